"""A model's fused groups, remembered so that tuning it again skips the fusion search.

The tuning cache answers for one group at a time; what it cannot answer is which groups a
model splits into.  The cost model's fusion search and the measured fusion checks after it
take most of a warm tune (tens of seconds on Swin-T, every group's configs proposed again),
though their outcome is settled once every group they measured is in the cache.  So the
final groups -- each one's members, in execution order -- are stored beside the group
entries, under a key that holds everything the outcome depends on:

* the graph's structure, tensor names included (``engine.graph_signature``),
* the fusion checks', the fusion search's and the kinds' versions (:data:`PLAN_VERSION`,
  ``engine.FUSION_VERSION``, ``kinds.SEARCH_VERSION``), the cost model's arch, the kernel kinds, ``topk`` and
  ``--nofusion``, the groups a library computes (``--skip-dot``),
* the GPU and the compiler whose measurements decided the fusion checks.

A stored plan is written only by a tune that ran every check (none cut short by a time
budget).  On a hit, each group is rebuilt from its members and tuned as usual -- from the
group entries, so nothing compiles unless an entry went missing -- and the search's log and
split failures come back with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from welder.arch import Arch
from welder.graph import Graph
from welder.schedule.engine import FUSION_VERSION, graph_signature
from welder.schedule.group import Group, InvalidGroup, make_group
from welder.schedule.kinds import SEARCH_VERSION
from welder.schedule.plan import SplitFailure

#: A group's unfused baseline: the latency of its members as one kernel each, their DRAM
#: traffic, and whether that latency was measured (else the cost model's).
Unfused = tuple[float, int, bool]

#: Bumped when the fusion checks (``tuner._ModelTuner.doubt`` and ``checked``) change what
#: they decide: a plan they made before is no answer for them now.
PLAN_VERSION = 3  # 2: fusions measuring 1.4 times their prediction are checked (was 1.5);
# 3: a softmax's normalisation gets positive inputs in the candidates' check (1fd2267): before,
# every candidate of such a part failed it, and the checks decided against the way holding it.


def plan_key(
    graph: Graph,
    arch: Arch,
    gpu: str,
    compiler: str,
    kinds: Sequence[str],
    topk: int,
    nofusion: bool,
    library_roots: Sequence[str] = (),
) -> str:
    """The key a model's plan is stored under (see the module's docstring)."""
    settings = [
        graph_signature(graph),
        PLAN_VERSION,
        FUSION_VERSION,
        SEARCH_VERSION,
        arch.name,
        gpu,
        compiler,
        sorted(kinds),
        topk,
        nofusion,
        sorted(library_roots),
    ]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CachedPlan:
    """The final groups' members in execution order, and what the search said about them;
    ``unfused`` holds each group's unfused baseline (latency, traffic, measured?) as the tune
    reported it, which costs every node's configs to work out again (a record written
    before it was kept has none)."""

    groups: tuple[tuple[str, ...], ...]
    log: tuple[str, ...]
    split_failures: tuple[SplitFailure, ...]
    unfused: tuple[Unfused, ...] = ()

    @classmethod
    def of(
        cls,
        groups: Sequence[Group],
        log: Sequence[str],
        failures: Sequence[SplitFailure],
        unfused: Sequence[Unfused] = (),
    ) -> CachedPlan:
        return cls(tuple(tuple(g.members) for g in groups), tuple(log), tuple(failures), tuple(unfused))

    def to_json(self) -> dict[str, Any]:
        return {
            "groups": [list(m) for m in self.groups],
            "log": list(self.log),
            "split_failures": [f.to_json() for f in self.split_failures],
            "unfused": [list(u) for u in self.unfused],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CachedPlan:
        failures = tuple(SplitFailure.from_json(f) for f in data["split_failures"])
        unfused = tuple((float(us), int(n), bool(measured)) for us, n, measured in data.get("unfused", []))
        return cls(tuple(tuple(m) for m in data["groups"]), tuple(data["log"]), failures, unfused)

    def rebuild(self, graph: Graph) -> list[Group] | None:
        """The groups over ``graph``, or None where one no longer forms (a key collision, or
        a rule of what a group may hold changed without the search's version)."""
        try:
            return [make_group(graph, list(members)) for members in self.groups]
        except (InvalidGroup, KeyError):
            return None
