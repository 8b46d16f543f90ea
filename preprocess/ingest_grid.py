"""``domainflow ingest climate RAW STORE``: a time-chunked climate Zarr -> a grid store of spatial chunks.

Raw input is the common analysis-ready form: a Zarr group (v2 as written by xarray, with
``_ARRAY_DIMENSIONS`` attrs, or v3 with ``dimension_names``) holding ``(time, latitude, longitude)``
variables (ERA5 / WeatherBench names such as ``t2m``, ``u10``) and their coordinate arrays, read with
xarray so that fill / missing values and CF packing decode exactly as xarray decodes them. Sources are
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
from .store_writer import TARGET_CHUNK_BYTES, StoreWriter, chunk_options, for_writing

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


COORD_NAMES = ("time",) + LAT_NAMES + LON_NAMES
CF_MASK_KEYS = ("_FillValue", "missing_value")


def open_dataset(raw, only=None, **kw):
    """The raw Zarr as an xarray Dataset, lazily (no dask) and with times left as numbers: xarray is the one
    reader of the source, so fill values (v2 ``fill_value``, ``_FillValue``, ``missing_value``) and CF
    packing decode exactly as xarray decodes them. Consolidated metadata is used when present. ``only``:
    the arrays to open (the rest are dropped, so arrays of other shapes do not stop xarray)."""
    import xarray as xr

    if only is not None:
        kw["drop_variables"] = [n for n in _array_names(raw) if n not in only]
    opts = dict(chunks=None, decode_times=False, **kw)
    try:
        return xr.open_zarr(raw, consolidated=True, **opts)
    except Exception:  # no (readable) consolidated metadata: read the arrays' own, without xarray's warning
        return xr.open_zarr(raw, consolidated=False, **opts)


def _array_names(raw) -> list[str]:
    """Names of the arrays in the raw group (its metadata only), to choose what xarray opens."""
    import zarr

    return list(zarr.open_group(raw, mode="r").array_keys())


def open_source(raw, variables=None) -> GridSource:
    """Find the ``(time, lat, lon)`` variables and coordinates of a raw climate Zarr group (read by xarray;
    coordinates and time as stored, variable attrs without the CF keys xarray decodes)."""
    raw = Path(raw)
    # coordinates stay as stored: time as raw numbers, and a zarr-python v2 store's default fill_value 0
    # must not turn longitude 0 into NaN
    as_stored = {n: False for n in COORD_NAMES}
    try:
        try:
            ds = open_dataset(raw, mask_and_scale=as_stored)
        except (FileNotFoundError, KeyError):
            raise
        except Exception:
            if not variables:
                raise
            # xarray cannot open all arrays together (a dimension with two sizes): just --variables
            ds = open_dataset(raw, only=(*variables, *COORD_NAMES), mask_and_scale=as_stored)
    except FileNotFoundError as exc:
        raise IngestError(f"{raw} is not a readable Zarr group ({type(exc).__name__}: {exc}); ingest climate "
                          f"reads a Zarr store with (time, latitude, longitude) variables") from None
    except KeyError as exc:  # xarray needs the dimension names of every array
        raise IngestError(f"{raw}: xarray cannot read it as a dataset ({exc.args[0] if exc.args else exc}); "
                          f"ingest climate reads a Zarr store whose arrays name their dimensions (v3 "
                          f"dimension_names, v2 _ARRAY_DIMENSIONS), as xarray writes it") from None
    except Exception as exc:
        shapes = _shapes(raw, variables)
        if len(set(shapes.values())) > 1:  # xarray refuses one dimension with two sizes
            raise IngestError(f"{raw}: variables have different shapes {shapes}; ingest them in separate stores "
                              f"(--variables)") from None
        raise IngestError(f"{raw} is not a readable Zarr group ({type(exc).__name__}: {exc}); ingest climate "
                          f"reads a Zarr store with (time, latitude, longitude) variables") from None
    with ds:
        return _source_of(raw, ds, variables)


def _shapes(raw, variables) -> dict:
    """Shapes of the (time, lat, lon) variables (or of ``variables``), each opened on its own, for the error
    raised when xarray cannot open them together; empty when that fails too."""
    try:
        names = list(variables) if variables else _array_names(raw)
        shapes = {}
        for name in names:
            with open_dataset(raw, only=(name,)) as one:
                arr = one.variables.get(name)
                if arr is not None and _is_gridded(arr):
                    shapes[name] = tuple(arr.shape)
        return shapes
    except Exception:
        return {}


def _is_gridded(arr) -> bool:
    """A ``(time, lat|latitude, lon|longitude)`` variable."""
    return len(arr.dims) == 3 and arr.dims[0] == "time" and arr.dims[1] in LAT_NAMES and arr.dims[2] in LON_NAMES


def _source_of(raw: Path, ds, variables) -> GridSource:
    """GridSource of an open dataset (see :func:`open_source`)."""
    gridded = {str(name): arr for name, arr in ds.variables.items() if _is_gridded(arr)}
    if not gridded:
        shown = {str(n): tuple(a.dims) for n, a in ds.variables.items()}
        raise IngestError(f"{raw} holds no (time, latitude, longitude) variables; arrays and their dims: {shown}")
    if variables:
        unknown = [v for v in variables if v not in gridded]
        if unknown:
            raise IngestError(f"{raw}: no variable(s) {unknown}; the (time, lat, lon) variables are "
                              f"{sorted(gridded)}")
        names = list(variables)
    else:
        names = sorted(gridded)
    shapes = {n: tuple(gridded[n].shape) for n in names}
    if len(set(shapes.values())) != 1:
        raise IngestError(f"{raw}: variables have different shapes {shapes}; ingest them in separate stores "
                          f"(--variables)")
    first = gridded[names[0]]
    T, H, W = first.shape
    lat_name, lon_name = first.dims[1], first.dims[2]

    def coord(name, n):
        if name not in ds.variables:  # a dimension without a coordinate array
            return None, {}
        var = ds.variables[name]
        values = np.asarray(var.values)
        if values.shape != (n,):
            raise IngestError(f"{raw}: coordinate {name!r} has shape {values.shape}, expected ({n},)")
        packed = [k for k in ("scale_factor", "add_offset") if k in var.attrs]
        if packed:
            raise IngestError(f"{raw}: coordinate {name!r} is CF-packed ({', '.join(packed)}); store it unpacked")
        return values, {k: v for k, v in var.attrs.items() if k not in CF_MASK_KEYS}

    (lat, _), (lon, _), (t, t_attrs) = coord(lat_name, H), coord(lon_name, W), coord("time", T)
    if lat is None or lon is None:
        raise IngestError(f"{raw}: coordinate arrays {lat_name!r} and {lon_name!r} are required")
    time_attrs = t_attrs if t is not None else {"units": "steps"}
    var_attrs = {n: dict(gridded[n].attrs) for n in names}  # xarray moved the CF packing keys to .encoding
    enc = first.encoding
    time_chunk = enc["chunks"][0] if enc.get("chunks") else enc.get("preferred_chunks", {}).get("time", T)
    return GridSource(raw, names, (T, H, W), int(time_chunk), lat.astype(np.float64), lon.astype(np.float64),
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


def ingest_block(raw: str, store: str, variables: list[str], t0: int, t1: int, train: list) -> dict:
    """Copy time steps ``[t0, t1)`` of every variable into ``data`` and mark the block done (a dask task)."""
    import zarr

    start, rss0 = time.perf_counter(), reset_peak_memory()
    name = f"{t0:09d}-{t1:09d}"
    out = for_writing(zarr.open_group(store, mode="r+")["data"])
    block = np.empty((t1 - t0, len(variables)) + tuple(out.shape[2:]), dtype=np.float32)
    with open_dataset(raw, only=variables) as src:  # just these arrays: no coordinates are read
        for c, v in enumerate(variables):
            # xarray's CF decoding: fill / missing values -> NaN, scale_factor / add_offset undone
            values = np.asarray(src[v].isel(time=slice(t0, t1)).values, dtype=np.float64)
            with np.errstate(over="ignore"):  # values beyond float32 become inf and are reported below
                block[:, c] = values
            bad = ~np.isfinite(block[:, c])
            if bad.any():
                step = t0 + int(np.argmax(bad.reshape(len(bad), -1).any(axis=1)))
                fills = [(k, x) for k in CF_MASK_KEYS for x in np.atleast_1d(src[v].encoding.get(k, []))
                         if x is not None and x == x]  # xarray reads values equal to these as missing
                why = "".join(f" (values equal to its {k} {x} read as missing)" for k, x in fills)
                raise RunError(f"time block {t0}..{t1}", f"{raw}: variable {v!r} holds {int(bad.sum())} "
                               f"NaN/Inf/missing values or values beyond float32 (first at time index {step})"
                               f"{why}; fill or mask them before ingest")
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
    with StoreWriter(store) as writer:  # holds the store's writer lock until the end
        return _ingest_blocks(writer, raw, store, src, opts, block, splits, (hc, wc), config, t0)


def _ingest_blocks(writer: StoreWriter, raw: Path, store: Path, src: GridSource, opts: GridOptions, block: int,
                   splits: dict, tile: tuple[int, int], config: dict, t0: float) -> IngestReport:
    """The locked part of :func:`ingest_climate`: open or resume, run the block tasks, complete."""
    import zarr

    T, H, W = src.shape
    hc, wc = tile
    state = writer.open("grid", str(raw.resolve()), None, config, overwrite=opts.overwrite)
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
        arr = root[name] if name in root else root.create_array(
            name, shape=values.shape, dtype=values.dtype, chunks=values.shape, dimension_names=[name],
            attributes=attrs, **chunk_options())
        for_writing(arr)[...] = values
    if "data" not in root:
        root.create_array("data", shape=(T, len(src.variables), H, W), chunks=(1, 1, hc, wc), dtype="float32",
                          dimension_names=["time", "channel", "lat", "lon"], **chunk_options())
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
