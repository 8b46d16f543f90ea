"""Multi-tensor ``torch._foreach_*`` ops on ShardTensors: what optimizers call with ``foreach=True`` (Adam's and
SGD's default on accelerators) and ``clip_grad_norm_(foreach=True)``.

Elementwise foreach ops work index by index like their one-tensor op: when every tensor at each index is laid
out like that index's first one (parameters, their gradients and the optimizer state are: gradients keep the
leaf's layout and ``zeros_like`` keeps it too), the op runs once on the local lists, as fast as on plain
tensors. Otherwise the other operands at an index are moved to the first one's layout (a warned relayout).
The reductions (``_foreach_norm``, ``_foreach_max``, ``_foreach_powsum``) and ``_foreach_mm`` run per index
through the engine's own one-tensor handlers, so their results are global.
"""

from __future__ import annotations

import functools

import torch

from domainflow.dispatch.registry import register_aten
from domainflow.dispatch.toolkit import (local_as, relayout, replicate_local, unsupported_or_fallback, warn_relayout,
                                         wrap_outputs)
from domainflow.layout.placements import Replicate
from domainflow.tensor.shard_tensor import ShardTensor

aten = torch.ops.aten
_R = Replicate()

# per-index one-tensor forms of the foreach ops that are not elementwise
_PER_INDEX = {
    "_foreach_norm": lambda t, ord=2, dtype=None: aten.linalg_vector_norm.default(t, ord, None, False, dtype=dtype),
    "_foreach_max": lambda t: aten.max.default(t),
    "_foreach_powsum": lambda t, ord=2, dtype=None: aten.sum.default(
        aten.pow.Tensor_Scalar(aten.abs.default(t if dtype is None else aten._to_copy.default(t, dtype=dtype)),
                               ord)),
    "_foreach_mm": lambda a, b: aten.mm.default(a, b),
}


@functools.lru_cache(maxsize=None)
def _arg_kinds(func) -> tuple[tuple[str, str], ...]:
    """(name, kind) of each schema argument: 'tensors' (one tensor per index), 'scalars' (one number per
    index), 'tensor' (one tensor for every index) or 'other'."""
    kinds = []
    for a in func._schema.arguments:
        t = str(a.type)
        kind = ("tensors" if t in ("List[Tensor]", "List[Optional[Tensor]]") else
                "scalars" if t.startswith("List[") and "Tensor" not in t else
                "tensor" if t in ("Tensor", "Optional[Tensor]") else "other")
        kinds.append((a.name, kind))
    return tuple(kinds)


def _bound(func, args, kwargs) -> list:
    """The op's arguments in schema order (keyword-only ones from ``kwargs``; absent ones as a sentinel)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        out.append(args[i] if i < len(args) else kwargs.get(a.name, _ABSENT))
    return out


_ABSENT = object()


def _call(func, bound):
    args, kwargs = [], {}
    for a, v in zip(func._schema.arguments, bound):
        if v is _ABSENT:
            continue
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return func(*args, **kwargs)


@register_aten(*[getattr(getattr(aten, n), o) for n in sorted({s.name[len("aten::"):] for s in
                                                               torch._C._jit_get_all_schemas()
                                                               if s.name.startswith("aten::_foreach_")})
                 for o in getattr(aten, n).overloads() if "out" not in o])
def foreach(func, args, kwargs):
    kinds = _arg_kinds(func)
    bound = _bound(func, args, kwargs)
    lists = [i for i, (_, k) in enumerate(kinds) if k == "tensors" and bound[i] is not _ABSENT
             and bound[i] is not None]
    if any(s.ndim and kinds[i][1] == "tensor" for i, s in enumerate(bound) if isinstance(s, ShardTensor)
           and not s._spec.is_replicated):
        return unsupported_or_fallback(func, args, kwargs, "its single tensor operand is sharded")
    n = len(bound[lists[0]])
    name = func._schema.name.split("::")[-1]
    if name in _PER_INDEX:
        return _per_index(name, bound, lists, n)
    alias = func._schema.arguments[lists[0]].alias_info
    inplace = bool(alias and alias.is_write)
    refs = []  # per index: the layout everything there is brought to, or None (plain tensors only)
    same = True
    for j in range(n):
        sts = [bound[i][j] for i in lists if isinstance(bound[i][j], ShardTensor)]
        ref = sts[0]._spec.reduced() if sts else None
        refs.append(ref)
        if any(s._spec is not ref and s._spec != ref for s in sts) or (
                ref is not None and len(sts) != sum(bound[i][j] is not None for i in lists)):
            same = False
    local = list(bound)
    for i, (_, kind) in enumerate(kinds):
        if kind == "tensor" and isinstance(bound[i], ShardTensor):
            local[i] = replicate_local(bound[i])
    if not same:
        warn_relayout(func, "moved operands at some index to the layout of the first tensor there")
    for i in lists:
        local[i] = [t if refs[j] is None else (t._local if same else local_as(t, refs[j]))
                    for j, t in enumerate(bound[i])]
    out = _call(func, local)
    if inplace:
        for j, t in enumerate(bound[lists[0]]):
            if isinstance(t, ShardTensor) and local[lists[0]][j] is not t._local:
                relayout(t, local[lists[0]][j], refs[j])  # a Partial self, or one moved to another layout
        return out
    # elementwise: each result has its index's global shape and layout
    return [o if refs[j] is None else wrap_outputs(o, refs[j]) for j, o in enumerate(out)]


def _per_index(name, bound, lists, n):
    """A foreach reduction (or mm) as one engine call per index."""
    one = _PER_INDEX[name]
    outs = []
    for j in range(n):
        per = [bound[i][j] if i in lists else bound[i] for i in range(len(bound))]
        outs.append(one(*[v for v in per if v is not _ABSENT]))
    return outs
