"""``F.interpolate`` / ``nn.Upsample`` on grids sharded over spatial dims.

Interpolation is separable: along each spatial dim an output row is a weighted sum of at most four input
rows (nearest: 1, linear: 2, cubic: 4), at source positions given by torch's own formulas (reproduced
here, float32 where torch uses float). Each output row goes to the rank holding its centre, which fetches
the few rows it lacks from its neighbours (the halo exchange), then every dim is applied as an
index-select and weighted sum on the local block; unsharded dims the same way without a fetch.

The common upsampling (``nn.Upsample(scale_factor=2)``: one sharded dim, a power-of-two factor, not
``align_corners``) instead runs torch's own kernel once on the block with its fetched rows and keeps this
rank's output rows: with such a factor the source position of every kept row, computed by torch on the
block, is the global one shifted by a whole number of rows, bit for bit (an exact multiple of a power of
two in float32), and the block holds every row its taps read, so nothing is clamped that globally is not.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from domainflow import comm
from domainflow.dispatch.toolkit import Schema, layout_rule, local_as, run_function_default, spec_like, unsupported_or_fallback
from domainflow.layout import shapes
from domainflow.layout.placements import Shard
from domainflow.dispatch.registry import register_aten, register_function
from domainflow.ops.windows import on_chunks
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.dispatch.toolkit import spec_from_sizes, without_partial

aten = torch.ops.aten

_MODES = {"nearest": 1, "nearest-exact": 1, "linear": 2, "bilinear": 2, "trilinear": 2, "bicubic": 4}
_A = -0.75  # torch's cubic convolution coefficient


def _scale(in_size: int, out_size: int, align_corners: bool, scale) -> float:
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else in_size / out_size


def taps(mode: str, in_size: int, out_size: int, align_corners: bool, scale) -> tuple[np.ndarray, np.ndarray]:
    """Per output row: input row indices (out, k) and weights (out, k), as torch computes them."""
    o = np.arange(out_size)
    if mode in ("nearest", "nearest-exact"):
        s = np.float32(1.0 / scale if scale is not None and scale > 0 else in_size / out_size)
        if mode == "nearest":
            idx = np.floor(o.astype(np.float32) * s).astype(np.int64)
        else:
            idx = np.floor((o.astype(np.float32) + np.float32(0.5)) * s).astype(np.int64)
        idx = np.minimum(idx, in_size - 1)
        return idx[:, None], np.ones((out_size, 1))
    s = _scale(in_size, out_size, align_corners, scale)
    src = s * o if align_corners else s * (o + 0.5) - 0.5
    if mode == "bicubic":
        i = np.floor(src).astype(np.int64)
        t = src - i
        w = np.stack([_cc2(t + 1), _cc1(t), _cc1(1 - t), _cc2(2 - t)], axis=1)
        idx = np.clip(np.stack([i - 1, i, i + 1, i + 2], axis=1), 0, in_size - 1)
        return idx, w
    src = np.maximum(src, 0.0)
    i0 = src.astype(np.int64)
    lam = src - i0
    i1 = i0 + (i0 < in_size - 1)
    return np.stack([i0, i1], axis=1), np.stack([1 - lam, lam], axis=1)


def _cc1(x):
    return ((_A + 2) * x - (_A + 3)) * x * x + 1


def _cc2(x):
    return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A


def _terms(idx: np.ndarray, w: np.ndarray, ndim: int, dim: int, dtype, device) -> tuple:
    """(index tensor, weight tensor shaped to broadcast along ``dim`` or None for all ones) per tap. Cached
    plans outlive the call: made as normal tensors even under ``torch.inference_mode()`` (an inference
    tensor cannot be saved for a later training step's backward)."""
    shape = [1] * ndim
    shape[dim] = -1
    out = []
    with torch.inference_mode(False):
        for k in range(idx.shape[1]):
            weight = None
            if not (w[:, k] == 1).all():
                weight = torch.as_tensor(w[:, k], dtype=dtype, device=device).reshape(shape)
            out.append((torch.as_tensor(idx[:, k], device=device), weight))
    return tuple(out)


def _apply_terms(local: torch.Tensor, dim: int, terms) -> torch.Tensor:
    """sum over taps of weight * local.index_select(dim, index) along ``dim``."""
    out = None
    for index, weight in terms:
        term = local.index_select(dim, index)
        if weight is not None:
            term = term * weight
        out = term if out is None else out + term
    return out


class _Taps:
    """This rank's taps on its fetched block (indices and weights, as arrays); ``terms(...)`` their tensors, kept
    for eager calls. While compiling they are made anew each trace: tensors made under one trace's fake mode and
    kept in the plan cache failed the next trace ("Mixing fake modes"), and would have reached eager calls."""

    def __init__(self, idx: np.ndarray, w: np.ndarray):
        self.idx, self.w, self._eager = idx, w, {}

    def terms(self, ndim: int, dim: int, dtype, device) -> tuple:
        if torch.compiler.is_compiling():
            return _terms(self.idx, self.w, ndim, dim, dtype, device)
        key = (ndim, dim, dtype, device)
        if key not in self._eager:
            self._eager[key] = _terms(self.idx, self.w, ndim, dim, dtype, device)
        return self._eager[key]


@layout_rule
def _sharded_dim_plan(mode, in_size, out_size, align, scale, sizes, me, ndim, dim, dtype, device):
    """Interpolation along a sharded dim, once per layout and arguments: this rank's row fetch, the output
    rows per rank, and the taps on the fetched block (None: this rank has no output rows)."""
    idx, w = taps(mode, in_size, out_size, align, scale)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    # output row o goes to the rank holding its centre, floor((o + 0.5) * in / out): integer scales then
    # scale every rank's rows alike ([8, 8] -> [16, 16]), matching the layout an encoder had before
    # pooling, so UNet skip connections need no reshuffle
    centre = np.minimum(np.floor((np.arange(out_size) + 0.5) * in_size / out_size).astype(np.int64), in_size - 1)
    owner = np.minimum(np.searchsorted(bounds[1:], centre, side="right"), len(sizes) - 1)
    wanted, counts = [], []
    for r in range(len(sizes)):
        rows = np.flatnonzero(owner == r)
        counts.append(len(rows))
        if len(rows) == 0:
            wanted.append([])
            continue
        lo, hi = int(idx[rows].min()), int(idx[rows].max()) + 1
        wanted.append(list(range(lo, hi)))
    mine = np.flatnonzero(owner == me)
    lo = wanted[me][0] if wanted[me] else 0
    terms = _Taps(idx[mine] - lo, w[mine]) if len(mine) else None
    # for torch's kernel on the fetched block (a power-of-two factor): the first kept output row of the
    # block's output
    first = int(mine[0]) - round(lo * out_size / in_size) if len(mine) else 0
    return shapes.row_fetch_plan(sizes, wanted, me), tuple(counts), terms, first


_NATIVE_MODES = frozenset({"nearest", "nearest-exact", "linear", "bilinear", "trilinear"})


def _native_exact(mode: str, align: bool, scale, in_size: int, out_size: int) -> bool:
    """Whether torch's kernel on a block of rows gives the global result on its rows, bit for bit: a
    power-of-two upsampling factor given as ``scale_factor`` (torch then uses 1 / factor, exact, so a shift of
    the block by whole rows shifts every source position exactly), no ``align_corners``, no cubic taps (which
    read clamped rows near the block's edge)."""
    if mode not in _NATIVE_MODES or align or scale is None or scale < 1 or out_size != in_size * scale:
        return False
    k = int(scale)
    return k == scale and k & (k - 1) == 0


_INTERPOLATE_ARGS = Schema("self", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias",
                           size=None, scale_factor=None, mode="nearest", align_corners=None,
                           recompute_scale_factor=None, antialias=False)


def _interpolate(func, args, kwargs):
    a = _INTERPOLATE_ARGS.bind(args, kwargs)
    x = a["self"]
    if not isinstance(x, ShardTensor):
        return run_function_default(func, args, kwargs)
    mode = a["mode"]
    nd = x.ndim - 2
    if not any(isinstance(p, Shard) and p.dim >= 2 for p in x._spec.placements) and x.ndim >= 3:
        return on_chunks(func, without_partial(x), args, kwargs)  # only batch or channels sharded: local
    if mode not in _MODES or a["antialias"]:
        return unsupported_or_fallback(func, args, kwargs, f"interpolate mode {mode!r}"
                                        + (" with antialias" if a["antialias"] else "") + " along a sharded dim")
    x = without_partial(x)
    spec = x._spec
    if any(isinstance(p, Shard) and p.dim == 1 for p in spec.placements):
        return unsupported_or_fallback(func, args, kwargs, "the channel dim is sharded")
    in_sizes = list(x.shape[2:])
    if a["size"] is not None:
        size = a["size"]
        out_sizes = [int(size)] * nd if isinstance(size, int) else [int(s) for s in size]
        scales = [None] * nd
    else:
        sf = a["scale_factor"]
        sf = [float(sf)] * nd if isinstance(sf, (int, float)) else [float(s) for s in sf]
        out_sizes = [int(math.floor(n * s)) for n, s in zip(in_sizes, sf)]
        scales = [None] * nd if a["recompute_scale_factor"] else sf
    align = bool(a["align_corners"]) if mode not in ("nearest", "nearest-exact") else False
    local = x.to_local()
    sizes_out = list(spec.sizes)
    from domainflow.layout.spec import mesh_shape

    mshape = mesh_shape(spec.mesh)
    split = [i for i in range(nd) if (m := spec.mesh_dim_of(i + 2)) is not None and mshape[m] > 1]
    if len(split) == 1 and _native_exact(mode, align, scales[split[0]], in_sizes[split[0]], out_sizes[split[0]]):
        return _native_on_block(x, local, split[0] + 2, mode, a, in_sizes, out_sizes, scales, align)
    done = [False] * nd
    for i in range(nd):
        d = i + 2
        m = spec.mesh_dim_of(d)
        if m is None or mshape[m] == 1:
            continue  # torch's own kernel below
        done[i] = True
        fetch, counts, terms, _ = _sharded_dim_plan(mode, in_sizes[i], out_sizes[i], align, scales[i], spec.sizes[m],
                                                 spec.coord[m], local.ndim, d, local.dtype, local.device)
        local = comm.fetch(local, d, fetch, spec.mesh, m)
        if terms is not None:
            local = _apply_terms(local, d, terms.terms(local.ndim, d, local.dtype, local.device))
        else:
            shape = list(local.shape)
            shape[d] = 0
            local = local.new_zeros(shape) + local.sum() * 0  # same backward on every rank
        sizes_out[m] = counts
    if not all(done):
        # every other dim in one call of torch's kernel; dims already done get scale 1 (exact identity)
        kw = {"mode": mode}
        if mode not in ("nearest", "nearest-exact"):
            kw["align_corners"] = align
        if a["size"] is not None or a["recompute_scale_factor"]:
            kw["size"] = [local.shape[i + 2] if done[i] else out_sizes[i] for i in range(nd)]
        else:
            kw["scale_factor"] = [1.0 if done[i] else scales[i] for i in range(nd)]
        if local.numel():
            local = F.interpolate(local, **kw)
        else:  # a rank without rows: the right empty shape, still wired for backward
            shape = list(local.shape[:2]) + [local.shape[i + 2] if done[i] else out_sizes[i] for i in range(nd)]
            local = local.new_zeros(shape) + local.sum() * 0
        for i in range(nd):
            m = spec.mesh_dim_of(i + 2)
            if m is not None and not done[i]:
                sizes_out[m] = (out_sizes[i],)
    return _wrap(local, spec, sizes_out)


def _native_on_block(x, local, d, mode, a, in_sizes, out_sizes, scales, align):
    """One sharded dim ``d`` with an exact power-of-two factor (:func:`_native_exact`): fetch the rows the
    taps read, run torch's kernel on the block, keep this rank's output rows (their owners as in the
    general path, so layouts agree)."""
    spec = x._spec
    m = spec.mesh_dim_of(d)
    i = d - 2
    fetch, counts, _, first = _sharded_dim_plan(mode, in_sizes[i], out_sizes[i], align, scales[i], spec.sizes[m],
                                                spec.coord[m], local.ndim, d, local.dtype, local.device)
    mine = counts[spec.coord[m]]
    block = comm.fetch(local, d, fetch, spec.mesh, m)
    kw = {"mode": mode, "scale_factor": scales} if mode in ("nearest", "nearest-exact") else \
        {"mode": mode, "scale_factor": scales, "align_corners": align}
    if mine and block.numel():
        out = F.interpolate(block, **kw).narrow(d, first, mine)
    else:  # a rank without rows (or channels): the right empty shape, still wired for backward
        shape = [block.shape[0], block.shape[1]] + [mine if k + 2 == d else out_sizes[k] for k in range(len(out_sizes))]
        out = block.new_zeros(shape) + block.sum() * 0
    sizes_out = list(spec.sizes)
    sizes_out[m] = counts
    for k in range(len(out_sizes)):
        mk = spec.mesh_dim_of(k + 2)
        if mk is not None and mk != m:  # a spatial dim on a mesh dim of size 1
            sizes_out[mk] = (out_sizes[k],)
    return _wrap(out, spec, sizes_out)


def _wrap(local, spec, sizes_out) -> ShardTensor:
    """The interpolated chunk, laid out like the input with every rank's output sizes ``sizes_out``."""
    mapping = {m: list(s) for m, s in enumerate(sizes_out) if s is not None}
    return ShardTensor.from_spec(local, spec_from_sizes(local.shape, spec.mesh, list(spec.placements), mapping))


register_function(F.interpolate)(_interpolate)


# aten ops that treat each batch row (and, for resampling, each channel) alone: op -> how many leading dims may
# be sharded; an ``input_size`` argument (their backward's) is made this rank's
_PER_SAMPLE = {aten.grid_sampler_2d.default: 1, aten.grid_sampler_3d.default: 1,
               aten.grid_sampler_2d_backward.default: 1, aten.grid_sampler_3d_backward.default: 1,
               aten._upsample_bilinear2d_aa.default: 2, aten._upsample_bicubic2d_aa.default: 2,
               aten._upsample_bilinear2d_aa_backward.default: 2, aten._upsample_bicubic2d_aa_backward.default: 2}


@register_aten(*_PER_SAMPLE)
def per_sample(func, args, kwargs):
    """Sampling a grid per batch row, antialiased resampling per channel: every tensor argument laid out like
    the first sharded one on the leading dims (a plain grid sliced to this rank's rows), the op on the chunks."""
    lead = _PER_SAMPLE[func]
    sts = [a for a in args if isinstance(a, ShardTensor)]
    ref = sts[0]._spec.reduced()
    if any(isinstance(p, Shard) and p.dim >= lead for s in sts for p in s._spec.placements):
        return unsupported_or_fallback(func, args, kwargs, f"a dim past the first {lead} is sharded")
    local_args = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = local_as(a, ref.with_(shape=a.shape) if isinstance(a, ShardTensor) else ref)
        elif isinstance(a, (list, tuple)) and len(a) == ref.ndim and tuple(a[:lead]) == tuple(ref.shape[:lead]):
            a = [*ref.local_shape[:lead], *a[lead:]]  # input_size
        local_args.append(a)
    out = func(*local_args, **kwargs)

    def wrap(o):
        return ShardTensor.from_spec(o, spec_like(ref.with_(shape=(*ref.shape[:lead], *o.shape[lead:])), o.shape))
    return tuple(wrap(o) if o is not None else None for o in out) if isinstance(out, tuple) else wrap(out)
