"""Mergeable normalisation statistics (preprocess.stats) against numpy on the concatenated data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from domainflow.preprocess.stats import RunningStats, merge_all


@pytest.mark.parametrize("seed", range(20))
def test_merging_any_split_equals_numpy(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 5.0, size=(rng.integers(1, 400), 3)) * [1.0, 1e3, 1e-3]
    cuts = np.sort(rng.integers(0, len(x), size=rng.integers(0, 6)))
    pieces = np.split(x, cuts)
    rng.shuffle(pieces)
    s = merge_all(RunningStats.of(p) for p in pieces)
    assert s.count == len(x)
    np.testing.assert_allclose(s.mean, x.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.std, x.std(0), rtol=1e-10)
    np.testing.assert_array_equal(s.min, x.min(0))
    np.testing.assert_array_equal(s.max, x.max(0))


def test_attrs_round_trip_and_json():
    x = np.arange(12.0).reshape(6, 2)
    s = RunningStats.of(x)
    d = json.loads(json.dumps(s.to_attrs()))
    back = RunningStats.from_attrs(d)
    np.testing.assert_allclose(back.m2, s.m2)
    assert d["count"] == 6 and d["mean"] == [5.0, 6.0]


def test_empty_and_bad_values():
    e = RunningStats.empty(2)
    s = RunningStats.of(np.ones((3, 2)))
    assert e.merge(s) is s and s.merge(e) is s
    assert merge_all([]) is None
    with pytest.raises(ValueError, match="NaN"):
        RunningStats.of(np.array([1.0, np.nan]))
