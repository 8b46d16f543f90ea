"""Start local ranks with torch's elastic launcher, so users never write a launch script.

A rank that fails with an error meant for the user (a ``DomainflowError``: a bad store, config or checkpoint,
a collective that timed out; or an ``OSError``) prints nothing itself: it leaves its message for the launcher,
which raises :class:`LaunchError` with the first rank's message on one line instead of torch's page of
tracebacks. Bugs (any other exception) keep their traceback; ``DOMAINFLOW_TRACEBACK=1`` shows it for every
error. Ctrl-C stops every
rank and ends in a KeyboardInterrupt in the caller.

A local launch listens on loopback only: its one store (the agent's and, shared, the ranks') is bound to
127.0.0.1 by the ``domainflow-local`` rendezvous handler registered here, and the ranks' Gloo pairs and NCCL
bootstrap use the loopback interface. A multi-node job started by the user's torchrun keeps its own addresses.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from domainflow.errors import DomainflowError

_ERRORS_ENV = "DOMAINFLOW_LAUNCH_ERRORS"
_RDZV_BACKEND = "domainflow-local"
# what torch's elastic agent sets for each rank (besides TORCHELASTIC_*): the rank's own values win
_SET_BY_AGENT = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                           "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                           "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
# variables a process reads when it starts (the C library's), which a forked rank cannot take any more
_READ_AT_START = ("MALLOC_", "LD_", "GLIBC_TUNABLES")


class LaunchError(DomainflowError, RuntimeError):
    """A launched rank failed; the message is the first failing rank's own (one line)."""


def under_launcher() -> bool:
    """True inside a rank started by torchrun / the elastic launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch_local(fn: Callable, nproc: int, *args, threads_per_rank: int | None = None,
                 env: dict[str, str | None] | None = None, start_method: str = "forkserver",
                 preload: Sequence[str] = ()) -> dict[int, object]:
    """Run ``fn(*args)`` on ``nproc`` local ranks (a module-level function); return {rank: result}.

    Each rank gets the usual torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``domainflow.init_mesh`` finds it, and this process's environment and ``sys.path`` as they are at the
    call. CPU threads are split between ranks unless given. ``env``: variables set (or, with None, removed) for
    the ranks only. ``start_method``: ``"forkserver"`` (the ranks fork from one server process that imported
    torch once, so N ranks start in about the time of one import) or ``"spawn"`` (a fresh interpreter per
    rank: needed for variables read at a process's start, such as glibc's ``MALLOC_*``). ``preload``: modules
    the ranks will import, imported once in the fork server instead of in every rank (when this call starts it).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from domainflow.layout.mesh import LOOPBACK_ENV

    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"launch_local: start_method={start_method!r}; use 'forkserver' or 'spawn'")
    at_start = sorted(k for k in (env or {}) if k.startswith(_READ_AT_START))
    if at_start and start_method != "spawn":
        raise ValueError(f"launch_local: {', '.join(at_start)} are read when a process starts, and forked ranks "
                         "have started already; pass start_method='spawn'")
    if threads_per_rank is not None:
        threads = str(threads_per_rank)
    else:  # an OMP_NUM_THREADS the user set wins over the even split
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    _register_loopback_rendezvous()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"domainflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend=_RDZV_BACKEND, rdzv_endpoint="", max_restarts=0, monitor_interval=0.1,
        start_method=start_method,
    )
    if start_method == "forkserver":  # started before the ranks' variables are set
        _fork_server(preload)
    errors = tempfile.mkdtemp(prefix="domainflow-launch-")
    # the ranks' Gloo / NCCL sockets on loopback too, whatever interface a cluster profile names
    extra = {"OMP_NUM_THREADS": threads, _ERRORS_ENV: errors, **LOOPBACK_ENV, **(env or {})}
    saved = {k: os.environ.get(k) for k in [*extra, "TORCHELASTIC_SIGNALS_TO_HANDLE"]}  # the last set by torch
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
    # a forked rank's parent is the fork server, not this process: the end of this pipe's write side (this
    # process exiting, killed or not) is how the ranks learn that their launcher is gone
    lifeline_r, lifeline_w = os.pipe()
    setup = {"environ": dict(os.environ), "sys_path": list(sys.path), "stdio": _LauncherStdio(),
             "lifeline": _Lifeline(lifeline_r)}
    handlers = _signal_handlers()
    try:
        return elastic_launch(config, _rank_entry)(setup, fn, *args)
    except ChildFailedError as exc:
        raise LaunchError(_first_failure(exc, Path(errors))) from None
    except SignalException as exc:
        raise KeyboardInterrupt(str(exc)) from None
    finally:
        for sig, handler in handlers.items():  # the agent's, which turn them into exceptions, stay behind
            signal.signal(sig, handler)
        os.close(lifeline_r)
        os.close(lifeline_w)
        for q, level in zip(quiet, levels):
            q.setLevel(level)
        shutil.rmtree(errors, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _signal_handlers() -> dict:
    """This process's handlers of the signals torch's elastic agent takes over (in the main thread only) and
    never gives back: they raise an exception in whatever this process does next, even in its forks."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    sigs = [getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)]
    return {sig: h for sig in sigs if (h := signal.getsignal(sig)) is not None}  # None: not set from Python


_SERVER_MODULES = ("torch", "torch.distributed")


def _fork_server(preload: Sequence[str]) -> None:
    """Start multiprocessing's fork server, once, importing torch and ``preload``: the ranks fork from it with
    those imports done, which would otherwise cost every rank seconds of CPU. A server already running is used
    as it is (stopping one waits for every process that inherited its pipe, forked pool workers included). It
    keeps this process's environment as it is now for whatever else forks from it later; a caller's own preload
    list stays, bar ``__main__``."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None:
        listed = [m for m in server._preload_modules if m != "__main__"]
        multiprocessing.set_forkserver_preload([*listed, *(m for m in (*_SERVER_MODULES, *preload) if m not in listed)])
    forkserver.ensure_running()


def _loopback_store(timeout_s: float = 300.0):
    """A TCPStore server listening on 127.0.0.1 only (given a host, TCPStore itself binds every interface)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    # the store takes the bound socket over (and closes it with the server)
    return TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(),
                    timeout=timedelta(seconds=timeout_s))


def _register_loopback_rendezvous() -> None:
    """Register the one-machine rendezvous with torch's elastic launcher (a no-op the second time)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_RDZV_BACKEND, _create_loopback_rendezvous)


def _create_loopback_rendezvous(params):
    """The rendezvous handler of one local launch (torch's registry calls this with the launch's parameters)."""
    return _loopback_rendezvous_class()(params.run_id)


@functools.cache
def _loopback_rendezvous_class():
    """Defined on first use, so that importing this module does not import torch."""
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousHandler, RendezvousInfo,
                                                      RendezvousStoreInfo)

    class LoopbackRendezvous(RendezvousHandler):
        """The rendezvous of a one-machine launch: one agent (the launcher), so no barrier to run; one store
        on 127.0.0.1, the agent's and, shared, the ranks' (torch's c10d handler binds both of its stores to
        every interface)."""

        def __init__(self, run_id: str):
            self._run_id, self._store, self._closed = run_id, None, False

        def get_backend(self) -> str:
            return _RDZV_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self):
            if self._closed:
                raise RendezvousClosedError(f"the local launch {self._run_id} has ended")
            if self._store is None:
                self._store = _loopback_store()
            agent = PrefixStore(f"torch.rendezvous.{self._run_id}", self._store)
            return RendezvousInfo(agent, 0, 1, RendezvousStoreInfo("127.0.0.1", self._store.port))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._closed, self._store = True, None
            return True

    return LoopbackRendezvous


def _rank_entry(setup: dict, fn: Callable, *args):
    """What each launched rank runs: ``fn(*args)``, with user-facing errors left as one line for the launcher."""
    _take_launcher_state(setup)
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.signal(signal.SIGTERM, _interrupt_once)
    try:
        return fn(*args)
    except KeyboardInterrupt:
        _drop_pending_reads_quietly()
        sys.exit(130)
    except (DomainflowError, OSError) as exc:
        folder = os.environ.get(_ERRORS_ENV)
        if folder is None:
            raise
        if os.environ.get("DOMAINFLOW_TRACEBACK"):  # asked for: printed as a bug's is (nothing else shows it)
            _print_traceback()
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
        # a bug, not a user error: its traceback is what "its output above says why" points at
        _print_traceback()
        raise


class _LauncherStdio:
    """This process's stdout and stderr as they are at the launch, for the ranks to print to: a forked rank's
    are the fork server's, fixed when it started. Sent with the ranks' arguments as duplicated descriptors
    (multiprocessing's ``DupFd``); unpickling it in a rank points the rank's descriptors 1 and 2 at them."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _attach_stdio, tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2))


class _Lifeline:
    """The read end of a pipe whose write end only the launching process holds: sent to each rank as a
    duplicated descriptor."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _watch_lifeline, (reduction.DupFd(self.fd),)


def _watch_lifeline(dup) -> None:
    """In a rank: when the launcher is gone (its end of the pipe closed: it exited, or was killed), stop as
    Ctrl-C would, and for good after 10 s (a rank blocked in a collective does not see the interrupt)."""
    import threading

    fd = dup.detach()

    def watch():
        while os.read(fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        os._exit(130)

    threading.Thread(target=watch, name="domainflow-lifeline", daemon=True).start()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # e.g. a daemon that closed its stdout: the ranks keep the server's
        return False
    return True


def _attach_stdio(out, err) -> None:
    for fd, dup, name in ((1, out, "stdout"), (2, err, "stderr")):
        if dup is None:
            continue
        stream = getattr(sys, name)
        if stream is not None:
            stream.flush()
        got = dup.detach()
        if got != fd:  # a spawned rank is handed the same descriptor numbers
            os.dup2(got, fd)
            os.close(got)
        if stream is None:  # the server started without this stream
            setattr(sys, name, open(fd, "w", buffering=1, closefd=False))


def _take_launcher_state(setup: dict) -> None:
    """The launching process's environment, ``sys.path`` and thread count in this rank: a forked rank starts
    from the fork server's, fixed when the server started (an earlier launch in the same process, say); the
    variables the elastic agent sets for this rank (RANK, MASTER_PORT, ...) stay."""
    import torch

    agent = {k: v for k, v in os.environ.items() if k in _SET_BY_AGENT or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(setup["environ"])
    os.environ.update(agent)
    sys.path[:] = setup["sys_path"]
    threads = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
    if threads.isdigit() and int(threads) > 0:  # a forked rank's torch loaded before its OMP_NUM_THREADS was set
        torch.set_num_threads(int(threads))
    _reread_import_time_settings()


def _reread_import_time_settings() -> None:
    """Settings that libraries the fork server imported read from the environment then (fsspec's ``FSSPEC_*``,
    zarr's ``ZARR_*``), read again from this rank's: a remote store's endpoint set for this launch must count."""
    fsspec_config = sys.modules.get("fsspec.config")
    if fsspec_config is not None:
        fsspec_config.conf.clear()
        fsspec_config.conf_dir = os.environ.get("FSSPEC_CONFIG_DIR", fsspec_config.default_conf_dir)
        fsspec_config.set_conf_files(fsspec_config.conf_dir, fsspec_config.conf)
        fsspec_config.set_conf_env(fsspec_config.conf, os.environ)
    zarr = sys.modules.get("zarr")
    if zarr is not None:
        zarr.config.refresh()


def _print_traceback() -> None:
    """The exception being handled, with its chain, on this rank's stderr: the elastic agent's own report of it
    is silenced (see launch_local), and spawn's is not always shown."""
    print(f"[rank {os.environ.get('RANK', '0')}] " + traceback.format_exc(), file=sys.stderr, flush=True)


def _drop_pending_reads_quietly() -> None:
    """A rank leaving on an error or Ctrl-C: zarr reads still in flight on its event loop (a prefetch) are
    dropped at exit, and asyncio would log "Task was destroyed but it is pending!" (or Python warn "coroutine
    'AsyncArray._get_selection' was never awaited", when Ctrl-C lands between a read's creation and its start)
    under the one-line message; what happened is reported already."""
    import warnings

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def _interrupt_once(signum, frame):
    """Ctrl-C or SIGTERM (a scheduler preempting the job) in a rank: the terminal or the scheduler and the
    launcher each pass it on; a second one during clean-up would interrupt the clean-up and print a traceback,
    so both are ignored from then on. Ending by the exception, not by the signal, also runs the rank's exit
    clean-up (a rank killed by SIGTERM left the launcher a "leaked semaphore" warning under the one line).
    Ignored by a handler that does nothing, not SIG_IGN: a second signal that arrived before this one's handler
    ran is still due, and Python finding SIG_IGN in its place prints *OSError: Signal 15 ignored due to race
    condition* with a traceback (SIGTERM to the job's processes and the launcher's forwarded one, together)."""
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _ignore_signal)
    raise KeyboardInterrupt


def _ignore_signal(signum, frame) -> None:
    """A signal after the first (see _interrupt_once): nothing to do."""


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
