"""A mesh location's cell adjacency as graph edges (``ingest cfd --edges``): which cells touch.

Surface cells (polygons) touch when they share an edge, volume cells when they share a face. Points are
compared by position, not by id, so cells of different pieces, patches or OpenFOAM processor folders (each
with its own copy of the points they share) connect as they do in the whole mesh.

Each side of a cell (a polygon's edge: 2 points; a volume cell's face: 3 or 4 points) is keyed by its distinct
points' coordinates in sorted order (a quad face with a repeated point is a triangle); cells whose sides have equal keys touch (every pair of them, when more than two
share one). The store keeps both directions of each adjacency as ``(sender, receiver)`` rows in the run's row
numbers, sorted by (receiver, sender), with ``edge_parts`` marking each spatial part's stretch
(``domainflow.store.format.EDGES``).

Two paths, one result: :func:`location_edges` in memory (the whole-file ingest), and :class:`StreamedEdges`
for the streaming ingest, which writes the keys to bucket files by a hash of their first point, pairs each
bucket alone, groups the edges by ranges of their receiver's row in files (as many groups as buckets, whatever
the number of parts), and sorts one group at a time. Its memory is one bucket or group (about a quarter of a
block's budget) plus the cell -> row map, 4 bytes per cell.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import numpy as np

from .errors import IngestError
from .mesh_geometry import group_by_size

# the faces of VTK's linear volume cells, as point positions within the cell (vtkTetra/vtkHexahedron/... faces)
_FACES = {
    10: ((0, 1, 3), (1, 2, 3), (2, 0, 3), (0, 2, 1)),                                            # tetra
    11: ((0, 4, 6, 2), (1, 3, 7, 5), (0, 1, 5, 4), (2, 6, 7, 3), (0, 2, 3, 1), (4, 5, 7, 6)),    # voxel
    12: ((0, 4, 7, 3), (1, 2, 6, 5), (0, 1, 5, 4), (3, 7, 6, 2), (0, 3, 2, 1), (4, 5, 6, 7)),    # hexahedron
    13: ((0, 1, 2), (3, 5, 4), (0, 3, 4, 1), (1, 4, 5, 2), (2, 5, 3, 0)),                        # wedge
    14: ((0, 3, 2, 1), (0, 1, 4), (1, 2, 4), (2, 3, 4), (3, 0, 4)),                              # pyramid
}
_POINTS = {10: 4, 11: 8, 12: 8, 13: 6, 14: 5}
_TYPE_NAMES = {42: "polyhedron", 7: "polygon", 5: "triangle", 9: "quad", 3: "line", 1: "vertex"}
KEY_BYTES = 8 * 3 * 4 + 8  # the largest side key (4 points) and its cell id


def side_keys(sizes: np.ndarray, conn: np.ndarray, points: np.ndarray, types: np.ndarray | None, surface: bool,
              name) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{points per side k: (keys (M, 3k) float64, cell (M,) int64 within the block)} of a block of cells given
    by their point counts ``sizes``, point ids ``conn`` into ``points`` and VTK ``types`` (None: polygons)."""
    points = np.asarray(points, dtype=np.float64) + 0.0  # + 0.0: -0.0 becomes 0.0, one key for one position
    conn = np.asarray(conn, dtype=np.int64)
    sides: dict[int, list] = {}
    if surface:
        for k, idx, pos in group_by_size(np.asarray(sizes)):
            if k < 2 or not len(idx):
                continue
            ends = conn[np.stack([pos, np.roll(pos, -1, axis=1)], axis=-1)]  # (cells, k, 2): each edge's points
            sides.setdefault(2, []).append((ends.reshape(-1, 2), np.repeat(idx, k)))
    else:
        if types is None:
            raise IngestError(f"{name}: a volume's adjacency needs cell types (a .vtu); this file has none")
        types = np.asarray(types)
        starts = np.cumsum(sizes) - sizes
        for t in np.flatnonzero(np.bincount(types.astype(np.int64))):  # the types present (small ints)
            faces = _FACES.get(int(t))
            idx = np.flatnonzero(types == t)
            if faces is None or (np.asarray(sizes)[idx] != _POINTS[int(t)]).any():
                raise IngestError(
                    f"{name}: cell {int(idx[0])} has VTK cell type {int(t)} ({_TYPE_NAMES.get(int(t), 'other')}); "
                    f"--edges finds volume neighbours of tetrahedra, voxels, hexahedra, wedges and pyramids only; "
                    f"ingest without --edges (or convert the mesh, e.g. OpenFOAM's decomposed polyhedra)")
            cell_pts = conn[starts[idx][:, None] + np.arange(_POINTS[int(t)])[None, :]]
            for f in faces:
                sides.setdefault(len(f), []).append((cell_pts[:, list(f)], idx))
    rank, first_of = _position_ranks(points)
    keyed: dict[int, list] = {}
    for k, parts in sides.items():
        ids = np.concatenate([p for p, _ in parts])
        cells = np.concatenate([c for _, c in parts]).astype(np.int64)
        r = np.sort(rank[ids], axis=1)  # each side's points in (x, y, z) order, as ranks of their positions
        # a side is keyed by its distinct points: a quad face with a repeated point (a hexahedron written as a
        # prism) is the triangle it is; one collapsed further (an edge of length 0, a face of fewer than 3
        # distinct points) is no side, so cells meeting only at such a point or line do not touch
        new = r[:, 1:] != r[:, :-1]
        distinct = 1 + new.sum(axis=1)
        first = np.concatenate([np.ones((len(r), 1), bool), new], axis=1)  # each distinct point once
        for m in np.flatnonzero(np.bincount(distinct)):
            if m < min(k, 3):
                continue
            rows = distinct == m
            keys = points[first_of[r[rows][first[rows]]]].reshape(int(rows.sum()), 3 * int(m))
            keyed.setdefault(int(m), []).append((keys, cells[rows]))
    return {m: (np.concatenate([k for k, _ in v]), np.concatenate([c for _, c in v])) for m, v in keyed.items()}


def _position_ranks(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each point's rank among the distinct positions in (x, y, z) order (equal positions, one rank), and a
    point of each rank: sorting a side's points is then sorting small integers."""
    order = np.lexsort(points.T[::-1])
    p = points[order]
    new = np.r_[True, (p[1:] != p[:-1]).any(axis=1)] if len(p) else np.zeros(0, bool)
    rank = np.empty(len(points), np.int64)
    rank[order] = np.cumsum(new) - 1
    return rank, order[new]


def shared_pairs(keys: np.ndarray, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cell pairs (a, b), a != b, whose sides have equal keys: every pair among the cells sharing one side."""
    if len(keys) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # sorted by a 64-bit hash of the key (one argsort, not a sort over 3k columns); exact all the same: when two
    # neighbours share a hash but not a key (a collision), the keys themselves are sorted instead
    h = _mix(np.ascontiguousarray(keys).view(np.uint64))
    order = np.argsort(h, kind="stable")
    k = keys[order]
    same = (k[1:] == k[:-1]).all(axis=1)
    if (~same & (h[order[1:]] == h[order[:-1]])).any():
        order = np.lexsort(keys.T[::-1])
        k = keys[order]
        same = (k[1:] == k[:-1]).all(axis=1)
    c = cells[order]
    starts = np.flatnonzero(np.r_[True, ~same])
    lengths = np.diff(np.r_[starts, len(k)])
    a_out, b_out = [], []
    counts = np.bincount(lengths)
    for n in np.flatnonzero(counts[2:]) + 2:
        at = starts[lengths == n]
        i, j = np.triu_indices(int(n), 1)
        a_out.append(c[at[:, None] + i[None, :]].ravel())
        b_out.append(c[at[:, None] + j[None, :]].ravel())
    if not a_out:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    a, b = np.concatenate(a_out), np.concatenate(b_out)
    keep = a != b
    return a[keep], b[keep]


def _mix(bits: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of ``bits`` (uint64 columns)."""
    h = np.full(len(bits), 0x9E3779B97F4A7C15, dtype=np.uint64)
    for j in range(bits.shape[1]):
        h = (h ^ bits[:, j]) * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
    return h


def both_ways(a_rows: np.ndarray, b_rows: np.ndarray) -> np.ndarray:
    """(sender, receiver) rows of both directions of the pairs."""
    return np.stack([np.concatenate([a_rows, b_rows]), np.concatenate([b_rows, a_rows])], axis=1).astype(np.int64)


def sorted_once(e: np.ndarray) -> np.ndarray:
    """(sender, receiver) rows sorted by (receiver, sender), each once."""
    if not len(e):
        return e.reshape(0, 2)
    n = int(e.max()) + 1
    if n < (1 << 31):  # one int64 key per edge: a 1-D unique, much faster than unique over rows
        key = np.sort(e[:, 1] * n + e[:, 0])
        key = key[np.r_[True, key[1:] != key[:-1]]]
        return np.stack([key % n, key // n], axis=1)
    return np.unique(e[:, ::-1], axis=0)[:, ::-1].copy()  # unique sorts by its first column: the receiver


def edge_parts(receivers: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each part's first edge (and the end): part p's edges have receivers in rows offsets[p]:offsets[p + 1]."""
    return np.searchsorted(receivers, np.asarray(offsets, dtype=np.int64), side="left").astype(np.int64)


def location_edges(sides: list[dict], row_of: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """In memory: ``(edges, edge_parts)`` of a location from its blocks' :func:`side_keys` (cell ids already
    made the location's cell numbers), ``row_of[cell]`` the cell's store row and the parts' row ``offsets``."""
    a_all, b_all = [], []
    for k in sorted({k for s in sides for k in s}):
        keys = np.concatenate([s[k][0] for s in sides if k in s])
        cells = np.concatenate([s[k][1] for s in sides if k in s])
        a, b = shared_pairs(keys, cells)
        a_all.append(row_of[a])
        b_all.append(row_of[b])
    a = np.concatenate(a_all) if a_all else np.zeros(0, np.int64)
    b = np.concatenate(b_all) if b_all else np.zeros(0, np.int64)
    edges = sorted_once(both_ways(a, b))
    return edges, edge_parts(edges[:, 1], offsets)


def _bucket(keys: np.ndarray, buckets: int) -> np.ndarray:
    """A bucket per key from its first point's bits (equal keys, equal first points, one bucket)."""
    return (_mix(np.ascontiguousarray(keys[:, :3]).view(np.uint64)) % np.uint64(buckets)).astype(np.int64)


class StreamedEdges:
    """The out-of-core path: add blocks of side keys (:meth:`add`), then :meth:`write` the edges into a
    location's store group. Scratch files under ``scratch`` named by ``tag``; removed by :meth:`close`."""

    def __init__(self, scratch: Path, tag: str, n_cells: int, budget_bytes: int):
        self.scratch, self.tag, self.n_cells = Path(scratch), tag, int(n_cells)
        self.budget = max(int(budget_bytes), 1 << 12)
        self.buckets = None
        self.files: dict[str, object] = {}

    def _file(self, name: str):
        fh = self.files.get(name)
        if fh is None:
            fh = self.files[name] = open(self.scratch / f"{self.tag}.{name}", "wb")
        return fh

    def add(self, sides: dict[int, tuple[np.ndarray, np.ndarray]], first_cell: int, cells_in_block: int) -> None:
        """One block's sides (cells numbered from ``first_cell``) appended to their buckets' files."""
        if self.buckets is None:  # from the first block: about one budget of keys per bucket
            # (at least 2 sides a cell: a first block of collapsed cells must not put a whole run in one bucket)
            per_cell = max(2.0, sum(len(c) for _, c in sides.values()) / max(1, cells_in_block))
            self.buckets = max(1, math.ceil(self.n_cells * per_cell * KEY_BYTES / self.budget))
        for k, (keys, cells) in sides.items():
            b = _bucket(keys, self.buckets)
            order = np.argsort(b, kind="stable")
            rec = np.empty(len(keys), dtype=[("key", "<f8", (3 * k,)), ("cell", "<i8")])
            rec["key"], rec["cell"] = keys[order], cells[order] + first_cell  # bucket by bucket: slices below
            cuts = np.searchsorted(b[order], np.arange(self.buckets + 1))
            for j in np.flatnonzero(np.diff(cuts)):
                rec[cuts[j]:cuts[j + 1]].tofile(self._file(f"sides{k}.{j}"))

    def write(self, group: Path, row_of: np.ndarray, offsets: np.ndarray, chunk_rows: int) -> int:
        """Pair each bucket, group the directed edges by receiver part, sort each group and write ``edges`` and
        ``edge_parts`` into the store group ``group``; returns the number of edges."""
        from .store_writer import create_array, write_array

        for fh in self.files.values():
            fh.close()
        offsets = np.asarray(offsets, dtype=np.int64)
        parts, rows = len(offsets) - 1, max(1, len(row_of))
        groups = max(1, self.buckets or 1)  # by ranges of receiver rows: about a bucket of edges each, however few parts
        part_files = {}
        for name in sorted(n for n in self.files if n.startswith("sides")):
            k = int(name[5:name.index(".")])
            rec = np.fromfile(self.scratch / f"{self.tag}.{name}", dtype=[("key", "<f8", (3 * k,)), ("cell", "<i8")])
            a, b = shared_pairs(rec["key"], rec["cell"])
            del rec
            e = both_ways(row_of[a], row_of[b])
            g = e[:, 1] * groups // rows
            order = np.argsort(g, kind="stable")  # each group's edges one slice (not a scan per group)
            e, g = e[order], g[order]
            cuts = np.searchsorted(g, np.arange(groups + 1))
            for j in np.flatnonzero(np.diff(cuts)):
                fh = part_files.get(j) or open(self.scratch / f"{self.tag}.group.{j}", "ab")
                part_files[j] = fh
                e[cuts[j]:cuts[j + 1]].tofile(fh)
            (self.scratch / f"{self.tag}.{name}").unlink()
        for fh in part_files.values():
            fh.close()
        total, counts = 0, np.zeros(parts, np.int64)
        sorted_path = self.scratch / f"{self.tag}.edges"
        with open(sorted_path, "wb") as out:
            for j in range(groups):
                path = self.scratch / f"{self.tag}.group.{j}"
                if not path.exists():
                    continue
                e = sorted_once(np.fromfile(path, dtype=np.int64).reshape(-1, 2))
                path.unlink()
                counts += np.bincount(np.searchsorted(offsets, e[:, 1], side="right") - 1, minlength=parts)
                e.tofile(out)
                total += len(e)
        arr = create_array(group, "edges", shape=(total, 2), chunks=(max(1, min(total, chunk_rows)), 2),
                           dtype=np.int64, overwrite=True)
        step = max(1, chunk_rows) * max(1, (self.budget // 16) // max(1, chunk_rows))  # whole chunks per write
        with open(sorted_path, "rb") as f:
            for lo in range(0, total, step):
                hi = min(lo + step, total)
                arr[lo:hi] = np.fromfile(f, dtype=np.int64, count=2 * (hi - lo)).reshape(-1, 2)
        sorted_path.unlink()
        import zarr

        write_array(zarr.open_group(group, mode="r+"), "edge_parts", np.r_[0, np.cumsum(counts)].astype(np.int64),
                    overwrite=True)
        return total

    def close(self) -> None:
        """Remove every scratch file this object made (also after a failure): ``tag`` is its own."""
        for fh in self.files.values():
            with contextlib.suppress(OSError):
                fh.close()
        for p in self.scratch.glob(f"{self.tag}.*"):
            with contextlib.suppress(OSError):
                os.unlink(p)
