"""The streaming .vtu writer: what it writes reads back in VTK itself (pyvista.read) and in the streaming
reader, whole or as .NN.part pieces; stale pieces go; a failed write leaves nothing; row counts are checked."""

from __future__ import annotations

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")

from domainflow.preprocess.vtk_xml import VtkXmlFile  # noqa: E402
from domainflow.preprocess.vtu_writer import BLOCK_BYTES, VtuWriter  # noqa: E402


def _grid():
    g = pv.ImageData(dimensions=(23, 17, 9)).cast_to_unstructured_grid()
    rng = np.random.default_rng(0)
    g.cell_data["a"] = rng.random(g.n_cells).astype(np.float32)
    g.cell_data["v"] = rng.random((g.n_cells, 3)).astype(np.float64)
    g.point_data["t"] = rng.integers(-5, 5, g.n_points).astype(np.int32)
    return g


def _write(path, g, pieces=1, block=997):
    w = VtuWriter(path, pieces)
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
    w = VtuWriter(tmp_path / "x.vtu")
    w.declare("CellData", "a", "f4")
    with pytest.raises(ValueError, match="shape"):
        w.append("CellData", "a", g.cell_data["v"])
    w.abort()
    w = VtuWriter(tmp_path / "x.vtu")
    w.declare("CellData", "a", "f4")
    w.append("CellData", "a", g.cell_data["a"][:10])
    with pytest.raises(ValueError, match="CellData/a got 10 rows, expected 11"):
        w.close(0, 11)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="section"):
        VtuWriter(tmp_path / "x.vtu").declare("Cell", "a", "f4")
