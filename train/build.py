"""What a config describes, built: the device mesh and the model (shared by training and prediction)."""

from __future__ import annotations

import torch

import domainflow as df
from domainflow import comm

from .config import Config
from .data import model_io
from .models import Transolver, UNet


def build_mesh(cfg: Config):
    """("dp", "domain"), or ("dp", "domain", "lon") for a grid sharded over latitude and longitude."""
    if cfg.data.kind == "grid" and len(cfg.data.shard_dims) == 2:
        return df.init_mesh((cfg.mesh.dp, cfg.mesh.domain, cfg.mesh.lon), ("dp", "domain", "lon"))
    return df.init_mesh((cfg.mesh.dp, cfg.mesh.domain), ("dp", "domain"))


def build_model(cfg: Config, ds) -> torch.nn.Module:
    """The model ``cfg.model`` names, sized for ``ds``'s inputs and outputs, seeded by ``train.seed``."""
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    io = model_io(cfg, ds)
    if m.name == "transolver":
        model = Transolver(io.in_dim, io.out_dim, io.global_dim, dim=m.dim, layers=m.layers, heads=m.heads,
                           slices=m.slices, mlp_ratio=m.mlp_ratio, dropout=m.dropout)
    else:
        model = UNet(io.in_dim, io.out_dim, base=m.base, levels=m.levels, statics=len(ds.statics))
    return model.to(dtype=dtype_of(cfg), device=comm.mesh_device(ds.axes.domain))


def dtype_of(cfg: Config) -> torch.dtype:
    """The training dtype ``train.dtype`` names."""
    return torch.float64 if cfg.train.dtype == "float64" else torch.float32
