"""The ``domainflow`` command run in the test process (no interpreter or torch start-up per call): for
commands that do not start ranks (ingest, inspect, and errors raised before ranks start)."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace


def run_cli(*args) -> SimpleNamespace:
    """``domainflow ARGS`` in this process: ``returncode``, ``stdout``, ``stderr`` (like subprocess.run's)."""
    from domainflow.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 2
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
