"""Elementwise losses (mse, huber, smooth L1, BCE with logits) and dropout on sharded tensors.

A loss with reduction "mean" or "sum" is a local sum over this rank's elements (divided by the global
element count for "mean"): a Partial(sum) scalar, exact after reduction. The backward ops are
elementwise given the (replicated) output gradient, so they run locally with the global count.
"""

from __future__ import annotations

import torch

from domainflow.dispatch.toolkit import (unsupported_or_fallback, common_mesh, layout_rule, local_as, replicate_local, replicated_spec,
                        shard_tensors, to_spec)
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.dispatch.registry import register_aten
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.layout.spec import ShardSpec

aten = torch.ops.aten
_R = Replicate()
_NONE, _MEAN, _SUM = 0, 1, 2


def _ref_specs(func, tensors) -> tuple[ShardSpec, ShardSpec]:
    """:func:`_loss_layouts` of the operands ``tensors`` (which must share one mesh)."""
    common_mesh(shard_tensors(tensors), func)
    return _loss_layouts(tuple(t._spec if isinstance(t, ShardTensor) else (None if t is None else t.shape)
                               for t in tensors))


@layout_rule
def _loss_layouts(layouts: tuple):
    """(the layout an elementwise loss or its backward runs in: the first sharded operand's of the input's
    shape, reduced; the layout of its summed scalar: Partial(sum) over the sharded mesh dims). ``layouts``:
    each tensor operand's ShardSpec, else its shape (None where absent)."""
    specs = [lay for lay in layouts if isinstance(lay, ShardSpec)]
    shape = tuple(layouts[0].shape if isinstance(layouts[0], ShardSpec) else layouts[0])
    sharded = [s for s in specs if not s.is_replicated and tuple(s.shape) == shape]
    spec = (sharded or specs)[0]
    if tuple(spec.shape) != shape:
        spec = replicated_spec(spec.mesh, shape)
    spec = spec.reduced()
    mesh = spec.mesh
    pl = [Partial("sum") if isinstance(p, Shard) else p for p in spec.placements]
    return spec, ShardSpec(mesh, pl, (), (None,) * mesh.ndim)


# loss op -> number of leading tensor args (self, target[, weight, pos_weight]); reduction position
_LOSSES = {
    aten.mse_loss.default: (2, 2),
    aten.huber_loss.default: (2, 2),
    aten.smooth_l1_loss.default: (2, 2),
    aten.binary_cross_entropy_with_logits.default: (4, 4),
}


@register_aten(*_LOSSES)
def elementwise_loss(func, args, kwargs):
    n_t, red_pos = _LOSSES[func]
    args = list(args) + [None] * (n_t - len(args)) if len(args) < n_t else list(args)
    reduction = args[red_pos] if len(args) > red_pos else kwargs.pop("reduction", _MEAN)
    kwargs = dict(kwargs)
    kwargs.pop("reduction", None)
    tensors = args[:n_t]
    if any(t is not None and t.shape != tensors[0].shape for t in tensors[1:2]):
        return unsupported_or_fallback(func, tuple(args), kwargs, "input and target shapes differ")
    spec, summed = _ref_specs(func, tensors)
    # weights of other shapes broadcast: slice them only where they are full along a sharded dim
    locs = [local_as(t, spec) for t in tensors[:2]] + [
        None if w is None else (local_as(w, spec) if w.shape == spec.shape else
                                (replicate_local(w) if isinstance(w, ShardTensor) else w)) for w in tensors[2:]]
    extra = args[red_pos + 1:]  # e.g. huber's delta
    if reduction == _NONE:
        return ShardTensor.from_spec(func(*locs, _NONE, *extra, **kwargs), spec)
    local = func(*locs, _SUM, *extra, **kwargs)
    if reduction == _MEAN:
        local = local / spec.shape.numel()
    return ShardTensor.from_spec(local, summed)


# backward op -> reduction position
_LOSS_BACKWARDS = {
    aten.mse_loss_backward.default: 3,
    aten.huber_loss_backward.default: 3,
    aten.smooth_l1_loss_backward.default: 3,
}


@register_aten(*_LOSS_BACKWARDS)
def elementwise_loss_backward(func, args, kwargs):
    grad, x, target = args[0], args[1], args[2]
    reduction = args[3]
    spec = _ref_specs(func, [x, target])[0]
    lx, lt = local_as(x, spec), local_as(target, spec)
    if reduction == _NONE:
        lg = local_as(grad, spec)
    else:
        lg = replicate_local(grad) if isinstance(grad, ShardTensor) else grad
    out = func(lg, lx, lt, _SUM if reduction != _NONE else _NONE, *args[4:], **kwargs)
    if reduction == _MEAN:
        out = out / spec.shape.numel()
    return ShardTensor.from_spec(out, spec)


@register_aten(aten.native_dropout.default)
def dropout(func, args, kwargs):
    """Dropout on local chunks: each rank draws its own mask (statistically, not bitwise, equal to
    single-device dropout, whose random stream depends on the whole tensor)."""
    x = args[0]
    spec = x._spec.reduced()
    out, mask = func(to_spec(x, spec), *args[1:], **kwargs)
    return ShardTensor.from_spec(out, spec), ShardTensor.from_spec(mask, spec)
