"""``domainflow ingest drivaerml``: synth -> ingest -> read back, parallel = serial, resume, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

import tempfile

from domainflow.preprocess import (
    ingest_grid,
    ingest_mesh,  # noqa: E402
)
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402
from domainflow.preprocess.cfd_recipe import load_recipe  # noqa: E402
from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml  # noqa: E402
from domainflow.preprocess.inspect_store import describe  # noqa: E402
from domainflow.preprocess.reference import DRIVAERML, Reference  # noqa: E402
from domainflow.preprocess.store_writer import StoreWriter  # noqa: E402
from domainflow.preprocess.synth_drivaerml import synth_drivaerml  # noqa: E402
from domainflow.vtk.pyvista_io import read_cells  # noqa: E402
from store_compare import assert_same_store  # noqa: E402
from test_ingest_grid import _grid_source  # noqa: E402  (one writer of small climate sources)

from domainflow.app.cli import main as cli  # noqa: E402

PARTS = 8
OPTS = dict(parts=PARTS, progress=False, split=(0.5, 0.25, 0.25))


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("raw")
    synth_drivaerml(out, runs=4, cells=2500, seed=3, volume_cells=1500, volume_pieces=2)
    return out


@pytest.fixture(scope="module")
def store(raw, tmp_path_factory):
    path = tmp_path_factory.mktemp("stores") / "serial.zarr"
    report = ingest_drivaerml(raw, path, workers=1, **OPTS)
    assert report.state == "new" and len(report.written) == 4
    return path


def _copy_raw(raw, tmp_path) -> Path:
    dst = tmp_path / "raw"
    shutil.copytree(raw, dst)
    return dst


def _read_full(path: Path):
    """The whole file read with pyvista directly (the reference the store must match)."""
    if not path.exists():
        pieces = sorted(path.parent.glob(path.name + ".*.part"))
        joined = path.parent / ("joined_" + path.name)
        joined.write_bytes(b"".join(p.read_bytes() for p in pieces))
        mesh = pv.read(joined)
        joined.unlink()
        return mesh
    return pv.read(path)


# -- round trip -------------------------------------------------------------------------------------
def test_every_cell_present_once_and_values_round_trip(raw, store):
    root = zarr.open_group(store, mode="r")
    ref = Reference(**{k: v for k, v in zip(("u_inf", "rho_inf", "p_inf", "l_ref"),
                                             (DRIVAERML.u_inf, DRIVAERML.rho_inf, DRIVAERML.p_inf, DRIVAERML.l_ref))})
    for run in sorted(root["runs"].group_keys()):
        i = run[4:]
        run_dir = raw / run
        for loc, fname in (("surface", f"boundary_{i}.vtp"), ("volume", f"volume_{i}.vtu")):
            mesh = _read_full(run_dir / fname)
            g = root["runs"][run][loc]
            order = np.asarray(g["order"][...])
            n = mesh.n_cells
            assert sorted(order.tolist()) == list(range(n)), f"{run}/{loc}: not every cell exactly once"
            inv = np.argsort(order)
            centres = np.asarray(mesh.cell_centers().points)
            np.testing.assert_allclose(np.asarray(g["coords"][...])[inv], centres, rtol=0, atol=1e-5)
            for spec in load_recipe("drivaerml").fields[loc]:
                scale, offset = spec.scale_offset(ref)
                stored = np.asarray(g["fields"][spec.name][...], dtype=np.float64)[inv]
                raw_vals = np.asarray(mesh.cell_data[spec.source], dtype=np.float64).reshape(n, -1)
                np.testing.assert_allclose(stored * scale + offset, raw_vals, rtol=2e-6,
                                           atol=2e-6 * np.abs(raw_vals).max())
                assert g["fields"][spec.name].dtype == np.float32
            if loc == "surface":
                areas = np.asarray(g["areas"][...])[inv]
                np.testing.assert_allclose(areas, mesh.compute_cell_sizes()["Area"], rtol=1e-5)
                normals = np.asarray(g["normals"][...])[inv]
                np.testing.assert_allclose(np.linalg.norm(normals, axis=1), 1, atol=1e-5)


def test_run_attrs_hold_reference_forces_and_geometry(raw, store):
    root = zarr.open_group(store, mode="r")
    a = dict(root["runs"]["run_2"].attrs)
    assert a["U_inf"] == DRIVAERML.u_inf and a["rho_inf"] == 1.0 and a["complete"] is True
    header = (raw / "run_2" / "force_mom_2.csv").read_text().splitlines()[0].split(",")
    assert set(h.strip() for h in header) == set(a["forces"])
    assert "cd" in a["forces"] and "cl" in a["forces"] and a["geometry"]
    fields = dict(root.attrs["fields"])
    assert fields["surface/Cp"]["source"] == "pMeanTrim" and fields["surface/Cf"]["components"] == 3
    head = dict(root.attrs["domainflow"])
    assert head == {**head, "format": 2, "kind": "mesh", "complete": True, "parts": PARTS}


def test_forces_integrated_from_stored_fields_match_the_csv(store):
    """Cp, Cf, normals and areas in the store integrate to the drag the run's CSV reports."""
    root = zarr.open_group(store, mode="r")
    for run in root["runs"].group_keys():
        g = root["runs"][run]["surface"]
        cp, cf = np.asarray(g["fields/Cp"][...], float)[:, 0], np.asarray(g["fields/Cf"][...], float)
        n, area = np.asarray(g["normals"][...], float), np.asarray(g["areas"][...], float)
        force = ((-cp[:, None] * n + cf) * area[:, None]).sum(axis=0)  # in units of q_inf
        attrs = dict(root["runs"][run].attrs)
        a_ref = _reference_area(attrs)
        np.testing.assert_allclose(force[0] / a_ref, attrs["forces"]["cd"], rtol=2e-3)


def _reference_area(attrs) -> float:
    """The CSV's drag divided back out: constref and per-run files must agree on the force."""
    f, fc = attrs["forces"], attrs["forces_constref"]
    assert f["cd"] != 0
    for key in ("A_ref", "a_ref", "area_ref", "Aref", "frontal_area"):
        for d in (f, fc):
            if key in d:
                return d[key] * (fc["cd"] / f["cd"] if d is fc else 1.0)
    from domainflow.preprocess import synth_drivaerml as s

    return s.A_REF_CONST * fc["cd"] / f["cd"]


def test_parts_are_contiguous_and_boxes_contain_their_points(store):
    root = zarr.open_group(store, mode="r")
    for run in root["runs"].group_keys():
        for loc in ("surface", "volume"):
            g = root["runs"][run][loc]
            parts, boxes = np.asarray(g["parts"][...]), np.asarray(g["part_boxes"][...])
            coords = np.asarray(g["coords"][...])
            assert parts[0] == 0 and parts[-1] == len(coords) and (np.diff(parts) >= 0).all()
            assert len(parts) == PARTS + 1 and boxes.shape == (PARTS, 2, 3)
            assert np.diff(parts).max() - np.diff(parts).min() <= 1
            for k in range(PARTS):
                rows = coords[parts[k]:parts[k + 1]]
                assert (rows >= boxes[k, 0]).all() and (rows <= boxes[k, 1]).all()
            # spatially compact: bisection boxes do not overlap, so they add up to at most the run's box
            # (rows in file order would give P boxes each nearly as large as the whole)
            vol = lambda b: np.prod(np.maximum(b[1] - b[0], 1e-9))  # noqa: E731
            whole = vol(np.stack([coords.min(0), coords.max(0)]))
            assert sum(vol(b) for b in boxes) <= whole * (1 + 1e-5)


def test_stats_equal_numpy_over_the_train_split(store):
    root = zarr.open_group(store, mode="r")
    splits, stats = dict(root.attrs["splits"]), dict(root.attrs["stats"])
    assert sorted(sum(splits.values(), [])) == sorted(root["runs"].group_keys())
    assert len(splits["train"]) == 2 and len(splits["val"]) == 1 and len(splits["test"]) == 1
    for key in ("surface/Cp", "surface/Cf", "surface/coords", "surface/areas", "volume/U", "volume/nut"):
        loc, name = key.split("/")
        arrays = [np.asarray(root["runs"][r][loc][name if name in ("coords", "areas", "normals") else
                                                   f"fields/{name}"][...], np.float64) for r in splits["train"]]
        x = np.concatenate([a.reshape(len(a), -1) for a in arrays])
        s = stats[key]
        assert s["count"] == len(x)
        np.testing.assert_allclose(s["mean"], x.mean(0), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(s["std"], x.std(0), rtol=1e-7, atol=1e-12)
        np.testing.assert_array_equal(s["min"], x.min(0))
        np.testing.assert_array_equal(s["max"], x.max(0))
    # val/test runs are left out: the stats over all runs differ from the stored ones
    every = np.concatenate([np.asarray(root["runs"][r]["surface/fields/Cp"][...], np.float64)
                            for r in root["runs"].group_keys()])
    assert every.size > stats["surface/Cp"]["count"] and abs(every.mean() - stats["surface/Cp"]["mean"][0]) > 1e-9


def test_two_workers_give_the_identical_store(raw, store, tmp_path):
    path = tmp_path / "parallel.zarr"
    report = ingest_drivaerml(raw, path, workers=2, **OPTS)
    assert len(report.written) == 4 and all(t["peak_rss"] > 0 for t in report.tasks)
    assert_same_store(store, path)


def test_distributed_scheduler_gives_the_identical_store(raw, store, tmp_path):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        ingest_drivaerml(raw, tmp_path / "cluster.zarr", scheduler=c.scheduler_address, **OPTS)
    assert_same_store(store, tmp_path / "cluster.zarr")


def test_rerun_on_a_complete_store_is_a_no_op(raw, tmp_path):
    path = tmp_path / "s.zarr"
    ingest_drivaerml(raw, path, **OPTS)
    stamp = (path / "zarr.json").stat().st_mtime_ns
    report = ingest_drivaerml(raw, path, **OPTS)
    assert report.state == "complete" and report.written == []
    assert (path / "zarr.json").stat().st_mtime_ns == stamp
    report = ingest_drivaerml(raw, path, overwrite=True, **OPTS)
    assert report.state == "new" and len(report.written) == 4


def test_resume_after_an_interrupted_ingest_gives_the_same_store(raw, store, tmp_path, monkeypatch):
    """Interrupt the third run half-way through writing it (as a kill would), then rerun."""
    path = tmp_path / "resumed.zarr"
    real = ingest_mesh.partition_location
    calls = []

    def dying(*a, **k):  # partition_location(scans, loc, ...): once per location of a run
        calls.append(a[1])
        if len(calls) == 5:  # run_3's first location: written into scratch, then the process "dies"
            real(*a, **k)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ingest_mesh, "partition_location", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest_drivaerml(raw, path, **OPTS)
    monkeypatch.setattr(ingest_mesh, "partition_location", real)
    root = zarr.open_group(path, mode="r")
    assert root.attrs["domainflow"]["complete"] is False
    assert sorted(root["runs"].group_keys()) == ["run_1", "run_2"]
    assert any((path.parent / "resumed.zarr.ingest-tmp" / "runs").iterdir())  # the half-written run
    report = ingest_drivaerml(raw, path, **OPTS)
    assert report.state == "resume" and report.kept == ["run_1", "run_2"] and report.written == ["run_3", "run_4"]
    assert not (path.parent / "resumed.zarr.ingest-tmp").exists()
    assert_same_store(store, path)


def test_resume_redoes_a_published_run_whose_raw_files_changed(raw, tmp_path, monkeypatch):
    """Interrupted after two runs; run_1's surface is then re-exported with other values. The resume must
    not keep the stale run_1."""
    src = _copy_raw(raw, tmp_path)
    path = tmp_path / "changed.zarr"
    real, calls = ingest_mesh.partition_location, []

    def dying(*a, **k):
        calls.append(a[1])
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ingest_mesh, "partition_location", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest_drivaerml(src, path, **OPTS)
    monkeypatch.setattr(ingest_mesh, "partition_location", real)
    f = src / "run_1" / "boundary_1.vtp"
    mesh = pv.read(f)
    mesh.cell_data["pMeanTrim"] = np.asarray(mesh.cell_data["pMeanTrim"]) * 2
    mesh.cell_data["CpMeanTrim"] = np.asarray(mesh.cell_data["CpMeanTrim"]) * 2
    mesh.save(f)
    report = ingest_drivaerml(src, path, **OPTS)
    assert report.kept == ["run_2"] and "run_1" in report.written
    assert any("run_1 has raw files changed" in w for w in report.warnings)
    new = zarr.open_group(path, mode="r")["runs/run_1/surface/fields/Cp"][...]
    order = np.argsort(zarr.open_group(path, mode="r")["runs/run_1/surface/order"][...])
    np.testing.assert_allclose(np.asarray(new)[order, 0] * DRIVAERML.q_inf, mesh.cell_data["pMeanTrim"], rtol=2e-6,
                               atol=1e-3)


def test_resume_after_sigkill_of_the_command(raw, store, tmp_path):
    """A real kill -9 of `domainflow ingest` between runs; the rerun completes to the same store."""
    path = tmp_path / "killed.zarr"
    cmd = [sys.executable, "-m", "domainflow.app.cli", "ingest", "drivaerml", str(raw), str(path), "--parts",
           str(PARTS), "--split", "0.5,0.25,0.25", "--quiet"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (path / "runs" / "run_1").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = zarr.open_group(path, mode="r")
    if root.attrs["domainflow"]["complete"]:
        pytest.fail("the ingest finished before it could be killed; make the data set larger")
    assert cli(["ingest", "drivaerml", str(raw), str(path), "--parts", str(PARTS), "--split", "0.5,0.25,0.25",
                "--quiet"]) == 0
    assert_same_store(store, path)


# -- bad input --------------------------------------------------------------------------------------
def _ingest_one(raw, tmp_path, **kw):
    return ingest_drivaerml(raw, tmp_path / "bad.zarr", **{**OPTS, **kw})


def test_truncated_vtk_names_the_file(raw, tmp_path):
    bad = _copy_raw(raw, tmp_path)
    f = bad / "run_2" / "boundary_2.vtp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(IngestError, match=r"run_2.*boundary_2\.vtp.*(corrupt|truncated)"):
        _ingest_one(bad, tmp_path)
    root = zarr.open_group(tmp_path / "bad.zarr", mode="r")
    assert root.attrs["domainflow"]["complete"] is False  # valid partial store, resumable


def test_missing_array_lists_the_arrays_present(raw, tmp_path):
    bad = _copy_raw(raw, tmp_path)
    f = bad / "run_3" / "boundary_3.vtp"
    mesh = pv.read(f)
    del mesh.cell_data["wallShearStressMeanTrim"]
    mesh.save(f)
    with pytest.raises(IngestError, match=r"boundary_3\.vtp.*wallShearStressMeanTrim.*present.*pMeanTrim"):
        _ingest_one(bad, tmp_path)


def test_point_data_instead_of_cell_data_is_explained(raw, tmp_path):
    bad = _copy_raw(raw, tmp_path)
    f = bad / "run_1" / "boundary_1.vtp"
    mesh = pv.read(f)
    mesh = mesh.cell_data_to_point_data()
    mesh.save(f)
    with pytest.raises(IngestError, match="POINT data"):
        _ingest_one(bad, tmp_path)


def test_nan_values_name_the_file_and_array(raw, tmp_path):
    bad = _copy_raw(raw, tmp_path)
    f = bad / "run_4" / "boundary_4.vtp"
    mesh = pv.read(f)
    p = np.array(mesh.cell_data["pMeanTrim"])
    p[[5, 9]] = np.nan
    mesh.cell_data["pMeanTrim"] = p
    mesh.save(f)
    with pytest.raises(IngestError, match=r"boundary_4\.vtp.*pMeanTrim.*2 of .*NaN/Inf.*cell 5"):
        _ingest_one(bad, tmp_path)


def test_missing_file_and_missing_piece(raw, tmp_path):
    bad = _copy_raw(raw, tmp_path)
    (bad / "run_2" / "force_mom_2.csv").unlink()
    with pytest.raises(IngestError, match=r"missing file.*force_mom_2\.csv"):
        _ingest_one(bad, tmp_path)
    shutil.copy(raw / "run_2" / "force_mom_2.csv", bad / "run_2")
    pieces = sorted((bad / "run_3").glob("volume_3.vtu.*.part"))
    assert len(pieces) == 2
    pieces[0].unlink()
    with pytest.raises(IngestError, match=r"volume_3\.vtu.*piece\(s\) \[0\] are missing"):
        _ingest_one(bad, tmp_path)


def test_on_error_skip_records_the_run_and_completes(raw, tmp_path):
    bad = _copy_raw(raw, tmp_path)
    f = bad / "run_3" / "volume_3.vtu.01.part"
    f.write_bytes(f.read_bytes()[:100])  # a truncated piece
    report = _ingest_one(bad, tmp_path, on_error="skip")
    assert list(report.skipped) == ["run_3"]
    root = zarr.open_group(tmp_path / "bad.zarr", mode="r")
    assert root.attrs["domainflow"]["complete"] is True
    assert "run_3" in root.attrs["skipped"] and "volume_3.vtu" in root.attrs["skipped"]["run_3"]
    assert "run_3" not in sum(dict(root.attrs["splits"]).values(), [])
    assert sorted(root["runs"].group_keys()) == ["run_1", "run_2", "run_4"]


def test_cli_stops_non_zero_and_the_partial_store_resumes_after_the_fix(raw, tmp_path, capsys):
    bad = _copy_raw(raw, tmp_path)
    f = bad / "run_3" / "boundary_3.vtp"
    good = f.read_bytes()
    f.write_bytes(good[:1000])
    args = ["ingest", "drivaerml", str(bad), str(tmp_path / "cli.zarr"), "--parts", "8", "--quiet",
            "--split", "0.5,0.25,0.25"]
    assert cli(args) == 1
    err = capsys.readouterr().err
    assert "boundary_3.vtp" in err and "rerun the same command to resume" in err
    f.write_bytes(good)
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "kept from before 2" in out


def test_options_are_checked(raw, tmp_path):
    with pytest.raises(ValueError, match="power of two"):
        _ingest_one(raw, tmp_path, parts=12)
    with pytest.raises(IngestError, match="--split"):
        _ingest_one(raw, tmp_path, split=(0.5, 0.6, 0.1))
    with pytest.raises(IngestError, match="no run folders named 'run_{i}'"):
        ingest_drivaerml(tmp_path, tmp_path / "x.zarr", **OPTS)
    path = tmp_path / "o.zarr"
    ingest_drivaerml(raw, path, **OPTS)
    with pytest.raises(IngestError, match=r"different options \(parts: store has 8, this ingest asks 16"):
        ingest_drivaerml(raw, path, **{**OPTS, "parts": 16})


def test_split_file_and_volume_cap(raw, tmp_path):
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [1, 3], "val": ["run_2"]}))
    path = tmp_path / "s.zarr"
    ingest_drivaerml(raw, path, parts=4, progress=False, split_file=str(split), volume_points=500)
    root = zarr.open_group(path, mode="r")
    assert dict(root.attrs["splits"]) == {"train": ["run_1", "run_3"], "val": ["run_2"], "test": []}
    assert sorted(root["runs"].group_keys()) == ["run_1", "run_2", "run_3"]
    order = np.asarray(root["runs/run_1/volume/order"][...])
    assert len(order) == 500 and len(set(order.tolist())) == 500
    split.write_text(json.dumps({"train": [1, 99]}))
    with pytest.raises(IngestError, match="run_99"):
        ingest_drivaerml(raw, tmp_path / "t.zarr", parts=4, progress=False, split_file=str(split))


def test_wrong_reference_speed_is_reported(raw, tmp_path):
    report = ingest_drivaerml(raw, tmp_path / "u.zarr", reference=Reference(u_inf=30.0), locations=("surface",),
                              parts=4, progress=False)
    assert report.warnings and "U_inf ~ 38.889" in report.warnings[0]


# -- a mesh nobody here wrote -------------------------------------------------------------------------
def test_ingest_pyvista_airplane_laid_out_as_a_drivaerml_run(tmp_path):
    """pyvista's shipped airplane surface with a pressure field added, in DrivaerML's run folder and file names."""
    from pyvista import examples

    plane = examples.load_airplane()
    raw = tmp_path / "raw"
    run = raw / "run_7"
    run.mkdir(parents=True)
    centres = np.asarray(plane.cell_centers().points)
    normals = np.asarray(plane.compute_normals(cell_normals=True, point_normals=False)["Normals"])
    q = DRIVAERML.q_inf
    cp = 1 - 2 * (1 - normals[:, 0] ** 2)  # sphere-like potential-flow Cp on the surface direction
    plane.cell_data["pMeanTrim"] = (cp * q).astype(np.float32)
    plane.cell_data["CpMeanTrim"] = cp.astype(np.float32)
    plane.cell_data["pPrime2MeanTrim"] = np.full(plane.n_cells, 0.01 * q * q, np.float32)
    plane.cell_data["wallShearStressMeanTrim"] = (0.003 * q * np.cross(normals, [0, 0, 1])).astype(np.float32)
    plane.save(run / "boundary_7.vtp")
    for name in ("force_mom_7.csv", "force_mom_constref_7.csv"):
        (run / name).write_text("cd,cl\n0.02,0.3\n")
    (run / "geo_parameters_7.csv").write_text("span,length\n1300,1500\n")
    path = tmp_path / "plane.zarr"
    report = ingest_drivaerml(raw, path, parts=16, locations=("surface",), progress=False)
    assert report.written == ["run_7"] and not report.warnings
    g = zarr.open_group(path, mode="r")["runs/run_7/surface"]
    inv = np.argsort(np.asarray(g["order"][...]))
    np.testing.assert_allclose(np.asarray(g["coords"][...])[inv], centres, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g["fields/Cp"][...])[inv, 0], cp, atol=1e-5)
    parts, boxes, coords = np.asarray(g["parts"][...]), np.asarray(g["part_boxes"][...]), np.asarray(g["coords"][...])
    for k in range(16):
        rows = coords[parts[k]:parts[k + 1]]
        assert len(rows) in (plane.n_cells // 16, plane.n_cells // 16 + 1)
        assert (rows >= boxes[k, 0]).all() and (rows <= boxes[k, 1]).all()
    text = zarr.open_group(path, mode="r").attrs["splits"]
    assert text["train"] == ["run_7"]


# -- the command line -------------------------------------------------------------------------------
def test_cli_synth_ingest_inspect(tmp_path, capsys):
    raw, store = tmp_path / "raw", tmp_path / "s.zarr"
    assert cli(["synth", "drivaerml", str(raw), "--runs", "3", "--cells", "800", "--quiet"]) == 0
    assert cli(["ingest", "drivaerml", str(raw), str(store), "--parts", "4", "--workers", "1", "--quiet",
                "--locations", "surface"]) == 0
    capsys.readouterr()
    assert cli(["inspect", str(store), "--domain", "1", "3", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh store, format 2, complete" in out and "runs: 3 published" in out
    assert "surface/fields/Cp" in out and "domain 3:" in out and "surface/Cp" in out
    assert cli(["inspect", str(tmp_path)]) == 1


SMALL_OPTS = dict(parts=4, progress=False, split=(0.5, 0.25, 0.25))


@pytest.fixture(scope="module")
def small_raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("adv_raw")
    synth_drivaerml(out, runs=3, cells=800, seed=1, volume_cells=700, volume_pieces=2)
    return out


def _copy(small_raw, tmp_path, name="raw") -> Path:
    dst = tmp_path / name
    shutil.copytree(small_raw, dst)
    return dst


def _runs(store) -> list[str]:
    return sorted(zarr.open_group(store, mode="r")["runs"].group_keys())


def _set_cell_array(path: Path, name: str, fn):
    mesh = pv.read(path)
    mesh.cell_data[name] = fn(np.array(mesh.cell_data[name]))
    mesh.save(path)


# =====================================================================================================
# Mesh: store and partition edge cases (behaviour that is right today; kept as regression tests)
# =====================================================================================================
@pytest.mark.parametrize("method", ["rcb", "morton", "slab"])
def test_more_parts_than_cells_gives_empty_parts_with_nan_boxes(small_raw, tmp_path, method):
    store = tmp_path / "big.zarr"
    ingest_drivaerml(small_raw, store, parts=2048, method=method, locations=("surface",), progress=False)
    g = zarr.open_group(store, mode="r")["runs/run_1/surface"]
    offsets, boxes = np.asarray(g["parts"][...]), np.asarray(g["part_boxes"][...])
    coords, order = np.asarray(g["coords"][...]), np.asarray(g["order"][...])
    n = len(coords)
    assert offsets.shape == (2049,) and offsets[0] == 0 and offsets[-1] == n and (np.diff(offsets) >= 0).all()
    assert sorted(order.tolist()) == list(range(n))
    empty = np.diff(offsets) == 0
    assert empty.sum() == 2048 - n  # n < P: exactly n parts hold one row each
    assert np.isnan(boxes[empty]).all() and not np.isnan(boxes[~empty]).any()
    for k in np.flatnonzero(~empty)[:50]:
        rows = coords[offsets[k]:offsets[k + 1]]
        assert (rows >= boxes[k, 0]).all() and (rows <= boxes[k, 1]).all()


def test_one_part_and_volume_cap_above_the_cell_count(small_raw, tmp_path):
    store = tmp_path / "p1.zarr"
    ingest_drivaerml(small_raw, store, parts=1, volume_points=10 ** 9, progress=False)
    run = zarr.open_group(store, mode="r")["runs/run_1"]
    mesh = pv.read(_join_pieces(small_raw / "run_1" / "volume_1.vtu", tmp_path))
    assert run.attrs["cells"]["volume"] == mesh.n_cells  # a cap above N keeps every cell
    assert np.asarray(run["volume/parts"][...]).tolist() == [0, mesh.n_cells]
    assert np.asarray(run["volume/order"][...]).tolist() == list(range(mesh.n_cells))  # P=1: file order


def _join_pieces(path: Path, tmp_path: Path) -> Path:
    joined = tmp_path / ("joined_" + path.name)
    joined.write_bytes(b"".join(p.read_bytes() for p in sorted(path.parent.glob(path.name + ".*.part"))))
    return joined


def test_run_order_is_numeric_and_unrelated_entries_are_ignored(small_raw, tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    for new, old in (("run_9", "run_1"), ("run_10", "run_2"), ("run_100", "run_3")):
        shutil.copytree(small_raw / old, src / new)
        for f in (src / new).iterdir():
            f.rename(f.with_name(f.name.replace(f"_{old[4:]}.", f"_{new[4:]}.")))
    (src / "run_4").write_text("a file, not a run folder")
    (src / "run_x").mkdir()
    (src / "notes.txt").write_text("hello")
    (src / "run_9" / "README.md").write_text("extra file in a run folder")
    report = ingest_drivaerml(src, tmp_path / "o.zarr", **SMALL_OPTS)
    assert report.written == ["run_9", "run_10", "run_100"]
    root = zarr.open_group(tmp_path / "o.zarr", mode="r")
    assert sorted(sum(dict(root.attrs["splits"]).values(), []), key=lambda r: int(r[4:])) == report.written
    assert root["runs/run_100"].attrs["run"] == 100


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_runs_all_go_to_train(small_raw, tmp_path, n):
    src = tmp_path / "raw"
    src.mkdir()
    for i in range(1, n + 1):
        shutil.copytree(small_raw / f"run_{i}", src / f"run_{i}")
    ingest_drivaerml(src, tmp_path / "s.zarr", parts=4, progress=False)  # default 0.8/0.1/0.1
    splits = dict(zarr.open_group(tmp_path / "s.zarr", mode="r").attrs["splits"])
    assert splits == {"train": [f"run_{i}" for i in range(1, n + 1)], "val": [], "test": []}


def test_surface_only_store_has_no_volume_anything(small_raw, tmp_path):
    store = tmp_path / "s.zarr"
    ingest_drivaerml(small_raw, store, locations=("surface",), **SMALL_OPTS)
    root = zarr.open_group(store, mode="r")
    assert all(k.startswith("surface/") for k in root.attrs["stats"])
    assert all(k.startswith("surface/") for k in root.attrs["fields"])
    for run in _runs(store):
        assert sorted(root["runs"][run].group_keys()) == ["surface"]
        assert dict(root["runs"][run].attrs["cells"]) == {"surface": 800}


def test_chunks_are_near_chunk_bytes_along_rows(small_raw, tmp_path):
    store = tmp_path / "c.zarr"
    ingest_drivaerml(small_raw, store, chunk_bytes=1024, locations=("surface",), **SMALL_OPTS)
    g = zarr.open_group(store, mode="r")["runs/run_1/surface"]
    for name, arr in list(g.arrays()) + list(g["fields"].arrays()):
        if name in ("parts", "part_boxes"):
            continue
        row = arr.dtype.itemsize * int(np.prod(arr.shape[1:]))
        assert arr.chunks[1:] == arr.shape[1:], name  # whole rows per chunk
        assert 1024 - row < arr.chunks[0] * row <= 1024, (name, arr.chunks)


def test_only_the_needed_cell_arrays_are_read(small_raw, tmp_path):
    f = tmp_path / "extra.vtp"
    mesh = pv.read(small_raw / "run_1" / "boundary_1.vtp")
    mesh.cell_data["huge_extra"] = np.zeros((mesh.n_cells, 9), np.float32)
    mesh.point_data["point_extra"] = np.zeros(mesh.n_points)
    mesh.save(f)
    got, arrays = read_cells(f, ["pMeanTrim"], optional=("CpMeanTrim", "not_there"))
    assert sorted(got.cell_data) == ["CpMeanTrim", "pMeanTrim"] and not list(got.point_data)
    assert sorted(arrays) == ["CpMeanTrim", "pMeanTrim"]


# =====================================================================================================
# Mesh: bad raw input -> IngestError naming the file (right today except where noted)
# =====================================================================================================
def _vtu_renamed_as_vtp(run: Path):
    (run / "boundary_2.vtp").unlink()
    pv.read(_join_pieces(run / "volume_2.vtu", run.parent)).save(run / "v.vtu")
    (run / "v.vtu").rename(run / "boundary_2.vtp")


def _pieces_00_and_02(run: Path):
    (run / "volume_2.vtu.01.part").rename(run / "volume_2.vtu.02.part")


BAD_VTK = {
    "inf": (lambda r: _set_cell_array(r / "boundary_2.vtp", "pMeanTrim",
                                      lambda a: np.where(np.arange(len(a)) == 7, np.inf, a).astype(np.float32)),
            r"boundary_2\.vtp.*pMeanTrim.*NaN/Inf.*cell 7"),
    "float64 beyond float32": (lambda r: _set_cell_array(r / "boundary_2.vtp", "pMeanTrim",
                                                         lambda a: np.where(np.arange(len(a)) == 3, 1e39, a)),
                               r"boundary_2\.vtp.*pMeanTrim.*NaN/Inf"),
    "scalar with 2 components": (lambda r: _set_cell_array(r / "boundary_2.vtp", "pMeanTrim",
                                                           lambda a: np.stack([a, a], 1)),
                                 r"boundary_2\.vtp.*pMeanTrim.*2 components, expected 1"),
    "vector with 1 component": (lambda r: _set_cell_array(r / "boundary_2.vtp", "wallShearStressMeanTrim",
                                                          lambda a: a[:, 0].copy()),
                                r"boundary_2\.vtp.*wallShearStressMeanTrim.*1 components, expected 3"),
    "vtu renamed to vtp": (_vtu_renamed_as_vtp, r"boundary_2\.vtp.*polygons only; cell 0 has VTK cell type 12"),
    "zero-byte vtp": (lambda r: (r / "boundary_2.vtp").write_bytes(b""), r"boundary_2\.vtp.*corrupt"),
    "zero-byte piece": (lambda r: (r / "volume_2.vtu.01.part").write_bytes(b""), r"volume_2\.vtu.*corrupt"),
    "pieces 00 and 02": (_pieces_00_and_02, r"volume_2\.vtu.*piece\(s\) \[1\] are missing \(found \[0, 2\]\)"),
    "legacy .vtk instead of .vtp": (lambda r: (pv.read(r / "boundary_2.vtp").save(r / "boundary_2.vtk"),
                                               (r / "boundary_2.vtp").unlink()),
                                    r"missing file.*boundary_2\.vtp.*holds.*boundary_2\.vtk"),
    "csv with two value rows": (lambda r: (r / "force_mom_2.csv").write_text("cd,cl\n1,2\n3,4\n"),
                                r"force_mom_2\.csv.*found 3 non-empty lines"),
    "csv non-numeric": (lambda r: (r / "force_mom_2.csv").write_text("cd,cl\n0.3,abc\n"),
                        r"force_mom_2\.csv.*'cl' holds 'abc'"),
    "csv without header": (lambda r: (r / "geo_parameters_2.csv").write_text("0.3,0.1\n"),
                           r"geo_parameters_2\.csv.*header"),
    "zero-byte csv": (lambda r: (r / "force_mom_constref_2.csv").write_bytes(b""),
                      r"force_mom_constref_2\.csv.*found 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_VTK))
def test_bad_raw_file_is_an_ingest_error_naming_it(small_raw, tmp_path, case):
    mutate, pattern = BAD_VTK[case]
    src = _copy(small_raw, tmp_path)
    mutate(src / "run_2")
    with pytest.raises(IngestError, match=r"run_2: .*" + pattern):
        ingest_drivaerml(src, tmp_path / "s.zarr", **SMALL_OPTS)
    assert zarr.open_group(tmp_path / "s.zarr", mode="r").attrs["domainflow"]["complete"] is False


def test_missing_last_part_piece_is_reported_as_missing_not_corrupt(tmp_path, capsys):
    """Pieces 00..02 of 00..03 have no gap, so only the joined file's end shows that .03.part is missing;
    the error says so (naming the file and the piece) instead of calling the volume file corrupt."""
    src = tmp_path / "raw"
    synth_drivaerml(src, runs=1, cells=300, volume_cells=400, volume_pieces=4, progress=False)
    run = src / "run_1"
    assert sorted(p.name for p in run.glob("volume_1.vtu.*.part")) == [f"volume_1.vtu.0{k}.part" for k in range(4)]
    (run / "volume_1.vtu.03.part").unlink()
    pattern = r"run_1: .*volume_1\.vtu: its \.part pieces 00\.\.02 end before.*\.03\.part and after\?\).*missing"
    with pytest.raises(IngestError, match=pattern) as caught:
        ingest_drivaerml(src, tmp_path / "s.zarr", **SMALL_OPTS)
    assert "corrupt" not in str(caught.value)
    code = cli(["ingest", "drivaerml", str(src), str(tmp_path / "c.zarr"), "--parts", "4", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "volume_1.vtu" in err and ".03.part" in err and "missing" in err and "corrupt" not in err


def test_csv_that_is_not_text_names_the_file(small_raw, tmp_path):
    # BUG: read_csv_row opens the CSV as UTF-8 text and lets UnicodeDecodeError escape: the message
    # ("'utf-8' codec can't decode byte 0xff") names neither the run nor the file, and it is not an
    # IngestError. Expected: IngestError "run_2: .../force_mom_2.csv: not a text CSV (...)".
    src = _copy(small_raw, tmp_path)
    (src / "run_2" / "force_mom_2.csv").write_bytes(b"\xff\xfe\x00garbage\n\x81\x82\n")
    with pytest.raises(IngestError, match=r"run_2.*force_mom_2\.csv"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **SMALL_OPTS)


@pytest.mark.parametrize("kind", ["binary", "directory"])
def test_unreadable_csv_is_skipped_with_on_error_skip(small_raw, tmp_path, kind):
    # BUG: with --on-error skip a CSV that cannot be decoded (UnicodeDecodeError) or opened
    # (IsADirectoryError, PermissionError) aborts the whole ingest, because ingest_run only catches
    # IngestError. Expected: run_2 recorded in attrs.skipped, the others ingested, the store complete.
    src = _copy(small_raw, tmp_path)
    f = src / "run_2" / "force_mom_2.csv"
    if kind == "binary":
        f.write_bytes(b"\xff\xfe\x00\x81")
    else:
        f.unlink()
        f.mkdir()
    report = ingest_drivaerml(src, tmp_path / "s.zarr", on_error="skip", **SMALL_OPTS)
    assert list(report.skipped) == ["run_2"] and "force_mom_2.csv" in report.skipped["run_2"]
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    assert root.attrs["domainflow"]["complete"] is True and "run_2" in root.attrs["skipped"]


def test_csv_with_a_repeated_column_name_is_refused(small_raw, tmp_path):
    # BUG: read_csv_row builds a dict from the header, so "cd,cd" silently keeps only the last value.
    # Expected: IngestError naming the file and the repeated column.
    src = _copy(small_raw, tmp_path)
    (src / "run_2" / "force_mom_2.csv").write_text("cd,cl,cd\n0.3,0.1,0.5\n")
    with pytest.raises(IngestError, match=r"force_mom_2\.csv.*'cd'"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **SMALL_OPTS)


def test_surface_of_line_cells_is_an_ingest_error(small_raw, tmp_path):
    # BUG: surface_geometry means to refuse non-polygon surfaces with an IngestError ("the surface must be
    # polygons only"), but pyvista's compute_normals raises TypeError first for a surface of lines or
    # vertices. TypeError is not caught by the CLI (traceback) nor by --on-error skip.
    # Expected: IngestError naming boundary_2.vtp (fix: check mesh.n_polys / catch TypeError and re-raise).
    src = _copy(small_raw, tmp_path)
    f = src / "run_2" / "boundary_2.vtp"
    mesh = pv.read(f)
    edges = mesh.extract_all_edges()
    for k in ("pMeanTrim", "CpMeanTrim", "pPrime2MeanTrim", "wallShearStressMeanTrim"):
        edges.cell_data[k] = np.zeros((edges.n_cells,) + mesh.cell_data[k].shape[1:], np.float32)
    edges.save(f)
    with pytest.raises(IngestError, match=r"boundary_2\.vtp"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **SMALL_OPTS)


# =====================================================================================================
# Mesh: options are checked before anything is written
# =====================================================================================================
def test_chunk_bytes_must_be_positive():
    # BUG: MeshOptions.validate does not check chunk_bytes (GridOptions refuses < 4). chunk_bytes=0 or
    # negative gives one-row chunks: one file per row (13 s for 4,500 cells; millions of files on real data).
    # Expected: IngestError naming --chunk-bytes.
    for bad in (0, -5):
        with pytest.raises(IngestError, match="--chunk-bytes"):
            MeshOptions(chunk_bytes=bad).validate()


def test_workers_below_one_refused_before_creating_the_store(small_raw, tmp_path):
    # BUG: --workers 0 is only refused inside run_tasks, after StoreWriter.open has already created an
    # empty partial store. Expected: the error comes from option validation and nothing is written.
    store = tmp_path / "w.zarr"
    with pytest.raises(ValueError, match="--workers"):
        ingest_drivaerml(small_raw, store, workers=0, **SMALL_OPTS)
    assert not store.exists()


def test_non_finite_reference_pressure_is_refused(small_raw, tmp_path):
    # BUG: Reference validates u_inf, rho_inf and l_ref but not p_inf, and the ingest checks the raw arrays
    # for NaN/Inf but not the scaled ones: p_inf=nan (e.g. `--p-inf nan`) makes every Cp NaN and the run
    # dies in RunningStats.of with "statistics of values containing NaN/Inf" (a plain ValueError, after the
    # store was created; --on-error skip does not catch it). Expected: refused up front, naming p_inf.
    store = tmp_path / "r.zarr"
    with pytest.raises(ValueError, match="p_inf"):
        ingest_drivaerml(small_raw, store, reference=Reference(p_inf=float("nan")), **SMALL_OPTS)
    assert not store.exists()


def test_repeated_location_is_refused_or_merged(small_raw, tmp_path):
    # BUG: MeshOptions.validate accepts locations=("surface", "surface") (`--locations surface,surface`);
    # every run then dies in zarr with ContainsGroupError ("A group exists ... at path 'surface'"), which
    # is not an IngestError, so --on-error skip aborts too. Expected: IngestError from validation, or the
    # repeat dropped.
    try:
        ingest_drivaerml(small_raw, tmp_path / "s.zarr", locations=("surface", "surface"), **SMALL_OPTS)
    except IngestError as exc:
        assert "--locations" in str(exc)
        return
    assert sorted(zarr.open_group(tmp_path / "s.zarr", mode="r")["runs/run_1"].group_keys()) == ["surface"]


def test_split_file_with_empty_train_fails_before_ingesting(small_raw, tmp_path):
    # BUG: a split file with "train": [] is accepted, every run is ingested, and only then does the
    # coordinator fail ("no train run was ingested"). On real data that is hours of wasted work.
    # Expected: IngestError about the empty train split before any run is written.
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [], "val": [1, 2], "test": [3]}))
    store = tmp_path / "e.zarr"
    with pytest.raises(IngestError, match="train"):
        ingest_drivaerml(small_raw, store, parts=4, progress=False, split_file=str(split))
    assert not store.exists() or not _runs(store)


def test_split_file_without_train_key_is_refused(small_raw, tmp_path):
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"val": [1], "test": [2]}))
    with pytest.raises(IngestError, match=r'"train" \(required\)'):
        ingest_drivaerml(small_raw, tmp_path / "v.zarr", parts=4, progress=False, split_file=str(split))


# =====================================================================================================
# Mesh: the STORE path
# =====================================================================================================
def test_overwrite_refuses_a_folder_that_is_not_a_store(small_raw, tmp_path):
    # BUG: StoreWriter.open(overwrite=True) rmtree's STORE whatever it is: `--overwrite` with a mistyped
    # STORE (a home or project folder) deletes it. Without --overwrite the same folder is refused.
    # Expected: --overwrite only replaces a domainflow store (zarr.json with attrs.domainflow) or an empty
    # folder; anything else is refused with IngestError and left untouched.
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "precious.txt").write_text("do not delete")
    with pytest.raises(IngestError, match="not a domainflow store"):
        ingest_drivaerml(small_raw, folder, **SMALL_OPTS)
    with pytest.raises(IngestError):
        ingest_drivaerml(small_raw, folder, overwrite=True, **SMALL_OPTS)
    assert (folder / "precious.txt").read_text() == "do not delete"


def test_overwrite_with_store_equal_to_raw_keeps_the_raw_data(small_raw, tmp_path):
    # BUG: `ingest drivaerml RAW RAW --overwrite` deletes the raw run folders (open() removes STORE before
    # any run is read), then fails with "missing file(s)". Expected: refused (STORE equal to, or containing,
    # RAW), raw data untouched.
    src = _copy(small_raw, tmp_path)
    with pytest.raises(IngestError):
        ingest_drivaerml(src, src, overwrite=True, **SMALL_OPTS)
    assert (src / "run_1" / "boundary_1.vtp").exists()


def test_store_path_that_is_a_file_is_an_ingest_error(small_raw, tmp_path):
    # BUG: StoreWriter.open calls Path.iterdir() on STORE; when STORE is a file this raises
    # NotADirectoryError. Expected: IngestError "STORE exists and is not a domainflow store".
    f = tmp_path / "s.zarr"
    f.write_text("not a store")
    with pytest.raises(IngestError, match="s.zarr"):
        ingest_drivaerml(small_raw, f, **SMALL_OPTS)


def test_store_path_may_be_a_symlink_to_an_empty_folder(small_raw, tmp_path):
    # BUG: STORE given as a symlink to an (empty) folder, common on clusters (a link to fast storage),
    # fails with "OSError: Cannot call rmtree on a symbolic link" (StoreWriter._remove_all). Expected: the
    # store is written into the link's target. The target is put on another file system when one is at
    # hand, so that scratch (next to the *link*) and runs/ (in the *target*) are on different devices:
    # publish_run's os.replace must then still work (fix: resolve the path in StoreWriter.__init__).
    shm = Path("/dev/shm")
    target = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path))
    try:
        link = tmp_path / "link.zarr"
        link.symlink_to(target, target_is_directory=True)
        report = ingest_drivaerml(small_raw, link, locations=("surface",), **SMALL_OPTS)
        assert report.written == ["run_1", "run_2", "run_3"]
        assert zarr.open_group(target, mode="r").attrs["domainflow"]["complete"] is True
    finally:
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(target.with_name(target.name + ".ingest-tmp"), ignore_errors=True)


# =====================================================================================================
# Mesh: resume
# =====================================================================================================
def _break(src: Path, run: str = "run_3") -> tuple[Path, bytes]:
    f = src / run / f"boundary_{run[4:]}.vtp"
    good = f.read_bytes()
    f.write_bytes(good[:300])
    return f, good


def test_resume_with_a_different_raw_folder_is_refused(small_raw, tmp_path):
    # BUG: the store records attrs.domainflow.source (RAW) but StoreWriter.open never compares it, so a
    # partial store made from RAW A is "resumed" from an unrelated RAW B: runs of A are kept, the rest come
    # from B, and the store is marked complete with source A. Expected: IngestError naming both folders
    # (or include the resolved source in attrs.ingest.config). The same holds for ingest climate.
    a = _copy(small_raw, tmp_path, "rawA")
    _break(a)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(a, store, **SMALL_OPTS)
    assert _runs(store) == ["run_1", "run_2"]
    b = tmp_path / "rawB"
    synth_drivaerml(b, runs=3, cells=600, seed=99, volume_cells=600)
    with pytest.raises(IngestError, match="rawA|rawB"):
        ingest_drivaerml(b, store, **SMALL_OPTS)


def test_resume_does_not_keep_runs_that_left_raw(small_raw, tmp_path):
    # BUG: a run published by an interrupted ingest whose folder was then removed from RAW stays in
    # runs/ of the completed store although it is in no split (finished_runs() is not intersected with
    # the runs found in RAW). Expected: every run in runs/ is listed in attrs.splits (drop the orphan), or
    # the resume is refused with IngestError.
    src = _copy(small_raw, tmp_path)
    f, good = _break(src)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(src, store, **SMALL_OPTS)
    f.write_bytes(good)
    shutil.rmtree(src / "run_1")
    try:
        ingest_drivaerml(src, store, **SMALL_OPTS)
    except IngestError:
        return
    root = zarr.open_group(store, mode="r")
    listed = set(sum(dict(root.attrs["splits"]).values(), []))
    assert set(_runs(store)) <= listed, f"runs {sorted(set(_runs(store)) - listed)} are in no split"


def test_resume_ignores_junk_in_scratch_and_cleans_it(small_raw, tmp_path):
    src = _copy(small_raw, tmp_path)
    f, good = _break(src)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(src, store, **SMALL_OPTS)
    scratch = tmp_path / "s.zarr.ingest-tmp"
    (scratch / "runs" / "run_3.deadbeef").mkdir(parents=True, exist_ok=True)
    (scratch / "runs" / "run_3.deadbeef" / "zarr.json").write_text("{ half written")
    (scratch / "domainflow-parts-junk").mkdir()
    (scratch / "domainflow-parts-junk" / "volume_3.vtu").write_bytes(b"x" * 1000)
    (scratch / "stray.txt").write_text("x")
    f.write_bytes(good)
    report = ingest_drivaerml(src, store, **SMALL_OPTS)
    assert report.state == "resume" and report.kept == ["run_1", "run_2"] and report.written == ["run_3"]
    assert not scratch.exists()
    ingest_drivaerml(src, tmp_path / "ref.zarr", **SMALL_OPTS)
    assert_same_store(tmp_path / "ref.zarr", store)


def test_overwrite_on_a_partial_store_starts_again(small_raw, tmp_path):
    src = _copy(small_raw, tmp_path)
    f, good = _break(src)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(src, store, **SMALL_OPTS)
    f.write_bytes(good)
    report = ingest_drivaerml(src, store, overwrite=True, **SMALL_OPTS)
    assert report.state == "new" and report.kept == [] and report.written == ["run_1", "run_2", "run_3"]


def test_two_workers_skip_and_stop_leave_valid_stores(small_raw, tmp_path):
    src = _copy(small_raw, tmp_path)
    f, good = _break(src, "run_2")
    report = ingest_drivaerml(src, tmp_path / "skip.zarr", workers=2, on_error="skip", **SMALL_OPTS)
    assert report.written == ["run_1", "run_3"] and list(report.skipped) == ["run_2"]
    assert zarr.open_group(tmp_path / "skip.zarr", mode="r").attrs["domainflow"]["complete"] is True
    store = tmp_path / "stop.zarr"
    with pytest.raises(IngestError, match=r"run_2.*boundary_2\.vtp"):
        ingest_drivaerml(src, store, workers=2, **SMALL_OPTS)
    assert zarr.open_group(store, mode="r").attrs["domainflow"]["complete"] is False
    f.write_bytes(good)
    report = ingest_drivaerml(src, store, workers=2, **SMALL_OPTS)
    assert report.state == "resume" and "run_2" in report.written
    ingest_drivaerml(src, tmp_path / "ref.zarr", **SMALL_OPTS)
    assert_same_store(tmp_path / "ref.zarr", store)


def test_task_arguments_hold_absolute_paths(small_raw, tmp_path, monkeypatch):
    # BUG: ingest_drivaerml and ingest_climate hand RAW and STORE to the tasks exactly as given. With
    # `--scheduler ADDRESS` the tasks run on dask workers started in their own working directory, so
    # `domainflow ingest drivaerml raw out.zarr --scheduler ...` makes workers read ./raw and write
    # ./out.zarr relative to *their* cwd. Expected: the coordinator resolves both paths before submitting.
    shutil.copytree(small_raw, tmp_path / "raw")
    monkeypatch.chdir(tmp_path)
    seen = []
    real_mesh, real_grid = ingest_mesh.run_graph, ingest_grid.run_tasks

    def spy_mesh(run_dir, run_id, store, opts):  # a run's graph: every task gets these two paths
        seen.append((str(run_dir), run_id, str(store)))
        return real_mesh(run_dir, run_id, store, opts)

    def spy(real):
        def run(func, calls, **kw):
            calls = list(calls)
            seen.extend(calls)
            return real(func, calls, **kw)
        return run

    monkeypatch.setattr(ingest_mesh, "run_graph", spy_mesh)
    monkeypatch.setattr(ingest_grid, "run_tasks", spy(real_grid))
    ingest_drivaerml("raw", "mesh.zarr", locations=("surface",), **SMALL_OPTS)
    _grid_source(tmp_path / "src.zarr", np.ones((3, 4, 8), np.float32))
    ingest_climate("src.zarr", "grid.zarr", progress=False)
    for call in seen:
        paths = [a for a in call if isinstance(a, str) and ("raw" in a or ".zarr" in a)]
        assert paths and all(os.path.isabs(p) for p in paths), call[:3]


# =====================================================================================================
# inspect and the command line
# =====================================================================================================
def test_inspect_incomplete_stores_and_non_stores(tmp_path, capsys):
    StoreWriter(tmp_path / "m.zarr").open("mesh", "somewhere", 8, {"parts": 8})
    text = describe(tmp_path / "m.zarr")
    assert "INCOMPLETE" in text and "runs: 0 published" in text and "rerun the same" in text
    StoreWriter(tmp_path / "g.zarr").open("grid", "somewhere", None, {})
    assert "no data array yet" in describe(tmp_path / "g.zarr")
    zarr.open_group(tmp_path / "plain.zarr", mode="w")
    (tmp_path / "file").write_text("x")
    for path in ("plain.zarr", "file", "missing"):
        with pytest.raises(IngestError, match="not a domainflow store"):
            describe(tmp_path / path)
        assert cli(["inspect", str(tmp_path / path)]) == 1
    assert "not a domainflow store" in capsys.readouterr().err


def test_cli_malformed_split_argument_is_a_clean_error(small_raw, tmp_path, capsys):
    # BUG: `--split 0.5,0.5` makes _floats raise argparse.ArgumentTypeError inside _ingest, after parsing;
    # main() only catches ValueError/RuntimeError/OSError, so the user gets a traceback. Expected: a one-line
    # "error: --split takes 3 comma-separated numbers" and a non-zero exit (return 1, or argparse's exit 2;
    # fix: use type=lambda s: _floats(...) on the argument, or catch ArgumentTypeError).
    args = ["ingest", "drivaerml", str(small_raw), str(tmp_path / "s.zarr"), "--split", "0.5,0.5", "--quiet"]
    try:
        code = cli(args)
    except SystemExit as exc:
        code = exc.code
    assert code not in (0, None)
    assert "--split" in capsys.readouterr().err
