"""Where every tensor of a model lives while the standalone runtime runs it.

Graph inputs and outputs live in the caller's buffers; weights in one device block loaded
at start-up; every intermediate in one device pool whose offsets come from a best-fit plan
over tensor lifetimes (``welder.tile.footprint.plan_pool``), so tensors that are never
alive at the same time share bytes.  Views own no memory: they resolve to the tensor they
alias.  A view that is a graph output takes the caller's output buffer for the tensor it
aliases (the producing kernel writes there directly); outputs that are inputs, constants or
already another output's buffer are copied at the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from welder.graph import Graph
from welder.tile.footprint import Buffer, plan_pool

#: Alignment of every buffer in the pool and the weight block: what cudaMalloc guarantees,
#: so vectorised loads behave the same on a pool tensor as on a caller's buffer.
ALIGNMENT = 256


class Place(Enum):
    """The memory a tensor lives in."""

    INPUT = "input"  # the caller's input buffer number `index`
    OUTPUT = "output"  # the caller's output buffer number `index`
    WEIGHT = "weight"  # `offset` bytes into the weight block
    POOL = "pool"  # `offset` bytes into the intermediate pool


@dataclass(frozen=True)
class Storage:
    place: Place
    index: int = 0
    offset: int = 0


@dataclass(frozen=True)
class KernelIO:
    """The tensors one launched kernel reads and writes, in launch order."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]


@dataclass(frozen=True)
class OutputCopy:
    """Graph output ``output`` is filled by a device-to-device copy from ``source``."""

    output: int
    source: Storage
    nbytes: int


@dataclass
class MemoryPlan:
    storage: dict[str, Storage]  # every tensor a kernel or an output touches, views included
    pool_bytes: int
    weights: dict[str, int] = field(default_factory=dict)  # constant -> offset in the block
    weight_bytes: int = 0
    copies: list[OutputCopy] = field(default_factory=list)
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)  # pool tensor -> steps

    def __getitem__(self, tensor: str) -> Storage:
        return self.storage[tensor]


def plan_memory(
    graph: Graph,
    kernels: Sequence[KernelIO],
    views: Mapping[str, str],
    align: int = ALIGNMENT,
    slabs: Mapping[str, tuple[str, int]] | None = None,
) -> MemoryPlan:
    """Storage for every tensor the ``kernels`` (in launch order) and the graph outputs use.

    ``views`` maps a view tensor to the tensor it aliases (possibly another view).
    ``slabs`` maps an input of a concatenation that is not launched to the concatenation
    and the byte offset of its run there (``welder.ir.views.concat_slabs``): the input's
    producer writes into the concatenation's memory, which lives from the first such write
    to its last reader.  No graph output may resolve into a slab; the concatenation itself,
    or a view of it, may be one.
    """
    slabs = slabs or {}
    produced = {t: step for step, k in enumerate(kernels) for t in k.writes}
    parts: dict[str, list[str]] = {}
    for part, (whole, _) in slabs.items():
        if part not in produced:
            raise ValueError(f"{part!r} is laid into {whole!r} but no kernel writes it")
        parts.setdefault(whole, []).append(part)

    def resolve(tensor: str) -> tuple[str, int]:
        """The tensor owning ``tensor``'s memory, and the byte offset of ``tensor`` in it."""
        seen, offset = set(), 0
        while tensor in views or tensor in slabs:
            if tensor in seen:
                raise ValueError(f"views form a cycle through {tensor!r}")
            seen.add(tensor)
            if tensor in views:
                tensor = views[tensor]
            else:
                tensor, at = slabs[tensor]
                offset += at
        return tensor, offset

    def root(tensor: str) -> str:
        return resolve(tensor)[0]

    def written(tensor: str) -> int:
        """The launch after which ``tensor`` (a kernel's, a view of one, or a concatenation
        laid out in place) holds all its values."""
        while tensor in views:
            tensor = views[tensor]
        return produced[tensor] if tensor in produced else max(written(p) for p in parts[tensor])

    storage: dict[str, Storage] = {t.name: Storage(Place.INPUT, i) for i, t in enumerate(graph.inputs)}
    needed = {root(t) for k in kernels for t in k.reads} | {root(o) for o in graph.outputs}
    used_constants = [c for c in graph.constants if c in needed]
    weights, weight_bytes = _pack([(c, graph.tensor(c).nbytes) for c in used_constants], align)
    storage.update({c: Storage(Place.WEIGHT, offset=o) for c, o in weights.items()})

    first_write: dict[str, int] = {}  # owner -> the first launch writing into it
    last_use: dict[str, int] = {}  # owner -> the last launch writing or reading it
    for t, step in produced.items():
        owner = root(t)
        first_write[owner] = min(first_write.get(owner, step), step)
        last_use[owner] = max(last_use.get(owner, step), step)
    copies = []
    for j, name in enumerate(graph.outputs):
        source, offset = resolve(name)
        if offset or graph.tensor(source).nbytes != graph.tensor(name).nbytes:
            raise ValueError(f"graph output {name!r} lies inside {source!r}, laid out in place")
        if source in first_write and source not in storage:
            storage[source] = Storage(Place.OUTPUT, j)
        else:
            if source not in storage:
                raise ValueError(f"graph output {name!r} is neither computed, an input nor a constant")
            copies.append(OutputCopy(j, storage[source], graph.tensor(name).nbytes))

    for step, k in enumerate(kernels):
        for t in k.reads:
            r = root(t)
            if r not in first_write and r not in storage:
                raise ValueError(f"kernel {step} reads {t!r}, which nothing before it provides")
            if r in first_write and written(t) >= step:
                raise ValueError(f"kernel {step} reads {t!r} before kernel {written(t)} writes it")
            last_use[r] = max(last_use.get(r, step), step)
    buffers = [
        Buffer(t, max(graph.tensor(t).nbytes, 1), step, last_use[t])
        for t, step in first_write.items()
        if t not in storage
    ]
    offsets, pool_bytes = plan_pool(buffers, align)
    storage.update({t: Storage(Place.POOL, offset=o) for t, o in offsets.items()})
    for tensor in [*views, *slabs]:
        owner, offset = resolve(tensor)
        if owner in storage:  # a view nothing reads needs no storage
            at = storage[owner]
            storage[tensor] = Storage(at.place, at.index, at.offset + offset)
    return MemoryPlan(
        storage,
        pool_bytes,
        weights,
        weight_bytes,
        copies,
        {b.name: (b.start, b.end) for b in buffers},
    )


def _pack(items: Sequence[tuple[str, int]], align: int) -> tuple[dict[str, int], int]:
    """Consecutive aligned offsets for buffers that all live for the whole run."""
    offsets, top = {}, 0
    for name, nbytes in items:
        offsets[name] = top
        top += -(-max(nbytes, 1) // align) * align
    return offsets, top
