"""Reusable multi-process test harness: a pool of worker processes with a real process group.

Parent side (pytest process)::

    pool = WorkerPool(4)                     # 4 workers, Gloo default process group each
    values = pool.run(rank_fn, x, k=2)       # rank_fn(x, k=2) on every rank, results in rank order
    pool.close()

``rank_fn`` must be a module-level function (it is sent by module + qualified name; the worker
imports its module, with the parent's ``sys.path``).  Arguments and return values are pickled;
returned tensors are detached and moved to the CPU.

Failures never hang:

* a rank that raises -> :class:`RankFailure` (an ``AssertionError``) with every failing rank's
  traceback; ranks still running ``grace`` seconds after the first failure (typically blocked in a
  collective the failed rank never joined) are reported with their stack and killed;
* a rank that dies (segfault, ``os._exit``) -> :class:`RankFailure` "rank N died with exit code X";
* ranks not done within the task timeout -> :class:`RankTimeout` naming each stuck rank, its
  current-operation note (:func:`set_current_op` / :func:`current_op`) and its Python stack.

After any failure that may have left the process group inconsistent, the pool is killed and
restarted lazily (fresh processes, fresh port) before the next ``run``.

Worker side helpers (for use inside rank functions): :func:`rank_and_world`,
:func:`set_current_op`, :func:`current_op`, :func:`worker_cache`, :func:`in_worker`.

Environment variables: ``DOMAINFLOW_TEST_PG_TIMEOUT`` (process-group timeout, s, default 30),
``DOMAINFLOW_TEST_TASK_TIMEOUT`` (default task timeout, s, default 60),
``DOMAINFLOW_TEST_GRACE`` (s to wait for other ranks after a failure, default 3),
``DOMAINFLOW_TEST_START_METHOD`` (``forkserver`` (default) or ``spawn``).

This module is independent of domainflow and imports torch lazily.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from typing import Any, Callable, Iterator

__all__ = [
    "WORLD_SIZES",
    "WorkerPool",
    "PoolCache",
    "DistTestError",
    "RankFailure",
    "RankTimeout",
    "PoolStartError",
    "get_pool",
    "close_all_pools",
    "rank_and_world",
    "set_current_op",
    "current_op",
    "get_current_op",
    "worker_cache",
    "in_worker",
]

#: World sizes tests should cover (3 catches "assumes a power of two" bugs).
WORLD_SIZES = (1, 2, 3, 4)

OP_SLOT_BYTES = 512
_STACK_WAIT_S = 0.5
_OUTPUT_TAIL_LINES = 40
_STACK_MAX_LINES = 40


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number") from None


def default_pg_timeout() -> float:
    return _env_float("DOMAINFLOW_TEST_PG_TIMEOUT", 30.0)


def default_task_timeout() -> float:
    return _env_float("DOMAINFLOW_TEST_TASK_TIMEOUT", 60.0)


def default_grace() -> float:
    return _env_float("DOMAINFLOW_TEST_GRACE", 3.0)


def default_start_method() -> str:
    return os.environ.get("DOMAINFLOW_TEST_START_METHOD", "forkserver").strip() or "forkserver"


# --------------------------------------------------------------------------------------------
# Errors


class DistTestError(AssertionError):
    """Base class of the harness' task errors (an AssertionError so pytest reports it as a failure)."""


class RankFailure(DistTestError):
    """One or more ranks raised or died.

    Attributes: ``failures`` {rank: report text}, ``ranks`` (sorted failing ranks, including ranks
    killed after the grace period), ``exit_codes`` {rank: exit code} for ranks that died.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None,
                 exit_codes: dict[int, int] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exit_codes = dict(exit_codes or {})
        self.ranks = sorted(self.failures)


class RankTimeout(DistTestError):
    """Ranks did not finish within the task timeout.

    Attributes: ``ranks`` (sorted stuck ranks), ``ops`` {rank: current-op note}, ``stacks``
    {rank: Python stack text}, ``timeout`` (s).
    """

    def __init__(self, message: str, ops: dict[int, str] | None = None,
                 stacks: dict[int, str] | None = None, timeout: float | None = None):
        super().__init__(message)
        self.ops = dict(ops or {})
        self.stacks = dict(stacks or {})
        self.ranks = sorted(self.ops)
        self.timeout = timeout


class PoolStartError(RuntimeError):
    """The worker processes could not be started / could not form the process group."""


# --------------------------------------------------------------------------------------------
# Worker-side state and helpers


class _WorkerState:
    def __init__(self, rank: int, world_size: int, op_slot):
        self.rank = rank
        self.world_size = world_size
        self.op_slot = op_slot
        self.cache: dict[Any, Any] = {}
        self.error_op: str | None = None  # op note active where the current task raised


_WORKER: _WorkerState | None = None
_LOCAL_OP = ""  # current-op note when called outside a worker
_PARENT_CACHE: dict[Any, Any] = {}


def in_worker() -> bool:
    """True inside a pool worker process."""
    return _WORKER is not None


def rank_and_world() -> tuple[int, int]:
    """(rank, world_size) of this worker; outside a worker, of the initialised default group."""
    if _WORKER is not None:
        return _WORKER.rank, _WORKER.world_size
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    raise RuntimeError("rank_and_world(): not in a pool worker and no default process group")


def _write_slot(slot, text: str) -> None:
    data = text.encode("utf-8", "replace")[: OP_SLOT_BYTES - 1]
    slot[: len(data) + 1] = data + b"\0"


def _read_slot(slot) -> str:
    raw = bytes(slot[:])
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def set_current_op(text: str) -> None:
    """Record what this rank is doing now (shown if the rank gets stuck). Cheap; no-op-ish outside workers."""
    global _LOCAL_OP
    text = "" if text is None else str(text)
    if _WORKER is not None:
        _write_slot(_WORKER.op_slot, text)
    else:
        _LOCAL_OP = text


def get_current_op() -> str:
    if _WORKER is not None:
        return _read_slot(_WORKER.op_slot)
    return _LOCAL_OP


@contextlib.contextmanager
def current_op(text: str) -> Iterator[None]:
    """Context manager: set the current-op note for the block, restore the previous one after."""
    previous = get_current_op()
    set_current_op(text)
    try:
        yield
    except BaseException:
        if _WORKER is not None and _WORKER.error_op is None:
            _WORKER.error_op = str(text)  # innermost note wins
        raise
    finally:
        set_current_op(previous)


def worker_cache(key: Any, factory: Callable[[], Any]) -> Any:
    """Per-process cache surviving across tasks (e.g. device meshes); cleared when the pool restarts."""
    cache = _WORKER.cache if _WORKER is not None else _PARENT_CACHE
    try:
        return cache[key]
    except KeyError:
        value = cache[key] = factory()
        return value


# --------------------------------------------------------------------------------------------
# Pickling helpers


def _fn_spec(fn: Callable) -> tuple:
    if isinstance(fn, types.FunctionType):
        qual = fn.__qualname__
        if "<locals>" in qual or "<lambda>" in qual:
            raise TypeError(
                f"WorkerPool.run: {fn.__module__}.{qual} is a lambda or nested function; rank "
                "functions must be defined at module level (they are sent by reference)")
        module = sys.modules.get(fn.__module__)
        file = getattr(module, "__file__", None)
        return ("ref", fn.__module__, qual, file)
    try:
        return ("pickle", pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:
        raise TypeError(f"WorkerPool.run: cannot pickle {fn!r}: {exc}") from exc


def _fn_name(spec: tuple, fn: Callable | None = None) -> str:
    if spec[0] == "ref":
        return f"{spec[1]}.{spec[2]}"
    return repr(fn)


_TEST_FILE_PREFIX = "test_"


def _load_module_from_file(name: str, file: str) -> types.ModuleType:
    """Load ``file`` as module ``name`` (pytest assertion rewriting for test files, best effort)."""
    parent = name.rpartition(".")[0]
    if parent:
        with contextlib.suppress(ImportError):
            importlib.import_module(parent)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {file!r}")
    module = importlib.util.module_from_spec(spec)
    code = None
    base = os.path.basename(file)
    if base.endswith(".py") and (base.startswith(_TEST_FILE_PREFIX) or base.endswith("_test.py")):
        try:
            import ast

            from _pytest.assertion.rewrite import rewrite_asserts

            with open(file, "rb") as fh:
                source = fh.read()
            tree = ast.parse(source, filename=file)
            rewrite_asserts(tree, source, file, None)
            code = compile(tree, file, "exec", dont_inherit=True)
        except Exception:
            code = None
    sys.modules[name] = module
    try:
        if code is not None:
            exec(code, module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _resolve_fn(spec: tuple) -> Callable:
    if spec[0] == "pickle":
        return pickle.loads(spec[1])
    _, modname, qual, file = spec
    module = sys.modules.get(modname)
    if module is None:
        base = os.path.basename(file or "")
        is_test_file = base.startswith(_TEST_FILE_PREFIX) or base.endswith("_test.py")
        if file and modname != "__main__" and is_test_file and os.path.exists(file):
            # Load test modules ourselves so their asserts get pytest's rewriting.
            module = _load_module_from_file(modname, file)
        else:
            try:
                module = importlib.import_module(modname)
            except ModuleNotFoundError as exc:
                # e.g. pytest --import-mode=importlib names that are not importable by name.
                if file and exc.name == modname and os.path.exists(file):
                    module = _load_module_from_file(modname, file)
                else:
                    raise
    obj: Any = module
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


class _ResultPickler(pickle.Pickler):
    """Pickles return values, sending tensors detached and on the CPU."""

    def reducer_override(self, obj):  # noqa: D401 - pickle hook
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            cls = type(obj)
            if cls is torch.nn.Parameter or (cls is torch.Tensor and (
                    obj.requires_grad or obj.device.type != "cpu")):
                return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _dumps_result(value: Any) -> bytes:
    buf = io.BytesIO()
    _ResultPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# Worker process


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _redirect_output(out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        with contextlib.suppress(OSError):
            os.dup2(fd, target)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)


def _is_outcome(exc: BaseException) -> str | None:
    """'skip' / 'xfail' for pytest skip/xfail outcome exceptions, else None."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is None:
        return None
    if isinstance(exc, getattr(outcomes, "Skipped", ())):
        return "skip"
    if isinstance(exc, getattr(outcomes, "XFailed", ())):
        return "xfail"
    return None


_STACK_FILE = None  # keeps the faulthandler file open


def _worker_main(rank: int, world_size: int, port: int, conn, op_slot, stack_path: str,
                 out_path: str, pg_timeout: float, backend: str) -> None:
    global _WORKER, _STACK_FILE
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    _set_pdeathsig()
    _redirect_output(out_path)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _STACK_FILE = open(stack_path, "a")
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True, chain=False)

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "DOMAINFLOW_TEST_WORKER": "1",
    })
    _WORKER = _WorkerState(rank, world_size, op_slot)

    try:
        from datetime import timedelta

        import torch
        import torch.distributed as tdist

        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        set_current_op(f"init_process_group({backend!r}) on tcp://127.0.0.1:{port}")
        tdist.init_process_group(
            backend, rank=rank, world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=pg_timeout))
        set_current_op("")
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("start_error", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    conn.send(("ready", os.getpid()))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        msg = pickle.loads(data)
        if msg[0] == "stop":
            break
        if msg[0] == "task":
            reply = _run_task(torch, *msg[1:])
            try:
                conn.send_bytes(reply)
            except (EOFError, OSError):
                break
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Skip destroy_process_group and interpreter teardown (torch/gloo static destructors can be
    # slow or noisy; peers may be gone already).
    os._exit(0)


def _run_task(torch, task_id: int, fnspec: tuple, sys_path, cwd, payload: bytes) -> bytes:
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    phase = "load"
    set_current_op("")
    if _WORKER is not None:
        _WORKER.error_op = None
    try:
        if sys_path is not None:
            sys.path[:] = sys_path
        if cwd is not None and cwd != os.getcwd():
            os.chdir(cwd)
        fn = _resolve_fn(fnspec)
        args, kwargs = pickle.loads(payload)
        phase = "call"
        result = fn(*args, **(kwargs or {}))
        phase = "result"
        try:
            blob = _dumps_result(result)
        except Exception as exc:
            raise TypeError(
                f"return value of the rank function is not picklable ({type(result).__name__}): "
                f"{exc}. Return plain tensors / Python values (e.g. .to_local() or .full_tensor() "
                "of distributed tensors).") from exc
        reply = ["ok", task_id, blob]
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = exc.__traceback__
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next  # drop this harness frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        outcome = _is_outcome(exc)
        try:
            summary = f"{type(exc).__name__}: {exc}"
        except Exception:
            summary = type(exc).__name__
        op = (_WORKER.error_op if _WORKER is not None else None) or get_current_op()
        reply = ["err", task_id, (phase, text, summary, outcome, op)]
    finally:
        with contextlib.suppress(Exception):
            torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        set_current_op("")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    # A task that destroyed the default process group leaves this worker unusable: say so.
    reply.append(bool(torch.distributed.is_initialized()))
    return pickle.dumps(tuple(reply), protocol=pickle.HIGHEST_PROTOCOL)


# --------------------------------------------------------------------------------------------
# Parent side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_FORKSERVER_LOCK = threading.Lock()
_STARTED_FORKSERVER = False  # this module started the fork server (stop it at exit)
# model libraries the model-zoo tests import on every rank: imported once by the fork server instead
# (model_libraries.py: only what the nets use)
_MODEL_LIBRARIES = ("model_libraries",)
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


def _get_context(method: str):
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        with _FORKSERVER_LOCK:
            from multiprocessing import forkserver

            if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
                from domainflow.train.run import COMPILE_MODULES, RANK_MODULES

                # what the workers and the ranks of launch_local (which uses this server too) import, once; the
                # compiler's modules too (in this suite, many workers and ranks compile)
                preload = ["__main__", "torch", "torch.distributed", "faulthandler", *RANK_MODULES,
                           *COMPILE_MODULES, *_MODEL_LIBRARIES]
                if __name__ != "__main__":
                    preload.append(__name__)
                ctx.set_forkserver_preload(preload)
                # The fork server's environment is what every forked worker inherits: one thread
                # per BLAS/OpenMP pool.  Set it only while the server starts. PYTHONPATH: Python 3.11's fork
                # server ignores the sys.path it is sent, so without it the harness modules above (this one,
                # model_libraries) would be skipped as missing and imported again by every worker.
                saved = {k: os.environ.get(k) for k in
                         ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONPATH")}
                try:
                    for k in saved:
                        os.environ[k] = "1"
                    os.environ["PYTHONPATH"] = os.pathsep.join(
                        [_HARNESS_DIR, *([saved["PYTHONPATH"]] if saved["PYTHONPATH"] else [])])
                    forkserver.ensure_running()
                    global _STARTED_FORKSERVER
                    _STARTED_FORKSERVER = True
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
    return ctx


def _tail(text: str, lines: int = _OUTPUT_TAIL_LINES) -> str:
    parts = text.rstrip("\n").splitlines()
    if len(parts) > lines:
        parts = [f"... ({len(parts) - lines} earlier lines)"] + parts[-lines:]
    return "\n".join(parts)


def _read_file(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _trim_stack(text: str) -> str:
    """Keep faulthandler's frames from user code, drop the harness and multiprocessing frames; the thread
    that was running the task comes first (others, e.g. a reader's prefetch thread, after it)."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
    blocks.sort(key=lambda b: not (b and b[0].startswith("Current thread")))
    out = []
    for line in (line for b in blocks for line in b):
        s = line.strip()
        if s.startswith("File ") and (os.sep + "multiprocessing" + os.sep in s
                                      or os.path.basename(__file__) in s
                                      and ("_worker_main" in s or "_run_task" in s)):
            continue
        if s == 'File "<string>", line 1 in <module>':
            continue  # the fork server / spawn bootstrap
        out.append(line)
    if len(out) > _STACK_MAX_LINES:
        out = out[:_STACK_MAX_LINES] + [f"  ... ({len(out) - _STACK_MAX_LINES} more lines)"]
    return "\n".join(out)


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


_ALL_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


class WorkerPool:
    """``world_size`` worker processes, each rank of one real default process group.

    Parameters: ``timeout`` default task timeout (s; env DOMAINFLOW_TEST_TASK_TIMEOUT, 60),
    ``pg_timeout`` process-group timeout (s; env DOMAINFLOW_TEST_PG_TIMEOUT, 30), ``grace`` (s to
    wait for the other ranks once one failed; env DOMAINFLOW_TEST_GRACE, 3), ``backend`` ("gloo"),
    ``start_method`` ("forkserver" or "spawn"; env DOMAINFLOW_TEST_START_METHOD), ``start``
    (start processes now rather than at the first ``run``), ``relay_output`` (re-print the ranks'
    stdout/stderr of each task to this process' stdout, lines prefixed ``[rank r]``).
    """

    def __init__(self, world_size: int, timeout: float | None = None, *,
                 pg_timeout: float | None = None, grace: float | None = None,
                 backend: str = "gloo", start_method: str | None = None,
                 start: bool = True, relay_output: bool = True,
                 start_timeout: float | None = None):
        if int(world_size) < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.timeout = float(timeout) if timeout is not None else default_task_timeout()
        self.pg_timeout = float(pg_timeout) if pg_timeout is not None else default_pg_timeout()
        self.grace = float(grace) if grace is not None else default_grace()
        self.backend = backend
        self.start_method = start_method or default_start_method()
        self.relay_output = relay_output
        self.start_timeout = (float(start_timeout) if start_timeout is not None
                              else max(60.0, self.pg_timeout + 30.0))
        self.starts = 0  # how many times processes were (re)started
        self._procs: list = []
        self._conns: list = []
        self._slots: list = []
        self._tmpdir: str | None = None
        self._needs_restart = False
        self._closed = False
        self._task_id = 0
        self._sent_sys_path: list | None = None
        self._sent_cwd: str | None = None
        self._lock = threading.RLock()
        self.port: int | None = None
        _ALL_POOLS.add(self)
        if start:
            self.start()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and not self._needs_restart and all(
            p.exitcode is None for p in self._procs)

    def _paths(self, rank: int) -> tuple[str, str]:
        assert self._tmpdir is not None
        return (os.path.join(self._tmpdir, f"rank{rank}.stack"),
                os.path.join(self._tmpdir, f"rank{rank}.out"))

    def start(self) -> None:
        """Start the worker processes (no-op when running and healthy)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            if self.alive:
                return
            self._kill()
            last_error: Exception | None = None
            for _attempt in range(3):
                try:
                    self._start_once()
                    return
                except _PortInUse as exc:
                    last_error = exc
                    self._kill()
            raise PoolStartError(f"could not start {self.world_size} workers: {last_error}")

    def _start_once(self) -> None:
        ctx = _get_context(self.start_method)
        if self._tmpdir is None or not os.path.isdir(self._tmpdir):
            self._tmpdir = tempfile.mkdtemp(prefix=f"dist_pool_w{self.world_size}_")
        self.port = port = _free_port()
        self._procs, self._conns, self._slots = [], [], []
        self._sent_sys_path = None
        self._sent_cwd = None
        self.starts += 1
        t0 = time.monotonic()
        for rank in range(self.world_size):
            stack_path, out_path = self._paths(rank)
            for path in (stack_path, out_path):
                open(path, "wb").close()
            slot = ctx.Array("c", OP_SLOT_BYTES, lock=False)
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main, name=f"dist_pool-w{self.world_size}-r{rank}",
                args=(rank, self.world_size, port, child_conn, slot, stack_path, out_path,
                      self.pg_timeout, self.backend),
                daemon=False)  # not daemonic: rank functions may start their own processes
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._slots.append(slot)

        pending = set(range(self.world_size))
        errors: dict[int, str] = {}
        deadline = t0 + self.start_timeout
        while pending and not errors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {}
            for r in pending:
                waitables[self._conns[r]] = r
                waitables[self._procs[r].sentinel] = r
            for obj in multiprocessing.connection.wait(list(waitables), timeout=remaining):
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self._conns[r]
                msg = None
                try:
                    if conn.poll():
                        msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == "ready":
                    pending.discard(r)
                elif msg is not None and msg[0] == "start_error":
                    errors[r] = msg[1]
                    pending.discard(r)
                else:
                    self._procs[r].join(1.0)
                    code = self._procs[r].exitcode
                    errors[r] = f"worker exited with code {code}{_signal_name(code)} during start-up"
                    pending.discard(r)
        if not pending and not errors:
            self._needs_restart = False
            return
        self._kill()
        text = "\n".join(errors.values())
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise _PortInUse(f"port {port} in use")
        parts = [f"could not start a {self.world_size}-rank {self.backend} pool "
                 f"({self.start_method}, port {port}):"]
        for r in sorted(errors):
            parts.append(f"--- rank {r}: {errors[r]}")
        for r in sorted(pending):
            parts.append(f"--- rank {r}: not ready after {time.monotonic() - t0:.1f} s"
                         + (" (start-up aborted)" if errors else ""))
        for r in range(self.world_size):
            out = _read_file(self._paths(r)[1]).strip()
            if out:
                parts.append(f"--- rank {r} output:\n{_tail(out)}")
        raise PoolStartError("\n".join(parts))

    def restart(self) -> None:
        """Kill the workers and start fresh ones (new port)."""
        with self._lock:
            self._kill()
            self.start()

    def _kill(self) -> None:
        """Kill all workers immediately and reap them."""
        for proc in self._procs:
            with contextlib.suppress(Exception):
                if proc.exitcode is None:
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.join(5.0)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.close()
        self._procs, self._conns, self._slots = [], [], []
        self._needs_restart = True

    def close(self, timeout: float = 2.0) -> None:
        """Stop the workers (politely, then by force) and remove the pool's temp files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stop = pickle.dumps(("stop",))
            for conn in self._conns:
                with contextlib.suppress(Exception):
                    conn.send_bytes(stop)
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                with contextlib.suppress(Exception):
                    proc.join(max(0.0, deadline - time.monotonic()))
            self._kill()
            if self._tmpdir is not None:
                import shutil

                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None
            _ALL_POOLS.discard(self)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close(timeout=0.5)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.alive else "stopped")
        return f"<WorkerPool world_size={self.world_size} {state} pids={self.pids}>"

    # -- running tasks -----------------------------------------------------------------------

    def run(self, fn: Callable, /, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        return self.run_task(fn, args, kwargs, timeout=timeout)

    def run_task(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                 timeout: float | None = None) -> list:
        """Like :meth:`run`, with explicit ``args``/``kwargs`` (so ``fn`` may take a ``timeout``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            spec = _fn_spec(fn)
            payload = pickle.dumps((tuple(args), dict(kwargs or {})),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            self.start()
            timeout = self.timeout if timeout is None else float(timeout)
            try:
                return self._run_locked(spec, _fn_name(spec, fn), payload, timeout)
            except BaseException as exc:
                if not isinstance(exc, DistTestError) and _is_outcome(exc) is None:
                    # Interrupted (Ctrl-C, pytest-timeout, ...) mid-task: the ranks are in an
                    # unknown state.
                    self._kill()
                raise

    def _run_locked(self, spec: tuple, name: str, payload: bytes, timeout: float) -> list:
        ws = self.world_size
        self._task_id += 1
        task_id = self._task_id
        sys_path = list(sys.path)
        send_path = sys_path if sys_path != self._sent_sys_path else None
        cwd = os.getcwd()
        send_cwd = cwd if cwd != self._sent_cwd else None
        msg = pickle.dumps(("task", task_id, spec, send_path, send_cwd, payload),
                           protocol=pickle.HIGHEST_PROTOCOL)
        for r in range(ws):
            with contextlib.suppress(OSError):
                os.truncate(self._paths(r)[1], 0)

        t0 = time.monotonic()
        results: dict[int, Any] = {}
        errors: dict[int, tuple] = {}   # rank -> (phase, traceback, summary, outcome)
        died: dict[int, int | None] = {}
        pg_lost: list[int] = []
        first_failure: float | None = None
        for r in range(ws):
            try:
                self._conns[r].send_bytes(msg)
            except (OSError, EOFError):
                died[r] = self._exit_code(r)
                first_failure = first_failure or time.monotonic()
        self._sent_sys_path = sys_path
        self._sent_cwd = cwd

        pending = set(range(ws)) - set(died)
        deadline = t0 + timeout
        while pending:
            limit = deadline if first_failure is None else min(deadline, first_failure + self.grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables = {}
            for r in pending:
                waitables[self._conns[r]] = r
                waitables[self._procs[r].sentinel] = r
            for obj in multiprocessing.connection.wait(list(waitables), timeout=remaining):
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self._conns[r]
                reply = None
                try:
                    if conn.poll():
                        reply = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    reply = None
                if reply is None:
                    died[r] = self._exit_code(r)
                elif reply[1] != task_id:
                    continue  # stale (cannot happen: the pool restarts after failures)
                elif reply[0] == "ok":
                    try:
                        results[r] = pickle.loads(reply[2])
                    except Exception:
                        errors[r] = ("result", traceback.format_exc(),
                                     "could not unpickle the return value", None, "")
                else:
                    errors[r] = reply[2]
                if reply is not None and not reply[3]:
                    pg_lost.append(r)
                pending.discard(r)
                if (r in died or r in errors) and first_failure is None:
                    first_failure = time.monotonic()
        elapsed = time.monotonic() - t0

        stuck = sorted(pending)
        ops: dict[int, str] = {}
        stacks: dict[int, str] = {}
        if stuck:
            ops, stacks = self._inspect(stuck)
        outputs = self._collect_output()

        failed = bool(stuck or died or errors)
        if pg_lost:
            self._kill()  # rank(s) destroyed the default process group: fresh workers next time
        if not failed:
            return [results[r] for r in range(ws)]

        # All ranks skipped / xfailed consistently: propagate the pytest outcome.
        outcomes = {e[3] for e in errors.values()}
        if not stuck and not died and len(errors) == ws and len(outcomes) == 1 and None not in outcomes:
            import pytest

            reason = errors[0][2].split(": ", 1)[-1]
            if outcomes == {"skip"}:
                pytest.skip(f"[all ranks] {reason}")
            pytest.xfail(f"[all ranks] {reason}")

        if stuck or died or any(e[0] == "call" for e in errors.values()):
            self._kill()  # the process group may be inconsistent: fresh processes next time
        return self._raise(name, timeout, elapsed, results, errors, died, stuck, ops, stacks,
                           outputs)

    def _exit_code(self, rank: int) -> int | None:
        proc = self._procs[rank]
        with contextlib.suppress(Exception):
            proc.join(2.0)
        return proc.exitcode

    def _inspect(self, ranks: list[int]) -> tuple[dict[int, str], dict[int, str]]:
        """Current-op notes and Python stacks (via faulthandler on SIGUSR1) of running ranks."""
        ops = {r: _read_slot(self._slots[r]) for r in ranks}
        signalled = []
        for r in ranks:
            path = self._paths(r)[0]
            with contextlib.suppress(OSError):
                os.truncate(path, 0)
            proc = self._procs[r]
            if proc.exitcode is None:
                with contextlib.suppress(Exception):
                    os.kill(proc.pid, signal.SIGUSR1)
                    signalled.append(r)
        stacks = {}
        if signalled:
            deadline = time.monotonic() + 2 * _STACK_WAIT_S
            time.sleep(_STACK_WAIT_S)
            while True:
                stacks = {r: _read_file(self._paths(r)[0]) for r in signalled}
                if all(stacks.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        # op notes may have changed while we waited; prefer the fresher one if set
        for r in ranks:
            now = _read_slot(self._slots[r])
            if now:
                ops[r] = now
        return ops, {r: _trim_stack(s) for r, s in stacks.items()}

    def _collect_output(self) -> dict[int, str]:
        outputs = {}
        for r in range(self.world_size):
            text = _read_file(self._paths(r)[1]) if self._tmpdir else ""
            outputs[r] = text
            if text and self.relay_output:
                lines = text.rstrip("\n").splitlines()
                with contextlib.suppress(Exception):
                    sys.stdout.write("".join(f"[rank {r}] {line}\n" for line in lines))
                    sys.stdout.flush()
        return outputs

    def _raise(self, name, timeout, elapsed, results, errors, died, stuck, ops, stacks, outputs):
        ws = self.world_size

        def stuck_block(r: int, header: str) -> str:
            op = ops.get(r) or "(no op note set; see dist_pool.current_op)"
            block = [f"===== rank {r} {header}, stuck in: {op}"]
            if stacks.get(r):
                block.append(f"Python stack of rank {r} (most recent call first):")
                block.append(stacks[r])
            else:
                block.append("(no stack dump obtained)")
            return "\n".join(block)

        def output_block(r: int) -> str:
            out = outputs.get(r, "").strip()
            return f"----- rank {r} output -----\n{_tail(out)}" if out else ""

        if not errors and not died:
            parts = [f"RankTimeout: {name} on {ws} ranks: rank(s) {stuck} did not finish within "
                     f"{timeout:g} s (killed; the pool restarts for the next run). "
                     f"Finished: {sorted(results)}."]
            for r in stuck:
                parts.append(f"rank {r} stuck in: {ops.get(r) or '(no op note set)'}")
            for r in stuck:
                parts.append(stuck_block(r, f"did not finish within {timeout:g} s"))
                if output_block(r):
                    parts.append(output_block(r))
            raise RankTimeout("\n".join(parts), ops=ops, stacks=stacks, timeout=timeout)

        failures: dict[int, str] = {}
        blocks: list[str] = []
        shown_tb: dict[str, int] = {}  # traceback text -> first rank that showed it
        for r in range(ws):
            if r in errors:
                phase, tb, summary, _outcome, op = errors[r]
                where = {"load": " (while loading the function / arguments)",
                         "result": " (while sending the return value)"}.get(phase, "")
                if op:
                    where += f"\nrank {r} raised while in: {op}"
                text = f"===== rank {r} raised {summary}{where}\n{tb.rstrip()}"
                if tb in shown_tb:
                    short = (f"===== rank {r} raised {summary}{where} "
                             f"(same traceback as rank {shown_tb[tb]})")
                    out = output_block(r)
                    failures[r] = text + ("\n" + out if out else "")
                    blocks.append(short + ("\n" + out if out else ""))
                    continue
                shown_tb[tb] = r
            elif r in died:
                code = died[r]
                text = (f"===== rank {r} died with exit code {code}{_signal_name(code)}")
            elif r in stuck:
                text = stuck_block(
                    r, f"still running {self.grace:g} s after the failure (killed)")
            else:
                continue
            out = output_block(r)
            if out:
                text += "\n" + out
            failures[r] = text
            blocks.append(text)
        summary_bits = []
        if errors:
            summary_bits.append(f"rank(s) {sorted(errors)} raised")
        if died:
            summary_bits.append("; ".join(
                f"rank {r} died with exit code {c}{_signal_name(c)}" for r, c in sorted(died.items())))
        if stuck:
            summary_bits.append(f"rank(s) {stuck} stuck and killed")
        header = (f"RankFailure: {name} on {ws} ranks failed after {elapsed:.1f} s: "
                  + "; ".join(summary_bits) + ".")
        raise RankFailure("\n".join([header] + blocks), failures=failures,
                          exit_codes={r: c for r, c in died.items()})


class _PortInUse(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Pool cache (one pool per world size)


class PoolCache:
    """Lazily creates and keeps one :class:`WorkerPool` per world size.

    ``run(world_size, fn, *args, timeout=None, **kwargs)`` runs on that pool.  Extra keyword
    arguments given to the constructor are passed to every ``WorkerPool``.
    """

    def __init__(self, **pool_kwargs):
        self.pool_kwargs = pool_kwargs
        self._pools: dict[int, WorkerPool] = {}
        self._lock = threading.Lock()

    def pool(self, world_size: int) -> WorkerPool:
        with self._lock:
            pool = self._pools.get(world_size)
            if pool is None or pool._closed:
                pool = self._pools[world_size] = WorkerPool(world_size, **self.pool_kwargs)
            return pool

    def run(self, world_size: int, fn: Callable, /, *args, timeout: float | None = None,
            **kwargs) -> list:
        return self.pool(world_size).run_task(fn, args, kwargs, timeout=timeout)

    def run_task(self, world_size: int, fn: Callable, args: tuple = (),
                 kwargs: dict | None = None, *, timeout: float | None = None) -> list:
        return self.pool(world_size).run_task(fn, args, kwargs, timeout=timeout)

    __call__ = run

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


_DEFAULT_CACHE: PoolCache | None = None


def get_pool(world_size: int) -> WorkerPool:
    """Process-wide cached pool for ``world_size`` (for scripts/benchmarks; closed at exit)."""
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is None:
        _DEFAULT_CACHE = PoolCache()
    return _DEFAULT_CACHE.pool(world_size)


def close_all_pools() -> None:
    """Close every pool still open in this process."""
    global _DEFAULT_CACHE
    if _DEFAULT_CACHE is not None:
        _DEFAULT_CACHE.close()
        _DEFAULT_CACHE = None
    for pool in list(_ALL_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


def _at_exit() -> None:
    close_all_pools()
    if _STARTED_FORKSERVER:
        # Stop (and reap) the fork server we started, so nothing outlives the session.
        with contextlib.suppress(Exception):
            from multiprocessing import forkserver

            forkserver._forkserver._stop()


atexit.register(_at_exit)
