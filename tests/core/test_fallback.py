"""Error paths of the engine: unsupported ops raise a named error on every rank, and fallback("gather")
gives the single-device result (forward and backward)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh

import domainflow as df
from domainflow import Shard, ShardTensor
from sweep import none_failed as _ok, check_into as _run, randn as _t, empty_shard_layouts as _zero_layouts

D = torch.float64


# =================================================================================================
# 8. error paths: unsupported ops raise, fallback('gather') is correct
# =================================================================================================
def _errors(seed):
    world = rank_and_world()[1]
    mesh = get_mesh((world,))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    n = 6
    full = _t(gen, n, 3)
    idx = torch.tensor([4, 0, 2])
    ops = {
        "cumsum0": lambda a: torch.cumsum(a, 0),
        "cummax0": lambda a: torch.cummax(a, 0)[0],
        "sort0": lambda a: torch.sort(a, 0)[0],
        "topk0": lambda a: torch.topk(a, 2, 0)[0],
        "flip0": lambda a: torch.flip(a, [0]),
        "roll0": lambda a: torch.roll(a, 1, 0),
        "softmax0": lambda a: torch.softmax(a, 0),
        "logsumexp0": lambda a: torch.logsumexp(a, 0),
        "median0": lambda a: torch.median(a, 0)[0],
        "index_select0": lambda a: torch.index_select(a, 0, idx),
        "adv_index0": lambda a: a[idx],
        "pad0": lambda a: F.pad(a.t(), (1, 2)).t(),
        "reshape_split_rows": lambda a: a.reshape(3, n).sum(0),
        "unfold": lambda a: a.unfold(0, 2, 1).sum(-1),
        "kthvalue": lambda a: torch.kthvalue(a, 2, 0)[0],
    }
    for sizes in _zero_layouts(n, world, rng)[:3]:
        for name, fn in ops.items():
            st = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
            want = fn(full)
            try:
                got = fn(st)
            except df.UnsupportedShardedOp:
                pass
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name} {sizes}: raised {type(e).__name__} (not UnsupportedShardedOp): "
                                f"{str(e).splitlines()[0][:200]}")
                continue
            else:
                g = got.full_tensor() if isinstance(got, ShardTensor) else got
                if g.shape != want.shape or not torch.allclose(g.double(), want.double(), atol=1e-10, rtol=1e-10):
                    failures.append(f"{name} {sizes}: silently wrong result")
                    continue
            # with the gather fallback the op gives the right values (forward and backward)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with df.fallback("gather"):
                    x = Sharded(full, [Shard(0)], {0: sizes})
                    _run(fn, [x], mesh, f"fallback_{name} {sizes}", failures)
    return _ok(failures)


@pytest.mark.parametrize("world", (3,))
def test_unsupported_ops_raise_and_fallback_is_correct(dist, world):
    assert all(dist.run(world, _errors, 800 + world))


def _argmax_keepdim():
    mesh = get_mesh((rank_and_world()[1],))
    gen = torch.Generator().manual_seed(0)
    x = Sharded(_t(gen, 5, 3), [Shard(0)], {0: (2, 3)})
    check_sharded(lambda a: a.argmax(keepdim=True), [x], mesh)
    return True


def test_argmax_flat_keepdim(dist):
    # Regression test (bug found in review, now fixed): argmax(dim=None, keepdim=True) returns shape () instead of (1, 1):
    # indexed_reduction's dim-None branch ignores keepdim.
    assert all(dist.run(2, _argmax_keepdim))


def _argmax_nan():
    mesh = get_mesh((rank_and_world()[1],))
    full = torch.arange(12.0, dtype=D).reshape(2, 6)
    full[1, 0] = float("nan")   # flat index 6, on rank 0 (cols 0..2)
    full[0, 4] = float("nan")   # flat index 4, on rank 1 (cols 3..5): torch returns 4
    x = df.distribute_tensor(full, mesh, [Shard(1)], sharding_shapes={0: (3, 3)})
    got, want = int(x.argmax()), int(full.argmax())
    assert got == want, f"argmax with NaNs: {got}, expected {want}"
    return True


def test_argmax_flat_nan_on_column_shards(dist):
    # Regression test (bug found in review, now fixed): _flat_candidates keeps the first NaN candidate in rank order rather than the smallest
    # global flat index; with column shards the later rank can hold the earlier NaN.
    assert all(dist.run(2, _argmax_nan))
