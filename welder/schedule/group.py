"""A fused group: a convex set of graph nodes with one sink that becomes one kernel.

``make_group`` checks that a set of nodes can be one kernel and works out its interface:
the external tensors it reads, the tensors it must write (read outside or graph outputs),
and its *stages* -- the members that own a tile: reductions, the root, and every other
member that must be written out.  Injective members that are neither are inlined into the
stages that read them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from welder.graph import Graph
from welder.ir.compute import Compute
from welder.ir.expr import TRANSCENDENTAL_CALLS, Call, Expr, walk
from welder.ir.inline import inline_compute, inline_expr
from welder.ir.window import reads_through_window


class InvalidGroup(ValueError):
    """The nodes cannot form one kernel (not convex, several sinks, ...)."""


@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]  # topological order
    root: str
    outputs: tuple[str, ...]  # written to global memory, topological order (root last)
    inputs: tuple[str, ...]  # read from global memory
    stages: tuple[str, ...]  # tile owners, topological order
    computes: dict[str, Compute]  # stage computes with inlined injective members

    @property
    def name(self) -> str:
        return self.root

    def __len__(self) -> int:
        return len(self.members)


def make_group(graph: Graph, names: Iterable[str]) -> Group:
    member_set = set(names)
    missing = member_set - graph.nodes.keys()
    if missing:
        raise InvalidGroup(f"not graph nodes: {sorted(missing)}")
    order = [graph.nodes[m] for m in sorted(member_set, key=graph.topo_rank)]
    sinks = [n.name for n in order if not any(c.name in member_set for c in graph.consumers(n.name))]
    if len(sinks) != 1:
        raise InvalidGroup(f"a group needs exactly one sink, got {sinks}")
    _check_convex(graph, member_set, order)
    root = sinks[0]
    outputs = [
        n.name
        for n in order
        if n.name == root
        or n.name in graph.outputs
        or any(c.name not in member_set for c in graph.consumers(n.name))
    ]
    inputs = list(dict.fromkeys(t for n in order for t in n.inputs if t not in member_set))
    stages = [n.name for n in order if n.compute.is_reduction or n.name in outputs]
    inlined = {n.name: n.compute for n in order if n.name not in stages}
    computes = {s: inline_compute(graph.nodes[s].compute, inlined) for s in stages}
    windowed = _recomputed_by_windows(graph, order, computes)
    if windowed:
        stages = sorted([*stages, *windowed], key=graph.topo_rank)
        inlined = {n.name: n.compute for n in order if n.name not in stages}
        computes = {s: inline_compute(graph.nodes[s].compute, inlined) for s in stages}
    return Group(tuple(n.name for n in order), root, tuple(outputs), tuple(inputs), tuple(stages), computes)


def _recomputed_by_windows(graph: Graph, order: Sequence, computes: dict[str, Compute]) -> list[str]:
    """Injective members that are stages too: those with a transcendental call (a sigmoid,
    an exponential) that a reduction reads through a window.  Inlined, such a member would be
    computed again at every tap for every output point (Conformer's GLU before its 31-tap
    depthwise convolution: 31 sigmoids an output); as a stage it is computed once per point
    of the block's tile and its halo, into shared memory.  The latest such member along a
    chain is taken: the members before it are read at its own points, not through the
    window."""
    chosen: list[str] = []
    reductions = [s for s, c in computes.items() if c.is_reduction and _calls_through_window(c)]
    if not reductions:
        return chosen
    injective = [n for n in order if n.name not in computes]
    for member in reversed(injective):
        others = {n.name: n.compute for n in injective if n.name != member.name and n.name not in chosen}
        if not _transcendental(inline_expr(member.compute.body, others)):
            continue
        for s in reductions:
            c = inline_compute(graph.nodes[s].compute, others)
            if any(ld.tensor == member.name and reads_through_window(ld, c) for ld in c.loads()):
                chosen.append(member.name)
                break
    return chosen


def _calls_through_window(c: Compute) -> bool:
    """Whether ``c`` has a transcendental call and reads something through a window."""
    return _transcendental(c.body) and any(reads_through_window(ld, c) for ld in c.loads())


def _transcendental(e: Expr) -> bool:
    return any(isinstance(n, Call) and n.fn in TRANSCENDENTAL_CALLS for n in walk(e))


def _check_convex(graph: Graph, members: set[str], order: list) -> None:
    """No path may leave the group and come back: that kernel would need its own output."""
    rank = graph.topo_rank
    last = max(rank(n.name) for n in order)
    frontier = [c.name for n in order for c in graph.consumers(n.name) if c.name not in members]
    seen: set[str] = set()
    while frontier:
        t = frontier.pop()
        if t in seen or rank(t) > last:
            continue
        seen.add(t)
        for c in graph.consumers(t):
            if c.name in members:
                raise InvalidGroup(
                    f"{t!r} lies on a path that leaves the group and re-enters it at {c.name!r}"
                )
            frontier.append(c.name)


def execution_order(groups: Sequence[Group]) -> list[int]:
    """Indices of ``groups`` in an order where every group follows the groups whose outputs it
    reads, as close to the given order as that allows.  (Ordering groups by their roots is not
    enough: a group's other outputs may be read before its root is computed.)"""
    producer = {t: k for k, g in enumerate(groups) for t in g.outputs}
    needs = [{producer[t] for t in g.inputs if t in producer} - {k} for k, g in enumerate(groups)]
    readers: list[list[int]] = [[] for _ in groups]
    for k, producers in enumerate(needs):
        for p in producers:
            readers[p].append(k)
    missing = [len(p) for p in needs]
    ready = [k for k, n in enumerate(missing) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for r in readers[k]:
            missing[r] -= 1
            if missing[r] == 0:
                heapq.heappush(ready, r)
    if len(order) < len(groups):
        cycle = [groups[k].root for k, n in enumerate(missing) if n > 0]
        raise ValueError(f"the groups depend on each other in a cycle: {cycle}")
    return order
