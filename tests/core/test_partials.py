"""Partial placements: pending sums and maxima reduced only when needed, casts, round trips, and
Partial values under autograd (redistribute chains, leaves, avg)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh

import domainflow as df
from domainflow import Partial, Replicate, Shard, ShardTensor
from sweep import error_line as _err, no_problems as _no_problems, none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


TOL = 1e-10


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


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rank() -> int:
    return torch.distributed.get_rank()


def _mesh2d():
    return get_mesh((2, 2), ("dp", "domain"))


def _rd(a, placements, sizes=None):
    """redistribute on the sharded run; identity on the one-process reference."""
    return a.redistribute(placements, sizes) if isinstance(a, ShardTensor) else a


# =================================================================================================
# 2. Partial placements under autograd
# =================================================================================================
def _chains_2d():
    mesh = _mesh2d()
    gen = _gen(12)
    fails = []
    x = Sharded(torch.randn(5, 4, 3, generator=gen, dtype=D), [Shard(0), Shard(1)], {0: (0, 5), 1: (3, 1)})
    w = torch.randn(3, 2, generator=gen, dtype=D)
    fns = {
        "sum0_to_shard": lambda a: _rd(a.sum(0), [Replicate(), Shard(0)]) * 2,
        "sum0_to_uneven_2d": lambda a: _rd(a.sum(0), [Shard(1), Shard(0)], {0: (3, 0), 1: (1, 3)}).exp(),
        "sum01_to_rep": lambda a: _rd(a.sum((0, 1)), [Replicate(), Replicate()]).sin(),
        "sum1_partial_moves": lambda a: _rd(a.sum(1), [Shard(1), Replicate()]).cos(),
        "partial_kept_other_dim_gathered": lambda a: _rd(_rd(a.sum(0), [Partial("sum"), Shard(1)]),
                                                         [Replicate(), Replicate()]) ** 2,
        "rep_to_partial_to_shard": lambda a: _rd(_rd(_rd(a, [Replicate(), Replicate()]),
                                                     [Partial("sum"), Partial("sum")]), [Shard(2), Shard(0)]) * 3,
        "shard_to_partial_max_back": lambda a: _rd(_rd(a, [Partial("max"), Shard(1)]), [Shard(0), Shard(1)]).tanh(),
        "partial_then_pointwise": lambda a: (_rd(a, [Partial("sum"), Shard(1)]) * 2 + 1).exp(),
        "amax_partial_times_sum": lambda a: _rd(a.amax(0), [Shard(0), Replicate()]) * a.sum(0),
        "mean_partial_matmul": lambda a: a.mean(1) @ w,
    }
    for name, fn in fns.items():
        try:
            check_sharded(fn, [x], mesh)
        except Exception as e:  # noqa: BLE001
            fails.append(f"{name}: {_err(e)}")
    return fails


def test_redistribute_chains_with_partial_sum_on_2d_mesh(dist):
    _no_problems(dist.run(4, _chains_2d))


def _partial_leaf(op):
    """from_local(local, [Partial(op)]) on a leaf that differs per rank; reference: stack the ranks'
    terms and reduce with the op in one process."""
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    me = _rank()
    gen = _gen(1)
    terms = torch.randn(world, 4, generator=gen, dtype=D) + 2.0      # no zeros, no ties
    cot = torch.randn(4, generator=gen, dtype=D)
    reduce = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0), "max": lambda t: t.amax(0),
              "min": lambda t: t.amin(0), "product": lambda t: t.prod(0)}[op]
    ref = terms.clone().requires_grad_()
    want = reduce(ref)
    (want * cot).sum().backward()
    probs = []
    leaf = terms[me].clone().requires_grad_()
    try:
        full = ShardTensor.from_local(leaf, mesh, [Partial(op)]).full_tensor()
        if not torch.allclose(full, want.detach(), rtol=0, atol=TOL):
            probs.append(f"Partial({op}) value {full.tolist()} != {want.tolist()}")
        (full * cot).sum().backward()
        if leaf.grad is None or not torch.allclose(leaf.grad, ref.grad[me], rtol=0, atol=TOL):
            probs.append(f"Partial({op}) local gradient {None if leaf.grad is None else leaf.grad.tolist()} "
                         f"!= {ref.grad[me].tolist()}")
    except Exception as e:  # noqa: BLE001
        probs.append(f"Partial({op}): {_err(e)}")
    return probs


@pytest.mark.parametrize("op", ["sum", "avg",
                                # Regression test (bug found in review, now fixed): max/min/product below
                                "max", "min", "product"])
def test_partial_leaf_full_tensor_gradient(dist, op):
    # Regression test (bug found in review, now fixed): _Redistribute.backward (shard_tensor.py) turns the gradient of a
    # Partial value into a replicated gradient for every rank's term, which is right only for sum
    # (and avg, which it divides by n). For y = max_k x_k the term's gradient is g * [x_k == y]
    # (min alike), for y = prod_k x_k it is g * y / x_k; every rank instead gets g unchanged.
    # Observed (3 ranks): the losing ranks of max/min get g instead of 0, product gets g instead of g*y/x_k.
    _no_problems(dist.run(3, _partial_leaf, op))


def _partial_avg_chains():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    me = _rank()
    gen = _gen(13)
    full = torch.randn(3, 2, generator=gen, dtype=D)
    cot = torch.randn(3, 2, generator=gen, dtype=D)
    terms = torch.randn(world, 3, 2, generator=gen, dtype=D)
    probs = []
    # (a) Replicate -> Partial(op) -> Replicate is the identity: the gradient must be the cotangent
    for op in ("sum", "avg", "max", "min"):
        x = full.clone().requires_grad_()
        y = df.distribute_tensor(x, mesh, [Replicate()]).redistribute([Partial(op)]).redistribute([Replicate()])
        (y.to_local() * cot).sum().backward()
        if not torch.allclose(x.grad, cot, rtol=0, atol=TOL):
            probs.append(f"R -> Partial({op}) -> R: gradient off by factor {(x.grad / cot).mean().item():.4f}")
    # (b) a Partial(avg) leaf through ops that reduce it implicitly (not via redistribute)
    for name, f in (("exp", torch.exp), ("times_2", lambda t: t * 2), ("square", lambda t: t ** 2)):
        ref = terms.clone().requires_grad_()
        (f(ref.mean(0)) * cot).sum().backward()
        leaf = terms[me].clone().requires_grad_()
        (f(ShardTensor.from_local(leaf, mesh, [Partial("avg")])) * cot).sum().backward()
        if leaf.grad is None or not torch.allclose(leaf.grad, ref.grad[me], rtol=0, atol=TOL):
            probs.append(f"Partial(avg) leaf -> {name}: gradient off by factor "
                         f"{(leaf.grad / ref.grad[me]).mean().item():.4f}")
    return probs


def test_partial_avg_gradients(dist):
    # Regression test (bug found in review, now fixed): gradients through Partial("avg") are off by a factor of the mesh size.
    # (a) distribute_tensor(x, mesh, [Replicate()]).redistribute([Partial("avg")]).redistribute([Replicate()])
    #     is the identity, but x.grad == cot / 3 on 3 ranks (sum/max/min give cot).
    # (b) ShardTensor.from_local(leaf, mesh, [Partial("avg")]).exp() (or * 2, ** 2): the dispatcher
    #     reduces the avg below autograd and nobody divides the leaf's gradient by n: leaf.grad is
    #     3x too large.
    # Root cause: the 1/n of an avg is applied in _Redistribute.backward (shard_tensor.py) whenever the
    # *source* has Partial(avg), instead of where a term becomes part of the average (_FromLocal.backward,
    # and Replicate -> Partial(avg) in redistribute): implicit reductions miss it, R->Pavg->R applies it
    # once too often.
    _no_problems(dist.run(3, _partial_avg_chains))


def _partial_avg_2d():
    mesh = _mesh2d()
    c = mesh.get_coordinate()
    gen = _gen(2)
    terms = torch.randn(2, 5, 3, generator=gen, dtype=D)   # one avg term per dp coordinate
    cot = torch.randn(5, 3, generator=gen, dtype=D)
    sizes = (2, 3)
    ref = terms.clone().requires_grad_()
    (ref.mean(0) * cot).sum().backward()
    off = sum(sizes[:c[1]])
    leaf = terms[c[0], off:off + sizes[c[1]]].clone().requires_grad_()
    st = ShardTensor.from_local(leaf, mesh, [Partial("avg"), Shard(0)], sharding_shapes={1: sizes})
    probs = []
    f = st.redistribute([Partial("avg"), Replicate()]).full_tensor()   # the avg stays pending, then reduces
    if not torch.allclose(f, ref.mean(0).detach(), rtol=0, atol=TOL):
        probs.append("value")
    (f * cot).sum().backward()
    want = ref.grad[c[0], off:off + sizes[c[1]]]
    if not torch.allclose(leaf.grad, want, rtol=0, atol=TOL):
        probs.append(f"gradient off by factor {(leaf.grad / want).mean().item():.4f} (expected 1)")
    return probs


def test_partial_avg_kept_through_2d_redistribute_gradient(dist):
    # Regression test (bug found in review, now fixed): [Partial("avg"), Shard(0)] -> [Partial("avg"), Replicate()] -> full_tensor(): the forward
    # reduces the avg once, but _Redistribute.backward divides by the dp size at *both* steps (it
    # divides whenever the source spec has a Partial(avg), even when the avg was kept), so the
    # leaf's gradient is cot / 4 instead of cot / 2 (observed/expected = 0.5).
    _no_problems(dist.run(4, _partial_avg_2d))


def _to_local_grad_placements():
    world = rank_and_world()[1]
    probs = []
    # 1-D: each rank computes its own loss from the replicated local; the objective is their sum
    mesh = get_mesh((world,))
    gen = _gen(3)
    full = torch.randn(5, 2, generator=gen, dtype=D)
    w = torch.randn(world, 5, 2, generator=gen, dtype=D)
    sizes = (2, 0, 3) if world == 3 else (5,) + (0,) * (world - 1)
    ref = full.clone().requires_grad_()
    sum(((ref * w[k]) ** 2).sum() for k in range(world)).backward()
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes}).detach().requires_grad_()
    loc = x.redistribute([Replicate()]).to_local(grad_placements=[Partial("sum")])
    ((loc * w[_rank()]) ** 2).sum().backward()
    if not isinstance(x.grad, ShardTensor) or not torch.allclose(x.grad.full_tensor(), ref.grad, rtol=0, atol=TOL):
        probs.append("1-D to_local(grad_placements=[Partial('sum')])")
    # default grad placements on a Shard tensor: the local gradient is this rank's rows
    x2 = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes}).detach().requires_grad_()
    (x2.to_local().sin() * 3).sum().backward()
    if not torch.allclose(x2.grad.full_tensor(), 3 * full.cos(), rtol=0, atol=TOL):
        probs.append("to_local() default grad placements")
    if world == 4:
        mesh2 = _mesh2d()
        c = mesh2.get_coordinate()
        ref = full.clone().requires_grad_()
        sum((ref * w[k]).sin().sum() for k in range(2)).backward()
        x3 = df.distribute_tensor(full, mesh2, [Shard(0), Replicate()], sharding_shapes={0: (4, 1)})
        x3 = x3.detach().requires_grad_()
        loc = x3.redistribute([Replicate(), Replicate()]).to_local(grad_placements=[Replicate(), Partial("sum")])
        (loc * w[c[1]]).sin().sum().backward()
        if not torch.allclose(x3.grad.full_tensor(), ref.grad, rtol=0, atol=TOL):
            probs.append("2-D to_local(grad_placements=[Replicate(), Partial('sum')])")
    return probs


@pytest.mark.parametrize("world", (3, 4))
def test_to_local_grad_placements(dist, world):
    _no_problems(dist.run(world, _to_local_grad_placements))


def _leaf_shard_tensor():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    gen = _gen(7)
    full = torch.randn(6, 3, generator=gen, dtype=D)
    w = torch.randn(3, 2, generator=gen, dtype=D)
    sizes = (0, 4, 2)
    probs = []

    def f(a):
        return ((a @ w).tanh() ** 2).mean() + a.sum(0).pow(2).sum() * 0.1 + a.amax(0).sum()

    ref = full.clone().requires_grad_()
    f(ref).backward()
    f(ref).backward()                          # gradients accumulate over two backward passes
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes}).detach().requires_grad_()
    if not (x.is_leaf and x.requires_grad and type(x) is ShardTensor):
        probs.append("detach().requires_grad_() is not a ShardTensor leaf")
    f(x).backward()
    f(x).backward()
    if not isinstance(x.grad, ShardTensor) or tuple(x.grad.shape) != (6, 3):
        probs.append(f"x.grad is {type(x.grad).__name__}")
    elif not torch.allclose(x.grad.full_tensor(), ref.grad, rtol=0, atol=TOL):
        probs.append("accumulated x.grad wrong")
    # optimise the sharded field itself (SGD with momentum), 3 steps
    ref2 = full.clone().requires_grad_()
    x2 = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes}).detach().requires_grad_()
    o1 = torch.optim.SGD([ref2], lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD([x2], lr=0.1, momentum=0.9)
    for _ in range(3):
        o1.zero_grad()
        f(ref2).backward()
        o1.step()
        o2.zero_grad()
        f(x2).backward()
        o2.step()
    if not torch.allclose(x2.detach().full_tensor(), ref2.detach(), rtol=0, atol=TOL):
        probs.append("SGD on a ShardTensor leaf")
    if x2.placements != (Shard(0),) or x2.spec.sizes != (sizes,):
        probs.append(f"SGD changed the leaf's layout to {x2.spec}")
    return probs


def test_leaf_shard_tensor_grad_accumulation_and_sgd(dist):
    _no_problems(dist.run(3, _leaf_shard_tensor))
