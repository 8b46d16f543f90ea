"""ShardTensor layouts on real process groups: construction, round trips, redistribution, DTensor interop.

Property style: random tensors with random uneven sharding sizes (zeros included) on world sizes
1-4 and 1-D / 2-D meshes; every check compares with the full tensor held in one process.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from dist_pool import WORLD_SIZES, rank_and_world
from sharded_check import get_mesh, mesh_shapes, random_sizes

import domainflow as df
from domainflow import Partial, Replicate, Shard, ShardTensor
from sweep import error_line as _err, no_problems as _no_problems

CASES = [(w, ms) for w in WORLD_SIZES for ms in mesh_shapes(w)]
IDS = [f"ws{w}-mesh{'x'.join(map(str, ms))}" for w, ms in CASES]


def _random_layout(rng, shape, mesh_shape, allow_partial=True):
    """Random placements (each tensor dim sharded by at most one mesh dim) and random sizes."""
    free = list(range(len(shape)))
    placements, sizes = [], {}
    for m, n in enumerate(mesh_shape):
        r = rng.random()
        if free and r < 0.6:
            d = rng.choice(free)
            free.remove(d)
            placements.append(Shard(d))
            sizes[m] = random_sizes(shape[d], n, rng)
        elif allow_partial and r < 0.75:
            placements.append(Partial("sum"))
        else:
            placements.append(Replicate())
    return placements, sizes


def _integer_tensor(rng, shape):
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    return torch.randint(-50, 50, shape, generator=g).to(torch.float64)


def _partial_local(full_piece, mesh, placements, coord, rng_seed):
    """Split a piece into exact integer partial terms over the Partial mesh dims."""
    local = full_piece.clone()
    for m, p in enumerate(placements):
        if isinstance(p, Partial):
            g = torch.Generator().manual_seed(rng_seed + 17 * m)
            n = mesh.shape[m]
            terms = [torch.randint(-9, 9, full_piece.shape, generator=g).double() for _ in range(n - 1)]
            terms.append(local - sum(terms) if terms else local)
            local = terms[coord[m]] if n > 1 else local
    return local


def _make(full, mesh, placements, sizes, seed):
    """A ShardTensor of ``full`` built from locals, Partial terms split at random (exact integers)."""
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    st = df.distribute_tensor(full, mesh, plain, sharding_shapes=sizes or None)
    coord = tuple(mesh.get_coordinate())
    local = _partial_local(st.to_local(), mesh, placements, coord, seed)
    return ShardTensor.from_local(local, mesh, placements, sharding_shapes=sizes)


# -------------------------------------------------------------------------------------------------
def _callers_tensor_stays_its_own(world):
    mesh = get_mesh((world,))
    for grad in (False, True):
        t = torch.ones(3, 2)
        with torch.set_grad_enabled(grad):
            st = ShardTensor.from_local(t, mesh, [Shard(0)], sharding_shapes={0: [3] * world})
        t.unsqueeze_(0)  # the caller's tensor changes shape in place; the ShardTensor's chunk must not
        assert st.to_local().shape == (3, 2) and st.full_tensor().shape == (3 * world, 2) == st.shape
        t[0, 0, 0] = 5  # memory is shared, as DTensor.from_local shares it
        assert st.to_local()[0, 0] == 5
    return True


def test_from_local_chunk_is_not_the_callers_tensor_object(dist):
    """from_local shares the caller's memory but not its tensor object (a view, as DTensor): an in-place shape
    change of the caller's tensor leaves the ShardTensor's layout and chunk alone, with or without grad mode."""
    assert all(dist.run(2, _callers_tensor_stays_its_own, 2))


def _round_trips(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    for trial in range(12):
        shape = tuple(rng.randint(0, 6) if rng.random() < 0.1 else rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        full = _integer_tensor(rng, shape)
        placements, sizes = _random_layout(rng, shape, mesh_shape)
        st = _make(full, mesh, placements, sizes, seed + trial)
        assert st.shape == full.shape
        assert torch.equal(st.full_tensor(), full), (placements, sizes)
        # infer: one all-gather gives the same layout as the mapping
        inferred = ShardTensor.from_local(st.to_local(), mesh, st.placements, sharding_shapes="infer")
        assert inferred._spec == st._spec
        # public sharding_shapes round-trips through from_local
        again = ShardTensor.from_local(st.to_local(), mesh, st.placements, sharding_shapes=st.sharding_shapes)
        assert again._spec == st._spec
        # offsets locate the local chunk in the full tensor
        if not st._spec.has_partial:
            idx = tuple(slice(o, o + n) for o, n in zip(st.offsets, st.to_local().shape))
            assert torch.equal(full[idx], st.to_local())
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_from_local_full_tensor_round_trip(dist, world, mesh_shape):
    """from_local (mapping / infer / public sharding_shapes) -> full_tensor gives back the tensor exactly."""
    assert all(dist.run(world, _round_trips, mesh_shape, 100 + world))


# -------------------------------------------------------------------------------------------------
def _redistribute_chains(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    for trial in range(8):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 3)))
        full = _integer_tensor(rng, shape)
        placements, sizes = _random_layout(rng, shape, mesh_shape)
        leaf_st = _make(full, mesh, placements, sizes, seed + trial)
        leaf = leaf_st.to_local().detach().clone().requires_grad_()
        x = ShardTensor.from_local(leaf, mesh, placements, sharding_shapes=sizes)
        start_local = leaf.detach().clone()
        cur = x
        for _ in range(4):
            pl, sz = _random_layout(rng, shape, mesh_shape, allow_partial=False)
            cur = cur.redistribute(pl, sharding_shapes=sz)
            assert tuple(cur.placements) == tuple(pl)
            assert {m: s for m, s in enumerate(cur._spec.sizes) if s is not None} == {m: tuple(s) for m, s in sz.items()}
            assert torch.equal(cur.full_tensor(), full), (placements, sizes, pl, sz)
        # back to the starting layout (Partial re-created as rank-0-holds-all): same global values
        back = cur.redistribute([Replicate() if isinstance(p, Partial) else p for p in placements], sharding_shapes=sizes)
        if not any(isinstance(p, Partial) for p in placements):
            assert torch.equal(back.to_local(), start_local)
        # backward of a chain is the reverse chain: the gradient of sum(full * g) is g's piece
        g = _integer_tensor(random.Random(seed + 1000 + trial), shape)
        (back.full_tensor() * g).sum().backward()
        gl = ShardTensor.from_local(leaf.grad, mesh, [Replicate() if isinstance(p, Partial) else p for p in placements],
                                    sharding_shapes=sizes)
        assert torch.equal(gl.full_tensor(), g), "gradient of a redistribution chain"
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_redistribute_chains_and_gradients(dist, world, mesh_shape):
    """Random chains of Shard(i)<->Shard(j), uneven resizes, Shard<->Replicate and Partial->* keep the
    global tensor exactly; the gradient through a chain is the identity."""
    assert all(dist.run(world, _redistribute_chains, mesh_shape, 200 + world))


# -------------------------------------------------------------------------------------------------
def _all_pairs(mesh_shape, seed):
    """Every ordered pair of placements on each mesh dim, with uneven sizes, one step each."""
    mesh = get_mesh(mesh_shape)
    rng = random.Random(seed)
    shape = (5, 7)
    full = _integer_tensor(rng, shape)
    choices = [Shard(0), Shard(1), Replicate(), Partial("sum")]
    count = 0
    for a in choices:
        for b in choices[:3]:
            pl_a = [a] + [Replicate()] * (len(mesh_shape) - 1)
            pl_b = [b] + [Replicate()] * (len(mesh_shape) - 1)
            sz_a = {0: random_sizes(shape[a.dim], mesh_shape[0], rng)} if isinstance(a, Shard) else {}
            sz_b = {0: random_sizes(shape[b.dim], mesh_shape[0], rng)} if isinstance(b, Shard) else {}
            x = _make(full, mesh, pl_a, sz_a, seed)
            y = x.redistribute(pl_b, sharding_shapes=sz_b)
            assert torch.equal(y.full_tensor(), full), (a, sz_a, b, sz_b)
            if isinstance(b, Shard):
                k = mesh.get_coordinate()[0]
                o = sum(sz_b[0][:k])
                assert torch.equal(y.to_local(), full.narrow(b.dim, o, sz_b[0][k]))
            count += 1
    # Partial(max/min/avg) -> Replicate
    for op, red in (("max", torch.amax), ("min", torch.amin), ("avg", torch.mean)):
        terms = torch.stack([_integer_tensor(random.Random(seed + r), shape) for r in range(mesh_shape[0])])
        k = mesh.get_coordinate()[0]
        x = ShardTensor.from_local(terms[k], mesh, [Partial(op)] + [Replicate()] * (len(mesh_shape) - 1))
        assert torch.allclose(x.full_tensor(), red(terms, 0), atol=1e-12)
    return count


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_every_placement_pair(dist, world, mesh_shape):
    assert all(c == 12 for c in dist.run(world, _all_pairs, mesh_shape, 300 + world))


# -------------------------------------------------------------------------------------------------
def _two_d_mesh_h_w():
    """A tensor sharded on H over one mesh axis and W over the other, unevenly, and back."""
    mesh = get_mesh((2, 2), ("dp", "domain"))
    full = torch.arange(5 * 7 * 3, dtype=torch.float64).reshape(5, 7, 3)
    x = df.distribute_tensor(full, mesh, [Shard(0), Shard(1)], sharding_shapes={0: (4, 1), 1: (0, 7)})
    c = mesh.get_coordinate()
    assert x.to_local().shape == ((4, 1)[c[0]], (0, 7)[c[1]], 3)
    y = x.redistribute([Shard(1), Shard(0)], sharding_shapes={"dp": (3, 4), "domain": (2, 3)})
    assert y.to_local().shape == ((2, 3)[c[1]], (3, 4)[c[0]], 3)
    assert torch.equal(y.full_tensor(), full)
    z = y.redistribute([Replicate(), Shard(2)], sharding_shapes={1: (3, 0)})
    assert torch.equal(z.full_tensor(), full)
    return True


def test_two_d_mesh_h_and_w(dist):
    assert all(dist.run(4, _two_d_mesh_h_w))


# -------------------------------------------------------------------------------------------------
def _scatter(mesh_shape, seed):
    mesh = get_mesh(mesh_shape)
    rank, world = rank_and_world()
    rng = random.Random(seed)
    for trial in range(4):
        shape = (rng.randint(1, 9), rng.randint(1, 4))
        full = _integer_tensor(random.Random(seed + trial), shape)
        placements, sizes = _random_layout(rng, shape, mesh_shape, allow_partial=False)
        src = trial % world
        from domainflow import comm

        comm.stats.reset()
        st = df.scatter_tensor(full if rank == src else None, src, mesh, placements, sharding_shapes=sizes)
        ref = df.distribute_tensor(full, mesh, placements, sharding_shapes=sizes)
        assert st._spec == ref._spec
        assert torch.equal(st.to_local(), ref.to_local())
        # the source sends each rank only its own piece: bytes sent = all pieces but its own
        if rank == src:
            others = full.numel() * 8 if all(isinstance(p, Shard) for p in placements) else None
            if others is not None:
                assert comm.stats.bytes["scatter"] == others - st.to_local().numel() * 8
    return True


@pytest.mark.parametrize("world,mesh_shape", CASES, ids=IDS)
def test_scatter_tensor_sends_pieces(dist, world, mesh_shape):
    assert all(dist.run(world, _scatter, mesh_shape, 400 + world))


# -------------------------------------------------------------------------------------------------
def _mismatch_error(kind):
    mesh = get_mesh((rank_and_world()[1],))
    rank = rank_and_world()[0]
    if kind == "ndim":
        local = torch.zeros((2, 3) if rank == 0 else (2, 3, 1))
    else:
        local = torch.zeros((2, 3) if rank == 0 else (2, 4))
    try:
        ShardTensor.from_local(local, mesh, [Shard(0)])
    except df.ShardingMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["ndim", "unsharded-dim"])
def test_from_local_mismatch_is_a_clear_error_on_every_rank(dist, kind):
    """Ranks whose chunks do not form one tensor all raise the same error naming the ranks."""
    msgs = dist.run(3, _mismatch_error, kind)
    assert all(m is not None for m in msgs)
    assert len(set(msgs)) == 1
    assert "rank 1" in msgs[0]


def _bad_mapping():
    mesh = get_mesh((2,))
    try:
        ShardTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)], sharding_shapes={0: (3, 3, 1)})
    except df.ShardingShapeError as e:
        return str(e)


def test_bad_sharding_shapes_mapping(dist):
    msgs = dist.run(2, _bad_mapping)
    assert all("mesh dim" in m for m in msgs)


# -------------------------------------------------------------------------------------------------
def _dtensor_interop():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    leaf = full.clone().requires_grad_()
    x = df.distribute_tensor(leaf, mesh, [Shard(0)])  # chunk layout: DTensor's
    dt = x.to_dtensor()
    assert torch.equal(dt.full_tensor(), full)
    back = ShardTensor.from_dtensor(dt)
    assert back._spec == x._spec
    (back.full_tensor() * 2).sum().backward()
    # distribute_tensor's input is replicated: every rank gets the gradient of the whole tensor
    assert torch.equal(leaf.grad, torch.full_like(full, 2.0))
    uneven = x.redistribute([Shard(0)], sharding_shapes={0: (7,) + (0,) * (mesh.shape[0] - 1)})
    if mesh.shape[0] > 1:
        with pytest.raises(df.ShardingShapeError):
            uneven.to_dtensor()
    ok = uneven.redistribute([Shard(0)], sharding_shapes="chunk").to_dtensor()
    assert torch.equal(ok.full_tensor(), full)
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_dtensor_interop(dist, world):
    assert all(dist.run(world, _dtensor_interop))


# -------------------------------------------------------------------------------------------------
def _mesh_errors():
    rank, world = rank_and_world()
    out = {}
    try:
        df.init_mesh((world + 1,), ("domain",))
    except ValueError as e:
        out["size"] = str(e)
    try:
        df.init_mesh((world,), ("dp", "domain"))
    except ValueError as e:
        out["names"] = str(e)
    mesh = get_mesh((world,))
    # "chunk" with a global shape: torch.chunk sizes, no communication
    from domainflow import comm
    from domainflow.layout import shapes

    sizes = shapes.chunk_sizes(7, world)
    comm.stats.reset()
    x = ShardTensor.from_local(torch.zeros(sizes[rank], 2), mesh, [Shard(0)], sharding_shapes="chunk", shape=(7, 2))
    out["chunk_sizes_ok"] = x._spec.sizes[0] == sizes and sum(comm.stats.calls.values()) == 0
    return out


def test_init_mesh_errors_and_chunk_layout(dist):
    for out in dist.run(2, _mesh_errors):
        assert "needs 3 ranks but the job has 2" in out["size"] and "torchrun" in out["size"]
        assert "names" in out["names"]
        assert out["chunk_sizes_ok"]


def _distribute_copies():
    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    full = torch.arange(12.0).reshape(6, 2)
    before = full.clone()
    shard = df.distribute_tensor(full, mesh, [Shard(0)])
    rep = df.distribute_tensor(full, mesh, [df.Replicate()])
    shard._local.add_(100.0)
    rep._local.mul_(-1.0)
    with torch.no_grad():
        shard.add_(1.0)
    return torch.equal(full, before), shard._local.is_contiguous()


@pytest.mark.parametrize("world", [1, 2])
def test_distribute_tensor_shards_are_copies(dist, world):
    """Like DTensor: writing into a shard (or a replicated copy) leaves the caller's tensor as it was."""
    for unchanged, contiguous in dist.run(world, _distribute_copies):
        assert unchanged and contiguous


def _leaf_grads_keep_layout(op: str):
    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    x = torch.randn(4, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sizes = {2: [5, 2], 3: [3, 0, 4]}[world]
    fns = {"cumsum": lambda t: t.cumsum(1), "max": lambda t: t.max(dim=1).values,
           "reshape": lambda t: t.reshape(4, 21), "transpose": lambda t: t.transpose(0, 1).sin()}
    f = fns[op]
    out = []
    for how in ("requires_grad_", "setter", "constructor"):
        base = df.distribute_tensor(x, mesh, [Shard(1)], sharding_shapes={0: sizes}).detach()
        if how == "requires_grad_":
            leaf = base.requires_grad_()
        elif how == "setter":
            base.requires_grad = True
            leaf = base
        else:
            leaf = ShardTensor(base._local.clone(), base._spec, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "moved the shard off dim 1" is expected for cumsum/max
            for _ in range(2):  # the second backward accumulates into the first's .grad
                (f(leaf) ** 2).sum().backward()
        ref = x.clone().requires_grad_()
        for _ in range(2):
            (f(ref) ** 2).sum().backward()
        out.append((leaf.grad._spec == leaf._spec, float((leaf.grad.full_tensor() - ref.grad).abs().max())))
    return out


@pytest.mark.parametrize("op", ["cumsum", "max", "reshape", "transpose"])
def test_gradients_of_shardtensor_leaves_have_the_leafs_layout(dist, op):
    """Backward may produce a leaf's gradient in another layout (cumsum along the sharded dim: moved off it;
    max over it: replicated; reshape: re-chunked); the leaf's .grad is laid out like the leaf, exactly."""
    for world in (2, 3):
        for rank_out in dist.run(world, _leaf_grads_keep_layout, op):
            for same, err in rank_out:
                assert same and err < 1e-12, rank_out


D = torch.float64


TOL = 1e-10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rank() -> int:
    return torch.distributed.get_rank()


# =================================================================================================
# 3. distribute_tensor / scatter_tensor with Partial placements, dtypes, 2-D meshes
# =================================================================================================
def _distribute_partial_bool():
    mesh = get_mesh((rank_and_world()[1],))
    t = torch.tensor([True, False, True])
    probs = []
    for op in ("sum", "max", "min", "product"):
        st = df.distribute_tensor(t, mesh, [Partial(op)])
        # checked without a collective: a mismatched dtype makes Gloo abort the process
        if st.dtype != torch.bool or st.to_local().dtype != torch.bool:
            probs.append(f"Partial({op}): local dtype {st.to_local().dtype}, wrapper dtype {st.dtype}")
    return probs


def test_distribute_tensor_partial_keeps_bool_dtype(dist):
    # Regression test (bug found in review, now fixed): distribute_tensor(bool_tensor, mesh, [Partial("sum")]) makes the non-zero ranks' local
    # `piece * 0` (and `piece * 0 + 1` for "product"), which is int64 for a bool tensor, while rank 0
    # keeps bool. full_tensor() then all-reduces 1-byte buffers against 8-byte ones: Gloo aborts the
    # process (SIGABRT "Received data size doesn't match expected size"). Root cause:
    # shard_tensor.distribute_tensor's `piece * 0` instead of partial_from_replicate/zeros_like.
    _no_problems(dist.run(3, _distribute_partial_bool))


def _distribute_partial_inf():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    t = torch.tensor([float("inf"), 1.5, float("-inf")], dtype=D)
    probs = []
    for op in ("sum", "avg", "max", "min", "product"):
        got = df.distribute_tensor(t, mesh, [Partial(op)]).full_tensor()
        if not torch.equal(got, t):
            probs.append(f"distribute_tensor Partial({op}): {got.tolist()} != {t.tolist()}")
        got = df.scatter_tensor(t if _rank() == 0 else None, 0, mesh, [Partial(op)]).full_tensor()
        if not torch.equal(got, t):
            probs.append(f"scatter_tensor Partial({op}): {got.tolist()} != {t.tolist()}")
    return probs


def test_distribute_tensor_partial_with_infinities(dist):
    # Regression test (bug found in review, now fixed): distribute_tensor(t, mesh, [Partial("sum")]) with t containing +-inf gives NaN there:
    # the other ranks hold `inf * 0 = nan` (and `inf * 0 + 1 = nan` for "product"). scatter_tensor
    # (which uses partial_from_replicate -> zeros_like/ones_like) is right. Root cause:
    # shard_tensor.distribute_tensor uses `piece * 0` "to keep the autograd link".
    _no_problems(dist.run(3, _distribute_partial_inf))


def _distribute_grad_to_replicated_input(placement):
    """A tensor every rank holds (like a replicated parameter, e.g. a learned positional field)
    distributed with distribute_tensor and used in a loss: its gradient on every rank must equal the
    single-process gradient, as it does for Replicate() and for plain parameters used with
    ShardTensors (DESIGN: replicated parameters get single-device gradients)."""
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    gen = _gen(4)
    full = torch.randn(5, 2, generator=gen, dtype=D)
    cot = torch.randn(5, 2, generator=gen, dtype=D)
    pl = {"replicate": Replicate(), "shard": Shard(0), "partial_sum": Partial("sum")}[placement]
    ref = full.clone().requires_grad_()
    ((ref * cot) ** 2).sum().backward()
    p = full.clone().requires_grad_()
    loss = ((df.distribute_tensor(p, mesh, [pl], sharding_shapes={0: (1, 4, 0)} if placement == "shard" else None)
             * cot) ** 2).sum()
    loss.backward()
    probs = []
    if p.grad is None or not torch.allclose(p.grad, ref.grad, rtol=0, atol=TOL):
        rows = [] if p.grad is None else [i for i in range(5) if not torch.allclose(p.grad[i], ref.grad[i])]
        probs.append(f"{placement}: p.grad differs from the single-process gradient in rows {rows}")
    # control: the same tensor used as a plain operand with a sharded activation
    q = full.clone().requires_grad_()
    z = df.distribute_tensor(torch.zeros(5, 2, dtype=D), mesh, [Shard(0)], sharding_shapes={0: (1, 4, 0)})
    (((z + q) * cot) ** 2).sum().backward()
    if not torch.allclose(q.grad, ref.grad, rtol=0, atol=TOL):
        probs.append("control (plain operand) gradient wrong")
    return probs


@pytest.mark.parametrize("placement", ["replicate",
                                       # Regression test (bug found in review, now fixed): shard, partial_sum
                                       "shard", "partial_sum"])
def test_distribute_tensor_gradient_of_replicated_input(dist, placement):
    # Regression test (bug found in review, now fixed): distribute_tensor(p, mesh, [Shard(0)]) with p replicated (every rank
    # holds the same p, requires_grad) gives each rank's p.grad only its own rows (others 0); with
    # [Partial("sum")] rank 0 gets the whole gradient and the others 0. With [Replicate()], and with
    # p used as a plain operand (`z + p`, the dispatcher's reduce-to-plain hook), every rank gets the
    # single-process gradient. distribute_tensor's narrow/`* 0` pieces are plain tensors that never get
    # the hook (dispatch.hook_plain_grads), so the partial gradients are never summed. If per-rank
    # partial gradients are the intended semantics, it should be documented (and made consistent
    # with Replicate).
    _no_problems(dist.run(3, _distribute_grad_to_replicated_input, placement))


def _scatter_2d_dtypes():
    mesh = get_mesh((2, 2), ("a", "b"))
    me = _rank()
    gen = _gen(5)
    base = torch.randn(5, 4, 3, generator=gen, dtype=D)
    probs = []
    layouts = (([Shard(0), Shard(1)], {0: (0, 5), 1: (4, 0)}),
               ([Shard(1), Shard(0)], {"a": (1, 3), "b": (5, 0)}),
               ([Replicate(), Shard(2)], {1: (0, 3)}))
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        full = (base > 0) if dt == torch.bool else (base * 10).to(dt)
        for pl, sz in layouts:
            try:
                st = df.scatter_tensor(full if me == 3 else None, 3, mesh, pl, sharding_shapes=sz)
                if st.dtype != dt or not torch.equal(st.full_tensor(), full):
                    probs.append(f"{dt} scatter {pl}")
                inf = ShardTensor.from_local(st.to_local(), mesh, pl, "infer")
                if inf.spec != st.spec or inf.dtype != dt:
                    probs.append(f"{dt} from_local('infer') {pl}: {inf.spec} vs {st.spec}")
                for tpl in ([Shard(2), Shard(0)], [Replicate(), Shard(1)], [Shard(1), Replicate()]):
                    rd = st.redistribute(tpl, "balanced")
                    if rd.dtype != dt or not torch.equal(rd.full_tensor(), full):
                        probs.append(f"{dt} redistribute {pl} -> {tpl}")
            except Exception as e:  # noqa: BLE001
                probs.append(f"{dt} {pl}: {_err(e)}")
    # Partial placements through scatter (src 2) and distribute on the 2-D mesh
    full = torch.arange(20, dtype=D).reshape(5, 4) - 7
    for pl, sz in (([Partial("sum"), Shard(0)], {"b": (0, 5)}), ([Shard(1), Partial("max")], {"a": (4, 0)}),
                   ([Partial("avg"), Partial("min")], None), ([Partial("product"), Shard(1)], {1: (1, 3)})):
        try:
            st = df.scatter_tensor(full if me == 2 else None, 2, mesh, pl, sharding_shapes=sz)
            d = df.distribute_tensor(full, mesh, pl, sharding_shapes=sz)
            if not torch.equal(st.full_tensor(), full) or not torch.equal(d.full_tensor(), full) or st.spec != d.spec:
                probs.append(f"Partial layout {pl}")
            if len({p.reduce_op for p in pl if isinstance(p, Partial)}) == 1:
                if not torch.equal(st.redistribute(st.placements, "chunk").to_dtensor().full_tensor(), full):
                    probs.append(f"to_dtensor {pl}")
        except Exception as e:  # noqa: BLE001
            probs.append(f"Partial layout {pl}: {_err(e)}")
    return probs


def test_scatter_from_local_redistribute_dtypes_on_2d_mesh(dist):
    _no_problems(dist.run(4, _scatter_2d_dtypes))


def _partial_dtypes():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    me = _rank()
    gen = _gen(6)
    allv = torch.randn(world, 6, generator=gen, dtype=D) * 5
    probs = []
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        vals = (allv > 0) if dt == torch.bool else allv.to(dt)
        ops = ("sum", "max", "min") if dt == torch.bool else ("sum", "max", "min", "product") + \
            (("avg",) if dt.is_floating_point else ())
        for op in ops:
            try:
                got = ShardTensor.from_local(vals[me].clone(), mesh, [Partial(op)], "infer").full_tensor()
            except Exception as e:  # noqa: BLE001
                probs.append(f"{dt} Partial({op}): {_err(e)}")
                continue
            if dt == torch.bool:
                want = {"sum": vals.any(0), "max": vals.any(0), "min": vals.all(0)}[op]
            else:
                v64 = vals.double()
                want = {"sum": v64.sum(0), "avg": v64.mean(0), "max": v64.amax(0), "min": v64.amin(0),
                        "product": v64.prod(0)}[op]
            tol = {torch.bfloat16: 5e-2, torch.float32: 1e-5}.get(dt, 0)
            if got.dtype != dt or not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol):
                probs.append(f"{dt} Partial({op}): {got.tolist()} != {want.tolist()}")
    return probs


def test_partial_full_tensor_dtypes(dist):
    _no_problems(dist.run(3, _partial_dtypes))


# =================================================================================================
# 6. Python-level tensor API: global semantics, no hidden communication
# =================================================================================================
def _python_api():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    gen = _gen(8)
    full = torch.randn(5, 3, generator=gen, dtype=D)
    sizes = (0, 4, 1)
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
    probs = []

    def check(name, fn, want):
        try:
            got = fn()
            if got != want:
                probs.append(f"{name}: {got!r} != {want!r}")
        except Exception as e:  # noqa: BLE001
            probs.append(f"{name}: {_err(e)}")

    # metadata is global, and needs no communication: run it on rank 0 only, then check that the
    # ranks are still in step (a collective right after) and that nothing was sent
    df.comm.stats.reset()
    if _rank() == 0:
        check("len", lambda: len(x), 5)
        check("shape", lambda: tuple(x.shape), (5, 3))
        check("size", lambda: (tuple(x.size()), x.size(0), x.size(-1)), ((5, 3), 5, 3))
        check("dim", lambda: x.dim(), 2)
        check("numel", lambda: (x.numel(), x.nelement()), (15, 15))
        r = repr(x)
        if "ShardTensor" not in r or "(5, 3)" not in r or "Shard(0)[0, 4, 1]" not in r:
            probs.append(f"repr lacks global shape / layout: {r}")
        if str(x) != r:
            probs.append("str != repr")
    if sum(df.comm.stats.calls.values()):
        probs.append(f"metadata / repr communicated: {dict(df.comm.stats.calls)}")
    check("still in step", lambda: torch.equal(x.full_tensor(), full), True)
    # values: global on every rank
    check("item(sum)", lambda: abs(x.sum().item() - full.sum().item()) < TOL, True)
    check("item(element)", lambda: x[3, 1].item(), full[3, 1].item())
    check("item(1-element)", lambda: df.distribute_tensor(full[0, :1], mesh, [Shard(0)],
                                                          sharding_shapes={0: (0, 0, 1)}).item(), full[0, 0].item())
    check("float(amax)", lambda: float(x.amax()), float(full.amax()))
    check("int(argmin)", lambda: int(x.argmin()), int(full.argmin()))
    check("if x.sum() > 0", lambda: bool(x.sum() > 0), bool(full.sum() > 0))
    check("if (x > 2).any()", lambda: bool((x > 1.5).any()), bool((full > 1.5).any()))
    check("iteration", lambda: [row.full_tensor().tolist() for row in x], full.tolist())
    check("x[-1]", lambda: x[-1].full_tensor().tolist(), full[-1].tolist())
    check("x[-4]", lambda: x[-4].full_tensor().tolist(), full[-4].tolist())
    check("unbind(1)", lambda: [t.full_tensor().tolist() for t in x.unbind(1)], [t.tolist() for t in full.unbind(1)])
    check("in", lambda: full[3, 2].item() in x, True)
    check("torch.equal", lambda: torch.equal(x, full), True)
    check("x.T", lambda: x.T.full_tensor().tolist(), full.T.tolist())
    check("int sum", lambda: int(df.distribute_tensor(torch.arange(7), mesh, [Shard(0)]).sum()), 21)
    # .tolist(): the global list, or a clear error -- never this rank's chunk
    try:
        got = x.tolist()
        if got != full.tolist():
            probs.append(f"tolist returned {got}")
    except (RuntimeError, TypeError, df.UnsupportedShardedOp):
        pass
    return probs


def test_python_api_is_global_and_metadata_does_not_communicate(dist):
    _no_problems(dist.run(3, _python_api))
