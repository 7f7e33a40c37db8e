"""Compute: one tensor defined as ``out[spatial axes] = reduce_{reduce axes} body``.

A Compute is the unit every stage works on.  It has at most one reduction; operators that
need several (softmax, layer norm) lower to several Computes.  A Compute without reduce
axes is *injective*: it can be inlined into its consumers, so it never needs a buffer of
its own inside a fused group.

Axes are named canonically (``i0, i1, ...`` spatial, ``r0, r1, ...`` reduce) so that two
structurally identical computes print and hash identically whatever the model called them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from welder.ir.expr import (
    BOOL,
    INDEX,
    Binary,
    Call,
    Expr,
    Load,
    Var,
    as_expr,
    format_expr,
    format_tensor_name,
    free_vars,
    is_float,
    loads,
    rename_tensors,
    substitute,
    walk,
)

REDUCE_OPS = ("sum", "prod", "max", "min", "argmax", "argmin")


@dataclass(frozen=True)
class Axis:
    name: str
    extent: int

    @property
    def var(self) -> Var:
        return Var(self.name)


@dataclass(frozen=True)
class Reduce:
    """Marker returned by :func:`reduce`; only valid as the whole body of a compute."""

    op: str
    body: Expr
    axes: tuple[Axis, ...]


_fresh = itertools.count()


@dataclass(frozen=True, eq=True, repr=False)
class ReduceVar(Var):
    """A reduction variable as used while a body is being built; ``compute`` replaces it
    by a plain canonical ``Var`` and records the extent on the Compute."""

    extent: int = 1


def reduce_axis(extent: int) -> ReduceVar:
    if extent < 1:
        raise ValueError(f"reduce axis extent must be positive, got {extent}")
    return ReduceVar(f"_k{next(_fresh)}", int(extent))


def reduce(op: str, body: Expr | float, axes: ReduceVar | Sequence[ReduceVar]) -> Reduce:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}")
    vs = [axes] if isinstance(axes, Var) else list(axes)
    if op in ("argmax", "argmin") and len(vs) != 1:
        raise ValueError(f"{op} reduces exactly one axis")
    if not all(isinstance(v, ReduceVar) for v in vs):
        raise TypeError("reduce() takes axes made by reduce_axis()")
    return Reduce(op, as_expr(body), tuple(Axis(v.name, v.extent) for v in vs))


@dataclass(frozen=True)
class Compute:
    name: str
    axes: tuple[Axis, ...]
    body: Expr
    dtype: str
    reduce_axes: tuple[Axis, ...] = ()
    reduce_op: str | None = None

    def __post_init__(self) -> None:
        if (self.reduce_op is None) != (not self.reduce_axes):
            raise ValueError(f"{self.name}: reduce_op and reduce_axes must be given together")
        if self.reduce_op is not None and self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"{self.name}: unknown reduction {self.reduce_op!r}")
        known = {a.name for a in self.axes} | {a.name for a in self.reduce_axes}
        unknown = free_vars(self.body) - known
        if unknown:
            raise ValueError(f"{self.name}: body uses unbound axes {sorted(unknown)}")
        if self.reduce_op in ("argmax", "argmin"):
            if self.dtype != "int64":
                raise TypeError(f"{self.name}: {self.reduce_op} produces int64")
        elif self.dtype != self.body.dtype:
            raise TypeError(f"{self.name}: body dtype {self.body.dtype} != {self.dtype}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.extent for a in self.axes)

    @property
    def is_reduction(self) -> bool:
        return bool(self.reduce_axes)

    @property
    def is_injective(self) -> bool:
        return not self.reduce_axes

    @property
    def is_product(self) -> bool:
        """Whether it sums products of two values (a matrix product, a convolution)."""
        return self.reduce_op == "sum" and isinstance(self.body, Binary) and self.body.op == "mul"

    def loads(self) -> list[Load]:
        return list(self._loads)

    @cached_property
    def _loads(self) -> tuple[Load, ...]:
        # The tile search propagates regions through every candidate tile: walk the body once.
        return tuple(loads(self.body))

    @property
    def point_flops(self) -> int:
        """Arithmetic per output point: the body's operations once per reduction point, plus
        the reduction's own combine (the add of a multiply-add: a matmul of M x N x K is
        2*M*N*K flops, as peak rates count them).  An injective copy counts one."""
        ops = sum(1 for n in walk(self.body) if isinstance(n, (Binary, Call)) and n.dtype != INDEX)
        if not self.is_reduction:
            return max(1, ops)
        return (ops + 1) * math.prod(a.extent for a in self.reduce_axes)

    @property
    def flops(self) -> int:
        """Arithmetic of the whole tensor (:attr:`point_flops` per output point)."""
        return math.prod(self.shape) * self.point_flops

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        """Tensors read, in first-use order, without repeats."""
        return tuple(dict.fromkeys(ld.tensor for ld in self._loads))

    def renamed(self, name: str | None = None, inputs: dict[str, str] | None = None) -> Compute:
        """Copy with a new output name and/or input tensors renamed."""
        return Compute(
            name=self.name if name is None else name,
            axes=self.axes,
            body=rename_tensors(self.body, inputs or {}),
            dtype=self.dtype,
            reduce_axes=self.reduce_axes,
            reduce_op=self.reduce_op,
        )

    def __str__(self) -> str:
        lhs = format_tensor_name(self.name)
        out = ", ".join(f"{a.name}:{a.extent}" for a in self.axes)
        rhs = format_expr(self.body)
        if self.reduce_op is not None:
            red = ", ".join(f"{a.name}:{a.extent}" for a in self.reduce_axes)
            rhs = f"{self.reduce_op}[{red}] {rhs}"
        return f"{lhs}[{out}] = {rhs}"


def compute(
    name: str,
    shape: Sequence[int],
    fn: Callable[..., Expr | Reduce | int | float],
    dtype: str | None = None,
) -> Compute:
    """Build a Compute in the style of TVM's ``te.compute``.

    ``fn`` receives one index variable per output dimension and returns either a value
    expression or ``reduce(op, body, axes)`` over axes made with :func:`reduce_axis`.
    Axes are renamed to the canonical ``i*``/``r*`` names.
    """
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"{name}: negative extent in shape {shape}")
    tmp = [Var(f"_s{next(_fresh)}") for _ in shape]
    result = fn(*tmp)
    spatial_map = {v.name: Var(f"i{k}") for k, v in enumerate(tmp)}
    axes = tuple(Axis(f"i{k}", s) for k, s in enumerate(shape))
    if isinstance(result, Reduce):
        reduce_map = {a.name: Var(f"r{k}") for k, a in enumerate(result.axes)}
        raxes = tuple(Axis(f"r{k}", a.extent) for k, a in enumerate(result.axes))
        body = substitute(result.body, {**spatial_map, **reduce_map})
        op: str | None = result.op
        out_dtype = "int64" if op in ("argmax", "argmin") else body.dtype
    else:
        body = substitute(as_expr(result, dtype), spatial_map)
        raxes, op, out_dtype = (), None, body.dtype
    if dtype is not None and dtype != out_dtype:
        raise TypeError(f"{name}: body has dtype {out_dtype}, expected {dtype}")
    return Compute(name, axes, body, out_dtype, raxes, op)


def reduce_identity(op: str, dtype: str) -> int | float | bool:
    """The neutral element a reduction starts from."""
    if op == "sum":
        return 0
    if op == "prod":
        return 1
    if dtype == BOOL:
        return op == "min"
    if is_float(dtype):
        return float("-inf") if op in ("max", "argmax") else float("inf")
    info = np.iinfo(np.int64 if dtype == INDEX else dtype)
    return int(info.min) if op in ("max", "argmax") else int(info.max)
