"""Point-to-point exchanges along a mesh dim: numbered and tagged so that mismatched ops time out by
name (never abort or mix bytes), ring shifts, and a source rank's headers and scattered pieces."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from domainflow.layout.spec import mesh_coordinate
from domainflow.comm import base as _base
from domainflow.comm.base import (
    _device, _dim_ranks, _EXCHANGES, _group, from_wire, group_size, _named, _nbytes, pending_checks, stats, wire_buffer,
    wire_bytes)


def begin_exchange(mesh: DeviceMesh, mesh_dim: int, what: str = "exchange") -> int:
    """Start a point-to-point exchange op along a mesh dim; every rank of the dim calls it (also one that then
    has nothing to trade). Runs the pending cross-rank checks and returns the op's number on its group:
    every rank of a group runs the same ops in the same order, so the numbers agree, and a rank that runs one
    the others do not (``loss.item()`` on rank 0 only) gets numbers that no longer match (see :func:`_tag`).
    While torch.compile traces, raises :class:`~domainflow.errors.CompileUnsupportedError` naming ``what``:
    the exchanges that compile (``comm.traced``) never come here."""
    _base.refuse_compiling(what)
    if pending_checks:
        _base._run_checks(what)
    group = _group(mesh, mesh_dim)
    hit = _EXCHANGES.get(id(group))
    n = 0 if hit is None or hit[0] is not group else hit[1] + 1
    _EXCHANGES[id(group)] = (group, n)
    return n


# Kinds of point-to-point message, part of the tag (Gloo matches a message by peer and tag), so that a halo
# exchange on one rank never meets a ring shift or a collective's payload on another (collectives use salts
# of 16 and more, from their op and dtype; tag 0, what untagged sends use, never occurs)
SALT_HALO, SALT_HALO_BACK, SALT_RING, SALT_SCATTER_HEADER, SALT_SCATTER = 1, 2, 4, 5, 6


def _tag(seq: int, nbytes: int, salt: int = SALT_HALO) -> int:
    """Point-to-point tag of a data message: its exchange's number, its size and its kind (``salt``).
    Messages of two different exchanges, of disagreeing sizes or of different kinds (a halo against an
    all-reduce's payload) then never meet: they wait and time out with a CollectiveError naming the op, instead of
    Gloo aborting the process (a message larger than the receive buffer) or filling the buffer with
    another op's bytes."""
    return (seq * 1_000_003 + nbytes * 7919 + salt * 104_729) % 0x7FFFFFFE + 1


def _exchange(out_pieces: dict, in_shapes: dict, like: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
              what: str, seq: int, kind: str | None = "halo", detail: str = "", salt: int = SALT_HALO) -> dict:
    """Send ``out_pieces[k]`` to the k-th rank along ``mesh_dim`` and receive ``in_shapes[k]``-shaped
    tensors from it, all at once (only with the ranks that have rows to trade: not a collective). ``seq`` is
    the op's :func:`begin_exchange` number, ``salt`` its kind (tags). The bytes sent are counted in ``stats``
    under ``kind`` (None: the caller counts them)."""
    return _exchange_wait(_exchange_start(out_pieces, in_shapes, like, mesh, mesh_dim, what, seq, kind, detail,
                                          salt))


def _exchange_start(out_pieces: dict, in_shapes: dict, like: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                    what: str, seq: int, kind: str | None = "halo", detail: str = "", salt: int = SALT_HALO):
    """Post the sends and receives of :func:`_exchange` and return at once; the caller does local work
    (copying its own rows) while the rows travel, then calls :func:`_exchange_wait`."""
    entered = time.time()
    if not out_pieces and not in_shapes:  # nothing to trade with anyone (a halo at the domain's edge, 1 rank)
        return (), {}, (what, mesh, mesh_dim, "", entered), ()
    ranks = _dim_ranks(mesh, mesh_dim)
    ops, received = [], {}
    for k, piece in out_pieces.items():
        piece = wire_bytes(piece)
        if kind is not None:
            stats.add(kind, _nbytes(piece))
        ops.append(dist.P2POp(dist.isend, piece, ranks[k], tag=_tag(seq, _nbytes(piece), salt)))
    for k, shape in in_shapes.items():
        buf = wire_buffer(shape, like.dtype, like.device)
        received[k] = from_wire(buf, shape, like.dtype)
        ops.append(dist.P2POp(dist.irecv, buf, ranks[k], tag=_tag(seq, _nbytes(buf), salt)))
    detail = f" with ranks {sorted(ranks[k] for k in set(out_pieces) | set(in_shapes))}{detail}"
    works = []
    if ops:
        with _named(what, mesh, mesh_dim, detail, entered):
            works = dist.batch_isend_irecv(ops)
    # the ops hold the (possibly temporary, made contiguous) pieces until the sends are waited on
    return works, received, (what, mesh, mesh_dim, detail, entered), ops


def _exchange_wait(pending) -> dict:
    works, received, (what, mesh, mesh_dim, detail, entered), _ops = pending
    if works:
        with _named(what, mesh, mesh_dim, detail, entered):
            for w in works:
                w.wait()
    return received


def ring_shift(tensors: Sequence[torch.Tensor], recv_shapes, mesh: DeviceMesh, mesh_dim: int,
               what: str = "ring exchange") -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring along ``mesh_dim`` and receive ``recv_shapes``-shaped
    tensors (same dtypes) from the previous one (ring attention's K/V blocks). Every rank of the dim calls it."""
    if torch.compiler.is_compiling():  # a functional all-to-all, recorded in the graph
        from domainflow.comm import traced

        return traced.ring_shift(tensors, recv_shapes, mesh, mesh_dim)
    seq = begin_exchange(mesh, mesh_dim, what)
    n = group_size(mesh, mesh_dim)
    me = mesh_coordinate(mesh)[mesh_dim]
    nxt, prv = (me + 1) % n, (me - 1) % n
    ranks = _dim_ranks(mesh, mesh_dim)
    ops, got = [], []
    for t in tensors:
        t = wire_bytes(t)
        stats.add("ring", _nbytes(t))
        ops.append(dist.P2POp(dist.isend, t, ranks[nxt], tag=_tag(seq, _nbytes(t), SALT_RING)))
    for shape, ref in zip(recv_shapes, tensors):
        buf = wire_buffer(shape, ref.dtype, ref.device)
        got.append(from_wire(buf, shape, ref.dtype))
        ops.append(dist.P2POp(dist.irecv, buf, ranks[prv], tag=_tag(seq, _nbytes(buf), SALT_RING)))
    detail = f" with ranks {sorted({ranks[nxt], ranks[prv]})}"
    entered = time.time()
    with _named(what, mesh, mesh_dim, detail, entered):
        works = dist.batch_isend_irecv(ops)
    _exchange_wait((works, None, (what, mesh, mesh_dim, detail, entered), ops))
    return got


def _scatter_seq(ranks: list[int]) -> int:
    """The number of a source-to-all op (header, scatter) among those on these ranks: tags them like an
    exchange, so a header never meets a piece nor a message of another op."""
    key = ("scatter", tuple(ranks))
    n = _SCATTERS.get(key, -1) + 1
    _SCATTERS[key] = n
    return n


_SCATTERS: dict = {}


def send_header(header: torch.Tensor | None, length: int, src: int, mesh: DeviceMesh) -> torch.Tensor:
    """Global rank ``src`` sends a small int64 ``header`` (its length known to all: ``length``) to every other
    rank of ``mesh``, which receive it: metadata only the source knows (shapes, dtype, sizes)."""
    _base.refuse_compiling(f"header send from rank {src}")
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank() if dist.is_initialized() else 0
    tag = _tag(_scatter_seq(ranks), 8 * length, SALT_SCATTER_HEADER)
    if me == src:
        ops = [dist.P2POp(dist.isend, header, r, tag=tag) for r in ranks if r != me]
        with _named("header send", None, None, f" from rank {src} to ranks {ranks}"):
            for w in dist.batch_isend_irecv(ops) if ops else ():
                w.wait()
        return header
    out = torch.empty(length, dtype=torch.int64, device=_device(mesh))
    with _named("header receive", None, None, f" from rank {src}"):
        dist.recv(out, src=src, tag=tag)
    return out


def scatter_pieces(pieces: list[torch.Tensor] | None, recv_shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device, src: int, mesh: DeviceMesh) -> torch.Tensor:
    """Global rank ``src`` sends ``pieces[k]`` to the k-th rank of ``mesh`` (row-major); each rank
    receives only its own piece (point-to-point, not a broadcast of the whole tensor)."""
    _base.refuse_compiling(f"scatter from rank {src}")
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank() if dist.is_initialized() else 0
    if pending_checks:
        _base._run_checks("scatter")
    seq = _scatter_seq(ranks)
    if me == src:
        ops, mine = [], None
        for k, r in enumerate(ranks):
            piece = pieces[k]
            if r == me:
                mine = piece
            elif piece.numel():
                piece = wire_bytes(piece)
                stats.add("scatter", _nbytes(piece))
                ops.append(dist.P2POp(dist.isend, piece, r, tag=_tag(seq, _nbytes(piece), SALT_SCATTER)))
        with _named("scatter (send)", None, None, f" from rank {src} to ranks {ranks}"):
            for w in dist.batch_isend_irecv(ops) if ops else ():
                w.wait()
        if mine is None:
            raise ValueError(f"scatter source rank {src} is not in the mesh {ranks}")
        return mine.clone(memory_format=torch.contiguous_format)  # never alias the caller's full tensor
    buf = wire_buffer(recv_shape, dtype, device)
    if buf.numel():
        with _named("scatter (receive)", None, None, f" of shape {tuple(recv_shape)} from rank {src}"):
            dist.recv(buf, src=src, tag=_tag(seq, _nbytes(buf), SALT_SCATTER))
    return from_wire(buf, recv_shape, dtype)
