"""The README's first lines are the two set-up commands, and its Python examples run as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = README.split("```")[1].strip().splitlines()
    assert first_block == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", README))))
def test_readme_python_example_runs(index, tmp_path):
    code = re.findall(r"```python\n(.*?)```", README, re.S)[index]
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_readme_data_commands_run(tmp_path):
    """The shell commands of the README's data section (synth, ingest, inspect) run as written."""
    section = README.split("## Data: from raw files to a partitioned store", 1)[1]
    block = section.split("```", 2)[1]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    commands = [c for c in commands if c]
    assert commands and all(c.startswith(".venv/bin/domainflow ") for c in commands)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    for command in commands:
        args = shlex.split(command)[1:]  # as a shell passes them: a quoted glob reaches domainflow whole
        out = subprocess.run([sys.executable, "-m", "domainflow.app.cli", *args, *(
            ["--quiet"] if args[0] in ("synth", "ingest") else [])], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=300)
        assert out.returncode == 0, (command, out.stderr[-3000:])
