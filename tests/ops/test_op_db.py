"""PyTorch's op database as a standing test: a fixed sample of ``op_db`` (every eighth op by name, plus every op
known to fail), each op's first two float64 samples sharded unevenly on 2 and 3 ranks (an empty shard included),
forward and input gradient against one process (``tests/harness/op_db_cases.py``). An op must give the result
of one process, or be refused by name; a refused op runs again under the opt-in ``fallback("gather")``, which
must then give the one-process result. ``op_db_refusals.json`` (written by ``benchmarks/op_db_sweep.py
--update-refusals``, which runs every op) lists the refused ops (``gather``: exact under the fallback;
``refused``: refused even then) and the wrong results and crashes not fixed yet: the test fails when an op that
ran is refused, when a listed op starts to run (update the list), and on any wrong result or crash not listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch's op database needs it (the test extra installs it)

LISTS = json.loads((Path(__file__).with_name("op_db_refusals.json")).read_text())
UPDATE = "update the lists: .venv/bin/python benchmarks/op_db_sweep.py --update-refusals"


def _sample() -> list[str]:
    from op_db_cases import candidate_ops, case_name

    names = sorted({case_name(o) for o in candidate_ops()})
    known = {n for bad in LISTS["wrong_or_crash"].values() for n in bad}
    return sorted(set(names[::8]) | (known & set(names)))


@pytest.mark.parametrize("world", [2, 3])
def test_op_db_sample_runs_exactly_or_is_refused_by_name(dist, world):
    from op_db_cases import sweep

    names = dist.run(world, _sample)[0]  # the ranks import torch's op database anyway; this process need not
    full = sweep(dist, world, names)
    got = {n: v.split(":")[0] for n, v in full.items()}
    listed = {n: k for n, k in LISTS["refused"][str(world)].items() if n in got}
    known_bad = LISTS["wrong_or_crash"][str(world)]
    new_bad = {n: full[n] for n, k in got.items() if k in ("wrong", "crash") and n not in known_bad}
    assert not new_bad, "wrong results or crashes:\n" + "\n".join(f"{n}: {v}" for n, v in new_bad.items())
    worse = {n: full[n] for n, k in got.items() if k in ("gather", "refused") and listed.get(n, "exact") != k
             and not (k == "gather" and listed.get(n) == "refused")}
    assert not worse, "refused now, ran before (or ran under fallback('gather') before):\n" + "\n".join(
        f"{n}: {v}" for n, v in sorted(worse.items()))
    better = sorted(n for n, k in listed.items() if got[n] != k)
    fixed = sorted(n for n in known_bad if n in got and got[n] not in ("wrong", "crash"))
    assert not better and not fixed, f"these run now: {better + fixed}; {UPDATE}"
