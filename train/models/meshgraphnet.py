"""MeshGraphNet (Pfaff et al., ICLR 2021; as PhysicsNeMo's MeshGraphNet): message passing over a mesh's edges.

Encoders map each node's inputs (with the per-sample globals) and each edge's features (the sender's inputs
minus the receiver's, and the norm of that difference) to latent vectors; each processor block updates every
edge from its two nodes, ``e += MLP([e, h_sender, h_receiver])``, then every node from the sum of its incoming
edges, ``h += MLP([h, sum e])``; a decoder maps the nodes to outputs. The MLPs are PhysicsNeMo's: Linear, SiLU,
Linear, LayerNorm (the decoder's without the norm).

Plain PyTorch, on one device as on ShardTensors. With the nodes sharded over the domain and each rank holding
the edges whose receiver it owns (what ``MeshDataset(edges=True)`` reads), ``h[senders]`` fetches only the
sender rows other ranks own (``domainflow.ops.indexing``; one exchange plan per forward, reused by every block),
``h[receivers]`` is local, and the messages are summed into a buffer sharded like the nodes
(``zeros_like(h).index_add``), so no row moves for the sum and no rank ever holds all N nodes.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Sequential):
    """PhysicsNeMo's MeshGraphMLP: Linear, SiLU, Linear, then LayerNorm (``norm=False``: the decoder's)."""

    def __init__(self, c_in: int, c_out: int, hidden: int, norm: bool = True):
        super().__init__(nn.Linear(c_in, hidden), nn.SiLU(), nn.Linear(hidden, c_out),
                         *([nn.LayerNorm(c_out)] if norm else []))


class ProcessorBlock(nn.Module):
    """One round of message passing: each edge from its two nodes, then each node from its incoming edges."""

    def __init__(self, dim: int):
        super().__init__()
        self.edge_mlp = MLP(3 * dim, dim, dim)
        self.node_mlp = MLP(2 * dim, dim, dim)

    def forward(self, h, e, senders, receivers):
        e = e + self.edge_mlp(torch.cat([e, h[senders], h[receivers]], dim=-1))
        incoming = torch.zeros_like(h).index_add(0, receivers, e)   # sharded like h: the receivers are local rows
        return h + self.node_mlp(torch.cat([h, incoming], dim=-1)), e


class MeshGraphNet(nn.Module):
    """Node inputs (1, N, in_dim) and directed edges (E, 2) ``(sender, receiver)`` -> per-node outputs
    (1, N, out_dim).

    ``global_dim`` per-sample values (design parameters) are appended to every node's inputs; ``dim`` is the
    latent width (and every MLP's hidden width), ``layers`` the processor blocks.
    """

    def __init__(self, in_dim: int, out_dim: int, global_dim: int = 0, dim: int = 64, layers: int = 4):
        super().__init__()
        self.global_dim = global_dim
        self.node_encoder = MLP(in_dim + global_dim, dim, dim)
        self.edge_encoder = MLP(in_dim + 1, dim, dim)
        self.blocks = nn.ModuleList(ProcessorBlock(dim) for _ in range(layers))
        self.decoder = MLP(dim, out_dim, dim, norm=False)

    def forward(self, x: torch.Tensor, globals_: torch.Tensor | None = None, *, edges: torch.Tensor) -> torch.Tensor:
        nodes = x[0]
        senders, receivers = edges[:, 0], edges[:, 1]
        h = self.node_encoder(self._with_globals(nodes, globals_))
        e = self.edge_encoder(self._edge_features(nodes, senders, receivers))
        for block in self.blocks:
            h, e = block(h, e, senders, receivers)
        return self.decoder(h).unsqueeze(0)

    @staticmethod
    def _edge_features(nodes, senders, receivers):
        """Each edge's sender inputs minus its receiver's, and the norm of that difference: (E, in_dim + 1)."""
        d = nodes[senders] - nodes[receivers]
        return torch.cat([d, torch.linalg.vector_norm(d, dim=-1, keepdim=True)], dim=-1)

    def _with_globals(self, nodes, globals_):
        """The nodes' inputs with the per-sample globals appended to each (when the model takes globals)."""
        if not self.global_dim:
            return nodes
        if globals_ is None:
            raise ValueError(f"MeshGraphNet was built with global_dim={self.global_dim}; pass globals_ "
                             f"(1, {self.global_dim})")
        g = globals_.reshape(1, self.global_dim).expand(nodes.shape[0], -1)
        return torch.cat([nodes, g.to(nodes.dtype)], dim=-1)
