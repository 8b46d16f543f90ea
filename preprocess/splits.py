"""Train / val / test splits: seeded by fractions, or read from a JSON file; recorded in the store.

Mesh stores split by run (a seeded shuffle of run ids: runs are independent samples). Grid stores split
by time into contiguous blocks in time order (train first), because neighbouring time steps are strongly
correlated and a random split would leak the validation period into training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .errors import IngestError

SPLITS = ("train", "val", "test")


def check_fractions(fractions) -> tuple[float, float, float]:
    f = tuple(float(x) for x in fractions)
    if len(f) != 3 or min(f) < 0 or abs(sum(f) - 1) > 1e-6 or f[0] <= 0:
        raise IngestError(f"--split must be three non-negative fractions train,val,test summing to 1 with "
                          f"train > 0, e.g. 0.8,0.1,0.1; got {list(fractions)}")
    return f


def split_counts(n: int, fractions) -> tuple[int, int, int]:
    """Sizes of train/val/test for ``n`` items: val and test get at least one item each when their
    fraction is positive and there are enough items to keep one for training; train gets the rest."""
    counts = [0, 0, 0]
    for k in (1, 2):
        counts[k] = int(np.floor(fractions[k] * n + 0.5))
        if fractions[k] > 0 and counts[k] == 0 and n >= 3:
            counts[k] = 1
    while counts[1] + counts[2] > max(0, n - 1):
        counts[2 if counts[2] >= counts[1] else 1] -= 1
    counts[0] = n - counts[1] - counts[2]
    return counts[0], counts[1], counts[2]


def read_split_file(path) -> dict:
    """The JSON object ``{"train": [...], "val": [...], "test": [...]}`` (val/test optional)."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise IngestError(f"split file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise IngestError(f"split file {path} is not JSON ({exc}); expected "
                          f'{{"train": [...], "val": [...], "test": [...]}}') from None
    if not isinstance(data, dict) or not set(data) <= set(SPLITS) or "train" not in data:
        raise IngestError(f'split file {path} must be a JSON object with keys "train" (required), "val", "test"; '
                          f"got keys {sorted(data) if isinstance(data, dict) else type(data).__name__}")
    for k in SPLITS:
        if not isinstance(data.get(k, []), list):
            raise IngestError(f"split file {path}: {k!r} must be a list, got {type(data[k]).__name__} {data[k]!r}")
    if not data["train"]:
        raise IngestError(f"split file {path}: the train list is empty; statistics are computed over the train "
                          f"split, so it needs at least one entry")
    return {k: list(data.get(k, [])) for k in SPLITS}


def _run_name(r) -> str:
    return f"run_{int(r)}" if isinstance(r, int) or str(r).isdigit() else str(r)


def _run_key(name: str):
    return (0, int(name[4:]), "") if name.startswith("run_") and name[4:].isdigit() else (1, 0, name)


def split_runs(runs: list[str], fractions, seed: int, split_file=None) -> dict[str, list[str]]:
    """Run ids per split: a seeded shuffle cut by ``fractions``, or the file's lists (ids or numbers)."""
    given = read_split_file(split_file)
    if given is not None:
        given = {k: [_run_name(r) for r in v] for k, v in given.items()}
        listed = [r for k in SPLITS for r in given[k]]
        dup = sorted({r for r in listed if listed.count(r) > 1}, key=_run_key)
        unknown = sorted(set(listed) - set(runs), key=_run_key)
        if dup:
            raise IngestError(f"split file {split_file} lists {dup} more than once")
        if unknown:
            raise IngestError(f"split file {split_file} names runs that are not in RAW: {unknown[:10]}")
        return {k: sorted(v, key=_run_key) for k, v in given.items()}
    n_train, n_val, _ = split_counts(len(runs), fractions)
    picked = [runs[i] for i in np.random.default_rng(seed).permutation(len(runs))]
    cuts = {"train": picked[:n_train], "val": picked[n_train:n_train + n_val], "test": picked[n_train + n_val:]}
    return {k: sorted(v, key=_run_key) for k, v in cuts.items()}


def split_times(steps: int, fractions, split_file=None) -> dict[str, list[list[int]]]:
    """Half-open time-index ranges ``[[start, stop], ...]`` per split: contiguous blocks in time order,
    or the file's ranges (checked to lie in ``[0, steps)`` and not to overlap)."""
    given = read_split_file(split_file)
    if given is None:
        n_train, n_val, n_test = split_counts(steps, fractions)
        bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, steps)}
        return {k: [[a, b]] if b > a else [] for k, (a, b) in bounds.items()}
    seen = np.zeros(steps, dtype=bool)
    out = {}
    for k in SPLITS:
        out[k] = []
        for rng in given[k]:
            if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng)
                    and 0 <= rng[0] < rng[1] <= steps):
                raise IngestError(f"split file {split_file}: {k} entry {rng!r} is not a time-index range "
                                  f"[start, stop) with 0 <= start < stop <= {steps}")
            if seen[rng[0]:rng[1]].any():
                raise IngestError(f"split file {split_file}: {k} range {rng} overlaps another range")
            seen[rng[0]:rng[1]] = True
            out[k].append(list(rng))
    return out


def time_mask(ranges, steps: int) -> np.ndarray:
    """Boolean mask over ``steps`` time indices covered by ``ranges``."""
    mask = np.zeros(steps, dtype=bool)
    for a, b in ranges:
        mask[a:b] = True
    return mask
