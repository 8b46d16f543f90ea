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
