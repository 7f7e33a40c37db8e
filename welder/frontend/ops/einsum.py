"""Einsum: any equation as one compute.

Labels kept in the output are the spatial axes and the others are summed; the body is the
product of one load per operand.  That is a pure sum of products -- the form MatMul and
attention scores take -- so the scheduler and the interpreter treat an einsum exactly like
the equivalent matrix product.  Without summed labels (transposes, diagonals, outer
products) the compute is injective.
"""

from __future__ import annotations

import functools
import operator
import string
from collections.abc import Sequence
from dataclasses import dataclass

from welder.errors import ModelError
from welder.frontend.registry import LowerContext, Tensor, register
from welder.ir.compute import reduce, reduce_axis
from welder.ir.expr import BOOL, Expr

_LETTERS = frozenset(string.ascii_letters)
_ELLIPSIS = "..."


@dataclass(frozen=True)
class _Equation:
    """One label per dimension of every operand and of the output.  Dimensions covered by
    an ellipsis get the labels ``.0``, ``.1``, ... of the broadcast ellipsis shape, right
    aligned, so they pair up across operands like letters do."""

    operands: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]


@register("Einsum")
def einsum(ctx: LowerContext) -> Tensor:
    xs = [ctx.input(k) for k in range(len(ctx.inputs))]
    if not xs:
        raise ModelError(f"{ctx.label}: Einsum needs at least one input")
    if len({x.dtype for x in xs}) > 1:
        raise ModelError(f"{ctx.label}: inputs have different dtypes {[x.dtype for x in xs]}")
    if xs[0].dtype == BOOL:
        raise ctx.fail("bool inputs are not supported")
    eq = _parse(ctx, ctx.attr("equation"), [x.rank for x in xs])
    extent = _extents(ctx, eq, xs)
    # Summed labels of extent one index 0 everywhere, so they need no reduction axis.
    summed = [lb for lb in dict.fromkeys(sum(eq.operands, ())) if lb not in eq.output and extent[lb] != 1]
    if any(extent[lb] == 0 for lb in summed):
        raise ctx.fail("summing over an empty dimension is not supported")

    def fn(*idx: Expr):
        axes = [reduce_axis(extent[lb]) for lb in summed]
        var = {**dict(zip(eq.output, idx)), **dict(zip(summed, axes))}
        loads = [
            x[tuple(0 if d == 1 else var[lb] for lb, d in zip(labels, x.shape))]
            for x, labels in zip(xs, eq.operands)
        ]
        body = functools.reduce(operator.mul, loads)
        return reduce("sum", body, axes) if axes else body

    return ctx.compute([extent[lb] for lb in eq.output], fn)


def _parse(ctx: LowerContext, equation: str, ranks: Sequence[int]) -> _Equation:
    """Labels of every operand and of the output, checked against the operand ranks."""
    eq = equation.replace(" ", "")
    bad = sorted(set(eq) - _LETTERS - set(",.->"))
    if bad:
        raise ModelError(f"{ctx.label}: equation {equation!r} contains {''.join(bad)!r}; labels are letters")
    lhs, arrow, rhs = eq.partition("->")
    if "-" in lhs + rhs or ">" in lhs + rhs:
        raise ModelError(f"{ctx.label}: equation {equation!r} has a malformed or repeated '->'")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ModelError(
            f"{ctx.label}: equation {equation!r} has {len(terms)} operand(s) "
            f"but the node has {len(ranks)} input(s)"
        )
    split = [_split_term(ctx, t, f"operand {k}") for k, t in enumerate(terms)]
    covered = []
    for k, ((before, after), rank) in enumerate(zip(split, ranks)):
        named = len(before) + len(after or "")
        if (after is None and named != rank) or named > rank:
            raise ModelError(
                f"{ctx.label}: operand {k} has rank {rank} but its subscripts {terms[k]!r} "
                f"name {named} dimensions"
            )
        covered.append(rank - named)
    ell = max(covered)
    ell_labels = tuple(f".{j}" for j in range(ell))
    operands = tuple(
        (*before, *ell_labels[ell - n :], *(after or "")) for (before, after), n in zip(split, covered)
    )
    if arrow:
        output = _explicit_output(ctx, rhs, operands, ell_labels)
    else:
        # Implicit output: the ellipsis, then the letters used exactly once in ASCII order
        # (numpy's rule, which the ONNX reference follows).
        letters = [lb for labels in operands for lb in labels if lb in _LETTERS]
        output = (*ell_labels, *sorted(lb for lb in set(letters) if letters.count(lb) == 1))
    return _Equation(operands, output)


def _split_term(ctx: LowerContext, term: str, what: str) -> tuple[str, str | None]:
    """(letters before the ellipsis, letters after it or None when there is none)."""
    before, dots, after = term.partition(_ELLIPSIS)
    if "." in before + after:
        raise ModelError(f"{ctx.label}: {what} subscripts {term!r}: '.' only appears as one '...'")
    return before, after if dots else None


def _explicit_output(
    ctx: LowerContext, rhs: str, operands: tuple[tuple[str, ...], ...], ell_labels: tuple[str, ...]
) -> tuple[str, ...]:
    before, after = _split_term(ctx, rhs, "output")
    if after is None and ell_labels:
        raise ModelError(f"{ctx.label}: the inputs use '...' but the output subscripts {rhs!r} do not")
    output = (*before, *(ell_labels if after is not None else ()), *(after or ""))
    seen = {lb for labels in operands for lb in labels}
    for lb in output:
        if output.count(lb) > 1:
            raise ModelError(f"{ctx.label}: output label {lb!r} appears more than once")
        if lb not in seen:
            raise ModelError(f"{ctx.label}: output label {lb!r} appears in no input")
    return output


def _extents(ctx: LowerContext, eq: _Equation, xs: Sequence[Tensor]) -> dict[str, int]:
    """Size of every label; a dimension of size 1 broadcasts against the others (numpy)."""
    sizes: dict[str, set[int]] = {}
    for x, labels in zip(xs, eq.operands):
        for lb, d in zip(labels, x.shape):
            sizes.setdefault(lb, set()).add(d)
    extent = {}
    for lb, ds in sizes.items():
        real = ds - {1}
        if len(real) > 1:
            what = "an ellipsis dimension" if lb.startswith(".") else f"label {lb!r}"
            raise ModelError(f"{ctx.label}: {what} has incompatible sizes {sorted(ds)}")
        extent[lb] = real.pop() if real else 1
    return extent
