"""Stores at a URL (``s3://bucket/cars.zarr``, ``gs://...``, ``https://host/cars.zarr``): the one place that
tells a URL from a local path and opens its filesystem through fsspec (credentials and endpoints from the
usual environment: ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``FSSPEC_S3_ENDPOINT_URL``, ...). Shared by the
readers and the ingest, which otherwise share only the store format."""

from __future__ import annotations

import re

from domainflow.errors import DomainflowError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_EXTRA = {"s3": "s3fs (pip install 'domainflow[remote]')", "s3a": "s3fs (pip install 'domainflow[remote]')",
          "gs": "gcsfs (pip install gcsfs)", "gcs": "gcsfs (pip install gcsfs)",
          "http": "aiohttp (pip install 'domainflow[remote]')", "https": "aiohttp (pip install 'domainflow[remote]')"}


class RemoteStoreError(DomainflowError, ValueError):
    """A store URL that cannot be used: an unknown scheme, a missing fsspec backend, an unreachable server."""


def is_url(path) -> bool:
    """True for ``scheme://...`` (not ``file://``: that is a local path)."""
    text = str(path)
    return bool(_URL.match(text)) and not text.startswith("file://")


def filesystem(url: str):
    """(fsspec filesystem, path inside it) of ``url``; a missing backend is one line naming what to install."""
    try:
        import fsspec
    except ImportError:
        raise RemoteStoreError(f"{url}: stores at a URL need fsspec (pip install 'domainflow[remote]')") from None
    scheme = url.split("://", 1)[0].lower()
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        need = _EXTRA.get(scheme)
        hint = f"; install {need}" if need else ""
        raise RemoteStoreError(f"{url}: no filesystem for {scheme}:// ({str(exc).splitlines()[0]}){hint}") from None


def zarr_store(url: str, read_only: bool = True):
    """A zarr v3 store over ``url`` (zarr's FsspecStore)."""
    from zarr.storage import FsspecStore

    filesystem(url)  # the backend is there (else one line)
    return FsspecStore.from_url(url, read_only=read_only)


def read_bytes(url: str, key: str) -> bytes | None:
    """The object ``key`` below ``url``, or None if there is none."""
    fs, root = filesystem(url)
    try:
        return fs.cat_file(f"{root.rstrip('/')}/{key}")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RemoteStoreError(f"{url}/{key}: cannot be read ({type(exc).__name__}: {exc})") from None


def stamp(url: str, key: str = "zarr.json") -> tuple:
    """What changes when the object ``key`` is rewritten: its ETag (or modification time) and size; () if absent."""
    fs, root = filesystem(url)
    try:
        info = fs.info(f"{root.rstrip('/')}/{key}")
    except FileNotFoundError:
        return ()
    except OSError as exc:
        raise RemoteStoreError(f"{url}/{key}: cannot be read ({type(exc).__name__}: {exc})") from None
    tag = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or info.get("updated")
    return str(tag), info.get("size")
