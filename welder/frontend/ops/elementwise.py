"""Elementwise operators: arithmetic, comparisons, logic, activations, casts.

All of them lower to one injective compute over the numpy-broadcast output shape.
Activations are composed from the IR's small set of math functions so the back ends
only implement those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from welder.errors import ModelError
from welder.frontend.registry import LowerContext, Tensor, dtype_from_onnx, register
from welder.ir.expr import (
    Const,
    Expr,
    binary,
    call,
    cast,
    eq,
    gt,
    is_float,
    le,
    logical_and,
    lt,
    maximum,
    minimum,
    select,
)


def broadcast_shape(ctx: LowerContext, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ModelError(f"{ctx.label}: input shapes {list(map(list, shapes))} do not broadcast") from None


def elementwise(ctx: LowerContext, fn: Callable[..., Expr], inputs: Sequence[Tensor] | None = None) -> Tensor:
    """``out[i] = fn(x0[i], x1[i], ...)`` with numpy broadcasting of the inputs."""
    xs = list(inputs) if inputs is not None else [ctx.input(k) for k in range(len(ctx.inputs))]
    shape = broadcast_shape(ctx, [x.shape for x in xs])
    return ctx.compute(shape, lambda *i: fn(*(x.broadcast(i) for x in xs)))


def unary(ctx: LowerContext, fn: Callable[[Expr], Expr]) -> Tensor:
    return elementwise(ctx, fn, [ctx.input(0)])


# -- arithmetic -------------------------------------------------------------------------

_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}


@register(*_BINARY)
def arith(ctx: LowerContext) -> Tensor:
    op = _BINARY[ctx.op_type]
    return elementwise(ctx, lambda a, b: binary(op, a, b), [ctx.input(0), ctx.input(1)])


@register("Pow")
def power(ctx: LowerContext) -> Tensor:
    x, y = ctx.input(0), ctx.input(1)
    exponent = ctx.const_value(1)
    if exponent is not None and exponent.size == 1 and is_float(x.dtype):
        e = float(exponent.reshape(()))
        special: dict[float, Callable[[Expr], Expr]] = {
            1.0: lambda v: v,
            2.0: lambda v: v * v,
            3.0: lambda v: v * v * v,
            # pow(-inf, 0.5) is +inf where sqrt(-inf) is NaN.
            0.5: lambda v: select(eq(v, -math.inf), Const(math.inf, v.dtype), call("sqrt", v)),
        }
        if e in special and broadcast_shape(ctx, [x.shape, y.shape]) == x.shape:
            return unary(ctx, special[e])
    return elementwise(ctx, pow_expr, [x, y])


def pow_expr(base: Expr, exponent: Expr) -> Expr:
    """``base ** exponent`` in the base's type.  Integer bases are raised in double and
    truncated, as onnxruntime does: ``2 ** -1 == 0`` and ``9 ** 0.5 == 3`` (an exponent
    of another type is allowed, and converting it to the integer type first would lose
    both)."""
    if is_float(base.dtype):
        return binary("pow", base, cast(exponent, base.dtype))
    wide = binary("pow", cast(base, "float64"), cast(exponent, "float64"))
    return cast(wide, base.dtype)


@register("Mod")
def mod(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    if ctx.attr("fmod", 0) or is_float(x.dtype):
        if not ctx.attr("fmod", 0):
            raise ctx.fail("fmod=0 is only defined for integer inputs")
        return elementwise(ctx, lambda a, b: call("fmod", a, b), [x, ctx.input(1)])
    return elementwise(ctx, lambda a, b: binary("mod", a, b), [x, ctx.input(1)])


_VARIADIC = {"Max": "max", "Min": "min", "Sum": "add", "Mean": "add"}


@register(*_VARIADIC)
def variadic(ctx: LowerContext) -> Tensor:
    op = _VARIADIC[ctx.op_type]
    xs = [ctx.input(k) for k in range(len(ctx.inputs))]

    def fn(*vals: Expr) -> Expr:
        out = vals[0]
        for v in vals[1:]:
            out = binary(op, out, v)
        return out / len(vals) if ctx.op_type == "Mean" else out

    return elementwise(ctx, fn, xs)


# -- comparison and logic -----------------------------------------------------------------

_COMPARE = {
    "Equal": "eq",
    "Less": "lt",
    "LessOrEqual": "le",
    "Greater": "gt",
    "GreaterOrEqual": "ge",
    "And": "and",
    "Or": "or",
    "Xor": "xor",
}


@register(*_COMPARE)
def compare(ctx: LowerContext) -> Tensor:
    op = _COMPARE[ctx.op_type]
    return elementwise(ctx, lambda a, b: binary(op, a, b), [ctx.input(0), ctx.input(1)])


@register("Not")
def logical_not(ctx: LowerContext) -> Tensor:
    return unary(ctx, lambda x: call("not", x))


@register("Where")
def where(ctx: LowerContext) -> Tensor:
    return elementwise(ctx, select, [ctx.input(0), ctx.input(1), ctx.input(2)])


@register("IsNaN")
def isnan(ctx: LowerContext) -> Tensor:
    return unary(ctx, lambda x: call("isnan", x))


@register("IsInf")
def isinf(ctx: LowerContext) -> Tensor:
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)

    def fn(x: Expr) -> Expr:
        inf = call("isinf", x)
        if pos and neg:
            return inf
        if not pos and not neg:
            return logical_and(inf, call("not", inf))
        return logical_and(inf, gt(x, 0.0) if pos else lt(x, 0.0))

    return unary(ctx, fn)


# -- casts ----------------------------------------------------------------------------------


@register("Cast")
def cast_op(ctx: LowerContext) -> Tensor:
    to = dtype_from_onnx(ctx.attr("to"), f"{ctx.label}: target type")
    return unary(ctx, lambda x: _cast(x, to))


@register("CastLike")
def cast_like(ctx: LowerContext) -> Tensor:
    to = ctx.input(1).dtype
    return unary(ctx, lambda x: _cast(x, to))


def _cast(x: Expr, to: str) -> Expr:
    if to == "bool" and x.dtype != "bool":
        return binary("ne", x, 0.0 if is_float(x.dtype) else 0)
    return cast(x, to)


# -- unary math and activations ------------------------------------------------------------

_CALLS = {
    "Sqrt": "sqrt",
    "Exp": "exp",
    "Log": "log",
    "Erf": "erf",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Abs": "abs",
    "Neg": "neg",
    "Floor": "floor",
    "Ceil": "ceil",
    "Round": "round",
    "Sin": "sin",
    "Cos": "cos",
}


@register(*_CALLS)
def math_call(ctx: LowerContext) -> Tensor:
    fn = _CALLS[ctx.op_type]
    if fn == "abs" and not is_float(ctx.input(0).dtype):
        return unary(ctx, lambda x: select(lt(x, 0), call("neg", x), x))
    return unary(ctx, lambda x: call(fn, x))


@register("Reciprocal")
def reciprocal(ctx: LowerContext) -> Tensor:
    return unary(ctx, lambda x: 1.0 / x)


@register("Sign")
def sign(ctx: LowerContext) -> Tensor:
    """1 above zero, -1 below, and the input itself otherwise: that is zero (of either
    sign) or NaN, which Sign must propagate."""
    dtype = ctx.input(0).dtype

    def fn(x: Expr) -> Expr:
        # Typed constants: a Python scalar would default to float32 or index.
        out = select(gt(x, 0), Const(1, dtype), x)
        if dtype.startswith("uint"):
            return out
        return select(lt(x, 0), Const(-1, dtype), out)

    return unary(ctx, fn)


@register("Relu")
def relu(ctx: LowerContext) -> Tensor:
    zero = 0.0 if is_float(ctx.input(0).dtype) else 0
    return unary(ctx, lambda x: maximum(x, zero))


@register("LeakyRelu")
def leaky_relu(ctx: LowerContext) -> Tensor:
    alpha = ctx.attr("alpha", 0.01)
    return unary(ctx, lambda x: select(lt(x, 0.0), x * alpha, x))


@register("PRelu")
def prelu(ctx: LowerContext) -> Tensor:
    return elementwise(ctx, lambda x, s: select(lt(x, 0.0), x * s, x), [ctx.input(0), ctx.input(1)])


@register("Elu")
def elu(ctx: LowerContext) -> Tensor:
    alpha = ctx.attr("alpha", 1.0)
    return unary(ctx, lambda x: select(lt(x, 0.0), (call("exp", x) - 1.0) * alpha, x))


@register("Celu")
def celu(ctx: LowerContext) -> Tensor:
    alpha = ctx.attr("alpha", 1.0)
    return unary(ctx, lambda x: maximum(x, 0.0) + minimum((call("exp", x / alpha) - 1.0) * alpha, 0.0))


@register("Selu")
def selu(ctx: LowerContext) -> Tensor:
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    return unary(ctx, lambda x: select(le(x, 0.0), call("exp", x) * alpha - alpha, x) * gamma)


@register("HardSigmoid")
def hard_sigmoid(ctx: LowerContext) -> Tensor:
    alpha, beta = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    return unary(ctx, lambda x: _clamp01(x * alpha + beta))


@register("HardSwish")
def hard_swish(ctx: LowerContext) -> Tensor:
    return unary(ctx, lambda x: x * _clamp01(x * (1.0 / 6.0) + 0.5))


def _clamp01(v: Expr) -> Expr:
    return maximum(minimum(v, 1.0), 0.0)


def softplus_expr(x: Expr) -> Expr:
    """log(1 + exp(x)) without overflow for large x."""
    return maximum(x, 0.0) + call("log", call("exp", call("neg", call("abs", x))) + 1.0)


@register("Softplus")
def softplus(ctx: LowerContext) -> Tensor:
    return unary(ctx, softplus_expr)


@register("Softsign")
def softsign(ctx: LowerContext) -> Tensor:
    return unary(ctx, lambda x: x / (call("abs", x) + 1.0))


@register("Mish")
def mish(ctx: LowerContext) -> Tensor:
    return unary(ctx, lambda x: x * call("tanh", softplus_expr(x)))


@register("ThresholdedRelu")
def thresholded_relu(ctx: LowerContext) -> Tensor:
    alpha = ctx.attr("alpha", 1.0)
    return unary(ctx, lambda x: select(gt(x, alpha), x, 0.0))


def gelu_expr(x: Expr, approximate: str = "none") -> Expr:
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (call("tanh", inner) + 1.0)
    return x * 0.5 * (call("erf", x * (1.0 / math.sqrt(2.0))) + 1.0)


@register("Gelu")
def gelu(ctx: LowerContext) -> Tensor:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ctx.fail(f"unknown approximate={approximate!r}")
    return unary(ctx, lambda x: gelu_expr(x, approximate))


@register("Clip")
def clip(ctx: LowerContext) -> Tensor:
    ctx.input(0)
    lo, hi = ctx.optional_input(1), ctx.optional_input(2)
    for t, what in ((lo, "min"), (hi, "max")):
        if t is not None and t.size != 1:
            raise ctx.fail(f"{what} must be a scalar")

    def fn(v: Expr) -> Expr:
        if lo is not None:
            v = maximum(v, lo[(0,) * lo.rank])
        if hi is not None:
            v = minimum(v, hi[(0,) * hi.rank])
        return v

    return unary(ctx, fn)
