"""The NCCL path in one command: multi-rank exactness checks and a short timing on CUDA, one rank per GPU.

Run on a GPU node:   .venv/bin/python benchmarks/gpu_check.py
Without a GPU it says so and exits 0 (nothing here may assume a device); ``--device cpu`` runs the same
checks on CPU ranks with Gloo, which is how this script itself is tested on machines without a GPU.

Each rank runs, against the same computation on the full tensor on its own device (float64):
  collectives    all-reduce (small: the exchange path on Gloo; large), uneven all-gather, broadcast
  halo conv      Conv2d + GroupNorm on a grid sharded along H (halo exchange forward and backward)
  transolver     a 2-layer Transolver step under deferred_param_grads: loss, every parameter gradient, and
                 the all-reduce count (2L + 1), loss.item() after backward needing no collective
  compiled       the same step through domainflow.compile (Inductor on CUDA, aot_eager on CPU by default):
                 loss and every parameter gradient
and times a few steps of a float32 Transolver on 200k points per sample. Prints a table and writes
benchmarks/results/gpu_check.json. NCCL needs one GPU per rank: with fewer than 2 GPUs only world size 1
runs on NCCL (the collectives still go through NCCL), and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _checks(device_type: str, timed_points: int, timed_steps: int, compile_backend: str = "inductor") -> dict:
    import torch
    import torch.nn.functional as F

    import domainflow as df
    from domainflow import Shard, comm
    from domainflow.layout.shapes import balanced_sizes
    from domainflow.train.models import Transolver

    mesh = df.init_mesh((int(os.environ.get("WORLD_SIZE", "1")),), ("domain",))
    world, rank = mesh.size(), mesh.get_rank()
    dev = comm.mesh_device(mesh)
    out = {"rank": rank, "world": world, "device": str(dev), "backend": torch.distributed.get_backend()}
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g).to(dev)

    # collectives
    errs = []
    for n in (16, 1 << 18):
        t = torch.full((n,), float(rank + 1), dtype=torch.float64, device=dev)
        errs.append(float((comm.all_reduce(t, "sum", mesh, 0) - world * (world + 1) / 2).abs().max()))
    full = rand(11, 3)
    sizes = balanced_sizes(11, world) if world > 1 else [11]
    st = df.distribute_tensor(full, mesh, [Shard(0)], sharding_shapes={0: sizes})
    errs.append(float((st.full_tensor() - full).abs().max()))
    b = comm.broadcast(torch.full((5,), float(rank), dtype=torch.float64, device=dev), 0, mesh, 0)
    errs.append(float(b.abs().max()))
    out["collectives_max_err"] = max(errs)

    # halo conv
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.GroupNorm(2, 4), torch.nn.GELU(),
                              torch.nn.Conv2d(4, 1, 3, padding=1)).double().to(dev)
    img = rand(1, 2, 13, 9)
    x = df.distribute_tensor(img, mesh, [Shard(2)], sharding_shapes={0: balanced_sizes(13, world)})
    y = net(x)
    (y ** 2).mean().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    ref = net(img)
    (ref ** 2).mean().backward()
    out["halo_conv_max_err"] = max([float((y.full_tensor() - ref).detach().abs().max())]
                                   + [float((a - p.grad).abs().max()) for a, p in zip(grads, net.parameters())])

    # Transolver step: values, gradients, all-reduce count
    torch.manual_seed(2)
    model = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=2, heads=2, slices=8).double().to(dev)
    pts, glob = rand(1, 37, 6), rand(1, 3)
    xp = df.distribute_tensor(pts, mesh, [Shard(1)], sharding_shapes={0: balanced_sizes(37, world)})
    comm.stats.reset()
    loss = (model(xp, glob) ** 2).mean()
    with df.deferred_param_grads():
        loss.backward()
    value = loss.item()
    calls = comm.stats.calls.get("all_reduce", 0)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = (model(pts, glob) ** 2).mean()
    ref.backward()
    out["transolver_max_err"] = max([abs(value - ref.item())]
                                    + [float((a - p.grad).abs().max()) for a, p in zip(grads, model.parameters())])
    out["transolver_all_reduces"] = calls
    out["transolver_all_reduces_expected"] = 2 * 2 + 1 if world > 1 else 0

    # the same step compiled (domainflow.compile: functional collectives in the graph, the ranks' graph check)
    torch.manual_seed(2)
    cmodel = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=16, layers=2, heads=2, slices=8).double().to(dev)
    compiled = df.compile(cmodel, backend=compile_backend)
    closs = (compiled(xp, glob) ** 2).mean()
    closs.backward()
    out["compiled_max_err"] = max([abs(closs.item() - ref.item())]
                                  + [float((p.grad - q.grad).abs().max()) for p, q in zip(cmodel.parameters(),
                                                                                          model.parameters())])
    out["compiled_graphs"] = compiled.frames

    # a short timing, float32, 200k points per sample split over the ranks
    if timed_steps:
        torch.manual_seed(3)
        big = Transolver(in_dim=6, out_dim=4, global_dim=3, dim=64, layers=3, heads=4, slices=32).to(dev)
        opt = torch.optim.AdamW(big.parameters(), lr=1e-4)
        n = timed_points
        pts = torch.randn(1, n, 6, generator=g).to(dev)
        glob = torch.randn(1, 3, generator=g).to(dev)
        xp = df.distribute_tensor(pts, mesh, [Shard(1)], sharding_shapes={0: balanced_sizes(n, world)})
        times = []
        for k in range(timed_steps + 1):
            if device_type == "cuda":
                torch.cuda.synchronize()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = (big(xp, glob) ** 2).mean()
            with df.deferred_param_grads():
                loss.backward()
            opt.step()
            if device_type == "cuda":
                torch.cuda.synchronize()
            if k:
                times.append(time.perf_counter() - t0)
        out["timed_step_s_median"] = statistics.median(times)
        out["timed_points"] = n
        if device_type == "cuda":
            out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--worlds", type=int, nargs="+", default=None, help="ranks per case (default: 1 and the GPU count)")
    ap.add_argument("--points", type=int, default=200_000, help="points per sample in the timed steps")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (0: checks only)")
    ap.add_argument("--compile-backend", choices=("inductor", "aot_eager"), default=None,
                    help="backend of the compiled check (default: inductor on cuda, aot_eager on cpu)")
    args = ap.parse_args()

    import torch

    from domainflow.launch import launch_local

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run with --device cpu for the same checks on Gloo)")
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    worlds = args.worlds or ([1] + ([gpus] if gpus > 1 else []) if args.device == "cuda" else [1, 2])
    note = "" if args.device != "cuda" or gpus > 1 else "one GPU: NCCL needs a GPU per rank, so only world size 1 ran"
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks pick Gloo on CPU
    rows, ok = [], True
    for world in worlds:
        backend = args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager")
        res = launch_local(_checks, world, args.device, args.points, args.steps, backend, threads_per_rank=1)
        ranks = [res[r] for r in sorted(res)]
        worst = {k: max(r[k] for r in ranks) for k in ("collectives_max_err", "halo_conv_max_err", "transolver_max_err",
                                                        "compiled_max_err")}
        row = {"world": world, "backend": ranks[0]["backend"], "device": ranks[0]["device"], **worst,
               "transolver_all_reduces": ranks[0]["transolver_all_reduces"],
               "transolver_all_reduces_expected": ranks[0]["transolver_all_reduces_expected"],
               "timed_step_s_median": max(r.get("timed_step_s_median", 0.0) for r in ranks),
               "peak_gpu_mib": max(r.get("peak_gpu_mib", 0.0) for r in ranks)}
        row["exact"] = all(v < 1e-9 for v in worst.values())
        row["counts_ok"] = row["transolver_all_reduces"] == row["transolver_all_reduces_expected"]
        ok &= row["exact"] and row["counts_ok"]
        rows.append(row)
    print(f"{'W':>3} {'backend':<8}{'device':<8}{'collectives':>12}{'halo conv':>11}{'transolver':>11}{'compiled':>10}"
          f"{'all-reduces':>12}{'step s':>8}{'GPU MiB':>9}")
    for r in rows:
        print(f"{r['world']:>3} {r['backend']:<8}{r['device']:<8}{r['collectives_max_err']:>12.1e}"
              f"{r['halo_conv_max_err']:>11.1e}{r['transolver_max_err']:>11.1e}{r['compiled_max_err']:>10.1e}"
              f"{r['transolver_all_reduces']:>6} / {r['transolver_all_reduces_expected']:<3}"
              f"{r['timed_step_s_median']:>8.3f}{r['peak_gpu_mib']:>9.0f}")
    print("errors: max abs difference from the same computation on the full tensor (float64; compiled: the "
          "step through domainflow.compile); all-reduces: "
          "measured / expected in a 2-layer Transolver step; step s: median float32 step at "
          f"{args.points} points" + (f"; {note}" if note else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "gpu_check.json" if args.device == "cuda" else "gpu_check_cpu.json"
    tmp = RESULTS / (name + ".tmp")
    tmp.write_text(json.dumps({"torch": torch.__version__, "rows": rows, "note": note, "ok": ok}, indent=2))
    tmp.replace(RESULTS / name)
    print(f"{'all checks passed' if ok else 'CHECKS FAILED'}; wrote {RESULTS / name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
