"""Missing values of a climate source (NaN after xarray's CF decoding: ``_FillValue``, ``missing_value``, NaN):
refused by default, or filled by an explicit ``--fill`` policy that the store records.

An ocean variable (SST) is missing over land at every step, so refusing it outright would leave a climate
user no way in; storing the gaps as numbers without saying so would make them silently wrong. The policy
``--fill`` names, per variable or channel (or ``*`` for all): ``mean`` (the train split's mean of the
channel's valid values) or a number in the variable's units (``--fill sst=271.46``). Ingest writes the
gaps as NaN first, counts them per channel over the whole source, then either refuses (naming every
channel with gaps, its count and first place) or fills them in a second, resumable pass; the store's attrs
record each filled channel's policy, value and count (``grid.missing``), and statistics are those of the
valid values only.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import IngestError

EXAMPLE = "--fill mean, --fill sst=mean or --fill sst=271.46,tcwv=0"


def parse_fill(text) -> dict[str, str | float]:
    """``mean`` | ``VALUE`` | ``SEL=mean|VALUE,...`` (SEL a variable or channel) -> {selector or "*": policy}."""
    if text is None or text == {}:
        return {}
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in (p.strip() for p in str(text).split(",")):
            if not part:
                continue
            sel, _, value = part.rpartition("=")
            items.append((sel.strip() or "*", value.strip()))
    out: dict[str, str | float] = {}
    for sel, value in items:
        if sel in out:
            raise IngestError(f"--fill names {sel!r} twice; give one policy per variable ({EXAMPLE})")
        out[sel] = _policy(sel, value)
    return out


def _policy(sel: str, value) -> str | float:
    if isinstance(value, str) and value.lower() == "mean":
        return "mean"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise IngestError(f"--fill {sel}={value}: a policy is 'mean' or a number in the variable's units "
                          f"({EXAMPLE})") from None
    with np.errstate(over="ignore"):
        as_stored = np.float32(number)
    if not math.isfinite(number) or not np.isfinite(as_stored):
        raise IngestError(f"--fill {sel}={value}: the fill value must be a finite number within float32's range, "
                          f"as the store holds it ({EXAMPLE})")
    return number


def policies(fill: dict, channels) -> dict[str, str | float]:
    """{channel name: policy} for ``channels`` (``Channel``s): a channel's own name wins over its variable's,
    which wins over ``*``. A selector that names nothing is an error."""
    names = {c.name for c in channels} | {c.variable for c in channels}
    unknown = sorted(s for s in fill if s != "*" and s not in names)
    if unknown:
        raise IngestError(f"--fill names {unknown}, which are not among the channels "
                          f"{[c.name for c in channels]} (or their variables)")
    out = {}
    for c in channels:
        for sel in (c.name, c.variable, "*"):
            if sel in fill:
                out[c.name] = fill[sel]
                break
    return out


def first_missing(block: np.ndarray) -> tuple[int, list[int] | None]:
    """(count, first (step, row, column)) of the NaNs of a (steps, H, W) block."""
    nan = np.isnan(block)
    count = int(nan.sum())
    if not count:
        return 0, None
    return count, [int(v[0]) for v in np.nonzero(nan)]


def fill_value(policy, mean: float) -> float:
    """The number a policy puts in the gaps (``mean``: the train mean of the valid values)."""
    return float(np.float32(mean if policy == "mean" else policy))


def fill_block(store: str, t0: int, t1: int, values: dict, mask_of: dict | None = None) -> int:
    """Replace the NaNs of ``data[t0:t1, c]`` by ``values[c]`` ({channel index: number}); returns how many.
    With ``mask_of`` ({channel index: index in the store's ``missing`` array}) the places filled are first
    added to that mask, which scores use to leave filled points out. Rerunning it is harmless: a filled
    block holds no NaN, and the mask is only ever added to."""
    import zarr

    from domainflow.store.chunks import read_checked

    from .store_writer import for_writing

    root = zarr.open_group(store, mode="r+")
    out = for_writing(root["data"])
    mask = for_writing(root["missing"]) if mask_of else None
    filled = 0
    for c, v in values.items():
        block = read_checked(store, out, (slice(t0, t1), int(c)))  # a damaged chunk: named
        nan = np.isnan(block)
        if mask is not None:  # before the fill: a task killed between the two redoes both
            f = int(mask_of[c])
            mask[t0:t1, f] = read_checked(store, mask, (slice(t0, t1), f)) | nan
        if nan.any():
            block[nan] = v
            out[t0:t1, int(c)] = block
            filled += int(nan.sum())
    return filled
