"""Raw values ingest reads and checks besides its VTK meshes (those are ``domainflow.vtk``'s): a run's one-row
CSV files (:func:`read_csv_row`) and arrays that must be finite (:func:`check_finite`). Errors are
:class:`IngestError`\\ s naming the file."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .errors import IngestError


def read_csv_row(path: Path) -> dict[str, float]:
    """A one-row CSV (header + values) such as DrivaerML's force and geometry files, as {column: value}."""
    if not path.exists():
        raise IngestError(f"{path} is missing")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [r for r in csv.reader(f) if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise IngestError(f"{path}: not a readable CSV text file ({type(exc).__name__}: {exc})") from None
    if len(rows) != 2:
        raise IngestError(f"{path}: expected a header line and one row of values, found {len(rows)} non-empty lines")
    header, values = [h.strip() for h in rows[0]], [v.strip() for v in rows[1]]
    repeated = sorted({h for h in header if header.count(h) > 1})
    if repeated:
        raise IngestError(f"{path}: column name(s) {repeated} appear more than once in the header")
    if len(header) != len(values):
        raise IngestError(f"{path}: {len(header)} column names but {len(values)} values")
    out = {}
    for h, v in zip(header, values):
        try:
            out[h] = float(v)
        except ValueError:
            raise IngestError(f"{path}: column {h!r} holds {v!r}, not a number") from None
        if not np.isfinite(out[h]):
            raise IngestError(f"{path}: column {h!r} is {v}")
    return out


def check_finite(values: np.ndarray, what: str) -> None:
    """Refuse NaN/Inf, naming the array, how many and the first bad row."""
    bad = ~np.isfinite(values)
    if bad.any():
        rows = bad.reshape(len(values), -1).any(axis=1)
        first = int(np.argmax(rows))
        raise IngestError(f"{what}: {int(rows.sum())} of {len(values)} cells hold NaN/Inf (first at cell {first}); "
                          f"fix or drop this run (--on-error skip records it and carries on)")
