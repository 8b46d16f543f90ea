"""A collective that another rank never joins fails with domainflow's own error, naming the rank, the
op and the mesh dim, within the process group's timeout (no silent hang)."""

from __future__ import annotations

import time

import pytest
import torch

import domainflow as df
from dist_pool import RankFailure, WorkerPool, rank_and_world
from domainflow import Shard


def _rank0_skips_the_gather():
    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    x = df.distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)], sharding_shapes={0: (1, 2)})
    if rank == 0:
        return "skipped"
    return x.full_tensor()  # waits for rank 0 forever without a timeout


def test_missing_rank_gives_named_collective_error():
    with WorkerPool(2, timeout=60, pg_timeout=3, grace=30) as pool:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_rank0_skips_the_gather)
        elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "CollectiveError" in msg
    assert "rank 1: all_gather over mesh dim 'domain'" in msg
    assert "another rank did not enter the same collective" in msg
    assert elapsed < 45
