"""The bytes of a checkpoint folder: read without running code, and checked against a manifest of checksums.

DCP keeps its ``.metadata`` as a pickle and non-tensor state (optimizer hyper-parameters) as ``torch.save``
bytes that it loads with ``weights_only=False``, so a crafted checkpoint could run code when it is opened.
Here ``.metadata`` is unpickled by :class:`MetadataUnpickler`, which admits only the classes DCP's metadata is
made of and refuses anything else by name before any of it runs, and byte items load with
``weights_only=True``. ``manifest.json`` lists every file of the checkpoint with its size and SHA-256 (written
at save, checked at load), so a flipped bit is a named error, never different weights.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

MANIFEST = "manifest.json"
_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    _DCP + "metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "MetadataIndex", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    _DCP + "filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint's metadata refers to something DCP metadata never holds (it may be crafted to run code)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, admitting only the classes it is made of (and torch dtypes)."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"it refers to {module}.{name}, which DCP checkpoint metadata never holds "
                               f"(a crafted file can run code when unpickled); nothing of it was run")


def read_metadata(folder: Path):
    """DCP's ``.metadata`` of ``folder``, unpickled safely (FileNotFoundError when there is none)."""
    with open(Path(folder) / ".metadata", "rb") as f:
        return MetadataUnpickler(f).load()


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled by :class:`MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read by ``torch.load(weights_only=True)`` (plain values only)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# -- manifest ------------------------------------------------------------------------------------------
def digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex) of a file, read in 4 MiB blocks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            block = f.read(4 << 20)
            if not block:
                break
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def own_files(folder: Path, rank: int) -> list[str]:
    """The files of a DCP save that ``rank`` wrote (FileSystemWriter names them ``__<rank>_<n>.distcp``)."""
    return sorted(p.name for p in Path(folder).glob(f"__{rank}_*.distcp"))


def write_manifest(folder: Path, digests: dict[str, tuple[int, str]]) -> None:
    """``manifest.json`` in ``folder``: ``digests`` plus every other file there (hashed here), itself left out."""
    folder = Path(folder)
    files = dict(digests)
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name not in files and p.name != MANIFEST:
            files[p.name] = digest(p)
    body = {"algorithm": "sha256", "files": {k: {"bytes": n, "sha256": h} for k, (n, h) in sorted(files.items())}}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(folder / MANIFEST)


def plain_name(name) -> bool:
    """A file name inside the checkpoint folder itself (no path, no ``..``): what a manifest or DCP may name."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def manifest_problems(folder: Path, share: tuple[int, int] | None = None, hashes: bool = True) -> list[str] | None:
    """What does not match ``folder``'s manifest ([] if all does), or None when it has no manifest (a
    checkpoint saved before checksums). Every file's size is checked; its SHA-256 (``hashes``) only for this
    rank's ``share`` (rank, world) of the files (all of them when None), so ranks split the reading. The
    manifest is not trusted either: only regular files of the folder itself are read."""
    folder = Path(folder)
    try:
        body = json.loads((folder / MANIFEST).read_text())
        files = body["files"]
        entries = sorted(files.items())
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"]
    found = []
    for i, (name, want) in enumerate(entries):
        if not plain_name(name) or not isinstance(want, dict) or not isinstance(want.get("bytes"), int) \
                or not isinstance(want.get("sha256"), str):
            found.append(f"{MANIFEST} has a malformed entry {name!r} (a file of the folder itself, with its bytes "
                         f"and sha256)")
            continue
        path = folder / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            found.append(f"{name} is missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            found.append(f"{name} is not a regular file")
            continue
        size = st.st_size
        if size != want["bytes"]:
            found.append(f"{name} is truncated ({size} of {want['bytes']} bytes)" if size < want["bytes"] else
                         f"{name} has {size} bytes, {MANIFEST} says {want['bytes']}")
            continue
        if hashes and (share is None or i % share[1] == share[0]):
            if digest(path)[1] != want["sha256"]:
                found.append(f"{name} does not match its SHA-256 in {MANIFEST} (its bytes changed since the save)")
    return found


def not_plain(state, where: str = "") -> str | None:
    """The first non-tensor value in a state dict that does not load back with ``weights_only=True`` (what
    loading admits), as 'key (type)', or None: checked at save, so a checkpoint that could not be loaded safely
    is refused by name when it is written, never called corrupt later."""
    if isinstance(state, torch.Tensor) or state is None or isinstance(state, (bool, int, float, str, bytes)):
        return None
    if isinstance(state, dict):
        for k, v in state.items():
            bad = not_plain(v, f"{where}.{k}" if where else str(k))
            if bad:
                return bad
        return None
    if isinstance(state, (list, tuple)):
        for k, v in enumerate(state):
            bad = not_plain(v, f"{where}[{k}]")
            if bad:
                return bad
        return None
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001  (weights_only refuses it, or it does not even pickle)
        return f"{where} ({type(state).__module__}.{type(state).__name__})"
    return None
