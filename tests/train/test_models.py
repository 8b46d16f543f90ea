"""The reference models (domainflow.train.models) sharded vs one process: outputs, input and parameter
gradients; Transolver's physics attention needs exactly one all-reduce per layer."""

from __future__ import annotations

import random

import pytest
import torch

from dist_pool import rank_and_world
from domainflow import Shard
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes


def _transolver(seed):
    import domainflow as df
    from domainflow import comm
    from domainflow.train.models import Transolver

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=2, heads=2, slices=8).double()
    pts = torch.randn(1, 29, 6, generator=gen, dtype=torch.float64)
    glob = torch.randn(1, 3, generator=gen, dtype=torch.float64)
    sizes = random_sizes(29, world, rng)
    check_sharded(lambda p, m: m(p, glob), [Sharded(pts, [Shard(1)], {0: sizes})], mesh, module=model)
    x = df.distribute_tensor(pts, mesh, [Shard(1)], sharding_shapes={0: list(sizes)})
    comm.stats.reset()
    with torch.no_grad():
        model(x, glob)
    return comm.stats.calls.get("all_reduce", 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_transolver_sharded_equals_single_process(dist, world):
    for calls in dist.run(world, _transolver, 7 + world):
        assert calls == (2 if world > 1 else 0)  # one per layer


def _transolver_step_all_reduces(layers: int):
    from domainflow import comm
    from domainflow.train.models import Transolver

    import domainflow as df

    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    torch.manual_seed(3)
    model = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=layers, heads=2, slices=8).double()
    ref = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=layers, heads=2, slices=8).double()
    ref.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(4)
    pts = torch.randn(1, 31, 6, generator=gen, dtype=torch.float64)
    glob = torch.randn(1, 3, generator=gen, dtype=torch.float64)
    sizes = {2: [13, 18], 3: [0, 20, 11]}[world]
    x = df.distribute_tensor(pts, mesh, [Shard(1)], sharding_shapes={0: sizes})
    comm.stats.reset()
    loss = (model(x, glob) ** 2).mean()
    forward = comm.stats.calls.get("all_reduce", 0)
    comm.stats.reset()
    with df.deferred_param_grads():
        loss.backward()
    backward = comm.stats.calls.get("all_reduce", 0)
    value = loss.item()  # rode on backward: no collective
    after = comm.stats.calls.get("all_reduce", 0)
    ref_loss = (ref(pts, glob) ** 2).mean()
    ref_loss.backward()
    worst = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return forward, backward, after - backward, abs(value - ref_loss.item()), worst


@pytest.mark.parametrize("world", [2, 3])
def test_transolver_step_all_reduces_at_the_analytic_minimum(dist, world):
    """A training step of an L-layer Transolver needs L all-reduces forward (the slice tokens), L backward
    (their gradients, pending sums that flow through the token attention's linear backward unreduced and
    are finished together in one coalesced reduction) and one for every parameter gradient under
    deferred_param_grads, with the loss riding on backward: 2L + 1, exact against one process."""
    for fwd, bwd, extra, loss_err, grad_err in dist.run(world, _transolver_step_all_reduces, 3):
        assert (fwd, bwd, extra) == (3, 3 + 1, 0), (fwd, bwd, extra)
        assert loss_err < 1e-12 and grad_err < 1e-10, (loss_err, grad_err)


def _transolver_blocks(sizes, block):
    """Block inference on uneven shards (a rank with no rows, ranks with different block counts)."""
    import domainflow as df
    from domainflow import comm
    from domainflow.train.models import Transolver

    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    torch.manual_seed(5)
    model = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=3, heads=2, slices=8).double().eval()
    gen = torch.Generator().manual_seed(6)
    pts = torch.randn(1, sum(sizes), 6, generator=gen, dtype=torch.float64)
    glob = torch.randn(1, 3, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        whole = model(pts, glob)
    x = df.distribute_tensor(pts, mesh, [Shard(1)], sharding_shapes={0: list(sizes)})
    comm.stats.reset()
    out = model.forward_blocks(x, glob, block_points=block)
    calls = comm.stats.calls.get("all_reduce", 0)
    return (out.sharding_shapes, out.full_tensor(), whole, out.to_local().shape, calls,
            model.forward_blocks(pts, glob, block_points=block))


@pytest.mark.parametrize("world,sizes", [(1, [37]), (2, [30, 7]), (3, [0, 25, 12])])
@pytest.mark.parametrize("block", [1, 4, 11, 100])
def test_transolver_block_inference_equals_the_whole_forward(dist, world, sizes, block):
    """``forward_blocks`` gives the unchunked forward to float64 rounding with the input's layout, with one
    all-reduce per layer whatever the number of blocks (blocks of one point in all are the exception: the
    engine's view rules gather a sharded dim of global size 1, which adds exchanges but changes no value)."""
    for rank, (shapes, full, whole, local, calls, plain) in enumerate(dist.run(world, _transolver_blocks, sizes, block)):
        torch.testing.assert_close(full, whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(plain, whole, rtol=1e-12, atol=1e-12)
        assert local[1] == sizes[rank] and [s[1] for s in shapes[0]] == sizes
        if block > 1:
            assert calls == (3 if world > 1 else 0)


def test_unet_residual_adds_the_last_input_step_not_the_static_fields():
    """With the head zeroed the residual UNet returns its input's last step: the C channels before the static
    fields appended after the window (history 2, C 3, S 2)."""
    from domainflow.train.models import UNet

    C, S = 3, 2
    model = UNet(2 * C + S, C, base=4, levels=2, statics=S).double()
    torch.nn.init.zeros_(model.head.weight)
    torch.nn.init.zeros_(model.head.bias)
    x = torch.randn(1, 2 * C + S, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(model(x), x[:, C:2 * C], rtol=0, atol=0)
