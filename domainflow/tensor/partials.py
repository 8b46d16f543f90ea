"""``reduce_partials``: finish several pending sums with one collective.

A reduction over a sharded dim leaves a ``Partial(sum)`` value that is all-reduced only when an op needs
it. When a model needs several such sums at once (Transolver's slice weights and weighted features, both
sums over the points), reducing them one by one costs one collective each; this helper reduces them
together, one coalesced all-reduce per mesh dim. Gradients are exact: a Partial value's gradient is the
replicated gradient of its sum.
"""

from __future__ import annotations

import torch

from domainflow import comm
from domainflow.layout.placements import Partial, Replicate
from domainflow.tensor.redistribute import grad_spec
from domainflow.tensor.shard_tensor import ShardTensor


class _ReduceTogether(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mesh_dims, *xs):
        specs = [x._spec for x in xs]
        ctx.specs = specs
        locals_ = [x._local.contiguous() for x in xs]
        for m in mesh_dims:
            idx = [k for k, s in enumerate(specs) if isinstance(s.placements[m], Partial)]
            reduced = comm.all_reduce_coalesced([locals_[k] for k in idx], "sum", specs[0].mesh, m)
            for k, t in zip(idx, reduced):
                locals_[k] = t
        return tuple(ShardTensor.from_spec(t, grad_spec(s)) for t, s in zip(locals_, specs))

    @staticmethod
    def backward(ctx, *grads):
        # gradients that arrive as pending sums (their consumers were linear in them) are finished together,
        # one coalesced all-reduce per mesh dim, as the forward did; anything else is redistributed alone
        grads = list(grads)
        mesh = ctx.specs[0].mesh
        for m in range(mesh.ndim):
            idx = [k for k, g in enumerate(grads) if isinstance(g, ShardTensor)
                   and isinstance(g._spec.placements[m], Partial) and g._spec.placements[m].reduce_op == "sum"]
            if not idx:
                continue
            reduced = comm.all_reduce_coalesced([grads[k]._local.contiguous() for k in idx], "sum", mesh, m)
            for k, t in zip(idx, reduced):
                g = grads[k]
                grads[k] = ShardTensor.from_spec(t, g._spec.with_(placements=tuple(
                    Replicate() if j == m else p for j, p in enumerate(g._spec.placements))))
        out = []
        for g, s in zip(grads, ctx.specs):
            gs = grad_spec(s)
            if isinstance(g, ShardTensor):
                g = g.redistribute(list(gs.placements)) if g._spec.placements != gs.placements else g
                out.append(ShardTensor.from_spec(g._local, gs))
            else:
                out.append(ShardTensor.from_spec(g, gs))
        return (None, *out)


def reduce_partials(*xs):
    """Replicated values of ``xs`` (ShardTensors, some pending ``Partial(sum)``), with one coalesced
    all-reduce per mesh dim for all of them. Other inputs are returned as they are."""
    todo = [k for k, x in enumerate(xs) if isinstance(x, ShardTensor) and x._spec.has_partial]
    if not todo:
        return xs
    bad = [xs[k]._spec.placements for k in todo
           if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in xs[k]._spec.placements)]
    if bad:
        raise ValueError(f"reduce_partials handles pending sums only, got placements {bad}; use .redistribute()")
    mesh = xs[todo[0]]._spec.mesh
    if any(xs[k]._spec.mesh != mesh for k in todo):
        raise ValueError("reduce_partials needs all pending values on one device mesh")
    mesh_dims = sorted({m for k in todo for m, p in enumerate(xs[k]._spec.placements) if isinstance(p, Partial)})
    reduced = _ReduceTogether.apply(tuple(mesh_dims), *[xs[k] for k in todo])
    out = list(xs)
    for k, r in zip(todo, reduced):
        out[k] = r
    return tuple(out)



# torch.compile: a node of the graph, not code for Dynamo to inline (it would trace into ShardTensor's
# constructor and break the graph): Dynamo runs it on fake ShardTensors, AOTAutograd traces it through the
# engine, whose all-reduce is then a functional collective (``comm.traced``). (issue 40).
torch._dynamo.allow_in_graph(reduce_partials)
