"""Which computes are views: copies that do not move data.

A reshape (and squeeze, unsqueeze, flatten, identity) of a row-major tensor leaves every
element at the same flat offset, so the runtime can let its output share the input's memory
instead of launching a copy kernel.  The decision must be exact -- a false positive silently
permutes data -- so :func:`is_view` proves the flat-index identity for every output point
rather than matching operator names or sampling points.

The proof stays cheap by splitting the output axes into independent components: axes that
appear together in some input index expression.  The difference between the input's flat
offset and the output's is then a sum of one function per component, and it is zero
everywhere exactly when each of those functions is constant and their total at the origin
is zero -- which needs each component evaluated over its own box only (for a
``[B, S, 768] -> [B, S, 12, 64]`` reshape: 768 points, not B * S * 768).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from welder.ir.compute import Axis, Compute
from welder.ir.expr import (
    INDEX,
    Binary,
    Const,
    Expr,
    Load,
    Select,
    Var,
    free_vars,
    row_major_offset,
    substitute,
    walk,
)
from welder.ir.interpret import evaluate


def is_view(compute: Compute, input_shape: Sequence[int]) -> bool:
    """Whether ``compute`` copies its one input unchanged in row-major order.

    True when the compute is injective, its body is a plain load (no cast, no select) of a
    tensor of the same dtype and element count whose shape is ``input_shape``, every index
    is data-independent and stays inside its dimension, and for every output point the
    input's flat offset equals the output's.  Its output may then alias the input's memory.
    """
    body = compute.body
    if compute.is_reduction or not isinstance(body, Load) or body.dtype != compute.dtype:
        return False
    return _keeps_offsets(compute.axes, body.indices, tuple(int(s) for s in input_shape))


@functools.lru_cache(maxsize=4096)
def _keeps_offsets(axes: tuple[Axis, ...], indices: tuple[Expr, ...], shape: tuple[int, ...]) -> bool:
    """:func:`is_view`'s proof for a load at ``indices`` over ``axes`` from a tensor of
    ``shape``.  Remembered: a model's repeated layers reshape alike, and a component of a
    batch-64 reshape can span millions of points (seconds of a runtime's emission)."""
    out_shape = tuple(a.extent for a in axes)
    if len(indices) != len(shape) or math.prod(shape) != math.prod(out_shape):
        return False
    if math.prod(shape) == 0:
        return True
    if any(isinstance(e, Load) for index in indices for e in walk(index)):
        return False
    output_offset = row_major_offset([a.var for a in axes], out_shape)
    diff = row_major_offset(indices, shape) - output_offset
    components = _components(axes, indices)
    origin = {a.name: Const(0) for a in axes}
    if int(_evaluate(substitute(diff, origin), ())) != 0:
        return False
    # A permutation (a transpose of a batch-64 activation: one component of 9M points,
    # 3 s to evaluate) shows a non-zero difference within each axis' first few points;
    # only a proof of the identity needs every point.
    corner = tuple(Axis(a.name, min(a.extent, 3)) for a in axes)
    if np.any(_evaluate(diff, corner) != 0):
        return False
    for group in components:
        others = {name: zero for name, zero in origin.items() if name not in {a.name for a in group}}
        values = _evaluate(substitute(diff, others), group)
        if np.any(values != 0):
            return False
    return _indices_in_range(indices, shape, components, origin)


def aliased_input(compute: Compute, shape_of: Callable[[str], Sequence[int]]) -> str | None:
    """The tensor whose memory ``compute``'s output may share (see :func:`is_view`), or None
    where it must be computed; ``shape_of`` gives a tensor's shape by name."""
    body = compute.body
    if isinstance(body, Load) and is_view(compute, shape_of(body.tensor)):
        return body.tensor
    return None


def _components(axes: Sequence[Axis], indices: Sequence[Expr]) -> list[tuple[Axis, ...]]:
    """The output axes grouped so that no index expression uses axes of two groups."""
    parent = {a.name: a.name for a in axes}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for index in indices:
        names = sorted(free_vars(index))
        for other in names[1:]:
            parent[find(other)] = find(names[0])
    groups: dict[str, list[Axis]] = {}
    for a in axes:
        groups.setdefault(find(a.name), []).append(a)
    return [tuple(g) for g in groups.values()]


def _indices_in_range(
    indices: Sequence[Expr],
    shape: Sequence[int],
    components: Sequence[tuple[Axis, ...]],
    origin: dict[str, Expr],
) -> bool:
    """Every index stays inside its dimension.  Each index depends on the axes of one
    component only (or none), so its range over that component's box is its full range."""
    for index, extent in zip(indices, shape):
        used = free_vars(index)
        axes = next((c for c in components if used & {a.name for a in c}), ())
        values = _evaluate(substitute(index, {n: z for n, z in origin.items() if n not in used}), axes)
        if np.any(values < 0) or np.any(values >= extent):
            return False
    return True


def _evaluate(expr: Expr, axes: Sequence[Axis]) -> np.ndarray:
    """``expr`` at every point of the box spanned by ``axes`` (exact int64 arithmetic)."""
    return np.asarray(evaluate(Compute("view_check", tuple(axes), expr, INDEX), {}))


@dataclass(frozen=True)
class Slab:
    """Where one input of a concatenation lies in the concatenation's memory: from element
    ``offset`` of it, at the row-major strides of ``storage`` -- the input's shape with the
    concatenation's extent along the axis.  Where every dimension before the axis is 1 the
    input is one contiguous run (``strided`` False) and its own strides address it too;
    otherwise each index before the axis steps over the other inputs' runs."""

    tensor: str
    offset: int
    storage: tuple[int, ...]
    axis: int
    strided: bool


def concat_slabs(compute: Compute, shape_of: Callable[[str], Sequence[int]]) -> list[Slab] | None:
    """Where each input of ``compute`` lies in its memory, if ``compute`` is a concatenation
    that copies each input whole; None where it is no such thing.

    A concatenation along an axis lays each input out in its memory at the input's own
    strides but for the dimensions before the axis, which step over the whole: the producers
    of the inputs may write straight into the output and nothing needs launching.  Along an
    axis before which every dimension is 1 (a batch of one along channels; any
    concatenation along the first axis) each input is a contiguous run.  Proved as
    :func:`is_view` proves a reshape: the body must be a tree of selects on the one axis
    against constants (the frontend's Concat), each leaf a load that copies its whole input
    in row-major order over its range of that axis."""
    if compute.is_reduction:
        return None
    extents = [a.extent for a in compute.axes]
    leaves: list[tuple[Load, int, int]] = []
    axis_name: list[str] = []

    def collect(e: Expr, lo: int, hi: int) -> bool:
        if isinstance(e, Load):
            leaves.append((e, lo, hi))
            return e.dtype == compute.dtype and lo < hi
        if not isinstance(e, Select):
            return False
        cond = e.cond
        if not (
            isinstance(cond, Binary)
            and cond.op == "lt"
            and isinstance(cond.a, Var)
            and isinstance(cond.b, Const)
            and cond.a.name == (axis_name or [cond.a.name])[0]
        ):
            return False
        axis_name[:] = [cond.a.name]
        cut = int(cond.b.value)
        return collect(e.a, lo, min(hi, cut)) and collect(e.b, max(lo, cut), hi)

    names = [a.name for a in compute.axes]
    if not isinstance(compute.body, Select) or not collect(compute.body, 0, 1 << 62) or not axis_name:
        return None
    axis = names.index(axis_name[0])
    inner = math.prod(extents[axis + 1 :])
    strided = math.prod(extents[:axis]) != 1
    slabs = []
    covered = 0
    for load, lo, hi in sorted(leaves, key=lambda leaf: leaf[1]):
        hi = min(hi, extents[axis])
        if lo != covered or hi <= lo:
            return None
        covered = hi
        shifted = _shifted(load.indices, axis_name[0], lo)
        axes = tuple(Axis(a.name, hi - lo) if k == axis else a for k, a in enumerate(compute.axes))
        shape = tuple(int(s) for s in shape_of(load.tensor))
        if not _keeps_offsets(axes, shifted, shape):
            return None
        if strided and shape != tuple(a.extent for a in axes):
            return None  # the strides address the input by the output's dimensions
        storage = tuple(extents[axis] if k == axis else a.extent for k, a in enumerate(axes))
        slabs.append(Slab(load.tensor, lo * inner, storage, axis, strided))
    if covered != extents[axis] or len({s.tensor for s in slabs}) != len(slabs):
        return None
    return slabs


def _shifted(indices: Sequence[Expr], name: str, shift: int) -> tuple[Expr, ...]:
    """``indices`` with axis ``name`` replaced by ``name + shift``."""
    moved = {name: Var(name) + Const(shift)} if shift else {}
    return tuple(substitute(i, moved) for i in indices)
