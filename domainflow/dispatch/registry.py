"""The one op registry: handlers for Python-level functions and for aten / custom ops.

Handlers take ``(func, args, kwargs)`` and return the op's result (ShardTensors where sharded).
Registration happens on import, on every device; re-registering an op replaces its handler.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Handler = Callable[..., object]


class OpRegistry:
    """Two tables: ``functions`` (consulted by ``__torch_function__``) and ``aten`` (``__torch_dispatch__``)."""

    def __init__(self):
        self.functions: dict[object, Handler] = {}
        self.aten: dict[torch._ops.OpOverload, Handler] = {}
        self.pointwise: Handler | None = None  # the rule for ops tagged pointwise (ops/pointwise.py)
        self._listeners: list[Callable[[], None]] = []

    def register_pointwise(self, handler: Handler) -> Handler:
        """Install the rule the engine applies to aten ops tagged pointwise that have no handler of their own."""
        self.pointwise = handler
        for listener in self._listeners:
            listener()
        return handler

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever a handler or the pointwise rule is registered (the engine forgets its
        cached routes and learnt fast-path layouts)."""
        self._listeners.append(listener)

    def register_function(self, *funcs) -> Callable[[Handler], Handler]:
        """Decorator: ``@register_function(torch.nn.functional.conv2d)`` routes that function to the handler."""
        if not funcs:
            raise TypeError("register_function needs at least one function")

        def deco(handler: Handler) -> Handler:
            for f in funcs:
                self.functions[f] = handler
            for listener in self._listeners:
                listener()
            return handler

        return deco

    def register_aten(self, *ops) -> Callable[[Handler], Handler]:
        """Decorator: ``@register_aten(torch.ops.aten.foo.default)``. Accepts op overloads, overload packets
        (all overloads) and ops made with ``torch.library.custom_op``."""
        if not ops:
            raise TypeError("register_aten needs at least one op")
        overloads = [o for op in ops for o in _overloads(op)]

        def deco(handler: Handler) -> Handler:
            for o in overloads:
                self.aten[o] = handler
            for listener in self._listeners:
                listener()
            return handler

        return deco


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    inner = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(inner, torch._ops.OpOverload):
        return [inner]
    raise TypeError(f"register_aten expects a torch.ops overload, packet or custom op, not {op!r}")


REGISTRY = OpRegistry()
register_function = REGISTRY.register_function
register_aten = REGISTRY.register_aten
