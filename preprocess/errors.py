"""Errors raised by ingest: each names the file or store and says how to fix it."""

from __future__ import annotations

from domainflow.errors import DomainflowError


class IngestError(DomainflowError, ValueError):
    """Bad raw input (corrupt or truncated file, missing array or file, NaN/Inf) or an incompatible store."""


class RunError(IngestError):
    """One run (or time block) could not be ingested; ``run`` names it so ``--on-error skip`` can record it."""

    def __init__(self, run: str, message: str):
        super().__init__(f"{run}: {message}")
        self.run = run
        self.reason = message

    def __reduce__(self):  # crosses process boundaries (dask workers) intact
        return (RunError, (self.run, self.reason))


class WorkerDiedError(IngestError):
    """A worker process of ``--workers N`` died mid-task (killed: out of memory, most often); the store is left
    partial and valid, so rerunning the same command resumes it."""
