"""``domainflow ingest climate SOURCE... STORE``: climate data -> a grid store of spatial chunks.

Sources (``climate_source.py``, the one reader of them, through xarray so that CF decoding is xarray's own):
netCDF files as ERA5 is downloaded (one file per month, a folder, a glob; single-level and pressure-level
downloads side by side), GRIB with the ``grib`` extra, or an analysis-ready Zarr (v2 as xarray writes it, with
``_ARRAY_DIMENSIONS``, or v3 with ``dimension_names``). Pressure-level variables become one channel per
level (``z500``, chosen with ``--levels``). Sources are usually chunked along time with whole maps per
chunk, which makes a lat/lon hyperslab read the whole map. Ingest re-chunks into ``data (T, C, H, W)``
with one chunk per time step, channel and spatial tile of about 1 MiB, so each rank of a domain-parallel
reader touches only the tiles of its own region.

One dask task per time block (inside one file of each group of files, and aligned to a Zarr source's time
chunks): read the block of every channel, refuse NaN/Inf (naming the date and the grid point), write whole
output chunks, and drop a marker holding the block's statistics over the train steps it contains. A rerun
skips blocks with markers; the coordinator merges the statistics in time order (so 1 or N workers give
identical stores) and marks the store complete last.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from domainflow import remote
from domainflow.store import time_axis
from domainflow.store.chunks import read_checked
from domainflow.store.climatology_index import DAYS, day_and_slot

from .climate_source import ClimateSource, SourceReader, open_source, read_static

from .climatology import CLIMATOLOGY_WINDOW, bands, climatology_band
from .errors import IngestError, RunError
from .missing_values import EXAMPLE as FILL_EXAMPLE
from .missing_values import fill_block, fill_value, first_missing, parse_fill, policies
from .parallel import count_cells, peak_memory, reset_peak_memory, run_tasks
from .report import IngestReport
from .splits import check_fractions, read_split_file, split_times, time_mask
from .stats import RunningStats, merge_all
from .store_writer import TARGET_CHUNK_BYTES, StoreWriter, create_array, for_writing


@dataclass
class GridOptions:
    variables: tuple[str, ...] | None = None
    levels: tuple[float, ...] | None = None
    climatology_window: int = CLIMATOLOGY_WINDOW
    fill: dict | str | None = None       # missing values: None (refuse), "mean", a number, or per variable
    static: tuple[str, ...] | None = None  # constant fields (land-sea mask, orography) kept as input channels
    member: float | None = None          # the ensemble member kept (its number), for a source that holds one
    time_block: int | None = None
    chunk_bytes: int = TARGET_CHUNK_BYTES
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    split_file: str | None = None
    workers: int = 1
    scheduler: str | None = None
    overwrite: bool = False
    staging: str | None = None  # a store at a URL is built here first, then uploaded (remote_upload.py)
    progress: bool = True

    def validate(self):
        self.split = check_fractions(self.split)
        if self.time_block is not None and self.time_block < 1:
            raise IngestError(f"--time-block must be at least 1, got {self.time_block}")
        if self.chunk_bytes < 64:
            raise IngestError(f"--chunk-bytes must be at least 64 (default 1 MiB), got {self.chunk_bytes}")
        if self.workers < 1:
            raise IngestError(f"--workers must be at least 1, got {self.workers}")
        if self.variables is not None and len(set(self.variables)) != len(self.variables):
            raise IngestError(f"--variables names a variable more than once: {list(self.variables)}")
        if self.climatology_window < 1:
            raise IngestError(f"--climatology-window must be at least 1 day, got {self.climatology_window}")
        self.fill = parse_fill(self.fill)
        if self.levels is not None and len(set(self.levels)) != len(self.levels):
            raise IngestError(f"--levels names a level more than once: {list(self.levels)}")


def spatial_tile(H: int, W: int, itemsize: int, target: int) -> tuple[int, int]:
    """A tile (hc, wc) of about ``target`` bytes with the grid's aspect ratio, so a rank's lat or lat x lon
    region reads little beyond itself."""
    elems = max(1, target // itemsize)
    if H * W <= elems:
        return H, W
    scale = math.sqrt(elems / (H * W))
    hc = min(H, max(1, int(H * scale)))
    wc = min(W, max(1, elems // hc))
    hc = min(H, max(1, elems // wc))  # never above the target unless one row of one column is
    return hc, wc


def ingest_block(reader: SourceReader, store: str, shown: str, t0: int, t1: int, train: list) -> dict:
    """Copy time steps ``[t0, t1)`` of every channel into ``data`` and mark the block done (a dask task).
    Missing values (NaN after decoding) are written as NaN and counted; the coordinator refuses or fills them
    once it knows the whole source's count (``missing_values.py``). Inf is refused here."""
    import zarr

    start, rss0 = time.perf_counter(), reset_peak_memory()
    name = f"{t0:09d}-{t1:09d}"
    root = zarr.open_group(store, mode="r+")
    out = for_writing(root["data"])
    # xarray's CF decoding: fill / missing values -> NaN, scale_factor / add_offset undone
    values, fills = reader.read_block(t0, t1)
    with np.errstate(over="ignore"):  # values beyond float32 become inf and are reported below
        block = values.astype(np.float32)
    del values
    missing = {}
    for c, channel in enumerate(reader.channels):
        inf = np.isinf(block[:, c])
        if inf.any():
            raise RunError(f"time block {t0}..{t1}", f"{shown}: " + _where(
                store, root, channel, int(inf.sum()), [int(v[0]) + t0 if k == 0 else int(v[0])
                                                       for k, v in enumerate(np.nonzero(inf))],
                "infinite values or values beyond float32") + "; fix them before ingest")
        count, first = first_missing(block[:, c])
        if count:
            missing[channel.name] = {"count": count, "first": [first[0] + t0, first[1], first[2]],
                                     "keys": fills[c]}
    out[t0:t1] = block
    count_cells(block.shape[0] * block.shape[2] * block.shape[3])  # grid points x time steps, for the bar
    mask = time_mask(train, out.shape[0])[t0:t1]
    stats = {}
    for k, c in enumerate(reader.channels):
        v = block[mask, k].reshape(-1)
        stats[c.name] = RunningStats.of(v[~np.isnan(v)] if c.name in missing else v).to_attrs()
    info = {"block": [t0, t1], "stats": stats, "missing": missing}
    StoreWriter(store).mark_block(name, info)
    return {**info, "name": name, "cells": {"grid": int(block.size)}, "raw_bytes": int(block.nbytes),
            "seconds": time.perf_counter() - start,
            "peak_rss": peak_memory(), "start_rss": rss0}


def _where(store, root, channel, count: int, first, what: str) -> str:
    """``variable 'x' holds N <what> (first at time index k (date), latitude .., longitude ..)``; the
    coordinates are read back from ``store`` (a damaged chunk of them is named)."""
    step, i, j = first
    name = f"variable {channel.variable!r}" + (f" at {channel.hpa:g} hPa" if channel.hpa is not None else "")
    when = _date(store, root["time"], step)
    lat, lon = float(read_checked(store, root["lat"], i)), float(read_checked(store, root["lon"], j))
    return (f"{name} holds {count} {what} (first at time index {step}{f' ({when})' if when else ''}, "
            f"latitude {lat:g}, longitude {lon:g})")


def _read_as_missing(keys) -> str:
    """`` (values equal to its _FillValue -32767 read as missing)`` for each mask key xarray applied."""
    return "".join(f" (values equal to its {k} {x} read as missing)" for k, x in keys)


def _date(store, time_array, k: int) -> str | None:
    """Time step ``k`` of the store as a date, when its units say how."""
    dates = time_axis.decode(read_checked(store, time_array, slice(k, k + 1)), dict(time_array.attrs))
    return None if dates is None else time_axis.label(dates[0])


def ingest_climate(raw, store, opts: GridOptions | None = None, **kw):
    """Ingest climate data (``raw``: a Zarr store, or netCDF / GRIB files, folders or globs; one or a list)
    into the grid store ``store`` (resuming if partial)."""

    opts = opts or GridOptions(**kw)
    if remote.is_url(store):  # built locally, then uploaded with its root metadata last
        from .remote_upload import ingest_to_url

        return ingest_to_url(ingest_climate, raw, str(store), opts)
    opts.validate()
    t0 = time.perf_counter()
    items = [raw] if isinstance(raw, (str, Path)) else list(raw)
    src = open_source(items, opts.variables, opts.levels, opts.static, opts.member)
    T, H, W = src.shape
    C = len(src.channels)
    # default: the source's time chunks for a Zarr (each task decodes whole source chunks), a file's steps for
    # netCDF; capped so that one task's block stays below ~512 MiB when a source stores a long series at once
    block = opts.time_block or max(1, min(src.time_chunk, (512 << 20) // (4 * C * H * W)))
    splits = split_times(T, opts.split, opts.split_file)
    hc, wc = spatial_tile(H, W, 4, opts.chunk_bytes)
    files = sorted({f.path for group in src.reader.groups for f in group})
    source = files[0] if len(files) == 1 else os.path.commonpath([str(Path(f).resolve()) for f in files])
    fill = policies(opts.fill, [*src.reader.channels, *src.statics])
    config = {"variables": src.channels, "time_block": block, "chunk_bytes": opts.chunk_bytes,
              "climatology_window": opts.climatology_window,
              "split": list(opts.split), "split_file": read_split_file(opts.split_file), "shape": [T, H, W]}
    if len(files) > 1:
        config["files"] = [os.path.relpath(Path(f).resolve(), source) for f in files]
    if opts.levels:
        config["levels"] = sorted(float(x) for x in opts.levels)
    if fill:
        config["fill"] = fill
    if src.statics:
        config["static"] = [f.name for f in src.statics]
    if opts.member is not None:
        config["member"] = float(opts.member)
    with StoreWriter(store) as writer:  # holds the store's writer lock until the end
        return _ingest_blocks(writer, Path(source).resolve(), Path(store).resolve(), src, opts, block, splits,
                              (hc, wc), config, t0, fill)


def _ingest_blocks(writer: StoreWriter, source: Path, store: Path, src: ClimateSource, opts: GridOptions,
                   block: int, splits: dict, tile: tuple[int, int], config: dict, t0: float,
                   fill: dict) -> IngestReport:
    """The locked part of :func:`ingest_climate`: open or resume, run the block tasks, fill or refuse missing
    values, write the climatology, complete."""
    import zarr

    T, H, W = src.shape
    hc, wc = tile
    channels = src.channels
    # a store refused for its missing values resumes with a --fill: the blocks hold NaN whatever the policy
    state = writer.open("grid", str(source), None, config, overwrite=opts.overwrite, resumable=("fill",))
    report = IngestReport(store=store, state=state)
    if state == "complete":
        report.seconds = time.perf_counter() - t0
        return report
    root = zarr.open_group(store, mode="r+")
    # coordinates first, data last; a resume writes the (small) coordinates again, since a kill may have come
    # between creating one and writing it
    for name, values, attrs in (("lat", src.lat, {"units": "degrees_north"}),
                                ("lon", src.lon, {"units": "degrees_east"}),
                                ("time", src.time, src.time_attrs)):
        arr = root[name] if name in root else create_array(
            root, name, shape=values.shape, dtype=values.dtype, chunks=values.shape, dimension_names=[name],
            attributes=attrs)
        for_writing(arr)[...] = values
    static_stats, static_missing = _statics(root, src, fill, tile)
    if "data" not in root:
        create_array(root, "data", shape=(T, len(channels), H, W), chunks=(1, 1, hc, wc), dtype="float32",
                     dimension_names=["time", "channel", "lat", "lon"])
    done = writer.finished_blocks()
    blocks = [(a, min(a + block, b)) for s, b in src.reader.spans() for a in range(s, b, block)]
    names = {f"{a:09d}-{b:09d}": (a, b) for a, b in blocks}
    report.kept = [n for n in names if n in done]
    shown = src.shown
    todo = [(src.reader, str(store), shown, a, b, splits["train"]) for n, (a, b) in names.items() if n not in done]
    summaries = dict(done)
    try:
        for out in run_tasks(ingest_block, todo, workers=opts.workers, scheduler=opts.scheduler,
                             desc=f"ingest {Path(shown.split(' ')[0]).name}", progress=opts.progress,
                             unit="step", weights=[t[4] - t[3] for t in todo]):
            report.tasks.append(out)
            report.written.append(out["name"])
            summaries[out["name"]] = out
    finally:
        report.seconds = time.perf_counter() - t0
    stats = {}
    for v in channels:
        merged = merge_all(RunningStats.from_attrs(summaries[n]["stats"][v]) for n in names)
        if not merged.count:
            raise IngestError(f"{shown}: channel {v!r} has no valid value in the train split (all missing); "
                              f"leave it out with --variables")
        stats[f"grid/{v}"] = merged.to_attrs()
    missing = _missing_values(writer, root, store, src, opts, fill, stats, [summaries[n] for n in names], done,
                              report)
    missing.update(static_missing)
    stats.update(static_stats)
    climatology = _climatology(writer, root, store, src, opts, splits, (hc, wc), done, report)
    fields = {}
    for c, v in enumerate(channels):
        a = src.channel_attrs.get(v, {})
        fields[f"grid/{v}"] = {"location": "grid", "components": 1, "channel": c, "units": str(a.get("units", "")),
                               "long_name": str(a.get("long_name", v))}
        if "level_hpa" in a:
            fields[f"grid/{v}"]["level_hpa"] = a["level_hpa"]
        if "source_variable" in a:
            fields[f"grid/{v}"]["source_variable"] = a["source_variable"]
        if "GRIB_stepType" in a:  # instant, accum, avg, max...: what a value of the field is
            fields[f"grid/{v}"]["step_type"] = str(a["GRIB_stepType"])
    for k, f in enumerate(src.statics):
        fields[f"static/{f.name}"] = {"location": "static", "components": 1, "channel": k,
                                      "units": str(f.attrs.get("units", "")),
                                      "long_name": str(f.attrs.get("long_name", f.name))}
    writer.complete({"fields": fields, "stats": stats, "splits": splits,
                     "grid": {"variables": channels, "shape": [T, H, W], "tile": [hc, wc],
                              "periodic_lon": _periodic(src.lon), "levels": src.levels,
                              "source": {"kind": src.reader.kind, "files": src.files,
                                         **({"member": opts.member} if opts.member is not None else {})},
                              "missing": missing,
                              "static": [f.name for f in src.statics],
                              "climatology": climatology}})
    report.seconds = time.perf_counter() - t0
    return report


def _statics(root, src: ClimateSource, fill: dict, tile: tuple[int, int]) -> tuple[dict, dict]:
    """Write ``static (S, H, W)``, the ``--static`` fields (missing values refused or filled like a channel's,
    from the map's own valid values); returns their statistics and filled counts. Small and idempotent: a
    resume writes it again."""
    if not src.statics:
        return {}, {}
    T, H, W = src.shape
    maps, stats, missing = np.empty((len(src.statics), H, W), np.float32), {}, {}
    for k, f in enumerate(src.statics):
        values, keys = read_static(f, src.reader.kind, src.reader.dims, src.reader.member)
        with np.errstate(over="ignore"):
            m = values.astype(np.float32)
        inf = np.isinf(m)
        if inf.any():
            raise IngestError(f"--static {f.name}: {int(inf.sum())} infinite values or values beyond float32 (first "
                              f"at latitude {src.lat[np.nonzero(inf)[0][0]]:g}); fix them before ingest")
        count, first = first_missing(m[None])
        valid = m[~np.isnan(m)]
        if count and f.name not in fill:
            raise IngestError(f"--static {f.name}: {count} missing values (first at latitude {src.lat[first[1]]:g}, "
                              f"longitude {src.lon[first[2]]:g})"
                              + _read_as_missing(keys)
                              + f"; fill them with a policy the store records ({FILL_EXAMPLE})")
        if not valid.size:
            raise IngestError(f"--static {f.name}: every value is missing")
        st = RunningStats.of(valid.reshape(-1))
        if count:
            v = fill_value(fill[f.name], st.mean[0])
            m[np.isnan(m)] = v
            missing[f.name] = {"count": count, "policy": "mean" if fill[f.name] == "mean" else "value", "value": v}
        maps[k] = m
        stats[f"static/{f.name}"] = st.to_attrs()
    hc, wc = tile
    arr = root["static"] if "static" in root else create_array(
        root, "static", shape=maps.shape, dtype="float32", chunks=(1, hc, wc),
        dimension_names=["static", "lat", "lon"])
    for_writing(arr)[...] = maps
    return stats, missing


def _missing_values(writer: StoreWriter, root, store: Path, src: ClimateSource, opts: GridOptions, fill: dict,
                    stats: dict, blocks: list, done: dict, report: IngestReport) -> dict:
    """Refuse the channels with missing values and no ``--fill`` policy (every one named, with its count over
    the whole source and its first place), or fill them block by block (resumable tasks ``fill-<block>``).
    Returns ``grid.missing``: {channel: {"count", "policy", "value"}} of the channels filled."""
    totals: dict = {}
    for info in blocks:  # in time order: the first block with gaps holds a channel's first one
        for name, m in info.get("missing", {}).items():
            t = totals.setdefault(name, {"count": 0, "first": m["first"], "keys": m["keys"]})
            t["count"] += m["count"]
    refused = [c for c in src.reader.channels if c.name in totals and c.name not in fill]
    if refused:
        parts = [_where(store, root, c, totals[c.name]["count"], totals[c.name]["first"], "missing values")
                 + _read_as_missing(totals[c.name]["keys"])
                 for c in refused]
        raise IngestError(f"{src.shown}: " + "; ".join(parts) + f". Fill them with a policy the store records "
                          f"({FILL_EXAMPLE}; rerunning keeps the blocks written), or fill or mask them before ingest")
    values = {c: fill_value(fill[c.name], stats[f"grid/{c.name}"]["mean"][0])
              for c in src.reader.channels if c.name in totals}
    by_index = {str(k): values[c] for k, c in enumerate(src.reader.channels) if c in values}
    # where the values were missing, per filled channel and step (scores leave those points out): written by
    # every block's task, each chunk a time step's tile, so no two tasks share a chunk
    mask_of = {k: f for f, k in enumerate(by_index)}
    if by_index and "missing" not in root:
        T, H, W = src.shape
        create_array(root, "missing", shape=(T, len(by_index), H, W), chunks=(1, 1, *root["data"].chunks[2:]),
                     dtype="bool", dimension_names=["time", "channel", "lat", "lon"],
                     attributes={"channels": [src.reader.channels[int(k)].name for k in by_index]})
    tasks = {}
    for info in blocks:
        t0, t1 = info["block"]
        if by_index:
            tasks[f"fill-{t0:09d}-{t1:09d}"] = (str(store), t0, t1, by_index, mask_of)
    # the values are fixed before the first fill task starts: a task killed mid-way has filled some chunks
    # already, so a rerun with other values would mix two fills in one channel
    fixed = done.get("fill-values") or done.get("fill-plan")  # its name in stores begun before issue 36
    if fixed is not None and fixed["fill"] != by_index:
        raise IngestError(f"{store} was being filled with {fixed['fill']} (channel index: value) and this ingest "
                          f"asks {by_index}; rerun with the first --fill, or pass --overwrite to start again")
    if tasks and fixed is None:
        StoreWriter(store).mark_block("fill-values", {"fill": by_index})
    todo = [(n, *args) for n, args in tasks.items() if n not in done]
    for out in run_tasks(fill_task, todo, workers=opts.workers, scheduler=opts.scheduler, desc="fill",
                         progress=opts.progress):
        report.tasks.append(out)
    return {c.name: {"count": totals[c.name]["count"], "policy": "mean" if fill[c.name] == "mean" else "value",
                     "value": v, "mask": "missing"} for c, v in values.items()}


def fill_task(name: str, store: str, t0: int, t1: int, values: dict, mask_of: dict | None = None) -> dict:
    """Fill one block's missing values, recording where in the store's mask, and mark it filled (a dask task)."""
    start, rss0 = time.perf_counter(), reset_peak_memory()
    filled = fill_block(store, t0, t1, values, mask_of)
    StoreWriter(store).mark_block(name, {"fill": values})
    return {"name": name, "filled": filled, "seconds": time.perf_counter() - start, "cells": {}, "raw_bytes": 0,
            "peak_rss": peak_memory(), "start_rss": rss0}


def _climatology(writer: StoreWriter, root, store: Path, src: ClimateSource, opts: GridOptions, splits: dict,
                 tile: tuple[int, int], done: dict, report: IngestReport) -> dict:
    """Write the train split's climatology (``climatology.py``): one task per channel and band of rows, each
    marked done like a time block, so a rerun resumes here too. Returns what the store's attrs record."""
    T, H, W = src.shape
    C = len(src.channels)
    hc, wc = tile
    _, _, hours = day_and_slot(src.time, src.time_attrs)
    days, slots = (DAYS, len(hours)) if hours else (1, 1)
    if "climatology" not in root:
        # a chunk holds a channel's tile at one hour for as many days as make ~1 MiB: one day of a big grid's
        # tile, the whole year of a small one (a day of a small tile per chunk would be thousands of tiny files);
        # one hour per chunk, so that each hour is a task of its own (see climatology_band)
        per_day = hc * wc * 4
        chunk_days = max(1, min(days, (1 << 20) // per_day))
        create_array(root, "climatology", shape=(days, slots, C, H, W), chunks=(chunk_days, 1, 1, hc, wc),
                     dtype="float32", dimension_names=["dayofyear", "hour", "channel", "lat", "lon"])
    if root["climatology"].chunks[1] == 1:  # a task per channel, band of rows and hour
        tasks = {f"clim-{c:05d}-{a:07d}-{h:03d}": (str(store), c, a, b, splits["train"], opts.climatology_window, h)
                 for c in range(C) for a, b in bands(H, hc, W, 1) for h in range(slots)}
    else:  # a store begun before: its chunks hold every hour, so one task writes them all
        tasks = {f"clim-{c:05d}-{a:07d}": (str(store), c, a, b, splits["train"], opts.climatology_window)
                 for c in range(C) for a, b in bands(H, hc, W, slots)}
    results = {n: done[n] for n in tasks if n in done}
    todo = [(n, *args) for n, args in tasks.items() if n not in done]
    for out in run_tasks(climatology_task, todo, workers=opts.workers, scheduler=opts.scheduler,
                         desc="climatology", progress=opts.progress):
        results[out["name"]] = out
        report.tasks.append(out)
    filled = {v: 0 for v in src.channels}
    for out in results.values():
        filled[src.channels[out["channel"]]] += out["filled"]
    return {"hours": hours, "window_days": opts.climatology_window if hours else None, "dated": bool(hours),
            "filled_entries": filled, "entries_per_channel": days * slots}


def climatology_task(name: str, store: str, channel: int, r0: int, r1: int, train, window: int,
                     hour: int | None = None) -> dict:
    """One channel's climatology over rows ``[r0, r1)`` (at one hour slot, or all), marked done (a dask task)."""
    start, rss0 = time.perf_counter(), reset_peak_memory()
    info = climatology_band(store, channel, r0, r1, train, window, hour)
    info = {**info, "name": name}
    StoreWriter(store).mark_block(name, info)
    return {**info, "seconds": time.perf_counter() - start, "cells": {}, "raw_bytes": 0, "peak_rss": peak_memory(),
            "start_rss": rss0}


def _periodic(lon: np.ndarray) -> bool:
    """True when the longitudes close the circle (a global grid): the last step wraps to the first."""
    if len(lon) < 2:
        return False
    step = np.diff(lon)
    return bool(np.allclose(step, step[0]) and abs(abs(step[0]) * len(lon) - 360.0) < 1e-6 * 360)
