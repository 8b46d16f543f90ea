"""Single-op corner cases, each once a bug: norms of Partial values, nansum with dims, in-place views,
cumsum/cumprod backward, index ops, NaN through max/min, losses with empty shards, ties, every dtype,
numpy-style keywords, sharded losses, attention and conv exact or refused."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

import domainflow as df
from domainflow import Partial, Replicate, Shard, ShardTensor
from sweep import none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


TOL = 1e-10


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


def _zero_dim_reductions():
    mesh = get_mesh((rank_and_world()[1],))
    whole = torch.arange(5.0, dtype=D)
    cases = {
        "amax": lambda a, d: a.amax(d), "argmax": lambda a, d: a.argmax(d), "prod": lambda a, d: a.prod(d),
        "any": lambda a, d: (a > 0).any(d), "vector_norm": lambda a, d: torch.linalg.vector_norm(a, dim=d),
        "sum": lambda a, d: a.sum(d), "mean": lambda a, d: a.mean(d), "var": lambda a, d: a.var(d, correction=0),
        "max": lambda a, d: a.max(d).values, "argmin": lambda a, d: a.argmin(d),
    }
    failures = []
    for tag, make in (("replicated", lambda: df.distribute_tensor(torch.tensor(2.5, dtype=D), mesh, [Replicate()])),
                      ("pending sum", lambda: df.distribute_tensor(whole, mesh, [Shard(0)]).sum())):
        ref = torch.tensor(2.5, dtype=D) if tag == "replicated" else whole.sum()
        for name, fn in cases.items():
            for d in (0, -1):
                got = fn(make(), d).full_tensor()
                want = fn(ref, d)
                if got.shape != want.shape or not torch.equal(got, want):
                    failures.append(f"{tag} {name}({d}): {got} != {want}")
    assert not failures, failures
    return True


def test_reductions_over_dim_0_of_a_zero_dim_tensor(dist):
    # Regression test (bug found in review, now fixed): a reduction naming dim 0 (or -1) of a 0-d ShardTensor,
    # which torch allows, raised IndexError in the shared reduction plan (it counted spec.shape[0] of shape ()).
    assert all(dist.run(2, _zero_dim_reductions))


def _unbind_plans():
    from domainflow.memo import PLANS

    mesh = get_mesh((rank_and_world()[1],))
    x = df.distribute_tensor(torch.randn(301, 3, dtype=D), mesh, [Shard(0)]).requires_grad_()
    before = len(PLANS)
    (torch.stack(x.unbind(0)[::-1]) * 2).sum().backward()  # 301 selects and their backwards
    assert len(PLANS) - before < 40, (before, len(PLANS))
    assert torch.equal(x.grad.full_tensor(), torch.full((301, 3), 2.0, dtype=D))
    return True


def test_unbind_keeps_no_plan_per_row(dist):
    # Regression test (found in review): select's layout plan (and its backward's) was keyed on the index, so
    # unbinding a sharded dim of n rows added 2n entries to the one bounded plan cache, pushing hot plans out.
    assert all(dist.run(2, _unbind_plans))


def _conjugate_views():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(5, 2 + world, dtype=torch.complex128, generator=gen)
    w = torch.randn(5, 1, dtype=torch.complex128, generator=gen)
    sizes = {0: (0,) + (2 + world,) * 0 + tuple(random_sizes(2 + world, world - 1, random.Random(world)))}
    cases = {  # torch.conj and .imag give lazy views; ops on a ShardTensor's chunk used to read their raw memory
        "x.conj() * w": lambda x: x.conj() * w, "x.conj() * 2j": lambda x: x.conj() * 2j,
        "x * x.conj()": lambda x: x * x.conj(), "x.conj().imag * 3": lambda x: x.conj().imag * 3,
        "view_as_real(x.conj())": lambda x: torch.view_as_real(x.conj().resolve_conj()) + 0,
        "(x.conj() @ x.T).real": lambda x: (x.conj().T @ x).real, "x.conj().sum(0)": lambda x: x.conj().sum(0),
    }
    failures = []
    for name, f in cases.items():
        _run(f, [Sharded(full, [Shard(1)], sizes, requires_grad=False)], mesh, name, failures, backward=False)
    st = df.distribute_tensor(full, mesh, [Shard(1)], sharding_shapes=sizes)
    with pytest.raises(df.UnsupportedShardedOp, match="conjugate .*view"):
        st.conj().mul_(2j)  # torch would change st through the view; refused rather than silently not
    for name, write in (("x.conj()[0].fill_(1)", lambda v: v[0].fill_(1)),  # through a view of the copy
                        ("x.conj().T.mul_(2)", lambda v: v.T.mul_(2)),
                        ("x.conj()[:, :2].zero_()", lambda v: v[:, :2].zero_())):
        with pytest.raises(df.UnsupportedShardedOp, match="conjugate .*view"):
            write(st.conj())
            failures.append(f"{name} wrote into a copy of st.conj() without a word")
    # x.view(-1) of x sharded along its inner dim re-shards a copy first: read right, a write through it refused
    real = df.distribute_tensor(full.real.contiguous(), mesh, [Shard(1)], sharding_shapes=sizes)
    if not torch.equal(real.view(-1).full_tensor(), full.real.reshape(-1)):
        failures.append("x.view(-1) of a Shard(1) tensor")
    for name, write in (("x.view(-1).mul_(0)", lambda v: v.mul_(0)), ("x.view(-1)[:4].zero_()", lambda v: v[:4].zero_())):
        with pytest.raises(df.UnsupportedShardedOp, match="reshape that had to re-shard"):
            write(real.view(-1))
            failures.append(f"{name} wrote into a re-sharded copy of x without a word")
    return _ok(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_conjugate_and_negative_views_give_their_values(dist, world):
    assert all(dist.run(world, _conjugate_views))


def _decomposed_ops():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    gen = torch.Generator().manual_seed(9)
    n = 3 + 2 * world
    sizes = {0: (0,) + tuple(random_sizes(n, world - 1, random.Random(world), zeros=False))}
    x = torch.randn(n, 6, generator=gen, dtype=D)
    target = torch.randint(0, 6, (n,), generator=gen)
    v, w = torch.randn(6, generator=gen, dtype=D), torch.randn(n, 3, generator=gen, dtype=D)
    cases = {  # no rule of their own: torch's decomposition, whose ops have rules
        "triu(x, 1)": lambda a: torch.triu(a, 1), "tril(x, -1)": lambda a: torch.tril(a, -1),
        "linalg.cross(x[:, :3], w)": lambda a: torch.linalg.cross(a[:, :3], w),
        "addmv(b, x, v)": lambda a: torch.addmv(a[:, 0], a, v),
        "cross_entropy(x, plain target)": lambda a: F.cross_entropy(a, target),
        "nll_loss(log_softmax(x), plain target)": lambda a: F.nll_loss(F.log_softmax(a, 1), target),
        "glu(x, 1)": lambda a: F.glu(a, 1), "pixel_shuffle": lambda a: F.pixel_shuffle(a.reshape(1, n, 1, 6).movedim(1, 2).reshape(1, 1, n, 6).repeat(1, 4, 1, 1), 2),
        "aminmax(x, dim=1)": lambda a: torch.aminmax(a, dim=1),
    }
    failures = []
    for name, f in cases.items():
        _run(f, [Sharded(x, [Shard(0)], sizes)], mesh, name, failures)
    return _ok(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_ops_without_a_rule_run_through_torchs_decomposition(dist, world):
    """``addmv``, ``linalg.cross``, ``triu``, ``glu``, losses with plain targets: no handler of their own, run
    through ``torch._decomp`` (their ops have rules), exact with uneven shards and an empty one; they used to be
    refused (or, under fallback('gather'), gathered)."""
    assert all(dist.run(world, _decomposed_ops))
