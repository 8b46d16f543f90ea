"""Sliding-window ops on spatially sharded grids (halo exchanges): convolution, padding, pooling.

Each case runs sharded on real Gloo ranks with uneven sizes (including ranks holding fewer rows than the
halo, and empty ranks) and is compared with the same op on the full tensor in one process: outputs, input
gradients and parameter gradients (float64, 1e-10)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dist_pool import rank_and_world
from domainflow import Replicate, Shard
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes


def _sizes(n, parts, rng, small=False):
    if small and parts > 1 and n >= parts:  # one rank with a single row: its neighbours fetch past it
        s = list(random_sizes(n - 1, parts - 1, rng, zeros=False)) if n - 1 >= parts - 1 else [n - 1] + [0] * (parts - 2)
        s.insert(rng.randrange(parts), 1)
        return tuple(s)
    return random_sizes(n, parts, rng)


CONV_CASES = [  # (kernel, stride, padding, dilation, groups)
    (3, 1, 1, 1, 1), (3, 1, "same", 1, 1), (4, 1, "same", 1, 1), (5, 2, 2, 1, 1), (3, 1, 0, 2, 1),
    (2, 2, 0, 1, 1), (3, 3, 1, 1, 2), (1, 1, 0, 1, 1), (3, 1, "valid", 1, 1), (5, 1, 4, 3, 1),
]


def _conv_rank(nd, seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for k, s, p, d, g in CONV_CASES:
        conv = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}[nd]
        module = conv(4, 6, k, stride=s, padding=p, dilation=d, groups=g).double()
        spatial = [rng.randint(9, 14) for _ in range(nd)]
        x = torch.randn(2, 4, *spatial, generator=gen, dtype=torch.float64)
        dim = 2 + rng.randrange(nd)
        sizes = _sizes(spatial[dim - 2], world, rng, small=rng.random() < 0.5)
        check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(dim)], {0: sizes})], mesh, module=module)
    return True


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv_matches_single_device(dist, nd, world):
    assert all(dist.run(world, _conv_rank, nd, 100 * nd + world))


def _conv_2d_mesh(seed):
    mesh = get_mesh((2, 2), ("h", "w"))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for k, s, p, d, g in CONV_CASES[:6]:
        module = torch.nn.Conv2d(3, 5, k, stride=s, padding=p, dilation=d).double()
        x = torch.randn(1, 3, 11, 13, generator=gen, dtype=torch.float64)
        sizes = {0: _sizes(11, 2, rng), 1: _sizes(13, 2, rng)}
        check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(2), Shard(3)], sizes)], mesh, module=module)
    # a 3-D conv with two spatial dims sharded
    module = torch.nn.Conv3d(2, 3, 3, padding=1).double()
    x = torch.randn(1, 2, 7, 8, 9, generator=gen, dtype=torch.float64)
    check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(3), Shard(4)], {0: (5, 3), 1: (1, 8)})], mesh, module=module)
    return True


def test_conv_on_a_2d_mesh_gets_corners_right(dist):
    assert all(dist.run(4, _conv_2d_mesh, 7))


def _padding_modes(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for mode in ("zeros", "reflect", "replicate", "circular"):
        module = torch.nn.Conv2d(3, 4, 3, padding=2, padding_mode=mode).double()
        x = torch.randn(2, 3, 10, 9, generator=gen, dtype=torch.float64)
        for dim in (2, 3):
            sizes = _sizes(x.shape[dim], world, rng, small=True)
            check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(dim)], {0: sizes})], mesh, module=module)
    for mode, value in (("constant", 0.0), ("constant", 1.5), ("reflect", None), ("replicate", None),
                        ("circular", None)):
        x = torch.randn(2, 3, 8, 7, generator=gen, dtype=torch.float64)
        sizes = _sizes(8, world, rng, small=True)
        kw = {"value": value} if value is not None else {}
        check_sharded(lambda t: F.pad(t, (1, 2, 2, 1), mode=mode, **kw), [Sharded(x, [Shard(2)], {0: sizes})], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_padding_modes_and_periodic_wrap(dist, world):
    assert all(dist.run(world, _padding_modes, 300 + world))


def _pad_with_an_empty_rank(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 7, 3, generator=gen, dtype=torch.float64)
    for pad, mode, value in [((0, 0, 1, 2), "constant", 1.5), ((1, 2, 2, 1), "replicate", None),
                             ((1, 1, 1, 1), "reflect", None), ((2, 1, 1, 2), "circular", None)]:
        kw = {"mode": mode} if value is None else {"mode": mode, "value": value}
        check_sharded(lambda t, pad=pad, kw=kw: F.pad(t, pad, **kw), [Sharded(x, [Shard(2)], {0: (2, 0, 5)})], mesh)
    return True


def test_padding_with_an_empty_middle_rank(dist):
    """A rank holding no rows pads like the others (a constant fill, reflect/replicate/circular of the other
    dims): no rank fails alone, leaving its peers waiting in the next collective."""
    assert all(dist.run(3, _pad_with_an_empty_rank, 31))


POOL_CASES = [  # (kernel, stride, padding, ceil_mode)
    (2, 2, 0, False), (3, 2, 1, False), (3, 2, 1, True), (3, 1, 1, False), (2, None, 0, True), (4, 3, 2, True),
]


def _pools(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for k, s, p, ceil in POOL_CASES:
        x = torch.randn(2, 3, 13, 10, generator=gen, dtype=torch.float64)
        sizes = _sizes(13, world, rng, small=rng.random() < 0.5)
        sh = [Sharded(x, [Shard(2)], {0: sizes})]
        check_sharded(lambda t: F.max_pool2d(t, k, s, p, ceil_mode=ceil), sh, mesh)
        for include in (True, False):
            check_sharded(lambda t: F.avg_pool2d(t, k, s, p, ceil_mode=ceil, count_include_pad=include), sh, mesh)
        check_sharded(lambda t: F.avg_pool2d(t, k, s, p, ceil_mode=ceil, divisor_override=5), sh, mesh)
    x = torch.randn(2, 3, 9, 8, 7, generator=gen, dtype=torch.float64)
    sh = [Sharded(x, [Shard(3)], {0: _sizes(8, world, rng)})]
    check_sharded(lambda t: F.max_pool3d(t, 2, 2, 0, dilation=1), sh, mesh)
    check_sharded(lambda t: F.avg_pool1d(t.flatten(1, 2), 3, 2, 1), [Sharded(torch.randn(2, 3, 4, 11, generator=gen,
                  dtype=torch.float64), [Shard(3)], {0: _sizes(11, world, rng)})], mesh)
    check_sharded(lambda t: F.adaptive_avg_pool2d(t, 1), [Sharded(torch.randn(2, 3, 9, 6, generator=gen,
                  dtype=torch.float64), [Shard(2)], {0: _sizes(9, world, rng)})], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pooling_matches_single_device(dist, world):
    assert all(dist.run(world, _pools, 400 + world))


def _batch_and_spatial(seed):
    mesh = get_mesh((2, 2), ("dp", "domain"))
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(4, 3, 9, 10, generator=gen, dtype=torch.float64)
    check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(0), Shard(2)], {0: (3, 1), 1: (2, 7)})], mesh, module=module)
    check_sharded(lambda t, m: m(t), [Sharded(x, [Replicate(), Shard(3)], {1: (6, 4)})], mesh, module=module)
    return True


def test_batch_and_spatial_sharding_together(dist):
    assert all(dist.run(4, _batch_and_spatial, 5))


def _halo_traffic():
    from domainflow import comm

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    x = torch.randn(1, 3, 12, 5, dtype=torch.float64)
    import domainflow as df

    st = df.distribute_tensor(x, mesh, [Shard(2)], sharding_shapes={0: (4, 1, 3, 4)})
    conv = torch.nn.Conv2d(3, 2, 3, padding=1).double()
    comm.stats.reset()
    y = conv(st)
    fwd = dict(comm.stats.bytes), dict(comm.stats.calls)
    y.sum().backward()
    return fwd, tuple(y.sharding_shapes[0][k][2] for k in range(world))


def test_halo_exchange_moves_only_halo_rows_point_to_point(dist):
    """A 3x3 convolution sends each neighbour one row (3 channels x 5 columns x 8 bytes) and nothing else:
    no all-gather. The rank holding a single row forwards its own row both ways. (Before it, one small
    all-reduce checks that the ranks agree on the sizes the test gave each of them: "check".)"""
    results = dist.run(4, _halo_traffic)
    row = 3 * 5 * 8
    for rank, ((nbytes, calls), out_sizes) in enumerate(results):
        assert set(nbytes) == {"halo", "check"} and calls["check"] == 1 and nbytes["check"] <= 64, nbytes
        neighbours = (rank > 0) + (rank < 3)
        assert nbytes["halo"] == neighbours * row
        assert out_sizes == (4, 1, 3, 4)  # stride 1, "same" padding: the output keeps the input layout


def _norms(seed):
    import copy

    import domainflow as df

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 6, 9, 7, generator=gen, dtype=torch.float64) * 2 + 0.5
    sizes = _sizes(9, world, rng, small=True)
    sh = [Sharded(x, [Shard(2)], {0: sizes})]
    gn = torch.nn.GroupNorm(3, 6).double()
    with torch.no_grad():
        gn.weight.normal_(generator=gen)
        gn.bias.normal_(generator=gen)
    check_sharded(lambda t, m: m(t), sh, mesh, module=gn)
    inn = torch.nn.InstanceNorm2d(6, affine=True).double()
    check_sharded(lambda t, m: m(t), sh, mesh, module=inn)
    ln = torch.nn.LayerNorm(6).double()  # over channel-last features: local
    check_sharded(lambda t, m: m(t.permute(0, 2, 3, 1)), sh, mesh, module=ln)
    # batch norm, training: outputs and grads; running statistics equal to single-device
    bn = torch.nn.BatchNorm2d(6, momentum=0.3).double()
    check_sharded(lambda t, m: m(t), sh, mesh, module=bn)
    ref, mine = copy.deepcopy(bn), copy.deepcopy(bn)
    ref(x)
    mine(df.distribute_tensor(x, mesh, [Shard(2)], sharding_shapes={0: sizes}))
    assert torch.allclose(mine.running_mean, ref.running_mean, atol=1e-12, rtol=0)
    assert torch.allclose(mine.running_var, ref.running_var, atol=1e-12, rtol=0)
    bn.eval()
    check_sharded(lambda t, m: m(t), sh, mesh, module=bn)
    bn3 = torch.nn.BatchNorm3d(2).double()
    x3 = torch.randn(2, 2, 5, 6, 4, generator=gen, dtype=torch.float64)
    check_sharded(lambda t, m: m(t), [Sharded(x3, [Shard(3)], {0: _sizes(6, world, rng)})], mesh, module=bn3)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_normalization_layers(dist, world):
    assert all(dist.run(world, _norms, 500 + world))


def _norm_far_from_zero(seed):
    """float32 group and batch norm of data whose mean is far above its spread (kelvin-like temperatures):
    the sharded statistics must be as accurate as torch's own float32 kernels, measured against float64."""
    import domainflow as df

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    x64 = 280.0 + 0.5 * torch.randn(2, 4, 24, 10, generator=gen, dtype=torch.float64)
    cot = torch.randn(2, 4, 24, 10, generator=gen, dtype=torch.float64)
    sizes = _sizes(24, world, rng)
    for norm in (lambda t: F.group_norm(t, 2), lambda t: F.batch_norm(t, None, None, training=True)):
        ref_in = x64.clone().requires_grad_()
        ref = norm(ref_in)
        (ref * cot).sum().backward()
        own_in = x64.float().requires_grad_()
        own = norm(own_in)
        (own * cot.float()).sum().backward()
        xs = df.distribute_tensor(x64.float(), mesh, [Shard(2)], sharding_shapes={0: sizes}).requires_grad_()
        ys = norm(xs)
        (ys * df.distribute_tensor(cot.float(), mesh, [Shard(2)], sharding_shapes={0: sizes})).sum().backward()
        for got, own_t, want, what in ((ys.full_tensor(), own, ref, "output"),
                                       (xs.grad.full_tensor(), own_in.grad, ref_in.grad, "input gradient")):
            err = (got.double() - want).abs().max().item()
            torch_err = (own_t.double() - want).abs().max().item()
            assert err <= 4 * torch_err + 1e-5, f"{what}: sharded error {err:.2e}, torch float32 {torch_err:.2e}"
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_normalization_statistics_stay_accurate_far_from_zero(dist, world):
    assert all(dist.run(world, _norm_far_from_zero, 700 + world))


INTERP = [dict(scale_factor=2, mode="nearest"), dict(size=(13, 9), mode="nearest"),
          dict(scale_factor=1.7, mode="nearest-exact"), dict(scale_factor=2, mode="bilinear", align_corners=False),
          dict(scale_factor=2, mode="bilinear", align_corners=True), dict(size=(5, 11), mode="bilinear"),
          dict(size=(17, 6), mode="bicubic", align_corners=False),
          dict(scale_factor=2.5, mode="bicubic", align_corners=True), dict(scale_factor=0.5, mode="bilinear"),
          dict(scale_factor=4, mode="bilinear"), dict(scale_factor=(2, 4), mode="nearest-exact"),
          dict(scale_factor=(4, 2), mode="bilinear", align_corners=False)]


def _interp(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for kw in INTERP:
        x = torch.randn(2, 3, 8, 7, generator=gen, dtype=torch.float64)
        dim = rng.choice([2, 3])
        sizes = _sizes(x.shape[dim], world, rng, small=rng.random() < 0.5)
        check_sharded(lambda t: F.interpolate(t, **kw), [Sharded(x, [Shard(dim)], {0: sizes})], mesh)
    x = torch.randn(1, 2, 6, 5, 4, generator=gen, dtype=torch.float64)
    check_sharded(lambda t: F.interpolate(t, scale_factor=2, mode="trilinear"),
                  [Sharded(x, [Shard(3)], {0: _sizes(5, world, rng)})], mesh)
    x = torch.randn(1, 2, 9, generator=gen, dtype=torch.float64)
    check_sharded(lambda t: torch.nn.Upsample(scale_factor=3, mode="linear")(t),
                  [Sharded(x, [Shard(2)], {0: _sizes(9, world, rng)})], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_interpolate_matches_single_device(dist, world):
    assert all(dist.run(world, _interp, 600 + world))


def _interp_after_inference(seed):
    import domainflow as df

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 9, 6, generator=gen, dtype=torch.float64)
    up = lambda t: F.interpolate(t, scale_factor=2, mode="bilinear")  # noqa: E731
    sizes = random_sizes(9, world, random.Random(seed))
    with torch.inference_mode():  # a validation pass first: the layout's plan is made here
        st = df.distribute_tensor(x, mesh, [Shard(2)], sharding_shapes={0: sizes})
        ok = torch.allclose(up(st).full_tensor(), up(x))
    for _ in range(2):  # then training with the same layout reuses the plan
        check_sharded(up, [Sharded(x, [Shard(2)], {0: sizes})], mesh)
    return ok


def _upsample_bit_exact(seed):
    import domainflow as df

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for kw in (dict(scale_factor=2, mode="bilinear"), dict(scale_factor=4, mode="bilinear"),
               dict(scale_factor=2, mode="nearest"), dict(scale_factor=(2, 1), mode="bilinear")):
        x = torch.randn(1, 3, 11, 6, generator=gen) * 100 + 7
        sizes = _sizes(11, world, rng, small=True)
        st = df.distribute_tensor(x, mesh, [Shard(2)], sharding_shapes={0: sizes})
        got = F.interpolate(st, **kw)
        assert torch.equal(got.full_tensor(), F.interpolate(x, **kw)), (kw, sizes)
        k = kw["scale_factor"][0] if isinstance(kw["scale_factor"], tuple) else kw["scale_factor"]
        assert got.placements[0] == Shard(2) and got.to_local().shape[2] == sizes[rank] * k
    x = torch.randn(1, 2, 9, generator=gen)
    sizes = _sizes(9, world, rng, small=True)
    st = df.distribute_tensor(x, mesh, [Shard(2)], sharding_shapes={0: sizes})
    assert torch.equal(F.interpolate(st, scale_factor=8, mode="linear").full_tensor(),
                       F.interpolate(x, scale_factor=8, mode="linear"))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_power_of_two_upsampling_is_bit_exact_in_float32(dist, world):
    """Upsampling by a power of two along the sharded dim (torch's kernel on each rank's block with its
    fetched rows) equals the single-device float32 result bit for bit, with uneven and empty shards; each
    rank keeps the output rows of its own input rows."""
    assert all(dist.run(world, _upsample_bit_exact, 750 + world))


@pytest.mark.parametrize("world", [1, 2])
def test_interpolate_trains_after_a_pass_under_inference_mode(dist, world):
    """Plans cached under torch.inference_mode() hold no inference tensors: a later training step can save
    them for backward."""
    assert all(dist.run(world, _interp_after_inference, 700 + world))


class _UNet(torch.nn.Module):
    """Two levels: conv + group norm + GELU blocks, max pooling down, upsampling up, skip connections.
    ``circular`` pads longitude periodically (a global grid)."""

    def __init__(self, cin=3, c=8, cout=2, circular=False, up="bilinear"):
        super().__init__()
        mode = "circular" if circular else "zeros"

        def block(a, b):
            return torch.nn.Sequential(torch.nn.Conv2d(a, b, 3, padding=1, padding_mode=mode),
                                       torch.nn.GroupNorm(2, b), torch.nn.GELU(),
                                       torch.nn.Conv2d(b, b, 3, padding=1, padding_mode=mode), torch.nn.GELU())
        self.enc1, self.enc2, self.mid = block(cin, c), block(c, 2 * c), block(2 * c, 2 * c)
        self.dec2, self.dec1 = block(4 * c, c), block(2 * c, c)
        self.up = torch.nn.Upsample(scale_factor=2, mode=up, **({"align_corners": False} if up != "nearest" else {}))
        self.head = torch.nn.Conv2d(c, cout, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(torch.nn.functional.max_pool2d(e1, 2))
        m = self.mid(torch.nn.functional.avg_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up(d2), e1], dim=1))
        return self.head(d1)


class _Conv3dNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            # no bias before batch norm: its gradient is exactly zero, and Adam would turn float32 rounding
            # noise in it into full-size steps (a property of Adam, not of sharding)
            torch.nn.Conv3d(2, 6, 3, padding=1, bias=False), torch.nn.BatchNorm3d(6), torch.nn.ReLU(),
            torch.nn.Conv3d(6, 6, 3, stride=2, padding=1), torch.nn.GELU(),
            torch.nn.Upsample(scale_factor=2),
            torch.nn.Conv3d(6, 1, 3, padding=1))

    def forward(self, x):
        return self.net(x)


def _train_equal(kind, dtype_name, mesh_shape, names, placements, sizes, steps, seed, deferred=False):
    import copy

    import domainflow as df

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    mesh = get_mesh(mesh_shape, names)
    if kind == "unet":
        model = _UNet(circular=True).to(dtype)
        x = torch.randn(2, 3, 16, 12, dtype=dtype)
        y = torch.randn(2, 2, 16, 12, dtype=dtype)
    else:
        model = _Conv3dNet().to(dtype)
        x = torch.randn(1, 2, 8, 12, 6, dtype=dtype)
        y = torch.randn(1, 1, 8, 12, 6, dtype=dtype)
    ref = copy.deepcopy(model)
    # Adam normalises each update, so in float32 a gradient element at rounding-noise level (sharded and
    # single-device sums round differently) becomes a full lr-sized step of either sign; SGD keeps float32
    # differences at rounding size, Adam is checked in float64
    make = (lambda ps: torch.optim.Adam(ps, lr=1e-2)) if dtype == torch.float64 else \
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    xs = df.distribute_tensor(x, mesh, placements, sharding_shapes=sizes)
    ys = df.distribute_tensor(y, mesh, placements, sharding_shapes=sizes)
    losses = []
    import contextlib

    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(xs) - ys) ** 2).mean()
        with df.deferred_param_grads() if deferred else contextlib.nullcontext():
            loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        losses.append((float(loss.full_tensor() if isinstance(loss, df.ShardTensor) else loss), float(ref_loss)))
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    buffers = max(((p - q).abs().max().item() for p, q in zip(model.buffers(), ref.buffers())
                   if p.is_floating_point()), default=0.0)
    return worst, buffers, losses


TRAIN_CASES = [
    ("unet", "float64", (3,), ("domain",), [Shard(2)], {0: (7, 2, 7)}, 1e-10),
    ("unet", "float64", (2, 2), ("lat", "lon"), [Shard(2), Shard(3)], {0: (10, 6), 1: (5, 7)}, 1e-10),
    ("unet", "float32", (2,), ("domain",), [Shard(3)], {0: (4, 8)}, 1e-5),
    ("conv3d", "float64", (4,), ("domain",), [Shard(3)], {0: (2, 5, 1, 4)}, 1e-10),
    ("conv3d", "float32", (2,), ("domain",), [Shard(2)], {0: (3, 5)}, 1e-5),
]


@pytest.mark.parametrize("deferred", [False, True], ids=["per-layer-grad-sums", "deferred-grad-sums"])
@pytest.mark.parametrize("case", TRAIN_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}")
def test_training_sharded_equals_single_device(dist, case, deferred):
    kind, dtype, mesh_shape, names, placements, sizes, tol = case
    world = 1
    for s in mesh_shape:
        world *= s
    for worst, buffers, losses in dist.run(world, _train_equal, kind, dtype, mesh_shape, names, placements, sizes,
                                           4, 11, deferred):
        assert worst <= tol and buffers <= tol, (worst, buffers)
        assert all(abs(a - b) <= tol * max(1.0, abs(b)) * 10 for a, b in losses)


CONVT_CASES = [  # (kernel, stride, padding, output_padding, dilation, groups)
    (2, 2, 0, 0, 1, 1), (3, 2, 1, 1, 1, 1), (4, 3, 1, 2, 1, 1), (3, 1, 1, 0, 1, 1), (3, 2, 0, 0, 2, 1),
    (5, 2, 3, 1, 1, 2),
]


def _conv_transpose(nd, seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cls = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d, 3: torch.nn.ConvTranspose3d}[nd]
    for k, s, p, op, d, g in CONVT_CASES:
        module = cls(4, 6, k, stride=s, padding=p, output_padding=op, dilation=d, groups=g).double()
        spatial = [rng.randint(5, 8) for _ in range(nd)]
        x = torch.randn(2, 4, *spatial, generator=gen, dtype=torch.float64)
        dim = 2 + rng.randrange(nd)
        sizes = _sizes(spatial[dim - 2], world, rng, small=rng.random() < 0.5)
        check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(dim)], {0: sizes})], mesh, module=module)
    return True


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_conv_transpose_matches_single_device(dist, nd, world):
    assert all(dist.run(world, _conv_transpose, nd, 700 + 10 * nd + world))


def _along(seed):
    import warnings

    from domainflow import comm

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 10, 4, generator=gen, dtype=torch.float64) * 3
    sizes = _sizes(10, world, rng)
    sh = [Sharded(x, [Shard(1)], {0: sizes})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no relayout of the whole tensor
        comm.stats.reset()
        check_sharded(lambda t: torch.softmax(t, 1), sh, mesh)
        check_sharded(lambda t: F.log_softmax(t, dim=-2), sh, mesh)
        check_sharded(lambda t: t.softmax(1) * 2, sh, mesh)
        check_sharded(lambda t: torch.logsumexp(t, 1), sh, mesh)
        check_sharded(lambda t: torch.logsumexp(t, (1, 2), keepdim=True), sh, mesh)
        check_sharded(lambda t: torch.roll(t, 3, 1), sh, mesh)
        check_sharded(lambda t: torch.roll(t, (-12, 1), (1, 2)), sh, mesh)
        check_sharded(lambda t: t.roll(1, 1), sh, mesh)
        import domainflow as df

        st = df.distribute_tensor(x, mesh, [Shard(1)], sharding_shapes={0: sizes}).requires_grad_()
        comm.stats.reset()  # the ops alone, forward and backward: reductions and halos, never the whole tensor
        (torch.softmax(st, 1) * torch.roll(st, 2, 1) + torch.logsumexp(st, 1, keepdim=True)).sum().backward()
        assert set(comm.stats.calls) <= {"all_reduce", "halo", "check"}, comm.stats.calls  # check: of the sizes
    y = x.clone()
    y[0, :, 0] = float("-inf")  # a row that is -inf everywhere stays well defined where torch's is
    check_sharded(lambda t: torch.log_softmax(t, 1)[1:], [Sharded(y, [Shard(1)], {0: sizes})], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_softmax_logsumexp_roll_along_the_sharded_dim(dist, world):
    assert all(dist.run(world, _along, 800 + world))


def _two_d_mesh_handlers(seed):
    mesh = get_mesh((2, 2), ("lat", "lon"))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 11, 9, generator=gen, dtype=torch.float64)
    sizes = {0: _sizes(11, 2, rng, small=True), 1: _sizes(9, 2, rng, small=True)}
    sh = [Sharded(x, [Shard(2), Shard(3)], sizes)]
    gn = torch.nn.GroupNorm(2, 4).double()
    bn = torch.nn.BatchNorm2d(4).double()
    cases = [
        lambda t: F.max_pool2d(t, 3, 2, 1, ceil_mode=True), lambda t: F.avg_pool2d(t, 2, 2, count_include_pad=False),
        lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), lambda t: F.interpolate(t, size=(7, 12)),
        lambda t: F.pad(t, (2, 1, 1, 2), mode="circular"), lambda t: F.pad(t, (1, 1, 2, 0), mode="reflect"),
        lambda t: torch.softmax(t, 3) + torch.logsumexp(t, 2, keepdim=True), lambda t: torch.roll(t, (3, -2), (2, 3)),
        lambda t: torch.cat([t, t * 2], dim=2), lambda t: torch.cat([t, t.sin()], dim=1),
        lambda t: torch.einsum("bch,bdh->bcd", t.sum(3), t.mean(3)),  # contracting the sharded lat: Partial
        lambda t: F.adaptive_avg_pool2d(t, 1),
        lambda t: F.conv_transpose2d(t, torch.ones(4, 2, 3, 3, dtype=torch.float64), stride=2, padding=1),
    ]
    for fn in cases:
        check_sharded(fn, sh, mesh)
    check_sharded(lambda t, m: m(t), sh, mesh, module=gn)
    check_sharded(lambda t, m: m(t), sh, mesh, module=bn)
    return True


def test_handlers_on_a_2d_domain_mesh(dist):
    assert all(dist.run(4, _two_d_mesh_handlers, 31))


def _conv_on_one_rank_mesh_dims():
    """Spatial dims sharded over mesh dims of one rank (a (2, 1) mesh, and the W dim on the size-1 dim):
    nothing to fetch there, torch pads those dims itself; strides, asymmetric "same" padding and transposed
    convolutions keep the single-device values, gradients and output sizes."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 2, generator=gen, dtype=torch.float64)
    wt = torch.randn(3, 2, 3, 3, generator=gen, dtype=torch.float64)
    cases = [lambda t: F.conv2d(t, w, padding=1, stride=2), lambda t: F.conv2d(t, w, padding="same"),
             lambda t: F.conv2d(t, w, padding=(2, 0), dilation=2),
             lambda t: F.conv_transpose2d(t, wt, stride=2, padding=1, output_padding=1)]
    for mesh_shape, placements, sizes in (((2, 1), [Shard(2), Shard(3)], {0: (4, 5)}),
                                          ((1, 2), [Shard(2), Shard(3)], {1: (5, 3)}),
                                          ((2, 1), [Shard(0), Shard(2)], {}),
                                          ((1, 2), [Shard(2), Shard(0)], {})):
        mesh = get_mesh(mesh_shape, ("a", "b"))
        for fn in cases:
            check_sharded(fn, [Sharded(x, placements, sizes)], mesh)
    return True


def test_convolutions_over_mesh_dims_of_one_rank(dist):
    assert all(dist.run(2, _conv_on_one_rank_mesh_dims))


def _too_few_rows_everywhere():
    """A 7x7 kernel over ranks of 1-2 rows: halos reach three ranks away; a kernel wider than the whole dim
    is refused the way torch refuses it."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 6, 5, generator=gen, dtype=torch.float64)
    conv = torch.nn.Conv2d(2, 3, 7, padding=3).double()
    check_sharded(lambda t, m: m(t), [Sharded(x, [Shard(2)], {0: (1, 2, 1, 2)})], mesh, module=conv)
    import domainflow as df

    st = df.distribute_tensor(x, mesh, [Shard(2)], sharding_shapes={0: (1, 2, 1, 2)})
    try:
        torch.nn.Conv2d(2, 3, 9).double()(st)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_halo_wider_than_neighbours_and_kernel_wider_than_the_grid(dist):
    msgs = dist.run(4, _too_few_rows_everywhere)
    assert all(m is not None and "Kernel size can't be greater than actual input size" in m for m in msgs) or \
        all(m is not None and "kernel" in m.lower() for m in msgs), msgs


def _deferred_calls():
    import domainflow as df
    from domainflow import comm

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    torch.manual_seed(0)
    model = _UNet().double()
    x = df.distribute_tensor(torch.randn(1, 3, 8, 8, dtype=torch.float64), mesh, [Shard(2)])
    calls = []
    for deferred in (False, True):
        model.zero_grad()
        loss = model(x).pow(2).mean()
        comm.stats.reset()
        with df.deferred_param_grads() if deferred else __import__("contextlib").nullcontext():
            loss.backward()
        calls.append((comm.stats.calls["all_reduce"], [p.grad.clone() for p in model.parameters()]))
    (n_now, g_now), (n_deferred, g_deferred) = calls
    same = max((a - b).abs().max().item() for a, b in zip(g_now, g_deferred))
    # autograd.grad keeps working by default (sums done before it returns)
    g = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    same_grad = max((a - b).abs().max().item() for a, b in zip(g, g_now))
    return n_now, n_deferred, same, same_grad


def test_deferred_parameter_gradient_sums_use_one_collective(dist):
    """Per-layer sums: one all-reduce per layer with parameters; deferred: one for the whole model (plus the
    group norms' statistics, which every layer needs either way); same gradients."""
    for n_now, n_deferred, same, same_grad in dist.run(2, _deferred_calls):
        assert same < 1e-12 and same_grad < 1e-12
        assert n_deferred <= n_now - 10, (n_now, n_deferred)


def _channels_sharded():
    """Pooling treats each channel alone: with the channel dim sharded (the batch too), every
    window lies in a rank's chunk, so torch's op runs on it (max pooling's indices included)."""
    import random as _random

    from sharded_check import Sharded, get_mesh, random_sizes
    from sweep import check_into, none_failed

    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(13)
    c = 2 + 2 * world
    x = torch.randn(2, c, 8, 6, generator=gen, dtype=torch.float64)
    sizes = {0: (0,) + tuple(random_sizes(c, world - 1, _random.Random(world), zeros=False))}
    cases = {
        "max_pool2d": lambda a: F.max_pool2d(a, 2), "max_pool2d indices": lambda a: F.max_pool2d(a, 3, 2, 1,
                                                                                                return_indices=True),
        "avg_pool2d": lambda a: F.avg_pool2d(a, 3, 1, 1), "max_pool1d": lambda a: F.max_pool1d(a.flatten(2), 4),
        "adaptive_avg_pool2d": lambda a: F.adaptive_avg_pool2d(a, (3, 2)),
        "adaptive_max_pool2d": lambda a: F.adaptive_max_pool2d(a, (3, 4)),
        "adaptive_max_pool2d indices": lambda a: F.adaptive_max_pool2d(a, 3, return_indices=True),
    }
    failures = []
    for name, f in cases.items():
        check_into(f, [Sharded(x, [Shard(1)], sizes)], mesh, name, failures)
    return none_failed(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_pooling_with_the_channel_dim_sharded(dist, world):
    assert all(dist.run(world, _channels_sharded))
