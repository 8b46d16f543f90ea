"""Read raw VTK files straight into ShardTensors: only the named arrays, each rank only its own pieces.

Partitioned files (``.pvtu``, ``.pvtp``, ``.vtm``) are read piecewise: the K piece files are split into
W contiguous, balanced ranges over the ranks of the domain axis, so no rank opens another rank's piece.
A monolithic file (``.vtu``, ``.vtp``, ``.vtk``, ...) is read whole by one rank and scattered: the slow
path for data not yet ingested (prefer ``domainflow ingest`` and the region readers).

Bad input raises on every rank together: everything that can be checked from the small XML headers is
checked identically on every rank before any collective; a failure only the reading rank can see
(corrupt binary data) is agreed on in the one all-gather that also carries the row counts.

The file-level work (index files, piece headers, reads through VTK) is the VTK layer's (``domainflow.vtk``);
this module spreads it over the ranks, turns arrays into tensors and agrees on the outcome. The layer's
``VtkFileError`` reaches the caller as a ``ValueError`` that starts with ``read_vtk:``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from domainflow.vtk.errors import MissingArraysError, VtkFileError
from domainflow.vtk.partitioned import ASSOCIATIONS, PARTITIONED_SUFFIXES, index_pieces, piece_header
from domainflow.vtk.pyvista_io import cell_centres, read_dataset

__all__ = ["read_vtk", "VtkRead", "PARTITIONED_SUFFIXES"]

# VTK XML type -> torch dtype; unsigned types wider than 8 bits widen to the next signed type, as the
# ShardTensor collectives carry only torch's common dtypes.
_XML_DTYPES = {
    "Int8": torch.int8, "UInt8": torch.uint8, "Int16": torch.int16, "UInt16": torch.int32,
    "Int32": torch.int32, "UInt32": torch.int64, "Int64": torch.int64, "UInt64": torch.int64,
    "Float32": torch.float32, "Float64": torch.float64,
}
_NP_WIDEN = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64, np.dtype(np.uint64): np.int64}


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
    if association not in ASSOCIATIONS:
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
    pieces, declared, nbytes = _layer(index_pieces, path, blocks)
    headers = []
    for p in pieces:
        h, n = _layer(piece_header, p)
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
def _layer(fn, *args):
    """A call into the VTK layer (``domainflow.vtk``) with its :class:`VtkFileError` as read_vtk's ValueError."""
    try:
        return fn(*args)
    except VtkFileError as exc:
        raise ValueError(f"read_vtk: {exc}") from None


def _vtk_read(path, names, association):
    """Read ``path`` through pyvista with only ``names`` of ``association`` enabled (None: all of them);
    VTK's errors become a ValueError naming the file."""
    try:
        mesh, _ = read_dataset(path, None if names is None else dict.fromkeys(names, association),
                               association=association)
    except MissingArraysError as exc:
        raise ValueError(_missing_message(path, list(exc.absent), association, exc.present)) from None
    except VtkFileError as exc:
        raise ValueError(f"read_vtk: {exc}") from None
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
        pts = cell_centres(mesh, pts.dtype)
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


def _describe(exc) -> str:
    """A one-rank failure as text to share: ValueErrors as they are, anything else with its type."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
