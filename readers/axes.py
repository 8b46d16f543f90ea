"""Which mesh dims a reader shards over (domain) and splits samples over (dp), resolved once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReaderAxes:
    """``domain``: the sub-mesh a sample is sharded over (1-D or N-D); ``dp_rank``/``dp_size``: this rank's
    place on the data-parallel axis (0 / 1 without one); ``coords``/``sizes``: this rank's coordinate and the
    size along each domain dim."""

    domain: object
    names: tuple[str, ...]
    coords: tuple[int, ...]
    sizes: tuple[int, ...]
    dp_rank: int
    dp_size: int


def resolve_axes(mesh, domain_axes, dp_axis: str | None = "dp") -> ReaderAxes:
    """Check ``mesh`` has the named dims and take its domain sub-mesh and dp coordinate.

    Pure metadata: every rank computes the same answer, so a bad mesh is refused on every rank at once.
    """
    names = tuple(mesh.mesh_dim_names or ())
    domain_axes = (domain_axes,) if isinstance(domain_axes, str) else tuple(domain_axes)
    missing = [a for a in domain_axes if a not in names]
    if missing:
        raise ValueError(f"the device mesh has dims {names or '(unnamed)'}, without {missing}; build it with "
                         f"domainflow.init_mesh(shape, names) naming the domain dim(s) {domain_axes} (and 'dp' for "
                         f"data parallelism), or pass domain_axis= the name you used")
    if dp_axis in domain_axes:
        raise ValueError(f"{dp_axis!r} cannot be both the dp axis and a domain axis")
    extra = [n for n in names if n not in domain_axes and n != dp_axis]
    if extra:
        raise ValueError(f"mesh dims {extra} are neither the dp axis {dp_axis!r} nor domain axes {domain_axes}; "
                         f"readers handle meshes of ({dp_axis!r}, domain dims...)")
    domain = mesh[domain_axes] if mesh.ndim > len(domain_axes) or names != domain_axes else mesh
    if dp_axis in names:
        dp_rank, dp_size = mesh.get_local_rank(dp_axis), mesh.size(names.index(dp_axis))
    else:
        dp_rank, dp_size = 0, 1
    coords = tuple(domain.get_local_rank(a) for a in domain_axes)
    sizes = tuple(domain.size(k) for k in range(len(domain_axes)))
    return ReaderAxes(domain, domain_axes, coords, sizes, dp_rank, dp_size)
