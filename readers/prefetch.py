"""Read ahead on a background thread with bounded memory.

``Prefetcher(loads, depth)`` calls each ``load()`` in order on one thread, at most ``depth`` results ahead
of the consumer, and yields the results in the same order, so the same seed gives the same samples with
and without prefetch. Zarr and numpy release the GIL while reading and decoding, so reads overlap with
the training step. An exception in a load is raised in the consumer at that position. The thread starts
at construction, so a dataset can start reading its next epoch before the loop asks for it.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Callable, Iterable

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Iterate ``load()`` results, computed up to ``depth`` items ahead (``depth <= 0``: inline); ``loads`` is
    iterated once, as the reads go (a generator stays lazy)."""

    def __init__(self, loads: Iterable[Callable[[], object]], depth: int):
        self.depth = depth
        self._loads = loads
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._q: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._produce, name="domainflow-prefetch", daemon=True)
            self._thread.start()

    def _produce(self):
        try:
            for load in self._loads:
                if self._stop.is_set():
                    return
                if not self._put(load()):
                    return
        except BaseException as exc:  # noqa: BLE001  (handed to the consumer)
            self._put(_Failure(exc))
            return
        self._put(_DONE)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        if self._thread is None:
            for load in self._loads:
                yield load()
            return
        try:
            while True:
                item = self._q.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading ahead (the thread ends within a load)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def prefetched(loads: Iterable[Callable[[], object]], depth: int):
    """Shorthand: iterate a :class:`Prefetcher`."""
    return iter(Prefetcher(loads, depth))


class EpochStream:
    """Epoch iteration shared by the datasets: each full pass advances ``epoch`` (``set_epoch`` overrides
    it), and with prefetch on, the next epoch's first samples are read while the current one finishes."""

    def __init__(self):
        self.epoch = 0
        self._ahead = None  # (epoch, Prefetcher) started speculatively at the end of the last pass

    def samples(self, entries, depth: int | None = None, **read):
        """The wrapped samples of ``entries`` ((key, weight) or (key, weight, epoch), in order), read up to
        ``depth`` ahead on a background thread (default: the dataset's ``prefetch``); ``read``: more
        ``read_region`` arguments. The one way the trainer, the metrics and predict read samples."""
        loads = (functools.partial(self.read_region, e[0], e[1], **({"epoch": e[2]} if len(e) > 2 else {}), **read)
                 for e in entries)  # lazily: entries may be a long run's schedule, made as it is read
        source = Prefetcher(loads, self.prefetch if depth is None else depth)
        try:
            for raw in source:
                yield self.wrap(raw)
        finally:
            source.close()

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` next (same seed and epoch: the same order in every run)."""
        self.epoch = int(epoch)

    def _iterate(self, loads_for, wrap, depth: int):
        epoch = self.epoch
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] != epoch:
            ahead[1].close()
            ahead = None
        source = ahead[1] if ahead is not None else Prefetcher(loads_for(epoch), depth)
        n = len(source._loads)  # loads_for gives a list: one epoch's reads
        for k, raw in enumerate(source):
            if depth > 0 and k == max(0, n - depth) and self._ahead is None:
                # this epoch's reads are (nearly) all done: start the next epoch's while the last steps compute
                self._ahead = (epoch + 1, Prefetcher(loads_for(epoch + 1), depth))
            yield wrap(raw)
        self.epoch = epoch + 1
        if depth > 0 and self._ahead is None:
            self._ahead = (self.epoch, Prefetcher(loads_for(self.epoch), depth))
