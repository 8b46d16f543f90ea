"""Predict runs' surface fields with a trained model and write them for ParaView, no rank gathering a run.

Each rank predicts its own cells and writes them as a piece, in original cell order within the piece (the
store's ``order``): the polygons of those cells when the raw ``boundary_<i>.vtp`` that ingest read is still at
the store's source path, else vertices at the cell centres; ``<field>_pred``, ``_true``, ``_err`` and
``cell_id`` as cell data (``predict_output``). The pieces stay, listed by a ``.pvtp``, or are streamed into
one ``.vtp`` on the first rank (the raw file's own points and polygons, every array in original cell order);
several runs go into a ``.pvd`` collection. ``predict_run`` (the whole run on the first rank) is what the
training figures use on a small validation run.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

import domainflow as df

from . import checkpoint as ckpt
from .config import Config, check_block_points, from_dict
from .build import build_model
from . import normalization
from .data import build_dataset, check_edges, make_batch, param_stats
from .inference import infer


@torch.no_grad()
def predict_run(model, cfg: Config, mesh, run: str, norm: dict | None = None) -> dict | None:
    """Predicted and true fields of ``run`` in original cell order, physical (non-dimensional) units, the inputs
    scaled by the model's normalisation ``norm`` (None: the store's); the arrays on the first rank, None
    elsewhere (every rank takes part in the forward)."""
    ds = build_dataset(cfg, mesh, None, shuffle=False, runs=[run], extra_inputs=["order"], norm=norm)
    sample = next(ds.samples([(run, 1.0)]))
    batch = make_batch(cfg, ds, sample, _param_scale(norm, ds))
    pred = infer(model, batch, cfg)
    out, k = {}, 0
    for f in ds.fields:
        c = int(ds.store.fields[f"{ds.location}/{f}"].get("components", 1))
        out[f"{f}_pred"] = ds.denormalize(f, pred[0, :, k:k + c]).full_tensor()
        out[f"{f}_true"] = ds.denormalize(f, sample[f]).full_tensor()
        k += c
    coords = ds.denormalize("coords", sample["coords"]).full_tensor() if "coords" in ds.inputs else None
    order = sample["order"].full_tensor().reshape(-1).long()
    if torch.distributed.get_rank() != 0:
        return None
    arrays = {}
    for name, v in out.items():
        back = torch.empty_like(v)
        back[order] = v
        arrays[name] = back.cpu().numpy()
    result = {"run": run, "arrays": arrays}
    if coords is not None:
        c = torch.empty_like(coords)
        c[order] = coords
        result["coords"] = c.cpu().numpy()
    return result


def raw_surface_path(store, run: str, n_cells: int | None = None) -> Path | None:
    """The raw surface file ingest read for ``run``, if it is still where the store says, reads as VTK XML
    and (given ``n_cells``) has that many polygons; else None."""
    from domainflow.vtk.xml_reader import VtkXmlFile

    source = store.attrs.get("domainflow", {}).get("source")
    if not source:
        return None
    # the recipe it was ingested with ("layout" in stores written before the rename; a store without one:
    # DrivaerML's run_<i>/boundary_<i>.vtp)
    config = store.attrs.get("ingest", {}).get("config", {})
    recipe = config.get("recipe") or config.get("layout") or \
        {"runs": "run_{i}", "files": {"surface": "boundary_{i}.vtp"}}
    template = recipe.get("files", {}).get("surface")
    try:
        folder = str(store.run(run).attrs.get("folder", run))
    except Exception:  # noqa: BLE001  (no such run: no raw surface)
        return None
    head, _, tail = recipe.get("runs", "run_{i}").partition("{i}")
    if not template or not folder.startswith(head) or not folder.endswith(tail):
        return None
    path = Path(source) / folder / template.format(i=folder[len(head):len(folder) - len(tail)])
    if not path.exists():
        return None
    try:
        with VtkXmlFile(path) as f:
            polys = f.cell_counts().get("Polys" if f.kind == "PolyData" else "Cells", 0)
            if n_cells is not None and (polys != n_cells or f.n_cells != n_cells):
                return None
    except (OSError, ValueError):  # a raw file that no longer reads (a VtkFileError): fall back to the cell centres
        return None
    return path


def raw_surface(store, run: str):
    """The raw surface mesh ingest read for ``run`` (pyvista), if it is still where the store says (else None)."""
    import pyvista as pv

    path = raw_surface_path(store, run)
    if path is None:
        return None
    from domainflow.vtk.pyvista_io import as_polydata

    try:
        return as_polydata(pv.read(path), path)  # a surface given as a .vtu of polygons too
    except Exception:  # noqa: BLE001  (a raw file VTK no longer reads: fall back to the cell centres)
        return None


def as_mesh(store, result: dict):
    """A pyvista dataset carrying the prediction: the raw surface (cell data) or a point cloud."""
    import pyvista as pv

    arrays = result["arrays"]
    n = len(next(iter(arrays.values())))
    mesh = raw_surface(store, result["run"])
    if mesh is not None and mesh.n_cells == n:
        mesh = mesh.copy()
        mesh.clear_data()
        for name, v in arrays.items():
            mesh.cell_data[name] = v
        return mesh
    if "coords" not in result:
        raise ValueError(f"no raw surface for {result['run']} and no coords input to place the points")
    cloud = pv.PolyData(result["coords"])
    for name, v in arrays.items():
        cloud.point_data[name] = v
    return cloud


def checkpoint_kind(checkpoint: str) -> str:
    """``mesh`` or ``grid``: what the checkpoint's model was trained on (its recorded config)."""
    path = ckpt.latest(Path(checkpoint))
    if path is None:
        raise FileNotFoundError(f"{checkpoint}: no checkpoint there (expected a step_<n> folder or a checkpoints "
                                f"folder with one)")
    return str(ckpt.meta(path)["config"].get("data", {}).get("kind", "mesh"))


class PredictionError(df.DomainflowError, RuntimeError):
    """A prediction file could not be written; raised on every rank, naming the rank and the file."""


OUTPUT_SUFFIXES = (".vtp", ".pvtp", ".pvd")


def predict_config(checkpoint: str, store: str, runs, domain: int = 1, block_points: int | None = None,
                   out: str | None = None, pieces: bool = False, trust_target: bool = False):
    """(checkpoint folder, config, [(run, output file, as pieces)], the model's normalisation) for a prediction,
    with every error that needs no process group raised here (the launcher calls it before it starts ranks): no
    checkpoint, a grid checkpoint, a model outside domainflow not trusted (``trust_target``), a store or run
    missing, a store whose fields do not fit the model, an output name that does not say what to write."""
    from domainflow.readers import open_store

    runs = [runs] if isinstance(runs, str) else list(runs)
    targets = _targets(runs, out, pieces) if out is not None else []
    path = ckpt.latest(Path(checkpoint))
    if path is None:
        raise FileNotFoundError(f"{checkpoint}: no checkpoint there (expected a step_<n> folder or a checkpoints "
                                f"folder with one)")
    meta = ckpt.meta(path)
    cfg = from_dict({k: v for k, v in meta["config"].items()})
    cfg.data.store = str(store)
    cfg.mesh.dp, cfg.mesh.domain = 1, domain
    if block_points is not None:
        if block_points < 0:
            raise ValueError(f"--block-points must be >= 0 (0: the whole run at once), got {block_points}")
        cfg.eval.block_points = block_points
        check_block_points(cfg)
    if cfg.data.kind != "mesh":
        raise ValueError(f"predict writes surface fields; the checkpoint was trained on a {cfg.data.kind} store")
    from .model_target import check_trusted

    check_trusted(cfg, f"the checkpoint {path}", trust_target)
    norm = meta.get("normalization")
    handle = open_store(store)
    try:
        for run in runs:
            handle.run(run)
        check_edges(cfg, handle, runs)
        if norm is not None:
            normalization.check_fits(norm, handle, cfg, f"the checkpoint {path}")
    finally:
        handle.close()
    return path, cfg, targets, norm


def _targets(runs: list[str], out: str, pieces: bool) -> list[tuple[str, Path, bool]]:
    """Where each run's prediction goes: OUT itself (``.vtp`` one file, ``.pvtp`` a piece per rank), or for a
    ``.pvd`` collection one file per run in the folder named like it (``--pieces``: ``.pvtp`` each)."""
    out = Path(out)
    if out.suffix not in OUTPUT_SUFFIXES:
        raise ValueError(f"{out}: the output must end in .vtp (one file), .pvtp (a piece per rank, with its index) "
                         f"or .pvd (a collection of several runs)")
    if not runs:
        raise ValueError("predict needs at least one --run")
    if out.suffix != ".pvd":
        if len(runs) > 1:
            raise ValueError(f"{len(runs)} runs go into a collection: name the output <name>.pvd, not {out.name}")
        if pieces:
            raise ValueError(f"--pieces chooses the files of a .pvd collection; for one run name the output "
                             f"{out.with_suffix('.pvtp').name} instead of {out.name}")
        return [(runs[0], out, out.suffix == ".pvtp")]
    folder = out.with_suffix("")
    return [(run, folder / f"{run}{'.pvtp' if pieces else '.vtp'}", pieces) for run in runs]


def _param_scale(norm: dict | None, ds):
    """The design parameters' (mean, std): the model's, or (a checkpoint from before normalisations were
    recorded) the store's train runs'."""
    return normalization.params(norm) if norm is not None else param_stats(ds)


@torch.no_grad()
def predict_local(model, cfg: Config, mesh, run: str, norm: dict | None) -> dict:
    """This rank's cells of ``run``: original cell ids (ascending), predicted, true and error fields (physical,
    non-dimensional units) in that order, the cell centres, and this rank's sums of squared errors and truths
    per field (for relative errors); nothing is gathered."""
    ds = build_dataset(cfg, mesh, None, shuffle=False, runs=[run], extra_inputs=["order", "coords"], norm=norm)
    sample = next(ds.samples([(run, 1.0)]))
    pred = _local(infer(model, make_batch(cfg, ds, sample, _param_scale(norm, ds)), cfg))[0]
    ids = _local(sample["order"]).reshape(-1).long()
    perm = torch.argsort(ids)
    arrays, sums, k = {}, {}, 0
    for f in ds.fields:
        c = int(ds.store.fields[f"{ds.location}/{f}"].get("components", 1))
        p, t = ds.denormalize(f, pred[:, k:k + c]), ds.denormalize(f, _local(sample[f]))
        k += c
        for name, v in ((f"{f}_pred", p), (f"{f}_true", t), (f"{f}_err", p - t)):
            v = v[perm]
            arrays[name] = (v[:, 0] if c == 1 else v).cpu().numpy()
        sums[f] = (float(((p.double() - t.double()) ** 2).sum()), float((t.double() ** 2).sum()))
    coords = ds.denormalize("coords", _local(sample["coords"]))[perm].cpu().numpy()
    n_cells = int(sample["order"].shape[0])
    return {"ids": ids[perm].cpu().numpy(), "arrays": arrays, "coords": coords, "sums": sums, "n_cells": n_cells,
            "store": ds.store, "axes": ds.axes}


def write_prediction(model, cfg: Config, mesh, run: str, norm: dict | None, out: Path, pieces: bool) -> dict:
    """Predict ``run`` and write it to ``out``: each rank writes its own cells as a piece (``pieces``: kept,
    with the ``.pvtp`` index; else assembled into one ``.vtp`` on the first rank, streaming the pieces, which
    are then removed). Every rank returns the run's relative L2 error per field."""
    from domainflow import comm

    from .predict_output import assemble, write_index, write_piece

    local = predict_local(model, cfg, mesh, run, norm)
    axes, out = local["axes"], Path(out)
    group, m = axes.domain, 0
    rank, world = axes.coords[0], axes.sizes[0]
    raw = raw_surface_path(local["store"], run, local["n_cells"])
    use_raw = all(comm.all_gather_object(raw is not None, group, m))  # every piece of the same kind
    folder = out.with_suffix("") if pieces else out.parent / f".{out.name}.pieces"
    files = [folder / f"{out.stem}_{r}.vtp" for r in range(world)]
    def piece():
        folder.mkdir(parents=True, exist_ok=True)
        write_piece(files[rank], local["ids"], local["arrays"], raw if use_raw else None, local["coords"])
    together(comm, group, piece, f"piece {files[rank]}")

    def finish():
        if rank != 0:
            return
        for stale in folder.glob(f"{out.stem}_*.vtp"):  # pieces of an earlier run at a larger domain size
            if re.fullmatch(rf"{re.escape(out.stem)}_\d+\.vtp", stale.name) and stale not in files:
                stale.unlink()
        if pieces:
            write_index(out, files)
        else:
            assemble(out, files, local["n_cells"], raw if use_raw else None)
            for f in files:
                f.unlink()
            folder.rmdir()
    together(comm, group, finish, str(out))
    names = list(local["sums"])  # one all-reduce for every field's two sums, on the mesh's device (NCCL: the GPU)
    sums = comm.all_reduce(torch.tensor([local["sums"][f] for f in names], dtype=torch.float64,
                                        device=comm.mesh_device(group)), "sum", group, m).cpu()
    errors = {f: float(math.sqrt(float(s[0]) / max(float(s[1]), 1e-300))) for f, s in zip(names, sums)}
    return {"run": run, "out": str(out), "cells": local["n_cells"], "rel_l2": errors,
            "geometry": "raw surface" if use_raw else "cell centres"}


def together(comm, group, step, what: str, error=None) -> None:
    """Run ``step`` on this rank, then raise the first rank's error on every rank of the mesh ``group`` (or go
    on on all), as ``error`` (default ``PredictionError``) naming the rank and ``what`` it was writing."""
    message = None
    try:
        step()
    except Exception as exc:  # noqa: BLE001  (sent to every rank, which all raise it)
        message = f"{type(exc).__name__}: {exc}"
    failed = [(r, e) for r, e in enumerate(comm.all_gather_object_mesh(message, group)) if e is not None]
    if failed:
        r, e = failed[0]
        raise (error or PredictionError)(f"rank {r} could not write the prediction ({what}): {e}")


def _local(t):
    return t.to_local() if isinstance(t, df.ShardTensor) else t


def predict_main(checkpoint: str, store: str, runs, out: str, domain: int = 1, block_points: int | None = None,
                 pieces: bool = False, trust_target: bool = False) -> int:
    """``domainflow predict``: one rank per domain part (started by the caller)."""
    path, cfg, targets, norm = predict_config(checkpoint, store, runs, domain, block_points, out, pieces,
                                              trust_target)
    mesh = df.init_mesh((1, domain), ("dp", "domain"))
    ds = build_dataset(cfg, mesh, None, shuffle=False, runs=[targets[0][0]])
    model = build_model(cfg, ds)
    ckpt.load(path, model)
    rank0 = torch.distributed.get_rank() == 0
    how = (f"; forward in blocks of {cfg.eval.block_points} points over the domain" if cfg.eval.block_points
           else "")
    done = []
    for run, target, as_pieces in targets:
        res = write_prediction(model, cfg, mesh, run, norm, target, as_pieces)
        done.append((run, target))
        if rank0:
            kind = f"{domain} pieces and their index" if as_pieces else "one file"
            print(f"wrote {target} ({kind}): {res['cells']} cells on the {res['geometry']}, arrays "
                  f"<field>_pred/_true/_err and cell_id; relative L2 "
                  f"{', '.join(f'{k} {v:.3f}' for k, v in res['rel_l2'].items())}{how}")
    if Path(out).suffix == ".pvd":
        from domainflow import comm

        from .predict_output import write_collection

        together(comm, ds.axes.domain, lambda: write_collection(Path(out), done) if rank0 else None, str(out))
        if rank0:
            print(f"wrote {out}: a collection of {len(done)} runs")
    return 0
