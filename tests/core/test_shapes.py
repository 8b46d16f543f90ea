"""Pure shape arithmetic (no process group), checked on thousands of random cases against brute force:
index arrays pushed through the real torch op tell where every element goes."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from domainflow.layout import shapes


def _rand_sizes(rng, n, parts):
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return tuple(b - a for a, b in zip([0] + cuts, cuts + [n]))


def test_chunk_sizes_match_torch_chunk():
    for n in range(0, 40):
        for parts in range(1, 9):
            want = [c.shape[0] for c in torch.arange(n).chunk(parts)] if n else []
            want += [0] * (parts - len(want))
            assert shapes.chunk_sizes(n, parts) == tuple(want)


def test_balanced_sizes_match_numpy():
    for n in range(0, 40):
        for parts in range(1, 9):
            assert shapes.balanced_sizes(n, parts) == tuple(len(a) for a in np.array_split(np.arange(n), parts))


def test_overlap_splits_move_every_row_once():
    rng = random.Random(0)
    for _ in range(3000):
        n, p, q = rng.randint(0, 30), rng.randint(1, 5), rng.randint(1, 5)
        src, dst = _rand_sizes(rng, n, p), _rand_sizes(rng, n, q)
        ov = shapes.overlap_splits(src, dst)
        owner_src = np.repeat(np.arange(p), src)
        owner_dst = np.repeat(np.arange(q), dst)
        want = np.zeros((p, q), int)
        np.add.at(want, (owner_src, owner_dst), 1)
        assert ov == want.tolist()


def test_slice_sizes_match_python_slicing():
    rng = random.Random(1)
    for _ in range(5000):
        n, parts = rng.randint(0, 25), rng.randint(1, 5)
        sizes = _rand_sizes(rng, n, parts)
        start, stop, step = rng.randint(-30, 30), rng.randint(-30, 30), rng.randint(1, 4)
        a, b, c = shapes.normalize_slice(n, start, stop, step)
        idx = np.arange(n)[start:stop:step]
        assert (a, b, c) and list(range(a, b, c)) == idx.tolist()
        counts, starts = shapes.slice_sizes(sizes, a, b, c)
        offs = shapes.offsets(sizes)
        got = []
        for k in range(parts):
            local = np.arange(offs[k], offs[k] + sizes[k])
            sel = local[starts[k]: starts[k] + (counts[k] - 1) * c + 1: c] if counts[k] else local[:0]
            got.extend(sel.tolist())
            assert len(sel) == counts[k]
        assert got == idx.tolist()


def _rand_shape(rng, nd):
    return tuple(rng.choice([1, 1, 2, 3, 4, 6]) for _ in range(nd))


def _reshapes(rng, shape):
    """Random target shapes with the same number of elements."""
    numel = math.prod(shape)
    out = []
    for _ in range(4):
        dims, left = [], numel
        while left > 1:
            d = rng.choice([f for f in range(1, left + 1) if left % f == 0])
            dims.append(d)
            left //= d
        rng.shuffle(dims)
        for _ in range(rng.randint(0, 2)):
            dims.insert(rng.randint(0, len(dims)), 1)
        out.append(tuple(dims) or (1,))
    return out


def test_view_shard_map_agrees_with_real_reshape():
    """When view_shard_map says a reshape keeps a dim sharded, reshaping the index tensor shows each
    rank's rows land exactly in the claimed contiguous range of the claimed output dim."""
    rng = random.Random(2)
    checked = refused = 0
    for _ in range(3000):
        src = _rand_shape(rng, rng.randint(1, 4))
        dim = rng.randrange(len(src))
        parts = rng.randint(1, 4)
        sizes = _rand_sizes(rng, src[dim], parts)
        owner = torch.repeat_interleave(torch.arange(parts), torch.tensor(sizes)).view(
            [-1 if d == dim else 1 for d in range(len(src))]).expand(src)
        for dst in _reshapes(rng, src):
            hit = shapes.view_shard_map(src, dst, dim, sizes)
            if hit is None:
                refused += 1
                continue
            e, dst_sizes = hit
            assert sum(dst_sizes) == dst[e]
            o = owner.reshape(dst)
            offs = shapes.offsets(dst_sizes)
            for k in range(parts):
                want = torch.zeros(dst[e], dtype=torch.bool)
                want[offs[k]: offs[k] + dst_sizes[k]] = True
                mask = want.view([-1 if d == e else 1 for d in range(len(dst))]).expand(dst)
                assert torch.equal(o == k, mask), (src, dst, dim, sizes)
            checked += 1
    assert checked > 1000 and refused > 100


def test_view_shard_map_common_cases():
    assert shapes.view_shard_map((6, 4, 3), (24, 3), 0, (2, 4)) == (0, (8, 16))
    assert shapes.view_shard_map((6, 4, 3), (6, 12), 0, (2, 4)) == (0, (2, 4))
    assert shapes.view_shard_map((6, 4, 3), (24, 3), 1, (1, 3)) is None  # inner dim of a merge
    assert shapes.view_shard_map((12, 3), (3, 4, 3), 0, (4, 8)) == (0, (1, 2))
    assert shapes.view_shard_map((12, 3), (3, 4, 3), 0, (5, 7)) is None  # rows straddle the split


def test_reduced_dim_map():
    assert shapes.reduced_dim_map(3, [1], False) == (frozenset({1}), {0: 0, 2: 1})
    assert shapes.reduced_dim_map(3, [-1], True) == (frozenset({2}), {0: 0, 1: 1})
    assert shapes.reduced_dim_map(2, None, False) == (frozenset({0, 1}), {})


def test_infer_view_shape_and_broadcast():
    assert shapes.infer_view_shape(24, (-1, 3)) == (8, 3)
    with pytest.raises(ValueError):
        shapes.infer_view_shape(24, (-1, 5))
    assert shapes.broadcast_shape((3, 1), (1, 4), (4,)) == (3, 4)
    with pytest.raises(ValueError):
        shapes.broadcast_shape((3,), (4,))


def test_local_shape_and_offsets():
    shape = (10, 7, 3)
    shard_dims = (0, 1)
    dim_sizes = ((4, 0, 6), (7, 0))
    assert shapes.local_shape(shape, shard_dims, dim_sizes, (2, 0)) == (6, 7, 3)
    assert shapes.local_offsets(3, shard_dims, dim_sizes, (2, 1)) == (4, 7, 0)


def test_row_fetch_plan_summaries_match_the_rows():
    """A row fetch's cached summaries (own runs, zero positions, identity and cover tests) agree with the
    positions and rows they summarise, for halos, wrap-around, repeats and empty ranks."""
    import random

    rng = random.Random(5)
    for _ in range(300):
        parts = rng.randint(1, 4)
        sizes = [rng.randint(0, 6) for _ in range(parts)]
        n = sum(sizes)
        wanted = []
        for _ in range(parts):
            k = rng.randint(0, 9)
            wanted.append([rng.choice([-1] + list(range(n))) if rng.random() < 0.3 or not n else
                           min(n - 1, max(0, i)) for i in range(k)])
        me = rng.randrange(parts)
        wanted[me] = rng.choice([wanted[me], list(range(sum(sizes[:me]), sum(sizes[:me + 1])))])
        plan = shapes.row_fetch_plan(sizes, wanted, me)
        pos, rows = plan.own
        expanded = [(p + i, r + i) for p, r, length in plan.own_runs for i in range(length)]
        assert expanded == list(zip(pos, rows))
        filled = set(pos) | {p for v in plan.recv.values() for p in v}
        assert plan.unfilled == tuple(p for p in range(plan.length) if p not in filled)
        start = sum(sizes[:me])
        # nothing moves: this rank keeps exactly its rows and trades none with anyone
        identity = wanted[me] == list(range(start, start + sizes[me])) and not plan.send and not plan.recv
        assert (plan.identity_len == sizes[me]) == identity
        covers = len(pos) == sizes[me] > 0 and list(rows) == list(range(sizes[me])) and \
            list(pos) == list(range(pos[0], pos[0] + sizes[me]))
        assert (plan.covers_len == sizes[me]) == covers
