"""In-place ops on ShardTensors: broadcasting plain operands, setitem by a sharded index, with autograd."""

from __future__ import annotations

import random

import pytest
import torch
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

import domainflow as df
from domainflow import Shard
from sweep import none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


WORLDS = (2, 3, 4)


# =================================================================================================
# 5. in-place ops with broadcasting plain operands
# =================================================================================================
def _inplace(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    row = _t(gen, 3)
    col = _t(gen, n, 1)
    full_plain = _t(gen, n, 3)
    mask = _t(gen, n, 3) > 0.3
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 3), [Shard(0)], {0: sizes})
        other = Sharded(_t(gen, n, 3), [Shard(0)], {0: random_sizes(n, world, rng)})

        def chain(a, b, r, c, m):
            z = a * 1.0
            z.add_(r)
            z.mul_(c)
            z.sub_(b, alpha=0.5)
            z.masked_fill_(m, 0.25)
            z.clamp_(-0.8, 0.9)
            z.div_(r.abs() + 1)
            return z

        _run(chain, [x, other, row, col, mask], mesh, f"inplace_chain {sizes}", failures)

        def copy_plain(a, fp):
            z = a * 2.0
            z.copy_(fp)
            return z * a

        _run(copy_plain, [x, full_plain], mesh, f"copy_plain {sizes}", failures)

        def copy_bcast(a, r):
            z = a * 2.0
            z.copy_(r)
            return z + a

        _run(copy_bcast, [x, row], mesh, f"copy_broadcast {sizes}", failures)

        def copy_other_layout(a, b):
            z = a * 1.0
            z.copy_(b * 3)
            return z

        _run(copy_other_layout, [x, other], mesh, f"copy_other_layout {sizes}", failures)

        def slice_inplace(a):
            z = a * 1.0
            z[1:4].mul_(3.0)
            z[:, 1].add_(0.5)
            z[::2, :2].clamp_(-0.2, 0.2)
            return z

        x_nograd = Sharded(x.full, x.placements, x.sizes, requires_grad=False)
        _run(slice_inplace, [x_nograd], mesh, f"slice_inplace {sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_inplace_ops_with_broadcasting_plain_operands(dist, world):
    assert all(dist.run(world, _inplace, 500 + world))


def _setitem_sharded_row():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.arange(12.0, dtype=D).reshape(4, 3)
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (1, 3)})
    x[2] = -1.0                      # a boundary condition on a row owned by rank 1
    ref = full.clone()
    ref[2] = -1.0
    got = x.full_tensor()
    assert torch.equal(got, ref), f"x[2] = -1 gave\n{got}\nexpected\n{ref}"
    return True


def test_setitem_on_sharded_index(dist):
    # Regression test (bug found in review, now fixed): x[i] = v on the sharded dim is silently lost: select() on a sharded dim returns a
    # broadcast copy, so the fill_/copy_ that __setitem__ applies never reaches x's local chunk.
    assert all(dist.run(2, _setitem_sharded_row))


def _select_inplace_grad():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 3), [Shard(0)], {0: (2, 3)})

    def fn(a):
        z = a * 1.0
        z[3] = z[3] * 2.0
        return z

    check_sharded(fn, [x], mesh)
    return True


def test_setitem_sharded_index_with_autograd(dist):
    # Regression test (bug found in review, now fixed): same root cause as test_setitem_on_sharded_index, with autograd in the loop.
    assert all(dist.run(2, _select_inplace_grad))
