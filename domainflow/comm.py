"""The collective layer: every byte domainflow moves between ranks goes through this module.

Functions take local tensors and a (mesh, mesh_dim) pair and work on Gloo and NCCL alike: uneven
all-gathers are padded to the largest part (Gloo has no uneven all-gather), all-to-alls move exact
byte counts. Failures are re-raised as :class:`CollectiveError` naming rank, op and mesh dim, so a
timed-out collective says who was waiting for what. ``stats`` counts calls and bytes moved, for
benchmarks and tests. Autograd wrappers for use inside handlers are at the bottom.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from domainflow.errors import CollectiveError
from domainflow.layout.spec import mesh_coordinate, mesh_shape

# Checks that must run before the next collective (cross-rank layout and parameter checks,
# domainflow.tensor.consistency). That layer files them here and installs their runner; this layer never
# imports it. ``pending_checks`` is truthy while one waits, so a collective pays one dict test.
pending_checks: dict = {}
_run_checks = None


def set_check_runner(run) -> None:
    """Install ``run(before: str)``, called before a collective while ``pending_checks`` is non-empty."""
    global _run_checks
    _run_checks = run


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
def _named(op: str, mesh: DeviceMesh | None, mesh_dim: int | None, detail: str = ""):
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = f" over mesh dim {_dim_name(mesh, mesh_dim)} of mesh {tuple(mesh.shape)}" if mesh is not None else ""
        timed_out = "imeout" in str(e) or "imed out" in str(e)
        hint = ("another rank did not enter the same collective (it failed earlier, took another code path, "
                "or passed a different shape)") if timed_out else "see the cause above"
        if timed_out:
            hint += _stall_report(f"{op}{where}", mesh, mesh_dim)
        raise CollectiveError(f"rank {rank}: {op}{where}{detail} failed: {e}\nLikely cause: {hint}.") from e


STALL_WAIT_S = 5.0  # how long a timed-out rank waits to hear which of its peers timed out too
_STALL_REPORTS = 0


def _stall_report(what: str, mesh, mesh_dim) -> str:
    """After a timeout: which peers are stuck elsewhere and which never reached a collective (the likely
    culprits: still computing, hung or dead). Each timed-out rank posts where it waits in the job's
    rendezvous store and reads its peers' posts for a few seconds; costs nothing until a timeout."""
    import json
    import time

    try:
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        peers = dim_ranks(mesh, mesh_dim) if mesh is not None else list(range(dist.get_world_size()))
        hit = _EXCHANGES.get(id(_group(mesh, mesh_dim))) if mesh is not None else None
        mine = {"op": what, "n": hit[1] + 1 if hit else 0}  # point-to-point ops this rank ran on the group
        global _STALL_REPORTS
        key = f"domainflow/stalled/{_STALL_REPORTS}/{{}}"  # the n-th timeout of each rank: a fresh set of keys
        _STALL_REPORTS += 1
        store.set(key.format(me), json.dumps(mine))
        posts, deadline = {}, time.monotonic() + STALL_WAIT_S
        while time.monotonic() < deadline and len(posts) < len(peers) - 1:
            for r in peers:
                if r != me and r not in posts and store.check([key.format(r)]):
                    posts[r] = json.loads(store.get(key.format(r)))
            time.sleep(0.05)
    except Exception:  # noqa: BLE001  (a diagnosis must never hide the error itself)
        return ""
    silent = [r for r in peers if r != me and r not in posts]
    elsewhere = {r: post for r, post in posts.items() if post != mine}
    out = ""
    if silent:
        out += (f". Likely culprit: rank(s) {silent}, which had not timed out in a collective {STALL_WAIT_S:g} s "
                f"after this rank did (stalled in computation or I/O, hung, dead, or finished without this "
                f"collective)")
    if elsewhere:
        out += (". The ranks ran different collectives (e.g. .item() of a pending value on some ranks only): "
                f"this rank waits in {what} after {mine['n']} point-to-point ops on this mesh dim; " + "; ".join(
                    f"rank {r} in {post['op']} after {post['n']}" for r, post in elsewhere.items()))
    return out


# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(mesh: DeviceMesh, mesh_dim: int) -> int:
    return mesh_shape(mesh)[mesh_dim]


def _group(mesh: DeviceMesh, mesh_dim: int):
    return mesh.get_group(mesh_dim)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# primitives on local tensors (no autograd)
# --------------------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, reduce_op: str, mesh: DeviceMesh, mesh_dim: int,
               what: tuple[str, str] | None = None, kind: str = "all_reduce") -> torch.Tensor:
    """Out-of-place all-reduce of ``t`` over one mesh dim (``avg`` done as sum / size for Gloo).
    Every rank gets the same bits. Small payloads on Gloo go by :func:`_reduce_by_exchange`. ``what``:
    (op, detail) to name in errors instead of "all_reduce(<op>)"; ``kind``: the ``stats`` key it counts under."""
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return t.clone()
    if pending_checks:
        _run_checks(f"all_reduce({reduce_op})")
    if _riders and reduce_op == "sum":
        riding = _take_riders(mesh, mesh_dim, t.dtype, t.device)
        if riding:
            return _all_reduce_with_riders(t, riding, mesh, mesh_dim)
    out = t.detach().clone(memory_format=torch.contiguous_format)
    stats.add(kind, _nbytes(out))
    bool_in = out.dtype == torch.bool
    if bool_in:
        out = out.to(torch.uint8)
    if _nbytes(out) * (n - 1) <= EXCHANGE_REDUCE_MAX_BYTES and _is_gloo(mesh, mesh_dim):
        out = _reduce_by_exchange(out, reduce_op, mesh, mesh_dim, what)
    else:
        nan = None
        if reduce_op in ("max", "min") and out.is_floating_point():
            nan = out.isnan()  # Gloo's MAX/MIN may drop a NaN from another rank; torch propagates it
            if bool(nan.any()):
                out = out.masked_fill(nan, 0)
            nan = nan.to(torch.uint8)
            with _named("all_reduce(max, NaN flags)", mesh, mesh_dim):
                dist.all_reduce(nan, op=dist.ReduceOp.MAX, group=_group(mesh, mesh_dim))
        op, detail = what or (f"all_reduce({reduce_op}) of {out.numel()} values", "")
        with _named(op, mesh, mesh_dim, detail):
            dist.all_reduce(out, op=_REDUCE_OPS[reduce_op], group=_group(mesh, mesh_dim))
        if nan is not None and bool(nan.any()):
            out = out.masked_fill(nan.bool(), float("nan"))
    if reduce_op == "avg":
        out = out / n if out.is_floating_point() or out.is_complex() else out // n
    return out.bool() if bool_in else out


# --------------------------------------------------------------------------------------------
# riders: small pending sums carried by the next all-reduce (a loss after backward)
# --------------------------------------------------------------------------------------------
class Rider:
    """A small pending sum (``local``, Partial(sum) over ``dims`` of ``mesh``) that the next sum all-reduce
    over each of those mesh dims carries along in its payload, so it costs no collective of its own;
    ``on_done(reduced)`` runs when every dim is reduced. See :func:`ride_along`."""

    __slots__ = ("local", "mesh", "dims", "on_done")

    def __init__(self, local, mesh, dims, on_done):
        self.local, self.mesh, self.dims, self.on_done = local, mesh, list(dims), on_done

    def reduced(self, value: torch.Tensor) -> None:
        self.local = value
        self.dims.pop(0)
        if not self.dims:
            self.on_done(value)


_riders: list[Rider] = []
_riders_lock = threading.Lock()  # backward may run on autograd's device threads


def ride_along(local: torch.Tensor, mesh: DeviceMesh, dims, on_done) -> Rider:
    """Queue ``local`` (a pending sum over mesh ``dims``) to travel with the next sum all-reduce of its dtype
    over each dim in turn; every rank must queue the same riders in the same order. :func:`land` finishes
    those no all-reduce carried."""
    rider = Rider(local.detach().contiguous(), mesh, [m for m in dims if group_size(mesh, m) > 1], on_done)
    if not rider.dims:
        on_done(rider.local)
        return rider
    with _riders_lock:
        _riders.append(rider)
    return rider


def land(riders, drop: bool = False) -> None:
    """Finish ``riders`` that no all-reduce carried, with one all-reduce per remaining mesh dim (or, with
    ``drop``, forget them: the backward they were waiting for failed)."""
    with _riders_lock:
        for r in riders:
            if r in _riders:
                _riders.remove(r)
    if drop:
        return
    for r in riders:
        while r.dims:
            r.reduced(all_reduce(r.local, "sum", r.mesh, r.dims[0]))


def _take_riders(mesh, mesh_dim, dtype, device) -> list[Rider]:
    group = _group(mesh, mesh_dim)
    with _riders_lock:
        riding = [r for r in _riders if r.local.dtype == dtype and r.local.device == device
                  and _group(r.mesh, r.dims[0]) is group]
        for r in riding:
            _riders.remove(r)
    return riding


def _all_reduce_with_riders(t, riding, mesh, mesh_dim) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1)] + [r.local.reshape(-1) for r in riding])
    red = all_reduce(flat, "sum", mesh, mesh_dim)
    out, i = red[:t.numel()].view(t.shape), t.numel()
    for r in riding:
        r.reduced(red[i:i + r.local.numel()].view(r.local.shape).clone())  # not a view keeping the payload
        i += r.local.numel()
        if r.dims:  # reduced over this dim; now waits for the next one's all-reduce
            with _riders_lock:
                _riders.append(r)
    return out


# Payload bytes a rank may send (tensor bytes x (peers)) for an all-reduce done as one point-to-point swap.
# Gloo's all_reduce of a small tensor took about 3 ms here (median, 2 CPU ranks; p90 4 ms) against 0.3 ms
# for a swap of the same bytes; normalisation layers need one per layer and direction (21 per step of the
# grid_scaling UNet). Larger payloads keep Gloo's bandwidth-optimal ring; NCCL always does.
EXCHANGE_REDUCE_MAX_BYTES = 1 << 20
_BACKENDS: dict = {}


def _is_gloo(mesh: DeviceMesh, mesh_dim: int) -> bool:
    group = _group(mesh, mesh_dim)
    hit = _BACKENDS.get(id(group))
    if hit is None or hit[0] is not group:
        hit = _BACKENDS[id(group)] = (group, str(dist.get_backend(group)) == "gloo")
    return hit[1]


_FOLD = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


def _reduce_by_exchange(out: torch.Tensor, reduce_op: str, mesh: DeviceMesh, mesh_dim: int,
                        what: tuple[str, str] | None = None) -> torch.Tensor:
    """All-reduce by sending ``out`` to every other rank of the mesh dim and folding the n parts in rank
    order, so every rank computes the same expression and gets the same bits; max/min propagate NaN."""
    n = group_size(mesh, mesh_dim)
    me = mesh_coordinate(mesh)[mesh_dim]
    peers = [k for k in range(n) if k != me]
    op, detail = what or (f"all_reduce({reduce_op}) of {out.numel()} values", "")
    got = _exchange({k: out for k in peers}, {k: out.shape for k in peers}, out, mesh, mesh_dim, op,
                    begin_exchange(mesh, mesh_dim, op), kind=None, detail=detail)
    fold = _FOLD[reduce_op]
    acc = out if me == 0 else got[0]
    for k in range(1, n):
        acc = fold(acc, out if k == me else got[k])
    return acc


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], reduce_op: str, mesh: DeviceMesh,
                         mesh_dim: int) -> list[torch.Tensor]:
    """One all-reduce for several tensors of one dtype (flattened into one buffer)."""
    if group_size(mesh, mesh_dim) == 1:
        return [t.clone() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    red = all_reduce(flat, reduce_op, mesh, mesh_dim)
    out, i = [], 0
    for t in tensors:
        out.append(red[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return out


def all_gather_uneven(t: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh,
                      mesh_dim: int) -> torch.Tensor:
    """Concatenate along ``dim`` the parts of every rank of one mesh dim; part k has ``sizes[k]`` rows.

    Parts are flattened and padded to the largest part so one ``all_gather_into_tensor`` works on
    Gloo and NCCL; when all parts are equal no padding copy is made.
    """
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return t
    if pending_checks:
        _run_checks("all_gather")
    shape = list(t.shape)
    row = math.prod(shape[:dim] + shape[dim + 1:])
    numels = [s * row for s in sizes]
    width = max(numels)
    flat = t.contiguous().view(-1)
    if flat.numel() != width:
        flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
    buf = flat.new_empty(n * width)
    stats.add("all_gather", _nbytes(flat))
    with _named("all_gather", mesh, mesh_dim, f" (uneven sizes {tuple(sizes)} along dim {dim})"):
        _all_gather_single(buf, flat, group=_group(mesh, mesh_dim))
    buf = buf.view(n, width)
    parts = [buf[k, : numels[k]].view(shape[:dim] + [sizes[k]] + shape[dim + 1:]) for k in range(n)]
    return torch.cat(parts, dim=dim)


def all_to_all_dims(t: torch.Tensor, split_dim: int, send_sizes: Sequence[int], cat_dim: int,
                    recv_shapes: Sequence[Sequence[int]], mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Split ``t`` along ``split_dim`` into ``send_sizes`` (one block per rank of the mesh dim), send
    block k to rank k, and concatenate the blocks received (shapes ``recv_shapes``) along ``cat_dim``.

    Covers Shard(i) -> Shard(j) and uneven -> uneven resharding of one dim; exact bytes, no padding.
    """
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return t
    if pending_checks:
        _run_checks("all_to_all")
    blocks = torch.split(t, list(send_sizes), dim=split_dim)
    send = torch.cat([b.reshape(-1) for b in blocks]) if t.numel() else t.new_empty(0)
    recv_numels = [math.prod(s) for s in recv_shapes]
    recv = t.new_empty(sum(recv_numels))
    stats.add("all_to_all", _nbytes(send))
    with _named("all_to_all", mesh, mesh_dim, f" (send {list(send_sizes)} along dim {split_dim})"):
        dist.all_to_all_single(recv, send, output_split_sizes=recv_numels,
                               input_split_sizes=[b.numel() for b in blocks], group=_group(mesh, mesh_dim))
    parts = torch.split(recv, recv_numels)
    return torch.cat([p.view(tuple(s)) for p, s in zip(parts, recv_shapes)], dim=cat_dim)


def broadcast(t: torch.Tensor, src_coord: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Broadcast ``t`` from coordinate ``src_coord`` of one mesh dim; every rank passes a tensor of the
    right shape (receivers' contents are ignored)."""
    if group_size(mesh, mesh_dim) == 1:
        return t
    if pending_checks:
        _run_checks("broadcast")
    out = t.detach().contiguous().clone()
    src = dist.get_global_rank(_group(mesh, mesh_dim), src_coord)
    stats.add("broadcast", _nbytes(out))
    with _named("broadcast", mesh, mesh_dim, f" from coordinate {src_coord}"):
        dist.broadcast(out, src=src, group=_group(mesh, mesh_dim))
    return out


def all_gather_object(obj, mesh: DeviceMesh, mesh_dim: int) -> list:
    """Gather a small picklable object from each rank of one mesh dim (for metadata only)."""
    n = group_size(mesh, mesh_dim)
    if n == 1:
        return [obj]
    if pending_checks:
        _run_checks("all_gather_object")
    out = [None] * n
    with _named("all_gather_object", mesh, mesh_dim):
        dist.all_gather_object(out, obj, group=_group(mesh, mesh_dim))
    return out


def all_gather_ints(values: Sequence[int], mesh: DeviceMesh) -> list[list[int]]:
    """Gather a short int vector from every rank of the whole mesh, in mesh (row-major) order."""
    ranks = mesh.mesh.flatten().tolist()
    if len(ranks) == 1:
        return [list(values)]
    if pending_checks:
        _run_checks("all_gather(shapes)")
    t = torch.tensor(list(values), dtype=torch.int64, device=_device(mesh))
    out = []
    # gather dim by dim: first over the last mesh dim, then outward, so any mesh shape works
    gathered = t.view(1, -1)
    for m in reversed(range(mesh.ndim)):
        n = group_size(mesh, m)
        flat = gathered.contiguous().view(-1)
        buf = flat.new_empty(n * flat.numel())
        with _named("all_gather(shapes)", mesh, m):
            _all_gather_single(buf, flat, group=_group(mesh, m))
        gathered = buf.view(-1, t.numel())
    for row in gathered.tolist():
        out.append([int(v) for v in row])
    return out


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors for ``mesh`` live on (the current CUDA device under NCCL)."""
    return _device(mesh)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


def send_header(header: torch.Tensor | None, length: int, src: int, mesh: DeviceMesh) -> torch.Tensor:
    """Global rank ``src`` sends a small int64 ``header`` (its length known to all: ``length``) to every other
    rank of ``mesh``, which receive it: metadata only the source knows (shapes, dtype, sizes)."""
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank() if dist.is_initialized() else 0
    if me == src:
        ops = [dist.P2POp(dist.isend, header, r) for r in ranks if r != me]
        with _named("header send", None, None, f" from rank {src} to ranks {ranks}"):
            for w in dist.batch_isend_irecv(ops) if ops else ():
                w.wait()
        return header
    out = torch.empty(length, dtype=torch.int64, device=_device(mesh))
    with _named("header receive", None, None, f" from rank {src}"):
        dist.recv(out, src=src)
    return out


def scatter_pieces(pieces: list[torch.Tensor] | None, recv_shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device, src: int, mesh: DeviceMesh) -> torch.Tensor:
    """Global rank ``src`` sends ``pieces[k]`` to the k-th rank of ``mesh`` (row-major); each rank
    receives only its own piece (point-to-point, not a broadcast of the whole tensor)."""
    ranks = mesh.mesh.flatten().tolist()
    me = dist.get_rank() if dist.is_initialized() else 0
    if pending_checks:
        _run_checks("scatter")
    if me == src:
        ops, mine = [], None
        for k, r in enumerate(ranks):
            piece = pieces[k].contiguous()
            if r == me:
                mine = piece
            elif piece.numel():
                stats.add("scatter", _nbytes(piece))
                ops.append(dist.P2POp(dist.isend, piece, r))
        with _named("scatter (send)", None, None, f" from rank {src} to ranks {ranks}"):
            for w in dist.batch_isend_irecv(ops) if ops else ():
                w.wait()
        if mine is None:
            raise ValueError(f"scatter source rank {src} is not in the mesh {ranks}")
        return mine.clone()  # never alias the caller's full tensor
    out = torch.empty(tuple(recv_shape), dtype=dtype, device=device)
    if out.numel():
        with _named("scatter (receive)", None, None, f" of shape {tuple(recv_shape)} from rank {src}"):
            dist.recv(out, src=src)
    return out


# --------------------------------------------------------------------------------------------
# autograd-aware wrappers, for handlers that work on local tensors
# --------------------------------------------------------------------------------------------
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, mesh, mesh_dim):
        ctx.mesh, ctx.mesh_dim = mesh, mesh_dim
        return all_reduce(t, "sum", mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        # y = sum_k x_k on every rank: dL/dx_k = sum over ranks of dL/dy_r
        return all_reduce(grad, "sum", ctx.mesh, ctx.mesh_dim), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, dim, sizes, mesh, mesh_dim):
        ctx.args = (dim, tuple(sizes), mesh, mesh_dim)
        return all_gather_uneven(t, dim, sizes, mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, mesh, mesh_dim = ctx.args
        k = mesh_coordinate(mesh)[mesh_dim]
        grad = all_reduce(grad, "sum", mesh, mesh_dim)
        return grad.narrow(dim, sum(sizes[:k]), sizes[k]), None, None, None, None


def all_reduce_sum_autograd(t: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Differentiable sum over a mesh dim (backward: sum of the output grads)."""
    return _AllReduceSum.apply(t, mesh, mesh_dim)


def all_gather_autograd(t: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int):
    """Differentiable uneven all-gather (backward: sum the grads, keep this rank's rows)."""
    return _AllGather.apply(t, dim, sizes, mesh, mesh_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, split_dim, send_sizes, cat_dim, recv_shapes, mesh, mesh_dim):
        ctx.args = (split_dim, tuple(send_sizes), cat_dim, [tuple(s) for s in recv_shapes], mesh, mesh_dim,
                    tuple(t.shape))
        return all_to_all_dims(t, split_dim, send_sizes, cat_dim, recv_shapes, mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        split_dim, send_sizes, cat_dim, recv_shapes, mesh, mesh_dim, in_shape = ctx.args
        # the reverse exchange: blocks go back to where they came from
        back_send = [s[cat_dim] for s in recv_shapes]
        back_recv = []
        for k in send_sizes:
            s = list(in_shape)
            s[split_dim] = k
            back_recv.append(s)
        g = all_to_all_dims(grad.contiguous(), cat_dim, back_send, split_dim, back_recv, mesh, mesh_dim)
        return g, None, None, None, None, None, None


def all_to_all_autograd(t: torch.Tensor, split_dim: int, send_sizes: Sequence[int], cat_dim: int,
                        recv_shapes: Sequence[Sequence[int]], mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Differentiable :func:`all_to_all_dims` (backward: the reverse exchange)."""
    return _AllToAll.apply(t, split_dim, send_sizes, cat_dim, recv_shapes, mesh, mesh_dim)


# --------------------------------------------------------------------------------------------
# halo exchange: neighbour point-to-point row fetches along one mesh dim
# --------------------------------------------------------------------------------------------
def dim_ranks(mesh: DeviceMesh, mesh_dim: int) -> list[int]:
    """Global ranks along ``mesh_dim`` through this rank, in coordinate order."""
    return dist.get_process_group_ranks(_group(mesh, mesh_dim)) if dist.is_initialized() else [0]


_dim_ranks = dim_ranks
_EXCHANGES: dict = {}  # id(group) -> (group, exchanges started on it by this rank)


def begin_exchange(mesh: DeviceMesh, mesh_dim: int, what: str = "exchange") -> int:
    """Start a point-to-point exchange op along a mesh dim; every rank of the dim calls it (also one that then
    has nothing to trade). Runs the pending cross-rank checks and returns the op's number on its group:
    every rank of a group runs the same ops in the same order, so the numbers agree, and a rank that runs one
    the others do not (``loss.item()`` on rank 0 only) gets numbers that no longer match (see :func:`_tag`)."""
    if pending_checks:
        _run_checks(what)
    group = _group(mesh, mesh_dim)
    hit = _EXCHANGES.get(id(group))
    n = 0 if hit is None or hit[0] is not group else hit[1] + 1
    _EXCHANGES[id(group)] = (group, n)
    return n


def _tag(seq: int, nbytes: int) -> int:
    """Point-to-point tag of a message: its exchange's number and its size. Messages of two different
    exchanges, or of disagreeing sizes, then never meet: they wait and time out with a CollectiveError
    naming the op, instead of Gloo aborting the process (a message larger than the receive buffer) or
    filling the buffer with another op's bytes."""
    return (seq * 1_000_003 + nbytes * 7919) % 0x7FFFFFFF


def _exchange(out_pieces: dict, in_shapes: dict, like: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
              what: str, seq: int, kind: str | None = "halo", detail: str = "") -> dict:
    """Send ``out_pieces[k]`` to the k-th rank along ``mesh_dim`` and receive ``in_shapes[k]``-shaped
    tensors from it, all at once (only with the ranks that have rows to trade: not a collective). ``seq`` is
    the op's :func:`begin_exchange` number. The bytes sent are counted in ``stats`` under ``kind`` (None: the
    caller counts them)."""
    return _exchange_wait(_exchange_start(out_pieces, in_shapes, like, mesh, mesh_dim, what, seq, kind, detail))


def _exchange_start(out_pieces: dict, in_shapes: dict, like: torch.Tensor, mesh: DeviceMesh, mesh_dim: int,
                    what: str, seq: int, kind: str | None = "halo", detail: str = ""):
    """Post the sends and receives of :func:`_exchange` and return at once; the caller does local work
    (copying its own rows) while the rows travel, then calls :func:`_exchange_wait`."""
    ranks = _dim_ranks(mesh, mesh_dim)
    ops, received = [], {}
    for k, piece in out_pieces.items():
        piece = piece.contiguous()
        if kind is not None:
            stats.add(kind, _nbytes(piece))
        ops.append(dist.P2POp(dist.isend, piece, ranks[k], tag=_tag(seq, _nbytes(piece))))
    for k, shape in in_shapes.items():
        received[k] = torch.empty(shape, dtype=like.dtype, device=like.device)
        ops.append(dist.P2POp(dist.irecv, received[k], ranks[k], tag=_tag(seq, _nbytes(received[k]))))
    detail = f" with ranks {sorted(ranks[k] for k in set(out_pieces) | set(in_shapes))}{detail}"
    works = []
    if ops:
        with _named(what, mesh, mesh_dim, detail):
            works = dist.batch_isend_irecv(ops)
    # the ops hold the (possibly temporary, made contiguous) pieces until the sends are waited on
    return works, received, (what, mesh, mesh_dim, detail), ops


def _exchange_wait(pending) -> dict:
    works, received, (what, mesh, mesh_dim, detail), _ops = pending
    if works:
        with _named(what, mesh, mesh_dim, detail):
            for w in works:
                w.wait()
    return received


def ring_shift(tensors: Sequence[torch.Tensor], recv_shapes, mesh: DeviceMesh, mesh_dim: int,
               what: str = "ring exchange") -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring along ``mesh_dim`` and receive ``recv_shapes``-shaped
    tensors (same dtypes) from the previous one (ring attention's K/V blocks). Every rank of the dim calls it."""
    seq = begin_exchange(mesh, mesh_dim, what)
    n = group_size(mesh, mesh_dim)
    me = mesh_coordinate(mesh)[mesh_dim]
    nxt, prv = (me + 1) % n, (me - 1) % n
    ranks = _dim_ranks(mesh, mesh_dim)
    ops, got = [], []
    for t in tensors:
        t = t.contiguous()
        stats.add("ring", _nbytes(t))
        ops.append(dist.P2POp(dist.isend, t, ranks[nxt], tag=_tag(seq, _nbytes(t))))
    for shape, ref in zip(recv_shapes, tensors):
        buf = torch.empty(shape, dtype=ref.dtype, device=ref.device)
        got.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, ranks[prv], tag=_tag(seq, _nbytes(buf))))
    detail = f" with ranks {sorted({ranks[nxt], ranks[prv]})}"
    with _named(what, mesh, mesh_dim, detail):
        works = dist.batch_isend_irecv(ops)
    _exchange_wait((works, None, (what, mesh, mesh_dim, detail), ops))
    return got


def _runs(positions, rows):
    """(pos, row, length) runs where consecutive positions take consecutive rows: copied as slices."""
    out = []
    for p, r in zip(positions, rows):
        if out and p == out[-1][0] + out[-1][2] and r == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([p, r, 1])
    return out


def _copy_rows(dst, dim, positions, src, rows):
    """dst[positions] = src[rows] along ``dim``, by slices where the indices run contiguously."""
    positions, rows = list(positions), list(rows)
    runs = _runs(positions, rows)
    if len(runs) <= 4:
        for p, r, n in runs:
            dst.narrow(dim, p, n).copy_(src.narrow(dim, r, n))
        return
    pi = torch.as_tensor(positions, dtype=torch.long, device=dst.device)
    ri = torch.as_tensor(rows, dtype=torch.long, device=src.device)
    dst.index_copy_(dim, pi, src.index_select(dim, ri))


def fetch_rows(local: torch.Tensor, dim: int, plan, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """The rows ``plan`` (a :class:`domainflow.layout.shapes.RowFetch`) asks for along ``dim``: own rows copied,
    other ranks' rows received from their owners, zero rows where asked. Not differentiable; see
    :func:`halo_exchange`."""
    pos, rows = plan.own
    seq = begin_exchange(mesh, mesh_dim, "halo exchange")
    if _keeps_block(plan, local.shape[dim]):
        return local  # nothing to fetch and nothing to pad: the block itself
    sends = {k: _select(local, dim, v) for k, v in plan.send.items()}
    shapes = {k: _with_len(local.shape, dim, len(v)) for k, v in plan.recv.items()}
    pending = _exchange_start(sends, shapes, local, mesh, mesh_dim, "halo exchange", seq)
    # every position is written once (own rows, received rows, zeros), so no zero-filled buffer first
    out = local.new_empty(_with_len(local.shape, dim, plan.length))
    if pos:
        _copy_rows(out, dim, pos, local, rows)
    zero = _unfilled(plan)
    if zero:
        _fill_zero(out, dim, zero)
    got = _exchange_wait(pending)
    for k, t in got.items():
        _copy_rows(out, dim, plan.recv[k], t, range(len(plan.recv[k])))
    return out


def _unfilled(plan) -> tuple[int, ...]:
    """Positions of a fetch that no own or received row fills (they are zero rows)."""
    filled = set(plan.own[0])
    for v in plan.recv.values():
        filled.update(v)
    return tuple(p for p in range(plan.length) if p not in filled)


def _fill_zero(out: torch.Tensor, dim: int, positions) -> None:
    runs = _runs(positions, positions)
    if len(runs) <= 4:
        for p, _, n in runs:
            out.narrow(dim, p, n).zero_()
    else:
        out.index_fill_(dim, torch.as_tensor(positions, dtype=torch.long, device=out.device), 0)


def _keeps_block(plan, n: int) -> bool:
    """True when a fetch asks for exactly this rank's own ``n`` rows, in order (nothing moves)."""
    pos, rows = plan.own
    return (not plan.recv and not plan.send and plan.length == n == len(pos)
            and list(pos) == list(range(n)) and list(rows) == list(range(n)))


def _with_len(shape, dim: int, n: int) -> list:
    out = list(shape)
    out[dim] = n
    return out


def _select(t: torch.Tensor, dim: int, rows) -> torch.Tensor:
    rows = list(rows)
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t.narrow(dim, rows[0], len(rows))
    return t.index_select(dim, torch.as_tensor(rows, dtype=torch.long, device=t.device))


def return_rows(grad: torch.Tensor, dim: int, local_shape, plan, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """The adjoint of :func:`fetch_rows`: each fetched row's gradient goes back to its owner and is added
    to the owner's row."""
    pos, rows = plan.own
    seq = begin_exchange(mesh, mesh_dim, "halo exchange (backward)")
    if _keeps_block(plan, local_shape[dim]):
        return grad
    back = {k: _select(grad, dim, v) for k, v in plan.recv.items()}
    shapes = {k: _with_len(local_shape, dim, len(v)) for k, v in plan.send.items()}
    pending = _exchange_start(back, shapes, grad, mesh, mesh_dim, "halo exchange (backward)", seq)
    if _covers_block(plan, local_shape[dim]):
        # the usual halo: the own rows are the whole block, in order, once: one copy, no zero fill first
        out = grad.narrow(dim, pos[0], len(pos)).clone(memory_format=torch.contiguous_format)
    else:
        out = grad.new_zeros(local_shape)
        if pos:
            _add_rows(out, dim, rows, grad, pos)
    got = _exchange_wait(pending)
    for k, t in got.items():
        _add_rows(out, dim, plan.send[k], t, range(len(plan.send[k])))
    return out


def _covers_block(plan, n: int) -> bool:
    """True when the fetch's own rows are the block's ``n`` rows in order, at consecutive positions."""
    pos, rows = plan.own
    return (len(pos) == n > 0 and list(rows) == list(range(n))
            and list(pos) == list(range(pos[0], pos[0] + n)))


def _add_rows(dst, dim, rows, src, positions):
    """dst[rows] += src[positions] along ``dim`` (repeated rows accumulate)."""
    rows, positions = list(rows), list(positions)
    if len(set(rows)) == len(rows) and len(_runs(rows, positions)) <= 4:
        for r, p, n in _runs(rows, positions):
            dst.narrow(dim, r, n).add_(src.narrow(dim, p, n))
        return
    ri = torch.as_tensor(rows, dtype=torch.long, device=dst.device)
    pi = torch.as_tensor(positions, dtype=torch.long, device=src.device)
    dst.index_add_(dim, ri, src.index_select(dim, pi))


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, dim, plan, mesh, mesh_dim):
        ctx.args = (dim, tuple(local.shape), plan, mesh, mesh_dim)
        return fetch_rows(local, dim, plan, mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        dim, shape, plan, mesh, mesh_dim = ctx.args
        return return_rows(grad.contiguous(), dim, shape, plan, mesh, mesh_dim), None, None, None, None


def halo_exchange(local: torch.Tensor, dim: int, sizes, wanted, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Differentiable row fetch along a sharded dim: rank r gets global rows ``wanted[r]`` (-1: zero row;
    any order, repeats allowed: halos, periodic wrap-around, reflection). Rows move point-to-point between
    the ranks that hold and want them (neighbours for a halo, further ranks when a neighbour holds fewer
    rows than the halo needs); the backward adds each row's gradient back on its owner."""
    from domainflow.layout.shapes import row_fetch_plan

    me = mesh_coordinate(mesh)[mesh_dim]
    plan = _fetch_plan(tuple(sizes), tuple(tuple(w) for w in wanted), me, row_fetch_plan)
    return _HaloExchange.apply(local, dim, plan, mesh, mesh_dim)


_PLANS: dict = {}


def _fetch_plan(sizes, wanted, me, make):
    key = (sizes, wanted, me)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 4096:
            _PLANS.clear()
        plan = _PLANS[key] = make(sizes, wanted, me)
    return plan


# --------------------------------------------------------------------------------------------
# index-driven row exchange: gathers and scatters by global row index along a sharded dim
# --------------------------------------------------------------------------------------------
class IndexPlan:
    """Who sends which rows for a gather (or, in reverse, a scatter) by global row index along one
    sharded dim, as seen by one rank.

    ``keys`` are the global rows this rank asks for, grouped by owner in rank order (sorted and
    distinct when deduplicated); ``inverse[i]`` is the key that request ``i`` uses; ``asked[k]`` counts
    the keys owned by rank k. ``serve_rows`` are the local rows this rank sends (grouped by requester)
    and ``serve_counts[k]`` how many of them go to rank k. Built once per index (one small all-to-all
    of counts and one of row ids), then reused for the data in both directions.
    """

    __slots__ = ("keys", "inverse", "order", "asked", "serve_rows", "serve_counts", "mesh", "mesh_dim")

    def __init__(self, keys, inverse, order, asked, serve_rows, serve_counts, mesh, mesh_dim):
        self.keys, self.inverse, self.order, self.asked = keys, inverse, order, tuple(asked)
        self.serve_rows, self.serve_counts = serve_rows, tuple(serve_counts)
        self.mesh, self.mesh_dim = mesh, mesh_dim

    @property
    def fetched(self) -> int:
        """Rows this rank receives from other ranks (its own rows are not counted)."""
        me = mesh_coordinate(self.mesh)[self.mesh_dim] if dist.is_initialized() else 0
        return sum(c for k, c in enumerate(self.asked) if k != me)


def index_plan(index: torch.Tensor, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int, *,
               dedupe: bool = True, what: str = "index") -> IndexPlan:
    """Plan the exchange that brings this rank the rows ``index`` (1-D, global row numbers along a dim
    whose rank k holds ``sizes[k]`` rows) names. ``dedupe`` asks for each distinct row once (gathers,
    sums); without it every entry travels on its own, in a stable order (max/min/mean/prod scatters,
    whose gradients must see each entry). Out-of-range rows raise ``IndexError`` on every rank."""
    n = group_size(mesh, mesh_dim)
    total = sum(sizes)
    index = index.reshape(-1).to(torch.long).contiguous()
    starts = torch.tensor([0, *_prefix(sizes)[:-1]], dtype=torch.long, device=index.device)
    order = None
    if dedupe:
        keys, inverse = torch.unique(index, sorted=True, return_inverse=True)
        owner = torch.searchsorted(starts, keys, right=True) - 1
    else:
        owner = torch.searchsorted(starts, index, right=True) - 1
        order = torch.sort(owner, stable=True).indices
        keys, owner = index[order], owner[order]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
    bad = bool(keys.numel()) and (int(keys.min()) < 0 or int(keys.max()) >= total)
    asked = torch.bincount(owner.clamp(0, n - 1), minlength=n) if keys.numel() else index.new_zeros(n)
    # counts and an "out of range" flag travel together, so a bad index fails on every rank at once
    send = torch.stack([asked, asked.new_full((n,), int(bad))], dim=1)
    got = all_to_all_dims(send, 0, [1] * n, 0, [(1, 2)] * n, mesh, mesh_dim)
    if bool(got[:, 1].any()):
        culprits = [k for k in range(n) if int(got[k, 1])]
        raise IndexError(f"{what}: an index is out of range for a dim of {total} rows (sharded over "
                         f"{n} ranks; bad indices on coordinate(s) {culprits} of mesh dim "
                         f"{_dim_name(mesh, mesh_dim)}); valid rows are 0..{total - 1}")
    asked_l = [int(c) for c in asked]
    serve_counts = [int(c) for c in got[:, 0]]
    me = mesh_coordinate(mesh)[mesh_dim] if dist.is_initialized() else 0
    wanted = all_to_all_dims(keys, 0, asked_l, 0, [(c,) for c in serve_counts], mesh, mesh_dim)
    return IndexPlan(keys, inverse, order, asked_l, wanted - int(starts[me]), serve_counts, mesh, mesh_dim)


def _prefix(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        acc += int(s)
        out.append(acc)
    return out


def gather_indexed(local: torch.Tensor, plan: IndexPlan) -> torch.Tensor:
    """Rows ``plan`` asked for, one per request, from ``local`` (this rank's rows along dim 0) and the
    other ranks'. Differentiable: the backward adds each request's gradient back to the owning row."""
    row = tuple(local.shape[1:])
    served = local.index_select(0, plan.serve_rows)
    rows = all_to_all_autograd(served, 0, plan.serve_counts, 0, [(c, *row) for c in plan.asked],
                               plan.mesh, plan.mesh_dim)
    return rows.index_select(0, plan.inverse)


def route_to_owners(values: torch.Tensor, plan: IndexPlan) -> torch.Tensor:
    """The reverse trip of :func:`gather_indexed`: ``values[i]`` (one row per request) goes to the owner
    of row ``index[i]``; requests of one key are summed first when the plan is deduplicated. Returns the
    rows this rank receives, aligned with ``plan.serve_rows``. Differentiable (backward: a gather)."""
    row = tuple(values.shape[1:])
    if plan.order is not None:  # one key per request: a permutation
        per_key = values.index_select(0, plan.order)
    else:
        per_key = values.new_zeros((plan.keys.numel(), *row)).index_add(0, plan.inverse, values)
    return all_to_all_autograd(per_key, 0, plan.asked, 0, [(c, *row) for c in plan.serve_counts],
                               plan.mesh, plan.mesh_dim)


class _SumToReplicated(torch.autograd.Function):
    """All-reduce sum whose result is a replicated output (every rank holds the same value and receives
    the same, full gradient for it): the backward passes that gradient through unchanged. (For a sum that
    each rank then uses with its own rows, as in softmax, the gradients are partial and must be summed:
    :func:`all_reduce_sum_autograd`.)"""

    @staticmethod
    def forward(ctx, t, mesh, mesh_dim):
        return all_reduce(t.contiguous(), "sum", mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def all_reduce_to_replicated(t: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Differentiable sum over ``mesh_dim`` of a value every rank then holds whole (see _SumToReplicated)."""
    return _SumToReplicated.apply(t, mesh, mesh_dim)
