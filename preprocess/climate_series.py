"""A climate source's series: which leading dims of a variable make its time series (``time``, ``valid_time``,
``step``, or a forecast's ``time`` and ``step``), the valid time of each of its steps (reference time + step,
never a forecast's start), and reading a stretch of its steps. Part of the one reader of climate sources,
``climate_source.py``, which imports it."""

from __future__ import annotations

import numpy as np

from domainflow.store import time_axis
from .errors import IngestError

TIME_NAMES = ("time", "valid_time")
STEP_NAMES = ("step",)       # a forecast's lead: valid time = time + step
SERIES_NAMES = TIME_NAMES + STEP_NAMES
CF_MASK_KEYS = ("_FillValue", "missing_value")


def series_dims(dims) -> tuple:
    """The leading dims of a variable that make its series: time, step, valid_time (one, or a forecast's time
    and step)."""
    out = []
    for d in dims:
        if d not in SERIES_NAMES:
            break
        out.append(d)
    return tuple(out)


def series_steps(da, tdims: tuple, a: int, b: int, grid: tuple, order: tuple = ()) -> np.ndarray:
    """Steps ``[a, b)`` of a variable's series as float64 ``(b - a, lat, lon)``, level already selected: a slice
    of its one series dim, or a forecast's (time, step) pairs in valid-time order (``order``)."""
    if len(tdims) == 1:
        return np.asarray(da.isel({tdims[0]: slice(a, b)}).transpose(tdims[0], *grid).values, dtype=np.float64)
    steps = [da.isel(dict(zip(tdims, (int(i) for i in order[k])))).transpose(*grid).values for k in range(a, b)]
    return np.asarray(np.stack(steps) if steps else np.empty((0,) + tuple(da.sizes[g] for g in grid)),
                      dtype=np.float64)


def valid_times(ds, path, tdims: tuple) -> tuple[np.ndarray | None, dict]:
    """A series' times flattened in its dims' order, and their attrs with ``meaning``: the valid time (the
    reference time plus the step) when the file has a step or a valid_time, else its time coordinate as it is
    (None when it has none). A forecast file's ``time`` is when the forecast started, never the data's date."""
    shape = tuple(ds.sizes[d] for d in tdims)
    has_step = "step" in ds.variables
    if "valid_time" in ds.variables and set(ds["valid_time"].dims) <= set(tdims):
        vt = ds["valid_time"]
        vt = vt.expand_dims({d: ds.sizes[d] for d in tdims if d not in vt.dims}).transpose(*tdims)
        values = np.asarray(vt.values).reshape(-1)
        attrs = {k: v for k, v in vt.attrs.items() if k not in CF_MASK_KEYS}
        meaning = "valid time (reference time + step)" if has_step else "valid time"
        return values, {**attrs, "meaning": meaning}
    names = [d for d in tdims if d in TIME_NAMES]
    if has_step and "time" in ds.variables:
        return _time_plus_step(ds, path, tdims)
    if len(tdims) != 1 or not names:
        raise IngestError(f"{path}: its series dims {tdims} have no valid_time coordinate and no time to add "
                          f"the steps to; give the file a valid_time (or a time) coordinate")
    values, attrs = coord_values(ds, path, names[0], shape[0])
    if values is None:
        return None, attrs
    return values, {**attrs, "meaning": "valid time" if names[0] == "valid_time" else f"the source's {names[0]!r}"}


def _time_plus_step(ds, path, tdims: tuple) -> tuple[np.ndarray, dict]:
    """Valid times of a (time, step) file that has no valid_time coordinate: the reference times decoded,
    the steps added (in their CF units), encoded back in the time's units."""
    import pandas as pd

    t_attrs = {k: v for k, v in ds["time"].attrs.items() if k not in CF_MASK_KEYS}
    ref = time_axis.decode(np.atleast_1d(np.asarray(ds["time"].values)), t_attrs)
    units = str(ds["step"].attrs.get("units", "")).strip().lower()
    unit = {"hours": "h", "hour": "h", "h": "h", "minutes": "min", "seconds": "s", "s": "s", "days": "D",
            "day": "D"}.get(units)
    if ref is None or unit is None:
        raise IngestError(f"{path}: a forecast's valid time needs a dated time and steps in hours, minutes, "
                          f"seconds or days; time units {t_attrs.get('units')!r}, step units {units!r}")
    step = pd.to_timedelta(np.atleast_1d(np.asarray(ds["step"].values, dtype=np.float64)), unit=unit).to_numpy()
    grid = {"time": ref, "step": step}
    order = [d for d in tdims if d in grid] or ["time"]
    if order == ["step", "time"]:
        values = ref[None, :] + step[:, None]
    elif order == ["step"]:
        values = ref[0] + step
    else:
        values = ref[:, None] + step[None, :]
    return time_axis.encode(values.reshape(-1), t_attrs), {**t_attrs, "meaning": "valid time (reference time + step)"}


def coord_values(ds, path, name, n):
    """(values, attrs) of a 1-D coordinate of length ``n`` (None when absent); CF-packed ones are refused."""
    if name not in ds.variables:
        return None, {}
    var = ds.variables[name]
    values = np.asarray(var.values)
    if values.shape != (n,):
        raise IngestError(f"{path}: coordinate {name!r} has shape {values.shape}, expected ({n},)")
    packed = [k for k in ("scale_factor", "add_offset") if k in var.attrs]
    if packed:
        raise IngestError(f"{path}: coordinate {name!r} is CF-packed ({', '.join(packed)}); store it unpacked")
    return values, {k: v for k, v in var.attrs.items() if k not in CF_MASK_KEYS}
