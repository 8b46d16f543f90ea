"""What a model's inputs and outputs were scaled with, recorded in each checkpoint so that prediction,
forecasts, evaluation and resumed training z-score with the model's own statistics, whatever store they read.

A record holds the per-key mean and std (store keys such as ``surface/Cp``, ``grid/t2m``, ``static/lsm``) of
every model input and output, what those channels are (fields and their components, geometry inputs, grid
variables and static fields) and, for mesh runs, the design parameters' names, mean and std. A store whose
channels do not fit the record is refused by name before anything is read.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from .config import ConfigError


def _moments(s: dict) -> dict:
    return {"mean": [float(v) for v in np.ravel(s["mean"])], "std": [float(v) for v in np.ravel(s["std"])]}


def from_store(cfg, store) -> dict:
    """The normalisation a training with ``cfg`` gets from ``store``: its train statistics of the model's inputs
    and outputs, and the design parameters' mean and std over its train runs (what ``MeshDataset`` and
    ``GridDataset`` z-score with when given no ``stats``)."""
    if cfg.data.kind == "mesh":
        loc = cfg.data.location
        names = list(cfg.data.inputs) + list(cfg.data.fields)
        out = {"kind": "mesh", "location": loc, "inputs": list(cfg.data.inputs), "fields": list(cfg.data.fields),
               "components": {f: int(store.fields.get(f"{loc}/{f}", {}).get("components", 1)) for f in cfg.data.fields},
               "stats": {f"{loc}/{n}": _moments(store.stats[f"{loc}/{n}"]) for n in names if f"{loc}/{n}" in store.stats},
               "params": _params(store) if cfg.data.use_params else None}
    else:
        grid = store.attrs.get("grid", {})
        variables = list(grid.get("variables", []))
        statics = list(grid.get("static", [])) if cfg.data.static else []
        keys = [f"grid/{v}" for v in variables] + [f"static/{n}" for n in statics]
        out = {"kind": "grid", "variables": variables, "statics": statics,
               "stats": {k: _moments(store.stats[k]) for k in keys if k in store.stats}}
    out["store"] = str(store.path)
    return out


def _params(store) -> dict | None:
    """Names, mean and std of the design parameters over the store's train runs (all runs if it has none)."""
    runs = (store.runs("train") if "train" in store.splits else []) or store.runs()
    names = sorted(store.run(runs[0]).attrs.get("geometry", {})) if runs else []
    if not names:
        return None
    values = np.array([[store.run(r).attrs.get("geometry", {}).get(k, np.nan) for k in names] for r in runs],
                      dtype=np.float64)
    std = values.std(0)
    return {"names": names, "mean": [float(v) for v in values.mean(0)],
            "std": [float(v) for v in np.where(std > 0, std, 1.0)]}


def stats(norm: dict | None) -> dict | None:
    """The record's statistics as a reader's ``stats=`` override (None: the store's own)."""
    return None if norm is None else norm["stats"]


def params(norm: dict | None):
    """(mean, std) of the design parameters the model was trained with, or None."""
    p = (norm or {}).get("params")
    return None if not p else (np.asarray(p["mean"], np.float64), np.asarray(p["std"], np.float64))


def channels(norm: dict) -> dict:
    """What the model's input and output channels are (the record without its statistics and store)."""
    out = {k: v for k, v in norm.items() if k not in ("stats", "store", "params")}
    out["params"] = (norm.get("params") or {}).get("names")
    return out


def digest(norm: dict) -> str:
    """A short hash of the channels (part of a run's identity; the statistics are compared with a tolerance)."""
    return hashlib.sha256(json.dumps(channels(norm), sort_keys=True).encode()).hexdigest()[:16]


def stats_differences(recorded: dict, current: dict, rtol: float = 1e-9) -> list[str]:
    """Statistics of ``recorded`` (a checkpoint's) that ``current`` (a store's) does not match within ``rtol``:
    'key mean: checkpoint [..], store [..]'. Re-ingesting the same data may change the last bits (another
    partition sums in another order); other runs or another split change the statistics themselves."""
    def close(a, b) -> bool:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return a.shape == b.shape and bool(np.all(np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b)) + 1e-300))

    out = []
    rows = [(k, m, s.get(m), (current["stats"].get(k) or {}).get(m)) for k, s in recorded["stats"].items()
            for m in ("mean", "std")]
    rp, cp = recorded.get("params") or {}, current.get("params") or {}
    rows += [("design parameters", m, rp.get(m), cp.get(m)) for m in ("mean", "std") if rp or cp]
    for key, moment, a, b in rows:
        if a is None or b is None or not close(a, b):
            out.append(f"{key} {moment}: checkpoint {_short(a)}, store {_short(b)}")
    return out


def _short(v) -> str:
    if v is None:
        return "none"
    v = np.ravel(np.asarray(v, np.float64))
    return "[" + ", ".join(f"{x:.6g}" for x in v[:4]) + (" ..." if len(v) > 4 else "") + "]"


def config_differences(norm: dict, cfg) -> list[str]:
    """Where a checkpoint's channels (``norm``) differ from what the config ``cfg`` asks of its data: the fields
    to predict, the inputs, their location, the design parameters, the static fields ('what: checkpoint X,
    this run Y')."""
    d = cfg.data
    if norm["kind"] != d.kind:
        return [f"data.kind: checkpoint {norm['kind']!r}, this run {d.kind!r}"]
    if norm["kind"] == "mesh":
        pairs = [("data.location", norm["location"], d.location), ("data.fields", norm["fields"], list(d.fields)),
                 ("data.inputs", norm["inputs"], list(d.inputs)),
                 ("data.use_params", bool(norm.get("params")), bool(d.use_params) and bool(norm.get("params")))]
    else:
        pairs = [("data.static", bool(norm["statics"]), bool(d.static) and bool(norm["statics"]))]
    return [f"{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in pairs if a != b]


def check_fits(norm: dict, store, cfg, where: str) -> None:
    """Refuse ``store`` when the channels a checkpoint's model was trained on (``norm``) are not all there with
    the same shape (``where``: what the checkpoint is, for the message)."""
    if norm["kind"] != cfg.data.kind:
        raise ConfigError(f"{store.path} is a {store.kind} store, but {where} was trained on a {norm['kind']} store")
    if norm["kind"] == "mesh":
        loc = norm["location"]
        have = {}
        for f in norm["fields"]:
            info = store.fields.get(f"{loc}/{f}")
            have[f] = None if info is None else int(info.get("components", 1))
        bad = {f: have[f] for f in norm["fields"] if have[f] != norm["components"][f]}
        if bad:
            raise ConfigError(
                f"{store.path} does not hold the {loc} fields {where} predicts: it was trained on "
                f"{_listing(norm['components'])}, the store has {_listing(have)} (None: missing); use a store "
                f"ingested with the same fields")
        p = norm.get("params")
        if p and cfg.data.use_params:
            runs = store.runs()
            names = sorted(store.run(runs[0]).attrs.get("geometry", {})) if runs else []
            if names != p["names"]:
                raise ConfigError(f"{store.path}'s runs have design parameters {names}, but {where} was trained on "
                                  f"{p['names']}; use a store ingested with the same recipe (geometry CSV)")
        return
    grid = store.attrs.get("grid", {})
    here_vars = list(grid.get("variables", []))
    here_static = list(grid.get("static", [])) if cfg.data.static else []
    if here_vars != norm["variables"] or here_static != norm["statics"]:
        raise ConfigError(f"{store.path} holds channels {here_vars} and static fields {here_static}, but the "
                          f"checkpoint's model was trained on {norm['variables']} and {norm['statics']} ({where}); use a "
                          f"store ingested the same way")


def _listing(d: dict) -> str:
    return ", ".join(f"{k} ({v} component{'s' if v != 1 else ''})" if v is not None else f"{k} (None)"
                     for k, v in d.items())
