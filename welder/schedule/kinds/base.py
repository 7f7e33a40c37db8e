"""What every kernel kind provides, and what its policy rule is given.

A kind is one way of computing a tile-owning stage: generic SIMT code, tensor-core MMA, a
vendor library call.  Each lives in one module of this package with

* its config dataclass (a :class:`~welder.schedule.config.StageConfig` subclass whose
  ``kind`` is the kind's name),
* its policy rule, :meth:`KernelKind.propose`: the group's candidate configs, each with the
  cost model's estimate, or None where the kind does not apply to the group,

and one template in ``codegen_templates/`` that ``welder.codegen`` renders its stages with.
``welder.schedule.kinds.KINDS`` registers them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from welder.arch import Arch
from welder.schedule.config import GroupConfig, StageConfig
from welder.schedule.group import Group

ShapeOf = Callable[[str], tuple[int, ...]]
DtypeOf = Callable[[str], str]

MAX_THREADS = 256
#: What the cost model adds to every kernel launch or library call, in microseconds.
LAUNCH_OVERHEAD_US = 2.0


@dataclass(frozen=True)
class Options:
    """What the search asks of every kind: how many candidates to keep, which kinds may
    propose them (in order of preference on equal estimates), and limits on the search."""

    topk: int = 1
    max_candidates: int = 256
    max_threads: int = MAX_THREADS
    kinds: tuple[str, ...] = ("attention", "attention_ffma", "wgmma", "mma", "mma_tf32x3", "ffma", "simt")
    # Clusters of blocks sharing an operand through TMA multicast: off by default, as the
    # clustered kernels measured 2-3.5x slower than their lone twins on the H100
    # (docs/tensor_cores.md, "Clusters").
    clusters: bool = False


@dataclass(frozen=True)
class ScheduleContext:
    """What a kind's rule may look at besides the group: tensor shapes and dtypes (of the
    group's inputs and members), the arch whose cost model ranks candidates, the options."""

    shape_of: ShapeOf
    dtype_of: DtypeOf
    arch: Arch
    options: Options = Options()


class KernelKind(Protocol):
    """One kernel kind (see the module docstring)."""

    @property
    def name(self) -> str: ...  # the key in KINDS and StageConfig.kind

    @property
    def config_type(self) -> type[StageConfig]: ...

    def propose(self, group: Group, ctx: ScheduleContext) -> list[GroupConfig] | None:
        """The ``ctx.options.topk`` best configs of ``group`` by this kind, best first, each
        with its estimate; ``[]`` where the kind applies but nothing fits the arch; None
        where the kind cannot compute the group at all."""
        ...


#: Estimates within this share of the first of a run are ties: the cost model cannot tell
#: those configs apart, and the tuner should measure different shapes among them.
TIE_TOLERANCE = 0.01


def spread_ties(ranked: Sequence[GroupConfig]) -> list[GroupConfig]:
    """``ranked`` (best first) with each run of tied estimates reordered so that each shape
    (block tile and threads) appears once before any appears twice, in rank order within
    each round.  The tensor-core and FMA kinds' estimates often tie across block shapes and
    pipeline depths: a family's few reserved places then went to the variants of one shape
    (BERT's fp32 FFN product on the H100: five 128 x 128 configs, while the 128 x 64 block
    that had measured 5% faster was left out)."""
    out: list[GroupConfig] = []
    start = 0
    while start < len(ranked):
        limit = ranked[start].estimate.latency_us * (1 + TIE_TOLERANCE)
        end = start
        while end < len(ranked) and ranked[end].estimate.latency_us <= limit:
            end += 1
        rounds: list[list[GroupConfig]] = []
        seen: dict[tuple, int] = {}
        for c in ranked[start:end]:
            shape = (c.block_tile, c.threads)
            n = seen[shape] = seen.get(shape, -1) + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(c)
        out += [c for r in rounds for c in r]
        start = end
    return out


#: How many configs of one likeness (:func:`alike`) come in estimate order; later ones give
#: way to any config estimated within ``ALIKE_DEFERRAL`` of them.
ALIKE_FIRST = 2
ALIKE_DEFERRAL = 0.10


def alike(c: GroupConfig) -> tuple:
    """What a config's kernel costs, as far as the cost model can tell: its family, block
    size, output vector width, elements a block, blocks an SM, registers, shared memory and
    traffic.  Configs alike in all of these differ only in how the block's elements split
    over the axes (a layer norm's 32 rows as 1 x 32 or 16 x 2 of a [seq, batch] row space),
    and measure within a few per cent of one another."""
    e = c.estimate
    return (
        c.family,
        c.threads,
        getattr(c.stages[-1], "vector", 1),
        math.prod(c.block_tile),
        e.blocks_per_sm,
        e.regs_per_thread,
        e.smem_bytes,
        e.read_bytes + e.write_bytes,
    )


def defer_alike(ranked: Sequence[GroupConfig]) -> list[GroupConfig]:
    """``ranked`` (near estimate order) with each config past the ``ALIKE_FIRST``-th of its
    likeness moved behind the configs estimated within ``ALIKE_DEFERRAL`` of it, so that a
    topk is not spent on one kernel split several ways.  Conformer's layer norm at batch 64
    on the H200: the first 24 proposals were six splits of 32 rows tied at one estimate
    (measured 32.7 to 43 us); the 16-row configs, 2.7% behind in estimate at 4 blocks an SM
    instead of 2, were never timed and measured 25.3 us."""
    out: list[GroupConfig] = []
    waiting: deque[GroupConfig] = deque()
    seen: dict[tuple, int] = {}
    for c in ranked:
        while waiting and waiting[0].estimate.latency_us * (1 + ALIKE_DEFERRAL) < c.estimate.latency_us:
            out.append(waiting.popleft())
        key = alike(c)
        seen[key] = seen.get(key, 0) + 1
        (out if seen[key] <= ALIKE_FIRST else waiting).append(c)
    return out + list(waiting)


def top_by_family(ranked: Sequence[GroupConfig], topk: int) -> list[GroupConfig]:
    """The ``topk`` best of ``ranked`` (best first) with places kept for the best of every
    family (``GroupConfig.family``) -- a quarter of them each, or an equal share where more
    than four families compete -- in estimate order, ties spread over shapes
    (:func:`spread_ties`) and configs alike to two before them deferred (:func:`defer_alike`)."""
    families: dict[str, list[GroupConfig]] = {}
    for c in ranked:
        families.setdefault(c.family, []).append(c)
    keep = max(1, topk // max(4, len(families))) if topk > 1 else 0
    chosen = [c for members in families.values() for c in defer_alike(spread_ties(members))[:keep]][:topk]
    for c in defer_alike(ranked):
        if len(chosen) >= topk:
            break
        if not any(c is d for d in chosen):
            chosen.append(c)
    return sorted(chosen, key=lambda c: c.estimate.latency_us)
