"""Reading raw VTK files for ingest: only the named cell arrays, split ``.part`` files, clear errors.

VTK reports problems by printing, not raising; every read here runs under pyvista's error catcher so a
corrupt or truncated file becomes an :class:`IngestError` that names the file and what VTK said.
"""

from __future__ import annotations

import contextlib
import csv
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import IngestError

_PIECE = re.compile(r"\.(\d+)\.part$")


def _quiet_vtk():
    """Stop VTK printing to stderr; errors still reach the catcher, which raises them."""
    from vtkmodules.vtkCommonCore import vtkLogger, vtkObject

    vtkLogger.SetStderrVerbosity(vtkLogger.VERBOSITY_OFF)
    vtkObject.GlobalWarningDisplayOn()


def pieces_of(path: Path) -> list[Path]:
    """The byte pieces ``<name>.00.part, <name>.01.part, ...`` of a file shipped split, in order."""
    found = {}
    for p in path.parent.glob(path.name + ".*.part"):
        m = _PIECE.search(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        return []
    missing = [i for i in range(max(found) + 1) if i not in found]
    if missing:
        raise IngestError(f"{path}: split into .part files but piece(s) {missing} are missing "
                          f"(found {sorted(found)}); download the missing pieces")
    return [found[i] for i in sorted(found)]


def locate(path: Path) -> Path | None:
    """``path`` if it exists, else ``path`` if it exists split into pieces (returned as is), else None."""
    if path.exists() or pieces_of(path):
        return path
    return None


@contextlib.contextmanager
def whole_file(path: Path, scratch: Path | None = None):
    """Yield a readable path for ``path``; if it ships as ``.NN.part`` pieces, concatenate them (bytes,
    like ``cat``) into a temporary file that is removed afterwards."""
    path = Path(path)
    if path.exists():
        yield path
        return
    pieces = pieces_of(path)
    if not pieces:
        raise IngestError(f"{path} is missing (neither the file nor {path.name}.00.part pieces exist)")
    folder = Path(tempfile.mkdtemp(prefix="domainflow-parts-", dir=scratch))
    try:
        joined = folder / path.name
        with open(joined, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        _check_complete_xml(path, joined, pieces)
        yield joined
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_XML_TAIL = 4096  # bytes read from the end of a joined file: room for </VTKFile> and trailing whitespace


def _check_complete_xml(path: Path, joined: Path, pieces: list[Path]) -> None:
    """A VTK XML file joined from pieces must end with ``</VTKFile>``: pieces 00..k with no gap can still
    lack the last one(s), which VTK would report as a corrupt file. Reads only the head and the tail."""
    size = joined.stat().st_size
    with open(joined, "rb") as f:
        head = f.read(64)
        f.seek(max(0, size - _XML_TAIL))
        tail = f.read()
    check_pieces_complete(path, head, tail, pieces)


def check_pieces_complete(path: Path, head: bytes, tail: bytes, pieces: list[Path]) -> None:
    """Refuse a VTK XML file shipped as ``pieces`` whose joined bytes (``head``: the first 64, ``tail``: the
    last few KiB) do not end with ``</VTKFile>``, naming the piece(s) that seem to be missing."""
    head = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith((b"<?xml", b"<VTKFile")):
        return  # not VTK XML (legacy VTK, or garbage that the reader reports as corrupt)
    if tail.rstrip().endswith(b"</VTKFile>"):
        return
    digits = [_PIECE.search(p.name).group(1) for p in pieces]
    found = digits[0] if len(digits) == 1 else f"{digits[0]}..{digits[-1]}"
    empty = [p.name for p in pieces if p.stat().st_size == 0]
    if empty:
        raise IngestError(f"{path}: its .part pieces {found} end before the file does; piece(s) {empty} hold 0 "
                          f"bytes: a corrupt or truncated download; download them again")
    following = f"{int(digits[-1]) + 1:0{len(digits[-1])}d}"
    raise IngestError(f"{path}: its .part pieces {found} end before the file does (no closing </VTKFile>); "
                      f"the last piece(s) (.{following}.part and after?) seem to be missing (or "
                      f".{digits[-1]}.part is cut short); download them")


def read_cells(path: Path, arrays, shown_as: Path | None = None, optional: tuple[str, ...] = ()):
    """Read a VTK XML mesh keeping only the arrays ``arrays`` (names of CELL arrays, or {name: "cell" |
    "point"}; point arrays are averaged to cells by VTK's vtkPointDataToCellData) and those of ``optional``
    that exist (cell data, or point data averaged); returns (mesh, {name: ndarray per cell}).

    ``shown_as`` is the name used in errors (the original file when ``path`` is a joined temporary).
    """
    import pyvista as pv

    _quiet_vtk()
    name = shown_as or path
    wanted = dict(arrays) if isinstance(arrays, dict) else {a: "cell" for a in arrays}
    with pv.VtkErrorCatcher(raise_errors=False, send_to_logging=False) as caught:
        try:
            reader = pv.get_reader(str(path))
            present = {"cell": list(reader.cell_array_names), "point": list(reader.point_array_names)}
        except Exception as exc:  # unknown extension, unreadable file
            raise IngestError(f"{name}: cannot be read as VTK ({_first_line(exc)})") from None
        _raise_caught(caught, name)
        absent = [a for a, kind in wanted.items() if a not in present[kind]]
        if absent:
            hint = ""
            other = [a for a in absent if a in present["point" if wanted[a] == "cell" else "cell"]]
            if other:
                hint = f" ({other} exist as {'POINT' if wanted[other[0]] == 'cell' else 'CELL'} data: set the layout's data: to match)"
            kinds = sorted({wanted[a] for a in absent})
            raise IngestError(f"{name}: missing {'/'.join(kinds)} array(s) {absent}{hint}; cell arrays present: "
                              f"{present['cell']}, point arrays present: {present['point']}")
        for a in optional:
            if a not in wanted:
                if a in present["cell"]:
                    wanted[a] = "cell"
                elif a in present["point"]:
                    wanted[a] = "point"
        reader.disable_all_cell_arrays()
        reader.disable_all_point_arrays()
        for a, kind in wanted.items():
            (reader.enable_cell_array if kind == "cell" else reader.enable_point_array)(a)
        try:
            mesh = reader.read()
        except Exception as exc:
            raise IngestError(f"{name}: corrupt or truncated VTK file ({_first_line(exc)})") from None
        _raise_caught(caught, name)
    if mesh is None or mesh.n_cells == 0:
        raise IngestError(f"{name}: VTK read no cells; the file is empty, truncated or not a mesh")
    if any(kind == "point" for kind in wanted.values()):
        averaged = mesh.point_data_to_cell_data(pass_point_data=False)
        for a, kind in wanted.items():
            if kind == "point":
                mesh.cell_data[a] = averaged.cell_data[a]
    out = {}
    for a in wanted:
        if a not in mesh.cell_data:
            raise IngestError(f"{name}: array {a!r} listed in the header but could not be read; the file is "
                              f"corrupt")
        values = np.asarray(mesh.cell_data[a])
        if len(values) != mesh.n_cells:
            raise IngestError(f"{name}: array {a!r} has {len(values)} values for {mesh.n_cells} cells")
        out[a] = values
    return mesh, out


def _first_line(exc) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _raise_caught(caught, name) -> None:
    """Turn the VTK errors seen so far into one IngestError naming the file."""
    if caught.error_events:
        said = "; ".join(str(getattr(e, "message", e)).strip().splitlines()[-1][:160]
                         for e in caught.error_events[:2])
        raise IngestError(f"{name}: corrupt or truncated VTK file (VTK: {said})")


def check_finite(values: np.ndarray, what: str) -> None:
    """Refuse NaN/Inf, naming the array, how many and the first bad row."""
    bad = ~np.isfinite(values)
    if bad.any():
        rows = bad.reshape(len(values), -1).any(axis=1)
        first = int(np.argmax(rows))
        raise IngestError(f"{what}: {int(rows.sum())} of {len(values)} cells hold NaN/Inf (first at cell {first}); "
                          f"fix or drop this run (--on-error skip records it and carries on)")


def as_polydata(mesh, name):
    """A surface as PolyData: itself, or an UnstructuredGrid of polygons with its cells in their order (its
    data arrays are not carried over)."""
    import pyvista as pv

    if isinstance(mesh, pv.PolyData):
        return mesh
    types = np.asarray(mesh.celltypes)
    bad = np.flatnonzero(~np.isin(types, (5, 7, 9)))
    if len(bad):
        raise IngestError(f"{name}: a surface must consist of polygons only; cell {int(bad[0])} has VTK cell "
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
        raise IngestError(f"{name}: a surface must consist of polygons only, found {found or 'no cells'}")
    centres = np.asarray(mesh.cell_centers().points, dtype=np.float64)
    with_normals = mesh.compute_normals(cell_normals=True, point_normals=False, split_vertices=False,
                                        consistent_normals=False, auto_orient_normals=False)
    if with_normals.n_cells != mesh.n_cells:
        raise IngestError(f"{name}: the surface holds non-polygon cells (normals changed the cell count "
                          f"{mesh.n_cells} -> {with_normals.n_cells}); the surface must be polygons only")
    normals = np.asarray(with_normals.cell_data["Normals"], dtype=np.float64)
    areas = np.asarray(mesh.compute_cell_sizes(length=False, area=True, volume=False).cell_data["Area"],
                       dtype=np.float64)
    if (areas <= 0).any():
        n = int((areas <= 0).sum())
        raise IngestError(f"{name}: {n} surface cells have zero or negative area; the mesh is degenerate")
    return centres, normals, areas


def cell_centres(mesh) -> np.ndarray:
    return np.asarray(mesh.cell_centers().points, dtype=np.float64)


def read_csv_row(path: Path) -> dict[str, float]:
    """A one-row CSV (header + values) such as DrivaerML's force and geometry files, as {column: value}."""
    if not path.exists():
        raise IngestError(f"{path} is missing")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [r for r in csv.reader(f) if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise IngestError(f"{path}: not a readable CSV text file ({type(exc).__name__}: {exc})") from None
    if len(rows) != 2:
        raise IngestError(f"{path}: expected a header line and one row of values, found {len(rows)} non-empty lines")
    header, values = [h.strip() for h in rows[0]], [v.strip() for v in rows[1]]
    repeated = sorted({h for h in header if header.count(h) > 1})
    if repeated:
        raise IngestError(f"{path}: column name(s) {repeated} appear more than once in the header")
    if len(header) != len(values):
        raise IngestError(f"{path}: {len(header)} column names but {len(values)} values")
    out = {}
    for h, v in zip(header, values):
        try:
            out[h] = float(v)
        except ValueError:
            raise IngestError(f"{path}: column {h!r} holds {v!r}, not a number") from None
        if not np.isfinite(out[h]):
            raise IngestError(f"{path}: column {h!r} is {v}")
    return out
