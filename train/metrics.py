"""Evaluation metrics, exact across ranks: every sum over a sample's points or grid cells is a global
sum (the engine reduces ShardTensor sums over the domain), and per-sample results are gathered over dp
before averaging, so no metric is a mean of per-rank means.

Surface (mesh) runs: relative L2 error ``|p - t| / |t|`` of Cp and of each wall-shear component, and the
drag and lift coefficients integrated from the predicted surface pressure and shear,
``C = sum(-Cp n + Cf) A / A_ref`` (x: drag, z: lift), next to the same integral of the true fields and
the run's ``force_mom_constref`` values. Grids: RMSE (physical units) and anomaly correlation (against
the training mean, the climatology the data are normalised by) per variable. Every metric is also
reported for a mean-field baseline (predicting the training mean everywhere), and on grids for
persistence (the last input step).
"""

from __future__ import annotations

import math

import torch

import domainflow as df
from domainflow import comm


def _f(t) -> float:
    if isinstance(t, df.ShardTensor):
        t = t.full_tensor()
    return float(t.detach())


def _channels(ds, fields) -> dict[str, slice]:
    out, k = {}, 0
    for f in fields:
        c = int(ds.store.fields[f"{ds.location}/{f}"].get("components", 1))
        out[f] = slice(k, k + c)
        k += c
    return out


def surface_metrics(ds, sample, pred_norm, reference_area: float) -> dict:
    """Metrics of one run from a normalised prediction (1, N, C) laid out like the sample's fields."""
    chans = _channels(ds, ds.fields)
    pred = {f: ds.denormalize(f, pred_norm[0, :, s]) for f, s in chans.items()}
    true = {f: ds.denormalize(f, sample[f]) for f in ds.fields}
    out = {}
    for f in ds.fields:
        comps = ["x", "y", "z"] if pred[f].shape[-1] == 3 else [""]
        for c, name in enumerate(comps):
            err = ((pred[f][:, c] - true[f][:, c]) ** 2).sum()
            ref = (true[f][:, c] ** 2).sum()
            out[f"rel_l2_{f}{'_' + name if name else ''}"] = math.sqrt(_f(err) / max(_f(ref), 1e-300))
    if "Cp" in pred and "Cf" in pred and "normals" in ds.inputs and "areas" in ds.inputs:
        n = ds.denormalize("normals", sample["normals"])
        a = ds.denormalize("areas", sample["areas"])[:, 0]
        for label, fields in (("pred", pred), ("true", true)):
            cp, cf = fields["Cp"][:, 0], fields["Cf"]
            force = ((-cp[:, None] * n + cf) * a[:, None]).sum(0) / reference_area
            force = force.full_tensor() if isinstance(force, df.ShardTensor) else force
            out[f"cd_{label}"], out[f"cl_{label}"] = float(force[0]), float(force[2])
        forces = sample.get("forces_constref", {})
        if "cd" in forces:
            out["cd_csv"], out["cl_csv"] = float(forces["cd"]), float(forces.get("cl", float("nan")))
    return out


def grid_metrics(ds, sample, pred_norm) -> dict:
    """Per variable: squared error sum (physical units), cell count and anomaly-correlation terms."""
    out = {}
    std = torch.tensor([ds.store.stats[f"grid/{v}"]["std"][0] or 1.0 for v in ds.variables], dtype=torch.float64)
    for c, v in enumerate(ds.variables):
        p, t = pred_norm[0, c], sample["target"][0, c]
        se = _f(((p - t) ** 2).sum()) * float(std[c]) ** 2
        num, pp, tt = _f((p * t).sum()), _f((p * p).sum()), _f((t * t).sum())
        cells = t.shape[0] * t.shape[1]
        out[v] = {"se": se, "cells": cells, "acc": num / math.sqrt(pp * tt) if pp > 0 and tt > 0 else 0.0}
    return out


@torch.no_grad()
def evaluate(trainer, split: str) -> dict:
    """Metrics of ``trainer.model`` on every sample of ``split`` (split over dp; exact over the domain),
    with the mean-field baseline; the same dict on every rank."""
    from .data import build_dataset, make_batch
    from .inference import infer

    cfg = trainer.cfg
    store_splits = trainer.ds.store.splits
    if split not in store_splits or not store_splits[split]:
        return {}
    extra = ["normals", "areas"] if cfg.data.kind == "mesh" else []
    ds = build_dataset(cfg, trainer.mesh, split, shuffle=False, extra_inputs=extra)
    model = trainer.model
    was_training = model.training
    model.eval()
    rows = []
    try:
        for key, w in ds.steps(0):
            if w == 0:
                continue
            sample = ds.wrap(ds.read_region(key, w))
            batch = make_batch(cfg, ds, sample, trainer.param_stats)
            pred = infer(model, batch, cfg)
            base = torch.zeros_like(batch.target)
            if cfg.data.kind == "mesh":
                rows.append({"run": key, "model": surface_metrics(ds, sample, pred, cfg.output.reference_area),
                             "baseline": surface_metrics(ds, sample, base, cfg.output.reference_area)})
            else:
                last = batch.x[:, -batch.target.shape[1]:]   # persistence: the last input step
                rows.append({"run": int(key), "model": grid_metrics(ds, sample, pred),
                             "baseline": grid_metrics(ds, sample, base),
                             "persistence": grid_metrics(ds, sample, last)})
    finally:
        model.train(was_training)
    if ds.axes.dp_size > 1:
        gathered = comm.all_gather_object(rows, trainer.mesh, 0)
        rows = [r for part in gathered for r in part]
    rows.sort(key=lambda r: str(r["run"]))
    summary = _summarise(rows, cfg.data.kind)
    return {"split": split, "runs": rows, "summary": summary}


def _summarise(rows: list[dict], kind: str) -> dict:
    out = {}
    for which in ("model", "baseline", "persistence"):
        if not rows or which not in rows[0]:
            continue
        if kind == "mesh":
            keys = [k for k in rows[0][which] if k.startswith("rel_l2")]
            s = {k: sum(r[which][k] for r in rows) / len(rows) for k in keys}
            if "cd_pred" in rows[0][which]:
                for c in ("cd", "cl"):
                    s[f"{c}_mae_vs_csv"] = sum(abs(r[which][f"{c}_pred"] - r[which][f"{c}_csv"]) for r in rows) / len(rows)
                s["cd_true_fields_mae_vs_csv"] = sum(abs(r[which]["cd_true"] - r[which]["cd_csv"]) for r in rows) / len(rows)
        else:
            s = {}
            for v in rows[0][which]:
                se = sum(r[which][v]["se"] for r in rows)
                cells = sum(r[which][v]["cells"] for r in rows)
                s[f"rmse_{v}"] = math.sqrt(se / cells)
                s[f"acc_{v}"] = sum(r[which][v]["acc"] for r in rows) / len(rows)
        out[which] = s
    out["samples"] = len(rows)
    return out
