"""Index-driven row exchange: gathers and scatters by global row index along a sharded dim."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from domainflow.layout.spec import mesh_coordinate
from domainflow.comm.autograd import all_to_all_autograd
from domainflow.comm.collectives import all_to_all_dims
from domainflow.comm.base import _dim_name, group_size


# --------------------------------------------------------------------------------------------
# index-driven row exchange: gathers and scatters by global row index along a sharded dim
# --------------------------------------------------------------------------------------------
class IndexPlan:
    """Who sends which rows for a gather (or, in reverse, a scatter) by global row index along one
    sharded dim, as seen by one rank.

    ``keys`` are the global rows this rank asks for, grouped by owner in rank order (sorted and
    distinct when deduplicated); ``inverse[i]`` is the key that request ``i`` uses; ``asked[k]`` counts
    the keys owned by rank k. ``serve_rows`` are the local rows this rank sends (grouped by requester)
    and ``serve_counts[k]`` how many of them go to rank k. Built once per index (one small all-to-all
    of counts and one of row ids), then reused for the data in both directions.
    """

    __slots__ = ("keys", "inverse", "order", "asked", "serve_rows", "serve_counts", "mesh", "mesh_dim")

    def __init__(self, keys, inverse, order, asked, serve_rows, serve_counts, mesh, mesh_dim):
        self.keys, self.inverse, self.order, self.asked = keys, inverse, order, tuple(asked)
        self.serve_rows, self.serve_counts = serve_rows, tuple(serve_counts)
        self.mesh, self.mesh_dim = mesh, mesh_dim

    @property
    def fetched(self) -> int:
        """Rows this rank receives from other ranks (its own rows are not counted)."""
        me = mesh_coordinate(self.mesh)[self.mesh_dim] if dist.is_initialized() else 0
        return sum(c for k, c in enumerate(self.asked) if k != me)


def index_plan(index: torch.Tensor, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int, *,
               dedupe: bool = True, what: str = "index") -> IndexPlan:
    """Plan the exchange that brings this rank the rows ``index`` (1-D, global row numbers along a dim
    whose rank k holds ``sizes[k]`` rows) names. ``dedupe`` asks for each distinct row once (gathers,
    sums); without it every entry travels on its own, in a stable order (max/min/mean/prod scatters,
    whose gradients must see each entry). Out-of-range rows raise ``IndexError`` on every rank."""
    n = group_size(mesh, mesh_dim)
    total = sum(sizes)
    index = index.reshape(-1).to(torch.long).contiguous()
    starts = torch.tensor([0, *_prefix(sizes)[:-1]], dtype=torch.long, device=index.device)
    order = None
    if dedupe:
        keys, inverse = torch.unique(index, sorted=True, return_inverse=True)
        owner = torch.searchsorted(starts, keys, right=True) - 1
    else:
        owner = torch.searchsorted(starts, index, right=True) - 1
        order = torch.sort(owner, stable=True).indices
        keys, owner = index[order], owner[order]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
    bad = bool(keys.numel()) and (int(keys.min()) < 0 or int(keys.max()) >= total)
    asked = torch.bincount(owner.clamp(0, n - 1), minlength=n) if keys.numel() else index.new_zeros(n)
    # counts and an "out of range" flag travel together, so a bad index fails on every rank at once
    send = torch.stack([asked, asked.new_full((n,), int(bad))], dim=1)
    got = all_to_all_dims(send, 0, [1] * n, 0, [(1, 2)] * n, mesh, mesh_dim)
    if bool(got[:, 1].any()):
        culprits = [k for k in range(n) if int(got[k, 1])]
        raise IndexError(f"{what}: an index is out of range for a dim of {total} rows (sharded over "
                         f"{n} ranks; bad indices on coordinate(s) {culprits} of mesh dim "
                         f"{_dim_name(mesh, mesh_dim)}); valid rows are 0..{total - 1}")
    asked_l = [int(c) for c in asked]
    serve_counts = [int(c) for c in got[:, 0]]
    me = mesh_coordinate(mesh)[mesh_dim] if dist.is_initialized() else 0
    wanted = all_to_all_dims(keys, 0, asked_l, 0, [(c,) for c in serve_counts], mesh, mesh_dim)
    return IndexPlan(keys, inverse, order, asked_l, wanted - int(starts[me]), serve_counts, mesh, mesh_dim)


def _prefix(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        acc += int(s)
        out.append(acc)
    return out


def gather_indexed(local: torch.Tensor, plan: IndexPlan) -> torch.Tensor:
    """Rows ``plan`` asked for, one per request, from ``local`` (this rank's rows along dim 0) and the
    other ranks'. Differentiable: the backward adds each request's gradient back to the owning row."""
    row = tuple(local.shape[1:])
    served = local.index_select(0, plan.serve_rows)
    rows = all_to_all_autograd(served, 0, plan.serve_counts, 0, [(c, *row) for c in plan.asked],
                               plan.mesh, plan.mesh_dim)
    return rows.index_select(0, plan.inverse)


def route_to_owners(values: torch.Tensor, plan: IndexPlan) -> torch.Tensor:
    """The reverse trip of :func:`gather_indexed`: ``values[i]`` (one row per request) goes to the owner
    of row ``index[i]``; requests of one key are summed first when the plan is deduplicated. Returns the
    rows this rank receives, aligned with ``plan.serve_rows``. Differentiable (backward: a gather)."""
    row = tuple(values.shape[1:])
    if plan.order is not None:  # one key per request: a permutation
        per_key = values.index_select(0, plan.order)
    else:
        per_key = values.new_zeros((plan.keys.numel(), *row)).index_add(0, plan.inverse, values)
    return all_to_all_autograd(per_key, 0, plan.asked, 0, [(c, *row) for c in plan.serve_counts],
                               plan.mesh, plan.mesh_dim)
