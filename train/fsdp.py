"""``mesh.dp_strategy=fsdp``: the model's parameters and optimizer state sharded over the dp axis with FSDP2
(``torch.distributed.fsdp.fully_shard``) while each sample's activations are ShardTensors over the domain.

Composition, and why it is exact: FSDP2 gathers a layer's parameters over dp before its forward, so the
layer sees plain replicated tensors, as without FSDP; in backward the layer's gradient is first summed over
the domain (domainflow, at once: ``deferred_param_grads`` would wait past FSDP2's reduce-scatter) and then
reduce-scattered over dp by FSDP2, summed rather than averaged (the loss seeds already weight each sample by
1/batch), so every rank's shard holds the single-device gradient.
"""

from __future__ import annotations

import contextlib

import torch

STRATEGIES = ("allreduce", "fsdp")


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Shard ``model`` over ``mesh["dp"]``: each block of an ``nn.ModuleList``/``ModuleDict`` (a transformer's
    layers, a UNet's levels; nested ones too, innermost first) as its own FSDP2 unit, so only one block's
    parameters are gathered at a time, then the rest."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["dp"]
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)  # no forward of their own: their elements are blocks
    blocks = {id(b) for m in model.modules() if isinstance(m, containers)
              for b in (m.values() if isinstance(m, torch.nn.ModuleDict) else m) if not isinstance(b, containers)}
    # deepest first (reversed pre-order), so a block holding blocks is sharded after them, as FSDP2 requires
    for module in reversed(list(model.modules())):
        if id(module) in blocks and module is not model and any(p.requires_grad for p in module.parameters()):
            fully_shard(module, mesh=dp)
    fully_shard(model, mesh=dp)
    for module in model.modules():
        if is_sharded(module):
            module.set_gradient_divide_factor(1.0)  # a sum over dp: the samples' weights are in the loss seeds
            # plain SUM collectives: for float32 FSDP2 would otherwise reduce with PREMUL_SUM(1/factor),
            # which Gloo refuses (NCCL sums the same either way)
            module.set_force_sum_reduction_for_comms(True)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Parameters gathered once for a stretch of forward passes that the dp ranks do not run in step
    (evaluation: each dp rank has its own samples and rollouts), then sharded again; a no-op without FSDP."""
    units = [m for m in model.modules() if is_sharded(m)]
    if not units:
        yield model
        return
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def local_numel(tensors) -> int:
    """Elements this rank holds of ``tensors`` (a DTensor's local shard, else the whole tensor)."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors
               if isinstance(t, torch.Tensor))


def state_numel(model: torch.nn.Module, optimizer) -> dict:
    """Elements of parameters and of optimizer state held on this rank (what FSDP divides by dp)."""
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    return {"params": local_numel(model.parameters()), "optimizer": local_numel(opt)}
