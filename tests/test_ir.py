"""Expressions and Computes: typing rules, exact simplification, canonical naming."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scalar_eval import eval_expr

from welder.frontend.registry import Tensor
from welder.ir.compute import compute, reduce, reduce_axis
from welder.ir.expr import INDEX, Binary, Const, Var, binary, call, cast, lt, nonnegative, select, substitute


def test_scalars_take_the_other_operands_dtype():
    x = Tensor("x", (4,), "float16")[Var("i")]
    assert (x * 0.5).dtype == "float16"
    assert (Var("i") + 1).dtype == INDEX


def test_mixed_dtypes_are_rejected():
    with pytest.raises(TypeError, match="dtypes differ"):
        Binary("add", Const(1.0, "float32"), Const(1.0, "float16"))
    with pytest.raises(TypeError, match="index"):
        Tensor("x", (4,), "float32")[Const(1.0, "float32")]


def test_select_of_constant_condition_folds():
    i = Var("i")
    assert select(Const(True, "bool"), i, i + 1) == i


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "sub", "mul", "floordiv", "mod"]), st.integers(-3, 5)),
        min_size=1,
        max_size=6,
    ),
    i=st.integers(-20, 20),
)
def test_index_simplification_is_exact(ops, i):
    """Whatever `binary` rewrites, the value at every point stays the same."""
    simplified, raw = Var("i"), Var("i")
    for op, c in ops:
        if op in ("floordiv", "mod") and c <= 0:
            c = 1 - c
        simplified = binary(op, simplified, c)
        raw = Binary(op, raw, Const(c, INDEX))
    assert eval_expr(simplified, {"i": i}, {}) == eval_expr(raw, {"i": i}, {})


@settings(max_examples=100, deadline=None)
@given(i=st.integers(-50, 50), j=st.integers(0, 9), c=st.integers(1, 7))
def test_split_and_joined_index_is_the_index(i, j, c):
    """``(x // c) * c + x % c`` (a reshape read through another) is ``x`` in either order,
    also where the operands differ only in part (then left as written, value kept)."""
    x = Var("i") * 10 + Var("j")
    assert (x // c) * c + x % c == x
    assert x % c + (x // c) * c == x
    other = (x // c) * c + Var("i") % c
    assert isinstance(other, Binary)
    raw = Binary("add", Binary("mul", Binary("floordiv", x, Const(c, INDEX)), Const(c, INDEX)), x % c)
    assert eval_expr(raw, {"i": i, "j": j}, {}) == i * 10 + j


def test_substitution_rewrites_each_variable_once():
    """A node that simplifies into one of its substituted parts is not substituted again:
    ``i0 * i1`` under ``{i0: i1, i1: 1}`` is ``i1``, and a joined index under a mapping that
    splits its own axis (``{i0: i0 // 4}``, as inlining a reshape does) keeps its value."""
    i0, i1 = Var("i0"), Var("i1")
    assert substitute(i0 * i1, {"i0": i1, "i1": Const(1, INDEX)}) == i1
    split = {"x": i0 // 4, "y": i0 % 4}
    joined = substitute(Var("x") * 4 + Var("y"), split)
    assert joined == i0
    nested = substitute((i0 // 4) * 4 + i0 % 4 + Var("y") * 0, {"i0": i0 // 4, "y": i1})
    for v in range(-9, 20):
        assert eval_expr(nested, {"i0": v, "i1": 3}, {}) == v // 4


def test_conv_offsets_collapse_into_one_constant():
    i = Var("i")
    assert str((i * 2 + 3) - 1) == "((i * 2) + 2)"


def test_compute_uses_canonical_axis_names():
    a = Tensor("A", (4, 8), "float32")
    b = Tensor("B", (8, 3), "float32")

    def make(name):
        k = reduce_axis(8)
        return compute(name, (4, 3), lambda i, j: reduce("sum", a[i, k] * b[k, j], k))

    c1, c2 = make("C"), make("C")
    assert c1 == c2 and hash(c1) == hash(c2)
    assert str(c1) == "C[i0:4, i1:3] = sum[r0:8] (A[i0, r0] * B[r0, i1])"
    assert c1.inputs == ("A", "B") and c1.is_reduction


def test_compute_checks_dtypes():
    x = Tensor("x", (2,), "float32")
    with pytest.raises(TypeError):
        compute("y", (2,), lambda i: x[i], dtype="float16")
    assert compute("y", (2,), lambda i: cast(lt(x[i], 0.0), "float32")).dtype == "float32"


def test_unknown_function_and_arity():
    with pytest.raises(ValueError):
        call("frobnicate", Const(1.0, "float32"))
    with pytest.raises(TypeError):
        call("fmod", Const(1.0, "float32"))


def test_odd_tensor_names_are_quoted_when_printed():
    x = Tensor("bert/layer 0[attn]", (2,), "float32")
    assert str(x[Var("i")]) == '"bert/layer 0[attn]"[i]'


_SIGNED_CALLS = ["exp", "sqrt", "abs", "sigmoid", "tanh", "neg", "erf"]
_SIGNED_OPS = ["add", "sub", "mul", "div", "max", "min"]


def _float_exprs() -> list:
    """Every expression of up to two levels over two loads and two constants (a second
    level with a leaf on one side): calls, arithmetic, squares and selects."""
    x = Tensor("x", (2,), "float32")
    leaves = [x[Const(0)], x[Const(1)], Const(0.0, "float32"), Const(-1.5, "float32")]

    def level(inner: list, other: list) -> list:
        out = [call(fn, a) for fn in _SIGNED_CALLS for a in inner] + [Binary("mul", a, a) for a in inner]
        for a in inner:
            for b in other:
                out += [Binary(op, a, b) for op in _SIGNED_OPS] + [Binary(op, b, a) for op in _SIGNED_OPS]
                out.append(select(lt(x[Const(0)], 0.0), a, b))
        return out

    first = level(leaves, leaves)
    return leaves + first + level(first, leaves)


def test_an_expression_called_nonnegative_never_evaluates_below_zero():
    """The sign analysis is conservative: where it says never negative, the naive
    evaluator finds no negative value on a grid of signed inputs (NaN and the
    arithmetic's errors aside)."""
    grid = [-3.0, -0.5, 0.0, 0.25, 2.0]
    checked = 0
    for e in _float_exprs():
        if not nonnegative(e):
            continue
        checked += 1
        for a in grid:
            for b in grid:
                try:
                    v = eval_expr(e, {}, {"x": np.array([a, b], np.float32)})
                except (ValueError, ZeroDivisionError, OverflowError):
                    continue
                assert math.isnan(v) or v >= 0, (str(e), a, b, v)
    assert checked > 500


def test_the_sign_analysis_knows_softmax_exponentials_and_relus():
    x = Tensor("x", (2,), "float32")[Var("i")]
    assert nonnegative(call("exp", x - 1.0))
    assert nonnegative(Binary("max", x, Const(0.0, "float32")))
    assert nonnegative(cast(call("exp", x), "float16"))
    assert not nonnegative(x)
    assert not nonnegative(call("exp", x) - 1.0)
    assert not nonnegative(Binary("max", x, Const(-1.0, "float32")))
