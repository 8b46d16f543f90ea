"""``MeshDataset``: samples of a mesh store, each rank reading only its own spatial region of a run.

Rank r of a W-rank domain reads rows ``[parts[r*P//W], parts[(r+1)*P//W])`` of every array of a run: one
contiguous, spatially compact range (the store's rows are sorted by part). All ranks know every rank's
row count from the run's ``parts`` offsets, so the ShardTensors are built without communication.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

from domainflow.layout.shapes import balanced_sizes, rows_per_rank
from domainflow.store.format import EDGE_PARTS, EDGES

from .axes import resolve_axes
from .normalize import Normalizer
from .prefetch import EpochStream
from .regions import mesh_rows
from .sampling import PointDraw, dp_share, epoch_order
from .store import Store, StoreError, open_store

GEOMETRY = ("coords", "normals", "areas", "order")


class MeshDataset(torch.utils.data.IterableDataset, EpochStream):
    """Iterates this dp rank's samples of ``split``; each is a dict with

    - one ShardTensor per name in ``inputs`` (geometry: coords, normals, areas, order) and ``fields`` (stored
      fields such as Cp, Cf), shape (N, C), sharded on dim 0 over the domain axis, z-scored with the store's
      train statistics when ``normalize`` (``order`` never is);
    - replicated per-run values as plain tensors: ``U_inf``, ``params`` (design parameters in
      ``param_names`` order), ``forces`` and ``forces_constref`` (dicts), ``run`` (its id) and ``weight``
      (1, or 0 for a padding step that evens out the dp ranks; multiply the loss by it).

    ``stats``: {store key: {"mean", "std"}} to z-score with instead of the store's train statistics for the keys
    it holds (a trained model's own, from its checkpoint, so a prediction never depends on the store it reads).

    ``prefetch`` samples are read ahead on a background thread (0: read inline); the order depends only on
    ``seed`` and the epoch (``set_epoch``), so prefetch never changes what is read.

    ``sample_points = K`` (> 0) reads K points of each sample instead of all: a uniform draw over the whole
    run keyed by (seed, epoch, run) (``sampling.PointDraw``), of which each rank reads the drawn rows it
    holds, in store order. Every domain size reads the same rows, so the union over ranks is the one-device
    draw; a rank's count follows its share of rows (hypergeometric, not fixed), and only the chunks that hold
    drawn rows are read. ``balanced_draw``: the drawn rows split evenly over the domain ranks instead (the same
    rows in the same order, so the same global sample; a rank's rows may lie in its neighbours' regions, and its
    box covers the parts they lie in): fixed per-rank sizes, which a compiled model needs to compile once.

    ``edges``: each sample also holds ``"edges"``, the run's directed edges ``(sender, receiver)`` whose receiver
    is one of this rank's rows, (E_r, 2) int64 sharded on dim 0 (every rank's count from the store's
    ``edge_parts``, so no communication), in the run's global row numbers: senders may be other ranks' rows, which
    the row exchange (``x[senders]``) fetches. A store ingested without ``--edges`` is refused, and so is
    ``sample_points`` (a drawn subset of the points has no graph).
    """

    def __init__(self, store, mesh, split: str | None = "train", location: str = "surface",
                 fields=("Cp", "Cf"), inputs=("coords", "normals"), normalize: bool = True, shuffle: bool = True,
                 seed: int = 0, prefetch: int = 2, domain_axis: str = "domain", dp_axis: str = "dp",
                 dtype: torch.dtype = torch.float32, runs=None, sample_points: int = 0, stats=None,
                 edges: bool = False, balanced_draw: bool = False):
        torch.utils.data.IterableDataset.__init__(self)
        EpochStream.__init__(self)
        self.store = store if isinstance(store, Store) else open_store(store)
        self.store.require_kind("mesh")
        self.axes = resolve_axes(mesh, (domain_axis,), dp_axis)
        self.location, self.fields, self.inputs = location, tuple(fields), tuple(inputs)
        self.normalize, self.shuffle, self.seed, self.prefetch, self.dtype = normalize, shuffle, seed, prefetch, dtype
        if sample_points < 0:
            raise ValueError(f"sample_points must be >= 0 (0: every point), got {sample_points}")
        self.sample_points = int(sample_points)
        self.balanced_draw = bool(balanced_draw)
        self.edges = bool(edges)
        self.runs = list(runs) if runs is not None else self.store.runs(split)
        self._check()
        self.stats = {**self.store.stats, **(stats or {})}
        self.normalizer = Normalizer(self.stats)
        from domainflow.comm import mesh_device

        self.device = mesh_device(self.axes.domain)
        self.param_names = sorted(self.store.run(self.runs[0]).attrs.get("geometry", {})) if self.runs else []
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._moments = {}
        if normalize:
            for name in self.inputs + self.fields:
                s = self.stats.get(f"{location}/{name}") if name != "order" else None
                if s is not None:
                    std = np.asarray(s["std"], np.float64)
                    self._moments[name] = (np.asarray(s["mean"], self._np_dtype),
                                           (1.0 / np.where(std > 0, std, 1.0)).astype(self._np_dtype))
        self._runs_open = {}  # run id -> (offsets, arrays, attrs, boxes, edges): metadata read once per run

    # -- checks (metadata only: every rank raises the same error, before any collective) -------------------
    def _check(self):
        check_request(self.store, self.location, self.fields, self.inputs, self.runs, self.axes.sizes[0],
                      edges=self.edges, sample_points=self.sample_points)

    # -- iteration ---------------------------------------------------------------------------------------
    def steps(self, epoch: int | None = None) -> list[tuple[str, float]]:
        """(run id, weight) of each step this dp rank takes in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        order = epoch_order(len(self.runs), self.seed, epoch, self.shuffle)
        return [(self.runs[i], w) for i, w in dp_share(order, self.axes.dp_rank, self.axes.dp_size)]

    def __len__(self) -> int:
        return -(-len(self.runs) // self.axes.dp_size)

    def __iter__(self):
        def loads(epoch):
            return [functools.partial(self.read_region, run, weight, epoch=epoch) for run, weight in self.steps(epoch)]
        return self._iterate(loads, self.wrap, self.prefetch)

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    # -- reading and wrapping --------------------------------------------------------------------------
    def _open_run(self, run_id: str):
        """A run's part offsets, array handles and attrs, read once (later samples read only chunk data)."""
        hit = self._runs_open.get(run_id)
        if hit is None:
            group = self.store.run(run_id)
            names = {n: f"{self.location}/{n}" for n in self.inputs + ("parts", "part_boxes")}
            names.update({n: f"{self.location}/fields/{n}" for n in self.fields})
            try:
                arrays = {n: group[key] for n, key in names.items()}
            except KeyError as exc:
                raise StoreError(f"{self.store.path} is damaged: run {run_id} has no array {exc}; re-ingest it "
                                 f"(`domainflow ingest ... --overwrite`)") from None
            offsets = tuple(int(x) for x in self.store.read(arrays.pop("parts")))
            boxes = self.store.read(arrays.pop("part_boxes")).astype(np.float64)
            graph = self._open_edges(run_id, group) if self.edges else None
            hit = self._runs_open[run_id] = (offsets, arrays, dict(group.attrs), boxes, graph)
        return hit

    def _open_edges(self, run_id: str, group):
        """(edge offsets per part, the edges array) of a run, or a StoreError naming the run and the fix."""
        loc = group[self.location]
        if EDGES not in loc or EDGE_PARTS not in loc:
            raise StoreError(no_edges(self.store, self.location, run_id))
        return tuple(int(x) for x in self.store.read(loc[EDGE_PARTS])), loc[EDGES]

    def read_region(self, run_id: str, weight: float = 1.0, rank: int | None = None, epoch: int | None = None) -> dict:
        """Rows of one run for this rank (or domain coordinate ``rank``) as numpy arrays, already cast and
        z-scored, plus the run's replicated values: all its rows, or with ``sample_points`` the drawn ones of
        ``epoch`` (default: the current one; ``row_ids`` says which). No torch and no communication: it runs on
        the prefetch thread, so the training loop only wraps the arrays."""
        self.store.check_unchanged()
        offsets, arrays, attrs, part_boxes, graph = self._open_run(run_id)
        rank = self.axes.coords[0] if rank is None else rank
        world = self.axes.sizes[0]
        a, b = mesh_rows(offsets, rank, world)
        sizes, selection, row_ids = rows_per_rank(offsets, world), slice(a, b), None
        draw = self.point_draw(run_id, offsets[-1], self.epoch if epoch is None else epoch)
        boxes = self._rank_boxes(part_boxes)
        if draw is not None and self.balanced_draw:
            sizes = list(balanced_sizes(draw.k, world))
            first = sum(sizes[:rank])
            row_ids = draw.rows_at(first, first + sizes[rank])
            # each rank's first and last drawn row (only the blocks they lie in are drawn) bound its box
            ends = [(draw.rows_at(lo, lo + 1), draw.rows_at(lo + n - 1, lo + n)) if n else ()
                    for lo, n in zip(np.cumsum([0, *sizes[:-1]]), sizes)]
            boxes = self._rank_boxes(part_boxes, [np.concatenate(e) if e else np.zeros(0, np.int64) for e in ends],
                                     offsets)
            a, b = (int(row_ids[0]), int(row_ids[-1]) + 1) if len(row_ids) else (0, 0)
            selection = row_ids
        elif draw is not None:
            row_ids = draw.rows(a, b)
            sizes = [draw.count(*mesh_rows(offsets, r, world)) for r in range(world)]
            selection = row_ids
        out = {}
        for name, arr in arrays.items():
            if row_ids is None:
                values = self.store.read(arr, selection)
            elif len(row_ids):
                values = self.store.read(arr, (row_ids,), orthogonal=True)
            else:
                values = np.zeros((0,) + tuple(arr.shape[1:]), dtype=arr.dtype)
            if name != "order":
                values = values.astype(self._np_dtype, copy=False)
                if values.ndim == 1:
                    values = values[:, None]
                if name in self._moments:  # in place, in the target dtype: no float64 temporaries
                    mean, inv_std = self._moments[name]
                    values = np.array(values, copy=True) if not values.flags.writeable else values
                    values -= mean
                    values *= inv_std
            out[name] = values
        edges = self._read_edges(graph, rank, world) if graph is not None else None
        self.store.check_unchanged()  # a store replaced mid-read would mix two stores in one sample
        return {"run": run_id, "weight": weight, "arrays": out, "rows": (a, b), "row_ids": row_ids,
                "sizes": sizes, "attrs": attrs, "boxes": boxes, "edges": edges}

    def _read_edges(self, graph, rank: int, world: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """This rank's edges (those whose receiver is one of its rows: the same part range as its rows) and
        every rank's edge count, from the run's edge offsets per part."""
        edge_offsets, arr = graph
        a, b = mesh_rows(edge_offsets, rank, world)
        return self.store.read(arr, slice(a, b)).astype(np.int64, copy=False), rows_per_rank(edge_offsets, world)

    def point_draw(self, run_id: str, n_rows: int, epoch: int) -> PointDraw | None:
        """The rows ``sample_points`` draws of ``run_id`` in ``epoch`` (None: every row is read)."""
        if not self.sample_points or (self.sample_points >= n_rows and not self.balanced_draw):
            return None  # (balanced: a run of exactly K rows is split evenly too, like every K-point draw)
        return PointDraw(n_rows, self.sample_points, (self.seed, epoch, zlib.crc32(str(run_id).encode())))

    def _rank_boxes(self, part_boxes: np.ndarray, rank_rows=None, offsets=None) -> np.ndarray:
        """(domain ranks, 2, 3) box of every rank's cells, from the store's part boxes, in the same units
        as the ``coords`` input (z-scored when it is): what ``domainflow.knn(..., boxes=)`` takes. ``rank_rows``:
        each rank's first and last row id (a balanced draw), boxed by the parts (``offsets``) between them."""
        world, parts = self.axes.sizes[0], len(part_boxes)
        out = np.empty((world, 2, part_boxes.shape[-1]), dtype=np.float64)
        for r in range(world):
            a, b = r * parts // world, (r + 1) * parts // world
            if rank_rows is not None:
                rows = rank_rows[r]
                if not len(rows):  # no points: an empty box (min > max), which no query overlaps
                    out[r, 0], out[r, 1] = np.inf, -np.inf
                    continue
                a = int(np.searchsorted(offsets, rows[0], side="right")) - 1
                b = int(np.searchsorted(offsets, rows[-1], side="right"))
            out[r, 0], out[r, 1] = part_boxes[a:b, 0].min(0), part_boxes[a:b, 1].max(0)
        if "coords" in self._moments:
            mean, inv_std = (np.asarray(v, dtype=np.float64).reshape(-1) for v in self._moments["coords"])
            out = (out - mean) * inv_std
        return out.astype(self._np_dtype)

    def wrap(self, raw: dict) -> dict:
        """ShardTensors from a region read (no communication: every rank's size comes from ``parts``)."""
        from domainflow import Shard, ShardTensor

        out = {"run": raw["run"], "weight": torch.tensor(raw["weight"], dtype=self.dtype, device=self.device)}
        sizes = {self.axes.names[0]: list(raw["sizes"])}
        for name, values in raw["arrays"].items():
            t = torch.from_numpy(values).to(self.device)
            out[name] = ShardTensor.from_local(t, self.axes.domain, [Shard(0)], sharding_shapes=sizes)
        if raw.get("edges") is not None:
            edges, counts = raw["edges"]
            out["edges"] = ShardTensor.from_local(torch.from_numpy(edges).to(self.device), self.axes.domain,
                                                  [Shard(0)], sharding_shapes={self.axes.names[0]: list(counts)})
        attrs = raw["attrs"]
        as_t = lambda v: torch.tensor(v, dtype=self.dtype, device=self.device)  # noqa: E731
        out["boxes"] = torch.from_numpy(raw["boxes"]).to(self.device)
        out["U_inf"] = as_t(attrs.get("U_inf", float("nan")))
        geometry = attrs.get("geometry", {})
        out["params"] = as_t([geometry.get(k, float("nan")) for k in self.param_names])
        out["forces"] = {k: as_t(v) for k, v in attrs.get("forces", {}).items()}
        out["forces_constref"] = {k: as_t(v) for k, v in attrs.get("forces_constref", {}).items()}
        return out

    def denormalize(self, name: str, x):
        """Undo the z-score of field or input ``name`` (e.g. a model's Cp prediction)."""
        return self.normalizer.denormalize(f"{self.location}/{name}", x)


def smallest_run(store: Store, location: str, runs) -> tuple[str, int]:
    """(run id, points) of the run of ``runs`` with the fewest points at ``location`` (array shapes only; the runs'
    metadata read by 8 threads, since a remote store answers each read with a round trip)."""
    from concurrent.futures import ThreadPoolExecutor

    def points(run):
        loc = store.run(run)[location]
        return run, next(int(loc[g].shape[0]) for g in GEOMETRY if g in loc)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return min(pool.map(points, runs), key=lambda rn: rn[1])


def check_request(store: Store, location: str, fields, inputs, runs, world: int, edges: bool = False,
                  sample_points: int = 0) -> None:
    """What a MeshDataset checks before reading: the store serves ``world`` domain ranks and holds the runs,
    location, fields and inputs asked for (and, with ``edges``, the runs' edges, read whole: no
    ``sample_points``). Metadata only and needs no process group, so a launcher runs it before it starts any
    rank."""
    loc = location
    if edges and sample_points:
        raise ValueError(f"sample_points={sample_points} draws a subset of the points, which has no graph; a sample "
                         f"read with edges is read whole (sample_points=0)")
    if world > store.parts:
        raise StoreError(f"{store.path} has {store.parts} spatial parts per run, so it serves domains of up to "
                         f"{store.parts} ranks, not {world}; re-ingest with --parts {_pow2_at_least(world)} "
                         f"or more")
    known = set(store.runs())
    unknown = [r for r in runs if r not in known]
    if unknown:
        raise StoreError(f"{store.path} has no run(s) {unknown[:10]}; it has {sorted(known)[:20]}")
    if not runs:
        raise StoreError(f"{store.path}: no runs to read (the split is empty)")
    first = store.run(runs[0])
    if loc not in first:
        locs = [k for k in ("surface", "volume") if k in first]
        raise StoreError(f"{store.path} has no {loc!r} data; its runs hold {locs}")
    available = store.field_names(loc)
    bad = [f for f in fields if f not in available]
    if bad:
        raise StoreError(f"{store.path}: no {loc} field(s) {bad}; the {loc} fields are {available}")
    geometry = [g for g in GEOMETRY if g in first[loc]]
    bad = [g for g in inputs if g not in geometry]
    if bad:
        raise StoreError(f"{store.path}: no {loc} input(s) {bad}; inputs are the geometry arrays {geometry} "
                         f"(fields go in fields=)")
    if edges and not has_edges(store, loc, runs[0]):
        raise StoreError(no_edges(store, loc, runs[0]))


def has_edges(store: Store, location: str, run: str) -> bool:
    """Whether ``run``'s ``location`` holds the cells' edges (a store ingested with ``--edges``)."""
    group = store.run(run)[location]
    return EDGES in group and EDGE_PARTS in group


def no_edges(store: Store, location: str, run: str) -> str:
    """The message for a run without edges: what is missing and how to get it."""
    return (f"{store.path}: run {run} has no {location} edges (the cells' adjacency a graph model reads); the store "
            f"was ingested without them: re-ingest it with edges (`domainflow ingest cfd ... --edges --overwrite`)")


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
