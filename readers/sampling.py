"""Sample order per epoch and its split over data-parallel ranks.

Every sample is seen exactly once per epoch over the dp axis, whatever the number of samples: rank d takes
positions ``d, d + D, d + 2D, ...`` of the epoch's order. Ranks that run out before the others get padding
steps (a real sample with weight 0), so every rank takes the same number of steps and no collective waits
for a rank that stopped; a loss multiplied by the weight makes padding contribute nothing.
"""

from __future__ import annotations

import numpy as np


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Indices ``0..n-1`` in this epoch's order (a permutation seeded by ``(seed, epoch)``)."""
    if not shuffle:
        return list(range(n))
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def dp_share(order: list[int], dp_rank: int, dp_size: int) -> list[tuple[int, float]]:
    """(sample index, weight) for each step of ``dp_rank``: weight 1 for its own samples, 0 for padding."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp rank {dp_rank} outside a dp axis of {dp_size}")
    n = len(order)
    if n == 0:
        return []
    steps = -(-n // dp_size)
    out = []
    for k in range(steps):
        pos = k * dp_size + dp_rank
        out.append((order[pos], 1.0) if pos < n else (order[pos % n], 0.0))
    return out
