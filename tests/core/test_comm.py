"""The collective layer's autograd-aware functions against single-process references: every rank's
contribution to a loss summed over ranks, gradients compared with torch.autograd on the full data."""

from __future__ import annotations

import random

import pytest
import torch

from dist_pool import WORLD_SIZES, rank_and_world
from domainflow import comm
from sharded_check import get_mesh, random_sizes

D = torch.float64


def _data(world, seed):
    rng = random.Random(seed)
    sizes = random_sizes(7, world, rng)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(7, 3, generator=g, dtype=D)
    cot = [torch.randn(7, 3, generator=g, dtype=D) for _ in range(world)]  # rank r's cotangent
    return sizes, full, cot


def _all_gather_and_reduce(seed):
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    sizes, full, cot = _data(world, seed)
    off = sum(sizes[:rank])
    # all-gather: y = full on every rank; total loss = sum_r <y, cot_r>
    x = full[off: off + sizes[rank]].clone().requires_grad_()
    y = comm.all_gather_autograd(x, 0, sizes, mesh, 0)
    assert torch.equal(y, full)
    (y * cot[rank]).sum().backward()
    want = sum(cot).narrow(0, off, sizes[rank])
    assert torch.allclose(x.grad, want, atol=1e-12)
    # all-reduce: z = sum_r x_r on every rank
    xr = (full * (rank + 1)).requires_grad_()
    z = comm.all_reduce_sum_autograd(xr, mesh, 0)
    assert torch.allclose(z, full * sum(range(1, world + 1)), atol=1e-12)
    (z * cot[rank]).sum().backward()
    assert torch.allclose(xr.grad, sum(cot), atol=1e-12)
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_gather_and_all_reduce_autograd(dist, world):
    assert all(dist.run(world, _all_gather_and_reduce, 5 + world))


def _all_to_all(seed):
    """Rows sharded unevenly -> columns sharded unevenly, and the gradient back."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    rows, cols = random_sizes(6, world, rng), random_sizes(5, world, rng)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(6, 5, generator=g, dtype=D)
    cot = [torch.randn(6, 5, generator=g, dtype=D) for _ in range(world)]
    r0 = sum(rows[:rank])
    x = full[r0: r0 + rows[rank]].clone().requires_grad_()
    recv = [(rows[k], cols[rank]) for k in range(world)]
    y = comm.all_to_all_autograd(x, 1, cols, 0, recv, mesh, 0)
    c0 = sum(cols[:rank])
    assert torch.equal(y, full[:, c0: c0 + cols[rank]])
    (y * cot[rank][:, c0: c0 + cols[rank]]).sum().backward()
    # total loss = sum_r <full[:, cols_r], cot_r[:, cols_r]>: d/d full = cot_r on r's columns
    want = torch.cat([cot[k][:, sum(cols[:k]): sum(cols[:k + 1])] for k in range(world)], 1)
    assert torch.allclose(x.grad, want[r0: r0 + rows[rank]], atol=1e-12)
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_to_all_autograd(dist, world):
    assert all(dist.run(world, _all_to_all, 9 + world))


def _all_reduce_paths(seed):
    """``comm.all_reduce`` by point-to-point swap (small payloads on Gloo) and by Gloo's own all-reduce
    (payload above ``EXCHANGE_REDUCE_MAX_BYTES``): same values, the same bits on every rank, NaN kept by
    max/min, integer and bool inputs, bytes counted as all-reduce traffic (not halo)."""
    import torch.distributed as tdist

    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(5, 3, generator=g, dtype=torch.float32) for _ in range(world)]
    big_n = comm.EXCHANGE_REDUCE_MAX_BYTES // 4 + 1  # float32 elements: over the threshold even at world 2
    bigs = [torch.randn(big_n, generator=g, dtype=torch.float32) for _ in range(world)]
    for x_parts in (parts, bigs):
        mine = x_parts[rank].clone()
        if x_parts is parts:
            mine[0, 0] = float("nan") if rank == world - 1 else mine[0, 0]
        comm.stats.reset()
        for op, ref in (("sum", lambda t: torch.stack(t).sum(0)), ("avg", lambda t: torch.stack(t).mean(0)),
                        ("max", lambda t: torch.stack(t).amax(0)), ("min", lambda t: torch.stack(t).amin(0)),
                        ("product", lambda t: torch.stack(t).prod(0))):
            got = comm.all_reduce(mine, op, mesh, 0)
            full = [p.clone() for p in x_parts]
            if x_parts is parts:
                full[world - 1][0, 0] = float("nan")
            want = ref(full)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True), op
            if op in ("max", "min") and x_parts is parts:
                assert torch.isnan(got[0, 0]), f"{op} dropped a NaN from rank {world - 1}"
            everyone = [torch.empty_like(got) for _ in range(world)]
            tdist.all_gather(everyone, got, group=mesh.get_group(0))
            assert all(torch.equal(e, got) or torch.equal(torch.nan_to_num(e), torch.nan_to_num(got))
                       for e in everyone), f"{op}: ranks got different bits"
        if world > 1:
            assert comm.stats.bytes.get("halo", 0) == 0 and comm.stats.calls["all_reduce"] == 5
    ints = comm.all_reduce(torch.tensor([rank, 1]), "sum", mesh, 0)
    assert ints.tolist() == [sum(range(world)), world]
    flags = comm.all_reduce(torch.tensor([rank == 0, False]), "max", mesh, 0)
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_reduce_small_by_exchange_and_large_by_gloo(dist, world):
    assert all(dist.run(world, _all_reduce_paths, 31 + world))


_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
           torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
           torch.complex32, torch.complex64, torch.complex128)


def _values(dtype, n, rank):
    """n distinct-ish values of ``dtype`` that depend on the rank (exact in every dtype: small integers)."""
    base = (torch.arange(n) * 7 + rank) % 11
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype) if dtype != torch.bool else base % 2 == 1


def _views(t):
    """``t`` as itself and, for complex, as a conjugate view and a negative view (the imaginary part of a
    conjugate), which torch resolves lazily: the bytes of the tensor are not its values."""
    out = [("plain", t)]
    if t.is_complex() and t.dtype != torch.complex32:
        out += [("conj", t.conj()), ("neg", t.conj().imag)]
    return out


def _every_dtype_and_view():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    for dtype in _DTYPES:
        for n in (6, 9000):  # in the pairing round, and point to point or through the backend
            sizes = [n // world] * world
            sizes[-1] += n - sum(sizes)
            for view, mine in _views(_values(dtype, sizes[rank] * 2, rank).view(sizes[rank], 2)):
                parts = [dict(_views(_values(dtype, s * 2, k).view(s, 2)))[view] for k, s in enumerate(sizes)]
                what = f"{dtype} {view} n={n}"
                eq = lambda a, b: a.dtype == b.dtype and torch.equal(a.resolve_conj().resolve_neg().view(torch.uint8),  # noqa: E731
                                                                     b.resolve_conj().resolve_neg().view(torch.uint8))
                assert eq(comm.all_gather_uneven(mine, 0, sizes, mesh, 0), torch.cat(parts)), what
                cols = comm.all_to_all_dims(mine, 1, [2 if k == 0 else 0 for k in range(world)], 0,
                                            [(s, 2 if rank == 0 else 0) for s in sizes], mesh, 0)
                want = torch.cat(parts) if rank == 0 else torch.cat(parts)[:, :0]
                assert eq(cols, want), what
                assert eq(comm.broadcast(mine if rank == 0 else torch.zeros_like(parts[0]), 0, mesh, 0), parts[0]), what
                if sizes[rank] == sizes[(rank - 1) % world]:
                    got = comm.ring_shift([mine], [mine.shape], mesh, 0)[0]
                    assert eq(got, parts[(rank - 1) % world]), what
                if dtype in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.complex32):
                    continue  # torch itself does not add these on the CPU
                same = [p[:sizes[0]] for p in parts]
                for op in ("sum", "product") + (() if dtype.is_complex else ("max",)):
                    stack = torch.stack([p.resolve_conj().resolve_neg() for p in same])
                    want = {"sum": lambda v: v.sum(0, dtype=v.dtype), "product": lambda v: v.prod(0, dtype=v.dtype),
                            "max": lambda v: v.amax(0)}[op](stack if dtype != torch.bool else stack.to(torch.uint8))
                    got = comm.all_reduce(same[rank], op, mesh, 0)
                    assert torch.equal(got, want.to(dtype)), f"{what} all_reduce({op})"  # bool: any, all
    odd = torch.arange(8.0, dtype=D)[rank:rank + 1:2]  # one element whose stride is 2: no byte view without a copy
    assert comm.ring_shift([odd], [odd.shape], mesh, 0)[0].item() == (rank - 1) % world
    wide = torch.arange(8.0, dtype=D)[3:4:2] if rank == 0 else torch.zeros(1, dtype=D)
    assert comm.broadcast(wide.expand(3000), 0, mesh, 0).tolist() == [3.0] * 3000  # stride 0: sent point to point
    zeros = torch._efficientzerotensor((3, 2), dtype=D)  # what some gradient formulas return
    got = comm.all_gather_uneven(zeros, 0, [3] * world, mesh, 0)
    assert torch.equal(got, torch.zeros(3 * world, 2, dtype=D))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_every_dtype_and_view_travels_exactly(dist, world):
    """Every dtype torch has (int16, unsigned, float8, complex32, bool: some Gloo or NCCL lack) and the lazy views
    (conjugate, negative, zero tensors) through gather, all-to-all, broadcast, ring and all-reduce, small and
    large: the values arrive exact, where the collective used to fail with "Invalid scalar type" or
    "view_as_real doesn't work on unresolved conjugated tensors"."""
    assert all(dist.run(world, _every_dtype_and_view))
