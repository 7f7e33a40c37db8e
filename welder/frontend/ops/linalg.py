"""Matrix products: MatMul (numpy semantics, batched and broadcast) and Gemm."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from welder.errors import ModelError
from welder.frontend.ops.elementwise import broadcast_shape
from welder.frontend.ops.shape import reshape_index, reshaped
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.compute import reduce, reduce_axis
from welder.ir.expr import Const, Expr


def contraction(
    ctx: LowerContext,
    shape: Sequence[int],
    k: int,
    term: Callable[[tuple[Expr, ...], Expr], Expr],
    dtype: str,
    hint: str = "",
) -> Tensor:
    """``out[idx] = sum_{r < k} term(idx, r)``.  The IR has no reduce axes of extent zero,
    so an empty contraction (K = 0, which ONNX allows) is the zero tensor it sums to."""
    if k == 0:
        return ctx.compute(shape, lambda *idx: Const(0, dtype), hint)

    def fn(*idx: Expr):
        r = reduce_axis(k)
        return reduce("sum", term(idx, r), r)

    return ctx.compute(shape, fn, hint)


def matmul_compute(ctx: LowerContext, a: Tensor, b: Tensor, hint: str = "") -> Tensor:
    """``numpy.matmul(a, b)`` as one sum reduction."""
    if a.rank == 0 or b.rank == 0:
        raise ModelError(f"{ctx.label}: MatMul inputs must have rank >= 1")
    a_vec, b_vec = a.rank == 1, b.rank == 1
    m_dims = () if a_vec else (a.shape[-2],)
    n_dims = () if b_vec else (b.shape[-1],)
    k = a.shape[-1]
    kb = b.shape[0] if b_vec else b.shape[-2]
    if k != kb:
        raise ModelError(f"{ctx.label}: inner dimensions differ ({list(a.shape)} @ {list(b.shape)})")
    a_batch, b_batch = a.shape[:-2], b.shape[:-2]
    batch = broadcast_shape(ctx, [a_batch, b_batch])
    nb = len(batch)
    if a.rank >= 3 and b.rank == 2 and math.prod(a_batch) > 1 and 0 not in a.shape:
        return _flat_product(ctx, a, b, hint)

    def term(idx: tuple[Expr, ...], r: Expr) -> Expr:
        bi = idx[:nb]
        rest = idx[nb:]
        av = a[(r,)] if a_vec else a[(*_batch(bi, a_batch), rest[0], r)]
        bv = b[(r,)] if b_vec else b[(*_batch(bi, b_batch), r, rest[-1])]
        return av * bv

    return contraction(ctx, batch + m_dims + n_dims, k, term, a.dtype, hint)


def _flat_product(ctx: LowerContext, a: Tensor, b: Tensor, hint: str) -> Tensor:
    """``a @ b`` with one weight matrix for every batch: the product over ``a``'s rows
    flattened, ``[prod(batch) * M, K] @ [K, N]``, reshaped back.  A kind then tiles M
    across batches (ViT's 50 tokens an image, Swin's 49 a window) instead of padding
    every batch's few rows to its tile."""
    lead = a.shape[:-1]
    rows = math.prod(lead)

    def term(idx: tuple[Expr, ...], r: Expr) -> Expr:
        i, j = idx
        return a[(*reshape_index((i,), (rows,), lead), r)] * b[r, j]

    flat = contraction(ctx, (rows, b.shape[1]), a.shape[-1], term, a.dtype, hint)
    return reshaped(ctx, flat, (*lead, b.shape[1]))


def _batch(idx: tuple[Expr, ...], dims: tuple[int, ...]) -> tuple:
    lead = len(idx) - len(dims)
    return tuple(0 if d == 1 else idx[lead + j] for j, d in enumerate(dims))


@register("MatMul")
def matmul(ctx: LowerContext) -> Tensor:
    return matmul_compute(ctx, ctx.input(0), ctx.input(1))


@register("Gemm")
def gemm(ctx: LowerContext) -> Tensor:
    a, b = ctx.input(0), ctx.input(1)
    if a.rank != 2 or b.rank != 2:
        raise ModelError(f"{ctx.label}: Gemm takes 2-D inputs, got {list(a.shape)} and {list(b.shape)}")
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    kb, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if k != kb:
        raise ModelError(f"{ctx.label}: inner dimensions differ after transposes ({k} vs {kb})")

    def term(idx: tuple[Expr, ...], r: Expr) -> Expr:
        i, j = idx
        av = a[r, i] if ta else a[i, r]
        bv = b[j, r] if tb else b[r, j]
        return av * bv

    c = ctx.optional_input(2)
    if c is None and alpha == 1.0:
        return contraction(ctx, (m, n), k, term, a.dtype)
    ab = contraction(ctx, (m, n), k, term, a.dtype, "product")
    if c is not None:
        broadcast_shape(ctx, [c.shape, (m, n)])

    def epilogue(i: Expr, j: Expr) -> Expr:
        out = ab[i, j] if alpha == 1.0 else ab[i, j] * alpha
        if c is not None:
            cv = c.broadcast((i, j))
            out = out + (cv if beta == 1.0 else cv * beta)
        return out

    return ctx.compute((m, n), epilogue)
