"""No silent de-sharding: writing a sharded ShardTensor into a plain tensor (``buf[idx] = x``, ``buf.copy_(x)``,
``buf.add_(x)``, ``out=`` variants, non-sum scatters into a fresh plain buffer) raises ShardingMismatchError naming
the op and the fix on every rank, never leaves a full-size plain copy on every rank; what is exact keeps working
(sharded or replicated destinations, replicated sources into plain tensors, messages summed into a fresh plain
buffer: graph networks' aggregation, one all-reduce of the buffer's size, no source gathered) and
fallback('gather') gathers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import get_mesh

import domainflow as df
from domainflow import Replicate, Shard, ShardTensor

D = torch.float64
N, C = 8, 3
# uneven layouts of N rows per world size, one with an empty shard
LAYOUTS = {2: [(5, 3), (0, 8)], 3: [(4, 1, 3), (3, 0, 5)]}


def _full():
    return torch.arange(N * C, dtype=D).reshape(N, C) / 7 - 1


def _outcome(fn):
    """('raised', error type, message) or ('value', is a ShardTensor, placements, full value)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return ("raised", type(e).__name__, str(e))
    if isinstance(out, ShardTensor):
        return ("value", True, tuple(out.placements), out.full_tensor())
    return ("value", False, None, out)


# =================================================================================================
# a sharded source into a plain destination: refused by name on every rank
# =================================================================================================
def _refused_cases(sizes):
    world = rank_and_world()[1]
    mesh = get_mesh((world,), ("domain",))
    full = _full()
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
    dst = torch.tensor([2, 0, 3, 3, 1, 0, 2, 1])
    i_sh = df.distribute_tensor(dst, mesh, [Shard(0)], sharding_shapes={0: sizes})
    ie_sh = df.distribute_tensor(dst[:, None].expand(N, C).contiguous(), mesh, [Shard(0)], sharding_shapes={0: sizes})
    perm = torch.tensor([3, 1, 0, 2, 7, 6, 4, 5])
    # a spatial field sharded on H; an rfft along W keeps the shard; a SpectralConv keeps the low modes
    H, W, m = N, 6, 2
    field = torch.arange(H * W * 2, dtype=D).reshape(H, W, 2).sin()
    xs = df.distribute_tensor(field, mesh, [Shard(0)], sharding_shapes={0: sizes})
    w = torch.randn(m, 2, generator=torch.Generator().manual_seed(0), dtype=torch.complex128)

    def spectral(u):
        u_ft = torch.fft.rfft(u, dim=1)
        out_ft = torch.zeros(H, W // 2 + 1, 2, dtype=torch.complex128)
        out_ft[:, :m] = u_ft[:, :m] * w
        return out_ft

    cases = {
        "buf[idx] = x": lambda: _setitem(torch.zeros(N, C, dtype=D), torch.arange(N), x),
        "buf[perm] = x": lambda: _setitem(torch.zeros(N, C, dtype=D), perm, x),
        "buf[...] = x": lambda: _setitem(torch.zeros(N, C, dtype=D), Ellipsis, x),
        "buf[:, :3] = x": lambda: _setitem(torch.zeros(N, 5, dtype=D), (slice(None), slice(0, 3)), x),
        "buf.copy_(x)": lambda: torch.zeros(N, C, dtype=D).copy_(x),
        "buf.add_(x)": lambda: torch.zeros(N, C, dtype=D).add_(x),
        "buf.mul_(x)": lambda: torch.ones(N, C, dtype=D).mul_(x),
        "buf.add_(x.sum(1, keepdim=True))": lambda: torch.zeros(N, C, dtype=D).add_(x.sum(1, keepdim=True)),
        "torch.mul(a, x, out=buf)": lambda: torch.mul(torch.ones(N, C, dtype=D), x, out=torch.empty(N, C, dtype=D)),
        "torch.add(x, 1, out=buf)": lambda: torch.add(x, 1, out=torch.empty(N, C, dtype=D)),
        "torch.index_select(x, 0, i, out=buf)":
            lambda: torch.index_select(x, 0, perm[:3], out=torch.empty(3, C, dtype=D)),
        "buf.index_reduce_(0, i, x, 'amax')": lambda: torch.zeros(4, C, dtype=D).index_reduce_(0, i_sh, x, "amax"),
        "buf.scatter_reduce_(0, idx, x, 'amax')": lambda: torch.zeros(4, C, dtype=D).scatter_reduce_(0, ie_sh, x,
                                                                                                   "amax"),
        "buf.index_add_(0, plain i, x)": lambda: torch.zeros(N, C, dtype=D).index_add_(0, perm, x),
        "buf.scatter_add_(0, plain idx, x)":
            lambda: torch.zeros(N, C, dtype=D).scatter_add_(0, perm[:, None].expand(N, C), x),
        "buf.scatter_(0, idx, x)": lambda: torch.zeros(N, C, dtype=D).scatter_(0, perm[:, None].expand(N, C), x),
        "buf.index_copy_(0, i, x)": lambda: torch.zeros(N, C, dtype=D).index_copy_(0, perm, x),
        "buf.masked_scatter_(mask, x)":
            lambda: torch.zeros(N, C, dtype=D).masked_scatter_(torch.ones(N, C, dtype=torch.bool), x),
        "buf.index_put_((i,), x)": lambda: torch.zeros(N, C, dtype=D).index_put_((perm,), x),
        "spectral conv out_ft[:, :m] = ...": lambda: spectral(xs),
        "foreach_add_([buf], [x])": lambda: _foreach_add([torch.zeros(N, C, dtype=D)], [x]),
    }
    return {name: _summary(_outcome(fn)) for name, fn in cases.items()}


def _setitem(buf, key, value):
    buf[key] = value
    return buf


def _foreach_add(dst, src):
    torch._foreach_add_(dst, src)
    return dst[0]


def _summary(outcome):
    if outcome[0] == "raised":
        return outcome
    return ("value", outcome[1], outcome[2], tuple(outcome[3].shape))


@pytest.mark.parametrize("world", (2, 3))
def test_sharded_source_into_plain_destination_raises_by_name_on_every_rank(dist, world):
    for sizes in LAYOUTS[world]:
        results = dist.run(world, _refused_cases, sizes)
        problems = []
        for name in results[0]:
            per_rank = [r[name] for r in results]
            if any(o[0] != "raised" or o[1] != "ShardingMismatchError" for o in per_rank):
                problems.append(f"{name} {sizes}: expected ShardingMismatchError on every rank, got "
                                f"{[o[:2] if o[0] == 'raised' else o for o in per_rank]}")
                continue
            msgs = {o[2] for o in per_rank}
            if len(msgs) != 1:
                problems.append(f"{name} {sizes}: the ranks raised different messages {msgs}")
            msg = per_rank[0][2]
            if "\n" in msg or ("plain tensor" not in msg and "plain destination" not in msg) or (
                    "'domain'" not in msg and "mesh dim" not in msg):
                problems.append(f"{name} {sizes}: message does not name the layouts in one line: {msg!r}")
            if name.startswith(("buf", "torch", "foreach")) and "plain tensor" in msg and "would gather" in msg:
                if "zeros_like" not in msg or "full_tensor()" not in msg:
                    problems.append(f"{name} {sizes}: message does not give the fix: {msg!r}")
        assert not problems, "\n".join(problems)


def _messages():
    world = rank_and_world()[1]
    mesh = get_mesh((world,), ("domain",))
    x = df.distribute_tensor(_full(), mesh, [Shard(0)], sharding_shapes={0: LAYOUTS[world][0]})
    out = {}
    for name, fn in {"copy_": lambda: torch.zeros(N, C, dtype=D).copy_(x),
                     "scatter_reduce_": lambda: torch.zeros(4, C, dtype=D).scatter_reduce_(
                         0, df.distribute_tensor(torch.zeros(N, C, dtype=torch.long), mesh, [Shard(0)],
                                                 sharding_shapes={0: LAYOUTS[world][0]}), x, "amax")}.items():
        out[name] = _outcome(fn)[2]
    return out


def test_refusal_names_op_layout_and_fix(dist):
    msgs = dist.run(2, _messages)[0]
    assert msgs["copy_"].startswith("copy_ of a ShardTensor (shape (8, 3) sharded on dim 0 over 'domain') into a "
                                    "plain tensor of shape (8, 3) would gather it onto every rank; allocate the "
                                    "destination from the ShardTensor (e.g. torch.zeros_like(x)) so it is sharded "
                                    "too, or call x.full_tensor() explicitly"), msgs["copy_"]
    assert "buf[...] = x" in msgs["copy_"]
    assert msgs["scatter_reduce_"].startswith("scatter_reduce_ of a ShardTensor (shape (8, 3)"), msgs["scatter_reduce_"]
    assert "only sums of messages go into a plain destination" in msgs["scatter_reduce_"]


# =================================================================================================
# what is exact keeps working
# =================================================================================================
def _allowed_cases(sizes):
    world = rank_and_world()[1]
    mesh = get_mesh((world,), ("domain",))
    full = _full()
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
    other = full.flip(0) * 2
    x2 = df.distribute_tensor(other, mesh, [Shard(0)], sharding_shapes={0: tuple(reversed(sizes))})
    xr = df.distribute_tensor(full, mesh, [Replicate()])
    perm = torch.tensor([3, 1, 0, 2, 7, 6, 4, 5])
    dst = torch.tensor([2, 0, 3, 3, 1, 0, 2, 1])
    i_sh = df.distribute_tensor(dst, mesh, [Shard(0)], sharding_shapes={0: sizes})
    ie_sh = df.distribute_tensor(dst[:, None].expand(N, C).contiguous(), mesh, [Shard(0)], sharding_shapes={0: sizes})
    H, W, m = N, 6, 2
    field = torch.arange(H * W * 2, dtype=D).reshape(H, W, 2).sin()
    xs = df.distribute_tensor(field, mesh, [Shard(0)], sharding_shapes={0: sizes})
    w = torch.randn(m, 2, generator=torch.Generator().manual_seed(0), dtype=torch.complex128)

    def spectral(u, alloc):
        u_ft = torch.fft.rfft(u, dim=1)
        out_ft = alloc(u_ft)
        out_ft[:, :m] = u_ft[:, :m] * w
        return out_ft

    def spectral_pad(u):
        u_ft = torch.fft.rfft(u, dim=1)
        low = u_ft[:, :m] * w
        return torch.cat([low, torch.zeros_like(u_ft[:, m:])], dim=1)

    def partial_sum():  # a pending sum (Partial) into a plain tensor: reduced, nothing is gathered
        return torch.zeros(C, dtype=D).copy_(x.sum(0))

    # name -> (the sharded call, the single-device call, "sharded" / "plain": the result's kind)
    cases = {
        "sharded_dst.copy_(plain)": (lambda: torch.zeros_like(x).copy_(other), lambda: other.clone(), "sharded"),
        "sharded_dst[...] = plain": (lambda: _setitem(torch.zeros_like(x), Ellipsis, other), lambda: other.clone(),
                                     "sharded"),
        "sharded_dst.copy_(sharded other sizes)": (lambda: torch.zeros_like(x).copy_(x2), lambda: other.clone(),
                                                   "sharded"),
        "sharded_dst.add_(sharded)": (lambda: (x * 1.0).add_(x2), lambda: full + other, "sharded"),
        "sharded_dst.index_add_(0, i, plain)": (lambda: torch.zeros_like(x).index_add_(0, perm, other),
                                                lambda: torch.zeros(N, C, dtype=D).index_add_(0, perm, other),
                                                "sharded"),
        "plain.copy_(replicated)": (lambda: torch.zeros(N, C, dtype=D).copy_(xr), lambda: full.clone(), "plain"),
        "plain[...] = replicated": (lambda: _setitem(torch.zeros(N, C, dtype=D), Ellipsis, xr), lambda: full.clone(),
                                    "plain"),
        "plain.add_(replicated)": (lambda: torch.ones(N, C, dtype=D).add_(xr), lambda: full + 1, "plain"),
        "torch.mul(a, replicated, out=plain)": (
            lambda: torch.mul(torch.ones(N, C, dtype=D) * 2, xr, out=torch.empty(N, C, dtype=D)),
            lambda: full * 2, "plain"),
        "plain.index_add_(0, i, replicated)": (
            lambda: torch.zeros(N, C, dtype=D).index_add_(0, perm, xr),
            lambda: torch.zeros(N, C, dtype=D).index_add_(0, perm, full), "plain"),
        "plain.copy_(partial sum)": (partial_sum, lambda: full.sum(0), "plain"),
        # graph networks' aggregation: the sums of every rank's messages, all-reduced into the plain buffer
        "plain.index_add_(0, i, sharded)": (lambda: torch.zeros(4, C, dtype=D).index_add_(0, i_sh, x),
                                           lambda: torch.zeros(4, C, dtype=D).index_add_(0, dst, full), "plain"),
        "plain.scatter_add_(0, idx, sharded)": (
            lambda: torch.zeros(4, C, dtype=D).scatter_add_(0, ie_sh, x),
            lambda: torch.zeros(4, C, dtype=D).scatter_add_(0, dst[:, None].expand(N, C), full), "plain"),
        "spectral conv, out_ft = zeros_like(u_ft)": (
            lambda: spectral(xs, torch.zeros_like), lambda: spectral(field, torch.zeros_like), "sharded"),
        "spectral conv, out_ft = u_ft.new_zeros (replicated)": (
            lambda: spectral(xs, lambda t: t.new_zeros(t.shape)), lambda: spectral(field, torch.zeros_like),
            "sharded or replicated"),
        "spectral conv out of place (cat)": (lambda: spectral_pad(xs), lambda: spectral_pad(field), "sharded"),
        "replicated_dst[:, :3] = sharded": (
            lambda: _setitem(x.new_zeros(N, 5), (slice(None), slice(0, 3)), x),
            lambda: _setitem(torch.zeros(N, 5, dtype=D), (slice(None), slice(0, 3)), full), "sharded or replicated"),
    }
    problems = []
    for name, (fn, ref_fn, kind) in cases.items():
        got, want = _outcome(fn), ref_fn()
        if got[0] == "raised":
            problems.append(f"{name} {sizes}: raised {got[1]}: {got[2][:200]}")
            continue
        _, is_st, placements, value = got
        if kind == "sharded" and not (is_st and any(isinstance(p, Shard) for p in placements)):
            problems.append(f"{name} {sizes}: expected a sharded result, got "
                            f"{placements if is_st else 'a plain tensor'}")
        elif kind == "plain" and is_st:
            problems.append(f"{name} {sizes}: expected the plain destination back, got a ShardTensor")
        elif kind == "sharded or replicated" and not is_st:
            problems.append(f"{name} {sizes}: expected a ShardTensor, got a plain tensor")
        if value.shape != want.shape or not torch.allclose(value, want, atol=1e-12, rtol=1e-12):
            problems.append(f"{name} {sizes}: wrong values")
    return problems


@pytest.mark.parametrize("world", (2, 3))
def test_exact_writes_keep_working(dist, world):
    for sizes in LAYOUTS[world]:
        problems = [p for ps in dist.run(world, _allowed_cases, sizes) for p in ps]
        assert not problems, "\n".join(problems)


def _view_of_replicated():
    """A replicated buffer whose slice receives a sharded source: the whole buffer is right on every rank."""
    world = rank_and_world()[1]
    mesh = get_mesh((world,), ("domain",))
    full = _full()
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: LAYOUTS[world][0]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buf = x.new_zeros(N, 5)
        buf[:, 1:4] = x
        buf[2:5, 4:].add_(x[2:5, :1])
    want = torch.zeros(N, 5, dtype=D)
    want[:, 1:4] = full
    want[2:5, 4:] += full[2:5, :1]
    return torch.equal(buf.full_tensor(), want), tuple(buf.placements), buf.to_local().clone()


@pytest.mark.parametrize("world", (2, 3))
def test_slice_of_replicated_buffer_receives_sharded_source(dist, world):
    # Regression test: the pointwise rule relaid out the slice (a view) to the source's sharding alone,
    # leaving the replicated base stale and different on every rank: silently wrong (x.new_zeros(...)
    # followed by buf[..., :m] = sharded is the fix the refusal above points to).
    results = dist.run(world, _view_of_replicated)
    for ok, placements, local in results:
        assert ok, "the buffer's full value differs from one device's"
        assert placements == (Replicate(),)
        assert torch.equal(local, results[0][2]), "a replicated buffer must hold the same values on every rank"


# =================================================================================================
# fallback('gather'): the user asked for gathering
# =================================================================================================
def _gathered():
    world = rank_and_world()[1]
    mesh = get_mesh((world,), ("domain",))
    sizes = LAYOUTS[world][0]
    full = _full()
    x = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
    dst = torch.tensor([2, 0, 3, 3, 1, 0, 2, 1])
    i_sh = df.distribute_tensor(dst, mesh, [Shard(0)], sharding_shapes={0: sizes})
    ie_sh = df.distribute_tensor(dst[:, None].expand(N, C).contiguous(), mesh, [Shard(0)], sharding_shapes={0: sizes})
    cases = {
        "scatter_add_ into torch.zeros": (lambda: torch.zeros(4, C, dtype=D).scatter_add_(0, ie_sh, x),
                                          lambda: torch.zeros(4, C, dtype=D).scatter_add_(0, dst[:, None].expand(N, C),
                                                                                          full)),
        "index_add_ into torch.zeros": (lambda: torch.zeros(4, C, dtype=D).index_add_(0, i_sh, x),
                                        lambda: torch.zeros(4, C, dtype=D).index_add_(0, dst, full)),
        "copy_": (lambda: torch.zeros(N, C, dtype=D).copy_(x), lambda: full.clone()),
        "buf[..., 1:] = x": (lambda: _setitem(torch.zeros(N, C + 1, dtype=D), (Ellipsis, slice(1, None)), x),
                             lambda: torch.cat([torch.zeros(N, 1, dtype=D), full], 1)),
        "add_": (lambda: torch.ones(N, C, dtype=D).add_(x), lambda: full + 1),
        "mul out=": (lambda: torch.mul(full, x, out=torch.empty(N, C, dtype=D)), lambda: full * full),
    }
    problems = []
    with df.fallback("gather"):
        for name, (fn, ref_fn) in cases.items():
            got = _outcome(fn)
            if got[0] == "raised":
                problems.append(f"{name}: raised {got[1]}: {got[2][:200]}")
            elif got[1]:
                problems.append(f"{name}: the plain destination should come back, got a ShardTensor")
            elif not torch.allclose(got[3], ref_fn(), atol=1e-12, rtol=1e-12):
                problems.append(f"{name}: wrong values")
    return problems


@pytest.mark.parametrize("world", (2, 3))
def test_gather_fallback_writes_whole_into_plain_destinations(dist, world):
    # Regression test: under fallback('gather') an in-place scatter into a fresh plain tensor crashed with
    # IndexError in toolkit.common_mesh (the fallback was handed only the plain tensor).
    problems = [p for ps in dist.run(world, _gathered) for p in ps]
    assert not problems, "\n".join(problems)


def _fallback_without_shard_tensor():
    from domainflow.dispatch.toolkit import gather_fallback

    with df.fallback("gather"):
        try:
            gather_fallback(torch.ops.aten.add_.Tensor, (torch.zeros(2), torch.ones(2)), {}, "a test")
        except df.UnsupportedShardedOp as e:
            return "no ShardTensor" in str(e)
    return False


def test_gather_fallback_without_shard_tensor_refuses_by_name(dist):
    assert all(dist.run(2, _fallback_without_shard_tensor))


# =================================================================================================
# messages into a replicated or plain destination, out of place: index and source sharded alike
# =================================================================================================
def _mismatched_messages(sizes):
    world = rank_and_world()[1]
    mesh = get_mesh((world,), ("domain",))
    x = df.distribute_tensor(_full(), mesh, [Shard(0)], sharding_shapes={0: sizes})
    dst = torch.tensor([2, 0, 3, 3, 1, 0, 2, 1])
    other = tuple(reversed(sizes))
    i_other = df.distribute_tensor(dst, mesh, [Shard(0)], sharding_shapes={0: other})
    out = {}
    for name, fn in {
        "plain index": lambda: torch.scatter_add(torch.zeros(4, C, dtype=D), 0, dst[:, None].expand(N, C), x),
        "plain source": lambda: torch.zeros(4, C, dtype=D).index_add(
            0, df.distribute_tensor(dst, mesh, [Shard(0)], sharding_shapes={0: sizes}), _full()),
        "other sizes": lambda: torch.zeros(4, C, dtype=D).index_add(0, i_other, x),
    }.items():
        got = _outcome(fn)
        out[name] = got[:2] if got[0] == "raised" else ("value",)
    return out


@pytest.mark.parametrize("world", (2, 3))
def test_messages_into_replicated_destination_need_index_and_source_alike(dist, world):
    # Regression test: a plain index with sharded messages (or the reverse, or other sizes) failed inside
    # torch with a raw RuntimeError on some ranks only (or used the wrong rows) while the others went on.
    sizes = LAYOUTS[world][0]
    results = dist.run(world, _mismatched_messages, sizes)
    for name in results[0]:
        got = [r[name] for r in results]
        assert all(g == ("raised", "ShardingMismatchError") for g in got), f"{name}: {got}"
