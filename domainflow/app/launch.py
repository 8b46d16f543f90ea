"""Start local ranks with torch's elastic launcher, so users never write a launch script.

A rank that fails with an error meant for the user (a ``DomainflowError``: a bad store, config or checkpoint,
a collective that timed out; or an ``OSError``) prints nothing itself: it leaves its message for the launcher,
which raises :class:`LaunchError` with the first rank's message on one line instead of torch's page of
tracebacks. Bugs (any other exception) keep their traceback; ``DOMAINFLOW_TRACEBACK=1`` shows it for every
error. Ctrl-C stops every
rank and ends in a KeyboardInterrupt in the caller.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from domainflow.errors import DomainflowError

_ERRORS_ENV = "DOMAINFLOW_LAUNCH_ERRORS"


class LaunchError(DomainflowError, RuntimeError):
    """A launched rank failed; the message is the first failing rank's own (one line)."""


def under_launcher() -> bool:
    """True inside a rank started by torchrun / the elastic launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch_local(fn: Callable, nproc: int, *args, threads_per_rank: int | None = None,
                 env: dict[str, str | None] | None = None) -> dict[int, object]:
    """Run ``fn(*args)`` on ``nproc`` local ranks (a module-level function); return {rank: result}.

    Each rank gets the usual torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``domainflow.init_mesh`` finds it. CPU threads are split between ranks unless given. ``env``: variables
    set (or, with None, removed) for the ranks only, e.g. glibc's allocator settings, read at their start.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if threads_per_rank is not None:
        threads = str(threads_per_rank)
    else:  # an OMP_NUM_THREADS the user set wins over the even split
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"domainflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn",
    )
    errors = tempfile.mkdtemp(prefix="domainflow-launch-")
    extra = {"OMP_NUM_THREADS": threads, _ERRORS_ENV: errors, **(env or {})}
    saved = {k: os.environ.get(k) for k in extra}
    for k, v in extra.items():  # the spawned ranks inherit these; this process gets its own back
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    # their warnings and errors repeat, at length, what the failing rank's own message says
    quiet = [logging.getLogger(n) for n in ["torch.distributed.elastic", "torch.multiprocessing"] + [
        n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic.", "torch.multiprocessing."))]]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, _rank_entry)(fn, *args)
    except ChildFailedError as exc:
        raise LaunchError(_first_failure(exc, Path(errors))) from None
    except SignalException as exc:
        raise KeyboardInterrupt(str(exc)) from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        shutil.rmtree(errors, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_entry(fn: Callable, *args):
    """What each launched rank runs: ``fn(*args)``, with user-facing errors left as one line for the launcher."""
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        return fn(*args)
    except KeyboardInterrupt:
        _drop_pending_reads_quietly()
        sys.exit(130)
    except (DomainflowError, OSError) as exc:
        folder = os.environ.get(_ERRORS_ENV)
        if folder is None or os.environ.get("DOMAINFLOW_TRACEBACK"):
            raise
        record = {"rank": int(os.environ.get("RANK", "0")), "time": time.time(), "type": type(exc).__name__,
                  "message": str(exc)}
        path = Path(folder) / f"rank{record['rank']}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        os.replace(path.with_suffix(".tmp"), path)
        _drop_pending_reads_quietly()
        # out without the interpreter's teardown: with a process group still up, destroying gloo's threads at
        # exit sometimes aborts ("terminate called without an active exception") under the one-line message
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except Exception:
        # a bug, not a user error: its traceback is what "its output above says why" points at, so print it
        # here (the elastic agent's own report of it is silenced above, and spawn's is not always shown)
        print(f"[rank {os.environ.get('RANK', '0')}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        raise


def _drop_pending_reads_quietly() -> None:
    """A rank leaving on an error or Ctrl-C: zarr reads still in flight on its event loop (a prefetch) are
    dropped at exit, and asyncio would log "Task was destroyed but it is pending!" under the one-line
    message; what happened is reported already."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def _interrupt_once(signum, frame):
    """Ctrl-C in a rank: the terminal and the launcher both pass it on; a second one during clean-up would
    interrupt the clean-up and print a traceback, so it is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _first_failure(exc, folder: Path) -> str:
    """One line for a failed launch: the root-cause rank's message. A rank's own error beats a collective
    error of its peers (which waited for it), and the earliest one wins."""
    records = []
    for p in folder.glob("rank*.json"):
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if records:
        records.sort(key=lambda r: (r["type"] == "CollectiveError", r["time"]))
        first = records[0]
        others = len({r["rank"] for r in records}) - 1
        text = " ".join(first["message"].split())  # every line (a timeout's "Likely cause" is on the second)
        prefix = f"rank {first['rank']}: "
        more = f" ({others} other rank(s) failed too)" if others else ""
        return (text if text.startswith(prefix) else prefix + text) + more
    rank, failure = exc.get_first_failure()
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return f"rank {rank} died ({how}); its output above says why"
