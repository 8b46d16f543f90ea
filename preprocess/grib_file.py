"""What a GRIB file holds, checked before it is read: its hypercubes (cfgrib's own split of a file into
datasets, by parameter and then by whatever key differs: level type, step type, step...) and its damage.

cfgrib's ``open_dataset`` reads one hypercube and only logs the variables it skips, and fills the fields a
cut-short download lacks with NaN; so a file is split here into every hypercube (each read on its own with
cfgrib's ``filter_by_keys``), its messages are counted with ecCodes (a message cut short, or bytes that are in
no message, name the file) and each hypercube must have every field of its (time, step, level...) grid.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

from .errors import IngestError


def index_path(path: str) -> str:
    """Where cfgrib keeps the index of a file's message headers, so that each later open (every hypercube at
    scan, every time block of every hypercube at ingest) reads it instead of scanning the whole file again: a
    folder of this user's in the temporary directory, one index per file content (path, size and mtime), never
    stale. cfgrib unpickles the index, so the folder is used only when it is this user's own and closed to
    others; an index left cut short (an ingest killed while writing it) is removed. "" (no index kept) where
    no such folder can be had."""
    import glob
    import stat

    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"domainflow-grib-index-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        own = os.lstat(folder)
    except OSError:
        return ""
    if not stat.S_ISDIR(own.st_mode) or own.st_uid != os.getuid() or own.st_mode & 0o077:
        return ""  # another user's, or open to others: an index there could be anyone's pickle
    for old in glob.glob(os.path.join(folder, key + ".*.idx")):
        if not _whole_pickle(old):
            try:
                os.unlink(old)
            except OSError:
                return ""
    return os.path.join(folder, key + ".{short_hash}.idx")


def _whole_pickle(path: str) -> bool:
    """Whether a file ends as a pickle does (its STOP opcode): one cut short by a killed writer does not."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"."
    except OSError:
        return False


class _QuietIndexErrors(logging.Filter):
    """cfgrib logs a full traceback when it cannot write or read an index file (a full disk, a file another
    ingest is writing at that moment), then scans the GRIB file itself, which is correct; the traceback would
    bury the one-line messages of ingest, so it is dropped (the ingest is only slower)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Can't create file", "Can't read index file"))


logging.getLogger("cfgrib.messages").addFilter(_QuietIndexErrors())


def hypercubes(path: str) -> list[tuple]:
    """The ``filter_by_keys`` of every hypercube of a GRIB file, as sorted item tuples, in parameter order:
    cfgrib's recursive split (``raw_open_datasets``), started per parameter as ``open_datasets`` does."""
    from cfgrib import cfmessage, messages
    from cfgrib.dataset import DatasetBuildError, open_fileindex

    index = open_fileindex(messages.FileStream(path, errors="raise"), indexpath=index_path(path),
                           computed_keys=cfmessage.COMPUTED_KEYS)
    found: list[tuple] = []

    def split(keys: dict) -> None:
        try:
            open_cube(path, keys)
            found.append(tuple(sorted(keys.items())))
            return
        except DatasetBuildError as exc:
            parts = exc.args[2]
        for extra in parts:
            split({**keys, **extra})

    for param in sorted(index["paramId"]):
        split({"paramId": param})
    return found


def open_cube(path: str, keys: dict):
    """One hypercube as cfgrib's own Dataset (lazy: headers read, values not)."""
    from cfgrib.dataset import open_file

    return open_file(path, indexpath=index_path(path), errors="raise", filter_by_keys=dict(keys))


def check_file(path: str) -> int:
    """The number of messages of a GRIB file; a message cut short, one ecCodes cannot decode, or bytes outside
    every message (a damaged or partly overwritten download) are an error naming the file."""
    import eccodes

    size, count, held = os.path.getsize(path), 0, 0
    with open(path, "rb") as f:
        while True:
            try:
                h = eccodes.codes_grib_new_from_file(f, headers_only=True)
            except Exception as exc:  # noqa: BLE001  (ecCodes' error names what is wrong with the message)
                raise IngestError(f"{path}: GRIB message {count + 1} is damaged or cut short ({exc}); the file is "
                                  f"truncated or corrupt (an interrupted download?): download it again") from None
            if h is None:
                break
            try:
                held += int(eccodes.codes_get(h, "totalLength"))
            finally:
                eccodes.codes_release(h)
            count += 1
    if count == 0:
        raise IngestError(f"{path}: no GRIB message in the file ({size} bytes); it is not GRIB, or it is damaged (an "
                          f"error page saved by the download?): download it again")
    if held != size:
        raise IngestError(f"{path}: {size - held} of its {size} bytes are in no GRIB message ({count} messages "
                          f"read); the file is damaged (an interrupted or corrupted download?): download it again")
    return count


def present_steps(path: str, keys: tuple) -> list[tuple] | None:
    """Check a hypercube's fields: every one of its grid must be there (a hole is a damaged or incomplete file,
    never missing values to fill), except between a forecast's time and step. ERA5's accumulations come from
    forecasts at 06 and 18 UTC whose steps cover each day once, so cfgrib's (time, step) grid is legitimately
    sparse: those (time, step) pairs that have all their fields are returned (None when the cube has no such
    grid); a pair with only some of its levels is a hole."""
    import numpy as np

    ds = open_cube(path, dict(keys))
    pairs = None
    for name, var in ds.variables.items():
        data = var.data
        held = getattr(data, "field_id_index", None)
        if held is None:
            continue
        lead = tuple(var.dimensions[: len(var.dimensions) - data.geo_ndim])
        shape = tuple(data.shape[: len(lead)])
        total = int(np.prod(shape)) if shape else 1
        if len(held) == total:
            continue
        have = set(held)
        if "time" in lead and "step" in lead:
            it, js = lead.index("time"), lead.index("step")
            per_pair = total // (shape[it] * shape[js])
            counts: dict = {}
            for ix in have:
                counts[ix[it], ix[js]] = counts.get((ix[it], ix[js]), 0) + 1
            partial = [p for p, n in counts.items() if n != per_pair]
            if not partial:
                pairs = sorted(counts)
                continue
            first = next(ix for ix in np.ndindex(*shape) if ix not in have and (ix[it], ix[js]) in counts)
        else:
            first = next(ix for ix in np.ndindex(*shape) if ix not in have)
        where = ", ".join(f"{d}={_value(ds, d, i)}" for d, i in zip(lead, first))
        raise IngestError(f"{path}: {name} has {len(held)} of the {total} fields of its {' x '.join(lead)} grid "
                          f"(the first missing at {where}); the file lacks messages (a download cut short or "
                          f"damaged): download it again")
    return pairs


def _value(ds, dim: str, i: int):
    values = ds.variables[dim].data if dim in ds.variables else None
    try:
        v = values[i]
    except Exception:  # noqa: BLE001
        return i
    v = v.item() if hasattr(v, "item") else v
    if dim in ("time", "valid_time") and isinstance(v, (int, float)):  # cfgrib's seconds since 1970
        import numpy as np

        return str(np.datetime64(int(v), "s")).replace("T", " ")
    return v
