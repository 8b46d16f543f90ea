"""``domainflow ingest climate RAW STORE``: a time-chunked climate Zarr -> a grid store of spatial chunks.

Raw input is the common analysis-ready form: a Zarr group (v2 as written by xarray, with
``_ARRAY_DIMENSIONS`` attrs, or v3 with ``dimension_names``) holding ``(time, latitude, longitude)``
variables (ERA5 / WeatherBench names such as ``t2m``, ``u10``) and their coordinate arrays. Sources are
usually chunked along time with whole maps per chunk, which makes a lat/lon hyperslab read the whole map.
Ingest re-chunks into ``data (T, C, H, W)`` with one chunk per time step, variable and spatial tile of
about 1 MiB, so each rank of a domain-parallel reader touches only the tiles of its own region.

One dask task per time block (aligned to the source's time chunks): read the block of every variable,
refuse NaN/Inf, write whole output chunks, and drop a marker holding the block's statistics over the
train steps it contains. A rerun skips blocks with markers; the coordinator merges the statistics in
time order (so 1 or N workers give identical stores) and marks the store complete last.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import IngestError, RunError
from .parallel import peak_memory, reset_peak_memory, run_tasks
from .report import IngestReport
from .splits import check_fractions, read_split_file, split_times, time_mask
from .stats import RunningStats, merge_all
from .store_writer import TARGET_CHUNK_BYTES, StoreWriter

LAT_NAMES = ("latitude", "lat")
LON_NAMES = ("longitude", "lon")


@dataclass
class GridOptions:
    variables: tuple[str, ...] | None = None
    time_block: int | None = None
    chunk_bytes: int = TARGET_CHUNK_BYTES
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    split_file: str | None = None
    workers: int = 1
    scheduler: str | None = None
    overwrite: bool = False
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


@dataclass
class GridSource:
    """What ingest found in the raw store: variables (in channel order), coordinates, time chunking."""

    path: Path
    variables: list[str]
    shape: tuple[int, int, int]
    time_chunk: int
    lat: np.ndarray
    lon: np.ndarray
    time: np.ndarray
    time_attrs: dict
    var_attrs: dict = field(default_factory=dict)


def _dims(arr) -> tuple | None:
    names = getattr(arr.metadata, "dimension_names", None)
    if names:
        return tuple(names)
    dims = arr.attrs.get("_ARRAY_DIMENSIONS")
    return tuple(dims) if dims else None


def open_source(raw, variables=None) -> GridSource:
    """Find the ``(time, lat, lon)`` variables and coordinates of a raw climate Zarr group."""
    import zarr

    raw = Path(raw)
    try:
        group = zarr.open_group(raw, mode="r")
    except Exception as exc:
        raise IngestError(f"{raw} is not a readable Zarr group ({type(exc).__name__}: {exc}); ingest climate "
                          f"reads a Zarr store with (time, latitude, longitude) variables") from None
    arrays = dict(group.arrays())
    gridded = {}
    for name, arr in arrays.items():
        dims = _dims(arr)
        if dims and len(dims) == 3 and dims[0] == "time" and dims[1] in LAT_NAMES and dims[2] in LON_NAMES:
            gridded[name] = arr
    if not gridded:
        shown = {n: _dims(a) for n, a in arrays.items()}
        raise IngestError(f"{raw} holds no (time, latitude, longitude) variables; arrays and their dims: {shown}")
    if variables:
        unknown = [v for v in variables if v not in gridded]
        if unknown:
            raise IngestError(f"{raw}: no variable(s) {unknown}; the (time, lat, lon) variables are "
                              f"{sorted(gridded)}")
        names = list(variables)
    else:
        names = sorted(gridded)
    shapes = {n: gridded[n].shape for n in names}
    if len(set(shapes.values())) != 1:
        raise IngestError(f"{raw}: variables have different shapes {shapes}; ingest them in separate stores "
                          f"(--variables)")
    first = gridded[names[0]]
    T, H, W = first.shape
    lat_name, lon_name = _dims(first)[1], _dims(first)[2]

    def coord(name, n):
        if name not in arrays:
            return None
        values = np.asarray(arrays[name][...])
        if values.shape != (n,):
            raise IngestError(f"{raw}: coordinate {name!r} has shape {values.shape}, expected ({n},)")
        return values

    lat, lon, t = coord(lat_name, H), coord(lon_name, W), coord("time", T)
    if lat is None or lon is None:
        raise IngestError(f"{raw}: coordinate arrays {lat_name!r} and {lon_name!r} are required")
    time_attrs = dict(arrays["time"].attrs) if t is not None else {"units": "steps"}
    time_attrs.pop("_ARRAY_DIMENSIONS", None)
    var_attrs = {n: {k: v for k, v in gridded[n].attrs.items()
                     if k not in ("_ARRAY_DIMENSIONS", "scale_factor", "add_offset", "_FillValue", "missing_value")}
                 for n in names}
    return GridSource(raw, names, (T, H, W), int(first.chunks[0]), lat.astype(np.float64), lon.astype(np.float64),
                      np.arange(T, dtype=np.int64) if t is None else t, time_attrs, var_attrs)


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


def unpack(arr, t0: int, t1: int) -> np.ndarray:
    """Time steps ``[t0, t1)`` of a variable in physical units, float64: CF packing (``scale_factor``,
    ``add_offset``, as ERA5 netCDF converted by xarray has) undone, fill / missing values as NaN."""
    values = np.asarray(arr[t0:t1])
    attrs = arr.attrs
    missing = [attrs[k] for k in ("_FillValue", "missing_value") if k in attrs and attrs[k] is not None]
    out = values.astype(np.float64)
    for m in missing:
        for x in np.atleast_1d(m):
            out[values == x] = np.nan
    if "scale_factor" in attrs:
        out *= float(attrs["scale_factor"])
    if "add_offset" in attrs:
        out += float(attrs["add_offset"])
    return out


def ingest_block(raw: str, store: str, variables: list[str], t0: int, t1: int, train: list) -> dict:
    """Copy time steps ``[t0, t1)`` of every variable into ``data`` and mark the block done (a dask task)."""
    import zarr

    start, rss0 = time.perf_counter(), reset_peak_memory()
    name = f"{t0:09d}-{t1:09d}"
    src = zarr.open_group(raw, mode="r")
    out = zarr.open_group(store, mode="r+")["data"]
    block = np.empty((t1 - t0, len(variables)) + tuple(out.shape[2:]), dtype=np.float32)
    for c, v in enumerate(variables):
        with np.errstate(over="ignore"):  # values beyond float32 become inf and are reported below
            block[:, c] = unpack(src[v], t0, t1)
        bad = ~np.isfinite(block[:, c])
        if bad.any():
            step = t0 + int(np.argmax(bad.reshape(len(bad), -1).any(axis=1)))
            raise RunError(f"time block {t0}..{t1}", f"{raw}: variable {v!r} holds {int(bad.sum())} NaN/Inf/missing "
                           f"values or values beyond float32 (first at time index {step}); fill or mask them "
                           f"before ingest")
    out[t0:t1] = block
    mask = time_mask(train, out.shape[0])[t0:t1]
    stats = {v: RunningStats.of(block[mask, c].reshape(-1)).to_attrs() for c, v in enumerate(variables)}
    info = {"block": [t0, t1], "stats": stats}
    StoreWriter(store).mark_block(name, info)
    return {**info, "name": name, "cells": {"grid": int(block.size)}, "raw_bytes": int(block.nbytes),
            "seconds": time.perf_counter() - start,
            "peak_rss": peak_memory(), "start_rss": rss0}


def ingest_climate(raw, store, opts: GridOptions | None = None, **kw):
    """Ingest a raw climate Zarr into the grid store ``store`` (resuming if partial)."""
    import zarr

    opts = opts or GridOptions(**kw)
    opts.validate()
    t0 = time.perf_counter()
    raw, store = Path(raw).resolve(), Path(store).resolve()  # tasks may run in other working directories
    src = open_source(raw, opts.variables)
    T, H, W = src.shape
    # default: the source's time chunks (each task decodes whole source chunks), capped so that one
    # task's block stays below ~512 MiB when a source stores the whole series as one chunk
    block = opts.time_block or max(1, min(src.time_chunk, (512 << 20) // (4 * len(src.variables) * H * W)))
    splits = split_times(T, opts.split, opts.split_file)
    hc, wc = spatial_tile(H, W, 4, opts.chunk_bytes)
    config = {"variables": src.variables, "time_block": block, "chunk_bytes": opts.chunk_bytes,
              "split": list(opts.split), "split_file": read_split_file(opts.split_file), "shape": [T, H, W]}
    writer = StoreWriter(store)
    state = writer.open("grid", str(raw.resolve()), None, config, overwrite=opts.overwrite)
    report = IngestReport(store=store, state=state)
    if state == "complete":
        report.seconds = time.perf_counter() - t0
        return report
    root = zarr.open_group(store, mode="r+")
    if "data" not in root:
        root.create_array("data", shape=(T, len(src.variables), H, W), chunks=(1, 1, hc, wc), dtype="float32",
                          dimension_names=["time", "channel", "lat", "lon"])
        for name, values, attrs in (("lat", src.lat, {"units": "degrees_north"}),
                                    ("lon", src.lon, {"units": "degrees_east"}),
                                    ("time", src.time, src.time_attrs)):
            arr = root.create_array(name, shape=values.shape, dtype=values.dtype, chunks=values.shape,
                                    dimension_names=[name], attributes=attrs)
            arr[...] = values
    done = writer.finished_blocks()
    blocks = [(a, min(a + block, T)) for a in range(0, T, block)]
    names = {f"{a:09d}-{b:09d}": (a, b) for a, b in blocks}
    report.kept = [n for n in names if n in done]
    todo = [(str(raw), str(store), src.variables, a, b, splits["train"]) for n, (a, b) in names.items()
            if n not in done]
    summaries = dict(done)
    try:
        for out in run_tasks(ingest_block, todo, workers=opts.workers, scheduler=opts.scheduler,
                             desc=f"ingest {raw.name}", progress=opts.progress):
            report.tasks.append(out)
            report.written.append(out["name"])
            summaries[out["name"]] = out
    finally:
        report.seconds = time.perf_counter() - t0
    stats = {}
    for v in src.variables:
        merged = merge_all(RunningStats.from_attrs(summaries[n]["stats"][v]) for n in names)
        stats[f"grid/{v}"] = merged.to_attrs()
    fields = {f"grid/{v}": {"location": "grid", "components": 1, "channel": c,
                            "units": str(src.var_attrs[v].get("units", "")),
                            "long_name": str(src.var_attrs[v].get("long_name", v))}
              for c, v in enumerate(src.variables)}
    writer.complete({"fields": fields, "stats": stats, "splits": splits,
                     "grid": {"variables": src.variables, "shape": [T, H, W], "tile": [hc, wc],
                              "periodic_lon": _periodic(src.lon)}})
    report.seconds = time.perf_counter() - t0
    return report


def _periodic(lon: np.ndarray) -> bool:
    """True when the longitudes close the circle (a global grid): the last step wraps to the first."""
    if len(lon) < 2:
        return False
    step = np.diff(lon)
    return bool(np.allclose(step, step[0]) and abs(abs(step[0]) * len(lon) - 360.0) < 1e-6 * 360)
