"""What defines a training run, recorded in its checkpoints: ``--resume`` continues only the same run.

The identity holds the settings that change what is learned: the model, the training data (the store's fields
and inputs, and a digest of the statistics and channels the model's inputs are scaled with, so a store
re-ingested with other runs is another run), the optimizer and its schedule, the batch, seed and precision.
Where the ranks run (dp/domain sizes at a fixed batch, FSDP or not, checkpoint and evaluation cadence, output
options) is not part of it: a run may resume on another mesh; nor is ``train.steps``: a resumed run may go on
longer (a cosine schedule then stretches to the new last step from where it is). Comparing two identities names each setting
that differs, with both values.
"""

from __future__ import annotations

from . import normalization
from .config import ConfigError

_MODEL_KEYS = {"transolver": ("dim", "layers", "heads", "slices", "mlp_ratio", "dropout"), "unet": ("base", "levels")}


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
                "data.lead": d.lead if d.kind == "grid" else None, "data.history": d.history if d.kind == "grid" else None,
                "data.static": d.static if d.kind == "grid" else None,
                "training data (statistics and channels)": normalization.digest(norm),
                "optimizer": "AdamW", "train.lr": t.lr, "train.weight_decay": t.weight_decay,
                "train.clip_grad": t.clip_grad, "train.schedule": t.schedule, "train.warmup": t.warmup,
                "train.min_lr": t.min_lr if t.schedule == "cosine" else None,
                "samples per step": t.batch or cfg.mesh.dp, "train.seed": t.seed, "train.dtype": t.dtype,
                "train.autocast": t.autocast})
    return {k: v for k, v in out.items() if v is not None}


def differences(recorded: dict, current: dict) -> list[str]:
    """'key: checkpoint X, this run Y' for each setting that differs."""
    keys = list(dict.fromkeys(list(recorded) + list(current)))
    return [f"{k}: checkpoint {recorded.get(k, '(not set)')!r}, this run {current.get(k, '(not set)')!r}"
            for k in keys if recorded.get(k) != current.get(k)]


def check_same(meta: dict, identity: dict, where) -> None:
    """Refuse to resume from a checkpoint (its ``meta``) of another run than ``identity``, naming every setting
    that differs (a checkpoint from before identities were recorded is taken as it is)."""
    recorded = meta.get("run")
    if recorded is None:
        return
    diff = differences(recorded, identity)
    if diff:
        stores = (meta.get("normalization") or {}).get("store")
        raise ConfigError(
            f"--resume: the checkpoint {where} is of another run" + (f" (trained on {stores})" if stores else "") +
            f": {'; '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}. Resume with the settings it was trained with, "
            f"start a new run in another output.dir, or fine-tune from its weights with --init-from {where}")
