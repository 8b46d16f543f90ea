"""What every part of the collective layer shares: the pending cross-rank checks, ``stats``, naming a
failed collective (and, after a timeout, which peers stalled), groups, devices and sizes."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from domainflow.errors import CollectiveError, CompileUnsupportedError
from domainflow.layout.spec import mesh_shape


# Checks that must run before the next collective (cross-rank layout and parameter checks,
# domainflow.tensor.consistency). That layer files them here and installs their runner; this layer never
# imports it. ``pending_checks`` is truthy while one waits, so a collective pays one dict test.
pending_checks: dict = {}
_run_checks = None


def set_check_runner(run) -> None:
    """Install ``run(before: str)``, called before a collective while ``pending_checks`` is non-empty."""
    global _run_checks
    _run_checks = run


_compiling = torch.compiler.is_compiling


def refuse_compiling(what: str) -> None:
    """While torch.compile traces, raise :class:`CompileUnsupportedError` naming ``what``: every eager exchange
    passes here first (the pairing round of each collective, point-to-point exchanges, scatters, headers), so
    an exchange that ``comm.traced`` does not record as a functional collective fails by name instead of
    running on fake tensors or tracing something else."""
    if _compiling():
        raise CompileUnsupportedError(what)


# Set (per thread) while domainflow.compile's wrapper calls its compiled function: Dynamo and AOTAutograd trace
# (and re-trace, on a recompile) inside that call, in this thread, so a trace that sees it unset was started
# by a raw torch.compile, whose graphs would run with no cross-rank check of parameters or declared layouts.
checked_compile = threading.local()
UNCHECKED_COMPILE = ("compile domain-parallel models with domainflow.compile(model), which checks parameters and "
                     "layouts across ranks before each call")


def refuse_unchecked_compile(what: str) -> None:
    """While torch.compile traces ``what`` (a ShardTensor input, a traced collective, a parameter meeting a
    ShardTensor) outside ``domainflow.compile``, raise :class:`CompileUnsupportedError` (one line)."""
    if _compiling() and not getattr(checked_compile, "on", False):
        raise CompileUnsupportedError(what, UNCHECKED_COMPILE)


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}


class CommStats:
    """Calls and payload bytes sent per collective kind, on this rank."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


stats = CommStats()


def _dim_name(mesh: DeviceMesh, mesh_dim: int) -> str:
    names = mesh.mesh_dim_names
    return f"'{names[mesh_dim]}'" if names else str(mesh_dim)


@contextlib.contextmanager
def _named(op: str, mesh: DeviceMesh | None, mesh_dim: int | None, detail: str = "", entered: float | None = None):
    """Turn a failed collective into a CollectiveError naming it; ``entered``: when this rank started the
    op (default: now), for telling after a timeout which ranks came late."""
    refuse_compiling(f"{op}{detail}")  # (before the try: never turned into a CollectiveError)
    entered = time.time() if entered is None else entered
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        raise collective_error(e, op, mesh, mesh_dim, detail, entered) from e


def collective_error(e: RuntimeError, op: str, mesh: DeviceMesh | None, mesh_dim: int | None, detail: str = "",
                     entered: float | None = None, transport_only: bool = False) -> CollectiveError | None:
    """The CollectiveError naming collective ``op`` (over ``mesh_dim`` of ``mesh``; None: the whole mesh) that
    failed with ``e``, with the likely cause (after a timeout or a closed connection: where the peers wait, see
    _stall_report). ``transport_only``: None unless ``e`` is such a transport failure (the rank's own errors stay
    as they are)."""
    timed_out = "imeout" in str(e) or "imed out" in str(e)
    # Gloo closes its connections when one end times out: the peer then fails with "Connection closed by
    # peer", often before its own timeout, and reports where it waits too (else it would look silent)
    peer_closed = "closed by peer" in str(e) or "Connection reset" in str(e)
    if transport_only and not (timed_out or peer_closed):
        return None
    entered = time.time() if entered is None else entered
    rank = dist.get_rank() if dist.is_initialized() else 0
    if mesh is None:
        where = ""
    elif mesh_dim is None:
        where = f" on mesh {tuple(mesh.shape)}"
    else:
        where = f" over mesh dim {_dim_name(mesh, mesh_dim)} of mesh {tuple(mesh.shape)}"
    if timed_out:
        hint = ("another rank did not enter the same collective (it failed earlier, took another code path, "
                "or passed a different shape)")
    elif peer_closed:
        hint = "a peer closed the connection: it timed out in a collective (see its error) or died"
    else:
        hint = "see the cause above"
    if timed_out or peer_closed:
        hint += _stall_report(f"{op}{where}", mesh, mesh_dim, entered)
    return CollectiveError(f"rank {rank}: {op}{where}{detail} failed: {e}\nLikely cause: {hint}.")


# how long a failed rank waits to hear where its peers failed (DOMAINFLOW_STALL_WAIT_S: raise it where ranks
# drift apart by more, e.g. on a busy machine, or a peer is called silent that was only late)
STALL_WAIT_S = 5.0
_STALL_REPORTS = 0


def _stall_wait() -> float:
    import os

    try:
        return float(os.environ.get("DOMAINFLOW_STALL_WAIT_S", STALL_WAIT_S))
    except ValueError:
        return STALL_WAIT_S


def _stall_report(what: str, mesh, mesh_dim, entered: float) -> str:
    """After a timeout or a closed connection: which peers wait in another collective, which reached theirs
    only after this rank had failed, and which never reported (the likely culprits: still computing, hung or
    dead). Each failed rank posts where it waits, and when it entered and failed, in the job's rendezvous
    store and reads its peers' posts for a few seconds; costs nothing until a collective fails."""
    import json

    failed = time.time()
    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        whole = mesh is None or mesh_dim is None
        peers = list(range(dist.get_world_size())) if whole else dim_ranks(mesh, mesh_dim)
        hit = None if whole else _EXCHANGES.get(id(_group(mesh, mesh_dim)))
        # ops (collectives and point-to-point exchanges) this rank ran on the group
        mine = {"op": what, "n": hit[1] + 1 if hit else 0, "entered": entered, "failed": failed}
        global _STALL_REPORTS
        key = f"domainflow/stalled/{_STALL_REPORTS}/{{}}"  # the n-th failure of each rank: a fresh set of keys
        _STALL_REPORTS += 1
        store.set(key.format(me), json.dumps(mine))
        wait = _stall_wait()
        posts, deadline = {}, time.monotonic() + wait
        while time.monotonic() < deadline and len(posts) < len(peers) - 1:
            for r in peers:
                if r != me and r not in posts and store.check([key.format(r)]):
                    posts[r] = json.loads(store.get(key.format(r)))
            time.sleep(0.05)
    except Exception:  # noqa: BLE001  (a diagnosis must never hide the error itself)
        return ""
    silent = [r for r in peers if r != me and r not in posts]
    late = [r for r, post in posts.items() if post["entered"] > failed]
    earlier = [r for r, post in posts.items() if post["failed"] < entered]
    elsewhere = {r: post for r, post in posts.items() if (post["op"], post["n"]) != (what, mine["n"])}
    out = ""
    if earlier:
        out += (f". This rank came late: rank(s) {earlier} had already failed in a collective when this rank "
                f"reached this one (this rank stalled in computation or I/O before it)")
    if late:
        out += (f". Likely culprit: rank(s) {late}, which reached a collective only after this rank had failed "
                f"(stalled in computation or I/O before it)")
    if silent:
        out += (f". Likely culprit: rank(s) {silent}, which had not failed in a collective {_stall_wait():g} s "
                f"after this rank did (stalled in computation or I/O, hung, dead, or finished without this "
                f"collective)")
    if elsewhere:
        out += (". The ranks ran different collectives (e.g. .item() of a pending value on some ranks only): "
                f"this rank waits in {what}, its op {mine['n']} on this mesh dim (collectives and exchanges); "
                + "; ".join(f"rank {r} in {post['op']}, its op {post['n']}" for r, post in elsewhere.items()))
    return out


# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(mesh: DeviceMesh, mesh_dim: int) -> int:
    return mesh_shape(mesh)[mesh_dim]


def _group(mesh: DeviceMesh, mesh_dim: int):
    """The process group of ``mesh_dim`` (cached: DeviceMesh.get_group costs microseconds on every call, and a
    collective asks for it several times)."""
    hit = _GROUPS.get((id(mesh), mesh_dim))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    group = mesh.get_group(mesh_dim)
    _GROUPS[(id(mesh), mesh_dim)] = (weakref.ref(mesh), group)
    return group


_GROUPS: dict = {}  # (id(mesh), mesh dim) -> (a weak reference to the mesh, its group): no mesh kept alive


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plain_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in an ordinary dense tensor: a conjugate or negative view resolved and torch's zero tensor
    (the zeros some gradient formulas return) made real, so that its bytes are its values."""
    t = t.detach()
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_conj().resolve_neg()


def wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a flat uint8 tensor (a view when it can be): what moves between ranks whenever nothing
    is computed on the way, so every dtype travels (int16, unsigned, complex, float8 and bool, which Gloo or
    NCCL lack) and arrives exact. :func:`from_wire` turns the bytes back."""
    flat = plain_values(t).contiguous().reshape(-1)
    if flat.stride(0) != 1:  # (a "contiguous" tensor of one element may have any stride)
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def wire_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A uint8 buffer to receive a ``shape``/``dtype`` tensor's :func:`wire_bytes` into."""
    return torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=device)


def from_wire(buf: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """The tensor whose :func:`wire_bytes` ``buf`` holds (a view of it)."""
    return buf.view(dtype).view(tuple(shape))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors for ``mesh`` live on (the current CUDA device under NCCL)."""
    return _device(mesh)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


def dim_ranks(mesh: DeviceMesh, mesh_dim: int) -> list[int]:
    """Global ranks along ``mesh_dim`` through this rank, in coordinate order."""
    return dist.get_process_group_ranks(_group(mesh, mesh_dim)) if dist.is_initialized() else [0]


_dim_ranks = dim_ranks
_EXCHANGES: dict = {}  # id(group) -> (group, number of the last op (collective or exchange) this rank started on it)
