"""``domainflow.compile``: ``torch.compile`` for domain-parallel models, with eager's cross-rank checks.

A compiled graph runs its collectives as functional collectives (``comm.traced``): no pairing round, and no
pending cross-rank check (``tensor.consistency``) runs inside it. Eager mode checks there what each rank
declares alone: layouts given per rank (``from_local(..., sharding_shapes=mapping)``) and replicated
parameters (each recorded the first time it meets a ShardTensor). Under ``torch.compile`` the engine only
sees fake parameters, so neither would be checked and a wrong one gives a silently wrong result, or a
functional all-to-all with mismatched sizes. :func:`compile` returns a callable that, before every call and
outside any graph:

1. records the module's plain parameters and buffers not checked yet (each once, like eager; the mesh is the
   first ShardTensor argument's), and
2. runs every pending cross-rank check (one small all-reduce per mesh dim, only when something is pending):
   a disagreement raises ``ShardingShapeError`` / ``ReplicaMismatchError`` on every rank, before any traced
   collective runs,

then calls ``torch.compile(model, **kwargs)``'s result with ``comm.base.checked_compile`` set, which Dynamo
and AOTAutograd (tracing, and re-tracing on a recompile, inside that call in this thread) see: a trace of
ShardTensors, traced collectives or parameters meeting a ShardTensor without it is refused
(``comm.refuse_unchecked_compile``).
"""

from __future__ import annotations

import torch

from domainflow import comm
from domainflow.comm import base as _base
from domainflow.tensor import consistency as _consistency
from domainflow.tensor.shard_tensor import ShardTensor

_PARAMETER = torch.nn.Parameter
_TENSOR = torch.Tensor


def compile(model_or_fn, **torch_compile_kwargs):  # noqa: A001 (domainflow.compile, like torch.compile)
    """``torch.compile(model_or_fn, **torch_compile_kwargs)`` for models on ShardTensors: the returned callable
    checks, eagerly before every call, that the ranks agree on the layouts they declared alone and on the
    module's replicated parameters and buffers (each checked once, the first call it meets a ShardTensor
    argument), then runs the compiled function. ``model_or_fn``: an ``nn.Module``, a bound method of one, or a
    function (the modules it closes over, names as globals or takes as arguments are checked; parameters it
    reaches otherwise, e.g. through a helper's globals, are not). Attributes of the compiled module are reachable
    on the result (``.parameters()``, ``.train()``).
    """
    # its own cache of graphs (torch.compile shares one per code object by default): a raw torch.compile of the
    # same model must not find, and run unchecked, a graph compiled here
    torch_compile_kwargs["isolate_recompiles"] = True
    return CheckedCompile(model_or_fn, torch.compile(model_or_fn, **torch_compile_kwargs))


class CheckedCompile:
    """What :func:`compile` returns: the compiled callable, called after the cross-rank checks."""

    def __init__(self, original, compiled):
        self._original = original
        self._compiled = compiled
        owner = original if isinstance(original, torch.nn.Module) else getattr(original, "__self__", None)
        self._module = owner if isinstance(owner, torch.nn.Module) else None
        self.__wrapped__ = original

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._compiled, name)

    def __call__(self, *args, **kwargs):
        mesh = _first_mesh(args) or _first_mesh(tuple(kwargs.values()))
        if mesh is not None:
            for m in _modules_reached(self._original, args, kwargs):
                _record_module(m, mesh)
        if comm.pending_checks:
            _consistency.flush("a call compiled by domainflow.compile")
        state = _base.checked_compile
        outer = getattr(state, "on", False)
        state.on = True
        try:
            return self._compiled(*args, **kwargs)
        finally:
            state.on = outer


def _modules_reached(fn, args, kwargs) -> list:
    """The modules whose parameters a call of ``fn`` uses, as far as can be seen without tracing: ``fn`` itself,
    the owner of a bound method (or the modules among its attributes), the modules a function closes over or
    names as globals, and nn.Module arguments. (While tracing, the engine sees only fake parameters.)"""
    Module = torch.nn.Module
    if isinstance(fn, Module):
        seen = [fn]
    else:
        seen = []
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, Module):
            seen.append(owner)
        elif owner is not None and hasattr(owner, "__dict__"):
            seen += [v for v in vars(owner).values() if isinstance(v, Module)]
        code = getattr(fn, "__code__", None)
        if code is not None:
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(v, Module):
                    seen.append(v)
            names = getattr(fn, "__globals__", {})
            seen += [names[n] for n in code.co_names if isinstance(names.get(n), Module)]
    seen += [a for a in (*args, *kwargs.values()) if isinstance(a, Module)]
    return seen


def _record_module(module: torch.nn.Module, mesh) -> None:
    """Record the plain parameters and buffers of ``module`` not checked yet (no communication)."""
    for p in module.parameters():
        if type(p) is _PARAMETER and not getattr(p, "_domainflow_recorded", False):
            _consistency.record_parameter(p, mesh)
    for b in module.buffers():
        if type(b) is _TENSOR and not getattr(b, "_domainflow_recorded", False):
            _consistency.record_parameter(b, mesh)


def _first_mesh(args):
    for a in args:
        if type(a) is ShardTensor:
            return a._spec.mesh
        if type(a) in (list, tuple):
            m = _first_mesh(a)
            if m is not None:
                return m
        elif type(a) is dict:
            m = _first_mesh(tuple(a.values()))
            if m is not None:
                return m
    return None
