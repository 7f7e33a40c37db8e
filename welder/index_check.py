"""Checking model inputs used as indices on the host, before a run.

A generated kernel clamps a data-dependent index into its dimension (``welder_index`` in
codegen_templates/welder_math.cuh): memory stays safe, but a bad token id would quietly
read the last row of the embedding.  So before any back end runs, the integer inputs that
feed a :class:`~welder.ir.expr.DataIndex` are checked here, and a bad value raises
:class:`~welder.errors.IndexRangeError` naming the input, the node, the value and the range.

A site is checked when its index value is computed from model inputs and constants by
integer computes only (the input itself, a reshape or slice of it, ``ids + offset``, a
position range ...) and that upstream work is small; the value is then evaluated exactly as
the run would, with the reference interpreter, at every point the node uses.  An index
computed from float data (a Cast of activations, an ArgMax) is not checked here; the
interpreter and the emulator still report it, and GPU kernels clamp it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from welder.graph import Graph
from welder.ir.compute import Axis, Compute
from welder.ir.expr import DataIndex, free_vars, is_float, loads, walk
from welder.ir.interpret import data_index, evaluate

#: The most elements of upstream tensors (and index points) one site may evaluate.
CHECK_LIMIT = 1 << 22


@dataclass(frozen=True)
class IndexSite:
    """One data-dependent index that model inputs decide."""

    node: str  # the compute holding the index
    index: DataIndex
    axes: tuple[Axis, ...]  # the axes of that compute the index value depends on
    upstream: tuple[str, ...]  # computed tensors the value reads, in topological order
    inputs: tuple[str, ...]  # the model inputs it derives from

    def describe(self) -> str:
        names = ", ".join(repr(n) for n in self.inputs)
        word = "input" if len(self.inputs) == 1 else "inputs"
        return f"{word} {names} feed{'s' if len(self.inputs) == 1 else ''} {self.index.origin or self.node}"


def index_sites(graph: Graph, limit: int = CHECK_LIMIT) -> list[IndexSite]:
    """Every data-dependent index of ``graph`` whose value the host can compute from the
    model inputs cheaply (see the module docstring)."""
    nodes = graph.topo_order()
    order = {n.name: k for k, n in enumerate(nodes)}
    input_names = {t.name for t in graph.inputs}
    sites: list[IndexSite] = []
    seen: set[tuple[str, DataIndex]] = set()
    for node in nodes:
        c = node.compute
        for e in walk(c.body):
            if not isinstance(e, DataIndex) or (node.name, e) in seen:
                continue
            seen.add((node.name, e))
            found = _upstream(graph, e, input_names, limit)
            if found is None:
                continue
            upstream, inputs = found
            used = free_vars(e.value)
            axes = tuple(a for a in (*c.axes, *c.reduce_axes) if a.name in used)
            if int(np.prod([a.extent for a in axes], dtype=np.int64)) > limit:
                continue
            upstream = sorted(upstream, key=order.__getitem__)
            sites.append(IndexSite(node.name, e, axes, tuple(upstream), tuple(sorted(inputs))))
    return sites


def _upstream(
    graph: Graph, e: DataIndex, input_names: set[str], limit: int
) -> tuple[set[str], set[str]] | None:
    """(computed tensors, model inputs) the value of ``e`` depends on, or None when it
    depends on no input, on float data or on too much work."""
    computed: set[str] = set()
    inputs: set[str] = set()
    todo = [ld.tensor for ld in loads(e.value)]
    size = 0
    while todo:
        t = todo.pop()
        if t in computed or t in inputs:
            continue
        if t in input_names:
            inputs.add(t)
            continue
        producer = graph.producer(t)
        if producer is None:
            continue  # a constant
        c = producer.compute
        if is_float(c.dtype):
            return None
        size += int(np.prod(c.shape, dtype=np.int64))
        if size > limit:
            return None
        computed.add(t)
        todo.extend(c.inputs)
    return (computed, inputs) if inputs else None


def check_index_inputs(graph: Graph, sites: list[IndexSite], feeds: Mapping[str, np.ndarray]) -> None:
    """Raises IndexRangeError if ``feeds`` give any site an index outside its dimension."""
    env: dict[str, np.ndarray] = {**graph.constants, **feeds}
    for site in sites:
        for t in site.upstream:
            if t not in env:
                env[t] = evaluate(graph.producer(t).compute, env)  # type: ignore[union-attr]
        value = site.index.value
        probe = Compute("index", site.axes, value, value.dtype)
        data_index(evaluate(probe, env), site.index.extent, site.describe())
