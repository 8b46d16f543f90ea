"""Replicated parameters used with sharded activations: one plain nn.Parameter used several times in one
forward gets the single-device gradient."""

from __future__ import annotations

import random

import pytest
import torch
from sharded_check import Sharded, get_mesh

from domainflow import Replicate, Shard
from sweep import none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


# =================================================================================================
# 4. one plain nn.Parameter used several times in one forward
# =================================================================================================
class SharedParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.tensor([0.7, -1.2, 0.4]))
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, x):
        h = self.lin(x) * self.scale                       # F.linear (own backward) + pointwise
        h = self.lin(torch.tanh(h)) + x * self.scale       # same Linear again, scale again
        h = self.norm(h) * self.scale + self.norm.weight   # LayerNorm weight also used as an addend
        h = h @ self.lin.weight.t()                        # weight used a third time, through mm
        h = torch.cat([h, self.scale.expand(h.shape[0], 3) * 2], 1)   # plain param concatenated
        return h


def _shared_params(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    torch.manual_seed(3)
    model = SharedParams().double()
    n = 7
    rest = [Replicate()] * (len(mesh_shape) - 1)
    for sizes in _zero_layouts(n, mesh_shape[0], rng):
        x = Sharded(_t(gen, n, 3), [Shard(0)] + rest, {0: sizes})
        _run(lambda a, m: m(a), [x], mesh, f"shared_out {sizes}", failures, module=model)
        _run(lambda a, m: ((m(a) - 0.3) ** 2).mean() + m(a).sum() * 0.1, [x], mesh, f"shared_loss {sizes}", failures,
             module=model)
    return _ok(failures)


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (3, (3,)), (4, (4,)), (4, (2, 2))])
def test_parameter_used_several_times(dist, world, mesh_shape):
    """Parameter gradients are plain tensors equal to one process, summed exactly once even when the
    parameter meets ShardTensors through F.linear, pointwise ops, LayerNorm and mm in one forward."""
    assert all(dist.run(world, _shared_params, mesh_shape, 400 + world))


def _hooks_see_gradients(mesh_shape):
    import domainflow as df

    mesh = get_mesh(mesh_shape)
    torch.manual_seed(5)
    model = SharedParams().double()
    x = torch.randn(6, 3, dtype=D)
    model(x).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    seen = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, p.grad.clone()))
    xs = df.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1))
    with df.deferred_param_grads():
        model(xs).square().sum().backward()
    failures = [n for n, p in model.named_parameters()
                if n not in seen or not torch.allclose(seen[n], want[n]) or not torch.allclose(p.grad, want[n])]
    assert not failures, (failures, sorted(seen))
    return True


@pytest.mark.parametrize("world,mesh_shape", [(1, (1,)), (2, (1, 2))])
def test_nothing_deferred_over_mesh_dims_of_one_rank(dist, world, mesh_shape):
    """A domain of one rank has nothing to sum: under deferred_param_grads every parameter's gradient still
    reaches autograd during backward (its post-accumulate hook sees the single-device gradient), as without
    domainflow, instead of waiting for an end-of-backward sum over one rank."""
    assert all(dist.run(world, _hooks_see_gradients, mesh_shape))
