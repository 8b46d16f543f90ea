"""Opening a domainflow store (``domainflow.store``; docs/store-format.md) for reading, with a count of the
bytes read.

Readers never import ``domainflow.preprocess``: the two share only the store format (``domainflow.store``).
Nothing damaged is read as data: stores of format 2 have every chunk on disk, so a missing chunk file (zarr would return fill
values) or one that does not decode (truncated) is a :class:`StoreError` naming the store, run, array and
file; so is a chunk whose bytes no longer match its crc32c (zarr's ``crc32c`` codec, which ingest writes after
zstd): a flipped bit. Stores written before checksums read as before (``domainflow inspect`` says which). A
reader holds a shared OS lock on the store, which makes ``ingest --overwrite`` refuse
to replace it, and :meth:`Store.check_unchanged` tells when the store was replaced all the same.

A store at a URL (``s3://``, ``gs://``, ``https://``; ``domainflow.remote``) is read through zarr's fsspec
store with the same counting and checks (the same chunk keys, so the same region-only reads and byte
counts); it has no OS lock, and its root metadata's ETag is the stamp that tells a replacement.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from domainflow import remote
from domainflow.locks import FileLock, LockHeld, store_locks
from domainflow.store.chunks import StoreError, describe_key, read_checked
from domainflow.store.format import FORMAT, HEAD, RUNS

__all__ = ["ByteCounter", "Store", "StoreError", "open_store"]
_METADATA_KEYS = {"zarr.json", ".zgroup", ".zattrs", ".zarray", ".zmetadata"}


def _counting_store(path):
    """A read-only zarr store (local, or fsspec's for a URL) that counts the bytes of every chunk and metadata
    read, and refuses to let a missing chunk file read as fill values."""
    from zarr.storage import LocalStore, WrapperStore

    class CountingStore(WrapperStore):
        def __init__(self, store, counter):
            super().__init__(store)
            self.counter = counter

        def _missing(self, key):
            if key.rsplit("/", 1)[-1] not in _METADATA_KEYS:
                raise StoreError(f"{path} is damaged: {describe_key(path, key)} is missing (every chunk of a "
                                 f"store is written at ingest); re-ingest it (`domainflow ingest ... --overwrite`)")

        async def get(self, key, prototype, byte_range=None):
            buf = await self._store.get(key, prototype, byte_range)
            if buf is None:
                self._missing(key)
            else:
                self.counter.add(key, len(buf))
            return buf

        async def get_partial_values(self, prototype, key_ranges):
            key_ranges = list(key_ranges)
            bufs = await self._store.get_partial_values(prototype, key_ranges)
            for (key, _), buf in zip(key_ranges, bufs):
                if buf is None:
                    self._missing(key)
                else:
                    self.counter.add(key, len(buf))
            return bufs

        def with_read_only(self, read_only: bool = False):
            return CountingStore(self._store.with_read_only(read_only), self.counter)

    counter = ByteCounter()
    inner = remote.zarr_store(str(path)) if remote.is_url(path) else LocalStore(str(path), read_only=True)
    return CountingStore(inner, counter), counter


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

    path: Path | str  # a str for a store at a URL
    kind: str
    parts: int | None
    fields: dict
    stats: dict
    splits: dict
    attrs: dict
    group: object
    counter: ByteCounter
    stamp: tuple = ()  # (inode, mtime, size) of the root metadata when opened: see check_unchanged
    lock: FileLock | None = field(default=None, repr=False)  # shared readers lock, held while open

    @property
    def bytes_read(self) -> int:
        """Chunk bytes read through this handle so far (compressed, as stored)."""
        return self.counter.data

    def runs(self, split: str | None = None) -> list[str]:
        """Run ids of a mesh store, all or those of ``split``."""
        self.require_kind("mesh")
        if split is None:
            return sorted(self.group[RUNS].group_keys(), key=_run_key)
        if split not in self.splits:
            raise StoreError(f"{self.path} has no split {split!r}; its splits are {sorted(self.splits)}")
        return list(self.splits[split])

    def run(self, run_id: str):
        """The zarr group of one run."""
        try:
            return self.group[RUNS][run_id]
        except KeyError:
            raise StoreError(f"{self.path} has no run {run_id!r}; it has {self.runs()[:20]}"
                             f"{' ...' if len(self.runs()) > 20 else ''}") from None

    def require_kind(self, kind: str) -> None:
        if self.kind != kind:
            what = {"mesh": "MeshDataset (runs of a mesh store, from `domainflow ingest drivaerml`)",
                    "grid": "GridDataset (a grid store, from `domainflow ingest climate`)"}
            raise StoreError(f"{self.path} is a {self.kind!r} store; use {what.get(self.kind, 'another reader')} "
                             f"instead of the reader for {kind!r} stores")

    def close(self) -> None:
        """Release the readers lock now (it is also released when the handle is collected or the process ends)."""
        if self.lock is not None:
            self.lock.release()

    def check_unchanged(self) -> None:
        """Raise StoreError if the store was replaced (re-ingested) since it was opened: an ``--overwrite``
        rewrites the root metadata, so its inode, mtime or size change. One ``stat``; readers call it
        around every sample they read."""
        if _stamp(self.path) != self.stamp:
            raise StoreError(f"{self.path} was replaced or changed while this job was reading it (a re-ingest "
                             f"with --overwrite?); the samples read so far may mix two stores. Restart the job")

    def read(self, arr, selection=Ellipsis, orthogonal: bool = False):
        """``arr[selection]`` (``orthogonal``: ``arr.get_orthogonal_selection``) as numpy; a chunk that does not
        decode (truncated, a flipped bit caught by its crc32c) is a StoreError naming its file."""
        return read_checked(self.path, arr, selection, orthogonal)

    def field_names(self, location: str) -> list[str]:
        return sorted(k.split("/", 1)[1] for k, v in self.fields.items() if v.get("location") == location)


def _run_key(name: str):
    return (0, int(name[4:]), "") if name.startswith("run_") and name[4:].isdigit() else (1, 0, name)


def _stamp(path) -> tuple:
    if remote.is_url(path):
        return remote.stamp(str(path))
    try:
        st = os.stat(path / "zarr.json")
    except OSError:
        return ()
    return st.st_ino, st.st_mtime_ns, st.st_size


def _reader_lock(path: Path) -> FileLock | None:
    """The shared readers lock of a store (None where it cannot be taken: an older or read-only store, or a
    filesystem without locks); refused while an ``--overwrite`` holds it exclusively."""
    try:
        return FileLock(store_locks(path.resolve())[1], shared=True).acquire()
    except LockHeld as held:
        raise StoreError(f"{path} is being overwritten by an ingest ({held.holder}); wait until it completes") \
            from None
    except OSError:
        return None


def open_store(path) -> Store:
    """Open a complete store (a folder, or a URL: s3://, gs://, https://); refuses partial stores, unknown
    formats and paths that are not stores."""
    if remote.is_url(path):
        return _open(str(path).rstrip("/"), None)
    path = Path(path)
    lock = _reader_lock(path)
    try:
        store = _open(path, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if lock is None:
        store.lock = _new_reader_lock(path)
    return store


def _new_reader_lock(path: Path) -> FileLock | None:
    """A store that has no readers lock file yet (copied without its lock folder, or written by an older
    version), now known to be a store: make the file and take the lock (None where that is not possible,
    e.g. a read-only folder; the store's stamp check still notices a replacement)."""
    readers = store_locks(path.resolve())[1]
    try:
        readers.parent.mkdir(exist_ok=True)
        readers.touch()
    except OSError:
        return None
    return _reader_lock(path)


def _open(path: Path, lock) -> Store:
    import zarr

    stamp = _stamp(path)
    try:
        if remote.is_url(path):
            raw = remote.read_bytes(path, "zarr.json")
            if raw is None:
                raise FileNotFoundError(path)
        else:
            raw = (path / "zarr.json").read_bytes()
        attrs = json.loads(raw).get("attributes", {})
    except FileNotFoundError:
        raise StoreError(f"{path} is not a domainflow store (no zarr.json); create one with `domainflow ingest`") \
            from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable store metadata ({exc})") from None
    head = attrs.get(HEAD)
    if not isinstance(head, dict):
        raise StoreError(f"{path} is a zarr group but not a domainflow store (no attrs['domainflow']); create "
                         f"one with `domainflow ingest`")
    if head.get("format") != FORMAT:
        old = " (format 1 does not keep every chunk on disk, so a lost chunk would read as zeros)" \
            if head.get("format") == 1 else ""
        raise StoreError(f"{path} has store format {head.get('format')!r}; this domainflow reads format {FORMAT}"
                         f"{old}. Re-ingest it with this version (`domainflow ingest ... --overwrite`) or upgrade")
    if not head.get("complete"):
        raise StoreError(f"{path} is incomplete: the ingest that writes it was interrupted (or is still "
                         f"running). Rerun the same `domainflow ingest` command to resume it; finished runs "
                         f"are kept")
    store, counter = _counting_store(path)
    group = zarr.open_group(store, mode="r")
    return Store(path=path, kind=head.get("kind"), parts=head.get("parts"), fields=dict(attrs.get("fields", {})),
                 stats=dict(attrs.get("stats", {})), splits=dict(attrs.get("splits", {})), attrs=attrs, group=group,
                 counter=counter, stamp=stamp, lock=lock)
