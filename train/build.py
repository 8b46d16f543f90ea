"""What a config describes, built: the device mesh and the model (shared by training and prediction)."""

from __future__ import annotations

import torch

import domainflow as df
from domainflow import comm

from . import model_target
from .config import Config, ConfigError
from .data import model_io


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
    sizes = {"in": io.in_dim, "out": io.out_dim, "global": io.global_dim}
    if cfg.data.kind == "grid":
        sizes["statics"] = len(ds.statics)
    if m.target:
        model = model_target.build(m.target, m.kwargs, sizes)
        if io.global_dim and not model_target.takes_globals(model):
            raise ConfigError(f"model.target={m.target}: its forward takes one input, but the store's {io.global_dim} "
                              f"design parameters are passed as a second (globals); set data.use_params=false or "
                              f"accept forward(x, globals)")
        model_target.check_edges_fit(cfg, model.forward)
    else:  # the built-ins through the same path, sized by their config keys
        own = {"transolver": {"dim": m.dim, "layers": m.layers, "heads": m.heads, "slices": m.slices,
                              "mlp_ratio": m.mlp_ratio, "dropout": m.dropout},
               "meshgraphnet": {"dim": m.dim, "layers": m.layers},
               "unet": {"base": m.base, "levels": m.levels}}[m.name]
        model = model_target.build(model_target.BUILTIN[m.name], {**own, **m.kwargs}, sizes, f"model.name={m.name!r}")
    return model.to(dtype=dtype_of(cfg), device=comm.mesh_device(ds.axes.domain))


def dtype_of(cfg: Config) -> torch.dtype:
    """The training dtype ``train.dtype`` names."""
    return torch.float64 if cfg.train.dtype == "float64" else torch.float32
