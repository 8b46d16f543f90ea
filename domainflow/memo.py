"""The one bounded memo every layer caches its plans in (layouts, redistributions, halo fetches, learnt calls).

Layout plans repeat every step, so they are computed once per key; a long run with ever new shapes (a
growing sequence, many grid sizes) must not grow without bound. ``Memo`` keeps two generations of dicts:
new entries go to the recent one; when it holds half the capacity it becomes the old one and the previous
old one is dropped; a hit in the old generation moves the entry back. So entries used in the last half of
the capacity's inserts survive (approximately least-recently-used eviction), and a hit costs one dict
lookup, with no reordering and no lock (each step is one atomic dict operation; a race may drop or
recompute an entry, never corrupt one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

_MISS = object()


class Memo:
    """A bounded memo of up to ``size`` entries (at least 2). ``memo.recent.get(key)`` is the fastest hit
    test for hot paths; fall back to :meth:`get` when it misses."""

    __slots__ = ("name", "size", "recent", "old")

    def __init__(self, size: int, name: str):
        self.name = name
        self.size = size
        self.recent: dict = {}
        self.old: dict = {}

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value stored under ``key`` (moved back to the recent generation), else ``default``."""
        value = self.recent.get(key, _MISS)
        if value is not _MISS:
            return value
        value = self.old.pop(key, _MISS)
        if value is _MISS:
            return default
        self.put(key, value)
        return value

    def put(self, key: Hashable, value: Any) -> Any:
        """Store ``value`` under ``key`` (the oldest generation is dropped when the recent one is full)."""
        recent = self.recent
        if len(recent) >= max(1, self.size // 2):
            self.old = recent
            recent = self.recent = {}
        recent[key] = value
        return value

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value under ``key``, computing and storing ``make()`` on a miss."""
        value = self.recent.get(key, _MISS)
        if value is _MISS:
            value = self.get(key, _MISS)
            if value is _MISS:
                value = self.put(key, make())
        return value

    def clear(self) -> None:
        self.recent = {}
        self.old = {}

    def items(self) -> list:
        return list(self.old.items()) + list(self.recent.items())

    def values(self) -> list:
        return [v for _, v in self.items()]

    def __contains__(self, key) -> bool:
        return key in self.recent or key in self.old

    def __len__(self) -> int:
        return len(self.recent) + len(self.old)

    def __repr__(self) -> str:
        return f"Memo({self.name!r}, {len(self)}/{self.size} entries)"


# The one cache of plans: the layouts op handlers derive (keyed on the op or rule, its static arguments
# and the input layouts), the calls the fast path learnt (keyed on the function first), redistribution
# steps and halo fetch plans. Cleared when a handler is registered (what was derived may change).
PLANS = Memo(65536, "plans")


def memoized(memo: Memo) -> Callable[[Callable], Callable]:
    """Decorator: cache a pure function of hashable arguments in ``memo``, keyed on (function, arguments)."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args):
            key = (fn, args)
            value = memo.recent.get(key, _MISS)
            if value is _MISS:
                value = memo.get(key, _MISS)
                if value is _MISS:
                    value = memo.put(key, fn(*args))
            return value

        return wrapper

    return deco
