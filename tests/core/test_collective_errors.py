"""A collective that another rank never joins fails with domainflow's own error, naming the rank, the
op and the mesh dim, within the process group's timeout (no silent hang)."""

from __future__ import annotations

import time

import pytest
import torch

import domainflow as df
from dist_pool import RankFailure, WorkerPool, rank_and_world
from domainflow import Shard


def _rank0_skips_the_gather():
    import os

    # rank 0 never reports: rank 1 need not wait the default 5 s to hear where it failed (set in the rank:
    # workers fork from a server whose environment was fixed when it started)
    os.environ["DOMAINFLOW_STALL_WAIT_S"] = "1"
    rank, world = rank_and_world()
    mesh = df.init_mesh((world,), ("domain",))
    x = df.distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)], sharding_shapes={0: (1, 2)})
    if rank == 0:
        return "skipped"
    return x.full_tensor()  # waits for rank 0 forever without a timeout


def test_missing_rank_gives_named_collective_error():
    with WorkerPool(2, timeout=60, pg_timeout=3, grace=30) as pool:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_rank0_skips_the_gather)
        elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "CollectiveError" in msg
    assert "rank 1: all_gather over mesh dim 'domain'" in msg
    assert "another rank did not enter the same collective" in msg
    assert elapsed < 45


# -- a pending loss and the usual logging idiom ----------------------------------------------------------
def _model_and_points(world, rank):
    mesh = df.init_mesh((world,), ("domain",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sizes = [0, 40] if world == 2 else [5, 0, 35][:world] if world == 3 else [40]
    return mesh, model, x, df.distribute_tensor(x, mesh, [Shard(0)], sharding_shapes={0: sizes})


def _log_on_rank0_after_backward(with_params: bool, deferred: bool = False):
    from domainflow import comm

    rank, world = rank_and_world()
    mesh, model, x, st = _model_and_points(world, rank)
    if not with_params:
        st = st.detach().requires_grad_()  # the loss's only input that needs a gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Linear(8, 1)).double()
    ref_model.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    logged, calls = [], []
    for _ in range(3):
        opt.zero_grad()
        comm.stats.reset()
        loss = (model(st) ** 2).mean() if with_params else (st ** 2).mean()
        if deferred:
            with df.deferred_param_grads():
                loss.backward()
        else:
            loss.backward()
        calls.append(dict(comm.stats.calls))
        if rank == 0:  # the idiom: only rank 0 looks at the loss
            logged.append(loss.item())
        opt.step()
        ref_opt.zero_grad()
        ref = (ref_model(x) ** 2).mean() if with_params else (x ** 2).mean()
        if with_params:
            ref.backward()
            ref_opt.step()
        if rank == 0:
            assert abs(logged[-1] - ref.item()) < 1e-12
    return logged, calls


@pytest.mark.parametrize("world", [2, 3])
def test_loss_item_on_rank0_after_backward_needs_no_collective(world):
    """The loss rides on the backward pass's gradient all-reduces: one per layer (two Linear layers), or one
    for the whole model under deferred_param_grads; none of its own, none for .item()."""
    with WorkerPool(world, timeout=60, pg_timeout=10, grace=10) as pool:
        for deferred, grad_reduces in ((False, 2), (True, 1)):
            results = pool.run(_log_on_rank0_after_backward, True, deferred)
            assert len(results[0][0]) == 3
            for _, rank_calls in results:
                for c in rank_calls:
                    assert c.get("all_reduce", 0) == grad_reduces, rank_calls


def test_a_loss_without_parameters_is_known_after_backward_too():
    """Nothing to ride on: backward ends with one small all-reduce of the loss itself."""
    with WorkerPool(2, timeout=60, pg_timeout=10, grace=10) as pool:
        results = pool.run(_log_on_rank0_after_backward, False)
    assert len(results[0][0]) == 3
    for _, rank_calls in results:
        assert all(c.get("all_reduce", 0) == 1 for c in rank_calls), rank_calls


def _item_on_rank0_before_backward(late_s=0.0):
    import os

    # both ranks time out, in different collectives; on a busy machine one may do so seconds after the other,
    # so each waits longer than the default 5 s for the other's report (else it names the other as silent).
    # Set here, in the rank: workers fork from a server whose environment was fixed when it started.
    os.environ["DOMAINFLOW_STALL_WAIT_S"] = "20"
    rank, world = rank_and_world()
    mesh, model, x, st = _model_and_points(world, rank)
    loss = (model(st) ** 2).mean()
    st.sum().item()  # on every rank: the pending cross-rank checks run here, together
    if rank == 0:
        loss.item()  # a pending value reduced on one rank only: the others go on into backward
    elif late_s:
        # rank 1 reaches its (other) collective after rank 0 has timed out and Gloo has closed the connection,
        # as on a busy machine: it fails at once with "Connection closed by peer" and must still report
        time.sleep(late_s)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("late_s", [0.0, 6.0])
def test_item_of_a_pending_value_on_one_rank_is_a_collective_error_not_an_abort(late_s):
    with WorkerPool(2, timeout=90, pg_timeout=5, grace=40) as pool:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_item_on_rank0_before_backward, late_s)
        elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "died with" not in msg and not info.value.exit_codes, msg  # Gloo aborted the process (SIGABRT) before
    for rank in (0, 1):
        assert f"rank {rank} raised CollectiveError" in msg, msg
    if late_s:
        assert "The ranks ran different collectives" in msg and "all_reduce(sum) of 1 values" in msg, msg
        assert "This rank came late: rank(s) [0] had already failed" in msg, msg
        assert "Likely culprit: rank(s) [1], which reached a collective only after this rank had failed" in msg
    else:  # both reach their collectives together: the pairing round tells them apart at once, no timeout
        for rank in (0, 1):
            assert f"rank {rank}: the ranks called collectives that do not pair" in msg, msg
        assert "rank 0: all_reduce(sum) of 1 values, float64; rank 1: all_reduce(sum) of " in msg, msg
        assert "failed: " not in msg and "Timed out" not in msg, msg
    assert elapsed < 60


def _rank1_stalls():
    import os

    os.environ["DOMAINFLOW_STALL_WAIT_S"] = "2"  # rank 0: 2 s timeout + 2 s waiting for reports, then it fails
    rank, world = rank_and_world()
    mesh, model, x, st = _model_and_points(world, rank)
    if rank == 1:
        time.sleep(7)  # longer than the collective timeout and rank 0's wait: a rank stuck computing
    return (model(st) ** 2).mean().item()


def test_a_stalled_rank_is_named_as_the_likely_culprit():
    with WorkerPool(2, timeout=90, pg_timeout=2, grace=20) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(_rank1_stalls)
    msg = str(info.value)
    assert "rank 0 raised CollectiveError" in msg and "Likely culprit: rank(s) [1]" in msg, msg
    # rank 1 wakes after rank 0 has failed and Gloo has closed the connection: it is told that it came late
    assert "rank 1 raised CollectiveError" in msg and "This rank came late: rank(s) [0]" in msg, msg
