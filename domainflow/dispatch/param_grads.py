"""Gradients of replicated parameters used with sharded activations: summed over the domain exactly once.

A layer applied to a sharded input gives each rank a partial gradient for its (replicated) parameters.
By default each layer's backward sums them right away, in one coalesced all-reduce per sharded mesh dim,
so every ``.grad`` (and ``torch.autograd.grad``) is the single-device gradient as soon as it exists.

Inside ``deferred_param_grads()`` the sums wait for the end of ``loss.backward()`` and go out together,
one coalesced all-reduce per mesh dim for the whole model, like DDP's gradient buckets: a training step
then has one synchronisation point for all parameters instead of one per layer. Use it around
``loss.backward()`` (not ``torch.autograd.grad``, whose results are returned before the final sum).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.autograd.graph import get_gradient_edge

from domainflow.layout.spec import mesh_shape

class _State:
    """Process-wide, not per thread: on accelerators autograd runs backward functions and hooks on its own
    device threads, which must see the mode and queues that the thread calling ``backward()`` set up."""

    def __init__(self):
        self.on = False
        self.queues: dict = {}  # graph task id -> {(mesh, mesh dims): (mesh, {id(param): (param, grad)})}
        self.lock = threading.Lock()


_state = _State()


@contextlib.contextmanager
def deferred_param_grads():
    """Sum replicated parameters' partial gradients once per backward, for all layers together."""
    previous = _state.on
    _state.on = True
    try:
        yield
    finally:
        _state.on = previous


def deferring() -> bool:
    """True inside ``deferred_param_grads()``."""
    return _state.on


def accumulates_into_grad(leaf) -> bool:
    """True when the running backward will add to ``leaf.grad`` (``backward()``, not ``torch.autograd.grad``,
    whose results are returned before the end-of-backward sum could reach them): only then may its sum wait."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(leaf).node)
    except RuntimeError:  # torch refuses the question for leaves inside autograd.grad
        return False


def multi_rank_dims(mesh, mesh_dims) -> tuple:
    """The mesh dims among ``mesh_dims`` with more than one rank: a sum over a mesh dim of one rank is the
    gradient itself (a domain of one rank, or a (dp, domain) mesh's dims of size 1), so autograd keeps it."""
    shape = mesh_shape(mesh)
    return tuple(m for m in mesh_dims if shape[m] > 1)


def defer_grad(param, partial_grad, mesh, mesh_dims) -> None:
    """Queue a leaf's partial gradient for the end-of-backward sum over ``mesh_dims`` (added to ``.grad``);
    ``mesh_dims`` of more than one rank (:func:`multi_rank_dims`)."""
    _queue(mesh, tuple(mesh_dims), [(param, partial_grad)])


def reduce_param_grads(params, grads, mesh, mesh_dims):
    """Gradients to return from a layer's backward for ``params``: summed now (default), or queued for
    the end of the backward pass (``deferred_param_grads``; then None is returned for them)."""
    from domainflow import comm

    grads = [g if p is None or p.requires_grad else None for p, g in zip(params, grads)]  # frozen: no grad
    idx = [k for k, (p, g) in enumerate(zip(params, grads)) if p is not None and g is not None]
    if not idx or not mesh_dims:
        return list(grads)
    mesh_dims = multi_rank_dims(mesh, mesh_dims)
    if not mesh_dims:
        return list(grads)
    if _state.on:
        # a derived weight's gradient must flow on, and autograd.grad returns before the end: sum those now
        leaves = [k for k in idx if params[k].is_leaf and accumulates_into_grad(params[k])]
        _queue(mesh, tuple(mesh_dims), [(params[k], grads[k]) for k in leaves])
        out = list(grads)
        for k in leaves:
            out[k] = None
        idx = [k for k in idx if k not in leaves]
        if not idx:
            return out
        grads = out
    parts = [grads[k].contiguous() for k in idx]
    for m in mesh_dims:
        parts = comm.all_reduce_coalesced(parts, "sum", mesh, m)
    out = list(grads)
    for k, g in zip(idx, parts):
        out[k] = g
    return out


def _queue(mesh, mesh_dims, pairs):
    # one queue per running backward (graph task): a checkpointed block's recomputation may run its
    # backward as a task of its own, whose end flushes what it queued
    task = torch._C._current_graph_task_id()
    with _state.lock:
        pending = _state.queues.get(task)
        if pending is None:
            pending = _state.queues[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _flush(task))
        # by value: equal meshes are one group (cached layouts may carry an equal mesh made earlier)
        group = pending.setdefault((mesh, mesh_dims), (mesh, {}))[1]
        for p, g in pairs:  # insertion order is the backward order: the same on every rank
            key = id(p)
            if key in group:
                group[key] = (p, group[key][1] + g)
            else:
                group[key] = (p, g)


def _check_alive(params) -> None:
    """Before the end-of-backward sum: every parameter still holds its memory. FSDP2 (``fully_shard``)
    reduce-scatters each gradient and frees the gathered parameter before this sum would run; writing to it
    would crash. The same on every rank, so all raise before the collective."""
    freed = [tuple(p.shape) for p in params if p.numel() and p.untyped_storage().nbytes() == 0]
    if freed:
        raise RuntimeError(f"deferred_param_grads(): {len(freed)} parameter(s) (shapes {freed[:4]}) were freed "
                           f"before the end of backward, as FSDP2's fully_shard does after reducing their "
                           f"gradients; call loss.backward() outside deferred_param_grads() with FSDP2 (each "
                           f"layer's gradient is then summed over the domain before FSDP2 reduces it)")


def _flush(task):
    """End of backward: one coalesced all-reduce per (mesh, mesh dim) for every queued gradient."""
    from domainflow import comm

    with _state.lock:
        pending = _state.queues.pop(task, None)
    if not pending:
        return
    for (_, mesh_dims), (mesh, group) in pending.items():
        params = [p for p, _ in group.values()]
        _check_alive(params)
        parts = [g.contiguous() for _, g in group.values()]
        for m in mesh_dims:
            parts = comm.all_reduce_coalesced(parts, "sum", mesh, m)
        with torch.no_grad():
            for p, g in zip(params, parts):
                g = g.to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
