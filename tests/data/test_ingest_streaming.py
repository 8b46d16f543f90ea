"""The streaming ingest (the default) against the in-memory one (VTK reads the whole file, ``partition()``
sorts in memory): the same store, array for array, when blocks are far smaller than a run and the
out-of-core median search needs several refinement rounds."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pv = pytest.importorskip("pyvista")
vtk = pytest.importorskip("vtk")

from domainflow.preprocess import ingest_mesh, partition  # noqa: E402
from domainflow.preprocess.ingest_mesh import ingest_drivaerml  # noqa: E402
from domainflow.preprocess.synth_drivaerml import synth_drivaerml  # noqa: E402
from store_compare import load_store  # noqa: E402

OPTS = dict(parts=8, progress=False, split=(0.5, 0.25, 0.25))


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream_raw")
    synth_drivaerml(out, runs=2, cells=3000, seed=5, volume_cells=2600, volume_pieces=3)
    # synth streams appended, zlib-compressed files; run_1's surface re-saved by VTK inline (base64, zlib)
    # and run_2's as appended raw, uncompressed: three encodings end to end
    pv.read(out / "run_1" / "boundary_1.vtp").save(out / "run_1" / "boundary_1.vtp", binary=True)
    f = out / "run_2" / "boundary_2.vtp"
    w = vtk.vtkXMLPolyDataWriter()
    w.SetInputData(pv.read(f))
    w.SetFileName(str(f))
    w.SetDataModeToAppended()
    w.EncodeAppendedDataOff()
    w.SetCompressorTypeToNone()
    assert w.Write() == 1
    return out


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 211 cells and a median search of 16 bins that gathers at most 40 values."""
    monkeypatch.setattr(ingest_mesh, "block_cells_for", lambda limit: 211)
    monkeypatch.setattr(partition, "_BINS", 16)
    monkeypatch.setattr(partition, "_GATHER", 40)


def _close(a, b, path=""):
    """Attrs equal, statistics (floats of a different summation order) to rounding."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{path}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)) and a and isinstance(a[0], (int, float, list)) and "stats" in path:
        atol = 1e-6 if "normals" in path else 1e-12  # the normals themselves differ by a few ulps
        np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-9, atol=atol, err_msg=path)
    elif isinstance(a, float) and "stats" in path:
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_stores_match(streamed, oracle):
    a, b = load_store(streamed), load_store(oracle)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for key in a:
        x, y = a[key], b[key]
        if x[0] == "group":
            _close(x[1], y[1], key)
            continue
        assert x[3] == y[3] and x[4] == y[4], f"chunks/dtype of {key}: {x[3:]} vs {y[3:]}"
        if key.endswith("/normals"):  # VTK's normal filter rounds differently: a few float32 ulps
            np.testing.assert_allclose(x[1], y[1], rtol=0, atol=4e-6, err_msg=key)
        else:
            assert x[1].shape == y[1].shape and np.array_equal(x[1], y[1], equal_nan=True), f"values of {key}"


@pytest.mark.parametrize("blocks", ["small", "default"])
def test_streamed_store_equals_the_in_memory_one(raw, tmp_path, request, blocks):
    """Small blocks: the out-of-core RCB with several refinement rounds; default blocks: a run this small is
    partitioned in memory (IN_MEMORY_BLOCKS), the rest still streams."""
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    ingest_drivaerml(raw, tmp_path / "stream.zarr", **OPTS)
    ingest_drivaerml(raw, tmp_path / "vtk.zarr", reader="vtk", **OPTS)
    assert_stores_match(tmp_path / "stream.zarr", tmp_path / "vtk.zarr")
    scratch = tmp_path / "stream.zarr.ingest-tmp"
    assert not scratch.exists() or not [p for p in scratch.rglob("*") if p.is_file()]  # column files removed


@pytest.mark.parametrize("extra", [dict(volume_points=700), dict(method="morton"), dict(method="slab", parts=4)])
def test_streamed_subsample_and_sorted_methods_equal_the_in_memory_ones(raw, tmp_path, small_blocks, monkeypatch,
                                                                       extra):
    """Blocks of 211 rows: morton and slab sort every location out of core (a sample sort in buckets)."""
    from domainflow.preprocess import mesh_stream

    sorts = []
    real = mesh_stream.key_order_streaming
    monkeypatch.setattr(mesh_stream, "key_order_streaming", lambda *a, **k: sorts.append(a[2]) or real(*a, **k))
    opts = {**OPTS, **extra}
    ingest_drivaerml(raw, tmp_path / "stream.zarr", **opts)
    ingest_drivaerml(raw, tmp_path / "vtk.zarr", reader="vtk", **opts)
    assert_stores_match(tmp_path / "stream.zarr", tmp_path / "vtk.zarr")
    assert sorts == ([] if "method" not in extra else [extra["method"]] * 4)  # 2 runs x 2 locations


def test_streaming_reads_part_pieces_without_a_joined_copy(raw, tmp_path, monkeypatch):
    """The volume ships as .part pieces; the streaming path never writes them joined (the in-memory path
    concatenates them into a temporary file first)."""
    joined = []
    real = ingest_mesh.whole_file

    def spy(path, *a, **k):
        joined.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(ingest_mesh, "whole_file", spy)
    src = tmp_path / "raw"
    shutil.copytree(raw, src)
    assert list((src / "run_1").glob("volume_1.vtu.*.part"))
    report = ingest_drivaerml(src, tmp_path / "s.zarr", **OPTS)
    assert report.written == ["run_1", "run_2"] and joined == []


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_bar_counts_cells_across_workers(raw, tmp_path, capfd, small_blocks, workers):
    """The bar shows the cells gone through, block by block, from worker processes too; at the end every
    cell of every run is counted once."""
    report = ingest_drivaerml(raw, tmp_path / "s.zarr", **{**OPTS, "progress": True, "workers": workers})
    total = sum(n for t in report.tasks for n in t["cells"].values())
    err = capfd.readouterr().err
    assert f"{total:,} cells" in err.split("\r")[-1] or f"{total:,} cells" in err.splitlines()[-1], err[-400:]


@pytest.fixture
def three_scans(monkeypatch):
    """Every raw file read by three scan tasks (a real run needs --task-bytes of raw data per task)."""
    monkeypatch.setattr(ingest_mesh, "scan_tasks_for", lambda size, task_bytes: 3)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("extra", [{}, dict(volume_points=700), dict(method="morton")])
def test_a_run_scanned_by_several_tasks_gives_the_same_store(raw, tmp_path, small_blocks, three_scans, monkeypatch,
                                                             workers, extra):
    """Stretches of cells scanned by separate tasks (in other processes with 2 workers), then one partition
    task (RCB on 2 workers: its first level only, then a task per subtree and a merge task; on 1 worker
    here forced to 2 levels and 4 subtrees) and a task per column: the same store as VTK reading the
    whole file."""
    opts = {**OPTS, **extra}
    rcb = "method" not in extra
    split = []
    if workers == 1:
        monkeypatch.setattr(ingest_mesh, "split_depth", lambda pieces, o: 2 if o.method == "rcb" else 0)
        real = ingest_mesh.partition_subtree
        monkeypatch.setattr(ingest_mesh, "partition_subtree", lambda *a: split.append(real(*a)) or split[-1])
    report = ingest_drivaerml(raw, tmp_path / "stream.zarr", **{**opts, "workers": workers})
    ingest_drivaerml(raw, tmp_path / "vtk.zarr", reader="vtk", **opts)
    assert_stores_match(tmp_path / "stream.zarr", tmp_path / "vtk.zarr")
    # start + surface (3 scans, partition, 7 columns) + volume (3 scans, partition, 5 columns) + RCB subtrees
    subtree_tasks = 0 if not rcb else 2 * (2 + 1) if workers == 2 else 2 * (4 + 1)
    assert [t["tasks"] for t in report.tasks] == [21 + subtree_tasks] * 2
    if workers == 1 and rcb:  # 4 subtrees of each location out of core (the 700 kept volume rows: in memory)
        done = [s for s in split if s is not None]
        assert len(split) == 16 and len(done) == (8 if "volume_points" in extra else 16)
    if workers == 2:  # one run's tasks ran in both worker processes
        assert all(len(t["pids"]) == 2 for t in report.tasks), [t["pids"] for t in report.tasks]
    scratch = tmp_path / "stream.zarr.ingest-tmp"
    assert not scratch.exists() or not [p for p in scratch.rglob("*") if p.is_file()]


def _nan_cells(path, cells):
    mesh = pv.read(path)
    p = np.array(mesh.cell_data["pMeanTrim"])
    p[cells] = np.nan
    mesh.cell_data["pMeanTrim"] = p
    mesh.save(path)
    return mesh.n_cells


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_cells_in_a_later_stretch_are_named_by_their_cell_and_skip_drops_the_run(raw, tmp_path, small_blocks,
                                                                                    three_scans, workers):
    """NaN only in the third scan task's stretch: the error counts them over all stretches and names the
    first one by its cell in the file; with --on-error skip the run is left out, the other run is written
    and nothing stays in scratch."""
    src = tmp_path / "raw"
    shutil.copytree(raw, src)
    n = _nan_cells(src / "run_2" / "boundary_2.vtp", [-9, -4])
    with pytest.raises(ingest_mesh.IngestError, match=rf"boundary_2\.vtp.*pMeanTrim.*2 of {n} cells.*cell {n - 9}\)"):
        ingest_drivaerml(src, tmp_path / "stop.zarr", **{**OPTS, "workers": workers})
    scratch = tmp_path / "stop.zarr.ingest-tmp"
    assert not (scratch / "columns").exists() or not list((scratch / "columns").iterdir())
    report = ingest_drivaerml(src, tmp_path / "skip.zarr", **{**OPTS, "workers": workers, "on_error": "skip",
                                                              "split": (1.0, 0.0, 0.0)})
    assert report.written == ["run_1"] and list(report.skipped) == ["run_2"]
    assert "cell " + str(n - 9) in report.skipped["run_2"]
    scratch = tmp_path / "skip.zarr.ingest-tmp"
    assert not scratch.exists() or not [p for p in scratch.rglob("*") if p.is_file()]


@pytest.mark.parametrize("method", ["rcb", "morton"])
def test_stages_can_run_again_as_a_cluster_reruns_a_lost_workers_tasks(raw, tmp_path, small_blocks, three_scans,
                                                                       monkeypatch, method):
    """dask.distributed reruns the tasks of a worker that died, from the same inputs: every column task
    here runs twice, the start task twice (the same run folder: its name is fixed in the graph), and the RCB's
    subtree and merge tasks twice; the store is still the in-memory one, with nothing left in scratch."""

    def twice(real):
        def run(*a):
            real(*a)
            return real(*a)
        return run

    for name in ("_column", "_start_run", "_subtree", "_merge"):
        monkeypatch.setattr(ingest_mesh, name, twice(getattr(ingest_mesh, name)))
    monkeypatch.setattr(ingest_mesh, "split_depth", lambda pieces, o: 2 if o.method == "rcb" else 0)
    ingest_drivaerml(raw, tmp_path / "stream.zarr", **OPTS, method=method)
    ingest_drivaerml(raw, tmp_path / "vtk.zarr", reader="vtk", **OPTS, method=method)
    assert_stores_match(tmp_path / "stream.zarr", tmp_path / "vtk.zarr")
    scratch = tmp_path / "stream.zarr.ingest-tmp"
    assert not scratch.exists() or not [p for p in scratch.rglob("*") if p.is_file()]


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_a_column_task_that_wrote_nothing_is_never_published(raw, tmp_path, monkeypatch, on_error):
    """A column stage that returned without writing its array (a lost write): the publish task finds the
    column missing and the run fails by name, or is skipped; it is never published without it."""
    real = ingest_mesh._column

    def lost(parted, key, loc, opts):
        return {"stats": {}, "warnings": []} if key == "field/Cf" else real(parted, key, loc, opts)

    monkeypatch.setattr(ingest_mesh, "_column", lost)
    opts = {**OPTS, "on_error": on_error, "split": (1.0, 0.0, 0.0)}
    if on_error == "stop":
        with pytest.raises(ingest_mesh.RunError, match=r"run_1: surface column 'field/Cf'.*missing"):
            ingest_drivaerml(raw, tmp_path / "s.zarr", **opts)
        return
    with pytest.raises(ingest_mesh.IngestError, match="no train run was ingested"):
        ingest_drivaerml(raw, tmp_path / "s.zarr", **opts)
    assert not (tmp_path / "s.zarr" / "runs" / "run_1").exists()


@pytest.mark.parametrize("workers,in_memory", [(1, True), (2, True), (1, False)])
def test_volume_points_checks_the_kept_cells_and_names_them_by_their_cell(raw, tmp_path, small_blocks, workers,
                                                                          in_memory, monkeypatch):
    """With --volume-points each field's column task reads only the kept cells from the raw file (700 kept
    rows: in memory, or with one block in memory out of core, reading block by block): NaN in a kept cell
    fails the run naming that cell of the file; NaN only in dropped cells is never read, and the store
    (which holds none of them) equals the one from the clean file."""
    from domainflow.preprocess import mesh_stream
    from domainflow.preprocess.ingest_mesh import MeshOptions
    from domainflow.preprocess.mesh_stream import _kept_cells

    if not in_memory:
        monkeypatch.setattr(mesh_stream, "IN_MEMORY_BLOCKS", 1)
        reads = []
        real_read = mesh_stream.FieldColumn.read
        monkeypatch.setattr(mesh_stream.FieldColumn, "read", lambda self, lo, hi: reads.append(hi - lo) or
                            real_read(self, lo, hi))
    opts = {**OPTS, "volume_points": 700, "workers": workers, "split": (1.0, 0.0, 0.0)}
    src = tmp_path / "raw"
    shutil.copytree(raw, src)
    pieces = sorted((src / "run_1").glob("volume_1.vtu.*.part"))
    whole = src / "run_1" / "volume_1.vtu"
    whole.write_bytes(b"".join(p.read_bytes() for p in pieces))
    for p in pieces:
        p.unlink()
    n = pv.read(whole).n_cells
    kept = _kept_cells(n, "volume", MeshOptions(**{k: v for k, v in opts.items() if k != "split"}), "run_1")
    dropped = np.setdiff1d(np.arange(n), kept)
    clean = whole.read_bytes()
    _nan_cells(whole, [int(dropped[5]), int(dropped[-3])])
    ingest_drivaerml(src, tmp_path / "dropped.zarr", **opts)
    whole.write_bytes(clean)
    ingest_drivaerml(src, tmp_path / "clean.zarr", **opts)
    a, b = load_store(tmp_path / "dropped.zarr"), load_store(tmp_path / "clean.zarr")
    assert sorted(a) == sorted(b) and "/runs/run_1/volume/fields/Cp" in a
    for k in a:
        if a[k][0] == "array":  # (the attrs differ: the raw files' fingerprints)
            np.testing.assert_array_equal(a[k][1], b[k][1], err_msg=k)
    _nan_cells(whole, [int(kept[400]), int(kept[650]), int(dropped[0])])
    with pytest.raises(ingest_mesh.IngestError, match=rf"volume_1\.vtu.*pMeanTrim.*2 of 700 cells.*cell {kept[400]}\)"):
        ingest_drivaerml(src, tmp_path / "bad.zarr", **opts)
    if not in_memory:  # the out-of-core path read the fields a block (211 rows) at a time, and its store
        # equals VTK's whole-file read of the same kept cells
        assert reads and max(reads) == 211 and len(reads) > 3 * 4, reads
        whole.write_bytes(clean)  # (a new mtime: both stores made from this file, for equal fingerprints)
        ingest_drivaerml(src, tmp_path / "clean2.zarr", **opts)
        ingest_drivaerml(src, tmp_path / "vtk.zarr", reader="vtk", **{**opts, "workers": 1})
        assert_stores_match(tmp_path / "clean2.zarr", tmp_path / "vtk.zarr")


def test_a_raw_file_changed_between_scan_and_columns_is_an_error(raw, tmp_path, monkeypatch):
    """A field's column task reads the raw file again: a file replaced after its scan (another size or cell
    count) fails the run by name instead of storing rows of another mesh."""
    src = tmp_path / "raw"
    shutil.copytree(raw, src)
    surface = src / "run_1" / "boundary_1.vtp"
    real = ingest_mesh._partition

    def then_replace(start, scans, path, loc, *a):
        out = real(start, scans, path, loc, *a)
        if path == surface:  # another mesh under the same name, after its geometry was scanned
            pv.Sphere(theta_resolution=30, phi_resolution=30).save(surface)
        return out

    monkeypatch.setattr(ingest_mesh, "_partition", then_replace)
    with pytest.raises(ingest_mesh.IngestError, match=r"boundary_1\.vtp changed while the run was ingested"):
        ingest_drivaerml(src, tmp_path / "s.zarr", **{**OPTS, "split": (1.0, 0.0, 0.0)})
