"""Cross-rank checks of what every rank must agree on but declares alone: user-given layouts and replicated
parameters.

``from_local(..., sharding_shapes=mapping | "chunk")`` takes each rank's word for every rank's size, and a
replicated ``nn.Parameter`` is assumed equal on every rank. Either, when wrong on one rank, gives a wrong
result with no error. Checking them where they are declared would cost a collective per tensor on the
reading hot path, so they are recorded there (no communication) and checked lazily: the collective layer
(:mod:`domainflow.comm`) calls :func:`flush` before any collective, which checks everything recorded since
the last one in one small all-reduce per mesh-dim group (a fingerprint per item, reduced by max of
(+h, -h): equal everywhere iff max == -max(-h)). A disagreement raises on every rank, before the
collective that would have used it: :class:`ShardingShapeError` for layouts, :class:`ReplicaMismatchError`
for parameters. Layouts are recorded only when a user supplies them; layouts the engine derives from checked
ones need no check. Each parameter is checked once, the first time it meets a ShardTensor.

Ranks record items in the same order (SPMD), so they take part in the same check collectives; groups of
one rank record nothing.
"""

from __future__ import annotations

import hashlib
import threading

import torch

from domainflow import comm
from domainflow.errors import ReplicaMismatchError, ShardingShapeError
from domainflow.layout.placements import Partial, Shard

_lock = threading.Lock()
_pending: dict = comm.pending_checks  # (group key) -> _Group, in the order first recorded (dicts keep it)
_flushing = threading.local()
stats = {"checks": 0, "items": 0}  # collectives spent on checks and items checked, for benchmarks and tests


class _Group:
    __slots__ = ("mesh", "mesh_dim", "items")

    def __init__(self, mesh, mesh_dim):
        self.mesh, self.mesh_dim = mesh, mesh_dim
        self.items: dict = {}  # key -> (kind, fingerprint or None, layout text or parameter); repeats are one


def _group_of(mesh, mesh_dim: int) -> _Group | None:
    if mesh.shape[mesh_dim] == 1:
        return None
    key = (id(mesh.get_group(mesh_dim)), mesh_dim)
    g = _pending.get(key)
    if g is None:
        g = _pending[key] = _Group(mesh, mesh_dim)
    return g


# --------------------------------------------------------------------------------------------
# recording (no communication)
# --------------------------------------------------------------------------------------------
def record_layout(spec, source: str) -> None:
    """A layout whose sizes a user gave (``source`` names the call): checked at the next collective over
    every mesh dim it is sharded on."""
    dims = [m for m, p in enumerate(spec.placements) if isinstance(p, Shard)]
    if not dims:
        return
    h = _layout_fingerprint(spec)
    with _lock:
        for m in dims:
            g = _group_of(spec.mesh, m)
            if g is not None and ("layout", h) not in g.items:
                g.items[("layout", h)] = ("layout", h, (source, _layout_text(spec)))


def record_parameter(param: torch.Tensor, mesh) -> None:
    """A replicated ``nn.Parameter`` was passed to a function together with a ShardTensor on ``mesh`` for the
    first time (the dispatcher calls this once per parameter): checked at the next collective over every
    mesh dim, since it must be equal on every rank of the mesh."""
    if getattr(param, "_domainflow_recorded", False):
        return
    param._domainflow_recorded = True
    if all(mesh.shape[m] == 1 for m in range(mesh.ndim)):
        return
    # its fingerprint now, not at the check: FSDP2 frees a gathered parameter's memory after the layer's forward
    h = param_fingerprint(param)
    with _lock:
        for m in range(mesh.ndim):
            g = _group_of(mesh, m)
            if g is not None:
                g.items[("param", id(param))] = ("param", h, param)


# --------------------------------------------------------------------------------------------
# checking (at the next collective)
# --------------------------------------------------------------------------------------------
def mark_checked(params) -> None:
    """``params`` need no check (:func:`sync_module` just made them equal on every rank): forgotten if
    recorded and not checked yet, and never recorded again."""
    ids = set()
    for p in params:
        p._domainflow_recorded = True
        ids.add(id(p))
    with _lock:
        for g in _pending.values():
            for key in [k for k in g.items if k[0] == "param" and k[1] in ids]:
                del g.items[key]


def pending() -> bool:
    return bool(_pending)


def flush(before: str = "a collective") -> None:
    """Check everything recorded so far; the collective layer calls it before each collective (``before``
    names that one, which is what a timeout of the check reports)."""
    if not _pending or getattr(_flushing, "on", False):
        return
    with _lock:
        groups = [g for g in _pending.values() if g.items]
        _pending.clear()
    _flushing.on = True
    try:
        for g in groups:
            _check_group(g, before)
    finally:
        _flushing.on = False


def _check_group(g: _Group, before: str) -> None:
    """One all-reduce of a fixed size whatever each rank recorded: (+h, -h) by max for one fingerprint of the
    rank's whole ordered list, so ranks agree iff max(h) == min(h)."""
    items = list(g.items.values())
    values = [h if h is not None else param_fingerprint(obj) for _, h, obj in items]
    combined = _digest(repr(values).encode())
    v = torch.tensor([combined, -combined], dtype=torch.int64, device=comm.mesh_device(g.mesh))
    red = comm.all_reduce(v, "max", g.mesh, g.mesh_dim,
                          what=(before, " (checking first that the ranks agree on layouts and parameters they "
                                        "declared alone)"), kind="check").tolist()
    stats["checks"] += 1
    stats["items"] += len(items)
    if red[0] != -red[1]:
        _raise(g, items, values)


def _raise(g: _Group, items, values) -> None:
    """Every rank raises the same error (the check's result is identical everywhere): what each rank declared
    comes from one all-gather on this failure path, and the message is built from it alike on every rank."""
    names = _param_names([obj for kind, _, obj in items if kind != "layout"])
    mine = [(kind, value, obj if kind == "layout" else (names[id(obj)], tuple(obj.shape), str(obj.dtype)))
            for (kind, _, obj), value in zip(items, values)]
    said = comm.all_gather_object(mine, g.mesh, g.mesh_dim)
    ranks = comm.dim_ranks(g.mesh, g.mesh_dim)
    dim = _dim_name(g.mesh, g.mesh_dim)
    layouts, params = [], []
    for j in range(max(len(s) for s in said)):
        entries = [s[j] if j < len(s) else None for s in said]
        if all(e == entries[0] for e in entries):
            continue
        first = next(e for e in entries if e is not None)
        if first[0] == "param" and all(e is not None and e[0] == "param" and e[2] == first[2] for e in entries):
            name, shape, dtype = first[2]
            differ = [ranks[r] for r, e in enumerate(entries) if e[1] != entries[0][1]]
            params.append(f"{name} (shape {shape}, {dtype}): rank(s) {differ} differ from rank {ranks[0]}")
            continue
        views = "; ".join(f"rank {ranks[r]}: " + (_entry_text(e) if e is not None else "nothing")
                          for r, e in enumerate(entries))
        layouts.append(f"{first[2][0] if first[0] == 'layout' else 'a declaration'}: {views}")
    if layouts:
        raise ShardingShapeError(
            f"the ranks of mesh dim {dim} disagree about the layout of a ShardTensor whose sizes were given "
            f"per rank (sharding_shapes mapping or 'chunk'), so results would be wrong: " + " | ".join(layouts[:4])
            + ". Pass every rank the same sizes for every rank (e.g. from the store's part offsets), or use "
              "sharding_shapes='infer' (one all-gather of the local shapes)")
    raise ReplicaMismatchError(
        f"replicated parameter(s) differ across the ranks of mesh dim {dim}, so training would silently diverge "
        f"from one device: " + "; ".join(params) + ". Seed every rank alike before building the model, or call "
        "domainflow.sync_module(model, mesh) after building it (copies the first rank's values to the others)")


def _entry_text(e) -> str:
    kind, _, obj = e
    return obj[1] if kind == "layout" else f"parameter {obj[0]} of shape {obj[1]}"


def _dim_name(mesh, m: int) -> str:
    names = mesh.mesh_dim_names
    return f"'{names[m]}'" if names else str(m)


# --------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------
_OPS = {"sum": 1, "avg": 2, "max": 3, "min": 4, "product": 5}


def _layout_fingerprint(spec) -> int:
    ints = [len(spec.shape), *spec.shape]
    for p, s in zip(spec.placements, spec.sizes):
        if isinstance(p, Shard):
            ints += [1, p.dim, len(s), *s]
        elif isinstance(p, Partial):
            ints += [2, _OPS.get(p.reduce_op, 0)]
        else:
            ints.append(0)
    return _digest(repr(ints).encode())


def _layout_text(spec) -> str:
    parts = [f"Shard({p.dim}) sizes {list(s)}" if isinstance(p, Shard) else str(p)
             for p, s in zip(spec.placements, spec.sizes)]
    return f"global shape {tuple(spec.shape)}, " + ", ".join(parts)


def _digest(data: bytes) -> int:
    """A 63-bit non-negative int (so that -h never overflows int64)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


_BLOCK = 1 << 22


def param_fingerprint(t: torch.Tensor) -> int:
    """A 63-bit checksum of a tensor's bytes, dtype and shape: BLAKE2 of the bytes on the CPU; on an
    accelerator, computed there in blocks (sums mod 2^64 of position-weighted 32-bit words, which any
    reduction order gives alike), so the parameters never travel to the host."""
    x = t.detach().contiguous().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    raw = x.view(torch.uint8)
    if raw.device.type == "cpu":
        # a copy: .numpy() marks the storage it shares as never resizable, and FSDP2 frees and re-allocates
        # the storage its gathered parameters live in by resizing it
        digest = hashlib.blake2b(raw.clone().numpy().data, digest_size=8).hexdigest()
    else:
        digest = device_checksum(raw)
    return _digest(repr((str(t.dtype), tuple(t.shape), digest)).encode())


def device_checksum(raw: torch.Tensor) -> int:
    """Checksum of a 1-D uint8 tensor where it lives: position-weighted 32-bit words summed mod 2^64."""
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    acc = torch.zeros((), dtype=torch.int64, device=raw.device)
    for i in range(0, words.numel(), _BLOCK):
        w = words[i:i + _BLOCK].to(torch.int64)
        pos = torch.arange(i, i + w.numel(), dtype=torch.int64, device=raw.device)
        acc = acc + (w * (pos * 0x9E3779B1 + 0x7F4A7C15)).sum()
    return int(acc)


def _is_module(o) -> bool:
    try:
        return isinstance(o, torch.nn.Module)
    except ReferenceError:  # a weakref.proxy whose object is gone (torch.compile leaves some behind)
        return False


def _param_names(params: list[torch.Tensor]) -> dict[int, str]:
    """'Model.blocks.0.norm.weight'-style names of parameters (or buffers: domainflow.compile checks those), by
    ``id``, found (on the failure path only) among the live modules that hold them; the longest path from a module
    that is nobody's child. One scan of the live objects for all of them (a scan per parameter took 0.25 s each in a
    small test process)."""
    import gc
    import warnings

    if not params:
        return {}
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if _is_module(o)]
    # torch.compile's wrapper (OptimizedModule) holds the user's model as a child: name from the model
    modules = [m for m in modules if type(m).__name__ != "OptimizedModule"]
    children = {id(c) for m in modules for c in m.children()}
    wanted = {id(p): p for p in params}
    best: dict[int, tuple[str, str]] = {}
    for m in modules:
        if id(m) in children:
            continue
        for kind, named in (("parameter", m.named_parameters), ("buffer", m.named_buffers)):
            for name, p in named(remove_duplicate=False):
                if wanted.get(id(p)) is p and (id(p) not in best or len(name) > len(best[id(p)][1])):
                    best[id(p)] = (kind, f"{type(m).__name__}.{name}")
    return {i: (f"{best[i][0]} {best[i][1]!r}" if i in best else "a parameter") for i in wanted}


def sync_module(module: torch.nn.Module, mesh, buffers: bool = True) -> torch.nn.Module:
    """Copy the parameters (and buffers) of the mesh's first rank to every rank of ``mesh``, for models built
    with a per-rank seed: one broadcast per dtype and mesh dim (coalesced), from coordinate 0 along each dim.
    Pass the domain sub-mesh (``mesh["domain"]``) to sync within each domain group only. Returns ``module``."""
    mark_checked(module.parameters())  # a forward before syncing recorded them: their check is moot now
    tensors = [p for p in module.parameters()] + ([b for b in module.buffers()] if buffers else [])
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            for m in range(mesh.ndim):
                flat = comm.broadcast(flat, 0, mesh, m)
            i = 0
            for t in ts:
                t.copy_(flat[i:i + t.numel()].view_as(t))
                i += t.numel()
    return module


comm.set_check_runner(flush)
