"""Resize: nearest-neighbour and (multi-)linear interpolation.

An output element reads one input element (nearest) or 2^k of them (linear, k being the
number of axes whose size changes), so the operator is one injective compute that fuses
into its consumer; axes that keep their size read the input index unchanged.

Source coordinates are computed from the output index with float32 arithmetic, operation
for operation as onnxruntime's CPU kernel does: at the rounding boundaries of nearest mode a
mathematically equal formula in a different order picks a different pixel, an error no
tolerance absorbs.  Where that float index equals an affine or floordiv expression at every
output position (integer up- and downsampling), the exact integer form is used instead, so
tile propagation sees ``x[..., i // 2]`` rather than float arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from welder.errors import ModelError
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.compute import compute
from welder.ir.expr import (
    INDEX,
    Expr,
    call,
    cast,
    const,
    ge,
    gt,
    is_float,
    is_half,
    logical_or,
    lt,
    maximum,
    minimum,
    select,
)
from welder.ir.interpret import evaluate

F32 = "float32"
_TRANSFORMS = frozenset(
    {
        "half_pixel",
        "half_pixel_symmetric",
        "pytorch_half_pixel",
        "align_corners",
        "asymmetric",
        "tf_half_pixel_for_nn",
        "tf_crop_and_resize",
    }
)
_NEAREST_MODES = frozenset({"round_prefer_floor", "round_prefer_ceil", "floor", "ceil"})
_POLICIES = frozenset({"stretch", "not_larger", "not_smaller"})
# Distance from one half within which nearest rounding treats a fraction as a tie.
_TIE = 1e-6


@dataclass(frozen=True)
class _Axis:
    """How one output axis maps onto the input: both lengths, the float32 scale the
    coordinate transform divides by, and the crop window (tf_crop_and_resize only)."""

    in_len: int
    out_len: int
    scale: float
    roi: tuple[float, float] = (0.0, 1.0)

    @property
    def identity(self) -> bool:
        # onnxruntime skips the coordinate transform of an axis whose scale is exactly one.
        return self.scale == 1.0 and self.roi == (0.0, 1.0)


@register("Resize")
def resize(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    if x.rank == 0:
        raise ModelError(f"{ctx.label}: cannot resize a scalar")
    mode, transform, nearest_mode = _read_modes(ctx, x)
    axes = _axis_maps(ctx, x, transform)
    guard = _extrapolation_guard(ctx, x, axes) if transform == "tf_crop_and_resize" else None

    if mode == "nearest":
        index_fns = [_nearest_axis(transform, nearest_mode, ax) for ax in axes]

        def body(*i: Expr) -> Expr:
            value = x[tuple(fn(v) for fn, v in zip(index_fns, i))]
            return guard(i, value) if guard else value

    else:
        acc = F32 if is_half(x.dtype) else x.dtype

        def body(*i: Expr) -> Expr:
            taps = [
                (d, *_linear_taps(_source_coordinate(transform, i[d], ax), ax.in_len))
                for d, ax in enumerate(axes)
                if not ax.identity
            ]
            value = cast(_blend(x, list(i), taps, acc), x.dtype)
            return guard(i, value) if guard else value

    return ctx.compute([ax.out_len for ax in axes], body)


def _read_modes(ctx: LowerContext, x: Tensor) -> tuple[str, str, str]:
    """(mode, coordinate transform, nearest rounding), refusing what is not implemented."""
    mode = ctx.attr("mode", "nearest")
    if mode == "cubic":
        raise ctx.fail("mode='cubic' is not supported (nearest and linear are)")
    if mode not in ("nearest", "linear"):
        raise ModelError(f"{ctx.label}: unknown mode {mode!r}")
    if ctx.attr("antialias", 0):
        raise ctx.fail("antialias=1 is not supported")
    if ctx.attr("exclude_outside", 0):
        raise ctx.fail("exclude_outside=1 only applies to cubic mode, which is not supported")
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if transform not in _TRANSFORMS:
        raise ctx.fail(f"coordinate_transformation_mode={transform!r} is not supported")
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    if mode == "nearest" and nearest_mode not in _NEAREST_MODES:
        raise ctx.fail(f"nearest_mode={nearest_mode!r} is not supported")
    if mode == "linear" and not is_float(x.dtype):
        raise ctx.fail(f"linear mode needs a floating-point input, got {x.dtype}")
    return mode, transform, nearest_mode


# -- output shape and per-axis scales ----------------------------------------------------


def _axis_maps(ctx: LowerContext, x: Tensor, transform: str) -> list[_Axis]:
    """Output length, scale and crop window of every axis, from either ``scales`` or
    ``sizes`` (optionally over a subset of axes), following onnxruntime's float32
    arithmetic for the derived quantities."""
    resized = _resized_axes(ctx, x.rank)
    scales, sizes = _given(ctx, 2, "scales"), _given(ctx, 3, "sizes")
    if (scales is None) == (sizes is None):
        raise ModelError(f"{ctx.label}: exactly one of the inputs 'scales' and 'sizes' must be given")
    given = scales if scales is not None else sizes
    if given.size != len(resized):
        raise ModelError(
            f"{ctx.label}: {'scales' if scales is not None else 'sizes'} has {given.size} entries "
            f"for {len(resized)} resized axes"
        )
    f32 = np.float32
    if scales is not None:
        factor = [f32(1.0)] * x.rank
        for d, s in zip(resized, scales.astype(np.float32)):
            if not (np.isfinite(s) and s > 0):
                raise ModelError(f"{ctx.label}: scale {float(s)} for axis {d} is not positive")
            factor[d] = s
        out = [int(factor[d] * f32(n)) for d, n in enumerate(x.shape)]
    else:
        out = list(x.shape)
        for d, s in zip(resized, sizes.astype(np.int64)):
            if s < 1:
                raise ModelError(f"{ctx.label}: size {int(s)} for axis {d} is not positive")
            out[d] = int(s)
        factor = [f32(o) / f32(n) if n else f32(1.0) for o, n in zip(out, x.shape)]
        factor, out = _keep_aspect_ratio(ctx, x.shape, resized, factor, out)
    roi = _roi(ctx, x.rank, resized) if transform == "tf_crop_and_resize" else None
    return [_Axis(x.shape[d], out[d], float(factor[d]), roi[d] if roi else (0.0, 1.0)) for d in range(x.rank)]


def _resized_axes(ctx: LowerContext, rank: int) -> list[int]:
    axes = [ctx.axis(int(a), rank) for a in ctx.attr("axes", range(rank))]
    if len(set(axes)) != len(axes):
        raise ModelError(f"{ctx.label}: axes {axes} repeat an axis")
    return axes


def _given(ctx: LowerContext, k: int, what: str) -> np.ndarray | None:
    """Constant input ``k`` flattened, or None when absent or empty (opset 11 passes an
    empty ``scales`` when ``sizes`` is used)."""
    if not ctx.has_input(k) or ctx.input(k).size == 0:
        return None
    return ctx.const_input(k, what).reshape(-1)


def _keep_aspect_ratio(
    ctx: LowerContext,
    shape: Sequence[int],
    resized: Sequence[int],
    factor: list[np.float32],
    out: list[int],
) -> tuple[list[np.float32], list[int]]:
    """One common scale for every resized axis (the smallest or largest of the requested
    ones); output lengths round half away from zero."""
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    if policy not in _POLICIES:
        raise ctx.fail(f"keep_aspect_ratio_policy={policy!r} is not supported")
    if policy == "stretch":
        return factor, out
    pick = min if policy == "not_larger" else max
    common = pick(factor[d] for d in resized)
    factor = [common if d in resized else np.float32(1.0) for d in range(len(shape))]
    out = [
        math.floor(float(common * np.float32(n)) + 0.5) if d in resized else n for d, n in enumerate(shape)
    ]
    return factor, out


def _roi(ctx: LowerContext, rank: int, resized: Sequence[int]) -> list[tuple[float, float]]:
    """Crop window [start, end] (normalised coordinates) of every axis."""
    values = _given(ctx, 1, "roi")
    if values is None or values.size != 2 * len(resized):
        raise ModelError(
            f"{ctx.label}: tf_crop_and_resize needs a roi of {2 * len(resized)} values "
            f"(starts then ends of the resized axes)"
        )
    values = values.astype(np.float32)
    roi = [(0.0, 1.0)] * rank
    for k, d in enumerate(resized):
        roi[d] = (float(values[k]), float(values[len(resized) + k]))
    return roi


# -- coordinates ------------------------------------------------------------------------------


def _source_coordinate(transform: str, i: Expr, ax: _Axis) -> Expr:
    """Float32 input coordinate of output position ``i`` along one axis."""
    x = cast(i, F32)
    s = ax.scale
    if transform == "asymmetric":
        return x / s
    if transform == "tf_half_pixel_for_nn":
        return (x + 0.5) / s
    if transform == "align_corners":
        return const(0.0, F32) if ax.out_len == 1 else x * float(ax.in_len - 1) / float(ax.out_len - 1)
    if transform == "pytorch_half_pixel" and ax.out_len == 1:
        return const(0.0, F32)
    if transform == "half_pixel_symmetric":
        return _half_pixel_symmetric(i, ax)
    if transform == "tf_crop_and_resize":
        return _crop_coordinate(x, ax)
    return (x + 0.5) / s - 0.5


def _half_pixel_symmetric(i: Expr, ax: _Axis) -> Expr:
    """Half-pixel mapping re-centred so that both borders lose the same amount when the
    scale does not divide the output length exactly (onnxruntime evaluates the final
    expression in double precision)."""
    f32 = np.float32
    adjustment = f32(ax.out_len) / (f32(ax.scale) * f32(ax.in_len))
    offset = float(f32(ax.in_len) / f32(2.0) * (f32(1.0) - adjustment))
    return cast(offset + (cast(i, "float64") + 0.5) / ax.scale - 0.5, F32)


def _crop_coordinate(x: Expr, ax: _Axis) -> Expr:
    """tf_crop_and_resize: output positions spread evenly over the crop window [start, end]
    of the input (a single output position samples the window's centre)."""
    f32 = np.float32
    start, end = f32(ax.roi[0]), f32(ax.roi[1])
    span = f32(ax.in_len - 1)
    if ax.out_len == 1:
        return const(float(f32(0.5 * float(start + end) * float(span))), F32)
    return float(start * span) + x * float(end - start) * float(span) / float(ax.out_len - 1)


def _clamp_index(i: Expr, n: int) -> Expr:
    return minimum(maximum(i, 0), n - 1)


def _nearest_index(nearest_mode: str, c: Expr, n: int) -> Expr:
    """Input index nearest to coordinate ``c``.

    A coordinate that is exactly half-way in exact arithmetic (7 / 2 = 3.5) can land a few
    float32 ulps off; onnxruntime treats a fraction within ``_TIE`` of one half as a tie,
    and so do we.  ``c - floor(c)`` and its difference to one half are exact in float32.
    """
    if nearest_mode in ("floor", "ceil"):
        r = call(nearest_mode, c)
    else:
        low = call("floor", c)
        above_half = (c - low) - 0.5
        up = gt(above_half, _TIE) if nearest_mode == "round_prefer_floor" else ge(above_half, -_TIE)
        r = select(up, low + 1.0, low)
    return _clamp_index(cast(r, INDEX), n)


def _nearest_axis(transform: str, nearest_mode: str, ax: _Axis) -> Callable[[Expr], Expr]:
    """Input index along one axis as a function of the output index."""
    if ax.identity:
        return lambda i: i
    return _integer_form(
        lambda i: _nearest_index(nearest_mode, _source_coordinate(transform, i, ax), ax.in_len), ax.out_len
    )


def _integer_form(fn: Callable[[Expr], Expr], n: int) -> Callable[[Expr], Expr]:
    """``fn``, or an affine ``a*i + b`` / ``(i + o) // q + b`` index that equals it at all
    ``n`` output positions (checked by evaluating ``fn``)."""
    if n == 0:
        return fn
    t = evaluate(compute("probe", (n,), fn), {})
    i = np.arange(n)
    base = int(t[0])
    step = int(t[1] - t[0]) if n > 1 else 0
    if np.array_equal(t, base + step * i):
        return lambda v: v * step + base
    starts = np.flatnonzero(np.diff(t)) + 1
    q = int(starts[1] - starts[0]) if len(starts) > 1 else max(int(starts[0]), n - int(starts[0]))
    o = q - int(starts[0])
    if o >= 0 and np.array_equal(t, base + (i + o) // q):
        return lambda v: (v + o) // q + base
    return fn


def _linear_taps(c: Expr, n: int) -> tuple[Expr, Expr, Expr]:
    """(lower index, upper index, weight of the upper one) for coordinate ``c``, which is
    first clamped into the input as onnxruntime does."""
    inside = minimum(maximum(c, 0.0), float(n - 1))
    low = call("floor", inside)
    lo = cast(low, INDEX)
    return lo, minimum(lo + 1, n - 1), inside - low


def _blend(x: Tensor, idx: list[Expr], taps: list[tuple[int, Expr, Expr, Expr]], acc: str) -> Expr:
    """Multilinear interpolation over the axes of ``taps`` (axis, lower, upper, weight):
    nested linear blends of 2^len(taps) loads, computed in ``acc``."""
    if not taps:
        return cast(x[tuple(idx)], acc)
    (d, lo, hi, frac), rest = taps[0], taps[1:]
    at_lo, at_hi = list(idx), list(idx)
    at_lo[d], at_hi[d] = lo, hi
    w = cast(frac, acc)
    return _blend(x, at_lo, rest, acc) * (1.0 - w) + _blend(x, at_hi, rest, acc) * w


def _extrapolation_guard(
    ctx: LowerContext, x: Tensor, axes: list[_Axis]
) -> Callable[[Sequence[Expr], Expr], Expr]:
    """tf_crop_and_resize: positions whose coordinate leaves the input on any resized
    axis take ``extrapolation_value``."""
    fill = cast(const(float(ctx.attr("extrapolation_value", 0.0)), F32), x.dtype)

    def guard(i: Sequence[Expr], value: Expr) -> Expr:
        outside = []
        for ax, v in zip(axes, i):
            if not ax.identity:
                c = _crop_coordinate(cast(v, F32), ax)
                outside.append(logical_or(lt(c, 0.0), gt(c, float(ax.in_len - 1))))
        return select(functools.reduce(logical_or, outside), fill, value) if outside else value

    return guard
