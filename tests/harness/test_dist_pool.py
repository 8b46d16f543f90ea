"""Tests of the multi-process harness itself (tests/dist_pool.py)."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as tdist

import dist_pool
from dist_pool import (
    WORLD_SIZES,
    RankFailure,
    RankTimeout,
    WorkerPool,
    current_op,
    rank_and_world,
    set_current_op,
    worker_cache,
)

# ----------------------------------------------------------------------------------------------
# Rank functions (module level: the workers import this module by name)


def _all_reduce_rank():
    rank, world = rank_and_world()
    assert tdist.get_rank() == rank and tdist.get_world_size() == world
    assert tdist.get_backend() == "gloo"
    t = torch.tensor([float(rank)], dtype=torch.float64)
    tdist.all_reduce(t)
    return t


def _tensors_back(scale, *, offset=0.0):
    rank, _ = rank_and_world()
    leaf = torch.full((2, 3), float(rank), requires_grad=True)
    nonleaf = leaf * scale + offset
    return {
        "rank": rank,
        "nonleaf": nonleaf,
        "param": torch.nn.Parameter(torch.arange(3.0)),
        "nested": [torch.zeros(0, 4), (torch.tensor(rank),)],
        "threads": torch.get_num_threads(),
    }


def _raise_on(bad_rank):
    rank, _ = rank_and_world()
    if rank == bad_rank:
        print(f"about to fail on rank {rank}")
        raise ValueError(f"boom on rank {rank}")
    return rank


def _fail_then_peers_stuck():
    rank, _ = rank_and_world()
    if rank == 0:
        raise ValueError("rank 0 gives up before the all_reduce")
    t = torch.ones(1)
    with current_op("all_reduce after rank 0 failed"):
        tdist.all_reduce(t)
    return t


def _stuck_all_reduce():
    rank, _ = rank_and_world()
    if rank == 0:
        return "rank 0 skipped the all_reduce"
    t = torch.ones(1)
    with current_op("all_reduce on mesh dim 'domain'"):
        tdist.all_reduce(t)
    return t


def _exit_on(bad_rank, code):
    rank, _ = rank_and_world()
    if rank == bad_rank:
        sys.stdout.flush()
        os._exit(code)
    return rank


def _segfault_on(bad_rank):
    rank, _ = rank_and_world()
    if rank == bad_rank:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV
    return rank


def _helpers():
    rank, world = rank_and_world()
    made = worker_cache("made", lambda: [])
    made.append(1)
    assert dist_pool.in_worker()
    set_current_op("step A")
    assert dist_pool.get_current_op() == "step A"
    with current_op("step B"):
        assert dist_pool.get_current_op() == "step B"
    assert dist_pool.get_current_op() == "step A"
    return rank, world, len(made), os.environ["RANK"], os.environ["WORLD_SIZE"]


def _change_global_state():
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return True


def _global_state():
    return torch.get_default_dtype(), torch.is_grad_enabled(), dist_pool.get_current_op()


def _failing_assert(x):
    assert x == 2
    return x


def _skip_all():
    pytest.skip("not supported here")


def _print_hello():
    rank, _ = rank_and_world()
    print(f"hello from {rank}")
    return rank


def _unpicklable():
    import threading

    return threading.Lock()


def _cwd():
    return os.getcwd()


def _pids():
    return os.getpid()


def _takes_timeout(timeout):
    return timeout


# ----------------------------------------------------------------------------------------------


def _pid_gone(pid: int, within: float = 5.0) -> bool:
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):  # exited and reaped
            return True
        time.sleep(0.05)  # still running, or a zombie not reaped yet
    return False


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_sum(dist, world_size):
    out = dist.run(world_size, _all_reduce_rank)
    assert len(out) == world_size
    expected = float(sum(range(world_size)))
    for t in out:
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float64
        assert t.item() == expected


def test_returned_tensors_come_back(dist):
    out = dist.run(3, _tensors_back, 2.0, offset=1.0)
    for rank, res in enumerate(out):
        assert res["rank"] == rank
        assert type(res["nonleaf"]) is torch.Tensor
        assert not res["nonleaf"].requires_grad
        torch.testing.assert_close(res["nonleaf"], torch.full((2, 3), 2.0 * rank + 1.0))
        assert type(res["param"]) is torch.Tensor
        torch.testing.assert_close(res["param"], torch.arange(3.0))
        assert res["nested"][0].shape == (0, 4)
        assert res["nested"][1][0].item() == rank
        assert res["threads"] == 1


def test_rank_failure_reports_traceback(dist):
    pool = dist.pool(3)
    with pytest.raises(RankFailure) as info:
        dist.run(3, _raise_on, 1)
    exc = info.value
    assert isinstance(exc, AssertionError)
    assert exc.ranks == [1]
    msg = str(exc)
    assert "rank 1" in msg
    assert "ValueError: boom on rank 1" in msg
    assert "Traceback (most recent call last)" in msg
    assert "_raise_on" in msg  # the frame of the rank function
    assert "about to fail on rank 1" in msg  # the failing rank's output
    # the pool works again
    assert [t.item() for t in dist.run(3, _all_reduce_rank)] == [3.0] * 3
    assert pool.alive


def test_failure_with_peers_stuck_in_collective():
    with WorkerPool(3, grace=1.0) as pool:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_fail_then_peers_stuck, timeout=30)
        elapsed = time.monotonic() - t0
        assert elapsed < 10, elapsed  # grace (1 s) + stack dump, not the 30 s task timeout
        msg = str(info.value)
        assert info.value.ranks == [0, 1, 2]
        assert "ValueError: rank 0 gives up" in msg
        assert "rank 1 still running" in msg and "rank 2 still running" in msg
        assert "stuck in: all_reduce after rank 0 failed" in msg
        assert "all_reduce" in msg
        starts = pool.starts
        assert [t.item() for t in pool.run(_all_reduce_rank)] == [3.0] * 3
        assert pool.starts == starts + 1  # restarted transparently


def test_stuck_collective_times_out(dist):
    pool = dist.pool(4)
    dist.run(4, _all_reduce_rank)
    old_pids = pool.pids
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        dist.run(4, _stuck_all_reduce, timeout=5)
    elapsed = time.monotonic() - t0
    assert 5 <= elapsed < 30, elapsed
    exc = info.value
    assert isinstance(exc, AssertionError)
    assert exc.ranks == [1, 2, 3]
    msg = str(exc)
    for r in (1, 2, 3):
        assert f"rank {r} stuck in: all_reduce on mesh dim 'domain'" in msg
        assert exc.ops[r] == "all_reduce on mesh dim 'domain'"
        # the Python stack of the stuck rank shows where it waits
        assert "all_reduce" in exc.stacks[r]
        assert "_stuck_all_reduce" in exc.stacks[r]
    assert "rank 0 stuck" not in msg
    # stuck workers were killed and reaped; the pool restarts with fresh processes
    assert all(_pid_gone(pid) for pid in old_pids)
    assert [t.item() for t in dist.run(4, _all_reduce_rank)] == [6.0] * 4
    assert not set(pool.pids) & set(old_pids)


def test_pg_timeout_bounds_a_stuck_collective():
    with WorkerPool(2, pg_timeout=2.0, grace=1.0) as pool:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_stuck_all_reduce, timeout=20)
        assert time.monotonic() - t0 < 15
        assert info.value.ranks == [1]  # Gloo's own timeout fired in rank 1's all_reduce
        assert "rank 1 raised while in: all_reduce on mesh dim 'domain'" in str(info.value)
        assert pool.run(_pids) == pool.pids


def test_rank_exit_reports_exit_code(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _exit_on, 1, 3)
    assert "rank 1 died with exit code 3" in str(info.value)
    assert info.value.exit_codes == {1: 3}
    assert dist.run(2, _exit_on, -1, 0) == [0, 1]


def test_rank_segfault_reports_signal(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _segfault_on, 0)
    msg = str(info.value)
    assert "rank 0 died with exit code -11 (SIGSEGV)" in msg
    assert "Fatal Python error" in msg  # faulthandler's report from the rank's output
    assert dist.run(2, _segfault_on, -1) == [0, 1]


def test_worker_helpers(dist):
    first = dist.run(2, _helpers)
    second = dist.run(2, _helpers)
    for rank in range(2):
        assert first[rank][:2] == (rank, 2)
        assert first[rank][3:] == (str(rank), "2")
        assert second[rank][2] == first[rank][2] + 1  # worker_cache persists across tasks


def test_global_state_restored_between_tasks(dist):
    assert dist.run(1, _change_global_state) == [True]
    assert dist.run(1, _global_state) == [(torch.float32, True, "")]


def test_assertions_in_rank_functions_are_rewritten(dist):
    with pytest.raises(RankFailure) as info:
        dist.run(2, _failing_assert, 1)
    assert "assert 1 == 2" in str(info.value)


def test_skip_on_all_ranks_skips(dist):
    with pytest.raises(pytest.skip.Exception, match="not supported here"):
        dist.run(2, _skip_all)


def test_output_is_relayed(dist, capsys):
    assert dist.run(2, _print_hello) == [0, 1]
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out
    assert "[rank 1] hello from 1" in out


def test_unpicklable_return_value(dist):
    pool = dist.pool(1)
    starts = pool.starts
    with pytest.raises(RankFailure, match="not picklable"):
        dist.run(1, _unpicklable)
    assert dist.run(1, _helpers)[0][:2] == (0, 1)
    assert pool.starts == starts  # nothing collective went wrong: no restart needed


def test_nested_functions_are_rejected(dist):
    def local_fn():
        return 1

    with pytest.raises(TypeError, match="module level"):
        dist.run(1, local_fn)
    with pytest.raises(TypeError, match="module level"):
        dist.run(1, lambda: 1)


def test_fn_from_module_not_importable_by_name(dist, tmp_path):
    import importlib.util

    path = tmp_path / "dp_hidden_module_xyz.py"
    path.write_text(textwrap.dedent("""
        import dist_pool

        def fn(a, b=0):
            rank, world = dist_pool.rank_and_world()
            return (rank, world, a + b)
    """))
    spec = importlib.util.spec_from_file_location("dp_hidden_module_xyz", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["dp_hidden_module_xyz"] = mod
    try:
        assert dist.run(2, mod.fn, 1, b=2) == [(0, 2, 3), (1, 2, 3)]
    finally:
        del sys.modules["dp_hidden_module_xyz"]


def test_cwd_and_timeout_kwarg(dist, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dist.run(2, _cwd) == [str(tmp_path)] * 2
    assert dist.pool(2).run_task(_takes_timeout, kwargs={"timeout": 7}) == [7, 7]


def test_close_leaves_no_processes():
    pool = WorkerPool(2)
    pids = pool.run(_pids)
    assert pids == pool.pids
    pool.close()
    assert all(_pid_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_pids)


def test_env_defaults(monkeypatch):
    monkeypatch.setenv("DOMAINFLOW_TEST_TASK_TIMEOUT", "7")
    monkeypatch.setenv("DOMAINFLOW_TEST_PG_TIMEOUT", "11")
    pool = WorkerPool(2, start=False)
    try:
        assert pool.timeout == 7.0 and pool.pg_timeout == 11.0 and pool.pids == []
        assert WorkerPool(1, timeout=3, start=False).timeout == 3.0
    finally:
        pool.close()


def _destroy_pg():
    tdist.destroy_process_group()
    return True


def test_task_destroying_the_process_group_gets_fresh_workers(dist):
    pool = dist.pool(2)
    dist.run(2, _all_reduce_rank)
    starts = pool.starts
    assert dist.run(2, _destroy_pg) == [True, True]
    assert [t.item() for t in dist.run(2, _all_reduce_rank)] == [1.0, 1.0]
    assert pool.starts == starts + 1
