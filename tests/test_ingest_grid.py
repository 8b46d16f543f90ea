"""``domainflow ingest climate``: synth -> ingest -> read back, re-chunking, stats, parallel, resume, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess import ingest_grid  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate, spatial_tile  # noqa: E402
from domainflow.preprocess.synth_climate import VARIABLES, synth_climate  # noqa: E402
from store_compare import assert_same_store  # noqa: E402

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


def test_two_workers_give_the_identical_store(raw, store, tmp_path):
    ingest_climate(raw, tmp_path / "p.zarr", workers=2, **OPTS)
    assert_same_store(store, tmp_path / "p.zarr")


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
    with pytest.raises(IngestError, match=r"'t2m' holds 1 NaN/Inf.*time index 2"):
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
    with pytest.raises(IngestError, match=r"'t2m' holds 1 NaN/Inf/missing.*time index 1"):
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
