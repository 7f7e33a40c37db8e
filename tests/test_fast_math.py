"""The cheaper math that kernels use for 16-bit floats (codegen/cprint.py's ``_FAST_16``,
welder_erf16 in welder_math.cuh, fp16's fast division) over every value of the format:
the generated kernel's result against the float64 function rounded once to the format,
at most one unit in the last place off, and that rarely (where the exact value sits near a
rounding boundary).  Exact values under float's smallest normal number (2^-126, which only
bf16 reaches) may come out as zero: the kernels compute in float, and welder_exp16 flushes such
results.  The emulator runs the kernels here; tests/test_gpu.py runs the same
check on the GPU, where welder_exp16 and welder_div16 are the hardware's approximations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import make_model

from welder.arch import get_arch
from welder.codegen import generate_model
from welder.frontend.onnx import import_onnx
from welder.runtime.emu import available
from welder.runtime.emulate import EmulatedModel
from welder.schedule.plan import plan_model

FORMATS = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


# ONNX op -> its float64 reference.
FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Exp": lambda x: np.exp(x),
    "Erf": np.vectorize(math.erf),
    "Sigmoid": _sigmoid,
    "Gelu": _gelu,
}

FLOAT_TINY = 2.0**-126
# welder_erf16's absolute error bound (scripts/fit_erf16.py), rounded up.
ERF_ERROR = 5e-6

# The share of values allowed one unit in the last place off.
OFF_BY_ONE = 0.005


def every_value(dtype: type) -> np.ndarray:
    """Every finite value of a 16-bit float format, then NaN and both infinities, as a
    matrix of 256 columns."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(dtype)
    finite = values[np.isfinite(values.astype(np.float32))]
    tail = np.array([np.nan, np.inf, -np.inf], np.float32).astype(dtype)
    flat = np.concatenate([finite, tail])
    rows = -(-flat.size // 256)
    return np.concatenate([flat, np.full(rows * 256 - flat.size, np.nan, np.float32).astype(dtype)]).reshape(
        rows, 256
    )


def unary_model(op: str, dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-node model of ``op`` fed every value of ``dtype``."""
    x = every_value(dtype)
    model = make_model([helper.make_node(op, ["x"], ["y"])], {"x": x}, ["y"], opset=20)
    return model, {"x": x}


def ordered(values: np.ndarray) -> np.ndarray:
    """16-bit floats as integers in the order of their values (both zeros at 0), so that
    neighbouring values differ by one."""
    bits = values.view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def assert_rounded_once(op: str, dtype: type, got: np.ndarray, x: np.ndarray) -> None:
    """``got`` within one unit in the last place of the float64 ``op`` of ``x`` rounded to
    ``dtype`` (or zero, under float's normal range), for all but ``OFF_BY_ONE`` of the values;
    NaN exactly where the exact value is.  Where GELU's 1 + erf(x / sqrt 2) cancels (x < -2),
    its error is erf's absolute error times |x| / 2 however erf is computed in float (erff's
    is float's spacing at 1, 6e-8): there the bound is that, for ours, plus the rounding to
    ``dtype``."""
    wide = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        exact64 = FUNCTIONS[op](wide)
        exact = exact64.astype(dtype)
    nan = np.isnan(exact.astype(np.float32))
    assert np.array_equal(nan, np.isnan(got.astype(np.float32))), f"{op}: NaN where the exact value is not"
    cancels = ~nan & (wide < -2) if op == "Gelu" else np.zeros_like(nan)
    error = np.abs(got[cancels].astype(np.float64) - exact64[cancels])
    info = ml_dtypes.finfo(dtype)
    rounding = float(info.eps) * np.abs(exact64[cancels]) + float(info.smallest_subnormal)
    bound = ERF_ERROR * np.abs(wide[cancels]) / 2 + rounding
    assert np.all(error <= bound), f"{op}: {np.max(error - bound):.2e} over the bound where 1 + erf cancels"
    _assert_within_an_ulp(f"{op} {dtype.__name__}", got, exact64, dtype, ~nan & ~cancels, x)


def _assert_within_an_ulp(
    label: str, got: np.ndarray, exact64: np.ndarray, dtype: type, kept: np.ndarray, x: np.ndarray
) -> None:
    """Where ``kept``: ``got`` at most one unit in the last place off ``exact64`` rounded to
    ``dtype`` (zero counts as right under float's normal range), on at most ``OFF_BY_ONE``
    of the values."""
    exact = exact64.astype(dtype)
    off = np.abs(ordered(got[kept]) - ordered(exact[kept]))
    flushed = (got[kept].astype(np.float32) == 0) & (np.abs(exact64[kept]) < FLOAT_TINY)
    off[flushed] = 0
    worst = int(np.argmax(off))
    assert off.max() <= 1, (
        f"{label}: {off.max()} ulp off at x = {x[kept][worst]!r}: "
        f"{got[kept][worst]!r}, exactly {exact[kept][worst]!r}"
    )
    assert np.mean(off) <= OFF_BY_ONE, f"{label}: {np.mean(off):.2%} of values one ulp off"


def emulated(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list, np.ndarray]:
    """The kernels welder generates for ``model`` (one config a group) and its output ``y``
    from the emulator."""
    graph = import_onnx(model)
    plan = plan_model(graph, get_arch("H100"), topk=1)
    kernels = generate_model(graph, [(p.group, p.configs[0]) for p in plan.groups])
    return kernels, EmulatedModel(graph, kernels).run(feeds)["y"]


@pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_16_bit_math_is_within_an_ulp_of_the_exact_value_for_every_input(op: str, fmt: str) -> None:
    dtype = FORMATS[fmt]
    model, feeds = unary_model(op, dtype)
    _, got = emulated(model, feeds)
    assert_rounded_once(op, dtype, got, feeds["x"])


#: What a softmax subtracts before its exp (welder_exp16_sub): its row's maximum, here one per
#: column -- small and moderate, then a row masked whole (BERT's additive mask, -10^4).
MAXIMA = np.concatenate([np.linspace(-64.0, 64.0, 253), [0.0, 1.0e4, -1.0e4]])


def difference_model(dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """exp(x - m) of every value ``x`` of ``dtype`` against each of the :data:`MAXIMA`."""
    x = every_value(dtype)
    nodes = [helper.make_node("Sub", ["x", "m"], ["d"]), helper.make_node("Exp", ["d"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"], {"m": MAXIMA.astype(dtype)}, opset=20), {"x": x}


def assert_difference_rounded_once(dtype: type, got: np.ndarray, x: np.ndarray) -> None:
    """``got`` within one unit in the last place of the float64 exp(x - m) rounded to
    ``dtype`` (or zero, under float's normal range), for all but ``OFF_BY_ONE`` of the
    values; NaN exactly where the exact value is."""
    m = MAXIMA.astype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        exact64 = np.exp(x.astype(np.float64) - m.astype(np.float64))
    _assert_columns_rounded_once("exp(x - m)", dtype, got, exact64, x)


def _assert_columns_rounded_once(
    label: str, dtype: type, got: np.ndarray, exact64: np.ndarray, x: np.ndarray
) -> None:
    """NaN in ``got`` exactly where the float64 ``exact64`` rounds to NaN in ``dtype``,
    every other value within one unit in the last place of it, and that rarely."""
    nan = np.isnan(exact64.astype(dtype).astype(np.float32))
    assert np.array_equal(nan, np.isnan(got.astype(np.float32))), f"{label}: NaN where the exact value is not"
    _assert_within_an_ulp(f"{label} {dtype.__name__}", got, exact64, dtype, ~nan, x)


@pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_exp_of_a_difference_is_within_an_ulp_for_every_input(fmt: str) -> None:
    """exp(x - m), which a softmax computes, is one FFMA and an ex2 (welder_exp16_sub:
    x log2(e) - m log2(e)): within one unit in the last place of the float64 value rounded
    once, for every value of the format against 256 maxima, and that rarely.
    tests/test_gpu.py runs the same check with the hardware's ex2.approx."""
    dtype = FORMATS[fmt]
    model, feeds = difference_model(dtype)
    kernels, got = emulated(model, feeds)
    assert all("welder_exp16_sub(" in k.source for k in kernels)
    assert_difference_rounded_once(dtype, got, feeds["x"])


#: The divisors of every value (one a column): both zeros, both infinities, NaN, the
#: smallest subnormal and the largest finite fp16 of both signs, 1, 3 and -0.1, then 61
#: values spaced evenly in log from 2^-24 to 2^15 and a third of each, of both signs.
DIVISORS = np.concatenate(
    [
        [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-24, -(2.0**-24), 65504.0, -65504.0, 1.0, 3.0, -0.1],
        *(s * np.logspace(-24, 15, 61, base=2.0) for s in (1.0, -1.0)),
        *(s * np.logspace(-24, 15, 61, base=2.0) / 3.0 for s in (1.0, -1.0)),
    ]
)


def quotient_model(dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x / d of every value ``x`` of ``dtype`` by each of the :data:`DIVISORS`."""
    x = every_value(dtype)
    node = helper.make_node("Div", ["x", "d"], ["y"])
    return make_model([node], {"x": x}, ["y"], {"d": DIVISORS.astype(dtype)}, opset=20), {"x": x}


def assert_quotient_rounded_once(dtype: type, got: np.ndarray, x: np.ndarray) -> None:
    """``got`` within one unit in the last place of the float64 x / d rounded to ``dtype``,
    for all but ``OFF_BY_ONE`` of the values; NaN exactly where the exact value is."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        exact64 = x.astype(np.float64) / DIVISORS.astype(dtype).astype(np.float64)
    _assert_columns_rounded_once("x / d", dtype, got, exact64, x)


@pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_quotient_is_within_an_ulp_for_every_input(fmt: str) -> None:
    """x / d: fp16 takes welder_div16 (a reciprocal and a product), bf16 IEEE division;
    within one unit in the last place of the float64 quotient rounded once, for every value
    of the format by 256 divisors (zeros, infinities, NaN, fp16's extremes), and that rarely.
    tests/test_gpu.py runs the same check with the hardware's rcp.approx."""
    dtype = FORMATS[fmt]
    model, feeds = quotient_model(dtype)
    kernels, got = emulated(model, feeds)
    assert all(("welder_div16(" in k.source) == (fmt == "float16") for k in kernels)
    assert_quotient_rounded_once(dtype, got, feeds["x"])
