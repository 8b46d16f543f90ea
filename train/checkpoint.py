"""Checkpoints with torch.distributed.checkpoint (DCP), written atomically.

All ranks write one DCP checkpoint into a scratch folder (replicated parameters are stored once); rank 0
then renames it to ``step_<n>`` and points ``latest`` at it (a write-and-rename), so a crash mid-save
leaves the previous checkpoint as the latest. Parameters are replicated, so a checkpoint saved at one
domain (or dp) size loads at any other.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(folder: Path, step: int, model, optimizer, cfg=None) -> Path:
    folder = Path(folder)
    final = folder / f"step_{step:08d}"
    scratch = folder / f".step_{step:08d}.partial"
    if _rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(scratch))
    _barrier()
    if _rank() == 0:
        meta = {"step": step, "config": cfg.to_dict() if cfg is not None else None}
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(scratch, final)
        tmp = folder / "latest.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, folder / "latest")
    _barrier()
    return final


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (or ``folder`` itself if it is one), else None."""
    folder = Path(folder)
    if (folder / "meta.json").exists():
        return folder
    pointer = folder / "latest"
    if pointer.exists():
        path = folder / pointer.read_text().strip()
        if (path / "meta.json").exists():
            return path
    done = sorted(p for p in folder.glob("step_*") if (p / "meta.json").exists()) if folder.exists() else []
    return done[-1] if done else None


def meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def load(path: Path, model, optimizer=None) -> int:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns its step."""
    path = Path(path)
    if not (path / "meta.json").exists():
        raise FileNotFoundError(f"{path} is not a complete domainflow checkpoint (no meta.json); pass a "
                                f"step_<n> folder or the checkpoints folder that holds them")
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
