"""Memory of reading a decomposed OpenFOAM case: processor by processor and block by block (what ``ingest cfd``
does) against VTK's merged read of the whole case (what it did before), on a case OpenFOAM itself writes here.

The case: icoFoam's cavity tutorial with its mesh refined to N x N x 1 hex cells (``blockMesh``), decomposed
into P processors (``decomposePar``, method simple); each processor's time 0 fields are copied to time 0.1 so
the processors hold a time the case folder lacks, as after a parallel run (the solver itself is not run: the
read does not depend on the values). Each read runs in a fresh process; its peak resident memory (``ru_maxrss``
of the process, no children) is reported with the cells it returned.

Run: .venv/bin/python benchmarks/openfoam_decomposed.py [--cells-per-side 1000] [--processors 8] (about 40 s)
Needs OpenFOAM's commands (Debian: ``apt-get install openfoam openfoam-examples``) and pyvista.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import write_results  # noqa: E402

EXAMPLES = Path(os.environ.get("FOAM_EXAMPLES", "/usr/share/doc/openfoam-examples/examples"))
BLOCKS = ("internalMesh", "patch/movingWall", "patch/fixedWalls")

_READ = r'''
import json, resource, sys, time
from pathlib import Path
from domainflow.vtk.pyvista_io import openfoam_pieces, read_cells
case, how = Path(sys.argv[1]), sys.argv[2]
t0 = time.perf_counter()
cells = 0
blocks = %r
if how == "whole":  # VTK's merged read of the decomposed case, one block at a time
    for b in blocks:
        mesh, raw = read_cells(case, {"p": "cell", "U": "cell"}, openfoam=((b,), None))
        cells += mesh.n_cells
        del mesh, raw
else:  # what ingest does: one processor's block at a time
    for b in blocks:
        for piece in openfoam_pieces(case):
            mesh, raw = read_cells(piece, {"p": "cell", "U": "cell"}, openfoam=((b,), None), allow_empty=True)
            cells += mesh.n_cells
            del mesh, raw
print(json.dumps({"cells": cells, "seconds": time.perf_counter() - t0,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
''' % (BLOCKS,)


def make_case(root: Path, n: int, procs: int) -> Path:
    env = {**os.environ, "WM_PROJECT_DIR": os.environ.get("WM_PROJECT_DIR", "/usr/share/openfoam")}
    case = root / "cavity"
    shutil.copytree(EXAMPLES / "incompressible/icoFoam/cavity/cavity", case)
    mesh_dict = case / "system" / "blockMeshDict"
    mesh_dict.write_text(re.sub(r"\(20 20 1\)", f"({n} {n} 1)", mesh_dict.read_text()))
    (case / "system" / "decomposeParDict").write_text(
        "FoamFile { version 2.0; format ascii; class dictionary; object decomposeParDict; }\n"
        f"numberOfSubdomains {procs};\nmethod simple;\ncoeffs {{ n ({procs} 1 1); }}\n")
    for cmd in (["blockMesh"], ["decomposePar"]):
        r = subprocess.run(cmd, cwd=case, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{cmd[0]} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    for p in case.glob("processor*"):
        shutil.copytree(p / "0", p / "0.1")  # a time only the processors hold, as after a parallel run
    return case


def read(case: Path, how: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _READ, str(case), how], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{how} read failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells-per-side", type=int, default=1000)
    parser.add_argument("--processors", type=int, default=8)
    args = parser.parse_args()
    if shutil.which("blockMesh") is None or not EXAMPLES.is_dir():
        print("OpenFOAM is not installed (apt-get install openfoam openfoam-examples); nothing measured")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        case = make_case(Path(tmp), args.cells_per_side, args.processors)
        made = time.perf_counter() - t0
        rows = {how: read(case, how) for how in ("pieces", "whole")}
    print(f"case: {args.cells_per_side ** 2} cells on {args.processors} processors (made in {made:.1f} s)")
    print(f"{'read':>8}  {'cells':>9}  {'peak MiB':>9}  {'seconds':>8}")
    for how, r in rows.items():
        print(f"{how:>8}  {r['cells']:>9}  {r['peak_mib']:>9.0f}  {r['seconds']:>8.1f}")
    ratio = rows["whole"]["peak_mib"] / rows["pieces"]["peak_mib"]
    print(f"whole / pieces peak memory: {ratio:.2f}x")
    write_results("openfoam_decomposed", {"cells": args.cells_per_side ** 2, "processors": args.processors,
                                          "reads": rows, "whole_over_pieces_peak": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
