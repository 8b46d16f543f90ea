"""Message passing on sharded graphs the way graph libraries write it: messages summed onto nodes with an in-place
scatter into a fresh plain tensor (``torch.zeros(N, C).scatter_add_(0, index, messages)``: torch_scatter's
``scatter_sum`` and PhysicsNeMo; ``index_add_``; PyG's ``src.new_zeros(...).scatter_add_``), nodes and edges sharded
unevenly (one rank without edges): the aggregation, and a standard MeshGraphNet (encoder, processor blocks with
edge and node updates and residuals, decoder) trained one step, equal to one process, forward and every parameter
gradient. Before, the in-place scatter into the plain tensor was refused."""

from __future__ import annotations

import pytest
import torch
from dist_pool import rank_and_world
from sharded_check import Sharded, check_sharded, get_mesh
from sweep import check_into, none_failed

import domainflow as df
from domainflow import Replicate, Shard, ShardTensor

D = torch.float64
N, E = 9, 23  # nodes, edges


def _aggregate(messages, dst, n, how):
    c = messages.shape[-1]
    if how == "scatter_add_":  # torch_scatter.scatter_sum
        return torch.zeros(n, c, dtype=messages.dtype).scatter_add_(0, dst.unsqueeze(-1).expand(-1, c), messages)
    if how == "index_add_":
        return torch.zeros(n, c, dtype=messages.dtype).index_add_(0, dst, messages)
    if how == "amax under fallback('gather')":  # a max stays no pending sum: gathered, as the user opted in to
        with df.fallback("gather"):
            return torch.zeros(n, c, dtype=messages.dtype).scatter_reduce_(
                0, dst.unsqueeze(-1).expand(-1, c), messages, "amax", include_self=False)
    # PyG's torch_geometric.utils.scatter(reduce="sum"): a buffer made from the source
    return messages.new_zeros((n, c)).scatter_add_(0, dst.unsqueeze(-1).expand(-1, c), messages)


class _MLP(torch.nn.Sequential):
    """PhysicsNeMo's MeshGraphMLP: Linear, SiLU, Linear, LayerNorm."""

    def __init__(self, i, o, hidden=8):
        super().__init__(torch.nn.Linear(i, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, o), torch.nn.LayerNorm(o))


class MeshGraphNet(torch.nn.Module):
    """A standard MeshGraphNet (Pfaff et al. 2021, as in PhysicsNeMo): encode, ``blocks`` of edge update
    e += MLP(e, x_src, x_dst) and node update x += MLP(x, sum of incoming e), decode."""

    def __init__(self, node_in=3, edge_in=2, out=2, width=6, blocks=2, aggregate="scatter_add_"):
        super().__init__()
        self.aggregate = aggregate
        self.node_enc, self.edge_enc = _MLP(node_in, width), _MLP(edge_in, width)
        self.edge_mlps = torch.nn.ModuleList(_MLP(3 * width, width) for _ in range(blocks))
        self.node_mlps = torch.nn.ModuleList(_MLP(2 * width, width) for _ in range(blocks))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.SiLU(), torch.nn.Linear(width, out))

    def forward(self, x, e, src, dst):
        x, e = self.node_enc(x), self.edge_enc(e)
        n = x.shape[0]
        for edge_mlp, node_mlp in zip(self.edge_mlps, self.node_mlps):
            e = e + edge_mlp(torch.cat([e, x[src], x[dst]], dim=-1))
            x = x + node_mlp(torch.cat([x, _aggregate(e, dst, n, self.aggregate)], dim=-1))
        return self.decoder(x)


def _graph(world):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(N, 3, generator=gen, dtype=D)
    e = torch.randn(E, 2, generator=gen, dtype=D)
    src, dst = torch.randint(0, N, (E,), generator=gen), torch.randint(0, N, (E,), generator=gen)
    nodes = [N // world] * world
    nodes[-1] += N - sum(nodes)
    edges = [0] + [E // (world - 1)] * (world - 1)  # the first rank holds no edge
    edges[-1] += E - sum(edges)
    return x, e, src, dst, {0: tuple(nodes)}, {0: tuple(edges)}


def _replicated(out, messages, mesh):
    """A plain aggregation (whole on every rank) as a replicated ShardTensor, for the comparison (in the sharded
    run; the one-process run gives it plain)."""
    if isinstance(messages, ShardTensor) and not isinstance(out, ShardTensor):
        return ShardTensor.from_local(out, mesh, [Replicate()], sharding_shapes="chunk", shape=out.shape)
    return out


def _aggregations():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    x, e, src, dst, nodes, edges = _graph(world)
    failures = []
    for how in ("scatter_add_", "index_add_", "new_zeros", "amax under fallback('gather')"):
        msgs = torch.randn(E, 4, generator=torch.Generator().manual_seed(2), dtype=D)
        check_into(lambda m, d, h=how: _replicated(_aggregate(m, d, N, h), m, mesh),
                   [Sharded(msgs, [Shard(0)], edges), Sharded(dst, [Shard(0)], edges, requires_grad=False)],
                   mesh, f"aggregate by {how}", failures)
    return none_failed(failures)


class _Residual(torch.nn.Module):
    """A destination with values and a gradient of its own (a residual aggregation, ``h.index_add_``)."""

    def __init__(self, c):
        super().__init__()
        self.h0 = torch.nn.Parameter(torch.randn(N, c, generator=torch.Generator().manual_seed(4), dtype=D))

    def forward(self, messages, dst, how):
        h = self.h0 * 1.0
        if how == "index_add_":
            return h.index_add_(0, dst, messages)
        return h.scatter_add_(0, dst.unsqueeze(-1).expand(-1, messages.shape[-1]), messages)


def _residual_aggregations():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    x, e, src, dst, nodes, edges = _graph(world)
    failures = []
    msgs = torch.randn(E, 4, generator=torch.Generator().manual_seed(2), dtype=D)
    for how in ("index_add_", "scatter_add_"):  # the ranks' gradient hooks on h must pair (one rank only ran them)
        check_into(lambda m, d, mod, h=how: _replicated(mod(m, d, h), m, mesh),
                   [Sharded(msgs, [Shard(0)], edges), Sharded(dst, [Shard(0)], edges, requires_grad=False)],
                   mesh, f"residual {how}", failures, module=_Residual(4))
    return none_failed(failures)


def _meshgraphnet(aggregate):
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    x, e, src, dst, nodes, edges = _graph(world)
    torch.manual_seed(0)
    model = MeshGraphNet(aggregate=aggregate).to(D)
    check_sharded(lambda a, b, s, d, m: m(a, b, s, d),
                  [Sharded(x, [Shard(0)], nodes), Sharded(e, [Shard(0)], edges),
                   Sharded(src, [Shard(0)], edges, requires_grad=False),
                   Sharded(dst, [Shard(0)], edges, requires_grad=False)], mesh, module=model, tol=1e-9)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_messages_summed_into_a_fresh_plain_tensor_exactly(dist, world):
    assert all(dist.run(world, _aggregations))


@pytest.mark.parametrize("world", [2, 3])
def test_messages_summed_into_a_destination_with_values_and_a_gradient(dist, world):
    assert all(dist.run(world, _residual_aggregations))


@pytest.mark.parametrize("aggregate", ["scatter_add_", "index_add_"])
@pytest.mark.parametrize("world", [2, 3])
def test_meshgraphnet_forward_and_parameter_gradients_equal_one_process(dist, world, aggregate):
    assert all(dist.run(world, _meshgraphnet, aggregate))
