"""Reshapes read as views of a product (welder/ir/layout.py): which reshapes split axes, how
a view's index follows from the product's, and whether a load reads the element at the
same flat position -- each checked against numpy over every element."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from welder.ir.compute import Axis
from welder.ir.expr import Const, Load, Var, binary
from welder.ir.layout import reads_own_flat_point, split_axes

#: (product shape, view shape): views that split axes of the product (axes of one element
#: anywhere), then reshapes that merge or regroup axes.
SPLITS = [
    ((1, 8, 12), (1, 8, 3, 4)),
    ((2, 6, 20), (2, 6, 4, 5)),
    ((2, 6, 20), (2, 1, 6, 2, 2, 5)),
    ((24,), (2, 3, 4)),
    ((1, 5, 1), (5,)),
    ((3, 4), (3, 4)),
]
NOT_SPLITS = [((4, 6), (24,)), ((4, 6), (6, 4)), ((2, 12), (2, 6, 3)), ((6, 4), (2, 12)), ((4,), (8,))]


@pytest.mark.parametrize(("shape", "view"), SPLITS)
def test_a_split_view_indexes_the_product_as_numpy_reshapes_it(shape, view) -> None:
    parts = split_axes(shape, view)
    assert parts is not None and len(parts) == len(view)
    for flat in range(int(np.prod(shape))):
        own = np.unravel_index(flat, shape)
        expected = np.unravel_index(flat, view)
        got = []
        for part in parts:
            if part.source is None:
                got.append(0)
                continue
            i = int(own[part.source]) // part.inner
            got.append(i if part.outermost else i % part.extent)
        assert tuple(got) == tuple(int(e) for e in expected), (flat, parts)


@pytest.mark.parametrize(("shape", "view"), NOT_SPLITS)
def test_a_reshape_that_merges_or_regroups_axes_is_no_split(shape, view) -> None:
    assert split_axes(shape, view) is None


def _flat_positions(load: Load, shape, axes) -> np.ndarray:
    """The flat position ``load`` reads at every point of ``axes`` (brute force), -1 where
    an index leaves its dimension."""
    out = []
    for point in itertools.product(*(range(a.extent) for a in axes)):
        env = {a.name: v for a, v in zip(axes, point)}
        index = [_value(i, env) for i in load.indices]
        out.append(
            int(np.ravel_multi_index(index, shape)) if all(0 <= i < e for i, e in zip(index, shape)) else -1
        )
    return np.array(out)


def _value(e, env) -> int:
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        return int(e.value)
    a, b = _value(e.a, env), _value(e.b, env)
    ops = {"add": int.__add__, "sub": int.__sub__, "mul": int.__mul__, "floordiv": int.__floordiv__}
    return ops[e.op](a, b)


i0, i1, i2, i3 = (Var(f"i{d}") for d in range(4))


def _load(indices) -> Load:
    return Load("p", tuple(indices), "float32")


def _axes(*extents: int) -> tuple[Axis, ...]:
    return tuple(Axis(f"i{d}", e) for d, e in enumerate(extents))


#: (a load of a tensor of this shape, the point's axes, row-major, whether it reads the
#: point's own flat position): a product read by its consumer in the conv's image form, the
#: same with the batch axis of one element read as 0, then a shifted read, swapped axes, a
#: read along another axis, a floor division that lands on the same point and one that does not.
LOADS = [
    (_load((i0, i1, binary("add", binary("mul", i2, 4), i3))), (2, 3, 12), _axes(2, 3, 3, 4), True),
    (_load((Const(0), i1, binary("add", binary("mul", i2, 4), i3))), (1, 3, 12), _axes(1, 3, 3, 4), True),
    (_load((i0, binary("add", i1, 1))), (2, 4), _axes(2, 3), False),
    (_load((i1, i0)), (3, 3), _axes(3, 3), False),
    (_load((i0, i0)), (3, 3), _axes(3, 3), False),
    (_load((i0, binary("floordiv", binary("add", binary("mul", i1, 2), 1), 2))), (2, 4), _axes(2, 4), True),
    (_load((i0, binary("floordiv", i1, 2))), (2, 4), _axes(2, 4), False),
]


@pytest.mark.parametrize(("load", "shape", "axes", "own_point"), LOADS)
def test_a_read_at_the_own_flat_point_is_recognised_as_brute_force_says(load, shape, axes, own_point) -> None:
    own = np.arange(int(np.prod([a.extent for a in axes])))
    same = np.array_equal(_flat_positions(load, shape, axes), own)
    assert same == own_point  # the table's claim, checked by brute force
    assert reads_own_flat_point(load, shape, axes) == same
