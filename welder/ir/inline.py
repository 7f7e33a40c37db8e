"""Inlining injective computes into their consumers.

Inside a fused kernel an injective compute (elementwise, broadcast, transpose, reshape,
slice, gather ...) never gets a buffer: wherever a consumer loads it, the producer's body
is evaluated at the loaded index instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from welder.ir.compute import Compute
from welder.ir.expr import Expr, Load, rewrite, substitute


def inline_expr(e: Expr, producers: Mapping[str, Compute]) -> Expr:
    """``e`` with every load of a tensor in ``producers`` replaced by its body, recursively.
    Every producer must be injective."""

    def fn(n: Expr) -> Expr | None:
        if not isinstance(n, Load) or n.tensor not in producers:
            return None
        p = producers[n.tensor]
        if p.reduce_axes:
            raise ValueError(f"cannot inline reduction {p.name!r}")
        body = substitute(p.body, {a.name: i for a, i in zip(p.axes, n.indices)})
        return inline_expr(body, producers)

    return rewrite(e, fn)


def inline_compute(c: Compute, producers: Mapping[str, Compute]) -> Compute:
    """Copy of ``c`` reading only tensors that are not in ``producers``."""
    return Compute(c.name, c.axes, inline_expr(c.body, producers), c.dtype, c.reduce_axes, c.reduce_op)
