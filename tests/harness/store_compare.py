"""Load a whole Zarr store into plain Python (arrays + attrs) so tests can compare stores exactly."""

from __future__ import annotations

import numpy as np


def load_store(path) -> dict:
    """{node path: ("array", ndarray, attrs) | ("group", attrs)} for every node of the store."""
    import zarr

    out = {}

    def visit(group, prefix):
        out[prefix or "/"] = ("group", dict(group.attrs))
        for name, arr in group.arrays():
            out[f"{prefix}/{name}"] = ("array", np.asarray(arr[...]), dict(arr.attrs), arr.chunks, str(arr.dtype))
        for name, sub in group.groups():
            visit(sub, f"{prefix}/{name}")

    visit(zarr.open_group(path, mode="r"), "")
    return out


def assert_same_store(a, b) -> None:
    """Same nodes, same attrs, same chunking, bit-identical array values."""
    sa, sb = load_store(a), load_store(b)
    assert sorted(sa) == sorted(sb), f"different nodes: {sorted(set(sa) ^ set(sb))}"
    for key in sa:
        x, y = sa[key], sb[key]
        assert x[0] == y[0], key
        if x[0] == "group":
            assert x[1] == y[1], f"attrs of {key} differ:\n{x[1]}\n{y[1]}"
        else:
            assert x[2] == y[2] and x[3] == y[3] and x[4] == y[4], f"metadata of {key} differs"
            assert x[1].shape == y[1].shape and np.array_equal(x[1], y[1], equal_nan=True), f"values of {key} differ"
