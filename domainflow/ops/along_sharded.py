"""Softmax, softmin, log-softmax, logsumexp, cumsum, cumprod, roll and flip along a sharded dim, without moving
the tensor.

The generic rule for dim-wise ops (``dimwise``) moves the shard off the dim first (an all-to-all of the
whole tensor). These handlers instead communicate only what the op needs: softmax-type ops all-reduce a
max (no gradient) and a sum of exponentials (differentiable) of the reduced shape; roll fetches only the
rows that cross rank boundaries (the halo exchange, with periodic wrap); flip fetches each rank's rows from
their mirror images (the layout stays as it was); cumsum and cumprod scan each chunk and combine it with the
ranks before it (one all-gather of each rank's total).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domainflow import comm
from domainflow.dispatch.toolkit import Schema, layout_rule, local_exact, run_function_default, to_spec, unsupported_or_fallback
from domainflow.layout import shapes
from domainflow.layout.placements import Replicate, Shard
from domainflow.dispatch.registry import register_aten, register_function
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.dispatch.toolkit import spec_from_sizes, spec_like, without_partial


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _global_max(local: torch.Tensor, dims, spec, mesh_dims) -> torch.Tensor:
    """Max over ``dims`` and the ranks of ``mesh_dims`` (a shift for stable exponentials: no gradient)."""
    with torch.no_grad():
        if local.numel():
            mx = local.amax(dims, keepdim=True)
        else:
            shape = [1 if k in dims else n for k, n in enumerate(local.shape)]
            mx = local.new_full(shape, float("-inf"))
        for m in mesh_dims:
            mx = comm.all_reduce(mx.contiguous(), "max", spec.mesh, m)
        return torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))


_SOFTMAX_ARGS = Schema("self", "dim", "_stacklevel", "dtype", _stacklevel=3, dtype=None)


def _softmax_like(log: bool):
    def handler(func, args, kwargs):
        a = _SOFTMAX_ARGS.bind(args, kwargs)
        x, dim = a["self"], a["dim"]
        if not isinstance(x, ShardTensor) or dim is None:
            return run_function_default(func, args, kwargs)
        d = _norm_dim(dim, x.ndim)
        m = x._spec.mesh_dim_of(d)
        if m is None:
            return run_function_default(func, args, kwargs)
        x = without_partial(x)
        spec = x._spec
        local = x.to_local()
        if a["dtype"] is not None:
            local = local.to(a["dtype"])
        shifted = local - _global_max(local, (d,), spec, [m])
        total = comm.all_reduce_sum_autograd(shifted.exp().sum(d, keepdim=True), spec.mesh, m)
        y = shifted - total.log() if log else shifted.exp() / total
        return ShardTensor.from_spec(y, spec_like(spec, y.shape))
    return handler


_LOGSUMEXP_ARGS = Schema("self", "dim", "keepdim", keepdim=False)


def _logsumexp(func, args, kwargs):
    a = _LOGSUMEXP_ARGS.bind(args, kwargs)
    x = a["self"]
    if not isinstance(x, ShardTensor):
        return run_function_default(func, args, kwargs)
    dims = a["dim"]
    dims = tuple(range(x.ndim)) if dims in (None, (), []) else ((dims,) if isinstance(dims, int) else tuple(dims))
    dims = tuple(sorted(_norm_dim(d, x.ndim) for d in dims))
    mesh_dims = [m for m in (x._spec.mesh_dim_of(d) for d in dims) if m is not None]
    if not mesh_dims:
        return run_function_default(func, args, kwargs)
    x = without_partial(x)
    spec = x._spec
    local = x.to_local()
    mx = _global_max(local, dims, spec, mesh_dims)
    total = (local - mx).exp().sum(dims, keepdim=True)
    for m in mesh_dims:
        total = comm.all_reduce_to_replicated(total, spec.mesh, m)
    y = mx + total.log()
    placements, mapping = [], {}
    for k, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim not in dims:
            new_dim = p.dim if a["keepdim"] else p.dim - sum(1 for d in dims if d < p.dim)
            placements.append(Shard(new_dim))
            mapping[k] = list(spec.sizes[k])
        else:
            placements.append(Replicate())
    if not a["keepdim"]:
        y = y.squeeze(dims) if dims else y
    return ShardTensor.from_spec(y, spec_from_sizes(y.shape, spec.mesh, placements, mapping))


@layout_rule
def _roll_fetch(sizes: tuple, shift: int, me: int):
    """This rank's row fetch for a roll by ``shift`` along a dim split in ``sizes`` (periodic), once per
    layout and shift: the per-call work does not grow with the rows."""
    n = sum(sizes)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    wanted = [[(g - shift) % n for g in range(s, s + k)] for s, k in zip(starts, sizes)]
    return shapes.row_fetch_plan(sizes, wanted, me)


def _softmin(func, args, kwargs):
    a = _SOFTMAX_ARGS.bind(args, kwargs)
    x = a["self"]
    if not isinstance(x, ShardTensor) or a["dim"] is None:
        return run_function_default(func, args, kwargs)
    return _softmax_like(log=False)(torch.softmax, (-x, a["dim"]), {"dtype": a["dtype"]})


_SCAN_ARGS = Schema("self", "dim", "dtype", dtype=None)


def _scan(product: bool):
    """cumsum (cumprod) along a sharded dim: each rank's chunk scanned, plus (times) the totals of the ranks
    before it; differentiable (the totals travel through an autograd all-gather)."""
    def handler(func, args, kwargs):
        a = _SCAN_ARGS.bind(args, kwargs)
        x = a["self"]
        if not isinstance(x, ShardTensor):
            return run_function_default(func, args, kwargs)
        d = _norm_dim(a["dim"], x.ndim) if x.ndim else 0
        m = x._spec.mesh_dim_of(d) if x.ndim else None
        if m is None:
            return run_function_default(func, args, kwargs)
        x = without_partial(x)
        spec = x._spec
        local = x.to_local()
        if a["dtype"] is not None:
            local = local.to(a["dtype"])
        scanned = torch.cumprod(local, d) if product else torch.cumsum(local, d)
        n = local.shape[d]
        # an empty chunk's total is 1 (0), still from the chunk: every rank's all-gather then has a backward
        empty = local.narrow(d, 0, 0)
        total = scanned.narrow(d, n - 1, 1) if n else (empty.prod(d, keepdim=True) if product else empty.sum(d, keepdim=True))
        world = len(spec.sizes[m])
        totals = comm.all_gather_autograd(total.contiguous(), d, [1] * world, spec.mesh, m)
        before = totals.narrow(d, 0, spec.coord[m])
        y = scanned * before.prod(d, keepdim=True) if product else scanned + before.sum(d, keepdim=True)
        return ShardTensor.from_spec(y, spec_like(spec, y.shape))
    return handler


@layout_rule
def _flip_fetch(sizes: tuple, me: int):
    """This rank's row fetch for a flip along a dim split in ``sizes``: its rows' mirror images, in order."""
    n = sum(sizes)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return shapes.row_fetch_plan(sizes, [[n - 1 - g for g in range(s, s + k)] for s, k in zip(starts, sizes)], me)


aten = torch.ops.aten


@register_aten(aten.roll.default, aten.flip.default)
def roll_or_flip(func, args, kwargs):
    """Below autograd (torch's own ops call these: ``fft.fftshift``; their backward is a roll or flip again):
    along unsharded dims on the chunk, along a sharded dim with the rows fetched from their owners; the
    result keeps the input's layout."""
    x = args[0]
    if func is aten.roll.default:
        shifts = args[1] if len(args) > 1 else kwargs["shifts"]
        dims = args[2] if len(args) > 2 else kwargs.get("dims", ())
        shifts, dims = ((shifts,) if isinstance(shifts, int) else tuple(shifts)), tuple(dims)
        if not dims:
            if x._spec.is_replicated:
                return ShardTensor.from_spec(torch.roll(x._local, shifts), x._spec)
            return unsupported_or_fallback(func, args, kwargs, "a roll without dims works on the flattened tensor")
    else:
        dims = tuple(args[1] if len(args) > 1 else kwargs["dims"])
        shifts = (None,) * len(dims)
    spec = x._spec.reduced()
    local = to_spec(x, spec)
    if all(spec.mesh_dim_of(_norm_dim(d, x.ndim)) is None for d in dims):
        if local is x._local:
            local_exact()
        return ShardTensor.from_spec(func(local, *args[1:], **kwargs), spec)
    for shift, d in zip(shifts, dims):
        d = _norm_dim(d, x.ndim)
        m = spec.mesh_dim_of(d)
        if m is None:
            local = torch.roll(local, shift, d) if shift is not None else torch.flip(local, (d,))
            continue
        sizes = tuple(spec.sizes[m])
        plan = _roll_fetch(sizes, shift, spec.coord[m]) if shift is not None else _flip_fetch(sizes, spec.coord[m])
        local = comm.fetch_rows(local, d, plan, spec.mesh, m)
    return ShardTensor.from_spec(local, spec)


for _f in (torch.softmax, F.softmax, torch.Tensor.softmax):
    register_function(_f)(_softmax_like(log=False))
for _f in (torch.log_softmax, F.log_softmax, torch.Tensor.log_softmax):
    register_function(_f)(_softmax_like(log=True))
for _f in (torch.logsumexp, torch.Tensor.logsumexp):
    register_function(_f)(_logsumexp)
register_function(F.softmin)(_softmin)
for _f in (torch.cumsum, torch.Tensor.cumsum):
    register_function(_f)(_scan(product=False))
for _f in (torch.cumprod, torch.Tensor.cumprod):
    register_function(_f)(_scan(product=True))
