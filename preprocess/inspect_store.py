"""``domainflow inspect STORE``: what a store holds and how evenly it splits over a domain of W ranks."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from domainflow import remote
from domainflow.layout.shapes import balanced_sizes, rows_per_rank
from domainflow.store.chunks import read_checked
from domainflow.store.format import checksummed

from .errors import IngestError


def _disk_bytes(path) -> int:
    if remote.is_url(path):
        fs, root = remote.filesystem(str(path))
        return int(fs.du(root))
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def _fmt_vec(values, width=4) -> str:
    vals = list(values)
    shown = ", ".join(f"{v:.4g}" for v in vals[:width])
    return f"[{shown}{', ...' if len(vals) > width else ''}]"


def describe(path, domains=(1, 2, 3, 4, 8)) -> str:
    """A human-readable report of the store at ``path``."""
    import zarr

    path = str(path).rstrip("/") if remote.is_url(path) else Path(path)
    where = remote.zarr_store(path) if remote.is_url(path) else path  # a missing backend: its own line
    try:
        root = zarr.open_group(where, mode="r")
        head = dict(root.attrs["domainflow"])
    except Exception:
        raise IngestError(f"{path} is not a domainflow store (no zarr group with attrs['domainflow']); "
                          f"create one with `domainflow ingest`") from None
    lines = [f"{path}: {head.get('kind')} store, format {head.get('format')}, "
             f"{'complete' if head.get('complete') else 'INCOMPLETE'}",
             f"  source: {head.get('source')}", f"  stored: {_fmt_bytes(_disk_bytes(path))} on disk",
             f"  checksums: {_checksums(root)}"]
    if not head.get("complete"):
        lines.append("  the ingest that writes it was interrupted or is still running; rerun the same "
                     "`domainflow ingest` command to resume")
    config = root.attrs.get("ingest", {}).get("config", {})
    read = functools.partial(read_checked, path)  # a damaged chunk of what inspect reads is named, not a traceback
    if head.get("kind") == "mesh":
        lines += _describe_mesh(root, head, config, domains, read)
    elif head.get("kind") == "grid":
        lines += _describe_grid(root, config, domains, read)
    if root.attrs.get("stats"):
        lines.append("  normalisation statistics (train split): key count mean std min max")
        for key, s in root.attrs["stats"].items():
            lines.append(f"    {key:<24} {s['count']:>10,} {_fmt_vec(s['mean'])} {_fmt_vec(s['std'])} "
                         f"{_fmt_vec(s['min'])} {_fmt_vec(s['max'])}")
    return "\n".join(lines)


def _checksums(root) -> str:
    """Whether the store's chunks carry checksums (from every array's metadata; no chunk is read)."""
    import zarr

    arrays = {name: node for name, node in root.members(max_depth=None) if isinstance(node, zarr.Array)}
    bare = sorted(name for name, node in arrays.items() if not checksummed(node))
    if not arrays:
        return "no arrays yet"
    if not bare:
        return "crc32c on every array (a flipped bit is an error naming its chunk)"
    if len(bare) == len(arrays):
        return ("none (written before checksums; re-ingest to add them: `domainflow ingest ... --overwrite`; "
                "until then a flipped bit reads as data)")
    return (f"crc32c on {len(arrays) - len(bare)} of {len(arrays)} arrays, none on {', '.join(bare[:3])}"
            f"{' ...' if len(bare) > 3 else ''}; re-ingest to add them (`domainflow ingest ... --overwrite`)")


def _describe_mesh(root, head, config, domains, read) -> list[str]:
    P = int(head["parts"])
    lines = [f"  parts: {P} ({config.get('partition', '?')}); reference: {config.get('reference', {})}"]
    splits = root.attrs.get("splits", {})
    runs = sorted(root["runs"].group_keys(), key=lambda s: (len(s), s))
    lines.append(f"  runs: {len(runs)} published" + ("; splits: " + ", ".join(f"{k} {len(v)}" for k, v in
                                                                              splits.items()) if splits else ""))
    skipped = root.attrs.get("skipped", {})
    for run, why in skipped.items():
        lines.append(f"  skipped {run}: {why}")
    if not runs:
        return lines
    first = root["runs"][runs[0]]
    lines.append(f"  arrays of {runs[0]} (every run has the same arrays, its own row count):")
    for loc in ("surface", "volume"):
        if loc not in first:
            continue
        for name, arr in sorted(first[loc].arrays()):
            lines.append(f"    {loc + '/' + name:<26} {str(arr.shape):<14} {str(arr.dtype):<8} chunks {arr.chunks}")
        for name, arr in sorted(first[loc]["fields"].arrays()):
            lines.append(f"    {loc + '/fields/' + name:<26} {str(arr.shape):<14} {str(arr.dtype):<8} chunks {arr.chunks}")
    for loc in ("surface", "volume"):
        offsets = {r: read(root["runs"][r][loc]["parts"]) for r in runs if loc in root["runs"][r]}
        if not offsets:
            continue
        cells = np.array([o[-1] for o in offsets.values()])
        lines.append(f"  {loc} cells per run: min {cells.min():,} mean {cells.mean():,.0f} max {cells.max():,}")
        edges = [root["runs"][r].attrs.get("edges", {}).get(loc) for r in offsets]
        if all(e is not None for e in edges):
            lines.append(f"  {loc} edges per run (cells that touch, both directions): min {min(edges):,} max "
                         f"{max(edges):,}")
        lines.append(f"  {loc} partition balance (rows per rank over all runs; imbalance = max / mean):")
        for W in domains:
            if W > P:
                continue
            per = np.array([rows_per_rank(o, W) for o in offsets.values()])
            imb = max((p.max() / p.mean()) if p.mean() else 1.0 for p in per)
            lines.append(f"    domain {W}: min {per.min():,} max {per.max():,} rows per rank, worst imbalance "
                         f"{imb:.3f}")
    return lines


def _describe_grid(root, config, domains, read) -> list[str]:
    lines = []
    if "data" not in root:
        return lines + ["  no data array yet"]
    data = root["data"]
    T, C, H, W = data.shape
    variables = config.get("variables", [])
    lines.append(f"  data {data.shape} {data.dtype} chunks {data.chunks}; channels {variables}")
    levels = root.attrs.get("grid", {}).get("levels", {})
    if levels:
        lines.append("  pressure levels (hPa): " + "; ".join(f"{v}: {', '.join(f'{x:g}' for x in ls)}"
                                                          for v, ls in levels.items()))
    fields = root.attrs.get("fields", {})

    def described(v):  # units, and what a value is when the source says (a GRIB step type: accum, avg...)
        f = fields.get(f"grid/{v}", {})
        kind = f.get("step_type")
        return f"{v} [{f.get('units', '')}]" + (f" ({kind})" if kind and kind != "instant" else "")

    if variables:
        lines.append("  channel units: " + ", ".join(described(v) for v in variables))
    meaning = root["time"].attrs.get("meaning")
    lines.append(f"  time: {T} steps, {_time_range(root['time'], read)}" + (f" ({meaning})" if meaning else ""))
    grid = root.attrs.get("grid", {})
    if grid.get("source", {}).get("member") is not None:
        lines.append(f"  ensemble member: {grid['source']['member']:g}")
    statics = grid.get("static", [])
    if statics:
        lines.append(f"  static fields {tuple(root['static'].shape)} (constant input channels): " + ", ".join(
            f"{n} [{fields.get(f'static/{n}', {}).get('units', '')}]" for n in statics))
    for v, m in grid.get("missing", {}).items():
        how = "the train mean of its valid values" if m["policy"] == "mean" else "a fixed value"
        size = H * W if v in statics else T * H * W
        lines.append(f"  {v}: {m['count']} missing values ({100 * m['count'] / size:.2g}% of its values) "
                     f"filled with {m['value']:g}, {how} (--fill); its statistics are of the valid values")
    clim = root.attrs.get("grid", {}).get("climatology")
    if clim:
        if clim.get("dated"):
            filled = max(clim.get("filled_entries", {}).values(), default=0)
            lines.append(f"  climatology (train split): by day of year and hour ({', '.join(map(str, clim['hours']))} "
                         f"h), {clim['window_days']}-day window; {filled} of {clim['entries_per_channel']} entries "
                         f"per channel have no train step in their window (the hour's train mean)")
        else:
            lines.append("  climatology (train split): the train mean per grid point (the time axis has no dates)")
    lat, lon = read(root["lat"]), read(root["lon"])
    lines.append(f"  lat {H}: {lat[0]:.3f} .. {lat[-1]:.3f}; lon {W}: {lon[0]:.3f} .. {lon[-1]:.3f}; "
                 f"periodic in lon: {root.attrs.get('grid', {}).get('periodic_lon', '?')}")
    for k, ranges in root.attrs.get("splits", {}).items():
        lines.append(f"  split {k}: {sum(b - a for a, b in ranges)} steps in {ranges}")
    lines.append("  lat rows per rank (balanced split of the rows over a domain of W ranks):")
    for Wd in domains:
        if Wd <= H:
            sizes = balanced_sizes(H, Wd)
            lines.append(f"    domain {Wd}: {min(sizes)}..{max(sizes)} rows per rank")
    return lines


def _time_range(time, read) -> str:
    """First .. last time step: dates (with the step) when the units say how to decode them, else numbers."""
    from domainflow.store import time_axis

    attrs = dict(time.attrs)
    steps = read(time)  # one small chunk (the coordinates are one chunk each)
    first, last = steps[0], steps[-1]
    ends = time_axis.decode(np.array([first, last]), attrs)
    if ends is None:
        return f"{first} .. {last} {attrs.get('units', '')}"
    hours = time_axis.step_hours(steps[:2], attrs)
    step = "" if hours is None else f", every {hours:g} h" if hours < 48 or hours % 24 else f", every {hours / 24:g} days"
    return f"{time_axis.label(ends[0])} .. {time_axis.label(ends[1])}{step}"
