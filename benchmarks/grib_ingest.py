"""`ingest climate` of a long GRIB file (hourly 2t messages written by ecCodes), with cfgrib's index of the
file's message headers cached (what ingest does: `preprocess/grib_file.index_path`) against no index kept,
where every open of the file (each hypercube at scan, each time block at ingest) scans all its headers again.
Both in this process, one after the other, on the same file. Then memory at a real grid (ERA5's 721 x 1440,
hourly): the peak resident size of reading every time block of the source as ingest's tasks do
(``SourceReader.read_block``, in a child process: the whole process tree) for a file of --memory-days and one
of twice as many days, which must stay the same (a time block at a time, never the file). (The climatology
ingest writes afterwards is not part of it: at this grid and hourly steps its per-task sums do not fit this
machine, see the closing note of the session that added this.)

    .venv/bin/python benchmarks/grib_ingest.py [--days 60] [--time-block 24] [--memory-days 3]

Prints a table and writes benchmarks/results/grib_ingest.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402
H, W = 9, 16


def write_grib(path: Path, days: int, grid=(H, W)) -> int:
    import eccodes as ec

    rng = np.random.default_rng(0)
    h = ec.codes_grib_new_from_samples("regular_ll_sfc_grib2")
    nj, ni = grid
    step = 360.0 / ni
    with open(path, "wb") as f:
        for key, v in [("Ni", ni), ("Nj", nj), ("latitudeOfFirstGridPointInDegrees", 90),
                       ("longitudeOfFirstGridPointInDegrees", 0), ("latitudeOfLastGridPointInDegrees", -90),
                       ("longitudeOfLastGridPointInDegrees", 360.0 - step), ("iDirectionIncrementInDegrees", step),
                       ("jDirectionIncrementInDegrees", 180.0 / (nj - 1)), ("shortName", "2t")]:
            ec.codes_set(h, key, v)
        for d in range(days):
            day = datetime.date(2020, 1, 1) + datetime.timedelta(days=d)
            for hour in range(24):
                ec.codes_set(h, "dataDate", int(day.strftime("%Y%m%d")))
                ec.codes_set(h, "dataTime", hour * 100)
                ec.codes_set_values(h, 270 + rng.standard_normal(nj * ni))
                ec.codes_write(h, f)
    ec.codes_release(h)
    return days * 24


_CHILD = """
import json, sys, time
from domainflow.preprocess.parallel import peak_memory, reset_peak_memory
from domainflow.preprocess.climate_source import open_source
base = reset_peak_memory()
t = time.perf_counter()
src = open_source(sys.argv[1])
block = int(sys.argv[3])
for a, b in src.reader.spans():
    for t0 in range(a, b, block):
        values, _ = src.reader.read_block(t0, min(t0 + block, b))
        del values
print(json.dumps({"seconds": time.perf_counter() - t, "base_rss": base, "peak_rss": peak_memory()}))
"""


def memory_rows(days: int, time_block: int) -> list[dict]:
    """Peak resident size of reading every block of an ERA5-sized hourly GRIB, ``days`` and twice as many, each
    in a child process."""
    rows = []
    for n in (days, 2 * days):
        with tempfile.TemporaryDirectory(prefix="grib-memory-") as tmp:
            path = Path(tmp) / "era5_2t.grib"
            messages = write_grib(path, n, grid=(721, 1440))
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(Path(tmp) / "g.zarr"), str(time_block)],
                                 capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            got = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"messages": messages, "file_bytes": path.stat().st_size, **got})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=int, default=60)
    ap.add_argument("--time-block", type=int, default=24)
    ap.add_argument("--memory-days", type=int, default=3)
    args = ap.parse_args()
    from domainflow.preprocess import grib_file
    from domainflow.preprocess.ingest_grid import ingest_climate

    with tempfile.TemporaryDirectory(prefix="grib-ingest-") as tmp:
        path = Path(tmp) / "era5_2t.grib"
        messages = write_grib(path, args.days)
        cached_index = grib_file.index_path
        rows = {}
        for mode, where in (("cached index", cached_index), ("no index", lambda p: "")):
            grib_file.index_path = where
            store = Path(tmp) / "g.zarr"
            shutil.rmtree(store, ignore_errors=True)
            t0 = time.perf_counter()
            ingest_climate(str(path), store, progress=False, split=(0.8, 0.1, 0.1), time_block=args.time_block)
            rows[mode] = time.perf_counter() - t0
        grib_file.index_path = cached_index
    blocks = -(-messages // args.time_block)
    print(f"{messages} messages, {blocks} time blocks of {args.time_block} steps")
    print(f"{'index':<14}{'ingest s':>10}")
    for mode, s in rows.items():
        print(f"{mode:<14}{s:>10.1f}")
    print(f"no index / cached: {rows['no index'] / rows['cached index']:.1f}x")
    memory = memory_rows(args.memory_days, args.time_block)
    print(f"\n721 x 1440 grid, hourly; every time block of {args.time_block} steps read (a child process)")
    print(f"{'messages':>9}{'file MiB':>10}{'peak MiB':>10}{'above start MiB':>17}{'s':>7}")
    for r in memory:
        print(f"{r['messages']:>9}{r['file_bytes'] / 2**20:>10.0f}{r['peak_rss'] / 2**20:>10.0f}"
              f"{(r['peak_rss'] - r['base_rss']) / 2**20:>17.0f}{r['seconds']:>7.1f}")
    out = {"messages": messages, "time_block": args.time_block, "blocks": blocks,
           "seconds": {k: round(v, 2) for k, v in rows.items()},
           "ratio_no_index_over_cached": round(rows["no index"] / rows["cached index"], 2),
           "memory_721x1440": memory}
    write_results("grib_ingest", out)


if __name__ == "__main__":
    main()
