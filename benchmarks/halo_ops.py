"""Halo ops on a grid sharded over its rows: conv2d (3x3, padding 1) and bilinear 2x interpolate, forward
and backward, on 1 and 2 ranks (Gloo, one thread per rank) against plain torch on the whole grid in one
process with one thread, each case in fresh processes started alike (glibc keeps large blocks in the
heap, ``measure.TUNED_MALLOC``: with its defaults a process's first backward passes page-fault their
buffers anew and plain conv2d at 256^2 took 7-13 ms in one process). Small grids show the per-call cost
of the engine (plans, autograd nodes, the exchange), large ones the parallel speed-up.

Run: .venv/bin/python benchmarks/halo_ops.py   (prints a table, writes benchmarks/results/halo_ops.json).
Quote ratios from one run: "vs plain" is plain torch's time over the sharded time per call (above 1: faster
than one plain process); plain is timed before and after the sharded runs and the faster time counts.

Peer: with PhysicsNeMo installed (``make peers``; ``--peer none`` skips it) the same steps run on
PhysicsNeMo's ShardTensor on the same ranks, right after domainflow's at each size, and "vs PhysicsNeMo" is
its time over domainflow's (above 1: domainflow faster). Each rank first checks that the library's forward
output, gathered, equals plain torch's on the whole grid (rel 1e-5).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import TUNED_MALLOC, write_results  # noqa: E402  (benchmarks/measure.py, next to this script)

CHANNELS = 8


def _ops():
    import torch.nn.functional as F

    return {
        "conv2d 3x3": lambda x, w: F.conv2d(x, w, padding=1),
        "interpolate bilinear x2": lambda x, w: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
    }


def _time_calls(fn, calls: int, barrier=None) -> float:
    """Median seconds per call over 5 rounds of ``calls`` calls (after a warm-up round)."""
    fn()
    rounds = []
    for _ in range(5):
        if barrier:
            barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls)
    return statistics.median(rounds)


def _step(op, x, w):
    def run():
        y = op(x, w)
        y.sum().backward()
    return run


def plain(size: int, calls: int) -> dict:
    """Plain torch in a fresh process started like the ranks (same allocator settings, one thread)."""
    from domainflow.launch import launch_local

    return launch_local(_plain_rank, 1, size, calls, threads_per_rank=1, env=TUNED_MALLOC, start_method="spawn")[0]


def _plain_rank(size: int, calls: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = {}
    for name, op in _ops().items():
        x = torch.randn(1, CHANNELS, size, size, requires_grad=True)
        w = torch.randn(CHANNELS, CHANNELS, 3, 3, requires_grad=True)
        out[name] = _time_calls(_step(op, x, w), calls)
    return out


def _rows_sharded(library: str, full, world: int):
    """The grid split over its rows in balanced slabs, as a domainflow or PhysicsNeMo ShardTensor."""
    sizes = [len(c) for c in torch.arange(full.shape[2]).tensor_split(world)]
    if library == "domainflow":
        import domainflow as df

        mesh = df.init_mesh((world,), ("domain",))
        return df.distribute_tensor(full, mesh, [df.Shard(2)], sharding_shapes={0: sizes})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import warnings

    import peers

    warnings.simplefilter("ignore")  # its deprecation notices, once per call, from every rank
    pdp = peers.load_physicsnemo()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    local = full.tensor_split(world, dim=2)[dist.get_rank()].clone()
    # the shapes given: PhysicsNeMo's "infer" gathers them through pinned memory, which needs CUDA
    shapes = {0: [(1, full.shape[1], n, full.shape[3]) for n in sizes]}
    return pdp.ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes=shapes)


def _sharded_rank(size: int, calls: int, library: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for name, op in _ops().items():
        full = torch.randn(1, CHANNELS, size, size)
        w = torch.randn(CHANNELS, CHANNELS, 3, 3, requires_grad=True)
        x = _rows_sharded(library, full, world).detach().requires_grad_(True)
        with torch.no_grad():
            got = op(x, w).full_tensor()
            want = op(full, w)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
            raise RuntimeError(f"{library} {name} at {size}^2 on {world} ranks differs from plain torch")
        barrier = (lambda: dist.barrier()) if world > 1 else None
        out[name] = _time_calls(_step(op, x, w), calls, barrier)
    return out


def sharded(size: int, calls: int, world: int, library: str = "domainflow") -> dict:
    from domainflow.launch import launch_local

    per_rank = launch_local(_sharded_rank, world, size, calls, library, threads_per_rank=1, env=TUNED_MALLOC, start_method="spawn")
    return {name: max(r[name] for r in per_rank.values()) for name in _ops()}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 256, 512])
    ap.add_argument("--calls", type=int, nargs="+", default=[200, 20, 5], help="calls per round, per size")
    ap.add_argument("--peer", choices=["auto", "physicsnemo", "none"], default="auto",
                    help="also time PhysicsNeMo's ShardTensor (auto: when installed, see `make peers`)")
    args = ap.parse_args()
    import peers

    peer = args.peer == "physicsnemo" or (args.peer == "auto" and peers.physicsnemo_available())
    if args.peer == "physicsnemo":
        peers.load_physicsnemo()  # fails here, naming `make peers`, before any rank starts
    elif args.peer == "auto" and not peer:
        print(f"PhysicsNeMo not installed: no peer column ({peers.INSTALL_HINT})")
    rows = []
    for size, calls in zip(args.sizes, args.calls):
        base = plain(size, calls)
        results = {w: sharded(size, calls, w) for w in (1, 2)}
        theirs = {w: sharded(size, calls, w, "physicsnemo") for w in (1, 2)} if peer else {}
        # this VM's speed drifts over seconds: plain is timed again after the sharded runs, the faster counts
        again = plain(size, calls)
        base = {name: min(base[name], again[name]) for name in base}
        for name in _ops():
            row = {"op": name, "grid": [size, size], "channels": CHANNELS, "plain_ms": base[name] * 1e3}
            for w in (1, 2):
                row[f"sharded_w{w}_ms"] = results[w][name] * 1e3
                row[f"w{w}_vs_plain"] = base[name] / results[w][name]
                if peer:
                    row[f"physicsnemo_w{w}_ms"] = theirs[w][name] * 1e3
                    row[f"w{w}_vs_physicsnemo"] = theirs[w][name] / results[w][name]
            rows.append(row)
    print(f"\nforward + backward per call, {CHANNELS} channels, rows sharded; median of 5 rounds")
    print(f"{'op':<26}{'grid':>10}{'plain ms':>10}{'W=1 ms':>9}{'W=2 ms':>9}{'W=1 vs plain':>14}{'W=2 vs plain':>14}"
          + (f"{'PNeMo W=1':>11}{'PNeMo W=2':>11}{'W=1 vs PNeMo':>14}{'W=2 vs PNeMo':>14}" if peer else ""))
    for r in rows:
        print(f"{r['op']:<26}{'x'.join(map(str, r['grid'])):>10}{r['plain_ms']:>10.3f}{r['sharded_w1_ms']:>9.3f}"
              f"{r['sharded_w2_ms']:>9.3f}{r['w1_vs_plain']:>14.2f}{r['w2_vs_plain']:>14.2f}"
              + (f"{r['physicsnemo_w1_ms']:>11.3f}{r['physicsnemo_w2_ms']:>11.3f}{r['w1_vs_physicsnemo']:>14.2f}"
                 f"{r['w2_vs_physicsnemo']:>14.2f}" if peer else ""))
    if peer:
        print("PNeMo: PhysicsNeMo's ShardTensor on the same ranks; vs PNeMo = its time / domainflow's")
    write_results("halo_ops", {"torch": torch.__version__, "threads_per_rank": 1, "rows": rows,
                               "peer": "physicsnemo " + _peer_version() if peer else None})


def _peer_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-physicsnemo")
    except PackageNotFoundError:
        import physicsnemo

        return getattr(physicsnemo, "__version__", "?")


if __name__ == "__main__":
    main()
