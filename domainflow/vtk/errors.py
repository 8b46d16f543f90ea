"""Errors of VTK files, and VTK's own errors made into them.

VTK reports problems by printing, not raising: every read through VTK runs with its printing off
(:func:`quiet_vtk`) under pyvista's error catcher, and what the catcher caught becomes one
:class:`VtkFileError` naming the file (:func:`raise_caught`). The layers above keep the error types their
users know: ingest turns a :class:`VtkFileError` into its ``IngestError``/``RunError``, ``read_vtk`` into a
``ValueError`` that starts with ``read_vtk:``.
"""

from __future__ import annotations

import re
from pathlib import Path

from domainflow.errors import DomainflowError

_ADDRESS = re.compile(r"\s*\(0x[0-9a-fA-F]+\)")  # VTK's object addresses: differ run to run, say nothing


class VtkFileError(DomainflowError, ValueError):
    """A VTK file (or its ``.part`` pieces) that cannot be read: missing, corrupt, truncated, not what was
    expected. The message is one line that names the file and says what to do."""


class MissingArraysError(VtkFileError):
    """Arrays asked for that a VTK file does not hold. ``absent``: {name: "cell" | "point"} of those missing;
    ``present``: {"cell": [...], "point": [...]} names the file holds; ``path``: the file as named."""

    def __init__(self, path, absent: dict, present: dict, fix: str | None = None):
        self.path, self.absent, self.fix = path, dict(absent), fix
        self.present = {k: list(v) for k, v in present.items()}
        names = list(self.absent)
        other = [a for a in names if a in self.present["point" if self.absent[a] == "cell" else "cell"]]
        hint = ""
        if other:
            hint = f" ({other} exist as {'POINT' if self.absent[other[0]] == 'cell' else 'CELL'} data"
            hint += f": {fix})" if fix else ")"
        kinds = sorted(set(self.absent.values()))
        super().__init__(f"{path}: missing {'/'.join(kinds)} array(s) {names}{hint}; cell arrays present: "
                         f"{self.present['cell']}, point arrays present: {self.present['point']}")

    def __reduce__(self):  # crosses process boundaries (ingest workers) intact
        return (MissingArraysError, (self.path, self.absent, self.present, self.fix))


def header_int(attrs, key: str, default: int, path, element: str) -> int:
    """An integer attribute of a VTK XML element, read as VTK reads it: absent or empty (``NumberOfComponents=""``,
    which VTK and meshio accept) gives ``default``; anything else that is no integer is a VtkFileError naming
    the file, the element and the attribute."""
    value = attrs.get(key)
    if value is None or not str(value).strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise VtkFileError(f"{path}: {element} has {key}={value!r}, which is not an integer; the file is corrupt "
                           f"or was not written as VTK XML") from None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), or its type's name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def quiet_vtk() -> None:
    """Stop VTK printing to stderr; its errors still reach pyvista's catcher, which :func:`raise_caught`
    raises."""
    from vtkmodules.vtkCommonCore import vtkLogger, vtkObject

    vtkLogger.SetStderrVerbosity(vtkLogger.VERBOSITY_OFF)
    vtkObject.GlobalWarningDisplayOn()


def vtk_said(event) -> str:
    """One caught VTK error as one line: the VTK class that reported it and the first line of what it said
    (an error's later lines are a dump of VTK's request), object addresses left out. An event pyvista could
    not take apart: the last line of its text (after VTK's "ERROR: In <file>, line <n>")."""
    alert, name = str(getattr(event, "alert", "") or ""), getattr(event, "name", "")
    if name and alert.strip():
        said = f"{name}: {alert.strip().splitlines()[0]}"
    else:
        said = (str(event).strip().splitlines() or [""])[-1]
    return _ADDRESS.sub("", said).strip()[:160]


def raise_caught(caught, path: str | Path) -> None:
    """Raise the VTK errors pyvista's catcher ``caught`` so far (the first two) as one :class:`VtkFileError`
    naming ``path``; nothing when there were none."""
    if caught.error_events:
        said = "; ".join(vtk_said(e) for e in caught.error_events[:2])
        raise VtkFileError(f"{path}: corrupt or truncated VTK file (VTK: {said})")
