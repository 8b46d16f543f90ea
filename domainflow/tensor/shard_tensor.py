"""ShardTensor: a torch.Tensor subclass holding this rank's chunk of a domain-sharded tensor.

Design choice: ShardTensor *wraps DTensor's vocabulary* (DeviceMesh, Shard/Replicate/Partial) but does
not subclass DTensor. DTensor's sharding propagation, redistribution and ``full_tensor`` assume the
``torch.chunk`` layout; uneven domain shards (any per-rank size, zeros included, as a spatial
partition of a mesh produces) would break those assumptions in many places that a subclass inherits
silently (PhysicsNeMo moved away from subclassing DTensor for the same reason). Our own spec
(``ShardSpec``: placements + per-mesh-dim sizes) lets every layout rule be pure arithmetic, and our own
dispatcher keeps per-op overhead near DTensor's C++ fast path. ``to_dtensor``/``from_dtensor`` convert
where the layout is DTensor's (chunk sizes), for FSDP2 and DCP.
"""

from __future__ import annotations

import functools

import weakref
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from domainflow import comm
from domainflow.tensor import consistency
from domainflow.layout import shapes
from domainflow.errors import CompileUnsupportedError, ShardingMismatchError, ShardingShapeError
from domainflow.memo import PLANS
from domainflow.layout.placements import Partial, Placement, Replicate, Shard, normalize_placements
from domainflow.tensor.redistribute import grad_spec, partial_from_replicate, redistribute_local
from domainflow.layout.spec import ShardSpec, mapping_mesh_dim, mesh_coordinate, mesh_shape, sizes_from_mapping

_MAX_DIMS = 12
_ALL_REPLICATE = {n: (Replicate(),) * n for n in range(1, 9)}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def global_strides_like(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Global strides laid out in the same dim order as the local chunk's memory."""
    if local.is_contiguous() or len(shape) <= 1:
        return _strides_in_order(None, tuple(shape))
    return _strides_in_order(local.stride(), tuple(shape))


@functools.lru_cache(maxsize=4096)
def _strides_in_order(local_strides, shape) -> tuple[int, ...]:
    """Strides of ``shape`` with its dims in the memory order of ``local_strides`` (None: row-major);
    cached: transposed chunks of the same shapes recur every step."""
    nd = len(shape)
    if local_strides is None:
        order = range(nd - 1, -1, -1)
    else:
        order = sorted(range(nd), key=lambda d: (local_strides[d], d))  # innermost first
    out = [0] * nd
    acc = 1
    for d in order:
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


class ShardTensor(torch.Tensor):
    """This rank's chunk (``_local``) of a tensor laid out by ``_spec`` over a device mesh.

    Two public ways make one from a local chunk: :meth:`from_local` (mesh and placements, like DTensor's; it
    may communicate to learn every rank's shape) and :meth:`from_spec` (the whole :class:`ShardSpec` known;
    no communication: what op handlers and readers use). ``ShardTensor(local, spec)`` itself is the raw
    wrapper below autograd, for this module and the dispatch engine only.
    """

    _local: torch.Tensor
    _spec: ShardSpec
    __slots__ = ("_local", "_spec")

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec, requires_grad: bool = False):
        if local.is_conj() or local.is_neg():
            # torch's lazy conjugate and negative bits are read by a fallback above __torch_dispatch__, never
            # below it, where every op on chunks runs: a chunk carrying one would be read as its raw memory
            local = local.resolve_conj().resolve_neg()
        if local.is_contiguous():
            r = torch.Tensor._make_wrapper_subclass(cls, spec.shape, dtype=local.dtype, device=local.device,
                                                    requires_grad=requires_grad)
        else:
            r = torch.Tensor._make_wrapper_subclass(cls, spec.shape, strides=global_strides_like(local, spec.shape),
                                                    dtype=local.dtype, device=local.device, requires_grad=requires_grad)
        r._local = local
        r._spec = spec
        if requires_grad:
            keep_leaf_layout(r)
        return r

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return f"ShardTensor(local={self._local!r}, spec={self._spec!r})"

    # ----- dispatch (the engine in domainflow.dispatch is installed here; this layer never imports it) -----
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return (_engine or _load_engine()).torch_function(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return (_engine or _load_engine()).torch_dispatch(func, types, args, kwargs)

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """``Tensor.backward``; a pending sum (a loss that is ``Partial``) is reduced on the way, in the payload
        of the backward pass's first all-reduce, so afterwards its value is known on every rank with no
        collective of its own: ``loss.backward(); if rank == 0: print(loss.item())`` is safe."""
        riders = _ride_backward(self)
        try:
            super().backward(gradient, retain_graph, create_graph, inputs)
        except BaseException as e:
            comm.land(riders, drop=True)
            if isinstance(e, RuntimeError) and _PLAIN_TANGENT in str(e):
                raise _value_past_a_graph_break() from e
            raise
        comm.land(riders)

    # ----- torch.compile / serialization hooks ------------------------------------------------
    def __tensor_flatten__(self):
        return ["_local"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        # torch.compile fakes ShardTensor inputs through here: a trace not started by domainflow.compile
        # (which checks parameters and layouts across ranks before each call) is refused
        comm.refuse_unchecked_compile("a ShardTensor")
        return ShardTensor(inner["_local"], spec)

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        """torch.compile: a gradient arriving in another layout than the one AOTAutograd traced the compiled
        backward with (the gradient of a compiled output that is a pending sum arrives replicated): the same
        tensor in that layout (Replicate to Partial needs no communication; any other change redistributes,
        alike on every rank, which all get the same gradient layout)."""
        if expected_type is not None and expected_type is not ShardTensor:
            return None
        if not isinstance(expected_metadata, ShardSpec) or expected_metadata.shape != self._spec.shape:
            return None
        if expected_metadata == self._spec:
            return self
        return ShardTensor(redistribute_local(self._local, self._spec, expected_metadata), expected_metadata)

    def __reduce_ex__(self, proto):
        raise TypeError("a ShardTensor cannot be pickled; save .to_local() with its .sharding_shapes, "
                        "or use .to_dtensor() with torch.distributed.checkpoint")

    # ----- layout accessors -------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def spec(self) -> ShardSpec:
        return self._spec

    @property
    def sharding_shapes(self) -> dict[int, tuple[torch.Size, ...]]:
        """For each sharded mesh dim, the local shape of every rank along it."""
        return self._spec.sharding_shapes()

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global index of this rank's first element along each dim."""
        return self._spec.offsets

    # ----- conversions ------------------------------------------------------------------------
    @staticmethod
    def from_local(local: torch.Tensor, mesh: DeviceMesh, placements, sharding_shapes="infer",
                   shape: Sequence[int] | None = None) -> "ShardTensor":
        """Wrap each rank's ``local`` chunk, given the mesh and placements (DTensor's ``from_local``): the
        way for user code that knows its chunk but not every rank's sizes.

        ``sharding_shapes``: "infer" (one all-gather of shapes over the mesh; checks that ranks agree),
        "chunk" (``torch.chunk`` layout of ``shape``, or an even split when ``shape`` is None; no
        communication), or a mapping ``{mesh dim or name: [local shape or size of each rank]}``
        (no communication; each rank's word is checked against the others' later, with the next
        collective). Differentiable: gradients flow back to ``local``. With the whole layout already at
        hand (another ShardTensor's ``.spec``, a layout a handler derived), :meth:`from_spec` is cheaper.
        """
        if isinstance(local, ShardTensor):
            raise TypeError("from_local got a ShardTensor; pass its .to_local() or call .redistribute()")
        spec = _spec_for_local(local, mesh, normalize_placements(placements, local.ndim, mesh.ndim), sharding_shapes,
                               shape)
        if not isinstance(sharding_shapes, str) or sharding_shapes != "infer":
            consistency.record_layout(spec, "ShardTensor.from_local")  # each rank's word: checked later
        return _from_callers_local(local, spec)

    @staticmethod
    def from_spec(local: torch.Tensor, spec: ShardSpec) -> "ShardTensor":
        """``local`` as this rank's chunk of the tensor laid out by ``spec`` (its mesh, placements, global
        shape and every rank's sizes), whose local shape ``local.shape`` must be: no communication and
        nothing recorded or re-derived, so it costs what wrapping costs. The way for op handlers (a layout
        derived and cached, or an operand's ``.spec``) and readers (sizes from the store); user code that
        knows only mesh and placements calls :meth:`from_local`. Differentiable: gradients flow back to
        ``local`` (a chunk that needs them, wrapped under no_grad, becomes a constant)."""
        if isinstance(local, ShardTensor):
            raise TypeError("from_spec got a ShardTensor; pass its .to_local() or call .redistribute()")
        if local.shape != spec.local_shape:
            raise ShardingShapeError(f"rank {_rank()} local tensor has shape {tuple(local.shape)} but the layout "
                                     f"{spec} gives it {spec.local_shape}")
        return _from_local(local, spec)

    def to_local(self, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's chunk. Differentiable; ``grad_placements`` says how the local gradients combine
        (default: like the forward placements, with Partial gradients treated as Replicate)."""
        if not torch.is_grad_enabled() or not self.requires_grad:
            return self._local
        return _ToLocal.apply(self, grad_placements)

    def redistribute(self, placements, sharding_shapes=None) -> "ShardTensor":
        """Same global tensor, new layout. ``sharding_shapes``: None keeps the sizes of shards that stay
        on their mesh dim and tensor dim and uses chunk sizes for new shards; "chunk"; "balanced"; or
        a mapping ``{mesh dim: [size or shape per rank]}``. Differentiable (backward is the reverse)."""
        spec = self._spec
        key = None
        if sharding_shapes is None or isinstance(sharding_shapes, str):
            key = (_redistribute_targets, spec, tuple(placements) if not isinstance(placements, Placement)
                   else (placements,), sharding_shapes)
            dst = PLANS.get(key)
        else:
            dst = None
        if dst is None:
            placements = normalize_placements(placements, spec.ndim, spec.mesh.ndim)
            dst = target_spec(spec, placements, sharding_shapes)
            if key is not None:
                PLANS.put(key, dst)
        if dst == spec:
            return self
        if key is None:
            consistency.record_layout(dst, "redistribute(sharding_shapes=...)")
        if not (self.requires_grad and torch.is_grad_enabled()):
            return _redistribute_to(self, dst)  # no autograd node needed
        return _Redistribute.apply(self, dst)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank (uneven all-gather / all-reduce). Differentiable."""
        spec = self._spec
        if spec.is_replicated:
            return self.to_local()
        if not (torch.is_grad_enabled() and self.requires_grad):
            full = PLANS.cached((_full_specs, spec), lambda: target_spec(spec, _ALL_REPLICATE[spec.mesh.ndim]))
            return redistribute_local(self._local, spec, full)
        return self.redistribute(_ALL_REPLICATE[spec.mesh.ndim]).to_local()

    def to_dtensor(self):
        """A DTensor of the same data; needs DTensor's layout (chunk sizes on every Shard)."""
        from torch.distributed.tensor import DTensor

        spec = self._spec
        for m, p in enumerate(spec.placements):
            if isinstance(p, Shard) and spec.sizes[m] != shapes.chunk_sizes(spec.shape[p.dim], spec.mesh.shape[m]):
                raise ShardingShapeError(
                    f"to_dtensor needs DTensor's torch.chunk layout, but mesh dim {m} shards dim {p.dim} as "
                    f"{spec.sizes[m]}; call .redistribute(x.placements, sharding_shapes='chunk').to_dtensor()")
        return DTensor.from_local(self.to_local(), spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec_strides(spec))

    @staticmethod
    def from_dtensor(dt) -> "ShardTensor":
        """Wrap a DTensor's local chunk (DTensor layout: chunk sizes) without communication."""
        mesh, placements = dt.device_mesh, tuple(dt.placements)
        for p in placements:
            if type(p) not in (Shard, Replicate, Partial):
                raise ShardingShapeError(f"from_dtensor cannot represent placement {p!r}; redistribute the DTensor "
                                         f"to Shard/Replicate/Partial first")
        sizes = [shapes.chunk_sizes(dt.shape[p.dim], mesh.shape[m]) if isinstance(p, Shard) else None
                 for m, p in enumerate(placements)]
        spec = ShardSpec.build(mesh, placements, dt.shape, sizes)
        return _from_callers_local(dt.to_local(), spec)


class TensorMarks:
    """A set of live tensors by identity (a tensor's ``==`` is elementwise, so weak sets cannot hold them).
    Used instead of flags in a tensor's ``__dict__``, which ``copy.deepcopy`` copies to a tensor that lacks
    the hook the flag stands for (an EMA copy of a model would then never be hooked)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, t) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t

    def add(self, t) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, key=key, refs=self._refs: refs.pop(key, None))


_layout_hooked = TensorMarks()


# torch's words when a compiled graph's ShardTensor output gets no gradient (pytorch issue 172556)
_PLAIN_TANGENT = "Expected a ShardTensor tangent but got a plain Tensor"


def _value_past_a_graph_break():
    """The one-line error for torch's *Expected a ShardTensor tangent but got a plain Tensor*: domainflow.compile
    gives a call's own outputs left out of the loss their zero gradients, so what is left is a value a graph hands
    on to code past a graph break that uses it without a gradient."""
    return CompileUnsupportedError("a compiled value used without its gradient", (
        "a compiled model passed a value that needs a gradient across a graph break to code that used it without "
        "one (e.g. float(y.mean()) or y.item() in the forward), and torch cannot give a ShardTensor such a value "
        "a zero gradient (pytorch issue 172556): .detach() it where it is used, or keep that code in the graph"))


def keep_leaf_layout(leaf: ShardTensor) -> None:
    """Give a ShardTensor leaf that needs gradients a hook that lays its gradient out like the leaf (the same
    placements and per-rank sizes; a Partial leaf's gradient replicated), whatever layout backward produced:
    ``leaf.grad._local`` is then the gradient of ``leaf._local``, as shard-local optimisers expect. Once."""
    if leaf in _layout_hooked:
        return
    ref = weakref.ref(leaf)

    def hook(grad):
        t = ref()
        if t is None or not isinstance(grad, ShardTensor):
            return grad
        want = grad_spec(t._spec)
        if grad._spec == want:
            return grad
        if grad.requires_grad:  # create_graph=True: the relayout stays differentiable
            return _Redistribute.apply(grad, want)
        return ShardTensor(redistribute_local(grad._local, grad._spec, want), want)

    leaf.register_hook(hook)
    _layout_hooked.add(leaf)


_redistribute_targets = "redistribute targets"  # first parts of their keys in domainflow.memo.PLANS
_full_specs = "full specs"
_MAX_RIDER_NUMEL = 4096


def _ride_backward(x: ShardTensor) -> list:
    """Riders for a pending sum that ``x.backward()`` reduces on the way (see :func:`comm.ride_along`)."""
    spec = x._spec
    if not spec.has_partial or x._local.numel() > _MAX_RIDER_NUMEL or not x._local.is_floating_point():
        return []
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in spec.placements):
        return []
    dims = [m for m, p in enumerate(spec.placements) if isinstance(p, Partial)]
    done_spec = spec.reduced()

    def resolved(value, x=x, done_spec=done_spec):
        # the same global value, now held whole on every rank: later .item() / full_tensor() need no collective
        x._local, x._spec = value.to(x._local.dtype), done_spec

    return [comm.ride_along(x._local, spec.mesh, dims, resolved)]


def spec_strides(spec: ShardSpec) -> tuple[int, ...]:
    """Contiguous strides of the global shape."""
    return _contig(spec.shape)


def _contig(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


# --------------------------------------------------------------------------------------------
# spec construction
# --------------------------------------------------------------------------------------------
def _spec_for_local(local, mesh, placements, sharding_shapes, shape) -> ShardSpec:
    lshape = tuple(local.shape)
    if isinstance(sharding_shapes, str):
        if sharding_shapes == "infer":
            sizes, gshape = _infer_sizes(local, mesh, placements)
        elif sharding_shapes == "chunk":
            if shape is None:
                gshape = list(lshape)
                for m, p in enumerate(placements):
                    if isinstance(p, Shard):
                        gshape[p.dim] = lshape[p.dim] * mesh.shape[m]
            else:
                gshape = list(shape)
            sizes = [shapes.chunk_sizes(gshape[p.dim], mesh.shape[m]) if isinstance(p, Shard) else None
                     for m, p in enumerate(placements)]
        else:
            raise ValueError(f"sharding_shapes={sharding_shapes!r}: use 'infer', 'chunk' or a mapping")
        spec = _checked_spec(lshape, mesh, placements, gshape, sizes)
    elif isinstance(sharding_shapes, Mapping):
        spec = spec_of_local_shape(lshape, mesh, placements, sharding_shapes)
    else:
        raise TypeError(f"sharding_shapes must be 'infer', 'chunk' or a mapping, not {type(sharding_shapes).__name__}")
    if shape is not None and tuple(shape) != tuple(spec.shape):
        raise ShardingShapeError(f"shape={tuple(shape)} disagrees with the sharding shapes, which give {tuple(spec.shape)}")
    return spec


def spec_of_local_shape(lshape: tuple, mesh, placements, sharding_shapes) -> ShardSpec:
    """The layout of a chunk of shape ``lshape`` given every rank's sizes (a mapping, as ``from_local``
    takes it): the global shape follows from the sizes along sharded dims, ``lshape`` elsewhere."""
    sizes = sizes_from_mapping(mesh, placements, lshape, sharding_shapes)
    gshape = list(lshape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            gshape[p.dim] = sum(sizes[m])
    return _checked_spec(tuple(lshape), mesh, placements, gshape, sizes)


def _checked_spec(lshape: tuple, mesh, placements, gshape, sizes) -> ShardSpec:
    """The layout of the given global shape and sizes; ShardingShapeError unless it gives this rank
    ``lshape``."""
    spec = ShardSpec.build(mesh, placements, gshape, sizes)
    if spec.local_shape != lshape:
        raise ShardingShapeError(
            f"rank {_rank()} local tensor has shape {lshape} but the layout {spec} gives it {spec.local_shape}; "
            f"pass sharding_shapes='infer' or the right mapping")
    return spec


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _infer_sizes(local, mesh, placements):
    """One all-gather of every rank's (ndim, dtype, shape); checks the ranks describe one tensor."""
    if local.ndim > _MAX_DIMS:
        raise ValueError(f"sharding_shapes='infer' supports up to {_MAX_DIMS} dims")
    code = _DTYPES.index(local.dtype) if local.dtype in _DTYPES else -1
    row = [local.ndim, code] + list(local.shape) + [0] * (_MAX_DIMS - local.ndim)
    rows = comm.all_gather_ints(row, mesh)
    mesh_shape = tuple(mesh.shape)
    coords = [tuple(int(c) for c in idx) for idx in torch.cartesian_prod(*[torch.arange(n) for n in mesh_shape]).view(len(rows), -1)] \
        if mesh.ndim > 1 else [(k,) for k in range(len(rows))]
    ranks = mesh.mesh.flatten().tolist()
    problems = []
    ref = rows[0]
    for r, (c, row_r) in enumerate(zip(coords, rows)):
        if row_r[0] != ref[0] or row_r[1] != ref[1]:
            problems.append(f"rank {ranks[r]} has a {row_r[0]}-D {_dtype_name(row_r[1])} chunk, rank {ranks[0]} a "
                            f"{ref[0]}-D {_dtype_name(ref[1])} chunk")
    nd = ref[0]
    sizes: list = [None] * mesh.ndim
    gshape = list(ref[2:2 + nd])
    sharded = {p.dim: m for m, p in enumerate(placements) if isinstance(p, Shard)}
    if not problems:
        for m, p in enumerate(placements):
            if isinstance(p, Shard):
                sizes[m] = [None] * mesh_shape[m]
        for r, (c, row_r) in enumerate(zip(coords, rows)):
            shp = row_r[2:2 + nd]
            for d in range(nd):
                m = sharded.get(d)
                if m is None:
                    if shp[d] != gshape[d]:
                        problems.append(f"rank {ranks[r]} has shape {tuple(shp)} but rank {ranks[0]} has "
                                        f"{tuple(ref[2:2 + nd])}: dim {d} is not sharded, so it must agree")
                        break
                else:
                    prev = sizes[m][c[m]]
                    if prev is not None and prev != shp[d]:
                        problems.append(f"ranks at coordinate {c[m]} of mesh dim {m} hold different sizes "
                                        f"({prev} and {shp[d]}) of dim {d}: shards must form a grid")
                    sizes[m][c[m]] = shp[d]
    if problems:
        raise ShardingMismatchError(
            "ShardTensor.from_local: the ranks' local chunks do not form one tensor with placements "
            f"{tuple(placements)}:\n  " + "\n  ".join(problems[:8]))
    for d, m in sharded.items():
        gshape[d] = sum(sizes[m])
        sizes[m] = tuple(sizes[m])
    return sizes, gshape


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "other-dtype"


def target_spec(spec: ShardSpec, placements: Sequence[Placement], sharding_shapes=None) -> ShardSpec:
    """The spec ``redistribute(placements, sharding_shapes)`` produces from ``spec``."""
    mesh = spec.mesh
    sizes: list = [None] * mesh.ndim
    if isinstance(sharding_shapes, Mapping):
        for key, entries in sharding_shapes.items():
            m = mapping_mesh_dim(mesh, key, placements)
            d = placements[m].dim
            sizes[m] = tuple(e if isinstance(e, int) else tuple(e)[d] for e in entries)
    for m, p in enumerate(placements):
        if not isinstance(p, Shard) or sizes[m] is not None:
            continue
        n = spec.shape[p.dim]
        if sharding_shapes == "balanced":
            sizes[m] = shapes.balanced_sizes(n, mesh_shape(mesh)[m])
        elif sharding_shapes is None and spec.placements[m] == p:
            sizes[m] = spec.sizes[m]
        elif sharding_shapes in (None, "chunk") or isinstance(sharding_shapes, Mapping):
            sizes[m] = shapes.chunk_sizes(n, mesh_shape(mesh)[m])
        else:
            raise ValueError(f"sharding_shapes={sharding_shapes!r}: use None, 'chunk', 'balanced' or a mapping")
    return ShardSpec.build(mesh, placements, spec.shape, sizes)


# --------------------------------------------------------------------------------------------
# autograd functions at the ShardTensor level
# --------------------------------------------------------------------------------------------
def _as_shard(grad, spec: ShardSpec) -> "ShardTensor":
    """A gradient reaching a ShardTensor autograd function as a ShardTensor. A plain one is either a local
    gradient laid out like the forward tensor or, with the global shape, one that torch's backward formula
    built from a factory (sgn's zeros, fft_r2c's new_zeros): a value every rank holds, of which this rank
    keeps its own piece (no communication, so ranks need not agree on which case theirs is)."""
    if isinstance(grad, ShardTensor):
        return grad
    if grad.shape != spec.local_shape and grad.shape == spec.shape:
        whole = spec.with_(placements=_ALL_REPLICATE[spec.mesh.ndim], sizes=(None,) * spec.mesh.ndim)
        return ShardTensor(redistribute_local(grad, whole, spec), spec)
    return ShardTensor(grad, spec)


def _from_local(local: torch.Tensor, spec: ShardSpec) -> "ShardTensor":
    """``local`` wrapped with ``spec``: through :class:`_FromLocal` where autograd records it, else directly
    (an autograd.Function costs about 15 us even when it records nothing). A chunk that requires grad,
    wrapped under no_grad, is detached as the Function's output would be: the result is a constant."""
    if local.requires_grad:
        if _grad_enabled():
            return _FromLocal.apply(local, spec)
        local = local.detach()
    return ShardTensor(local, spec)


_grad_enabled = torch.is_grad_enabled


def _from_callers_local(local: torch.Tensor, spec: ShardSpec) -> "ShardTensor":
    """:func:`_from_local` for a tensor the caller keeps (``from_local``, ``from_dtensor``): the chunk is a
    new tensor object sharing its memory, as DTensor's, so an in-place change of the caller's tensor's
    shape (``unsqueeze_``, ``resize_``) cannot change the ShardTensor's chunk."""
    if local.requires_grad and _grad_enabled():
        return _FromLocal.apply(local, spec)
    return ShardTensor(local.detach() if local.requires_grad else local.view_as(local), spec)


class _FromLocal(torch.autograd.Function):
    """Wrap local chunks. The gradient of a ShardTensor is dL/d(its global value); for a Partial
    placement the local chunk is one term of that value, so backward applies d(value)/d(term):
    1 for sum, 1/n for avg, (term == reduced) for max/min, reduced/term for product."""

    @staticmethod
    def forward(ctx, local, spec):
        ctx.spec = spec
        if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in spec.placements):
            ctx.save_for_backward(local.detach())
        return ShardTensor(local.view_as(local), spec)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        target = grad_spec(spec)
        g = _as_shard(grad, target)
        if g._spec != target:
            g = _redistribute_to(g, target)
        local = g.to_local() if g.requires_grad else g._local  # (a graph under create_graph=True: kept)
        if ctx.saved_tensors:
            local = local * _term_derivative(ctx.saved_tensors[0], spec)
        return local, None


def _term_derivative(term: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """d(reduced value)/d(this rank's term) for a chunk with Partial placements, reducing over the
    Partial mesh dims in order (one or two all-reduces per non-sum Partial mesh dim)."""
    factor = torch.ones_like(term)
    current = term
    for m, p in enumerate(spec.placements):
        if not isinstance(p, Partial):
            continue
        op, n = p.reduce_op, mesh_shape(spec.mesh)[m]
        if op == "sum":
            current = comm.all_reduce(current, "sum", spec.mesh, m)
            continue
        if op == "avg":
            factor = factor / n
            current = comm.all_reduce(current, "avg", spec.mesh, m)
        elif op in ("max", "min"):
            reduced = comm.all_reduce(current, op, spec.mesh, m)
            factor = factor * (current == reduced).to(term.dtype)  # every tied term gets the gradient
            current = reduced
        else:  # product: d prod / d t_k = product of the other terms (zero-safe)
            zeros = comm.all_reduce((current == 0).to(term.dtype), "sum", spec.mesh, m)
            nonzero = comm.all_reduce(torch.where(current == 0, torch.ones_like(current), current), "product",
                                      spec.mesh, m)
            factor = factor * product_of_others(current, zeros, nonzero)
            current = torch.where(zeros > 0, torch.zeros_like(nonzero), nonzero)
    return factor


def product_of_others(x: torch.Tensor, zeros: torch.Tensor, nonzero_product: torch.Tensor) -> torch.Tensor:
    """d(product)/dx for each factor x, zero-safe: given the number of zero factors and the product of
    the non-zero ones, it is product/x with no zero, the non-zero product at the only zero, else 0."""
    safe = torch.where(x == 0, torch.ones_like(x), x)
    return torch.where(zeros == 0, nonzero_product / safe,
                       torch.where((zeros == 1) & (x == 0), nonzero_product, torch.zeros_like(nonzero_product)))


class _Distribute(torch.autograd.Function):
    """distribute_tensor: every rank holds the same (replicated) tensor; its gradient is the
    gradient of the whole tensor on every rank, like any replicated operand's."""

    @staticmethod
    def forward(ctx, tensor, dst):
        ctx.dst = dst
        coord = mesh_coordinate(dst.mesh)
        piece = tensor.detach()
        for m, p in enumerate(dst.placements):
            if isinstance(p, Shard):
                k = coord[m]
                piece = piece.narrow(p.dim, sum(dst.sizes[m][:k]), dst.sizes[m][k])
            elif isinstance(p, Partial):
                piece = partial_from_replicate(piece, p, coord[m])  # sum/product: identity off coordinate 0
        # a copy of this rank's piece, like DTensor: an in-place update of the shard never reaches the
        # caller's tensor, and the full tensor's storage is not kept alive by the shard
        return ShardTensor(piece.clone(memory_format=torch.contiguous_format), dst)

    @staticmethod
    def backward(ctx, grad):
        dst = ctx.dst
        g = _as_shard(grad, grad_spec(dst))
        full = g._spec.with_(placements=_ALL_REPLICATE[dst.mesh.ndim], sizes=(None,) * dst.mesh.ndim)
        return (g._local if g._spec == full else redistribute_local(g._local, g._spec, full)), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, grad_placements):
        spec = st._spec
        if grad_placements is not None:
            gp = normalize_placements(grad_placements, spec.ndim, spec.mesh.ndim)
            ctx.gspec = target_spec(spec, gp, None)
        else:
            ctx.gspec = grad_spec(spec)
        return st._local.view_as(st._local)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, ShardTensor):
            raise TypeError("the gradient of to_local() must be a plain tensor")
        # differentiable when the gradient has a graph (create_graph=True): double backward goes through
        return ShardTensor.from_spec(grad, ctx.gspec), None


def _redistribute_to(st: ShardTensor, dst: ShardSpec) -> ShardTensor:
    return ShardTensor(redistribute_local(st._local, st._spec, dst), dst)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, dst):
        ctx.src = st._spec
        return _redistribute_to(st, dst)

    @staticmethod
    def backward(ctx, grad):
        # gradients are dL/d(global value): the same value in any layout, so redistribute back
        target = grad_spec(ctx.src)
        g = _as_shard(grad, target)
        return (_redistribute_to(g, target) if g._spec != target else g), None


# --------------------------------------------------------------------------------------------
# module-level constructors
# --------------------------------------------------------------------------------------------
def distribute_tensor(tensor: torch.Tensor, mesh: DeviceMesh, placements, sharding_shapes=None) -> ShardTensor:
    """Every rank holds the full ``tensor`` and keeps a copy of its own piece (no communication).

    Differentiable: ``tensor`` is a replicated operand, so every rank's ``tensor.grad`` is the gradient
    of the whole tensor (gathered in backward), as for a plain tensor used with ShardTensors."""
    placements = normalize_placements(placements, tensor.ndim, mesh.ndim)
    full = ShardSpec(mesh, (Replicate(),) * mesh.ndim, tensor.shape, (None,) * mesh.ndim)
    dst = target_spec(full, placements, sharding_shapes if sharding_shapes is not None else "chunk")
    if sharding_shapes is not None and not isinstance(sharding_shapes, str):
        consistency.record_layout(dst, "distribute_tensor")  # each rank's word for the sizes: checked later
    return _Distribute.apply(tensor, dst)


def scatter_tensor(tensor: torch.Tensor | None, src: int, mesh: DeviceMesh, placements,
                   sharding_shapes=None) -> ShardTensor:
    """Global rank ``src`` holds ``tensor`` and sends each rank only its own piece (other ranks may pass
    None). Shape, dtype and sizes travel in a small header, so only ``src`` needs to know them.
    A data-loading op: the result is differentiable from here on, but gradients do not flow back to
    ``tensor`` on ``src`` (the other ranks have no tensor to attach a backward to)."""
    import torch.distributed as dist

    me = dist.get_rank() if dist.is_initialized() else 0
    mesh_shape = tuple(mesh.shape)
    header_len = 2 + _MAX_DIMS + sum(mesh_shape)
    if me == src:
        if tensor is None:
            raise ValueError(f"scatter_tensor: source rank {src} must pass the tensor")
        placements_n = normalize_placements(placements, tensor.ndim, mesh.ndim)
        full = ShardSpec(mesh, (Replicate(),) * mesh.ndim, tensor.shape, (None,) * mesh.ndim)
        dst = target_spec(full, placements_n, sharding_shapes if sharding_shapes is not None else "chunk")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"scatter_tensor does not support dtype {tensor.dtype}")
        header = [tensor.ndim, _DTYPES.index(tensor.dtype)] + list(tensor.shape) + [0] * (_MAX_DIMS - tensor.ndim)
        for m in range(mesh.ndim):
            header += list(dst.sizes[m]) if dst.sizes[m] is not None else [0] * mesh_shape[m]
        comm.send_header(torch.tensor(header, dtype=torch.int64, device=comm.mesh_device(mesh)), header_len, src,
                         mesh)
        pieces = []
        coords = _all_coords(mesh_shape)
        for c in coords:
            piece = tensor.detach()
            for m, p in enumerate(dst.placements):
                if isinstance(p, Shard):
                    piece = piece.narrow(p.dim, sum(dst.sizes[m][:c[m]]), dst.sizes[m][c[m]])
            pieces.append(piece)
        local = comm.scatter_pieces(pieces, (), tensor.dtype, tensor.device, src, mesh)
        spec = dst
    else:
        h = comm.send_header(None, header_len, src, mesh).tolist()
        nd, dtype = h[0], _DTYPES[h[1]]
        gshape = h[2:2 + nd]
        placements_n = normalize_placements(placements, nd, mesh.ndim)
        sizes, i = [], 2 + _MAX_DIMS
        for m, n in enumerate(mesh_shape):
            sizes.append(tuple(h[i:i + n]) if isinstance(placements_n[m], Shard) else None)
            i += n
        spec = ShardSpec.build(mesh, placements_n, gshape, sizes)
        dev = comm.mesh_device(mesh)
        local = comm.scatter_pieces(None, spec.local_shape, dtype, dev, src, mesh)
    for m, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            local = partial_from_replicate(local, p, spec.coord[m])
    return _from_local(local, spec)


def _all_coords(mesh_shape) -> list[tuple[int, ...]]:
    coords = [()]
    for n in mesh_shape:
        coords = [c + (k,) for c in coords for k in range(n)]
    return coords


_engine = None  # the dispatch engine, once domainflow.load_engine() has loaded it and the built-in handlers


def install_engine(engine) -> None:
    """Route ShardTensor ops through ``engine``: its ``torch_function`` / ``torch_dispatch``, and where it
    has them, the same as class methods (``method_function`` / ``method_dispatch``), installed as the
    class's hooks to spare every op one Python call."""
    global _engine
    _engine = engine
    if hasattr(engine, "method_function"):
        ShardTensor.__torch_function__ = classmethod(engine.method_function)
    if hasattr(engine, "method_dispatch"):
        ShardTensor.__torch_dispatch__ = classmethod(engine.method_dispatch)


def _load_engine():
    """A ShardTensor used before anything loaded the engine (this module imported directly): load it now."""
    import importlib

    importlib.import_module("domainflow").load_engine()
    return _engine
