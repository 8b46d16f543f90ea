"""Autograd-aware collectives for handlers that work on local tensors. Each backward is itself made of these
differentiable collectives, so gradients taken with ``create_graph=True`` (gradient penalties, PINN residuals)
keep their graph through them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from domainflow.layout.spec import mesh_coordinate
from domainflow.comm.collectives import all_gather_uneven, all_reduce, all_to_all_dims


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
        # y = sum_k x_k on every rank: dL/dx_k = sum over ranks of dL/dy_r (itself a sum: differentiable)
        return _AllReduceSum.apply(grad, ctx.mesh, ctx.mesh_dim), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, dim, sizes, mesh, mesh_dim):
        ctx.args = (dim, tuple(sizes), mesh, mesh_dim)
        return all_gather_uneven(t, dim, sizes, mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, mesh, mesh_dim = ctx.args
        k = mesh_coordinate(mesh)[mesh_dim]
        grad = _AllReduceSum.apply(grad, mesh, mesh_dim)
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
        g = _AllToAll.apply(grad.contiguous(), cat_dim, back_send, split_dim, back_recv, mesh, mesh_dim)
        return g, None, None, None, None, None, None


def all_to_all_autograd(t: torch.Tensor, split_dim: int, send_sizes: Sequence[int], cat_dim: int,
                        recv_shapes: Sequence[Sequence[int]], mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Differentiable :func:`all_to_all_dims` (backward: the reverse exchange)."""
    return _AllToAll.apply(t, split_dim, send_sizes, cat_dim, recv_shapes, mesh, mesh_dim)


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
