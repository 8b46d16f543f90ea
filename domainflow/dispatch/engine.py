"""The dispatch engine: how an op on ShardTensors is routed. It only picks and runs what the registry holds.

``__torch_function__`` (above autograd) first tries the fast path (``fast_path.py``: learnt local calls
outside autograd), then routes registered Python-level functions (handlers that need their own autograd
node, e.g. reductions whose gradient must stay sharded). ``__torch_dispatch__`` (below autograd) applies
these rules in order, chosen once per op and cached:
1. a registered aten handler (``ops/`` registers the built-in ones);
2. the pointwise rule (``ops/pointwise.py`` registers it) for elementwise ops (``elementwise.py``: tagged
   pointwise by torch, or decomposed by torch into pointwise ops only): arithmetic output layouts, one plan
   cached per input layout;
3. an op torch composes of others, reaching us whole (``torch.inference_mode()``): its
   decomposition;
4. local execution when every ShardTensor input is replicated;
5. torch's decomposition of the op (``torch._decomp``), whose ops come back through the engine;
6. ``UnsupportedShardedOp``, unless ``fallback("gather")`` is active.
In-place and ``out=`` ops check their destination first: a plain one among ShardTensor operands is written
whole when none of them is sharded (exact) and refused by name when one is (``toolkit.into_plain``), never
gathered onto every rank in silence; function handlers given a plain ``out=`` follow the same rule.
Plain tensors that need gradients (``nn.Parameter``s) count as replicated; the first time one meets a
ShardTensor it gets a gradient hook that reduces its summed (often Partial) gradient to a plain tensor,
so partial gradients are summed over the domain exactly once per backward. Parameters passed to a Python
call with a ShardTensor are recorded for the cross-rank replica check (``domainflow.tensor.consistency``).
"""

from __future__ import annotations

import torch

from domainflow.dispatch import fast_path as _fast
from domainflow.dispatch.elementwise import is_elementwise_call, is_tagged_elementwise, may_be_elementwise
from domainflow.dispatch.registry import REGISTRY
from domainflow.dispatch.toolkit import hook_plain_grads, run_replicated, shard_tensors, tracing as _tracing
from domainflow.dispatch.toolkit import into_plain, is_sharded, op_name, plain_destination_error
from domainflow.dispatch.toolkit import (COPIED_VIEWS, mark_copied_view, refuse_write_into_copied_view,
                                        unsupported_or_fallback)
from domainflow.comm.base import refuse_unchecked_compile as _refuse_unchecked_compile
from domainflow.errors import CompileUnsupportedError, UnsupportedShardedOp
from domainflow.tensor import consistency as _consistency
from domainflow.tensor.shard_tensor import ShardTensor

_INPLACE = torch.Tag.inplace
_OUT = torch.Tag.out
# runs ``func`` with __torch_function__ disabled for subclasses (the C implementation torch uses)
_run_function = torch._C._disabled_torch_function_impl


# --------------------------------------------------------------------------------------------
# __torch_function__
# --------------------------------------------------------------------------------------------
def torch_function(func, types, args=(), kwargs=None):
    return method_function(None, func, types, args, kwargs)


def _engine_function(func, types, args, kwargs):
    """A Python-level call through the engine: its function handler, or torch's own code (whose aten ops
    come back through ``__torch_dispatch__``)."""
    # parameters meeting a ShardTensor are recorded for the replica check here, at the Python call the model
    # makes, which every rank makes alike (aten-level decompositions may differ between ranks with strides)
    # (not while torch.compile traces: its parameters are fake; domainflow.compile checks the real ones before
    # each call, and a trace not started by it is refused here)
    for a in args:
        if type(a) is _PARAMETER and not getattr(a, "_domainflow_recorded", False):
            _record_or_refuse(args, kwargs)
            break
    else:
        if kwargs:  # F.group_norm and friends pass weight and bias by keyword
            for a in kwargs.values():
                if type(a) is _PARAMETER and not getattr(a, "_domainflow_recorded", False):
                    _record_or_refuse(args, kwargs)
                    break
    handler = _functions.get(func)
    if handler is not None:
        if kwargs and kwargs.get("out") is not None and _plain_out(kwargs["out"]):
            # handlers compute a new result and would drop a plain out=: the rule of in-place ops instead
            return into_plain(func, args, kwargs, _first_tensor(kwargs["out"]), whole=ShardTensor.full_tensor,
                              name=f"{op_name(func)}(out=)")
        trace = _tracing.trace
        if trace is not None:
            return _traced_step(trace, _with_handler, handler, func, args, kwargs or {})
        try:
            with _no_subclass_functions():  # like torch's default: nested calls skip __torch_function__
                return handler(func, args, kwargs or {})
        except CompileUnsupportedError as e:
            _name_refusal(e, func)
            raise
    try:
        return _run_function(func, types, args, kwargs if kwargs is not None else _NO_KWARGS)
    except CompileUnsupportedError as e:
        _name_refusal(e, func)
        raise


def _name_refusal(e: CompileUnsupportedError, func) -> None:
    """Re-raise a refusal under torch.compile naming the op whose rule reached it (the innermost one)."""
    named = e.naming(op_name(func))
    if named is not e:
        raise named from e


def _plain_out(out) -> bool:
    """Whether ``out=`` is a plain tensor, or a tuple of them."""
    if type(out) in (tuple, list):
        return all(type(o) is not ShardTensor for o in out) and any(isinstance(o, torch.Tensor) for o in out)
    return type(out) is not ShardTensor and isinstance(out, torch.Tensor)


def _first_tensor(out):
    return next(o for o in out if isinstance(o, torch.Tensor)) if type(out) in (tuple, list) else out


def _with_handler(handler, func, args, kwargs):
    with _no_subclass_functions():
        return handler(func, args, kwargs)


def _traced_step(trace, run, route, func, args, kwargs):
    """One step of a call the fast path learns: counted, and local-exact if its own handler said so (a
    nested step's declaration counts for that step alone)."""
    outer = trace.marked
    trace.marked = False
    trace.steps += 1
    try:
        out = run(route, func, args, kwargs)
        if trace.marked:
            trace.exact += 1
    finally:
        trace.marked = outer
    return out


_PARAMETER = torch.nn.Parameter
_compiling = torch.compiler.is_compiling
# ShardTensor.__torch_function__ (installed by shard_tensor.install_engine): the fast path, else the engine
_fast.install(_engine_function)
method_function = _fast.method_function


def _record_or_refuse(args, kwargs) -> None:
    if _compiling():
        _refuse_unchecked_compile("a parameter meeting a ShardTensor")
    else:
        _record_parameters(args, kwargs)


def _record_parameters(args, kwargs) -> None:
    mesh = _first_mesh(args) or _first_mesh(tuple((kwargs or {}).values()))
    if mesh is not None:
        for a in list(args) + list((kwargs or {}).values()):
            if type(a) is _PARAMETER:
                _consistency.record_parameter(a, mesh)


_NO_KWARGS: dict = {}
_no_subclass_functions = torch._C.DisableTorchFunctionSubclass


_functions = REGISTRY.functions


def _first_mesh(args):
    for a in args:
        if type(a) is ShardTensor:
            return a._spec.mesh
        if type(a) in (list, tuple):
            for x in a:
                if type(x) is ShardTensor:
                    return x._spec.mesh
    return None


# --------------------------------------------------------------------------------------------
# __torch_dispatch__
# --------------------------------------------------------------------------------------------
def torch_dispatch(func, types, args=(), kwargs=None):
    return method_dispatch(None, func, types, args, kwargs)


def method_dispatch(cls, func, types, args=(), kwargs=None):
    """``ShardTensor.__torch_dispatch__``: the op's cached route."""
    route = _routes.get(func)
    if route is None:
        route = _route(func)
    if route is not _pointwise_rule:
        hook_plain_grads(args)  # the pointwise rule does this while it scans its arguments
    trace = _tracing.trace
    if trace is not None:
        return _traced_step(trace, _call_route, route, func, args, kwargs or {})
    try:
        return route(func, args, kwargs or {})
    except CompileUnsupportedError as e:
        _name_refusal(e, func)
        raise


def _call_route(route, func, args, kwargs):
    return route(func, args, kwargs)


_routes: dict = {}


def _route(func):
    """Pick (once per op) how it runs: a registered handler, the pointwise rule, or the generic path."""
    handler = REGISTRY.aten.get(func)
    if handler is not None:
        route = handler
    elif _OUT not in func.tags and (is_tagged_elementwise(func) or _in_place_form(func, is_tagged_elementwise)):
        route = REGISTRY.pointwise or _generic
    elif torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        route = _decomposed
    elif _OUT not in func.tags and (may_be_elementwise(func) or _in_place_form(func, may_be_elementwise)):
        route = _elementwise_if_it_says_so
    else:
        route = _generic
    if (_INPLACE in func.tags or _OUT in func.tags) and route is not REGISTRY.pointwise:
        route = _guard_destinations(route, func)  # the pointwise rule checks a plain self in its cached plan
    if _INPLACE in func.tags and route is not REGISTRY.pointwise:  # (the pointwise rule checks in its plan)
        route = _not_into_copied_views(route)
    if getattr(func, "is_view", False):
        route = _views_of_copies_are_copies(route)
    _routes[func] = route
    return route


def _guard_destinations(route, func):
    """``route`` for an in-place or ``out=`` op, first checking that what it writes into is no plain tensor
    while ShardTensors are among the operands (``toolkit.into_plain``: exact when they are not sharded,
    else refused by name, never a silent gather). A ShardTensor ``self`` costs one type test."""
    writes = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write)
    if not writes:
        return route

    def destinations(args, kwargs):
        for i, name, kwarg_only in writes:
            if not kwarg_only and i < len(args):
                yield args[i]
            elif kwargs.get(name) is not None:
                yield kwargs[name]

    def checked(func, args, kwargs):
        dests = list(destinations(args, kwargs))
        lists = [d for d in dests if type(d) in (list, tuple)]
        if lists:  # foreach: per index
            out = _plain_list_destinations(func, args, kwargs, lists)
            return route(func, args, kwargs) if out is _ROUTE else out
        plain = [d for d in dests if type(d) is not ShardTensor and isinstance(d, torch.Tensor)]
        if not plain:
            return route(func, args, kwargs)
        if len(plain) == len(dests):
            return into_plain(func, args, kwargs, plain[0])
        if any(is_sharded(s) for s in shard_tensors(args, kwargs)):  # some outputs plain, others ShardTensors
            raise plain_destination_error(func, next(s for s in shard_tensors(args, kwargs) if is_sharded(s)),
                                          plain[0])
        return route(func, args, kwargs)

    if writes[0][:2] == (0, "self") and len(writes) == 1:
        def guarded(func, args, kwargs):
            a0 = args[0]
            if type(a0) is ShardTensor:
                return route(func, args, kwargs)
            if type(a0) is list:  # foreach: a list of ShardTensors is the common case
                for t in a0:
                    if type(t) is not ShardTensor:
                        break
                else:
                    return route(func, args, kwargs)
            return checked(func, args, kwargs)
        return guarded
    return checked


_ROUTE = object()


def _not_into_copied_views(route):
    """``route`` for an in-place op, first refusing a ``self`` that stands for a view but holds a copy."""
    def checked(func, args, kwargs):
        if COPIED_VIEWS and args:
            refuse_write_into_copied_view(func, args[0])
        return route(func, args, kwargs)
    return checked


def _views_of_copies_are_copies(route):
    """``route`` for a view op: a view of a ShardTensor that holds a copy (``x.conj()``) is a copy too, so a
    write through it (``x.conj()[0].fill_(1)``) is refused as a write into the first would be."""
    def viewed(func, args, kwargs):
        out = route(func, args, kwargs)
        if COPIED_VIEWS and args and COPIED_VIEWS.get(id(args[0])) is args[0]:
            mark_copied_view(out)
        return out
    return viewed


def _plain_list_destinations(func, args, kwargs, lists):
    """A foreach op writing into lists: every destination plain -> ``into_plain``; a plain one at an index
    where another list holds a sharded tensor -> refused by name; else ``_ROUTE`` (the route handles it)."""
    if all(type(t) is ShardTensor for d in lists for t in d):
        return _ROUTE
    if not any(type(t) is ShardTensor for d in lists for t in d):
        return into_plain(func, args, kwargs, next(t for d in lists for t in d if t is not None))
    others = [a for a in args if type(a) in (list, tuple) and not any(a is d for d in lists)]
    for d in lists:
        for j, t in enumerate(d):
            if type(t) is not ShardTensor and isinstance(t, torch.Tensor):
                src = next((o[j] for o in others if j < len(o) and is_sharded(o[j])), None)
                if src is not None:
                    raise plain_destination_error(func, src, t)
    return _ROUTE


def _decomposed(func, args, kwargs):
    """An op torch writes in other ops (CompositeImplicitAutograd: softmax.int, linear, matmul, layer_norm)
    that reaches us whole, as under ``torch.inference_mode()``, where autograd does not decompose it: run
    its decomposition, whose ops come back through the engine (DTensor does the same)."""
    out = func.decompose(*args, **kwargs)
    return _generic(func, args, kwargs) if out is NotImplemented else out


def _out_of_place(func):
    """``masked_fill`` for ``masked_fill_`` (same overload); None for an op that is not an in-place form."""
    name = func._schema.name.split("::")[-1]
    if not name.endswith("_") or _INPLACE not in func.tags and not func._schema.is_mutable:
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, func._overloadname, None) if packet is not None else None


def _in_place_form(func, test) -> bool:
    """``masked_fill_`` and friends: in-place ops whose out-of-place form passes ``test``."""
    base = _out_of_place(func)
    return base is not None and test(base)


def _elementwise_if_it_says_so(func, args, kwargs):
    """An op torch does not tag pointwise but decomposes (or builds on TensorIterator): the pointwise rule when
    this call is elementwise (``elementwise.is_elementwise_call``, decided once per kind of arguments), else
    the generic path."""
    if is_elementwise_call(_out_of_place(func) or func, args, kwargs):
        return REGISTRY.pointwise(func, args, kwargs)
    return _generic(func, args, kwargs)


def clear_routes() -> None:
    """Forget cached routes (the registry calls it when a handler or the pointwise rule is registered)."""
    global _pointwise_rule
    _routes.clear()
    _fast.clear()
    _pointwise_rule = REGISTRY.pointwise


_pointwise_rule = None


REGISTRY.on_change(clear_routes)


def _generic(func, args, kwargs):
    """No handler: local when every ShardTensor operand is replicated; else torch's own decomposition of the op
    (``torch._decomp``: ``addmv`` into a matmul and an add, ``linalg_cross`` into indexing and products, ``glu``
    into a split and a sigmoid), whose ops come back through the engine, as DTensor does; else refused by name
    (or gathered, under ``fallback("gather")``)."""
    sts = shard_tensors(args, kwargs)
    if all(s._spec.is_replicated for s in sts):
        return run_replicated(func, args, kwargs, sts)
    decomposition = _decomposition(func)
    if decomposition is not None:
        try:
            out = decomposition(*args, **kwargs)
        except UnsupportedShardedOp as e:  # raised on every rank alike: its ops decide from layouts
            reason = (f"it has no rule of its own, and torch's decomposition of it reaches an op without one "
                      f"({str(e).splitlines()[0].removeprefix('domainflow has no sharding rule for ').rstrip('.')})")
            return unsupported_or_fallback(func, args, kwargs, reason)
        if out is not NotImplemented:
            return out
    return unsupported_or_fallback(func, args, kwargs, "it is not pointwise and has no registered handler")


def _decomposition(func):
    """torch's decomposition of an op that computes a new result (in-place and ``out=`` forms write into their
    operands: those keep their own rules), or None."""
    if _INPLACE in func.tags or _OUT in func.tags or func._schema.is_mutable:
        return None
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)
