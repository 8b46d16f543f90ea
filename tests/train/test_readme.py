"""README.md and docs/*.md are true: the README opens with the two set-up commands, every Python example of
the README and the docs runs as written, the shell tours run as written, docs/cli.md names every subcommand and
option of the parser, and every relative link between the pages resolves."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[tuple[str, str]]:
    """The fenced blocks of a page: (info string, code)."""
    return [(info.strip(), code) for info, code in FENCE.findall(page.read_text())]


def test_readme_opens_with_the_two_commands():
    first_block = README.split("```")[1].strip().splitlines()
    assert first_block == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


# -- Python examples: every ```python block of README.md and docs/*.md (```python norun: shown, not run) ---------
def _python_examples() -> dict[str, list[str]]:
    """Each distinct example's code -> where it is shown (an example shown twice runs once)."""
    out: dict[str, list[str]] = {}
    for page in PAGES:
        index = 0
        for info, code in _blocks(page):
            words = info.split()
            if words[:1] == ["python"]:
                if "norun" not in words[1:]:
                    out.setdefault(code, []).append(f"{_rel(page)}#{index}")
                index += 1
    return out


EXAMPLES = _python_examples()
EXAMPLE_IDS = [places[0] for places in EXAMPLES.values()]


@pytest.fixture(scope="module")
def started_examples(request, tmp_path_factory):
    """Every selected example started at once, each in its own process and folder (they mostly wait for
    imports, so side by side they take about half the time); a test collects its own."""
    selected = {item.callspec.params["where"] for item in request.session.items
                if getattr(item, "callspec", None) is not None and "where" in item.callspec.params
                and item.module is request.module}
    procs = {}
    for code, places in EXAMPLES.items():
        if places[0] not in selected:
            continue
        folder = tmp_path_factory.mktemp("example")
        (folder / "example.py").write_text(code)
        procs[places[0]] = subprocess.Popen([sys.executable, "example.py"], cwd=folder, env=ENV, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_docs_have_python_examples():
    assert any(p.startswith("README.md#") for ps in EXAMPLES.values() for p in ps)
    assert len(EXAMPLES) >= 5, EXAMPLE_IDS


@pytest.mark.parametrize("where", EXAMPLE_IDS)
def test_python_example_runs(where, started_examples):
    try:
        out, err = started_examples[where].communicate(timeout=180)
    except subprocess.TimeoutExpired:
        started_examples[where].kill()
        raise
    assert started_examples[where].returncode == 0, (where, err[-3000:])


# -- shell tours: every block whose lines are all `.venv/bin/domainflow ...` commands runs, in its page's order ---
# a launcher variable of an enclosing job must not reach the commands
NO_JOB = {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _tours() -> list[tuple[str, list[str]]]:
    tours = []
    for page in PAGES:
        for info, code in _blocks(page):
            if info.split()[:1] not in ([], ["sh"], ["bash"], ["console"]):
                continue
            lines = [line.split("#", 1)[0].strip() for line in code.strip().splitlines()]
            commands = [line for line in lines if line]
            if commands and all(c.startswith(".venv/bin/domainflow ") for c in commands):
                tours.append((_rel(page), commands))
    return tours


TOURS = _tours()


def test_the_tours_cover_ingest_train_and_predict():
    """The README's tour goes from raw files to a prediction; the data pipeline's covers the climate path."""
    readme = " ".join(c for page, cs in TOURS if page == "README.md" for c in cs)
    for step in ("synth drivaerml", "ingest cfd", "inspect", "train", "predict"):
        assert f"domainflow {step}" in readme, step
    data = " ".join(c for page, cs in TOURS if page == "docs/data-pipeline.md" for c in cs)
    for step in ("synth climate", "ingest climate", "--cds", "--static", "--fill"):
        assert step in data, step


@pytest.mark.parametrize("page,commands", TOURS, ids=[f"{page}#{i}" for i, (page, _) in enumerate(TOURS)])
def test_tour_commands_run(page, commands, tmp_path, monkeypatch):
    """Each command as a shell passes it (a quoted glob reaches domainflow whole), run in this process (ranks fork
    from the test's fork server; each command's own process is tested in its own file)."""
    from cli_runner import run_cli

    monkeypatch.chdir(tmp_path)
    for command in commands:
        args = shlex.split(command)[1:]
        if args[0] in ("synth", "ingest"):
            args.append("--quiet")
        if args[0] == "train":
            args += ["output.plots=false", "output.progress=false"]  # figures are the demo test's: time
        out = run_cli(*args, env=NO_JOB)
        assert out.returncode == 0, (page, command, out.stderr[-3000:])


# -- docs/cli.md is the parser's -----------------------------------------------------------------------------------
class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _the_parser() -> argparse.ArgumentParser:
    """The ``domainflow`` command's parser, as ``domainflow.app.cli.main`` builds it."""
    from domainflow.app import cli

    for name in ("build_parser", "make_parser", "parser"):
        if callable(getattr(cli, name, None)):
            return getattr(cli, name)()

    def stop(self, args=None, namespace=None):
        raise _Parsed(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    try:
        cli.main([])
    except _Parsed as done:
        return done.parser
    finally:
        mp.undo()
    raise AssertionError("domainflow.app.cli.main parsed nothing")


def _commands(parser, path=()):
    """(subcommand path, its parser) for every subcommand a user sees (aliases with no help are hidden)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            shown = {a.dest for a in action._choices_actions if a.help != argparse.SUPPRESS}
            for name, sub in action.choices.items():
                if name in shown:
                    yield (*path, name), sub
                    yield from _commands(sub, (*path, name))


def _options(parser) -> list[str]:
    return [s for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            for s in a.option_strings]


def _sections(text: str) -> dict[str, str]:
    """Heading `domainflow X Y` -> its own text (to the next heading: a command's section ends where its first
    subcommand's begins)."""
    heads = [(m.start(), m.group(1).strip()) for m in re.finditer(r"^#+ `domainflow ([a-z -]+)`", text, re.M)]
    ends = [m.start() for m in re.finditer(r"^#", text, re.M)] + [len(text)]
    return {name: text[start:next(e for e in ends if e > start)] for start, name in heads}


def test_cli_reference_names_every_subcommand_and_option():
    sections = _sections((ROOT / "docs" / "cli.md").read_text())
    commands = list(_commands(_the_parser()))
    assert len(commands) >= 10, [c for c, _ in commands]
    missing = []
    for path, sub in commands:
        name = " ".join(path)
        if name not in sections:
            missing.append(f"no section `domainflow {name}`")
            continue
        leaves = _options(sub)
        if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            text = sections[name]
            missing += [f"`domainflow {name}` {opt}" for opt in leaves
                        if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)
                        and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])",
                                          sections.get(path[0], ""))]  # the options every `ingest` takes
    assert not missing, "docs/cli.md lacks:\n" + "\n".join(missing)


def test_cli_reference_names_no_option_the_parser_lacks():
    """Every `--option` docs/cli.md lists in a table is one the parser knows (hidden aliases included)."""
    known = set()
    parser = _the_parser()
    for _, sub in [((), parser), *_commands(parser)]:
        known.update(s for a in sub._actions for s in a.option_strings)
    text = (ROOT / "docs" / "cli.md").read_text()
    listed = set(re.findall(r"^\| `(--[a-z-]+)", text, re.M))
    assert listed and listed <= known, sorted(listed - known)


# -- links ----------------------------------------------------------------------------------------------------------
def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    text = FENCE.sub("", page.read_text())
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https://, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            wrong.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            wrong.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not wrong, f"{_rel(page)}:\n" + "\n".join(wrong)
