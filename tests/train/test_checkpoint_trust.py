"""Checkpoints are not trusted blindly: a flipped bit is named by its checksum, a crafted ``.metadata`` (a
pickle that would run a command) is refused by name before any of it runs, byte items load without code, and
a save that hits a full disk ends in one line on every rank with the last checkpoint kept and the space freed."""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from test_train import MESH_OVERRIDES


@pytest.fixture(scope="module")
def trained(cars_store, tmp_path_factory):
    """A 2-step run with a checkpoint after each step; ``cars.zarr`` beside it is the store it trained on."""
    root = tmp_path_factory.mktemp("trust")
    (root / "cars.zarr").symlink_to(cars_store)
    res = run_cli("train", f"data.store={root / 'cars.zarr'}", *MESH_OVERRIDES, "output.plots=false",
                  "train.steps=2", "train.checkpoint_every=1", "--out", root / "run")
    assert res.returncode == 0, res.stderr
    return root


class _RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _predict(trained, ckpt, out):
    return run_cli("predict", ckpt, trained / "cars.zarr", "--run", "run_1", out)


@pytest.mark.parametrize("manifest", ["rewritten", "removed"])
def test_a_crafted_metadata_pickle_is_refused_before_it_runs(trained, tmp_path, manifest):
    from domainflow.train.checkpoint_files import MANIFEST, write_manifest

    ckpt = tmp_path / "step_00000002"
    shutil.copytree(trained / "run" / "checkpoints" / "step_00000002", ckpt)
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    if manifest == "rewritten":  # whoever crafts the pickle can write a manifest to match
        (ckpt / MANIFEST).unlink()
        write_manifest(ckpt, {})
    else:
        (ckpt / MANIFEST).unlink()
    res = _predict(trained, ckpt, tmp_path / "p.vtp")
    assert res.returncode == 1
    assert ".metadata is refused: it refers to posix.system, which DCP checkpoint metadata never holds" in res.stderr
    assert "nothing of it was run" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not marker.exists()


def test_byte_items_load_without_running_code(tmp_path):
    """DCP's own planner loads non-tensor items with ``weights_only=False``; ours does not."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from domainflow.train.checkpoint_files import SafePlanner

    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_RunsACommand(marker), buf)

    class Item:
        dest_index = type("I", (), {"fqn": "optim.param_groups"})()

    planner = SafePlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        planner.load_bytes(Item(), io.BytesIO(buf.getvalue()))
    assert not marker.exists()
    plain = DefaultLoadPlanner()
    plain.flatten_state_dict, plain.state_dict = False, {}
    plain.load_bytes(Item(), io.BytesIO(buf.getvalue()))  # what DCP alone would do: it runs the command
    assert marker.exists()


def test_a_flipped_bit_in_a_checkpoint_shard_is_named(trained, tmp_path):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(trained / "run" / "checkpoints", ckpts)
    data = ckpts / "step_00000002" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    res = _predict(trained, ckpts, tmp_path / "p.vtp")
    assert res.returncode == 1
    assert "__0_0.distcp does not match its SHA-256 in manifest.json" in res.stderr, res.stderr
    assert f"the newest older complete checkpoint is {ckpts / 'step_00000001'}" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "p.vtp").exists()


def _tmpfs_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(sys.platform != "linux" or not _tmpfs_works(),
                    reason="needs a user+mount namespace for a small tmpfs (unshare -rm), to fill a real disk")
def test_a_full_disk_while_saving_ends_in_one_line_and_resume_continues(trained, tmp_path):
    """The output folder on a real tmpfs with room for one checkpoint: the second save fails with ENOSPC."""
    one = sum(p.stat().st_size for p in (trained / "run" / "checkpoints" / "step_00000001").iterdir())
    out = tmp_path / "small"
    out.mkdir()
    size_kib = (one * 3 // 2) // 1024 + 64  # one checkpoint, the logs and some slack; not two checkpoints
    train = [sys.executable, "-m", "domainflow.app.cli", "train", f"data.store={trained / 'cars.zarr'}",
             *MESH_OVERRIDES, "output.plots=false", "train.steps=3", "train.checkpoint_every=1", "--domain", "2",
             "--out", str(out)]
    script = (f"mount -t tmpfs -o size={size_kib}k tmpfs {out} || exit 90\n"
              "\"$@\"; echo FIRST_RC=$?\n"
              f"echo LEFT=$(ls -A {out}/checkpoints | tr '\\n' ' ')\n"
              f"mount -o remount,size=64m {out}\n"  # space freed: the same command with --resume goes on
              "\"$@\" --resume; echo SECOND_RC=$?\n"
              f"echo LATEST=$(cat {out}/checkpoints/latest)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"}
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *train], env=env, capture_output=True,
                         text=True, timeout=300)
    said = dict(line.split("=", 1) for line in res.stdout.splitlines() if line.split("=", 1)[0] in
                ("FIRST_RC", "LEFT", "SECOND_RC", "LATEST"))
    assert said.get("FIRST_RC") == "1", res.stdout + res.stderr
    err = [line for line in res.stderr.strip().splitlines() if line.strip() and "Warning" not in line]
    first = next(line for line in err if "could not be saved" in line)
    assert re.match(r"error: rank \d: checkpoint step 2 could not be saved in .*: no space left on its disk "
                    r"\(rank \d: .*No space left on device", first), first  # whichever rank's write failed
    assert f"the newest checkpoint is still {out}/checkpoints/step_00000001" in first, first
    assert "Free space there (or set output.dir elsewhere) and rerun with --resume" in first, first
    assert "Traceback" not in res.stderr, res.stderr
    assert said["LEFT"].split() == ["latest", "step_00000001"], said  # the partial save's space was freed
    assert said.get("SECOND_RC") == "0" and said.get("LATEST") == "step_00000003", res.stdout + res.stderr


def test_a_crafted_model_target_in_a_checkpoint_never_runs(trained, tmp_path):
    """predict rebuilds the model a checkpoint names: only a torch.nn.Module class, and code outside domainflow
    only when the user trusts it."""
    import json

    from domainflow.train.checkpoint_files import MANIFEST, write_manifest

    ckpt = tmp_path / "step_00000002"
    shutil.copytree(trained / "run" / "checkpoints" / "step_00000002", ckpt)
    marker = tmp_path / "ran"
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["model"].update(target="os:system", kwargs={"command": f"touch {marker}"})
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / MANIFEST).unlink()
    write_manifest(ckpt, {})  # whoever crafts it can write a manifest to match
    res = _predict(trained, ckpt, tmp_path / "p.vtp")
    assert res.returncode == 1 and "code outside domainflow" in res.stderr and "--trust-model-target" in res.stderr
    res = run_cli("predict", ckpt, trained / "cars.zarr", "--run", "run_1", tmp_path / "p.vtp", "--trust-model-target")
    assert res.returncode == 1 and "is a builtin_function_or_method, not a torch.nn.Module class" in res.stderr, \
        res.stderr
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["/dev/zero", "../outside", "malformed"])
def test_a_crafted_manifest_reads_nothing_outside_the_checkpoint(trained, tmp_path, entry):
    import json

    from domainflow.train.checkpoint_files import MANIFEST

    ckpt = tmp_path / "step_00000002"
    shutil.copytree(trained / "run" / "checkpoints" / "step_00000002", ckpt)
    body = json.loads((ckpt / MANIFEST).read_text())
    body["files"][entry] = {"size": 5} if entry == "malformed" else {"bytes": 0, "sha256": "0" * 64}
    (ckpt / MANIFEST).write_text(json.dumps(body))
    res = _predict(trained, ckpt, tmp_path / "p.vtp")
    assert res.returncode == 1 and f"manifest.json has a malformed entry {entry!r}" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


class _NumpyState(torch.nn.Module):
    """A module whose extra state is a numpy array: loading it would need more than plain values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def get_extra_state(self):
        import numpy as np

        return np.arange(3)

    def set_extra_state(self, state):
        pass


def test_state_that_could_not_load_safely_is_refused_when_saved(tmp_path):
    from domainflow.train import checkpoint as ckpt

    model = _NumpyState()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ckpt.CheckpointError, match=r"its state model\._extra_state \(numpy\.ndarray\) is not a "
                                                   r"tensor or a plain value"):
        ckpt.save(tmp_path, 1, model, opt)
    assert not list(tmp_path.glob("step_*"))
