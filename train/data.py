"""From reader samples to model inputs and targets, for both reference jobs.

Mesh (surface) samples: per-point inputs (e.g. cell centre and normal, z-scored by the store's train
statistics) concatenated to (1, N, C_in), the run's design parameters z-scored over the training runs as
per-sample globals, the fields to predict concatenated to (1, N, C_out), and with ``data.edges`` the sample's
edges (E, 2) for a graph model. Grid samples: the readers' (1, history * C + S, H, W) window (S static fields
last) and (1, C, H, W) target as they are. ``call_model`` is the one spelling of the forward contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import normalization
from .config import Config, ConfigError

_WIDTH = {"coords": 3, "normals": 3, "areas": 1}


@dataclass
class ModelIO:
    in_dim: int
    out_dim: int
    global_dim: int


@dataclass
class Batch:
    x: torch.Tensor
    globals: torch.Tensor | None
    target: torch.Tensor
    edges: torch.Tensor | None = None    # (E, 2) (sender, receiver) global row numbers, with data.edges


def call_model(model, batch: Batch):
    """The model's forward on ``batch``: ``model(x)``, ``model(x, globals)`` when the batch has globals, with
    ``edges=`` when it has edges. Training, evaluation and prediction all call a model through this."""
    args = (batch.x,) if batch.globals is None else (batch.x, batch.globals)
    return model(*args) if batch.edges is None else model(*args, edges=batch.edges)


def build_dataset(cfg: Config, mesh, split: str, shuffle: bool, runs=None, extra_inputs=(), sample_points: int = 0,
                  norm: dict | None = None, balanced_draw: bool = False):
    """The reader for ``split`` (``sample_points``: points drawn per mesh sample, 0: all), z-scoring with the
    model's normalisation ``norm`` (a checkpoint's; None: the store's own statistics); a field or input the
    store lacks is refused by the reader, naming the choices the store has."""
    from domainflow.readers import GridDataset, MeshDataset

    d = cfg.data
    if not d.store:
        raise ConfigError("data.store is not set; give the path of an ingested store (domainflow ingest ...)")
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    if d.kind == "mesh":
        bad = [i for i in d.inputs if i not in _WIDTH]
        if bad:
            raise ConfigError(f"data.inputs {bad} are not per-point geometry inputs; choose from {sorted(_WIDTH)}")
        inputs = tuple(d.inputs) + tuple(i for i in extra_inputs if i not in d.inputs)
        store = _with_edges(cfg, runs) if d.edges else d.store
        return MeshDataset(store, mesh, split=split if runs is None else None, location=d.location,
                           fields=tuple(d.fields), inputs=inputs, shuffle=shuffle, seed=cfg.train.seed,
                           prefetch=d.prefetch, dtype=dtype, runs=runs, sample_points=sample_points,
                           stats=normalization.stats(norm), edges=d.edges, balanced_draw=balanced_draw)
    axes = ("domain",) if len(d.shard_dims) == 1 else ("domain", "lon")
    return GridDataset(d.store, mesh, split=split, shard_dims=tuple(d.shard_dims), lead=d.lead, history=d.history,
                       shuffle=shuffle, seed=cfg.train.seed, prefetch=d.prefetch, dtype=dtype, domain_axes=axes,
                       static=d.static, stats=normalization.stats(norm))


def _with_edges(cfg: Config, runs=None):
    """``data.store`` opened, refused (ConfigError) when it holds no edges for the graph model (``check_edges``)."""
    from domainflow.readers import open_store

    store = open_store(cfg.data.store)
    try:
        check_edges(cfg, store, runs)
    except BaseException:
        store.close()
        raise
    return store


def check_edges(cfg: Config, store, runs=None) -> None:
    """With ``data.edges``, the store holds the edges of ``runs`` (default: its first training run), ingested with
    ``--edges``: else a ConfigError naming the key, the model that needs them and the fix. Metadata only (the
    launcher runs it before any rank)."""
    from domainflow.readers.mesh_dataset import has_edges

    d = cfg.data
    if not d.edges:
        return
    runs = list(runs) if runs is not None else list(store.splits.get("train") or store.runs())[:1]
    # a run without the location at all is the reader's error to name (check_request: "has no 'volume' data")
    missing = [r for r in runs if d.location in store.run(r) and not has_edges(store, d.location, r)]
    if missing:
        who = f"model.name={cfg.model.name}" if not cfg.model.target else f"model.target={cfg.model.target}"
        raise ConfigError(f"data.edges=true ({who}) reads each sample's edges, but {store.path} holds no {d.location} "
                          f"edges (run(s) {missing[:5]}): re-ingest it with edges (`domainflow ingest cfd ... --edges "
                          f"--overwrite`), or use a model without edges (data.edges=false)")


def model_io(cfg: Config, ds) -> ModelIO:
    if cfg.data.kind == "mesh":
        out = sum(int(ds.store.fields[f"{ds.location}/{f}"].get("components", 1)) for f in ds.fields)
        if cfg.data.use_params:
            check_params(ds.store)
        globals_ = len(ds.param_names) if cfg.data.use_params else 0
        return ModelIO(sum(_WIDTH[i] for i in cfg.data.inputs), out, globals_)
    return ModelIO(ds.in_channels, len(ds.variables), 0)


def check_params(store) -> None:
    """Every run has the same design parameters (a recipe's optional geometry CSV may be missing for some):
    else one ConfigError naming the runs, before any run trains with NaN or without its globals."""
    from .config import ConfigError

    names = {r: tuple(sorted(store.run(r).attrs.get("geometry", {}))) for r in store.runs()}
    kinds = sorted(set(names.values()), key=lambda k: -sum(v == k for v in names.values()))
    if len(kinds) > 1:
        odd = sorted((r for r, k in names.items() if k != kinds[0]), key=lambda r: (len(r), r))
        raise ConfigError(f"{store.path}: run(s) {odd[:10]}{' ...' if len(odd) > 10 else ''} have other design "
                          f"parameters than the rest ({len(kinds[0])} named in a geometry CSV; a recipe's optional CSV "
                          f"missing for them?); set data.use_params=false, or re-ingest without those runs")


def param_stats(ds) -> tuple[np.ndarray, np.ndarray] | None:
    """Mean and std of the design parameters over the dataset's runs (metadata only, same on every rank)."""
    if not getattr(ds, "param_names", None):
        return None
    values = np.array([[ds.store.run(r).attrs.get("geometry", {}).get(k, np.nan) for k in ds.param_names]
                       for r in ds.store.runs("train") or ds.runs], dtype=np.float64)
    std = values.std(0)
    return values.mean(0), np.where(std > 0, std, 1.0)


def make_batch(cfg: Config, ds, sample: dict, stats) -> Batch:
    if cfg.data.kind == "grid":
        return Batch(sample["input"], None, sample["target"])
    x = torch.cat([sample[i] for i in cfg.data.inputs], dim=-1).unsqueeze(0)
    y = torch.cat([sample[f] for f in ds.fields], dim=-1).unsqueeze(0)
    g = None
    if cfg.data.use_params and stats is not None:
        mean, std = (torch.as_tensor(v, dtype=sample["params"].dtype, device=sample["params"].device) for v in stats)
        g = ((sample["params"] - mean) / std).unsqueeze(0)
    return Batch(x, g, y, sample["edges"] if cfg.data.edges else None)
