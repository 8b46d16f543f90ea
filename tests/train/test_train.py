"""domainflow.train end to end on small stores: sharded training equals one process (Transolver on a
surface, UNet on a grid), dp x domain equals dp on the same samples, resume equals an uninterrupted run,
checkpoints load across domain sizes, NaN losses stop cleanly, config errors name the key, the demo
runs, and predict writes a file pyvista reads back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dist_pool import rank_and_world
from sharded_check import get_mesh

MESH_OVERRIDES = ["model.dim=8", "model.layers=2", "model.heads=2", "model.slices=4", "train.dtype=float64",
                  "train.lr=3e-3", "train.warmup=1", "output.progress=false", "output.plots=false",
                  "data.prefetch=1"]
GRID_OVERRIDES = ["data.kind=grid", "model.name=unet", "model.base=4", "train.dtype=float64", "train.lr=3e-3",
                  "output.progress=false", "output.plots=false", "data.prefetch=0"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from domainflow.preprocess.ingest_grid import GridOptions, ingest_climate
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml
    from domainflow.preprocess.synth_climate import synth_climate
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("train")
    synth_drivaerml(root / "raw", runs=6, cells=700, seed=3, volume_cells=200, volume_pieces=1, progress=False)
    ingest_drivaerml(root / "raw", root / "cars.zarr",
                     MeshOptions(parts=8, locations=("surface",), progress=False, split=(0.67, 0.33, 0.0)))
    synth_climate(root / "era5.zarr", grid=(8, 16), steps=30, seed=1, progress=False)
    ingest_climate(root / "era5.zarr", root / "grid.zarr", GridOptions(progress=False, split=(0.6, 0.2, 0.2)))
    return {"mesh": str(root / "cars.zarr"), "grid": str(root / "grid.zarr"), "root": root}


def _config(kind, store, out, extra=()):
    from domainflow.train import load_config

    base = MESH_OVERRIDES if kind == "mesh" else GRID_OVERRIDES
    return load_config(None, [f"data.store={store}", f"output.dir={out}", *base, *extra])


def _train(kind, store, out, dp, domain, extra):
    """Train on a (dp, domain) mesh of this pool's ranks; parameters and per-step losses back."""
    from domainflow.train import Trainer

    cfg = _config(kind, store, out, [f"mesh.dp={dp}", f"mesh.domain={domain}", *extra])
    trainer = Trainer(cfg, mesh=get_mesh((dp, domain), ("dp", "domain")))
    res = trainer.fit()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return params, [h["loss"] for h in trainer.history], res.get("eval", {}).get("summary")


def _assert_same(a, b, tol):
    for k in a:
        err = float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1.0))
        assert err <= tol, f"parameter {k}: max rel difference {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("kind", ["mesh", "grid"])
@pytest.mark.parametrize("world", [2, 3])
def test_domain_parallel_training_equals_one_process(dist, stores, tmp_path, kind, world):
    # a grid is also scored on a two-step rollout (WeatherBench's RMSE and ACC of model, persistence, climatology)
    extra = ["train.steps=3", "train.eval_every=0"] + (["eval.lead_steps=1,2"] if kind == "grid" else [])
    ref, ref_losses, ref_eval = dist.run(1, _train, kind, stores[kind], str(tmp_path / "one"), 1, 1, extra)[0]
    for params, losses, summary in dist.run(world, _train, kind, stores[kind], str(tmp_path / "w"), 1, world, extra):
        _assert_same(params, ref, 1e-10)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        for key, value in ref_eval["model"].items():
            assert summary["model"][key] == pytest.approx(value, rel=1e-8, abs=1e-12), key
        for lead, forecasts in ref_eval.get("leads", {}).items():
            for name, scores in forecasts.items():
                for key, value in scores.items():
                    assert summary["leads"][lead][name][key] == pytest.approx(value, rel=1e-8, abs=1e-12), (lead, key)
    if kind == "grid":
        assert sorted(ref_eval["leads"]) == ["1", "2"] and ref_eval["samples"] >= 1
        assert all(abs(v) < 1e-12 for k, v in ref_eval["leads"]["2"]["climatology"].items() if k.startswith("acc_"))


@pytest.mark.parametrize("world", [2, 3])
def test_a_points_budget_trains_to_the_same_parameters_on_every_domain_size(dist, stores, tmp_path, world):
    """``data.sample_points``: every domain size draws the same points of each sample per step, so it trains
    to the one-process parameters; and the budget is applied (training on every point differs)."""
    extra = ["train.steps=3", "data.sample_points=150", "output.plots=false"]
    ref, ref_losses, _ = dist.run(1, _train, "mesh", stores["mesh"], str(tmp_path / "one"), 1, 1, extra)[0]
    whole, _, _ = dist.run(1, _train, "mesh", stores["mesh"], str(tmp_path / "all"), 1, 1, extra[:1])[0]
    assert max(float((whole[k] - ref[k]).abs().max()) for k in ref) > 1e-6
    for params, losses, _ in dist.run(world, _train, "mesh", stores["mesh"], str(tmp_path / "w"), 1, world, extra):
        _assert_same(params, ref, 1e-10)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)


def _evaluate_both(store, out):
    """Evaluation of one trained model, whole and in blocks of 5 points over the domain."""
    from domainflow.train import Trainer

    _, world = rank_and_world()
    trainer = Trainer(_config("mesh", store, out, ["train.steps=2", f"mesh.domain={world}"]),
                      mesh=get_mesh((1, world), ("dp", "domain")))
    trainer.fit()
    whole = trainer.evaluate()["summary"]
    trainer.cfg.eval.block_points = 5
    calls, blocks = [], trainer.model.forward_blocks
    def spy(x, *a, **k):  # rows per rank of each call, and the sample's largest rank and global size
        sizes = [int(s[1]) for s in x.sharding_shapes[0]] if world > 1 else [int(x.shape[1])]
        calls.append((k["block_points"], max(sizes), sum(sizes)))
        return blocks(x, *a, **k)
    trainer.model.forward_blocks = spy
    return whole, trainer.evaluate()["summary"], calls


def _first_steps_of_a_long_run(store, out):
    """The first steps of a run of 10**12 steps, read through the trainer's stream, and the same steps of a short
    run's schedule."""
    import itertools

    from domainflow.train import Trainer

    trainer = Trainer(_config("mesh", store, out, ["train.steps=1000000000000", "data.prefetch=2"]),
                      mesh=get_mesh((1, 1), ("dp", "domain")))
    stream = trainer._stream(0, trainer.cfg.train.steps)
    steps = [step for step, _, _ in itertools.islice(stream, 5)]
    stream.close()
    long = [e[:4] for e in itertools.islice(trainer._schedule(0, 10**12), 9)]
    return steps, long, [e[:4] for e in trainer._schedule(0, 9)]


def test_a_run_of_many_steps_starts_at_once(dist, stores, tmp_path):
    """The trainer's read schedule is made as it is read: before, a run of train.steps=100000 computed every step's
    entries (and an epoch order per step) before its first step, 3.6 s more here than a run of 2 steps; a run of
    10**12 steps never started."""
    steps, long, short = dist.run(1, _first_steps_of_a_long_run, stores["mesh"], str(tmp_path), timeout=120)[0]
    assert steps == [0, 1, 2, 3, 4]
    assert long == short and [e[0] for e in long] == list(range(9)), long
    assert len({e[2] for e in long[:4]}) == 4  # epoch 0: each of the store's 4 training runs once


@pytest.mark.parametrize("world", [1, 3])
def test_evaluation_in_blocks_of_points_equals_the_whole_forward(dist, stores, tmp_path, world):
    for whole, blocked, calls in dist.run(world, _evaluate_both, stores["mesh"], str(tmp_path)):
        # eval.block_points counts over the domain: each rank's block is its share of 5 points
        assert calls and all(rows == -(-most // -(-total // 5)) for rows, most, total in calls)
        assert world == 1 or all(rows < 5 for rows, _, _ in calls)
        for key, value in whole["model"].items():
            assert blocked["model"][key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


def test_dp_by_domain_equals_dp_on_the_same_samples(dist, stores, tmp_path):
    extra = ["train.steps=2", "train.batch=4"]
    four = dist.run(4, _train, "mesh", stores["mesh"], str(tmp_path / "dp4"), 4, 1, extra)
    two_by_two = dist.run(4, _train, "mesh", stores["mesh"], str(tmp_path / "dp2"), 2, 2, extra)
    for (p4, l4, _), (p22, l22, _) in zip(four, two_by_two):
        _assert_same(p22, p4, 1e-10)
        np.testing.assert_allclose(l22, l4, rtol=1e-10)


def _resume(kind, store, out, extra=()):
    """4 steps straight; 2 steps, stop, resume to 4: the same losses and parameters."""
    import torch.distributed as dist

    from domainflow.train import Trainer

    _, world = rank_and_world()
    straight = Trainer(_config(kind, store, out + "/straight", ["train.steps=4", f"mesh.domain={world}", *extra]),
                       mesh=get_mesh((1, world), ("dp", "domain")))
    straight.fit()
    cfg = _config(kind, store, out + "/split", ["train.steps=2", "train.checkpoint_every=1",
                                                 f"mesh.domain={world}", *extra])
    first = Trainer(cfg, mesh=get_mesh((1, world), ("dp", "domain")))
    first.fit()
    dist.barrier()
    cfg.train.steps = 4
    second = Trainer(cfg, mesh=get_mesh((1, world), ("dp", "domain")))
    second.fit(resume=True)
    return ([h["loss"] for h in straight.history], [h["loss"] for h in first.history + second.history],
            {k: v.clone() for k, v in straight.model.state_dict().items()},
            {k: v.clone() for k, v in second.model.state_dict().items()})


@pytest.mark.parametrize("world,extra", [(1, ()), (2, ()), (2, ("data.sample_points=150", "train.batch=2"))],
                         ids=["ws1", "ws2", "ws2-sample-points"])
def test_resume_continues_exactly(dist, stores, tmp_path, world, extra):
    """Also with a points budget: a resumed run draws the points the uninterrupted one drew."""
    for straight, split, p_straight, p_split in dist.run(world, _resume, "mesh", stores["mesh"], str(tmp_path),
                                                         extra):
        np.testing.assert_allclose(split, straight, rtol=1e-12)
        _assert_same(p_split, p_straight, 1e-12)
    metrics = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics if "loss" in json.loads(m)] == [1, 2, 3, 4]


def _load_at(kind, store, ckpt_dir, out):
    from domainflow.train import Trainer
    from domainflow.train import checkpoint as ckpt

    _, world = rank_and_world()
    trainer = Trainer(_config(kind, store, out, [f"mesh.domain={world}"]), mesh=get_mesh((1, world), ("dp", "domain")))
    step = ckpt.load(ckpt.latest(ckpt_dir), trainer.model, trainer.opt)
    return step, trainer.evaluate()["summary"]


def test_checkpoint_saved_at_one_domain_size_loads_at_another(dist, stores, tmp_path):
    saved = dist.run(2, _train, "mesh", stores["mesh"], str(tmp_path / "a"), 1, 2, ["train.steps=2"])[0]
    results = dist.run(3, _load_at, "mesh", stores["mesh"], str(tmp_path / "a" / "checkpoints"), str(tmp_path / "b"))
    for step, summary in results:
        assert step == 2
        for key, value in saved[2]["model"].items():
            assert summary["model"][key] == pytest.approx(value, rel=1e-8, abs=1e-12), key


def _nan(store, out):
    from domainflow.train import Trainer, TrainingDiverged

    _, world = rank_and_world()
    cfg = _config("mesh", store, out, ["train.steps=2", "train.checkpoint_every=1", f"mesh.domain={world}"])
    trainer = Trainer(cfg, mesh=get_mesh((1, world), ("dp", "domain")))
    trainer.fit()
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))   # poison the model: the next loss is NaN
    trainer.cfg.train.steps = 4
    try:
        trainer.fit()
    except TrainingDiverged as e:
        return str(e), trainer.step
    return None, trainer.step


def test_nan_loss_stops_naming_step_and_sample_and_keeps_the_last_checkpoint(dist, stores, tmp_path):
    for msg, step in dist.run(2, _nan, stores["mesh"], str(tmp_path)):
        assert msg is not None and "step 3" in msg and "run_" in msg and "step_00000002" in msg, msg
        assert step == 2
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002"


def test_config_errors_name_the_key_and_the_choices(tmp_path, stores):
    from domainflow.train import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"unknown key train\.stpes \(did you mean 'steps'\?\)"):
        load_config(None, ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"unknown config section 'modle'.*sections are"):
        load_config(None, ["modle.dim=3"])
    with pytest.raises(ConfigError, match=r"model\.name = 'gpt' is not one of \['transolver', 'meshgraphnet', 'unet'\]"):
        load_config(None, ["model.name=gpt"])
    with pytest.raises(ConfigError, match=r"train\.steps must be an integer"):
        load_config(None, ["train.steps=lots"])
    with pytest.raises(ConfigError, match=r"train\.batch=3 must be a multiple of mesh\.dp=2"):
        load_config(None, ["train.batch=3", "mesh.dp=2"])
    with pytest.raises(ConfigError, match=r"data\.sample_points=100 draws points of a mesh sample; a grid"):
        load_config(None, GRID_OVERRIDES + ["data.sample_points=100"])
    with pytest.raises(ConfigError, match=r"data\.sample_points must be >= 0"):
        load_config(None, ["data.sample_points=-1"])
    with pytest.raises(ConfigError, match=r"eval\.block_points=64: model 'unet' has no block inference"):
        load_config(None, GRID_OVERRIDES + ["eval.block_points=64"])
    # train.compile: static shapes only, and not with what it was not made to work with
    with pytest.raises(ConfigError, match=r"train\.compile=true compiles static shapes, and on this mesh store each "
                                          r"sample has its own number of points.*set data\.sample_points=N"):
        load_config(None, ["train.compile=true"])
    with pytest.raises(ConfigError, match=r"a graph model reads each sample whole with its edges \(data\.edges=true, "
                                          r"model\.name=meshgraphnet\).*set train\.compile=false"):
        load_config(None, ["train.compile=true", "model.name=meshgraphnet"])
    with pytest.raises(ConfigError, match=r"train\.compile=true with mesh\.dp_strategy=fsdp"):
        load_config(None, GRID_OVERRIDES + ["train.compile=true", "mesh.dp_strategy=fsdp"])
    with pytest.raises(ConfigError, match=r"train\.compile=true with train\.checkpoint_activations=true"):
        load_config(None, GRID_OVERRIDES + ["train.compile=true", "train.checkpoint_activations=true"])
    with pytest.raises(ConfigError, match=r"train\.compile_backend = 'eager' is not one of \['inductor', 'aot_eager'\]"):
        load_config(None, GRID_OVERRIDES + ["train.compile=true", "train.compile_backend=eager"])
    for mesh in (["mesh.dp=2"], ["mesh.domain=2"]):  # the drawn points split evenly over the domain ranks
        assert load_config(None, ["train.compile=true", "data.sample_points=100", *mesh]).train.compile
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 5\nlr = 0.01\n[data]\nstore = "x.zarr"\n')
    yaml = tmp_path / "c.yaml"
    yaml.write_text("train:\n  steps: 5\n  lr: 0.01\ndata:\n  store: x.zarr\n")
    for path in (toml, yaml):
        cfg = load_config(path, ["train.steps=7"])
        assert (cfg.train.steps, cfg.train.lr, cfg.data.store) == (7, 0.01, "x.zarr")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = 5\nfoo = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key train\.foo"):
        load_config(bad)


def _missing_field(store, out):
    from domainflow.readers import StoreError
    from domainflow.train import Trainer

    cfg = _config("mesh", store, out, ["data.fields=Cp,Tau"])
    try:
        Trainer(cfg, mesh=get_mesh((1, 1), ("dp", "domain")))
    except StoreError as e:
        return str(e)
    return None


def test_a_field_not_in_the_store_is_named_with_the_choices(dist, stores, tmp_path):
    msg = dist.run(1, _missing_field, stores["mesh"], str(tmp_path))[0]
    assert msg is not None and "Tau" in msg and "Cp" in msg and "Cf" in msg


def test_tiny_demo_runs_end_to_end_and_predict_writes_a_readable_surface(tmp_path, capfd):
    import pyvista as pv

    from domainflow.app.cli import main

    assert main(["demo", "--tiny", "--out", str(tmp_path / "demo")]) == 0
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    summary = report["result"]["eval"]["summary"]
    assert summary["samples"] >= 1 and "rel_l2_Cp" in summary["model"] and "rel_l2_Cp" in summary["baseline"]
    train = tmp_path / "demo" / "train"
    for name in ("metrics.jsonl", "loss.png", "surface_cp.png", "result.json"):
        assert (train / name).exists(), name
    run = report["result"]["eval"]["runs"][0]["run"]
    out = tmp_path / "pred.vtp"
    assert main(["predict", str(train / "checkpoints"), report["store"], "--run", run, str(out)]) == 0
    mesh = pv.read(out)
    assert {"Cp_pred", "Cp_true", "Cf_pred", "Cf_true"} <= set(mesh.cell_data.keys())
    raw = pv.read(tmp_path / "demo" / "raw" / run / f"boundary_{run.split('_')[1]}.vtp")
    assert mesh.n_cells == raw.n_cells
    # rows are back in the original cell order: the true Cp equals the raw file's own Cp
    np.testing.assert_allclose(mesh.cell_data["Cp_true"].reshape(-1), raw.cell_data["CpMeanTrim"].reshape(-1),
                               rtol=1e-5, atol=1e-5)
    # block inference on 2 ranks writes the same prediction (float32: summation order only)
    blocks = tmp_path / "pred_blocks.vtp"
    assert main(["predict", str(train / "checkpoints"), report["store"], "--run", run, str(blocks), "--domain", "2",
                 "--block-points", "97"]) == 0
    assert "forward in blocks of 97 points over the domain" in capfd.readouterr().out
    again = pv.read(blocks)
    for name in ("Cp_pred", "Cf_pred", "Cp_true"):
        np.testing.assert_allclose(again.cell_data[name], mesh.cell_data[name], rtol=1e-4, atol=1e-5)


def test_tiny_climate_demo_runs_end_to_end(tmp_path):
    from domainflow.train.demo import run_demo

    report = run_demo(str(tmp_path / "demo"), climate=True, tiny=True)
    summary = report["result"]["eval"]["summary"]
    assert any(k.startswith("rmse_") for k in summary["model"]) and any(k.startswith("acc_") for k in summary["model"])
    # ingested from the CDS-style netCDF files: the mask static, SST's land gaps filled, levels as channels
    assert sorted((tmp_path / "demo" / "era5_cds").glob("era5_*_levels_*.nc"))
    import zarr

    store = zarr.open_group(tmp_path / "demo" / "grid.zarr", mode="r")
    assert store.attrs["grid"]["static"] == ["lsm"] and {"z500", "t850", "sst"} <= set(store.attrs["grid"]["variables"])
    assert store.attrs["grid"]["missing"]["sst"]["count"] > 0 and 0 < summary["filled"]["sst"] < 1
    assert summary["filled_scored"] is False  # SST's land points are left out of its scores (the store's mask)
    assert {"rmse_z500", "acc_t850", "rmse_sst"} <= set(summary["model"])
    assert (tmp_path / "demo" / "train" / "loss.png").exists()
    assert list((tmp_path / "demo" / "train").glob("map_*.png"))


def _options(store, out):
    """Activation checkpointing changes nothing (float64); bf16 autocast trains (float32) with finite losses."""
    from domainflow.train import Trainer

    _, world = rank_and_world()
    mesh = get_mesh((1, world), ("dp", "domain"))
    plain = Trainer(_config("mesh", store, out + "/plain", ["train.steps=2", f"mesh.domain={world}"]), mesh=mesh)
    plain.fit()
    ckpt = Trainer(_config("mesh", store, out + "/ckpt", ["train.steps=2", f"mesh.domain={world}",
                                                         "train.checkpoint_activations=true"]), mesh=mesh)
    ckpt.fit()
    bf16 = Trainer(_config("mesh", store, out + "/bf16", ["train.steps=2", f"mesh.domain={world}",
                                                         "train.dtype=float32", "train.autocast=bf16",
                                                         "train.clip_grad=0.5", "train.schedule=constant"]),
                   mesh=mesh)
    bf16.fit()
    # equal up to the order in which the deferred gradient sums are queued (recomputation reorders them)
    same = all(float((a - b).abs().max()) <= 1e-12 * max(1.0, float(b.abs().max()))
               for a, b in zip(plain.model.state_dict().values(), ckpt.model.state_dict().values()))
    return same, [h["loss"] for h in bf16.history]


def test_activation_checkpointing_and_bf16_autocast(dist, stores, tmp_path):
    for same, bf16_losses in dist.run(2, _options, stores["mesh"], str(tmp_path)):
        assert same
        assert len(bf16_losses) == 2 and all(np.isfinite(bf16_losses))


def _train_latlon(store, out, lat, lon):
    from domainflow.train import Trainer

    cfg = _config("grid", store, out, ["train.steps=3", "data.shard_dims=lat,lon", f"mesh.domain={lat}",
                                       f"mesh.lon={lon}"])
    trainer = Trainer(cfg, mesh=get_mesh((1, lat, lon), ("dp", "domain", "lon")))
    trainer.fit()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, [h["loss"] for h in trainer.history]


def test_grid_sharded_over_lat_and_lon_equals_one_process(dist, stores, tmp_path):
    ref, ref_losses = dist.run(1, _train_latlon, stores["grid"], str(tmp_path / "one"), 1, 1)[0]
    for params, losses in dist.run(4, _train_latlon, stores["grid"], str(tmp_path / "four"), 2, 2):
        _assert_same(params, ref, 1e-10)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)


def _train_history(kind, store, out, dp, domain, extra):
    """_train's parameters, the per-step log entries and the parameters of a plain module loading the checkpoint."""
    from domainflow.train import Trainer
    from domainflow.train import checkpoint as ckpt
    from domainflow.train.build import build_model

    cfg = _config(kind, store, out, [f"mesh.dp={dp}", f"mesh.domain={domain}", *extra])
    trainer = Trainer(cfg, mesh=get_mesh((dp, domain), ("dp", "domain")))
    trainer.fit()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    model = build_model(cfg, trainer.ds)  # the plain module: a checkpoint with torch.compile's names would not load
    ckpt.load(ckpt.latest(trainer.ckpt_dir), model)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return params, trainer.history, loaded


@pytest.mark.parametrize("kind", ["grid", "mesh"])
def test_compiled_training_equals_eager_with_one_compile_and_eager_checkpoints(dist, stores, tmp_path, kind):
    """train.compile=true at domain 2 (aot_eager: every graph's cross-rank check, no C++ build): the grid UNet, and
    the Transolver on a mesh store with a points budget (the drawn points split evenly over the ranks: the same
    sample every step at fixed per-rank sizes, where eager's per-rank counts vary) train to eager's losses and
    parameters, compile in the first step only, and the checkpoint loads into the plain module (the names are the
    module's, not torch.compile's wrapper's)."""
    extra = ["train.steps=3", "train.eval_every=0"] + (["data.sample_points=301"] if kind == "mesh" else [])
    ref, ref_log, _ = dist.run(2, _train_history, kind, stores[kind], str(tmp_path / "eager"), 1, 2, extra)[0]
    compiled = extra + ["train.compile=true", "train.compile_backend=aot_eager"]
    for params, log, loaded in dist.run(2, _train_history, kind, stores[kind], str(tmp_path / "c"), 1, 2, compiled):
        _assert_same(params, ref, 1e-10)
        _assert_same(loaded, params, 0.0)
        np.testing.assert_allclose([h["loss"] for h in log], [h["loss"] for h in ref_log], rtol=1e-10)
        graphs = [h["compiled_graphs"] for h in log]
        assert graphs[0] >= 1 and graphs == graphs[:1] * len(graphs), graphs
        assert "compiled_graphs" not in ref_log[0]
