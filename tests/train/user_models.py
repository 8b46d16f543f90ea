"""Models a user brings, named by ``model.target`` in the tests: written with torch ops only, no domainflow."""

from __future__ import annotations

import torch
from torch import nn


class SpectralConv2d(nn.Module):
    """The Fourier layer of an FNO: keep the lowest ``modes`` x ``modes`` Fourier modes, mix channels there."""

    def __init__(self, c_in: int, c_out: int, modes: int):
        super().__init__()
        self.c_out, self.modes = c_out, modes
        scale = 1.0 / (c_in * c_out)
        self.w_pos = nn.Parameter(scale * torch.randn(c_in, c_out, modes, modes, 2))
        self.w_neg = nn.Parameter(scale * torch.randn(c_in, c_out, modes, modes, 2))

    def forward(self, x):
        H, W = x.shape[-2], x.shape[-1]
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        low = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], torch.view_as_complex(self.w_pos))
        high = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], torch.view_as_complex(self.w_neg))
        out_ft = x_ft.new_zeros(x.shape[0], self.c_out, H, W // 2 + 1)
        out_ft[:, :, :m, :m] = low
        out_ft[:, :, -m:, :m] = high
        return torch.fft.irfft2(out_ft, s=(H, W))


class FNO(nn.Module):
    """A small Fourier neural operator: lift, ``layers`` x (spectral conv + 1x1 conv, GELU), project."""

    def __init__(self, in_channels: int, out_channels: int, width: int = 8, modes: int = 2, layers: int = 2):
        super().__init__()
        self.lift = nn.Conv2d(in_channels, width, 1)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.project = nn.Conv2d(width, out_channels, 1)

    def forward(self, x):
        h = self.lift(x)
        for spectral, pointwise in zip(self.spectral, self.pointwise):
            h = torch.nn.functional.gelu(spectral(h) + pointwise(h))
        return self.project(h)
