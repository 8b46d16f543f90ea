"""Synthetic DrivaerML set: exact raw layout, forces that re-integrate from the files, outward normals,
determinism per (seed, run), smooth and physically sane coefficients, argument checks."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")

from domainflow.preprocess import synth_drivaerml as S  # noqa: E402
from domainflow.preprocess.reference import DRIVAERML, Reference  # noqa: E402
from domainflow.preprocess.synth_drivaerml import DESIGN_PARAMETERS, synth_drivaerml  # noqa: E402

CELLS = 2000
SURFACE = {"pMeanTrim": 1, "CpMeanTrim": 1, "pPrime2MeanTrim": 1, "wallShearStressMeanTrim": 3}
VOLUME = {"UMeanTrim": 3, "pMeanTrim": 1, "nutMeanTrim": 1, "CpMeanTrim": 1}


def _files(i, pieces):
    vol = [f"volume_{i}.vtu.{k:02d}.part" for k in range(pieces)] if pieces > 1 else [f"volume_{i}.vtu"]
    return {f"boundary_{i}.vtp", f"drivaer_{i}.stl", f"force_mom_{i}.csv", f"force_mom_constref_{i}.csv",
            f"geo_parameters_{i}.csv", *vol}


def _row(path):
    with open(path, newline="") as f:
        header, values, *rest = list(csv.reader(f))
    assert rest == [] and len(header) == len(values)
    return dict(zip(header, map(float, values)))


def _cells(mesh, spec):
    out = {}
    for name, comps in spec.items():
        a = np.asarray(mesh.cell_data[name])
        assert a.dtype == np.float32, name
        assert a.shape == ((mesh.n_cells,) if comps == 1 else (mesh.n_cells, comps)), name
        assert np.isfinite(a).all(), name
        out[name] = a
    return out


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """Runs 3 and 4 (seed 7) with the volume split in 3 pieces, and run 3 again unsplit."""
    base = tmp_path_factory.mktemp("drivaerml")
    split = synth_drivaerml(base / "split", runs=2, cells=CELLS, seed=7, volume_pieces=3, first_run=3,
                            progress=True)
    whole = synth_drivaerml(base / "whole", runs=1, cells=CELLS, seed=7, volume_pieces=1, first_run=3)
    return split, whole


def test_layout_names_arrays_and_split_volume(raw):
    split, whole = raw
    assert [p.name for p in split] == ["run_3", "run_4"] and [p.name for p in whole] == ["run_3"]
    for folder in split:
        i = int(folder.name[4:])
        assert {p.name for p in folder.iterdir()} == _files(i, 3)  # nothing else, no temporaries
        surface = pv.read(folder / f"boundary_{i}.vtp")
        assert isinstance(surface, pv.PolyData) and abs(surface.n_cells - CELLS) <= 0.15 * CELLS
        assert surface.is_all_triangles
        _cells(surface, SURFACE)
        stl = pv.read(folder / f"drivaer_{i}.stl")
        assert stl.n_cells == surface.n_cells
        assert open(folder / f"drivaer_{i}.stl", "rb").read(5) != b"solid"  # binary STL
        assert tuple(_row(folder / f"geo_parameters_{i}.csv")) == DESIGN_PARAMETERS
        for name in (f"force_mom_{i}.csv", f"force_mom_constref_{i}.csv"):
            assert tuple(_row(folder / name)) == S.FORCE_COLUMNS
    joined = b"".join((split[0] / f"volume_3.vtu.{k:02d}.part").read_bytes() for k in range(3))
    single = (whole[0] / "volume_3.vtu").read_bytes()
    sizes = [(split[0] / f"volume_3.vtu.{k:02d}.part").stat().st_size for k in range(3)]
    assert max(sizes) - min(sizes) <= 1
    assert joined == single and b'format="ascii"' not in single
    (split[0] / "joined.vtu").write_bytes(joined)
    try:
        volume = pv.read(split[0] / "joined.vtu")
    finally:
        (split[0] / "joined.vtu").unlink()
    assert isinstance(volume, pv.UnstructuredGrid) and abs(volume.n_cells - CELLS) <= 0.15 * CELLS
    assert set(volume.celltypes) == {pv.CellType.HEXAHEDRON}
    fields = _cells(volume, VOLUME)
    reference = pv.read(whole[0] / "volume_3.vtu")
    for name in VOLUME:
        np.testing.assert_array_equal(fields[name], np.asarray(reference.cell_data[name]))


def _integrate(mesh, point):
    """Force and moment on the body from the file's fields with pyvista's normals, areas and centres."""
    normals = np.asarray(mesh.compute_normals(cell_normals=True, point_normals=False, auto_orient_normals=False,
                                              consistent_normals=False, split_vertices=False)
                         .cell_data["Normals"], dtype=np.float64)
    areas = np.asarray(mesh.compute_cell_sizes(length=False, area=True, volume=False).cell_data["Area"])
    centres = np.asarray(mesh.cell_centers().points, dtype=np.float64)
    p = np.asarray(mesh.cell_data["pMeanTrim"], dtype=np.float64)
    tau = np.asarray(mesh.cell_data["wallShearStressMeanTrim"], dtype=np.float64)
    f = (-(p - DRIVAERML.p_inf)[:, None] * normals + tau) * areas[:, None]
    return f.sum(0), np.cross(centres - point, f).sum(0), normals, areas


def test_csv_forces_equal_integrated_fields(raw):
    q, l_ref = DRIVAERML.q_inf, DRIVAERML.l_ref
    for folder in raw[0]:
        i = int(folder.name[4:])
        mesh = pv.read(folder / f"boundary_{i}.vtp")
        geo = _row(folder / f"geo_parameters_{i}.csv")
        x_front, x_rear = geo["Front_Overhang"], geo["Vehicle_Length"] - geo["Rear_Overhang"]
        mid = np.array([0.5 * (x_front + x_rear), 0.0, 0.0])
        force, moment, normals, areas = _integrate(mesh, mid)
        frontal = 0.5 * np.sum(np.abs(normals[:, 0]) * areas)  # silhouette of an x-monotone closed body
        own, const = _row(folder / f"force_mom_{i}.csv"), _row(folder / f"force_mom_constref_{i}.csv")
        area = force[0] / (q * own["cd"])
        assert area == pytest.approx(frontal, rel=0.02)
        for row, a_ref, point in ((own, area, mid), (const, S.A_REF_CONST, S.CENTRE_CONST)):
            m = moment + np.cross(mid - point, force)
            qa = q * a_ref
            axle = (moment[1] / (qa * (x_rear - x_front)))
            want = {"cd": force[0] / qa, "cs": force[1] / qa, "cl": force[2] / qa, "cmx": m[0] / (qa * l_ref),
                    "cmy": m[1] / (qa * l_ref), "cmz": m[2] / (qa * l_ref),
                    "clf": 0.5 * force[2] / qa + axle, "clr": 0.5 * force[2] / qa - axle}
            scale = abs(want["cd"])
            for k, v in want.items():
                assert row[k] == pytest.approx(v, rel=1e-4, abs=1e-4 * scale), (folder.name, k)
        assert const["cd"] / own["cd"] == pytest.approx(area / S.A_REF_CONST, rel=1e-6)
        cp = np.asarray(mesh.cell_data["CpMeanTrim"], np.float64)
        p = np.asarray(mesh.cell_data["pMeanTrim"], np.float64)
        np.testing.assert_allclose(cp, (p - DRIVAERML.p_inf) / q, rtol=1e-5, atol=1e-6)


def test_normals_point_out_of_a_closed_body(raw):
    mesh = pv.read(raw[0][0] / "boundary_3.vtp")
    assert mesh.n_open_edges == 0
    normals = np.asarray(mesh.cell_normals, dtype=np.float64)
    areas = np.asarray(mesh.compute_cell_sizes().cell_data["Area"])
    centres = np.asarray(mesh.cell_centers().points, dtype=np.float64)
    centroid = (centres * areas[:, None]).sum(0) / areas.sum()
    assert np.mean(np.einsum("ij,ij->i", normals, centres - centroid) > 0) > 0.98
    signed_volume = np.sum(np.einsum("ij,ij->i", centres, normals) * areas) / 3.0
    assert signed_volume > 0 and signed_volume == pytest.approx(mesh.volume, rel=1e-3)
    assert 4.0 < signed_volume < 10.0  # a car: ~4.6 x 1.8 x 1.4 m, well filled
    assert mesh.bounds[4] > 0.05  # above the ground at ride height
    assert (areas > 0).all()


def test_deterministic_per_seed_and_run(tmp_path, raw):
    alone = synth_drivaerml(tmp_path / "a", runs=1, cells=CELLS, seed=7, first_run=4, volume_pieces=0)
    other = synth_drivaerml(tmp_path / "b", runs=1, cells=CELLS, seed=8, first_run=4, volume_pieces=0)
    ref = pv.read(raw[0][1] / "boundary_4.vtp")
    same = pv.read(alone[0] / "boundary_4.vtp")
    diff = pv.read(other[0] / "boundary_4.vtp")
    assert np.asarray(ref.points).tobytes() == np.asarray(same.points).tobytes()
    for name in SURFACE:
        assert np.asarray(ref.cell_data[name]).tobytes() == np.asarray(same.cell_data[name]).tobytes()
    assert not np.array_equal(ref.cell_data["pMeanTrim"], diff.cell_data["pMeanTrim"])
    assert (raw[0][1] / "force_mom_4.csv").read_text() == (alone[0] / "force_mom_4.csv").read_text()
    assert (raw[0][1] / "geo_parameters_4.csv").read_text() != (other[0] / "geo_parameters_4.csv").read_text()
    assert {p.name for p in alone[0].iterdir()} == _files(4, 1)


@pytest.mark.parametrize("name", ["Backlight_Angle", "Vehicle_Ride_Height", "Vehicle_Length"])
def test_coefficients_smooth_in_parameters(name):
    params = S.sample_parameters(0, 5)
    lo, hi = S.PARAMETER_RANGES[name]
    step = 1e-3 * (hi - lo)
    cd = []
    for k in range(3):
        p = dict(params, **{name: params[name] + k * step})
        cd.append(S.simulate_surface(p, CELLS).forces["cd"])
    d1, d2 = cd[1] - cd[0], cd[2] - cd[1]
    assert abs(d1) < 1e-3 and abs(d2) < 1e-3  # a 0.1 % change of the range moves cd by < 1 count x 10
    assert abs(d2 - d1) <= 0.1 * max(abs(d1), 1e-7)  # nearly linear: no jumps at this scale


def test_lamb_coefficient_against_closed_forms():
    assert S.lamb_k(1.0, 1.0, 1.0) == pytest.approx(0.5, rel=1e-12)
    a, b = 2.0, 0.5  # prolate spheroid along x
    e = math.sqrt(1.0 - (b / a) ** 2)
    alpha0 = 2.0 * (1.0 - e * e) / e ** 3 * (0.5 * math.log((1.0 + e) / (1.0 - e)) - e)
    assert S.lamb_alpha0(a, b, b) == pytest.approx(alpha0, rel=1e-10)


def test_physics_sanity():
    cds = []
    for i in range(1, 9):
        case = S.simulate_surface(S.sample_parameters(0, i), CELLS)
        cp = case.fields["CpMeanTrim"].astype(np.float64)
        centres, normals, areas = S.triangle_geometry(case.points, case.tris)
        assert 0.9 <= cp.max() <= 1.0
        nose = centres[:, 0] < 0.1 * case.body.length
        assert cp[nose].max() == cp.max()  # stagnation at the front
        roof = (normals[:, 2] > 0.95) & (centres[:, 2] > case.body.height - 0.1)
        assert roof.sum() > 5 and np.average(cp[roof], weights=areas[roof]) < -0.05
        base = normals[:, 0] > 0.99
        assert (cp[base] < -0.05).all()  # separated base
        tau = case.fields["wallShearStressMeanTrim"].astype(np.float64)
        attached = (np.abs(normals[:, 2]) > 0.9) & (centres[:, 0] > 0.3 * case.body.length) & (
            centres[:, 0] < 0.6 * case.body.length)
        assert (tau[attached, 0] > 0).all()  # friction drags the body downstream where attached
        cds.append(case.forces["cd"])
        assert -0.3 < case.forces["cl"] < 0.4 and abs(case.forces["cs"]) < 1e-6
    assert 0.2 < min(cds) and max(cds) < 0.45 and np.std(cds) > 0.005


def test_volume_far_field_and_wake():
    case = S.simulate_surface(S.sample_parameters(0, 2), CELLS)
    body = case.body
    far = np.array([[-30.0, 0.0, 5.0], [body.length / 2, 20.0, 5.0]])
    f = S.volume_fields(body, case, far)
    np.testing.assert_allclose(f["UMeanTrim"], [[DRIVAERML.u_inf, 0, 0]] * 2, atol=0.05)
    assert np.abs(f["CpMeanTrim"]).max() < 0.01 and (f["nutMeanTrim"] < 1e-3).all()
    zc = body.profile(np.array([body.length]))[0][0]
    wake = S.volume_fields(body, case, np.array([[body.length + 0.3, 0.0, zc]]))
    assert wake["UMeanTrim"][0, 0] < 0.8 * DRIVAERML.u_inf and wake["CpMeanTrim"][0] < 0
    points, hexes = S.volume_grid(body, 3000)
    centres = points[hexes].mean(axis=1)
    assert not body.inside(centres).any() and points[:, 2].min() == 0.0


def test_reference_scales_pressure():
    params = S.sample_parameters(0, 1)
    slow = Reference(u_inf=30.0)
    a, b = S.simulate_surface(params, CELLS), S.simulate_surface(params, CELLS, slow)
    np.testing.assert_allclose(a.fields["CpMeanTrim"], b.fields["CpMeanTrim"], rtol=1e-6)
    np.testing.assert_allclose(b.fields["pMeanTrim"], b.fields["CpMeanTrim"] * slow.q_inf, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("kwargs", [dict(runs=0), dict(runs=1.5), dict(cells=100), dict(cells=True),
                                    dict(volume_pieces=-1), dict(volume_pieces=101), dict(volume_cells=10),
                                    dict(seed=-1), dict(first_run=-1), dict(reference="drivaerml")])
def test_bad_arguments_raise(tmp_path, kwargs):
    with pytest.raises(ValueError):
        synth_drivaerml(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def _volume_oracle(body, cells):
    """The in-memory construction the streamed grid replaces: the whole box, np.unique over all hexahedra."""
    grid = S.BoxGrid(body, cells)  # the fitted spacing (its count pass is checked below)
    lo, size, dims = grid.lo, grid.size, grid.dims
    nx, ny, nz = dims
    axes = [lo[d] + (np.arange(dims[d]) + 0.5) * size[d] / dims[d] for d in range(3)]
    keep = ~body.inside(np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3))
    assert keep.sum() == grid.n_cells
    i, j, k = np.unravel_index(np.flatnonzero(keep), (nx, ny, nz))
    pid = lambda a, b, c: (a * (ny + 1) + b) * (nz + 1) + c  # noqa: E731
    hexes = np.stack([pid(i, j, k), pid(i + 1, j, k), pid(i + 1, j + 1, k), pid(i, j + 1, k),
                      pid(i, j, k + 1), pid(i + 1, j, k + 1), pid(i + 1, j + 1, k + 1), pid(i, j + 1, k + 1)],
                     axis=1)
    used, inverse = np.unique(hexes, return_inverse=True)
    a, b, c = np.unravel_index(used, (nx + 1, ny + 1, nz + 1))
    return lo + np.stack([a, b, c], axis=1) * (size / dims), inverse.reshape(hexes.shape)


@pytest.mark.parametrize("cells,block", [(300, 1 << 18), (4000, 1 << 18), (4000, 300), (30000, 2000)])
def test_streamed_volume_equals_in_memory_grid(monkeypatch, cells, block):
    """Slab blocks of any size give the in-memory grid's points, hexahedra and centres bit for bit."""
    monkeypatch.setattr(S, "VOLUME_BLOCK_CELLS", block)
    body = S.Body(S.sample_parameters(2, 3))
    points, hexes = _volume_oracle(body, cells)
    blocks = list(S.BoxGrid(body, cells).blocks())
    assert len(blocks) > (1 if block < 1000 else 0)
    np.testing.assert_array_equal(np.concatenate([p for p, _, _ in blocks]), points)
    np.testing.assert_array_equal(np.concatenate([h for _, h, _ in blocks]), hexes)
    np.testing.assert_array_equal(np.concatenate([c for _, _, c in blocks]), points[hexes].mean(axis=1))


def test_streamed_volume_file_equals_vtk_written_grid(tmp_path, monkeypatch):
    """The streamed file reads back in VTK as the grid VTK's own writer would have written (same points,
    cells and float32 fields), whatever the block and field-chunk boundaries."""
    monkeypatch.setattr(S, "VOLUME_BLOCK_CELLS", 700)
    case = S.simulate_surface(S.sample_parameters(0, 1), CELLS)
    points, hexes = _volume_oracle(case.body, 9000)
    want = pv.UnstructuredGrid({pv.CellType.HEXAHEDRON: hexes}, points.astype(np.float32))
    for k, v in S.volume_fields(case.body, case, points[hexes].mean(axis=1)).items():
        want.cell_data[k] = v.astype(np.float32)
    S._write_volume(tmp_path / "v.vtu", case, 9000, 1, DRIVAERML)
    got = pv.read(tmp_path / "v.vtu")
    np.testing.assert_array_equal(got.points, want.points)
    np.testing.assert_array_equal(got.cell_connectivity, want.cell_connectivity)
    np.testing.assert_array_equal(got.celltypes, want.celltypes)
    assert sorted(got.cell_data) == sorted(want.cell_data)
    for k in want.cell_data:
        np.testing.assert_array_equal(got.cell_data[k], want.cell_data[k], err_msg=k)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.vtu"]  # no scratch left behind


@pytest.mark.parametrize("block", [1 << 18, 500, 97])
def test_streamed_surface_files_hold_the_in_memory_surface(tmp_path, monkeypatch, block):
    """The surface written block by block (.vtp and binary .stl) reads back in VTK as the in-memory surface:
    the same points, triangles and float32 fields, whatever the block; forces to summation rounding."""
    ref = S.simulate_surface(S.sample_parameters(0, 3), 6000)
    monkeypatch.setattr(S, "SURFACE_BLOCK_CELLS", block)
    case = S.write_surface(tmp_path, 3, S.Body(S.sample_parameters(0, 3)), 6000, DRIVAERML)
    mesh = pv.read(tmp_path / "boundary_3.vtp")
    assert mesh.n_cells == len(ref.tris) and mesh.n_points == len(ref.points)
    np.testing.assert_array_equal(mesh.points, ref.points)
    np.testing.assert_array_equal(mesh.faces.reshape(-1, 4)[:, 1:], ref.tris)
    for k, v in ref.fields.items():
        np.testing.assert_array_equal(mesh.cell_data[k], v, err_msg=k)
    stl = pv.read(tmp_path / "drivaer_3.stl")
    np.testing.assert_array_equal(stl.points[stl.faces.reshape(-1, 4)[:, 1:]], ref.points[ref.tris])
    for k, v in ref.forces.items():
        assert case.forces[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["boundary_3.vtp", "drivaer_3.stl"]


def test_a_killed_synths_scratch_is_removed_by_the_next(tmp_path):
    """.tmp-<pid>-* files of a synth that no longer runs go when the run is written again."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "run_1"
    folder.mkdir()
    stale = folder / f".tmp-{int(dead.stdout)}-volume_1.vtu.0.blob"
    stale.write_bytes(b"x")
    synth_drivaerml(tmp_path, runs=1, cells=300, volume_cells=300)
    assert not stale.exists() and not list(folder.glob(".tmp-*"))
