"""Device meshes: ``init_mesh`` sets up the process group from the launcher's environment if needed."""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh



def default_timeout_s() -> float:
    """Seconds before a collective times out: ``DOMAINFLOW_COLLECTIVE_TIMEOUT`` as it is now (read at each use:
    a rank forked from a server that imported this module long before gets its own launch's value), else 300."""
    return float(os.environ.get("DOMAINFLOW_COLLECTIVE_TIMEOUT", "300"))


# the loopback interface for Gloo's pairs and NCCL's bootstrap: a 1-rank group, and the ranks of a local launch
LOOPBACK_ENV = dict.fromkeys(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"), "lo0" if sys.platform == "darwin" else "lo")


def _device_type() -> str:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return acc.type if acc is not None else "cpu"


def init_mesh(shape: Sequence[int] | int, names: Sequence[str] | str | None = None,
              timeout_s: float | None = None) -> DeviceMesh:
    """A DeviceMesh of ``shape`` named ``names`` over all ranks.

    Initialises the default process group from the torchrun environment when none exists (NCCL with
    an accelerator, Gloo otherwise; a plain process becomes a 1-rank group). Collectives time out
    after ``timeout_s`` (env ``DOMAINFLOW_COLLECTIVE_TIMEOUT``, default 300 s) instead of hanging.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if isinstance(names, str):
        names = (names,)
    if names is not None and len(names) != len(shape):
        raise ValueError(f"init_mesh got {len(shape)} mesh dims {shape} but {len(names)} names {tuple(names)}")
    device_type = _device_type()
    if not dist.is_initialized():
        env = os.environ
        # a plain process becomes a 1-rank group through an in-memory store; the launcher variables are left
        # alone, so a later launch from this process does not mistake it for one of its ranks
        alone = {} if "RANK" in env and "WORLD_SIZE" in env else {"store": dist.HashStore(), "rank": 0,
                                                                   "world_size": 1}
        if alone:  # it talks to no one: its sockets listen on loopback, for as long as this process lives (Gloo
            # reads this for every group, the mesh's included; NCCL at its first collective), whatever a profile says
            env.update(LOOPBACK_ENV)
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type not in ("cpu", "cuda"):
            backend = None  # let torch pick the accelerator's default backend
        if device_type != "cpu":
            getattr(torch, device_type).set_device(int(os.environ.get("LOCAL_RANK", "0")))
        t = datetime.timedelta(seconds=timeout_s or default_timeout_s())
        dist.init_process_group(backend=backend, timeout=t, **alone)
    world = dist.get_world_size()
    total = 1
    for s in shape:
        total *= s
    if total != world:
        raise ValueError(
            f"mesh shape {shape} needs {total} ranks but the job has {world}; launch with "
            f"`torchrun --nproc-per-node {total}` or pick a shape whose product is {world}"
        )
    if dist.get_backend() == "gloo":
        device_type = "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=tuple(names) if names else None)

