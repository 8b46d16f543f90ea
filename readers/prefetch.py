"""Read ahead on a background thread with bounded memory.

``prefetched(loads, depth)`` calls each ``load()`` in order on one thread, at most ``depth`` results ahead of
the consumer, and yields the results in the same order; so the same seed gives the same samples with and
without prefetch. Zarr and numpy release the GIL while reading and decoding, so the reads overlap with the
training step. An exception in a load is raised in the consumer at that position.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def prefetched(loads: Iterable[Callable[[], object]], depth: int) -> Iterator:
    """Yield ``load()`` for each load, computed up to ``depth`` items ahead (``depth <= 0``: inline)."""
    if depth <= 0:
        for load in loads:
            yield load()
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for load in loads:
                if stop.is_set():
                    return
                item = load()
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001  (handed to the consumer)
            _put_until(q, _Failure(exc), stop)
            return
        _put_until(q, _DONE, stop)

    thread = threading.Thread(target=produce, name="domainflow-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join(timeout=10)


def _put_until(q: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
