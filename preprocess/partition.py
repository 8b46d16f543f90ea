"""Spatial partitioning of mesh points into P contiguous, compact parts.

A partition reorders the rows of a run so that each of P parts is one contiguous row range; a rank of a
W-rank domain then reads parts ``[r*P//W, (r+1)*P//W)`` (``domainflow.shapes.part_range``), one
contiguous, spatially compact slab of rows. P is a power of two so that every power-of-two domain size
gets whole subtrees of the bisection.

Methods:
- ``rcb`` (default): recursive coordinate bisection. Split the points at the median of the longest
  side of their bounding box, recurse on both halves, log2(P) levels. Parts differ in size by at most
  one row per level and are compact boxes.
- ``morton``: sort by Z-order (Morton) code of the coordinates quantised to 21 bits per axis, then cut
  into P equal row counts. Cheaper; parts are compact but can be L-shaped.
- ``slab``: sort along one axis (the longest extent unless given) and cut into P equal row counts.

All methods are deterministic: ties are broken by the original row index (stable sorts).
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
    pts = np.asarray(points, dtype=np.float64)
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
            key_order = np.argsort(morton_codes(pts), kind="stable")
        else:
            ax = int(np.argmax(np.ptp(pts, axis=0))) if axis is None and n else (axis or 0)
            key_order = np.argsort(pts[:, ax], kind="stable")
        order = key_order.astype(np.int64)
        offsets = np.array([k * n // parts for k in range(parts + 1)], dtype=np.int64)
    return Partition(order=order, offsets=offsets, boxes=part_boxes(pts[order], offsets))


def _rcb(pts: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    segments = [np.arange(len(pts), dtype=np.int64)]
    while len(segments) < parts:
        nxt = []
        for idx in segments:
            if len(idx) == 0:
                nxt += [idx, idx]
                continue
            sub = pts[idx]
            ax = int(np.argmax(sub.max(axis=0) - sub.min(axis=0)))
            srt = idx[np.argsort(sub[:, ax], kind="stable")]
            half = (len(srt) + 1) // 2
            nxt += [srt[:half], srt[half:]]
        segments = nxt
    order = np.concatenate(segments) if segments else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in segments])]).astype(np.int64)
    return order, offsets


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
    for k in range(parts):
        a, b = offsets[k], offsets[k + 1]
        if b > a:
            boxes[k, 0] = sorted_pts[a:b].min(axis=0)
            boxes[k, 1] = sorted_pts[a:b].max(axis=0)
    return boxes
