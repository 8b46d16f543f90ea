"""Contractions the way model libraries write them: ``torch.einsum``, ``opt_einsum.contract`` (which picks its
backend from the operand's module, ``domainflow`` for a ShardTensor, and used to fall back to numpy: "Can't call
numpy() on Tensor that requires grad") and ``tensorly.einsum`` with its opt_einsum plugin (neuraloperator's
path); an input sharded unevenly on a dim that is kept or contracted, forward and gradients equal to one process."""

from __future__ import annotations

import pytest
import torch
from dist_pool import rank_and_world
from sharded_check import Sharded, get_mesh
from sweep import check_into, none_failed

from domainflow import Shard

opt_einsum = pytest.importorskip("opt_einsum")
tensorly = pytest.importorskip("tensorly")

D = torch.float64
EQUATIONS = ("bixy,ioy->boxy", "bixy,ioy->bxo", "bixy,ioxy->boxy", "bixy,bjxy->bij")  # FNO: ioxy


class _Weight(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone())


def _contract_with(how: str):
    if how == "torch":
        return torch.einsum
    if how == "opt_einsum":
        return opt_einsum.contract
    from tensorly.plugins import use_opt_einsum

    tensorly.set_backend("pytorch")
    use_opt_einsum("optimal")
    return tensorly.einsum


def _every_contraction():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(3)
    failures = []
    x = torch.randn(2, 3, 4 + world, 5, generator=gen, dtype=D)
    weights = {"ioy": torch.randn(3, 4, 5, generator=gen, dtype=D),
               "ioxy": torch.randn(3, 4, 4 + world, 5, generator=gen, dtype=D),
               "bjxy": torch.randn(2, 3, 4 + world, 5, generator=gen, dtype=D)}
    for how in ("torch", "opt_einsum", "tensorly"):
        contract = _contract_with(how)
        for eq in EQUATIONS:
            w = weights[eq.split(",")[1].split("-")[0]]
            for dim in (2, 3):
                n = x.shape[dim]
                sizes = {0: (0,) + (n // (world - 1),) * (world - 2) + (n - (n // (world - 1)) * (world - 2),)}
                name = f"{how} {eq} dim {dim}"
                if eq.endswith("bjxy->bij"):  # two operands of the same grid, sharded alike
                    ins = [Sharded(x, [Shard(dim)], sizes), Sharded(w, [Shard(dim)], sizes)]
                    check_into(lambda a, b, c=contract, e=eq: c(e, a, b), ins, mesh, name, failures)
                else:  # a model's weight (a plain parameter: its gradient is checked too)
                    check_into(lambda a, m, c=contract, e=eq: c(e, a, m.weight), [Sharded(x, [Shard(dim)], sizes)],
                               mesh, name, failures, module=_Weight(w))
    return none_failed(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_einsum_opt_einsum_and_tensorly_contract_sharded_inputs_exactly(dist, world):
    assert all(dist.run(world, _every_contraction))
