"""Gradients that arrive laid out differently from the forward output (another operand's layout, a
shard on the dim an op works along): backward stays exact."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

from domainflow import Shard
from sweep import none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


WORLDS = (2, 3, 4)


# =================================================================================================
# 3. gradients that arrive with another layout than the forward output
# =================================================================================================
def _grad_layouts(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 7
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 4), [Shard(0)], {0: sizes})
        w_slice = Sharded(_t(gen, 3, 4), [Shard(0)])                  # chunk layout of the sliced length
        w_rows = Sharded(_t(gen, n, 4), [Shard(0)], {0: random_sizes(n, world, rng)})
        _run(lambda a, w: (w * a[1::2]).sum(), [x, w_slice], mesh, f"slice_then_mul_other_layout {sizes}", failures)
        _run(lambda a, w: (a[1::2] * w).sum(0), [x, w_slice], mesh, f"slice_then_mul_first {sizes}", failures)
        _run(lambda a, w: (w * a.exp()).sum(), [x, w_rows], mesh, f"pointwise_other_layout {sizes}", failures)
        _run(lambda a, w: (w * a.t().t()).mean(), [x, w_rows], mesh, f"transpose_chain {sizes}", failures)
        _run(lambda a, w: (w[2] * a[2]).sum(), [x, w_rows], mesh, f"select_both {sizes}", failures)
        # reductions over the sharded dim whose [4]-shaped output meets an operand sharded along it
        w_c = Sharded(_t(gen, 4), [Shard(0)], {0: random_sizes(4, world, rng)})
        for name, red in {"sum0": lambda a: a.sum(0), "mean0": lambda a: a.mean(0), "amax0": lambda a: a.amax(0),
                          "max0": lambda a: a.max(0)[0], "var0": lambda a: a.var(0),
                          "prod0": lambda a: (a * 0.2 + 1).prod(0),
                          "norm0": lambda a: torch.linalg.vector_norm(a, dim=0),
                          "layernorm": lambda a: F.layer_norm(a, (4,))[1:3].sum(0)}.items():
            _run(lambda a, w, red=red: w * red(a), [x, w_c], mesh, f"reduce_then_other_layout_{name} {sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_arriving_in_another_layout(dist, world):
    """slice/transpose/select outputs combined with operands sharded with other sizes: the backward
    gets gradients laid out like the other operand; results must still equal one process."""
    assert all(dist.run(world, _grad_layouts, 300 + world))


def _grad_layout_view(world_sizes):
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 4), [Shard(0)], {0: world_sizes})
    w = Sharded(_t(gen, 24), [Shard(0)], {0: (5, 10, 9)})  # not multiples of 4
    # Regression test (bug found in review, now fixed): forward works; backward of the reshape gets w's layout and cannot view it back
    check_sharded(lambda a, ww: ww * a.reshape(24), [x, w], mesh)
    return True


def test_reshape_backward_with_gradient_in_other_layout(dist):
    # Regression test (bug found in review, now fixed): the gradient of a.reshape(24) arrives laid out like `ww` (sizes 5, 10, 9 over 24)
    # whose rows do not map back to whole rows of [6, 4]; the view backward raises
    # UnsupportedShardedOp instead of redistributing the gradient to the forward output layout.
    assert all(dist.run(3, _grad_layout_view, (1, 4, 1)))


def _grad_layout_softmax():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 6), [Shard(0)], {0: (2, 3)})
    w = Sharded(_t(gen, 5, 6), [Shard(1)], {0: (4, 2)})
    # softmax over the unsharded dim 1 of x; w is sharded on dim 1, so it leads the product's layout
    check_sharded(lambda a, ww: ww * torch.softmax(a, 1), [x, w], mesh)
    return True


def test_softmax_backward_with_gradient_sharded_on_softmax_dim(dist):
    # Regression test (bug found in review, now fixed).
    # Was: forward is legal (softmax over an unsharded dim); the gradient comes back sharded on
    # dim 1 (w's layout), and _softmax_backward_data raises UnsupportedShardedOp in backward.
    assert all(dist.run(2, _grad_layout_softmax))
