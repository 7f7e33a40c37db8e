"""Data movement: reshapes, transposes, slicing, concatenation, padding, gathers.

All of these are injective computes.  Reshapes map indices through the smallest groups of
dimensions whose sizes multiply to the same number, so ``[B, S, 768] -> [B, S, 12, 64]``
reads ``x[b, s, h * 64 + d]`` rather than a chain of divisions of a flat offset.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from welder.errors import ModelError
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.expr import Expr


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
        return tuple(0 for _ in in_shape)
    for g_in, g_out in dim_groups(in_shape, out_shape):
        linear: Expr | int = 0
        for d in g_out:
            linear = linear * out_shape[d] + out_idx[d]
        stride = 1
        for d in reversed(g_in):
            part = linear // stride if stride > 1 else linear
            result[d] = part % in_shape[d] if d != g_in[0] else part
            stride *= in_shape[d]
    return tuple(result)


def reshaped(ctx: LowerContext, x: Tensor, shape: Sequence[int], hint: str = "") -> Tensor:
    shape = tuple(int(s) for s in shape)
    if shape == x.shape:
        return x
    return ctx.compute(shape, lambda *i: x[reshape_index(i, shape, x.shape)], hint)


@register("Reshape")
def reshape(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    spec = [int(s) for s in ctx.const_input(1, "shape").reshape(-1)]
    allowzero = ctx.attr("allowzero", 0)
    out = []
    for k, s in enumerate(spec):
        if s == 0 and not allowzero:
            if k >= x.rank:
                raise ModelError(f"{ctx.label}: shape entry {k} copies a dimension the input lacks")
            out.append(x.shape[k])
        else:
            out.append(s)
    if out.count(-1) > 1:
        raise ModelError(f"{ctx.label}: shape {spec} has more than one -1")
    if -1 in out:
        known = int(np.prod([s for s in out if s != -1]))
        if known == 0 or x.size % known:
            raise ModelError(f"{ctx.label}: cannot reshape {list(x.shape)} to {spec}")
        out[out.index(-1)] = x.size // known
    if int(np.prod(out)) != x.size:
        raise ModelError(f"{ctx.label}: cannot reshape {list(x.shape)} ({x.size} elements) to {out}")
    return reshaped(ctx, x, out)


@register("Transpose")
def transpose(ctx: LowerContext) -> Tensor:
    x = ctx.input(0)
    perm = [ctx.axis(p, x.rank) for p in ctx.attr("perm", list(reversed(range(x.rank))))]
    if sorted(perm) != list(range(x.rank)):
        raise ModelError(f"{ctx.label}: perm {perm} is not a permutation of {x.rank} axes")
    inverse = [perm.index(d) for d in range(x.rank)]
    return ctx.compute([x.shape[p] for p in perm], lambda *i: x[tuple(i[inverse[d]] for d in range(x.rank))])
