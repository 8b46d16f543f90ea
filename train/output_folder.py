"""A training owns its output folder: an exclusive lock while it runs, and no fresh start over another
training's checkpoints.

The lock (``flock`` on ``<out>/.domainflow-train.lock``, ``domainflow.locks``) is taken by the process that
starts the job (the launcher of local ranks, or rank 0 under torchrun) and dies with it, so two trainings
never write one ``metrics.jsonl`` or move each other's ``latest``. A folder that already holds checkpoints
takes a fresh run only with ``--overwrite``; ``--resume`` continues it. What ``--overwrite`` replaces is
removed only once the new run has started (``clear``, after its model, data and any ``--init-from`` weights are
in place), so a run refused for any reason leaves the old one whole.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from domainflow.locks import FileLock, LockHeld, LocksUnsupported

from .config import ConfigError

LOCK = ".domainflow-train.lock"
# what a training writes into its folder (``--overwrite`` removes these, and nothing else)
WRITTEN = ("checkpoints", "metrics.jsonl", "result.json", "config.json", "tensorboard", "mlruns", "mlflow_run.json",
           "loss.png", "surface_cp.png", "rmse_by_lead.png")
WRITTEN_GLOBS = ("map_*.png",)


class OutputFolderError(ConfigError):
    """The output folder is in use by another training, or holds one that this run would silently mix with."""


def checkpoint_steps(out: Path) -> list[str]:
    """The ``step_*`` checkpoint folders under ``out/checkpoints``, oldest first."""
    folder = Path(out) / "checkpoints"
    return sorted(p.name for p in folder.glob("step_*") if p.is_dir()) if folder.is_dir() else []


def claim(out, resume: bool = False, overwrite: bool = False, init_from=None) -> FileLock | None:
    """Take ``out`` for one training: its lock (held by the returned FileLock until released or this process
    ends; None where the filesystem has no locks, warned), then the rule for what it holds. Nothing is removed
    here (see :func:`clear`)."""
    out = Path(out)
    if resume and overwrite:
        raise OutputFolderError("--resume continues the training in the output folder and --overwrite replaces it; "
                                "give one of them")
    if overwrite and init_from is not None and _inside(Path(init_from), out):
        raise OutputFolderError(f"--init-from {init_from} lies in the output folder {out} that --overwrite replaces; "
                                f"copy that checkpoint elsewhere first, or set another output.dir (--out)")
    out.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out / LOCK)
    try:
        lock.acquire()
    except LockHeld as exc:
        raise OutputFolderError(f"output.dir {out} is in use by another training ({exc.holder}); wait for it to end "
                                f"or set another output.dir (--out)") from None
    except LocksUnsupported:
        warnings.warn(f"{out}: the filesystem has no file locks, so nothing stops a second training from writing "
                      f"into this folder at the same time", stacklevel=2)
        lock = None
    try:
        _check_contents(out, resume, overwrite)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _check_contents(out: Path, resume: bool, overwrite: bool) -> None:
    steps = checkpoint_steps(out)
    if steps and not resume and not overwrite:
        raise OutputFolderError(
            f"output.dir {out} already holds the checkpoints of a training ({', '.join(steps[-3:])}); add --resume to "
            f"continue it, --overwrite to replace it, or set another output.dir (--out)")


def clear(out) -> None:
    """Remove what a training wrote into ``out`` (``--overwrite``, once the new run has started), and nothing
    else: the lock file stays."""
    out = Path(out)
    for name in WRITTEN:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for pattern in WRITTEN_GLOBS:
        for p in out.glob(pattern):
            p.unlink()
