"""The host cost of one call of a compiled function: a tiny pointwise function (``x * 2 + 1`` on 256 x 64 floats)
called many times, plain PyTorch eager and ``torch.compile`` on one process, domainflow eager and
``domainflow.compile`` on a ShardTensor at domain 1 and 2. The kernels take microseconds, so the time per call is
the wrapper: Dynamo's guards (a ShardTensor's spec is in them), domainflow's per-call checks and, at domain 2, the
compiled graph's cross-rank check (one small collective per graph and direction), next to the time of one
all-reduce of one float on the same ranks.

Run: .venv/bin/python benchmarks/compile_overhead.py   (prints a table, writes benchmarks/results/compile_overhead.json).
Median of 5 rounds of ``--calls`` calls each, forward only (no gradient), one CPU thread per rank, all variants in
the same ranks one after the other; quote ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402

# "one all_reduce": a collective of one float on the same ranks, what one cross-rank check round costs at least
VARIANTS = ("torch eager", "torch compiled", "domainflow eager", "domainflow compiled", "one all_reduce")


def _rank(calls: int, backend: str) -> dict:
    import torch
    import torch.distributed as dist

    import domainflow as df
    from domainflow.layout.shapes import balanced_sizes

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = df.init_mesh((world,), ("domain",))
    full = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    sharded = df.distribute_tensor(full, mesh, [df.Shard(0)], sharding_shapes={0: list(balanced_sizes(256, world))})

    def fn(x):
        return x * 2 + 1

    out = {}
    for variant in VARIANTS:
        if (variant.startswith("torch") and world > 1) or (variant == "one all_reduce" and world == 1):
            continue
        x = full if variant.startswith("torch") else sharded
        f = {"torch compiled": lambda: torch.compile(fn, backend=backend, dynamic=False),
             "domainflow compiled": lambda: df.compile(fn, backend=backend),
             "one all_reduce": lambda: lambda _: dist.all_reduce(torch.zeros(1))}.get(variant, lambda: fn)()
        torch._dynamo.reset()
        with torch.no_grad():
            for _ in range(20):  # the compile, then warm calls
                f(x)
            rounds = []
            for _ in range(5):
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    f(x)
                rounds.append((time.perf_counter() - t0) / calls)
        out[variant] = statistics.median(rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--domains", default="1,2")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    args = ap.parse_args()
    from domainflow.launch import launch_local

    rows = []
    for world in [int(d) for d in args.domains.split(",")]:
        res = launch_local(_rank, world, args.calls, args.backend, threads_per_rank=1)
        per_call = {v: max(r[v] for r in res.values()) for v in VARIANTS if v in res[0]}  # the slowest rank
        rows.append({"domain": world, "per_call_s": per_call})
    base = rows[0]["per_call_s"] if rows and rows[0]["domain"] == 1 else {}
    print(f"\nper call of a compiled x * 2 + 1 (256 x 64 floats), no gradient, backend {args.backend}; median of "
          f"5 x {args.calls} calls, the slowest rank")
    print(f"{'domain':>7}{'variant':>22}{'us per call':>13}{'vs torch compiled d1':>22}")
    for r in rows:
        for v, s in r["per_call_s"].items():
            vs = s / base["torch compiled"] if "torch compiled" in base else float("nan")
            print(f"{r['domain']:>7}{v:>22}{s * 1e6:>13.1f}{vs:>22.2f}")
    write_results("compile_overhead", {"backend": args.backend, "calls": args.calls, "rows": rows})


if __name__ == "__main__":
    main()
