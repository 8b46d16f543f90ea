"""The built-in MeshGraphNet (``model.name=meshgraphnet``) on a store ingested with edges: training at domain 2
and 3 (and with activation checkpointing) equals one process, the evaluation too, a checkpoint predicts the same
at domain 2 as at 1; ``MeshDataset(edges=True)`` gives each rank exactly its edges; the refusals name the key
and the fix (a store without edges, edges for a model without them, edges with a points budget)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_pool import rank_and_world
from sharded_check import get_mesh

MGN = ["model.name=meshgraphnet", "model.dim=8", "model.layers=2", "train.dtype=float64", "train.lr=3e-3",
       "train.warmup=1", "output.progress=false", "output.plots=false", "data.prefetch=1", "train.steps=3"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """One small DrivaerML-style data set ingested twice into 8 parts: with edges, and without."""
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    root = tmp_path_factory.mktemp("mgn")
    synth_drivaerml(root / "raw", runs=3, cells=400, seed=3, volume_cells=200, volume_pieces=1, progress=False)
    opts = dict(parts=8, locations=("surface",), progress=False, split=(0.67, 0.33, 0.0))
    ingest_drivaerml(root / "raw", root / "edges.zarr", MeshOptions(edges=True, **opts))
    ingest_drivaerml(root / "raw", root / "plain.zarr", MeshOptions(**opts))
    return {"edges": str(root / "edges.zarr"), "plain": str(root / "plain.zarr"), "root": root}


def _config(store, out, extra=()):
    from domainflow.train import load_config

    return load_config(None, [f"data.store={store}", f"output.dir={out}", *MGN, *extra])


def _train(store, out, extra=()):
    """Train on a domain of this pool's ranks; parameters, per-step losses and the evaluation summary back."""
    from domainflow.train import Trainer

    _, world = rank_and_world()
    trainer = Trainer(_config(store, out, [f"mesh.domain={world}", *extra]), mesh=get_mesh((1, world), ("dp", "domain")))
    res = trainer.fit()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return params, [h["loss"] for h in trainer.history], res["eval"]["summary"]


@pytest.fixture(scope="module")
def one_process(dist, stores, tmp_path_factory):
    """The reference: 3 steps at domain 1, its checkpoint kept for the predict test."""
    out = tmp_path_factory.mktemp("mgn_one")
    params, losses, summary = dist.run(1, _train, stores["edges"], str(out))[0]
    return {"params": params, "losses": losses, "summary": summary, "ckpt": str(out / "checkpoints")}


@pytest.mark.parametrize("world,extra", [(2, ()), (3, ()), (2, ("train.checkpoint_activations=true",))],
                         ids=["domain2", "domain3", "domain2-checkpointed"])
def test_domain_parallel_training_equals_one_process(dist, stores, one_process, tmp_path, world, extra):
    for params, losses, summary in dist.run(world, _train, stores["edges"], str(tmp_path), extra):
        for k, ref in one_process["params"].items():
            err = float((params[k] - ref).abs().max() / ref.abs().max().clamp_min(1.0))
            assert err <= 1e-10, f"parameter {k}: max rel difference {err:.2e}"
        np.testing.assert_allclose(losses, one_process["losses"], rtol=1e-10)
        assert summary["samples"] == one_process["summary"]["samples"] >= 1
        for key, value in one_process["summary"]["model"].items():
            assert summary["model"][key] == pytest.approx(value, rel=1e-8, abs=1e-12), key


def _predict(ckpt, store, run):
    """This rank's cells of ``run`` predicted from the checkpoint, as ``domainflow predict`` does."""
    from domainflow.train import checkpoint
    from domainflow.train.build import build_model
    from domainflow.train.data import build_dataset
    from domainflow.train.predict import predict_config, predict_local

    _, world = rank_and_world()
    path, cfg, _, norm = predict_config(ckpt, store, [run], domain=world)
    mesh = get_mesh((1, world), ("dp", "domain"))
    model = build_model(cfg, build_dataset(cfg, mesh, None, shuffle=False, runs=[run]))
    checkpoint.load(path, model)
    local = predict_local(model, cfg, mesh, run, norm)
    return local["ids"], local["arrays"]


def test_predict_from_a_checkpoint_at_domain_2_equals_domain_1(dist, stores, one_process):
    from domainflow.readers import open_store

    run = open_store(stores["edges"]).splits["val"][0]
    ((ids, ref),) = dist.run(1, _predict, one_process["ckpt"], stores["edges"], run)
    pieces = dist.run(2, _predict, one_process["ckpt"], stores["edges"], run)
    got_ids = np.concatenate([p[0] for p in pieces])
    assert sorted(got_ids.tolist()) == sorted(ids.tolist()) and all(len(p[0]) for p in pieces)
    where = {int(i): k for k, i in enumerate(ids)}
    for name, values in ref.items():
        got = np.concatenate([p[1][name] for p in pieces])
        np.testing.assert_allclose(got, values[[where[int(i)] for i in got_ids]], rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def _edges_read(store):
    """This rank's ``edges`` sample of the first training run: its local rows, sizes, and its row range."""
    from domainflow.readers import MeshDataset

    _, world = rank_and_world()
    ds = MeshDataset(store, get_mesh((world,), ("domain",)), shuffle=False, prefetch=0, edges=True)
    sample = next(iter(ds))
    edges = sample["edges"]
    sizes = [int(s[0]) for s in edges.sharding_shapes[0]] if world > 1 else [int(edges.shape[0])]
    return (ds.runs[0], edges.to_local().numpy(), sizes, tuple(edges.shape), edges.dtype,
            ds.read_region(ds.runs[0])["rows"])


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_exactly_the_edges_of_its_rows(dist, stores, world):
    import zarr

    got = dist.run(world, _edges_read, stores["edges"])
    group = zarr.open_group(stores["edges"], mode="r")["runs"][got[0][0]]["surface"]
    edges, edge_parts, parts = group["edges"][...], group["edge_parts"][...], group["parts"].shape[0] - 1
    counts = [int(edge_parts[(r + 1) * parts // world] - edge_parts[r * parts // world]) for r in range(world)]
    for r, (_, local, sizes, shape, dtype, (a, b)) in enumerate(got):
        lo = edge_parts[r * parts // world]
        np.testing.assert_array_equal(local, edges[lo:lo + counts[r]])
        assert sizes == counts and shape == (len(edges), 2) and dtype == torch.int64
        assert ((local[:, 1] >= a) & (local[:, 1] < b)).all()    # every receiver is one of this rank's rows
        assert ((local[:, 0] < a) | (local[:, 0] >= b)).any()    # some senders are other ranks' rows
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), edges)


def _forward_traffic(store):
    """One forward of a MeshGraphNet on this rank's share of a sample: the rows each exchange plan fetches from
    other ranks, the distinct senders other ranks own, and the all-reduces it made."""
    import domainflow as df
    from domainflow import comm
    from domainflow.readers import MeshDataset
    from domainflow.train.models import MeshGraphNet

    _, world = rank_and_world()
    ds = MeshDataset(store, get_mesh((world,), ("domain",)), shuffle=False, prefetch=0, dtype=torch.float64,
                     edges=True)
    sample = next(iter(ds))
    x = torch.cat([sample["coords"], sample["normals"]], dim=-1).unsqueeze(0)
    torch.manual_seed(0)
    model = MeshGraphNet(6, 4, dim=8, layers=3).double()
    plans, make = [], comm.index_plan
    def spy(*args, **kwargs):
        plan = make(*args, **kwargs)
        plans.append((kwargs.get("what"), plan.fetched))
        return plan
    comm.index_plan = spy
    comm.stats.reset()
    try:
        with torch.no_grad():
            model(x, edges=sample["edges"])
    finally:
        comm.index_plan = make
    a, b = ds.read_region(ds.runs[0])["rows"]
    senders = sample["edges"].to_local()[:, 0]
    remote = int(torch.unique(senders[(senders < a) | (senders >= b)]).numel())
    assert isinstance(sample["edges"], df.ShardTensor)
    return plans, remote, comm.stats.calls.get("all_reduce", 0)


@pytest.mark.parametrize("world", [2, 3])
def test_a_forward_fetches_only_the_senders_other_ranks_own(dist, stores, world):
    """The sender rows come once per forward (the plan is reused by every block); receivers are local, and the
    messages are summed into rows sharded like the nodes: no all-reduce, no other row moves."""
    for plans, remote, all_reduces in dist.run(world, _forward_traffic, stores["edges"]):
        fetched = [n for _, n in plans if n]
        assert fetched == [remote] and remote > 0, plans
        assert sum(what.startswith("index_add") for what, _ in plans) == 3 and all_reduces == 0, plans


def _read_refused(store, **kwargs):
    from domainflow.readers import MeshDataset

    try:
        MeshDataset(store, get_mesh((1,), ("domain",)), prefetch=0, edges=True, **kwargs)
    except (ValueError, KeyError) as exc:  # StoreError is a ValueError
        return type(exc).__name__, str(exc)
    return None


def _train_refused(store, out):
    from domainflow.train import ConfigError, Trainer

    try:
        Trainer(_config(store, out), mesh=get_mesh((1, 1), ("dp", "domain")))
    except ConfigError as exc:
        return str(exc)
    return None


def test_a_store_without_edges_is_refused_naming_the_fix(dist, stores, tmp_path):
    from domainflow.train import ConfigError
    from domainflow.train.run import preflight

    kind, msg = dist.run(1, _read_refused, stores["plain"])[0]
    assert kind == "StoreError" and "plain.zarr" in msg and "has no surface edges" in msg and "--edges" in msg, msg
    with pytest.raises(ConfigError, match=r"data\.edges=true \(model\.name=meshgraphnet\) .*plain\.zarr holds no "
                                          r"surface edges.*--edges"):
        preflight(_config(stores["plain"], str(tmp_path)), resume=False)
    msg = dist.run(1, _train_refused, stores["plain"], str(tmp_path))[0]
    assert msg is not None and "data.edges=true (model.name=meshgraphnet)" in msg and "--edges" in msg, msg


def test_edges_for_a_model_without_them_are_refused_by_name(stores, tmp_path):
    from domainflow.train import ConfigError, load_config
    from domainflow.train.run import preflight

    with pytest.raises(ConfigError, match=r"data\.edges=true: model\.name='transolver' takes no edges"):
        load_config(None, ["data.edges=true"])
    cfg = load_config(None, [f"data.store={stores['edges']}", f"output.dir={tmp_path}", "data.edges=true",
                             "model.target=torch.nn:Linear"])
    with pytest.raises(ConfigError, match=r"data\.edges=true: the forward of model\.target=torch\.nn:Linear takes "
                                          r"no edges keyword"):
        preflight(cfg, resume=False)
    with pytest.raises(ConfigError, match=r"data\.edges=false: model\.name=meshgraphnet passes messages"):
        load_config(None, ["model.name=meshgraphnet", "data.edges=false"])


def test_edges_with_a_points_budget_are_refused_by_name(dist, stores):
    from domainflow.train import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data\.sample_points=100 draws a subset .* no graph"):
        load_config(None, ["model.name=meshgraphnet", "data.sample_points=100"])
    kind, msg = dist.run(1, _read_refused, stores["edges"], sample_points=100)[0]
    assert kind == "ValueError" and "sample_points=100" in msg and "no graph" in msg, msg


def test_block_inference_and_the_estimate_are_refused_for_a_graph_model(stores, one_process):
    """Blocks of points would cut the edges; the estimate measures draws of points."""
    from domainflow.train import ConfigError, load_config
    from domainflow.train.estimate import EstimateError, check_measurable
    from domainflow.train.predict import predict_config

    with pytest.raises(ConfigError, match=r"eval\.block_points=64: model 'meshgraphnet' has no block inference"):
        load_config(None, ["model.name=meshgraphnet", "eval.block_points=64"])
    with pytest.raises(ConfigError, match=r"eval\.block_points=64: model 'meshgraphnet' has no block inference"):
        predict_config(one_process["ckpt"], stores["edges"], ["run_1"], block_points=64)
    with pytest.raises(EstimateError, match=r"data\.edges=true \(meshgraphnet\) trains on whole samples"):
        check_measurable(load_config(None, ["model.name=meshgraphnet", f"data.store={stores['edges']}"]))
