"""``domainflow predict`` of a grid checkpoint: an autoregressive forecast written as an xarray-readable Zarr or
netCDF, every rank writing its own block; the same values at domain 1, 3 and on a 2 x 2 lat x lon mesh, equal to
the model applied by hand to the store's data; errors known before ranks start in one line."""

from __future__ import annotations


import numpy as np
import pytest

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")

INITS = "2020-01-05T00,2020-01-06T12"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from domainflow.app.cli import main
    from domainflow.preprocess.ingest_grid import ingest_climate
    from domainflow.preprocess.synth_climate import synth_climate

    root = tmp_path_factory.mktemp("forecast")
    synth_climate(root / "era5.zarr", grid=(8, 16), steps=40, seed=2, progress=False)
    ingest_climate(root / "era5.zarr", root / "g.zarr", progress=False, split=(0.6, 0.2, 0.2))
    assert main(["train", "--out", str(root / "train"), f"data.store={root / 'g.zarr'}", "data.kind=grid",
                 "model.name=unet", "model.base=4", "train.steps=2", "train.dtype=float64", "output.plots=false",
                 "output.progress=false", "data.prefetch=0"]) == 0
    return {"root": root, "store": root / "g.zarr", "ckpt": root / "train" / "checkpoints"}


def _predict(trained, out, *args, here=False):
    """``domainflow predict``; ``here``: in this process (for errors raised before any rank starts)."""
    from cli_runner import run_cli

    return run_cli("predict", trained["ckpt"], trained["store"], out, *args,
                   env=None if here else {"OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"})


def _by_hand(store, ckpt_dir, steps):
    """The checkpoint's model applied by one process to plain tensors of the store's data, rolled out."""
    import torch

    from domainflow.train import checkpoint as ckpt
    from domainflow.train.build import build_model
    from domainflow.train.config import from_dict
    from domainflow.train.data import build_dataset
    from sharded_check import get_mesh

    path = ckpt.latest(ckpt_dir)
    cfg = from_dict(dict(ckpt.meta(path)["config"]))
    cfg.data.store = str(store)
    mesh = get_mesh((1, 1), ("dp", "domain"))
    ds = build_dataset(cfg, mesh, "train", shuffle=False)
    model = build_model(cfg, ds)
    ckpt.load(path, model)
    model.eval()
    root = zarr.open_group(store, mode="r")
    stats = root.attrs["stats"]
    names = root.attrs["grid"]["variables"]
    mean = np.array([stats[f"grid/{v}"]["mean"][0] for v in names]).reshape(1, -1, 1, 1)
    std = np.array([stats[f"grid/{v}"]["std"][0] for v in names]).reshape(1, -1, 1, 1)
    times = xr.coding.times.decode_cf_datetime(root["time"][...], root["time"].attrs["units"])
    statics = root.attrs["grid"].get("static", []) if cfg.data.static else []
    static = np.zeros((1, 0) + root["data"].shape[2:])
    if statics:  # the constant fields, z-scored by their own statistics, after the window's channels
        s_mean = np.array([stats[f"static/{v}"]["mean"][0] for v in statics]).reshape(1, -1, 1, 1)
        s_std = np.array([stats[f"static/{v}"]["std"][0] for v in statics]).reshape(1, -1, 1, 1)
        static = (np.asarray(root["static"][...], np.float64)[None] - s_mean) / s_std
    out = []
    for init in INITS.split(","):
        t = int(np.flatnonzero(times == np.datetime64(init))[0])
        x = (np.asarray(root["data"][t:t + 1], np.float64) - mean) / std
        leads = []
        with torch.no_grad():
            for _ in range(steps):
                y = model(torch.as_tensor(np.concatenate([x, static], axis=1))).numpy()
                assert y.shape[1] == len(names)
                leads.append(y * std + mean)
                x = y
        out.append(np.concatenate(leads))  # (steps, C, H, W)
    return np.stack(out), names


def test_forecasts_are_the_same_on_every_domain_and_equal_the_model_by_hand(trained, tmp_path, dist):
    outs = {"one": (tmp_path / "one.zarr", []), "three": (tmp_path / "three.nc", ["--domain", "3"]),
            "latlon": (tmp_path / "latlon.zarr", ["--domain", "2", "--lon", "2"]),
            # through domainflow.compile (aot_eager: the graphs' cross-rank checks without a C++ build)
            "compiled": (tmp_path / "compiled.zarr", ["--domain", "2", "--compile", "--compile-backend", "aot_eager"])}
    for name, (out, extra) in outs.items():
        r = _predict(trained, out, "--init", INITS, "--steps", "3", *extra)
        assert r.returncode == 0, r.stderr
        assert f"wrote {out}" in r.stdout
        assert not list(tmp_path.glob(".*tmp*")), list(tmp_path.iterdir())  # the scratch folder is gone
    ref = xr.open_zarr(outs["one"][0])
    expected, names = dist.run(1, _by_hand, trained["store"], trained["ckpt"], 3)[0]
    assert list(ref.data_vars) == names
    for c, v in enumerate(names):
        assert ref[v].dims == ("time", "lead_time", "latitude", "longitude") and ref[v].dtype == np.float64
        np.testing.assert_allclose(ref[v].values, expected[:, :, c], rtol=1e-10, atol=1e-9)
        assert ref[v].attrs["units"] == zarr.open_group(trained["store"]).attrs["fields"][f"grid/{v}"]["units"]
    with (xr.open_dataset(outs["three"][0]) as three, xr.open_zarr(outs["latlon"][0]) as latlon,
          xr.open_zarr(outs["compiled"][0]) as compiled):
        for other in (three, latlon, compiled):
            for v in names:
                np.testing.assert_allclose(other[v].values, ref[v].values, rtol=1e-12, atol=1e-9)
    np.testing.assert_array_equal(ref["time"].values, np.array(INITS.split(","), dtype="datetime64[ns]"))
    np.testing.assert_array_equal(ref["lead_time"].values, np.array([6, 12, 18], dtype="timedelta64[h]"))
    store = zarr.open_group(trained["store"], mode="r")
    np.testing.assert_array_equal(ref["latitude"].values, store["lat"][...])
    np.testing.assert_array_equal(ref["longitude"].values, store["lon"][...])


def test_forecast_errors_are_one_line_before_ranks_start(trained, tmp_path):
    for args, msg in [(["--init", "1999-01-01", "--domain", "2"], "holds no step at that time; its steps run from"),
                      (["--init", INITS, "--steps", "0", "--domain", "2"], "--steps must be at least 1"),
                      (["--run", "run_1", "--domain", "2"], "--run names a run of a mesh store"),
                      (["--init", "0", "--domain", "9"], "leaves a rank without any")]:
        r = _predict(trained, tmp_path / "f.zarr", *args, here=True)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode != 0 and len(lines) == 1 and msg in lines[0], r.stderr
    r = _predict(trained, tmp_path / "f.zarr", "--init", "0", "--compile", "--compile-backend", "eager", here=True)
    assert r.returncode == 2 and "argument --compile-backend: invalid choice: 'eager'" in r.stderr, r.stderr  # argparse's
    # another store, ingested with other channels: the model's inputs would be mixed up
    from domainflow.preprocess.ingest_grid import ingest_climate

    ingest_climate(trained["root"] / "era5.zarr", tmp_path / "other.zarr", progress=False, split=(0.6, 0.2, 0.2),
                   variables=("v10", "u10", "t2m", "msl", "tcwv"))
    r = _predict({**trained, "store": tmp_path / "other.zarr"}, tmp_path / "o.zarr", "--init", INITS, "--domain", "2",
                 here=True)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "but the checkpoint's model was trained on" in lines[0], r.stderr
    r = _predict(trained, tmp_path / "f.txt", "--init", INITS, here=True)
    assert r.returncode != 0 and "a .zarr store or a .nc file" in r.stderr
    assert not (tmp_path / "f.zarr").exists()
    # the output's folder is a file: the first rank cannot create the dataset, and every rank says so
    (tmp_path / "taken").write_text("a file, not a folder")
    r = _predict(trained, tmp_path / "taken" / "f.zarr", "--init", INITS, "--domain", "2")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "rank 0 could not write the prediction" in lines[0], r.stderr


def test_static_fields_are_inputs_and_stay_through_the_rollout(tmp_path, dist):
    """A store of CDS-style files with the land-sea mask as a static field and SST filled: the model takes
    C + 1 inputs, and the forecast at domain 1 and 2 equals the model fed the mask at every step by hand."""
    from domainflow.app.cli import main
    from domainflow.preprocess.ingest_grid import ingest_climate
    from domainflow.preprocess.synth_cds import synth_cds

    synth_cds(tmp_path / "cds", grid=(8, 16), steps=40, seed=3)
    ingest_climate(str(tmp_path / "cds" / "*.nc"), tmp_path / "g.zarr", progress=False, split=(0.6, 0.2, 0.2),
                   static=("lsm",), fill={"sst": "mean"}, variables=("t2m", "sst", "z500"))
    assert main(["train", "--out", str(tmp_path / "train"), f"data.store={tmp_path / 'g.zarr'}", "data.kind=grid",
                 "model.name=unet", "model.base=4", "train.steps=2", "train.dtype=float64", "output.plots=false",
                 "output.progress=false", "data.prefetch=0", "eval.lead_steps=1,2"]) == 0
    trained = {"store": tmp_path / "g.zarr", "ckpt": tmp_path / "train" / "checkpoints"}
    expected, names = dist.run(1, _by_hand, trained["store"], trained["ckpt"], 2)[0]
    assert names == ["t2m", "sst", "z500"]
    for out, extra in ((tmp_path / "one.zarr", []), (tmp_path / "two.zarr", ["--domain", "2"])):
        r = _predict(trained, out, "--init", INITS, "--steps", "2", *extra)
        assert r.returncode == 0, r.stderr
        with xr.open_zarr(out) as got:
            assert sorted(got.data_vars) == sorted(names)  # the static field is an input, not a forecast variable
            for c, v in enumerate(names):
                np.testing.assert_allclose(got[v].values, expected[:, :, c], rtol=1e-10, atol=1e-9)
