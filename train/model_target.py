"""A model named by import path: ``model.target = "package.module:Class"`` (or ``"path/to/file.py:Class"``) with
``model.kwargs``, built on every rank the same way; the built-in models are targets too.

The data's sizes are passed to the parameters the constructor names and the kwargs leave unset: the input
width as ``in_dim``, ``in_channels`` or ``in_features``, the output width as ``out_dim``, ``out_channels`` or
``out_features``, the number of per-sample globals as ``global_dim`` and a grid's static fields as
``statics``. So ``torch.nn:Conv2d`` with ``{"kernel_size": 3, "padding": 1}`` is a (tiny) grid model.

The forward contract (docs/architecture.md has an example): a mesh model gets ``x`` (1, N, C_in) and, when
the store's design parameters are used (``data.use_params``), ``globals`` (1, G), and with ``data.edges`` the
keyword ``edges`` (E, 2): directed edges (sender, receiver) in global row numbers; it returns (1, N, C_out);
a grid model gets (1, history * C + S, H, W) and returns (1, C, H, W). Inputs are ShardTensors: plain torch
code runs on them, domainflow supplies the halos and collectives.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from torch import nn

from .config import ConfigError

BUILTIN = {"transolver": "domainflow.train.models.transolver:Transolver",
           "meshgraphnet": "domainflow.train.models.meshgraphnet:MeshGraphNet",
           "unet": "domainflow.train.models.unet:UNet"}
SIZE_NAMES = {"in": ("in_dim", "in_channels", "in_features"), "out": ("out_dim", "out_channels", "out_features"),
              "global": ("global_dim",), "statics": ("statics",)}


def resolve(target: str):
    """The ``nn.Module`` class ``target`` names; a ConfigError naming what is missing or what it is otherwise
    (nothing but a module class is ever called, so a config or a checkpoint cannot name, say, ``os:system``)."""
    module, sep, name = target.rpartition(":")
    if not sep:
        module, _, name = target.rpartition(".")
    if not module or not name:
        raise ConfigError(f"model.target={target!r} is not an import path; write package.module:Class (e.g. "
                          f"torch.nn:Conv2d) or path/to/file.py:Class")
    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise ConfigError(f"model.target={target!r}: no file {path}")
            key = f"domainflow_user_model_{abs(hash(str(path.resolve())))}"
            mod = sys.modules.get(key)
            if mod is None:
                spec = importlib.util.spec_from_file_location(key, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[key] = mod
                spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"model.target={target!r}: cannot import {module!r} ({exc}); is it installed or on "
                          f"PYTHONPATH?") from None
    except Exception as exc:  # noqa: BLE001  (the user's module fails on import: name it)
        raise ConfigError(f"model.target={target!r}: importing {module!r} failed: {type(exc).__name__}: {exc}") from None
    obj = getattr(mod, name, None)
    if obj is None or not callable(obj):
        public = sorted(n for n in dir(mod) if not n.startswith("_"))[:20]
        raise ConfigError(f"model.target={target!r}: {module!r} has no callable {name!r}; it has {public}")
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        raise ConfigError(f"model.target={target!r} is a {type(obj).__name__}, not a torch.nn.Module class; name the "
                          f"model's class")
    return obj


def check_trusted(cfg, where, trusted: bool) -> None:
    """A checkpoint's config that names a model outside domainflow (``model.target``) is imported and built only
    when the user says they trust that code (``--trust-model-target``): predicting from a checkpoint must not run
    code the checkpoint names, e.g. a ``.py`` file shipped beside it."""
    target = cfg.model.target
    if target and target not in BUILTIN.values() and not trusted:
        raise ConfigError(f"{where} was trained with model.target={target!r}, code outside domainflow that predicting "
                          f"from it imports and runs; pass --trust-model-target if you trust that code")


def build(target: str, kwargs: dict, sizes: dict, shown: str | None = None) -> nn.Module:
    """``target(**kwargs)`` with the data's ``sizes`` ({"in", "out", "global", "statics"}) filled into the size
    parameters its signature names and ``kwargs`` leaves unset. Whatever the constructor raises becomes one
    ConfigError naming ``shown`` (a built-in's ``model.name=...``; ``model.target=...`` by default), the kwargs
    and the exception, chained to it (``DOMAINFLOW_TRACEBACK=1`` shows where it was raised)."""
    fn = resolve(target)
    params = check_kwargs(target, fn, kwargs)
    kw = dict(kwargs)
    for key, names in SIZE_NAMES.items():
        for n in names:
            if n in params and n not in kw and key in sizes:
                kw[n] = sizes[key]
                break
    try:
        model = fn(**kw)
    except Exception as exc:  # noqa: BLE001  (the user's constructor: any exception is theirs, named here)
        text = " ".join(str(exc).split())
        fix = "fix model.kwargs or the constructor" if shown is None else "fix the model.* settings"
        raise ConfigError(f"{shown or f'model.target={target!r}'} with {kw} failed to build: {type(exc).__name__}"
                          f"{': ' + text if text else ''}; {fix}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={target!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_kwargs(target: str, fn, kwargs: dict) -> dict:
    """``fn``'s parameters; a kwarg it does not take (and no ``**kwargs`` to catch it) is a ConfigError."""
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return params
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise ConfigError(f"model.kwargs {unknown} are not parameters of {target}; it takes {list(params)}")
    return params


def takes_globals(model: nn.Module) -> bool:
    """Whether the model's forward accepts a second argument (the per-sample globals)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 2


def edges_keyword(forward) -> str:
    """How ``forward`` takes the sample's edges: "required" (an ``edges`` parameter without a default), "optional"
    (with one, or ``**kwargs``) or "no"."""
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "optional"
    p = params.get("edges")
    if p is not None and p.kind != p.POSITIONAL_ONLY:
        return "required" if p.default is p.empty else "optional"
    return "optional" if any(q.kind == q.VAR_KEYWORD for q in params.values()) else "no"


def check_edges_fit(cfg, forward) -> None:
    """``data.edges`` and the model's forward agree: edges go only to a forward that takes ``edges=``, and a forward
    that needs them gets them. A ConfigError naming the key and the fix otherwise."""
    how, target = edges_keyword(forward), cfg.model.target
    if cfg.data.edges and how == "no":
        raise ConfigError(f"data.edges=true: the forward of model.target={target} takes no edges keyword; set "
                          f"data.edges=false, or accept forward(x, ..., edges=...)")
    if not cfg.data.edges and how == "required":
        raise ConfigError(f"model.target={target}: its forward needs edges=, which only a store's edges give; set "
                          f"data.edges=true (a store ingested with --edges)")
