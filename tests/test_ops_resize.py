"""Resize lowering: interpreter vs onnxruntime over modes, coordinate transforms, scales,
sizes, layouts and opsets, plus the shape of the compute it builds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx_util import assert_matches_onnx_reference, assert_matches_ort, make_model

from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx
from welder.ir.compute import Compute
from welder.ir.expr import INDEX, Cast, Load, walk
from welder.ir.interpret import evaluate

NEAREST_MODES = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
TRANSFORMS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn"]
# Upsample-like, non-integer and mixed up/down factors on the H and W axes of NCHW.
SCALES = [(2.0, 2.0), (0.5, 1.7), (3.0, 0.6), (1.0, 1.5)]


def _resize(x, attrs, scales=None, sizes=None, roi=None, opset=13):
    """A one-node Resize model; roi/scales/sizes are initializers, missing ones are ''.
    Before opset 13 roi and scales are required, so they are passed empty when unused."""
    inits: dict[str, np.ndarray] = {}
    names = ["x"]
    for name, value, dtype in (
        ("roi", roi, np.float32),
        ("scales", scales, np.float32),
        ("sizes", sizes, np.int64),
    ):
        if value is None and name != "sizes" and opset < 13:
            value = []
        if value is None:
            names.append("")
            continue
        inits[name] = np.asarray(value, dtype)
        names.append(name)
    while names[-1] == "":
        names.pop()
    node = helper.make_node("Resize", names, ["y"], name="resize_0", **attrs)
    return make_model([node], {"x": x}, ["y"], inits, opset)


def _x(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _check(x, attrs, **kw):
    assert_matches_ort(_resize(x, attrs, **kw), {"x": x})


def _only_compute(model):
    nodes = list(import_onnx(model))
    assert len(nodes) == 1
    return nodes[0].compute


X = _x((2, 3, 5, 7))


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("nearest_mode", NEAREST_MODES)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_nearest(transform, nearest_mode, scales):
    attrs = {"mode": "nearest", "coordinate_transformation_mode": transform, "nearest_mode": nearest_mode}
    _check(X, attrs, scales=[1.0, 1.0, *scales])


@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("transform", [*TRANSFORMS, "half_pixel_symmetric"])
def test_linear(transform, scales):
    attrs = {"mode": "linear", "coordinate_transformation_mode": transform}
    _check(X, attrs, scales=[1.0, 1.0, *scales], opset=19)


@pytest.mark.parametrize("sizes", [(9, 3), (1, 13), (7, 7), (5, 4)], ids=str)
@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize(
    "transform", ["half_pixel", "align_corners", "pytorch_half_pixel", "half_pixel_symmetric"]
)
def test_sizes(transform, mode, sizes):
    attrs = {"mode": mode, "coordinate_transformation_mode": transform}
    _check(X, attrs, sizes=[2, 3, *sizes], opset=19)


LAYOUTS = [
    ((4, 5), (2.0, 0.6)),
    ((3, 4, 5), (2.0, 1.5, 0.7)),
    ((2, 4, 5, 3), (1.0, 2.0, 0.5, 1.0)),
    ((1, 2, 3, 4, 5), (1.0, 1.0, 2.0, 1.5, 0.7)),
]


@pytest.mark.parametrize(
    ("mode", "shape", "scales"),
    # onnxruntime has no 1-D linear resize, so 1-D is checked in nearest mode only.
    [("nearest", (6,), (1.7,)), *[(m, *c) for m in ("nearest", "linear") for c in LAYOUTS]],
    ids=str,
)
def test_layouts(mode, shape, scales):
    _check(_x(shape), {"mode": mode}, scales=scales)


@pytest.mark.parametrize("opset", [11, 13, 18, 19])
@pytest.mark.parametrize("use_sizes", [False, True])
def test_opsets(opset, use_sizes):
    given = {"sizes": [2, 3, 9, 4]} if use_sizes else {"scales": [1.0, 1.0, 1.7, 0.6]}
    _check(X, {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, opset=opset, **given)


@pytest.mark.parametrize(
    ("axes", "given"),
    [
        ([-1], {"scales": [1.7]}),
        ([3, 2], {"scales": [1.7, 0.6]}),
        ([2], {"sizes": [11]}),
        ([3, -2], {"sizes": [4, 9]}),
    ],
    ids=str,
)
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_axes_attribute(mode, axes, given):
    _check(X, {"mode": mode, "axes": axes}, opset=18, **given)


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("sizes", [(9, 9), (3, 20), (10, 14)], ids=str)
def test_keep_aspect_ratio(policy, sizes):
    _check(X, {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": policy}, sizes=sizes, opset=18)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize(
    ("roi", "sizes"),
    [
        ([0, 0, -0.2, 0.1, 1, 1, 1.3, 0.8], [2, 3, 6, 9]),
        ([0, 0, 0.3, 0.1, 1, 1, 0.6, 0.8], [2, 3, 1, 9]),
        ([0, 0, 0.25, 0.0, 1, 1, 0.75, 1.0], [2, 3, 4, 7]),
    ],
    ids=["extrapolate", "single-row", "crop"],
)
def test_tf_crop_and_resize(mode, roi, sizes):
    attrs = {
        "mode": mode,
        "coordinate_transformation_mode": "tf_crop_and_resize",
        "extrapolation_value": -3.5,
    }
    _check(X, attrs, roi=roi, sizes=sizes)


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("linear", np.float16),
        ("nearest", np.float16),
        ("nearest", np.uint8),
        ("nearest", np.int8),
        ("nearest", np.int32),
    ],
)
def test_dtypes(mode, dtype):
    _check(_x((1, 2, 4, 5), dtype), {"mode": mode}, scales=[1.0, 1.0, 1.5, 0.6])


def _check_unchanged_shape(x, attrs, factors):
    """A scale other than 1 whose output keeps the input's shape (width 2 at 1.25 gives 2):
    onnxruntime copies the input through, while the spec -- and onnx's reference evaluator,
    and torch's interpolate -- still map coordinates with the given scale. We follow the
    spec, so these cases are checked against the reference evaluator."""
    assert_matches_onnx_reference(_resize(x, attrs, scales=[1.0, 1.0, *factors], opset=19), {"x": x})


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize(
    ("h", "w", "factors"), [(1, 2, (1.0, 1.25)), (3, 2, (1.25, 1.0)), (2, 3, (1.25, 1.25))]
)
def test_scale_that_keeps_the_shape_still_interpolates(mode, h, w, factors):
    attrs = {"mode": mode, "coordinate_transformation_mode": "half_pixel"}
    _check_unchanged_shape(_x((1, 2, h, w)), attrs, factors)


@settings(max_examples=30, deadline=None)
@given(
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    mode=st.sampled_from(["nearest", "linear"]),
    transform=st.sampled_from([*TRANSFORMS, "half_pixel_symmetric"]),
    nearest_mode=st.sampled_from(NEAREST_MODES),
    factors=st.tuples(*[st.sampled_from([0.34, 0.5, 0.6, 1.0, 1.25, 1.7, 2.0, 3.0])] * 2),
    sizes=st.one_of(st.none(), st.tuples(st.integers(1, 13), st.integers(1, 13))),
)
def test_random(h, w, mode, transform, nearest_mode, factors, sizes):
    x = _x((1, 2, h, w))
    attrs = {"mode": mode, "coordinate_transformation_mode": transform, "nearest_mode": nearest_mode}
    if sizes is None:
        out_hw = (int(np.float32(factors[0]) * h), int(np.float32(factors[1]) * w))
        assume(min(out_hw) > 0)
        if out_hw == (h, w):
            _check_unchanged_shape(x, attrs, factors)
        else:
            _check(x, attrs, scales=[1.0, 1.0, *factors], opset=19)
    else:
        _check(x, attrs, sizes=[1, 2, *sizes], opset=19)


@pytest.mark.parametrize(
    ("transform", "nearest_mode", "width", "size"),
    [
        ("asymmetric", "round_prefer_ceil", 7, 2),
        ("asymmetric", "round_prefer_ceil", 13, 8),
        ("asymmetric", "round_prefer_floor", 11, 26),
        ("half_pixel", "round_prefer_ceil", 20, 6),
        ("half_pixel", "round_prefer_floor", 20, 26),
    ],
)
def test_near_ties_round_like_onnxruntime(transform, nearest_mode, width, size):
    """Sizes whose float32 coordinate misses an exact half-way point by an ulp or two."""
    attrs = {"mode": "nearest", "coordinate_transformation_mode": transform, "nearest_mode": nearest_mode}
    _check(_x((1, 1, 2, width)), attrs, sizes=[1, 1, 2, size])


@pytest.mark.parametrize(("width", "size"), [(3, 11), (5, 17), (3, 1)], ids=str)
def test_half_pixel_symmetric_rounds_like_onnxruntime(width, size):
    """Sizes where the double-precision coordinate and a float32 one floor differently."""
    attrs = {
        "mode": "nearest",
        "coordinate_transformation_mode": "half_pixel_symmetric",
        "nearest_mode": "floor",
    }
    _check(_x((1, 1, 2, width)), attrs, sizes=[1, 1, 2, size], opset=19)


# -- the compute it builds -------------------------------------------------------------------


def _has_cast(c) -> bool:
    return any(isinstance(n, Cast) for n in walk(c.body))


@pytest.mark.parametrize(
    ("transform", "nearest_mode", "scale"),
    [
        ("asymmetric", "floor", 2.0),
        ("half_pixel", "round_prefer_floor", 2.0),
        ("half_pixel", "round_prefer_ceil", 3.0),
        ("asymmetric", "floor", 0.5),
    ],
)
def test_integer_factors_give_exact_index_arithmetic(transform, nearest_mode, scale):
    attrs = {"mode": "nearest", "coordinate_transformation_mode": transform, "nearest_mode": nearest_mode}
    model = _resize(_x((1, 2, 4, 6)), attrs, scales=[1.0, 1.0, scale, scale])
    assert not _has_cast(_only_compute(model))
    assert_matches_ort(model, {"x": _x((1, 2, 4, 6))})


@pytest.mark.parametrize(
    ("attrs", "given"),
    [
        ({"mode": "nearest", "nearest_mode": "ceil"}, {"scales": [1.0, 1.0, 1.7, 0.6]}),
        (
            {"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn"},
            {"sizes": [2, 3, 9, 4]},
        ),
        (
            {"mode": "nearest", "coordinate_transformation_mode": "asymmetric"},
            {"scales": [1.0, 1.0, 3.0, 0.5]},
        ),
        ({"mode": "linear"}, {"scales": [1.0, 1.0, 1.7, 0.6]}),
        ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, {"sizes": [2, 3, 9, 4]}),
        (
            {"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
            {"scales": [1.0, 1.0, 2.0, 1.5]},
        ),
        (
            {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"},
            {"sizes": [2, 3, 6, 9], "roi": [0, 0, -0.2, 0.1, 1, 1, 1.3, 0.8]},
        ),
    ],
)
def test_loads_stay_in_bounds(attrs, given):
    """The interpreter clamps out-of-range indices, so a missing clamp in the lowering
    would go unnoticed by the comparison with onnxruntime; check every index directly."""
    c = _only_compute(_resize(X, attrs, **given))
    for ld in (n for n in walk(c.body) if isinstance(n, Load)):
        for k, index in enumerate(ld.indices):
            values = evaluate(Compute("probe", c.axes, index, INDEX), {})
            assert values.min() >= 0 and values.max() < X.shape[k], f"{ld}: axis {k} leaves the input"


def test_unchanged_axes_cost_nothing():
    c = _only_compute(_resize(X, {"mode": "linear"}, scales=[1.0, 1.0, 1.0, 1.7]))
    loads = [n for n in walk(c.body) if isinstance(n, Load)]
    assert c.is_injective
    assert len({ld.indices for ld in loads}) == 2
    for ld in loads:
        assert [str(i) for i in ld.indices[:3]] == ["i0", "i1", "i2"]


@pytest.mark.parametrize(("scales", "taps"), [((2.0, 1.0), 2), ((2.0, 1.7), 4)])
def test_linear_reads_two_taps_per_resized_axis(scales, taps):
    c = _only_compute(_resize(X, {"mode": "linear"}, scales=[1.0, 1.0, *scales]))
    assert c.is_injective
    assert len({ld.indices for ld in walk(c.body) if isinstance(ld, Load)}) == taps


def test_trilinear_is_one_compute():
    x = _x((1, 1, 3, 4, 5))
    c = _only_compute(_resize(x, {"mode": "linear"}, scales=[1.0, 1.0, 2.0, 1.5, 0.7]))
    assert c.is_injective
    assert len({ld.indices for ld in walk(c.body) if isinstance(ld, Load)}) == 8


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"mode": "cubic"}, "cubic"),
        ({"mode": "linear", "antialias": 1}, "antialias"),
        ({"mode": "nearest", "exclude_outside": 1}, "exclude_outside"),
        ({"mode": "nearest", "nearest_mode": "banker"}, "nearest_mode"),
        ({"mode": "nearest", "coordinate_transformation_mode": "sideways"}, "coordinate_transformation_mode"),
        ({"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "fill"}, "keep_aspect_ratio_policy"),
    ],
)
def test_unsupported_attributes(attrs, message):
    given = {"sizes": [4, 4]} if "axes" in attrs else {"scales": [1.0, 1.0, 2.0, 2.0]}
    with pytest.raises(UnsupportedError, match=message) as err:
        import_onnx(_resize(X, attrs, opset=18, **given))
    assert "Resize node 'resize_0'" in str(err.value)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"scales": [1.0, 2.0, 2.0]}, "3 entries for 4 resized axes"),
        ({"scales": [1.0, 1.0, 0.0, 2.0]}, "not positive"),
        ({"sizes": [2, 3, 0, 4]}, "not positive"),
        ({}, "exactly one of"),
        ({"scales": [1.0, 1.0, 2.0, 2.0], "sizes": [2, 3, 10, 14]}, "exactly one of"),
    ],
    ids=["length", "scale", "size", "neither", "both"],
)
def test_bad_scales_and_sizes(given, message):
    with pytest.raises(ModelError, match=message) as err:
        import_onnx(_resize(X, {"mode": "nearest"}, **given))
    assert "resize_0" in str(err.value)


def test_linear_on_integers_is_refused():
    with pytest.raises(UnsupportedError, match="linear mode needs a floating-point input"):
        import_onnx(_resize(_x((1, 1, 3, 3), np.int32), {"mode": "linear"}, scales=[1.0, 1.0, 2.0, 2.0]))


def test_crop_needs_roi():
    attrs = {"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize"}
    with pytest.raises(ModelError, match="roi of 8 values"):
        import_onnx(_resize(X, attrs, scales=[1.0, 1.0, 2.0, 2.0]))


def test_runtime_scales_are_refused():
    scales = np.asarray([1.0, 1.0, 2.0, 2.0], np.float32)
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize_0", mode="nearest")
    model = make_model([node], {"x": X, "scales": scales}, ["y"], opset=13)
    with pytest.raises(UnsupportedError, match=r"resize_0.*'scales'.*must be a constant"):
        import_onnx(model)
