"""Row arrays on local disk for the streaming ingest: written and read in row blocks through pread/pwrite,
never mapped, so a run larger than memory passes through a worker with only a block resident."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def row_blocks(n: int, rows: int):
    """(lo, hi) ranges of at most ``rows`` rows covering ``n`` rows."""
    for lo in range(0, n, max(1, rows)):
        yield lo, min(lo + rows, n)


class ScratchArray:
    """An (n, *tail) array of ``dtype`` in the file ``path`` (created empty of size n rows)."""

    def __init__(self, path: Path, n: int, dtype, tail: tuple[int, ...] = (), *, _existing: bool = False):
        self.path, self.n, self.dtype, self.tail = Path(path), int(n), np.dtype(dtype), tuple(tail)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.tail, dtype=np.int64))
        if _existing:
            self._fd = os.open(self.path, os.O_RDWR)
            return
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, self.n * self.row_bytes)

    @classmethod
    def open(cls, path, dtype, tail: tuple[int, ...] = ()) -> "ScratchArray":
        """An array another task wrote (closed with ``remove=False``); its row count from the file size."""
        row_bytes = np.dtype(dtype).itemsize * int(np.prod(tuple(tail), dtype=np.int64))
        size = os.stat(path).st_size
        if row_bytes and size % row_bytes:
            raise OSError(f"{path}: {size} bytes is not a whole number of {row_bytes}-byte rows")
        return cls(path, size // row_bytes if row_bytes else 0, dtype, tail, _existing=True)

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
        return row_blocks(self.n, rows)

    def close(self, remove: bool = True) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if remove:
                self.path.unlink(missing_ok=True)


class JoinedColumns:
    """Several scratch arrays of one column (the stretches that scan tasks wrote), read as one array."""

    def __init__(self, parts: list[ScratchArray]):
        self.parts = parts
        self.dtype, self.tail = parts[0].dtype, parts[0].tail
        self.row_bytes = parts[0].row_bytes
        self.starts = np.concatenate([[0], np.cumsum([p.n for p in parts])]).astype(np.int64)
        self.n = int(self.starts[-1])

    @classmethod
    def open(cls, files) -> "JoinedColumns":
        """From ``(path, dtype, tail)`` entries, in row order."""
        parts = []
        try:
            for path, dtype, tail in files:
                parts.append(ScratchArray.open(path, dtype, tuple(tail)))
        except BaseException:
            for p in parts:
                p.close(remove=False)
            raise
        return cls(parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n,) + self.tail

    def read(self, lo: int, hi: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, lo, side="right")) - 1
        out = []
        for i in range(max(first, 0), len(self.parts)):
            s0, s1 = int(self.starts[i]), int(self.starts[i + 1])
            if s0 >= hi:
                break
            a, b = max(lo, s0), min(hi, s1)
            if a < b:
                out.append(self.parts[i].read(a - s0, b - s0))
        if not out:
            return np.zeros((0,) + self.tail, self.dtype)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def blocks(self, rows: int):
        """(lo, hi) row ranges of at most ``rows`` rows covering all stretches together."""
        return row_blocks(self.n, rows)

    def close(self, remove: bool = False) -> None:
        for p in self.parts:
            p.close(remove)


class CellIds:
    """The column of cell ids 0..n-1 read like a scratch array (a location kept whole needs no file for it)."""

    dtype, tail, row_bytes = np.dtype(np.int64), (), 8

    def __init__(self, n: int):
        self.n = int(n)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n,)

    def read(self, lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi, dtype=np.int64)

    def blocks(self, rows: int):
        return row_blocks(self.n, rows)

    def close(self, remove: bool = False) -> None:
        pass


class RowRange:
    """Rows ``[lo, hi)`` of a scratch array, read and written as an array of their own (a subtree's rows)."""

    def __init__(self, base, lo: int, hi: int):
        self.base, self.lo, self.n = base, int(lo), int(hi) - int(lo)
        self.dtype, self.tail = base.dtype, base.tail

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n,) + self.tail

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.base.read(self.lo + lo, self.lo + hi)

    def write(self, lo: int, values: np.ndarray) -> None:
        self.base.write(self.lo + lo, values)

    def blocks(self, rows: int):
        return row_blocks(self.n, rows)
