"""The plain data a schedule consists of: what the policy decides and codegen obeys.

A group's config is kind-neutral: its root tile, grid, block size, shared memory and the
cost model's estimate, plus one :class:`StageConfig` per tile-owning stage.  What a stage's
config holds depends on its *kernel kind* (``welder.schedule.kinds``): each kind defines its
own subclass in its own module, and the JSON form of a stage names its kind.

Everything here serialises to JSON (``tuned.json``, the tuning cache) and back
(``welder.schedule.kinds.config_from_json``), so a tuned model can be rebuilt without
searching again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar


@dataclass
class StageConfig:
    """How one tile-owning stage of a group is computed: the base of every kind's config.

    Subclasses set ``kind`` (the name the kind is registered under in
    ``welder.schedule.kinds.KINDS``) and ``in_kernel``: True for stages that welder renders
    into the group's kernel, False for a stage that a vendor library computes -- a group
    holding one is that library call, not a kernel."""

    node: str
    kind: ClassVar[str] = ""
    in_kernel: ClassVar[bool] = True

    @property
    def family(self) -> str:
        """Candidates the search measures some of whatever their estimates (see
        ``welder.schedule.kinds.propose``): the kind, unless a kind splits its own."""
        return self.kind

    @property
    def blocks_per_tile(self) -> int:
        """Blocks the kernel launches for each root tile: more than one only where the
        stage splits its reduction among blocks (split-K, ``MmaConfig.splits``).  A property
        every kind answers, so that no other field is taken for it by its name: attention's
        warps splitting keys once were, and launched a block per split."""
        return 1

    def renamed(self, names: Mapping[str, str]) -> StageConfig:
        """Copy with node and tensor names mapped through ``names`` (others kept)."""
        raise NotImplementedError(f"{type(self).__name__} does not rename its tensors")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StageConfig:
        """The config from :meth:`to_json`'s dict (its ``kind`` key already consumed)."""
        return cls(**tuples_of(d, cls))


@dataclass
class Estimate:
    """The cost model's view of one config."""

    blocks: int
    blocks_per_sm: int
    waves: int
    read_bytes: int  # global memory, whole kernel, rounded to transactions, re-reads included
    write_bytes: int
    compulsory_bytes: int  # every tensor the kernel touches, once: what must cross DRAM
    flops: int
    smem_bytes: int
    regs_per_thread: int
    latency_us: float


@dataclass
class GroupConfig:
    root: str
    block_tile: tuple[int, ...]
    grid: tuple[int, ...]  # blocks per root axis
    block_order: tuple[int, ...]  # root axes, slowest-varying first, for blockIdx.x
    threads: int
    stages: list[StageConfig]  # one per tile-owning stage, each of its kind's config type
    smem_bytes: int
    estimate: Estimate

    @property
    def num_blocks(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n

    @property
    def family(self) -> str:
        """The config's family (:attr:`StageConfig.family`): its first stage's, or the first
        one a later stage has of its own -- a window twin of a convolution behind a producer
        stage is as much a twin as one of a first stage."""
        return next((st.family for st in self.stages if st.family != st.kind), self.stages[0].family)

    @property
    def kernel(self) -> bool:
        """Whether welder generates this group's kernel; False where a library call computes
        the group (its tiling fields are then unused)."""
        return all(st.in_kernel for st in self.stages)

    def stage(self, node: str) -> StageConfig:
        return next(s for s in self.stages if s.node == node)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data; ``welder.schedule.kinds.config_from_json`` reads it back (it
        knows every kind's stage config)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stages"] = [st.to_json() for st in self.stages]
        d["estimate"] = asdict(self.estimate)
        return d

    def renamed(self, names: Mapping[str, str]) -> GroupConfig:
        """Copy with node and tensor names mapped through ``names`` (others kept)."""
        stages = [st.renamed(names) for st in self.stages]
        return replace(self, root=names.get(self.root, self.root), stages=stages)


def tuples_of(d: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """JSON lists back to the tuples the dataclass ``cls`` declares."""
    out = dict(d)
    for f in fields(cls):
        if f.name in out and isinstance(out[f.name], list) and "tuple" in str(f.type):
            out[f.name] = tuple(out[f.name])
    return out
