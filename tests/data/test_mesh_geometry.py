"""Cell geometry from connectivity (preprocess.mesh_geometry) against VTK's filters on the same mesh:
centres bit for bit for every linear cell type VTK centres by interpolation, normals and areas to
rounding; polyhedra (VTK's centre is not inside the cell) get the mean of their points."""

from __future__ import annotations

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")

from domainflow.preprocess.mesh_geometry import cell_centres, polygon_normals_areas  # noqa: E402
from vtk_oracle import mixed_grid, surface  # noqa: E402


def _with_pyramids_and_hexahedra():
    pyr = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0], [0.5, 0.5, 1]], float) + 20
    pyramids = pv.UnstructuredGrid(np.array([5, 0, 1, 2, 3, 4]), np.array([pv.CellType.PYRAMID], np.uint8), pyr)
    hexes = pv.ImageData(dimensions=(3, 3, 3), spacing=(0.3, 0.7, 1.1)).cast_to_unstructured_grid()
    hexes = pv.UnstructuredGrid({pv.CellType.HEXAHEDRON: hexes.cell_connectivity.reshape(-1, 8)[:, [0, 1, 3, 2, 4, 5, 7, 6]]},
                                hexes.points + 0.123)
    return mixed_grid(5).merge([pyramids, hexes], merge_points=False)


def test_volume_centres_are_vtks_bit_for_bit_except_polyhedra():
    g = _with_pyramids_and_hexahedra()
    ours = cell_centres(np.diff(g.cell_offsets), g.cell_connectivity, g.points, types=g.celltypes)
    theirs = np.asarray(g.cell_centers().points, np.float64)
    kinds = set(np.unique(g.celltypes))
    assert {pv.CellType.TETRA, pv.CellType.VOXEL, pv.CellType.HEXAHEDRON, pv.CellType.WEDGE,
            pv.CellType.PYRAMID, pv.CellType.POLYHEDRON} <= kinds
    poly = g.celltypes == pv.CellType.POLYHEDRON
    assert np.array_equal(ours[~poly], theirs[~poly])
    conn, off = g.cell_connectivity, g.cell_offsets
    for i in np.flatnonzero(poly):
        assert np.allclose(ours[i], g.points[conn[off[i]:off[i + 1]]].mean(axis=0))


def test_surface_centres_normals_and_areas_match_vtks_filters():
    s = surface(3)
    faces = s.faces
    sizes, conn, i = [], [], 0
    while i < len(faces):
        sizes.append(faces[i])
        conn.extend(faces[i + 1:i + 1 + faces[i]])
        i += faces[i] + 1
    sizes, conn = np.array(sizes), np.array(conn)
    assert set(sizes) == {3, 4}
    centres = cell_centres(sizes, conn, s.points)
    normals, areas = polygon_normals_areas(sizes, conn, s.points)
    assert np.array_equal(centres, np.asarray(s.cell_centers().points, np.float64))
    vtk_normals = s.compute_normals(cell_normals=True, point_normals=False, split_vertices=False,
                                    consistent_normals=False, auto_orient_normals=False).cell_data["Normals"]
    np.testing.assert_allclose(normals, vtk_normals, rtol=0, atol=2e-6)
    vtk_areas = s.compute_cell_sizes(length=False, area=True, volume=False).cell_data["Area"]
    np.testing.assert_allclose(areas, vtk_areas, rtol=1e-12)


def test_points_may_be_a_stretch_of_the_points_array():
    """A block of cells passes only the rows of the points array it refers to (``first`` = their start)."""
    tri = surface(4).triangulate()
    conn = tri.faces.reshape(-1, 4)[:, 1:]
    block = conn[len(conn) // 2:].ravel()  # the second half of the cells
    sizes = np.full(len(block) // 3, 3)
    first = int(block.min())
    assert first > 0
    whole = cell_centres(sizes, block, tri.points)
    stretch = cell_centres(sizes, block, tri.points[first:block.max() + 1], first=first)
    assert np.array_equal(whole, stretch)
