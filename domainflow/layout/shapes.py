"""Shape arithmetic for uneven sharding: pure functions, no tensors moved, no process group needed.

Every layout question (local shapes, offsets, how a view or reduction maps sharded dims, which rows a
resharding moves where) is answered here so it can be tested in one process on many random cases.
A layout is described per mesh dim by ``sizes``: for a mesh dim that shards tensor dim ``d``, the
extent along ``d`` held at each coordinate of that mesh dim (zeros allowed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

Sizes = tuple[int, ...]


def chunk_sizes(n: int, parts: int) -> Sizes:
    """Sizes that ``torch.chunk``/DTensor give when splitting ``n`` into ``parts`` (trailing parts may be 0)."""
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    step = -(-n // parts) if n else 0
    return tuple(max(0, min(step, n - i * step)) for i in range(parts))


def balanced_sizes(n: int, parts: int) -> Sizes:
    """Sizes differing by at most one, larger first (what ``numpy.array_split`` gives)."""
    q, r = divmod(n, parts)
    return tuple(q + (i < r) for i in range(parts))


def offsets(sizes: Sequence[int]) -> Sizes:
    """Start index of each part: exclusive prefix sums."""
    return (0, *accumulate(sizes))[:-1] if sizes else ()


def local_shape(global_shape: Sequence[int], shard_dims: Sequence[int | None],
                dim_sizes: Sequence[Sizes | None], coord: Sequence[int]) -> tuple[int, ...]:
    """Local shape at mesh coordinate ``coord``; ``shard_dims[m]`` is the tensor dim mesh dim m shards."""
    shape = list(global_shape)
    for m, d in enumerate(shard_dims):
        if d is not None:
            shape[d] = dim_sizes[m][coord[m]]
    return tuple(shape)


def local_offsets(ndim: int, shard_dims: Sequence[int | None], dim_sizes: Sequence[Sizes | None],
                  coord: Sequence[int]) -> tuple[int, ...]:
    """Global index of the local chunk's first element along every tensor dim."""
    off = [0] * ndim
    for m, d in enumerate(shard_dims):
        if d is not None:
            off[d] = sum(dim_sizes[m][: coord[m]])
    return tuple(off)


def overlap_splits(src: Sequence[int], dst: Sequence[int]) -> list[list[int]]:
    """``out[i][j]``: rows that part i of layout ``src`` shares with part j of layout ``dst``.

    Both layouts split the same extent into contiguous ranges; this is the send/receive matrix of an
    all-to-all that turns one uneven layout into the other.
    """
    if sum(src) != sum(dst):
        raise ValueError(f"layouts {tuple(src)} and {tuple(dst)} cover different extents")
    so, do = offsets(src), offsets(dst)
    return [
        [max(0, min(so[i] + src[i], do[j] + dst[j]) - max(so[i], do[j])) for j in range(len(dst))]
        for i in range(len(src))
    ]


def slice_sizes(sizes: Sequence[int], start: int, stop: int, step: int) -> tuple[Sizes, Sizes]:
    """Sizes of ``x[start:stop:step]`` on each part and the local start index on each part.

    ``start``/``stop`` must already be clamped to ``[0, n]`` (as aten.slice receives them after
    normalisation here); returns (counts, local_starts).
    """
    counts, starts = [], []
    for off, size in zip(offsets(sizes), sizes):
        lo, hi = max(start, off), min(stop, off + size)
        if hi <= lo:
            counts.append(0)
            starts.append(0)
            continue
        first = start + (-(-(lo - start) // step)) * step  # first selected index >= lo
        n = 0 if first >= hi else (hi - 1 - first) // step + 1
        counts.append(n)
        starts.append(first - off if n else 0)
    return tuple(counts), tuple(starts)


def normalize_slice(n: int, start: int | None, stop: int | None, step: int) -> tuple[int, int, int]:
    """Clamp slice bounds the way Python/aten do for a dim of length ``n``."""
    if step <= 0:
        raise ValueError("slice step must be positive")
    start = 0 if start is None else start
    stop = n if stop is None else stop
    if start < 0:
        start += n
    if stop < 0:
        stop += n
    start = min(max(start, 0), n)
    stop = min(max(stop, start), n)
    return start, stop, step


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """Result shape of broadcasting ``shapes`` together (numpy rules)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, start=ndim - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    raise ValueError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[i] = n
    return tuple(out)


def infer_view_shape(numel: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Resolve a single ``-1`` in a view shape."""
    shape = list(shape)
    if shape.count(-1) > 1:
        raise ValueError(f"only one dimension can be inferred in view shape {tuple(shape)}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        i = shape.index(-1)
        if known == 0 or numel % known:
            raise ValueError(f"view shape {tuple(shape)} is invalid for {numel} elements")
        shape[i] = numel // known
    if math.prod(shape) != numel:
        raise ValueError(f"view shape {tuple(shape)} is invalid for {numel} elements")
    return tuple(shape)


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a reshape into groups of (src dims, dst dims) whose products match.

    Size-1 dims form their own groups so they never glue two real groups together.
    """
    if 0 in src or 0 in dst:
        return [(tuple(range(len(src))), tuple(range(len(dst))))]
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        if i < len(src) and j < len(dst) and src[i] == 1 and dst[j] == 1:
            groups.append(((i,), (j,)))
            i += 1
            j += 1
            continue
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        i += 1
        j += 1
        while a != b:
            if a < b:
                a *= src[i]
                gi.append(i)
                i += 1
            else:
                b *= dst[j]
                gj.append(j)
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def view_shard_map(src: Sequence[int], dst: Sequence[int], dim: int, sizes: Sequence[int]) -> tuple[int, Sizes] | None:
    """Where a reshape ``src -> dst`` takes a tensor sharded on ``dim`` with per-part ``sizes``.

    Returns (dst dim, dst sizes), or None when a rank's rows do not stay one contiguous block of a
    single dst dim (e.g. sharding an inner dim of a flattened group), which needs communication.
    """
    for gi, gj in view_groups(src, dst):
        if dim not in gi:
            continue
        real_i = [d for d in gi if src[d] != 1]
        real_j = [d for d in gj if dst[d] != 1]
        if not real_i or dim != real_i[0]:
            return None  # only the outermost dim of a group keeps rows contiguous
        if not real_j:
            return None
        inner_src = math.prod(src[d] for d in gi if d > dim)
        e = real_j[0]
        inner_dst = math.prod(dst[d] for d in gj if d > e)
        out = []
        for s in sizes:
            total = s * inner_src
            if total % inner_dst:
                return None
            out.append(total // inner_dst)
        return e, tuple(out)
    return None


def reduced_dim_map(ndim: int, dims: Sequence[int] | None, keepdim: bool) -> tuple[frozenset[int], dict[int, int]]:
    """For a reduction over ``dims`` (None: all): the reduced dims and where surviving dims go."""
    red = frozenset(range(ndim)) if dims is None or len(dims) == 0 else frozenset(d % ndim if ndim else 0 for d in dims)
    where, k = {}, 0
    for d in range(ndim):
        if d in red:
            if keepdim:
                k += 1
            continue
        where[d] = k
        k += 1
    return red, where


def part_range(rank: int, world: int, parts: int) -> tuple[int, int]:
    """The spatial parts ``[start, stop)`` that rank ``rank`` of a ``world``-rank domain reads from a
    store partitioned into ``parts`` parts (docs/store-format.md: ``[r*P//W, (r+1)*P//W)``)."""
    if not 0 < world <= parts:
        raise ValueError(f"a store with {parts} spatial parts serves domain sizes 1..{parts}, not {world}; "
                         f"re-ingest with more parts (--parts) or use a smaller domain")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a domain of {world} ranks")
    return rank * parts // world, (rank + 1) * parts // world


def rows_per_rank(part_offsets: Sequence[int], world: int) -> Sizes:
    """Rows each rank of a ``world``-rank domain holds, from the store's part offsets (P+1 values):
    the sharding sizes of a sample, known without communication."""
    parts = len(part_offsets) - 1
    out = []
    for r in range(world):
        a, b = part_range(r, world, parts)
        out.append(int(part_offsets[b]) - int(part_offsets[a]))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# sliding windows (convolution, pooling) along a sharded dim, and row fetches for halos
# --------------------------------------------------------------------------------------------
def window_out_len(n: int, kernel: int, stride: int, dilation: int, pad_lo: int, pad_hi: int,
                   ceil_mode: bool = False) -> int:
    """Output length of a sliding window over ``n`` rows, torch's rule (ceil mode: the last window must
    start inside the input or the left padding)."""
    span = dilation * (kernel - 1) + 1
    room = n + pad_lo + pad_hi - span
    if room < 0:
        return 0
    out = (-(-room // stride) if ceil_mode else room // stride) + 1
    if ceil_mode and (out - 1) * stride >= n + pad_lo:
        out -= 1
    return out


@dataclass(frozen=True)
class WindowPlan:
    """A sliding window over a dim sharded in ``sizes``: rank r computes outputs ``out_sizes[r]`` (starting
    at ``out_offsets[r]``) from input rows ``need[r] = [lo, hi)`` (global; rows outside ``[0, n)`` are
    padding)."""

    out_sizes: Sizes
    out_offsets: Sizes
    need: tuple[tuple[int, int], ...]


def window_plan(sizes: Sequence[int], kernel: int, stride: int, dilation: int, pad_lo: int, pad_hi: int,
                ceil_mode: bool = False) -> WindowPlan:
    """Assign each output of a window op to the rank holding its window's centre row (clamped into the
    input), so stride-1 "same" windows keep the input layout and strided ones shrink it evenly; each rank
    then needs the input rows its windows span."""
    n = sum(sizes)
    n_out = window_out_len(n, kernel, stride, dilation, pad_lo, pad_hi, ceil_mode)
    span = dilation * (kernel - 1) + 1
    bounds = _bounds(sizes)
    counts = [0] * len(sizes)
    for o in range(n_out):
        c = min(max(o * stride - pad_lo + (span - 1) // 2, 0), n - 1)
        r = _owner(bounds, c)
        counts[r] += 1
    out_offsets = offsets(counts)
    need = []
    for r, k in enumerate(counts):
        if k == 0:
            need.append((0, 0))
            continue
        first, last = out_offsets[r], out_offsets[r] + k - 1
        need.append((first * stride - pad_lo, last * stride - pad_lo + span))
    return WindowPlan(tuple(counts), tuple(out_offsets), tuple(need))


def _bounds(sizes: Sequence[int]) -> Sizes:
    """Part boundaries: ``len(sizes) + 1`` inclusive prefix sums starting at 0."""
    return (0, *accumulate(sizes))


def _owner(bounds: Sequence[int], row: int) -> int:
    """The rank whose rows ``[bounds[r], bounds[r+1])`` hold ``row`` (the last such, skipping empty ranks)."""
    lo, hi = 0, len(bounds) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bounds[mid] <= row:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pad_index(g: int, n: int, mode: str) -> int:
    """The input row that padding row ``g`` (outside ``[0, n)``) copies, or -1 for a constant (zeros)."""
    if 0 <= g < n:
        return g
    if mode in ("constant", "zeros"):
        return -1
    if mode == "circular":
        return g % n
    if mode == "replicate":
        return 0 if g < 0 else n - 1
    if mode == "reflect":
        r = -g if g < 0 else 2 * (n - 1) - g
        if not 0 <= r < n:
            raise ValueError(f"reflect padding of {abs(g) if g < 0 else g - n + 1} rows needs more than the {n} "
                             f"rows of the dim")
        return r
    raise ValueError(f"unknown padding mode {mode!r}")


@dataclass(frozen=True)
class RowFetch:
    """Where the rows a rank asked for come from: ``own`` (positions, local rows) it copies itself,
    ``recv[src]`` positions filled from rank src, ``send[dst]`` local rows it sends to rank dst; positions
    not listed stay zero; ``trades``: whether any rank of the fetch gets a row from another (the same on every
    rank: a fetch in which no rank trades needs no exchange at all)."""

    length: int
    own: tuple[tuple[int, ...], tuple[int, ...]]
    recv: dict
    send: dict
    trades: bool = True

    # what every exchange with this plan needs, worked out once per plan (plans are cached)
    @functools.cached_property
    def own_runs(self) -> tuple[tuple[int, int, int], ...]:
        """(position, local row, length) runs of the own rows: copied as slices."""
        return tuple(tuple(r) for r in index_runs(*self.own))

    @functools.cached_property
    def unfilled(self) -> tuple[int, ...]:
        """Positions no own or received row fills (zero rows)."""
        filled = set(self.own[0])
        for v in self.recv.values():
            filled.update(v)
        return tuple(p for p in range(self.length) if p not in filled)

    @functools.cached_property
    def identity_len(self) -> int:
        """n when the fetch asks for exactly this rank's own n rows in order (nothing moves), else -1."""
        pos, rows = self.own
        n = len(pos)
        ok = (not self.recv and not self.send and self.length == n and pos == tuple(range(n))
              and rows == tuple(range(n)))
        return n if ok else -1

    @functools.cached_property
    def covers_len(self) -> int:
        """n when the own rows are the block's n rows in order at consecutive positions, else -1."""
        pos, rows = self.own
        n = len(pos)
        ok = n > 0 and rows == tuple(range(n)) and pos == tuple(range(pos[0], pos[0] + n))
        return n if ok else -1


def index_runs(positions, rows) -> list[list[int]]:
    """[pos, row, length] runs where consecutive positions take consecutive rows (copied as slices)."""
    out = []
    for p, r in zip(positions, rows):
        if out and p == out[-1][0] + out[-1][2] and r == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([p, r, 1])
    return out


def row_fetch_plan(sizes: Sequence[int], wanted: Sequence[Sequence[int]], me: int) -> RowFetch:
    """Rank ``me``'s part of a fetch in which rank r wants global rows ``wanted[r]`` (-1: a zero row)."""
    bounds = _bounds(sizes)
    own_pos, own_rows, recv, send = [], [], {}, {}
    for p, g in enumerate(wanted[me]):
        if g < 0:
            continue
        o = _owner(bounds, g)
        if o == me:
            own_pos.append(p)
            own_rows.append(g - bounds[me])
        else:
            recv.setdefault(o, []).append(p)
    for r, rows in enumerate(wanted):
        if r == me:
            continue
        mine = [g - bounds[me] for g in rows if g >= 0 and _owner(bounds, g) == me]
        if mine:
            send[r] = tuple(mine)
    trades = any(g >= 0 and _owner(bounds, g) != r for r, rows in enumerate(wanted) for g in rows)
    return RowFetch(len(wanted[me]), (tuple(own_pos), tuple(own_rows)), {k: tuple(v) for k, v in recv.items()}, send,
                    trades)


def diagonal_runs(sizes: Sequence[int], rows: int, cols: int, offset: int, sharded_rows: bool) -> tuple[Sizes, Sizes]:
    """(how many diagonal elements each part holds, each part's diagonal offset within its chunk) for the
    diagonal ``offset`` of a ``rows`` x ``cols`` matrix whose rows (``sharded_rows``) or columns are split in
    ``sizes``: each part holds one contiguous run of the diagonal, in part order."""
    first, last = max(0, -offset), min(rows, cols - offset)  # the diagonal's row range [first, last)
    counts, local = [], []
    for lo, n in zip(offsets(sizes), sizes):
        if sharded_rows:  # rows [lo, lo + n)
            counts.append(max(0, min(lo + n, last) - max(lo, first)))
            local.append(offset + lo)
        else:  # columns [lo, lo + n): rows [lo - offset, lo + n - offset)
            counts.append(max(0, min(lo + n - offset, last) - max(lo - offset, first)))
            local.append(offset - lo)
    return tuple(counts), tuple(local)
