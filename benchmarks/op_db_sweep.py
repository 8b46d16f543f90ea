"""PyTorch's op database against domainflow, every op: how many run exactly, are refused by name, give a wrong
result or crash, on 2 and 3 real ranks (Gloo). The cases are ``tests/harness/op_db_cases.py``'s: each op's
first two float64 samples, the input sharded unevenly along its first dim of length >= 2 (one layout with every
rank holding rows, one with an empty shard), forward and input gradient against one process; an op refused by
name runs again under the opt-in ``fallback("gather")`` (``gather``: exact then; ``refused``: refused even then).

Run: .venv/bin/python benchmarks/op_db_sweep.py [--worlds 2,3] [--ops NAME,...] [--update-refusals]
(several minutes). Prints a table and writes benchmarks/results/op_db_sweep.json with every op's outcome;
``--update-refusals`` rewrites ``tests/ops/op_db_refusals.json``: the refused ops, each ``gather`` or
``refused`` (coverage may only grow) and the known wrong results and crashes (to be fixed), the lists
``tests/ops/test_op_db.py`` holds a fixed sample of ops to.
Needs the test extra (``expecttest`` for torch's op database).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "harness"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402

REFUSALS = ROOT / "tests" / "ops" / "op_db_refusals.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--ops", default="", help="comma-separated case names (default: every op)")
    parser.add_argument("--chunk", type=int, default=40, help="ops per pool task")
    parser.add_argument("--update-refusals", action="store_true")
    args = parser.parse_args()

    from dist_pool import PoolCache
    from op_db_cases import candidate_ops, case_name, sweep

    names = [n for n in args.ops.split(",") if n] or sorted({case_name(o) for o in candidate_ops()})
    pools = PoolCache(timeout=600)
    results, seconds = {}, {}
    try:
        for world in [int(w) for w in args.worlds.split(",")]:
            t0 = time.perf_counter()
            results[world], seconds[world] = sweep(pools, world, names, args.chunk), time.perf_counter() - t0
    finally:
        pools.close()
    kinds = ["exact", "gather", "refused", "wrong", "crash", "skip"]
    print(f"{'ranks':>5}  " + "  ".join(f"{k:>8}" for k in kinds) + "   seconds")
    for world, got in results.items():
        counts = Counter(v.split(":")[0] for v in got.values())
        print(f"{world:>5}  " + "  ".join(f"{counts.get(k, 0):>8}" for k in kinds) + f"   {seconds[world]:7.1f}")
    for world, got in results.items():
        for name, v in sorted(got.items()):
            if v.startswith(("wrong", "crash")):
                print(f"  {world} ranks  {name}: {v[:200]}")
    write_results("op_db_sweep", {"ops": len(names), "seconds": seconds, "outcomes": results})
    if args.update_refusals:
        listed = {"refused": {str(w): {n: v.split(":")[0] for n, v in sorted(got.items())
                                       if v.startswith(("gather", "refused"))} for w, got in results.items()},
                  "wrong_or_crash": {str(w): {n: v for n, v in sorted(got.items()) if v.startswith(("wrong", "crash"))}
                                     for w, got in results.items()}}
        REFUSALS.write_text(json.dumps(listed, indent=1) + "\n")
        print(f"wrote {REFUSALS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
