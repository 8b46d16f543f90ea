"""One location (surface or volume) of one run, streamed from its VTK XML file into the store in bounded
memory: the ingest's default path.

1. Blocks of cells: read that stretch of the connectivity, the points it refers to and the needed cell
   arrays (``vtk_xml``), compute centres (and surface normals and areas, ``mesh_geometry``), make the
   fields dimensionless, check them, and append every row to column files on local scratch disk.
   ``--volume-points K`` keeps the same K cells as the in-memory path (one seeded draw) and skips blocks
   holding none of them.
2. The exact RCB partition from the coordinate column (``partition.rcb_streaming``): the same parts and
   order as ``partition()`` in memory.
3. Rows copied part by part into reordered column files, then written into the store's arrays in whole
   chunks with statistics merged block by block.

Peak memory is set by ``block_cells`` (the ingest derives it from ``--memory-limit``), not by the run.
The in-memory path (``vtk_io.read_cells``, VTK's filters, ``partition()``) stays as the tests' oracle.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import numpy as np

from .errors import IngestError
from .mesh_geometry import cell_centres, polygon_normals_areas
from .parallel import count_cells
from .partition import partition, rcb_streaming
from .scratch import ScratchArray
from .stats import RunningStats
from .store_writer import chunk_options, chunk_rows, write_array
from .vtk_xml import VtkXmlFile

BYTES_PER_CELL = 2048  # working bytes per cell of a block (all columns, the gathered points, temporaries)
_POINT_GAP = 4096      # point ids further apart than this are read as separate stretches


def block_cells_for(memory_limit: int) -> int:
    """Cells per block so one block's working set stays well inside ``memory_limit`` bytes."""
    return int(min(max(memory_limit // (4 * BYTES_PER_CELL), 4096), 1 << 22))


class _BadRows:
    """NaN/Inf seen in an array over all blocks: the count and the first row, reported once at the end."""

    def __init__(self, what: str):
        self.what, self.count, self.first, self.total = what, 0, None, 0

    def add(self, values: np.ndarray, first_row: int) -> None:
        bad = ~np.isfinite(values)
        if bad.any():
            rows = bad.reshape(len(values), -1).any(axis=1)
            if self.first is None:
                self.first = first_row + int(np.argmax(rows))
            self.count += int(rows.sum())
        self.total += len(values)

    def check(self) -> None:
        if self.count:
            raise IngestError(f"{self.what}: {self.count} of {self.total} cells hold NaN/Inf (first at cell "
                              f"{self.first}); fix or drop this run (--on-error skip records it and carries on)")


def stream_location(path: Path, shown_as: Path, loc: str, specs, opts, run_id: str, group, scratch: Path,
                    warnings: list, cp_check: str | None, block_cells: int) -> tuple[dict, int, int]:
    """Ingest ``loc`` of one run from ``path`` into ``group[loc]``; returns (statistics, rows, raw bytes)."""
    with VtkXmlFile(path) as f, contextlib.ExitStack() as scratch_files:
        name = shown_as
        section = _check_mesh(f, loc, name)
        n = f.cell_counts()[section]
        if n == 0:
            raise IngestError(f"{name}: VTK read no cells; the file is empty, truncated or not a mesh")
        sources = _check_arrays(f, [s.source for s in specs], name)
        check_cp = cp_check if cp_check and cp_check in f.array_names("cell") else None
        keep = None
        if loc == "volume" and opts.volume_points and n > opts.volume_points:
            keep = np.sort(np.random.default_rng([opts.seed, int(run_id[4:])])
                           .choice(n, opts.volume_points, replace=False))
        rows = n if keep is None else len(keep)
        tag = f"{run_id}-{loc}-{uuid.uuid4().hex[:8]}"

        def column(key, dtype, tail=()):
            arr = ScratchArray(scratch / f"{tag}-{key}", rows, dtype, tail)
            scratch_files.callback(arr.close)
            return arr

        geometry = ["coords"] + (["normals", "areas"] if loc == "surface" else [])
        cols = {"coords": column("coords", np.float32, (3,)), "order": column("order", np.int64)}
        if loc == "surface":
            cols["normals"] = column("normals", np.float32, (3,))
            cols["areas"] = column("areas", np.float32)
        for s in specs:
            cols[f"field/{s.name}"] = column(f"field-{s.name}", np.float32, (s.components,))
        bad = {s.source: _BadRows(f"{name} array {s.source!r}") for s in specs}
        bad_scaled = {s.source: _BadRows(f"{name} array {s.source!r} made dimensionless "
                                         f"(scale {s.scale_offset(opts.reference)[0]:g})") for s in specs}
        bad_geo = {k: _BadRows(f"{name} {k}") for k in geometry}
        nonpositive = 0
        cp = np.zeros(3)  # dot(theirs, ours), dot(ours, ours), all of theirs finite (1) or not (0)
        cp[2] = 1.0
        out = 0
        for c0 in range(0, n, block_cells):
            c1 = min(c0 + block_cells, n)
            pick = None
            if keep is not None:
                a, b = np.searchsorted(keep, [c0, c1])
                if a == b:
                    count_cells(c1 - c0)
                    continue
                pick = keep[a:b] - c0
            sizes, conn = f.cell_block(c0, c1, section)
            pts, local = _points_of(f, conn)
            types = f.cell_types(c0, c1) if loc == "volume" else None
            geo = {"coords": cell_centres(sizes, local, pts, types=types)}
            if loc == "surface":
                geo["normals"], areas = polygon_normals_areas(sizes, local, pts)
                geo["areas"] = areas
                nonpositive += int((areas <= 0).sum())
            block = {k: v.astype(np.float32) for k, v in geo.items()}
            block["order"] = np.arange(c0, c1, dtype=np.int64)
            for s in specs:
                values = np.asarray(f.read("cell", s.source, c0, c1), dtype=np.float32).reshape(c1 - c0, -1)
                if values.shape[1] != s.components:
                    raise IngestError(f"{name}: array {s.source!r} has {values.shape[1]} components, "
                                      f"expected {s.components}")
                bad[s.source].add(values, c0)
                scale, offset = s.scale_offset(opts.reference)
                scaled = (values - np.float32(offset)) * np.float32(1.0 / scale)
                bad_scaled[s.source].add(scaled, c0)
                block[f"field/{s.name}"] = scaled
            for k in geometry:
                bad_geo[k].add(block[k], c0)
            if check_cp:
                theirs = np.asarray(f.read("cell", check_cp, c0, c1), dtype=np.float64)
                ours = block["field/Cp"][:, 0]
                cp[2] *= float(np.isfinite(theirs).all())
                if cp[2]:
                    cp[0] += float(np.dot(theirs, ours))
                    cp[1] += float(np.dot(ours, ours))
            if pick is not None:
                block = {k: v[pick] for k, v in block.items()}
            m = len(block["order"])
            for k, v in block.items():
                cols[k].write(out, v)
            out += m
            count_cells(c1 - c0)
        # the in-memory path's order: areas, then each array raw and dimensionless, then the geometry
        if nonpositive:
            raise IngestError(f"{name}: {nonpositive} surface cells have zero or negative area; the mesh is degenerate")
        for s in sources:
            bad[s].check()
            bad_scaled[s].check()
        for k in geometry:
            bad_geo[k].check()
        if check_cp and cp[2] and cp[1] > 0:
            _warn_cp(cp[0] / cp[1], name, opts, warnings)
        sub = group.create_group(loc)
        stats = _write_partitioned(sub, cols, rows, opts, scratch, tag, scratch_files, block_cells)
        return stats, rows, f.src.size


def _check_mesh(f: VtkXmlFile, loc: str, name) -> str:
    """The topology section whose cells are the rows: Polys of a surface, Cells of a volume."""
    if loc == "surface":
        if f.kind != "PolyData":
            raise IngestError(f"{name}: corrupt or truncated VTK file: it holds {f.kind}, a surface must be "
                              f"PolyData (.vtp)")
        counts = f.cell_counts()
        others = {"line": counts["Lines"], "vertex": counts["Verts"], "strip": counts["Strips"]}
        if any(others.values()) or not counts["Polys"]:
            found = ", ".join(f"{v} {k} cells" for k, v in others.items() if v)
            raise IngestError(f"{name}: a surface must consist of polygons only, found {found or 'no cells'}")
        return "Polys"
    if f.kind != "UnstructuredGrid":
        raise IngestError(f"{name}: corrupt or truncated VTK file: it holds {f.kind}, a volume must be an "
                          f"UnstructuredGrid (.vtu)")
    return "Cells"


def _check_arrays(f: VtkXmlFile, arrays: list[str], name) -> list[str]:
    present_cell, present_point = f.array_names("cell"), f.array_names("point")
    absent = [a for a in arrays if a not in present_cell]
    if absent:
        hint = ""
        as_points = [a for a in absent if a in present_point]
        if as_points:
            hint = f" ({as_points} exist as POINT data; the DrivaerML layout stores them as CELL data)"
        raise IngestError(f"{name}: missing cell array(s) {absent}{hint}; cell arrays present: "
                          f"{present_cell}, point arrays present: {present_point}")
    return arrays


def _points_of(f: VtkXmlFile, conn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The points a block's connectivity refers to, read stretch by stretch (only the ids used, in runs
    closer than ``_POINT_GAP``); returns (points, connectivity re-indexed into them)."""
    if not len(conn):
        return np.zeros((0, 3)), conn
    if conn.min() < 0 or conn.max() >= f.n_points:
        raise IngestError(f"{f.path}: the connectivity refers to point {int(conn.max())} of {f.n_points} (or a "
                          f"negative id): a corrupt file")
    first, span = int(conn.min()), int(conn.max()) - int(conn.min()) + 1
    if span <= 8 * len(conn):  # ids in a compact range (the usual numbering): a mask, no sort
        mask = np.zeros(span, dtype=bool)
        mask[conn - first] = True
        used = np.flatnonzero(mask) + first
        local = (np.cumsum(mask) - 1)[conn - first]
    else:
        used = np.unique(conn)
        local = np.searchsorted(used, conn)
    cuts = np.flatnonzero(np.diff(used) > _POINT_GAP) + 1
    parts = []
    for run in np.split(used, cuts):
        stretch = f.points(int(run[0]), int(run[-1]) + 1)
        parts.append(stretch[run - run[0]])
    return np.concatenate(parts) if len(parts) > 1 else parts[0], local


def _warn_cp(ratio: float, name, opts, warnings: list) -> None:
    if abs(ratio - 1) > 0.01:
        u = opts.reference.u_inf / np.sqrt(ratio) if ratio > 0 else float("nan")
        warnings.append(f"{name}: Cp from pMeanTrim with U_inf={opts.reference.u_inf} is {1 / ratio:.3f}x the "
                        f"file's CpMeanTrim; the data were made dimensionless with U_inf ~ {u:.3f} "
                        f"(pass --u-inf / --rho-inf to match)")


def _write_partitioned(sub, cols: dict, rows: int, opts, scratch: Path, tag: str, scratch_files,
                       block_cells: int) -> dict:
    """Partition by the coordinates, reorder every column part by part, write the store arrays in whole
    chunks; returns the per-array statistics."""
    coords = cols["coords"]
    reordered = {}
    for k, col in cols.items():
        reordered[k] = ScratchArray(scratch / f"{tag}-sorted-{k.replace('/', '-')}", rows, col.dtype, col.tail)
        scratch_files.callback(reordered[k].close)
    if opts.method == "rcb":
        part_of = ScratchArray(scratch / f"{tag}-part", rows, np.uint32)
        scratch_files.callback(part_of.close)
        offsets, boxes = rcb_streaming(coords, opts.parts, block_cells, part_of)
        filled = offsets[:-1].copy()  # next free row of each part
        for lo, hi in coords.blocks(block_cells):
            part = part_of.read(lo, hi)
            small = part.astype(np.uint16) if opts.parts <= 1 << 16 else part  # radix-sorted when small
            order = np.argsort(small, kind="stable")  # within a part rows keep file order
            part = part.astype(np.int64)
            counts = np.bincount(part, minlength=opts.parts)
            starts = np.concatenate([[0], np.cumsum(counts)])
            for k, col in cols.items():
                values = col.read(lo, hi)[order]
                for q in np.flatnonzero(counts):
                    reordered[k].write(int(filled[q]), values[starts[q]:starts[q + 1]])
            filled += counts
    else:  # morton / slab sort all rows by a key: in memory, one column at a time (O(rows) memory)
        p = partition(coords.read(0, rows), opts.parts, opts.method)
        offsets, boxes = p.offsets, p.boxes
        for k, col in cols.items():
            reordered[k].write(0, col.read(0, rows)[p.order])
        del p
    stats = {}
    for k, col in reordered.items():
        target = sub.require_group("fields") if k.startswith("field/") else sub
        key = k.split("/", 1)[1] if k.startswith("field/") else k
        channels = int(np.prod(col.tail, dtype=np.int64)) if col.tail else 1
        merged = None if k == "order" else RunningStats.empty(channels)
        chunks = (min(max(1, rows), chunk_rows(col.row_bytes, opts.chunk_bytes)),) + col.tail
        arr = target.create_array(key, shape=col.shape, chunks=chunks, dtype=col.dtype, attributes={},
                                  **chunk_options())
        step = chunks[0] * max(1, block_cells // chunks[0])  # whole chunks per write
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            values = col.read(lo, hi)
            arr[lo:hi] = values
            if merged is not None:
                merged = merged.merge(RunningStats.of(values))
        if merged is not None:
            stats[key] = merged.to_attrs()
    write_array(sub, "parts", offsets.astype(np.int64), opts.chunk_bytes)
    write_array(sub, "part_boxes", boxes.astype(np.float32), opts.chunk_bytes)
    return stats
