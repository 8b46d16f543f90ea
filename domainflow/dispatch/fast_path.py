"""The fast path: a Python-level call on ShardTensors outside autograd that needs no communication runs
straight on the local chunks, with its output layout taken from one cache keyed on (function, argument
schema: static arguments by value, tensors by layout, shape and dtype): ``toolkit.PLANS``, the one bounded
memo the handlers keep their layout plans in too.

An entry is learnt, never written by hand: the first call with a key runs the full engine under a
:class:`~domainflow.dispatch.toolkit.Trace`; only when every step it took declared itself local-exact
(``toolkit.local_exact``), nothing communicated and the result is one new ShardTensor, no view of an
input, is its layout cached. Functions written in Python take it only where a handler of ours answers
for them (see :func:`learn`). Later calls skip both ``__torch_dispatch__`` and the handlers (about half of DTensor's per-op
overhead, ``benchmarks/dispatch_overhead.py``); calls that need gradients always take the full engine,
whose autograd rules they need.
"""

from __future__ import annotations

import types

import torch

from domainflow.comm.base import stats as _comm_stats
from domainflow.dispatch import toolkit as _toolkit
from domainflow.dispatch.registry import REGISTRY as _REGISTRY
from domainflow.tensor.shard_tensor import ShardTensor, global_strides_like

_plans = _toolkit.PLANS  # key (starting with the function) -> _Plan, or None: the call takes the engine
_never: set = set()  # functions whose result is no tensor (getters, .item(), .dim()): never looked up
_SCALARS = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.memory_format,
                      torch.layout})
_no_subclass_functions = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_UNSEEN = object()
_PYTHON_FUNCTION = types.FunctionType
_PARAMETER = torch.nn.Parameter
_Tensor = torch.Tensor
_wrapper = torch.Tensor._make_wrapper_subclass


class _Plan:
    """What a learnt call gives: the result's layout, its local shape, and the local strides of a
    non-contiguous result with the global strides they give the ShardTensor."""

    __slots__ = ("spec", "shape", "device", "local_strides", "global_strides")

    def __init__(self, spec, local):
        self.spec = spec
        self.shape = local.shape
        self.device = local.device  # the inputs' (their layouts name the mesh, so the device type)
        self.local_strides = local.stride()
        self.global_strides = global_strides_like(local, spec.shape)


def clear() -> None:
    """Forget every learnt entry and layout plan (a handler or rule was registered: what was exact may
    not be)."""
    _plans.clear()
    _never.clear()


_engine = None  # the full engine: engine(func, types, args, kwargs) (installed by the engine, see install)


def install(engine) -> None:
    """Name the full engine that calls the fast path cannot take go to."""
    global _engine
    _engine = engine


def method_function(cls, func, types, args=(), kwargs=None):
    """``ShardTensor.__torch_function__``: the fast path where it applies, else the full engine. It
    declines a call that needs gradients, runs under a dispatch mode, has an argument that is neither a
    tensor nor a plain value, writes into ``out=``, has a parameter not yet recorded for the replica check
    (the engine records it), or was learnt not local-exact; an unseen call is learnt (:func:`learn`).
    Written for speed: it runs on every Python-level call on a ShardTensor (one loop builds the key and
    the local arguments)."""
    if func in _never or _dispatch_modes():
        return _engine(func, types, args, kwargs)
    grad = _grad_enabled()
    if grad and _needs_grad(args, kwargs):
        return _engine(func, types, args, kwargs)
    parts = [func]
    local_args = []
    sharded = unrecorded = False
    for a in args:
        t = type(a)
        if t is ShardTensor:
            local = a._local
            parts.append(a._spec)
            parts.append(local.dtype)
            local_args.append(local)
            sharded = True
        elif t in _SCALARS:
            parts.append(t)
            parts.append(a)
            local_args.append(a)
        elif t is _Tensor and not (grad and a.requires_grad):  # a plain operand (weights): inline, it is common
            parts.append(a.shape)
            parts.append(a.dtype)
            local_args.append(a)
        else:
            k = _other_key(a, t, grad, parts)
            if not k:
                return _engine(func, types, args, kwargs)
            unrecorded = unrecorded or k is _UNRECORDED
            local_args.append(a)
    local_kwargs = None
    if kwargs:
        if "out" in kwargs:
            return _engine(func, types, args, kwargs)
        local_kwargs = {}
        for name, a in kwargs.items():
            parts.append(name)
            t = type(a)
            if t is ShardTensor:
                local = a._local
                parts.append(a._spec)
                parts.append(local.dtype)
                local_kwargs[name] = local
                sharded = True
            elif t in _SCALARS:
                parts.append(t)
                parts.append(a)
                local_kwargs[name] = a
            else:
                k = _other_key(a, t, grad, parts)
                if not k:
                    return _engine(func, types, args, kwargs)
                unrecorded = unrecorded or k is _UNRECORDED
                local_kwargs[name] = a
    if not sharded:
        return _engine(func, types, args, kwargs)
    key = tuple(parts)
    plan = _plans.recent.get(key, _UNSEEN)
    if plan is _UNSEEN:
        plan = _plans.get(key, _UNSEEN)
        if plan is _UNSEEN:
            return learn(key, func, args, kwargs, lambda: _engine(func, types, args, kwargs))
    if plan is None or unrecorded:
        return _engine(func, types, args, kwargs)
    out = func(*local_args, **local_kwargs) if local_kwargs else func(*local_args)
    if type(out) is not _Tensor or out.shape != plan.shape:
        return _engine(func, types, args, kwargs)  # cannot happen for a key learnt right
    spec = plan.spec
    # ShardTensor.from_spec(out, spec), inline (checked above: the shape the key was learnt with; outside autograd);
    # a non-contiguous result (a transpose) takes the global strides learnt with the local strides they follow from
    if out.is_contiguous():
        r = _wrapper(ShardTensor, spec.shape, dtype=out.dtype, device=plan.device)
    elif out.stride() == plan.local_strides:
        r = _wrapper(ShardTensor, spec.shape, strides=plan.global_strides, dtype=out.dtype, device=plan.device)
    else:
        return ShardTensor.from_spec(out, spec)
    r._local = out
    r._spec = spec
    return r



_UNRECORDED = 2  # truthy: the key is fine, but the call must take the engine


def _needs_grad(args, kwargs) -> bool:
    """Whether a ShardTensor argument requires grad (its flag read without entering __torch_function__)."""
    with _no_subclass_functions():
        for a in args:
            if type(a) is ShardTensor and a.requires_grad:
                return True
        if kwargs:
            for a in kwargs.values():
                if type(a) is ShardTensor and a.requires_grad:
                    return True
    return False


def _other_key(a, t, grad: bool, parts: list):
    """Key part of an argument that is neither a ShardTensor nor a plain value; False: no fast path."""
    if isinstance(a, _Tensor):
        if grad and a.requires_grad:
            return False
        parts.append(a.shape)  # not its device: one that does not fit the chunks' fails as in the engine
        parts.append(a.dtype)
        if t is _PARAMETER and not getattr(a, "_domainflow_recorded", False):
            return _UNRECORDED  # the engine must record it for the cross-rank replica check
        return True
    if t is tuple or t is list or t is torch.Size:
        parts.append(t)
        for x in a:
            if type(x) not in _SCALARS:
                return False
            parts.append(x)
        parts.append(len(a))
        return True
    return False


def learn(key, func, args, kwargs, call):
    """Run ``call()`` (the full engine) under a trace and cache what it teaches about ``key``."""
    tracing = _toolkit.tracing
    if tracing.trace is not None:  # a call inside one being learnt: its steps count there
        return call()
    if type(func) is _PYTHON_FUNCTION and func not in _REGISTRY.functions:
        # torch's Python code between the aten steps may read the global size and make scalars of it
        # (F.kl_div's batchmean divides by input.size(0)): the trace cannot see that, so such a function
        # takes the engine unless a handler of its own answers for it
        _never.add(func)
        return call()
    trace = tracing.trace = _toolkit.Trace()
    sent = sum(_comm_stats.calls.values())
    try:
        out = call()
    finally:
        tracing.trace = None
    if not isinstance(out, torch.Tensor):
        if not (isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)):
            _never.add(func)  # sizes, numbers, None: a function that returns no tensor at all
        plan = None
    elif type(out) is ShardTensor and _aliases_input(out, args, kwargs):
        # in place, or a view (transpose, unsqueeze): autograd links a view to its base (version counter,
        # in-place ops through the view) only when the op passes through torch's dispatcher
        _never.add(func)
        plan = None
    elif (type(out) is ShardTensor and trace.steps and trace.exact == trace.steps
          and sum(_comm_stats.calls.values()) == sent):
        plan = _Plan(out._spec, out._local)
    else:
        plan = None
    _plans.put(key, plan)  # threads may learn at once: the memo's steps are atomic
    return out


def _aliases_input(out, args, kwargs) -> bool:
    """The result is one of the inputs (an in-place op, ``requires_grad_``), an autograd view (torch made
    it one, on every rank alike, also where the chunk is empty) or shares an input's memory: never cached."""
    values = list(args) + (list(kwargs.values()) if kwargs else [])
    if any(out is a for a in values):
        return True
    with _no_subclass_functions():
        if out._is_view():
            return True
    storage = out._local.untyped_storage()
    if not storage.nbytes():
        return False  # an empty chunk shares no memory
    ptr = storage.data_ptr()
    for a in values:
        if isinstance(a, torch.Tensor):
            local = a._local if type(a) is ShardTensor else a
            if local.untyped_storage().data_ptr() == ptr:
                return True
    return False
