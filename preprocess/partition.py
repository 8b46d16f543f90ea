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
their original (file) order.
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


def morton_codes(pts: np.ndarray, bits: int = 21) -> np.ndarray:
    """Z-order codes of points quantised to ``bits`` bits per axis within their bounding box."""
    n, d = pts.shape
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    lo, hi = pts.min(axis=0), pts.max(axis=0)
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
