"""Reductions: over unsharded dims they run locally; over a sharded dim they give a Partial result
(sum/mean -> Partial(sum), amax/amin -> Partial(max/min), prod -> Partial(product)) that is reduced
only when a later op needs the value. Index-returning reductions (max/min with dim, argmax) compare
each rank's candidate and return replicated results. ``torch.sum``/``mean`` are also handled above
autograd so their gradients come back sharded like the input instead of as replicated full tensors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from domainflow import comm
from domainflow.layout import shapes
from domainflow.dispatch.toolkit import Schema, layout_rule, local_exact, run_function_default, to_spec
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.dispatch.registry import register_aten, register_function
from domainflow.tensor.shard_tensor import ShardTensor, product_of_others
from domainflow.layout.spec import ShardSpec

aten = torch.ops.aten
_R = Replicate()


def _dims_arg(x, dim):
    if dim is None:
        return None
    if isinstance(dim, int):
        return [dim]
    return list(dim)


def _reduce_partials(x: ShardTensor, keep_sum: bool) -> ShardTensor:
    """Reduce pending Partial values unless they are sums feeding another sum."""
    spec = x._spec
    if not spec.has_partial:
        return x
    pl = [p if (keep_sum and isinstance(p, Partial) and p.reduce_op == "sum") else
          (_R if isinstance(p, Partial) else p) for p in spec.placements]
    dst = spec.with_(placements=pl)
    return x if dst == spec else ShardTensor.from_spec(to_spec(x, dst), dst)


def _out_spec(spec: ShardSpec, red, where, keepdim, partial: str | None, out_shape) -> ShardSpec:
    pl, sz = [], []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            if p.dim in red:
                if partial is None:
                    pl.append(_R)
                else:
                    pl.append(Partial(partial))
                sz.append(None)
            else:
                pl.append(Shard(where[p.dim]))
                sz.append(spec.sizes[m])
        else:
            pl.append(p)
            sz.append(None)
    return ShardSpec(spec.mesh, pl, out_shape, sz)


class _Reduction(NamedTuple):
    """A reduction over ``dims`` of one input layout, worked out once per layout and arguments."""

    red: list  # the reduced dims, sorted
    out_spec: ShardSpec  # the output's layout: pending ``kind`` over sharded reduced dims, or replicated there
    count: int  # the elements each output reduces over the whole domain
    mesh_dims: tuple  # the mesh dims that shard a reduced dim (where a collective finishes the reduction)


@layout_rule
def _reduction_layout(spec: ShardSpec, dims, keepdim: bool, kind) -> _Reduction:
    """The reduced dims and the output's layout (pending ``kind`` over the sharded reduced dims, replicated
    there when ``kind`` is None), once per input layout and arguments."""
    red, where = shapes.reduced_dim_map(spec.ndim, dims, keepdim)
    out = _out_spec(spec, red, where, keepdim, kind, _out_shape(spec.shape, red, keepdim))
    mesh_dims = tuple(m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in red)
    # a 0-d tensor reduced over its dim 0 (or -1), as torch allows, counts its one element
    return _Reduction(sorted(red), out, math.prod(spec.shape[d] for d in red if d < spec.ndim), mesh_dims)


def _key_dims(dims):
    return None if dims is None else tuple(dims)


def _out_shape(shape, red, keepdim):
    return [1 if d in red else n for d, n in enumerate(shape) if keepdim or d not in red]


@register_aten(aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.nansum.default)
def sum_mean(func, args, kwargs):
    x = args[0]
    is_mean = func in (aten.mean.default, aten.mean.dim)
    if func in (aten.sum.default, aten.mean.default):
        dims, keepdim = None, False
        dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
    elif func is aten.nansum.default:
        dims = _dims_arg(x, args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = kwargs.get("dtype")
    else:
        dims = _dims_arg(x, args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
    unchanged = x is args[0]
    x = _reduce_partials(x, keep_sum=True)
    unchanged = unchanged and x is args[0]
    local_dims, out_spec, count, mesh_dims = _reduction_layout(x._spec, _key_dims(dims), bool(keepdim), "sum")
    fn = torch.nansum if func is aten.nansum.default else torch.sum
    if unchanged and local_dims and not (is_mean and (mesh_dims or not dtype
                                                       and not x._local.dtype.is_floating_point
                                                       and not x._local.dtype.is_complex)):
        local_exact()  # a sum of the local chunk (a mean over dims held whole, of floats as torch takes)
    if local_dims:
        local = fn(x._local, dim=local_dims, keepdim=keepdim, dtype=dtype)
    else:
        local = fn(x._local, dtype=dtype) if x.ndim == 0 else x._local.to(dtype) if dtype else x._local.clone()
    if is_mean:
        local = local / count
    return ShardTensor.from_spec(local, out_spec)


_EXTREME = {"max": -math.inf, "min": math.inf}


def _fill_for(dtype, kind):
    if dtype.is_floating_point:
        return _EXTREME[kind]
    if dtype == torch.bool:
        return kind == "min"
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


@register_aten(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def amax_amin(func, args, kwargs):
    kind = "max" if func in (aten.amax.default, aten.max.default) else "min"
    x = _reduce_partials(args[0], keep_sum=False)
    spec = x._spec
    if func in (aten.max.default, aten.min.default):
        dims, keepdim = None, False
    else:
        dims = _dims_arg(x, args[1] if len(args) > 1 else kwargs.get("dim", []))
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    red, out_spec, _, mesh_dims = _reduction_layout(spec, _key_dims(dims), bool(keepdim), kind)
    local = x._local
    if local.numel() == 0 and mesh_dims:
        # this rank's part is empty: contribute the identity of the reduction
        shape = [1 if d in red else n for d, n in enumerate(local.shape)] if keepdim else \
            [n for d, n in enumerate(local.shape) if d not in red]
        out = torch.full(shape, _fill_for(local.dtype, kind), dtype=local.dtype, device=local.device)
    else:
        op = torch.amax if kind == "max" else torch.amin
        out = op(local, dim=red, keepdim=keepdim) if x.ndim else local.clone()
    return ShardTensor.from_spec(out, out_spec)


@register_aten(aten.prod.default, aten.prod.dim_int)
def prod(func, args, kwargs):
    x = _reduce_partials(args[0], keep_sum=False)
    spec = x._spec
    if func is aten.prod.default:
        dims, keepdim, dtype = None, False, kwargs.get("dtype", args[1] if len(args) > 1 else None)
        local = torch.prod(x._local, dtype=dtype)
    else:
        dims, keepdim = [args[1]], (args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
        local = torch.prod(x._local, dims[0], keepdim=keepdim, dtype=dtype)
    return ShardTensor.from_spec(local, _reduction_layout(spec, _key_dims(dims), bool(keepdim), "product").out_spec)


@register_aten(aten.any.default, aten.all.default, aten.any.dim, aten.all.dim, aten.any.dims, aten.all.dims)
def any_all(func, args, kwargs):
    x = _reduce_partials(args[0], keep_sum=False)
    spec = x._spec
    kind = "max" if func in (aten.any.default, aten.any.dim, aten.any.dims) else "min"
    if func in (aten.any.default, aten.all.default):
        dims, keepdim = None, False
    else:
        dims = _dims_arg(x, args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    red, out_spec, _, _ = _reduction_layout(spec, _key_dims(dims), bool(keepdim), kind)
    op = torch.any if kind == "max" else torch.all
    local = op(x._local, dim=tuple(red), keepdim=keepdim) if x.ndim else op(x._local)
    return ShardTensor.from_spec(local, out_spec)


@register_aten(aten.linalg_vector_norm.default)
def vector_norm(func, args, kwargs):
    """p-norms: local sums of |x|^p (or max/min of |x|), one all-reduce per sharded reduced dim."""
    x = _reduce_partials(args[0], keep_sum=False)
    ordv = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dims = _dims_arg(x, args[2] if len(args) > 2 else kwargs.get("dim"))
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = args[4] if len(args) > 4 else kwargs.get("dtype")
    spec = x._spec
    rd, out_spec, _, mesh_dims = _reduction_layout(spec, _key_dims(dims), bool(keepdim), None)
    if not mesh_dims:
        out = torch.linalg.vector_norm(x._local, ordv, dim=rd if x.ndim else None, keepdim=keepdim, dtype=dtype)
        return ShardTensor.from_spec(out, out_spec)
    a = x._local.abs() if dtype is None else x._local.to(dtype).abs()
    if ordv in (math.inf, -math.inf):
        kind = "max" if ordv > 0 else "min"
        local = (a.amax(rd, keepdim=keepdim) if kind == "max" else a.amin(rd, keepdim=keepdim)) if a.numel() else \
            torch.full(_out_shape(a.shape, rd, keepdim), _fill_for(a.dtype, kind), dtype=a.dtype, device=a.device)
        post = None
    elif ordv == 0:
        kind, local, post = "sum", (a != 0).to(a.dtype).sum(rd, keepdim=keepdim), None
    else:
        kind, local, post = "sum", a.pow(ordv).sum(rd, keepdim=keepdim), ordv
    for m in mesh_dims:
        local = comm.all_reduce(local, kind, spec.mesh, m)
    if post is not None:
        local = local.pow(1.0 / post)
    return ShardTensor.from_spec(local, out_spec)


@register_aten(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def indexed_reduction(func, args, kwargs):
    """max/min over a dim with indices, argmax/argmin: each rank's candidate (value, global index) is
    gathered along the sharded dim's mesh dim and the first extreme wins, as in torch."""
    x = _reduce_partials(args[0], keep_sum=False)
    spec = x._spec
    kind = "max" if func in (aten.max.dim, aten.argmax.default) else "min"
    want_values = func in (aten.max.dim, aten.min.dim)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dim is None:  # argmax over the flattened tensor
        flat_idx, _ = _flat_candidates(x, kind)
        shape = (1,) * x.ndim if keepdim else ()
        return ShardTensor.from_spec(flat_idx.reshape(shape), ShardSpec(spec.mesh, (_R,) * spec.mesh.ndim, shape,
                                                              (None,) * spec.mesh.ndim))
    dim %= max(x.ndim, 1)
    out_spec = _reduction_layout(spec, (dim,), bool(keepdim), None).out_spec
    m = spec.mesh_dim_of(dim)
    local = x._local
    if m is None:
        v, i = (torch.max if kind == "max" else torch.min)(local, dim, keepdim=True)
        v, i = (v, i) if keepdim else (v.squeeze(dim), i.squeeze(dim))
        indices = ShardTensor.from_spec(i, out_spec)
        return (ShardTensor.from_spec(v, out_spec), indices) if want_values else indices
    k = spec.coord[m]
    off = shapes.offsets(spec.sizes[m])
    if local.shape[dim] == 0:
        shp = list(local.shape)
        shp[dim] = 1
        v = torch.full(shp, _fill_for(local.dtype, kind), dtype=local.dtype, device=local.device)
        i = torch.zeros(shp, dtype=torch.int64, device=local.device)
    else:
        v, i = (torch.max if kind == "max" else torch.min)(local, dim, keepdim=True)
        i = i + off[k]
    n = spec.mesh.shape[m]
    vs = comm.all_gather_uneven(v, dim, [1] * n, spec.mesh, m)
    is_ = comm.all_gather_uneven(i, dim, [1] * n, spec.mesh, m)
    valid = torch.tensor([s > 0 for s in spec.sizes[m]], device=local.device)
    keep = valid.nonzero().flatten()
    vs, is_ = vs.index_select(dim, keep), is_.index_select(dim, keep)
    bv, bi = (torch.max if kind == "max" else torch.min)(vs, dim, keepdim=True)
    idx = is_.gather(dim, bi)
    if not keepdim:
        bv, idx = bv.squeeze(dim), idx.squeeze(dim)
    indices = ShardTensor.from_spec(idx, out_spec)
    return (ShardTensor.from_spec(bv, out_spec), indices) if want_values else indices


def _better(val, gi, best_val, best_gi, kind) -> bool:
    """torch's order for argmax/argmin: NaN beats everything, then the extreme value, ties (and NaNs)
    go to the smallest flat index."""
    if math.isnan(val) or math.isnan(best_val):
        return math.isnan(val) and (not math.isnan(best_val) or gi < best_gi)
    if val == best_val:
        return gi < best_gi
    return val > best_val if kind == "max" else val < best_val


def _flat_candidates(x: ShardTensor, kind):
    spec = x._spec
    local = x._local
    dev = local.device
    if local.numel():
        flat = local.reshape(-1)
        j = int((flat.argmax() if kind == "max" else flat.argmin()).item())
        val = flat[j].to(torch.float64)
        multi = list(torch.unravel_index(torch.tensor(j), local.shape)) if local.ndim else []
        g = [int(c) + o for c, o in zip(multi, spec.offsets)]
        gidx = 0
        for c, n in zip(g, spec.shape):
            gidx = gidx * n + c
        cand = torch.tensor([0.0, float(val), float(gidx)], dtype=torch.float64, device=dev)
    else:
        cand = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64, device=dev)  # [empty, value, index]
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            rows = comm.all_gather_uneven(cand.view(1, 3), 0, [1] * spec.mesh.shape[m], spec.mesh, m)
            best = None
            for empty, val, gi in rows.tolist():
                if not empty and (best is None or _better(val, gi, best[1], best[2], kind)):
                    best = (0.0, val, gi)
            cand = torch.tensor(best if best else [1.0, 0.0, 0.0], dtype=torch.float64, device=dev)
    return torch.tensor(int(cand[2].item()), dtype=torch.int64, device=dev), cand[1]


@register_aten(aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
def var_std(func, args, kwargs):
    """Two-pass variance over sharded dims: a global mean, then the global sum of squared deviations."""
    x = _reduce_partials(args[0], keep_sum=False)
    spec = x._spec
    dims = _dims_arg(x, args[1] if len(args) > 1 else kwargs.get("dim"))
    correction = kwargs.get("correction", args[2] if len(args) > 2 else None)
    correction = 1 if correction is None else correction
    keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
    rd, out_spec, count, mesh_dims = _reduction_layout(spec, _key_dims(dims), bool(keepdim), None)
    local = x._local
    s = local.sum(rd, keepdim=True)
    for m in mesh_dims:
        s = comm.all_reduce(s, "sum", spec.mesh, m)
    mean = s / count
    sq = (local - mean).pow(2).sum(rd, keepdim=True)
    for m in mesh_dims:
        sq = comm.all_reduce(sq, "sum", spec.mesh, m)
    var = sq / max(count - correction, 0)
    if not keepdim:
        var, mean = var.squeeze(rd) if rd else var, mean.squeeze(rd) if rd else mean
    res = var.sqrt() if func in (aten.std.correction, aten.std_mean.correction) else var
    if func in (aten.var_mean.correction, aten.std_mean.correction):
        return ShardTensor.from_spec(res, out_spec), ShardTensor.from_spec(mean, out_spec)
    return ShardTensor.from_spec(res, out_spec)


# --------------------------------------------------------------------------------------------
# above autograd: sum / mean whose gradient stays sharded like the input
# --------------------------------------------------------------------------------------------
class _SumMeanPlan(NamedTuple):
    """A differentiable sum / mean over reduced dims that include a sharded one, worked out once per (input
    layout, reduced dims, keepdim, mean): the local reduction, the scale, the output's layout (a pending
    Partial sum), and for backward the input gradient's layout and the output gradient's wanted layout."""

    red: list  # the reduced dims, sorted
    count: int  # the elements each output sums for a mean (1 for a sum)
    scale: float  # the gradient's scale: 1 / count (NaN over nothing, as torch)
    out_spec: ShardSpec
    in_grad_spec: ShardSpec
    grad_want: ShardSpec  # the output's gradient laid out like the output, partial dims replicated
    mesh_dims: tuple  # the mesh dims that shard a reduced dim (none: torch's own sum runs locally)


@layout_rule
def _sum_mean_plan(spec: ShardSpec, dims, keepdim: bool, mean: bool) -> _SumMeanPlan:
    from domainflow.tensor.redistribute import grad_spec

    r = _reduction_layout(spec, dims, keepdim, "sum")
    count = r.count if mean else 1
    in_grad_spec = grad_spec(spec)
    return _SumMeanPlan(r.red, count, 1.0 / count if count else math.nan, r.out_spec, in_grad_spec,
                        _reduction_layout(in_grad_spec, dims, keepdim, None).out_spec, r.mesh_dims)


class _SumMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, keepdim, dtype):
        ctx.plan, ctx.keepdim, ctx.in_dtype = plan, keepdim, x.dtype
        # what sum_mean computes for an input without Partials: the local sum (scaled for a mean), pending
        local = torch.sum(x._local, dim=plan.red, keepdim=keepdim, dtype=dtype)
        if plan.count != 1:
            local = local / plan.count  # as sum_mean divides (0 / 0 over nothing is NaN, as torch)
        return ShardTensor.from_spec(local, plan.out_spec)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        want, in_grad_spec = plan.grad_want, plan.in_grad_spec
        if not isinstance(grad, ShardTensor):
            spec = in_grad_spec
            grad = ShardTensor.from_spec(grad, ShardSpec(spec.mesh, (_R,) * spec.mesh.ndim, grad.shape,
                                                         (None,) * spec.mesh.ndim))
        g = to_spec(grad, want) if grad._spec != want else grad._local
        if not ctx.keepdim:
            for d in plan.red:
                g = g.unsqueeze(d)
        g = g.expand(in_grad_spec.local_shape)
        if plan.scale != 1.0:
            g = g * plan.scale
        return ShardTensor.from_spec(g.to(ctx.in_dtype), in_grad_spec), None, None, None


_SUM_ARGS = Schema("self", "dim", "keepdim", dim=None, keepdim=False, dtype=None)
_SUM_DTYPE_ARGS = Schema("self", dim=None, keepdim=False)  # sum(input, dtype)


def _differentiable_reduction_args(args, kwargs):
    """(x, dim, keepdim, dtype) of a sum/mean/prod call on a ShardTensor that needs a gradient, else
    None (the call then runs through the aten-level rules)."""
    first = args[0] if args else kwargs.get("input")
    if not (type(first) is ShardTensor and first.requires_grad and torch.is_grad_enabled()):
        return None
    if len(args) > 1 and isinstance(args[1], torch.dtype):  # sum(input, dtype)
        a = _SUM_DTYPE_ARGS.bind(args[:1], kwargs, dtype=args[1])
    else:
        a = _SUM_ARGS.bind(args, kwargs)
    if "out" in a:
        return None
    return a["self"], a["dim"], a["keepdim"], a["dtype"]


def _sum_mean_function(func, args, kwargs):
    """torch.sum/mean and Tensor.sum/mean on a ShardTensor: an autograd node whose backward expands the
    gradient locally (sharded like the input) when a sharded dim is reduced."""
    parsed = _differentiable_reduction_args(args, kwargs)
    if parsed is None:
        return run_function_default(func, args, kwargs)  # no gradient: the aten-level rule suffices
    x, dim, keepdim, dtype = parsed
    dims = None if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    spec = x._spec
    if spec.has_partial:
        return run_function_default(func, args, kwargs)
    plan = _sum_mean_plan(spec, dims, bool(keepdim), func in (torch.mean, torch.Tensor.mean))
    if not plan.mesh_dims:
        return run_function_default(func, args, kwargs)
    return _SumMean.apply(x, plan, keepdim, dtype)


register_function(torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean)(_sum_mean_function)


# --------------------------------------------------------------------------------------------
# above autograd: prod over sharded dims (torch's backward uses cumprod along the reduced dim)
# --------------------------------------------------------------------------------------------
class _Prod(torch.autograd.Function):
    """d prod / d x_i = prod of the others: with no zero in a reduced slice that is prod / x_i; with one
    zero only that element gets the product of the non-zeros; with more, nothing. Zero counts and
    non-zero products are global (one all-reduce each per sharded reduced mesh dim)."""

    @staticmethod
    def forward(ctx, x, dim, keepdim, dtype):
        spec = x._spec
        rd, out_spec, _, mesh_dims = _reduction_layout(spec, None if dim is None else (dim % x.ndim,), bool(keepdim), None)
        ctx.spec, ctx.red, ctx.keepdim, ctx.grad_want = spec, rd, keepdim, out_spec
        local = x._local if dtype is None else x._local.to(dtype)
        zeros = (local == 0).sum(rd, keepdim=True)
        nonzero = torch.where(local == 0, torch.ones_like(local), local)
        if len(rd) == 1:
            nonzero_prod = nonzero.prod(rd[0], keepdim=True)
        else:  # all dims (prod takes one dim or none)
            nonzero_prod = nonzero.prod().reshape([1] * local.ndim)
        for m in mesh_dims:
            zeros = comm.all_reduce(zeros, "sum", spec.mesh, m)
            nonzero_prod = comm.all_reduce(nonzero_prod, "product", spec.mesh, m)
        ctx.save_for_backward(local, zeros, nonzero_prod)
        out = torch.where(zeros > 0, torch.zeros_like(nonzero_prod), nonzero_prod)
        if not keepdim:
            out = out.squeeze(rd) if rd else out
        return ShardTensor.from_spec(out, out_spec)

    @staticmethod
    def backward(ctx, grad):
        local, zeros, nz = ctx.saved_tensors
        spec, rd = ctx.spec, ctx.red
        from domainflow.tensor.redistribute import grad_spec

        # the gradient laid out like the output (replicated over the reduced mesh dims)
        g = to_spec(grad, ctx.grad_want) if isinstance(grad, ShardTensor) else grad
        if not ctx.keepdim:
            for d in rd:
                g = g.unsqueeze(d)
        return ShardTensor.from_spec(g * product_of_others(local, zeros, nz), grad_spec(spec)), None, None, None


def _prod_function(func, args, kwargs):
    parsed = _differentiable_reduction_args(args, kwargs)
    if parsed is None:
        return run_function_default(func, args, kwargs)
    x, dim, keepdim, dtype = parsed
    if x._spec.has_partial or not _reduction_layout(x._spec, None if dim is None else (dim,), bool(keepdim), None).mesh_dims:
        return run_function_default(func, args, kwargs)
    return _Prod.apply(x, dim, keepdim, dtype)


register_function(torch.prod, torch.Tensor.prod)(_prod_function)
