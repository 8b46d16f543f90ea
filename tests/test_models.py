"""The reference models (domainflow.train.models) sharded vs one process: outputs, input and parameter
gradients; Transolver's physics attention needs exactly one all-reduce per layer."""

from __future__ import annotations

import random

import pytest
import torch

from dist_pool import rank_and_world
from domainflow import Shard
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes


def _transolver(seed):
    import domainflow as df
    from domainflow import comm
    from domainflow.train.models import Transolver

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=2, heads=2, slices=8).double()
    pts = torch.randn(1, 29, 6, generator=gen, dtype=torch.float64)
    glob = torch.randn(1, 3, generator=gen, dtype=torch.float64)
    sizes = random_sizes(29, world, rng)
    check_sharded(lambda p, m: m(p, glob), [Sharded(pts, [Shard(1)], {0: sizes})], mesh, module=model)
    x = df.distribute_tensor(pts, mesh, [Shard(1)], sharding_shapes={0: list(sizes)})
    comm.stats.reset()
    with torch.no_grad():
        model(x, glob)
    return comm.stats.calls.get("all_reduce", 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_transolver_sharded_equals_single_process(dist, world):
    for calls in dist.run(world, _transolver, 7 + world):
        assert calls == (2 if world > 1 else 0)  # one per layer
