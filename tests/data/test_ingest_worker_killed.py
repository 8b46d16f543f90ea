"""A worker process of ``domainflow ingest --workers N`` killed mid-task (as the out-of-memory killer does): the
command ends with one line that says a worker died, what to lower and that a rerun resumes; the rerun of the
same command then completes the store, equal to one ingested without the kill. A real SIGKILL of a real pool
worker: the task that kills its own process is put in place in this process, which the workers fork from."""

from __future__ import annotations

import os
import signal
import uuid
import warnings
from pathlib import Path

import pytest

pytest.importorskip("pyvista")
zarr = pytest.importorskip("zarr")

from cli_runner import run_cli  # noqa: E402
from store_compare import assert_same_store  # noqa: E402

from domainflow.preprocess import ingest_grid, ingest_mesh  # noqa: E402

_PARENT = os.getpid()  # the test process; the pool's workers are its forks
_VICTIM = {"marker": None, "match": None}  # set by a test before the ingest, inherited by the workers
_real_partition, _real_block = ingest_mesh.partition_location, ingest_grid.ingest_block


def _die_if_victim(what: str) -> None:
    """In a pool worker (not this process), on the victim's task: note the pid, then SIGKILL the process."""
    if os.getpid() != _PARENT and _VICTIM["match"] in what:
        Path(_VICTIM["marker"]).write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def _partition_or_die(scans, loc, path, *args, **kw):
    _die_if_victim(str(path))  # the raw file the run's location is partitioned from
    return _real_partition(scans, loc, path, *args, **kw)


def _block_or_die(reader, store, shown, t0, t1, train):
    _die_if_victim(f"block {t0}")
    return _real_block(reader, store, shown, t0, t1, train)


def _one_line_worker_death(res, marker: Path) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
    pid = int(marker.read_text())  # a worker, not this process, was killed
    assert pid != os.getpid()
    line = lines[0]
    assert line.startswith("error: an ingest worker process was killed (SIGKILL"), line
    assert "lower --workers (now 2" in line and "rerun the same command" in line and "resumes" in line, line
    return line


def _kill_then_resume(tmp_path, monkeypatch, args, module, task: str, dying, match: str) -> str:
    """Ingest ``args`` (``None``: the store) once whole as the reference, then with 2 workers where the task
    ``module.task`` matching ``match`` SIGKILLs its worker: the one line it ends with; the rerun resumes to a
    store equal to the reference."""
    reference, store = tmp_path / "reference.zarr", tmp_path / "store.zarr"
    assert run_cli(*[reference if a is None else a for a in args]).returncode == 0
    cmd = [store if a is None else a for a in args] + ["--workers", "2"]
    marker = tmp_path / "killed.pid"
    monkeypatch.setitem(_VICTIM, "marker", str(marker))
    monkeypatch.setitem(_VICTIM, "match", match)
    real = getattr(module, task)
    monkeypatch.setattr(module, task, dying)
    line = _one_line_worker_death(run_cli(*cmd), marker)
    assert zarr.open_group(store, mode="r").attrs["domainflow"]["complete"] is False
    # what a kill in the middle of writing a file leaves, named as zarr names it (LocalStore writes each file as
    # <name>.<uuid>.partial, then renames it): groups' metadata and a chunk (a mesh run's are written elsewhere)
    chunks = [p for p in sorted(store.rglob("*")) if p.is_file() and "c" in p.relative_to(store).parts][:1]
    for left in [*store.rglob("zarr.json")][:2] + chunks:
        left.with_suffix(f".{uuid.uuid4().hex}.partial").write_bytes(b"{")
    assert len(list(store.rglob("*.partial"))) >= 2
    monkeypatch.setattr(module, task, real)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        res = run_cli(*cmd)
        members = dict(zarr.open_group(store, mode="r").members(max_depth=None))
    assert res.returncode == 0 and "resumed" in res.stdout, res.stderr[-3000:]
    # before: "ZarrUserWarning: Object at zarr.<uuid>.partial is not recognized as a component of a Zarr
    # hierarchy", in the rerun and in every later reader, and the unfinished files stayed
    assert not [str(w.message) for w in said if "not recognized" in str(w.message)], [str(w.message) for w in said]
    assert members and not list(store.rglob("*.partial"))
    assert_same_store(reference, store)
    return line


def test_a_killed_mesh_ingest_worker_is_one_line_and_the_rerun_completes_the_store(tmp_path, monkeypatch):
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    raw = tmp_path / "raw"
    synth_drivaerml(raw, runs=4, cells=600, seed=1, volume_cells=200, volume_pieces=1)
    args = ["ingest", "drivaerml", raw, None, "--parts", "4", "--locations", "surface", "--split", "0.5,0.25,0.25",
            "--quiet"]
    line = _kill_then_resume(tmp_path, monkeypatch, args, ingest_mesh, "partition_location", _partition_or_die,
                             "run_3")
    assert "--memory-limit" in line


def test_a_killed_climate_ingest_worker_is_one_line_and_the_rerun_completes_the_store(tmp_path, monkeypatch):
    from domainflow.preprocess.synth_climate import synth_climate

    source = synth_climate(tmp_path / "era5.zarr", grid=(8, 16), steps=40, seed=2)
    args = ["ingest", "climate", source, None, "--time-block", "8", "--split", "0.6,0.2,0.2", "--quiet"]
    line = _kill_then_resume(tmp_path, monkeypatch, args, ingest_grid, "ingest_block", _block_or_die, "block 16")
    assert "--time-block" in line


_PREEMPTIBLE_INGEST = """
import os, signal, sys, time
from pathlib import Path

import numpy as np

from domainflow.preprocess import parallel
from domainflow.preprocess.errors import WorkerDiedError
from domainflow.preprocess.parallel import run_tasks


def task(kind, mark):
    if kind.startswith("victim"):  # dies once the other worker is inside its task
        deadline = time.monotonic() + 30
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.01)
        if kind == "victim holding the counter":  # killed inside count_cells, as the OOM killer may
            parallel._cells.get_lock().acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "busy":
        Path(mark).touch()
        time.sleep(1)
    return np.zeros(1 << 20)  # 8 MB: more than the pipe back to the pool holds


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a job's preemption handler: note it, go on
    try:
        list(run_tasks(task, [(sys.argv[2], sys.argv[1]), ("busy", sys.argv[1])] + [("big", sys.argv[1])] * 4,
                       workers=2, progress=False))
    except WorkerDiedError as exc:
        print(exc)
"""


@pytest.mark.parametrize("victim", ["victim", "victim holding the counter"])
def test_a_worker_that_outlives_the_pools_sigterm_does_not_hang_the_ingest(tmp_path, victim):
    """Once a worker dies the pool SIGTERMs the others and waits for them: a worker forked from a process with a
    SIGTERM handler of its own (a job's preemption handler; torch's elastic launcher leaves one behind) went on
    with the next task and blocked the ingest's end forever. Now the error comes, and the process ends. A worker
    killed while holding the progress counter's lock (inside ``count_cells``) left it held, and the command's
    last read of the count waited for it forever."""
    import subprocess
    import sys

    script = tmp_path / "preemptible_ingest.py"
    script.write_text(_PREEMPTIBLE_INGEST)
    try:
        res = subprocess.run([sys.executable, str(script), str(tmp_path / "busy"), victim], capture_output=True,
                             text=True, timeout=30)  # about 1 s; the workers die with it (see _die_with_parent)
    except subprocess.TimeoutExpired:
        raise AssertionError("the ingest still ran 30 s after its worker died: it hung") from None
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("an ingest worker process was killed (SIGKILL"), res.stdout + res.stderr[-3000:]


_SLOW_INGEST = """
import pathlib, sys, time

from domainflow.preprocess import ingest_mesh, parallel

real = ingest_mesh.partition_location


def slow(*a, **k):  # a long task (a huge run's partition), running in a worker when Ctrl-C comes
    with parallel._cells.get_lock():  # inside count_cells, as a task often is: the kill leaves the lock held
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(120)
    return real(*a, **k)


ingest_mesh.partition_location = slow  # the workers fork from this process
from domainflow.app.cli import main

sys.exit(main(sys.argv[2:]))
"""


def test_ctrl_c_of_an_ingest_with_workers_is_one_line_at_once_and_the_rerun_completes(tmp_path):
    """Ctrl-C reaches the command and its workers (the terminal's whole process group): the command ends at once
    with its one line, not after the running task (two minutes here), and no worker prints a traceback (one
    idle in the pool's queue did); the rerun completes the store. The running task holds the progress counter's
    lock when its worker is killed: the command's last read of the count waited for it forever (a CI hang)."""
    import subprocess
    import sys
    import time

    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    raw, store, busy = tmp_path / "raw", tmp_path / "store.zarr", tmp_path / "busy"
    synth_drivaerml(raw, runs=1, cells=600, seed=1, volume_cells=200, volume_pieces=1)
    script = tmp_path / "slow_ingest.py"
    script.write_text(_SLOW_INGEST)
    args = ["ingest", "drivaerml", str(raw), str(store), "--parts", "2", "--locations", "surface", "--workers", "2",
            "--quiet"]
    proc = subprocess.Popen([sys.executable, str(script), str(busy), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not busy.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy.exists(), proc.communicate()[1][-3000:]
        time.sleep(0.3)  # the other worker waits in the pool's queue
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 130 and lines == [
        "interrupted; the store is a valid partial store: rerun the same command to resume"], err[-3000:]
    assert took < 15, took
    res = run_cli(*args)
    assert res.returncode == 0 and "resumed" in res.stdout, res.stderr[-3000:]
    reference = tmp_path / "reference.zarr"  # one ingest without the interruption, in one process
    assert run_cli(*[str(reference) if a == str(store) else a for a in args[:-3]], "--quiet").returncode == 0
    assert_same_store(reference, store)
