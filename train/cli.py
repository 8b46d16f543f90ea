"""The training subcommands of ``domainflow``: ``demo`` (the main job, end to end), ``train``, ``estimate`` (memory
per rank at every domain size; ``plan``, its name before issue 36, is a hidden alias) and ``predict`` (surface fields
for ParaView, or a grid model's forecast). ``domainflow.app.cli`` assembles them with the other subsystems'
commands."""

from __future__ import annotations

import json
from pathlib import Path

from domainflow.cli_values import parse_bytes

INTERRUPTED_TRAIN = "interrupted; rerun with --resume to continue from the last checkpoint"
HIDDEN_COMMANDS = ("plan",)  # earlier names that still work, left out of the help: plan is estimate


def add_demo(sub) -> None:
    """Add ``demo`` to the ``domainflow`` command's subparsers ``sub``."""
    demo = sub.add_parser("demo", help="the main job: synth -> ingest -> domain-parallel training -> evaluation")
    demo.add_argument("--climate", action="store_true", help="the grid path (periodic UNet on an ERA5-like series)")
    demo.add_argument("--tiny", action="store_true", help="a seconds-long version (what CI runs)")
    demo.add_argument("--nproc", type=int, default=2, help="domain ranks to start (default 2)")
    demo.add_argument("--out", default="demo_output")
    demo.add_argument("--fresh", action="store_true", help="delete --out first (default: reuse data made before)")
    demo.set_defaults(handler=_demo)


def add_commands(sub) -> None:
    """Add ``train``, ``estimate`` (and its hidden alias ``plan``) and ``predict`` to the ``domainflow`` command's
    subparsers ``sub``; ``train`` and ``estimate`` take ``section.key=value`` overrides after their options too."""
    from .config import COMPILE_BACKENDS

    train = sub.add_parser("train", help="train a model on a store (config file + key=value overrides)")
    train.add_argument("config", nargs="?", default=None, help="YAML or TOML config (default: built-in defaults)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=200 data.store=cars.zarr")
    train.add_argument("--nproc", type=int, default=None,
                       help="local ranks to start (default: dp x domain; alone, it sets the domain size)")
    train.add_argument("--dp", type=int, default=None, help="data-parallel size (mesh.dp)")
    train.add_argument("--domain", type=int, default=None, help="ranks per sample (mesh.domain)")
    train.add_argument("--out", default=None, help="output folder (output.dir)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output "
                                                             "(of the same run: other settings are refused by name)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace a training already in the output folder (without it, a folder holding "
                            "checkpoints is refused)")
    train.add_argument("--init-from", default=None, metavar="CKPT",
                       help="start from the weights (and input scaling) of another run's checkpoint: fine-tuning, with "
                            "a fresh optimizer at step 0")
    estimate = sub.add_parser("estimate", help="measure a config's step at domain 1 and estimate the memory per "
                                               "rank at every domain size")
    # ``plan``: the name before issue 36, the same command; no help, so the command list leaves it out
    old = sub.add_parser("plan", description="the same as `domainflow estimate` (its earlier name)")
    for est in (estimate, old):
        est.add_argument("config", nargs="?", default=None, help="YAML or TOML config (as for train)")
        est.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.dim=128 data.store=cars.zarr")
        est.add_argument("--points", type=int, default=None,
                         help="points of a sample (default: the largest training run of the store)")
        est.add_argument("--memory", type=parse_bytes, default=None,
                         help="memory per rank, e.g. 80GiB: also print the smallest domain size that fits it")
        est.add_argument("--max-domain", type=int, default=64, help="largest domain size to consider (default 64)")
        est.add_argument("--sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                         help="points of the measured samples (default 16384,32768)")
        est.add_argument("--headroom", type=float, default=None,
                         help="share of the prediction added for the allocator when deciding what fits (default 0.2)")
        est.add_argument("--json", default=None, help="also write the estimate to this JSON file")
        est.set_defaults(handler=_estimate, overrides_anywhere=True)
    pred = sub.add_parser("predict", help="write runs' predicted, true and error surface fields for ParaView, or a "
                                          "grid model's forecast as a Zarr / netCDF dataset")
    pred.add_argument("checkpoint", help="a step_<n> checkpoint folder, or the checkpoints folder (latest)")
    pred.add_argument("store")
    pred.add_argument("--run", action="append", help="mesh: run id in the store, e.g. run_3; repeat it "
                                                     "(or give run_1,run_2) for several: OUT is a .pvd")
    pred.add_argument("out", help="mesh: run_3.vtp (one file, assembled on one rank), run_3.pvtp (a piece per rank "
                                  "and their index) or runs.pvd (a collection, one file per run in the folder runs/); "
                                  "grid: forecast.zarr or forecast.nc")
    pred.add_argument("--init", default=None, help="grid: initial time(s), dates such as 2020-03-01T06 or step "
                                                   "indices, comma-separated")
    pred.add_argument("--steps", type=int, default=1, help="grid: steps of the rollout (each data.lead store steps)")
    pred.add_argument("--lon", type=int, default=1, help="grid: ranks over longitude too (a domain x lon mesh)")
    pred.add_argument("--pieces", action="store_true", help="with a .pvd: each run as a .pvtp of per-rank pieces")
    pred.add_argument("--domain", type=int, default=1, help="ranks to split the surface over (default 1)")
    pred.add_argument("--trust-model-target", action="store_true",
                      help="build a checkpoint's own model (model.target: code outside domainflow) by importing it")
    pred.add_argument("--block-points", type=int, default=None,
                      help="forward in blocks of this many points over the domain, each rank its share, in "
                           "bounded memory (default: the "
                           "checkpoint's eval.block_points; 0: the whole run at once)")
    pred.add_argument("--compile", action="store_true",
                      help="grid: run the forecast's model through domainflow.compile (torch.compile): one compile, "
                           "then every step of the rollout")
    pred.add_argument("--compile-backend", default=None, choices=COMPILE_BACKENDS,
                      help="the backend of --compile (default inductor; given alone, it implies --compile)")
    train.set_defaults(handler=_train, interrupted=INTERRUPTED_TRAIN, overrides_anywhere=True)
    pred.set_defaults(handler=_predict)


def _demo(args) -> int:
    from .demo import run_demo

    run_demo(args.out, climate=args.climate, tiny=args.tiny, nproc=args.nproc, fresh=args.fresh)
    return 0


def _train(args) -> int:
    from .config import load_config
    from .run import run_training

    overrides = list(args.overrides)
    if args.config is not None and "=" in args.config:  # no config file, only overrides
        overrides.insert(0, args.config)
        args.config = None
    if args.dp is not None:
        overrides.append(f"mesh.dp={args.dp}")
    if args.domain is not None:
        overrides.append(f"mesh.domain={args.domain}")
    if args.out is not None:
        overrides.append(f"output.dir={args.out}")
    cfg = load_config(args.config, overrides)
    if args.nproc and cfg.mesh.size == 1 and args.nproc > 1:
        cfg.mesh.domain = args.nproc  # --nproc alone: all ranks on one sample's domain
    result = run_training(cfg, nproc=args.nproc, resume=args.resume, init_from=args.init_from,
                          overwrite=args.overwrite)
    print(train_report(result, cfg))
    return 0


def train_report(result: dict, cfg) -> str:
    """What ``train`` prints at the end: the evaluation table, the figures and where everything is (the whole
    result stays in result.json)."""
    from .tables import eval_table

    summ = result.get("eval", {}).get("summary") or {}
    lines = [f"trained {result['steps']} steps; final training loss {result['loss']}"]
    if summ:
        lines.append(f"evaluation on {cfg.data.val_split} ({summ.get('samples', 0)} samples):")
        lines += ["  " + line for line in eval_table(summ, cfg.data.kind)]
    lines += [f"figure: {f}" for f in result.get("figures", [])]
    out = Path(result["out"])
    lines.append(f"output: {out} (result.json, metrics.jsonl, checkpoints/"
                 + "".join(f", {n}/" for n in ("tensorboard", "mlruns") if (out / n).exists()) + ")")
    return "\n".join(lines)


def _estimate(args) -> int:
    from .config import load_config
    from .estimate import (HEADROOM, EstimateError, check_measurable, estimate_json, format_estimate, make_estimate,
                           measure)

    overrides = list(args.overrides)
    if args.config is not None and "=" in args.config:  # no config file, only overrides
        overrides.insert(0, args.config)
        args.config = None
    cfg = load_config(args.config, overrides)
    headroom = HEADROOM if args.headroom is None else args.headroom
    for name, value, low in (("--points", args.points, 1), ("--max-domain", args.max_domain, 1),
                             ("--memory", args.memory, 1)):
        if value is not None and value < low:
            raise EstimateError(f"{name} must be at least {low}, got {value}")
    if not (headroom >= 0 and headroom < 10):
        raise EstimateError(f"--headroom is a fraction >= 0 of the prediction (e.g. 0.2), got {headroom}")
    _, largest_run, _ = check_measurable(cfg)
    points = args.points if args.points is not None else largest_run
    model = measure(cfg, args.sizes) if args.sizes is not None else measure(cfg)
    estimate = make_estimate(model, points, cfg.data.sample_points, args.memory, args.max_domain, headroom)
    print(format_estimate(estimate, cfg))
    if args.json:
        Path(args.json).write_text(json.dumps(estimate_json(estimate), indent=1))
    return 0


def _predict(args) -> int:
    from domainflow.launch import launch_local, under_launcher
    from .predict import checkpoint_kind, predict_config, predict_main
    from .run import COMPILE_MODULES, RANK_MODULES

    if checkpoint_kind(args.checkpoint) == "grid":
        from .forecast import forecast_config, forecast_main

        if args.init is None or args.run:
            raise ValueError("a grid checkpoint forecasts from --init DATE[,DATE...] (or step indices) for --steps K "
                             "steps" + ("; --run names a run of a mesh store" if args.run else ""))
        call = (args.checkpoint, args.store, args.init, args.steps, args.out, args.domain, args.lon,
                args.trust_model_target, _compile_backend(args))
        if args.domain * args.lon == 1 or under_launcher():
            return forecast_main(*call)
        forecast_config(*call)  # errors known before ranks start
        launch_local(forecast_main, args.domain * args.lon, *call,
                     preload=RANK_MODULES + (COMPILE_MODULES if _compile_backend(args) else ()))
        return 0
    if _compile_backend(args):
        raise ValueError("--compile compiles static shapes, and every run of a mesh store has its own points per "
                         "rank: each would compile anew for one forward; predict mesh runs without --compile (a "
                         "grid forecast's rollout is what --compile speeds up)")
    if not args.run or args.init is not None:
        raise ValueError("a mesh checkpoint predicts runs: give --run run_<i> (--init is for grid checkpoints)")
    runs = [r.strip() for item in args.run for r in item.split(",") if r.strip()]
    call = (args.checkpoint, args.store, runs, args.out, args.domain, args.block_points, args.pieces,
            args.trust_model_target)
    if args.domain == 1 or under_launcher():
        return predict_main(*call)
    predict_config(args.checkpoint, args.store, runs, args.domain, args.block_points, args.out, args.pieces,
                   args.trust_model_target)  # errors known before ranks start
    launch_local(predict_main, args.domain, *call, preload=RANK_MODULES)
    return 0


def _compile_backend(args) -> str | None:
    """predict's compile backend (None: eager): ``--compile`` or ``--compile-backend`` (which implies it)."""
    return args.compile_backend or ("inductor" if args.compile else None)
