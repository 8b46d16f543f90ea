"""PyTorch's placement vocabulary, re-exported, plus the few predicates domainflow needs."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard", "normalize_placements", "partial_reduce_op"]

# Partial reduce ops domainflow knows how to reduce, mapped to torch.distributed.ReduceOp names.
PARTIAL_OPS = {"sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def partial_reduce_op(p: Partial) -> str:
    op = p.reduce_op
    if op not in PARTIAL_OPS:
        raise ValueError(f"Partial({op!r}) is not supported; use one of {sorted(PARTIAL_OPS)}")
    return op


def normalize_placements(placements, ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """Validate placements against the tensor rank and mesh rank; make Shard dims non-negative."""
    if isinstance(placements, Placement):
        placements = (placements,)
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements {placements} for a {mesh_ndim}-D device mesh; "
            f"give exactly one placement per mesh dim"
        )
    out = []
    seen: dict[int, int] = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError(f"Shard({p.dim}) on mesh dim {m} is out of range for a {ndim}-D tensor")
            if d in seen:
                raise ValueError(
                    f"tensor dim {d} is sharded by mesh dims {seen[d]} and {m}; domainflow shards each tensor "
                    f"dim over at most one mesh dim (flatten those mesh dims into one instead)"
                )
            seen[d] = m
            out.append(Shard(d) if d != p.dim else p)
        elif isinstance(p, Partial):
            partial_reduce_op(p)
            out.append(p)
        elif isinstance(p, Replicate):
            out.append(p)
        else:
            raise ValueError(f"unsupported placement {p!r} on mesh dim {m}; use Shard(d), Replicate() or Partial(op)")
    return tuple(out)
