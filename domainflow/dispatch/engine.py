"""The dispatch engine: how an op on ShardTensors runs.

``__torch_function__`` (above autograd) routes registered Python-level functions (handlers that need
their own autograd node, e.g. reductions whose gradient must stay sharded). ``__torch_dispatch__``
(below autograd) applies DESIGN.md's rules in order:
1. a registered handler (ops/ registers the built-in ones);
2. local execution for ops that do not touch a sharded dim: pointwise ops (with arithmetic
   output layouts, cached per input layout) and any op whose ShardTensor inputs are all replicated;
3. ``UnsupportedShardedOp``, unless ``fallback("gather")`` is active.
Plain tensors that need gradients (``nn.Parameter``s) count as replicated; the first time one meets a
ShardTensor it gets a gradient hook that reduces its summed (often Partial) gradient to a plain tensor,
so partial gradients are summed over the domain exactly once per backward.
"""

from __future__ import annotations

import torch

from domainflow.tensor import consistency as _consistency
from domainflow.dispatch.fallback import fallback as _fallback_mode
from domainflow.dispatch.fallback import warn_once as _warn_fallback
from domainflow.errors import ShardingMismatchError, UnsupportedShardedOp
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.tensor.redistribute import redistribute_local
from domainflow.dispatch.registry import REGISTRY
from domainflow.tensor.shard_tensor import ShardTensor, target_spec
from domainflow.layout.spec import ShardSpec

_POINTWISE = torch.Tag.pointwise
_INPLACE = torch.Tag.inplace
_OUT = torch.Tag.out
_R = Replicate()


# --------------------------------------------------------------------------------------------
# argument helpers (parse once, in one place)
# --------------------------------------------------------------------------------------------
def shard_tensors(args, kwargs=None) -> list[ShardTensor]:
    """ShardTensors among ``args`` (one level of lists included) and ``kwargs`` values."""
    out = []
    for a in args:
        if isinstance(a, ShardTensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, ShardTensor))
    if kwargs:
        out.extend(v for v in kwargs.values() if isinstance(v, ShardTensor))
    return out


def common_mesh(sts, op):
    mesh = sts[0]._spec.mesh
    for s in sts[1:]:
        if s._spec.mesh is not mesh and s._spec.mesh != mesh:
            raise ShardingMismatchError(f"{op}: operands live on different device meshes "
                                        f"({tuple(mesh.shape)} and {tuple(s._spec.mesh.shape)}); redistribute onto one mesh")
    return mesh


def wrap(out, spec_or_fn):
    """Wrap local results; ``spec_or_fn`` is a spec or a function from a local tensor to its spec."""
    if isinstance(out, torch.Tensor):
        spec = spec_or_fn(out) if callable(spec_or_fn) else spec_or_fn
        return ShardTensor(out, spec)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap(o, spec_or_fn) for o in out)
    return out


def replicated_spec(mesh, shape) -> ShardSpec:
    return ShardSpec(mesh, (_R,) * mesh.ndim, shape, (None,) * mesh.ndim)


def to_spec(x: ShardTensor, dst: ShardSpec) -> torch.Tensor:
    """Local chunk of ``x`` under layout ``dst`` (no autograd: we are below it here)."""
    return x._local if x._spec == dst else redistribute_local(x._local, x._spec, dst)


def local_as(t, spec: ShardSpec) -> torch.Tensor | None:
    """This rank's chunk of ``t`` laid out like ``spec`` (same placements and sizes; ``t`` may differ in
    shape along unsharded dims). ``t`` is a ShardTensor (redistributed if needed), a plain tensor
    holding the full value (sliced along the sharded dims where it has the full extent, else used
    as it is, e.g. broadcast), or None."""
    if t is None:
        return None
    if isinstance(t, ShardTensor):
        return to_spec(t, spec if t.shape == spec.shape else spec.with_(shape=t.shape))
    coord = spec.coord
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and t.ndim == spec.ndim and t.shape[p.dim] == spec.shape[p.dim]:
            k = coord[m]
            t = t.narrow(p.dim, sum(spec.sizes[m][:k]), spec.sizes[m][k])
    return t


def replicate_local(x: ShardTensor) -> torch.Tensor:
    """The full tensor on this rank (gathers / reduces as needed)."""
    s = x._spec
    if s.is_replicated:
        return x._local
    return redistribute_local(x._local, s, replicated_spec(s.mesh, s.shape))


def _unsupported_or_fallback(func, args, kwargs, reason: str):
    if _fallback_mode.current() == "gather":
        return gather_fallback(func, args, kwargs, reason)
    raise UnsupportedShardedOp(func, f"{reason} (operands: {describe_sharding(shard_tensors(args, kwargs))})")


def describe_sharding(sts) -> str:
    parts = []
    for s in sts:
        sp = s._spec
        dims = [f"dim {p.dim} over mesh dim {m} in sizes {list(sp.sizes[m])}" for m, p in enumerate(sp.placements)
                if isinstance(p, Shard)]
        parts.append(f"shape {tuple(sp.shape)} sharded on " + (", ".join(dims) if dims else "no dim")
                     + (" (Partial)" if sp.has_partial else ""))
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# __torch_function__
# --------------------------------------------------------------------------------------------
def torch_function(func, types, args=(), kwargs=None):
    # parameters meeting a ShardTensor are recorded for the replica check here, at the Python call the model
    # makes, which every rank makes alike (aten-level decompositions may differ between ranks with strides)
    for a in args:
        if type(a) is _PARAMETER and not getattr(a, "_domainflow_recorded", False):
            _record_parameters(args, kwargs)
            break
    else:
        if kwargs:  # F.group_norm and friends pass weight and bias by keyword
            for a in kwargs.values():
                if type(a) is _PARAMETER and not getattr(a, "_domainflow_recorded", False):
                    _record_parameters(args, kwargs)
                    break
    handler = _functions.get(func)
    if handler is not None:
        with _no_subclass_functions():  # like torch's default: nested calls skip __torch_function__
            return handler(func, args, kwargs or {})
    return _run_function(func, types, args, kwargs if kwargs is not None else _NO_KWARGS)


_PARAMETER = torch.nn.Parameter


def _record_parameters(args, kwargs) -> None:
    mesh = _first_mesh(args) or _first_mesh(tuple((kwargs or {}).values()))
    if mesh is not None:
        for a in list(args) + list((kwargs or {}).values()):
            if type(a) is _PARAMETER:
                _consistency.record_parameter(a, mesh)


_NO_KWARGS: dict = {}
_no_subclass_functions = torch._C.DisableTorchFunctionSubclass
# runs ``func`` with __torch_function__ disabled for subclasses (the C implementation torch uses)
_run_function = torch._C._disabled_torch_function_impl


def run_function_default(func, args, kwargs):
    """What a function handler calls to fall through to torch's own implementation."""
    return _run_function(func, (ShardTensor,), args, kwargs)


_functions = REGISTRY.functions
_ALIASES = {"input": "self", "axis": "dim", "keepdims": "keepdim"}


def bind(args, kwargs, names, **defaults) -> dict:
    """A torch function's positional and keyword arguments as one dict by parameter name (``input=``
    and numpy's ``axis=`` / ``keepdims=`` accepted), for function handlers."""
    out = dict(defaults)
    out.update(zip(names, args))
    for k, v in kwargs.items():
        out[_ALIASES.get(k, k)] = v
    return out


def _reduce_grad_to_plain(grad):
    """Gradient hook of a plain tensor (e.g. an nn.Parameter) used with ShardTensors: the summed
    gradient arrives as a ShardTensor (often Partial); reduce it to a plain tensor, exactly once."""
    if isinstance(grad, ShardTensor):
        return replicate_local(grad)
    return grad


def hook_plain_grads(args):
    """Give plain tensors that need gradients the reduce-to-plain hook (once per tensor)."""
    for a in args:
        if type(a) is ShardTensor:
            continue
        if isinstance(a, torch.Tensor):
            if a.requires_grad and not getattr(a, "_domainflow_hooked", False):
                a.register_hook(_reduce_grad_to_plain)
                a._domainflow_hooked = True
        elif type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor):
            hook_plain_grads(a)


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
    route = _routes.get(func)
    if route is None:
        route = _route(func)
    if route is not pointwise:
        hook_plain_grads(args)  # pointwise() does this while it scans its arguments
    return route(func, args, kwargs or {})


_routes: dict = {}


def _route(func):
    """Pick (once per op) how it runs: a registered handler, the pointwise rule, or the generic path."""
    handler = REGISTRY.aten.get(func)
    if handler is not None:
        route = handler
    elif _OUT not in func.tags and (_POINTWISE in func.tags or _inplace_of_pointwise(func)):
        route = pointwise
    else:
        route = _generic
    _routes[func] = route
    return route


def _inplace_of_pointwise(func) -> bool:
    """``masked_fill_`` and friends: in-place ops whose out-of-place form is tagged pointwise."""
    name = func._schema.name.split("::")[-1]
    if not name.endswith("_") or _INPLACE not in func.tags and not func._schema.is_mutable:
        return False
    packet = getattr(torch.ops.aten, name[:-1], None)
    base = getattr(packet, func._overloadname, None) if packet is not None else None
    return base is not None and _POINTWISE in base.tags


def clear_routes() -> None:
    """Forget cached routes (the registry calls it when a handler is registered)."""
    _routes.clear()


REGISTRY.on_change(clear_routes)


def _generic(func, args, kwargs):
    sts = shard_tensors(args, kwargs)
    if all(s._spec.is_replicated for s in sts):
        return run_replicated(func, args, kwargs, sts)
    return _unsupported_or_fallback(func, args, kwargs, "it is not pointwise and has no registered handler")


def run_replicated(func, args, kwargs, sts):
    """All ShardTensor inputs replicated: compute locally; outputs replicated (no communication)."""
    mesh = common_mesh(sts, func)
    la, lk = _unwrap_all(args, kwargs)
    out = func(*la, **lk)
    if _INPLACE in func.tags and args and isinstance(args[0], ShardTensor):
        return args[0]
    return wrap(out, lambda t: replicated_spec(mesh, t.shape))


def _unwrap_all(args, kwargs):
    def u(a):
        if isinstance(a, ShardTensor):
            return a._local
        if isinstance(a, (list, tuple)) and any(isinstance(x, ShardTensor) for x in a):
            return type(a)(x._local if isinstance(x, ShardTensor) else x for x in a)
        return a

    return [u(a) for a in args], {k: u(v) for k, v in kwargs.items()}


def gather_fallback(func, args, kwargs, reason: str):
    """fallback('gather'): full tensors in, op on every rank, outputs re-sharded like the first input
    when the shape allows, else replicated."""
    sts = shard_tensors(args, kwargs)
    _warn_fallback(func, reason)
    mesh = common_mesh(sts, func)
    first = sts[0]._spec

    def full(a):
        if isinstance(a, ShardTensor):
            return replicate_local(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, ShardTensor) for x in a):
            return type(a)(replicate_local(x) if isinstance(x, ShardTensor) else x for x in a)
        return a

    full_args = [full(a) for a in args]
    out = func(*full_args, **{k: full(v) for k, v in kwargs.items()})
    if _INPLACE in func.tags and isinstance(args[0], ShardTensor):
        # the op wrote into a gathered copy of self: keep self's layout, with the new values
        self_ = args[0]
        spec = self_._spec.with_(placements=tuple(_R if isinstance(p, Partial) else p for p in self_._spec.placements))
        relayout(self_, redistribute_local(full_args[0], replicated_spec(mesh, self_.shape), spec), spec)
        return self_

    def respec(t):
        rep = replicated_spec(mesh, t.shape)
        if t.shape != first.shape:
            return rep, t
        dst = target_spec(rep, tuple(_R if isinstance(p, Partial) else p for p in first.placements),
                          {m: s for m, s in enumerate(first.sizes) if s is not None})
        return dst, redistribute_local(t, rep, dst)

    def w(o):
        if isinstance(o, torch.Tensor):
            spec, local = respec(o)
            return ShardTensor(local, spec)
        if isinstance(o, (list, tuple)):
            return type(o)(w(x) for x in o)
        return o

    return w(out)


# --------------------------------------------------------------------------------------------
# pointwise ops: layout arithmetic + cache
# --------------------------------------------------------------------------------------------
_aten = torch.ops.aten
# ops under which a Partial(sum) operand stays Partial
_LINEAR_ALL = {_aten.add.Tensor, _aten.sub.Tensor, _aten.add_.Tensor, _aten.sub_.Tensor}
_LINEAR_ONE = {_aten.mul.Tensor, _aten.mul.Scalar, _aten.mul_.Tensor, _aten.mul_.Scalar, _aten.div.Tensor,
               _aten.div.Scalar, _aten.div_.Tensor, _aten.div_.Scalar, _aten.neg.default, _aten.neg_.default,
               _aten.clone.default}
_plan_cache: dict = {}


class _Plan:
    __slots__ = ("out_spec", "actions", "inplace", "local_only")

    def __init__(self, out_spec, actions, inplace):
        self.out_spec = out_spec
        self.actions = actions  # per tensor arg: (index, None | ShardSpec to redistribute to | narrows)
        self.inplace = inplace
        self.local_only = all(not act for _, act in actions)  # every operand used as it is


def _flat_tensor_args(args):
    """Positional tensor-like args, flat: (index, value) with ShardTensors and plain tensors."""
    return [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


def pointwise(func, args, kwargs):
    key = [func]
    for a in args:
        t = type(a)
        if t is ShardTensor:
            key.append(a._spec)
        elif isinstance(a, torch.Tensor):
            if a.requires_grad and not getattr(a, "_domainflow_hooked", False):
                hook_plain_grads((a,))
            key.append(a.shape)
        else:
            key.append(None if t in _SCALARS else _hashable(a))
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                return _unsupported_or_fallback(func, args, kwargs, "tensor keyword arguments are not supported")
    key = tuple(key)
    plan = _plan_cache.get(key)
    if plan is None:
        plan = _plan_pointwise(func, args)
        if len(_plan_cache) > 65536:
            _plan_cache.clear()
        _plan_cache[key] = plan
    if isinstance(plan, str):
        return _unsupported_or_fallback(func, args, kwargs, plan)
    if plan.local_only:
        out = func(*[a._local if type(a) is ShardTensor else a for a in args], **kwargs)
    else:
        local_args = list(args)
        for i, act in plan.actions:
            a = args[i]
            if type(a) is ShardTensor:
                local_args[i] = a._local if act is None else redistribute_local(a._local, a._spec, act)
            elif act:
                for d, start, length in act:
                    a = a.narrow(d, start, length)
                local_args[i] = a
        out = func(*local_args, **kwargs)
        if plan.inplace and local_args[0] is not args[0]._local:
            relayout(args[0], local_args[0], plan.out_spec)  # self had to change layout
    if plan.inplace:
        return args[0]
    if type(out) is torch.Tensor:
        return ShardTensor(out, plan.out_spec)
    return wrap(out, plan.out_spec)


_SCALARS = (int, float, bool, complex)


def _hashable(a):
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


def _plan_pointwise(func, args):
    tensors = _flat_tensor_args(args)
    sts = [(i, a) for i, a in tensors if isinstance(a, ShardTensor)]
    mesh = common_mesh([a for _, a in sts], func)
    out_shape = torch.broadcast_shapes(*[a.shape for _, a in tensors])
    ndim = len(out_shape)
    inplace = _INPLACE in func.tags
    if inplace and not isinstance(args[0], ShardTensor):
        return "an in-place op on a plain tensor cannot take ShardTensor operands (use an out-of-place op)"
    has_scalar = any(not isinstance(a, torch.Tensor) and isinstance(a, (int, float, complex)) for a in args)
    placements: list = []
    sizes: list = []
    targets: dict[int, list] = {i: list(a._spec.placements) for i, a in sts}
    target_sizes: dict[int, list] = {i: list(a._spec.sizes) for i, a in sts}
    moved = []
    claimed: set[int] = set()  # output dims already sharded by an earlier mesh dim
    for m in range(mesh.ndim):
        pl = {i: a._spec.placements[m] for i, a in sts}
        partial_ops = {i: p for i, p in pl.items() if isinstance(p, Partial)}
        if partial_ops:
            keep = _partial_survives(func, args, pl, partial_ops, has_scalar, inplace)
            if keep is not None:
                placements.append(keep)
                sizes.append(None)
                continue
            for i in partial_ops:
                targets[i][m] = _R
                pl[i] = _R
        # choose the reference shard: the first sharded operand (for in-place ops: self first)
        ref = None
        for i, a in sts:
            p = pl[i]
            if isinstance(p, Shard):
                e = p.dim + ndim - a.ndim
                if a.shape[p.dim] == out_shape[e] and e not in claimed:
                    ref = (e, a._spec.sizes[m])
                    break
        if ref is None:
            for i, _ in sts:
                if isinstance(pl[i], Shard):
                    targets[i][m] = _R
                    target_sizes[i][m] = None
                    moved.append(i)
            placements.append(_R)
            sizes.append(None)
            continue
        e, ref_sizes = ref
        claimed.add(e)
        for i, a in sts:
            off = ndim - a.ndim
            d = e - off
            full_here = d >= 0 and a.shape[d] == out_shape[e]
            p = pl[i]
            if full_here:
                if not (isinstance(p, Shard) and p.dim == d and a._spec.sizes[m] == ref_sizes):
                    if isinstance(p, Shard):
                        moved.append(i)
                    targets[i][m] = Shard(d)
                    target_sizes[i][m] = ref_sizes
            elif isinstance(p, Shard):
                moved.append(i)
                targets[i][m] = _R
                target_sizes[i][m] = None
        placements.append(Shard(e))
        sizes.append(ref_sizes)
    out_spec = ShardSpec(mesh, placements, out_shape, sizes)
    actions = []
    for i, a in tensors:
        if isinstance(a, ShardTensor):
            dst = ShardSpec(mesh, targets[i], a.shape, target_sizes[i])
            actions.append((i, None if dst == a._spec else _valid(dst)))
        else:
            narrows = []
            off = ndim - a.ndim
            coord = out_spec.coord
            for m, p in enumerate(placements):
                if isinstance(p, Shard):
                    d = p.dim - off
                    if d >= 0 and a.shape[d] == out_shape[p.dim]:
                        k = coord[m]
                        narrows.append((d, sum(sizes[m][:k]), sizes[m][k]))
            actions.append((i, narrows))
    if moved:
        _warn_moved(func, [tensors_i for tensors_i in moved], sts)
    return _Plan(out_spec, actions, inplace)


def relayout(x: ShardTensor, local: torch.Tensor, spec: ShardSpec) -> None:
    """Give ``x`` a new layout in place (same global tensor): an in-place op whose operands need it
    laid out differently (``loss += reg`` on a Partial loss, ``x.add_(y)`` with x replicated and y
    sharded). Views taken of ``x`` earlier keep the old chunk."""
    x._local = local
    x._spec = spec


def _valid(spec: ShardSpec) -> ShardSpec:
    return ShardSpec.build(spec.mesh, spec.placements, spec.shape, spec.sizes)


def _partial_survives(func, args, pl, partial_ops, has_scalar, inplace):
    """Placement kept on this mesh dim when Partial operands may stay pending, else None."""
    ops = {p.reduce_op for p in partial_ops.values()}
    if len(ops) != 1:
        return None
    (op,) = ops
    if op not in ("sum", "avg"):
        if func in (_aten.clone.default,) and len(pl) == 1:
            return next(iter(partial_ops.values()))
        return None
    p0 = next(iter(partial_ops.values()))
    others = [p for i, p in pl.items() if i not in partial_ops]
    if any(isinstance(p, Shard) for p in others):
        return None
    n_tensor_args = sum(isinstance(a, torch.Tensor) for a in args)
    if func in _LINEAR_ALL:
        if len(partial_ops) == n_tensor_args and not has_scalar:
            return p0
        return None
    if func in _LINEAR_ONE and len(partial_ops) == 1:
        (i,) = partial_ops
        if func in (_aten.div.Tensor, _aten.div_.Tensor, _aten.div.Scalar, _aten.div_.Scalar) and i != 0:
            return None
        if inplace and i != 0:
            return None
        return p0
    return None


_relayout_warned: set = set()


def warn_relayout(func, detail: str) -> None:
    """A handler moved data to a layout the op can use (communication the user did not ask for);
    warned once per op and situation."""
    key = (func, detail)
    if key in _relayout_warned:
        return
    _relayout_warned.add(key)
    import warnings

    warnings.warn(f"domainflow: {func}: {detail} (this communicates; it is common in backward passes, where "
                  f"gradients can arrive laid out like another operand).", stacklevel=4)


def _warn_moved(func, idx, sts):
    """Called when a plan is made (plans are cached): once per op and combination of layouts."""
    import warnings

    warnings.warn(
        f"domainflow: {func} got operands laid out differently ({describe_sharding([a for _, a in sts])}); "
        f"resharding operand(s) {sorted(set(idx))} to match the first sharded one (this communicates). "
        f"Redistribute them once up front to avoid it.", stacklevel=3)

