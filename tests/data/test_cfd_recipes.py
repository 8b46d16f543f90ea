"""CFD recipes beyond DrivaerML (``ingest cfd --recipe``): the same synthetic runs re-written by VTK (pyvista)
in the AhmedML, WindsorML and an OpenFOAM-style recipe of one's own (other file and array names, a surface
given as a .vtu of polygons, point data, scalar components, absolute pressure, runs from 0, a missing optional
CSV) ingest into the stores the DrivaerML recipe gives after their own non-dimensionalisation; point data is
averaged to cells exactly as VTK's vtkPointDataToCellData does (the streaming reader against the VTK oracle);
recipe mistakes are one line naming the key; the names before the rename (``--layout``, ``--show-layout``, a
store's ``layout`` attrs) still work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

from cli_runner import run_cli  # noqa: E402
from domainflow.preprocess.cfd_recipe import load_recipe  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_cfd  # noqa: E402
from domainflow.preprocess.reference import DRIVAERML  # noqa: E402

U, L = DRIVAERML.u_inf, DRIVAERML.l_ref
Q = 0.5 * U * U


@pytest.fixture(scope="module")
def drivaer(tmp_path_factory):
    """Three synthetic DrivaerML runs (0, 1, 2) and their store."""
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("recipes")
    synth_drivaerml(root / "raw", runs=3, cells=500, seed=4, volume_cells=300, volume_pieces=1, first_run=0)
    ingest_cfd(root / "raw", root / "drivaer.zarr", MeshOptions(parts=4, progress=False, split=(0.67, 0.33, 0.0)))
    return root


def _mesh(run_dir: Path, name: str):
    return pv.read(str(run_dir / name))


def _copy_csvs(src: Path, dst: Path, i: int, names: dict):
    for old, new in names.items():
        shutil.copy(src / old.format(i=i), dst / new.format(i=i))


def _ahmedml(drivaer: Path) -> Path:
    """AhmedML names: pMean (kinematic, U = 1 m/s), wallShearStressMean, UMean, nutMean, CELL data; the
    constant-reference forces in force_mom_<i>.csv; run 2 lacks its geo_parameters (as AhmedML's run 500)."""
    raw = drivaer / "ahmed"
    for i in range(3):
        src, dst = drivaer / "raw" / f"run_{i}", raw / f"run_{i}"
        dst.mkdir(parents=True)
        s = _mesh(src, f"boundary_{i}.vtp")
        out = pv.PolyData(s.points, faces=s.faces)
        out.cell_data["pMean"] = s.cell_data["pMeanTrim"] / Q * 0.5
        out.cell_data["wallShearStressMean"] = s.cell_data["wallShearStressMeanTrim"] / Q * 0.5
        out.cell_data["static(p)_coeffMean"] = s.cell_data["CpMeanTrim"]
        out.save(str(dst / f"boundary_{i}.vtp"))
        v = _mesh(src, f"volume_{i}.vtu")
        vol = pv.UnstructuredGrid(v.cells, v.celltypes, v.points)
        vol.cell_data["UMean"] = v.cell_data["UMeanTrim"] / U
        vol.cell_data["pMean"] = v.cell_data["pMeanTrim"] / Q * 0.5
        vol.cell_data["nutMean"] = v.cell_data["nutMeanTrim"] / (U * L) * 1.044
        vol.save(str(dst / f"volume_{i}.vtu"))
        _copy_csvs(src, dst, i, {"force_mom_constref_{i}.csv": "force_mom_{i}.csv",
                                 "force_mom_{i}.csv": "force_mom_varref_{i}.csv"})
        if i != 2:
            _copy_csvs(src, dst, i, {"geo_parameters_{i}.csv": "geo_parameters_{i}.csv"})
    return raw


def _windsorml(drivaer: Path) -> Path:
    """WindsorML: the surface a .vtu of polygons with POINT data cpavg and cfxavg/cfyavg/cfzavg (VTK's own
    cell-to-point averaging), the volume CELL data velocity{x,y,z}avg and absolute pressureavg."""
    raw = drivaer / "windsor"
    rho, u, p0 = 1.31, 40.0, 37330.4
    for i in range(3):
        src, dst = drivaer / "raw" / f"run_{i}", raw / f"run_{i}"
        dst.mkdir(parents=True)
        s = _mesh(src, f"boundary_{i}.vtp")
        cells = pv.PolyData(s.points, faces=s.faces)
        cells.cell_data["cpavg"] = s.cell_data["CpMeanTrim"]
        cf = s.cell_data["wallShearStressMeanTrim"] / Q
        for k, axis in enumerate("xyz"):
            cells.cell_data[f"cf{axis}avg"] = cf[:, k].copy()
        points = cells.cell_data_to_point_data(pass_cell_data=False).cast_to_unstructured_grid()
        points.save(str(dst / f"boundary_{i}.vtu"))
        v = _mesh(src, f"volume_{i}.vtu")
        vol = pv.UnstructuredGrid(v.cells, v.celltypes, v.points)
        for k, axis in enumerate("xyz"):
            vol.cell_data[f"velocity{axis}avg"] = v.cell_data["UMeanTrim"][:, k] / U * u
        vol.cell_data["pressureavg"] = p0 + v.cell_data["pMeanTrim"] / Q * (0.5 * rho * u * u)
        vol.save(str(dst / f"volume_{i}.vtu"))
        _copy_csvs(src, dst, i, {"force_mom_constref_{i}.csv": "force_mom_{i}.csv",
                                 "force_mom_{i}.csv": "force_mom_varref_{i}.csv",
                                 "geo_parameters_{i}.csv": "geo_parameters_{i}.csv"})
    return raw


def _fields(store: Path, run: str, loc: str) -> dict:
    g = zarr.open_group(str(store), mode="r")[f"runs/{run}/{loc}"]
    out = {"coords": g["coords"][...]}
    out.update({k: g["fields"][k][...] for k in g["fields"].array_keys()})
    return out


def test_ahmedml_recipe_gives_the_drivaerml_store(drivaer, tmp_path):
    raw = _ahmedml(drivaer)
    report = ingest_cfd(raw, tmp_path / "ahmed.zarr", MeshOptions(recipe="ahmedml", parts=4, progress=False,
                                                                  split=(0.67, 0.33, 0.0)))
    assert not report.warnings, report.warnings  # our Cp agrees with the file's static(p)_coeffMean
    root = zarr.open_group(str(tmp_path / "ahmed.zarr"), mode="r")
    assert root.attrs["recipe"] == "ahmedml" and root.attrs["reference"]["U_inf"] == 1.0
    assert root.attrs["fields"]["surface/Cp"]["source"] == "pMean"
    run2 = root["runs/run_2"].attrs
    assert "geometry" not in run2 and "cd" in run2["forces_constref"]  # the optional CSV it lacks
    # run 2's missing design parameters: training with them is refused by name, before any rank starts
    r = run_cli("train", "--out", tmp_path / "t", f"data.store={tmp_path / 'ahmed.zarr'}")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "run(s) ['run_2'] have other design parameters" in lines[0] \
        and "data.use_params=false" in lines[0], r.stderr
    for run in ("run_0", "run_1", "run_2"):
        for loc in ("surface", "volume"):
            want, got = _fields(drivaer / "drivaer.zarr", run, loc), _fields(tmp_path / "ahmed.zarr", run, loc)
            assert set(got) == {"coords", "Cp", "Cf"} if loc == "surface" else {"coords", "U", "Cp", "nut"}
            for k in got:
                np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=f"{run} {loc} {k}")


@pytest.mark.parametrize("reader", ["stream", "vtk"])
def test_windsorml_point_data_on_a_vtu_surface(drivaer, tmp_path, reader):
    raw = drivaer / "windsor"
    if not raw.exists():
        _windsorml(drivaer)
    store = tmp_path / f"windsor-{reader}.zarr"
    ingest_cfd(raw, store, MeshOptions(recipe="windsorml", parts=4, progress=False, split=(0.67, 0.33, 0.0),
                                       reader=reader))
    root = zarr.open_group(str(store), mode="r")
    assert root.attrs["fields"]["surface/Cf"]["association"] == "point"
    assert root.attrs["forces"] == {"drag_axis": 0, "lift_axis": 1, "reference_area": 0.112}  # +y is up
    assert root.attrs["fields"]["surface/Cf"]["source"] == "cfxavg+cfyavg+cfzavg"
    for run in ("run_0", "run_1", "run_2"):
        want, got = _fields(drivaer / "drivaer.zarr", run, "volume"), _fields(store, run, "volume")
        for k in ("coords", "U", "Cp"):  # absolute pressure and other units: the same dimensionless fields
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=f"{run} volume {k}")
        want, got = _fields(drivaer / "drivaer.zarr", run, "surface"), _fields(store, run, "surface")
        np.testing.assert_allclose(got["coords"], want["coords"], rtol=1e-6, atol=1e-6)  # the same cells, in order
        # point data averaged back to the cells: each cell's vertex mean of VTK's point values
        surface = pv.read(str(raw / run / f"boundary_{run[4:]}.vtu"))
        means = surface.point_data_to_cell_data(pass_point_data=False)
        order = zarr.open_group(str(store), mode="r")[f"runs/{run}/surface/order"][...]
        np.testing.assert_allclose(got["Cp"][:, 0], np.asarray(means.cell_data["cpavg"])[order], rtol=1e-5, atol=1e-6)
        cf = np.column_stack([means.cell_data[f"cf{a}avg"] for a in "xyz"])[order]
        np.testing.assert_allclose(got["Cf"], cf, rtol=1e-5, atol=1e-6)
        assert np.corrcoef(got["Cp"][:, 0], want["Cp"][:, 0])[0, 1] > 0.9  # smoothed, still the same field


OWN_RECIPE = """
name: openfoam-cases
runs: case{i}
files: {surface: "wall_{i}.vtp"}
csv: {geometry: "params_{i}.csv"}
data: point
reference: {u_inf: 38.889}
fields:
  surface:
    - {name: Cp, source: p, quantity: pressure}
    - {name: Cf, source: wallShearStress, components: 3, quantity: shear}
forces: {drag: z, lift: x, reference_area: 0.5}
"""


def _own(drivaer: Path) -> Path:
    """OpenFOAM's own names (p, wallShearStress) as point data, folders case<i>, one CSV."""
    raw = drivaer / "own"
    if raw.exists():  # made by an earlier test of this module
        return raw
    for i in range(3):
        src, dst = drivaer / "raw" / f"run_{i}", raw / f"case{i}"
        dst.mkdir(parents=True)
        s = _mesh(src, f"boundary_{i}.vtp")
        cells = pv.PolyData(s.points, faces=s.faces)
        cells.cell_data["p"] = s.cell_data["pMeanTrim"]
        cells.cell_data["wallShearStress"] = s.cell_data["wallShearStressMeanTrim"]
        cells.cell_data_to_point_data(pass_cell_data=False).save(str(dst / f"wall_{i}.vtp"))
        _copy_csvs(src, dst, i, {"geo_parameters_{i}.csv": "params_{i}.csv"})
    (drivaer / "own.yaml").write_text(OWN_RECIPE)
    return raw


def _cli(*args):
    return run_cli(*args, env={"OMP_NUM_THREADS": "1"})


def test_a_recipe_file_of_ones_own_through_the_cli_and_training(drivaer, tmp_path):
    raw = _own(drivaer)
    r = run_cli("ingest", "cfd", raw, tmp_path / "own.zarr", "--recipe", drivaer / "own.yaml", "--parts", "4",
                "--split", "0.67,0.33,0", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    root = zarr.open_group(str(tmp_path / "own.zarr"), mode="r")
    assert sorted(root["runs"].group_keys()) == ["run_0", "run_1", "run_2"]
    assert root["runs/run_1"].attrs["folder"] == "case1" and root.attrs["recipe"] == "openfoam-cases"
    surface = pv.read(str(raw / "case1" / "wall_1.vtp")).point_data_to_cell_data(pass_point_data=False)
    order = root["runs/run_1/surface/order"][...]
    np.testing.assert_allclose(root["runs/run_1/surface/fields/Cp"][...][:, 0],
                               np.asarray(surface.cell_data["p"])[order] / Q, rtol=1e-5, atol=1e-6)
    r = _cli("train", "--out", tmp_path / "train", f"data.store={tmp_path / 'own.zarr'}", "train.steps=1",
             "model.dim=8", "model.layers=1", "model.heads=2", "model.slices=4", "output.plots=false",
             "output.progress=false", "data.prefetch=0", "--domain", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    # the force coefficients integrate along the recipe's axes over its area (here drag z, lift x, 0.5 m^2)
    assert root.attrs["forces"] == {"drag_axis": 2, "lift_axis": 0, "reference_area": 0.5}
    row = json.loads((tmp_path / "train" / "result.json").read_text())["eval"]["runs"][0]
    g = root[f"runs/{row['run']}/surface"]
    cp, cf = g["fields/Cp"][...][:, :1].astype(np.float64), g["fields/Cf"][...].astype(np.float64)
    force = ((-cp * g["normals"][...] + cf) * g["areas"][...][:, None]).sum(0) / 0.5
    assert abs(force[0]) > 0.1 and abs(force[2]) > 0.1 and abs(force[0] - force[2]) > 0.1
    assert row["model"]["cd_true"] == pytest.approx(force[2], rel=1e-4)
    assert row["model"]["cl_true"] == pytest.approx(force[0], rel=1e-4)
    # predict finds the raw surface through the recipe (case1/wall_1.vtp) and writes onto its polygons
    r = _cli("predict", tmp_path / "train" / "checkpoints", tmp_path / "own.zarr", tmp_path / "p.vtp", "--run", "run_1",
             "--domain", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    out, raw_surface = pv.read(str(tmp_path / "p.vtp")), pv.read(str(raw / "case1" / "wall_1.vtp"))
    assert out.n_cells == raw_surface.n_cells and out.n_verts == 0 and "Cp_pred" in out.cell_data
    np.testing.assert_array_equal(out.faces, raw_surface.faces)
    # a reference value given on the command line replaces the recipe's
    r = run_cli("ingest", "cfd", raw, tmp_path / "own2.zarr", "--recipe", drivaer / "own.yaml", "--parts", "4",
                "--split", "0.67,0.33,0", "--quiet", "--u-inf", str(2 * U))
    assert r.returncode == 0, r.stderr[-3000:]
    cp2 = zarr.open_group(str(tmp_path / "own2.zarr"), mode="r")["runs/run_1/surface/fields/Cp"][...]
    np.testing.assert_allclose(cp2 * 4, root["runs/run_1/surface/fields/Cp"][...], rtol=1e-5, atol=1e-6)


def test_fields_stored_as_read_keep_their_values_and_units(drivaer, tmp_path):
    """``quantity: as_read`` stores a dimensional field unchanged and records the units the recipe gives (a
    pressure in m2/s2, a temperature in K), where only ``coefficient`` kept values, labelled dimensionless."""
    raw = _own(drivaer)
    recipe = tmp_path / "as_read.yaml"
    recipe.write_text(OWN_RECIPE.replace(
        "    - {name: Cf, source: wallShearStress, components: 3, quantity: shear}",
        "    - {name: Cf, source: wallShearStress, components: 3, quantity: shear}\n"
        "    - {name: p, source: p, quantity: as_read, units: m2/s2}\n"
        "    - {name: tau, source: wallShearStress, components: 3, quantity: as_read, units: m2/s2}"))
    ingest_cfd(raw, tmp_path / "s.zarr", MeshOptions(recipe=recipe, parts=4, progress=False, split=(0.67, 0.33, 0.0)))
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    attrs = root.attrs["fields"]
    assert attrs["surface/p"]["units"] == "m2/s2" and attrs["surface/p"]["quantity"] == "as_read"
    assert attrs["surface/p"]["scale"] == 1.0 and attrs["surface/p"]["offset"] == 0.0
    assert attrs["surface/Cp"]["units"] == "1"
    surface = pv.read(str(raw / "case1" / "wall_1.vtp")).point_data_to_cell_data(pass_point_data=False)
    g = root["runs/run_1/surface"]
    order = g["order"][...]
    np.testing.assert_array_equal(g["fields/p"][...][:, 0], np.asarray(surface.cell_data["p"], np.float32)[order])
    np.testing.assert_array_equal(g["fields/tau"][...],
                                  np.asarray(surface.cell_data["wallShearStress"], np.float32)[order])


def test_zero_padded_run_folders_keep_their_digits_in_file_names(drivaer, tmp_path):
    """run_007/boundary_007.vtp: the store calls it run_7, the files are found by the folder's own digits."""
    raw = tmp_path / "padded"
    for i in range(3):
        src, dst = drivaer / "raw" / f"run_{i}", raw / f"run_{i:03d}"
        dst.mkdir(parents=True)
        for f in src.iterdir():
            shutil.copy(f, dst / f.name.replace(f"_{i}.", f"_{i:03d}."))
    ingest_cfd(raw, tmp_path / "p.zarr", MeshOptions(parts=4, locations=("surface",), progress=False,
                                                    split=(0.67, 0.33, 0.0)))
    root = zarr.open_group(str(tmp_path / "p.zarr"), mode="r")
    assert sorted(root["runs"].group_keys()) == ["run_0", "run_1", "run_2"]
    assert root["runs/run_1"].attrs["folder"] == "run_001"
    np.testing.assert_array_equal(_fields(tmp_path / "p.zarr", "run_1", "surface")["Cp"],
                                  _fields(drivaer / "drivaer.zarr", "run_1", "surface")["Cp"])


@pytest.mark.parametrize("text,message", [
    ("runs: run_{i}\nfiles: {surface: '../b.vtp'}\nfields: {surface: []}", "must be a path inside the run folder"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}_{i}.vtp'}\nfields: {surface: []}", "at most once"),
    ("runs: 'runs/{i}'\nfiles: {surface: 'b_{i}.vtp'}\nfields: {surface: []}", "or be a glob of folder names"),
    ("runs: run_{i}\nfiles: {volume: 'VTK/case_{i}.vtm'}\nfields: {volume: []}", "is a .vtm multi-block index; name"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nfields: {surface: [{name: Cp, source: p, quantity: pressur}]}",
     "quantity 'pressur' is not one of"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp', volume: 'v_{i}.vtu'}\nfields: {volume: [{name: U, source: U, "
     "quantity: velocity}]}", "fields.surface is missing"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nfeilds: {}", r"unknown key\(s\) \['feilds'\]"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nfields: {surface: [{name: Cp, source: p, quantity: pressure}], "
     "volume: [{name: U, source: U, quantity: velocity}]}", r"fields names \['volume'\], which the recipe's files"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\ndata: {surfaces: point}\nfields: {surface: [{name: Cp, "
     "source: p, quantity: pressure}]}", r"data names \['surfaces'\]"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}_{case}.vtp'}\nfields: {surface: []}", "no other {...} field"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\ncsv: {fingerprint: 'f_{i}.csv'}\nfields: {surface: []}",
     r"csv key\(s\) \['fingerprint'\] are names a run's attrs already use"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nfields: {surface: [{name: Cf, source: t, components: three, "
     "quantity: shear}]}", "components must be a whole number"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nforces: {lift: up}\nfields: {surface: [{name: Cp, source: p, "
     "quantity: pressure}]}",
     "forces.lift must be x, y or z"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\ndata: points\nfields: {surface: [{name: Cp, source: p, quantity: "
     "pressure}]}", "data.surface='points' is not one of"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nfields: {surface: [{name: T, source: T, quantity: as_read}]}",
     "field 'T' is stored as read: give its units"),
    ("runs: run_{i}\nfiles: {surface: 'b_{i}.vtp'}\nfields: {surface: [{name: Cp, source: p, quantity: pressure, "
     "units: Pa}]}", "quantity 'pressure' is made dimensionless .*use quantity: as_read"),
])
def test_recipe_mistakes_are_named(tmp_path, text, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(IngestError, match=message):
        load_recipe(path)


def test_arrays_of_the_wrong_kind_are_named_before_anything_is_written(drivaer, tmp_path):
    """The AhmedML files read with the WindsorML recipe: missing arrays named, cell/point hint given, as the
    run's one-line error, for both readers; an unknown recipe name is one line through the CLI."""
    raw = drivaer / "ahmed" if (drivaer / "ahmed").exists() else _ahmedml(drivaer)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("runs: run_{i}\nfiles: {surface: 'boundary_{i}.vtp'}\ndata: point\n"
                     "fields: {surface: [{name: Cp, source: pMean, quantity: pressure}]}\n")
    for reader in ("stream", "vtk"):
        with pytest.raises(IngestError, match=r"boundary_0\.vtp: missing point array\(s\) \['pMean'\] \(\['pMean'\] "
                                              r"exist as CELL data"):
            ingest_cfd(raw, tmp_path / f"w-{reader}.zarr", MeshOptions(recipe=wrong, parts=4, progress=False,
                                                                      reader=reader))
    r = run_cli("ingest", "cfd", raw, tmp_path / "x.zarr", "--recipe", "starccm")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "neither a built-in recipe" in lines[0], r.stderr


def test_the_names_before_the_rename_still_work_on_the_command_line(drivaer):
    """``--layout`` and ``--show-layout`` (the names before issue 36) are hidden aliases of ``--recipe`` and
    ``--show-recipe``: the same destination, not in the help."""
    shown = run_cli("ingest", "cfd", "--show-recipe", "ahmedml")
    old = run_cli("ingest", "cfd", "--show-layout", "ahmedml")
    assert shown.returncode == old.returncode == 0 and "runs: run_{i}" in shown.stdout and old.stdout == shown.stdout
    r = run_cli("ingest", "cfd", drivaer / "raw", drivaer / "x.zarr", "--layout", "starccm")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "--recipe starccm: neither a built-in recipe" in lines[0], r.stderr
    r = run_cli("ingest", "cfd", drivaer / "raw", drivaer / "x.zarr", "--layout", "drivaerml", "--recipe", "starccm")
    assert r.returncode != 0 and "--recipe starccm" in r.stderr  # one destination: the last one given wins
    usage = run_cli("ingest", "cfd", "--help").stdout
    assert "--recipe" in usage and "--show-recipe" in usage and "layout" not in usage


def test_stores_written_before_the_rename_still_resume_and_predict(drivaer, tmp_path):
    """A store an older domainflow wrote records its recipe as ``layout`` (in its ingest config and its root
    attrs): ingest still finds it complete (the same options), predict still finds its raw surface."""
    from domainflow.readers.store import open_store
    from domainflow.train.predict import raw_surface_path

    raw = drivaer / "ahmed" if (drivaer / "ahmed").exists() else _ahmedml(drivaer)
    store = tmp_path / "old.zarr"
    opts = dict(recipe="ahmedml", parts=4, progress=False, split=(0.67, 0.33, 0.0), locations=("surface",))
    ingest_cfd(raw, store, MeshOptions(**opts))
    root = zarr.open_group(str(store), mode="r+")
    config = dict(root.attrs["ingest"]["config"])
    assert config["recipe"]["name"] == "ahmedml" and root.attrs["recipe"] == "ahmedml"
    config["layout"] = config.pop("recipe")  # as written before the rename
    root.attrs["ingest"] = {**root.attrs["ingest"], "config": config}
    root.attrs["layout"] = root.attrs.pop("recipe")
    assert ingest_cfd(raw, store, MeshOptions(**opts)).state == "complete"
    assert raw_surface_path(open_store(store), "run_1") == raw / "run_1" / "boundary_1.vtp"
    with pytest.raises(IngestError, match="different options"):  # still compared: another recipe is refused
        ingest_cfd(raw, store, MeshOptions(**{**opts, "recipe": "windsorml"}))
