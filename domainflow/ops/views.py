"""View and indexing ops: reshape/permute/squeeze/expand/slice/select and friends.

Layouts follow arithmetically (``shapes.view_shard_map``, ``shapes.slice_sizes``). Communication
happens only for ``select`` of one index of a sharded dim (a broadcast from its owner, which keeps a
true view so ``x[i] = v`` writes into ``x``), and for a reshape whose shards would straddle its groups
(moved to the nearest compatible layout, with a warning; typical for gradients in backward).
"""

from __future__ import annotations

import math


import torch

from domainflow import comm
from domainflow.layout import shapes
from domainflow.dispatch.toolkit import (PLANS, layout_rule, local_exact, mark_copied_view, unsupported_or_fallback,
                                        to_spec, warn_relayout)
from domainflow.memo import Memo
from domainflow.errors import UnsupportedShardedOp
from domainflow.layout.placements import Replicate, Shard
from domainflow.dispatch.registry import REGISTRY, register_aten
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.layout.spec import ShardSpec, mesh_shape

aten = torch.ops.aten
_R = Replicate()


def _spec(x: ShardSpec, placements, shape, sizes) -> ShardSpec:
    return ShardSpec(x.mesh, placements, shape, sizes)


def _replicate_dims(x: ShardTensor, dims) -> ShardTensor:
    """Gather the mesh dims that shard any of ``dims`` (used where a view cannot keep them sharded)."""
    spec = x._spec
    pl, sz = list(spec.placements), list(spec.sizes)
    for m, p in enumerate(pl):
        if isinstance(p, Shard) and p.dim in dims:
            pl[m], sz[m] = _R, None
    dst = _spec(spec, pl, spec.shape, sz)
    return x if dst == spec else ShardTensor.from_spec(to_spec(x, dst), dst)


@register_aten(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default)
def view(func, args, kwargs):
    x, size = args[0], args[1]
    key = (_view_layouts, x._spec, tuple(size))
    out = PLANS.get(key)
    copied = False  # the result views a re-laid-out copy of x, so a write into it would not reach x
    if out is None:
        out = _view_layout(x, size)
        if isinstance(out, ShardSpec):
            PLANS.put(key, out)
        elif isinstance(out, tuple):  # (moved input, its spec): rows re-sharded, or a size-1 sharded dim replicated
            (x, out), copied = out, True
        else:
            return unsupported_or_fallback(func, args, kwargs, out)
    local = x._local
    if func is aten.view.default:
        # a ShardTensor reports the strides of a contiguous tensor whatever its local chunk's are, so torch
        # (einsum, matmul) may view a sliced one that cannot be viewed locally: copy it, as torch would have
        # reshaped the sliced tensor it cannot view
        try:
            res = local.view(out.local_shape)
        except RuntimeError:
            res, copied = local.reshape(out.local_shape), True
    elif func is aten._reshape_alias.default:
        res = local.reshape(out.local_shape)
    else:
        res = func(local, out.local_shape)
    result = ShardTensor.from_spec(res, out)
    return mark_copied_view(result) if copied else result


_view_layouts = "view layouts"  # the first part of their keys in toolkit.PLANS


def _compatible_layout(spec: ShardSpec, out_shape) -> ShardSpec | None:
    """``spec``, or the nearest layout whose shards survive reshaping to ``out_shape``: each failing
    shard moves to the outermost dim of its reshape group with sizes in whole units of that group's
    inner extent (chunked). None when no such layout exists."""
    src = tuple(spec.shape)
    pl, sz = list(spec.placements), list(spec.sizes)
    changed = False
    for m, p in enumerate(spec.placements):
        if not isinstance(p, Shard) or shapes.view_shard_map(src, out_shape, p.dim, spec.sizes[m]) is not None:
            continue
        group = next((g for g in shapes.view_groups(src, out_shape) if p.dim in g[0]), None)
        real_i = [d for d in group[0] if src[d] != 1] if group else []
        real_j = [d for d in group[1] if out_shape[d] != 1] if group else []
        if not real_i or not real_j:
            return None
        outer, e = real_i[0], real_j[0]
        if outer != p.dim and any(isinstance(q, Shard) and q.dim == outer for q in pl):
            return None
        inner_src = math.prod(src[d] for d in group[0] if d > outer)
        inner_dst = math.prod(out_shape[d] for d in group[1] if d > e)
        unit = inner_dst // math.gcd(inner_src, inner_dst)
        if src[outer] % unit:
            return None
        pl[m] = Shard(outer)
        sz[m] = tuple(unit * c for c in shapes.chunk_sizes(src[outer] // unit, mesh_shape(spec.mesh)[m]))
        changed = True
    return ShardSpec.build(spec.mesh, pl, src, sz) if changed else spec


def _view_layout(x: ShardTensor, size):
    """The output spec of reshaping ``x`` to ``size``, or a reason string when rows would split."""
    spec = x._spec
    try:
        out_shape = shapes.infer_view_shape(spec.shape.numel(), size)
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    # a sharded dim of global size 1 that the view drops or merges: gather it (one row) first
    ones = [p.dim for m, p in enumerate(spec.placements) if isinstance(p, Shard) and spec.shape[p.dim] == 1
            and shapes.view_shard_map(tuple(spec.shape), out_shape, p.dim, spec.sizes[m]) is None]
    gathered = None
    if ones:
        x = gathered = _replicate_dims(x, ones)
        spec = x._spec
    src = tuple(spec.shape)
    moved = _compatible_layout(spec, out_shape)
    if moved is not None and moved != spec:
        # rows of a shard would straddle the reshape's groups (typical for gradients that arrive laid
        # out like another operand): move them to the nearest layout the reshape keeps sharded
        warn_relayout(aten.view.default, f"re-sharded a {src} tensor so that reshaping it to {out_shape} "
                                         f"keeps whole rows on each rank")
        x = gathered = ShardTensor.from_spec(to_spec(x, moved), moved)
        spec = moved
    pl, sz = list(spec.placements), list(spec.sizes)
    for m, p in enumerate(spec.placements):
        if not isinstance(p, Shard):
            continue
        hit = shapes.view_shard_map(src, out_shape, p.dim, spec.sizes[m])
        if hit is None:
            return (f"reshaping {src} -> {out_shape} splits the rows of sharded dim {p.dim} across "
                    f"output dims (only the outermost dim of a merged/split group can stay sharded); move the "
                    f"sharded dim outward first (e.g. permute) or redistribute")
        pl[m], sz[m] = Shard(hit[0]), hit[1]
    out = _spec(spec, pl, out_shape, sz)
    return (gathered, out) if gathered is not None else out


@register_aten(aten.permute.default)
def permute(func, args, kwargs):
    x = args[0]
    dims, spec = _permuted(x._spec, tuple(args[1]))
    local_exact()  # transpose and t come here too: each is itself run on the local chunk
    return ShardTensor.from_spec(x._local.permute(dims), spec)


@layout_rule
def _permuted(spec, dims):
    """(dims made non-negative, the layout after ``permute(dims)``), cached per layout and dims:
    transposes repeat every step."""
    nd = max(len(spec.shape), 1)
    dims = tuple(d % nd for d in dims)
    return dims, _permuted_spec(spec, dims)


def _permuted_spec(spec, dims):
    inv = {d: i for i, d in enumerate(dims)}
    pl = [Shard(inv[p.dim]) if isinstance(p, Shard) else p for p in spec.placements]
    return _spec(spec, pl, [spec.shape[d] for d in dims], spec.sizes)


@register_aten(aten.transpose.int)
def transpose(func, args, kwargs):
    x = args[0]
    nd = max(x.ndim, 1)
    a, b = args[1] % nd, args[2] % nd
    dims = list(range(x.ndim))
    if x.ndim:
        dims[a], dims[b] = dims[b], dims[a]
    return permute(aten.permute.default, (x, dims), {})


@register_aten(aten.t.default)
def t(func, args, kwargs):
    x = args[0]
    return permute(aten.permute.default, (x, list(range(x.ndim))[::-1]), {})


@register_aten(aten.unsqueeze.default)
def unsqueeze(func, args, kwargs):
    x, dim = args[0], args[1] % (args[0].ndim + 1)
    local_exact()
    return ShardTensor.from_spec(x._local.unsqueeze(dim), _unsqueezed(x._spec, dim))


@layout_rule
def _unsqueezed(spec: ShardSpec, dim: int) -> ShardSpec:
    pl = [Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in spec.placements]
    shape = list(spec.shape)
    shape.insert(dim, 1)
    return _spec(spec, pl, shape, spec.sizes)


@register_aten(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze(func, args, kwargs):
    x = args[0]
    nd = x.ndim
    if func is aten.squeeze.default:
        dims = [d for d in range(nd) if x.shape[d] == 1]
    elif func is aten.squeeze.dim:
        dims = [args[1] % nd] if nd else []
    else:
        dims = [d % nd for d in args[1]] if nd else []
    dims = [d for d in dims if x.shape[d] == 1]
    x = _replicate_dims(x, dims)
    out = _squeezed(x._spec, tuple(dims))
    return ShardTensor.from_spec(x._local.reshape(out.local_shape), out)


@layout_rule
def _squeezed(spec: ShardSpec, dims: tuple) -> ShardSpec:
    keep = [d for d in range(spec.ndim) if d not in dims]
    pos = {d: i for i, d in enumerate(keep)}
    pl = [Shard(pos[p.dim]) if isinstance(p, Shard) else p for p in spec.placements]
    return _spec(spec, pl, [spec.shape[d] for d in keep], spec.sizes)


@register_aten(aten.expand.default)
def expand(func, args, kwargs):
    x, size = args[0], list(args[1])
    spec = x._spec
    lead = len(size) - x.ndim
    out_shape = [s if s != -1 else spec.shape[i - lead] for i, s in enumerate(size)]
    grow = [d for d in range(x.ndim) if spec.shape[d] == 1 and out_shape[d + lead] != 1]
    x = _replicate_dims(x, grow)
    out = _expanded(x._spec, tuple(out_shape), lead)
    return ShardTensor.from_spec(x._local.expand(out.local_shape), out)


@layout_rule
def _expanded(spec: ShardSpec, out_shape: tuple, lead: int) -> ShardSpec:
    pl = [Shard(p.dim + lead) if isinstance(p, Shard) else p for p in spec.placements]
    return _spec(spec, pl, out_shape, spec.sizes)


@register_aten(aten.slice.Tensor)
def slice_(func, args, kwargs):
    """``x[a:b:c]`` along any dim; along a sharded dim each rank keeps its part of the selection
    (new, possibly uneven sizes; no communication)."""
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.ndim
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    spec = x._spec
    n = spec.shape[dim]
    start, end, step = shapes.normalize_slice(n, start, end, step)
    out, local_slice = _sliced(spec, dim, start, end, step)
    local = x._local[(slice(None),) * dim + (local_slice,)]
    m = spec.mesh_dim_of(dim)
    if m is not None:
        _remember(out, (dim, start, end, step, n), spec.sizes[m])
    return ShardTensor.from_spec(local, out)


@layout_rule
def _sliced(spec: ShardSpec, dim: int, start: int, end: int, step: int):
    """(the layout of ``x[start:end:step]`` along ``dim``, this rank's slice of its chunk): along a sharded dim
    each rank keeps its part of the selection."""
    m = spec.mesh_dim_of(dim)
    shape = list(spec.shape)
    shape[dim] = len(range(start, end, step))
    if m is None:
        return _spec(spec, spec.placements, shape, spec.sizes), slice(start, end, step)
    counts, starts = shapes.slice_sizes(spec.sizes[m], start, end, step)
    k = spec.coord[m]
    sz = list(spec.sizes)
    sz[m] = counts
    lo = starts[k]
    return _spec(spec, spec.placements, shape, sz), slice(lo, lo + (counts[k] - 1) * step + 1 if counts[k] else lo, step)


@register_aten(aten.select.int)
def select(func, args, kwargs):
    """``x.select(dim, i)``: local on an unsharded dim; on a sharded dim its owner broadcasts the slice
    (a replicated result). The owner's chunk stays a view of ``x``, so ``x[i] = v`` writes into ``x``;
    the other ranks hold copies, so a later in-place change to ``x`` shows only on the owner's view."""
    x, dim, index = args[0], args[1] % args[0].ndim, args[2]
    spec = x._spec
    n = spec.shape[dim]
    if not -n <= index < n:
        raise IndexError(f"index {index} is out of bounds for dim {dim} with size {n}")
    index %= n
    out, m, offs = _selected(spec, dim)
    if m is None:
        return ShardTensor.from_spec(x._local.select(dim, index), out)
    _remember(out, ("select", dim, index, n), (m, spec.sizes[m]))
    sizes = spec.sizes[m]
    owner = max(k for k in range(len(offs)) if offs[k] <= index and sizes[k] > 0)
    if spec.coord[m] == owner:
        # the owner keeps a true view, so `x[i] = v` (select, then an in-place write) lands in x
        view = x._local.select(dim, index - offs[owner])
        comm.broadcast(view.contiguous(), owner, spec.mesh, m)
        return ShardTensor.from_spec(view, out)
    return ShardTensor.from_spec(comm.broadcast(x._local.new_empty(out.local_shape), owner, spec.mesh, m), out)


@layout_rule
def _selected(spec: ShardSpec, dim: int):
    """(the layout of ``x.select(dim, i)``, the mesh dim sharding ``dim`` or None, that mesh dim's rank
    offsets): replicated over that mesh dim. Not keyed on the index: ``unbind`` selects every one."""
    m = spec.mesh_dim_of(dim)
    keep = [d for d in range(spec.ndim) if d != dim]
    pos = {d: i for i, d in enumerate(keep)}
    shape = [spec.shape[d] for d in keep]
    if m is None:
        pl = [Shard(pos[p.dim]) if isinstance(p, Shard) else p for p in spec.placements]
        return _spec(spec, pl, shape, spec.sizes), None, None
    pl = [_R if mm == m else (Shard(pos[p.dim]) if isinstance(p, Shard) else p) for mm, p in enumerate(spec.placements)]
    sz = [None if mm == m else s for mm, s in enumerate(spec.sizes)]
    return _spec(spec, pl, shape, sz), m, tuple(shapes.offsets(spec.sizes[m]))


@register_aten(aten.split.Tensor, aten.split_with_sizes.default)
def split(func, args, kwargs):
    x = args[0]
    arg = args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    n = x.shape[dim]
    if func is aten.split.Tensor:
        lens = [min(arg, n - i) for i in range(0, n, arg)] if n else [0]
    else:
        lens = list(arg)
    out, start = [], 0
    for ln in lens:
        out.append(slice_(aten.slice.Tensor, (x, dim, start, start + ln, 1), {}))
        start += ln
    return out


@register_aten(aten.unbind.int)
def unbind(func, args, kwargs):
    x = args[0]
    dim = (args[1] if len(args) > 1 else 0) % x.ndim
    return [select(aten.select.int, (x, dim, i), {}) for i in range(x.shape[dim])]


@register_aten(aten.as_strided.default, aten.unfold.default)
def strided(func, args, kwargs):
    x = args[0]
    if x._spec.is_replicated:
        out = func(x._local, *args[1:], **kwargs)
        return ShardTensor.from_spec(out, _spec(x._spec, x._spec.placements, out.shape, x._spec.sizes))
    return unsupported_or_fallback(func, args, kwargs, f"{func} reinterprets memory, which a sharded tensor "
                                    f"does not have as one block")


# --------------------------------------------------------------------------------------------
# backward of slicing: put the gradient rows back where the forward input had them
# --------------------------------------------------------------------------------------------
# Forward slices remember (output layout -> input sizes) so their backward restores the input's
# exact layout without communication; a bounded memo, like the dispatcher's plan cache.
_slice_origin = Memo(4096, "slice origins")


def _remember(out: ShardSpec, key, sizes) -> None:
    _slice_origin.put((out, key), sizes)


def _cover_sizes(counts, start, step, n):
    """A partition of ``n`` input rows in which each rank owns the rows its slice rows came from."""
    firsts, cum = [], 0
    for c in counts:
        firsts.append(start + cum * step if c else None)
        cum += c
    bounds, nonempty = [], [k for k, c in enumerate(counts) if c]
    if not nonempty:
        return (n,) + (0,) * (len(counts) - 1)
    lo = [0] * len(counts)
    for j, k in enumerate(nonempty):
        lo[k] = 0 if j == 0 else firsts[k]
    sizes = [0] * len(counts)
    for j, k in enumerate(nonempty):
        hi = n if j == len(nonempty) - 1 else lo[nonempty[j + 1]]
        sizes[k] = hi - lo[k]
    del bounds
    return tuple(sizes)


@register_aten(aten.slice_backward.default)
def slice_backward(func, args, kwargs):
    grad, input_sizes, dim, start, end, step = args
    spec = grad._spec
    dim %= len(input_sizes)
    n = input_sizes[dim]
    start, end, step = shapes.normalize_slice(n, start, end, step)
    m = spec.mesh_dim_of(dim)
    origin = None if m is None else _slice_origin.get((spec, (dim, start, end, step, n)))
    out, rows = _slice_grad_layout(spec, tuple(input_sizes), dim, start, end, step, origin)
    if m is None:
        return ShardTensor.from_spec(func(grad._local, out.local_shape, dim, start, end, step), out)
    local = grad._local.new_zeros(out.local_shape)
    if rows is not None:
        local[(slice(None),) * dim + (rows,)] = grad._local
    return ShardTensor.from_spec(local, out)


@layout_rule
def _slice_grad_layout(spec: ShardSpec, input_sizes: tuple, dim: int, start: int, end: int, step: int, origin):
    """(the layout of a slice's input gradient, this rank's rows of it the slice's gradient fills or None):
    along a sharded dim the forward input's sizes when remembered (``origin``), else a cover of the rows."""
    m = spec.mesh_dim_of(dim)
    if m is None:
        return _spec(spec, spec.placements, input_sizes, spec.sizes), None
    in_sizes = origin
    if in_sizes is None or shapes.slice_sizes(in_sizes, start, end, step)[0] != spec.sizes[m]:
        in_sizes = _cover_sizes(spec.sizes[m], start, step, input_sizes[dim])
    sz = list(spec.sizes)
    sz[m] = in_sizes
    k = spec.coord[m]
    counts, local_starts = shapes.slice_sizes(in_sizes, start, end, step)
    lo = local_starts[k]
    rows = slice(lo, lo + (counts[k] - 1) * step + 1, step) if counts[k] else None
    return _spec(spec, spec.placements, input_sizes, sz), rows


@register_aten(aten.select_backward.default)
def select_backward(func, args, kwargs):
    grad, input_sizes, dim, index = args
    spec = grad._spec
    dim %= len(input_sizes)
    n = input_sizes[dim]
    index %= n
    origin = _slice_origin.get((spec, ("select", dim, index, n)))
    out, rows = _select_grad_layout(spec, tuple(input_sizes), dim, origin)
    if origin is None:  # the forward did not cut a sharded dim: insert the dim locally
        return ShardTensor.from_spec(func(grad._local, out.local_shape, dim, index), out)
    local = grad._local.new_zeros(out.local_shape)
    lo, count = rows
    if lo <= index < lo + count:
        local.select(dim, index - lo).copy_(grad._local)
    return ShardTensor.from_spec(local, out)


@layout_rule
def _select_grad_layout(spec: ShardSpec, input_sizes: tuple, dim: int, origin):
    """(the layout of a select's input gradient, (the first row this rank holds of ``dim``, how many) or None):
    ``origin`` (the mesh dim and sizes the forward cut along ``dim``) shards ``dim`` again. Not keyed on
    the index, as ``_selected``."""
    if origin is None:
        pl = [Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in spec.placements]
        return _spec(spec, pl, input_sizes, spec.sizes), None
    m, in_sizes = origin
    pl = [Shard(dim) if mm == m else (Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p)
          for mm, p in enumerate(spec.placements)]
    sz = [in_sizes if mm == m else s for mm, s in enumerate(spec.sizes)]
    k = spec.coord[m]
    return _spec(spec, pl, input_sizes, sz), (sum(in_sizes[:k]), in_sizes[k])


_OUT_OF_PLACE = {
    aten.squeeze_.default: aten.squeeze.default, aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims, aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.t_.default: aten.t.default, aten.transpose_.default: aten.transpose.int,
}


@register_aten(*_OUT_OF_PLACE)
def inplace_view(func, args, kwargs):
    """``x.squeeze_(1)`` and friends: the out-of-place view gives the new layout; the wrapper's own
    shape is then updated in place (as torch does for wrapper subclasses)."""
    from torch.utils._python_dispatch import return_and_correct_aliasing

    from domainflow.dispatch.toolkit import relayout

    x = args[0]
    out_of_place = _OUT_OF_PLACE[func]
    res = REGISTRY.aten[out_of_place](out_of_place, args, kwargs)
    relayout(x, res._local, res._spec)
    return return_and_correct_aliasing(func, args, kwargs, x)


@register_aten(aten.as_strided_.default, aten.resize_.default)
def inplace_restride(func, args, kwargs):
    raise UnsupportedShardedOp(func, "a sharded tensor has no single block of memory to re-stride or resize; "
                               "build a new ShardTensor instead")
