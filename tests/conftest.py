"""Shared pytest fixtures: multi-process pools with real (Gloo) process groups.

    from dist_pool import WORLD_SIZES, current_op, rank_and_world

    def _sum_ranks():                         # module level: sent to the workers by reference
        rank, world = rank_and_world()
        t = torch.tensor([float(rank)])
        with current_op("all_reduce of ranks"):
            torch.distributed.all_reduce(t)
        return t

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_sum(dist, world_size):
        out = dist.run(world_size, _sum_ranks)      # one result per rank, in rank order
        ...

(or request the ``world_size`` fixture, which is parametrised over WORLD_SIZES.)
"""

from __future__ import annotations

import os
import sys

# the harness (dist_pool, sharded_check, store_compare) is imported by module name, by tests and workers alike
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")
if sys.path[:1] != [_HERE]:
    if _HERE in sys.path:
        sys.path.remove(_HERE)
    sys.path.insert(0, _HERE)

import pytest  # noqa: E402
from dist_pool import WORLD_SIZES, PoolCache  # noqa: E402


@pytest.fixture(scope="session")
def dist():
    """Session-wide pools, one per world size: ``dist.run(world_size, fn, *args, **kwargs)``."""
    cache = PoolCache()
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture(params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def world_size(request):
    """Parametrises a test over WORLD_SIZES (1, 2, 3, 4)."""
    return request.param
