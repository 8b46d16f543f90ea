"""``diagonal`` with one of its two dims sharded, and its backward. Each rank's chunk holds one contiguous run
of the diagonal, so the result is a view of the chunk (writes reach the input) sharded along its last dim
in those run lengths; no communication. torch's decompositions of ``diag``, ``diag_embed``, ``diagflat``,
``trace`` and ``linalg.diagonal`` go through it."""

from __future__ import annotations

import torch

from domainflow.dispatch.registry import register_aten
from domainflow.dispatch.toolkit import Schema, layout_rule, local_as, unsupported_or_fallback
from domainflow.layout import shapes
from domainflow.layout.placements import Shard
from domainflow.layout.spec import ShardSpec
from domainflow.memo import Memo
from domainflow.tensor.shard_tensor import ShardTensor

aten = torch.ops.aten
_ARGS = Schema("self", "offset", "dim1", "dim2", offset=0, dim1=0, dim2=1)
_BACKWARD_ARGS = Schema("grad_output", "input_sizes", "offset", "dim1", "dim2")
# a diagonal's result layout -> the input layout it was taken from, so its backward restores that layout
_origin = Memo(4096, "diagonal origins")


@layout_rule
def _diagonal_layout(spec: ShardSpec, offset: int, d1: int, d2: int):
    """(the layout of ``x.diagonal(offset, d1, d2)``, this rank's offset within its chunk), or why not."""
    m1, m2 = spec.mesh_dim_of(d1), spec.mesh_dim_of(d2)
    if m1 is not None and m2 is not None:
        return f"both diagonal dims {d1} and {d2} are sharded"
    if spec.shard_dims.count(d1) > 1 or spec.shard_dims.count(d2) > 1:
        return "a diagonal dim is sharded over several mesh dims"
    keep = [d for d in range(spec.ndim) if d not in (d1, d2)]
    pos = {d: i for i, d in enumerate(keep)}
    rows, cols = spec.shape[d1], spec.shape[d2]
    length = max(0, min(rows, cols - offset) - max(0, -offset))
    pl, sz, local_offset = [], list(spec.sizes), offset
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim in (d1, d2):
            counts, local = shapes.diagonal_runs(spec.sizes[m], rows, cols, offset, p.dim == d1)
            pl.append(Shard(len(keep)))
            sz[m] = counts
            local_offset = local[spec.coord[m]]
        elif isinstance(p, Shard):
            pl.append(Shard(pos[p.dim]))
        else:
            pl.append(p)
    return ShardSpec(spec.mesh, pl, [spec.shape[d] for d in keep] + [length], sz), local_offset


@register_aten(aten.diagonal.default)
def diagonal(func, args, kwargs):
    a = _ARGS.bind(args, kwargs)
    x = a["self"]
    d1, d2 = a["dim1"] % x.ndim, a["dim2"] % x.ndim
    plan = _diagonal_layout(x._spec, a["offset"], d1, d2)
    if isinstance(plan, str):
        return unsupported_or_fallback(func, args, kwargs, plan)
    out, local_offset = plan
    _origin.put((out, a["offset"], d1, d2, tuple(x.shape)), x._spec)
    return ShardTensor.from_spec(x._local.diagonal(local_offset, d1, d2), out)


@register_aten(aten.diagonal_backward.default)
def diagonal_backward(func, args, kwargs):
    """The input gradient in the layout the forward input had (zeros off the diagonal)."""
    a = _BACKWARD_ARGS.bind(args, kwargs)
    grad, sizes = a["grad_output"], tuple(a["input_sizes"])
    d1, d2 = a["dim1"] % len(sizes), a["dim2"] % len(sizes)
    spec = _origin.get((grad._spec, a["offset"], d1, d2, sizes)) if isinstance(grad, ShardTensor) else None
    if spec is None:
        return unsupported_or_fallback(func, args, kwargs, "the gradient is not laid out as a diagonal of a "
                                       "sharded tensor domainflow took")
    out, local_offset = _diagonal_layout(spec, a["offset"], d1, d2)
    local = grad._local.new_zeros(spec.local_shape)
    local.diagonal(local_offset, d1, d2).copy_(grad._local)
    return ShardTensor.from_spec(local, spec)


_SCATTER_ARGS = Schema("self", "src", "offset", "dim1", "dim2", offset=0, dim1=0, dim2=1)


@register_aten(aten.diagonal_scatter.default)
def diagonal_scatter(func, args, kwargs):
    """``x`` with its diagonal replaced by ``src``: each rank writes its run of ``src`` into its chunk."""
    a = _SCATTER_ARGS.bind(args, kwargs)
    x, src = a["self"], a["src"]
    if not isinstance(x, ShardTensor):
        return unsupported_or_fallback(func, args, kwargs, "the destination is not sharded")
    d1, d2 = a["dim1"] % x.ndim, a["dim2"] % x.ndim
    spec = x._spec.reduced() if isinstance(src, ShardTensor) or x._spec.has_partial else x._spec
    plan = _diagonal_layout(spec, a["offset"], d1, d2)
    if isinstance(plan, str):
        return unsupported_or_fallback(func, args, kwargs, plan)
    out, local_offset = plan
    local = local_as(x, spec).clone()
    local.diagonal(local_offset, d1, d2).copy_(local_as(src, out))
    return ShardTensor.from_spec(local, spec)
