"""Run ingest tasks with dask: the local scheduler by default, a ``dask.distributed`` cluster on request.

A grid ingest is one task per time block; a mesh run is a small graph (scan tasks per stretch of cells,
a partition task, a task per column, a task that publishes the run), so one huge run uses every worker.
Tasks return small summaries (statistics, sizes); the coordinator merges them in a fixed order, so results
do not depend on the number of workers or on completion order. ``workers == 1`` runs in this process (no pickling, no start-up
cost); more workers use dask's process pool, since VTK reading and compression hold the GIL.

Progress: the bar counts tasks (or what they weigh: a climate ingest's time steps), and tasks report the cells
they have gone through (``count_cells``, after every block) into one shared counter, so a single huge run shows
cells and cells/s as it goes. On a ``dask.distributed`` cluster the bar counts tasks (or weights) only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterable, Iterator

_cells = None  # a shared multiprocessing.Value while tasks run locally (in this process and its workers)
_POLL = 0.5  # seconds between progress updates from the counter


def count_cells(n: int) -> None:
    """Tell the progress bar that ``n`` more cells went through (no-op outside run_tasks)."""
    if _cells is not None:
        with _cells.get_lock():
            _cells.value += int(n)


def _cells_text(n: int, seconds: float) -> str:
    from tqdm import tqdm

    rate = tqdm.format_sizeof(n / seconds) if seconds > 0 else "?"
    return f"{n:,} cells, {rate} cells/s"  # a grid ingest counts grid points x time steps


@contextlib.contextmanager
def _cell_counter(bar, context):
    """A shared counter (workers inherit it) shown on ``bar`` every _POLL seconds and once at the end."""
    global _cells
    counter, stop, t0 = context.Value("q", 0), threading.Event(), time.perf_counter()
    # this process reads the count without the counter's lock: a worker killed while holding it (Ctrl-C, the
    # OOM killer) leaves it held for good, and reading under it hung the command at its end
    count = counter.get_obj()

    def show():
        bar.set_postfix_str(_cells_text(count.value, time.perf_counter() - t0), refresh=True)

    def poll():
        while not stop.wait(_POLL):
            show()

    before, _cells = _cells, counter
    thread = threading.Thread(target=poll, daemon=True, name="ingest-progress")
    if not bar.disable:
        thread.start()
    try:
        yield counter
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        if count.value:
            show()
        _cells = before


def run_tasks(func: Callable, calls: Iterable[tuple], *, workers: int = 1, scheduler: str | None = None,
              desc: str = "ingest", progress: bool = True, unit: str = "task", weights=None) -> Iterator:
    """Yield ``func(*args)`` for every ``args`` in ``calls`` as tasks finish, with a tqdm progress bar.

    An exception in a task propagates (after the tasks already running finish or are cancelled).
    """
    import dask

    calls = list(calls)
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    yield from run_graphs([dask.delayed(func, pure=False)(*args) for args in calls], workers=workers,
                          scheduler=scheduler, desc=desc, progress=progress, unit=unit, weights=weights)


def run_graphs(finals: list, *, workers: int = 1, scheduler: str | None = None, desc: str = "ingest",
               progress: bool = True, unit: str = "task", weights=None) -> Iterator:
    """Compute dask graphs (one ``Delayed`` per item: a run's last task, with the tasks it depends on) and
    yield each item's result; the bar counts items, or each item's weight in ``unit`` (a time block's steps).
    ``workers == 1``: item after item in this process. An exception in a task propagates (after the tasks
    already running finish or are cancelled)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if not finals:
        return
    from tqdm.auto import tqdm

    weight = dict(zip((t.key for t in finals), weights or [1] * len(finals)))
    bar = tqdm(total=sum(weight.values()), desc=desc, unit=unit, disable=not progress, leave=progress)
    try:
        if scheduler:
            yield from _distributed(finals, scheduler, bar, weight)
        else:
            yield from _local(finals, workers, bar, weight)
    finally:
        bar.close()


def _local(finals, workers, bar, weight):
    import multiprocessing

    context = multiprocessing.get_context(_start_method())
    with _cell_counter(bar, context) as counter:
        yield from _local_counted(finals, workers, bar, counter, weight)


def _local_counted(finals, workers, bar, counter, weight):
    import dask

    if workers == 1:
        with one_core():
            for final in finals:
                (out,) = dask.compute(final, scheduler="sync")
                bar.update(weight[final.key])
                yield out
        return
    from dask.callbacks import Callback

    class _Progress(Callback):
        def _posttask(self, key, result, dsk, state, worker_id):
            if key in weight:
                bar.update(weight[key])

    from concurrent.futures.process import BrokenProcessPool

    with worker_pool(workers, counter) as pool, _Progress():
        fed = _Fed(pool, 2 * workers)
        try:
            results = dask.compute(*finals, scheduler="processes", pool=fed, chunksize=1)  # one task per batch
        except BrokenProcessPool:  # the pool's "terminated abruptly" says neither why nor what to do
            error = _worker_died(list(fed.workers.values()), workers)
            _kill(pool, fed)  # the pool's exit waits for every worker: one that outlived its SIGTERM would hang it
            raise error from None
        except KeyboardInterrupt:  # Ctrl-C: now, not once the running tasks end (a huge run's take minutes)
            _kill(pool, fed)
            raise
    yield from results


def _kill(pool, fed) -> None:
    """SIGKILL the pool's workers still running: what they were writing is left as a killed ingest leaves it
    (unpublished, redone by the rerun)."""
    for p in {**fed.workers, **(getattr(pool, "_processes", None) or {})}.values():
        if p.exitcode is None:
            p.kill()
    # a worker killed while sending a result larger than a pipe holds (no ingest task returns one) leaves the
    # pool's thread waiting for the rest; with the workers gone, this process's write end of that pipe is the
    # last one, and closing it ends the wait
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()


def _worker_died(procs: list, workers: int):
    """The one-line error for a worker process that died: how (its exit status), what to lower, and that a
    rerun resumes. ``procs``: the pool's worker processes (once one is gone, the pool SIGTERMs the others)."""
    import signal
    import time

    from .errors import WorkerDiedError

    # the pool's own thread reaps its processes too: an exit status may show only a moment later
    deadline = time.monotonic() + 5
    while any(getattr(p, "exitcode", 0) is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    codes = [p.exitcode for p in procs if getattr(p, "exitcode", None) not in (None, 0)]
    # the cause before its consequences: a worker killed by a signal, not the pool's SIGTERM to the others nor
    # another's exit code 1 (its queue to this process broke when the pool did)
    code = next((c for c in codes if c < 0 and c != -signal.SIGTERM), next(
        (c for c in codes if c != -signal.SIGTERM), codes[0] if codes else None))
    if code is None:
        how = "died"
    elif code == -signal.SIGKILL:
        how = "was killed (SIGKILL, as the system ends a process when memory runs out)"
    elif code < 0:
        try:
            how = f"died of signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"died of signal {-code}"
    else:
        how = f"exited with code {code}"
    return WorkerDiedError(
        f"an ingest worker process {how}; if memory ran out, lower --workers (now {workers}; each worker holds "
        f"its task's data) or the memory a task takes (ingest cfd: --memory-limit; ingest climate: --time-block), "
        f"then rerun the same command: the store is left partial and valid, and the rerun resumes it")


class _Fed:
    """The pool as dask's local scheduler sees it: dask keeps ``_max_workers`` tasks in flight, so with one
    per worker a worker idles for the round trip to this process between tasks (about 3 ms, 136 times in an
    8-run ingest); with two per worker the next task already waits in the pool's queue."""

    def __init__(self, pool, in_flight: int):
        self._pool, self._max_workers = pool, in_flight
        self.workers: dict = {}  # every worker process the pool started (to tell how one died, see _worker_died)

    def submit(self, *args, **kw):
        future = self._pool.submit(*args, **kw)
        # CPython's pool keeps its processes in _processes and drops them once one dies: keep our own references
        self.workers.update(getattr(self._pool, "_processes", None) or {})
        return future


def _init_worker(counter=None):
    """One core per worker process: VTK's SMP filters and zarr's codec threads would otherwise each use
    every core, so N workers would oversubscribe the machine N-fold. On Linux a worker also dies with the
    ingest that started it (a ``kill -9`` of the command would otherwise leave its workers running). The
    progress counter comes along. Signals: the pool ends its workers with SIGTERM (once one has died), and a
    handler inherited from the parent (a job's preemption handler, torch's elastic launcher) would turn it into
    an exception that dask's task wrapper catches, leaving a worker that goes on and blocks the pool's exit;
    Ctrl-C reaches every process of the terminal's group, and is the parent's to handle (a worker would print
    its traceback under the command's one line)."""
    import signal

    global _cells
    _cells = counter
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_threads(1)
    _die_with_parent()


def _die_with_parent() -> None:
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _set_threads(n: int | None) -> tuple:
    """Set VTK's SMP threads and zarr's codec threads; returns the previous settings."""
    import zarr
    from vtkmodules.vtkCommonCore import vtkSMPTools

    before = (vtkSMPTools.GetEstimatedNumberOfThreads(), zarr.config.get("threading.max_workers"))
    vtkSMPTools.Initialize(n or 0)
    zarr.config.set({"threading.max_workers": n})
    return before


@contextlib.contextmanager
def one_core():
    """``--workers 1`` means one core, in this process, as each worker process gets."""
    before = _set_threads(1)
    try:
        yield
    finally:
        vtkthreads, zarr_workers = before
        _set_threads(vtkthreads)
        import zarr

        zarr.config.set({"threading.max_workers": zarr_workers})


def _start_method() -> str:
    import sys

    return "fork" if sys.platform.startswith("linux") else "spawn"


def worker_pool(workers: int, counter=None):
    """A process pool for dask's local scheduler. On Linux the workers fork from this process: no
    re-import of ``__main__`` (so ingest works from any script, guarded by ``if __name__ == "__main__"``
    or not) and no start-up import cost; zarr resets its event loop after a fork. Elsewhere: spawn."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    method = _start_method()
    if method == "fork":  # import the heavy readers once, here, instead of once per worker
        import importlib

        for module in ("pyvista", "zarr"):
            importlib.import_module(module)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker,
                               initargs=(counter,))


def _distributed(finals, address, bar, weight):
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise RuntimeError("--scheduler needs dask.distributed: pip install 'domainflow[cluster]'") from None
    try:
        client = Client(address, timeout="30s")
    except OSError as exc:
        raise RuntimeError(f"cannot reach the dask scheduler at {address!r} ({exc}); start one with "
                           f"`dask scheduler` and `dask worker ADDRESS`, or leave out --scheduler") from None
    try:
        futures = client.compute(finals)
        try:
            for fut in as_completed(futures):
                out = fut.result()
                bar.update(weight.get(fut.key, 1))
                yield out
        except BaseException:
            # no task of a failed ingest starts after it has returned (dask lets a running one finish)
            client.cancel(futures)
            raise
    finally:
        client.close()


def reset_peak_memory() -> int:
    """Start measuring a task's peak memory: reset the kernel's high-water mark (Linux) and return the
    resident size now, in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def release_free_memory() -> None:
    """Hand the heap that freed blocks left behind back to the OS (glibc ``malloc_trim``, as dask.distributed
    workers do), so a worker that has run many tasks holds what is live, not the largest task's heap."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory() -> int:
    """Peak resident size since :func:`reset_peak_memory` (Linux), else since the process started."""
    peak = _status_bytes("VmHWM")
    if peak:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
