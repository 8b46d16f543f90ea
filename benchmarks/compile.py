"""torch.compile of a domain-parallel training step: step time of a Transolver (dim 64, 3 layers) compiled with
``domainflow.compile`` vs the same step eager, vs plain PyTorch eager and ``torch.compile`` on one process, at
domain 1 and 2, at a launch-bound size (a few hundred points per rank) and at 200k points, plus the compile time.

Run: .venv/bin/python benchmarks/compile.py   (prints a table, writes benchmarks/results/compile.json).
A step is forward, MSE loss, backward and an Adam step, float32, one CPU thread per rank. Compile time is the
first step's time (tracing, Inductor's C++ build) less a warm step's. All variants of one domain size run in the
same ranks one after the other, so their ratios come from the same machine state; quote ratios.
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

MODEL = {"in_dim": 3, "out_dim": 4, "dim": 64, "layers": 3, "heads": 4, "slices": 32}


def _rank(points: int, steps: int, backend: str, variants: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    import domainflow as df
    from domainflow.layout.shapes import balanced_sizes
    from domainflow.train.models import Transolver

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = df.init_mesh((world,), ("domain",))
    sizes = list(balanced_sizes(points, world))
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(1, points, MODEL["in_dim"], generator=gen)
    y_full = torch.randn(1, points, MODEL["out_dim"], generator=gen)

    def shard(t):
        return df.distribute_tensor(t, mesh, [df.Shard(1)], sharding_shapes={0: sizes})

    def barrier():
        if world > 1:
            dist.barrier()

    out = {"rank": rank, "world": world, "points": points, "rank_points": sizes[rank], "variants": {}}
    for variant in variants:
        if variant.startswith("torch") and world > 1:
            continue  # plain PyTorch runs the whole sample on one process
        torch.manual_seed(0)
        model = Transolver(**MODEL)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        if variant.startswith("torch"):
            x, y = x_full, y_full
        else:
            x, y = shard(x_full), shard(y_full)
        if variant == "torch compiled":
            fn = torch.compile(model, backend=backend, dynamic=False)
        elif variant == "domainflow compiled":
            fn = df.compile(model, backend=backend)
        else:
            fn = model

        def step():
            pred = fn(x)
            loss = ((pred - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        torch._dynamo.reset()
        barrier()
        t0 = time.perf_counter()
        first_loss = float(step().detach())
        first = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out["variants"][variant] = {"first_s": first, "step_s": statistics.median(times), "first_loss": first_loss,
                                    "frames": getattr(fn, "frames", None)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512,200000", help="total points of a sample (comma-separated)")
    ap.add_argument("--domains", default="1,2")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default: 30 for small sizes, 5 for large)")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    args = ap.parse_args()
    from domainflow.launch import launch_local

    variants = ["torch eager", "torch compiled", "domainflow eager", "domainflow compiled"]
    rows = []
    for points in [int(s) for s in args.sizes.split(",")]:
        steps = args.steps or (30 if points <= 10000 else 5)
        for world in [int(d) for d in args.domains.split(",")]:
            res = launch_local(_rank, world, points, steps, args.backend, variants, threads_per_rank=1)
            slowest = {v: max(r["variants"][v]["step_s"] for r in res.values() if v in r["variants"])
                       for v in variants if v in res[0]["variants"]}
            firsts = {v: max(r["variants"][v]["first_s"] for r in res.values() if v in r["variants"])
                      for v in slowest}
            rows.append({"points": points, "domain": world, "rank_points": [res[r]["rank_points"] for r in sorted(res)],
                         "step_s": slowest, "compile_s": {v: firsts[v] - slowest[v] for v in slowest if "compiled" in v},
                         "losses": {v: res[0]["variants"][v]["first_loss"] for v in slowest},
                         "frames": {v: res[0]["variants"][v]["frames"] for v in slowest}})
            print(f"done: {points} points, domain {world}", flush=True)
    base = {r["points"]: r["step_s"] for r in rows if r["domain"] == 1}
    print(f"\nTransolver training step ({MODEL}), float32, 1 CPU thread per rank, backend {args.backend}; "
          "median step time (the slowest rank)")
    print(f"{'points':>8}{'domain':>7}{'variant':>22}{'step ms':>10}{'vs torch compiled d1':>22}"
          f"{'vs domainflow eager':>21}{'compile s':>11}")
    for r in rows:
        b = base.get(r["points"], {})
        for v, s in r["step_s"].items():
            vs_tc = s / b["torch compiled"] if "torch compiled" in b else float("nan")
            vs_eager = s / r["step_s"]["domainflow eager"]
            comp = r["compile_s"].get(v)
            print(f"{r['points']:>8}{r['domain']:>7}{v:>22}{s * 1e3:>10.2f}{vs_tc:>22.2f}{vs_eager:>21.2f}"
                  + (f"{comp:>11.1f}" if comp is not None else f"{'':>11}"))
    write_results("compile", {"model": MODEL, "backend": args.backend, "rows": rows})


if __name__ == "__main__":
    main()
