"""Adversarial tests of ``domainflow ingest`` / ``inspect``: odd layouts, bad input, resume, paths, CLI.

Complements tests/test_ingest_mesh.py and tests/test_ingest_grid.py (no case here repeats one there).
Tests that fail describe, in a comment, the behaviour they expect.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess import ingest_grid, ingest_mesh  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402
from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml  # noqa: E402
from domainflow.preprocess.inspect_store import describe  # noqa: E402
from domainflow.preprocess.reference import Reference  # noqa: E402
from domainflow.preprocess.store_writer import StoreWriter  # noqa: E402
from domainflow.preprocess.synth_drivaerml import synth_drivaerml  # noqa: E402
from domainflow.preprocess.vtk_io import read_cells  # noqa: E402
from store_compare import assert_same_store  # noqa: E402

OPTS = dict(parts=4, progress=False, split=(0.5, 0.25, 0.25))


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("adv_raw")
    synth_drivaerml(out, runs=3, cells=800, seed=1, volume_cells=700, volume_pieces=2)
    return out


def _copy(raw, tmp_path, name="raw") -> Path:
    dst = tmp_path / name
    shutil.copytree(raw, dst)
    return dst


def _runs(store) -> list[str]:
    return sorted(zarr.open_group(store, mode="r")["runs"].group_keys())


def _set_cell_array(path: Path, name: str, fn):
    mesh = pv.read(path)
    mesh.cell_data[name] = fn(np.array(mesh.cell_data[name]))
    mesh.save(path)


# =====================================================================================================
# Mesh: layout and partition edge cases (behaviour that is right today; kept as regression tests)
# =====================================================================================================
@pytest.mark.parametrize("method", ["rcb", "morton", "slab"])
def test_more_parts_than_cells_gives_empty_parts_with_nan_boxes(raw, tmp_path, method):
    store = tmp_path / "big.zarr"
    ingest_drivaerml(raw, store, parts=2048, method=method, locations=("surface",), progress=False)
    g = zarr.open_group(store, mode="r")["runs/run_1/surface"]
    offsets, boxes = np.asarray(g["parts"][...]), np.asarray(g["part_boxes"][...])
    coords, order = np.asarray(g["coords"][...]), np.asarray(g["order"][...])
    n = len(coords)
    assert offsets.shape == (2049,) and offsets[0] == 0 and offsets[-1] == n and (np.diff(offsets) >= 0).all()
    assert sorted(order.tolist()) == list(range(n))
    empty = np.diff(offsets) == 0
    assert empty.sum() == 2048 - n  # n < P: exactly n parts hold one row each
    assert np.isnan(boxes[empty]).all() and not np.isnan(boxes[~empty]).any()
    for k in np.flatnonzero(~empty)[:50]:
        rows = coords[offsets[k]:offsets[k + 1]]
        assert (rows >= boxes[k, 0]).all() and (rows <= boxes[k, 1]).all()


def test_one_part_and_volume_cap_above_the_cell_count(raw, tmp_path):
    store = tmp_path / "p1.zarr"
    ingest_drivaerml(raw, store, parts=1, volume_points=10 ** 9, progress=False)
    run = zarr.open_group(store, mode="r")["runs/run_1"]
    mesh = pv.read(_join_pieces(raw / "run_1" / "volume_1.vtu", tmp_path))
    assert run.attrs["cells"]["volume"] == mesh.n_cells  # a cap above N keeps every cell
    assert np.asarray(run["volume/parts"][...]).tolist() == [0, mesh.n_cells]
    assert np.asarray(run["volume/order"][...]).tolist() == list(range(mesh.n_cells))  # P=1: file order


def _join_pieces(path: Path, tmp_path: Path) -> Path:
    joined = tmp_path / ("joined_" + path.name)
    joined.write_bytes(b"".join(p.read_bytes() for p in sorted(path.parent.glob(path.name + ".*.part"))))
    return joined


def test_run_order_is_numeric_and_unrelated_entries_are_ignored(raw, tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    for new, old in (("run_9", "run_1"), ("run_10", "run_2"), ("run_100", "run_3")):
        shutil.copytree(raw / old, src / new)
        for f in (src / new).iterdir():
            f.rename(f.with_name(f.name.replace(f"_{old[4:]}.", f"_{new[4:]}.")))
    (src / "run_4").write_text("a file, not a run folder")
    (src / "run_x").mkdir()
    (src / "notes.txt").write_text("hello")
    (src / "run_9" / "README.md").write_text("extra file in a run folder")
    report = ingest_drivaerml(src, tmp_path / "o.zarr", **OPTS)
    assert report.written == ["run_9", "run_10", "run_100"]
    root = zarr.open_group(tmp_path / "o.zarr", mode="r")
    assert sorted(sum(dict(root.attrs["splits"]).values(), []), key=lambda r: int(r[4:])) == report.written
    assert root["runs/run_100"].attrs["run"] == 100


@pytest.mark.parametrize("n", [1, 2])
def test_one_or_two_runs_all_go_to_train(raw, tmp_path, n):
    src = tmp_path / "raw"
    src.mkdir()
    for i in range(1, n + 1):
        shutil.copytree(raw / f"run_{i}", src / f"run_{i}")
    ingest_drivaerml(src, tmp_path / "s.zarr", parts=4, progress=False)  # default 0.8/0.1/0.1
    splits = dict(zarr.open_group(tmp_path / "s.zarr", mode="r").attrs["splits"])
    assert splits == {"train": [f"run_{i}" for i in range(1, n + 1)], "val": [], "test": []}


def test_surface_only_store_has_no_volume_anything(raw, tmp_path):
    store = tmp_path / "s.zarr"
    ingest_drivaerml(raw, store, locations=("surface",), **OPTS)
    root = zarr.open_group(store, mode="r")
    assert all(k.startswith("surface/") for k in root.attrs["stats"])
    assert all(k.startswith("surface/") for k in root.attrs["fields"])
    for run in _runs(store):
        assert sorted(root["runs"][run].group_keys()) == ["surface"]
        assert dict(root["runs"][run].attrs["cells"]) == {"surface": 800}


def test_chunks_are_near_chunk_bytes_along_rows(raw, tmp_path):
    store = tmp_path / "c.zarr"
    ingest_drivaerml(raw, store, chunk_bytes=1024, locations=("surface",), **OPTS)
    g = zarr.open_group(store, mode="r")["runs/run_1/surface"]
    for name, arr in list(g.arrays()) + list(g["fields"].arrays()):
        if name in ("parts", "part_boxes"):
            continue
        row = arr.dtype.itemsize * int(np.prod(arr.shape[1:]))
        assert arr.chunks[1:] == arr.shape[1:], name  # whole rows per chunk
        assert 1024 - row < arr.chunks[0] * row <= 1024, (name, arr.chunks)


def test_only_the_needed_cell_arrays_are_read(raw, tmp_path):
    f = tmp_path / "extra.vtp"
    mesh = pv.read(raw / "run_1" / "boundary_1.vtp")
    mesh.cell_data["huge_extra"] = np.zeros((mesh.n_cells, 9), np.float32)
    mesh.point_data["point_extra"] = np.zeros(mesh.n_points)
    mesh.save(f)
    got, arrays = read_cells(f, ["pMeanTrim"], optional=("CpMeanTrim", "not_there"))
    assert sorted(got.cell_data) == ["CpMeanTrim", "pMeanTrim"] and not list(got.point_data)
    assert sorted(arrays) == ["CpMeanTrim", "pMeanTrim"]


# =====================================================================================================
# Mesh: bad raw input -> IngestError naming the file (right today except where noted)
# =====================================================================================================
def _vtu_renamed_as_vtp(run: Path):
    (run / "boundary_2.vtp").unlink()
    pv.read(_join_pieces(run / "volume_2.vtu", run.parent)).save(run / "v.vtu")
    (run / "v.vtu").rename(run / "boundary_2.vtp")


def _pieces_00_and_02(run: Path):
    (run / "volume_2.vtu.01.part").rename(run / "volume_2.vtu.02.part")


BAD_VTK = {
    "inf": (lambda r: _set_cell_array(r / "boundary_2.vtp", "pMeanTrim",
                                      lambda a: np.where(np.arange(len(a)) == 7, np.inf, a).astype(np.float32)),
            r"boundary_2\.vtp.*pMeanTrim.*NaN/Inf.*cell 7"),
    "float64 beyond float32": (lambda r: _set_cell_array(r / "boundary_2.vtp", "pMeanTrim",
                                                         lambda a: np.where(np.arange(len(a)) == 3, 1e39, a)),
                               r"boundary_2\.vtp.*pMeanTrim.*NaN/Inf"),
    "scalar with 2 components": (lambda r: _set_cell_array(r / "boundary_2.vtp", "pMeanTrim",
                                                           lambda a: np.stack([a, a], 1)),
                                 r"boundary_2\.vtp.*pMeanTrim.*2 components, expected 1"),
    "vector with 1 component": (lambda r: _set_cell_array(r / "boundary_2.vtp", "wallShearStressMeanTrim",
                                                          lambda a: a[:, 0].copy()),
                                r"boundary_2\.vtp.*wallShearStressMeanTrim.*1 components, expected 3"),
    "vtu renamed to vtp": (_vtu_renamed_as_vtp, r"boundary_2\.vtp.*corrupt or truncated.*PolyData"),
    "zero-byte vtp": (lambda r: (r / "boundary_2.vtp").write_bytes(b""), r"boundary_2\.vtp.*corrupt"),
    "zero-byte piece": (lambda r: (r / "volume_2.vtu.01.part").write_bytes(b""), r"volume_2\.vtu.*corrupt"),
    "pieces 00 and 02": (_pieces_00_and_02, r"volume_2\.vtu.*piece\(s\) \[1\] are missing \(found \[0, 2\]\)"),
    "legacy .vtk instead of .vtp": (lambda r: (pv.read(r / "boundary_2.vtp").save(r / "boundary_2.vtk"),
                                               (r / "boundary_2.vtp").unlink()),
                                    r"missing file.*boundary_2\.vtp.*holds.*boundary_2\.vtk"),
    "csv with two value rows": (lambda r: (r / "force_mom_2.csv").write_text("cd,cl\n1,2\n3,4\n"),
                                r"force_mom_2\.csv.*found 3 non-empty lines"),
    "csv non-numeric": (lambda r: (r / "force_mom_2.csv").write_text("cd,cl\n0.3,abc\n"),
                        r"force_mom_2\.csv.*'cl' holds 'abc'"),
    "csv without header": (lambda r: (r / "geo_parameters_2.csv").write_text("0.3,0.1\n"),
                           r"geo_parameters_2\.csv.*header"),
    "zero-byte csv": (lambda r: (r / "force_mom_constref_2.csv").write_bytes(b""),
                      r"force_mom_constref_2\.csv.*found 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_VTK))
def test_bad_raw_file_is_an_ingest_error_naming_it(raw, tmp_path, case):
    mutate, pattern = BAD_VTK[case]
    src = _copy(raw, tmp_path)
    mutate(src / "run_2")
    with pytest.raises(IngestError, match=r"run_2: .*" + pattern):
        ingest_drivaerml(src, tmp_path / "s.zarr", **OPTS)
    assert zarr.open_group(tmp_path / "s.zarr", mode="r").attrs["domainflow"]["complete"] is False


def test_missing_last_part_piece_is_reported_as_missing_not_corrupt(tmp_path, capsys):
    """Pieces 00..02 of 00..03 have no gap, so only the joined file's end shows that .03.part is missing;
    the error says so (naming the file and the piece) instead of calling the volume file corrupt."""
    src = tmp_path / "raw"
    synth_drivaerml(src, runs=1, cells=300, volume_cells=400, volume_pieces=4, progress=False)
    run = src / "run_1"
    assert sorted(p.name for p in run.glob("volume_1.vtu.*.part")) == [f"volume_1.vtu.0{k}.part" for k in range(4)]
    (run / "volume_1.vtu.03.part").unlink()
    pattern = r"run_1: .*volume_1\.vtu: its \.part pieces 00\.\.02 end before.*\.03\.part and after\?\).*missing"
    with pytest.raises(IngestError, match=pattern) as caught:
        ingest_drivaerml(src, tmp_path / "s.zarr", **OPTS)
    assert "corrupt" not in str(caught.value)
    code = cli(["ingest", "drivaerml", str(src), str(tmp_path / "c.zarr"), "--parts", "4", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "volume_1.vtu" in err and ".03.part" in err and "missing" in err and "corrupt" not in err


def test_csv_that_is_not_text_names_the_file(raw, tmp_path):
    # BUG: read_csv_row opens the CSV as UTF-8 text and lets UnicodeDecodeError escape: the message
    # ("'utf-8' codec can't decode byte 0xff") names neither the run nor the file, and it is not an
    # IngestError. Expected: IngestError "run_2: .../force_mom_2.csv: not a text CSV (...)".
    src = _copy(raw, tmp_path)
    (src / "run_2" / "force_mom_2.csv").write_bytes(b"\xff\xfe\x00garbage\n\x81\x82\n")
    with pytest.raises(IngestError, match=r"run_2.*force_mom_2\.csv"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **OPTS)


@pytest.mark.parametrize("kind", ["binary", "directory"])
def test_unreadable_csv_is_skipped_with_on_error_skip(raw, tmp_path, kind):
    # BUG: with --on-error skip a CSV that cannot be decoded (UnicodeDecodeError) or opened
    # (IsADirectoryError, PermissionError) aborts the whole ingest, because ingest_run only catches
    # IngestError. Expected: run_2 recorded in attrs.skipped, the others ingested, the store complete.
    src = _copy(raw, tmp_path)
    f = src / "run_2" / "force_mom_2.csv"
    if kind == "binary":
        f.write_bytes(b"\xff\xfe\x00\x81")
    else:
        f.unlink()
        f.mkdir()
    report = ingest_drivaerml(src, tmp_path / "s.zarr", on_error="skip", **OPTS)
    assert list(report.skipped) == ["run_2"] and "force_mom_2.csv" in report.skipped["run_2"]
    root = zarr.open_group(tmp_path / "s.zarr", mode="r")
    assert root.attrs["domainflow"]["complete"] is True and "run_2" in root.attrs["skipped"]


def test_csv_with_a_repeated_column_name_is_refused(raw, tmp_path):
    # BUG: read_csv_row builds a dict from the header, so "cd,cd" silently keeps only the last value.
    # Expected: IngestError naming the file and the repeated column.
    src = _copy(raw, tmp_path)
    (src / "run_2" / "force_mom_2.csv").write_text("cd,cl,cd\n0.3,0.1,0.5\n")
    with pytest.raises(IngestError, match=r"force_mom_2\.csv.*'cd'"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **OPTS)


def test_surface_of_line_cells_is_an_ingest_error(raw, tmp_path):
    # BUG: surface_geometry means to refuse non-polygon surfaces with an IngestError ("the surface must be
    # polygons only"), but pyvista's compute_normals raises TypeError first for a surface of lines or
    # vertices. TypeError is not caught by the CLI (traceback) nor by --on-error skip.
    # Expected: IngestError naming boundary_2.vtp (fix: check mesh.n_polys / catch TypeError and re-raise).
    src = _copy(raw, tmp_path)
    f = src / "run_2" / "boundary_2.vtp"
    mesh = pv.read(f)
    edges = mesh.extract_all_edges()
    for k in ("pMeanTrim", "CpMeanTrim", "pPrime2MeanTrim", "wallShearStressMeanTrim"):
        edges.cell_data[k] = np.zeros((edges.n_cells,) + mesh.cell_data[k].shape[1:], np.float32)
    edges.save(f)
    with pytest.raises(IngestError, match=r"boundary_2\.vtp"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **OPTS)


# =====================================================================================================
# Mesh: options are checked before anything is written
# =====================================================================================================
def test_chunk_bytes_must_be_positive():
    # BUG: MeshOptions.validate does not check chunk_bytes (GridOptions refuses < 4). chunk_bytes=0 or
    # negative gives one-row chunks: one file per row (13 s for 4,500 cells; millions of files on real data).
    # Expected: IngestError naming --chunk-bytes.
    for bad in (0, -5):
        with pytest.raises(IngestError, match="--chunk-bytes"):
            MeshOptions(chunk_bytes=bad).validate()


def test_workers_below_one_refused_before_creating_the_store(raw, tmp_path):
    # BUG: --workers 0 is only refused inside run_tasks, after StoreWriter.open has already created an
    # empty partial store. Expected: the error comes from option validation and nothing is written.
    store = tmp_path / "w.zarr"
    with pytest.raises(ValueError, match="--workers"):
        ingest_drivaerml(raw, store, workers=0, **OPTS)
    assert not store.exists()


def test_non_finite_reference_pressure_is_refused(raw, tmp_path):
    # BUG: Reference validates u_inf, rho_inf and l_ref but not p_inf, and the ingest checks the raw arrays
    # for NaN/Inf but not the scaled ones: p_inf=nan (e.g. `--p-inf nan`) makes every Cp NaN and the run
    # dies in RunningStats.of with "statistics of values containing NaN/Inf" (a plain ValueError, after the
    # store was created; --on-error skip does not catch it). Expected: refused up front, naming p_inf.
    store = tmp_path / "r.zarr"
    with pytest.raises(ValueError, match="p_inf"):
        ingest_drivaerml(raw, store, reference=Reference(p_inf=float("nan")), **OPTS)
    assert not store.exists()


def test_repeated_location_is_refused_or_merged(raw, tmp_path):
    # BUG: MeshOptions.validate accepts locations=("surface", "surface") (`--locations surface,surface`);
    # every run then dies in zarr with ContainsGroupError ("A group exists ... at path 'surface'"), which
    # is not an IngestError, so --on-error skip aborts too. Expected: IngestError from validation, or the
    # repeat dropped.
    try:
        ingest_drivaerml(raw, tmp_path / "s.zarr", locations=("surface", "surface"), **OPTS)
    except IngestError as exc:
        assert "--locations" in str(exc)
        return
    assert sorted(zarr.open_group(tmp_path / "s.zarr", mode="r")["runs/run_1"].group_keys()) == ["surface"]


def test_split_file_with_empty_train_fails_before_ingesting(raw, tmp_path):
    # BUG: a split file with "train": [] is accepted, every run is ingested, and only then does the
    # coordinator fail ("no train run was ingested"). On real data that is hours of wasted work.
    # Expected: IngestError about the empty train split before any run is written.
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [], "val": [1, 2], "test": [3]}))
    store = tmp_path / "e.zarr"
    with pytest.raises(IngestError, match="train"):
        ingest_drivaerml(raw, store, parts=4, progress=False, split_file=str(split))
    assert not store.exists() or not _runs(store)


def test_split_file_without_train_key_is_refused(raw, tmp_path):
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"val": [1], "test": [2]}))
    with pytest.raises(IngestError, match=r'"train" \(required\)'):
        ingest_drivaerml(raw, tmp_path / "v.zarr", parts=4, progress=False, split_file=str(split))


# =====================================================================================================
# Mesh: the STORE path
# =====================================================================================================
def test_overwrite_refuses_a_folder_that_is_not_a_store(raw, tmp_path):
    # BUG: StoreWriter.open(overwrite=True) rmtree's STORE whatever it is: `--overwrite` with a mistyped
    # STORE (a home or project folder) deletes it. Without --overwrite the same folder is refused.
    # Expected: --overwrite only replaces a domainflow store (zarr.json with attrs.domainflow) or an empty
    # folder; anything else is refused with IngestError and left untouched.
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "precious.txt").write_text("do not delete")
    with pytest.raises(IngestError, match="not a domainflow store"):
        ingest_drivaerml(raw, folder, **OPTS)
    with pytest.raises(IngestError):
        ingest_drivaerml(raw, folder, overwrite=True, **OPTS)
    assert (folder / "precious.txt").read_text() == "do not delete"


def test_overwrite_with_store_equal_to_raw_keeps_the_raw_data(raw, tmp_path):
    # BUG: `ingest drivaerml RAW RAW --overwrite` deletes the raw run folders (open() removes STORE before
    # any run is read), then fails with "missing file(s)". Expected: refused (STORE equal to, or containing,
    # RAW), raw data untouched.
    src = _copy(raw, tmp_path)
    with pytest.raises(IngestError):
        ingest_drivaerml(src, src, overwrite=True, **OPTS)
    assert (src / "run_1" / "boundary_1.vtp").exists()


def test_store_path_that_is_a_file_is_an_ingest_error(raw, tmp_path):
    # BUG: StoreWriter.open calls Path.iterdir() on STORE; when STORE is a file this raises
    # NotADirectoryError. Expected: IngestError "STORE exists and is not a domainflow store".
    f = tmp_path / "s.zarr"
    f.write_text("not a store")
    with pytest.raises(IngestError, match="s.zarr"):
        ingest_drivaerml(raw, f, **OPTS)


def test_store_path_may_be_a_symlink_to_an_empty_folder(raw, tmp_path):
    # BUG: STORE given as a symlink to an (empty) folder, common on clusters (a link to fast storage),
    # fails with "OSError: Cannot call rmtree on a symbolic link" (StoreWriter._remove_all). Expected: the
    # store is written into the link's target. The target is put on another file system when one is at
    # hand, so that scratch (next to the *link*) and runs/ (in the *target*) are on different devices:
    # publish_run's os.replace must then still work (fix: resolve the path in StoreWriter.__init__).
    shm = Path("/dev/shm")
    target = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path))
    try:
        link = tmp_path / "link.zarr"
        link.symlink_to(target, target_is_directory=True)
        report = ingest_drivaerml(raw, link, locations=("surface",), **OPTS)
        assert report.written == ["run_1", "run_2", "run_3"]
        assert zarr.open_group(target, mode="r").attrs["domainflow"]["complete"] is True
    finally:
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(target.with_name(target.name + ".ingest-tmp"), ignore_errors=True)


# =====================================================================================================
# Mesh: resume
# =====================================================================================================
def _break(src: Path, run: str = "run_3") -> tuple[Path, bytes]:
    f = src / run / f"boundary_{run[4:]}.vtp"
    good = f.read_bytes()
    f.write_bytes(good[:300])
    return f, good


def test_resume_with_a_different_raw_folder_is_refused(raw, tmp_path):
    # BUG: the store records attrs.domainflow.source (RAW) but StoreWriter.open never compares it, so a
    # partial store made from RAW A is "resumed" from an unrelated RAW B: runs of A are kept, the rest come
    # from B, and the store is marked complete with source A. Expected: IngestError naming both folders
    # (or include the resolved source in attrs.ingest.config). The same holds for ingest climate.
    a = _copy(raw, tmp_path, "rawA")
    _break(a)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(a, store, **OPTS)
    assert _runs(store) == ["run_1", "run_2"]
    b = tmp_path / "rawB"
    synth_drivaerml(b, runs=3, cells=600, seed=99, volume_cells=600)
    with pytest.raises(IngestError, match="rawA|rawB"):
        ingest_drivaerml(b, store, **OPTS)


def test_resume_does_not_keep_runs_that_left_raw(raw, tmp_path):
    # BUG: a run published by an interrupted ingest whose folder was then removed from RAW stays in
    # runs/ of the completed store although it is in no split (finished_runs() is not intersected with
    # the runs found in RAW). Expected: every run in runs/ is listed in attrs.splits (drop the orphan), or
    # the resume is refused with IngestError.
    src = _copy(raw, tmp_path)
    f, good = _break(src)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(src, store, **OPTS)
    f.write_bytes(good)
    shutil.rmtree(src / "run_1")
    try:
        ingest_drivaerml(src, store, **OPTS)
    except IngestError:
        return
    root = zarr.open_group(store, mode="r")
    listed = set(sum(dict(root.attrs["splits"]).values(), []))
    assert set(_runs(store)) <= listed, f"runs {sorted(set(_runs(store)) - listed)} are in no split"


def test_resume_ignores_junk_in_scratch_and_cleans_it(raw, tmp_path):
    src = _copy(raw, tmp_path)
    f, good = _break(src)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(src, store, **OPTS)
    scratch = tmp_path / "s.zarr.ingest-tmp"
    (scratch / "runs" / "run_3.deadbeef").mkdir(parents=True, exist_ok=True)
    (scratch / "runs" / "run_3.deadbeef" / "zarr.json").write_text("{ half written")
    (scratch / "domainflow-parts-junk").mkdir()
    (scratch / "domainflow-parts-junk" / "volume_3.vtu").write_bytes(b"x" * 1000)
    (scratch / "stray.txt").write_text("x")
    f.write_bytes(good)
    report = ingest_drivaerml(src, store, **OPTS)
    assert report.state == "resume" and report.kept == ["run_1", "run_2"] and report.written == ["run_3"]
    assert not scratch.exists()
    ingest_drivaerml(src, tmp_path / "ref.zarr", **OPTS)
    assert_same_store(tmp_path / "ref.zarr", store)


def test_overwrite_on_a_partial_store_starts_again(raw, tmp_path):
    src = _copy(raw, tmp_path)
    f, good = _break(src)
    store = tmp_path / "s.zarr"
    with pytest.raises(IngestError):
        ingest_drivaerml(src, store, **OPTS)
    f.write_bytes(good)
    report = ingest_drivaerml(src, store, overwrite=True, **OPTS)
    assert report.state == "new" and report.kept == [] and report.written == ["run_1", "run_2", "run_3"]


def test_two_workers_skip_and_stop_leave_valid_stores(raw, tmp_path):
    src = _copy(raw, tmp_path)
    f, good = _break(src, "run_2")
    report = ingest_drivaerml(src, tmp_path / "skip.zarr", workers=2, on_error="skip", **OPTS)
    assert report.written == ["run_1", "run_3"] and list(report.skipped) == ["run_2"]
    assert zarr.open_group(tmp_path / "skip.zarr", mode="r").attrs["domainflow"]["complete"] is True
    store = tmp_path / "stop.zarr"
    with pytest.raises(IngestError, match=r"run_2.*boundary_2\.vtp"):
        ingest_drivaerml(src, store, workers=2, **OPTS)
    assert zarr.open_group(store, mode="r").attrs["domainflow"]["complete"] is False
    f.write_bytes(good)
    report = ingest_drivaerml(src, store, workers=2, **OPTS)
    assert report.state == "resume" and "run_2" in report.written
    ingest_drivaerml(src, tmp_path / "ref.zarr", **OPTS)
    assert_same_store(tmp_path / "ref.zarr", store)


def test_task_arguments_hold_absolute_paths(raw, tmp_path, monkeypatch):
    # BUG: ingest_drivaerml and ingest_climate hand RAW and STORE to the tasks exactly as given. With
    # `--scheduler ADDRESS` the tasks run on dask workers started in their own working directory, so
    # `domainflow ingest drivaerml raw out.zarr --scheduler ...` makes workers read ./raw and write
    # ./out.zarr relative to *their* cwd. Expected: the coordinator resolves both paths before submitting.
    shutil.copytree(raw, tmp_path / "raw")
    monkeypatch.chdir(tmp_path)
    seen = []
    real_mesh, real_grid = ingest_mesh.run_tasks, ingest_grid.run_tasks

    def spy(real):
        def run(func, calls, **kw):
            calls = list(calls)
            seen.extend(calls)
            return real(func, calls, **kw)
        return run

    monkeypatch.setattr(ingest_mesh, "run_tasks", spy(real_mesh))
    monkeypatch.setattr(ingest_grid, "run_tasks", spy(real_grid))
    ingest_drivaerml("raw", "mesh.zarr", locations=("surface",), **OPTS)
    _grid_source(tmp_path / "src.zarr", np.ones((3, 4, 8), np.float32))
    ingest_climate("src.zarr", "grid.zarr", progress=False)
    for call in seen:
        paths = [a for a in call if isinstance(a, str) and ("raw" in a or ".zarr" in a)]
        assert paths and all(os.path.isabs(p) for p in paths), call[:3]


# =====================================================================================================
# inspect and the command line
# =====================================================================================================
def test_inspect_incomplete_stores_and_non_stores(tmp_path, capsys):
    StoreWriter(tmp_path / "m.zarr").open("mesh", "somewhere", 8, {"parts": 8})
    text = describe(tmp_path / "m.zarr")
    assert "INCOMPLETE" in text and "runs: 0 published" in text and "rerun the same" in text
    StoreWriter(tmp_path / "g.zarr").open("grid", "somewhere", None, {})
    assert "no data array yet" in describe(tmp_path / "g.zarr")
    zarr.open_group(tmp_path / "plain.zarr", mode="w")
    (tmp_path / "file").write_text("x")
    for path in ("plain.zarr", "file", "missing"):
        with pytest.raises(IngestError, match="not a domainflow store"):
            describe(tmp_path / path)
        assert cli(["inspect", str(tmp_path / path)]) == 1
    assert "not a domainflow store" in capsys.readouterr().err


def test_cli_malformed_split_argument_is_a_clean_error(raw, tmp_path, capsys):
    # BUG: `--split 0.5,0.5` makes _floats raise argparse.ArgumentTypeError inside _ingest, after parsing;
    # main() only catches ValueError/RuntimeError/OSError, so the user gets a traceback. Expected: a one-line
    # "error: --split takes 3 comma-separated numbers" and a non-zero exit (return 1, or argparse's exit 2;
    # fix: use type=lambda s: _floats(...) on the argument, or catch ArgumentTypeError).
    args = ["ingest", "drivaerml", str(raw), str(tmp_path / "s.zarr"), "--split", "0.5,0.5", "--quiet"]
    try:
        code = cli(args)
    except SystemExit as exc:
        code = exc.code
    assert code not in (0, None)
    assert "--split" in capsys.readouterr().err


# =====================================================================================================
# Climate
# =====================================================================================================
def _grid_source(path: Path, *variables, lat=None, lon=None, time=True, time_chunk=None, fmt=3, attrs=None):
    """A small (time, latitude, longitude) Zarr with variables v0, v1, ..."""
    g = zarr.open_group(path, mode="w", zarr_format=fmt)
    T, H, W = variables[0].shape
    lat = np.linspace(-60, 60, H) if lat is None else np.asarray(lat, float)
    lon = np.arange(W) * 360.0 / W if lon is None else np.asarray(lon, float)

    def put(name, values, dims, chunks, extra=None):
        # v2 as xarray writes an array without missing values: no fill_value (to xarray a v2 fill_value is
        # the _FillValue, and zarr-python's default 0 would make every 0 a missing value)
        kw = ({"dimension_names": dims} if fmt == 3
              else {"attributes": {"_ARRAY_DIMENSIONS": dims}, "fill_value": None})
        a = g.create_array(name, shape=values.shape, dtype=values.dtype, chunks=chunks, **kw)
        a[...] = values
        if extra:
            a.attrs.update(extra)

    for i, v in enumerate(variables):
        put(f"v{i}", v, ["time", "latitude", "longitude"], (time_chunk or v.shape[0],) + v.shape[1:],
            (attrs or {}).get(f"v{i}"))
    put("latitude", lat, ["latitude"], lat.shape)
    put("longitude", lon, ["longitude"], lon.shape)
    if time:
        put("time", np.arange(T, dtype=np.int64) * 6, ["time"], (T,), {"units": "hours since 2000-01-01"})
    return path


@pytest.mark.parametrize("T,time_chunk,time_block", [(10, 4, None), (10, 10, 4), (3, 3, 8), (1, 1, None)])
def test_grid_time_blocks_that_do_not_divide_the_series(tmp_path, T, time_chunk, time_block):
    rng = np.random.default_rng(T)
    v = rng.normal(size=(T, 5, 8)).astype(np.float32)
    src = _grid_source(tmp_path / "src.zarr", v, time_chunk=time_chunk)
    store = tmp_path / "g.zarr"
    report = ingest_climate(src, store, time_block=time_block, progress=False)
    block = time_block or time_chunk
    assert len(report.written) == -(-T // block)
    root = zarr.open_group(store, mode="r")
    np.testing.assert_array_equal(np.asarray(root["data"][:, 0]), v)
    train = root.attrs["splits"]["train"]
    n_train = sum(b - a for a, b in train)
    assert root.attrs["stats"]["grid/v0"]["count"] == n_train * 5 * 8
    x = np.concatenate([v[a:b] for a, b in train]).astype(np.float64)
    np.testing.assert_allclose(root.attrs["stats"]["grid/v0"]["mean"], [x.mean()], rtol=1e-9)


def test_grid_regional_ascending_lat_and_no_time_coordinate(tmp_path):
    v = np.arange(4 * 6 * 7, dtype=np.float32).reshape(4, 6, 7)
    src = _grid_source(tmp_path / "src.zarr", v, lat=np.linspace(30, 55, 6), lon=np.linspace(-10, 20, 7),
                       time=False, fmt=2)
    store = tmp_path / "g.zarr"
    ingest_climate(src, store, progress=False)
    root = zarr.open_group(store, mode="r")
    assert root.attrs["grid"]["periodic_lon"] is False
    np.testing.assert_array_equal(root["lat"][...], np.linspace(30, 55, 6))  # kept ascending, as given
    np.testing.assert_array_equal(root["time"][...], np.arange(4))
    assert root["time"].attrs["units"] == "steps"
    np.testing.assert_array_equal(root["data"][:, 0], v)


def test_grid_variables_of_different_shapes_point_to_variables_option(tmp_path):
    g = _grid_source(tmp_path / "src.zarr", np.zeros((4, 5, 8), np.float32))
    a = zarr.open_group(g, mode="r+").create_array("v9", shape=(4, 5, 4), dtype="f4",
                                                   dimension_names=["time", "latitude", "longitude"])
    a[...] = 0
    with pytest.raises(IngestError, match=r"different shapes.*--variables"):
        ingest_climate(g, tmp_path / "g.zarr", progress=False)
    ingest_climate(g, tmp_path / "g.zarr", variables=("v0",), progress=False)  # the way out works


@pytest.mark.parametrize("step", [0, 9], ids=["in-train", "in-test"])
def test_grid_value_beyond_float32_is_refused(tmp_path, step):
    # BUG: ingest_block checks the *source* values for NaN/Inf and then casts them to float32. A float64
    # source value beyond float32's range (1e39) becomes inf in the store: in the test split it is written
    # silently (data holds inf, store complete); in the train split RunningStats.of raises a plain
    # ValueError that names neither variable nor time step. Expected: IngestError naming the variable and
    # time index (fix: check np.isfinite on the float32 block after the cast).
    v = np.ones((10, 4, 8))
    v[step, 1, 2] = 1e39
    src = _grid_source(tmp_path / "src.zarr", v)
    with pytest.raises(IngestError, match=rf"'v0'.*time index {step}"):
        ingest_climate(src, tmp_path / "g.zarr", progress=False)


def test_grid_split_file_with_empty_train_is_refused(tmp_path):
    # BUG: mesh ingest refuses an empty train split, grid ingest completes: attrs.stats gets count 0,
    # std NaN, min Infinity, max -Infinity, which zarr writes into zarr.json as bare NaN/Infinity (not valid
    # JSON for strict readers) and which no model can normalise with. Expected: IngestError about the
    # empty train split, before any block is written.
    src = _grid_source(tmp_path / "src.zarr", np.ones((6, 4, 8), np.float32))
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": [], "val": [[0, 3]], "test": [[3, 6]]}))
    with pytest.raises(IngestError, match="train"):
        ingest_climate(src, tmp_path / "g.zarr", split_file=str(split), progress=False)


def test_grid_packed_int16_variables_are_decoded_or_refused(tmp_path):
    # BUG: ERA5 written by xarray from the CDS netCDF keeps CF packing: int16 values with scale_factor /
    # add_offset attrs. ingest_block copies the packed integers as they are, so the store holds e.g. 12000
    # instead of 12000 * 0.01 + 250 = 370 K, with the source's units. Expected: unpack
    # (raw * scale_factor + add_offset) or refuse with an IngestError naming scale_factor.
    packed = np.arange(3 * 4 * 8, dtype=np.int16).reshape(3, 4, 8) * 100
    src = _grid_source(tmp_path / "src.zarr", packed,
                       attrs={"v0": {"scale_factor": 0.01, "add_offset": 250.0, "units": "K"}})
    try:
        ingest_climate(src, tmp_path / "g.zarr", progress=False)
    except IngestError as exc:
        assert "scale_factor" in str(exc)
        return
    data = np.asarray(zarr.open_group(tmp_path / "g.zarr", mode="r")["data"][:, 0])
    np.testing.assert_allclose(data, packed * 0.01 + 250.0, rtol=1e-6)


def test_grid_repeated_variable_is_refused_or_merged(tmp_path):
    # BUG: `--variables v0,v0` is accepted: data gets two identical channels, attrs.grid.variables lists v0
    # twice, but attrs.fields (keyed by name) describes only channel 1. Expected: IngestError naming the
    # repeated variable, or the repeat dropped (one channel).
    src = _grid_source(tmp_path / "src.zarr", np.ones((3, 4, 8), np.float32))
    try:
        ingest_climate(src, tmp_path / "g.zarr", variables=("v0", "v0"), progress=False)
    except IngestError as exc:
        assert "v0" in str(exc)
        return
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    assert root["data"].shape[1] == len(root.attrs["grid"]["variables"]) == len(root.attrs["fields"])
