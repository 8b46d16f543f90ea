"""One location (surface or volume) of one run, streamed from its VTK XML file into the store in bounded
memory: the ingest's default path, in three stages that run as separate dask tasks, so one huge run
keeps every worker busy.

1. ``scan_cells`` (one task per stretch of cells; a file larger than ``--task-bytes`` gets several):
   blocks of cells: read that stretch of the connectivity and the points it refers to (``domainflow.vtk.xml_reader``),
   compute centres (and surface normals and areas, ``mesh_geometry``), check them, and append every row
   to column files on scratch disk. The fields are not read here (their column tasks read them).
   ``--volume-points K`` keeps the same K cells as the in-memory path (one seeded draw), skips blocks
   holding none of them and writes the kept cells' ids.
2. ``partition_location`` (one task): the geometry checks over all stretches (the first bad cell is
   named), then the partition from the coordinate column: ``partition()`` in memory when the location has at most
   ``IN_MEMORY_BLOCKS`` blocks of rows, else out of core with the same parts and order
   (``partition.rcb_streaming``; morton/slab: ``partition.key_order_streaming``, a sample sort). It leaves
   each row's group (its part; for morton/slab out of core a bucket of about half a block), per block the
   permutation that sorts its rows by group, and for morton/slab the permutation that sorts each run of
   whole groups by key. On several workers an out-of-core RCB stops after its first levels: then
   ``partition_subtree`` (one task per subtree, in parallel) partitions each subtree's rows and
   ``merge_subtrees`` puts every row's part back in file order.
3. ``write_column`` (one task per column: coordinates, each field, ...; a field read from the raw file
   here, made dimensionless and checked, ``FieldColumn``, so no field passes through scratch disk): rows
   copied group by group into a reordered column file (morton/slab: then sorted by key a window at a
   time, in place; a small location all in memory), then written into the store's array in whole chunks
   with statistics merged block by block (the coordinates task also finds the part boxes after a sample
   sort).

Every stage can run again (a cluster reruns the tasks of a lost worker): inputs are removed only when the
run is published.

Peak memory per task is set by ``block_cells`` (the ingest derives it from ``--memory-limit``), not by the
run. The in-memory path (``domainflow.vtk.pyvista_io.read_cells``, VTK's filters, ``partition()``) is ``reader="vtk"``, what the
tests compare this path with.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from domainflow.vtk.xml_reader import VtkXmlFile

from .errors import IngestError
from .mesh_edges import StreamedEdges, side_keys
from .mesh_geometry import cell_centres, polygon_normals_areas
from .parallel import count_cells
from .partition import group_perm, group_rows, key_order_streaming, partition, rcb_streaming
from .scratch import CellIds, JoinedColumns, RowRange, ScratchArray, row_blocks
from .stats import RunningStats
from .store_writer import chunk_rows, create_array, write_array

BYTES_PER_CELL = 2048  # working bytes per cell of a block (all columns, the gathered points, temporaries)
# a location of at most this many blocks of rows is partitioned, and its columns reordered, in memory
# (``partition()``: about 80 B per row, a column at most ~40 B per row, within one block's working set of
# BYTES_PER_CELL per cell); larger ones out of core. Both give the same parts, order and columns
# (tests/data/test_partition.py, test_ingest_streaming.py), so the choice changes only time and memory.
IN_MEMORY_BLOCKS = 8


def block_cells_for(memory_limit: int) -> int:
    """Cells per block so one block's working set stays well inside ``memory_limit`` bytes."""
    return int(min(max(memory_limit // (4 * BYTES_PER_CELL), 4096), 1 << 22))


class _BadRows:
    """NaN/Inf seen in an array over all blocks: the count and the first row, reported once at the end."""

    def __init__(self, what: str):
        self.what, self.count, self.first, self.total = what, 0, None, 0

    def add(self, values: np.ndarray, first_row: int, ids: np.ndarray | None = None) -> None:
        """Rows of cells ``first_row, first_row + 1, ...`` (or of the cells ``ids``)."""
        bad = ~np.isfinite(values)
        if bad.any():
            rows = bad.reshape(len(values), -1).any(axis=1)
            if self.first is None:
                k = int(np.argmax(rows))
                self.first = first_row + k if ids is None else int(ids[k])
            self.count += int(rows.sum())
        self.total += len(values)

    @classmethod
    def merged(cls, parts: list) -> "_BadRows":
        """One record from the records of consecutive stretches of cells (in cell order)."""
        out = cls(parts[0].what)
        for p in parts:
            if out.first is None and p.first is not None:
                out.first = p.first
            out.count += p.count
            out.total += p.total
        return out

    def check(self) -> None:
        if self.count:
            raise IngestError(f"{self.what}: {self.count} of {self.total} cells hold NaN/Inf (first at cell "
                              f"{self.first}); fix or drop this run (--on-error skip records it and carries on)")


def scan_tasks_for(raw_bytes: int, task_bytes: int) -> int:
    """How many ``scan_cells`` tasks read a file of ``raw_bytes`` (one per ``task_bytes`` started)."""
    return max(1, -(-int(raw_bytes) // max(1, int(task_bytes))))


def _kept_cells(n: int, loc: str, opts, run_id: str):
    """The cells ``--volume-points`` keeps (sorted; the in-memory path's draw), or None for all."""
    if loc == "volume" and opts.volume_points and n > opts.volume_points:
        return np.sort(np.random.default_rng([opts.seed, int(run_id[4:])]).choice(n, opts.volume_points,
                                                                                   replace=False))
    return None


def scan_cells(path: Path, shown_as: Path, loc: str, specs, opts, run_id: str, scratch: Path, tag: str,
               piece: int, pieces: int, block_cells: int) -> dict:
    """Stage 1: the geometry of cells ``[piece*n//pieces, (piece+1)*n//pieces)`` of ``loc`` into column
    files under ``scratch`` (kept for the later stages); returns where they are and what the checks saw.
    The fields' arrays are only checked to be there: each field's column task reads its array itself."""
    with VtkXmlFile(path) as f, contextlib.ExitStack() as on_error:
        name = shown_as
        section = _check_mesh(f, loc, name)
        n = f.cell_counts()[section]
        if n == 0:
            raise IngestError(f"{name}: VTK read no cells; the file is empty, truncated or not a mesh")
        _check_arrays(f, specs, name)
        keep = _kept_cells(n, loc, opts, run_id)
        first, end = piece * n // pieces, (piece + 1) * n // pieces
        if keep is not None:
            keep = keep[np.searchsorted(keep, first):np.searchsorted(keep, end)]
        rows = end - first if keep is None else len(keep)

        cols, files = {}, {}

        def column(key, dtype, tail=()):
            target = scratch / f"{tag}.{piece}.{key.replace('/', '-')}"
            cols[key] = ScratchArray(target, rows, dtype, tail)
            files[key] = (str(target), np.dtype(dtype).str, tuple(tail))
            on_error.callback(cols[key].close)  # removed unless the scan finishes

        geometry = ["coords"] + (["normals", "areas"] if loc == "surface" else [])
        column("coords", np.float32, (3,))
        if keep is not None:
            column("order", np.int64)  # the kept cells' ids
        else:
            files["order"] = None  # all cells in file order: their ids need no file (CellIds)
        if loc == "surface":
            column("normals", np.float32, (3,))
            column("areas", np.float32)
        bad_geo = {k: _BadRows(f"{name} {k}") for k in geometry}
        nonpositive = 0
        out = 0
        for c0 in range(first, end, block_cells):
            c1 = min(c0 + block_cells, end)
            pick = None
            if keep is not None:
                a, b = np.searchsorted(keep, [c0, c1])
                if a == b:
                    count_cells(c1 - c0)
                    continue
                pick = keep[a:b] - c0
            sizes, conn = f.cell_block(c0, c1, section)
            pts, local = f.points_of(conn)
            types = f.cell_types(c0, c1) if section == "Cells" else None
            if loc == "surface" and types is not None:
                _check_polygons(types, c0, name)
            geo = {"coords": cell_centres(sizes, local, pts, types=types)}
            if loc == "surface":
                geo["normals"], areas = polygon_normals_areas(sizes, local, pts)
                geo["areas"] = areas
                nonpositive += int((areas <= 0).sum())
            block = {k: v.astype(np.float32) for k, v in geo.items()}
            block["order"] = np.arange(c0, c1, dtype=np.int64)
            for k in geometry:
                bad_geo[k].add(block[k], c0)
            if pick is not None:
                block = {k: v[pick] for k, v in block.items()}
            for k, col in cols.items():
                col.write(out, block[k])
            out += len(block["order"])
            count_cells(c1 - c0)
        on_error.pop_all()
        for arr in cols.values():
            arr.close(remove=False)
        return {"rows": rows, "files": files, "bad_geo": bad_geo, "nonpositive": nonpositive,
                "raw_bytes": f.src.size, "cell_counts": f.cell_counts(), "geometry": geometry}


def partition_location(scans: list, loc: str, shown_as, opts, group_dir: Path, scratch: Path, tag: str,
                       block_cells: int, split_depth: int = 0) -> dict:
    """Stage 2: the checks over every scanned stretch (in the in-memory path's order), then the partition
    of all rows and the per-block sorting permutation; creates the location's group with its ``parts`` and
    ``part_boxes``; returns the partition the ``write_column`` tasks follow (and any warning). RCB out of core with
    ``split_depth`` D > 0: only the first D levels here, the rows of each of the 2**D subtrees grouped for
    ``partition_subtree`` tasks (in parallel) and ``merge_subtrees``, which then completes the partition."""
    import zarr

    first = scans[0]
    nonpositive = sum(s["nonpositive"] for s in scans)
    columns = {k: [s["files"][k] for s in scans] for k in first["files"]}
    try:
        if nonpositive:
            raise IngestError(f"{shown_as}: {nonpositive} surface cells have zero or negative area; the mesh is "
                              f"degenerate")
        for k in first["geometry"]:
            _BadRows.merged([s["bad_geo"][k] for s in scans]).check()
        rows = sum(s["rows"] for s in scans)
        parted = {"rows": rows, "columns": columns, "method": opts.method, "block_cells": block_cells,
                "group": str(Path(group_dir) / loc), "source": str(shown_as), "warnings": [], "location": loc,
                "raw_bytes": first["raw_bytes"], "cell_counts": first["cell_counts"]}
        with contextlib.ExitStack() as stack:
            coords = JoinedColumns.open(columns["coords"])
            stack.callback(coords.close)

            def scratch_array(name, dtype, tail=(), keep=True):
                arr = ScratchArray(scratch / f"{tag}.{name}", rows, dtype, tail)
                stack.callback(arr.close, not keep)  # kept: later stages read them
                parted[name] = str(arr.path)
                return arr

            parted["group_of"], parted["perm"], parted["inner"], windows = None, None, None, None
            if rows <= IN_MEMORY_BLOCKS * block_cells:  # fits the budget: partition() in memory, and each
                # column task takes its rows in the partition's order in memory (one permutation for all)
                p = partition(coords.read(0, rows), opts.parts, opts.method)
                offsets, groups, boxes = p.offsets, p.offsets, p.boxes
                scratch_array("take", np.uint32).write(0, p.order.astype(np.uint32))
                del p
            elif opts.method == "rcb":  # out of core: the same parts
                group_of, perm = scratch_array("group_of", np.uint32), scratch_array("perm", np.uint32)
                nodes = 1 << split_depth if 0 < split_depth < opts.parts.bit_length() - 1 else opts.parts
                offsets, boxes = rcb_streaming(coords, nodes, block_cells, group_of)
                groups = offsets
                for lo, hi in coords.blocks(block_cells):
                    group_perm(group_of.read(lo, hi), perm, lo, nodes)
                if nodes < opts.parts:  # the subtrees' rows together, for their own tasks
                    grouped = scratch_array("subtree-coords", coords.dtype, coords.tail)
                    group_rows(coords, group_of, perm, offsets, grouped, block_cells)
                    scratch_array("subtree-parts", np.uint32)
                    parted.update(subtrees=offsets, subtree_parts=opts.parts // nodes)
                    offsets = boxes = None  # merge_subtrees writes them
            else:  # out of core: the same order, by a sample sort (inner: the sort within its windows); the
                # coords task finds the boxes
                group_of, perm = scratch_array("group_of", np.uint32), scratch_array("perm", np.uint32)
                k = key_order_streaming(coords, opts.parts, opts.method, block_cells,
                                        scratch_array("keys", np.uint64, keep=False), group_of, perm,
                                        scratch_array("sorted-keys", np.uint64, keep=False),
                                        scratch_array("inner", np.uint32))
                offsets, groups, windows, boxes = k.offsets, k.groups, k.windows, None
            parted.update(groups=groups, windows=windows, boxes_from_coords=boxes is None and "subtrees" not in parted)
        sub = zarr.open_group(parted["group"], mode="w", zarr_format=3)
        sub.create_group("fields")
        if "subtrees" not in parted:
            _write_parts(parted, offsets, boxes, opts)
        return parted
    except BaseException:
        remove_files([f for files in columns.values() for f in files])
        raise


def _write_parts(parted: dict, offsets: np.ndarray, boxes, opts) -> None:
    import zarr

    parted["offsets"] = offsets
    sub = zarr.open_group(parted["group"], mode="r+")
    write_array(sub, "parts", offsets.astype(np.int64), opts.chunk_bytes, overwrite=True)
    if boxes is not None:
        write_array(sub, "part_boxes", boxes.astype(np.float32), opts.chunk_bytes, overwrite=True)


def partition_subtree(parted: dict, j: int, opts) -> dict | None:
    """Stage 2b (one task per subtree, when the partition task split the RCB): subtree j's rows, together in
    the grouped coordinates in file order, partitioned into its parts exactly as the whole RCB would (in
    memory when small); their local parts go to the subtree's rows of ``subtree-parts``."""
    if "subtrees" not in parted:
        return None
    lo, hi = int(parted["subtrees"][j]), int(parted["subtrees"][j + 1])
    block_cells, parts = parted["block_cells"], parted["subtree_parts"]
    coords = ScratchArray.open(parted["subtree-coords"], np.float32, (3,))
    ids = ScratchArray.open(parted["subtree-parts"], np.uint32)
    try:
        mine, mine_ids = RowRange(coords, lo, hi), RowRange(ids, lo, hi)
        if hi - lo <= IN_MEMORY_BLOCKS * block_cells:
            p = partition(mine.read(0, hi - lo), parts, "rcb")
            local = np.empty(hi - lo, np.uint32)
            local[p.order] = np.repeat(np.arange(parts, dtype=np.uint32), np.diff(p.offsets))
            mine_ids.write(0, local)
            return {"counts": np.diff(p.offsets), "boxes": p.boxes}
        offsets, boxes = rcb_streaming(mine, parts, block_cells, mine_ids)
        return {"counts": np.diff(offsets), "boxes": boxes}
    finally:
        coords.close(remove=False)
        ids.close(remove=False)


def merge_subtrees(parted: dict, subtrees: list, scratch: Path, tag: str, opts) -> dict:
    """Stage 2c: every row's part in file order from its subtree and its part within it (rows of a subtree
    keep file order in the grouped columns), the per-block permutation by part, the part offsets and boxes.
    Without a split the partition is already complete."""
    if "subtrees" not in parted:
        return parted
    rows, block_cells, nodes = parted["rows"], parted["block_cells"], len(parted["subtrees"]) - 1
    k = parted["subtree_parts"]
    offsets = np.concatenate([[0], np.cumsum(np.concatenate([s["counts"] for s in subtrees]))]).astype(np.int64)
    boxes = np.concatenate([s["boxes"] for s in subtrees])
    out = dict(parted, groups=offsets, scratch=[parted["group_of"], parted["perm"], parted["subtree-coords"],
                                               parted["subtree-parts"]])
    with contextlib.ExitStack() as stack:
        opened = []
        for name, dtype in (("group_of", np.uint32), ("perm", np.uint32), ("subtree-parts", np.uint32)):
            opened.append(ScratchArray.open(parted[name], dtype))
            stack.callback(opened[-1].close, False)
        node_of, node_perm, local = opened
        final = {}
        for name in ("part_of", "part_perm"):
            final[name] = ScratchArray(scratch / f"{tag}.{name}", rows, np.uint32)
            stack.callback(final[name].close, False)
        filled = np.asarray(parted["subtrees"][:-1], dtype=np.int64).copy()
        for lo, hi in node_of.blocks(block_cells):
            node = node_of.read(lo, hi)
            counts = np.bincount(node, minlength=nodes)
            by_node = np.concatenate([local.read(int(filled[j]), int(filled[j] + counts[j])) + np.uint32(j * k)
                                      for j in np.flatnonzero(counts)])
            part = np.empty(hi - lo, np.uint32)
            part[node_perm.read(lo, hi)] = by_node  # back to file order
            final["part_of"].write(lo, part)
            group_perm(part, final["part_perm"], lo, opts.parts)
            filled += counts
    out.update(group_of=str(final["part_of"].path), perm=str(final["part_perm"].path))
    _write_parts(out, offsets, boxes, opts)
    return out


class FieldColumn:
    """A field's rows read from the raw file by its own column task, in cell order and each once: made
    dimensionless and checked as they pass (NaN/Inf, before and after scaling; the surface's Cp against
    the file's ``CpMeanTrim``), read like a scratch column. Kept cells of ``--volume-points`` only: their
    ids come from the ``order`` column, and stretches of cells holding none are not read."""

    def __init__(self, parted: dict, spec, opts, cp_check: str | None = None):
        self.spec, self.opts, self.name = spec, opts, parted["source"]
        self.n, self.block = parted["rows"], parted["block_cells"]
        self.dtype, self.tail = np.dtype(np.float32), (spec.components,)
        self.row_bytes = 4 * spec.components
        self.scale, self.offset = spec.scale_offset(opts.reference)
        self.bad = _BadRows(f"{self.name} array {spec.source!r}")
        self.bad_scaled = _BadRows(f"{self.name} array {spec.source!r} made dimensionless (scale {self.scale:g})")
        order = parted["columns"]["order"]
        self.ids = None if order[0] is None else JoinedColumns.open(order)
        try:
            self.f = VtkXmlFile(parted["source"])
            if self.f.src.size != parted["raw_bytes"] or self.f.cell_counts() != parted["cell_counts"]:
                raise IngestError(f"{self.name} changed while the run was ingested ({self.f.src.size} bytes, cells "
                                  f"{self.f.cell_counts()}; its scan saw {parted['raw_bytes']} bytes, cells "
                                  f"{parted['cell_counts']}); rerun the ingest once the file is complete")
        except BaseException:
            if self.ids is not None:
                self.ids.close()
            if hasattr(self, "f"):
                self.f.close()
            raise
        self.section = _check_mesh(self.f, parted["location"], self.name)
        self.cp_check = cp_check if cp_check and cp_check in self.f.array_names(spec.association) else None
        self.cp = np.array([0.0, 0.0, 1.0])  # dot(theirs, ours), dot(ours, ours), all of theirs finite
        self.next = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n,) + self.tail

    def blocks(self, rows: int):
        return row_blocks(self.n, rows)

    def read(self, lo: int, hi: int) -> np.ndarray:
        if lo != self.next:
            raise RuntimeError(f"{self.name}: field rows read out of order ({lo}, expected {self.next})")
        self.next = hi
        ids = None if self.ids is None else self.ids.read(lo, hi)
        c0, c1 = (lo, hi) if ids is None else (int(ids[0]), int(ids[-1]) + 1) if hi > lo else (0, 0)
        out = []
        for a in range(c0, c1, self.block):  # a block of cells at a time; with kept ids, only blocks holding some
            b = min(a + self.block, c1)
            pick = None
            if ids is not None:
                i, j = np.searchsorted(ids, [a, b])
                if i == j:
                    continue
                pick = ids[i:j] - a
            out.append(self._cells(a, b, pick))
        if not out:
            return np.zeros((0,) + self.tail, np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _raw(self, name: str, a: int, b: int) -> np.ndarray:
        """Cells ``[a, b)`` of array ``name``, shape (cells, components): read, or averaged from its points."""
        if self.spec.association == "cell":
            return np.asarray(self.f.read("cell", name, a, b)).reshape(b - a, -1)
        sizes, conn = self.f.cell_block(a, b, self.section)
        values, local = self.f.point_rows_of(conn, lambda lo, hi: self.f.read("point", name, lo, hi))
        return cell_means(sizes, local, np.asarray(values, dtype=np.float64).reshape(len(values), -1))

    def _cells(self, a: int, b: int, pick) -> np.ndarray:
        s = self.spec
        parts = [self._raw(name, a, b) for name in s.sources]
        values = np.asarray(parts[0] if len(parts) == 1 else np.column_stack(parts), dtype=np.float32)
        if values.shape[1] != s.components:
            raise IngestError(f"{self.name}: array {s.source!r} has {values.shape[1]} components, expected "
                              f"{s.components}")
        ids = None
        if pick is not None:  # only the kept cells are checked and stored
            values, ids = values[pick], pick + a
        self.bad.add(values, a, ids)
        scaled = (values - np.float32(self.offset)) * np.float32(1.0 / self.scale)
        self.bad_scaled.add(scaled, a, ids)
        if self.cp_check:
            theirs = np.asarray(self._raw(self.cp_check, a, b), dtype=np.float64).reshape(-1)
            self.cp[2] *= float(np.isfinite(theirs).all())
            if self.cp[2]:
                self.cp[0] += float(np.dot(theirs, scaled[:, 0]))
                self.cp[1] += float(np.dot(scaled[:, 0], scaled[:, 0]))
        return scaled

    def finish(self) -> list[str]:
        """After every row went through: the checks (an IngestError naming the first bad cell), then any
        warning about the reference values."""
        if self.next != self.n:
            raise RuntimeError(f"{self.name}: {self.next} of {self.n} field rows read")
        self.bad.check()
        self.bad_scaled.check()
        warnings = []
        if self.cp_check and self.cp[2] and self.cp[1] > 0:
            _warn_cp(self.cp[0] / self.cp[1], self.name, self.opts, warnings, self.spec.source, self.cp_check)
        return warnings

    def close(self, remove: bool = False) -> None:
        self.f.close()
        if self.ids is not None:
            self.ids.close()


def write_column(parted: dict, key: str, opts, field=None, cp_check: str | None = None) -> dict:
    """Stage 3: column ``key`` reordered into its parts and written into the store's array in whole chunks;
    returns its statistics (none for ``order``) and any warning. A field (``field``: its FieldSpec) is read
    from the raw file here (``FieldColumn``), the geometry and kept cell ids from the scan's files."""
    import zarr

    rows, block_cells = parted["rows"], parted["block_cells"]
    with contextlib.ExitStack() as stack:
        if field is not None:
            col = FieldColumn(parted, field, opts, cp_check)
        else:
            files = parted["columns"][key]
            col = CellIds(rows) if files[0] is None else JoinedColumns.open(files)
        stack.callback(col.close)  # the scan files stay until the run is published: a rerun reads them again
        if parted.get("take"):  # small: reordered in memory by the partition's order, no scratch copy
            take = ScratchArray.open(parted["take"], np.uint32)
            stack.callback(take.close, False)
            reordered = col.read(0, rows)[take.read(0, rows)]
        else:  # parts (or buckets) together a block at a time, then sorted by key within windows, in place
            group_of = ScratchArray.open(parted["group_of"], np.uint32)
            stack.callback(group_of.close, False)
            inner = ScratchArray.open(parted["inner"], np.uint32) if parted["inner"] else None
            if inner is not None:
                stack.callback(inner.close, False)
            windows = list(zip(parted["windows"][:-1], parted["windows"][1:])) if inner is not None else []
            perm = ScratchArray.open(parted["perm"], np.uint32)
            stack.callback(perm.close, False)
            at = Path(parted["group_of"])
            reordered = ScratchArray(at.with_name(at.stem + f".sorted-{key.replace('/', '-')}"), rows, col.dtype,
                                     col.tail)
            stack.callback(reordered.close)
            group_rows(col, group_of, perm, parted["groups"], reordered, block_cells)
            for a, b in windows:
                reordered.write(int(a), reordered.read(int(a), int(b))[inner.read(int(a), int(b))])
        warnings = col.finish() if field is not None else []  # all rows read: checked before any is written
        name = key.split("/", 1)[1] if key.startswith("field/") else key
        channels = int(np.prod(col.tail, dtype=np.int64)) if col.tail else 1
        merged = None if key == "order" else RunningStats.empty(channels)
        chunks = (min(max(1, rows), chunk_rows(col.row_bytes, opts.chunk_bytes)),) + col.tail
        # created by its path inside the location's group (opening the groups first costs two more reads)
        where = Path(parted["group"]) / ("fields" if key.startswith("field/") else "")
        arr = create_array(where, name, shape=col.shape, chunks=chunks, dtype=col.dtype,
                           overwrite=True)  # a rerun (lost worker) writes it again
        step = chunks[0] * max(1, block_cells // chunks[0])  # whole chunks per write
        boxes = _PartBoxes(parted["offsets"], col.tail) if key == "coords" and parted["boxes_from_coords"] else None
        in_memory = isinstance(reordered, np.ndarray)
        if in_memory and rows:
            arr[...] = reordered  # one write; the statistics still go a step at a time (the same numbers)
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            values = reordered[lo:hi] if in_memory else reordered.read(lo, hi)
            if not in_memory:
                arr[lo:hi] = values
            if merged is not None:
                merged = merged.merge(RunningStats.of(values))
            if boxes is not None:
                boxes.add(lo, values)
        if boxes is not None:
            write_array(zarr.open_group(parted["group"], mode="r+"), "part_boxes", boxes.boxes(), opts.chunk_bytes,
                        overwrite=True)  # a rerun too
        return {"stats": {name: merged.to_attrs()} if merged is not None else {}, "warnings": warnings}


def write_edges(parted: dict, opts, scratch: Path, tag: str) -> dict:
    """Stage 3b (``--edges``): the location's cell adjacency (``mesh_edges``) from its raw file, block by block,
    into ``edges`` and ``edge_parts`` of its store group, rows numbered by the ``order`` column (written first);
    memory: the cell -> row map (4 bytes per cell) and one bucket of sides at a time."""
    import zarr

    n, block_cells, name = parted["rows"], parted["block_cells"], parted["source"]
    group = Path(parted["group"])
    order = zarr.open_array(str(group / "order"), mode="r")
    row_of = np.empty(n, np.uint32 if n < (1 << 32) else np.int64)
    for lo, hi in row_blocks(n, block_cells):
        row_of[order[lo:hi]] = np.arange(lo, hi, dtype=row_of.dtype)
    streamed = StreamedEdges(scratch, f"{tag}-edges", n, block_cells * BYTES_PER_CELL // 4)
    try:
        with VtkXmlFile(name) as f:
            section = _check_mesh(f, parted["location"], name)
            if f.src.size != parted["raw_bytes"] or f.cell_counts() != parted["cell_counts"]:
                raise IngestError(f"{name} changed while the run was ingested; rerun the ingest once the file is "
                                  f"complete")
            for c0 in range(0, n, block_cells):
                c1 = min(c0 + block_cells, n)
                sizes, conn = f.cell_block(c0, c1, section)
                pts, local = f.points_of(conn)
                types = f.cell_types(c0, c1) if section == "Cells" else None
                streamed.add(side_keys(sizes, local, pts, types, parted["location"] == "surface", name), c0, c1 - c0)
        count = streamed.write(group, row_of, parted["offsets"], chunk_rows(16, opts.chunk_bytes))
    finally:
        streamed.close()
    return {"stats": {}, "warnings": [], "edges": count}


class _PartBoxes:
    """Bounding boxes of the parts of reordered rows seen a block at a time (``partition.part_boxes``)."""

    def __init__(self, offsets: np.ndarray, tail: tuple):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        parts, d = len(offsets) - 1, tail[0]
        self.lo, self.hi = np.full((parts, d), np.inf, np.float32), np.full((parts, d), -np.inf, np.float32)

    def add(self, lo: int, values: np.ndarray) -> None:
        part = np.searchsorted(self.offsets, np.arange(lo, lo + len(values)), side="right") - 1
        starts = np.flatnonzero(np.r_[True, part[1:] != part[:-1]])  # rows of a part are contiguous
        ids = part[starts]
        self.lo[ids] = np.minimum(self.lo[ids], np.minimum.reduceat(values, starts, axis=0))
        self.hi[ids] = np.maximum(self.hi[ids], np.maximum.reduceat(values, starts, axis=0))

    def boxes(self) -> np.ndarray:
        out = np.full((len(self.lo), 2, self.lo.shape[1]), np.nan, np.float32)
        full = np.diff(self.offsets) > 0
        out[full, 0], out[full, 1] = self.lo[full], self.hi[full]
        return out


def remove_files(files) -> None:
    """Delete scratch column files (``(path, dtype, tail)`` entries or paths; None: no file), ignoring missing ones."""
    for f in files:
        if f is not None:
            Path(f[0] if isinstance(f, (tuple, list)) else f).unlink(missing_ok=True)


POLYGON_TYPES = (5, 7, 9)  # VTK_TRIANGLE, VTK_POLYGON, VTK_QUAD: the cells a surface given as a .vtu may hold


def _check_polygons(types: np.ndarray, first: int, name) -> None:
    bad = np.flatnonzero(~np.isin(types, POLYGON_TYPES))
    if len(bad):
        raise IngestError(f"{name}: a surface must consist of polygons only; cell {first + int(bad[0])} has VTK cell "
                          f"type {int(types[bad[0]])} (triangles 5, polygons 7 and quads 9 are surface cells)")


def cell_means(sizes: np.ndarray, local: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per cell, the mean of its points' ``values`` (rows indexed by the block's connectivity ``local``):
    point data on the store's cell rows, as VTK's vtkPointDataToCellData averages it."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    sums = np.add.reduceat(values[local], starts, axis=0) if len(local) else np.zeros((0, values.shape[1]))
    return sums / np.asarray(sizes, dtype=np.float64)[:, None]


def _check_mesh(f: VtkXmlFile, loc: str, name) -> str:
    """The topology section whose cells are the rows: Polys of a surface (or the 2-D Cells of a surface
    given as an UnstructuredGrid, checked block by block), Cells of a volume."""
    if loc == "surface":
        if f.kind == "UnstructuredGrid":
            n = f.cell_counts()["Cells"]
            if not n:
                raise IngestError(f"{name}: a surface must consist of polygons only, found no cells")
            _check_polygons(f.cell_types(0, min(n, 4096)), 0, name)  # a volume given as a surface, at once
            return "Cells"
        if f.kind != "PolyData":
            raise IngestError(f"{name}: corrupt or truncated VTK file: it holds {f.kind}, a surface must be "
                              f"PolyData (.vtp) or an UnstructuredGrid (.vtu) of polygons")
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


def _check_arrays(f: VtkXmlFile, specs, name) -> None:
    """Every field's arrays are there, as the recipe's cell or point data (one line naming what is)."""
    present = {"cell": f.array_names("cell"), "point": f.array_names("point")}
    absent = {}
    for s in specs:
        for a in s.sources:
            if a not in present[s.association]:
                absent.setdefault(s.association, []).append(a)
    if absent:
        other = {"cell": "point", "point": "cell"}
        hints = [f"{[a for a in names if a in present[other[kind]]]} exist as {other[kind].upper()} data"
                 for kind, names in absent.items() if any(a in present[other[kind]] for a in names)]
        what = "; ".join(f"{kind} array(s) {names}" for kind, names in absent.items())
        raise IngestError(f"{name}: missing {what}{' (' + '; '.join(hints) + ': set the recipe' + chr(39) + 's data: to match)' if hints else ''}; "
                          f"cell arrays present: {present['cell']}, point arrays present: {present['point']}")


def _warn_cp(ratio: float, name, opts, warnings: list, source: str, check: str) -> None:
    if abs(ratio - 1) > 0.01:
        u = opts.reference.u_inf / np.sqrt(ratio) if ratio > 0 else float("nan")
        warnings.append(f"{name}: Cp from {source} with U_inf={opts.reference.u_inf} is {1 / ratio:.3f}x the "
                        f"file's {check}; the data were made dimensionless with U_inf ~ {u:.3f} "
                        f"(pass --u-inf / --rho-inf to match)")
