"""The one reader of raw climate data: netCDF files (one or many, given as files, folders or globs), GRIB files
(through cfgrib, an optional extra) or a Zarr group (v2 as xarray writes it, or v3), all opened with xarray so
that CF decoding (``scale_factor``/``add_offset``, ``_FillValue``/``missing_value``, time units and calendars)
is xarray's own.

``open_source`` runs once, in the coordinator: it resolves what the user named into files, opens each one's
metadata, groups the files by the variables they hold (CDS delivers single-level and pressure-level
variables as separate downloads), orders each group's files along time, and checks what must hold for one
grid store: the same latitudes and longitudes everywhere, one time axis shared by every group, evenly
spaced and without repeats. Variables become channels: ``(time, lat, lon)`` ones as they are, ``(time,
level, lat, lon)`` ones one channel per pressure level, named ``<var><level in hPa>`` (``z500``, ``t850``).
Time may be called ``time`` or ``valid_time``, latitude ``latitude`` or ``lat``, longitude ``longitude`` or
``lon``; coordinates are kept as the source has them (descending latitude, longitudes -180..180 or 0..360).

The result carries a small, picklable :class:`SourceReader`: a dask task reads time steps ``[t0, t1)`` of
every channel with ``read_block``, opening only the one file of each group that holds them.
"""

from __future__ import annotations

import glob as globmod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from domainflow.store import time_axis
from .climate_series import (CF_MASK_KEYS, SERIES_NAMES, coord_values, series_dims, series_steps,
                             valid_times)
from .errors import IngestError

MEMBER_NAMES = ("number", "realization", "member")   # an ensemble's members (cfgrib calls them number)
DEFAULT_FILL_ATTR = "domainflow_netcdf_default_fill"  # a netCDF variable's _FillValue is its type's default
ENSEMBLE_ATTR = "domainflow_member_dim"   # set on a dataset whose ensemble was read at one member
LAT_NAMES = ("latitude", "lat")
LON_NAMES = ("longitude", "lon")
LEVEL_NAMES = ("level", "pressure_level", "isobaricInhPa", "isobaricInPa", "plev", "lev")
COORD_NAMES = SERIES_NAMES + LAT_NAMES + LON_NAMES
NETCDF_SUFFIXES = (".nc", ".nc4", ".netcdf", ".cdf", ".h5", ".hdf5")
GRIB_SUFFIXES = (".grib", ".grb", ".grib1", ".grib2", ".grb2")
WHAT = ("ingest climate reads netCDF or GRIB files (files, folders or globs of them) or one Zarr store of "
        "(time, latitude, longitude) variables")


@dataclass(frozen=True)
class Channel:
    """One channel of the store: a variable, at one pressure level for a level variable."""

    name: str                    # z500, t2m
    variable: str                # the source's variable name
    group: int                   # which file group holds it
    level: float | None = None   # the source's level value (its own units), None for a (time, lat, lon) variable
    hpa: float | None = None     # the level in hPa


@dataclass(frozen=True)
class FileSpan:
    path: str
    t0: int                      # global time indices [t0, t1) this file holds
    t1: int
    part: tuple = ()             # a GRIB hypercube's filter_by_keys items; () for netCDF and Zarr
    tdims: tuple = ()            # the file's series dims: (time,), (valid_time,), (step,), (time, step)...
    order: tuple = ()            # a (time, step) series: its (time, step) index pairs in valid-time order


@dataclass
class SourceReader:
    """What a task needs to read time blocks: each group's files and the channels (picklable, small)."""

    kind: str                    # "zarr", "netcdf" or "grib"
    groups: list                 # [[FileSpan, ...], ...] per group, in time order
    channels: list               # [Channel, ...]
    dims: dict                   # {"time": (names), "lat": name, "lon": name, "level": {variable: dim name}}
    member: float | None = None  # the ensemble member read (--member), None without an ensemble

    def spans(self) -> list[tuple[int, int]]:
        """The stretches of time no file boundary of any group cuts: each is read from one file per group."""
        cuts = sorted({c for files in self.groups for f in files for c in (f.t0, f.t1)})
        return list(zip(cuts[:-1], cuts[1:]))

    def read_block(self, t0: int, t1: int) -> tuple[np.ndarray, list]:
        """Time steps ``[t0, t1)`` of every channel as float64 ``(t1 - t0, C, H, W)``, decoded by xarray
        (missing values are NaN), and each channel's (mask key, value) pairs that xarray read as missing."""
        out, fills = None, [[] for _ in self.channels]
        for g, files in enumerate(self.groups):
            mine = [k for k, c in enumerate(self.channels) if c.group == g]
            if not mine:
                continue
            span = next((f for f in files if f.t0 <= t0 and t1 <= f.t1), None)
            if span is None:
                raise IngestError(f"time steps {t0}..{t1 - 1} are not inside one file of the group {files[0].path}, ...")
            names = sorted({self.channels[k].variable for k in mine})
            names += sorted({self.dims["level"][v] for v in names if v in self.dims["level"]})  # for .sel
            with open_dataset(span.path, self.kind, only=names, part=span.part, member=self.member) as ds:
                for k in mine:
                    c = self.channels[k]
                    da = ds[c.variable]
                    if c.level is not None:
                        da = da.sel({self.dims["level"][c.variable]: c.level})
                    values = series_steps(da, span.tdims or self.dims["time"], t0 - span.t0, t1 - span.t0,
                                          (self.dims["lat"], self.dims["lon"]), span.order)
                    if out is None:
                        out = np.empty((t1 - t0, len(self.channels)) + values.shape[1:], dtype=np.float64)
                    out[:, k] = values
                    fills[k] = _mask_keys(da)
        return out, fills


@dataclass(frozen=True)
class StaticField:
    """A constant field (land-sea mask, orography) taken from the source as an input channel: a (lat, lon)
    variable of ``paths[0]``, or a (time, lat, lon) one whose steps must all be the same map."""

    name: str
    paths: tuple                 # the files holding it (every one is checked to hold the same map)
    timed: bool                  # False: a (lat, lon) variable
    attrs: dict = field(default_factory=dict, hash=False, compare=False)
    parts: tuple = ()            # each path's GRIB hypercube keys (() each for netCDF and Zarr)

    @property
    def variable(self) -> str:   # the missing-value policies select by variable or channel name
        return self.name


@dataclass
class ClimateSource:
    """A resolved climate source: its channels, coordinates and time axis, and the reader for its blocks."""

    shown: str                   # how to name it in messages
    reader: SourceReader
    shape: tuple                 # (T, H, W)
    lat: np.ndarray
    lon: np.ndarray
    time: np.ndarray             # numbers in time_attrs["units"] (steps when the source has no time)
    time_attrs: dict
    time_chunk: int
    channel_attrs: dict = field(default_factory=dict)   # {channel: {"units", "long_name", ...}}
    statics: list = field(default_factory=list)         # [StaticField, ...] (--static)
    levels: dict = field(default_factory=dict)          # {variable: [hPa, ...]} of the level variables kept
    files: int = 1

    @property
    def channels(self) -> list[str]:
        return [c.name for c in self.reader.channels]


# -- files ------------------------------------------------------------------------------------------------
def resolve(items) -> tuple[str, list[str]]:
    """(kind, paths) of what the user named: one Zarr store, or netCDF / GRIB files from files, folders and
    globs (each expanded in sorted order); a name that matches nothing is an error naming it."""
    items = [str(i) for i in ([items] if isinstance(items, (str, Path)) else items)]
    if not items:
        raise IngestError(f"no climate source given; {WHAT}")
    files, zarrs = [], []
    for item in items:
        path = Path(item)
        if any(ch in item for ch in "*?["):
            found = sorted(globmod.glob(item, recursive=True))
            if not found:
                raise IngestError(f"{item}: the pattern matches no file; {WHAT}")
            for f in found:
                (zarrs if _is_zarr(Path(f)) else files).append(f)
        elif path.is_dir():
            if _is_zarr(path):
                zarrs.append(str(path))
            else:
                inside = sorted(str(p) for p in path.iterdir() if p.suffix.lower() in NETCDF_SUFFIXES + GRIB_SUFFIXES)
                if not inside:
                    raise IngestError(f"{item}: a folder with no netCDF or GRIB files and not a Zarr store; {WHAT}")
                files.extend(inside)
        elif path.is_file():
            files.append(str(path))
        else:
            raise IngestError(f"{item}: no such file or folder, and not a readable Zarr group; {WHAT}")
    # absolute: tasks may run on dask workers started in other working directories
    files, zarrs = [str(Path(f).resolve()) for f in files], [str(Path(z).resolve()) for z in zarrs]
    if zarrs:
        if len(zarrs) > 1 or files:
            raise IngestError(f"{', '.join(zarrs + files)}: a Zarr source is ingested on its own (one store per "
                              f"ingest); {WHAT}")
        return "zarr", zarrs
    kinds = {"grib" if Path(f).suffix.lower() in GRIB_SUFFIXES else "netcdf" for f in files}
    if len(kinds) > 1:
        raise IngestError(f"{items}: netCDF and GRIB files mixed; convert one kind or ingest them separately")
    dupes = sorted({f for f in files if files.count(f) > 1})
    if dupes:
        raise IngestError(f"{dupes[0]} is named twice among the sources ({items})")
    return kinds.pop(), files


def _is_zarr(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in ("zarr.json", ".zgroup", ".zmetadata"))


def open_dataset(path, kind: str, only=None, coords_as_stored: bool = False, part: tuple = (), member=None):
    """One source file (or the Zarr store) as a lazy xarray Dataset with times left as numbers. ``only``: the
    variables to open (others dropped, so arrays of other shapes do not stop xarray). ``coords_as_stored``:
    coordinates without CF masking (a zarr-python v2 store's default fill_value 0 must not turn longitude 0
    into NaN). ``part``: a GRIB file's hypercube (its filter_by_keys items). ``member``: the ensemble member
    kept of an ensemble's variables (required when the file holds one)."""
    import xarray as xr

    kw = {"chunks": None, "decode_times": False}
    if coords_as_stored:
        kw["mask_and_scale"] = {n: False for n in COORD_NAMES}
    if kind == "zarr":
        if only is not None:
            kw["drop_variables"] = [n for n in _zarr_array_names(path) if n not in only]
        try:
            ds = xr.open_zarr(path, consolidated=True, **kw)
        except Exception:  # no (readable) consolidated metadata: the arrays' own, without xarray's warning
            ds = xr.open_zarr(path, consolidated=False, **kw)
        return _one_member(ds, path, member)
    if kind == "grib":
        try:
            import cfgrib  # noqa: F401
        except ImportError:
            raise IngestError(f"{path}: reading GRIB needs cfgrib and ecCodes: pip install 'domainflow[grib]' "
                              f"(or convert the files to netCDF)") from None
        kw.pop("mask_and_scale", None)
        from .grib_file import index_path

        # errors="raise" as grib_file opens it: cfgrib's cached index is valid for one file stream mode
        ds = xr.open_dataset(path, engine="cfgrib", backend_kwargs={"indexpath": index_path(path), "errors": "raise",
                                                                    "filter_by_keys": dict(part)}, **kw)
        ds = _one_message_as_one_step(ds)
    else:
        import warnings

        raw = _with_netcdf_default_fills(xr.open_dataset(path, chunks=None, decode_cf=False), path)
        with warnings.catch_warnings():  # a missing_value next to the default fill: both are masked, as netCDF4 does
            warnings.simplefilter("ignore", xr.SerializationWarning)
            ds = xr.decode_cf(raw, decode_times=False)
        if coords_as_stored:  # neither masked nor unpacked (a packed coordinate is refused by name)
            ds = ds.assign_coords({n: raw.variables[n] for n in raw.coords if n in ds.coords})
    if only is not None:
        ds = ds[[v for v in only if v in ds.variables]]
    return _one_member(ds, path, member)


def _one_message_as_one_step(ds):
    """A GRIB hypercube of one time (a file per date or hour, or a single step) as a series of one step: cfgrib
    makes its time, step and valid time scalar coordinates; the valid time becomes its one-step dim."""
    gridded = [v for v in ds.data_vars.values() if v.ndim >= 2 and v.dims[-2] in LAT_NAMES and v.dims[-1] in LON_NAMES]
    if not gridded or any(d in SERIES_NAMES for v in gridded for d in v.dims):
        return ds
    scalar = next((n for n in ("valid_time", "time") if n in ds.coords and ds[n].ndim == 0), None)
    return ds if scalar is None else ds.expand_dims(scalar)


def _one_member(ds, path, member):
    """An ensemble's variables at member ``member`` (its number); an ensemble read without ``--member`` is an
    error naming the members."""
    dims = {d for v in ds.data_vars.values() for d in v.dims if d in MEMBER_NAMES and ds.sizes[d] > 1}
    # (a scalar member coordinate is no ensemble: cfgrib gives deterministic GRIB 1 fields number=0)
    for d in sorted(dims):
        have = np.asarray(ds[d].values) if d in ds.variables else np.arange(ds.sizes[d])
        if member is None:
            raise IngestError(f"{path} holds an ensemble ({d}: {len(have)} members, {have[0]:g} .. {have[-1]:g}); "
                              f"pick one with --member K, or ingest each member into its own store")
        if float(member) not in set(have.astype(np.float64).tolist()):
            raise IngestError(f"{path}: --member {member:g} is not among its members {have.tolist()}")
        ds = ds.sel({d: have[have.astype(np.float64) == float(member)][0]})
        ds.attrs[ENSEMBLE_ATTR] = d
    return ds


def _with_netcdf_default_fills(raw, path):
    """A netCDF dataset opened undecoded, made to decode as netCDF4 reads it: a data variable without a
    ``_FillValue`` has its type's default fill (9.97e36 for float32: what unwritten values hold) as one,
    since netCDF4 masks it and xarray would not. Bytes only in fill mode (netCDF4's rule)."""
    import netCDF4

    nc = None
    try:
        for name, var in raw.data_vars.items():
            kind = var.dtype.str[1:]
            if "_FillValue" in var.attrs or kind not in netCDF4.default_fillvals or var.dtype.kind not in "iuf":
                continue
            fill = netCDF4.default_fillvals[kind]
            if kind in ("i1", "u1"):  # netCDF4 masks a byte's default fill only in fill mode
                if nc is None:
                    nc = netCDF4.Dataset(path)
                held = nc.variables.get(name)
                fill = held.get_fill_value() if held is not None else None
                if fill is None:
                    continue
            var.attrs["_FillValue"] = np.array(fill, dtype=var.dtype)
            var.attrs[DEFAULT_FILL_ATTR] = 1  # so a message says where the fill came from
    finally:
        if nc is not None:
            nc.close()
    return raw


def _zarr_array_names(path) -> list[str]:
    import zarr

    return list(zarr.open_group(path, mode="r").array_keys())


# -- what a file holds --------------------------------------------------------------------------------------
def gridded_variables(ds) -> dict[str, tuple[str | None, object]]:
    """{variable: (level dim or None, variable)} of a dataset's (series, lat, lon) and (series, level, lat, lon)
    variables, the series being time, valid_time, step, or a forecast's time and step."""
    out = {}
    for name, var in ds.variables.items():
        dims = tuple(var.dims)
        if name in ds.coords or len(dims) < 3 or dims[-2] not in LAT_NAMES or dims[-1] not in LON_NAMES:
            continue
        lead = series_dims(dims)
        if not lead or len(set(lead)) != len(lead):
            continue
        rest = dims[len(lead):-2]
        if not rest:
            out[str(name)] = (None, var)
        elif len(rest) == 1 and rest[0] in LEVEL_NAMES:
            out[str(name)] = (rest[0], var)
    return out


def flat_variables(ds) -> dict:
    """{variable: variable} of a dataset's (lat, lon) variables (constant fields: land-sea mask, orography)."""
    return {str(n): v for n, v in ds.variables.items()
            if n not in ds.coords and len(v.dims) == 2 and v.dims[0] in LAT_NAMES and v.dims[1] in LON_NAMES}


def level_hpa(ds, dim: str) -> np.ndarray:
    """A level coordinate's values in hPa (Pa when its units say so, e.g. CMIP's plev)."""
    values = np.asarray(ds[dim].values, dtype=np.float64) if dim in ds.variables else np.arange(ds.sizes[dim])
    units = str(ds[dim].attrs.get("units", "")).strip() if dim in ds.variables else ""
    return values / 100.0 if units in ("Pa", "pa", "pascal", "Pascal") else values


def _channel_name(variable: str, hpa: float) -> str:
    return f"{variable}{int(hpa)}" if float(hpa).is_integer() else f"{variable}{hpa:g}"


@dataclass
class _FileInfo:
    path: str
    variables: dict              # {variable: level dim or None}
    levels: dict                 # {variable: (values as stored, hPa)}
    time: np.ndarray | None
    time_attrs: dict
    lat: np.ndarray
    lon: np.ndarray
    dims: dict
    attrs: dict
    time_chunk: int
    steps: int
    flat: dict = field(default_factory=dict)   # {variable: attrs} of its (lat, lon) variables
    part: tuple = ()                           # a GRIB hypercube's filter_by_keys items
    order: tuple = ()                          # a (time, step) series' index pairs in valid-time order
    ensemble: bool = False                     # an ensemble read at --member


def _scan_file(path: str, kind: str, variables=None, part: tuple = (), member=None) -> _FileInfo:
    """What one file (or one hypercube of a GRIB file) holds (metadata and coordinates only)."""
    what = "a Zarr group" if kind == "zarr" else f"a {kind} file"
    try:
        try:
            ds = open_dataset(path, kind, coords_as_stored=True, part=part, member=member)
        except (FileNotFoundError, KeyError, IngestError):
            raise
        except Exception:
            if kind != "zarr" or not variables:
                raise
            # xarray cannot open all arrays together (a dimension with two sizes): just --variables
            ds = open_dataset(path, kind, only=(*variables, *COORD_NAMES), coords_as_stored=True, member=member)
    except IngestError:
        raise
    except KeyError as exc:  # xarray needs the dimension names of every array
        raise IngestError(f"{path}: xarray cannot read it as a dataset ({exc.args[0] if exc.args else exc}); "
                          f"it reads arrays that name their dimensions (Zarr v3 dimension_names, v2 "
                          f"_ARRAY_DIMENSIONS), as xarray writes them") from None
    except Exception as exc:  # noqa: BLE001  (any backend's error, with the file named)
        shapes = _zarr_shapes(path) if kind == "zarr" else {}
        if len(set(shapes.values())) > 1:  # xarray refuses one dimension with two sizes
            raise IngestError(f"{path}: variables have different shapes {shapes}; ingest them in separate stores "
                              f"(--variables)") from None
        raise IngestError(f"{path} is not readable as {what} ({type(exc).__name__}: {exc}); {WHAT}") from None
    with ds:
        info = _scan_dataset(ds, path, part)
        info.ensemble = ENSEMBLE_ATTR in ds.attrs
        return info


def _scan_dataset(ds, path: str, part: tuple) -> _FileInfo:
    """What an opened file (or GRIB hypercube) holds: its gridded and constant variables and coordinates."""
    found = gridded_variables(ds)
    flat = flat_variables(ds)
    if not found and not flat:
        _refuse_other_grids(ds, path)
        shown = {str(n): tuple(a.dims) for n, a in ds.variables.items()}
        raise IngestError(f"{path} holds no (time, latitude, longitude) or (time, level, latitude, longitude) "
                          f"variables; arrays and their dims: {shown}")
    if not found:  # only constant fields (an "invariant" download): named with --static
        var = next(iter(flat.values()))
        latd, lond = var.dims
        lat = coord_values(ds, path, latd, var.shape[0])[0]
        lon = coord_values(ds, path, lond, var.shape[1])[0]
        if lat is None or lon is None:
            raise IngestError(f"{path}: coordinate arrays {latd!r} and {lond!r} are required")
        return _FileInfo(path, {}, {}, None, {}, lat.astype(np.float64), lon.astype(np.float64),
                         {"time": None, "lat": latd, "lon": lond}, {}, 1, 0,
                         {n: dict(v.attrs) for n, v in flat.items()}, part)
    first = next(iter(found.values()))[1]
    tdims, latd, lond = series_dims(first.dims), first.dims[-2], first.dims[-1]
    for name, (_, var) in found.items():
        if (series_dims(var.dims), var.dims[-2], var.dims[-1]) != (tdims, latd, lond):
            raise IngestError(f"{path}: variable {name!r} has dims {var.dims}, others {first.dims}")
    T, H, W = int(np.prod([first.sizes[d] for d in tdims])), first.shape[-2], first.shape[-1]

    def coord(name, n):
        return coord_values(ds, path, name, n)

    (lat, _), (lon, _) = coord(latd, H), coord(lond, W)
    t, t_attrs = valid_times(ds, path, tdims)
    order = ()
    if len(tdims) > 1:  # (time, step): the pairs the file holds, in valid-time order
        from .grib_file import present_steps

        shape = tuple(first.sizes[d] for d in tdims)
        held = (present_steps(path, part) if part else None) or list(np.ndindex(*shape))
        flat_index = [int(np.ravel_multi_index(ix, shape)) for ix in held]
        at = np.argsort(np.asarray(t)[flat_index], kind="stable") if t is not None else np.arange(len(held))
        order = tuple(tuple(int(i) for i in held[k]) for k in at)
        t = None if t is None else np.asarray(t)[[flat_index[k] for k in at]]
        T = len(order)
    elif part:
        from .grib_file import present_steps

        present_steps(path, part)  # any hole is damage
    if lat is None or lon is None:
        raise IngestError(f"{path}: coordinate arrays {latd!r} and {lond!r} are required")
    levels = {}
    for name, (ldim, _) in found.items():
        if ldim is not None:
            levels[name] = (np.asarray(ds[ldim].values) if ldim in ds.variables else np.arange(ds.sizes[ldim]),
                            level_hpa(ds, ldim))
    enc = first.encoding
    chunk = enc["chunks"][0] if enc.get("chunks") else enc.get("preferred_chunks", {}).get(tdims[0], T)
    if len(tdims) > 1:  # a forecast's (time, step): read a step at a time
        chunk = 1
    attrs = {n: dict(v.attrs) for n, (_, v) in found.items()}  # xarray moved the CF keys to .encoding
    flat = {n: dict(v.attrs) for n, v in flat.items() if v.dims == (latd, lond)}
    return _FileInfo(path, {n: d for n, (d, _) in found.items()}, levels, t, t_attrs,
                     lat.astype(np.float64), lon.astype(np.float64),
                     {"time": tdims, "lat": latd, "lon": lond}, attrs, int(chunk or T), int(T), flat, part,
                     order)


def _refuse_other_grids(ds, path) -> None:
    """A variable on a grid other than a regular latitude-longitude one (reduced Gaussian, Lambert, a
    projection's x/y) is refused with what the grid is and how to regrid it."""
    for name, var in ds.data_vars.items():
        grid = var.attrs.get("GRIB_gridType")
        mapping = var.attrs.get("grid_mapping")
        if grid in (None, "regular_ll") and mapping is None and not any(d in ("values", "x", "y", "rlat", "rlon")
                                                                        for d in var.dims):
            continue
        what = (f"on a {grid} grid" if grid else f"on the grid of {mapping!r}" if mapping else
                f"on dims {tuple(var.dims)}")
        raise IngestError(f"{path}: {name} is {what}, not a regular latitude-longitude grid; ingest climate reads "
                          f"regular latitude-longitude grids: regrid it first (e.g. `cdo remapbil,r1440x721 in out`, "
                          f"or earthkit-regrid / xESMF)")


def _zarr_shapes(path) -> dict:
    """Shapes of a Zarr source's gridded variables, each opened on its own (for the error raised when xarray
    cannot open them together); empty when that fails too."""
    try:
        shapes = {}
        for name in _zarr_array_names(path):
            with open_dataset(path, "zarr", only=(name,)) as one:
                for v, (_, var) in gridded_variables(one).items():
                    shapes[v] = tuple(var.shape)
        return shapes
    except Exception:  # noqa: BLE001
        return {}


# -- the source -------------------------------------------------------------------------------------------
def open_source(items, variables=None, levels=None, static=None, member=None) -> ClimateSource:
    """Resolve, scan and check a climate source; ``variables`` selects variables (all their levels) or
    channels (``z500``); ``levels`` (hPa) selects the pressure levels of level variables; ``static`` names
    constant fields (``lsm``, ``z`` of the surface) kept apart from the time-dependent channels; ``member``
    picks one member of an ensemble. A GRIB file is read as every hypercube it holds, each checked whole."""
    kind, paths = resolve(items)
    shown = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more files)"
    infos, names = [], set()
    for p in paths:
        for part in _parts(p, kind):
            if part and variables:
                held = grib_names(p, part)
                names.update(held)
                if not _selected(held, part, (*variables, *(static or ()))):
                    continue  # a hypercube --variables leaves out is not read (its grid or times do not matter)
            infos.append(_scan_file(p, kind, variables, part, member))
    if not infos:
        raise IngestError(f"--variables {list(variables)}: no such variable in {shown}; its variables are "
                          f"{sorted(names)}")
    if member is not None and not any(i.ensemble for i in infos):
        raise IngestError(f"--member {member:g}: {shown} holds no ensemble (no member dim); leave --member out")
    first = infos[0]
    for info in infos[1:]:
        for name, a, b in (("latitude", first.lat, info.lat), ("longitude", first.lon, info.lon)):
            if a.shape != b.shape or not np.array_equal(a, b):
                raise IngestError(f"{info.path}: its {name}s differ from those of {first.path}; every file of a "
                                  f"source must be on the same grid")
    statics = _statics(infos, static or (), variables)
    infos = [i for i in infos if i.variables]  # files of constant fields only are no part of the time axis
    if not infos:
        raise IngestError(f"{shown}: no time-dependent (time, latitude, longitude) variable besides the --static "
                          f"fields {list(static or ())}")
    first = infos[0]
    groups = _group_files(infos)
    time, time_attrs, spans = _time_axis(groups)
    channels, levels_kept, attrs = _channels(groups, variables, levels)
    # every group's dims: the names may differ between downloads, but one reader needs one set per group
    dims = {"time": first.dims["time"], "lat": first.dims["lat"], "lon": first.dims["lon"], "level": {}}
    for g in groups:
        for info in g:  # (the series dims may differ: each span reads its own)
            if (info.dims["lat"], info.dims["lon"]) != (first.dims["lat"], first.dims["lon"]):
                raise IngestError(f"{info.path} names its dims {info.dims}, {first.path} {first.dims}; rename them "
                                  f"to one convention")
            dims["level"].update({v: d for v, d in info.variables.items() if d is not None})
    reader = SourceReader(kind, spans, channels, dims, None if member is None else float(member))
    T = len(time)
    return ClimateSource(shown=shown, reader=reader, shape=(T, len(first.lat), len(first.lon)), lat=first.lat,
                         lon=first.lon, time=time, time_attrs=time_attrs,
                         time_chunk=min(i.time_chunk for i in infos) if kind == "zarr" else max(
                             b.t1 - b.t0 for files in spans for b in files),
                         channel_attrs=attrs, levels=levels_kept, files=len(paths), statics=statics)


def _parts(path: str, kind: str) -> list[tuple]:
    """The hypercubes a file is read as: every one of a GRIB file (each checked for damage and holes), the
    whole file otherwise (a classic netCDF file checked to be as long as its header says)."""
    if kind == "netcdf":
        from .netcdf_file import check_size

        check_size(path)
    if kind != "grib":
        return [()]
    from . import grib_file

    try:
        import cfgrib  # noqa: F401
    except ImportError:
        raise IngestError(f"{path}: reading GRIB needs cfgrib and ecCodes: pip install 'domainflow[grib]' "
                          f"(or convert the files to netCDF)") from None
    grib_file.check_file(path)
    return grib_file.hypercubes(path)  # each checked for holes when it is scanned


def grib_names(path: str, part: tuple) -> list[str]:
    """The variable names cfgrib gives a GRIB hypercube's data."""
    from .grib_file import open_cube

    ds = open_cube(path, dict(part))
    return [n for n, v in ds.variables.items() if n not in ds.dimensions and "GRIB_paramId" in v.attributes]


def _selected(names, part: tuple, variables) -> bool:
    """Whether ``--variables`` (variables, or channels: ``z500``, or ``t2m_avg`` for hypercubes told apart by
    a key of theirs) picks any of a hypercube's ``names``."""
    values = {str(v) for _, v in part}
    for v in variables:
        for n in names:
            rest = v[len(n):]
            if v == n or (v.startswith(n) and (rest.replace(".", "", 1).isdigit() or rest[1:] in values)):
                return True
    return False


def _statics(infos: list[_FileInfo], names, variables) -> list[StaticField]:
    """The ``--static`` fields, found among the files' (lat, lon) and single-level (time, lat, lon) variables,
    and taken out of the files' time-dependent variables. A file of (lat, lon) fields that are not named is an
    error (they would be dropped without a word)."""
    names = list(names)
    if len(set(names)) != len(names):
        raise IngestError(f"--static names a field more than once: {names}")
    both = sorted(set(names) & set(variables or ()))
    if both:
        raise IngestError(f"{both} named both by --static and --variables; a field is an input channel of one kind")
    out = []
    for name in names:
        flat = [i for i in infos if name in i.flat]
        # single-level (time, lat, lon) copies only: ERA5's surface geopotential ``z`` (an invariant download)
        # comes next to the pressure levels' ``z``, which stays a variable
        timed = [i for i in infos if name in i.variables and i.variables[name] is None]
        if not flat and not timed and any(name in i.variables for i in infos):
            raise IngestError(f"--static {name}: a pressure-level variable is not a constant field")
        holders = flat or timed
        if not holders:
            known = sorted({v for i in infos for v in (*i.variables, *i.flat)})
            raise IngestError(f"--static {name}: no file holds a (latitude, longitude) or (time, latitude, longitude) "
                              f"variable {name!r}; the variables are {known}")
        attrs = holders[0].flat[name] if flat else holders[0].attrs[name]
        out.append(StaticField(name, tuple(i.path for i in holders), not flat, dict(attrs),
                               tuple(i.part for i in holders)))
        for i in timed:  # also when a (lat, lon) copy wins: the field is an input, never a predicted channel
            i.variables.pop(name)
    for info in infos:
        if not info.variables and not info.flat:  # every variable was a static (time, lat, lon) one
            continue
        unnamed = sorted(set(info.flat) - set(names))
        if not info.variables and unnamed:
            raise IngestError(f"{info.path} holds only constant (latitude, longitude) fields {unnamed}: name the ones "
                              f"to use with --static (e.g. --static {','.join(unnamed)}), or leave the file out")
    return out


def read_static(field_: StaticField, kind: str, dims: dict, member=None) -> tuple[np.ndarray, list]:
    """A static field's (H, W) map as float64 (missing values NaN) and the mask keys xarray read as missing.
    A field given with a time axis must hold one map: the first and last step of every file holding it are
    compared with the first (to 1e-4 of its range, above int16 packing's rounding) and a difference is an
    error naming the file and step."""
    ref, keys = None, []
    for path, part in zip(field_.paths, field_.parts or [()] * len(field_.paths)):
        with open_dataset(path, kind, only=[field_.name], part=part, member=member) as ds:
            da = ds[field_.name]
            if not field_.timed:
                return np.asarray(da.transpose(*da.dims[-2:]).values, np.float64), _mask_keys(da)
            tdim = da.dims[0]
            n = da.sizes[tdim]
            for step in sorted({0, n - 1}):
                m = np.asarray(da.isel({tdim: step}).values, np.float64)
                if ref is None:
                    ref, keys = m, _mask_keys(da)
                    continue
                span = np.nanmax(ref) - np.nanmin(ref) if np.isfinite(ref).any() else 0.0
                same = np.isnan(ref) == np.isnan(m)
                close = np.abs(np.nan_to_num(m - ref)) <= 1e-4 * span + 1e-12 * np.abs(np.nan_to_num(ref))
                if not (same & close).all():
                    i, j = (int(v[0]) for v in np.nonzero(~(same & close)))
                    raise IngestError(f"--static {field_.name}: {path} step {step} differs from the first map at "
                                      f"row {i}, column {j} ({m[i, j]:g} against {ref[i, j]:g}): it varies in time, "
                                      f"so it is not a constant field; ingest it as a variable")
    return ref, keys


def _mask_keys(da) -> list:
    default = DEFAULT_FILL_ATTR in da.attrs
    return [("netCDF default fill" if default and key == "_FillValue" else key, x) for key in CF_MASK_KEYS
            for x in np.atleast_1d(da.encoding.get(key, [])) if x is not None and x == x]


def _group_files(infos: list[_FileInfo]) -> list[list[_FileInfo]]:
    """Files grouped by the variables they hold, each group in time order."""
    groups: dict[tuple, list] = {}
    for info in infos:  # a GRIB hypercube is its own group: the same name may come from two (hPa and Pa levels)
        groups.setdefault((tuple(sorted(info.variables)), info.part), []).append(info)
    names = list(groups)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            both = set(names[a][0]) & set(names[b][0]) if names[a][1] == names[b][1] else set()
            if both:
                raise IngestError(f"{groups[names[a]][0].path} and {groups[names[b]][0].path} both hold {sorted(both)} "
                                  f"but not the same variables; a variable must come from one set of files")
    out = []
    for key in names:
        files = groups[key]
        if any(f.time is None for f in files) and len(files) > 1:
            raise IngestError(f"{files[0].path}: files without a time coordinate cannot be put in order; give them "
                              f"a time coordinate (or ingest one file)")
        if files[0].time is not None:
            files.sort(key=lambda f: _decoded(f)[0] if len(f.time) else 0)
        out.append(files)
    return out


def _decoded(info: _FileInfo) -> np.ndarray:
    """A file's times as xarray decodes them (numpy datetime64, or cftime objects for other calendars)."""
    dates = time_axis.decode(info.time, info.time_attrs)
    return np.asarray(info.time) if dates is None else dates


def _time_axis(groups) -> tuple[np.ndarray, dict, list]:
    """The source's time axis (numbers in the first file's units; re-encoded there when files differ), its
    attrs and each group's file spans; every group must have the same times, evenly spaced, no repeats."""
    axes = []
    for files in groups:
        if files[0].time is None:
            axes.append(None)
            continue
        axes.append(np.concatenate([_decoded(f) for f in files]))
    ref_files = groups[0]
    first = ref_files[0]
    if axes[0] is None:
        time, attrs = np.arange(first.steps, dtype=np.int64), {"units": "steps"}
    else:
        dates = axes[0]
        same_units = all(f.time_attrs.get("units") == first.time_attrs.get("units") and
                         f.time_attrs.get("calendar") == first.time_attrs.get("calendar") for f in ref_files)
        if same_units:
            time = np.concatenate([np.asarray(f.time) for f in ref_files])
        else:
            time = time_axis.encode(dates, first.time_attrs)
        attrs = dict(first.time_attrs)
        _check_even(dates, ref_files)
    for g, (files, ax) in enumerate(zip(groups, axes)):
        if g and (ax is None) != (axes[0] is None) or (ax is not None and (len(ax) != len(axes[0]) or
                                                                            not np.array_equal(ax, axes[0]))):
            if files[0].part:  # GRIB hypercubes, of one file or several
                one = [sorted(f[0].variables) for f, a in ((files, ax), (ref_files, axes[0])) if a is not None and
                       len(a) == 1]
                pick = (f"; {one[0]} has one time: a constant field (land-sea mask, orography)? name it with "
                        f"--static" if one else "; ingest them apart (--variables)")
                raise IngestError(f"{sorted(files[0].variables)} of {files[0].path} cover other valid times than "
                                  f"{sorted(ref_files[0].variables)} of {ref_files[0].path}: {_cover(ax)} against "
                                  f"{_cover(axes[0])}{pick}")
            raise IngestError(f"{files[0].path} and the other files of its variables ({sorted(files[0].variables)}) "
                              f"cover other times than {ref_files[0].path} ({sorted(ref_files[0].variables)}): "
                              f"{_cover(ax)} against {_cover(axes[0])}; give every variable the same times")
    spans = []
    for files in groups:
        at, mine = 0, []
        for f in files:
            n = _length(f)
            mine.append(FileSpan(f.path, at, at + n, f.part, f.dims["time"], f.order))
            at += n
        spans.append(mine)
    return time, attrs, spans


def _length(info: _FileInfo) -> int:
    return info.steps


def _cover(ax) -> str:
    if ax is None:
        return "no time coordinate"
    return f"{len(ax)} steps {ax[0]} .. {ax[-1]}" if len(ax) else "no steps"


def _check_even(dates: np.ndarray, files) -> None:
    """Times strictly increasing with one step (a repeat or a gap makes a lead of k steps mean two things)."""
    if len(dates) < 2:
        return
    deltas = np.array([dates[k + 1] - dates[k] for k in range(len(dates) - 1)])
    where = [k for k in range(len(deltas)) if not deltas[k] == deltas[0]]
    bad = [k for k in range(len(deltas)) if not deltas[k] > deltas[0] * 0]
    if bad or where:
        k = (bad or where)[0]
        holder, at = files[0].path, 0
        for f in files:
            if at + _length(f) > k:
                holder = f.path
                break
            at += _length(f)
        what = "repeats or goes back" if bad else f"jumps by {deltas[k]} instead of {deltas[0]}"
        raise IngestError(f"the time axis {what} after step {k} ({dates[k]} -> {dates[k + 1]}, in {holder}): "
                          f"ingest a series of evenly spaced, distinct times (a missing or doubled file?)")


def _channels(groups, variables, levels) -> tuple[list[Channel], dict, dict]:
    """Channels in order: variables by name, a level variable's levels in ascending hPa."""
    available: dict[tuple[str, int], tuple[str | None, np.ndarray, np.ndarray, dict]] = {}
    for g, files in enumerate(groups):
        info = files[0]
        for v, ldim in info.variables.items():
            vals, hpa = info.levels.get(v, (None, None))
            available[v, g] = (ldim, vals, hpa, info.attrs[v])
    all_channels: list[Channel] = []
    attrs: dict = {}
    for v, g in sorted(available):
        ldim, vals, hpa, a = available[v, g]
        if ldim is None:
            all_channels.append(Channel(v, v, g))
            attrs[v, g] = a
            continue
        order = np.argsort(hpa, kind="stable")
        for k in order:
            name = _channel_name(v, float(hpa[k]))
            all_channels.append(Channel(name, v, g, vals[k].item(), float(hpa[k])))
            attrs[name, g] = {**a, "level_hpa": float(hpa[k]), "source_variable": v}
    all_channels, attrs = _told_apart(all_channels, attrs, groups)
    if levels:
        wanted = {float(x) for x in levels}
        have = {c.hpa for c in all_channels if c.hpa is not None}
        missing = sorted(wanted - have)
        if missing:
            raise IngestError(f"--levels {missing} hPa are not in the source; its pressure levels are "
                              f"{sorted(have) or 'none (no level variables)'}")
        all_channels = [c for c in all_channels if c.hpa is None or c.hpa in wanted]
    names = {c.name for c in all_channels}
    clash = sorted(n for n in names if sum(c.name == n for c in all_channels) > 1)
    if clash:
        raise IngestError(f"channel name(s) {clash} given by two variables; ingest them with --variables apart")
    if variables:
        picked, unknown = [], []
        for v in variables:
            hit = [c for c in all_channels if c.variable == v] or [c for c in all_channels if c.name == v]
            if not hit:
                unknown.append(v)
            picked.extend(c for c in hit if c not in picked)
        if unknown:
            raise IngestError(f"no variable(s) {unknown}; the variables are {sorted({v for v, _ in available})} and "
                              f"the channels "
                              f"{[c.name for c in all_channels]}")
        all_channels = picked
    kept_levels: dict = {}
    for c in all_channels:
        if c.hpa is not None:
            kept_levels.setdefault(c.variable, []).append(c.hpa)
    return all_channels, kept_levels, {c.name: attrs[c.name] for c in all_channels}


def _told_apart(channels: list[Channel], attrs: dict, groups) -> tuple[list[Channel], dict]:
    """Channels of one name from two GRIB hypercubes (an instantaneous and an averaged field of one parameter,
    say) named apart by the first key their hypercubes differ in (``t2m_avg``); each channel's attrs by name."""
    from dataclasses import replace

    out, by_name = [], {}
    for c in channels:
        same = [o for o in channels if o.name == c.name and o.group != c.group]
        name, mine = c.name, dict(groups[c.group][0].part)
        if same:
            differs = [k for k in mine if k != "paramId" and
                       any(dict(groups[o.group][0].part).get(k) != mine[k] for o in same)]
            if differs:
                name = f"{c.name}_{mine[differs[0]]}"
        out.append(replace(c, name=name))
        by_name[name] = attrs[c.name, c.group] if name == c.name else {**attrs[c.name, c.group],
                                                                        "source_variable": c.variable}
    return out, by_name
