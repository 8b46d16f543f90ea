"""``domainflow ingest cfd RAW STORE --recipe R``: CFD run folders -> a partitioned mesh store.

The recipe (``cfd_recipe``: DrivaerML, AhmedML, WindsorML built in, or a recipe.yaml) names the run
folders, each run's files and which arrays become which dimensionless fields.

Per run, a small dask graph (``run_graph``): a start task (files present, CSVs read); per location scan
tasks, one per ``--task-bytes`` of raw data, that stream the needed cell arrays of the surface (and volume,
its ``.part`` pieces read as one stream) block by block (``mesh_stream``): cell centres, normals and areas,
non-dimensionalised fields, NaN/Inf counted; a partition task (checks over all stretches, P spatially
compact contiguous parts; on several workers an RCB's subtrees and a merge as tasks of their own); a task
per column that writes it into the run's group in scratch; and a last task that moves the run into
``runs/<id>`` in one rename. One huge run thus uses every worker. Memory per worker is set by
``--memory-limit``, not by the run's size. ``reader="vtk"`` is the whole-file path (VTK reads each file whole,
any format VTK reads, through ``domainflow.vtk.pyvista_io``; the tests compare the streaming path with it). The coordinator then merges the train runs' statistics (in run order, so
1 or N workers give identical stores), records splits, fields and references, and marks the store
complete last. A rerun resumes: published runs are kept, the rest are redone.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from domainflow import remote
from domainflow.store.format import EDGE_PARTS, EDGES
from domainflow.vtk.errors import VtkFileError
from domainflow.vtk.partitioned import index_pieces
from domainflow.vtk.pieces import locate, pieces_of, whole_file
from domainflow.vtk.pyvista_io import (cell_centres, cell_connectivity, openfoam_group_patches, openfoam_pieces,
                                       openfoam_pieces_time, read_cells, surface_geometry)

from .errors import IngestError, RunError
from .mesh_edges import location_edges, side_keys
from .parallel import count_cells, peak_memory, release_free_memory, reset_peak_memory, run_graphs
from .partition import METHODS, check_parts, partition
from .cfd_recipe import LOCATIONS, FieldSpec, Recipe, load_recipe
from .reference import Reference
from .report import IngestReport
from .splits import check_fractions, read_split_file, split_runs
from .stats import RunningStats, merge_all
from .mesh_stream import (_warn_cp, block_cells_for, merge_subtrees, partition_location, partition_subtree,
                          remove_files, scan_cells, scan_tasks_for, write_column, write_edges)
from .store_writer import StoreWriter, write_array
from .raw_values import check_finite, read_csv_row

@dataclass
class MeshOptions:
    """Everything that shapes the store's contents (compared on resume) plus how to run."""

    parts: int = 64
    method: str = "rcb"
    reference: Reference | None = None  # None: the recipe's
    locations: tuple[str, ...] | None = None  # None: every location of the recipe
    recipe: Any = "drivaerml"  # a built-in recipe's name, a recipe.yaml path or a Recipe
    volume_points: int | None = None
    seed: int = 0
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    split_file: str | None = None
    chunk_bytes: int = 1 << 20
    workers: int = 1
    scheduler: str | None = None
    on_error: str = "stop"
    overwrite: bool = False
    staging: str | None = None  # a store at a URL is built here first, then uploaded (remote_upload.py)
    progress: bool = True
    memory_limit: int = 2 << 30  # per worker: sets the streaming block size
    task_bytes: int = 256 << 20  # a raw file larger than this is scanned by several tasks (same store)
    reader: str = "stream"       # "stream" (bounded memory) or "vtk" (whole file through VTK)
    edges: bool = False          # also store each location's cell adjacency (mesh_edges) for graph models

    def validate(self):
        self.recipe = load_recipe(self.recipe)
        if self.reference is None:
            self.reference = self.recipe.reference
        if self.locations is None:
            self.locations = tuple(loc for loc in LOCATIONS if loc in self.recipe.files)
        missing = [loc for loc in self.locations if loc not in self.recipe.files]
        if missing:
            raise IngestError(f"--locations {list(missing)}: recipe {self.recipe.name!r} has no such files (it has "
                              f"{sorted(self.recipe.files)})")
        check_parts(self.parts)
        if self.method not in METHODS:
            raise IngestError(f"unknown partition method {self.method!r}; choose one of {METHODS}")
        bad = [loc for loc in self.locations if loc not in LOCATIONS]
        if bad or not self.locations or len(set(self.locations)) != len(self.locations):
            raise IngestError(f"--locations must name some of {LOCATIONS}, each once, got {list(self.locations)}")
        if self.workers < 1:
            raise IngestError(f"--workers must be at least 1, got {self.workers}")
        if self.chunk_bytes < 64:
            raise IngestError(f"--chunk-bytes must be at least 64 (default 1 MiB), got {self.chunk_bytes}")
        if self.volume_points is not None and self.volume_points < 1:
            raise IngestError(f"--volume-points must be a positive cap, got {self.volume_points}")
        if self.memory_limit < 64 << 20:
            raise IngestError(f"--memory-limit must be at least 64 MiB (default 2 GiB), got {self.memory_limit} bytes")
        if self.task_bytes < 1 << 20:
            raise IngestError(f"--task-bytes must be at least 1 MiB (default 256 MiB), got {self.task_bytes} bytes")
        if self.reader not in ("stream", "vtk"):
            raise IngestError(f"reader must be 'stream' or 'vtk', got {self.reader!r}")
        if self.edges and self.volume_points and "volume" in self.locations:
            raise IngestError(f"--edges with --volume-points {self.volume_points}: a random subset of the volume's "
                              f"cells has no mesh adjacency; drop one of them (or --locations surface)")
        if self.on_error not in ("stop", "skip"):
            raise IngestError(f"--on-error must be 'stop' or 'skip', got {self.on_error!r}")
        self.split = check_fractions(self.split)

    def config(self) -> dict:
        # the DrivaerML recipe is what every store before recipes was ingested with: left out of the config,
        # so such a store still resumes (and a complete one is still "nothing to do"); stores written before
        # the rename record it as "layout" (RENAMED_CONFIG_KEYS: compared as "recipe")
        recipe = {} if self.recipe.to_attrs() == load_recipe("drivaerml").to_attrs() else \
            {"recipe": self.recipe.to_attrs()}
        return {"parts": self.parts, "partition": self.method, "reference": self.reference.to_attrs(), **recipe,
                "locations": list(self.locations), "volume_points": self.volume_points, "seed": self.seed,
                "split": list(self.split), "split_file": read_split_file(self.split_file),
                "chunk_bytes": self.chunk_bytes, **({"edges": True} if self.edges else {})}


# -- discovery ---------------------------------------------------------------------------------------
def discover_runs(raw: Path, recipe="drivaerml") -> dict[str, Path]:
    """``run_<i>`` -> its folder, for the recipe's run folders under ``raw``, in numeric order."""
    return load_recipe(recipe).discover(raw)


# -- one run: a graph of tasks (streaming) or one task (the whole-file path) ------------------------
def run_graph(run_dir: Path, run_id: str, store: Path, opts: MeshOptions):
    """The dask graph that ingests one run; its last task returns the run's summary. Streaming: a start
    task (files present, CSVs read), per location ``scan_tasks_for`` scan tasks, a partition task and a
    task per column, then a task that publishes the run. ``reader="vtk"``: one task."""
    import dask

    files = _files(run_dir, run_id, opts)
    if opts.reader != "stream" or not all(_streamable(files[loc]) for loc in opts.locations):
        # legacy .vtk and .pvtu/.pvtp have no streaming reader: VTK reads the run's files whole
        return dask.delayed(ingest_run, pure=False)(str(run_dir), run_id, str(store), opts)
    stage = dask.delayed(_stage, pure=False)
    block_cells = block_cells_for(opts.memory_limit)
    # names fixed here, in the graph: a stage that a cluster reruns (its worker died) reuses them
    token = uuid.uuid4().hex[:8]
    # the options as one graph node: dask would otherwise walk the dataclass in every task's arguments
    o = dask.delayed(opts, name=f"options-{run_id}-{token}", traverse=False)
    start = stage(_start_run, run_id, o, str(run_dir), run_id, str(store), token, o)
    locations = []
    for loc in opts.locations:
        pieces = scan_tasks_for(_raw_size(files[loc]), opts.task_bytes)
        tag = f"{run_id}-{loc}-{uuid.uuid4().hex[:8]}"
        scans = [stage(_scan, run_id, o, start, files[loc], loc, tag, i, pieces, block_cells, run_id, o)
                 for i in range(pieces)]
        depth = split_depth(pieces, opts)
        parted = stage(_partition, run_id, o, start, scans, files[loc], loc, tag, block_cells, depth, o)
        partition_tasks = [parted]
        if depth:  # the RCB's subtrees as tasks of their own (when the partition task finds it out of core)
            subtrees = [stage(_subtree, run_id, o, parted, j, o) for j in range(1 << depth)]
            partition_tasks += subtrees + [stage(_merge, run_id, o, start, parted, subtrees, tag, o)]
        columns = [stage(_column, run_id, o, partition_tasks[-1], key, loc, o) for key in column_keys(loc, opts)]
        if opts.edges:  # after the order column: the edges are numbered by the rows it gives each cell
            columns.append(stage(_edges, run_id, o, partition_tasks[-1], columns[column_keys(loc, opts).index("order")],
                                 start, tag, o))
        locations.append((loc, tag, scans, partition_tasks, columns))
    return dask.delayed(_finish_run, pure=False)(run_id, str(store), o, start, locations)


def _streamable(path: Path) -> bool:
    """A file the streaming reader reads in bounded memory: VTK XML ``.vtu``/``.vtp`` (or their .part pieces)."""
    return Path(path).suffix.lower() in (".vtu", ".vtp")


def split_depth(pieces: int, opts: MeshOptions) -> int:
    """Levels of the RCB the partition task does itself before its 2**depth subtrees go to their own tasks:
    none on one worker or for a location read by one scan task; else enough subtrees for the workers."""
    workers = 8 if opts.scheduler else opts.workers
    if opts.method != "rcb" or pieces < 2 or workers < 2:
        return 0
    return max(0, min(opts.parts.bit_length() - 2, (workers - 1).bit_length()))  # each subtree >= 2 parts


def column_keys(loc: str, opts: MeshOptions) -> list[str]:
    """The row columns a location's store group holds (``field/<name>`` for fields)."""
    return ["coords", "order"] + (["normals", "areas"] if loc == "surface" else []) + \
        [f"field/{s.name}" for s in opts.recipe.fields[loc]]


def _raw_size(path: Path) -> int:
    """Bytes of a raw file or of its .part pieces; 0 when absent or incomplete (its scan names the fault)."""
    try:
        return path.stat().st_size if path.exists() else sum(p.stat().st_size for p in pieces_of(path))
    except (IngestError, VtkFileError, OSError):
        return 0


def _failed(value) -> dict | None:
    """The first failure among a stage's inputs (a skipped run's record), looking into lists and tuples."""
    if isinstance(value, dict) and "error" in value:
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            bad = _failed(v)
            if bad is not None:
                return bad
    return None


def _run_failed(exc: Exception, run_id: str, opts: MeshOptions) -> dict:
    """A run's IngestError/OSError: its failure record under ``--on-error skip``, else raised as its RunError."""
    if opts.on_error == "skip":
        return {"run": run_id, "error": str(exc)}
    if isinstance(exc, RunError):
        raise exc
    raise RunError(run_id, str(exc)) from None


_TRIM_ABOVE = 32 << 20


def _stage(fn, run_id: str, opts: MeshOptions, *args):
    """Run one stage of a run's graph: passes an upstream failure on, turns an IngestError/OSError into
    the run's RunError (or, with ``--on-error skip``, into a failure record), times the stage."""
    bad = _failed(list(args))
    if bad is not None:
        return bad
    t0, started, rss0 = time.perf_counter(), time.time(), reset_peak_memory()
    try:
        out = fn(*args)
    except (IngestError, VtkFileError, OSError) as exc:
        return _run_failed(exc, run_id, opts)
    peak = peak_memory()
    if peak - rss0 > _TRIM_ABOVE:  # the next stage in this worker starts from what is live, not from this
        release_free_memory()  # one's heap (a trim costs about a millisecond: not after small stages)
    return {"out": out, "seconds": time.perf_counter() - t0, "started": started, "pid": os.getpid(),
            "peak_rss": peak, "start_rss": rss0}


def _start_run(run_dir: str, run_id: str, store: str, token: str, opts: MeshOptions) -> dict:
    """The run's files are there and its CSVs parse; the run group's scratch folder (``token`` names it, so a
    rerun of this stage finds the group the later stages write into)."""
    run_dir = Path(run_dir)
    files = _files(run_dir, run_id, opts)
    _check_present(run_dir, run_id, files, opts)
    attrs = _run_attrs(run_id, run_dir, files, opts)
    writer = StoreWriter(store)
    columns = writer.scratch / "columns"
    columns.mkdir(parents=True, exist_ok=True)
    folder = writer.new_run_folder(run_id, token)
    import zarr

    zarr.open_group(folder, mode="a", zarr_format=3)  # "a": a rerun keeps what later stages wrote
    return {"attrs": attrs, "folder": str(folder), "columns": str(columns)}


def _files(run_dir: Path, run_id: str, opts: MeshOptions) -> dict[str, Path]:
    return opts.recipe.files_of(run_dir, run_id)


def _scan(start: dict, path: Path, loc: str, tag: str, piece: int, pieces: int, block_cells: int,
          run_id: str, opts: MeshOptions) -> dict:
    return scan_cells(path, path, loc, opts.recipe.fields[loc], opts, run_id, Path(start["out"]["columns"]), tag, piece,
                      pieces, block_cells)


def _partition(start: dict, scans: list, path: Path, loc: str, tag: str, block_cells: int, depth: int,
               opts: MeshOptions) -> dict:
    return partition_location([s["out"] for s in scans], loc, path, opts, Path(start["out"]["folder"]),
                              Path(start["out"]["columns"]), tag, block_cells, depth)


def _subtree(parted: dict, j: int, opts: MeshOptions) -> dict | None:
    return partition_subtree(parted["out"], j, opts)


def _merge(start: dict, parted: dict, subtrees: list, tag: str, opts: MeshOptions) -> dict:
    return merge_subtrees(parted["out"], [s["out"] for s in subtrees], Path(start["out"]["columns"]), tag, opts)


def _column(parted: dict, key: str, loc: str, opts: MeshOptions) -> dict:
    field = next((s for s in opts.recipe.fields[loc] if key == f"field/{s.name}"), None)
    return write_column(parted["out"], key, opts, field, _cp_check(loc, field, opts))


def _edges(parted: dict, order_written: dict, start: dict, tag: str, opts: MeshOptions) -> dict:
    return write_edges(parted["out"], opts, Path(start["out"]["columns"]), tag)


def _cp_check(loc: str, field: FieldSpec | None, opts: MeshOptions) -> str | None:
    """The file's own Cp array that this field's values are compared with (the recipe's cp_check)."""
    check = opts.recipe.cp_check.get(loc)
    return check if check and field is not None and field.name == "Cp" and field.quantity == "pressure" else None


def _finish_run(run_id: str, store: str, opts: MeshOptions, start: dict, locations: list) -> dict:
    """The run's last task: publish its group (attrs, cells, statistics) in one rename, or, when a stage
    failed (``--on-error skip``), drop what the run left in scratch and return the failure."""
    stages = [start] + [x for _, _, scans, partition_tasks, columns in locations
                        for x in scans + partition_tasks + columns]
    bad = _failed(stages)
    if bad is not None:
        _drop_run_scratch(start, locations)
        return bad
    try:
        return _publish_run(run_id, store, start, locations, stages, opts)
    except (IngestError, VtkFileError, OSError) as exc:
        _drop_run_scratch(start, locations)
        return _run_failed(exc, run_id, opts)


def _publish_run(run_id: str, store: str, start: dict, locations: list, stages: list, opts: MeshOptions) -> dict:
    import zarr

    begun = start["out"]
    group = zarr.open_group(begun["folder"], mode="r+")
    stats, cells, edges, warnings, raw_bytes = {}, {}, {}, [], 0
    for loc, _, scans, partition_tasks, columns in locations:
        p = partition_tasks[-1]["out"]
        cells[loc], raw_bytes = p["rows"], raw_bytes + p["raw_bytes"]
        warnings += p["warnings"]
        for c in columns:
            stats.update({f"{loc}/{k}": v for k, v in c["out"]["stats"].items()})
            warnings += c["out"]["warnings"]
            if "edges" in c["out"]:
                edges[loc] = c["out"]["edges"]
        if opts.edges:
            _check_edges(Path(begun["folder"]) / loc, edges.get(loc), len(p["offsets"]))
        for key in column_keys(loc, opts) + ["part_boxes"]:  # every column written, in full, before it is published
            try:  # opened by its path: one metadata read
                rows = zarr.open_array(str(Path(begun["folder"]) / loc / key.replace("field/", "fields/")),
                                       mode="r").shape[0]
            except (FileNotFoundError, KeyError, ValueError, zarr.errors.BaseZarrError):
                rows = None
            if rows != (len(p["offsets"]) - 1 if key == "part_boxes" else p["rows"]):
                raise IngestError(f"{loc} column {key!r} of the run group is missing or short; the run is redone "
                                  f"on the next ingest")
        remove_files([p[k] for k in ("take", "group_of", "perm", "inner") if p.get(k)] + p.get("scratch", []) +
                     [f for s in scans for f in s["out"]["files"].values()])
    group.attrs.update({**begun["attrs"], "cells": cells, **({"edges": edges} if opts.edges else {}), "stats": stats,
                        "complete": True})
    StoreWriter(store).publish_run(Path(begun["folder"]), run_id)
    return {"run": run_id, "stats": stats, "cells": cells, "raw_bytes": raw_bytes, "warnings": warnings,
            "seconds": sum(x["seconds"] for x in stages), "started": min(x["started"] for x in stages),
            "pid": stages[0]["pid"], "pids": sorted({x["pid"] for x in stages}),
            "peak_rss": max(x["peak_rss"] for x in stages), "start_rss": min(x["start_rss"] for x in stages),
            "tasks": len(stages)}


def _check_edges(folder: Path, count: int | None, offsets: int) -> None:
    """A location's ``edges`` (``count`` rows) and ``edge_parts`` (one per part offset) are written in full."""
    import zarr

    try:
        shapes = [zarr.open_array(str(folder / name), mode="r").shape[0] for name in (EDGES, EDGE_PARTS)]
    except (FileNotFoundError, KeyError, ValueError, zarr.errors.BaseZarrError):
        shapes = None
    if count is None or shapes != [count, offsets]:
        raise IngestError(f"{folder.name} edges of the run group are missing or short; the run is redone on the "
                          f"next ingest")


def _drop_run_scratch(start: dict, locations: list) -> None:
    """Remove a failed run's half-built group and column files (each stage removes its own on error too)."""
    import shutil

    if "out" not in start:
        return
    shutil.rmtree(start["out"]["folder"], ignore_errors=True)
    columns = Path(start["out"]["columns"])
    for _, tag, *_ in locations:
        for f in columns.glob(f"{tag}.*"):
            f.unlink(missing_ok=True)


def _check_present(run_dir: Path, run_id: str, files: dict, opts: MeshOptions) -> None:
    needed = [k for k in opts.recipe.csv if k not in opts.recipe.optional_csv] + list(opts.locations)
    missing = [files[k] for k in needed if locate(files[k]) is None]
    if missing:
        present = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
        raise RunError(run_id, f"missing file(s) {[str(m) for m in missing]}; the folder holds {present}")


def _run_attrs(run_id: str, run_dir: Path, files: dict, opts: MeshOptions) -> dict:
    return {"run": int(run_id[4:]), "run_id": run_id, **opts.reference.to_attrs(),
            "fingerprint": fingerprint(files, opts), "folder": Path(run_dir).name,
            **{k: read_csv_row(files[k]) for k in opts.recipe.csv if files[k].exists()
               or k not in opts.recipe.optional_csv}}


def ingest_run(run_dir: str, run_id: str, store: str, opts: MeshOptions) -> dict:
    """Ingest one run folder into ``store``; returns its summary (stats, sizes, timing, peak memory)."""
    t0, started, rss0 = time.perf_counter(), time.time(), reset_peak_memory()
    try:
        summary = _ingest_run(Path(run_dir), run_id, StoreWriter(store), opts)
    except (IngestError, VtkFileError, OSError) as exc:
        return _run_failed(exc, run_id, opts)
    summary["seconds"] = time.perf_counter() - t0
    summary["started"], summary["pid"] = started, os.getpid()
    summary["peak_rss"], summary["start_rss"] = peak_memory(), rss0
    return summary


def _ingest_run(run_dir: Path, run_id: str, writer: StoreWriter, opts: MeshOptions) -> dict:
    """The whole-file path (``reader="vtk"``): VTK reads each file whole (the tests compare the streaming path with it)."""
    import zarr

    files = _files(run_dir, run_id, opts)
    _check_present(run_dir, run_id, files, opts)
    attrs = _run_attrs(run_id, run_dir, files, opts)
    raw_bytes = 0
    folder = writer.new_run_folder(run_id)
    group = zarr.open_group(folder, mode="w", zarr_format=3)
    stats, cells, edges, warnings = {}, {}, {}, []
    for loc in opts.locations:
        with whole_file(files[loc], scratch=writer.scratch) as path:
            raw_bytes += path.stat().st_size
            if loc in opts.recipe.blocks:  # a .vtm: the block files it reads
                raw_bytes += sum(os.path.getsize(p) for p in index_pieces(str(path), list(opts.recipe.blocks[loc]))[0])
            rows, arrays, sides = _read_location(loc, path, files[loc], run_id, opts, warnings)
        cells[loc] = len(rows["coords"])
        count_cells(cells[loc])
        loc_stats = _write_location(group, loc, rows, arrays, opts, sides, edges)
        stats.update({f"{loc}/{k}": v for k, v in loc_stats.items()})
    group.attrs.update({**attrs, "cells": cells, **({"edges": edges} if opts.edges else {}), "stats": stats,
                        "complete": True})
    writer.publish_run(folder, run_id)
    return {"run": run_id, "stats": stats, "cells": cells, "raw_bytes": raw_bytes, "warnings": warnings}


def fingerprint(files: dict, opts: MeshOptions) -> dict:
    """Size and modification time of every raw file a run is built from: a resume redoes a published run
    whose raw files changed since."""
    out = {}
    for key in list(opts.recipe.csv) + list(opts.locations):
        path = files[key]
        if key in opts.recipe.csv and not path.exists():
            continue  # an optional CSV this run lacks
        try:
            found = [path] if path.exists() else pieces_of(path)
            if key in opts.recipe.blocks and path.exists():  # a .vtm: its block files too
                found += [Path(p) for p in index_pieces(str(path), list(opts.recipe.blocks[key]))[0]]
        except VtkFileError as exc:  # a resume's check of a published run: ingest's own error
            raise IngestError(str(exc)) from None
        for p in found:
            st = p.stat()
            out[p.name if p.parent == path.parent else os.path.relpath(p, path.parent)] = [st.st_size, st.st_mtime_ns]
    return out


def _read_location(loc, path, shown_as, run_id, opts, warnings):
    specs = opts.recipe.fields[loc]
    cp_check = opts.recipe.cp_check.get(loc)
    openfoam = opts.recipe.openfoam_read(loc)
    arrays = {a: s.association for s in specs for a in s.sources}
    optional = (cp_check,) if cp_check else ()
    rows, raw, sides = _cells(loc, path, shown_as, arrays, optional, openfoam, opts)
    n_cells = len(rows["coords"])
    rows["order"] = np.arange(n_cells, dtype=np.int64)
    fields = {}
    for spec in specs:
        values = np.column_stack([np.asarray(raw[a], dtype=np.float32).reshape(n_cells, -1)
                                  for a in spec.sources])
        if values.shape[1] != spec.components:
            raise IngestError(f"{shown_as}: array {spec.source!r} has {values.shape[1]} components, "
                              f"expected {spec.components}")
        check_finite(values, f"{shown_as} array {spec.source!r}")
        scale, offset = spec.scale_offset(opts.reference)
        fields[spec.name] = (values - np.float32(offset)) * np.float32(1.0 / scale)
        check_finite(fields[spec.name], f"{shown_as} array {spec.source!r} made dimensionless (scale {scale:g})")
    for k, v in rows.items():
        check_finite(v, f"{shown_as} {k}")
    cp = next((s for s in specs if _cp_check(loc, s, opts)), None)
    if cp is not None and cp_check in raw:
        _compare_cp(fields[cp.name][:, 0], np.asarray(raw[cp_check], dtype=np.float64), shown_as, opts, warnings,
                    cp.source, cp_check)
    if loc == "volume" and opts.volume_points and n_cells > opts.volume_points:
        keep = np.sort(np.random.default_rng([opts.seed, int(run_id[4:])])
                       .choice(n_cells, opts.volume_points, replace=False))
        rows = {k: v[keep] for k, v in rows.items()}
        fields = {k: v[keep] for k, v in fields.items()}
    return rows, fields, sides


def _cells(loc, path, shown_as, arrays, optional, openfoam, opts):
    """(geometry rows, {array: values per cell}) of one location. A decomposed OpenFOAM case is read processor by
    processor and block by block, so one processor's block is in VTK's memory at a time, its rows in the order
    VTK's merged read gives (each block's processors in turn, block after block); anything else in one read."""
    fix = "set the recipe's data: to match"
    case = Path(path).parent.parent if openfoam else None  # an OpenFOAM case: its folder
    pieces = openfoam_pieces(case) if openfoam else []
    if not pieces:
        mesh, raw = read_cells(case or path, arrays, shown_as=shown_as, optional=optional, fix=fix, openfoam=openfoam,
                               blocks=opts.recipe.blocks.get(loc))
        return _geometry(loc, mesh, shown_as), raw, _sides(loc, mesh, shown_as, 0, opts)
    blocks, time = openfoam
    try:
        time = openfoam_pieces_time(case, pieces, time)
        # a group (group/wall) patch by patch, as VTK's merged reading orders it: each patch's processors in turn
        blocks = [p for b in blocks for p in (openfoam_group_patches(pieces, b, time) if b.startswith("group/")
                                              else [b])]
    except VtkFileError as exc:
        raise IngestError(str(exc)) from None
    parts = []
    for block in blocks:
        for piece in pieces:
            name = f"{shown_as} ({piece.name}, {block})"
            mesh, raw = read_cells(piece, arrays, shown_as=name, optional=optional, fix=fix,
                                   openfoam=((block,), time), allow_empty=True)
            if mesh.n_cells:
                first = sum(len(rows["coords"]) for rows, _, _ in parts)
                parts.append((_geometry(loc, mesh, name), raw, _sides(loc, mesh, name, first, opts)))
            del mesh
    if not parts:
        raise IngestError(f"{shown_as}: the OpenFOAM blocks {list(blocks)} hold no cells in any processor")
    found = set(parts[0][1])
    if any(set(raw) != found for _, raw, _ in parts):
        raise IngestError(f"{shown_as}: the processors' blocks hold different arrays; every one must hold "
                          f"{sorted(found)}")
    return ({k: np.concatenate([rows[k] for rows, _, _ in parts]) for k in parts[0][0]},
            {a: np.concatenate([np.asarray(raw[a]) for _, raw, _ in parts]) for a in found},
            [s for _, _, piece in parts for s in piece])


def _sides(loc, mesh, name, first: int, opts) -> list[dict]:
    """With ``--edges``: the side keys of a mesh's cells (``mesh_edges``), its cells numbered from ``first``."""
    if not opts.edges:
        return []
    sizes, conn, points, types = cell_connectivity(mesh, loc == "surface", name)
    sides = side_keys(sizes, conn, points, types, loc == "surface", name)
    return [{k: (keys, cells + first) for k, (keys, cells) in sides.items()}]


def _geometry(loc, mesh, name) -> dict:
    """The store's geometry rows of one location's cells (float32, the store's dtype)."""
    if loc == "surface":
        coords, normals, areas = surface_geometry(mesh, name)
        rows = {"coords": coords, "normals": normals, "areas": areas}
    else:
        rows = {"coords": cell_centres(mesh)}
    return {k: v.astype(np.float32) for k, v in rows.items()}


def _compare_cp(ours, theirs, name, opts, warnings, source: str, check: str):
    """Our Cp should match the file's own (``check``); a constant ratio means the reference values differ."""
    if not np.isfinite(theirs).all() or np.abs(ours).max() == 0:
        return
    _warn_cp(float(np.dot(theirs, ours) / np.dot(ours, ours)), name, opts, warnings, source, check)


def _write_location(group, loc, rows, fields, opts, sides=(), edges=None) -> dict:
    """Partition, reorder and write one location (with ``--edges`` its adjacency, its count into ``edges``);
    returns its per-array statistics."""
    part = partition(rows["coords"], opts.parts, opts.method)
    order = part.order
    sub = group.create_group(loc)
    if opts.edges:
        row_of = np.empty(len(order), np.int64)
        row_of[order] = np.arange(len(order))
        pairs, offsets = location_edges(list(sides), row_of, part.offsets)
        write_array(sub, EDGES, pairs, opts.chunk_bytes)
        write_array(sub, EDGE_PARTS, offsets, opts.chunk_bytes)
        edges[loc] = len(pairs)
    stats = {}
    for name in ("coords", "normals", "areas"):
        if name in rows:
            values = rows[name][order]
            write_array(sub, name, values, opts.chunk_bytes)
            stats[name] = RunningStats.of(values).to_attrs()
    write_array(sub, "order", rows["order"][order], opts.chunk_bytes)
    write_array(sub, "parts", part.offsets.astype(np.int64), opts.chunk_bytes)
    write_array(sub, "part_boxes", part.boxes.astype(np.float32), opts.chunk_bytes)
    fgroup = sub.create_group("fields")
    for name, values in fields.items():
        values = values[order]
        write_array(fgroup, name, values, opts.chunk_bytes)
        stats[name] = RunningStats.of(values).to_attrs()
    return stats


# -- the whole ingest -----------------------------------------------------------------------------
def ingest_cfd(raw, store, opts: MeshOptions | None = None, **kw) -> IngestReport:
    """Ingest every run folder of ``raw`` (``opts.recipe``'s, DrivaerML by default) into the mesh store
    ``store`` (resuming if partial)."""
    opts = opts or MeshOptions(**kw)
    if remote.is_url(store):  # built locally, then uploaded with its root metadata last
        from .remote_upload import ingest_to_url

        return ingest_to_url(ingest_cfd, raw, str(store), opts)
    opts.validate()
    t0 = time.perf_counter()
    raw, store = Path(raw).resolve(), Path(store).resolve()  # tasks may run in other working directories
    runs = opts.recipe.discover(raw)
    splits = split_runs(list(runs), opts.split, opts.seed, opts.split_file)
    wanted = [r for k in ("train", "val", "test") for r in splits[k]]
    wanted = [r for r in runs if r in set(wanted)]
    with StoreWriter(store) as writer:  # holds the store's writer lock until the end
        return _ingest_runs(writer, raw, store, runs, splits, wanted, opts, t0)


def _ingest_runs(writer: StoreWriter, raw: Path, store: Path, runs: dict, splits: dict, wanted: list,
                 opts: MeshOptions, t0: float) -> IngestReport:
    """The locked part of :func:`ingest_cfd`: open or resume, run the tasks, complete."""
    state = writer.open("mesh", str(raw.resolve()), opts.parts, opts.config(), overwrite=opts.overwrite)
    report = IngestReport(store=store, state=state)
    if state == "complete":
        report.seconds = time.perf_counter() - t0
        return report
    done = writer.finished_runs()
    for r in list(done):
        if r not in wanted or done[r].get("fingerprint") != fingerprint(_files(runs[r], r, opts), opts):
            writer.remove_run(r)  # left RAW, or its raw files changed since it was published
            why = "is no longer in RAW or the splits" if r not in wanted else "has raw files changed since ingest"
            report.warnings.append(f"{r} {why}; removed from the partial store (redone if still wanted)")
            del done[r]
    report.kept = [r for r in wanted if r in done]
    todo = [run_graph(runs[r], r, store, opts) for r in wanted if r not in done]
    summaries = {r: {"stats": done[r]["stats"], "cells": done[r]["cells"]} for r in report.kept}
    try:
        for out in run_graphs(todo, workers=opts.workers, scheduler=opts.scheduler, unit="run",
                             desc=f"ingest {raw.name}", progress=opts.progress):
            if "error" in out:
                report.skipped[out["run"]] = out["error"]
                continue
            report.tasks.append(out)
            report.written.append(out["run"])
            report.warnings += out["warnings"]
            summaries[out["run"]] = out
    except BaseException:
        # on this machine no task of ours runs any more (the pool has shut down; a cluster's futures are
        # cancelled): the failed runs' column files go now, their half-built groups when the next ingest
        # opens the store (which also removes anything a cancelled cluster task still wrote)
        shutil.rmtree(writer.scratch / "columns", ignore_errors=True)
        raise
    finally:
        report.seconds = time.perf_counter() - t0
    ok = {k: [r for r in v if r in summaries] for k, v in splits.items()}
    if not ok["train"]:
        raise IngestError(f"no train run was ingested ({len(report.skipped)} skipped); nothing to compute "
                          f"normalisation statistics from")
    stats = {}
    for key in sorted({k for s in summaries.values() for k in s["stats"]}):
        merged = merge_all(RunningStats.from_attrs(summaries[r]["stats"][key]) for r in ok["train"]
                           if key in summaries[r]["stats"])
        if merged is not None:
            stats[key] = merged.to_attrs()
    fields = {f"{loc}/{s.name}": s.attrs(loc, opts.reference) for loc in opts.locations
              for s in opts.recipe.fields[loc]}
    writer.complete({"fields": fields, "stats": stats, "splits": ok, "reference": opts.reference.to_attrs(),
                     "recipe": opts.recipe.name, "forces": force_attrs(opts.recipe), "skipped": report.skipped})
    report.seconds = time.perf_counter() - t0
    return report



def force_attrs(recipe: Recipe) -> dict:
    """What the metrics integrate forces with: the drag and lift axes (0, 1, 2) and the reference area."""
    f = recipe.forces
    return {"drag_axis": "xyz".index(f["drag"]), "lift_axis": "xyz".index(f["lift"]),
            "reference_area": f["reference_area"]}


ingest_drivaerml = ingest_cfd  # the DrivaerML recipe is the default
