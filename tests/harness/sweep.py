"""Worker-side helpers for sweep tests that run many cases per rank function and report every failure
together: random float64 tensors, layouts with empty shards, and collecting ``check_sharded`` failures."""

from __future__ import annotations

import random

import torch

from sharded_check import check_sharded, random_sizes


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    """A float64 normal tensor from ``gen``."""
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def empty_shard_layouts(n: int, parts: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Layouts of ``n`` rows over ``parts`` ranks with empty shards: first empty, last empty, all rows on
    one middle rank, plus one random (zeros likely)."""
    if parts == 1:
        return [(n,)]
    out = [(0,) * (parts - 1) + (n,), (n,) + (0,) * (parts - 1)]
    mid = [0] * parts
    mid[parts // 2] = n
    out.append(tuple(mid))
    if parts >= 3 and n >= 2:
        out.append((0, n - 1) + (0,) * (parts - 3) + (1,))
    out.append(random_sizes(n, parts, rng))
    return list(dict.fromkeys(out))[:4]


def check_into(fn, inputs, mesh, name, failures, **kw) -> None:
    """``check_sharded``; a failure is appended to ``failures`` with the case's name instead of raised."""
    try:
        check_sharded(fn, inputs, mesh, **kw)
    except Exception as e:  # noqa: BLE001 - collect every failing case with its name
        failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def none_failed(failures) -> bool:
    """Assert no case failed (all named in the message); True for ``all(dist.run(...))``."""
    assert not failures, "\n".join(failures)
    return True


def error_line(e: BaseException) -> str:
    """An exception in one line, for a problem list."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def no_problems(results) -> None:
    """``results``: one list of problem strings per rank."""
    bad = {r: p for r, p in enumerate(results) if p}
    assert not bad, "\n".join(f"rank {r}: {p}" for r, ps in bad.items() for p in ps)
