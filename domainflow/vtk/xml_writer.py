"""A streaming writer of VTK XML UnstructuredGrid (``.vtu``) and PolyData (``.vtp``) files: arrays arrive
block by block and leave compressed, so a 150M-cell volume (or a 9M-cell surface) is written with only a
block in memory.

VTK's writer needs the whole mesh in memory (several times the file's size). This one writes the format
VTK itself writes with ``SetDataModeToAppended`` and ``EncodeAppendedDataOff``: a ``UInt64`` header,
``vtkZLibDataCompressor`` blocks of 32 KiB, all arrays in one raw ``AppendedData`` section. Each array's
compressed blocks go to a scratch file next to the target as they come; ``close`` then knows every offset
and streams the XML header and the blobs into the file, or straight into ``.NN.part`` byte pieces, each
published atomically (piece 00 last, so an interrupted write reads as incomplete).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import zlib_codec

BLOCK_BYTES = 32768  # uncompressed bytes per compressed block: VTK's default
COPY_BYTES = 8 << 20  # bytes moved at a time while assembling the file
_VTK_TYPES = {"i1": "Int8", "u1": "UInt8", "i2": "Int16", "u2": "UInt16", "i4": "Int32", "u4": "UInt32",
              "i8": "Int64", "u8": "UInt64", "f4": "Float32", "f8": "Float64"}
_SECTIONS = {"UnstructuredGrid": ("PointData", "CellData", "Points", "Cells"),
             "PolyData": ("PointData", "CellData", "Points", "Verts", "Polys")}


def vtk_type(dtype) -> str:
    """VTK's name of a numpy dtype ("Float32", "Int64", ...)."""
    key = np.dtype(dtype).str[1:]
    if key not in _VTK_TYPES:
        raise ValueError(f"dtype {np.dtype(dtype)} has no VTK type")
    return _VTK_TYPES[key]


class _Blob:
    """One array's encoded bytes: zlib blocks in a scratch file, their sizes kept for the header."""

    def __init__(self, path: Path, name: str, dtype, components: int, level: int):
        self.path, self.name, self.dtype = path, name, np.dtype(dtype).newbyteorder("<")
        self.components, self.level = int(components), level
        self.rows = 0
        self.total = 0  # uncompressed bytes
        self.sizes: list[int] = []
        self._pending = bytearray()
        self._file = open(path, "wb")

    def append(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        shape = (len(values),) if self.components == 1 else (len(values), self.components)
        if values.shape != shape:
            raise ValueError(f"{self.name}: a block of shape {values.shape}, expected (rows"
                             f"{'' if self.components == 1 else f', {self.components}'})")
        self.rows += len(values)
        data = np.ascontiguousarray(values, dtype=self.dtype).tobytes()
        self.total += len(data)
        self._pending += data
        full = len(self._pending) - len(self._pending) % BLOCK_BYTES
        for at in range(0, full, BLOCK_BYTES):
            self._emit(self._pending[at:at + BLOCK_BYTES])
        del self._pending[:full]

    def _emit(self, raw) -> None:
        packed = zlib_codec.compress(raw, self.level)
        self._file.write(packed)
        self.sizes.append(len(packed))

    def finish(self) -> bytes:
        """Close the scratch file; returns the compression header (VTK: nblocks, block size, size of a
        partial last block or 0, then each block's compressed size)."""
        last = len(self._pending)
        if last:
            self._emit(bytes(self._pending))
            self._pending = bytearray()
        self._file.close()
        return np.array([len(self.sizes), BLOCK_BYTES, last, *self.sizes], "<u8").tobytes()

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


class VtkXmlWriter:
    """``VtkXmlWriter(path, pieces, kind=...)``; ``declare`` every array, ``append`` their blocks in row order
    (arrays independently), then ``close(n_points, n_cells)``. ``kind`` "UnstructuredGrid" (cells:
    ``Cells`` connectivity, offsets, types) or "PolyData" (polygons: ``Polys`` connectivity, offsets; or
    vertices: ``Verts``).
    ``pieces`` > 1 writes ``path.NN.part`` byte pieces (what ``cat`` joins back into ``path``) instead of
    ``path``; stale pieces or a stale whole file go."""

    def __init__(self, path, pieces: int = 1, level: int = 1, kind: str = "UnstructuredGrid"):
        if kind not in _SECTIONS:
            raise ValueError(f"kind must be one of {sorted(_SECTIONS)}, got {kind!r}")
        self.path, self.pieces, self.level, self.kind = Path(path), int(pieces), int(level), kind
        self._blobs: dict[tuple[str, str], _Blob] = {}
        self._tag = f".tmp-{os.getpid()}-{self.path.name}"

    def declare(self, section: str, name: str, dtype, components: int = 1) -> None:
        """One array: ``section`` is ``PointData``, ``CellData``, ``Points`` (name ``Points``), ``Cells``
        (``connectivity``, ``offsets``, ``types``) or, for PolyData, ``Polys`` or ``Verts`` (``connectivity``,
        ``offsets``: polygons, or vertices for a point cloud)."""
        if section not in _SECTIONS[self.kind]:
            raise ValueError(f"section must be one of {_SECTIONS[self.kind]}, got {section!r}")
        other = {"Verts": "Polys", "Polys": "Verts"}.get(section)
        if other is not None and any(sec == other for sec, _ in self._blobs):
            raise ValueError(f"{self.path.name}: a PolyData written here holds vertices or polygons, not both")
        if np.dtype(dtype).str[1:] not in _VTK_TYPES:
            raise ValueError(f"{name}: dtype {np.dtype(dtype)} has no VTK type")
        scratch = self.path.with_name(f"{self._tag}.{len(self._blobs)}.blob")
        self._blobs[section, name] = _Blob(scratch, name, dtype, components, self.level)

    def append(self, section: str, name: str, values) -> None:
        self._blobs[section, name].append(values)

    def close(self, n_points: int, n_cells: int) -> None:
        """Check the row counts, assemble the file (or its pieces) and publish it."""
        try:
            headers = {key: blob.finish() for key, blob in self._blobs.items()}
            self._check(n_points, n_cells)
            xml, order = self._xml(headers, n_points, n_cells)
            tail = b"\n  </AppendedData>\n</VTKFile>\n"
            size = len(xml) + sum(len(headers[k]) + sum(self._blobs[k].sizes) for k in order) + len(tail)
            targets = self._targets()
            bounds = [k * size // len(targets) for k in range(len(targets) + 1)]
            tmps = [t.with_name(f"{self._tag}.{i}.part") for i, t in enumerate(targets)]
            try:
                with _SplitFile(tmps, bounds) as out:
                    out.write(xml)
                    for key in order:
                        out.write(headers[key])
                        with open(self._blobs[key].path, "rb") as src:
                            while chunk := src.read(COPY_BYTES):
                                out.write(chunk)
                    out.write(tail)
                for stale in self._stale():
                    stale.unlink()
                for tmp, target in reversed(list(zip(tmps, targets))):
                    os.replace(tmp, target)
            finally:
                for tmp in tmps:
                    tmp.unlink(missing_ok=True)
        finally:
            for blob in self._blobs.values():
                blob.discard()

    def abort(self) -> None:
        """Drop the scratch files (after an error while appending)."""
        for blob in self._blobs.values():
            blob.discard()

    def _check(self, n_points: int, n_cells: int) -> None:
        for (section, name), blob in self._blobs.items():
            want = {"PointData": n_points, "Points": n_points, "CellData": n_cells}.get(section)
            if section in ("Cells", "Verts", "Polys"):
                want = None if name == "connectivity" else n_cells
            if want is not None and blob.rows != want:
                raise ValueError(f"{self.path.name}: {section}/{name} got {blob.rows} rows, expected {want}")

    def _xml(self, headers, n_points: int, n_cells: int) -> tuple[bytes, list]:
        order, lines, offset = [], [], 0
        declared = {sec for sec, _ in self._blobs}
        for section in _SECTIONS[self.kind]:
            if section in ("Verts", "Polys") and section not in declared:
                continue  # a PolyData holds vertices or polygons: the other section is left out
            lines.append(f"      <{section}>")
            for (sec, name), blob in self._blobs.items():
                if sec != section:
                    continue
                comps = f' NumberOfComponents="{blob.components}"' if blob.components != 1 else ""
                lines.append(f'        <DataArray type="{_VTK_TYPES[blob.dtype.str[1:]]}" Name="{name}"{comps} '
                             f'format="appended" offset="{offset}"/>')
                order.append((sec, name))
                offset += len(headers[sec, name]) + sum(blob.sizes)
            lines.append(f"      </{section}>")
        verts = n_cells if "Verts" in declared else 0
        counts = (f'NumberOfCells="{n_cells}"' if self.kind == "UnstructuredGrid" else
                  f'NumberOfVerts="{verts}" NumberOfLines="0" NumberOfStrips="0" NumberOfPolys="{n_cells - verts}"')
        head = (f'<?xml version="1.0"?>\n<VTKFile type="{self.kind}" version="1.0" byte_order="LittleEndian" '
                f'header_type="UInt64" compressor="vtkZLibDataCompressor">\n  <{self.kind}>\n'
                f'    <Piece NumberOfPoints="{n_points}" {counts}>\n')
        body = "\n".join(lines) + f'\n    </Piece>\n  </{self.kind}>\n  <AppendedData encoding="raw">\n   _'
        return (head + body).encode(), order

    def _targets(self) -> list[Path]:
        if self.pieces <= 1:
            return [self.path]
        return [self.path.with_name(f"{self.path.name}.{k:02d}.part") for k in range(self.pieces)]

    def _stale(self) -> list[Path]:
        """What an earlier write left: its pieces and, when writing pieces, its whole file (all removed
        before the new pieces are published, so no mix of old and new pieces ever reads as complete)."""
        old = sorted(self.path.parent.glob(self.path.name + ".*.part"))
        if self.pieces > 1 and self.path.exists():
            old.append(self.path)
        return old


class _SplitFile:
    """One byte stream written across several files: file k receives bytes [bounds[k], bounds[k + 1])."""

    def __init__(self, paths: list[Path], bounds: list[int]):
        self.paths, self.bounds = paths, bounds
        self.pos, self.k, self._file = 0, 0, open(paths[0], "wb")

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while len(view):
            while self.pos >= self.bounds[self.k + 1] and self.k + 1 < len(self.paths):
                self._file.close()
                self.k += 1
                self._file = open(self.paths[self.k], "wb")
            take = len(view) if self.k + 1 == len(self.paths) else min(len(view), self.bounds[self.k + 1] - self.pos)
            self._file.write(view[:take])
            view = view[take:]
            self.pos += take

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
        for k in range(self.k + 1, len(self.paths)):  # pieces a short stream never reached: empty
            open(self.paths[k], "wb").close()
        return False
