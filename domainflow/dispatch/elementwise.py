"""Which aten ops are elementwise: each output element depends only on the same-index elements of the
(broadcast) inputs, so the op runs on local chunks as they are. Derived from torch's own records, not listed:

1. the ``pointwise`` tag (most arithmetic, activations, comparisons);
2. a decomposition (``torch._decomp``) made of pointwise ops only and returning the broadcast shape, run on meta
   tensors: the activation backwards torch does not tag (``leaky_relu_backward``, ``elu_backward``,
   ``hardtanh_backward``, ``softplus_backward``...), ``hardswish``, ``log_sigmoid_forward``, ``_prelu_kernel``
   and its backward (PReLU's weight broadcast over channels);
3. for ops with no decomposition, a TensorIterator kernel (``structured_inherits: TensorIteratorBase`` in the
   ``native_functions.yaml`` torch ships in ``torchgen``) taking only tensors, scalars and flags and returning
   the broadcast shape (``softshrink_backward``, ``hardshrink_backward``). TensorIterator alone is no such
   record: ``glu`` (a dim), ``mse_loss`` (a reduction) and ``index.Tensor`` (index lists) are built on it.

Records 2 and 3 are read on an op's first call with each kind of arguments (its non-tensor values and its
operands' ranks and dtypes: ``smooth_l1_loss`` is elementwise with ``reduction="none"`` only), on the operands'
global shapes, so every rank decides alike. A new op torch adds in any of these forms is covered without a
line here.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

_POINTWISE = torch.Tag.pointwise
# elementwise ops no record shows: building complex numbers (e.g. for an FFT's input)
_ALSO = frozenset({torch.ops.aten.complex.default, torch.ops.aten.polar.default})
# ops a pointwise decomposition may use besides pointwise ones: dtype casts, copies and aliases of its operands
_CASTS = frozenset({"aten::_to_copy", "aten::clone", "aten::alias", "aten::detach", "aten::copy",
                    "aten::lift_fresh", "prims::convert_element_type"})
# ... and constants, which read no operand's values (``self.new_zeros(())``)
_CONSTANTS = frozenset({"aten::scalar_tensor", "aten::full", "aten::zeros", "aten::ones", "aten::empty",
                        "aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::new_empty",
                        "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::empty_like"})
_FLAG_TYPES = (float, bool, complex, type(None))


def is_tagged_elementwise(func) -> bool:
    """Known elementwise without running anything: torch tags it pointwise."""
    return _POINTWISE in func.tags or func in _ALSO


def may_be_elementwise(func) -> bool:
    """``func`` has a record that :func:`is_elementwise_call` reads (a decomposition or a TensorIterator kernel)."""
    from torch._decomp import decomposition_table

    return func in decomposition_table or func.name() in _tensor_iterator_ops()


def is_elementwise_call(func, args, kwargs) -> bool:
    """Whether this call of ``func`` (untagged) is elementwise, by its decomposition or its TensorIterator
    kernel (module docstring); decided once per kind of arguments."""
    kind = _kind((args, sorted(kwargs.items())))
    hit = _decisions.get((func, kind))
    if hit is None:
        hit = _decisions[(func, kind)] = _elementwise_on_meta(func, args, kwargs)
    return hit


_decisions: dict = {}


def _kind(a):
    """What an op's decomposition may branch on, hashable: non-tensor values, and tensors' ranks and dtypes."""
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dim(), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_kind(b) for b in a)
    try:
        hash(a)
    except TypeError:
        return repr(a)
    return a


def _elementwise_on_meta(func, args, kwargs) -> bool:
    from torch._decomp import decomposition_table

    tensors = []

    def meta(a):
        if isinstance(a, torch.Tensor):
            m = torch.empty([n or 2 for n in a.shape], dtype=a.dtype, device="meta")
            tensors.append(m)
            return m
        if isinstance(a, (list, tuple)):
            return type(a)(meta(b) for b in a)
        return a

    margs = [meta(a) for a in args]
    mkwargs = {k: meta(v) for k, v in kwargs.items()}
    if not tensors:
        return False
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return False
    decomposition = decomposition_table.get(func)
    if decomposition is not None:
        recorder = _OpRecorder()
        try:
            with recorder:
                out = decomposition(*margs, **mkwargs)
        except Exception:  # noqa: BLE001 - a decomposition that cannot run on meta tensors proves nothing
            return False
        return (_broadcast_shaped(out, shape) and all(_allowed(f) for f in recorder.calls)
                and _same_on_a_slice(func, args, kwargs))
    if func.name() not in _tensor_iterator_ops():
        return False
    flags = [a for a in [*args, *kwargs.values()] if not isinstance(a, torch.Tensor)]
    if not all(isinstance(a, _FLAG_TYPES) for a in flags):  # an int may be a dim or a reduction
        return False
    try:
        out = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: nothing proven
        return False
    return _broadcast_shaped(out, shape) and _same_on_a_slice(func, args, kwargs)


def _same_on_a_slice(func, args, kwargs) -> bool:
    """The op run on the first two of three rows of its operands (along each dim in turn) gives the first two
    rows of its result on all three: what running it on local chunks needs, and what pointwise ops alone do not
    show, since a decomposition may scale by an operand's size (``soft_margin_loss_backward`` divides by the
    operand's numel with reduction="mean"). Small CPU tensors of fixed values, once per kind of arguments."""
    gen = torch.Generator().manual_seed(0)
    tensors = []

    def real(a):
        if isinstance(a, torch.Tensor):
            shape = [1 if n == 1 else 3 for n in a.shape]
            if a.dtype.is_floating_point or a.dtype.is_complex:
                t = (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(a.dtype)
            elif a.dtype == torch.bool:
                t = torch.rand(shape, generator=gen) > 0.5
            else:
                t = torch.randint(0, 3, shape, generator=gen).to(a.dtype)
            tensors.append(t)
            return t
        if isinstance(a, (list, tuple)):
            return type(a)(real(b) for b in a)
        return a

    rargs, rkwargs = [real(a) for a in args], {k: real(v) for k, v in kwargs.items()}
    try:
        whole = func(*rargs, **rkwargs)
        outs = whole if isinstance(whole, (tuple, list)) else (whole,)
        for d in range(1, max(t.dim() for t in tensors) + 1):  # counted from the right, as broadcasting aligns

            def cut(a, d=d):
                if isinstance(a, torch.Tensor):
                    return a.narrow(a.dim() - d, 0, 2) if a.dim() >= d and a.shape[-d] == 3 else a
                if isinstance(a, (list, tuple)):
                    return type(a)(cut(b) for b in a)
                return a

            part = func(*[cut(a) for a in rargs], **{k: cut(v) for k, v in rkwargs.items()})
            for o, p in zip(outs, part if isinstance(part, (tuple, list)) else (part,)):
                want = cut(o)
                if want.shape != p.shape or not (
                        torch.allclose(p, want, rtol=1e-4, atol=1e-6, equal_nan=True)
                        if p.is_floating_point() or p.is_complex() else torch.equal(p, want)):
                    return False
    except Exception:  # noqa: BLE001 - an op that cannot run on such values proves nothing
        return False
    return True


def _broadcast_shaped(out, shape) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(isinstance(o, torch.Tensor) and o.shape == shape for o in outs)


def _allowed(func) -> bool:
    return (_POINTWISE in func.tags or func in _ALSO or func._schema.name in _CASTS
            or func._schema.name in _CONSTANTS)


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops a decomposition runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # below autograd (as inside the engine) ops torch writes in others (``to``, ``__or__``) arrive whole
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        self.calls.append(func)
        return func(*args, **kwargs)


@functools.cache
def _tensor_iterator_ops() -> frozenset[str]:
    """Names (as ``OpOverload.name()`` spells them) of the ops torch builds on TensorIterator: the structured
    ``out=`` kernels inheriting TensorIteratorBase and the ops delegating to them, from torch's packaged
    ``native_functions.yaml`` (scanned, not parsed: a few milliseconds; empty where a build lacks it)."""
    spec = importlib.util.find_spec("torchgen")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    path = os.path.join(spec.submodule_search_locations[0], "packaged", "ATen", "native", "native_functions.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return frozenset()
    kernels, delegates = set(), []
    for entry in text.split("\n- func: ")[1:]:
        name = entry[:entry.find("(")]
        if "structured_inherits: TensorIteratorBase" in entry:
            kernels.add(name)
        at = entry.find("structured_delegate:")
        if at >= 0:
            delegates.append((name, entry[at + len("structured_delegate:"):].split("\n", 1)[0].strip()))
    names = kernels | {name for name, target in delegates if target in kernels}
    return frozenset("aten::" + n.removesuffix(".default") for n in names)
