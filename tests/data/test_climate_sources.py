"""``ingest climate`` reads ERA5 as it is downloaded: netCDF files written by xarray/netCDF4 the way the CDS writes
them (``valid_time``, packed int16, descending latitude, single-level and pressure-level files side by side, one
file per period), named as files, folders or globs. The store must hold exactly what ``xarray.open_mfdataset``
decodes; files that do not make one series are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")
pytest.importorskip("netCDF4")

from store_compare import assert_same_store  # noqa: E402

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402

H, W, STEPS = 9, 16, 8                      # a 22.5-degree global grid, 8 six-hourly steps per file
LEVELS = [1000, 850, 500]                   # as the CDS orders them
PACK = {"dtype": "int16", "_FillValue": -32767}


def _coords(start, lat_name="latitude", lon_name="longitude", time_name="valid_time", lon0=0.0):
    return {time_name: pd.date_range(start, periods=STEPS, freq="6h"),
            lat_name: (lat_name, np.linspace(90, -90, H), {"units": "degrees_north"}),
            lon_name: (lon_name, lon0 + np.arange(W) * 360.0 / W, {"units": "degrees_east"})}


def _packing(values) -> dict:
    lo, hi = float(np.nanmin(values)), float(np.nanmax(values))
    scale = (hi - lo) / 60000 or 1.0
    return {**PACK, "scale_factor": scale, "add_offset": (hi + lo) / 2}


def single_levels(path, start, seed, missing=None, **names):
    """A CDS single-level download: t2m (K) and msl (Pa), packed int16."""
    rng = np.random.default_rng(seed)
    t2m = 270 + 15 * rng.standard_normal((STEPS, H, W))
    msl = 101325 + 900 * rng.standard_normal((STEPS, H, W))
    if missing is not None:
        t2m[missing] = np.nan
    tdim, latd, lond = names.get("time_name", "valid_time"), names.get("lat_name", "latitude"), names.get("lon_name", "longitude")
    dims = (tdim, latd, lond)
    ds = xr.Dataset({"t2m": (dims, t2m, {"units": "K", "long_name": "2 metre temperature"}),
                     "msl": (dims, msl, {"units": "Pa", "long_name": "Mean sea level pressure"})},
                    coords=_coords(start, **names))
    ds.to_netcdf(path, encoding={"t2m": _packing(t2m), "msl": _packing(msl)})
    return ds


def pressure_levels(path, start, seed, missing=None, level_name="pressure_level", level_values=LEVELS,
                    level_units="hPa", **names):
    """A CDS pressure-level download: z (m2 s-2) and t (K) on (valid_time, pressure_level, lat, lon)."""
    rng = np.random.default_rng(seed)
    n = len(level_values)
    z = 9.81 * (5500 + 300 * rng.standard_normal((STEPS, n, H, W)))
    t = 250 + 10 * rng.standard_normal((STEPS, n, H, W))
    if missing is not None:
        z[missing] = np.nan
    tdim, latd, lond = names.get("time_name", "valid_time"), names.get("lat_name", "latitude"), names.get("lon_name", "longitude")
    dims = (tdim, level_name, latd, lond)
    coords = _coords(start, **names)
    coords[level_name] = (level_name, np.asarray(level_values, dtype=float), {"units": level_units})
    ds = xr.Dataset({"z": (dims, z, {"units": "m**2 s**-2", "long_name": "Geopotential"}),
                     "t": (dims, t, {"units": "K", "long_name": "Temperature"})}, coords=coords)
    ds.to_netcdf(path, encoding={"z": _packing(z), "t": _packing(t)})
    return ds


STARTS = ["2020-01-01", "2020-01-03", "2020-01-05"]  # three files of 8 six-hourly steps: one series


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    folder = tmp_path_factory.mktemp("era5")
    for k, start in enumerate(STARTS):
        single_levels(folder / f"era5_sl_{start}.nc", start, seed=k)
        pressure_levels(folder / f"era5_pl_{start}.nc", start, seed=10 + k)
    return folder


CHANNELS = ["msl", "t500", "t850", "t1000", "t2m", "z500", "z850", "z1000"]


def _reference(folder):
    files = sorted(str(p) for p in folder.glob("*.nc"))
    return xr.open_mfdataset(files, combine="by_coords")


def _expected(ref, channel):
    if channel in ("msl", "t2m"):
        return ref[channel].values
    var, level = channel[0], int(channel[1:])
    return ref[var].sel(pressure_level=level).values


def test_cds_netcdf_files_ingest_as_open_mfdataset_decodes_them(raw, tmp_path, capsys):
    store = tmp_path / "g.zarr"
    report = ingest_climate(str(raw / "*.nc"), store, progress=False, split=(0.5, 0.25, 0.25))
    assert report.state == "new" and len(report.written) == 3  # one block per month of files
    root = zarr.open_group(store, mode="r")
    assert root.attrs["grid"]["variables"] == CHANNELS
    assert root.attrs["grid"]["levels"] == {"t": [500.0, 850.0, 1000.0], "z": [500.0, 850.0, 1000.0]}
    assert root.attrs["fields"]["grid/z500"]["units"] == "m**2 s**-2"
    assert root.attrs["fields"]["grid/z500"]["level_hpa"] == 500.0
    with _reference(raw) as ref:
        for c, name in enumerate(CHANNELS):
            np.testing.assert_array_equal(np.asarray(root["data"][:, c]), _expected(ref, name).astype(np.float32))
        np.testing.assert_array_equal(root["lat"][...], ref["latitude"].values)  # descending, as given
        times = xr.coding.times.decode_cf_datetime(root["time"][...], root["time"].attrs["units"],
                                                   root["time"].attrs.get("calendar"))
        np.testing.assert_array_equal(times, ref["valid_time"].values)
    assert root.attrs["grid"]["periodic_lon"] is True
    # the folder, or the two kinds of files named apart, give the same store
    for items in ([raw], [str(raw / "era5_pl_*.nc"), str(raw / "era5_sl_*.nc")]):
        other = tmp_path / f"g{len(items)}.zarr"
        ingest_climate(items, other, progress=False, split=(0.5, 0.25, 0.25))
        assert_same_store(store, other)
    # a rerun is a no-op; another set of files is another ingest
    assert ingest_climate(str(raw / "*.nc"), store, progress=False, split=(0.5, 0.25, 0.25)).state == "complete"
    with pytest.raises(IngestError, match="different options"):
        ingest_climate([str(raw / "era5_sl_*.nc")], store, progress=False, split=(0.5, 0.25, 0.25))
    assert cli(["inspect", str(store), "--domain", "1"]) == 0
    out = capsys.readouterr().out
    assert "2020-01-01 00:00:00 .. 2020-01-06 18:00:00, every 6 h" in out
    assert "pressure levels (hPa): t: 500, 850, 1000; z: 500, 850, 1000" in out


def test_levels_and_variables_choose_the_channels(raw, tmp_path):
    def channels(**kw):
        path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.zarr"
        ingest_climate(str(raw / "*.nc"), path, progress=False, split=(0.5, 0.25, 0.25), **kw)
        return zarr.open_group(path, mode="r").attrs["grid"]["variables"]

    assert channels(levels=(500,)) == ["msl", "t500", "t2m", "z500"]
    assert channels(variables=("z", "t2m"), levels=(850, 500)) == ["z500", "z850", "t2m"]
    assert channels(variables=("t850", "msl")) == ["t850", "msl"]
    with pytest.raises(IngestError, match=r"--levels \[700.0\] hPa are not in the source.*500.0, 850.0, 1000.0"):
        ingest_climate(str(raw / "*.nc"), tmp_path / "x.zarr", levels=(700, 500), progress=False)
    with pytest.raises(IngestError, match=r"no variable\(s\) \['q'\].*'t', 't2m', 'z'.*'z500'"):
        ingest_climate(str(raw / "*.nc"), tmp_path / "y.zarr", variables=("q",), progress=False)


def test_cmip_style_names_plev_in_pa_and_longitudes_from_minus_180(tmp_path):
    names = {"time_name": "time", "lat_name": "lat", "lon_name": "lon"}
    ref = pressure_levels(tmp_path / "pl.nc", "2001-06-01", seed=4, level_name="plev", level_values=[85000, 50000],
                          level_units="Pa", lon0=-180.0, **names)
    store = tmp_path / "g.zarr"
    ingest_climate(tmp_path / "pl.nc", store, progress=False, split=(0.5, 0.25, 0.25))
    root = zarr.open_group(store, mode="r")
    assert root.attrs["grid"]["variables"] == ["t500", "t850", "z500", "z850"]
    assert root.attrs["grid"]["periodic_lon"] is True
    np.testing.assert_array_equal(root["lon"][...], -180.0 + np.arange(W) * 22.5)
    with xr.open_dataset(tmp_path / "pl.nc") as back:  # what xarray decodes from the file
        np.testing.assert_array_equal(np.asarray(root["data"][:, 2]),
                                      back["z"].sel(plev=50000).values.astype(np.float32))
    assert ref is not None


def test_a_missing_value_is_refused_with_its_date_and_place(tmp_path):
    for k, start in enumerate(STARTS):
        single_levels(tmp_path / f"sl_{k}.nc", start, seed=k)
        # step 3 of the second file, 850 hPa, latitude row 2 (45 N), longitude column 5 (112.5 E)
        pressure_levels(tmp_path / f"pl_{k}.nc", start, seed=10 + k, missing=(3, 1, 2, 5) if k == 1 else None)
    with pytest.raises(IngestError, match=r"variable 'z' at 850 hPa holds 1 missing values.*first at time "
                                          r"index 11 \(2020-01-03 18:00:00\), latitude 45, longitude 112.5.*_FillValue"):
        ingest_climate(str(tmp_path / "*.nc"), tmp_path / "g.zarr", progress=False)


def test_files_that_do_not_make_one_series_are_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    single_levels(a / "sl_1.nc", "2020-01-01", seed=1)
    single_levels(a / "sl_3.nc", "2020-01-05", seed=3)  # 2020-01-03 .. 04 missing
    with pytest.raises(IngestError, match=r"time axis jumps by .* after step 7 \(2020-01-02T18.*sl_1.nc"):
        ingest_climate(a, tmp_path / "g1.zarr", progress=False)
    single_levels(b / "sl_1.nc", "2020-01-01", seed=1)
    single_levels(b / "sl_1b.nc", "2020-01-02", seed=2)  # overlaps the first file's second day
    with pytest.raises(IngestError, match="repeats or goes back"):
        ingest_climate(b, tmp_path / "g2.zarr", progress=False)
    with pytest.raises(IngestError, match="named twice"):
        ingest_climate([str(a / "sl_1.nc"), str(a / "*.nc")], tmp_path / "g3.zarr", progress=False)
    with pytest.raises(IngestError, match="matches no file"):
        ingest_climate(str(a / "*.grib"), tmp_path / "g4.zarr", progress=False)
    c = tmp_path / "c"
    c.mkdir()
    single_levels(c / "sl.nc", "2020-01-01", seed=1)
    pressure_levels(c / "pl.nc", "2020-01-02", seed=1)  # other times than the single-level file
    with pytest.raises(IngestError, match="cover other times"):
        ingest_climate(c, tmp_path / "g5.zarr", progress=False)
    d = tmp_path / "d"
    d.mkdir()
    single_levels(d / "sl.nc", "2020-01-01", seed=1)
    ds = pressure_levels(tmp_path / "x.nc", "2020-01-01", seed=1)
    ds.assign_coords(latitude=ds.latitude.values + 1).to_netcdf(d / "pl.nc")  # another grid
    with pytest.raises(IngestError, match="latitudes differ"):
        ingest_climate(d, tmp_path / "g6.zarr", progress=False)


def test_cli_takes_several_sources_and_levels(raw, tmp_path, capsys):
    store = tmp_path / "g.zarr"
    assert cli(["ingest", "climate", str(raw / "era5_sl_*.nc"), str(raw / "era5_pl_*.nc"), str(store),
                "--levels", "500", "--split", "0.5,0.25,0.25", "--quiet"]) == 0
    assert zarr.open_group(store, mode="r").attrs["grid"]["variables"] == ["msl", "t500", "t2m", "z500"]
    capsys.readouterr()
    assert cli(["ingest", "climate", str(raw / "nothing_*.nc"), str(tmp_path / "h.zarr"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matches no file" in err[0]


def _grib(path, day, seed, short="2t"):
    """Four six-hourly analyses of one surface field on the test grid, written by ecCodes itself."""
    ec = pytest.importorskip("eccodes")
    values = 270 + np.random.default_rng(seed).standard_normal((4, H, W))
    with open(path, "wb") as f:
        for k in range(4):
            h = ec.codes_grib_new_from_samples("regular_ll_sfc_grib2")
            for key, v in [("Ni", W), ("Nj", H), ("latitudeOfFirstGridPointInDegrees", 90),
                           ("longitudeOfFirstGridPointInDegrees", 0), ("latitudeOfLastGridPointInDegrees", -90),
                           ("longitudeOfLastGridPointInDegrees", 337.5), ("iDirectionIncrementInDegrees", 22.5),
                           ("jDirectionIncrementInDegrees", 22.5), ("dataDate", 20200100 + day),
                           ("dataTime", 600 * k), ("shortName", short)]:
                ec.codes_set(h, key, v)
            ec.codes_set_values(h, values[k].ravel())
            ec.codes_write(h, f)
            ec.codes_release(h)


def test_grib_files_ingest_as_cfgrib_decodes_them(tmp_path):
    pytest.importorskip("cfgrib", reason="GRIB needs the grib extra (cfgrib, eccodes)")
    _grib(tmp_path / "a.grib", 1, seed=0)
    _grib(tmp_path / "b.grib", 2, seed=1)
    store = tmp_path / "g.zarr"
    ingest_climate(str(tmp_path / "*.grib"), store, progress=False, split=(0.5, 0.25, 0.25))
    root = zarr.open_group(store, mode="r")
    assert root.attrs["grid"]["variables"] == ["t2m"] and root.attrs["grid"]["source"]["kind"] == "grib"
    for k, name in enumerate(("a.grib", "b.grib")):
        with xr.open_dataset(tmp_path / name, engine="cfgrib", backend_kwargs={"indexpath": ""}) as ref:
            np.testing.assert_array_equal(np.asarray(root["data"][4 * k:4 * k + 4, 0]), ref["t2m"].values)


@pytest.mark.parametrize("fmt", ["NETCDF3_CLASSIC", "NETCDF3_64BIT", "NETCDF4"])
def test_a_netcdf_download_cut_short_is_named(tmp_path, capsys, fmt):
    """netCDF reads the missing end of a truncated classic file as zeros: the last steps (or the time axis) would
    be ingested as data. Every format's truncated file is an error naming it, in one line."""
    path = tmp_path / "era5.nc"
    single_levels(path, "2020-01-01", seed=4).to_netcdf(path, format=fmt)
    data = path.read_bytes()
    for cut in (len(data) - 4, len(data) * 2 // 3):
        path.write_bytes(data[:cut])
        assert cli(["ingest", "climate", str(path), str(tmp_path / "g.zarr"), "--quiet"]) == 1
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
        assert len(err) == 1 and str(path) in err[0], err
        assert ("is cut short" in err[0] and "download it again" in err[0]) if fmt != "NETCDF4" else \
            "not readable as a netcdf file" in err[0], err
    path.write_bytes(data)
    assert cli(["ingest", "climate", str(path), str(tmp_path / "g.zarr"), "--quiet", "--split", "0.5,0.25,0.25"]) == 0
