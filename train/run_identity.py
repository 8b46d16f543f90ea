"""What defines a training run, recorded in its checkpoints: ``--resume`` continues only the same run.

The identity holds the settings that change what is learned: the model, the training data (its fields, inputs
and channels; and, compared apart within 1e-9, the statistics the model's inputs are scaled with, so a store
re-ingested with other runs or another split is another run, while one re-ingested with other parts is not),
the optimizer and its schedule, the batch, seed and precision.
Where the ranks run (dp/domain sizes at a fixed batch, FSDP or not, checkpoint and evaluation cadence, output
options) is not part of it: a run may resume on another mesh; nor is ``train.steps``: a resumed run may go
on longer (a cosine schedule then stretches to the new last step from where it is). Comparing two identities
names each setting that differs, with both values.
"""

from __future__ import annotations

import json

from . import normalization
from .config import ConfigError

_MODEL_KEYS = {"transolver": ("dim", "layers", "heads", "slices", "mlp_ratio", "dropout"),
               "meshgraphnet": ("dim", "layers"), "unet": ("base", "levels")}


def identity(cfg, norm: dict) -> dict:
    """The settings that define the run of ``cfg`` whose inputs are scaled by ``norm`` (a flat dict)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    out = {"model.target": m.target} if m.target else {"model.name": m.name}
    if not m.target:
        out.update({f"model.{k}": getattr(m, k) for k in _MODEL_KEYS.get(m.name, ())})
    out["model.kwargs"] = dict(m.kwargs)
    out.update({"data.kind": d.kind, "data.fields": list(d.fields) if d.kind == "mesh" else None,
                "data.inputs": list(d.inputs) if d.kind == "mesh" else None,
                "data.location": d.location if d.kind == "mesh" else None,
                "data.use_params": d.use_params if d.kind == "mesh" else None,
                "data.sample_points": d.sample_points if d.kind == "mesh" else None,
                "data.edges": True if d.edges else None,  # absent when off: identities recorded before it match
                "data.lead": d.lead if d.kind == "grid" else None, "data.history": d.history if d.kind == "grid" else None,
                "data.static": d.static if d.kind == "grid" else None,
                "training data (channels)": normalization.digest(norm),
                "optimizer": "AdamW", "train.lr": t.lr, "train.weight_decay": t.weight_decay,
                "train.clip_grad": t.clip_grad, "train.schedule": t.schedule, "train.warmup": t.warmup,
                "train.min_lr": t.min_lr if t.schedule == "cosine" else None,
                "samples per step": t.batch or cfg.mesh.dp, "train.seed": t.seed, "train.dtype": t.dtype,
                "train.autocast": t.autocast})
    # as a checkpoint's JSON holds it (a tuple in model.kwargs comes back a list)
    return json.loads(json.dumps({k: v for k, v in out.items() if v is not None}))


def differences(recorded: dict, current: dict) -> list[str]:
    """'key: checkpoint X, this run Y' for each setting that differs."""
    keys = list(dict.fromkeys(list(recorded) + list(current)))
    return [f"{k}: checkpoint {recorded.get(k, '(not set)')!r}, this run {current.get(k, '(not set)')!r}"
            for k in keys if recorded.get(k) != current.get(k)]


def check_same(meta: dict, identity: dict, where, store_norm: dict | None = None) -> None:
    """Refuse to resume from a checkpoint (its ``meta``) of another run than ``identity``, naming every setting
    that differs, and (given ``store_norm``, the store's normalisation) every statistic the store no longer
    matches within 1e-9 (a checkpoint from before identities were recorded is taken as it is)."""
    recorded = meta.get("run")
    if recorded is None:
        return
    diff = differences(recorded, identity)
    if store_norm is not None and meta.get("normalization") is not None:
        diff += [f"training data {d}" for d in normalization.stats_differences(meta["normalization"], store_norm)]
    if diff:
        stores = (meta.get("normalization") or {}).get("store")
        raise ConfigError(
            f"--resume: the checkpoint {where} is of another run" + (f" (trained on {stores})" if stores else "") +
            f": {'; '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}. Resume with the settings it was trained with, "
            f"start a new run in another output.dir, or fine-tune from its weights with --init-from {where}")


def check_init_from(meta: dict, identity: dict, cfg, where) -> None:
    """Refuse ``--init-from`` a checkpoint (its ``meta``) whose model or channels do not fit this run's config:
    its weights would not load, or its output channels would come out in another order. A checkpoint from
    before identities and normalisations were recorded is taken as it is."""
    diff = []
    recorded = meta.get("run")
    if recorded is not None:
        model = lambda d: {k: v for k, v in d.items() if k.startswith("model.")}  # noqa: E731
        diff += differences(model(recorded), model(identity))
    if meta.get("normalization") is not None:
        diff += normalization.config_differences(meta["normalization"], cfg)
    if diff:
        raise ConfigError(f"--init-from {where}: its model or channels do not fit this run ({'; '.join(diff[:8])}); "
                          f"fine-tuning keeps the model and the channels it was trained with: set them as the "
                          f"checkpoint has them")
