"""Worker-side helpers for multi-rank tests: meshes, random uneven layouts, and ``check_sharded``,
the reusable check that compares a function on sharded inputs with the same function on the full
tensors in one process (outputs, input gradients, parameter gradients and the output layout)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import domainflow as df
from dist_pool import worker_cache
from domainflow import Partial, Replicate, ShardTensor

F64_TOL = 1e-10
F32_TOL = 1e-5


def get_mesh(shape: Sequence[int], names: Sequence[str] | None = None):
    """A device mesh over this worker's ranks, cached for the worker's life."""
    shape = tuple(shape)
    names = tuple(names) if names else tuple(f"d{i}" for i in range(len(shape)))
    return worker_cache(("mesh", shape, names), lambda: df.init_mesh(shape, names))


def mesh_shapes(world: int) -> list[tuple[int, ...]]:
    """1-D mesh always; 2-D meshes when the world size factorises."""
    out = [(world,)]
    if world == 4:
        out.append((2, 2))
    if world == 2:
        out.append((1, 2))
    return out


def random_sizes(n: int, parts: int, rng: random.Random, zeros: bool = True) -> tuple[int, ...]:
    """A random split of ``n`` into ``parts`` contiguous sizes, zeros allowed (and likely for small n)."""
    if parts == 1:
        return (n,)
    while True:
        cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
        sizes = tuple(b - a for a, b in zip([0] + cuts, cuts + [n]))
        if zeros or min(sizes) > 0 or n < parts:
            return sizes


def nearly_empty_sizes(n: int, parts: int, rng: random.Random) -> tuple[int, ...]:
    """Random uneven sizes of ``n`` over ``parts`` ranks, one rank holding at most one row."""
    s = list(random_sizes(n, parts, rng))
    if parts > 1:
        k = rng.randrange(parts)
        extra = s[k] - min(s[k], 1)
        s[k] -= extra
        s[(k + 1) % parts] += extra
    return tuple(s)


@dataclass
class Sharded:
    """A full tensor and the layout to shard it with (``sizes`` per mesh dim; None: chunk sizes)."""

    full: torch.Tensor
    placements: Sequence
    sizes: dict = field(default_factory=dict)
    requires_grad: bool = True


def shard(full: torch.Tensor, mesh, placements, sizes: dict | None = None, requires_grad: bool = False):
    """(ShardTensor, local leaf) for this rank's piece of ``full`` under the given layout."""
    st = df.distribute_tensor(full.detach(), mesh, placements, sharding_shapes=sizes or None)
    local = st.to_local().detach().clone().requires_grad_(requires_grad)
    spec = st._spec
    mapping = {m: s for m, s in enumerate(spec.sizes) if s is not None}
    pl = [Replicate() if isinstance(p, Partial) else p for p in spec.placements]
    if any(isinstance(p, Partial) for p in spec.placements):
        # a Partial input: keep the local values distribute_tensor chose (rank 0 holds the value)
        pl = list(spec.placements)
    return ShardTensor.from_local(local, mesh, pl, sharding_shapes=mapping), local


def _as_tuple(out):
    if isinstance(out, (tuple, list)):
        return tuple(out)
    return (out,)


def check_sharded(fn: Callable, inputs: Sequence, mesh, module: torch.nn.Module | None = None,
                  expect_placements: Sequence | None = None, expect_sizes: dict | None = None,
                  tol: float | None = None, backward: bool = True, seed: int = 0) -> dict:
    """Run ``fn(*inputs[, module])`` sharded and on full tensors in this process; assert equal
    outputs, input gradients and parameter gradients, and the first output's layout.

    ``inputs`` items are :class:`Sharded` (sharded per its layout), tensors (passed as plain tensors
    to both runs) or other values. Returns max errors, for tests that want to report them.
    """
    # ---- reference: full tensors, one process -----------------------------------------------
    ref_in = []
    for a in inputs:
        if isinstance(a, Sharded):
            t = a.full.detach().clone()
            if a.requires_grad and t.is_floating_point():
                t.requires_grad_()
            ref_in.append(t)
        else:
            ref_in.append(a)
    ref_mod = copy.deepcopy(module) if module is not None else None
    ref_out = _as_tuple(fn(*ref_in, ref_mod) if module is not None else fn(*ref_in))
    dtype = next((o.dtype for o in ref_out if isinstance(o, torch.Tensor) and o.is_floating_point()), torch.float64)
    tol = tol if tol is not None else (F64_TOL if dtype == torch.float64 else F32_TOL)
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
           if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in ref_out]
    do_backward = backward and any(o.requires_grad for o in ref_out if isinstance(o, torch.Tensor))
    if do_backward:
        sum((o * c).sum() for o, c in zip(ref_out, cot) if c is not None and o.requires_grad).backward()

    # ---- sharded -----------------------------------------------------------------------------
    sh_in, leaves = [], []
    for a in inputs:
        if isinstance(a, Sharded):
            st, leaf = shard(a.full, mesh, a.placements, a.sizes,
                             requires_grad=a.requires_grad and a.full.is_floating_point())
            sh_in.append(st)
            leaves.append((leaf, st))
        else:
            sh_in.append(a)
            leaves.append(None)
    sh_mod = copy.deepcopy(module) if module is not None else None
    out = _as_tuple(fn(*sh_in, sh_mod) if module is not None else fn(*sh_in))
    errors = {}
    assert len(out) == len(ref_out), f"sharded run returned {len(out)} outputs, reference {len(ref_out)}"
    fulls = []
    for k, (o, r) in enumerate(zip(out, ref_out)):
        if not isinstance(r, torch.Tensor):
            assert o == r, f"output {k}: {o!r} != {r!r}"
            fulls.append(None)
            continue
        assert isinstance(o, ShardTensor), f"output {k} is a {type(o).__name__}, expected a ShardTensor"
        assert tuple(o.shape) == tuple(r.shape), f"output {k}: global shape {tuple(o.shape)} != {tuple(r.shape)}"
        f = o.full_tensor()
        fulls.append(f)
        errors[f"out{k}"] = _assert_close(f, r, tol, f"output {k}")
    if expect_placements is not None:
        got = tuple(out[0].placements)
        assert got == tuple(expect_placements), f"output placements {got}, expected {tuple(expect_placements)}"
    if expect_sizes is not None:
        got = {m: s for m, s in enumerate(out[0]._spec.sizes) if s is not None}
        assert got == {m: tuple(s) for m, s in expect_sizes.items()}, f"output sharding sizes {got}, expected {expect_sizes}"
    if do_backward:
        loss = sum((f * c).sum() for f, c in zip(fulls, cot) if c is not None and f is not None and f.requires_grad)
        loss.backward()
        for i, (a, lv) in enumerate(zip(inputs, leaves)):
            if lv is None or not isinstance(a, Sharded) or not ref_in[i].requires_grad:
                continue
            leaf, st = lv
            ref_g = ref_in[i].grad
            if leaf.grad is None:
                assert ref_g is None or not ref_g.any(), f"input {i}: no gradient reached the sharded input"
                continue
            gspec = st._spec
            pl = [Replicate() if isinstance(p, Partial) else p for p in gspec.placements]
            g = ShardTensor.from_local(leaf.grad, mesh, pl,
                                       sharding_shapes={m: s for m, s in enumerate(gspec.sizes) if s is not None})
            errors[f"grad_in{i}"] = _assert_close(g.full_tensor(), ref_g, tol, f"gradient of input {i}")
        if module is not None:
            for (name, p), (_, rp) in zip(sh_mod.named_parameters(), ref_mod.named_parameters()):
                if rp.grad is None:
                    continue
                assert p.grad is not None, f"parameter {name} got no gradient"
                assert type(p.grad) is torch.Tensor, f"parameter {name}.grad is a {type(p.grad).__name__}"
                errors[f"grad_{name}"] = _assert_close(p.grad, rp.grad, tol, f"gradient of parameter {name}")
    return errors


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> float:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.is_floating_point() and not got.is_complex():
        assert torch.equal(got, want), f"{what}: {got} != {want}"
        return 0.0
    err = (got.detach().double() - want.detach().double()).abs()
    scale = want.detach().double().abs().clamp_min(1.0)
    rel = (err / scale).nan_to_num(nan=0.0)
    nan_mismatch = bool((got.isnan() != want.isnan()).any())
    worst = float(rel.max()) if rel.numel() else 0.0
    assert not nan_mismatch and worst <= tol, f"{what}: max error {worst:.3e} > {tol:.0e}"
    return worst
