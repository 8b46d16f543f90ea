"""Your own model by import path (``model.target``, ``model.kwargs``): a layer taken from ``torch.nn`` and an FNO
written in a file of its own (torch ops only, ``torch.fft`` included) train and forecast through the CLI,
domain-parallel with the single-device values; the checkpoint records the target so ``predict`` rebuilds
it; a wrong target is one line before any rank starts, a constructor that raises one line from every rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")

from cli_runner import run_cli  # noqa: E402  (the command in this process, its ranks forked)
from test_forecast import INITS, _by_hand  # noqa: E402

FNO = f"{Path(__file__).resolve().parent / 'user_models.py'}:FNO"
GRID = ["data.kind=grid", "train.steps=2", "train.dtype=float64", "output.plots=false", "output.progress=false",
        "data.prefetch=0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from domainflow.preprocess.ingest_grid import ingest_climate
    from domainflow.preprocess.synth_climate import synth_climate

    root = tmp_path_factory.mktemp("user_models")
    synth_climate(root / "era5.zarr", grid=(8, 16), steps=40, seed=2, progress=False)
    ingest_climate(root / "era5.zarr", root / "g.zarr", progress=False, split=(0.6, 0.2, 0.2))
    return root / "g.zarr"


def _cli(*args, cwd=None):
    return run_cli(*args, cwd=cwd, env={"OMP_NUM_THREADS": "1", "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"})


def _train(store, out, *extra):
    r = _cli("train", "--out", out, f"data.store={store}", *GRID, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((Path(out) / "result.json").read_text())


def test_a_torch_nn_layer_trains_and_forecasts_like_the_model_by_hand(store, tmp_path, dist):
    """torch.nn.Conv2d: in_channels / out_channels come from the store, the rest from model.kwargs."""
    from domainflow.train import checkpoint as ckpt

    _train(store, tmp_path / "train", "model.target=torch.nn:Conv2d", 'model.kwargs={"kernel_size": 3, "padding": 1}',
           "--domain", "2")
    path = ckpt.latest(tmp_path / "train" / "checkpoints")
    model_cfg = ckpt.meta(path)["config"]["model"]
    assert model_cfg["target"] == "torch.nn:Conv2d" and model_cfg["kwargs"] == {"kernel_size": 3, "padding": 1}
    expected, names = dist.run(1, _by_hand, store, tmp_path / "train" / "checkpoints", 2)[0]
    for out, extra in ((tmp_path / "one.zarr", []), (tmp_path / "two.zarr", ["--domain", "2"])):
        r = _cli("predict", tmp_path / "train" / "checkpoints", store, out, "--init", INITS, "--steps", "2", *extra,
                 "--trust-model-target")
        assert r.returncode == 0, r.stderr[-3000:]
        with xr.open_zarr(out) as got:
            for c, v in enumerate(names):
                np.testing.assert_allclose(got[v].values, expected[:, :, c], rtol=1e-10, atol=1e-9)


def test_an_fno_from_a_file_trains_the_same_on_one_and_three_ranks(store, tmp_path):
    """The FNO's FFTs transform the sharded latitude: the shard moves to the channels for them (all-to-all)."""
    one = _train(store, tmp_path / "one", f"model.target={FNO}", 'model.kwargs={"width": 6, "modes": 2}')
    three = _train(store, tmp_path / "three", f"model.target={FNO}", 'model.kwargs={"width": 6, "modes": 2}',
                   "--domain", "3")
    assert one["loss"] == pytest.approx(three["loss"], rel=1e-12)
    for key, value in one["eval"]["summary"]["model"].items():
        assert three["eval"]["summary"]["model"][key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    # a checkpoint's own model code is imported only when the user trusts it (one line, before any rank starts)
    r = run_cli("predict", tmp_path / "three" / "checkpoints", store, tmp_path / "f0.nc", "--init", INITS)
    assert r.returncode == 1 and f"was trained with model.target={FNO!r}, code outside domainflow" in r.stderr
    assert "--trust-model-target" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    outs = []
    for out, extra in ((tmp_path / "f1.nc", ["--trust-model-target"]),
                       (tmp_path / "f2.nc", ["--domain", "2", "--trust-model-target"])):
        # predict rebuilds the model from the checkpoint alone, from another working folder
        r = _cli("predict", tmp_path / "three" / "checkpoints", store, out, "--init", INITS, "--steps", "2", *extra,
                 cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(xr.open_dataset(out))
    for v in outs[0].data_vars:
        assert np.isfinite(outs[0][v].values).all()
        np.testing.assert_allclose(outs[1][v].values, outs[0][v].values, rtol=1e-10, atol=1e-9)


def test_a_wrong_target_is_one_line_before_ranks_start(store, tmp_path):
    for extra, msg in [(["model.target=nosuch_package.models:Net"], "cannot import 'nosuch_package.models'"),
                       (["model.target=torch.nn:NoSuchLayer"], "'torch.nn' has no callable 'NoSuchLayer'"),
                       ([f"model.target={tmp_path / 'missing.py'}:Net"], "no file"),
                       (["model.target=torch.nn:Conv2d", 'model.kwargs={"kernel": 3}'],
                        r"model.kwargs ['kernel'] are not parameters of torch.nn:Conv2d"),
                       (["model.target=torch.nn:Conv2d", "model.kwargs=3"], "must be a table")]:
        r = run_cli("train", "--out", tmp_path / "t", f"data.store={store}", *GRID, *extra, "--domain", "2")
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode != 0 and len(lines) == 1 and msg in lines[0], (extra, r.stderr[-2000:])
    # a target that builds something other than a module is named by every rank (one line)
    r = _cli("train", "--out", tmp_path / "t", f"data.store={store}", *GRID, "model.target=builtins:dict",
             "--domain", "2")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "not a torch.nn.Module" in lines[0], r.stderr[-2000:]


_RAISING_MODEL = """
from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels, out_channels, width=4):
        super().__init__()
        if width % 3:
            raise ValueError(f"width must be a multiple of 3,\\ngot {width}")  # two lines
        self.conv = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x):
        return self.conv(x)
"""


def test_a_constructor_that_raises_is_one_line_naming_target_kwargs_and_exception(store, tmp_path):
    """The user's ``__init__`` raises (a ValueError over two lines): one ConfigError line on one rank and from
    the ranks of a launch, naming the target, the kwargs it was built with and the exception; its traceback,
    the user's line included, only with DOMAINFLOW_TRACEBACK=1."""
    (tmp_path / "raising.py").write_text(_RAISING_MODEL)
    target = f"{tmp_path / 'raising.py'}:Net"
    args = ["train", "--out", tmp_path / "t", f"data.store={store}", *GRID, f"model.target={target}",
            'model.kwargs={"width": 4}']
    want = (f"model.target={target!r} with {{'width': 4, 'in_channels': 5, 'out_channels': 5}} failed to build: "
            f"ValueError: width must be a multiple of 3, got 4; fix model.kwargs or the constructor")
    one = run_cli(*args)  # one rank, in this process
    lines = [x for x in one.stderr.splitlines() if x.strip()]
    assert one.returncode == 1 and lines == [f"error: {want}"], one.stderr[-2000:]
    two = run_cli(*args, "--domain", "2", env={"DOMAINFLOW_TRACEBACK": None})
    lines = [x for x in two.stderr.splitlines() if x.strip()]
    assert two.returncode == 1 and len(lines) == 1, two.stderr[-3000:]
    assert lines[0].startswith("error: rank ") and want in lines[0], lines
    shown = run_cli(*args, "--domain", "2", env={"DOMAINFLOW_TRACEBACK": "1"})
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr, shown.stderr[-3000:]
    assert 'raise ValueError(f"width must be a multiple of 3' in shown.stderr and want in shown.stderr, \
        shown.stderr[-3000:]


def test_a_torch_nn_model_on_a_mesh_store_and_the_globals_contract(tmp_path):
    """torch.nn.Linear on the surface points (in_features/out_features from the store): with the store's design
    parameters passed as globals its one-argument forward is refused by name; without them it trains on two
    ranks and predicts."""
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    synth_drivaerml(tmp_path / "raw", runs=4, cells=400, seed=3, volume_cells=200, volume_pieces=1, progress=False)
    ingest_drivaerml(tmp_path / "raw", tmp_path / "cars.zarr",
                     MeshOptions(parts=4, locations=("surface",), progress=False, split=(0.75, 0.25, 0.0)))
    mesh = [f"data.store={tmp_path / 'cars.zarr'}", "data.kind=mesh", "model.target=torch.nn:Linear",
            "train.steps=2", "output.plots=false", "output.progress=false", "data.prefetch=0", "--domain", "2"]
    r = _cli("train", "--out", tmp_path / "refused", *mesh)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "its forward takes one input" in lines[0] \
        and "data.use_params=false" in lines[0], r.stderr[-2000:]
    r = _cli("train", "--out", tmp_path / "linear", *mesh, "data.use_params=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "relative L2" in r.stdout or "rel_l2" in r.stdout, r.stdout[-2000:]
    r = _cli("predict", tmp_path / "linear" / "checkpoints", tmp_path / "cars.zarr", tmp_path / "run.pvtp", "--run",
             "run_4", "--domain", "2", "--trust-model-target")
    assert r.returncode == 0, r.stderr[-3000:]
