"""k-nearest-neighbour and radius search where points and queries are both sharded by space.

Each rank searches its own points first. That gives every query an upper bound on how far its
neighbours can be (the k-th local distance; for a rank holding fewer than k points, the farthest
corner of the nearest other ranks' boxes that together hold k points). The rank's *reach* is the box
of its queries, cut into up to 64 compact blocks, each grown by its queries' bounds (by the radius, for
radius search); ranks swap reaches (one small all-gather) and send each other only their points inside
the other's reach boxes (a bounding-box halo).
With a spatial partition, as ingest stores it, that is a thin shell around each region, not the whole
cloud. The search over the fetched points is merged with the local result, so neighbour sets equal a
single-process search exactly, ties going to the smaller global index.

Results are global row numbers laid out like the queries, ready for ``x[index]`` (the gather in
``ops/indexing``) and for ``index_add`` / ``scatter_reduce`` aggregation.
"""

from __future__ import annotations

import torch

from domainflow import comm
from domainflow.errors import ShardingMismatchError
from domainflow.layout.placements import Replicate, Shard
from domainflow.ops.point_search import kd_order, knn_search, merge_knn, radius_search
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.dispatch.toolkit import spec_from_sizes

_last_fetch = {"points": 0, "local": 0}


def last_fetch() -> dict:
    """Points this rank received from other ranks in its last search, and its own point count."""
    return dict(_last_fetch)


# torch.compile: knn and radius run eagerly (a graph break; their data-dependent fetches between ranks have no
# traced form), so a compiled model that calls them gets eager's result (issue 40)
@torch.compiler.disable
def knn(points, k: int, queries=None, *, exclude_self: bool = False, boxes: torch.Tensor | None = None):
    """The ``k`` nearest points to each query (each point, when ``queries`` is None).

    ``points`` (N, D) and ``queries`` (M, D) are ShardTensors sharded on dim 0 over the same mesh dim
    (any sizes, empty ranks included; other mesh dims replicated), or plain tensors. Mixed layouts work too:
    replicated or plain points with sharded queries search locally; sharded points with replicated or plain
    queries (or sharded over another mesh dim) are gathered first; replicated queries give replicated
    results. ``exclude_self``
    (with ``queries`` None) leaves each point out of its own list. ``boxes`` (ranks, 2, D), each rank's
    point box (``MeshDataset`` samples carry them, from the store's part boxes), saves one all-gather.

    Returns ``(index, distance)``, both (M, k) laid out like the queries: global row numbers of the
    points ordered by (distance, index), and the distances.
    """
    if k < 1:
        raise ValueError(f"knn: k must be at least 1, got {k}")
    queries, layout = _layout(points, queries, exclude_self, "knn")
    total = points.shape[0]
    if total - int(exclude_self) < k:
        raise ValueError(f"knn: k={k} but there are only {total} points"
                         f"{' (each excluding itself)' if exclude_self else ''}; lower k")
    if layout is None:  # plain tensors, one process
        p = points.detach()
        ids = torch.arange(len(p), device=p.device)
        d2, idx = knn_search(queries.detach(), p, ids, k, exclude=ids if exclude_self else None)
        return idx, d2.sqrt()
    p, q, pid, qid, mesh, m, whole = layout
    exclude = qid if exclude_self else None
    d2, idx = knn_search(q, p, pid, k, exclude=exclude)
    if whole:  # every rank holds all points: nothing to fetch
        return _like_queries(idx, queries, mesh), _like_queries(d2.sqrt(), queries, mesh)
    if comm.group_size(mesh, m) > 1:
        box_all = _point_boxes(p, mesh, m, boxes)
        bound = _box_bound(q, box_all, points._spec.sizes[m], k + int(exclude_self), comm_coord(mesh, m))
        bound = torch.minimum(bound, d2[:, -1]) if len(q) else bound
        fp, fid = _fetch_within(p, pid, q, bound.sqrt(), mesh, m)
        if len(fp):
            d2b, idxb = knn_search(q, fp, fid, k, exclude=exclude)
            d2, idx = merge_knn(d2, idx, d2b, idxb, k)
    return _like_queries(idx, queries), _like_queries(d2.sqrt(), queries)


@torch.compiler.disable
def radius(points, r: float, queries=None, *, max_neighbors: int | None = None, exclude_self: bool = False):
    """All points within distance ``r`` of each query (``|q - p|**2 <= r*r``), as an edge list.

    Layouts as in :func:`knn`. Returns ``(query_index, point_index, distance)``: 1-D global row numbers,
    ordered by query, then by point; each rank holds the edges of its own queries (so the edge list is
    sharded with uneven, data-dependent sizes). ``max_neighbors`` keeps each query's nearest.
    """
    if r < 0:
        raise ValueError(f"radius: r must be non-negative, got {r}")
    queries, layout = _layout(points, queries, exclude_self, "radius")
    if layout is None:
        p = points.detach()
        ids = torch.arange(len(p), device=p.device)
        qi, pi, d2 = radius_search(queries.detach(), p, ids, r, max_neighbors, ids if exclude_self else None)
        return qi, pi, d2.sqrt()
    p, q, pid, qid, mesh, m, whole = layout
    if not whole and comm.group_size(mesh, m) > 1:
        fp, fid = _fetch_within(p, pid, q, q.new_full((len(q),), float(r)), mesh, m)
        p, pid = torch.cat([p, fp]), torch.cat([pid, fid])
    qi, pi, d2 = radius_search(q, p, pid, r, max_neighbors, qid if exclude_self else None)
    qi = qid[qi] if len(qi) else qi
    if m is None:  # replicated queries: every rank found every edge
        return tuple(ShardTensor.from_spec(t, spec_from_sizes(t.shape, mesh, [Replicate()] * mesh.ndim, {}))
                     for t in (qi, pi, d2.sqrt()))
    n = comm.group_size(mesh, m)
    counts = comm.all_gather_uneven(torch.tensor([len(qi)], device=q.device), 0, [1] * n, mesh, m)
    placements = [Shard(0) if k == m else Replicate() for k in range(mesh.ndim)]
    sizes = {m: [int(c) for c in counts]}
    return tuple(ShardTensor.from_spec(t, spec_from_sizes(t.shape, mesh, placements, sizes)) for t in (qi, pi, d2.sqrt()))


# --------------------------------------------------------------------------------------------
# pieces
# --------------------------------------------------------------------------------------------
def comm_coord(mesh, m: int) -> int:
    from domainflow.layout.spec import mesh_coordinate

    return mesh_coordinate(mesh)[m]


def _layout(points, queries, exclude_self: bool, what: str):
    """(queries, (local points, local queries, their global ids, mesh, mesh dim) or None for plain
    tensors); queries None means the points themselves."""
    if queries is None:
        queries = points
    elif exclude_self:
        raise ValueError(f"{what}: exclude_self needs queries=None (the points are their own queries)")
    return queries, _local_layout(points, queries, what)


def _local_layout(points, queries, what: str):
    """None for plain tensors; else (points, queries, their global row ids, mesh, mesh dim of the queries'
    rows or None, whole) with local tensors. ``whole``: this rank holds every point (points replicated or
    plain, or sharded otherwise than the queries and gathered), so no fetch is needed."""
    for name, t in (("points", points), ("queries", queries)):
        if t.ndim != 2 or not t.is_floating_point():
            raise ValueError(f"{what}: {name} must be a floating (rows, dims) tensor, got {t.dtype} {tuple(t.shape)}")
    if points.shape[1] != queries.shape[1]:
        raise ValueError(f"{what}: points have {points.shape[1]} coordinates, queries {queries.shape[1]}")
    sts = [t for t in (points, queries) if isinstance(t, ShardTensor)]
    if not sts:
        return None
    if len(sts) == 2 and points._spec.mesh != queries._spec.mesh:
        raise ShardingMismatchError(f"{what}: points and queries live on different device meshes")
    mesh = sts[0]._spec.mesh
    pm, qm = _row_mesh_dim(points, what, "points"), _row_mesh_dim(queries, what, "queries")
    if pm is not None and pm == qm:
        return (points._local.detach(), queries._local.detach(), _global_ids(points, pm), _global_ids(queries, qm),
                mesh, pm, False)
    p = _whole(points)
    pid = torch.arange(len(p), device=p.device)
    if qm is not None:
        return p, queries._local.detach(), pid, _global_ids(queries, qm), mesh, qm, True
    q = _whole(queries)
    return p, q, pid, torch.arange(len(q), device=q.device), mesh, None, True


def _row_mesh_dim(t, what: str, name: str) -> int | None:
    """The mesh dim sharding ``t``'s rows (dim 0), or None when ``t`` is plain or replicated."""
    if not isinstance(t, ShardTensor):
        return None
    shards = [k for k, p in enumerate(t._spec.placements) if not isinstance(p, Replicate)]
    if not shards:
        return None
    if len(shards) != 1 or t._spec.placements[shards[0]] != Shard(0):
        raise ShardingMismatchError(f"{what}: {name} must be sharded on dim 0 over one mesh dim (replicated over "
                                    f"the others) or replicated; got placements {t.placements}")
    return shards[0]


def _whole(t) -> torch.Tensor:
    """All rows of ``t`` on this rank (a sharded ShardTensor is gathered), detached."""
    if isinstance(t, ShardTensor):
        return t.detach().redistribute([Replicate()] * t._spec.mesh.ndim).to_local()
    return t.detach()


def _global_ids(t: ShardTensor, m: int) -> torch.Tensor:
    start = t._spec.offsets[0]
    return torch.arange(start, start + t._local.shape[0], device=t._local.device)


def _like_queries(local: torch.Tensor, queries, mesh=None) -> ShardTensor:
    """``local`` (one row per local query) laid out like the queries; replicated when they are plain."""
    if not isinstance(queries, ShardTensor):
        return ShardTensor.from_spec(local, spec_from_sizes(local.shape, mesh, [Replicate()] * mesh.ndim, {}))
    spec = queries._spec
    return ShardTensor.from_spec(local, spec_from_sizes(local.shape, spec.mesh, list(spec.placements),
                                                        {k: list(s) for k, s in enumerate(spec.sizes) if s is not None}))


def _point_boxes(p: torch.Tensor, mesh, m: int, boxes) -> torch.Tensor:
    """(ranks, 2, D) boxes of every rank's points along mesh dim ``m`` (empty rank: an empty box)."""
    if boxes is not None:
        return torch.as_tensor(boxes, dtype=p.dtype, device=p.device)
    if len(p):
        mine = torch.stack([p.amin(0), p.amax(0)])
    else:
        mine = torch.stack([p.new_full((p.shape[1],), float("inf")), p.new_full((p.shape[1],), float("-inf"))])
    n = comm.group_size(mesh, m)
    return comm.all_gather_uneven(mine[None], 0, [1] * n, mesh, m)


def _box_bound(q: torch.Tensor, boxes: torch.Tensor, sizes, need: int, me: int) -> torch.Tensor:
    """Per query, a squared distance within which ``need`` points surely lie: the farthest corner of the
    nearest ranks' boxes that together hold ``need`` points (for ranks holding too few points)."""
    if not len(q):
        return q.new_zeros(0)
    lo, hi = boxes[:, 0], boxes[:, 1]
    far = torch.maximum((q[:, None] - lo[None]).abs(), (hi[None] - q[:, None]).abs())
    far2 = (far * far).sum(-1)                                          # (nq, ranks)
    counts = torch.tensor([int(s) for s in sizes], device=q.device)
    far2 = torch.where(counts[None] > 0, far2, far2.new_full((), float("inf")))
    srt, order = torch.sort(far2, dim=1)
    enough = counts[order].cumsum(1) >= need
    first = enough.float().argmax(1)
    return srt.gather(1, first[:, None])[:, 0]


REACH_BOXES = 64


def _fetch_within(p, pid, q, reach, mesh, m: int):
    """The other ranks' points that some query of this rank may reach: the queries are grouped into up
    to ``REACH_BOXES`` compact blocks, each block's box grown by its largest reach; the boxes are
    all-gathered and each rank sends every other the points inside any of its boxes."""
    n = comm.group_size(mesh, m)
    me = comm_coord(mesh, m)
    dims = p.shape[1]
    boxes = torch.stack([q.new_full((REACH_BOXES, dims), float("inf")),
                         q.new_full((REACH_BOXES, dims), float("-inf"))], 1)    # (boxes, 2, D), empty
    if len(q):
        leaf = -(-len(q) // REACH_BOXES)
        order = kd_order(q, leaf)
        block = torch.arange(len(q), device=q.device) // leaf
        qs = q[order]
        grow = (reach[order] * (1 + 1e-6) + 1e-30)[:, None]  # a hair wider than the bound: never too narrow
        idx = block[:, None].expand(-1, dims)
        boxes[:, 0] = boxes[:, 0].scatter_reduce(0, idx, qs - grow, "amin")
        boxes[:, 1] = boxes[:, 1].scatter_reduce(0, idx, qs + grow, "amax")
    reaches = comm.all_gather_uneven(boxes[None], 0, [1] * n, mesh, m)   # (ranks, boxes, 2, D)
    rows, counts = [], []
    for k in range(n):
        if k == me or not len(p):
            rows.append(pid.new_zeros(0))
        else:
            lo, hi = reaches[k, :, 0], reaches[k, :, 1]
            inside = ((p[:, None] >= lo[None]) & (p[:, None] <= hi[None])).all(-1).any(1)
            rows.append(inside.nonzero()[:, 0])
        counts.append(len(rows[-1]))
    order = torch.cat(rows)
    got = comm.all_to_all_dims(torch.tensor(counts, device=p.device), 0, [1] * n, 0, [(1,)] * n, mesh, m)
    recv = [int(c) for c in got]
    fp = comm.all_to_all_dims(p[order], 0, counts, 0, [(c, dims) for c in recv], mesh, m)
    fid = comm.all_to_all_dims(pid[order], 0, counts, 0, [(c,) for c in recv], mesh, m)
    _last_fetch.update(points=len(fid), local=len(p))
    return fp, fid
