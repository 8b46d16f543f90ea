"""Stores at a URL: ``ingest`` into ``s3://`` (a local S3-compatible moto server on 127.0.0.1) builds the
store locally and uploads it with its root metadata last; readers, ``inspect``, ``train`` and ``predict``
read it through zarr's fsspec store with the same chunk reads and byte counts as the local copy; an
interrupted upload resumes; a store already at the URL is not replaced without --overwrite; a plain HTTP
server serves a store read-only; a missing fsspec backend is one line."""

from __future__ import annotations

import functools
import http.server
import json
import os
import threading

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("aiohttp")
moto_server = pytest.importorskip("moto.server")
zarr = pytest.importorskip("zarr")

from cli_runner import run_cli  # noqa: E402  (ingest and inspect in this process, pointed at the server)
from domainflow.readers.store import StoreError, open_store  # noqa: E402

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with a bucket; the environment that points fsspec at it (set here for
    this process, passed to the CLI's)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**CREDS, "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fsspec.config.set_conf_env(fsspec.config.conf)  # fsspec reads FSSPEC_* once at import: again now
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("bucket")
    try:
        yield {"env": {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                       "DOMAINFLOW_COLLECTIVE_TIMEOUT": "60"}, "fs": fs,
               "root": tmp_path_factory.mktemp("remote")}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture(scope="module")
def raw(s3):
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    synth_drivaerml(s3["root"] / "raw", runs=3, cells=600, seed=5, volume_cells=200, volume_pieces=1)
    return s3["root"] / "raw"


def _cli(env, *args):
    """``domainflow ARGS`` in this process (its ranks forked) with the environment ``env``."""
    return run_cli(*args, env={**{k: None for k in os.environ if k not in env},
                               **{k: v for k, v in env.items() if os.environ.get(k) != v}})


INGEST = ["--parts", "4", "--locations", "surface", "--split", "0.67,0.33,0", "--quiet"]


@pytest.fixture(scope="module")
def stores(s3, raw):
    """The same runs ingested into a local folder and into s3://bucket/cars.zarr."""
    local = s3["root"] / "cars.zarr"
    r = run_cli("ingest", "cfd", raw, local, *INGEST)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("ingest", "cfd", raw, "s3://bucket/cars.zarr", *INGEST, "--staging", s3["root"] / "staging")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "uploaded to s3://bucket/cars.zarr (root metadata last)" in r.stdout, r.stdout
    return local, "s3://bucket/cars.zarr"


def _read_region(store, run, lo, hi):
    store.counter.track_keys = True
    store.counter.reset()
    group = store.run(run)["surface"]
    out = {k: store.read(group[k], slice(lo, hi)) for k in ("coords", "normals", "areas")}
    out.update({k: store.read(group["fields"][k], slice(lo, hi)) for k in ("Cp", "Cf")})
    return out, store.counter.data, sorted(store.counter.keys)


def test_an_s3_store_reads_the_same_region_with_the_same_bytes(stores):
    local, url = (open_store(p) for p in stores)
    assert url.runs() == local.runs() and url.splits == local.splits and url.stats == local.stats
    for run in local.runs():
        offsets = local.read(local.run(run)["surface"]["parts"])
        lo, hi = int(offsets[1]), int(offsets[3])  # rank 1's parts of a 2-rank domain: a region, not the run
        a, bytes_a, keys_a = _read_region(local, run, lo, hi)
        b, bytes_b, keys_b = _read_region(url, run, lo, hi)
        assert keys_a == keys_b and bytes_a == bytes_b > 0
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    url.check_unchanged()  # the root object's ETag is the stamp


def test_inspect_train_and_predict_from_the_url(s3, stores, tmp_path):
    _, url = stores
    r = run_cli("inspect", url)
    assert r.returncode == 0 and "mesh store" in r.stdout and "complete" in r.stdout, r.stderr[-2000:]
    common = ["train.steps=2", "model.dim=8", "model.layers=1", "model.heads=2", "model.slices=4",
              "train.dtype=float64", "output.plots=false", "output.progress=false", "data.prefetch=1", "--domain", "2"]
    r = _cli(s3["env"], "train", "--out", tmp_path / "s3", f"data.store={url}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "s3" / "result.json").read_text())
    assert result["steps"] == 2 and result["eval"]["summary"]["samples"] == 1
    r = _cli(s3["env"], "predict", tmp_path / "s3" / "checkpoints", url, tmp_path / "run.vtp", "--run", "run_2",
             "--domain", "2")
    assert r.returncode == 0 and (tmp_path / "run.vtp").exists(), r.stderr[-3000:]


def test_an_interrupted_upload_resumes_and_readers_refuse_it_meanwhile(s3, raw, stores):
    fs, url = s3["fs"], "s3://bucket/cars.zarr"
    objects = sorted(fs.find("bucket/cars.zarr"))
    chunk = next(o for o in objects if "/surface/fields/Cp/c/" in o)
    fs.rm([chunk, "bucket/cars.zarr/zarr.json"])  # as an upload stopped before its last objects
    with pytest.raises(StoreError, match="not a domainflow store"):
        open_store(url)
    r = run_cli("ingest", "cfd", raw, url, *INGEST, "--staging", s3["root"] / "staging")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 object(s) uploaded" in r.stdout, r.stdout  # the missing chunk, then the root metadata
    assert sorted(fs.find("bucket/cars.zarr")) == objects
    assert open_store(url).runs() == open_store(stores[0]).runs()


def test_a_store_at_the_url_is_replaced_only_with_overwrite(s3, raw, stores):
    from domainflow.preprocess.synth_drivaerml import synth_drivaerml

    url, fs = "s3://bucket/cars.zarr", s3["fs"]
    other = s3["root"] / "elsewhere"  # another machine's staging: it did not build what is at the URL
    r = run_cli("ingest", "cfd", raw, url, *INGEST, "--staging", other)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "already holds a store" in lines[0] and "--overwrite" in lines[0], \
        r.stderr
    # new data of the same sizes (another seed): every object is sent again, none of the old one is kept
    raw2 = s3["root"] / "raw2"
    synth_drivaerml(raw2, runs=3, cells=600, seed=6, volume_cells=200, volume_pieces=1)
    r = run_cli("ingest", "cfd", raw2, url, *INGEST, "--staging", other, "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    staged = next(p for p in other.iterdir() if p.is_dir() and p.name.endswith("cars.zarr"))
    files = sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file())
    assert sorted(o[len("bucket/cars.zarr/"):] for o in fs.find("bucket/cars.zarr")) == files
    differ = [f for f in files if fs.cat_file(f"bucket/cars.zarr/{f}") != (staged / f).read_bytes()]
    assert not differ, differ[:5]


def test_a_url_holding_other_objects_is_not_touched_without_overwrite(s3, raw):
    fs = s3["fs"]
    fs.pipe_file("bucket/projects/notes.txt", b"keep me")
    r = run_cli("ingest", "cfd", raw, "s3://bucket/projects", *INGEST, "--staging", s3["root"] / "st3")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "1 object(s) but no domainflow store" in lines[0], r.stderr
    assert fs.cat_file("bucket/projects/notes.txt") == b"keep me"


def test_a_store_served_over_http(s3, stores):
    folder = stores[0].parent
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{stores[0].name}"
        store, local = open_store(url), open_store(stores[0])
        assert store.runs() == local.runs()
        run = local.runs()[0]
        a, bytes_a, keys_a = _read_region(local, run, 0, 50)
        b, bytes_b, keys_b = _read_region(store, run, 0, 50)
        assert keys_a == keys_b and bytes_a == bytes_b
        np.testing.assert_array_equal(a["Cp"], b["Cp"])
    finally:
        server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_a_missing_backend_or_scheme_is_one_line(s3, stores, tmp_path):
    r = run_cli("inspect", "gs://bucket/cars.zarr")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "gcsfs" in lines[0], r.stderr
    r = run_cli("train", "--out", tmp_path / "t", "data.store=nosuch://x/cars.zarr")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "no filesystem for nosuch://" in lines[0], r.stderr
