"""Transolver (Wu et al., ICML 2024): physics attention over the points of a mesh.

Each layer softly assigns the N points to M learned "slices" (a softmax over slices, per point), forms
one token per slice as the weighted mean of the points' features, lets the M tokens attend to each other,
and maps the tokens back to the points with the same weights. Cost is linear in N.

The module is plain PyTorch: given ShardTensor inputs sharded on the point dim, domainflow's engine runs
it domain-parallel. The two sums over points (slice weights, weighted features) come out of the engine
as pending sums; ``reduce_partials`` finishes both with one all-reduce per layer, the only collective
the layer needs (it returns plain tensors unchanged, so the module also runs on one device as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domainflow import reduce_partials


class PhysicsAttention(nn.Module):
    """Slice -> attend among slice tokens -> de-slice, over points (B, N, C)."""

    def __init__(self, dim: int, heads: int = 4, slices: int = 32, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"PhysicsAttention: dim={dim} is not divisible by heads={heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.in_x = nn.Linear(dim, dim)
        self.in_fx = nn.Linear(dim, dim)
        self.to_slice = nn.Linear(self.head_dim, slices)
        self.temperature = nn.Parameter(torch.full((1, heads, 1, 1), 0.5))
        self.to_q = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.to_k = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.to_v = nn.Linear(self.head_dim, self.head_dim, bias=False)
        self.out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(dropout))
        nn.init.orthogonal_(self.to_slice.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h, d = self.heads, self.head_dim
        xm = self.in_x(x).reshape(b, n, h, d).transpose(1, 2)                  # (B, H, N, D)
        fx = self.in_fx(x).reshape(b, n, h, d).transpose(1, 2)
        w = torch.softmax(self.to_slice(xm) / self.temperature, dim=-1)        # (B, H, N, M): per point
        num = w.transpose(-2, -1) @ fx                                         # (B, H, M, D): sum over points
        den = w.sum(2)                                                         # (B, H, M):    sum over points
        num, den = reduce_partials(num, den)                                   # one all-reduce for both
        tokens = num / (den[..., None] + 1e-5)
        tokens = F.scaled_dot_product_attention(self.to_q(tokens), self.to_k(tokens), self.to_v(tokens))
        y = (w @ tokens).transpose(1, 2).reshape(b, n, c)                      # de-slice: per point
        return self.out(y)


class TransolverBlock(nn.Module):
    def __init__(self, dim: int, heads: int, slices: int, mlp_ratio: int = 2, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = PhysicsAttention(dim, heads, slices, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transolver(nn.Module):
    """Point features (B, N, in_dim) -> per-point outputs (B, N, out_dim).

    ``in_dim`` counts per-point inputs (e.g. cell centre and normal: 6); ``global_dim`` per-sample
    values (design parameters, freestream) broadcast to every point and appended to its inputs.
    """

    def __init__(self, in_dim: int, out_dim: int, global_dim: int = 0, dim: int = 64, layers: int = 4,
                 heads: int = 4, slices: int = 32, mlp_ratio: int = 2, dropout: float = 0.0):
        super().__init__()
        self.global_dim = global_dim
        self.embed = nn.Sequential(nn.Linear(in_dim + global_dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))
        self.blocks = nn.ModuleList(TransolverBlock(dim, heads, slices, mlp_ratio, dropout) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, out_dim))

    def forward(self, points: torch.Tensor, globals_: torch.Tensor | None = None) -> torch.Tensor:
        x = points
        if self.global_dim:
            if globals_ is None:
                raise ValueError(f"Transolver was built with global_dim={self.global_dim}; pass globals_ (B, "
                                 f"{self.global_dim})")
            g = globals_.reshape(points.shape[0], 1, self.global_dim).expand(-1, points.shape[1], -1)
            x = torch.cat([points, g.to(points.dtype)], dim=-1)
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
