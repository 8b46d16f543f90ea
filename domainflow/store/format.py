"""What a domainflow store holds: the format version, the root attributes, the array paths and the codecs.

A store is a Zarr v3 group. Its root's ``attrs["domainflow"]`` is the head: ``format`` (:data:`FORMAT`),
``kind`` ("mesh" or "grid"), ``complete`` (set last by the ingest that writes it), ``source`` (the raw data),
``parts`` (spatial parts per run) and ``checksum`` (:data:`CHECKSUM`, stores written since chunks carry one).
Its other attributes: ``fields`` (per "<location>/<field>" or "grid/<variable>": units, components, ...),
``stats`` (per key: count, mean, std, min, max over the train split), ``splits`` and ``ingest`` (the options).

A mesh store holds ``runs/<run id>/<location>/`` groups (location "surface" or "volume") with the geometry
arrays (``coords``, ``normals``, ``areas``, ``order``: rows sorted by spatial part), ``parts`` (the part
offsets: part p is rows ``parts[p]:parts[p + 1]``), ``part_boxes`` and ``fields/<name>``. A grid store holds
``data (time, channel, lat, lon)``, ``time``, ``lat``, ``lon`` and optionally ``static``, ``missing`` and
``climatology``.
"""

from __future__ import annotations

FORMAT = 2                # 2: every chunk is written (a missing chunk file is damage, never fill values)
CHECKSUM = "crc32c"       # attrs["domainflow"]["checksum"]: every chunk of the store carries one
HEAD = "domainflow"       # the root attribute holding the head
KINDS = ("mesh", "grid")
LOCATIONS = ("surface", "volume")
GEOMETRY = ("coords", "normals", "areas", "order")  # a mesh location's per-row geometry arrays
# optional (ingest --edges): the cells' adjacency as directed edges (sender, receiver) in the run's row numbers,
# sorted by (receiver, sender), so part p's edges (receivers in its rows) are EDGES[EDGE_PARTS[p]:EDGE_PARTS[p + 1]]
EDGES = "edges"
EDGE_PARTS = "edge_parts"
RUNS = "runs"
FIELDS = "fields"
GRID_ARRAYS = ("data", "time", "lat", "lon", "static", "missing", "climatology")


def run_array(run: str, location: str, name: str, field: bool = False) -> str:
    """The path of a mesh run's array: ``runs/<run>/<location>/[fields/]<name>``."""
    return f"{RUNS}/{run}/{location}/{FIELDS + '/' if field else ''}{name}"


def compressors() -> tuple:
    """The bytes-to-bytes codecs of every store array: zarr's default zstd, then a crc32c of the compressed
    bytes (last: a reader checks the bytes as stored before it decompresses them; 4 bytes per chunk)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return ZstdCodec(level=0, checksum=False), Crc32cCodec()


def chunk_options() -> dict:
    """``create_array`` options of every store array: chunks checksummed (:func:`compressors`), and every chunk
    written, also one of fill values only, so a chunk absent on disk means lost."""
    return {"compressors": compressors(), "config": {"write_empty_chunks": True}}


def checksummed(arr) -> bool:
    """Whether ``arr``'s chunks carry a crc32c (zarr's ``crc32c`` codec; stores written before it have none)."""
    from zarr.codecs import Crc32cCodec

    return any(isinstance(c, Crc32cCodec) for c in getattr(arr.metadata, "codecs", ()))
