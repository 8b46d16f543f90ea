"""The synthetic climate series written as ERA5 arrives from the Copernicus Climate Data Store: netCDF files,
one per month and per product, as the CDS's netCDF converter writes them.

Why: the climate demo and tests must exercise what a user's first real download looks like, not the
project's own analysis-ready Zarr: ``valid_time`` (seconds since 1970) instead of ``time``, variables packed
as int16 with ``scale_factor``/``add_offset`` and a ``_FillValue``, descending latitude, a separate
pressure-level product with a ``pressure_level`` dimension in hPa listed from the surface up, an ocean
variable (``sst``) missing over land, and a constant land-sea mask (``lsm``) delivered at every time step.

The fields come from :class:`synth_climate.Simulation`. Besides its five surface fields:
``sst`` = the air-mass temperature + 1 K (at least 271.46 K, sea water's freezing point) over the ocean,
missing over land; ``lsm`` = 1 where the simulation's stationary temperature pattern is warm enough to call
land; ``t`` at 850 and 500 hPa = the air-mass temperature minus a 6.5 K/km lapse rate to 1.5 and 5.5 km;
``z`` = the hypsometric geopotential R_d * (mean layer temperature) * ln(msl / p).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import numpy as np

from .synth_climate import START, VARIABLE_ATTRS, VARIABLES, Simulation, _check_args, make_grid

R_DRY = 287.05  # J/(kg K)
LAPSE = 6.5e-3  # K/m
LEVELS_HPA = (850.0, 500.0)  # the CDS lists pressure levels from the surface up
LEVEL_HEIGHT_M = {850.0: 1500.0, 500.0: 5500.0}
SST_MIN = 271.46
EXTRA_ATTRS = {
    "sst": {"units": "K", "long_name": "Sea surface temperature", "standard_name": "sea_surface_temperature"},
    "lsm": {"units": "1", "long_name": "Land-sea mask", "standard_name": "land_binary_mask"},
    "t": {"units": "K", "long_name": "Temperature", "standard_name": "air_temperature"},
    "z": {"units": "m**2 s**-2", "long_name": "Geopotential", "standard_name": "geopotential"},
}
SINGLE = (*VARIABLES, "sst", "lsm")
PRESSURE = ("z", "t")
FILL_INT16 = -32767


def land_mask(sim: Simulation) -> np.ndarray:
    """1 over "land": where the simulation's stationary temperature anomaly exceeds 1.5 K (about a quarter of
    the globe, in a few continents), else 0."""
    tr = sim.tracers
    anomaly = tr.t_static - (300.0 - 42.0 * tr.sphi ** 2)
    return (anomaly > 1.5).astype(np.float32)


def frames(sim: Simulation, steps: int):
    """The single-level and pressure-level fields of each step: ({var: (H, W)}, {var: (levels, H, W)})."""
    lsm = land_mask(sim)
    ocean = lsm < 0.5
    for out in sim.run(steps):
        surface = dict(zip(VARIABLES, out))
        temp = sim.tracers.temp
        surface["sst"] = np.where(ocean, np.maximum(temp + 1.0, SST_MIN), np.nan).astype(np.float32)
        surface["lsm"] = lsm
        t_lev = np.stack([temp - LAPSE * LEVEL_HEIGHT_M[p] for p in LEVELS_HPA])
        msl = surface["msl"].astype(np.float64)
        z_lev = np.stack([R_DRY * 0.5 * (temp + t) * np.log(msl / (100.0 * p)) for p, t in zip(LEVELS_HPA, t_lev)])
        yield surface, {"z": z_lev.astype(np.float32), "t": t_lev.astype(np.float32)}


def _packing(values: np.ndarray) -> dict:
    """int16 packing of ``values`` as the CDS writes it: the file's range over 65532 steps (-32766..32766, so no
    value rounds onto the _FillValue -32767), NaN as _FillValue."""
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    scale = (hi - lo) / 65532.0 or 1.0
    return {"dtype": "int16", "scale_factor": scale, "add_offset": lo + 32766.0 * scale, "_FillValue": FILL_INT16,
            "zlib": True, "complevel": 1}


def synth_cds(out, grid=(32, 64), steps=120, seed=0, dt_hours=6, overwrite=False) -> Path:
    """Simulate like :func:`synth_climate.synth_climate` and write a folder of CDS-style netCDF files,
    ``era5_single_levels_YYYY-MM.nc`` and ``era5_pressure_levels_YYYY-MM.nc`` per month (atomically: the
    folder appears whole); return its path."""
    import pandas as pd
    import xarray as xr

    h, w, dt_hours = _check_args(grid, steps, 1, dt_hours)
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass overwrite=True to replace it, or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    g = make_grid(h, w)
    sim = Simulation(g, seed, dt_hours)
    dates = pd.date_range(START, periods=int(steps), freq=f"{dt_hours}h")
    months = dates.to_period("M")
    try:
        stream = frames(sim, int(steps))
        for month in months.unique():
            idx = np.nonzero(months == month)[0]
            surf = {v: np.empty((len(idx), h, w), np.float32) for v in SINGLE}
            lev = {v: np.empty((len(idx), len(LEVELS_HPA), h, w), np.float32) for v in PRESSURE}
            for k in range(len(idx)):
                s, p = next(stream)
                for v in SINGLE:
                    surf[v][k] = s[v]
                for v in PRESSURE:
                    lev[v][k] = p[v]
            _write_month(xr, tmp, str(month), dates[idx], g, surf, lev)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_month(xr, folder: Path, month: str, dates, g, surf: dict, lev: dict) -> None:
    seconds = ((dates - np.datetime64("1970-01-01")) // np.timedelta64(1, "s")).to_numpy().astype(np.int64)
    coords = {
        "valid_time": ("valid_time", seconds, {"units": "seconds since 1970-01-01", "calendar": "proleptic_gregorian",
                                               "long_name": "time", "standard_name": "time"}),
        "latitude": ("latitude", g.lat, {"units": "degrees_north", "long_name": "latitude",
                                         "standard_name": "latitude"}),
        "longitude": ("longitude", g.lon, {"units": "degrees_east", "long_name": "longitude",
                                           "standard_name": "longitude"}),
        "number": ((), np.int64(0), {"long_name": "ensemble member numerical id"}),
        "expver": ("valid_time", np.array(["0001"] * len(dates), dtype=object), {"long_name": "Experiment version"}),
    }
    attrs = {"GRIB_centre": "ecmf", "Conventions": "CF-1.7", "institution": "European Centre for Medium-Range "
             "Weather Forecasts", "history": "domainflow.preprocess.synth_cds (synthetic, CDS netCDF layout)"}
    dims = ("valid_time", "latitude", "longitude")
    single = xr.Dataset({v: (dims, surf[v], {**VARIABLE_ATTRS, **EXTRA_ATTRS}[v]) for v in SINGLE},
                        coords=coords, attrs=attrs)
    single.to_netcdf(folder / f"era5_single_levels_{month}.nc", encoding={v: _packing(surf[v]) for v in SINGLE})
    plev = {"pressure_level": ("pressure_level", np.array(LEVELS_HPA), {"units": "hPa", "long_name": "pressure",
                                                                        "standard_name": "air_pressure"})}
    dims4 = ("valid_time", "pressure_level", "latitude", "longitude")
    pressure = xr.Dataset({v: (dims4, lev[v], EXTRA_ATTRS[v]) for v in PRESSURE}, coords={**coords, **plev},
                          attrs=attrs)
    pressure.to_netcdf(folder / f"era5_pressure_levels_{month}.nc", encoding={v: _packing(lev[v]) for v in PRESSURE})

