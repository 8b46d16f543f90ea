"""Evaluation metrics, exact across ranks: every sum over a sample's points or grid cells is a global
sum (the engine reduces ShardTensor sums over the domain), and per-sample results are gathered over dp
before averaging, so no metric is a mean of per-rank means.

Surface (mesh) runs: relative L2 error ``|p - t| / |t|`` of Cp and of each wall-shear component, and the
drag and lift coefficients integrated from the predicted surface pressure and shear,
``C = sum(-Cp n + Cf) A / A_ref`` (x: drag, z: lift), next to the same integral of the true fields and
the run's ``force_mom_constref`` values, next to a mean-field baseline (the training mean everywhere).
Grids, as WeatherBench 2 scores them (``grid_scores``): latitude-weighted RMSE in physical units and ACC
against the train split's per-gridpoint climatology by day of year and hour, at each of
``eval.lead_steps`` of an autoregressive rollout, for the model, persistence and the climatology forecast.
"""

from __future__ import annotations

import math

import numpy as np
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


DRIVAERML_FORCES = {"drag_axis": 0, "lift_axis": 2, "reference_area": 2.15}  # a store from before recipes


def force_axes(store, reference_area: float = 0.0) -> tuple[int, int, float]:
    """(drag axis, lift axis, reference area) of a mesh store's force coefficients: its recipe's (WindsorML
    lifts along y), the area ``reference_area`` when given (> 0)."""
    f = {**DRIVAERML_FORCES, **{k: v for k, v in dict(store.attrs.get("forces", {})).items() if v is not None}}
    return int(f["drag_axis"]), int(f["lift_axis"]), float(reference_area or f["reference_area"])


def surface_metrics(ds, sample, pred_norm, reference_area: float) -> dict:
    """Metrics of one run from a normalised prediction (1, N, C) laid out like the sample's fields
    (``reference_area``: 0 for the store's)."""
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
        drag, lift, area = force_axes(ds.store, reference_area)
        for label, fields in (("pred", pred), ("true", true)):
            cp, cf = fields["Cp"][:, 0], fields["Cf"]
            force = ((-cp[:, None] * n + cf) * a[:, None]).sum(0) / area
            force = force.full_tensor() if isinstance(force, df.ShardTensor) else force
            out[f"cd_{label}"], out[f"cl_{label}"] = float(force[drag]), float(force[lift])
        forces = {k.lower(): v for k, v in sample.get("forces_constref", {}).items()}  # WindsorML writes Cd, Cl
        for c in ("cd", "cl"):
            if c in forces:
                out[f"{c}_csv"] = float(forces[c])
        if forces and ("cd" not in forces or "cl" not in forces):  # named in the summary, never silently dropped
            out["csv_missing"] = [c for c in ("cd", "cl") if c not in forces]
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
    ds = build_dataset(cfg, trainer.mesh, split, shuffle=False, extra_inputs=extra, norm=trainer.norm)
    model = trainer.model
    was_training = model.training
    model.eval()
    rows = []
    try:
        if cfg.data.kind == "grid":
            rows = _grid_rows(ds, model, cfg, split)
        entries = [(key, w) for key, w in ds.steps(0) if w != 0] if cfg.data.kind == "mesh" else []
        for (key, _), sample in zip(entries, ds.samples(entries)):
            batch = make_batch(cfg, ds, sample, trainer.param_stats)
            pred = infer(model, batch, cfg)
            base = torch.zeros_like(batch.target)
            rows.append({"run": key, "model": surface_metrics(ds, sample, pred, cfg.output.reference_area),
                         "baseline": surface_metrics(ds, sample, base, cfg.output.reference_area)})
    finally:
        model.train(was_training)
    if ds.axes.dp_size > 1:
        gathered = comm.all_gather_object(rows, trainer.mesh, 0)
        rows = [r for part in gathered for r in part]
    rows.sort(key=lambda r: str(r["run"]))
    summary = _summarise(rows, cfg.data.kind) if cfg.data.kind == "mesh" else _summarise_grid(rows, ds, cfg)
    return {"split": split, "runs": rows, "summary": summary}


GRID_FORECASTS = ("model", "persistence", "climatology")


def _grid_rows(ds, model, cfg, split: str) -> list[dict]:
    """For each initial time of the split whose rollout stays inside one of its time ranges: the model rolled
    out autoregressively to the largest of ``eval.lead_steps`` (its prediction fed back as the newest input
    step), and at each of those leads the scores of the model, of persistence (the last input step) and of
    the climatology of the valid time, against the truth of the valid time (``grid_scores``)."""
    from .grid_scores import forecast_terms
    from .inference import rollout

    leads = list(cfg.eval.lead_steps)
    last_lead = max(leads)
    C = len(ds.variables)
    weights = ds.lat_weights()
    ranges = ds.store.splits[split]
    rows = []
    entries = [(t, w) for t, w in ds.steps(0) if w != 0 and any(a <= t and t + last_lead * ds.lead < b
                                                                 for a, b in ranges)]
    for (t, _), sample in zip(entries, ds.samples(entries)):
        newest = ds.history * C  # the static fields follow the window's steps
        persistence = sample["input"][:, newest - C:newest]
        row = {"run": int(t), "leads": {}}
        for k, pred in rollout(model, sample["input"], last_lead, C, cfg, relayout=ds.relayout,
                               statics=len(ds.statics)):
            if k not in leads:
                continue
            valid = t + k * ds.lead
            truth = sample["target"] if k == 1 else ds.shard(ds.read_truth(valid))
            clim = ds.shard(ds.read_climatology(valid)) if ds.has_climatology else torch.zeros_like(truth)
            observed = ds.shard(ds.read_valid(valid)) if ds.has_mask else None  # filled points left out
            row["leads"][str(k)] = {name: {key: v.tolist() for key, v in
                                           forecast_terms(f, truth, clim, weights, observed).items()}
                                    for name, f in (("model", pred), ("persistence", persistence),
                                                    ("climatology", clim))}
        rows.append(row)
    return rows


def _summarise_grid(rows: list[dict], ds, cfg) -> dict:
    """RMSE and ACC per variable for the model, persistence and climatology at each lead; the first lead's
    also as the summary's ``model``/``persistence``/``climatology`` entries."""
    from .grid_scores import summarise

    std = [ds.stats[f"grid/{v}"]["std"][0] or 1.0 for v in ds.variables]
    leads = [str(k) for k in cfg.eval.lead_steps]
    by_lead = {}
    for k in leads:
        by_lead[k] = {name: summarise([{key: np.asarray(v) for key, v in r["leads"][k][name].items()} for r in rows],
                                      ds.variables, std) for name in GRID_FORECASTS}
    out = dict(by_lead[leads[0]]) if rows else {name: {} for name in GRID_FORECASTS}
    out["samples"] = len(rows)
    out["leads"] = by_lead
    out["lead_steps"] = [int(k) for k in leads]
    step_h = _step_hours(ds)
    if step_h:
        out["lead_hours"] = [int(k) * ds.lead * step_h for k in leads]
    out["climatology_source"] = ("the train split's per-gridpoint climatology by day of year and hour" if
                                 ds.has_climatology else "the train mean of each variable (the store has no "
                                 "climatology: re-ingest it for WeatherBench anomalies)")
    T, _, H, W = ds.data.shape
    missing = ds.store.attrs.get("grid", {}).get("missing", {})
    out["filled"] = {v: missing[v]["count"] / (T * H * W) for v in ds.variables if v in missing}
    out["filled_scored"] = not ds.has_mask  # a store from before the mask: its filled points are in the scores
    return out


def _step_hours(ds) -> float | None:
    """Hours between two steps of the store, when its time axis holds dates."""
    from domainflow.store.time_axis import step_hours

    time = ds.store.group["time"]
    return step_hours(ds.store.read(time, slice(0, 2)), dict(time.attrs))


def _summarise(rows: list[dict], kind: str) -> dict:
    out = {}
    for which in ("model", "baseline"):
        if not rows or which not in rows[0]:
            continue
        if kind == "mesh":
            keys = [k for k in rows[0][which] if k.startswith("rel_l2")]
            s = {k: sum(r[which][k] for r in rows) / len(rows) for k in keys}
            s.update(_csv_scores(rows, which, out))
        out[which] = s
    out["samples"] = len(rows)
    return out


def _csv_scores(rows: list[dict], which: str, summary: dict) -> dict:
    """The drag and lift errors against the runs' force CSVs; a score some run's CSV cannot give is left out and
    named in ``summary["not_computed"]`` (which runs lack which coefficient), never dropped silently."""
    if not all("cd_pred" in r[which] for r in rows) or not any(f"{c}_csv" in r[which] or "csv_missing" in r[which]
                                                               for r in rows for c in ("cd", "cl")):
        return {}  # no forces integrated (no Cp/Cf/normals/areas) or a recipe without force CSVs
    scores = {}
    for key, (c, side) in CSV_SCORES.items():
        lacking = [str(r["run"]) for r in rows if f"{c}_csv" not in r[which]]
        if lacking:
            with_file = [str(r["run"]) for r in rows if any(k in r[which] for k in ("cd_csv", "cl_csv", "csv_missing"))]
            what = (f"have no {c} column in their force CSV (forces_constref)" if set(lacking) <= set(with_file) else
                    f"lack the force CSV (forces_constref) or its {c} column")
            summary.setdefault("not_computed", {})[key] = (
                f"run(s) {lacking[:6]}{' ...' if len(lacking) > 6 else ''} {what}")
        else:
            scores[key] = sum(abs(r[which][f"{c}_{side}"] - r[which][f"{c}_csv"]) for r in rows) / len(rows)
    return scores


# score: (coefficient, which integral of it is compared with the run's force CSV)
CSV_SCORES = {"cd_mae_vs_csv": ("cd", "pred"), "cl_mae_vs_csv": ("cl", "pred"),
              "cd_true_fields_mae_vs_csv": ("cd", "true")}
