"""The ``domainflow`` command run in the test process, like ``subprocess.run`` of it but without an interpreter and
torch start-up per call: the ranks a command launches fork from the one fork server (torch imported once), and
what they print to their stdout/stderr is captured with the command's own output (file-descriptor level).

Each subcommand keeps one end-to-end test through a real ``domainflow`` process (``python -m domainflow.app.cli``);
the rest of the command-line tests call this."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import traceback
from types import SimpleNamespace


def run_cli(*args, cwd=None, env: dict | None = None) -> SimpleNamespace:
    """``domainflow ARGS`` in this process: ``returncode``, ``stdout``, ``stderr`` (like subprocess.run's). ``cwd``:
    the working folder during the call; ``env``: variables set (None: removed) during the call."""
    from domainflow.app.cli import main

    saved_env = {k: os.environ.get(k) for k in (env or {})}
    for k, v in (env or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    here = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile("w+b") as fd_out, tempfile.TemporaryFile("w+b") as fd_err:
        sys.stdout.flush()
        sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        os.dup2(fd_out.fileno(), 1)
        os.dup2(fd_err.fileno(), 2)
        try:
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main([str(a) for a in args])
                except SystemExit as exc:  # argparse's own errors
                    code = exc.code if isinstance(exc.code, int) else 2
                except Exception:  # what the interpreter does with an exception main() lets through
                    traceback.print_exc()
                    code = 1
        finally:
            os.chdir(here)
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            os.close(kept[0])
            os.close(kept[1])
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        fd_out.seek(0)
        fd_err.seek(0)
        stdout = out.getvalue() + fd_out.read().decode(errors="replace")
        stderr = err.getvalue() + fd_err.read().decode(errors="replace")
    return SimpleNamespace(returncode=code, stdout=stdout, stderr=stderr)
