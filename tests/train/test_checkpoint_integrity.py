"""Checkpoints are verified before they count, with real processes: two torchrun agents writing to per-node
folders fail at the first save on every rank and publish no ``latest``; one shared folder publishes and
resumes; a corrupt latest checkpoint is named (what is wrong, where) and ``--resume`` falls back to the
previous one, ending with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_train import MESH_OVERRIDES

ENV = {**{k: v for k, v in os.environ.items()
          if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
       "OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"}
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def store(cars_store):
    return cars_store


def _train_args(store, out, extra=()):
    return ["-m", "domainflow.app.cli", "train", f"data.store={store}", *MESH_OVERRIDES, *extra, "--domain", "2",
            "--out", str(out)]


def _finish(procs) -> list[tuple[int, str]]:
    """(exit code, output) of each process; one still running at the deadline is stopped (SIGTERM lets a
    torchrun agent stop its workers, which run in their own sessions), so a test never hangs."""
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return results


def _cli(store, out, extra=()) -> tuple[int, str]:
    """``domainflow train ... --domain 2``: two local ranks started by the command (run in this process)."""
    from cli_runner import run_cli

    r = run_cli(*_train_args(store, out, extra)[2:], env={"OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"})
    return r.returncode, r.stdout + r.stderr


def _two_nodes(store, outs, extra=()) -> list[tuple[int, str]]:
    """Two torchrun agents on this host as two one-rank "nodes" of one job, node n writing to ``outs[n]``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "1", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *_train_args(store, out, extra)],
                              env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for n, out in enumerate(outs)]
    return _finish(procs)


def _losses(out: Path) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def _assert_same_losses(got, want):
    assert [s for s, _ in got] == [s for s, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-10)


@pytest.fixture(scope="module")
def trained(store, tmp_path_factory):
    """3 steps on 2 local ranks with a checkpoint after each: the reference for the tests that resume."""
    out = tmp_path_factory.mktemp("trained") / "run"
    rc, log = _cli(store, out, ["train.steps=3", "train.checkpoint_every=1"])
    assert rc == 0, log[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003"
    return out


def test_per_node_checkpoint_folders_fail_at_the_first_save_on_every_node(store, tmp_path):
    outs = [tmp_path / "node0", tmp_path / "node1"]
    results = _two_nodes(store, outs, ["train.steps=2", "train.checkpoint_every=1"])
    ckpt_dir = str(outs[0] / "checkpoints")
    for n, (rc, log) in enumerate(results):
        assert rc != 0, f"node {n} exited 0:\n{log[-3000:]}"
        assert "checkpoint step 1 was not published" in log and "every node" in log, log[-3000:]
        assert f"the checkpoint directory {ckpt_dir} must be on storage" in log, log[-3000:]
        assert "rank 0" in log and "__1_0.distcp is missing" in log and "rank 1" in log, log[-3000:]
        assert ".metadata is missing" in log, log[-3000:]
    for out in outs:
        assert not (out / "checkpoints" / "latest").exists()
        assert not list((out / "checkpoints").glob("step_*"))


def test_a_shared_checkpoint_folder_publishes_latest_and_resumes(store, trained, tmp_path):
    out = tmp_path / "shared"
    for rc, log in _two_nodes(store, [out, out], ["train.steps=2", "train.checkpoint_every=1"]):
        assert rc == 0, log[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert {p.name for p in (ckpts / "step_00000002").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    from domainflow.train import checkpoint as ckpt

    assert ckpt.problems(ckpts / "step_00000002") == []
    # what two nodes published resumes (here on one node's two ranks: the same two shards, read the same way)
    rc, log = _cli(store, out, ["train.steps=3", "train.checkpoint_every=1", "--resume"])
    assert rc == 0, log[-3000:]
    assert (ckpts / "latest").read_text() == "step_00000003"
    _assert_same_losses(_losses(out), _losses(trained))


def _corrupt(ckpt: Path, how: str) -> str:
    """Damage the checkpoint folder ``ckpt``; the words the error must use for it."""
    data = ckpt / "__1_0.distcp"
    if how == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        return r"__1_0\.distcp is truncated \(\d+ of \d+ bytes\)"
    if how == "delete":
        data.unlink()
        return r"__1_0\.distcp is missing"
    if how == "zero":  # full size, so only its checksum finds it
        data.write_bytes(bytes(data.stat().st_size))
        return r"__1_0\.distcp does not match its SHA-256 in manifest\.json"
    if how == "no .metadata":
        (ckpt / ".metadata").unlink()
        return r"\.metadata is missing"
    if how == "garbled .metadata":  # caught by the manifest's sizes before it is unpickled
        (ckpt / ".metadata").write_bytes(b"not a pickle")
        return r"\.metadata is truncated \(12 of \d+ bytes\)"
    if how == "garbled .metadata, no manifest":  # a checkpoint saved before manifests: unpickling finds it
        (ckpt / "manifest.json").unlink()
        (ckpt / ".metadata").write_bytes(b"not a pickle")
        return r"\.metadata is unreadable"
    (ckpt / "meta.json").write_text('{"step": 3, "conf')
    return r"meta\.json is unreadable"


@pytest.mark.parametrize("how", ["truncate", "delete", "zero"])
def test_resume_skips_a_corrupt_latest_checkpoint_with_a_warning(store, trained, tmp_path, how):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpts = out / "checkpoints"
    why = _corrupt(ckpts / "step_00000003", how)
    rc, log = _cli(store, out, ["train.steps=3", "train.checkpoint_every=1", "--resume"])
    assert rc == 0, log[-3000:]
    assert re.search(rf"checkpoint {re.escape(str(ckpts / 'step_00000003'))} is corrupt or unreadable \(.*{why}.*\); "
                     rf"resuming from {re.escape(str(ckpts / 'step_00000002'))} \(step 2\) instead", log), log[-3000:]
    _assert_same_losses(_losses(out), _losses(trained))
    from domainflow.train import checkpoint as ckpt

    assert ckpt.latest(ckpts) == ckpts / "step_00000003" and not ckpt.problems(ckpts / "step_00000003")


@pytest.mark.parametrize("how", ["truncate", "delete", "no .metadata", "garbled .metadata",
                                 "garbled .metadata, no manifest", "garbled meta.json"])
def test_latest_and_load_name_the_corrupt_checkpoint_and_why(trained, tmp_path, how):
    """In this process, without a process group: the checks happen before DCP reads anything."""
    from domainflow.train import checkpoint as ckpt

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(trained / "checkpoints", ckpts)
    bad = ckpts / "step_00000003"
    why = _corrupt(bad, how)
    model = torch.nn.Linear(1, 1)
    older = re.escape(str(ckpts / "step_00000002"))
    with pytest.raises(ckpt.CheckpointError, match=rf"{re.escape(str(bad))} is corrupt: {why}.*newest older "
                                                   rf"complete checkpoint is {older}"):
        ckpt.latest(ckpts)
    for path in (ckpts, bad):
        with pytest.raises(ckpt.CheckpointError, match=rf"{re.escape(str(bad))} is corrupt or unreadable: rank 0 "
                                                       rf"\(.*\): {why}"):
            ckpt.load(path, model)


def test_resume_with_no_complete_checkpoint_lists_what_it_tried(trained, tmp_path):
    from domainflow.train import checkpoint as ckpt

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(trained / "checkpoints", ckpts)
    for step in (1, 2, 3):
        _corrupt(ckpts / f"step_{step:08d}", "delete")
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint under .* loads; tried: .*step_00000003 .*"
                                                   r"__1_0\.distcp is missing.*step_00000002 .*step_00000001 "):
        ckpt.load_newest_complete(ckpts, torch.nn.Linear(1, 1), None)
