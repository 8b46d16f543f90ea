"""A run knows what it is and owns its folder: ``--resume`` continues only a checkpoint of the same run (other
settings are named, both sides), ``--init-from`` starts a new run from another's weights, a fresh run into a
folder with checkpoints is refused unless it overwrites by name, and a second training into a folder in use
is refused while the first runs (a real process holding the lock)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from cli_runner import run_cli
from test_train import MESH_OVERRIDES

ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")},
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def store(cars_store):
    return cars_store


def _train(store, out, *extra):
    return run_cli("train", f"data.store={store}", *MESH_OVERRIDES, "output.plots=false", *extra, "--out", out)


def test_a_fresh_run_into_a_folder_with_checkpoints_is_refused_unless_it_overwrites(store, tmp_path):
    out = tmp_path / "run"
    assert _train(store, out, "train.steps=2").returncode == 0
    res = _train(store, out, "train.steps=1")
    assert res.returncode == 1
    assert f"output.dir {out} already holds the checkpoints of a training (step_00000002)" in res.stderr
    assert "--resume" in res.stderr and "--overwrite" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"  # nothing was touched
    res = _train(store, out, "train.steps=1", "--overwrite")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][-1].startswith(
        '{"step": 1')


def test_resume_from_another_runs_checkpoint_is_refused_naming_both_sides(store, tmp_path):
    out = tmp_path / "run"
    assert _train(store, out, "train.steps=2", "train.checkpoint_every=1").returncode == 0
    res = _train(store, out, "train.steps=4", "train.lr=0.01", "--resume")
    assert res.returncode == 1
    assert "is of another run" in res.stderr and "train.lr: checkpoint 0.003, this run 0.01" in res.stderr, res.stderr
    assert "--init-from" in res.stderr
    res = _train(store, out, "train.steps=4", "--resume", "--domain", "2")  # refused before ranks start, too
    assert res.returncode == 0, res.stderr
    res = _train(store, out, "train.steps=5", "model.dim=16", "--resume", "--domain", "2")
    assert res.returncode == 1 and "model.dim: checkpoint 8, this run 16" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_init_from_starts_a_new_run_from_another_runs_weights(store, tmp_path):
    from domainflow.train import checkpoint as ckpt

    assert _train(store, tmp_path / "a", "train.steps=2").returncode == 0
    source = tmp_path / "a" / "checkpoints"
    res = _train(store, tmp_path / "b", "train.steps=1", "train.lr=1e-300", "train.warmup=0",
                 "--init-from", source)
    assert res.returncode == 0, res.stderr
    meta = ckpt.meta(ckpt.latest(tmp_path / "b" / "checkpoints"))
    assert meta["step"] == 1 and meta["normalization"] == ckpt.meta(ckpt.latest(source))["normalization"]

    def weights(folder):
        model = torch.nn.Module()
        from domainflow.train.config import from_dict
        from domainflow.train.data import build_dataset
        from domainflow.train.build import build_model
        from sharded_check import get_mesh

        cfg = from_dict(ckpt.meta(ckpt.latest(folder))["config"])
        model = build_model(cfg, build_dataset(cfg, get_mesh((1, 1), ("dp", "domain")), "train", shuffle=False))
        ckpt.load(folder, model)
        return {k: v.clone() for k, v in model.state_dict().items()}

    a, b = weights(source), weights(tmp_path / "b" / "checkpoints")
    for k in a:  # lr 1e-300: the one step kept the weights it started from
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    res = _train(store, tmp_path / "c", "train.steps=1", "--init-from", tmp_path / "nowhere")
    assert res.returncode == 1 and "--init-from" in res.stderr and "no checkpoint there" in res.stderr


def test_a_second_training_into_a_folder_in_use_is_refused(store, tmp_path):
    out = tmp_path / "busy"
    first = subprocess.Popen([sys.executable, "-m", "domainflow.app.cli", "train", f"data.store={store}",
                              *MESH_OVERRIDES, "output.plots=false", "train.steps=100000", "--out", str(out)],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = out / ".domainflow-train.lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().startswith("pid")):
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first training never took its folder"
            time.sleep(0.1)
        for extra in ((), ("--resume",), ("--overwrite",), ("--domain", "2")):
            res = _train(store, out, "train.steps=1", *extra)
            assert res.returncode == 1, res.stderr
            assert f"output.dir {out} is in use by another training (pid {first.pid} on host" in res.stderr, res.stderr
        assert first.poll() is None  # the first one goes on
    finally:
        first.kill()
        first.wait()
    res = _train(store, tmp_path / "busy", "train.steps=1", "--overwrite")  # the lock died with its process
    assert res.returncode == 0, res.stderr


def test_a_refused_overwrite_leaves_the_old_run_whole(store, tmp_path):
    out = tmp_path / "run"
    assert _train(store, out, "train.steps=1").returncode == 0
    before = sorted(p.name for p in out.rglob("*"))
    res = _train(store, out, "train.steps=1", "data.fields=Cp,Cff", "--overwrite")  # a typo: refused
    assert res.returncode == 1 and "Cff" in res.stderr, res.stderr
    res = _train(store, out, "train.steps=1", "--overwrite", "--init-from", out / "checkpoints")
    assert res.returncode == 1 and "lies in the output folder" in res.stderr and "--overwrite replaces" in res.stderr
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing was removed


def test_init_from_refuses_a_model_or_channels_that_do_not_fit(store, tmp_path):
    source = tmp_path / "a" / "checkpoints"
    assert _train(store, tmp_path / "a", "train.steps=1").returncode == 0
    for extra, said in ((["data.fields=Cf,Cp"], "data.fields: checkpoint ['Cp', 'Cf'], this run ['Cf', 'Cp']"),
                        (["model.dim=16"], "model.dim: checkpoint 8, this run 16")):
        for ranks in ([], ["--domain", "2"]):
            res = _train(store, tmp_path / "b", "train.steps=1", *extra, *ranks, "--init-from", source)
            assert res.returncode == 1, res.stderr
            assert "its model or channels do not fit this run" in res.stderr and said in res.stderr, res.stderr
            assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_resume_after_reingesting_the_same_data_but_not_other_data(cars_raw, store, tmp_path):
    """Other parts sum the statistics in another order (the last bits change): the same data, resumed. Another
    split is other training data: refused, naming the statistics that differ."""
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml

    out = tmp_path / "run"
    assert _train(store, out, "train.steps=1", "train.checkpoint_every=1").returncode == 0
    opts = dict(locations=("surface",), progress=False)
    ingest_drivaerml(cars_raw, tmp_path / "parts2.zarr", MeshOptions(parts=2, split=(0.75, 0.25, 0.0), **opts))
    ingest_drivaerml(cars_raw, tmp_path / "other.zarr", MeshOptions(parts=4, split=(0.5, 0.5, 0.0), **opts))
    res = _train(tmp_path / "other.zarr", out, "train.steps=2", "--resume")
    assert res.returncode == 1 and "is of another run" in res.stderr, res.stderr
    assert "training data surface/" in res.stderr and "mean: checkpoint [" in res.stderr, res.stderr
    res = _train(tmp_path / "parts2.zarr", out, "train.steps=2", "--resume")
    assert res.returncode == 0, res.stderr
