"""The training loop on a ("dp", "domain") mesh.

Samples are split over dp, each sample's domain over domain (the readers hand out ShardTensors), and
the model is an ordinary module with replicated parameters. A step takes ``batch / dp`` samples per dp
rank (gradient accumulation), each loss weighted by the sample's weight (0 for padding steps) over the
step's number of real samples; domain partial gradients are summed by the engine once per backward
(``deferred_param_grads``) and dp gradients in one coalesced all-reduce, which also carries a
non-finite-loss flag, so a NaN stops every rank at the same step. With ``mesh.dp_strategy=fsdp`` the
parameters and optimizer state are sharded over dp by FSDP2 instead (``fsdp.py``): each layer's gradient is
summed over the domain as backward reaches it and reduce-scattered over dp by FSDP2; the flag and the loss
still go in one small all-reduce. Data order depends only on the seed,
the epoch and the step, so a resumed run reads exactly what an uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import domainflow as df
from domainflow import comm

from . import checkpoint as ckpt
from . import fsdp, normalization, output_folder, run_identity
from .config import Config, ConfigError
from .data import Batch, build_dataset, call_model
from .loggers import Loggers
from .metrics import evaluate
from .build import build_mesh, build_model


class TrainingDiverged(df.DomainflowError, RuntimeError):
    """The loss became NaN/Inf; the message names the step and the samples."""


@dataclass
class StepLog:
    step: int
    loss: float
    lr: float
    seconds: float
    samples: int


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up, then constant or cosine decay to ``min_lr`` at the last step."""
    t = cfg.train
    if t.warmup and step < t.warmup:
        return (step + 1) / t.warmup
    if t.schedule == "constant" or t.steps <= t.warmup:
        return 1.0
    progress = (step - t.warmup) / max(1, t.steps - t.warmup)
    floor = t.min_lr / t.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """One rank's side of a training job (every rank builds one with the same config)."""

    def __init__(self, cfg: Config, mesh=None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else build_mesh(cfg)
        self.rank = torch.distributed.get_rank()
        self.out = Path(cfg.output.dir)
        # compiled: the drawn points split evenly over the domain ranks, so every step has the same per-rank sizes
        self.ds = build_dataset(cfg, self.mesh, "train", shuffle=True, sample_points=cfg.data.sample_points,
                                balanced_draw=cfg.train.compile)
        # what this store gives the model's inputs (a resume or --init-from adopts its checkpoint's instead)
        self.norm = self.store_norm = normalization.from_store(cfg, self.ds.store)
        self.identity = run_identity.identity(cfg, self.norm)
        self.model = build_model(cfg, self.ds)
        self.sharded = cfg.mesh.dp_strategy == "fsdp"
        if self.sharded:
            fsdp.shard_model(self.model, self.mesh)
        t = cfg.train
        # the training forward (and its backward) compiled; evaluation, figures and checkpoints use the module itself
        self.forward = df.compile(self.model, backend=t.compile_backend) if t.compile else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(cfg, s))
        self.dp, self.dp_rank = self.ds.axes.dp_size, self.ds.axes.dp_rank
        self.micro = (t.batch or self.dp) // self.dp
        self.step = 0
        self._steps_per_epoch = None
        self.history: list[dict] = []
        self.ckpt_dir = self.out / "checkpoints"

    # -- data order ------------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        if self._steps_per_epoch is None:
            self._steps_per_epoch = -(-len(self.ds.steps(0)) // self.micro)
        return self._steps_per_epoch

    def _schedule(self, start: int, stop: int):
        """(step, real samples in the step over all dp ranks, key, weight, samples in the step, epoch) of each
        sample this rank reads in steps ``start..stop-1``, made as they are consumed (a run of a million steps
        starts at once and holds one epoch's order, not every step's)."""
        n = len(self.ds.runs) if self.cfg.data.kind == "mesh" else len(self.ds.times)
        per_epoch, orders = self.steps_per_epoch(), {}
        for step in range(start, stop):
            epoch, k = divmod(step, per_epoch)
            if epoch not in orders:
                orders.clear()
                orders[epoch] = self.ds.steps(epoch)
            mine = orders[epoch]
            lo, hi = k * self.micro, min((k + 1) * self.micro, len(mine))
            total = sum(1 for e in range(lo, hi) for d in range(self.dp) if e * self.dp + d < n)
            for key, w in mine[lo:hi]:
                yield step, total, key, w, hi - lo, epoch

    def _stream(self, start: int, stop: int):
        """(step, [(real samples in the step, sample), ...], seconds waited for data) for steps
        ``start..stop-1``, read ahead on a background thread."""
        # the schedule twice, not one shared through itertools.tee: the reads consume theirs on the prefetch
        # thread, and a tee (or one generator) iterated from two threads is not safe
        it = self.ds.samples(((key, w, e) for _, _, key, w, _, e in self._schedule(start, stop)),
                             depth=self.cfg.data.prefetch)
        try:
            batch, waited = [], 0.0
            for s, total, _, _, count, _ in self._schedule(start, stop):
                t0 = time.perf_counter()
                sample = next(it)
                waited += time.perf_counter() - t0
                batch.append((total, sample))
                if len(batch) == count:
                    yield s, batch, waited
                    batch, waited = [], 0.0
        finally:
            it.close()

    # -- one step --------------------------------------------------------------------------------------
    def _forward_loss(self, sample) -> tuple[torch.Tensor, object]:
        batch: Batch = self._batch(sample)
        with self._autocast():
            pred = self._call_model(batch)
        mse = ((pred.to(batch.target.dtype) - batch.target) ** 2).mean()
        return mse, batch

    def _batch(self, sample):
        from .data import make_batch

        return make_batch(self.cfg, self.ds, sample, self.param_stats)

    def _call_model(self, batch):
        if self.cfg.train.checkpoint_activations:
            return _checkpointed(self.model, batch)
        return call_model(self.forward, batch)

    def _autocast(self):
        if self.cfg.train.autocast == "bf16":
            return torch.autocast(comm.mesh_device(self.mesh).type, dtype=torch.bfloat16)
        import contextlib

        return contextlib.nullcontext()

    @property
    def param_stats(self):
        """(mean, std) of the design parameters the model's globals are scaled with (its normalisation's)."""
        return normalization.params(self.norm)

    def _reduce_dp(self, bad: bool, runs: list[str], losses: list[float]) -> float:
        """Sum gradients over dp in one coalesced all-reduce, which also carries the non-finite flag and the
        step's loss sum and count (for the log); returns the mean loss of the step's real samples."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        # under FSDP2 the gradients are summed over dp already (its reduce-scatter): only the flag and loss go
        grads = [] if self.sharded else [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        finite = [v for v in losses if math.isfinite(v)]
        # coalesced with the gradients (their dtype), or alone under FSDP2 (float64: the logged loss keeps its digits)
        dtype, device = (grads[0].dtype, grads[0].device) if grads else (torch.float64, comm.mesh_device(self.mesh))
        # and under train.compile this rank's Dynamo graphs so far: the log's compiled_graphs, summed over dp
        graphs = float(self.forward.frames) if self.cfg.train.compile else 0.0
        extra = torch.tensor([float(bad), sum(finite), float(len(losses)), graphs], dtype=dtype, device=device)
        dp_dim = 0
        if self.dp > 1:
            out = comm.all_reduce_coalesced(grads + [extra], "sum", self.mesh, dp_dim)
            grads, extra = out[:-1], out[-1]
        # the loss is a global value, so every domain rank of a sample sees the same flag
        if float(extra[0]) > 0:
            names = comm.all_gather_object(runs if bad else [], self.mesh, dp_dim) if self.dp > 1 else [runs]
            culprits = sorted({r for rs in names for r in rs})
            try:
                last = ckpt.latest(self.ckpt_dir)
            except ckpt.CheckpointError as exc:  # the divergence is the news; the checkpoint's state is a detail
                last = f"unusable ({exc})"
            raise TrainingDiverged(
                f"the loss is NaN/Inf at step {self.step + 1} on sample(s) {culprits}; stopping. The last good "
                f"checkpoint is {last or 'none (none was saved yet)'}; check those samples (domainflow inspect) "
                f"or lower train.lr / set train.clip_grad")
        self.compiled_graphs = int(extra[3])
        if not self.sharded:
            for p, g in zip(params, grads):
                p.grad = g
        else:  # as replicated: a parameter the step did not use gets a zero gradient (AdamW still decays it)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return float(extra[1] / extra[2]) if float(extra[2]) else float("nan")

    def train_step(self, samples) -> StepLog:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        losses, bad, runs = [], False, []
        for total, sample in samples:
            mse, _ = self._forward_loss(sample)
            w = sample["weight"]
            # d(mse * w/total): backward from mse itself with that seed, so mse is the pending sum that rides
            # on the backward pass's first all-reduce and reading its value below needs no collective
            seed = torch.ones_like(mse) * (w / max(total, 1))
            if self.sharded:  # each layer's domain sum before FSDP2 reduce-scatters it
                mse.backward(seed)
            else:
                with df.deferred_param_grads():
                    mse.backward(seed)
            value = float(_value(mse))
            if not math.isfinite(value):
                bad = True
                runs.append(str(sample.get("run", sample.get("time"))))
            if float(w) > 0:
                losses.append(value)
        loss = self._reduce_dp(bad, runs, losses)
        if self.cfg.train.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        return StepLog(self.step, loss, lr, time.perf_counter() - t0, len(samples))

    # -- the job ---------------------------------------------------------------------------------------
    def fit(self, resume: bool = False, init_from: str | None = None, overwrite: bool = False,
            claimed: bool = False) -> dict:
        """Train (``resume``: from the latest checkpoint of this run; ``init_from``: from another checkpoint's
        weights, a fresh optimizer and step 0), checkpoint and evaluate. Rank 0 holds the output folder's lock
        for the whole job unless the caller does (``claimed``); ``overwrite`` replaces a training there."""
        # a Trainer fitted again goes on with its own run (in memory): no fresh start over its checkpoints
        continuing = self.step > 0
        overwrite = overwrite and not continuing
        lock = None if claimed else self._claim(resume or continuing, overwrite, init_from)
        try:
            return self._fit(resume, init_from, overwrite)
        finally:
            if lock is not None:
                lock.release()

    def _claim(self, resume: bool, overwrite: bool, init_from):
        """Rank 0 takes the output folder (``output_folder.claim``); its verdict is raised on every rank."""
        lock, error = None, None
        if self.rank == 0:
            try:
                lock = output_folder.claim(self.out, resume, overwrite, init_from)
            except Exception as exc:  # noqa: BLE001  (any failure: every rank raises it, none waits)
                error = str(exc) if isinstance(exc, output_folder.OutputFolderError) else \
                    f"output.dir {self.out}: {type(exc).__name__}: {exc}"
        errors = comm.all_gather_object_mesh(error, self.mesh)
        if errors[0] is not None:
            raise output_folder.OutputFolderError(errors[0])
        return lock

    def _fit(self, resume: bool, init_from: str | None, overwrite: bool = False) -> dict:
        cfg = self.cfg
        if resume and init_from:
            raise ConfigError("--resume continues this run from its own checkpoint; --init-from starts a new run from "
                              "another's weights: give one of them")
        if resume:
            self.resume()
        elif init_from:
            self.init_from(init_from)
        if self.rank == 0:
            if overwrite:  # only now: a run refused before this point leaves the old one whole
                output_folder.clear(self.out)
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        log = Loggers(self.out, cfg.output.loggers, self.rank == 0, self.step, cfg.to_dict())
        bar = _progress(cfg, self.rank, self.step)
        failed = True
        try:
            try:
                for _, samples, waited in self._stream(self.step, cfg.train.steps):
                    self._after_step(self.train_step(samples), log, bar, waited)
            finally:
                if bar is not None:
                    bar.close()
            if cfg.train.checkpoint_every == 0 or self.step % cfg.train.checkpoint_every:
                self.save()
            result = {"steps": self.step, "loss": self.history[-1]["loss"] if self.history else None,
                      "out": str(self.out), "dp_strategy": cfg.mesh.dp_strategy,
                      "state_numel": fsdp.state_numel(self.model, self.opt)}
            result["eval"] = self.evaluate(log)
            if cfg.output.plots:
                with fsdp.gathered(self.model):
                    result["figures"] = self.figures(result["eval"])
                log.figures(result["figures"], self.step)
            failed = False
        finally:
            log.close(failed)
        if self.rank == 0:
            (self.out / "result.json").write_text(json.dumps(result, indent=1, default=str))
        return result

    def figures(self, evaluation: dict) -> list[str]:
        """Loss curves, and the first validation sample: surface Cp predicted vs true (mesh) or maps of
        prediction, truth and error (grid). Every rank takes part; rank 0 renders."""
        from . import plots
        from .predict import as_mesh, predict_run

        made = []
        runs = [r["run"] for r in evaluation.get("runs", [])]
        if self.cfg.data.kind == "mesh" and runs:
            result = predict_run(self.model, self.cfg, self.mesh, runs[0], self.norm)
            if result is not None:
                made.append(plots.surface_cp(as_mesh(self.ds.store, result), self.out / "surface_cp.png",
                                             title=f"({runs[0]}, step {self.step})"))
        elif runs:
            made += self._grid_figure(int(runs[0]))
            summary = evaluation.get("summary", {})
            if self.rank == 0 and summary.get("leads"):
                units = {k.split("/", 1)[1]: f.get("units", "") for k, f in self.ds.store.fields.items()}
                made.append(plots.rmse_by_lead(summary, self.out / "rmse_by_lead.png", units))
        if self.rank == 0 and (self.out / "metrics.jsonl").exists():
            made.append(plots.loss_curves(self.out / "metrics.jsonl", self.out / "loss.png"))
        return [str(p) for p in made]

    @torch.no_grad()
    def _grid_figure(self, t: int) -> list:
        from . import plots
        from .data import build_dataset, make_batch

        ds = build_dataset(self.cfg, self.mesh, self.cfg.data.val_split, shuffle=False, norm=self.norm)
        sample = next(ds.samples([(t, 1.0)]))
        batch = make_batch(self.cfg, ds, sample, None)
        self.model.eval()
        pred = ds.denormalize(call_model(self.model, batch)).full_tensor()
        self.model.train()
        true = ds.denormalize(batch.target).full_tensor()
        if self.rank != 0:
            return []
        v = ds.variables[0]
        store = ds.store
        units = store.fields.get(f"grid/{v}", {}).get("units", "")
        when = _time_label(store, t + ds.lead)
        return [plots.grid_maps(pred[0, 0].cpu().numpy(), true[0, 0].cpu().numpy(), v, self.out / f"map_{v}.png",
                                lat=store.read(store.group["lat"]), lon=store.read(store.group["lon"]), units=units,
                                title=f"{v}, lead {ds.lead} step(s), valid {when} (step {self.step})")]

    def _after_step(self, entry: StepLog, log, bar, waited: float = 0.0):
        rec = {"step": entry.step, "loss": entry.loss, "lr": entry.lr,
               "samples_per_s": entry.samples * self.dp / max(entry.seconds + waited, 1e-9), "seconds": entry.seconds,
               "data_wait_s": waited, "memory_mib": _peak_memory_mib(comm.mesh_device(self.mesh))}
        if self.cfg.train.compile:  # Dynamo graphs so far, summed over dp: a rise after the first step is a recompile
            rec["compiled_graphs"] = self.compiled_graphs
        self.history.append(rec)
        log.write(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{entry.loss:.4g}", samples_s=f"{rec['samples_per_s']:.2f}")
        t = self.cfg.train
        if t.checkpoint_every and entry.step % t.checkpoint_every == 0:
            self.save()
        if t.eval_every and entry.step % t.eval_every == 0 and entry.step < t.steps:
            self.evaluate(log)

    def evaluate(self, log=None) -> dict:
        with fsdp.gathered(self.model):  # the dp ranks evaluate different samples: no FSDP2 gather per forward
            res = evaluate(self, self.cfg.data.val_split)
        if log is not None and res:
            log.write({"step": self.step, "eval": res["summary"]})
        return res

    # -- checkpoints -----------------------------------------------------------------------------------
    def save(self) -> Path:
        """A checkpoint that carries what defines the run and everything its inputs were scaled with."""
        record = {"run": self.identity, "normalization": self.norm}
        return ckpt.save(self.ckpt_dir, self.step, self.model, self.opt, self.cfg, record)

    def _adopt(self, norm: dict | None, where: str) -> None:
        """Scale inputs and outputs as the checkpoint ``where`` did (``norm``; None: a checkpoint from before
        normalisations were recorded keeps this store's), refusing a store whose channels do not fit."""
        if norm is None or norm == self.norm:
            return
        normalization.check_fits(norm, self.ds.store, self.cfg, where)
        self.norm = norm
        self.ds = build_dataset(self.cfg, self.mesh, "train", shuffle=True, sample_points=self.cfg.data.sample_points,
                                norm=norm, balanced_draw=self.cfg.train.compile)

    def resume(self) -> None:
        """Continue from the latest checkpoint, or the newest older complete one if it is corrupt (warned); a
        checkpoint of another run (``run_identity``) is refused with both sides named."""
        head = ckpt.head_meta(self.ckpt_dir)
        if head is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_dir}; start without --resume")
        run_identity.check_same(head, self.identity, self.ckpt_dir, self.store_norm)
        self._adopt(head.get("normalization"), f"the checkpoint under {self.ckpt_dir}")
        found = ckpt.load_newest_complete(self.ckpt_dir, self.model, self.opt)
        if found is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_dir}; start without --resume")
        run_identity.check_same(ckpt.meta(found[0]), self.identity, found[0], self.store_norm)
        self.step = found[1]
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(self.cfg, s),
                                                       last_epoch=self.step - 1)
        for g in self.opt.param_groups:
            g["lr"] = self.cfg.train.lr * lr_factor(self.cfg, self.step)


    def init_from(self, source: str) -> None:
        """Start from the weights of the checkpoint ``source`` (another run's: fine-tuning), with its
        normalisation, a fresh optimizer and step 0."""
        path = ckpt.latest(Path(source))
        if path is None:
            raise FileNotFoundError(f"--init-from {source}: no checkpoint there (expected a step_<n> folder or a "
                                    f"checkpoints folder with one)")
        meta = ckpt.meta(path)
        run_identity.check_init_from(meta, self.identity, self.cfg, path)
        self._adopt(meta.get("normalization"), f"the --init-from checkpoint {path}")
        ckpt.load(path, self.model)


def _checkpointed(model, batch):
    """Activation checkpointing of each block of the model (``model.blocks``: recomputed in backward, whatever
    its arguments), or of the whole forward for a model without blocks."""
    from domainflow import checkpoint_activations as checkpoint

    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return checkpoint(lambda b: call_model(model, b), batch)
    originals = [b.forward for b in blocks]
    try:
        for b, f in zip(blocks, originals):
            b.forward = (lambda f: lambda *args, **kwargs: checkpoint(f, *args, **kwargs))(f)
        return call_model(model, batch)
    finally:
        for b, f in zip(blocks, originals):
            b.forward = f


def _time_label(store, k: int) -> str:
    """Step ``k`` of a store's time axis as a date when its units give one, else its index."""
    from domainflow.store import time_axis

    time = store.group["time"]
    dates = time_axis.decode(store.read(time, slice(k, k + 1)), dict(time.attrs))
    return f"step {k}" if dates is None else time_axis.label(dates[0])[:16]


def _value(t) -> torch.Tensor:
    if isinstance(t, df.ShardTensor):
        t = t.full_tensor()
    return t.detach()


def _peak_memory_mib(device) -> float:
    """This rank's peak memory so far: the accelerator's peak allocation, or the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _progress(cfg: Config, rank: int, start: int):
    if rank != 0 or not cfg.output.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
