"""Data-movement lowerings (welder/frontend/ops/shape.py) against onnxruntime."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx_util import assert_matches_ort, single_op

from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx
from welder.ir.expr import Load, walk

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
DTYPES = ["float32", "int64", "bool"]


def sample(shape, dtype: str = "float32", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.startswith("int"):
        return rng.integers(-100, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def check(op: str, x: np.ndarray, attrs=None, consts=None, opset: int = 17, order=None, n_outputs=1) -> None:
    """One ``op`` node reading graph input ``x`` and constant inputs ``consts``."""
    model = single_op(op, {"x": x}, attrs, consts, n_outputs=n_outputs, opset=opset, input_order=order)
    assert_matches_ort(model, {"x": x})


def with_axes(op: str, x: np.ndarray, axes, opset: int, name: str = "axes", attrs=None, n_outputs=1):
    """``axes`` (or Split's ``split``) as an attribute before opset 13 and an input from it."""
    attrs = dict(attrs or {})
    if axes is None:
        return single_op(op, {"x": x}, attrs, n_outputs=n_outputs, opset=opset)
    if opset < 13:
        return single_op(op, {"x": x}, {**attrs, name: list(axes)}, n_outputs=n_outputs, opset=opset)
    return single_op(op, {"x": x}, attrs, {name: i64(axes)}, n_outputs=n_outputs, opset=opset)


def loaded_tensors(model) -> set[str]:
    graph = import_onnx(model)
    return {n.tensor for node in graph.nodes.values() for n in walk(node.compute.body) if isinstance(n, Load)}


# -- Reshape and friends -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "spec", "allowzero"),
    [
        ((2, 3, 4), [4, 6], 0),
        ((2, 3, 4), [0, -1], 0),
        ((2, 3, 4), [-1], 0),
        ((2, 3, 4), [2, 0, 2, 2], 0),
        ((2, 3, 4), [4, 0, -1], 0),
        ((1, 6), [6, 1], 0),
        ((2, 1, 3), [3, 2], 0),
        ((2, 3, 4), [2, 3, 4], 0),
        ((0, 3), [3, 0], 1),
        ((2, 0, 3), [0, -1], 0),
    ],
)
def test_reshape(shape, spec, allowzero, dtype):
    check("Reshape", sample(shape, dtype), {"allowzero": allowzero}, {"shape": i64(spec)})


def _groupings(draw, factors: list[int]) -> tuple[int, ...]:
    cuts = sorted(draw(st.sets(st.integers(1, max(len(factors) - 1, 1)), max_size=len(factors))))
    bounds = [0, *[c for c in cuts if c < len(factors)], len(factors)]
    return tuple(int(np.prod(factors[a:b])) for a, b in itertools.pairwise(bounds))


@st.composite
def reshape_pairs(draw):
    factors = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    return _groupings(draw, factors), _groupings(draw, factors)


@settings(max_examples=30, deadline=None)
@given(reshape_pairs())
def test_reshape_regroupings(pair):
    src, dst = pair
    check("Reshape", sample(src), None, {"shape": i64(dst)})


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ([-1, -1], "more than one -1"),
        ([5, 5], "cannot reshape"),
        ([-2, -3], "invalid entry"),
        ([0, 0, 0, 0], "lacks"),
    ],
)
def test_reshape_errors(spec, error):
    with pytest.raises(ModelError, match=f"reshape_0.*{error}"):
        import_onnx(single_op("Reshape", {"x": sample((2, 3, 1))}, None, {"shape": i64(spec)}, opset=13))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("perm", [None, [0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 2, 1]])
def test_transpose(perm, dtype):
    check("Transpose", sample((2, 3, 4), dtype), {"perm": perm} if perm else None)


def test_transpose_rank4_and_bad_perm():
    check("Transpose", sample((2, 3, 4, 5)), {"perm": [0, 2, 3, 1]})
    with pytest.raises(ModelError, match=r"transpose_0"):
        import_onnx(single_op("Transpose", {"x": sample((2, 3))}, {"perm": [0, 0]}))


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [-3, -1, 0, 1, 2, 3])
def test_flatten(axis, opset):
    check("Flatten", sample((2, 3, 4)), {"axis": axis}, opset=opset)


def test_flatten_default_and_bad_axis():
    check("Flatten", sample((2, 3, 4), "bool"))
    with pytest.raises(ModelError, match=r"flatten_0"):
        import_onnx(single_op("Flatten", {"x": sample((2, 3))}, {"axis": 3}))


@pytest.mark.parametrize("opset", [11, 13, 21])
@pytest.mark.parametrize("axes", [None, [0], [-1], [0, 2], [2, -3]])
@pytest.mark.parametrize("dtype", ["float32", "bool"])
def test_squeeze(axes, opset, dtype):
    x = sample((1, 3, 1), dtype)
    assert_matches_ort(with_axes("Squeeze", x, axes, opset), {"x": x})


@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze_errors(opset):
    with pytest.raises(ModelError, match=r"squeeze_0.*cannot squeeze"):
        import_onnx(with_axes("Squeeze", sample((1, 3)), [1], opset))
    with pytest.raises(ModelError, match=r"squeeze_0.*repeat"):
        import_onnx(with_axes("Squeeze", sample((1, 3)), [0, -2], opset))


def test_squeeze_empty_axes():
    x = sample((2, 3))
    assert_matches_ort(with_axes("Squeeze", x, [], 13), {"x": x})
    with pytest.raises(UnsupportedError, match=r"squeeze_0.*ambiguous"):
        import_onnx(with_axes("Squeeze", sample((1, 3)), [], 13))


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axes", [[0], [-1], [1, 3], [0, -1], [3, 0, 2]])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_unsqueeze(axes, opset, dtype):
    x = sample((2, 3), dtype)
    assert_matches_ort(with_axes("Unsqueeze", x, axes, opset), {"x": x})


@pytest.mark.parametrize("opset", [11, 13])
def test_unsqueeze_scalar(opset):
    x = sample((), "int64")
    assert_matches_ort(with_axes("Unsqueeze", x, [0], opset), {"x": x})


def test_reshape_family_stays_affine():
    """Squeeze/Unsqueeze/Flatten are index copies: no division appears in the index."""
    x = sample((2, 1, 3))
    for model in (
        with_axes("Unsqueeze", x, [0, 4], 13),
        with_axes("Squeeze", x, [1], 13),
        single_op("Flatten", {"x": x}, {"axis": 2}),
    ):
        graph = import_onnx(model)
        (node,) = graph.nodes.values()
        ops = {getattr(n, "op", None) for n in walk(node.compute.body)}
        assert not ops & {"floordiv", "mod"}, str(node.compute)


@pytest.mark.parametrize("blocksize", [2, 3])
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(blocksize, mode):
    x = sample((2, 2 * blocksize * blocksize, 3, 2))
    check("DepthToSpace", x, {"blocksize": blocksize, "mode": mode}, opset=13)


@pytest.mark.parametrize("blocksize", [2, 3])
def test_space_to_depth(blocksize):
    check("SpaceToDepth", sample((2, 3, 2 * blocksize, blocksize)), {"blocksize": blocksize}, opset=13)


def test_depth_space_errors():
    with pytest.raises(ModelError, match=r"depthtospace_0"):
        import_onnx(single_op("DepthToSpace", {"x": sample((1, 6, 2, 2))}, {"blocksize": 2}))
    with pytest.raises(UnsupportedError, match=r"depthtospace_0.*mode"):
        import_onnx(single_op("DepthToSpace", {"x": sample((1, 8, 2, 2))}, {"blocksize": 2, "mode": "XYZ"}))
    with pytest.raises(ModelError, match=r"spacetodepth_0.*divisible"):
        import_onnx(single_op("SpaceToDepth", {"x": sample((1, 2, 3, 4))}, {"blocksize": 2}))
    with pytest.raises(UnsupportedError, match=r"spacetodepth_0.*CRD"):
        import_onnx(single_op("SpaceToDepth", {"x": sample((1, 2, 4, 4))}, {"blocksize": 2, "mode": "CRD"}))


# -- Slice, Split, Concat -----------------------------------------------------------------


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize(
    ("shape", "starts", "ends", "axes", "steps"),
    [
        ((5, 6), [1], [4], [0], None),
        ((5, 6), [-3], [INT64_MAX], [1], [1]),
        ((5, 6), [INT64_MAX], [INT64_MIN], [1], [-1]),
        ((5, 6), [-1, 4], [-100, 0], [0, 1], [-2, -1]),
        ((5, 6), [0, 0], [10, 10], None, None),
        ((5, 6), [2], [2], [0], None),
        ((4, 5, 6), [1], [-1], [-2], [2]),
        ((5,), [10], [20], None, None),
        ((5, 6), [-10], [3], [1], [1]),
        ((7,), [100], [-100], [0], [-3]),
        ((7, 3), [1, 0], [7, 3], [0, 1], [3, 1]),
    ],
)
def test_slice(shape, starts, ends, axes, steps, opset):
    given = {"starts": starts, "ends": ends, "axes": axes, "steps": steps}
    consts = {k: i64(v) for k, v in given.items() if v is not None}
    order = ["x", *(k if v is not None else "" for k, v in given.items())]
    while not order[-1]:
        order.pop()
    check("Slice", sample(shape), None, consts, opset=opset, order=order)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slice_dtypes(dtype):
    check(
        "Slice",
        sample((4, 6), dtype),
        None,
        {"s": i64([1, 5]), "e": i64([3, 0]), "a": i64([0, 1]), "t": i64([1, -2])},
    )


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-8, 8), st.integers(-8, 8), st.sampled_from([-3, -2, -1, 1, 2, 3])),
        min_size=2,
        max_size=2,
    )
)
def test_slice_random(spec):
    starts, ends, steps = (i64(v) for v in zip(*spec))
    consts = {"s": starts, "e": ends, "a": i64([1, 0]), "t": steps}
    check("Slice", sample((5, 6)), None, consts)


def test_slice_errors():
    base = {"s": i64([0]), "e": i64([2]), "a": i64([0])}
    with pytest.raises(ModelError, match=r"slice_0.*non-zero"):
        import_onnx(single_op("Slice", {"x": sample((4,))}, None, {**base, "t": i64([0])}))
    with pytest.raises(ModelError, match=r"slice_0.*repeat"):
        import_onnx(
            single_op(
                "Slice", {"x": sample((4,))}, None, {"s": i64([0, 1]), "e": i64([2, 3]), "a": i64([0, 0])}
            )
        )


@pytest.mark.parametrize(
    ("opset", "shape", "attrs", "split", "n"),
    [
        (11, (4, 6), {"axis": 1}, [2, 4], 2),
        (11, (4, 6), {"axis": -1}, None, 3),
        (11, (6, 2), {}, [1, 2, 3], 3),
        (13, (4, 6), {"axis": 1}, [1, 0, 5], 3),
        (13, (4, 6), {"axis": 0}, None, 2),
        (18, (7, 2), {"num_outputs": 3}, None, 3),
        (18, (2, 10), {"num_outputs": 4, "axis": 1}, None, 4),
        (18, (2, 9), {"axis": 1}, [4, 5], 2),
        (18, (2, 8), {"axis": -1, "num_outputs": 2}, None, 2),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_split(opset, shape, attrs, split, n, dtype):
    x = sample(shape, dtype)
    assert_matches_ort(with_axes("Split", x, split, opset, "split", attrs, n), {"x": x})


@pytest.mark.parametrize(
    ("opset", "attrs", "split", "n", "error"),
    [
        (13, {}, None, 4, "not evenly splittable"),
        (13, {}, [2, 2], 2, "does not divide"),
        (11, {}, [7], 2, "does not divide"),
        (18, {"num_outputs": 3}, None, 2, "num_outputs=3"),
        (18, {"num_outputs": 2}, [3, 3], 2, "not both"),
        (18, {"num_outputs": 4}, None, 4, "cannot split"),
    ],
)
def test_split_errors(opset, attrs, split, n, error):
    with pytest.raises(ModelError, match=f"split_0.*{error}"):
        import_onnx(with_axes("Split", sample((6,)), split, opset, "split", attrs, n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shapes", "axis"),
    [
        ([(2, 3), (4, 3)], 0),
        ([(2, 3), (2, 1), (2, 5)], 1),
        ([(2, 3), (2, 1), (2, 5)], -1),
        ([(2, 3, 4), (2, 0, 4), (2, 2, 4)], 1),
        ([(2, 3)], 0),
        ([(2, 0), (2, 0)], 1),
        ([(1, k) for k in (1, 3, 2, 1, 1, 4, 2, 1, 1)], 1),
    ],
)
def test_concat(shapes, axis, dtype):
    feeds = {f"x{k}": sample(s, dtype, seed=k) for k, s in enumerate(shapes)}
    model = single_op("Concat", feeds, {"axis": axis})
    assert_matches_ort(model, feeds)


def test_concat_errors():
    feeds = {"a": sample((2, 3)), "b": sample((3, 3))}
    with pytest.raises(ModelError, match=r"concat_0.*do not concatenate"):
        import_onnx(single_op("Concat", feeds, {"axis": 1}))


# -- Pad, Expand, Tile -----------------------------------------------------------------------


def pad_model(x, pads, mode, opset, value=None, axes=None, value_as_input=False):
    inputs, consts = {"x": x}, {"pads": i64(pads)}
    order = ["x", "pads"]
    if value is not None:
        (inputs if value_as_input else consts)["value"] = np.asarray(value, dtype=x.dtype)
        order.append("value")
    if axes is not None:
        consts["axes"] = i64(axes)
        order += ["", "axes"] if value is None else ["axes"]
    return single_op("Pad", inputs, {"mode": mode}, consts, opset=opset, input_order=order)


PADS = [[1, 2, 0, 1], [0, 0, 2, 0], [-1, 1, 2, -2], [2, 0, -1, 3], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "opset"),
    [(m, o) for m in ("constant", "reflect", "edge") for o in (11, 13, 18, 19)]
    + [("wrap", 19), ("wrap", 21)],
)
@pytest.mark.parametrize("pads", PADS)
def test_pad_modes(mode, pads, opset):
    x = sample((4, 5))
    assert_matches_ort(pad_model(x, pads, mode, opset), {"x": x})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value_as_input", [False, True])
def test_pad_constant_value(dtype, value_as_input):
    x = sample((3, 4), dtype)
    value = {"float32": 2.5, "int64": -7, "bool": True}[dtype]
    feeds = {"x": x, **({"value": np.asarray(value, dtype=dtype)} if value_as_input else {})}
    assert_matches_ort(
        pad_model(x, [1, 0, 2, 1], "constant", 13, value, value_as_input=value_as_input), feeds
    )


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize(("axes", "pads"), [([1], [2, 1]), ([-1, 0], [1, 0, 0, 1]), ([2], [0, -1])])
@pytest.mark.parametrize("value", [None, 1.5])
def test_pad_axes(mode, axes, pads, value):
    x = sample((2, 3, 4))
    assert_matches_ort(pad_model(x, pads, mode, 18, value, axes), {"x": x})


def test_pad_empty_input():
    x = sample((0, 3))
    assert_matches_ort(pad_model(x, [1, 0, 1, 2], "constant", 13, 3.0), {"x": x})


def test_pad_errors():
    x = sample((3, 4))
    with pytest.raises(UnsupportedError, match=r"pad_0.*wrap.*opset 18"):
        import_onnx(pad_model(x, [1, 1, 1, 1], "wrap", 18))
    with pytest.raises(ModelError, match=r"pad_0.*reflect pads"):
        import_onnx(pad_model(x, [3, 0, 0, 0], "reflect", 13))
    with pytest.raises(ModelError, match=r"pad_0.*4 pads for 1 axes"):
        import_onnx(pad_model(x, [1, 1, 1, 1], "constant", 18, axes=[0]))
    with pytest.raises(ModelError, match=r"pad_0.*crop more"):
        import_onnx(pad_model(x, [-2, 0, -2, 0], "constant", 13))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "target"),
    [((3,), [2, 3]), ((3, 1), [1, 4]), ((2, 1, 4), [3, 1]), ((2, 3), [2, 3]), ((1,), [2, 0]), ((), [2, 2])],
)
def test_expand(shape, target, dtype):
    check("Expand", sample(shape, dtype), None, {"shape": i64(target)})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("repeats", [[2, 1, 3], [1, 1, 1], [0, 2, 1], [3, 2, 2]])
def test_tile(repeats, dtype):
    check("Tile", sample((2, 1, 3), dtype), None, {"repeats": i64(repeats)})


def test_expand_tile_errors():
    with pytest.raises(ModelError, match=r"expand_0.*do not broadcast"):
        import_onnx(single_op("Expand", {"x": sample((2, 3))}, None, {"s": i64([4, 3, 3])}))
    with pytest.raises(ModelError, match=r"tile_0.*repeats"):
        import_onnx(single_op("Tile", {"x": sample((2, 3))}, None, {"r": i64([2])}))


# -- Gather ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize(
    "indices",
    [np.int64(2), np.int64(-1), i64([0, 2, 3]), i64([3, 1, -1]), i64([[0, -2], [1, 1], [3, 0]]), i64([-4])],
)
def test_gather_constant_indices(indices, axis, dtype):
    check("Gather", sample((4, 5, 4), dtype), {"axis": axis}, {"indices": np.asarray(indices)})


@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("axis", [0, 2, -2])
@pytest.mark.parametrize("ishape", [(), (3,), (2, 3)])
def test_gather_runtime_indices(index_dtype, axis, ishape):
    data = sample((4, 3, 5))
    n = data.shape[axis]
    indices = np.random.default_rng(1).integers(-n, n, ishape).astype(index_dtype)
    model = single_op("Gather", {"data": data, "indices": indices}, {"axis": axis})
    assert_matches_ort(model, {"data": data, "indices": indices})


def test_gather_constant_progression_is_affine():
    """Constant indices that step regularly read ``data`` directly, without an index load."""
    for indices in (np.int64(1), i64([0, 2, 4])):
        model = single_op("Gather", {"x": sample((6, 3))}, {"axis": 0}, {"indices": indices})
        assert loaded_tensors(model) == {"x"}
    model = single_op("Gather", {"x": sample((6, 3))}, {"axis": 0}, {"indices": i64([0, 2, 1])})
    assert loaded_tensors(model) == {"x", "indices"}


def test_gather_errors():
    with pytest.raises(ModelError, match=r"gather_0.*out of range"):
        import_onnx(single_op("Gather", {"x": sample((3, 2))}, {"axis": 0}, {"indices": i64([3])}))
    with pytest.raises(ModelError, match=r"gather_0.*axis"):
        import_onnx(single_op("Gather", {"x": sample((3, 2))}, {"axis": 2}, {"indices": i64([0])}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("ishape", [(3, 4), (2, 2)])
@pytest.mark.parametrize("constant", [False, True])
def test_gather_elements(axis, ishape, dtype, constant):
    data = sample((3, 4), dtype)
    n = data.shape[axis]
    indices = np.random.default_rng(2).integers(-n, n, ishape).astype(np.int64)
    if constant:
        check("GatherElements", data, {"axis": axis}, {"indices": indices})
    else:
        model = single_op("GatherElements", {"x": data, "indices": indices}, {"axis": axis})
        assert_matches_ort(model, {"x": data, "indices": indices})


def test_gather_elements_errors():
    with pytest.raises(ModelError, match=r"gatherelements_0.*do not fit"):
        import_onnx(single_op("GatherElements", {"x": sample((3, 4))}, {"axis": 0}, {"i": i64([[0] * 5])}))
    with pytest.raises(ModelError, match=r"gatherelements_0.*out of range"):
        import_onnx(single_op("GatherElements", {"x": sample((3, 4))}, {"axis": 1}, {"i": i64([[4]])}))


# -- shape-like inputs must be constant --------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "attrs", "inputs", "opset"),
    [
        ("Reshape", {}, {"shape": i64([6])}, 13),
        ("Expand", {}, {"shape": i64([2, 3])}, 13),
        ("Tile", {}, {"repeats": i64([1, 2])}, 13),
        ("Slice", {}, {"starts": i64([0]), "ends": i64([1])}, 13),
        ("Squeeze", {}, {"axes": i64([0])}, 13),
        ("Unsqueeze", {}, {"axes": i64([0])}, 13),
        ("Split", {}, {"split": i64([1, 1])}, 13),
        ("Pad", {}, {"pads": i64([0, 0, 1, 1])}, 13),
    ],
)
def test_shape_inputs_must_be_constant(op, attrs, inputs, opset):
    x = sample((2, 3))
    feeds = {"x": x, **inputs}
    model = single_op(op, feeds, attrs, n_outputs=2 if op == "Split" else 1, opset=opset)
    name = next(iter(inputs))
    with pytest.raises(UnsupportedError, match=f"{op} node '{op.lower()}_0'.*{name}.*must be a constant"):
        import_onnx(model)
