"""The one place that reads a time axis: numbers with CF ``units`` ("hours since 1900-01-01") and ``calendar``
decoded as xarray decodes them (numpy datetime64, or cftime dates for other calendars); an axis whose units
are not "<unit> since <date>" has no dates (its steps are just numbered)."""

from __future__ import annotations

import numpy as np


def has_dates(attrs: dict) -> bool:
    return "since" in str(attrs.get("units", ""))


def decode(values, attrs: dict):
    """The dates of ``values`` (an array), or None when the axis has no dates."""
    if not has_dates(attrs):
        return None
    from xarray.coding.times import decode_cf_datetime

    return np.asarray(decode_cf_datetime(np.asarray(values), str(attrs["units"]), attrs.get("calendar")))


def encode(dates, attrs: dict) -> np.ndarray:
    """``dates`` as numbers in the axis's units and calendar."""
    from xarray.coding.times import encode_cf_datetime

    number, _, _ = encode_cf_datetime(np.asarray(dates), str(attrs["units"]), attrs.get("calendar"))
    return np.asarray(number)


def label(date) -> str:
    """A date as ``YYYY-MM-DD HH:MM:SS``."""
    return str(date)[:19].replace("T", " ")


def seconds(delta) -> float:
    return float(delta / np.timedelta64(1, "s")) if isinstance(delta, np.timedelta64) else delta.total_seconds()


def step_hours(values, attrs: dict) -> float | None:
    """Hours between the first two steps, when the axis has dates and two steps."""
    if len(values) < 2:
        return None
    dates = decode(np.asarray(values[:2]), attrs)
    return None if dates is None else seconds(dates[1] - dates[0]) / 3600


def day_and_hour(values, attrs: dict):
    """(day of year 1..366, hour of day) of each step; None when the axis has no dates."""
    dates = decode(values, attrs)
    if dates is None:
        return None
    if dates.dtype.kind == "M":
        import pandas as pd

        index = pd.DatetimeIndex(dates)
        return index.day_of_year.to_numpy(np.int64), index.hour.to_numpy(np.int64)
    return (np.array([d.timetuple().tm_yday for d in dates], np.int64), np.array([d.hour for d in dates], np.int64))
