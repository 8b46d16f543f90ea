"""``mesh.dp_strategy=fsdp``: parameters and optimizer state sharded over dp with FSDP2 while each sample's
domain is sharded over the domain ranks. At dp 2 x domain 2 the parameters after 3 steps equal one process
training on the same samples (float64, 1e-10; Transolver on a surface with AdamW and gradient clipping,
UNet on a grid); each rank holds about half of the parameters and optimizer state; the checkpoint
(DCP) resumes at another dp/domain size without FSDP and continues as the uninterrupted run; a user's own
loop with fully_shard over the dp sub-mesh is exact too, and deferred_param_grads under FSDP2 is refused by
name instead of crashing."""

from __future__ import annotations

import pytest
import torch

from dist_pool import rank_and_world
from sharded_check import get_mesh
from test_ddp import _data, _model  # the same model and batches as the DDP test
from test_train import _assert_same, _config, stores  # noqa: F401  (the module's store fixture)


def _full(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _fit(kind, store, out, dp, domain, extra, resume=False):
    from domainflow.train import Trainer

    cfg = _config(kind, store, out, [f"mesh.dp={dp}", f"mesh.domain={domain}", *extra])
    trainer = Trainer(cfg, mesh=get_mesh((dp, domain), ("dp", "domain")))
    res = trainer.fit(resume=resume)
    return _full(trainer.model.state_dict()), [h["loss"] for h in trainer.history], res


@pytest.mark.parametrize("kind", ["mesh", "grid"])
def test_fsdp_over_dp_with_a_sharded_domain_equals_one_process(dist, stores, tmp_path, kind):  # noqa: F811
    extra = ["train.steps=3", "train.batch=2", "train.clip_grad=0.5"]
    ref, ref_losses, ref_res = dist.run(1, _fit, kind, stores[kind], str(tmp_path / "one"), 1, 1, extra)[0]
    got = dist.run(4, _fit, kind, stores[kind], str(tmp_path / "fsdp"), 2, 2, [*extra, "mesh.dp_strategy=fsdp"])
    for params, losses, res in got:
        _assert_same(params, ref, 1e-10)
        assert losses == pytest.approx(ref_losses, rel=1e-10)
        for key, value in ref_res["eval"]["summary"]["model"].items():
            assert res["eval"]["summary"]["model"][key] == pytest.approx(value, rel=1e-8, abs=1e-12), key
        # each dp rank holds about half of every parameter (FSDP2 splits dim 0) and of its two Adam moments
        total, mine = ref_res["state_numel"], res["state_numel"]
        assert res["dp_strategy"] == "fsdp" and ref_res["dp_strategy"] == "allreduce"
        for key in ("params", "optimizer"):
            assert 0.45 <= mine[key] / total[key] <= 0.55, (mine, total)
    for key in ("params", "optimizer"):  # ranks 0 and 2: dp 0 and 1 of domain rank 0 hold it all between them
        assert got[0][2]["state_numel"][key] + got[2][2]["state_numel"][key] == ref_res["state_numel"][key]


def test_fsdp_in_float32_sums_with_plain_collectives(dist, stores, tmp_path):  # noqa: F811
    """float32 (the default dtype): FSDP2 would reduce with PREMUL_SUM, which Gloo refuses; sums instead."""
    extra = ["train.steps=2", "train.batch=2", "train.dtype=float32"]
    ref, ref_losses, _ = dist.run(1, _fit, "mesh", stores["mesh"], str(tmp_path / "one"), 1, 1, extra)[0]
    got = dist.run(4, _fit, "mesh", stores["mesh"], str(tmp_path / "fsdp"), 2, 2, [*extra, "mesh.dp_strategy=fsdp"])
    for params, losses, _ in got:
        _assert_same(params, ref, 1e-5)
        assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_an_fsdp_checkpoint_resumes_at_another_size_without_fsdp(dist, stores, tmp_path):  # noqa: F811
    """3 steps under FSDP2 at 2 x 2, then 2 more on one dp rank x 2 domain ranks (replicated parameters):
    the same as 5 steps in one process."""
    extra = ["train.batch=2", "train.checkpoint_every=1", "train.schedule=constant"]  # the same lr whatever steps
    ref, ref_losses, _ = dist.run(1, _fit, "mesh", stores["mesh"], str(tmp_path / "one"), 1, 1,
                                  [*extra, "train.steps=5"])[0]
    out = str(tmp_path / "run")
    first = dist.run(4, _fit, "mesh", stores["mesh"], out, 2, 2, [*extra, "train.steps=3", "mesh.dp_strategy=fsdp"])
    second = dist.run(2, _fit, "mesh", stores["mesh"], out, 1, 2, [*extra, "train.steps=5"], True)
    for params, losses, _ in second:
        _assert_same(params, ref, 1e-10)
        assert first[0][1] + losses == pytest.approx(ref_losses, rel=1e-10)


def _own_loop(deferred: bool):
    """A user's loop: fully_shard over the dp sub-mesh, ShardTensor points over the domain, AdamW + clipping."""
    from torch.distributed.fsdp import fully_shard

    import domainflow as df
    from domainflow import Shard, ShardTensor

    rank, world = rank_and_world()
    mesh = get_mesh((2, 2), ("dp", "domain"))
    dp, dom = mesh.get_coordinate()
    sizes = [6, 4]
    lo, hi = sum(sizes[:dom]), sum(sizes[:dom + 1])
    model = _model()
    fully_shard(model, mesh=mesh["dp"])
    model.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = _data()
    for step in range(3):
        xs = ShardTensor.from_local(x[step, dp, :, lo:hi].contiguous(), mesh["domain"], [Shard(1)],
                                    sharding_shapes={"domain": sizes})
        ys = ShardTensor.from_local(y[step, dp, :, lo:hi].contiguous(), mesh["domain"], [Shard(1)],
                                    sharding_shapes={"domain": sizes})
        opt.zero_grad()
        loss = ((model(xs) - ys) ** 2).mean() / 2  # summed over dp: the mean of the two samples
        if deferred:
            try:
                with df.deferred_param_grads():
                    loss.backward()
            except RuntimeError as e:
                return str(e)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def test_a_users_own_loop_with_fully_shard(dist):
    results = dist.run(4, _own_loop, False)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    x, y = _data()
    for step in range(3):
        opt.zero_grad()
        ((ref(x[step]) - y[step]) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    for params in results:
        for got, want in zip(params, ref.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    # the end-of-backward sum would come after FSDP2 reduced and freed the gradients (it crashed): refused
    for msg in dist.run(4, _own_loop, True):
        assert "deferred_param_grads(): " in msg and "outside deferred_param_grads() with FSDP2" in msg, msg


def test_fsdp_through_the_cli_and_predict_from_its_checkpoint(dist, stores, tmp_path):  # noqa: F811
    """``domainflow train --dp 2 --domain 2 mesh.dp_strategy=fsdp``, then ``predict`` rebuilds the model
    unsharded from the DCP checkpoint on two ranks."""
    import json

    from cli_runner import run_cli
    from test_train import MESH_OVERRIDES

    extra = ["train.steps=2", "train.batch=2"]
    _, ref_losses, _ = dist.run(1, _fit, "mesh", stores["mesh"], str(tmp_path / "one"), 1, 1, extra)[0]

    def cli(*args):
        return run_cli(*args, env={"OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"})

    out = tmp_path / "cli"
    r = cli("train", "--out", out, "--dp", "2", "--domain", "2", f"data.store={stores['mesh']}", *MESH_OVERRIDES,
            *extra, "mesh.dp_strategy=fsdp")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["dp_strategy"] == "fsdp" and res["loss"] == pytest.approx(ref_losses[-1], rel=1e-10)
    r = cli("predict", out / "checkpoints", stores["mesh"], tmp_path / "run.vtp", "--run", res["eval"]["runs"][0]["run"],
            "--domain", "2")
    assert r.returncode == 0 and (tmp_path / "run.vtp").exists(), r.stderr[-3000:]
    r = run_cli("train", "--out", tmp_path / "bad", f"data.store={stores['mesh']}", "mesh.dp_strategy=zero3")
    assert r.returncode != 0 and "mesh.dp_strategy='zero3' is not one of ['allreduce', 'fsdp']" in r.stderr, r.stderr


class _Block(torch.nn.Module):
    """A block holding a ModuleList of its own (and a frozen layer): FSDP2 must shard the inner ones first."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        for layer in self.inner:
            x = torch.tanh(layer(x))
        return self.frozen(x)


class _Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.levels = torch.nn.ModuleList([_Block(), torch.nn.ModuleList([_Block(), _Block()])])

    def forward(self, x):
        x = self.levels[0](x)
        for block in self.levels[1]:
            x = block(x)
        return x


def _nested_rank():
    from domainflow import Shard, ShardTensor
    from domainflow.train.fsdp import shard_model

    mesh = get_mesh((2, 2), ("dp", "domain"))
    dp, dom = mesh.get_coordinate()
    model = shard_model(_Nested().double(), mesh)
    x = torch.randn(2, 1, 10, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sizes = [7, 3]
    lo, hi = sum(sizes[:dom]), sum(sizes[:dom + 1])
    xs = ShardTensor.from_local(x[dp, :, lo:hi].contiguous(), mesh["domain"], [Shard(1)], sharding_shapes={"domain": sizes})
    (model(xs) ** 2).mean().backward()
    return [p.grad.full_tensor().clone() if p.grad is not None else None for p in model.parameters()]


def test_nested_module_lists_are_sharded_innermost_first(dist):
    ref = _Nested().double()
    x = torch.randn(2, 1, 10, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ref(x) ** 2).mean(dim=(1, 2, 3)).sum().backward()  # FSDP2 sums the two dp samples' mean losses
    for grads in dist.run(4, _nested_rank):
        for got, p in zip(grads, ref.parameters()):
            if p.grad is None:
                assert got is None
            else:
                torch.testing.assert_close(got, p.grad, rtol=1e-10, atol=1e-12)
