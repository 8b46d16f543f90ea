"""Partitioned VTK data sets: the index files (``.pvtu``, ``.pvtp`` list piece files; a ``.vtm`` lists data sets
in named blocks) and the XML headers of the piece files, all read without touching the pieces' data.

Everything here reads only small XML, so every rank of a parallel read can check the same things the same
way before any rank reads data (``domainflow.readers.vtk``). Errors are :class:`VtkFileError`\\ s naming the file.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from .errors import VtkFileError, header_int

#: Suffixes of index files, read piecewise; anything else is one data set.
PARTITIONED_SUFFIXES = (".pvtu", ".pvtp", ".vtm")
#: Suffixes of the VTK XML data set files an index may list.
PIECE_SUFFIXES = (".vtu", ".vtp", ".vts", ".vtr", ".vti")
ASSOCIATIONS = {"cell": "CellData", "point": "PointData"}
_HEADER_CHUNK = 4 << 10
_APPENDED = b"<AppendedData"


@dataclass
class PieceHeader:
    """What a piece's XML header says, read without touching its data."""

    path: str
    arrays: dict  # association -> {name: (VTK type, components)}
    points_type: str
    counts: dict | None  # association -> rows, when the header lists them all


def vtm_datasets(node, around=()) -> list[tuple[str, set]]:
    """(file, the names of the data set and of every block around it) of each data set of a .vtm, in order."""
    out = []
    for child in node:
        names = set(around) | ({child.get("name")} if child.get("name") else set())
        if child.tag == "DataSet" and child.get("file"):
            out.append((child.get("file"), names))
        out += vtm_datasets(child, names if child.tag in ("Block", "Piece") else around)
    return out


def index_pieces(path, blocks=None) -> tuple[list[str], dict | None, int]:
    """Piece paths listed by a .pvtu / .pvtp / .vtm index, in document order, each checked to exist;
    plus the arrays a .pvtu / .pvtp declares ({association: {name: VTK type} or None where it has no
    P*Data element}; None for .vtm) and the index's size. ``blocks``: of a .vtm, only the data sets named so
    or inside a block named so."""
    folder = os.path.dirname(os.path.abspath(path))
    nbytes = os.path.getsize(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise VtkFileError(f"{path} is not a valid VTK XML index ({exc}); rewrite it or read "
                           f"the pieces one by one") from None
    declared = None
    if path.lower().endswith(".vtm"):
        found = vtm_datasets(root)
        if blocks is not None:
            known = sorted({n for _, names in found for n in names})
            unknown = [b for b in blocks if b not in known]
            if unknown:
                raise VtkFileError(f"{path} has no block(s) named {unknown}; its blocks and data sets are "
                                   f"{known}")
            found = [(f, names) for f, names in found if names & set(blocks)]
        files = [f for f, _ in found]
    else:
        declared = {assoc: None if root.find(f"./*/P{tag}") is None else
                    {e.get("Name"): e.get("type") for e in root.iterfind(f"./*/P{tag}/PDataArray")}
                    for assoc, tag in ASSOCIATIONS.items()}
        ghost = root.find("./*[@GhostLevel]")
        if ghost is not None and ghost.get("GhostLevel", "0").strip() not in ("", "0"):
            raise VtkFileError(f"{path} has GhostLevel={ghost.get('GhostLevel')}: its pieces overlap, "
                               f"so their union would repeat rows; write it with ghost level 0")
        files = [e.get("Source") for e in root.iter("Piece") if e.get("Source")]
    if not files:
        raise VtkFileError(f"{path} lists no piece files (no <Piece Source=...> / <DataSet file=...>)")
    pieces = [os.path.join(folder, f) for f in files]
    missing = [p for p in pieces if not os.path.isfile(p)]
    if missing:
        raise VtkFileError(f"{path} lists piece file(s) that do not exist: {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}; restore them or rewrite the index")
    return pieces, declared, nbytes


def piece_header(path) -> tuple[PieceHeader, int]:
    """Parse a piece's XML header up to its appended data (or its first inline Piece); (header, bytes read)."""
    if not path.lower().endswith(PIECE_SUFFIXES):
        raise VtkFileError(f"piece {path} is not a VTK XML dataset file (expected one of {PIECE_SUFFIXES})")
    scan = _HeaderScan(path)
    nbytes = 0
    try:
        with open(path, "rb") as fh:
            carry = b""  # bytes not fed yet: the marker may straddle two chunks
            while scan.state is None:
                chunk = fh.read(_HEADER_CHUNK)
                nbytes += len(chunk)
                window = carry + chunk
                cut = window.find(_APPENDED)
                keep = len(_APPENDED) - 1
                if cut >= 0:
                    scan.feed(window[:cut], end="appended")
                elif not chunk:
                    scan.feed(window, end="eof")
                else:
                    split = max(len(window) - keep, 0)
                    scan.feed(window[:split])
                    carry = window[split:]
    except (ET.ParseError, UnicodeDecodeError) as exc:
        raise VtkFileError(f"piece {path} has a corrupt XML header ({exc}); rewrite the file") from None
    if scan.kind is None or scan.state == "eof":
        raise VtkFileError(f"piece {path} ends inside its XML header (truncated?); rewrite the file")
    complete = scan.state in ("appended", "closed")
    return PieceHeader(path, scan.arrays, scan.points_type or "Float64", scan.counts if complete else None), nbytes


class _HeaderScan:
    """Incremental XML scan of a piece header: array names/types/components, points type, row counts.

    ``state`` becomes "appended" (reached the appended data), "closed" (the root element ended),
    "piece" (inline data: stopped after the first Piece, not reading the rest) or "eof" (truncated).
    """

    def __init__(self, path=None):
        self.path = path  # named in errors
        self.parser = ET.XMLPullParser(events=("start", "end"))
        self.stack: list[str] = []
        self.arrays = {"cell": {}, "point": {}}
        self.counts = {"cell": 0, "point": 0}
        self.points_type = None
        self.kind = None
        self.inline = False
        self.state = None

    def feed(self, data: bytes, end: str | None = None) -> None:
        self.parser.feed(data)
        for event, el in self.parser.read_events():
            self._start(el) if event == "start" else self._end(el)
            if self.state is not None:
                return
        self.state = end

    def _start(self, el) -> None:
        self.stack.append(el.tag)
        if len(self.stack) == 1:
            self.kind = el.get("type")
        elif el.tag == "Piece":
            _count_rows(el, self.counts, self.path)
        elif el.tag == "DataArray":
            self.inline = self.inline or el.get("format", "appended") != "appended"
            parent = self.stack[-2]
            if parent in ("CellData", "PointData") and "Piece" in self.stack:
                assoc = "cell" if parent == "CellData" else "point"
                comps = header_int(el.attrib, "NumberOfComponents", 1, self.path, f"DataArray {el.get('Name')!r}")
                self.arrays[assoc].setdefault(el.get("Name"), (el.get("type"), comps))
            elif parent in ("Points", "Coordinates") and self.points_type is None:
                self.points_type = el.get("type")

    def _end(self, el) -> None:
        self.stack.pop()
        if el.tag == "Piece" and self.inline:
            self.state = "piece"  # inline data: the rest of the file is data, not header
        elif not self.stack:
            self.state = "closed"


def _count_rows(piece, counts, path=None) -> None:
    """Add a <Piece>'s row counts (unstructured / poly data); structured pieces give extents instead."""
    if piece.get("NumberOfPoints") is None:
        counts["cell"] = counts["point"] = None
        return
    if counts["point"] is None:
        return
    counts["point"] += header_int(piece.attrib, "NumberOfPoints", 0, path, "<Piece>")
    counts["cell"] += sum(header_int(piece.attrib, a, 0, path, "<Piece>") for a in (
        "NumberOfCells", "NumberOfVerts", "NumberOfLines", "NumberOfStrips", "NumberOfPolys"))
