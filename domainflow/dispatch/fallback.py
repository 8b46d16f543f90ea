"""Opt-in slow path for ops without a sharding rule: gather -> compute on full tensors -> re-shard."""

from __future__ import annotations

import contextvars
import warnings

_MODES = ("error", "gather")
_mode: contextvars.ContextVar[str] = contextvars.ContextVar("domainflow_fallback", default="error")
_warned: set = set()


class fallback:
    """``with domainflow.fallback("gather"):`` lets unsupported ops run on gathered full tensors
    (warning once per op); ``domainflow.fallback.set("gather")`` makes it the default."""

    def __init__(self, mode: str = "gather"):
        _check(mode)
        self.mode = mode
        self._token = None

    def __enter__(self):
        self._token = _mode.set(self.mode)
        return self

    def __exit__(self, *exc):
        _mode.reset(self._token)
        return False

    @staticmethod
    def set(mode: str) -> None:
        _check(mode)
        _mode.set(mode)

    @staticmethod
    def current() -> str:
        return _mode.get()


def _check(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"fallback mode {mode!r} is not one of {_MODES}")


def warn_once(op, detail: str) -> None:
    if op in _warned:
        return
    _warned.add(op)
    warnings.warn(f"domainflow fallback('gather') for {op}: {detail}. This gathers full tensors on every rank; "
                  f"register a handler to keep it sharded.", stacklevel=4)
