"""A metric whose inputs a store lacks is named in the table and in result.json, never silently left out: force
CSVs without a ``cl`` column (a real data set's CSV rewritten the way such files come) score drag, and say why
lift is not scored."""

from __future__ import annotations

import csv
import json

from cli_runner import run_cli
from test_train import MESH_OVERRIDES


def test_a_force_csv_without_cl_is_named_in_the_table_and_result(cars_raw, tmp_path):
    import shutil

    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml

    shutil.copytree(cars_raw, tmp_path / "raw")
    for path in (tmp_path / "raw").glob("run_*/force_mom_constref_*.csv"):
        rows = list(csv.reader(path.open()))
        keep = [j for j, name in enumerate(rows[0]) if name != "cl"]
        with path.open("w", newline="") as f:
            csv.writer(f).writerows([[r[j] for j in keep] for r in rows])
    ingest_drivaerml(tmp_path / "raw", tmp_path / "cars.zarr",
                     MeshOptions(parts=2, locations=("surface",), progress=False, split=(0.75, 0.25, 0.0)))
    res = run_cli("train", f"data.store={tmp_path / 'cars.zarr'}", *MESH_OVERRIDES, "output.plots=false",
                  "train.steps=1", "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(line.split()[:1] == ["cd_mae_vs_csv"] for line in lines), res.stdout
    named = [line for line in lines if line.split()[:1] == ["cl_mae_vs_csv"]]
    assert named and "not computed: run(s) ['run_" in named[0], res.stdout
    assert "have no cl column in their force CSV (forces_constref)" in named[0]
    summary = json.loads((tmp_path / "run" / "result.json").read_text())["eval"]["summary"]
    assert "cl_mae_vs_csv" not in summary["model"] and "cd_mae_vs_csv" in summary["model"]
    assert "have no cl column" in summary["not_computed"]["cl_mae_vs_csv"]
    assert list(summary["not_computed"]) == ["cl_mae_vs_csv"]
