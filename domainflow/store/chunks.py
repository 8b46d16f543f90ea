"""Reading store data so that nothing damaged is read as data: a chunk that does not decode (truncated, or a
flipped bit caught by its crc32c) is a :class:`StoreError` naming the store, run, array, chunk and file."""

from __future__ import annotations

import numpy as np

from domainflow.errors import DomainflowError

from .format import RUNS, checksummed

REINGEST = "re-ingest it (`domainflow ingest ... --overwrite`)"


class StoreError(DomainflowError, ValueError):
    """The path is not a complete domainflow store of a format and kind this reader understands, or it is
    damaged (a chunk missing or undecodable) or was replaced while being read."""


def describe_key(root, key: str) -> str:
    """"run run_3, array surface/coords, chunk 2,0 (file <path>)" for a store key (or the grid's ``data``)."""
    head, _, chunk = key.partition("/c/")
    parts = head.split("/")
    where = f"run {parts[1]}, array {'/'.join(parts[2:])}" if parts[0] == RUNS and len(parts) > 2 \
        else f"array {head}"
    return f"{where}, chunk {chunk.replace('/', ',') or '?'} (file {str(root).rstrip('/')}/{key})"


def read_checked(path, arr, selection=Ellipsis, orthogonal: bool = False) -> np.ndarray:
    """``arr[selection]`` (``orthogonal``: ``arr.get_orthogonal_selection``) of the store at ``path`` as numpy;
    a chunk that does not decode is a StoreError naming the store, run, array and chunk file (found by reading
    the selection's chunks one by one, on the failure path only). Every read of store data goes through here:
    the readers', and what ingest and inspect read back."""
    try:
        return np.asarray(arr.get_orthogonal_selection(selection) if orthogonal else arr[selection])
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001  (zarr and numcodecs raise many types)
        error = damaged(path, arr, selection, exc)
        if error is None:
            raise
        raise error from exc


def damaged(path, arr, selection, exc) -> StoreError | None:
    """A StoreError naming the first chunk of ``selection`` that does not read, or None if all do."""
    from zarr.core.indexing import OrthogonalIndexer

    try:
        if selection is Ellipsis:
            selection = tuple(slice(None) for _ in arr.shape)
        indexer = OrthogonalIndexer(selection, arr.shape, arr.metadata.chunk_grid)
        coords = sorted({tuple(int(i) for i in c.chunk_coords) for c in indexer})
    except Exception:  # noqa: BLE001  (a selection zarr itself refused: nothing is damaged)
        coords = []
    for c in coords:
        block = tuple(slice(i * n, (i + 1) * n) for i, n in zip(c, arr.chunks))
        try:
            arr[block]
        except StoreError as err:
            return err
        except Exception as err:  # noqa: BLE001
            where = describe_key(path, f"{arr.path}/{arr.metadata.encode_chunk_key(c)}")
            if checksummed(arr) and isinstance(err, ValueError) and "checksum" in str(err).lower():
                why = (": checksum mismatch (crc32c): its bytes changed after ingest wrote them (a flipped bit, a "
                       "bad disk or copy)")
            else:
                why = f" ({type(err).__name__}: {err})"
            return StoreError(f"{path} is damaged: {where} cannot be read{why}; {REINGEST}")
    return None
