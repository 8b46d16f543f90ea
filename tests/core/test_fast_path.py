"""The fast path (domainflow.dispatch.fast_path) on real process groups: outside autograd, a call whose
every step is local-exact runs straight on the local chunks from its second time on (no
engine), with the layout, strides and values the engine gives; anything that
communicates, relayouts, slices a plain operand, works in place or needs gradients keeps taking the
engine."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import domainflow as df
from dist_pool import rank_and_world
from domainflow import Replicate, Shard, ShardTensor
from sharded_check import random_sizes

D = torch.float64


def _setup(seed):
    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(11, 6, 4, generator=gen, dtype=D)
    sizes = random_sizes(11, world, random.Random(seed))
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
    x.flat = df.distribute_tensor(full[:, 0], mesh, [Shard(0)], sharding_shapes={0: sizes})  # 2-D, for mm
    rep = df.distribute_tensor(torch.randn(6, 4, generator=gen, dtype=D), mesh, [Replicate()])
    plain = {"row": torch.randn(4, generator=gen, dtype=D), "col": torch.randn(11, 1, 1, generator=gen, dtype=D),
             "m": torch.randn(4, 5, generator=gen, dtype=D)}
    lin = torch.nn.Linear(4, 3).to(D)
    return mesh, full, x, rep, plain, lin, sizes


def _cases(plain, lin):
    """name -> (function, whether its second call must take the fast path; else the engine, every time)."""
    return {
        "add": (lambda a, r: a + a, True),
        "scalar": (lambda a, r: a * 2.5 - 1, True),
        "sin": (lambda a, r: torch.sin(a), True),
        "gelu": (lambda a, r: F.gelu(a), True),
        "replicated operand": (lambda a, r: a * r, True),
        "broadcast row": (lambda a, r: a + plain["row"], True),
        "sum unsharded dim": (lambda a, r: a.sum(1), True),
        "sum sharded dim (pending)": (lambda a, r: a.sum(0), True),
        "mean unsharded dim": (lambda a, r: a.mean(2), True),
        "matmul": (lambda a, r: (a.flat if isinstance(a, ShardTensor) else a[:, 0]) @ plain["m"], True),
        "linear (parameters)": (lambda a, r: lin(a), True),
        "layer_norm": (lambda a, r: F.layer_norm(a, (4,)), True),
        "softmax unsharded dim": (lambda a, r: torch.softmax(a, -1), True),
        "cumsum unsharded dim": (lambda a, r: torch.cumsum(a, 2), True),
        "replicated only": (lambda a, r: torch.tanh(r), True),
        # the engine: global sizes in the arguments, communication, slicing a plain operand
        "view (global sizes)": (lambda a, r: a.view(-1, 4), False),
        "softmax sharded dim": (lambda a, r: torch.softmax(a, 0), False),
        "mean sharded dim": (lambda a, r: a.mean(0), False),
        "plain operand sliced": (lambda a, r: a * plain["col"], False),
        "matmul 3-D (folded by a view of global sizes)": (lambda a, r: a @ plain["m"], False),
        # views: autograd links a view to its base only when the op passes through torch's dispatcher
        "transpose": (lambda a, r: a.transpose(1, 2), False),
        "unsqueeze": (lambda a, r: a.unsqueeze(1), False),
        "transposed 2-D": (lambda a, r: (a.flat if isinstance(a, ShardTensor) else a[:, 0]).t(), False),
        # torch's Python code reads the (global) batch size between its aten steps: no handler answers for it
        "kl_div batchmean": (lambda a, r: F.kl_div(torch.log_softmax(a, -1), torch.softmax(a, -1).flip(-1),
                                                   reduction="batchmean"), False),
        "integer mean unsharded dim (torch refuses; the engine answers)": (
            lambda a, r: (a * 100).long().mean(2) if isinstance(a, ShardTensor) else (a * 100).long().double().mean(2),
            False),
    }


def _counting_engine():
    """Counts Python-level calls that take the full engine rather than the fast path."""
    from domainflow.dispatch import fast_path as engine

    orig = engine._engine
    count = [0]

    def counting(func, types, args, kwargs):
        count[0] += 1
        return orig(func, types, args, kwargs)

    engine._engine = counting
    return count, lambda: setattr(engine, "_engine", orig)


def _twice_without_grad(seed):
    mesh, full, x, rep, plain, lin, sizes = _setup(seed)
    count, restore = _counting_engine()
    out = {}
    try:
        with torch.no_grad():
            for name, (fn, _) in _cases(plain, lin).items():
                want = fn(full, rep.to_local())
                first = fn(x, rep)
                before = count[0]
                second = fn(x, rep)
                dispatched = count[0] - before
                assert type(second) is ShardTensor, name
                assert second._spec == first._spec, (name, second._spec, first._spec)
                assert second.stride() == first.stride() and second.dtype == first.dtype, name
                assert torch.equal(second.to_local(), first.to_local()), name
                got = second.redistribute([Replicate()]).to_local()
                assert torch.allclose(got.to(want.dtype), want, atol=1e-6), name
                out[name] = dispatched
    finally:
        restore()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_second_call_without_grad_skips_the_engine_where_every_step_is_local(dist, world):
    results = dist.run(world, _twice_without_grad, 7 + world)
    cases = _cases({"row": None, "col": None, "m": None}, None)
    for rank_result in results:
        for name, dispatched in rank_result.items():
            fast = cases[name][1]
            if fast:
                assert dispatched == 0, (name, dispatched)
            else:
                assert dispatched > 0, (name, dispatched)


def _what_never_takes_it(seed):
    mesh, full, x, rep, plain, lin, sizes = _setup(seed)
    count, restore = _counting_engine()
    seen = {}
    try:
        # gradients: the engine's autograd rules, every time
        xg = df.distribute_tensor(full.clone(), mesh, [Shard(0)], sharding_shapes={0: sizes})
        xg.requires_grad_(True)
        for _ in range(2):
            before = count[0]
            y = xg * 2
            seen.setdefault("grad", []).append(count[0] - before)
            assert y.grad_fn is not None
        y.sum().backward()
        assert torch.equal(xg.grad.to_local(), torch.full_like(xg.to_local(), 2.0))
        # linear's parameters need gradients under grad mode: the engine too
        y = lin(x)
        assert y.requires_grad and y.grad_fn is not None
        with torch.no_grad():
            # in place: the result is the input
            z = x.clone()
            for _ in range(2):
                before = count[0]
                r = z.add_(1.0)
                assert r is z
                seen.setdefault("in place", []).append(count[0] - before)
            assert torch.allclose(z.to_local(), x.to_local() + 2)
            # out= (refused by the engine, every time: never run locally by the fast path instead)
            o = x.clone()
            for _ in range(2):
                before = count[0]
                try:
                    torch.add(x, x, out=o)
                    raise AssertionError("out= was not refused")
                except df.UnsupportedShardedOp:
                    pass
                seen.setdefault("out=", []).append(count[0] - before)
    finally:
        restore()
    return seen


def test_gradients_in_place_and_out_always_take_the_engine(dist):
    for seen in dist.run(2, _what_never_takes_it, 3):
        for name, counts in seen.items():
            assert all(c > 0 for c in counts), (name, counts)


def _registering_forgets(seed):
    from domainflow.dispatch import fast_path

    mesh, full, x, rep, plain, lin, sizes = _setup(seed)
    with torch.no_grad():
        torch.cos(x)
        torch.cos(x)
        learnt = sum(v is not None for v in fast_path._plans.values())
        df.register_aten(torch.ops.aten.cos.default)(lambda func, args, kwargs: args[0] * 0 + 42.0)
        try:
            after = torch.cos(x).to_local()  # the user's handler, not a stale fast entry
        finally:
            from domainflow.dispatch.registry import REGISTRY

            del REGISTRY.aten[torch.ops.aten.cos.default]
            REGISTRY.register_pointwise(REGISTRY.pointwise)  # forget the routes to the removed handler
    return learnt, bool(torch.all(after == 42.0))


def test_registering_a_handler_forgets_what_was_learnt(dist):
    for learnt, used_new in dist.run(1, _registering_forgets, 5):
        assert learnt >= 1 and used_new


def _bounded(seed):
    from domainflow.dispatch import fast_path

    mesh, full, x, rep, plain, lin, sizes = _setup(seed)
    old = fast_path._plans.size
    fast_path._plans.size = 8
    sizes_seen, ok = [], True
    try:
        fast_path.clear()
        with torch.no_grad():
            for step in range(12):
                for k in (1.0, 2.0, float(step + 3)):  # two keys used every step, one new key each step
                    y = x.pow(k) if k != 1.0 else x.sum(2)
                    want = full.pow(k) if k != 1.0 else full.sum(2)
                    ok = ok and torch.allclose(y.redistribute([Replicate()]).to_local(), want)
                sizes_seen.append(len(fast_path._plans))
        hot = [key for key, p in fast_path._plans.items() if p is not None and key[0] is torch.Tensor.pow and key[-1] == 2.0]
    finally:
        fast_path._plans.size = old
    return ok, max(sizes_seen), len(hot)


def test_the_cache_is_bounded_and_keeps_what_is_used(dist):
    for ok, most, hot in dist.run(2, _bounded, 4):
        assert ok and most <= 8 and hot == 1, (ok, most, hot)


def _views_stay_views(seed):
    mesh, full, x, rep, plain, lin, sizes = _setup(seed)
    out = []
    for _ in range(2):  # the second call is where a learnt entry would answer
        xx = x.flat.clone()
        p = torch.ones(xx.shape[1], xx.shape[0], dtype=D, requires_grad=True)
        v = xx.t()  # grad mode, nothing requires grad: the fast path may look at it
        v.add_(df.distribute_tensor(p, mesh, [Replicate()]))  # writes into xx through the view
        loss = (xx * 2).sum()
        out.append(xx.requires_grad)
        if xx.requires_grad:
            loss.backward()
            out.append(float(p.grad[0, 0]))
    return out


def test_views_keep_their_autograd_link_to_the_base(dist):
    """An in-place op on a view with an operand that needs gradients makes the base need them too, as in
    torch, on every call (a learnt entry would build the view outside torch's dispatcher, unlinked)."""
    for got in dist.run(2, _views_stay_views, 6):
        assert got == [True, 2.0, True, 2.0], got


def _threads_learning(seed):
    import sys
    import threading

    from domainflow.dispatch import fast_path

    mesh, full, x, rep, plain, lin, sizes = _setup(seed)
    old, interval = fast_path._plans.size, sys.getswitchinterval()
    fast_path._plans.size = 64
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the sweep meets the other's inserts
    errors = []

    def work(tid):
        try:
            with torch.no_grad():
                for i in range(6000):
                    x * float(tid * 1e6 + i)  # a new key every call: learning and sweeping all the time
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        fast_path._plans.size = old
        sys.setswitchinterval(interval)
    return errors, len(fast_path._plans)


def test_threads_learning_at_once_share_the_cache_safely(dist):
    for errors, entries in dist.run(1, _threads_learning, 2):
        assert not errors and entries <= 64, (errors, entries)
