"""Store chunks carry a crc32c (zarr v3's ``crc32c`` codec, after zstd), so one flipped bit in a chunk file is an
error naming the store, run, array and chunk, raised by the readers (and by a 2-rank training job as one line,
not a hang), instead of data that trains on. Every array an ingest writes carries it; a store written before
checksums still reads, and ``domainflow inspect`` says which kind a store is. Stores written by the real
ingest, bits flipped in the chunk files on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from cli_runner import run_cli  # noqa: E402
from domainflow.preprocess.errors import IngestError  # noqa: E402
from domainflow.preprocess.ingest_mesh import ingest_drivaerml  # noqa: E402
from domainflow.readers import StoreError, open_store  # noqa: E402

PARTS = 4
OPTS = dict(parts=PARTS, progress=False, split=(0.5, 0.25, 0.25), locations=("surface",), chunk_bytes=4096)
FIX = "re-ingest it (`domainflow ingest ... --overwrite`)"


@pytest.fixture(scope="module")
def raw(cars_raw_large):
    return cars_raw_large


@pytest.fixture(scope="module")
def pristine(cars_store_chunked):
    """A mesh store as ingest writes it (several chunks per array, OPTS); tests damage copies of it."""
    return cars_store_chunked


@pytest.fixture
def store(pristine, tmp_path):
    import shutil

    path = tmp_path / "s.zarr"
    shutil.copytree(pristine, path)
    return path


GRID = dict(progress=False, split=(0.5, 0.25, 0.25), variables=("t2m", "sst", "z500"))  # sst: gaps over land


@pytest.fixture(scope="module")
def cds(tmp_path_factory):
    """CDS-style netCDF files: two months, six-hourly, on an 8 x 16 grid."""
    pytest.importorskip("xarray")
    pytest.importorskip("netCDF4")
    from domainflow.preprocess.synth_cds import synth_cds

    return synth_cds(tmp_path_factory.mktemp("cds") / "era5", grid=(8, 16), steps=130, seed=1)


@pytest.fixture(scope="module")
def grid(cds, tmp_path_factory):
    """A grid store with every array a climate ingest writes: data, lat, lon, time, static, missing (a
    filled variable) and climatology."""
    from domainflow.preprocess.ingest_grid import ingest_climate

    path = tmp_path_factory.mktemp("grid") / "g.zarr"
    ingest_climate(str(cds / "*.nc"), path, fill="mean", static=("lsm",), **GRID)
    return path


def _chunk_files(store: Path, array: str) -> list[Path]:
    return sorted(p for p in (store / array / "c").rglob("*") if p.is_file())


def _flip_bit(path: Path, at: float = 0.5, bit: int = 3) -> None:
    """Flip one bit of the file, ``at`` of the way into it (in the compressed payload)."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 1 << bit
    path.write_bytes(bytes(data))


def _arrays(path) -> dict:
    root = zarr.open_group(path, mode="r")
    return {name: node for name, node in root.members(max_depth=None) if isinstance(node, zarr.Array)}


def _codec_names(arr) -> list[str]:
    return [c.to_dict()["name"] for c in arr.metadata.codecs]


def _mesh_dataset(path, **kw):
    import torch

    import domainflow as df
    from domainflow.readers import MeshDataset

    return MeshDataset(path, df.init_mesh((1,), ("domain",)), split=None, dtype=torch.float64, **kw)


# -- every array written carries the checksum, as the last bytes-to-bytes codec ------------------------
def test_every_array_of_a_mesh_store_carries_a_crc32c_after_zstd(pristine):
    arrays = _arrays(pristine)
    assert len(arrays) >= 8 * 7  # coords, normals, areas, order, parts, part_boxes, fields of every run
    for name, arr in arrays.items():
        assert _codec_names(arr)[-2:] == ["zstd", "crc32c"], (name, _codec_names(arr))
    assert zarr.open_group(pristine, mode="r").attrs["domainflow"]["checksum"] == "crc32c"


def test_every_array_of_a_grid_store_carries_a_crc32c_after_zstd(grid):
    arrays = _arrays(grid)
    assert {"data", "lat", "lon", "time", "static", "missing", "climatology"} <= set(arrays), sorted(arrays)
    for name, arr in arrays.items():
        assert _codec_names(arr)[-2:] == ["zstd", "crc32c"], (name, _codec_names(arr))


# -- a flipped bit is named by the readers ------------------------------------------------------------
def test_a_flipped_bit_in_a_mesh_chunk_is_named_by_the_reader(store):
    s = open_store(store)
    run = s.runs()[0]
    arr = s.run(run)["surface/fields/Cp"]
    rows = arr.chunks[0]
    clean = s.read(arr, slice(0, rows))
    victim = _chunk_files(store, f"runs/{run}/surface/fields/Cp")[1]
    _flip_bit(victim)
    for prefetch in (0, 2):  # inline, and on the prefetch thread (handed to the consumer)
        ds = _mesh_dataset(store, prefetch=prefetch, runs=[run], shuffle=False)
        with pytest.raises(StoreError) as info:
            for _ in ds:
                pass
        msg = str(info.value)
        assert msg.startswith(f"{store} is damaged: run {run}, array surface/fields/Cp, chunk 1"), msg
        assert "checksum mismatch (crc32c)" in msg and str(victim) in msg and FIX in msg and "\n" not in msg
    # Store.read names it too, and the other chunks of the array still read
    with pytest.raises(StoreError, match=r"chunk 1,0 .*checksum mismatch \(crc32c\)"):
        open_store(store).read(arr)
    np.testing.assert_array_equal(open_store(store).read(arr, slice(0, rows)), clean)


def test_every_bit_of_a_chunk_is_covered(store):
    """Not only the payload: the zstd frame header and the stored checksum itself."""
    run = open_store(store).runs()[0]
    victim = _chunk_files(store, f"runs/{run}/surface/coords")[0]
    original = victim.read_bytes()
    arr = open_store(store).run(run)["surface/coords"]
    for at in (0.0, 0.5, (len(original) - 1) / len(original)):
        _flip_bit(victim, at, bit=0)
        with pytest.raises(StoreError, match=r"array surface/coords, chunk 0,0 .*checksum mismatch \(crc32c\)"):
            open_store(store).read(arr)
        victim.write_bytes(original)
    assert open_store(store).read(arr).shape == arr.shape


def test_a_flipped_bit_in_a_grid_chunk_is_named_by_the_reader(grid, tmp_path):
    import shutil

    import domainflow as df
    from domainflow.readers import GridDataset

    path = tmp_path / "g.zarr"
    shutil.copytree(grid, path)
    victim = path / "data" / "c" / "5" / "1" / "0" / "0"
    _flip_bit(victim)
    ds = GridDataset(path, df.init_mesh((1,), ("domain",)), split="train", prefetch=0, shuffle=False)
    with pytest.raises(StoreError) as info:
        for t, _ in ds.steps():
            ds.read_region(t)
    msg = str(info.value)
    assert msg.startswith(f"{path} is damaged: array data, chunk 5,1,0,0"), msg
    assert "checksum mismatch (crc32c)" in msg and str(victim) in msg and FIX in msg


def test_a_flipped_bit_in_a_climatology_chunk_is_named(grid, tmp_path):
    import shutil

    import domainflow as df
    from domainflow.readers import GridDataset

    path = tmp_path / "g.zarr"
    shutil.copytree(grid, path)
    for victim in _chunk_files(path, "climatology"):
        _flip_bit(victim)
    ds = GridDataset(path, df.init_mesh((1,), ("domain",)), split="train", prefetch=0, shuffle=False)
    with pytest.raises(StoreError, match=r"array climatology, chunk .*checksum mismatch \(crc32c\)"):
        ds.read_climatology(ds.steps()[0][0])


def test_inspect_names_a_flipped_bit_in_what_it_reads(grid, tmp_path):
    import shutil

    path = tmp_path / "g.zarr"
    shutil.copytree(grid, path)
    _flip_bit(_chunk_files(path, "time")[0])
    r = run_cli("inspect", path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{path} is damaged: array time, chunk 0" in r.stderr and "checksum mismatch (crc32c)" in r.stderr


def test_a_resumed_grid_ingest_names_a_flipped_bit_in_what_it_reads_back(cds, tmp_path):
    """The climatology is computed from the data written, also by an earlier (refused, killed) ingest of the
    same store: a chunk damaged in between is named there, not averaged into the store."""
    from domainflow.preprocess.ingest_grid import ingest_climate

    path = tmp_path / "g.zarr"
    with pytest.raises(IngestError, match="missing values"):  # sst's gaps, no --fill: the blocks stay written
        ingest_climate(str(cds / "*.nc"), path, **GRID)
    victim = path / "data" / "c" / "0" / "0" / "0" / "0"  # t2m (not filled: only the climatology reads it back)
    _flip_bit(victim)
    with pytest.raises(StoreError) as info:
        ingest_climate(str(cds / "*.nc"), path, fill={"sst": "mean"}, **GRID)
    msg = str(info.value)
    assert msg.startswith(f"{path} is damaged: array data, chunk 0,0,0,0"), msg
    assert "checksum mismatch (crc32c)" in msg and str(victim) in msg and FIX in msg


def test_training_on_two_ranks_stops_on_one_line_when_one_rank_reads_a_flipped_bit(store, tmp_path):
    """The damaged chunk is read by rank 1 only (the last rows of a train run): rank 1 raises from its prefetch
    thread, rank 0 waits in a collective, and the job ends (no hang) with rank 1's message on one line."""
    s = open_store(store)
    run = s.splits["train"][0]
    victim = _chunk_files(store, f"runs/{run}/surface/fields/Cp")[-1]
    offsets = np.asarray(zarr.open_group(store, mode="r")[f"runs/{run}/surface/parts"][...])
    rows = zarr.open_group(store, mode="r")[f"runs/{run}/surface/fields/Cp"].chunks[0]
    assert (len(_chunk_files(store, f"runs/{run}/surface/fields/Cp")) - 1) * rows >= offsets[PARTS // 2]  # rank 1's
    _flip_bit(victim)
    proc = run_cli("train", f"data.store={store}", f"output.dir={tmp_path / 'out'}",
                   "train.steps=6", "model.dim=8", "model.layers=1", "model.heads=2", "model.slices=4",
                   "output.progress=false", "output.plots=false", "train.eval_every=0", "--domain", "2",
                   env={"OMP_NUM_THREADS": "1", "DOMAINFLOW_TRACEBACK": None})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    damaged = [ln for ln in lines if "is damaged" in ln]
    assert len(damaged) == 1, out
    line = damaged[0]
    assert f"rank 1: {store} is damaged: run {run}, array surface/fields/Cp" in line, out
    assert "checksum mismatch (crc32c)" in line and str(victim) in line, out
    assert "Traceback" not in out, out


# -- stores written before checksums --------------------------------------------------------------
def _strip_checksums(path: Path) -> None:
    """Rewrite every array of ``path`` as an ingest before checksums did (zstd only; same chunks and values),
    and its head without the checksum entry."""
    root = zarr.open_group(path, mode="r+")
    for name, arr in list(_arrays(path).items()):
        values, attrs = np.asarray(arr[...]), dict(arr.attrs)
        parent, _, leaf = name.rpartition("/")
        group = root[parent] if parent else root
        dims = arr.metadata.dimension_names
        del group[leaf]
        group.create_array(leaf, shape=values.shape, chunks=arr.chunks, dtype=values.dtype, attributes=attrs,
                           dimension_names=dims, config={"write_empty_chunks": True})[...] = values
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["domainflow"].pop("checksum", None)
    (path / "zarr.json").write_text(json.dumps(meta))


def test_a_store_written_before_checksums_still_reads_and_inspect_says_so(store, pristine):
    _strip_checksums(store)
    assert not any("crc32c" in _codec_names(a) for a in _arrays(store).values())
    run = open_store(store).runs()[0]
    old = _mesh_dataset(store, prefetch=0).read_region(run)["arrays"]
    new = _mesh_dataset(pristine, prefetch=0).read_region(run)["arrays"]
    for k in new:
        np.testing.assert_array_equal(np.asarray(old[k]), np.asarray(new[k]))
    before = run_cli("inspect", store)
    after = run_cli("inspect", pristine)
    assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
    assert "  checksums: none (written before checksums; re-ingest to add them" in before.stdout, before.stdout
    assert "  checksums: crc32c on every array" in after.stdout, after.stdout
    # a damaged chunk that still decodes is what such a store cannot tell; one that does not is named as before
    victim = _chunk_files(store, f"runs/{run}/surface/coords")[0]
    victim.write_bytes(victim.read_bytes()[:10])
    with pytest.raises(StoreError, match=r"array surface/coords, chunk 0,0 .*cannot be read \("):
        _mesh_dataset(store, prefetch=0).read_region(run)


def test_a_partial_store_started_before_checksums_is_not_resumed_into_a_mixed_one(raw, store):
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["domainflow"].pop("checksum", None)
    meta["attributes"]["domainflow"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(IngestError, match=r"was started by an ingest that wrote no chunk checksums.*--overwrite"):
        ingest_drivaerml(raw, store, **OPTS)
    ingest_drivaerml(raw, store, **{**OPTS, "overwrite": True})
    assert all("crc32c" in _codec_names(a) for a in _arrays(store).values())
