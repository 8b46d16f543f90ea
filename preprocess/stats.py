"""Mergeable per-channel statistics (count, mean, std, min, max) for normalisation.

Each ingest task summarises its own rows; summaries merge pairwise with Chan et al.'s parallel
variance update, so the result does not depend on how rows were split between tasks (up to rounding)
and never needs all rows in memory. ``std`` is the population standard deviation (ddof = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RunningStats:
    """Sufficient statistics of an (N, C) sample: count, mean (C,), sum of squared deviations m2 (C,),
    min (C,), max (C,)."""

    count: int
    mean: np.ndarray
    m2: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @classmethod
    def empty(cls, channels: int) -> "RunningStats":
        z = np.zeros(channels, dtype=np.float64)
        return cls(0, z.copy(), z.copy(), np.full(channels, np.inf), np.full(channels, -np.inf))

    @classmethod
    def of(cls, values: np.ndarray) -> "RunningStats":
        """Statistics of ``values`` (N, C) or (N,)."""
        x = np.asarray(values, dtype=np.float64)
        if x.ndim == 1:
            x = x[:, None]
        if not np.isfinite(x).all():
            raise ValueError("statistics of values containing NaN/Inf; the ingest must reject such fields first")
        if len(x) == 0:
            return cls.empty(x.shape[1])
        cols = np.ascontiguousarray(x.T)  # one contiguous row per channel: reductions run at memory speed
        mean = cols.mean(axis=1)
        return cls(len(x), mean, ((cols - mean[:, None]) ** 2).sum(axis=1), cols.min(axis=1), cols.max(axis=1))

    def merge(self, other: "RunningStats") -> "RunningStats":
        """Combined statistics of both samples (Chan, Golub & LeVeque)."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta ** 2 * (self.count * other.count / n)
        return RunningStats(n, mean, m2, np.minimum(self.min, other.min), np.maximum(self.max, other.max))

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / self.count) if self.count else np.full_like(self.mean, np.nan)

    def to_attrs(self) -> dict:
        """The store's ``attrs.stats`` entry: JSON-ready lists."""
        return {"count": int(self.count), "mean": self.mean.tolist(), "std": self.std.tolist(),
                "min": self.min.tolist(), "max": self.max.tolist()}

    @classmethod
    def from_attrs(cls, d: dict) -> "RunningStats":
        mean, std = np.asarray(d["mean"], float), np.asarray(d["std"], float)
        return cls(int(d["count"]), mean, std ** 2 * int(d["count"]), np.asarray(d["min"], float),
                   np.asarray(d["max"], float))


def merge_all(items) -> RunningStats | None:
    """Merge an iterable of summaries (a tree reduction keeps rounding low for many items)."""
    items = [s for s in items if s is not None]
    if not items:
        return None
    while len(items) > 1:
        items = [items[i].merge(items[i + 1]) if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]
