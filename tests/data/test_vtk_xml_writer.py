"""The streaming .vtu/.vtp writer: what it writes reads back in VTK itself (pyvista.read) and in the streaming
reader, whole or as .NN.part pieces; stale pieces go; a failed write leaves nothing; row counts are checked."""

from __future__ import annotations

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")

from domainflow.vtk.xml_reader import VtkXmlFile  # noqa: E402
from domainflow.vtk.xml_writer import BLOCK_BYTES, VtkXmlWriter  # noqa: E402


def _grid():
    g = pv.ImageData(dimensions=(23, 17, 9)).cast_to_unstructured_grid()
    rng = np.random.default_rng(0)
    g.cell_data["a"] = rng.random(g.n_cells).astype(np.float32)
    g.cell_data["v"] = rng.random((g.n_cells, 3)).astype(np.float64)
    g.point_data["t"] = rng.integers(-5, 5, g.n_points).astype(np.int32)
    return g


def _write(path, g, pieces=1, block=997):
    w = VtkXmlWriter(path, pieces)
    w.declare("CellData", "a", "f4")
    w.declare("CellData", "v", "f8", 3)
    w.declare("PointData", "t", "i4")
    w.declare("Points", "Points", "f4", 3)
    for name, dtype in (("connectivity", "i8"), ("offsets", "i8"), ("types", "u1")):
        w.declare("Cells", name, dtype)
    n = g.n_cells
    for lo in range(0, n, block):  # rows in blocks that cut compression blocks anywhere
        hi = min(n, lo + block)
        w.append("CellData", "a", g.cell_data["a"][lo:hi])
        w.append("CellData", "v", g.cell_data["v"][lo:hi])
        w.append("Cells", "offsets", g.cell_offsets[1:][lo:hi])
        w.append("Cells", "types", g.celltypes[lo:hi])
    w.append("Cells", "connectivity", g.cell_connectivity)
    w.append("PointData", "t", g.point_data["t"])
    w.append("Points", "Points", g.points.astype(np.float32))
    w.close(g.n_points, n)


def _same(got, g):
    np.testing.assert_array_equal(got.points, g.points)
    np.testing.assert_array_equal(got.cell_connectivity, g.cell_connectivity)
    np.testing.assert_array_equal(got.celltypes, g.celltypes)
    for k in ("a", "v"):
        assert got.cell_data[k].dtype == g.cell_data[k].dtype
        np.testing.assert_array_equal(got.cell_data[k], g.cell_data[k])
    np.testing.assert_array_equal(got.point_data["t"], g.point_data["t"])


def test_vtk_reads_what_it_writes(tmp_path):
    g = _grid()
    assert g.cell_data["v"].nbytes > 2 * BLOCK_BYTES  # several compression blocks
    _write(tmp_path / "x.vtu", g)
    _same(pv.read(tmp_path / "x.vtu"), g)
    with VtkXmlFile(tmp_path / "x.vtu") as f:
        np.testing.assert_array_equal(f.read("cell", "v", 100, 2000), g.cell_data["v"][100:2000])
        np.testing.assert_array_equal(f.points(), g.points)
    assert [p.name for p in tmp_path.iterdir()] == ["x.vtu"]


def test_pieces_join_to_the_file_and_replace_stale_ones(tmp_path):
    g = _grid()
    _write(tmp_path / "whole.vtu", g)
    for k in range(5):  # a stale earlier set with more pieces, and a stale whole file
        (tmp_path / f"x.vtu.{k:02d}.part").write_bytes(b"old")
    (tmp_path / "x.vtu").write_bytes(b"old")
    _write(tmp_path / "x.vtu", g, pieces=3)
    parts = sorted(tmp_path.glob("x.vtu.*.part"))
    assert [p.name for p in parts] == [f"x.vtu.{k:02d}.part" for k in range(3)]
    assert not (tmp_path / "x.vtu").exists()
    assert b"".join(p.read_bytes() for p in parts) == (tmp_path / "whole.vtu").read_bytes()
    sizes = [p.stat().st_size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    with VtkXmlFile(tmp_path / "x.vtu") as f:  # read as one stream, never joined
        np.testing.assert_array_equal(f.read("cell", "a"), g.cell_data["a"])


def test_failed_write_leaves_nothing_and_counts_are_checked(tmp_path):
    g = _grid()
    w = VtkXmlWriter(tmp_path / "x.vtu")
    w.declare("CellData", "a", "f4")
    with pytest.raises(ValueError, match="shape"):
        w.append("CellData", "a", g.cell_data["v"])
    w.abort()
    w = VtkXmlWriter(tmp_path / "x.vtu")
    w.declare("CellData", "a", "f4")
    w.append("CellData", "a", g.cell_data["a"][:10])
    with pytest.raises(ValueError, match="CellData/a got 10 rows, expected 11"):
        w.close(0, 11)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="section"):
        VtkXmlWriter(tmp_path / "x.vtu").declare("Cell", "a", "f4")


def test_polydata_reads_back_in_vtk_and_the_streaming_reader(tmp_path):
    """Triangles and a quad as PolyData (.vtp): VTK reads the same points, polygons and cell arrays."""
    g = pv.Sphere(theta_resolution=40, phi_resolution=30)
    rng = np.random.default_rng(1)
    g.cell_data["p"] = rng.random(g.n_cells).astype(np.float32)
    g.cell_data["tau"] = rng.random((g.n_cells, 3)).astype(np.float32)
    conn, offsets = g.faces.reshape(-1, 4)[:, 1:].ravel(), 3 * np.arange(1, g.n_cells + 1)
    w = VtkXmlWriter(tmp_path / "s.vtp", kind="PolyData")
    for name, comps in (("p", 1), ("tau", 3)):
        w.declare("CellData", name, "f4", comps)
    w.declare("Points", "Points", "f4", 3)
    w.declare("Polys", "connectivity", "i8")
    w.declare("Polys", "offsets", "i8")
    for lo in range(0, g.n_cells, 333):
        hi = min(lo + 333, g.n_cells)
        w.append("CellData", "p", g.cell_data["p"][lo:hi])
        w.append("CellData", "tau", g.cell_data["tau"][lo:hi])
        w.append("Polys", "connectivity", conn[3 * lo:3 * hi])
        w.append("Polys", "offsets", offsets[lo:hi])
    w.append("Points", "Points", g.points.astype(np.float32))
    w.close(g.n_points, g.n_cells)
    got = pv.read(tmp_path / "s.vtp")
    assert isinstance(got, pv.PolyData) and got.n_cells == g.n_cells
    np.testing.assert_array_equal(got.points, g.points)
    np.testing.assert_array_equal(got.faces, g.faces)
    for k in ("p", "tau"):
        np.testing.assert_array_equal(got.cell_data[k], g.cell_data[k])
    with VtkXmlFile(tmp_path / "s.vtp") as f:
        np.testing.assert_array_equal(f.read("cell", "tau", 10, 500), g.cell_data["tau"][10:500])
    with pytest.raises(ValueError, match="section"):
        VtkXmlWriter(tmp_path / "t.vtp", kind="PolyData").declare("Cells", "types", "u1")
