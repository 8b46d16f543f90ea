"""What the scaling benchmarks measure the same way: bytes autograd saves for backward, available memory,
and writing a results file atomically. Imported by the benchmark scripts (their folder is on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# glibc settings for the benchmark ranks (``--malloc tuned``): with the defaults every block above 32 MiB
# (large activations, im2col buffers of CPU convolutions) is mmap-ed and unmapped on every use, so each step
# pays page faults that depend on the block sizes rather than on the work; these keep freed memory in the
# heap. Set in the environment before the ranks start (glibc reads it at process start).
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**30), "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30)}


class SavedBytes:
    """Storage bytes of the tensors autograd saves for backward while ``hooks()`` is active: each storage
    counted once (by data pointer), a ShardTensor by its local tensor, storages in ``exclude`` (e.g. the
    parameters' data pointers) left out; ``kinds`` counts ShardTensors and plain tensors saved."""

    def __init__(self, exclude=()):
        self.seen: dict[int, int] = {}
        self.kinds = {"ShardTensor": 0, "plain": 0}
        self.exclude = set(exclude)

    def pack(self, t):
        import domainflow as df

        shard = isinstance(t, df.ShardTensor)
        self.kinds["ShardTensor" if shard else "plain"] += 1
        local = t._local if shard else t
        try:
            st = local.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (should not happen): count its elements
            ptr, n = id(local), local.numel() * local.element_size()
        if ptr not in self.exclude:
            self.seen[ptr] = max(self.seen.get(ptr, 0), n)
        return t

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (8 GiB when it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def write_results(name: str, out: dict) -> Path:
    """benchmarks/results/<name>.json, written to a temporary file and renamed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = RESULTS / f"{name}.json.tmp"
    tmp.write_text(json.dumps(out, indent=2, default=str))
    tmp.replace(path)
    print(f"wrote {path}")
    return path
