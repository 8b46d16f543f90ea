"""The model libraries the model-zoo tests run (MONAI's nets, neuraloperator), imported once by each fork server
(``dist_pool``) so that no rank imports them again. MONAI's ``__init__`` imports every one of its submodules, and
with them optional packages its nets never use (mlflow, pandas, matplotlib, scipy.signal: about 7 s of the 9 s of
``import monai.networks.nets`` here): those not imported yet are hidden while MONAI loads (its ``optional_import``
then records them as missing), and visible again afterwards for the code that does use them."""

from __future__ import annotations

import contextlib
import sys

_UNUSED_BY_NETS = ("mlflow", "pandas", "matplotlib", "scipy.signal")


@contextlib.contextmanager
def _hidden(names):
    hidden = [n for n in names if n not in sys.modules]
    for n in hidden:
        sys.modules[n] = None  # an import of it raises ImportError
    try:
        yield
    finally:
        for n in hidden:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


with contextlib.suppress(ImportError):  # an uninstalled library: its tests skip
    with _hidden(_UNUSED_BY_NETS):
        import monai.networks.nets  # noqa: F401
with contextlib.suppress(ImportError):
    import neuralop  # noqa: F401
