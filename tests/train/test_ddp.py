"""A user's own training loop may wrap the model in ``torch.nn.parallel.DistributedDataParallel`` over the dp axis
of a ("dp", "domain") mesh while domainflow shards each sample's domain: after three steps on 2 x 2 ranks the
parameters equal one process training on the whole batch (float64)."""

from __future__ import annotations

import copy

import torch

from dist_pool import rank_and_world
from domainflow import Shard, ShardTensor
from sharded_check import get_mesh


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 2)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 1, 10, 3, generator=g, dtype=torch.float64)  # (step, sample, 1, points, in)
    y = torch.randn(3, 2, 1, 10, 2, generator=g, dtype=torch.float64)
    return x, y


def _ddp_rank():
    rank, world = rank_and_world()
    mesh = get_mesh((2, 2), ("dp", "domain"))
    dp, dom = mesh.get_coordinate()
    sizes = [6, 4]  # uneven points per domain rank
    lo, hi = sum(sizes[:dom]), sum(sizes[:dom + 1])
    model = torch.nn.parallel.DistributedDataParallel(_model(), process_group=mesh["dp"].get_group())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    for step in range(3):
        xs = ShardTensor.from_local(x[step, dp, :, lo:hi].contiguous(), mesh["domain"], [Shard(1)],
                                    sharding_shapes={"domain": sizes})
        ys = ShardTensor.from_local(y[step, dp, :, lo:hi].contiguous(), mesh["domain"], [Shard(1)],
                                    sharding_shapes={"domain": sizes})
        opt.zero_grad()
        ((model(xs) - ys) ** 2).mean().backward()  # DDP averages the two samples' gradients over dp
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def test_ddp_over_the_dp_axis_with_a_sharded_domain(dist):
    results = dist.run(4, _ddp_rank)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _data()
    for step in range(3):
        opt.zero_grad()
        ((ref(x[step]) - y[step]) ** 2).mean().backward()  # the whole batch of two samples in one process
        opt.step()
    for params in results:
        for got, want in zip(params, ref.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
