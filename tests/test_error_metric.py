"""``welder.check.error_metric`` against the definition, element by element in Python floats.

The metric decides every tuner check and test_acc verdict; its fast path works in float32
for narrow floats and in place, so it is compared here with a plain loop over dtypes,
special values and shapes."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from welder.check import error_metric


def brute_force(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |a - b| / max(|b|, 1); inf where a is not finite and b is, or where b is special
    and a differs from it (NaN matching NaN)."""
    if actual.shape != expected.shape:
        return math.inf
    worst = 0.0
    for x, y in zip(actual.reshape(-1).tolist(), expected.reshape(-1).tolist()):
        x, y = float(x), float(y)
        if math.isfinite(y):
            if not math.isfinite(x):
                return math.inf
            worst = max(worst, abs(x - y) / max(abs(y), 1.0))
        elif not (x == y or (math.isnan(x) and math.isnan(y))):
            return math.inf
    return worst


DTYPES = [np.float16, np.float32, np.float64, ml_dtypes.bfloat16, np.int64, np.int32]


REFERENCE_DTYPES = [np.float32, np.float16, np.float64, np.int64]


@pytest.mark.parametrize("got", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("want", REFERENCE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_metric_matches_its_definition(got: type, want: type) -> None:
    rng = np.random.default_rng(7)
    for trial in range(20):
        b = (rng.standard_normal(37) * 10.0 ** rng.integers(-3, 4)).astype(want)
        a = (b.astype(np.float64) + rng.standard_normal(37) * 10.0 ** -rng.integers(1, 6)).astype(got)
        floats = np.dtype(want).kind == "f" and np.dtype(got).kind != "i"
        if trial % 4 == 1 and floats:
            b[3], a[3] = np.nan, np.nan  # matching specials are fine
            b[5], a[5] = np.inf, np.inf
        if trial % 4 == 2 and np.dtype(got).kind != "i":
            a[11] = np.nan  # a NaN where the reference is finite
        if trial % 4 == 3 and floats:
            b[2] = -np.inf  # a special the back end does not reproduce
        expected = brute_force(a, b)
        got_metric = error_metric(a, b)
        if math.isinf(expected):
            assert math.isinf(got_metric)
        else:
            assert got_metric == pytest.approx(expected, rel=1e-6, abs=1e-12)
        assert not np.shares_memory(a, b)


def test_metric_leaves_its_arguments_alone_and_checks_shapes() -> None:
    a = np.array([5.0, -1.0], np.float32)
    b = np.array([4.0, -2.0], np.float32)
    assert error_metric(a, b) == pytest.approx(0.5)
    assert a.tolist() == [5.0, -1.0] and b.tolist() == [4.0, -2.0]
    assert error_metric(a, b[:1]) == math.inf
    assert error_metric(a[:0], b[:0]) == 0.0
