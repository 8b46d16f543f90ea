"""The VTK tests' oracle: what pyvista and VTK themselves build, write and read, for the streaming reader and
writer (``domainflow.vtk``) and the geometry of ingest to be compared with.

- ``mixed_grid``: an UnstructuredGrid of hexahedra, wedges, tetrahedra and a polyhedron with cell and point
  arrays of several dtypes; ``surface``: a PolyData of triangles and quads with cell and point arrays.
- ``write_with_vtk``: a mesh written by VTK's own XML writers in any data mode, compressor, header and id
  type, byte order, block size and number of pieces.
- ``vtk_topology``: the topology arrays as VTK's reader holds them.

Imported by module name (the harness folder is on ``sys.path``, tests/conftest.py); needs pyvista and vtk.
"""

from __future__ import annotations

import numpy as np
import pyvista as pv
import vtk


def mixed_grid(seed=0) -> "pv.UnstructuredGrid":
    """Hexahedra, wedges, tetrahedra and a polyhedron, with cell and point arrays of several dtypes."""
    rng = np.random.default_rng(seed)
    grid = pv.ImageData(dimensions=(6, 5, 4)).cast_to_unstructured_grid()
    tets = grid.triangulate().extract_cells(range(0, 40))
    wpts = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1], [0, 1, 1]], float) - 5
    wedges = pv.UnstructuredGrid(np.array([6, 0, 1, 2, 3, 4, 5]), np.array([pv.CellType.WEDGE], np.uint8), wpts)
    pts = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1]], float) + 10
    faces = [6, 4, 0, 1, 2, 3, 4, 4, 5, 6, 7, 4, 0, 1, 5, 4, 4, 1, 2, 6, 5, 4, 2, 3, 7, 6, 4, 3, 0, 4, 7]
    poly = pv.UnstructuredGrid(np.array([len(faces)] + faces), np.array([pv.CellType.POLYHEDRON], np.uint8), pts)
    mesh = grid.merge([tets, wedges, poly], merge_points=False)
    n, p = mesh.n_cells, mesh.n_points
    mesh.clear_data()
    mesh.cell_data["pressure"] = rng.standard_normal(n).astype(np.float32)
    mesh.cell_data["wallShearStress"] = rng.standard_normal((n, 3)).astype(np.float64)
    mesh.cell_data["region"] = rng.integers(-5, 200, n).astype(np.int32)
    mesh.cell_data["flag"] = rng.integers(0, 255, n).astype(np.uint8)
    mesh.point_data["T"] = rng.standard_normal(p).astype(np.float64) * 1e5
    mesh.point_data["id64"] = rng.integers(-(2**40), 2**40, p).astype(np.int64)
    return mesh


def surface(seed=0) -> "pv.PolyData":
    rng = np.random.default_rng(seed)
    s = pv.Sphere(theta_resolution=30, phi_resolution=20)
    quads = pv.Plane(i_resolution=4, j_resolution=3).translate((3, 0, 0))
    s = s.merge(quads)
    s.clear_data()
    s.cell_data["CpMeanTrim"] = rng.standard_normal(s.n_cells).astype(np.float32)
    s.cell_data["wallShearStressMeanTrim"] = rng.standard_normal((s.n_cells, 3)).astype(np.float32)
    s.point_data["pt"] = rng.standard_normal(s.n_points)
    return s


def write_with_vtk(mesh, path, mode, compressor, header="UInt32", ids="Int64", big_endian=False, block=512, pieces=1):
    writer = (vtk.vtkXMLUnstructuredGridWriter() if isinstance(mesh, pv.UnstructuredGrid)
              else vtk.vtkXMLPolyDataWriter())
    writer.SetInputData(mesh)
    writer.SetFileName(str(path))
    {"ascii": writer.SetDataModeToAscii, "binary": writer.SetDataModeToBinary}.get(
        mode, writer.SetDataModeToAppended)()
    if mode.startswith("appended"):
        writer.SetEncodeAppendedData(mode == "appended-base64")
    {"none": writer.SetCompressorTypeToNone, "zlib": writer.SetCompressorTypeToZLib,
     "lz4": writer.SetCompressorTypeToLZ4, "lzma": writer.SetCompressorTypeToLZMA}[compressor]()
    (writer.SetHeaderTypeToUInt64 if header == "UInt64" else writer.SetHeaderTypeToUInt32)()
    (writer.SetIdTypeToInt64 if ids == "Int64" else writer.SetIdTypeToInt32)()
    (writer.SetByteOrderToBigEndian if big_endian else writer.SetByteOrderToLittleEndian)()
    writer.SetBlockSize(block)  # small blocks: compressed arrays span several
    writer.SetNumberOfPieces(pieces)
    assert writer.Write() == 1
    return path


def vtk_topology(ref):
    """{name: values} of the topology arrays as VTK's reader holds them (offsets without the leading 0)."""
    conv = pv.convert_array
    if isinstance(ref, pv.UnstructuredGrid):
        out = {"connectivity": ref.cell_connectivity, "offsets": ref.cell_offsets[1:], "types": ref.celltypes}
        if (ref.celltypes == pv.CellType.POLYHEDRON).any():
            out["face_connectivity"] = ref.polyhedron_face_connectivity
            out["face_offsets"] = ref.polyhedron_face_offsets[1:]
            out["polyhedron_to_faces"] = ref.polyhedron_face_location_connectivity
            out["polyhedron_offsets"] = ref.polyhedron_face_location_offsets[1:]
        return {("Cells", k): v for k, v in out.items()}
    out = {}
    for section, cells in (("Polys", ref.GetPolys()), ("Lines", ref.GetLines()), ("Verts", ref.GetVerts()),
                           ("Strips", ref.GetStrips())):
        if cells.GetNumberOfCells():
            out[(section, "connectivity")] = conv(cells.GetConnectivityArray())
            out[(section, "offsets")] = conv(cells.GetOffsetsArray())[1:]
    return out
