"""Blocks of a tensor along one dim, each rank cutting only its own rows: passes over a sample in bounded
memory (chunked inference). No communication: every rank knows every rank's extent from the layout, so all
ranks agree on the number of blocks and on each block's layout, and a block is an ordinary ShardTensor the
engine plans like any other (a rank whose rows ran out holds an empty shard of it)."""

from __future__ import annotations

import torch

from domainflow.layout.placements import Shard
from domainflow.layout.spec import mesh_coordinate


def split_blocks(x, dim: int, rows: int) -> list:
    """``x`` cut along ``dim`` into blocks of ``rows`` rows per rank (a rank's last block fewer, or one more
    when it would otherwise be a block of one point in all); at least one block. A plain tensor or one not
    sharded on ``dim`` is cut like ``torch.split``."""
    from .shard_tensor import ShardTensor

    if rows < 1:
        raise ValueError(f"blocks need at least one row each, got rows={rows}")
    dim, spec, m, sizes = _along(x, dim)
    if m is None:
        return list(torch.split(x, rows, dim)) if x.shape[dim] else [x]
    count = max(1, max(-(-s // rows) for s in sizes))
    cuts = [k * rows for k in range(count)] + [max(sizes)]
    if count > 1 and sum(max(0, s - cuts[-2]) for s in sizes) == 1:
        # a last block of one point in all joins the one before: the engine treats a sharded dim of global
        # size 1 as a broadcast dim (views gather it), which costs exchanges a block of two or more does not
        del cuts[-2]
    local, own = x.to_local(), int(x.to_local().shape[dim])
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        piece = local.narrow(dim, min(lo, own), max(0, min(hi, own) - lo))
        shapes = _other_sizes(spec, m)
        shapes[m] = [max(0, min(hi, s) - lo) for s in sizes]
        out.append(ShardTensor.from_local(piece, x.device_mesh, x.placements, sharding_shapes=shapes))
    return out


def rows_per_block(x, dim: int, points: int) -> int:
    """Rows per rank for blocks of about ``points`` points over the whole domain: ceil(global / points)
    blocks, each of the largest rank's rows over that count, so every rank cuts its rows into at most that
    many and a rank's block is its share of ``points`` (more ranks, smaller blocks, the same count; uneven
    shares make a block over the domain somewhat larger than ``points``). A plain tensor: ``points``."""
    if points < 1:
        raise ValueError(f"blocks need at least one point each, got points={points}")
    _, _, m, sizes = _along(x, dim)
    if m is None:
        return points
    count = max(1, -(-sum(sizes) // points))
    return max(1, -(-max(sizes) // count))


def join_blocks(blocks: list, dim: int):
    """The blocks of :func:`split_blocks` (or results laid out like them) joined back along ``dim``: each
    rank concatenates its own pieces, so the result has the layout the blocks were cut from."""
    from .shard_tensor import ShardTensor

    first = blocks[0]
    dim = dim % first.ndim
    if not isinstance(first, ShardTensor):
        return torch.cat(blocks, dim)
    spec = first.spec
    m = spec.mesh_dim_of(dim)
    if m is None or not isinstance(first.placements[m], Shard):
        return torch.cat(blocks, dim)
    shapes = _other_sizes(spec, m)
    shapes[m] = [sum(int(b.spec.sizes[m][r]) for b in blocks) for r in range(len(spec.sizes[m]))]
    local = torch.cat([b.to_local() for b in blocks], dim)
    return ShardTensor.from_local(local, first.device_mesh, first.placements, sharding_shapes=shapes)


@torch.no_grad()
def blockwise(fn, x, rows: int, halo: int = 0, dim: int = 1, periodic: bool = False):
    """``fn`` over ``x`` in blocks of ``rows`` rows per rank along its sharded dim ``dim``, each block given
    up to ``halo`` rows of context on both sides (the rank's own rows, or at its edges its neighbours' from
    one halo exchange for the whole pass; none beyond the global ends, where ``fn``'s own padding applies,
    or the other end's rows if ``periodic``), and the context cut from each block's output. No grad.

    Equal to ``fn`` on the whole sample when ``fn`` is row-local with reach ``halo`` along ``dim``: output row
    i depends only on input rows i-halo..i+halo and on the ends through ``fn``'s own padding (a stack of
    stride-1 convolutions padded to keep their length, zero padding, or circular with ``periodic``; pointwise
    ops). ``fn`` gets and returns plain tensors, the local block with its context: it must not communicate
    (no norms over the sample), and its output keeps the block's length along ``dim`` (other dims may change,
    e.g. channels). Memory: ``x``, a copy of the rank's rows with their context (the exchange's result), the
    output and one block's activations. A plain ``x`` is cut the same way on one process. Refused: another
    sharded dim (its edges would get no context) and pending sums (``fn`` is rarely linear)."""
    from domainflow import comm

    from .shard_tensor import ShardTensor

    if rows < 1 or halo < 0:
        raise ValueError(f"blockwise needs rows >= 1 and halo >= 0, got rows={rows}, halo={halo}")
    dim, spec, m, sizes = _along(x, dim)
    if spec is not None and m is None:
        raise ValueError(f"blockwise: dim {dim} of the input is not sharded ({x.placements}); cut the sharded dim")
    if spec is not None:
        others = [d for k, d in enumerate(spec.shard_dims) if d is not None and k != m]
        if others or any(p.is_partial() for p in x.placements):
            raise ValueError(f"blockwise: the input ({x.placements}) is "
                             f"{'also sharded on dim ' + str(others[0]) if others else 'a pending sum'}; only dim "
                             f"{dim} may be sharded (redistribute the others to Replicate first)")
    local = x.to_local() if spec is not None else x
    n = int(local.shape[dim])
    total, me = sum(sizes), (mesh_coordinate(x.device_mesh)[m] if m is not None else 0)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]

    def context(r):  # rows of context before and after rank r's rows
        if periodic and total:
            return halo, halo
        return min(halo, starts[r]), min(halo, total - starts[r] - sizes[r])

    if n == 0:  # no rows here: fn on zeros only to learn its output's other dims
        if m is not None and halo and total:
            _halo_rows(comm, local, dim, sizes, starts, total, context, x.device_mesh, m)  # the others' exchange
        probe = fn(local.new_zeros(_with_len(local.shape, dim, 2 * halo + 1)))
        _check_length(probe, dim, 2 * halo + 1)
        local_out = probe.narrow(dim, 0, 0)
    else:
        before, after = context(me)
        if m is not None and halo and total:
            padded = _halo_rows(comm, local, dim, sizes, starts, total, context, x.device_mesh, m)
        elif before or after:
            ids = torch.tensor([i % total for i in range(-before, n + after)], device=local.device)
            padded = local.index_select(dim, ids)
        else:
            padded = local
        local_out, length_padded = None, int(padded.shape[dim])
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            a, b = max(0, lo + before - halo), min(length_padded, hi + before + halo)
            out = fn(padded.narrow(dim, a, b - a))
            _check_length(out, dim, b - a)
            if local_out is None:  # the output's other dims are known once the first block is done
                local_out = out.new_empty(_with_len(out.shape, dim, n))
            local_out.narrow(dim, lo, hi - lo).copy_(out.narrow(dim, lo + before - a, hi - lo))
            del out
    if m is None:
        return local_out
    return ShardTensor.from_local(local_out, x.device_mesh, x.placements,
                                  sharding_shapes={**_other_sizes(spec, m), m: sizes})


def _along(x, dim: int):
    """(dim made non-negative, x's spec or None, the mesh dim sharding ``dim`` or None, per-rank sizes along
    it: one entry, the whole length, when ``dim`` is not sharded)."""
    from .shard_tensor import ShardTensor

    dim = dim % x.ndim
    spec = x.spec if isinstance(x, ShardTensor) else None
    m = spec.mesh_dim_of(dim) if spec is not None else None
    sizes = [int(s) for s in spec.sizes[m]] if m is not None else [int(x.shape[dim])]
    return dim, spec, m, sizes


def _check_length(out, dim: int, length: int) -> None:
    if int(out.shape[dim]) != length:
        raise ValueError(f"blockwise: fn changed the length of dim {dim} from {length} to {int(out.shape[dim])}; "
                         f"it must keep it (pad its convolutions to the same size)")


def _halo_rows(comm, local, dim, sizes, starts, total, context, mesh, m):
    """Each rank's rows with its context rows before and after (one exchange with the ranks holding them)."""
    wanted = []
    for r, (a, s) in enumerate(zip(starts, sizes)):
        before, after = context(r)
        wanted.append([i % total for i in range(a - before, a + s + after)] if s else [])
    return comm.halo_exchange(local, dim, sizes, wanted, mesh, m)


def _with_len(shape, dim: int, n: int) -> list:
    return [n if d == dim else int(s) for d, s in enumerate(shape)]


def _other_sizes(spec, m: int) -> dict:
    """Per-rank extents of the sharded mesh dims other than ``m`` (unchanged by cutting along m's dim)."""
    return {k: [int(s) for s in spec.sizes[k]] for k, d in enumerate(spec.shard_dims) if d is not None and k != m}
