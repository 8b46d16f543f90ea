"""The pointwise rule: output layouts of elementwise ops by layout arithmetic, one plan cached per
(op, input layouts). Broadcast plain operands are sliced to the local chunk; a Partial(sum) operand stays
pending where the op is linear in it (the tables below); anything else is reduced first."""

from __future__ import annotations

from typing import NamedTuple

import torch

from domainflow.dispatch.registry import REGISTRY
from domainflow.dispatch.toolkit import hook_plain_grads, hooked_plain_grads, into_plain, local_as, local_exact
from domainflow.dispatch.toolkit import COPIED_VIEWS, refuse_write_into_copied_view
from domainflow.dispatch.toolkit import relayout, replicate_local, to_spec, unsupported_or_fallback, warn_moved
from domainflow.dispatch.toolkit import warn_relayout, wrap_outputs
from domainflow.errors import ShardingMismatchError
from domainflow.tensor.redistribute import redistribute_local
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.layout.spec import ShardSpec
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.dispatch.toolkit import PLANS, common_mesh

_INPLACE = torch.Tag.inplace
_R = Replicate()


_aten = torch.ops.aten


# ops under which a Partial(sum) operand stays Partial
_LINEAR_ALL = {_aten.add.Tensor, _aten.sub.Tensor, _aten.add_.Tensor, _aten.sub_.Tensor}


_LINEAR_ONE = {_aten.mul.Tensor, _aten.mul.Scalar, _aten.mul_.Tensor, _aten.mul_.Scalar, _aten.div.Tensor,
               _aten.div.Scalar, _aten.div_.Tensor, _aten.div_.Scalar, _aten.neg.default, _aten.neg_.default,
               _aten.clone.default}


_plans = PLANS
_MISS = object()


# The typed steps of a pointwise plan: how each tensor operand becomes the local argument of the op.
class AsIs(NamedTuple):
    """The operand's local chunk (a plain tensor: itself, broadcast)."""

    index: int

    def local(self, a):
        return a._local if type(a) is ShardTensor else a


class Relayout(NamedTuple):
    """A ShardTensor operand laid out otherwise: redistributed to ``spec`` (communicates; warned once)."""

    index: int
    spec: ShardSpec

    def local(self, a):
        return redistribute_local(a._local, a._spec, self.spec)


class SliceRows(NamedTuple):
    """A plain operand with the full extent along sharded output dims: this rank's rows, by ``narrows``
    ((dim, start, length) each)."""

    index: int
    narrows: tuple

    def local(self, a):
        for d, start, length in self.narrows:
            a = a.narrow(d, start, length)
        return a


class _Plan:
    __slots__ = ("out_spec", "actions", "inplace", "local_only")

    def __init__(self, out_spec, actions, inplace):
        self.out_spec = out_spec
        self.actions = actions  # one typed step per tensor operand
        self.inplace = inplace
        self.local_only = all(type(act) is AsIs for act in actions)  # every operand used as it is


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
            if a.requires_grad and a not in hooked_plain_grads:
                hook_plain_grads((a,))
            key.append(a.shape)
        else:
            key.append(None if t in _SCALARS else _hashable(a))
    if kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                return unsupported_or_fallback(func, args, kwargs, "tensor keyword arguments are not supported")
    key = tuple(key)
    plan = _plans.recent.get(key, _MISS)
    if plan is _MISS:
        plan = _plans.cached(key, lambda: _plan_pointwise(func, args))
    if isinstance(plan, str):
        if plan is _PLAIN_SELF:
            return into_plain(func, args, kwargs, args[0])
        return unsupported_or_fallback(func, args, kwargs, plan)
    if plan.inplace and COPIED_VIEWS:
        refuse_write_into_copied_view(func, args[0])
    if plan.local_only:
        out = func(*[a._local if type(a) is ShardTensor else a for a in args], **kwargs)
        if not plan.inplace:
            local_exact()
    else:
        if plan.inplace and type(plan.actions[0]) is Relayout and _is_view(args[0]):
            return _into_view(func, args, kwargs)
        local_args = list(args)
        for act in plan.actions:
            local_args[act.index] = act.local(args[act.index])
        out = func(*local_args, **kwargs)
        if plan.inplace and local_args[0] is not args[0]._local:
            relayout(args[0], local_args[0], plan.out_spec)  # self had to change layout
    if plan.inplace:
        return args[0]
    if type(out) is torch.Tensor:
        return ShardTensor.from_spec(out, plan.out_spec)
    return wrap_outputs(out, plan.out_spec)


_SCALARS = (int, float, bool, complex)


_no_subclass_functions = torch._C.DisableTorchFunctionSubclass


def _is_view(x) -> bool:
    with _no_subclass_functions():
        return x._is_view()


def _into_view(func, args, kwargs):
    """An in-place op on a view (``buf[:, :m] = y``) whose operands are laid out otherwise: relaying out the view
    alone would leave its base stale, so the operands are brought to the view's layout instead (a replicated
    view gathers them; communicates, warned once). A pending-sum view, or an operand that cannot take the
    view's layout, is refused by name."""
    self_ = args[0]
    spec = self_._spec
    if spec.has_partial:
        raise ShardingMismatchError(
            f"{func}: in place on a view of a pending sum (Partial) that its other operands would make reduce; "
            f"reduce the base first (x = x.redistribute([Replicate()]) or x.full_tensor())")
    local_args = list(args)
    for i, a in enumerate(args[1:], 1):
        if type(a) is ShardTensor:
            if spec.is_replicated:
                local_args[i] = replicate_local(a)
            elif a.shape == self_.shape:
                local_args[i] = to_spec(a, spec)
            else:
                raise ShardingMismatchError(
                    f"{func}: in place on a view laid out {spec.placements} with an operand of shape {tuple(a.shape)} "
                    f"laid out {a._spec.placements}; redistribute the operand to the view's layout first")
        elif isinstance(a, torch.Tensor):
            local_args[i] = local_as(a, spec)
    warn_relayout(func, "an in-place op on a view: its operands were brought to the view's layout")
    func(self_._local, *local_args[1:], **kwargs)
    return self_


# the plan of an in-place op on a plain tensor with ShardTensor operands: toolkit.into_plain decides
_PLAIN_SELF = "an in-place op on a plain tensor with ShardTensor operands"


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
        return _PLAIN_SELF
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
            actions.append(AsIs(i) if dst == a._spec else Relayout(i, _valid(dst)))
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
            actions.append(SliceRows(i, tuple(narrows)) if narrows else AsIs(i))
    if moved:
        warn_moved(func, [tensors_i for tensors_i in moved], sts)
    return _Plan(out_spec, actions, inplace)


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


REGISTRY.register_pointwise(pointwise)
