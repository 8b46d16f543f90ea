"""Predict a run's surface fields with a trained model and write them for ParaView.

Rows go back to the original cell order (the store's ``order``), so the arrays line up with the raw
surface file. When the raw ``boundary_<i>.vtp`` that ingest read is still at the store's source path,
the output is that mesh with predicted and true fields as cell data; otherwise a point cloud of the cell
centres carries them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import domainflow as df

from . import checkpoint as ckpt
from .config import Config, from_dict
from .build import build_model
from .data import build_dataset, make_batch, param_stats
from .inference import infer


@torch.no_grad()
def predict_run(model, cfg: Config, mesh, run: str, stats=None) -> dict | None:
    """Predicted and true fields of ``run`` in original cell order, physical (non-dimensional) units;
    the arrays on the first rank, None elsewhere (every rank takes part in the forward)."""
    ds = build_dataset(cfg, mesh, None, shuffle=False, runs=[run], extra_inputs=["order"])
    sample = ds.wrap(ds.read_region(run, 1.0, rank=None))
    batch = make_batch(cfg, ds, sample, stats if stats is not None else param_stats(ds))
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


def raw_surface(store, run: str):
    """The raw surface mesh ingest read for ``run``, if it is still where the store says (else None)."""
    import pyvista as pv

    source = store.attrs.get("domainflow", {}).get("source")
    if not source:
        return None
    path = Path(source) / run / f"boundary_{str(run).rsplit('_', 1)[-1]}.vtp"   # run_<i>/boundary_<i>.vtp
    if not path.exists():
        return None
    try:
        return pv.read(path)
    except Exception:  # noqa: BLE001  (a raw file that no longer reads: fall back to the cell centres)
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


def predict_config(checkpoint: str, store: str, run: str, domain: int = 1, block_points: int | None = None):
    """(checkpoint folder, config) for a prediction, with every error that needs no process group raised here
    (the launcher calls it before it starts ranks): no checkpoint, a grid checkpoint, a store or run missing."""
    from domainflow.readers import open_store

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
    if cfg.data.kind != "mesh":
        raise ValueError(f"predict writes surface fields; the checkpoint was trained on a {cfg.data.kind} store")
    handle = open_store(store)
    try:
        handle.run(run)
    finally:
        handle.close()
    return path, cfg


def predict_main(checkpoint: str, store: str, run: str, out: str, domain: int = 1,
                 block_points: int | None = None) -> int:
    """``domainflow predict``: one rank per domain part (started by the caller)."""
    path, cfg = predict_config(checkpoint, store, run, domain, block_points)

    mesh = df.init_mesh((1, domain), ("dp", "domain"))
    ds = build_dataset(cfg, mesh, None, shuffle=False, runs=[run])
    model = build_model(cfg, ds)
    ckpt.load(path, model)
    train_ds = build_dataset(cfg, mesh, "train", shuffle=False)
    result = predict_run(model, cfg, mesh, run, param_stats(train_ds))
    if result is not None:
        dataset = as_mesh(ds.store, result)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        dataset.save(out)
        errs = {k[:-5]: float(np.linalg.norm(result["arrays"][k] - result["arrays"][k[:-5] + "_true"]) /
                              max(float(np.linalg.norm(result["arrays"][k[:-5] + "_true"])), 1e-300))
                for k in result["arrays"] if k.endswith("_pred")}
        how = f" (forward in blocks of {cfg.eval.block_points} points per rank)" if cfg.eval.block_points else ""
        print(f"wrote {out}: {type(dataset).__name__} with {dataset.n_cells} cells, arrays "
              f"{sorted(result['arrays'])}; relative L2 {', '.join(f'{k} {v:.3f}' for k, v in errs.items())}{how}")
    return 0
