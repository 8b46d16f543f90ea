"""Files shipped as byte pieces: ``<name>.00.part, <name>.01.part, ...`` whose bytes, joined in order (like
``cat``), are the file. Find them (:func:`pieces_of`, :func:`locate`), refuse an incomplete set
(:func:`check_pieces_complete`), read them as one stream (:class:`ByteSource`, :func:`byte_source`) or join
them into a temporary file (:func:`whole_file`). Errors are :class:`VtkFileError`\\ s naming the file."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import VtkFileError

PIECE = re.compile(r"\.(\d+)\.part$")
XML_TAIL = 4096  # bytes read from the end of a joined file: room for </VTKFile> and trailing whitespace


def pieces_of(path: Path) -> list[Path]:
    """The byte pieces ``<name>.00.part, <name>.01.part, ...`` of a file shipped split, in order."""
    path = Path(path)
    found = {}
    for p in path.parent.glob(path.name + ".*.part"):
        m = PIECE.search(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        return []
    missing = [i for i in range(max(found) + 1) if i not in found]
    if missing:
        raise VtkFileError(f"{path}: split into .part files but piece(s) {missing} are missing "
                           f"(found {sorted(found)}); download the missing pieces")
    return [found[i] for i in sorted(found)]


def locate(path: Path) -> Path | None:
    """``path`` if it exists, else ``path`` if it exists split into pieces (returned as is), else None."""
    path = Path(path)
    if path.exists() or pieces_of(path):
        return path
    return None


@contextlib.contextmanager
def whole_file(path: Path, scratch: Path | None = None):
    """Yield a readable path for ``path``; if it ships as ``.NN.part`` pieces, concatenate them (bytes,
    like ``cat``) into a temporary file (under ``scratch``) that is removed afterwards."""
    path = Path(path)
    if path.exists():
        yield path
        return
    pieces = pieces_of(path)
    if not pieces:
        raise VtkFileError(f"{path} is missing (neither the file nor {path.name}.00.part pieces exist)")
    folder = Path(tempfile.mkdtemp(prefix="domainflow-parts-", dir=scratch))
    try:
        joined = folder / path.name
        with open(joined, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        size = joined.stat().st_size
        with open(joined, "rb") as f:
            head = f.read(64)
            f.seek(max(0, size - XML_TAIL))
            tail = f.read()
        check_pieces_complete(path, head, tail, pieces)
        yield joined
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_pieces_complete(path: Path, head: bytes, tail: bytes, pieces: list[Path]) -> None:
    """Refuse a VTK XML file shipped as ``pieces`` whose joined bytes (``head``: the first 64, ``tail``: the
    last few KiB) do not end with ``</VTKFile>``, naming the piece(s) that seem to be missing: pieces 00..k
    with no gap can still lack the last one(s), which VTK would report as a corrupt file."""
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith((b"<?xml", b"<VTKFile")):
        return  # not VTK XML (legacy VTK, or garbage that the reader reports as corrupt)
    if tail.rstrip().endswith(b"</VTKFile>"):
        return
    digits = [PIECE.search(Path(p).name).group(1) for p in pieces]
    found = digits[0] if len(digits) == 1 else f"{digits[0]}..{digits[-1]}"
    empty = [Path(p).name for p in pieces if Path(p).stat().st_size == 0]
    if empty:
        raise VtkFileError(f"{path}: its .part pieces {found} end before the file does; piece(s) {empty} hold 0 "
                           f"bytes: a corrupt or truncated download; download them again")
    following = f"{int(digits[-1]) + 1:0{len(digits[-1])}d}"
    raise VtkFileError(f"{path}: its .part pieces {found} end before the file does (no closing </VTKFile>); "
                       f"the last piece(s) (.{following}.part and after?) seem to be missing (or "
                       f".{digits[-1]}.part is cut short); download them")


class ByteSource:
    """Random access to the bytes of ``path`` or, when it ships split, of its ``.NN.part`` pieces in order."""

    def __init__(self, path: Path, pieces: list[Path] | None = None):
        self.path = Path(path)
        self.files = [self.path] if pieces is None else list(pieces)
        self.sizes = [os.path.getsize(f) for f in self.files]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()
        self.size = self.starts[-1]
        self._fds: list[int | None] = [None] * len(self.files)

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer only at the end of the stream)."""
        out, pos, end = [], offset, min(offset + n, self.size)
        while pos < end:
            k = int(np.searchsorted(self.starts, pos, side="right")) - 1
            if self._fds[k] is None:
                self._fds[k] = os.open(self.files[k], os.O_RDONLY)
            take = min(end, self.starts[k + 1]) - pos
            chunk = os.pread(self._fds[k], take, pos - self.starts[k])
            if not chunk:
                raise VtkFileError(f"{self.path}: {self.files[k].name} changed size while being read")
            out.append(chunk)
            pos += len(chunk)
        return b"".join(out)

    def close(self) -> None:
        for k, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[k] = None


def byte_source(path: Path) -> ByteSource:
    """``path`` itself, or its ``.NN.part`` pieces (all of them, none missing, ending like a whole VTK XML
    file) as one stream."""
    path = Path(path)
    if path.exists():
        return ByteSource(path)
    pieces = pieces_of(path)
    if not pieces:
        raise VtkFileError(f"{path} is missing (neither the file nor {path.name}.00.part pieces exist)")
    src = ByteSource(path, pieces)
    check_pieces_complete(path, src.read(0, 64), src.read(max(0, src.size - XML_TAIL), XML_TAIL), pieces)
    return src
