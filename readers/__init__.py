"""Region readers: each rank reads only its own part of a partitioned Zarr store and gets ShardTensors.

Installed as ``domainflow.readers``; always import it by that name, never as bare ``readers``.

- ``open_store(path)``: a complete store's runs, fields, statistics and splits (refuses partial stores).
- ``MeshDataset``: samples of a mesh store (DrivaerML-style runs), sharded on the point dim.
- ``GridDataset``: (input window, target) pairs of a grid store, sharded over lat (and lon).
- ``read_vtk``: VTK files, partitioned ones piecewise per rank.
"""

from .grid_dataset import GridDataset
from .mesh_dataset import MeshDataset
from .normalize import Normalizer
from .store import ByteCounter, Store, StoreError, open_store
from .vtk import VtkRead, read_vtk

__all__ = ["ByteCounter", "GridDataset", "MeshDataset", "Normalizer", "Store", "StoreError", "VtkRead", "open_store",
           "read_vtk"]
