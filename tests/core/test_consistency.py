"""What each rank declares alone is checked across ranks before it can make a result wrong: sizes given per
rank (``sharding_shapes`` mapping or "chunk") and replicated parameters. A disagreement raises the same named
error on every rank at the first collective; an agreement costs one small collective per batch of new
declarations and nothing per op afterwards. ``domainflow.sync_module`` fixes per-rank initialisation.
Real Gloo groups; references are single-process torch."""

from __future__ import annotations

import pytest
import torch

import domainflow as df
from dist_pool import rank_and_world
from domainflow import Shard
from sharded_check import get_mesh


def _error_of(fn):
    """(type name, message) of what ``fn`` raises on this rank, or None (the pool stays healthy)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def _own_sizes(rank, world):
    """Sizes every rank agrees on: rank k holds k + 2 rows."""
    return [k + 2 for k in range(world)]


def _disagreeing_mapping(kind):
    """Each rank's mapping is consistent with its own chunk, but the last rank says the first two ranks hold
    one row more and one row less than they do."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    sizes = _own_sizes(rank, world)
    if rank == world - 1:
        sizes = [sizes[0] + 1, sizes[1] - 1] + sizes[2:]
    local = torch.arange(float(sizes[rank] * 4)).reshape(-1, 4) + 100 * rank

    def gather():
        x = df.ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes={"domain": sizes})
        return x.full_tensor()

    def conv_mean():
        grid = local.reshape(1, 1, -1, 4).double()
        x = df.ShardTensor.from_local(grid, mesh, [Shard(2)], sharding_shapes={"domain": sizes})
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(1, 2, 3, padding=1).double()
        return conv(x).mean().item()

    return _error_of({"gather": gather, "conv_mean": conv_mean}[kind])


@pytest.mark.parametrize("kind", ["gather", "conv_mean"])
@pytest.mark.parametrize("world", [2, 3])
def test_sizes_that_ranks_disagree_on_raise_on_every_rank(dist, world, kind):
    results = dist.run(world, _disagreeing_mapping, kind)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} computed a result from a layout the ranks disagree on"
        name, msg = res
        assert name == "ShardingShapeError", (rank, msg)
        assert "disagree about the layout" in msg and "from_local" in msg
        last = world - 1
        assert f"rank {last}: global shape" in msg and "Shard(" in msg, msg
    assert len({msg for _, msg in results}) == 1  # the same message everywhere


def _chunk_with_different_local_sizes():
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    local = torch.ones(3 + (rank == 0), 2)  # "chunk" without a shape: each rank guesses the global size alone
    return _error_of(lambda: df.ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes="chunk").sum().item())


def test_chunk_layouts_guessed_differently_are_refused(dist):
    for res in dist.run(2, _chunk_with_different_local_sizes):
        assert res is not None and res[0] == "ShardingShapeError", res


def _agreeing_costs():
    from domainflow import comm
    from domainflow.tensor import consistency

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    sizes = _own_sizes(rank, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).double()
    per_step = []
    for step in range(3):
        comm.stats.reset()
        # a sample: several tensors with one layout, as a reader makes them
        xs = [df.ShardTensor.from_local(torch.randn(sizes[rank], 4, dtype=torch.float64), mesh, [Shard(0)],
                                        sharding_shapes={"domain": sizes}) for _ in range(3)]
        loss = sum((model(x) ** 2).mean() for x in xs)
        loss.backward()
        checks_after_first = comm.stats.calls["check"]
        for _ in range(10):  # more ops and collectives on layouts already checked: nothing more
            (xs[0] * 2 + 1).sum().item()
        per_step.append((checks_after_first, comm.stats.calls["check"], comm.stats.bytes["check"]))
    return per_step, consistency.stats["items"]


@pytest.mark.parametrize("world", [2, 3])
def test_agreeing_declarations_cost_one_small_collective_and_nothing_per_op(dist, world):
    for per_step, _items in dist.run(world, _agreeing_costs):
        for step, (first, total, nbytes) in enumerate(per_step):
            assert first == total == 1, per_step  # one check per sample, none for the ops after it
            # one fingerprint of everything declared (and its negation, int64), however much that was
            assert nbytes == 2 * 8, per_step


def _per_rank_seed(sync):
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    torch.manual_seed(0 if rank < world - 1 else 1)  # the last rank initialises differently
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).double()
    if sync:
        df.sync_module(model, mesh)
    x = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    st = df.distribute_tensor(x, mesh, [Shard(0)])
    err = _error_of(lambda: (model(st) ** 2).mean().backward())
    if err is not None:
        return err
    torch.manual_seed(0)  # rank 0's model on one device: the reference a synced job must equal
    ref = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).double()
    (ref(x) ** 2).mean().backward()
    return max(float((p.grad - r.grad).abs().max()) for p, r in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_that_differ_across_ranks_are_named(dist, world):
    results = dist.run(world, _per_rank_seed, False)
    for res in results:
        assert isinstance(res, tuple) and res[0] == "ReplicaMismatchError", res
        msg = res[1]
        assert "parameter 'Sequential.0.weight' (shape (8, 3)" in msg and "'Sequential.2.bias'" in msg, msg
        assert f"rank(s) [{world - 1}] differ from rank 0" in msg and "sync_module" in msg
    assert len({r[1] for r in results}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_sync_module_makes_per_rank_initialisation_equal_one_device(dist, world):
    for worst in dist.run(world, _per_rank_seed, True):
        assert isinstance(worst, float) and worst < 1e-12, worst


def _conv_net_with_a_per_rank_bias():
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.GroupNorm(2, 4)).double()
    with torch.no_grad():
        net[1].bias[1] += 1e-9 * rank  # one element, far below what a loss would show
    x = df.distribute_tensor(torch.randn(1, 2, 8, 6, dtype=torch.float64), mesh, [Shard(2)])
    return _error_of(lambda: net(x).sum().item())


def test_a_tiny_difference_in_a_grid_model_is_caught(dist):
    for res in dist.run(2, _conv_net_with_a_per_rank_bias):
        assert res is not None and res[0] == "ReplicaMismatchError" and "'Sequential.1.bias'" in res[1], res


def test_the_accelerator_checksum_sees_one_flipped_bit_and_a_swap():
    """The checksum parameters get on an accelerator (run here on CPU tensors): any bit or order change shows."""
    from domainflow.tensor.consistency import device_checksum

    raw = torch.randn(3 * (1 << 20) + 7, generator=torch.Generator().manual_seed(0)).view(torch.uint8)
    base = device_checksum(raw)
    assert device_checksum(raw.clone()) == base
    flipped = raw.clone()
    flipped[12345] ^= 1
    swapped = raw.clone()
    swapped[[0, 4]] = raw[[4, 0]]
    assert device_checksum(flipped) != base and device_checksum(swapped) != base


def _disagreeing_after_repeats():
    """Rank 0 declares one layout twice, rank 1 that layout and then a wrong one: the check is still one
    collective of one size on every rank, so it fails with the named error, not a timeout."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    local = torch.ones(2 + rank, 3)
    second = [2, 3] if rank == 0 else [3, 3]  # rank 1 alone misdescribes rank 0
    xs = [df.ShardTensor.from_local(local, mesh, [Shard(0)], sharding_shapes={"domain": sizes})
          for sizes in ([2, 3], second)]
    return _error_of(lambda: sum(x.sum() for x in xs).item())


def test_different_numbers_of_declarations_still_fail_by_name(dist):
    for res in dist.run(2, _disagreeing_after_repeats):
        assert res is not None and res[0] == "ShardingShapeError", res


def _sync_after_a_forward():
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2).double()
    x = df.distribute_tensor(torch.ones(6, 3, dtype=torch.float64), mesh, [Shard(0)])
    model(x)  # records the (different) parameters; nothing has communicated yet
    df.sync_module(model, mesh)
    return model(x).sum().item(), [p.detach().clone() for p in model.parameters()]


def test_sync_module_after_a_forward_syncs_instead_of_raising(dist):
    results = dist.run(2, _sync_after_a_forward)
    (v0, p0), (v1, p1) = results
    assert v0 == v1 and all(torch.equal(a, b) for a, b in zip(p0, p1))


def _loss_does_not_hold_the_gradient_buffer():
    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 64).double()
    x = df.distribute_tensor(torch.ones(8, 3, dtype=torch.float64), mesh, [Shard(0)])
    loss = model(x).sum()
    loss.backward()
    return loss._local.untyped_storage().nbytes()


def test_a_loss_after_backward_holds_only_its_own_value(dist):
    for nbytes in dist.run(2, _loss_does_not_hold_the_gradient_buffer):
        assert nbytes == 8, nbytes
