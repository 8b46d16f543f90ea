"""The main job, end to end on data the project generates itself.

``domainflow demo``: synthesise a small DrivaerML-style set (car-like bodies, surface fields), ingest it
(dask, 2 workers) into a partitioned store, train a Transolver with the surface sharded over 2 CPU ranks
(domain = 2), evaluate on the held-out runs against a mean-field baseline, and write the metrics table and
plots. ``--climate`` does the same for the grid path (an ERA5-like series delivered as CDS netCDF files, a
periodic UNet sharded over latitude, scored as WeatherBench 2 scores forecasts). ``--tiny`` is the seconds-long version CI runs.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .config import load_config
from .tables import eval_table

SIZES = {
    # runs, cells per run, steps, model width, layers, slices
    "full": dict(runs=24, cells=5000, steps=600, dim=64, layers=3, slices=32, lr=2e-3),
    "tiny": dict(runs=5, cells=1200, steps=8, dim=16, layers=1, slices=8, lr=2e-3),
}
GRID_SIZES = {
    "full": dict(grid=(32, 64), series=400, steps=300, base=16, lr=2e-3, leads="1,4,8"),
    "tiny": dict(grid=(8, 16), series=40, steps=6, base=4, lr=2e-3, leads="1,2"),
}


def run_demo(out: str = "demo_output", climate: bool = False, tiny: bool = False, nproc: int = 2,
             fresh: bool = False) -> dict:
    out_dir = Path(out)
    if fresh and out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings = {}
    size = "tiny" if tiny else "full"
    if climate:
        store, cfg = _climate_data(out_dir, GRID_SIZES[size], nproc, timings)
    else:
        store, cfg = _surface_data(out_dir, SIZES[size], nproc, timings)
    from .run import run_training

    t = time.perf_counter()
    result = run_training(cfg, overwrite=True)  # the demo's own folder: each run trains anew
    timings["train + evaluate"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    report = {"store": str(store), "train_dir": cfg.output.dir, "timings_s": timings, "result": result,
              "kind": "grid" if climate else "mesh", "domain": cfg.mesh.domain}
    (out_dir / "demo_report.json").write_text(json.dumps(report, indent=1, default=str))
    print(format_report(report))
    return report


def _surface_data(out_dir: Path, size: dict, nproc: int, timings: dict):
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    raw, store = out_dir / "raw", out_dir / "cars.zarr"
    t = time.perf_counter()
    if not (raw / f"run_{size['runs']}").exists():
        synth_drivaerml(raw, runs=size["runs"], cells=size["cells"], seed=0, volume_cells=200, volume_pieces=1,
                        progress=False)
    timings["synth"] = time.perf_counter() - t
    t = time.perf_counter()
    # resumes a finished or interrupted store; 2 dask workers
    report = ingest_drivaerml(raw, store, MeshOptions(parts=8, locations=("surface",), workers=2, progress=False,
                                                      split=(0.75, 0.25, 0.0)))
    timings["ingest"] = time.perf_counter() - t
    print(report.summary())
    cfg = load_config(None, [
        f"data.store={store}", "data.kind=mesh", "model.name=transolver",
        f"model.dim={size['dim']}", f"model.layers={size['layers']}", f"model.slices={size['slices']}",
        f"train.steps={size['steps']}", f"train.lr={size['lr']}", f"train.warmup={max(1, size['steps'] // 20)}",
        "train.clip_grad=1.0", f"train.checkpoint_every={max(1, size['steps'] // 3)}",
        f"train.eval_every={max(1, size['steps'] // 4)}", f"mesh.domain={nproc}", f"output.dir={out_dir / 'train'}"])
    return store, cfg


def _climate_data(out_dir: Path, size: dict, nproc: int, timings: dict):
    """ERA5 as the CDS delivers it (monthly netCDF files of single-level and pressure-level variables, packed
    int16, ``valid_time``, SST missing over land), ingested with the land-sea mask as a static input and the
    SST gaps filled with its train mean."""
    from domainflow.preprocess.ingest_grid import GridOptions, ingest_climate
    from domainflow.preprocess.synth_cds import synth_cds

    raw, store = out_dir / "era5_cds", out_dir / "grid.zarr"
    t = time.perf_counter()
    if not raw.exists():
        synth_cds(raw, grid=size["grid"], steps=size["series"], seed=0)
    timings["synth"] = time.perf_counter() - t
    t = time.perf_counter()
    report = ingest_climate(str(raw / "*.nc"), store, GridOptions(
        workers=2, progress=False, split=(0.7, 0.15, 0.15), static=("lsm",), fill={"sst": "mean"},
        variables=("t2m", "u10", "v10", "msl", "tcwv", "sst", "z500", "t850")))
    timings["ingest"] = time.perf_counter() - t
    print(report.summary())
    cfg = load_config(None, [
        f"data.store={store}", "data.kind=grid", "model.name=unet", f"model.base={size['base']}",
        f"train.steps={size['steps']}", f"train.lr={size['lr']}", "train.clip_grad=1.0",
        f"train.checkpoint_every={max(1, size['steps'] // 3)}", f"mesh.domain={nproc}",
        f"eval.lead_steps={size['leads']}",
        f"output.dir={out_dir / 'train'}"])
    return store, cfg


def format_report(report: dict) -> str:
    res = report["result"]
    summ = res.get("eval", {}).get("summary", {})
    lines = [f"\n== domainflow demo ({'climate UNet' if report['kind'] == 'grid' else 'surface Transolver'}, "
             f"domain = {report['domain']} CPU ranks) =="]
    lines += eval_table(summ, report["kind"])
    lines.append(f"validation samples: {summ.get('samples', 0)};  final training loss {res.get('loss')}")
    lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in report["timings_s"].items()))
    lines.append(f"store: {report['store']}")
    lines.append(f"training output (metrics.jsonl, checkpoints/, result.json): {report['train_dir']}")
    for f in res.get("figures", []):
        lines.append(f"figure: {f}")
    return "\n".join(lines)
