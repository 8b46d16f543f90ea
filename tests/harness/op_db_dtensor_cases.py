"""PyTorch's own op database (``op_db``) through PyTorch's DTensor, run in a pool's workers, on the cases of
``op_db_cases.py`` (the same candidate ops, the same first two float64 samples drawn with the same seeds, the
same skip rules, the same closeness rule and cotangents) so that ``benchmarks/op_db_dtensor.py`` can set
DTensor's outcomes beside domainflow's.

The one difference is the layout: DTensor has no uneven shard sizes, so the input is sharded with
``torch.distributed.tensor.distribute_tensor(full, mesh, [Shard(dim)])``, DTensor's own ``torch.chunk`` split
(one case per sample, not op_db_cases' two uneven layouts; trailing shards may be empty, e.g. 2 rows on 3
ranks give 1, 1, 0). Every other plain tensor argument becomes a replicated DTensor (``[Replicate()]``).

Outcomes: ``exact`` (naming the collectives DTensor added in the forward, counted as ``CommDebugMode`` would:
an ``all_gather_into_tensor`` there is DTensor gathering a sharded input, silently), ``refused`` (DTensor raises
``NotImplementedError`` or names an operator that "does not have a sharding strategy registered"), ``wrong``,
``crash`` (any other error; ``in backward:`` / ``in full_tensor:`` say where) or ``skip``; an op's outcome is
its worst case's (crash > wrong > refused > exact > skip)."""

from __future__ import annotations

import json

import torch
from op_db_cases import TOL, _clone, _line, _random, candidate_ops, case_name, sharded_samples
from sharded_check import _assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from dist_pool import rank_and_world, set_current_op, worker_cache

_RANK = {"skip": 0, "exact": 1, "refused": 2, "wrong": 3, "crash": 4}
KINDS = tuple(_RANK)


class _Wrong(Exception):
    """A comparison with the one-process result failed (DTensor's own AssertionErrors stay crashes)."""


def _close(got, want, what: str) -> None:
    try:
        _assert_close(got, want, TOL, what)
    except AssertionError as e:
        raise _Wrong(_line(e)) from None


class OutOfStep(Exception):
    """The ranks could not agree on a case's outcome: the process group may be mid-collective."""


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return worker_cache(("dtensor_mesh", world), lambda: init_device_mesh("cpu", (world,)))


def chunk_sizes(n: int, world: int) -> list[int]:
    """The sizes ``torch.chunk`` (and so DTensor's ``Shard``) gives ``n`` rows over ``world`` ranks."""
    step = -(-n // world) if n else 0
    return [max(0, min(step, n - r * step)) for r in range(world)]


def _agreement_group(world: int, timeout: float):
    """A Gloo group of its own for exchanging outcomes, so that a rank that failed alone cannot pair its
    exchange with another rank's DTensor collective (Gloo aborts the process on such a mismatch): the others
    run into the process group's timeout instead, and every rank's error is reported."""
    from datetime import timedelta

    import torch.distributed as tdist

    return worker_cache(("dtensor_agree", world, timeout),
                        lambda: tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)))


def run_cases(names: list[str], progress: str | None = None, agree_timeout: float = 60.0,
              seed: int = 0) -> tuple[dict[str, str], bool]:
    """Every case of the named ops on this pool's ranks through DTensor: ({name: outcome line}, out_of_step).
    Rank 0 appends each op's [name, outcome, ends the task] to ``progress`` (JSON lines) as it finishes, so the
    parent keeps them when a later op hangs or kills a rank. An op whose ranks end a case differently (one
    failed alone, the others timed out waiting for it) or cannot exchange outcomes ends the task
    (``out_of_step`` True: the parent restarts the pool before the next op)."""
    import warnings

    rank, world = rank_and_world()
    mesh = _mesh(world)
    group = _agreement_group(world, agree_timeout)
    ops = {case_name(o): o for o in candidate_ops()}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            set_current_op(f"DTensor op_db case {name}")
            try:
                out[name], stop = _run_op(ops[name], mesh, world, group, seed), False
            except OutOfStep as e:
                out[name], stop = str(e), True
            if rank == 0 and progress:
                with open(progress, "a") as f:
                    f.write(json.dumps([name, out[name], stop]) + "\n")
            if stop:
                return out, True
    return out, False


def _run_op(op, mesh, world: int, group, seed: int) -> str:
    # op_db_cases' seeding and sampling: the same samples on every rank and as domainflow's sweep
    cases, skipped = sharded_samples(op, seed)
    worst = skipped or "skip: no sample with a tensor input of a dim of length >= 2"
    for k, sample, dim in cases:
        x = sample.input
        if _random(op, sample):
            return "skip: random"
        where = f"sample {k} dim {dim} sizes {chunk_sizes(x.shape[dim], world)}"
        try:
            outcome, in_step = _agreed(_attempt(op, sample, dim, mesh, seed), group)
        except OutOfStep as e:
            raise OutOfStep(f"crash: {where}: {str(e).removeprefix('crash: ')}") from e
        line = f"{outcome.split(':')[0]}: {where}" + (":" + outcome.split(":", 1)[1] if ":" in outcome else "")
        if not in_step:
            raise OutOfStep(line)
        kind, was = outcome.split(":")[0], worst.split(":")[0]
        if _RANK[kind] > _RANK[was] or (kind == was == "exact" and "all_gather" in line and "all_gather" not in worst):
            worst = line  # the worst case; of exact ones, one where DTensor gathered the input
    return worst


def _agreed(outcome: str, group) -> tuple[str, bool]:
    """(every rank's outcome, whether the ranks ended the case alike). Ranks whose outcomes differ are a crash,
    each distinct outcome named with its ranks. Raises OutOfStep when the exchange itself fails."""
    import torch.distributed as tdist

    got = [None] * tdist.get_world_size()
    try:
        tdist.all_gather_object(got, outcome, group=group)
    except Exception as e:  # noqa: BLE001
        raise OutOfStep(f"crash: ranks out of step: {type(e).__name__}: {_line(e)}") from e
    if len(set(got)) == 1:
        return got[0], True
    distinct = {}
    for r, g in enumerate(got):
        distinct.setdefault(g, []).append(str(r))
    kinds = {g.split(":")[0] for g in got}
    head = "crash: ranks disagree" if len(kinds) > 1 else f"{kinds.pop()}: ranks differ"
    return head + ": " + " | ".join(f"rank {','.join(rs)}: {g[:200]}" for g, rs in distinct.items()), False


class _Collectives(TorchDispatchMode):
    """Counts the collectives DTensor issues (``_c10d_functional`` ops) while active, as ``CommDebugMode`` does
    but without its module hooks (which fail on ops that call an ``nn.Module``, e.g.
    ``triplet_margin_with_distance_loss``): DTensor's ops are handed on (``NotImplemented``) so that DTensor
    runs them, and the collectives on plain local tensors it then issues come back here."""

    NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func._overloadpacket.__name__
        if func.namespace in self.NAMESPACES and not name.startswith(("wait", "_wrap")):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **kwargs)


def _refusal(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, NotImplementedError) or "does not have a sharding strategy registered" in str(e):
            return True
        e = e.__cause__
    return False


def _attempt(op, sample, dim: int, mesh, seed: int) -> str:
    """op_db_cases._attempt with DTensor in place of ShardTensor (and no gather fallback)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = sample.input.detach()
    grad = op.supports_autograd and full.is_floating_point()
    args, kwargs = tree_map(_clone, sample.args), tree_map(_clone, sample.kwargs)
    ref_x = full.clone().requires_grad_(grad)
    try:
        ref = op(ref_x, *args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return f"skip: the op on full tensors fails ({type(e).__name__})"
    ref_outs, _ = tree_flatten(ref)

    def replicated(a):
        if not isinstance(a, torch.Tensor) or isinstance(a, DTensor) or a.layout != torch.strided:
            return a
        d = distribute_tensor(a.detach(), mesh, [Replicate()])
        return d.requires_grad_() if a.requires_grad else d

    stage = ""  # where a refusal or crash happened: the forward (""), gathering the outputs, or the backward
    try:
        leaf = distribute_tensor(full.clone(), mesh, [Shard(dim)]).requires_grad_(grad)
        a, kw = tree_map(replicated, tree_map(_clone, sample.args)), tree_map(replicated, tree_map(_clone, sample.kwargs))
        with _Collectives() as comm:  # the collectives DTensor adds in the forward (redistributions)
            got = op(leaf, *a, **kw)
        counts = comm.counts
        exact = "exact" + (": forward " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) if counts else "")
        got_outs, _ = tree_flatten(got)
        if len(got_outs) != len(ref_outs):
            return f"wrong: {len(got_outs)} outputs, {len(ref_outs)} on one process"
        fulls, stage = [], "in full_tensor: "
        for i, (g, r) in enumerate(zip(got_outs, ref_outs)):
            if isinstance(g, DTensor):
                g = g.full_tensor()
            fulls.append(g)
            if isinstance(r, torch.Tensor):
                if not isinstance(g, torch.Tensor):
                    return f"wrong: output {i} is a {type(g).__name__}"
                if g.dtype != r.dtype:
                    return f"wrong: output {i} is {g.dtype}, {r.dtype} on one process"
                _close(g, r.detach(), f"output {i}")
            elif isinstance(g, torch.Tensor):
                return f"wrong: output {i} is a tensor, a {type(r).__name__} on one process"
            elif g != r and not (g != g and r != r):
                return f"wrong: output {i} is {g!r}, {r!r} on one process"
        wanted = [(f, r) for f, r in zip(fulls, ref_outs) if isinstance(r, torch.Tensor) and r.requires_grad
                  and (r.is_floating_point() or r.is_complex())]
        if grad and wanted:
            gen = torch.Generator().manual_seed(seed)
            cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(r.dtype) for _, r in wanted]
            try:
                torch.autograd.backward([r for _, r in wanted], cots, inputs=[ref_x])
            except Exception:  # noqa: BLE001 - torch refuses this cotangent on one process: no gradient to compare
                return exact
            ref_g = ref_x.grad
            stage = "in backward: "
            mine = [(f, c) for (f, _), c in zip(wanted, cots) if f.requires_grad]
            if mine:
                torch.autograd.backward([f for f, _ in mine], [c for _, c in mine], inputs=[leaf])
            if leaf.grad is None:
                if ref_g is not None and ref_g.any():
                    return "wrong: no gradient reached the sharded input"
            else:
                g = leaf.grad.full_tensor() if isinstance(leaf.grad, DTensor) else leaf.grad
                _close(g, ref_g if ref_g is not None else torch.zeros_like(full), "input gradient")
        return exact
    except _Wrong as e:
        return f"wrong: {e}"
    except Exception as e:  # noqa: BLE001 - a refusal by DTensor, or any other error: a crash, named
        kind = "refused" if _refusal(e) else "crash"
        cause = f" (from {type(e.__cause__).__name__})" if e.__cause__ is not None and type(
            e.__cause__) is not type(e) else ""
        return f"{kind}: {stage}{type(e).__name__}{cause}: {_line(e)}"
