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
        w, fx = self._weights(x), self._features(x)
        num, den = reduce_partials(*self._slice_sums(w, fx))                   # one all-reduce for both
        return self._deslice(w, self._tokens(num, den), x.shape)

    # the steps of forward, also run block by block (slice_sums over all blocks first, then deslice)
    def _weights(self, x):
        """Soft assignment of each point to the slices, per head: (B, H, N, M)."""
        b, n, _ = x.shape
        xm = self.in_x(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)   # (B, H, N, D)
        return torch.softmax(self.to_slice(xm) / self.temperature, dim=-1)

    def _features(self, x):
        b, n, _ = x.shape
        return self.in_fx(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)

    @staticmethod
    def _slice_sums(w, fx):
        """Sums over points of the slice-weighted features (B, H, M, D) and of the weights (B, H, M)."""
        # (fx^T w)^T, not w^T fx: CPU BLAS runs this reduction over the N points ~10x faster in this order
        return (fx.transpose(-2, -1) @ w).transpose(-2, -1), w.sum(2)

    def _tokens(self, num, den):
        tokens = num / (den[..., None] + 1e-5)
        return F.scaled_dot_product_attention(self.to_q(tokens), self.to_k(tokens), self.to_v(tokens))

    def _deslice(self, w, tokens, shape):
        b, n, c = shape
        # (tokens^T w^T) is w @ tokens transposed: its backward reduces over the points in the fast order too
        per_point = tokens.transpose(-2, -1) @ w.transpose(-2, -1)                     # (B, H, D, N)
        return self.out(per_point.permute(0, 3, 1, 2).reshape(b, n, c))

    def slice_sums(self, x):
        """This block's share of the two sums over points (pending sums when sharded)."""
        return self._slice_sums(self._weights(x), self._features(x))

    def deslice(self, x, num, den):
        """The layer's output for the points of ``x`` from the finished sums over all points."""
        return self._deslice(self._weights(x), self._tokens(num, den), x.shape)


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

    @torch.no_grad()
    def forward_blocks(self, blocks: list) -> list:
        """``forward`` (no grad) over a sample given as blocks of points: the slice sums of every block first
        (one all-reduce for the layer), then each block's output, added to the block in place (the residual
        stream is allocated once, not once per layer); equal to ``forward`` up to summation order."""
        num = den = None
        for x in blocks:
            n, d = self.attn.slice_sums(self.norm1(x))
            num, den = (n, d) if num is None else (num + n, den + d)
        num, den = reduce_partials(num, den)
        for x in blocks:
            x.add_(self.attn.deslice(self.norm1(x), num, den))
            x.add_(self.mlp(self.norm2(x)))
        return blocks


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
        x = self.embed(self._with_globals(points, globals_))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @torch.no_grad()
    def forward_blocks(self, points: torch.Tensor, globals_: torch.Tensor | None = None,
                       block_points: int = 65536) -> torch.Tensor:
        """``forward`` (no grad) in blocks of ``block_points`` rows per rank (``eval.block_points`` counts over
        the whole domain; ``domainflow.rows_per_block`` turns it into rows per rank), for inference on samples whose
        activations do not fit: exact, since points meet only in each layer's slice sums, which are summed
        over all blocks before any block is mapped back. Memory: the (N, dim) residual stream plus one
        block's activations, instead of every layer's (N, heads, slices) weights at once."""
        from domainflow import join_blocks, split_blocks

        pieces = split_blocks(points, 1, block_points)
        x = []
        for k in range(len(pieces)):
            p, pieces[k] = pieces[k], None
            x.append(self.embed(self._with_globals(p, globals_)))
        for block in self.blocks:
            x = block.forward_blocks(x)
        out = []
        for k in range(len(x)):
            b, x[k] = x[k], None  # each residual block dropped once its output exists
            out.append(self.head(b))
        return join_blocks(out, 1)

    def _with_globals(self, points, globals_):
        """The points with the per-sample globals appended to each (when the model takes globals)."""
        if not self.global_dim:
            return points
        if globals_ is None:
            raise ValueError(f"Transolver was built with global_dim={self.global_dim}; pass globals_ (B, "
                             f"{self.global_dim})")
        g = globals_.reshape(points.shape[0], 1, self.global_dim).expand(-1, points.shape[1], -1)
        return torch.cat([points, g.to(points.dtype)], dim=-1)
