"""Row arrays on local disk for the streaming ingest: written and read in row blocks through pread/pwrite,
never mapped, so a run larger than memory passes through a worker with only a block resident."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class ScratchArray:
    """An (n, *tail) array of ``dtype`` in the file ``path`` (created empty of size n rows)."""

    def __init__(self, path: Path, n: int, dtype, tail: tuple[int, ...] = ()):
        self.path, self.n, self.dtype, self.tail = Path(path), int(n), np.dtype(dtype), tuple(tail)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.tail, dtype=np.int64))
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, self.n * self.row_bytes)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n,) + self.tail

    def read(self, lo: int, hi: int) -> np.ndarray:
        want = (hi - lo) * self.row_bytes
        buf = bytearray(want)
        view, got = memoryview(buf), 0
        while got < want:
            k = os.preadv(self._fd, [view[got:]], lo * self.row_bytes + got)
            if k <= 0:
                raise OSError(f"{self.path}: short read at row {lo}")
            got += k
        return np.frombuffer(buf, self.dtype).reshape((hi - lo,) + self.tail)

    def write(self, lo: int, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype)
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], lo * self.row_bytes + done)

    def blocks(self, rows: int):
        """(lo, hi) row ranges of at most ``rows`` rows covering the array."""
        for lo in range(0, self.n, max(1, rows)):
            yield lo, min(lo + rows, self.n)

    def close(self, remove: bool = True) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if remove:
                self.path.unlink(missing_ok=True)
