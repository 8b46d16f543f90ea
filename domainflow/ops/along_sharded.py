"""Softmax, log-softmax, logsumexp and roll along a sharded dim, without moving the tensor.

The generic rule for dim-wise ops (``dimwise``) moves the shard off the dim first (an all-to-all of the
whole tensor). These handlers instead communicate only what the op needs: softmax-type ops all-reduce a
max (no gradient) and a sum of exponentials (differentiable) of the reduced shape; roll fetches only the
rows that cross rank boundaries (the halo exchange, with periodic wrap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from domainflow import comm
from domainflow.dispatch.toolkit import Schema, layout_rule, run_function_default
from domainflow.layout import shapes
from domainflow.layout.placements import Replicate, Shard
from domainflow.dispatch.registry import register_function
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


_ROLL_ARGS = Schema("self", "shifts", "dims", dims=None)


def _roll(func, args, kwargs):
    a = _ROLL_ARGS.bind(args, kwargs)
    x = a["self"]
    if not isinstance(x, ShardTensor) or a["dims"] in (None, (), []):
        return run_function_default(func, args, kwargs)
    shifts = (a["shifts"],) if isinstance(a["shifts"], int) else tuple(a["shifts"])
    dims = (a["dims"],) if isinstance(a["dims"], int) else tuple(a["dims"])
    if len(shifts) != len(dims) or not any(x._spec.mesh_dim_of(_norm_dim(d, x.ndim)) is not None for d in dims):
        return run_function_default(func, args, kwargs)
    x = without_partial(x)
    spec = x._spec
    local = x.to_local()
    for shift, d in zip(shifts, dims):
        d = _norm_dim(d, x.ndim)
        m = spec.mesh_dim_of(d)
        if m is None:
            local = torch.roll(local, shift, d)
            continue
        local = comm.fetch(local, d, _roll_fetch(tuple(spec.sizes[m]), shift, spec.coord[m]), spec.mesh, m)
    return ShardTensor.from_spec(local, spec_like(spec, local.shape))


@layout_rule
def _roll_fetch(sizes: tuple, shift: int, me: int):
    """This rank's row fetch for a roll by ``shift`` along a dim split in ``sizes`` (periodic), once per
    layout and shift: the per-call work does not grow with the rows."""
    n = sum(sizes)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    wanted = [[(g - shift) % n for g in range(s, s + k)] for s, k in zip(starts, sizes)]
    return shapes.row_fetch_plan(sizes, wanted, me)


for _f in (torch.softmax, F.softmax, torch.Tensor.softmax):
    register_function(_f)(_softmax_like(log=False))
for _f in (torch.log_softmax, F.log_softmax, torch.Tensor.log_softmax):
    register_function(_f)(_softmax_like(log=True))
for _f in (torch.logsumexp, torch.Tensor.logsumexp):
    register_function(_f)(_logsumexp)
for _f in (torch.roll, torch.Tensor.roll):
    register_function(_f)(_roll)
