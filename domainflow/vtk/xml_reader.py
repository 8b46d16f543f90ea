"""A streaming reader of VTK XML mesh files (``.vtu``, ``.vtp``): one array, or a row range of it, without
reading the rest of the file.

VTK's own reader materialises the whole file (several times its size for a 150M-cell volume). This one
scans the XML structure once in fixed-size blocks, remembers where each ``DataArray``'s bytes lie, and
decodes only what is asked for, block by block: inline (``ascii``, ``binary`` = base64) and appended
(raw or base64) data; uncompressed or zlib/lz4/lzma-compressed blocks; UInt32/UInt64 headers; any byte
order; several ``Piece``s (rows concatenated, topology offset by the earlier pieces' points). A file
shipped as ``name.00.part``, ``name.01.part``, ... is read as one virtual byte stream, never joined on
disk. Memory is bounded by the block size plus what the caller asks for.

VTK's reader stays the reference: the tests compare every encoding, written by VTK itself, with
``pyvista.read`` value for value. A file that cannot be read is a :class:`VtkFileError` naming it.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import zlib_codec
from .errors import VtkFileError, header_int
from .pieces import ByteSource, byte_source

SCAN_BLOCK = 4 << 20  # bytes read at a time while scanning the XML structure
POINT_GAP = 4096      # point ids further apart than this are read as separate stretches
# an XML attribute in double or single quotes (foamToVTK writes type='PolyData')
_ATTR = re.compile(rb'([A-Za-z_:][-\w:.]*)\s*=\s*(?:"([^"]*)"|\'([^\']*)\')')
_TYPES = {"Int8": "i1", "UInt8": "u1", "Int16": "i2", "UInt16": "u2", "Int32": "i4", "UInt32": "u4",
          "Int64": "i8", "UInt64": "u8", "Float32": "f4", "Float64": "f8"}
_ASSOCIATIONS = {"cell": "CellData", "point": "PointData"}
_TOPOLOGY = {"UnstructuredGrid": ("Cells",), "PolyData": ("Verts", "Lines", "Strips", "Polys")}


# ------------------------------------------------------------------------------------------------
# the XML structure, scanned once
# ------------------------------------------------------------------------------------------------
@dataclass
class Element:
    name: str
    attrs: dict
    children: list = field(default_factory=list)
    text: list = field(default_factory=list)  # (start, end) byte ranges of non-blank text directly inside

    def find(self, name: str):
        return next((c for c in self.children if c.name == name), None)


def _scan(src: ByteSource) -> tuple[Element, int | None, str | None]:
    """The element tree (text kept as byte ranges, never loaded) and where appended data starts."""
    root = Element("#document", {})
    stack = [root]
    pos, buf, buf_at = 0, b"", 0

    def fill(upto):  # make buf cover [pos, upto) if the file has it
        nonlocal buf, buf_at
        if upto <= buf_at + len(buf):
            return
        keep = buf[pos - buf_at:]
        buf = keep + src.read(buf_at + len(buf), max(SCAN_BLOCK, upto - (buf_at + len(buf))))
        buf_at = pos

    while True:
        fill(pos + 1)
        lt = buf.find(b"<", pos - buf_at)
        while lt < 0 and buf_at + len(buf) < src.size:  # a long text (inline data): scan on, block by block
            text_start = pos
            pos = buf_at + len(buf)
            _note_text(stack[-1], buf, buf_at, text_start, pos)
            fill(pos + 1)
            lt = buf.find(b"<", pos - buf_at)
        if lt < 0:
            _note_text(stack[-1], buf, buf_at, pos, buf_at + len(buf))
            break
        _note_text(stack[-1], buf, buf_at, pos, buf_at + lt)
        pos = buf_at + lt
        if buf.startswith(b"<!--", lt):
            end, close = _find(src, fill, lambda: buf, lambda: buf_at, pos, b"-->")
            pos = end + close
            continue
        end, close = _find(src, fill, lambda: buf, lambda: buf_at, pos, b">")
        tag = buf[pos - buf_at + 1:end - buf_at]
        pos = end + close
        if tag.startswith((b"?", b"!")):
            continue
        if tag.startswith(b"/"):
            name = tag[1:].strip().decode()
            if stack[-1].name != name:
                raise VtkFileError(f"{src.path}: corrupt VTK XML: </{name}> closes <{stack[-1].name}>")
            stack.pop()
            continue
        selfclosing = tag.endswith(b"/")
        body = tag[:-1] if selfclosing else tag
        name = body.split(None, 1)[0].decode()
        el = Element(name, {k.decode(): (v or w).decode() for k, v, w in _ATTR.findall(body)})
        stack[-1].children.append(el)
        if name == "AppendedData":
            fill(pos + 4096)
            under = buf.find(b"_", pos - buf_at)
            if under < 0:
                raise VtkFileError(f"{src.path}: corrupt VTK XML: <AppendedData> without its '_' marker")
            return root, buf_at + under + 1, el.attrs.get("encoding", "raw")
        if not selfclosing:
            stack.append(el)
    if len(stack) > 1:
        raise VtkFileError(f"{src.path}: corrupt or truncated VTK file: it ends inside <{stack[-1].name}> (a missing "
                           f".part piece or a cut download?)")
    return root, None, None


def _find(src, fill, get_buf, get_at, pos, what: bytes) -> tuple[int, int]:
    """Absolute offset of ``what`` at or after ``pos`` (a tag is short: at most a few blocks)."""
    upto = pos + 4096
    while True:
        fill(upto)
        buf, at = get_buf(), get_at()
        k = buf.find(what, pos - at)
        if k >= 0:
            return at + k, len(what)
        if at + len(buf) >= src.size:
            raise VtkFileError(f"{src.path}: corrupt or truncated VTK file: it ends inside a tag")
        upto += SCAN_BLOCK


def _note_text(el: Element, buf: bytes, buf_at: int, start: int, end: int) -> None:
    if end <= start:
        return
    seg = buf[start - buf_at:end - buf_at]
    lead = len(seg) - len(seg.lstrip())
    trail = len(seg) - len(seg.rstrip())
    if lead == len(seg):
        return
    a, b = start + lead, end - trail
    if el.text and el.text[-1][1] == start:  # the same text continued across a block boundary
        el.text[-1] = (el.text[-1][0], b)
    else:
        el.text.append((a, b))


# ------------------------------------------------------------------------------------------------
# one DataArray
# ------------------------------------------------------------------------------------------------
@dataclass
class ArrayInfo:
    """Where one DataArray's values lie and how they are encoded."""

    name: str
    dtype: np.dtype
    components: int
    rows: int
    format: str          # ascii | binary | appended
    start: int           # absolute byte offset of the (encoded) data
    end: int | None      # end of inline text; None for appended data (its header says)
    encoding: str        # raw | base64 (ascii for format ascii)


class VtkXmlFile:
    """The header of one VTK XML mesh file; arrays are decoded on request (``read``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.src = byte_source(self.path)
        try:
            root, self._appended, app_encoding = _scan(self.src)
        except Exception:
            self.src.close()
            raise
        vtk = root.find("VTKFile")
        if vtk is None:
            raise VtkFileError(f"{self.path}: corrupt or truncated VTK file, or not VTK XML (no <VTKFile> element)")
        self.kind = vtk.attrs.get("type", "")
        if self.kind not in _TOPOLOGY:
            raise VtkFileError(f"{self.path}: VTK XML type {self.kind!r} is not a mesh this reader handles "
                               f"(UnstructuredGrid .vtu or PolyData .vtp)")
        self.big_endian = vtk.attrs.get("byte_order", "LittleEndian") == "BigEndian"
        self.header = np.dtype((">" if self.big_endian else "<") + ("u8" if vtk.attrs.get("header_type") == "UInt64"
                                                                       else "u4"))
        self.compressor = vtk.attrs.get("compressor") or None
        self._app_encoding = app_encoding
        self._block_tables: dict[tuple[int, str], _BlockTable] = {}  # per compressed array
        body = vtk.find(self.kind)
        pieces = [p for p in (body.children if body else []) if p.name == "Piece"]
        if not pieces:
            raise VtkFileError(f"{self.path}: corrupt or truncated VTK file: it holds no <Piece>")
        self.pieces = []
        for p in pieces:
            n_points = header_int(p.attrs, "NumberOfPoints", 0, self.path, "<Piece>")
            counts = {t: header_int(p.attrs, f"NumberOf{t}", 0, self.path, "<Piece>") for t in _TOPOLOGY[self.kind]}
            if self.kind == "UnstructuredGrid":
                counts = {"Cells": header_int(p.attrs, "NumberOfCells", 0, self.path, "<Piece>")}
            arrays = {"point": {}, "cell": {}, "points": None, "topology": {}}
            for assoc, tag in _ASSOCIATIONS.items():
                sec = p.find(tag)
                for a in (sec.children if sec else []):
                    if a.name == "DataArray":
                        rows = n_points if assoc == "point" else sum(counts.values())
                        arrays[assoc][a.attrs.get("Name", "")] = self._info(a, rows)
            pts = p.find("Points")
            da = pts.find("DataArray") if pts else None
            if da is not None:
                arrays["points"] = self._info(da, n_points)
            for t in _TOPOLOGY[self.kind]:
                sec = p.find(t)
                arrays["topology"][t] = {a.attrs.get("Name", ""): self._info(a, None)
                                         for a in (sec.children if sec else []) if a.name == "DataArray"}
            self.pieces.append({"points": n_points, "counts": counts, "arrays": arrays})
        self.n_points = sum(p["points"] for p in self.pieces)
        self.n_cells = sum(sum(p["counts"].values()) for p in self.pieces)

    def close(self) -> None:
        self.src.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"VtkXmlFile({str(self.path)!r}, {self.kind}, {self.n_points} points, {self.n_cells} cells, "
                f"{len(self.pieces)} piece(s))")

    # -- what is there --------------------------------------------------------------------------
    def array_names(self, association: str) -> list[str]:
        """Names of the ``"cell"`` or ``"point"`` data arrays (of the first piece; all pieces must agree)."""
        return list(self.pieces[0]["arrays"][association])

    def info(self, association: str, name: str) -> ArrayInfo:
        try:
            return self.pieces[0]["arrays"][association][name]
        except KeyError:
            raise VtkFileError(f"{self.path}: no {association} array {name!r}; {association} arrays present: "
                               f"{self.array_names(association)}") from None

    # -- reading --------------------------------------------------------------------------------
    def read(self, association: str, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of a ``"cell"`` or ``"point"`` array, shape (rows,) or (rows, components)."""
        self.info(association, name)
        return self._rows(lambda p: p["arrays"][association].get(name),
                          lambda p: p["points"] if association == "point" else sum(p["counts"].values()),
                          start, stop, f"{association} array {name!r}")

    def points(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Point coordinates ``[start, stop)``, shape (rows, 3)."""
        return self._rows(lambda p: p["arrays"]["points"], lambda p: p["points"], start, stop, "Points")

    def topology_names(self, section: str | None = None) -> list[str]:
        section = section or _TOPOLOGY[self.kind][0]
        return list(self.pieces[0]["arrays"]["topology"].get(section, {}))

    def topology(self, name: str, section: str | None = None) -> np.ndarray:
        """A whole topology array of ``section`` (``Cells`` of a .vtu, ``Polys`` ... of a .vtp) over all pieces:
        ``connectivity`` offset by the earlier pieces' points, ``offsets`` continued across pieces."""
        section = section or _TOPOLOGY[self.kind][0]
        if len(self.pieces) > 1 and name not in ("connectivity", "offsets", "types"):
            raise VtkFileError(f"{self.path}: {name!r} of a file with {len(self.pieces)} pieces: only connectivity, "
                               f"offsets and types can be joined across pieces")
        parts, point_base, conn_base = [], 0, 0
        for p in self.pieces:
            a = p["arrays"]["topology"].get(section, {}).get(name)
            if a is None:
                if p["counts"].get(section, 0):
                    raise VtkFileError(f"{self.path}: <{section}> has no {name!r} array")
            else:
                v = self._decode(a, 0, None)
                if name == "connectivity" and point_base:
                    v = v + point_base
                elif name == "offsets":  # each cell's end in the connectivity: the last is the piece's length
                    end = int(v[-1]) if len(v) else 0
                    v = v + conn_base if conn_base else v
                    conn_base += end
                parts.append(v)
            point_base += p["points"]
        return np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, np.int64)

    def cell_block(self, lo: int, hi: int, section: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Cells ``[lo, hi)`` of ``section`` (over all pieces): (number of points of each cell, their point ids
        one cell after another), read from just that stretch of ``offsets`` and ``connectivity``."""
        section = section or _TOPOLOGY[self.kind][0]
        sizes, conn, base, point_base = [], [], 0, 0
        for p in self.pieces:
            n = p["counts"].get(section, 0)
            a, b = max(lo - base, 0), min(hi - base, n)
            if a < b:
                arrays = p["arrays"]["topology"].get(section, {})
                if "offsets" not in arrays or "connectivity" not in arrays:
                    raise VtkFileError(f"{self.path}: <{section}> lacks its offsets or connectivity array")
                ends = self._decode(arrays["offsets"], max(a - 1, 0), b).astype(np.int64, copy=False)
                start = int(ends[0]) if a > 0 else 0
                ends = ends[1:] if a > 0 else ends
                if len(ends) != b - a or (np.diff(ends, prepend=start) < 0).any():
                    raise VtkFileError(f"{self.path}: <{section}> offsets are not ascending: a corrupt file")
                ids = self._decode(arrays["connectivity"], start, int(ends[-1])).astype(np.int64, copy=False)
                sizes.append(np.diff(ends, prepend=start))
                conn.append(ids + point_base if point_base else ids)
            base += n
            point_base += p["points"]
        if not sizes:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return (np.concatenate(sizes), np.concatenate(conn)) if len(sizes) > 1 else (sizes[0], conn[0])

    def points_of(self, conn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The points a connectivity refers to, read stretch by stretch (only the ids used, in runs closer
        than ``POINT_GAP``); returns (points, connectivity re-indexed into them)."""
        if not len(conn):
            return np.zeros((0, 3), dtype=self.pieces[0]["arrays"]["points"].dtype), conn
        return self.point_rows_of(conn, self.points)

    def point_rows_of(self, conn: np.ndarray, read) -> tuple[np.ndarray, np.ndarray]:
        """Rows of a point array (``read(lo, hi)`` reads rows ``[lo, hi)``: coordinates or a point data array)
        that a non-empty connectivity refers to, as :meth:`points_of`; returns (rows, connectivity re-indexed
        into them)."""
        if conn.min() < 0 or conn.max() >= self.n_points:
            raise VtkFileError(f"{self.path}: the connectivity refers to point {int(conn.max())} of {self.n_points} "
                               f"(or a negative id): a corrupt file")
        first, span = int(conn.min()), int(conn.max()) - int(conn.min()) + 1
        if span <= 8 * len(conn):  # ids in a compact range (the usual numbering): a mask, no sort
            mask = np.zeros(span, dtype=bool)
            mask[conn - first] = True
            if mask.all():  # every point of the range used (a block of a compactly numbered mesh): one stretch
                return read(first, first + span), conn - first
            used = np.flatnonzero(mask) + first
            local = (np.cumsum(mask) - 1)[conn - first]
        else:
            used = np.unique(conn)
            local = np.searchsorted(used, conn)
        cuts = np.flatnonzero(np.diff(used) > POINT_GAP) + 1
        parts = []
        for run in np.split(used, cuts):
            stretch = read(int(run[0]), int(run[-1]) + 1)
            parts.append(stretch[run - run[0]])
        return np.concatenate(parts) if len(parts) > 1 else parts[0], local

    def cells_of(self, ids: np.ndarray, block: int = 1 << 20, section: str | None = None):
        """(number of points of each cell, their point ids) of cells ``ids`` (ascending, any subset), read a
        stretch of at most ``block`` cells at a time and only where ``ids`` has cells: memory follows the
        cells asked for, not the file. ``section`` defaults to ``Polys`` of a .vtp (``Cells`` of a .vtu)."""
        section = section or ("Polys" if self.kind == "PolyData" else "Cells")
        ids = np.asarray(ids, dtype=np.int64)
        sizes_out, conn_out, k = [], [], 0
        while k < len(ids):
            lo = int(ids[k])
            j = int(np.searchsorted(ids, lo + block, side="left"))
            sizes, conn = self.cell_block(lo, int(ids[j - 1]) + 1, section)
            pick = ids[k:j] - lo
            starts = np.cumsum(sizes) - sizes
            lens = sizes[pick]
            # the picked cells' stretches of the connectivity, one after another
            at = np.repeat(starts[pick] - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
            sizes_out.append(lens)
            conn_out.append(conn[at])
            k = j
        if not sizes_out:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(sizes_out), np.concatenate(conn_out)

    def cell_types(self, lo: int, hi: int) -> np.ndarray:
        """VTK cell types of cells ``[lo, hi)`` of a .vtu (over all pieces)."""
        return self._rows(lambda p: p["arrays"]["topology"].get("Cells", {}).get("types"),
                          lambda p: p["counts"].get("Cells", 0), lo, hi, "cell types")

    def cell_counts(self) -> dict[str, int]:
        """Cells per topology section over all pieces (a .vtu has only ``Cells``)."""
        return {t: sum(p["counts"].get(t, 0) for p in self.pieces) for t in _TOPOLOGY[self.kind]}

    def _rows(self, pick, count, start, stop, what) -> np.ndarray:
        total = sum(count(p) for p in self.pieces)
        stop = total if stop is None else stop
        if not 0 <= start <= stop <= total:
            raise VtkFileError(f"{self.path}: rows [{start}, {stop}) of {what} are outside its {total} rows")
        out, base = [], 0
        for p in self.pieces:
            n = count(p)
            lo, hi = max(start - base, 0), min(stop - base, n)
            if lo < hi:
                a = pick(p)
                if a is None:
                    raise VtkFileError(f"{self.path}: a piece lacks {what}")
                out.append(self._decode(a, lo, hi))
            base += n
        if len(out) == 1:
            return out[0]
        a = pick(self.pieces[0])
        shape = (0,) if a.components == 1 else (0, a.components)
        return np.concatenate(out) if out else np.zeros(shape, a.dtype)

    # -- decoding -------------------------------------------------------------------------------
    def _info(self, el: Element, rows: int | None) -> ArrayInfo:
        name = el.attrs.get("Name", "")
        t = el.attrs.get("type")
        if t not in _TYPES:
            raise VtkFileError(f"{self.path}: DataArray {name!r} has type {t!r}; numeric types only "
                               f"({', '.join(_TYPES)})")
        dtype = np.dtype((">" if self.big_endian else "<") + _TYPES[t])
        comps = header_int(el.attrs, "NumberOfComponents", 1, self.path, f"DataArray {name!r}")
        fmt = el.attrs.get("format", "ascii")
        if fmt == "appended":
            if self._appended is None:
                raise VtkFileError(f"{self.path}: DataArray {name!r} is appended but the file has no <AppendedData>")
            return ArrayInfo(name, dtype, comps, rows, fmt, self._appended + header_int(el.attrs, "offset", 0, self.path,
                                                                                    f"DataArray {name!r}"), None,
                             self._app_encoding)
        if fmt not in ("ascii", "binary"):
            raise VtkFileError(f"{self.path}: DataArray {name!r} has format {fmt!r} (ascii, binary or appended)")
        if not el.text:
            start = end = 0
        else:
            start, end = el.text[-1] if fmt == "binary" else (el.text[0][0], el.text[-1][1])
        return ArrayInfo(name, dtype, comps, rows, fmt, start, end, "ascii" if fmt == "ascii" else "base64")

    def _decode(self, a: ArrayInfo, lo: int, hi: int | None) -> np.ndarray:
        """Rows [lo, hi) of one piece's array (hi None: all of it)."""
        try:
            if a.format == "ascii":
                flat = self._ascii(a, lo, hi)
            else:
                flat = self._binary(a, lo, hi)
        except VtkFileError:
            raise
        except (ValueError, *zlib_codec.errors, binascii.Error, EOFError, OSError) as exc:
            raise VtkFileError(f"{self.path}: DataArray {a.name!r} cannot be decoded ({type(exc).__name__}: "
                               f"{str(exc)[:160]}): a corrupt or truncated file") from None
        flat = flat.astype(a.dtype.newbyteorder("="), copy=False)
        return flat if a.components == 1 else flat.reshape(-1, a.components)

    def _ascii(self, a: ArrayInfo, lo: int, hi: int | None) -> np.ndarray:
        first, last = lo * a.components, None if hi is None else hi * a.components
        kind = np.float64 if a.dtype.kind == "f" else a.dtype.newbyteorder("=")
        out, seen, pos, carry = [], 0, a.start, b""
        while pos < a.end and (last is None or seen < last):
            chunk = carry + self.src.read(pos, min(SCAN_BLOCK, a.end - pos))
            pos += SCAN_BLOCK
            if pos < a.end:  # the last token may continue in the next block
                cut = max(chunk.rfind(b" "), chunk.rfind(b"\n"), chunk.rfind(b"\t"), chunk.rfind(b"\r"))
                chunk, carry = (chunk[:cut], chunk[cut:]) if cut >= 0 else (b"", chunk)
            else:
                carry = b""
            vals = np.array(chunk.split(), dtype=kind) if chunk.strip() else np.zeros(0, kind)
            a0, a1 = max(first - seen, 0), len(vals) if last is None else min(last - seen, len(vals))
            if a0 < a1:
                out.append(vals[a0:a1].astype(a.dtype))
            seen += len(vals)
        if carry.strip():
            vals = np.array(carry.split(), dtype=kind)
            a0, a1 = max(first - seen, 0), len(vals) if last is None else min(last - seen, len(vals))
            if a0 < a1:
                out.append(vals[a0:a1].astype(a.dtype))
            seen += len(vals)
        got = sum(len(o) for o in out)
        want = (last if last is not None else seen) - first
        if got != want or (a.rows is not None and hi is None and seen != a.rows * a.components):
            raise VtkFileError(f"{self.path}: ascii DataArray {a.name!r} holds {seen} values, expected "
                               f"{a.rows * a.components if a.rows is not None else want}: a corrupt or truncated file")
        return np.concatenate(out) if out else np.zeros(0, a.dtype)

    # binary data: [header][data] where header is (nbytes) uncompressed, or (nblocks, blocksize, lastsize,
    # csize_1..n) compressed; base64-encoded as one stream when uncompressed, header and blocks apart when
    # compressed
    def _binary(self, a: ArrayInfo, lo: int, hi: int | None) -> np.ndarray:
        stream = _Raw(self.src, a.start) if a.encoding == "raw" else _Base64(self.src, a.start, a.end, self.path)
        hs = self.header.itemsize
        row = a.dtype.itemsize * a.components
        if self.compressor is None:
            nbytes = int(np.frombuffer(stream.head(hs), self.header)[0])
            total_rows = nbytes // row if row else 0
            hi = total_rows if hi is None else hi
            self._check_rows(a, total_rows, hi)
            data = stream.body(hs, lo * row, (hi - lo) * row, together=True)
        else:
            table = self._block_table(a, stream)
            total_rows = table.nbytes // row if row else 0
            hi = total_rows if hi is None else hi
            self._check_rows(a, total_rows, hi)
            b0, b1 = lo * row, hi * row
            if b1 <= b0:
                return np.zeros(0, a.dtype)
            bsize = table.bsize
            k0, k1 = b0 // bsize, (b1 - 1) // bsize
            coff = table.offsets(stream, k0, k1)  # compressed offsets of blocks k0 .. k1 + 1
            decomp = _decompressor(self.compressor, self.path)
            together = None
            if a.encoding == "raw":  # the blocks lie back to back: one read for all of them
                together = stream.body(table.header_bytes, int(coff[0]), int(coff[-1] - coff[0]), together=True)
            parts = []
            for k in range(k0, k1 + 1):
                at, size = int(coff[k - k0]), int(coff[k - k0 + 1] - coff[k - k0])
                if together is None:
                    raw = stream.body(table.header_bytes, at, size, together=False)
                else:
                    raw = together[at - int(coff[0]):at - int(coff[0]) + size]
                want = table.usize(k)
                block = decomp(raw, want)
                if len(block) != want:
                    raise VtkFileError(f"{self.path}: DataArray {a.name!r}: block {k} decompresses to {len(block)} "
                                       f"bytes, its header says {want}: a corrupt file")
                s = b0 - k * bsize if k == k0 else 0
                e = b1 - k * bsize if k == k1 else len(block)
                parts.append(block[s:e])
            data = b"".join(parts)
        if len(data) != (hi - lo) * row:
            raise VtkFileError(f"{self.path}: DataArray {a.name!r} ends early ({len(data)} of {(hi - lo) * row} "
                               f"bytes): a corrupt or truncated file")
        return np.frombuffer(bytearray(data), a.dtype)  # writable, like VTK's arrays

    def _block_table(self, a: ArrayInfo, stream) -> "_BlockTable":
        key = (a.start, a.encoding)
        if key not in self._block_tables:
            self._block_tables[key] = _BlockTable(stream, self.header, self.path)
        return self._block_tables[key]

    def _check_rows(self, a: ArrayInfo, total_rows: int, hi: int) -> None:
        if a.rows is not None and total_rows != a.rows:
            raise VtkFileError(f"{self.path}: DataArray {a.name!r} holds {total_rows} rows, the piece says {a.rows}: "
                               f"a corrupt file")
        if hi > total_rows:
            raise VtkFileError(f"{self.path}: DataArray {a.name!r} has {total_rows} rows, {hi} asked for")


class _BlockTable:
    """Where the blocks of a compressed array lie. Its header (block count, block size, size of a partial last
    block, then every block's compressed size) grows with the array, 8 bytes per 32 KiB block, so it stays
    on disk: read once in slices to keep the offset of every ``STRIDE``-th block, then re-read around the
    blocks a read needs."""

    STRIDE = 1024
    CHUNK = 1 << 16  # header entries read at a time

    def __init__(self, stream, header: np.dtype, path: Path):
        self.hs, self.header = header.itemsize, header
        nblocks, bsize, last = (int(v) for v in np.frombuffer(stream.head(3 * self.hs), header))
        if nblocks and bsize <= 0:
            raise VtkFileError(f"{path}: a compressed DataArray with block size {bsize}: a corrupt file")
        self.nblocks, self.bsize, self.last = nblocks, bsize, last
        self.header_bytes = self.hs * (3 + nblocks)
        self.nbytes = bsize * nblocks - (bsize - last if nblocks and last else 0)
        coarse, total = [0], 0
        for c0 in range(0, nblocks, self.CHUNK):  # CHUNK is a multiple of STRIDE
            sizes = self._sizes(stream, c0, min(c0 + self.CHUNK, nblocks))
            ends = total + np.cumsum(sizes)
            coarse += ends[self.STRIDE - 1::self.STRIDE].tolist()
            total = int(ends[-1])
        self.coarse = np.asarray(coarse[:nblocks // self.STRIDE + 1], dtype=np.int64)

    def _sizes(self, stream, k0: int, k1: int) -> np.ndarray:
        raw = stream.header(self.hs * (3 + k0), self.hs * (k1 - k0))
        return np.frombuffer(raw, self.header).astype(np.int64)

    def usize(self, k: int) -> int:
        """Uncompressed bytes of block k."""
        return self.last if k == self.nblocks - 1 and self.last else self.bsize

    def offsets(self, stream, k0: int, k1: int) -> np.ndarray:
        """Compressed offsets of blocks k0 .. k1 + 1 (k1 - k0 + 2 values, the last one the end of block k1)."""
        c = k0 // self.STRIDE
        sizes = self._sizes(stream, c * self.STRIDE, k1 + 1)
        ends = np.concatenate([[0], np.cumsum(sizes)]) + self.coarse[c]
        return ends[k0 - c * self.STRIDE:]


class _Raw:
    """Appended raw bytes from ``start``."""

    def __init__(self, src: ByteSource, start: int):
        self.src, self.start = src, start

    def head(self, n: int) -> bytes:
        b = self.src.read(self.start, n)
        if len(b) < n:
            raise VtkFileError(f"{self.src.path}: corrupt or truncated VTK file: it ends inside a DataArray header")
        return b

    def header(self, at: int, n: int) -> bytes:
        """Bytes [at, at + n) of the array's header."""
        b = self.src.read(self.start + at, n)
        if len(b) < n:
            raise VtkFileError(f"{self.src.path}: corrupt or truncated VTK file: it ends inside a DataArray header")
        return b

    def body(self, header_bytes: int, offset: int, n: int, together: bool) -> bytes:
        return self.src.read(self.start + header_bytes + offset, n)


class _Base64:
    """Base64 text from ``start`` (to ``end`` for inline data): decoded 4 characters per 3 bytes, seeking
    to the group that holds the wanted bytes. Text with whitespace inside is read from its start."""

    def __init__(self, src: ByteSource, start: int, end: int | None, path: Path):
        self.src, self.start, self.end, self.path = src, start, end, path
        self._sep: bool | None = None

    def _chars(self, at: int, n: int) -> bytes:
        stop = at + n if self.end is None else min(at + n, self.end)
        got = self.src.read(at, max(stop - at, 0))
        if bytes(got).translate(None, b"\r\n\t ") != got:
            raise VtkFileError(f"{self.path}: base64 data with line breaks inside is not supported by the "
                               f"streaming reader; re-save the file (e.g. pyvista .save) or use binary appended data")
        return got

    def head(self, n: int) -> bytes:
        chars = 4 * ((n + 2) // 3)
        return base64.b64decode(self._chars(self.start, chars))[:n]

    def header(self, at: int, n: int) -> bytes:
        """Bytes [at, at + n) of a header encoded on its own (compressed data), decoding only their groups."""
        g0, g1 = at // 3, (at + n + 2) // 3
        dec = base64.b64decode(self._chars(self.start + 4 * g0, 4 * (g1 - g0)))
        if len(dec) < at - 3 * g0 + n:
            raise VtkFileError(f"{self.path}: corrupt or truncated VTK file: it ends inside a DataArray header")
        return dec[at - 3 * g0:at - 3 * g0 + n]

    def body(self, header_bytes: int, offset: int, n: int, together: bool) -> bytes:
        if n <= 0:
            return b""
        if together and self._separate_header(header_bytes):
            together = False
        if together:  # header and data one base64 stream
            b0 = header_bytes + offset
            base = self.start
        else:  # the header encoded alone (padded), then the data
            b0 = offset
            base = self.start + 4 * ((header_bytes + 2) // 3)
        g0, g1 = b0 // 3, (b0 + n + 2) // 3
        dec = base64.b64decode(self._chars(base + 4 * g0, 4 * (g1 - g0)))
        s = b0 - 3 * g0
        return dec[s:s + n]

    def _separate_header(self, header_bytes: int) -> bool:
        """Uncompressed data: VTK encodes header and data together, some writers apart (a padded header)."""
        if self._sep is None:
            chars = self._chars(self.start, 4 * ((header_bytes + 2) // 3))
            self._sep = header_bytes % 3 != 0 and chars.endswith(b"=")
        return self._sep


def _decompressor(name: str, path: Path):
    if name == "vtkZLibDataCompressor":
        return lambda raw, n: zlib_codec.decompress(raw)
    if name == "vtkLZMADataCompressor":
        import lzma

        return lambda raw, n: lzma.decompress(raw)
    if name == "vtkLZ4DataCompressor":
        try:
            import lz4.block
        except ImportError:
            raise VtkFileError(f"{path}: is LZ4-compressed; install the lz4 package (pip install "
                               f"'domainflow[lz4]') or re-save it with zlib compression") from None
        return lambda raw, n: lz4.block.decompress(raw, uncompressed_size=n)
    raise VtkFileError(f"{path}: unknown VTK compressor {name!r} (vtkZLibDataCompressor, vtkLZ4DataCompressor "
                       f"or vtkLZMADataCompressor)")
