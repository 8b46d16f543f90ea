"""Prediction files for ParaView and pyvista, written without gathering a run on any rank.

- ``write_piece``: one rank's cells as a ``.vtp`` piece, in original cell order within the piece: the raw
  surface's polygons of those cells (read from the raw file for just those cells) or, without the raw
  file, vertices at the cell centres; predicted, true and error fields and ``cell_id`` as cell data.
- ``write_index``: the ``.pvtp`` that lists the pieces (ParaView and pyvista open it as one dataset).
- ``assemble``: one ``.vtp`` of the whole run from the pieces, streamed a block of cells at a time on one
  rank: the raw file's own points and polygons (or the centres), every array in original cell order.
- ``write_collection``: a ``.pvd`` over several predicted runs.

Every file is published atomically (the streaming writer renames a finished scratch file; the XML indexes
are written to a scratch name and renamed).
"""

from __future__ import annotations

import os
from pathlib import Path
from xml.sax.saxutils import quoteattr

import numpy as np

from domainflow.vtk.xml_reader import VtkXmlFile
from domainflow.vtk.xml_writer import VtkXmlWriter, vtk_type

ROWS_PER_APPEND = 1 << 18  # rows handed to the writer at a time (it copies what it is given)
ASSEMBLE_CELLS = 1 << 20   # cells of the assembled file handled at a time


def write_piece(path: Path, ids: np.ndarray, arrays: dict, raw: Path | None, coords: np.ndarray | None) -> None:
    """Cells ``ids`` (original ids, ascending) with ``arrays`` (rows in the same order) as cell data, plus
    ``cell_id``: the raw surface's polygons of those cells, or vertices at ``coords``."""
    if raw is not None:
        with VtkXmlFile(raw) as f:  # polygons of a .vtp, or the 2-D cells of a surface given as a .vtu
            sizes, conn = f.cells_of(ids, section="Polys" if f.kind == "PolyData" else "Cells")
            points, conn = f.points_of(conn)
        topology = "Polys"
    else:
        points, conn, sizes = coords, np.arange(len(ids), dtype=np.int64), np.ones(len(ids), np.int64)
        topology = "Verts"
    cells = {"cell_id": np.asarray(ids, np.int64), **arrays}
    w = VtkXmlWriter(path, kind="PolyData")
    try:
        w.declare("Points", "Points", points.dtype, 3)
        w.declare(topology, "connectivity", np.int64)
        w.declare(topology, "offsets", np.int64)
        for name, v in cells.items():
            w.declare("CellData", name, v.dtype, 1 if v.ndim == 1 else v.shape[1])
        _append(w, "Points", "Points", points)
        _append(w, topology, "connectivity", conn.astype(np.int64, copy=False))
        _append(w, topology, "offsets", np.cumsum(sizes, dtype=np.int64))
        for name, v in cells.items():
            _append(w, "CellData", name, v)
        w.close(len(points), len(ids))
    except BaseException:
        w.abort()
        raise


def write_index(path: Path, pieces: list[Path]) -> None:
    """The ``.pvtp`` listing ``pieces`` (relative to ``path``), with the arrays and point type of the first."""
    with VtkXmlFile(pieces[0]) as f:
        declared = [(name, f.info("cell", name)) for name in f.array_names("cell")]
        points = f.pieces[0]["arrays"]["points"]
    arrays = "".join(f'      <PDataArray type="{_type_name(a)}" Name={quoteattr(name)} NumberOfComponents='
                     f'"{a.components}"/>\n' for name, a in declared)
    sources = "".join(f"    <Piece Source={quoteattr(os.path.relpath(p, path.parent))}/>\n" for p in pieces)
    text = (f'<?xml version="1.0"?>\n<VTKFile type="PPolyData" version="1.0" byte_order="LittleEndian" '
            f'header_type="UInt64">\n  <PPolyData GhostLevel="0">\n    <PCellData>\n{arrays}    </PCellData>\n'
            f'    <PPoints>\n      <PDataArray type="{_type_name(points)}" NumberOfComponents="3"/>\n    </PPoints>\n'
            f'{sources}  </PPolyData>\n</VTKFile>\n')
    _publish_text(path, text)


def assemble(path: Path, pieces: list[Path], n_cells: int, raw: Path | None) -> None:
    """One ``.vtp`` of the whole run from ``pieces`` (which together hold cells ``0..n_cells-1``), every array
    in original cell order, a block of ``ASSEMBLE_CELLS`` cells at a time: the raw file's points and
    polygons, or the pieces' vertices at the cell centres."""
    files = [VtkXmlFile(p) for p in pieces]
    w = VtkXmlWriter(path, kind="PolyData")
    try:
        names = [n for n in files[0].array_names("cell")]
        infos = {n: files[0].info("cell", n) for n in names}
        for n in names:
            w.declare("CellData", n, infos[n].dtype, infos[n].components)
        cursor = [0] * len(files)
        geometry = VtkXmlFile(raw) if raw is not None else None
        try:
            if geometry is not None:
                w.declare("Points", "Points", geometry.pieces[0]["arrays"]["points"].dtype, 3)
                w.declare("Polys", "connectivity", np.int64)
                w.declare("Polys", "offsets", np.int64)
                for lo in range(0, geometry.n_points, ASSEMBLE_CELLS):
                    w.append("Points", "Points", geometry.points(lo, min(lo + ASSEMBLE_CELLS, geometry.n_points)))
                n_points = geometry.n_points
            else:
                w.declare("Points", "Points", files[0].pieces[0]["arrays"]["points"].dtype, 3)
                w.declare("Verts", "connectivity", np.int64)
                w.declare("Verts", "offsets", np.int64)
                n_points = n_cells
            end = 0
            for lo in range(0, n_cells, ASSEMBLE_CELLS):
                hi = min(lo + ASSEMBLE_CELLS, n_cells)
                spans = _spans(files, cursor, lo, hi)
                ids = np.concatenate([f.read("cell", "cell_id", a, b) for f, (a, b) in zip(files, spans)])
                where = ids - lo
                if len(ids) != hi - lo or np.any(np.bincount(where, minlength=hi - lo) != 1):
                    raise ValueError(f"{path}: the pieces do not hold cells {lo}..{hi - 1} exactly once each")
                for n in names:
                    out = np.empty((hi - lo,) + ((infos[n].components,) if infos[n].components > 1 else ()),
                                   dtype=infos[n].dtype)
                    out[where] = np.concatenate([f.read("cell", n, a, b) for f, (a, b) in zip(files, spans)])
                    w.append("CellData", n, out)
                if geometry is not None:
                    sizes, conn = geometry.cell_block(lo, hi, "Polys" if geometry.kind == "PolyData" else "Cells")
                    w.append("Polys", "connectivity", conn)
                    w.append("Polys", "offsets", end + np.cumsum(sizes))
                    end += int(sizes.sum())
                else:
                    pts = np.empty((hi - lo, 3), dtype=files[0].pieces[0]["arrays"]["points"].dtype)
                    pts[where] = np.concatenate([f.points(a, b) for f, (a, b) in zip(files, spans)])
                    w.append("Points", "Points", pts)
                    w.append("Verts", "connectivity", np.arange(lo, hi, dtype=np.int64))
                    w.append("Verts", "offsets", np.arange(lo + 1, hi + 1, dtype=np.int64))
                cursor = [b for _, b in spans]
        finally:
            if geometry is not None:
                geometry.close()
        w.close(n_points, n_cells)
    except BaseException:
        w.abort()
        raise
    finally:
        for f in files:
            f.close()


def write_collection(path: Path, datasets: list[tuple[str, Path]]) -> None:
    """A ``.pvd`` listing ``(name, file)`` pairs, one time step each (ParaView steps through the runs)."""
    entries = "".join(f'    <DataSet timestep="{k}" part="0" name={quoteattr(name)} '
                      f'file={quoteattr(os.path.relpath(p, path.parent))}/>\n' for k, (name, p) in enumerate(datasets))
    _publish_text(path, f'<?xml version="1.0"?>\n<VTKFile type="Collection" version="0.1" byte_order="LittleEndian">\n'
                        f'  <Collection>\n{entries}  </Collection>\n</VTKFile>\n')


def _spans(files, cursor, lo: int, hi: int) -> list[tuple[int, int]]:
    """For each piece, the rows from its cursor whose cell ids are below ``hi`` (each piece is sorted)."""
    spans = []
    for f, a in zip(files, cursor):
        n = f.n_cells
        ids = f.read("cell", "cell_id", a, min(a + (hi - lo), n))  # at most hi - lo of them can be in [lo, hi)
        spans.append((a, a + int(np.searchsorted(ids, hi))))
    return spans


def _append(w, section: str, name: str, values: np.ndarray) -> None:
    for lo in range(0, len(values), ROWS_PER_APPEND):
        w.append(section, name, values[lo:lo + ROWS_PER_APPEND])
    if not len(values):
        w.append(section, name, values)


def _type_name(info) -> str:
    return vtk_type(info.dtype)


def _publish_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)
