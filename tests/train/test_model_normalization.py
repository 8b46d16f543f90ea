"""A model carries its normalisation: its checkpoints record the statistics its inputs and outputs were scaled
with, and predictions, forecasts and evaluation use them whatever store they read. A run predicted from the
training store and from a store holding only that run (other statistics) is the same prediction; a forecast
from a store ingested with another split is the same forecast; a store whose channels do not fit is refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cli_runner import run_cli
from test_train import MESH_OVERRIDES

GRID = ["data.kind=grid", "model.name=unet", "model.base=4", "train.dtype=float64", "output.plots=false",
        "output.progress=false", "data.prefetch=0"]


@pytest.fixture(scope="module")
def mesh_stores(cars_raw, cars_store, tmp_path_factory):
    """A 4-run training store and a store of one of its runs ingested alone (its own statistics)."""
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml

    root = tmp_path_factory.mktemp("norm_mesh")
    (root / "all.zarr").symlink_to(cars_store)
    (root / "one").mkdir()
    shutil.copytree(cars_raw / "run_2", root / "one" / "run_2")
    ingest_drivaerml(root / "one", root / "one.zarr", MeshOptions(parts=2, locations=("surface",), progress=False,
                                                                  split=(1.0, 0.0, 0.0)))
    res = run_cli("train", f"data.store={root / 'all.zarr'}", *MESH_OVERRIDES, "train.steps=2", "output.plots=false",
                  "--out", root / "run")
    assert res.returncode == 0, res.stderr
    return root


def _cp_pred(path):
    import pyvista as pv

    mesh = pv.read(path)
    return np.asarray(mesh.cell_data["Cp_pred"], np.float64), np.asarray(mesh.cell_data["cell_id"])


def test_a_run_predicts_the_same_from_any_store(mesh_stores):
    from domainflow.readers import open_store

    root = mesh_stores
    a, b = (open_store(root / n) for n in ("all.zarr", "one.zarr"))
    assert a.stats["surface/Cp"]["mean"] != b.stats["surface/Cp"]["mean"]  # the stores' statistics differ
    for n in ("all", "one"):
        res = run_cli("predict", root / "run" / "checkpoints", root / f"{n}.zarr", "--run", "run_2", root / f"{n}.vtp")
        assert res.returncode == 0, res.stderr
    (pa, ia), (pb, ib) = _cp_pred(root / "all.vtp"), _cp_pred(root / "one.vtp")
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_allclose(pb, pa, rtol=1e-12, atol=1e-12)


def test_the_checkpoint_records_what_the_inputs_were_scaled_with(mesh_stores):
    from domainflow.readers import open_store
    from domainflow.train import checkpoint as ckpt

    meta = ckpt.meta(ckpt.latest(mesh_stores / "run" / "checkpoints"))
    norm = meta["normalization"]
    store = open_store(mesh_stores / "all.zarr")
    assert norm["fields"] == ["Cp", "Cf"] and norm["components"] == {"Cp": 1, "Cf": 3}
    for key in ("surface/Cp", "surface/Cf", "surface/coords", "surface/normals"):
        np.testing.assert_array_equal(norm["stats"][key]["mean"], np.ravel(store.stats[key]["mean"]))
        np.testing.assert_array_equal(norm["stats"][key]["std"], np.ravel(store.stats[key]["std"]))
    assert norm["params"]["names"] == sorted(store.run(store.runs("train")[0]).attrs["geometry"])
    assert meta["run"]["train.lr"] == 3e-3 and "training data (channels)" in meta["run"]


@pytest.fixture(scope="module")
def grid_stores(tmp_path_factory):
    """One climate series ingested with two splits (other train statistics), and without one variable."""
    from domainflow.preprocess.ingest_grid import ingest_climate
    from domainflow.preprocess.synth_climate import synth_climate

    root = tmp_path_factory.mktemp("norm_grid")
    synth_climate(root / "era5.zarr", grid=(8, 16), steps=40, seed=4, progress=False)
    ingest_climate(root / "era5.zarr", root / "a.zarr", progress=False, split=(0.6, 0.2, 0.2))
    ingest_climate(root / "era5.zarr", root / "b.zarr", progress=False, split=(0.3, 0.3, 0.4))
    res = run_cli("train", f"data.store={root / 'a.zarr'}", *GRID, "train.steps=2", "--out", root / "run")
    assert res.returncode == 0, res.stderr
    return root


def test_a_forecast_is_the_same_from_a_store_with_other_statistics(grid_stores):
    import xarray as xr

    from domainflow.readers import open_store

    root = grid_stores
    assert open_store(root / "a.zarr").stats["grid/t2m"] != open_store(root / "b.zarr").stats["grid/t2m"]
    for n in ("a", "b"):
        res = run_cli("predict", root / "run" / "checkpoints", root / f"{n}.zarr", root / f"f_{n}.zarr",
                      "--init", "2020-01-06T00", "--steps", "2")
        assert res.returncode == 0, res.stderr
    with xr.open_zarr(root / "f_a.zarr") as fa, xr.open_zarr(root / "f_b.zarr") as fb:
        for v in fa.data_vars:
            np.testing.assert_allclose(fb[v].values, fa[v].values, rtol=1e-12, atol=1e-9)


def test_a_store_without_the_models_channels_is_refused_by_name(grid_stores):
    from domainflow.preprocess.ingest_grid import ingest_climate

    root = grid_stores
    ingest_climate(root / "era5.zarr", root / "fewer.zarr", progress=False, split=(0.6, 0.2, 0.2),
                   variables=("t2m", "msl"))
    res = run_cli("predict", root / "run" / "checkpoints", root / "fewer.zarr", root / "f.zarr", "--init", "5")
    assert res.returncode == 1
    assert "holds channels ['t2m', 'msl']" in res.stderr and "was trained on" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
