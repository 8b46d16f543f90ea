"""PyTorch's own op database (``op_db``) against domainflow, run in a pool's workers: each op's first sample
inputs, the input sharded unevenly along its first dim of length >= 2 (one layout with every rank holding rows,
one with an empty shard), forward and input gradient compared with the op on full tensors in this process.
Each case ends in one outcome: ``exact``, ``gather`` (a named ``UnsupportedShardedOp``, and exact under the
opt-in ``fallback("gather")``), ``refused`` (refused even then), ``wrong`` or ``crash`` (any other error); ops
that are random, take no tensor input or have no dim to shard are ``skip``.
Used by ``tests/ops/test_op_db.py`` (a fixed sample of ops) and ``benchmarks/op_db_sweep.py`` (all of them)."""

from __future__ import annotations

import itertools
import zlib

import torch
from sharded_check import _assert_close, get_mesh, shard
from torch.utils._pytree import tree_flatten, tree_map

import domainflow as df
from domainflow import Partial, Replicate, Shard, ShardTensor
from domainflow.tensor import consistency
from dist_pool import rank_and_world

TOL = 1e-9
SAMPLES = 2
DTYPE = torch.float64


def candidate_ops() -> list:
    """``op_db`` entries with float64 support on CPU, by case name (``name.variant``). Turns off, in this
    process, torch's search of the stack for the running unittest test (below)."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.opinfo import core

    # torch's sample generators look for the running unittest test in the stack, reading the source of every
    # frame (inspect.stack(): about 40 ms a call in a rank, half the op sweep's time); no test is a unittest one
    # here, so the search always finds none
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    return [o for o in op_db if DTYPE in o.supported_dtypes("cpu") and not o.is_factory_function]


def case_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def layouts(n: int, world: int) -> list[tuple[int, ...]]:
    """Two uneven splits of ``n`` rows over ``world`` ranks: every rank holding rows where it can, and one
    with the first rank empty."""
    uneven = [n // world] * world
    uneven[-1] += n % world
    if n % world == 0 and uneven[0] > 1:
        uneven[0] -= 1
        uneven[-1] += 1
    empty = [0] + [n // (world - 1)] * (world - 1)
    empty[-1] += n - sum(empty)
    return [tuple(uneven), tuple(empty)]


def run_cases(names: list[str], seed: int = 0) -> dict[str, str]:
    """Every case of the named ops on this pool's ranks: {``name`` or ``name[k] sizes``: outcome line}; the
    outcome of an op is its worst case's (crash > wrong > refused > gather > exact > skip)."""
    import warnings

    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    ops = {case_name(o): o for o in candidate_ops()}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecations and our relayout notes, thousands of lines
        for name in names:
            out[name] = _run_op(ops[name], mesh, world, seed)
    return out


_RANDOM_NAMES = ("rand", "normal", "bernoulli", "multinomial", "uniform", "exponential", "geometric", "cauchy",
                 "log_normal", "poisson")
_RANK = {"skip": 0, "exact": 1, "gather": 2, "refused": 3, "wrong": 4, "crash": 5}
KINDS = tuple(_RANK)


def sharded_samples(op, seed: int):
    """(the op's cases: [(sample number, sample, the dim to shard)], None), or ([], why it is skipped). The same
    samples on every rank and in every harness (sample functions draw from torch, numpy and Python's random)."""
    import random

    import numpy as np

    torch.manual_seed(zlib.crc32(case_name(op).encode()) + seed)
    np.random.seed(zlib.crc32(case_name(op).encode()) % 2**32)
    random.seed(zlib.crc32(case_name(op).encode()) + seed)
    try:
        samples = list(itertools.islice(op.sample_inputs("cpu", DTYPE, requires_grad=op.supports_autograd), SAMPLES))
    except Exception as e:  # noqa: BLE001
        return [], f"skip: no samples ({type(e).__name__})"
    cases = []
    for k, sample in enumerate(samples):
        x = sample.input
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            continue
        dim = next((d for d, n in enumerate(x.shape) if n >= 2), None)
        if dim is not None:
            cases.append((k, sample, dim))
    return cases, None if cases else "skip: no sample with a tensor input of a dim of length >= 2"


def _run_op(op, mesh, world: int, seed: int) -> str:
    cases, skipped = sharded_samples(op, seed)
    worst = skipped or "skip: no sample with a tensor input of a dim of length >= 2"
    for k, sample, dim in cases:
        x = sample.input
        if _random_on_any_rank(op, sample, mesh):
            return "skip: random"
        for sizes in layouts(x.shape[dim], world):
            outcome = _one_case(op, sample, dim, sizes, mesh, seed)
            try:  # this case's pending layout checks, here, not at the next case's first collective
                consistency.flush("the end of the case")
            except df.DomainflowError as e:
                outcome = f"crash: {type(e).__name__}: {_line(e)}" if outcome.startswith(("exact", "skip")) else outcome
            outcome = _agreed(outcome, mesh)
            if _RANK[outcome.split(":")[0]] > _RANK[worst.split(":")[0]]:
                worst = f"{outcome.split(':')[0]}: sample {k} dim {dim} sizes {list(sizes)}" + (
                    ":" + outcome.split(":", 1)[1] if ":" in outcome else "")
    return worst


def _random_on_any_rank(op, sample, mesh) -> bool:
    """:func:`_random`, agreed by every rank: an op that returns uninitialised memory (``empty_like``) may give
    equal values twice on one rank and not on another, and ranks that take different paths do not pair."""
    from domainflow import comm

    return any(comm.all_gather_object(_random(op, sample), mesh, 0))


def _random(op, sample) -> bool:
    """Draws random numbers: torch's op database wraps such ops in ``wrapper_set_seed`` (a fixed seed per call,
    which every rank would repeat on its own chunk), or its output changes with the seed."""
    import inspect

    if op.name.startswith(_RANDOM_NAMES) or "dropout" in op.name:  # some reseed inside, out of sight
        return True
    if "wrapper_set_seed" in getattr(getattr(op.op, "__code__", None), "co_names", ()):  # (a lambda's source
        return True  # is its first line only)
    try:
        if "wrapper_set_seed" in inspect.getsource(op.op):
            return True
    except (OSError, TypeError):
        pass

    def once(s):
        torch.manual_seed(s)
        with torch.no_grad():  # on copies: an in-place op (``uniform_``) must not change the sample
            return tree_flatten(op(sample.input.detach().clone(), *tree_map(_clone, sample.args),
                                   **tree_map(_clone, sample.kwargs)))[0]

    def same(u, v) -> bool:
        u, v = u.detach(), v.detach()
        if u.is_complex():
            u, v = torch.view_as_real(u.resolve_conj()), torch.view_as_real(v.resolve_conj())
        return torch.equal(u, v) or (u.is_floating_point() and torch.equal(u.nan_to_num(), v.nan_to_num()))

    try:
        a, b = once(0), once(1)
        return any(isinstance(u, torch.Tensor) and u.layout == torch.strided and not same(u, v) for u, v in zip(a, b))
    except Exception:  # noqa: BLE001 - the reference itself fails: not ours to judge, and not random either
        return False


def _agreed(outcome: str, mesh) -> str:
    """Every rank's outcome; ranks that disagree are a crash (a refusal or error on some ranks only). Through
    domainflow's collective layer, whose pairing round names a rank left in another collective instead of
    letting Gloo abort the process."""
    from domainflow import comm

    try:
        got = comm.all_gather_object(outcome, mesh, 0)
    except df.DomainflowError as e:
        return f"crash: ranks out of step ({type(e).__name__}): " + _line(e)
    if len({g.split(":")[0] for g in got}) > 1:
        return "crash: ranks disagree: " + " | ".join(f"rank {r}: {g}" for r, g in enumerate(got))
    return got[0]


def _clone(a):
    return a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a


def _one_case(op, sample, dim: int, sizes, mesh, seed: int) -> str:
    """One case's outcome; an op refused by name is run again under the opt-in ``fallback("gather")``, which
    must then give the one-process result too: ``gather`` (refused, exact when gathered) or ``refused``
    (refused even then), and a wrong result or crash under the fallback is one like any other."""
    outcome = _attempt(op, sample, dim, sizes, mesh, seed)
    if not outcome.startswith("refused"):
        return outcome
    with df.fallback("gather"):
        again = _attempt(op, sample, dim, sizes, mesh, seed)
    kind = again.split(":")[0]
    if kind == "exact":
        return "gather" + outcome.removeprefix("refused")
    if kind in ("wrong", "crash"):
        return f"{kind}: under fallback('gather'):" + again.split(":", 1)[1]
    return outcome


def _attempt(op, sample, dim: int, sizes, mesh, seed: int) -> str:
    full = sample.input.detach()
    grad = op.supports_autograd and full.is_floating_point()
    args, kwargs = tree_map(_clone, sample.args), tree_map(_clone, sample.kwargs)
    ref_x = full.clone().requires_grad_(grad)
    try:
        ref = op(ref_x, *args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return f"skip: the op on full tensors fails ({type(e).__name__})"
    ref_outs, _ = tree_flatten(ref)
    try:
        st, leaf = shard(full, mesh, [Shard(dim)], {0: sizes}, requires_grad=grad)
        got = op(st, *tree_map(_clone, sample.args), **tree_map(_clone, sample.kwargs))
        got_outs, _ = tree_flatten(got)
        if len(got_outs) != len(ref_outs):
            return f"wrong: {len(got_outs)} outputs, {len(ref_outs)} on one process"
        fulls = []
        for i, (g, r) in enumerate(zip(got_outs, ref_outs)):
            if isinstance(g, ShardTensor):
                g = g.full_tensor()
            fulls.append(g)
            if isinstance(r, torch.Tensor):
                if not isinstance(g, torch.Tensor):
                    return f"wrong: output {i} is a {type(g).__name__}"
                if g.dtype != r.dtype:
                    return f"wrong: output {i} is {g.dtype}, {r.dtype} on one process"
                _assert_close(g, r.detach(), TOL, f"output {i}")
            elif g != r and not (g != g and r != r):
                return f"wrong: output {i} is {g!r}, {r!r} on one process"
        wanted = [(f, r) for f, r in zip(fulls, ref_outs) if isinstance(r, torch.Tensor) and r.requires_grad
                  and (r.is_floating_point() or r.is_complex())]
        if grad and wanted:
            gen = torch.Generator().manual_seed(seed)
            cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(r.dtype) for _, r in wanted]
            try:
                torch.autograd.backward([r for _, r in wanted], cots, inputs=[ref_x])
            except Exception:  # noqa: BLE001 - torch refuses this cotangent on one process (linalg.eig's phase
                return "exact"  # check): the forward was compared; no gradient to compare with
            ref_g = ref_x.grad
            torch.autograd.backward([f for f, _ in wanted], cots, inputs=[leaf])
            if leaf.grad is None:
                if ref_g is not None and ref_g.any():
                    return "wrong: no gradient reached the sharded input"
            else:
                pl = [Replicate() if isinstance(p, Partial) else p for p in st._spec.placements]
                g = ShardTensor.from_local(leaf.grad, mesh, pl, sharding_shapes={
                    m: s for m, s in enumerate(st._spec.sizes) if s is not None})
                _assert_close(g.full_tensor(), ref_g if ref_g is not None else torch.zeros_like(full), TOL,
                              "input gradient")
        return "exact"
    except df.UnsupportedShardedOp as e:
        return "refused: " + _line(e)
    except AssertionError as e:
        return "wrong: " + _line(e)
    except Exception as e:  # noqa: BLE001 - every other error is a crash, named
        return f"crash: {type(e).__name__}: {_line(e)}"


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


def sweep(pools, world: int, names: list[str], chunk: int = 40) -> dict[str, str]:
    """Every named op on ``world`` ranks of ``pools`` (a ``dist_pool.PoolCache``; this side of the pool):
    {name: outcome}. An op that leaves the ranks out of step (a crash mid-collective) is reported as its own
    crash and the pool restarted, so the ops after it start in step."""
    got: dict[str, str] = {}
    todo = list(names)
    while todo:
        batch = todo[:chunk]
        part = pools.run(world, run_cases, batch)[0]
        kept, restart = 0, False
        for name in batch:
            outcome = part[name]
            if "ranks out of step" in outcome and kept:  # an earlier op's doing: rerun this one on fresh ranks
                restart = True
                break
            got[name] = outcome
            kept += 1
            if outcome.startswith("crash"):  # it may have left a collective half done
                restart = True
                break
        todo = todo[kept:]
        if restart:
            pools.pool(world).restart()
    return got
