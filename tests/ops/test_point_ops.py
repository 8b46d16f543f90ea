"""Gathers and scatters by global index across shard boundaries (the message-passing step) against the
same ops on full tensors in one process: outputs, input and parameter gradients, uneven shards with a
nearly empty rank, repeated indices, ties in max/min."""

from __future__ import annotations

import random

import pytest
import torch

from dist_pool import rank_and_world
from domainflow import Replicate, Shard, ShardTensor
from sharded_check import Sharded, check_sharded, get_mesh, nearly_empty_sizes


_sizes = nearly_empty_sizes  # one rank holds at most one row


def _gathers(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, q, c = 17, 13, 3
    x = torch.randn(n, c, generator=gen, dtype=torch.float64)
    xs, qs = _sizes(n, world, rng), _sizes(q, world, rng)
    idx = torch.randint(0, n, (q,), generator=gen)
    idx[:3] = idx[0]  # repeats
    sx = Sharded(x, [Shard(0)], {0: xs})
    si = Sharded(idx, [Shard(0)], {0: qs}, requires_grad=False)
    # index_select by a sharded index: the output follows the index's sizes
    check_sharded(lambda a, i: torch.index_select(a, 0, i), [sx, si], mesh,
                  expect_placements=[Shard(0)], expect_sizes={0: qs})
    # by a replicated (plain) index: a replicated output
    check_sharded(lambda a: a.index_select(0, idx), [sx], mesh, expect_placements=[Replicate()])
    # along a sharded dim 1
    xt = x.t().contiguous()
    check_sharded(lambda a, i: a.index_select(1, i), [Sharded(xt, [Shard(1)], {0: xs}), si], mesh,
                  expect_placements=[Shard(1)], expect_sizes={0: qs})
    # x[nbr] with a (q, k) neighbour index: the message-passing gather
    nbr = torch.randint(0, n, (q, 4), generator=gen)
    check_sharded(lambda a, i: a[i] * 2.0, [sx, Sharded(nbr, [Shard(0)], {0: qs}, requires_grad=False)], mesh,
                  expect_placements=[Shard(0)], expect_sizes={0: qs})
    # gather: an expanded (row-uniform) index and an element-wise one
    check_sharded(lambda a, i: torch.gather(a, 0, i[:, None].expand(-1, c)), [sx, si], mesh)
    check_sharded(lambda a: torch.gather(a, 0, idx[:, None].expand(q, c)), [sx], mesh)
    elem = torch.randint(0, n, (q, 2), generator=gen)
    check_sharded(lambda a, i: a.gather(0, i), [sx, Sharded(elem, [Shard(0)], {0: qs}, requires_grad=False)], mesh)
    return True


def _scatters(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, e, c = 11, 19, 3
    x = torch.randn(n, c, generator=gen, dtype=torch.float64)
    # integer-valued messages make ties in amax / amin likely
    src = torch.randint(-3, 4, (e, c), generator=gen).to(torch.float64)
    dst = torch.randint(0, n, (e,), generator=gen)
    xs, es = _sizes(n, world, rng), _sizes(e, world, rng)
    sx = Sharded(x, [Shard(0)], {0: xs})
    ss = Sharded(src, [Shard(0)], {0: es})
    sd = Sharded(dst, [Shard(0)], {0: es}, requires_grad=False)
    check_sharded(lambda a, i, s: a.index_add(0, i, s, alpha=0.5), [sx, sd, ss], mesh,
                  expect_placements=[Shard(0)], expect_sizes={0: xs})
    for reduce in ("prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_sharded(lambda a, i, s: a.index_reduce(0, i, s, reduce, include_self=include_self), [sx, sd, ss],
                          mesh)
    # an expanded index (whole rows travel) and the same index materialised (element by element)
    expanded = lambda i: i[:, None].expand(-1, c)  # noqa: E731
    si = Sharded(dst[:, None].expand(e, c).contiguous(), [Shard(0)], {0: es}, requires_grad=False)
    check_sharded(lambda a, i, s: torch.scatter_add(a, 0, expanded(i), s), [sx, sd, ss], mesh)
    check_sharded(lambda a, i, s: torch.scatter_add(a, 0, i, s), [sx, si, ss], mesh)
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_sharded(lambda a, i, s: a.scatter_reduce(0, expanded(i), s, reduce, include_self=include_self),
                          [sx, sd, ss], mesh)
            check_sharded(lambda a, i, s: a.scatter_reduce(0, i, s, reduce, include_self=include_self),
                          [sx, si, ss], mesh)
    # an element-wise index (each column its own destination) and a narrower one
    elem = torch.randint(0, n, (e, 2), generator=gen)
    se = Sharded(elem, [Shard(0)], {0: es}, requires_grad=False)
    for reduce in ("sum", "mean", "amax"):
        check_sharded(lambda a, i, s: a.scatter_reduce(0, i, s[:, :2], reduce, include_self=False), [sx, se, ss],
                      mesh)
    # into a replicated destination (e.g. one value per graph): a pending sum
    seg = torch.randint(0, 3, (e,), generator=gen)
    out = check_sharded(lambda i, s: torch.zeros(3, c, dtype=torch.float64).index_add(0, i, s),
                        [Sharded(seg, [Shard(0)], {0: es}, requires_grad=False), ss], mesh)
    assert out is not None
    # in place, on a sharded destination
    check_sharded(lambda a, i, s: (a * 1.0).index_add_(0, i, s), [sx, sd, ss], mesh)
    return True


def _message_passing(seed):
    """A two-layer point network: gather neighbour features, an MLP on edges, mean / max aggregation
    onto destinations across shards; parameters' gradients equal single-process."""
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, k, c = 23, 4, 5
    pos = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    feat = torch.randn(n, c, generator=gen, dtype=torch.float64)
    nbr = torch.randint(0, n, (n, k), generator=gen)
    sizes = _sizes(n, world, rng)
    torch.manual_seed(seed)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.edge = torch.nn.Sequential(torch.nn.Linear(c + 3, 8), torch.nn.GELU(), torch.nn.Linear(8, c))

        def forward(self, p, h, nb):
            rel = p[nb] - p.unsqueeze(1)                       # (n, k, 3) relative positions
            msg = self.edge(torch.cat([h[nb], rel], dim=-1))   # (n, k, c)
            mean = msg.mean(1)
            # scatter the same messages back onto their sources: aggregation across shards
            dst = nb.reshape(-1)
            back = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand(-1, c), msg.reshape(-1, c), "amax",
                                                      include_self=False)
            return h + mean + back

    net = torch.nn.ModuleList([Layer(), Layer()]).to(torch.float64)

    def run(p, h, nb, model):
        for layer in model:
            h = layer(p, h, nb)
        return h

    check_sharded(run, [Sharded(pos, [Shard(0)], {0: sizes}), Sharded(feat, [Shard(0)], {0: sizes}),
                        Sharded(nbr, [Shard(0)], {0: sizes}, requires_grad=False)], mesh, module=net)
    return True


def _bad_index(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    import domainflow as df

    x = df.distribute_tensor(torch.zeros(5, 2), mesh, [Shard(0)])
    rank, _ = rank_and_world()
    bad = torch.tensor([4 + rank * 10])  # out of range on every rank but rank 0
    idx = ShardTensor.from_local(bad, mesh, [Shard(0)], sharding_shapes={0: [1] * world})
    try:
        x[idx]
    except IndexError as e:
        assert "out of range" in str(e)
        return world > 1
    return world == 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gathers_by_global_index(dist, world):
    assert all(dist.run(world, _gathers, 20 + world))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scatters_by_global_index(dist, world):
    assert all(dist.run(world, _scatters, 30 + world))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_message_passing_network(dist, world):
    assert all(dist.run(world, _message_passing, 40 + world))


@pytest.mark.parametrize("world", [1, 3])
def test_out_of_range_index_fails_on_every_rank(dist, world):
    assert all(dist.run(world, _bad_index, 0))


# --------------------------------------------------------------------------------------------
# neighbour search on a real surface: pyvista's airplane, partitioned spatially as ingest does
# --------------------------------------------------------------------------------------------
def _airplane(dtype=torch.float64):
    """Cell centres of pyvista's shipped airplane in RCB order (8 parts), and the part offsets/boxes."""
    import numpy as np
    from pyvista import examples

    from domainflow.preprocess.partition import partition

    centres = np.asarray(examples.load_airplane().cell_centers().points, dtype=np.float64)
    part = partition(centres, 8)
    return torch.tensor(centres[part.order], dtype=dtype), [int(x) for x in part.offsets], part.boxes


_REFERENCE: dict = {}


def _cached(key, make):
    """Brute-force references, computed once per worker process (every rank needs the same ones)."""
    if key not in _REFERENCE:
        _REFERENCE[key] = make()
    return _REFERENCE[key]


def _brute_knn(q, p, k, exclude_self=False):
    return _cached(("knn", len(q), len(p), k, exclude_self), lambda: _brute_knn_now(q, p, k, exclude_self))


def _brute_knn_now(q, p, k, exclude_self):
    from domainflow.ops.point_search import squared_distances

    d2 = squared_distances(q, p)
    if exclude_self:
        d2.fill_diagonal_(float("inf"))
    s = torch.sort(d2, dim=1, stable=True)      # columns are in index order: ties go to the smaller index
    return s.indices[:, :k], s.values[:, :k].sqrt()


def _surface_references():
    """The brute-force answers on the airplane's own points (the same for every world size and rank), computed
    once in the test process: 16 nearest with and without the point itself, and the radius searches."""
    if "surface" not in _REFERENCE:
        pts, _, _ = _airplane()
        lo, hi = pts.amin(0), pts.amax(0)
        r = float((hi - lo).norm()) * 0.02
        _REFERENCE["surface"] = {"knn": {excl: _brute_knn_now(pts, pts, 16, excl) for excl in (False, True)},
                                 "radius": {cap: _brute_radius_now(pts, r, cap) for cap in (None, 4)}, "r": r}
    return _REFERENCE["surface"]


def _knn_case(seed, refs):
    import domainflow as df
    from domainflow.layout.shapes import rows_per_rank

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    pts, offsets, boxes = _airplane()
    n = len(pts)
    # ingest's layout (rank r holds parts [r*P/W, (r+1)*P/W)) and a layout with one nearly empty rank
    layouts = [tuple(rows_per_rank(offsets, world)), _sizes(n, world, rng)]
    gen = torch.Generator().manual_seed(seed)
    lo, hi = pts.amin(0), pts.amax(0)
    others = lo + (hi - lo) * torch.rand(301, 3, generator=gen, dtype=torch.float64)   # off-surface queries
    fetched = []
    for sizes in layouts:
        sp = df.distribute_tensor(pts, mesh, [Shard(0)], sharding_shapes={0: list(sizes)})
        for k, excl in ((1, False), (8, True), (16, False)):
            idx, dist_ = df.knn(sp, k, exclude_self=excl)
            ref_i, ref_d = (t[:, :k] for t in refs["knn"][excl])
            assert idx.placements == (Shard(0),) and idx._spec.sizes[0] == sizes
            assert torch.equal(idx.full_tensor(), ref_i), f"knn k={k} exclude_self={excl} sizes={sizes}"
            torch.testing.assert_close(dist_.full_tensor(), ref_d, rtol=1e-12, atol=1e-12)
            fetched.append(df.ops.neighbours.last_fetch()["points"])
        qs = _sizes(len(others), world, rng)
        sq = df.distribute_tensor(others, mesh, [Shard(0)], sharding_shapes={0: list(qs)})
        idx, _ = df.knn(sp, 5, sq)
        assert torch.equal(idx.full_tensor(), _brute_knn(others, pts, 5)[0])
        # radius search, with and without a cap on neighbours
        r = refs["r"]
        for cap in (None, 4):
            qi, pi, dd = df.radius(sp, r, max_neighbors=cap, exclude_self=True)
            got = torch.stack([qi.full_tensor(), pi.full_tensor()], 1)
            ref = refs["radius"][cap]
            assert torch.equal(got, ref), f"radius r={r} cap={cap} sizes={sizes}"
    # the partition's own boxes (per rank, merged from part boxes) may stand in for the all-gathered ones
    sizes = layouts[0]
    per_rank = torch.tensor([[boxes[a:b, 0].min(0), boxes[a:b, 1].max(0)] for a, b in
                             _part_ranges(len(offsets) - 1, world)], dtype=torch.float64)
    sp = df.distribute_tensor(pts, mesh, [Shard(0)], sharding_shapes={0: list(sizes)})
    idx, _ = df.knn(sp, 8, boxes=per_rank)
    assert torch.equal(idx.full_tensor(), refs["knn"][False][0][:, :8])
    return fetched[:3], n


def _part_ranges(parts, world):
    return [(r * parts // world, (r + 1) * parts // world) for r in range(world)]


def _brute_radius_now(pts, r, cap):
    from domainflow.ops.point_search import squared_distances

    d2 = squared_distances(pts, pts)
    d2.fill_diagonal_(float("inf"))
    d2 = d2.masked_fill(~(d2 <= torch.tensor(r * r, dtype=pts.dtype)), float("inf"))
    if cap is not None:  # each query's `cap` nearest (stable sort: ties to the smaller index)
        s = torch.sort(d2, dim=1, stable=True)
        keep = torch.zeros_like(d2, dtype=torch.bool)
        keep.scatter_(1, s.indices[:, :cap], torch.isfinite(s.values[:, :cap]))
    else:
        keep = torch.isfinite(d2)
    return keep.nonzero()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_knn_and_radius_on_a_partitioned_surface(dist, world):
    results = dist.run(world, _knn_case, 50 + world, _surface_references())
    if world == 4:
        # with ingest's spatial partition each rank fetches a thin shell, not the whole cloud
        n = results[0][1]
        for fetched, _ in results:
            assert max(fetched) < 0.25 * n, f"ranks fetched {fetched} of {n} points"


def _mixed_layout_search(seed):
    """knn/radius with points and queries in any mix of sharded, replicated and plain: results equal the plain
    search, laid out like the queries (replicated when the queries are not sharded)."""
    import domainflow as df

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pts = torch.rand(60, 3, generator=gen, dtype=torch.float64)
    qry = torch.rand(23, 3, generator=gen, dtype=torch.float64)
    ref_i, ref_d = df.knn(pts, 4, qry)
    ref_r = df.radius(pts, 0.25, qry, max_neighbors=5)
    ps, qs = _sizes(len(pts), world, rng), _sizes(len(qry), world, rng)
    layouts = {"plain": lambda t, s: t, "replicated": lambda t, s: df.distribute_tensor(t, mesh, [Replicate()]),
               "sharded": lambda t, s: df.distribute_tensor(t, mesh, [Shard(0)], sharding_shapes={0: list(s)})}
    problems = []
    for pn, pl in layouts.items():
        for qn, ql in layouts.items():
            if pn == qn == "plain":
                continue
            idx, d = df.knn(pl(pts, ps), 4, ql(qry, qs))
            edges = df.radius(pl(pts, ps), 0.25, ql(qry, qs), max_neighbors=5)
            want = (Shard(0),) if qn == "sharded" else (Replicate(),)
            if tuple(idx.placements) != want or tuple(edges[0].placements) != want:
                problems.append(f"points {pn}, queries {qn}: results laid out {idx.placements}")
            if qn == "sharded" and idx._spec.sizes[0] != tuple(qs):
                problems.append(f"points {pn}, queries {qn}: knn rows {idx._spec.sizes[0]}, queries {qs}")
            if not (torch.equal(idx.full_tensor(), ref_i) and torch.equal(d.full_tensor(), ref_d)):
                problems.append(f"points {pn}, queries {qn}: knn differs from the plain search")
            if not all(torch.equal(e.full_tensor(), r) for e, r in zip(edges, ref_r)):
                problems.append(f"points {pn}, queries {qn}: radius differs from the plain search")
    rep = df.distribute_tensor(pts, mesh, [Replicate()])
    if not torch.equal(df.knn(rep, 3, exclude_self=True)[0].full_tensor(), df.knn(pts, 3, exclude_self=True)[0]):
        problems.append("replicated points, exclude_self: differs from the plain search")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3])
def test_knn_and_radius_with_mixed_layouts(dist, world):
    for problems in dist.run(world, _mixed_layout_search, 60 + world):
        assert not problems, problems
