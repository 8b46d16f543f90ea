"""Redistribution of a local chunk from one ShardSpec to another, mesh dim by mesh dim.

Plain functions on local tensors (no autograd); ShardTensor wraps them in an autograd Function whose
backward is the reverse redistribution. Order of steps: reduce Partials, move shards between tensor
dims or sizes with all-to-alls, gather the shards that must go, then slice locally for new shards
(slicing a replicated tensor needs no communication).
"""

from __future__ import annotations

import torch

from . import comm, shapes
from .placements import Partial, Replicate, Shard
from .spec import ShardSpec, mesh_shape

_R = Replicate()


def grad_spec(spec: ShardSpec) -> ShardSpec:
    """Layout of the gradient of a tensor with ``spec``: a Partial value's gradient is replicated."""
    if not spec.has_partial:
        return spec
    return spec.with_(placements=tuple(_R if isinstance(p, Partial) else p for p in spec.placements))


def partial_from_replicate(local: torch.Tensor, p: Partial, coord: int) -> torch.Tensor:
    """This rank's term when a replicated value becomes Partial(op): coordinate 0 keeps the value, the
    others hold the op's identity (0 for sum, 1 for product; max/min/avg keep the value)."""
    if coord == 0:
        return local
    if p.reduce_op == "sum":
        return torch.zeros_like(local)
    if p.reduce_op == "product":
        return torch.ones_like(local)
    return local


def _set(spec: ShardSpec, m: int, placement, sizes=None) -> ShardSpec:
    pl = list(spec.placements)
    sz = list(spec.sizes)
    pl[m] = placement
    sz[m] = sizes
    return ShardSpec(spec.mesh, pl, spec.shape, sz)


def redistribute_local(local: torch.Tensor, src: ShardSpec, dst: ShardSpec) -> torch.Tensor:
    """Turn this rank's chunk under ``src`` into its chunk under ``dst`` (same mesh, same global shape)."""
    if src == dst:
        return local
    if src.mesh is not dst.mesh and src.mesh != dst.mesh:
        raise ValueError("redistribute cannot move a tensor between device meshes")
    mesh = src.mesh
    cur = src
    coord = src.coord

    # 1. Partial -> reduce (the only step that changes values).
    for m, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if isinstance(a, Partial) and a != b:
            local = comm.all_reduce(local, a.reduce_op, mesh, m)
            cur = _set(cur, m, _R)

    # 2. Shard -> Shard on the same mesh dim: all-to-all (other tensor dim, or other sizes).
    for m, (a, b) in enumerate(zip(cur.placements, dst.placements)):
        if not (isinstance(a, Shard) and isinstance(b, Shard)):
            continue
        if a.dim == b.dim and cur.sizes[m] == dst.sizes[m]:
            continue
        me, n = coord[m], mesh_shape(mesh)[m]
        if a.dim == b.dim:
            ov = shapes.overlap_splits(cur.sizes[m], dst.sizes[m])
            shape = list(local.shape)
            recv = [shape[:a.dim] + [ov[r][me]] + shape[a.dim + 1:] for r in range(n)]
            local = comm.all_to_all_dims(local, a.dim, ov[me], a.dim, recv, mesh, m)
            cur = _set(cur, m, b, dst.sizes[m])
        elif cur.mesh_dim_of(b.dim) is None:
            shape = list(local.shape)
            if shape[b.dim] != cur.shape[b.dim]:
                continue  # target dim still cut by another mesh dim: handled by gather + slice below
            recv = []
            for r in range(n):
                s = list(shape)
                s[a.dim] = cur.sizes[m][r]
                s[b.dim] = dst.sizes[m][me]
                recv.append(s)
            local = comm.all_to_all_dims(local, b.dim, dst.sizes[m], a.dim, recv, mesh, m)
            cur = _set(cur, m, b, dst.sizes[m])

    # 3. Shard -> anything else: gather along the mesh dim.
    for m, (a, b) in enumerate(zip(cur.placements, dst.placements)):
        if isinstance(a, Shard) and (a != b or cur.sizes[m] != dst.sizes[m]):
            local = comm.all_gather_uneven(local, a.dim, cur.sizes[m], mesh, m)
            cur = _set(cur, m, _R)

    # 4. Replicate -> Shard (local slice) or -> Partial.
    for m, (a, b) in enumerate(zip(cur.placements, dst.placements)):
        if a == b:
            continue
        if isinstance(b, Shard):
            k = coord[m]
            local = local.narrow(b.dim, sum(dst.sizes[m][:k]), dst.sizes[m][k])
            cur = _set(cur, m, b, dst.sizes[m])
        elif isinstance(b, Partial):
            local = partial_from_replicate(local, b, coord[m])
            cur = _set(cur, m, b)
    if cur != dst:  # pragma: no cover - a planning bug, never a user error
        raise AssertionError(f"redistribute planned {cur} instead of {dst}")
    return local
