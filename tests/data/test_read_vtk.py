"""domainflow.readers.vtk: piecewise reads of .pvtu / .pvtp / .vtm equal VTK's own whole-dataset read,
each rank opening only its own pieces; monolithic files are read by one rank and scattered; bad input
raises on every rank together (no rank left in a collective)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from dist_pool import rank_and_world
from sharded_check import get_mesh

from domainflow import Shard
from domainflow.readers.vtk import read_vtk

CELL = {"pMeanTrim": np.float32, "wallShearStressMeanTrim": np.float64}
POINT = {"q": np.float64, "U": np.float32}
PIECE_COUNTS = (2, 3, 4, 5)  # with W in 1..4: fewer, as many and more pieces than ranks
MODES = ("appended", "raw", "ascii")  # piece i is written in MODES[i % 3]: exercises every header layout
TIMEOUT = 30


# --------------------------------------------------------------------------------------------
# test data: a sphere with scalar and 3-component, float32 and float64 cell and point arrays
# --------------------------------------------------------------------------------------------
def _sphere():
    import pyvista as pv

    s = pv.Sphere(theta_resolution=30, phi_resolution=16)
    c = np.asarray(s.cell_centers().points, dtype=np.float64)
    p = np.asarray(s.points, dtype=np.float64)
    s.cell_data["pMeanTrim"] = (3 * c[:, 0] + c[:, 2] + np.arange(s.n_cells)).astype(np.float32)
    s.cell_data["wallShearStressMeanTrim"] = np.stack([c[:, 1], c[:, 2] ** 2, c[:, 0] * c[:, 1]], 1)
    s.point_data["q"] = p[:, 0] - 2 * p[:, 1] + np.arange(s.n_points)
    s.point_data["U"] = (p * [1.0, 2.0, 3.0]).astype(np.float32)
    return s


def _split(mesh, k):
    """k contiguous, uneven cell ranges of ``mesh`` as separate datasets (poly data stays poly data)."""
    n = mesh.n_cells
    cuts = [0] + [round(n * (i * i + i) / (k * k + k)) for i in range(1, k)] + [n]
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        piece = mesh.extract_cells(np.arange(a, b))
        for name in ("vtkOriginalCellIds", "vtkOriginalPointIds"):
            piece.cell_data.pop(name, None)
            piece.point_data.pop(name, None)
        pieces.append(piece)
    return pieces


def _write_piece(dataset, path, mode):
    import vtk

    writer = vtk.vtkXMLPolyDataWriter() if path.endswith(".vtp") else vtk.vtkXMLUnstructuredGridWriter()
    writer.SetInputData(dataset)
    writer.SetFileName(path)
    if mode == "ascii":
        writer.SetDataModeToAscii()
    elif mode == "raw":
        writer.SetEncodeAppendedData(0)
    assert writer.Write() == 1, path


def _as_poly(ug):
    """An unstructured piece as poly data, keeping its cell order (all cells are triangles)."""
    import pyvista as pv

    cells = np.asarray(ug.cells).reshape(-1, 4)
    poly = pv.PolyData(np.asarray(ug.points), faces=cells.ravel())
    for k, v in ug.cell_data.items():
        poly.cell_data[k] = v
    for k, v in ug.point_data.items():
        poly.point_data[k] = v
    return poly


def _write_index(path, kind, sources, piece):
    """A hand-written .pvtu / .pvtp index listing ``piece``'s arrays (VTK's parallel writers can't split
    a dataset held in memory)."""
    def arrays(data):
        return "".join(f'      <PDataArray type="Float{np.asarray(v).dtype.itemsize * 8}" Name="{n}" '
                       f'NumberOfComponents="{1 if np.asarray(v).ndim == 1 else np.asarray(v).shape[1]}"/>\n'
                       for n, v in data.items())
    pieces = "".join(f'    <Piece Source="{os.path.basename(s)}"/>\n' for s in sources)
    text = (f'<?xml version="1.0"?>\n<VTKFile type="P{kind}" version="0.1" byte_order="LittleEndian">\n'
            f'  <P{kind} GhostLevel="0">\n    <PPointData>\n{arrays(piece.point_data)}    </PPointData>\n'
            f'    <PCellData>\n{arrays(piece.cell_data)}    </PCellData>\n'
            f'    <PPoints>\n      <PDataArray type="Float32" Name="Points" NumberOfComponents="3"/>\n'
            f'    </PPoints>\n{pieces}  </P{kind}>\n</VTKFile>\n')
    with open(path, "w") as fh:
        fh.write(text)


def _write_vtm(path, pieces):
    """A .vtm through VTK's writer, leaves nested as [p0, [p1, [p2, ...]]] and alternating vtp / vtu."""
    import vtk

    def nest(rest):
        block = vtk.vtkMultiBlockDataSet()
        block.SetNumberOfBlocks(2 if len(rest) > 1 else 1)
        block.SetBlock(0, _as_poly(rest[0]) if len(rest) % 2 else rest[0])
        if len(rest) > 1:
            block.SetBlock(1, nest(rest[1:]))
        return block

    writer = vtk.vtkXMLMultiBlockDataWriter()
    writer.SetInputData(nest(pieces))
    writer.SetFileName(path)
    assert writer.Write() == 1


def _write_partitioned(folder, fmt, k, mesh=None):
    """Write ``mesh`` (default: the sphere) as k pieces in format fmt; returns the index path."""
    mesh = _sphere() if mesh is None else mesh
    pieces = _split(mesh, k)
    os.makedirs(folder, exist_ok=True)
    name = os.path.join(folder, f"data_{k}.{fmt}")
    if fmt == "vtm":
        _write_vtm(name, pieces)
        return name
    ext = "vtu" if fmt == "pvtu" else "vtp"
    sources = []
    for i, piece in enumerate(pieces):
        src = os.path.join(folder, f"data_{k}_{i}.{ext}")
        _write_piece(piece if ext == "vtu" else _as_poly(piece), src, MODES[i % len(MODES)])
        sources.append(src)
    _write_index(name, "UnstructuredGrid" if ext == "vtu" else "PolyData", sources, pieces[0])
    return name


def _vtk_reference(path, association, names=None):
    """Reading the whole dataset in one process with VTK's own reader: ({name: tensor}, coords); all
    the association's arrays unless ``names`` is given."""
    import pyvista as pv
    import vtk

    if path.endswith((".pvtu", ".pvtp", ".vtm")):
        reader = {"pvtu": vtk.vtkXMLPUnstructuredGridReader, "pvtp": vtk.vtkXMLPPolyDataReader,
                  "vtm": vtk.vtkXMLMultiBlockDataReader}[path.rsplit(".", 1)[1]]()
        reader.SetFileName(path)
        reader.Update()
        data = pv.wrap(reader.GetOutput())
    else:
        data = pv.read(path)
    leaves = list(_leaves(data)) if isinstance(data, pv.MultiBlock) else [data]
    out, coords = {}, []
    for leaf in leaves:
        values = leaf.cell_data if association == "cell" else leaf.point_data
        for n in (names if names is not None else values.keys()):
            out.setdefault(n, []).append(torch.from_numpy(np.array(values[n])))
        pts = np.asarray(leaf.points)
        if association == "cell":
            pts = np.asarray(leaf.cell_centers().points).astype(pts.dtype)
        coords.append(torch.from_numpy(pts.copy()))
    return {n: torch.cat(v) for n, v in out.items()}, torch.cat(coords)


def _leaves(block):
    import pyvista as pv

    for item in block:
        if isinstance(item, pv.MultiBlock):
            yield from _leaves(item)
        elif item is not None:
            yield item


def _piece_paths(index):
    """The piece files of an index, in order (as the reader should assign them)."""
    import xml.etree.ElementTree as ET

    root = ET.parse(index).getroot()
    folder = os.path.dirname(os.path.abspath(index))
    if index.endswith(".vtm"):
        return [os.path.join(folder, e.get("file")) for e in root.iter("DataSet") if e.get("file")]
    return [os.path.join(folder, e.get("Source")) for e in root.iter("Piece")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every partitioned file (fmt, K) plus a monolithic .vtp and legacy .vtk of the same sphere."""
    folder = str(tmp_path_factory.mktemp("vtk"))
    out = {(fmt, k): _write_partitioned(os.path.join(folder, fmt), fmt, k)
           for fmt in ("pvtu", "pvtp", "vtm") for k in PIECE_COUNTS}
    sphere = _sphere()
    out["vtp"] = os.path.join(folder, "whole.vtp")
    sphere.save(out["vtp"])
    out["vtk"] = os.path.join(folder, "whole.vtk")
    sphere.save(out["vtk"])
    out["folder"] = folder
    return out


def _assert_equal(got: dict, got_coords, want: dict, want_coords, what):
    assert set(got) == set(want), f"{what}: arrays {sorted(got)}, expected {sorted(want)}"
    for n, w in want.items():
        g = got[n]
        assert g.dtype == w.dtype, f"{what}: {n} dtype {g.dtype}, file has {w.dtype}"
        assert g.shape == w.shape, f"{what}: {n} shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g, w), f"{what}: {n} differs"
    assert got_coords.dtype == want_coords.dtype, f"{what}: coords dtype {got_coords.dtype} != {want_coords.dtype}"
    torch.testing.assert_close(got_coords, want_coords, rtol=1e-6, atol=1e-6, msg=f"{what}: coords differ")


# --------------------------------------------------------------------------------------------
# rank functions (module level: the pool sends them by reference)
# --------------------------------------------------------------------------------------------
def _rank_read_all(paths: dict, cases: list):
    """Each case read piecewise on a 1-D "domain" mesh: what the parent needs to check it."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    results = []
    for key, association in cases:
        out = read_vtk(paths[key], arrays=None, mesh=mesh, association=association)
        first = next(iter(out.arrays.values()))
        full = ({n: t.full_tensor() for n, t in out.arrays.items()}, out.coords.full_tensor())  # collective
        results.append({
            "pieces": out.pieces, "bytes_read": out.bytes_read,
            "sizes": [s[0] for s in first.sharding_shapes[0]],
            "local_rows": {n: t.to_local().shape[0] for n, t in out.arrays.items()} | {
                "coords": out.coords.to_local().shape[0]},
            "placements": tuple(first.placements),
            "full": full if rank == 0 else None,
        })
    return results


def _rank_monolithic(path: str, src: int, arrays):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    out = read_vtk(path, arrays=arrays, mesh=mesh, association="cell", src=src)
    return {"bytes_read": out.bytes_read, "pieces": out.pieces, "names": list(out.arrays),
            "sizes": [out.arrays[n].to_local().shape[0] for n in out.arrays] + [out.coords.to_local().shape[0]],
            "full": ({n: t.full_tensor() for n, t in out.arrays.items()}, out.coords.full_tensor())}


def _rank_error(path: str, kwargs: dict):
    """Run a read expected to fail; return the message (every rank must get one, none may hang)."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    try:
        read_vtk(path, mesh=mesh, **kwargs)
    except (ValueError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _rank_bad_axis(path: str):
    rank, world = rank_and_world()
    try:
        read_vtk(path, mesh=get_mesh((world,), ("space",)), axis="domain")
    except ValueError as exc:
        return str(exc)
    return None


def _rank_2d(path: str):
    """A (dp, domain) = (2, 2) mesh: each dp row reads the whole file piecewise over its domain ranks."""
    mesh = get_mesh((2, 2), ("dp", "domain"))
    out = read_vtk(path, arrays=("pMeanTrim", "wallShearStressMeanTrim"), mesh=mesh, axis="domain")
    p = out.arrays["pMeanTrim"]
    return {"pieces": out.pieces, "mesh_names": p.device_mesh.mesh_dim_names,
            "mesh_ranks": p.device_mesh.mesh.flatten().tolist(),
            "full": ({n: t.full_tensor() for n, t in out.arrays.items()}, out.coords.full_tensor())}


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
def test_piecewise_equals_whole_dataset(dist, world_size, files):
    """For every format, K < W, K == W and K > W, cell and point data: the union over ranks equals VTK's
    whole-dataset read; rank r read exactly pieces [r*K//W, (r+1)*K//W) and only their bytes."""
    cases = [((fmt, k), assoc) for fmt in ("pvtu", "pvtp", "vtm") for k in PIECE_COUNTS for assoc in ("cell", "point")]
    per_rank = dist.run(world_size, _rank_read_all, files, cases, timeout=TIMEOUT)
    for c, (key, assoc) in enumerate(cases):
        what = f"{key[0]} K={key[1]} {assoc} on {world_size} ranks"
        path, k = files[key], key[1]
        pieces = _piece_paths(path)
        want, want_coords = _vtk_reference(path, assoc)
        _assert_equal(*per_rank[0][c]["full"], want, want_coords, what)
        rows = []
        for r in range(world_size):
            got = per_rank[r][c]
            mine = pieces[r * k // world_size:(r + 1) * k // world_size]
            assert got["pieces"] == mine, f"{what}: rank {r} read {got['pieces']}, expected {mine}"
            assert got["bytes_read"] == sum(os.path.getsize(p) for p in mine), f"{what}: rank {r} bytes_read"
            rows.append(sum(_vtk_reference(p, assoc)[1].shape[0] for p in mine))
            assert set(got["local_rows"].values()) == {rows[-1]}, f"{what}: rank {r} rows {got['local_rows']}"
            assert got["placements"] == (Shard(0),), f"{what}: placements {got['placements']}"
        assert per_rank[0][c]["sizes"] == rows, f"{what}: sharding sizes {per_rank[0][c]['sizes']} != {rows}"


@pytest.mark.parametrize("fmt", ["vtp", "vtk"])
def test_monolithic_read_by_one_rank_and_scattered(dist, world_size, files, fmt):
    """Only rank src opens the file; every rank gets a balanced row range; the union is the file."""
    src = world_size - 1
    per_rank = dist.run(world_size, _rank_monolithic, files[fmt], src, None, timeout=TIMEOUT)
    want, want_coords = _vtk_reference(files[fmt], "cell")
    n = want_coords.shape[0]
    for r, got in enumerate(per_rank):
        assert (got["bytes_read"] > 0) == (r == src), f"rank {r} bytes_read {got['bytes_read']}"
        if r == src:
            assert got["bytes_read"] == os.path.getsize(files[fmt]) and got["pieces"] == [files[fmt]]
        else:
            assert got["pieces"] == []
        balanced = (r + 1) * n // world_size - r * n // world_size
        assert set(got["sizes"]) == {balanced}, f"rank {r} holds {got['sizes']} rows, balanced is {balanced}"
        _assert_equal(*got["full"], want, want_coords, f"{fmt} on rank {r}")


def test_only_requested_arrays(dist, files):
    """Requesting one array of two returns just it, on the piecewise, scattered and mesh=None paths."""
    out = read_vtk(files[("pvtu", 3)], arrays=("pMeanTrim",))
    assert list(out.arrays) == ["pMeanTrim"]
    out = read_vtk(files[("vtm", 3)], arrays="q", association="point")
    assert list(out.arrays) == ["q"]
    per_rank = dist.run(2, _rank_monolithic, files["vtp"], 0, ["wallShearStressMeanTrim"], timeout=TIMEOUT)
    assert [r["names"] for r in per_rank] == [["wallShearStressMeanTrim"]] * 2
    per_rank = dist.run(2, _rank_monolithic, files["vtk"], 1, ["pMeanTrim"], timeout=TIMEOUT)
    assert [r["names"] for r in per_rank] == [["pMeanTrim"]] * 2


@pytest.mark.parametrize("key", [("pvtu", 4), ("pvtp", 5), ("vtm", 3), "vtp", "vtk"], ids=str)
def test_mesh_none_reads_the_whole_file_as_plain_tensors(files, key):
    path = files[key]
    for assoc in ("cell", "point"):
        names = tuple(CELL if assoc == "cell" else POINT)
        out = read_vtk(path, arrays=names, association=assoc)
        assert all(type(t) is torch.Tensor for t in out.arrays.values()) and type(out.coords) is torch.Tensor
        _assert_equal(out.arrays, out.coords, *_vtk_reference(path, assoc, names), f"{key} {assoc}")
        data_files = _piece_paths(path) if isinstance(key, tuple) else [path]
        assert out.pieces == data_files
        assert out.bytes_read == sum(os.path.getsize(p) for p in data_files)


def test_missing_array_raises_on_every_rank_listing_the_present(dist, files):
    for path in (files[("pvtu", 2)], files[("vtm", 5)], files["vtp"], files["vtk"]):
        msgs = dist.run(3, _rank_error, path, {"arrays": ("pMeanTrim", "nope")}, timeout=TIMEOUT)
        for r, m in enumerate(msgs):
            assert m is not None and m.startswith("ValueError"), f"{path}: rank {r} got {m!r}"
            assert "'nope'" in m and "'wallShearStressMeanTrim'" in m and "pMeanTrim" in m, m
    # a cell array asked for as point data: the message says so
    msgs = dist.run(2, _rank_error, files[("pvtp", 3)], {"arrays": ("pMeanTrim",), "association": "point"},
                    timeout=TIMEOUT)
    assert all("association='cell'" in m for m in msgs), msgs


def test_missing_piece_file(dist, files, tmp_path):
    folder = str(tmp_path / "missing")
    shutil.copytree(os.path.dirname(files[("pvtp", 3)]), folder)
    index = os.path.join(folder, "data_3.pvtp")
    gone = _piece_paths(index)[2]
    os.remove(gone)
    msgs = dist.run(3, _rank_error, index, {}, timeout=TIMEOUT)
    assert all(m and "ValueError" in m and gone in m and "do not exist" in m for m in msgs), msgs


def test_unparsable_index(dist, tmp_path):
    index = str(tmp_path / "broken.pvtu")
    with open(index, "w") as fh:
        fh.write('<?xml version="1.0"?>\n<VTKFile type="PUnstructuredGrid"><PUnstructuredGrid>\n')
    msgs = dist.run(2, _rank_error, index, {}, timeout=TIMEOUT)
    assert all(m and "ValueError" in m and index in m for m in msgs), msgs


@pytest.mark.parametrize("fmt,mode", [("pvtu", "appended"), ("pvtp", "raw")])
def test_corrupt_piece_on_one_rank_raises_everywhere(dist, files, tmp_path, fmt, mode):
    """Truncating piece 1's binary data: only rank 1 can see it, yet every rank raises naming the file."""
    folder = str(tmp_path / fmt)
    shutil.copytree(os.path.dirname(files[(fmt, 3)]), folder)
    index = os.path.join(folder, f"data_3.{fmt}")
    bad = _piece_paths(index)[1]
    mesh = _split(_sphere(), 3)[1]
    _write_piece(mesh if fmt == "pvtu" else _as_poly(mesh), bad, mode)
    with open(bad, "r+b") as fh:
        fh.truncate(os.path.getsize(bad) * 2 // 3)
    msgs = dist.run(3, _rank_error, index, {}, timeout=TIMEOUT)
    for r, m in enumerate(msgs):
        assert m is not None and "ValueError" in m and bad in m, f"rank {r}: {m!r}"
        assert "rank 1" in m, f"rank {r} does not say which rank failed: {m!r}"


def test_corrupt_monolithic_file_raises_everywhere(dist, files, tmp_path):
    bad = str(tmp_path / "whole.vtp")
    shutil.copy(files["vtp"], bad)
    with open(bad, "r+b") as fh:
        fh.truncate(os.path.getsize(bad) // 2)
    msgs = dist.run(3, _rank_error, bad, {"src": 2}, timeout=TIMEOUT)
    assert all(m and "ValueError" in m and bad in m and "rank 2" in m for m in msgs), msgs


def test_axis_not_in_mesh(dist, files):
    msgs = dist.run(2, _rank_bad_axis, files[("pvtu", 2)], timeout=TIMEOUT)
    assert all(m and "'domain'" in m and "('space',)" in m for m in msgs), msgs


def test_bad_arguments(files):
    with pytest.raises(ValueError, match="association"):
        read_vtk(files["vtp"], association="face")
    with pytest.raises(FileNotFoundError, match="nowhere.vtp"):
        read_vtk(os.path.join(files["folder"], "nowhere.vtp"))


def test_2d_mesh_shards_over_the_domain_sub_mesh(dist, files):
    """(dp, domain) = (2, 2): arrays live on the domain sub-mesh; both dp rows hold the whole file and
    the ranks at one domain coordinate read the same pieces."""
    path = files[("pvtu", 3)]
    per_rank = dist.run(4, _rank_2d, path, timeout=TIMEOUT)
    want, want_coords = _vtk_reference(path, "cell", tuple(CELL))
    pieces = _piece_paths(path)
    for r, got in enumerate(per_rank):
        dp, dom = divmod(r, 2)
        assert got["mesh_names"] == ("domain",) and got["mesh_ranks"] == [2 * dp, 2 * dp + 1], got
        assert got["pieces"] == pieces[dom * 3 // 2:(dom + 1) * 3 // 2], f"rank {r}: {got['pieces']}"
        _assert_equal(*got["full"], want, want_coords, f"2-D mesh rank {r}")


def test_vtm_blocks_are_chosen_by_name(tmp_path):
    """An OpenFOAM-style multi-block case (the volume as "internalMesh", the boundary patches in a "boundary"
    block), written by pyvista/VTK: ``blocks=`` reads the named ones only, equal to pyvista's own read of them,
    instead of joining the volume and the patches into one array."""
    import pyvista as pv

    from domainflow.readers import read_vtk

    volume = pv.ImageData(dimensions=(4, 3, 3)).cast_to_unstructured_grid()
    volume.cell_data["p"] = np.arange(volume.n_cells, dtype=np.float64)
    inlet = pv.Plane(i_resolution=2, j_resolution=2)
    inlet.cell_data["p"] = 100.0 + np.arange(inlet.n_cells, dtype=np.float64)
    wall = pv.Plane(i_resolution=3, j_resolution=1)
    wall.cell_data["p"] = 200.0 + np.arange(wall.n_cells, dtype=np.float64)
    case = pv.MultiBlock({"internalMesh": volume, "boundary": pv.MultiBlock({"inlet": inlet, "wall": wall})})
    case.save(tmp_path / "case.vtm")
    back = pv.read(tmp_path / "case.vtm")
    got = read_vtk(tmp_path / "case.vtm", ["p"], blocks=["internalMesh"])
    np.testing.assert_array_equal(got.arrays["p"].numpy(), back["internalMesh"].cell_data["p"])
    got = read_vtk(tmp_path / "case.vtm", ["p"], blocks="boundary")  # a block of blocks: all its patches
    np.testing.assert_array_equal(got.arrays["p"].numpy(), np.concatenate([inlet.cell_data["p"], wall.cell_data["p"]]))
    got = read_vtk(tmp_path / "case.vtm", ["p"], blocks=["wall"])
    np.testing.assert_array_equal(got.arrays["p"].numpy(), wall.cell_data["p"])
    with pytest.raises(ValueError, match=r"has no block\(s\) named \['walls'\]; its blocks and data sets are "
                                         r"\['boundary', 'inlet', 'internalMesh', 'wall'\]"):
        read_vtk(tmp_path / "case.vtm", ["p"], blocks=["walls"])
    with pytest.raises(ValueError, match="selects blocks of a .vtm"):
        read_vtk(next(tmp_path.rglob("*.vtu")), ["p"], blocks=["internalMesh"])
