"""Scores of gridded forecasts as WeatherBench 2 defines them, exact on a grid split over ranks.

For one forecast (an initial time, a lead, a variable) on z-scored fields, with latitude weights
``w = cos(lat)`` normalised to mean 1 over the grid:

- squared error ``MSE = mean over grid points of w (f - o)^2``;
- anomaly correlation ``ACC = sum w f'o' / sqrt(sum w f'^2 * sum w o'^2)``, ``f' = f - c`` and ``o' = o - c``
  the anomalies against the climatology ``c`` of the forecast's valid time (day of year and hour of day);
  0 when the forecast has no anomaly at all (the climatology forecast).

Over forecasts, ``RMSE = sqrt(mean of MSE)`` (the square root after the time mean, as WeatherBench 2 computes
it) in the variable's units (the z-score's std multiplied back; ACC does not depend on the scaling), and
``ACC = mean of ACC``. The four weighted sums of a forecast are pending sums over the grid's ranks, finished
in one all-reduce, so every rank gets the global values.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def forecast_terms(f, o, clim, weights, valid=None) -> dict:
    """Per channel of one forecast: ``mse`` and ``acc`` (numpy arrays of C values). ``f``, ``o``, ``clim``:
    (1, C, H, W) z-scored forecast, truth and climatology (ShardTensors or plain tensors); ``weights``: the
    (1, 1, H, 1) latitude weights laid out like them; ``valid``: (1, C, H, W) 1 where the truth was observed, 0
    where it was missing and filled at ingest (those points are left out, as WeatherBench 2's NaN-skipping
    weighted means do: the MSE is then divided by the weights of the valid points)."""
    from domainflow import reduce_partials

    f, o, clim = (x.to(torch.float64) for x in (f, o, clim))
    fa, oa = f - clim, o - clim
    dims = (0, 2, 3)
    if valid is None:
        sums = reduce_partials((weights * (f - o) ** 2).sum(dims), (weights * fa * oa).sum(dims),
                               (weights * fa * fa).sum(dims), (weights * oa * oa).sum(dims))
        norm = np.full(f.shape[1], float(f.shape[2] * f.shape[3]))  # the weights' sum: mean 1 over the grid
    else:
        w = weights * valid.to(torch.float64)
        sums = reduce_partials((w * (f - o) ** 2).sum(dims), (w * fa * oa).sum(dims), (w * fa * fa).sum(dims),
                               (w * oa * oa).sum(dims), w.sum(dims))
        norm = _plain(sums[4]).cpu().numpy()
    se, num, ff, oo = (_plain(s).cpu().numpy() for s in sums[:4])
    denom = np.sqrt(ff * oo)
    acc = np.divide(num, denom, out=np.zeros_like(num), where=denom > 0)
    return {"mse": np.divide(se, norm, out=np.zeros_like(se), where=norm > 0), "acc": acc}


def _plain(t):
    from domainflow import ShardTensor

    return t.full_tensor() if isinstance(t, ShardTensor) else t


def summarise(terms: list[dict], variables: list[str], std) -> dict:
    """``rmse_<v>`` (physical units) and ``acc_<v>`` over a list of :func:`forecast_terms` results."""
    out = {}
    if not terms:
        return out
    mse = np.mean([t["mse"] for t in terms], axis=0)
    acc = np.mean([t["acc"] for t in terms], axis=0)
    for c, v in enumerate(variables):
        out[f"rmse_{v}"] = math.sqrt(float(mse[c])) * float(std[c])
        out[f"acc_{v}"] = float(acc[c])
    return out
