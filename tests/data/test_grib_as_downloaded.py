"""``ingest climate`` of GRIB files as ECMWF and the CDS deliver them, written here by ecCodes itself (messages
from its own samples with ERA5's keys): every hypercube of a file ingested (an accumulated field next to an
instantaneous one), dates as valid times (reference time + step), forecasts with a step dim, one file per
hour, ensembles through ``--member``, levels in hPa and Pa in one file. Values equal cfgrib's own decoding of
each hypercube. Damaged downloads (a file cut inside a message or between messages, overwritten bytes) and
grids that are not regular latitude-longitude are named errors, never missing values or dropped variables."""

from __future__ import annotations

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")
ec = pytest.importorskip("eccodes")
cfgrib = pytest.importorskip("cfgrib", reason="GRIB needs the grib extra (cfgrib, eccodes)")

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402

H, W = 9, 16                                 # a 22.5-degree global grid
SPLIT = (0.5, 0.25, 0.25)


def _message(f, short, date, time, values, step=0, accum=False, level=None, level_type=None, number=None,
             sample="regular_ll_sfc_grib2"):
    """One GRIB 2 message on the test grid, written by ecCodes."""
    h = ec.codes_grib_new_from_samples(sample)
    try:
        for key, v in [("Ni", W), ("Nj", H), ("latitudeOfFirstGridPointInDegrees", 90),
                       ("longitudeOfFirstGridPointInDegrees", 0), ("latitudeOfLastGridPointInDegrees", -90),
                       ("longitudeOfLastGridPointInDegrees", 337.5), ("iDirectionIncrementInDegrees", 22.5),
                       ("jDirectionIncrementInDegrees", 22.5), ("dataDate", date), ("dataTime", time)]:
            ec.codes_set(h, key, v)
        if number is not None:  # an ensemble member: ECMWF's ensemble product template
            ec.codes_set(h, "productDefinitionTemplateNumber", 1)
            ec.codes_set(h, "typeOfEnsembleForecast", 3)
            ec.codes_set(h, "numberOfForecastsInEnsemble", 10)
            ec.codes_set(h, "perturbationNumber", number)
        if level_type is not None:
            ec.codes_set(h, "typeOfLevel", level_type)
        if level is not None:
            ec.codes_set(h, "level", level)
        if accum:  # an accumulation over the forecast's first `step` hours (ERA5's tp)
            ec.codes_set(h, "productDefinitionTemplateNumber", 8)
            ec.codes_set(h, "stepType", "accum")
        ec.codes_set(h, "shortName", short)
        if accum:
            ec.codes_set(h, "stepRange", f"0-{step}")
        else:
            ec.codes_set(h, "step", step)
        ec.codes_set_values(h, np.asarray(values, np.float64).ravel())
        ec.codes_write(h, f)
    finally:
        ec.codes_release(h)


def _field(rng, base=270.0):
    return base + rng.standard_normal((H, W))


def _cubes(path) -> dict:
    """{variable: DataArray} of every hypercube of a file as cfgrib decodes it."""
    out = {}
    for ds in cfgrib.open_datasets(str(path), backend_kwargs={"indexpath": ""}):
        for name, da in ds.data_vars.items():
            out[name] = da.load()
    return out


def _store(path):
    return zarr.open_group(path, mode="r")


def test_every_hypercube_ingests_at_its_valid_time(tmp_path, capsys):
    """Analyses of 2t at 00 UTC and the accumulated tp of the previous day's forecast (reference time a day
    before): cfgrib's open_dataset reads 2t and drops tp; both must be in the store, at the valid times, with
    tp's step type kept."""
    rng = np.random.default_rng(0)
    path = tmp_path / "era5.grib"
    with open(path, "wb") as f:
        for day in range(1, 5):
            _message(f, "2t", 20200100 + day, 0, _field(rng))
            _message(f, "tp", 20200100 + day - 1 if day > 1 else 20191231, 0, rng.random((H, W)) * 1e-3, step=24,
                     accum=True)
    with xr.open_dataset(path, engine="cfgrib", backend_kwargs={"indexpath": ""}) as one:
        assert list(one.data_vars) == ["t2m"]  # what a single open_dataset gives: tp is dropped
    store = tmp_path / "g.zarr"
    ingest_climate(str(path), store, progress=False, split=SPLIT)
    root = _store(store)
    assert root.attrs["grid"]["variables"] == ["t2m", "tp"]
    cubes = _cubes(path)
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), cubes["t2m"].values)
    np.testing.assert_array_equal(np.asarray(root["data"][:, 1]), cubes["tp"].values)
    dates = xr.coding.times.decode_cf_datetime(np.asarray(root["time"][:]), root["time"].attrs["units"],
                                               root["time"].attrs.get("calendar"))
    np.testing.assert_array_equal(dates, cubes["tp"].valid_time.values)
    assert str(dates[0])[:10] == "2020-01-01"  # the valid time, not the forecast's start (2019-12-31)
    assert root["time"].attrs["meaning"].startswith("valid time")
    assert root.attrs["fields"]["grid/tp"]["step_type"] == "accum"
    assert root.attrs["fields"]["grid/t2m"]["step_type"] == "instant"
    assert cli(["inspect", str(store)]) == 0
    shown = capsys.readouterr().out
    assert "channel units: t2m [K], tp [m] (accum)" in shown, shown
    assert "(valid time (reference time + step))" in shown, shown


def test_a_lone_accumulated_field_is_dated_by_its_valid_time(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "tp.grib"
    with open(path, "wb") as f:
        for day in range(1, 5):
            _message(f, "tp", 20200100 + day, 0, rng.random((H, W)), step=24, accum=True)
    store = tmp_path / "g.zarr"
    ingest_climate(str(path), store, progress=False, split=SPLIT)
    root = _store(store)
    dates = xr.coding.times.decode_cf_datetime(np.asarray(root["time"][:]), root["time"].attrs["units"],
                                               root["time"].attrs.get("calendar"))
    assert str(dates[0])[:10] == "2020-01-02" and str(dates[-1])[:10] == "2020-01-05"


def test_a_forecast_with_a_step_dim_and_one_file_per_hour_are_series(tmp_path):
    rng = np.random.default_rng(2)
    fc = tmp_path / "fc.grib"  # two forecasts (00 and 12 UTC) of steps 0 and 6: valid every 6 hours
    with open(fc, "wb") as f:
        for t in (0, 1200):
            for step in (0, 6):
                _message(f, "2t", 20200101, t, _field(rng), step=step)
    cube = _cubes(fc)["t2m"]
    assert cube.dims[:2] == ("time", "step")
    store = tmp_path / "fc.zarr"
    ingest_climate(str(fc), store, progress=False, split=SPLIT)
    root = _store(store)
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), cube.values.reshape(4, H, W))
    np.testing.assert_array_equal(np.asarray(root["time"][:]), cube.valid_time.values.reshape(-1)
                                  .astype("datetime64[s]").astype(np.int64))
    hourly = tmp_path / "hourly"  # one GRIB per hour, as many download ERA5: a scalar time each
    hourly.mkdir()
    for hour in range(4):
        with open(hourly / f"2t_2020010100{hour:02d}.grib", "wb") as f:
            _message(f, "2t", 20200101, 100 * hour, _field(rng))
    store = tmp_path / "hourly.zarr"
    ingest_climate(str(hourly), store, progress=False, split=SPLIT)
    root = _store(store)
    assert root.attrs["grid"]["shape"] == [4, H, W]
    for hour in range(4):
        with xr.open_dataset(hourly / f"2t_2020010100{hour:02d}.grib", engine="cfgrib",
                             backend_kwargs={"indexpath": ""}) as one:
            np.testing.assert_array_equal(np.asarray(root["data"][hour, 0]), one["t2m"].values)


def test_an_ensemble_needs_a_member_and_gives_that_member(tmp_path, capsys):
    rng = np.random.default_rng(3)
    path = tmp_path / "ens.grib"
    with open(path, "wb") as f:
        for day in (1, 2, 3, 4):
            for number in (0, 1, 2):
                _message(f, "2t", 20200100 + day, 0, _field(rng), number=number)
    assert cli(["ingest", "climate", str(path), str(tmp_path / "a.zarr"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an ensemble (number: 3 members, 0 .. 2)" in err[0] and "--member" in err[0], err
    store = tmp_path / "m1.zarr"
    assert cli(["ingest", "climate", str(path), str(store), "--member", "1", "--split", "0.5,0.25,0.25",
                "--quiet"]) == 0
    cube = _cubes(path)["t2m"]
    np.testing.assert_array_equal(np.asarray(_store(store)["data"][:, 0]), cube.sel(number=1).values)
    assert _store(store).attrs["grid"]["source"]["member"] == 1
    assert cli(["ingest", "climate", str(path), str(tmp_path / "m9.zarr"), "--member", "9", "--quiet"]) == 1
    assert "--member 9 is not among its members [0, 1, 2]" in capsys.readouterr().err


def test_levels_written_in_hpa_and_pa_in_one_file(tmp_path):
    """ecCodes keeps an isobaricInPa level of 5000 Pa as 50 hPa: cfgrib gives one cube with its levels in file
    order (500, 50); the store's channels are in ascending hPa."""
    rng = np.random.default_rng(4)
    path = tmp_path / "pl.grib"
    with open(path, "wb") as f:
        for day in (1, 2, 3, 4):
            _message(f, "t", 20200100 + day, 0, _field(rng, 250), level=500, level_type="isobaricInhPa",
                     sample="regular_ll_pl_grib2")
            _message(f, "t", 20200100 + day, 0, _field(rng, 220), level=5000, level_type="isobaricInPa",
                     sample="regular_ll_pl_grib2")
    store = tmp_path / "g.zarr"
    ingest_climate(str(path), store, progress=False, split=SPLIT)
    root = _store(store)
    assert root.attrs["grid"]["variables"] == ["t50", "t500"]
    cube = _cubes(path)["t"]
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), cube.sel(isobaricInhPa=50).values)
    np.testing.assert_array_equal(np.asarray(root["data"][:, 1]), cube.sel(isobaricInhPa=500).values)


def _analyses(path, days=4, levels=(500, 850)):
    rng = np.random.default_rng(5)
    with open(path, "wb") as f:
        for day in range(1, days + 1):
            for level in levels:
                _message(f, "t", 20200100 + day, 0, _field(rng, 250), level=level, level_type="isobaricInhPa",
                         sample="regular_ll_pl_grib2")
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["cut inside a message", "cut between messages", "overwritten bytes", "not grib"])
def test_a_damaged_download_is_named_and_never_filled(tmp_path, capsys, damage):
    """Each used to ingest as a whole pressure level of NaN (refused as missing values, and `--fill mean`
    then exited 0 with that level set to its mean) or as "constant fields"."""
    data = _analyses(tmp_path / "whole.grib")
    size = len(data) // 8  # each message has the same length
    path = tmp_path / "damaged.grib"
    if damage == "cut inside a message":
        path.write_bytes(data[:-size // 2])
        said = "GRIB message 8 is damaged or cut short"
    elif damage == "cut between messages":
        path.write_bytes(data[:-size])
        said = "t has 7 of the 8 fields of its time x isobaricInhPa grid (the first missing at time=2020-01-04"
    elif damage == "overwritten bytes":  # inside message 4, and over message 6's "GRIB" (ecCodes then skips it)
        bad = bytearray(data)
        bad[3 * size + 10: 3 * size + 50] = bytes(40)
        path.write_bytes(bytes(bad))
        said = "GRIB message 4 is damaged or cut short"
        bad = bytearray(data)
        bad[5 * size: 5 * size + 4] = b"XXXX"
        (tmp_path / "skipped.grib").write_bytes(bytes(bad))
        with pytest.raises(IngestError, match=rf"{size} of its {len(data)} bytes are in no GRIB message \(7 messages"):
            ingest_climate(str(tmp_path / "skipped.grib"), tmp_path / "s.zarr", progress=False)
    else:
        path.write_bytes(b"<html>502 Bad Gateway</html>" * 10)
        said = "no GRIB message in the file"
    for extra in ([], ["--fill", "mean"]):
        assert cli(["ingest", "climate", str(path), str(tmp_path / "g.zarr"), "--quiet", *extra]) == 1
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
        assert len(err) == 1 and said in err[0] and str(path) in err[0] and "download it again" in err[0], err
        assert not (tmp_path / "g.zarr").exists()


def test_a_grid_that_is_not_regular_latitude_longitude_is_named(tmp_path):
    path = tmp_path / "gg.grib"
    h = ec.codes_grib_new_from_samples("reduced_gg_sfc_grib2")
    try:
        with open(path, "wb") as f:
            for day in (1, 2):
                ec.codes_set(h, "dataDate", 20200100 + day)
                ec.codes_write(h, f)
    finally:
        ec.codes_release(h)
    with pytest.raises(IngestError, match=r"is on a reduced_gg grid, not a regular latitude-longitude grid; .*regrid"):
        ingest_climate(str(path), tmp_path / "g.zarr", progress=False)


def test_variables_picks_hypercubes_and_leaves_the_others_unread(tmp_path):
    """With --variables, a hypercube left out does not have to share the times (or the grid) of those kept."""
    rng = np.random.default_rng(6)
    path = tmp_path / "mixed.grib"
    with open(path, "wb") as f:
        for day in range(1, 5):
            _message(f, "2t", 20200100 + day, 0, _field(rng))
            _message(f, "tp", 20200100 + day, 0, rng.random((H, W)), step=24, accum=True)  # valid a day later
    with pytest.raises(IngestError, match=r"\[.tp.\] of .* cover other valid times than \[.t2m.\] of .*--variables"):
        ingest_climate(str(path), tmp_path / "both.zarr", progress=False, split=SPLIT)
    for name in ("t2m", "tp"):
        store = tmp_path / f"{name}.zarr"
        ingest_climate(str(path), store, progress=False, split=SPLIT, variables=(name,))
        np.testing.assert_array_equal(np.asarray(_store(store)["data"][:, 0]), _cubes(path)[name].values)


def _era5_day(f, rng, day):
    """One day of ERA5 single levels as the CDS delivers GRIB: hourly 2t analyses, and hourly tp accumulated by
    the forecasts of the previous day's 18 UTC (steps 6..12: 00-06 UTC), 06 UTC (steps 1..12) and 18 UTC (steps
    1..5). cfgrib puts tp on a 3 x 12 (time, step) grid of which 24 fields exist."""
    prev = 20191231 if day == 1 else 20200100 + day - 1
    for hour in range(24):
        _message(f, "2t", 20200100 + day, 100 * hour, _field(rng))
    for date, time, steps in ((prev, 1800, range(6, 13)), (20200100 + day, 600, range(1, 13)),
                              (20200100 + day, 1800, range(1, 6))):
        for step in steps:
            _message(f, "tp", date, time, rng.random((H, W)) * 1e-3, step=step, accum=True)


def test_era5_hourly_accumulations_from_two_forecasts_a_day(tmp_path):
    """tp's (time, step) grid is legitimately sparse (not a damaged download): its 24 fields a day are a series of
    hourly valid times next to 2t's analyses, day files after day files."""
    rng = np.random.default_rng(8)
    for day in (1, 2):
        with open(tmp_path / f"era5_2020010{day}.grib", "wb") as f:
            _era5_day(f, rng, day)
    store = tmp_path / "g.zarr"
    ingest_climate(str(tmp_path / "*.grib"), store, progress=False, split=SPLIT)
    root = _store(store)
    assert root.attrs["grid"]["variables"] == ["t2m", "tp"] and root.attrs["grid"]["shape"] == [48, H, W]
    want_time, want = [], {"t2m": [], "tp": []}
    for day in (1, 2):
        cubes = _cubes(tmp_path / f"era5_2020010{day}.grib")
        want["t2m"].append(cubes["t2m"].values)
        tp = cubes["tp"].stack(k=("time", "step")).transpose("k", ...)
        tp = tp.isel(k=np.flatnonzero(np.isfinite(tp.values).all(axis=(1, 2))))  # the pairs that exist (no NaN)
        tp = tp.isel(k=np.argsort(tp.valid_time.values, kind="stable"))
        want["tp"].append(tp.transpose("k", ...).values)
        want_time.append(tp.valid_time.values)
        np.testing.assert_array_equal(tp.valid_time.values, cubes["t2m"].valid_time.values)
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), np.concatenate(want["t2m"]))
    np.testing.assert_array_equal(np.asarray(root["data"][:, 1]), np.concatenate(want["tp"]))
    dates = xr.coding.times.decode_cf_datetime(np.asarray(root["time"][:]), root["time"].attrs["units"],
                                               root["time"].attrs.get("calendar"))
    np.testing.assert_array_equal(dates, np.concatenate(want_time))


def test_a_file_of_one_message_continues_a_series_and_bad_picks_are_named(tmp_path, capsys):
    """jan.grib (three daily analyses) and jan4.grib (one message, a scalar time) make one series; --variables
    naming nothing, and --member on a source without an ensemble, are named in one line."""
    rng = np.random.default_rng(9)
    with open(tmp_path / "jan.grib", "wb") as f:
        for day in (1, 2, 3):
            _message(f, "2t", 20200100 + day, 0, _field(rng))
    with open(tmp_path / "jan4.grib", "wb") as f:
        _message(f, "2t", 20200104, 0, _field(rng))
    store = tmp_path / "g.zarr"
    ingest_climate(str(tmp_path / "*.grib"), store, progress=False, split=SPLIT)
    want = np.concatenate([_cubes(tmp_path / "jan.grib")["t2m"].values, _cubes(tmp_path / "jan4.grib")["t2m"].values[None]])
    np.testing.assert_array_equal(np.asarray(_store(store)["data"][:, 0]), want)
    for extra, said in ((["--variables", "nosuch"], "its variables are ['t2m']"),
                        (["--member", "3"], "--member 3: ")):
        assert cli(["ingest", "climate", str(tmp_path / "*.grib"), str(tmp_path / "x.zarr"), "--quiet", *extra]) == 1
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
        assert len(err) == 1 and said in err[0], err


def test_a_static_field_of_an_ensemble_file_is_read_at_the_member(tmp_path):
    rng = np.random.default_rng(10)
    path = tmp_path / "ens.grib"
    lsm = {n: rng.random((H, W)) for n in (0, 1)}
    with open(path, "wb") as f:
        for day in (1, 2, 3, 4):
            for number in (0, 1):
                _message(f, "2t", 20200100 + day, 0, _field(rng), number=number)
                _message(f, "lsm", 20200100 + day, 0, lsm[number], number=number)
    store = tmp_path / "g.zarr"
    ingest_climate(str(path), store, progress=False, split=SPLIT, member=1, static=("lsm",))
    root = _store(store)
    np.testing.assert_array_equal(np.asarray(root["static"][0]), _cubes(path)["lsm"].sel(number=1).values[0])
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), _cubes(path)["t2m"].sel(number=1).values)


def test_the_header_index_is_private_and_a_broken_one_is_rebuilt(tmp_path, monkeypatch, capfd):
    """cfgrib's index of a file's headers (a pickle) is kept only in a folder of this user's closed to others; one
    cut short (an ingest killed while writing it) is removed and rebuilt, without a traceback."""
    import glob
    import os
    import tempfile

    from domainflow.preprocess import grib_file

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    rng = np.random.default_rng(11)
    path = tmp_path / "a.grib"
    with open(path, "wb") as f:
        for day in (1, 2, 3, 4):
            _message(f, "2t", 20200100 + day, 0, _field(rng))
    ingest_climate(str(path), tmp_path / "g1.zarr", progress=False, split=SPLIT)
    folder = tmp_path / "tmp" / f"domainflow-grib-index-{os.getuid()}"
    indexes = glob.glob(str(folder / "*.idx"))
    assert indexes and oct(folder.stat().st_mode & 0o777) == "0o700"
    for cut in indexes:  # as a kill while cfgrib writes them leaves them
        data = open(cut, "rb").read()
        open(cut, "wb").write(data[: len(data) // 2])
    capfd.readouterr()
    ingest_climate(str(path), tmp_path / "g2.zarr", progress=False, split=SPLIT)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "index file" not in err, err
    np.testing.assert_array_equal(np.asarray(_store(tmp_path / "g2.zarr")["data"][...]),
                                  np.asarray(_store(tmp_path / "g1.zarr")["data"][...]))
    assert all(open(p, "rb").read()[-1:] == b"." for p in glob.glob(str(folder / "*.idx")))  # rebuilt whole
    folder.chmod(0o755)  # open to others: not used
    assert grib_file.index_path(str(path)) == ""
