"""Ops whose result size depends on the data: ``nonzero`` (``argwhere``), ``masked_select`` and its backward's
``masked_scatter``, with the outermost dim sharded. Row-major order then runs rank by rank, so each rank
selects from its own chunk and the result is sharded along its first dim in the ranks' counts (one small
all-gather of the counts); ``nonzero`` adds the rank's first row to its row indices."""

from __future__ import annotations

import torch

from domainflow import comm
from domainflow.dispatch.registry import register_aten
from domainflow.dispatch.toolkit import layout_rule, local_as, unsupported_or_fallback
from domainflow.layout import shapes
from domainflow.layout.placements import Replicate, Shard
from domainflow.layout.spec import ShardSpec
from domainflow.tensor.shard_tensor import ShardTensor

aten = torch.ops.aten


def _outer_mesh_dim(spec: ShardSpec):
    """The mesh dim sharding dim 0 when that is the only sharding (row-major order is rank order), or why not."""
    if spec.has_partial:
        return None, "it has a pending sum"
    sharded = [m for m, d in enumerate(spec.shard_dims) if d is not None]
    if len(sharded) != 1 or spec.shard_dims[sharded[0]] != 0:
        return None, "row-major order is rank order only with dim 0 alone sharded"
    return sharded[0], None


def _counts(count: int, spec: ShardSpec, m: int) -> tuple:
    """Every rank's ``count`` along mesh dim ``m``: a gather over that mesh dim only (data-parallel replicas on
    another mesh dim hold other samples and need not be at the same op)."""
    return tuple(int(c) for c in comm.all_gather_object(int(count), spec.mesh, m))


@layout_rule
def _selected_layout(spec: ShardSpec, m: int, counts: tuple, trailing: tuple) -> ShardSpec:
    placements = [Shard(0) if k == m else Replicate() for k in range(spec.mesh.ndim)]
    sizes = [counts if k == m else None for k in range(spec.mesh.ndim)]
    return ShardSpec(spec.mesh, placements, (sum(counts), *trailing), sizes)


@register_aten(aten.nonzero.default)
def nonzero(func, args, kwargs):
    x = args[0]
    m, why = _outer_mesh_dim(x._spec)
    if why:
        return unsupported_or_fallback(func, args, kwargs, why)
    local = torch.nonzero(x._local)
    local[:, 0] += x._spec.offsets[0]
    counts = _counts(local.shape[0], x._spec, m)
    return ShardTensor.from_spec(local, _selected_layout(x._spec, m, counts, (x.ndim,)))


def _mask_layout(x, mask, func):
    """(x's layout, the mesh dim sharding its dim 0) when the mask broadcasts to x's shape, or why not."""
    if not isinstance(x, ShardTensor):
        return None, None, "only the mask is sharded"
    if shapes.broadcast_shape(x.shape, mask.shape) != tuple(x.shape):
        return None, None, "the mask broadcasts the input to a larger shape"
    m, why = _outer_mesh_dim(x._spec)
    return x._spec, m, why


@register_aten(aten.masked_select.default)
def masked_select(func, args, kwargs):
    x, mask = args
    spec, m, why = _mask_layout(x, mask, func)
    if why:
        return unsupported_or_fallback(func, args, kwargs, why)
    local = torch.masked_select(x._local, _mask_part(mask, spec))
    return ShardTensor.from_spec(local, _selected_layout(spec, m, _counts(local.shape[0], spec, m), ()))


def _mask_part(mask, spec: ShardSpec) -> torch.Tensor:
    """This rank's part of a mask that broadcasts to ``spec``'s shape (its rows when it has them all)."""
    if mask.ndim == spec.ndim and mask.shape[0] == spec.shape[0]:
        return local_as(mask, spec.with_(shape=mask.shape))
    return mask._local if isinstance(mask, ShardTensor) else mask  # broadcast along dim 0 (size 1 or absent)


@register_aten(aten.masked_scatter.default, aten.masked_scatter_.default)
def masked_scatter(func, args, kwargs):
    """``x`` with its masked elements taken from ``source`` in row-major order: each rank takes the run of
    ``source`` after the elements the ranks before it take."""
    x, mask, source = args
    spec, m, why = _mask_layout(x, mask, func)
    if why or (isinstance(source, ShardTensor) and source.ndim != 1):
        return unsupported_or_fallback(func, args, kwargs, why or "a sharded source that is not 1-D")
    local_mask = _mask_part(mask, spec).expand(spec.local_shape)
    counts = _counts(int(local_mask.sum()), spec, m)
    start = sum(counts[:spec.coord[m]])
    if isinstance(source, ShardTensor):
        total = source.shape[0]
        sizes = counts[:-1] + (total - sum(counts[:-1]),)
        part = local_as(source, ShardSpec(spec.mesh, [Shard(0) if k == m else Replicate()
                                                      for k in range(spec.mesh.ndim)], (total,),
                                          [sizes if k == m else None for k in range(spec.mesh.ndim)]))
        part = part[:counts[spec.coord[m]]]
    else:
        part = source.reshape(-1)[start:start + counts[spec.coord[m]]]
    if func is aten.masked_scatter_.default:
        x._local.masked_scatter_(local_mask, part)
        return x
    return ShardTensor.from_spec(x._local.masked_scatter(local_mask, part), spec)
