"""Where rank 0 records a run: ``output.loggers`` names any of ``jsonl`` (``metrics.jsonl``, always kept: the loss
plot reads it), ``tensorboard`` (``<out>/tensorboard``, through ``torch.utils.tensorboard``) and ``mlflow`` (a
local ``<out>/mlruns`` folder unless ``MLFLOW_TRACKING_URI`` names a server or database). Each gets the
training records (loss, lr, step time, data wait, memory), the evaluation summaries and the figures; a
resumed run drops what was logged after its checkpoint (TensorBoard's ``purge_step``; MLflow continues the
same run, whose id ``<out>/mlflow_run.json`` keeps, and logs the steps after the checkpoint again: MLflow keeps
both values of such a step). Logging never stops training: only rank 0 logs, so a logger that fails (an
unreachable tracking server, a full disk) is dropped with a warning instead of leaving the other ranks
waiting in the next collective."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from .config import ConfigError

KNOWN = ("jsonl", "tensorboard", "mlflow")
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow")}  # name: (module, extra)


def check_available(names) -> None:
    """Every logger named is known and importable; else a ConfigError naming the extra to install."""
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise ConfigError(f"output.loggers {unknown} are not loggers; choose from {list(KNOWN)}")
    import importlib

    for n in names:
        if n in NEEDS:
            try:
                importlib.import_module(NEEDS[n][0])
            except ImportError:
                raise ConfigError(f"output.loggers={n} needs the {NEEDS[n][0]} package: pip install "
                                  f"'domainflow[{NEEDS[n][1]}]' (or leave {n} out of output.loggers)") from None


class Loggers:
    """The loggers of one run (inactive on ranks other than 0): ``write`` a record, ``figures``, ``close``."""

    def __init__(self, out: Path, names, active: bool, start_step: int, config: dict):
        self.out, self.active = Path(out), active
        self._sinks = []
        if not active:
            return
        self._sinks.append(JsonlLog(self.out / "metrics.jsonl", truncate_after=start_step))
        names = [n for n in dict.fromkeys(names) if n != "jsonl"]
        check_available(names)
        makers = {"tensorboard": lambda: TensorBoardLog(self.out / "tensorboard", start_step),
                  "mlflow": lambda: MLflowLog(self.out, start_step, config)}
        for n in names:
            try:
                self._sinks.append(makers[n]())
            except Exception as exc:  # noqa: BLE001  (any backend's error: named, then training goes on)
                warnings.warn(f"output.loggers: {n} could not start ({type(exc).__name__}: {exc}); training goes on "
                              f"without it", stacklevel=2)

    def _each(self, call) -> None:
        for s in list(self._sinks):
            try:
                call(s)
            except Exception as exc:  # noqa: BLE001
                if isinstance(s, JsonlLog):
                    raise  # metrics.jsonl is the run's own record
                warnings.warn(f"output.loggers: {type(s).__name__} failed ({type(exc).__name__}: {exc}); dropped, "
                              f"training goes on", stacklevel=3)
                self._sinks.remove(s)

    def write(self, rec: dict) -> None:
        self._each(lambda s: s.write(rec))

    def figures(self, paths, step: int) -> None:
        self._each(lambda s: s.figures([Path(p) for p in paths], step))

    def close(self, failed: bool = False) -> None:
        self._each(lambda s: s.close(failed))
        self._sinks = []


def scalars(rec: dict) -> dict[str, float]:
    """A record as flat ``name: number`` pairs: ``train/loss`` ..., ``eval/<forecast>/<metric>`` (a grid
    summary's first lead as its top-level entries, the other leads as ``eval/lead<k>/<forecast>/<metric>``)."""
    out = {}
    if "eval" not in rec:
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                out[f"train/{k}"] = float(v)
        return out
    summary = rec["eval"]
    for name, metrics in summary.items():
        if isinstance(metrics, dict) and name != "leads" and name != "filled":
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    out[f"eval/{name}/{k}"] = float(v)
    for lead, entry in summary.get("leads", {}).items():
        for name, metrics in entry.items():
            for k, v in metrics.items():
                out[f"eval/lead{lead}/{name}/{k}"] = float(v)
    return out


class JsonlLog:
    """JSON lines; a resumed run first drops the lines of steps after its checkpoint."""

    def __init__(self, path: Path, truncate_after: int):
        self.path = path
        keep = []
        if truncate_after and path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("step", 0) <= truncate_after:
                    keep.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)

    def write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def figures(self, paths, step: int) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


class TensorBoardLog:
    """Scalars and figures (as images) in a TensorBoard event file."""

    def __init__(self, folder: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1 if start_step else None)

    def write(self, rec: dict) -> None:
        for k, v in scalars(rec).items():
            self.writer.add_scalar(k, v, rec["step"])
        self.writer.flush()

    def figures(self, paths, step: int) -> None:
        import matplotlib.image

        for p in paths:
            if p.suffix == ".png" and p.exists():
                self.writer.add_image(f"figures/{p.stem}", matplotlib.image.imread(p)[..., :3], step,
                                      dataformats="HWC")
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class MLflowLog:
    """Parameters (the config, flattened), metrics by step and figures as artifacts of one MLflow run."""

    def __init__(self, out: Path, start_step: int, config: dict):
        import logging

        import mlflow

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not a line per experiment created on stdout
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow keeps a local folder store only on request (its default is now a database)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "domainflow"))
        keep = out / "mlflow_run.json"
        run_id = json.loads(keep.read_text())["run_id"] if start_step and keep.exists() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else out.name)
        if run_id is None:
            keep.write_text(json.dumps({"run_id": self.run.info.run_id}))
            flat = {}
            for section, values in config.items():
                for k, v in (values.items() if isinstance(values, dict) else []):
                    flat[f"{section}.{k}"] = json.dumps(v) if isinstance(v, (list, dict)) else v
            mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def write(self, rec: dict) -> None:
        values = scalars(rec)
        if values:
            self.mlflow.log_metrics(values, step=int(rec["step"]))

    def figures(self, paths, step: int) -> None:
        for p in paths:
            if p.exists():
                self.mlflow.log_artifact(str(p), artifact_path="figures")

    def close(self, failed: bool = False) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")
