"""Training configuration: a YAML or TOML file plus ``key.sub=value`` overrides, checked against a schema.

Every section is a dataclass; an unknown section or key is an error that names it and lists the valid
choices, and values are converted to the declared type (so ``train.steps=20`` on the command line is an
int). Fields that must exist in the store (the fields to predict, the inputs) are checked against it when
the data is opened (``readers``), with the same kind of message.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from domainflow.errors import DomainflowError


class ConfigError(DomainflowError, ValueError):
    """A configuration key or value that cannot be used; the message says which and what is valid."""


@dataclass
class DataConfig:
    store: str = ""
    kind: str = "mesh"                   # mesh (surface of a car) | grid (climate)
    location: str = "surface"
    fields: list = field(default_factory=lambda: ["Cp", "Cf"])
    inputs: list = field(default_factory=lambda: ["coords", "normals"])
    use_params: bool = True              # append the run's design parameters to every point
    val_split: str = "val"
    shard_dims: list = field(default_factory=lambda: ["lat"])   # grid: lat or lat, lon
    lead: int = 1
    history: int = 1
    static: bool = True                  # grid: the store's static fields (land-sea mask, ...) as extra inputs
    prefetch: int = 2
    sample_points: int = 0               # mesh: points of each sample per training step, drawn uniformly (0: all)
    edges: bool = False                  # mesh: each sample's edges for a graph model (on by itself for meshgraphnet)


@dataclass
class ModelConfig:
    name: str = "transolver"             # transolver | meshgraphnet | unet (built-in; ignored when target is set)
    target: str = ""                     # your own model: "package.module:Class" or "path/to/file.py:Class"
    kwargs: dict = field(default_factory=dict)   # passed to the model (target's, or a built-in's extra ones)
    dim: int = 64                        # transolver, meshgraphnet: latent width
    layers: int = 4                      # transolver: blocks; meshgraphnet: message-passing (processor) blocks
    heads: int = 4
    slices: int = 32
    mlp_ratio: int = 2
    base: int = 16                       # unet: channels of the first level
    levels: int = 2
    dropout: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 100
    batch: int = 0                       # samples per optimizer step over all dp ranks (0: one per dp rank)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 0
    schedule: str = "cosine"             # cosine | constant
    min_lr: float = 0.0
    clip_grad: float = 0.0               # max global gradient norm (0: off)
    seed: int = 0
    dtype: str = "float32"               # float32 | float64 (parameters and data)
    autocast: str = "none"               # none | bf16
    checkpoint_activations: bool = False
    compile: bool = False                # training forward and backward through domainflow.compile (torch.compile)
    compile_backend: str = "inductor"    # inductor | aot_eager (train.compile's torch.compile backend)
    eval_every: int = 0                  # steps (0: only at the end)
    checkpoint_every: int = 0            # steps (0: only at the end)
    log_every: int = 1


@dataclass
class EvalConfig:
    block_points: int = 0                # evaluation and predict: forward in blocks of this many points over the domain,
                                         # each rank its share (0: the whole sample at once)
    lead_steps: list = field(default_factory=lambda: [1])  # grid: leads (in data.lead steps) of the scored rollout


@dataclass
class MeshConfig:
    dp: int = 1
    domain: int = 1                      # ranks per sample: over the points, or over latitude on a grid
    lon: int = 1                         # grids sharded over lat and lon (data.shard_dims=lat,lon): ranks over lon
    dp_strategy: str = "allreduce"       # allreduce (replicated parameters) | fsdp (FSDP2: sharded over dp)

    @property
    def size(self) -> int:
        return self.dp * self.domain * self.lon


@dataclass
class OutputConfig:
    dir: str = "runs/train"
    plots: bool = True
    progress: bool = True
    reference_area: float = 0.0          # m^2 of the force coefficients; 0: the store's recipe's (DrivaerML 2.15)
    loggers: list = field(default_factory=lambda: ["jsonl"])   # jsonl | tensorboard | mlflow (rank 0 logs)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


COMPILE_BACKENDS = ("inductor", "aot_eager")  # domainflow.compile's (train.compile_backend, predict --compile)
GRAPH_MODELS = ("meshgraphnet",)  # the built-ins whose forward takes the sample's edges (data.edges)
MESH_MODELS = ("transolver", "meshgraphnet")

_CHOICES = {
    ("data", "kind"): ("mesh", "grid"),
    ("data", "location"): ("surface", "volume"),
    ("model", "name"): ("transolver", "meshgraphnet", "unet"),
    ("train", "schedule"): ("cosine", "constant"),
    ("train", "dtype"): ("float32", "float64"),
    ("train", "autocast"): ("none", "bf16"),
    ("train", "compile_backend"): COMPILE_BACKENDS,
}


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """The config in ``path`` (``.yaml``/``.yml``/``.toml``/``.json``; None: defaults) with ``overrides``
    (``section.key=value``) applied on top."""
    raw: dict = {}
    if path is not None:
        raw = read_file(Path(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. train.steps=50)")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) != 2:
            raise ConfigError(f"override {item!r}: keys are section.key, e.g. train.lr=3e-4; sections are "
                              f"{_sections()}")
        raw.setdefault(parts[0], {})
        if not isinstance(raw[parts[0]], dict):
            raise ConfigError(f"section {parts[0]!r} must be a table of keys")
        raw[parts[0]][parts[1]] = _parse_scalar(value)
    return from_dict(raw)


def read_file(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {suffix!r}; use .yaml, .toml or .json")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (any parser's error, with the file named)
        raise ConfigError(f"config file {path} does not parse: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections, got {type(data).__name__}")
    return data


def from_dict(raw: dict) -> Config:
    cfg = Config()
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for name, values in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown config section {name!r}{_did_you_mean(name, sections)}; sections are "
                              f"{_sections()}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {name!r} must be a table of keys, got {values!r}")
        section = getattr(cfg, name)
        keys = {f.name: f for f in dataclasses.fields(section)}
        for key, value in values.items():
            if key not in keys:
                raise ConfigError(f"unknown key {name}.{key}{_did_you_mean(key, keys)}; valid keys of [{name}] are "
                                  f"{sorted(keys)}")
            setattr(section, key, _convert(name, key, value, getattr(section, key)))
    _check(cfg, {(name, key) for name, values in raw.items() for key in values})
    return cfg


def _convert(section: str, key: str, value, default):
    where = f"{section}.{key}"
    choices = _CHOICES.get((section, key))
    if choices is not None and value not in choices:
        raise ConfigError(f"{where} = {value!r} is not one of {list(choices)}")
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, dict):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ConfigError(f"{where} must be a table, e.g. {where}='{{\"width\": 32}}', got {value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of keyword arguments, got {value!r}")
        return dict(value)
    if isinstance(default, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return list(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _check(cfg: Config, given=frozenset()) -> None:
    """The rules between keys (``given``: the (section, key) pairs the config set itself)."""
    t = cfg.train
    for key in ("steps", "eval_every", "checkpoint_every", "warmup", "batch"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if cfg.data.sample_points < 0:
        raise ConfigError(f"data.sample_points must be >= 0 (0: every point), got {cfg.data.sample_points}")
    if cfg.data.sample_points and cfg.data.kind != "mesh":
        raise ConfigError(f"data.sample_points={cfg.data.sample_points} draws points of a mesh sample; a grid sample "
                          f"is trained whole (set data.sample_points=0)")
    if cfg.eval.block_points < 0:
        raise ConfigError(f"eval.block_points must be >= 0 (0: the whole sample at once), got {cfg.eval.block_points}")
    if cfg.model.target:
        module, sep, name = cfg.model.target.rpartition(":")
        if sep and module.endswith(".py"):  # a checkpoint must rebuild it from any working folder
            cfg.model.target = f"{Path(module).resolve()}:{name}"
    check_block_points(cfg)
    try:
        leads = sorted({int(k) for k in cfg.eval.lead_steps})
    except (TypeError, ValueError):
        leads = []
    if not leads or leads[0] < 1:
        raise ConfigError(f"eval.lead_steps must be integers >= 1 (e.g. 1,4,8), got {cfg.eval.lead_steps}")
    if leads != [1] and cfg.data.kind != "grid":
        raise ConfigError(f"eval.lead_steps={cfg.eval.lead_steps} rolls out a grid forecast; a mesh sample has no "
                          f"lead (remove it)")
    cfg.eval.lead_steps = leads
    if cfg.output.reference_area < 0:
        raise ConfigError(f"output.reference_area must be a positive area in m^2 (0: the store's), got "
                          f"{cfg.output.reference_area}")
    if t.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    if cfg.mesh.dp < 1 or cfg.mesh.domain < 1 or cfg.mesh.lon < 1:
        raise ConfigError(f"mesh.dp, mesh.domain and mesh.lon must be >= 1, got {cfg.mesh.dp}, {cfg.mesh.domain} and "
                          f"{cfg.mesh.lon}")
    if cfg.mesh.dp_strategy not in ("allreduce", "fsdp"):
        raise ConfigError(f"mesh.dp_strategy={cfg.mesh.dp_strategy!r} is not one of ['allreduce', 'fsdp'] (fsdp shards "
                          f"parameters and optimizer state over the dp ranks with FSDP2)")
    two_d = cfg.data.kind == "grid" and list(cfg.data.shard_dims) == ["lat", "lon"]
    if cfg.mesh.lon > 1 and not two_d:
        raise ConfigError(f"mesh.lon={cfg.mesh.lon} shards longitude: it needs data.kind=grid and data.shard_dims=lat,lon")
    if cfg.data.kind == "grid" and list(cfg.data.shard_dims) not in (["lat"], ["lat", "lon"]):
        raise ConfigError(f"data.shard_dims={cfg.data.shard_dims} is not one of [lat] or [lat, lon]")
    if t.batch and t.batch % cfg.mesh.dp:
        raise ConfigError(f"train.batch={t.batch} must be a multiple of mesh.dp={cfg.mesh.dp} (each dp rank takes "
                          f"batch/dp samples per step)")
    if cfg.model.target:
        pass  # the user's model: its sizes come from the data, its contract is checked when it is built
    elif cfg.model.name not in (("unet",) if cfg.data.kind == "grid" else MESH_MODELS):
        raise ConfigError(f"model.name={cfg.model.name!r} does not fit data.kind={cfg.data.kind!r}: use transolver or "
                          f"meshgraphnet for mesh stores and unet for grid stores, or your own with "
                          f"model.target=package.module:Class")
    _check_edges(cfg, given)
    _check_compile(cfg)


def _check_compile(cfg: Config) -> None:
    """``train.compile``: static shapes only (one compiled graph for the whole run), so refused where a step's
    per-rank shapes change from sample to sample, and with what it has not been made to work with."""
    t, d, m = cfg.train, cfg.data, cfg.mesh
    if not t.compile:
        return
    if m.dp_strategy == "fsdp":
        raise ConfigError("train.compile=true with mesh.dp_strategy=fsdp: FSDP2's parameter gathers are not run "
                          "through domainflow.compile's checks; use mesh.dp_strategy=allreduce or train.compile=false")
    if t.checkpoint_activations:
        raise ConfigError("train.compile=true with train.checkpoint_activations=true: activation checkpointing is not "
                          "compiled; set one of them to false")
    if d.edges:
        raise ConfigError(f"train.compile=true compiles static shapes, and a graph model reads each sample whole with "
                          f"its edges (data.edges=true{', model.name=' + cfg.model.name if not cfg.model.target else ''}"
                          f"), whose points per rank change with every sample; set train.compile=false")
    if d.kind == "mesh" and not d.sample_points:
        raise ConfigError("train.compile=true compiles static shapes, and on this mesh store each sample has its own "
                          "number of points, so every step would compile anew; set data.sample_points=N (N points "
                          "of every sample, split evenly over the domain ranks), or train.compile=false")


def check_block_points(cfg: Config) -> None:
    """Block inference (``eval.block_points``, ``predict --block-points``) only for a model that has it: the
    Transolver, or a model.target's ``forward_blocks``, never across a graph's edges."""
    b, m = cfg.eval.block_points, cfg.model
    if b and m.name != "transolver" and not m.target:
        raise ConfigError(f"eval.block_points={b}: model {m.name!r} has no block inference (only transolver does); "
                          f"set eval.block_points=0")
    if b and cfg.data.edges:
        raise ConfigError(f"eval.block_points={b} cuts each sample into blocks of points, and data.edges=true passes "
                          f"messages across them; set eval.block_points=0")


def _check_edges(cfg: Config, given) -> None:
    """``data.edges``: on by itself for a built-in graph model; refused where no model takes the edges, on a grid
    and with a points budget (a drawn subset of the points has no graph)."""
    d, m = cfg.data, cfg.model
    graph = not m.target and m.name in GRAPH_MODELS
    if graph:
        if ("data", "edges") in given and not d.edges:
            raise ConfigError(f"data.edges=false: model.name={m.name} passes messages along the store's edges, so it "
                              f"reads them; remove data.edges=false")
        d.edges = True
    if not d.edges:
        return
    if d.kind != "mesh":
        raise ConfigError("data.edges=true reads a mesh store's edges; a grid store has none (set data.edges=false)")
    if not m.target and not graph:
        raise ConfigError(f"data.edges=true: model.name={m.name!r} takes no edges (its forward has no edges= "
                          f"keyword); set data.edges=false, or use model.name=meshgraphnet or a model.target whose "
                          f"forward takes edges=")
    if d.sample_points:
        raise ConfigError(f"data.sample_points={d.sample_points} draws a subset of each sample's points, which has "
                          f"no graph, and data.edges=true{' (model.name=' + m.name + ')' if graph else ''} reads "
                          f"the sample's edges; set data.sample_points=0")


def _parse_scalar(text: str):
    """A command-line value: JSON when it parses (numbers, true/false, lists), else the string."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        lowered = text.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return text


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def _did_you_mean(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
