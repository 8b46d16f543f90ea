"""Layout-preserving tensor ops: copies, dtype casts, *_like factories, fills, scalars, cat/stack."""

from __future__ import annotations

import torch

from domainflow.layout import shapes
from domainflow.ops.pointwise import pointwise
from domainflow.dispatch.toolkit import mark_copied_view
from domainflow.dispatch.toolkit import common_mesh, layout_rule, local_as, replicate_local, run_function_default, unsupported_or_fallback, replicated_spec, shard_tensors, to_spec
from domainflow.layout.placements import Replicate
from domainflow.dispatch.registry import register_aten, register_function
from domainflow.tensor.shard_tensor import ShardTensor, keep_leaf_layout
from domainflow.layout.spec import ShardSpec, mesh_shape

aten = torch.ops.aten
_R = Replicate()


@register_aten(aten.detach.default, aten.alias.default, aten.lift_fresh.default, aten._to_copy.default,
               aten.conj_physical.default,
               aten._conj.default, aten._neg_view.default, aten.resolve_conj.default, aten.resolve_neg.default)
def same_layout(func, args, kwargs):
    """Unary ops that keep shape and layout (Partial sums stay pending, except through a cast to an
    integer or bool dtype, which does not commute with the sum). The lazy conjugate and negative views
    (``x.conj()``) give chunks holding their values (``ShardTensor`` resolves the bits), no views: writing
    into one is refused (``toolkit.refuse_write_into_copied_view``)."""
    x = args[0]
    dtype = kwargs.get("dtype")
    if x._spec.has_partial and dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        spec = x._spec.reduced()
        return ShardTensor.from_spec(func(to_spec(x, spec), *args[1:], **kwargs), spec)
    out = ShardTensor.from_spec(func(x._local, *args[1:], **kwargs), x._spec)
    if func is aten._conj.default or func is aten._neg_view.default:
        mark_copied_view(out)
    return out


@register_aten(aten.view_as_real.default, aten.view_as_complex.default)
def complex_views(func, args, kwargs):
    """``view_as_real`` adds a trailing dim of 2 (real, imaginary), ``view_as_complex`` takes it away; the
    sharded dims stay where they are (a shard of the pair dim itself cannot be viewed as complex)."""
    x = args[0]
    spec = x._spec
    if func is aten.view_as_real.default:
        return ShardTensor.from_spec(func(x._local), spec.with_(shape=tuple(spec.shape) + (2,)))
    if spec.mesh_dim_of(spec.ndim - 1) is not None:
        return unsupported_or_fallback(func, args, kwargs, "its last dim (real, imaginary) is sharded")
    return ShardTensor.from_spec(func(x._local), spec.with_(shape=tuple(spec.shape[:-1])))


@register_aten(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
               aten.randint_like.low_dtype)
def like_factory(func, args, kwargs):
    """New tensor laid out like the input; a Partial input gives a replicated result (its values are
    the op's, not pending sums)."""
    x = args[0]
    return ShardTensor.from_spec(func(x._local, *args[1:], **kwargs), x._spec.reduced())


@register_aten(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
               aten.new_empty_strided.default)
def new_factory(func, args, kwargs):
    """``x.new_zeros(size)`` gives a replicated tensor of the requested global size."""
    x = args[0]
    out = func(x._local, *args[1:], **kwargs)
    return ShardTensor.from_spec(out, replicated_spec(x._spec.mesh, out.shape))


@register_aten(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.normal_.default,
               aten.uniform_.default, aten.bernoulli_.float, aten.exponential_.default, aten.random_.default,
               getattr(aten.random_, "from"), aten.random_.to)
def fill_inplace(func, args, kwargs):
    """Overwrite every element: a Partial tensor simply becomes replicated (no reduction needed)."""
    x = args[0]
    rest = [replicate_local(a) if isinstance(a, ShardTensor) else a for a in args[1:]]
    func(x._local, *rest, **kwargs)
    if x._spec.has_partial:
        from domainflow.dispatch.toolkit import relayout

        relayout(x, x._local, x._spec.reduced())
    return x


@register_aten(aten.copy_.default)
def copy_(func, args, kwargs):
    """``dst.copy_(src)`` into a ShardTensor: src is laid out like dst (sliced locally when replicated). A plain
    ``dst`` never reaches here: the engine's destination check (``toolkit.into_plain``) decides it first."""
    return pointwise(func, args, kwargs)


@register_aten(aten._local_scalar_dense.default)
def item(func, args, kwargs):
    return replicate_local(args[0]).item()


@register_aten(aten.equal.default)
def equal(func, args, kwargs):
    a, b = args
    sts = shard_tensors(args)
    if a.shape != b.shape:
        return False
    ref = sts[0]._spec
    ref = ref.reduced()
    la, lb = local_as(a, ref), local_as(b, ref)
    from domainflow import comm

    ok = torch.tensor([1 if torch.equal(la, lb) else 0], dtype=torch.int64, device=la.device)
    for m in range(ref.mesh.ndim):
        ok = comm.all_reduce(ok, "min", ref.mesh, m)
    return bool(ok.item())


@register_aten(aten.is_same_size.default)
def is_same_size(func, args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


@register_aten(aten.cat.default)
def cat(func, args, kwargs):
    """Concatenate along a dim no operand is sharded on; operands are aligned like pointwise inputs."""
    tensors = [t for t in args[0] if not (t.ndim == 1 and t.shape[0] == 0 and not isinstance(t, ShardTensor))]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    sts = [t for t in tensors if isinstance(t, ShardTensor)]
    common_mesh(sts, func)
    layouts = tuple(t._spec if isinstance(t, ShardTensor) else t.shape for t in tensors)
    targets, out = _cat_plan(layouts, dim % sts[0].ndim)
    return ShardTensor.from_spec(torch.cat([local_as(t, spec) for t, spec in zip(tensors, targets)], dim), out)


@layout_rule
def _cat_plan(layouts: tuple, dim: int):
    """(each operand's layout to concatenate in, the output's layout); ``layouts``: each operand's
    ShardSpec, or its shape for a plain tensor."""
    specs = [lay for lay in layouts if isinstance(lay, ShardSpec)]
    lengths = [lay.shape[dim] if isinstance(lay, ShardSpec) else lay[dim] for lay in layouts]
    m = next((s.mesh_dim_of(dim) for s in specs if s.mesh_dim_of(dim) is not None), None)
    if m is not None:
        return _cat_sharded_dim_plan(layouts, lengths, dim, m)
    ref = specs[0].reduced()
    targets = []
    for length in lengths:
        shape = list(ref.shape)
        shape[dim] = length
        targets.append(ShardSpec(ref.mesh, ref.placements, shape, ref.sizes))
    out_shape = list(ref.shape)
    out_shape[dim] = sum(lengths)
    return tuple(targets), ShardSpec(ref.mesh, ref.placements, out_shape, ref.sizes)


@register_aten(aten.stack.default)
def stack(func, args, kwargs):
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim = dim % (tensors[0].ndim + 1)
    return cat(aten.cat.default, ([t.unsqueeze(dim) for t in tensors], dim), {})


def _cat_sharded_dim_plan(layouts, lengths, dim, m):
    """Concatenation along a dim sharded over mesh dim ``m``. Rank k's output is one contiguous range of
    sum_i(size of operand i on rank k) rows; each operand is resharded so that rank k holds exactly its
    part of that range, then locals are concatenated. For operands that tile one sharded tensor (the
    pieces of a split) the target equals their layout: no communication."""
    ref_spec = next(s for s in layouts if isinstance(s, ShardSpec) and s.mesh_dim_of(dim) == m).reduced()
    mesh = ref_spec.mesh
    n = mesh_shape(mesh)[m]
    per_rank = [0] * n
    for lay, length in zip(layouts, lengths):
        s = lay.sizes[m] if isinstance(lay, ShardSpec) and lay.mesh_dim_of(dim) == m else None
        if s is None:
            s = shapes.chunk_sizes(length, n)
        per_rank = [a + b for a, b in zip(per_rank, s)]
    out_off = shapes.offsets(per_rank)
    targets, start = [], 0
    for length in lengths:
        target = tuple(max(0, min(o + c, start + length) - max(o, start)) for o, c in zip(out_off, per_rank))
        sz = list(ref_spec.sizes)
        sz[m] = target
        shape = list(ref_spec.shape)
        shape[dim] = length
        targets.append(ShardSpec(mesh, ref_spec.placements, shape, sz))
        start += length
    shape = list(ref_spec.shape)
    shape[dim] = start
    sz = list(ref_spec.sizes)
    sz[m] = tuple(per_rank)
    return tuple(targets), ShardSpec(mesh, ref_spec.placements, shape, sz)


@register_function(torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__)
def requires_grad(func, args, kwargs):
    """``x.requires_grad_()`` / ``x.requires_grad = True`` on a ShardTensor leaf: its gradient will be laid
    out like the leaf (``keep_leaf_layout``)."""
    out = run_function_default(func, args, kwargs)
    x = args[0]
    if isinstance(x, ShardTensor) and x.requires_grad and x.is_leaf:
        keep_leaf_layout(x)
    return out


@register_aten(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar)
def isin(func, args, kwargs):
    """Elementwise in ``elements`` when the values tested against are whole on every rank (plain or
    replicated): local, laid out like ``elements``."""
    elements, test = args[0], args[1]
    if isinstance(test, ShardTensor) and not test._spec.reduced().is_replicated:
        return unsupported_or_fallback(func, args, kwargs, "the values tested against are sharded")
    if not isinstance(elements, ShardTensor):
        return unsupported_or_fallback(func, args, kwargs, "only the values tested against are sharded")
    spec = elements._spec.reduced()
    test = to_spec(test, test._spec.reduced()) if isinstance(test, ShardTensor) else test
    return ShardTensor.from_spec(func(to_spec(elements, spec), test, *args[2:], **kwargs), spec)
