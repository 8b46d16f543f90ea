"""Which entry of a grid store's climatology each time step uses: ``climatology (366, S, C, H, W)`` is indexed
by day of year (0..365) and hour slot (the position of the step's hour among the S hours of day the time
axis holds); a time axis without dates has one entry (day 0, slot 0)."""

from __future__ import annotations

import numpy as np

from .time_axis import day_and_hour

DAYS = 366


def day_and_slot(time_values, attrs) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(day index 0..365 of each step, hour slot of each step, the hours of the slots); one slot and day 0
    for every step when the axis has no dates."""
    keys = day_and_hour(time_values, attrs)
    n = len(time_values)
    if keys is None:
        return np.zeros(n, np.int64), np.zeros(n, np.int64), []
    doy, hour = keys
    hours = sorted(set(int(h) for h in hour))
    slot = np.searchsorted(np.array(hours), hour)
    return doy - 1, slot, hours
