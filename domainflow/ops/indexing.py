"""Gathers and scatters by global index along a sharded dim: ``index_select``, ``x[idx]``, ``gather``,
``index_add``, ``index_reduce``, ``scatter_add`` and ``scatter_reduce``.

This is the message-passing step of point-cloud and mesh models: neighbour features are gathered by
global row number (``x[nbr]``), messages are summed / averaged / maxed onto their destination rows
(``index_add``, ``scatter_reduce``) across shard boundaries. No rank ever holds the full source: each
asks the owners for exactly the distinct rows it needs (``comm.index_plan``: one small all-to-all of
counts and row ids), the rows come back in one all-to-all, and the backward sends gradients to their
owners the same way. Scatters send each message to its destination's owner, which applies torch's own
op, so ties in max/min and the counts in mean follow single-device semantics exactly.

Layouts. The indexed tensor is sharded on the indexed dim (other mesh dims may shard other dims). The
index (and a scatter's source) is either sharded on its own first dim along the same mesh dim, with its
own sizes (the output follows the index: uneven sizes come from the queries, not the source), or
replicated (every rank asks for the same rows; a replicated output). Indexing an unsharded dim keeps
the local rule in ``dimwise``.
"""

from __future__ import annotations

import math

import torch

from domainflow import comm
from domainflow.dispatch.toolkit import Schema, into_plain, run_function_default, unsupported_or_fallback
from domainflow.errors import ShardingMismatchError
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.dispatch.registry import register_function
from domainflow.tensor.shard_tensor import ShardTensor, distribute_tensor
from domainflow.dispatch.toolkit import params_for, spec_from_sizes, without_partial


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------
def _index_layout(index, x_spec, m: int, index_dim: int, what: str):
    """``(index, replicated)``: the index as a ShardTensor sharded on ``index_dim`` along mesh dim ``m`` (and
    replicated on the others). A replicated (or plain) index is cut into chunks here, so every request is
    made by one rank only; the caller re-replicates the result (an all-gather whose backward keeps each
    rank's chunk, so a replicated output's gradient is counted once). Raises naming ``what`` when the
    index is laid out some other way."""
    if not isinstance(index, ShardTensor) or index._spec.is_replicated:
        return _chunked(index, x_spec.mesh, m, index_dim), True
    spec = index._spec
    if spec.has_partial:
        raise ShardingMismatchError(f"{what}: the index is a pending sum (Partial); indices must be whole numbers "
                                    f"on every rank")
    for k, p in enumerate(spec.placements):
        if k == m:
            if isinstance(p, Shard) and p.dim != index_dim:
                raise ShardingMismatchError(
                    f"{what}: the index is sharded on its dim {p.dim} along mesh dim {k}; shard it on dim "
                    f"{index_dim} (one index row per query row) or replicate it")
        elif isinstance(p, Shard):
            raise ShardingMismatchError(
                f"{what}: the index is sharded over mesh dim {k}, which is not the indexed dim's mesh dim {m}; "
                f"replicate the index there")
    if not isinstance(spec.placements[m], Shard):
        raise ShardingMismatchError(f"{what}: the index is sharded, but not over the indexed dim's mesh dim {m}; "
                                    f"shard it on its dim {index_dim} over mesh dim {m}, or replicate it")
    return index, False


def _chunked(t, mesh, m: int, dim: int) -> ShardTensor:
    """A replicated (or plain) tensor cut into chunks along ``dim`` over mesh dim ``m`` (no communication;
    differentiable: the gradient of the whole tensor is gathered back on every rank)."""
    placements = [Replicate()] * mesh.ndim
    placements[m] = Shard(dim % max(t.ndim, 1))
    if isinstance(t, ShardTensor):
        return t.redistribute(placements)
    return distribute_tensor(t, mesh, placements)


def _rereplicate(out: ShardTensor, m: int) -> ShardTensor:
    placements = list(out.placements)
    placements[m] = Replicate()
    return out.redistribute(placements)


def _wrap(out_local, x_spec, m: int, dim: int, index_sizes, shift: int = 0) -> ShardTensor:
    """The result of indexing ``x`` (layout ``x_spec``) along ``dim`` sharded over mesh dim ``m``: that mesh
    dim follows the index (sharded with its sizes, or replicated); the others keep x's layout (their dims
    shifted by ``shift`` when the index adds dims before them)."""
    placements, mapping = [], {}
    for k, p in enumerate(x_spec.placements):
        if k == m:
            placements.append(Shard(dim) if index_sizes is not None else Replicate())
            if index_sizes is not None:
                mapping[k] = list(index_sizes)
        elif isinstance(p, Shard):
            placements.append(Shard(p.dim + shift if p.dim > dim else p.dim))
            mapping[k] = list(x_spec.sizes[k])
        else:
            placements.append(p)
    return ShardTensor.from_spec(out_local, spec_from_sizes(out_local.shape, x_spec.mesh, placements, mapping))


def _plan(index_local, x_spec, m: int, what: str, dedupe: bool = True, cache_on=None) -> comm.IndexPlan:
    """The exchange plan for ``index_local``; cached on the index ShardTensor ``cache_on`` (a message-passing
    network reuses one neighbour index in every layer; every rank holds the same objects, so every rank
    hits or misses the cache together and no collective is skipped on one rank only)."""
    comm.refuse_compiling(f"{what} (a gather by global row index)")
    key = (id(x_spec.mesh), m, tuple(x_spec.sizes[m]), dedupe)
    if cache_on is not None:
        cache = cache_on.__dict__.setdefault("_index_plans", {})
        hit = cache.get(key)
        if hit is not None and hit[0] == index_local._version:
            return hit[1]
    plan = comm.index_plan(index_local, x_spec.sizes[m], x_spec.mesh, m, dedupe=dedupe, what=what)
    if cache_on is not None:
        cache[key] = (index_local._version, plan)
    return plan


def _sharded_dim(x, dim):
    """(x without pending sums, dim, mesh dim) when ``x`` is a ShardTensor sharded on ``dim``, else None."""
    if not isinstance(x, ShardTensor):
        return None
    d = dim % x.ndim
    if x._spec.mesh_dim_of(d) is None:
        return None
    x = without_partial(x)
    return x, d, x._spec.mesh_dim_of(d)


def _is_long(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.long, torch.int, torch.int16, torch.int8,
                                                               torch.uint8)


# --------------------------------------------------------------------------------------------
# gathers
# --------------------------------------------------------------------------------------------
def _fetch_rows(local_rows: torch.Tensor, index: ShardTensor, x_spec, m, what, index_local=None):
    """``source[index]`` along dim 0 of ``local_rows`` (this rank's rows of a sharded source)."""
    idx = index._local if index_local is None else index_local
    plan = _plan(idx.reshape(-1), x_spec, m, what, cache_on=index if index_local is None else None)
    return comm.gather_indexed(local_rows, plan).reshape(*idx.shape, *local_rows.shape[1:])


_INDEX_SELECT_ARGS = Schema("self", "dim", "index")


def _index_select(func, args, kwargs):
    a = _INDEX_SELECT_ARGS.bind(args, kwargs)
    hit = _sharded_dim(a["self"], a["dim"])
    if hit is None:
        return _replicated_source(func, args, kwargs, a["self"], a["index"], a["dim"])
    x, d, m = hit
    what = f"index_select along dim {d}"
    if a["index"].ndim > 1:
        raise IndexError(f"{what}: index must be 1-D, got shape {tuple(a['index'].shape)}")
    index, replicated = _index_layout(a["index"], x._spec, m, 0, what)
    local = x.to_local().movedim(d, 0)
    out = _fetch_rows(local, index, x._spec, m, what)
    out = _wrap(out.movedim(0, d), x._spec, m, d, index._spec.sizes[m])
    return _rereplicate(out, m) if replicated else out


def _getitem(func, args, kwargs):
    x, key = args[0], args[1]
    if isinstance(key, tuple) and len(key) == 1:
        key = key[0]
    if not _is_long(key) or key.dtype == torch.uint8:
        return run_function_default(func, args, kwargs)
    hit = _sharded_dim(x, 0)
    if hit is None:
        return _replicated_source(func, args, kwargs, x, key, 0)
    x, _, m = hit
    what = "x[index] along dim 0"
    index, replicated = _index_layout(key, x._spec, m, 0, what)
    out = _fetch_rows(x.to_local(), index, x._spec, m, what)
    out = _wrap(out, x._spec, m, 0, index._spec.sizes[m], shift=max(index.ndim - 1, 0))
    return _rereplicate(out, m) if replicated else out


def _replicated_source(func, args, kwargs, x, index, dim):
    """A replicated (or plain) source indexed by an index sharded on its first dim: a local lookup whose
    result is sharded like the index (an embedding-table lookup); the source's gradient is summed over
    the index's mesh dims."""
    if not isinstance(index, ShardTensor) or isinstance(x, ShardTensor) and not x._spec.is_replicated:
        return run_function_default(func, args, kwargs)
    spec = index._spec
    if spec.has_partial or any(isinstance(p, Shard) and p.dim != 0 for p in spec.placements):
        return run_function_default(func, args, kwargs)
    if isinstance(x, ShardTensor):
        x = x.to_local()
    mesh_dims = [k for k, p in enumerate(spec.placements) if isinstance(p, Shard)]
    (x,) = params_for(spec.mesh, mesh_dims, x)
    d = dim % x.ndim
    idx = index._local
    out = x.index_select(d, idx) if func is not _GETITEM else x[idx]
    if func is not _GETITEM and d != 0:
        # x.index_select(d, sharded index) is sharded on dim d
        placements = [Shard(d) if isinstance(p, Shard) else p for p in spec.placements]
    else:
        placements = list(spec.placements)
    mapping = {k: list(spec.sizes[k]) for k in mesh_dims}
    return ShardTensor.from_spec(out, spec_from_sizes(out.shape, spec.mesh, placements, mapping))


_GATHER_ARGS = Schema("self", "dim", "index", "sparse_grad", sparse_grad=False)


def _gather(func, args, kwargs):
    a = _GATHER_ARGS.bind(args, kwargs)
    hit = _sharded_dim(a["self"], a["dim"])
    if hit is None:
        return run_function_default(func, args, kwargs)
    x, d, m = hit
    what = f"gather along dim {d}"
    _only_sharded_on(x._spec, m, what)
    index, replicated = _index_layout(a["index"], x._spec, m, d, what)
    local = x.to_local().movedim(d, 0)
    idx = index._local.movedim(d, 0)
    rows = _uniform_rows(idx)
    if rows is not None:  # the same row for every element of an index row: fetch whole rows
        got = _fetch_rows(local, index, x._spec, m, what, rows)
        out = got[(slice(None), *(slice(0, n) for n in idx.shape[1:]))]
    else:  # element by element, through the flattened source
        flat, flat_spec = _flatten(local, x._spec, m)
        out = _fetch_rows(flat, index, flat_spec, m, what, _flat_index(idx, local)).reshape(idx.shape)
    out = _wrap(out.movedim(0, d), x._spec, m, d, index._spec.sizes[m])
    return _rereplicate(out, m) if replicated else out


def _uniform_rows(idx: torch.Tensor):
    """The per-row index when ``idx`` (index dim first) is expanded along its other dims (stride 0, as
    ``nbr[:, None].expand(-1, C)`` makes it), else None. Decided from strides only, never from values:
    every rank must take the same path, since the paths communicate differently."""
    if idx.ndim == 1:
        return idx
    if all(s == 0 for s in idx.stride()[1:]):
        return idx[(slice(None), *([0] * (idx.ndim - 1)))]
    return None


def _flatten(local: torch.Tensor, spec, m: int):
    """This rank's rows flattened to single elements, and a layout whose sizes along ``m`` count elements."""
    per_row = math.prod(local.shape[1:])
    sizes = list(spec.sizes)
    sizes[m] = tuple(s * per_row for s in spec.sizes[m])
    return local.contiguous().reshape(-1), spec.with_(sizes=tuple(sizes))


def _flat_index(idx: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Global element numbers of ``source[idx[i, j...], j...]`` in the flattened (rows, rest) source."""
    rest = local.shape[1:]
    strides = torch.ones(len(rest), dtype=torch.long)
    for j in range(len(rest) - 2, -1, -1):
        strides[j] = strides[j + 1] * rest[j + 1]
    per_row = int(strides[0] * rest[0]) if rest else 1
    flat = idx.to(torch.long) * per_row
    for j in range(1, idx.ndim):
        shape = [1] * idx.ndim
        shape[j] = idx.shape[j]
        flat = flat + (torch.arange(idx.shape[j], device=idx.device) * int(strides[j - 1])).view(shape)
    return flat


def _only_sharded_on(spec, m: int, what: str) -> None:
    others = [k for k, p in enumerate(spec.placements) if k != m and isinstance(p, Shard)]
    if others:
        raise ShardingMismatchError(f"{what}: the source is also sharded over mesh dim(s) {others}; element-wise "
                                    f"gathers and scatters need it sharded on the indexed dim only. Redistribute "
                                    f"it (Replicate on those mesh dims) first")


# --------------------------------------------------------------------------------------------
# scatters
# --------------------------------------------------------------------------------------------
_GETITEM = torch.Tensor.__getitem__
_REDUCES = ("sum", "prod", "mean", "amax", "amin")


def _scatter(kind: str):
    """Handler for one scatter family: ``index`` (index_add / index_reduce: a 1-D row index) or
    ``elementwise`` (scatter_add / scatter_reduce: an index shaped like the source)."""
    names = {
        "index_add": ("self", "dim", "index", "source", "alpha"),
        "index_reduce": ("self", "dim", "index", "source", "reduce", "include_self"),
        "scatter_add": ("self", "dim", "index", "src"),
        "scatter_reduce": ("self", "dim", "index", "src", "reduce", "include_self"),
    }[kind]
    schema = Schema(*names, alpha=1, include_self=True, reduce="sum")

    def handler(func, args, kwargs):
        a = schema.bind(args, kwargs)
        a.pop("out", None)
        src = a.get("source", a.get("src"))
        x, dim, index = a["self"], a["dim"], a["index"]
        inplace = getattr(func, "__name__", "").endswith("_")
        reduce = a["reduce"]
        if reduce not in _REDUCES:
            return run_function_default(func, args, kwargs)
        hit = _sharded_dim(x, dim)
        if hit is None:
            if inplace and not isinstance(x, ShardTensor):
                if reduce == "sum" and a["include_self"]:
                    partial = _scatter_to_replicated(kind, a, src)
                    if partial is not None:
                        return _summed_into_plain(x, partial)
                return into_plain(func, args, kwargs, x, "; only sums of messages go into a plain destination",
                                  whole=ShardTensor.full_tensor)
            partial = _scatter_to_replicated(kind, a, src)
            if partial is None:
                return run_function_default(func, args, kwargs)
            return _finish(func, x, partial, inplace)
        x, d, m = hit
        what = f"{kind} along dim {d}"
        spec = x._spec
        index, replicated = _index_layout(index, spec, m, 0 if kind.startswith("index") else d, what)
        index_l = index._local
        src_dim = d if kind.startswith("scatter") else dim % src.ndim
        src_l = _source_local(src, spec, m, src_dim, index._spec.sizes[m], replicated, what)
        if kind == "index_add" and a["alpha"] != 1:
            src_l = src_l * a["alpha"]
        local = x.to_local().movedim(d, 0)
        dest_dim = d if kind.startswith("scatter") else dim % max(src_l.ndim, 1)
        src_m = src_l.movedim(dest_dim, 0) if src_l.ndim else src_l.reshape(1)
        if kind.startswith("index"):
            out = _scatter_rows(local, index_l.reshape(-1), src_m, spec, m, kind, reduce, a["include_self"], what)
        else:
            _only_sharded_on(spec, m, what)
            idx = index_l.movedim(d, 0)
            src_m = src_m[tuple(slice(0, n) for n in idx.shape)]
            rows = _uniform_rows(idx)
            if rows is not None:
                out = _scatter_rows(local, rows, src_m, spec, m, kind, reduce, a["include_self"], what)
            else:
                flat, flat_spec = _flatten(local, spec, m)
                got = _scatter_rows(flat, _flat_index(idx, local).reshape(-1), src_m.reshape(-1), flat_spec, m,
                                    "index_reduce", reduce, a["include_self"], what)
                out = got.reshape(local.shape)
        out = out.movedim(0, d)
        return _finish(func, a["self"], ShardTensor.from_spec(out, spec_from_sizes(
            out.shape, spec.mesh, list(spec.placements),
            {k: list(s) for k, s in enumerate(spec.sizes) if s is not None})), inplace)
    return handler


def _source_local(src, spec, m: int, src_dim: int, index_sizes, replicated: bool, what: str) -> torch.Tensor:
    """This rank's messages: the source laid out like its index (sharded on its indexed dim with the
    index's sizes, or replicated when the index is, then cut into the same chunks)."""
    src_sharded = isinstance(src, ShardTensor) and not src._spec.is_replicated
    if replicated:
        if src_sharded:
            raise ShardingMismatchError(f"{what}: the source is sharded but the index is replicated; shard the index "
                                        f"like the source")
        return _chunked(src, spec.mesh, m, src_dim).to_local()
    if not src_sharded:
        raise ShardingMismatchError(f"{what}: the index is sharded but the source is not; shard the source like the "
                                    f"index (one source row per index entry)")
    src = without_partial(src)
    p = src._spec.placements[m]
    if not (isinstance(p, Shard) and p.dim == src_dim) or list(src._spec.sizes[m]) != list(index_sizes):
        raise ShardingMismatchError(
            f"{what}: the source must be sharded on its dim {src_dim} with the index's sizes {list(index_sizes)} "
            f"along mesh dim {m}; it is {p} with sizes {src._spec.sizes[m]}")
    return src.to_local()


def _scatter_rows(local, rows, src, spec, m, kind, reduce, include_self, what):
    """``local`` (this rank's destination rows) after the messages ``src[i]`` of every rank reached global
    row ``rows[i]``: sums travel pre-summed per destination row, other reductions one message at a time so
    the owner's torch op sees exactly the single-device operands."""
    dedupe = kind in ("index_add", "scatter_add") or (reduce == "sum" and include_self)
    plan = comm.index_plan(rows.reshape(-1), spec.sizes[m], spec.mesh, m, dedupe=dedupe, what=what)
    got = comm.route_to_owners(src, plan)
    dest, whole_rows = plan.serve_rows, got.shape[1:] == local.shape[1:]
    if dedupe and whole_rows:
        return local.index_add(0, dest, got)
    if kind == "index_reduce" and reduce != "sum" and whole_rows:
        return local.index_reduce(0, dest, got, reduce, include_self=include_self)
    expanded = dest.view(-1, *[1] * (got.ndim - 1)).expand(got.shape)
    return local.scatter_reduce(0, expanded, got, reduce, include_self=include_self)


def _scatter_to_replicated(kind, a, src):
    """A replicated (or plain) destination receiving a sharded source's messages: with sums, a pending sum
    (``Partial``) whose local value is this rank's messages (plus the destination on coordinate 0); other
    reductions are refused with the fix."""
    x, index = a["self"], a["index"]
    shards = [t for t in (index, src) if isinstance(t, ShardTensor) and not t._spec.is_replicated]
    if not shards or isinstance(x, ShardTensor) and not x._spec.is_replicated:
        return None
    if isinstance(src, ShardTensor) and src._spec.has_partial:
        src = without_partial(src)
    _check_messages(kind, index, src, a["dim"])
    spec = next(t for t in (index, src) if isinstance(t, ShardTensor))._spec
    mesh_dims = [k for k, p in enumerate(spec.placements) if isinstance(p, Shard)]
    if not (a["reduce"] == "sum" and a["include_self"]):
        raise ShardingMismatchError(
            f"{kind} with reduce={a['reduce']!r}, include_self={a['include_self']} into a replicated destination "
            f"from a sharded source: only sums can stay pending across ranks. Make the destination sharded (e.g. "
            f"torch.zeros_like of a sharded tensor) or reduce with 'sum' and divide by counts")
    local_x = x.to_local() if isinstance(x, ShardTensor) else x
    (local_x,) = params_for(spec.mesh, mesh_dims, local_x)
    coord = spec.coord
    if any(coord[k] for k in mesh_dims):
        # the destination's values count once (coordinate 0's); zeros here, still in the graph, so that the
        # gradient hook params_for put on it runs on every rank (its all-reduce pairs with coordinate 0's)
        local_x = torch.where(torch.zeros((), dtype=torch.bool, device=local_x.device), local_x, 0)
    index_l = index._local if isinstance(index, ShardTensor) else index
    src_l = src.to_local() if isinstance(src, ShardTensor) else src
    if kind == "index_add":
        out = local_x.index_add(a["dim"], index_l, src_l, alpha=a["alpha"])
    elif kind == "index_reduce":
        out = local_x.index_reduce(a["dim"], index_l, src_l, "sum", include_self=True)
    else:
        out = local_x.scatter_add(a["dim"], index_l, src_l)
    placements = [Partial("sum") if k in mesh_dims else Replicate() for k in range(spec.mesh.ndim)]
    return ShardTensor.from_spec(out, spec_from_sizes(out.shape, spec.mesh, placements, {}))


def _check_messages(kind: str, index, src, dim: int) -> None:
    """Messages into a replicated (or plain) destination: index and source sharded alike, only along the
    dim that pairs index entries with source rows (index dim 0 with the source's ``dim`` for index_add /
    index_reduce, ``dim`` of both for scatters), with the same sizes. Raises naming the fix otherwise (decided
    from layouts: every rank alike, before any work; a mismatch would otherwise fail on some ranks only)."""
    what = f"{kind} into a replicated or plain destination"
    idx = index._spec if isinstance(index, ShardTensor) else None
    sp = src._spec if isinstance(src, ShardTensor) else None
    if idx is not None and idx.has_partial:
        raise ShardingMismatchError(f"{what}: the index is a pending sum (Partial); indices must be whole numbers on "
                                    f"every rank")
    idx_dim = 0 if kind.startswith("index") else dim % max(index.ndim, 1)
    src_dim = dim % max(src.ndim, 1)
    for m in range((idx if idx is not None else sp).mesh.ndim):
        pi = idx.placements[m] if idx is not None else None
        ps = sp.placements[m] if sp is not None else None
        if not isinstance(pi, Shard) and not isinstance(ps, Shard):
            continue
        if not (isinstance(pi, Shard) and isinstance(ps, Shard) and pi.dim == idx_dim and ps.dim == src_dim
                and idx.sizes[m] == sp.sizes[m]):
            raise ShardingMismatchError(
                f"{what}: over mesh dim {m} the index is {_placed(pi, idx, m)} and the source {_placed(ps, sp, m)}; "
                f"shard both alike, the index on dim {idx_dim} and the source on dim {src_dim} with the same sizes "
                f"(one index entry per source row), or neither")


def _placed(p, spec, m: int) -> str:
    if isinstance(p, Shard):
        return f"{p} in sizes {list(spec.sizes[m])}"
    return "plain" if p is None else str(p)


def _summed_into_plain(x: torch.Tensor, partial: ShardTensor) -> torch.Tensor:
    """Messages summed into a plain destination every rank holds whole (graph networks' aggregation,
    ``torch.zeros(N, C).scatter_add_(0, index, messages)`` in torch_scatter, PyG and PhysicsNeMo): the pending sum
    of every rank's messages (plus the destination's values) all-reduced, written into it; exact, and the
    messages' gradient flows back through the all-reduce. The destination stays plain, whole on every rank."""
    whole = partial.full_tensor()
    x.copy_(whole)
    return x


def _finish(func, x, out, inplace):
    if inplace:  # x is a ShardTensor here: the handler sends a plain destination to into_plain
        x.copy_(out) if x._spec == out._spec else x.copy_(out.redistribute(x.placements))
        return x
    return out


# --------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------
for _f in (torch.index_select, torch.Tensor.index_select):
    register_function(_f)(_index_select)
register_function(_GETITEM)(_getitem)
for _f in (torch.gather, torch.Tensor.gather):
    register_function(_f)(_gather)
for _name, _fs in {
    "index_add": (torch.index_add, torch.Tensor.index_add, torch.Tensor.index_add_),
    "index_reduce": (torch.index_reduce, torch.Tensor.index_reduce, torch.Tensor.index_reduce_),
    "scatter_add": (torch.scatter_add, torch.Tensor.scatter_add, torch.Tensor.scatter_add_),
    "scatter_reduce": (torch.scatter_reduce, torch.Tensor.scatter_reduce, torch.Tensor.scatter_reduce_),
}.items():
    for _f in _fs:
        register_function(_f)(_scatter(_name))


_EMBEDDING_ARGS = Schema("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse",
                         padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)


def _embedding(func, args, kwargs):
    """A table sharded by rows (vocabulary-parallel, as Megatron's embedding) looked up with an index whole on
    every rank: each rank looks up the rows it holds, zeros for the others, and the result is a pending sum
    over the table's ranks; each rank's rows get their gradients locally."""
    a = _EMBEDDING_ARGS.bind(args, kwargs)
    ids, weight = a["input"], a["weight"]
    if not isinstance(weight, ShardTensor) or isinstance(ids, ShardTensor):
        return run_function_default(func, args, kwargs)
    weight = without_partial(weight)
    spec = weight._spec
    sharded = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard)]
    if sharded != [spec.mesh_dim_of(0)] or sharded == [None]:
        return run_function_default(func, args, kwargs)
    if a["max_norm"] is not None or a["scale_grad_by_freq"] or a["sparse"]:
        return unsupported_or_fallback(func, args, kwargs, "max_norm, scale_grad_by_freq or sparse with the table's "
                                       "rows sharded")
    (m,) = sharded
    rows = spec.shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):  # ids are whole on every rank: all raise
        raise IndexError(f"F.embedding: ids must be in [0, {rows}), got {int(ids.min())}..{int(ids.max())}")
    lo, n = spec.offsets[0], spec.local_shape[0]
    table = weight.to_local()
    own = (ids >= lo) & (ids < lo + n)
    if n:
        pad = a["padding_idx"]
        pad = (pad % rows) - lo if pad is not None and lo <= pad % rows < lo + n else None
        found = torch.nn.functional.embedding(torch.where(own, ids - lo, 0), table, pad)
        out = torch.where(own.unsqueeze(-1), found, 0)  # (not a product: an inf in a looked-up row is no NaN)
    else:  # no rows here: zeros, still from the table (every rank's backward then runs)
        out = table.new_zeros((*ids.shape, table.shape[1])) + table.sum() * 0
    placements = [Partial("sum") if k == m else p for k, p in enumerate(spec.placements)]
    return ShardTensor.from_spec(out, spec_from_sizes(out.shape, spec.mesh, placements, {}))


register_function(torch.nn.functional.embedding)(_embedding)
