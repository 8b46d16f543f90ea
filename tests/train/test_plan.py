"""`domainflow plan`: one measured training step at two small sizes, fitted and turned into the memory per rank
at every domain size and the smallest domain size within a budget; what it cannot plan is refused in one line.
(How close the plan comes to real runs is measured in benchmarks/train_scale.py, not here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from domainflow.train.plan import MemoryModel, fits, format_plan, largest_points, make_plan, rank_points

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
MODEL = ["model.dim=8", "model.layers=1", "model.heads=2", "model.slices=4"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from domainflow.preprocess.ingest_mesh import ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("plan")
    synth_drivaerml(root / "raw", runs=3, cells=3000, seed=1, volume_cells=200, volume_pieces=1, progress=False)
    ingest_drivaerml(root / "raw", root / "s.zarr", parts=8, progress=False, split=(0.67, 0.33, 0.0),
                     locations=("surface",))
    return root / "s.zarr"


def _plan(*args):
    cmd = [sys.executable, "-m", "domainflow.app.cli", "plan", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


def test_plan_prints_memory_per_rank_at_every_domain_size_and_the_smallest_that_fits(store, tmp_path):
    out = tmp_path / "plan.json"
    r = _plan(f"data.store={store}", *MODEL, "--points", "100000", "--memory", "400MiB", "--sizes", "512,1024,2048",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    model = MemoryModel(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan["model"].items()})
    assert model.sizes == (512, 1024, 2048) and model.per_point > 0 and model.fixed > 0
    # the measured peaks lie on the fitted line (one step's peak grows with the points), within 10%
    for n, peak in zip(model.sizes, model.peaks):
        assert abs(model.bytes_at(n) / peak - 1) < 0.1, (n, peak, model)
    rows = {row["domain"]: row for row in plan["rows"]}
    assert {1, 2, 4, 8, 16, 32, 64} <= set(rows)
    for w, row in rows.items():
        assert row["points_per_rank"] == (100000 // w if w <= 8 else -(-100000 // w))
        assert row["bytes_per_rank"] == pytest.approx(model.bytes_at(row["points_per_rank"]))
        assert row["fits_parts"] == (w <= 8)  # the store has 8 parts per run
    # 5, 6 or 7 ranks over 8 parts leave some rank 2 parts, as many points as at 4 ranks
    shares = {w: rank_points(100000, w, 8) if w <= 8 else -(-100000 // w) for w in range(1, 65)}
    assert shares[5] == shares[7] == shares[4] == 25000
    smallest = next((w for w in range(1, 65) if fits(model, shares[w], 400 * 2**20)), None)
    assert plan["smallest_domain"] == smallest
    text = r.stdout
    assert "per point" in text and "smallest domain size within 400 MiB per rank" in text
    assert "re-ingest with --parts >= 16" in text  # domain sizes beyond the store's parts are flagged
    # data.sample_points caps the points a step trains on, whatever the sample's size
    r = _plan(f"data.store={store}", *MODEL, "data.sample_points=5000", "--points", "100000", "--sizes", "512,1024",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["points"] == 5000 and "data.sample_points = 5000" in r.stdout


def test_what_cannot_be_planned_is_one_line(store, tmp_path):
    r = _plan(f"data.store={store}", *MODEL, "--sizes", "4000,8000")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "the smallest training run" in lines[0] and "pass smaller --sizes" in lines[0]
    r = _plan(f"data.store={store}", "data.kind=grid", "model.name=unet")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "mesh sample" in lines[0], r.stderr
    r = _plan(f"data.store={tmp_path / 'none.zarr'}", *MODEL)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "none.zarr" in lines[0], r.stderr


def test_rank_points_is_the_largest_share_of_the_parts_a_rank_reads():
    # rank r reads parts [r*P//W, (r+1)*P//W): with 8 parts over 3 ranks they get 2, 3 and 3 parts
    assert rank_points(800, 3, 8) == 300
    assert rank_points(800, 1, 8) == 800 and rank_points(800, 8, 8) == 100
    assert rank_points(801, 2, 8) == 401  # rounded up: the share of a part is never less than its points


def test_smallest_domain_and_largest_sample_follow_the_headroom():
    m = MemoryModel(fixed=100 * 2**20, per_point=1000.0, sizes=(1, 2), peaks=(0, 0), parts=64)
    plan = make_plan(m, 1_000_000, memory=600 * 2**20, max_domain=64)
    # 1M points: W=2 holds 500k points = 100 MiB + 477 MiB = 577 MiB, over 600 MiB / 1.1; W=3 holds 22 of
    # the 64 parts, 343,750 points = 428 MiB, which fits
    assert plan.smallest == 3
    assert make_plan(m, 1_000_000, memory=600 * 2**20, headroom=0.0).smallest == 2
    for w, n in plan.largest:
        assert fits(m, rank_points(n, w, 64), 600 * 2**20) and not fits(m, rank_points(n + w, w, 64), 600 * 2**20)
    assert largest_points(m, 100 * 2**20, 4) == 0  # the fixed part alone does not fit
    text = format_plan(make_plan(m, 1_000_000, memory=2**20), _cfg(), 1_000_000)
    assert "no domain size up to 64 fits 1 MiB per rank" in text and "the fixed part alone" in text


def _cfg():
    from domainflow.train.config import load_config

    return load_config(None, ["data.store=x.zarr"])
