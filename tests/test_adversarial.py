"""Adversarial checks: empty shards everywhere, gradients that come back in another layout, shared
parameters, in-place ops, 2-D meshes, pending Partial values, error paths. Every case compares with an
independent float64 computation on the full tensor in one process (check_sharded or explicit)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import domainflow as df
from dist_pool import rank_and_world
from domainflow import Partial, Replicate, Shard, ShardTensor
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

D = torch.float64
TOL = 1e-10


def _t(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=D)


def _zero_layouts(n: int, parts: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Layouts of ``n`` rows over ``parts`` ranks with empty shards: first empty, last empty, all rows on
    one middle rank, plus one random (zeros likely)."""
    if parts == 1:
        return [(n,)]
    out = [(0,) * (parts - 1) + (n,), (n,) + (0,) * (parts - 1)]
    mid = [0] * parts
    mid[parts // 2] = n
    out.append(tuple(mid))
    if parts >= 3 and n >= 2:
        out.append((0, n - 1) + (0,) * (parts - 3) + (1,))
    out.append(random_sizes(n, parts, rng))
    return list(dict.fromkeys(out))[:4]


def _run(fn, inputs, mesh, name, failures, **kw):
    try:
        check_sharded(fn, inputs, mesh, **kw)
    except Exception as e:  # noqa: BLE001 - collect every failing case with its name
        failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def _ok(failures):
    assert not failures, "\n".join(failures)
    return True


WORLDS = (2, 3, 4)


# =================================================================================================
# 1. empty shards + reductions over the sharded dim
# =================================================================================================
def _zero_reductions(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 5
    fns = {
        "amax0": lambda a: a.amax(0),
        "amin0_keep": lambda a: a.amin(0, keepdim=True),
        "max_all": lambda a: a.max(),
        "min_all": lambda a: a.min(),
        "max_dim0": lambda a: a.max(0),
        "min_dim0_keep": lambda a: a.min(0, keepdim=True),
        "argmax0": lambda a: a.argmax(0),
        "argmin_flat": lambda a: a.argmin(),
        "prod0": lambda a: (a * 0.3 + 1).prod(0),
        "prod_all": lambda a: (a * 0.1 + 1).prod(),
        "var0": lambda a: a.var(0),
        "var0_unbiased_false": lambda a: torch.var(a, 0, correction=0, keepdim=True),
        "std_all": lambda a: a.std(),
        "var_mean0": lambda a: torch.var_mean(a, 0),
        "norm2": lambda a: torch.linalg.vector_norm(a, dim=0),
        "norm_inf": lambda a: torch.linalg.vector_norm(a, float("inf"), dim=0),
        "norm_neginf": lambda a: torch.linalg.vector_norm(a, -float("inf")),
        "norm_1p5": lambda a: torch.linalg.vector_norm(a, 1.5, dim=(0, 1)),
        "norm0": lambda a: torch.linalg.vector_norm(a, 0, dim=0).to(D) + 0 * a.sum(),
        "sum_mean": lambda a: a.sum(0) + a.mean((0, 1), keepdim=True).squeeze(0),
        "logsumexp_unsharded": lambda a: torch.logsumexp(a, 1),
        "softmax_unsharded": lambda a: torch.softmax(a, -1) * a,
        "manual_logsumexp_sharded": lambda a: (a - a.amax(0, keepdim=True)).exp().sum(0).log() + a.amax(0),
        "sqrt_sum_sq": lambda a: (a * a).sum((0, 2)).sqrt(),
    }
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 3, 2), [Shard(0)], {0: sizes})
        for name, fn in fns.items():
            _run(fn, [x], mesh, f"{name} sizes={sizes}", failures)
    # products with exact zeros (one zero in a column, two zeros in another)
    full = _t(gen, n, 3) * 0.5 + 1.0
    full[1, 0] = 0.0
    full[0, 1] = 0.0
    full[n - 1, 1] = 0.0
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(full.clone(), [Shard(0)], {0: sizes})
        _run(lambda a: a.prod(0), [x], mesh, f"prod_with_zeros sizes={sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", (3, 4))
def test_zero_shards_reductions(dist, world):
    """Reductions over a sharded dim whose shards include empty ones: values and gradients."""
    assert all(dist.run(world, _zero_reductions, 100 + world))


# =================================================================================================
# 2. empty shards + views, slicing, select, cat/split, matmul, LayerNorm, softmax, F.linear
# =================================================================================================
def _zero_views(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 4, 3), [Shard(0)], {0: sizes})
        last = max(k for k, s in enumerate(sizes) if s > 0)
        last_row = sum(sizes[:last]) + sizes[last] - 1
        cases = {
            "merge_inner": lambda a: a.reshape(n * 4, 3) * 2,
            "merge_all": lambda a: a.reshape(-1).sin(),
            "flatten_unflatten": lambda a: a.flatten(0, 1).unflatten(0, (n, 4)) + 1,
            "slice_step2": lambda a: a[::2] * 3,
            "slice_1_step3": lambda a: a[1::3].exp(),
            "slice_tail": lambda a: a[n - 2:],
            "slice_step4_then_sum": lambda a: a[::4].sum(0),
            "select_last_row": lambda a: a[last_row] * 2,
            "select_first_row": lambda a: a[0] + 1,
            "select_neg": lambda a: a.select(0, -1),
            "cat_sharded": lambda a: torch.cat([a, a[1:3] * 2, a[::3]], 0),
            "split_cat": lambda a: torch.cat([p * (i + 1) for i, p in enumerate(a.split([0, 2, 1, 3], 0))], 0),
            "chunk": lambda a: a.chunk(4, 0)[-1] * 5,
            "unbind_sharded": lambda a: torch.stack(a.unbind(0)[::2], 0),
            "stack_sharded": lambda a: torch.stack([a, a * 2], 0).sum(0),
            "diff": lambda a: torch.diff(a, dim=0),
            "layernorm": lambda a: F.layer_norm(a, (3,)) * 1.5,
            "layernorm2": lambda a: F.layer_norm(a, (4, 3)),
            "softmax_unsharded": lambda a: torch.log_softmax(a, 1),
            "matmul_contract_sharded": lambda a: a.reshape(n, 12).t() @ a.reshape(n, 12),
            "einsum_nc_nc": lambda a: torch.einsum("nij,nij->ij", a, a),
        }
        for name, fn in cases.items():
            _run(fn, [x], mesh, f"{name} sizes={sizes}", failures)
        # F.linear on [B, N, C] with N sharded (zeros included), and nn.Linear/LayerNorm modules
        xb = Sharded(_t(gen, 2, n, 3), [Shard(1)], {0: sizes})
        torch.manual_seed(1)
        lin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.GELU(),
                                  torch.nn.Linear(4, 2)).double()
        _run(lambda a, m: m(a), [xb], mesh, f"linear_BNC sizes={sizes}", failures, module=lin)
        _run(lambda a, m: (m(a) ** 2).mean(), [xb], mesh, f"linear_BNC_loss sizes={sizes}", failures, module=lin)
    # splitting a sharded dim when every rank's rows divide evenly
    for sizes in [(0,) * (world - 1) + (8,), (8,) + (0,) * (world - 1), (2,) * (world - 1) + (8 - 2 * (world - 1),)]:
        x = Sharded(_t(gen, 8, 3), [Shard(0)], {0: sizes})
        _run(lambda a: a.reshape(4, 2, 3) * 2, [x], mesh, f"split_dim sizes={sizes}", failures)
        _run(lambda a: a.reshape(4, 2, 3).sum(1), [x], mesh, f"split_dim_sum sizes={sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_zero_shards_views_and_ops(dist, world):
    assert all(dist.run(world, _zero_views, 200 + world))


# =================================================================================================
# 3. gradients that arrive with another layout than the forward output
# =================================================================================================
def _grad_layouts(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 7
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 4), [Shard(0)], {0: sizes})
        w_slice = Sharded(_t(gen, 3, 4), [Shard(0)])                  # chunk layout of the sliced length
        w_rows = Sharded(_t(gen, n, 4), [Shard(0)], {0: random_sizes(n, world, rng)})
        _run(lambda a, w: (w * a[1::2]).sum(), [x, w_slice], mesh, f"slice_then_mul_other_layout {sizes}", failures)
        _run(lambda a, w: (a[1::2] * w).sum(0), [x, w_slice], mesh, f"slice_then_mul_first {sizes}", failures)
        _run(lambda a, w: (w * a.exp()).sum(), [x, w_rows], mesh, f"pointwise_other_layout {sizes}", failures)
        _run(lambda a, w: (w * a.t().t()).mean(), [x, w_rows], mesh, f"transpose_chain {sizes}", failures)
        _run(lambda a, w: (w[2] * a[2]).sum(), [x, w_rows], mesh, f"select_both {sizes}", failures)
        # reductions over the sharded dim whose [4]-shaped output meets an operand sharded along it
        w_c = Sharded(_t(gen, 4), [Shard(0)], {0: random_sizes(4, world, rng)})
        for name, red in {"sum0": lambda a: a.sum(0), "mean0": lambda a: a.mean(0), "amax0": lambda a: a.amax(0),
                          "max0": lambda a: a.max(0)[0], "var0": lambda a: a.var(0),
                          "prod0": lambda a: (a * 0.2 + 1).prod(0),
                          "norm0": lambda a: torch.linalg.vector_norm(a, dim=0),
                          "layernorm": lambda a: F.layer_norm(a, (4,))[1:3].sum(0)}.items():
            _run(lambda a, w, red=red: w * red(a), [x, w_c], mesh, f"reduce_then_other_layout_{name} {sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_arriving_in_another_layout(dist, world):
    """slice/transpose/select outputs combined with operands sharded with other sizes: the backward
    gets gradients laid out like the other operand; results must still equal one process."""
    assert all(dist.run(world, _grad_layouts, 300 + world))


def _grad_layout_view(world_sizes):
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 4), [Shard(0)], {0: world_sizes})
    w = Sharded(_t(gen, 24), [Shard(0)], {0: (5, 10, 9)})  # not multiples of 4
    # Regression test (bug found in review, now fixed): forward works; backward of the reshape gets w's layout and cannot view it back
    check_sharded(lambda a, ww: ww * a.reshape(24), [x, w], mesh)
    return True


def test_reshape_backward_with_gradient_in_other_layout(dist):
    # Regression test (bug found in review, now fixed): the gradient of a.reshape(24) arrives laid out like `ww` (sizes 5, 10, 9 over 24)
    # whose rows do not map back to whole rows of [6, 4]; the view backward raises
    # UnsupportedShardedOp instead of redistributing the gradient to the forward output layout.
    assert all(dist.run(3, _grad_layout_view, (1, 4, 1)))


def _grad_layout_softmax():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 6), [Shard(0)], {0: (2, 3)})
    w = Sharded(_t(gen, 5, 6), [Shard(1)], {0: (4, 2)})
    # softmax over the unsharded dim 1 of x; w is sharded on dim 1, so it leads the product's layout
    check_sharded(lambda a, ww: ww * torch.softmax(a, 1), [x, w], mesh)
    return True


def test_softmax_backward_with_gradient_sharded_on_softmax_dim(dist):
    # Regression test (bug found in review, now fixed).
    # Was: forward is legal (softmax over an unsharded dim); the gradient comes back sharded on
    # dim 1 (w's layout), and _softmax_backward_data raises UnsupportedShardedOp in backward.
    assert all(dist.run(2, _grad_layout_softmax))


# =================================================================================================
# 4. one plain nn.Parameter used several times in one forward
# =================================================================================================
class SharedParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.tensor([0.7, -1.2, 0.4]))
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, x):
        h = self.lin(x) * self.scale                       # F.linear (own backward) + pointwise
        h = self.lin(torch.tanh(h)) + x * self.scale       # same Linear again, scale again
        h = self.norm(h) * self.scale + self.norm.weight   # LayerNorm weight also used as an addend
        h = h @ self.lin.weight.t()                        # weight used a third time, through mm
        h = torch.cat([h, self.scale.expand(h.shape[0], 3) * 2], 1)   # plain param concatenated
        return h


def _shared_params(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    torch.manual_seed(3)
    model = SharedParams().double()
    n = 7
    rest = [Replicate()] * (len(mesh_shape) - 1)
    for sizes in _zero_layouts(n, mesh_shape[0], rng):
        x = Sharded(_t(gen, n, 3), [Shard(0)] + rest, {0: sizes})
        _run(lambda a, m: m(a), [x], mesh, f"shared_out {sizes}", failures, module=model)
        _run(lambda a, m: ((m(a) - 0.3) ** 2).mean() + m(a).sum() * 0.1, [x], mesh, f"shared_loss {sizes}", failures,
             module=model)
    return _ok(failures)


@pytest.mark.parametrize("world,mesh_shape", [(2, (2,)), (3, (3,)), (4, (4,)), (4, (2, 2))])
def test_parameter_used_several_times(dist, world, mesh_shape):
    """Parameter gradients are plain tensors equal to one process, summed exactly once even when the
    parameter meets ShardTensors through F.linear, pointwise ops, LayerNorm and mm in one forward."""
    assert all(dist.run(world, _shared_params, mesh_shape, 400 + world))


# =================================================================================================
# 5. in-place ops with broadcasting plain operands
# =================================================================================================
def _inplace(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    row = _t(gen, 3)
    col = _t(gen, n, 1)
    full_plain = _t(gen, n, 3)
    mask = _t(gen, n, 3) > 0.3
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 3), [Shard(0)], {0: sizes})
        other = Sharded(_t(gen, n, 3), [Shard(0)], {0: random_sizes(n, world, rng)})

        def chain(a, b, r, c, m):
            z = a * 1.0
            z.add_(r)
            z.mul_(c)
            z.sub_(b, alpha=0.5)
            z.masked_fill_(m, 0.25)
            z.clamp_(-0.8, 0.9)
            z.div_(r.abs() + 1)
            return z

        _run(chain, [x, other, row, col, mask], mesh, f"inplace_chain {sizes}", failures)

        def copy_plain(a, fp):
            z = a * 2.0
            z.copy_(fp)
            return z * a

        _run(copy_plain, [x, full_plain], mesh, f"copy_plain {sizes}", failures)

        def copy_bcast(a, r):
            z = a * 2.0
            z.copy_(r)
            return z + a

        _run(copy_bcast, [x, row], mesh, f"copy_broadcast {sizes}", failures)

        def copy_other_layout(a, b):
            z = a * 1.0
            z.copy_(b * 3)
            return z

        _run(copy_other_layout, [x, other], mesh, f"copy_other_layout {sizes}", failures)

        def slice_inplace(a):
            z = a * 1.0
            z[1:4].mul_(3.0)
            z[:, 1].add_(0.5)
            z[::2, :2].clamp_(-0.2, 0.2)
            return z

        x_nograd = Sharded(x.full, x.placements, x.sizes, requires_grad=False)
        _run(slice_inplace, [x_nograd], mesh, f"slice_inplace {sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", WORLDS)
def test_inplace_ops_with_broadcasting_plain_operands(dist, world):
    assert all(dist.run(world, _inplace, 500 + world))


def _setitem_sharded_row():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.arange(12.0, dtype=D).reshape(4, 3)
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (1, 3)})
    x[2] = -1.0                      # a boundary condition on a row owned by rank 1
    ref = full.clone()
    ref[2] = -1.0
    got = x.full_tensor()
    assert torch.equal(got, ref), f"x[2] = -1 gave\n{got}\nexpected\n{ref}"
    return True


def test_setitem_on_sharded_index(dist):
    # Regression test (bug found in review, now fixed): x[i] = v on the sharded dim is silently lost: select() on a sharded dim returns a
    # broadcast copy, so the fill_/copy_ that __setitem__ applies never reaches x's local chunk.
    assert all(dist.run(2, _setitem_sharded_row))


def _select_inplace_grad():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 3), [Shard(0)], {0: (2, 3)})

    def fn(a):
        z = a * 1.0
        z[3] = z[3] * 2.0
        return z

    check_sharded(fn, [x], mesh)
    return True


def test_setitem_sharded_index_with_autograd(dist):
    # Regression test (bug found in review, now fixed): same root cause as test_setitem_on_sharded_index, with autograd in the loop.
    assert all(dist.run(2, _select_inplace_grad))


# =================================================================================================
# 6. 2-D meshes
# =================================================================================================
def _rd(a, placements):
    """redistribute on the sharded run; identity on the one-process reference."""
    return a.redistribute(placements) if isinstance(a, ShardTensor) else a


def _mesh2d(seed):
    mesh = get_mesh((2, 2))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    A, B, C = 5, 4, 3
    for sa, sb in [((0, A), (B, 0)), ((A - 2, 2), (1, B - 1))]:
        x = Sharded(_t(gen, A, B, C), [Shard(0), Shard(1)], {0: sa, 1: sb})
        y_swapped = Sharded(_t(gen, A, B, C), [Shard(1), Shard(0)], {0: random_sizes(B, 2, rng),
                                                                   1: random_sizes(A, 2, rng)})
        y_only0 = Sharded(_t(gen, A, B, C), [Shard(0), Replicate()], {0: random_sizes(A, 2, rng)})
        y_only1 = Sharded(_t(gen, A, B, C), [Replicate(), Shard(1)], {1: sb})
        y_c = Sharded(_t(gen, A, B, C), [Shard(2), Replicate()], {0: random_sizes(C, 2, rng)})
        fns = {
            "sum0": lambda a: a.sum(0),
            "sum1": lambda a: a.sum(1),
            "sum01": lambda a: a.sum((0, 1)),
            "mean01_keep": lambda a: a.mean((0, 1), keepdim=True) * a,
            "amax01": lambda a: a.amax((0, 1)),
            "amin1": lambda a: a.amin(1),
            "max_all": lambda a: a.max(),
            "argmax1": lambda a: a.argmax(1),
            "argmax_flat": lambda a: a.argmin(),
            "max_dim0": lambda a: a.max(0),
            "var01": lambda a: a.var((0, 1)),
            "std1": lambda a: a.std(1),
            "norm01": lambda a: torch.linalg.vector_norm(a, dim=(0, 1)),
            "norm_inf": lambda a: torch.linalg.vector_norm(a, float("inf")),
            "prod1": lambda a: (a * 0.2 + 1).prod(1),
            "softmax2": lambda a: torch.softmax(a, 2),
            "layernorm": lambda a: F.layer_norm(a, (C,)),
            "reshape_merge12": lambda a: a.reshape(A, B * C) * 2,
            "reshape_merge01_outer_sharded": lambda a: a.permute(1, 0, 2).reshape(B, A * C).sum(0),
            "permute": lambda a: a.permute(2, 1, 0).contiguous() + 1,
            "redistribute_swap": lambda a: _rd(a, [Shard(1), Shard(0)]) * 2,
            "redistribute_to_c": lambda a: _rd(a, [Shard(2), Shard(0)]).exp(),
            "redistribute_rep": lambda a: _rd(a, [Replicate(), Shard(2)]) + 0,
            "redistribute_partial": lambda a: _rd(a.sum(0), [Shard(1), Shard(0)]).sin(),
            "slice1_step2": lambda a: a[:, ::2] * 3,
            "select1": lambda a: a[:, B - 1],
            "cat1": lambda a: torch.cat([a, a[:, :1]], 1),
        }
        for name, fn in fns.items():
            _run(fn, [x], mesh, f"{name} sa={sa} sb={sb}", failures)
        for yname, y in [("swapped", y_swapped), ("only0", y_only0), ("only1", y_only1), ("c", y_c)]:
            _run(lambda a, b: a * b + b.sin(), [x, y], mesh, f"pointwise_{yname}", failures)
            _run(lambda a, b: (a - b).pow(2).sum((0, 1)), [x, y], mesh, f"pointwise_sum_{yname}", failures)
        _run(lambda a, b: torch.bmm(a.permute(1, 0, 2), b.permute(1, 2, 0)), [x, y_only1], mesh, "bmm_batch_sharded",
             failures)
        torch.manual_seed(2)
        mlp = torch.nn.Sequential(torch.nn.Linear(C, 4), torch.nn.LayerNorm(4), torch.nn.Tanh(),
                                  torch.nn.Linear(4, 2)).double()
        _run(lambda a, m: (m(a) - 0.2).pow(2).mean(), [x], mesh, "mlp_loss_2d", failures, module=mlp)
        _run(lambda a, m: m(a), [x], mesh, "mlp_out_2d", failures, module=mlp)
    return _ok(failures)


def test_mesh_2x2_sharded_on_two_dims(dist):
    assert all(dist.run(4, _mesh2d, 600))


def _mesh2d_same_dim_two_mesh_dims():
    mesh = get_mesh((2, 2))
    gen = torch.Generator().manual_seed(1)
    x = Sharded(_t(gen, 5, 3), [Shard(0), Replicate()], {0: (1, 4)})
    y = Sharded(_t(gen, 5, 3), [Replicate(), Shard(0)], {1: (3, 2)})
    check_sharded(lambda a, b: a + b, [x, y], mesh)
    return True


def test_mesh_2x2_pointwise_same_dim_sharded_on_different_mesh_dims(dist):
    # Regression test (bug found in review, now fixed).
    # Was: x is Shard(0) on mesh dim 0, y is Shard(0) on mesh dim 1. The pointwise planner targets
    # [Shard(0), Shard(0)] for both operands and ShardSpec.build raises ValueError ("tensor dim 0 is
    # sharded by mesh dims 0 and 1") instead of computing x + y (or raising UnsupportedShardedOp).
    assert all(dist.run(4, _mesh2d_same_dim_two_mesh_dims))


def _mesh2d_mm_contract_two_mesh_dims():
    mesh = get_mesh((2, 2))
    gen = torch.Generator().manual_seed(2)
    a = Sharded(_t(gen, 3, 6), [Shard(1), Replicate()], {0: (2, 4)})
    b = Sharded(_t(gen, 6, 2), [Replicate(), Shard(0)], {1: (5, 1)})
    check_sharded(lambda p, q: p @ q, [a, b], mesh)
    return True


def test_mesh_2x2_matmul_contracted_dim_sharded_on_different_mesh_dims(dist):
    # Regression test (bug found in review, now fixed).
    # Was: the contracted dim is sharded over mesh dim 0 in `a` and over mesh dim 1 in `b`;
    # plan_contraction asks for a_dst [Shard(1), Shard(1)] and ShardSpec.build raises ValueError.
    assert all(dist.run(4, _mesh2d_mm_contract_two_mesh_dims))


# =================================================================================================
# 7. pending Partial values
# =================================================================================================
def _partials(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 3), [Shard(0)], {0: sizes})
        bias = _t(gen, 3)
        fns = {
            "linear_then_exp": lambda a: (a.sum(0) * 2 - a.mean(0) / 3 + bias).exp(),
            "partial_minus_partial_sq": lambda a: (a.sum(0) - a[::2].sum(0)) ** 2,
            "partial_times_plain": lambda a: (a.sum(0) * bias).sum() * a,
            "partial_div_partial": lambda a: a.sum(0) / (a * a).sum(0),
            "plain_div_partial": lambda a: bias / (a * a + 1).sum(0),
            "partial_compare": lambda a: torch.where(a.sum(0) > 0, a.sum(0), -a.sum(0)),
            "partial_plus_scalar": lambda a: a.sum(0) + 1.5,
            "partial_neg_clone": lambda a: (-a.sum(0)).clone().abs(),
            "partial_max_in_loss": lambda a: ((a - a.amax(0, keepdim=True)) ** 2).mean(),
            "partial_min_times_2": lambda a: a.amin(0) * 2 + a.amin(0).exp(),
            "partial_prod": lambda a: (a * 0.1 + 1).prod(0) * 3,
            "partial_unsqueeze_expand": lambda a: a.sum(0).unsqueeze(0).expand(n, 3) * a,
            "partial_matmul": lambda a: a.t() @ a @ bias.unsqueeze(1),
            "partial_sum_of_sum": lambda a: a.sum(0).sum() + a.sum(),
            "partial_mean_of_partial": lambda a: a.sum(0).mean(),
            "partial_var": lambda a: a.sum(0).var(),
            "partial_softmax": lambda a: torch.softmax(a.sum(0), 0),
            "partial_cat": lambda a: torch.cat([a.sum(0), a.amax(0), bias]),
            "partial_stack_rep": lambda a: torch.stack([a.sum(0), bias]),
            "partial_mse": lambda a: F.mse_loss(a.sum(0), bias),
            "partial_select": lambda a: a.sum(0)[1] * a,
            "partial_slice": lambda a: a.sum(0)[1:] ** 2,
        }
        for name, fn in fns.items():
            _run(fn, [x], mesh, f"{name} sizes={sizes}", failures)
    # .item(), comparisons and bool on global scalars read the same on every rank
    full = _t(gen, n, 3)
    for sizes in _zero_layouts(n, world, rng):
        st = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
        s = st.sum() * 2 + st.mean()
        if abs(s.item() - (full.sum() * 2 + full.mean()).item()) > TOL:
            failures.append(f"item {sizes}: {s.item()} vs {(full.sum() * 2 + full.mean()).item()}")
        if bool(st.sum() > 0) != bool(full.sum() > 0):
            failures.append(f"bool(compare) {sizes}")
        if abs(float(st.amax()) - float(full.amax())) > TOL:
            failures.append(f"float(amax) {sizes}")
        if int(st.argmax()) != int(full.argmax()):
            failures.append(f"int(argmax) {sizes}")
    return _ok(failures)


@pytest.mark.parametrize("world", (2, 3))
def test_pending_partials(dist, world):
    assert all(dist.run(world, _partials, 700 + world))


def _partial_to_int():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.full((4, 1), 0.3, dtype=D)       # column sum 1.2
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (2, 2)})
    s = x.sum(0)                                   # Partial(sum): 0.6 on each rank
    got = s.to(torch.int64).full_tensor()
    want = full.sum(0).to(torch.int64)
    assert torch.equal(got, want), f"sum(0).to(int64) = {got.tolist()}, expected {want.tolist()}"
    got_b = s.to(torch.bool).full_tensor()
    want_b = full.sum(0).to(torch.bool)
    assert torch.equal(got_b, want_b), f"sum(0).to(bool) = {got_b.tolist()}, expected {want_b.tolist()}"
    return True


def test_partial_cast_to_integer(dist):
    # Regression test (bug found in review, now fixed): _to_copy keeps a Partial(sum) pending (same_layout handler), but casting to an integer
    # (or bool) dtype does not commute with the sum: int(0.6) + int(0.6) = 0 != int(1.2) = 1, and
    # bool(0.6) + bool(0.6) gives 2 as uint8/bool -> wrong.
    assert all(dist.run(2, _partial_to_int))


def _partial_product_placement():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.tensor([2.0, 3.0, -1.5], dtype=D)
    out = {}
    for op in ("sum", "avg", "max", "min", "product"):
        p = df.distribute_tensor(full, mesh, [Partial(op)])
        out[op] = p.full_tensor()
        r = df.distribute_tensor(full, mesh, [Replicate()]).redistribute([Partial(op)]).redistribute([Replicate()])
        out[op + "_via_redistribute"] = r.to_local()
    bad = {k: v.tolist() for k, v in out.items() if not torch.allclose(v, full, rtol=0, atol=1e-12)}
    assert not bad, f"Replicate -> Partial(op) -> Replicate changed the value: {bad} (expected {full.tolist()})"
    return True


def test_replicate_to_partial_product_round_trip(dist):
    # Regression test (bug found in review, now fixed): Replicate -> Partial("product") keeps the full value on every rank (only "sum" zeroes the
    # other ranks), so reducing it gives value ** world_size (distribute_tensor and redistribute).
    assert all(dist.run(3, _partial_product_placement))


# =================================================================================================
# 8. error paths: unsupported ops raise, fallback('gather') is correct
# =================================================================================================
def _errors(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    full = _t(gen, n, 3)
    idx = torch.tensor([4, 0, 2])
    ops = {
        "cumsum0": lambda a: torch.cumsum(a, 0),
        "cummax0": lambda a: torch.cummax(a, 0)[0],
        "sort0": lambda a: torch.sort(a, 0)[0],
        "topk0": lambda a: torch.topk(a, 2, 0)[0],
        "flip0": lambda a: torch.flip(a, [0]),
        "roll0": lambda a: torch.roll(a, 1, 0),
        "softmax0": lambda a: torch.softmax(a, 0),
        "logsumexp0": lambda a: torch.logsumexp(a, 0),
        "median0": lambda a: torch.median(a, 0)[0],
        "index_select0": lambda a: torch.index_select(a, 0, idx),
        "adv_index0": lambda a: a[idx],
        "pad0": lambda a: F.pad(a.t(), (1, 2)).t(),
        "reshape_split_rows": lambda a: a.reshape(3, n).sum(0),
        "unfold": lambda a: a.unfold(0, 2, 1).sum(-1),
        "kthvalue": lambda a: torch.kthvalue(a, 2, 0)[0],
    }
    for sizes in _zero_layouts(n, world, rng)[:3]:
        for name, fn in ops.items():
            st = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
            want = fn(full)
            try:
                got = fn(st)
            except df.UnsupportedShardedOp:
                pass
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name} {sizes}: raised {type(e).__name__} (not UnsupportedShardedOp): "
                                f"{str(e).splitlines()[0][:200]}")
                continue
            else:
                g = got.full_tensor() if isinstance(got, ShardTensor) else got
                if g.shape != want.shape or not torch.allclose(g.double(), want.double(), atol=1e-10, rtol=1e-10):
                    failures.append(f"{name} {sizes}: silently wrong result")
                    continue
            # with the gather fallback the op gives the right values (forward and backward)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with df.fallback("gather"):
                    x = Sharded(full, [Shard(0)], {0: sizes})
                    _run(fn, [x], mesh, f"fallback_{name} {sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", (3,))
def test_unsupported_ops_raise_and_fallback_is_correct(dist, world):
    assert all(dist.run(world, _errors, 800 + world))


def _argmax_keepdim():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 3), [Shard(0)], {0: (2, 3)})
    check_sharded(lambda a: a.argmax(keepdim=True), [x], mesh)
    return True


def test_argmax_flat_keepdim(dist):
    # Regression test (bug found in review, now fixed): argmax(dim=None, keepdim=True) returns shape () instead of (1, 1):
    # indexed_reduction's dim-None branch ignores keepdim.
    assert all(dist.run(2, _argmax_keepdim))


def _argmax_nan():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.arange(12.0, dtype=D).reshape(2, 6)
    full[1, 0] = float("nan")   # flat index 6, on rank 0 (cols 0..2)
    full[0, 4] = float("nan")   # flat index 4, on rank 1 (cols 3..5): torch returns 4
    x = df.distribute_tensor(full, mesh, [Shard(1)], sharding_shapes={0: (3, 3)})
    got, want = int(x.argmax()), int(full.argmax())
    assert got == want, f"argmax with NaNs: {got}, expected {want}"
    return True


def test_argmax_flat_nan_on_column_shards(dist):
    # Regression test (bug found in review, now fixed): _flat_candidates keeps the first NaN candidate in rank order rather than the smallest
    # global flat index; with column shards the later rank can hold the earlier NaN.
    assert all(dist.run(2, _argmax_nan))


# =================================================================================================
# 9. single-bug reproductions found by the sweeps above
# =================================================================================================
def _norm_of_partial():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 3), [Shard(0)], {0: (2, 4)})
    check_sharded(lambda a: torch.linalg.vector_norm(a.sum(0)), [x], mesh)
    return True


def test_vector_norm_of_partial_backward(dist):
    # Regression test (bug found in review, now fixed).
    # Was: forward is fine (vector_norm reduces the pending Partial), but torch's norm backward
    # multiplies the saved Partial input and then calls masked_fill_ in place on the Partial product;
    # dispatch refuses ("the first operand of an in-place op would have to change layout") so
    # backward raises UnsupportedShardedOp. In-place non-linear ops on a Partial should reduce it.
    assert all(dist.run(2, _norm_of_partial))


def _nansum_dim():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    full = _t(gen, 5, 3)
    full[1, 2] = float("nan")
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (2, 3)})
    for dim in (0, 1):
        got = torch.nansum(x, dim).full_tensor()
        want = torch.nansum(full, dim)
        assert torch.allclose(got, want, rtol=0, atol=TOL), (dim, got, want)
    return True


def test_nansum_with_dim(dist):
    # Regression test (bug found in review, now fixed): aten.nansum.default is nansum(self, dim=None, keepdim=False, *, dtype=None) but sum_mean
    # treats it like sum.default (args[1] = dtype): torch.nansum(x, 0) raises
    # TypeError "nansum(): argument 'dtype' must be torch.dtype, not list" (any dim, sharded or not).
    assert all(dist.run(2, _nansum_dim))


def _layer_norm_fallback():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 3, 6), [Shard(1)], {0: (2, 4)})   # normalising over the sharded dim
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with df.fallback("gather"):
            check_sharded(lambda a: F.layer_norm(a, (6,)) * 2, [x], mesh)
    return True


def test_layer_norm_over_sharded_dim_with_gather_fallback(dist):
    # Regression test (bug found in review, now fixed): forward goes through the gather fallback, but the native_layer_norm_backward handler has
    # no "normalised dim is sharded" guard: it runs the op on local chunks ([3, 2] with
    # normalized_shape [6]) and narrows mean/rstd [3, 1] by the dim-1 sizes -> RuntimeError.
    assert all(dist.run(2, _layer_norm_fallback))


def _inplace_metadata_ops():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.arange(6.0, dtype=D).reshape(3, 2)
    problems = []
    r = df.distribute_tensor(full.unsqueeze(1), mesh, [Replicate()])   # (3, 1, 2), replicated
    r.squeeze_(1)
    if tuple(r.shape) != (3, 2) or tuple(r.to_local().shape) != (3, 2):
        problems.append(f"squeeze_: wrapper {tuple(r.shape)}, local {tuple(r.to_local().shape)}, expected (3, 2)")
    q = torch.quantile(df.distribute_tensor(full, mesh, [Replicate()]), 0.3, dim=0)
    if tuple(q.shape) != (2,):
        problems.append(f"quantile(dim=0) on a replicated ShardTensor: shape {tuple(q.shape)}, expected (2,)")
    assert not problems, "\n".join(problems)
    return True


def test_inplace_view_ops_update_the_wrapper_shape(dist):
    # Regression test (bug found in review, now fixed).
    # Was: in-place metadata ops (squeeze_, unsqueeze_, t_, ...) on ShardTensors go to _generic ->
    # run_replicated, which mutates the local tensor and returns args[0] unchanged: the wrapper keeps
    # the old global shape (3, 1, 2) while the local is (3, 2). torch.quantile (which ends in
    # squeeze_) silently returns shape (2, 1) instead of (2,), also under fallback('gather').
    assert all(dist.run(2, _inplace_metadata_ops))


def _fill_tensor_on_unsharded_select():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 3), [Shard(0)], {0: (1, 4)})

    def fn(a):
        z = a * 1.0
        z[:, 1] = 0.5          # __setitem__ with a Python scalar: aten.fill_.Tensor on a local view
        return z

    check_sharded(fn, [x], mesh)
    return True


def test_setitem_scalar_on_unsharded_dim(dist):
    # Regression test (bug found in review, now fixed).
    # Was: (missing rule) z[:, 1] = 0.5 touches no sharded dim, yet aten.fill_.Tensor (what
    # __setitem__ emits) has no handler and is not tagged pointwise, so it raises
    # UnsupportedShardedOp; fill_.Scalar is registered but fill_.Tensor is not.
    assert all(dist.run(2, _fill_tensor_on_unsharded_select))


def _cumprod_fallback():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 3), [Shard(0)], {0: (2, 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with df.fallback("gather"):
            check_sharded(lambda a: torch.cumprod(a, 0), [x], mesh)
    return True


def test_cumprod_backward_with_gather_fallback(dist):
    # Regression test (bug found in review, now fixed): under fallback('gather') the forward works, but cumprod's backward uses the
    # in-place aten.scatter_.value, which gather_fallback refuses for every in-place op, so
    # backward raises UnsupportedShardedOp even though the user opted in to the fallback.
    assert all(dist.run(2, _cumprod_fallback))


def _inplace_on_view_with_grad():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 3), [Shard(0)], {0: (2, 4)})

    def fn(a):
        z = a * 1.0
        z[1:4].mul_(3.0)        # in-place on a (local) view of a tensor that needs grad
        return z

    check_sharded(fn, [x], mesh)
    return True


def test_inplace_on_view_of_sharded_tensor_backward(dist):
    # Regression test (bug found in review, now fixed).
    # Was: autograd's CopySlices backward does result = grad.new_empty_strided(base sizes) and then
    # result.copy_(grad). new_empty_strided gives a *replicated* ShardTensor (new_factory), and
    # copy_ into a replicated dst from a sharded src is refused by the pointwise planner, so any
    # in-place op on a view of a sharded tensor that requires grad fails in backward.
    assert all(dist.run(2, _inplace_on_view_with_grad))


def _more_grad_layouts():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 6), [Shard(0)], {0: (2, 3)})
    w = Sharded(_t(gen, 5, 6), [Shard(1)], {0: (4, 2)})
    check_sharded(lambda a, ww: ww * torch.cumsum(a, 1), [x, w], mesh)
    return True


def test_cumsum_backward_with_gradient_sharded_on_cumsum_dim(dist):
    # Regression test (bug found in review, now fixed).
    # Was: same class as the softmax case: cumsum over the unsharded dim 1 is legal, but its
    # gradient comes back sharded on dim 1 (w's layout) and the backward (flip/cumsum along dim 1)
    # raises UnsupportedShardedOp.
    assert all(dist.run(2, _more_grad_layouts))


def _index_ops_backward(which):
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 4), [Shard(0)], {0: (2, 3)})
    idx = torch.tensor([[3, 0], [1, 1], [0, 2], [3, 3], [2, 1]])
    sel = torch.tensor([3, 0, 0])
    fns = {
        "gather": lambda a: torch.gather(a, 1, idx) * 2,
        "index_select": lambda a: torch.index_select(a, 1, sel) * 2,
    }
    check_sharded(fns[which], [x], mesh)
    return True


@pytest.mark.parametrize("which", ["gather", "index_select"])
def test_index_ops_along_unsharded_dim_backward(dist, which):
    # Regression test (bug found in review, now fixed): the forward has a handler
    # (index_along_unsharded_dim), but index_select's backward does
    # grad.new_zeros(input sizes).index_add_(dim, index, grad): new_zeros is replicated and the
    # in-place index_add_ has no rule -> UnsupportedShardedOp in backward.
    assert all(dist.run(2, _index_ops_backward, which))


def _nan_extremes():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.tensor([[1.0, 2.0], [3.0, 4.0], [float("nan"), 0.5], [0.0, float("nan")]], dtype=D)
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (2, 2)})  # NaNs on rank 1
    y = df.distribute_tensor(full.flip(0), mesh, [Shard(0)], sharding_shapes={0: (2, 2)})  # NaNs on rank 0
    problems = []
    for name, fn in {"amax0": lambda a: a.amax(0), "amin0": lambda a: a.amin(0), "max": lambda a: a.max(),
                     "min": lambda a: a.min(),
                     "norm_inf": lambda a: torch.linalg.vector_norm(a, float("inf"), 0)}.items():
        for tname, t, f in (("nan_on_rank1", x, full), ("nan_on_rank0", y, full.flip(0))):
            got, want = fn(t).full_tensor(), fn(f)
            if not torch.equal(got.isnan(), want.isnan()):
                problems.append(f"{name} {tname}: {got.tolist()} expected {want.tolist()}")
    assert not problems, "\n".join(problems)
    return True


def test_nan_propagates_through_sharded_max_min(dist):
    # Regression test (bug found in review, now fixed): Partial(max/min) values are reduced with dist.all_reduce(MAX/MIN); Gloo's
    # max/min (std::max-style) drop a NaN that arrives from another rank, so x.amax(0), x.max(),
    # x.min(), vector_norm(inf) return finite numbers when the NaN sits on rank 1 (torch: NaN).
    # A diverged loss/field can go unnoticed. (max(dim)/argmax gather candidates and are fine.)
    assert all(dist.run(2, _nan_extremes))


def _losses_zero_shards(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(_t(gen, n, 4), [Shard(0)], {0: sizes})
        y = Sharded(_t(gen, n, 4), [Shard(0)], {0: random_sizes(n, world, rng)}, requires_grad=False)
        labels = torch.randint(0, 4, (n,), generator=gen)
        fns = {
            "mse": lambda a, b: F.mse_loss(a, b),
            "l1_sum": lambda a, b: F.l1_loss(a, b, reduction="sum"),
            "huber": lambda a, b: F.huber_loss(a, b, delta=0.3),
            "bce_logits_pw": lambda a, b: F.binary_cross_entropy_with_logits(
                a, torch.sigmoid(b), pos_weight=torch.linspace(0.5, 2, 4, dtype=D)),
            "normalize0": lambda a, b: F.normalize(a, dim=0) * b,
            "cosine0": lambda a, b: F.cosine_similarity(a, b, dim=0),
            "cosine1": lambda a, b: F.cosine_similarity(a, b, dim=1),
            "relative_l2": lambda a, b: torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b),
        }
        for name, fn in fns.items():
            _run(fn, [x, y], mesh, f"{name} {sizes}", failures)
        # cross entropy: either exact or a clear UnsupportedShardedOp, never wrong
        st = df.distribute_tensor(x.full, mesh, [Shard(0)], sharding_shapes={0: sizes})
        lab = df.distribute_tensor(labels, mesh, [Shard(0)], sharding_shapes={0: sizes})
        try:
            ce = F.cross_entropy(st, lab)
        except df.UnsupportedShardedOp:
            pass
        except Exception as e:  # noqa: BLE001
            failures.append(f"cross_entropy {sizes}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        else:
            want = F.cross_entropy(x.full, labels)
            if abs(ce.full_tensor().item() - want.item()) > TOL:
                failures.append(f"cross_entropy {sizes}: {ce.full_tensor().item()} vs {want.item()}")
    return _ok(failures)


@pytest.mark.parametrize("world", (3,))
def test_losses_with_zero_shards(dist, world):
    assert all(dist.run(world, _losses_zero_shards, 900 + world))


def _ties_and_avg(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 7
    full = torch.randint(-2, 3, (n, 3), generator=gen).to(D)   # many ties, across ranks too
    for sizes in _zero_layouts(n, world, rng):
        x = Sharded(full, [Shard(0)], {0: sizes})
        for name, fn in {
            "amax_ties": lambda a: a.amax(0) * 3,
            "max_all_ties": lambda a: a.max() * 2,
            "min_all_ties": lambda a: a.min() * 2,
            "max_dim_ties": lambda a: a.max(0),
            "argmin_dim_ties": lambda a: a.argmin(0),
            "argmax_flat_ties": lambda a: a.argmax(),
            "norm_inf_ties": lambda a: torch.linalg.vector_norm(a, float("inf"), dim=0),
        }.items():
            _run(fn, [x], mesh, f"{name} {sizes}", failures)
    # Partial("avg") values: linear ops stay pending, anything else reduces first
    base = _t(gen, 4, 3)
    st = df.distribute_tensor(base, mesh, [Partial("avg")])
    got = ((st * 2 - st / 4) + st).full_tensor()
    if not torch.allclose(got, base * 2.75, atol=TOL, rtol=0):
        failures.append(f"partial avg linear: {got} vs {base * 2.75}")
    got = (st.exp() + 1).sum().full_tensor()
    if abs(got.item() - (base.exp() + 1).sum().item()) > 1e-9:
        failures.append("partial avg exp/sum")
    if abs(st.sum().item() - base.sum().item()) > TOL:
        failures.append("partial avg sum")
    return _ok(failures)


@pytest.mark.parametrize("world", (3,))
def test_ties_and_partial_avg(dist, world):
    """Ties within and across ranks (gradients split exactly as torch does); Partial('avg')."""
    assert all(dist.run(world, _ties_and_avg, 1000 + world))


def _dtypes():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(5)
    base = _t(gen, 7, 4)
    sizes = (0, 5, 2)[:world] if world == 3 else (1, 6)
    other = (4, 0, 3) if world == 3 else (5, 2)
    problems = []
    for dtype in (torch.bool, torch.int64, torch.int32, torch.uint8, torch.float16, torch.bfloat16, torch.complex128):
        full = (base > 0) if dtype == torch.bool else (base * 10).to(dtype) if not dtype.is_complex else \
            torch.complex(base, base.flip(0)).to(dtype)
        st = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
        steps = {
            "full_tensor": lambda: st.full_tensor(),
            "reshard_sizes": lambda: st.redistribute([Shard(0)], {0: other}).full_tensor(),
            "to_shard1": lambda: st.redistribute([Shard(1)]).full_tensor(),
            "select_owned": lambda: st[5].full_tensor(),
        }
        for name, fn in steps.items():
            want = full if name != "select_owned" else full[5]
            try:
                got = fn()
            except Exception as e:  # noqa: BLE001
                problems.append(f"{dtype} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            if got.dtype != want.dtype or not torch.equal(got, want):
                problems.append(f"{dtype} {name}: wrong result")
    # a bool mask laid out differently from the tensor it selects in
    x = df.distribute_tensor(base, mesh, [Shard(0)], sharding_shapes={0: sizes})
    m = df.distribute_tensor(base > 0.2, mesh, [Shard(0)], sharding_shapes={0: other})
    try:
        got = torch.where(m, x, -x).full_tensor()
        if not torch.equal(got, torch.where(base > 0.2, base, -base)):
            problems.append("where with misaligned bool mask: wrong result")
    except Exception as e:  # noqa: BLE001
        problems.append(f"where with misaligned bool mask: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    assert not problems, "\n".join(problems)
    return True


@pytest.mark.parametrize("world", (2, 3))
def test_collectives_for_every_dtype(dist, world):
    assert all(dist.run(world, _dtypes))


def _axis_kwarg():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 3), [Shard(0)], {0: (2, 4)})
    check_sharded(lambda a: a.sum(axis=0) + torch.mean(a, axis=0), [x], mesh)
    return True


def test_sum_mean_with_numpy_axis_keyword(dist):
    # Regression test (bug found in review, now fixed).
    # Was: (silently wrong) with a ShardTensor that requires grad, x.sum(axis=0) / torch.mean(x, axis=0)
    # reach _sum_mean_function (__torch_function__) with kwargs {"axis": 0}; it only looks for
    # "dim", so it reduces over *all* dims and returns a scalar instead of shape (3,).
    assert all(dist.run(2, _axis_kwarg))


def _input_kwarg():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 3), [Shard(0)], {0: (2, 4)})
    w = _t(gen, 2, 3)
    check_sharded(lambda a: torch.sum(input=a, dim=0) + torch.prod(input=a * 0.1 + 1, dim=0), [x], mesh)
    check_sharded(lambda a: F.linear(input=a, weight=w), [x], mesh)
    return True


def test_functions_called_with_input_keyword(dist):
    # Regression test (bug found in review, now fixed).
    # Was: the __torch_function__ handlers (_sum_mean_function, _prod_function, _linear_function)
    # read args[0]; torch.sum(input=x, dim=0), torch.prod(input=x, dim=0), F.linear(input=x, weight=w)
    # pass everything as kwargs -> IndexError: tuple index out of range.
    assert all(dist.run(2, _input_kwarg))


def _inplace_on_partial_loss():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 6, 3), [Shard(0)], {0: (2, 4)})
    y = _t(gen, 6, 3)
    w = _t(gen, 3)

    def fn(a):
        loss = F.mse_loss(a, y)            # a pending Partial(sum) scalar
        loss += 0.5 * (w ** 2).sum()       # the usual "add a regulariser" idiom, in place
        return loss

    check_sharded(fn, [x], mesh)
    return True


def test_inplace_add_on_partial_loss(dist):
    # Regression test (bug found in review, now fixed).
    # Was: `loss += reg` on a Partial(sum) loss raises UnsupportedShardedOp ("the first operand of an
    # in-place op would have to change layout"). The planner may not keep the Partial (a replicated
    # term must be added once), but it could reduce the Partial in place (all-reduce the local, set
    # the spec to Replicate) instead of refusing. Same root cause as test_vector_norm_of_partial_backward.
    assert all(dist.run(2, _inplace_on_partial_loss))


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 8)
        self.n = torch.nn.LayerNorm(8)
        self.b = torch.nn.Linear(8, 1)
        self.s = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.b(F.gelu(self.n(self.a(x)))) * self.s


def _direct_backward(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 9
    full = _t(gen, n, 3)
    target = _t(gen, n, 1)
    for sizes in _zero_layouts(n, world, rng):
        torch.manual_seed(0)
        ref = _MLP().double()
        model = _MLP().double()
        model.load_state_dict(ref.state_dict())
        xr = full.clone().requires_grad_()
        ref_loss = F.mse_loss(ref(xr), target) + 0.1 * ref(xr).abs().mean()
        ref_loss.backward()
        leaf = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes}).to_local().clone()
        leaf.requires_grad_()
        x = ShardTensor.from_local(leaf, mesh, [Shard(0)], sharding_shapes={0: sizes})
        t = df.distribute_tensor(target, mesh, [Shard(0)], sharding_shapes={0: sizes})
        loss = F.mse_loss(model(x), t) + 0.1 * model(x).abs().mean()
        loss.backward()                       # directly on the ShardTensor loss, as the README does
        if abs(loss.item() - ref_loss.item()) > TOL:
            failures.append(f"{sizes}: loss {loss.item()} vs {ref_loss.item()}")
        for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            if type(p.grad) is not torch.Tensor:
                failures.append(f"{sizes}: {name}.grad is {type(p.grad).__name__}")
            elif not torch.allclose(p.grad, rp.grad, rtol=0, atol=TOL):
                failures.append(f"{sizes}: {name}.grad off by {(p.grad - rp.grad).abs().max().item():.3e}")
        off = sum(sizes[:mesh.get_coordinate()[0]])
        if leaf.grad is None or not torch.allclose(leaf.grad, xr.grad[off:off + leaf.shape[0]], rtol=0, atol=TOL):
            failures.append(f"{sizes}: input grad wrong")
    return _ok(failures)


@pytest.mark.parametrize("world", (3,))
def test_direct_backward_on_sharded_loss(dist, world):
    """loss.backward() on the ShardTensor loss itself (not via full_tensor), parameters used twice."""
    assert all(dist.run(world, _direct_backward, 1100 + world))


def _attention_and_conv():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(0)
    sizes = (0, 5, 2) if world == 3 else (5, 2)
    q, k, v = _t(gen, 2, 7, 4), _t(gen, 2, 7, 4), _t(gen, 2, 7, 4)
    conv_w = _t(gen, 3, 4, 3)
    cases = {
        "sdpa_q_sharded": (lambda a, kk, vv: F.scaled_dot_product_attention(a, kk, vv), [1, None, None]),
        "sdpa_all_sharded": (lambda a, kk, vv: F.scaled_dot_product_attention(a, kk, vv), [1, 1, 1]),
        "manual_attention_kv_sharded": (lambda a, kk, vv: torch.softmax(a @ kk.transpose(1, 2), -1) @ vv, [None, 1, 1]),
        "conv1d_len_sharded": (lambda a, kk, vv: F.conv1d(a.transpose(1, 2), conv_w, padding=1), [1, None, None]),
        "conv1d_batch_sharded": (lambda a, kk, vv: F.conv1d(a.transpose(1, 2), conv_w, padding=1), [0, None, None]),
    }
    problems = []
    for name, (fn, dims) in cases.items():
        want = fn(q, k, v)
        ins = []
        for t, d in zip((q, k, v), dims):
            if d is None:
                ins.append(df.distribute_tensor(t, mesh, [Replicate()]))
            else:
                ins.append(df.distribute_tensor(t, mesh, [Shard(d)], sharding_shapes={0: sizes if d == 1 else
                                                                                       (2,) + (0,) * (world - 1)}))
        try:
            got = fn(*ins)
        except df.UnsupportedShardedOp:
            continue
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        g = got.full_tensor()
        if g.shape != want.shape or not torch.allclose(g, want, rtol=1e-10, atol=1e-10):
            err = (g - want).abs().max().item() if g.shape == want.shape else "shape"
            problems.append(f"{name}: silently wrong (max err {err})")
    assert not problems, "\n".join(problems)
    return True


@pytest.mark.parametrize("world", (2, 3))
def test_attention_and_conv_are_exact_or_refused(dist, world):
    assert all(dist.run(world, _attention_and_conv))


def _empty_global_and_norms():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(0)
    failures = []
    e = Sharded(_t(gen, 0, 3), [Shard(0)], {0: (0,) * world})
    plain = _t(gen, 0, 3)
    for name, fn in {
        "sum0": lambda a: a.sum(0),
        "mul": lambda a: a * 2 + 1,
        "reshape": lambda a: a.reshape(0, 3, 1),
        "cat_nonempty": lambda a: torch.cat([a, torch.ones(2, 3, dtype=D)], 0),
        "layernorm": lambda a: F.layer_norm(a, (3,)),
        "mse": lambda a: F.mse_loss(a, plain, reduction="sum"),
    }.items():
        _run(fn, [e], mesh, f"empty_{name}", failures)
    x = Sharded(_t(gen, 5, 4), [Shard(0)], {0: (0,) * (world - 1) + (5,)})
    w = _t(gen, 4)
    _run(lambda a: F.rms_norm(a, (4,), w, 1e-6), [x], mesh, "rms_norm", failures)
    return _ok(failures)


def test_empty_global_tensor_and_other_norms(dist):
    assert all(dist.run(3, _empty_global_and_norms))


def _mean_of_empty():
    mesh = get_mesh((rank_and_world()[1],))
    e = Sharded(torch.zeros(0, 3, dtype=D), [Shard(0)], {0: (0, 0)})
    check_sharded(lambda a: a.mean(0), [e], mesh)   # torch: [nan, nan, nan]
    return True


def test_mean_over_empty_sharded_dim(dist):
    # Regression test (bug found in review, now fixed): _SumMean.forward computes ctx.scale = 1.0 / 0 in Python for a reduction over an
    # empty dim -> ZeroDivisionError, where torch returns NaN (the no-grad aten path does return NaN).
    assert all(dist.run(2, _mean_of_empty))
