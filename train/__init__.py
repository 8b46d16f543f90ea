"""Training loop and models on a ("dp", "domain") mesh, consuming ShardTensors from the readers.

Installed as ``domainflow.train``; always import it by that name, never as bare ``train``.

- ``load_config(path, overrides)``: the YAML/TOML config, checked against its schema.
- ``Trainer(cfg)``: one rank's side of a job: ``fit(resume=False)`` trains, checkpoints, evaluates.
- ``run_training(cfg, nproc)``: start the ranks (torch's elastic launcher) unless already under torchrun.
- ``models``: Transolver and MeshGraphNet (surface fields) and a periodic UNet (gridded forecasting).
"""

from .config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "Trainer", "TrainingDiverged", "load_config"]


def __getattr__(name):
    """``Trainer`` and ``TrainingDiverged`` load torch: on first use (PEP 562), so that the ``domainflow`` command,
    which assembles ``train.cli`` with the data commands, starts an ingest without importing torch."""
    if name in ("Trainer", "TrainingDiverged"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'domainflow.train' has no attribute {name!r}")
