"""The demo and the local launcher: rank results come back, empty shards train like an independent
reference, the demo command line end to end and its report for any step count."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import domainflow as df
from domainflow import Shard, ShardTensor

D = torch.float64


TOL = 1e-10


# =================================================================================================
# 5. the demo and the local launcher
# =================================================================================================
def _launch_tiny(k):
    mesh = df.init_mesh((int(os.environ["WORLD_SIZE"]),), ("domain",))
    r = mesh.get_rank()
    x = ShardTensor.from_local(torch.full((r + 1,), float(r + k), dtype=D), mesh, [Shard(0)])
    return {"rank": r, "env_rank": os.environ.get("RANK"), "full": x.full_tensor().tolist(),
            "sizes": list(x.spec.sizes[0])}


def _preempted(signum, frame):
    """A job's own SIGTERM handler (a scheduler's preemption notice), set before a launch."""


def test_launch_local_returns_rank_results():
    """Rank results come back, and this process's signal handlers are its own again: torch's elastic agent
    leaves its handlers, which raise, behind (in a later ingest's workers they kept a worker alive that hung
    the ingest's end)."""
    from domainflow.launch import launch_local

    old = os.environ.get("OMP_NUM_THREADS")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _preempted)
    try:
        res = launch_local(_launch_tiny, 2, 10)
        assert signal.getsignal(signal.SIGTERM) is _preempted
        assert signal.getsignal(signal.SIGINT) is handlers[signal.SIGINT]
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    assert sorted(res) == [0, 1]
    for r in (0, 1):
        assert res[r]["rank"] == r and res[r]["env_rank"] == str(r)
        assert res[r]["full"] == [10.0, 11.0, 11.0]
        assert res[r]["sizes"] == [1, 2]


def _what_a_rank_sees(name):
    import sys

    print(f"printed by rank {os.environ.get('RANK')}", flush=True)
    return {"value": os.environ.get(name), "gone": os.environ.get("DOMAINFLOW_TEST_GONE"), "path": sys.path[0],
            "threads": torch.get_num_threads(), "rank": os.environ.get("RANK")}


def test_a_forked_rank_sees_the_environment_and_path_of_its_own_launch(monkeypatch, tmp_path, capfd):
    """The fork server outlives a launch; the next launch's ranks still get that launch's environment, sys.path,
    thread count and stdout (not the server's, fixed at its start), and the agent's own RANK."""
    from domainflow.launch import launch_local

    monkeypatch.setenv("DOMAINFLOW_TEST_GONE", "old")
    launch_local(_what_a_rank_sees, 1, "DOMAINFLOW_TEST_MARK")  # starts the server (if none runs yet)
    monkeypatch.setenv("DOMAINFLOW_TEST_MARK", "second launch")
    monkeypatch.delenv("DOMAINFLOW_TEST_GONE")
    monkeypatch.syspath_prepend(str(tmp_path))
    capfd.readouterr()
    res = launch_local(_what_a_rank_sees, 2, "DOMAINFLOW_TEST_MARK", threads_per_rank=1)
    printed = capfd.readouterr().out
    assert "printed by rank 0" in printed and "printed by rank 1" in printed, printed
    for r in (0, 1):
        assert res[r] == {"value": "second launch", "gone": None, "path": str(tmp_path), "threads": 1,
                          "rank": str(r)}


def _library_settings():
    import fsspec.config
    import zarr

    from domainflow.layout.mesh import default_timeout_s

    return {"s3": fsspec.config.conf.get("s3", {}).get("endpoint_url"), "zarr": zarr.config.get("async.concurrency"),
            "timeout": default_timeout_s()}


def test_settings_libraries_read_at_import_come_from_the_ranks_own_launch():
    """The fork server imported fsspec, zarr and domainflow when it started: their settings from the environment
    (an S3 endpoint, zarr's config, the collective timeout) are this launch's, given for the ranks only."""
    from domainflow.launch import launch_local

    launch_local(_library_settings, 1, preload=("zarr", "domainflow.layout.mesh"))  # starts a server if none runs
    res = launch_local(_library_settings, 2, env={"FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9",
                                                  "ZARR_ASYNC__CONCURRENCY": "7", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "12"})
    for r in (0, 1):
        assert res[r] == {"s3": "http://127.0.0.1:9", "zarr": 7, "timeout": 12.0}


def test_variables_read_at_a_process_start_need_spawned_ranks():
    from domainflow.launch import launch_local

    with pytest.raises(ValueError, match=r"MALLOC_ARENA_MAX are read when a process starts.*start_method='spawn'"):
        launch_local(_what_a_rank_sees, 1, "X", env={"MALLOC_ARENA_MAX": "2"})


def _demo_in_pool(tmp):
    from domainflow.app.selfcheck import rank_main

    return rank_main(60, 3, 3e-3, 1.0, tmp)           # split 1.0: every point on rank 0, others empty


def test_demo_rank_main_with_empty_shards_matches_independent_reference(dist, tmp_path):
    from domainflow.app.selfcheck import PointNet, sphere_cloud

    res = dist.run(3, _demo_in_pool, str(tmp_path))
    r0 = res[0]
    assert r0["sizes"] == [60, 0, 0] and [r["local_points"] for r in res] == [60, 0, 0]
    # independent reference: same seed, same model, plain Adam on the full cloud in this process
    torch.manual_seed(0)
    model = PointNet().double()
    x, y = sphere_cloud(60)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert max(abs(a - b) for a, b in zip(r0["losses"], want)) < TOL
    assert r0["max_param_diff"] < TOL
    saved = json.loads((tmp_path / "demo_results.json").read_text())
    assert saved["losses"] == r0["losses"]


def test_demo_cli_end_to_end(tmp_path, capsys):
    from domainflow.app.cli import main

    old = os.environ.get("OMP_NUM_THREADS")
    try:
        rc = main(["selfcheck", "--points", "80", "--steps", "3", "--out", str(tmp_path)])
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out
    saved = json.loads((tmp_path / "demo_results.json").read_text())
    assert saved["sizes"] == [50, 30] and saved["max_param_diff"] < TOL


def _fake_result(steps, diff=0.0):
    losses = [1.0 / (k + 1) for k in range(steps)]
    return {"losses": losses, "ref_losses": [v + diff for v in losses], "max_param_diff": diff,
            "sizes": [6, 4], "world": 2, "rel_l2_cp": 0.5, "rel_l2_mean_baseline": 0.8,
            "comm_bytes_per_step": {"all_reduce": 8.0}, "seconds_sharded": 0.1, "seconds_single": 0.1}


@pytest.mark.parametrize("steps", [1, 2, 3, 10])
def test_demo_report_any_step_count(steps, tmp_path, capsys):
    # Regression test (bug found in review, now fixed): `domainflow demo --steps 1` (or 2) trains, then crashes in
    # demo.report: it prints rows for steps sorted({0, 1, 2, n // 2, n - 1}) without clipping to
    # n, so losses[1] / losses[2] raise IndexError: list index out of range.
    from domainflow.app.selfcheck import report

    assert report(_fake_result(steps), str(tmp_path)) == 0
    assert "PASS" in capsys.readouterr().out
    assert report(_fake_result(steps, diff=1e-6), str(tmp_path)) == 1
