"""Normalisations.  Each lowers to several computes with one reduction apiece, so the
scheduler sees (and can fuse) the individual stages."""

from __future__ import annotations

from collections.abc import Sequence

from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.compute import reduce, reduce_axis
from welder.ir.expr import Expr, call


def reduce_over(
    ctx: LowerContext, x: Tensor, axes: Sequence[int], op: str, hint: str, value=lambda v: v
) -> Tensor:
    """``op`` over ``axes`` of ``value(x[...])``; the result drops those axes."""
    keep = [d for d in range(x.rank) if d not in axes]

    def fn(*idx: Expr):
        rs = [reduce_axis(x.shape[d]) for d in axes]
        full: list[Expr] = [None] * x.rank  # type: ignore[list-item]
        for d, i in zip(keep, idx):
            full[d] = i
        for d, r in zip(axes, rs):
            full[d] = r
        return reduce(op, value(x[tuple(full)]), rs)

    return ctx.compute([x.shape[d] for d in keep], fn, hint)


def kept(idx: Sequence[Expr], axes: Sequence[int]) -> tuple[Expr, ...]:
    """The components of a full index that a reduction over ``axes`` kept."""
    return tuple(i for d, i in enumerate(idx) if d not in axes)


def _softmax_axes(ctx: LowerContext, x: Tensor) -> list[int]:
    default = -1 if ctx.opset >= 13 else 1
    axis = ctx.axis(ctx.attr("axis", default), x.rank)
    # Before opset 13 the input is viewed as 2-D [prod(shape[:axis]), prod(shape[axis:])].
    return [axis] if ctx.opset >= 13 else list(range(axis, x.rank))


@register("Softmax", "LogSoftmax")
def softmax(ctx: LowerContext) -> Tensor:
    """M = max x;  E = exp(x - M);  S = sum E;  Y = E / S   (LogSoftmax: (x - M) - log S)."""
    x = ctx.input(0)
    axes = _softmax_axes(ctx, x)
    m = reduce_over(ctx, x, axes, "max", "max")
    if ctx.op_type == "LogSoftmax":
        shifted = ctx.compute(x.shape, lambda *i: x[i] - m[kept(i, axes)], "shifted")
        s = reduce_over(ctx, shifted, axes, "sum", "sum", lambda v: call("exp", v))
        return ctx.compute(x.shape, lambda *i: shifted[i] - call("log", s[kept(i, axes)]))
    e = ctx.compute(x.shape, lambda *i: call("exp", x[i] - m[kept(i, axes)]), "exp")
    s = reduce_over(ctx, e, axes, "sum", "sum")
    return ctx.compute(x.shape, lambda *i: e[i] / s[kept(i, axes)])
