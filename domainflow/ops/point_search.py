"""Exact k-nearest-neighbour and radius search on one rank's points (pure torch, any device).

Points and queries are grouped into small, spatially compact blocks (a k-d split) with bounding boxes.
For each query block, only candidate blocks whose box can hold a neighbour are compared: for kNN the
blocks closer than an upper bound on the k-th distance (the farthest corner of the nearest blocks that
together hold k points), for radius search the blocks within the radius. The distance of a pair is
always ``sum_d (q_d - p_d)**2`` in the input dtype, evaluated the same way whatever the blocking, so
results do not depend on how points are split into blocks or ranks. Ties are broken by the smaller
candidate id, so neighbour sets are deterministic and equal to a brute-force search.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 128
CANDIDATE_BLOCK = 64


def squared_distances(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(len(q), len(p)) squared distances, one coordinate at a time (bitwise reproducible per pair)."""
    d2 = None
    for j in range(q.shape[1]):
        diff = q[:, j, None] - p[None, :, j]
        d2 = diff * diff if d2 is None else d2 + diff * diff
    if d2 is None:
        return q.new_zeros(len(q), len(p))
    return d2


def kd_order(points: torch.Tensor, leaf: int) -> torch.Tensor:
    """A permutation grouping ``points`` (n, D) into spatially compact leaves of ``leaf`` rows (the last
    may be shorter): recursive median splits along each segment's longest axis, all segments of a level
    at once (two stable sorts per level), splitting at multiples of ``leaf``."""
    n = points.shape[0]
    perm = torch.arange(n, device=points.device)
    if n <= leaf:
        return perm
    seg = torch.zeros(n, dtype=torch.long, device=points.device)
    dims = points.shape[1]
    while True:
        sizes = torch.bincount(seg)
        if int(sizes.max()) <= leaf:
            return perm
        pts = points[perm]
        nseg = len(sizes)
        lo = pts.new_full((nseg, dims), float("inf")).scatter_reduce(0, seg[:, None].expand(-1, dims), pts, "amin")
        hi = pts.new_full((nseg, dims), float("-inf")).scatter_reduce(0, seg[:, None].expand(-1, dims), pts, "amax")
        axis = (hi - lo).argmax(1)
        key = pts.gather(1, axis[seg][:, None])[:, 0]
        o = torch.sort(key, stable=True).indices
        o = o[torch.sort(seg[o], stable=True).indices]       # by segment, then by the split coordinate
        perm = perm[o]
        starts = sizes.cumsum(0) - sizes
        pos = torch.arange(n, device=points.device) - starts[seg]
        blocks = (sizes + leaf - 1) // leaf
        half = (blocks + 1) // 2 * leaf                        # split at a multiple of leaf
        seg = 2 * seg + (pos >= half[seg]).long()
        seg = torch.unique_consecutive(seg, return_inverse=True)[1]


class _Blocks:
    """Points in Morton order, cut into blocks of ``size`` with per-block boxes and counts."""

    def __init__(self, points: torch.Tensor, ids: torch.Tensor, size: int):
        order = kd_order(points, size)
        self.points, self.ids, self.order, self.size = points[order], ids[order], order, size
        n = len(points)
        nb = (n + size - 1) // size
        pad = nb * size - n
        dims = points.shape[1]
        if n:
            padded = torch.cat([self.points, self.points[-1:].expand(pad, dims)]) if pad else self.points
            blocks = padded.view(nb, size, dims)
            self.lo, self.hi = blocks.amin(1), blocks.amax(1)
        else:
            self.lo = self.hi = points.new_zeros(0, dims)
        self.counts = torch.full((nb,), size, dtype=torch.long, device=points.device)
        if pad:
            self.counts[-1] = size - pad
        self.n = n

    def rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Row numbers (into the Morton-ordered points) of the given blocks."""
        r = (blocks[:, None] * self.size + torch.arange(self.size, device=blocks.device)).reshape(-1)
        return r[r < self.n]


def _box_gaps(qlo, qhi, lo, hi):
    """Lower and upper bounds of the squared distance between a query box and each candidate box."""
    gap = torch.maximum(lo - qhi, qlo - hi).clamp_min(0)
    far = torch.maximum((hi - qlo).abs(), (qhi - lo).abs())
    return (gap * gap).sum(1), (far * far).sum(1)


def _take_k(d2: torch.Tensor, ids: torch.Tensor, k: int):
    """Per row, the k smallest of ``d2`` ordered by (distance, id); columns of ``d2`` are in increasing id
    order. Returns (d2 (rows, k), ids (rows, k)); rows with fewer than k finite entries pad with inf / -1."""
    rows, m = d2.shape
    if m == 0 or k == 0:
        return d2.new_full((rows, k), float("inf")), ids.new_full((rows, k), -1)
    kk = min(k, m)
    kth = d2.topk(kk, dim=1, largest=False).values[:, -1:]
    below = d2 < kth
    ties = d2 == kth
    room = kk - below.sum(1, keepdim=True)
    keep = below | (ties & (ties.cumsum(1) <= room))      # the first ties in id order
    cols = keep.nonzero()[:, 1].view(rows, kk)            # k columns per row, in id order
    sel_d2 = d2.gather(1, cols)
    o = torch.sort(sel_d2, dim=1, stable=True).indices    # by distance; equal distances keep id order
    out_d2, out_ids = sel_d2.gather(1, o), ids[cols.gather(1, o)]
    out_ids = torch.where(torch.isfinite(out_d2), out_ids, out_ids.new_full((), -1))
    if kk < k:
        out_d2 = torch.cat([out_d2, d2.new_full((rows, k - kk), float("inf"))], 1)
        out_ids = torch.cat([out_ids, out_ids.new_full((rows, k - kk), -1)], 1)
    return out_d2, out_ids


def knn_search(queries: torch.Tensor, points: torch.Tensor, ids: torch.Tensor, k: int,
               exclude: torch.Tensor | None = None):
    """The k nearest of ``points`` (ids ``ids``) to each query, by (squared distance, id).

    Returns (squared distances (nq, k), ids (nq, k)); with fewer than k points the tail is inf / -1.
    ``exclude`` (nq,) gives, per query, an id that must not be its own neighbour (the query itself).
    """
    nq = len(queries)
    out_d2 = queries.new_full((nq, k), float("inf"))
    out_ids = torch.full((nq, k), -1, dtype=torch.long, device=queries.device)
    if nq == 0 or len(points) == 0 or k == 0:
        return out_d2, out_ids
    cand = _Blocks(points, ids, CANDIDATE_BLOCK)
    qb = _Blocks(queries, torch.arange(nq, device=queries.device), QUERY_BLOCK)
    for b in range(len(qb.counts)):
        rows = qb.rows(torch.tensor([b], device=queries.device))
        q = qb.points[rows]
        skip = exclude[qb.order[rows]] if exclude is not None else None
        sel = _knn_candidates(q, qb.lo[b], qb.hi[b], cand, k, skip)
        cids = cand.ids[sel]
        o = torch.sort(cids).indices
        sel, cids = sel[o], cids[o]
        d2 = squared_distances(q, cand.points[sel])
        if skip is not None:
            d2 = d2.masked_fill(cids[None, :] == skip[:, None], float("inf"))
        dd, ii = _take_k(d2, cids, k)
        out_d2[qb.order[rows]] = dd
        out_ids[qb.order[rows]] = ii
    return out_d2, out_ids


def _knn_candidates(q, qlo, qhi, cand: _Blocks, k: int, skip):
    """Rows of ``cand`` that can be among the k nearest of some query in ``q``: a first guess from the
    blocks nearest the query box gives each query an upper bound on its k-th distance; a block is
    kept when it lies within that bound of at least one query."""
    lb, _ = _box_gaps(qlo, qhi, cand.lo, cand.hi)
    order = torch.sort(lb).indices
    need = k + (1 if skip is not None else 0)
    first = int(torch.searchsorted(cand.counts[order].cumsum(0), need)) + 1
    near = cand.rows(order[:max(first, 4)])
    d2 = squared_distances(q, cand.points[near])
    if skip is not None:
        d2 = d2.masked_fill(cand.ids[near][None, :] == skip[:, None], float("inf"))
    if d2.shape[1] < k:
        return cand.rows(torch.arange(len(cand.counts), device=q.device))
    bound = d2.topk(k, dim=1, largest=False).values[:, -1]
    gap = torch.maximum(cand.lo[None] - q[:, None], q[:, None] - cand.hi[None]).clamp_min(0)
    reach = ((gap * gap).sum(-1) <= bound[:, None]).any(0)
    return cand.rows(reach.nonzero()[:, 0])


def merge_knn(d2_a, ids_a, d2_b, ids_b, k: int):
    """The k best of two candidate lists per query (each ordered or not), by (distance, id)."""
    d2 = torch.cat([d2_a, d2_b], 1)
    ids = torch.cat([ids_a, ids_b], 1)
    big = torch.iinfo(torch.long).max
    key_ids = torch.where(ids < 0, ids.new_full((), big), ids)
    o = torch.sort(key_ids, dim=1, stable=True).indices   # id order first ...
    d2, ids = d2.gather(1, o), ids.gather(1, o)
    o = torch.sort(d2, dim=1, stable=True).indices         # ... then distance, ties keep id order
    return d2.gather(1, o)[:, :k], ids.gather(1, o)[:, :k]


def radius_search(queries: torch.Tensor, points: torch.Tensor, ids: torch.Tensor, r: float,
                  max_neighbors: int | None = None, exclude: torch.Tensor | None = None):
    """All ``points`` within distance ``r`` (``d2 <= r*r``) of each query: (query rows, ids, squared
    distances), ordered by query row, then by id. ``max_neighbors`` keeps each query's nearest (ties to
    the smaller id). ``exclude`` as in :func:`knn_search`."""
    nq = len(queries)
    empty = (torch.zeros(0, dtype=torch.long, device=queries.device),) * 2 + (queries.new_zeros(0),)
    if nq == 0 or len(points) == 0:
        return empty
    r2 = torch.tensor(r * r, dtype=queries.dtype, device=queries.device)
    cand = _Blocks(points, ids, CANDIDATE_BLOCK)
    qb = _Blocks(queries, torch.arange(nq, device=queries.device), QUERY_BLOCK)
    out_q, out_i, out_d = [], [], []
    for b in range(len(qb.counts)):
        rows = qb.rows(torch.tensor([b], device=queries.device))
        q = qb.points[rows]
        lb, _ = _box_gaps(qb.lo[b], qb.hi[b], cand.lo, cand.hi)
        sel = cand.rows((lb <= r2).nonzero()[:, 0])
        if not len(sel):
            continue
        cids = cand.ids[sel]
        o = torch.sort(cids).indices
        sel, cids = sel[o], cids[o]
        d2 = squared_distances(q, cand.points[sel])
        inside = d2 <= r2
        if exclude is not None:
            inside &= cids[None, :] != exclude[qb.order[rows]][:, None]
        if max_neighbors is not None:
            dd, ii = _take_k(d2.masked_fill(~inside, float("inf")), cids, max_neighbors)
            keep = ii >= 0
            qi = qb.order[rows][:, None].expand_as(ii)[keep]
            out_q.append(qi)
            out_i.append(ii[keep])
            out_d.append(dd[keep])
        else:
            rr, cc = inside.nonzero(as_tuple=True)
            out_q.append(qb.order[rows][rr])
            out_i.append(cids[cc])
            out_d.append(d2[rr, cc])
    if not out_q:
        return empty
    qi, ii, dd = torch.cat(out_q), torch.cat(out_i), torch.cat(out_d)
    o = torch.sort(ii, stable=True).indices                # by id ...
    qi, ii, dd = qi[o], ii[o], dd[o]
    o = torch.sort(qi, stable=True).indices                # ... within each query
    return qi[o], ii[o], dd[o]
