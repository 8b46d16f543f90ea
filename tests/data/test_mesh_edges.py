"""``ingest cfd --edges``: each run's cell adjacency as graph edges in the store, equal to VTK's own neighbour
search (``cell_neighbors``: surface cells sharing an edge, volume cells sharing a face) on files written by VTK and
on OpenFOAM's own output, the same from the streaming and the whole-file path, from a decomposed OpenFOAM case read
processor by processor and from its serial twin, and out of core with many buckets; the refusals are named."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_cfd, ingest_drivaerml  # noqa: E402
from domainflow.preprocess.mesh_edges import StreamedEdges, location_edges, side_keys  # noqa: E402

CASES = Path(__file__).with_name("openfoam")


def _vtk_pairs(mesh, connection: str) -> set:
    """VTK's neighbours of every cell, as (cell, neighbour) pairs of the mesh's cell numbers."""
    return {(int(a), int(b)) for a in range(mesh.n_cells) for b in mesh.cell_neighbors(a, connection)}


def _merged_by_position(mesh):
    """``mesh`` with coincident points made one (pieces, patches and processors each carry copies), cells kept."""
    pts = np.asarray(mesh.points, dtype=np.float64)
    unique, inverse = np.unique(pts, axis=0, return_inverse=True)
    if isinstance(mesh, pv.PolyData):
        faces = np.asarray(mesh.faces).copy()
        k = 0
        while k < len(faces):
            n = faces[k]
            faces[k + 1:k + 1 + n] = inverse.ravel()[faces[k + 1:k + 1 + n]]
            k += n + 1
        return pv.PolyData(unique, faces=faces)
    offsets = np.asarray(mesh.cell_offsets)
    cells = np.insert(inverse.ravel()[np.asarray(mesh.cell_connectivity)], offsets[:-1], np.diff(offsets))
    return pv.UnstructuredGrid(cells, np.asarray(mesh.celltypes), unique)


def _stored_pairs(group) -> set:
    """The store's edges of a location as (raw cell, raw cell) pairs (``order`` maps rows back to cells)."""
    order, edges = group["order"][...], group["edges"][...]
    return {(int(order[s]), int(order[r])) for s, r in edges}


def _check_layout(group):
    """Sorted by (receiver, sender), each once, no self loop, both directions, part p's receivers in its rows."""
    edges, parts, eparts = group["edges"][...], group["parts"][...], group["edge_parts"][...]
    key = edges[:, 1] * (1 << 32) + edges[:, 0]
    assert (np.diff(key) > 0).all() and (edges[:, 0] != edges[:, 1]).all()
    assert {tuple(e) for e in edges} == {(r, s) for s, r in edges}
    assert len(eparts) == len(parts) and eparts[0] == 0 and eparts[-1] == len(edges)
    for p in range(len(parts) - 1):
        r = edges[eparts[p]:eparts[p + 1], 1]
        assert ((r >= parts[p]) & (r < parts[p + 1])).all()


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """Two DrivaerML-style runs (a .vtp surface, a volume in two .part pieces), ingested with edges by the
    streaming path and by the whole-file (VTK) path."""
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("edges")
    synth_drivaerml(root / "raw", runs=2, cells=500, seed=3, volume_cells=200, volume_pieces=2, progress=False)
    for reader in ("stream", "vtk"):
        ingest_drivaerml(root / "raw", root / f"{reader}.zarr", MeshOptions(parts=4, progress=False, edges=True,
                                                                           reader=reader, split=(0.5, 0.5, 0.0)))
    return root


def test_edges_equal_vtks_neighbours_on_both_ingest_paths(synth, tmp_path):
    stream = zarr.open_group(str(synth / "stream.zarr"), mode="r")
    whole = zarr.open_group(str(synth / "vtk.zarr"), mode="r")
    assert stream.attrs["ingest"]["config"]["edges"] is True
    surface = pv.read(synth / "raw" / "run_1" / "boundary_1.vtp")
    joined = tmp_path / "volume_1.vtu"  # the .part pieces are one file's bytes, cut
    joined.write_bytes(b"".join(p.read_bytes() for p in sorted((synth / "raw" / "run_1").glob("volume_1.vtu.*.part"))))
    volume = pv.read(joined)
    want = {"surface": _vtk_pairs(surface, "edges"), "volume": _vtk_pairs(volume, "faces")}
    for loc in ("surface", "volume"):
        g = stream[f"runs/run_1/{loc}"]
        _check_layout(g)
        assert _stored_pairs(g) == want[loc] and len(want[loc]) > g["coords"].shape[0]
        assert stream["runs/run_1"].attrs["edges"][loc] == g["edges"].shape[0]
        np.testing.assert_array_equal(g["edges"][...], whole[f"runs/run_1/{loc}/edges"][...])
        np.testing.assert_array_equal(g["edge_parts"][...], whole[f"runs/run_1/{loc}/edge_parts"][...])


def test_out_of_core_with_many_buckets_equals_the_in_memory_edges(synth, tmp_path):
    from domainflow.vtk.pyvista_io import cell_connectivity

    sizes, conn, points, _ = cell_connectivity(pv.read(synth / "raw" / "run_2" / "boundary_2.vtp"), True, "s")
    n = len(sizes)
    rng = np.random.default_rng(0)
    row_of = rng.permutation(n)
    offsets = np.array([0, n // 5, n // 2, n // 2, n], dtype=np.int64)  # an empty part too
    starts = np.r_[0, np.cumsum(sizes)]
    blocks, streamed = [], StreamedEdges(tmp_path, "t-edges", n, budget_bytes=8 << 10)  # a few KiB: ~6 buckets
    group = zarr.open_group(str(tmp_path / "g"), mode="w")
    try:
        for c0 in range(0, n, 97):
            c1 = min(c0 + 97, n)
            sides = side_keys(sizes[c0:c1], conn[starts[c0]:starts[c1]], points, None, True, "s")
            blocks.append({k: (keys, cells + c0) for k, (keys, cells) in sides.items()})
            streamed.add(sides, c0, c1 - c0)
        assert streamed.buckets > 3
        count = streamed.write(tmp_path / "g", row_of, offsets, chunk_rows=50)
    finally:
        streamed.close()
    edges, parts = location_edges(blocks, row_of, offsets)
    assert count == len(edges) > 0 and not list(tmp_path.glob("t-edges.*"))  # scratch removed
    np.testing.assert_array_equal(group["edges"][...], edges)
    np.testing.assert_array_equal(group["edge_parts"][...], parts)
    assert parts[2] == parts[3]


CAVITY = """
runs: "cavity*"
openfoam: {surface: [movingWall, fixedWalls], volume: internalMesh}
fields:
  surface: [{name: p, source: p, quantity: as_read, units: m2/s2}]
  volume: [{name: p, source: p, quantity: as_read, units: m2/s2}]
"""


def _foam(case: Path, blocks, decomposed=False):
    r = pv.POpenFOAMReader(str(case / "system" / "controlDict"))
    if decomposed:
        r.case_type = "decomposed"
    r.disable_all_patch_arrays()
    for b in blocks:
        r.enable_patch_array(b)
    leaves = [b for b in r.read().recursive_iterator() if b is not None and b.n_cells]
    return leaves[0] if len(leaves) == 1 else pv.MultiBlock(leaves).combine(merge_points=False)


def _by_centre(group) -> set:
    """The edges as pairs of cell centres: a mesh's graph independent of how its cells are numbered."""
    c = [tuple(x) for x in np.round(group["coords"][...].astype(np.float64), 6)]
    return {(c[s], c[r]) for s, r in group["edges"][...]}


def test_openfoam_cases_serial_and_decomposed_give_vtks_graph(tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity", raw / "cavity")
    shutil.copytree(CASES / "cavity_decomposed", raw / "cavity_decomposed")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(CAVITY)
    ingest_cfd(raw, tmp_path / "s.zarr", MeshOptions(recipe=recipe, parts=2, progress=False, split=(1.0, 0.0, 0.0),
                                                     edges=True))
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    serial, decomposed = root["runs/run_0"], root["runs/run_1"]
    internal = _foam(raw / "cavity", ["internalMesh"])
    assert _stored_pairs(serial["volume"]) == _vtk_pairs(internal, "faces")
    assert serial["volume/edges"].shape[0] == 2 * 760  # the case's 760 internal faces, both directions
    walls = _foam(raw / "cavity", ["patch/movingWall", "patch/fixedWalls"])
    assert _stored_pairs(serial["surface"]) == _vtk_pairs(_merged_by_position(walls), "edges")
    for loc in ("surface", "volume"):
        _check_layout(decomposed[loc])
        # processor by processor, each with its own points: the same graph as the serial case
        assert _by_centre(decomposed[loc]) == _by_centre(serial[loc])


def test_refusals_are_named(synth, tmp_path):
    with pytest.raises(IngestError, match=r"--edges with --volume-points 10: a random subset"):
        MeshOptions(edges=True, volume_points=10).validate()
    grid = pv.ImageData(dimensions=(3, 2, 2)).cast_to_unstructured_grid()
    sizes, conn = np.array([8, 8]), np.asarray(grid.cell_connectivity)
    types = np.array([12, 42])
    with pytest.raises(IngestError, match=r"mesh.vtu: cell 1 has VTK cell type 42 \(polyhedron\); --edges finds"):
        side_keys(sizes, conn, np.asarray(grid.points), types, False, "mesh.vtu")
    # a store with edges is not resumed or redone without them (one store, one set of options)
    with pytest.raises(IngestError, match=r"edges: store has True, this ingest asks None"):
        ingest_drivaerml(synth / "raw", synth / "stream.zarr", MeshOptions(parts=4, progress=False,
                                                                          split=(0.5, 0.5, 0.0)))


def test_a_hash_collision_falls_back_to_sorting_the_keys(synth, monkeypatch):
    """Sides are paired after a sort by a 64-bit hash of their keys; keys that share a hash (here all of them)
    are sorted by the keys themselves, so a collision never joins or separates cells wrongly."""
    from domainflow.preprocess import mesh_edges
    from domainflow.vtk.pyvista_io import cell_connectivity

    sizes, conn, points, _ = cell_connectivity(pv.read(synth / "raw" / "run_1" / "boundary_1.vtp"), True, "s")
    keys, cells = side_keys(sizes, conn, points, None, True, "s")[2]
    want = mesh_edges.shared_pairs(keys, cells)
    monkeypatch.setattr(mesh_edges, "_mix", lambda bits: np.zeros(len(bits), np.uint64))
    got = mesh_edges.shared_pairs(keys, cells)
    assert len(want[0]) > len(sizes)
    assert sorted(zip(*got)) == sorted(zip(*want))


def test_cells_meeting_at_a_point_of_collapsed_sides_do_not_touch():
    """Quads with a repeated point (a triangle written as a quad, common in CFD output) have an edge of length 0;
    two such cells meeting only at that point share no edge, and a face of fewer than 3 distinct points is none."""
    pts = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [2, 1, 0], [2, 2, 0]], dtype=np.float64)
    sizes, conn = np.array([4, 4]), np.array([0, 1, 2, 2, 2, 2, 3, 4])
    keys, cells = side_keys(sizes, conn, pts, None, True, "s")[2]
    from domainflow.preprocess.mesh_edges import shared_pairs

    assert len(keys) == 6 and len(shared_pairs(keys, cells)[0]) == 0
    # two hexahedra collapsed into wedges along a common line touch through no face
    hexes = np.array([[0, 1, 2, 2, 5, 6, 7, 7], [2, 2, 3, 4, 7, 7, 8, 9]])
    cube = np.array([[x, y, z] for z in (0, 1) for x, y in ((0, 0), (1, 0), (1, 1), (2, 1), (2, 2))], np.float64)
    sides = side_keys(np.array([8, 8]), hexes.ravel(), cube, np.array([12, 12]), False, "v")
    assert all(len(shared_pairs(k, c)[0]) == 0 for k, c in sides.values())


@pytest.mark.parametrize("second", ["tetra", "collapsed hexahedron"])
def test_a_hexahedron_written_as_a_prism_touches_its_neighbour_through_the_triangle(second):
    """A hexahedron with a repeated point (how many exporters write a prism) has a quad face of 3 distinct points:
    it is that triangle, so the cell beside it through the triangle (a tetrahedron, or another collapsed
    hexahedron whose repeated corner differs) touches it, as VTK's cell_neighbors says (review finding)."""
    pts = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 0, 1], [1, 0, 1], [1, 1, 1], [0, 0, -1], [1, 0, -1],
                    [1, 1, -1], [1, 1, -1]], float)
    prism = [8, 0, 1, 2, 2, 3, 4, 5, 5]  # bottom face (0, 1, 2, 2): the triangle 0-1-2
    other = [4, 0, 1, 2, 6] if second == "tetra" else [8, 6, 7, 8, 8, 0, 0, 1, 2]  # top face (0, 0, 1, 2)
    mesh = pv.UnstructuredGrid(np.array(prism + other), np.array([12, 10 if second == "tetra" else 12], np.uint8), pts)
    from domainflow.preprocess.mesh_edges import shared_pairs
    from domainflow.vtk.pyvista_io import cell_connectivity

    sizes, conn, points, types = cell_connectivity(mesh, False, "v")
    pairs = {(int(a), int(b)) for k, c in side_keys(sizes, conn, points, types, False, "v").values()
             for a, b in zip(*shared_pairs(k, c))}
    assert {p for p in pairs} | {(b, a) for a, b in pairs} == _vtk_pairs(mesh, "faces") == {(0, 1), (1, 0)}


def test_few_parts_sort_the_edges_in_bounded_groups(synth, tmp_path):
    """The out-of-core sort groups edges by ranges of receiving rows, not by part: with 1 part and many buckets
    each group is about a bucket (a review found one group per part, the whole run's edges at once)."""
    from domainflow.preprocess import mesh_edges
    from domainflow.vtk.pyvista_io import cell_connectivity

    sizes, conn, points, _ = cell_connectivity(pv.read(synth / "raw" / "run_2" / "boundary_2.vtp"), True, "s")
    n = len(sizes)
    row_of = np.random.default_rng(1).permutation(n)
    streamed = StreamedEdges(tmp_path, "t-edges", n, budget_bytes=8 << 10)
    zarr.open_group(str(tmp_path / "g"), mode="w")
    seen = []
    real = mesh_edges.sorted_once

    def spy(e):
        seen.append(len(e))
        return real(e)

    mesh_edges.sorted_once = spy
    try:
        streamed.add(side_keys(sizes, conn, points, None, True, "s"), 0, n)
        count = streamed.write(tmp_path / "g", row_of, np.array([0, n]), chunk_rows=64)
    finally:
        mesh_edges.sorted_once = real
        streamed.close()
    assert streamed.buckets > 3 and len(seen) >= streamed.buckets - 1 and max(seen) < count / 2
    edges, parts = location_edges([side_keys(sizes, conn, points, None, True, "s")], row_of, np.array([0, n]))
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "g"), mode="r")["edges"][...], edges)


def test_a_pvtp_piece_set_written_by_vtks_parallel_writer(tmp_path):
    """A surface as VTK's parallel writer leaves it (``.pvtp`` and its ``.vtp`` pieces, each with its own copy of
    the points on the seams): ingested as VTK reads it (``pv.get_reader`` has no ``.pvtp`` reader, once a bare
    "cannot be read"), its edges crossing the pieces' seams as in the whole surface."""
    import vtk

    run = tmp_path / "raw" / "run_1"
    run.mkdir(parents=True)
    source = vtk.vtkSphereSource()  # a streaming source: each piece its own cells
    source.SetThetaResolution(24)
    source.SetPhiResolution(16)
    height = vtk.vtkElevationFilter()  # a field to store: the height, averaged to the cells
    height.SetInputConnection(source.GetOutputPort())
    to_cells = vtk.vtkPointDataToCellData()
    to_cells.SetInputConnection(height.GetOutputPort())
    writer = vtk.vtkXMLPPolyDataWriter()
    writer.SetFileName(str(run / "surf.pvtp"))
    writer.SetNumberOfPieces(3)
    writer.SetStartPiece(0)
    writer.SetEndPiece(2)
    writer.SetInputConnection(to_cells.GetOutputPort())
    writer.Write()
    assert len(list(run.glob("surf_*.vtp"))) == 3
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text('runs: "run_*"\nfiles: {surface: surf.pvtp}\n'
                      'fields: {surface: [{name: z, source: Elevation, quantity: as_read, units: "1"}]}\n')
    ingest_cfd(tmp_path / "raw", tmp_path / "s.zarr", MeshOptions(recipe=recipe, parts=2, progress=False,
                                                                  split=(1.0, 0.0, 0.0), edges=True))
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["runs/run_0/surface"]
    r = vtk.vtkXMLPPolyDataReader()
    r.SetFileName(str(run / "surf.pvtp"))
    r.Update()
    whole = pv.wrap(r.GetOutput())
    order = g["order"][...]
    assert len(order) == whole.n_cells > 300
    np.testing.assert_allclose(g["coords"][...], np.asarray(whole.cell_centers().points)[order], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(g["fields/z"][...][:, 0], np.asarray(whole.cell_data["Elevation"], np.float32)[order])
    _check_layout(g)
    assert _stored_pairs(g) == _vtk_pairs(_merged_by_position(whole), "edges")
    assert _vtk_pairs(whole, "edges") < _stored_pairs(g)  # by point id alone, the seams would not connect
