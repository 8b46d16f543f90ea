"""Missing values and constant fields of climate sources written by xarray/netCDF4 the way the CDS writes them
(``synth_cds``: SST missing over land, the land-sea mask at every step, packed int16 with a _FillValue).

Gaps are counted over the whole source and refused by name, or filled by an explicit ``--fill`` policy the
store records (a rerun with the policy keeps the blocks already written); constant fields become the store's
``static`` array, equal to what xarray decodes."""

from __future__ import annotations

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
xr = pytest.importorskip("xarray")
pytest.importorskip("netCDF4")

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402
from domainflow.preprocess.synth_cds import synth_cds  # noqa: E402

SPLIT = (0.5, 0.25, 0.25)
VARS = ("t2m", "sst", "z500")


@pytest.fixture(scope="module")
def cds(tmp_path_factory):
    """Two months of six-hourly fields (two files per product) on an 8 x 16 grid."""
    return synth_cds(tmp_path_factory.mktemp("cds") / "era5", grid=(8, 16), steps=130, seed=1)


def _decoded(cds, name):
    with xr.open_mfdataset(str(cds / "era5_single_levels_*.nc")) as ds:
        return ds[name].values.astype(np.float32)


def test_gaps_are_counted_over_the_whole_source_then_filled_on_rerun(cds, tmp_path):
    sst = _decoded(cds, "sst")
    nan = np.isnan(sst)
    assert nan.any() and nan[:124].any() and nan[124:].any()  # in both monthly files
    t, i, j = (int(v[0]) for v in np.nonzero(nan))
    lat = xr.open_dataset(cds / "era5_single_levels_2020-01.nc")["latitude"].values
    store = tmp_path / "g.zarr"
    with pytest.raises(IngestError, match=rf"variable 'sst' holds {int(nan.sum())} missing values \(first at time "
                                          rf"index {t} .*latitude {lat[i]:g}, longitude {j * 22.5:g}\).*_FillValue "
                                          rf"-32767.*--fill"):
        ingest_climate(str(cds / "*.nc"), store, progress=False, split=SPLIT, variables=VARS)
    assert zarr.open_group(store, mode="r").attrs["domainflow"]["complete"] is False
    # the rerun with a policy keeps every block written and only fills (2 workers: the same store)
    report = ingest_climate(str(cds / "*.nc"), store, progress=False, split=SPLIT, variables=VARS,
                            fill={"sst": "mean"}, workers=2)
    assert report.written == [] and len(report.kept) == 2
    root = zarr.open_group(store, mode="r")
    names = root.attrs["grid"]["variables"]
    data = np.asarray(root["data"][:, names.index("sst")])
    train = np.zeros(len(sst), bool)
    for a, b in root.attrs["splits"]["train"]:
        train[a:b] = True
    valid_mean = np.mean(sst[train][~nan[train]].astype(np.float64))
    np.testing.assert_array_equal(data[~nan], sst[~nan])
    np.testing.assert_array_equal(data[nan], np.float32(valid_mean))
    assert not np.isnan(np.asarray(root["data"][...])).any()
    stats = root.attrs["stats"]["grid/sst"]
    assert stats["count"] == int((~nan[train]).sum())
    np.testing.assert_allclose(stats["mean"][0], valid_mean, rtol=1e-12)
    np.testing.assert_allclose(stats["std"][0], np.std(sst[train][~nan[train]].astype(np.float64)), rtol=1e-9)
    assert root.attrs["grid"]["missing"] == {"sst": {"count": int(nan.sum()), "policy": "mean",
                                                     "value": float(np.float32(valid_mean)), "mask": "missing"}}
    # where the values were missing, as xarray decodes them: the mask scores leave out
    assert root["missing"].attrs["channels"] == ["sst"]
    np.testing.assert_array_equal(np.asarray(root["missing"][:, 0]), nan)
    np.testing.assert_array_equal(np.asarray(root["data"][:, names.index("t2m")]), _decoded(cds, "t2m"))
    # a complete store is never refilled with another policy behind the user's back
    with pytest.raises(IngestError, match="different options.*fill"):
        ingest_climate(str(cds / "*.nc"), store, progress=False, split=SPLIT, variables=VARS, fill={"sst": 0})


def test_a_fixed_fill_value_and_bad_policies(cds, tmp_path, capsys):
    sst = _decoded(cds, "sst")
    assert cli(["ingest", "climate", str(cds), str(tmp_path / "g.zarr"), "--variables", "sst,t2m", "--fill",
                "sst=271.46", "--quiet"]) == 0
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    data = np.asarray(root["data"][:, root.attrs["grid"]["variables"].index("sst")])
    np.testing.assert_array_equal(data[np.isnan(sst)], np.float32(271.46))
    assert root.attrs["grid"]["missing"]["sst"]["policy"] == "value"
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "g.zarr")]) == 0
    assert f"sst: {int(np.isnan(sst).sum())} missing values" in capsys.readouterr().out
    for fill, msg in [("sst=warm", "a policy is 'mean' or a number"), ("sst=nan", "must be a finite number"),
                      ("nosuch=0", r"--fill names \['nosuch'\], which are not among the channels"),
                      ("sst=0,sst=1", "names 'sst' twice")]:
        with pytest.raises(IngestError, match=msg):
            ingest_climate(str(cds), tmp_path / "x.zarr", progress=False, variables=("sst",), fill=fill)


def test_static_fields_from_every_step_or_an_invariant_file(cds, tmp_path):
    with xr.open_mfdataset(str(cds / "era5_single_levels_*.nc")) as ds:
        lsm = ds["lsm"].isel(valid_time=0).values.astype(np.float32)
        lat, lon = ds["latitude"].values, ds["longitude"].values
    ingest_climate(str(cds / "*.nc"), tmp_path / "a.zarr", progress=False, split=SPLIT, variables=VARS,
                   fill="mean", static=("lsm",))
    root = zarr.open_group(tmp_path / "a.zarr", mode="r")
    assert root.attrs["grid"]["static"] == ["lsm"] and "lsm" not in root.attrs["grid"]["variables"]
    np.testing.assert_array_equal(np.asarray(root["static"][0]), lsm)
    assert root.attrs["fields"]["static/lsm"]["units"] == "1"
    np.testing.assert_allclose(root.attrs["stats"]["static/lsm"]["mean"][0], lsm.astype(np.float64).mean(), rtol=1e-9)
    # an "invariant" download: (latitude, longitude) fields in a file of their own, e.g. orography
    folder = tmp_path / "src"
    folder.mkdir()
    for f in cds.glob("*.nc"):
        (folder / f.name).symlink_to(f)
    orog = (1000 * np.cos(np.deg2rad(lat))[:, None] * np.ones(len(lon))).astype(np.float32)
    orog[2, 3] = np.nan
    xr.Dataset({"z": (("latitude", "longitude"), orog, {"units": "m**2 s**-2"}),
                "slor": (("latitude", "longitude"), np.full_like(orog, 0.1))},
               coords={"latitude": lat, "longitude": lon}).to_netcdf(folder / "invariant.nc")
    with pytest.raises(IngestError, match=r"invariant.nc holds only constant \(latitude, longitude\) fields "
                                          r"\['slor', 'z'\]: name the ones to use with --static"):
        ingest_climate(str(folder), tmp_path / "b.zarr", progress=False, variables=("t2m",))
    with pytest.raises(IngestError, match=r"--static z: 1 missing values \(first at latitude .*--fill"):
        ingest_climate(str(folder), tmp_path / "b.zarr", progress=False, variables=("t2m",), static=("z", "slor"))
    ingest_climate(str(folder), tmp_path / "b.zarr", progress=False, variables=("t2m",), static=("z", "slor"),
                   fill={"z": 0})
    root = zarr.open_group(tmp_path / "b.zarr", mode="r")
    assert root.attrs["grid"]["static"] == ["z", "slor"]
    np.testing.assert_array_equal(np.asarray(root["static"][0]), np.nan_to_num(orog, nan=0.0))
    assert root.attrs["grid"]["missing"]["z"] == {"count": 1, "policy": "value", "value": 0.0}
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), _decoded(cds, "t2m"))


def test_a_field_that_changes_is_not_static(cds, tmp_path):
    with pytest.raises(IngestError, match=r"--static t2m: .*era5_single_levels_2020-01.nc step 123 differs from "
                                          r"the first map.*not a constant field"):
        ingest_climate(str(cds), tmp_path / "a.zarr", progress=False, variables=("msl",), static=("t2m",))
    with pytest.raises(IngestError, match=r"--static nosuch: no file holds .*the variables are \[.*'lsm'"):
        ingest_climate(str(cds), tmp_path / "a.zarr", progress=False, static=("nosuch",))
    with pytest.raises(IngestError, match="pressure-level variable is not a constant field"):
        ingest_climate(str(cds), tmp_path / "a.zarr", progress=False, static=("z",))
    with pytest.raises(IngestError, match=r"named both by --static and --variables"):
        ingest_climate(str(cds), tmp_path / "a.zarr", progress=False, variables=("lsm", "t2m"), static=("lsm",))


def test_a_fill_killed_midway_is_not_resumed_with_other_values(cds, tmp_path, monkeypatch):
    """The first fill task writes its chunks and dies before marking itself done: a rerun with another value
    would fill the rest with it, two values in one channel. The values are fixed before any task starts."""
    import domainflow.preprocess.ingest_grid as ingest_grid

    real = ingest_grid.fill_block

    def killed_after_writing(*args):
        real(*args)
        raise KeyboardInterrupt  # the process dies here, before the task's marker

    store = tmp_path / "g.zarr"
    monkeypatch.setattr(ingest_grid, "fill_block", killed_after_writing)
    with pytest.raises(KeyboardInterrupt):
        ingest_climate(str(cds), store, progress=False, variables=("sst",), time_block=20, fill="sst=111")
    monkeypatch.undo()
    with pytest.raises(IngestError, match=r"was being filled with \{'0': 111.0\}.*asks \{'0': 222.0\}"):
        ingest_climate(str(cds), store, progress=False, variables=("sst",), time_block=20, fill="sst=222")
    # a store begun before issue 36 names the marker fill-plan: still honoured
    from domainflow.preprocess.store_writer import StoreWriter

    marker = StoreWriter(store).block_marker("fill-values")
    marker.rename(marker.with_name("fill-plan.json"))
    with pytest.raises(IngestError, match=r"was being filled with \{'0': 111.0\}.*asks \{'0': 222.0\}"):
        ingest_climate(str(cds), store, progress=False, variables=("sst",), time_block=20, fill="sst=222")
    ingest_climate(str(cds), store, progress=False, variables=("sst",), time_block=20, fill="sst=111")
    root = zarr.open_group(store, mode="r")
    data = np.asarray(root["data"][...])
    assert not np.isnan(data).any() and not (data == 222).any() and (data == 111).any()
    # the killed block's task ran again on data it had filled already: its mask still marks the gaps
    np.testing.assert_array_equal(np.asarray(root["missing"][:, 0]), np.isnan(_decoded(cds, "sst")))
    with pytest.raises(IngestError, match="within float32's range"):
        ingest_climate(str(cds), tmp_path / "x.zarr", progress=False, variables=("sst",), fill="sst=1e40")


def test_a_static_field_given_twice_and_surface_geopotential_next_to_pressure_levels(cds, tmp_path):
    """ERA5 as downloaded: lsm at every step in the monthly files and in an invariant file; the surface
    geopotential ``z`` (one step) next to the pressure levels' ``z``. The static fields are inputs only (never
    predicted channels), and the pressure-level ``z`` stays channels."""
    folder = tmp_path / "src"
    folder.mkdir()
    for f in cds.glob("*.nc"):
        (folder / f.name).symlink_to(f)
    with xr.open_dataset(cds / "era5_single_levels_2020-01.nc") as ds:
        lsm = ds["lsm"].isel(valid_time=0)
        xr.Dataset({"lsm": lsm.drop_vars(["valid_time", "expver"], errors="ignore")}).to_netcdf(folder / "lsm.nc")
        surface = (9.81 * 300 * lsm).expand_dims(valid_time=ds["valid_time"][:1]).astype(np.float32)
        xr.Dataset({"z": surface}).to_netcdf(folder / "invariant_z.nc")
    ingest_climate(str(folder), tmp_path / "g.zarr", progress=False, static=("lsm", "z"), fill={"sst": "mean"})
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    channels = root.attrs["grid"]["variables"]
    assert root.attrs["grid"]["static"] == ["lsm", "z"] and "lsm" not in channels
    assert {"z500", "z850", "t2m"} <= set(channels) and "z" not in channels
    np.testing.assert_allclose(np.asarray(root["static"][1]), surface.values[0], rtol=1e-6)


def _valid_blocks(store, t):
    from dist_pool import rank_and_world

    from domainflow.readers import GridDataset
    from sharded_check import get_mesh

    _, world = rank_and_world()
    ds = GridDataset(store, get_mesh((world,), ("domain",)), split="train", prefetch=0, variables=["t2m", "sst"])
    return ds.has_mask, ds.read_valid(t)


def test_each_rank_reads_its_block_of_the_missing_mask(cds, tmp_path, dist):
    """What the scores leave out: 0 where SST was missing (and filled), 1 elsewhere and for t2m, per rank."""
    store = tmp_path / "g.zarr"
    ingest_climate(str(cds / "*.nc"), store, progress=False, split=SPLIT, variables=VARS, fill={"sst": "mean"})
    nan = np.isnan(_decoded(cds, "sst"))
    t = int(np.nonzero(nan.any(axis=(1, 2)))[0][0])
    blocks = dist.run(2, _valid_blocks, str(store), t)
    assert all(has for has, _ in blocks)
    valid = np.concatenate([b for _, b in blocks], axis=2)[0]  # ranks split the latitude rows
    np.testing.assert_array_equal(valid[1], ~nan[t])
    assert (valid[0] == 1).all()


def test_netcdfs_default_fill_is_missing_as_netcdf4_reads_it(tmp_path):
    """A variable written by netCDF4 without a _FillValue, some of its values never written: those hold netCDF's
    default fill (9.97e36 for float32, -32767 packed int16), which netCDF4 reads as missing. They used to be
    ingested as data; now they are missing values (refused by default, filled by a policy), as netCDF4 reads them."""
    import netCDF4

    path = tmp_path / "era5.nc"
    rng = np.random.default_rng(7)
    with netCDF4.Dataset(path, "w") as nc:
        for name, n in (("valid_time", 8), ("latitude", 4), ("longitude", 8)):
            nc.createDimension(name, n)
        nc.createVariable("valid_time", "i8", ("valid_time",))[:] = np.arange(8) * 6
        nc["valid_time"].units = "hours since 2020-01-01"
        nc.createVariable("latitude", "f8", ("latitude",))[:] = [67.5, 22.5, -22.5, -67.5]
        nc.createVariable("longitude", "f8", ("longitude",))[:] = np.arange(8) * 45.0
        t2m = nc.createVariable("t2m", "f4", ("valid_time", "latitude", "longitude"))  # no _FillValue
        sst = nc.createVariable("sst", "i2", ("valid_time", "latitude", "longitude"))  # packed, no _FillValue
        sst.scale_factor, sst.add_offset = 0.01, 280.0
        for k in range(8):
            if k != 5:  # step 5 of t2m is never written
                t2m[k] = 270 + rng.standard_normal((4, 8)).astype(np.float32)
        sst[:] = 280 + rng.standard_normal((8, 4, 8))
        sst[2, 1, 3] = np.ma.masked  # netCDF4 writes a masked value as the default fill
    with netCDF4.Dataset(path) as nc:
        want = {v: np.ma.filled(nc[v][:].astype(np.float64), np.nan) for v in ("sst", "t2m")}
    assert np.isnan(want["t2m"][5]).all() and np.isnan(want["sst"]).sum() == 1
    with pytest.raises(IngestError, match=r"variable 'sst' holds 1 missing values.*variable 't2m' holds 32 missing"):
        ingest_climate(str(path), tmp_path / "g.zarr", progress=False, split=SPLIT)
    ingest_climate(str(path), tmp_path / "g.zarr", progress=False, split=SPLIT, fill="0")
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    for c, name in enumerate(root.attrs["grid"]["variables"]):
        got, nan = np.asarray(root["data"][:, c]), np.isnan(want[name])
        np.testing.assert_array_equal(got[~nan], want[name][~nan].astype(np.float32))
        assert (got[nan] == 0).all()
        assert root.attrs["grid"]["missing"][name]["count"] == int(nan.sum())
