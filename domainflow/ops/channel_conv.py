"""Convolutions (and transposed ones) with the input-channel dim sharded: each rank convolves its channels with
its slice of the weight, and the output is a pending sum (``Partial``) over those ranks, reduced where it is
used; the bias is added by one rank. The weight's gradient is summed over the ranks (each fills its slice).
Batch sharding may come with it; spatial sharding with it is refused (shard one or the other)."""

from __future__ import annotations

import torch

from domainflow.dispatch.toolkit import params_for, unsupported_or_fallback, without_partial
from domainflow.layout.placements import Partial, Shard
from domainflow.layout.spec import ShardSpec
from domainflow.tensor.shard_tensor import ShardTensor


def channel_sharded(x: ShardTensor) -> bool:
    """Whether ``x``'s channel dim (1) is sharded."""
    return x._spec.mesh_dim_of(1) is not None


def channel_conv(func, x: ShardTensor, weight, bias, transposed: bool, conv_args: tuple, args, kwargs):
    """``func(x, weight, bias, *conv_args)`` with x's channel dim sharded (groups 1)."""
    x = without_partial(x)
    spec = x._spec
    groups = conv_args[-2] if transposed else conv_args[-1]
    if groups != 1:
        return unsupported_or_fallback(func, args, kwargs, "the channel dim is sharded and groups > 1")
    if any(isinstance(p, Shard) and p.dim > 1 for p in spec.placements) or spec.shard_dims.count(1) > 1:
        return unsupported_or_fallback(func, args, kwargs, "the channel dim and a spatial dim are both sharded "
                                       "(shard one of them)")
    m = spec.mesh_dim_of(1)
    me = spec.coord[m]
    lo, n = spec.offsets[1], spec.sizes[m][me]
    sharded = [k for k, p in enumerate(spec.placements) if isinstance(p, Shard)]  # channels, and batch if any
    (w,) = params_for(spec.mesh, sharded, weight)
    w_part = w[lo:lo + n] if transposed else w[:, lo:lo + n]
    local = x.to_local()
    out_shape = func(torch.empty(local.shape[0], weight.shape[1 if not transposed else 0], *local.shape[2:],
                                 device="meta", dtype=local.dtype), weight.to("meta"), None, *conv_args).shape
    if n:
        out = func(local, w_part, None, *conv_args)
    else:  # no channels here: zeros, still from the weight and input (every rank's backward then runs)
        out = local.new_zeros(out_shape) + 0 * (local.sum() + w_part.sum())
    if bias is not None:
        (b,) = params_for(spec.mesh, sharded, bias)  # one rank of m adds it; every batch shard's gradient counts
        b = b.reshape(-1, *([1] * (out.ndim - 2)))
        out = out + (b if me == 0 else 0 * b)
    placements = [Partial("sum") if k == m else p for k, p in enumerate(spec.placements)]
    sizes = [None if k == m else s for k, s in enumerate(spec.sizes)]
    global_shape = (spec.shape[0], *out_shape[1:])
    return ShardTensor.from_spec(out, ShardSpec(spec.mesh, placements, global_shape, sizes))
