"""Recompiles of a compiled domain-parallel training run over mesh samples of different sizes (issue 40).

A store of 20 synthetic car runs of 5 different sizes is trained for 20 steps at domain 2 with
``train.compile=true`` and a points budget (``data.sample_points``): the log's ``compiled_graphs`` (Dynamo graphs
so far, every step) shows whether a step recompiled. Next to it, from the same draws: how many different per-rank
layouts the 20 steps would have had if each rank kept the drawn points of its own region (eager's reading, where
every new layout would be a recompile), and how many whole samples would have (no points budget).

Run: .venv/bin/python benchmarks/compile_samples.py [--backend aot_eager|inductor]
(prints a table, writes benchmarks/results/compile_samples.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402

SIZES = (1500, 1900, 2300, 2700, 3100)  # cells per run, 4 runs each
DOMAIN, STEPS, POINTS = 2, 20, 1024


def _store(root: Path) -> Path:
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    for i, cells in enumerate(SIZES):
        synth_drivaerml(root / "raw", runs=4, cells=cells, seed=i, volume_cells=200, volume_pieces=1,
                        first_run=1 + 4 * i)
    ingest_drivaerml(root / "raw", root / "cars.zarr", MeshOptions(parts=8, locations=("surface",), progress=False,
                                                                   split=(0.95, 0.05, 0.0)))
    return root / "cars.zarr"


def _layouts(store: Path, schedule: list[str], points: int) -> tuple[int, int]:
    """Distinct per-rank layouts of the steps' samples: drawn points kept by region, and whole samples."""
    from domainflow.layout.shapes import rows_per_rank
    from domainflow.readers import open_store
    from domainflow.readers.regions import mesh_rows
    from domainflow.readers.sampling import PointDraw
    import zlib

    handle = open_store(store)
    drawn, whole = set(), set()
    try:
        for epoch, run in schedule:
            offsets = [int(v) for v in handle.read(handle.run(run)["surface/parts"])]
            whole.add(rows_per_rank(offsets, DOMAIN))
            draw = PointDraw(offsets[-1], points, (0, epoch, zlib.crc32(run.encode())))
            drawn.add(tuple(draw.count(*mesh_rows(offsets, r, DOMAIN)) for r in range(DOMAIN)))
    finally:
        handle.close()
    return len(drawn), len(whole)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = _store(root)
        out = root / "run"
        cmd = [sys.executable, "-m", "domainflow.app.cli", "train", "--out", str(out), "--nproc", str(DOMAIN),
               f"data.store={store}", f"data.sample_points={POINTS}", f"train.steps={STEPS}", "train.compile=true",
               f"train.compile_backend={args.backend}", "model.dim=32", "model.layers=2", "output.plots=false",
               "output.progress=false", "train.eval_every=0"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [e for e in log if "compiled_graphs" in e]
        graphs = [e["compiled_graphs"] for e in steps]
        # the runs each step trained on, in order (the trainer's schedule: the store's train split, shuffled)
        import torch.distributed as dist
        import domainflow as df

        dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
        from domainflow.readers import MeshDataset

        ds = MeshDataset(store, df.init_mesh((1, 1), ("dp", "domain")), split="train", shuffle=True, seed=0,
                         prefetch=0, sample_points=POINTS)
        schedule, epoch = [], 0
        while len(schedule) < STEPS:
            schedule += [(epoch, run) for run, _ in ds.steps(epoch)]
            epoch += 1
        drawn, whole = _layouts(store, schedule[:STEPS], POINTS)
        dist.destroy_process_group()
    rows = {"steps": STEPS, "domain": DOMAIN, "sample_points": POINTS, "backend": args.backend,
            "compiled_graphs_per_step": graphs, "recompiles_after_step_1": graphs[-1] - graphs[0],
            "layouts_if_by_region": drawn, "layouts_of_whole_samples": whole, "wall_s": round(wall, 1),
            "first_step_s": round(steps[0]["seconds"], 2),
            "median_step_s": round(sorted(e["seconds"] for e in steps[1:])[len(steps[1:]) // 2], 4)}
    print(f"{'steps':>5} {'graphs after step 1':>19} {'after step 20':>13} {'recompiles':>10} "
          f"{'layouts by region':>17} {'layouts whole':>13}")
    print(f"{STEPS:>5} {graphs[0]:>19} {graphs[-1]:>13} {graphs[-1] - graphs[0]:>10} {drawn:>17} {whole:>13}")
    write_results("compile_samples", rows)


if __name__ == "__main__":
    main()
