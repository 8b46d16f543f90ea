"""Named error classes: each message names the input at fault and the fix."""

from __future__ import annotations


class DomainflowError(Exception):
    """Base class of every error domainflow raises on purpose."""


class UnsupportedShardedOp(DomainflowError, NotImplementedError):
    """An op touches a sharded dim and no handler is registered for it."""

    def __init__(self, op, reason: str):
        self.op = op
        name = str(op) if str(op).startswith(("aten.", "prims.")) or "::" in str(op) or "." in str(op) and not hasattr(op, "__qualname__") else (getattr(op, "__name__", None) or str(op))
        super().__init__(
            f"domainflow has no sharding rule for {name}: {reason}.\n"
            f"Fixes: redistribute the operand first (x.redistribute([Replicate()]) or a Shard on another dim); "
            f"register a handler with @domainflow.register_aten({_aten_name(op)}) or "
            f"@domainflow.register_function(<python function>); or opt in to the slow path with "
            f"`with domainflow.fallback('gather'):` (gathers the full tensor on every rank)."
        )


def _aten_name(op) -> str:
    text = str(op)
    return f"torch.ops.{text}" if text.startswith("aten.") else "torch.ops.<ns>.<op>.<overload>"


class ShardingMismatchError(DomainflowError, ValueError):
    """Operands or ranks disagree about a layout that must agree."""


class ShardingShapeError(DomainflowError, ValueError):
    """Sharding shapes given by the user do not describe the tensor."""


class CollectiveError(DomainflowError, RuntimeError):
    """A collective failed or timed out; the message names rank, op and mesh dim."""


class ReplicaMismatchError(DomainflowError, ValueError):
    """A tensor that must be equal on every rank (a replicated parameter) differs between ranks."""


class CompileUnsupportedError(DomainflowError, RuntimeError):
    """An exchange between ranks that domainflow cannot record in a torch.compile graph was reached while
    torch.compile traced (only halo row fetches, all-reduces and ring shifts are traced, as functional
    collectives: see docs/engine-and-handlers.md, "torch.compile"), or a domain-parallel model was traced by
    a raw ``torch.compile`` instead of ``domainflow.compile`` (which checks across ranks before each call)."""

    op: str | None = None  # the op whose rule reached the exchange, once named (:meth:`naming`)
    exchange: str | None = None  # what it refused, before an op was named

    def naming(self, op: str) -> "CompileUnsupportedError":
        """This refusal naming ``op``, whose rule reached the exchange (each engine call it passes through
        names its own op: the outermost, the op the model called, is named last); itself where it is not about
        an exchange (a raw torch.compile refused)."""
        if self._custom:
            return self
        exchange = self.exchange or self.what
        named = CompileUnsupportedError(f"{op} on a sharded tensor ({exchange})")
        named.op, named.exchange = op, exchange
        return named

    def __init__(self, what: str, message: str | None = None):
        self.what = what
        self._custom = message is not None
        super().__init__(message or (
            f"domainflow cannot trace {what} under torch.compile (only halo row fetches, all-reduces and ring "
            f"shifts compile); run this region eagerly: wrap it in torch.compiler.disable, or compile only the "
            f"parts without it"))
