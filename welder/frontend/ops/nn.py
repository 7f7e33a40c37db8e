"""Sliding-window operators: Conv, ConvTranspose and the pools.

They share one piece of geometry, :class:`Window`: along each spatial axis, output
position ``o`` and kernel tap ``k`` read input position ``o*stride + k*dilation - pad``.
Conv and the pools gather through that map directly; ConvTranspose is the adjoint of a
Conv, so it inverts the same map and gathers from ``(y + pad - k*dilation) / stride``
where that quotient is exact.

Every reduction body stays a plain sum of products (or a max) of guarded loads.  Bias
additions and the divisions of the average pools are separate injective computes,
which the scheduler inlines into the reduction's epilogue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from welder.errors import ModelError
from welder.frontend.ops.norm import reduce_over, stats_dtype
from welder.frontend.ops.shape import reshape_index, reshaped
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.compute import Reduce, reduce, reduce_axis, reduce_identity
from welder.ir.expr import Expr, ExprLike, cast, eq, ge, is_float, logical_and, lt, maximum, minimum, select

AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")
#: Dtypes whose convolutions are lowered as flat products (:func:`_pointwise_conv`,
#: :func:`_conv_as_product`), the form the tensor-core kinds compute.
POINTWISE_AS_PRODUCT = frozenset({"float16", "bfloat16"})
#: Narrowest group lowered as a product: output channels per group (M) and input channels
#: per group times kernel taps (K) of at least one m16n8k16 instruction's M and K.  Narrower
#: groups (depthwise, ShuffleNet's) would be mostly padding on tensor cores.
PRODUCT_MIN_GROUP = 16
#: Shortest reduction (input channels per group times kernel taps) over which an fp32
#: convolution is lowered as a flat product, for the ``ffma`` kind (:func:`_deep_fp32`).
FP32_PRODUCT_MIN_DEPTH = 256


@dataclass(frozen=True)
class Window:
    """One spatial axis of a sliding window.

    ``size`` is the extent of the axis that is read and ``out`` the number of window
    positions.  For ConvTranspose the roles swap: its output is the axis "read" by the
    equivalent Conv and its input holds the window positions.
    """

    size: int
    kernel: int
    stride: int
    dilation: int
    pad_begin: int
    pad_end: int
    out: int

    @property
    def span(self) -> int:
        """Extent of the dilated kernel."""
        return (self.kernel - 1) * self.dilation + 1

    @property
    def first(self) -> int:
        """Lowest position any tap reads."""
        return -self.pad_begin

    @property
    def last(self) -> int:
        """Highest position any tap reads (beyond the padding when ceil_mode overhangs)."""
        return (self.out - 1) * self.stride + self.span - 1 - self.pad_begin

    def position(self, o: Expr, k: Expr) -> Expr:
        return o * self.stride + k * self.dilation - self.pad_begin

    def inside(self, pos: Expr) -> Expr:
        """Guard ``0 <= pos < size``, true constant when no tap can leave the axis."""
        return _within(pos, self.first, self.last, 0, self.size)

    def source(self, y: Expr, k: Expr) -> tuple[Expr, Expr]:
        """Window position ``q`` with ``position(q, k) == y``, and the guard that such an
        integral ``q`` exists in ``[0, out)`` (the gather form of a transposed conv)."""
        t = y + self.pad_begin - k * self.dilation
        t_lo, t_hi = self.pad_begin - (self.span - 1), self.size - 1 + self.pad_begin
        if self.stride == 1:
            return t, _within(t, t_lo, t_hi, 0, self.out)
        q = t // self.stride
        in_range = _within(q, t_lo // self.stride, t_hi // self.stride, 0, self.out)
        return q, logical_and(eq(t % self.stride, 0), in_range)

    def taps(self, o: Expr, lo: int, hi: int) -> Expr | int:
        """How many taps of the window at ``o`` read a position in ``[lo, hi)``; a
        constant when that holds for every tap of every window."""
        if self.first >= lo and self.last < hi:
            return self.kernel
        # Taps k with lo <= o*stride + k*dilation - pad_begin < hi, clamped to [0, kernel).
        d, shift = self.dilation, o * self.stride
        first: Expr | int = 0
        last: Expr | int = self.kernel - 1
        if self.first < lo:
            first = maximum((lo + self.pad_begin + d - 1 - shift) // d, 0)
        if self.last >= hi:
            last = minimum((hi - 1 + self.pad_begin - shift) // d, self.kernel - 1)
        return last - first + 1  # type: ignore[operator]


def _within(x: Expr, lowest: int, highest: int, lo: int, hi: int) -> Expr:
    """``lo <= x < hi`` for ``x`` known to lie in ``[lowest, highest]``; comparisons
    the known range already settles are left out."""
    conds = []
    if lowest < lo:
        conds.append(ge(x, lo))
    if highest >= hi:
        conds.append(lt(x, hi))
    return logical_and(*conds)


# -- attributes ---------------------------------------------------------------------------


def _ints(ctx: LowerContext, name: str, length: int, default: int) -> tuple[int, ...]:
    value = ctx.attr(name, None)
    if value is None:
        return (default,) * length
    if len(value) != length:
        raise ModelError(f"{ctx.label}: {name} has {len(value)} entries, expected {length}")
    return tuple(int(v) for v in value)


def _positive(ctx: LowerContext, name: str, rank: int) -> tuple[int, ...]:
    values = _ints(ctx, name, rank, 1)
    if any(v < 1 for v in values):
        raise ModelError(f"{ctx.label}: {name} must be positive, got {list(values)}")
    return values


def _auto_pad(ctx: LowerContext) -> str:
    mode = ctx.attr("auto_pad", "NOTSET")
    if mode not in AUTO_PADS:
        raise ctx.fail(f"auto_pad={mode!r} is not one of {', '.join(AUTO_PADS)}")
    return mode


def _explicit_pads(ctx: LowerContext, rank: int) -> list[tuple[int, int]]:
    pads = _ints(ctx, "pads", 2 * rank, 0)
    if any(p < 0 for p in pads):
        raise ctx.fail(f"negative pads {list(pads)} are not supported")
    return list(zip(pads[:rank], pads[rank:]))


def _split_pad(total: int, extra_at_end: bool) -> tuple[int, int]:
    """(begin, end) halves of ``total`` padding; an odd one goes to the end or begin."""
    small = total // 2
    return (small, total - small) if extra_at_end else (total - small, small)


def _kernel_shape(ctx: LowerContext, rank: int, weights: Sequence[int] | None = None) -> tuple[int, ...]:
    """The kernel's spatial shape: the attribute, or else the weights' (Conv only)."""
    if ctx.attr("kernel_shape", None) is None:
        if weights is None:
            raise ModelError(f"{ctx.label}: missing required attribute 'kernel_shape'")
        return tuple(weights)
    kernel = _positive(ctx, "kernel_shape", rank)
    if weights is not None and kernel != tuple(weights):
        raise ModelError(
            f"{ctx.label}: kernel_shape {list(kernel)} disagrees with the weights {list(weights)}"
        )
    return kernel


def _output_size(ctx: LowerContext, axis: int, w: Window, ceil_mode: bool) -> int:
    """Number of window positions along an axis; ``w.out`` is not read."""
    padded = w.size + w.pad_begin + w.pad_end
    if padded < w.span:
        raise ModelError(
            f"{ctx.label}: the window spans {w.span} positions along spatial axis {axis}, "
            f"more than the padded input ({padded})"
        )
    room = padded - w.span
    out = (-(-room // w.stride) if ceil_mode else room // w.stride) + 1
    # With ceil_mode the last window must still start inside the input or its left padding.
    if ceil_mode and (out - 1) * w.stride >= w.size + w.pad_begin:
        out -= 1
    return out


def sliding_windows(
    ctx: LowerContext, sizes: Sequence[int], kernel: Sequence[int], ceil_mode: bool = False
) -> list[Window]:
    """Geometry of Conv and the pools along each spatial axis, from strides,
    dilations, pads / auto_pad and ceil_mode."""
    rank = len(sizes)
    strides = _positive(ctx, "strides", rank)
    dilations = _positive(ctx, "dilations", rank)
    mode = _auto_pad(ctx)
    if mode == "NOTSET":
        pads = _explicit_pads(ctx, rank)
    elif mode == "VALID":
        pads = [(0, 0)] * rank
    else:
        # SAME: as many windows as strides fit in the input, the padding split evenly.
        pads = [
            _split_pad(max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size), mode == "SAME_UPPER")
            for size, k, s, d in zip(sizes, kernel, strides, dilations)
        ]
    windows = []
    for axis, (size, k, s, d, (begin, end)) in enumerate(zip(sizes, kernel, strides, dilations, pads)):
        w = Window(size, k, s, d, begin, end, out=0)
        windows.append(replace(w, out=_output_size(ctx, axis, w, ceil_mode)))
    return windows


def _transposed_windows(ctx: LowerContext, sizes: Sequence[int], kernel: Sequence[int]) -> list[Window]:
    """ConvTranspose geometry: the window positions are the input, the axis read is
    the output, sized by output_shape, auto_pad or the pads and output_padding."""
    rank = len(sizes)
    strides = _positive(ctx, "strides", rank)
    dilations = _positive(ctx, "dilations", rank)
    extra = _ints(ctx, "output_padding", rank, 0)
    if any(e < 0 for e in extra):
        raise ModelError(f"{ctx.label}: output_padding must not be negative, got {list(extra)}")
    mode = _auto_pad(ctx)
    requested = _requested_output_shape(ctx, rank)
    pads = _explicit_pads(ctx, rank) if mode == "NOTSET" else [(0, 0)] * rank
    windows = []
    for axis, (size, k, s, d, e) in enumerate(zip(sizes, kernel, strides, dilations, extra)):
        natural = s * (size - 1) + e + (k - 1) * d + 1
        if requested is None and mode not in ("SAME_UPPER", "SAME_LOWER"):
            begin, end = pads[axis]
        else:
            # Padding trims the natural extent to the requested one (input * stride for
            # SAME); it never grows the output.
            target = size * s if requested is None else requested[axis]
            begin, end = _split_pad(max(0, natural - target), extra_at_end=mode == "SAME_UPPER")
        # An explicit output_shape beyond the natural extent gets zeros at the end.
        out = natural - begin - end if requested is None else requested[axis]
        if out < 1:
            raise ModelError(f"{ctx.label}: output extent {out} along spatial axis {axis} is not positive")
        windows.append(Window(out, k, s, d, begin, end, size))
    return windows


def _requested_output_shape(ctx: LowerContext, rank: int) -> list[int] | None:
    shape = ctx.attr("output_shape", None)
    if shape is None:
        return None
    if len(shape) != rank:
        raise ModelError(f"{ctx.label}: output_shape {list(shape)} does not have {rank} spatial dimensions")
    return [int(v) for v in shape]


# -- inputs -------------------------------------------------------------------------------


def _batched_input(ctx: LowerContext, floats_only: bool = True) -> Tensor:
    """Input 0, shaped (N, C, spatial...)."""
    x = ctx.input(0)
    if x.rank < 3:
        raise ModelError(f"{ctx.label}: input must be (N, C, spatial...), got shape {list(x.shape)}")
    if floats_only and not is_float(x.dtype):
        raise ctx.fail(f"element type {x.dtype} is not supported")
    return x


def _weights(ctx: LowerContext, x: Tensor) -> Tensor:
    w = ctx.input(1)
    if w.rank != x.rank or w.dtype != x.dtype:
        raise ModelError(
            f"{ctx.label}: weights {w.dtype}{list(w.shape)} do not match the input {x.dtype}{list(x.shape)}"
        )
    return w


def _group(ctx: LowerContext, channels: int) -> int:
    group = ctx.attr("group", 1)
    if group < 1 or channels % group:
        raise ModelError(f"{ctx.label}: group={group} does not divide the {channels} input channels")
    return group


def _with_bias(ctx: LowerContext, y: Tensor) -> Tensor:
    """``y + B[c]`` as an injective epilogue, when the node has a bias input."""
    b = ctx.optional_input(2)
    if b is None:
        return y
    if b.shape != (y.shape[1],) or b.dtype != y.dtype:
        raise ModelError(f"{ctx.label}: bias {b.dtype}{list(b.shape)} does not match {y.shape[1]} channels")
    return ctx.compute(y.shape, lambda n, c, *o: y[(n, c, *o)] + b[c])


def _window_load(
    x: Tensor,
    lead: tuple[ExprLike, ...],
    windows: Sequence[Window],
    o: Sequence[Expr],
    ks: Sequence[Expr],
    fill: float,
) -> Expr:
    """``x[*lead, window positions]``, or ``fill`` where a tap reads padding."""
    pos = [w.position(oi, k) for w, oi, k in zip(windows, o, ks)]
    guard = logical_and(*(w.inside(p) for w, p in zip(windows, pos)))
    return select(guard, x[(*lead, *pos)], fill)


# -- convolutions --------------------------------------------------------------------------


@register("Conv")
def conv(ctx: LowerContext) -> Tensor:
    """``O[n,c,o] = sum_{ci,k} select(inside, X[n, g*Cin_g + ci, o*s + k*d - p], 0) * W[c, ci, k]``."""
    x = _batched_input(ctx)
    w = _weights(ctx, x)
    m, per_group = w.shape[:2]
    group = _group(ctx, x.shape[1])
    if per_group * group != x.shape[1] or m % group:
        raise ModelError(
            f"{ctx.label}: weights {list(w.shape)} do not fit {x.shape[1]} input channels in {group} group(s)"
        )
    windows = sliding_windows(ctx, x.shape[2:], _kernel_shape(ctx, x.rank - 2, w.shape[2:]))
    m_per_group = m // group
    depth = per_group * math.prod(win.kernel for win in windows)  # products an output sums
    if (
        x.dtype in POINTWISE_AS_PRODUCT
        or _patchify(windows, group, m_per_group)
        or _deep_fp32(x.dtype, depth, group, m_per_group)
    ):
        pointwise = group == 1 and all(map(_pointwise, windows))
        if pointwise and len(windows) > 1:
            return _with_bias(ctx, _pointwise_conv(ctx, x, w))
        wide = m_per_group >= PRODUCT_MIN_GROUP and depth >= PRODUCT_MIN_GROUP
        # A 1-D pointwise conv is a product in its image form already.
        if wide and not pointwise:
            return _with_bias(ctx, _conv_as_product(ctx, x, w, windows, group))

    def fn(n: Expr, c: Expr, *o: Expr) -> Reduce:
        ci = reduce_axis(per_group)
        ks = [reduce_axis(win.kernel) for win in windows]
        channel = ci if group == 1 else (c // m_per_group) * per_group + ci
        return reduce("sum", _window_load(x, (n, channel), windows, o, ks, 0.0) * w[(c, ci, *ks)], [ci, *ks])

    y = ctx.compute((x.shape[0], m, *(win.out for win in windows)), fn, "conv")
    return _with_bias(ctx, y)


def _patchify(windows: Sequence[Window], group: int, m_per_group: int) -> bool:
    """Whether a convolution cuts its image into disjoint patches (ViT's and Swin's patch
    embeddings: a kernel as wide as its stride, no dilation, no padding) wide enough for a
    product kind.  Such a convolution is a product in any dtype: each input element feeds
    one output position, so the image form's tiles share no halo with their neighbours and
    the flat product loses the CUDA-core kind nothing, while it lets the product kinds
    (``ffma`` for exact fp32, TF32) take it.  Overlapping windows keep the image form
    outside :data:`POINTWISE_AS_PRODUCT`: there a tile of partial rows reuses its halo."""
    disjoint = all(
        w.kernel == w.stride > 1 and w.dilation == 1 and w.pad_begin == w.pad_end == 0 for w in windows
    )
    return disjoint and group == 1 and m_per_group >= PRODUCT_MIN_GROUP


def _deep_fp32(dtype: str, depth: int, group: int, m_per_group: int) -> bool:
    """Whether an fp32 convolution reduces over enough products per output to be bound by
    its arithmetic, where the ``ffma`` kind's register tiles beat the CUDA-core kind's
    window kernels.  A shallow one is bound by its traffic, and there the image form keeps
    what fusion saves (a 1x1 convolution tiled with its depthwise consumer)."""
    wide = group == 1 and m_per_group >= PRODUCT_MIN_GROUP
    return dtype == "float32" and wide and depth >= FP32_PRODUCT_MIN_DEPTH


def _pointwise(win: Window) -> bool:
    """Whether the window reads exactly the output's own position (1-wide, stride 1, no
    padding; a 1-wide kernel's dilation moves nothing)."""
    return win.kernel == 1 and win.stride == 1 and win.pad_begin == 0 and win.pad_end == 0


def _pointwise_conv(ctx: LowerContext, x: Tensor, w: Tensor) -> Tensor:
    """A 1x1 convolution as the batched product it is, ``O[n, c, p] = sum_ci W[c, ci] *
    X[n, ci, p]`` over the spatial positions ``p`` flattened, reshaped back to the image.

    The flat form is what the tensor-core kind recognizes (the output's last axis N, the
    one before it M = c, one reduce axis K = ci); the reshape in front of the consumers is
    injective, and the tensor-core kind tiles through it in whole rows of the image.  Only
    the 16-bit floats take this form (:data:`POINTWISE_AS_PRODUCT`), where that kind is on
    by default.  The CUDA-core kind tiles the image form better: a tile of a few partial
    rows, which a fused 3x3 or depthwise consumer wants, covers a long run of the flat
    axis.  Lowered flat, fp32 MobileNetV2's cost-model plans were estimated faster (H100
    189.8 -> 165.4 us, V100 312.3 -> 284.3 us) but grew from 27 to 34 kernels and from 38.8
    to 47.2 MB of compulsory traffic, so exact fp32 keeps the image form.  The cost is that
    ``--tf32`` cannot put shallow fp32 1x1 convolutions on tensor cores: the lowering does
    not know the options a graph is tuned with.  fp32 patch embeddings and deep reductions
    are the exceptions (:func:`_patchify`, :func:`_deep_fp32`)."""
    spatial = x.shape[2:]
    flat = math.prod(spatial)
    zeros = (0,) * len(spatial)

    def fn(n: Expr, c: Expr, p: Expr) -> Reduce:
        ci = reduce_axis(x.shape[1])
        return reduce("sum", x[(n, ci, *reshape_index((p,), (flat,), spatial))] * w[(c, ci, *zeros)], [ci])

    y = ctx.compute((x.shape[0], w.shape[0], flat), fn, "conv")
    return reshaped(ctx, y, (x.shape[0], w.shape[0], *spatial))


def _conv_as_product(
    ctx: LowerContext, x: Tensor, w: Tensor, windows: Sequence[Window], group: int
) -> Tensor:
    """Any convolution as a flat product (an implicit GEMM), reshaped back to the image:
    ``O[n, (g,) c, p] = sum_k W[g*Mg + c, k] * X~[n, g, k, p]`` with ``p`` the output
    positions flattened and one reduce axis ``k`` over the group's input channels and kernel
    taps flattened (the weights' own row-major order, so ``W`` stays affine: row ``c`` is
    ``K`` contiguous elements).  ``X~`` is the image operand the product gathers: ``k`` and
    ``p`` are decomposed with ``//`` and ``%`` into ``(ci, taps)`` and the output position,
    and a tap that reads padding is the same ``select(inside, X[...], 0)`` as the image form.

    The tensor-core kinds compute it with ``W`` copied as an affine operand and ``X~`` as a
    gathered one, element by element (docs/tensor_cores.md, "Convolutions as implicit
    GEMM").  A 1x1 unpadded stride-1 conv is the special case whose gather is affine
    (:func:`_pointwise_conv`).  Several groups get an axis of their own in front of the
    channels: every group is one matrix of a batched product."""
    n, per_group = x.shape[0], w.shape[1]
    m_per_group = w.shape[0] // group
    outs = tuple(win.out for win in windows)
    kernel = tuple(win.kernel for win in windows)
    flat, depth = math.prod(outs), per_group * math.prod(kernel)
    padded = _padded_weights(ctx, w, depth)

    def fn(*axes: Expr) -> Reduce:
        b, c, p = axes[0], axes[-2], axes[-1]
        g = axes[1] if group > 1 else 0
        k = reduce_axis(depth)
        ci, *ks = reshape_index((k,), (depth,), (per_group, *kernel))
        o = reshape_index((p,), (flat,), outs)
        row = g * m_per_group + c if group > 1 else c
        channel = g * per_group + ci if group > 1 else ci
        image = _window_load(x, (b, channel), windows, o, ks, 0.0)
        weight = w[(row, ci, *ks)] if padded is None else padded[(row, k)]
        return reduce("sum", weight * image, [k])

    lead = (n, group) if group > 1 else (n,)
    y = ctx.compute((*lead, m_per_group, flat), fn, "conv")
    return reshaped(ctx, y, (n, w.shape[0], *outs))


def _padded_weights(ctx: LowerContext, w: Tensor, depth: int) -> Tensor | None:
    """Constant weights as ``[out channels, depth]`` rows padded with zeros to a multiple of
    8 elements, where ``depth`` is not one (ResNet's 7x7 stem over 3 channels: 147): the
    tensor-core kinds copy weight rows 16 bytes at a time, which needs every row to start
    16-byte aligned.  The product still sums ``depth`` elements.  None where no padding is
    needed or the weights are not constant (that conv then stays off tensor cores)."""
    value = ctx.const_value(1)
    if depth % 8 == 0 or value is None:
        return None
    rows = w.shape[0]
    padded = np.zeros((rows, -(-depth // 8) * 8), value.dtype)
    padded[:, :depth] = value.reshape(rows, depth)
    return ctx.constant(padded, "weights")


@register("ConvTranspose")
def conv_transpose(ctx: LowerContext) -> Tensor:
    """Gather form: ``Y[n,c,y] = sum_{ci,k} select(exact, X[n, g*Cin_g + ci, (y + p - k*d) / s], 0)
    * W[g*Cin_g + ci, c mod Cout_g, k]``."""
    x = _batched_input(ctx)
    w = _weights(ctx, x)
    channels, m_per_group = w.shape[:2]
    if channels != x.shape[1]:
        raise ModelError(f"{ctx.label}: weights expect {channels} input channels, the input has {x.shape[1]}")
    group = _group(ctx, channels)
    per_group = channels // group
    windows = _transposed_windows(ctx, x.shape[2:], _kernel_shape(ctx, x.rank - 2, w.shape[2:]))

    def fn(n: Expr, c: Expr, *y: Expr) -> Reduce:
        ci = reduce_axis(per_group)
        ks = [reduce_axis(win.kernel) for win in windows]
        sources = [win.source(yi, k) for win, yi, k in zip(windows, y, ks)]
        guard = logical_and(*(cond for _, cond in sources))
        channel = ci if group == 1 else (c // m_per_group) * per_group + ci
        xv = select(guard, x[(n, channel, *(q for q, _ in sources))], 0.0)
        wv = w[(channel, c if group == 1 else c % m_per_group, *ks)]
        return reduce("sum", xv * wv, [ci, *ks])

    y = ctx.compute((x.shape[0], m_per_group * group, *(win.size for win in windows)), fn, "conv")
    return _with_bias(ctx, y)


# -- pooling ------------------------------------------------------------------------------


def _pool_windows(ctx: LowerContext, x: Tensor) -> list[Window]:
    ceil_mode = ctx.attr("ceil_mode", 0)
    if ceil_mode not in (0, 1):
        raise ctx.fail(f"ceil_mode={ceil_mode} is not 0 or 1")
    return sliding_windows(ctx, x.shape[2:], _kernel_shape(ctx, x.rank - 2), bool(ceil_mode))


def _pool(ctx: LowerContext, x: Tensor, windows: Sequence[Window], op: str, hint: str = "") -> Tensor:
    """``op`` over each window; padded taps contribute the reduction's identity."""
    fill = reduce_identity(op, x.dtype)

    def fn(n: Expr, c: Expr, *o: Expr) -> Reduce:
        ks = [reduce_axis(win.kernel) for win in windows]
        return reduce(op, _window_load(x, (n, c), windows, o, ks, fill), ks)

    return ctx.compute((*x.shape[:2], *(win.out for win in windows)), fn, hint)


@register("MaxPool")
def max_pool(ctx: LowerContext) -> Tensor:
    if ctx.output_used(1):
        raise ctx.fail("the Indices output is not supported")
    x = _batched_input(ctx, floats_only=False)
    # storage_order only describes the Indices output, which is refused above.
    return _pool(ctx, x, _pool_windows(ctx, x), "max")


@register("AveragePool")
def average_pool(ctx: LowerContext) -> Tensor:
    """Window sum, then a division by the number of taps counted: all of them inside
    the padded input (count_include_pad=1) or only those inside the input."""
    x = _batched_input(ctx)
    if ctx.opset < 19 and ctx.attr("dilations", None) is not None:
        raise ctx.fail(f"dilations are only defined from opset 19 (the model uses opset {ctx.opset})")
    include_pad = ctx.attr("count_include_pad", 0)
    if include_pad not in (0, 1):
        raise ctx.fail(f"count_include_pad={include_pad} is not 0 or 1")
    windows = _pool_windows(ctx, x)
    total = _pool(ctx, x, windows, "sum", "sum")

    def divisor(o: Sequence[Expr]) -> Expr | int:
        count: Expr | int = 1
        for win, oi in zip(windows, o):
            lo, hi = (-win.pad_begin, win.size + win.pad_end) if include_pad else (0, win.size)
            count = count * win.taps(oi, lo, hi)  # type: ignore[operator]
        return count

    def fn(n: Expr, c: Expr, *o: Expr) -> Expr:
        count = divisor(o)
        return total[(n, c, *o)] / (float(count) if isinstance(count, int) else cast(count, x.dtype))

    return ctx.compute(total.shape, fn)


@register("GlobalAveragePool", "GlobalMaxPool")
def global_pool(ctx: LowerContext) -> Tensor:
    """One reduction over every spatial axis, kept as size-1 axes (plus the division).  A
    half tensor is summed in fp32: 256 x 256 halves of 2 already pass fp16's 65504."""
    x = _batched_input(ctx, floats_only=ctx.op_type == "GlobalAveragePool")
    spatial = list(range(2, x.rank))
    if ctx.op_type == "GlobalMaxPool":
        return reduce_over(ctx, x, spatial, "max", "max", keepdims=True)
    work = stats_dtype(x.dtype)
    total = reduce_over(ctx, x, spatial, "sum", "sum", lambda v: cast(v, work), keepdims=True)
    count = float(math.prod(x.shape[2:]))
    return ctx.compute(total.shape, lambda *i: cast(total[i] / count, x.dtype))
