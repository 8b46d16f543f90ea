"""``GridDataset``: (input window, target) pairs of a grid store, each rank reading only its hyperslab.

The store holds ``data (T, C, H, W)`` in per-time-step spatial tiles. Rank (i, j) of a domain sharded over
lat (and lon) reads ``data[t0:t1, :, lat slab, lon slab]`` only. A ``halo`` of k reads k extra rows on each
side from disk (wrapping around in longitude on a global grid, clipped at the poles), so a first
convolution needs no exchange; the widened block is returned next to the ShardTensor.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .axes import resolve_axes
from .normalize import Normalizer
from .prefetch import EpochStream
from .regions import grid_slab
from .sampling import dp_share, epoch_order
from .store import Store, StoreError, open_store

DIMS = {"lat": 2, "lon": 3}  # tensor dims of (1, C, lat, lon) samples


class GridDataset(torch.utils.data.IterableDataset, EpochStream):
    """Iterates this dp rank's samples; each is a dict with

    - ``input``: ShardTensor (1, history * C + S, H, W), the steps ``t - history + 1 .. t`` stacked on
      channels (oldest first), then the store's S static fields (land-sea mask, orography; ``static=False``
      leaves them out), and ``target``: ShardTensor (1, C, H, W) at ``t + lead``; sharded over lat (tensor
      dim 2) and, on a 2-D domain, lon (dim 3); z-scored per variable when ``normalize``;
    - ``input_halo`` (only when ``halo > 0``): this rank's input block widened by up to ``halo`` rows per
      side as a plain tensor, with ``halo_widths`` {dim: (before, after)} saying how many were added;
    - ``time`` (index of t), ``weight`` (0 for a padding step that evens out dp ranks).

    ``shard_dims``: ("lat",) or ("lat", "lon"), matched in order with ``domain_axes`` (mesh dim names).
    A sample's window and target lie inside one range of the split. ``stats``: {store key: {"mean", "std"}} to
    z-score with instead of the store's train statistics for the keys it holds (a trained model's own).
    """

    def __init__(self, store, mesh, split: str = "train", shard_dims=("lat",), lead: int = 1, history: int = 1,
                 halo: int = 0, variables=None, normalize: bool = True, shuffle: bool = True, seed: int = 0,
                 prefetch: int = 2, domain_axes=None, dp_axis: str = "dp", dtype: torch.dtype = torch.float32,
                 static: bool = True, stats=None):
        torch.utils.data.IterableDataset.__init__(self)
        EpochStream.__init__(self)
        self.store = store if isinstance(store, Store) else open_store(store)
        self.store.require_kind("grid")
        self.shard_dims = (shard_dims,) if isinstance(shard_dims, str) else tuple(shard_dims)
        bad = [d for d in self.shard_dims if d not in DIMS] or len(set(self.shard_dims)) != len(self.shard_dims)
        if bad or not self.shard_dims:
            raise ValueError(f"shard_dims must be ('lat',) or ('lat', 'lon'), got {shard_dims!r}")
        if domain_axes is None:
            domain_axes = ("domain",) if len(self.shard_dims) == 1 else tuple(f"domain_{d}" for d in self.shard_dims)
        domain_axes = (domain_axes,) if isinstance(domain_axes, str) else tuple(domain_axes)
        if len(domain_axes) != len(self.shard_dims):
            raise ValueError(f"shard_dims {self.shard_dims} need as many domain axes, got {domain_axes}")
        self.axes = resolve_axes(mesh, domain_axes, dp_axis)
        if lead < 1 or history < 1 or halo < 0:
            raise ValueError(f"need lead >= 1, history >= 1 and halo >= 0, got {lead}, {history}, {halo}")
        self.lead, self.history, self.halo = lead, history, halo
        self.normalize, self.shuffle, self.seed, self.prefetch, self.dtype = normalize, shuffle, seed, prefetch, dtype
        self.data = self.store.group["data"]
        T, C, H, W = self.data.shape
        grid = self.store.attrs.get("grid", {})
        all_vars = list(grid.get("variables", []))
        self.variables = list(variables) if variables is not None else all_vars
        unknown = [v for v in self.variables if v not in all_vars]
        if unknown:
            raise StoreError(f"{self.store.path}: no variable(s) {unknown}; it has {all_vars}")
        self.channels = [all_vars.index(v) for v in self.variables]
        self.statics = list(grid.get("static", [])) if static else []
        self._static_blocks: dict = {}
        self.periodic = bool(grid.get("periodic_lon", False))
        if split not in self.store.splits:
            raise StoreError(f"{self.store.path} has no split {split!r}; its splits are {sorted(self.store.splits)}")
        self.times = [t for a, b in self.store.splits[split] for t in range(a + history - 1, b - lead)]
        extent = {"lat": H, "lon": W}
        self.slabs = {}
        for d, coord, size in zip(self.shard_dims, self.axes.coords, self.axes.sizes):
            self.slabs[d] = grid_slab(extent[d], size, coord, halo, periodic=(d == "lon" and self.periodic))
        for d in DIMS:
            if d not in self.slabs:
                self.slabs[d] = grid_slab(extent[d], 1, 0, halo, periodic=(d == "lon" and self.periodic))
        self.sizes = {axis: [grid_slab(extent[d], size, k).size for k in range(size)]
                      for d, axis, size in zip(self.shard_dims, self.axes.names, self.axes.sizes)}
        from domainflow.comm import mesh_device

        self.device = mesh_device(self.axes.domain)
        self.stats = {**self.store.stats, **(stats or {})}
        self.normalizer = Normalizer(self.stats)
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._day = self._slot = None  # the climatology's (day of year, hour) index of each step, when needed
        stats = [self.stats[f"grid/{v}"] for v in self.variables]
        self._mean = np.array([s["mean"][0] for s in stats], self._np_dtype).reshape(1, -1, 1, 1)
        self._inv_std = np.array([1.0 / (s["std"][0] if s["std"][0] > 0 else 1.0) for s in stats],
                                 self._np_dtype).reshape(1, -1, 1, 1)

    @property
    def in_channels(self) -> int:
        """Channels of an input: history * C dynamic ones, then the static fields."""
        return self.history * len(self.variables) + len(self.statics)

    def steps(self, epoch: int | None = None) -> list[tuple[int, float]]:
        """(time index, weight) of each step this dp rank takes in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        order = epoch_order(len(self.times), self.seed, epoch, self.shuffle)
        return [(self.times[i], w) for i, w in dp_share(order, self.axes.dp_rank, self.axes.dp_size)]

    def __len__(self) -> int:
        return -(-len(self.times) // self.axes.dp_size)

    def __iter__(self):
        def loads(epoch):
            return [functools.partial(self.read_region, t, w) for t, w in self.steps(epoch)]
        return self._iterate(loads, self.wrap, self.prefetch)

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    # -- reading ---------------------------------------------------------------------------------------
    def _read(self, t0: int, t1: int, halo: bool) -> np.ndarray:
        """data[t0:t1, channels, lat slab, lon slab] (with halo rows when ``halo``), one read per range."""
        lat, lon = self.slabs["lat"], self.slabs["lon"]
        lat_reads = lat.reads if halo else ((lat.start, lat.stop),)
        lon_reads = lon.reads if halo else ((lon.start, lon.stop),)
        ch = self.channels
        csel = slice(ch[0], ch[-1] + 1) if ch == list(range(ch[0], ch[-1] + 1)) else None
        rows = []
        for a, b in lat_reads:
            cols = []
            for c, d in lon_reads:
                if csel is not None:
                    block = self.store.read(self.data, (slice(t0, t1), csel, slice(a, b), slice(c, d)))
                else:
                    block = self.store.read(self.data, (slice(t0, t1), ch, slice(a, b), slice(c, d)),
                                            orthogonal=True)
                cols.append(block)
            rows.append(np.concatenate(cols, axis=3) if len(cols) > 1 else cols[0])
        return np.concatenate(rows, axis=2) if len(rows) > 1 else rows[0]

    def read_region(self, t: int, weight: float = 1.0, epoch: int | None = None) -> dict:
        """This rank's input window and target at time ``t`` as numpy arrays, cast and z-scored (on the
        prefetch thread, so the training loop only wraps them). ``epoch`` is accepted like
        ``MeshDataset.read_region``'s and unused: a grid sample is always read whole."""
        self.store.check_unchanged()
        window = self._with_static(self._prepare(self._read(t - self.history + 1, t + 1, halo=self.halo > 0)),
                                   halo=self.halo > 0)
        target = self._prepare(self._read(t + self.lead, t + self.lead + 1, halo=False))
        self.store.check_unchanged()  # a store replaced mid-read would mix two stores in one sample
        return {"time": t, "weight": weight, "window": window, "target": target}

    def read_window(self, t: int) -> np.ndarray:
        """This rank's input window ending at step ``t`` (steps ``t - history + 1 .. t``), z-scored, without
        reading a target (a forecast may start at the store's last step)."""
        if t - self.history + 1 < 0 or t >= self.data.shape[0]:
            raise StoreError(f"{self.store.path}: an input window of {self.history} step(s) ending at step {t} is "
                             f"outside its {self.data.shape[0]} steps")
        return self._with_static(self._prepare(self._read(t - self.history + 1, t + 1, halo=False)), halo=False)

    def _with_static(self, window: np.ndarray, halo: bool) -> np.ndarray:
        """A (steps, C, h, w) window as (1, steps * C + S, h, w) with this rank's block of the static fields."""
        window = window.reshape(1, -1, window.shape[2], window.shape[3])
        if not self.statics:
            return window
        if halo not in self._static_blocks:  # read once: the fields do not change
            arr = self.store.group["static"]
            names = list(self.store.attrs.get("grid", {}).get("static", []))
            idx = [names.index(n) for n in self.statics]
            lat, lon = self.slabs["lat"], self.slabs["lon"]
            rows = []
            for a, b in (lat.reads if halo else ((lat.start, lat.stop),)):
                cols = [self.store.read(arr, (idx, slice(a, b), slice(c, d)), orthogonal=True)
                        for c, d in (lon.reads if halo else ((lon.start, lon.stop),))]
                rows.append(np.concatenate(cols, axis=2))
            block = np.concatenate(rows, axis=1).astype(np.float64)
            st = [self.stats[f"static/{n}"] for n in self.statics]
            mean = np.array([x["mean"][0] for x in st]).reshape(-1, 1, 1)
            std = np.array([x["std"][0] if x["std"][0] > 0 else 1.0 for x in st]).reshape(-1, 1, 1)
            if self.normalize:
                block = (block - mean) / std
            self._static_blocks[halo] = block.astype(self._np_dtype)[None]
        return np.concatenate([window, self._static_blocks[halo]], axis=1)

    def read_truth(self, t: int) -> np.ndarray:
        """This rank's (1, C, h, w) block of step ``t``, z-scored like a target (for rollouts' later leads)."""
        return self._prepare(self._read(t, t + 1, halo=False))

    @property
    def has_climatology(self) -> bool:
        return "climatology" in self.store.group

    def read_climatology(self, t: int) -> np.ndarray:
        """This rank's (1, C, h, w) block of the train split's climatology at step ``t``'s day of year and hour of
        day (``preprocess/climatology.py``), z-scored like the data."""
        from domainflow.store.climatology_index import day_and_slot

        if not self.has_climatology:
            raise StoreError(f"{self.store.path} has no climatology (ingested before it was written); re-ingest it "
                             f"with domainflow ingest climate --overwrite")
        if self._day is None:
            time = self.store.group["time"]
            self._day, self._slot, _ = day_and_slot(self.store.read(time), dict(time.attrs))
        clim = self.store.group["climatology"]
        d = int(self._day[t]) if clim.shape[0] > 1 else 0
        lat, lon = self.slabs["lat"], self.slabs["lon"]
        block = self.store.read(clim, (d, int(self._slot[t]), self.channels, slice(lat.start, lat.stop),
                                       slice(lon.start, lon.stop)), orthogonal=True)
        return self._prepare(np.asarray(block)[None])

    @property
    def has_mask(self) -> bool:
        """The store records where filled values were missing (``ingest climate --fill``)."""
        return "missing" in self.store.group

    def read_valid(self, t: int) -> np.ndarray:
        """This rank's (1, C, h, w) block of step ``t``: 1 where the value was read, 0 where it was missing and
        filled at ingest (scores leave those points out); all ones for a channel never filled."""
        lat, lon = self.slabs["lat"], self.slabs["lon"]
        h, w = lat.stop - lat.start, lon.stop - lon.start
        out = np.ones((1, len(self.channels), h, w), self._np_dtype)
        if not self.has_mask:
            return out
        mask = self.store.group["missing"]
        names = list(mask.attrs.get("channels", []))
        all_vars = list(self.store.attrs.get("grid", {}).get("variables", []))
        for k, c in enumerate(self.channels):
            if all_vars[c] in names:
                f = names.index(all_vars[c])
                block = self.store.read(mask, (t, f, slice(lat.start, lat.stop), slice(lon.start, lon.stop)))
                out[0, k] = ~np.asarray(block, dtype=bool)
        return out

    def lat_weights(self, dtype=torch.float64):
        """cos(latitude) normalised to mean 1 over the grid (WeatherBench 2's area weights on a regular grid), as
        a (1, 1, H, 1) ShardTensor laid out like the samples' latitude (replicated over a longitude axis)."""
        from domainflow import Replicate, Shard, ShardTensor

        lat = np.asarray(self.store.read(self.store.group["lat"]), dtype=np.float64)
        w = np.cos(np.deg2rad(lat))
        w = w / w.mean()
        rows = torch.as_tensor(w[self.slabs["lat"].start:self.slabs["lat"].stop], dtype=dtype, device=self.device)
        placements = [Shard(2) if d == "lat" else Replicate() for d in self.shard_dims]
        lat_axis = self.axes.names[self.shard_dims.index("lat")]
        return ShardTensor.from_local(rows.reshape(1, 1, -1, 1), self.axes.domain, placements,
                                      sharding_shapes={lat_axis: self.sizes[lat_axis]})

    def shard(self, block: np.ndarray):
        """A (steps, C, h, w) (or (1, K, h, w)) block of this rank as the (1, steps * C, H, W) ShardTensor of the
        whole grid."""
        from domainflow import Shard, ShardTensor

        t = torch.from_numpy(np.ascontiguousarray(block)).to(self.device)
        t = t.reshape(1, -1, t.shape[2], t.shape[3])
        return ShardTensor.from_local(t, self.axes.domain, [Shard(DIMS[d]) for d in self.shard_dims],
                                      sharding_shapes=self.sizes)

    def relayout(self, x):
        """A (1, C, H, W) ShardTensor in this reader's layout (a model's output may come out split otherwise, e.g.
        after a UNet's down- and up-sampling of rows that do not halve evenly)."""
        from domainflow import Shard

        return x.redistribute([Shard(DIMS[d]) for d in self.shard_dims], sharding_shapes=self.sizes)

    def _prepare(self, block: np.ndarray) -> np.ndarray:
        """(steps, C, h, w) -> the dataset's dtype, normalised per variable."""
        out = block.astype(self._np_dtype, copy=True)
        if self.normalize:  # in place, in the target dtype
            out -= self._mean
            out *= self._inv_std
        return out

    def _core(self, block: np.ndarray) -> np.ndarray:
        """The block without its halo rows."""
        if self.halo == 0:
            return block
        lat, lon = self.slabs["lat"], self.slabs["lon"]
        return block[:, :, lat.before: block.shape[2] - lat.after, lon.before: block.shape[3] - lon.after]

    def wrap(self, raw: dict) -> dict:
        out = {"time": raw["time"], "weight": torch.tensor(raw["weight"], dtype=self.dtype, device=self.device)}
        out["input"] = self.shard(self._core(raw["window"]))
        out["target"] = self.shard(raw["target"])
        if self.halo:
            w = torch.from_numpy(np.ascontiguousarray(raw["window"])).to(self.device)
            out["input_halo"] = w.reshape(1, -1, w.shape[2], w.shape[3])
            out["halo_widths"] = {DIMS[d]: (self.slabs[d].before, self.slabs[d].after) for d in DIMS}
        return out

    def denormalize(self, x, channel_dim: int = 1):
        """Undo the z-score of a (.., C, ..) prediction whose channels are ``variables`` (in that order)."""
        mean = torch.tensor([self.stats[f"grid/{v}"]["mean"][0] for v in self.variables], dtype=x.dtype,
                            device=self.device)
        std = torch.tensor([self.stats[f"grid/{v}"]["std"][0] or 1.0 for v in self.variables],
                           dtype=x.dtype, device=self.device)
        shape = [1] * x.ndim
        shape[channel_dim] = len(self.variables)
        return x * std.reshape(shape) + mean.reshape(shape)
