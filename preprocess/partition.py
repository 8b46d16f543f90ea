"""Spatial partitioning of mesh points into P contiguous, compact parts.

A partition reorders the rows of a run so that each of P parts is one contiguous row range; a rank of a
W-rank domain then reads parts ``[r*P//W, (r+1)*P//W)`` (``domainflow.layout.shapes.part_range``), one
contiguous, spatially compact slab of rows. P is a power of two so that every power-of-two domain size
gets whole subtrees of the bisection.

Methods:
- ``rcb`` (default): recursive coordinate bisection. Split the points at the median of the longest
  side of their bounding box, recurse on both halves, log2(P) levels. Parts differ in size by at most
  one row per level and are compact boxes.
- ``morton``: sort by Z-order (Morton) code of the coordinates quantised to 21 bits per axis, then cut
  into P equal row counts. Cheaper; parts are compact but can be L-shaped.
- ``slab``: sort along one axis (the longest extent unless given) and cut into P equal row counts.

All methods are deterministic: ties are broken by the original row index. Within an RCB part rows keep
their original (file) order; within a morton/slab part they are in key order.

Out of core (a run larger than memory, coordinates on disk): ``rcb_streaming`` finds every median exactly by
histogram passes; ``key_order_streaming`` sorts by the morton/slab key as a sample sort (buckets of about
half a block, each sorted in memory). Both give exactly ``partition()``'s parts and order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("rcb", "morton", "slab")


@dataclass(frozen=True)
class Partition:
    """``order[i]``: original row of new row i; ``offsets``: P+1 row offsets of the parts;
    ``boxes``: (P, 2, D) min/max corner of each part (NaN for an empty part)."""

    order: np.ndarray
    offsets: np.ndarray
    boxes: np.ndarray

    @property
    def parts(self) -> int:
        return len(self.offsets) - 1

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)


def check_parts(parts: int) -> None:
    if parts < 1 or parts & (parts - 1):
        raise ValueError(f"the number of spatial parts must be a power of two (1, 2, 4, ... 64 ...), got {parts}; "
                         f"choose one at least as large as the largest domain size you will train with")


def partition(points: np.ndarray, parts: int, method: str = "rcb", axis: int | None = None) -> Partition:
    """Partition ``points`` (N, D) into ``parts`` contiguous parts by ``method``."""
    check_parts(parts)
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; choose one of {METHODS}")
    pts = np.asarray(points)
    if pts.dtype not in (np.float32, np.float64):
        pts = pts.astype(np.float64)
    if pts.ndim != 2:
        raise ValueError(f"points must be an (N, D) array, got shape {pts.shape}")
    if not np.isfinite(pts).all():
        bad = int((~np.isfinite(pts)).any(axis=1).sum())
        raise ValueError(f"{bad} of {len(pts)} points have NaN/Inf coordinates; fix the mesh before partitioning")
    n = len(pts)
    if method == "rcb":
        order, offsets = _rcb(pts, parts)
    else:
        if method == "morton":
            key_order = np.argsort(morton_codes(pts.astype(np.float64)), kind="stable")
        else:
            ax = int(np.argmax(np.ptp(pts, axis=0))) if axis is None and n else (axis or 0)
            key_order = np.argsort(pts[:, ax], kind="stable")
        order = key_order.astype(np.int64)
        offsets = np.array([k * n // parts for k in range(parts + 1)], dtype=np.int64)
    return Partition(order=order, offsets=offsets, boxes=part_boxes(pts[order], offsets))


def _rcb(pts: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    cols = [np.ascontiguousarray(pts[:, d]) for d in range(pts.shape[1])]  # fast contiguous reductions
    segments = [np.arange(len(pts), dtype=np.int64)]
    while len(segments) < parts:
        nxt = []
        for idx in segments:
            nxt += list(_bisect(cols, idx))
        segments = nxt
    order = np.concatenate(segments) if segments else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in segments])]).astype(np.int64)
    return order, offsets


def _bisect(cols: list, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split rows ``idx`` (ascending) at the median of their bounding box's longest side: the first
    ``ceil(n/2)`` rows by coordinate, ties to the lower original row. A linear-time selection, not a
    sort; both halves stay in ascending row order (the file's own locality within a part)."""
    n = len(idx)
    if n == 0:
        return idx, idx
    sub = [c[idx] for c in cols]
    ax = int(np.argmax([c.max() - c.min() for c in sub]))
    v = sub[ax]
    half = (n + 1) // 2
    t = np.partition(v, half - 1)[half - 1]
    take = v < t
    ties = np.flatnonzero(v == t)[: half - int(take.sum())]
    take[ties] = True
    return idx[take], idx[~take]


def morton_codes(pts: np.ndarray, bits: int = 21, box: tuple | None = None) -> np.ndarray:
    """Z-order codes of points quantised to ``bits`` bits per axis within their bounding box (``box``:
    (lo, hi) of all points, when ``pts`` is one block of them)."""
    n, d = pts.shape
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    lo, hi = (pts.min(axis=0), pts.max(axis=0)) if box is None else box
    scale = np.where(hi > lo, (2 ** bits - 1) / np.where(hi > lo, hi - lo, 1), 0)
    q = ((pts - lo) * scale).astype(np.uint64)
    code = np.zeros(n, dtype=np.uint64)
    for b in range(bits):
        for a in range(d):
            code |= ((q[:, a] >> np.uint64(b)) & np.uint64(1)) << np.uint64(b * d + a)
    return code


def part_boxes(sorted_pts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(P, 2, D) bounding box of each part of already reordered points; NaN for empty parts."""
    parts, d = len(offsets) - 1, sorted_pts.shape[1]
    boxes = np.full((parts, 2, d), np.nan, dtype=np.float32)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    for a in range(d):
        col = np.ascontiguousarray(sorted_pts[:, a])
        starts = np.asarray(offsets[:-1])[nonempty]
        boxes[nonempty, 0, a] = np.minimum.reduceat(col, starts) if len(nonempty) else 0
        boxes[nonempty, 1, a] = np.maximum.reduceat(col, starts) if len(nonempty) else 0
    return boxes


# ------------------------------------------------------------------------------------------------
# out of core: the same RCB partition from coordinates on disk, a block of rows at a time
# ------------------------------------------------------------------------------------------------
_BINS = 4096           # histogram bins per node and refinement round
_GATHER = 1 << 20      # values of one bin gathered to select the median exactly


def rcb_streaming(coords, parts: int, block_rows: int, node_ids) -> tuple[np.ndarray, np.ndarray]:
    """The partition ``partition(coords, parts, "rcb")`` makes, found in bounded memory.

    ``coords``: a row array on disk (``read(lo, hi)``, ``blocks(rows)``, ``n``) of float32/64 (N, D) points;
    ``node_ids``: a writable (N,) integer row array that receives each row's part. Each bisection level
    finds every node's exact median along its longest side by histogram passes (4096 bins a round, then the
    values of the median's bin), then assigns rows in one pass, ties to the lower row as in memory. Returns
    (offsets (P+1,), boxes (P, 2, D)); rows keep file order within a part, so the stored order is
    ``argsort(part, stable)``. About two passes over the coordinates per level."""
    check_parts(parts)
    n = coords.n
    d = coords.shape[1]
    levels = parts.bit_length() - 1
    count = np.array([n], dtype=np.int64)
    lo_box, hi_box = _boxes(coords, None, 1, block_rows)
    for level in range(levels):
        nodes = 1 << level
        src = node_ids if level else None
        span = hi_box - lo_box                       # in the coordinates' dtype, as the in-memory cut
        axis = np.argmax(span, axis=1) if d else np.zeros(nodes, np.int64)
        half = (count + 1) // 2
        cut, ties = _medians(coords, src, nodes, axis, half, count, lo_box, hi_box, block_rows)
        count, lo_box, hi_box = _assign(coords, src, node_ids, nodes, axis, cut, ties, block_rows)
    if levels == 0:
        for lo, hi in coords.blocks(block_rows):
            node_ids.write(lo, np.zeros(hi - lo, node_ids.dtype))
    offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    boxes = np.full((parts, 2, d), np.nan, dtype=np.float32)
    full = count > 0
    boxes[full, 0] = lo_box[full]
    boxes[full, 1] = hi_box[full]
    return offsets, boxes


def _node_block(src, lo, hi) -> np.ndarray:
    return np.zeros(hi - lo, np.int64) if src is None else src.read(lo, hi).astype(np.int64)


def _boxes(coords, src, nodes, block_rows):
    d = coords.shape[1]
    dt = coords.dtype
    lo_box = np.full((nodes, d), np.inf, dtype=dt)
    hi_box = np.full((nodes, d), -np.inf, dtype=dt)
    for lo, hi in coords.blocks(block_rows):
        x, node = coords.read(lo, hi), _node_block(src, lo, hi)
        _update_min_max(lo_box, hi_box, node, x)
    return lo_box, hi_box


def _update_min_max(lo, hi, group: np.ndarray, values: np.ndarray) -> None:
    """lo[g] = min(lo[g], values of group g), hi likewise (like np.minimum.at, several times faster):
    one radix sort of the group ids, then reduceat."""
    if not len(group):
        return
    order = np.argsort(group.astype(np.uint16) if len(lo) <= 1 << 16 else group, kind="stable")
    g = group[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    v = values[order]
    ids = g[starts]
    lo[ids] = np.minimum(lo[ids], np.minimum.reduceat(v, starts, axis=0))
    hi[ids] = np.maximum(hi[ids], np.maximum.reduceat(v, starts, axis=0))


def _bin(v, lo, scale):
    """Histogram bin of values ``v`` in a range starting at ``lo``, ``scale`` = bins / width (0 for an empty
    width): the same in every pass and monotone in v."""
    b = (v.astype(np.float64) - lo) * scale
    np.floor(b, out=b)
    np.clip(b, 0, _BINS - 1, out=b)
    return b.astype(np.int64)


def _scale(width):
    with np.errstate(divide="ignore"):
        return np.where(width > 0, _BINS / width, 0.0)


def _medians(coords, src, nodes, axis, half, count, lo_box, hi_box, block_rows):
    """Each node's ``half``-th smallest value along its axis (exact) and how many of the values equal to it
    go left (the first ones in row order): ``half`` minus the values strictly below the cut, counted while
    selecting (values in lower histogram bins lie strictly below every value of the median's bin)."""
    k = half - 1                                      # 0-based rank of the cut value
    active = count > 0
    cut = np.zeros(nodes, dtype=np.float64)
    below = np.zeros(nodes, dtype=np.int64)          # values known to lie below the current range
    less = np.zeros(nodes, dtype=np.int64)           # values strictly below the cut, once it is known
    chain = [[] for _ in range(nodes)]                # (lo, scale, bin) rounds that narrowed each node's range
    first = np.array([lo_box[j, axis[j]] for j in range(nodes)], dtype=np.float64)
    last = np.array([hi_box[j, axis[j]] for j in range(nodes)], dtype=np.float64)
    done = ~active | (first == last)
    cut[done & active] = first[done & active]
    inside = count.copy()                             # values of each node inside its current range
    while not done.all():
        # a histogram round over the nodes whose bin is still too full to gather
        rng_lo, rng_w = first.copy(), last - first
        rng_s = _scale(rng_w)
        # gather the values of nodes whose range is narrow enough, up to _GATHER values over all nodes
        # together (at deep levels every node is small; gathering them all would hold the whole column)
        cand = np.flatnonzero(~done & (inside <= _GATHER))
        gather = np.zeros(nodes, dtype=bool)
        gather[cand[np.cumsum(inside[cand]) <= _GATHER]] = True
        hist_nodes = ~done & ~gather
        # min/max of a node's values in range: only after a first round (all equal at the start: first == last)
        narrowed = hist_nodes & np.array([len(c) > 0 for c in chain], dtype=bool)
        hist = np.zeros((nodes, _BINS), dtype=np.int64)
        vmin, vmax = np.full(nodes, np.inf), np.full(nodes, -np.inf)
        vals = [[] for _ in range(nodes)]
        for lo, hi in coords.blocks(block_rows):
            x, node = coords.read(lo, hi), _node_block(src, lo, hi)
            v = x[np.arange(hi - lo), axis[node]]
            member = _members(v, node, chain, ~done)
            if hist_nodes.any():
                m = member & hist_nodes[node]
                nm, vm = node[m], v[m]
                hist += np.bincount(nm * _BINS + _bin(vm, rng_lo[nm], rng_s[nm]),
                                    minlength=nodes * _BINS).reshape(nodes, _BINS)
                if narrowed.any():
                    keep = narrowed[nm]
                    _update_min_max(vmin, vmax, nm[keep], vm[keep])
            if gather.any():
                m = member & gather[node]
                for j, values in _by_group(node[m], v[m], nodes):
                    vals[j].append(values)
        for j in np.flatnonzero(gather):
            v = np.concatenate(vals[j]) if len(vals[j]) != 1 else vals[j][0]
            r = int(k[j] - below[j])
            cut[j] = np.partition(v, r)[r]
            less[j] = below[j] + int(np.count_nonzero(v < v.dtype.type(cut[j])))
            done[j] = True
        for j in np.flatnonzero(hist_nodes):
            if narrowed[j] and vmin[j] == vmax[j]:  # every value left in range is the same: that is the cut
                cut[j] = vmin[j]
                less[j] = below[j]
                done[j] = True
                continue
            c = np.cumsum(hist[j])
            b = int(np.searchsorted(c, k[j] - below[j], side="right"))
            below[j] += int(c[b - 1]) if b else 0
            inside[j] = int(hist[j, b])
            chain[j].append((rng_lo[j], rng_s[j], b))
            a_lo = rng_lo[j] + rng_w[j] * b / _BINS
            a_hi = rng_lo[j] + rng_w[j] * (b + 1) / _BINS
            first[j], last[j] = a_lo, a_hi
    return cut, np.where(active, half - less, 0)


def _by_group(group: np.ndarray, values: np.ndarray, groups: int):
    """(g, values of group g) for every group present, in row order within a group: one radix sort."""
    order = np.argsort(group.astype(np.uint16) if groups <= 1 << 16 else group, kind="stable")
    counts = np.bincount(group, minlength=groups)
    pieces = np.split(values[order], np.cumsum(counts)[:-1])
    return [(int(j), pieces[j]) for j in np.flatnonzero(counts)]


def _members(v, node, chain, open_nodes) -> np.ndarray:
    """Rows whose value lies inside their node's current (narrowed) range."""
    m = open_nodes[node].copy()
    depth = max((len(c) for c in chain), default=0)
    for r in range(depth):
        lo = np.array([c[r][0] if len(c) > r else 0.0 for c in chain])
        scale = np.array([c[r][1] if len(c) > r else 0.0 for c in chain])
        want = np.array([c[r][2] if len(c) > r else -1 for c in chain])
        has = want[node] >= 0
        m &= ~has | (_bin(v, lo[node], scale[node]) == want[node])
    return m


def _assign(coords, src, dst, nodes, axis, cut, ties, block_rows):
    """Send every row to child 2j (below the cut, or among the first ``ties[j]`` rows equal to it) or
    2j+1; returns the children's counts and bounding boxes."""
    d = coords.shape[1]
    taken = np.zeros(nodes, dtype=np.int64)
    count = np.zeros(2 * nodes, dtype=np.int64)
    lo_box = np.full((2 * nodes, d), np.inf, dtype=coords.dtype)
    hi_box = np.full((2 * nodes, d), -np.inf, dtype=coords.dtype)
    for lo, hi in coords.blocks(block_rows):
        x, node = coords.read(lo, hi), _node_block(src, lo, hi)
        v = x[np.arange(hi - lo), axis[node]]
        c = cut[node].astype(v.dtype)
        left = v < c
        eq = np.flatnonzero(v == c)
        if len(eq):  # rank of each tie among its node's ties in row order, carried across blocks
            en = node[eq]
            order = np.argsort(en, kind="stable")
            sn = en[order]
            starts = np.flatnonzero(np.r_[True, sn[1:] != sn[:-1]])
            rank = np.arange(len(sn)) - np.repeat(starts, np.diff(np.r_[starts, len(sn)]))
            rank_of = np.empty(len(eq), np.int64)
            rank_of[order] = rank + taken[sn]
            left[eq] = rank_of < ties[en]
            taken += np.bincount(en, minlength=nodes)
        child = 2 * node + (~left)
        dst.write(lo, child.astype(dst.dtype))
        count += np.bincount(child, minlength=2 * nodes)
        _update_min_max(lo_box, hi_box, child, x)
    return count, lo_box, hi_box


# ------------------------------------------------------------------------------------------------
# out of core: the morton and slab orders (every row sorted by a key) as a sample sort
# ------------------------------------------------------------------------------------------------
_SAMPLES_PER_BUCKET = 32
_ROW_BITS = 40         # rows of one location < 2**40


def sort_keys(x: np.ndarray, method: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint64 keys of a block of points whose ascending order (ties by row) is ``partition()``'s order for
    ``method`` ("morton" or "slab"); ``lo``/``hi``: the bounding box of all points, in their dtype."""
    if method == "morton":
        return morton_codes(x.astype(np.float64), box=(lo.astype(np.float64), hi.astype(np.float64)))
    ax = int(np.argmax(hi - lo))  # np.ptp in the points' dtype, as in memory
    v = x[:, ax].astype(np.float64) + 0.0  # exact; -0.0 becomes 0.0 (they tie in memory too)
    u = v.view(np.uint64)
    return np.where(u >> np.uint64(63), ~u, u | np.uint64(1 << 63))  # float order as unsigned order


@dataclass(frozen=True)
class KeyOrder:
    """Where a sample sort put the rows: ``groups`` (B+1) offsets of the buckets in grouped order (rows of a
    bucket in file order); ``windows``: offsets of runs of whole buckets within which the ``inner``
    permutation (window-local) sorts the grouped rows; ``offsets``: the P+1 parts of the sorted rows."""

    offsets: np.ndarray
    groups: np.ndarray
    windows: np.ndarray


def key_order_streaming(coords, parts: int, method: str, block_rows: int, keys, group_of, perm, grouped,
                        inner) -> KeyOrder:
    """The order ``partition(coords, parts, method)`` makes for "morton"/"slab", found in bounded memory.

    ``coords``: a row array on disk (``read``, ``blocks``, ``n``); ``keys``/``grouped`` (uint64),
    ``group_of``/``perm``/``inner`` (uint32): writable scratch row arrays this fills. A seeded sample of
    the keys gives about 2 rows / block_rows bucket splitters (a splitter is a (key, row) pair, so equal keys
    split too); every row goes to its bucket, buckets are grouped in file order, then each window of whole
    buckets (about a block) is sorted in memory. The splitters change only bucket sizes, never the order:
    it is exactly the stable sort of the keys."""
    check_parts(parts)
    n = coords.n
    (lo,), (hi,) = _boxes(coords, None, 1, block_rows)
    buckets = max(1, -(-2 * n // max(1, block_rows)))
    per_block = max(1, -(-_SAMPLES_PER_BUCKET * buckets * block_rows // max(1, n)))
    rng = np.random.default_rng(0)  # any sample gives the same order; this one is repeatable
    sample_keys, sample_rows = [], []
    for a, b in coords.blocks(block_rows):
        k = sort_keys(coords.read(a, b), method, lo, hi)
        keys.write(a, k)
        pick = np.sort(rng.choice(b - a, min(b - a, per_block), replace=False))
        sample_keys.append(k[pick])
        sample_rows.append(pick + a)
    sk = np.concatenate(sample_keys) if n else np.zeros(0, np.uint64)
    sr = np.concatenate(sample_rows).astype(np.int64) if n else np.zeros(0, np.int64)
    o = np.lexsort((sr, sk))
    at = (np.arange(1, buckets) * len(sk)) // buckets
    split_keys, split_rows = sk[o][at], sr[o][at]
    first_of_key = np.r_[True, split_keys[1:] != split_keys[:-1]] if len(at) else np.zeros(0, bool)
    key_group = np.cumsum(first_of_key)
    split_comp = (key_group << _ROW_BITS) + split_rows  # (key group, row) as one sorted int64
    counts = np.zeros(buckets, np.int64)
    for a, b in keys.blocks(block_rows):
        k = keys.read(a, b)
        g = np.searchsorted(split_keys, k, "left")  # splitters with a smaller key
        tie = np.flatnonzero(g < len(split_keys))
        tie = tie[split_keys[g[tie]] == k[tie]]
        if len(tie):  # equal keys: the splitters of that key whose row is at most this row come before
            rows = np.arange(a, b, dtype=np.int64)[tie]
            g[tie] = np.searchsorted(split_comp, (key_group[g[tie]] << _ROW_BITS) + rows, "right")
        group_of.write(a, g.astype(np.uint32))
        counts += group_perm(g, perm, a, buckets)
    groups = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    group_rows(keys, group_of, perm, groups, grouped, block_rows)
    windows = whole_group_windows(groups, block_rows)
    for a, b in zip(windows[:-1], windows[1:]):
        inner.write(int(a), np.argsort(grouped.read(int(a), int(b)), kind="stable").astype(np.uint32))
    offsets = np.array([q * n // parts for q in range(parts + 1)], dtype=np.int64)
    return KeyOrder(offsets=offsets, groups=groups, windows=windows)


def group_perm(group: np.ndarray, perm, lo: int, groups: int) -> np.ndarray:
    """Write the permutation that sorts one block's rows (starting at row ``lo``) by group, rows of a group
    in file order, into ``perm``; returns the block's count per group."""
    small = group.astype(np.uint16) if groups <= 1 << 16 else group  # radix-sorted when small
    perm.write(lo, np.argsort(small, kind="stable"))
    return np.bincount(group, minlength=groups)


def group_rows(col, group_of, perm, groups: np.ndarray, out, block_rows: int) -> None:
    """Copy ``col`` into ``out`` with the rows of each group together (group g at ``groups[g]``), in file
    order within a group, a block at a time (``perm`` from ``group_perm``)."""
    filled = np.asarray(groups[:-1], dtype=np.int64).copy()  # next free row of each group
    for a, b in col.blocks(block_rows):
        counts = np.bincount(group_of.read(a, b), minlength=len(filled))
        values = col.read(a, b)[perm.read(a, b)]
        starts = np.concatenate([[0], np.cumsum(counts)])
        for q in np.flatnonzero(counts):
            out.write(int(filled[q]), values[starts[q]:starts[q + 1]])
        filled += counts


def whole_group_windows(groups: np.ndarray, block_rows: int) -> np.ndarray:
    """Offsets of consecutive runs of whole groups of at most ``block_rows`` rows (a larger group alone)."""
    cuts = [0]
    for g in range(len(groups) - 1):
        if groups[g + 1] - cuts[-1] > block_rows and groups[g] > cuts[-1]:
            cuts.append(int(groups[g]))
    if cuts[-1] != groups[-1]:
        cuts.append(int(groups[-1]))
    return np.asarray(cuts, dtype=np.int64)
