"""``domainflow ingest ... s3://bucket/cars.zarr``: an ingest into a store at a URL.

Object stores have no rename and no lock, so the ingest runs as ever into a local staging store (resumable,
locked, published run by run) and the finished store is then uploaded with its root metadata last: the
root ``zarr.json`` holds ``complete``, so until it arrives readers refuse the URL as incomplete, and a reader
never sees a half-uploaded store as complete. An interrupted upload resumes: objects already there with
the same size that its journal (beside the staging store) records as sent for this same build are kept.
Without ``--overwrite`` the URL must be empty, hold such a partial upload, or this very store; anything
else is refused. ``--overwrite`` first deletes the URL's root metadata (readers refuse it from then on),
then sends every object and drops those the new store does not have. The staging store lives under
``--staging`` (default: ``$TMPDIR/domainflow-staging/<hash of the URL>``) and is kept for the next resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from domainflow import remote

from .errors import IngestError

ROOT_META = "zarr.json"


def staging_for(url: str, staging: str | os.PathLike | None = None) -> Path:
    """The local store an ingest into ``url`` is built in."""
    base = Path(staging) if staging else Path(tempfile.gettempdir()) / "domainflow-staging"
    name = url.rstrip("/").rsplit("/", 1)[-1] or "store.zarr"
    return base / f"{hashlib.sha1(url.encode()).hexdigest()[:12]}-{name}"


def ingest_to_url(ingest, raw, url: str, opts, staging=None):
    """Run ``ingest(raw, local, opts)`` into the staging store, then upload it to ``url``; the report names
    the URL and the seconds include the upload."""
    url = url.rstrip("/")
    t0 = time.perf_counter()
    local = staging_for(url, staging or getattr(opts, "staging", None))
    local.parent.mkdir(parents=True, exist_ok=True)
    if not opts.overwrite:
        _check_target(url, local)  # before hours of ingest: a URL that holds something else is refused now
    report = ingest(raw, local, opts)
    uploaded = upload_store(local, url, overwrite=opts.overwrite)
    report.store = url
    report.uploaded.append(f"staged in {local}; {uploaded} object(s) uploaded to {url} (root metadata last)")
    report.seconds = time.perf_counter() - t0
    return report


def _complete(meta: bytes | None) -> bool:
    try:
        return bool(json.loads(meta)["attributes"]["domainflow"].get("complete"))
    except (TypeError, ValueError, KeyError):
        return False


def _journal_path(local: Path) -> Path:
    """Beside the staging store: which objects of which build reached the URL (for a resumed upload)."""
    return local.with_name(local.name + ".uploaded.json")


def _read_journal(local: Path) -> dict:
    try:
        return json.loads(_journal_path(local).read_text())
    except (OSError, ValueError):
        return {}


def _remote_objects(fs, root: str) -> dict:
    try:
        return {p[len(root) + 1:]: info.get("size") for p, info in fs.find(root, detail=True).items()}
    except FileNotFoundError:
        return {}


def _check_target(url: str, local: Path) -> None:
    """Without --overwrite the URL must be empty, hold this machine's partial upload (every object there is
    in its journal), or the very store staged here (then there is nothing to upload)."""
    fs, root = remote.filesystem(url)
    root = root.rstrip("/")
    there = _remote_objects(fs, root)
    if not there:
        return
    meta = remote.read_bytes(url, ROOT_META)
    mine = (local / ROOT_META).read_bytes() if (local / ROOT_META).exists() else None
    if meta is not None and meta == mine and _complete(meta):
        return
    journal = _read_journal(local)
    if meta is None and set(there) <= set(journal.get("objects", {})):
        return  # an upload of ours that stopped before its root metadata
    what = ("a store" + ("" if _complete(meta) else " (incomplete)") if meta is not None
            else f"{len(there)} object(s) but no domainflow store")
    raise IngestError(f"{url} already holds {what} that this machine did not upload; pass --overwrite to replace "
                      f"everything under it")


def upload_store(local: Path, url: str, overwrite: bool = False) -> int:
    """Copy the complete store ``local`` to ``url``, root metadata last; returns the objects uploaded. A rerun
    after an interrupted upload sends only what its journal does not show as sent for this same build;
    ``overwrite`` sends everything and removes what the new store does not have."""
    local = Path(local)
    meta = (local / ROOT_META).read_bytes()
    if not _complete(meta):
        raise IngestError(f"{local} is not a complete store; nothing is uploaded to {url}")
    if url.split("://", 1)[0] in ("http", "https"):
        raise IngestError(f"{url}: an HTTP server is read-only here; ingest to s3://, gs:// or a folder and serve that")
    fs, root = remote.filesystem(url)
    root = root.rstrip("/")
    build = hashlib.sha256(meta).hexdigest()
    journal = _read_journal(local)
    if overwrite or journal.get("build") != build or journal.get("url") != url:
        journal = {"url": url, "build": build, "objects": {}}
    if overwrite and fs.exists(f"{root}/{ROOT_META}"):
        fs.rm_file(f"{root}/{ROOT_META}")  # readers refuse the URL from now until the new root arrives
    there = _remote_objects(fs, root)
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    stamp = {f: [(local / f).stat().st_size, (local / f).stat().st_mtime_ns] for f in files}
    todo = [f for f in files if f != ROOT_META and not (journal["objects"].get(f) == stamp[f]
                                                          and there.get(f) == stamp[f][0])]
    for k in range(0, len(todo), UPLOAD_BATCH):
        batch = todo[k:k + UPLOAD_BATCH]
        try:
            fs.put([str(local / f) for f in batch], [f"{root}/{f}" for f in batch])
        except OSError as exc:
            raise IngestError(f"{url}: upload failed ({type(exc).__name__}: {exc}); rerun the same command to "
                              f"resume (objects already sent are kept)") from None
        journal["objects"].update({f: stamp[f] for f in batch})
        _write_journal(local, journal)
    stale = sorted(set(there) - set(files))  # an older store's objects: only --overwrite gets here with any
    if stale:
        fs.rm([f"{root}/{f}" for f in stale])
    fs.pipe_file(f"{root}/{ROOT_META}", meta)  # last: the store is complete at the URL from here on
    journal["objects"][ROOT_META] = stamp[ROOT_META]
    _write_journal(local, journal)
    return len(todo) + 1


UPLOAD_BATCH = 256  # objects per fsspec put (sent concurrently); the journal is written after each


def _write_journal(local: Path, journal: dict) -> None:
    path = _journal_path(local)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(journal))
    tmp.replace(path)
