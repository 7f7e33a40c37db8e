"""Memory footprints and the traffic model.

Global memory is read in sectors (32 bytes on every GPU we target), so the cost of a
region is not its size but the sectors its rows touch: a tile whose innermost extent is 4
floats costs a whole sector per row.  Contiguity is counted from the innermost dimension
outwards: dimensions the region covers completely merge into one longer run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def contiguous_run(extents: Sequence[int], shape: Sequence[int]) -> tuple[int, int]:
    """(elements per contiguous run, number of runs) of a box ``extents`` in a row-major
    tensor of ``shape``."""
    run, k = 1, len(shape) - 1
    while k >= 0:
        run *= extents[k]
        if extents[k] < shape[k]:
            k -= 1
            break
        k -= 1
    rows = 1
    for e in extents[: k + 1]:
        rows *= e
    return run, rows


def transaction_bytes(extents: Sequence[int], shape: Sequence[int], elem_bytes: int, transaction: int) -> int:
    """Bytes moved to read or write box ``extents`` of a tensor, rounded to transactions.

    The box's origin is taken as aligned.  Runs after the first start wherever the row
    stride puts them, so unless that stride is a whole number of transactions each run is
    charged for the worst alignment it can have."""
    extents = [min(e, s) for e, s in zip(extents, shape)]
    if any(e == 0 for e in extents):
        return 0
    if not shape:
        return transaction
    run, rows = contiguous_run(extents, shape)
    run_bytes = run * elem_bytes
    stride_bytes = elem_bytes * math.prod(shape[len(shape) - _run_dims(extents, shape) :])
    if rows == 1 or stride_bytes % transaction == 0:
        sectors = -(-run_bytes // transaction)
    else:
        sectors = (transaction - elem_bytes + run_bytes - 1) // transaction + 1
    return rows * sectors * transaction


def _run_dims(extents: Sequence[int], shape: Sequence[int]) -> int:
    """How many innermost dimensions one contiguous run spans."""
    n = 0
    for e, s in zip(reversed(extents), reversed(shape)):
        n += 1
        if e < s:
            break
    return n


@dataclass(frozen=True)
class Buffer:
    """A buffer live from step ``start`` to step ``end`` (inclusive)."""

    name: str
    nbytes: int
    start: int
    end: int


def plan_pool(buffers: Sequence[Buffer], align: int = 16) -> tuple[dict[str, int], int]:
    """Best-fit placement of buffers in one pool, in order of first use: a buffer takes
    the smallest free hole that holds it, freed holes merge.  Returns offsets and the
    pool size.  Plans a kernel's shared memory (buffers live across stages) and the
    runtime's device pool (tensors live across kernels) alike."""
    offsets: dict[str, int] = {}
    free: list[tuple[int, int]] = []  # (offset, size) holes below `top`
    top = 0
    live: list[tuple[Buffer, int]] = []
    for buf in sorted(buffers, key=lambda b: (b.start, -b.nbytes, b.name)):
        for dead in [x for x in live if x[0].end < buf.start]:
            live.remove(dead)
            free = _release(free, dead[1], _round(dead[0].nbytes, align))
        size = _round(buf.nbytes, align)
        fits = [(s, o) for o, s in free if s >= size]
        if fits:
            s, o = min(fits)
            free.remove((o, s))
            if s > size:
                free.append((o + size, s - size))
        else:
            o = top
            top += size
        offsets[buf.name] = o
        live.append((buf, o))
    return offsets, top


def _round(n: int, align: int) -> int:
    return -(-n // align) * align


def _release(free: list[tuple[int, int]], offset: int, size: int) -> list[tuple[int, int]]:
    holes = sorted([*free, (offset, size)])
    merged: list[tuple[int, int]] = []
    for o, s in holes:
        if merged and merged[-1][0] + merged[-1][1] == o:
            merged[-1] = (merged[-1][0], merged[-1][1] + s)
        else:
            merged.append((o, s))
    return merged
