"""Blocks of a sharded dim (chunked inference): a block counted over the whole domain becomes each rank's
share of it, the same number of blocks on every rank, and the blocks join back to the input."""

from __future__ import annotations

import pytest
import torch

from dist_pool import rank_and_world
from domainflow import Shard
from sharded_check import get_mesh


def _blocks(sizes, points):
    import domainflow as df

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    full = torch.arange(sum(sizes) * 2, dtype=torch.float64).reshape(1, sum(sizes), 2)
    x = df.distribute_tensor(full, mesh, [Shard(1)], sharding_shapes={0: list(sizes)})
    rows = df.rows_per_block(x, 1, points)
    blocks = df.split_blocks(x, 1, rows)
    joined = df.join_blocks(blocks, 1)
    return rows, [[int(s[1]) for s in b.sharding_shapes[0]] for b in blocks], joined.full_tensor(), full


@pytest.mark.parametrize("world,sizes", [(1, [40]), (2, [20, 20]), (2, [30, 10]), (3, [0, 25, 15]), (4, [10] * 4)])
@pytest.mark.parametrize("points", [1, 8, 13, 40, 100])
def test_a_block_over_the_domain_is_each_ranks_share_of_it(dist, world, sizes, points):
    total = sum(sizes)
    count = -(-total // points)
    for rows, shapes, joined, full in dist.run(world, _blocks, sizes, points):
        torch.testing.assert_close(joined, full, rtol=0, atol=0)
        # every rank cuts its rows into at most as many blocks as the sample needs (one fewer when the last
        # block would hold one point in all), the largest rank into about 1/count of its rows each
        assert len(shapes) <= count and rows == max(1, -(-max(sizes) // count))
        assert all(s == [min(max(0, n - k * rows), rows) for n in sizes] for k, s in enumerate(shapes[:-1]))
        assert [sum(col) for col in zip(*shapes)] == list(sizes)


def test_more_ranks_smaller_blocks_the_same_count(dist):
    one = dist.run(1, _blocks, [4000], 1000)[0]
    two = dist.run(2, _blocks, [2000, 2000], 1000)[0]
    assert (one[0], len(one[1])) == (1000, 4) and (two[0], len(two[1])) == (500, 4)


def test_rows_per_block_of_a_plain_tensor_is_the_block():
    import domainflow as df

    assert df.rows_per_block(torch.zeros(1, 10, 3), 1, 4) == 4
    with pytest.raises(ValueError, match="at least one point"):
        df.rows_per_block(torch.zeros(1, 10, 3), 1, 0)


def _conv_stack(periodic):
    from torch import nn

    torch.manual_seed(3)
    mode = "circular" if periodic else "zeros"
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode=mode), nn.GELU(),
                         nn.Conv2d(8, 4, 5, padding=2, padding_mode=mode)).double()  # reach 1 + 2 = 3 rows


def _blockwise_conv(sizes, rows, halo, periodic):
    import domainflow as df

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    model = _conv_stack(periodic)
    full = torch.randn(1, 3, sum(sizes), 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x = df.distribute_tensor(full, mesh, [Shard(2)], sharding_shapes={0: list(sizes)})
    out = df.blockwise(model, x, rows, halo=halo, dim=2, periodic=periodic)
    with torch.no_grad():
        whole = model(full)
    return out.full_tensor(), whole, [int(s[2]) for s in out.sharding_shapes[0]]


@pytest.mark.parametrize("world,sizes", [(1, [17]), (2, [9, 8]), (3, [0, 11, 2])])
@pytest.mark.parametrize("periodic", [False, True])
def test_blockwise_convolutions_with_their_reach_as_halo_equal_the_whole(dist, world, sizes, periodic):
    """A conv stack of reach 3 in blocks of 1, 4 or 64 rows per rank with a halo of 3 (one exchange with
    the neighbours, zeros or the other end's rows beyond the ends) equals the stack on the whole grid; a
    halo of 2 does not (the check can fail)."""
    for rows in (1, 4, 64):
        for out, whole, shapes in dist.run(world, _blockwise_conv, sizes, rows, 3, periodic):
            torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)
            assert shapes == list(sizes)
    out, whole, _ = dist.run(world, _blockwise_conv, sizes, 4, 2, periodic)[0]
    assert not torch.allclose(out, whole)


def _knn_blocks(sizes, rows, k):
    """Mean of each point's k nearest points' features, whole and with the queries in blocks."""
    import domainflow as df

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(5)
    pts = torch.rand(sum(sizes), 3, generator=gen, dtype=torch.float64)
    feats = torch.randn(sum(sizes), 4, generator=gen, dtype=torch.float64)
    p = df.distribute_tensor(pts, mesh, [Shard(0)], sharding_shapes={0: list(sizes)})
    f = df.distribute_tensor(feats, mesh, [Shard(0)], sharding_shapes={0: list(sizes)})

    def layer(queries):
        idx, _ = df.knn(p, k, queries)
        return f.index_select(0, idx.reshape(-1)).reshape(-1, k, 4).mean(1)

    with torch.no_grad():
        whole = layer(p)
        blocks = df.join_blocks([layer(q) for q in df.split_blocks(p, 0, rows)], 0)
    _, idx = torch.cdist(pts, pts).topk(k, largest=False)
    return whole.full_tensor(), blocks.full_tensor(), feats[idx].mean(1)


@pytest.mark.parametrize("world,sizes", [(1, [23]), (2, [12, 11]), (3, [0, 15, 8])])
def test_knn_layers_in_blocks_of_queries_equal_the_whole(dist, world, sizes):
    """Blocks of queries search all points (every rank's): a knn layer run block by block equals the
    whole layer and a dense search on one process."""
    for whole, blocks, dense in dist.run(world, _knn_blocks, sizes, 5, 4):
        torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(whole, dense, rtol=1e-12, atol=1e-12)


def test_blockwise_refuses_a_function_that_changes_the_length():
    import domainflow as df

    with pytest.raises(ValueError, match="must keep it"):
        df.blockwise(lambda t: t[:, :, 1:], torch.zeros(1, 2, 10), 4, halo=1, dim=2)
    torch.testing.assert_close(df.blockwise(lambda t: t * 2, torch.ones(1, 2, 10), 3, halo=1, dim=2),
                               torch.full((1, 2, 10), 2.0))


def _blockwise_refusals():
    import domainflow as df
    from domainflow import Partial

    mesh = get_mesh((1, 1), ("lat", "lon"))
    t = torch.zeros(1, 2, 6, 4)
    msgs = []
    for placements in ([Shard(2), Shard(3)], [Shard(2), Partial()]):
        x = df.ShardTensor.from_local(t, mesh, placements)
        try:
            df.blockwise(lambda b: b, x, 2, halo=1, dim=2)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_blockwise_refuses_another_sharded_dim_and_pending_sums(dist):
    msgs = dist.run(1, _blockwise_refusals)[0]
    assert len(msgs) == 2 and "also sharded on dim 3" in msgs[0] and "pending sum" in msgs[1]
