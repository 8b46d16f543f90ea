"""Normalization layers on sharded tensors: group, batch and instance norm on grids sharded over batch and/or
spatial dims; layer norm over sharded trailing dims (the aten handler in ``dimwise`` runs the local case).

Statistics need sums over the sharded dims: each rank sums its block (in float64), and one all-reduce per
sharded mesh dim carries the sums and the sums of squares together. The normalisation itself is local.
Running statistics (batch norm) are updated in place from the global statistics, so they are identical on
every rank and equal to single-device training. Affine parameters get their gradients summed over the
sharded mesh dims once, in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from domainflow import comm
from domainflow.dispatch.toolkit import Schema, layout_rule, params_for, run_function_default, unsupported_or_fallback
from domainflow.layout.placements import Shard
from domainflow.dispatch.registry import register_function
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.dispatch.toolkit import spec_like, without_partial


@layout_rule
def _sharded_mesh_dims(spec) -> tuple[tuple[int, ...], str | None]:
    """The mesh dims sharding the batch or spatial dims of a norm's input (N, C, *spatial), or why its
    statistics cannot be taken sharded (the channel dim is sharded)."""
    dims = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            if p.dim == 1:
                return (), f"dim {p.dim} is sharded; these statistics need it whole (shard batch or spatial dims)"
            dims.append(m)
    return tuple(dims), None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of local sums: float32 for half types (as torch's own norms), else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _sum(t: torch.Tensor, dims, dtype=None) -> torch.Tensor:
    """``t`` summed over ``dims`` keeping them (size 1); no dims: ``t`` itself (torch would sum them all)."""
    return t.sum(dims, keepdim=True, dtype=dtype) if dims else (t if dtype is None else t.to(dtype))


def _keepdim_shape(x: torch.Tensor, dims) -> list[int]:
    return [1 if d in dims else n for d, n in enumerate(x.shape)]


def _centred_moments(xs: torch.Tensor, dims: tuple[int, ...], count: int, spec, reduce_mesh_dims):
    """Global mean and biased variance (float64, keepdim shape, no gradient) of ``xs`` over ``dims`` and the
    ranks of ``reduce_mesh_dims``; also the block centred on its own local mean, ``xs - shift``, and
    ``delta = mean - shift``.

    Each rank centres its block before squaring, so the sum of squares has no cancellation even where
    |mean| >> std (say raw temperatures in kelvin). The local shifts and centred sums are combined exactly
    in float64 (Chan's pairwise formula, written as sums) by one all-reduce per mesh dim. The centred block
    is what the normalisation saves for backward, in place of the input (same size).
    """
    acc = _acc_dtype(xs.dtype)
    n_loc = 1
    for d in dims:
        n_loc *= xs.shape[d]
    with torch.no_grad():
        if n_loc:
            shift = _sum(xs, dims, acc).div(n_loc).to(xs.dtype)
        else:
            shift = xs.new_zeros(_keepdim_shape(xs, dims))
        centred = xs - shift
        m2 = _sum(centred.square(), dims, acc).double()
        s = shift.double()
        sums = torch.stack([s * n_loc, m2 + n_loc * s * s])
        for m in reduce_mesh_dims:
            sums = comm.all_reduce(sums.contiguous(), "sum", spec.mesh, m)
        mean = sums[0] / count
        var = (sums[1] / count - mean * mean).clamp_min(0)
    return mean, var, centred, mean - s


class _Normalize(torch.autograd.Function):
    """y = (centred - delta) * rstd * weight + bias, where ``centred`` is the input less a per-block shift
    and ``delta`` the global mean less that shift; statistics over ``dims`` and the ranks of ``mesh_dims``.

    ``x`` (the input) only links the graph; the centred block and the small statistics are saved, as in
    torch's fused norms, and the backward works from per-cell sums (a cell: one index of the dims kept by the
    statistics or the affine parameters), so it makes three passes over the activation instead of a dozen.
    With batch statistics the input gradient needs two global means of the output gradient: one all-reduce
    per mesh dim; with fixed statistics (eval) it is local. Weight and bias gradients are summed over
    ``param_mesh_dims`` in one coalesced all-reduce (or queued under ``deferred_param_grads``).
    """

    @staticmethod
    def forward(ctx, x, centred, weight, bias, delta, rstd, dims, count, spec, mesh_dims, param_mesh_dims,
                batch_stats, affine_shape):
        scale = rstd if weight is None else rstd * weight.reshape(affine_shape)
        offset = -delta * scale
        if bias is not None:
            offset = offset + bias.reshape(affine_shape)
        y = centred * scale.to(centred.dtype)
        y.add_(offset.to(centred.dtype))
        ctx.save_for_backward(centred, weight, delta, rstd)
        ctx.params, ctx.bias_shape = (weight, bias), (bias.shape if bias is not None else None)
        ctx.args = (dims, count, spec, mesh_dims, param_mesh_dims, batch_stats, affine_shape, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        centred, weight, delta, rstd = ctx.saved_tensors
        dims, count, spec, mesh_dims, param_mesh_dims, batch_stats, affine_shape, has_bias = ctx.args
        acc = _acc_dtype(dy.dtype)
        inner = tuple(d for d in dims if affine_shape[d] == 1)  # summed within a cell
        db = _sum(dy, inner, acc).double()  # per cell: sum of dy
        dxh = (_sum(dy * centred, inner, acc).double() - delta * db) * rstd  # per cell: sum of dy * xhat
        w = weight.reshape(affine_shape).double() if weight is not None else None
        scale = rstd if w is None else rstd * w
        if batch_stats:
            outer = tuple(d for d in dims if d not in inner)
            g, gx = (db, dxh) if w is None else (db * w, dxh * w)
            sums = torch.stack([_sum(g, outer), _sum(gx, outer)])
            for m in mesh_dims:
                sums = comm.all_reduce(sums.contiguous(), "sum", spec.mesh, m)
            mg, mgx = sums[0] / count, sums[1] / count
            # dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd, expanded over centred and dy
            dx = centred * (-mgx * rstd * rstd).to(dy.dtype)
            dx.add_(((delta * mgx * rstd - mg) * rstd).to(dy.dtype))
            dx.addcmul_(dy, scale.to(dy.dtype))  # in place: half the time of adding dy * scale
        else:
            dx = dy * scale.to(dy.dtype)
        from domainflow.dispatch.param_grads import reduce_param_grads

        other = tuple(k for k in range(dy.ndim) if affine_shape[k] == 1)
        gw = dxh.sum(other).reshape(weight.shape).to(weight.dtype) if weight is not None else None
        gb = db.sum(other).reshape(ctx.bias_shape).to(ctx.params[1].dtype) if has_bias else None
        gw, gb = reduce_param_grads(ctx.params, [gw, gb], spec.mesh, param_mesh_dims)
        return dx, None, gw, gb, None, None, None, None, None, None, None, None, None


def _normalize(x_local, centred, weight, bias, delta, var, eps, dims, count, spec, mesh_dims, param_mesh_dims,
               batch_stats, affine_shape):
    rstd = torch.rsqrt(var.double() + eps)
    return _Normalize.apply(x_local, centred, weight, bias, delta.double(), rstd, dims, count, spec, mesh_dims,
                            param_mesh_dims, batch_stats, affine_shape)


def _prepare(func, args, kwargs, x, others):
    """(x, spec, sharded mesh dims) for a norm over a batch/space-sharded input, or the result of the
    default or refusing path as ``(None, result, None)``."""
    if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) for t in others):
        return None, run_function_default(func, args, kwargs), None
    x = without_partial(x)
    mesh_dims, why = _sharded_mesh_dims(x._spec)
    if why:
        return None, unsupported_or_fallback(func, args, kwargs, why), None
    return x, x._spec, mesh_dims

_GROUP_NORM_ARGS = Schema("self", "num_groups", "weight", "bias", "eps", weight=None, bias=None, eps=1e-5)
_BATCH_NORM_ARGS = Schema("self", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps",
                          running_mean=None, running_var=None, weight=None, bias=None, training=False, momentum=0.1,
                          eps=1e-5)
_INSTANCE_NORM_ARGS = Schema("self", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum",
                             "eps", running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                             momentum=0.1, eps=1e-5)
_LAYER_NORM_ARGS = Schema("self", "normalized_shape", "weight", "bias", "eps", weight=None, bias=None, eps=1e-5)


def _group_norm(func, args, kwargs):
    a = _GROUP_NORM_ARGS.bind(args, kwargs)
    x, spec, mesh_dims = _prepare(func, args, kwargs, a["self"], (a["weight"], a["bias"]))
    if x is None:
        return spec
    G = a["num_groups"]
    C = x.shape[1]
    spatial_mesh_dims, dims, count, affine = _group_norm_plan(spec, G)
    local = x.to_local()
    view = local.reshape(local.shape[0], G, C // G, *local.shape[2:])  # stats per (sample, group)
    _, var, centred, delta = _centred_moments(view, dims, count, spec, spatial_mesh_dims)
    y = _normalize(view, centred, a["weight"], a["bias"], delta, var, a["eps"], dims, count, spec,
                   spatial_mesh_dims, mesh_dims, True, affine)
    return ShardTensor.from_spec(y.reshape(local.shape), spec_like(spec, local.shape))


@layout_rule
def _group_norm_plan(spec, groups: int):
    """(the mesh dims sharding space, the dims of the (N, G, C/G, *space) view the statistics reduce, the
    elements each statistic counts, the affine parameters' shape on that view)."""
    C, nd = spec.shape[1], spec.ndim
    spatial_mesh_dims = tuple(m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim >= 2)
    return (spatial_mesh_dims, tuple(range(2, nd + 1)), (C // groups) * math.prod(spec.shape[2:]),
            (1, groups, C // groups) + (1,) * (nd - 2))


@layout_rule
def _channel_norm_plan(spec, stats_over_batch: bool):
    """(the dims the statistics reduce, the mesh dims their sums span, the elements each counts, the affine
    parameters' shape): per channel over batch and space (batch norm) or per sample and channel over space."""
    nd = spec.ndim
    spatial = tuple(range(2, nd))
    n_space = math.prod(spec.shape[2:])
    sharded = [(m, p.dim) for m, p in enumerate(spec.placements) if isinstance(p, Shard)]
    affine = (1, spec.shape[1]) + (1,) * (nd - 2)
    if stats_over_batch:
        return (0,) + spatial, tuple(m for m, _ in sharded), spec.shape[0] * n_space, affine
    return spatial, tuple(m for m, d in sharded if d >= 2), n_space, affine


def _batch_norm(func, args, kwargs):
    a = _BATCH_NORM_ARGS.bind(args, kwargs)
    return _channel_norm(func, args, kwargs, a, stats_over_batch=True, use_batch_stats=a["training"])


def _instance_norm(func, args, kwargs):
    a = _INSTANCE_NORM_ARGS.bind(args, kwargs)
    return _channel_norm(func, args, kwargs, a, stats_over_batch=False, use_batch_stats=a["use_input_stats"])


def _channel_norm(func, args, kwargs, a, stats_over_batch: bool, use_batch_stats: bool):
    """Batch norm (statistics per channel over batch and space) and instance norm (per sample and channel
    over space)."""
    x, spec, mesh_dims = _prepare(func, args, kwargs, a["self"],
                                  (a["weight"], a["bias"], a["running_mean"], a["running_var"]))
    if x is None:
        return spec
    local = x.to_local()
    dims, reduce_mesh, count, affine = _channel_norm_plan(spec, stats_over_batch)
    if use_batch_stats:
        mean, var, centred, delta = _centred_moments(local, dims, count, spec, reduce_mesh)
        rm, rv = a["running_mean"], a["running_var"]
        if rm is not None and rv is not None:
            with torch.no_grad():  # identical on every rank: the statistics are global
                m = a["momentum"] if a["momentum"] is not None else 0.0
                unbiased = var * (count / max(count - 1, 1))
                if not stats_over_batch:  # instance norm: the running statistics average the samples
                    mean, unbiased = mean.mean(0), unbiased.mean(0)
                rm.mul_(1 - m).add_(mean.reshape(rm.shape).to(rm.dtype), alpha=m)
                rv.mul_(1 - m).add_(unbiased.reshape(rv.shape).to(rv.dtype), alpha=m)
        y = _normalize(local, centred, a["weight"], a["bias"], delta, var, a["eps"], dims, count, spec,
                       reduce_mesh, mesh_dims, True, affine)
    else:
        mean = a["running_mean"].reshape(affine)
        var = a["running_var"].reshape(affine)
        y = _normalize(local, local, a["weight"], a["bias"], mean, var, a["eps"], dims, count, spec, [],
                       mesh_dims, False, affine)
    return ShardTensor.from_spec(y, spec_like(spec, y.shape))


@layout_rule
def _layer_norm_layout(spec, axis: int):
    """(the layout once pending sums are reduced, the mesh dims sharding a normalised dim)."""
    spec = spec.reduced()
    return spec, tuple(m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim >= axis)


def _layer_norm(func, args, kwargs):
    """Layer norm over trailing dims, some of them sharded (a row's statistics span ranks): global moments in
    one all-reduce, the normalisation local. Without a sharded normalised dim the aten handler runs it locally.
    The weight and bias are sliced to this rank's block; their gradients, zero outside the block, are summed
    over every sharded mesh dim once (queued under ``deferred_param_grads``)."""
    a = _LAYER_NORM_ARGS.bind(args, kwargs)
    x, weight, bias = a["self"], a["weight"], a["bias"]
    shape = tuple(a["normalized_shape"]) if not isinstance(a["normalized_shape"], int) else (a["normalized_shape"],)
    if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) and not t._spec.reduced().is_replicated
                                             for t in (weight, bias)):
        return run_function_default(func, args, kwargs)
    axis = x.ndim - len(shape)
    spec, stat_mesh = _layer_norm_layout(x._spec, axis)
    if not stat_mesh:  # no normalised dim sharded: torch's own, whose aten op runs on the local chunks
        return run_function_default(func, args, kwargs)
    x = without_partial(x)
    local = x.to_local()
    weight, bias = (without_partial(t).to_local() if isinstance(t, ShardTensor) else t for t in (weight, bias))
    dims = tuple(range(axis, x.ndim))
    count = math.prod(shape)
    _, var, centred, delta = _centred_moments(local, dims, count, spec, stat_mesh)
    all_mesh = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard)]
    weight, bias = params_for(spec.mesh, all_mesh, weight, bias)
    coord = spec.coord

    def block(t):
        if t is None:
            return None
        for m in stat_mesh:
            d = spec.placements[m].dim - axis
            t = t.narrow(d, sum(spec.sizes[m][:coord[m]]), spec.sizes[m][coord[m]])
        return t

    affine = (1,) * axis + tuple(local.shape[axis:])
    y = _normalize(local, centred, block(weight), block(bias), delta, var, a["eps"], dims, count, spec, stat_mesh,
                   [], True, affine)
    return ShardTensor.from_spec(y, spec_like(spec, y.shape))


register_function(F.layer_norm)(_layer_norm)
register_function(F.group_norm)(_group_norm)
register_function(F.batch_norm)(_batch_norm)
register_function(F.instance_norm)(_instance_norm)
