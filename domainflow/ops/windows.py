"""Sliding-window ops on spatially sharded grids: padding, convolution and pooling with halo exchanges.

Every handler works the same way, one sharded spatial dim at a time (so a 2-D domain mesh gets its
corner rows for free: the second exchange moves rows that already carry the first one's halo):
1. ``shapes.window_plan`` assigns each output to the rank holding its window's centre and says which
   input rows each rank needs (pure arithmetic, identical on every rank);
2. ``comm.halo_exchange`` fetches the rows a rank lacks from their owners, point to point (further than
   the neighbour when a neighbour holds fewer rows than the halo), with zeros for padding;
3. torch's own op runs on the widened local block with no padding along the sharded dims.
Replicated weights get the single-device gradient: their local gradients are summed over the sharded
mesh dims once, in backward, in one coalesced all-reduce.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from domainflow import comm
from domainflow.layout import shapes
from domainflow.dispatch.toolkit import Schema, layout_rule, local_as, params_for, run_function_default, unsupported_or_fallback
from domainflow.dispatch.toolkit import spec_from_sizes, spec_like, without_partial
from domainflow.layout.placements import Shard
from domainflow.layout.spec import mesh_shape
from domainflow.dispatch.registry import register_function
from domainflow.ops.channel_conv import channel_conv, channel_sharded
from domainflow.tensor.shard_tensor import ShardTensor


# --------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------


def _tuple(v, n: int, name: str) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(x) for x in v)
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise ValueError(f"{name} must have {n} entries, got {v}")
    return v


def _sharded_spatial(x: ShardTensor, first_spatial: int, op, args, kwargs):
    """[(mesh dim, tensor dim)] of the sharded spatial dims; batch sharding is fine; anything else refused."""
    return _sharded_spatial_dims(x._spec, first_spatial)


def _sharded_spatial_dims(spec, first_spatial: int, channels_apart: bool = False):
    """:func:`_sharded_spatial` of a layout: (dims, None), or (None, why not). ``channels_apart``: the op treats
    each channel alone (pooling), so a sharded channel dim is like a sharded batch dim."""
    out = []
    seen = set()
    for m, p in enumerate(spec.placements):
        if not isinstance(p, Shard):
            continue
        if p.dim in seen:
            return None, "a tensor dim sharded over two mesh dims"
        seen.add(p.dim)
        if p.dim >= first_spatial:
            out.append((m, p.dim))
        elif p.dim == first_spatial - 1 and not channels_apart:
            return None, f"the channel dim {p.dim} is sharded (shard the batch or spatial dims)"
    return out, None


def _widen(local, x_spec, sharded, plans):
    """Fetch, along each sharded dim in turn, the input rows each rank's windows need (zeros outside)."""
    mesh = x_spec.mesh
    for m, d in sharded:
        local = comm.fetch(local, d, _window_fetch(x_spec.sizes[m], plans[(m, d)].need, x_spec.coord[m]), mesh, m)
    return local


@layout_rule
def _window_fetch(sizes, need, me):
    """This rank's row fetch for a window plan's input ranges ``need`` (rows outside the dim are zeros)."""
    n = sum(sizes)
    wanted = [[g if 0 <= g < n else -1 for g in range(lo, hi)] for lo, hi in need]
    return shapes.row_fetch_plan(sizes, wanted, me)


window_plan = layout_rule(shapes.window_plan)  # once per (sizes, kernel, stride, dilation, padding, ceil mode)


def _valid_mask(x_spec, sharded, plans, ndim, device, dtype, lo_ok, hi_ok):
    """A broadcastable mask over the widened block: 1 where the global row is in ``[lo_ok(n), hi_ok(n))``
    along every sharded dim."""
    mask = None
    for m, d in sharded:
        n = sum(x_spec.sizes[m])
        lo, hi = plans[(m, d)].need[x_spec.coord[m]]
        g = torch.arange(lo, hi, device=device)
        v = ((g >= lo_ok(m, d, n)) & (g < hi_ok(m, d, n))).to(dtype)
        shape = [1] * ndim
        shape[d] = hi - lo
        v = v.reshape(shape)
        mask = v if mask is None else mask * v
    return mask


def _rows_outside(x_spec, m, plan) -> bool:
    """Whether this rank's widened block along mesh dim ``m`` holds rows outside the tensor (padding)."""
    lo, hi = plan.need[x_spec.coord[m]]
    return hi > lo and (lo < 0 or hi > sum(x_spec.sizes[m]))


def _wrap_out(out_local, x_spec, sharded, plans, out_shape):
    """The window op's output: sharded like the input, with the plans' output sizes on the sharded dims."""
    sizes = list(x_spec.sizes)
    for m, d in sharded:
        sizes[m] = plans[(m, d)].out_sizes
    return ShardTensor.from_spec(out_local, spec_like(x_spec.with_(shape=out_shape, sizes=sizes), out_local.shape))


# --------------------------------------------------------------------------------------------
# convolution
# --------------------------------------------------------------------------------------------
def _conv_padding(padding, kernel, dilation, stride, nd):
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * nd
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
            out = []
            for k, dl in zip(kernel, dilation):
                total = dl * (k - 1)
                out.append((total // 2, total - total // 2))
            return out
        raise ValueError(f"invalid padding string {padding!r}")
    return [(p, p) for p in _tuple(padding, nd, "padding")]


_CONV_ARGS = Schema("self", "weight", "bias", "stride", "padding", "dilation", "groups",
                    bias=None, stride=1, padding=0, dilation=1, groups=1)


def _make_conv(nd: int, func):
    def handler(_func, args, kwargs):
        a = _CONV_ARGS.bind(args, kwargs)
        x, weight, bias = a["self"], a["weight"], a["bias"]
        if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) for t in (weight, bias)):
            return run_function_default(func, args, kwargs)
        if x.ndim != nd + 2:
            return handler(func, (x.unsqueeze(0), weight, bias, a["stride"], a["padding"], a["dilation"],
                                  a["groups"]), {}).squeeze(0)  # unbatched: this handler again, batched
        if channel_sharded(x):
            return channel_conv(func, x, weight, bias, False, (a["stride"], a["padding"], a["dilation"], a["groups"]),
                                args, kwargs)
        kernel = tuple(weight.shape[2:])
        stride, dilation = _tuple(a["stride"], nd, "stride"), _tuple(a["dilation"], nd, "dilation")
        pads = _conv_padding(a["padding"], kernel, dilation, stride, nd)
        return sharded_conv(func, x, weight, bias, stride, pads, dilation, a["groups"], args, kwargs)

    return handler


def sharded_conv(func, x: ShardTensor, weight, bias, stride, pads, dilation, groups, args=(), kwargs=None):
    """``func`` (F.conv1d/2d/3d) on ``x`` sharded over batch and/or spatial dims, with zero padding
    ``pads[i] = (before, after)`` per spatial dim (asymmetric and negative allowed: conv_transpose uses it)."""
    x = without_partial(x)
    spec = x._spec
    setup = _conv_setup(spec, tuple(weight.shape[2:]), weight.shape[0], tuple(stride), tuple(map(tuple, pads)),
                        tuple(dilation))
    if isinstance(setup, str):
        return unsupported_or_fallback(func, args, kwargs or {}, setup)
    local = x.to_local()
    for m, d, fetch in setup.fetches:
        local = comm.fetch(local, d, fetch, spec.mesh, m)
    if setup.extra_pad:
        local = F.pad(local, setup.extra_pad)
    weight, bias = params_for(spec.mesh, setup.grad_mesh_dims, weight, bias)
    if setup.out_spec is None:  # no outputs on this rank along a sharded dim
        return _wrap_out(_empty_like_output(local, weight, bias, spec, setup.sharded, setup.plans, setup.out_shape),
                         spec, setup.sharded, setup.plans, setup.out_shape)
    return ShardTensor.from_spec(func(local, weight, bias, stride, setup.conv_pad, dilation, groups), setup.out_spec)


class _ConvSetup(NamedTuple):
    """Everything about a sharded convolution that follows from the input layout and the static arguments."""

    sharded: list  # [(mesh dim, tensor dim)] of the sharded spatial dims
    plans: dict  # (mesh dim, tensor dim) -> shapes.WindowPlan
    fetches: tuple  # (mesh dim, tensor dim, this rank's row fetch), in the order they run
    conv_pad: tuple  # torch's (symmetric) padding: 0 along sharded dims
    extra_pad: list | None  # F.pad arguments for asymmetric padding of unsharded dims
    grad_mesh_dims: list  # mesh dims the weights' gradients are summed over
    out_shape: list
    out_spec: object  # the output's layout; None where this rank has no outputs


@layout_rule
def _conv_setup(spec, kernel, out_channels, stride, pads, dilation):
    """The cached plan of a sharded convolution (a string: why it cannot run sharded)."""
    nd = spec.ndim - 2
    sharded, why = _sharded_spatial_dims(spec, 2)
    if sharded is None:
        return why
    plans = {(m, d): window_plan(spec.sizes[m], kernel[d - 2], stride[d - 2], dilation[d - 2], *pads[d - 2])
             for m, d in sharded}
    # a dim "sharded" over a mesh dim of one rank has nothing to fetch: torch pads it, as an unsharded one
    split = mesh_shape(spec.mesh)
    fetches = tuple((m, d, _window_fetch(spec.sizes[m], plans[(m, d)].need, spec.coord[m])) for m, d in sharded
                    if split[m] > 1)
    sharded_dims = {d for _, d, _ in fetches}
    # unsharded dims keep their padding; torch takes symmetric padding only, so pad asymmetric ones here
    conv_pad, extra = [], []
    for i in range(nd):
        lo, hi = (0, 0) if i + 2 in sharded_dims else pads[i]
        if lo == hi and lo >= 0:
            conv_pad.append(lo)
            extra.append((0, 0))
        else:
            conv_pad.append(0)
            extra.append((lo, hi))
    extra_pad = [v for e in reversed(extra) for v in e] if any(e != (0, 0) for e in extra) else None
    out_shape = [spec.shape[0], out_channels]
    for i in range(nd):
        out_shape.append(shapes.window_out_len(spec.shape[i + 2], kernel[i], stride[i], dilation[i], *pads[i]))
    _check_fits(spec.shape[2:], kernel, dilation, pads, out_shape[2:])
    out_spec = None
    if not any(plans[(m, d)].out_sizes[spec.coord[m]] == 0 for m, d in sharded):
        sizes = list(spec.sizes)
        for m, d in sharded:
            sizes[m] = plans[(m, d)].out_sizes
        out_spec = spec.with_(shape=out_shape, sizes=sizes)
    return _ConvSetup(sharded, plans, fetches, tuple(conv_pad), extra_pad,
                      [m for m, _ in sharded] + _batch_dims(spec), out_shape, out_spec)


def _check_fits(sizes, kernel, dilation, pads, out_sizes) -> None:
    """Refuse, as torch does, a window wider than the padded input (every rank decides alike)."""
    for i, n in enumerate(out_sizes):
        if n <= 0:
            span = dilation[i] * (kernel[i] - 1) + 1
            raise RuntimeError(f"Calculated padded input size per channel along spatial dim {i} "
                               f"({sizes[i] + pads[i][0] + pads[i][1]}) is smaller than the kernel span ({span}): "
                               f"Kernel size can't be greater than actual input size")


def _batch_dims(spec) -> list[int]:
    """Mesh dims sharding the batch dim: parameter gradients sum over them too."""
    return [m for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == 0]


def _empty_like_output(local, weight, bias, spec, sharded, plans, out_shape):
    """A rank with no outputs along a sharded dim: an empty block still wired to the inputs and weights, so
    every rank runs the same backward collectives."""
    shape = list(spec.local_shape)
    shape[1] = out_shape[1]
    for i in range(2, len(out_shape)):
        shape[i] = out_shape[i]
    for m, d in sharded:
        shape[d] = plans[(m, d)].out_sizes[spec.coord[m]]
    for m in _batch_dims(spec):
        shape[0] = spec.local_shape[0]
    tie = local.sum() * 0 + weight.sum() * 0 + (bias.sum() * 0 if bias is not None else 0)
    return local.new_zeros(shape) + tie


for _nd, _f in ((1, F.conv1d), (2, F.conv2d), (3, F.conv3d)):
    register_function(_f)(_make_conv(_nd, _f))


# --------------------------------------------------------------------------------------------
# transposed convolution: zero insertion (local) + a stride-1 convolution with the flipped kernel
# --------------------------------------------------------------------------------------------
def _insert_zeros(x: ShardTensor, stride) -> ShardTensor:
    """x[i] -> position i*s with zeros between, along every spatial dim. Each rank keeps its own rows
    (and the zeros after them), so no communication: rank r's block starts at ``start_r * s``."""
    spec = x._spec
    local = x.to_local()
    nd = x.ndim - 2
    sizes = list(spec.sizes)
    shape = list(spec.shape)
    for i in range(nd):
        d, s = i + 2, stride[i]
        if s == 1:
            continue
        n = spec.shape[d]
        total = (n - 1) * s + 1 if n else 0
        m = spec.mesh_dim_of(d)
        if m is None:
            own, start = n, 0
        else:
            own, start = spec.sizes[m][spec.coord[m]], sum(spec.sizes[m][:spec.coord[m]])
        length = max(0, min((start + own) * s, total) - start * s) if own else 0
        new_shape = list(local.shape)
        new_shape[d] = length
        local = _scatter_strided(local, new_shape, d, s)
        if m is not None:
            sz = spec.sizes[m]
            starts = [sum(sz[:r]) for r in range(len(sz))]
            sizes[m] = tuple(max(0, min((a + k) * s, total) - a * s) if k else 0 for a, k in zip(starts, sz))
        shape[d] = total
    mapping = {m: list(v) for m, v in enumerate(sizes) if v is not None}
    return ShardTensor.from_spec(local, spec_from_sizes(local.shape, spec.mesh, list(spec.placements), mapping))


def _scatter_strided(local, new_shape, d, s):
    """Differentiable zero insertion: ``local`` placed every ``s`` rows of a zero tensor."""
    idx = torch.arange(0, local.shape[d] * s, s, device=local.device)
    return local.new_zeros(new_shape).index_copy(d, idx, local)


_CONV_TRANSPOSE_ARGS = Schema("self", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation",
                              bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1)


def _make_conv_transpose(nd: int, func, conv):
    def handler(_func, args, kwargs):
        a = _CONV_TRANSPOSE_ARGS.bind(args, kwargs)
        x, weight, bias = a["self"], a["weight"], a["bias"]
        if not isinstance(x, ShardTensor) or any(isinstance(t, ShardTensor) for t in (weight, bias)):
            return run_function_default(func, args, kwargs)
        if x.ndim != nd + 2:
            return handler(func, (x.unsqueeze(0), weight, bias, a["stride"], a["padding"], a["output_padding"],
                                  a["groups"], a["dilation"]), {}).squeeze(0)  # unbatched: batched
        if channel_sharded(x):
            return channel_conv(func, x, weight, bias, True, (a["stride"], a["padding"], a["output_padding"],
                                                              a["groups"], a["dilation"]), args, kwargs)
        x = without_partial(x)
        sharded, why = _sharded_spatial(x, 2, func, args, kwargs)
        if sharded is None:
            return unsupported_or_fallback(func, args, kwargs, why)
        stride, pad = _tuple(a["stride"], nd, "stride"), _tuple(a["padding"], nd, "padding")
        out_pad, dilation = _tuple(a["output_padding"], nd, "output_padding"), _tuple(a["dilation"], nd, "dilation")
        g = a["groups"]
        kernel = tuple(weight.shape[2:])
        cin, cout_g = weight.shape[0], weight.shape[1]
        # (C_in, C_out/g, k...) -> (C_out, C_in/g, k...), flipped: the convolution this transposes
        w = weight.reshape(g, cin // g, cout_g, *kernel).transpose(1, 2).reshape(g * cout_g, cin // g, *kernel)
        w = w.flip(list(range(2, 2 + nd)))
        pads = [(dl * (k - 1) - p, dl * (k - 1) - p + op) for k, p, op, dl in zip(kernel, pad, out_pad, dilation)]
        return sharded_conv(conv, _insert_zeros(x, stride), w, bias, (1,) * nd, pads, dilation, g, args, kwargs)

    return handler


for _nd, _f, _c in ((1, F.conv_transpose1d, F.conv1d), (2, F.conv_transpose2d, F.conv2d),
                    (3, F.conv_transpose3d, F.conv3d)):
    register_function(_f)(_make_conv_transpose(_nd, _f, _c))


# --------------------------------------------------------------------------------------------
# padding
# --------------------------------------------------------------------------------------------
_PAD_ARGS = Schema("self", "pad", "mode", "value", mode="constant", value=None)


def _pad(func, args, kwargs):
    a = _PAD_ARGS.bind(args, kwargs)
    x, pad, mode, value = a["self"], list(a["pad"]), a["mode"], a["value"]
    if not isinstance(x, ShardTensor):
        return run_function_default(func, args, kwargs)
    x = without_partial(x)
    spec = x._spec
    npad = len(pad) // 2
    per_dim = {x.ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(npad)}
    sharded = [(m, p.dim) for m, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim in per_dim
               and per_dim[p.dim] != (0, 0)]
    if any(lo < 0 or hi < 0 for lo, hi in per_dim.values()) and sharded:
        return unsupported_or_fallback(func, args, kwargs, "negative padding (cropping) of a sharded dim")
    local = x.to_local()
    sizes = list(spec.sizes)
    for m, d in sharded:
        lo, hi = per_dim[d]
        fetch, zero_rows, new = _pad_fetch(spec.sizes[m], lo, hi, mode, spec.coord[m])
        local = comm.fetch(local, d, fetch, spec.mesh, m)
        if mode == "constant" and value:
            fill = torch.tensor(zero_rows, dtype=torch.bool, device=local.device)  # bool also when empty
            shape = [1] * local.ndim
            shape[d] = len(zero_rows)
            local = local.masked_fill(fill.reshape(shape), value)
        sizes[m] = new
    rest = []
    for i in range(npad):
        d = x.ndim - 1 - i
        rest += [0, 0] if any(d == sd for _, sd in sharded) else list(per_dim[d])
    if any(rest):
        if mode != "constant" and local.numel() == 0:
            # torch refuses reflect/replicate/circular padding of an empty block (a rank without rows): the
            # result is empty too, with the other dims padded, still wired to the input for backward
            shape = list(local.shape)
            for i in range(npad):
                shape[x.ndim - 1 - i] += rest[2 * i] + rest[2 * i + 1]
            local = local.new_zeros(shape) + local.sum() * 0
        else:
            local = F.pad(local, rest, mode=mode, value=value) if mode == "constant" else F.pad(local, rest, mode=mode)
    mapping = {m: list(sizes[m]) for m, p in enumerate(spec.placements) if isinstance(p, Shard)}
    return ShardTensor.from_spec(local, spec_from_sizes(local.shape, spec.mesh, list(spec.placements), mapping))


register_function(F.pad)(_pad)
# what Dynamo puts in a compiled graph for F.pad: the builtin it calls (its own handle_torch_function), which would
# otherwise reach the engine as its C++ decomposition (a circular pad as copies into views of a new tensor)
register_function(torch._C._nn.pad)(_pad)


@register_function(torch.constant_pad_nd)
def _constant_pad_nd(func, args, kwargs):
    a = Schema("self", "pad", "value", value=0).bind(args, kwargs)
    return _pad(F.pad, (a["self"], a["pad"], "constant", a["value"]), {})


_UNPOOL_ARGS = Schema("self", "indices", "kernel_size", "stride", "padding", "output_size", stride=None, padding=0,
                      output_size=None)


def _make_unpool(nd: int, func):
    def handler(_func, args, kwargs):
        """Max unpooling with only batch or channel dims sharded: each chunk with its indices, locally."""
        a = _UNPOOL_ARGS.bind(args, kwargs)
        x, indices = a["self"], a["indices"]
        if not isinstance(x, ShardTensor):
            return run_function_default(func, args, kwargs)
        x = without_partial(x)
        first_spatial = x.ndim - nd
        if any(isinstance(p, Shard) and p.dim >= first_spatial for p in x._spec.placements):
            return unsupported_or_fallback(func, args, kwargs, "max unpooling along a sharded spatial dim")
        rest = {k: a[k] for k in ("kernel_size", "stride", "padding", "output_size")}
        idx = local_as(indices, x._spec)
        # (on_chunks probes an empty chunk's output shape on the meta device: indices to match)
        return on_chunks(lambda t: func(t, idx if t.device == idx.device else torch.zeros_like(t, dtype=idx.dtype),
                                        **rest), x, (x,), {})
    return handler


for _nd, _f in ((1, F.max_unpool1d), (2, F.max_unpool2d), (3, F.max_unpool3d)):
    register_function(_f)(_make_unpool(_nd, _f))


@layout_rule
def _pad_fetch(s, lo, hi, mode, me):
    """Padding ``lo`` / ``hi`` rows onto a dim sharded in sizes ``s``: this rank's row fetch, which of its
    rows are constant padding, and the new sizes (the first rank gains ``lo`` rows, the last ``hi``)."""
    n = sum(s)
    bounds = [sum(s[:r]) for r in range(len(s) + 1)]
    wanted, new = [], []
    for r in range(len(s)):
        rows = list(range(bounds[r], bounds[r + 1]))
        if r == 0:
            rows = list(range(-lo, 0)) + rows
        if r == len(s) - 1:
            rows = rows + list(range(n, n + hi))
        wanted.append([shapes.pad_index(g, n, mode) for g in rows])
        new.append(len(rows))
    return shapes.row_fetch_plan(s, wanted, me), tuple(g < 0 for g in wanted[me]), tuple(new)


# --------------------------------------------------------------------------------------------
# pooling
# --------------------------------------------------------------------------------------------
def _make_pool(nd: int, func, kind: str):
    names = (("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
             if kind == "max" else
             ("self", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"))
    schema = Schema(*names, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False,
                    count_include_pad=True, divisor_override=None)

    def handler(_func, args, kwargs):
        a = schema.bind(args, kwargs)
        x = a["self"]
        if not isinstance(x, ShardTensor):
            return run_function_default(func, args, kwargs)
        if x.ndim != nd + 2:
            return handler(_func, (x.unsqueeze(0),) + tuple(args[1:]), kwargs).squeeze(0)
        x = without_partial(x)
        sharded, why = _sharded_spatial_dims(x._spec, 2, channels_apart=True)
        if sharded is None:
            return unsupported_or_fallback(func, args, kwargs, why)
        if not sharded:  # only batch or channel dims sharded: every window lies in this rank's chunk
            return on_chunks(func, x, args, kwargs)
        if a["return_indices"] or func in (F.max_pool1d_with_indices, F.max_pool2d_with_indices,
                                           F.max_pool3d_with_indices):
            return unsupported_or_fallback(func, args, kwargs, "return_indices on a sharded input")
        kernel = _tuple(a["kernel_size"], nd, "kernel_size")
        stride = _tuple(a["stride"] if a["stride"] not in (None, [], ()) else kernel, nd, "stride")
        pad = _tuple(a["padding"], nd, "padding")
        dilation = _tuple(a["dilation"], nd, "dilation")
        ceil = bool(a["ceil_mode"])
        spec = x._spec
        plans = {(m, d): window_plan(spec.sizes[m], kernel[d - 2], stride[d - 2], dilation[d - 2],
                                     pad[d - 2], pad[d - 2], ceil) for m, d in sharded}
        local = _widen(x.to_local(), spec, sharded, plans)
        sharded_dims = {d for _, d in sharded}
        local_pad = tuple(0 if i + 2 in sharded_dims else pad[i] for i in range(nd))
        out_shape = list(spec.shape[:2]) + [shapes.window_out_len(spec.shape[i + 2], kernel[i], stride[i],
                                                                  dilation[i], pad[i], pad[i], ceil)
                                            for i in range(nd)]
        _check_fits(spec.shape[2:], kernel, dilation, [(p_, p_) for p_ in pad], out_shape[2:])
        if any(plans[(m, d)].out_sizes[spec.coord[m]] == 0 for m, d in sharded):
            shape = list(spec.local_shape)
            for i in range(2, x.ndim):
                shape[i] = out_shape[i]
            for m, d in sharded:
                shape[d] = plans[(m, d)].out_sizes[spec.coord[m]]
            out_local = local.new_zeros(shape) + local.sum() * 0
            return _wrap_out(out_local, spec, sharded, plans, out_shape)
        if kind == "max":
            # padding rows in the block (fetched rows before the first or past the last): never the max. Known
            # from the plans, not from the mask's values, which torch.compile could only read with a graph break
            if any(_rows_outside(spec, m, plans[(m, d)]) for m, d in sharded):
                real = _valid_mask(spec, sharded, plans, x.ndim, local.device, local.dtype,
                                   lambda m, d, n: 0, lambda m, d, n: n)
                local = local.masked_fill(real == 0, float("-inf"))
            out_local = func(local, kernel, stride, local_pad, dilation, ceil_mode=ceil)
        else:
            extra = (a["divisor_override"],) if nd > 1 else ()  # avg_pool1d has no divisor_override
            out_local = func(local, kernel, stride, local_pad, ceil, a["count_include_pad"], *extra)
            if a["divisor_override"] is None:
                # along a sharded dim the local op counted every fetched row; torch counts real rows (and
                # padding rows with count_include_pad) but never rows past the padded end (ceil mode).
                # Counts are separable, so rescale by each sharded dim's counted fraction per window.
                for m, d in sharded:
                    n = sum(spec.sizes[m])
                    lo, hi = plans[(m, d)].need[spec.coord[m]]
                    g = torch.arange(lo, hi, device=local.device)
                    p_ = pad[d - 2] if a["count_include_pad"] else 0
                    counted = ((g >= -p_) & (g < n + p_)).to(local.dtype).reshape(1, 1, -1)
                    frac = F.avg_pool1d(counted, kernel[d - 2], stride[d - 2], 0).reshape(-1)
                    shape = [1] * out_local.ndim
                    shape[d] = -1
                    out_local = out_local / frac.reshape(shape)
        return _wrap_out(out_local, spec, sharded, plans, out_shape)

    return handler


for _nd, _f in ((1, F.max_pool1d), (2, F.max_pool2d), (3, F.max_pool3d), (1, F.max_pool1d_with_indices),
                 (2, F.max_pool2d_with_indices), (3, F.max_pool3d_with_indices)):
    register_function(_f)(_make_pool(_nd, _f, "max"))
for _nd, _f in ((1, F.avg_pool1d), (2, F.avg_pool2d), (3, F.avg_pool3d)):
    register_function(_f)(_make_pool(_nd, _f, "avg"))


def on_chunks(func, x: ShardTensor, args, kwargs):
    """A pooling or resampling op whose windows never cross a rank (only batch or channel dims sharded): torch's
    op on this rank's chunk, each output laid out like the input on the batch and channel dims."""
    local = x.to_local()

    def call(t):
        if args:
            return func(t, *args[1:], **kwargs)
        kw = dict(kwargs)
        kw[next(k for k, v in kwargs.items() if isinstance(v, ShardTensor))] = t
        return func(**kw)

    if local.numel():
        out = call(local)
    else:  # torch refuses an empty batch or channel dim: the output's shape from a meta probe, no values
        probe = call(torch.empty([max(n, 1) for n in local.shape], dtype=local.dtype, device="meta"))
        keep = local.sum() * 0  # (in the graph: the chunk's gradient is an empty one, not none)

        def empty(m):
            shape = list(local.shape[:2]) + list(m.shape[2:])
            return local.new_zeros(shape) + keep if m.is_floating_point() else torch.zeros(
                shape, dtype=m.dtype, device=local.device)
        out = tuple(empty(m) for m in probe) if isinstance(probe, tuple) else empty(probe)
    spec = x._spec

    def wrap(o):
        return ShardTensor.from_spec(o, spec_like(spec.with_(shape=list(spec.shape[:2]) + list(o.shape[2:])),
                                                  o.shape))
    return tuple(wrap(o) for o in out) if isinstance(out, tuple) else wrap(out)


_ADAPTIVE_ARGS = Schema("self", "output_size", "return_indices", return_indices=False)
_ADAPTIVE_DIMS = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
                  F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3,
                  F.adaptive_max_pool1d_with_indices: 1, F.adaptive_max_pool2d_with_indices: 2,
                  F.adaptive_max_pool3d_with_indices: 3}


def _adaptive(func, mean: bool):
    def handler(_func, args, kwargs):
        a = _ADAPTIVE_ARGS.bind(args, kwargs)
        x, size = a["self"], a["output_size"]
        nd = _ADAPTIVE_DIMS[func]
        sizes = list(size) if isinstance(size, (tuple, list)) else [size] * nd  # None: that dim's input size
        if not isinstance(x, ShardTensor):
            return run_function_default(func, args, kwargs)
        if x.ndim == nd + 1:  # unbatched: this handler on the batch of one, whose dim is then dropped
            rest = {k: v for k, v in kwargs.items() if k not in ("input", "self")}
            out = handler(_func, (x.unsqueeze(0), *args[1:]), rest)
            return tuple(o.squeeze(0) for o in out) if isinstance(out, tuple) else out.squeeze(0)
        spatial = tuple(range(x.ndim - nd, x.ndim))
        if mean and all(s == 1 for s in sizes):
            return x.mean(dim=spatial, keepdim=True)  # global pooling: a Partial sum, reduced when needed
        if x.ndim == nd + 2 and not any(isinstance(p, Shard) and p.dim in spatial for p in x._spec.placements):
            return on_chunks(func, without_partial(x), args, kwargs)  # batch or channels sharded: local
        if not any(isinstance(p, Shard) and p.dim in spatial for p in x._spec.placements):
            return run_function_default(func, args, kwargs)
        return unsupported_or_fallback(func, args, kwargs, f"adaptive pooling to {size} over a sharded dim "
                                        f"(only output size 1 of the mean, global pooling, is supported)")
    return handler


for _f in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d):
    register_function(_f)(_adaptive(_f, mean=True))
for _f in (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d, F.adaptive_max_pool1d_with_indices,
           F.adaptive_max_pool2d_with_indices, F.adaptive_max_pool3d_with_indices):
    register_function(_f)(_adaptive(_f, mean=False))
