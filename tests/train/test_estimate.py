"""`domainflow estimate`: one measured training step at two small sizes, fitted and turned into the memory per
rank at every domain size and the smallest domain size within a budget; what it cannot estimate is refused in one
line; `domainflow estimate`, its name before issue 36, still runs it. (How close the estimate comes to real runs is
measured in benchmarks/train_scale.py, not here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from domainflow.train.estimate import (Line, MemoryModel, fits, format_estimate, largest_points, make_estimate, parts_for,
                                      rank_points, row)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
MODEL = ["model.dim=8", "model.layers=1", "model.heads=2", "model.slices=4"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from domainflow.preprocess.ingest_mesh import ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("estimate")
    synth_drivaerml(root / "raw", runs=3, cells=3000, seed=1, volume_cells=200, volume_pieces=1, progress=False)
    ingest_drivaerml(root / "raw", root / "s.zarr", parts=8, progress=False, split=(0.67, 0.33, 0.0),
                     locations=("surface",))
    return root / "s.zarr"


def _estimate(*args):
    cmd = [sys.executable, "-m", "domainflow.app.cli", "estimate", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


def _estimate_here(*args, command="estimate"):
    from cli_runner import run_cli

    return run_cli(command, *args)


def test_estimate_prints_memory_per_rank_at_every_domain_size_and_the_smallest_that_fits(store, tmp_path):
    """One real ``domainflow estimate`` process (with block inference: measured once more in blocks, and the rows
    estimate each rank's share of a block), then data.sample_points in this process."""
    out = tmp_path / "estimate.json"
    r = _estimate(f"data.store={store}", *MODEL, "eval.block_points=20000", "--points", "100000", "--memory", "600MiB",
                  "--sizes", "512,1024,2048", "--json", str(out))
    assert r.returncode == 0, r.stderr
    estimate = json.loads(out.read_text())
    m = estimate["model"]
    assert m["block_points"] == 20000 and m["blocked_peak"] > 0 and 0 <= m["eval_resident"] <= m["eval"]["per_point"]
    model = MemoryModel(train=Line(**m["train"]), eval=Line(**m["eval"]), parts=m["parts"], block_points=20000,
                        eval_resident=m["eval_resident"])
    assert m["sizes"] == [512, 1024, 2048] and model.parts == 8
    assert model.train.per_point > 0 and model.eval.per_point > 0
    # the measured peaks lie on the fitted lines (each grows with the points), within 10%
    for n, tp, ep in zip(m["sizes"], m["train_peaks"], m["eval_peaks"]):
        assert abs(model.train.bytes_at(n) / tp - 1) < 0.1 and abs(model.eval.bytes_at(n) / ep - 1) < 0.1
    rows = {row_["domain"]: row_ for row_ in estimate["rows"]}
    assert {1, 2, 4, 8, 16, 32, 64} <= set(rows)
    for w, row_ in rows.items():
        # beyond the store's 8 parts the estimate assumes the re-ingest it asks for: 8 parts per rank
        parts = 8 if w <= 8 else max(64, 8 * w)
        assert row_["parts"] == parts and row_["eval_points"] == row_["train_points"] == rank_points(100000, w, parts)
        assert row_["eval_bytes"] == pytest.approx(model.eval_bytes(row_["eval_points"], 100000))
        assert row_["bytes"] == pytest.approx(max(model.train.bytes_at(row_["train_points"]),
                                                  model.eval_bytes(row_["eval_points"], 100000)))
    # 5, 6 or 7 ranks over 8 parts leave some rank 2 parts, as many points as at 4 ranks
    assert rank_points(100000, 5, 8) == rank_points(100000, 7, 8) == rank_points(100000, 4, 8) == 25000
    smallest = next((w for w in range(1, 65) if fits(row(model, 100000, 100000, w), 600 * 2**20)), None)
    assert estimate["smallest_domain"] == smallest
    text = r.stdout
    assert "per point" in text and "smallest domain size within 600 MiB per rank" in text
    assert "re-ingest with --parts 128: the store has 8" in text  # domain sizes beyond the store's parts
    assert "over the domain) of which" in text
    # data.sample_points caps the points a training step takes; evaluation still sees the whole sample
    r = _estimate_here(f"data.store={store}", *MODEL, "data.sample_points=5000", "--points", "100000", "--sizes",
                       "512,1024", "--memory", "200MiB", "--json", str(out))
    assert r.returncode == 0, r.stderr
    estimate = json.loads(out.read_text())
    assert estimate["points"] == 100000 and estimate["step_points"] == 5000 and "5,000 per training step" in r.stdout
    assert estimate["rows"][0]["train_points"] == 5000 and estimate["rows"][0]["eval_points"] == 100000
    m = estimate["model"]  # without block inference: each row is the larger of its step's and its evaluation's peak
    model = MemoryModel(train=Line(**m["train"]), eval=Line(**m["eval"]), parts=m["parts"])
    for row_ in estimate["rows"]:
        assert row_["bytes"] == pytest.approx(max(model.train.bytes_at(row_["train_points"]),
                                                  model.eval.bytes_at(row_["eval_points"])))
    assert estimate["smallest_domain"] == next(
        (w for w in range(1, 65) if fits(row(model, 100000, 5000, w), 200 * 2**20)), None)


def test_block_inference_estimates_the_resident_points_and_one_block_of_the_ranks_share():
    m = MemoryModel(train=Line(1e8, 1000.0), eval=Line(1e8, 500.0), parts=64, block_points=1_000_000,
                    eval_resident=100.0)
    # 4M points at domain 1: 4 blocks of 1M; 100 B stay for all 4M points, the other 400 B for one block
    assert m.eval_bytes(4_000_000, 4_000_000) == pytest.approx(1e8 + 100 * 4e6 + 400 * 1e6)
    # domain 2: each rank holds 2M and cuts it into the same 4 blocks, of 500k
    assert m.eval_bytes(2_000_000, 4_000_000) == pytest.approx(1e8 + 100 * 2e6 + 400 * 5e5)
    # a sample within one block: the whole share at once, as without blocks
    assert m.eval_bytes(300_000, 600_000) == pytest.approx(m.eval.bytes_at(300_000))
    assert row(m, 4_000_000, 4_000_000, 2).eval_bytes == pytest.approx(m.eval_bytes(2_000_000, 4_000_000))
    m.block_points = 0
    assert m.eval_bytes(2_000_000, 4_000_000) == m.eval.bytes_at(2_000_000)


def test_the_largest_sample_with_block_inference_looks_past_the_step_where_a_block_begins():
    """The evaluation's memory drops where one more block begins (2^20 + 1 points here): 2^20 points do not
    fit, 2^20 + 1 and up to ~1.6M do; a search that assumed memory grows with the sample stopped at 825k."""
    m = MemoryModel(train=Line(350e6, 10.0), eval=Line(350e6, 2000.0), parts=64, block_points=1 << 20,
                    eval_resident=350.0)
    memory = 2.4e9
    assert not fits(row(m, 1 << 20, 1 << 20, 1), memory, 0.0) and fits(row(m, (1 << 20) + 1, (1 << 20) + 1, 1),
                                                                          memory, 0.0)
    n = largest_points(m, memory, 1, headroom=0.0)
    assert fits(row(m, n, n, 1), memory, 0.0) and not fits(row(m, n + 1, n + 1, 1), memory, 0.0)
    assert n > 1_400_000
    # every larger size fails (checked on a grid beyond it)
    assert not any(fits(row(m, k, k, 1), memory, 0.0) for k in range(n + 1, 8 * n, 9973))
    # without blocks the answer is where the line meets the memory
    m.block_points = 0
    n = largest_points(m, memory, 1, headroom=0.0)
    assert fits(row(m, n, n, 1), memory, 0.0) and not fits(row(m, n + 1, n + 1, 1), memory, 0.0)


def test_what_cannot_be_estimated_is_one_line(store, tmp_path):
    """Each refused before anything is measured: in this process."""
    r = _estimate_here(f"data.store={store}", *MODEL, "--sizes", "4000,8000")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "the smallest training run" in lines[0] and "pass smaller --sizes" in lines[0]
    r = _estimate_here(f"data.store={store}", "data.kind=grid", "model.name=unet")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "mesh sample" in lines[0], r.stderr
    r = _estimate_here(f"data.store={tmp_path / 'none.zarr'}", *MODEL)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "none.zarr" in lines[0], r.stderr
    for bad, msg in ((["--headroom", "-1"], "--headroom is a fraction"), (["--max-domain", "0"], "--max-domain must"),
                     (["--points", "0"], "--points must")):
        r = _estimate_here(f"data.store={store}", *MODEL, *bad)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 1 and len(lines) == 1 and msg in lines[0], r.stderr


def test_plan_is_a_hidden_alias_of_estimate(store):
    """``domainflow plan`` (the name before issue 36) runs the same command, and the help lists only estimate."""
    from cli_runner import run_cli

    for command in ("estimate", "plan"):
        r = _estimate_here(f"data.store={store}", *MODEL, "--sizes", "4000,8000", command=command)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 1 and len(lines) == 1 and "the estimate measures samples of 8000 points" in lines[0], \
            r.stderr
    usage = run_cli("--help").stdout
    assert "estimate" in usage and "plan" not in usage, usage
    assert "--memory" in run_cli("plan", "--help").stdout


def test_rank_points_is_the_largest_share_of_the_parts_a_rank_reads():
    # rank r reads parts [r*P//W, (r+1)*P//W): with 8 parts over 3 ranks they get 2, 3 and 3 parts
    assert rank_points(800, 3, 8) == 300
    assert rank_points(800, 1, 8) == 800 and rank_points(800, 8, 8) == 100
    assert rank_points(801, 2, 8) == 401  # rounded up: the share of a part is never less than its points
    assert parts_for(8, 8) == 8 and parts_for(9, 8) == 128 and parts_for(3, 64) == 64 and parts_for(100, 64) == 1024


def test_smallest_domain_and_largest_sample_follow_the_headroom_and_the_evaluation():
    m = MemoryModel(train=Line(100 * 2**20, 1000.0), eval=Line(100 * 2**20, 100.0), parts=64)
    estimate = make_estimate(m, 1_000_000, memory=600 * 2**20, max_domain=64, headroom=0.1)
    # 1M points: W=2 holds 500k points = 100 MiB + 477 MiB = 577 MiB, over 600 MiB / 1.1; W=3 holds 22 of
    # the 64 parts, 343,750 points = 428 MiB, which fits
    assert estimate.smallest == 3
    assert make_estimate(m, 1_000_000, memory=600 * 2**20, headroom=0.0).smallest == 2
    for r in estimate.rows:
        n = r.largest
        assert fits(row(m, n, n, r.domain), 600 * 2**20, 0.1) and not fits(row(m, n + 1, n + 1, r.domain), 600 * 2**20, 0.1)
    # training on 10k points per step: the evaluation of the whole sample decides, at 100 B per point
    sampled = make_estimate(m, 10_000_000, sample_points=10_000, memory=600 * 2**20, headroom=0.1)
    assert sampled.rows[0].train_points == 10_000 and sampled.rows[0].eval_points == 10_000_000
    assert sampled.rows[0].bytes == sampled.rows[0].eval_bytes and sampled.smallest == 3
    assert largest_points(m, 600 * 2**20, 1, 10_000, 0.1) > largest_points(m, 600 * 2**20, 1, 0, 0.1)
    assert largest_points(m, 100 * 2**20, 4) == 0  # the fixed part alone does not fit
    text = format_estimate(make_estimate(m, 1_000_000, memory=2**20), _cfg())
    assert "no domain size up to 64 fits 1 MiB per rank" in text and "the fixed part alone" in text


def _cfg():
    from domainflow.train.config import load_config

    return load_config(None, ["data.store=x.zarr"])
