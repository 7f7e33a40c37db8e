"""Elementwise lowerings (welder/frontend/ops/elementwise.py) against onnxruntime.

Each test builds a one-node model, imports it, runs the interpreter and compares with
onnxruntime on random (or deliberately extreme) inputs: arithmetic and comparisons under
numpy broadcasting, the dtypes each operator allows, attribute combinations, and every
activation at inputs far out in both tails, where a naive formula overflows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from onnx import TensorProto
from onnx_util import assert_matches_onnx_reference, assert_matches_ort, single_op

from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx

# Broadcasting pairs: scalar on either side, rank mismatch, size-1 dims on both sides,
# an empty dimension.
BROADCAST_PAIRS = [
    ((3, 4), (3, 4)),
    ((), (3, 4)),
    ((3, 4), ()),
    ((4,), (2, 3, 4)),
    ((2, 3, 4), (1, 4)),
    ((3, 1), (1, 4)),
    ((2, 1, 4), (3, 1)),
    ((1,), (2, 3)),
    ((1, 1, 1), (5,)),
    ((0, 3), (1, 3)),
]

INT_DTYPES = [np.int32, np.int64]
FLOAT_DTYPES = [np.float32, np.float16, np.float64]

# Far tails and the neighbourhood of zero, where activations over- or underflow.
EXTREMES = np.array(
    [-100, -88.8, -50, -20, -5, -1, -1e-3, -1e-30, 0, 1e-30, 1e-3, 1, 5, 20, 50, 88.8, 100],
    dtype=np.float64,
)


def rand(shape, dtype=np.float32, seed: int = 0, low: float = -3.0, high: float = 3.0) -> np.ndarray:
    """Uniform values in [low, high); integers in [low, high] (both ends inclusive)."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return np.asarray(rng.integers(int(low), int(high) + 1, size=shape), dtype=dtype)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    return np.asarray(rng.uniform(low, high, size=shape), dtype=dtype)


def nonzero(shape, dtype=np.float32, seed: int = 0) -> np.ndarray:
    """Values of either sign bounded away from zero (divisors)."""
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1, 1], size=shape)
    if np.issubdtype(dtype, np.integer):
        return np.asarray(rng.integers(1, 6, size=shape) * sign, dtype=dtype)
    return np.asarray(rng.uniform(0.5, 3.0, size=shape) * sign, dtype=dtype)


def assert_matches(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Compare with onnxruntime or, where its CPU provider has no kernel for the type
    (float64 activations, bool Where, int64 Relu, ...), with onnx's reference evaluator."""
    try:
        assert_matches_ort(model, feeds)
        return
    except ModelError as e:
        if "NOT_IMPLEMENTED" not in str(e):
            raise
    assert_matches_onnx_reference(model, feeds)


def check_unary(op: str, x: np.ndarray, opset: int = 17, **attrs) -> None:
    assert_matches(single_op(op, {"x": x}, attrs, opset=opset), {"x": x})


def check_binary(op: str, a: np.ndarray, b: np.ndarray, opset: int = 17, **attrs) -> None:
    assert_matches(single_op(op, {"a": a, "b": b}, attrs, opset=opset), {"a": a, "b": b})


def dtype_id(dtype) -> str:
    return np.dtype(dtype).name


# -- arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize("shapes", BROADCAST_PAIRS, ids=str)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_arith_broadcasting(op, shapes):
    a = rand(shapes[0], seed=1)
    b = nonzero(shapes[1], seed=2) if op == "Div" else rand(shapes[1], seed=2)
    check_binary(op, a, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_arith_dtypes(op, dtype):
    """Integer Div truncates towards zero, so both signs appear in both operands."""
    a = rand((4, 5), dtype, seed=3, low=-20, high=20)
    b = nonzero((4, 5), dtype, seed=4) if op == "Div" else rand((4, 5), dtype, seed=4, low=-20, high=20)
    check_binary(op, a, b)


@settings(max_examples=25, deadline=None)
@given(
    shapes=mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, min_side=1, max_side=3),
    op=st.sampled_from(["Add", "Sub", "Mul", "Div"]),
    seed=st.integers(0, 2**16),
)
def test_arith_random_broadcasting(shapes, op, seed):
    a = rand(shapes.input_shapes[0], seed=seed)
    b = nonzero(shapes.input_shapes[1], seed=seed + 1)
    check_binary(op, a, b)


# -- Pow --------------------------------------------------------------------------------


@pytest.mark.parametrize("exponent", [2.0, 0.5, 3.0, 1.0, -1.0, 0.0, 1.7])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=dtype_id)
def test_pow_constant_exponent(exponent, dtype):
    """A constant exponent is an initializer; 2, 3, 0.5 and 1 take dedicated lowerings."""
    low = 0.1 if exponent % 1 else -3.0  # fractional powers of negatives are NaN
    x = rand((3, 4), dtype, seed=5, low=low)
    model = single_op("Pow", {"x": x}, initializers={"y": np.asarray(exponent, dtype=dtype)})
    assert_matches(model, {"x": x})


@pytest.mark.parametrize("exponent", [2.0, 0.5, 3.0])
@pytest.mark.parametrize("special", [np.inf, -np.inf, 0.0, -0.0])
def test_pow_constant_exponent_special_values(exponent, special):
    """The dedicated lowerings must agree with pow() on infinities and signed zeros."""
    x = np.array([special, 1.0, 4.0], dtype=np.float32)
    model = single_op("Pow", {"x": x}, initializers={"y": np.asarray(exponent, dtype=np.float32)})
    assert_matches(model, {"x": x})


@pytest.mark.parametrize("exp_shape", [(1,), (1, 1), (1, 1, 1), (4,)], ids=str)
def test_pow_constant_exponent_broadcasts_output(exp_shape):
    """An exponent of higher rank than the base changes the output shape."""
    x = rand((3, 4), seed=6)
    y = np.full(exp_shape, 2.0, dtype=np.float32)
    assert_matches(single_op("Pow", {"x": x}, initializers={"y": y}), {"x": x})


@pytest.mark.parametrize("exp_dtype", [np.float32, np.int64, np.int32], ids=dtype_id)
def test_pow_tensor_exponent(exp_dtype):
    x = rand((3, 4), seed=7, low=0.2, high=2.5)
    y = rand((4,), exp_dtype, seed=8, low=-3, high=3)
    check_binary("Pow", x, y)


@pytest.mark.parametrize("base_dtype", INT_DTYPES, ids=dtype_id)
def test_pow_integer_base(base_dtype):
    """Integer powers are exact, and negative exponents truncate the fraction
    (2 ** -1 == 0, (-1) ** -3 == -1).  Zero is not raised to a negative power (undefined)."""
    x = rand((4, 6), base_dtype, seed=9, low=-5, high=5)
    x[x == 0] = 1
    y = rand((4, 6), base_dtype, seed=10, low=-3, high=5)
    check_binary("Pow", x, y)


@pytest.mark.parametrize("exponent", [0.5, 1.5, 2.0])
def test_pow_integer_base_float_exponent(exponent):
    """T1 may differ from T: 9 ** 0.5 is 3, not 9 ** 0."""
    x = np.array([[0, 1, 4, 9], [16, 25, 2, 7]], dtype=np.int64)
    y = np.full((2, 4), exponent, dtype=np.float32)
    check_binary("Pow", x, y)


# -- Mod --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((), (2, 3)), ((2, 1), (1, 3))], ids=str
)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8], ids=dtype_id)
@pytest.mark.parametrize("fmod", [0, 1])
def test_mod_integers(fmod, dtype, shapes):
    """fmod=0 takes the divisor's sign (Python), fmod=1 the dividend's (C)."""
    a = rand(shapes[0], dtype, seed=11, low=-20, high=20)
    b = nonzero(shapes[1], dtype, seed=12)
    check_binary("Mod", a, b, fmod=fmod)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_mod_floats_fmod(dtype):
    a = rand((4, 5), dtype, seed=13, low=-10, high=10)
    b = nonzero((5,), dtype, seed=14)
    check_binary("Mod", a, b, fmod=1)


def test_mod_floats_without_fmod_is_rejected():
    a = rand((2, 3))
    with pytest.raises(UnsupportedError, match="fmod"):
        import_onnx(single_op("Mod", {"a": a, "b": a}, {"fmod": 0}))


# -- variadic ---------------------------------------------------------------------------

VARIADIC_SHAPES = [
    [(3, 4)],
    [(3, 4), (3, 4)],
    [(3, 1), (4,)],
    [(2, 3, 4), (3, 1), ()],
    [(1,), (2, 1, 3), (4, 1)],
]


@pytest.mark.parametrize("shapes", VARIADIC_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic(op, shapes):
    feeds = {f"x{k}": rand(s, seed=20 + k) for k, s in enumerate(shapes)}
    assert_matches(single_op(op, feeds), feeds)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.int64], ids=dtype_id)
@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_dtypes(op, dtype):
    if op in ("Sum", "Mean") and np.issubdtype(dtype, np.integer):
        pytest.skip(f"{op} is defined for floating-point types only")
    feeds = {f"x{k}": rand((2, 3), dtype, seed=30 + k, low=-9, high=9) for k in range(3)}
    assert_matches(single_op(op, feeds), feeds)


# -- comparison and logic ---------------------------------------------------------------


@pytest.mark.parametrize("shapes", BROADCAST_PAIRS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64, np.float16], ids=dtype_id)
@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
def test_compare(op, dtype, shapes):
    """Small integer-valued data, so that equal elements (the edge of every predicate)
    are common."""
    a = rand(shapes[0], np.int64, seed=40, low=-2, high=2).astype(dtype)
    b = rand(shapes[1], np.int64, seed=41, low=-2, high=2).astype(dtype)
    check_binary(op, a, b)


def test_equal_bool():
    a, b = rand((3, 4), np.bool_, seed=42), rand((4,), np.bool_, seed=43)
    check_binary("Equal", a, b)


@pytest.mark.parametrize("shapes", BROADCAST_PAIRS, ids=str)
@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op, shapes):
    check_binary(op, rand(shapes[0], np.bool_, seed=44), rand(shapes[1], np.bool_, seed=45))


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)], ids=str)
def test_not(shape):
    check_unary("Not", rand(shape, np.bool_, seed=46))


@pytest.mark.parametrize(
    "shapes",
    [
        ((3, 4), (3, 4), (3, 4)),
        ((3, 1), (1, 4), ()),
        ((4,), (2, 3, 4), (3, 1)),
        ((), (2, 3), (2, 3)),
        ((2, 1, 1), (1, 3, 1), (1, 1, 4)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.float16], ids=dtype_id)
def test_where(dtype, shapes):
    feeds = {
        "c": rand(shapes[0], np.bool_, seed=47),
        "x": rand(shapes[1], dtype, seed=48),
        "y": rand(shapes[2], dtype, seed=49),
    }
    assert_matches(single_op("Where", feeds), feeds)


# -- NaN and infinity -----------------------------------------------------------------------

SPECIALS = np.array([[np.nan, np.inf, -np.inf, 0.0], [-1.5, 3.0, np.nan, -np.inf]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_sign_special_values(dtype):
    """NaN stays NaN (as numpy and onnx's reference have it; onnxruntime's float16 kernel
    alone returns 0, hence no float16 here); infinities have a sign."""
    check_unary("Sign", SPECIALS.astype(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_isnan(dtype):
    check_unary("IsNaN", SPECIALS.astype(dtype), opset=20)


@pytest.mark.parametrize("positive", [0, 1])
@pytest.mark.parametrize("negative", [0, 1])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_isinf_detect_flags(dtype, positive, negative):
    check_unary("IsInf", SPECIALS.astype(dtype), opset=20, detect_positive=positive, detect_negative=negative)


# -- casts ----------------------------------------------------------------------------------

CAST_TYPES = {
    np.float32: TensorProto.FLOAT,
    np.float16: TensorProto.FLOAT16,
    np.float64: TensorProto.DOUBLE,
    np.int32: TensorProto.INT32,
    np.int64: TensorProto.INT64,
    np.int8: TensorProto.INT8,
    np.uint8: TensorProto.UINT8,
    np.bool_: TensorProto.BOOL,
}


def cast_source(src, dst) -> np.ndarray:
    """Values every target can represent: negative fractions (truncation towards zero),
    zeros (bool), and nothing outside uint8 when the target is unsigned."""
    if src == np.bool_:
        return rand((3, 5), np.bool_, seed=50)
    values = np.array(
        [[-2.7, -1.0, -0.5, 0.0, 0.4], [1.0, 2.5, 7.9, -100.2, 120.6], [0.0, -0.0, 3.0, -3.0, 64.0]]
    )
    if dst == np.uint8 or src == np.uint8:
        values = np.abs(values)
    return values.astype(src)


@pytest.mark.parametrize("dst", list(CAST_TYPES), ids=dtype_id)
@pytest.mark.parametrize("src", list(CAST_TYPES), ids=dtype_id)
def test_cast(src, dst):
    x = cast_source(src, dst)
    check_unary("Cast", x, to=CAST_TYPES[dst])


@pytest.mark.parametrize("dst", [np.float16, np.int32, np.int64, np.bool_], ids=dtype_id)
@pytest.mark.parametrize("src", [np.float32, np.int64], ids=dtype_id)
def test_cast_like(src, dst):
    x = cast_source(src, dst)
    like = np.zeros((1,), dtype=dst)
    assert_matches(single_op("CastLike", {"x": x, "like": like}), {"x": x, "like": like})


def test_cast_wraps_narrowing_integers():
    """int64 -> int32 keeps the low bits, like every C compiler."""
    x = np.array([2**31, 2**31 + 5, -(2**31) - 1, 7], dtype=np.int64)
    check_unary("Cast", x, to=TensorProto.INT32)


def test_cast_float_overflow_to_float16():
    x = np.array([1e5, -1e5, 65504.0, 3.0e-8], dtype=np.float32)
    check_unary("Cast", x, to=TensorProto.FLOAT16)


# -- unary math -------------------------------------------------------------------------------

# Inputs inside each function's domain.
UNARY_DOMAINS = {
    "Sqrt": (0.0, 10.0),
    "Exp": (-10.0, 10.0),
    "Log": (0.01, 10.0),
    "Erf": (-4.0, 4.0),
    "Tanh": (-5.0, 5.0),
    "Sigmoid": (-10.0, 10.0),
    "Abs": (-5.0, 5.0),
    "Neg": (-5.0, 5.0),
    "Floor": (-5.0, 5.0),
    "Ceil": (-5.0, 5.0),
    "Round": (-5.0, 5.0),
    "Sin": (-7.0, 7.0),
    "Cos": (-7.0, 7.0),
    "Reciprocal": (0.5, 4.0),
    "Sign": (-3.0, 3.0),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", list(UNARY_DOMAINS))
def test_unary_math(op, dtype):
    low, high = UNARY_DOMAINS[op]
    x = rand((4, 6), dtype, seed=60, low=low, high=high)
    if op in ("Sign", "Abs", "Neg"):
        x[0, :3] = 0
    check_unary(op, x)


def test_reciprocal_negative():
    check_unary("Reciprocal", -rand((3, 4), seed=61, low=0.5, high=4.0))


def test_round_half_to_even():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.49999997, -3.5001], dtype=np.float32)
    check_unary("Round", x)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64], ids=dtype_id)
@pytest.mark.parametrize("op", ["Abs", "Neg", "Sign"])
def test_unary_integers(op, dtype):
    x = rand((3, 5), dtype, seed=62, low=-50, high=50)
    x[0, 0] = 0
    check_unary(op, x)


@pytest.mark.parametrize("op", ["Abs", "Sign"])
def test_unary_unsigned(op):
    x = np.array([0, 1, 7, 200, 255], dtype=np.uint8)
    check_unary(op, x)


# -- activations --------------------------------------------------------------------------------

# (op type, attributes, first opset where ORT has the op)
ACTIVATIONS = [
    ("Relu", {}, 14),
    ("LeakyRelu", {}, 16),
    ("LeakyRelu", {"alpha": 0.3}, 16),
    ("Elu", {}, 6),
    ("Elu", {"alpha": 0.5}, 6),
    ("Celu", {}, 12),
    ("Celu", {"alpha": 2.5}, 12),
    ("Selu", {}, 6),
    ("Selu", {"alpha": 1.5, "gamma": 2.0}, 6),
    ("HardSigmoid", {}, 6),
    ("HardSigmoid", {"alpha": 0.4, "beta": 0.3}, 6),
    ("HardSwish", {}, 14),
    ("Softplus", {}, 1),
    ("Softsign", {}, 1),
    ("Mish", {}, 18),
    ("ThresholdedRelu", {}, 10),
    ("ThresholdedRelu", {"alpha": 0.5}, 10),
    ("Sigmoid", {}, 13),
    ("Tanh", {}, 13),
    ("Gelu", {}, 20),
    ("Gelu", {"approximate": "tanh"}, 20),
    ("Gelu", {"approximate": "none"}, 20),
]


def activation_id(case) -> str:
    op, attrs, _ = case
    return op + "".join(f"-{k}={v}" for k, v in attrs.items())


@pytest.mark.parametrize("case", ACTIVATIONS, ids=activation_id)
def test_activation_random(case):
    op, attrs, first = case
    x = rand((3, 4, 5), seed=70, low=-4, high=4)
    check_unary(op, x, opset=max(17, first), **attrs)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=dtype_id)
@pytest.mark.parametrize("case", ACTIVATIONS, ids=activation_id)
def test_activation_extremes(case, dtype):
    """No overflow to inf or NaN in the far tails (exp(100) overflows float32)."""
    op, attrs, first = case
    if op == "Celu" and dtype != np.float32:
        pytest.skip("Celu is defined for float32 only up to opset 21")
    x = EXTREMES.astype(dtype)
    check_unary(op, x, opset=max(17, first), **attrs)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8], ids=dtype_id)
def test_relu_integers(dtype):
    check_unary("Relu", rand((3, 4), dtype, seed=71, low=-9, high=9), opset=14)


@pytest.mark.parametrize("slope_shape", [(), (1,), (5,), (4, 1), (3, 4, 5), (1, 4, 1)], ids=str)
def test_prelu_slope_broadcast(slope_shape):
    x = rand((3, 4, 5), seed=72, low=-4, high=4)
    slope = rand(slope_shape, seed=73, low=0.0, high=1.0)
    assert_matches(single_op("PRelu", {"x": x, "s": slope}, opset=16), {"x": x, "s": slope})


def test_prelu_slope_initializer():
    x = rand((2, 3, 4, 4), seed=74, low=-4, high=4)
    slope = rand((3, 1, 1), seed=75, low=0.0, high=1.0)
    assert_matches(single_op("PRelu", {"x": x}, initializers={"s": slope}), {"x": x})


# -- Clip -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64], ids=dtype_id)
@pytest.mark.parametrize(
    "bounds", [(None, None), (-1.0, None), (None, 1.5), (-1.0, 1.5), (2.0, 1.0), (0.0, 0.0)], ids=str
)
def test_clip(bounds, dtype):
    """Bounds as scalar initializers; omitted ones are empty input names.  min > max
    clamps everything to max."""
    lo, hi = bounds
    x = rand((4, 5), dtype, seed=80, low=-4, high=4)
    inits = {}
    order = ["x", "", ""]
    if lo is not None:
        inits["lo"] = np.asarray(lo).astype(dtype)
        order[1] = "lo"
    if hi is not None:
        inits["hi"] = np.asarray(hi).astype(dtype)
        order[2] = "hi"
    while order[-1] == "":
        order.pop()
    model = single_op("Clip", {"x": x}, initializers=inits, input_order=order, opset=13)
    assert_matches(model, {"x": x})


def test_clip_bounds_as_inputs():
    """Bounds that are model inputs, not constants, are read at run time."""
    x = rand((4, 5), seed=81, low=-4, high=4)
    feeds = {"x": x, "lo": np.array(-0.5, dtype=np.float32), "hi": np.array([2.0], dtype=np.float32)}
    assert_matches(single_op("Clip", feeds, opset=13), feeds)


def test_clip_rejects_tensor_bounds():
    x = rand((4, 5))
    model = single_op("Clip", {"x": x}, initializers={"lo": np.zeros((5,), np.float32)})
    with pytest.raises(UnsupportedError, match="scalar"):
        import_onnx(model)
