"""Elementwise ops torch does not tag pointwise (activation backwards, ``hardswish``, ``log_sigmoid_forward``,
PReLU's kernels) run on local chunks, found from torch's decompositions: every ``torch.nn`` activation, forward,
input gradient and parameter gradient equal to one process on uneven shards with an empty one; in-place forms
too; an op whose decomposition is not elementwise never runs on the chunks as they are."""

from __future__ import annotations

import pytest
import torch
from dist_pool import rank_and_world
from sharded_check import Sharded, get_mesh
from sweep import check_into, none_failed

import domainflow as df
from domainflow import Shard

D = torch.float64


def _activations():
    nn = torch.nn
    return {
        "LeakyReLU": nn.LeakyReLU(0.1), "ELU": nn.ELU(0.7), "CELU": nn.CELU(1.3), "SELU": nn.SELU(),
        "ReLU6": nn.ReLU6(), "Hardtanh": nn.Hardtanh(-0.5, 0.8), "Softplus": nn.Softplus(2.0, 1.0),
        "Softshrink": nn.Softshrink(0.3), "Hardshrink": nn.Hardshrink(0.3), "Hardsigmoid": nn.Hardsigmoid(),
        "Hardswish": nn.Hardswish(), "LogSigmoid": nn.LogSigmoid(), "Mish": nn.Mish(), "SiLU": nn.SiLU(),
        "GELU": nn.GELU(), "GELU-tanh": nn.GELU("tanh"), "Tanhshrink": nn.Tanhshrink(),
        "Threshold": nn.Threshold(0.1, -2.0),
        "PReLU": nn.PReLU(), "PReLU-channels": nn.PReLU(3, init=0.2),
    }


def _every_activation():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(7)
    failures = []
    for name, layer in _activations().items():
        layer = layer.to(D)
        if isinstance(layer, torch.nn.PReLU):  # weights of both signs, not PReLU's one init value
            with torch.no_grad():
                layer.weight.copy_(torch.linspace(-0.4, 0.6, layer.weight.numel(), dtype=D))
        full = torch.randn(2, 3, 5 + world, 4, generator=gen, dtype=D) * 3
        sizes = {}
        for dim in (2, 3):
            n = full.shape[dim]
            if world > 1:
                split = [0] + [n // (world - 1)] * (world - 1)
                split[-1] += n - sum(split)
                sizes = {0: tuple(split)}  # the first rank empty, the others uneven
            check_into(lambda x, m: m(x), [Sharded(full, [Shard(dim)], sizes)], mesh, f"{name} dim {dim}", failures,
                       module=layer)
    return none_failed(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_every_activation_forward_and_gradients_equal_one_process(dist, world):
    assert all(dist.run(world, _every_activation))


def _in_place_forms():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(7, 4, generator=gen, dtype=D) * 3
    failures = []
    F = torch.nn.functional
    cases = {"leaky_relu_": lambda x: F.leaky_relu(x * 1, 0.2, inplace=True),
             "elu_": lambda x: F.elu(x * 1, inplace=True),
             "hardtanh_": lambda x: F.hardtanh(x * 1, -1.0, 0.5, inplace=True),
             "hardswish_": lambda x: F.hardswish(x * 1, inplace=True),
             "hardsigmoid_": lambda x: F.hardsigmoid(x * 1, inplace=True),
             "relu6_": lambda x: F.relu6(x * 1, inplace=True),
             "celu_": lambda x: F.celu(x * 1, inplace=True),
             "selu_": lambda x: F.selu(x * 1, inplace=True)}
    for name, fn in cases.items():
        check_into(fn, [Sharded(full, [Shard(0)], {0: tuple([0] * (world - 1) + [7])})], mesh, name, failures)
        check_into(fn, [Sharded(full, [Shard(0)], {0: tuple([7 // world] * (world - 1) + [7 - 7 // world * (world - 1)])})],
                   mesh, name + " uneven", failures)
    return none_failed(failures)


def test_in_place_activations_equal_one_process(dist):
    assert all(dist.run(3, _in_place_forms))


def _not_elementwise_is_refused():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    x = df.distribute_tensor(torch.randn(6, 4, dtype=D), mesh, [Shard(0)])
    # glu halves a dim: its decomposition narrows, which is not elementwise, so it never runs on the chunks as
    # they are (each rank would halve its own rows); along the sharded dim its decomposition runs through the
    # engine (two narrows of the sharded dim, laid out alike, and a product): the one-process result
    with pytest.warns(UserWarning):  # the halves straddle ranks differently: a warned relayout
        got0 = torch.ops.aten.glu.default(x, 0).full_tensor()
    assert torch.allclose(got0, torch.nn.functional.glu(x.full_tensor(), 0), rtol=1e-12, atol=1e-12)
    # along another dim it runs locally where a handler exists, or is refused by name, never wrong
    try:
        got = torch.nn.functional.glu(x, 1).full_tensor()
    except df.UnsupportedShardedOp as e:
        assert "glu" in str(e)
    else:
        assert torch.equal(got, torch.nn.functional.glu(x.full_tensor(), 1))
    return True


def test_an_op_whose_decomposition_is_not_elementwise_never_runs_on_the_chunks_as_they_are(dist):
    assert all(dist.run(2, _not_elementwise_is_refused))


def test_what_the_decompositions_say():
    """Without ranks: torch's decompositions classify the untagged activation ops, and not glu / mse_loss."""
    from domainflow.dispatch.elementwise import is_elementwise_call, is_tagged_elementwise

    aten = torch.ops.aten
    x, w = torch.randn(2, 3, 4, dtype=D), torch.randn(3, 1, dtype=D)
    g = torch.randn_like(x)
    for op, args in [(aten.leaky_relu_backward.default, (g, x, 0.1, False)), (aten.hardswish.default, (x,)),
                     (aten.elu_backward.default, (g, 1.0, 1.0, 1.0, False, x)),
                     (aten.hardtanh_backward.default, (g, x, -1.0, 1.0)), (aten.log_sigmoid_forward.default, (x,)),
                     (aten._prelu_kernel.default, (x, w)), (aten._prelu_kernel_backward.default, (g, x, w)),
                     (aten.softplus_backward.default, (g, x, 1.0, 20.0)),
                     (aten.softshrink_backward.default, (g, x, 0.5)), (aten.hardshrink_backward.default, (g, x, 0.5)),
                     (aten.smooth_l1_loss.default, (x, g, 0, 1.0))]:  # reduction "none"
        assert not is_tagged_elementwise(op) and is_elementwise_call(op, args, {}), op
    for op, args in [(aten.glu.default, (x, 1)), (aten.mse_loss.default, (x, g, 1)),
                     (aten.smooth_l1_loss.default, (x, g, 1, 1.0)),  # reduction "mean", after "none" above
                     (aten.index.Tensor, (x, [torch.tensor([1, 0])])),
                     (aten._softmax_backward_data.default, (g, x, 1, D))]:
        assert not is_elementwise_call(op, args, {}), op
