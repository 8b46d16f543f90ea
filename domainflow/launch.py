"""Start local ranks with torch's elastic launcher, so users never write a launch script."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable


def under_launcher() -> bool:
    """True inside a rank started by torchrun / the elastic launcher."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch_local(fn: Callable, nproc: int, *args, threads_per_rank: int | None = None) -> dict[int, object]:
    """Run ``fn(*args)`` on ``nproc`` local ranks (a module-level function); return {rank: result}.

    Each rank gets the usual torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), so
    ``domainflow.init_mesh`` finds it. CPU threads are split between ranks unless given.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if threads_per_rank is not None:
        threads = str(threads_per_rank)
    else:  # an OMP_NUM_THREADS the user set wins over the even split
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"domainflow-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn",
    )
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads  # the spawned ranks inherit it; this process gets its own back
    try:
        return elastic_launch(config, fn)(*args)
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
