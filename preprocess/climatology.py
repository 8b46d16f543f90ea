"""Per-gridpoint climatology of a grid store's train split, by day of year and hour of day, as WeatherBench 2
computes it: for each (day of year, hour of day, channel, grid point) the mean over the train steps of that
hour whose day of year lies within a window of days around it (61 by default, wrapping around the year).
It is the reference of anomalies (ACC) and the climatology forecast of the evaluation.

Stored next to ``data`` as ``climatology (366, S, C, H, W)``, S the hours of day the time axis holds, chunked
by ``data``'s spatial tiles and as many days as make about 1 MiB. Entries no train step reaches (a short series covers a few seasons only) take the
train mean of their hour of day and are counted in the array's ``filled`` attribute, so an evaluation can say
how much of its climatology is seasonal. A store whose time axis has no dates gets one entry (366 = S = 1):
the train mean per grid point.

One task per channel and band of latitude rows (whole tiles, so no two tasks write one chunk): it streams
the band's train steps from ``data`` and keeps the sums per (day of year, hour) in memory.
"""

from __future__ import annotations

import numpy as np

from domainflow.store.chunks import read_checked
from domainflow.store.climatology_index import DAYS, day_and_slot

CLIMATOLOGY_WINDOW = 61       # days, as WeatherBench 2's climatology
TASK_BYTES = 256 << 20        # float64 sums a task may hold


def bands(H: int, hc: int, W: int, slots: int, budget: int = TASK_BYTES) -> list[tuple[int, int]]:
    """Latitude row bands of whole tiles (``hc`` rows each) whose sums fit ``budget`` bytes."""
    per_row = DAYS * max(slots, 1) * W * 8 * 2  # sums and their windowed copy
    tiles = max(1, budget // max(per_row * hc, 1))
    step = tiles * hc
    return [(a, min(a + step, H)) for a in range(0, H, step)]


def climatology_band(store: str, channel: int, r0: int, r1: int, train_ranges, window: int, hour: int | None = None,
                     block: int = 64) -> dict:
    """Compute and write ``climatology[:, :, channel, r0:r1, :]`` from the steps of ``train_ranges`` (a dask
    task; the days and hours come from the store's own time axis). ``hour``: that hour slot's entries only, from its
    steps only (its sums are 1/hours of all of them: an hourly 0.25-degree series needs 34 GiB for a band's
    sums of every hour, 1.4 GiB for one hour's); None: every hour (stores whose chunks hold every hour)."""
    import zarr

    from .splits import time_mask
    from .store_writer import for_writing

    root = zarr.open_group(store, mode="r+")
    data, out = root["data"], for_writing(root["climatology"])
    time = root["time"]
    day, slot, hours = day_and_slot(read_checked(store, time), dict(time.attrs))  # a damaged chunk: named
    train = time_mask(train_ranges, data.shape[0])
    W = data.shape[3]
    dated = out.shape[0] == DAYS
    S = max(len(hours), 1) if hour is None else 1
    sums = np.zeros((DAYS if dated else 1, S, r1 - r0, W), np.float64)
    counts = np.zeros((DAYS if dated else 1, S), np.int64)
    steps = np.flatnonzero(train)
    mine = steps if hour is None else steps[slot[steps] == hour]
    for a in range(0, len(mine), block):  # contiguous stretches of train steps, a block at a time
        idx = mine[a:a + block]
        values = _band(store, data, idx, channel, r0, r1)
        d = day[idx] if dated else np.zeros(len(idx), np.int64)
        np.add.at(sums, (d, slot[idx] if hour is None else 0), values)
        np.add.at(counts, (d, slot[idx] if hour is None else 0), 1)
    if dated:
        sums, counts = _windowed(sums, window), _windowed(counts, window)
    per_slot = sums.sum(0) / np.maximum(counts.sum(0), 1)[:, None, None]   # the train mean of each hour
    if (counts.sum(0) == 0).any():  # an hour no train step has: the train mean of every hour
        if hour is None:
            overall = sums.sum((0, 1)) / max(int(counts.sum()), 1)
        else:
            overall = np.zeros((r1 - r0, W), np.float64)
            for a in range(0, len(steps), block):
                overall += _band(store, data, steps[a:a + block], channel, r0, r1).sum(0)
            overall /= max(len(steps), 1)
        per_slot[counts.sum(0) == 0] = overall
    empty = counts == 0
    clim = np.where(empty[:, :, None, None], per_slot[None], sums / np.maximum(counts, 1)[:, :, None, None])
    hours_out = slice(None) if hour is None else slice(hour, hour + 1)
    out[:, hours_out, channel, r0:r1, :] = clim.astype(np.float32)
    return {"channel": channel, "rows": [r0, r1], "filled": int(empty.sum())}


def _band(store, data, idx, channel: int, r0: int, r1: int) -> np.ndarray:
    """Steps ``idx`` of one channel's rows ``[r0, r1)`` as float64."""
    return read_checked(store, data, (idx, channel, slice(r0, r1), slice(None)), orthogonal=True).astype(np.float64)


def _windowed(x: np.ndarray, window: int) -> np.ndarray:
    """Sums over ``window`` days centred on each day of year (axis 0), wrapping around the year."""
    half = window // 2
    if half <= 0:
        return x
    if 2 * half + 1 >= x.shape[0]:
        return np.broadcast_to(x.sum(0, keepdims=True), x.shape).copy()
    padded = np.concatenate([x[-half:], x, x[:half]], axis=0)
    c = np.cumsum(padded, axis=0, dtype=np.float64 if x.dtype.kind == "f" else np.int64)
    c = np.concatenate([np.zeros_like(c[:1]), c], axis=0)
    return c[2 * half + 1:] - c[:-(2 * half + 1)]
