"""Normalisations.  Each lowers to several computes with one reduction apiece, so the
scheduler sees (and can fuse) the individual stages:

    total = sum x;  mean = total / n;  centred = x - mean;  sq = sum centred^2;
    inv_std = rsqrt(sq / n + eps);  y = (x - mean) * inv_std * scale + bias

Only ``total`` and ``sq`` are reductions; everything else is injective and is inlined by
the scheduler.  Statistics of 16-bit float tensors are kept in float32: a float16 sum of
squares overflows long before the variance itself does, and a bfloat16 one keeps 8 bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from welder.errors import ModelError
from welder.frontend.registry import LowerContext, Tensor, dtype_from_onnx, register
from welder.ir.compute import reduce, reduce_axis
from welder.ir.expr import Expr, call, cast, is_float, is_half


def _same(v: Expr) -> Expr:
    return v


def reduced_shape(shape: Sequence[int], axes: Sequence[int], keepdims: bool) -> tuple[int, ...]:
    """Shape after reducing ``axes``: dropped, or kept with extent 1 (``keepdims``)."""
    if keepdims:
        return tuple(1 if d in axes else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in axes)


def reduce_over(
    ctx: LowerContext,
    x: Tensor,
    axes: Sequence[int],
    op: str,
    hint: str,
    value: Callable[[Expr], Expr] = _same,
    keepdims: bool = False,
) -> Tensor:
    """``op`` over ``axes`` of ``value(x[...])``.  The result drops those axes, or keeps
    them with extent 1 (``keepdims``) and never reads their index, so a keepdims result
    costs no reshape afterwards."""

    def fn(*idx: Expr):
        rvars = {d: reduce_axis(x.shape[d]) for d in axes}
        if keepdims:
            full = [rvars.get(d, i) for d, i in enumerate(idx)]
        else:
            rest = iter(idx)
            full = [rvars[d] if d in rvars else next(rest) for d in range(x.rank)]
        return reduce(op, value(x[tuple(full)]), list(rvars.values()))

    return ctx.compute(reduced_shape(x.shape, axes, keepdims), fn, hint)


def kept(idx: Sequence[Expr], axes: Sequence[int], keepdims: bool = False) -> tuple[Expr, ...]:
    """The index into a reduction over ``axes`` (see :func:`reduce_over`) that belongs to
    the full index ``idx`` of its input."""
    if keepdims:
        return tuple(0 if d in axes else i for d, i in enumerate(idx))
    return tuple(i for d, i in enumerate(idx) if d not in axes)


def stats_dtype(dtype: str) -> str:
    """The float type statistics of a ``dtype`` tensor are computed in."""
    return "float32" if is_half(dtype) else dtype


def moments(
    ctx: LowerContext, x: Tensor, axes: Sequence[int], epsilon: float, dtype: str, keepdims: bool = True
) -> tuple[Tensor, Tensor]:
    """Mean and ``1 / sqrt(var + epsilon)`` of ``x`` over ``axes``, in ``dtype``.

    The variance is the mean of squared deviations from the mean (two reductions), not
    ``E[x^2] - E[x]^2``, which cancels catastrophically when the mean is large.
    """
    n = math.prod(x.shape[d] for d in axes)

    def to(v: Expr) -> Expr:
        return cast(v, dtype)

    total = reduce_over(ctx, x, axes, "sum", "sum", to, keepdims)
    mean = ctx.compute(total.shape, lambda *i: total[i] / float(n), "mean")
    centred = ctx.compute(x.shape, lambda *i: to(x[i]) - mean[kept(i, axes, keepdims)], "centred")
    sq = reduce_over(ctx, centred, axes, "sum", "sqsum", lambda v: v * v, keepdims)
    inv_std = ctx.compute(sq.shape, lambda *i: call("rsqrt", sq[i] / float(n) + epsilon), "inv_std")
    return mean, inv_std


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without changing it (unidirectionally)."""
    lead = len(target) - len(shape)
    return lead >= 0 and all(d in (1, target[lead + k]) for k, d in enumerate(shape))


def _check_stats_dtype(ctx: LowerContext, dtype: str) -> str:
    if not is_float(dtype):
        raise ctx.fail(f"normalisation needs a float tensor, got {dtype}")
    return dtype


def _channel_param(ctx: LowerContext, k: int, what: str, channels: int) -> Tensor:
    """Input ``k``, a per-channel vector of length ``channels``."""
    t = ctx.input(k)
    if t.shape != (channels,):
        raise ModelError(f"{ctx.label}: {what} has shape {list(t.shape)}, expected [{channels}]")
    return t


def _channels(ctx: LowerContext, x: Tensor, min_rank: int) -> int:
    """The channel count of an ``[N, C, ...]`` input of at least ``min_rank`` dims."""
    if x.rank < min_rank:
        raise ModelError(f"{ctx.label}: input has rank {x.rank}, expected at least {min_rank}")
    return x.shape[1]


# -- softmax ---------------------------------------------------------------------------------


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
    if x.size == 0:  # nothing to normalise; the output is as empty as the input
        return ctx.compute(x.shape, lambda *i: x[i])
    m = reduce_over(ctx, x, axes, "max", "max")
    if ctx.op_type == "LogSoftmax":
        shifted = ctx.compute(x.shape, lambda *i: x[i] - m[kept(i, axes)], "shifted")
        s = reduce_over(ctx, shifted, axes, "sum", "sum", lambda v: call("exp", v))
        return ctx.compute(x.shape, lambda *i: shifted[i] - call("log", s[kept(i, axes)]))
    e = ctx.compute(x.shape, lambda *i: call("exp", x[i] - m[kept(i, axes)]), "exp")
    s = reduce_over(ctx, e, axes, "sum", "sum")
    return ctx.compute(x.shape, lambda *i: e[i] / s[kept(i, axes)])


# -- layer, instance, group and batch normalisation --------------------------------------------


@register("LayerNormalization")
def layer_norm(ctx: LowerContext) -> list[Tensor]:
    """Normalises over ``axis..rank-1``; Mean and InvStdDev have the keepdims shape and the
    ``stash_type`` dtype, which is also the arithmetic of the whole operator."""
    x = ctx.input(0)
    axis = ctx.axis(ctx.attr("axis", -1), x.rank)
    axes = list(range(axis, x.rank))
    dtype = _check_stats_dtype(ctx, dtype_from_onnx(ctx.attr("stash_type", 1), f"{ctx.label}: stash_type"))
    scale, bias = ctx.input(1), ctx.optional_input(2)
    for t, what in ((scale, "Scale"), (bias, "B")):
        if t is not None and not _broadcasts_to(t.shape, x.shape):
            raise ModelError(
                f"{ctx.label}: {what} of shape {list(t.shape)} does not broadcast to {list(x.shape)}"
            )
    mean, inv_std = moments(ctx, x, axes, ctx.attr("epsilon", 1e-5), dtype, keepdims=True)

    def fn(*i: Expr) -> Expr:
        v = (cast(x[i], dtype) - mean[kept(i, axes, True)]) * inv_std[kept(i, axes, True)]
        v = v * cast(scale.broadcast(i), dtype)
        if bias is not None:
            v = v + cast(bias.broadcast(i), dtype)
        return cast(v, x.dtype)

    return [ctx.compute(x.shape, fn), mean, inv_std]


@register("InstanceNormalization")
def instance_norm(ctx: LowerContext) -> Tensor:
    """Per sample and channel over the spatial axes, then a per-channel affine."""
    x = ctx.input(0)
    channels = _channels(ctx, x, 3)
    scale = _channel_param(ctx, 1, "scale", channels)
    bias = _channel_param(ctx, 2, "B", channels)
    dtype = _check_stats_dtype(ctx, stats_dtype(x.dtype))
    mean, inv_std = moments(ctx, x, range(2, x.rank), ctx.attr("epsilon", 1e-5), dtype, keepdims=False)

    def fn(*i: Expr) -> Expr:
        stat = i[:2]
        v = (cast(x[i], dtype) - mean[stat]) * inv_std[stat]
        return cast(v * cast(scale[i[1]], dtype) + cast(bias[i[1]], dtype), x.dtype)

    return ctx.compute(x.shape, fn)


@register("GroupNormalization")
def group_norm(ctx: LowerContext) -> Tensor:
    """Statistics over each group of ``C / num_groups`` channels and the spatial axes.

    Scale and bias are per group up to opset 20 and per channel from opset 21.  The
    statistics reduce a grouped view ``[N, G, C/G, ...]`` of the input (injective, so
    it costs no copy); the output indexes them with ``c // (C/G)``.
    """
    x = ctx.input(0)
    channels = _channels(ctx, x, 2)
    groups = ctx.attr("num_groups")
    if groups < 1 or channels % groups:
        raise ModelError(f"{ctx.label}: num_groups={groups} does not divide the {channels} channels")
    per_channel = ctx.opset >= 21
    params = channels if per_channel else groups
    scale = _channel_param(ctx, 1, "scale", params)
    bias = _channel_param(ctx, 2, "bias", params)
    dtype = stats_dtype(x.dtype)
    if ctx.opset >= 21:
        dtype = dtype_from_onnx(ctx.attr("stash_type", 1), f"{ctx.label}: stash_type")
    _check_stats_dtype(ctx, dtype)
    width = channels // groups
    grouped = ctx.compute(
        (x.shape[0], groups, width, *x.shape[2:]),
        lambda n, g, k, *s: x[(n, g * width + k, *s)],
        "grouped",
    )
    axes = range(2, grouped.rank)
    mean, inv_std = moments(ctx, grouped, axes, ctx.attr("epsilon", 1e-5), dtype, keepdims=False)

    def fn(*i: Expr) -> Expr:
        stat = (i[0], i[1] // width)
        p = i[1] if per_channel else stat[1]
        v = (cast(x[i], dtype) - mean[stat]) * inv_std[stat]
        return cast(v * cast(scale[p], dtype) + cast(bias[p], dtype), x.dtype)

    return ctx.compute(x.shape, fn)


@register("BatchNormalization")
def batch_norm(ctx: LowerContext) -> Tensor:
    """Inference form: ``(x - mean[c]) * scale[c] / sqrt(var[c] + eps) + B[c]``, one
    injective compute.  (Behind a Conv it is usually folded away before lowering.)"""
    if ctx.attr("training_mode", 0):
        raise ctx.fail("training_mode=1 is not supported (inference only)")
    if any(ctx.output_used(k) for k in range(1, ctx.num_outputs)):
        raise ctx.fail("the running/saved mean and variance outputs exist only in training; not supported")
    x = ctx.input(0)
    channels = _channels(ctx, x, 2)
    scale, bias, mean, var = (
        _channel_param(ctx, k, what, channels) for k, what in enumerate(("scale", "B", "mean", "var"), 1)
    )
    dtype = _check_stats_dtype(ctx, stats_dtype(x.dtype))
    eps = ctx.attr("epsilon", 1e-5)

    def fn(*i: Expr) -> Expr:
        c = i[1]
        coef = cast(scale[c], dtype) * call("rsqrt", cast(var[c], dtype) + eps)
        return cast((cast(x[i], dtype) - cast(mean[c], dtype)) * coef + cast(bias[c], dtype), x.dtype)

    return ctx.compute(x.shape, fn)
