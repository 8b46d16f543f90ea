"""``domainflow ingest climate``: synth -> ingest -> read back, re-chunking, stats, parallel, resume, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from pathlib import Path

from domainflow.preprocess import ingest_grid  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate, spatial_tile  # noqa: E402
from domainflow.preprocess.synth_climate import VARIABLES, synth_climate  # noqa: E402
from store_compare import assert_same_store  # noqa: E402

from domainflow.app.cli import main as cli  # noqa: E402

H, W, T = 24, 48, 30
OPTS = dict(chunk_bytes=1024, progress=False)  # small tiles: several per map, as a big grid would have


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    return synth_climate(tmp_path_factory.mktemp("raw") / "era5.zarr", grid=(H, W), steps=T, seed=1, time_chunk=7)


@pytest.fixture(scope="module")
def store(raw, tmp_path_factory):
    path = tmp_path_factory.mktemp("stores") / "grid.zarr"
    report = ingest_climate(raw, path, workers=1, **OPTS)
    assert report.state == "new" and len(report.written) == 5  # ceil(30 / 7) time blocks
    return path


def test_data_equals_the_source_and_is_rechunked_per_step(raw, store):
    src, root = zarr.open_group(raw, mode="r"), zarr.open_group(store, mode="r")
    data = root["data"]
    assert data.shape == (T, len(VARIABLES), H, W) and data.dtype == np.float32
    assert data.chunks[:2] == (1, 1) and data.chunks[2] < H and data.chunks[2:] == spatial_tile(H, W, 4, 1024)
    assert data.chunks[2] * data.chunks[3] * 4 <= 1024
    full = np.asarray(data[...])
    variables = root.attrs["grid"]["variables"]
    assert sorted(variables) == sorted(VARIABLES)
    for c, v in enumerate(variables):
        np.testing.assert_array_equal(full[:, c], np.asarray(src[v][...]))
        assert root.attrs["fields"][f"grid/{v}"]["channel"] == c
        assert root.attrs["fields"][f"grid/{v}"]["units"] == src[v].attrs["units"]
    np.testing.assert_array_equal(root["lat"][...], src["latitude"][...])
    np.testing.assert_array_equal(root["lon"][...], src["longitude"][...])
    np.testing.assert_array_equal(root["time"][...], src["time"][...])
    assert root["time"].attrs["units"] == src["time"].attrs["units"]
    assert root.attrs["grid"]["periodic_lon"] is True


def test_a_hyperslab_is_a_slice_of_the_source(raw, store):
    src, data = zarr.open_group(raw, mode="r"), zarr.open_group(store, mode="r")["data"]
    variables = zarr.open_group(store, mode="r").attrs["grid"]["variables"]
    c = variables.index("msl")
    np.testing.assert_array_equal(data[3:9, c, 5:13, 20:41], np.asarray(src["msl"][3:9, 5:13, 20:41]))


def test_stats_equal_numpy_over_the_train_time_range(raw, store):
    src, root = zarr.open_group(raw, mode="r"), zarr.open_group(store, mode="r")
    splits = dict(root.attrs["splits"])
    assert splits == {"train": [[0, 24]], "val": [[24, 27]], "test": [[27, 30]]}  # contiguous, in time order
    for v in VARIABLES:
        x = np.asarray(src[v][0:24], dtype=np.float64).ravel()
        s = root.attrs["stats"][f"grid/{v}"]
        assert s["count"] == x.size
        np.testing.assert_allclose(s["mean"], [x.mean()], rtol=1e-10)
        np.testing.assert_allclose(s["std"], [x.std()], rtol=1e-8)
        assert s["min"] == [x.min()] and s["max"] == [x.max()]


def test_two_workers_give_the_identical_store(raw, store, tmp_path, capfd):
    ingest_climate(raw, tmp_path / "p.zarr", workers=2, **{**OPTS, "progress": True})
    assert_same_store(store, tmp_path / "p.zarr")
    # the bar counts time steps and grid cells (grid points x steps; it used to say "0 cells, 0.00 cells/s")
    shown = capfd.readouterr().err.replace("\r", "\n").strip().splitlines()
    last = [line for line in shown if line.startswith("ingest ")][-1]
    assert f"{T}/{T} [" in last and "step/s" in last and f"{T * H * W:,} cells" in last, last


def test_resume_after_a_failed_block(raw, store, tmp_path, monkeypatch):
    path = tmp_path / "r.zarr"
    real = ingest_grid.RunningStats.of
    calls = []

    def dying(values):
        calls.append(1)
        if len(calls) == 3 * len(VARIABLES):  # the third block: its chunks are written, its marker is not
            raise KeyboardInterrupt
        return real(values)

    monkeypatch.setattr(ingest_grid.RunningStats, "of", dying)
    with pytest.raises(KeyboardInterrupt):
        ingest_climate(raw, path, **OPTS)
    monkeypatch.setattr(ingest_grid.RunningStats, "of", real)
    assert zarr.open_group(path, mode="r").attrs["domainflow"]["complete"] is False
    report = ingest_climate(raw, path, **OPTS)
    assert report.state == "resume" and len(report.kept) == 2 and len(report.written) == 3
    assert_same_store(store, path)
    assert ingest_climate(raw, path, **OPTS).state == "complete"


def test_zarr_v2_source_with_xarray_dimension_attrs(tmp_path):
    """Analysis-ready stores (WeatherBench 2, ARCO-ERA5) are Zarr v2 with _ARRAY_DIMENSIONS attrs."""
    g = zarr.open_group(tmp_path / "v2.zarr", mode="w", zarr_format=2)
    rng = np.random.default_rng(0)
    values = rng.normal(size=(5, 6, 8)).astype(np.float32)
    a = g.create_array("z500", shape=values.shape, chunks=(5, 6, 8), dtype="f4",
                       attributes={"_ARRAY_DIMENSIONS": ["time", "lat", "lon"], "units": "m**2 s**-2"})
    a[...] = values
    for name, vals in (("lat", np.linspace(-75, 75, 6)), ("lon", np.arange(8) * 45.0), ("time", np.arange(5))):
        c = g.create_array(name, shape=vals.shape, dtype=vals.dtype, attributes={"_ARRAY_DIMENSIONS": [name]})
        c[...] = vals
    ingest_climate(tmp_path / "v2.zarr", tmp_path / "s.zarr", progress=False, split=(0.6, 0.2, 0.2))
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    np.testing.assert_array_equal(root["data"][:, 0], values)
    assert root.attrs["fields"]["grid/z500"]["units"] == "m**2 s**-2"


def test_bad_input(raw, tmp_path):
    with pytest.raises(IngestError, match=r"no variable\(s\) \['sst'\].*t2m"):
        ingest_climate(raw, tmp_path / "a.zarr", variables=("t2m", "sst"), **OPTS)
    with pytest.raises(IngestError, match="not a readable Zarr group"):
        ingest_climate(tmp_path / "nothing", tmp_path / "b.zarr", **OPTS)
    g = zarr.open_group(tmp_path / "nan.zarr", mode="w")
    v = np.ones((4, 4, 4), np.float32)
    v[2, 1, 1] = np.nan
    a = g.create_array("t2m", shape=v.shape, dtype="f4", dimension_names=["time", "latitude", "longitude"])
    a[...] = v
    for name in ("latitude", "longitude"):
        c = g.create_array(name, shape=(4,), dtype="f8", dimension_names=[name])
        c[...] = np.arange(4.0)
    with pytest.raises(IngestError, match=r"'t2m' holds 1 missing values.*time index 2"):
        ingest_climate(tmp_path / "nan.zarr", tmp_path / "c.zarr", **OPTS)
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [[0, 20]], "val": [[15, 30]]}))
    with pytest.raises(IngestError, match="overlaps"):
        ingest_climate(raw, tmp_path / "d.zarr", split_file=str(split), **OPTS)


def test_cf_packed_variables_are_unpacked_and_fill_values_refused(tmp_path):
    """ERA5 converted from netCDF by xarray keeps CF packing (int16 + scale_factor/add_offset) and
    _FillValue; the store holds physical values, and a fill value is missing data, not a number."""
    g = zarr.open_group(tmp_path / "p.zarr", mode="w")
    packed = (np.arange(4 * 4 * 8).reshape(4, 4, 8) * 7 - 50).astype(np.int16)
    a = g.create_array("t2m", shape=packed.shape, dtype="i2", dimension_names=["time", "latitude", "longitude"],
                       attributes={"scale_factor": 0.01, "add_offset": 250.0, "_FillValue": -32767, "units": "K"})
    a[...] = packed
    for name in ("latitude", "longitude"):
        c = g.create_array(name, shape=(packed.shape[1 if name == "latitude" else 2],), dtype="f8",
                           dimension_names=[name])
        c[...] = np.arange(c.shape[0], dtype=float)
    ingest_climate(tmp_path / "p.zarr", tmp_path / "s.zarr", progress=False, split=(0.5, 0.25, 0.25))
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    np.testing.assert_allclose(root["data"][:, 0], packed * 0.01 + 250.0, rtol=1e-6)
    assert "scale_factor" not in root.attrs["fields"]["grid/t2m"] and root.attrs["fields"]["grid/t2m"]["units"] == "K"
    packed[1, 2, 3] = -32767
    a[...] = packed
    with pytest.raises(IngestError, match=r"'t2m' holds 1 missing values.*time index 1"):
        ingest_climate(tmp_path / "p.zarr", tmp_path / "s2.zarr", progress=False)


def test_split_file_of_time_ranges(raw, tmp_path):
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [[0, 10], [20, 30]], "test": [[10, 20]]}))
    ingest_climate(raw, tmp_path / "s.zarr", split_file=str(split), variables=("t2m",), **OPTS)
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    x = np.concatenate([np.asarray(zarr.open_group(raw)["t2m"][a:b]) for a, b in ([0, 10], [20, 30])])
    assert root.attrs["stats"]["grid/t2m"]["count"] == x.size
    np.testing.assert_allclose(root.attrs["stats"]["grid/t2m"]["mean"], [x.astype(np.float64).mean()], rtol=1e-10)


def test_cli_synth_ingest_inspect_climate(tmp_path, capsys):
    raw, store = tmp_path / "era5.zarr", tmp_path / "g.zarr"
    assert cli(["synth", "climate", str(raw), "--grid", "8", "16", "--steps", "12", "--quiet"]) == 0
    assert cli(["ingest", "climate", str(raw), str(store), "--workers", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert cli(["inspect", str(store), "--domain", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "grid store, format 2, complete" in out and "grid/t2m" in out and "domain 3: 2..3 rows" in out
    assert cli(["ingest", "climate", str(raw), str(store), "--on-error", "skip", "--quiet"]) != 0


# =====================================================================================================
# Climate
# =====================================================================================================
def _grid_source(path: Path, *variables, lat=None, lon=None, time=True, time_chunk=None, fmt=3, attrs=None):
    """A small (time, latitude, longitude) Zarr with variables v0, v1, ..."""
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    T, H, W = variables[0].shape
    lat = np.linspace(-60, 60, H) if lat is None else np.asarray(lat, float)
    lon = np.arange(W) * 360.0 / W if lon is None else np.asarray(lon, float)

    def put(name, values, dims, chunks, extra=None):
        # v2 as xarray writes an array without missing values: no fill_value (to xarray a v2 fill_value is
        # the _FillValue, and zarr-python's default 0 would make every 0 a missing value)
        kw = ({"dimension_names": dims} if fmt == 3
              else {"attributes": {"_ARRAY_DIMENSIONS": dims}, "fill_value": None})
        a = g.create_array(name, shape=values.shape, dtype=values.dtype, chunks=chunks, **kw)
        a[...] = values
        if extra:
            a.attrs.update(extra)

    for i, v in enumerate(variables):
        put(f"v{i}", v, ["time", "latitude", "longitude"], (time_chunk or v.shape[0],) + v.shape[1:],
            (attrs or {}).get(f"v{i}"))
    put("latitude", lat, ["latitude"], lat.shape)
    put("longitude", lon, ["longitude"], lon.shape)
    if time:
        put("time", np.arange(T, dtype=np.int64) * 6, ["time"], (T,), {"units": "hours since 2000-01-01"})
    return path


@pytest.mark.parametrize("T,time_chunk,time_block", [(10, 4, None), (10, 10, 4), (3, 3, 8), (1, 1, None)])
def test_grid_time_blocks_that_do_not_divide_the_series(tmp_path, T, time_chunk, time_block):
    rng = np.random.default_rng(T)
    v = rng.normal(size=(T, 5, 8)).astype(np.float32)
    src = _grid_source(tmp_path / "src.zarr", v, time_chunk=time_chunk)
    store = tmp_path / "g.zarr"
    report = ingest_climate(src, store, time_block=time_block, progress=False)
    block = time_block or time_chunk
    assert len(report.written) == -(-T // block)
    root = zarr.open_group(store, mode="r")
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), v)
    train = root.attrs["splits"]["train"]
    n_train = sum(b - a for a, b in train)
    assert root.attrs["stats"]["grid/v0"]["count"] == n_train * 5 * 8
    x = np.concatenate([v[a:b] for a, b in train]).astype(np.float64)
    np.testing.assert_allclose(root.attrs["stats"]["grid/v0"]["mean"], [x.mean()], rtol=1e-9)


def test_grid_regional_ascending_lat_and_no_time_coordinate(tmp_path):
    v = np.arange(4 * 6 * 7, dtype=np.float32).reshape(4, 6, 7)
    src = _grid_source(tmp_path / "src.zarr", v, lat=np.linspace(30, 55, 6), lon=np.linspace(-10, 20, 7),
                       time=False, fmt=2)
    store = tmp_path / "g.zarr"
    ingest_climate(src, store, progress=False)
    root = zarr.open_group(store, mode="r")
    assert root.attrs["grid"]["periodic_lon"] is False
    np.testing.assert_array_equal(root["lat"][...], np.linspace(30, 55, 6))  # kept ascending, as given
    np.testing.assert_array_equal(root["time"][...], np.arange(4))
    assert root["time"].attrs["units"] == "steps"
    np.testing.assert_array_equal(root["data"][:, 0], v)


def test_grid_variables_of_different_shapes_point_to_variables_option(tmp_path):
    g = _grid_source(tmp_path / "src.zarr", np.zeros((4, 5, 8), np.float32))
    a = zarr.open_group(g, mode="r+").create_array("v9", shape=(4, 5, 4), dtype="f4",
                                                   dimension_names=["time", "latitude", "longitude"])
    a[...] = 0
    with pytest.raises(IngestError, match=r"different shapes.*--variables"):
        ingest_climate(g, tmp_path / "g.zarr", progress=False)
    ingest_climate(g, tmp_path / "g.zarr", variables=("v0",), progress=False)  # the way out works


@pytest.mark.parametrize("step", [0, 9], ids=["in-train", "in-test"])
def test_grid_value_beyond_float32_is_refused(tmp_path, step):
    # BUG: ingest_block checks the *source* values for NaN/Inf and then casts them to float32. A float64
    # source value beyond float32's range (1e39) becomes inf in the store: in the test split it is written
    # silently (data holds inf, store complete); in the train split RunningStats.of raises a plain
    # ValueError that names neither variable nor time step. Expected: IngestError naming the variable and
    # time index (fix: check np.isfinite on the float32 block after the cast).
    v = np.ones((10, 4, 8))
    v[step, 1, 2] = 1e39
    src = _grid_source(tmp_path / "src.zarr", v)
    with pytest.raises(IngestError, match=rf"'v0'.*time index {step}"):
        ingest_climate(src, tmp_path / "g.zarr", progress=False)


def test_grid_split_file_with_empty_train_is_refused(tmp_path):
    # BUG: mesh ingest refuses an empty train split, grid ingest completes: attrs.stats gets count 0,
    # std NaN, min Infinity, max -Infinity, which zarr writes into zarr.json as bare NaN/Infinity (not valid
    # JSON for strict readers) and which no model can normalise with. Expected: IngestError about the
    # empty train split, before any block is written.
    src = _grid_source(tmp_path / "src.zarr", np.ones((6, 4, 8), np.float32))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [], "val": [[0, 3]], "test": [[3, 6]]}))
    with pytest.raises(IngestError, match="train"):
        ingest_climate(src, tmp_path / "g.zarr", split_file=str(split), progress=False)


def test_grid_packed_int16_variables_are_decoded_or_refused(tmp_path):
    # BUG: ERA5 written by xarray from the CDS netCDF keeps CF packing: int16 values with scale_factor /
    # add_offset attrs. ingest_block copies the packed integers as they are, so the store holds e.g. 12000
    # instead of 12000 * 0.01 + 250 = 370 K, with the source's units. Expected: unpack
    # (raw * scale_factor + add_offset) or refuse with an IngestError naming scale_factor.
    packed = np.arange(3 * 4 * 8, dtype=np.int16).reshape(3, 4, 8) * 100
    src = _grid_source(tmp_path / "src.zarr", packed,
                       attrs={"v0": {"scale_factor": 0.01, "add_offset": 250.0, "units": "K"}})
    try:
        ingest_climate(src, tmp_path / "g.zarr", progress=False)
    except IngestError as exc:
        assert "scale_factor" in str(exc)
        return
    data = np.asarray(zarr.open_group(tmp_path / "g.zarr", mode="r")["data"][:, 0])
    np.testing.assert_allclose(data, packed * 0.01 + 250.0, rtol=1e-6)


def test_grid_repeated_variable_is_refused_or_merged(tmp_path):
    # BUG: `--variables v0,v0` is accepted: data gets two identical channels, attrs.grid.variables lists v0
    # twice, but attrs.fields (keyed by name) describes only channel 1. Expected: IngestError naming the
    # repeated variable, or the repeat dropped (one channel).
    src = _grid_source(tmp_path / "src.zarr", np.ones((3, 4, 8), np.float32))
    try:
        ingest_climate(src, tmp_path / "g.zarr", variables=("v0", "v0"), progress=False)
    except IngestError as exc:
        assert "v0" in str(exc)
        return
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    assert root["data"].shape[1] == len(root.attrs["grid"]["variables"]) == len(root.attrs["fields"])
