"""What the cross-rank checks of issue 13 cost: user-given layouts (``from_local`` with a sizes mapping),
replicated parameters, and the loss that rides on the backward pass's all-reduce.

Run: .venv/bin/python benchmarks/consistency_checks.py [--points 200000 --repeats 15]   (about a minute)
Prints a table and writes benchmarks/results/consistency_checks.json. 2 real ranks (Gloo, 1 thread each);
every row is measured side by side in one run, on/off interleaved; quote ratios and differences.

(a) A sample as MeshDataset wraps it: 4 arrays of N rows per rank made into ShardTensors with a sizes mapping,
    then the first collective (a Partial sum's .item()). With checks the first collective is preceded by one
    small all-reduce of the layouts' fingerprints; "off" is the same with layout recording disabled. Also the
    count of check collectives per sample and per later op (target: at most 1 per new layout, 0 per op).
(b) Parameters: fingerprints of every parameter of a model, on their device (once per parameter in a job):
    a Transolver-sized MLP stack and a 10M-parameter one; the time and what it is per MB.
(c) Dispatch: the scan of a call's arguments for parameters not yet recorded, per op (``x * w`` with ``w`` a
    recorded nn.Parameter), against the dispatcher without the scan.
(d) A training step (2-layer MLP on the sharded points, ``deferred_param_grads``, then ``loss.item()`` on every
    rank): with the loss riding on the gradients' all-reduce against reducing it in a collective of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402


def _best(fn, repeats: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times)


def _rank(points: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import domainflow as df
    from domainflow import comm
    from domainflow.tensor import consistency
    from domainflow.dispatch import engine as dispatch

    torch.set_num_threads(1)
    mesh = df.init_mesh((int(os.environ["WORLD_SIZE"]),), ("domain",))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [points // world + (k < points % world) for k in range(world)]
    arrays = [torch.randn(sizes[rank], c, dtype=torch.float32) for c in (3, 3, 1, 3)]
    out = {}

    # (a) a sample's layouts
    def sample():
        xs = [df.ShardTensor.from_local(a, mesh, [df.Shard(0)], sharding_shapes={"domain": sizes}) for a in arrays]
        return xs[2].sum().item()

    record = consistency.record_layout
    off = lambda *a, **k: None  # noqa: E731
    t_on, t_off = [], []
    for k in range(repeats):
        for mode in (("on", "off") if k % 2 == 0 else ("off", "on")):
            consistency.record_layout = record if mode == "on" else off
            dist.barrier()
            (t_on if mode == "on" else t_off).append(_best(sample, 1, 5))
    consistency.record_layout = record
    comm.stats.reset()
    xs = [df.ShardTensor.from_local(a, mesh, [df.Shard(0)], sharding_shapes={"domain": sizes}) for a in arrays]
    xs[0].sum().item()
    per_sample = comm.stats.calls["check"]
    for _ in range(20):
        (xs[0] * 2 + xs[1]).sum().item()
    out["a"] = {"sample_on_s": min(t_on), "sample_off_s": min(t_off), "extra_us": (min(t_on) - min(t_off)) * 1e6,
                "ratio": min(t_on) / min(t_off), "checks_per_sample": per_sample,
                "checks_per_later_op": (comm.stats.calls["check"] - per_sample) / 20}

    # (b) parameter fingerprints
    rows = []
    for width, depth in ((64, 8), (1024, 10)):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        t = _best(lambda: [consistency.param_fingerprint(p) for p in params], max(3, repeats // 3))
        rows.append({"params": n, "mb": n * 4 / 2**20, "seconds": t, "ms_per_mb": t * 1e3 / (n * 4 / 2**20)})
    out["b"] = rows

    # (c) the per-op scan
    x = df.ShardTensor.from_local(torch.randn(64, 8), mesh, [df.Shard(0)], sharding_shapes={"domain": [64] * world})
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(8))
    (x * w).sum().item()  # records w and checks it once

    def scanless(func, types, args=(), kwargs=None):
        handler = dispatch._functions.get(func)
        if handler is not None:
            with dispatch._no_subclass_functions():
                return handler(func, args, kwargs or {})
        return dispatch._run_function(func, types, args, kwargs if kwargs is not None else dispatch._NO_KWARGS)

    scanning = dispatch.torch_function
    with torch.no_grad():
        op = lambda: x * w  # noqa: E731
        t_scan, t_plain = [], []
        for k in range(repeats):
            for mode in (("scan", "plain") if k % 2 == 0 else ("plain", "scan")):
                dispatch.torch_function = scanning if mode == "scan" else scanless
                (t_scan if mode == "scan" else t_plain).append(_best(op, 3, 2000))
        dispatch.torch_function = scanning
    out["c"] = {"op_us_with_scan": min(t_scan) * 1e6, "op_us_without": min(t_plain) * 1e6,
                "scan_us": (min(t_scan) - min(t_plain)) * 1e6}

    # (d) a step whose loss rides on the gradients' all-reduce vs one reduced on its own
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    pts = xs[0]

    def step(ride: bool):
        model.zero_grad()
        loss = (model(pts) ** 2).mean()
        if not ride:
            loss.full_tensor()  # what a user without the rider would pay: a reduction of its own (discarded)
        with df.deferred_param_grads():
            loss.backward()
        return loss.item()

    t_ride, t_own = [], []
    for k in range(repeats):
        for ride in ((True, False) if k % 2 == 0 else (False, True)):
            dist.barrier()
            (t_ride if ride else t_own).append(_best(lambda: step(ride), 1, 3))
    comm.stats.reset()
    step(True)
    out["d"] = {"step_ride_s": min(t_ride), "step_own_s": min(t_own), "saved_us": (min(t_own) - min(t_ride)) * 1e6,
                "all_reduces_per_step": comm.stats.calls["all_reduce"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=200_000, help="points per sample (over 2 ranks)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    from domainflow.launch import launch_local

    res = launch_local(_rank, 2, args.points, args.repeats, threads_per_rank=1)
    r0 = res[0]
    a, c, d = r0["a"], r0["c"], r0["d"]
    print(f"2 ranks (Gloo), {args.points:,} points per sample, best of {args.repeats} (interleaved)")
    print("\n(a) a sample's 4 arrays wrapped with a sizes mapping + the first collective")
    print(f"{'checks':<8}{'ms':>8}")
    print(f"{'on':<8}{a['sample_on_s'] * 1e3:>8.3f}\n{'off':<8}{a['sample_off_s'] * 1e3:>8.3f}")
    print(f"extra per sample {a['extra_us']:.0f} us ({a['ratio']:.3f}x); check collectives: {a['checks_per_sample']} "
          f"per sample, {a['checks_per_later_op']:.0f} per later op")
    print("\n(b) parameter fingerprints (once per parameter, on its device)")
    print(f"{'params':>12}{'MB':>8}{'ms':>9}{'ms/MB':>8}")
    for r in r0["b"]:
        print(f"{r['params']:>12,}{r['mb']:>8.1f}{r['seconds'] * 1e3:>9.2f}{r['ms_per_mb']:>8.3f}")
    print(f"\n(c) per op (x * w, w an nn.Parameter): {c['op_us_with_scan']:.2f} us with the parameter scan, "
          f"{c['op_us_without']:.2f} us without: {c['scan_us']:+.2f} us")
    print(f"\n(d) training step with .item() of the loss on every rank: loss riding on the gradient all-reduce "
          f"{d['step_ride_s'] * 1e3:.3f} ms vs its own reduction {d['step_own_s'] * 1e3:.3f} ms "
          f"(saves {d['saved_us']:.0f} us); all-reduces per step: {d['all_reduces_per_step']}")
    targets = {"a_at_most_one_check_per_sample": a["checks_per_sample"] <= 1,
               "a_no_check_per_later_op": a["checks_per_later_op"] == 0}
    print("\ntargets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items()))
    write_results("consistency_checks", {"points": args.points, "repeats": args.repeats, "ranks": 2,
                                         "cpu_count": os.cpu_count(), **r0, "targets_met": targets})


if __name__ == "__main__":
    main()
