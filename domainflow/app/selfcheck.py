"""``domainflow selfcheck``: domain-parallel training of a
per-point network on a surface point cloud, checked step by step against single-process training.

Data: N points on a sphere (Fibonacci lattice) in a uniform flow along x. Potential-flow theory gives
the surface pressure coefficient Cp = 1 - 9/4 sin^2(theta), theta the angle from the flow direction:
stagnation (Cp = 1) at the front and back, suction (Cp = -1.25) around the equator. The network maps
(position, normal) to Cp.

Domain parallelism: points are sorted along x (a slab partition) and split unevenly between ranks; rank
0 scatters each rank only its own slab (``scatter_tensor``). The model is a plain ``nn.Module`` with
replicated parameters; the loss is the exact global mean over all points. The same training runs in
one process on the full cloud, and parameters are compared after every step (float64).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

import domainflow as df


class PointNet(torch.nn.Module):
    """Per-point MLP (Linear -> LayerNorm -> GELU ...): domain parallel with no handler at all."""

    def __init__(self, c_in: int = 6, hidden: int = 32, c_out: int = 1):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(c_in, hidden), torch.nn.LayerNorm(hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, c_out))

    def forward(self, x):
        return self.net(x)


def sphere_cloud(n: int, dtype=torch.float64):
    """(features [n, 6] = position and normal, Cp [n, 1]) sorted along x."""
    i = torch.arange(n, dtype=dtype) + 0.5
    phi = torch.acos(1 - 2 * i / n)
    theta = math.pi * (1 + 5 ** 0.5) * i
    p = torch.stack([torch.cos(phi), torch.sin(phi) * torch.cos(theta), torch.sin(phi) * torch.sin(theta)], 1)
    order = torch.argsort(p[:, 0])
    p = p[order]
    sin2 = 1 - p[:, 0] ** 2
    cp = (1 - 2.25 * sin2).unsqueeze(1)
    return torch.cat([p, p], 1), cp  # on a unit sphere the outward normal equals the position


def _train(model, x, y, steps, lr):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach().full_tensor().item() if isinstance(loss, df.ShardTensor) else loss.item()))
    return losses


def rank_main(n_points: int, steps: int, lr: float, split: float, out_dir: str) -> dict:
    """One rank of the self-check (started by ``domainflow selfcheck``)."""
    mesh = df.init_mesh((int(os.environ["WORLD_SIZE"]),), ("domain",))
    rank, world = mesh.get_rank(), mesh.size()
    torch.manual_seed(0)
    model = PointNet().double()
    ref_model = PointNet().double()
    ref_model.load_state_dict(model.state_dict())
    # uneven slab partition: rank 0 takes `split` of the points, the rest share the remainder
    first = round(split * n_points) if world > 1 else n_points
    sizes = (first,) + tuple(len(c) for c in torch.arange(n_points - first).tensor_split(world - 1)) if world > 1 else (n_points,)
    x_full = y_full = None
    if rank == 0:
        x_full, y_full = sphere_cloud(n_points)
    x = df.scatter_tensor(x_full, 0, mesh, [df.Shard(0)], sharding_shapes={0: sizes})
    y = df.scatter_tensor(y_full, 0, mesh, [df.Shard(0)], sharding_shapes={0: sizes})
    df.comm.stats.reset()
    t0 = time.perf_counter()
    losses = _train(model, x, y, steps, lr)
    t_sharded = time.perf_counter() - t0
    comm_bytes = dict(df.comm.stats.bytes)
    with torch.no_grad():
        pred = model(x).full_tensor()
    result = {"rank": rank, "world": world, "local_points": x.to_local().shape[0], "sizes": list(sizes)}
    if rank == 0:
        t0 = time.perf_counter()
        ref_losses = _train(ref_model, x_full, y_full, steps, lr)
        t_single = time.perf_counter() - t0
        diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref_model.parameters()))
        rel_l2 = float(torch.linalg.vector_norm(pred - y_full) / torch.linalg.vector_norm(y_full))
        baseline = float(torch.linalg.vector_norm(y_full.mean() - y_full) / torch.linalg.vector_norm(y_full))
        result.update(losses=losses, ref_losses=ref_losses, max_param_diff=diff, rel_l2_cp=rel_l2,
                      rel_l2_mean_baseline=baseline, seconds_sharded=t_sharded, seconds_single=t_single,
                      comm_bytes_per_step={k: v / steps for k, v in comm_bytes.items()})
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "demo_results.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out / "demo_results.json")  # publish atomically
    return result


def report(result: dict, out_dir: str) -> int:
    """Print the self-check's table; exit status 0 only when sharded training equals single-process training."""
    losses, ref = result["losses"], result["ref_losses"]
    print(f"\ndomainflow demo: {sum(result['sizes'])} surface points, domain = {result['world']} ranks, "
          f"uneven shards {result['sizes']}")
    print(f"{'step':>5} {'loss (sharded)':>16} {'loss (1 process)':>17} {'|diff|':>9}")
    for s in sorted({k for k in (0, 1, 2, len(losses) // 2, len(losses) - 1) if 0 <= k < len(losses)}):
        print(f"{s:>5} {losses[s]:>16.10f} {ref[s]:>17.10f} {abs(losses[s] - ref[s]):>9.1e}")
    print(f"max |parameter difference| after {len(losses)} steps: {result['max_param_diff']:.2e} (float64)")
    print(f"relative L2 error of Cp: model {result['rel_l2_cp']:.4f}, mean-field baseline "
          f"{result['rel_l2_mean_baseline']:.4f}")
    print(f"bytes communicated per step on rank 0: {result['comm_bytes_per_step']}")
    print(f"time: sharded {result['seconds_sharded']:.2f} s, single process {result['seconds_single']:.2f} s")
    print(f"results: {Path(out_dir) / 'demo_results.json'}")
    ok = result["max_param_diff"] < 1e-10 and max(abs(a - b) for a, b in zip(losses, ref)) < 1e-10
    print("PASS: domain-parallel training equals single-process training" if ok else
          "FAIL: sharded and single-process training differ")
    return 0 if ok else 1
