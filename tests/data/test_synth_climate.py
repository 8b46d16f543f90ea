"""Tests for domainflow.preprocess.synth_climate: store layout, determinism, plausibility, periodicity,
wave propagation, pole-safe advection, atomic writes and argument checks."""

from __future__ import annotations

import math
import warnings
from datetime import datetime

import numpy as np
import pytest
import zarr

import domainflow.preprocess.synth_climate as sc
from domainflow.preprocess.synth_climate import VARIABLES, synth_climate

GRID = (32, 64)
STEPS = 20
CHUNK = 8
DT = 6


def _open(path):
    return zarr.open_group(str(path), mode="r")


def _read(path, name):
    return _open(path)[name][...]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "era5_synth.zarr"
    return synth_climate(out, grid=GRID, steps=STEPS, seed=0, dt_hours=DT, time_chunk=CHUNK)


@pytest.fixture(scope="module")
def fields(store):
    return {name: _read(store, name).astype(np.float64) for name in VARIABLES}


# ------------------------------------------------------------------------------------------- layout


def test_variables_order():
    assert VARIABLES == ("t2m", "u10", "v10", "msl", "tcwv")


def test_variable_arrays(store):
    g = _open(store)
    h, w = GRID
    expected_units = {"t2m": "K", "u10": "m s**-1", "v10": "m s**-1", "msl": "Pa", "tcwv": "kg m**-2"}
    for name in VARIABLES:
        arr = g[name]
        assert arr.dtype == np.float32
        assert arr.shape == (STEPS, h, w)
        assert arr.chunks == (CHUNK, h, w)
        assert arr.metadata.dimension_names == ("time", "latitude", "longitude")
        assert arr.attrs["units"] == expected_units[name]
        assert arr.attrs["long_name"] and arr.attrs["standard_name"]
    assert g["u10"].attrs["standard_name"] == "eastward_wind"
    assert g["v10"].attrs["standard_name"] == "northward_wind"


def test_coordinates(store):
    g = _open(store)
    h, w = GRID
    lat, lon, time = g["latitude"], g["longitude"], g["time"]
    assert lat.dtype == np.float64 and lon.dtype == np.float64 and time.dtype == np.int64
    assert lat.metadata.dimension_names == ("latitude",)
    assert lon.metadata.dimension_names == ("longitude",)
    assert time.metadata.dimension_names == ("time",)
    la, lo, ti = lat[...], lon[...], time[...]
    assert la.shape == (h,) and np.all(np.diff(la) < 0), "latitude must descend (north first)"
    assert np.all(np.abs(la) < 90) and la[0] > 80 and la[-1] < -80
    np.testing.assert_allclose(la + la[::-1], 0, atol=1e-12)  # symmetric about the equator
    assert lo.shape == (w,) and lo[0] == 0 and lo[-1] < 360 and np.all(np.diff(lo) > 0)
    np.testing.assert_allclose(np.diff(lo), 360 / w)
    assert lat.attrs["units"] == "degrees_north" and lon.attrs["units"] == "degrees_east"
    assert time.attrs["units"] == "hours since 1900-01-01 00:00:00.0"
    assert time.attrs["calendar"] == "gregorian"
    start = (datetime(2020, 1, 1) - datetime(1900, 1, 1)).total_seconds() / 3600
    assert ti[0] == start and np.all(np.diff(ti) == DT)


def test_group_attrs_and_consolidated(store):
    g = _open(store)
    assert g.attrs["Conventions"] == "CF-1.6"
    assert "synth_climate" in g.attrs["source"] and "synth_climate" in g.attrs["history"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cons = zarr.open_consolidated(str(store), zarr_format=3)
    assert set(VARIABLES) | {"time", "latitude", "longitude"} <= set(cons.array_keys())


def test_partial_last_chunk_is_filled(tmp_path):
    path = synth_climate(tmp_path / "s.zarr", grid=(8, 16), steps=5, time_chunk=2)
    for name in VARIABLES:
        arr = _open(path)[name]
        assert arr.chunks == (2, 8, 16)
        assert np.all(np.isfinite(arr[...]))


# ------------------------------------------------------------------------------ values, determinism


def test_deterministic(store, fields, tmp_path):
    again = synth_climate(tmp_path / "again.zarr", grid=GRID, steps=STEPS, seed=0, dt_hours=DT, time_chunk=CHUNK)
    other = synth_climate(tmp_path / "other.zarr", grid=GRID, steps=STEPS, seed=1, dt_hours=DT, time_chunk=CHUNK)
    for name in VARIABLES:
        np.testing.assert_array_equal(_read(again, name), fields[name].astype(np.float32))
        assert not np.array_equal(_read(other, name), fields[name].astype(np.float32)), name


def test_finite_and_plausible(store, fields):
    lat = _read(store, "latitude")
    weights = np.cos(np.deg2rad(lat))
    tropics, polar = np.abs(lat) < 20, np.abs(lat) > 65
    for name, a in fields.items():
        assert np.all(np.isfinite(a)), name
    t2m, tcwv, msl = fields["t2m"], fields["tcwv"], fields["msl"]
    assert 225 < t2m.min() and t2m.max() < 315
    assert t2m[:, tropics].mean() > t2m[:, polar].mean() + 20
    assert 0 <= tcwv.min() and tcwv.max() < 75
    assert tcwv[:, tropics].mean() > 30 > 10 > tcwv[:, polar].mean()
    assert 95000 < msl.min() and msl.max() < 106000 and msl.std() > 300
    global_mean = (msl.mean(axis=2) * weights).sum(axis=1) / weights.sum()
    np.testing.assert_allclose(global_mean, 101325, atol=50)
    speed = np.hypot(fields["u10"], fields["v10"])
    assert 5 < speed.max() < 30
    zonal_u = fields["u10"].mean(axis=(0, 2))
    assert zonal_u[(np.abs(lat) > 40) & (np.abs(lat) < 55)].mean() > 3, "midlatitude westerlies"
    assert zonal_u[(np.abs(lat) > 5) & (np.abs(lat) < 20)].mean() < -2, "tropical easterlies"


def test_geostrophic_msl(store, fields):
    """In midlatitudes u10 ~ -(1/(rho f)) dp/dy: the pressure gradient and the wind agree in sign."""
    lat = np.deg2rad(_read(store, "latitude"))
    dy = sc.EARTH_RADIUS * (lat[1] - lat[0])
    dpdy = np.gradient(fields["msl"], dy, axis=1)
    f = 2 * sc.OMEGA * np.sin(lat)[None, :, None]
    ug = -dpdy / (sc.RHO_AIR * f)
    band = (np.abs(lat) > np.deg2rad(30)) & (np.abs(lat) < np.deg2rad(70))
    u = fields["u10"][:, band]
    assert np.corrcoef(ug[:, band].ravel(), u.ravel())[0, 1] > 0.95


@pytest.mark.parametrize("m, n", [(1, 1), (1, 2), (2, 4), (3, 5), (5, 8)])
def test_legendre_derivatives(m, n):
    phi = np.linspace(-1.5, 1.5, 3001)
    p, dp, pc = sc.legendre(m, n, phi)
    np.testing.assert_allclose(pc * np.cos(phi), p, rtol=1e-12, atol=1e-12)
    scale = np.abs(dp).max()
    np.testing.assert_allclose(dp[1:-1], np.gradient(p, phi)[1:-1], atol=1e-4 * scale)


def test_winds_are_non_divergent():
    """u, v come from a streamfunction: divergence is discretisation noise next to vorticity."""
    grid = sc.make_grid(90, 180)
    u, v = sc.Flow(grid, sc.wave_modes(0)).winds(3600.0)
    phi = grid.phi[:, None]
    a, cos = sc.EARTH_RADIUS, np.cos(phi)
    k = 1j * np.fft.rfftfreq(u.shape[1], 1.0 / u.shape[1])

    def d_lam(f):
        return np.fft.irfft(k * np.fft.rfft(f, axis=1), n=f.shape[1], axis=1)

    def d_phi(f):
        return np.gradient(f, grid.phi, axis=0)

    div = (d_lam(u) + d_phi(v * cos)) / (a * cos)
    vort = (d_lam(v) - d_phi(u * cos)) / (a * cos)
    inner = np.abs(grid.lat) < 70
    assert np.sqrt(np.mean(div[inner] ** 2)) < 0.01 * np.sqrt(np.mean(vort[inner] ** 2))


def test_seam_is_continuous(fields):
    for name, a in fields.items():
        a = a - a.mean(axis=2, keepdims=True)
        seam = np.abs(a[..., 0] - a[..., -1])
        neighbours = np.abs(np.diff(a, axis=2))
        assert seam.max() <= 1.5 * neighbours.max() + 1e-6, name
        assert seam.mean() <= 3 * neighbours.mean() + 1e-6, name


# ------------------------------------------------------------------------------------------ dynamics


def test_fields_change_in_time(fields):
    for name, a in fields.items():
        change = np.abs(np.diff(a, axis=0)).mean()
        assert change > 1e-3 * (np.abs(a).mean() + 1), name


def _lag_shift(a, lag):
    """Longitude shift (grid columns) maximising the lag-`lag` correlation of zonal anomalies."""
    a = a - a.mean(axis=-1, keepdims=True)
    w = a.shape[-1]
    corr = [np.sum(a[:-lag] * np.roll(a[lag:], -s, axis=-1)) for s in range(w)]
    s = int(np.argmax(corr))
    return s - w if s > w // 2 else s


def test_wave_pattern_propagates_westward(store, fields):
    lat = _read(store, "latitude")
    band = (lat > 30) & (lat < 65)
    for name in ("v10", "msl"):
        shifts = [_lag_shift(fields[name][:, band], lag) for lag in (1, 2)]
        assert shifts[0] < 0, (name, shifts)  # westward: the pattern reappears at smaller longitude
        assert shifts[1] <= shifts[0], (name, shifts)


def test_wave_phase_speeds_follow_dispersion(fields):
    """Each zonal wavenumber's phase in v10 advances by -m c dt per step, c from Rossby-Haurwitz."""
    v = fields["v10"]
    spec = np.fft.rfft(v, axis=2)  # (T, H, W//2 + 1)
    dt = DT * 3600.0
    for mode in sc.wave_modes(0):
        row = int(np.argmax(np.abs(spec[0, :, mode.m])))
        dphase = np.angle(spec[1:, row, mode.m] / spec[:-1, row, mode.m])
        expected = math.remainder(-mode.m * mode.speed * dt, 2 * math.pi)
        np.testing.assert_allclose(dphase, expected, atol=1e-3)
        assert mode.speed < sc.doppler_rotation(mode.m, mode.n), "westward relative to the flow"
        assert mode.speed == pytest.approx(sc.rossby_haurwitz_speed(mode.n, sc.doppler_rotation(mode.m, mode.n)))


@pytest.mark.parametrize("w", [90, 91])
def test_advection_carries_blob_over_the_pole(w):
    """Solid-body rotation about the x axis: a blob at (0N, 90E) goes over the north pole to (0N, 270E)."""
    grid = sc.make_grid(45, w)
    model = sc.TracerModel(grid, sc.Flow(grid, sc.wave_modes(0)), seed=0)
    x = model.xyz
    blob = np.exp(-(np.arccos(np.clip(x[1], -1, 1)) / np.deg2rad(15)) ** 2)[None]
    rate = 2 * np.pi / 86400  # one turn a day
    vel = rate * sc.EARTH_RADIUS * np.stack([np.zeros_like(x[0]), -x[2], x[1]])
    np.testing.assert_allclose(model.advect(blob, 0 * vel, 3600.0), blob, atol=1e-12)
    field, n = blob, 36
    area = np.cos(grid.phi)[:, None]
    for k in range(1, n + 1):
        field = model.advect(field, vel, 0.5 * 86400 / n)
        if k in (n // 2, n):
            centre = (x * field[0] * area).sum(axis=(1, 2))
            centre /= np.linalg.norm(centre)
            target = [0, 0, 1] if k == n // 2 else [0, -1, 0]
            assert np.dot(centre, target) > math.cos(np.deg2rad(3)), (k, centre)
    assert 0.5 < field.max() <= 1 + 1e-9 and field.min() >= -1e-12


# ------------------------------------------------------------------------------------ writing, errors


def test_existing_store_refused_unless_overwrite(tmp_path):
    out = tmp_path / "s.zarr"
    synth_climate(out, grid=(8, 16), steps=2, seed=0)
    first = _read(out, "t2m")
    with pytest.raises(ValueError, match="overwrite=True"):
        synth_climate(out, grid=(8, 16), steps=2, seed=1)
    np.testing.assert_array_equal(_read(out, "t2m"), first)
    synth_climate(out, grid=(8, 16), steps=2, seed=1, overwrite=True)
    assert not np.array_equal(_read(out, "t2m"), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def _fail_on_second_chunk(monkeypatch):
    real, calls = sc._write_chunk, []

    def flaky(arrays, start, block):
        calls.append(start)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        real(arrays, start, block)

    monkeypatch.setattr(sc, "_write_chunk", flaky)


def test_failure_midway_leaves_no_store(tmp_path, monkeypatch):
    _fail_on_second_chunk(monkeypatch)
    out = tmp_path / "raw" / "s.zarr"
    with pytest.raises(RuntimeError, match="simulated crash"):
        synth_climate(out, grid=(8, 16), steps=6, time_chunk=2)
    assert not out.exists()
    assert list(out.parent.iterdir()) == [], "temporary store left behind"


def test_failure_during_overwrite_keeps_old_store(tmp_path, monkeypatch):
    out = tmp_path / "s.zarr"
    synth_climate(out, grid=(8, 16), steps=6, time_chunk=2, seed=0)
    before = _read(out, "msl")
    _fail_on_second_chunk(monkeypatch)
    with pytest.raises(RuntimeError):
        synth_climate(out, grid=(8, 16), steps=6, time_chunk=2, seed=3, overwrite=True)
    np.testing.assert_array_equal(_read(out, "msl"), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_writes_one_time_chunk_at_a_time(tmp_path, monkeypatch):
    real, seen = sc._write_chunk, []

    def spy(arrays, start, block):
        seen.append((start, block.shape))
        real(arrays, start, block)

    monkeypatch.setattr(sc, "_write_chunk", spy)
    synth_climate(tmp_path / "s.zarr", grid=(8, 16), steps=7, time_chunk=3)
    assert seen == [(0, (5, 3, 8, 16)), (3, (5, 3, 8, 16)), (6, (5, 1, 8, 16))]


def test_progress_bar(tmp_path, capsys):
    synth_climate(tmp_path / "s.zarr", grid=(8, 16), steps=4, time_chunk=2, progress=True)
    assert "synth_climate" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    ({"grid": (3, 16)}, "H"),
    ({"grid": (8, 3)}, "W"),
    ({"grid": (8,)}, "grid"),
    ({"steps": 0}, "steps"),
    ({"time_chunk": 0}, "time_chunk"),
    ({"dt_hours": 0}, "dt_hours"),
    ({"dt_hours": -6}, "dt_hours"),
    ({"dt_hours": 1.5}, "dt_hours"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    out = tmp_path / "s.zarr"
    with pytest.raises(ValueError, match=match):
        synth_climate(out, **{"grid": (8, 16), **kwargs})
    assert list(tmp_path.iterdir()) == []
