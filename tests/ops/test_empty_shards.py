"""Ops on layouts with empty shards (a rank holding no rows): reductions over the sharded dim, views,
slicing, select, cat/split, matmul, LayerNorm, softmax, F.linear; values and gradients."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import Sharded, get_mesh

from domainflow import Shard
from sweep import none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


WORLDS = (2, 3, 4)


# =================================================================================================
# 1. empty shards + reductions over the sharded dim
# =================================================================================================
def _zero_reductions(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 5
    fns = {
        "amax0": lambda a: a.amax(0),
        "amin0_keep": lambda a: a.amin(0, keepdim=True),
        "max_all": lambda a: a.max(),
        "min_all": lambda a: a.min(),
        "max_dim0": lambda a: a.max(0),
        "min_dim0_keep": lambda a: a.min(0, keepdim=True),
        "argmax0": lambda a: a.argmax(0),
        "argmin_flat": lambda a: a.argmin(),
        "prod0": lambda a: (a * 0.3 + 1).prod(0),
        "prod_all": lambda a: (a * 0.1 + 1).prod(),
        "var0": lambda a: a.var(0),
        "var0_unbiased_false": lambda a: torch.var(a, 0, correction=0, keepdim=True),
        "std_all": lambda a: a.std(),
        "var_mean0": lambda a: torch.var_mean(a, 0),
        "norm2": lambda a: torch.linalg.vector_norm(a, dim=0),
        "norm_inf": lambda a: torch.linalg.vector_norm(a, float("inf"), dim=0),
        "norm_neginf": lambda a: torch.linalg.vector_norm(a, -float("inf")),
        "norm_1p5": lambda a: torch.linalg.vector_norm(a, 1.5, dim=(0, 1)),
        "norm0": lambda a: torch.linalg.vector_norm(a, 0, dim=0).to(D) + 0 * a.sum(),
        "sum_mean": lambda a: a.sum(0) + a.mean((0, 1), keepdim=True).squeeze(0),
        "logsumexp_unsharded": lambda a: torch.logsumexp(a, 1),
        "softmax_unsharded": lambda a: torch.softmax(a, -1) * a,
        "manual_logsumexp_sharded": lambda a: (a - a.amax(0, keepdim=True)).exp().sum(0).log() + a.amax(0),
        "sqrt_sum_sq": lambda a: (a * a).sum((0, 2)).sqrt(),
    }
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 3, 2), [Shard(0)], {0: sizes})
        for name, fn in fns.items():
            _run(fn, [x], mesh, f"{name} sizes={sizes}", failures)
    # products with exact zeros (one zero in a column, two zeros in another)
    full = _t(gen, n, 3) * 0.5 + 1.0
    full[1, 0] = 0.0
    full[0, 1] = 0.0
    full[n - 1, 1] = 0.0
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(full.clone(), [Shard(0)], {0: sizes})
        _run(lambda a: a.prod(0), [x], mesh, f"prod_with_zeros sizes={sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", (3, 4))
def test_zero_shards_reductions(dist, world):
    """Reductions over a sharded dim whose shards include empty ones: values and gradients."""
    assert all(dist.run(world, _zero_reductions, 100 + world))


# =================================================================================================
# 2. empty shards + views, slicing, select, cat/split, matmul, LayerNorm, softmax, F.linear
# =================================================================================================
def _zero_views(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 4, 3), [Shard(0)], {0: sizes})
        last = max(k for k, s in enumerate(sizes) if s > 0)
        last_row = sum(sizes[:last]) + sizes[last] - 1
        cases = {
            "merge_inner": lambda a: a.reshape(n * 4, 3) * 2,
            "merge_all": lambda a: a.reshape(-1).sin(),
            "flatten_unflatten": lambda a: a.flatten(0, 1).unflatten(0, (n, 4)) + 1,
            "slice_step2": lambda a: a[::2] * 3,
            "slice_1_step3": lambda a: a[1::3].exp(),
            "slice_tail": lambda a: a[n - 2:],
            "slice_step4_then_sum": lambda a: a[::4].sum(0),
            "select_last_row": lambda a: a[last_row] * 2,
            "select_first_row": lambda a: a[0] + 1,
            "select_neg": lambda a: a.select(0, -1),
            "cat_sharded": lambda a: torch.cat([a, a[1:3] * 2, a[::3]], 0),
            "split_cat": lambda a: torch.cat([p * (i + 1) for i, p in enumerate(a.split([0, 2, 1, 3], 0))], 0),
            "chunk": lambda a: a.chunk(4, 0)[-1] * 5,
            "unbind_sharded": lambda a: torch.stack(a.unbind(0)[::2], 0),
            "stack_sharded": lambda a: torch.stack([a, a * 2], 0).sum(0),
            "diff": lambda a: torch.diff(a, dim=0),
            "layernorm": lambda a: F.layer_norm(a, (3,)) * 1.5,
            "layernorm2": lambda a: F.layer_norm(a, (4, 3)),
            "softmax_unsharded": lambda a: torch.log_softmax(a, 1),
            "matmul_contract_sharded": lambda a: a.reshape(n, 12).t() @ a.reshape(n, 12),
            "einsum_nc_nc": lambda a: torch.einsum("nij,nij->ij", a, a),
        }
        for name, fn in cases.items():
            _run(fn, [x], mesh, f"{name} sizes={sizes}", failures)
        # F.linear on [B, N, C] with N sharded (zeros included), and nn.Linear/LayerNorm modules
        xb = Sharded(_t(gen, 2, n, 3), [Shard(1)], {0: sizes})
        torch.manual_seed(1)
        lin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.GELU(),
                                  torch.nn.Linear(4, 2)).double()
        _run(lambda a, m: m(a), [xb], mesh, f"linear_BNC sizes={sizes}", failures, module=lin)
        _run(lambda a, m: (m(a) ** 2).mean(), [xb], mesh, f"linear_BNC_loss sizes={sizes}", failures, module=lin)
    # splitting a sharded dim when every rank's rows divide evenly
    for sizes in [(0,) * (world - 1) + (8,), (8,) + (0,) * (world - 1), (2,) * (world - 1) + (8 - 2 * (world - 1),)]:
        x = Sharded(_t(gen, 8, 3), [Shard(0)], {0: sizes})
        _run(lambda a: a.reshape(4, 2, 3) * 2, [x], mesh, f"split_dim sizes={sizes}", failures)
        _run(lambda a: a.reshape(4, 2, 3).sum(1), [x], mesh, f"split_dim_sum sizes={sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_zero_shards_views_and_ops(dist, world):
    assert all(dist.run(world, _zero_views, 200 + world))
