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
    kinds: tuple[str, ...] = ("attention", "attention_ffma", "wgmma", "mma", "ffma", "simt")
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


def top_by_family(ranked: Sequence[GroupConfig], topk: int) -> list[GroupConfig]:
    """The ``topk`` best of ``ranked`` (best first) with places kept for the best of every
    family (``StageConfig.family``) of the group's first stage -- a quarter of them each, or
    an equal share where more than four families compete -- in estimate order, ties spread
    over shapes (:func:`spread_ties`)."""
    families: dict[str, list[GroupConfig]] = {}
    for c in ranked:
        families.setdefault(c.stages[0].family, []).append(c)
    keep = max(1, topk // max(4, len(families))) if topk > 1 else 0
    chosen = [c for members in families.values() for c in spread_ties(members)[:keep]][:topk]
    for c in ranked:
        if len(chosen) >= topk:
            break
        if not any(c is d for d in chosen):
            chosen.append(c)
    return sorted(chosen, key=lambda c: c.estimate.latency_us)
