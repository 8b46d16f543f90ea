"""The toolkit op handlers are written with: argument parsing, layouts of operands and results, the
gather fallback, relayout warnings, and autograd glue for replicated parameters. Handlers in ``ops/``
(built-in or a user's) use these names and nothing private of another module."""

from __future__ import annotations

import threading
import weakref

import torch

from domainflow.dispatch.fallback import fallback as _fallback_mode
from domainflow.dispatch.fallback import warn_once as _warn_fallback
from domainflow.dispatch.param_grads import (accumulates_into_grad, defer_grad, deferring, multi_rank_dims,
                                             reduce_param_grads)
from domainflow.errors import ShardingMismatchError, UnsupportedShardedOp
from domainflow.layout.placements import Partial, Replicate, Shard, normalize_placements
from domainflow.layout.spec import ShardSpec
from domainflow.memo import PLANS, memoized  # PLANS: the one plan cache, re-exported for handlers
from domainflow.tensor.redistribute import redistribute_local
from domainflow.tensor.shard_tensor import ShardTensor, TensorMarks, spec_of_local_shape, target_spec

_INPLACE = torch.Tag.inplace
_R = Replicate()


def layout_rule(fn):
    """Decorator for a handler's pure layout function of hashable arguments (specs, shapes, dims): computed
    once per arguments and kept in :data:`PLANS`."""
    return memoized(PLANS)(fn)


def shard_tensors(args, kwargs=None) -> list[ShardTensor]:
    """ShardTensors among ``args`` and ``kwargs`` values (one level of lists included)."""
    out = []
    for a in args:
        if isinstance(a, ShardTensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, ShardTensor))
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, ShardTensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, ShardTensor))
    return out


def common_mesh(sts, op):
    """The one device mesh of ShardTensors ``sts``; ``ShardingMismatchError`` if they live on different ones."""
    mesh = sts[0]._spec.mesh
    for s in sts[1:]:
        if s._spec.mesh is not mesh and s._spec.mesh != mesh:
            raise ShardingMismatchError(f"{op}: operands live on different device meshes "
                                        f"({tuple(mesh.shape)} and {tuple(s._spec.mesh.shape)}); redistribute onto one mesh")
    return mesh


def wrap_outputs(out, spec_or_fn):
    """Every local tensor in ``out`` (a tensor, or lists and tuples of them, nested; other values kept as they
    are) wrapped by :meth:`ShardTensor.from_spec`; ``spec_or_fn`` is the spec of each, or a function from a
    local tensor to its spec."""
    if isinstance(out, torch.Tensor):
        spec = spec_or_fn(out) if callable(spec_or_fn) else spec_or_fn
        return ShardTensor.from_spec(out, spec)
    if isinstance(out, (list, tuple)):
        return type(out)(wrap_outputs(o, spec_or_fn) for o in out)
    return out


def replicated_spec(mesh, shape) -> ShardSpec:
    """The layout of a tensor of ``shape`` replicated over every dim of ``mesh``."""
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


def unsupported_or_fallback(func, args, kwargs, reason: str):
    """What a handler returns for a case it cannot run sharded: the gather fallback when it is on, else
    ``UnsupportedShardedOp`` naming the op, the reason and the operands' layouts."""
    if _fallback_mode.current() == "gather":
        return gather_fallback(func, args, kwargs, reason)
    raise UnsupportedShardedOp(func, f"{reason} (operands: {describe_sharding(shard_tensors(args, kwargs))})")


def describe_sharding(sts) -> str:
    """How ShardTensors ``sts`` are laid out, in words (for error messages)."""
    parts = []
    for s in sts:
        sp = s._spec
        dims = [f"dim {p.dim} over mesh dim {m} in sizes {list(sp.sizes[m])}" for m, p in enumerate(sp.placements)
                if isinstance(p, Shard)]
        parts.append(f"shape {tuple(sp.shape)} sharded on " + (", ".join(dims) if dims else "no dim")
                     + (" (Partial)" if sp.has_partial else ""))
    return "; ".join(parts)


def is_sharded(x) -> bool:
    """Whether ``x`` is a ShardTensor split over some mesh dim (a Shard placement), from its layout alone."""
    return type(x) is ShardTensor and any(d is not None for d in x._spec.shard_dims)


def op_name(op) -> str:
    """``copy_`` for aten.copy_.default, ``mul(out=)`` for aten.mul.out, ``index_add_`` for Tensor.index_add_."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return getattr(op, "__name__", None) or str(op)
    name = schema.name.split("::")[-1]
    return f"{name}(out=)" if torch.Tag.out in op.tags else name


def plain_destination_error(op, source: ShardTensor, dest: torch.Tensor, fix: str = "",
                            name: str | None = None) -> ShardingMismatchError:
    """The refusal of an op that would write sharded ``source`` into the plain tensor ``dest`` (gathering it
    onto every rank): one line naming the op (or ``name``), the layouts and the fix."""
    sp = source._spec
    names = tuple(getattr(sp.mesh, "mesh_dim_names", None) or ())
    over = [f"dim {p.dim} over {names[m]!r}" if m < len(names) else f"dim {p.dim} over mesh dim {m}"
            for m, p in enumerate(sp.placements) if isinstance(p, Shard)]
    name = name or op_name(op)
    if name == "copy_":
        fix = fix or ("; buf[...] = x and buf[..., :m] = x assign through copy_: writing the result out of place "
                      "(e.g. F.pad(x, ...) around the assigned part) keeps it sharded too")
    return ShardingMismatchError(
        f"{name} of a ShardTensor (shape {tuple(sp.shape)} sharded on {', '.join(over)}) into a plain tensor of "
        f"shape {tuple(dest.shape)} would gather it onto every rank; allocate the destination from the ShardTensor "
        f"(e.g. torch.zeros_like(x)) so it is sharded too, or call x.full_tensor() explicitly if a full copy is "
        f"what you want{fix}")


def into_plain(func, args, kwargs, dest, fix: str = "", whole=None, name: str | None = None):
    """An in-place or ``out=`` op whose destination ``dest`` is a plain tensor while ShardTensors are among its
    operands. Unsharded ones (replicated, or pending sums: reduced) are whole on every rank, so the op runs on
    plain tensors and writes the same values on every rank: exact. A sharded one would be gathered onto
    every rank: refused by name (``plain_destination_error``; every rank decides alike, from layouts, before
    any communication), unless ``fallback('gather')`` is on, which asked for it. ``whole``: how a ShardTensor
    becomes whole (default ``replicate_local``, below autograd; a function handler passes ``full_tensor``);
    ``name``: the op's name in the error, where ``func`` does not tell it."""
    sharded = [s for s in shard_tensors(args, kwargs) if is_sharded(s)]
    if sharded:
        if _fallback_mode.current() != "gather":
            raise plain_destination_error(func, sharded[-1], dest, fix, name)  # the last: the source, not an index
        _warn_fallback(func, "it writes a sharded operand into a plain tensor")
    la, lk = _map_shard_tensors(args, kwargs, whole or replicate_local)
    return func(*la, **lk)


# runs ``func`` with __torch_function__ disabled for subclasses (the C implementation torch uses)
_run_function = torch._C._disabled_torch_function_impl


def run_function_default(func, args, kwargs):
    """What a function handler calls to fall through to torch's own implementation (the aten ops it runs
    on ShardTensors answer for themselves to the fast path's trace)."""
    local_exact()
    return _run_function(func, (ShardTensor,), args, kwargs)


class Trace:
    """What one Python-level call did on ShardTensors while the fast path learns it: ``steps`` (aten ops
    and function handlers entered) and how many of them declared themselves local-exact."""

    __slots__ = ("steps", "exact", "marked")

    def __init__(self):
        self.steps = 0
        self.exact = 0
        self.marked = False  # the step running now declared itself local-exact


class _Tracing(threading.local):
    trace = None  # the Trace this thread fills, or None


tracing = _Tracing()


def local_exact() -> None:
    """A handler declares the op it runs now local-exact: its result is the op itself run on the local
    chunks with every other argument unchanged (no communication, no relayout, no slicing of plain
    operands), laid out by the input layouts alone. When every step of a Python-level call is, the engine
    runs that call directly on local chunks the next time it sees the same layouts outside autograd
    (``domainflow.dispatch.fast_path``). Declare it only where all of this holds; a handler that calls
    another handler directly (not through torch) answers for that one's declaration too."""
    t = tracing.trace
    if t is not None:
        t.marked = True


_ALIASES = {"input": "self", "axis": "dim", "keepdims": "keepdim"}


class Schema:
    """A torch function's parameters as a handler declares them, once (at import): names in order and
    defaults. ``bind`` gives a call's arguments as one dict by name, defaults filled (``input=`` and
    numpy's ``axis=`` / ``keepdims=`` accepted); the static ones then key the handler's ``@layout_rule``."""

    __slots__ = ("names", "defaults")

    def __init__(self, *names: str, **defaults):
        self.names = names
        self.defaults = defaults

    def bind(self, args, kwargs, **overrides) -> dict:
        """``overrides``: defaults that depend on the call (``sum(x, dtype)``)."""
        out = dict(self.defaults)
        if overrides:
            out.update(overrides)
        out.update(zip(self.names, args))
        for k, v in kwargs.items():
            out[_ALIASES.get(k, k)] = v
        return out


def _plain_grad_hook(tensor):
    """Gradient hook of a plain tensor (e.g. an nn.Parameter) used with ShardTensors: its summed gradient
    arrives as a ShardTensor (often Partial) and is reduced to a plain tensor, exactly once. For a leaf
    inside ``deferred_param_grads()`` the sum joins the one coalesced all-reduce at the end of backward
    (the hook hands autograd zeros; the reduced sum is added to ``.grad`` then)."""
    ref = weakref.ref(tensor)

    def hook(grad):
        if not isinstance(grad, ShardTensor):
            return grad
        t = ref()
        if t is not None and t.is_leaf and deferring() and accumulates_into_grad(t):
            dims = _partial_sum_dims(grad._spec)
            if dims:
                dims = multi_rank_dims(grad._spec.mesh, dims)
                if not dims:  # pending only over mesh dims of one rank: the local chunk is the whole sum
                    return grad._local
                defer_grad(t, grad._local, grad._spec.mesh, dims)
                return torch.zeros_like(grad._local)
        return replicate_local(grad)

    return hook


def _partial_sum_dims(spec) -> tuple[int, ...] | None:
    """The Partial(sum) mesh dims of a gradient that is otherwise replicated (its local chunk is then the
    whole tensor's partial sum), or None when it is laid out otherwise."""
    dims = []
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_op == "sum":
            dims.append(m)
        elif not isinstance(p, Replicate):
            return None
    return tuple(dims) or None


# tensors that have the hook (by identity, not a flag that copy.deepcopy would copy to an unhooked tensor)
hooked_plain_grads = TensorMarks()


def hook_plain_grads(args):
    """Give plain tensors that need gradients the reduce-to-plain hook (once per tensor)."""
    for a in args:
        if type(a) is ShardTensor:
            continue
        if isinstance(a, torch.Tensor):
            if a.requires_grad and a not in hooked_plain_grads:
                a.register_hook(_plain_grad_hook(a))
                hooked_plain_grads.add(a)
        elif type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor):
            hook_plain_grads(a)


def run_replicated(func, args, kwargs, sts):
    """All ShardTensor inputs replicated: compute locally; outputs replicated (no communication)."""
    mesh = common_mesh(sts, func)
    la, lk = _unwrap_all(args, kwargs)
    out = func(*la, **lk)
    if _INPLACE in func.tags and args and isinstance(args[0], ShardTensor):
        return args[0]
    local_exact()
    return wrap_outputs(out, lambda t: replicated_spec(mesh, t.shape))


def _unwrap_all(args, kwargs):
    def u(a):
        if isinstance(a, ShardTensor):
            return a._local
        if isinstance(a, (list, tuple)) and any(isinstance(x, ShardTensor) for x in a):
            return type(a)(x._local if isinstance(x, ShardTensor) else x for x in a)
        return a

    return [u(a) for a in args], {k: u(v) for k, v in kwargs.items()}


def _map_shard_tensors(args, kwargs, fn):
    """``args`` and ``kwargs`` with every ShardTensor (also in lists and tuples) replaced by ``fn(it)``."""
    def m(a):
        if isinstance(a, ShardTensor):
            return fn(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, ShardTensor) for x in a):
            return type(a)(fn(x) if isinstance(x, ShardTensor) else x for x in a)
        return a

    return [m(a) for a in args], {k: m(v) for k, v in kwargs.items()}


def gather_fallback(func, args, kwargs, reason: str):
    """fallback('gather'): full tensors in, op on every rank, outputs re-sharded like the first input
    when the shape allows, else replicated."""
    sts = shard_tensors(args, kwargs)
    if not sts:
        raise UnsupportedShardedOp(func, f"{reason}; the gather fallback was handed no ShardTensor operand to take "
                                         f"the device mesh from")
    _warn_fallback(func, reason)
    mesh = common_mesh(sts, func)
    first = sts[0]._spec
    if not isinstance(func, torch._ops.OpOverload):
        return _gather_fallback_above_autograd(func, args, kwargs, mesh, first)
    full_args, full_kwargs = _map_shard_tensors(args, kwargs, replicate_local)
    out = func(*full_args, **full_kwargs)
    inplace = _INPLACE in getattr(func, "tags", ())  # func: an aten op, or a Python function (no tags)
    dest = args[0] if inplace else kwargs.get("out")
    if dest is not None and not isinstance(dest, ShardTensor):
        return out  # a plain destination, written whole (what the user opted in to)
    if inplace:
        # the op wrote into a gathered copy of self: keep self's layout, with the new values
        self_ = args[0]
        spec = self_._spec.reduced()
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
            if o.layout != torch.strided:
                raise UnsupportedShardedOp(func, f"{reason}; gathered, it returns a {o.layout} tensor, which a "
                                                 f"ShardTensor cannot hold (operands: {describe_sharding(sts)})")
            spec, local = respec(o)
            return ShardTensor.from_spec(local, spec)
        if isinstance(o, (list, tuple)):
            return type(o)(w(x) for x in o)
        return o

    # a view op's result is a copy here: writes through it (backward formulas make them: x.diagonal().mul_(...))
    # would not reach the input, so they are refused
    return mark_copied_view(w(out)) if getattr(func, "is_view", False) else w(out)


def _gather_fallback_above_autograd(func, args, kwargs, mesh, first: ShardSpec):
    """The gather fallback of a Python-level function (a function handler's case it cannot run sharded): above
    autograd, so through ShardTensor's differentiable conversions, or the inputs' gradients would be lost."""
    rep = (_R,) * mesh.ndim
    full_args, full_kwargs = _map_shard_tensors(args, kwargs, lambda st: st.redistribute(rep).to_local())
    out = func(*full_args, **full_kwargs)
    sizes = {m: s for m, s in enumerate(first.sizes) if s is not None}
    placements = tuple(_R if isinstance(p, Partial) else p for p in first.placements)

    def w(o):
        if isinstance(o, torch.Tensor) and not isinstance(o, ShardTensor):
            whole = ShardTensor.from_spec(o, replicated_spec(mesh, o.shape))
            return whole.redistribute(placements, sharding_shapes=sizes) if o.shape == first.shape else whole
        if isinstance(o, (list, tuple)):
            return type(o)(w(x) for x in o)
        return o

    return w(out)


# ShardTensors that stand for a view of another but hold a copy: torch's lazy conjugate and negative views
# (``x.conj()``, resolved so ops on chunks read values) and a view op's result under the gather fallback
# (``x.diagonal()``, ``x.unfold(...)``) or of a reshape that re-sharded its input (``x.view(-1)`` of a tensor
# sharded along its inner dim): a write into one would not reach the viewed tensor, so in-place ops
# refuse it (by id: a WeakSet compares tensors with ==, elementwise)
COPIED_VIEWS: "weakref.WeakValueDictionary[int, ShardTensor]" = weakref.WeakValueDictionary()


def mark_copied_view(x):
    """Record ``x`` (a ShardTensor, or a tuple/list of them) as a view held as a copy."""
    if isinstance(x, ShardTensor):
        COPIED_VIEWS[id(x)] = x
    elif isinstance(x, (list, tuple)):
        for t in x:
            mark_copied_view(t)
    return x


def refuse_write_into_copied_view(func, x) -> None:
    """Raise when in-place ``func`` would write into one of :data:`COPIED_VIEWS`."""
    if COPIED_VIEWS.get(id(x)) is x:
        raise UnsupportedShardedOp(func, "it writes into a ShardTensor that stands for a view of another (a conjugate "
                                         "or negative view, a view op's result under fallback('gather'), or a "
                                         "reshape that had to re-shard its input) but "
                                         "holds a copy: the write would not reach the viewed tensor; write into the "
                                         "tensor itself, or into a .clone() of the view")


def relayout(x: ShardTensor, local: torch.Tensor, spec: ShardSpec) -> None:
    """Give ``x`` a new layout in place (same global tensor): an in-place op whose operands need it
    laid out differently (``loss += reg`` on a Partial loss, ``x.add_(y)`` with x replicated and y
    sharded). Views taken of ``x`` earlier keep the old chunk."""
    x._local = local
    x._spec = spec


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


def warn_moved(func, idx, sts):
    """Called when a plan is made (plans are cached): once per op and combination of layouts."""
    import warnings

    warnings.warn(
        f"domainflow: {func} got operands laid out differently ({describe_sharding([a for _, a in sts])}); "
        f"resharding operand(s) {sorted(set(idx))} to match the first sharded one (this communicates). "
        f"Redistribute them once up front to avoid it.", stacklevel=3)


class _SumGradsOver(torch.autograd.Function):
    """Identity on replicated parameters; backward sums their (per-rank partial) gradients over the given
    mesh dims (``domainflow.dispatch.param_grads``: now, or once per backward for all layers)."""

    @staticmethod
    def forward(ctx, mesh, mesh_dims, *params):
        ctx.mesh, ctx.mesh_dims, ctx.params = mesh, mesh_dims, params
        return tuple(p.view_as(p) if p is not None else None for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *reduce_param_grads(ctx.params, grads, ctx.mesh, ctx.mesh_dims))


def params_for(mesh, mesh_dims, *params):
    """Route plain parameters through the gradient sum (only those that need gradients)."""
    need = any(p is not None and p.requires_grad for p in params)
    if not need or not mesh_dims or not torch.is_grad_enabled():
        return params
    return _SumGradsOver.apply(mesh, tuple(mesh_dims), *params)


def spec_like(spec: ShardSpec, local_shape) -> ShardSpec:
    """The layout of a chunk of shape ``local_shape`` with ``spec``'s mesh, placements and per-rank sizes (the
    global shape follows: ``spec``'s along sharded dims, ``local_shape`` elsewhere), for
    ``ShardTensor.from_spec(local, spec_like(spec, local.shape))``; derived once per (spec, local shape)."""
    return _spec_like(spec, tuple(local_shape))


@layout_rule
def _spec_like(spec, local_shape: tuple):
    mapping = {m: list(s) for m, s in enumerate(spec.sizes) if s is not None}
    return spec_of_local_shape(local_shape, spec.mesh, normalize_placements(spec.placements, len(local_shape),
                                                                            spec.mesh.ndim), mapping)


def spec_from_sizes(local_shape, mesh, placements, sizes) -> ShardSpec:
    """The layout of a chunk of shape ``local_shape`` over ``mesh`` with ``placements``, given every rank's sizes
    as ``ShardTensor.from_local`` takes them (``{mesh dim or name: [size or local shape of each rank]}``), for
    ``ShardTensor.from_spec``: for a handler's own outputs, whose sizes it derived from checked layouts, so
    nothing is recorded for the cross-rank layout check (that would cost a collective per op). Derived once
    per (mesh, placements, local shape, sizes) and kept in :data:`PLANS` (sizes given as lists of lists:
    each time)."""
    local_shape = tuple(local_shape)
    key = (_derived_specs, mesh, tuple(placements), local_shape, tuple((k, tuple(v)) for k, v in sizes.items()))
    try:
        spec = PLANS.get(key)
    except TypeError:  # sizes given as lists of lists: derived each time
        key, spec = None, None
    if spec is None:
        spec = spec_of_local_shape(local_shape, mesh, normalize_placements(placements, len(local_shape), mesh.ndim),
                                   sizes)
        if key is not None:
            PLANS.put(key, spec)
    return spec


_derived_specs = "derived specs"  # first part of their keys in PLANS


def without_partial(x: ShardTensor) -> ShardTensor:
    """``x`` with every Partial placement reduced to Replicate (one all-reduce per Partial mesh dim)."""
    if x._spec.has_partial:
        return x.redistribute(x._spec.reduced().placements)
    return x
