"""Which rows / hyperslab each rank of a domain reads: pure arithmetic on store metadata, no I/O.

A mesh run's rank r of W reads the rows of parts ``[r*P//W, (r+1)*P//W)`` (``domainflow.layout.shapes``); a grid
is split into balanced slabs along each sharded dim, optionally widened by a halo that wraps around a
periodic dim (longitude on a global grid) and is clipped at a closed one (the poles).
"""

from __future__ import annotations

from dataclasses import dataclass

from domainflow.layout.shapes import balanced_sizes, part_range


def mesh_rows(part_offsets, rank: int, world: int) -> tuple[int, int]:
    """Row range ``[start, stop)`` rank ``rank`` of a ``world``-rank domain reads from a run."""
    parts = len(part_offsets) - 1
    a, b = part_range(rank, world, parts)
    return int(part_offsets[a]), int(part_offsets[b])


@dataclass(frozen=True)
class Slab:
    """A rank's share of one grid dim: its own ``[start, stop)`` plus ``before``/``after`` halo rows, read as
    the index ranges ``reads`` (two ranges when a periodic halo wraps around the edge)."""

    start: int
    stop: int
    before: int
    after: int
    reads: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


def grid_slab(n: int, world: int, rank: int, halo: int = 0, periodic: bool = False) -> Slab:
    """Rank ``rank``'s balanced share of ``n`` rows split ``world`` ways, with ``halo`` rows on each side."""
    if not 0 < world <= n:
        raise ValueError(f"cannot split {n} grid rows over {world} ranks; use at most {n} ranks along this dim")
    if halo < 0:
        raise ValueError(f"halo must be >= 0, got {halo}")
    sizes = balanced_sizes(n, world)
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    if periodic:
        if halo > n:
            raise ValueError(f"a periodic halo of {halo} rows is wider than the whole dim ({n} rows)")
        lo, hi = start - halo, stop + halo
        reads = []
        if lo < 0:
            reads.append((n + lo, n))
        reads.append((max(lo, 0), min(hi, n)))
        if hi > n:
            reads.append((0, hi - n))
        return Slab(start, stop, halo, halo, tuple(reads))
    lo, hi = max(0, start - halo), min(n, stop + halo)
    return Slab(start, stop, start - lo, hi - stop, ((lo, hi),))


def chunks_touched(start: int, stop: int, chunk: int) -> int:
    """How many chunks of length ``chunk`` the row range ``[start, stop)`` touches."""
    if stop <= start:
        return 0
    return (stop - 1) // chunk - start // chunk + 1
