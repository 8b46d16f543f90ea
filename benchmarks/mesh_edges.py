"""The cost of ``ingest cfd --edges`` (the cells' adjacency for graph models) at growing run sizes: peak memory
and time of one worker, with and without edges, surface (polygons sharing an edge) and volume (hexahedra
sharing a face), through the streaming path.

Run: .venv/bin/python benchmarks/mesh_edges.py [--cells 500000 2000000 --memory-limit 512MiB
     --work /tmp/domainflow_ingest_scale]   (about 5 min at the defaults, 3 GB of scratch disk at most)
Prints a table and writes benchmarks/results/mesh_edges.json. Each ingest runs in a fresh process (its peak
resident size, the kernel's high-water mark of the whole process, is its own; one worker, so every task runs
in it); "above imports" subtracts what the process held before the ingest. The raw runs are
``benchmarks/ingest_scale.py``'s (made once under ``--work`` and reused).

Target: with edges, the peak above imports at the largest size is at most 1.3x that at the smallest plus
the cell -> row map (4 bytes per cell, the documented rule), and under ``--memory-limit``, also with 2 parts
per run (the edges are sorted by ranges of rows, not by part). The peak is the largest of the ingest's stages'
own peaks (each stage resets the kernel's high-water mark when it starts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ingest_scale import MiB, _bytes, make_raw, warm  # noqa: E402  (next to this script)
from measure import write_results  # noqa: E402

_CHILD = r"""
import json, sys, time
from domainflow.preprocess.parallel import peak_memory, reset_peak_memory
from domainflow.preprocess.ingest_mesh import ingest_drivaerml
import numcodecs, zarr
raw, store, limit, loc, edges, parts = (sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1",
                                        int(sys.argv[6]))
base = reset_peak_memory()
t = time.perf_counter()
report = ingest_drivaerml(raw, store, parts=parts, locations=(loc,), split=(1.0, 0.0, 0.0), progress=False,
                          memory_limit=limit, overwrite=True, workers=1, edges=edges)
seconds = time.perf_counter() - t
root = zarr.open_group(store, mode="r")
run = next(iter(root["runs"].group_keys()))
# every stage resets the high-water mark and records its own peak: the largest of them is the ingest's
print(json.dumps({"seconds": seconds, "cells": report.tasks[0]["cells"][loc], "base_rss": base,
                  "peak_rss": max(peak_memory(), report.peak_rss),
                  "edges": root["runs"][run].attrs.get("edges", {}).get(loc, 0)}))
"""


def run_one(raw: Path, store: Path, limit: int, loc: str, edges: bool, parts: int = 64) -> dict:
    warm(raw)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(raw), str(store), str(limit), loc, str(int(edges)),
                          str(parts)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"ingest of {raw} (edges {edges}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", type=int, nargs="+", default=[500_000, 2_000_000])
    ap.add_argument("--memory-limit", type=_bytes, default=512 * MiB)
    ap.add_argument("--work", default="/tmp/domainflow_ingest_scale")
    args = ap.parse_args()
    work = Path(args.work)
    rows = []
    for loc in ("surface", "volume"):
        for cells in args.cells:
            raw, _ = make_raw(work, cells) if loc == "volume" else make_raw(work, 2000, surface=cells)
            for edges, parts in ((False, 64), (True, 64)) + (((True, 2),) if cells == args.cells[-1] else ()):
                r = run_one(raw, work / "edges_store.zarr", args.memory_limit, loc, edges, parts)
                r.update(location=loc, with_edges=edges, parts=parts,
                         above_imports_mib=(r["peak_rss"] - r["base_rss"]) / MiB)
                rows.append(r)
    print(f"{'location':<9} {'cells':>10} {'parts':>5} {'edges':>6} {'edge rows':>11} {'seconds':>8} "
          f"{'peak above imports':>19}")
    for r in rows:
        print(f"{r['location']:<9} {r['cells']:>10,} {r['parts']:>5} {str(r['with_edges']):>6} {r['edges']:>11,} "
              f"{r['seconds']:>8.1f} {r['above_imports_mib']:>15.0f} MiB")
    summary = {}
    for loc in ("surface", "volume"):
        mine = [r for r in rows if r["location"] == loc and r["with_edges"] and r["parts"] == 64]
        plain = [r for r in rows if r["location"] == loc and not r["with_edges"]]
        few = [r for r in rows if r["location"] == loc and r["with_edges"] and r["parts"] == 2]
        small, large = mine[0], mine[-1]
        allowed = 1.3 * small["above_imports_mib"] + 4 * (large["cells"] - small["cells"]) / MiB
        summary[loc] = {"peak_growth": large["above_imports_mib"] / small["above_imports_mib"],
                        "flat_target_mib": allowed, "flat": large["above_imports_mib"] <= allowed,
                        "under_memory_limit": large["peak_rss"] - large["base_rss"] <= args.memory_limit,
                        "time_ratio_edges_vs_none": [m["seconds"] / p["seconds"] for m, p in zip(mine, plain)],
                        "two_parts_under_memory_limit": all(r["peak_rss"] - r["base_rss"] <= args.memory_limit
                                                            for r in few)}
        print(f"{loc}: with edges, peak {summary[loc]['peak_growth']:.2f}x from {small['cells']:,} to "
              f"{large['cells']:,} cells (allowed {allowed:.0f} MiB: {'ok' if summary[loc]['flat'] else 'OVER'}); "
              f"under --memory-limit: {summary[loc]['under_memory_limit']} (2 parts: "
              f"{summary[loc]['two_parts_under_memory_limit']}); time with/without edges "
              + ", ".join(f"{x:.2f}x" for x in summary[loc]["time_ratio_edges_vs_none"]))
    write_results("mesh_edges", {"memory_limit": args.memory_limit, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
