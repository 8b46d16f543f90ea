"""The no-grad forward of evaluation and prediction: the whole sample at once, or with ``eval.block_points``
in blocks of points through the model's ``forward_blocks`` (bounded memory, the same values). The block is
counted over the whole domain, like ``data.sample_points``: each rank's block is its share of it, so a rank's
block memory halves when the domain doubles."""

from __future__ import annotations

import torch

from .config import Config, ConfigError
from .data import call_model


@torch.no_grad()
def infer(model, batch, cfg: Config):
    """The model's prediction for ``batch`` (model in eval mode for the call, then as it was)."""
    block = cfg.eval.block_points
    was = model.training
    model.eval()
    try:
        if not block:
            return call_model(model, batch)
        blocks = getattr(model, "forward_blocks", None)
        if blocks is None:
            raise ConfigError(f"eval.block_points={block}: {type(model).__name__} has no forward_blocks (block "
                              f"inference); set eval.block_points=0")
        from domainflow import rows_per_block

        return blocks(batch.x, batch.globals, block_points=rows_per_block(batch.x, 1, block))
    finally:
        model.train(was)


@torch.no_grad()
def rollout(model, state, steps: int, channels: int, cfg: Config, relayout=None, statics: int = 0):
    """An autoregressive forecast: yields ``(k, prediction)`` for k = 1..``steps``, each prediction
    (1, C, H, W) fed back as the newest step of the next input window (``state``: (1, history * C + S, H, W),
    oldest step first, then the ``statics`` S constant fields, as the grid readers stack it; the static
    fields stay). ``relayout``: puts each prediction in the input's layout (a grid reader's ``relayout``)
    before it is yielded and fed back."""
    from .data import Batch

    dynamic = state.shape[1] - statics
    window, static = (state[:, :dynamic], state[:, dynamic:]) if statics else (state, None)
    for k in range(1, steps + 1):
        pred = infer(model, Batch(state, None, None), cfg)
        if relayout is not None:
            pred = relayout(pred)
        yield k, pred
        if k < steps:
            newest = pred.to(state.dtype)
            window = newest if dynamic == channels else torch.cat([window[:, channels:], newest], dim=1)
            state = window if static is None else torch.cat([window, static], dim=1)
