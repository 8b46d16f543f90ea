"""Run ingest tasks with dask: the local scheduler by default, a ``dask.distributed`` cluster on request.

One task per run (meshes) or per time block (grids). Tasks are independent and return small summaries
(statistics, sizes); the coordinator merges them in a fixed order, so results do not depend on the
number of workers or on completion order. ``workers == 1`` runs in this process (no pickling, no start-up
cost); more workers use dask's process pool, since VTK reading and compression hold the GIL.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator


def run_tasks(func: Callable, calls: Iterable[tuple], *, workers: int = 1, scheduler: str | None = None,
              desc: str = "ingest", progress: bool = True) -> Iterator:
    """Yield ``func(*args)`` for every ``args`` in ``calls`` as tasks finish, with a tqdm progress bar.

    An exception in a task propagates (after the tasks already running finish or are cancelled).
    """
    calls = list(calls)
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if not calls:
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=len(calls), desc=desc, unit="task", disable=not progress, leave=progress)
    try:
        if scheduler:
            yield from _distributed(func, calls, scheduler, bar)
        else:
            yield from _local(func, calls, workers, bar)
    finally:
        bar.close()


def _local(func, calls, workers, bar):
    if workers == 1:
        with one_core():
            for args in calls:
                out = func(*args)
                bar.update(1)
                yield out
        return
    import dask
    from dask.callbacks import Callback

    class _Progress(Callback):
        def _posttask(self, key, result, dsk, state, worker_id):
            if key in keys:
                bar.update(1)

    tasks = [dask.delayed(func, pure=False)(*args) for args in calls]
    keys = {t.key for t in tasks}
    with worker_pool(workers) as pool, _Progress():
        results = dask.compute(*tasks, scheduler="processes", pool=pool, chunksize=1)  # one run per batch
    yield from results


def _init_worker():
    """One core per worker process: VTK's SMP filters and zarr's codec threads would otherwise each use
    every core, so N workers would oversubscribe the machine N-fold. On Linux a worker also dies with the
    ingest that started it (a ``kill -9`` of the command would otherwise leave its workers running)."""
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


def worker_pool(workers: int):
    """A process pool for dask's local scheduler. On Linux the workers fork from this process: no
    re-import of ``__main__`` (so ingest works from any script, guarded by ``if __name__ == "__main__"``
    or not) and no start-up import cost; zarr resets its event loop after a fork. Elsewhere: spawn."""
    import multiprocessing
    import sys
    from concurrent.futures import ProcessPoolExecutor

    method = "fork" if sys.platform.startswith("linux") else "spawn"
    if method == "fork":  # import the heavy readers once, here, instead of once per worker
        import importlib

        for module in ("pyvista", "zarr"):
            importlib.import_module(module)
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_init_worker)


def _distributed(func, calls, address, bar):
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
        futures = [client.submit(func, *args, pure=False) for args in calls]
        for fut in as_completed(futures):
            out = fut.result()
            bar.update(1)
            yield out
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
