"""`domainflow predict` writes what ParaView and pyvista open, without gathering a run on any rank: a piece per
rank (.pvtp), one file assembled from the pieces (.vtp), a .pvd over runs; on the raw surface's own polygons,
or on the cell centres when the raw file is gone. Compared with VTK's own read of the raw files; real ranks
through the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from xml.etree import ElementTree

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")

from cli_runner import run_cli  # noqa: E402

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"}
RUN_ENV = {"OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"}
TRAIN = ["model.dim=8", "model.layers=2", "model.heads=2", "model.slices=4", "output.progress=false",
         "output.plots=false", "train.eval_every=0", "data.prefetch=0", "train.steps=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store of 4 runs (raw files kept, 8 parts) and a checkpoint trained on it at domain 1."""
    from domainflow.app.cli import main
    from domainflow.preprocess.ingest_mesh import ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("predict")
    synth_drivaerml(root / "raw", runs=4, cells=900, seed=5, volume_cells=200, volume_pieces=1, progress=False)
    ingest_drivaerml(root / "raw", root / "s.zarr", parts=8, progress=False, split=(0.5, 0.5, 0.0),
                     locations=("surface",), chunk_bytes=2048)
    assert main(["train", "--out", str(root / "train"), f"data.store={root / 's.zarr'}", *TRAIN]) == 0
    return {"root": root, "store": root / "s.zarr", "ckpt": root / "train" / "checkpoints"}


def _predict(trained, *args):
    """``domainflow predict`` in this process (its ranks forked); the command's own process: the .pvd test."""
    return run_cli("predict", trained["ckpt"], trained["store"], *args, env=RUN_ENV)


def _raw(trained, run):
    return pv.read(trained["root"] / "raw" / run / f"boundary_{run.split('_')[1]}.vtp")


def _read_pvtp(path):
    import vtk

    reader = vtk.vtkXMLPPolyDataReader()
    reader.SetFileName(str(path))
    reader.Update()
    return pv.wrap(reader.GetOutput())


def _cells(mesh) -> list[tuple]:
    """Each cell's points, as coordinates (comparable across files that number points differently)."""
    faces, pts, out, k = mesh.faces, mesh.points, [], 0
    while k < len(faces):
        n = faces[k]
        out.append(tuple(map(tuple, pts[faces[k + 1:k + 1 + n]].round(6))))
        k += n + 1
    return out


def test_one_file_per_rank_and_one_assembled_file_agree_with_the_raw_surface(trained, tmp_path):
    run = "run_2"
    one = tmp_path / "one.vtp"
    r = _predict(trained, "--run", run, str(one))
    assert r.returncode == 0, r.stderr
    raw = _raw(trained, run)
    ref = pv.read(one)
    # the assembled file is the raw surface itself (its points and polygons) with the arrays in cell order
    np.testing.assert_array_equal(ref.points, raw.points)
    np.testing.assert_array_equal(ref.faces, raw.faces)
    np.testing.assert_array_equal(ref.cell_data["cell_id"], np.arange(raw.n_cells))
    np.testing.assert_allclose(ref.cell_data["Cp_true"], raw.cell_data["CpMeanTrim"].reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref.cell_data["Cp_err"], ref.cell_data["Cp_pred"] - ref.cell_data["Cp_true"],
                               rtol=1e-5, atol=1e-6)
    assert ref.cell_data["Cf_pred"].shape == (raw.n_cells, 3) and "Cf_err" in ref.cell_data

    pieces = tmp_path / "three.pvtp"
    (tmp_path / "three").mkdir()
    (tmp_path / "three" / "three_7.vtp").write_text("a piece of an earlier prediction at domain 8")
    (tmp_path / "three" / "three_summary.vtp").write_text("the user's own file")
    r = _predict(trained, "--run", run, str(pieces), "--domain", "3", "--block-points", "50")
    assert r.returncode == 0, r.stderr
    assert "3 pieces and their index" in r.stdout and "blocks of 50 points" in r.stdout
    files = sorted((tmp_path / "three").glob("three_[0-9]*.vtp"))
    assert [f.name for f in files] == ["three_0.vtp", "three_1.vtp", "three_2.vtp"]  # the stale piece is gone
    assert (tmp_path / "three" / "three_summary.vtp").read_text() == "the user's own file"
    seen = []
    raw_cells = _cells(raw)
    for f in files:
        piece = pv.read(f)
        ids = piece.cell_data["cell_id"]
        assert np.all(np.diff(ids) > 0)  # original cell order within the piece
        seen.append(ids)
        assert _cells(piece) == [raw_cells[i] for i in ids]  # the raw polygons of exactly those cells
        for name in ("Cp_pred", "Cp_true", "Cp_err", "Cf_pred", "Cf_true"):
            np.testing.assert_allclose(piece.cell_data[name], ref.cell_data[name][ids], rtol=1e-4, atol=1e-5)
    assert sorted(np.concatenate(seen).tolist()) == list(range(raw.n_cells))
    whole = _read_pvtp(pieces)  # VTK's parallel reader (ParaView's) joins the pieces
    assert whole.n_cells == raw.n_cells and {"Cp_pred", "Cp_err", "cell_id"} <= set(whole.cell_data.keys())

    assembled = tmp_path / "three.vtp"
    r = _predict(trained, "--run", run, str(assembled), "--domain", "3")
    assert r.returncode == 0, r.stderr
    back = pv.read(assembled)
    np.testing.assert_array_equal(back.faces, raw.faces)
    for name in ("Cp_pred", "Cf_pred", "Cp_true", "cell_id"):
        np.testing.assert_allclose(back.cell_data[name], ref.cell_data[name], rtol=1e-4, atol=1e-5)
    assert not (tmp_path / ".three.vtp.pieces").exists()  # the scratch pieces are gone


def test_without_the_raw_file_the_cells_are_vertices_at_their_centres_and_a_pvd_lists_the_runs(trained, tmp_path):
    store = tmp_path / "s.zarr"
    shutil.copytree(trained["store"], store)  # same store, source path no longer there
    source = trained["root"] / "raw"
    moved = tmp_path / "raw_moved"
    shutil.copytree(source, moved)
    shutil.rmtree(source)
    try:
        for pieces in (False, True):
            out = tmp_path / f"runs_{int(pieces)}.pvd"
            args = ["predict", str(trained["ckpt"]), str(store), "--run", "run_1,run_3", str(out), "--domain", "2"]
            if pieces:  # in this process; the .pvd of whole files through a real `domainflow predict` process
                r = run_cli(*args, "--pieces", env=RUN_ENV)
            else:
                r = subprocess.run([sys.executable, "-m", "domainflow.app.cli", *args], env=ENV, capture_output=True,
                                   text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            assert "cell centres" in r.stdout and "a collection of 2 runs" in r.stdout
            listed = [(d.get("timestep"), d.get("name"), d.get("file"))
                      for d in ElementTree.parse(out).getroot().iter("DataSet")]
            suffix = ".pvtp" if pieces else ".vtp"
            assert listed == [("0", "run_1", f"runs_{int(pieces)}/run_1{suffix}"),
                              ("1", "run_3", f"runs_{int(pieces)}/run_3{suffix}")]
            if not pieces:  # pyvista steps through a collection of .vtp files itself
                reader = pv.get_reader(str(out))
                assert len(reader.time_values) == 2
            for _, run, file in listed:
                data = _read_pvtp(out.parent / file) if pieces else pv.read(out.parent / file)
                raw = pv.read(moved / run / f"boundary_{run.split('_')[1]}.vtp")
                assert data.n_cells == raw.n_cells == data.n_points
                order = np.argsort(data.cell_data["cell_id"])
                np.testing.assert_allclose(data.points[order], raw.cell_centers().points, rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(data.cell_data["Cp_true"][order],
                                           raw.cell_data["CpMeanTrim"].reshape(-1), rtol=1e-5, atol=1e-5)
    finally:
        shutil.copytree(moved, source)


def test_output_names_are_checked_before_ranks_start_and_a_rank_that_cannot_write_fails_every_rank(trained, tmp_path):
    for args, msg in [(["--run", "run_1", "--run", "run_2", str(tmp_path / "a.vtp")], "name the output <name>.pvd"),
                      (["--run", "run_1", str(tmp_path / "a.vtk")], "must end in .vtp (one file), .pvtp"),
                      (["--run", "run_1", "--pieces", str(tmp_path / "a.vtp")], "name the output a.pvtp"),
                      (["--run", "run_9", str(tmp_path / "a.vtp")], "no run 'run_9'"),
                      (["--run", "run_1", "--compile", str(tmp_path / "a.vtp")],
                       "--compile compiles static shapes, and every run of a mesh store has its own points"),
                      (["--run", "run_1", "--compile-backend", "aot_eager", str(tmp_path / "a.vtp")],  # implies it
                       "--compile compiles static shapes, and every run of a mesh store has its own points")]:

        r = run_cli("predict", trained["ckpt"], trained["store"], *args, "--domain", "2")
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode != 0 and len(lines) == 1 and msg in lines[0], r.stderr
    # rank 1's piece cannot be published (a folder sits where the file goes): every rank names rank 1
    blocked = tmp_path / "b" / "b_1.vtp"
    blocked.mkdir(parents=True)
    r = _predict(trained, "--run", "run_1", str(tmp_path / "b.pvtp"), "--domain", "2")
    assert r.returncode != 0
    assert "rank 1 could not write the prediction" in r.stderr and "b_1.vtp" in r.stderr, r.stderr
    assert not (tmp_path / "b.pvtp").exists()
