"""Sliding windows: reductions whose innermost output axis and one reduce axis (a tap) are
read only through the position ``i * stride + r * dilation``.

A depthwise convolution in image form is the case that matters: ``O[n, c, h, w] = sum_{kh,
kw} select(inside, X[n, c, h + kh - 1, w + kw - 1], 0) * W[c, 0, kh, kw]``.  Two outputs
``w`` and ``w + 1`` read the same input at taps ``kw + 1`` and ``kw``, so a thread computing
``R`` neighbouring outputs needs ``R + K - 1`` distinct values of the windowed factor per
row, not ``R * K``.  :func:`sliding_window` finds the factor, the tap and the step, and proves
the property by evaluating every index and condition of the factor that involves the two
axes over the output's extent (sampling the other axes), so a product the analysis accepts
may share the values whatever its lowering looked like.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from welder.ir.compute import Compute
from welder.ir.expr import Binary, Const, Expr, Load, Select, Var, free_vars, walk

#: Strides and dilations tried (the most values shared wins among those that hold).
STEPS = (1, 2, 3, 4)
#: Most (output, tap) positions the proof evaluates.  Windows worth unrolling are a few taps
#: along one image row (the SIMT twin unrolls at most 1024 products a thread); past this an
#: axis is a flattened image or a channel reduction, and evaluating every position in Python
#: took seconds a call (MobileNetV2's stem: 12544 flat positions by 27 taps, 16 s).
MAX_POINTS = 1 << 14

_OPS: dict[str, Callable[[int, int], int]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "max": max,
    "min": min,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
    "and": lambda a, b: bool(a) and bool(b),
    "or": lambda a, b: bool(a) or bool(b),
}


def reads_through_window(load: Load, c: Compute) -> bool:
    """Whether ``c`` reads ``load`` through a window: an index moving with an output axis
    and a reduced one together (``x[i + r]``), so that output points share elements.  A
    looser test than :func:`sliding_window`'s: any such index, whatever its step."""
    outputs = {a.name for a in c.axes}
    reduced = {a.name for a in c.reduce_axes}
    return any(free_vars(i) & outputs and free_vars(i) & reduced for i in load.indices)


@dataclass(frozen=True)
class SlidingWindow:
    """``compute.body`` is ``factor(x) * other`` (``x`` the operand index 0 or 1 of the
    multiplication) where ``x`` reads the innermost output axis ``axis`` and reduce axis
    ``tap`` only through ``i * stride + r * dilation``, and ``other`` reads neither
    ``axis``."""

    x: int
    axis: str
    tap: str
    stride: int
    dilation: int

    def slots(self, reg: int, taps: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """For ``reg`` neighbouring outputs and ``taps`` taps: the distinct positions, each as
        the first ``(output, tap)`` reading it, and every ``(output, tap, position)``."""
        first: dict[int, int] = {}
        reps: list[tuple[int, int]] = []
        uses = []
        for v, k in itertools.product(range(reg), range(taps)):
            pos = v * self.stride + k * self.dilation
            if pos not in first:
                first[pos] = len(reps)
                reps.append((v, k))
            uses.append((v, k, first[pos]))
        return reps, uses


@functools.lru_cache(maxsize=1024)
def sliding_window(c: Compute) -> SlidingWindow | None:
    """The sliding window of ``c`` along its innermost axis, or None (see the module).
    Cached: the fusion search asks again for every group a stage joins."""
    body = c.body
    if not c.reduce_axes or not isinstance(body, Binary) or body.op != "mul" or not c.axes:
        return None
    axis = c.axes[-1]
    extents = {a.name: a.extent for a in (*c.axes, *c.reduce_axes)}
    for x, (factor, other) in enumerate(((body.a, body.b), (body.b, body.a))):
        if axis.name in free_vars(other):
            continue
        leaves = _leaves(factor)
        if leaves is None:
            return None
        taps = {n for e in leaves if axis.name in (used := free_vars(e)) for n in used} - {axis.name}
        taps &= {a.name for a in c.reduce_axes if a.extent > 1}
        for tap in sorted(taps):  # a flat index may hold two taps, one per image axis
            steps = _steps([e for e in leaves if free_vars(e) & {axis.name, tap}], axis.name, tap, extents)
            if steps is not None:
                return SlidingWindow(x, axis.name, tap, *steps)
    return None


def _leaves(e: Expr) -> list[Expr] | None:
    """The integer and boolean expressions a value reads its position through: load indices
    and the terms of select conditions (a padding guard is one term per axis); None where
    an index itself reads data."""
    found: list[Expr] = []
    for node in walk(e):
        if isinstance(node, Load):
            found.extend(node.indices)
        elif isinstance(node, Select):
            found.extend(_terms(node.cond))
    if any(isinstance(n, Load) for leaf in found for n in walk(leaf)):
        return None
    return found


def _terms(cond: Expr) -> list[Expr]:
    if isinstance(cond, Binary) and cond.op == "and":
        return [*_terms(cond.a), *_terms(cond.b)]
    return [cond]


def _steps(leaves: list[Expr], axis: str, tap: str, extents: Mapping[str, int]) -> tuple[int, int] | None:
    """``(stride, dilation)`` under which every leaf is a function of ``i * stride + r *
    dilation`` (sharing the most positions; coprime, as only their ratio decides what is
    shared: a stride-2 dilation-2 window shares what a stride-1 one does), or None."""
    if extents[axis] * extents[tap] > MAX_POINTS:
        return None
    others = sorted({n for e in leaves for n in free_vars(e)} - {axis, tap})
    samples = [
        {n: pick(extents[n]) for n in others} for pick in (lambda e: 0, lambda e: e // 2, lambda e: e - 1)
    ]
    points = list(itertools.product(range(extents[axis]), range(extents[tap])))
    try:
        values = [
            {(i, r): tuple(_value(e, {**env, axis: i, tap: r}) for e in leaves) for i, r in points}
            for env in samples
        ]
    except (KeyError, ZeroDivisionError):
        return None
    best: tuple[int, tuple[int, int]] | None = None
    for stride, dilation in itertools.product(STEPS, STEPS):
        if math.gcd(stride, dilation) > 1:
            continue  # shares what (stride, dilation) / gcd shares
        seen: dict[int, list[tuple]] = {}
        for i, r in points:
            seen.setdefault(i * stride + r * dilation, []).append(tuple(v[(i, r)] for v in values))
        if all(len(set(vals)) == 1 for vals in seen.values()) and (best is None or len(seen) < best[0]):
            best = (len(seen), (stride, dilation))
    if best is None or best[0] == len(points):
        return None  # nothing shared: no window
    return best[1]


def _value(e: Expr, env: Mapping[str, int]) -> int:
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Binary) and e.op in _OPS:
        return int(_OPS[e.op](_value(e.a, env), _value(e.b, env)))
    raise KeyError(type(e).__name__)
