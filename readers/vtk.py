"""Read raw VTK files straight into ShardTensors: only the named arrays, each rank only its own pieces.

Partitioned files (``.pvtu``, ``.pvtp``, ``.vtm``) are read piecewise: the K piece files are split into
W contiguous, balanced ranges over the ranks of the domain axis, so no rank opens another rank's piece.
A monolithic file (``.vtu``, ``.vtp``, ``.vtk``, ...) is read whole by one rank and scattered: the slow
path for data not yet ingested (prefer ``domainflow ingest`` and the region readers).

Bad input raises on every rank together: everything that can be checked from the small XML headers is
checked identically on every rank before any collective; a failure only the reading rank can see
(corrupt binary data) is agreed on in the one all-gather that also carries the row counts.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["read_vtk", "VtkRead", "PARTITIONED_SUFFIXES"]

#: Suffixes read piecewise (an XML index of piece files); anything else is read whole by one rank.
PARTITIONED_SUFFIXES = (".pvtu", ".pvtp", ".vtm")
_PIECE_SUFFIXES = (".vtu", ".vtp", ".vts", ".vtr", ".vti")
_ASSOCIATIONS = {"cell": "CellData", "point": "PointData"}

# VTK XML type -> torch dtype; unsigned types wider than 8 bits widen to the next signed type, as the
# ShardTensor collectives carry only torch's common dtypes.
_XML_DTYPES = {
    "Int8": torch.int8, "UInt8": torch.uint8, "Int16": torch.int16, "UInt16": torch.int32,
    "Int32": torch.int32, "UInt32": torch.int64, "Int64": torch.int64, "UInt64": torch.int64,
    "Float32": torch.float32, "Float64": torch.float64,
}
_NP_WIDEN = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64, np.dtype(np.uint64): np.int64}
_HEADER_CHUNK = 4 << 10
_APPENDED = b"<AppendedData"


@dataclass
class VtkRead:
    """What :func:`read_vtk` returns on one rank.

    ``arrays``: name -> ShardTensor (Shard(0) over the domain axis; rows are cells or points in file
    order; shape (N,) for one-component arrays, (N, C) otherwise), or plain tensors when ``mesh`` is None.
    ``coords``: (N, 3) cell centres or points, laid out like the arrays, in the points' dtype.
    ``bytes_read``: sizes of the data files this rank opened (its pieces, or the whole monolithic file
    on the source rank). ``header_bytes``: bytes read while parsing index files and piece headers
    (every rank parses every header, so that all ranks validate the same way).
    ``pieces``: the data files this rank read, in order.
    """

    arrays: dict
    coords: torch.Tensor
    bytes_read: int = 0
    header_bytes: int = 0
    pieces: list = field(default_factory=list)


@dataclass
class _Header:
    """What a piece's XML header says, read without touching its data."""

    path: str
    arrays: dict  # association -> {name: (VTK type, components)}
    points_type: str
    counts: dict | None  # association -> rows, when the header lists them all


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------
def read_vtk(path, arrays=None, mesh=None, axis: str = "domain", association: str = "cell",
             src: int = 0, blocks=None) -> VtkRead:
    """Read the ``arrays`` (None: all of them) of ``association`` ("cell" or "point") from a VTK file.

    ``mesh``: a DeviceMesh (1-D, or N-D with a dim named ``axis``); the results are Shard(0) over the
    ``axis`` sub-mesh. None: the whole file in this process, as plain tensors. Partitioned files are
    read piecewise (rank r of W reads pieces [r*K//W, (r+1)*K//W)); monolithic files are read whole by
    rank ``src`` of the axis and scattered in balanced row ranges, which is the slow path for data not
    yet ingested: prefer ``domainflow ingest`` and the region readers for repeated reads.

    ``blocks``: the names of the blocks of a ``.vtm`` to read (e.g. ``["internalMesh"]`` of an OpenFOAM case,
    or a boundary patch): a data set is read when its own name or the name of a block around it is listed.
    None reads every data set of the index as pieces of one.
    """
    path = os.fspath(path)
    if association not in _ASSOCIATIONS:
        raise ValueError(f"read_vtk({path}): association={association!r}; use 'cell' or 'point'")
    if arrays is not None:
        arrays = list(dict.fromkeys([arrays] if isinstance(arrays, str) else arrays))
    domain = _domain_mesh(mesh, axis)
    world = 1 if domain is None else domain.size()
    if not 0 <= src < world:
        raise ValueError(f"read_vtk({path}): src={src} is not a rank of the {world}-rank axis {axis!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"read_vtk: {path} does not exist")
    if blocks is not None:
        blocks = [blocks] if isinstance(blocks, str) else list(blocks)
        if not path.lower().endswith(".vtm"):
            raise ValueError(f"read_vtk({path}): blocks={blocks} selects blocks of a .vtm multi-block index")
    if path.lower().endswith(PARTITIONED_SUFFIXES):
        return _read_partitioned(path, arrays, domain, association, blocks)
    return _read_monolithic(path, arrays, domain, association, src)


def _domain_mesh(mesh, axis):
    """The 1-D sub-mesh of ``axis`` (an unnamed 1-D mesh is taken as the axis itself)."""
    if mesh is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1 and not names:
        return mesh
    if axis not in names:
        raise ValueError(f"read_vtk: axis={axis!r} is not a dim of the mesh, whose dims are {names}; "
                         f"pass axis= one of them")
    return mesh if mesh.ndim == 1 else mesh[axis]


# --------------------------------------------------------------------------------------------
# partitioned files
# --------------------------------------------------------------------------------------------
def _read_partitioned(path, arrays, domain, association, blocks=None) -> VtkRead:
    """Each rank reads its contiguous range of pieces; one all-gather agrees on success and row counts."""
    pieces, declared, nbytes = _piece_files(path, blocks)
    headers = []
    for p in pieces:
        h, n = _piece_header(p)
        headers.append(h)
        nbytes += n
    if arrays is None and declared is not None and declared[association] is not None:
        # like VTK's parallel readers: the arrays the index declares (else those of the first piece)
        arrays = [n for n, t in declared[association].items() if t in _XML_DTYPES]
    names, dtypes, comps, coord_dtype = _plan(path, headers, arrays, association)
    world, me = (1, 0) if domain is None else (domain.size(), domain.get_local_rank())
    k = len(pieces)
    mine = headers[me * k // world:(me + 1) * k // world]
    error, local, coords = None, None, None
    try:
        parts = [_read_piece(h, names, association, coord_dtype, dtypes) for h in mine]
        local, coords = _concat(parts, names, dtypes, comps, coord_dtype)
    except Exception as exc:  # only this rank sees it: hand it to the agreement below
        if domain is None:
            raise
        error = _describe(exc)
    out = VtkRead({}, None, sum(os.path.getsize(h.path) for h in mine), nbytes, [h.path for h in mine])
    if domain is None:
        out.arrays, out.coords = local, coords
        return out
    sizes = _agree(domain, error, 0 if coords is None else coords.shape[0], path)
    out.arrays = {n: _wrap(t, domain, sizes) for n, t in local.items()}
    out.coords = _wrap(coords, domain, sizes)
    return out


def _vtm_datasets(node, around=()) -> list[tuple[str, set]]:
    """(file, the names of the data set and of every block around it) of each data set of a .vtm, in order."""
    out = []
    for child in node:
        names = set(around) | ({child.get("name")} if child.get("name") else set())
        if child.tag == "DataSet" and child.get("file"):
            out.append((child.get("file"), names))
        out += _vtm_datasets(child, names if child.tag in ("Block", "Piece") else around)
    return out


def _piece_files(path, blocks=None) -> tuple[list[str], dict | None, int]:
    """Piece paths listed by a .pvtu / .pvtp / .vtm index, in document order, each checked to exist;
    plus the arrays a .pvtu / .pvtp declares ({association: {name: VTK type} or None where it has no
    P*Data element}; None for .vtm) and the index's size."""
    folder = os.path.dirname(os.path.abspath(path))
    nbytes = os.path.getsize(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise ValueError(f"read_vtk: {path} is not a valid VTK XML index ({exc}); rewrite it or read "
                         f"the pieces one by one") from None
    declared = None
    if path.lower().endswith(".vtm"):
        found = _vtm_datasets(root)
        if blocks is not None:
            known = sorted({n for _, names in found for n in names})
            unknown = [b for b in blocks if b not in known]
            if unknown:
                raise ValueError(f"read_vtk: {path} has no block(s) named {unknown}; its blocks and data sets are "
                                 f"{known}")
            found = [(f, names) for f, names in found if names & set(blocks)]
        files = [f for f, _ in found]
    else:
        declared = {assoc: None if root.find(f"./*/P{tag}") is None else
                    {e.get("Name"): e.get("type") for e in root.iterfind(f"./*/P{tag}/PDataArray")}
                    for assoc, tag in _ASSOCIATIONS.items()}
        ghost = root.find("./*[@GhostLevel]")
        if ghost is not None and ghost.get("GhostLevel", "0").strip() not in ("", "0"):
            raise ValueError(f"read_vtk: {path} has GhostLevel={ghost.get('GhostLevel')}: its pieces overlap, "
                             f"so their union would repeat rows; write it with ghost level 0")
        files = [e.get("Source") for e in root.iter("Piece") if e.get("Source")]
    if not files:
        raise ValueError(f"read_vtk: {path} lists no piece files (no <Piece Source=...> / <DataSet file=...>)")
    pieces = [os.path.join(folder, f) for f in files]
    missing = [p for p in pieces if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"read_vtk: {path} lists piece file(s) that do not exist: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; restore them or rewrite the index")
    return pieces, declared, nbytes


def _piece_header(path) -> tuple[_Header, int]:
    """Parse a piece's XML header up to its appended data (or its first inline Piece); (header, bytes)."""
    if not path.lower().endswith(_PIECE_SUFFIXES):
        raise ValueError(f"read_vtk: piece {path} is not a VTK XML dataset file (expected one of "
                         f"{_PIECE_SUFFIXES})")
    scan = _HeaderScan()
    nbytes = 0
    try:
        with open(path, "rb") as fh:
            carry = b""  # bytes not fed yet: the marker may straddle two chunks
            while scan.state is None:
                chunk = fh.read(_HEADER_CHUNK)
                nbytes += len(chunk)
                window = carry + chunk
                cut = window.find(_APPENDED)
                keep = len(_APPENDED) - 1
                if cut >= 0:
                    scan.feed(window[:cut], end="appended")
                elif not chunk:
                    scan.feed(window, end="eof")
                else:
                    split = max(len(window) - keep, 0)
                    scan.feed(window[:split])
                    carry = window[split:]
    except (ET.ParseError, UnicodeDecodeError) as exc:
        raise ValueError(f"read_vtk: piece {path} has a corrupt XML header ({exc}); rewrite the file") from None
    if scan.kind is None or scan.state == "eof":
        raise ValueError(f"read_vtk: piece {path} ends inside its XML header (truncated?); rewrite the file")
    complete = scan.state in ("appended", "closed")
    return _Header(path, scan.arrays, scan.points_type or "Float64", scan.counts if complete else None), nbytes


class _HeaderScan:
    """Incremental XML scan of a piece header: array names/types/components, points type, row counts.

    ``state`` becomes "appended" (reached the appended data), "closed" (the root element ended),
    "piece" (inline data: stopped after the first Piece, not reading the rest) or "eof" (truncated).
    """

    def __init__(self):
        self.parser = ET.XMLPullParser(events=("start", "end"))
        self.stack: list[str] = []
        self.arrays = {"cell": {}, "point": {}}
        self.counts = {"cell": 0, "point": 0}
        self.points_type = None
        self.kind = None
        self.inline = False
        self.state = None

    def feed(self, data: bytes, end: str | None = None) -> None:
        self.parser.feed(data)
        for event, el in self.parser.read_events():
            self._start(el) if event == "start" else self._end(el)
            if self.state is not None:
                return
        self.state = end

    def _start(self, el) -> None:
        self.stack.append(el.tag)
        if len(self.stack) == 1:
            self.kind = el.get("type")
        elif el.tag == "Piece":
            _count_rows(el, self.counts)
        elif el.tag == "DataArray":
            self.inline = self.inline or el.get("format", "appended") != "appended"
            parent = self.stack[-2]
            if parent in ("CellData", "PointData") and "Piece" in self.stack:
                assoc = "cell" if parent == "CellData" else "point"
                comps = int(el.get("NumberOfComponents", "1"))
                self.arrays[assoc].setdefault(el.get("Name"), (el.get("type"), comps))
            elif parent in ("Points", "Coordinates") and self.points_type is None:
                self.points_type = el.get("type")

    def _end(self, el) -> None:
        self.stack.pop()
        if el.tag == "Piece" and self.inline:
            self.state = "piece"  # inline data: the rest of the file is data, not header
        elif not self.stack:
            self.state = "closed"


def _count_rows(piece, counts) -> None:
    """Add a <Piece>'s row counts (unstructured / poly data); structured pieces give extents instead."""
    if piece.get("NumberOfPoints") is None:
        counts["cell"] = counts["point"] = None
        return
    if counts["point"] is None:
        return
    counts["point"] += int(piece.get("NumberOfPoints"))
    cells = [piece.get(a) for a in ("NumberOfCells", "NumberOfVerts", "NumberOfLines", "NumberOfStrips",
                                    "NumberOfPolys")]
    counts["cell"] += sum(int(c) for c in cells if c is not None)


def _plan(path, headers, arrays, association):
    """Names, dtypes, component counts and coords dtype, agreed from the headers alone (same on every rank)."""
    first = headers[0].arrays[association]
    names = list(arrays) if arrays is not None else [n for n, (t, _) in first.items() if t in _XML_DTYPES]
    dtypes, comps = {}, {}
    coord_dtype = torch.float32
    for h in headers:
        present = h.arrays[association]
        absent = [n for n in names if n not in present]
        if absent:
            raise ValueError(_missing_message(h.path, absent, association, h.arrays, index=path))
        for n in names:
            vtype, c = present[n]
            if vtype not in _XML_DTYPES:
                raise ValueError(f"read_vtk: {association} array {n!r} of {h.path} has type {vtype}, which "
                                 f"cannot become a tensor; leave it out of arrays=")
            if comps.setdefault(n, c) != c:
                raise ValueError(f"read_vtk: {association} array {n!r} has {c} components in {h.path} but "
                                 f"{comps[n]} in {headers[0].path}; the pieces disagree")
            dtypes[n] = torch.promote_types(dtypes.get(n, _XML_DTYPES[vtype]), _XML_DTYPES[vtype])
        coord_dtype = torch.promote_types(coord_dtype, _XML_DTYPES.get(h.points_type, torch.float64))
    return names, dtypes, comps, coord_dtype


def _missing_message(file, absent, association, present, index=None) -> str:
    where = f"{file} (a piece of {index})" if index else f"{file}"
    other = "point" if association == "cell" else "cell"
    hint = [a for a in absent if a in present.get(other, {})]
    hint = f" ({hint} exist as {other} data: pass association={other!r})" if hint else ""
    return (f"read_vtk: {where} has no {association} array(s) {absent}{hint}; {association} arrays present: "
            f"{sorted(present.get(association, {}))}")


def _read_piece(header, names, association, coord_dtype, dtypes):
    """Read one piece file with only ``names`` enabled; ({name: tensor}, coords)."""
    mesh = _vtk_read(header.path, names, association)
    rows = mesh.n_cells if association == "cell" else mesh.n_points
    expected = header.counts[association] if header.counts else None
    if expected is not None and rows != expected:
        raise ValueError(f"read_vtk: piece {header.path} gave {rows} {association}s but its header lists "
                         f"{expected}; the file is corrupt or truncated")
    values = _take(mesh, names, association, header.path)
    return {n: values[n].to(dtypes[n]) for n in names}, _coords(mesh, association).to(coord_dtype)


def _concat(parts, names, dtypes, comps, coord_dtype):
    """Stack the pieces' rows; a rank without pieces gets 0 rows of the agreed shapes and dtypes."""
    if not parts:
        empty = {n: torch.empty((0,) if comps[n] == 1 else (0, comps[n]), dtype=dtypes[n]) for n in names}
        return empty, torch.empty((0, 3), dtype=coord_dtype)
    arrays = {n: torch.cat([p[0][n] for p in parts]) for n in names}
    return arrays, torch.cat([p[1] for p in parts])


# --------------------------------------------------------------------------------------------
# monolithic files (slow path: one rank reads, then scatters)
# --------------------------------------------------------------------------------------------
def _read_monolithic(path, arrays, domain, association, src) -> VtkRead:
    """Rank ``src`` of the axis reads the whole file and scatters balanced row ranges."""
    from domainflow import Shard, scatter_tensor

    me = 0 if domain is None else domain.get_local_rank()
    error, values, coords, rows = None, None, None, 0
    if me == src:
        try:
            values, coords = _read_whole(path, arrays, association)
            rows = coords.shape[0]
        except Exception as exc:  # only the source sees it: hand it to the agreement below
            if domain is None:
                raise
            error = _describe(exc)
    mine = me == src
    out = VtkRead({}, None, os.path.getsize(path) if mine else 0, 0, [path] if mine else [])
    if domain is None:
        out.arrays, out.coords = values, coords
        return out
    world = domain.size()
    _agree(domain, error, rows, path)
    root = domain.mesh.flatten().tolist()[src]
    sizes = {0: [(r + 1) * rows // world - r * rows // world for r in range(world)]} if mine else None
    names = arrays if arrays is not None else _share_names(domain, list(values) if mine else None, src)
    out.arrays = {n: scatter_tensor(values[n] if mine else None, root, domain, [Shard(0)], sharding_shapes=sizes)
                  for n in names}
    out.coords = scatter_tensor(coords, root, domain, [Shard(0)], sharding_shapes=sizes)
    return out


def _read_whole(path, arrays, association):
    """Read a monolithic file (only the requested arrays where the reader can select); (values, coords)."""
    mesh = _vtk_read(path, arrays, association)
    data = mesh.cell_data if association == "cell" else mesh.point_data
    names = list(arrays) if arrays is not None else [n for n in data.keys() if _numeric(data[n])]
    values = _take(mesh, names, association, path)
    coords = _coords(mesh, association)
    return {n: values[n] for n in names}, coords


def _share_names(domain, names, src):
    """The source's array names on every rank of the axis (with arrays=None they are known only after
    reading, and every rank must scatter the same arrays in the same order)."""
    from domainflow import comm

    got = comm.all_gather_object(names, domain, 0)
    return got[src]


# --------------------------------------------------------------------------------------------
# VTK reading and cross-rank agreement
# --------------------------------------------------------------------------------------------
def _vtk_read(path, names, association):
    """Read ``path`` through pyvista with only ``names`` of ``association`` enabled; VTK's printed errors
    become a ValueError naming the file."""
    import pyvista as pv

    _quiet_vtk()
    with pv.VtkErrorCatcher(raise_errors=False, send_to_logging=False) as caught:
        try:
            reader = pv.get_reader(path)
        except Exception as exc:
            raise ValueError(f"read_vtk: {path} cannot be read as VTK ({_first_line(exc)})") from None
        _raise_caught(caught, path)
        if hasattr(reader, "disable_all_cell_arrays"):
            present = {"cell": dict.fromkeys(reader.cell_array_names), "point": dict.fromkeys(reader.point_array_names)}
            _raise_caught(caught, path)
            absent = [n for n in (names or ()) if n not in present[association]]
            if absent:
                raise ValueError(_missing_message(path, absent, association, present))
            reader.disable_all_cell_arrays()
            reader.disable_all_point_arrays()
            enable = reader.enable_cell_array if association == "cell" else reader.enable_point_array
            for n in (names if names is not None else present[association]):
                enable(n)
        try:
            mesh = reader.read()
        except Exception as exc:
            raise ValueError(f"read_vtk: {path} is corrupt or truncated ({_first_line(exc)})") from None
        _raise_caught(caught, path)
    if mesh is None or not hasattr(mesh, "n_cells") or not hasattr(mesh, "points"):
        raise ValueError(f"read_vtk: {path} did not give one dataset (got {type(mesh).__name__}); "
                         f"multi-block data belongs in a .vtm index")
    return mesh


def _take(mesh, names, association, path) -> dict:
    """The named arrays as tensors (file dtype, unsigned types widened); missing ones listed with the present."""
    data = mesh.cell_data if association == "cell" else mesh.point_data
    absent = [n for n in names if n not in data.keys()]
    if absent:
        present = {"cell": dict.fromkeys(mesh.cell_data.keys()), "point": dict.fromkeys(mesh.point_data.keys())}
        raise ValueError(_missing_message(path, absent, association, present))
    rows = mesh.n_cells if association == "cell" else mesh.n_points
    out = {}
    for n in names:
        a = np.asarray(data[n])
        if not _numeric(a):
            raise ValueError(f"read_vtk: {association} array {n!r} of {path} has dtype {a.dtype}, which cannot "
                             f"become a tensor; leave it out of arrays=")
        if a.shape[0] != rows:
            raise ValueError(f"read_vtk: {path}: array {n!r} has {a.shape[0]} values for {rows} {association}s; "
                             f"the file is corrupt")
        out[n] = torch.from_numpy(np.array(a, dtype=_NP_WIDEN.get(a.dtype, a.dtype), order="C"))  # owns its memory
    return out


def _numeric(a) -> bool:
    return np.asarray(a).dtype.kind in "iufb"


def _coords(mesh, association) -> torch.Tensor:
    """Cell centres (in the points' dtype) or points, as an (N, 3) tensor."""
    pts = np.asarray(mesh.points)
    if association == "cell":
        pts = np.asarray(mesh.cell_centers().points).astype(pts.dtype, copy=False)
    return torch.from_numpy(np.array(pts, order="C")).reshape(-1, 3)


def _agree(domain, error, rows, path) -> list[int]:
    """One all-gather of (failed, rows) over the axis; raise on every rank if any rank failed, else the
    per-rank row counts."""
    from domainflow import comm

    got = comm.all_gather_ints([int(error is not None), rows], domain)
    if not any(g[0] for g in got):
        return [g[1] for g in got]
    messages = comm.all_gather_object(error, domain, 0)  # failure path only: every rank shares why
    ranks = domain.mesh.flatten().tolist()
    failed = [f"rank {ranks[k]}: {m}" for k, m in enumerate(messages) if m is not None]
    raise ValueError(f"read_vtk({path}) failed on {len(failed)} rank(s):\n  " + "\n  ".join(failed))


def _wrap(local, domain, sizes):
    """Shard(0) ShardTensor over the axis from known per-rank row counts (no further communication)."""
    from domainflow import Shard, ShardTensor

    return ShardTensor.from_local(local, domain, [Shard(0)], sharding_shapes={0: sizes})


def _quiet_vtk() -> None:
    """Stop VTK printing to stderr; errors still reach pyvista's catcher."""
    from vtkmodules.vtkCommonCore import vtkLogger, vtkObject

    vtkLogger.SetStderrVerbosity(vtkLogger.VERBOSITY_OFF)
    vtkObject.GlobalWarningDisplayOn()


def _describe(exc) -> str:
    """A one-rank failure as text to share: ValueErrors as they are, anything else with its type."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _first_line(exc) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _raise_caught(caught, path) -> None:
    """Turn the VTK errors caught so far into a ValueError naming the file."""
    if caught.error_events:
        said = "; ".join(str(getattr(e, "alert", e)).strip().splitlines()[-1][:160]
                         for e in caught.error_events[:2])
        raise ValueError(f"read_vtk: {path} is corrupt or truncated (VTK: {said})")
