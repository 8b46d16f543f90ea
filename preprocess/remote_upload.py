"""``domainflow ingest ... s3://bucket/cars.zarr``: an ingest into a store at a URL.

Object stores have no rename and no lock, so the ingest runs as ever into a local staging store (resumable,
locked, published run by run) and the finished store is then uploaded with its root metadata last: the
root ``zarr.json`` holds ``complete``, so until it arrives readers refuse the URL as incomplete, and a reader
never sees a half-uploaded store as complete. An interrupted upload resumes: objects already there with
the same size are kept. ``--overwrite`` first deletes the URL's root metadata (readers refuse it from then
on), then uploads and drops objects the new store does not have. The staging store lives under
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
    there = _remote_root(url)
    if there is not None and not opts.overwrite:
        mine = (local / ROOT_META).read_bytes() if (local / ROOT_META).exists() else None
        if mine != there or not _complete(there):
            raise IngestError(f"{url} already holds a store{'' if _complete(there) else ' (incomplete)'} that this "
                              f"machine did not build; pass --overwrite to replace it")
    report = ingest(raw, local, opts)
    uploaded = upload_store(local, url, overwrite=opts.overwrite)
    report.store = url
    report.uploaded.append(f"staged in {local}; {uploaded} object(s) uploaded to {url} (root metadata last)")
    report.seconds = time.perf_counter() - t0
    return report


def _remote_root(url: str) -> bytes | None:
    return remote.read_bytes(url, ROOT_META)


def _complete(meta: bytes | None) -> bool:
    try:
        return bool(json.loads(meta)["attributes"]["domainflow"].get("complete"))
    except (TypeError, ValueError, KeyError):
        return False


def upload_store(local: Path, url: str, overwrite: bool = False) -> int:
    """Copy the complete store ``local`` to ``url``, root metadata last; returns the objects uploaded."""
    local = Path(local)
    meta = (local / ROOT_META).read_bytes()
    if not _complete(meta):
        raise IngestError(f"{local} is not a complete store; nothing is uploaded to {url}")
    fs, root = remote.filesystem(url)
    root = root.rstrip("/")
    if url.split("://", 1)[0] in ("http", "https"):
        raise IngestError(f"{url}: an HTTP server is read-only here; ingest to s3://, gs:// or a folder and serve that")
    if overwrite and fs.exists(f"{root}/{ROOT_META}"):
        fs.rm_file(f"{root}/{ROOT_META}")  # readers refuse the URL from now until the new root arrives
    try:
        there = {p[len(root) + 1:]: info.get("size") for p, info in fs.find(root, detail=True).items()}
    except FileNotFoundError:
        there = {}
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    todo = [f for f in files if f != ROOT_META and there.get(f) != (local / f).stat().st_size]
    if todo:
        try:
            fs.put([str(local / f) for f in todo], [f"{root}/{f}" for f in todo])
        except OSError as exc:
            raise IngestError(f"{url}: upload failed ({type(exc).__name__}: {exc}); rerun the same command to "
                              f"resume (objects already there are kept)") from None
    stale = sorted(set(there) - set(files))  # not part of the store being published (an older one's runs)
    if stale:
        fs.rm([f"{root}/{f}" for f in stale])
    fs.pipe_file(f"{root}/{ROOT_META}", meta)  # last: the store is complete at the URL from here on
    return len(todo) + 1
