"""Shared pytest fixtures: multi-process pools with real (Gloo) process groups.

    from dist_pool import WORLD_SIZES, current_op, rank_and_world

    def _sum_ranks():                         # module level: sent to the workers by reference
        rank, world = rank_and_world()
        t = torch.tensor([float(rank)])
        with current_op("all_reduce of ranks"):
            torch.distributed.all_reduce(t)
        return t

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_sum(dist, world_size):
        out = dist.run(world_size, _sum_ranks)      # one result per rank, in rank order
        ...

(or request the ``world_size`` fixture, which is parametrised over WORLD_SIZES.)
"""

from __future__ import annotations

import os
import sys

# the harness (dist_pool, sharded_check, store_compare) is imported by module name, by tests and workers alike
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")
if sys.path[:1] != [_HERE]:
    if _HERE in sys.path:
        sys.path.remove(_HERE)
    sys.path.insert(0, _HERE)

import multiprocessing  # noqa: E402

import pytest  # noqa: E402
from dist_pool import WORLD_SIZES, PoolCache  # noqa: E402

from domainflow.train.run import COMPILE_MODULES, RANK_MODULES  # noqa: E402

# whichever test starts this process's fork server first (launch_local or a pool), it imports what the ranks
# import, once (also what a rank's first compile imports: many tests compile)
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", *RANK_MODULES, *COMPILE_MODULES])


@pytest.fixture(scope="session")
def dist():
    """Session-wide pools, one per world size: ``dist.run(world_size, fn, *args, **kwargs)``."""
    cache = PoolCache()
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture(params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def world_size(request):
    """Parametrises a test over WORLD_SIZES (1, 2, 3, 4)."""
    return request.param


# -- shared data: made once per session, read-only for the tests (a test that changes files copies them) -------
@pytest.fixture(scope="session")
def cars_raw(tmp_path_factory):
    """A small DrivaerML-style raw data set: 4 runs of about 400 surface cells (and a volume each)."""
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    path = tmp_path_factory.mktemp("cars_raw") / "raw"
    synth_drivaerml(path, runs=4, cells=400, seed=3, volume_cells=200, volume_pieces=1, progress=False)
    return path


@pytest.fixture(scope="session")
def cars_store(cars_raw, tmp_path_factory):
    """``cars_raw``'s surfaces ingested in 4 parts, train 3 runs and val 1 (``run_1``..``run_4``)."""
    from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_drivaerml

    path = tmp_path_factory.mktemp("cars_store") / "cars.zarr"
    ingest_drivaerml(cars_raw, path, MeshOptions(parts=4, locations=("surface",), progress=False,
                                                 split=(0.75, 0.25, 0.0)))
    return path


@pytest.fixture(scope="session")
def cars_store_chunked(cars_raw_large, tmp_path_factory):
    """``cars_raw_large`` ingested in 4 parts with 4 KiB chunks (several chunks per array), train 4 runs, val 2,
    test 2; tests that damage a store damage a copy of it."""
    from domainflow.preprocess.ingest_mesh import ingest_drivaerml

    path = tmp_path_factory.mktemp("cars_store_chunked") / "s.zarr"
    ingest_drivaerml(cars_raw_large, path, parts=4, progress=False, split=(0.5, 0.25, 0.25), locations=("surface",),
                     chunk_bytes=4096)
    return path


@pytest.fixture(scope="session")
def cars_raw_large(tmp_path_factory):
    """8 runs of 3000 surface cells: several chunks per array (store integrity and checksum tests)."""
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    path = tmp_path_factory.mktemp("cars_raw_large") / "raw"
    synth_drivaerml(path, runs=8, cells=3000, seed=5, volume_cells=200, volume_pieces=1, progress=False)
    return path



# The files that run longest first (about 20 s or more each here, longest first), then the rest folder by folder:
# with `--dist loadfile --no-loadscope-reorder` (the Makefile) each worker takes whole files in this order as it
# frees up, so the run ends on short files instead of one worker alone with a long one (xdist's own order, by
# number of tests, left the 30 s op database file for last).
_LONG_FILES = ("train/test_train.py", "core/test_compile.py", "data/test_readers.py", "train/test_launch_errors.py",
               "data/test_ingest_streaming.py", "train/test_checkpoint_integrity.py", "data/test_ingest_mesh.py",
               "ops/test_grid_ops.py", "harness/test_dist_pool.py", "ops/test_op_db.py", "train/test_readme.py",
               "core/test_packaging.py", "data/test_store_integrity.py", "train/test_forecast.py",
               "models/test_model_zoo.py", "ops/test_point_ops.py", "core/test_dispatch.py",
               "train/test_local_sockets.py", "train/test_fsdp.py", "core/test_collective_errors.py")
_FOLDERS_FIRST = ("train", "models", "data", "ops", "core", "harness")


def pytest_collection_modifyitems(session, config, items):
    tests = os.path.dirname(os.path.abspath(__file__))
    gone = [f for f in _LONG_FILES if not os.path.exists(os.path.join(tests, f))]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: _LONG_FILES names files that do not exist: {gone}")

    def rank(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        if path in _LONG_FILES:
            return (0, _LONG_FILES.index(path))
        folder = path.split("/")[0]
        return (1, _FOLDERS_FIRST.index(folder) if folder in _FOLDERS_FIRST else len(_FOLDERS_FIRST))

    items.sort(key=rank)  # stable: files keep their order within a folder, tests within a file
