"""Redistribution of a local chunk from one ShardSpec to another, mesh dim by mesh dim.

Plain functions on local tensors (no autograd); ShardTensor wraps them in an autograd Function whose
backward is the reverse redistribution. Order of steps: reduce Partials, move shards between tensor
dims or sizes with all-to-alls, gather the shards that must go, then slice locally for new shards
(slicing a replicated tensor needs no communication).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from domainflow import comm
from domainflow.layout import shapes
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.layout.spec import ShardSpec, mesh_shape
from domainflow.memo import PLANS

_R = Replicate()


def grad_spec(spec: ShardSpec) -> ShardSpec:
    """Layout of the gradient of a tensor with ``spec``: a Partial value's gradient is replicated."""
    return spec.reduced()


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
    steps = PLANS.cached((redistribute_steps, src, dst), lambda: redistribute_steps(src, dst))
    mesh = src.mesh
    for step in steps:
        local = step.run(local, mesh)
    return local


# The typed steps of a redistribution plan: each is one collective or one local operation along a mesh dim.
class Reduce(NamedTuple):
    """Partial -> Replicate: all-reduce with the Partial's op."""

    mesh_dim: int
    op: str

    def run(self, local, mesh):
        return comm.all_reduce(local, self.op, mesh, self.mesh_dim)


class AllToAll(NamedTuple):
    """Shard -> Shard on one mesh dim: split ``split_dim`` into ``split_sizes``, receive ``recv_shapes``,
    concatenate along ``cat_dim``."""

    mesh_dim: int
    split_dim: int
    split_sizes: tuple
    cat_dim: int
    recv_shapes: list

    def run(self, local, mesh):
        return comm.all_to_all_dims(local, self.split_dim, self.split_sizes, self.cat_dim, self.recv_shapes,
                                    mesh, self.mesh_dim)


class Gather(NamedTuple):
    """Shard -> Replicate: uneven all-gather along ``dim`` of chunks ``sizes``."""

    mesh_dim: int
    dim: int
    sizes: tuple

    def run(self, local, mesh):
        return comm.all_gather_uneven(local, self.dim, self.sizes, mesh, self.mesh_dim)


class Narrow(NamedTuple):
    """Replicate -> Shard: keep this rank's rows (no communication)."""

    mesh_dim: int
    dim: int
    start: int
    length: int

    def run(self, local, mesh):
        return local.narrow(self.dim, self.start, self.length)


class MakePartial(NamedTuple):
    """Replicate -> Partial: this rank's share of the value (no communication)."""

    mesh_dim: int
    placement: Partial
    coord: int

    def run(self, local, mesh):
        return partial_from_replicate(local, self.placement, self.coord)




def redistribute_steps(src: ShardSpec, dst: ShardSpec) -> tuple:
    """The typed steps (:class:`Reduce`, :class:`AllToAll`, :class:`Gather`, :class:`Narrow`,
    :class:`MakePartial`) from layout ``src`` to ``dst`` on this rank; pure layout arithmetic, cached per
    (src, dst) by :func:`redistribute_local`."""
    if src.mesh is not dst.mesh and src.mesh != dst.mesh:
        raise ValueError("redistribute cannot move a tensor between device meshes")
    mesh = src.mesh
    cur = src
    coord = src.coord
    steps = []

    # 1. Partial -> reduce (the only step that changes values).
    for m, (a, b) in enumerate(zip(src.placements, dst.placements)):
        if isinstance(a, Partial) and a != b:
            steps.append(Reduce(m, a.reduce_op))
            cur = _set(cur, m, _R)

    # 2. Shard -> Shard on the same mesh dim: all-to-all (other tensor dim, or other sizes).
    for m, (a, b) in enumerate(zip(cur.placements, dst.placements)):
        if not (isinstance(a, Shard) and isinstance(b, Shard)):
            continue
        if a.dim == b.dim and cur.sizes[m] == dst.sizes[m]:
            continue
        me, n = coord[m], mesh_shape(mesh)[m]
        shape = list(cur.local_shape)
        if a.dim == b.dim:
            ov = shapes.overlap_splits(cur.sizes[m], dst.sizes[m])
            recv = [shape[:a.dim] + [ov[r][me]] + shape[a.dim + 1:] for r in range(n)]
            steps.append(AllToAll(m, a.dim, ov[me], a.dim, recv))
            cur = _set(cur, m, b, dst.sizes[m])
        elif cur.mesh_dim_of(b.dim) is None:
            recv = []
            for r in range(n):
                s_ = list(shape)
                s_[a.dim] = cur.sizes[m][r]
                s_[b.dim] = dst.sizes[m][me]
                recv.append(s_)
            steps.append(AllToAll(m, b.dim, dst.sizes[m], a.dim, recv))
            cur = _set(cur, m, b, dst.sizes[m])
        # else: the target dim is still cut by another mesh dim: gather + slice below

    # 3. Shard -> anything else: gather along the mesh dim.
    for m, (a, b) in enumerate(zip(cur.placements, dst.placements)):
        if isinstance(a, Shard) and (a != b or cur.sizes[m] != dst.sizes[m]):
            steps.append(Gather(m, a.dim, cur.sizes[m]))
            cur = _set(cur, m, _R)

    # 4. Replicate -> Shard (local slice) or -> Partial.
    for m, (a, b) in enumerate(zip(cur.placements, dst.placements)):
        if a == b:
            continue
        if isinstance(b, Shard):
            k = coord[m]
            steps.append(Narrow(m, b.dim, sum(dst.sizes[m][:k]), dst.sizes[m][k]))
            cur = _set(cur, m, b, dst.sizes[m])
        elif isinstance(b, Partial):
            steps.append(MakePartial(m, b, coord[m]))
            cur = _set(cur, m, b)
    if cur != dst:  # pragma: no cover - a bug of ours, never a user error
        raise AssertionError(f"redistribute_steps reached {cur} instead of {dst}")
    return tuple(steps)
