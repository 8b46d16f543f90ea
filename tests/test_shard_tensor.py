"""ShardTensor layouts on real process groups: construction, round trips, redistribution, DTensor interop.

Property style: random tensors with random uneven sharding sizes (zeros included) on world sizes
1-4 and 1-D / 2-D meshes; every check compares with the full tensor held in one process.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import domainflow as df
from dist_pool import WORLD_SIZES, rank_and_world
from domainflow import Partial, Replicate, Shard, ShardTensor
from sharded_check import get_mesh, mesh_shapes, random_sizes

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
