"""How many ranks a sample needs: ``domainflow plan``.

One training step of the config (its model, loss, optimizer, dtype, autocast and activation checkpointing:
the real ``Trainer``) is measured at domain 1 on small draws of a training run (``data.sample_points``) of
two sizes, in a child process. Its peak memory, fitted as ``fixed + bytes per point x points``, predicts a
rank's peak at any domain size: the activations follow the points a rank holds (the largest rank's share
of the store's spatial parts), the parameters, gradients and optimizer state are replicated.

Peak memory is the process's peak resident size on CPU, measured with glibc returning every freed block of
64 KiB or more to the OS at once (``MALLOC_MMAP_THRESHOLD_``), so that it is the peak of live memory and not
of whatever the heap kept; on a GPU it is the CUDA caching allocator's peak allocated memory (the CUDA
context and the allocator's cache come on top). A real run's allocator keeps some freed memory on top of
the live peak (glibc's heap on CPU, the caching allocator's reserve on a GPU), so whether a domain size fits
is decided with ``headroom`` (default 10%) on top of the prediction (``benchmarks/train_scale.py`` measures
how far real runs are from the plan).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

from .config import Config, ConfigError, from_dict

PLAN_SIZES = (16384, 32768)       # points of the two measured samples
PLAN_STEPS = 2                    # steps per size; the last one (optimizer state in place) is measured
MEASURE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}  # freed blocks >= 64 KiB go back to the OS at once
DOMAINS = (1, 2, 4, 8, 16, 32, 64)
HEADROOM = 0.10                   # the allocator's share on top of the live peak when deciding what fits


class PlanError(ConfigError):
    """A plan that cannot be made (a grid config, a store too small to measure on); says what to change."""


@dataclass
class MemoryModel:
    """A rank's peak memory in a training step: ``fixed + per_point * points`` (bytes)."""

    fixed: float
    per_point: float
    sizes: tuple = ()
    peaks: tuple = ()
    device: str = "cpu"
    parts: int = 1
    seconds: tuple = field(default_factory=tuple)

    def bytes_at(self, points: float) -> float:
        return self.fixed + self.per_point * points


def rank_points(points: int, domain: int, parts: int) -> int:
    """Points of the largest rank's share when a sample of ``points`` is split over ``domain`` ranks: rank r
    reads parts ``[r*P//W, (r+1)*P//W)`` of the run's ``parts`` spatial parts (about equal in size)."""
    most = max((r + 1) * parts // domain - r * parts // domain for r in range(domain))
    return math.ceil(points * most / parts)


def check_plannable(cfg: Config) -> tuple[int, int]:
    """(points of the smallest training run, parts per run) of the config's mesh store; a grid config or a
    store without a train split is refused with what to do instead."""
    from domainflow.readers import open_store

    if cfg.data.kind != "mesh":
        raise PlanError("domainflow plan measures memory per point of a mesh sample; a grid config splits rows of "
                        "a fixed grid (measure a step with domainflow train --domain 1 instead)")
    if not cfg.data.store:
        raise ConfigError("data.store is not set; give the path of an ingested store (domainflow ingest ...)")
    store = open_store(cfg.data.store)
    try:
        store.require_kind("mesh")
        runs = store.runs("train")
        if not runs:
            raise PlanError(f"{store.path} has no runs in its train split; the plan measures a training step on one")
        sizes = [int(store.run(r)[cfg.data.location]["parts"][-1]) for r in runs]
        parts = int(store.parts)
    finally:
        store.close()
    return min(sizes), parts


def measure(cfg: Config, sizes=PLAN_SIZES, steps: int = PLAN_STEPS) -> MemoryModel:
    """Fit a rank's peak memory per step to the points of the sample, from one child process at domain 1."""
    from domainflow.app.launch import launch_local

    smallest, parts = check_plannable(cfg)
    sizes = tuple(sorted(int(s) for s in sizes))
    if len(sizes) < 2 or sizes[0] < 1 or len(set(sizes)) != len(sizes):
        raise PlanError(f"the plan needs two or more different sample sizes to measure, got {list(sizes)}")
    if sizes[-1] > smallest:
        raise PlanError(f"the plan measures samples of {sizes[-1]} points, but the smallest training run of "
                        f"{cfg.data.store} has {smallest}; pass smaller --sizes (e.g. {smallest // 4},{smallest // 2})")
    if steps < 2:
        raise PlanError("the plan measures the second step or later (the first creates the optimizer state)")
    saved = {k: os.environ.get(k) for k in MEASURE_MALLOC}
    os.environ.update(MEASURE_MALLOC)  # the spawned rank inherits it; glibc reads it when the process starts
    try:
        with tempfile.TemporaryDirectory(prefix="domainflow-plan-") as out:
            result = launch_local(_measure_rank, 1, cfg.to_dict(), sizes, steps, out)[0]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    peaks = [p for p, _ in result["peaks"]]
    n = len(sizes)  # least-squares line through the measured points
    mx, my = sum(sizes) / n, sum(peaks) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, peaks)) / sum((x - mx) ** 2 for x in sizes)
    if slope <= 0:
        raise PlanError(f"the peak memory did not grow from {sizes[0]} to {sizes[-1]} points ({peaks}); measure "
                        f"larger samples with --sizes")
    return MemoryModel(fixed=my - slope * mx, per_point=slope, sizes=sizes, peaks=tuple(peaks),
                       device=result["device"], parts=parts, seconds=tuple(s for _, s in result["peaks"]))


def _measure_rank(cfg_dict: dict, sizes, steps: int, out: str) -> dict:
    """The child process: the config's Trainer at domain 1 on draws of each size; each size's peak memory
    over its measured steps (bytes) and the step time (s)."""
    import gc
    import time

    import torch

    from .loop import Trainer

    peaks = []
    device = "cpu"
    for n in sizes:
        d = dict(cfg_dict)
        d["mesh"] = {**d["mesh"], "dp": 1, "domain": 1, "lon": 1}
        d["data"] = {**d["data"], "sample_points": int(n), "prefetch": d["data"]["prefetch"]}
        d["output"] = {**d["output"], "dir": out, "progress": False, "plots": False}
        trainer = Trainer(from_dict(d))
        device = next(trainer.model.parameters()).device
        stream = trainer._stream(0, steps)
        peak, seconds = 0, 0.0
        for k, (_, samples, _) in enumerate(stream):
            last = k == steps - 1
            _reset_peak(device)
            t0 = time.perf_counter()
            trainer.train_step(samples)
            seconds = time.perf_counter() - t0
            if k >= 1:
                peak = max(peak, _peak(device))
            del samples
            if last:
                break
        stream.close()
        peaks.append((peak, seconds))
        del trainer, stream
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"peaks": peaks, "device": str(getattr(device, "type", device))}


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        from domainflow.preprocess.parallel import reset_peak_memory

        reset_peak_memory()


def _peak(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    from domainflow.preprocess.parallel import peak_memory

    return int(peak_memory())


@dataclass
class Plan:
    model: MemoryModel
    points: int                    # points of a sample a step trains on
    rows: list                     # (domain, points on the largest rank, bytes per rank, fits the parts)
    memory: int | None = None
    smallest: int | None = None    # the smallest domain size within ``memory`` (None: none up to max_domain)
    headroom: float = HEADROOM
    largest: list = field(default_factory=list)  # (domain, largest sample within ``memory``) of the shown rows


def fits(model: MemoryModel, rank_points_: int, memory: int, headroom: float = HEADROOM) -> bool:
    """True when a rank holding ``rank_points_`` points is predicted to stay within ``memory`` with headroom."""
    return model.bytes_at(rank_points_) * (1 + headroom) <= memory


def largest_points(model: MemoryModel, memory: int, domain: int, headroom: float = HEADROOM) -> int:
    """The largest sample whose largest rank share at ``domain`` ranks fits ``memory`` (0: none)."""
    per_rank = (memory / (1 + headroom) - model.fixed) / model.per_point
    if per_rank < 1:
        return 0
    most = max((r + 1) * model.parts // domain - r * model.parts // domain for r in range(domain))
    n = int(per_rank * model.parts / most) if domain <= model.parts else int(per_rank * domain)
    while n > 0 and not fits(model, _share(n, domain, model.parts), memory, headroom):
        n -= 1  # ceil() in the share can tip the last point over
    return n


def _share(points: int, domain: int, parts: int) -> int:
    return rank_points(points, domain, parts) if domain <= parts else math.ceil(points / domain)


def make_plan(model: MemoryModel, points: int, memory: int | None = None, max_domain: int = 64,
              headroom: float = HEADROOM) -> Plan:
    """Memory per rank at domain sizes 1..``max_domain`` for a sample of ``points``, and the smallest domain
    size whose prediction, with ``headroom`` for the allocator, fits ``memory`` bytes per rank."""
    def row(w):
        share = _share(points, w, model.parts)
        return (w, share, model.bytes_at(share), w <= model.parts)

    shown = sorted({w for w in DOMAINS if w <= max_domain} | {max_domain})
    smallest, largest = None, []
    if memory is not None:
        smallest = next((w for w in range(1, max_domain + 1) if fits(model, row(w)[1], memory, headroom)), None)
        if smallest is not None:
            shown = sorted(set(shown) | {smallest})
        largest = [(w, largest_points(model, memory, w, headroom)) for w in shown]
    return Plan(model, points, [row(w) for w in shown], memory, smallest, headroom, largest)


def format_plan(plan: Plan, cfg: Config, requested: int) -> str:
    """The plan as a short table with what it assumes."""
    m = plan.model
    unit = "GPU memory (allocated)" if m.device == "cuda" else "peak resident memory"
    lines = []
    budget = f"; data.sample_points = {cfg.data.sample_points}" if plan.points != requested else ""
    lines.append(f"{cfg.model.name} (dim {cfg.model.dim}, {cfg.model.layers} layers), {cfg.train.dtype}"
                 f"{', bf16 autocast' if cfg.train.autocast == 'bf16' else ''}"
                 f"{', activation checkpointing' if cfg.train.checkpoint_activations else ''}; "
                 f"{plan.points:,} points per step{budget}")
    lines.append(f"measured at domain 1 on {', '.join(f'{s:,}' for s in m.sizes)} points of {cfg.data.store}: "
                 f"{', '.join(_size(p) for p in m.peaks)} -> {_size(m.fixed)} + {m.per_point / 1024:.2f} KiB "
                 f"per point ({unit}, one training step)")
    largest = dict(plan.largest)
    head = f"  {'largest sample':>14}" if plan.memory is not None else ""
    lines.append(f"{'domain':>6}  {'points/rank':>12}  {'memory/rank':>12}{head}")
    for w, share, b, ok in plan.rows:
        note = "" if ok else f"  (the store has {m.parts} parts per run: re-ingest with --parts >= {w})"
        mark = "  <- smallest within the budget" if w == plan.smallest else ""
        most = f"  {largest[w]:>14,}" if plan.memory is not None else ""
        lines.append(f"{w:>6}  {share:>12,}  {_size(b):>12}{most}{mark}{note}")
    if plan.memory is not None:
        within = f"{_size(plan.memory)} per rank with {100 * plan.headroom:.0f}% headroom for the allocator"
        if plan.smallest is None:
            floor = m.fixed
            why = (f" (the fixed part alone, {_size(floor)}, exceeds it)" if floor * (1 + plan.headroom) >= plan.memory
                   else "")
            lines.append(f"no domain size up to {plan.rows[-1][0]} fits {within}{why}; set data.sample_points, "
                         f"train.checkpoint_activations=true or a smaller model")
        else:
            lines.append(f"smallest domain size within {within}: {plan.smallest}")
    return "\n".join(lines)


def _size(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"
