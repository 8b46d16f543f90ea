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

Nothing is trusted blindly (``checkpoint_files``): a published checkpoint carries ``manifest.json`` with every
file's SHA-256, checked before it loads (the ranks split the hashing), so a flipped bit is a named error and
``--resume`` falls back past it; DCP's pickled metadata is read by an unpickler that admits only DCP's own
classes, so a crafted checkpoint cannot run code. A save that fails on any rank (a full disk) removes its
scratch folder and raises one ``CheckpointError`` on every rank, the previous checkpoint staying the latest.
"""

from __future__ import annotations

import errno
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from domainflow.errors import DomainflowError

from .checkpoint_files import (MANIFEST, SafePlanner, SafeReader, UnsafeCheckpoint, digest, manifest_problems,
                               not_plain, own_files, plain_name, read_metadata, write_manifest)

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


def problems(path: Path, need_meta: bool = True, save_id: str | None = None,
             share: tuple[int, int] | None = None, hashes: bool = True) -> list[str]:
    """What is wrong with the checkpoint folder ``path`` as this process sees it ([] if nothing): its
    ``meta.json`` (when ``need_meta``), DCP's ``.metadata`` (from the save ``save_id`` when given), every file
    that metadata references, each at least as long as the data it holds, and (published checkpoints) every
    file against ``manifest.json``: sizes, and (``hashes``) the SHA-256 of this rank's ``share`` (rank, world)
    of the files."""
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
    if need_meta:
        checked = manifest_problems(path, share, hashes)
        if checked:
            return found + checked
    try:
        md = read_metadata(path)
        need: dict[str, int] = {}
        for info in md.storage_data.values():
            if not plain_name(info.relative_path):
                return found + [f".metadata names a file outside the checkpoint folder ({info.relative_path!r})"]
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    except FileNotFoundError:
        return found + [".metadata is missing"]
    except UnsafeCheckpoint as e:
        return found + [f".metadata is refused: {e}"]
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


def save(folder: Path, step: int, model, optimizer, cfg=None, record: dict | None = None) -> Path:
    """Save ``step`` under ``folder`` on every rank; published as ``latest`` only once every rank sees every
    rank's files there, with a manifest of their checksums, else every rank raises a ``CheckpointError`` naming
    who misses what. ``record``: what else ``meta.json`` keeps (the run's identity, its normalisation)."""
    folder = Path(folder)
    final = folder / f"step_{step:08d}"
    scratch = folder / f".step_{step:08d}.partial"

    def prepare():
        if _rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(scratch, ignore_errors=True)
    _together(prepare, folder, step, scratch)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    bad = not_plain({"model": model_sd, "optim": optim_sd})
    if bad:  # the same state on every rank: every rank refuses
        raise CheckpointError(f"checkpoint step {step} was not saved: its state {bad} is not a tensor or a plain value, "
                              f"which a checkpoint cannot hold (it is loaded with weights_only=True, so it can never "
                              f"run code); return tensors or plain Python values from it (e.g. get_extra_state)")
    saved = _together(lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(scratch)),
                      folder, step, scratch)
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
    mine = _together(lambda: {n: digest(scratch / n) for n in own_files(scratch, _rank())}, folder, step, scratch)
    digests = {k: v for part in _gather(mine) for k, v in part.items()}

    def publish():
        if _rank() != 0:
            return
        meta = {"step": step, "config": cfg.to_dict() if cfg is not None else None, **(record or {})}
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(scratch, digests)
        if final.exists():
            shutil.rmtree(final)
        os.replace(scratch, final)
        tmp = folder / "latest.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, folder / "latest")
    _together(publish, folder, step, scratch)
    return final


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _no_space(e: BaseException) -> bool:
    """``e`` (or a rank's failure inside DCP's error, or its cause) says the disk or quota is full."""
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        return True
    if isinstance(e, dcp.CheckpointException):
        return any(_no_space(x) for x, _ in e.failures.values())
    cause = e.__cause__ or e.__context__
    return cause is not None and _no_space(cause)


def _together(step_fn, folder: Path, step: int, scratch: Path):
    """Run one part of a save on this rank; when it fails on any rank, remove the scratch folder and raise the
    same ``CheckpointError`` on every rank (a full disk says what to do), the last checkpoint staying latest."""
    try:
        value, error = step_fn(), None
    except (Exception, dcp.CheckpointException) as e:  # DCP's error is a BaseException
        value, error = None, (_short(e), _no_space(e))
    errors = [(r, e) for r, e in enumerate(_gather(error)) if e is not None]
    if not errors:
        return value
    if _rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)  # frees the space the partial save took
    try:
        last = _candidates(folder)[:1]
    except OSError:
        last = []
    kept = f"the newest checkpoint is still {last[0]}" if last else "no checkpoint was saved before"
    r, (message, full) = errors[0]
    if not message.startswith("rank "):  # DCP's own error names its ranks already
        message = f"rank {r}: {message}"
    if any(full for _, (_, full) in errors):
        raise CheckpointError(
            f"checkpoint step {step} could not be saved in {folder}: no space left on its disk ({message}); "
            f"{kept}. Free space there (or set output.dir elsewhere) and rerun with --resume")
    raise CheckpointError(f"checkpoint step {step} could not be saved in {folder}: {message}; {kept}")


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
    found = problems(tried[0], hashes=False)  # sizes and metadata: the bytes' hashes are checked by the load
    if found:
        older = next((p for p in tried[1:] if not problems(p, hashes=False)), None)
        raise CheckpointError(
            f"checkpoint {tried[0]} is corrupt: {_listing(found)}; the newest older complete checkpoint is "
            f"{older or 'none'}" + (" (--resume falls back to it; load it by passing its folder)" if older else ""))
    return tried[0]


def meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def head_meta(folder: Path) -> dict | None:
    """``meta.json`` of the newest checkpoint under ``folder`` whose meta reads, as rank 0 sees it, on every rank
    (None when there is none): what a resume checks and adopts before it loads."""
    found = None
    if _rank() == 0:
        for path in _candidates(Path(folder)):
            try:
                found = meta(path)
                break
            except (OSError, ValueError):
                continue
    return _gather(found)[0]


def _read_into(path: Path, model, optimizer) -> int:
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # a placeholder; its state is ignored
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state.get("optim", optim_sd))
    return int(meta(path)["step"])


def _verified_load(path: Path, model, optimizer) -> tuple[int | None, list[str]]:
    """Verify ``path`` on every rank, then load it: (its step, []) on every rank, or (None, why) on every rank
    when any rank finds it incomplete or fails to load it."""
    share = (_rank(), dist.get_world_size()) if dist.is_initialized() else None
    views = _gather((socket.gethostname(), str(Path(path).resolve()), problems(path, share=share)))
    why = _who_sees_what(views)
    if why:
        seen = [[f for f in found if "SHA-256" not in f] for _, _, found in views]  # hashing is split over ranks
        if any(seen[r] != seen[0] for r in range(len(seen))):
            why.append(f"the ranks see different files: {SHARED_STORAGE.format('')}")
        return None, why
    try:
        step, error = _read_into(path, model, optimizer), None
    except (Exception, dcp.CheckpointException) as e:  # DCP's (a BaseException) reports a failure on every rank
        step, error = None, _short(e)
    errors = _gather(error)
    if any(errors):
        return None, [f"loading it failed: {_listing(list(dict.fromkeys(e for e in errors if e)), 3)}"]
    if _rank() == 0 and not (Path(path) / MANIFEST).exists():
        warnings.warn(f"checkpoint {path} has no {MANIFEST} (saved before checkpoints carried checksums): its bytes "
                      f"are not verified", stacklevel=3)
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
        older = _gather(_older_complete(Path(head[0])) if _rank() == 0 else None)[0]
        hint = (f"the newest older complete checkpoint is {older} (load it by passing its folder; --resume falls back "
                f"to it)" if older else "load an older step_<n> folder, or --resume, which falls back to the newest "
                "complete one")
        raise CheckpointError(f"checkpoint {head[0]} is corrupt or unreadable: {'; '.join(why)}; {hint}")
    return step


def _older_complete(path: Path) -> str | None:
    """The newest ``step_*`` beside ``path`` and older than it whose files are all there at their sizes."""
    if not _STEP.fullmatch(path.name):
        return None
    older = sorted((p for p in path.parent.glob("step_*") if p.is_dir() and p.name < path.name), reverse=True)
    return next((str(p) for p in older if not problems(p, hashes=False)), None)


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
