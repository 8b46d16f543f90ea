"""The streaming VTK XML reader against VTK's own: every encoding VTK writes reads back value for value
equal (and of the same dtype) to ``pyvista.read`` of the same file; row ranges equal slices of the whole;
split ``.part`` files read as one; broken files give a named error."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
vtk = pytest.importorskip("vtk")

from domainflow.vtk import xml_reader  # noqa: E402
from domainflow.vtk.errors import VtkFileError  # noqa: E402
from domainflow.vtk.xml_reader import VtkXmlFile  # noqa: E402
from vtk_oracle import mixed_grid, surface, vtk_topology, write_with_vtk  # noqa: E402

_MODES = ["ascii", "binary", "appended-raw", "appended-base64"]
_COMPRESSORS = ["none", "zlib", "lz4", "lzma"]
_CASES = [(m, c) for m in _MODES for c in _COMPRESSORS if m != "ascii" or c == "none"]


def _check_equal(path):
    """Everything the reader gives equals VTK's reading of ``path``; returns the reader's view of it."""
    ref = pv.read(path)
    with VtkXmlFile(path) as f:
        assert (f.n_points, f.n_cells) == (ref.n_points, ref.n_cells)
        assert sorted(f.array_names("cell")) == sorted(ref.cell_data.keys())
        for assoc, data in (("cell", ref.cell_data), ("point", ref.point_data)):
            for name in data.keys():
                got, want = f.read(assoc, name), np.asarray(data[name])
                assert got.dtype == want.dtype, (assoc, name, got.dtype, want.dtype)
                assert got.shape == want.shape and np.array_equal(got, want), (assoc, name)
        pts = f.points()
        assert pts.dtype == ref.points.dtype and np.array_equal(pts, ref.points)
        for (section, name), want in vtk_topology(ref).items():
            got = f.topology(name, section)
            assert np.array_equal(got, np.asarray(want)), (section, name)
        return f.kind


@pytest.mark.parametrize("mode,compressor", _CASES)
@pytest.mark.parametrize("header,ids", [("UInt32", "Int32"), ("UInt64", "Int64")])
def test_every_encoding_of_a_volume_reads_like_vtk(tmp_path, mode, compressor, header, ids):
    path = write_with_vtk(mixed_grid(), tmp_path / "volume.vtu", mode, compressor, header, ids)
    assert _check_equal(path) == "UnstructuredGrid"


@pytest.mark.parametrize("mode,compressor", _CASES)
def test_every_encoding_of_a_surface_reads_like_vtk(tmp_path, mode, compressor):
    path = write_with_vtk(surface(), tmp_path / "boundary.vtp", mode, compressor, "UInt64")
    assert _check_equal(path) == "PolyData"


@pytest.mark.parametrize("mode,compressor", [("appended-raw", "none"), ("binary", "zlib"), ("ascii", "none")])
def test_big_endian_files_read_like_vtk(tmp_path, mode, compressor):
    _check_equal(write_with_vtk(mixed_grid(1), tmp_path / "be.vtu", mode, compressor, big_endian=True))


@pytest.mark.parametrize("mode,compressor", [("appended-raw", "none"), ("appended-base64", "zlib"), ("binary", "lz4"),
                                             ("ascii", "none")])
def test_several_pieces_in_one_file_join_like_vtk(tmp_path, mode, compressor):
    path = write_with_vtk(surface(2), tmp_path / "pieces.vtp", mode, compressor, pieces=3)
    with VtkXmlFile(path) as f:
        assert len(f.pieces) == 3
    _check_equal(path)


@pytest.mark.parametrize("mode,compressor", [("appended-raw", "none"), ("appended-base64", "none"),
                                             ("binary", "none"), ("appended-raw", "zlib"), ("binary", "lzma"),
                                             ("appended-base64", "zlib"), ("binary", "zlib"), ("ascii", "none")])
def test_row_ranges_equal_slices_of_the_whole(tmp_path, mode, compressor, monkeypatch):
    """Also the compressed block header read in slices: every 4th block's offset kept, 8 entries a read."""
    monkeypatch.setattr(xml_reader, "SCAN_BLOCK", 97)  # ascii text and the scan cross many block boundaries
    monkeypatch.setattr(xml_reader._BlockTable, "STRIDE", 4)
    monkeypatch.setattr(xml_reader._BlockTable, "CHUNK", 8)
    mesh = mixed_grid(3)
    path = write_with_vtk(mesh, tmp_path / "rows.vtu", mode, compressor, block=64, pieces=2)
    ref = pv.read(path)
    with VtkXmlFile(path) as f:
        n = f.n_cells
        for name in ("pressure", "wallShearStress", "flag"):
            whole = np.asarray(ref.cell_data[name])
            for lo, hi in [(0, 1), (3, 17), (n // 2 - 5, n // 2 + 5), (n - 1, n), (0, n), (7, 7)]:
                assert np.array_equal(f.read("cell", name, lo, hi), whole[lo:hi]), (name, lo, hi)
        assert np.array_equal(f.points(5, 40), ref.points[5:40])
        with pytest.raises(VtkFileError, match=r"rows \[0, .*outside"):
            f.read("cell", "pressure", 0, n + 1)


def test_part_pieces_read_as_one_stream_without_joining(tmp_path):
    path = write_with_vtk(mixed_grid(4), tmp_path / "whole.vtu", "appended-raw", "zlib")
    data = path.read_bytes()
    split = tmp_path / "split" / "volume_1.vtu"
    split.parent.mkdir()
    cuts = [0, 100, len(data) // 2, len(data) // 2 + 1, len(data)]
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        (split.parent / f"volume_1.vtu.{k:02d}.part").write_bytes(data[a:b])
    ref = pv.read(path)
    with VtkXmlFile(split) as f:
        assert len(f.src.files) == 4 and not split.exists()
        assert np.array_equal(f.read("cell", "wallShearStress"), ref.cell_data["wallShearStress"])
        assert np.array_equal(f.topology("connectivity"), ref.cell_connectivity)
    assert sorted(p.name for p in split.parent.iterdir()) == [f"volume_1.vtu.{k:02d}.part" for k in range(4)]


def test_a_missing_part_piece_is_named(tmp_path):
    path = write_with_vtk(surface(), tmp_path / "b.vtp", "appended-raw", "none")
    data = path.read_bytes()
    (tmp_path / "s.vtp.00.part").write_bytes(data[:300])
    (tmp_path / "s.vtp.02.part").write_bytes(data[600:])
    with pytest.raises(VtkFileError, match=r"piece\(s\) \[1\] are missing"):
        VtkXmlFile(tmp_path / "s.vtp")


@pytest.mark.parametrize("mode,compressor", [("appended-raw", "none"), ("appended-raw", "zlib"), ("binary", "none"),
                                             ("ascii", "none")])
def test_a_truncated_file_is_a_named_error(tmp_path, mode, compressor):
    path = write_with_vtk(mixed_grid(), tmp_path / "t.vtu", mode, compressor)
    data = path.read_bytes()
    cut = tmp_path / "cut.vtu"
    # cut inside the data: an appended file loses its data (the header still parses), an inline one its end tags
    cut.write_bytes(data[: int(len(data) * 0.7)])
    with pytest.raises(VtkFileError, match="cut.vtu"):
        with VtkXmlFile(cut) as f:
            for name in f.array_names("cell"):
                f.read("cell", name)
            f.points()
            f.topology("connectivity")


def test_corrupt_compressed_block_is_a_named_error(tmp_path):
    path = write_with_vtk(mixed_grid(), tmp_path / "c.vtu", "appended-raw", "zlib")
    with VtkXmlFile(path) as f:
        a = f.info("cell", "wallShearStress")
    data = bytearray(path.read_bytes())
    blocks = int(np.frombuffer(data[a.start:a.start + 4], "<u4")[0])
    body = a.start + 4 * (3 + blocks)
    data[body + 2:body + 22] = b"\x00" * 20  # inside its first compressed block
    bad = tmp_path / "bad.vtu"
    bad.write_bytes(bytes(data))
    with VtkXmlFile(bad) as f, pytest.raises(VtkFileError, match="bad.vtu: DataArray 'wallShearStress' cannot be decoded"):
        f.read("cell", "wallShearStress")


def test_not_a_mesh_and_unknown_arrays_are_named(tmp_path):
    img = tmp_path / "img.vti"
    pv.ImageData(dimensions=(3, 3, 3)).save(img)
    with pytest.raises(VtkFileError, match="ImageData.*UnstructuredGrid .vtu or PolyData .vtp"):
        VtkXmlFile(img)
    path = write_with_vtk(surface(), tmp_path / "s.vtp", "appended-raw", "none")
    with VtkXmlFile(path) as f, pytest.raises(VtkFileError, match=r"no cell array 'Cp'.*CpMeanTrim"):
        f.read("cell", "Cp")


@pytest.mark.parametrize("mode", ["ascii", "appended-raw"])
def test_an_empty_number_of_components_reads_as_vtk_reads_it(tmp_path, mode):
    """``NumberOfComponents=""`` (VTK and meshio read it: one component) reads like VTK; a value that is no integer
    is an error naming the file and the array, where it used to be a bare "invalid literal for int()"."""
    path = tmp_path / "mesh.vtu"
    write_with_vtk(mixed_grid(), path, mode, "none")
    text = path.read_bytes()
    first = text.index(b"<DataArray")
    head = text[:first] + text[first:].replace(b"<DataArray ", b'<DataArray NumberOfComponents="" ', 1)
    blank = tmp_path / "blank.vtu"
    blank.write_bytes(head)
    _check_equal(blank)
    bad = tmp_path / "bad.vtu"
    bad.write_bytes(head.replace(b'NumberOfComponents=""', b'NumberOfComponents="x"', 1))
    with pytest.raises(VtkFileError, match=r"bad\.vtu: DataArray .* has NumberOfComponents='x', which is not an "
                                           r"integer"):
        with VtkXmlFile(str(bad)) as f:
            f.read("cell", f.array_names("cell")[0])
