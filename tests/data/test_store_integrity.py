"""A store is never silently wrong: one writer at a time (an OS lock that dies with its process), readers
not blocked, ``--overwrite`` refused under a reader, a replaced store noticed by its readers, missing or
damaged chunk files named instead of read as zeros, and the create-then-attrs window of a new store closed.
Real processes, real kills and files written by zarr itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from domainflow.app.cli import main as cli  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_mesh import ingest_drivaerml  # noqa: E402
from domainflow.readers import StoreError, open_store  # noqa: E402
from store_compare import assert_same_store  # noqa: E402

PARTS = 4
ARGS = ["--parts", str(PARTS), "--split", "0.5,0.25,0.25", "--quiet", "--locations", "surface"]
OPTS = dict(parts=PARTS, progress=False, split=(0.5, 0.25, 0.25), locations=("surface",))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def raw(cars_raw_large):
    return cars_raw_large


@pytest.fixture(scope="module")
def reference(raw, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    ingest_drivaerml(raw, path, **OPTS)
    return path


def _ingest_cmd(raw, store, *extra):
    return [sys.executable, "-m", "domainflow.app.cli", "ingest", "drivaerml", str(raw), str(store), *ARGS, *extra]


def _wait_for(cond, timeout=60.0, proc=None):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            return False
        time.sleep(0.005)
    return True


def _holder(script: str, *args) -> subprocess.Popen:
    """A Python process running ``script`` (which prints "ready" once it holds what it should), kept alive."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"helper process failed: {line}{proc.stdout.read() if proc.poll() else ''}"
    return proc


READER = """
    import sys, time
    from domainflow.readers import open_store
    store = open_store(sys.argv[1])
    store.read(store.run(store.runs()[0])["surface/coords"])
    print("ready", flush=True)
    time.sleep(120)
"""


# -- one writer at a time ---------------------------------------------------------------------------
def test_two_ingests_started_together_one_wins_the_other_names_the_holder(raw, reference, tmp_path):
    path = tmp_path / "s.zarr"
    procs = [subprocess.Popen(_ingest_cmd(raw, path), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 1], f"exit codes {codes}:\n{outs[0]}\n{outs[1]}"
    loser = outs[codes.index(1)]
    # the holder's pid: as it wrote it into the lock file, or from /proc/locks when the loser looked first
    assert "is being written by another ingest" in loser and str(path) in loser, loser
    assert "pid" in loser or "process(es)" in loser, loser
    assert "host" in loser
    assert_same_store(reference, path)  # the winner's store is whole: nothing deleted under it


def test_a_second_ingest_a_moment_later_fails_at_once_and_the_first_completes(raw, reference, tmp_path):
    """The second ingest is started (Python and its imports) before the first, and runs the moment the first has
    begun writing, so it always meets the first at work however fast the machine ingests."""
    path = tmp_path / "s.zarr"
    args = ["ingest", "drivaerml", str(raw), str(path), *ARGS]
    waiter = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from domainflow.app.cli import main
        import domainflow.preprocess.cfd_recipe, domainflow.preprocess.ingest_mesh  # what ingest imports on first use
        print("ready", flush=True)
        while not Path({str(path / "runs")!r}).exists():
            time.sleep(0.001)
        t0 = time.monotonic()
        code = main({args!r})
        print(f"took {{time.monotonic() - t0:.3f}}", flush=True)
        sys.exit(code)
    """)
    second = subprocess.Popen([sys.executable, "-c", waiter], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert second.stdout.readline().strip() == "ready", second.stderr.read()
    first = subprocess.Popen(_ingest_cmd(raw, path), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 1, out + err
    assert f"pid {first.pid}" in err, err
    assert float(out.split("took")[1]) < 10  # fails at once
    assert first.wait(timeout=300) == 0
    assert_same_store(reference, path)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_ingest_leaves_no_stale_lock(raw, reference, tmp_path, workers):
    """Also with forked worker processes, which outlive the killed command for a while and must not have
    inherited its lock."""
    path = tmp_path / "s.zarr"
    proc = subprocess.Popen(_ingest_cmd(raw, path, "--workers", str(workers)), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    building = path.with_name(path.name + ".ingest-tmp") / "runs"  # a task is writing a run: kill it mid-task
    assert _wait_for(lambda: building.exists() and any(building.iterdir()), proc=proc)
    workers_of = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert cli(["ingest", "drivaerml", str(raw), str(path), *ARGS]) == 0  # resumes: the lock died with it
    assert_same_store(reference, path)
    assert _wait_for(lambda: not any(Path(f"/proc/{w}").exists() for w in workers_of), timeout=10), \
        f"worker processes {workers_of} outlived the killed ingest"


def test_readers_are_not_blocked_by_a_writer(reference, tmp_path):
    holder = _holder("""
        import sys
        from domainflow.preprocess.store_writer import StoreWriter
        w = StoreWriter(sys.argv[1])
        w._lock_writers()
        print("ready", flush=True)
        sys.stdin.read()
    """, reference)
    try:
        store = open_store(reference)  # a complete store reads while a writer (a no-op rerun) holds its lock
        assert store.read(store.run(store.runs()[0])["surface/coords"]).shape[1] == 3
    finally:
        holder.kill()
        holder.wait()


# -- --overwrite and readers -----------------------------------------------------------------------
def test_overwrite_is_refused_while_a_job_reads_the_store(raw, reference, tmp_path, capsys):
    path = tmp_path / "s.zarr"
    ingest_drivaerml(raw, path, **OPTS)
    reader = _holder(READER, path)
    try:
        code = cli(["ingest", "drivaerml", str(raw), str(path), *ARGS, "--overwrite"])
        err = capsys.readouterr().err
        assert code == 1 and "is being read by" in err and str(reader.pid) in err, err
        assert_same_store(reference, path)  # untouched
    finally:
        reader.kill()
        reader.wait()
    assert cli(["ingest", "drivaerml", str(raw), str(path), *ARGS, "--overwrite"]) == 0  # reader gone: fine


def test_a_reader_notices_a_store_replaced_under_it(raw, tmp_path):
    """Where the readers lock cannot be taken (here: its folder cannot be made while the reader opens the
    store, as on a read-only mount or a filesystem without locks), an overwrite goes ahead, and the reader's
    next sample is an error."""
    import torch

    import domainflow as df
    from domainflow.locks import store_locks
    from domainflow.readers import MeshDataset

    path = tmp_path / "s.zarr"
    ingest_drivaerml(raw, path, **OPTS)
    import shutil

    folder = store_locks(path.resolve())[1].parent
    shutil.rmtree(folder)
    folder.write_text("not a folder")  # the reader can neither find nor make its lock file
    mesh = df.init_mesh((1,), ("domain",))
    ds = MeshDataset(path, mesh, split="train", prefetch=0, dtype=torch.float64)
    assert ds.store.lock is None
    folder.unlink()
    first = ds.read_region(ds.runs[0])
    assert first["arrays"]["coords"].shape[1] == 3
    assert cli(["ingest", "drivaerml", str(raw), str(path), *ARGS, "--overwrite", "--seed", "1"]) == 0
    with pytest.raises(StoreError, match="was replaced or changed while this job was reading it"):
        ds.read_region(ds.runs[0])


# -- damaged stores --------------------------------------------------------------------------------
def _chunk_files(store: Path, array: str) -> list[Path]:
    return sorted(p for p in (store / array / "c").rglob("*") if p.is_file())


def _mesh_dataset(path):
    import torch

    import domainflow as df
    from domainflow.readers import MeshDataset

    return MeshDataset(path, df.init_mesh((1,), ("domain",)), split=None, prefetch=0, dtype=torch.float64)


@pytest.fixture
def copy(cars_store_chunked, tmp_path):
    """A copy of a store of several chunks per array, to damage."""
    import shutil

    path = tmp_path / "s.zarr"
    shutil.copytree(cars_store_chunked, path)
    return path


def test_a_missing_chunk_file_is_named_not_read_as_zeros(copy):
    run = open_store(copy).runs()[0]
    victim = _chunk_files(copy, f"runs/{run}/surface/fields/Cp")[1]
    victim.unlink()
    ds = _mesh_dataset(copy)
    with pytest.raises(StoreError) as info:
        ds.read_region(run)
    msg = str(info.value)
    assert "is missing" in msg and str(copy) in msg and f"run {run}" in msg and "surface/fields/Cp" in msg
    assert str(victim) in msg


def test_a_truncated_chunk_file_is_named(copy):
    run = open_store(copy).runs()[0]
    victim = _chunk_files(copy, f"runs/{run}/surface/coords")[2]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(StoreError) as info:
        _mesh_dataset(copy).read_region(run)
    msg = str(info.value)
    assert "cannot be read" in msg and str(victim) in msg and f"run {run}" in msg and "surface/coords" in msg


def test_a_missing_grid_chunk_is_named(tmp_path):
    from domainflow.preprocess.ingest_grid import ingest_climate
    from domainflow.preprocess.synth_climate import synth_climate
    from domainflow.readers import GridDataset
    import domainflow as df

    synth_climate(tmp_path / "era5.zarr", grid=(8, 16), steps=12, seed=1, progress=False)
    ingest_climate(tmp_path / "era5.zarr", tmp_path / "g.zarr", progress=False)
    victim = tmp_path / "g.zarr" / "data" / "c" / "5" / "1" / "0" / "0"
    victim.unlink()
    ds = GridDataset(tmp_path / "g.zarr", df.init_mesh((1,), ("domain",)), split="train", prefetch=0,
                     shuffle=False)
    with pytest.raises(StoreError, match=r"array data, chunk 5,1,0,0 .*is missing"):
        for t, _ in ds.steps():
            ds.read_region(t)


def test_chunks_of_fill_values_are_written_so_absence_means_loss(raw, tmp_path):
    """zarr skips chunks that hold only the fill value; a store writes them, so a reader may treat every
    absent chunk as lost (an all-zero field, like a wall-shear component on a symmetric body)."""
    from domainflow.preprocess.store_writer import write_array

    root = zarr.open_group(tmp_path / "z.zarr", mode="w", zarr_format=3)
    write_array(root, "zeros", np.zeros((100, 3), np.float32), target=120)
    assert len(_chunk_files(tmp_path / "z.zarr", "zeros")) == 10


def test_a_store_of_the_old_format_is_refused_with_the_fix(copy):
    meta = json.loads((copy / "zarr.json").read_text())
    meta["attributes"]["domainflow"]["format"] = 1
    (copy / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"format 1 does not keep every chunk.*--overwrite"):
        open_store(copy)


def test_training_on_a_store_with_a_lost_chunk_fails_naming_it(copy, tmp_path, capsys):
    run = open_store(copy).runs()[0]
    victim = _chunk_files(copy, f"runs/{run}/surface/fields/Cf")[0]
    victim.unlink()
    code = cli(["train", f"data.store={copy}", f"output.dir={tmp_path / 'out'}", "train.steps=8", "model.dim=8",
                "model.layers=1", "model.heads=2", "model.slices=4", "output.progress=false", "output.plots=false",
                "data.prefetch=0", "train.eval_every=0"])
    err = capsys.readouterr().err
    assert code == 1 and "is missing" in err and str(victim) in err, err


# -- the window between creating a store and writing its attrs -------------------------------------
def test_an_empty_group_left_by_a_kill_is_accepted_by_resume_and_overwrite(raw, reference, tmp_path):
    """What the old two-step creation left when killed in between: a zarr group with no attrs. Both a
    plain rerun and --overwrite take it (there is nothing in it to lose)."""
    for extra in ([], ["--overwrite"]):
        path = tmp_path / f"s{len(extra)}.zarr"
        zarr.open_group(path, mode="w", zarr_format=3)
        assert cli(["ingest", "drivaerml", str(raw), str(path), *ARGS, *extra]) == 0
        assert_same_store(reference, path)


def test_a_foreign_zarr_group_is_still_refused(raw, tmp_path):
    path = tmp_path / "theirs.zarr"
    root = zarr.open_group(path, mode="w", zarr_format=3)
    root.attrs["owner"] = "someone else"
    with pytest.raises(IngestError, match="is not a domainflow store"):
        ingest_drivaerml(raw, path, **{**OPTS, "overwrite": True})
    assert zarr.open_group(path, mode="r").attrs["owner"] == "someone else"


def test_a_new_store_appears_with_its_attrs_in_one_write(raw, tmp_path):
    """Kill the ingest as soon as the store's root metadata exists: it already names the store, so the rerun
    resumes (never 'exists and is not a domainflow store')."""
    for attempt in range(3):
        path = tmp_path / f"k{attempt}.zarr"
        proc = subprocess.Popen(_ingest_cmd(raw, path), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        assert _wait_for(lambda: (path / "zarr.json").exists(), proc=proc, timeout=120)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        meta = json.loads((path / "zarr.json").read_text())
        assert meta["attributes"]["domainflow"]["complete"] is False
        assert cli(["ingest", "drivaerml", str(raw), str(path), *ARGS]) == 0


def test_a_copied_store_gets_its_readers_lock_back(raw, tmp_path, capsys):
    """``cp -r`` of a store leaves its lock folder behind: the first reader makes it, so --overwrite is still
    refused while the copy is read."""
    import shutil

    src = tmp_path / "s.zarr"
    ingest_drivaerml(raw, src, **OPTS)
    copy = tmp_path / "copy.zarr"
    shutil.copytree(src, copy)
    reader = _holder(READER, copy)
    try:
        code = cli(["ingest", "drivaerml", str(raw), str(copy), *ARGS, "--overwrite"])
        assert code == 1 and "is being read by" in capsys.readouterr().err
    finally:
        reader.kill()
        reader.wait()
