"""ReduceXxx, ArgMax and ArgMin against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx_util import assert_matches_ort, single_op

from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceSumSquare",
]
FP16 = 2e-2


def axes_are_input(op: str, opset: int) -> bool:
    return opset >= (13 if op == "ReduceSum" else 18)


def reduce_model(op, x, axes=None, keepdims=1, opset=18, noop=None):
    """One reduce node; ``axes`` goes wherever ``opset`` puts it (None: omitted)."""
    attrs = {"keepdims": keepdims}
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    inits = {}
    if axes is not None:
        if axes_are_input(op, opset):
            inits["axes"] = np.asarray(axes, dtype=np.int64)
        else:
            attrs["axes"] = list(axes)
    return single_op(op, {"x": x}, attrs, inits, opset=opset)


def sample(op, shape, dtype=np.float32, seed=0):
    """Random input; ReduceProd gets magnitudes near 1 so products stay well scaled."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        high = 3 if op == "ReduceProd" else 20
        return rng.integers(-high, high + 1, shape).astype(dtype)
    if op == "ReduceProd":
        x = rng.uniform(0.7, 1.3, shape) * rng.choice([-1.0, 1.0], shape)
    else:
        x = rng.standard_normal(shape) * 2
    return x.astype(dtype)


AXES_4D = [None, [0], [-1], [1, 3], [-3, 2], [3, 0, 1], [0, 1, 2, 3]]


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", AXES_4D, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_input_opset18(op, axes, keepdims):
    x = sample(op, (2, 3, 4, 5))
    assert_matches_ort(reduce_model(op, x, axes, keepdims, opset=18), {"x": x})


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [None, [1], [-1, 0]], ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_older_opsets(op, axes, keepdims, opset):
    """Attribute axes (and ReduceSum's input axes from opset 13)."""
    x = sample(op, (3, 4, 5), seed=1)
    assert_matches_ort(reduce_model(op, x, axes, keepdims, opset=opset), {"x": x})


@pytest.mark.parametrize("shape,axes", [((7,), [0]), ((7,), None), ((6, 5), [1]), ((6, 5), [-2])], ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_low_rank(op, shape, axes):
    x = sample(op, shape, seed=2)
    for keepdims in (0, 1):
        assert_matches_ort(reduce_model(op, x, axes, keepdims), {"x": x})


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_float16(op):
    x = sample(op, (4, 6, 33), np.float16, seed=3)
    for axes, keepdims in (([2], 1), ([0, 2], 0), (None, 0)):
        assert_matches_ort(reduce_model(op, x, axes, keepdims), {"x": x}, threshold=FP16)


def test_reduce_mean_float16_sum_would_overflow():
    """The sum exceeds float16's range although the mean does not."""
    x = np.full((1, 4096), 60000.0, np.float16) * np.float16(0.5)
    assert_matches_ort(reduce_model("ReduceMean", x, [1]), {"x": x}, threshold=FP16)
    assert_matches_ort(reduce_model("ReduceL2", x / np.float16(100), [1]), {"x": x}, threshold=FP16)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("op", [op for op in REDUCE_OPS if op != "ReduceLogSumExp"])
def test_reduce_integers(op, dtype):
    """ReduceMean truncates; L2 is computed in floating point and truncated."""
    x = sample(op, (5, 7), dtype, seed=4)
    for axes in ([1], [0], None):
        assert_matches_ort(reduce_model(op, x, axes, 0), {"x": x})


@pytest.mark.parametrize("given_axes", ["missing", "empty"])
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_noop_with_empty_axes(op, given_axes):
    x = sample(op, (3, 4), seed=5)
    axes = None if given_axes == "missing" else []
    assert_matches_ort(reduce_model(op, x, axes, 1, noop=1), {"x": x})


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_empty_axes_without_noop_reduce_everything(op):
    x = sample(op, (3, 4), seed=6)
    assert_matches_ort(reduce_model(op, x, [], 0, noop=0), {"x": x})


def test_reduce_sum_noop_opset13():
    x = sample("ReduceSum", (3, 4))
    assert_matches_ort(reduce_model("ReduceSum", x, None, 1, opset=13, noop=1), {"x": x})


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", [op for op in REDUCE_OPS if op != "ReduceMean"])
def test_reduce_empty_set(op, keepdims):
    """Reducing zero elements gives the reduction's identity (after post-processing)."""
    x = np.zeros((2, 0, 3), np.float32)
    assert_matches_ort(reduce_model(op, x, [1], keepdims), {"x": x})
    assert_matches_ort(reduce_model(op, x, [0], keepdims), {"x": x})  # empty output


def test_reduce_mean_empty_set_is_nan():
    x = np.zeros((2, 0), np.float32)
    (out,) = import_onnx(reduce_model("ReduceMean", x, [1], 0)).run({"x": x}).values()
    assert out.shape == (2,) and np.isnan(out).all()


def test_log_sum_exp_infinities():
    """Rows of -inf give -inf, rows containing +inf give +inf, no NaN."""
    x = np.array([[-np.inf, -np.inf, -np.inf], [1.0, np.inf, 2.0], [0.5, -np.inf, 3.0]], np.float32)
    assert_matches_ort(reduce_model("ReduceLogSumExp", x, [1], 0), {"x": x})


def test_log_sum_exp_large_values_are_stable():
    x = (np.random.default_rng(7).standard_normal((4, 50)) * 30 + 500).astype(np.float32)
    assert_matches_ort(reduce_model("ReduceLogSumExp", x, [1], 1), {"x": x})


@settings(max_examples=25, deadline=None)
@given(
    op=st.sampled_from(REDUCE_OPS),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
    keepdims=st.integers(0, 1),
)
def test_reduce_random_axes(op, shape, data, keepdims):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(-rank, rank - 1), max_size=rank, unique_by=lambda a: a % rank))
    x = sample(op, tuple(shape), seed=8)
    assert_matches_ort(reduce_model(op, x, axes, keepdims), {"x": x})


# -- graph structure ---------------------------------------------------------------------------


def reductions(graph):
    return [n.compute for n in graph if n.compute.is_reduction]


@pytest.mark.parametrize("keepdims", [0, 1])
def test_keepdims_costs_no_extra_compute(keepdims):
    x = sample("ReduceSum", (2, 3, 4))
    graph = import_onnx(reduce_model("ReduceSum", x, [1], keepdims))
    (only,) = list(graph)
    assert only.compute.shape == ((2, 1, 4) if keepdims else (2, 4))
    assert [a.extent for a in only.compute.reduce_axes] == [3]


@pytest.mark.parametrize(
    "op,expected",
    [("ReduceMean", (1, 2)), ("ReduceL2", (1, 2)), ("ReduceMax", (1, 1)), ("ReduceLogSumExp", (2, 5))],
)
def test_one_reduction_and_injective_post_processing(op, expected):
    x = sample(op, (2, 3, 4))
    graph = import_onnx(reduce_model(op, x, [0, 2], 1))
    assert (len(reductions(graph)), len(list(graph))) == expected
    for c in reductions(graph):
        assert sorted(a.extent for a in c.reduce_axes) == [2, 4]


# -- ArgMax / ArgMin ----------------------------------------------------------------------------


def with_ties(shape, dtype=np.float32, seed=0):
    """Few distinct values, so first and last extreme indices differ."""
    return np.random.default_rng(seed).integers(0, 3, shape).astype(dtype)


@pytest.mark.parametrize("select_last_index", [0, 1])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1, -3])
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_reduce(op, axis, keepdims, select_last_index):
    x = with_ties((3, 4, 5))
    attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": select_last_index}
    assert_matches_ort(single_op(op, {"x": x}, attrs, opset=13), {"x": x})


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64, np.float64])
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_reduce_dtypes_and_ranks(op, dtype):
    for shape in ((9,), (6, 7), (2, 3, 4, 5)):
        x = with_ties(shape, dtype, seed=len(shape))
        for last in (0, 1):
            attrs = {"axis": -1, "keepdims": 0, "select_last_index": last}
            assert_matches_ort(single_op(op, {"x": x}, attrs, opset=13), {"x": x})


def test_arg_reduce_default_attributes_opset11():
    x = sample("ArgMax", (4, 5))
    assert_matches_ort(single_op("ArgMax", {"x": x}, opset=11), {"x": x})


# -- errors ---------------------------------------------------------------------------------------


def test_duplicate_axes_rejected():
    x = sample("ReduceSum", (2, 3))
    with pytest.raises(ModelError, match=r"reducesum_0.*twice"):
        import_onnx(reduce_model("ReduceSum", x, [1, -1]))


def test_axis_out_of_range_rejected():
    x = sample("ReduceMax", (2, 3))
    with pytest.raises(ModelError, match=r"reducemax_0.*out of range"):
        import_onnx(reduce_model("ReduceMax", x, [2]))
    with pytest.raises(ModelError, match=r"argmax_0.*out of range"):
        import_onnx(single_op("ArgMax", {"x": x}, {"axis": -3}, opset=13))


def test_axes_in_the_wrong_place_rejected():
    x = sample("ReduceMax", (2, 3))
    as_attribute = single_op("ReduceMax", {"x": x}, {"axes": [1]}, opset=18)
    with pytest.raises(ModelError, match=r"reducemax_0.*opset 18.*second input"):
        import_onnx(as_attribute)
    as_input = single_op("ReduceMax", {"x": x}, {}, {"axes": np.array([1], np.int64)}, opset=13)
    with pytest.raises(ModelError, match=r"reducemax_0.*opset 13.*attribute"):
        import_onnx(as_input)


def test_axes_must_be_constant():
    x = sample("ReduceSum", (2, 3))
    model = single_op("ReduceSum", {"x": x, "axes": np.array([1], np.int64)}, opset=13)
    with pytest.raises(UnsupportedError, match=r"reducesum_0.*axes.*constant"):
        import_onnx(model)


def test_integer_log_sum_exp_rejected():
    x = sample("ReduceLogSumExp", (2, 3), np.int32)
    with pytest.raises(UnsupportedError, match=r"reducelogsumexp_0.*int32"):
        import_onnx(reduce_model("ReduceLogSumExp", x, [1]))


def test_empty_set_argmin_and_integer_mean_rejected():
    x = np.zeros((2, 0, 3), np.float32)
    with pytest.raises(UnsupportedError, match=r"reducemean_0.*int32.*empty"):
        import_onnx(reduce_model("ReduceMean", x.astype(np.int32), [1]))
    with pytest.raises(UnsupportedError, match=r"argmin_0.*empty"):
        import_onnx(single_op("ArgMin", {"x": x}, {"axis": 1}, opset=13))
