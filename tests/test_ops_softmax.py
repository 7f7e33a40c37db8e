"""Softmax and LogSoftmax (welder/frontend/ops/norm.py) against onnxruntime.

Before opset 13 both operators flatten the input to 2-D at ``axis`` (default 1) and
normalise each row over all the trailing dimensions; from opset 13 they normalise over
the single dimension ``axis`` (default -1).  The two differ for every axis but the last
of an input of rank 3 or more, so each axis is checked under both.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx_util import assert_matches_ort, single_op

OPS = ["Softmax", "LogSoftmax"]


def rand(shape, dtype=np.float32, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal(shape) * scale, dtype=dtype)


def check(op: str, x: np.ndarray, opset: int, axis: int | None = None) -> None:
    attrs = {} if axis is None else {"axis": axis}
    assert_matches_ort(single_op(op, {"x": x}, attrs, opset=opset), {"x": x})


@pytest.mark.parametrize("opset", [11, 12, 13, 17, 21])
@pytest.mark.parametrize("axis", [None, 0, 1, 2, 3, -1, -2, -4])
@pytest.mark.parametrize("op", OPS)
def test_axis_semantics(op, axis, opset):
    """Every axis of a 4-D input (None: the opset's default) under the coerce-to-2D
    semantics of opsets 11-12 and the single-axis semantics of 13+."""
    check(op, rand((2, 3, 4, 5), seed=1), opset, axis)


@pytest.mark.parametrize("shape", [(7,), (1,), (3, 1), (1, 6), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", OPS)
def test_ranks_and_unit_axes(op, opset, shape):
    """Low ranks and normalised axes of extent one (the output is all ones / zeros)."""
    check(op, rand(shape, seed=2), opset, -1)
    check(op, rand(shape, seed=3), opset, 0)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", OPS)
def test_extreme_inputs(op, opset):
    """Large logits of both signs: exp must never see an unshifted input (exp(100)
    overflows float32, exp(-100) underflows to zero and log(0) is -inf)."""
    row = np.array([-100.0, -50.0, 0.0, 50.0, 100.0, 88.8, -88.8, 1e-30])
    x = np.stack([row, row + 1e4, row * 0.0, -row]).astype(np.float32)
    check(op, x, opset, -1)
    check(op, x, opset, 0)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", OPS)
def test_empty_batch(op, opset):
    """Rows of which there are none: an empty output."""
    check(op, np.zeros((0, 5), np.float32), opset, -1)


@pytest.mark.parametrize("op", OPS)
def test_empty_normalised_axis(op):
    check(op, np.zeros((2, 0, 3), np.float32), 13, 1)


@pytest.mark.parametrize("op", OPS)
def test_equal_logits(op):
    """A constant row gives exactly 1/n (log: -log n)."""
    x = np.full((3, 8), 7.5, dtype=np.float32)
    check(op, x, 13)


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("op", OPS)
def test_float16(op, opset, axis):
    check(op, rand((2, 16, 8), np.float16, seed=4), opset, axis)


@pytest.mark.parametrize("op", OPS)
def test_float64(op):
    check(op, rand((3, 5), np.float64, seed=5), 13, 1)


@pytest.mark.parametrize("op", OPS)
def test_attention_scores(op):
    """The shape transformers use: [batch, heads, query, key] over the keys."""
    check(op, rand((2, 4, 16, 16), seed=6), 13, -1)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
    op=st.sampled_from(OPS),
    opset=st.sampled_from([11, 12, 13, 18]),
    seed=st.integers(0, 2**16),
)
def test_random(shape, data, op, opset, seed):
    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1), label="axis")
    check(op, rand(tuple(shape), seed=seed), opset, axis)
