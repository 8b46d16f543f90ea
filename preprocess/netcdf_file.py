"""A netCDF file's size checked against its header before it is read: the netCDF library reads the missing end
of a truncated classic (netCDF-3) file as zeros, so a download cut short would be ingested as data (or its
time axis misread). netCDF-4 files are HDF5, whose library refuses a truncated file itself.

The classic header (the format spec's ``magic numrecs dim_list gatt_list var_list``) gives each variable's
offset and size; the file must reach the end of the last one: ``begin + vsize`` for a fixed-size variable,
``begin + (numrecs - 1) * recsize + vsize`` for a record variable.
"""

from __future__ import annotations

import os
import struct

from .errors import IngestError

_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 4, 6: 8, 7: 1, 8: 2, 9: 4, 10: 8, 11: 8}  # nc_type -> bytes per value
_ABSENT, _DIMENSION, _VARIABLE, _ATTRIBUTE = 0, 10, 11, 12


class _Header:
    def __init__(self, f, version: int):
        self.f, self.version = f, version

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError
        return data

    def int(self) -> int:
        return struct.unpack(">i", self.read(4))[0]

    def size(self) -> int:  # NON_NEG: 8 bytes in CDF-5, else 4
        return struct.unpack(">q", self.read(8))[0] if self.version == 5 else struct.unpack(">I", self.read(4))[0]

    def offset(self) -> int:  # begin: 4 bytes in CDF-1, 8 in CDF-2 and CDF-5
        return struct.unpack(">q", self.read(8))[0] if self.version in (2, 5) else struct.unpack(">I", self.read(4))[0]

    def name(self) -> str:
        n = self.size()
        return self.read(n + (-n) % 4)[:n].decode("utf-8", "replace")

    def skip_attributes(self) -> None:
        tag, count = self.int(), self.size()
        if tag == _ABSENT:
            return
        for _ in range(count):
            self.name()
            kind, n = self.int(), self.size()
            nbytes = n * _SIZES.get(kind, 1)
            self.read(nbytes + (-nbytes) % 4)


def check_size(path: str) -> None:
    """Nothing for a file that is not classic netCDF; an error naming the file when a classic one is shorter
    than its header says (a download cut short)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
        if len(magic) != 4 or magic[:3] != b"CDF" or magic[3] not in (1, 2, 5):
            return
        h = _Header(f, magic[3])
        try:
            numrecs = h.size()
            if numrecs in (0xFFFFFFFF, -1):  # streaming: the count is not in the header
                return
            dims = []
            tag, count = h.int(), h.size()
            for _ in range(count if tag == _DIMENSION else 0):
                h.name()
                dims.append(h.size())
            h.skip_attributes()
            tag, count = h.int(), h.size()
            variables = []
            for _ in range(count if tag == _VARIABLE else 0):
                name = h.name()
                ids = [h.size() for _ in range(h.size())]
                h.skip_attributes()
                kind = h.int()
                vsize, begin = h.size(), h.offset()
                rec = bool(ids) and dims[ids[0]] == 0
                values = 1
                for i in ids[1:] if rec else ids:
                    values *= dims[i]
                variables.append((name, rec, vsize, values * _SIZES.get(kind, 1), begin))
        except (EOFError, IndexError, struct.error):
            raise IngestError(f"{path}: its netCDF header is cut short or damaged ({size} bytes); the file is "
                              f"truncated or corrupt (an interrupted download?): download it again") from None
    records = [v for v in variables if v[1]]
    # a record holds each record variable's padded vsize, except a lone record variable's: its values unpadded
    recsize = records[0][3] if len(records) == 1 else sum(v[2] for v in records)
    need, last = 0, None
    for name, rec, _, nbytes, begin in variables:  # where each variable's last value ends
        if rec and not numrecs:
            continue
        end = begin + (numrecs - 1) * recsize + nbytes if rec else begin + nbytes
        if end > need:
            need, last = end, name
    if size < need:
        raise IngestError(f"{path} is cut short: {size} of the {need} bytes its header describes (variable {last!r} "
                          f"ends at byte {need}); the file is truncated (an interrupted download?): download it again")
