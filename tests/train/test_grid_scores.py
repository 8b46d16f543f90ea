"""WeatherBench 2's scores (``train/grid_scores.py``) against answers known by hand and against an independent
numpy formula, on one process and on a grid split over ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from domainflow.train.grid_scores import forecast_terms, summarise

H, W, C = 7, 10, 3
LAT = np.linspace(-81, 81, H)


def _weights():
    w = np.cos(np.deg2rad(LAT))
    return w / w.mean()


def _t(a):
    return torch.as_tensor(a, dtype=torch.float64)


def _w():
    return _t(_weights()).reshape(1, 1, H, 1)


def _fields(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, C, H, W)) for _ in range(3)]


def test_known_answers():
    f, o, clim = _fields()
    std = [2.0, 0.5, 10.0]
    # a constant offset: RMSE is the offset (weights have mean 1), in physical units
    off = forecast_terms(_t(o + 0.3), _t(o), _t(clim), _w())
    np.testing.assert_allclose(off["mse"], 0.09, rtol=1e-12)
    assert summarise([off], ["a", "b", "c"], std)["rmse_a"] == pytest.approx(0.6)
    # a perfect forecast: RMSE 0, ACC 1; the climatology forecast: ACC 0
    perfect = forecast_terms(_t(o), _t(o), _t(clim), _w())
    np.testing.assert_allclose(perfect["mse"], 0, atol=0)
    np.testing.assert_allclose(perfect["acc"], 1, rtol=1e-12)
    np.testing.assert_array_equal(forecast_terms(_t(clim), _t(o), _t(clim), _w())["acc"], 0.0)
    # anomalies scaled up keep ACC 1; reversed give -1
    np.testing.assert_allclose(forecast_terms(_t(clim + 3 * (o - clim)), _t(o), _t(clim), _w())["acc"], 1, rtol=1e-12)
    np.testing.assert_allclose(forecast_terms(_t(clim - (o - clim)), _t(o), _t(clim), _w())["acc"], -1, rtol=1e-12)
    # RMSE is the square root of the mean MSE over forecasts (not the mean of their RMSEs)
    a = {"mse": np.array([1.0, 1, 1]), "acc": np.array([0.5, 0.5, 0.5])}
    b = {"mse": np.array([9.0, 9, 9]), "acc": np.array([1.0, 1, 1])}
    s = summarise([a, b], ["a", "b", "c"], [1.0, 1.0, 1.0])
    assert s["rmse_a"] == pytest.approx(math.sqrt(5)) and s["acc_a"] == pytest.approx(0.75)


def _numpy_terms(f, o, clim):
    w = _weights().reshape(1, 1, H, 1)
    mse = (w * (f - o) ** 2).mean(axis=(0, 2, 3))
    fa, oa = f - clim, o - clim
    acc = (w * fa * oa).sum(axis=(0, 2, 3)) / np.sqrt((w * fa ** 2).sum(axis=(0, 2, 3)) * (w * oa ** 2).sum(axis=(0, 2, 3)))
    return mse, acc


def _valid(seed=0):
    """Channel 1 missing on a land-like patch (filled at ingest); the others observed everywhere."""
    v = np.ones((1, C, H, W))
    v[0, 1, 2:5, 3:8] = 0
    return v


def _numpy_masked(f, o, clim, valid):
    """WeatherBench 2 on NaN-masked truth: xarray's weighted means over the observed points only."""
    mse, acc = [], []
    w = np.broadcast_to(_weights().reshape(H, 1), (H, W))
    for c in range(C):
        keep = valid[0, c] > 0
        wk, fk, ok, ck = w[keep], f[0, c][keep], o[0, c][keep], clim[0, c][keep]
        mse.append((wk * (fk - ok) ** 2).sum() / wk.sum())
        fa, oa = fk - ck, ok - ck
        acc.append((wk * fa * oa).sum() / np.sqrt((wk * fa ** 2).sum() * (wk * oa ** 2).sum()))
    return np.array(mse), np.array(acc)


def test_points_filled_at_ingest_are_left_out_of_the_scores():
    f, o, clim = _fields(4)
    valid = _valid()
    o_filled = np.where(valid > 0, o, 0.0)  # what the store holds there: a fill value
    got = forecast_terms(_t(f), _t(o_filled), _t(clim), _w(), _t(valid))
    mse, acc = _numpy_masked(f, o, clim, valid)
    np.testing.assert_allclose(got["mse"], mse, rtol=1e-12)
    np.testing.assert_allclose(got["acc"], acc, rtol=1e-12)
    plain = forecast_terms(_t(f), _t(o), _t(clim), _w())  # all ones: the unmasked scores exactly
    all_valid = forecast_terms(_t(f), _t(o), _t(clim), _w(), _t(np.ones((1, C, H, W))))
    np.testing.assert_allclose(all_valid["mse"], plain["mse"], rtol=1e-12)
    np.testing.assert_allclose(all_valid["acc"], plain["acc"], rtol=1e-12)


def test_scores_equal_the_numpy_formula_on_one_process():
    for seed in range(3):
        f, o, clim = _fields(seed)
        got = forecast_terms(_t(f), _t(o), _t(clim), _w())
        mse, acc = _numpy_terms(f, o, clim)
        np.testing.assert_allclose(got["mse"], mse, rtol=1e-12)
        np.testing.assert_allclose(got["acc"], acc, rtol=1e-12)


def _sharded_terms(seed, lon_too):
    import domainflow as df
    from domainflow import Replicate, Shard
    from sharded_check import get_mesh

    world = torch.distributed.get_world_size()
    mesh = get_mesh((world // 2, 2) if lon_too else (world,), ("lat", "lon") if lon_too else ("lat",))
    f, o, clim = _fields(seed)
    place = [Shard(2), Shard(3)] if lon_too else [Shard(2)]
    wplace = [Shard(2), Replicate()] if lon_too else [Shard(2)]
    fs, os_, cs, vs = (df.distribute_tensor(_t(x), mesh, place) for x in (f, o, clim, _valid()))
    got = forecast_terms(fs, os_, cs, df.distribute_tensor(_w(), mesh, wplace))
    masked = forecast_terms(fs, os_, cs, df.distribute_tensor(_w(), mesh, wplace), vs)
    return got["mse"], got["acc"], masked["mse"], masked["acc"]


@pytest.mark.parametrize("world,lon_too", [(2, False), (3, False), (4, True)])
def test_scores_on_a_grid_split_over_ranks_equal_one_process(dist, world, lon_too):
    for seed in range(2):
        mse, acc = _numpy_terms(*_fields(seed))
        masked_mse, masked_acc = _numpy_masked(*_fields(seed), _valid())
        for got_mse, got_acc, got_mmse, got_macc in dist.run(world, _sharded_terms, seed, lon_too):
            np.testing.assert_allclose(got_mse, mse, rtol=1e-12)
            np.testing.assert_allclose(got_acc, acc, rtol=1e-12)
            np.testing.assert_allclose(got_mmse, masked_mse, rtol=1e-12)
            np.testing.assert_allclose(got_macc, masked_acc, rtol=1e-12)
