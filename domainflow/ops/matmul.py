"""Matrix products (mm, addmm, bmm, baddbmm): rows/columns/batch sharded stay sharded; a sharded
contracted dim gives a Partial(sum) result that is reduced only when needed."""

from __future__ import annotations

from typing import NamedTuple

import torch

from domainflow.dispatch.param_grads import reduce_param_grads
from domainflow.dispatch.toolkit import Schema, common_mesh, layout_rule, local_exact, run_function_default, shard_tensors
from domainflow.dispatch.toolkit import unsupported_or_fallback
from domainflow.tensor.redistribute import grad_spec, redistribute_local
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.dispatch.registry import register_aten, register_function
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.layout.spec import ShardSpec

aten = torch.ops.aten
_R = Replicate()


def _spec_of(t, mesh) -> ShardSpec:
    if isinstance(t, ShardTensor):
        return t._spec
    return _replicated(mesh, t.shape)


@layout_rule
def _replicated(mesh, shape) -> ShardSpec:
    return ShardSpec(mesh, (_R,) * mesh.ndim, shape, (None,) * mesh.ndim)


def _local_in(t, spec: ShardSpec, dst: ShardSpec) -> torch.Tensor:
    local = t._local if isinstance(t, ShardTensor) else t
    return local if spec == dst else redistribute_local(local, spec, dst)


@layout_rule
def plan_contraction(a_spec: ShardSpec, b_spec: ShardSpec, nb: int):
    """Layouts for ``a[*B, M, K] @ b[*B, K, N]`` (nb batch dims). Returns (a_dst, b_dst, out spec); one
    plan per (layouts, nb), cached (specs are immutable and hashed once)."""
    mesh = a_spec.mesh
    # dim indices: a's M at nb, a's K at nb+1; b's K at nb, b's N at nb+1
    M = nb
    out_shape = list(a_spec.shape[:nb]) + [a_spec.shape[M], b_spec.shape[nb + 1]]
    a_pl, a_sz = list(a_spec.placements), list(a_spec.sizes)
    b_pl, b_sz = list(b_spec.placements), list(b_spec.sizes)
    o_pl, o_sz = [], []
    for m in range(mesh.ndim):
        _contract_mesh_dim(m, a_pl, a_sz, b_pl, b_sz, o_pl, o_sz, nb)
        # a tensor dim may be sharded by one mesh dim only: on a clash replicate this mesh dim
        if _clash(a_pl, m) or _clash(b_pl, m) or _clash(o_pl, m):
            a_pl[m] = b_pl[m] = o_pl[m] = _R
            a_sz[m] = b_sz[m] = o_sz[m] = None
    a_dst = ShardSpec.build(mesh, a_pl, a_spec.shape, a_sz)
    b_dst = ShardSpec.build(mesh, b_pl, b_spec.shape, b_sz)
    return a_dst, b_dst, ShardSpec(mesh, o_pl, out_shape, o_sz)


def _clash(placements, m) -> bool:
    """True when mesh dim ``m`` shards a tensor dim that another mesh dim already shards."""
    p = placements[m]
    return isinstance(p, Shard) and any(isinstance(q, Shard) and q.dim == p.dim
                                        for k, q in enumerate(placements) if k != m)


def _contract_mesh_dim(m, a_pl, a_sz, b_pl, b_sz, o_pl, o_sz, nb):
    """The contraction rule for one mesh dim (updates the operand targets, appends the output's)."""
    M, K = nb, nb + 1
    pa, pb = a_pl[m], b_pl[m]
    # pending partials: keep when the other side is replicated, else reduce
    if isinstance(pa, Partial) or isinstance(pb, Partial):
        if isinstance(pa, Partial) and pa.reduce_op == "sum" and pb == _R:
            o_pl.append(pa), o_sz.append(None)
            return
        if isinstance(pb, Partial) and pb.reduce_op == "sum" and pa == _R:
            o_pl.append(pb), o_sz.append(None)
            return
        if isinstance(pa, Partial):
            a_pl[m], a_sz[m], pa = _R, None, _R
        if isinstance(pb, Partial):
            b_pl[m], b_sz[m], pb = _R, None, _R
    da = pa.dim if isinstance(pa, Shard) else None
    db = pb.dim if isinstance(pb, Shard) else None
    if da is not None and da < nb:  # batch dim: b follows a
        b_pl[m], b_sz[m] = Shard(da), a_sz[m]
        o_pl.append(Shard(da)), o_sz.append(a_sz[m])
    elif db is not None and db < nb:
        a_pl[m], a_sz[m] = Shard(db), b_sz[m]
        o_pl.append(Shard(db)), o_sz.append(b_sz[m])
    elif da == K or db == nb:  # contracted dim sharded on either side: both sharded alike -> Partial
        sizes = a_sz[m] if da == K else b_sz[m]
        a_pl[m], a_sz[m] = Shard(K), sizes
        b_pl[m], b_sz[m] = Shard(nb), sizes
        o_pl.append(Partial("sum")), o_sz.append(None)
    elif da == M:
        b_pl[m], b_sz[m] = _R, None
        o_pl.append(Shard(nb)), o_sz.append(a_sz[m])
    elif db == nb + 1:
        a_pl[m], a_sz[m] = _R, None
        o_pl.append(Shard(nb + 1)), o_sz.append(b_sz[m])
    else:
        o_pl.append(_R), o_sz.append(None)


def _partial_rank_zero(spec: ShardSpec) -> bool:
    """True on the one rank that adds a replicated term to a Partial(sum) value."""
    coord = spec.coord
    return all(coord[m] == 0 for m, p in enumerate(spec.placements) if isinstance(p, Partial))


class _Contraction(NamedTuple):
    """A contraction's plan for given operand layouts: each operand's layout to compute in (None: as it is)
    and the output's layout."""

    a_dst: ShardSpec | None
    b_dst: ShardSpec | None
    out: ShardSpec


@layout_rule
def _contraction(a_spec: ShardSpec, b_spec: ShardSpec, nb: int) -> _Contraction:
    a_dst, b_dst, out = plan_contraction(a_spec, b_spec, nb)
    return _Contraction(None if a_dst == a_spec else a_dst, None if b_dst == b_spec else b_dst, out)


def _local_at(t, spec: ShardSpec, dst: ShardSpec | None) -> torch.Tensor:
    """``t``'s local tensor, redistributed from ``spec`` to ``dst`` unless that is None."""
    local = t._local if isinstance(t, ShardTensor) else t
    return local if dst is None else redistribute_local(local, spec, dst)


def _contract(func, a, b, nb, bias=None, beta=1, alpha=1):
    a_sharded, b_sharded = isinstance(a, ShardTensor), isinstance(b, ShardTensor)
    if (a_sharded and b_sharded) or bias is not None:
        mesh = common_mesh(shard_tensors([a, b] + ([bias] if bias is not None else [])), func)
    else:
        mesh = (a if a_sharded else b)._spec.mesh
    a_spec, b_spec = _spec_of(a, mesh), _spec_of(b, mesh)
    plan = _contraction(a_spec, b_spec, nb)
    out = plan.out
    la, lb = _local_at(a, a_spec, plan.a_dst), _local_at(b, b_spec, plan.b_dst)
    local = torch.matmul(la, lb)
    if bias is None and alpha == 1 and plan.a_dst is None and plan.b_dst is None and la.ndim == lb.ndim == 2 + nb:
        local_exact()  # torch.mm/bmm itself on the chunks (matmul here also takes what they refuse)
    if alpha != 1:
        local = local * alpha
    if bias is not None and beta != 0:
        # bias laid out like the product (sliced locally), counted once for Partial results
        bias_spec = _spec_of(bias, mesh)
        if bias_spec.has_partial:
            return unsupported_or_fallback(func, (bias, a, b), {}, "Partial bias")
        full_out = out.reduced()
        b_local = _bias_local(bias, bias_spec, full_out)
        if _partial_rank_zero(out):
            local = local + (b_local * beta if beta != 1 else b_local)
    return ShardTensor.from_spec(local, out)


def _bias_local(bias, bias_spec: ShardSpec, out: ShardSpec) -> torch.Tensor:
    """This rank's part of ``bias`` broadcast against an output laid out as ``out``."""
    off = out.ndim - len(bias_spec.shape)
    pl, sz = [], []
    for m, p in enumerate(out.placements):
        if isinstance(p, Shard) and p.dim - off >= 0 and bias_spec.shape[p.dim - off] == out.shape[p.dim] != 1:
            pl.append(Shard(p.dim - off)), sz.append(out.sizes[m])
        else:
            pl.append(_R), sz.append(None)
    dst = ShardSpec.build(out.mesh, pl, bias_spec.shape, sz)
    return _local_in(bias, bias_spec, dst)


@register_aten(aten.mm.default)
def mm(func, args, kwargs):
    return _contract(func, args[0], args[1], 0)


@register_aten(aten.bmm.default)
def bmm(func, args, kwargs):
    return _contract(func, args[0], args[1], 1)


@register_aten(aten.addmm.default, aten.baddbmm.default)
def addmm(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    return _contract(func, a, b, 1 if func is aten.baddbmm.default else 0, bias=bias, beta=beta, alpha=alpha)


@register_aten(aten.dot.default, aten.mv.default)
def dot_mv(func, args, kwargs):
    a, b = args
    if func is aten.dot.default:
        out = mm(aten.mm.default, (a.unsqueeze(0), b.unsqueeze(1)), {})
        return out.reshape(())
    return mm(aten.mm.default, (a, b.unsqueeze(1)), {}).squeeze(1)


# --------------------------------------------------------------------------------------------
# above autograd: F.linear on points/cells sharded along any leading dims
# --------------------------------------------------------------------------------------------
class _LocalLinear(torch.autograd.Function):
    """``F.linear`` on each rank's rows with replicated weights. torch's own path folds leading dims
    into one (a reshape that a dim sharded inside [B, N, C] cannot survive); this runs on the local
    chunk instead. Backward: input gradient local; weight and bias gradients summed over the sharded
    mesh dims in one collective, so plain parameters get the single-device gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        spec = x._spec
        local = x._local
        ctx.save_for_backward(local, weight)
        # the parameters themselves (saved tensors may come back as other objects, e.g. recomputed under
        # activation checkpointing), for the deferred gradient sums that are keyed by parameter
        ctx.spec, ctx.has_bias, ctx.params = spec, bias is not None, (weight, bias)
        out = torch.nn.functional.linear(local, weight, bias)
        return ShardTensor.from_spec(out, _linear_specs(spec, weight.shape[0])[0])

    @staticmethod
    def backward(ctx, grad):
        local, weight = ctx.saved_tensors
        spec = ctx.spec
        # a pending sum of gradients over a mesh dim the input is replicated on (e.g. tokens a contraction
        # over the sharded points made) stays pending: every gradient here is linear in it, so the input's
        # gradient stays Partial and the parameters' join their sum over the sharded dims
        out_spec, gx_spec, mesh_dims = _linear_backward_plan(
            spec, weight.shape[0], grad._spec if isinstance(grad, ShardTensor) and grad._spec.has_partial else None)
        g = _local_in(grad, grad._spec, out_spec) if isinstance(grad, ShardTensor) else grad
        # under autocast the forward ran in a lower precision: compute in the gradient's dtype, as torch's
        # own linear backward does, and hand each gradient back in its input's dtype
        cd = g.dtype
        gx = (g @ weight.to(cd)).to(local.dtype)
        g2, x2 = g.reshape(-1, g.shape[-1]), local.reshape(-1, local.shape[-1]).to(cd)
        gw = (g2.t() @ x2).to(weight.dtype)
        gb = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        # summed over the domain now, or once per backward for the whole model (deferred_param_grads)
        gw, gb = reduce_param_grads(ctx.params, (gw, gb), spec.mesh, mesh_dims)
        return ShardTensor.from_spec(gx, gx_spec), gw, gb


@layout_rule
def _linear_specs(spec: ShardSpec, out_features: int):
    """Layouts of a local linear on input ``spec``: (output, output gradient, input gradient, the mesh dims
    the parameters' gradients are summed over), once per (input layout, width)."""
    out_spec = spec.with_(shape=tuple(spec.shape[:-1]) + (out_features,))
    gx_spec = grad_spec(spec)
    gout_spec = gx_spec.with_(shape=out_spec.shape)
    return out_spec, gout_spec, gx_spec, tuple(m for m, p in enumerate(spec.placements) if isinstance(p, Shard))


@layout_rule
def _linear_backward_plan(spec: ShardSpec, out_features: int, partial_grad: ShardSpec | None):
    """(the output gradient's wanted layout, the input gradient's layout, the mesh dims the parameters'
    gradients are summed over) for a local linear on input ``spec``; ``partial_grad``: the output gradient's
    layout when it holds pending sums. A pending sum over a mesh dim the input is replicated on stays pending
    in the input's gradient and joins the parameters' sum."""
    _, out_spec, gx_spec, mesh_dims = _linear_specs(spec, out_features)
    kept = () if partial_grad is None else tuple(
        m for m, p in enumerate(partial_grad.placements)
        if isinstance(p, Partial) and p.reduce_op == "sum" and spec.placements[m] == _R)
    if not kept:
        return out_spec, gx_spec, mesh_dims
    mesh_dims = tuple(m for m, p in enumerate(spec.placements) if isinstance(p, Shard) or m in kept)
    out_spec = out_spec.with_(placements=tuple(partial_grad.placements[m] if m in kept else p
                                                for m, p in enumerate(out_spec.placements)),
                              sizes=tuple(None if m in kept else s for m, s in enumerate(out_spec.sizes)))
    gx_spec = gx_spec.with_(placements=tuple(partial_grad.placements[m] if m in kept else p
                                              for m, p in enumerate(gx_spec.placements)))
    return out_spec, gx_spec, mesh_dims


_LINEAR_ARGS = Schema("self", "weight", "bias", bias=None)


def _linear_function(func, args, kwargs):
    if not kwargs and 2 <= len(args) <= 3:  # nn.Linear's own call: F.linear(input, weight, bias)
        x, weight, bias = args[0], args[1], args[2] if len(args) == 3 else None
    else:
        a = _LINEAR_ARGS.bind(args, kwargs)
        x, weight, bias = a["self"], a["weight"], a["bias"]
    plain = all(t is None or type(t) is not ShardTensor for t in (weight, bias))
    if (not isinstance(x, ShardTensor) or not plain or x.ndim < 2 or x._spec.has_partial
            or x._spec.mesh_dim_of(x.ndim - 1) is not None):
        return run_function_default(func, args, kwargs)
    local_exact()  # F.linear on the local rows with the plain parameters
    return _LocalLinear.apply(x, weight, bias)


register_function(torch.nn.functional.linear)(_linear_function)
