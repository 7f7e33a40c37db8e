"""Interval arithmetic on index expressions, with origins that depend on the block.

A thread block of a fused kernel computes one tile of the group's output; which elements
of every other tensor it touches follows from the index expressions.  Those regions are
described per dimension by an :class:`Interval`: a lower bound that is a function of the
block coordinates (``b0, b1, ...``) and of the reduction-step counters (``k0, ...``), and a
static extent that holds for every block.  Lower bounds stay *affine* (``64*b1 + 3``)
wherever the arithmetic allows it, which is what makes divisibility -- and hence exact
floordiv/mod through reshapes -- decidable; elsewhere they become opaque expressions that
the code generator can still evaluate at run time, with a conservative extent.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from welder.ir.expr import INDEX, Binary, Const, Expr, Load, Select, Var, binary, walk


@dataclass(frozen=True)
class Affine:
    """``const + sum(coef * var)`` over block/step variables, integer coefficients."""

    terms: tuple[tuple[str, int], ...] = ()
    const: int = 0

    @staticmethod
    def make(terms: Mapping[str, int] | None = None, const: int = 0) -> Affine:
        clean = tuple(sorted((v, c) for v, c in (terms or {}).items() if c != 0))
        return Affine(clean, int(const))

    @property
    def coefs(self) -> dict[str, int]:
        return dict(self.terms)

    @property
    def is_const(self) -> bool:
        return not self.terms

    def __add__(self, other: Affine | int) -> Affine:
        if isinstance(other, int):
            return Affine(self.terms, self.const + other)
        merged = self.coefs
        for v, c in other.terms:
            merged[v] = merged.get(v, 0) + c
        return Affine.make(merged, self.const + other.const)

    def __sub__(self, other: Affine | int) -> Affine:
        return self + (other.scale(-1) if isinstance(other, Affine) else -other)

    def scale(self, c: int) -> Affine:
        return Affine.make({v: k * c for v, k in self.terms}, self.const * c)

    def coefs_divisible_by(self, d: int) -> bool:
        if not self.terms:  # a constant, the common case
            return True
        return all(c % d == 0 for _, c in self.terms)

    def same_terms(self, other: Affine) -> bool:
        return self.terms == other.terms

    def to_expr(self) -> Expr:
        out: Expr = Const(0, INDEX)
        for v, c in self.terms:
            out = binary("add", out, binary("mul", Var(v), c))
        return binary("add", out, self.const)

    def evaluate(self, env: Mapping[str, int]) -> int:
        return self.const + sum(c * env[v] for v, c in self.terms)

    def __str__(self) -> str:
        parts = [f"{c}*{v}" if c != 1 else v for v, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


Origin = Affine | Expr


@dataclass(frozen=True)
class Interval:
    """``[lo, lo + extent)``; ``extent`` bounds the size for every block."""

    lo: Origin
    extent: int

    # Both are asked for millions of times a fusion search, with few distinct arguments;
    # intervals are immutable, so one instance serves every caller.
    @staticmethod
    @functools.cache
    def const(value: int) -> Interval:
        return Interval(Affine((), int(value)), 1)

    @staticmethod
    @functools.cache
    def full(extent: int) -> Interval:
        return Interval(Affine(), extent)

    @property
    def affine(self) -> Affine | None:
        return self.lo if isinstance(self.lo, Affine) else None

    def lo_expr(self) -> Expr:
        return self.lo.to_expr() if isinstance(self.lo, Affine) else self.lo

    def at(self, env: Mapping[str, int]) -> tuple[int, int]:
        """Concrete ``(lo, hi_exclusive)`` for given block/step variable values."""
        lo = self.lo.evaluate(env) if isinstance(self.lo, Affine) else eval_index(self.lo, env)
        return lo, lo + self.extent

    def __str__(self) -> str:
        return f"[{self.lo}, +{self.extent})"


def _as_opaque(o: Origin) -> Expr:
    return o.to_expr() if isinstance(o, Affine) else o


def _add(a: Origin, b: Origin | int) -> Origin:
    if isinstance(a, Affine) and isinstance(b, (Affine, int)):
        return a + b
    return binary("add", _as_opaque(a), b if isinstance(b, int) else _as_opaque(b))


def _scale(a: Origin, c: int) -> Origin:
    return a.scale(c) if isinstance(a, Affine) else binary("mul", a, c)


def union(a: Interval | None, b: Interval | None) -> Interval | None:
    """Smallest interval holding both, or None when that depends on the block in a way
    a static extent cannot describe."""
    if a is None or b is None:
        return None
    if a == b:
        return a
    la, lb = a.affine, b.affine
    if la is None or lb is None or not la.same_terms(lb):
        return None
    lo = min(la.const, lb.const)
    hi = max(la.const + a.extent, lb.const + b.extent)
    return Interval(Affine(la.terms, lo), hi - lo)


def affine_form(e: Expr) -> Affine | None:
    """Index expression ``e`` as a sum of its variables times constants plus a constant,
    where it is one (each variable bound to a point, so that the interval is one value)."""
    names = {n.name for n in walk(e) if isinstance(n, Var)}
    point = bound(e, {v: Interval(Affine.make({v: 1}), 1) for v in names})
    return point.affine if point is not None and point.extent == 1 else None


def bound(e: Expr, env: Mapping[str, Interval]) -> Interval | None:
    """Interval of the values index expression ``e`` takes when every axis variable
    ranges over its interval in ``env``; None if unbounded (data-dependent indices)."""
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        return Interval.const(int(e.value)) if e.dtype == INDEX else None
    if isinstance(e, Select):
        return union(bound(e.a, env), bound(e.b, env))
    if not isinstance(e, Binary) or e.dtype != INDEX:
        return None  # loads, casts from data: the whole dimension may be touched
    a, b = bound(e.a, env), bound(e.b, env)
    if a is None or b is None:
        return None
    ca = a.affine.const if a.extent == 1 and a.affine is not None and a.affine.is_const else None
    cb = b.affine.const if b.extent == 1 and b.affine is not None and b.affine.is_const else None
    if e.op == "add":
        return Interval(_add(a.lo, b.lo), a.extent + b.extent - 1)
    if e.op == "sub":
        hi_b = _add(b.lo, b.extent - 1)
        return Interval(_add(a.lo, _scale(hi_b, -1)), a.extent + b.extent - 1)
    if e.op == "mul":
        if cb is None and ca is not None:
            a, b, cb = b, a, ca
        if cb is None:
            return None
        if cb >= 0:
            return Interval(_scale(a.lo, cb), (a.extent - 1) * cb + 1) if cb else Interval.const(0)
        return Interval(_scale(_add(a.lo, a.extent - 1), cb), (a.extent - 1) * -cb + 1)
    if e.op == "floordiv" and cb is not None and cb > 0:
        return _floordiv(a, cb)
    if e.op == "mod" and cb is not None and cb > 0:
        return _mod(a, cb)
    if e.op in ("max", "min"):
        return _monotone_minmax(e.op, a, b)
    return None


def _residue_class(a: Interval, d: int) -> tuple[int, int]:
    """``(g, r)``: every block's lower bound of ``a`` is ``r`` modulo ``g``, and ``g``
    divides ``d``.  ``g`` is the gcd of ``d`` and the block coefficients, so the lower
    bound modulo ``d`` is one of ``r, r + g, ..., d - g + r``; an opaque bound gives
    ``(1, 0)`` (any residue)."""
    aff = a.affine
    if aff is None:
        return 1, 0
    g = math.gcd(d, *(c for _, c in aff.terms))
    return g, aff.const % g


def _floordiv(a: Interval, d: int) -> Interval:
    aff = a.affine
    if aff is not None and aff.coefs_divisible_by(d):
        lo_c = aff.const // d
        hi_c = (aff.const + a.extent - 1) // d
        terms = {v: c // d for v, c in aff.terms}
        return Interval(Affine.make(terms, lo_c), hi_c - lo_c + 1)
    # `extent` consecutive integers from a lower bound at residue `lo % d` span
    # `(lo % d + extent - 1) // d + 1` quotients; the largest residue is `d - g + r`.  A
    # tile of 32 along a merged axis of 64 (g = 32) thus reads one quotient, not two.
    g, r = _residue_class(a, d)
    extent = (d - g + r + a.extent - 1) // d + 1
    return Interval(binary("floordiv", a.lo_expr(), d), extent)


def _mod(a: Interval, d: int) -> Interval:
    # The range never wraps around when even the largest residue of the lower bound,
    # `d - g + r`, leaves room for the extent: `r + extent <= g`.
    g, r = _residue_class(a, d)
    if r + a.extent <= g:
        aff = a.affine
        if aff is not None and aff.coefs_divisible_by(d):
            return Interval(Affine.make(const=aff.const % d), a.extent)
        return Interval(binary("mod", a.lo_expr(), d), a.extent)
    return Interval.full(d)  # the range may wrap around: assume every residue


def _monotone_minmax(op: str, a: Interval, b: Interval) -> Interval | None:
    la, lb = a.affine, b.affine
    if la is not None and lb is not None and la.same_terms(lb):
        pick = max if op == "max" else min
        lo = pick(la.const, lb.const)
        hi = pick(la.const + a.extent - 1, lb.const + b.extent - 1)
        return Interval(Affine(la.terms, lo), max(hi - lo + 1, 1))
    lo = binary(op, a.lo_expr(), b.lo_expr())
    # max/min never widen the range beyond the wider operand.
    return Interval(lo, max(a.extent, b.extent))


def eval_index(e: Expr, env: Mapping[str, int]) -> int:
    """Value of an index expression without loads, at one point."""
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Select):
        raise ValueError("select in a bound expression")
    if isinstance(e, Binary):
        a, b = eval_index(e.a, env), eval_index(e.b, env)
        return {
            "add": lambda: a + b,
            "sub": lambda: a - b,
            "mul": lambda: a * b,
            "floordiv": lambda: a // b,
            "mod": lambda: a % b,
            "max": lambda: max(a, b),
            "min": lambda: min(a, b),
        }[e.op]()
    raise ValueError(f"not an index expression: {e}")


def depends_on_data(e: Expr) -> bool:
    """True if the expression reads tensor data (a gather-style index)."""
    return any(isinstance(n, Load) for n in walk(e))
