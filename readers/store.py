"""Opening a domainflow store (format in DESIGN.md) for reading, with a count of the bytes read.

Readers never import ``domainflow.preprocess``: the two share only the store format.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1


class StoreError(ValueError):
    """The path is not a complete domainflow store of a format and kind this reader understands."""


def _counting_store(path: Path):
    """A read-only zarr local store that counts the bytes of every chunk and metadata read."""
    from zarr.storage import LocalStore, WrapperStore

    class CountingStore(WrapperStore):
        def __init__(self, store, counter):
            super().__init__(store)
            self.counter = counter

        async def get(self, key, prototype, byte_range=None):
            buf = await self._store.get(key, prototype, byte_range)
            if buf is not None:
                self.counter.add(key, len(buf))
            return buf

        async def get_partial_values(self, prototype, key_ranges):
            key_ranges = list(key_ranges)
            bufs = await self._store.get_partial_values(prototype, key_ranges)
            for (key, _), buf in zip(key_ranges, bufs):
                if buf is not None:
                    self.counter.add(key, len(buf))
            return bufs

        def with_read_only(self, read_only: bool = False):
            return CountingStore(self._store.with_read_only(read_only), self.counter)

    counter = ByteCounter()
    return CountingStore(LocalStore(str(path), read_only=True), counter), counter


@dataclass
class ByteCounter:
    """Bytes read from a store: chunk data and metadata separately (thread-safe)."""

    data: int = 0
    metadata: int = 0
    track_keys: bool = False  # also list the chunk keys read (tests, benchmarks); off in training
    keys: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, key: str, n: int) -> None:
        with self._lock:
            if key.endswith("zarr.json"):
                self.metadata += n
            else:
                self.data += n
                if self.track_keys:
                    self.keys.append(key)

    def reset(self) -> None:
        with self._lock:
            self.data = self.metadata = 0
            self.keys = []


@dataclass
class Store:
    """A complete store opened for reading: kind, parts, fields, statistics, splits; ``group`` is the root."""

    path: Path
    kind: str
    parts: int | None
    fields: dict
    stats: dict
    splits: dict
    attrs: dict
    group: object
    counter: ByteCounter

    @property
    def bytes_read(self) -> int:
        """Chunk bytes read through this handle so far (compressed, as stored)."""
        return self.counter.data

    def runs(self, split: str | None = None) -> list[str]:
        """Run ids of a mesh store, all or those of ``split``."""
        self.require_kind("mesh")
        if split is None:
            return sorted(self.group["runs"].group_keys(), key=_run_key)
        if split not in self.splits:
            raise StoreError(f"{self.path} has no split {split!r}; its splits are {sorted(self.splits)}")
        return list(self.splits[split])

    def run(self, run_id: str):
        """The zarr group of one run."""
        try:
            return self.group["runs"][run_id]
        except KeyError:
            raise StoreError(f"{self.path} has no run {run_id!r}; it has {self.runs()[:20]}"
                             f"{' ...' if len(self.runs()) > 20 else ''}") from None

    def require_kind(self, kind: str) -> None:
        if self.kind != kind:
            what = {"mesh": "MeshDataset (runs of a mesh store, from `domainflow ingest drivaerml`)",
                    "grid": "GridDataset (a grid store, from `domainflow ingest climate`)"}
            raise StoreError(f"{self.path} is a {self.kind!r} store; use {what.get(self.kind, 'another reader')} "
                             f"instead of the reader for {kind!r} stores")

    def field_names(self, location: str) -> list[str]:
        return sorted(k.split("/", 1)[1] for k, v in self.fields.items() if v.get("location") == location)


def _run_key(name: str):
    return (0, int(name[4:]), "") if name.startswith("run_") and name[4:].isdigit() else (1, 0, name)


def open_store(path) -> Store:
    """Open a complete store; refuses partial stores, unknown formats and paths that are not stores."""
    import zarr

    path = Path(path)
    meta = path / "zarr.json"
    try:
        attrs = json.loads(meta.read_text()).get("attributes", {})
    except FileNotFoundError:
        raise StoreError(f"{path} is not a domainflow store (no zarr.json); create one with `domainflow ingest`") \
            from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable store metadata ({exc})") from None
    head = attrs.get("domainflow")
    if not isinstance(head, dict):
        raise StoreError(f"{path} is a zarr group but not a domainflow store (no attrs['domainflow']); create "
                         f"one with `domainflow ingest`")
    if head.get("format") != FORMAT:
        raise StoreError(f"{path} has store format {head.get('format')!r}; this domainflow reads format {FORMAT}. "
                         f"Re-ingest it with this version (`domainflow ingest ... --overwrite`) or upgrade")
    if not head.get("complete"):
        raise StoreError(f"{path} is incomplete: the ingest that writes it was interrupted (or is still "
                         f"running). Rerun the same `domainflow ingest` command to resume it; finished runs "
                         f"are kept")
    store, counter = _counting_store(path)
    group = zarr.open_group(store, mode="r")
    return Store(path=path, kind=head.get("kind"), parts=head.get("parts"), fields=dict(attrs.get("fields", {})),
                 stats=dict(attrs.get("stats", {})), splits=dict(attrs.get("splits", {})), attrs=attrs, group=group,
                 counter=counter)
