"""The climatology ingest writes (``preprocess/climatology.py``) against an independent computation from the
data: per grid point, the mean of the train steps of each hour of day within a window of days around each day
of year (wrapping around the year), the hour's train mean where the window holds no train step; the train mean
per grid point when the time axis has no dates; resumable like the data."""

from __future__ import annotations

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

from test_climate_sources import STARTS, STEPS, pressure_levels  # noqa: E402

from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402


def _expected(root, window):
    data = np.asarray(root["data"][...], np.float64)
    dates = pd.DatetimeIndex(xr.coding.times.decode_cf_datetime(root["time"][...], root["time"].attrs["units"],
                                                                 root["time"].attrs.get("calendar")))
    train = np.zeros(len(dates), bool)
    for a, b in root.attrs["splits"]["train"]:
        train[a:b] = True
    hours = sorted(set(dates.hour))
    out = np.empty((366, len(hours)) + data.shape[1:])
    filled = 0
    for s, h in enumerate(hours):
        of_hour = train & (dates.hour == h)
        for d in range(1, 367):
            gap = np.abs(dates.day_of_year.to_numpy() - d)
            near = np.minimum(gap, 366 - gap) <= window // 2
            members = of_hour & near
            if members.any():
                out[d - 1, s] = data[members].mean(0)
            else:
                out[d - 1, s] = data[of_hour].mean(0)
                filled += 1
    return out, hours, filled


@pytest.mark.parametrize("window", [61, 3])
def test_climatology_is_the_windowed_mean_of_the_train_steps(tmp_path, window):
    for k, start in enumerate(STARTS):
        pressure_levels(tmp_path / f"pl_{k}.nc", start, seed=k)
    store = tmp_path / "g.zarr"
    ingest_climate(str(tmp_path / "*.nc"), store, progress=False, split=(0.5, 0.25, 0.25), climatology_window=window,
                   chunk_bytes=256)
    root = zarr.open_group(store, mode="r")
    expected, hours, filled = _expected(root, window)
    clim = root["climatology"]
    assert clim.shape == expected.shape
    np.testing.assert_allclose(np.asarray(clim[...]), expected.astype(np.float32), rtol=2e-6)
    info = root.attrs["grid"]["climatology"]
    assert info["hours"] == hours == [0, 6, 12, 18] and info["window_days"] == window and info["dated"] is True
    channels = root.attrs["grid"]["variables"]
    assert info["filled_entries"] == {c: filled for c in channels}  # every channel and point alike
    # three days of train data reach 2 x 30 more days of the year with a 61-day window, 2 x 1 with 3 days
    assert filled == 4 * (366 - (3 + 2 * (window // 2)))


def test_without_dates_the_climatology_is_the_train_mean(tmp_path):
    from test_ingest_grid import _grid_source

    v = np.random.default_rng(0).normal(size=(10, 5, 8)).astype(np.float32)
    src = _grid_source(tmp_path / "src.zarr", v, time=False)
    ingest_climate(src, tmp_path / "g.zarr", progress=False, split=(0.6, 0.2, 0.2))
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    (a, b), = root.attrs["splits"]["train"]
    assert root["climatology"].shape == (1, 1, 1, 5, 8) and root.attrs["grid"]["climatology"]["dated"] is False
    np.testing.assert_allclose(root["climatology"][0, 0, 0], v[a:b].astype(np.float64).mean(0), rtol=1e-6)


def test_an_interrupted_climatology_resumes(tmp_path, monkeypatch):
    from domainflow.preprocess import ingest_grid

    for k, start in enumerate(STARTS):
        pressure_levels(tmp_path / f"pl_{k}.nc", start, seed=k)
    ref = tmp_path / "ref.zarr"
    ingest_climate(str(tmp_path / "*.nc"), ref, progress=False, split=(0.5, 0.25, 0.25))
    real, calls = ingest_grid.climatology_band, []

    def dying(store, channel, *args, **kw):
        calls.append(channel)
        if len(calls) == 3:
            raise OSError("disk full (test)")
        return real(store, channel, *args, **kw)

    monkeypatch.setattr(ingest_grid, "climatology_band", dying)
    store = tmp_path / "g.zarr"
    with pytest.raises(OSError, match="disk full"):
        ingest_climate(str(tmp_path / "*.nc"), store, progress=False, split=(0.5, 0.25, 0.25))
    assert zarr.open_group(store, mode="r").attrs["domainflow"]["complete"] is False
    monkeypatch.setattr(ingest_grid, "climatology_band", real)
    report = ingest_climate(str(tmp_path / "*.nc"), store, progress=False, split=(0.5, 0.25, 0.25))
    assert report.state == "resume" and len(report.kept) == 3  # the data blocks are not read again
    np.testing.assert_array_equal(zarr.open_group(store, mode="r")["climatology"][...],
                                  zarr.open_group(ref, mode="r")["climatology"][...])


def test_an_hour_without_train_steps_takes_the_train_mean(tmp_path):
    """Each hour is a task of its own (an hourly 0.25-degree series' sums of every hour do not fit a worker); an
    hour no train step has gets the train mean of every hour, per grid point."""
    for k, start in enumerate(STARTS):
        pressure_levels(tmp_path / f"pl_{k}.nc", start, seed=k)
    store = tmp_path / "g.zarr"
    T = len(STARTS) * STEPS
    train_steps = 2  # 00 and 06 UTC of the first day: no 12 or 18 UTC step in the train split
    ingest_climate(str(tmp_path / "*.nc"), store, progress=False, split=(train_steps / T, 0.5 - train_steps / T, 0.5),
                   chunk_bytes=256)
    root = zarr.open_group(store, mode="r")
    assert root.attrs["splits"]["train"] == [[0, train_steps]]
    assert root["climatology"].chunks[1] == 1  # one hour per chunk
    data = np.asarray(root["data"][...], np.float64)
    clim = np.asarray(root["climatology"][...])
    mean = data[:train_steps].mean(0)
    for slot in (2, 3):  # 12 and 18 UTC
        np.testing.assert_allclose(clim[:, slot], np.broadcast_to(mean, clim[:, slot].shape).astype(np.float32),
                                   rtol=2e-6)
    np.testing.assert_allclose(clim[0, 0], data[0].astype(np.float32), rtol=2e-6)  # day 1, 00 UTC: its one step
