"""domainflow as an array backend for libraries that pick one by the operand's module (opt_einsum, and tensorly
and neuraloperator through it): they take ``type(x).__module__``'s top package, ``domainflow`` for a ShardTensor,
and call its numpy-style ``tensordot``, ``transpose`` and ``einsum``. Without these opt_einsum falls back to
numpy and fails on a tensor that requires grad; with them a ShardTensor stays a torch tensor and the
contraction runs through the engine like any torch call."""

from __future__ import annotations

import torch


def tensordot(x: torch.Tensor, y: torch.Tensor, axes=2) -> torch.Tensor:
    """numpy.tensordot: ``axes`` an int or a pair of sequences of dims."""
    return torch.tensordot(x, y, dims=axes)


def transpose(x: torch.Tensor, axes=None) -> torch.Tensor:
    """numpy.transpose: ``axes`` a permutation of all dims (None: reversed), not torch's two-dim swap."""
    return x.permute(*(reversed(range(x.ndim)) if axes is None else axes))


def einsum(equation: str, *operands: torch.Tensor, **_numpy_options) -> torch.Tensor:
    """numpy.einsum's call form; numpy-only options (``order``, ``casting``, ``optimize``) are ignored: torch
    chooses its own contraction order."""
    return torch.einsum(equation, *operands)
