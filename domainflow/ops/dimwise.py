"""Ops that work along one dim (or trailing dims) independently of the others: softmax, cumsum,
sort, topk, layer_norm (flip and roll: ``along_sharded.py``) (FFTs: ``fft.py``). When the dims they work along are not sharded they run on local
chunks (rule 2: no communication); along a sharded dim they need a dedicated handler."""

from __future__ import annotations

from typing import NamedTuple

import torch

from domainflow.layout import shapes
from domainflow.dispatch.fallback import fallback as _fallback_mode
from domainflow.dispatch.toolkit import (layout_rule, unsupported_or_fallback, common_mesh, local_as, local_exact, relayout, shard_tensors, to_spec,
                        warn_relayout)
from domainflow.layout.spec import mesh_shape
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.dispatch.registry import register_aten
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.layout.spec import ShardSpec

aten = torch.ops.aten
_R = Replicate()

# op -> (index of the dim argument, its default, number of leading tensor arguments)
_DIM_OPS = {
    aten._softmax.default: (1, None, 1),
    aten._safe_softmax.default: (1, None, 1),
    aten._log_softmax.default: (1, None, 1),
    aten._softmax_backward_data.default: (2, None, 2),
    aten._log_softmax_backward_data.default: (2, None, 2),
    aten.cumsum.default: (1, None, 1),
    aten.cumprod.default: (1, None, 1),
    aten.logcumsumexp.default: (1, None, 1),
    aten.cummax.default: (1, None, 1),
    aten.cummin.default: (1, None, 1),
    aten.sort.default: (1, -1, 1),
    aten.sort.stable: ("dim", -1, 1),
    aten.topk.default: (2, -1, 1),
    aten.logsumexp.default: (1, None, 1),
    aten.kthvalue.default: (2, -1, 1),
    aten.mode.default: (1, -1, 1),
    aten.median.dim: (1, None, 1),
    aten.nanmedian.dim: (1, None, 1),
}
# ops among them that drop their dim unless keepdim: op -> index of keepdim
_KEEPDIM = {aten.kthvalue.default: 3, aten.mode.default: 2, aten.median.dim: 2, aten.nanmedian.dim: 2}


def _dims_of(func, args, kwargs, ndim):
    pos, default, _ = _DIM_OPS[func]
    if isinstance(pos, str):
        val = kwargs.get(pos, default)
    else:
        val = args[pos] if len(args) > pos else kwargs.get("dim", kwargs.get("dims", default))
    if val is None:
        return list(range(ndim))
    if isinstance(val, int):
        val = [val]
    return [d % ndim for d in val] if ndim else []


@layout_rule
def _global_spec(spec: ShardSpec, local_shape) -> ShardSpec:
    """The layout of an op's result whose local shape is ``local_shape`` (cached per layout and shape)."""
    shape = [spec.shape[d] if spec.mesh_dim_of(d) is not None else n for d, n in enumerate(local_shape)]
    return spec.with_(shape=shape)


def layout_avoiding(spec: ShardSpec, dims, shape) -> ShardSpec | None:
    """``spec`` with every shard on one of ``dims`` moved to another dim (the largest free one, chunk
    sizes), or None when no dim is free."""
    pl, sz = list(spec.placements), list(spec.sizes)
    taken = {p.dim for p in pl if isinstance(p, Shard)}
    for m, p in enumerate(pl):
        if isinstance(p, Shard) and p.dim in dims:
            free = [d for d in range(len(shape)) if d not in dims and d not in taken]
            if not free:
                return None  # only replicating would do: that is the opt-in gather fallback
            d = max(free, key=lambda k: shape[k])
            taken.add(d)
            pl[m], sz[m] = Shard(d), shapes.chunk_sizes(shape[d], mesh_shape(spec.mesh)[m])
    return ShardSpec.build(spec.mesh, pl, shape, sz)


class _DimPlan(NamedTuple):
    """How a dim-wise op runs for given operand layouts and dims (one propagation, cached)."""

    ref: ShardSpec | None  # the layout every operand is used in; None: only replicating would do
    moved: bool  # no operand leaves the op's dims unsharded: the shard moves off them
    mixed: bool  # some operands are sharded along the op's dims, others not: laid out like the others
    exact: bool  # every operand a ShardTensor laid out as ``ref`` already (no communication)


@layout_rule
def _dim_plan(specs: tuple, dims: tuple) -> _DimPlan:
    """``specs``: each leading tensor operand's layout (None for a plain tensor)."""
    sts = [s for s in specs if s is not None]
    # lay every operand out like one that does not shard the dims the op works along; in backward
    # passes a gradient can arrive sharded on such a dim (laid out like some other operand)
    usable = [s for s in sts if not any(s.mesh_dim_of(d) is not None for d in dims)]
    if usable:
        ref, moved = usable[0].reduced(), False
    else:
        ref, moved = layout_avoiding(sts[0].reduced(), set(dims), tuple(sts[0].shape)), True
    return _DimPlan(ref, moved, bool(usable) and len(usable) != len(sts),
                    len(sts) == len(specs) and all(s == ref for s in sts))


@register_aten(*_DIM_OPS)
def dim_local(func, args, kwargs):
    n_t = _DIM_OPS[func][2]
    tensors = args[:n_t]
    specs = tuple(t._spec if type(t) is ShardTensor else None for t in tensors)
    if n_t > 1:
        common_mesh(shard_tensors(tensors), func)
    first = next(s for s in specs if s is not None)
    dims = _dims_of(func, args, kwargs, first.ndim)
    plan = _dim_plan(specs, tuple(dims))
    ref = plan.ref
    if plan.moved:
        if _fallback_mode.current() == "gather" or ref is None:
            return unsupported_or_fallback(func, args, kwargs, f"it works along dim(s) {dims}, which are sharded")
        warn_relayout(func, f"moved the shard off dim(s) {dims}, which the op works along")
    if plan.mixed:
        warn_relayout(func, "laid an operand sharded along the op's dim out like the others")
    if plan.exact:
        local_exact()  # every operand sharded and used as it is
        locs = [t._local for t in tensors]
    else:
        locs = [local_as(t, ref) for t in tensors]
    if func is aten.logsumexp.default:
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return ShardTensor.from_spec(torch.logsumexp(locs[0], dims, keepdim),
                                     _logsumexp_layout(ref, tuple(dims), bool(keepdim)))
    if func in _KEEPDIM and dims:  # run with keepdim, then drop the dim (unsharded in ``ref``) from the layout
        k = _KEEPDIM[func]
        keepdim = bool(args[k] if len(args) > k else kwargs.get("keepdim", False))
        lead = [args[1] if len(args) > 1 else kwargs["k"]] if func is aten.kthvalue.default else []
        outs = func(*locs, *lead, dims[0], True)
        spec = _kept_or_dropped(ref, dims[0], keepdim)
        return type(outs)(ShardTensor.from_spec(o if keepdim else o.squeeze(dims[0]), spec) for o in outs)
    out = func(*locs, *args[n_t:], **kwargs)
    if isinstance(out, torch.Tensor):
        return ShardTensor.from_spec(out, _global_spec(ref, out.shape))
    return type(out)(ShardTensor.from_spec(o, _global_spec(ref, o.shape)) for o in out)


@layout_rule
def _kept_or_dropped(ref: ShardSpec, dim: int, keepdim: bool) -> ShardSpec:
    """The layout of a reduction over ``dim`` (unsharded in ``ref``), with the dim kept as 1 or dropped."""
    if keepdim:
        return ref.with_(shape=[1 if d == dim else n for d, n in enumerate(ref.shape)])
    pl = [Shard(p.dim - (p.dim > dim)) if isinstance(p, Shard) else p for p in ref.placements]
    return ref.with_(placements=pl, shape=[n for d, n in enumerate(ref.shape) if d != dim])


@layout_rule
def _logsumexp_layout(ref: ShardSpec, dims: tuple, keepdim: bool) -> ShardSpec:
    """The layout of logsumexp over ``dims`` (none of them sharded in ``ref``)."""
    keep = [d for d in range(ref.ndim) if keepdim or d not in dims]
    pos = {d: i for i, d in enumerate(keep)}
    pl = [Shard(pos[p.dim]) if isinstance(p, Shard) else p for p in ref.placements]
    return ShardSpec(ref.mesh, pl, [1 if d in dims else ref.shape[d] for d in keep], ref.sizes)


@layout_rule
def _layer_norm_plan(spec: ShardSpec, n_normalized: int):
    """(the input's layout with pending sums reduced, the statistics' layout), or why it cannot run
    locally (a normalised dim is sharded: ``ops/normalization.py`` handles that above autograd)."""
    reduced = spec.reduced()
    axis = spec.ndim - n_normalized
    if any(reduced.mesh_dim_of(d) is not None for d in range(axis, spec.ndim)):
        return "it normalises over a sharded dim"
    return reduced, reduced.with_(shape=tuple(reduced.shape[:axis]) + (1,) * n_normalized)


@register_aten(aten.native_layer_norm.default)
def layer_norm(func, args, kwargs):
    """Normalising over trailing dims that are not sharded: local; statistics keep the leading layout."""
    x, normalized_shape, weight, bias, eps = args
    plan = _layer_norm_plan(x._spec, len(normalized_shape))
    if type(plan) is str:
        return unsupported_or_fallback(func, args, kwargs, plan)
    spec, stat_spec = plan
    if x._spec is spec or x._spec == spec:
        local_exact()
        lx = x._local
    else:
        lx = to_spec(x, spec)
    lw = weight._local if isinstance(weight, ShardTensor) else weight
    lb = bias._local if isinstance(bias, ShardTensor) else bias
    out, mean, rstd = func(lx, normalized_shape, lw, lb, eps)
    return ShardTensor.from_spec(out, spec), ShardTensor.from_spec(mean, stat_spec), ShardTensor.from_spec(rstd, stat_spec)


@layout_rule
def _layer_norm_backward_plan(x_spec: ShardSpec, normalized_shape: tuple, stat_shape: tuple):
    """(the layout the backward runs in, its statistics' layout, the weight and bias gradients' layout: a
    pending sum over the sharded leading dims), or None when only replicating would do."""
    spec = x_spec.reduced()
    axis = len(spec.shape) - len(normalized_shape)
    if any(spec.mesh_dim_of(d) is not None for d in range(axis, len(spec.shape))):
        spec = layout_avoiding(spec, set(range(axis, len(spec.shape))), tuple(spec.shape))
        if spec is None:
            return None
    pspec = ShardSpec(spec.mesh, [Partial("sum") if isinstance(p, Shard) else p for p in spec.placements],
                      normalized_shape, (None,) * spec.mesh.ndim)
    return spec, spec.with_(shape=stat_shape), pspec


@register_aten(aten.native_layer_norm_backward.default)
def layer_norm_backward(func, args, kwargs):
    """Input gradient local; weight/bias gradients sum over the (sharded) leading dims: Partial(sum)."""
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args
    x_spec = x._spec if isinstance(x, ShardTensor) else shard_tensors([grad, x, mean, rstd])[0]._spec
    plan = _layer_norm_backward_plan(x_spec, tuple(normalized_shape), tuple(mean.shape))
    if plan is None:
        return unsupported_or_fallback(func, args, kwargs, "it normalises over a sharded dim")
    spec, stat_spec, pspec = plan
    lg, lx = local_as(grad, spec), local_as(x, spec)
    lm, lr = local_as(mean, stat_spec), local_as(rstd, stat_spec)
    lw = weight._local if isinstance(weight, ShardTensor) else weight
    lb = bias._local if isinstance(bias, ShardTensor) else bias
    gi, gw, gb = func(lg, lx, normalized_shape, lm, lr, lw, lb, mask)
    return (ShardTensor.from_spec(gi, spec) if gi is not None else None,
            ShardTensor.from_spec(gw, pspec) if gw is not None else None,
            ShardTensor.from_spec(gb, pspec) if gb is not None else None)


# op -> positions of the tensor arguments laid out alike (all but the `dim` extent agree)
_INDEX_OPS = {
    aten.gather.default: (0, 2),
    aten.scatter.src: (0, 2, 3),
    aten.scatter.value: (0, 2),
    aten.scatter_add.default: (0, 2, 3),
    aten.scatter_reduce.two: (0, 2, 3),
    aten.index_select.default: (0,),
    aten.index_add.default: (0, 3),
    aten.index_add_.default: (0, 3),
    aten.index_copy.default: (0, 3),
    aten.index_copy_.default: (0, 3),
    aten.index_fill.int_Scalar: (0,),
    aten.index_fill_.int_Scalar: (0,),
    aten.scatter_.src: (0, 2, 3),
    aten.scatter_.value: (0, 2),
    aten.scatter_add_.default: (0, 2, 3),
    aten.scatter_reduce_.two: (0, 2, 3),
}


@register_aten(*_INDEX_OPS)
def index_along_unsharded_dim(func, args, kwargs):
    """gather/scatter/index_select along a dim that is not sharded: every operand is laid out like the
    first sharded one on the other dims (sliced locally when replicated), then the op runs locally."""
    pos = _INDEX_OPS[func]
    sts = [args[i] for i in pos if isinstance(args[i], ShardTensor)]
    others = [a for i, a in enumerate(args) if i not in pos and isinstance(a, ShardTensor)]
    if not sts or any(not o._spec.is_replicated for o in others):
        return unsupported_or_fallback(func, args, kwargs, "the index operand is sharded")
    common_mesh(sts + others, func)  # operands on one mesh, or a clear error
    dim = args[1] % args[0].ndim
    sharded = [s for s in sts if not s._spec.reduced().is_replicated]
    ref = ((sharded or sts)[0]._spec).reduced()
    if ref.mesh_dim_of(dim) is not None:
        return unsupported_or_fallback(func, args, kwargs, f"it indexes along dim {dim}, which is sharded")
    for i in pos:
        a = args[i]
        if any(a.shape[d] != ref.shape[d] for d in range(a.ndim) if d != dim and ref.mesh_dim_of(d) is not None):
            return unsupported_or_fallback(func, args, kwargs, "operands differ in size along a sharded dim")
    local_args = list(args)
    for i in pos:
        a = args[i]
        spec = ref.with_(shape=[a.shape[d] if d == dim or ref.mesh_dim_of(d) is None else ref.shape[d]
                                for d in range(a.ndim)])
        local_args[i] = local_as(a, spec)
    for i, a in enumerate(args):
        if i not in pos and isinstance(a, ShardTensor):
            local_args[i] = a._local
    out = func(*local_args, **kwargs)
    out_spec = _global_spec(ref, out.shape)
    if torch.Tag.inplace in func.tags:
        self_ = args[0]
        if isinstance(self_, ShardTensor):
            if local_args[0] is not self_._local or self_._spec != out_spec:
                # e.g. the zeros that an index op's backward scatters into: replicated before, now
                # laid out like the sharded operands (a view of the old chunk, so no copy)
                relayout(self_, local_args[0], out_spec)
            return self_
        return unsupported_or_fallback(func, args, kwargs, "an in-place index op on a plain tensor")
    return ShardTensor.from_spec(out, out_spec)
