"""Z-score normalisation from a store's train-split statistics, and its inverse for predictions."""

from __future__ import annotations

import numpy as np
import torch


class Normalizer:
    """``(x - mean) / std`` per component for each store key (e.g. "surface/Cp", "grid/t2m").

    A component with zero spread (a constant over the train split) is only shifted (std taken as 1), so
    normalising never divides by zero. Works on plain tensors and ShardTensors alike (pointwise ops with
    replicated statistics need no communication).
    """

    def __init__(self, stats: dict):
        self._stats = {k: (np.asarray(v["mean"], np.float64), np.asarray(v["std"], np.float64))
                       for k, v in stats.items()}

    def keys(self):
        return self._stats.keys()

    def _moments(self, key: str, like: torch.Tensor, channel_dim: int):
        if key not in self._stats:
            raise KeyError(f"no statistics for {key!r}; the store has statistics for {sorted(self._stats)}")
        mean, std = self._stats[key]
        std = np.where(std > 0, std, 1.0)
        shape = [1] * like.ndim
        shape[channel_dim] = len(mean)
        as_tensor = lambda a: torch.as_tensor(a, dtype=like.dtype, device=like.device).reshape(shape)  # noqa: E731
        return as_tensor(mean), as_tensor(std)

    def normalize(self, key: str, x: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
        mean, std = self._moments(key, x, channel_dim)
        return (x - mean) / std

    def denormalize(self, key: str, x: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
        mean, std = self._moments(key, x, channel_dim)
        return x * std + mean
