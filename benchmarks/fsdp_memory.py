"""Parameters and optimizer state per rank with ``mesh.dp_strategy=fsdp`` (FSDP2 over dp) against
``allreduce`` (replicated), at dp 2 x domain 2 (4 Gloo ranks), with a Transolver large enough that its state
outweighs a small sample's activations.

Run: .venv/bin/python benchmarks/fsdp_memory.py [--dim 256 --layers 8 --steps 4 --cells 4000]   (about 2 min)
Prints a table and writes benchmarks/results/fsdp_memory.json. Per strategy, the real ``Trainer`` (AdamW,
float32) on a synthetic DrivaerML-style surface store: per rank the bytes of parameters and of optimizer
state it holds (a DTensor's local shard under FSDP2: exact, from the tensors), the whole process's peak RSS
(VmHWM; largest rank and sum over the 4 ranks: the process tree), and the slowest rank's step time
(median after the first step). Target: state per rank under fsdp <= 0.55x allreduce's (1/dp = 0.5 plus
FSDP2's padding of each parameter's first dim to a multiple of dp).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402
from train_scaling import prepare_store  # noqa: E402

MiB = 2**20


def _rank(over: list[str], steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from domainflow.preprocess.parallel import peak_memory
    from domainflow.train import Trainer, load_config
    from domainflow.train.fsdp import local_numel

    torch.set_num_threads(1)
    trainer = Trainer(load_config(None, over))
    stream = trainer._stream(0, steps)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        _, samples, _ = next(stream)
        trainer.train_step(samples)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    stream.close()
    opt = [v for s in trainer.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    return {"rank": dist.get_rank(), "param_bytes": 4 * local_numel(trainer.model.parameters()),
            "optimizer_bytes": 4 * local_numel(opt), "peak": peak_memory(), "step_s": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cells", type=int, default=4000)
    p.add_argument("--work", default=None, help="folder for the store (default: a temporary one, removed)")
    args = p.parse_args()

    from domainflow.launch import launch_local

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fsdp_memory_"))
    try:
        store, cells, _ = prepare_store(work, args.cells, 4)
        rows = {}
        for strategy in ("allreduce", "fsdp"):
            over = [f"data.store={store}", f"model.dim={args.dim}", f"model.layers={args.layers}", "model.heads=8",
                    "model.slices=32", f"train.steps={args.steps}", "train.batch=2", "output.progress=false",
                    "output.plots=false", f"output.dir={work / strategy}", "mesh.dp=2", "mesh.domain=2",
                    "data.prefetch=0", f"mesh.dp_strategy={strategy}"]
            res = launch_local(_rank, 4, over, args.steps, threads_per_rank=1)
            ranks = [res[r] for r in sorted(res)]
            timed = [max(r["step_s"][k] for r in ranks) for k in range(1, args.steps)]
            rows[strategy] = {"param_bytes": max(r["param_bytes"] for r in ranks),
                              "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),
                              "peak": max(r["peak"] for r in ranks), "peak_sum": sum(r["peak"] for r in ranks),
                              "median_step_s": statistics.median(timed), "per_rank": ranks}
        a, f = rows["allreduce"], rows["fsdp"]
        state_ratio = (f["param_bytes"] + f["optimizer_bytes"]) / (a["param_bytes"] + a["optimizer_bytes"])
        out = {"dim": args.dim, "layers": args.layers, "cells": cells, "steps": args.steps, "rows": rows,
               "state_ratio": state_ratio, "target": 0.55, "met": state_ratio <= 0.55,
               "load_avg_1min": os.getloadavg()[0]}
        print(f"Transolver dim {args.dim} x {args.layers} layers, {cells:,} cells per sample, dp 2 x domain 2 "
              f"(4 Gloo ranks), float32 AdamW")
        print(f"{'strategy':<10}{'params MiB':>11}{'optim MiB':>10}{'peak MiB':>10}{'peak sum':>10}{'step s':>8}")
        for name, r in rows.items():
            print(f"{name:<10}{r['param_bytes'] / MiB:>11.2f}{r['optimizer_bytes'] / MiB:>10.2f}{r['peak'] / MiB:>10.0f}"
                  f"{r['peak_sum'] / MiB:>10.0f}{r['median_step_s']:>8.3f}")
        print(f"parameters + optimizer state per rank, fsdp / allreduce: {state_ratio:.3f} (target <= 0.55: "
              f"{'met' if out['met'] else 'NOT met'})")
        write_results("fsdp_memory", out)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
