"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically and verified.

All ranks write one DCP checkpoint into a scratch folder. DCP spreads even replicated parameters over the
ranks' files, so a checkpoint needs every rank's file in one folder: after the save every rank checks that
it sees DCP's ``.metadata`` and every file that lists, at full size, and the verdicts are combined in one
collective, so when any rank cannot (the folder is not on storage every node sees) every rank raises the
same ``CheckpointError`` and nothing is published. Only then rank 0 renames the scratch folder to
``step_<n>`` and points ``latest`` at it (a write-and-rename), so a crash mid-save leaves the previous
checkpoint as the latest.

Loading verifies the same way first: ``latest`` and ``load`` name a corrupt folder and why, and
``load_newest_complete`` (``--resume``) falls back to the newest older checkpoint that verifies on every
rank, deciding the same on every rank. Parameters are replicated, so a checkpoint saved at one domain (or
dp) size loads at any other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from domainflow.errors import DomainflowError

SHARED_STORAGE = ("the checkpoint directory{} must be on storage every node can see (a shared filesystem): DCP "
                  "spreads even replicated parameters over the ranks' files, so every rank's file is needed")
_STEP = re.compile(r"step_\d+")


class CheckpointError(DomainflowError, RuntimeError):
    """A checkpoint is not visible to every rank, or is corrupt; the message names the folder and why."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj) -> list:
    """``obj`` from every rank of the world group, in rank order (the one collective of each decision)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def problems(path: Path, need_meta: bool = True, save_id: str | None = None) -> list[str]:
    """What is wrong with the checkpoint folder ``path`` as this process sees it ([] if nothing): its
    ``meta.json`` (when ``need_meta``), DCP's ``.metadata`` (from the save ``save_id`` when given) and every
    file that metadata references, each at least as long as the data it holds."""
    path = Path(path)
    if not path.is_dir():
        return ["the folder does not exist"]
    found = []
    if need_meta:
        try:
            int(json.loads((path / "meta.json").read_text())["step"])
        except FileNotFoundError:
            found.append("meta.json is missing")
        except (ValueError, KeyError, TypeError) as e:
            found.append(f"meta.json is unreadable ({type(e).__name__}: {e})")
    try:
        md = FileSystemReader(str(path)).read_metadata()
        need: dict[str, int] = {}
        for info in md.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    except FileNotFoundError:
        return found + [".metadata is missing"]
    except Exception as e:  # a garbled pickle can raise almost anything
        return found + [f".metadata is unreadable ({type(e).__name__}: {e})"]
    if save_id is not None and getattr(md.storage_meta, "save_id", None) != save_id:
        found.append(".metadata is left from another save")
    for name, size in sorted(need.items()):
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            found.append(f"{name} is missing")
            continue
        if have < size:
            found.append(f"{name} is truncated ({have} of {size} bytes)")
    return found


def _listing(items: list[str], most: int = 6) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _who_sees_what(views: list[tuple]) -> list[str]:
    """'rank(s) (host, folder): problems' for the ranks of ``views`` ((host, folder, problems) per rank) that
    found problems, ranks finding the same grouped; a folder is named only where it differs from rank 0's."""
    groups: dict[tuple, list[int]] = {}
    for r, (_, where, found) in enumerate(views):
        if found:
            groups.setdefault((where if where != views[0][1] else None, tuple(found)), []).append(r)
    lines = []
    for (where, found), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_listing([str(r) for r in ranks])}"
        place = _listing(sorted({views[r][0] for r in ranks}), 3) + (f", folder {where}" if where else "")
        lines.append(f"{who} ({place}): {_listing(list(found))}")
    return lines[:8] + ([f"and {len(lines) - 8} more groups of ranks"] if len(lines) > 8 else [])


def save(folder: Path, step: int, model, optimizer, cfg=None, inputs: dict | None = None) -> Path:
    """Save ``step`` under ``folder`` on every rank; published as ``latest`` only once every rank sees every
    rank's files there, else every rank raises a ``CheckpointError`` naming who misses what."""
    folder = Path(folder)
    final = folder / f"step_{step:08d}"
    scratch = folder / f".step_{step:08d}.partial"
    if _rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(scratch))
    _barrier()
    save_id = getattr(saved.storage_meta, "save_id", None)
    views = _gather((socket.gethostname(), str(scratch.resolve()),
                     problems(scratch, need_meta=False, save_id=save_id)))
    if any(found for _, _, found in views):
        where = Path(views[0][1])  # rank 0's, so that every rank raises the same message
        raise CheckpointError(
            f"checkpoint step {step} was not published: {SHARED_STORAGE.format(' ' + str(where.parent))}. Not "
            f"every rank sees every rank's files in {where}: {'; '.join(_who_sees_what(views))}. Set output.dir "
            f"(--out) to a folder on shared storage")
    if _rank() == 0:
        meta = {"step": step, "config": cfg.to_dict() if cfg is not None else None, "inputs": inputs}
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(scratch, final)
        tmp = folder / "latest.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, folder / "latest")
    _barrier()
    return final


def _is_checkpoint(path: Path) -> bool:
    return bool(_STEP.fullmatch(path.name) or (path / "meta.json").exists() or (path / ".metadata").exists())


def _candidates(folder: Path) -> list[Path]:
    """Checkpoints to try, best first: ``folder`` itself if it is one; else the one ``latest`` points at,
    then the older ``step_*`` folders, newest first (all ``step_*`` folders when there is no pointer)."""
    if _is_checkpoint(folder):
        return [folder]
    if not folder.is_dir():
        return []
    steps = sorted((p for p in folder.glob("step_*") if p.is_dir()), reverse=True)
    pointer = folder / "latest"
    if not pointer.exists():
        return steps
    head = folder / pointer.read_text().strip()
    return [head] + [p for p in steps if p.name < head.name]


def latest(folder: Path) -> Path | None:
    """The latest checkpoint under ``folder`` (or ``folder`` itself if it is one), else None. A corrupt one
    raises a ``CheckpointError`` naming it, why, and the newest older one that is complete."""
    tried = _candidates(Path(folder))
    if not tried:
        return None
    found = problems(tried[0])
    if found:
        older = next((p for p in tried[1:] if not problems(p)), None)
        raise CheckpointError(
            f"checkpoint {tried[0]} is corrupt: {_listing(found)}; the newest older complete checkpoint is "
            f"{older or 'none'}" + (" (--resume falls back to it; load it by passing its folder)" if older else ""))
    return tried[0]


def meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def _read_into(path: Path, model, optimizer) -> int:
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # a placeholder; its state is ignored
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state.get("optim", optim_sd))
    return int(meta(path)["step"])


def _verified_load(path: Path, model, optimizer) -> tuple[int | None, list[str]]:
    """Verify ``path`` on every rank, then load it: (its step, []) on every rank, or (None, why) on every rank
    when any rank finds it incomplete or fails to load it."""
    views = _gather((socket.gethostname(), str(Path(path).resolve()), problems(path)))
    why = _who_sees_what(views)
    if why:
        if any(views[r][2] != views[0][2] for r in range(len(views))):
            why.append(f"the ranks see different files: {SHARED_STORAGE.format('')}")
        return None, why
    try:
        step, error = _read_into(path, model, optimizer), None
    except (Exception, dcp.CheckpointException) as e:  # DCP's (a BaseException) reports a failure on every rank
        step, error = None, _short(e)
    errors = _gather(error)
    if any(errors):
        return None, [f"loading it failed: {_listing(list(dict.fromkeys(e for e in errors if e)), 3)}"]
    return step, []


def _short(e: BaseException) -> str:
    """One line per failure (DCP's own message holds every failing rank's whole traceback)."""
    if isinstance(e, dcp.CheckpointException):
        return ", ".join(f"rank {r}: {_short(x)}" for r, (x, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]}"


def load(path: Path, model, optimizer=None) -> int:
    """Load a checkpoint (a ``step_<n>`` folder, or the latest in a checkpoints folder) into ``model`` (and
    ``optimizer``) on every rank; returns its step. An incomplete or unreadable one raises a
    ``CheckpointError`` naming it, on every rank."""
    head = _gather([str(p) for p in _candidates(Path(path))[:1]])[0]  # rank 0's choice
    if not head:
        raise FileNotFoundError(f"{path} holds no domainflow checkpoint; pass a step_<n> folder or the "
                                f"checkpoints folder that holds them")
    step, why = _verified_load(Path(head[0]), model, optimizer)
    if step is None:
        raise CheckpointError(f"checkpoint {head[0]} is corrupt or unreadable: {'; '.join(why)}; load an older "
                              f"step_<n> folder, or --resume, which falls back to the newest complete one")
    return step


def load_newest_complete(folder: Path, model, optimizer) -> tuple[Path, int] | None:
    """Load the latest checkpoint under ``folder`` or, when it is incomplete or unreadable on any rank, the
    newest older one that loads on every rank, warning which was skipped and which is used; the same
    decision on every rank. (path, step), or None when there is no checkpoint; a ``CheckpointError``
    lists what was tried when none loads."""
    tried = [Path(p) for p in _gather([str(p) for p in _candidates(Path(folder))])[0]]  # rank 0's order
    skipped = []
    for path in tried:
        step, why = _verified_load(path, model, optimizer)
        if step is not None:
            if skipped and _rank() == 0:
                warnings.warn(f"checkpoint {'; '.join(skipped)}; resuming from {path} (step {step}) instead",
                              stacklevel=2)
            return path, step
        skipped.append(f"{path} is corrupt or unreadable ({'; '.join(why)})")
    if not tried:
        return None
    raise CheckpointError(f"no checkpoint under {folder} loads; tried: {'; '.join(skipped)}")
