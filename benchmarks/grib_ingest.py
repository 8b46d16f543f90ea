"""`ingest climate` of a long GRIB file (hourly 2t messages written by ecCodes), with cfgrib's index of the
file's message headers cached (what ingest does: `preprocess/grib_file.index_path`) against no index kept,
where every open of the file (each hypercube at scan, each time block at ingest) scans all its headers again.
Both in this process, one after the other, on the same file.

    .venv/bin/python benchmarks/grib_ingest.py [--days 60] [--time-block 24]

Prints a table and writes benchmarks/results/grib_ingest.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
H, W = 9, 16


def write_grib(path: Path, days: int) -> int:
    import eccodes as ec

    rng = np.random.default_rng(0)
    h = ec.codes_grib_new_from_samples("regular_ll_sfc_grib2")
    with open(path, "wb") as f:
        for key, v in [("Ni", W), ("Nj", H), ("latitudeOfFirstGridPointInDegrees", 90),
                       ("longitudeOfFirstGridPointInDegrees", 0), ("latitudeOfLastGridPointInDegrees", -90),
                       ("longitudeOfLastGridPointInDegrees", 337.5), ("iDirectionIncrementInDegrees", 22.5),
                       ("jDirectionIncrementInDegrees", 22.5), ("shortName", "2t")]:
            ec.codes_set(h, key, v)
        for d in range(days):
            day = datetime.date(2020, 1, 1) + datetime.timedelta(days=d)
            for hour in range(24):
                ec.codes_set(h, "dataDate", int(day.strftime("%Y%m%d")))
                ec.codes_set(h, "dataTime", hour * 100)
                ec.codes_set_values(h, 270 + rng.standard_normal(H * W))
                ec.codes_write(h, f)
    ec.codes_release(h)
    return days * 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=int, default=60)
    ap.add_argument("--time-block", type=int, default=24)
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
    RESULTS.mkdir(exist_ok=True)
    out = {"messages": messages, "time_block": args.time_block, "blocks": blocks,
           "seconds": {k: round(v, 2) for k, v in rows.items()},
           "ratio_no_index_over_cached": round(rows["no index"] / rows["cached index"], 2)}
    tmp_json = RESULTS / "grib_ingest.json.tmp"
    tmp_json.write_text(json.dumps(out, indent=2))
    tmp_json.replace(RESULTS / "grib_ingest.json")
    print(f"wrote {RESULTS / 'grib_ingest.json'}")


if __name__ == "__main__":
    main()
