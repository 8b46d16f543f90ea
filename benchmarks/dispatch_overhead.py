"""Per-op dispatch overhead (plain torch vs ShardTensor vs DTensor, one process) and the cost of an
uneven Shard -> Replicate redistribution against a hand-written padded all_gather (2 and 4 ranks).

Run: .venv/bin/python benchmarks/dispatch_overhead.py   (prints a table, writes
benchmarks/results/dispatch_overhead.json). All numbers of one run come from the same machine state;
quote ratios, not absolute times.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _best_us(fn, n=20000, repeats=7) -> float:
    for _ in range(500):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


class _MinimalSubclass(torch.Tensor):
    """The floor for any Python ``__torch_dispatch__`` wrapper: unwrap, run the op, wrap. No layout
    logic at all; it shows how much of the overhead is the Python dispatch round trip itself."""

    @staticmethod
    def __new__(cls, local, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, local.shape, dtype=local.dtype, device=local.device,
                                                requires_grad=requires_grad)
        r._l = local
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a._l if isinstance(a, _MinimalSubclass) else a for a in args], **(kwargs or {}))
        if isinstance(out, (tuple, list)):
            return type(out)(_MinimalSubclass(o) if isinstance(o, torch.Tensor) else o for o in out)
        return _MinimalSubclass(out)


def per_op_overhead(n: int = 20000, autograd: bool = False) -> list[dict]:
    """Per-op times of plain torch, ShardTensor, DTensor and the dispatch floor. ``autograd``: the input
    and the weights need gradients (a training step's forward), else all run under ``torch.no_grad()``
    (inference: where domainflow's fast path applies)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor as dt_distribute

    import domainflow as df

    torch.set_num_threads(1)
    mesh = df.init_mesh((1,), ("domain",))
    base = torch.randn(8, 8)
    w = torch.randn(8, 8)
    img = torch.randn(1, 2, 8, 8)
    kernel = torch.randn(2, 2, 3, 3)
    st = df.distribute_tensor(base, mesh, [df.Shard(0)])
    dt = dt_distribute(base, mesh, [DShard(0)])
    st_img = df.distribute_tensor(img, mesh, [df.Shard(2)])
    dt_img = dt_distribute(img, mesh, [DShard(2)])
    # with autograd the floor's wrappers need gradients too: autograd (C++) records the op above the
    # Python __torch_dispatch__, as it does for ShardTensor and DTensor
    floor = _MinimalSubclass(base, requires_grad=autograd)
    # the second operand as each library takes it: plain for torch and ShardTensor (parameters stay plain
    # tensors), a replicated DTensor for DTensor (which refuses plain tensors mixed in)
    dw = dt_distribute(w, mesh, [DReplicate()])
    dkernel = dt_distribute(kernel, mesh, [DReplicate()])
    if autograd:
        for t in (base, w, img, kernel, st, dt, st_img, dt_img, dw, dkernel):
            t.requires_grad_(True)
    ops = {
        "pointwise (x + x)": (lambda x, o: x + x, None),
        "reduction (x.sum(0))": (lambda x, o: x.sum(0), None),
        "view (x.view(64))": (lambda x, o: x.view(64), None),
        "transpose (x.t())": (lambda x, o: x.t(), None),
        "matmul (x @ W)": (lambda x, o: x @ o, "w"),
        "linear (F.linear)": (lambda x, o: F.linear(x, o), "w"),
        "layer_norm (last dim)": (lambda x, o: F.layer_norm(x, (8,)), None),
        "softmax (last dim)": (lambda x, o: torch.softmax(x, -1), None),
        "conv2d (3x3, pad 1)": (lambda x, o: F.conv2d(x, o, padding=1), "conv"),
    }
    rows = []
    for name, (op, other) in ops.items():
        if other == "conv":
            args = {"plain": (img, kernel), "st": (st_img, kernel), "dt": (dt_img, dkernel), "floor": None}
        else:
            o = w if other else None
            args = {"plain": (base, o), "st": (st, o), "dt": (dt, dw if other else None),
                    "floor": (floor, _MinimalSubclass(w, requires_grad=autograd) if other else None)}
        with torch.set_grad_enabled(autograd):  # inference runs under no_grad (as `domainflow predict` does)
            times = {k: _best_us(lambda a=a: op(*a), n=n) if a is not None else None for k, a in args.items()}
        plain = times["plain"]
        rows.append({"op": name, "autograd": autograd, "plain_us": plain, "shardtensor_us": times["st"], "dtensor_us": times["dt"],
                     "python_floor_us": times["floor"],
                     "overhead_ratio": (times["st"] - plain) / (times["dt"] - plain),
                     "floor_ratio": (times["floor"] - plain) / (times["dt"] - plain) if times["floor"] else None})
    return rows


def _redistribute_rank(numel_rows: int, cols: int, fraction: float, iters: int) -> dict:
    import torch.distributed as dist

    import domainflow as df
    from domainflow import comm

    torch.set_num_threads(1)
    mesh = df.init_mesh((int(os.environ["WORLD_SIZE"]),), ("domain",))
    rank, world = mesh.get_rank(), mesh.size()
    first = int(numel_rows * fraction) if world > 1 else numel_rows
    rest = [len(c) for c in torch.arange(numel_rows - first).tensor_split(world - 1)] if world > 1 else []
    sizes = (first, *rest)
    local = torch.randn(sizes[rank], cols)
    x = df.ShardTensor.from_local(local, mesh, [df.Shard(0)], sharding_shapes={0: sizes})
    group = mesh.get_group(0)
    gather = comm._all_gather_single

    def ours():
        return x.full_tensor()

    def hand_written():
        # what a user writes by hand: pad to the largest shard, all_gather, trim, concatenate
        mx = max(sizes)
        buf = torch.zeros(mx, cols)
        buf[: local.shape[0]] = local
        out = torch.empty(world * mx, cols)
        gather(out, buf, group=group)
        return torch.cat([out[k * mx: k * mx + sizes[k]] for k in range(world)])

    assert torch.equal(ours(), hand_written())
    times = {"domainflow": [], "hand_written": []}
    for _ in range(20):
        ours(), hand_written()
    for i in range(iters):
        for name, fn in (("domainflow", ours), ("hand_written", hand_written)) if i % 2 else \
                (("hand_written", hand_written), ("domainflow", ours)):
            dist.barrier(group)
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {"sizes": sizes, "domainflow_ms": statistics.median(times["domainflow"]) * 1e3,
            "hand_written_ms": statistics.median(times["hand_written"]) * 1e3}


def redistribution() -> list[dict]:
    from domainflow.launch import launch_local

    rows = []
    for world in (2, 4):
        for rows_, cols, iters in ((4096, 16, 300), (262144, 16, 40)):
            res = launch_local(_redistribute_rank, world, rows_, cols, 0.7, iters, threads_per_rank=1)[0]
            rows.append({"world": world, "global_shape": [rows_, cols], "sizes": list(res["sizes"]),
                         "domainflow_ms": res["domainflow_ms"], "hand_written_ms": res["hand_written_ms"],
                         "ratio": res["domainflow_ms"] / res["hand_written_ms"]})
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per timing repeat")
    ap.add_argument("--ops-only", action="store_true", help="skip the multi-rank redistribution part")
    args = ap.parse_args()
    ops = []
    for autograd in (False, True):
        rows = per_op_overhead(args.calls, autograd)
        ops += rows
        what = ("input and weights need gradients (a training forward: the full engine)" if autograd else
                "under torch.no_grad() (inference: domainflow's fast path)")
        print(f"\nPer-op time on an 8x8 float32 tensor (conv: 1x2x8x8), one process, mesh of 1 (best of 7 x "
              f"{args.calls} calls); {what}")
        print(f"{'op':<24}{'torch us':>10}{'ShardTensor us':>16}{'DTensor us':>12}{'floor us':>10}"
              f"{'overhead ST/DT':>16}{'floor/DT':>10}")
        for r in rows:
            print(f"{r['op']:<24}{r['plain_us']:>10.2f}{r['shardtensor_us']:>16.2f}{r['dtensor_us']:>12.2f}"
                  + (f"{r['python_floor_us']:>10.2f}" if r["python_floor_us"] else f"{'-':>10}")
                  + f"{r['overhead_ratio']:>16.2f}" + (f"{r['floor_ratio']:>10.2f}" if r["floor_ratio"] else f"{'-':>10}"))
    print("overhead = (ShardTensor - torch) / (DTensor - torch); floor = a wrapper subclass whose "
          "__torch_dispatch__ only unwraps, runs the op and wraps")
    red = [] if args.ops_only else redistribution()
    print("\nUneven Shard(0) -> Replicate (full_tensor) vs hand-written padded all_gather, Gloo, median of 300 / 40 runs")
    print(f"{'ranks':>5}  {'global shape':<14}{'shard rows':<28}{'domainflow ms':>14}{'hand-written ms':>16}{'ratio':>7}")
    for r in red:
        print(f"{r['world']:>5}  {str(tuple(r['global_shape'])):<14}{str(r['sizes']):<28}{r['domainflow_ms']:>14.3f}"
              f"{r['hand_written_ms']:>16.3f}{r['ratio']:>7.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"torch": torch.__version__, "per_op": ops, "redistribution": red,
           "targets": {"overhead_ratio_max": 0.6, "redistribution_ratio_max": 1.3},
           "overhead_targets_met": {r["op"]: r["overhead_ratio"] <= 0.6 for r in ops if not r["autograd"]},
           "overhead_with_autograd_within_0.6": {r["op"]: r["overhead_ratio"] <= 0.6 for r in ops if r["autograd"]}}
    tmp = RESULTS / "dispatch_overhead.json.tmp"
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(RESULTS / "dispatch_overhead.json")
    print(f"\nwrote {RESULTS / 'dispatch_overhead.json'}")


if __name__ == "__main__":
    main()
