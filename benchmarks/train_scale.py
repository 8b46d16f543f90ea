"""Training and prediction at full resolution (issue 16): a points budget per step, activation checkpointing,
domain 2 against domain 1 at 1M points, block inference with per-rank outputs, and the memory estimate
against measured runs, including the largest sample that trains within a per-rank budget at domain 1, 2, 4.

Run: .venv/bin/python benchmarks/train_scale.py [--cells 1000000 --large 3000000 --budget 3GiB --rounds 2
     --steps 3 --work /tmp/domainflow_train_scale]                       (about 15-20 min on 2 cores)
Prints one table per part and writes benchmarks/results/train_scale.json. Ratios are taken between runs of
this one invocation (the machine may be shared: the 1-minute load average is in the JSON).

Model: the surface Transolver of the issue (dim 32, 2 layers, 4 heads, 32 slices; coords + normals + the
14 design parameters -> Cp, Cf), float32, AdamW, the real ``Trainer`` (``train_step``: forward, loss,
backward, optimizer), one torch thread per rank, ranks started by ``launch_local`` (Gloo). Data: synthetic
DrivaerML-style runs of about ``--cells`` and ``--large`` surface cells, ingested into 8 RCB parts (the
stores of ``train_scaling.py``, made once under ``--work``). "peak" is a rank's whole-process peak resident
size (VmHWM); the largest over ranks is reported, and the JSON also has the sum over ranks.

Timed runs pin each rank's process to one core (its data-loading threads included), so "domain 1 on one
core" does not load its data on the idle second core while the ranks of domain 2 load theirs on their own.

Allocator: memory is measured with glibc's defaults (what a user's process gets); step times with the
"tuned" heap of ``train_scaling.py`` (large blocks kept in the heap: with the defaults a 1M-point step
spends most of its time in page faults, which would make the timings measure the kernel, not the work).
Each part says which it uses.

Parts and targets:
1. points budget: ``data.sample_points=200000`` on the ``--cells`` and the ``--large`` store, domain 1:
   peak and step time within 1.2x of each other (defaults allocator for the peak, tuned for the time).
2. activation checkpointing at ``--cells`` points, domain 1 (tuned): best step <= 1.4x the plain step.
3. domain 2 (2 ranks, 2 cores) against domain 1 (1 core) at ``--cells`` points (tuned): >= 1.8x samples/s;
   next to it the control (dp 2 on runs of half the points: the same per-rank work without collectives).
4. predict with block inference (``--block-points``, a block over the whole domain, each rank its share;
   defaults allocator), a piece per rank (.pvtp): peak at ``--large`` points <= 1.3x at ``--cells`` points
   (domain 1); at ``--large`` domain 2's largest rank <= 0.6x domain 1's. The block (default 2^20 points)
   holds the whole ``--cells`` sample at domain 1 and a third of ``--large``: a rank's peak is its fixed cost
   (interpreter, torch, model: ~350 MB) + its share of one block + what stays for every point of its share,
   so the domain-2 target needs the block's activations to outweigh the fixed cost (about 4x), and the
   large/small target needs the block not to be smaller than the small sample. ``--small-block`` (65536)
   runs the same three predictions with a block below both samples for comparison (not a target).
5. the memory estimate (``domainflow.train.estimate``: two measured steps at 16k and 32k points) against the measured
   peaks of part 6 (two other sizes, N and 1.25 N per rank, at domain 1, 2 and 4): within 15%. Part 1's
   runs (200k points per rank) are shown beside it, not a target: there glibc's heap keeps freed (N, 32)
   activations (25 MB, under its 32 MiB mmap ceiling), so the process peaks ~16-20% above the live peak
   the estimate measures; the estimate's 20% headroom is for that.
6. largest sample within ``--budget`` per rank at domain 1, 2, 4 (defaults allocator): the estimate's
   largest size N (with its 20% headroom for the allocator); a store of about N cells and one of about
   1.25 N cells trained for 2 steps at that domain size; the measured largest lies between the largest that
   fit and the smallest that did not (and where the line through the two measured peaks meets the budget).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from measure import TUNED_MALLOC, write_results  # noqa: E402  (benchmarks/measure.py, next to this script)
from train_scaling import prepare_store  # noqa: E402

MiB, GiB = 2**20, 2**30
MODEL = ["model.dim=32", "model.layers=2", "model.heads=4", "model.slices=32"]
BUDGET_POINTS = 200000
TARGETS = {"budget_peak": 1.2, "budget_step": 1.2, "checkpoint_step": 1.4, "domain2_throughput": 1.8,
           "predict_large_over_small": 1.3, "predict_domain2_over_domain1": 0.6, "estimate_error": 0.15}
BRACKET = 1.25


# ------------------------------------------------------------------------------------------------ ranks
def _train_rank(over: list[str], steps: int, pin: bool) -> dict:
    """One rank: the Trainer's steps; per-step seconds (barrier to barrier) and the process's peak RSS.
    ``pin``: the whole process (its prefetch and zarr threads too) on core LOCAL_RANK, so domain 1 does its
    data loading on its one core as each rank of domain 2 does, instead of on the idle second core."""
    import torch
    import torch.distributed as dist

    from domainflow.preprocess.parallel import peak_memory
    from domainflow.train import Trainer, load_config

    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    trainer = Trainer(load_config(None, over))
    world = dist.get_world_size()
    stream = trainer._stream(0, steps)
    times, rows = [], 0
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _, samples, _ = next(stream)
        rows = max(rows, *(getattr(s["coords"], "_local", s["coords"]).shape[0] for _, s in samples))
        trainer.train_step(samples)
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
        del samples
    stream.close()
    return {"rank": dist.get_rank(), "step_s": times, "peak": peak_memory(), "rows": rows}


def _predict_rank(checkpoint: str, store: str, run: str, out: str, domain: int, block: int) -> dict:
    """One rank of ``domainflow predict`` (a piece per rank); the process's peak RSS."""
    import torch
    import torch.distributed as dist

    from domainflow.preprocess.parallel import peak_memory
    from domainflow.train.predict import predict_main

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    predict_main(checkpoint, store, [run], out, domain, block, False)
    return {"rank": dist.get_rank(), "peak": peak_memory(), "s": time.perf_counter() - t0}


def _launch(fn, nproc: int, *args, malloc: dict | None = None) -> list[dict]:
    from domainflow.launch import launch_local

    env = {**{k: None for k in TUNED_MALLOC}, **(malloc or {})}  # glibc's defaults unless tuned
    res = launch_local(fn, nproc, *args, threads_per_rank=1, env=env, start_method="spawn")
    return [res[r] for r in sorted(res)]


def train(store: Path, work: Path, label: str, domain: int, steps: int, extra=(), tuned=False,
          nproc: int | None = None) -> dict:
    """``steps`` Trainer steps at ``domain`` ranks (``nproc`` in all, with a dp axis in ``extra``);
    slowest-rank step times after the first, peaks."""
    over = [f"data.store={store}", *MODEL, "output.progress=false", "output.plots=false", f"train.steps={steps}",
            f"output.dir={work / 'out' / label}", f"mesh.domain={domain}", "data.prefetch=1", *extra]
    load0 = os.getloadavg()[0]
    ranks = _launch(_train_rank, nproc or domain, over, steps, tuned, malloc=TUNED_MALLOC if tuned else None)
    timed = [max(r["step_s"][k] for r in ranks) for k in range(1, steps)]
    return {"label": label, "domain": domain, "overrides": over, "malloc": "tuned" if tuned else "system",
            "step_s": timed, "best_s": min(timed) if timed else None,
            "median_s": statistics.median(timed) if timed else None, "peak": max(r["peak"] for r in ranks),
            "peak_sum": sum(r["peak"] for r in ranks), "rows": max(r["rows"] for r in ranks),
            "load_avg_1min": [load0, os.getloadavg()[0]], "per_rank": ranks}


# ------------------------------------------------------------------------------------------------ parts
def part_budget(small, large, work, steps) -> dict:
    res = {}
    for name, store in (("small", small), ("large", large)):
        extra = [f"data.sample_points={BUDGET_POINTS}"]
        res[name] = {"memory": train(store, work, f"budget_{name}_mem", 1, 2, extra),
                     "time": train(store, work, f"budget_{name}_time", 1, steps + 1, extra, tuned=True)}
    res["peak_ratio"] = res["large"]["memory"]["peak"] / res["small"]["memory"]["peak"]
    res["step_ratio"] = res["large"]["time"]["best_s"] / res["small"]["time"]["best_s"]
    res["step_ratio_median"] = res["large"]["time"]["median_s"] / res["small"]["time"]["median_s"]
    return res


def part_timed(small, half, work, steps, rounds) -> dict:
    """Parts 2 and 3 interleaved: plain and checkpointed at domain 1, plain at domain 2 and the control,
    ``rounds`` times; each configuration's best round (the machine's speed drifts). The control is mesh
    (dp 2, domain 1) on runs of half the points: each rank trains a whole run of N/2 points, the per-rank work
    of domain 2 without its collectives, so its step is what two co-running ranks reach on this machine."""
    runs = {"plain": [], "checkpointed": [], "W2": [], "control": []}
    for k in range(rounds):
        runs["plain"].append(train(small, work, f"plain_W1_{k}", 1, steps + 1, tuned=True))
        runs["checkpointed"].append(train(small, work, f"ckpt_W1_{k}", 1, steps + 1,
                                          ["train.checkpoint_activations=true"], tuned=True))
        runs["W2"].append(train(small, work, f"plain_W2_{k}", 2, steps + 1, tuned=True))
        runs["control"].append(train(half, work, f"control_dp2_{k}", 1, steps + 1, ["mesh.dp=2"], tuned=True,
                                     nproc=2))
    best = {name: min(rs, key=lambda r: r["best_s"]) for name, rs in runs.items()}
    for name, rs in runs.items():
        best[name] = {**best[name], "rounds_best_s": [r["best_s"] for r in rs],
                      "rounds_median_s": [r["median_s"] for r in rs], "median_s": min(r["median_s"] for r in rs)}
    plain, ckpt, w2, control = best["plain"], best["checkpointed"], best["W2"], best["control"]
    return {"checkpoint": {"plain": plain, "checkpointed": ckpt, "ratio": ckpt["best_s"] / plain["best_s"],
                           "ratio_median": ckpt["median_s"] / plain["median_s"]},
            "domain2": {"W1": plain, "W2": w2, "throughput": plain["best_s"] / w2["best_s"],
                        "throughput_median": plain["median_s"] / w2["median_s"], "control": control,
                        "control_throughput": plain["best_s"] / control["best_s"]}}


def part_predict(small, large, work, block) -> dict:
    # a checkpoint of the benchmark's model (one step on 16k points of the small store)
    from domainflow.train.config import load_config

    ck_out = work / "out" / "predict_ckpt"

    cfg = load_config(None, [f"data.store={small}", *MODEL, "output.progress=false", "output.plots=false",
                             "train.steps=1", "data.sample_points=16384", f"output.dir={ck_out}", "data.prefetch=0"])
    _launch(_fit_rank, 1, cfg.to_dict())
    ckpt = str(ck_out / "checkpoints")
    res = {}
    for name, store, domain in (("small_W1", small, 1), ("large_W1", large, 1), ("large_W2", large, 2)):
        run = _first_run(store)
        out = work / "out" / "predict" / f"{name}.pvtp"
        load0 = os.getloadavg()[0]
        ranks = _launch(_predict_rank, domain, ckpt, str(store), run, str(out), domain, block)
        res[name] = {"peak": max(r["peak"] for r in ranks), "peak_sum": sum(r["peak"] for r in ranks),
                     "s": max(r["s"] for r in ranks), "run": run, "domain": domain, "block_points": block,
                     "load_avg_1min": [load0, os.getloadavg()[0]]}
    res["large_over_small"] = res["large_W1"]["peak"] / res["small_W1"]["peak"]
    res["domain2_over_domain1"] = res["large_W2"]["peak"] / res["large_W1"]["peak"]
    return res


def print_predict(p: dict) -> None:
    for name in ("small_W1", "large_W1", "large_W2"):
        r = p[name]
        print(f"   {name:>9}: peak per rank {r['peak'] / MiB:.0f} MiB (all ranks {r['peak_sum'] / MiB:.0f}), "
              f"{r['s']:.1f} s")
    print(f"   large / small at domain 1: {p['large_over_small']:.3f}x; domain 2 / domain 1 at large: "
          f"{p['domain2_over_domain1']:.3f}x")


def _fit_rank(cfg_dict: dict) -> dict:
    from domainflow.train.config import from_dict
    from domainflow.train.loop import Trainer

    cfg = from_dict(cfg_dict)
    trainer = Trainer(cfg)
    for _, samples, _ in trainer._stream(0, 1):
        trainer.train_step(samples)
    trainer.save()
    return {}


def _first_run(store: Path) -> str:
    from domainflow.readers import open_store

    s = open_store(store)
    try:
        return s.runs()[0]
    finally:
        s.close()


def part_estimate(small: Path):
    from domainflow.train.config import load_config
    from domainflow.train.estimate import measure

    cfg = load_config(None, [f"data.store={small}", *MODEL, "data.prefetch=1"])
    t0 = time.perf_counter()
    model = measure(cfg)
    return model, time.perf_counter() - t0


def part_largest(work: Path, model, budget: int) -> dict:
    from domainflow.train.estimate import HEADROOM, largest_points

    res = {}
    for w in (1, 2, 4):
        n_pred = largest_points(model, budget, w)  # with the estimate's headroom for the allocator
        row = {"predicted_points": n_pred, "predicted_bytes": model.train.bytes_at(n_pred / w), "headroom": HEADROOM,
               "runs": []}
        for factor in (1.0, BRACKET):
            store, cells, _ = prepare_store(work, int(n_pred * factor), 3)
            r = train(store, work, f"largest_W{w}_{factor}", w, 2)
            r["cells"] = cells
            r["predicted"] = model.train.bytes_at(r["rows"])
            r["fits"] = r["peak"] <= budget
            row["runs"].append(r)
        fit = [r["cells"] for r in row["runs"] if r["fits"]]
        over = [r["cells"] for r in row["runs"] if not r["fits"]]
        row["measured_largest_at_least"] = max(fit) if fit else None
        row["measured_largest_below"] = min(over) if over else None
        (a, b) = row["runs"]  # the two measured peaks, joined by a line: where it crosses the budget
        row["measured_largest_interpolated"] = int(a["cells"] + (budget - a["peak"]) * (b["cells"] - a["cells"]) /
                                                   (b["peak"] - a["peak"])) if b["peak"] != a["peak"] else None
        res[str(w)] = row
    return res


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=1000000, help="surface cells per run of the small store")
    ap.add_argument("--large", type=int, default=3000000, help="surface cells per run of the large store")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed) of the timed parts")
    ap.add_argument("--block-points", type=int, default=1 << 20,
                    help="predict's block of points over the domain (each rank its share) for the targets")
    ap.add_argument("--small-block", type=int, default=65536,
                    help="a second predict block, smaller than both samples, shown next to it (0: skip)")
    ap.add_argument("--budget", default="3GiB", help="per-rank memory budget of part 6")
    ap.add_argument("--parts", default="budget,timed,predict,estimate,largest",
                    help="comma-separated parts to run (timed: parts 2 and 3)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of parts 2 and 3")
    ap.add_argument("--work", default="/tmp/domainflow_train_scale", help="stores and outputs (kept between runs)")
    args = ap.parse_args()
    from domainflow.cli_values import parse_bytes as _bytes

    budget = _bytes(args.budget)
    parts = set(args.parts.split(","))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    small, cells_small, _ = prepare_store(work, args.cells, 3)
    large, cells_large, _ = prepare_store(work, args.large, 3)
    out = {"cells_small": cells_small, "cells_large": cells_large, "model": MODEL, "targets": TARGETS,
           "cpu_count": os.cpu_count(), "budget_bytes": budget}
    met = {}

    if "budget" in parts:
        b = out["budget"] = part_budget(small, large, work, args.steps)
        print(f"1. data.sample_points={BUDGET_POINTS}, domain 1")
        print(f"{'store':>10} {'cells':>10} {'peak MiB':>9} {'step s best/med (tuned)':>24}")
        for name, cells in (("small", cells_small), ("large", cells_large)):
            m, t = b[name]["memory"], b[name]["time"]
            print(f"{name:>10} {cells:>10,} {m['peak'] / MiB:>9.0f} {t['best_s']:>15.2f} / {t['median_s']:.2f}")
        print(f"   large / small: peak {b['peak_ratio']:.3f}x, step {b['step_ratio']:.3f}x (median "
              f"{b['step_ratio_median']:.3f}x)")
        met["budget_peak_within_1.2x"] = b["peak_ratio"] <= TARGETS["budget_peak"]
        met["budget_step_within_1.2x"] = max(b["step_ratio"], 1 / b["step_ratio"]) <= TARGETS["budget_step"]

    if "timed" in parts:
        half, cells_half, _ = prepare_store(work, args.cells // 2, 3)
        timed = part_timed(small, half, work, args.steps, args.rounds)
        c = out["checkpoint"] = timed["checkpoint"]
        print(f"2. activation checkpointing at {cells_small:,} points, domain 1 (tuned, pinned; best of "
              f"{args.rounds} interleaved rounds)")
        for name in ("plain", "checkpointed"):
            r = c[name]
            print(f"   {name:>13}: step best / median {r['best_s']:.2f} / {r['median_s']:.2f} s (rounds' best "
                  f"{', '.join(f'{x:.2f}' for x in r['rounds_best_s'])}), peak {r['peak'] / MiB:.0f} MiB (tuned heap)")
        print(f"   checkpointed / plain: {c['ratio']:.3f}x (median {c['ratio_median']:.3f}x)")
        met["checkpoint_step_le_1.4x"] = c["ratio"] <= TARGETS["checkpoint_step"]
        d = out["domain2"] = timed["domain2"]
        print(f"3. domain 2 (2 ranks, 2 cores) vs domain 1 (1 core) at {cells_small:,} points (tuned, pinned)")
        print(f"   W=1 {d['W1']['best_s']:.2f} s, W=2 {d['W2']['best_s']:.2f} s per step (rounds' best "
              f"{', '.join(f'{x:.2f}' for x in d['W2']['rounds_best_s'])}): {d['throughput']:.2f}x samples/s "
              f"(median {d['throughput_median']:.2f}x)")
        print(f"   control, dp 2 on runs of {cells_half:,} points (no domain collectives): {d['control']['best_s']:.2f} s "
              f"per step, {d['control_throughput']:.2f}x: what two co-running ranks reach on this machine")
        met["domain2_throughput_ge_1.8x"] = d["throughput"] >= TARGETS["domain2_throughput"]

    if "predict" in parts:
        p = out["predict"] = part_predict(small, large, work, args.block_points)
        print(f"4. predict with --block-points {args.block_points} (over the domain), a piece per rank (.pvtp)")
        print_predict(p)
        if args.small_block:
            q = out["predict_small_block"] = part_predict(small, large, work, args.small_block)
            print(f"   the same with --block-points {args.small_block} (not the target's block):")
            print_predict(q)
        met["predict_large_le_1.3x_small"] = p["large_over_small"] <= TARGETS["predict_large_over_small"]
        met["predict_domain2_le_0.6x_domain1"] = p["domain2_over_domain1"] <= TARGETS["predict_domain2_over_domain1"]

    model = None
    if "estimate" in parts or "plan" in parts or "largest" in parts:  # plan: its earlier name
        model, estimate_s = part_estimate(small)
        out["estimate"] = {"train": vars(model.train), "eval": vars(model.eval), "sizes": model.sizes,
                       "train_peaks": model.train_peaks, "eval_peaks": model.eval_peaks, "seconds": estimate_s,
                       "checks": []}
        print(f"5. estimate: a training step {model.train.fixed / MiB:.0f} MiB + {model.train.per_point / 1024:.2f} "
              f"KiB per point, evaluation {model.eval.fixed / MiB:.0f} MiB + {model.eval.per_point / 1024:.2f} KiB "
              f"per point (measured at {', '.join(map(str, model.sizes))} points in {estimate_s:.0f} s)")
    if "largest" in parts:
        lg = out["largest"] = part_largest(work, model, budget)
        print(f"6. largest sample within {budget / GiB:.1f} GiB per rank (defaults allocator, 2 steps)")
        print(f"{'W':>3} {'estimated N':>11} {'run cells':>11} {'peak MiB':>9} {'estimated MiB':>13} {'fits':>5}")
        for w, row in lg.items():
            for r in row["runs"]:
                print(f"{w:>3} {row['predicted_points']:>11,} {r['cells']:>11,} {r['peak'] / MiB:>9.0f} "
                      f"{r['predicted'] / MiB:>13.0f} {'yes' if r['fits'] else 'no':>5}")
            lo, hi = row["measured_largest_at_least"], row["measured_largest_below"]
            interp = row["measured_largest_interpolated"]
            print(f"    W={w}: measured largest {'>= ' + format(lo, ',') if lo else '< ' + format(hi, ',')}"
                  f"{' and < ' + format(hi, ',') if lo and hi else ''}"
                  f"{f' (about {interp:,} between the two runs)' if interp else ''}; estimated "
                  f"{row['predicted_points']:,} (with {100 * row['headroom']:.0f}% headroom)")
            met[f"largest_W{w}_estimated_size_fits"] = bool(row["runs"][0]["fits"])
    if model is not None:
        checks = out["estimate"]["checks"]
        for r in ([out["budget"][n]["memory"] for n in ("small", "large")] if "budget" in out else []) + \
                 [r for row in out.get("largest", {}).values() for r in row["runs"]]:
            pred = model.train.bytes_at(r["rows"])
            checks.append({"label": r["label"], "rows_per_rank": r["rows"], "measured": r["peak"],
                           "predicted": pred, "error": pred / r["peak"] - 1})
        if checks:
            print("   estimate vs measured peak per rank (defaults allocator):")
            for ch in checks:
                print(f"   {ch['label']:>22}: {ch['rows_per_rank']:>9,} points/rank, measured "
                      f"{ch['measured'] / MiB:>6.0f} MiB, estimated {ch['predicted'] / MiB:>6.0f} MiB "
                      f"({100 * ch['error']:+.1f}%)")
            # the target: within 15% of measured runs at two sizes other than the estimate's own, which
            # part 6's runs are (N and 1.25 N points per rank at domain 1, 2 and 4); the budget runs at 200k
            # points per rank are reported beside it: there glibc's heap keeps the freed (N, 32) activations
            # (25 MB, under its 32 MiB mmap ceiling) and the runs come out ~16-20% above the live peak
            sized = [ch for ch in checks if ch["label"].startswith("largest_")]
            met["estimate_within_15pct_at_two_other_sizes"] = (
                len({ch["label"].rsplit("_", 1)[-1] for ch in sized}) >= 2
                and all(abs(ch["error"]) <= TARGETS["estimate_error"] for ch in sized))
            out["estimate"]["within_15pct_every_check"] = all(abs(ch["error"]) <= TARGETS["estimate_error"] for ch in checks)
            print(f"   every check within 15% (budget runs included, not the target): "
                  f"{'yes' if out['estimate']['within_15pct_every_check'] else 'no'}")
    for k, v in met.items():
        print(f"target {k}: {'met' if v else 'NOT met'}")
    out["targets_met"] = met
    out["total_s"] = time.perf_counter() - t_start
    out["load_avg_1min_start_end"] = [load_start, os.getloadavg()[0]]
    print(f"total {out['total_s']:.0f} s; 1-min load average {load_start:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    write_results("train_scale", out)


if __name__ == "__main__":
    main()
