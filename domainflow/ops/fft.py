"""``torch.fft``: a transform works along whole dims, so a shard on one of them is first moved to another dim
(``redistribute``: an all-to-all of the tensor, as a distributed FFT does), then each rank transforms its
chunk. Handled at the torch-function level, so the backward is torch's own formula on the local chunks plus
the redistribute's transpose: an FNO written with ``torch.fft`` trains domain-parallel. The result stays
laid out with the moved shard (the next op relays it out if it must)."""

from __future__ import annotations

import torch

from domainflow.dispatch.registry import register_function
from domainflow.dispatch.toolkit import layout_rule, run_function_default, spec_like, unsupported_or_fallback, without_partial
from domainflow.ops.dimwise import layout_avoiding
from domainflow.tensor.shard_tensor import ShardTensor

# function -> how many trailing dims it transforms by default (None: all of them, or len(s))
_ONE = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
_TWO = ("fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2")
_N = ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn")


def _dims(name: str, args, kwargs, ndim: int) -> list[int]:
    """The dims a ``torch.fft`` call transforms, non-negative."""
    s = kwargs.get("s", kwargs.get("n", args[1] if len(args) > 1 else None))
    dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    if name in _ONE:
        dims = [-1 if dim is None else dim]
    elif dim is not None:
        dims = [dim] if isinstance(dim, int) else list(dim)
    elif name in _TWO:
        dims = [-2, -1]
    elif s is not None:
        dims = list(range(-len(s), 0))
    else:
        dims = list(range(ndim))
    return sorted(d % ndim for d in dims)


@layout_rule
def _target(spec, dims: tuple):
    """The layout to transform in: ``spec`` with the shards on ``dims`` moved to other dims (None: none free)."""
    return layout_avoiding(spec, set(dims), tuple(spec.shape))


def _handler(name: str):
    def handler(func, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, ShardTensor):
            return run_function_default(func, args, kwargs)
        dims = _dims(name, args, kwargs, x.ndim)
        x = without_partial(x)
        spec = x._spec
        if any(spec.mesh_dim_of(d) is not None for d in dims):
            target = _target(spec, tuple(dims))
            if target is None:
                return unsupported_or_fallback(func, args, kwargs, f"it transforms dim(s) {dims}, which are sharded, "
                                                                   f"and no other dim can take the shard")
            mapping = {m: list(s) for m, s in enumerate(target.sizes) if s is not None}
            x = x.redistribute(list(target.placements), sharding_shapes=mapping)
            spec = target
        rest = list(args[1:])
        call = {k: v for k, v in kwargs.items() if k != "input"}
        local = x.to_local()
        if local.numel() == 0:  # an empty chunk: FFT libraries refuse it; transform one row and keep none
            d = next(k for k, n in enumerate(local.shape) if n == 0)
            probe = local.new_zeros([1 if k == d else n for k, n in enumerate(local.shape)])
            y = func(probe, *rest, **call).narrow(d, 0, 0)
            # joined to the graph (a real zero: a complex one would turn an irfft's real result complex), so its
            # backward takes part in the all-to-all
            y = y + (local.real if local.is_complex() else local).sum() * 0
            return ShardTensor.from_spec(y, spec_like(spec, y.shape))
        y = func(local, *rest, **call)
        return ShardTensor.from_spec(y, spec_like(spec, y.shape))
    return handler


for _name in (*_ONE, *_TWO, *_N):
    _f = getattr(torch.fft, _name, None)
    if _f is not None:
        register_function(_f)(_handler(_name))
