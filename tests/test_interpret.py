"""The vectorised interpreter against a naive scalar evaluator (tests/scalar_eval.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scalar_eval import eval_compute

from welder.frontend.registry import Tensor
from welder.ir import interpret
from welder.ir.compute import Compute, compute, reduce, reduce_axis
from welder.ir.expr import Load, Var, call, cast, ge, in_range, logical_and, lt, select

RNG = np.random.default_rng(0)


def t(name, arr):
    dtype = "bool" if arr.dtype == np.bool_ else arr.dtype.name
    return Tensor(name, arr.shape, dtype)


def check(c, tensors, tol=1e-5):
    got = interpret.evaluate(c, tensors)
    want = eval_compute(c, tensors)
    assert got.shape == c.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    return got


def test_matmul_goes_through_einsum_and_matches():
    a, b = RNG.standard_normal((5, 7)).astype(np.float32), RNG.standard_normal((7, 3)).astype(np.float32)
    A, B = t("A", a), t("B", b)
    k = reduce_axis(7)
    c = compute("C", (5, 3), lambda i, j: reduce("sum", A[i, k] * B[k, j], k))
    assert interpret._factors(c) is not None
    check(c, {"A": a, "B": b})


def test_padded_strided_conv():
    x = RNG.standard_normal((1, 2, 7, 6)).astype(np.float32)
    w = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)
    X, W = t("X", x), t("W", w)
    s, p = 2, 1

    def fn(n, co, h, ww):
        ci, kh, kw = reduce_axis(2), reduce_axis(3), reduce_axis(3)
        y, z = h * s + kh - p, ww * s + kw - p
        inside = logical_and(in_range(y, 0, 7), in_range(z, 0, 6))
        return reduce("sum", select(inside, X[n, ci, y, z], 0.0) * W[co, ci, kh, kw], [ci, kh, kw])

    c = compute("O", (1, 3, 4, 3), fn)
    check(c, {"X": x, "W": w})


def test_reduction_axis_absent_from_body_multiplies_by_extent():
    x = RNG.standard_normal((4,)).astype(np.float32)
    X = t("X", x)
    k = reduce_axis(5)
    c = compute("S", (4,), lambda i: reduce("sum", X[i], k))
    np.testing.assert_allclose(interpret.evaluate(c, {"X": x}), 5 * x, rtol=1e-6)


@pytest.mark.parametrize("op", ["max", "min", "prod", "argmax", "argmin"])
def test_other_reductions(op):
    x = RNG.standard_normal((3, 6)).astype(np.float32)
    x[1, 2] = x[1, 4] = x[1].max() + 1  # a tie: the first occurrence wins
    X = t("X", x)

    def fn(i):
        k = reduce_axis(6)
        return reduce(op, X[i, k], k)

    check(compute("R", (3,), fn), {"X": x})


def test_data_dependent_gather_and_integer_division():
    table = RNG.standard_normal((10, 4)).astype(np.float32)
    ids = np.array([[3, -1, 9], [0, 2, -10]], dtype=np.int64)
    T, I = t("T", table), t("I", ids)

    def fn(b, s, d):
        v = cast(I[b, s], "index")
        return T[select(lt(v, 0), v + 10, v), d]

    check(compute("G", (2, 3, 4), fn), {"T": table, "I": ids})
    q = compute("Q", (2, 3), lambda i, j: I[i, j] / 4)  # C division truncates towards zero
    got = check(q, {"I": ids})
    assert got[0, 1] == 0 and got[1, 2] == -2


def test_chunking_gives_the_same_result(monkeypatch):
    x = RNG.standard_normal((9, 8)).astype(np.float32)
    X = t("X", x)
    c = compute("E", (9, 8), lambda i, j: call("exp", X[i, j]) + X[j % 9, (i + j) % 8])
    whole = interpret.evaluate(c, {"X": x})
    monkeypatch.setattr(interpret, "_ELEMENTWISE_LIMIT", 10)
    np.testing.assert_array_equal(interpret.evaluate(c, {"X": x}), whole)


def test_fp16_sum_accumulates_in_fp32():
    x = np.full((1, 4096), 1.0, dtype=np.float16)  # an fp16 running sum would stall at 2048
    X = t("X", x)
    k = reduce_axis(4096)
    c = compute("S", (1,), lambda i: reduce("sum", X[i, k], k))
    assert interpret.evaluate(c, {"X": x})[0] == 4096


def test_empty_output_and_identity_of_reductions():
    X = t("X", np.zeros((0, 4), np.float32))
    k = reduce_axis(4)
    c = compute("S", (0,), lambda i: reduce("max", X[i, k], k))
    assert interpret.evaluate(c, {"X": np.zeros((0, 4), np.float32)}).shape == (0,)


@settings(max_examples=40, deadline=None)
@given(
    a=st.integers(-3, 3),
    b=st.integers(-3, 3),
    c0=st.integers(-6, 6),
    d=st.integers(1, 4),
    fn=st.sampled_from(["exp", "tanh", "abs", "sigmoid", "erf", "floor"]),
)
def test_random_affine_guarded_loads(a, b, c0, d, fn):
    """Affine + floordiv/mod index expressions, guarded where they may leave the tensor."""
    x = RNG.standard_normal((6, 5)).astype(np.float32)
    X = t("X", x)

    def body(i, j):
        r = i * a + j * b + c0
        q = r // d
        m = r % 5
        guard = in_range(q, 0, 6)
        return select(guard, call(fn, X[q, m]), 0.0) + cast(ge(r, 0), "float32")

    check(compute("Y", (4, 7), body), {"X": x})


def test_unbound_axis_is_rejected():
    with pytest.raises(ValueError, match="unbound"):
        Compute("Y", (), Load("X", (Var("nope"),), "float32"), "float32")
