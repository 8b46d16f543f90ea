"""How many ranks a sample needs: ``domainflow estimate`` (``domainflow plan`` before issue 36).

One training step of the config (its model, loss, optimizer, dtype, autocast and activation checkpointing: the
real ``Trainer``) and the evaluation forward after it (no grad, the whole sample; with the config's
``eval.block_points`` once more in four blocks at the largest size) are measured at domain 1 on small draws of
a training run (``data.sample_points``) of two sizes, in a child process. Each peak, fitted as ``fixed + bytes
per point x points``, predicts a rank's peak at any domain size: the activations follow the points a rank
holds (the largest rank's share of the store's spatial parts), the parameters, gradients and optimizer state
are replicated. A rank's memory is the larger of the training step on the points a step trains on
(``data.sample_points`` of the sample, or all of it) and the evaluation of a whole sample (with
``eval.block_points``: what stays per point of the rank's share, from the blocked measurement, plus one block,
the rank's share of ``eval.block_points``).

Peak memory is the process's peak resident size on CPU, measured with glibc returning every freed block of
64 KiB or more to the OS at once (``MALLOC_MMAP_THRESHOLD_``), so that it is the peak of live memory and not
of whatever the heap kept; on a GPU it is the CUDA caching allocator's peak allocated memory (the CUDA
context and the allocator's cache come on top). A real run's allocator keeps some freed memory on top of
the live peak (glibc's heap on CPU, the caching allocator's reserve on a GPU), so whether a domain size fits
is decided with ``headroom`` (default 20%) on top of the prediction (``benchmarks/train_scale.py`` measures
how far real runs are from the estimate).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field

from .config import Config, ConfigError, from_dict

MEASURE_SIZES = (16384, 32768)       # points of the two measured samples
MEASURE_STEPS = 2                    # steps per size; the last one (optimizer state in place) is measured
MEASURE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}  # freed blocks >= 64 KiB go back to the OS at once
DOMAINS = (1, 2, 4, 8, 16, 32, 64)
HEADROOM = 0.20                   # the allocator's share on top of the live peak when deciding what fits


class EstimateError(ConfigError):
    """An estimate that cannot be made (a grid config, a store too small to measure on); says what to change."""


@dataclass
class Line:
    """Peak memory ``fixed + per_point * points`` (bytes), fitted to measured (points, peak) pairs."""

    fixed: float
    per_point: float

    def bytes_at(self, points: float) -> float:
        return self.fixed + self.per_point * points

    @classmethod
    def fit(cls, sizes, peaks, what: str) -> "Line":
        n = len(sizes)  # least squares
        mx, my = sum(sizes) / n, sum(peaks) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(sizes, peaks)) / sum((x - mx) ** 2 for x in sizes)
        if slope <= 0:
            raise EstimateError(f"the peak memory of {what} did not grow from {sizes[0]} to {sizes[-1]} points "
                            f"({list(peaks)}); measure larger samples with --sizes")
        return cls(my - slope * mx, slope)


@dataclass
class MemoryModel:
    """A rank's peak memory in a training step and in the evaluation of a sample, each a :class:`Line`.
    With block inference (``block_points`` > 0, over the domain) the evaluation holds ``eval_resident``
    bytes per point of the rank's whole share (residual stream, inputs) and the rest of ``eval.per_point``
    per point of one block only."""

    train: Line
    eval: Line
    sizes: tuple = ()
    train_peaks: tuple = ()
    eval_peaks: tuple = ()
    device: str = "cpu"
    parts: int = 1
    seconds: tuple = field(default_factory=tuple)
    block_points: int = 0
    eval_resident: float | None = None  # bytes per point kept for the whole share (None: no block inference)
    blocked_peak: int | None = None     # the measured peak it was fitted from (largest size, blocks of a quarter)

    def eval_bytes(self, share: int, points: int) -> float:
        """Evaluation peak of a rank holding ``share`` of a sample of ``points``."""
        if not self.block_points or self.eval_resident is None:
            return self.eval.bytes_at(share)
        block = math.ceil(share / max(1, math.ceil(points / self.block_points)))  # rows_per_block's cut
        resident = min(self.eval_resident, self.eval.per_point)
        return self.eval.fixed + resident * share + (self.eval.per_point - resident) * block


def rank_points(points: int, domain: int, parts: int) -> int:
    """Points of the largest rank's share when a sample of ``points`` is split over ``domain`` ranks: rank r
    reads parts ``[r*P//W, (r+1)*P//W)`` of the run's ``parts`` spatial parts (about equal in size)."""
    most = max((r + 1) * parts // domain - r * parts // domain for r in range(domain))
    return math.ceil(points * most / parts)


def parts_for(domain: int, parts: int) -> int:
    """The parts per run a store needs for ``domain`` ranks: the store's own when it has enough, else what a
    re-ingest should ask for (a power of two, at least 8 per rank, so that shares differ by at most 1/8)."""
    if domain <= parts:
        return parts
    return max(64, 1 << (8 * domain - 1).bit_length())


def check_measurable(cfg: Config) -> tuple[int, int, int]:
    """(points of the smallest and of the largest training run, parts per run) of the config's mesh store; a
    grid config, a graph model's (whole samples only) or a store without a train split is refused with what to do
    instead."""
    from domainflow.readers import open_store

    if cfg.data.kind != "mesh":
        raise EstimateError("domainflow estimate measures memory per point of a mesh sample; a grid config splits rows of "
                        "a fixed grid (measure a step with domainflow train --domain 1 instead)")
    if cfg.data.edges:
        raise EstimateError(f"domainflow estimate measures draws of a sample's points (data.sample_points), which have "
                            f"no graph; data.edges=true ({cfg.model.target or cfg.model.name}) trains on whole samples: "
                            f"measure a step with domainflow train --domain 1 instead")
    if not cfg.data.store:
        raise ConfigError("data.store is not set; give the path of an ingested store (domainflow ingest ...)")
    store = open_store(cfg.data.store)
    try:
        store.require_kind("mesh")
        runs = store.runs("train")
        if not runs:
            raise EstimateError(f"{store.path} has no runs in its train split; the estimate measures a training step on one")
        sizes = [int(store.run(r)[cfg.data.location]["parts"][-1]) for r in runs]
        parts = int(store.parts)
    finally:
        store.close()
    return min(sizes), max(sizes), parts


def measure(cfg: Config, sizes=MEASURE_SIZES, steps: int = MEASURE_STEPS) -> MemoryModel:
    """Fit a rank's peak memory per training step and per evaluation to the points of the sample, from one
    child process at domain 1."""
    from domainflow.launch import launch_local

    smallest, _, parts = check_measurable(cfg)
    sizes = tuple(sorted(int(s) for s in sizes))
    if len(sizes) < 2 or sizes[0] < 1 or len(set(sizes)) != len(sizes):
        raise EstimateError(f"the estimate needs two or more different sample sizes to measure, got {list(sizes)}")
    if sizes[-1] > smallest:
        raise EstimateError(f"the estimate measures samples of {sizes[-1]} points, but the smallest training run of "
                        f"{cfg.data.store} has {smallest}; pass smaller --sizes (e.g. {smallest // 4},{smallest // 2})")
    if steps < 2:
        raise EstimateError("the estimate measures the second step or later (the first creates the optimizer state)")
    with tempfile.TemporaryDirectory(prefix="domainflow-estimate-") as out:
        result = launch_local(_measure_rank, 1, cfg.to_dict(), sizes, steps, out, env=MEASURE_MALLOC,
                              start_method="spawn")[0]
    train_peaks = tuple(r["train"] for r in result["sizes"])
    eval_peaks = tuple(r["eval"] for r in result["sizes"])
    whole = Line.fit(sizes, eval_peaks, "an evaluation")
    resident, blocked = None, result.get("blocked")
    if blocked is not None:  # the largest size again in 4 blocks: what one block's points cost, the rest stays
        n = sizes[-1]
        per_block_point = max(0.0, (whole.bytes_at(n) - blocked) / (n - math.ceil(n / 4)))
        resident = max(0.0, whole.per_point - per_block_point)
    return MemoryModel(train=Line.fit(sizes, train_peaks, "a training step"), eval=whole, sizes=sizes,
                       train_peaks=train_peaks, eval_peaks=eval_peaks, device=result["device"], parts=parts,
                       seconds=tuple(r["seconds"] for r in result["sizes"]), block_points=cfg.eval.block_points,
                       eval_resident=resident, blocked_peak=blocked)


def _measure_rank(cfg_dict: dict, sizes, steps: int, out: str) -> dict:
    """The child process: the config's Trainer at domain 1 on draws of each size; per size the peak memory
    of a training step after the first, of the evaluation forward after it (bytes), and the step time (s)."""
    import gc
    import time

    import torch

    from .inference import infer
    from .loop import Trainer

    results, blocked = [], None
    device = torch.device("cpu")
    block = int(cfg_dict["eval"].get("block_points") or 0)
    for n in sizes:
        d = dict(cfg_dict)
        d["mesh"] = {**d["mesh"], "dp": 1, "domain": 1, "lon": 1}
        d["data"] = {**d["data"], "sample_points": int(n)}
        d["output"] = {**d["output"], "dir": out, "progress": False, "plots": False}
        trainer = Trainer(from_dict(d))
        device = next(trainer.model.parameters()).device
        stream = trainer._stream(0, steps)
        peak, seconds, sample = 0, 0.0, None
        for k, (_, samples, _) in enumerate(stream):
            _reset_peak(device)
            t0 = time.perf_counter()
            trainer.train_step(samples)
            seconds = time.perf_counter() - t0
            if k >= 1:
                peak = max(peak, _peak(device))
            sample = samples[0][1]
            del samples
            if k == steps - 1:
                break
        stream.close()
        # the evaluation that follows training in Trainer.fit: a no-grad forward of a sample, gradients kept;
        # measured whole (the points of one block cost this much each) and, with block inference, the
        # largest size again in 4 blocks (what stays for the whole sample: residual stream, inputs)
        batch = trainer._batch(sample)
        trainer.cfg.eval.block_points = 0
        _reset_peak(device)
        infer(trainer.model, batch, trainer.cfg)
        results.append({"train": peak, "eval": _peak(device), "seconds": seconds})
        if block and n == sizes[-1]:
            trainer.cfg.eval.block_points = -(-int(n) // 4)
            _reset_peak(device)
            infer(trainer.model, batch, trainer.cfg)
            blocked = _peak(device)
        del trainer, stream, sample, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"sizes": results, "device": device.type, "blocked": blocked}


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
class Row:
    """One domain size of an estimate: points and predicted bytes per rank (the largest rank)."""

    domain: int
    parts: int                 # parts per run the shares assume (more than the store's: a re-ingest)
    train_points: int          # training step
    eval_points: int           # evaluation of a whole sample
    train_bytes: float
    eval_bytes: float
    largest: int | None = None  # the largest sample within the estimate's memory (None: no memory given)

    @property
    def bytes(self) -> float:
        return max(self.train_bytes, self.eval_bytes)


@dataclass
class Estimate:
    model: MemoryModel
    points: int                    # points of a sample
    step_points: int               # points a training step takes of it (data.sample_points, or all)
    rows: list
    memory: int | None = None
    smallest: int | None = None    # the smallest domain size within ``memory`` (None: none up to max_domain)
    headroom: float = HEADROOM


def row(model: MemoryModel, points: int, step_points: int, domain: int) -> Row:
    """The predicted peaks of ``domain`` ranks on a sample of ``points``, ``step_points`` of them per step."""
    parts = parts_for(domain, model.parts)
    tp, ep = rank_points(step_points, domain, parts), rank_points(points, domain, parts)
    return Row(domain, parts, tp, ep, model.train.bytes_at(tp), model.eval_bytes(ep, points))


def fits(r: Row, memory: int, headroom: float = HEADROOM) -> bool:
    """True when the row's prediction, with ``headroom`` for the allocator, stays within ``memory``."""
    return r.bytes * (1 + headroom) <= memory


def largest_points(model: MemoryModel, memory: int, domain: int, sample_points: int = 0,
                   headroom: float = HEADROOM) -> int:
    """The largest sample that fits ``memory`` per rank at ``domain`` ranks (0: none), its training steps
    taking ``sample_points`` of it (0: all)."""
    def ok(n):
        return fits(row(model, n, min(n, sample_points) if sample_points else n, domain), memory, headroom)

    block = model.block_points if model.eval_resident is not None else 0
    if not block:  # both peaks grow with the sample
        return _largest(ok, 1, MAX_POINTS)
    # with block inference the evaluation drops where one more block begins (cB + 1 points): it grows with
    # the sample within each range ((c-1)B, cB] of c blocks, and the smallest sample of a range grows with c
    c = _largest(lambda c: ok((c - 1) * block + 1), 1, MAX_POINTS // block + 1)
    return _largest(ok, (c - 1) * block + 1, c * block) if c else 0


MAX_POINTS = 1 << 44  # where the search for the largest sample stops (a block model may plateau)


def _largest(ok, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ``ok(n)``, for ``ok`` true up to some n and false beyond (0: not even lo)."""
    if lo > hi or not ok(lo):
        return 0
    step = 1
    while True:  # gallop up from lo, then bisect between the last that fits and the first that does not
        nxt = lo + step
        if nxt >= hi:
            if ok(hi):
                return hi
            bad = hi
            break
        if not ok(nxt):
            bad = nxt
            break
        lo, step = nxt, step * 2
    while bad - lo > 1:
        mid = (lo + bad) // 2
        lo, bad = (mid, bad) if ok(mid) else (lo, mid)
    return lo


def make_estimate(model: MemoryModel, points: int, sample_points: int = 0, memory: int | None = None,
              max_domain: int = 64, headroom: float = HEADROOM) -> Estimate:
    """Memory per rank at domain sizes 1..``max_domain`` for a sample of ``points`` (training steps on
    ``sample_points`` of them, 0: all), and the smallest domain size whose prediction, with ``headroom`` for
    the allocator, fits ``memory`` bytes per rank."""
    if points < 1 or max_domain < 1 or sample_points < 0:
        raise EstimateError(f"an estimate needs points >= 1, max_domain >= 1 and sample_points >= 0; got {points}, "
                        f"{max_domain}, {sample_points}")
    if not (headroom >= 0 and math.isfinite(headroom)):
        raise EstimateError(f"the headroom is a fraction >= 0 (e.g. 0.2), got {headroom}")
    step = min(points, sample_points) if sample_points else points
    shown = sorted({w for w in DOMAINS if w <= max_domain} | {max_domain})
    smallest = None
    if memory is not None:
        smallest = next((w for w in range(1, max_domain + 1) if fits(row(model, points, step, w), memory, headroom)),
                        None)
        if smallest is not None:
            shown = sorted(set(shown) | {smallest})
    rows = [row(model, points, step, w) for w in shown]
    if memory is not None:
        for r in rows:
            r.largest = largest_points(model, memory, r.domain, sample_points, headroom)
    return Estimate(model, points, step, rows, memory, smallest, headroom)


def format_estimate(estimate: Estimate, cfg: Config) -> str:
    """The estimate as a short table with what it assumes."""
    m = estimate.model
    unit = "GPU memory (allocated)" if m.device == "cuda" else "peak resident memory"
    sampled = estimate.step_points != estimate.points
    lines = [f"{cfg.model.name} (dim {cfg.model.dim}, {cfg.model.layers} layers), {cfg.train.dtype}"
             f"{', bf16 autocast' if cfg.train.autocast == 'bf16' else ''}"
             f"{', activation checkpointing' if cfg.train.checkpoint_activations else ''}; samples of "
             f"{estimate.points:,} points" + (f", {estimate.step_points:,} per training step (data.sample_points = "
                                          f"{cfg.data.sample_points})" if sampled else ""),
             f"measured at domain 1 on {', '.join(f'{s:,}' for s in m.sizes)} points of {cfg.data.store} "
             f"({unit}): training step {_size(m.train.fixed)} + {m.train.per_point / 1024:.2f} KiB per point, "
             f"evaluation {_size(m.eval.fixed)} + {m.eval.per_point / 1024:.2f} KiB per point"
             + (f" of a block (eval.block_points = {m.block_points} over the domain) of which "
                f"{m.eval_resident / 1024:.2f} KiB stay for every point of the rank"
                if m.block_points and m.eval_resident is not None else "")]
    cols = f"{'domain':>6}  {'points/rank':>12}  {'train step':>10}  {'evaluation':>10}  {'memory/rank':>11}"
    lines.append(cols + (f"  {'largest sample':>14}" if estimate.memory is not None else ""))
    for r in estimate.rows:
        note = "" if r.parts == m.parts else f"  (re-ingest with --parts {r.parts}: the store has {m.parts})"
        mark = "  <- smallest within the budget" if r.domain == estimate.smallest else ""
        most = f"  {r.largest:>14,}" if estimate.memory is not None else ""
        share = f"{r.eval_points:,}"
        lines.append(f"{r.domain:>6}  {share:>12}  {_size(r.train_bytes):>10}  {_size(r.eval_bytes):>10}  "
                     f"{_size(r.bytes):>11}{most}{mark}{note}")
    if estimate.memory is not None:
        within = f"{_size(estimate.memory)} per rank with {100 * estimate.headroom:.0f}% headroom for the allocator"
        if estimate.smallest is None:
            floor = max(m.train.fixed, m.eval.fixed)
            why = (f" (the fixed part alone, {_size(floor)}, exceeds it)" if floor * (1 + estimate.headroom) >= estimate.memory
                   else "")
            lines.append(f"no domain size up to {estimate.rows[-1].domain} fits {within}{why}; set data.sample_points, "
                         f"train.checkpoint_activations=true, eval.block_points or a smaller model")
        else:
            lines.append(f"smallest domain size within {within}: {estimate.smallest}")
    return "\n".join(lines)


def estimate_json(estimate: Estimate) -> dict:
    """The estimate as plain data (``domainflow estimate --json``)."""
    from dataclasses import asdict

    return {"points": estimate.points, "step_points": estimate.step_points, "memory": estimate.memory,
            "smallest_domain": estimate.smallest, "headroom": estimate.headroom, "model": asdict(estimate.model),
            "rows": [{**asdict(r), "bytes": r.bytes} for r in estimate.rows]}


def _size(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"
