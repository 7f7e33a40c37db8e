"""What the tuner checks a candidate's outputs against: the reference interpreter's values of
its group, whole -- or, for a group too large to interpret in full at every tune, on sampled
rows.

A NeRF layer at 2M points or a batch-64 convolution has outputs of hundreds of millions of
elements; interpreting such a group in numpy took tens of seconds, every group of every tune.
Where each member of the group computes row ``r`` of its first axis from row ``r`` of the
group's other members alone (a batch or point axis: every read of another member indexes
it by the member's own first index), the rows are independent, and three ranges of them --
the first, a seeded middle one and the last (a ragged last tile lies there) -- are
interpreted instead: about :data:`SAMPLE_ELEMENTS` per output each.  The candidate's whole
output is still computed on the GPU; only those rows are compared.  A group whose rows are
not independent (attention across a sequence, a transpose, a reduction over rows) is
interpreted whole, whatever its size.  The runtime's final check (``test_acc``, ``welder
check``) compares every element of the model's outputs with onnxruntime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from welder.graph import Graph
from welder.ir.expr import Var
from welder.ir.interpret import evaluate, np_dtype
from welder.schedule.group import Group

#: Groups whose outputs hold more elements than this are checked on sampled rows where their
#: rows are independent.  At 16M, the 120 groups of mobilevit_s at batch 64 in fp16 took 67 s
#: to interpret on two cores (a depthwise convolution of 16.8M elements alone 7 s); at 1M, 37
#: s, most of it the attention groups, whose rows are not independent.
SAMPLED_ABOVE = 1 << 20
#: Elements of one output per sampled range of rows.
SAMPLE_ELEMENTS = 1 << 18


@dataclass
class Reference:
    """The reference values of a group's outputs: whole arrays (``rows`` None), or the
    outputs' values on the ranges ``rows`` of their first axis, one after another.  The
    tuner asks the device for the same rows of a candidate's outputs (``Device.run``'s
    ``rows``): a batch-64 output is tens of megabytes to bring back, its sample one."""

    values: dict[str, np.ndarray]
    rows: tuple[tuple[int, int], ...] | None = None


def select_rows(array: np.ndarray, rows: Sequence[tuple[int, int]] | None) -> np.ndarray:
    """``array``'s ranges ``rows`` of its first axis, one after another (whole if None)."""
    if rows is None:
        return array
    return np.concatenate([array[a:b] for a, b in rows])


def reference(graph: Graph, group: Group, feeds: Mapping[str, np.ndarray], seed: int = 0) -> Reference:
    """The group's outputs by the reference interpreter, on sampled rows where the group is
    large and its rows independent (see the module docstring), else whole."""
    elements = sum(int(np.prod(graph.tensor(o).shape, dtype=np.int64)) for o in group.outputs)
    if elements <= SAMPLED_ABOVE or not independent_rows(graph, group):
        return Reference(whole_outputs(graph, group, feeds))
    extent = graph.tensor(group.outputs[0]).shape[0]
    row_elements = max(1, elements // len(group.outputs) // extent)
    ranges = sample_ranges(extent, max(1, SAMPLE_ELEMENTS // row_elements), seed)
    env = dict(feeds)
    for m in group.members:
        c = graph.nodes[m].compute
        full = np.zeros(c.shape, np_dtype(c.dtype))  # untouched rows stay unallocated
        for a, b in ranges:
            full[a:b] = evaluate(c, env, rows=(a, b))
        env[m] = full
    return Reference({o: select_rows(env[o], ranges) for o in group.outputs}, tuple(ranges))


def whole_outputs(graph: Graph, group: Group, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The group's outputs by the reference interpreter, member by member."""
    env = dict(feeds)
    for m in group.members:
        env[m] = evaluate(graph.nodes[m].compute, env)
    return {o: env[o] for o in group.outputs}


def independent_rows(graph: Graph, group: Group) -> bool:
    """Whether every member has the same first axis, of more than one index, and reads the
    other members only at its own index along it."""
    members = set(group.members)
    computes = [graph.nodes[m].compute for m in group.members]
    if len({c.shape[0] if c.shape else 0 for c in computes}) != 1 or not computes[0].shape:
        return False
    if computes[0].shape[0] < 2:
        return False
    for c in computes:
        for ld in c.loads():
            if ld.tensor in members and not (isinstance(ld.indices[0], Var) and ld.indices[0].name == "i0"):
                return False
    return True


def sample_ranges(extent: int, rows: int, seed: int) -> list[tuple[int, int]]:
    """The first ``rows`` indices of ``extent``, ``rows`` from a seeded point in between and
    the last ``rows``, merged where they overlap."""
    middle = int(np.random.default_rng(seed).integers(0, max(1, extent - rows)))
    ranges = sorted((max(0, a), min(extent, a + rows)) for a in (0, middle, extent - rows))
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged
