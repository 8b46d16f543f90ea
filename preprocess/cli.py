"""The data subcommands of ``domainflow``: ``synth`` (synthetic raw data in real data sets' formats), ``ingest``
(raw files -> a partitioned store, resumable) and ``inspect`` (what a store holds). ``domainflow.app.cli``
assembles them with the other subsystems' commands."""

from __future__ import annotations

import argparse

from domainflow.cli_values import parse_bytes, parse_floats

INTERRUPTED_INGEST = "interrupted; the store is a valid partial store: rerun the same command to resume"


def add_commands(sub) -> None:
    """Add ``synth``, ``ingest`` and ``inspect`` to the ``domainflow`` command's subparsers ``sub``."""
    _add_synth(sub)
    _add_ingest(sub)
    insp = sub.add_parser("inspect", help="describe a store: runs, arrays, stats, splits, partition balance")
    insp.add_argument("store")
    insp.add_argument("--domain", type=int, nargs="+", default=[1, 2, 3, 4, 8],
                      help="domain sizes to show the partition balance for")
    insp.set_defaults(handler=_inspect)


def after_error(exc) -> str | None:
    """What to tell a user after an ingest's error (a run that failed leaves a resumable store)."""
    from .errors import RunError

    if isinstance(exc, RunError):
        return ("the store is left partial and valid; fix the problem and rerun the same command to resume "
                "(or pass --on-error skip)")
    return None


def _synth(args) -> int:
    if args.kind == "drivaerml":
        from .synth_drivaerml import synth_drivaerml

        paths = synth_drivaerml(args.out, runs=args.runs, cells=args.cells, seed=args.seed,
                                volume_cells=args.volume_cells, volume_pieces=args.volume_pieces,
                                first_run=args.first_run, progress=not args.quiet)
        print(f"wrote {len(paths)} DrivaerML-style runs under {args.out}")
    elif args.cds:
        from .synth_cds import synth_cds

        path = synth_cds(args.out, grid=tuple(args.grid), steps=args.steps, seed=args.seed, dt_hours=args.dt_hours,
                         overwrite=args.overwrite)
        print(f"wrote {len(list(path.glob('*.nc')))} CDS-style netCDF files of a {args.grid[0]}x{args.grid[1]} climate "
              f"time series of {args.steps} steps to {path}")
    else:
        from .synth_climate import synth_climate

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

        from .cfd_recipe import load_recipe, show_recipe
        from .errors import IngestError
        from .ingest_mesh import MeshOptions, ingest_cfd

        if getattr(args, "show_recipe", None):
            print(show_recipe(args.show_recipe), end="")
            return 0
        if args.raw is None or args.store is None:
            raise IngestError("ingest cfd needs RAW (the folder of run folders) and STORE (the .zarr to write)")
        recipe = load_recipe(getattr(args, "recipe", "drivaerml"))
        given = {k: getattr(args, k) for k in ("u_inf", "rho_inf", "p_inf", "l_ref") if getattr(args, k) is not None}
        locations = tuple(x for x in args.locations.split(",") if x) if args.locations else None
        opts = MeshOptions(parts=args.parts, method=args.partition, recipe=recipe,
                           reference=replace(recipe.reference, **given), locations=locations,
                           volume_points=args.volume_points, seed=args.seed, on_error=args.on_error,
                           memory_limit=args.memory_limit, task_bytes=args.task_bytes, edges=args.edges, **common)
        report = ingest_cfd(args.raw, args.store, opts)
    else:
        from .errors import IngestError
        from .ingest_grid import GridOptions, ingest_climate

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
                           member=args.member,
                           climatology_window=args.climatology_window, **common)
        report = ingest_climate(args.raw, args.store, opts)
    print(report.summary())
    return 0


def _inspect(args) -> int:
    from .inspect_store import describe

    print(describe(args.store, domains=tuple(args.domain)))
    return 0


def _add_synth(sub):
    synth = sub.add_parser("synth", help="generate a synthetic raw data set in a real data set's format")
    synth.set_defaults(handler=_synth)
    kinds = synth.add_subparsers(dest="kind", required=True)
    d = kinds.add_parser("drivaerml", help="car-like bluff bodies in DrivaerML's run folders and file names")
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
    d.add_argument("--locations", default=None, help="surface,volume or one of them (default: the recipe's)")
    d.add_argument("--volume-points", type=int, default=None,
                   help="cap volume cells per run (a seeded random subset; only these cells are read and checked)")
    d.add_argument("--edges", action="store_true",
                   help="also store each run's cell adjacency (cells sharing a face; on a surface an edge) as graph "
                        "edges, partitioned with the cells, for graph models such as model.name=meshgraphnet")
    d.add_argument("--memory-limit", type=parse_bytes, default=2 << 30,
                   help="memory per worker, e.g. 2GiB (default): sets the streaming block size")
    d.add_argument("--task-bytes", type=parse_bytes, default=256 << 20,
                   help="raw bytes per scan task, e.g. 256MiB (default): a larger file is read by several "
                        "tasks, so one huge run uses every worker (the store is the same)")
    d.add_argument("--seed", type=int, default=0, help="seed of the split and the volume subsample")
    d.add_argument("--u-inf", type=float, default=None,
                   help="free-stream speed, m/s (default: the recipe's; DrivaerML 38.889, the paper's 140 km/h)")
    d.add_argument("--rho-inf", type=float, default=None,
                   help="density (default: the recipe's; 1 where OpenFOAM wrote kinematic pressure and shear)")
    d.add_argument("--p-inf", type=float, default=None, help="free-stream pressure (default: the recipe's)")
    d.add_argument("--l-ref", type=float, default=None, help="reference length, m (default: the recipe's)")


def _add_ingest(sub):
    ingest = sub.add_parser("ingest", help="raw files -> a spatially partitioned Zarr store (resumable)")
    ingest.set_defaults(handler=_ingest, interrupted=INTERRUPTED_INGEST)
    kinds = ingest.add_subparsers(dest="kind", required=True)
    parsers = [kinds.add_parser("cfd", help="CFD run folders (a recipe: drivaerml, ahmedml, windsorml, openfoam or a "
                                            "recipe.yaml) -> a mesh store"),
               kinds.add_parser("climate", help="netCDF / GRIB files or a Zarr of climate data -> a grid store"),
               kinds.add_parser("drivaerml", help="the same as `ingest cfd --recipe drivaerml`")]
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
        p.add_argument("--split", default=(0.8, 0.1, 0.1), type=lambda text: parse_floats(text, 3, "--split"),
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
    cfd.add_argument("--recipe", default="drivaerml",
                     help="how to read the raw data: drivaerml (default), ahmedml, windsorml, openfoam (case folders), or a recipe.yaml of your "
                          "own (run folders, files, arrays -> fields, units); --show-recipe NAME prints one as a template")
    cfd.add_argument("--show-recipe", default=None, metavar="NAME", help="print a built-in recipe as YAML and exit")
    # the names before issue 36 (a "layout" is a ShardTensor's sharding now): still accepted, not shown
    cfd.add_argument("--layout", dest="recipe", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    cfd.add_argument("--show-layout", dest="show_recipe", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
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
    c.add_argument("--member", type=float, default=None,
                   help="the ensemble member to keep (its number, e.g. 0 for ERA5's control), for a source that "
                        "holds an ensemble; one store per member")
    c.add_argument("--fill", default=None,
                   help="missing values (NaN, _FillValue): refused by default; 'mean' (the train mean of the valid "
                        "values), a number, or per variable/channel, e.g. sst=mean or sst=271.46,tcwv=0; the store "
                        "records the policy and count")
    c.add_argument("--climatology-window", type=int, default=61,
                   help="days around each day of year averaged into the train climatology (default 61, as "
                        "WeatherBench 2)")
