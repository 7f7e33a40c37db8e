"""Conv, ConvTranspose and the pools: interpreter vs onnxruntime on random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx_util import assert_matches_ort, single_op

import welder.frontend.onnx as frontend
from welder.check import error_metric, onnxruntime_outputs
from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx
from welder.ir.expr import Binary, Load, Select, walk

AUTO_PADS = ["NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]


def _rand(rng: np.random.Generator, *shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _attrs(**kw) -> dict:
    """Node attributes, leaving out the ones given as None (so defaults get tested)."""
    return {k: v for k, v in kw.items() if v is not None}


def _same_pads(x_shape: tuple[int, ...], attrs: dict) -> dict:
    """``attrs`` with auto_pad SAME_* replaced by the explicit pads the specification
    prescribes: as many windows as strides fit, the dilated window's overhang split evenly
    (the odd one at the end for SAME_UPPER)."""
    spatial = x_shape[2:]
    kernel = attrs["kernel_shape"]
    strides = attrs.get("strides", [1] * len(spatial))
    dilations = attrs.get("dilations", [1] * len(spatial))
    begin, end = [], []
    for n, k, s, d in zip(spatial, kernel, strides, dilations):
        total = max(0, (-(-n // s) - 1) * s + (k - 1) * d + 1 - n)
        small = total // 2 if attrs["auto_pad"] == "SAME_UPPER" else total - total // 2
        begin.append(small)
        end.append(total - small)
    return {k: v for k, v in attrs.items() if k != "auto_pad"} | {"pads": begin + end}


def _assert_matches_ort_of(model, equivalent, feeds: dict[str, np.ndarray]) -> None:
    """Our result for ``model`` against onnxruntime's for an ``equivalent`` model: for
    the cases where onnxruntime refuses, or departs from, the specification."""
    ours = import_onnx(model).run(feeds)["out0"]
    ref = onnxruntime_outputs(equivalent, feeds, ["out0"])["out0"]
    assert ours.shape == ref.shape
    assert error_metric(ours, ref) <= 1e-4


@pytest.fixture
def without_onnx_shape_inference(monkeypatch):
    """ONNX's shape inference disagrees with onnxruntime in a few corners (ceil_mode
    windows starting in the end padding, SAME ConvTranspose with output_padding); the
    importer's cross-check against it is switched off to compare with onnxruntime there."""
    monkeypatch.setattr(frontend, "inferred_types", lambda model: {})


def _check(op: str, x: np.ndarray, attrs: dict, inits: dict | None = None, opset: int = 17) -> None:
    model = single_op(op, {"x": x}, attrs, inits, opset=opset)
    dilated = max(attrs.get("dilations", [1])) > 1
    if op != "ConvTranspose" and attrs.get("auto_pad", "").startswith("SAME") and dilated:
        # onnxruntime refuses dilated SAME convolutions and pads dilated SAME pools as if
        # they were not dilated; compare with the explicit pads of the specification.
        kernel = list(inits["w"].shape[2:]) if inits else attrs["kernel_shape"]
        explicit = _same_pads(x.shape, {"kernel_shape": kernel, **attrs})
        _assert_matches_ort_of(model, single_op(op, {"x": x}, explicit, inits, opset=opset), {"x": x})
    else:
        assert_matches_ort(model, {"x": x})


def _check_conv(
    op: str,
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    attrs: dict,
    bias: bool = True,
    opset: int = 17,
) -> None:
    rng = np.random.default_rng(0)
    x = _rand(rng, *x_shape)
    out_channels = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
    inits = {"w": _rand(rng, *w_shape)}
    if bias:
        inits["b"] = _rand(rng, out_channels)
    _check(op, x, attrs, inits, opset)


def _check_pool(op: str, x_shape: tuple[int, ...], attrs: dict, opset: int = 17, dtype=np.float32) -> None:
    x = (np.random.default_rng(1).standard_normal(x_shape) * 4).astype(dtype)
    _check(op, x, attrs, opset=opset)


# -- Conv ---------------------------------------------------------------------------------

# (input shape, weight shape, attributes)
CONV_CASES = [
    ((2, 3, 11), (4, 3, 3), {}),
    ((1, 4, 12), (6, 2, 4), _attrs(group=2, strides=[3], pads=[2, 1])),
    ((1, 3, 10), (5, 3, 3), _attrs(dilations=[3], pads=[0, 4])),
    ((2, 4, 9), (4, 1, 5), _attrs(group=4, pads=[2, 2])),
    ((1, 3, 7, 9), (5, 3, 3, 3), _attrs(pads=[1, 1, 1, 1])),
    ((2, 3, 8, 7), (4, 3, 2, 3), _attrs(strides=[2, 1], pads=[0, 1, 1, 2])),
    ((1, 4, 9, 10), (6, 2, 3, 2), _attrs(group=2, strides=[2, 3], dilations=[2, 1], pads=[1, 0, 2, 1])),
    ((1, 6, 8, 8), (6, 1, 3, 3), _attrs(group=6, pads=[1, 1, 1, 1])),
    ((1, 3, 8, 8), (6, 1, 3, 3), _attrs(group=3, strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 4, 10, 9), (3, 4, 1, 1), _attrs(strides=[3, 2])),
    ((1, 2, 12, 11), (3, 2, 3, 4), _attrs(dilations=[2, 3], kernel_shape=[3, 4])),
    ((1, 3, 5, 6), (2, 3, 5, 6), {}),
    ((1, 2, 6, 5, 7), (3, 2, 2, 3, 2), _attrs(pads=[1, 0, 1, 0, 1, 1], strides=[1, 2, 2])),
    ((1, 4, 5, 6, 5), (4, 2, 3, 1, 2), _attrs(group=2, dilations=[1, 1, 2], pads=[1, 0, 0, 1, 0, 1])),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), CONV_CASES)
def test_conv(x_shape, w_shape, attrs, bias):
    _check_conv("Conv", x_shape, w_shape, attrs, bias)


@pytest.mark.parametrize("auto_pad", AUTO_PADS)
@pytest.mark.parametrize(
    ("x_shape", "w_shape", "strides", "dilations"),
    [
        ((1, 2, 10), (3, 2, 4), [3], [1]),
        ((1, 2, 9, 8), (3, 2, 3, 2), [2, 3], [1, 2]),
        ((1, 2, 8, 9), (4, 1, 4, 3), [1, 2], [2, 1]),
        ((1, 2, 5, 6, 7), (2, 2, 2, 3, 2), [2, 1, 3], [1, 1, 2]),
    ],
)
def test_conv_auto_pad(x_shape, w_shape, strides, dilations, auto_pad):
    group = x_shape[1] // w_shape[1]
    attrs = _attrs(auto_pad=auto_pad, strides=strides, dilations=dilations, group=group)
    _check_conv("Conv", x_shape, w_shape, attrs)


@settings(max_examples=25, deadline=None)
@given(
    size=st.tuples(st.integers(4, 9), st.integers(4, 9)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilations=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    pads=st.tuples(*(st.integers(0, 2) for _ in range(4))),
    group=st.sampled_from([1, 2]),
    bias=st.booleans(),
)
def test_conv_random_geometry(size, kernel, strides, dilations, pads, group, bias):
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    assume(all(n + pads[a] + pads[a + 2] >= s for a, (n, s) in enumerate(zip(size, span))))
    attrs = _attrs(strides=list(strides), dilations=list(dilations), pads=list(pads), group=group)
    _check_conv("Conv", (2, 4, *size), (2 * group, 4 // group, *kernel), attrs, bias)


@pytest.mark.parametrize("opset", [11, 21])
def test_conv_other_opsets(opset):
    attrs = _attrs(strides=[2, 1], pads=[1, 2, 0, 1], group=2)
    _check_conv("Conv", (1, 4, 7, 8), (4, 2, 3, 3), attrs, opset=opset)


def test_conv_weights_as_graph_input():
    rng = np.random.default_rng(3)
    feeds = {"x": _rand(rng, 1, 3, 6, 7), "w": _rand(rng, 2, 3, 3, 2), "b": _rand(rng, 2)}
    assert_matches_ort(single_op("Conv", feeds, {"pads": [1, 0, 1, 1]}), feeds)


def _computes(model) -> list:
    return [n.compute for n in import_onnx(model).topo_order()]


def test_conv_reduction_is_a_sum_of_products():
    """The bias is a separate epilogue; the reduction multiplies a guarded input load by a
    weight load, and axes that cannot leave the input get no guard."""
    rng = np.random.default_rng(0)
    x = _rand(rng, 1, 2, 6, 6)
    attrs = {"pads": [1, 0, 1, 0]}  # padding along H only
    inits = {"w": _rand(rng, 3, 2, 3, 3), "b": _rand(rng, 3)}
    reduction, epilogue = _computes(single_op("Conv", {"x": x}, attrs, inits))
    assert reduction.reduce_op == "sum" and epilogue.is_injective
    body = reduction.body
    assert isinstance(body, Binary) and body.op == "mul"
    assert isinstance(body.a, Select) and isinstance(body.b, Load)
    guarded = {str(n.a) for n in walk(body.a.cond) if isinstance(n, Binary) and n.op in ("lt", "ge")}
    assert guarded == {"((i2 + r1) - 1)"}

    unpadded = _computes(single_op("Conv", {"x": x}, {}, {"w": inits["w"]}))
    assert len(unpadded) == 1 and not any(isinstance(n, Select) for n in walk(unpadded[0].body))


# -- ConvTranspose -------------------------------------------------------------------------

CONV_TRANSPOSE_CASES = [
    ((2, 3, 5), (3, 2, 3), {}),
    ((1, 4, 6), (4, 3, 4), _attrs(strides=[3], pads=[1, 2], group=2)),
    ((1, 2, 5), (2, 2, 3), _attrs(strides=[2], dilations=[2], output_padding=[1])),
    ((1, 3, 4, 5), (3, 2, 3, 3), _attrs(strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 2, 4, 3), (2, 3, 2, 3), _attrs(strides=[3, 2], pads=[0, 1, 2, 0], output_padding=[2, 1])),
    ((1, 4, 5, 4), (4, 1, 3, 2), _attrs(group=4, strides=[2, 1], dilations=[1, 2])),
    ((1, 4, 3, 4), (4, 2, 3, 3), _attrs(group=2, strides=[2, 3], dilations=[2, 1], pads=[2, 1, 0, 1])),
    ((1, 3, 4, 4), (3, 2, 3, 3), _attrs(strides=[2, 2], output_shape=[8, 9])),
    ((1, 3, 4, 4), (3, 2, 3, 3), _attrs(strides=[2, 2], output_shape=[10, 7], pads=[1, 1, 1, 1])),
    ((1, 3, 4, 5), (3, 2, 3, 2), _attrs(strides=[1, 2], kernel_shape=[3, 2])),
    ((1, 2, 3, 4, 3), (2, 2, 2, 3, 2), _attrs(strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 0])),
    ((1, 2, 3, 3, 2), (2, 1, 2, 2, 3), _attrs(group=2, dilations=[2, 1, 1], output_padding=[0, 0, 0])),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), CONV_TRANSPOSE_CASES)
def test_conv_transpose(x_shape, w_shape, attrs, bias):
    _check_conv("ConvTranspose", x_shape, w_shape, attrs, bias)


@pytest.mark.parametrize("auto_pad", AUTO_PADS)
@pytest.mark.parametrize(
    ("x_shape", "w_shape", "strides", "extra"),
    [
        ((1, 2, 5), (2, 3, 4), [2], [0]),
        ((1, 2, 4, 5), (2, 2, 3, 2), [2, 3], [0, 1]),
        ((1, 2, 3, 4), (2, 2, 5, 1), [1, 2], [0, 1]),
    ],
)
def test_conv_transpose_auto_pad(x_shape, w_shape, strides, extra, auto_pad):
    attrs = _attrs(auto_pad=auto_pad, strides=strides, output_padding=extra)
    _check_conv("ConvTranspose", x_shape, w_shape, attrs)


@settings(max_examples=20, deadline=None)
@given(
    size=st.tuples(st.integers(2, 5), st.integers(2, 5)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilations=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    pads=st.tuples(*(st.integers(0, 1) for _ in range(4))),
    group=st.sampled_from([1, 2]),
)
def test_conv_transpose_random_geometry(size, kernel, strides, dilations, pads, group):
    natural = [s * (n - 1) + (k - 1) * d + 1 for n, k, s, d in zip(size, kernel, strides, dilations)]
    assume(all(n - pads[a] - pads[a + 2] >= 1 for a, n in enumerate(natural)))
    attrs = _attrs(strides=list(strides), dilations=list(dilations), pads=list(pads), group=group)
    _check_conv("ConvTranspose", (1, 4, *size), (4, 2, *kernel), attrs)


@pytest.mark.usefixtures("without_onnx_shape_inference")
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_conv_transpose_same_with_output_padding(auto_pad):
    """The natural extent exceeds input * stride here; onnxruntime trims to the latter,
    ONNX's shape inference keeps the output padding on top of it."""
    attrs = _attrs(auto_pad=auto_pad, strides=[2, 3], output_padding=[1, 2])
    _check_conv("ConvTranspose", (1, 2, 4, 3), (2, 2, 3, 4), attrs)


def test_conv_transpose_opset11():
    attrs = _attrs(strides=[2, 2], pads=[1, 0, 0, 1], output_padding=[1, 1])
    _check_conv("ConvTranspose", (1, 2, 3, 4), (2, 3, 3, 3), attrs, opset=11)


def test_conv_transpose_unit_stride_needs_no_division():
    rng = np.random.default_rng(0)
    x = _rand(rng, 1, 2, 4, 4)
    (c,) = _computes(single_op("ConvTranspose", {"x": x}, {}, {"w": _rand(rng, 2, 3, 3, 3)}))
    assert not any(isinstance(n, Binary) and n.op in ("floordiv", "mod") for n in walk(c.body))


# -- MaxPool and AveragePool ----------------------------------------------------------------

# (input shape, attributes) shared by both pools
POOL_CASES = [
    ((2, 3, 10), _attrs(kernel_shape=[3])),
    ((1, 2, 11), _attrs(kernel_shape=[4], strides=[3], pads=[1, 2])),
    ((1, 2, 10), _attrs(kernel_shape=[2], strides=[2], pads=[1, 1], ceil_mode=1)),
    ((1, 2, 7, 8), _attrs(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 3, 9, 7), _attrs(kernel_shape=[3, 2], strides=[2, 3], pads=[0, 1, 2, 1])),
    ((2, 2, 8, 9), _attrs(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ((1, 2, 9, 10), _attrs(kernel_shape=[3, 4], strides=[3, 3], pads=[1, 2, 1, 1], ceil_mode=1)),
    ((1, 2, 6, 7), _attrs(kernel_shape=[5, 1], pads=[2, 0, 2, 0])),
    ((1, 2, 5, 6, 7), _attrs(kernel_shape=[2, 3, 2], strides=[2, 2, 3], pads=[1, 1, 0, 0, 1, 1])),
    ((1, 1, 6, 7, 5), _attrs(kernel_shape=[3, 2, 2], strides=[2, 1, 2], ceil_mode=1)),
]


@pytest.mark.parametrize(("x_shape", "attrs"), POOL_CASES)
def test_max_pool(x_shape, attrs):
    _check_pool("MaxPool", x_shape, attrs)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize(("x_shape", "attrs"), POOL_CASES)
def test_average_pool(x_shape, attrs, count_include_pad):
    _check_pool("AveragePool", x_shape, {**attrs, "count_include_pad": count_include_pad})


@pytest.mark.parametrize("ceil_mode", [0, 1])
@pytest.mark.parametrize("auto_pad", AUTO_PADS)
@pytest.mark.parametrize(
    ("op", "count_include_pad"), [("MaxPool", None), ("AveragePool", 0), ("AveragePool", 1)]
)
def test_pool_auto_pad(op, count_include_pad, auto_pad, ceil_mode):
    attrs = _attrs(
        kernel_shape=[3, 2],
        strides=[2, 3],
        auto_pad=auto_pad,
        ceil_mode=ceil_mode,
        count_include_pad=count_include_pad,
    )
    _check_pool(op, (1, 2, 9, 10), attrs)


@pytest.mark.parametrize("auto_pad", AUTO_PADS)
@pytest.mark.parametrize(
    ("x_shape", "attrs"),
    [
        ((1, 2, 12), _attrs(kernel_shape=[3], dilations=[2], strides=[2], pads=[1, 2])),
        ((1, 2, 9, 10), _attrs(kernel_shape=[2, 3], dilations=[2, 2], strides=[1, 2], ceil_mode=1)),
        ((1, 2, 9, 8), _attrs(kernel_shape=[3, 2], dilations=[1, 2], pads=[2, 1, 1, 1])),
    ],
)
def test_max_pool_dilations(x_shape, attrs, auto_pad):
    if auto_pad != "NOTSET":
        attrs = {k: v for k, v in attrs.items() if k != "pads"} | {"auto_pad": auto_pad}
    _check_pool("MaxPool", x_shape, attrs)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize(
    "attrs",
    [
        _attrs(kernel_shape=[3, 2], dilations=[2, 2], strides=[1, 2], pads=[2, 1, 1, 1]),
        _attrs(kernel_shape=[2, 3], dilations=[3, 1], strides=[2, 2], pads=[1, 1, 0, 1], ceil_mode=1),
    ],
)
def test_average_pool_dilations_opset19(attrs, count_include_pad):
    _check_pool("AveragePool", (1, 2, 9, 10), {**attrs, "count_include_pad": count_include_pad}, opset=19)


@pytest.mark.parametrize("opset", [11, 21])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_pool_other_opsets(op, opset):
    attrs = _attrs(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1)
    _check_pool(op, (1, 2, 8, 9), attrs, opset=opset)


@pytest.mark.parametrize("dtype", [np.float64, np.int8, np.uint8, np.float16])
def test_max_pool_dtypes(dtype):
    attrs = _attrs(kernel_shape=[2, 3], strides=[2, 2], pads=[1, 1, 0, 1])
    _check_pool("MaxPool", (1, 2, 7, 8), attrs, dtype=dtype)


def test_max_pool_storage_order_without_indices():
    """storage_order only describes the Indices output, so it does not matter here."""
    _check_pool("MaxPool", (1, 2, 6, 5), _attrs(kernel_shape=[2, 2], storage_order=1))


def test_average_pool_float16():
    attrs = _attrs(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1])
    _check_pool("AveragePool", (1, 2, 7, 6), attrs, dtype=np.float16)


@pytest.mark.usefixtures("without_onnx_shape_inference")
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
def test_ceil_mode_last_window_starts_inside(op):
    """With ceil_mode a window that would start in the end padding is dropped."""
    _check_pool(op, (1, 2, 6, 7), _attrs(kernel_shape=[2, 1], strides=[2, 2], pads=[0, 0, 1, 0], ceil_mode=1))


# -- global pools ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 3, 5, 6), (1, 4, 3, 4, 5)])
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool(op, shape):
    _check_pool(op, shape, {})


# -- bad input ------------------------------------------------------------------------------


def _import(op: str, attrs: dict, opset: int = 17, n_outputs: int = 1, x_shape=(1, 2, 6, 6), inits=None):
    x = np.zeros(x_shape, np.float32)
    import_onnx(single_op(op, {"x": x}, attrs, inits, n_outputs=n_outputs, opset=opset))


def test_max_pool_indices_output_is_refused():
    with pytest.raises(UnsupportedError, match=r"MaxPool node 'maxpool_0'.*Indices"):
        _import("MaxPool", {"kernel_shape": [2, 2]}, n_outputs=2)


def test_average_pool_dilations_before_opset19_are_refused():
    with pytest.raises(UnsupportedError, match=r"AveragePool node 'averagepool_0'.*dilations"):
        _import("AveragePool", {"kernel_shape": [2, 2], "dilations": [2, 2]})


def test_unknown_auto_pad_is_refused():
    with pytest.raises(UnsupportedError, match=r"MaxPool node 'maxpool_0'.*auto_pad='SAME'"):
        _import("MaxPool", {"kernel_shape": [2, 2], "auto_pad": "SAME"})


def test_negative_pads_are_refused():
    with pytest.raises(UnsupportedError, match=r"Conv node 'conv_0'.*negative pads"):
        _import("Conv", {"pads": [-1, 0, 0, 0]}, inits={"w": np.zeros((2, 2, 3, 3), np.float32)})


@pytest.mark.parametrize(
    ("op", "attrs", "w_shape", "message"),
    [
        ("Conv", {"group": 3}, (3, 1, 3, 3), "group=3 does not divide"),
        ("Conv", {"group": 2}, (3, 1, 3, 3), r"weights \[3, 1, 3, 3\] do not fit"),
        ("Conv", {"kernel_shape": [2, 2]}, (3, 2, 3, 3), "disagrees with the weights"),
        ("Conv", {}, (3, 2, 7, 3), "window spans 7 positions"),
        ("ConvTranspose", {}, (3, 2, 3, 3), "expect 3 input channels"),
        ("ConvTranspose", {"output_shape": [1, 2, 9, 9]}, (2, 2, 3, 3), "does not have 2 spatial"),
    ],
)
def test_inconsistent_shapes_name_the_node(op, attrs, w_shape, message):
    with pytest.raises(ModelError, match=f"{op} node '{op.lower()}_0'.*{message}"):
        _import(op, attrs, inits={"w": np.zeros(w_shape, np.float32)})
