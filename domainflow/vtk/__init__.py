"""The one VTK layer: what ingest (``domainflow.preprocess``), ``read_vtk`` (``domainflow.readers``) and
predict (``domainflow.train``) share about VTK files. No torch; pyvista/VTK only where a module says so.

- ``errors``: :class:`VtkFileError` (a file that cannot be read, one line naming it) and the handling of
  VTK's own errors (VTK prints them; here they are raised): ``quiet_vtk``, ``first_line``, ``raise_caught``.
- ``pieces``: files shipped as ``.NN.part`` byte pieces (find, check complete, join, read as one stream).
- ``zlib_codec``: the zlib streams of VTK XML blocks (ISA-L's when installed, else the standard library's).
- ``xml_reader``: :class:`VtkXmlFile`, the streaming reader of ``.vtu`` / ``.vtp`` files (one array, or a
  row range of it, without reading the rest).
- ``xml_writer``: :class:`VtkXmlWriter`, the streaming writer of ``.vtu`` / ``.vtp`` files.
- ``partitioned``: the index files of partitioned data sets (``.pvtu``, ``.pvtp``, ``.vtm``) and the XML headers
  of their piece files, read without their data.
- ``pyvista_io``: what goes through pyvista/VTK itself: reading any dataset file (legacy ``.vtk`` too) with only
  the arrays asked for, cell arrays with point data averaged to cells, surface geometry, cell centres.

Nothing here imports ``readers``, ``preprocess`` or ``train``; this package's ``__init__`` imports nothing.
"""
