"""Spatial partitioning (preprocess.partition) and the part -> rank arithmetic readers use."""

from __future__ import annotations

import numpy as np
import pytest

from domainflow.layout import shapes
from domainflow.preprocess.partition import METHODS, check_parts, morton_codes, partition


def _cloud(rng, n, d=3):
    """Anisotropic, clustered points with duplicates: harder than uniform noise."""
    centers = rng.normal(size=(4, d)) * [8.0, 2.0, 0.5][:d]
    pts = centers[rng.integers(0, 4, n)] + rng.normal(size=(n, d)) * [2.0, 0.5, 0.1][:d]
    if n > 10:
        pts[: n // 10] = pts[n // 10: 2 * (n // 10)]  # exact duplicates
    return pts


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [0, 1, 7, 100, 2000])
@pytest.mark.parametrize("parts", [1, 2, 8, 64])
def test_partition_is_a_permutation_with_contiguous_parts(method, n, parts):
    rng = np.random.default_rng(n * 131 + parts)
    pts = _cloud(rng, n)
    p = partition(pts, parts, method)
    assert sorted(p.order.tolist()) == list(range(n))
    assert p.offsets[0] == 0 and p.offsets[-1] == n and len(p.offsets) == parts + 1
    assert (np.diff(p.offsets) >= 0).all()
    assert p.sizes().max() - p.sizes().min() <= 1  # balanced to one row
    reordered = pts[p.order]
    for k in range(parts):
        rows = reordered[p.offsets[k]: p.offsets[k + 1]]
        if len(rows):
            assert (rows >= p.boxes[k, 0] - 1e-5).all() and (rows <= p.boxes[k, 1] + 1e-5).all()
        else:
            assert np.isnan(p.boxes[k]).all()
    again = partition(pts, parts, method)
    assert np.array_equal(again.order, p.order)  # deterministic


def test_rcb_siblings_are_separated_by_a_plane():
    """Each bisection cuts along one axis: sibling parts' boxes do not overlap along it."""
    rng = np.random.default_rng(0)
    pts = _cloud(rng, 4000)
    p = partition(pts, 16, "rcb")
    for k in range(0, 16, 2):
        a, b = p.boxes[k], p.boxes[k + 1]
        assert any(a[1, ax] <= b[0, ax] + 1e-6 for ax in range(3)), (k, a, b)


def test_rcb_parts_are_more_compact_than_a_random_split():
    rng = np.random.default_rng(1)
    pts = _cloud(rng, 4000)
    vol = lambda b: float(np.prod(b[:, 1] - b[:, 0], axis=-1).sum())  # noqa: E731
    p = partition(pts, 16, "rcb")
    shuffled = rng.permutation(len(pts))
    rand_boxes = np.stack([[pts[s].min(0), pts[s].max(0)] for s in np.array_split(shuffled, 16)])
    assert vol(p.boxes) < 0.1 * vol(rand_boxes)


def test_morton_order_sorts_codes():
    rng = np.random.default_rng(2)
    pts = _cloud(rng, 500)
    p = partition(pts, 8, "morton")
    codes = morton_codes(pts)[p.order]
    assert (np.diff(codes.astype(np.float64)) >= 0).all()


def test_slab_splits_along_the_longest_axis():
    rng = np.random.default_rng(3)
    pts = rng.uniform(size=(300, 3)) * [1.0, 10.0, 2.0]
    p = partition(pts, 4, "slab")
    xs = pts[p.order][:, 1]
    assert (np.diff(xs) >= 0).all()


@pytest.mark.parametrize("bad", [0, 3, 6, 100])
def test_parts_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        check_parts(bad)


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="NaN/Inf"):
        partition(np.array([[0.0, 1.0], [np.nan, 2.0]]), 2)
    with pytest.raises(ValueError, match="method"):
        partition(np.zeros((3, 3)), 2, "octree")


def test_part_ranges_cover_every_part_once():
    for parts in (1, 2, 8, 64):
        for world in range(1, parts + 1):
            ranges = [shapes.part_range(r, world, parts) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == parts
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert [shapes.part_range(r, 3, 8) for r in range(3)] == [(0, 2), (2, 5), (5, 8)]
    with pytest.raises(ValueError, match="domain sizes 1..8"):
        shapes.part_range(0, 9, 8)


def test_rows_per_rank_are_the_sharding_sizes():
    rng = np.random.default_rng(4)
    p = partition(_cloud(rng, 1000), 8)
    for world in (1, 2, 3, 4, 8):
        sizes = shapes.rows_per_rank(p.offsets, world)
        assert sum(sizes) == 1000 and len(sizes) == world


# -- out of core: the same partition from coordinates on disk -------------------------------------------
def _streamed(pts, parts, block, tmp_path):
    from domainflow.preprocess.partition import rcb_streaming
    from domainflow.preprocess.scratch import ScratchArray

    coords = ScratchArray(tmp_path / "coords", len(pts), pts.dtype, (pts.shape[1],))
    coords.write(0, pts)
    ids = ScratchArray(tmp_path / "ids", len(pts), np.uint16)
    try:
        offsets, boxes = rcb_streaming(coords, parts, block, ids)
        return np.argsort(ids.read(0, len(pts)), kind="stable"), offsets, boxes
    finally:
        coords.close()
        ids.close()


_CLOUDS = {
    "gaussian": lambda rng: rng.standard_normal((6000, 3)).astype(np.float32),
    "many ties": lambda rng: np.round(rng.standard_normal((4000, 3)) * 2).astype(np.float32),
    "all equal": lambda rng: np.zeros((300, 3), np.float32),
    "fewer points than parts": lambda rng: rng.standard_normal((5, 3)).astype(np.float32),
    "one point": lambda rng: rng.standard_normal((1, 3)).astype(np.float32),
    "2-D float64": lambda rng: rng.standard_normal((3000, 2)),
    "a flat slab": lambda rng: np.c_[rng.standard_normal((3000, 2)), np.full(3000, 0.5)].astype(np.float32),
}


@pytest.mark.parametrize("cloud", sorted(_CLOUDS))
@pytest.mark.parametrize("parts,bins,gather", [(16, 4096, 1 << 20), (32, 4, 25), (1, 16, 40), (2, 8, 10)])
def test_out_of_core_rcb_equals_the_in_memory_partition(tmp_path, monkeypatch, cloud, parts, bins, gather):
    """Blocks of 97 rows and (in most cases) a median search that must narrow its range several times."""
    from domainflow.preprocess import partition as part_module

    monkeypatch.setattr(part_module, "_BINS", bins)
    monkeypatch.setattr(part_module, "_GATHER", gather)
    pts = _CLOUDS[cloud](np.random.default_rng(7))
    ref = partition(pts, parts, "rcb")
    order, offsets, boxes = _streamed(pts, parts, 97, tmp_path)
    assert np.array_equal(offsets, ref.offsets)
    assert np.array_equal(order, ref.order)
    assert np.array_equal(boxes, ref.boxes, equal_nan=True)


def _key_sorted(pts, parts, method, block, tmp_path):
    """The row order and parts of the out-of-core morton/slab sort (original row of each sorted row)."""
    from domainflow.preprocess.partition import group_rows, key_order_streaming
    from domainflow.preprocess.scratch import ScratchArray

    n = len(pts)
    arrays = {"coords": (pts.dtype, (pts.shape[1],)), "rows": (np.int64, ()), "keys": (np.uint64, ()),
              "grouped": (np.uint64, ()), "group_of": (np.uint32, ()), "perm": (np.uint32, ()),
              "inner": (np.uint32, ()), "out": (np.int64, ())}
    a = {k: ScratchArray(tmp_path / k, n, dt, tail) for k, (dt, tail) in arrays.items()}
    try:
        a["coords"].write(0, pts)
        a["rows"].write(0, np.arange(n))
        key_order = key_order_streaming(a["coords"], parts, method, block, a["keys"], a["group_of"], a["perm"],
                                        a["grouped"], a["inner"])
        group_rows(a["rows"], a["group_of"], a["perm"], key_order.groups, a["out"], block)
        grouped, inner = a["out"].read(0, n), a["inner"].read(0, n)
        windows = zip(key_order.windows[:-1], key_order.windows[1:])
        order = np.concatenate([grouped[w0:w1][inner[w0:w1]] for w0, w1 in windows]
                               or [np.zeros(0, np.int64)])
        assert np.diff(key_order.groups).max(initial=0) <= block  # buckets of about half a block: bounded memory
        assert np.diff(key_order.windows).max(initial=0) <= block
        return order, key_order
    finally:
        for x in a.values():
            x.close()


@pytest.mark.parametrize("cloud", sorted(_CLOUDS))
@pytest.mark.parametrize("method", ["morton", "slab"])
@pytest.mark.parametrize("parts,block", [(8, 97), (1, 50), (4, 4000), (16, 7)])
def test_out_of_core_key_sort_equals_the_in_memory_partition(tmp_path, cloud, method, parts, block):
    """Morton/slab: a sample sort in buckets of about half a block gives partition()'s exact order and
    parts, ties (equal keys split over buckets, or all rows equal) ordered by row as in memory."""
    pts = _CLOUDS[cloud](np.random.default_rng(7))
    ref = partition(pts, parts, method)
    order, key_order = _key_sorted(pts, parts, method, block, tmp_path)
    assert np.array_equal(key_order.offsets, ref.offsets)
    assert np.array_equal(order, ref.order)
