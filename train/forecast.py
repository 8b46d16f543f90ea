"""Forecasts of a trained grid model as an xarray-readable dataset: ``domainflow predict CHECKPOINT STORE
out.zarr --init 2020-03-01T00 --steps 8`` (or ``out.nc``).

Each initial time's input window is read from the store, the model is rolled out ``--steps`` steps on the
domain-parallel grid (its prediction fed back as the newest input step, as in evaluation), and every rank
writes its own latitude (x longitude) block of each lead into the output Zarr: one variable per channel in
its physical units, dims ``(time, lead_time, latitude, longitude)``, ``time`` the initial times in the store's
time units and calendar, ``lead_time`` in hours (steps when the store's time axis has no dates). Chunks never
straddle two ranks' blocks, so no two ranks write one chunk. The dataset is built in a scratch folder and
renamed into place once every rank has written; a ``.nc`` output is converted from it on the first rank
through xarray (chunk by chunk) and the scratch folder removed.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

import domainflow as df

from . import checkpoint as ckpt
from .config import COMPILE_BACKENDS, from_dict

FORECAST_SUFFIXES = (".zarr", ".nc")


def forecast_config(checkpoint: str, store: str, inits, steps: int, out: str, domain: int = 1, lon: int = 1,
                    trust_target: bool = False, compile_backend: str | None = None):
    """(checkpoint folder, config, initial step indices, output path, the model's normalisation) with every
    error that needs no process group raised here, before ranks start: no or a mesh checkpoint, an output that
    is not .zarr/.nc, steps < 1, a store whose channels do not fit the model, an initial time the store does not
    hold or that has no full input window before it."""
    from domainflow.readers import open_store

    out = Path(out)
    if out.suffix not in FORECAST_SUFFIXES:
        raise ValueError(f"{out}: a forecast is written as a .zarr store or a .nc file; name the output e.g. "
                         f"{out.with_suffix('.zarr').name}")
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    if compile_backend is not None and compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend {compile_backend}: the backend is one of {list(COMPILE_BACKENDS)}")
    if domain < 1 or lon < 1:
        raise ValueError(f"--domain and --lon must be at least 1, got {domain} and {lon}")
    path = ckpt.latest(Path(checkpoint))
    if path is None:
        raise FileNotFoundError(f"{checkpoint}: no checkpoint there (expected a step_<n> folder or a checkpoints "
                                f"folder with one)")
    meta = ckpt.meta(path)
    cfg = from_dict(dict(meta["config"]))
    if cfg.data.kind != "grid":
        raise ValueError(f"--init forecasts a grid; the checkpoint was trained on a {cfg.data.kind} store (predict it "
                         f"with --run)")
    from .model_target import check_trusted

    check_trusted(cfg, f"the checkpoint {path}", trust_target)
    cfg.data.store = str(store)
    cfg.mesh.dp, cfg.mesh.domain, cfg.mesh.lon = 1, domain, lon
    cfg.data.shard_dims = ["lat", "lon"] if lon > 1 else ["lat"]
    inits = [str(i).strip() for i in ([inits] if isinstance(inits, str) else inits) for i in str(i).split(",")]
    inits = [i for i in inits if i]
    if not inits:
        raise ValueError("--init needs at least one initial time (a date such as 2020-03-01T00, or a step index)")
    handle = open_store(store)
    try:
        handle.require_kind("grid")
        time = handle.group["time"]
        H, W = handle.group["data"].shape[2:]
        if domain > H or lon > W:
            raise ValueError(f"{store} has {H} latitudes and {W} longitudes; --domain {domain} --lon {lon} leaves a "
                             f"rank without any")
        index = [_step_of(i, handle.read(time), dict(time.attrs), store) for i in inits]
        norm = meta.get("normalization")
        trained = meta.get("inputs")  # a checkpoint from before normalisations were recorded
        if norm is not None:  # the same channels and static fields, in the same order, or the inputs would mix up
            from .normalization import check_fits

            check_fits(norm, handle, cfg, f"the checkpoint {path}")
        elif trained:
            grid = handle.attrs.get("grid", {})
            here = {"variables": list(grid.get("variables", [])),
                    "statics": list(grid.get("static", [])) if cfg.data.static else []}
            if here != trained:
                raise ValueError(f"{store} holds channels {here['variables']} and static fields {here['statics']}, "
                                 f"but the checkpoint's model was trained on {trained['variables']} and "
                                 f"{trained['statics']}; forecast from a store ingested the same way")
    finally:
        handle.close()
    early = [(i, k) for i, k in zip(inits, index) if k - cfg.data.history + 1 < 0]
    if early:
        raise ValueError(f"initial time {early[0][0]} (step {early[0][1]}) has no {cfg.data.history} input step(s) "
                         f"before it in {store}")
    return path, cfg, index, out, norm


def _step_of(text: str, values: np.ndarray, attrs: dict, store) -> int:
    """The store step an initial time names: a step index, or a date matching one of the store's times
    (``values``, ``attrs``: the store's time axis)."""
    if text.lstrip("-").isdigit():
        k = int(text)
        if not 0 <= k < len(values):
            raise ValueError(f"--init {text}: {store} has steps 0..{len(values) - 1}")
        return k
    from domainflow.store import time_axis

    if not time_axis.has_dates(attrs):
        raise ValueError(f"--init {text}: {store}'s time axis has no dates ({attrs.get('units') or 'no units'}); give "
                         f"a step index")
    try:
        import pandas as pd

        wanted = pd.Timestamp(text)
    except ValueError:
        raise ValueError(f"--init {text!r} is neither a date (e.g. 2020-03-01T06) nor a step index") from None
    hit = np.flatnonzero(values == time_axis.encode([wanted.to_datetime64()], attrs)[0])
    if not len(hit):
        ends = time_axis.decode(values[[0, -1]], attrs)
        raise ValueError(f"--init {text}: {store} holds no step at that time; its steps run from "
                         f"{time_axis.label(ends[0])} to {time_axis.label(ends[1])}")
    return int(hit[0])


def forecast_main(checkpoint: str, store: str, inits, steps: int, out: str, domain: int = 1, lon: int = 1,
                  trust_target: bool = False, compile_backend: str | None = None) -> int:
    """``domainflow predict ... --init``: one rank per block of the grid (started by the caller)."""
    from domainflow import comm

    from .build import build_mesh, build_model
    from .data import build_dataset
    from .inference import rollout
    from .predict import PredictionError, together

    path, cfg, index, out, norm = forecast_config(checkpoint, store, inits, steps, out, domain, lon, trust_target,
                                                  compile_backend)
    mesh = build_mesh(cfg)
    ds = build_dataset(cfg, mesh, next(iter(_splits(store))), shuffle=False, norm=norm)
    model = build_model(cfg, ds)
    ckpt.load(path, model)
    forward = model if compile_backend is None else df.compile(model, backend=compile_backend)
    group = ds.axes.domain
    first = all(c == 0 for c in ds.axes.coords)
    dtype = next(model.parameters()).dtype
    scratch = out.parent / f".{out.stem}.tmp-{_token(group)}.zarr"
    writer = ForecastWriter(scratch, ds, index, steps, np.dtype(str(dtype).split(".")[-1]))
    C = len(ds.variables)
    try:
        together(comm, group, lambda: writer.create() if first else None, str(scratch), PredictionError)
        for i, t in enumerate(index):
            state = ds.shard(ds.read_window(t))
            for k, pred in rollout(forward, state, steps, C, cfg, relayout=ds.relayout, statics=len(ds.statics)):
                block = ds.denormalize(pred).to_local()[0].cpu().numpy()
                # each write is checked on every rank before the next step's collectives: a rank that cannot
                # write stops every rank here, never one rank waiting in the model for the others
                together(comm, group, lambda: writer.write(i, k - 1, block), str(scratch), PredictionError)
        together(comm, group, lambda: writer.publish(out) if first else None, str(out), PredictionError)
    except BaseException:
        if first:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    if torch.distributed.get_rank() == 0:
        print(f"wrote {out}: {len(index)} initial time(s) x {steps} lead(s) of {', '.join(ds.variables)} on the "
              f"{ds.data.shape[2]} x {ds.data.shape[3]} grid, written by {int(np.prod(ds.axes.sizes))} rank(s)")
    return 0


def _splits(store) -> list:
    from domainflow.readers import open_store

    handle = open_store(store)
    try:
        return list(handle.splits)
    finally:
        handle.close()


def _token(group) -> str:
    """A name every rank of the group agrees on (the first rank's)."""
    from domainflow import comm

    return comm.all_gather_object_mesh(uuid.uuid4().hex[:8], group)[0]


class ForecastWriter:
    """The output Zarr: created by one rank, each rank writing its block of each (initial time, lead)."""

    def __init__(self, path: Path, ds, index: list[int], steps: int, dtype):
        self.path, self.ds, self.index, self.steps, self.dtype = Path(path), ds, list(index), steps, dtype
        T, C, H, W = ds.data.shape
        self.H, self.W = H, W
        lat_offsets = _offsets(ds, "lat", H)
        lon_offsets = _offsets(ds, "lon", W)
        # chunks that never straddle two ranks' blocks: the largest size dividing every block boundary
        self.chunks = (1, 1, math.gcd(H, *lat_offsets), math.gcd(W, *lon_offsets))

    def create(self) -> None:
        import zarr

        from domainflow.store import time_axis

        ds, store = self.ds, self.ds.store.group
        read = self.ds.store.read  # every store read checked (a damaged chunk named)
        if self.path.exists():
            shutil.rmtree(self.path)
        root = zarr.open_group(self.path, mode="w", zarr_format=3)
        time = store["time"]
        tattrs = {k: v for k, v in dict(time.attrs).items() if k in ("units", "calendar", "long_name", "standard_name")}
        tattrs.setdefault("long_name", "initial time")
        values = read(time)
        hours = time_axis.step_hours(values[:2], dict(time.attrs))
        lead = np.arange(1, self.steps + 1) * ds.lead * (hours if hours else 1)
        coords = {
            "time": (values[self.index], tattrs),
            "lead_time": (lead.astype(np.float64) if hours and not float(hours).is_integer() else lead.astype(np.int64),
                          # "dtype" marks a CF duration that xarray decodes to timedelta64, as it writes one
                          {"units": "hours", "long_name": "lead time", "dtype": "timedelta64[ns]"} if hours else
                          {"units": "steps", "long_name": "lead time (steps of the store)"}),
            "latitude": (read(store["lat"]), {"units": "degrees_north", "long_name": "latitude"}),
            "longitude": (read(store["lon"]), {"units": "degrees_east", "long_name": "longitude"}),
        }
        for name, (values, attrs) in coords.items():
            a = root.create_array(name, shape=values.shape, dtype=values.dtype, dimension_names=[name],
                                  attributes=attrs)
            a[...] = values
        fields = ds.store.fields
        for v in ds.variables:
            info = fields.get(f"grid/{v}", {})
            attrs = {"units": info.get("units", ""), "long_name": info.get("long_name", v)}
            if "level_hpa" in info:
                attrs["level_hpa"] = info["level_hpa"]
            root.create_array(v, shape=(len(self.index), self.steps, self.H, self.W), dtype=self.dtype,
                              chunks=self.chunks, dimension_names=["time", "lead_time", "latitude", "longitude"],
                              attributes=attrs, fill_value=np.nan)
        root.attrs.update({"title": "domainflow forecast", "source_store": str(ds.store.path)})

    def write(self, i: int, k: int, block: np.ndarray) -> None:
        """This rank's (C, h, w) block of initial time ``i`` and lead ``k`` (0-based)."""
        import zarr

        lat, lon = self.ds.slabs["lat"], self.ds.slabs["lon"]
        root = zarr.open_group(self.path, mode="r+")
        for c, v in enumerate(self.ds.variables):
            root[v][i, k, lat.start:lat.stop, lon.start:lon.stop] = block[c].astype(self.dtype, copy=False)

    def publish(self, out: Path) -> None:
        """Consolidate the metadata and move the dataset into place (converted to netCDF for a .nc)."""
        import zarr

        import warnings

        with warnings.catch_warnings():  # zarr notes that v3 consolidated metadata is not in the spec yet
            warnings.filterwarnings("ignore", message="Consolidated metadata")
            zarr.consolidate_metadata(str(self.path))
        if out.suffix == ".zarr":
            if out.exists():
                shutil.rmtree(out)
            os.replace(self.path, out)
            return
        import xarray as xr

        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        with xr.open_zarr(self.path) as data:
            data.to_netcdf(tmp)
        os.replace(tmp, out)
        shutil.rmtree(self.path)


def _offsets(ds, dim: str, n: int) -> list[int]:
    """Where the ranks' blocks along ``dim`` start (0 when the dim is not sharded)."""
    from domainflow.readers.regions import grid_slab

    if dim not in ds.shard_dims:
        return [0]
    size = ds.axes.sizes[ds.shard_dims.index(dim)]
    return [grid_slab(n, size, k).start for k in range(size)]


