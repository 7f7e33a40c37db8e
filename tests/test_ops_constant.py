"""Constant-producing and aliasing lowerings (welder/frontend/ops/constant.py), and the
folding of the shape arithmetic exported models carry."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_util import assert_matches_ort, make_model, single_op

from welder.errors import UnsupportedError
from welder.frontend.onnx import import_onnx


def sample(shape, dtype: str = "float32", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.startswith("int"):
        return rng.integers(-100, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def op_types(model) -> set[str]:
    return {n.op_type for n in import_onnx(model).nodes.values()}


# -- aliases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "float16"])
def test_identity(dtype):
    x = sample((2, 3), dtype)
    assert_matches_ort(single_op("Identity", {"x": x}), {"x": x})


def test_identity_chain_and_constant():
    x = sample((4,))
    nodes = [
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Identity", ["a"], ["b"]),
        helper.make_node("Identity", ["w"], ["c"]),
        helper.make_node("Add", ["b", "c"], ["y"]),
    ]
    model = make_model(nodes, {"x": x}, ["b", "c", "y"], {"w": sample((4,), seed=1)})
    assert_matches_ort(model, {"x": x})


@pytest.mark.parametrize(
    ("opset", "inputs"),
    [(11, []), (12, ["ratio"]), (13, ["ratio", "training_mode"]), (13, ["", "training_mode"])],
)
@pytest.mark.parametrize("mask", [False, True])
def test_dropout_inference(opset, inputs, mask):
    x = sample((3, 5))
    consts = {"ratio": np.asarray(0.3, np.float32), "training_mode": np.asarray(False)}
    consts = {k: v for k, v in consts.items() if k in inputs}
    attrs = {"ratio": 0.3} if opset < 12 else {}
    model = single_op("Dropout", {"x": x}, attrs, consts, 2 if mask else 1, opset, ["x", *inputs])
    assert_matches_ort(model, {"x": x})


def test_dropout_training_is_refused():
    x = sample((3,))
    model = single_op("Dropout", {"x": x}, None, {"r": np.asarray(0.5, np.float32), "t": np.asarray(True)})
    with pytest.raises(UnsupportedError, match=r"dropout_0.*only inference"):
        import_onnx(model)
    model = single_op(
        "Dropout",
        {"x": x, "t": np.asarray(False)},
        None,
        {"r": np.asarray(0.5, np.float32)},
        input_order=["x", "r", "t"],
    )
    with pytest.raises(UnsupportedError, match=r"dropout_0.*training_mode.*must be a constant"):
        import_onnx(model)


# -- Constant, Shape, Size ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [
        {"value": numpy_helper.from_array(sample((2, 3)))},
        {"value": numpy_helper.from_array(sample((4,), "int64"))},
        {"value": numpy_helper.from_array(sample((2, 2), "bool"))},
        {"value": numpy_helper.from_array(np.asarray(3.5, np.float32))},
        {"value_float": 1.25},
        {"value_floats": [1.0, -2.0, 3.5]},
        {"value_int": -7},
        {"value_ints": [3, 1, 4]},
    ],
)
def test_constant(attrs):
    node = helper.make_node("Constant", [], ["c"], name="constant_0", **attrs)
    model = make_model([node, helper.make_node("Identity", ["c"], ["y"])], {}, ["c", "y"], opset=13)
    assert_matches_ort(model, {})


def test_constant_string_is_refused():
    node = helper.make_node("Constant", [], ["c"], name="constant_0", value_strings=["a"])
    with pytest.raises(UnsupportedError, match=r"constant_0.*only tensor"):
        import_onnx(make_model([node], {}, ["c"], opset=13))


@pytest.mark.parametrize(
    ("opset", "start", "end"),
    [(13, None, None), (15, 1, None), (15, -2, None), (15, 0, -1), (15, -10, 10), (15, 2, 1), (19, 3, 4)],
)
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), ()])
def test_shape(opset, start, end, shape):
    x = sample(shape)
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    assert_matches_ort(single_op("Shape", {"x": x}, attrs, opset=opset), {"x": x})


@pytest.mark.parametrize("shape", [(2, 3), (), (0, 4)])
def test_size(shape):
    x = sample(shape, "int64")
    assert_matches_ort(single_op("Size", {"x": x}), {"x": x})


# -- Range and ConstantOfShape -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "limit", "delta", "dtype"),
    [
        (0, 10, 1, "int64"),
        (10, 0, -3, "int64"),
        (0, 5, 2, "int32"),
        (1, 1, 1, "int64"),
        (5, 0, 1, "int64"),
        (0.0, 1.0, 0.1, "float32"),
        (-2.5, 3.7, 0.45, "float32"),
        (3.0, -1.0, -0.5, "float32"),
        (1.0, 2.0, 0.25, "float64"),
    ],
)
def test_range(start, limit, delta, dtype):
    consts = {k: np.asarray(v, dtype=dtype) for k, v in (("s", start), ("l", limit), ("d", delta))}
    model = single_op("Range", {}, None, consts, opset=13)
    assert_matches_ort(model, {})
    graph = import_onnx(model)
    assert not graph.nodes and graph.outputs[0] in graph.constants


def test_range_is_refused_for_runtime_limits():
    model = single_op(
        "Range",
        {"l": np.asarray(4, np.int64)},
        None,
        {"s": i64(0), "d": i64(1)},
        opset=13,
        input_order=["s", "l", "d"],
    )
    with pytest.raises(UnsupportedError, match=r"Range node 'range_0'.*limit.*must be a constant"):
        import_onnx(model)


@pytest.mark.parametrize(
    "value",
    [
        None,
        np.asarray([1.5], np.float32),
        np.asarray([7], np.int64),
        np.asarray([True]),
        np.asarray([-2], np.int32),
        np.asarray([0.5], np.float16),
    ],
)
@pytest.mark.parametrize("shape", [[2, 3], [], [0, 4], [5]])
def test_constant_of_shape(value, shape):
    attrs = {"value": numpy_helper.from_array(value)} if value is not None else {}
    model = single_op("ConstantOfShape", {}, attrs, {"shape": i64(shape)}, opset=13)
    assert_matches_ort(model, {})


def test_large_constant_of_shape_stays_a_compute():
    """A big fill is a loads-free compute, not hundreds of kilobytes of weights."""
    x = sample((300, 300))
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node(
            "ConstantOfShape", ["s"], ["z"], value=numpy_helper.from_array(np.asarray([2.0], np.float32))
        ),
        helper.make_node("Mul", ["x", "z"], ["y"]),
    ]
    model = make_model(nodes, {"x": x}, ["y"], opset=13)
    assert_matches_ort(model, {"x": x})
    graph = import_onnx(model)
    assert max((c.size for c in graph.constants.values()), default=0) < x.size
    (fill,) = [n for n in graph.nodes.values() if n.op_type == "ConstantOfShape"]
    assert fill.compute.shape == x.shape and not fill.compute.inputs


def test_constant_of_shape_is_refused_for_runtime_shape():
    model = single_op("ConstantOfShape", {"shape": i64([2, 3])}, opset=13)
    with pytest.raises(UnsupportedError, match=r"constantofshape_0.*must be a constant"):
        import_onnx(model)


# -- folding of exported shape arithmetic ------------------------------------------------------


def _split_heads_model(opset: int):
    """``x.view(B, S, heads, -1)`` the way torch exports it: the batch and sequence sizes are
    read from the tensor at run time, so Reshape's shape is computed by a small subgraph."""
    x = sample((2, 6, 8))

    def unsqueeze(src: str, dst: str) -> list:
        if opset >= 13:
            return [helper.make_node("Unsqueeze", [src, "zero"], [dst])]
        return [helper.make_node("Unsqueeze", [src], [dst], axes=[0])]

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero_s"], ["batch"], axis=0),
        helper.make_node("Gather", ["shape", "one_s"], ["seq"], axis=0),
        *unsqueeze("batch", "batch1"),
        *unsqueeze("seq", "seq1"),
        helper.make_node("Concat", ["batch1", "seq1", "heads", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["split"]),
        helper.make_node("Transpose", ["split"], ["y"], perm=[0, 2, 1, 3]),
    ]
    consts = {"zero_s": i64(0), "one_s": i64(1), "zero": i64([0]), "heads": i64([2]), "minus_one": i64([-1])}
    return make_model(nodes, {"x": x}, ["y"], consts, opset=opset), x


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_shape_chain_folds_away(opset):
    model, x = _split_heads_model(opset)
    assert_matches_ort(model, {"x": x})
    assert op_types(model) == {"Reshape", "Transpose"}


def test_range_and_fill_from_shape_fold():
    """Position ids and attention masks built from a runtime shape become constants."""
    x = sample((2, 5), "int64")
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
        helper.make_node("ConstantOfShape", ["shape"], ["mask"], value=numpy_helper.from_array(i64([1]))),
        helper.make_node("Add", ["x", "positions"], ["y"]),
        helper.make_node("Mul", ["y", "mask"], ["z"]),
    ]
    model = make_model(nodes, {"x": x}, ["z"], {"zero": i64(0), "one": i64(1)}, opset=13)
    assert_matches_ort(model, {"x": x})
    assert op_types(model) == {"Add", "Mul"}


def test_bool_and_dtype_of_fill_match_inference():
    """ONNX shape inference cross-checks the dtype the fill carries."""
    value = numpy_helper.from_array(np.asarray([1], np.uint8))
    node = helper.make_node("ConstantOfShape", ["s"], ["c"], value=value)
    model = make_model([node], {}, ["c"], {"s": i64([3])}, opset=13)
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("c", TensorProto.UINT8, [3]))
    assert import_onnx(model).run({})["c"].dtype == np.uint8
