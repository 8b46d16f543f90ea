"""Gathers and scatters by global index across shard boundaries (the message-passing step) against the
same ops on full tensors in one process: outputs, input and parameter gradients, uneven shards with a
nearly empty rank, repeated indices, ties in max/min."""

from __future__ import annotations

import random

import pytest
import torch

from dist_pool import rank_and_world
from domainflow import Partial, Replicate, Shard, ShardTensor
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes


def _sizes(n, world, rng):
    """Random uneven sizes with one rank holding at most one row."""
    s = list(random_sizes(n, world, rng))
    if world > 1:
        k = rng.randrange(world)
        extra = s[k] - min(s[k], 1)
        s[k] -= extra
        s[(k + 1) % world] += extra
    return tuple(s)


def _gathers(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, q, c = 17, 13, 3
    x = torch.randn(n, c, generator=gen, dtype=torch.float64)
    xs, qs = _sizes(n, world, rng), _sizes(q, world, rng)
    idx = torch.randint(0, n, (q,), generator=gen)
    idx[:3] = idx[0]  # repeats
    sx = Sharded(x, [Shard(0)], {0: xs})
    si = Sharded(idx, [Shard(0)], {0: qs}, requires_grad=False)
    # index_select by a sharded index: the output follows the index's sizes
    check_sharded(lambda a, i: torch.index_select(a, 0, i), [sx, si], mesh,
                  expect_placements=[Shard(0)], expect_sizes={0: qs})
    # by a replicated (plain) index: a replicated output
    check_sharded(lambda a: a.index_select(0, idx), [sx], mesh, expect_placements=[Replicate()])
    # along a sharded dim 1
    xt = x.t().contiguous()
    check_sharded(lambda a, i: a.index_select(1, i), [Sharded(xt, [Shard(1)], {0: xs}), si], mesh,
                  expect_placements=[Shard(1)], expect_sizes={0: qs})
    # x[nbr] with a (q, k) neighbour index: the message-passing gather
    nbr = torch.randint(0, n, (q, 4), generator=gen)
    check_sharded(lambda a, i: a[i] * 2.0, [sx, Sharded(nbr, [Shard(0)], {0: qs}, requires_grad=False)], mesh,
                  expect_placements=[Shard(0)], expect_sizes={0: qs})
    # gather: an expanded (row-uniform) index and an element-wise one
    check_sharded(lambda a, i: torch.gather(a, 0, i[:, None].expand(-1, c)), [sx, si], mesh)
    check_sharded(lambda a: torch.gather(a, 0, idx[:, None].expand(q, c)), [sx], mesh)
    elem = torch.randint(0, n, (q, 2), generator=gen)
    check_sharded(lambda a, i: a.gather(0, i), [sx, Sharded(elem, [Shard(0)], {0: qs}, requires_grad=False)], mesh)
    return True


def _scatters(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, e, c = 11, 19, 3
    x = torch.randn(n, c, generator=gen, dtype=torch.float64)
    # integer-valued messages make ties in amax / amin likely
    src = torch.randint(-3, 4, (e, c), generator=gen).to(torch.float64)
    dst = torch.randint(0, n, (e,), generator=gen)
    xs, es = _sizes(n, world, rng), _sizes(e, world, rng)
    sx = Sharded(x, [Shard(0)], {0: xs})
    ss = Sharded(src, [Shard(0)], {0: es})
    sd = Sharded(dst, [Shard(0)], {0: es}, requires_grad=False)
    check_sharded(lambda a, i, s: a.index_add(0, i, s, alpha=0.5), [sx, sd, ss], mesh,
                  expect_placements=[Shard(0)], expect_sizes={0: xs})
    for reduce in ("prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_sharded(lambda a, i, s: a.index_reduce(0, i, s, reduce, include_self=include_self), [sx, sd, ss],
                          mesh)
    # an expanded index (whole rows travel) and the same index materialised (element by element)
    expanded = lambda i: i[:, None].expand(-1, c)  # noqa: E731
    si = Sharded(dst[:, None].expand(e, c).contiguous(), [Shard(0)], {0: es}, requires_grad=False)
    check_sharded(lambda a, i, s: torch.scatter_add(a, 0, expanded(i), s), [sx, sd, ss], mesh)
    check_sharded(lambda a, i, s: torch.scatter_add(a, 0, i, s), [sx, si, ss], mesh)
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_sharded(lambda a, i, s: a.scatter_reduce(0, expanded(i), s, reduce, include_self=include_self),
                          [sx, sd, ss], mesh)
            check_sharded(lambda a, i, s: a.scatter_reduce(0, i, s, reduce, include_self=include_self),
                          [sx, si, ss], mesh)
    # an element-wise index (each column its own destination) and a narrower one
    elem = torch.randint(0, n, (e, 2), generator=gen)
    se = Sharded(elem, [Shard(0)], {0: es}, requires_grad=False)
    for reduce in ("sum", "mean", "amax"):
        check_sharded(lambda a, i, s: a.scatter_reduce(0, i, s[:, :2], reduce, include_self=False), [sx, se, ss],
                      mesh)
    # into a replicated destination (e.g. one value per graph): a pending sum
    seg = torch.randint(0, 3, (e,), generator=gen)
    out = check_sharded(lambda i, s: torch.zeros(3, c, dtype=torch.float64).index_add(0, i, s),
                        [Sharded(seg, [Shard(0)], {0: es}, requires_grad=False), ss], mesh)
    assert out is not None
    # in place, on a sharded destination
    check_sharded(lambda a, i, s: (a * 1.0).index_add_(0, i, s), [sx, sd, ss], mesh)
    return True


def _message_passing(seed):
    """A two-layer point network: gather neighbour features, an MLP on edges, mean / max aggregation
    onto destinations across shards; parameters' gradients equal single-process."""
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, k, c = 23, 4, 5
    pos = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    feat = torch.randn(n, c, generator=gen, dtype=torch.float64)
    nbr = torch.randint(0, n, (n, k), generator=gen)
    sizes = _sizes(n, world, rng)
    torch.manual_seed(seed)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.edge = torch.nn.Sequential(torch.nn.Linear(c + 3, 8), torch.nn.GELU(), torch.nn.Linear(8, c))

        def forward(self, p, h, nb):
            rel = p[nb] - p.unsqueeze(1)                       # (n, k, 3) relative positions
            msg = self.edge(torch.cat([h[nb], rel], dim=-1))   # (n, k, c)
            mean = msg.mean(1)
            # scatter the same messages back onto their sources: aggregation across shards
            dst = nb.reshape(-1)
            back = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand(-1, c), msg.reshape(-1, c), "amax",
                                                      include_self=False)
            return h + mean + back

    net = torch.nn.ModuleList([Layer(), Layer()]).to(torch.float64)

    def run(p, h, nb, model):
        for layer in model:
            h = layer(p, h, nb)
        return h

    check_sharded(run, [Sharded(pos, [Shard(0)], {0: sizes}), Sharded(feat, [Shard(0)], {0: sizes}),
                        Sharded(nbr, [Shard(0)], {0: sizes}, requires_grad=False)], mesh, module=net)
    return True


def _bad_index(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    import domainflow as df

    x = df.distribute_tensor(torch.zeros(5, 2), mesh, [Shard(0)])
    rank, _ = rank_and_world()
    bad = torch.tensor([4 + rank * 10])  # out of range on every rank but rank 0
    idx = ShardTensor.from_local(bad, mesh, [Shard(0)], sharding_shapes={0: [1] * world})
    try:
        x[idx]
    except IndexError as e:
        assert "out of range" in str(e)
        return world > 1
    return world == 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gathers_by_global_index(dist, world):
    assert all(dist.run(world, _gathers, 20 + world))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scatters_by_global_index(dist, world):
    assert all(dist.run(world, _scatters, 30 + world))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_message_passing_network(dist, world):
    assert all(dist.run(world, _message_passing, 40 + world))


@pytest.mark.parametrize("world", [1, 3])
def test_out_of_range_index_fails_on_every_rank(dist, world):
    assert all(dist.run(world, _bad_index, 0))
