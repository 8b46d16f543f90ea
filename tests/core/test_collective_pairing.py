"""Collectives never pair different ops: ranks in different collectives (other kinds, sizes, dtypes or reduce
ops) all raise a CollectiveError naming every rank's op at once, in the pairing round every collective starts
with; never a Gloo abort, never a return with another op's bytes. Small payloads travel in that round: results
match the references. Each way runs here: Gloo's (larger payloads point to point while the round runs), and
NCCL's (payload collectives after the round) with the round built in host memory or with torch copies as on
an accelerator."""

from __future__ import annotations

import time

import pytest
import torch

import domainflow as df
from dist_pool import RankFailure, WorkerPool, rank_and_world
from domainflow import Shard, comm
from domainflow.errors import CollectiveError
from sharded_check import get_mesh

SMALL, LARGE = 6, 3000  # elements per rank: inside the all-gather pairing round (24 B) / after it (12 KB)
MISMATCH = "the ranks called collectives that do not pair"


WAYS = ["gloo", "nccl", "nccl on device"]
_IS_GLOO = {}


def _use(way: str) -> None:
    """Pair collectives Gloo's way, or NCCL's ("nccl": the payload collectives after the round; "nccl on
    device": the round built and read with torch copies too, as on an accelerator)."""
    from domainflow.comm import collectives

    real = _IS_GLOO.setdefault("f", collectives._is_gloo)
    collectives._is_gloo = real if way == "gloo" else (lambda mesh, mesh_dim: False)
    collectives._on_host = (lambda dev: False) if way == "nccl on device" else (lambda dev: dev.type == "cpu")


# -- every pair of different collectives --------------------------------------------------------------------
def _call(op: str, m: int, rank: int, world: int, mesh):
    """Run collective ``op`` with about ``m`` elements per rank; returns what it returned."""
    t = torch.arange(float(m)) + 100 * rank
    if op == "all_gather":  # full_tensor() of a ShardTensor: an uneven all-gather
        return comm.all_gather_uneven(t, 0, [m] * world, mesh, 0)
    if op == "all_gather_half_f64":  # the same bytes as all_gather, as float64
        return comm.all_gather_uneven(t[: m // 2].double(), 0, [m // 2] * world, mesh, 0)
    if op == "all_gather_other_sizes":
        return comm.all_gather_uneven(t[: m - 1], 0, [m - 1] * world, mesh, 0)
    if op == "all_gather_holds_more":  # a part with a row more than the sizes say
        return comm.all_gather_uneven(torch.arange(float(m + 1)), 0, [m] * world, mesh, 0)
    if op == "all_gather_dim1":  # the same sizes and bytes, along another dim
        return comm.all_gather_uneven(t.view(1, m), 1, [m] * world, mesh, 0)
    if op in ("all_to_all", "all_to_all_other_counts"):
        k = m if op == "all_to_all" else m + 1
        x = torch.arange(float(world * k))
        return comm.all_to_all_dims(x, 0, [k] * world, 0, [(k,)] * world, mesh, 0)
    if op in ("all_reduce", "all_reduce_max"):
        return comm.all_reduce(t, "sum" if op == "all_reduce" else "max", mesh, 0)
    if op == "all_reduce_f64":
        return comm.all_reduce(t.double(), "sum", mesh, 0)
    if op == "broadcast":
        return comm.broadcast(t, 0, mesh, 0)
    if op == "broadcast_from_1":
        return comm.broadcast(t, 1, mesh, 0)
    if op == "all_gather_object":
        return comm.all_gather_object("x" * m, mesh, 0)
    raise ValueError(op)


PAIRS = [  # (rank 0 calls, the other ranks call)
    ("all_gather", "all_to_all"), ("all_reduce", "all_gather"), ("broadcast", "all_gather"),
    ("broadcast", "all_reduce"), ("all_to_all", "broadcast"), ("all_gather_object", "all_reduce"),
    ("all_gather", "all_gather_other_sizes"), ("all_gather", "all_gather_half_f64"),
    ("all_gather", "all_gather_dim1"), ("all_gather", "all_gather_holds_more"), ("all_reduce", "all_reduce_max"),
    ("all_reduce", "all_reduce_f64"), ("all_to_all", "all_to_all_other_counts"), ("broadcast", "broadcast_from_1"),
]
_WORDS = {"all_gather_half_f64": "float64", "all_gather_holds_more": "but this rank holds",
          "all_gather_other_sizes": "all_gather", "all_gather_dim1": "along dim 1", "all_reduce_max": "all_reduce(max)",
          "all_reduce_f64": "float64", "all_to_all_other_counts": "all_to_all", "broadcast_from_1": "from coordinate 1"}


def _every_pair(way: str):
    """Each rank runs its side of every pair, small and large; records the error (or what came back), then
    checks that the group still works (a pairing mismatch leaves nothing behind)."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    _use(way)
    out = []
    try:
        for m in (SMALL, LARGE):
            for mine, theirs in PAIRS:
                op = mine if rank == 0 else theirs
                t0 = time.monotonic()
                try:
                    got = _call(op, m, rank, world, mesh)
                    said = f"returned {type(got).__name__}"
                except CollectiveError as e:
                    said = str(e)
                out.append((m, mine, theirs, said, time.monotonic() - t0))
                total = comm.all_reduce(torch.tensor([float(rank + 1)] * m), "sum", mesh, 0)
                assert torch.equal(total, torch.full((m,), world * (world + 1) / 2)), total
    finally:
        _use("gloo")
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("way", WAYS)
def test_different_collectives_raise_on_every_rank_naming_each_op(world, way):
    with WorkerPool(world, timeout=120, pg_timeout=5, grace=20) as pool:
        results = pool.run(_every_pair, way)
    for rank, cases in enumerate(results):
        assert len(cases) == 2 * len(PAIRS)
        for m, mine, theirs, said, took in cases:
            where = f"rank {rank}, {mine} vs {theirs}, {m} elements"
            assert said.startswith(f"rank {rank}: {MISMATCH}, over mesh dim 'd0' of mesh ({world},)"), (where, said)
            assert "Timed out" not in said and took < 5, (where, took, said)  # at once, not by a timeout
            listing = said.split("\n")[0].split(f"of mesh ({world},): ", 1)[1]  # rank 0's op first, then theirs
            ours, others = listing.split("; ", 1)
            assert ours.startswith(f"rank 0: {mine}"), (where, listing)
            assert _WORDS.get(theirs, theirs.split("_from")[0]) in others, (where, listing)
            assert others.startswith("rank 1: " if world == 2 else ("rank 1: ", "ranks [1, 2]: ")), (where, listing)
            assert "Likely cause:" in said, (where, said)


# -- rank 0 gathers a ShardTensor while the others run a backward through torch.fft --------------------------
def _full_tensor_against_fft_backward(m: int):
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    g = torch.Generator().manual_seed(0)
    x = df.distribute_tensor(torch.randn(2 * m, 4 * world, generator=g), mesh, [Shard(0)]).requires_grad_()
    loss = torch.fft.fft(x, dim=0).abs().sum()  # the FFT moves the shard to dim 1 (all-to-all); backward: back
    other = df.distribute_tensor(torch.arange(float(3 * m * 2)).reshape(3 * m, 2), mesh, [Shard(0)],
                                 sharding_shapes={0: [m, 2 * m, 0][:world] if world == 3 else [m, 2 * m]})
    comm.all_reduce(torch.ones(1), "sum", mesh, 0)  # (the pending layout check runs here, on every rank)
    t0 = time.monotonic()
    try:
        if rank == 0:
            got = other.full_tensor()  # logging on rank 0 only, while the others go on into backward
            return "returned", tuple(got.shape), time.monotonic() - t0
        loss.backward()
        return "returned", tuple(x.grad.shape), time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("m", [2, 400])
def test_full_tensor_on_one_rank_against_an_fft_backward(world, m):
    """The issue's case: Gloo aborted rank 1 (SIGABRT) and rank 0's full_tensor() returned."""
    with WorkerPool(world, timeout=120, pg_timeout=5, grace=20) as pool:
        results = pool.run(_full_tensor_against_fft_backward, m)
    for rank, (kind, said, took) in enumerate(results):
        assert kind == "CollectiveError", (rank, kind, said)
        first = said.split("\n")[0]
        assert first.startswith(f"rank {rank}: {MISMATCH}"), (rank, said)
        assert "rank 0: all_gather (uneven sizes" in first and "all_to_all (send" in first, (rank, first)
        assert took < 5 and "Timed out" not in said, (rank, took, said)  # at once, not by a timeout


# -- a point-to-point exchange on one rank, a collective on the other: they never meet -----------------------
def _p2p_against_collective(case: str):
    import os

    os.environ["DOMAINFLOW_STALL_WAIT_S"] = "15"  # both ranks fail by timeout; give the other's report time
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    t = torch.tensor([1.0, 2.0, 3.0]) + 10 * rank
    if rank == 1:  # a halo: fetch row 2 of rank 0 (4 bytes each way, as the small all-reduce below)
        got = comm.halo_exchange(t, 0, [3, 3], [[0, 1, 2, 3], [2, 3, 4, 5]], mesh, 0)
        return got.tolist()
    if case == "small all_reduce":  # 1 float32: the same bytes as the halo's row (met it before, by tag)
        return comm.all_reduce(t[:1], "sum", mesh, 0).tolist()
    return comm.all_gather_uneven(t, 0, [3, 3], mesh, 0).tolist()


@pytest.mark.parametrize("case", ["small all_reduce", "all_gather"])
def test_a_halo_on_one_rank_never_meets_a_collective_on_another(case):
    with WorkerPool(2, timeout=120, pg_timeout=4, grace=40) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(_p2p_against_collective, case)
    msg = str(info.value)
    assert not info.value.exit_codes, msg
    for rank in (0, 1):
        assert f"rank {rank} raised CollectiveError" in msg, msg
    assert "rank 1: halo exchange over mesh dim 'd0'" in msg, msg
    assert "rank 1 in halo exchange" in msg or "rank 0 in " in msg, msg  # the stall report names the other op


# -- small payloads in the pairing round give the same results ----------------------------------------------
def _results(m: int, way: str):
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    _use(way)
    try:
        g = torch.Generator().manual_seed(7 + rank)
        t = torch.randn(m, generator=g, dtype=torch.float64)
        out = {}
        for op in ("sum", "avg", "max", "min", "product"):
            out[op] = comm.all_reduce(t, op, mesh, 0)
        nan = t.clone()
        nan[0] = float("nan") if rank == world - 1 else nan[0]
        out["max_nan"] = comm.all_reduce(nan, "max", mesh, 0)
        out["int32"] = comm.all_reduce(torch.arange(m, dtype=torch.int32) * (rank + 1), "sum", mesh, 0)
        out["bool"] = comm.all_reduce(torch.arange(m) % (rank + 2) == 0, "sum", mesh, 0)
        out["complex"] = comm.all_reduce(t.to(torch.complex128) * 1j, "sum", mesh, 0)
        sizes = [(k + 1) * m // world for k in range(world)]
        sizes[-1] = 0  # uneven, one empty part
        part = torch.arange(float(sizes[rank] * 3)).view(sizes[rank], 3) + 1000 * rank
        out["all_gather"] = comm.all_gather_uneven(part, 0, sizes, mesh, 0)
        out["all_gather_dim1"] = comm.all_gather_uneven(part.t().contiguous(), 1, sizes, mesh, 0)
        # all-to-all: rank r sends (r + k + 1) * m // world rows of 2 to rank k
        send = [(rank + k + 1) * m // world for k in range(world)]
        recv = [(k + rank + 1) * m // world for k in range(world)]
        x = torch.arange(float(sum(send) * 2)).view(-1, 2) + 10_000 * rank
        out["all_to_all"] = comm.all_to_all_dims(x, 0, send, 0, [(c, 2) for c in recv], mesh, 0)
        out["broadcast"] = comm.broadcast(t.view(-1, 1) * (rank + 1), 1, mesh, 0)
        out["object"] = comm.all_gather_object(("r", rank, "y" * m), mesh, 0)
        out["object_mixed"] = comm.all_gather_object("z" * (10_000 if rank == 0 else 5), mesh, 0)  # one too long
        out["ints"] = comm.all_gather_ints([rank, m, 3], mesh)
        one = torch.arange(12.0).view(4, 3)[0:1, 1] + rank  # "contiguous", one element, stride 3
        out["one_gather"] = comm.all_gather_uneven(one, 0, [1] * world, mesh, 0)
        out["one_sum"] = comm.all_reduce(one, "sum", mesh, 0)
        out["no_values"] = comm.all_gather_uneven(torch.zeros(rank + 1, 0, 3), 0, list(range(1, world + 1)), mesh, 0)
        return out
    finally:
        _use("gloo")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("way", WAYS)
def test_small_and_large_payloads_give_the_reference_results(dist, world, way):
    for m in (SMALL, LARGE):
        res = dist.run(world, _results, m, way)
        ts = [torch.randn(m, generator=torch.Generator().manual_seed(7 + r), dtype=torch.float64) for r in range(world)]
        full = torch.stack(ts)
        want = {"sum": full.sum(0), "avg": full.sum(0) / world, "max": full.amax(0), "min": full.amin(0),
                "product": full.prod(0)}
        for r, out in enumerate(res):
            for op, w in want.items():
                assert torch.allclose(out[op], w, rtol=1e-12, atol=1e-12), (m, r, op)
                assert torch.equal(out[op], res[0][op]), (m, r, op)  # the same bits on every rank
            assert torch.isnan(out["max_nan"][0]) and torch.equal(out["max_nan"][1:], want["max"][1:])
            assert out["int32"].dtype == torch.int32
            assert torch.equal(out["int32"], torch.arange(m, dtype=torch.int32) * sum(range(1, world + 1)))
            assert out["bool"].dtype == torch.bool
            assert torch.equal(out["bool"], sum((torch.arange(m) % (k + 2) == 0).long() for k in range(world)) > 0)
            assert torch.allclose(out["complex"], want["sum"].to(torch.complex128) * 1j)
            sizes = [(k + 1) * m // world for k in range(world)]
            sizes[-1] = 0
            ag = torch.cat([torch.arange(float(sizes[k] * 3)).view(sizes[k], 3) + 1000 * k for k in range(world)])
            assert torch.equal(out["all_gather"], ag) and torch.equal(out["all_gather_dim1"], ag.t()), (m, r)
            blocks = []
            for k in range(world):
                send_k = [(k + j + 1) * m // world for j in range(world)]
                x = torch.arange(float(sum(send_k) * 2)).view(-1, 2) + 10_000 * k
                blocks.append(x[sum(send_k[:r]): sum(send_k[:r + 1])])
            assert torch.equal(out["all_to_all"], torch.cat(blocks)), (m, r)
            assert torch.equal(out["broadcast"], ts[1].view(-1, 1) * 2), (m, r)
            assert out["object"] == [("r", k, "y" * m) for k in range(world)]
            assert out["object_mixed"] == ["z" * (10_000 if k == 0 else 5) for k in range(world)]
            assert out["ints"] == [[k, m, 3] for k in range(world)]
            assert out["one_gather"].tolist() == [1.0 + k for k in range(world)]
            assert out["one_sum"].tolist() == [sum(1.0 + k for k in range(world))]
            assert out["no_values"].shape == (sum(range(1, world + 1)), 0, 3)  # parts of rows without values


def test_the_pairing_round_fits_its_buffer():
    """Headers keep the payload 16-byte aligned, so every dtype is viewed in place."""
    from domainflow.comm.collectives import Header, inline_bytes

    for n in (2, 3, 8, 64, 1000):
        assert inline_bytes(n) % 16 == 0 and 512 <= inline_bytes(n) <= 4096
        assert (8 * len(Header("all_to_all", n, 0, torch.float32).values)) % 16 == 0
