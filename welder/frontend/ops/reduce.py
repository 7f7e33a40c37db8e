"""Reductions: the ReduceXxx family, ArgMax and ArgMin.

Each lowers to one reduction compute (two for the numerically stable LogSumExp) plus
injective computes for whatever follows the reduction (the mean's division, L2's square
root).  With ``keepdims`` the reduction produces the kept size-1 axes itself, so no
reshape follows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from welder.errors import ModelError
from welder.frontend.ops.norm import kept, reduce_over, reduced_shape
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.compute import reduce_identity
from welder.ir.expr import Expr, call, cast, const, is_float, is_half, lt, select


def _square(v: Expr) -> Expr:
    return v * v


def _abs(v: Expr) -> Expr:
    return call("abs", v) if is_float(v.dtype) else select(lt(v, 0), call("neg", v), v)


@dataclass(frozen=True)
class _Reduction:
    """``post(op(pre(x)), n)`` where ``n`` is the number of reduced elements."""

    op: str
    pre: Callable[[Expr], Expr] | None = None
    post: Callable[[Expr, int], Expr] | None = None
    # onnxruntime evaluates these on integer tensors in floating point and truncates.
    float_on_integers: bool = False


_REDUCTIONS = {
    "ReduceSum": _Reduction("sum"),
    "ReduceMean": _Reduction("sum", post=lambda s, n: s / n),
    "ReduceMax": _Reduction("max"),
    "ReduceMin": _Reduction("min"),
    "ReduceProd": _Reduction("prod"),
    "ReduceL1": _Reduction("sum", pre=_abs),
    "ReduceL2": _Reduction("sum", pre=_square, post=lambda s, n: call("sqrt", s), float_on_integers=True),
    "ReduceSumSquare": _Reduction("sum", pre=_square),
}


def _axes_from_input(ctx: LowerContext) -> bool:
    """Whether this opset passes the axes as the second input rather than an attribute."""
    return ctx.opset >= (13 if ctx.op_type == "ReduceSum" else 18)


def reduce_axes(ctx: LowerContext, x: Tensor) -> list[int]:
    """The sorted axes to reduce; empty when the node reduces nothing
    (``noop_with_empty_axes``).  Absent or empty axes otherwise mean all of them."""
    from_input = _axes_from_input(ctx)
    misplaced = ctx.attr("axes", None) is not None if from_input else ctx.has_input(1)
    if misplaced:
        where = "the second input" if from_input else "an attribute"
        raise ModelError(f"{ctx.label}: at opset {ctx.opset} the axes are given as {where}")
    if from_input:
        given = [int(a) for a in ctx.const_input(1, "axes").reshape(-1)] if ctx.has_input(1) else []
    else:
        given = list(ctx.attr("axes", []))
    if not given:
        return [] if ctx.attr("noop_with_empty_axes", 0) else list(range(x.rank))
    axes = sorted(ctx.axis(a, x.rank) for a in given)
    if len(set(axes)) != len(axes):
        raise ModelError(f"{ctx.label}: axes {given} name an axis twice")
    return axes


def _work_dtype(dtype: str, float_on_integers: bool, has_post: bool) -> str:
    """The dtype a reduction accumulates and post-processes in.

    float16 and bfloat16 go through float32 when a step follows the reduction: the sum of
    a mean or of L2 can overflow float16 although the final result would not, and a
    bfloat16 intermediate would drop all but 8 bits of it.
    """
    if is_half(dtype) and has_post:
        return "float32"
    if not is_float(dtype) and float_on_integers:
        return "float64"
    return dtype


@register(*_REDUCTIONS)
def reduction(ctx: LowerContext) -> Tensor:
    """One reduction of ``pre(x)``, then ``post`` as an injective compute where needed."""
    x = ctx.input(0)
    kind = _REDUCTIONS[ctx.op_type]
    axes = reduce_axes(ctx, x)
    keepdims = bool(ctx.attr("keepdims", 1))
    work = _work_dtype(x.dtype, kind.float_on_integers, kind.post is not None)

    def pre(v: Expr) -> Expr:
        v = cast(v, work)
        return v if kind.pre is None else kind.pre(v)

    def finish(v: Expr, n: int) -> Expr:
        return cast(v if kind.post is None else kind.post(v, n), x.dtype)

    if not axes:
        # noop_with_empty_axes: the element-wise parts still apply (ReduceSumSquare squares).
        if kind.pre is None and kind.post is None:
            return x
        return ctx.compute(x.shape, lambda *i: finish(pre(x[i]), 1))
    n = math.prod(x.shape[d] for d in axes)
    if n == 0:
        if kind.post is not None and not is_float(work):
            raise ctx.fail(f"the {x.dtype} mean of an empty set is undefined")
        identity = const(reduce_identity(kind.op, work), work)
        return _empty_set(ctx, reduced_shape(x.shape, axes, keepdims), finish(identity, n))
    acc = reduce_over(ctx, x, axes, kind.op, kind.op, pre, keepdims)
    if kind.post is None and work == x.dtype:
        return acc
    return ctx.compute(acc.shape, lambda *i: finish(acc[i], n))


def _empty_set(ctx: LowerContext, shape: tuple[int, ...], value: Expr) -> Tensor:
    """The result of reducing zero elements: ``value`` everywhere.  A compute that loads
    nothing, so it neither reads the empty input nor adds a constant of the output's size."""
    return ctx.compute(shape, lambda *i: value, "empty_set")


@register("ReduceLogSumExp")
def reduce_log_sum_exp(ctx: LowerContext) -> Tensor:
    """``M = max x;  E = exp(x - M');  S = sum E;  Y = log S + M'`` with ``M' = M`` where
    it is finite and 0 otherwise, so all-(-inf) rows give -inf rather than NaN."""
    x = ctx.input(0)
    if not is_float(x.dtype):
        # Runtimes disagree on integer LogSumExp and newer opsets drop it from the schema.
        raise ctx.fail(f"{x.dtype} input is not supported; cast it to a float type first")
    axes = reduce_axes(ctx, x)
    if not axes:
        return x  # log(exp(x)) == x
    keepdims = bool(ctx.attr("keepdims", 1))
    if any(x.shape[d] == 0 for d in axes):
        return _empty_set(ctx, reduced_shape(x.shape, axes, keepdims), const(-math.inf, x.dtype))
    work = _work_dtype(x.dtype, float_on_integers=False, has_post=True)
    m = reduce_over(ctx, x, axes, "max", "max", keepdims=keepdims)

    def finite_shift(*i: Expr) -> Expr:
        v = cast(m[i], work)
        return select(call("isinf", v), 0.0, v)

    shift = ctx.compute(m.shape, finite_shift, "shift")
    e = ctx.compute(x.shape, lambda *i: call("exp", cast(x[i], work) - shift[kept(i, axes, keepdims)]), "exp")
    s = reduce_over(ctx, e, axes, "sum", "sum", keepdims=keepdims)
    return ctx.compute(s.shape, lambda *i: cast(call("log", s[i]) + shift[i], x.dtype))


@register("ArgMax", "ArgMin")
def arg_reduce(ctx: LowerContext) -> Tensor:
    """Index of the first extreme element along ``axis``.  ``select_last_index`` reduces
    the reversed axis instead (through an injective view) and maps the index back."""
    x = ctx.input(0)
    if x.rank == 0:
        raise ModelError(f"{ctx.label}: input must have rank >= 1")
    axis = ctx.axis(ctx.attr("axis", 0), x.rank)
    n = x.shape[axis]
    if n == 0:
        raise ctx.fail(f"axis {axis} of shape {list(x.shape)} is empty")
    keepdims = bool(ctx.attr("keepdims", 1))
    op = "argmax" if ctx.op_type == "ArgMax" else "argmin"
    if not ctx.attr("select_last_index", 0):
        return reduce_over(ctx, x, [axis], op, op, keepdims=keepdims)

    def flipped(*i: Expr) -> Expr:
        return x[tuple((n - 1) - v if d == axis else v for d, v in enumerate(i))]

    rev = ctx.compute(x.shape, flipped, "reversed")
    pos = reduce_over(ctx, rev, [axis], op, op, keepdims=keepdims)
    return ctx.compute(pos.shape, lambda *i: (n - 1) - pos[i])
