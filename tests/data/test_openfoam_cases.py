"""OpenFOAM case folders go into a store as they are (no foamToVTK): ``ingest cfd`` with a recipe's ``openfoam``
key reads each run folder through VTK's own OpenFOAM reader (pyvista's ``POpenFOAMReader``): the internal mesh as
the volume, the named patches merged into the surface, the latest time or a given one, a decomposed case
(``processor*/``, as ``decomposePar`` and a parallel run leave it) through its processors. The cases are OpenFOAM's
own output (``tests/data/openfoam``, OpenFOAM v1912: icoFoam's cavity, serial and run on 2 processors, and
pitzDaily with k-epsilon); every stored row equals VTK's reading: centres and every field."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

from domainflow.preprocess.errors import IngestError, RunError  # noqa: E402
from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_cfd  # noqa: E402

CASES = Path(__file__).with_name("openfoam")


def _vtk(case: Path, blocks, time=None, decomposed=False):
    """VTK's reading of ``blocks`` of ``case``: one data set (patches combined, in the reader's order)."""
    r = pv.POpenFOAMReader(str(case / "system" / "controlDict"))
    if decomposed:
        r.case_type = "decomposed"
    r.set_active_time_value(r.time_values[-1] if time is None else time)
    r.disable_all_patch_arrays()
    for b in blocks:
        r.enable_patch_array(b)
    r.cell_to_point_creation = False
    leaves = [b for b in r.read().recursive_iterator() if b is not None and b.n_cells]
    return leaves[0] if len(leaves) == 1 else pv.MultiBlock(leaves).combine(merge_points=False)


def _check(group, mesh, fields):
    order = group["order"][...]
    assert len(order) == mesh.n_cells
    np.testing.assert_allclose(group["coords"][...], np.asarray(mesh.cell_centers().points)[order].astype(np.float32),
                               rtol=1e-6, atol=1e-7)
    for name in fields:  # a stored name, or {stored name: VTK's array}
        source = fields[name] if isinstance(fields, dict) else name
        want = np.asarray(mesh.cell_data[source], np.float32).reshape(mesh.n_cells, -1)[order]
        np.testing.assert_array_equal(group[f"fields/{name}"][...], want)


def _ingest(tmp_path, raw, recipe_text):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text)
    ingest_cfd(raw, tmp_path / "s.zarr", MeshOptions(recipe=recipe, parts=2, progress=False, split=(1.0, 0.0, 0.0)))
    return zarr.open_group(str(tmp_path / "s.zarr"), mode="r")


CAVITY = """
runs: "cavity*"
openfoam: {surface: [movingWall, fixedWalls], volume: internalMesh}
fields:
  surface: [{name: p, source: p, quantity: as_read, units: m2/s2}]
  volume:
    - {name: p, source: p, quantity: as_read, units: m2/s2}
    - {name: U, source: U, components: 3, quantity: as_read, units: m/s}
"""


def test_serial_and_decomposed_cases_at_their_latest_time(tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity", raw / "cavity")
    shutil.copytree(CASES / "cavity_decomposed", raw / "cavity_decomposed")
    root = _ingest(tmp_path, raw, CAVITY)
    assert {k: root[f"runs/{k}"].attrs["folder"] for k in root["runs"].group_keys()} == {
        "run_0": "cavity", "run_1": "cavity_decomposed"}
    for run, case, decomposed in (("run_0", "cavity", False), ("run_1", "cavity_decomposed", True)):
        g = root[f"runs/{run}"]
        assert g.attrs["cells"] == {"surface": 80, "volume": 400}
        _check(g["volume"], _vtk(raw / case, ["internalMesh"], decomposed=decomposed), ["p", "U"])
        _check(g["surface"], _vtk(raw / case, ["patch/movingWall", "patch/fixedWalls"], decomposed=decomposed), ["p"])
    # the decomposed case's latest time is the parallel run's (0.1), not the case folder's only time (0)
    late, start = _vtk(raw / "cavity_decomposed", ["internalMesh"], decomposed=True), _vtk(
        raw / "cavity_decomposed", ["internalMesh"], time=0.0)
    assert np.abs(np.asarray(late.cell_data["U"])).max() > 0 and np.abs(np.asarray(start.cell_data["U"])).max() == 0


def test_a_turbulent_case_at_a_given_time_with_its_wall_patches(tmp_path):
    raw = tmp_path / "raw"
    shutil.copytree(CASES / "pitzdaily", raw / "pitzDaily")
    root = _ingest(tmp_path, raw, """
runs: pitzDaily
openfoam: {surface: [lowerWall, upperWall], volume: true, time: 10}
fields:
  surface:
    - {name: p, source: p, quantity: as_read, units: m2/s2}
    - {name: tau, source: wallShearStress, components: 3, quantity: as_read, units: m2/s2}
  volume:
    - {name: U, source: U, components: 3, quantity: as_read, units: m/s}
    - {name: k, source: k, quantity: as_read, units: m2/s2}
    - {name: nut, source: nut, quantity: as_read, units: m2/s}
""")
    g = root["runs/run_0"]
    _check(g["volume"], _vtk(raw / "pitzDaily", ["internalMesh"], time=10.0), ["U", "k", "nut"])
    _check(g["surface"], _vtk(raw / "pitzDaily", ["patch/lowerWall", "patch/upperWall"], time=10.0),
           {"p": "p", "tau": "wallShearStress"})
    assert np.abs(g["surface/fields/tau"][...]).max() > 0  # the wall shear stress lives on the wall patches


@pytest.mark.parametrize("openfoam,message", [
    ("{surface: [noSuchPatch]}", r"has no \['patch/noSuchPatch'\]; it has \["),
    ("{volume: internalMesh, time: 0.07}", r"no time 0\.07; the case holds times \[0\.0, 0\.05, 0\.1\]"),
])
def test_a_missing_patch_or_time_is_named_with_what_the_case_has(tmp_path, openfoam, message):
    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity", raw / "cavity")
    loc = "surface" if "surface" in openfoam else "volume"
    with pytest.raises(RunError, match=message):
        _ingest(tmp_path, raw, f"runs: cavity\nopenfoam: {openfoam}\nfields: {{{loc}: [{{name: p, source: p, "
                               f"quantity: as_read, units: m2/s2}}]}}\n")


def test_recipe_mistakes_about_openfoam_are_named(tmp_path):
    from domainflow.preprocess.cfd_recipe import load_recipe

    for text, message in (
            ("runs: c\nopenfoam: {surface: [w]}\nfiles: {surface: a.vtp}\nfields: {surface: []}", "not both"),
            ("runs: c\nopenfoam: {volume: cells}\nfields: {volume: []}", "openfoam.volume is internalMesh"),
            ("runs: c\nopenfoam: {time: 3}\nfields: {volume: []}", "naming surface patches and/or the volume")):
        path = tmp_path / "r.yaml"
        path.write_text(text)
        with pytest.raises(IngestError, match=message):
            load_recipe(path)


def test_the_built_in_openfoam_recipe_reads_every_case_folder(tmp_path):
    """``--recipe openfoam``: every folder a case, its wall patches (OpenFOAM's patch group "wall") the surface,
    the internal mesh the volume, kinematic p made Cp with the U_inf given."""
    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity", raw / "a_cavity")
    shutil.copytree(CASES / "pitzdaily", raw / "b_pitzdaily")
    from domainflow.preprocess.reference import Reference

    ingest_cfd(raw, tmp_path / "s.zarr", MeshOptions(recipe="openfoam", parts=2, progress=False, split=(1.0, 0.0, 0.0),
                                                     reference=Reference(u_inf=10.0)))
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    assert root["runs/run_0"].attrs["cells"] == {"surface": 80, "volume": 400}
    assert root["runs/run_1"].attrs["cells"] == {"surface": 91, "volume": 725}
    walls = _vtk(raw / "b_pitzdaily", ["group/wall"])
    g = root["runs/run_1/surface"]
    order = g["order"][...]
    np.testing.assert_allclose(g["fields/Cp"][...][:, 0], (np.asarray(walls.cell_data["p"]) / (0.5 * 10.0 ** 2))[order],
                               rtol=1e-5, atol=1e-6)


def test_a_decomposed_case_is_read_one_processor_and_block_at_a_time(tmp_path, monkeypatch):
    """As ``decomposePar`` and a parallel run leave it (no ``.foam`` files): VTK opens one ``processorN/`` folder
    for one block at a time (never the whole case), and the rows equal VTK's merged reading of the case."""
    from domainflow.vtk import pyvista_io

    raw = tmp_path / "raw"
    shutil.copytree(CASES / "cavity_decomposed", raw / "cavity_decomposed")
    for foam in (raw / "cavity_decomposed").rglob("*.foam"):
        foam.unlink()
    opened = []
    real = pyvista_io.openfoam_reader

    def spy(case, blocks, time=None):
        opened.append((case.name, tuple(blocks)))
        return real(case, blocks, time)

    monkeypatch.setattr(pyvista_io, "openfoam_reader", spy)
    root = _ingest(tmp_path, raw, CAVITY)
    assert sorted(opened) == sorted((f"processor{k}", (b,)) for k in (0, 1)
                                    for b in ("patch/movingWall", "patch/fixedWalls", "internalMesh"))
    monkeypatch.undo()
    g = root["runs/run_0"]
    _check(g["volume"], _vtk(raw / "cavity_decomposed", ["internalMesh"], decomposed=True), ["p", "U"])
    _check(g["surface"], _vtk(raw / "cavity_decomposed", ["patch/movingWall", "patch/fixedWalls"], decomposed=True),
           ["p"])


def test_a_decomposed_case_by_wall_group_in_vtks_order_and_at_one_time(tmp_path):
    """``group/wall`` is read patch by patch (each patch's processors in turn, VTK's merged order, so ``order`` indexes
    VTK's reading); a stray ``processor1.bak`` is no processor; processors whose latest times differ (a parallel
    run's last write cut short) are refused by name instead of mixing two times, and so is a missing processor folder
    (review findings)."""
    raw = tmp_path / "raw"
    case = raw / "cavity_decomposed"
    shutil.copytree(CASES / "cavity_decomposed", case)
    shutil.copytree(case / "processor1", case / "processor1.bak")
    root = _ingest(tmp_path, raw, CAVITY.replace("surface: [movingWall, fixedWalls]", "surface: group/wall"))
    _check(root["runs/run_0/surface"], _vtk(case, ["group/wall"], decomposed=True), ["p"])
    (tmp_path / "again").mkdir()
    shutil.move(case / "processor1", tmp_path / "processor1")  # a processor folder missing: its cells would be
    with pytest.raises(IngestError, match=r"processor folders \[0\] are not processor0..processor1 "
                                          r"\(decomposeParDict: numberOfSubdomains 2\)"):
        _ingest(tmp_path / "again", raw, CAVITY)
    shutil.move(tmp_path / "processor1", case / "processor1")
    shutil.rmtree(case / "processor1" / "0.1")
    with pytest.raises(IngestError, match=r"the processors' latest times differ \(processor0: 0.1, processor1: 0.05\)"):
        _ingest(tmp_path / "again", raw, CAVITY)
