"""Values the ``domainflow`` subcommands parse from the command line: sizes (2GiB) and lists of numbers."""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """A size such as 2GiB, 512MiB, 1.5G or 1000000 (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB or 1500000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_floats(text: str, n: int, what: str) -> tuple[float, ...]:
    """``n`` comma-separated numbers (``what``: the option, for the message)."""
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != n:
        raise argparse.ArgumentTypeError(f"{what} takes {n} comma-separated numbers, got {text!r}")
    return vals
