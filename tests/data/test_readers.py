"""Region readers: each rank reads only its region of a store and gets ShardTensors (real Gloo ranks)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from dist_pool import rank_and_world  # noqa: E402
from domainflow.preprocess.ingest_grid import ingest_climate  # noqa: E402
from domainflow.preprocess.ingest_mesh import ingest_drivaerml  # noqa: E402
from domainflow.preprocess.synth_climate import synth_climate  # noqa: E402
from domainflow.preprocess.synth_drivaerml import synth_drivaerml  # noqa: E402
from domainflow.readers.regions import chunks_touched, grid_slab  # noqa: E402
from domainflow.readers.sampling import dp_share, epoch_order  # noqa: E402
from domainflow.readers.store import StoreError, open_store  # noqa: E402
from domainflow.layout.shapes import rows_per_rank  # noqa: E402
from sharded_check import get_mesh  # noqa: E402

P = 8
H, W = 12, 20


@pytest.fixture(scope="module")
def mesh_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    synth_drivaerml(root / "raw", runs=5, cells=3000, seed=2, volume_cells=800, volume_pieces=1)
    # small chunks so that regions start and end inside chunks, as they do on real data
    ingest_drivaerml(root / "raw", root / "s.zarr", parts=P, progress=False, chunk_bytes=4096,
                     split=(0.6, 0.2, 0.2))
    return str(root / "s.zarr")


@pytest.fixture(scope="module")
def grid_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    synth_climate(root / "era5.zarr", grid=(H, W), steps=16, seed=4, time_chunk=5)
    ingest_climate(root / "era5.zarr", root / "g.zarr", progress=False, chunk_bytes=96, split=(0.5, 0.25, 0.25))
    return str(root / "g.zarr")


# -- pure arithmetic --------------------------------------------------------------------------------
def test_dp_share_sees_every_sample_once_and_evens_out_steps():
    for n in range(0, 13):
        for dp in range(1, 5):
            order = epoch_order(n, 3, 1, True)
            shares = [dp_share(order, d, dp) for d in range(dp)]
            real = sorted(i for s in shares for i, w in s if w == 1.0)
            assert real == list(range(n))
            assert len({len(s) for s in shares}) <= 1  # same number of steps on every dp rank
    assert epoch_order(10, 3, 1, True) != epoch_order(10, 3, 2, True)


def test_grid_slab_periodic_and_clipped_halos():
    s = grid_slab(10, 3, 0, halo=2, periodic=True)
    assert (s.start, s.stop, s.before, s.after) == (0, 4, 2, 2) and s.reads == ((8, 10), (0, 6))
    s = grid_slab(10, 3, 2, halo=2, periodic=True)
    assert (s.start, s.stop) == (7, 10) and s.reads == ((5, 10), (0, 2))
    s = grid_slab(10, 3, 0, halo=2)
    assert s.before == 0 and s.after == 2 and s.reads == ((0, 6),)
    assert chunks_touched(3, 9, 4) == 3 and chunks_touched(4, 8, 4) == 1 and chunks_touched(5, 5, 4) == 0
    with pytest.raises(ValueError, match="cannot split 10 grid rows over 11"):
        grid_slab(10, 11, 0)


# -- open_store -------------------------------------------------------------------------------------
def test_open_store_refuses_partial_unknown_and_foreign(mesh_store, tmp_path):
    s = open_store(mesh_store)
    assert s.kind == "mesh" and s.parts == P and set(s.runs()) == {f"run_{i}" for i in range(1, 6)}
    import shutil

    partial = tmp_path / "partial.zarr"
    shutil.copytree(mesh_store, partial)
    meta = json.loads((partial / "zarr.json").read_text())
    meta["attributes"]["domainflow"]["complete"] = False
    (partial / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="interrupted.*Rerun the same `domainflow ingest` command to resume"):
        open_store(partial)
    meta["attributes"]["domainflow"].update(complete=True, format=99)
    (partial / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match="format 99"):
        open_store(partial)
    with pytest.raises(StoreError, match="not a domainflow store"):
        open_store(tmp_path)
    zarr.open_group(tmp_path / "plain.zarr", mode="w")
    with pytest.raises(StoreError, match="not a domainflow store"):
        open_store(tmp_path / "plain.zarr")


# -- mesh regions -----------------------------------------------------------------------------------
def _mesh_regions(path, prefetch=0):
    from domainflow.readers import MeshDataset

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    ds = MeshDataset(path, mesh, split=None, fields=("Cp", "Cf"), inputs=("coords", "normals", "areas", "order"),
                     normalize=False, shuffle=False, prefetch=prefetch)
    out = []
    for sample in ds:
        before = ds.bytes_read
        full = {k: sample[k].full_tensor().numpy() for k in ("coords", "Cp", "order")}
        out.append({"run": sample["run"], "local": {k: sample[k].to_local().numpy() for k in
                                                     ("coords", "normals", "areas", "order", "Cp", "Cf")},
                    "sizes": sample["coords"].sharding_shapes, "full": full, "bytes_after": before})
    # bytes and chunk files of one region read, measured alone (parts offsets already cached)
    ds.store.counter.reset()
    ds.store.counter.track_keys = True
    raw = ds.read_region("run_3")
    return {"samples": out, "one_read": ds.bytes_read, "rows": raw["rows"], "keys": list(ds.store.counter.keys)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_union_of_regions_is_the_whole_run(dist, mesh_store, world):
    results = dist.run(world, _mesh_regions, mesh_store)
    root = zarr.open_group(mesh_store, mode="r")
    runs = sorted(root["runs"].group_keys(), key=lambda s: int(s[4:]))
    for k, run in enumerate(runs):
        g = root["runs"][run]["surface"]
        parts = np.asarray(g["parts"][...])
        sizes = rows_per_rank(parts, world)
        for name, stored in (("coords", g["coords"]), ("normals", g["normals"]), ("areas", g["areas"]),
                             ("order", g["order"]), ("Cp", g["fields/Cp"]), ("Cf", g["fields/Cf"])):
            pieces = [r["samples"][k]["local"][name] for r in results]
            assert [len(p) for p in pieces] == list(sizes)
            expect = np.asarray(stored[...])
            got = np.concatenate(pieces)
            np.testing.assert_array_equal(got.reshape(expect.shape), expect)
        for r in results:
            assert r["samples"][k]["run"] == run
            np.testing.assert_array_equal(r["samples"][k]["full"]["Cp"], np.asarray(g["fields/Cp"][...]))
            assert tuple(shape[0] for shape in r["samples"][k]["sizes"][0]) == tuple(sizes)  # no communication


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_reads_only_its_rows_plus_at_most_two_chunks(dist, mesh_store, world):
    """Each rank opens exactly the chunk files that overlap its rows (at most one partial chunk at each
    end), so its bytes are its rows' bytes plus at most two chunks."""
    results = dist.run(world, _mesh_regions, mesh_store)
    g = zarr.open_group(mesh_store, mode="r")["runs/run_3/surface"]
    names = ("coords", "normals", "areas", "order", "fields/Cp", "fields/Cf")
    for rank, r in enumerate(results):
        a, b = r["rows"]
        read = sorted(r["keys"])
        expect = sorted(f"runs/run_3/surface/{n}/c/{k}" + "/0" * (g[n].ndim - 1)
                        for n in names for k in range(a // g[n].chunks[0], (b - 1) // g[n].chunks[0] + 1))
        assert read == expect, (rank, sorted(set(read) ^ set(expect))[:5])
        on_disk = sum(os.path.getsize(f"{mesh_store}/{key}") for key in expect)
        assert r["one_read"] == on_disk
        own = sum((b - a) * g[n].dtype.itemsize * int(np.prod(g[n].shape[1:])) for n in names)
        two_chunks = sum(2 * int(np.prod(g[n].chunks)) * g[n].dtype.itemsize for n in names)
        assert r["one_read"] <= own + two_chunks
        assert all(chunks_touched(a, b, g[n].chunks[0]) <= -(-(b - a) // g[n].chunks[0]) + 1 for n in names)


def test_prefetch_gives_identical_samples(dist, mesh_store):
    off = dist.run(3, _mesh_regions, mesh_store, 0)
    on = dist.run(3, _mesh_regions, mesh_store, 3)
    for a, b in zip(off, on):
        assert [s["run"] for s in a["samples"]] == [s["run"] for s in b["samples"]]
        for sa, sb in zip(a["samples"], b["samples"]):
            for k in sa["local"]:
                np.testing.assert_array_equal(sa["local"][k], sb["local"][k])


def _dp_coverage(path, shuffle, epoch):
    from domainflow.readers import MeshDataset

    mesh = get_mesh((2, 2), ("dp", "domain"))
    ds = MeshDataset(path, mesh, split=None, fields=("Cp",), inputs=("coords",), shuffle=shuffle, seed=5, prefetch=1)
    ds.set_epoch(epoch)
    return [(s["run"], float(s["weight"]), int(s["Cp"].to_local().shape[0]), len(ds)) for s in ds]


@pytest.mark.parametrize("epoch", [0, 1])
def test_dp_coverage_is_exact_on_a_dp_by_domain_mesh(dist, mesh_store, epoch):
    results = dist.run(4, _dp_coverage, mesh_store, True, epoch)
    # ranks 0,1 are dp 0 (domain 0,1); ranks 2,3 are dp 1
    assert [x[:2] for x in results[0]] == [x[:2] for x in results[1]]  # a dp group reads the same samples
    assert [x[:2] for x in results[2]] == [x[:2] for x in results[3]]
    seen = [r for res in (results[0], results[2]) for r, w, _, _ in res if w == 1.0]
    assert sorted(seen) == sorted(f"run_{i}" for i in range(1, 6))  # 5 runs over 2 dp ranks: each once
    assert len(results[0]) == len(results[2]) == 3  # the short rank takes a weight-0 padding step
    assert sum(w == 0.0 for res in (results[0], results[2]) for _, w, _, _ in res) == 1


def _normalized(path):
    from domainflow.readers import MeshDataset

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    ds = MeshDataset(path, mesh, split="train", fields=("Cf",), inputs=("coords",), shuffle=False, prefetch=0)
    s = next(iter(ds))
    a, b = ds.read_region(s["run"])["rows"]
    raw = np.asarray(zarr.open_group(path, mode="r")[f"runs/{s['run']}/surface/fields/Cf"][a:b])
    back = ds.denormalize("Cf", s["Cf"]).to_local().numpy()
    return s["Cf"].to_local().numpy(), raw, back, s["params"].numpy(), ds.param_names, float(s["U_inf"])


def test_normalisation_uses_the_train_stats_and_inverts(dist, mesh_store):
    stats = open_store(mesh_store).stats["surface/Cf"]
    for z, raw, back, params, names, u in dist.run(2, _normalized, mesh_store):
        np.testing.assert_allclose(z, (raw - np.array(stats["mean"])) / np.array(stats["std"]), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(back, raw, rtol=1e-5, atol=1e-7)
        assert len(params) == len(names) > 5 and u == pytest.approx(38.889, rel=1e-6)


def _errors(path, grid_path, parts_store):
    from domainflow.readers import GridDataset, MeshDataset

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    msgs = []
    for make in (lambda: MeshDataset(path, mesh, fields=("Cp", "nope")),
                 lambda: MeshDataset(path, mesh, runs=["run_1", "run_77"]),
                 lambda: MeshDataset(path, mesh, inputs=("coords", "Cp")),
                 lambda: MeshDataset(grid_path, mesh),
                 lambda: GridDataset(path, mesh),
                 lambda: MeshDataset(path, get_mesh((world,), ("points",))),
                 lambda: MeshDataset(path, mesh, location="volume", fields=("Cf",)),
                 lambda: MeshDataset(parts_store, mesh)):
        try:
            make()
            msgs.append(None)
        except (ValueError, KeyError) as exc:
            msgs.append(str(exc))
    return msgs


def test_bad_input_is_refused_on_every_rank(dist, mesh_store, grid_store, tmp_path):
    raw = tmp_path / "raw"
    synth_drivaerml(raw, runs=2, cells=600, seed=0, volume_pieces=1)
    ingest_drivaerml(raw, tmp_path / "p2.zarr", parts=2, progress=False, locations=("surface",))
    results = dist.run(4, _errors, mesh_store, grid_store, str(tmp_path / "p2.zarr"))
    assert all(r == results[0] for r in results)  # the same error on every rank, no rank left waiting
    field, run, inp, kind_m, kind_g, axis, vol, parts = results[0]
    assert "no surface field(s) ['nope']" in field and "'Cf'" in field and "'Cp'" in field
    assert "run_77" in run and "run_1" in run
    assert "Cp" in inp and "geometry arrays" in inp
    assert "'grid' store; use GridDataset" in kind_m and "'mesh' store; use MeshDataset" in kind_g
    assert "without ['domain']" in axis and "points" in axis
    assert "no volume field(s) ['Cf']" in vol and "'U'" in vol
    assert "2 spatial parts" in parts and "--parts 4" in parts


# -- grid hyperslabs --------------------------------------------------------------------------------
def _grid_regions(path, mesh_shape, names, shard_dims, halo, history):
    from domainflow.readers import GridDataset

    mesh = get_mesh(mesh_shape, names)
    ds = GridDataset(path, mesh, split="train", shard_dims=shard_dims, history=history, lead=2, halo=halo,
                     normalize=False, shuffle=False, prefetch=2)
    ds.store.counter.track_keys = True
    out = []
    for s in ds:
        item = {"time": s["time"], "input": s["input"].to_local().numpy(), "target": s["target"].to_local().numpy(),
                "input_full": s["input"].full_tensor().numpy(), "sizes": s["input"].sharding_shapes}
        if halo:
            item["input_halo"] = s["input_halo"].numpy()
            item["halo_widths"] = s["halo_widths"]
        out.append(item)
    slabs = {d: (ds.slabs[d].start, ds.slabs[d].stop) for d in ("lat", "lon")}
    return {"samples": out, "slabs": slabs, "bytes": ds.bytes_read, "keys": sorted(set(ds.store.counter.keys))}


GRID_CASES = [((1,), ("domain",), ("lat",)), ((2,), ("domain",), ("lat",)), ((3,), ("domain",), ("lat",)),
              ((4,), ("domain",), ("lat",)), ((2, 2), ("domain_lat", "domain_lon"), ("lat", "lon")),
              ((1, 3), ("domain_lat", "domain_lon"), ("lat", "lon")),
              ((2, 2), ("dp", "domain"), ("lat",))]


@pytest.mark.parametrize("halo", [0, 2])
@pytest.mark.parametrize("case", GRID_CASES, ids=lambda c: "x".join(map(str, c[0])) + "-" + "+".join(c[2]))
def test_grid_hyperslabs_equal_slices_of_the_full_array(dist, grid_store, case, halo):
    mesh_shape, names, shard_dims = case
    world = int(np.prod(mesh_shape))
    results = dist.run(world, _grid_regions, grid_store, mesh_shape, names, shard_dims, halo, 2)
    data = np.asarray(zarr.open_group(grid_store, mode="r")["data"][...])
    T, C = data.shape[:2]
    train_end = 8  # split 0.5 of 16 steps
    expected_times = list(range(1, train_end - 2))  # history 2, lead 2, inside [0, 8)
    for r in results:
        (la, lb), (oa, ob) = r["slabs"]["lat"], r["slabs"]["lon"]
        if "dp" not in names:
            assert [s["time"] for s in r["samples"]] == expected_times
        for s in r["samples"]:
            t = s["time"]
            window = data[t - 1:t + 1, :, la:lb, oa:ob].reshape(1, 2 * C, lb - la, ob - oa)
            np.testing.assert_array_equal(s["input"], window)
            np.testing.assert_array_equal(s["target"], data[t + 2:t + 3, :, la:lb, oa:ob].reshape(1, C, lb - la, ob - oa))
            np.testing.assert_array_equal(s["input_full"], data[t - 1:t + 1].reshape(1, 2 * C, H, W))
            if halo:
                lat_idx = np.arange(max(0, la - halo), min(H, lb + halo))  # clipped at the poles
                lon_idx = np.arange(oa - halo, ob + halo) % W  # wraps around the globe
                expect = data[t - 1:t + 1][:, :, lat_idx][:, :, :, lon_idx].reshape(1, 2 * C, len(lat_idx), len(lon_idx))
                np.testing.assert_array_equal(s["input_halo"], expect)
                assert s["halo_widths"][2] == (la - lat_idx[0], lat_idx[-1] + 1 - lb)
                assert s["halo_widths"][3] == (halo, halo)
    if halo == 0 and "dp" not in names:  # exactly the tiles overlapping the rank's region, nothing else
        tile = zarr.open_group(grid_store, mode="r")["data"].chunks
        for r in results:
            (la, lb), (oa, ob) = r["slabs"]["lat"], r["slabs"]["lon"]
            steps = sorted({t for s in r["samples"] for t in (s["time"] - 1, s["time"], s["time"] + 2)})
            expect = sorted(f"data/c/{t}/{c}/{i}/{j}" for t in steps for c in range(C)
                            for i in range(la // tile[2], (lb - 1) // tile[2] + 1)
                            for j in range(oa // tile[3], (ob - 1) // tile[3] + 1))
            assert r["keys"] == expect


def _epochs(path, prefetch):
    from domainflow.readers import MeshDataset

    mesh = get_mesh((1,), ("domain",))
    ds = MeshDataset(path, mesh, split=None, fields=("Cp",), inputs=("coords",), seed=9, prefetch=prefetch)
    seen = []
    for _ in range(3):  # each full pass advances the epoch; the next one's reads start early
        seen.append([(s["run"], float(s["Cp"].to_local()[:5].sum())) for s in ds])
    ahead = ds._ahead is not None
    ds.set_epoch(0)  # an explicit epoch wins over the speculative one
    again = [(s["run"], float(s["Cp"].to_local()[:5].sum())) for s in ds]
    return seen, again, ahead, ds.epoch


def test_epochs_advance_and_prefetch_across_epochs_changes_nothing(dist, mesh_store):
    (off, off_again, _, _), = dist.run(1, _epochs, mesh_store, 0)
    (on, on_again, ahead, epoch), = dist.run(1, _epochs, mesh_store, 2)
    assert on == off and on_again == off_again == off[0]
    assert len({tuple(r for r, _ in e) for e in off}) == 3  # three different shuffles
    assert ahead and epoch == 1


def _grid_normalized(path):
    from domainflow.readers import GridDataset

    mesh = get_mesh((2,), ("domain",))
    ds = GridDataset(path, mesh, split="val", shuffle=False, prefetch=1)
    s = next(iter(ds))
    return s["time"], s["target"].full_tensor().numpy(), ds.denormalize(s["target"]).full_tensor().numpy()


def test_grid_normalisation_per_variable(dist, grid_store):
    t, z, back = dist.run(2, _grid_normalized, grid_store)[0]
    root = zarr.open_group(grid_store, mode="r")
    stats = root.attrs["stats"]
    names = root.attrs["grid"]["variables"]
    raw = np.asarray(root["data"][t + 1])
    mean = np.array([stats[f"grid/{v}"]["mean"][0] for v in names]).reshape(-1, 1, 1)
    std = np.array([stats[f"grid/{v}"]["std"][0] for v in names]).reshape(-1, 1, 1)
    np.testing.assert_allclose(z[0], (raw - mean) / std, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(back[0], raw, rtol=1e-5, atol=1e-3)


def _boxes_and_knn(path):
    import torch

    import domainflow as df
    from domainflow.readers import MeshDataset

    rank, world = rank_and_world()
    mesh = get_mesh((world,), ("domain",))
    ds = MeshDataset(path, mesh, split="train", fields=("Cp",), inputs=("coords",), shuffle=False, prefetch=0)
    s = next(iter(ds))
    pts = s["coords"].to_local()
    lo, hi = s["boxes"][rank]
    inside = bool(((pts >= lo - 1e-5) & (pts <= hi + 1e-5)).all())
    with_boxes, _ = df.knn(s["coords"], 6, exclude_self=True, boxes=s["boxes"])
    without, _ = df.knn(s["coords"], 6, exclude_self=True)
    plain, _ = df.knn(s["coords"].full_tensor(), 6, exclude_self=True)
    same = torch.equal(with_boxes.full_tensor(), plain) and torch.equal(without.full_tensor(), plain)
    return inside, same, tuple(s["boxes"].shape), df.ops.neighbours.last_fetch()


def test_samples_carry_rank_boxes_for_neighbour_search(dist, mesh_store):
    """Each sample's per-rank boxes (from the store's part boxes, z-scored like the coords) contain the
    rank's points, and a kNN search using them equals one in a single process."""
    for inside, same, shape, fetch in dist.run(3, _boxes_and_knn, mesh_store):
        assert inside and same and shape == (3, 2, 3)
        assert fetch["points"] < 3000 // 2


# -- a points budget per step (data.sample_points) ---------------------------------------------------
def _drawn(path, k, location, epochs, balanced=False):
    from domainflow.readers import MeshDataset

    rank, world = rank_and_world()
    ds = MeshDataset(path, get_mesh((world,), ("domain",)), split=None, location=location, fields=("Cp",) if
                     location == "surface" else (), inputs=("coords", "order"), normalize=False, shuffle=False,
                     prefetch=0, sample_points=k, balanced_draw=balanced)
    ds._open_run("run_2")  # the part offsets: metadata, read once per run
    out = []
    for epoch in epochs:
        ds.store.counter.reset()
        ds.store.counter.track_keys = True
        raw = ds.read_region("run_2", epoch=epoch)
        keys, nbytes = list(ds.store.counter.keys), ds.bytes_read
        sample = ds.wrap(raw)
        out.append({"ids": raw["row_ids"], "rows": raw["rows"], "coords": sample["coords"].to_local().numpy(),
                    "full": sample["coords"].full_tensor().numpy(), "sizes": sample["coords"].sharding_shapes,
                    "order": sample["order"].to_local().numpy(), "keys": keys, "bytes": nbytes,
                    "boxes": sample["boxes"].numpy()})
    return out


@pytest.mark.parametrize("location", ["surface", "volume"])
def test_sample_points_read_the_same_rows_on_every_domain_size_and_only_their_chunks(dist, mesh_store, location):
    """The rows drawn of a run are one draw over the run whatever the domain size (the union over ranks, in
    rank order, is the one-rank draw), each rank holds the drawn rows of its own region with the stored
    values, every rank knows every rank's count, another epoch draws other rows, and a rank reads exactly
    the chunk files that hold its drawn rows."""
    g = zarr.open_group(mesh_store, mode="r")[f"runs/run_2/{location}"]
    n, k = g["coords"].shape[0], 7 if location == "surface" else 2
    one = dist.run(1, _drawn, mesh_store, k, location, [0, 1])[0]
    ids0 = one[0]["ids"]
    assert len(ids0) == k and np.all(np.diff(ids0) > 0) and ids0[-1] < n
    assert not np.array_equal(ids0, one[1]["ids"])  # a new epoch, a new draw
    np.testing.assert_array_equal(one[0]["coords"], g["coords"][:][ids0])
    for world in (2, 3):
        results = dist.run(world, _drawn, mesh_store, k, location, [0])
        np.testing.assert_array_equal(np.concatenate([r[0]["ids"] for r in results]), ids0)
        sizes = [len(r[0]["ids"]) for r in results]
        for rank, r in enumerate(results):
            r = r[0]
            a, b = r["rows"]
            assert np.all((r["ids"] >= a) & (r["ids"] < b))
            assert [int(s[0]) for s in r["sizes"][0]] == sizes
            np.testing.assert_array_equal(r["coords"], g["coords"][:][r["ids"]])
            np.testing.assert_array_equal(r["order"], g["order"][:][r["ids"]])
            np.testing.assert_array_equal(r["full"], one[0]["coords"])
            arrays = ("coords", "order", "fields/Cp") if location == "surface" else ("coords", "order")
            expect = sorted(f"runs/run_2/{location}/{name}/c/{c}" + "/0" * (g[name].ndim - 1) for name in arrays
                            for c in sorted({int(i) // g[name].chunks[0] for i in r["ids"]}))
            assert sorted(r["keys"]) == expect, rank
            assert r["bytes"] == sum(os.path.getsize(f"{mesh_store}/{key}") for key in expect)
    chunks = -(-n // g["coords"].chunks[0])
    assert len({int(i) // g["coords"].chunks[0] for i in ids0}) < chunks  # a small draw skips chunks


def test_a_balanced_draw_is_the_same_sample_split_evenly_over_the_ranks(dist, mesh_store):
    """``balanced_draw`` (what train.compile reads): the same drawn rows in the same order as the one-rank draw,
    split evenly over the ranks (fixed sizes, whatever each region holds), each rank's rows with their stored
    values and inside its box, every rank knowing every rank's count."""
    g = zarr.open_group(mesh_store, mode="r")["runs/run_2/surface"]
    k = 11
    ids0 = dist.run(1, _drawn, mesh_store, k, "surface", [0])[0][0]["ids"]
    for world in (2, 3):
        results = [r[0] for r in dist.run(world, _drawn, mesh_store, k, "surface", [0], True)]
        sizes = [k // world + (r < k % world) for r in range(world)]
        assert [len(r["ids"]) for r in results] == sizes
        np.testing.assert_array_equal(np.concatenate([r["ids"] for r in results]), ids0)
        regular = [len(r[0]["ids"]) for r in dist.run(world, _drawn, mesh_store, k, "surface", [0])]
        for rank, r in enumerate(results):
            assert [int(s[0]) for s in r["sizes"][0]] == sizes
            np.testing.assert_array_equal(r["coords"], g["coords"][:][r["ids"]])
            np.testing.assert_array_equal(r["full"], g["coords"][:][ids0])
            lo, hi = r["boxes"][rank]
            assert np.all((r["coords"] >= lo - 1e-6) & (r["coords"] <= hi + 1e-6)), rank
        if world == 3:
            assert regular != sizes  # the regions alone would not give even sizes here
    # a run of exactly k points: all its rows, split evenly too (as a region read it would have other sizes)
    n = g["coords"].shape[0]
    results = [r[0] for r in dist.run(2, _drawn, mesh_store, n, "surface", [0], True)]
    assert [len(r["ids"]) for r in results] == [n - n // 2, n // 2]
    np.testing.assert_array_equal(np.concatenate([r["ids"] for r in results]), np.arange(n))


def test_a_point_draw_is_a_simple_random_sample_whatever_the_blocks():
    """PointDraw against a one-device draw (numpy's choice without replacement): every row is drawn with
    probability k/n and every pair of rows together with k(k-1)/(n(n-1)), within a block and across blocks
    alike (a draw with fixed per-block counts would fail the across-block pairs), and any split of the rows
    into ranges gives back the same draw."""
    from domainflow.readers.sampling import PointDraw

    n, k, block, trials = 30, 6, 8, 20000
    hits, pairs = np.zeros(n), np.zeros((n, n))
    for t in range(trials):
        draw = PointDraw(n, k, (5, t, 11), block=block)
        ids = draw.rows(0, n)
        assert len(ids) == k and len(set(ids.tolist())) == k
        if t < 50:
            cuts = sorted({0, n, *np.random.default_rng(t).integers(0, n, 3).tolist()})
            np.testing.assert_array_equal(np.concatenate([draw.rows(a, b) for a, b in zip(cuts, cuts[1:])]), ids)
            assert [draw.count(a, b) for a, b in zip(cuts, cuts[1:])] == [len(draw.rows(a, b))
                                                                           for a, b in zip(cuts, cuts[1:])]
            at = sorted({0, k, *np.random.default_rng(t).integers(0, k, 2).tolist()})  # positions of the draw
            np.testing.assert_array_equal(np.concatenate([draw.rows_at(a, b) for a, b in zip(at, at[1:])]), ids)
        hits[ids] += 1
        pairs[np.ix_(ids, ids)] += 1
    p1, p2 = k / n, k * (k - 1) / (n * (n - 1))
    # each count is binomial(trials, p): 5 standard deviations
    assert np.all(np.abs(hits - trials * p1) < 5 * np.sqrt(trials * p1 * (1 - p1)))
    off = ~np.eye(n, dtype=bool)
    assert np.all(np.abs(pairs[off] - trials * p2) < 5 * np.sqrt(trials * p2 * (1 - p2)))
    same = np.equal.outer(np.arange(n) // block, np.arange(n) // block) & off
    assert abs(pairs[same].mean() - pairs[off & ~same].mean()) < 0.05 * trials * p2
    assert PointDraw(n, n + 5, (1,)).rows(0, n).tolist() == list(range(n))
