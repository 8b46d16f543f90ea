"""Layer norm over trailing dims that are sharded (each row's statistics span ranks) against one device:
outputs, input and affine gradients (also under deferred_param_grads), uneven and empty shards, raw values
far from zero (the centred moments must not cancel)."""

from __future__ import annotations

import random

import pytest
import torch

import domainflow as df
from dist_pool import rank_and_world
from domainflow import Replicate, Shard
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

D = torch.float64


def _layer_norms(seed):
    _, world = rank_and_world()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 6, generator=gen, dtype=D) * 3 + 250.0  # kelvin-like: |mean| >> std
    meshes = [((world,), [Shard(2)]), ((world,), [Shard(1)])]
    if world == 4:
        meshes.append(((2, 2), [Shard(0), Shard(2)]))  # batch and the normalised dim sharded
    for shape, placements in meshes:
        mesh = get_mesh(shape)
        for norm_shape, affine in (((6,), True), ((4, 6), True), ((6,), False)):
            mod = torch.nn.LayerNorm(norm_shape, elementwise_affine=affine, dtype=D)
            with torch.no_grad():
                for p in mod.parameters():
                    p.normal_(generator=gen)
            sizes = {m: random_sizes(x.shape[p.dim], shape[m], rng) for m, p in enumerate(placements)
                     if isinstance(p, Shard)}
            check_sharded(lambda a, m: m(a) * 1.5, [Sharded(x, placements, sizes)], mesh, module=mod,
                          expect_placements=placements)
            with df.deferred_param_grads():
                check_sharded(lambda a, m: m(a).square(), [Sharded(x, placements, sizes)], mesh, module=mod)
    # the functional form with plain weight and bias
    mesh = get_mesh((world,))
    w, b = torch.randn(4, 6, generator=gen, dtype=D), torch.randn(4, 6, generator=gen, dtype=D)
    check_sharded(lambda a, w_, b_: torch.nn.functional.layer_norm(a, (4, 6), w_, b_, 1e-3),
                  [Sharded(x, [Shard(2)], {0: random_sizes(6, world, rng)}), Sharded(w, [Replicate()]),
                   Sharded(b, [Replicate()])], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layer_norm_over_sharded_dims_matches_one_device(dist, world):
    assert all(dist.run(world, _layer_norms, 70 + world))
