"""``ingest climate`` decodes missing values and CF packing exactly as xarray does, in Zarr v2 and v3.

Sources are written by xarray itself (``Dataset.to_zarr``), as analysis-ready ERA5 extracts are: in v2 a
``_FillValue`` goes into ``.zarray``'s ``fill_value``, not into the attrs, so a hand decoder that only
reads attrs stores the raw fill bits as data.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402

T, H, W = 6, 5, 8
FORMATS = pytest.mark.parametrize("fmt", [2, 3], ids=["zarr-v2", "zarr-v3"])
PACKED = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 270.0, "_FillValue": -32767}
ENCODINGS = {  # how the variable is written; each one marks the NaNs as missing in its own way
    "fill-value": {"_FillValue": -9999.0},
    "int16-packed": PACKED,
    "missing-value": {"missing_value": -9999.0},
}


def _dataset(nan_at=()) -> xr.Dataset:
    """ERA5-like t2m (K) and msl (Pa) on a small global grid with datetime times; NaN at ``nan_at``."""
    rng = np.random.default_rng(3)
    t2m = (270.0 + 20.0 * rng.standard_normal((T, H, W))).astype(np.float32)
    for index in nan_at:
        t2m[index] = np.nan
    msl = (101325.0 + 800.0 * rng.standard_normal((T, H, W))).astype(np.float32)
    dims = ("time", "latitude", "longitude")
    return xr.Dataset(
        {"t2m": (dims, t2m, {"units": "K", "long_name": "2 metre temperature"}),
         "msl": (dims, msl, {"units": "Pa", "long_name": "Mean sea level pressure"})},
        coords={"time": pd.date_range("2000-01-01", periods=T, freq="6h"),
                "latitude": ("latitude", np.linspace(60, -60, H), {"units": "degrees_north"}),
                "longitude": ("longitude", np.arange(W) * 360.0 / W, {"units": "degrees_east"})})


def _write(ds: xr.Dataset, path, fmt: int, encoding: dict, consolidated: bool = True):
    """``ds.to_zarr`` as a user would write it (zarr warns that v3 consolidated metadata is not in the spec)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        ds.to_zarr(path, zarr_format=fmt, mode="w", consolidated=consolidated, encoding={"t2m": encoding})
    return path


@FORMATS
@pytest.mark.parametrize("how", list(ENCODINGS))
def test_missing_values_are_refused_naming_variable_count_and_time(tmp_path, fmt, how):
    """A NaN written as a fill / missing value is missing data: refused, never stored as a temperature."""
    src = _write(_dataset(nan_at=[(2, 1, 3), (4, 0, 0), (4, 2, 5)]), tmp_path / "src.zarr", fmt, ENCODINGS[how])
    assert np.isnan(xr.open_zarr(src)["t2m"].values).sum() == 3  # what xarray reads
    with pytest.raises(IngestError, match=r"variable 't2m' holds 3 missing values.*first at time index 2"):
        ingest_climate(src, tmp_path / "g.zarr", progress=False)
    assert zarr.open_group(tmp_path / "g.zarr", mode="r").attrs["domainflow"]["complete"] is False


@FORMATS
@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "not-consolidated"])
def test_packed_variable_ingests_as_xarray_decodes_it(tmp_path, fmt, consolidated, recwarn):
    """int16 + scale_factor/add_offset (+ _FillValue, unused) reads back as xarray's float32 values; the
    other variables, coordinates and raw time numbers too; absent consolidated metadata warns of nothing."""
    src = _write(_dataset(), tmp_path / "src.zarr", fmt, PACKED, consolidated)
    recwarn.clear()
    ingest_climate(src, tmp_path / "g.zarr", progress=False, split=(0.5, 0.25, 0.25))
    assert not [w for w in recwarn if "onsolidated" in str(w.message)], [str(w.message) for w in recwarn]
    ref = xr.open_zarr(src, consolidated=consolidated)
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    variables = root.attrs["grid"]["variables"]
    assert sorted(variables) == ["msl", "t2m"]
    for v in variables:
        expected = ref[v].values.astype(np.float32)
        got = np.asarray(root["data"][:, variables.index(v)])
        assert not np.isnan(expected).any()
        np.testing.assert_array_equal(got, expected)
        assert root.attrs["fields"][f"grid/{v}"]["units"] == ref[v].attrs["units"]
    packed = np.asarray(zarr.open_group(src, mode="r")["t2m"][...])
    assert packed.dtype == np.int16  # really packed: the store holds physical values, not these
    assert abs(float(root.attrs["stats"]["grid/t2m"]["mean"][0]) - 270.0) < 10.0
    np.testing.assert_array_equal(root["lat"][...], ref["latitude"].values)
    np.testing.assert_array_equal(root["lon"][...], ref["longitude"].values)
    raw_time = xr.open_zarr(src, consolidated=consolidated, decode_times=False)["time"]
    np.testing.assert_array_equal(root["time"][...], raw_time.values)
    assert root["time"].attrs["units"] == raw_time.attrs["units"] and "since" in root["time"].attrs["units"]
