"""Blocks of a tensor along one dim, each rank cutting only its own rows: passes over a sample in bounded
memory (chunked inference). No communication: every rank knows every rank's extent from the layout, so all
ranks agree on the number of blocks and on each block's layout, and a block is an ordinary ShardTensor the
engine plans like any other (a rank whose rows ran out holds an empty shard of it)."""

from __future__ import annotations

import torch

from domainflow.layout.placements import Shard


def split_blocks(x, dim: int, rows: int) -> list:
    """``x`` cut along ``dim`` into blocks of ``rows`` rows per rank (a rank's last block fewer, or one more
    when it would otherwise be a block of one point in all); at least one block. A plain tensor or one not
    sharded on ``dim`` is cut like ``torch.split``."""
    from .shard_tensor import ShardTensor

    if rows < 1:
        raise ValueError(f"blocks need at least one row each, got rows={rows}")
    dim = dim % x.ndim
    spec = x.spec if isinstance(x, ShardTensor) else None
    m = spec.mesh_dim_of(dim) if spec is not None else None
    if m is None:
        return list(torch.split(x, rows, dim)) if x.shape[dim] else [x]
    sizes = [int(s) for s in spec.sizes[m]]
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
    """Rows per rank for blocks of about ``points`` points over the whole domain: the sample is cut into
    ceil(global / points) blocks and each rank cuts its rows into that many, so a rank's block is its share
    of ``points`` (more ranks, smaller blocks, the same number of blocks). A plain tensor: ``points``."""
    from .shard_tensor import ShardTensor

    if points < 1:
        raise ValueError(f"blocks need at least one point each, got points={points}")
    dim = dim % x.ndim
    spec = x.spec if isinstance(x, ShardTensor) else None
    m = spec.mesh_dim_of(dim) if spec is not None else None
    if m is None:
        return points
    sizes = [int(s) for s in spec.sizes[m]]
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


def _other_sizes(spec, m: int) -> dict:
    """Per-rank extents of the sharded mesh dims other than ``m`` (unchanged by cutting along m's dim)."""
    return {k: [int(s) for s in spec.sizes[k]] for k, d in enumerate(spec.shard_dims) if d is not None and k != m}
