"""Data movement: reshapes, transposes, slicing, concatenation, padding, gathers.

All of these are injective computes.  Reshapes map indices through the smallest groups of
dimensions whose sizes multiply to the same number, so ``[B, S, 768] -> [B, S, 12, 64]``
reads ``x[b, s, h * 64 + d]`` rather than a chain of divisions of a flat offset.  Index
expressions stay affine (plus floordiv/mod by constants) wherever the operator allows it,
because tile propagation bounds them exactly; only gathers with data-dependent indices
load an index from a tensor, as a ``DataIndex`` that knows its extent and its node (see
docs/ir.md, "Data-dependent indices").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from welder.errors import ModelError
from welder.frontend.ops.elementwise import broadcast_shape
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.expr import DataIndex, Expr, as_expr, cast, eq, ge, logical_and, lt, select

# -- shared helpers ------------------------------------------------------------------------


def attr_or_input(ctx: LowerContext, name: str, k: int, since: int) -> list[int] | None:
    """An integer list that is attribute ``name`` before opset ``since`` and the constant
    input ``k`` from it on (Squeeze/Unsqueeze axes, Split sizes); None when absent."""
    if ctx.opset >= since:
        return const_ints(ctx, k, name) if ctx.has_input(k) else None
    value = ctx.attr(name, None)
    return None if value is None else [int(v) for v in value]


def const_ints(ctx: LowerContext, k: int, what: str) -> list[int]:
    """Constant input ``k`` as a list of Python ints (shapes, pads, repeats)."""
    return [int(v) for v in ctx.const_input(k, what).reshape(-1)]


def normalise_axes(ctx: LowerContext, axes: Sequence[int], rank: int) -> list[int]:
    """Axes made non-negative; repeats are an error because every op here gives each axis
    at most one role."""
    out = [ctx.axis(a, rank) for a in axes]
    if len(set(out)) != len(out):
        raise ModelError(f"{ctx.label}: axes {list(axes)} repeat an axis")
    return out


def strided(
    ctx: LowerContext,
    x: Tensor,
    starts: Sequence[int],
    steps: Sequence[int],
    shape: Sequence[int],
    hint: str = "",
) -> Tensor:
    """``out[i] = x[starts + i * steps]`` per dimension (Slice, Split).  The caller keeps
    every index inside ``x``, so no guard is needed; the whole of ``x`` is ``x`` itself."""
    if tuple(shape) == x.shape and not any(starts) and all(s == 1 for s in steps):
        return x
    return ctx.compute(shape, lambda *i: x[tuple(k * st + s for k, s, st in zip(i, starts, steps))], hint)


# -- reshapes ------------------------------------------------------------------------------


def dim_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up consecutive runs of dims of ``a`` and ``b`` with equal products.

    Size-1 dims form groups of their own where possible, so squeezes and unsqueezes map
    to plain index copies.
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and not (j < len(b) and b[j] == 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and not (i < len(a) and a[i] == 1):
            groups.append(([], [j]))
            j += 1
            continue
        ga, gb = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(i)
                pa *= a[i]
                i += 1
            else:
                gb.append(j)
                pb *= b[j]
                j += 1
        groups.append((ga, gb))
    return groups


def reshape_index(
    out_idx: Sequence[Expr], out_shape: Sequence[int], in_shape: Sequence[int]
) -> tuple[Expr, ...]:
    """Input index that a row-major reshape from ``in_shape`` to ``out_shape`` reads."""
    if int(np.prod(out_shape)) != int(np.prod(in_shape)):
        raise ValueError(f"cannot reshape {list(in_shape)} to {list(out_shape)}")
    result: list[Expr] = [None] * len(in_shape)  # type: ignore[list-item]
    if int(np.prod(out_shape)) == 0:
        return tuple(as_expr(0) for _ in in_shape)
    for g_in, g_out in dim_groups(in_shape, out_shape):
        linear: Expr | int = 0
        for d in g_out:
            linear = linear * out_shape[d] + out_idx[d]
        stride = 1
        for d in reversed(g_in):
            part = linear // stride if stride > 1 else linear
            result[d] = part % in_shape[d] if d != g_in[0] else part
            stride *= in_shape[d]
    return tuple(as_expr(r) for r in result)


def reshaped(ctx: LowerContext, x: Tensor, shape: Sequence[int], hint: str = "") -> Tensor:
    """``x`` viewed with another shape of the same size (the tensor itself if unchanged)."""
    shape = tuple(int(s) for s in shape)
    if shape == x.shape:
        return x
    return ctx.compute(shape, lambda *i: x[reshape_index(i, shape, x.shape)], hint)


def _reshape_target(ctx: LowerContext, x: Tensor, spec: Sequence[int], allowzero: int) -> list[int]:
    """Resolve Reshape's 0 (copy the input dim unless ``allowzero``) and -1 (infer)."""
    out = []
    for k, s in enumerate(spec):
        if s < -1:
            raise ModelError(f"{ctx.label}: shape {list(spec)} has the invalid entry {s}")
        if s == 0 and not allowzero:
            if k >= x.rank:
                raise ModelError(f"{ctx.label}: shape entry {k} copies a dimension the input lacks")
            out.append(x.shape[k])
        else:
            out.append(s)
    if out.count(-1) > 1:
        raise ModelError(f"{ctx.label}: shape {list(spec)} has more than one -1")
    if -1 in out:
        known = math.prod(s for s in out if s != -1)
        if known == 0 or x.size % known:
            raise ModelError(f"{ctx.label}: cannot reshape {list(x.shape)} to {list(spec)}")
        out[out.index(-1)] = x.size // known
    if math.prod(out) != x.size:
        raise ModelError(f"{ctx.label}: cannot reshape {list(x.shape)} ({x.size} elements) to {out}")
    return out


@register("Reshape")
def reshape(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    out = _reshape_target(ctx, x, const_ints(ctx, 1, "shape"), ctx.attr("allowzero", 0))
    return reshaped(ctx, x, out)


@register("Flatten")
def flatten(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    axis = ctx.attr("axis", 1)
    # Unlike most axes, axis == rank is valid here (everything goes into the first dim).
    if not -x.rank <= axis <= x.rank:
        raise ModelError(f"{ctx.label}: axis {axis} out of range for rank {x.rank}")
    axis = axis + x.rank if axis < 0 else axis
    return reshaped(ctx, x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@register("Squeeze")
def squeeze(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    axes = attr_or_input(ctx, "axes", 1, since=13)
    if axes == [] and 1 in x.shape:
        # onnxruntime squeezes every size-1 dim here while ONNX shape inference squeezes none.
        raise ctx.fail("an empty axes input is ambiguous; omit it to squeeze every size-1 dimension")
    if axes is None:
        drop = [d for d, s in enumerate(x.shape) if s == 1]
    else:
        drop = normalise_axes(ctx, axes, x.rank)
        wrong = [d for d in drop if x.shape[d] != 1]
        if wrong:
            raise ModelError(f"{ctx.label}: cannot squeeze axes {wrong} of shape {list(x.shape)}")
    return reshaped(ctx, x, [s for d, s in enumerate(x.shape) if d not in drop])


@register("Unsqueeze")
def unsqueeze(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    axes = attr_or_input(ctx, "axes", 1, since=13)
    if axes is None:
        raise ModelError(f"{ctx.label}: missing axes")
    rank = x.rank + len(axes)
    new = set(normalise_axes(ctx, axes, rank))
    dims = iter(x.shape)
    return reshaped(ctx, x, [1 if d in new else next(dims) for d in range(rank)])


@register("Transpose")
def transpose(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    perm = [ctx.axis(p, x.rank) for p in ctx.attr("perm", list(reversed(range(x.rank))))]
    if sorted(perm) != list(range(x.rank)):
        raise ModelError(f"{ctx.label}: perm {perm} is not a permutation of {x.rank} axes")
    inverse = [perm.index(d) for d in range(x.rank)]
    return ctx.compute([x.shape[p] for p in perm], lambda *i: x[tuple(i[inverse[d]] for d in range(x.rank))])


def _nchw(ctx: LowerContext, x: Tensor, blocksize: int) -> tuple[int, int, int, int]:
    if x.rank != 4:
        raise ModelError(f"{ctx.label}: expects a 4-D NCHW input, got shape {list(x.shape)}")
    if blocksize < 1:
        raise ModelError(f"{ctx.label}: blocksize must be positive, got {blocksize}")
    return x.shape  # type: ignore[return-value]


@register("DepthToSpace")
def depth_to_space(ctx: LowerContext) -> Tensor:
    """``[N, C, H, W] -> [N, C/b², H*b, W*b]``; DCR takes the block offset from the
    outer channel bits, CRD from the inner ones."""
    x, b = ctx.input(0), ctx.attr("blocksize")
    n, c, h, w = _nchw(ctx, x, b)
    mode = ctx.attr("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise ctx.fail(f"mode {mode!r} is not supported (DCR or CRD)")
    if c % (b * b):
        raise ModelError(f"{ctx.label}: {c} channels are not divisible by blocksize² = {b * b}")
    oc = c // (b * b)

    def fn(i: Expr, ch: Expr, y: Expr, z: Expr) -> Expr:
        by, bx = y % b, z % b
        src = (by * b + bx) * oc + ch if mode == "DCR" else (ch * b + by) * b + bx
        return x[i, src, y // b, z // b]

    return ctx.compute((n, oc, h * b, w * b), fn)


@register("SpaceToDepth")
def space_to_depth(ctx: LowerContext) -> Tensor:
    """``[N, C, H, W] -> [N, C*b², H/b, W/b]``; the block offset is the outer channel part."""
    x, b = ctx.input(0), ctx.attr("blocksize")
    n, c, h, w = _nchw(ctx, x, b)
    if ctx.attr("mode", "DCR") != "DCR":
        raise ctx.fail(f"mode {ctx.attr('mode')!r} is not supported (only DCR)")
    if h % b or w % b:
        raise ModelError(f"{ctx.label}: spatial size {[h, w]} is not divisible by blocksize {b}")

    def fn(i: Expr, ch: Expr, y: Expr, z: Expr) -> Expr:
        block = ch // c
        return x[i, ch % c, y * b + block // b, z * b + block % b]

    return ctx.compute((n, c * b * b, h // b, w // b), fn)


# -- slicing and joining -------------------------------------------------------------------


def _slice_range(dim: int, start: int, end: int, step: int) -> tuple[int, int]:
    """(first index, length) of one sliced axis, clamping as the ONNX spec does."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return start, max(0, -((start - end) // step))


@register("Slice")
def slice_op(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    starts, ends = const_ints(ctx, 1, "starts"), const_ints(ctx, 2, "ends")
    axes = const_ints(ctx, 3, "axes") if ctx.has_input(3) else list(range(len(starts)))
    steps = const_ints(ctx, 4, "steps") if ctx.has_input(4) else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ModelError(f"{ctx.label}: starts, ends, axes and steps differ in length")
    if 0 in steps:
        raise ModelError(f"{ctx.label}: steps must be non-zero")
    first, step, shape = [0] * x.rank, [1] * x.rank, list(x.shape)
    for d, s, e, st in zip(normalise_axes(ctx, axes, x.rank), starts, ends, steps):
        first[d], shape[d] = _slice_range(x.shape[d], s, e, st)
        step[d] = st
    return strided(ctx, x, first, step, shape)


def _split_sizes(ctx: LowerContext, dim: int) -> list[int]:
    split = attr_or_input(ctx, "split", 1, since=13)
    count = ctx.attr("num_outputs", None) if ctx.opset >= 18 else None
    n = ctx.num_outputs
    if split is not None:
        if count is not None:
            raise ModelError(f"{ctx.label}: give either the split input or num_outputs, not both")
        if len(split) != n or sum(split) != dim or min(split) < 0:
            raise ModelError(f"{ctx.label}: split {split} does not divide {dim} into {n} outputs")
        return split
    if count is None:
        if dim % n:
            raise ModelError(f"{ctx.label}: dimension {dim} is not evenly splittable into {n} outputs")
        return [dim // n] * n
    if count != n:
        raise ModelError(f"{ctx.label}: num_outputs={count} but the node has {n} outputs")
    chunk = -(-dim // n)
    if dim and chunk * (n - 1) >= dim:
        raise ModelError(f"{ctx.label}: cannot split {dim} into {n} chunks of {chunk}")
    return [chunk] * (n - 1) + [dim - chunk * (n - 1)]


@register("Split")
def split(ctx: LowerContext) -> list[Tensor]:
    x = ctx.input(0)
    axis = ctx.axis(ctx.attr("axis", 0), x.rank)
    outs, offset = [], 0
    for k, size in enumerate(_split_sizes(ctx, x.shape[axis])):
        first, shape = [0] * x.rank, list(x.shape)
        first[axis], shape[axis] = offset, size
        outs.append(strided(ctx, x, first, [1] * x.rank, shape, f"part{k}"))
        offset += size
    return outs


@register("Concat")
def concat(ctx: LowerContext) -> Tensor:
    xs = [ctx.input(k) for k in range(len(ctx.inputs))]
    if xs[0].rank == 0:
        raise ModelError(f"{ctx.label}: cannot concatenate scalars")
    axis = ctx.axis(ctx.attr("axis"), xs[0].rank)
    for t in xs:
        if (
            t.rank != xs[0].rank
            or t.dtype != xs[0].dtype
            or any(a != b for d, (a, b) in enumerate(zip(t.shape, xs[0].shape)) if d != axis)
        ):
            shapes = [f"{list(u.shape)} {u.dtype}" for u in xs]
            raise ModelError(f"{ctx.label}: inputs {shapes} do not concatenate along axis {axis}")
    parts = [t for t in xs if t.shape[axis] > 0] or xs[:1]
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [t.shape[axis] for t in parts]).tolist()
    shape = list(xs[0].shape)
    shape[axis] = offsets[-1]

    def pick(i: Sequence[Expr], lo: int, hi: int) -> Expr:
        # A balanced tree of selects keeps the expression depth logarithmic in the number
        # of inputs (exported graphs concatenate hundreds of shape scalars).
        if hi - lo == 1:
            at = i[axis] - offsets[lo]
            return parts[lo][(*i[:axis], at, *i[axis + 1 :])]
        mid = (lo + hi) // 2
        return select(lt(i[axis], offsets[mid]), pick(i, lo, mid), pick(i, mid, hi))

    return ctx.compute(shape, lambda *i: pick(i, 0, len(parts)))


# -- padding and broadcasting ----------------------------------------------------------------

# Pad modes and the opset that introduced each.
_PAD_MODES = {"constant": 11, "reflect": 11, "edge": 11, "wrap": 19}


def _pad_widths(ctx: LowerContext, rank: int) -> list[tuple[int, int]]:
    """(begin, end) per axis from the pads input and, from opset 18, the axes input."""
    pads = const_ints(ctx, 1, "pads")
    axes = list(range(rank))
    if ctx.opset >= 18 and ctx.has_input(3):
        axes = normalise_axes(ctx, const_ints(ctx, 3, "axes"), rank)
    if len(pads) != 2 * len(axes):
        raise ModelError(f"{ctx.label}: {len(pads)} pads for {len(axes)} axes")
    widths = [(0, 0)] * rank
    for k, d in enumerate(axes):
        widths[d] = (pads[k], pads[len(axes) + k])
    return widths


def _pad_source(ctx: LowerContext, mode: str, i: Expr, dim: int, begin: int, end: int) -> Expr:
    """Input index for output index ``i`` along one padded axis.

    Negative pads crop first and the remaining pads then apply to the cropped extent, as
    onnxruntime does; ``s`` is the position relative to the cropped start ``lo``.
    """
    lo, kept = max(-begin, 0), dim - max(-begin, 0) - max(-end, 0)
    before, after = max(begin, 0), max(end, 0)
    if kept <= 0 and (before or after) and mode != "constant":
        raise ModelError(f"{ctx.label}: {mode} padding of an empty axis")
    s = i - before
    if mode == "edge":
        s = select(lt(s, 0), 0, s) if before else s
        s = select(ge(s, kept), kept - 1, s) if after else s
    elif mode == "reflect":
        if max(before, after) > kept - 1:
            raise ModelError(
                f"{ctx.label}: reflect pads ({begin}, {end}) exceed {kept - 1} for a dim of {kept}"
            )
        s = select(lt(s, 0), 0 - s, s) if before else s
        s = select(ge(s, kept), 2 * (kept - 1) - s, s) if after else s
    elif mode == "wrap" and (before or after):
        s = s % kept
    return s + lo


@register("Pad")
def pad(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    mode = ctx.attr("mode", "constant")
    if mode not in _PAD_MODES or ctx.opset < _PAD_MODES[mode]:
        raise ctx.fail(f"mode {mode!r} is not supported at opset {ctx.opset}")
    widths = _pad_widths(ctx, x.rank)
    shape = [d + b + e for d, (b, e) in zip(x.shape, widths)]
    if min(shape, default=0) < 0:
        raise ModelError(f"{ctx.label}: pads {widths} crop more than the shape {list(x.shape)}")
    fill = _pad_value(ctx, x)
    if x.size == 0 and mode == "constant":
        return ctx.compute(shape, lambda *i: fill)

    def fn(*i: Expr) -> Expr:
        src = [_pad_source(ctx, mode, i[d], n, b, e) for d, (n, (b, e)) in enumerate(zip(x.shape, widths))]
        if mode != "constant":
            return x[src]
        inside = [ge(i[d], b) for d, (b, _) in enumerate(widths) if b > 0]
        inside += [lt(i[d], b + n) for d, (n, (b, e)) in enumerate(zip(x.shape, widths)) if e > 0]
        return select(logical_and(*inside), x[src], fill)

    return ctx.compute(shape, fn)


def _pad_value(ctx: LowerContext, x: Tensor) -> Expr:
    """The constant-mode fill: 0 by default, else the (scalar) constant_value input, which
    may also be a runtime tensor."""
    if not ctx.has_input(2):
        return as_expr(0, x.dtype)
    v = ctx.input(2)
    if v.size != 1 or v.dtype != x.dtype:
        raise ModelError(
            f"{ctx.label}: constant_value must be one {x.dtype} value, got {list(v.shape)} {v.dtype}"
        )
    known = ctx.const_value(2)
    return as_expr(known.reshape(()).item(), x.dtype) if known is not None else v[(0,) * v.rank]


@register("Expand")
def expand(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    target = const_ints(ctx, 1, "shape")
    if min(target, default=0) < 0:
        raise ModelError(f"{ctx.label}: negative dimension in shape {target}")
    shape = broadcast_shape(ctx, [x.shape, tuple(target)])
    if shape == x.shape:
        return x
    return ctx.compute(shape, lambda *i: x.broadcast(i))


@register("Tile")
def tile(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    repeats = const_ints(ctx, 1, "repeats")
    if len(repeats) != x.rank or min(repeats, default=0) < 0:
        raise ModelError(f"{ctx.label}: repeats {repeats} do not fit an input of rank {x.rank}")
    if all(r == 1 for r in repeats):
        return x
    shape = [d * r for d, r in zip(x.shape, repeats)]
    return ctx.compute(
        shape, lambda *i: x[tuple(k if r == 1 else k % d for k, d, r in zip(i, x.shape, repeats))]
    )


# -- gathers ---------------------------------------------------------------------------------


def wrap_index(ctx: LowerContext, value: Expr, n: int) -> Expr:
    """A data value used as an index into a dimension of ``n``: negative counts from the
    end, anything outside ``[-n, n)`` is reported (interpreter, emulator) or clamped (GPU)
    in the name of this node.  With ``n == 0`` the indices are empty (checked before), so
    the output is too and no index is ever evaluated."""
    return DataIndex(value, n, ctx.label) if n else as_expr(0)


def _checked_indices(ctx: LowerContext, n: int) -> np.ndarray | None:
    """Input 1 when it is constant, with negative entries resolved; out-of-range entries
    are an error here rather than an unguarded load later.  Runtime indices into an empty
    dimension are an error too: no value could be valid."""
    values = ctx.const_value(1)
    if n == 0 and ctx.has_input(1) and ctx.input(1).size:
        raise ModelError(f"{ctx.label}: indices into an empty dimension")
    if values is None:
        return None
    values = values.astype(np.int64)
    if values.size and (values.min() < -n or values.max() >= n):
        raise ModelError(f"{ctx.label}: indices out of range [{-n}, {n - 1}]")
    return np.where(values < 0, values + n, values)


def _progression(values: np.ndarray) -> tuple[int, int] | None:
    """(first, step) if ``values`` (rank 0 or 1) is an arithmetic progression, else None."""
    flat = values.reshape(-1)
    if values.ndim > 1 or flat.size == 0:
        return None
    step = int(flat[1] - flat[0]) if flat.size > 1 else 0
    if np.any(np.diff(flat) != step):
        return None
    return int(flat[0]), step


def _gather_position(ctx: LowerContext, indices: Tensor, n: int) -> Callable[[Sequence[Expr]], Expr]:
    """Maps output axes spanning ``indices`` to the position gathered along the axis.

    Constant indices forming a progression (a scalar, a strided range) become an affine
    index, which tile propagation bounds exactly; anything else is loaded as data.
    """
    values = _checked_indices(ctx, n)
    prog = _progression(values) if values is not None else None
    if prog is not None:
        first, step = prog
        return lambda j: j[0] * step + first if j else as_expr(first)
    return lambda j: wrap_index(ctx, indices[tuple(j)], n)


@register("Gather")
def gather(ctx: LowerContext) -> Tensor:
    data, indices = ctx.input(0), ctx.input(1)
    axis = ctx.axis(ctx.attr("axis", 0), data.rank)
    position = _gather_position(ctx, indices, data.shape[axis])
    q = indices.rank
    shape = data.shape[:axis] + indices.shape + data.shape[axis + 1 :]
    return ctx.compute(shape, lambda *i: data[(*i[:axis], position(i[axis : axis + q]), *i[axis + q :])])


@register("GatherElements")
def gather_elements(ctx: LowerContext) -> Tensor:
    data, indices = ctx.input(0), ctx.input(1)
    axis = ctx.axis(ctx.attr("axis", 0), data.rank)
    if indices.rank != data.rank or any(
        a > b for d, (a, b) in enumerate(zip(indices.shape, data.shape)) if d != axis
    ):
        raise ModelError(
            f"{ctx.label}: indices of shape {list(indices.shape)} do not fit data {list(data.shape)}"
        )
    n = data.shape[axis]
    _checked_indices(ctx, n)

    def fn(*i: Expr) -> Expr:
        return data[(*i[:axis], wrap_index(ctx, indices[i], n), *i[axis + 1 :])]

    return ctx.compute(indices.shape, fn)


@register("GatherND")
def gather_nd(ctx: LowerContext) -> Tensor:
    """``out[o..., j...] = data[o[:b]..., indices[o..., 0], ..., indices[o..., k-1], j...]``
    where ``o`` spans ``indices.shape[:-1]``, ``b`` is batch_dims and ``k`` the length of
    the last axis of ``indices``."""
    data, indices = ctx.input(0), ctx.input(1)
    b = ctx.attr("batch_dims", 0)
    q, r = indices.rank, data.rank
    if q < 1 or not 0 <= b < min(q, r):
        raise ModelError(f"{ctx.label}: batch_dims={b} does not fit data rank {r} and indices rank {q}")
    k = indices.shape[-1]
    if k > r - b or indices.shape[:b] != data.shape[:b]:
        raise ModelError(
            f"{ctx.label}: indices of shape {list(indices.shape)} do not fit data {list(data.shape)} "
            f"with batch_dims={b}"
        )
    dims = data.shape[b : b + k]
    values = ctx.const_value(1)
    if values is not None and values.size:
        values = values.astype(np.int64).reshape(-1, k)
        bad = (values < -np.asarray(dims)) | (values >= np.asarray(dims))
        if bad.any():
            m = int(np.nonzero(bad.any(axis=0))[0][0])
            raise ModelError(f"{ctx.label}: indices out of range [{-dims[m]}, {dims[m] - 1}] in column {m}")
    if indices.size and 0 in dims:
        raise ModelError(f"{ctx.label}: indices into an empty dimension")
    shape = indices.shape[:-1] + data.shape[b + k :]

    def fn(*i: Expr) -> Expr:
        outer = i[: q - 1]
        pos = [wrap_index(ctx, indices[(*outer, m)], n) for m, n in enumerate(dims)]
        return data[(*outer[:b], *pos, *i[q - 1 :])]

    return ctx.compute(shape, fn)


@register("OneHot")
def one_hot(ctx: LowerContext) -> Tensor:
    """``out[..., j, ...] = on if indices[...] (negative counting from the end) == j else
    off``.  An index outside ``[-depth, depth)`` selects no position: ONNX defines that row
    as all ``off``, so it is compared, never used as an address, and is not an error."""
    indices, values = ctx.input(0), ctx.input(2)
    depth_value = ctx.const_input(1, "depth").reshape(-1)
    if depth_value.size != 1:
        raise ModelError(f"{ctx.label}: depth must be one value, got {depth_value.size}")
    depth = int(depth_value[0])
    if depth < 1:
        raise ModelError(f"{ctx.label}: depth must be positive, got {depth}")
    if values.shape != (2,):
        raise ModelError(f"{ctx.label}: values must be [off_value, on_value], got shape {list(values.shape)}")
    axis = ctx.axis(ctx.attr("axis", -1), indices.rank + 1)
    known = ctx.const_value(2)
    if known is not None:
        off, on = (as_expr(v.item(), values.dtype) for v in known.reshape(-1))
    else:
        off, on = values[0], values[1]
    shape = (*indices.shape[:axis], depth, *indices.shape[axis:])

    def fn(*i: Expr) -> Expr:
        v = cast(indices[i[:axis] + i[axis + 1 :]], "int64")
        pos = select(lt(v, 0), v + depth, v)
        return select(eq(pos, cast(i[axis], "int64")), on, off)

    return ctx.compute(shape, fn)
