"""The no-grad forward of evaluation and prediction: the whole sample at once, or with ``eval.block_points``
in blocks of points through the model's ``forward_blocks`` (bounded memory, the same values)."""

from __future__ import annotations

import torch

from .config import Config, ConfigError


@torch.no_grad()
def infer(model, batch, cfg: Config):
    """The model's prediction for ``batch`` (model in eval mode for the call, then as it was)."""
    block = cfg.eval.block_points
    was = model.training
    model.eval()
    try:
        if not block:
            return model(batch.x, batch.globals) if batch.globals is not None else model(batch.x)
        blocks = getattr(model, "forward_blocks", None)
        if blocks is None:
            raise ConfigError(f"eval.block_points={block}: {type(model).__name__} has no forward_blocks (block "
                              f"inference); set eval.block_points=0")
        return blocks(batch.x, batch.globals, block_points=block)
    finally:
        model.train(was)
