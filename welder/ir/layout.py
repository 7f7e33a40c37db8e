"""Proving that a load reads memory at an affine offset of the axes.

A product that a matrix unit or a library computes needs each operand as ``offset +
sum(stride * axis)`` over the axes of the compute: :func:`affine_layout` proves that exactly
by evaluating the load's index expressions over each group of axes that share one (so the
proof costs the boxes of those groups, not of all axes together), and gives the strides.
``--skip-dot`` (cuBLAS) and the tensor-core kind both read operands this way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from welder.ir.compute import Axis, Compute
from welder.ir.expr import INDEX, Expr, Load, free_vars, walk
from welder.ir.interpret import evaluate

#: Largest box of axes evaluated to prove an operand's addressing affine; beyond it the
#: proof gives up (a product then stays a generated SIMT kernel rather than costing a long proof).
MAX_PROOF_POINTS = 1 << 22


def affine_layout(
    load: Load, shape: Sequence[int], axes: Sequence[Axis]
) -> tuple[int, dict[str, int]] | None:
    """(offset, stride per axis) with ``flat(load) = offset + sum(stride[a] * a)`` at every
    point of the axes, every index inside its dimension; None if the load is not that.

    Each index expression uses the axes of one component (axes that appear together); the
    flat offset is then a sum of one function per component, affine exactly when each is,
    so evaluating every component over its own box proves it.  Memoised by the index
    expressions, shape and axes alone: the tile search asks again for every candidate of a
    product, and the repeated layers of a model ask the same question of other tensors."""
    found = _affine_layout(tuple(load.indices), tuple(shape), tuple(axes))
    return None if found is None else (found[0], dict(found[1]))


@functools.lru_cache(maxsize=4096)
def _affine_layout(
    indices: tuple[Expr, ...], shape: tuple[int, ...], axes: tuple[Axis, ...]
) -> tuple[int, dict[str, int]] | None:
    if any(isinstance(e, Load) for i in indices for e in walk(i)):
        return None
    components = _components(axes, indices)
    if any(math.prod(a.extent for a in comp) > MAX_PROOF_POINTS for comp in components):
        return None
    values = [_index_values(index, components) for index in indices]
    if any(np.any(v < 0) or np.any(v >= extent) for v, extent in zip(values, shape)):
        return None
    strides = row_major_strides(shape)
    at_origin = [int(v.reshape(-1)[0]) for v in values]
    offset = sum(s * v for s, v in zip(strides, at_origin))
    per_axis: dict[str, int] = {a.name: 0 for a in axes}
    for comp in components:
        names = {a.name for a in comp}
        flat = offset + sum(
            s * (v - o)
            for s, v, o, index in zip(strides, values, at_origin, indices)
            if free_vars(index) & names
        )
        found = affine_strides(np.asarray(flat), comp, offset)
        if found is None:
            return None
        per_axis.update(found)
    return offset, per_axis


def _components(axes: Sequence[Axis], indices: Sequence[Expr]) -> list[tuple[Axis, ...]]:
    """The axes grouped so that no index expression uses axes of two groups."""
    group = {a.name: k for k, a in enumerate(axes)}
    for index in indices:
        used = sorted({group[n] for n in free_vars(index)})
        for g in used[1:]:
            group = {n: used[0] if k == g else k for n, k in group.items()}
    by_group: dict[int, list[Axis]] = {}
    for a in axes:
        by_group.setdefault(group[a.name], []).append(a)
    return [tuple(g) for g in by_group.values()]


def _index_values(index: Expr, components: Sequence[tuple[Axis, ...]]) -> np.ndarray:
    """``index`` over the box of the component whose axes it uses (a scalar if none)."""
    used = free_vars(index)
    comp = next((c for c in components if used & {a.name for a in c}), ())
    return np.asarray(evaluate(Compute("gemm_layout", tuple(comp), index, INDEX), {}), dtype=np.int64)


def affine_strides(flat: np.ndarray, comp: tuple[Axis, ...], offset: int) -> dict[str, int] | None:
    """Stride per axis of ``comp`` if ``flat`` (over the component's box) is
    ``offset + sum(stride * axis)``."""
    if flat.ndim == 0:
        flat = np.broadcast_to(flat, tuple(a.extent for a in comp))
    strides = {}
    predicted = np.full(flat.shape, offset, dtype=np.int64)
    for k, a in enumerate(comp):
        unit = tuple(1 if j == k and a.extent > 1 else 0 for j in range(len(comp)))
        stride = int(flat[unit]) - offset
        strides[a.name] = stride
        shape = [1] * len(comp)
        shape[k] = a.extent
        predicted = predicted + stride * np.arange(a.extent, dtype=np.int64).reshape(shape)
    return strides if np.array_equal(flat, predicted) else None


def row_major_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return strides[::-1]


@dataclass(frozen=True)
class SplitAxis:
    """Where axis ``j`` of a view of a tensor (:func:`split_axes`) reads the tensor: index
    ``i // inner % extent`` of the tensor's axis ``source`` (``i``: the tensor's index along
    it), or index 0 where ``source`` is None (an axis of one element)."""

    source: int | None
    inner: int
    extent: int
    outermost: bool  # the source axis' highest digit: no ``% extent`` needed


def split_axes(shape: Sequence[int], view: Sequence[int]) -> list[SplitAxis] | None:
    """How ``view``, a row-major reshape of ``shape`` that splits axes of it into several
    (``[N, C, H * W]`` as ``[N, C, H, W]``) and merges none, indexes ``shape``: one
    :class:`SplitAxis` per axis of ``view``.  None where ``view`` is not such a reshape (it
    merges axes or holds another number of elements).  Axes of one element may appear or
    vanish anywhere."""
    found: list[SplitAxis] = []
    j = 0
    for d, extent in enumerate(shape):
        if extent == 1:
            continue
        run: list[int] = []
        size = 1
        while size < extent:
            while j < len(view) and view[j] == 1:
                found.append(SplitAxis(None, 1, 1, True))
                j += 1
            if j == len(view):
                return None
            run.append(j)
            size *= view[j]
            j += 1
        if size != extent:
            return None
        inner = extent
        for pos, k in enumerate(run):
            inner //= view[k]
            found.append(SplitAxis(d, inner, view[k], pos == 0))
    if any(e != 1 for e in view[j:]):
        return None
    found += [SplitAxis(None, 1, 1, True) for _ in view[j:]]
    return found


@functools.lru_cache(maxsize=4096)
def reads_own_flat_point(load: Load, shape: tuple[int, ...], axes: tuple[Axis, ...]) -> bool:
    """Whether ``load`` reads its tensor (row-major, of ``shape``) at the flat position that
    the point of ``axes`` (row-major) has in its own space: the same element where one
    tensor is a reshape of the other.  Proved by :func:`affine_layout` (offset 0, each axis
    of more than one element at its row-major stride); cached, as the tensor-core policy
    asks once per config."""
    found = affine_layout(load, shape, axes)
    if found is None:
        return False
    offset, strides = found
    own = row_major_strides([a.extent for a in axes])
    return offset == 0 and all(strides[a.name] == s for a, s in zip(axes, own) if a.extent > 1)
