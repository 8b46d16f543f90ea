"""Collectives while ``torch.compile`` traces: the same exchanges as functional collectives
(``torch.distributed._functional_collectives``), which Dynamo and AOTAutograd record as graph nodes and
Inductor compiles. Eager code keeps the numbered, tagged point-to-point exchanges and the pairing round of
``p2p`` / ``collectives``: those call ``dist.batch_isend_irecv`` and read headers on the host, which a trace
over fake tensors cannot do (it ran them on fake tensors, or traced ``c10d.send`` with effects that Inductor
refuses). Nothing here checks that ranks agree (no pairing round inside a graph): ranks may trace different
graphs (a rule that decides on a rank's own sizes, a guard failing on one rank only), so ``domainflow.compile``
runs one pairing round before each compiled graph runs, carrying a digest of its collectives
(``collectives.check_compiled_graph``), and checks layouts declared per rank and replicated parameters eagerly
before each call; each function here refuses a trace started by a raw ``torch.compile``
(``base.refuse_unchecked_compile``).

Routed here (issue 40): the halo row fetch (``halo.fetch``), ``collectives.all_reduce`` and ``p2p.ring_shift``.
Every other exchange of the eager layer raises CompileUnsupportedError while compiling (``base.refuse_compiling``).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from domainflow.comm.base import _group, group_size, refuse_unchecked_compile
from domainflow.layout.spec import mesh_coordinate

compiling = torch.compiler.is_compiling


def _wait(t):
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _group_name(mesh, mesh_dim: int) -> str:
    return _group(mesh, mesh_dim).group_name


def all_reduce(t: torch.Tensor, reduce_op: str, mesh, mesh_dim: int) -> torch.Tensor:
    """Out-of-place all-reduce over one mesh dim, traceable (not differentiable: for backward formulas and
    values that need no gradient)."""
    refuse_unchecked_compile("all_reduce")
    if group_size(mesh, mesh_dim) == 1:
        return t.clone()
    op = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "product": "product"}[reduce_op]
    flat = _apart([t.reshape(-1)], t.reshape(-1))  # kept apart from every other collective (_apart)
    if op == "avg":  # Gloo has no avg: sum / n, as the eager layer does
        out = _wait(funcol.all_reduce(flat, "sum", _group_name(mesh, mesh_dim))) / group_size(mesh, mesh_dim)
    else:
        out = _wait(funcol.all_reduce(flat, op, _group_name(mesh, mesh_dim)))
    return out.view(t.shape)


def _segments(plan, recv_at: dict):
    """(source, first row, rows) runs that build the fetched block in position order: source 0 the local
    block, 1 the received rows, 2 a zero row; consecutive rows of one source merged. Plain ints from the
    plan only (never a traced size: a SymInt kept across traces breaks the next one); cached on the plan."""
    hit = getattr(plan, "_traced_segments", None)
    if hit is not None:
        return hit
    src = [(2, 0)] * plan.length
    for p, r in zip(*plan.own):
        src[p] = (0, r)
    for k, positions in plan.recv.items():
        for i, p in enumerate(positions):
            src[p] = (1, recv_at[k] + i)
    runs = []
    for s, r in src:
        if runs and runs[-1][0] == s and (s == 2 or runs[-1][1] + runs[-1][2] == r):
            runs[-1][2] += 1
        else:
            runs.append([s, r, 1])
    runs = tuple(tuple(x) for x in runs)
    object.__setattr__(plan, "_traced_segments", runs)
    return runs


def _apart(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``rows`` concatenated (along dim 0) with a fresh empty tensor, an ``aten.empty`` node, which AOTAutograd's
    common-subexpression elimination (CSE) never merges: no two collectives are then one expression, on any rank.
    Two collectives identical on some ranks only were merged there, leaving those ranks fewer collectives than
    their peers ("the ranks compiled different graphs"): two fetches of one input with the same rows (two
    same-size convolutions, max and average pooling of one input) on the ranks that send rows but not on one that
    sends none, two fetches an empty shard makes with nothing to trade, the zero gradients of two same-shape
    layers' parameters on an empty shard."""
    return torch.cat([*rows, torch.empty((0,) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)])


class _RowExchange(torch.autograd.Function):
    """The rows' ``all_to_all_single``; backward: the gradients of the received rows back to their owners (the
    transposed exchange), kept apart from every other collective (:func:`_apart`): on a rank that received
    nothing in two fetches (an empty shard) both gradients are one expression (``0 * sum(grad)``)."""

    @staticmethod
    def forward(ctx, send, recv_sizes, send_sizes, group_name):
        ctx.exchange = (recv_sizes, send_sizes, group_name)
        return _wait(funcol.all_to_all_single(send, recv_sizes, send_sizes, group_name))

    @staticmethod
    def backward(ctx, grad):
        recv_sizes, send_sizes, group_name = ctx.exchange
        grad = _apart([grad], grad)
        return _wait(funcol.all_to_all_single(grad, send_sizes, recv_sizes, group_name)), None, None, None


def fetch_rows(local: torch.Tensor, dim: int, plan, mesh, mesh_dim: int) -> torch.Tensor:
    """``halo.fetch`` while compiling: the rows every rank sends go in one ``all_to_all_single`` with
    per-rank split sizes (rows, along ``dim`` moved first), and the block is assembled from slices of the
    local chunk, the received rows and zeros. Differentiable by construction: the all-to-all's autograd
    sends each row's gradient back to its owner, and ``cat``/``narrow`` add it onto the owner's row."""
    refuse_unchecked_compile("a halo row fetch")
    n = group_size(mesh, mesh_dim)
    x = local.movedim(dim, 0)
    send_sizes, recv_sizes = [0] * n, [0] * n
    pieces = []
    for k in sorted(plan.send):
        rows = plan.send[k]
        send_sizes[k] = len(rows)
        if rows == tuple(range(rows[0], rows[0] + len(rows))):
            pieces.append(x.narrow(0, rows[0], len(rows)))
        else:
            pieces.append(x[list(rows)])
    recv_at, at = {}, 0
    for k in range(n):
        if k in plan.recv:
            recv_sizes[k] = len(plan.recv[k])
            recv_at[k] = at
            at += recv_sizes[k]
    # every rank of the dim joins, also one with nothing to trade (others may trade among themselves), unless no
    # rank trades at all (known alike on every rank): then no exchange. The
    # all-to-all's backward is a collective too, returning the gradients of the rows each rank sent: every rank
    # must reach it from its output, so with a gradient wanted, an empty send is an empty slice of the block and
    # an output that uses no received row still takes an empty slice of them (before, a rank that only sent
    # rows skipped the backward exchange: its sent rows lost their gradient, and the other ranks' backward
    # exchange met the next collective instead)
    # every send is kept apart from every other collective (_apart), on every rank alike
    wants_grad = x.requires_grad and torch.is_grad_enabled()
    grad = plan.trades and wants_grad
    send = _apart(pieces if pieces else [x.narrow(0, 0, 0)] if grad else [], x)
    received = None
    if plan.trades:
        received = _RowExchange.apply(send, recv_sizes, send_sizes, _group_name(mesh, mesh_dim))
    if plan.identity_len == local.shape[dim]:
        segments = ((0, 0, plan.identity_len),)
        if not grad:
            return local
    else:
        segments = _segments(plan, recv_at)
    parts = []
    for s, r, k in segments:
        if s == 0:
            parts.append(x.narrow(0, r, k))
        elif s == 1:
            parts.append(received.narrow(0, r, k))
        else:
            parts.append(x.new_zeros((k,) + tuple(x.shape[1:])))
    if grad and not any(s == 1 for s, _, _ in segments):
        parts.append(received.narrow(0, 0, 0))
    if not parts or (wants_grad and not any(s == 0 for s, _, _ in segments)):
        # no rows of its own in the block (its windows need none, or only padding): an empty slice of them keeps
        # the chunk in the graph, so it gets its (zero) gradient as in eager, not None on this rank only (which
        # made x.grad.full_tensor() a collective one rank could not join)
        parts.append(x.narrow(0, 0, 0))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    return out.movedim(0, dim).contiguous()


def ring_shift(tensors, recv_shapes, mesh, mesh_dim: int) -> list:
    """``p2p.ring_shift`` while compiling: each tensor to the next rank of the ring, one of ``recv_shapes``
    from the previous, as one ``all_to_all_single`` per tensor (flattened; only the two ring neighbours get a
    non-zero split). Not differentiable (ring attention's own autograd function calls it in both passes)."""
    refuse_unchecked_compile("a ring shift")
    n = group_size(mesh, mesh_dim)
    me = mesh_coordinate(mesh)[mesh_dim]
    nxt, prv = (me + 1) % n, (me - 1) % n
    out = []
    for t, shape in zip(tensors, recv_shapes):
        numel = 1
        for s in shape:
            numel *= s
        send_sizes, recv_sizes = [0] * n, [0] * n
        send_sizes[nxt] = t.numel()
        recv_sizes[prv] = numel
        got = _wait(funcol.all_to_all_single(t.contiguous().reshape(-1), recv_sizes, send_sizes,
                                             _group_name(mesh, mesh_dim)))
        out.append(got.reshape(tuple(shape)))
    return out
