"""2-D device meshes and sub-meshes of a ("dp", "domain") mesh: tensors sharded on two mesh dims, the same
dim over two mesh dims, sub-mesh lookups, a block trained with SGD on 1-D and 2-D meshes equal to one process."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh, random_sizes

import domainflow as df
from domainflow import Replicate, Shard, ShardTensor
from sweep import error_line as _err, no_problems as _no_problems, none_failed as _ok, check_into as _run, randn as _t

D = torch.float64


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


TOL = 1e-10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rank() -> int:
    return torch.distributed.get_rank()


def _dp_domain_mesh():
    return get_mesh((2, 2), ("dp", "domain"))


# =================================================================================================
# 1. sub-meshes of a ("dp", "domain") 2x2 mesh
# =================================================================================================
def _submesh_layouts():
    mesh = _dp_domain_mesh()
    dom, dp = mesh["domain"], mesh["dp"]
    me, c = _rank(), mesh.get_coordinate()
    probs = []
    # each dp group holds a different sample, of a different length, with its own uneven split
    n = 5 + c[0]
    full = torch.arange(n * 3, dtype=D).reshape(n, 3) + 100 * c[0]
    sizes = (n, 0) if c[0] == 0 else (1, n - 1)
    src = dom.mesh.tolist()[-1]                 # the last rank of this rank's domain group
    try:
        st = df.scatter_tensor(full if me == src else None, src, dom, [Shard(0)], sharding_shapes={"domain": sizes})
        if not torch.equal(st.full_tensor(), full):
            probs.append("scatter_tensor on mesh['domain']: wrong full_tensor")
        if st.spec.sizes != (sizes,) or st.to_local().shape[0] != sizes[c[1]]:
            probs.append(f"scatter_tensor on mesh['domain']: sizes {st.spec.sizes}, expected {sizes}")
        if [tuple(s) for s in st.sharding_shapes[0]] != [(k, 3) for k in sizes]:
            probs.append(f"sharding_shapes {st.sharding_shapes}")
        inf = ShardTensor.from_local(st.to_local(), dom, [Shard(0)], "infer")
        if inf.spec.sizes != (sizes,) or tuple(inf.shape) != (n, 3):
            probs.append(f"from_local('infer') on mesh['domain']: {inf.spec}")
        if not torch.equal(st.redistribute([Shard(1)]).full_tensor(), full):
            probs.append("redistribute Shard(0) -> Shard(1) on mesh['domain']")
        r2 = st.redistribute([Shard(0)], {"domain": (2, n - 2)})
        if not torch.equal(r2.full_tensor(), full) or r2.to_local().shape[0] != (2, n - 2)[c[1]]:
            probs.append("redistribute to named sizes on mesh['domain']")
        rep = st.redistribute([Replicate()])
        if not torch.equal(rep.to_local(), full):
            probs.append("redistribute to Replicate on mesh['domain']")
        dt = st.redistribute([Shard(0)], "chunk").to_dtensor()
        if not torch.equal(dt.full_tensor(), full):
            probs.append("to_dtensor on mesh['domain']")
        back = ShardTensor.from_dtensor(dt)
        if not torch.equal(back.full_tensor(), full) or back.placements != (Shard(0),):
            probs.append("from_dtensor on mesh['domain']")
        # sums over the sub-mesh only: each dp group gets its own sample's sum
        if not torch.allclose(st.sum(0).full_tensor(), full.sum(0), rtol=0, atol=TOL):
            probs.append("sum over mesh['domain']")
        # the other sub-mesh: shard over dp, the domain groups hold different data
        m = 4 + c[1]
        fdp = torch.arange(m * 2, dtype=D).reshape(m, 2) * (c[1] + 1)
        srcdp = dp.mesh.tolist()[0]
        sdp = df.scatter_tensor(fdp if me == srcdp else None, srcdp, dp, [Shard(0)], sharding_shapes={0: (m, 0)})
        if not torch.equal(sdp.full_tensor(), fdp):
            probs.append("scatter_tensor on mesh['dp']")
        if not torch.allclose(sdp.mean(0).full_tensor(), fdp.mean(0), rtol=0, atol=TOL):
            probs.append("mean over mesh['dp']")
    except Exception as e:  # noqa: BLE001
        probs.append(_err(e))
    return probs


def test_submesh_scatter_infer_redistribute_dtensor(dist):
    _no_problems(dist.run(4, _submesh_layouts))


def _submesh_two_lookups():
    mesh = _dp_domain_mesh()
    c = mesh.get_coordinate()
    full = torch.arange(14, dtype=D).reshape(7, 2) * (1 + c[0])
    sizes = (3, 4)
    x = df.distribute_tensor(full, mesh["domain"], [Shard(0)], sharding_shapes={0: sizes})
    y = df.distribute_tensor(full * 2, mesh["domain"], [Shard(0)], sharding_shapes={0: sizes})  # 2nd lookup
    probs = []
    for name, fn, want in (("x + y", lambda: x + y, 3 * full),
                           ("x * y", lambda: x * y, 2 * full * full),
                           ("mse_loss", lambda: F.mse_loss(x, y), ((full - 2 * full) ** 2).mean())):
        try:
            got = fn().full_tensor()
            if not torch.allclose(got, want, rtol=0, atol=TOL):
                probs.append(f"{name}: wrong value")
        except Exception as e:  # noqa: BLE001
            probs.append(f"{name}: {_err(e)}")
    return probs


def test_submesh_tensors_from_two_lookups_combine(dist):
    # Regression test (bug found in review, now fixed): DeviceMesh.__getitem__ returns a new (equal) DeviceMesh object on every lookup, and
    # ShardSpec equality/hash use mesh identity (`is`, id(mesh)). x on mesh["domain"] plus y on a
    # second mesh["domain"] lookup, same layout, raised AssertionError("redistribute planned
    # ShardSpec(...) instead of ShardSpec(...)") from plan_redistribute, now redistribute_steps (the two printed specs are
    # identical). Same for init_mesh called twice or a deepcopy'd ShardTensor (next test).
    _no_problems(dist.run(4, _submesh_two_lookups))


def _deepcopy_combine():
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    full = torch.arange(15, dtype=D).reshape(5, 3)
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: (0,) * (world - 1) + (5,)})
    probs = []
    try:
        y = copy.deepcopy(x)                 # e.g. an EMA copy of a model holding ShardTensor state
        if not torch.equal(y.full_tensor(), full):
            probs.append("deepcopy: wrong value")
        if not torch.equal((x + y).full_tensor(), 2 * full):
            probs.append("x + deepcopy(x): wrong value")
    except Exception as e:  # noqa: BLE001
        probs.append(_err(e))
    return probs


def test_deepcopy_of_shard_tensor_combines_with_original(dist):
    # Regression test (bug found in review, now fixed): copy.deepcopy(x) deep-copies the DeviceMesh inside the spec; the copy's spec then differs
    # from x's (mesh identity), and x + deepcopy(x) raised AssertionError in plan_redistribute (now redistribute_steps).
    # Same root cause as test_submesh_tensors_from_two_lookups_combine (ShardSpec.__eq__/__hash__).
    _no_problems(dist.run(3, _deepcopy_combine))


class Block(nn.Module):
    """Attention-free block on [B, N, C]: Linear, LayerNorm MLP with residual, softmax gate over
    channels, a learned per-channel scale, and a global context (mean over the sharded N)."""

    def __init__(self, c: int = 4, h: int = 8):
        super().__init__()
        self.inp = nn.Linear(c, h)
        self.ln = nn.LayerNorm(h)
        self.mlp1 = nn.Linear(h, 2 * h)
        self.mlp2 = nn.Linear(2 * h, h)
        self.gate = nn.Linear(h, h)
        self.out = nn.Linear(h, 1)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, h))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.mlp2(F.gelu(self.mlp1(self.ln(h))))
        h = h * torch.softmax(self.gate(h), dim=-1) * self.scale
        h = h + 0.5 * h.mean(dim=1, keepdim=True)
        return self.out(h)


def _loss_plain(out, y, model):
    return F.mse_loss(out, y)


def _loss_mixed(out, y, model):
    """A Partial global mean plus a plain (replicated) regulariser."""
    reg = sum((p ** 2).sum() for p in model.parameters())
    return 0.3 * out.pow(2).mean() + F.mse_loss(out, y) + 1e-3 * reg


def _loss_reg_first(out, y, model):
    """Plain term first, then Partial terms (one a mean over only the sharded and channel dims)."""
    reg = sum((p ** 2).sum() for p in model.parameters())
    return 1e-3 * reg + out.pow(2).mean(dim=(1, 2)).sum() * 0.2 + F.mse_loss(out, y)


_LOSSES = {"plain": _loss_plain, "mixed": _loss_mixed, "reg_first": _loss_reg_first}


def _submesh_training():
    """Samples split over dp by hand; each sample's N sharded over mesh['domain'] (a sub-mesh);
    gradients all-reduced over dp by the user: equals one process on the whole batch."""
    mesh = _dp_domain_mesh()
    dom = mesh["domain"]
    c = mesh.get_coordinate()
    gen = _gen(10)
    B, N, C = 2, 7, 4
    xf = torch.randn(B, N, C, generator=gen, dtype=D)
    yf = torch.randn(B, N, 1, generator=gen, dtype=D)
    sizes = ((0, 7), (4, 3))[c[0]]
    probs = []
    for lname in ("plain", "reg_first"):
        lf = _LOSSES[lname]
        torch.manual_seed(0)
        ref = Block().double()
        model = copy.deepcopy(ref)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        try:
            x = df.distribute_tensor(xf[c[0]:c[0] + 1], dom, [Shard(1)], sharding_shapes={"domain": sizes})
            y = df.distribute_tensor(yf[c[0]:c[0] + 1], dom, [Shard(1)], sharding_shapes={"domain": sizes})
            for _ in range(3):
                ropt.zero_grad()
                (sum(lf(ref(xf[b:b + 1]), yf[b:b + 1], ref) for b in range(B)) / B).backward()
                ropt.step()
                opt.zero_grad()
                lf(model(x), y, model).backward()
                for p in model.parameters():
                    if type(p.grad) is not torch.Tensor:
                        probs.append(f"{lname}: grad is {type(p.grad).__name__}")
                        return probs
                    torch.distributed.all_reduce(p.grad, group=mesh.get_group("dp"))
                    p.grad /= 2
                opt.step()
            err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
            if err > TOL:
                probs.append(f"{lname}: parameters differ by {err:.3e} after 3 steps")
        except Exception as e:  # noqa: BLE001
            probs.append(f"{lname}: {_err(e)}")
    return probs


def test_submesh_training_with_user_dp_allreduce(dist):
    _no_problems(dist.run(4, _submesh_training))


# =================================================================================================
# 4. a [B, N, C] block trained with SGD, N sharded: equals one process to 1e-10 in float64
# =================================================================================================
def _train(model, x, y, lossfn, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lossfn(model(x), y, model)
        loss.backward()
        opt.step()
        losses.append(loss.full_tensor().item() if isinstance(loss, ShardTensor) else loss.item())
    return losses


def _model_training(mesh_shape):
    mesh_shape = tuple(mesh_shape)
    mesh = _dp_domain_mesh() if len(mesh_shape) == 2 else get_mesh(mesh_shape, ("domain",))
    gen = _gen(9)
    B, N, C = 2, 7, 4
    xf = torch.randn(B, N, C, generator=gen, dtype=D)
    yf = torch.randn(B, N, 1, generator=gen, dtype=D)
    if len(mesh_shape) == 1:
        pl, sz = [Shard(1)], {0: {1: (7,), 2: (0, 7), 3: (3, 0, 4), 4: (2, 0, 5, 0)}[mesh_shape[0]]}
    else:
        pl, sz = [Shard(0), Shard(1)], {"dp": (1, 1), "domain": (5, 2)}
    probs = []
    for lname, lf in _LOSSES.items():
        torch.manual_seed(0)
        ref = Block().double()
        model = copy.deepcopy(ref)
        try:
            ref_losses = _train(ref, xf, yf, lf)
            x = df.distribute_tensor(xf, mesh, pl, sharding_shapes=sz)
            y = df.distribute_tensor(yf, mesh, pl, sharding_shapes=sz)
            losses = _train(model, x, y, lf)
        except Exception as e:  # noqa: BLE001
            probs.append(f"{lname}: {_err(e)}")
            continue
        dl = max(abs(a - b) for a, b in zip(ref_losses, losses))
        dp = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        if dl > TOL or dp > TOL:
            probs.append(f"{lname}: losses differ by {dl:.3e}, parameters by {dp:.3e}")
        bad = [n for n, p in model.named_parameters() if type(p.grad) is not torch.Tensor]
        if bad:
            probs.append(f"{lname}: non-plain gradients for {bad}")
    return probs


@pytest.mark.parametrize("world,mesh_shape", [(3, (3,)), (4, (4,)), (4, (2, 2))], ids=["ws3", "ws4", "2x2"])
def test_block_sgd_matches_one_process(dist, world, mesh_shape):
    _no_problems(dist.run(world, _model_training, mesh_shape))
