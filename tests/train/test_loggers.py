"""``output.loggers``: TensorBoard and MLflow get the training records, evaluation and figures of rank 0, read
back with their own readers (TensorBoard's event accumulator, ``mlflow.search_runs``); a resumed run goes on
without duplicate steps; a logger whose package is missing is one line naming the extra."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("tensorboard")
mlflow = pytest.importorskip("mlflow")

from domainflow.train.config import ConfigError  # noqa: E402

from cli_runner import run_cli  # noqa: E402


def _train(store, out, steps, *extra):
    r = run_cli("train", "--out", out, f"data.store={store}",
                "data.kind=grid", "model.name=unet", "model.base=4", f"train.steps={steps}", "train.checkpoint_every=2",
                "output.progress=false", "output.loggers=jsonl,tensorboard,mlflow", "--domain", "2", *extra,
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_tensorboard_and_mlflow_hold_the_run_and_its_resumption(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from domainflow.preprocess.ingest_grid import ingest_climate
    from domainflow.preprocess.synth_climate import synth_climate

    synth_climate(tmp_path / "era5.zarr", grid=(8, 16), steps=30, seed=1, progress=False)
    ingest_climate(tmp_path / "era5.zarr", tmp_path / "g.zarr", progress=False, split=(0.6, 0.2, 0.2))
    out = tmp_path / "run"
    printed = _train(tmp_path / "g.zarr", out, 3)
    assert "lead  metric" in printed and "tensorboard/, mlruns/" in printed and "{" not in printed  # a table
    _train(tmp_path / "g.zarr", out, 5, "--resume")
    losses = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5]

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]  # the resumed run purged nothing it kept, doubled nothing
    assert [e.value for e in loss] == pytest.approx([losses[s] for s in range(1, 6)], rel=1e-6)
    assert {"train/lr", "train/data_wait_s", "train/memory_mib", "eval/model/rmse_t2m",
            "eval/persistence/acc_t2m"} <= set(scalars)
    assert "figures/loss" in events.Tags()["images"]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
    runs = mlflow.search_runs(experiment_names=["domainflow"])
    assert len(runs) == 1  # the resumed run continued the first one
    run_id = runs["run_id"][0]
    assert runs["params.model.base"][0] == "4" and runs["params.train.steps"][0] == "3"
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    assert "eval/model/rmse_t2m" in runs.columns.str.replace("metrics.", "", regex=False)
    artifacts = [a.path for a in mlflow.tracking.MlflowClient().list_artifacts(run_id, "figures")]
    assert "figures/loss.png" in artifacts


def test_a_missing_or_unknown_logger_is_named(monkeypatch):
    from domainflow.train.loggers import check_available

    with pytest.raises(ConfigError, match=r"output.loggers \['wandb'\] are not loggers"):
        check_available(["jsonl", "wandb"])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"needs the tensorboard package: pip install 'domainflow\[tensorboard\]'"):
        check_available(["tensorboard"])
