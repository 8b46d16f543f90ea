"""Ops that work along, or consume, the sharded dim and run sharded without gathering it: convolutions over
sharded input channels (a pending sum; weight and bias gradients summed), ``diagonal`` (a true view of the
chunk, so writes reach the input), ``trace``, cumsum/cumprod (a scan across ranks), flip and multi-dim roll,
``nonzero``/``masked_select``/``masked_scatter`` (sizes that depend on the data), kthvalue/mode along an
unsharded dim, an embedding table sharded by rows (a pending sum), grid sampling and antialiased resampling
with the batch sharded. Values and every gradient equal one process (float64), at uneven sizes with an empty chunk;
what still cannot run is refused by name."""

from __future__ import annotations

import pytest
import torch

import domainflow as df
from dist_pool import rank_and_world
from domainflow import Shard
from sharded_check import Sharded, check_sharded, get_mesh, shard

SIZES = {2: (2, 3), 3: (0, 2, 3)}  # 5 rows or channels


def _conv_rank(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x1 = torch.randn(2, 5, 9, generator=gen, dtype=torch.float64)
    x2 = torch.randn(2, 5, 6, 7, generator=gen, dtype=torch.float64)
    for x, layer in ((x1, torch.nn.Conv1d(5, 4, 3, padding=1)), (x2, torch.nn.Conv2d(5, 3, (3, 2), stride=2)),
                     (x2, torch.nn.ConvTranspose2d(5, 2, 3, stride=2, output_padding=1)),
                     (x1[0], torch.nn.Conv1d(5, 2, 3, padding="same"))):  # unbatched: channels are dim 0
        dim = x.ndim - (3 if x.ndim == 4 else 2)
        check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(dim)], {0: SIZES[world]})], mesh, module=layer.double())
    return True


def _conv_2d_mesh_rank(seed):
    """Batch sharded over "dp", channels over "domain" (review: the bias gradient was summed over the channel
    ranks only, so each data-parallel replica kept its own)."""
    rank, world = rank_and_world()
    mesh = get_mesh((2, world // 2), ("dp", "domain"))
    torch.manual_seed(seed)
    x = torch.randn(4, 5, 6, 7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for layer in (torch.nn.Conv2d(5, 3, 3, padding=1), torch.nn.ConvTranspose2d(5, 2, 3)):
        check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(0), Shard(1)])], mesh, module=layer.double())
    return True


def test_a_convolution_over_sharded_channels_with_the_batch_sharded_too(dist):
    assert all(dist.run(2, _conv_2d_mesh_rank, 8))


@pytest.mark.filterwarnings("ignore:domainflow")
@pytest.mark.parametrize("world", [2, 3])
def test_a_convolution_over_sharded_channels_is_a_pending_sum_with_exact_gradients(dist, world):
    assert all(dist.run(world, _conv_rank, 3))


def _diagonal_rank(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(5, 4, 3, generator=gen, dtype=torch.float64)
    for dim, fn in ((0, lambda t: t.diagonal(1) * 2), (1, lambda t: t.diagonal(-1, 0, 1)),
                    (0, lambda t: torch.trace(t[:, :, 0]) * t[:, :, 1].sum()),
                    (1, lambda t: torch.diag_embed(t[:, :, 0].diagonal(), offset=1))):
        check_sharded(fn, [Sharded(a, [Shard(dim)], {0: SIZES[world][:world - 1] + (SIZES[world][-1] - 1,)
                                                     if dim == 1 else SIZES[world]})], mesh)
    # a view: writing into the diagonal writes into the sharded input, as on one device
    want = a.clone()
    want.diagonal(0, 0, 1).mul_(-3)
    x, _ = shard(a, mesh, [Shard(0)], {0: SIZES[world]})
    x.diagonal(0, 0, 1).mul_(-3)
    assert torch.equal(x.full_tensor(), want)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_diagonal_is_a_view_of_each_chunk_along_either_sharded_dim(dist, world):
    assert all(dist.run(world, _diagonal_rank, 4))


def _along_rank(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(5, 3, generator=gen, dtype=torch.float64) + 0.5
    cases = [lambda t: torch.cumsum(t, 0), lambda t: t.cumprod(0) * 3, lambda t: torch.flip(t, (0, 1)),
             lambda t: torch.roll(t, (2, -1), (0, 1)), lambda t: torch.fft.fftshift(t),
             lambda t: torch.kthvalue(t, 2, dim=1).values, lambda t: torch.mode(t.round(), 1, keepdim=True)[0],
             lambda t: torch.masked_select(t, t > 0.9) * 2, lambda t: torch.nonzero(t > 0.9),
             lambda t: t.masked_scatter(t > 0.9, torch.arange(15.0, dtype=t.dtype))]
    for fn in cases:
        check_sharded(fn, [Sharded(a, [Shard(0)], {0: SIZES[world]})], mesh)
    # a vocabulary-parallel embedding table (rows sharded) looked up with ids whole on every rank
    ids = torch.tensor([[4, 0, 3], [3, 3, 1]])
    for pad in (None, 3, -1):
        check_sharded(lambda w: torch.nn.functional.embedding(ids, w, padding_idx=pad) * 2,
                      [Sharded(a, [Shard(0)], {0: SIZES[world]})], mesh)
    table = a.clone()
    table[2] = float("inf")  # a row no id looks up (review: the other ranks' lookups were inf * 0 = NaN)
    check_sharded(lambda w: torch.nn.functional.embedding(torch.tensor([0, 1, 4]), w),
                  [Sharded(table, [Shard(0)], {0: SIZES[world]})], mesh)
    x, _ = shard(a, mesh, [Shard(0)], {0: SIZES[world]})
    with pytest.raises(IndexError, match=r"ids must be in \[0, 5\)"):  # as one process raises
        torch.nn.functional.embedding(torch.tensor([1, 5]), x)
    # per-sample ops with the batch sharded and a plain grid: grid sampling, antialiased and area resampling
    img = torch.randn(5, 2, 6, 7, generator=gen, dtype=torch.float64)
    grid = torch.rand(5, 3, 4, 2, generator=gen, dtype=torch.float64) * 2 - 1
    for fn in (lambda t: torch.nn.functional.grid_sample(t, grid, align_corners=False),
               lambda t: torch.nn.functional.interpolate(t, size=(4, 3), mode="bilinear", antialias=True),
               lambda t: torch.nn.functional.interpolate(t, size=(3, 5), mode="area")):
        check_sharded(fn, [Sharded(img, [Shard(0)], {0: SIZES[world]})], mesh)
    return True


@pytest.mark.filterwarnings("ignore:domainflow")
@pytest.mark.parametrize("world", [2, 3])
def test_scans_flips_rolls_and_data_dependent_sizes_along_the_sharded_dim(dist, world):
    assert all(dist.run(world, _along_rank, 5))


def _refused_rank(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    a = torch.rand(4, 5, dtype=torch.float64)
    x, _ = shard(a, mesh, [Shard(1)], {0: (2, 3) if world == 2 else (1, 1, 3)})
    out = []
    for fn in (lambda t: torch.nonzero(t), lambda t: torch.masked_select(t, t > 0.5)):
        with pytest.raises(df.UnsupportedShardedOp, match="row-major order is rank order only with dim 0"):
            fn(x)
        out.append(True)
    return all(out)


@pytest.mark.parametrize("world", [2])
def test_selection_along_an_inner_sharded_dim_is_refused_by_name(dist, world):
    assert all(dist.run(world, _refused_rank, 6))


def _second_order_rank(seed):
    """Gradients of gradients (a gradient penalty, a PINN's residual) through handlers that communicate above
    autograd: the inner gradient keeps its graph and the outer one equals one process."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    a = torch.rand(5, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    for fn in (lambda t: t.cumsum(0), lambda t: t.cumprod(0), lambda t: t.softmax(0), lambda t: t.flip(0) * t):
        ref = a.clone().requires_grad_()
        (g,) = torch.autograd.grad((fn(ref) ** 3).sum(), [ref], create_graph=True)
        (g ** 2).sum().backward()
        x, leaf = shard(a, mesh, [Shard(0)], {0: SIZES[world]}, requires_grad=True)
        (gx,) = torch.autograd.grad((fn(x) ** 3).sum(), [leaf], create_graph=True)
        assert gx.requires_grad
        (gx ** 2).sum().backward()
        lo, n = sum(SIZES[world][:rank]), SIZES[world][rank]  # the leaf is this rank's chunk
        torch.testing.assert_close(gx.detach(), g.detach()[lo:lo + n], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(leaf.grad, ref.grad[lo:lo + n], rtol=1e-9, atol=1e-12)
    return True


@pytest.mark.filterwarnings("ignore:domainflow")
@pytest.mark.parametrize("world", [2, 3])
def test_gradients_of_gradients_along_the_sharded_dim(dist, world):
    assert all(dist.run(world, _second_order_rank, 7))
