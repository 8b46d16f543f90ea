"""What an ingest did, for the command line and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class IngestReport:
    """Tasks written now, kept from an earlier (interrupted) ingest and skipped, with per-task timing,
    peak memory and raw bytes; ``state`` is "new", "resume" or "complete" (nothing to do)."""

    store: Path
    state: str
    written: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    tasks: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    seconds: float = 0.0
    uploaded: list = field(default_factory=list)  # a store at a URL: what was uploaded (remote_upload.py)

    @property
    def cells(self) -> int:
        return sum(sum(t["cells"].values()) for t in self.tasks)

    @property
    def peak_rss(self) -> int:
        return max((t["peak_rss"] for t in self.tasks), default=0)

    @property
    def peak_growth(self) -> int:
        """The most memory one task added on top of what its worker held when it started."""
        return max((t["peak_rss"] - t.get("start_rss", 0) for t in self.tasks), default=0)

    @property
    def largest_task_bytes(self) -> int:
        return max((t["raw_bytes"] for t in self.tasks), default=0)

    def summary(self) -> str:
        if self.state == "complete":
            done = f"{self.store}: already complete; nothing to do (pass --overwrite to ingest again)"
            return "\n".join([done] + [f"  {u}" for u in self.uploaded])
        lines = [f"{self.store}: {'resumed' if self.state == 'resume' else 'written'} in {self.seconds:.1f} s",
                 f"  tasks written {len(self.written)}, kept from before {len(self.kept)}, "
                 f"skipped {len(self.skipped)}"]
        if self.tasks:
            lines.append(f"  {self.cells:,} cells, {self.cells / max(self.seconds, 1e-9):,.0f} cells/s; peak memory "
                         f"per worker {self.peak_rss / 2**20:.0f} MiB, at most {self.peak_growth / 2**20:.0f} MiB "
                         f"for one task (largest task's raw input {self.largest_task_bytes / 2**20:.1f} MiB)")
        for run, why in self.skipped.items():
            lines.append(f"  skipped {run}: {why}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        lines += [f"  {u}" for u in self.uploaded]
        return "\n".join(lines)
