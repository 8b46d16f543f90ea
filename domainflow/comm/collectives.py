"""Collectives on local tensors (no autograd): all-reduce (with riders; small Gloo payloads as one
swap), coalesced, uneven all-gather, all-to-all, broadcast, gathers of objects and ints."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from domainflow.layout.spec import mesh_coordinate
from domainflow.comm import base as _base
from domainflow.comm.base import (
    _all_gather_single, _device, _group, group_size, _named, _nbytes, pending_checks, _REDUCE_OPS, stats)
from domainflow.comm.p2p import _exchange, begin_exchange


# --------------------------------------------------------------------------------------------
# primitives on local tensors (no autograd)
# --------------------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, reduce_op: str, mesh: DeviceMesh, mesh_dim: int,
               what: tuple[str, str] | None = None, kind: str = "all_reduce") -> torch.Tensor:
    """Out-of-place all-reduce of ``t`` over one mesh dim (``avg`` done as sum / size for Gloo).
    Every rank gets the same bits. Small payloads on Gloo go by :func:`_reduce_by_exchange`. ``what``:
    (op, detail) to name in errors instead of "all_reduce(<op>)"; ``kind``: the ``stats`` key it counts under."""
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return t.clone()
    if pending_checks:
        _base._run_checks(f"all_reduce({reduce_op})")
    if _riders and reduce_op == "sum":
        riding = _take_riders(mesh, mesh_dim, t.dtype, t.device)
        if riding:
            return _all_reduce_with_riders(t, riding, mesh, mesh_dim)
    out = t.detach().clone(memory_format=torch.contiguous_format)
    stats.add(kind, _nbytes(out))
    bool_in = out.dtype == torch.bool
    if bool_in:
        out = out.to(torch.uint8)
    if _nbytes(out) * (n - 1) <= EXCHANGE_REDUCE_MAX_BYTES and _is_gloo(mesh, mesh_dim):
        out = _reduce_by_exchange(out, reduce_op, mesh, mesh_dim, what)
    else:
        nan = None
        if reduce_op in ("max", "min") and out.is_floating_point():
            nan = out.isnan()  # Gloo's MAX/MIN may drop a NaN from another rank; torch propagates it
            if bool(nan.any()):
                out = out.masked_fill(nan, 0)
            nan = nan.to(torch.uint8)
            with _named("all_reduce(max, NaN flags)", mesh, mesh_dim):
                dist.all_reduce(nan, op=dist.ReduceOp.MAX, group=_group(mesh, mesh_dim))
        op, detail = what or (f"all_reduce({reduce_op}) of {out.numel()} values", "")
        with _named(op, mesh, mesh_dim, detail):
            dist.all_reduce(out, op=_REDUCE_OPS[reduce_op], group=_group(mesh, mesh_dim))
        if nan is not None and bool(nan.any()):
            out = out.masked_fill(nan.bool(), float("nan"))
    if reduce_op == "avg":
        out = out / n if out.is_floating_point() or out.is_complex() else out // n
    return out.bool() if bool_in else out


# --------------------------------------------------------------------------------------------
# riders: small pending sums carried by the next all-reduce (a loss after backward)
# --------------------------------------------------------------------------------------------
class Rider:
    """A small pending sum (``local``, Partial(sum) over ``dims`` of ``mesh``) that the next sum all-reduce
    over each of those mesh dims carries along in its payload, so it costs no collective of its own;
    ``on_done(reduced)`` runs when every dim is reduced. See :func:`ride_along`."""

    __slots__ = ("local", "mesh", "dims", "on_done")

    def __init__(self, local, mesh, dims, on_done):
        self.local, self.mesh, self.dims, self.on_done = local, mesh, list(dims), on_done

    def reduced(self, value: torch.Tensor) -> None:
        self.local = value
        self.dims.pop(0)
        if not self.dims:
            self.on_done(value)


_riders: list[Rider] = []
_riders_lock = threading.Lock()  # backward may run on autograd's device threads


def ride_along(local: torch.Tensor, mesh: DeviceMesh, dims, on_done) -> Rider:
    """Queue ``local`` (a pending sum over mesh ``dims``) to travel with the next sum all-reduce of its dtype
    over each dim in turn; every rank must queue the same riders in the same order. :func:`land` finishes
    those no all-reduce carried."""
    rider = Rider(local.detach().contiguous(), mesh, [m for m in dims if group_size(mesh, m) > 1], on_done)
    if not rider.dims:
        on_done(rider.local)
        return rider
    with _riders_lock:
        _riders.append(rider)
    return rider


def land(riders, drop: bool = False) -> None:
    """Finish ``riders`` that no all-reduce carried, with one all-reduce per remaining mesh dim (or, with
    ``drop``, forget them: the backward they were waiting for failed)."""
    with _riders_lock:
        for r in riders:
            if r in _riders:
                _riders.remove(r)
    if drop:
        return
    for r in riders:
        while r.dims:
            r.reduced(all_reduce(r.local, "sum", r.mesh, r.dims[0]))


def _take_riders(mesh, mesh_dim, dtype, device) -> list[Rider]:
    group = _group(mesh, mesh_dim)
    with _riders_lock:
        riding = [r for r in _riders if r.local.dtype == dtype and r.local.device == device
                  and _group(r.mesh, r.dims[0]) is group]
        for r in riding:
            _riders.remove(r)
    return riding


def _all_reduce_with_riders(t, riding, mesh, mesh_dim) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1)] + [r.local.reshape(-1) for r in riding])
    red = all_reduce(flat, "sum", mesh, mesh_dim)
    out, i = red[:t.numel()].view(t.shape), t.numel()
    for r in riding:
        r.reduced(red[i:i + r.local.numel()].view(r.local.shape).clone())  # not a view keeping the payload
        i += r.local.numel()
        if r.dims:  # reduced over this dim; now waits for the next one's all-reduce
            with _riders_lock:
                _riders.append(r)
    return out


# Payload bytes a rank may send (tensor bytes x (peers)) for an all-reduce done as one point-to-point swap.
# Gloo's all_reduce of a small tensor took about 3 ms here (median, 2 CPU ranks; p90 4 ms) against 0.3 ms
# for a swap of the same bytes; normalisation layers need one per layer and direction (21 per step of the
# grid_scaling UNet). Larger payloads keep Gloo's bandwidth-optimal ring; NCCL always does.
EXCHANGE_REDUCE_MAX_BYTES = 1 << 20
_BACKENDS: dict = {}


def _is_gloo(mesh: DeviceMesh, mesh_dim: int) -> bool:
    group = _group(mesh, mesh_dim)
    hit = _BACKENDS.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _BACKENDS[id(group)] = (group, str(dist.get_backend(group)) == "gloo")
    return hit[1]


_FOLD = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


def _reduce_by_exchange(out: torch.Tensor, reduce_op: str, mesh: DeviceMesh, mesh_dim: int,
                        what: tuple[str, str] | None = None) -> torch.Tensor:
    """All-reduce by sending ``out`` to every other rank of the mesh dim and folding the n parts in rank
    order, so every rank computes the same expression and gets the same bits; max/min propagate NaN."""
    n = group_size(mesh, mesh_dim)
    me = mesh_coordinate(mesh)[mesh_dim]
    peers = [k for k in range(n) if k != me]
    op, detail = what or (f"all_reduce({reduce_op}) of {out.numel()} values", "")
    got = _exchange({k: out for k in peers}, {k: out.shape for k in peers}, out, mesh, mesh_dim, op,
                    begin_exchange(mesh, mesh_dim, op), kind=None, detail=detail)
    fold = _FOLD[reduce_op]
    acc = out if me == 0 else got[0]
    for k in range(1, n):
        acc = fold(acc, out if k == me else got[k])
    return acc


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], reduce_op: str, mesh: DeviceMesh,
                         mesh_dim: int) -> list[torch.Tensor]:
    """One all-reduce for several tensors of one dtype (flattened into one buffer)."""
    if group_size(mesh, mesh_dim) == 1:
        return [t.clone() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    red = all_reduce(flat, reduce_op, mesh, mesh_dim)
    out, i = [], 0
    for t in tensors:
        out.append(red[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return out


def all_gather_uneven(t: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh,
                      mesh_dim: int) -> torch.Tensor:
    """Concatenate along ``dim`` the parts of every rank of one mesh dim; part k has ``sizes[k]`` rows.

    Parts are flattened and padded to the largest part so one ``all_gather_into_tensor`` works on
    Gloo and NCCL; when all parts are equal no padding copy is made.
    """
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return t
    if pending_checks:
        _base._run_checks("all_gather")
    shape = list(t.shape)
    row = math.prod(shape[:dim] + shape[dim + 1:])
    numels = [s * row for s in sizes]
    width = max(numels)
    flat = t.contiguous().view(-1)
    if flat.numel() != width:
        flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
    buf = flat.new_empty(n * width)
    stats.add("all_gather", _nbytes(flat))
    with _named("all_gather", mesh, mesh_dim, f" (uneven sizes {tuple(sizes)} along dim {dim})"):
        _all_gather_single(buf, flat, group=_group(mesh, mesh_dim))
    buf = buf.view(n, width)
    parts = [buf[k, : numels[k]].view(shape[:dim] + [sizes[k]] + shape[dim + 1:]) for k in range(n)]
    return torch.cat(parts, dim=dim)


def all_to_all_dims(t: torch.Tensor, split_dim: int, send_sizes: Sequence[int], cat_dim: int,
                    recv_shapes: Sequence[Sequence[int]], mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Split ``t`` along ``split_dim`` into ``send_sizes`` (one block per rank of the mesh dim), send
    block k to rank k, and concatenate the blocks received (shapes ``recv_shapes``) along ``cat_dim``.

    Covers Shard(i) -> Shard(j) and uneven -> uneven resharding of one dim; exact bytes, no padding.
    """
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return t
    if pending_checks:
        _base._run_checks("all_to_all")
    blocks = torch.split(t, list(send_sizes), dim=split_dim)
    send = torch.cat([b.reshape(-1) for b in blocks]) if t.numel() else t.new_empty(0)
    recv_numels = [math.prod(s) for s in recv_shapes]
    recv = t.new_empty(sum(recv_numels))
    stats.add("all_to_all", _nbytes(send))
    with _named("all_to_all", mesh, mesh_dim, f" (send {list(send_sizes)} along dim {split_dim})"):
        dist.all_to_all_single(recv, send, output_split_sizes=recv_numels,
                               input_split_sizes=[b.numel() for b in blocks], group=_group(mesh, mesh_dim))
    parts = torch.split(recv, recv_numels)
    return torch.cat([p.view(tuple(s)) for p, s in zip(parts, recv_shapes)], dim=cat_dim)


def broadcast(t: torch.Tensor, src_coord: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Broadcast ``t`` from coordinate ``src_coord`` of one mesh dim; every rank passes a tensor of the
    right shape (receivers' contents are ignored)."""
    if group_size(mesh, mesh_dim) == 1:
        return t
    if pending_checks:
        _base._run_checks("broadcast")
    out = t.detach().contiguous().clone()
    src = dist.get_global_rank(_group(mesh, mesh_dim), src_coord)
    stats.add("broadcast", _nbytes(out))
    with _named("broadcast", mesh, mesh_dim, f" from coordinate {src_coord}"):
        dist.broadcast(out, src=src, group=_group(mesh, mesh_dim))
    return out


def all_gather_object(obj, mesh: DeviceMesh, mesh_dim: int) -> list:
    """Gather a small picklable object from each rank of one mesh dim (for metadata only)."""
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return [obj]
    if pending_checks:
        _base._run_checks("all_gather_object")
    out = [None] * n
    with _named("all_gather_object", mesh, mesh_dim):
        dist.all_gather_object(out, obj, group=_group(mesh, mesh_dim))
    return out


def all_gather_object_mesh(obj, mesh: DeviceMesh) -> list:
    """Gather a small picklable object from every rank of the whole mesh, in mesh (row-major) order."""
    out = [obj]
    for m in reversed(range(mesh.ndim)):  # the last dim first, then outward: row-major order
        out = [x for part in all_gather_object(out, mesh, m) for x in part]
    return out


def all_gather_ints(values: Sequence[int], mesh: DeviceMesh) -> list[list[int]]:
    """Gather a short int vector from every rank of the whole mesh, in mesh (row-major) order."""
    ranks = mesh.mesh.flatten().tolist()
    if len(ranks) == 1:
        return [list(values)]
    if pending_checks:
        _base._run_checks("all_gather(shapes)")
    t = torch.tensor(list(values), dtype=torch.int64, device=_device(mesh))
    out = []
    # gather dim by dim: first over the last mesh dim, then outward, so any mesh shape works
    gathered = t.view(1, -1)
    for m in reversed(range(mesh.ndim)):
        n = group_size(mesh, m)
        flat = gathered.contiguous().view(-1)
        buf = flat.new_empty(n * flat.numel())
        with _named("all_gather(shapes)", mesh, m):
            _all_gather_single(buf, flat, group=_group(mesh, m))
        gathered = buf.view(-1, t.numel())
    for row in gathered.tolist():
        out.append([int(v) for v in row])
    return out
