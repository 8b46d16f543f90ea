"""Cell geometry from connectivity, one block of cells at a time: centres, and for polygons unit normals
and areas (the streaming ingest's replacement for VTK's cell-centre, normal and cell-size filters, which
need the whole mesh in memory).

- centre: what VTK's cell-centre filter computes, the cell's interpolation at its parametric centre
  (sum over points of point x weight, in point order, in float64), for triangles, quads, pixels,
  tetrahedra, voxels, hexahedra, wedges and pyramids: the same bits as ``pyvista``'s ``cell_centers``.
  For other polygons and polyhedra VTK maps a parametric centre through a local frame or the bounding
  box, which need not lie near the cell; there the centre is the mean of the cell's points.
- normal and area of a polygon: Newell's method (the normal of a planar polygon is the vector area over
  its magnitude, area = |vector area| / 2), as VTK's polygon code computes them; the sign follows the
  polygon's winding.

Points come from a callable ``points_of(ids)`` so the caller decides how they are read (all at once for a
small mesh, or only the stretch of the points array this block refers to).
"""

from __future__ import annotations

import numpy as np


def group_by_size(sizes: np.ndarray):
    """(k, cell indices with k points, their positions in the concatenated connectivity) for each k."""
    if len(sizes) and sizes.min() == sizes.max():  # one cell size (the usual mesh): no search
        k = int(sizes[0])
        yield k, np.arange(len(sizes)), np.arange(len(sizes) * k).reshape(-1, k)
        return
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else np.zeros(0, np.int64)
    for k in np.unique(sizes):
        idx = np.flatnonzero(sizes == k)
        yield int(k), idx, starts[idx][:, None] + np.arange(k)[None, :]


# VTK cell type -> interpolation weights at the parametric centre (vtkCell::GetParametricCenter, then the
# type's InterpolationFunctions), in point order
def _wedge(r=0.333333, s=0.333333, t=0.5):  # VTK's literal, not 1/3
    return [(1 - r - s) * (1 - t), r * (1 - t), s * (1 - t), (1 - r - s) * t, r * t, s * t]


def _pyramid(r=0.4, s=0.4, t=0.2):
    return [(1 - r) * (1 - s) * (1 - t), r * (1 - s) * (1 - t), r * s * (1 - t), (1 - r) * s * (1 - t), t]


_TRIANGLE, _PIXEL, _QUAD, _TETRA, _VOXEL, _HEXAHEDRON, _WEDGE, _PYRAMID = 5, 8, 9, 10, 11, 12, 13, 14
_WEIGHTS = {_TRIANGLE: [1 - 1 / 3 - 1 / 3, 1 / 3, 1 / 3], _PIXEL: [0.25] * 4, _QUAD: [0.25] * 4,
            _TETRA: [1 - 0.25 - 0.25 - 0.25, 0.25, 0.25, 0.25], _VOXEL: [0.125] * 8, _HEXAHEDRON: [0.125] * 8,
            _WEDGE: _wedge(), _PYRAMID: _pyramid()}
_POLYGON_TYPE = {3: _TRIANGLE, 4: _QUAD}  # a polydata polygon of 3 / 4 points is a triangle / quad to VTK


def cell_centres(sizes: np.ndarray, conn: np.ndarray, points: np.ndarray, first: int = 0,
                 types: np.ndarray | None = None) -> np.ndarray:
    """(n, 3) float64 centres of cells given by their point counts ``sizes`` and point ids ``conn``;
    ``points`` holds the rows ``first ..`` of the points array that ``conn`` refers to. ``types``: VTK cell
    types (None: polygons, typed by their point count)."""
    out = np.empty((len(sizes), 3), dtype=np.float64)
    points = np.asarray(points, dtype=np.float64)  # once per point, not once per corner (the same values)
    for k, idx, pos in group_by_size(sizes):
        if k == 0:
            raise ValueError("a cell without points")
        ids = conn[pos] - first  # (m, k)
        kinds = np.full(len(idx), _POLYGON_TYPE.get(k, -1)) if types is None else np.asarray(types)[idx]
        one = len(kinds) and kinds.min() == kinds.max()
        for t in (kinds[:1] if one else np.unique(kinds)):
            sel = slice(None) if one else kinds == t
            w = _WEIGHTS.get(int(t))
            cols = ids[sel]
            if w is None or len(w) != k:  # other polygons, polyhedra, higher-order cells: the mean
                out[idx[sel]] = points[cols].astype(np.float64, copy=False).sum(axis=1) / k
                continue
            # corner by corner, in point order as VTK sums (the same bits); one (m, 3) gather at a time
            acc = points[cols[:, 0]] * w[0]
            corner = np.empty_like(acc)
            for i in range(1, k):
                np.take(points, cols[:, i], axis=0, out=corner)
                corner *= w[i]
                acc += corner
            out[idx[sel]] = acc
    return out


def polygon_normals_areas(sizes: np.ndarray, conn: np.ndarray, points: np.ndarray,
                          first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, 3) unit normals and (n,) areas of polygons by Newell's method (float64)."""
    normals = np.empty((len(sizes), 3), dtype=np.float64)
    areas = np.empty(len(sizes), dtype=np.float64)
    xyz = [np.ascontiguousarray(points[:, a], dtype=np.float64) for a in range(3)]  # gathered corner by corner
    for k, idx, pos in group_by_size(sizes):
        if k < 3:
            raise ValueError(f"a polygon with {k} points")
        ids = conn[pos] - first
        corner = [[c[ids[:, i]] for c in xyz] for i in range(k)]  # corner i: its x, y, z columns
        n = np.empty((len(idx), 3))
        for a, (b, c) in enumerate(((1, 2), (2, 0), (0, 1))):  # n_a = sum_i (p_i - p_i+1)_b (p_i + p_i+1)_c
            total = None
            for i in range(k):
                p, q = corner[i], corner[(i + 1) % k]
                term = (p[b] - q[b]) * (p[c] + q[c])
                total = term if total is None else total + term  # in corner order, as sum(axis=1) adds
            n[:, a] = total
        length = np.linalg.norm(n, axis=1)
        areas[idx] = 0.5 * length
        with np.errstate(invalid="ignore", divide="ignore"):
            normals[idx] = n / length[:, None]
    return normals, areas
