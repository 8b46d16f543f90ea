"""Writing a domainflow store (``domainflow.store``; docs/store-format.md) so that nothing is lost and nothing
half-written is read.

- The root group's ``attrs["domainflow"]["complete"]`` is set last; until then the store is a resumable
  partial store.
- A mesh run is written into a scratch folder next to the store (``<store>.ingest-tmp/``) and moved into
  ``runs/<id>`` with one ``os.replace``, so a run is either absent or whole; a killed task leaves only
  scratch, which the next ingest deletes.
- A grid time block writes whole chunks of ``data`` (zarr's local store writes each chunk file atomically)
  and then a small JSON marker with its statistics; blocks without a marker are redone.
- Each writer task writes whole chunks only and no two tasks share a chunk: zarr-python loses data when
  tasks write parts of the same chunk or shard concurrently.
- Every chunk is written, fill values included (zarr skips all-fill chunks by default), so a reader can tell a
  missing chunk file from data (store format 2).
- Every chunk carries a crc32c of its stored bytes (zarr v3's ``crc32c`` codec, after zstd), so a flipped bit is
  a named error at read time instead of wrong data. Every store array is created by :func:`create_array`.
- One writer at a time: the coordinating process holds an exclusive OS lock on the store for the whole ingest
  (it dies with the process, so a killed ingest never leaves a stale lock); ``--overwrite`` also locks out
  readers (a training job reading the store makes it fail instead of changing what the job reads).

Only the coordinating process writes root attributes; tasks return what they learnt.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np

from domainflow.locks import FileLock, LockHeld, LocksUnsupported, store_locks
from domainflow.store.format import CHECKSUM, FORMAT, HEAD, RUNS, chunk_options

from .errors import IngestError

TARGET_CHUNK_BYTES = 1 << 20
# ingest options renamed since stores were first written: a store's old key is compared under its new name, so a
# store written before the rename still resumes (or is still "complete": nothing to do)
RENAMED_CONFIG_KEYS = {"layout": "recipe"}


def create_array(where, name: str, *, shape, chunks, dtype, attributes: dict | None = None,
                 dimension_names=None, overwrite: bool = False):
    """The one place store arrays are created: ``where`` (a zarr group, or the folder of one: one metadata
    write, no group read) gets array ``name`` with :func:`chunk_options`."""
    import zarr

    kw = dict(shape=shape, chunks=chunks, dtype=dtype, attributes=attributes or {}, overwrite=overwrite,
              **chunk_options())
    if dimension_names is not None:
        kw["dimension_names"] = list(dimension_names)
    if isinstance(where, (str, os.PathLike)):
        return zarr.create_array(str(Path(where) / name), zarr_format=3, **kw)
    return where.create_array(name, **kw)


def for_writing(arr):
    """``arr`` (opened from disk) set to write every chunk, as :func:`chunk_options` promises readers."""
    return arr.with_config({"write_empty_chunks": True})


def chunk_rows(row_bytes: int, target: int = TARGET_CHUNK_BYTES) -> int:
    """Rows per chunk so a chunk holds about ``target`` bytes (at least one row)."""
    return max(1, int(target) // max(1, int(row_bytes)))


def write_array(group, name: str, values: np.ndarray, target: int = TARGET_CHUNK_BYTES, attrs: dict | None = None,
                overwrite: bool = False):
    """Create ``group[name]`` holding ``values``, chunked along rows into ~``target``-byte chunks."""
    values = np.ascontiguousarray(values)
    row_bytes = values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64))
    chunks = (min(max(1, len(values)), chunk_rows(row_bytes, target)),) + tuple(values.shape[1:])
    arr = create_array(group, name, shape=values.shape, chunks=chunks, dtype=values.dtype, attributes=attrs,
                       overwrite=overwrite)
    if values.size:
        arr[...] = values
    return arr


def _json_safe(obj):
    """Attrs must be JSON: numpy scalars/arrays to Python numbers/lists."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


class StoreWriter:
    """Opens, resumes and completes one store at ``path`` (a local folder); holds the store's writer lock
    from :meth:`open` until :meth:`close` (also a context manager)."""

    def __init__(self, path):
        # resolved: a symlinked store keeps its scratch next to the real folder (same file system, so the
        # final rename works) and dask workers in other working directories find it
        self.path = Path(path).resolve()
        self.scratch = self.path.with_name(self.path.name + ".ingest-tmp")
        self._locks: list[FileLock] = []

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the store's locks (a killed process releases them by dying)."""
        while self._locks:
            self._locks.pop().release()

    # -- opening -----------------------------------------------------------------------------------
    def open(self, kind: str, source: str, parts: int, config: dict, overwrite: bool = False,
             resumable: tuple = ()) -> str:
        """Start or resume; returns "new", "resume" or "complete" (nothing to do).

        ``config`` holds every option that changes the store's contents; resuming or re-running with
        different options is refused, so one store never mixes two ingests, except that the ``resumable``
        keys may change while the store is incomplete (the caller checks what was done under the old value).
        A second writer of the same store is refused at once, naming the one at work.
        """
        import zarr

        config = _json_safe(config)
        source = str(Path(source).resolve())
        self._check_target(Path(source))
        self._lock_writers()
        try:
            if overwrite:
                self._lock_readers()
                self._remove_all()
            head = self._head()
            if head is not None:
                if head.get("kind") != kind or head.get("format") != FORMAT:
                    raise IngestError(f"{self.path} holds a {head.get('kind')!r} store of format {head.get('format')}, "
                                      f"not a {kind!r} store of format {FORMAT}; pass --overwrite to replace it or "
                                      f"choose another STORE path")
                if head.get("checksum") != CHECKSUM and not head.get("complete"):
                    raise IngestError(f"{self.path} was started by an ingest that wrote no chunk checksums (an older "
                                      f"domainflow), and one store never mixes chunks with and without them; pass "
                                      f"--overwrite to start again")
                if head.get("source") != source:
                    raise IngestError(f"{self.path} was ingested from {head.get('source')}, not {source}; rerun with "
                                      f"the original RAW to resume, or pass --overwrite to start again")
                root = zarr.open_group(self.path, mode="r+")
                old = {RENAMED_CONFIG_KEYS.get(k, k): v for k, v in root.attrs.get("ingest", {}).get("config", {}).items()}
                diff = {k: (old.get(k), config.get(k)) for k in sorted(set(old) | set(config))
                        if old.get(k) != config.get(k)}
                if diff and not head.get("complete") and set(diff) <= set(resumable):
                    root.attrs["ingest"] = {**dict(root.attrs.get("ingest", {})), "config": config}
                    diff = {}
                if diff:
                    what = "; ".join(f"{k}: store has {a!r}, this ingest asks {b!r}" for k, (a, b) in diff.items())
                    raise IngestError(f"{self.path} was written by an ingest with different options ({what}); rerun "
                                      f"with the store's options to resume, or pass --overwrite to start again")
                if head.get("complete"):
                    return "complete"
                self._clean_scratch()
                self._remove_unfinished_files()
                if kind == "mesh" and RUNS not in root:
                    root.create_group(RUNS)  # killed right after the root was written
                return "resume"
            self._remove_all()
            # the root and its attrs in one (atomic) write: a kill leaves either nothing or a resumable store
            root = zarr.create_group(self.path, zarr_format=3, attributes={
                HEAD: {"format": FORMAT, "kind": kind, "complete": False, "source": source, "parts": parts,
                               "checksum": CHECKSUM},
                "ingest": {"config": config},
            })
            if kind == "mesh":
                root.create_group("runs")
            return "new"
        except BaseException:
            self.close()
            raise

    def _remove_unfinished_files(self) -> None:
        """The files a killed writer was writing: zarr writes each one as ``<name>.<uuid>.partial`` and renames it
        when whole, so one killed mid-write stays behind, and every later listing of its group warns about it
        (*ZarrUserWarning: Object at zarr.<uuid>.partial is not recognized as a component of a Zarr hierarchy*),
        in this ingest and in every reader. Only with the writer lock held: no writer is at work."""
        for p in self.path.rglob("*.partial"):
            if p.is_file():
                p.unlink()

    def _lock_writers(self) -> None:
        """The exclusive writer lock (a file beside the store, never deleted), or IngestError naming its holder."""
        writer, readers = store_locks(self.path)
        writer.parent.mkdir(parents=True, exist_ok=True)
        readers.touch()  # readers open it, never create it
        try:
            self._locks.append(FileLock(writer).acquire())
        except LockHeld as held:
            raise IngestError(f"{self.path} is being written by another ingest ({held.holder}); wait for it to "
                              f"finish (or stop it) and rerun this command, which then resumes or finds the store "
                              f"complete") from None
        except LocksUnsupported as exc:
            warnings.warn(f"{exc}: nothing stops a second ingest of {self.path} from running at the same time; "
                          f"run one at a time", stacklevel=3)

    def _lock_readers(self) -> None:
        """Lock out readers before replacing a store (held until :meth:`close`): refused while one reads it."""
        try:
            self._locks.append(FileLock(store_locks(self.path)[1]).acquire())
        except LockHeld as held:
            raise IngestError(f"{self.path} is being read by {held.holder} (a training job?); --overwrite would "
                              f"change the data under it. Stop the readers first, or ingest into a new STORE "
                              f"path") from None
        except LocksUnsupported:
            pass  # readers then notice the replaced store themselves (Store.check_unchanged)

    def _check_target(self, source: Path) -> None:
        """Refuse a STORE path that is a file, overlaps the raw data, or is a folder we did not write."""
        if self.path.is_file():
            raise IngestError(f"STORE {self.path} is a file; give a folder path for the store (e.g. data.zarr)")
        if self.path == source or self.path in source.parents:
            raise IngestError(f"STORE {self.path} is or contains the raw data {source}; choose a separate path")
        if self.path.is_dir() and any(self.path.iterdir()) and not self._is_store():
            raise IngestError(f"{self.path} exists and is not a domainflow store; choose another STORE path or "
                              f"delete it yourself (--overwrite replaces only stores that ingest wrote)")

    def _head(self) -> dict | None:
        """``attrs["domainflow"]`` of the store on disk, or None when there is none yet."""
        try:
            meta = json.loads((self.path / "zarr.json").read_text())
        except (OSError, ValueError):
            return None
        head = meta.get("attributes", {}).get(HEAD)
        return dict(head) if isinstance(head, dict) else None

    def _is_store(self) -> bool:
        """A store ingest wrote, or the empty group an older ingest left when killed between creating the
        root and writing its attrs (nothing in it to lose)."""
        if self._head() is not None:
            return True
        try:
            meta = json.loads((self.path / "zarr.json").read_text())
        except (OSError, ValueError):
            return False
        rest = {p.name for p in self.path.iterdir()} - {"zarr.json"}
        return (meta.get("node_type") == "group" and not meta.get("attributes")
                and rest <= {"runs"} and not any(p.name != "zarr.json" for p in (self.path / "runs").glob("*")))

    def _remove_all(self):
        """Delete the store (only ever one that ingest wrote, see _check_target) and its scratch."""
        if self.path.is_dir():
            shutil.rmtree(self.path)
        if self.scratch.exists():
            shutil.rmtree(self.scratch)

    def _clean_scratch(self):
        """Delete what killed tasks left behind (half-built runs, joined .part files); finished work lives
        in the store or in block markers, which stay."""
        if not self.scratch.exists():
            return
        for p in self.scratch.iterdir():
            if p.name != "blocks":
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def remove_run(self, run_id: str) -> None:
        """Drop a published run (its raw files changed, or it left RAW) before the store completes."""
        dest = self.path / "runs" / run_id
        if dest.exists():
            shutil.rmtree(dest)

    # -- mesh runs ---------------------------------------------------------------------------------
    def finished_runs(self) -> dict[str, dict]:
        """Run id -> attrs of each run already published (complete by construction)."""
        import zarr

        root = zarr.open_group(self.path, mode="r")
        out = {}
        for name, grp in root["runs"].groups():
            attrs = dict(grp.attrs)
            if attrs.get("complete"):
                out[name] = attrs
        return out

    def new_run_folder(self, run_id: str, token: str | None = None) -> Path:
        """A fresh scratch folder for a task to build run ``run_id`` in (``token`` names it; default new)."""
        folder = self.scratch / "runs" / f"{run_id}.{token or uuid.uuid4().hex[:8]}"
        folder.parent.mkdir(parents=True, exist_ok=True)
        return folder

    def publish_run(self, folder: Path, run_id: str) -> None:
        """Move a finished run group into ``runs/<run_id>`` in one rename."""
        dest = self.path / "runs" / run_id
        if dest.exists():  # only after an interrupted --overwrite of this very run
            shutil.rmtree(dest)
        os.replace(folder, dest)

    # -- grid blocks -------------------------------------------------------------------------------
    def block_marker(self, name: str) -> Path:
        return self.scratch / "blocks" / f"{name}.json"

    def mark_block(self, name: str, info: dict) -> None:
        path = self.block_marker(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.partial")
        tmp.write_text(json.dumps(_json_safe(info)))
        os.replace(tmp, path)

    def finished_blocks(self) -> dict[str, dict]:
        folder = self.scratch / "blocks"
        if not folder.exists():
            return {}
        return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}

    # -- completion --------------------------------------------------------------------------------
    def complete(self, attrs: dict) -> None:
        """Write the summary attrs (fields, stats, splits, ...) and then, last, mark the store complete."""
        import zarr

        root = zarr.open_group(self.path, mode="r+")
        root.attrs.update(_json_safe(attrs))
        head = dict(root.attrs["domainflow"])
        head["complete"] = True
        root.attrs["domainflow"] = head
        if self.scratch.exists():
            shutil.rmtree(self.scratch)
        self.close()
