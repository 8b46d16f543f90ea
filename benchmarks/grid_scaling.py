"""Grid scaling: activation memory per rank and training-step time of a small 3-D UNet at a fixed global
grid, on 1, 2 and 4 ranks, with the grid sharded along one spatial dim.

Run: .venv/bin/python benchmarks/grid_scaling.py [--grid 96 96 96 --steps 4 --warmup 1 --rounds 3]   (about 4 min)
Prints a table and writes benchmarks/results/<--name>.json (default grid_scaling). All numbers of one run
come from the same machine state; quote ratios, not absolute times.

Grid size: the default 96^3 (a 96^3 x 8-channel float32 activation is 27 MiB; the plain step saves about
0.5 GiB for backward). At 64^3 a rank's step at W = 2 is about 0.6 s for the same 45 synchronisations
(forward: 12 halo exchanges, 10 group-norm all-reduces and the loss; backward: 11 halo exchanges, 10
group-norm all-reduces and the gradient sum), each costing about 0.3 ms of Gloo latency on this VM plus the
drift between the two cores' speeds, so this fixed cost weighs about 2.7 times as much as at 96^3:
``--grid 64 64 64 --name grid_scaling_64`` records that case.

The model (``UNet3d``): two levels of [Conv3d 3x3x3 + GroupNorm + GELU] x 2 blocks, max_pool3d down,
``nn.Upsample(scale_factor=2, mode=--up)`` up, channel-concat skips, a 1x1x1 head; float32, batch 1, input
1 x 4 x D x H x W (default 96^3, 8 base channels). The input and target are sharded along tensor dim
``--shard-dim`` (default 4, W) in balanced slabs (``distribute_tensor(..., [Shard(4)], sharding_shapes={0:
sizes})``). One step = forward,
``((model(x) - y) ** 2).mean()`` (the exact global mean), backward, Adam step.

Rows: "plain" is one process running the model on ordinary tensors (the single-process reference);
W = 1, 2, 4 run it on ShardTensors over W ranks (Gloo, ``launch_local``; W = 1 shows the cost of the sharded
code paths with nothing to exchange). Every rank uses 1 torch thread (``--threads``), so plain vs W = 2 is
one core against two; W = 4 oversubscribes the 2 cores of this machine and is reported without a target.

Measured per rank:
- saved bytes: storage bytes of the tensors autograd saves for backward during the first step's forward
  (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, by data pointer; for a saved
  ShardTensor its local tensor; parameters left out, they are replicated and tiny here).
- halo bytes: ``domainflow.comm.stats.bytes['halo']`` over that forward. These are the bytes this rank
  *sent*; the exchanges are symmetric (an interior rank sends and receives the same rows, an edge rank one
  side of each), so they stand in for the bytes received, which are what the rank saves in addition.
- peak RSS: the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs just before the first
  step) over all steps; "above base" subtracts the resident size after imports and mesh setup.
- step time: from a barrier to the end of ``opt.step()``, slowest rank per step; best and median of
  ``--steps`` steps after ``--warmup`` steps (the hooked first step is not timed) in each of ``--rounds``
  rounds. A round starts every case once, in turn (plain, W = 1, 2, 4), so the cases sample the same
  stretches of this shared VM's load rather than one case running in a quiet minute and another in a busy
  one; best and median are over all rounds' steps. Memory and halo numbers come from the first round.

Allocator (``--malloc``, default "tuned"): the ranks start with ``measure.TUNED_MALLOC`` (see there) so
that large blocks such as the im2col buffers of CPU convolutions are reused from the heap instead of being
mmap-ed and page-faulted on every call, for every case alike; "system" keeps glibc's defaults.

Correctness guard: every sharded run's first-step loss must equal the plain run's within rel 1e-4 (float32),
else the row is marked and the script exits non-zero after writing the results.

Targets (issue): saved bytes per rank at W ranks <= 1.1 x (plain bytes / W + halo bytes), max over ranks;
W = 2 throughput >= 1.6 x plain (one process, one thread).

Caveat on step times: torch's CPU convolution picks oneDNN (mkldnn) for a float32 3-D input only when
N * C * D * H > 20480 (it looks at the first four dims), else the much slower im2col ``slow_conv3d``. Slabs
along D shrink that product, so on W ranks more of the local convolutions fall to the slow kernel than in the
single-process model (e.g. 1 x 8 x 32 x 64 x 64 takes ~3x longer than 1 x 8 x 64 x 64 x 64 here). Sharding
the last spatial dim (``--shard-dim 4``, the default) leaves the choice unchanged; ``--shard-dim 2`` shows
the slow-kernel effect.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from measure import TUNED_MALLOC, SavedBytes, write_results  # noqa: E402  (benchmarks/measure.py, next to this script)
from domainflow.layout.shapes import balanced_sizes  # noqa: E402
MiB = 2**20


def _model(cin: int, c: int, cout: int, up: str):
    import torch
    from torch import nn
    from torch.nn import functional as F

    def block(a, b):
        return nn.Sequential(nn.Conv3d(a, b, 3, padding=1), nn.GroupNorm(2, b), nn.GELU(),
                             nn.Conv3d(b, b, 3, padding=1), nn.GroupNorm(2, b), nn.GELU())

    class UNet3d(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc1, self.enc2, self.mid = block(cin, c), block(c, 2 * c), block(2 * c, 2 * c)
            self.dec2, self.dec1 = block(4 * c, c), block(2 * c, c)
            self.up = nn.Upsample(scale_factor=2, mode=up, **({} if up.startswith("nearest") else
                                                               {"align_corners": False}))
            self.head = nn.Conv3d(c, cout, 1)

        def forward(self, x):
            e1 = self.enc1(x)
            e2 = self.enc2(F.max_pool3d(e1, 2))
            m = self.mid(F.max_pool3d(e2, 2))
            d2 = self.dec2(torch.cat([self.up(m), e2], dim=1))
            d1 = self.dec1(torch.cat([self.up(d2), e1], dim=1))
            return self.head(d1)

    return UNet3d()


# --------------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------------
def _rank(mode: str, cfg: dict, steps: int, warmup: int, threads: int) -> dict:
    import torch
    import torch.distributed as dist

    import domainflow as df
    from domainflow import comm
    from domainflow.preprocess.parallel import peak_memory, reset_peak_memory

    torch.set_num_threads(threads)
    sharded = mode == "sharded"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = df.init_mesh((world,), ("domain",)) if sharded else None
    base_rss = reset_peak_memory()

    torch.manual_seed(cfg["seed"])
    model = _model(cfg["cin"], cfg["channels"], cfg["cout"], cfg["up"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(1, cfg["cin"], *cfg["grid"])
    y = torch.randn(1, cfg["cout"], *cfg["grid"])
    d = cfg["shard_dim"]
    sizes = list(balanced_sizes(cfg["grid"][d - 2], world))
    if sharded:
        x = df.distribute_tensor(x, mesh, [df.Shard(d)], sharding_shapes={0: sizes})
        y = df.distribute_tensor(y, mesh, [df.Shard(d)], sharding_shapes={0: sizes})
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}

    # the analytic minimum of the forward halo traffic this rank sends: a stride-1 "same" convolution of
    # kernel k sends (k - 1) / 2 rows to each neighbour, a linear x2 upsampling (outputs owned by the rank of
    # their centre) one row, a 2x2x2 pooling of even slabs none
    analytic = {"bytes": 0, "on": False}

    def minimum(module, inputs):
        t = inputs[0]
        if not (sharded and world > 1 and analytic["on"]):
            return
        local = t.to_local()
        per_row = local.numel() // max(1, local.shape[d]) * local.element_size()
        neighbours = (rank > 0) + (rank < world - 1)
        if isinstance(module, torch.nn.Conv3d):
            rows = (module.kernel_size[d - 2] - 1) // 2
        else:
            rows = 0 if module.mode.startswith("nearest") else 1
        analytic["bytes"] += rows * neighbours * per_row

    for mod in model.modules():
        if isinstance(mod, (torch.nn.Conv3d, torch.nn.Upsample)):
            mod.register_forward_pre_hook(minimum)

    saved = SavedBytes(exclude=param_ptrs)

    def step(hooked: bool):
        opt.zero_grad(set_to_none=True)
        comm.stats.reset()
        if hooked:
            with saved.hooks():
                loss = ((model(x) - y) ** 2).mean()
        else:
            loss = ((model(x) - y) ** 2).mean()
        fwd = dict(comm.stats.bytes)
        with df.deferred_param_grads():  # one gradient sum for the whole model, as a training loop does
            loss.backward()
        opt.step()
        return loss, fwd, dict(comm.stats.bytes), dict(comm.stats.calls)

    def sync():
        if world > 1:
            dist.barrier()

    reset_peak_memory()
    sync()
    t = time.perf_counter()
    analytic["on"] = True
    loss, fwd_bytes, step_bytes, step_calls = step(hooked=True)
    analytic["on"] = False
    first_s = time.perf_counter() - t
    first_loss = float((loss.full_tensor() if isinstance(loss, df.ShardTensor) else loss).detach())
    del loss
    times = []
    for k in range(warmup + steps):
        sync()
        t = time.perf_counter()
        step(hooked=False)
        dt = time.perf_counter() - t
        if k >= warmup:
            times.append(dt)
    sync()
    return {"rank": rank, "world": world, "mode": mode, "rows": sizes[rank], "first_loss": first_loss,
            "first_step_s": first_s, "step_s": times, "saved_bytes": saved.total,
            "saved_storages": len(saved.seen), "saved_tensors": dict(saved.kinds),
            "halo_fwd_bytes": fwd_bytes.get("halo", 0), "halo_min_bytes": analytic["bytes"],
            "fwd_comm_bytes": fwd_bytes,
            "step_comm_bytes": step_bytes, "step_comm_calls": step_calls,
            "base_rss": base_rss, "peak_rss": peak_memory()}


def run_case(mode: str, world: int, cfg: dict, args) -> dict:
    """One launch of ``world`` ranks: the hooked first step, warm-up and timed steps."""
    from domainflow.launch import launch_local

    res = launch_local(_rank, world, mode, cfg, args.steps, args.warmup, args.threads,
                       threads_per_rank=args.threads)
    ranks = [res[r] for r in sorted(res)]
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    return {"mode": mode, "world": world, "step_s": slowest, "first_loss": ranks[0]["first_loss"],
            "max_saved_bytes": max(r["saved_bytes"] for r in ranks),
            "max_peak_rss": max(r["peak_rss"] for r in ranks),
            "max_peak_above_base": max(r["peak_rss"] - r["base_rss"] for r in ranks), "per_rank": ranks}


def merge_rounds(rounds: list[dict]) -> dict:
    """A case over all rounds: the first round's memory numbers, step times of every round."""
    case = dict(rounds[0])
    steps = [t for r in rounds for t in r["step_s"]]
    case["step_s"] = steps
    case["step_s_by_round"] = [r["step_s"] for r in rounds]
    case["best_s"], case["median_s"] = min(steps), statistics.median(steps)
    case["max_peak_rss"] = max(r["max_peak_rss"] for r in rounds)
    case["max_peak_above_base"] = max(r["max_peak_above_base"] for r in rounds)
    return case


# --------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", type=int, nargs=3, default=[96, 96, 96], metavar=("D", "H", "W"),
                    help="global spatial size (each divisible by 4 for the two poolings)")
    ap.add_argument("--shard-dim", type=int, default=4, choices=(2, 3, 4),
                    help="tensor dim to shard (4 = W, the last spatial dim, default: see the caveat above; "
                         "2 = D, the first)")
    ap.add_argument("--channels", type=int, default=8, help="base channels (GroupNorm uses 2 groups)")
    ap.add_argument("--up", default="trilinear", choices=("trilinear", "nearest"), help="nn.Upsample mode")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per case and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the (hooked, untimed) first one")
    ap.add_argument("--name", default="grid_scaling", help="results file stem under benchmarks/results/")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--rounds", type=int, default=3, help="times every case is started, in turn")
    ap.add_argument("--malloc", choices=("tuned", "system"), default="tuned",
                    help="glibc allocator settings of the ranks (see the module docstring)")
    args = ap.parse_args()
    if args.malloc == "tuned":
        os.environ.update(TUNED_MALLOC)  # the spawned ranks inherit it (glibc reads it at their start)

    import torch

    cfg = {"grid": list(args.grid), "cin": 4, "cout": 4, "channels": args.channels, "up": args.up, "seed": 0,
           "shard_dim": args.shard_dim}
    t0 = time.perf_counter()
    order = [("plain", 1)] + [("sharded", w) for w in args.worlds]
    rounds: dict = {key: [] for key in order}
    for _ in range(args.rounds):
        for mode, w in order:
            rounds[(mode, w)].append(run_case(mode, w, cfg, args))
    cases = [merge_rounds(rounds[key]) for key in order]
    plain = cases[0]
    single = plain["max_saved_bytes"]
    print(f"3-D UNet, input 1 x {cfg['cin']} x {' x '.join(map(str, cfg['grid']))} float32, {args.channels} base "
          f"channels, upsample {args.up}; sharded along tensor dim {args.shard_dim} "
          f"({'DHW'[args.shard_dim - 2]}) in balanced slabs; {args.threads} torch thread(s) per "
          f"rank on {os.cpu_count()} cores; malloc {args.malloc}; best / median of {args.rounds} rounds x "
          f"{args.steps} steps after {args.warmup} warm-up")
    print(f"{'W':<6}{'step s best/med':>17}{'thru':>7}{'loss ok':>9}{'saved MiB':>11}{'halo MiB':>10}"
          f"{'bound MiB':>11}{'/bound':>8}{'peak RSS MiB':>14}{'above base':>12}")
    ok_all = True
    for c in cases:
        c["throughput_vs_plain"] = plain["best_s"] / c["best_s"]
        c["throughput_vs_plain_median"] = plain["median_s"] / c["median_s"]
        c["loss_rel_err"] = abs(c["first_loss"] - plain["first_loss"]) / max(abs(plain["first_loss"]), 1e-30)
        c["loss_ok"] = c["loss_rel_err"] <= 1e-4
        ok_all &= c["loss_ok"]
        w = c["world"]
        worst = None
        for r in c["per_rank"]:
            r["bound_bytes"] = single / w + r["halo_fwd_bytes"]
            r["ratio_to_bound"] = r["saved_bytes"] / r["bound_bytes"]
            if worst is None or r["ratio_to_bound"] > worst["ratio_to_bound"]:
                worst = r
        c["worst_rank"] = worst["rank"]
        c["max_ratio_to_bound"] = worst["ratio_to_bound"]
        c["max_halo_fwd_bytes"] = max(r["halo_fwd_bytes"] for r in c["per_rank"])
        label = "plain" if c["mode"] == "plain" else str(w)
        print(f"{label:<6}{c['best_s']:>9.3f} /{c['median_s']:>6.3f}{c['throughput_vs_plain']:>6.2f}x"
              f"{'yes' if c['loss_ok'] else 'NO':>9}{c['max_saved_bytes'] / MiB:>11.1f}"
              f"{c['max_halo_fwd_bytes'] / MiB:>10.2f}{worst['bound_bytes'] / MiB:>11.1f}"
              f"{c['max_ratio_to_bound']:>8.2f}{c['max_peak_rss'] / MiB:>14.0f}{c['max_peak_above_base'] / MiB:>12.0f}")
    print("thru = plain best step time / this best step time (one grid per step); saved: max over ranks of the "
          "bytes autograd saves in forward (parameters excluded); bound = plain saved / W + the worst rank's "
          "forward halo bytes (sent, as a stand-in for received); /bound: worst rank; peak RSS: VmHWM over the "
          "steps, max over ranks; above base: minus the rank's RSS after imports and mesh setup")
    for c in cases[1:]:
        per = ", ".join(f"r{r['rank']} {r['saved_bytes'] / MiB:.1f}/{r['halo_fwd_bytes'] / MiB:.2f}"
                        for r in c["per_rank"])
        comm_b = c["per_rank"][0]["step_comm_bytes"]
        print(f"  W={c['world']}: saved/halo MiB per rank: {per}; rank 0 sends per step: "
              + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in sorted(comm_b.items())) + f"; first-step loss rel err "
              f"{c['loss_rel_err']:.1e}")

    by_w = {c["world"]: c for c in cases[1:]}
    targets = {}
    for w in (2, 4):
        if w in by_w:
            pairs = [(r["halo_fwd_bytes"], r["halo_min_bytes"]) for r in by_w[w]["per_rank"]]
            print(f"  W={w}: forward halo bytes sent per rank vs analytic minimum: "
                  + ", ".join(f"{a / MiB:.3f}/{b / MiB:.3f} MiB" for a, b in pairs))
            targets[f"halo_bytes_W{w}_equal_analytic_minimum"] = all(a == b for a, b in pairs)
    for w in (2, 4):
        if w in by_w:
            targets[f"saved_bytes_W{w}_le_1.1x_bound"] = by_w[w]["max_ratio_to_bound"] <= 1.1
    if 2 in by_w and 1 in by_w:  # parallel efficiency: the same sharded code on 2 ranks vs 1 rank, 1 core each
        targets["throughput_W2_ge_1.6x_W1"] = by_w[2]["throughput_vs_plain"] / by_w[1]["throughput_vs_plain"] >= 1.6
    if 2 in by_w:  # stricter: against plain torch in one process
        targets["throughput_W2_ge_1.6x_plain"] = by_w[2]["throughput_vs_plain"] >= 1.6
    targets["first_step_loss_matches_plain"] = ok_all
    for k, v in targets.items():
        print(f"target {k}: {'met' if v else 'NOT met'}")
    if 2 in by_w:
        print(f"  (W=2 vs plain, median steps: {by_w[2]['throughput_vs_plain_median']:.2f}x; "
              f"W=2 vs W=1 sharded: {by_w[2]['throughput_vs_plain'] / by_w[1]['throughput_vs_plain']:.2f}x)"
              if 1 in by_w else "")
    total = time.perf_counter() - t0
    print(f"total {total:.0f} s")

    out = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "threads_per_rank": args.threads,
           "malloc": args.malloc, "malloc_env": TUNED_MALLOC if args.malloc == "tuned" else {},
           "config": cfg, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "total_s": total,
           "targets": {"saved_bytes": "max over ranks saved <= 1.1 x (plain saved / W + halo forward bytes)",
                       "throughput": "W=2 best step throughput >= 1.6 x W=1 (parallel efficiency >= 0.8; 1 thread "
                                     "per rank); also reported against plain torch",
                       "loss": "first-step loss of every sharded run equals plain within rel 1e-4"},
           "targets_met": targets, "cases": cases}
    write_results(args.name, out)
    if not ok_all:
        raise SystemExit("a sharded run's first-step loss differs from the single-process loss: its numbers "
                         "measure a wrong computation")


if __name__ == "__main__":
    main()
