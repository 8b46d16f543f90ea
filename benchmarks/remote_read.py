"""Region reads from a store on object storage: what one rank of a W-rank domain reads from ``s3://`` (a moto
S3 server on 127.0.0.1, in its own process), how fast, against a plain zarr read of the same rows through
the same fsspec store, and against the same reads from the local copy.

Run: .venv/bin/python benchmarks/remote_read.py [--runs 2 --cells 200000 --repeats 5]   (about a minute)
Prints a table and writes benchmarks/results/remote_read.json. A synthetic DrivaerML-style surface set is
ingested into a local store and into s3://bench/cars.zarr (``ingest`` builds it locally and uploads it: the
upload rate is reported too). Per case (W, rank): ``MeshDataset.read_region`` of that rank's rows (inputs
coords, normals; fields Cp, Cf; no normalisation), with the dataset's domain coordinate set to each rank in
turn, on the S3 store, against ``zarr.open_group(FsspecStore)[...][a:b]`` of the same arrays (group opened
once) and against ``read_region`` on the local store; best of N, interleaved. Bytes are the chunk bytes the
reader counted: the same keys and bytes from S3 and from the local copy. The S3 server is local (no
network latency): the numbers measure the client path (fsspec/s3fs/aiohttp and the server's HTTP), not a
cloud; quote the ratios. Peak RSS is this process's (the server's is separate and not the reader's).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402

LOC, INPUTS, FIELDS = "surface", ("coords", "normals"), ("Cp", "Cf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def _as_rank(ds, rank: int, world: int):
    ds.axes = dataclasses.replace(ds.axes, coords=(rank,), sizes=(world,))
    return ds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--cells", type=int, default=200_000)
    p.add_argument("--parts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    proc, port = _server()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    import fsspec

    fsspec.config.set_conf_env(fsspec.config.conf)
    tmp = Path(tempfile.mkdtemp(prefix="remote_read_"))
    try:
        import torch
        import zarr

        import domainflow as df
        from domainflow.preprocess.ingest_mesh import MeshOptions, ingest_cfd
        from domainflow.preprocess.synth_drivaerml import synth_drivaerml
        from domainflow.readers import MeshDataset
        from domainflow.remote import zarr_store

        torch.set_num_threads(1)
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
        synth_drivaerml(tmp / "raw", runs=args.runs, cells=args.cells, seed=0, volume_cells=2000, volume_pieces=1)
        opts = dict(parts=args.parts, locations=("surface",), progress=False, split=(1.0, 0.0, 0.0))
        ingest_cfd(tmp / "raw", tmp / "cars.zarr", MeshOptions(**opts))
        url = "s3://bench/cars.zarr"
        t0 = time.perf_counter()
        report = ingest_cfd(tmp / "raw", url, MeshOptions(**opts, staging=str(tmp / "staging")))
        ingest_s = time.perf_counter() - t0
        stored = sum(f.stat().st_size for f in (tmp / "cars.zarr").rglob("*") if f.is_file())

        mesh = df.init_mesh((1,), ("domain",))
        kw = dict(split=None, location=LOC, fields=FIELDS, inputs=INPUTS, shuffle=False, prefetch=0, normalize=False)
        s3_ds, local_ds = MeshDataset(url, mesh, **kw), MeshDataset(tmp / "cars.zarr", mesh, **kw)
        root = zarr.open_group(zarr_store(url), mode="r")
        keys = list(INPUTS) + [f"fields/{f}" for f in FIELDS]
        runs = s3_ds.runs

        def plain(run, a, b):
            loc = root["runs"][run][LOC]
            return {k: np.asarray(loc[k][a:b]) for k in keys}

        rows = []
        for world, rank in [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)]:
            _as_rank(s3_ds, rank, world)
            _as_rank(local_ds, rank, world)
            times = {"s3 reader": [], "s3 plain zarr": [], "local reader": []}
            nbytes = {}
            for run in runs:
                a, b = s3_ds.read_region(run)["rows"]  # warm: metadata and part offsets cached, as after an epoch
                local_ds.read_region(run)
                for name, ds in (("s3", s3_ds), ("local", local_ds)):
                    ds.store.counter.track_keys = True
                    ds.store.counter.reset()
                    got = ds.read_region(run)["arrays"]
                    nbytes.setdefault(name, []).append((ds.store.counter.data, sorted(ds.store.counter.keys)))
                ref = plain(run, a, b)
                assert all(np.array_equal(got[n].reshape(ref[n if n in INPUTS else f"fields/{n}"].shape),
                                          ref[n if n in INPUTS else f"fields/{n}"]) for n in got)
                for k in range(args.repeats):
                    order = [("s3 reader", lambda: s3_ds.read_region(run)), ("s3 plain zarr", lambda: plain(run, a, b)),
                             ("local reader", lambda: local_ds.read_region(run))]
                    for name, fn in (order if k % 2 == 0 else order[::-1]):
                        t = time.perf_counter()
                        fn()
                        times[name].append((run, time.perf_counter() - t))
            best = {n: sum(min(t for r, t in v if r == run) for run in runs) for n, v in times.items()}
            same = nbytes["s3"] == nbytes["local"]
            mib = sum(b for b, _ in nbytes["s3"]) / 2**20
            rows.append({"world": world, "rank": rank, "stored_mib_read": mib, "same_keys_and_bytes_as_local": same,
                         **{f"{n} s": v for n, v in best.items()},
                         "s3 reader MiB/s": mib / best["s3 reader"], "s3 plain MiB/s": mib / best["s3 plain zarr"],
                         "plain/reader": best["s3 plain zarr"] / best["s3 reader"],
                         "local/s3 reader": best["local reader"] / best["s3 reader"]})
        out = {"runs": len(runs), "cells": args.cells, "parts": args.parts, "repeats": args.repeats,
               "stored_mib": stored / 2**20, "ingest_to_s3_s": ingest_s, "upload": report.uploaded,
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cases": rows}
        print(f"{len(runs)} runs x ~{args.cells:,} surface cells, {args.parts} parts; store {stored / 2**20:.1f} MiB; "
              f"ingest + upload to s3 {ingest_s:.1f} s")
        print(f"{'rows of':<12}{'MiB read':>9}{'s3 reader':>11}{'plain zarr':>12}{'plain/reader':>14}{'local':>9}"
              f"{'MiB/s s3':>10}{'same bytes':>12}")
        for r in rows:
            print(f"{'W=%d rank %d' % (r['world'], r['rank']):<12}{r['stored_mib_read']:>9.2f}{r['s3 reader s']:>11.3f}"
                  f"{r['s3 plain zarr s']:>12.3f}{r['plain/reader']:>14.2f}{r['local reader s']:>9.3f}"
                  f"{r['s3 reader MiB/s']:>10.1f}{str(r['same_keys_and_bytes_as_local']):>12}")
        print("times: best of N per run summed over runs, seconds; plain/reader >= 1 means the reader is as fast as "
              "plain zarr on the same fsspec store")
        write_results("remote_read", out)
    finally:
        proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
