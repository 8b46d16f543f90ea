"""ShardSpec: the layout of a ShardTensor (mesh, placements, global shape, per-mesh-dim sizes).

A spec is immutable and hashable (its hash is computed once) so the dispatcher can cache sharding
decisions keyed by specs. Sizes are stored per mesh dim, ``sizes[m]`` being the extent along the
tensor dim that mesh dim m shards at each coordinate of m; that makes a spec identical on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from domainflow.layout import shapes
from domainflow.errors import ShardingShapeError
from domainflow.layout.placements import Partial, Placement, Replicate, Shard, normalize_placements

_REPLICATE = Replicate()
_coord_cache: dict[int, tuple[DeviceMesh, tuple[int, ...]]] = {}
_shape_cache: dict[int, tuple[DeviceMesh, tuple[int, ...]]] = {}


def mesh_shape(mesh: DeviceMesh) -> tuple[int, ...]:
    """``tuple(mesh.shape)``, cached (DeviceMesh recomputes it from its layout on every access)."""
    hit = _shape_cache.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    shape = tuple(mesh.shape)
    _shape_cache[id(mesh)] = (mesh, shape)
    return shape


def mesh_coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate in ``mesh`` (cached; a mesh never changes)."""
    hit = _coord_cache.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"this rank is not part of device mesh {mesh}")
    coord = tuple(coord)
    _coord_cache[id(mesh)] = (mesh, coord)
    return coord


class ShardSpec:
    """Global layout of a sharded tensor; identical on every rank of its mesh."""

    __slots__ = ("mesh", "placements", "shape", "sizes", "shard_dims", "is_replicated", "has_partial", "_hash",
                 "_local_shape", "_offsets")

    def __init__(self, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int],
                 sizes: Sequence[Sequence[int] | None]):
        self.mesh = mesh
        self.placements = tuple(placements)
        self.shape = torch.Size(shape)
        self.sizes = tuple(None if s is None else tuple(int(v) for v in s) for s in sizes)
        self.shard_dims = tuple(p.dim if isinstance(p, Shard) else None for p in self.placements)
        kinds = {type(p) for p in self.placements}
        self.is_replicated = kinds <= {Replicate}
        self.has_partial = Partial in kinds
        # by value: mesh["domain"] looked up twice, or a deep copy, gives equal but distinct meshes
        self._hash = hash((mesh, self.placements, self.shape, self.sizes))
        self._local_shape = None
        self._offsets = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def build(cls, mesh: DeviceMesh, placements, shape: Sequence[int], sizes=None) -> "ShardSpec":
        """Validated spec; ``sizes`` per mesh dim (None entries: torch.chunk sizes)."""
        placements = normalize_placements(placements, len(shape), mesh.ndim)
        sizes = list(sizes) if sizes is not None else [None] * mesh.ndim
        mshape = mesh_shape(mesh)
        for m, p in enumerate(placements):
            if isinstance(p, Shard):
                n = shape[p.dim]
                if sizes[m] is None:
                    sizes[m] = shapes.chunk_sizes(n, mshape[m])
                s = tuple(int(v) for v in sizes[m])
                if len(s) != mshape[m] or sum(s) != n or min(s) < 0:
                    raise ShardingShapeError(
                        f"sharding sizes {s} for Shard({p.dim}) on mesh dim {m} must be {mshape[m]} "
                        f"non-negative sizes summing to the global size {n} of tensor dim {p.dim}"
                    )
                sizes[m] = s
            else:
                sizes[m] = None
        return cls(mesh, placements, shape, sizes)

    def with_(self, placements=None, shape=None, sizes=None) -> "ShardSpec":
        return ShardSpec(self.mesh, self.placements if placements is None else placements,
                         self.shape if shape is None else shape, self.sizes if sizes is None else sizes)

    def reduced(self) -> "ShardSpec":
        """This layout with every Partial placement replaced by Replicate: the layout once pending sums
        (maxima, ...) are reduced. The spec itself when there is nothing pending."""
        if not self.has_partial:
            return self
        return self.with_(placements=tuple(Replicate() if isinstance(p, Partial) else p for p in self.placements))

    # -- identity -----------------------------------------------------------------------------
    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return (self is other) or (
            isinstance(other, ShardSpec) and self._hash == other._hash and self.placements == other.placements
            and self.shape == other.shape and self.sizes == other.sizes
            and (self.mesh is other.mesh or self.mesh == other.mesh)
        )

    def __repr__(self) -> str:
        pl = ", ".join(_placement_str(p, s) for p, s in zip(self.placements, self.sizes))
        return f"ShardSpec(shape={tuple(self.shape)}, placements=[{pl}], mesh={tuple(self.mesh.shape)})"

    # -- derived layout -----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def coord(self) -> tuple[int, ...]:
        return mesh_coordinate(self.mesh)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self._local_shape is None:
            self._local_shape = shapes.local_shape(self.shape, self.shard_dims, self.sizes, self.coord)
        return self._local_shape

    @property
    def offsets(self) -> tuple[int, ...]:
        if self._offsets is None:
            self._offsets = shapes.local_offsets(self.ndim, self.shard_dims, self.sizes, self.coord)
        return self._offsets

    def mesh_dim_of(self, tensor_dim: int) -> int | None:
        """The mesh dim sharding ``tensor_dim``, or None."""
        for m, d in enumerate(self.shard_dims):
            if d == tensor_dim:
                return m
        return None

    def sharding_shapes(self) -> dict[int, tuple[torch.Size, ...]]:
        """Public form: for every sharded mesh dim, the local shape of each rank along it (this rank's
        coordinates on the other mesh dims)."""
        out = {}
        base = list(self.local_shape)
        for m, d in enumerate(self.shard_dims):
            if d is None:
                continue
            out[m] = tuple(torch.Size(base[:d] + [s] + base[d + 1:]) for s in self.sizes[m])
        return out

    def local_numel(self) -> int:
        return math.prod(self.local_shape)


def _placement_str(p: Placement, sizes) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim}){list(sizes)}"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return "Replicate()"


def mapping_mesh_dim(mesh: DeviceMesh, key, placements) -> int:
    """The mesh dim a ``sharding_shapes`` key names (its index or its name), which ``placements`` must shard."""
    names = tuple(mesh.mesh_dim_names or ())
    m = names.index(key) if isinstance(key, str) and key in names else key
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m < mesh.ndim:
        raise ShardingShapeError(f"sharding_shapes key {key!r} is not a mesh dim of {mesh} (names {names})")
    p = placements[m]
    if not isinstance(p, Shard):
        raise ShardingShapeError(f"sharding_shapes gives sizes for mesh dim {key!r} whose placement is {p}, not Shard")
    return m


def sizes_from_mapping(mesh: DeviceMesh, placements, local_shape: Sequence[int], mapping: Mapping) -> list:
    """Per-mesh-dim sizes from a user mapping ``{mesh dim or name: [shape or size per rank]}``."""
    sizes: list = [None] * mesh.ndim
    for key, entries in mapping.items():
        m = mapping_mesh_dim(mesh, key, placements)
        d = placements[m].dim
        vals = []
        for k, e in enumerate(entries):
            if isinstance(e, int):
                vals.append(e)
                continue
            e = tuple(e)
            if len(e) != len(local_shape):
                raise ShardingShapeError(f"sharding shape {e} of rank {k} on mesh dim {key!r} has {len(e)} dims; "
                                         f"the local tensor has {len(local_shape)}")
            for i, (a, b) in enumerate(zip(e, local_shape)):
                if i != d and a != b:
                    raise ShardingShapeError(
                        f"sharding shape {e} of rank {k} on mesh dim {key!r} differs from the local shape "
                        f"{tuple(local_shape)} in dim {i}, which mesh dim {key!r} does not shard")
            vals.append(e[d])
        coord = mesh_coordinate(mesh)[m]
        if len(vals) != mesh.shape[m]:
            raise ShardingShapeError(f"sharding_shapes for mesh dim {key!r} lists {len(vals)} ranks; the mesh dim has "
                                     f"{mesh.shape[m]}")
        if vals[coord] != local_shape[d]:
            raise ShardingShapeError(
                f"sharding_shapes says this rank (coordinate {coord} on mesh dim {key!r}) holds {vals[coord]} "
                f"along dim {d}, but its local tensor has {local_shape[d]}")
        sizes[m] = tuple(vals)
    for m, p in enumerate(placements):
        if isinstance(p, Shard) and sizes[m] is None:
            raise ShardingShapeError(f"sharding_shapes has no entry for mesh dim {m} ({p}); give one for every Shard")
    return sizes
