"""PyTorch's op database through PyTorch's DTensor, on the cases of domainflow's sweep (``op_db_sweep.py``):
how many ops DTensor runs exactly, refuses, gets wrong or crashes on, on 2 and 3 real ranks (Gloo), to quote
beside domainflow's ``benchmarks/results/op_db_sweep.json``.

The same candidate ops and the same first two float64 samples (``tests/harness/op_db_cases.py``'s functions and
seeding), the same skip rules (random ops, no sample with a dim of length >= 2, the op failing on full
tensors), the same closeness rule (``_assert_close``, tolerance 1e-9) and the same input-gradient check (the
same random cotangents on every float output). The layout differs: DTensor cannot take domainflow's uneven
shard sizes, so the input is ``torch.distributed.tensor.distribute_tensor(full, mesh, [Shard(dim)])``, DTensor's
own ``torch.chunk`` split (one case per sample; trailing shards may be empty), not op_db_cases' two uneven
layouts; every other plain tensor argument is a replicated DTensor. Outcomes: ``exact``, ``refused``
(``NotImplementedError`` or "does not have a sharding strategy registered"), ``wrong``, ``crash``, ``skip``.

Run: .venv/bin/python benchmarks/op_db_dtensor.py [--worlds 2,3] [--ops NAME,...] [--chunk 40] [--timeout 300]
[--pg-timeout 10] [--compare-only]
(a few minutes). Prints a table, the ops DTensor runs exactly and domainflow does not (its outcome in
op_db_sweep.json is not ``exact``; ``gather`` counts as not exact) and DTensor's wrong results, and writes
benchmarks/results/op_db_dtensor.json with every op's outcome; ``--compare-only`` redoes the comparison
(domainflow's sweep changes as ops are added) without running DTensor again.
Needs the test extra (``expecttest`` for torch's op database).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "harness"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import RESULTS, write_results  # noqa: E402

KINDS = ["exact", "refused", "wrong", "crash", "skip"]


def sweep(pools, world: int, names: list[str], chunk: int, timeout: float, agree_timeout: float) -> dict[str, str]:
    """Every named op on ``world`` ranks through DTensor: {name: outcome}. A task that fails (a rank dies, e.g.
    Gloo aborting on mismatched collectives, or the ranks outlive ``timeout``) keeps the outcomes its rank 0
    recorded; the op it was on is a crash and the pool restarts (dist_pool restarts a failed pool by itself),
    as it does after an op whose ranks ended differently, for the ops after it."""
    from dist_pool import DistTestError
    from op_db_dtensor_cases import run_cases

    got: dict[str, str] = {}
    todo = list(names)
    with tempfile.TemporaryDirectory() as tmp:
        while todo:
            batch, progress = todo[:chunk], Path(tmp) / f"progress-{world}-{len(got)}.jsonl"
            try:
                part, out_of_step = pools.run(world, run_cases, batch, str(progress), agree_timeout,
                                             timeout=timeout)[0]
            except DistTestError as e:
                done = [json.loads(line) for line in progress.read_text().splitlines()] if progress.exists() else []
                part = {n: v for n, v, _ in done}
                lines = str(e).strip().splitlines() or [type(e).__name__]
                why = lines[0][:200] + "".join(f" [{ln.split('what():', 1)[1].strip()[:160]}]"
                                              for ln in lines if "what():" in ln)[:400]
                if done and done[-1][2]:  # the task ended at its last op (ranks out of step); a rank died of it
                    part[done[-1][0]] += f"; then the pool task failed ({type(e).__name__}): {why}"
                else:  # the op after the last recorded one hung or killed a rank
                    part[batch[len(part)]] = f"crash: pool task failed ({type(e).__name__}): {why}"
                out_of_step = False  # the pool restarts by itself
            got.update(part)
            todo = todo[len(part):]
            if out_of_step:
                pools.pool(world).restart()
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--ops", default="", help="comma-separated case names (default: every op)")
    parser.add_argument("--chunk", type=int, default=40, help="ops per pool task")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per pool task")
    parser.add_argument("--pg-timeout", type=float, default=10,
                        help="Gloo timeout (s) of DTensor's collectives: how long ranks wait for one that failed alone")
    parser.add_argument("--compare-only", action="store_true",
                        help="no run: compare the outcomes in op_db_dtensor.json with op_db_sweep.json as it is now")
    args = parser.parse_args()

    if args.compare_only:
        old = json.loads((RESULTS / "op_db_dtensor.json").read_text())
        report(old["outcomes"], old["seconds"], old["ops"])
        return 0

    from dist_pool import PoolCache
    from op_db_cases import candidate_ops, case_name

    names = [n for n in args.ops.split(",") if n] or sorted({case_name(o) for o in candidate_ops()})
    pools = PoolCache(timeout=args.timeout, pg_timeout=args.pg_timeout)
    results, seconds = {}, {}
    try:
        for world in [int(w) for w in args.worlds.split(",")]:
            t0 = time.perf_counter()
            results[str(world)] = sweep(pools, world, names, args.chunk, args.timeout, 3 * args.pg_timeout + 10)
            seconds[str(world)] = time.perf_counter() - t0
    finally:
        pools.close()
    report(results, seconds, len(names))
    return 0


def report(results: dict[str, dict[str, str]], seconds: dict[str, float], ops: int) -> None:
    """Print the table and the comparison with domainflow's sweep; write op_db_dtensor.json."""
    print(f"DTensor (torch {_torch_version()}), {ops} ops")
    print(f"{'ranks':>5}  " + "  ".join(f"{k:>8}" for k in KINDS) + "   seconds")
    for world, got in results.items():
        counts = Counter(v.split(":")[0] for v in got.values())
        print(f"{world:>5}  " + "  ".join(f"{counts.get(k, 0):>8}" for k in KINDS) + f"   {seconds[world]:7.1f}")

    sweep_file = RESULTS / "op_db_sweep.json"
    ours = json.loads(sweep_file.read_text())["outcomes"] if sweep_file.exists() else {}
    compared = {"file": str(sweep_file), "modified": time.strftime(
        "%Y-%m-%dT%H:%M:%S", time.localtime(sweep_file.stat().st_mtime)) if sweep_file.exists() else None,
        "domainflow_counts": {}, "dtensor_exact_domainflow_not": {}, "domainflow_exact_dtensor_not": {}}
    for world, got in results.items():
        mine = ours.get(world)
        if mine is None:
            print(f"\n{world} ranks: no domainflow outcomes in {sweep_file}")
            continue
        kind = {n: mine.get(n, "missing").split(":")[0] for n in got}
        only = {n: kind[n] for n, v in sorted(got.items()) if v.startswith("exact") and kind[n] != "exact"}
        reverse = {n: v.split(":")[0] for n, v in sorted(got.items()) if not v.startswith("exact")
                   and kind[n] == "exact"}
        compared["domainflow_counts"][world] = dict(Counter(kind.values()))
        compared["dtensor_exact_domainflow_not"][world] = only
        compared["domainflow_exact_dtensor_not"][world] = reverse
        print(f"\n{world} ranks: DTensor exact, domainflow not ({len(only)}; domainflow's outcome in brackets):")
        print("  " + (", ".join(f"{n} [{k}]" for n, k in only.items()) or "none"))
        print(f"{world} ranks: domainflow exact, DTensor not: {len(reverse)} "
              f"({dict(Counter(reverse.values()))})")
    print(f"(domainflow's outcomes: {sweep_file}, modified {compared['modified']})")
    for world, got in results.items():
        wrong = {n: v for n, v in sorted(got.items()) if v.startswith("wrong")}
        print(f"\n{world} ranks: DTensor wrong ({len(wrong)}):")
        for n, v in wrong.items():
            print(f"  {n}: {v[:200]}")
    write_results("op_db_dtensor", {"ops": ops, "torch": _torch_version(), "seconds": seconds,
                                    "outcomes": results, "compared_with_domainflow": compared})


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
