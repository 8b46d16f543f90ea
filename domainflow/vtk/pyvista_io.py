"""What goes through pyvista/VTK itself: reading a data set file of any format VTK reads (VTK XML, legacy
``.vtk``, ...) with only the arrays asked for (:func:`read_dataset`), cell arrays with point data averaged to
the cells (:func:`read_cells`), and the geometry VTK's filters give: a surface's cell centres, normals and
areas (:func:`surface_geometry`, :func:`as_polydata`), cell centres (:func:`cell_centres`).

Used by ingest's in-memory path (``reader="vtk"``), ``read_vtk`` of a monolithic file and predict's raw
surface; bounded-memory reads of VTK XML go through :mod:`domainflow.vtk.xml_reader` instead. Every read runs
with VTK's printing off under pyvista's error catcher (:mod:`domainflow.vtk.errors`): a corrupt or truncated
file is a :class:`VtkFileError` naming it. pyvista is imported on first use, never with this module.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import MissingArraysError, VtkFileError, first_line, quiet_vtk, raise_caught


def read_dataset(path, arrays: dict | None = None, association: str | None = None, optional=(),
                 shown_as=None, fix: str | None = None, openfoam: tuple | None = None, blocks=None,
                 allow_empty: bool = False):
    """Read one data set file; returns (dataset, {name: "cell" | "point"} of the arrays asked for and found).

    ``arrays``: {name: "cell" | "point"} to read; where the file's reader can select arrays, only those and
    those of ``optional`` that exist (as cell data, else as point data) are read. A missing one is a
    :class:`MissingArraysError` (``fix``: what its hint tells the user to do). None: every array (every one of
    ``association`` only, where given and the reader can select). ``shown_as``: the name used in errors (the
    original file when ``path`` is a joined temporary). ``openfoam``: (blocks, time): ``path`` is an OpenFOAM case
    folder, read by VTK's own OpenFOAM reader (:func:`openfoam_reader`). ``blocks``: ``path`` is a ``.vtm`` index,
    of which the data sets with these names or inside blocks of these names are read and merged in order.
    ``allow_empty``: blocks without cells are no error (a patch one processor of a decomposed case lacks)."""
    import pyvista as pv

    if blocks is not None:
        return _vtm_blocks(path, blocks, arrays, association, optional, shown_as, fix)

    quiet_vtk()
    name = shown_as or path
    wanted = dict(arrays or {})
    with pv.VtkErrorCatcher(raise_errors=False, send_to_logging=False) as caught:
        try:
            reader = _reader(Path(path)) if openfoam is None else openfoam_reader(Path(path), *openfoam)
        except VtkFileError:
            raise
        except Exception as exc:  # unknown extension, unreadable file
            raise VtkFileError(f"{name}: cannot be read as VTK ({first_line(exc)})") from None
        raise_caught(caught, name)
        selects = hasattr(reader, "disable_all_cell_arrays")  # XML readers do; the legacy .vtk reader does not
        if selects:
            try:
                present = {"cell": list(reader.cell_array_names), "point": list(reader.point_array_names)}
            except Exception as exc:
                raise VtkFileError(f"{name}: cannot be read as VTK ({first_line(exc)})") from None
            raise_caught(caught, name)
            if arrays is not None:
                wanted = _resolve(name, wanted, optional, present, fix)
            if arrays is not None or association is not None:
                reader.disable_all_cell_arrays()
                reader.disable_all_point_arrays()
                chosen = wanted if arrays is not None else dict.fromkeys(present[association], association)
                for a, kind in chosen.items():
                    (reader.enable_cell_array if kind == "cell" else reader.enable_point_array)(a)
        try:
            mesh = reader.read()
        except Exception as exc:
            raise VtkFileError(f"{name}: corrupt or truncated VTK file ({first_line(exc)})") from None
        raise_caught(caught, name)
        if openfoam is not None:
            mesh = _one_dataset(mesh, name, allow_empty)
    if mesh is None:
        raise VtkFileError(f"{name}: VTK read no cells; the file is empty, truncated or not a mesh")
    if not hasattr(mesh, "n_cells") or not hasattr(mesh, "points"):
        raise VtkFileError(f"{name}: did not give one dataset (got {type(mesh).__name__}); multi-block data "
                           f"belongs in a .vtm index")
    if arrays is not None and not selects:
        wanted = _resolve(name, wanted, optional, {"cell": list(mesh.cell_data.keys()),
                                                   "point": list(mesh.point_data.keys())}, fix)
    return mesh, wanted


def _reader(path: Path):
    """pyvista's reader of ``path``; a ``.pvtp`` (VTK's parallel PolyData pieces, which ``pv.get_reader`` does not
    know) through VTK's ``vtkXMLPPolyDataReader``, with pyvista's array selection as for a ``.pvtu``."""
    import pyvista as pv

    if path.suffix.lower() != ".pvtp":
        return pv.get_reader(str(path))
    from pyvista.core.utilities.reader import BaseReader, PointCellDataSelection
    from vtkmodules.vtkIOXML import vtkXMLPPolyDataReader

    class XMLPPolyDataReader(BaseReader, PointCellDataSelection):
        _vtk_class = vtkXMLPPolyDataReader  # not in pyvista's VTK class table, so not by name

    return XMLPPolyDataReader(str(path))


def openfoam_pieces(case: Path) -> list[Path]:
    """The ``processorN/`` folders of a decomposed OpenFOAM case, in processor order, when its times are there
    (``decomposePar`` and a parallel run, no ``reconstructPar``: the processors hold a later time than the case
    folder); [] for a case read as one."""
    procs = sorted((p for p in case.glob("processor[0-9]*") if p.is_dir() and p.name[len("processor"):].isdigit()),
                   key=lambda p: int(p.name[len("processor"):]))  # (not a stray processor1.bak)
    return procs if procs and _latest_time(procs[0]) > _latest_time(case) else []


def openfoam_pieces_time(case: Path, pieces: list[Path], time=None) -> float:
    """The time to read every processor of a decomposed case at: ``time``, or the latest, which every processor
    must hold (processors whose latest times differ are a parallel run's last write left incomplete)."""
    numbers = [int(p.name[len("processor"):]) for p in pieces]
    wanted = _subdomains(case)
    if numbers != list(range(len(numbers))) or wanted not in (None, len(numbers)):
        raise VtkFileError(f"{case}: processor folders {numbers} are not processor0..processor{(wanted or len(numbers)) - 1}"
                           f"{f' (decomposeParDict: numberOfSubdomains {wanted})' if wanted else ''}; a processor "
                           f"folder is missing, so would its cells be")
    if time not in (None, "latest"):
        return float(time)
    latest = {p.name: _latest_time(p) for p in pieces}
    if len(set(latest.values())) > 1:
        listed = ", ".join(f"{k}: {v:g}" for k, v in latest.items())
        raise VtkFileError(f"{case}: the processors' latest times differ ({listed}); the parallel run's last write "
                           f"is incomplete. Set the recipe's openfoam time: to a time every processor holds")
    return next(iter(latest.values()))


def _subdomains(case: Path):
    """``numberOfSubdomains`` of the case's ``system/decomposeParDict`` (None without one)."""
    import re

    try:
        found = re.search(r"^\s*numberOfSubdomains\s+(\d+)\s*;", (case / "system" / "decomposeParDict").read_text(),
                          re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def openfoam_group_patches(pieces: list[Path], group: str, time: float) -> list[str]:
    """The patches (``patch/<name>``) of ``group`` (``group/wall``) with cells on any processor, in the case's
    patch order (what VTK's merged reading of the group gives, patch after patch)."""
    import pyvista as pv

    names = set()
    order = None
    for piece in pieces:
        reader = openfoam_reader(piece, [group], time)
        order = order or [n[len("patch/"):] for n in reader.patch_array_names if n.startswith("patch/")]
        quiet_vtk()
        with pv.VtkErrorCatcher(raise_errors=False, send_to_logging=False) as caught:
            blocks = reader.read()
        raise_caught(caught, piece)

        def walk(b, name):
            if isinstance(b, pv.MultiBlock):
                for k in range(b.n_blocks):
                    walk(b[k], b.get_block_name(k))
            elif b is not None and b.n_cells:
                names.add(name)
        walk(blocks, None)
    return [f"patch/{n}" for n in order if n in names]


def _latest_time(folder: Path) -> float:
    """The latest OpenFOAM time folder's time (-1 without one)."""
    times = [-1.0]
    for p in folder.iterdir():
        try:
            times.append(float(p.name))
        except ValueError:
            continue
    return max(times)


def _is_piece(case: Path) -> bool:
    return case.name.startswith("processor") and (case.parent / "system" / "controlDict").is_file()


def openfoam_reader(case: Path, blocks, time=None):
    """VTK's OpenFOAM reader (pyvista's ``POpenFOAMReader``) of the case folder ``case`` (its
    ``system/controlDict``; no ``.foam`` file needed), set to read ``blocks`` (``internalMesh``, or
    ``patch/<name>``: several patches give one surface), cell data only, at ``time`` (None: the latest). A
    decomposed case (:func:`openfoam_pieces`) is read through its processors, merged by VTK (the whole mesh in
    memory); ``case`` may also be one ``processorN/`` folder of it, read alone (VTK reads it as a case of its own,
    through a scratch folder of links beside a ``.foam`` file, which lives as long as the reader)."""
    import tempfile
    import weakref

    import pyvista as pv

    control = case / "system" / "controlDict"
    scratch = None
    if _is_piece(case):
        scratch = tempfile.TemporaryDirectory(prefix="domainflow-foam-")
        for entry in case.iterdir():
            (Path(scratch.name) / entry.name).symlink_to(entry.resolve())
        control = Path(scratch.name) / "piece.foam"
        control.touch()
    elif not control.is_file():
        raise VtkFileError(f"{case}: not an OpenFOAM case (no system/controlDict)")
    reader = pv.POpenFOAMReader(str(control))
    if scratch is not None:  # the links live as long as the reader (pyvista's readers take no attributes)
        weakref.finalize(reader, scratch.cleanup)
    if scratch is None and openfoam_pieces(case):
        reader.case_type = "decomposed"
    times = list(reader.time_values)
    if not times:
        raise VtkFileError(f"{case}: OpenFOAM case without time folders")
    when = times[-1] if time in (None, "latest") else float(time)
    if not any(abs(t - when) <= 1e-9 * max(1.0, abs(when)) for t in times):
        raise VtkFileError(f"{case}: no time {time!r}; the case holds times {times}")
    reader.set_active_time_value(when)
    known = [n for n in reader.patch_array_names if "procBoundary" not in n]  # the processors' shared faces
    absent = [b for b in blocks if b not in known]
    if absent:
        raise VtkFileError(f"{case}: OpenFOAM case has no {absent}; it has {known}")
    reader.disable_all_patch_arrays()
    for b in blocks:
        reader.enable_patch_array(b)
    reader.cell_to_point_creation = False
    return reader


def _vtm_blocks(path, blocks, arrays, association, optional, shown_as, fix):
    """The data sets a .vtm lists under ``blocks``, each read as one file (its arrays checked), merged in the
    index's order into one data set (the store's rows: data set after data set)."""
    import pyvista as pv

    from .partitioned import index_pieces

    pieces, _, _ = index_pieces(str(path), list(blocks))
    meshes, found = [], None
    for piece in pieces:
        mesh, wanted = read_dataset(piece, arrays, association, optional, fix=fix)
        if found is not None and wanted != found:  # an optional array only some blocks hold
            raise VtkFileError(f"{shown_as or path}: block file {piece} holds the arrays {sorted(wanted)}, an earlier "
                               f"one {sorted(found)}; every block must hold the same")
        found = wanted
        meshes.append(mesh)
    return _one_dataset(pv.MultiBlock(meshes), shown_as or path), found


def _one_dataset(blocks, name, allow_empty: bool = False):
    """The data sets an OpenFOAM read gave (a multi-block tree), as one: itself, or several patches combined into
    one unstructured grid of polygons (the store's surface rows, patch after patch)."""
    import pyvista as pv

    leaves = []

    def walk(b):
        if isinstance(b, pv.MultiBlock):
            for k in range(b.n_blocks):
                if b[k] is not None:
                    walk(b[k])
        elif b is not None and b.n_cells:
            leaves.append(b)

    walk(blocks)
    if not leaves and allow_empty:
        return pv.PolyData()
    if not leaves:
        raise VtkFileError(f"{name}: the OpenFOAM blocks read hold no cells")
    return leaves[0] if len(leaves) == 1 else pv.MultiBlock(leaves).combine(merge_points=False)


def _resolve(name, wanted: dict, optional, present: dict, fix) -> dict:
    """``wanted`` checked against the arrays ``present``, plus the ``optional`` ones found (cell data first)."""
    absent = {a: kind for a, kind in wanted.items() if a not in present[kind]}
    if absent:
        raise MissingArraysError(name, absent, present, fix)
    for a in optional:
        if a not in wanted:
            if a in present["cell"]:
                wanted[a] = "cell"
            elif a in present["point"]:
                wanted[a] = "point"
    return wanted


def read_cells(path: Path, arrays, shown_as: Path | None = None, optional: tuple[str, ...] = (),
               fix: str | None = None, openfoam: tuple | None = None, blocks=None, allow_empty: bool = False):
    """Read a mesh keeping only the arrays ``arrays`` (names of CELL arrays, or {name: "cell" | "point"}; point
    arrays are averaged to cells by VTK's vtkPointDataToCellData) and those of ``optional`` that exist (cell
    data, or point data averaged); returns (mesh, {name: ndarray per cell}).

    ``shown_as`` is the name used in errors (the original file when ``path`` is a joined temporary); ``fix``
    ends the hint of a missing array's error (what the caller's user changes)."""
    name = shown_as or path
    wanted = dict(arrays) if isinstance(arrays, dict) else {a: "cell" for a in arrays}
    mesh, wanted = read_dataset(path, wanted, optional=optional, shown_as=name, fix=fix, openfoam=openfoam,
                                blocks=blocks, allow_empty=allow_empty)
    if mesh.n_cells == 0 and allow_empty:
        return mesh, {}
    if mesh.n_cells == 0:
        raise VtkFileError(f"{name}: VTK read no cells; the file is empty, truncated or not a mesh")
    if any(kind == "point" for kind in wanted.values()):
        averaged = mesh.point_data_to_cell_data(pass_point_data=False)
        for a, kind in wanted.items():
            if kind == "point":
                mesh.cell_data[a] = averaged.cell_data[a]
    out = {}
    for a in wanted:
        if a not in mesh.cell_data:
            raise VtkFileError(f"{name}: array {a!r} listed in the header but could not be read; the file is "
                               f"corrupt")
        values = np.asarray(mesh.cell_data[a])
        if len(values) != mesh.n_cells:
            raise VtkFileError(f"{name}: array {a!r} has {len(values)} values for {mesh.n_cells} cells")
        out[a] = values
    return mesh, out


def as_polydata(mesh, name):
    """A surface as PolyData: itself, or an UnstructuredGrid of polygons with its cells in their order (its
    data arrays are not carried over)."""
    import pyvista as pv

    if isinstance(mesh, pv.PolyData):
        return mesh
    types = np.asarray(mesh.celltypes)
    bad = np.flatnonzero(~np.isin(types, (5, 7, 9)))
    if len(bad):
        raise VtkFileError(f"{name}: a surface must consist of polygons only; cell {int(bad[0])} has VTK cell "
                           f"type {int(types[bad[0]])} (triangles 5, polygons 7 and quads 9 are surface cells)")
    offsets = np.asarray(mesh.cell_offsets if hasattr(type(mesh), "cell_offsets") else mesh.offset)
    faces = np.insert(np.asarray(mesh.cell_connectivity), offsets[:-1], np.diff(offsets))
    return pv.PolyData(np.asarray(mesh.points), faces=faces)


def surface_geometry(mesh, name) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cell centres, unit normals (from each polygon's own winding) and areas of a surface mesh (PolyData, or
    an UnstructuredGrid of polygons, taken as PolyData with its cells in their order)."""
    mesh = as_polydata(mesh, name)
    others = {"line": mesh.n_lines, "vertex": mesh.n_verts}
    if any(others.values()) or not mesh.n_cells:
        found = ", ".join(f"{n} {k} cells" for k, n in others.items() if n)
        raise VtkFileError(f"{name}: a surface must consist of polygons only, found {found or 'no cells'}")
    centres = cell_centres(mesh)
    with_normals = mesh.compute_normals(cell_normals=True, point_normals=False, split_vertices=False,
                                        consistent_normals=False, auto_orient_normals=False)
    if with_normals.n_cells != mesh.n_cells:
        raise VtkFileError(f"{name}: the surface holds non-polygon cells (normals changed the cell count "
                           f"{mesh.n_cells} -> {with_normals.n_cells}); the surface must be polygons only")
    normals = np.asarray(with_normals.cell_data["Normals"], dtype=np.float64)
    areas = np.asarray(mesh.compute_cell_sizes(length=False, area=True, volume=False).cell_data["Area"],
                       dtype=np.float64)
    if (areas <= 0).any():
        n = int((areas <= 0).sum())
        raise VtkFileError(f"{name}: {n} surface cells have zero or negative area; the mesh is degenerate")
    return centres, normals, areas


def cell_connectivity(mesh, surface: bool, name) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(points per cell, their point ids, the points, VTK cell types or None for polygons) of the cells that
    are a location's rows: a surface's polygons in :func:`as_polydata`'s order, a volume's cells."""
    from vtkmodules.util.numpy_support import vtk_to_numpy

    if surface:
        mesh = as_polydata(mesh, name)
        polys = mesh.GetPolys()
        if polys.GetNumberOfCells() != mesh.n_cells:
            raise VtkFileError(f"{name}: a surface must consist of polygons only; it holds {mesh.n_cells} cells of "
                               f"which {polys.GetNumberOfCells()} are polygons (triangle strips, lines or vertices)")
        offsets = vtk_to_numpy(polys.GetOffsetsArray()).astype(np.int64)
        return np.diff(offsets), vtk_to_numpy(polys.GetConnectivityArray()).astype(np.int64), \
            np.asarray(mesh.points), None
    offsets = np.asarray(mesh.cell_offsets if hasattr(type(mesh), "cell_offsets") else mesh.offset, dtype=np.int64)
    return np.diff(offsets), np.asarray(mesh.cell_connectivity, dtype=np.int64), np.asarray(mesh.points), \
        np.asarray(mesh.celltypes)


def cell_centres(mesh, dtype=np.float64) -> np.ndarray:
    """VTK's cell centres (its ``cell_centers`` filter) as an (N, 3) array of ``dtype``."""
    return np.asarray(mesh.cell_centers().points).astype(dtype, copy=False)
