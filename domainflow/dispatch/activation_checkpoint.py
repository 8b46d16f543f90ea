"""Activation checkpointing for models that run on ShardTensors.

``torch.utils.checkpoint`` recomputes a block's forward during backward, from inside the autograd
engine, where torch may have switched ``__torch_function__`` off for tensor subclasses. The recomputation
would then bypass domainflow's function-level rules (softmax over a sharded dim, ring attention, ...) and
take different, possibly unsupported, paths from the forward. ``checkpoint_activations`` switches them back on for the
recomputation, so it replays exactly what the forward did.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint


def _with_function_rules(fn):
    def run(*args, **kwargs):
        state = torch._C._get_torch_function_state()
        torch._C._set_torch_function_state(torch._C._TorchFunctionState.ENABLED)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_torch_function_state(state)
    return run


def checkpoint_activations(fn, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint(fn, *args)`` (non-reentrant by default) that recomputes ``fn``
    with domainflow's rules in force; works on plain tensors too."""
    return _torch_checkpoint(_with_function_rules(fn), *args, use_reentrant=use_reentrant, **kwargs)
