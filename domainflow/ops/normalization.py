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
from .windows import _without_partial, like


def _sharded_mesh_dims(spec, allowed_dims) -> tuple[list[int], str | None]:
    dims = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            if p.dim not in allowed_dims:
                return [], f"dim {p.dim} is sharded; these statistics need it whole (shard batch or spatial dims)"
            dims.append(m)
    return dims, None


def _global_moments(xs: torch.Tensor, dims: tuple[int, ...], count: int, spec, reduce_mesh_dims):
    """Mean and biased variance (float64, no gradient) of ``xs`` over ``dims`` and the ranks of
    ``reduce_mesh_dims``: one all-reduce per mesh dim carries the sums and the sums of squares."""
    with torch.no_grad():
        sums = torch.stack([xs.sum(dims, dtype=torch.float64), (xs * xs).sum(dims, dtype=torch.float64)])
        for m in reduce_mesh_dims:
            sums = comm.all_reduce(sums.contiguous(), "sum", spec.mesh, m)
        mean = sums[0] / count
        var = (sums[1] / count - mean * mean).clamp_min(0)
    return mean, var


def _keep(t: torch.Tensor, dims, ndim: int) -> torch.Tensor:
    """Re-insert the reduced ``dims`` as size-1 dims (broadcastable against the input)."""
    for d in sorted(dims):
        t = t.unsqueeze(d)
    return t if t.ndim == ndim else t.reshape(t.shape + (1,) * (ndim - t.ndim))


class _Normalize(torch.autograd.Function):
    """y = (x - mean) * rstd * weight + bias with statistics over ``dims`` and the ranks of ``mesh_dims``.

    Saves only the input and the (small) statistics, like torch's fused norms, and recomputes the normalised
    values in backward. With batch statistics the input gradient needs two global means of the output
    gradient: one all-reduce per mesh dim; with fixed statistics (eval) it is local. Weight and bias
    gradients are summed over ``param_mesh_dims`` in one coalesced all-reduce.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, rstd, dims, count, spec, mesh_dims, param_mesh_dims, batch_stats,
                affine_shape):
        xhat = (x - mean) * rstd
        y = xhat
        if weight is not None:
            y = y * weight.reshape(affine_shape)
        if bias is not None:
            y = y + bias.reshape(affine_shape)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.params, ctx.bias_shape = (weight, bias), (bias.shape if bias is not None else None)
        ctx.args = (dims, count, spec, mesh_dims, param_mesh_dims, batch_stats, affine_shape, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dims, count, spec, mesh_dims, param_mesh_dims, batch_stats, affine_shape, has_bias = ctx.args
        xhat = (x - mean) * rstd
        g = dy * weight.reshape(affine_shape) if weight is not None else dy
        if batch_stats:
            sums = torch.stack([g.sum(dims, dtype=torch.float64), (g * xhat).sum(dims, dtype=torch.float64)])
            for m in mesh_dims:
                sums = comm.all_reduce(sums.contiguous(), "sum", spec.mesh, m)
            mg = _keep(sums[0] / count, dims, x.ndim).to(x.dtype)
            mgx = _keep(sums[1] / count, dims, x.ndim).to(x.dtype)
            dx = (g - mg - xhat * mgx) * rstd
        else:
            dx = g * rstd
        from ..param_grads import reduce_param_grads

        keep = [k for k, n in enumerate(affine_shape) if n != 1]
        other = tuple(k for k in range(x.ndim) if k not in keep)
        gw = (dy * xhat).sum(other).reshape(weight.shape) if weight is not None else None
        gb = dy.sum(other).reshape(ctx.bias_shape) if has_bias else None
        gw, gb = reduce_param_grads(ctx.params, [gw, gb], spec.mesh, param_mesh_dims)
        return dx, gw, gb, None, None, None, None, None, None, None, None, None


def _normalize(x_local, weight, bias, mean, var, eps, dims, count, spec, mesh_dims, param_mesh_dims, batch_stats,
               affine_shape):
    rstd = torch.rsqrt(var + eps)
    mean = _keep(mean, dims, x_local.ndim).to(x_local.dtype) if mean.ndim < x_local.ndim else mean.to(x_local.dtype)
    rstd = _keep(rstd, dims, x_local.ndim).to(x_local.dtype) if rstd.ndim < x_local.ndim else rstd.to(x_local.dtype)
    return _Normalize.apply(x_local, weight, bias, mean, rstd, dims, count, spec, mesh_dims, param_mesh_dims,
                            batch_stats, affine_shape)


def _prepare(func, args, kwargs, x, others):
    """(x, spec, sharded mesh dims) for a norm over a batch/space-sharded input, or the result of the
    default or refusing path as ``(None, result, None)``."""
    if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) for t in others):
        return None, run_function_default(func, args, kwargs), None
    x = _without_partial(x)
    mesh_dims, why = _sharded_mesh_dims(x._spec, {0} | set(range(2, x.ndim)))
    if why:
        return None, _unsupported_or_fallback(func, args, kwargs, why), None
    return x, x._spec, mesh_dims


def _group_norm(func, args, kwargs):
    a = bind(args, kwargs, ("self", "num_groups", "weight", "bias", "eps"), weight=None, bias=None, eps=1e-5)
    x, spec, mesh_dims = _prepare(func, args, kwargs, a["self"], (a["weight"], a["bias"]))
    if x is None:
        return spec
    spatial_mesh_dims = [m for m in mesh_dims if spec.placements[m].dim >= 2]
    G = a["num_groups"]
    C = x.shape[1]
    local = x.to_local()
    view = local.reshape(local.shape[0], G, C // G, *local.shape[2:])  # stats per (sample, group)
    dims = tuple(range(2, view.ndim))
    count = (C // G) * (int(torch.tensor(x.shape[2:]).prod().item()) if x.ndim > 2 else 1)
    mean, var = _global_moments(view, dims, count, spec, spatial_mesh_dims)
    affine = (1, G, C // G) + (1,) * (x.ndim - 2)
    y = _normalize(view, a["weight"], a["bias"], mean, var, a["eps"], dims, count, spec, spatial_mesh_dims,
                   mesh_dims, True, affine)
    return like(spec, y.reshape(local.shape))


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
    x, spec, mesh_dims = _prepare(func, args, kwargs, a["self"],
                                  (a["weight"], a["bias"], a["running_mean"], a["running_var"]))
    if x is None:
        return spec
    local = x.to_local()
    C = x.shape[1]
    spatial = tuple(range(2, x.ndim))
    affine = (1, C) + (1,) * (x.ndim - 2)
    n_space = int(torch.tensor(x.shape[2:]).prod().item()) if x.ndim > 2 else 1
    if stats_over_batch:
        dims, reduce_mesh, count = (0,) + spatial, mesh_dims, x.shape[0] * n_space
    else:
        dims, reduce_mesh, count = spatial, [m for m in mesh_dims if spec.placements[m].dim >= 2], n_space
    if use_batch_stats:
        mean, var = _global_moments(local, dims, count, spec, reduce_mesh)
        rm, rv = a["running_mean"], a["running_var"]
        if rm is not None and rv is not None:
            with torch.no_grad():  # identical on every rank: the statistics are global
                m = a["momentum"] if a["momentum"] is not None else 0.0
                unbiased = var * (count / max(count - 1, 1))
                rm.mul_(1 - m).add_((mean if stats_over_batch else mean.mean(0)).to(rm.dtype), alpha=m)
                rv.mul_(1 - m).add_((unbiased if stats_over_batch else unbiased.mean(0)).to(rv.dtype), alpha=m)
        y = _normalize(local, a["weight"], a["bias"], mean, var, a["eps"], dims, count, spec, reduce_mesh,
                       mesh_dims, True, affine)
    else:
        mean = a["running_mean"].reshape(affine)
        var = a["running_var"].reshape(affine)
        y = _normalize(local, a["weight"], a["bias"], mean, var, a["eps"], dims, count, spec, [], mesh_dims, False,
                       affine)
    return like(spec, y)


register_function(F.group_norm)(_group_norm)
register_function(F.batch_norm)(_batch_norm)
register_function(F.instance_norm)(_instance_norm)
