"""The ``domainflow`` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _selfcheck(args) -> int:
    from domainflow.app.launch import launch_local, under_launcher
    from domainflow.app.selfcheck import rank_main, report

    call = (args.points, args.steps, args.lr, args.split, args.out)
    if under_launcher():
        res = rank_main(*call)
        return report(res, args.out) if res.get("rank") == 0 else 0
    results = launch_local(rank_main, args.nproc, *call)
    return report(results[0], args.out)


def _demo(args) -> int:
    from domainflow.train.demo import run_demo

    run_demo(args.out, climate=args.climate, tiny=args.tiny, nproc=args.nproc, fresh=args.fresh)
    return 0


def _train(args) -> int:
    from domainflow.train.config import load_config
    from domainflow.train.run import run_training

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
    from domainflow.train.tables import eval_table

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


def _plan(args) -> int:
    from domainflow.train.config import load_config
    from domainflow.train.plan import HEADROOM, PlanError, check_plannable, format_plan, make_plan, measure, plan_json

    overrides = list(args.overrides)
    if args.config is not None and "=" in args.config:  # no config file, only overrides
        overrides.insert(0, args.config)
        args.config = None
    cfg = load_config(args.config, overrides)
    headroom = HEADROOM if args.headroom is None else args.headroom
    for name, value, low in (("--points", args.points, 1), ("--max-domain", args.max_domain, 1),
                             ("--memory", args.memory, 1)):
        if value is not None and value < low:
            raise PlanError(f"{name} must be at least {low}, got {value}")
    if not (headroom >= 0 and headroom < 10):
        raise PlanError(f"--headroom is a fraction >= 0 of the prediction (e.g. 0.2), got {headroom}")
    _, largest_run, _ = check_plannable(cfg)
    points = args.points if args.points is not None else largest_run
    model = measure(cfg, args.sizes) if args.sizes is not None else measure(cfg)
    plan = make_plan(model, points, cfg.data.sample_points, args.memory, args.max_domain, headroom)
    print(format_plan(plan, cfg))
    if args.json:
        Path(args.json).write_text(json.dumps(plan_json(plan), indent=1))
    return 0


def _predict(args) -> int:
    from domainflow.app.launch import launch_local, under_launcher
    from domainflow.train.predict import checkpoint_kind, predict_config, predict_main

    if checkpoint_kind(args.checkpoint) == "grid":
        from domainflow.train.forecast import forecast_config, forecast_main

        if args.init is None or args.run:
            raise ValueError("a grid checkpoint forecasts from --init DATE[,DATE...] (or step indices) for --steps K "
                             "steps" + ("; --run names a run of a mesh store" if args.run else ""))
        call = (args.checkpoint, args.store, args.init, args.steps, args.out, args.domain, args.lon)
        if args.domain * args.lon == 1 or under_launcher():
            return forecast_main(*call)
        forecast_config(*call)  # errors known before ranks start
        launch_local(forecast_main, args.domain * args.lon, *call)
        return 0
    if not args.run or args.init is not None:
        raise ValueError("a mesh checkpoint predicts runs: give --run run_<i> (--init is for grid checkpoints)")
    runs = [r.strip() for item in args.run for r in item.split(",") if r.strip()]
    call = (args.checkpoint, args.store, runs, args.out, args.domain, args.block_points, args.pieces)
    if args.domain == 1 or under_launcher():
        return predict_main(*call)
    predict_config(args.checkpoint, args.store, runs, args.domain, args.block_points, args.out, args.pieces)  # before ranks start
    launch_local(predict_main, args.domain, *call)
    return 0


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def _bytes(text: str) -> int:
    """A size such as 2GiB, 512MiB, 1.5G or 1000000 (bytes)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB, 512MiB or 1500000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _floats(text: str, n: int, what: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != n:
        raise argparse.ArgumentTypeError(f"{what} takes {n} comma-separated numbers, got {text!r}")
    return vals


def _synth(args) -> int:
    if args.kind == "drivaerml":
        from domainflow.preprocess.synth_drivaerml import synth_drivaerml

        paths = synth_drivaerml(args.out, runs=args.runs, cells=args.cells, seed=args.seed,
                                volume_cells=args.volume_cells, volume_pieces=args.volume_pieces,
                                first_run=args.first_run, progress=not args.quiet)
        print(f"wrote {len(paths)} DrivaerML-layout runs under {args.out}")
    elif args.cds:
        from domainflow.preprocess.synth_cds import synth_cds

        path = synth_cds(args.out, grid=tuple(args.grid), steps=args.steps, seed=args.seed, dt_hours=args.dt_hours,
                         overwrite=args.overwrite)
        print(f"wrote {len(list(path.glob('*.nc')))} CDS-style netCDF files of a {args.grid[0]}x{args.grid[1]} climate "
              f"time series of {args.steps} steps to {path}")
    else:
        from domainflow.preprocess.synth_climate import synth_climate

        path = synth_climate(args.out, grid=tuple(args.grid), steps=args.steps, seed=args.seed,
                             dt_hours=args.dt_hours, time_chunk=args.time_chunk, overwrite=args.overwrite,
                             progress=not args.quiet)
        print(f"wrote a {args.grid[0]}x{args.grid[1]} climate time series of {args.steps} steps to {path}")
    return 0


def _ingest(args) -> int:
    common = dict(split=args.split, split_file=args.split_file, workers=args.workers,
                  scheduler=args.scheduler, overwrite=args.overwrite, progress=not args.quiet,
                  chunk_bytes=args.chunk_bytes, staging=args.staging)
    if args.kind in ("cfd", "drivaerml"):
        from dataclasses import replace

        from domainflow.preprocess.cfd_layout import load_layout, show_layout
        from domainflow.preprocess.errors import IngestError
        from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_cfd

        if getattr(args, "show_layout", None):
            print(show_layout(args.show_layout), end="")
            return 0
        if args.raw is None or args.store is None:
            raise IngestError("ingest cfd needs RAW (the folder of run folders) and STORE (the .zarr to write)")
        layout = load_layout(getattr(args, "layout", "drivaerml"))
        given = {k: getattr(args, k) for k in ("u_inf", "rho_inf", "p_inf", "l_ref") if getattr(args, k) is not None}
        locations = tuple(x for x in args.locations.split(",") if x) if args.locations else None
        opts = MeshOptions(parts=args.parts, method=args.partition, layout=layout,
                           reference=replace(layout.reference, **given), locations=locations,
                           volume_points=args.volume_points, seed=args.seed, on_error=args.on_error,
                           memory_limit=args.memory_limit, task_bytes=args.task_bytes, **common)
        report = ingest_cfd(args.raw, args.store, opts)
    else:
        from domainflow.preprocess.errors import IngestError
        from domainflow.preprocess.ingest_grid import GridOptions, ingest_climate

        if args.on_error != "stop":
            raise IngestError("--on-error skip is for mesh runs; a skipped time block would leave a hole in the "
                              "time axis (fix the source and rerun: finished blocks are kept)")
        variables = tuple(x for x in args.variables.split(",") if x) if args.variables else None
        try:
            levels = tuple(float(x) for x in args.levels.split(",") if x.strip()) if args.levels else None
        except ValueError:
            raise IngestError(f"--levels takes numbers in hPa, e.g. 500,850; got {args.levels!r}") from None
        opts = GridOptions(variables=variables, levels=levels, time_block=args.time_block, fill=args.fill,
                           static=tuple(x for x in args.static.split(",") if x) if args.static else None,
                           climatology_window=args.climatology_window, **common)
        report = ingest_climate(args.raw, args.store, opts)
    print(report.summary())
    return 0


def _inspect(args) -> int:
    from domainflow.preprocess.inspect_store import describe

    print(describe(args.store, domains=tuple(args.domain)))
    return 0


def _add_synth(sub):
    synth = sub.add_parser("synth", help="generate a synthetic raw data set in a real layout")
    kinds = synth.add_subparsers(dest="kind", required=True)
    d = kinds.add_parser("drivaerml", help="car-like bluff bodies in the DrivaerML run-folder layout")
    d.add_argument("out", help="folder to write run_<i>/ folders into")
    d.add_argument("--runs", type=int, default=8)
    d.add_argument("--cells", type=int, default=20000, help="surface cells per run (approximate)")
    d.add_argument("--volume-cells", type=int, default=None, help="volume cells per run (default: --cells)")
    d.add_argument("--volume-pieces", type=int, default=2, help="split volume files into N .part pieces")
    d.add_argument("--first-run", type=int, default=1)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    c = kinds.add_parser("climate", help="an ERA5-like (time, latitude, longitude) Zarr from a small simulation")
    c.add_argument("out", help="path of the Zarr store to write (with --cds: a folder of netCDF files)")
    c.add_argument("--cds", action="store_true",
                   help="write monthly netCDF files as the CDS delivers ERA5 (valid_time, packed int16, pressure "
                        "levels, SST missing over land, a land-sea mask) instead of an analysis-ready Zarr")
    c.add_argument("--grid", type=int, nargs=2, metavar=("H", "W"), default=(32, 64))
    c.add_argument("--steps", type=int, default=120)
    c.add_argument("--dt-hours", type=float, default=6)
    c.add_argument("--time-chunk", type=int, default=8)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_mesh_ingest_options(d):
    """The options of a mesh ingest (``ingest cfd`` and its alias ``ingest drivaerml``)."""
    d.add_argument("--parts", type=int, default=64, help="spatial parts per run, a power of two (default 64)")
    d.add_argument("--partition", choices=("rcb", "morton", "slab"), default="rcb")
    d.add_argument("--locations", default=None, help="surface,volume or one of them (default: the layout's)")
    d.add_argument("--volume-points", type=int, default=None,
                   help="cap volume cells per run (a seeded random subset; only these cells are read and checked)")
    d.add_argument("--memory-limit", type=_bytes, default=2 << 30,
                   help="memory per worker, e.g. 2GiB (default): sets the streaming block size")
    d.add_argument("--task-bytes", type=_bytes, default=256 << 20,
                   help="raw bytes per scan task, e.g. 256MiB (default): a larger file is read by several "
                        "tasks, so one huge run uses every worker (the store is the same)")
    d.add_argument("--seed", type=int, default=0, help="seed of the split and the volume subsample")
    d.add_argument("--u-inf", type=float, default=None,
                   help="free-stream speed, m/s (default: the layout's; DrivaerML 38.889, the paper's 140 km/h)")
    d.add_argument("--rho-inf", type=float, default=None,
                   help="density (default: the layout's; 1 where OpenFOAM wrote kinematic pressure and shear)")
    d.add_argument("--p-inf", type=float, default=None, help="free-stream pressure (default: the layout's)")
    d.add_argument("--l-ref", type=float, default=None, help="reference length, m (default: the layout's)")


def _add_ingest(sub):
    ingest = sub.add_parser("ingest", help="raw files -> a spatially partitioned Zarr store (resumable)")
    kinds = ingest.add_subparsers(dest="kind", required=True)
    parsers = [kinds.add_parser("cfd", help="CFD run folders (a layout: drivaerml, ahmedml, windsorml or a "
                                            "layout.yaml) -> a mesh store"),
               kinds.add_parser("climate", help="netCDF / GRIB files or a Zarr of climate data -> a grid store"),
               kinds.add_parser("drivaerml", help="the same as `ingest cfd --layout drivaerml`")]
    for p in parsers:
        if p is not parsers[1]:
            p.add_argument("raw", nargs="?" if p is parsers[0] else None, help="the folder of run folders")
        else:
            p.add_argument("raw", nargs="+", metavar="SOURCE",
                           help="netCDF or GRIB files, folders or globs of them (e.g. 'era5/*.nc'), or one Zarr store")
        p.add_argument("store", nargs="?" if p is parsers[0] else None,
                       help="the store to write: a folder ending in .zarr, or a URL (s3://bucket/cars.zarr)")
        p.add_argument("--workers", type=int, default=1, help="dask worker processes on this machine")
        p.add_argument("--scheduler", default=None, help="address of a running dask.distributed scheduler")
        p.add_argument("--split", default=(0.8, 0.1, 0.1), type=lambda text: _floats(text, 3, "--split"),
                       help="train,val,test fractions (default 0.8,0.1,0.1)")
        p.add_argument("--split-file", default=None, help='JSON {"train": [...], "val": [...], "test": [...]}')
        p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="target chunk size (default 1 MiB)")
        p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                       help="stop (default; the partial store resumes) or skip bad runs and record them")
        p.add_argument("--overwrite", action="store_true", help="replace an existing store")
        p.add_argument("--staging", default=None,
                       help="for a STORE at a URL (s3://, gs://): the local folder it is built in before the upload "
                            "(default: a folder under the temp dir, kept for a resume)")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    cfd, c, drivaerml = parsers
    cfd.add_argument("--layout", default="drivaerml",
                     help="the raw data's layout: drivaerml (default), ahmedml, windsorml, or a layout.yaml of your own "
                          "(run folders, files, arrays -> fields, units); --show-layout NAME prints one as a template")
    cfd.add_argument("--show-layout", default=None, metavar="NAME", help="print a built-in layout as YAML and exit")
    for d in (cfd, drivaerml):
        _add_mesh_ingest_options(d)
    c.add_argument("--variables", default=None,
                   help="comma-separated variables (all their levels) or channels such as z500 (default: all)")
    c.add_argument("--levels", default=None,
                   help="comma-separated pressure levels in hPa of the level variables, e.g. 500,850 (default: all)")
    c.add_argument("--time-block", type=int, default=None, help="time steps per task (default: source chunk)")
    c.add_argument("--static", default=None,
                   help="comma-separated constant fields (e.g. lsm,z: land-sea mask, orography), from (lat, lon) "
                        "variables or (time, lat, lon) ones that never change; stored apart and added to the model's "
                        "inputs")
    c.add_argument("--fill", default=None,
                   help="missing values (NaN, _FillValue): refused by default; 'mean' (the train mean of the valid "
                        "values), a number, or per variable/channel, e.g. sst=mean or sst=271.46,tcwv=0; the store "
                        "records the policy and count")
    c.add_argument("--climatology-window", type=int, default=61,
                   help="days around each day of year averaged into the train climatology (default 61, as "
                        "WeatherBench 2)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="domainflow", description="Domain-parallel scientific ML.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: synth -> ingest -> domain-parallel training -> evaluation")
    demo.add_argument("--climate", action="store_true", help="the grid path (periodic UNet on an ERA5-like series)")
    demo.add_argument("--tiny", action="store_true", help="a seconds-long version (what CI runs)")
    demo.add_argument("--nproc", type=int, default=2, help="domain ranks to start (default 2)")
    demo.add_argument("--out", default="demo_output")
    demo.add_argument("--fresh", action="store_true", help="delete --out first (default: reuse data made before)")
    check = sub.add_parser("selfcheck", help="train a per-point model on a sharded surface, compared with one "
                                             "process after every step")
    check.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2)")
    check.add_argument("--points", type=int, default=6000)
    check.add_argument("--steps", type=int, default=150)
    check.add_argument("--lr", type=float, default=3e-3)
    check.add_argument("--split", type=float, default=0.62, help="fraction of points on rank 0 (uneven shards)")
    check.add_argument("--out", default="selfcheck_output")
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
    plan = sub.add_parser("plan", help="measure a config's step at domain 1 and predict the memory per rank at "
                                       "every domain size")
    plan.add_argument("config", nargs="?", default=None, help="YAML or TOML config (as for train)")
    plan.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.dim=128 data.store=cars.zarr")
    plan.add_argument("--points", type=int, default=None,
                      help="points of a sample (default: the largest training run of the store)")
    plan.add_argument("--memory", type=_bytes, default=None,
                      help="memory per rank, e.g. 80GiB: also print the smallest domain size that fits it")
    plan.add_argument("--max-domain", type=int, default=64, help="largest domain size to consider (default 64)")
    plan.add_argument("--sizes", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                      help="points of the measured samples (default 16384,32768)")
    plan.add_argument("--headroom", type=float, default=None,
                      help="share of the prediction added for the allocator when deciding what fits (default 0.2)")
    plan.add_argument("--json", default=None, help="also write the plan to this JSON file")
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
    pred.add_argument("--block-points", type=int, default=None,
                      help="forward in blocks of this many points over the domain, each rank its share, in "
                           "bounded memory (default: the "
                           "checkpoint's eval.block_points; 0: the whole run at once)")
    _add_synth(sub)
    _add_ingest(sub)
    insp = sub.add_parser("inspect", help="describe a store: runs, arrays, stats, splits, partition balance")
    insp.add_argument("store")
    insp.add_argument("--domain", type=int, nargs="+", default=[1, 2, 3, 4, 8],
                      help="domain sizes to show the partition balance for")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in ("train", "plan") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra  # overrides given after options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    run = {"demo": _demo, "selfcheck": _selfcheck, "synth": _synth, "ingest": _ingest, "inspect": _inspect,
           "train": _train, "plan": _plan, "predict": _predict}[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        if args.command == "ingest":
            print("interrupted; the store is a valid partial store: rerun the same command to resume",
                  file=sys.stderr)
        elif args.command == "train":
            print("interrupted; rerun with --resume to continue from the last checkpoint", file=sys.stderr)
        else:
            print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        import os

        from domainflow.preprocess.errors import IngestError, RunError

        if (args.command == "selfcheck" and not isinstance(exc, IngestError)) or os.environ.get("DOMAINFLOW_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        if isinstance(exc, RunError):
            print("the store is left partial and valid; fix the problem and rerun the same command to resume "
                  "(or pass --on-error skip)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
