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

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess import ingest_mesh  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_mesh import FIELDS, ingest_drivaerml  # noqa: E402
from domainflow.preprocess.reference import DRIVAERML, Reference  # noqa: E402
from domainflow.preprocess.synth_drivaerml import synth_drivaerml  # noqa: E402
from store_compare import assert_same_store  # noqa: E402

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
            for spec in FIELDS[loc]:
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
    real = ingest_mesh._write_location
    calls = []

    def dying(group, loc, *a, **k):
        calls.append(loc)
        if len(calls) == 5:  # run_3's surface: written into scratch, then the process "dies"
            real(group, loc, *a, **k)
            raise KeyboardInterrupt
        return real(group, loc, *a, **k)

    monkeypatch.setattr(ingest_mesh, "_write_location", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest_drivaerml(raw, path, **OPTS)
    monkeypatch.setattr(ingest_mesh, "_write_location", real)
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
    real, calls = ingest_mesh._write_location, []

    def dying(group, loc, *a, **k):
        calls.append(loc)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(group, loc, *a, **k)

    monkeypatch.setattr(ingest_mesh, "_write_location", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest_drivaerml(src, path, **OPTS)
    monkeypatch.setattr(ingest_mesh, "_write_location", real)
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
    with pytest.raises(IngestError, match="no run_<i> folders"):
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
    """pyvista's shipped airplane surface with a pressure field added, in the DrivaerML layout."""
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
