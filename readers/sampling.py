"""Sample order per epoch, its split over data-parallel ranks, and the points drawn of a sample per step.

Every sample is seen exactly once per epoch over the dp axis, whatever the number of samples: rank d takes
positions ``d, d + D, d + 2D, ...`` of the epoch's order. Ranks that run out before the others get padding
steps (a real sample with weight 0), so every rank takes the same number of steps and no collective waits
for a rank that stopped; a loss multiplied by the weight makes padding contribute nothing.

``PointDraw`` picks the rows of a sample a step trains on (``data.sample_points``): one uniform draw over the
whole sample, of which each domain rank reads the rows it holds.
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


DRAW_BLOCK = 1 << 20  # rows per block of a point draw: fixed, so a draw never depends on how ranks split the rows


class PointDraw:
    """``k`` distinct rows of a ``n_rows``-row sample drawn uniformly (a simple random sample without
    replacement), keyed by ``key`` (e.g. seed, epoch, run): the same key gives the same rows on any number of
    ranks, and any rank can find its own rows and every rank's count without communication.

    The draw is made in two stages that together are exactly a simple random sample: how many of the ``k``
    rows fall in each block of ``DRAW_BLOCK`` rows (multivariate hypergeometric), then which rows of a block
    (a uniform choice of that many). A rank draws only the blocks its rows touch, so memory and time follow
    ``k`` and the rank's share, not the whole sample."""

    def __init__(self, n_rows: int, k: int, key, block: int = DRAW_BLOCK):
        if k < 0:
            raise ValueError(f"a point draw needs k >= 0, got {k}")
        self.n, self.k, self.block = int(n_rows), min(int(k), int(n_rows)), int(block)
        self.key = [int(v) & 0xFFFFFFFFFFFFFFFF for v in key]
        sizes = np.full(-(-self.n // self.block), self.block, dtype=np.int64)
        if self.n % self.block:
            sizes[-1] = self.n % self.block
        self._sizes = sizes
        if len(sizes) == 1:
            self._counts = np.array([self.k], dtype=np.int64)
        elif len(sizes):
            self._counts = np.random.default_rng([*self.key, 0]).multivariate_hypergeometric(sizes, self.k)
        else:
            self._counts = np.zeros(0, dtype=np.int64)
        self._blocks: dict[int, np.ndarray] = {}

    def _rows_of_block(self, b: int) -> np.ndarray:
        hit = self._blocks.get(b)
        if hit is None:
            rng = np.random.default_rng([*self.key, 1, b])
            chosen = rng.choice(int(self._sizes[b]), size=int(self._counts[b]), replace=False, shuffle=False)
            hit = self._blocks[b] = np.sort(chosen).astype(np.int64) + b * self.block
        return hit

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """The drawn row ids in ``[lo, hi)``, ascending."""
        if hi <= lo:
            return np.zeros(0, dtype=np.int64)
        first, last = lo // self.block, (hi - 1) // self.block
        parts = []
        for b in range(first, last + 1):
            ids = self._rows_of_block(b)
            if b == first or b == last:
                ids = ids[(ids >= lo) & (ids < hi)]
            parts.append(ids)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def rows_at(self, first: int, stop: int) -> np.ndarray:
        """The drawn row ids at positions ``[first, stop)`` of the ascending draw (only the blocks they lie in are
        drawn): a balanced split of the draw over ranks, whatever rows each rank's region holds."""
        stop = min(stop, self.k)
        if stop <= first:
            return np.zeros(0, dtype=np.int64)
        ends = np.cumsum(self._counts)  # position after the last drawn row of each block
        b0, b1 = int(np.searchsorted(ends, first, side="right")), int(np.searchsorted(ends, stop - 1, side="right"))
        ids = np.concatenate([self._rows_of_block(b) for b in range(b0, b1 + 1)])
        start = int(ends[b0 - 1]) if b0 else 0  # position of the first drawn row of block b0
        return ids[first - start:stop - start]

    def count(self, lo: int, hi: int) -> int:
        """How many drawn rows fall in ``[lo, hi)`` (only the two edge blocks are drawn for it)."""
        if hi <= lo:
            return 0
        first, last = lo // self.block, (hi - 1) // self.block
        total = 0
        for b in range(first, last + 1):
            start, stop = b * self.block, b * self.block + int(self._sizes[b])
            if lo <= start and stop <= hi:
                total += int(self._counts[b])
            else:
                ids = self._rows_of_block(b)
                total += int(np.count_nonzero((ids >= lo) & (ids < hi)))
        return total
