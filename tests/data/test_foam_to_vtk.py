"""What foamToVTK writes goes into a store: OpenFOAM's own output (``tests/data/openfoam``, written by OpenFOAM
v1912 and its foamToVTK; ``make_cases.sh`` there remakes it) through ``ingest cfd`` with a recipe of one's own.
The XML block files (``VTK/<case>_<step>/internal.vtu`` and a ``boundary/<patch>.vtp``, named in subfolders of
the run folder, without a run number) stream; the legacy ``.vtk`` files (which the streaming reader has no
parser for, once refused as "corrupt or truncated") are read whole by VTK; runs are found by a glob; fields are
kept as read, with their units. Every stored row equals VTK's own reading: cell centres, the patch's centres,
and p and U."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_cfd  # noqa: E402

CASES = Path(__file__).with_name("openfoam")

RECIPE = """
name: foam-to-vtk
runs: "{runs}"
files: {{volume: "{volume}", surface: "{surface}"}}
fields:
  volume:
    - {{name: p, source: p, quantity: as_read, units: m2/s2}}
    - {{name: U, source: U, components: 3, quantity: as_read, units: m/s}}
  surface:
    - {{name: p, source: p, quantity: as_read, units: m2/s2}}
"""


def _ingest(tmp_path, raw, runs, volume, surface):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(runs=runs, volume=volume, surface=surface))
    ingest_cfd(raw, tmp_path / "s.zarr", MeshOptions(recipe=recipe, parts=2, progress=False, split=(1.0, 0.0, 0.0)))
    return zarr.open_group(str(tmp_path / "s.zarr"), mode="r")


def _same_as_vtk(group, path: Path, fields, surface=False):
    """The store's rows (through their ``order``) are VTK's cells of ``path``: centres and fields."""
    mesh = pv.read(str(path))
    order = group["order"][...]
    assert len(order) == mesh.n_cells and sorted(order) == list(range(mesh.n_cells))
    centres = np.asarray(mesh.cell_centers().points, np.float64)
    np.testing.assert_allclose(group["coords"][...], centres[order].astype(np.float32), rtol=1e-6, atol=1e-7)
    for name in fields:
        want = np.asarray(mesh.cell_data[name], np.float32).reshape(mesh.n_cells, -1)[order]
        np.testing.assert_array_equal(group[f"fields/{name}"][...], want)


@pytest.mark.parametrize("kind", ["xml", "legacy"])
def test_foam_to_vtk_output_ingests_like_vtk_reads_it(tmp_path, kind):
    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity", raw / "cavity")
    if kind == "xml":
        volume, surface = "VTK/cavity_20/internal.vtu", "VTK/cavity_20/boundary/movingWall.vtp"
    else:
        volume, surface = "VTK_legacy/cavity_20.vtk", "VTK_legacy/movingWall/movingWall_20.vtk"
    root = _ingest(tmp_path, raw, "cavity", volume, surface)
    assert sorted(root["runs"].group_keys()) == ["run_0"] and root["runs/run_0"].attrs["folder"] == "cavity"
    assert root.attrs["fields"]["volume/U"]["units"] == "m/s" and root.attrs["fields"]["volume/p"]["units"] == "m2/s2"
    _same_as_vtk(root["runs/run_0/volume"], raw / "cavity" / volume, ["p", "U"])
    _same_as_vtk(root["runs/run_0/surface"], raw / "cavity" / surface, ["p"], surface=True)


def test_run_folders_found_by_a_glob(tmp_path):
    raw = tmp_path / "raw"
    for name, case in (("case_b", "pitzdaily"), ("case_a", "cavity")):
        src = CASES / case / "VTK_legacy"
        (raw / name).mkdir(parents=True)
        shutil.copy(next(src.glob(f"{case}_*.vtk")), raw / name / "internal.vtk")
        shutil.copy(next(src.glob("*Wall*/*.vtk")), raw / name / "wall.vtk")
    (raw / "notes").write_text("not a run folder")
    root = _ingest(tmp_path, raw, "case_*", "internal.vtk", "wall.vtk")
    assert {k: root[f"runs/{k}"].attrs["folder"] for k in root["runs"].group_keys()} == {"run_0": "case_a",
                                                                                      "run_1": "case_b"}
    for run, name in (("run_0", "case_a"), ("run_1", "case_b")):
        _same_as_vtk(root[f"runs/{run}/volume"], raw / name / "internal.vtk", ["p", "U"])


def test_a_vtm_index_with_blocks_chosen_by_name(tmp_path, capsys):
    """foamToVTK's VTK/<case>_<step>.vtm: the volume is its `internal` data set, the surface its `boundary`
    block (every patch, merged in the index's order), read whole by VTK; a .vtm without blocks, or a block
    it lacks, is a one-line error naming what it has."""
    from domainflow.app.cli import main as cli

    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity", raw / "cavity")
    recipe = tmp_path / "recipe.yaml"
    text = RECIPE.format(runs="cavity", volume="VTK/cavity_20.vtm", surface="VTK/cavity_20.vtm")
    recipe.write_text(text + "blocks: {volume: [internal], surface: [boundary]}\n")
    ingest_cfd(raw, tmp_path / "s.zarr", MeshOptions(recipe=recipe, parts=2, progress=False, split=(1.0, 0.0, 0.0)))
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    folder = raw / "cavity" / "VTK" / "cavity_20"
    _same_as_vtk(root["runs/run_0/volume"], folder / "internal.vtu", ["p", "U"])
    patches = [pv.read(str(folder / "boundary" / f"{p}.vtp")) for p in ("movingWall", "fixedWalls")]  # index order
    surface = root["runs/run_0/surface"]
    order = surface["order"][...]
    centres = np.concatenate([np.asarray(m.cell_centers().points) for m in patches])
    assert len(order) == len(centres) and sorted(order) == list(range(len(centres)))
    np.testing.assert_allclose(surface["coords"][...], centres[order].astype(np.float32), rtol=1e-6, atol=1e-7)
    p = np.concatenate([np.asarray(m.cell_data["p"], np.float32) for m in patches])
    np.testing.assert_array_equal(surface["fields/p"][...][:, 0], p[order])
    for extra, said in (("", "is a .vtm multi-block index; name the data sets or blocks"),
                        ("blocks: {volume: [internal], surface: [walls]}\n",
                         "has no block(s) named ['walls']; its blocks and data sets are ['boundary', 'fixedWalls', "
                         "'internal', 'movingWall']")):
        recipe.write_text(text + extra)
        assert cli(["ingest", "cfd", str(raw), str(tmp_path / f"x{len(extra)}.zarr"), "--recipe", str(recipe),
                    "--quiet"]) == 1
        err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
        assert said in err[0] and "Traceback" not in "".join(err), err  # (a run's error: then how to resume)
