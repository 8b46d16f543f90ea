"""A UNet for gridded forecasting on a latitude-longitude grid, periodic in longitude.

Convolutions pad longitude circularly (the grid wraps around the globe) and latitude with zeros (the
poles are edges), through ``F.pad`` before an unpadded convolution. Plain PyTorch: on a grid sharded
over latitude (or latitude and longitude), domainflow's halo exchanges supply the neighbouring rows,
wrapping from the last rank to the first in longitude.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PeriodicConv(nn.Module):
    """3x3 convolution, circular in longitude (last dim), zero-padded in latitude."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=0)

    def forward(self, x):
        x = F.pad(x, (1, 1, 0, 0), mode="circular")
        x = F.pad(x, (0, 0, 1, 1))
        return self.conv(x)


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        groups = max(1, min(8, c_out // 4))
        self.net = nn.Sequential(PeriodicConv(c_in, c_out), nn.GroupNorm(groups, c_out), nn.GELU(),
                                 PeriodicConv(c_out, c_out), nn.GroupNorm(groups, c_out), nn.GELU())

    def forward(self, x):
        return self.net(x)


class UNet(nn.Module):
    """(B, in_channels, H, W) -> (B, out_channels, H, W); H and W divisible by 2**(levels-1).

    Predicts the change from the last input step when ``residual`` (the usual choice for forecasting); the
    input's last ``statics`` channels are constant fields, so the last step is the ``out_channels`` before them.
    """

    def __init__(self, in_channels: int, out_channels: int, base: int = 16, levels: int = 2,
                 residual: bool = True, statics: int = 0):
        super().__init__()
        chans = [base * 2 ** k for k in range(levels)]
        self.down = nn.ModuleList()
        c = in_channels
        for ch in chans:
            self.down.append(ConvBlock(c, ch))
            c = ch
        self.up = nn.ModuleList()
        self.fuse = nn.ModuleList()
        for ch in reversed(chans[:-1]):
            self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
            self.fuse.append(ConvBlock(c + ch, ch))
            c = ch
        self.head = nn.Conv2d(c, out_channels, 1)
        self.residual = residual and in_channels - statics >= out_channels
        self.out_channels = out_channels
        self.newest = in_channels - statics - out_channels  # first channel of the last input step

    def forward(self, x):
        skips = []
        h = x
        for k, block in enumerate(self.down):
            h = block(h)
            if k < len(self.down) - 1:
                skips.append(h)
                h = F.max_pool2d(h, 2)
        for up, fuse in zip(self.up, self.fuse):
            h = fuse(torch.cat([up(h), skips.pop()], dim=1))
        out = self.head(h)
        if self.residual:
            out = out + x[:, self.newest:self.newest + self.out_channels]
        return out
