"""``F.scaled_dot_product_attention`` with the sequence dim sharded.

- Queries, keys and values all sharded on the sequence dim (over the same mesh dim, sizes may differ and be
  uneven): ring attention. K/V blocks travel around the ring; each rank folds every block into its output
  with the online log-sum-exp update, so no rank ever holds the full K/V. The backward is a second ring
  pass: K/V blocks travel again together with their accumulating gradients, which arrive home complete.
- Sharded queries, replicated K/V: local attention; K/V gradients are summed over the ranks.
- Replicated queries, sharded K/V (Perceiver / Transolver pattern): each rank attends to its block and the
  partial results combine through one max and one sum all-reduce of the log-sum-exp weights.
SDPA called from inside another functional (``nn.MultiheadAttention``) reaches the aten op, which has
ring handlers too (forward and backward, the log-sum-exp output carrying the ring's statistics).
Causal masks use global positions; a full (.., Lq, Lk) ``attn_mask`` (boolean or additive, every rank
holding it) is sliced per block; grouped-query attention (fewer K/V heads) is supported. Dropout draws
each rank's own mask (statistically, not bitwise, like one device; with everything sharded the keys and
values are gathered for it, a warned relayout). A mask that needs gradients raises ``UnsupportedShardedOp``
(use ``fallback("gather")``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from domainflow import comm
from domainflow.dispatch.toolkit import Schema, layout_rule, run_function_default, run_replicated, shard_tensors, unsupported_or_fallback
from domainflow.layout.placements import Partial, Replicate, Shard
from domainflow.dispatch.registry import register_aten, register_function
from domainflow.tensor.shard_tensor import ShardTensor
from domainflow.layout.spec import ShardSpec
from domainflow.dispatch.toolkit import params_for, spec_from_sizes, spec_like, warn_relayout, without_partial


def _ring_exchange(tensors, recv_shapes, mesh, m):
    """Send ``tensors`` to the next rank of the ring along mesh dim ``m``, receive ``recv_shapes`` from the
    previous one."""
    return comm.ring_shift(tensors, recv_shapes, mesh, m, "ring attention exchange")


def _scores(q, kb, scale, causal, q0, k0, mask=None):
    s = (q @ kb.transpose(-2, -1)) * scale
    if mask is not None:  # the full (.., Lq, Lk) mask: this rank's rows, this block's columns
        blk = mask[..., q0:q0 + q.shape[-2], k0:k0 + kb.shape[-2]]
        s = s.masked_fill(~blk, float("-inf")) if blk.dtype == torch.bool else s + blk.to(s.dtype)
    if causal:
        qi = torch.arange(q0, q0 + q.shape[-2], device=q.device)[:, None]
        kj = torch.arange(k0, k0 + kb.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    return s


def _expand(t, groups):
    return t.repeat_interleave(groups, dim=-3) if groups > 1 else t


_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _flash_ok(q, kb, vb) -> bool:
    """Blocks go through torch's fused CPU flash kernel (tiled: no (Lq, Lk) score matrix in memory) when
    it applies; otherwise the plain math below (other devices, a value head size unlike the query's)."""
    return (q.device.type == "cpu" and q.ndim == 4 and q.dtype in _FLASH_DTYPES and q.shape[-1] == vb.shape[-1]
            and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _block_bias(q, kb, causal, q0, k0, mask):
    """(additive float mask or None, rows of this block with no allowed key or None, whole block masked)."""
    lq, lk = q.shape[-2], kb.shape[-2]
    if causal and k0 > q0 + lq - 1:
        return None, None, True
    bias, allowed = None, None
    if mask is not None:
        blk = mask[..., q0:q0 + lq, k0:k0 + lk]
        if blk.dtype == torch.bool:
            allowed = blk
            bias = torch.zeros(blk.shape, dtype=q.dtype, device=q.device).masked_fill(~blk, float("-inf"))
        else:
            bias = blk.to(q.dtype)
            allowed = torch.isfinite(bias)
    if causal and k0 + lk - 1 > q0:  # the diagonal crosses this block
        qi = torch.arange(q0, q0 + lq, device=q.device)[:, None]
        kj = torch.arange(k0, k0 + lk, device=q.device)[None, :]
        c = kj <= qi
        allowed = c if allowed is None else allowed & c
        cb = torch.zeros(c.shape, dtype=q.dtype, device=q.device).masked_fill(~c, float("-inf"))
        bias = cb if bias is None else bias + cb
    empty = None if allowed is None else ~allowed.any(-1, keepdim=True)
    return bias, empty, False


def _block_forward(q, ke, ve, scale, bias, empty):
    """Attention of ``q`` to one K/V block: (output, log-sum-exp (.., Lq, 1)); rows with no allowed key give
    (0, -inf) so they carry no weight when blocks are combined."""
    o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, False, attn_mask=bias, scale=scale)
    lse = lse.unsqueeze(-1)
    if empty is not None:
        empty = empty.expand(lse.shape)
        lse = lse.masked_fill(empty, float("-inf"))
        o = o.masked_fill(empty, 0.0)
    return o, lse


def _tied(x, *deps):
    """``x``, exactly, wired to ``deps`` in the graph (each adds the sum of an empty slice of itself: 0).
    Under torch.compile a block a rank skips (its queries or the block's keys empty, or causally masked) must
    still use what the ring brought and the gradient it got, as the ranks that compute it do: else AOTAutograd
    places that rank's ring shifts of the backward in the forward graph (they do not depend on the gradient
    there), and the ranks' graphs differ (see domainflow.compile's graph check)."""
    for d in deps:
        x = x + d.reshape(-1)[:0].sum().to(x.dtype)
    return x


def ring_forward(q, k, v, q_sizes, k_sizes, mesh, m, causal, scale, groups, mask=None):
    """This rank's attention output and log-sum-exp (.., Lq_local, 1), folding in every K/V block as it
    passes around the ring (online softmax)."""
    w = len(k_sizes)
    me = mesh.get_coordinate()[m]
    q0 = sum(q_sizes[:me])
    k_starts = [sum(k_sizes[:r]) for r in range(w)]
    shape = q.shape[:-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(*shape, v.shape[-1], dtype=acc)
    lse = q.new_full((*shape, 1), float("-inf"), dtype=acc)
    flash = _flash_ok(q, k, v)
    den = None if flash else q.new_zeros((*shape, 1), dtype=acc)
    kb, vb, src = k, v, me
    compiling = torch.compiler.is_compiling()
    for t in range(w):
        prev = (src - 1) % w
        used = False
        if kb.shape[-2] and q.shape[-2]:
            ke, ve = _expand(kb, groups), _expand(vb, groups)
            if flash:
                bias, empty, skip = _block_bias(q, kb, causal, q0, k_starts[src], mask)
                if not skip:
                    o_b, lse_b = _block_forward(q, ke, ve, scale, bias, empty)
                    new = torch.logaddexp(lse, lse_b.to(acc))
                    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
                    out = out * torch.exp(lse - safe) + o_b.to(acc) * torch.exp(lse_b.to(acc) - safe)
                    lse = new
                    used = True
            else:
                used = True  # out holds sum(exp(s - mx) v), den sum(exp(s - mx)), with lse as the running max mx
                s = _scores(q, ke, scale, causal, q0, k_starts[src], mask)
                new = torch.maximum(lse, s.amax(-1, keepdim=True).to(acc))
                shift = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
                p = torch.exp(s - shift)
                corr = torch.exp(lse - shift)
                den = den * corr + p.sum(-1, keepdim=True)
                out = out * corr + (p @ ve).to(acc)
                lse = new
                del s, p
        if compiling and not used:  # (the same graph on every rank)
            out = _tied(out, kb, vb)
        if t < w - 1:
            kb, vb = _ring_exchange([kb, vb], [_resized(kb, k_sizes[prev]), _resized(vb, k_sizes[prev])], mesh, m)
            src = prev
    if not flash:
        out = out / den
        shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        lse = shift + torch.log(den)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, q_sizes, k_sizes, mesh, m, causal, scale, groups, mask=None):
    """Gradients of q, k, v: the K/V blocks travel the ring again with their accumulating gradients, which
    arrive at their owner complete after the last hop."""
    w = len(k_sizes)
    me = mesh.get_coordinate()[m]
    q0 = sum(q_sizes[:me])
    k_starts = [sum(k_sizes[:r]) for r in range(w)]
    dout = dout.contiguous()
    flash = _flash_ok(q, k, v)
    # rows with no allowed key anywhere: +inf makes every exp(s - lse) vanish (their gradient is zero)
    lse_bw = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    delta = None if flash else (dout * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    kb, vb, dkb, dvb, src = k, v, torch.zeros_like(k), torch.zeros_like(v), me
    compiling = torch.compiler.is_compiling()
    for t in range(w):
        dk = dv = None
        if kb.shape[-2] and q.shape[-2]:
            ke, ve = _expand(kb, groups), _expand(vb, groups)
            if flash:
                bias, _, skip = _block_bias(q, kb, causal, q0, k_starts[src], mask)
                if not skip:
                    g = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        dout, q, ke, ve, out, lse_bw.squeeze(-1).to(q.dtype if q.dtype != torch.bfloat16
                                                                      else torch.float32),
                        0.0, False, attn_mask=bias, scale=scale)
                    dq, dk, dv = dq + g[0], g[1], g[2]
            else:
                s = _scores(q, ke, scale, causal, q0, k_starts[src], mask)
                p = torch.exp(s - lse_bw)
                del s
                dv = p.transpose(-2, -1) @ dout
                ds = p * (dout @ ve.transpose(-2, -1) - delta)
                del p
                dq = dq + (ds @ ke) * scale
                dk = (ds.transpose(-2, -1) @ q) * scale
                del ds
            if dk is not None:
                if groups > 1:
                    dk = dk.unflatten(-3, (dk.shape[-3] // groups, groups)).sum(-3)
                    dv = dv.unflatten(-3, (dv.shape[-3] // groups, groups)).sum(-3)
                dkb, dvb = dkb + dk, dvb + dv
        if compiling and dk is None:  # a block skipped here: wired as where it is computed (see _tied)
            dq = _tied(dq, kb, vb)
            dkb, dvb = _tied(dkb, dout, q), _tied(dvb, dout)
        prev = (src - 1) % w
        n = k_sizes[prev]
        if t < w - 1:  # the block, with its gradients so far, moves on
            kb, vb, dkb, dvb = _ring_exchange([kb, vb, dkb, dvb], [_resized(x, n) for x in (kb, vb, dkb, dvb)],
                                              mesh, m)
        elif w > 1:  # last hop: only the finished gradients go home
            dkb, dvb = _ring_exchange([dkb, dvb], [_resized(dkb, n), _resized(dvb, n)], mesh, m)
        src = prev
    return dq, dkb, dvb


def _resized(t, n):
    shape = list(t.shape)
    shape[-2] = n
    return shape


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_sizes, k_sizes, mesh, m, causal, scale, groups, mask):
        out, lse = ring_forward(q, k, v, q_sizes, k_sizes, mesh, m, causal, scale, groups, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_sizes, k_sizes, mesh, m, causal, scale, groups, mask)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


# below autograd: the aten ops SDPA decomposes into when called from inside another functional
# (nn.MultiheadAttention); the log-sum-exp output carries the ring's statistics to the backward op
_aten = torch.ops.aten


@layout_rule
def _reshaped(spec: ShardSpec, shape: tuple) -> ShardSpec:
    """``spec`` with global shape ``shape`` (an output or gradient laid out like an operand, its last dim
    or its whole shape changed where no dim is sharded)."""
    return spec.with_(shape=shape)


def _ring_specs(q, k, v):
    """The mesh dim sharding the sequence of ``q``, ``k`` and ``v`` alike (ring attention), else None."""
    return _ring_layouts(q._spec, k._spec, v._spec)[0]


@layout_rule
def _ring_layouts(q_spec, k_spec, v_spec):
    """(the mesh dim sharding the sequence dim of all three alike, or None; the output's layout; the
    log-sum-exp's layout), once per operand layouts."""
    mq = _spec_seq_mesh_dim(q_spec, q_spec.ndim - 2)
    if mq is None or any(_spec_seq_mesh_dim(s, s.ndim - 2) != mq for s in (k_spec, v_spec)) or \
            any(s.placements != q_spec.placements for s in (k_spec, v_spec)) or q_spec.has_partial:
        return None, None, None
    lead = tuple(q_spec.shape[:-1])
    return mq, q_spec.with_(shape=lead + (v_spec.shape[-1],)), q_spec.with_(shape=lead)


_FLASH_CPU_ARGS = Schema("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale",
                         dropout_p=0.0, is_causal=False, attn_mask=None, scale=None)
_FLASH_CPU_BACKWARD_ARGS = Schema("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal",
                                  "attn_mask", "scale", attn_mask=None, scale=None)
_SDPA_ARGS = Schema("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
                    attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)


@register_aten(_aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_cpu(func, args, kwargs):
    a = _FLASH_CPU_ARGS.bind(args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    sts = shard_tensors(args, kwargs)
    if all(t._spec.is_replicated for t in sts):
        return run_replicated(func, args, kwargs, sts)  # nothing sharded (e.g. attention among slice tokens)
    m, out_spec, lse_spec = _ring_layouts(q._spec, k._spec, v._spec) \
        if all(isinstance(t, ShardTensor) for t in (q, k, v)) else (None, None, None)
    if m is None or a["dropout_p"] or a["attn_mask"] is not None:
        return unsupported_or_fallback(func, args, kwargs, "scaled dot product attention needs query, key and "
                                        "value sharded alike on the sequence dim, no dropout and no mask here")
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    spec = q._spec
    out, lse = ring_forward(q._local, k._local, v._local, spec.sizes[m], k._spec.sizes[m], spec.mesh, m,
                            bool(a["is_causal"]), scale, 1)
    return ShardTensor.from_spec(out, out_spec), ShardTensor.from_spec(lse.squeeze(-1), lse_spec)


@register_aten(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_cpu_backward(func, args, kwargs):
    a = _FLASH_CPU_BACKWARD_ARGS.bind(args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    sts = shard_tensors(args, kwargs)
    if all(t._spec.is_replicated for t in sts):
        return run_replicated(func, args, kwargs, sts)
    g = a["grad_out"]
    rest = [t for t in (q, k, v, a["out"], a["logsumexp"]) if isinstance(t, ShardTensor)]
    if isinstance(g, ShardTensor) and all(t._spec.is_replicated for t in rest) and all(
            isinstance(p, Replicate) or (isinstance(p, Partial) and p.reduce_op == "sum") for p in g._spec.placements):
        # replicated attention (e.g. among slice tokens) whose output gradient is a pending sum: the backward
        # is linear in that gradient, so the input gradients stay pending sums too (no collective here)
        local = [t._local if isinstance(t, ShardTensor) else t for t in args]
        lk = {key: (val._local if isinstance(val, ShardTensor) else val) for key, val in kwargs.items()}
        outs = func(*local, **lk)
        return tuple(ShardTensor.from_spec(o, _reshaped(g._spec, tuple(o.shape))) for o in outs)
    m = _ring_specs(q, k, v)
    if m is None:
        return unsupported_or_fallback(func, args, kwargs, "attention backward with mixed layouts")
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    spec = q._spec
    g = a["grad_out"]
    g = g.redistribute(list(a["out"]._spec.placements), sharding_shapes={d: list(s) for d, s in
                                                                          enumerate(a["out"]._spec.sizes)
                                                                          if s is not None})._local \
        if isinstance(g, ShardTensor) else g
    dq, dk, dv = ring_backward(g, q._local, k._local, v._local, a["out"]._local, a["logsumexp"]._local.unsqueeze(-1),
                               spec.sizes[m], k._spec.sizes[m], spec.mesh, m, bool(a["is_causal"]), scale, 1)
    return ShardTensor.from_spec(dq, spec), ShardTensor.from_spec(dk, k._spec), ShardTensor.from_spec(dv, v._spec)


def _seq_mesh_dim(t, seq_dim):
    if not isinstance(t, ShardTensor):
        return None
    return _spec_seq_mesh_dim(t._spec, seq_dim)


def _spec_seq_mesh_dim(spec, seq_dim):
    """The mesh dim sharding tensor dim ``seq_dim`` of a layout, else None."""
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim == seq_dim:
            return m
    return None


def _sdpa(func, args, kwargs):
    a = _SDPA_ARGS.bind(args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    if not any(isinstance(t, ShardTensor) for t in (q, k, v)):
        return run_function_default(func, args, kwargs)
    nd = q.ndim
    seq = nd - 2
    mq, mk, mv = (_seq_mesh_dim(t, seq) for t in (q, k, v))
    if mq is None and mk is None:
        return run_function_default(func, args, kwargs)  # sequence unsharded: the generic rules apply
    mask = a["attn_mask"]
    if isinstance(mask, ShardTensor):
        mask = _replicated_local(mask, mask._spec.mesh)
    if mask is not None and mask.requires_grad:
        return unsupported_or_fallback(func, args, kwargs, "a differentiable attn_mask with a sharded sequence dim")
    dropout = float(a["dropout_p"] or 0.0)
    groups = q.shape[-3] // k.shape[-3] if a["enable_gqa"] else 1
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    causal = bool(a["is_causal"])
    if dropout and mq is not None and mk is not None:
        # dropout acts on each row's normalised weights: the ring's running rescaling cannot apply it, so
        # the keys and values are gathered (this rank's queries attend to all of them, as below)
        warn_relayout(func, "gathered keys and values for attention dropout with a sharded sequence")
        k, v = (_replicated_local(t, t._spec.mesh) for t in (k, v))
        mk = mv = None
    if mq is not None and mk is not None:
        if mk != mq or mv != mq:
            return unsupported_or_fallback(func, args, kwargs, "query, key and value sharded over different mesh dims")
        q, k, v = (without_partial(t) for t in (q, k, v))
        spec = q._spec
        if any(t._spec.placements != spec.placements for t in (k, v)):
            return unsupported_or_fallback(func, args, kwargs, "query, key and value laid out differently")
        out = _RingAttention.apply(q.to_local(), k.to_local(), v.to_local(), spec.sizes[mq], k._spec.sizes[mq],
                                   spec.mesh, mq, causal, scale, groups, mask)
        return ShardTensor.from_spec(out, spec_like(_reshaped(spec, tuple(spec.shape[:-1]) + (out.shape[-1],)),
                                                    out.shape))
    if mq is not None:  # replicated K/V: local attention, K/V gradients summed over the ranks
        q = without_partial(q)
        spec = q._spec
        k_full = _replicated_local(k, spec.mesh)
        v_full = _replicated_local(v, spec.mesh)
        k_full, v_full = params_for(spec.mesh, [mq], k_full, v_full)
        q0 = sum(spec.sizes[mq][:spec.coord[mq]])
        ql = q.to_local()
        if causal or mask is not None or dropout:
            s = _scores(ql, _expand(k_full, groups), scale, causal, q0, 0, mask)
            out = F.dropout(torch.softmax(s, -1), dropout) @ _expand(v_full, groups)
        else:
            out = F.scaled_dot_product_attention(ql, k_full, v_full, scale=scale, enable_gqa=a["enable_gqa"])
        return ShardTensor.from_spec(out, spec_like(_reshaped(spec, tuple(spec.shape[:-1]) + (out.shape[-1],)),
                                                    out.shape))
    # replicated queries, sharded K/V: partial attention per rank, combined by log-sum-exp weights
    if causal or mask is not None:
        return unsupported_or_fallback(func, args, kwargs, "is_causal or attn_mask with replicated queries and "
                                        "sharded keys")
    k, v = without_partial(k), without_partial(v)
    spec = k._spec
    ql = _replicated_local(q, spec.mesh)
    (ql,) = params_for(spec.mesh, [mk], ql)
    kl, vl = k.to_local(), v.to_local()
    s = (ql @ _expand(kl, groups).transpose(-2, -1)) * scale
    with torch.no_grad():
        local_max = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full(s.shape[:-1] + (1,), float("-inf"))
        big = comm.all_reduce(local_max.contiguous(), "max", spec.mesh, mk)
        big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    p = torch.exp(s - big)
    # dropout of the normalised weights p/den is dropout of p: each rank drops its own block's columns
    num = comm.all_reduce_to_replicated(F.dropout(p, dropout) @ _expand(vl, groups), spec.mesh, mk)
    den = comm.all_reduce_to_replicated(p.sum(-1, keepdim=True), spec.mesh, mk)
    out = num / den
    placements = [Replicate() if k_ == mk else p_ for k_, p_ in enumerate(spec.placements)]
    return ShardTensor.from_spec(out, spec_from_sizes(out.shape, spec.mesh, placements,
                                                      {d: list(s_) for d, s_ in enumerate(spec.sizes)
                                                       if s_ is not None and d != mk}))


def _replicated_local(t, mesh):
    if isinstance(t, ShardTensor):
        return t.redistribute([Replicate()] * mesh.ndim).to_local()
    return t


register_function(F.scaled_dot_product_attention)(_sdpa)
