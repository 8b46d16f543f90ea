"""The dispatch engine on real process groups: every op checked against the full computation in one
process (float64, 1e-10) with check_sharded: outputs, input gradients, parameter gradients, layout."""

from __future__ import annotations

import random
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import domainflow as df
from dist_pool import WORLD_SIZES, rank_and_world
from domainflow import Partial, Replicate, Shard, ShardTensor
from sharded_check import Sharded, check_sharded, get_mesh, mesh_shapes, random_sizes

CASES = [(w, ms) for w in WORLD_SIZES for ms in mesh_shapes(w)]
IDS = [f"ws{w}-mesh{'x'.join(map(str, ms))}" for w, ms in CASES]
D = torch.float64


def _t(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=D)


def _layout_rows(mesh_shape, rng, shape):
    """Shard dim 0 over mesh dim 0 (uneven), and dim 1 over mesh dim 1 when the mesh is 2-D."""
    placements = [Shard(0)]
    sizes = {0: random_sizes(shape[0], mesh_shape[0], rng)}
    if len(mesh_shape) > 1:
        placements.append(Shard(1))
        sizes[1] = random_sizes(shape[1], mesh_shape[1], rng)
    return placements, sizes


# -------------------------------------------------------------------------------------------------
def _pointwise(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(3):
        shape = (rng.randint(1, 9), rng.randint(1, 6), 3)
        pl, sz = _layout_rows(mesh_shape, rng, shape)
        x = Sharded(_t(gen, *shape), pl, sz)
        y_same = Sharded(_t(gen, *shape), pl, sz)
        y_rep = Sharded(_t(gen, *shape), [Replicate()] * len(mesh_shape))
        y_row = _t(gen, 3)  # plain tensor broadcast along the trailing dim
        y_col = _t(gen, shape[0], 1, 1)  # plain, full along the sharded dim: sliced locally
        c = _t(gen, 1, shape[1], 1)
        check_sharded(lambda a, b: torch.sin(a) * b + 2.5 - a / (1 + b * b), [x, y_same], mesh,
                      expect_placements=pl, expect_sizes=sz)
        check_sharded(lambda a, b: torch.tanh(a) * b, [x, y_rep], mesh, expect_placements=pl, expect_sizes=sz)
        check_sharded(lambda a, r, col, cc: F.gelu(a * r) + col * a - cc, [x, y_row, y_col, c], mesh,
                      expect_placements=pl, expect_sizes=sz)
        check_sharded(lambda a, b: torch.where(a > 0, a, b).clamp(-0.5, 0.7) ** 2, [x, y_same], mesh)
        # broadcasting a sharded operand against a bigger one adds leading dims
        check_sharded(lambda a, b: a + b, [x, Sharded(_t(gen, 2, *shape), [Replicate()] * len(mesh_shape))], mesh,
                      expect_placements=[Shard(p.dim + 1) for p in pl], expect_sizes=sz)

        def inplace(a, b):
            z = a * 1.0
            z.mul_(b).add_(b, alpha=2.0)
            z.clamp_(min=-1.0)
            return z

        check_sharded(inplace, [x, y_same], mesh, expect_placements=pl, expect_sizes=sz)
        check_sharded(inplace, [x, y_rep], mesh, expect_placements=pl, expect_sizes=sz)
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_pointwise_and_broadcasting(dist, world, mesh_shape):
    """Pointwise ops with sharded, replicated, plain-tensor and scalar operands run locally and
    keep the first operand's uneven layout; in-place variants too."""
    assert all(dist.run(world, _pointwise, mesh_shape, 10 + world))


# -------------------------------------------------------------------------------------------------
def _misaligned(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shape = (7, 5)
    n = mesh_shape[0]
    a_sizes, b_sizes = random_sizes(7, n, rng), random_sizes(7, n, rng)
    rest = [Replicate()] * (len(mesh_shape) - 1)
    x = Sharded(_t(gen, *shape), [Shard(0)] + rest, {0: a_sizes})
    y = Sharded(_t(gen, *shape), [Shard(0)] + rest, {0: b_sizes})
    z = Sharded(_t(gen, *shape), [Shard(1)] + rest, {0: random_sizes(5, n, rng)})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        check_sharded(lambda a, b: a * b + a, [x, y], mesh, expect_placements=[Shard(0)] + rest,
                      expect_sizes={0: a_sizes})
        check_sharded(lambda a, b: a - b, [x, z], mesh, expect_placements=[Shard(0)] + rest,
                      expect_sizes={0: a_sizes})
    moved = [str(m.message) for m in w if "laid out differently" in str(m.message)]
    if n > 1 and a_sizes != b_sizes:
        assert moved, "a misaligned operand must be resharded visibly (warning), never combined silently"
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_misaligned_operands_are_resharded(dist, world, mesh_shape):
    """Same placement, different sharding sizes (PhysicsNeMo #1943) or different sharded dims: the
    second operand is resharded to the first's layout, with a warning; results equal one process."""
    assert all(dist.run(world, _misaligned, mesh_shape, 20 + world))


# -------------------------------------------------------------------------------------------------
def _reductions(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shape = (rng.randint(2, 9), rng.randint(1, 5), 3)
    pl, sz = _layout_rows(mesh_shape, rng, shape)
    x = Sharded(_t(gen, *shape), pl, sz)
    fns = {
        "sum_all": lambda a: a.sum(),
        "sum0": lambda a: a.sum(0),
        "sum_keep": lambda a: a.sum((0, 2), keepdim=True),
        "sum_unsharded": lambda a: torch.sum(a, -1),
        "mean_all": lambda a: a.mean(),
        "mean01": lambda a: torch.mean(a, (0, 1)),
        "amax0": lambda a: a.amax(0),
        "amin_all": lambda a: a.amin(),
        "max_all": lambda a: a.max(),
        "min_all": lambda a: a.min(),
        "max_dim0": lambda a: a.max(0),
        "min_dim0_keep": lambda a: a.min(0, keepdim=True),
        "max_dim2": lambda a: a.max(2),
        "argmax0": lambda a: a.argmax(0),
        "argmin_flat": lambda a: a.argmin(),
        "prod0": lambda a: (a * 0.3 + 1).prod(0),
        "prod_all": lambda a: (a * 0.1 + 1).prod(),
        "var0": lambda a: a.var(0),
        "std_all": lambda a: a.std(),
        "norm": lambda a: torch.linalg.vector_norm(a),
        "norm3": lambda a: torch.linalg.vector_norm(a, 3, dim=0),
        "norm_inf": lambda a: torch.linalg.vector_norm(a, float("inf")),
        "mse": lambda a: ((a - 0.5) ** 2).mean(),
        "relative_l2": lambda a: torch.linalg.vector_norm(a - 1) / torch.linalg.vector_norm(a),
        "sqrt_of_sum": lambda a: (a * a).sum(0).sqrt(),
        "partial_plus_partial": lambda a: a.sum(0) * 2 + a.mean(0),
        "any_all": lambda a: torch.stack([(a > 1).any(), (a > -5).all()]).to(D),
    }
    for name, fn in fns.items():
        try:
            check_sharded(fn, [x], mesh)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    # a global scalar reads the same on every rank
    st = df.distribute_tensor(x.full, mesh, pl, sharding_shapes=sz)
    assert abs(st.sum().item() - x.full.sum().item()) < 1e-10
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_reductions(dist, world, mesh_shape):
    """sum/mean/max/min/prod/var/norm/any over sharded dims, unsharded dims and all dims: Partial
    results reduced to the global answer; gradients equal one process."""
    assert all(dist.run(world, _reductions, mesh_shape, 30 + world))


def _partial_stays_pending():
    mesh = get_mesh((rank_and_world()[1],))
    from domainflow import comm

    x = df.distribute_tensor(torch.arange(12.0, dtype=D).reshape(6, 2), mesh, [Shard(0)])
    comm.stats.reset()
    s = x.sum(0) * 3 + x.mean(0)  # linear in the partial sums: still Partial, no communication yet
    assert s.placements == (Partial("sum"),)
    assert sum(comm.stats.calls.values()) == 0
    assert torch.allclose(s.full_tensor(), torch.arange(12.0, dtype=D).reshape(6, 2).sum(0) * (3 + 1 / 6))
    assert comm.stats.calls["all_reduce"] == (1 if mesh.shape[0] > 1 else 0)
    return True


def test_partial_results_stay_pending_until_needed(dist):
    assert all(dist.run(3, _partial_stays_pending))


# -------------------------------------------------------------------------------------------------
def _views(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n0 = mesh_shape[0]
    rest = [Replicate()] * (len(mesh_shape) - 1)
    a_sizes = random_sizes(6, n0, rng)
    x = Sharded(_t(gen, 6, 4, 3), [Shard(0)] + rest, {0: a_sizes})
    cases = [
        ("flatten_inner", lambda a: a.reshape(6, 12), [Shard(0)], {0: a_sizes}),
        ("flatten_outer", lambda a: a.flatten(0, 1), [Shard(0)], {0: tuple(4 * s for s in a_sizes)}),
        ("view_minus1", lambda a: a.view(-1, 3).view(6, 4, 3), [Shard(0)], {0: a_sizes}),
        ("unsqueeze", lambda a: a.unsqueeze(0).unsqueeze(-1), [Shard(1)], {0: a_sizes}),
        ("squeeze", lambda a: a.unsqueeze(1).squeeze(1), [Shard(0)], {0: a_sizes}),
        ("permute", lambda a: a.permute(2, 0, 1), [Shard(1)], {0: a_sizes}),
        ("transpose", lambda a: a.transpose(0, 2), [Shard(2)], {0: a_sizes}),
        ("movedim", lambda a: torch.movedim(a, 0, -1), [Shard(2)], {0: a_sizes}),
        ("expand", lambda a: a.unsqueeze(1).expand(6, 2, 4, 3), [Shard(0)], {0: a_sizes}),
        ("slice_unsharded", lambda a: a[:, 1:3], [Shard(0)], {0: a_sizes}),
        ("slice_sharded", lambda a: a[1:5], None, None),
        ("slice_step", lambda a: a[::2], None, None),
        ("slice_step3", lambda a: a[1::3], None, None),
        ("narrow", lambda a: a.narrow(0, 2, 3), None, None),
        ("select_unsharded", lambda a: a[:, 2], [Shard(0)], {0: a_sizes}),
        ("select_sharded", lambda a: a[4], [Replicate()], None),
        ("split_sharded", lambda a: a.split([2, 4], 0), None, None),
        ("split_unsharded", lambda a: a.split(2, 1), [Shard(0)], {0: a_sizes}),
        ("unbind_unsharded", lambda a: a.unbind(2), [Shard(0)], {0: a_sizes}),
        ("cat_unsharded", lambda a: torch.cat([a, a * 2], 1), [Shard(0)], {0: a_sizes}),
        ("stack", lambda a: torch.stack([a, a + 1], -1), [Shard(0)], {0: a_sizes}),
        ("t_2d", lambda a: a[:, :, 0].t(), [Shard(1)], {0: a_sizes}),
    ]
    for name, fn, pl, sz in cases:
        try:
            check_sharded(fn, [x], mesh, expect_placements=None if pl is None else pl + rest, expect_sizes=sz)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    # slicing a sharded dim keeps each rank's part, no communication: sizes follow arithmetically
    st = df.distribute_tensor(x.full, mesh, [Shard(0)] + rest, sharding_shapes={0: a_sizes})
    from domainflow import comm
    from domainflow.layout import shapes

    comm.stats.reset()
    y = st[1::2]
    assert sum(comm.stats.calls.values()) == 0
    assert y._spec.sizes[0] == shapes.slice_sizes(a_sizes, 1, 6, 2)[0]
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_views_and_indexing(dist, world, mesh_shape):
    """Views that keep or move the sharded dim, slicing along it (uneven result, no communication),
    select, split, cat/stack: values, gradients and layouts."""
    assert all(dist.run(world, _views, mesh_shape, 40 + world))


def test_view_that_splits_rows_reshards_or_is_refused(dist):
    """A reshape whose shards would straddle groups moves them to the nearest compatible layout (with a
    warning); when no layout works it is refused with a message naming the op and the sharded dim."""
    results = dist.run(4, _relayout_view_4)
    for warned, msg in results:
        assert warned
        assert msg is not None and "aten.view" in msg and "sharded dim 1" in msg and "fallback" in msg


def _relayout_view_4():
    rank, world = rank_and_world()
    mesh = get_mesh((4,))
    full = torch.arange(24.0, dtype=D).reshape(4, 6)
    x = df.distribute_tensor(full, mesh, [Shard(1)], sharding_shapes={0: (1, 2, 0, 3)})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = x.reshape(24)  # dim 1 is the inner dim of the merge: its rows would interleave
    assert torch.equal(y.full_tensor(), full.reshape(24))
    assert y.placements == (Shard(0),)
    warned = any("re-sharded" in str(m.message) for m in w)
    mesh2 = get_mesh((2, 2), ("a", "b"))
    z = df.distribute_tensor(full, mesh2, [Shard(0), Shard(1)], sharding_shapes={0: (1, 3), 1: (2, 4)})
    try:
        z.reshape(24)  # both dims sharded: no layout keeps whole rows
    except df.UnsupportedShardedOp as e:
        return warned, str(e)
    return warned, None


# -------------------------------------------------------------------------------------------------
class PointMLP(torch.nn.Module):
    """A per-point network on a point cloud [N, C]: the kind of model that is domain parallel for free."""

    def __init__(self, c_in=3, hidden=8, c_out=2):
        super().__init__()
        self.inp = torch.nn.Linear(c_in, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.out = torch.nn.Linear(hidden, c_out)
        self.scale = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = F.gelu(self.norm(self.inp(x)))
        return self.out(h) * self.scale + torch.softmax(h, -1)[:, :2]


def _param_grads(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    torch.manual_seed(0)
    model = PointMLP().double()
    n = rng.randint(3, 17)
    rest = [Replicate()] * (len(mesh_shape) - 1)
    x = Sharded(_t(torch.Generator().manual_seed(seed), n, 3), [Shard(0)] + rest,
                {0: random_sizes(n, mesh_shape[0], rng)})
    check_sharded(lambda a, m: m(a), [x], mesh, module=model, expect_placements=[Shard(0)] + rest)
    # a loss that is a global mean: gradients of the replicated parameters summed exactly once
    check_sharded(lambda a, m: ((m(a) - 1) ** 2).mean(), [x], mesh, module=model)
    return True


def _submesh_param_grads():
    """A ("dp", "domain") mesh: each dp group shards its own sample over its "domain" sub-mesh."""
    mesh = get_mesh((2, 2), ("dp", "domain"))
    sub = mesh["domain"]
    dp = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = PointMLP().double()
    n = 9 + dp  # the two dp groups hold different samples
    x = Sharded(_t(torch.Generator().manual_seed(dp), n, 3), [Shard(0)], {0: (n - 2, 2)})
    check_sharded(lambda a, m: ((m(a) - 1) ** 2).mean(), [x], sub, module=model)
    return True


def test_parameter_gradients_on_a_domain_submesh(dist):
    assert all(dist.run(4, _submesh_param_grads))


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_parameter_gradients_equal_single_device(dist, world, mesh_shape):
    """Plain nn.Parameters used with ShardTensors: .grad is a plain tensor equal to the single-device
    gradient (partial sums reduced exactly once; PhysicsNeMo #1944)."""
    assert all(dist.run(world, _param_grads, mesh_shape, 50 + world))


def _matmul(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n0 = mesh_shape[0]
    rest = [Replicate()] * (len(mesh_shape) - 1)
    sa, sb = random_sizes(7, n0, rng), random_sizes(5, n0, rng)
    a_rows = Sharded(_t(gen, 7, 5), [Shard(0)] + rest, {0: sa})
    a_cols = Sharded(_t(gen, 7, 5), [Shard(1)] + rest, {0: sb})
    b_rows = Sharded(_t(gen, 5, 4), [Shard(0)] + rest, {0: sb})
    b_rep = Sharded(_t(gen, 5, 4), [Replicate()] * len(mesh_shape))
    w = _t(gen, 5, 4)
    check_sharded(lambda a, b: a @ b, [a_rows, b_rep], mesh, expect_placements=[Shard(0)] + rest, expect_sizes={0: sa})
    check_sharded(lambda a, b: a @ b, [a_cols, b_rows], mesh, expect_placements=[Partial("sum")] + rest)
    check_sharded(lambda a, b: (a @ b).relu(), [a_cols, b_rep], mesh)
    check_sharded(lambda a, b: torch.addmm(torch.ones(4, dtype=D), a, b, beta=0.5, alpha=2.0), [a_cols, b_rows], mesh)
    check_sharded(lambda a, ww: a @ ww, [a_rows, w], mesh)
    check_sharded(lambda a: a.t() @ a, [a_rows], mesh, expect_placements=[Partial("sum")] + rest)
    # nn.Linear on [B, N, C] with the point dim N sharded (torch folds B and N, which a shard cannot survive)
    lin = torch.nn.Linear(5, 3).double()
    nsz = random_sizes(7, n0, rng)
    xb3 = Sharded(_t(gen, 2, 7, 5), [Shard(1)] + rest, {0: nsz})
    check_sharded(lambda a, m: torch.tanh(m(a)), [xb3], mesh, module=lin, expect_placements=[Shard(1)] + rest,
                  expect_sizes={0: nsz})
    check_sharded(lambda a, m: m(a).pow(2).mean(), [a_rows], mesh, module=torch.nn.Linear(5, 2).double())
    bsz = random_sizes(3, n0, rng)
    xb = Sharded(_t(gen, 3, 4, 5), [Shard(0)] + rest, {0: bsz})
    yb = Sharded(_t(gen, 3, 5, 2), [Replicate()] * len(mesh_shape))
    check_sharded(lambda a, b: torch.bmm(a, b), [xb, yb], mesh, expect_placements=[Shard(0)] + rest, expect_sizes={0: bsz})
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_matmul(dist, world, mesh_shape):
    """Rows sharded -> rows sharded; contracted dim sharded -> Partial(sum), reduced when needed."""
    assert all(dist.run(world, _matmul, mesh_shape, 60 + world))


# -------------------------------------------------------------------------------------------------
def _unsupported():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.tensor([3.0, 1, 4, 1.5, 5, 9, 2, 6, 5.5, 8], dtype=D)
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (7, 3)})
    try:
        torch.sort(x, 0)
        raise AssertionError("sorting along a sharded dim must not run silently")
    except df.UnsupportedShardedOp as e:
        msg = str(e)
    x2 = df.distribute_tensor(full.reshape(5, 2), mesh, [Shard(0)])
    assert torch.equal(torch.sort(x2, 1).values.full_tensor(), torch.sort(full.reshape(5, 2), 1).values)  # local
    # relayout warnings are once per process: an earlier test in this pool process may have sorted along a dim
    sys.modules["domainflow.dispatch.toolkit"]._relayout_warned.clear()
    with warnings.catch_warnings(record=True) as w2:  # a 2-D tensor can move its shard off the sorted dim
        warnings.simplefilter("always")
        assert torch.equal(torch.sort(x2, 0).values.full_tensor(), torch.sort(full.reshape(5, 2), 0).values)
    assert any("moved the shard off" in str(m.message) for m in w2) or mesh.shape[0] == 1
    sys.modules["domainflow.dispatch.fallback"]._warned.clear()  # warnings are once per op per process
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with df.fallback("gather"):
            y = torch.sort(x, 0).values
            y2 = torch.sort(x * 2, 0).values
    assert torch.equal(y.full_tensor(), torch.sort(full, 0).values)
    assert torch.equal(y2.full_tensor(), torch.sort(full * 2, 0).values)
    assert y.placements == x.placements and y._spec.sizes == x._spec.sizes
    n_warn = sum("fallback('gather')" in str(m.message) for m in w)
    return msg, n_warn


def test_unsupported_op_error_and_fallback(dist):
    """An op touching a sharded dim with no rule raises UnsupportedShardedOp naming the op, the
    sharded dims and how to register a handler; fallback('gather') computes it, warning once per op."""
    for msg, n_warn in dist.run(2, _unsupported):
        assert "aten.sort" in msg
        assert "dim 0 over mesh dim 0" in msg and "shape (10,)" in msg
        assert "register_aten(torch.ops.aten.sort" in msg
        assert n_warn == 1


# -------------------------------------------------------------------------------------------------
@torch.library.custom_op("dftest::row_scale", mutates_args=())
def row_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """A user op: scale each row by s * (global row index + 1); needs the rank's offset when sharded."""
    idx = torch.arange(x.shape[0], dtype=x.dtype, device=x.device) + 1
    return x * s * idx.view(-1, *([1] * (x.ndim - 1)))


@row_scale.register_fake
def _(x, s):
    return torch.empty_like(x)


@df.register_aten(row_scale)
def _row_scale_sharded(func, args, kwargs):
    x, s = args
    spec = x.spec
    off = spec.offsets[0]
    idx = torch.arange(x.to_local().shape[0], dtype=x.dtype) + 1 + off
    return ShardTensor.from_spec(x.to_local() * s * idx.view(-1, *([1] * (x.ndim - 1))), spec)


def _custom_op():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.randn(7, 2, dtype=D, generator=torch.Generator().manual_seed(3))
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: random_sizes(7, mesh.shape[0], random.Random(1))})
    assert torch.allclose(row_scale(x, 2.0).full_tensor(), row_scale(full, 2.0), atol=1e-12)
    return True


def test_register_aten_for_custom_op(dist):
    assert all(dist.run(3, _custom_op))


def rms(x):
    """A Python-level user function with its own sharded handler."""
    return (x * x).mean(-1, keepdim=True).sqrt()


@df.register_function(rms)
def _rms_sharded(func, args, kwargs):
    x = args[0]
    return ShardTensor.from_spec(func(x.to_local()), x.spec.with_(shape=tuple(x.shape[:-1]) + (1,)))


def _function_handler():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.randn(5, 4, dtype=D, generator=torch.Generator().manual_seed(4))
    x = df.distribute_tensor(full, mesh, [Shard(0)])
    out = torch.overrides.handle_torch_function(rms, (x,), x) if torch.overrides.has_torch_function((x,)) else rms(x)
    assert torch.allclose(out.full_tensor(), rms(full))
    return True


def test_register_function(dist):
    assert all(dist.run(2, _function_handler))


# -------------------------------------------------------------------------------------------------
def _losses(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shape = (rng.randint(2, 9), rng.randint(1, 5), 3)
    pl, sz = _layout_rows(mesh_shape, rng, shape)
    x = Sharded(_t(gen, *shape), pl, sz)
    y = Sharded(_t(gen, *shape), pl, sz, requires_grad=False)
    y_plain = _t(gen, *shape)
    fns = {
        "mse": lambda a, b: F.mse_loss(a, b),
        "mse_sum": lambda a, b: F.mse_loss(a, b, reduction="sum"),
        "mse_none": lambda a, b: F.mse_loss(a, b, reduction="none"),
        "huber": lambda a, b: F.huber_loss(a, b, delta=0.5),
        "smooth_l1": lambda a, b: F.smooth_l1_loss(a, b, beta=0.3),
        "l1": lambda a, b: F.l1_loss(a, b),
        "bce_logits": lambda a, b: F.binary_cross_entropy_with_logits(a, torch.sigmoid(b)),
    }
    for name, fn in fns.items():
        for target in (y, y_plain):
            try:
                check_sharded(fn, [x, target], mesh)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from e
    # dropout: the mask is local; with p=0 training equals the identity, and in eval it is a no-op
    check_sharded(lambda a: F.dropout(a, 0.0, training=True) * 2, [x], mesh)
    st = df.distribute_tensor(x.full, mesh, pl, sharding_shapes=sz)
    out = F.dropout(st, 0.5, training=True)
    assert out.placements == st.placements and out._spec.sizes == st._spec.sizes
    kept = out.to_local() != 0
    assert torch.allclose(out.to_local()[kept], st.to_local()[kept] * 2)
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_losses_and_dropout(dist, world, mesh_shape):
    """Elementwise losses reduce exactly over all points (mean over the global count); their
    gradients stay sharded; dropout keeps the layout."""
    assert all(dist.run(world, _losses, mesh_shape, 70 + world))



class _NormedMLP(torch.nn.Module):
    """LayerNorm and a learned temperature (plain parameters used in pointwise/aten ops) around Linears."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(3, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.temperature = torch.nn.Parameter(torch.tensor(0.7))
        self.shift = torch.nn.Parameter(torch.linspace(-0.2, 0.3, 8))
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.norm(self.inp(x))
        h = torch.nn.functional.gelu(h / self.temperature + self.shift)
        return self.out(h)


def _plain_param_grads_step(deferred: bool):
    from domainflow import comm

    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    torch.manual_seed(0)
    model = _NormedMLP().double()
    ref = _NormedMLP().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(37, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sizes = {1: [37], 2: [0, 37], 3: [5, 0, 32], 4: [10, 9, 9, 9]}[world]
    st = df.distribute_tensor(x, mesh, [Shard(0)], sharding_shapes={0: sizes})
    counts = []
    for _ in range(2):  # the second step accumulates into existing .grad
        loss = (model(st) ** 2).mean()
        comm.stats.reset()
        if deferred:
            with df.deferred_param_grads():
                loss.backward()
        else:
            loss.backward()
        counts.append(comm.stats.calls.get("all_reduce", 0))
        (ref(x) ** 2).mean().backward()
    worst = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    plain = all(type(p.grad) is torch.Tensor for p in model.parameters())
    return counts, worst, plain


@pytest.mark.parametrize("world", [2, 3, 4])
def test_deferred_param_grads_sum_every_plain_parameter_in_one_all_reduce(dist, world):
    """Under deferred_param_grads, LayerNorm's weight and bias and parameters used in pointwise ops
    (a temperature, a shift) join the Linear layers' partial gradients in one coalesced all-reduce per
    backward, instead of one each; the gradients equal one device's, as plain tensors."""
    for deferred, expected in ((True, 1), (False, None)):
        for counts, worst, plain in dist.run(world, _plain_param_grads_step, deferred):
            assert worst < 1e-12 and plain, (worst, plain)
            if expected is not None:
                assert counts == [expected, expected], counts
            else:
                assert all(c >= 5 for c in counts), counts  # one per layer and per plain parameter


def _rfft_under_fallback(dim: int, sizes):
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(torch.randn(3, 6, dtype=torch.float64, generator=gen), [Shard(dim)], {0: sizes})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's "gathering" warning
        with df.fallback("gather"):
            check_sharded(lambda a: torch.view_as_real(torch.fft.rfft(a, dim=1)).sin(), [x], mesh)
    return True


@pytest.mark.parametrize("dim,sizes", [(1, (2, 4)), (0, (1, 2))])
def test_rfft_under_the_gather_fallback_is_exact_forward_and_backward(dist, dim, sizes):
    """torch.fft.rfft has no rule; under fallback('gather') its forward is gathered and its backward (which
    views the complex gradient as real pairs) must come out with the right shape and values too."""
    assert all(dist.run(2, _rfft_under_fallback, dim, sizes))


def _deferred_corner_cases():
    import copy

    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    st = df.distribute_tensor(x, mesh, [Shard(0)], sharding_shapes={0: [4, 5] if world == 2 else [9]})
    problems = []
    # torch.autograd.grad inside the context: the exact gradient, and .grad left alone
    w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
    with df.deferred_param_grads():
        (g,) = torch.autograd.grad(((st * w) ** 2).sum(), [w])
    ref = 2 * (x ** 2).sum(0) * w.detach()
    if float((g - ref).abs().max()) > 1e-12 or w.grad is not None:
        problems.append(f"autograd.grad: {g} vs {ref}, .grad {w.grad}")
    # a frozen weight gets no .grad under deferral
    lin = torch.nn.Linear(4, 2).double()
    lin.weight.requires_grad_(False)
    with df.deferred_param_grads():
        lin(st).sum().backward()
    if lin.weight.grad is not None or lin.bias.grad is None:
        problems.append(f"frozen weight: grad {lin.weight.grad}, bias grad {lin.bias.grad}")
    # a deep copy of a model (EMA) that met ShardTensors is hooked afresh: plain, exact gradients
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    model(st).sum().backward()
    twin = copy.deepcopy(model)
    twin.zero_grad()
    ref_model = copy.deepcopy(model)
    ref_model.zero_grad()
    with df.deferred_param_grads():
        (twin(st) ** 2).sum().backward()
    (ref_model(x) ** 2).sum().backward()
    for (name, p), q in zip(twin.named_parameters(), ref_model.parameters()):
        if type(p.grad) is not torch.Tensor or float((p.grad - q.grad).abs().max()) > 1e-12:
            problems.append(f"deepcopy: {name} grad {type(p.grad).__name__}")
    # create_graph through a leaf whose gradient changes layout: still differentiable
    leaf = df.distribute_tensor(torch.randn(5, 6, dtype=torch.float64), mesh, [Shard(0)]).detach().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (gl,) = torch.autograd.grad((leaf.sort(0).values ** 2).sum(), [leaf], create_graph=True)  # moves the shard
    if not gl.requires_grad:
        problems.append("create_graph: the leaf's gradient lost its graph")
    return problems


@pytest.mark.parametrize("world", [1, 2])
def test_deferred_param_grads_corner_cases(dist, world):
    """autograd.grad inside deferred_param_grads is exact and leaves .grad alone; frozen weights get no .grad;
    a deep copy of a model is hooked afresh; a relaid-out leaf gradient keeps create_graph's graph."""
    for problems in dist.run(world, _deferred_corner_cases):
        assert not problems, problems


# -------------------------------------------------------------------------------------------------
def _under_inference_mode(seed):
    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 9, 4, generator=gen, dtype=D)
    x = df.distribute_tensor(full, mesh, [Shard(1)], sharding_shapes={0: random_sizes(9, world, rng)})
    lin = torch.nn.Linear(4, 3).to(D)
    ln = torch.nn.LayerNorm(4).to(D)
    cases = [lambda t: torch.softmax(t, -1), lambda t: F.log_softmax(t, -1), lin, ln, lambda t: F.gelu(t) * 2,
             lambda t: t.mean(1), lambda t: t.sum(1)]
    ok = []
    with torch.inference_mode():
        for fn in cases:
            for _ in range(2):  # the second call may take the fast path
                got = fn(x).redistribute([Replicate()] * mesh.ndim).to_local()
                ok.append(torch.allclose(got, fn(full), atol=1e-12))
    return ok


@pytest.mark.parametrize("world", [1, 2])
def test_ops_run_under_inference_mode(dist, world):
    """Under torch.inference_mode() autograd does not decompose composite ops (softmax.int, linear,
    layer_norm): the engine runs their decomposition, as DTensor does, instead of refusing them."""
    for ok in dist.run(world, _under_inference_mode, 3):
        assert all(ok), ok


def test_a_schema_binds_names_defaults_and_aliases():
    from domainflow.dispatch.toolkit import Schema

    schema = Schema("self", "dim", "keepdim", keepdim=False, dtype=None)
    assert schema.bind((1, 2), {}) == {"self": 1, "dim": 2, "keepdim": False, "dtype": None}
    assert schema.bind((), {"input": 1, "axis": 0, "keepdims": True}) == {"self": 1, "dim": 0, "keepdim": True,
                                                                         "dtype": None}
    assert schema.bind((1,), {}, dtype=torch.float64)["dtype"] is torch.float64
    assert schema.defaults == {"keepdim": False, "dtype": None}  # a call never changes the declaration
