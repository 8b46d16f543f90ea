"""zlib streams of VTK XML blocks: ISA-L's implementation when the optional ``fast`` extra is installed
(``pip install 'domainflow[fast]'``: the same format, about 1.3x faster to decompress and 3-10x faster to
compress at level 1), else the standard library's. Either reads what the other writes."""

from __future__ import annotations

import zlib

try:
    from isal import isal_zlib as _impl
except ImportError:  # the standard library: slower, the same streams
    _impl = zlib

compress, decompress = _impl.compress, _impl.decompress
errors = (zlib.error,) if _impl is zlib else (zlib.error, _impl.error)  # what a corrupt stream raises
