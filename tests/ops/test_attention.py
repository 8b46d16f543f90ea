"""Attention with a sharded sequence dim (ring attention and the replicated-side patterns) against
single-device SDPA: outputs and gradients, uneven shards with a nearly empty rank, causal, GQA."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from dist_pool import rank_and_world
from domainflow import Replicate, Shard
from sharded_check import Sharded, check_sharded, get_mesh, nearly_empty_sizes, random_sizes


_sizes = nearly_empty_sizes  # one rank holds at most one row


def _ring(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # value head size 6 runs the blocks through plain math, 5 (= the query's) through torch's flash kernel
    for (causal, gqa, lq, lk), dv in itertools.product(
            ((False, False, 13, 13), (True, False, 13, 13), (False, True, 11, 11), (True, True, 12, 12),
             (False, False, 9, 14)), (6, 5)):
        hq, hk = (4, 2) if gqa else (3, 3)
        q = torch.randn(2, hq, lq, 5, generator=gen, dtype=torch.float64)
        k = torch.randn(2, hk, lk, 5, generator=gen, dtype=torch.float64)
        v = torch.randn(2, hk, lk, dv, generator=gen, dtype=torch.float64)
        qs, ks = _sizes(lq, world, rng), _sizes(lk, world, rng)
        kw = {"is_causal": causal, "enable_gqa": gqa}
        check_sharded(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kw),
                      [Sharded(q, [Shard(2)], {0: qs}), Sharded(k, [Shard(2)], {0: ks}),
                       Sharded(v, [Shard(2)], {0: ks})], mesh)
    for kind in ("bool", "float"):
        q = torch.randn(1, 2, 10, 4, generator=gen, dtype=torch.float64)
        if kind == "bool":
            mask = torch.rand(10, 10, generator=gen) > 0.3
            mask |= torch.eye(10, dtype=torch.bool)  # no fully masked row
        else:
            mask = torch.randn(1, 2, 10, 10, generator=gen, dtype=torch.float64)
        s = _sizes(10, world, rng)
        check_sharded(lambda a, b: F.scaled_dot_product_attention(a, b, b, attn_mask=mask),
                      [Sharded(q, [Shard(2)], {0: s}), Sharded(q.flip(-1), [Shard(2)], {0: s})], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_attention_matches_sdpa(dist, world):
    assert all(dist.run(world, _ring, 10 + world))


def _replicated_sides(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 10, 4, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 3, 6, 4, generator=gen, dtype=torch.float64)
    # sharded queries, replicated K/V (cross-attention to a few global tokens)
    check_sharded(lambda a, b: F.scaled_dot_product_attention(a, b, b * 2),
                  [Sharded(q, [Shard(2)], {0: _sizes(10, world, rng)}), Sharded(kv, [Replicate()])], mesh)
    check_sharded(lambda a, b: F.scaled_dot_product_attention(a, b, b, is_causal=True),
                  [Sharded(q[:, :, :6], [Shard(2)], {0: _sizes(6, world, rng)}), Sharded(kv, [Replicate()])], mesh)
    # replicated queries (a few slice tokens) attending to sharded K/V (Perceiver / Transolver pattern)
    toks = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    check_sharded(lambda a, b: F.scaled_dot_product_attention(a, b, b.sin()),
                  [Sharded(toks, [Replicate()]), Sharded(q, [Shard(2)], {0: _sizes(10, world, rng)})], mesh)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_replicated_queries_or_keys(dist, world):
    assert all(dist.run(world, _replicated_sides, 30 + world))


def _ring_traffic():
    import domainflow as df
    from domainflow import comm

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    x = torch.randn(1, 2, 12, 4, dtype=torch.float64)
    q = df.distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    comm.stats.reset()
    out = F.scaled_dot_product_attention(q, q, q)
    fwd = dict(comm.stats.calls)
    out.to_local().sum().backward()
    return fwd, dict(comm.stats.calls)


def test_ring_attention_never_gathers(dist):
    for fwd, total in dist.run(3, _ring_traffic):
        assert set(fwd) == {"ring"} and "all_gather" not in total and "all_to_all" not in total


class _ViTBlock(torch.nn.Module):
    """Patch embedding (strided conv), pre-norm multi-head self-attention (SDPA) and an MLP: a timm-style
    block."""

    def __init__(self, dim=8, heads=2, patch=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Conv2d(3, dim, patch, stride=patch)
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, img):
        x = self.embed(img).flatten(2).transpose(1, 2)  # (B, tokens, dim), tokens sharded with the image rows
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


def _vit(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    block = _ViTBlock().double()
    img = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64)
    rows = [2 * r for r in random_sizes(6, world, rng)]  # whole patches per rank
    check_sharded(lambda t, m: m(t), [Sharded(img, [Shard(2)], {0: tuple(rows)})], mesh, module=block)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vit_block_unmodified(dist, world):
    assert all(dist.run(world, _vit, 50 + world))


def _mha(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).double()
    x = torch.randn(2, 11, 8, generator=gen, dtype=torch.float64)
    check_sharded(lambda t, m: m(t, t, t, need_weights=False)[0], [Sharded(x, [Shard(1)], {0: _sizes(11, world, rng)})],
                  mesh, module=mha)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_multihead_attention_unmodified(dist, world):
    assert all(dist.run(world, _mha, 70 + world))


class _PhysicsAttention(torch.nn.Module):
    """Transolver's physics attention over points (B, N, C): points are softly assigned to M slices
    (softmax over slices, local per point), slice tokens are weighted means over the points (two sums
    over the sharded point dim, reduced together: one collective), the M tokens attend to each other
    (replicated), and de-slicing maps them back to the points (local)."""

    def __init__(self, dim=8, heads=2, slices=4):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.x_proj, self.fx_proj = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.slice = torch.nn.Linear(self.d, slices)
        self.qkv = torch.nn.Linear(self.d, 3 * self.d, bias=False)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        import domainflow as df

        b, n, c = x.shape
        xm = self.x_proj(x).reshape(b, n, self.h, self.d).transpose(1, 2)      # (B, H, N, D)
        fx = self.fx_proj(x).reshape(b, n, self.h, self.d).transpose(1, 2)
        w = torch.softmax(self.slice(xm), dim=-1)                               # (B, H, N, M), local
        num = w.transpose(-2, -1) @ fx                                          # (B, H, M, D), pending sum
        den = w.sum(2)                                                          # (B, H, M), pending sum
        num, den = df.reduce_partials(num, den) if isinstance(num, df.ShardTensor) else (num, den)
        tokens = num / (den[..., None] + 1e-5)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        tokens = F.scaled_dot_product_attention(q, k, v)                        # among M slices, replicated
        y = (w @ tokens).transpose(1, 2).reshape(b, n, c)                       # de-slice: local
        return self.out(y)


class _Transolver(torch.nn.Module):
    def __init__(self, dim=8, layers=2):
        super().__init__()
        self.embed = torch.nn.Linear(3, dim)
        self.blocks = torch.nn.ModuleList(_PhysicsAttention(dim) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, pts):
        x = self.embed(pts)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return self.head(x)


def _transolver(seed):
    import domainflow as df
    from domainflow import comm

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _Transolver().double()
    pts = torch.randn(2, 23, 3, generator=gen, dtype=torch.float64)
    sizes = _sizes(23, world, rng)
    check_sharded(lambda t, m: m(t), [Sharded(pts, [Shard(1)], {0: sizes})], mesh, module=model)
    # one physics-attention layer's forward: exactly one all-reduce (the fused slice sums)
    x = df.distribute_tensor(torch.randn(2, 23, 8, dtype=torch.float64), mesh, [Shard(1)], sharding_shapes={0: sizes})
    layer = _PhysicsAttention().double()
    comm.stats.reset()
    with torch.no_grad():
        layer(x)
    return comm.stats.calls.get("all_reduce", 0), comm.stats.bytes.get("all_reduce", 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_transolver_physics_attention(dist, world):
    for calls, nbytes in dist.run(world, _transolver, 90 + world):
        assert calls == (1 if world > 1 else 0)
        # analytic minimum: slice tokens (B, H, M, D) and their normaliser (B, H, M), float64
        assert nbytes == (2 * 2 * 4 * 4 + 2 * 2 * 4) * 8 * (world > 1)


def _dropout(seed):
    """With value = identity, SDPA's output is the dropped-out attention weights themselves: every entry is
    0 or P/(1-p). Gradients are checked against one device given the mask each rank drew."""
    import warnings

    import domainflow as df

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + rank)  # each rank its own mask stream
    L, p = 12, 0.4
    q = torch.randn(2, L, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(2, L, 4, generator=gen, dtype=torch.float64)
    v = torch.eye(L, dtype=torch.float64).expand(2, L, L).contiguous()
    cot = torch.randn(2, L, L, generator=gen, dtype=torch.float64)
    problems = []
    sizes = {0: random_sizes(L, world, rng)}
    for name, (pq, pk) in {"batch": ([Shard(0)], [Shard(0)]), "ring": ([Shard(1)], [Shard(1)]),
                           "queries": ([Shard(1)], [Replicate()]), "keys": ([Replicate()], [Shard(1)])}.items():
        sq = sizes if pq[0] == Shard(1) else None
        sk = sizes if pk[0] == Shard(1) else None
        Q = df.distribute_tensor(q, mesh, pq, sharding_shapes=sq).requires_grad_()
        K = df.distribute_tensor(k, mesh, pk, sharding_shapes=sk).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = F.scaled_dot_product_attention(Q, K, df.distribute_tensor(v, mesh, pk, sharding_shapes=sk),
                                                 dropout_p=p)
            (out * df.distribute_tensor(cot, mesh, out.placements, sharding_shapes=(
                {0: list(out._spec.sizes[0])} if out._spec.sizes[0] is not None else None))).sum().backward()
        o = out.full_tensor()
        qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
        P = torch.softmax(qr @ kr.transpose(-1, -2) / 2.0, -1)
        kept = (o != 0).double()
        if not torch.allclose(o, kept * P.detach() / (1 - p), rtol=1e-12, atol=0):
            problems.append(f"{name}: output is not the dropped-out attention weights")
        if not 0.2 < 1 - kept.mean().item() < 0.6:
            problems.append(f"{name}: dropped {1 - kept.mean().item():.2f} of the weights, expected about {p}")
        (kept * P / (1 - p) * cot).sum().backward()
        for what, got, want in (("query", Q.grad.full_tensor(), qr.grad), ("key", K.grad.full_tensor(), kr.grad)):
            if not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
                problems.append(f"{name}: {what} gradient differs from one device with the same mask")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3])
def test_attention_dropout_with_a_sharded_batch_or_sequence(dist, world):
    for problems in dist.run(world, _dropout, 90 + world):
        assert not problems, problems
