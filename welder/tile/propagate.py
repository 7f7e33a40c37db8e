"""Tile propagation: from a tile of a node's output to the regions of its inputs, and
backwards through a whole fused group.

The group's *root* (its one sink) is tiled by the config; block ``b`` computes
``root[b0*T0 : b0*T0+T0, ...]``.  Every other member's region is the union of what its
consumers inside the group read, so an intermediate tile holds exactly what the block
needs (halos included) and no more.  Reduction axes are read whole unless a step counter
is given, which is how per-step staging buffers are sized.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from welder.ir.compute import Compute
from welder.ir.expr import Load
from welder.tile.region import Affine, Interval, bound, union

ShapeOf = Callable[[str], tuple[int, ...]]


@dataclass(frozen=True)
class Region:
    """A box in a tensor: one interval per dimension."""

    dims: tuple[Interval, ...]

    @functools.cached_property  # regions are immutable, and the tile search asks again and again
    def extents(self) -> tuple[int, ...]:
        return tuple(d.extent for d in self.dims)

    def clipped_extents(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(map(min, self.extents, shape))

    def at(self, env: Mapping[str, int]) -> tuple[tuple[int, int], ...]:
        return tuple(d.at(env) for d in self.dims)

    def __str__(self) -> str:
        return "(" + ", ".join(map(str, self.dims)) + ")"


def whole(shape: Sequence[int]) -> Region:
    return Region(tuple(Interval.full(s) for s in shape))


def union_regions(a: Region | None, b: Region, shape: Sequence[int]) -> Region:
    if a is None:
        return b
    dims = []
    for da, db, s in zip(a.dims, b.dims, shape):
        u = union(da, db)
        dims.append(Interval.full(s) if u is None else u)
    return Region(tuple(dims))


def block_vars(rank: int) -> list[str]:
    return [f"b{k}" for k in range(rank)]


def step_vars(rank: int) -> list[str]:
    return [f"k{k}" for k in range(rank)]


def root_region(tile: Sequence[int]) -> Region:
    """The root's tile for block (b0, b1, ...)."""
    return _root_region(tuple(tile))


@functools.lru_cache(maxsize=1 << 14)
def _root_region(tile: tuple[int, ...]) -> Region:
    # regions are immutable: the fusion search asks for the same few tiles a million times
    return Region(tuple(Interval(Affine.make({v: t}), t) for v, t in zip(block_vars(len(tile)), tile)))


def reduce_intervals(c: Compute, rstep: Sequence[int] | None) -> list[Interval]:
    """Whole reduce axes, or one step of ``rstep`` at counters ``k0, k1, ...``."""
    extents = tuple(a.extent for a in c.reduce_axes)
    return list(_reduce_intervals(extents, None if rstep is None else tuple(rstep)))


@functools.lru_cache(maxsize=1 << 14)
def _reduce_intervals(extents: tuple[int, ...], rstep: tuple[int, ...] | None) -> tuple[Interval, ...]:
    if rstep is None:
        return tuple(Interval.full(e) for e in extents)
    return tuple(
        Interval(Affine.make({v: r}), r) if r < e else Interval.full(e)
        for v, r, e in zip(step_vars(len(rstep)), rstep, extents)
    )


def read_regions(
    c: Compute, out: Sequence[Interval], shape_of: ShapeOf, rstep: Sequence[int] | None = None
) -> dict[str, Region]:
    """Region of every tensor ``c`` reads while computing the output box ``out``
    (with reduce axes whole, or one step of ``rstep``).

    Memoised by what the answer depends on (see ``_structure``), the shapes read, the box
    and the step: the tile search asks again for the same boxes of the same node (every
    candidate of every group holding it, the repeated layers' one signature), and bounding
    each index expression is most of a cold plan's own time."""
    if len(out) != len(c.axes):
        raise ValueError(f"{c.name}: {len(out)} intervals for {len(c.axes)} axes")
    if len(_READS) >= MEMO_LIMIT:
        _forget()
    shapes = tuple(shape_of(t) for t in c.inputs)
    key = (_structure(c), shapes, tuple(out), None if rstep is None else tuple(rstep))
    found = _READS.get(key)
    if found is None:
        found = _READS[key] = _read_regions(c, out, shape_of, rstep)
    return dict(found)


#: read_regions answers kept before the memo starts again (a model's cold plan asks for
#: some 40,000 distinct ones).
MEMO_LIMIT = 200_000

# What read_regions answers depend on, besides the shapes read: the axes' names, the reduce
# axes and the loads of a compute (not its arithmetic).  Groups build new computes for the
# same nodes (renamed to canonical names, say), so the memo goes by that structure, numbered
# once per compute object.
_STRUCTURES: dict[tuple, int] = {}
_STRUCTURE_OF: dict[int, tuple[weakref.ref, int]] = {}
_READS: dict[tuple, dict[str, Region]] = {}


def _structure(c: Compute) -> int:
    entry = _STRUCTURE_OF.get(id(c))
    if entry is not None and entry[0]() is c:
        return entry[1]
    loads = tuple((ld.tensor, ld.indices) for ld in c.loads())
    number = _STRUCTURES.setdefault((tuple(a.name for a in c.axes), c.reduce_axes, loads), len(_STRUCTURES))
    key = id(c)
    _STRUCTURE_OF[key] = (weakref.ref(c, lambda _: _STRUCTURE_OF.pop(key, None)), number)
    return number


def _forget() -> None:
    _READS.clear()
    _STRUCTURES.clear()
    _STRUCTURE_OF.clear()


def _read_regions(
    c: Compute, out: Sequence[Interval], shape_of: ShapeOf, rstep: Sequence[int] | None
) -> dict[str, Region]:
    env = {a.name: iv for a, iv in zip(c.axes, out)}
    env.update({a.name: iv for a, iv in zip(c.reduce_axes, reduce_intervals(c, rstep))})
    regions: dict[str, Region] = {}
    for ld in c.loads():
        regions[ld.tensor] = union_regions(
            regions.get(ld.tensor), load_region(ld, env, shape_of), shape_of(ld.tensor)
        )
    return regions


def load_region(ld: Load, env: Mapping[str, Interval], shape_of: ShapeOf) -> Region:
    shape = shape_of(ld.tensor)
    dims = []
    for idx, size in zip(ld.indices, shape):
        iv = bound(idx, env)
        dims.append(Interval.full(size) if iv is None else iv)
    return Region(tuple(dims))


@dataclass
class GroupRegions:
    """Per block: the region of every member's output and of every external input."""

    root: str
    tile: tuple[int, ...]
    members: dict[str, Region]
    inputs: dict[str, Region]


def propagate_group(
    members: Sequence[Compute], root: str, tile: Sequence[int], shape_of: ShapeOf
) -> GroupRegions:
    """Regions of all members and inputs for the root tiled by ``tile``.

    ``members`` must be in topological order and ``root`` must be the only member no
    other member reads."""
    by_name = {c.name: c for c in members}
    if root not in by_name:
        raise ValueError(f"root {root!r} is not a member")
    if len(tile) != len(by_name[root].axes):
        raise ValueError(f"tile {list(tile)} does not match the rank of {root!r}")
    regions: dict[str, Region] = {root: root_region(tile)}
    inputs: dict[str, Region] = {}
    for c in reversed(members):
        if c.name not in regions:
            raise ValueError(f"member {c.name!r} is not read by any later member; it cannot be in the group")
        for tensor, region in read_regions(c, regions[c.name].dims, shape_of).items():
            target = regions if tensor in by_name else inputs
            target[tensor] = union_regions(target.get(tensor), region, shape_of(tensor))
    return GroupRegions(root, tuple(tile), regions, inputs)


def partitions_output(region: Region, shape: Sequence[int], tile: Sequence[int], grid: Sequence[int]) -> bool:
    """True if the blocks' regions of a tensor tile it exactly: every element is written
    by exactly one block.  Group outputs other than the root must satisfy this, or two
    blocks would race (or nobody would write some elements)."""
    used: set[str] = set()
    for d, size in zip(region.dims, shape):
        aff = d.affine
        if aff is None or aff.const != 0 or len(aff.terms) > 1:
            return False
        if not aff.terms:
            if d.extent < size:
                return False
            continue
        ((var, coef),) = aff.terms
        if coef != d.extent or var in used:
            return False
        k = int(var[1:])
        if -(-size // d.extent) != grid[k]:
            return False
        used.add(var)
    # A block coordinate no dimension depends on means several blocks write the same box.
    return all(f"b{k}" in used or grid[k] == 1 for k in range(len(tile)))
