"""Packaging: the four top-level folders install as one distribution, ``domainflow``.

docs/architecture.md: domainflow/ -> domainflow, readers/ -> domainflow.readers,
preprocess/ -> domainflow.preprocess, train/ -> domainflow.train, both for an editable
install and for a plain ``pip install .`` (wheel).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# folder in the repo -> package it installs as
FOLDERS = {
    "domainflow": "domainflow",
    "readers": "domainflow.readers",
    "preprocess": "domainflow.preprocess",
    "train": "domainflow.train",
}
PACKAGES = list(FOLDERS.values())


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (
        f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
        f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
    return proc


def _copy_source(dst: Path) -> None:
    """Copy only what the build needs, so no stale build/ or egg-info of the repo leaks in."""
    dst.mkdir()
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, dst / folder, ignore=ignore)


def _expected_wheel_files(src: Path) -> set[str]:
    """Every .py file under the four folders, as its path inside the wheel."""
    expected = set()
    for folder, package in FOLDERS.items():
        root = src / folder
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            expected.add(package.replace(".", "/") + "/" + rel)
    return expected


@pytest.mark.timeout(120)
def test_wheel_installs_all_subpackages(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _copy_source(src)

    # 1. build the wheel (setuptools + wheel come from the venv: see Makefile `venv`)
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
         "--no-build-isolation", "-w", str(wheels)],
        cwd=tmp_path, env=_pip_env(),
    )
    (wheel,) = wheels.glob("domainflow-*.whl")

    # 2. the wheel holds the four packages and every module under the four folders
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(
            (zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), ""
        )
    for package in PACKAGES:
        assert f"{package.replace('.', '/')}/__init__.py" in names, (package, sorted(names))
    missing = sorted(_expected_wheel_files(src) - names)
    assert not missing, (
        "modules under the package folders are missing from the wheel; add each new "
        "sub-package (a folder with an __init__.py) to [tool.setuptools] packages in "
        f"pyproject.toml: {missing}"
    )
    assert not any(n.startswith(("readers/", "preprocess/", "train/", "tests/")) for n in names), (
        "bare top-level packages leaked into the wheel", sorted(names))
    assert "domainflow = domainflow.app.cli:main" in entry_points, entry_points

    # 3. install it into a throwaway target dir
    site = tmp_path / "site"
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        cwd=tmp_path, env=_pip_env(),
    )

    # 4. import from that dir only: -I -S keeps out the venv's site (and with it the editable
    #    install's .pth finder), the env, and the cwd; torch/numpy come from their own dirs.
    import numpy
    import torch

    dep_dirs = []
    for mod in (torch, numpy):
        d = str(Path(mod.__file__).resolve().parents[1])
        if d not in dep_dirs:
            dep_dirs.append(d)
    code = (
        "import json, sys\n"
        f"sys.path[:0] = {json.dumps([str(site)] + dep_dirs)}\n"
        "import importlib\n"
        f"mods = {{n: importlib.import_module(n).__file__ for n in {PACKAGES!r}}}\n"
        "print(json.dumps(mods))\n"
    )
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    proc = _run([sys.executable, "-I", "-S", "-c", code], cwd=run_dir, env=_pip_env(), timeout=100)
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    site_resolved = site.resolve()
    for package in PACKAGES:
        f = Path(files[package]).resolve()
        assert f.is_relative_to(site_resolved), (package, str(f), "should come from", str(site))
        assert f.as_posix().endswith(package.replace(".", "/") + "/__init__.py"), (package, str(f))


def _is_editable_install() -> bool:
    try:
        raw = metadata.distribution("domainflow").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False
    if not raw:
        return False
    return bool(json.loads(raw).get("dir_info", {}).get("editable"))


@pytest.mark.timeout(120)
def test_editable_install_maps_folders(tmp_path: Path) -> None:
    if not _is_editable_install():
        pytest.skip("domainflow is not installed in editable mode here (make venv does that)")
    # Run from outside the repo so the cwd on sys.path cannot help: only the installed
    # editable finder can map domainflow.readers -> <repo>/readers.
    code = (
        "import importlib, json\n"
        f"print(json.dumps({{n: importlib.import_module(n).__file__ for n in {PACKAGES!r}}}))\n"
    )
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = _run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=100)
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    for folder, package in FOLDERS.items():
        assert Path(files[package]).resolve() == (REPO / folder / "__init__.py").resolve(), (
            package, files[package])

    # and in this process too (what the rest of the test suite sees)
    import domainflow.readers

    assert Path(domainflow.readers.__file__).as_posix().endswith("readers/__init__.py")
    assert Path(domainflow.readers.__file__).resolve() == (REPO / "readers" / "__init__.py").resolve()


_FIRST_IMPORTS = ["domainflow.dispatch.engine", "domainflow.ops", "domainflow.comm", "domainflow.ops.neighbours",
                  "domainflow.tensor.shard_tensor", "domainflow.layout.spec", "domainflow.tensor.partials",
                  "domainflow.dispatch.registry", "domainflow.train"]


# the tensor layer imported directly (no ``domainflow.X`` access first) still dispatches ops
_TENSOR_LAYER_ALONE = "the tensor layer alone"
_TENSOR_LAYER_CODE = (
    "from domainflow.tensor.shard_tensor import distribute_tensor\n"
    "from domainflow.layout.mesh import init_mesh\n"
    "from domainflow.layout.placements import Shard\n"
    "x = distribute_tensor(torch.rand(4, 3), init_mesh((1,), ('d',)), [Shard(0)])\n"
    "assert torch.equal((x + x).full_tensor(), 2 * x.full_tensor())\n"
    "assert type(x.sum()).__name__ == 'ShardTensor', type(x.sum())\n")


@pytest.fixture(scope="module")
def first_imports():
    """Each of ``_FIRST_IMPORTS`` imported first, then used, in a fresh process of its own: one interpreter imports
    torch and its DTensor package (not ours: seconds each time) once and forks a child per module, which reports
    its exit code and error."""
    import subprocess
    import sys

    code = (
        "import json, os, sys, traceback\n"
        "import torch, torch.distributed, torch.distributed.tensor\n"
        "results, children = {}, {}\n"
        f"for module in {[*_FIRST_IMPORTS, _TENSOR_LAYER_ALONE]!r}:\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.close(r)\n"
        "        try:\n"
        f"            if module == {_TENSOR_LAYER_ALONE!r}:\n"
        f"                exec({_TENSOR_LAYER_CODE!r})\n"
        "            else:\n"
        "                __import__(module)\n"
        "                import domainflow as df\n"
        "                x = df.distribute_tensor(torch.rand(4, 3), df.init_mesh((1,), ('d',)), [df.Shard(0)])\n"
        "                assert df.knn(x, 2)[0].shape == (4, 2)\n"
        "            os.write(w, b'ok')\n"
        "            os._exit(0)\n"
        "        except BaseException:\n"
        "            os.write(w, traceback.format_exc()[-2000:].encode())\n"
        "            os._exit(1)\n"
        "    os.close(w)\n"
        "    children[module] = (pid, r)\n"
        "for module, (pid, r) in children.items():  # all started first: they import at the same time\n"
        "    with os.fdopen(r, 'rb') as f:\n"
        "        said = f.read().decode()\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    results[module] = [os.waitstatus_to_exitcode(status), said]\n"
        "print(json.dumps(results))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", _FIRST_IMPORTS)
def test_any_engine_module_can_be_imported_first(module, first_imports):
    """No import cycle bites whichever module a user (or a worker) imports first."""
    code, said = first_imports[module]
    assert code == 0 and said == "ok", said


# The core's rooms, bottom to top: a module may import its own room and the rooms below, never above
# (docs/architecture.md). The package root wires the engine to the tensor layer (load_engine) and is above all.
_CORE_LAYERS = ["errors", "locks", "cli_values", "store", "vtk", "layout", "launch", "comm", "tensor", "dispatch", "ops", "__init__", "app"]


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "domainflow":
        return None
    if len(parts) == 1:
        return "__init__"
    if parts[1] in ("readers", "preprocess", "train"):
        return parts[1]
    return parts[1] if parts[1] in _CORE_LAYERS else None


def _imports(path: Path, module: str) -> set[str]:
    """Modules ``path`` imports (static imports anywhere in the file, relative ones resolved)."""
    import ast

    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            if base != "domainflow":  # `from domainflow import comm` imports the comm room, not the root's code
                out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _module_files(folder: str, prefix: str):
    root = REPO / folder
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        yield path, ".".join([prefix, *parts]) if parts else prefix


def test_core_rooms_import_only_downward():
    """errors/locks <- layout <- comm <- tensor <- dispatch <- ops <- the package root <- app; only app may
    import train and preprocess. A violation names the file and the import."""
    rank = {room: i for i, room in enumerate(_CORE_LAYERS)}
    wrong = []
    for path, module in _module_files("domainflow", "domainflow"):
        room = _room(module)
        if room is None:
            continue
        for target in _imports(path, module):
            other = _room(target)
            if other is None or other == room:
                continue
            if other in ("readers", "preprocess", "train"):
                if room != "app":
                    wrong.append(f"{path.relative_to(REPO)} imports {target} (only app/ may)")
            elif rank[other] > rank[room]:
                wrong.append(f"{path.relative_to(REPO)} ({room}) imports {target} ({other}, a room above)")
    assert not wrong, "\n".join(wrong)


# The four folders, the package-dir mapping resolved: the core below everything; readers and preprocess above it
# and never each other (they share the store format, domainflow/store/); train above those; the command (app/)
# on top (docs/architecture.md).
_FOLDER_ROOMS = {"core": set(), "readers": {"core"}, "preprocess": {"core"},
                 "train": {"core", "readers", "preprocess"}, "app": {"core", "readers", "preprocess", "train"}}


def _folder_room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("app", "train", "readers", "preprocess") else "core"


def _import_graph() -> dict[str, set[str]]:
    """Every module of the installed package -> the modules of ours it imports (at module level or inside a
    function; ``from pkg import sub`` counts as importing ``pkg.sub`` alone, as Python runs it)."""
    import ast

    files = {m: p for folder, prefix in (("domainflow", "domainflow"), ("readers", "domainflow.readers"),
                                         ("preprocess", "domainflow.preprocess"), ("train", "domainflow.train"))
             for p, m in _module_files(folder, prefix)}
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package.split(".")
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [x for x in subs if x in files] or [base]
            for name in names:
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def test_the_whole_import_graph_has_no_loop_and_runs_the_documented_way():
    """Across the four folders (the package-dir mapping resolved, imports inside functions counted): no module
    reaches itself through others, and no arrow runs against core <- readers, preprocess <- train <- app."""
    graph = _import_graph()
    wrong = [f"{m} ({_folder_room(m)}) imports {t} ({_folder_room(t)})" for m, ts in sorted(graph.items())
             for t in sorted(ts) if _folder_room(t) != _folder_room(m)
             and _folder_room(t) not in _FOLDER_ROOMS[_folder_room(m)]]
    assert not wrong, "\n".join(wrong)
    state, path, loops = {}, [], []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                loops.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not loops, "\n".join(loops[:10])


# Inside the collective layer: base <- traced (torch.compile's functional collectives) <- p2p <- collectives <-
# autograd <- indexed, and halo on p2p
_COMM_BELOW = {"base": set(), "traced": {"base"}, "p2p": {"base", "traced"},
               "collectives": {"base", "traced", "p2p"}, "halo": {"base", "traced", "p2p"},
               "autograd": {"base", "traced", "p2p", "collectives"},
               "indexed": {"base", "traced", "p2p", "collectives", "autograd"}}


def test_comm_modules_import_only_those_below():
    """The comm package's modules form a chain, not a circle; only its __init__ gathers them."""
    files = dict((m.rpartition(".")[2], (path, m)) for path, m in _module_files("domainflow/comm", "domainflow.comm")
                 if m != "domainflow.comm")
    assert sorted(files) == sorted(_COMM_BELOW)
    for name, (path, module) in files.items():
        used = {t.split(".")[2] for t in _imports(path, module) if t.startswith("domainflow.comm.")}
        assert used <= _COMM_BELOW[name], (name, used - _COMM_BELOW[name])


def test_engine_never_imports_the_rules():
    """The engine runs plans; the rules in ops/ register themselves (the registry is how they meet)."""
    for path, module in _module_files("domainflow/dispatch", "domainflow.dispatch"):
        assert not any(t.startswith("domainflow.ops") for t in _imports(path, module)), path


def test_train_has_no_import_circle():
    """train/'s modules import each other without a loop (build.py holds what loop and predict share)."""
    graph = {}
    for path, module in _module_files("train", "domainflow.train"):
        graph[module] = {t for t in _imports(path, module) if t.startswith("domainflow.train") and t != module}
    modules = set(graph)
    graph = {m: {t for t in ts if t in modules} for m, ts in graph.items()}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for t in sorted(graph[m]):
            if not m.startswith(t + ".") and not (t == "domainflow.train" and m.startswith(t)):
                visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_shard_tensor_module_alone_loads_the_engine_on_first_use(first_imports):
    """Importing the tensor layer directly (no ``domainflow.X`` access first) still dispatches ops (a child of
    ``first_imports``)."""
    code, said = first_imports[_TENSOR_LAYER_ALONE]
    assert code == 0 and said == "ok", said


def test_the_data_commands_never_import_torch(tmp_path):
    """synth, ingest and inspect through the one ``domainflow`` command (which also assembles the training
    commands) never import torch: ingest processes and the workers they fork stay light."""
    code = (f"import sys; from domainflow.app.cli import main; raw, store = {str(tmp_path / 'raw')!r}, "
            f"{str(tmp_path / 's.zarr')!r}; "
            "assert main(['synth', 'drivaerml', raw, '--runs', '2', '--cells', '400', '--volume-cells', '200', "
            "'--quiet']) == 0; "
            "assert main(['ingest', 'drivaerml', raw, store, '--parts', '2', '--locations', 'surface', '--quiet']) == 0; "
            "assert main(['inspect', store]) == 0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def _name_room(module: str) -> str:
    """A module's room: the first two dotted components (``domainflow.dispatch``, ``domainflow.readers``,
    ``domainflow.memo``); the package root is a room of its own."""
    return ".".join(module.split(".")[:2])


def test_no_underscore_name_is_imported_from_another_room():
    """A name with a leading underscore is private to its room: no module imports one from another room
    (``from domainflow.tensor.shard_tensor import _x`` in ops/) or reaches one through a module it imported
    (``toolkit._x``); what another room needs is public, or lives where it is used. A violation names the
    file, the line and the name."""
    import ast

    files = {m: p for folder, prefix in (("domainflow", "domainflow"), ("readers", "domainflow.readers"),
                                         ("preprocess", "domainflow.preprocess"), ("train", "domainflow.train"))
             for p, m in _module_files(folder, prefix)}
    wrong = []
    for module, path in sorted(files.items()):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        aliases = {}  # local name -> one of our modules it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "domainflow":
                        aliases[a.asname or "domainflow"] = a.name if a.asname else "domainflow"
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package.split(".")
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "domainflow":
                    continue
                for a in node.names:
                    if f"{base}.{a.name}" in files:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    if a.name.startswith("_") and not a.name.startswith("__") \
                            and _name_room(base) != _name_room(module):
                        wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {a.name} from {base}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    target = ".".join([aliases[value.id], *reversed(chain)])
                    if _name_room(target) != _name_room(module):
                        wrong.append(f"{path.relative_to(REPO)}:{node.lineno} uses {target}.{node.attr}")
    assert not wrong, "\n".join(wrong)
