"""Raw CFD run-folder recipes: where a run's files are, which arrays become which stored fields, and how
they are made dimensionless. ``domainflow ingest cfd RAW STORE --recipe NAME|recipe.yaml``.

A recipe is a YAML mapping (the built-ins below have the same form; ``domainflow ingest cfd --show-recipe
NAME`` prints one as a template)::

    name: my-openfoam-cases
    runs: case_{i}                      # run folders under RAW; {i} is the run number (or a glob: case*)
    files:                              # per location, inside the run folder (subfolders allowed, {i} optional):
                                        # a .vtu/.vtp or its .part pieces (name.00.part, ...), streamed in
                                        # bounded memory; a legacy .vtk or a .pvtu/.pvtp, read whole by VTK
      surface: boundary_{i}.vtp         # polygons: PolyData, or an UnstructuredGrid of 2-D cells
      volume: internal_{i}.vtu
    # blocks: {surface: [boundary]}     # a location given as a .vtm (foamToVTK's VTK/<case>_<step>.vtm): the data
                                        # sets or blocks that make it, read whole by VTK and merged in order
    csv:                                # optional one-row CSVs kept in the run's attrs (forces, geometry)
      forces_constref: forces_{i}.csv   # the constant-reference coefficients (cd, cl) the metrics compare with
      geometry: params_{i}.csv          # design parameters (the model's globals)
    optional_csv: [geometry]            # CSVs a run may lack
    data: {surface: point, volume: cell}   # where the arrays live (default cell)
    reference: {u_inf: 10.0, rho_inf: 1.0, p_inf: 0.0, l_ref: 1.0}
    fields:
      surface:
        - {name: Cp, source: p, quantity: pressure}
        - {name: Cf, source: wallShearStress, components: 3, quantity: shear}
      volume:
        - {name: U, source: [Ux, Uy, Uz], quantity: velocity}   # scalar arrays stacked into components
    cp_check: {surface: CpMean}          # optional: the file's own Cp, compared with ours (warns on a mismatch)
    forces: {drag: x, lift: z, reference_area: 0.112}   # the axes and area of the force coefficients (m^2)

Quantities and their scaling (stored = (raw - offset) / scale, recorded per field in the store):
``pressure`` (q_inf, p_inf), ``shear`` (q_inf), ``pressure_variance`` (q_inf^2), ``velocity`` (U_inf),
``viscosity`` (U_inf * L_ref), ``coefficient`` (already dimensionless: stored as read), ``as_read`` (stored
unchanged, with the units the field gives: ``{name: T, source: T, quantity: as_read, units: K}``).

Point data: each stored row is a cell (the store's rows are cells, with centres, normals and areas), so
a field given on points is averaged to cells: a cell's value is the mean of its vertices' values, as
VTK's ``vtkPointDataToCellData`` computes it (the whole-file path, ``reader="vtk"``, uses that filter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import IngestError
from .reference import Reference

LOCATIONS = ("surface", "volume")
QUANTITIES = ("pressure", "shear", "pressure_variance", "velocity", "viscosity", "coefficient", "as_read")
ASSOCIATIONS = ("cell", "point")


@dataclass(frozen=True)
class FieldSpec:
    """A stored field: its name, the raw array(s) it comes from (one array, or scalar arrays stacked as its
    components), components, how it is made dimensionless, and whether it lives on cells or points."""

    name: str
    sources: tuple[str, ...]
    components: int
    quantity: str  # one of QUANTITIES
    association: str = "cell"
    units: str = "1"  # what the stored values are in: "1" once made dimensionless; the recipe's for as_read

    @property
    def source(self) -> str:
        return self.sources[0] if len(self.sources) == 1 else "+".join(self.sources)

    def scale_offset(self, ref: Reference) -> tuple[float, float]:
        """stored = (raw - offset) / scale."""
        q = ref.q_inf
        return {"pressure": (q, ref.p_inf), "shear": (q, 0.0), "pressure_variance": (q * q, 0.0),
                "velocity": (ref.u_inf, 0.0), "viscosity": (ref.u_inf * ref.l_ref, 0.0),
                "coefficient": (1.0, 0.0), "as_read": (1.0, 0.0)}[self.quantity]

    def attrs(self, location: str, ref: Reference) -> dict:
        scale, offset = self.scale_offset(ref)
        return {"location": location, "components": self.components, "units": self.units, "source": self.source,
                "association": self.association, "quantity": self.quantity, "scale": scale, "offset": offset}


@dataclass(frozen=True)
class Recipe:
    """A raw data set's run-folder recipe (see the module docstring)."""

    name: str
    runs: str
    files: dict
    fields: dict  # location -> tuple[FieldSpec, ...]
    csv: dict = field(default_factory=dict)
    optional_csv: tuple[str, ...] = ()
    reference: Reference = Reference()
    cp_check: dict = field(default_factory=dict)  # location -> the file's own Cp array (optional)
    forces: dict = field(default_factory=lambda: dict(DEFAULT_FORCES))  # drag/lift axes, reference area
    source: str = ""  # where it was read from (a built-in's name or a file)
    openfoam: dict = field(default_factory=dict)  # run folders are OpenFOAM cases: {location: blocks, "time": t}
    blocks: dict = field(default_factory=dict)  # location -> names of the .vtm data sets or blocks it is made of

    def openfoam_read(self, loc: str) -> tuple | None:
        """(VTK OpenFOAM reader blocks, time) of ``loc`` when the runs are OpenFOAM cases, else None."""
        if not self.openfoam:
            return None
        return tuple(self.openfoam[loc]), self.openfoam.get("time")

    # -- run folders and files ------------------------------------------------------------------
    def run_pattern(self) -> re.Pattern:
        head, _, tail = self.runs.partition("{i}")
        return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"$")

    @property
    def runs_by_glob(self) -> bool:
        """``runs`` is a glob (``case*``, or one folder's name): the folders it matches, in name order, are runs
        0, 1, ...; else it holds ``{i}``, the run number."""
        return "{i}" not in self.runs

    def discover(self, raw: Path) -> dict[str, Path]:
        """``run_<i>`` -> the folder, for every folder of ``raw`` matching ``runs``, in numeric order (a glob:
        in name order, numbered from 0)."""
        raw = Path(raw)
        if not raw.is_dir():
            raise IngestError(f"raw data folder {raw} does not exist")
        if self.runs_by_glob:
            found = {f"run_{k}": p for k, p in enumerate(sorted((p for p in raw.glob(self.runs) if p.is_dir()),
                                                                 key=lambda p: p.name))}
            if found:
                return found
        pattern, found = self.run_pattern(), {}
        for p in raw.iterdir() if not self.runs_by_glob else ():
            m = pattern.match(p.name)
            if p.is_dir() and m:
                i = int(m.group(1))
                if f"run_{i}" in found:
                    raise IngestError(f"{raw}: folders {found[f'run_{i}'].name} and {p.name} are both run {i} "
                                      f"of recipe {self.name!r} ({self.runs})")
                found[f"run_{i}"] = p
        if not found:
            example = " ".join(sorted(p.name for p in raw.iterdir())[:5])
            raise IngestError(f"{raw} holds no run folders named {self.runs!r} (recipe {self.name!r}); it holds: "
                              f"{example or 'nothing'}. Pass the recipe of this data set (--recipe drivaerml, "
                              f"ahmedml, windsorml, openfoam or a recipe.yaml)")
        return dict(sorted(found.items(), key=lambda kv: int(kv[0][4:])))

    def files_of(self, run_dir: Path, run_id: str) -> dict[str, Path]:
        """The run's files by role: each location, then each CSV; ``{i}`` is the run number as the folder
        writes it (``run_007`` -> ``boundary_007.vtp``)."""
        m = None if self.runs_by_glob else self.run_pattern().match(Path(run_dir).name)
        i = m.group(1) if m else run_id[4:]
        return {**{k: Path(run_dir) / t.format(i=i) for k, t in self.files.items()},
                **{k: Path(run_dir) / t.format(i=i) for k, t in self.csv.items()}}

    def to_attrs(self) -> dict:
        """What the store records (and a resumed ingest compares)."""
        return {"name": self.name, "runs": self.runs, "files": dict(self.files), "csv": dict(self.csv),
                "optional_csv": list(self.optional_csv), "cp_check": dict(self.cp_check), "forces": dict(self.forces),
                **({"openfoam": dict(self.openfoam)} if self.openfoam else {}),
                **({"blocks": {k: list(v) for k, v in self.blocks.items()}} if self.blocks else {}),
                "fields": {loc: [{"name": s.name, "source": list(s.sources), "components": s.components,
                                  "quantity": s.quantity, "association": s.association,
                                  **({"units": s.units} if s.quantity == "as_read" else {})} for s in specs]
                           for loc, specs in self.fields.items()}}


# -- reading a recipe ---------------------------------------------------------------------------
def parse_recipe(data: dict, where: str) -> Recipe:
    """A Recipe from its mapping form; every mistake is one IngestError naming ``where`` and the key."""
    if not isinstance(data, dict):
        raise IngestError(f"recipe {where}: expected a mapping with keys runs, files, fields; got {type(data).__name__}")
    known = {"name", "runs", "files", "csv", "optional_csv", "data", "reference", "fields", "cp_check", "forces",
             "openfoam", "blocks"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise IngestError(f"recipe {where}: unknown key(s) {unknown}; the keys are {sorted(known)}")
    openfoam = _openfoam(data, where)
    if openfoam:
        if "files" in data:
            raise IngestError(f"recipe {where}: give files or openfoam, not both (openfoam reads each run folder as "
                              f"an OpenFOAM case)")
        data = {**data, "files": {loc: "system/controlDict" for loc in LOCATIONS if loc in openfoam}}
    for key in ("runs", "files", "fields"):
        if key not in data:
            raise IngestError(f"recipe {where}: '{key}' is missing (see `domainflow ingest cfd --show-recipe drivaerml`)")
    runs = str(data["runs"])
    if runs.count("{i}") > 1 or "/" in runs or not runs.strip():
        raise IngestError(f"recipe {where}: runs={runs!r} must name a folder with one '{{i}}' for the run number, "
                          f"e.g. run_{{i}}, or be a glob of folder names, e.g. case* (runs 0, 1, ... in name order)")
    _check_template(runs, f"recipe {where}: runs", need_i="{i}" in runs)
    files = _mapping(data, "files", where)
    bad = sorted(set(files) - set(LOCATIONS))
    if bad or not files:
        raise IngestError(f"recipe {where}: files has location(s) {bad or 'none'}; use surface and/or volume")
    csv = {str(k): str(v) for k, v in _mapping(data, "csv", where).items()}
    clash = sorted(set(csv) & RESERVED_ATTRS)
    if clash:
        raise IngestError(f"recipe {where}: csv key(s) {clash} are names a run's attrs already use; rename them")
    for key, template in [*files.items(), *csv.items()]:
        _check_template(str(template), f"recipe {where}: {key} file", need_i=False, subfolders=True)
    blocks = _blocks(data, files, where)
    optional = tuple(str(x) for x in data.get("optional_csv", []) or [])
    if set(optional) - set(csv):
        raise IngestError(f"recipe {where}: optional_csv {sorted(set(optional) - set(csv))} are not csv keys {sorted(csv)}")
    assoc = data.get("data", "cell")
    if not isinstance(assoc, (str, dict)):
        raise IngestError(f"recipe {where}: data must be cell, point or a mapping per location, got {assoc!r}")
    if isinstance(assoc, dict):
        _only_locations(assoc, files, f"recipe {where}: data")
    assoc = {loc: assoc for loc in files} if isinstance(assoc, str) else {**{loc: "cell" for loc in files}, **assoc}
    for loc, a in assoc.items():
        if a not in ASSOCIATIONS:
            raise IngestError(f"recipe {where}: data.{loc}={a!r} is not one of {list(ASSOCIATIONS)}")
    fields_in = _mapping(data, "fields", where)
    _only_locations(fields_in, files, f"recipe {where}: fields")
    fields = {}
    for loc in files:
        specs = fields_in.get(loc)
        if specs is not None and not isinstance(specs, list):
            raise IngestError(f"recipe {where}: fields.{loc} must be a list of fields, got {specs!r}")
        if not specs:
            raise IngestError(f"recipe {where}: fields.{loc} is missing: list the fields to store for the {loc}")
        fields[loc] = tuple(_field(s, loc, assoc[loc], f"{where} fields.{loc}[{k}]") for k, s in enumerate(specs))
        names = [s.name for s in fields[loc]]
        if len(set(names)) != len(names):
            raise IngestError(f"recipe {where}: fields.{loc} names a field twice: {names}")
    ref_in = _mapping(data, "reference", where)
    bad = sorted(set(ref_in) - {"u_inf", "rho_inf", "p_inf", "l_ref"})
    if bad:
        raise IngestError(f"recipe {where}: reference has unknown key(s) {bad}; use u_inf, rho_inf, p_inf, l_ref")
    try:
        reference = Reference(**{k: float(v) for k, v in ref_in.items()})
    except (TypeError, ValueError) as exc:
        raise IngestError(f"recipe {where}: reference: {exc}") from None
    cp_check = {str(k): str(v) for k, v in _mapping(data, "cp_check", where).items()}
    _only_locations(cp_check, files, f"recipe {where}: cp_check")
    return Recipe(name=str(data.get("name", Path(where).stem)), runs=runs, files={k: str(v) for k, v in files.items()},
                  fields=fields, csv=csv, optional_csv=optional, reference=reference, cp_check=cp_check,
                  forces=_forces(_mapping(data, "forces", where), where), source=where, openfoam=openfoam,
                  blocks=blocks)


def _blocks(data: dict, files: dict, where: str) -> dict:
    """The recipe's ``blocks``: for each location given as a ``.vtm``, the names of the data sets or blocks it
    is made of (a block's name takes every data set inside it); required for a .vtm, refused for other files."""
    spec = _mapping(data, "blocks", where)
    _only_locations(spec, files, f"recipe {where}: blocks")
    out = {}
    for loc, template in files.items():
        vtm = str(template).lower().endswith(".vtm")
        names = spec.get(loc)
        if vtm and not names:
            raise IngestError(f"recipe {where}: {loc} file {template!r} is a .vtm multi-block index; name the data "
                              f"sets or blocks of the {loc} with blocks: {{{loc}: [...]}} (foamToVTK's: internal, "
                              f"boundary, or patch names)")
        if names and not vtm:
            raise IngestError(f"recipe {where}: blocks.{loc} selects blocks of a .vtm, but the {loc} file is "
                              f"{template!r}")
        if names:
            if isinstance(names, str):
                names = [names]
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise IngestError(f"recipe {where}: blocks.{loc} must be a list of block names, got {names!r}")
            out[loc] = tuple(names)
    return out


def _openfoam(data: dict, where: str) -> dict:
    """The recipe's ``openfoam`` mapping: ``surface`` (patch names, merged into one surface), ``volume``
    (``internalMesh``, or true) and ``time`` (a time folder's value; ``latest``, the default)."""
    spec = data.get("openfoam")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or not set(spec) & set(LOCATIONS):
        raise IngestError(f"recipe {where}: openfoam must be a mapping naming surface patches and/or the volume, "
                          f"e.g. {{surface: [lowerWall, upperWall], volume: internalMesh, time: latest}}")
    unknown = sorted(set(spec) - {*LOCATIONS, "time"})
    if unknown:
        raise IngestError(f"recipe {where}: openfoam has unknown key(s) {unknown} (surface, volume, time)")
    out = {}
    if "surface" in spec:
        patches = [spec["surface"]] if isinstance(spec["surface"], str) else list(spec["surface"] or [])
        if not patches or not all(isinstance(p_, str) and p_ for p_ in patches):
            raise IngestError(f"recipe {where}: openfoam.surface must name the patches that make the surface")
        out["surface"] = [p_ if p_.startswith(("patch/", "group/")) else f"patch/{p_}" for p_ in patches]
    if "volume" in spec:
        if spec["volume"] not in (True, "internalMesh"):
            raise IngestError(f"recipe {where}: openfoam.volume is internalMesh (or true), got {spec['volume']!r}")
        out["volume"] = ["internalMesh"]
    time = spec.get("time", "latest")
    if time != "latest":
        try:
            time = float(time)
        except (TypeError, ValueError):
            raise IngestError(f"recipe {where}: openfoam.time is latest or a time value, got {time!r}") from None
    out["time"] = None if time == "latest" else time
    return out


DEFAULT_FORCES = {"drag": "x", "lift": "z", "reference_area": None}


def _forces(spec: dict, where: str) -> dict:
    """The force coefficients' drag and lift axes (x, y or z) and reference area (m^2; None: the train config's)."""
    bad = sorted(set(spec) - set(DEFAULT_FORCES))
    if bad:
        raise IngestError(f"recipe {where}: forces has unknown key(s) {bad}; use drag, lift, reference_area")
    out = {**DEFAULT_FORCES, **spec}
    for k in ("drag", "lift"):
        if out[k] not in ("x", "y", "z"):
            raise IngestError(f"recipe {where}: forces.{k} must be x, y or z, got {out[k]!r}")
    if out["drag"] == out["lift"]:
        raise IngestError(f"recipe {where}: forces.drag and forces.lift are both {out['drag']!r}")
    area = out["reference_area"]
    if area is not None:
        try:
            area = float(area)
        except (TypeError, ValueError):
            area = -1.0
        if not area > 0:
            raise IngestError(f"recipe {where}: forces.reference_area must be a positive area in m^2, got "
                              f"{out['reference_area']!r}")
    out["reference_area"] = area
    return out


# attrs every run's group holds: a CSV of the same name would overwrite one
RESERVED_ATTRS = frozenset({"run", "run_id", "fingerprint", "folder", "cells", "stats", "complete", "U_inf", "rho_inf",
                            "p_inf", "L_ref", "q_inf"})


def _check_template(template: str, what: str, need_i: bool = True, subfolders: bool = False) -> None:
    """A name with ``{i}`` (the run number) at most once (exactly once where ``need_i``) and no other field; a
    file's may name a subfolder of the run folder (``VTK/internal.vtu``), never one outside it."""
    import string

    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise IngestError(f"{what} {template!r} is not a valid name pattern ({exc})") from None
    if names.count("i") > 1 or (need_i and names.count("i") != 1) or set(names) - {"i"}:
        raise IngestError(f"{what} {template!r} must hold '{{i}}' (the run number) {'once' if need_i else 'at most once'} "
                          f"and no other {{...}} field, e.g. boundary_{{i}}.vtp")
    parts = Path(template).parts
    if ("/" in template and not subfolders) or Path(template).is_absolute() or ".." in parts:
        raise IngestError(f"{what} {template!r} must be a path inside the run folder"
                          + (" (subfolders allowed, no '..')" if subfolders else " (a name, no '/')"))


def _only_locations(mapping: dict, files: dict, what: str) -> None:
    bad = sorted(str(k) for k in mapping if k not in files)
    if bad:
        raise IngestError(f"{what} names {bad}, which the recipe's files do not have (it has {sorted(files)})")


def _mapping(data: dict, key: str, where: str) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise IngestError(f"recipe {where}: '{key}' must be a mapping, got {value!r}")
    return value


def _field(spec, loc: str, association: str, where: str) -> FieldSpec:
    if not isinstance(spec, dict) or "name" not in spec or "source" not in spec or "quantity" not in spec:
        raise IngestError(f"recipe {where}: a field needs name, source and quantity, got {spec!r}")
    unknown = sorted(set(spec) - {"name", "source", "components", "quantity", "data", "units"})
    if unknown:
        raise IngestError(f"recipe {where}: unknown key(s) {unknown} (name, source, components, quantity, data, "
                          f"units)")
    sources = tuple(spec["source"]) if isinstance(spec["source"], (list, tuple)) else (str(spec["source"]),)
    if not sources or not all(isinstance(s, str) and s for s in sources):
        raise IngestError(f"recipe {where}: source must be an array name or a list of scalar array names")
    try:
        components = int(spec.get("components", len(sources)))
    except (TypeError, ValueError):
        raise IngestError(f"recipe {where}: components must be a whole number, got {spec.get('components')!r}") from None
    if len(sources) > 1 and components != len(sources):
        raise IngestError(f"recipe {where}: {len(sources)} scalar sources make {len(sources)} components, not {components}")
    if components < 1:
        raise IngestError(f"recipe {where}: components must be >= 1, got {components}")
    if spec["quantity"] not in QUANTITIES:
        raise IngestError(f"recipe {where}: quantity {spec['quantity']!r} is not one of {list(QUANTITIES)}")
    association = spec.get("data", association)
    if association not in ASSOCIATIONS:
        raise IngestError(f"recipe {where}: data={association!r} is not one of {list(ASSOCIATIONS)}")
    units = spec.get("units")
    if spec["quantity"] == "as_read":
        if not isinstance(units, str) or not units.strip():
            raise IngestError(f"recipe {where}: field {spec['name']!r} is stored as read: give its units "
                              f"(units: K, units: m/s, units: 1 for a dimensionless one)")
    elif units is not None and str(units) != "1":
        raise IngestError(f"recipe {where}: field {spec['name']!r} has units {units!r}, but quantity "
                          f"{spec['quantity']!r} is made dimensionless (units 1); use quantity: as_read to keep "
                          f"the values and their units")
    return FieldSpec(str(spec["name"]), sources, components, spec["quantity"], association,
                     units.strip() if spec["quantity"] == "as_read" else "1")


def load_recipe(name_or_path, reference: Reference | None = None) -> Recipe:
    """A built-in recipe by name, or one read from a YAML file; ``reference`` (given on the command line)
    replaces the recipe's reference values."""
    if isinstance(name_or_path, Recipe):
        recipe = name_or_path
    elif str(name_or_path) in BUILTIN:
        recipe = parse_recipe(BUILTIN[str(name_or_path)], str(name_or_path))
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise IngestError(f"--recipe {name_or_path}: neither a built-in recipe ({sorted(BUILTIN)}) nor a file")
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise IngestError(f"--recipe {path}: not a readable YAML file ({str(exc).splitlines()[0]})") from None
        recipe = parse_recipe(data, str(path))
    if reference is not None:
        from dataclasses import replace

        recipe = replace(recipe, reference=reference)
    return recipe


def show_recipe(name: str) -> str:
    """A built-in recipe as YAML (a template for a recipe file of one's own)."""
    import yaml

    if name not in BUILTIN:
        raise IngestError(f"--show-recipe {name}: not a built-in recipe; the built-ins are {sorted(BUILTIN)}")
    notes = {"openfoam": "OpenFOAM case folders (serial or decomposed), through VTK's OpenFOAM reader",
             "drivaerml": "DrivAerML (Ashton et al. 2024, arXiv:2408.11969; huggingface.co/datasets/neashton/drivaerml)",
             "ahmedml": "AhmedML (Ashton et al. 2024, arXiv:2407.20801; huggingface.co/datasets/neashton/ahmedml)",
             "windsorml": "WindsorML (Ashton et al. 2024, arXiv:2407.19320; huggingface.co/datasets/neashton/windsorml)"}
    return f"# {notes[name]}\n" + yaml.safe_dump(BUILTIN[name], sort_keys=False, default_flow_style=None)


# -- the built-ins ----------------------------------------------------------------------------------
# Names from the data sets' own cards and files (neilashton/caemldatasets, the Hugging Face trees, NVIDIA
# physicsnemo-curator's readers, neilashton/fluidsbench-submission's PRESSURE_REFERENCES.md and
# reference/windsorml/contract.py); the note of issue 18 lists what was confirmed where.
BUILTIN = {
    # any OpenFOAM case (incompressible: kinematic p, rho = 1) per run folder, read through VTK's OpenFOAM reader at
    # its latest time: the surface is every wall patch (OpenFOAM's patch group "wall"), the volume the internal
    # mesh; U_inf and L_ref are the case's own (--u-inf, --l-ref); more fields (wallShearStress, nut, k, omega,
    # T as_read with units K) in a recipe of one's own: `--show-recipe openfoam` is its template
    "openfoam": {
        "name": "openfoam",
        "runs": "*",
        "openfoam": {"surface": ["group/wall"], "volume": "internalMesh", "time": "latest"},
        "data": "cell",
        "reference": {"u_inf": 1.0, "rho_inf": 1.0, "p_inf": 0.0, "l_ref": 1.0},
        "fields": {
            "surface": [{"name": "Cp", "source": "p", "quantity": "pressure"}],
            "volume": [{"name": "U", "source": "U", "components": 3, "quantity": "velocity"},
                       {"name": "Cp", "source": "p", "quantity": "pressure"}]},
    },
    # OpenFOAM (incompressible): kinematic p and wall shear (rho = 1), time averages over a trimmed window,
    # all CELL data; U = 38.889 m/s (140 km/h); the volume ships as volume_<i>.vtu.00.part, .01.part
    "drivaerml": {
        "name": "drivaerml",
        "runs": "run_{i}",
        "files": {"surface": "boundary_{i}.vtp", "volume": "volume_{i}.vtu"},
        "csv": {"forces": "force_mom_{i}.csv", "forces_constref": "force_mom_constref_{i}.csv",
                "geometry": "geo_parameters_{i}.csv"},
        "data": "cell",
        "reference": {"u_inf": 38.889, "rho_inf": 1.0, "p_inf": 0.0, "l_ref": 2.786},
        "fields": {
            "surface": [{"name": "Cp", "source": "pMeanTrim", "quantity": "pressure"},
                        {"name": "Cf", "source": "wallShearStressMeanTrim", "components": 3, "quantity": "shear"},
                        {"name": "CpPrime2", "source": "pPrime2MeanTrim", "quantity": "pressure_variance"}],
            "volume": [{"name": "U", "source": "UMeanTrim", "components": 3, "quantity": "velocity"},
                       {"name": "Cp", "source": "pMeanTrim", "quantity": "pressure"},
                       {"name": "nut", "source": "nutMeanTrim", "quantity": "viscosity"}]},
        "cp_check": {"surface": "CpMeanTrim"},
        "forces": {"drag": "x", "lift": "z", "reference_area": 2.15},  # force_mom_constref's constant area
    },
    # OpenFOAM: kinematic pMean (outlet 0), U = 1 m/s, rho = 1 (so Cp = 2 pMean), CELL data; force_mom_<i>.csv
    # uses the constant reference area, force_mom_varref_<i>.csv each body's own; geo_parameters is missing
    # for run 500; the Ahmed body is 1.044 m long
    "ahmedml": {
        "name": "ahmedml",
        "runs": "run_{i}",
        "files": {"surface": "boundary_{i}.vtp", "volume": "volume_{i}.vtu"},
        "csv": {"forces_constref": "force_mom_{i}.csv", "forces": "force_mom_varref_{i}.csv",
                "geometry": "geo_parameters_{i}.csv"},
        "optional_csv": ["geometry"],
        "data": "cell",
        "reference": {"u_inf": 1.0, "rho_inf": 1.0, "p_inf": 0.0, "l_ref": 1.044},
        "fields": {
            "surface": [{"name": "Cp", "source": "pMean", "quantity": "pressure"},
                        {"name": "Cf", "source": "wallShearStressMean", "components": 3, "quantity": "shear"}],
            "volume": [{"name": "U", "source": "UMean", "components": 3, "quantity": "velocity"},
                       {"name": "Cp", "source": "pMean", "quantity": "pressure"},
                       {"name": "nut", "source": "nutMean", "quantity": "viscosity"}]},
        "cp_check": {"surface": "static(p)_coeffMean"},
        # the Ahmed body's frontal area, 0.389 m x 0.288 m (force_mom_<i>.csv's constant reference); z up
        "forces": {"drag": "x", "lift": "z", "reference_area": 0.112},
    },
    # Volcano ScaLES (WMLES): the surface is boundary_<i>.vtu (polygons) with POINT data coefficients
    # cpavg and cfxavg/cfyavg/cfzavg; the volume has CELL data velocity{x,y,z}avg and absolute pressureavg
    # (p_ref 37330.4 Pa, rho 1.31 kg/m^3, U 40 m/s); runs start at run_0; +y is up (lift is Cf_y); the body
    # length 1.044 m is not in the files (no stored field uses l_ref: it scales only nu_t)
    "windsorml": {
        "name": "windsorml",
        "runs": "run_{i}",
        "files": {"surface": "boundary_{i}.vtu", "volume": "volume_{i}.vtu"},
        "csv": {"forces_constref": "force_mom_{i}.csv", "forces": "force_mom_varref_{i}.csv",
                "geometry": "geo_parameters_{i}.csv"},
        "data": {"surface": "point", "volume": "cell"},
        "reference": {"u_inf": 40.0, "rho_inf": 1.31, "p_inf": 37330.4, "l_ref": 1.044},
        "fields": {
            "surface": [{"name": "Cp", "source": "cpavg", "quantity": "coefficient"},
                        {"name": "Cf", "source": ["cfxavg", "cfyavg", "cfzavg"], "quantity": "coefficient"}],
            "volume": [{"name": "U", "source": ["velocityxavg", "velocityyavg", "velocityzavg"],
                        "quantity": "velocity"},
                       {"name": "Cp", "source": "pressureavg", "quantity": "pressure"}]},
        "forces": {"drag": "x", "lift": "y", "reference_area": 0.112},  # +y is up
    },
}
