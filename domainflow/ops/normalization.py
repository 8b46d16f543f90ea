"""Normalization layers on grids sharded over batch and/or spatial dims: group, batch and instance norm.

Statistics need sums over the sharded dims: each rank sums its block (in float64), and one all-reduce per
sharded mesh dim carries the sums and the sums of squares together. The normalisation itself is local.
Running statistics (batch norm) are updated in place from the global statistics, so they are identical on
every rank and equal to single-device training. Affine parameters get their gradients summed over the
sharded mesh dims once, in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..dispatch import _unsupported_or_fallback, bind, run_function_default
from ..placements import Shard
from ..registry import register_function
from ..shard_tensor import ShardTensor
from .windows import _params_for, _without_partial


def _like(spec, local: torch.Tensor) -> ShardTensor:
    """``local`` wrapped with ``spec``'s layout (same sizes; no communication)."""
    mapping = {m: list(s) for m, s in enumerate(spec.sizes) if s is not None}
    return ShardTensor.from_local(local, spec.mesh, list(spec.placements), sharding_shapes=mapping)


def _sharded_mesh_dims(spec, allowed_dims) -> tuple[list[int], str | None]:
    dims = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            if p.dim not in allowed_dims:
                return [], f"dim {p.dim} is sharded; these statistics need it whole (shard batch or spatial dims)"
            dims.append(m)
    return dims, None


def _global_moments(xs: torch.Tensor, dims: tuple[int, ...], count: int, spec, reduce_mesh_dims):
    """Mean and biased variance of ``xs`` over ``dims`` and the ranks of ``reduce_mesh_dims`` (float64;
    one all-reduce per mesh dim carries both sums)."""
    x64 = xs.to(torch.float64)
    sums = torch.stack([x64.sum(dims), (x64 * x64).sum(dims)])
    for m in reduce_mesh_dims:
        sums = comm.all_reduce_sum_autograd(sums, spec.mesh, m)
    mean = sums[0] / count
    var = (sums[1] / count - mean * mean).clamp_min(0)
    return mean, var


def _group_norm(func, args, kwargs):
    a = bind(args, kwargs, ("self", "num_groups", "weight", "bias", "eps"), weight=None, bias=None, eps=1e-5)
    x = a["self"]
    if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) for t in (a["weight"], a["bias"])):
        return run_function_default(func, args, kwargs)
    x = _without_partial(x)
    spec = x._spec
    mesh_dims, why = _sharded_mesh_dims(spec, {0} | set(range(2, x.ndim)))
    if why:
        return _unsupported_or_fallback(func, args, kwargs, why)
    spatial_mesh_dims = [m for m in mesh_dims if spec.placements[m].dim >= 2]
    G = a["num_groups"]
    C = x.shape[1]
    local = x.to_local()
    n_local = local.shape[0]
    grouped = local.reshape(n_local, G, -1)
    count = (C // G) * int(torch.tensor(x.shape[2:]).prod().item()) if x.ndim > 2 else C // G
    mean, var = _global_moments(grouped, (2,), count, spec, spatial_mesh_dims)
    inv = torch.rsqrt(var + a["eps"])
    y = ((grouped - mean[..., None].to(local.dtype)) * inv[..., None].to(local.dtype)).reshape(local.shape)
    weight, bias = _params_for(spec.mesh, mesh_dims, a["weight"], a["bias"])
    shape = (1, C) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return _like(spec, y)


def _batch_norm(func, args, kwargs):
    a = bind(args, kwargs, ("self", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
             running_mean=None, running_var=None, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5)
    return _channel_norm(func, args, kwargs, a, stats_over_batch=True, use_batch_stats=a["training"])


def _instance_norm(func, args, kwargs):
    a = bind(args, kwargs, ("self", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum",
                            "eps"),
             running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1,
             eps=1e-5)
    return _channel_norm(func, args, kwargs, a, stats_over_batch=False, use_batch_stats=a["use_input_stats"])


def _channel_norm(func, args, kwargs, a, stats_over_batch: bool, use_batch_stats: bool):
    """Batch norm (statistics per channel over batch and space) and instance norm (per sample and channel
    over space)."""
    x = a["self"]
    tensors = (a["weight"], a["bias"], a["running_mean"], a["running_var"])
    if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) for t in tensors):
        return run_function_default(func, args, kwargs)
    x = _without_partial(x)
    spec = x._spec
    mesh_dims, why = _sharded_mesh_dims(spec, {0} | set(range(2, x.ndim)))
    if why:
        return _unsupported_or_fallback(func, args, kwargs, why)
    local = x.to_local()
    C = x.shape[1]
    spatial = tuple(range(2, x.ndim))
    shape = (1, C) + (1,) * (x.ndim - 2)
    n_space = int(torch.tensor(x.shape[2:]).prod().item()) if x.ndim > 2 else 1
    if use_batch_stats:
        if stats_over_batch:
            reduce_dims, reduce_mesh = (0,) + spatial, mesh_dims
            count = x.shape[0] * n_space
        else:
            reduce_dims, reduce_mesh = spatial, [m for m in mesh_dims if spec.placements[m].dim >= 2]
            count = n_space
        mean, var = _global_moments(local, reduce_dims, count, spec, reduce_mesh)
        rm, rv = a["running_mean"], a["running_var"]
        if rm is not None and rv is not None:
            with torch.no_grad():  # identical on every rank: the statistics are global
                m = a["momentum"] if a["momentum"] is not None else 0.0
                bm = mean if stats_over_batch else mean.mean(0)
                bv = var * (count / max(count - 1, 1))
                bv = bv if stats_over_batch else bv.mean(0)
                rm.mul_(1 - m).add_(bm.to(rm.dtype), alpha=m)
                rv.mul_(1 - m).add_(bv.to(rv.dtype), alpha=m)
        if stats_over_batch:
            mean, var = mean.reshape(shape), var.reshape(shape)
        else:
            mean = mean.reshape(local.shape[:2] + (1,) * (x.ndim - 2))
            var = var.reshape(local.shape[:2] + (1,) * (x.ndim - 2))
    else:
        mean, var = a["running_mean"].reshape(shape), a["running_var"].reshape(shape)
    y = (local - mean.to(local.dtype)) * torch.rsqrt(var + a["eps"]).to(local.dtype)
    weight, bias = _params_for(spec.mesh, mesh_dims, a["weight"], a["bias"])
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return _like(spec, y)


register_function(F.group_norm)(_group_norm)
register_function(F.batch_norm)(_batch_norm)
register_function(F.instance_norm)(_instance_norm)
