"""Halo exchange: the rows a rank needs from its neighbours along one sharded dim, fetched point to point
(forward) and their gradients returned and summed (backward)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from domainflow.layout.shapes import index_runs
from domainflow.layout.spec import mesh_coordinate
from domainflow.memo import PLANS
from domainflow.comm import traced as _traced
from domainflow.comm.p2p import SALT_HALO_BACK, _exchange_start, _exchange_wait, begin_exchange


_runs = index_runs
_compiling = torch.compiler.is_compiling


def _copy_rows(dst, dim, positions, src, rows, runs=None):
    """dst[positions] = src[rows] along ``dim``, by slices where the indices run contiguously (``runs``:
    already worked out)."""
    if runs is None:
        positions, rows = list(positions), list(rows)
        runs = _runs(positions, rows)
    if len(runs) <= 4:
        for p, r, n in runs:
            dst.narrow(dim, p, n).copy_(src.narrow(dim, r, n))
        return
    pi = torch.as_tensor(positions, dtype=torch.long, device=dst.device)
    ri = torch.as_tensor(rows, dtype=torch.long, device=src.device)
    dst.index_copy_(dim, pi, src.index_select(dim, ri))


def fetch_rows(local: torch.Tensor, dim: int, plan, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """The rows ``plan`` (a :class:`domainflow.layout.shapes.RowFetch`) asks for along ``dim``: own rows copied,
    other ranks' rows received from their owners, zero rows where asked. Not differentiable; see
    :func:`halo_exchange`."""
    pos, rows = plan.own
    seq = begin_exchange(mesh, mesh_dim, "halo exchange")
    if plan.identity_len == local.shape[dim]:
        return local  # nothing to fetch and nothing to pad: the block itself
    sends = {k: _select(local, dim, v) for k, v in plan.send.items()}
    shapes = {k: _with_len(local.shape, dim, len(v)) for k, v in plan.recv.items()}
    pending = _exchange_start(sends, shapes, local, mesh, mesh_dim, "halo exchange", seq)
    # every position is written once (own rows, received rows, zeros), so no zero-filled buffer first
    out = local.new_empty(_with_len(local.shape, dim, plan.length))
    if pos:
        _copy_rows(out, dim, pos, local, rows, plan.own_runs)
    zero = plan.unfilled
    if zero:
        _fill_zero(out, dim, zero)
    got = _exchange_wait(pending)
    for k, t in got.items():
        _copy_rows(out, dim, plan.recv[k], t, range(len(plan.recv[k])))
    return out


def _fill_zero(out: torch.Tensor, dim: int, positions) -> None:
    runs = _runs(positions, positions)
    if len(runs) <= 4:
        for p, _, n in runs:
            out.narrow(dim, p, n).zero_()
    else:
        out.index_fill_(dim, torch.as_tensor(positions, dtype=torch.long, device=out.device), 0)


def _with_len(shape, dim: int, n: int) -> list:
    out = list(shape)
    out[dim] = n
    return out


def _select(t: torch.Tensor, dim: int, rows) -> torch.Tensor:
    rows = list(rows)
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t.narrow(dim, rows[0], len(rows))
    return t.index_select(dim, torch.as_tensor(rows, dtype=torch.long, device=t.device))


def return_rows(grad: torch.Tensor, dim: int, local_shape, plan, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """The adjoint of :func:`fetch_rows`: each fetched row's gradient goes back to its owner and is added
    to the owner's row."""
    pos, rows = plan.own
    seq = begin_exchange(mesh, mesh_dim, "halo exchange (backward)")
    if plan.identity_len == local_shape[dim]:
        return grad
    back = {k: _select(grad, dim, v) for k, v in plan.recv.items()}
    shapes = {k: _with_len(local_shape, dim, len(v)) for k, v in plan.send.items()}
    pending = _exchange_start(back, shapes, grad, mesh, mesh_dim, "halo exchange (backward)", seq,
                              salt=SALT_HALO_BACK)
    if plan.covers_len == local_shape[dim]:
        # the usual halo: the own rows are the whole block, in order, once: one copy, no zero fill first
        out = grad.narrow(dim, pos[0], len(pos)).clone(memory_format=torch.contiguous_format)
    else:
        out = grad.new_zeros(local_shape)
        if pos:
            _add_rows(out, dim, rows, grad, pos)
    got = _exchange_wait(pending)
    for k, t in got.items():
        _add_rows(out, dim, plan.send[k], t, range(len(plan.send[k])))
    return out


def _add_rows(dst, dim, rows, src, positions):
    """dst[rows] += src[positions] along ``dim`` (repeated rows accumulate)."""
    rows, positions = list(rows), list(positions)
    if len(set(rows)) == len(rows) and len(_runs(rows, positions)) <= 4:
        for r, p, n in _runs(rows, positions):
            dst.narrow(dim, r, n).add_(src.narrow(dim, p, n))
        return
    ri = torch.as_tensor(rows, dtype=torch.long, device=dst.device)
    pi = torch.as_tensor(positions, dtype=torch.long, device=src.device)
    dst.index_add_(dim, ri, src.index_select(dim, pi))


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, dim, plan, mesh, mesh_dim):
        ctx.args = (dim, tuple(local.shape), plan, mesh, mesh_dim)
        return fetch_rows(local, dim, plan, mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        dim, shape, plan, mesh, mesh_dim = ctx.args
        return return_rows(grad.contiguous(), dim, shape, plan, mesh, mesh_dim), None, None, None, None


def halo_exchange(local: torch.Tensor, dim: int, sizes, wanted, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Differentiable row fetch along a sharded dim: rank r gets global rows ``wanted[r]`` (-1: zero row;
    any order, repeats allowed: halos, periodic wrap-around, reflection). Rows move point-to-point between
    the ranks that hold and want them (neighbours for a halo, further ranks when a neighbour holds fewer
    rows than the halo needs); the backward adds each row's gradient back on its owner."""
    from domainflow.layout.shapes import row_fetch_plan

    me = mesh_coordinate(mesh)[mesh_dim]
    plan = _fetch_plan(tuple(sizes), tuple(tuple(w) for w in wanted), me, row_fetch_plan)
    return fetch(local, dim, plan, mesh, mesh_dim)


def fetch(local: torch.Tensor, dim: int, plan, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """:func:`halo_exchange` with this rank's plan already made (``shapes.row_fetch_plan``, cached by the
    caller): what per-step window ops use, so no per-call work grows with the rows. Outside autograd (no
    gradient wanted) the rows are fetched without an autograd node. While torch.compile traces, one
    functional all-to-all (``traced.fetch_rows``), differentiable by construction."""
    if _compiling():
        return _traced.fetch_rows(local, dim, plan, mesh, mesh_dim)
    if local.requires_grad and torch.is_grad_enabled():
        return _HaloExchange.apply(local, dim, plan, mesh, mesh_dim)
    return fetch_rows(local, dim, plan, mesh, mesh_dim)


def _fetch_plan(sizes, wanted, me, make):
    return PLANS.cached((_fetch_plan, sizes, wanted, me), lambda: make(sizes, wanted, me))
