"""Multi-tensor (``torch._foreach_*``) ops on ShardTensor leaves: the optimizers' foreach paths and
``clip_grad_norm_(foreach=True)`` give the single-device parameters, layouts stay the leaves'."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import domainflow as df
from dist_pool import rank_and_world
from domainflow import Replicate, Shard
from sharded_check import get_mesh, nearly_empty_sizes

D = torch.float64
OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                               foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, foreach=True),
}


def _optimizers(seed):
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    problems = []
    for name, make in OPTIMIZERS.items():
        fulls = [torch.randn(7, 5, generator=gen, dtype=D), torch.randn(3, 9, generator=gen, dtype=D),
                 torch.randn(4, generator=gen, dtype=D)]
        layouts = [([Shard(0)], {0: nearly_empty_sizes(7, world, rng)}),
                   ([Shard(1)], {0: nearly_empty_sizes(9, world, rng)}), ([Replicate()], None)]
        sts = [df.distribute_tensor(f, mesh, pl, sharding_shapes=sz).requires_grad_() for f, (pl, sz) in
               zip(fulls, layouts)]
        refs = [f.clone().requires_grad_() for f in fulls]
        opt, ref_opt = make(sts), make(refs)
        for _ in range(3):
            for ps, o in ((sts, opt), (refs, ref_opt)):
                loss = sum((p.sin() * (k + 1)).sum() for k, p in enumerate(ps[:2])) + (ps[2] ** 2).sum()
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(ps, 0.5, foreach=True)
                o.step()
                o.zero_grad()
            if isinstance(norm, df.ShardTensor):
                norm = norm.full_tensor()
        for k, (st, ref) in enumerate(zip(sts, refs)):
            err = (st.full_tensor() - ref).abs().max().item()
            if err > 1e-12:
                problems.append(f"{name}: parameter {k} differs from one device by {err:.3e}")
            if tuple(st.placements) != tuple(layouts[k][0]):
                problems.append(f"{name}: parameter {k} now laid out {st.placements}")
        for k, st in enumerate(sts):
            for key, v in opt.state[st].items():
                if isinstance(v, df.ShardTensor) and v.shape == st.shape and v._spec != st._spec:
                    problems.append(f"{name}: state {key} of parameter {k} laid out unlike it")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3])
def test_foreach_optimizers_and_clipping_equal_one_device(dist, world):
    for problems in dist.run(world, _optimizers, 40 + world):
        assert not problems, problems


def _mixed_layouts():
    _, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 4, generator=gen, dtype=D), torch.randn(6, 4, generator=gen, dtype=D)
    xa = df.distribute_tensor(a, mesh, [Shard(0)])
    xb = df.distribute_tensor(b, mesh, [Shard(1)])  # another layout: moved to xa's, with a warning
    xc = df.distribute_tensor(b, mesh, [Shard(0)])
    from domainflow.dispatch import toolkit

    toolkit._relayout_warned.clear()  # relayout warnings are once per process; this worker may have warned
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch._foreach_add_([xa, xc], [xb, b], alpha=2.0)  # a plain tensor at index 1
    moved = any("layout of the first tensor" in str(m.message) for m in w)
    out = torch._foreach_mul([xa, xc], [0.5, 3.0])  # a scalar per index
    norms = torch._foreach_norm([xa, xb])
    return (moved, xa.placements, out[0].full_tensor(), out[1].full_tensor(),
            [n.full_tensor() if isinstance(n, df.ShardTensor) else n for n in norms])


@pytest.mark.parametrize("world", [2, 3])
def test_foreach_with_mixed_layouts_plain_tensors_and_scalar_lists(dist, world):
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 4, generator=gen, dtype=D), torch.randn(6, 4, generator=gen, dtype=D)
    want_a, want_c = a + 2 * b, b + 2 * b
    for moved, placements, o0, o1, norms in dist.run(world, _mixed_layouts):
        assert moved, "moving an operand to another layout must warn"
        assert placements == (Shard(0),)
        torch.testing.assert_close(o0, want_a * 0.5, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o1, want_c * 3.0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(norms[0], torch.linalg.vector_norm(want_a), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(norms[1], torch.linalg.vector_norm(b), rtol=1e-12, atol=1e-12)
