"""The SIMT kernel kind: its stage config and its policy -- candidate configs for one fused
group, ranked by the cost model.  Its stages render with ``codegen_templates/stages/simt.cu.j2``.

Every group can be computed this way, so the rule applies everywhere (it may still find
nothing that fits the arch).

1. The *base tile* is the smallest root tile that makes no block recompute a whole
   intermediate another block also computes: a root axis that some intermediate stage
   does not depend on (a softmax row statistic along the row) must be one block wide.
2. A best-first search grows the tile one axis at a time through powers of two,
   divisors and the full extent, ranking each by estimated latency (traffic rounded to
   transactions, times waves).
3. For every tile the per-stage decisions follow, once per block size (a power of two
   times the warp size that the tile can use): threads over the tile's axes (innermost
   first, so loads and stores coalesce), a register tile per thread, inter-thread
   reduction where the spatial tile is smaller than the block, which global inputs to
   stage in shared memory and the reduction step that keeps those loads coalesced and
   fits, vector widths, and a best-fit shared-memory plan.  The cost model picks the
   block size; near-ties go to the smallest block that still gives every SM partition
   ``WARPS_PER_PARTITION`` resident warps.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

from welder.arch import Arch
from welder.ir.compute import Compute
from welder.ir.expr import Expr, Load, Select, free_vars, walk
from welder.ir.interpret import np_dtype
from welder.ir.window import reads_through_window, sliding_window
from welder.schedule.config import Estimate, GroupConfig, StageConfig, tuples_of
from welder.schedule.group import Group
from welder.schedule.kinds.base import LAUNCH_OVERHEAD_US, DtypeOf, Options, ScheduleContext, ShapeOf
from welder.tile.footprint import Buffer, plan_pool, transaction_bytes
from welder.tile.propagate import (
    GroupRegions,
    Region,
    partitions_output,
    propagate_group,
    read_regions,
)
from welder.tile.region import Affine, affine_form

MAX_REG_TILE = 64  # outputs per thread, so accumulators stay in registers
MIN_INNER_THREADS = 8  # consecutive threads along the innermost axis: 32-byte sectors for fp32
BASE_REGISTERS = 24
DRAM_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.6
SM_BANDWIDTH_SHARE = 3.0
# Resident warps each SM partition (warp scheduler) needs to hide memory latency; below
# that, an SM's rates scale down (measured on H100: an 8-block fused LayerNorm group).
WARPS_PER_PARTITION = 4
# GPU clock cycles per block launched, whatever the block does: a kernel of many small
# blocks runs no faster than the GPU starts them (measured on an H100: a residual add of
# 8192x768 fp16 took 0.6 ns a block -- 120 us for 196608 blocks of 32 elements, 41 us for
# 65536 of 96 -- against 12 us for 3072 to 12288 blocks of 512 to 2048 elements).
BLOCK_ISSUE_CYCLES = 1.2
# GPU clock cycles each reduction point a thread takes in turn: the loop's loads and combine
# wait on one another.  A kernel takes at least its waves' serial chains, plus one chain that
# nothing hides (:func:`estimate_cost`).  Fitted on the H200's times of 3,347 SIMT configs
# (ten tunes of batch-1 models, 2026-11-29): over the estimate without it, their time grew
# with the points a thread reduces (1.14x at 2-7, 1.7x at 32-127, 5.8x past 256), about
# 60 ns a point.
SERIAL_POINT_CYCLES = 120
# Block sizes whose estimates lie this close to the best one count as ties.
BLOCK_SIZE_TOLERANCE = 0.02
# The most reduction points one step stages, in 128-byte lines of the input's elements:
# four lines of K per step amortise a step's two barriers; longer steps only take shared
# memory away from other resident blocks, which the cost model does not reward.
STEP_LINES = 4
LINE_BYTES = 128


T = TypeVar("T")


@dataclass
class StagedInput:
    """A global tensor copied into shared memory one reduction step at a time."""

    tensor: str
    extents: tuple[int, ...]  # region per step
    offset: int  # byte offset in the group's shared pool
    vector: int  # elements per load instruction
    # Elements the buffer starts before the region along the innermost axis, so that vector
    # loads start aligned where the region does not (a convolution's halo: origin - 1).
    shift: int = 0
    # Already in shared memory: an earlier stage of the block staged the same region whole
    # and its buffer is kept for this one, which reads it without loading (:func:`share_rows`).
    resident: bool = False


@dataclass
class SimtConfig(StageConfig):
    """How one SIMT stage computes its tile.

    Threads are laid out over the tile's axes (``thread_shape``, innermost axis fastest);
    thread ``t`` handles elements ``t_d + j_d * thread_shape[d]`` for ``j_d <
    reg_tile[d]``.  Threads beyond ``prod(thread_shape)`` split the reduction
    (``reduce_threads`` per output, combined with shuffles).  With ``vector`` > 1 (an
    elementwise stage: see :func:`vector_twin`) the innermost axis counts vectors of that
    many contiguous elements: a thread's ``j``-th vector starts at element
    ``(t + j * thread_shape) * vector``, loaded and stored 16 bytes at a time.
    """

    kind: ClassVar[str] = "simt"

    tile: tuple[int, ...]  # extents of the region this block computes
    thread_shape: tuple[int, ...]
    reg_tile: tuple[int, ...]
    reduce_threads: int = 1
    rstep: tuple[int, ...] = ()
    staged: list[StagedInput] = field(default_factory=list)
    smem_offset: int | None = None  # where its tile lives when consumed inside the group
    reduce_offset: int | None = None  # scratch for combining warps of a cross-warp reduction
    write_global: bool = False
    vector: int = 1  # contiguous elements per thread along the innermost axis
    # A sliding window's layout (:func:`window_twin`): along the innermost axis a thread's
    # register tile is contiguous (element ``t * reg + j``) and the reduction loops are
    # unrolled, so the taps of neighbouring outputs read the same elements.
    window: bool = False
    # Global inputs read once per element staged all the same (:func:`stream_twin`): the
    # staging loads move 16 bytes each, where a reduction's own reads move one element.
    stream: bool = False
    # A reduction split over threads, nothing staged, walks its innermost reduce axis in
    # vectors of this many contiguous elements (:func:`reduce_vector_twin`): each thread
    # loads 16 bytes of an input per instruction where it loaded one element.
    rvector: int = 1
    # Such a reduction keeps the vectors it loads in registers (:func:`held_twin`), and the
    # later stages of the group that read the same elements at the same thread take them
    # from there: the codegen matches each of their loads to a held one, and loads where none
    # matches.
    hold: bool = False

    @property
    def family(self) -> str:
        if self.hold:
            return "simt_held"
        if self.window:
            return "simt_window"
        if self.stream:
            return "simt_stream"
        return "simt_vector" if self.rvector > 1 else self.kind

    def renamed(self, names: Mapping[str, str]) -> SimtConfig:
        staged = [replace(sd, tensor=names.get(sd.tensor, sd.tensor)) for sd in self.staged]
        return replace(self, node=names.get(self.node, self.node), staged=staged)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SimtConfig:
        staged = [StagedInput(**{**x, "extents": tuple(x["extents"])}) for x in d["staged"]]
        return cls(**{**tuples_of(d, cls), "staged": staged})


#: The tile search stops once it holds ``topk`` configs and the best tile left to expand is
#: estimated this many times slower than the best found.
SEARCH_GIVE_UP = 3.0


class SimtKind:
    """The kind every group has: generic CUDA cores, one thread per register tile."""

    name = "simt"
    config_type = SimtConfig

    def propose(self, group: Group, ctx: ScheduleContext) -> list[GroupConfig]:
        """The best configs with their sliding-window twins, streaming twins and twins
        reading rows in vectors where they have them (families of their own:
        :func:`~.propose` keeps places for each), in estimate order (the twins in vectors
        are estimated lower than the configs they copy), each twin after its config on ties."""
        shape_of, dtype_of = _memo(ctx.shape_of), _memo(ctx.dtype_of)
        found = schedule_group(group, shape_of, dtype_of, ctx.arch, ctx.options)
        info = group_info(group, shape_of, dtype_of, ctx.arch) if found else None
        proposed: list[GroupConfig] = []
        for c in found:
            vectors = reduce_vector_twin(group, c, shape_of, dtype_of, ctx.arch, info)
            twins = (
                window_twin(group, c),
                stream_twin(group, c, shape_of, dtype_of, ctx.arch, info),
                vectors,
                held_twin(group, vectors, shape_of, dtype_of, ctx.arch, info),
            )
            proposed += [c, *(x for x in twins if x is not None)]
        return sorted(proposed, key=lambda c: c.estimate.latency_us)


KIND = SimtKind()


def schedule_group(
    group: Group, shape_of: ShapeOf, dtype_of: DtypeOf, arch: Arch, options: Options = Options()
) -> list[GroupConfig]:
    """The ``topk`` best valid configs, best first; empty if none fits the arch."""
    shape_of, dtype_of = _memo(shape_of), _memo(dtype_of)
    info = group_info(group, shape_of, dtype_of, arch)
    root_shape = shape_of(group.root)
    base = base_tile(group, shape_of)
    axis_choices = [axis_candidates(e, b) for e, b in zip(root_shape, base)]
    start = (0,) * len(root_shape)
    alternates: list[GroupConfig] = []

    def evaluate(pos: tuple[int, ...]) -> GroupConfig | None:
        tile = tuple(c[p] for c, p in zip(axis_choices, pos))
        variants = tile_configs(group, tile, shape_of, dtype_of, arch, options, info=info)
        alternates.extend(variants[1:])
        return variants[0] if variants else None

    seen = {start}
    first = evaluate(start)
    heap: list[tuple[float, tuple[int, ...], GroupConfig]] = []
    if first is not None:
        heap.append((first.estimate.latency_us, start, first))
    results: list[GroupConfig] = []
    evaluated = 1
    best = math.inf
    while heap and evaluated < options.max_candidates:
        if len(results) >= options.topk and heap[0][0] > SEARCH_GIVE_UP * best:
            break  # what is left to expand is far behind: its neighbours will be too
        _, pos, cfg = heapq.heappop(heap)
        results.append(cfg)
        best = min(best, cfg.estimate.latency_us)
        for d in range(len(pos)):
            for step in next_sizes(axis_choices[d], root_shape[d], pos[d]):
                nxt = (*pos[:d], step, *pos[d + 1 :])
                if nxt in seen:
                    break
                seen.add(nxt)
                evaluated += 1
                cand = evaluate(nxt)
                if cand is not None:
                    heapq.heappush(heap, (cand.estimate.latency_us, nxt, cand))
                if cand is not None and cand.estimate.latency_us <= cfg.estimate.latency_us:
                    break  # not a wall: the search goes on from the ragged size
    results.extend(c for _, _, c in heap)
    results.sort(key=_rank_key)
    alternates.sort(key=_rank_key)
    ranked = [*results, *alternates]
    return _both_forms(diverse_topk(results, options.topk, alternates), ranked, options.topk)


def next_sizes(choices: Sequence[int], extent: int, k: int) -> list[int]:
    """The positions in ``choices`` (an axis's tile sizes, smallest first) the search steps to
    from position ``k``: the next size, and where that one leaves a ragged last tile, the next
    that divides the axis (which the search tries only where the ragged one estimates worse
    than the tile it steps from).  Without the second a ragged size walls off the larger ones
    behind it: a 56-wide depthwise convolution's rows stopped at 14 (16 is ragged) while whole
    rows, read in vectors, estimate lower."""
    steps = [k + 1] if k + 1 < len(choices) else []
    if steps and extent % choices[k + 1]:
        steps += [j for j in range(k + 2, len(choices)) if extent % choices[j] == 0][:1]
    return steps


def _both_forms(chosen: list[GroupConfig], pool: Sequence[GroupConfig], k: int) -> list[GroupConfig]:
    """``chosen`` with up to half of its places (at least one) given to the best
    vectorised configs and at least one to a scalar one, where the pool has both: the
    estimate does not model what vectors save (load and store instructions), so the
    measurement must see both forms.  In estimate order, a twin before its scalar config."""
    vector = [c for c in pool if c.stages[-1].vector > 1]
    scalar = [c for c in pool if c.stages[-1].vector == 1]
    if k < 2 or not vector or not scalar:
        return chosen

    def first(configs: Sequence[GroupConfig], n: int) -> list[GroupConfig]:
        out: list[GroupConfig] = []
        for c in configs:
            if len(out) < n and all(c is not x for x in out):
                out.append(c)
        return out

    vectors = first([*(c for c in chosen if c.stages[-1].vector > 1), *vector], max(1, k // 2))
    scalars = first([*(c for c in chosen if c.stages[-1].vector == 1), *scalar], k - len(vectors))
    return sorted([*vectors, *scalars], key=_rank_key)


def _memo(fn: Callable[[str], T]) -> Callable[[str], T]:
    """``fn`` remembered per tensor name: graph lookups dominate the search otherwise."""
    known: dict[str, T] = {}

    def lookup(name: str) -> T:
        if name not in known:
            known[name] = fn(name)
        return known[name]

    return lookup


def _rank_key(c: GroupConfig) -> tuple:
    return (c.estimate.latency_us, c.estimate.read_bytes + c.estimate.write_bytes, c.block_tile, c.threads)


def diverse_topk(
    ranked: list[GroupConfig], k: int, alternates: Sequence[GroupConfig] = ()
) -> list[GroupConfig]:
    """The best ``k`` configs, except that no block size takes more than a third of the
    places while others are available: the cost model is least sure how block size trades
    occupancy against reuse, so measurement should see several.  ``ranked`` holds each
    tile's preferred block size; ``alternates`` (other block sizes of the same tiles) fill
    places that distinct tiles leave empty."""
    cap = max(1, -(-k // 3))
    chosen: list[GroupConfig] = []
    per_size: dict[int, int] = {}
    pools = (ranked, alternates)
    for cfg in (c for pool in pools for c in pool):
        if len(chosen) < k and per_size.get(cfg.threads, 0) < cap:
            chosen.append(cfg)
            per_size[cfg.threads] = per_size.get(cfg.threads, 0) + 1
    for pool in pools:
        chosen += [c for c in pool if all(c is not x for x in chosen)][: k - len(chosen)]
    return chosen


# -- tiles ------------------------------------------------------------------------------------


def base_tile(group: Group, shape_of: ShapeOf) -> tuple[int, ...]:
    """Root axes an intermediate stage ignores must not be split across blocks."""
    root_shape = shape_of(group.root)
    ones = (1,) * len(root_shape)
    regions = _propagate(group, ones, shape_of)
    base = list(ones)
    for k, extent in enumerate(root_shape):
        var = f"b{k}"
        for s in group.stages:
            if s == group.root:
                continue
            if not _depends_on(regions.members[s], var):
                base[k] = extent
                break
    return tuple(base)


def _depends_on(region: Region, var: str) -> bool:
    for d in region.dims:
        if isinstance(d.lo, Affine):
            if d.lo.coefs.get(var):
                return True
        elif var in free_vars(d.lo):
            return True
    return False


def axis_candidates(extent: int, base: int) -> list[int]:
    """Tile sizes worth trying along one axis, smallest first."""
    if base >= extent:
        return [extent]
    out = {extent, base}
    p = 1
    while p < extent:
        if p >= base:
            out.add(p)
        p *= 2
    out.update(d for d in range(base, min(extent, 512) + 1) if extent % d == 0 and d % 2 == 0)
    return sorted(out)


def _propagate(group: Group, tile: Sequence[int], shape_of: ShapeOf) -> GroupRegions:
    stages = [group.computes[s] for s in group.stages]
    return propagate_group(stages, group.root, tile, shape_of)


# -- one tile -----------------------------------------------------------------------------------


@dataclass
class _StageInfo:
    """What the policy needs of one stage's compute, worked out once per group."""

    compute: Compute
    elem: int  # bytes per element of its output
    last_reader: int | None  # position of the last stage reading its tile inside the group
    loads: list[tuple[str, tuple[int, ...], int]]  # (tensor, output axes its index uses, itemsize)
    stageable: list[tuple[str, int]]  # global inputs a step may stage, with their itemsize
    stage_elem: int  # the narrowest of those, in bytes: sets the points per line
    units: dict[str, int]  # coalescing unit per reduce axis
    point_flops: int

    @property
    def points(self) -> int:
        """Reduction points per output (1 for an injective stage)."""
        return math.prod(a.extent for a in self.compute.reduce_axes)


@dataclass
class _GroupInfo:
    """Tile-independent facts about a group, so a tile's configs cost no expression walks."""

    stages: dict[str, _StageInfo]
    io_bytes: int
    itemsize: Callable[[str], int]


def group_info(group: Group, shape_of: ShapeOf, dtype_of: DtypeOf, arch: Arch) -> _GroupInfo:
    def itemsize(t: str) -> int:
        return np_dtype(dtype_of(t)).itemsize

    position = {s: k for k, s in enumerate(group.stages)}
    readers: dict[str, list[int]] = {}
    for s in group.stages:
        for t in group.computes[s].inputs:
            if t in position and t != s:
                readers.setdefault(t, []).append(position[s])
    external = set(group.inputs)
    stages = {}
    for s in group.stages:
        c = group.computes[s]
        axis_of = {a.name: k for k, a in enumerate(c.axes)}
        distinct = _distinct_loads(c)
        loads = [
            (
                ld.tensor,
                tuple(sorted({axis_of[v] for i in ld.indices for v in free_vars(i) if v in axis_of})),
                itemsize(ld.tensor),
            )
            for ld in distinct
        ]
        stageable = [
            ld
            for ld in distinct
            if c.is_reduction and ld.tensor in external and not any(_data_dependent(i) for i in ld.indices)
        ]
        stages[s] = _StageInfo(
            c,
            itemsize(s),
            max(readers[s]) if s in readers else None,
            loads,
            [(ld.tensor, itemsize(ld.tensor)) for ld in stageable],
            min((itemsize(ld.tensor) for ld in stageable), default=4),
            coalescing_units(c, stageable, itemsize, arch),
            c.point_flops,
        )
    return _GroupInfo(stages, io_bytes(group, shape_of, dtype_of), itemsize)


@dataclass(frozen=True)
class StepOption:
    """One reduction step of a stage and the global inputs staged with it.

    ``staged`` holds (tensor, extents per step, vector width, shift: see
    :class:`StagedInput`); ``coalesced`` is False when the step cuts a staged input's
    contiguous runs below one read transaction."""

    rstep: tuple[int, ...]
    staged: tuple[tuple[str, tuple[int, ...], int, int], ...]
    nbytes: int  # staging buffers of one step
    coalesced: bool


class StepOptions:
    """A stage's reduction steps, largest first.  The steps themselves are cheap; what each
    stages (a region per input) is worked out on demand, since most tiles fit one of their
    first steps.

    Budgets of reduction points per step halve from ``STEP_LINES`` lines of the input's
    elements down to one point; each budget goes to the reduce axes innermost first
    (``reduction_step``), keeping a staged input's innermost axis a whole number of
    transactions long (or whole) as long as the budget allows."""

    def __init__(self, stage: _StageInfo, region: Region, shape_of: ShapeOf, stream: bool = False) -> None:
        self.stage, self.region, self.shape_of, self.stream = stage, region, shape_of, stream
        self.whole = tuple(a.extent for a in stage.compute.reduce_axes)
        self.steps: list[tuple[tuple[int, ...], bool]] = []
        for budget in _halvings(STEP_LINES * LINE_BYTES // stage.stage_elem):
            step = reduction_step(stage.compute, budget, stage.units)
            if not self.steps or self.steps[-1][0] != step[0]:
                self.steps.append(step)
        self._options: dict[int, StepOption] = {}

    def __len__(self) -> int:
        return len(self.steps)

    def get(self, k: int) -> StepOption:
        if k not in self._options:
            self._options[k] = self._option(*self.steps[k])
        return self._options[k]

    def _option(self, rstep: tuple[int, ...], coalesced: bool) -> StepOption:
        per_step = read_regions(self.stage.compute, self.region.dims, self.shape_of, rstep)
        step_points = math.prod(self.region.extents) * math.prod(rstep)
        staged = []
        nbytes = 0
        for tensor, elem in self.stage.stageable:
            reg = per_step[tensor]
            shape = self.shape_of(tensor)
            if not self.stream and step_points < 2 * math.prod(reg.clipped_extents(shape)):
                continue  # read about once per element: staging buys nothing but wider loads
            # The buffer spans the whole region, halo outside the tensor included (zero-filled),
            # so kernels index it with the same offsets the region was computed with.
            extents, vector, shift = reg.extents, vector_width(reg, shape, reg.extents), 0
            if vector == 1:
                extents, vector, shift = aligned_superset(reg, shape, elem)
            staged.append((tensor, extents, vector, shift))
            nbytes += math.prod(extents) * elem
        return StepOption(rstep, tuple(staged), nbytes, coalesced)

    def whole_step(self) -> StepOption:
        """The whole reduction in one step (:func:`share_rows`)."""
        return self._option(self.whole, True)

    def smaller(self, k: int, nbytes: int, coalesced_only: bool) -> int | None:
        """The first step after the ``k``-th that may stage at most ``nbytes``, or the last
        one allowed if none may; None if there is no smaller step.  A region's extent is an
        affine function of the step with a non-negative constant (halos), so scaling step
        ``k``'s bytes by the ratio of points never overestimates a smaller step: the steps
        skipped cannot fit."""
        allowed = [j for j in range(k + 1, len(self.steps)) if self.steps[j][1] or not coalesced_only]
        if not allowed:
            return None
        have, points = self.get(k).nbytes, math.prod(self.steps[k][0])
        for j in allowed:
            if have * math.prod(self.steps[j][0]) <= nbytes * points:
                return j
        return allowed[-1]


def _halvings(n: int) -> list[int]:
    out = []
    while n >= 1:
        out.append(n)
        n //= 2
    return out


def coalescing_units(
    c: Compute, loads: Sequence[Load], itemsize: Callable[[str], int], arch: Arch
) -> dict[str, int]:
    """Per reduce axis, the step granularity that keeps staged loads coalesced: a reduce
    axis in the innermost index of a load steps in whole read transactions of that load's
    elements (8 fp32, 16 fp16); other reduce axes do not change how contiguous a load is."""
    reduce_names = {a.name for a in c.reduce_axes}
    units: dict[str, int] = {}
    for ld in loads:
        if not ld.indices:
            continue
        size = itemsize(ld.tensor)
        for v in free_vars(ld.indices[-1]) & reduce_names:
            units[v] = max(units.get(v, 1), max(1, arch.read_transaction // size))
    return units


def reduction_step(c: Compute, budget: int, units: dict[str, int]) -> tuple[tuple[int, ...], bool]:
    """Split ``budget`` reduction points over the reduce axes, innermost first; an axis
    shorter than what is left is taken whole.  A longer one is cut into the fewest steps the
    budget allows, each a multiple of the axis's coalescing unit, balanced so the last
    step wastes as little as possible (768 by 128 -> 128; 72 by 64 -> 40, not 64 + 8).
    Returns the step and whether every axis kept its unit."""
    steps: list[int] = []
    coalesced = True
    for a in reversed(c.reduce_axes):
        unit = units.get(a.name, 1)
        if a.extent <= budget:
            s = a.extent
        else:
            if budget < unit:
                coalesced, unit = False, 1
            usable = budget // unit * unit
            n = -(-a.extent // usable)
            s = unit * -(-a.extent // (n * unit))
        steps.append(s)
        budget = max(1, budget // s)
    return tuple(reversed(steps)), coalesced


@dataclass
class _Tile:
    """What a root tile fixes whatever the block size: regions, grid, global traffic,
    arithmetic, and each staging stage's reduction steps (shared by all block sizes)."""

    tile: tuple[int, ...]
    grid: tuple[int, ...]
    regions: GroupRegions
    read_block: int
    write_block: int
    compulsory: int
    dram_bytes: float
    flops_block: int
    steps: dict[tuple[str, bool], StepOptions] = field(default_factory=dict)


def block_bytes(
    regions: Mapping[str, Region],
    tensors: Iterable[str],
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    transaction: int,
) -> int:
    """Bytes one block moves for ``tensors`` (their regions clipped to the tensors), in whole
    transactions of ``transaction`` bytes."""
    return sum(
        transaction_bytes(
            regions[t].clipped_extents(shape_of(t)), shape_of(t), np_dtype(dtype_of(t)).itemsize, transaction
        )
        for t in tensors
    )


def make_config(
    group: Group,
    tile: tuple[int, ...],
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
    options: Options = Options(),
    threads: int | None = None,
) -> GroupConfig | None:
    """Every per-stage decision for one root tile (at the preferred block size, or at
    ``threads``), or None if it breaks a limit."""
    variants = tile_configs(group, tile, shape_of, dtype_of, arch, options, threads)
    return variants[0] if variants else None


def tile_configs(
    group: Group,
    tile: tuple[int, ...],
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
    options: Options = Options(),
    threads: int | None = None,
    info: _GroupInfo | None = None,
) -> list[GroupConfig]:
    """One config per block size the tile can use, the preferred first: the lowest estimate,
    except that sizes within ``BLOCK_SIZE_TOLERANCE`` of it go to the smallest block that
    keeps ``WARPS_PER_PARTITION`` warps resident on every SM partition -- a smaller block
    gives each thread a larger register tile (each loaded value feeds more outputs) and
    lets more blocks share an SM, so one block's barrier waits are covered by another's
    work.  Empty if no block size fits the arch."""
    info = info or group_info(group, shape_of, dtype_of, arch)
    facts = _tile_facts(group, info, tile, shape_of, dtype_of, arch)
    if facts is None:
        return []
    sizes = [threads] if threads else block_sizes(group, facts.regions, math.prod(facts.grid), arch, options)
    configs = [c for t in sizes if (c := _config(group, info, facts, t, shape_of, arch)) is not None]
    if not configs:
        return []
    # Vectorised twins first, so that they win ties with the scalar configs they copy.
    configs = [*_vector_twins(group, info, facts, configs, shape_of, dtype_of, arch), *configs]
    best = min(c.estimate.latency_us for c in configs)
    near = [c for c in configs if c.estimate.latency_us <= best * (1 + BLOCK_SIZE_TOLERANCE)]
    want = WARPS_PER_PARTITION * arch.sm_partitions

    def preference(c: GroupConfig) -> tuple:
        resident = c.estimate.blocks_per_sm * c.threads // arch.warp_size
        return (resident < want, c.threads)

    pick = min(near, key=preference)
    return [pick, *sorted((c for c in configs if c is not pick), key=_rank_key)]


def block_sizes(
    group: Group, regions: GroupRegions, blocks: int, arch: Arch, options: Options = Options()
) -> list[int]:
    """Block sizes worth trying for a tile: the warp size times powers of two, up to the
    limit, that leave no warp without work (at most one thread per output, or per
    reduction point where spare threads split a reduction) and no thread more than
    ``MAX_REG_TILE`` outputs of the root.

    The limit is ``options.max_threads``, or the arch's largest block for a reduction
    whose tile has fewer outputs than that and whose grid of ``blocks`` fills less than half
    the GPU's thread slots at that limit (:func:`few_blocks`): the loads such a kernel keeps
    in flight scale with its resident warps, and larger blocks, their threads splitting the
    reduction, are the only way left to add warps (BSRN's contrast, a mean
    and deviation over 256 x 256 per channel, ran 64 blocks of 256 threads in 36 us on an
    H200, reading 8 MB twice; 128 threads took 67 us, 64 threads 131)."""
    limit = min(options.max_threads, arch.max_threads_per_block)
    work = max(
        math.prod(regions.members[s].extents) * math.prod(a.extent for a in group.computes[s].reduce_axes)
        for s in group.stages
    )
    root = math.prod(regions.members[group.root].extents)
    reduces = any(group.computes[s].is_reduction for s in group.stages)
    if reduces and root < limit and few_blocks(blocks, limit, arch):
        limit = arch.max_threads_per_block
    sizes = []
    t = arch.warp_size
    while t <= limit:
        if (t <= work or t == arch.warp_size) and root <= t * MAX_REG_TILE:
            sizes.append(t)
        t *= 2
    if not sizes:
        sizes.append(t // 2)  # the largest: a tile too big for any block fails in thread_layout
    if not reduces:
        # Nothing to reuse or to wait for at a barrier: a smaller block buys nothing, and
        # blocks of one or two warps cannot fill an SM (``max_blocks_per_sm``) and leave
        # more blocks to start for the same work.  How many blocks share the work is the
        # tile's choice.
        return sizes[-1:]
    return sizes


def few_blocks(blocks: int, threads: int, arch: Arch) -> bool:
    """Whether ``blocks`` blocks of ``threads`` threads fill less than half the thread slots of
    the GPU's SMs."""
    return 2 * blocks * threads < arch.sm_count * arch.max_threads_per_sm


def _tile_facts(
    group: Group, info: _GroupInfo, tile: tuple[int, ...], shape_of: ShapeOf, dtype_of: DtypeOf, arch: Arch
) -> _Tile | None:
    root_shape = shape_of(group.root)
    grid = tuple(-(-s // t) for s, t in zip(root_shape, tile))
    regions = _propagate(group, tile, shape_of)
    for out in group.outputs:
        if out != group.root and not partitions_output(regions.members[out], shape_of(out), tile, grid):
            return None
    blocks = math.prod(grid)
    read_block = block_bytes(regions.inputs, regions.inputs, shape_of, dtype_of, arch.read_transaction)
    write_block = block_bytes(regions.members, group.outputs, shape_of, dtype_of, arch.write_transaction)
    flops_block = sum(
        math.prod(regions.members[s].extents) * info.stages[s].point_flops for s in group.stages
    )
    compulsory = min((read_block + write_block) * blocks, info.io_bytes)
    dram = _dram_equivalent_bytes(read_block + write_block, blocks, compulsory, arch)
    return _Tile(tile, grid, regions, read_block, write_block, compulsory, dram, flops_block)


def _config(
    group: Group,
    info: _GroupInfo,
    facts: _Tile,
    threads: int,
    shape_of: ShapeOf,
    arch: Arch,
    stream: bool = False,
    resident: bool = False,
) -> GroupConfig | None:
    """The config of one tile and block size; with ``stream``, every reduction stage stages
    its global inputs whatever their reuse (:func:`stream_twin`), and with ``resident`` too
    each whole, read by later stages where they read the same region (:func:`share_rows`)."""
    stages: list[SimtConfig] = []
    for s in group.stages:
        stage = plan_stage(group, s, facts.regions, threads)
        if stage is None:
            return None
        stages.append(stage)
    staging = {}
    for k, st in enumerate(stages):
        si = info.stages[st.node]
        if si.stageable and (st.reduce_threads == 1 or stream):
            key = (st.node, stream)
            if key not in facts.steps:
                facts.steps[key] = StepOptions(si, facts.regions.members[st.node], shape_of, stream)
            staging[k] = facts.steps[key]
    if resident:
        smem = share_rows(info, stages, staging, threads, arch, facts, shape_of)
    else:
        smem = choose_steps(info, stages, staging, threads, arch)
    if smem is None:
        return None
    if stream:
        stages = [replace(st, stream=bool(st.staged)) for st in stages]
    regs = max(registers(st) for st in stages)
    if regs > arch.max_regs_per_thread:
        return None
    estimate = estimate_cost(info, facts, stages, threads, smem, regs, arch)
    if estimate is None:
        return None
    order = tuple(range(len(facts.tile)))
    return GroupConfig(group.root, facts.tile, facts.grid, order, threads, stages, smem, estimate)


#: Bytes a vectorised elementwise stage moves per load or store instruction (LDG.128 / STG.128).
VECTOR_BYTES = 16


def elementwise_vector(group: Group, shape_of: ShapeOf, dtype_of: DtypeOf, tile: Sequence[int]) -> int:
    """Elements per vector of a group's last stage, or 1 where it cannot have them.

    The last stage must be an injective one computing the root, an output of the group
    (others, written by earlier stages, keep their layouts): a float tensor whose rows and
    tile rows are whole vectors of 16 bytes (so a vector starts at a multiple of its width
    and lies wholly inside the tensor or wholly outside).  An elementwise group is one such
    stage; a normalisation's last stage (LayerNorm's scale and shift, softmax's division)
    is another, also where the group writes an earlier norm's output too (two layer norms
    in a row).  Loads whose innermost index is the output's
    innermost axis plus a multiple of the width become vector loads as well
    (:mod:`welder.codegen.simt`); the others stay one element at a time."""
    last = group.stages[-1] == group.root and group.root in group.outputs
    if not last or group.computes[group.root].is_reduction:
        return 1
    dtype = dtype_of(group.root)
    if dtype not in ("float16", "bfloat16", "float32"):
        return 1
    width = VECTOR_BYTES // np_dtype(dtype).itemsize
    shape = shape_of(group.root)
    if not shape or shape[-1] % width or tile[-1] % width:
        return 1
    return width


def _vector_twins(
    group: Group,
    info: _GroupInfo,
    facts: _Tile,
    configs: Sequence[GroupConfig],
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
) -> list[GroupConfig]:
    """The vectorised twin of each block size of a tile, where it has one.  In a group of
    several stages, a block with fewer vectors than half its threads gives way to the
    smaller block (planned and estimated as a scalar config first) that they fill; an
    elementwise group's twin keeps its block and needs every thread busy
    (:func:`vector_twin`), so a tile too small for a block has no twin of it."""
    width = elementwise_vector(group, shape_of, dtype_of, facts.tile)
    if width == 1:
        return []
    vectors = math.prod(facts.tile) // width
    twins: dict[int, GroupConfig] = {}
    for cfg in configs:
        threads = cfg.threads
        while len(group.stages) > 1 and threads > arch.warp_size and vectors * 2 < threads:
            threads //= 2
        if threads in twins:
            continue
        base = cfg if threads == cfg.threads else _config(group, info, facts, threads, shape_of, arch)
        twin = None if base is None else vector_twin(group, base, shape_of, dtype_of)
        if twin is not None:
            twins[threads] = twin
    return list(twins.values())


#: Most multiply-adds a window stage unrolls per thread (register tile times window).
MAX_WINDOW_UNROLL = 1024
#: Outputs a thread of a window stage computes in one run along the innermost axis, where the
#: tile allows: 8 outputs of a 3-wide window read 10 values instead of 24.
WINDOW_RUN = 8


def window_twin(group: Group, cfg: GroupConfig) -> GroupConfig | None:
    """``cfg`` with its first reduction stage laid out for a sliding window
    (``SimtConfig.window``), or None where that stage is no sliding window or it would not
    pay.  Stages before it (a prologue the window reads from shared memory: Conformer's GLU
    in front of its depthwise convolution) keep their layouts.

    The generic layout strides a thread's outputs by the thread count, so no two of them
    share an input, and walks the taps in a loop: a 3x3 depthwise convolution reads nine
    shared-memory elements per output, each through its own index and padding arithmetic
    (MobileNetV2's fused depthwise groups ran at 360-960 GB/s on the H100).  With ``R``
    contiguous outputs per thread and the taps unrolled, the ``R x K`` reads of a window
    row fall on ``R + K - 1`` distinct elements, which the compiler loads once: the same
    addresses, computed from constants.  The estimate is the generic one; the tuner
    measures the twin as a family of its own."""
    k = next((k for k, st in enumerate(cfg.stages) if group.computes[st.node].reduce_axes), 0)
    st = cfg.stages[k]
    c = group.computes[st.node]
    last = len(c.shape) - 1
    extents = [a.extent for a in c.reduce_axes]
    if (
        not isinstance(st, SimtConfig)
        or st.window
        or not c.reduce_axes
        or st.vector != 1
        or (st.rstep and tuple(st.rstep) != tuple(extents))
        or 2 * math.prod(extents) > MAX_WINDOW_UNROLL  # no run of two would fit the unroll
        or sliding_window(c) is None
    ):
        return None
    # One thread per output run, the taps walked by each (no threads split the reduction).
    for run in (WINDOW_RUN, WINDOW_RUN // 2, 2):
        if st.tile[last] % run:
            continue
        tshape, reg = thread_layout((*st.tile[:-1], st.tile[last] // run), cfg.threads)
        reg = (*reg[:-1], reg[-1] * run)
        if math.prod(reg) <= MAX_REG_TILE and math.prod(reg) * math.prod(extents) <= MAX_WINDOW_UNROLL:
            twin = replace(st, window=True, thread_shape=tshape, reg_tile=reg, reduce_threads=1)
            return replace(cfg, stages=[*cfg.stages[:k], twin, *cfg.stages[k + 1 :]])
    return None


def stream_twin(
    group: Group,
    cfg: GroupConfig,
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
    info: _GroupInfo | None = None,
) -> GroupConfig | None:
    """``cfg`` with the global inputs of its reductions staged through shared memory even
    where each element is read once, or None where that stages nothing more.

    A reduction split over threads reads its row one element per thread and instruction: a
    LayerNorm over 512 halves moves 2 bytes a load, too few in flight to stream from DRAM
    (Conformer's, at batch 64 fp16, ran at 2.8 times its traffic floor).  Staged, the same
    bytes arrive in 16-byte vectors from every thread of the block, and the reduction reads
    them from shared memory.  Where later reductions read the region an earlier one staged
    (a LayerNorm's sum of squares, a softmax's sum after its max) and the whole of it fits
    without costing blocks per SM, it is staged once and kept for them (:func:`share_rows`);
    otherwise each stages it step by step.  The estimate does not model load widths, so the
    twin is a family of its own (``simt_stream``) that the tuner measures beside the original.  A
    group whose reductions reuse an input (a product's operand, a window's halo) gets none
    (:func:`streams`)."""
    if any(not isinstance(st, SimtConfig) or st.window for st in cfg.stages):
        return None
    info = info or group_info(group, shape_of, dtype_of, arch)
    if not _streams(info) or not any(info.stages[st.node].stageable and not st.staged for st in cfg.stages):
        return None
    facts = _tile_facts(group, info, tuple(cfg.block_tile), shape_of, dtype_of, arch)
    twin = None
    if facts is not None:
        twin = _config(group, info, facts, cfg.threads, shape_of, arch, stream=True, resident=True)
        twin = twin or _config(group, info, facts, cfg.threads, shape_of, arch, stream=True)
    if twin is None or not any(st.stream for st in twin.stages):
        return None
    if cfg.stages[-1].vector > 1:
        twin = vector_twin(group, twin, shape_of, dtype_of) or twin
    return twin


def streams(group: Group, shape_of: ShapeOf, dtype_of: DtypeOf, arch: Arch) -> bool:
    """Whether ``group``'s configs may have streaming twins (:func:`stream_twin`)."""
    return _streams(group_info(group, shape_of, dtype_of, arch))


def shares_rows(group: Group, shape_of: ShapeOf, dtype_of: DtypeOf, arch: Arch) -> bool:
    """Whether ``group``'s streaming twins may stage an input once for several stages
    (:func:`share_rows`): two of its reductions may stage the same tensor, or a reduction
    one that an injective stage reads (an RMS norm's normalisation)."""
    info = group_info(group, shape_of, dtype_of, arch)
    if not _streams(info):
        return False
    staging = [t for si in info.stages.values() for t, _ in si.stageable]
    injective = {
        ld.tensor for si in info.stages.values() if not si.compute.is_reduction for ld in si.compute.loads()
    }
    return len(staging) > len(set(staging)) or bool(injective & set(staging))


def _streams(info: _GroupInfo) -> bool:
    """A reduction stage with global inputs to stage, and no stage that reuses one (a
    product's operand: staging already serves it, and the places the twin would take in
    the measurement belong to the kinds built for products)."""
    stages = info.stages.values()
    return any(si.stageable for si in stages) and not any(_reuses_inputs(si) for si in stages)


def _reuses_inputs(stage: _StageInfo) -> bool:
    """Whether a reduction stage reads some global input element for several outputs: a
    load whose indices leave out an output axis (a matmul's operands) or move with a
    reduce axis along an output axis (a convolution's window)."""
    c = stage.compute
    if not c.is_reduction:
        return False
    outputs = {a.name for a in c.axes if a.extent > 1}
    staged = {t for t, _ in stage.stageable}
    return any(
        not outputs <= set().union(*(free_vars(i) for i in ld.indices)) or reads_through_window(ld, c)
        for ld in c.loads()
        if ld.tensor in staged
    )


def vector_twin(group: Group, cfg: GroupConfig, shape_of: ShapeOf, dtype_of: DtypeOf) -> GroupConfig | None:
    """``cfg`` with its last stage vectorised (same tile, block and estimate: the tuner's
    measurement tells the twins apart), or None where it cannot be."""
    stage = cfg.stages[-1]
    if stage.node != group.root or stage.reduce_threads != 1:
        return None
    width = elementwise_vector(group, shape_of, dtype_of, stage.tile)
    if width == 1:
        return None
    units = (*stage.tile[:-1], stage.tile[-1] // width)
    if len(group.stages) == 1 and not _fills(units, cfg.threads):
        return None  # an elementwise group: some thread would idle or do less than the others
    if math.prod(units) * 2 < cfg.threads and cfg.threads > 32:
        return None  # most of the block would idle
    tshape, reg = thread_layout(units, cfg.threads)
    if math.prod(reg) * width > MAX_REG_TILE:
        return None
    twin = replace(stage, thread_shape=tshape, reg_tile=reg, vector=width)
    return replace(cfg, stages=[*cfg.stages[:-1], twin])


def reduce_vector(
    group: Group,
    info: _GroupInfo,
    stage: SimtConfig,
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    tiles: Mapping[str, Sequence[int]] | None = None,
) -> int:
    """Elements per vector along the innermost reduce axis of ``stage``, or 1 where it cannot
    have them: a reduction split over threads (``reduce_threads`` > 1) that stages nothing
    and reads no input element for several outputs (:func:`_reuses_inputs`: a product's
    operands belong to the kinds built for products), with a float input read
    unconditionally whose innermost index steps through aligned vectors as that axis does
    (:func:`steps_in_vectors`; its rows whole vectors), a reduce axis a whole number of
    vectors long, and at least one vector for each thread.  The input is a global one, or
    a member whose whole rows an earlier stage keeps in shared memory (``tiles``: member ->
    its tile; a layer norm's output that a second layer norm reduces).  The width is 16
    bytes of the widest such input."""
    c = group.computes[stage.node]
    if not c.is_reduction or stage.reduce_threads < 2 or stage.staged or stage.window:
        return 1
    if _reuses_inputs(info.stages[stage.node]):
        return 1
    axis = c.reduce_axes[-1]
    # whole rows, not a reduction's one value a row (a mean kept beside the row it is of)
    rows_kept = {t for t, tile in (tiles or {}).items() if tile and tile[-1] == shape_of(t)[-1] > 1}
    loads = [
        ld
        for ld in unconditional_loads(c.body)
        if (ld.tensor in group.inputs or ld.tensor in rows_kept)
        and ld.indices
        and dtype_of(ld.tensor) in ("float16", "bfloat16", "float32")
    ]
    points = info.stages[stage.node].points
    for width in sorted({VECTOR_BYTES // np_dtype(dtype_of(ld.tensor)).itemsize for ld in loads}):
        if axis.extent % width or points // width < stage.reduce_threads:
            continue
        rows = [ld for ld in loads if shape_of(ld.tensor)[-1] % width == 0]
        if any(steps_in_vectors(ld, axis.name, width) for ld in rows):
            return width
    return 1


def reduce_vector_twin(
    group: Group,
    cfg: GroupConfig,
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
    info: _GroupInfo | None = None,
) -> GroupConfig | None:
    """``cfg`` with every reduction that can (:func:`reduce_vector`) walking its row in
    16-byte vectors, estimated again (a thread takes a vector in turn where it took an
    element), or None where no stage can.  A family of its own (``simt_vector``, where its
    first stage reads in vectors), so the tuner measures both forms.

    A reduction of few outputs split over many threads is latency-bound: a thread has one
    element's load in flight per point it takes.  BSRN's contrast reduces 65,536 halves a
    channel over 1,024 threads; its mean alone took 11.7 us on an H200 (64 points a
    thread), against a floor of 1.7 us for its 8 MB."""
    if any(not isinstance(st, SimtConfig) for st in cfg.stages):
        return None
    info = info or group_info(group, shape_of, dtype_of, arch)
    tiles = {st.node: st.tile for st in cfg.stages if st.smem_offset is not None}
    widths = [reduce_vector(group, info, st, shape_of, dtype_of, tiles) for st in cfg.stages]
    stages = [replace(st, rvector=w) if w > 1 else st for st, w in zip(cfg.stages, widths)]
    facts = _tile_facts(group, info, tuple(cfg.block_tile), shape_of, dtype_of, arch)
    if facts is None or all(st.rvector == 1 for st in stages):
        return None
    regs = max(registers(st) for st in stages)
    if regs > arch.max_regs_per_thread:
        return None
    estimate = estimate_cost(info, facts, stages, cfg.threads, cfg.smem_bytes, regs, arch)
    return None if estimate is None else replace(cfg, stages=stages, estimate=estimate)


#: Vectors a thread holds for the stages after its reduction (:func:`held_twin`): 128 bytes,
#: 32 registers.
MAX_HELD_VECTORS = 8


def held_twin(
    group: Group,
    cfg: GroupConfig | None,
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
    info: _GroupInfo | None = None,
) -> GroupConfig | None:
    """``cfg`` (a twin reading a reduction in vectors: :func:`reduce_vector_twin`) with that
    reduction holding the vectors it loads in registers and the normalisation after it laid
    out over the same vectors at the same threads, so that it and the reductions between read
    the row from registers (``SimtConfig.hold``); None where the layouts cannot meet.  A
    family of its own (``simt_held``), so the tuner measures it beside the others.

    A layer norm's block loads its rows from DRAM, reduces, then reads them twice more from
    the caches: the DRAM phase is a third of the block's life, so an SM has a third of its
    blocks' rows in flight. Conformer b64 fp16's layer norm ran at 2.9 TB/s (22.9 us for 67
    MB) on the H200, whatever its block, vector or shared-memory layout.  Held, the block's
    one load is most of its life.

    The layouts meet where the reduction (the group's first reading in vectors) has one
    reduce axis walked by ``reduce_threads`` threads an output, each taking the same number
    of vectors (at most :data:`MAX_HELD_VECTORS`), one output a thread, and the group's last
    stage is an injective one over the same rows whose innermost axis is the whole reduce
    axis, vectorised to the same width: its thread ``t`` then takes the vectors the
    reduction's thread ``t`` loaded, in the same order."""
    if cfg is None or any(not isinstance(st, SimtConfig) for st in cfg.stages):
        return None
    info = info or group_info(group, shape_of, dtype_of, arch)
    first = next((k for k, st in enumerate(cfg.stages) if st.rvector > 1), None)
    if first is None:
        return None
    red, last = cfg.stages[first], cfg.stages[-1]
    axes = info.stages[red.node].compute.reduce_axes
    vectors = axes[-1].extent // red.rvector if len(axes) == 1 else 0
    held = vectors // red.reduce_threads
    shape = len(last.tile)
    rows = held_rows(red.tile, shape)
    if not 1 <= held <= MAX_HELD_VECTORS or vectors % red.reduce_threads or rows is None:
        return None
    if math.prod(red.reg_tile) != 1 or tuple(red.tile[:rows]) != tuple(last.tile[:-1]):
        return None
    if last.tile[-1] != vectors * red.rvector or cfg.threads != math.prod(red.tile) * red.reduce_threads:
        return None
    if elementwise_vector(group, shape_of, dtype_of, last.tile) != red.rvector or last.reduce_threads != 1:
        return None
    if tuple(red.thread_shape) != tuple(red.tile):
        return None
    out = replace(
        last,
        thread_shape=(*red.thread_shape[:rows], red.reduce_threads),
        reg_tile=(*([1] * (shape - 1)), held),
        vector=red.rvector,
    )
    stages = [*cfg.stages[:first], replace(red, hold=True), *cfg.stages[first + 1 : -1], out]
    facts = _tile_facts(group, info, tuple(cfg.block_tile), shape_of, dtype_of, arch)
    regs = max(registers(st) for st in stages) + held * VECTOR_BYTES // 4
    if facts is None or regs > arch.max_regs_per_thread:
        return None
    estimate = estimate_cost(info, facts, stages, cfg.threads, cfg.smem_bytes, regs, arch)
    return None if estimate is None else replace(cfg, stages=stages, estimate=estimate)


def held_rows(reduced: Sequence[int], rank: int) -> int | None:
    """How many leading axes of a reduction's output ``reduced`` are the rows of a stage of
    ``rank`` axes whose innermost axis is the reduce axis: all of them, or all but a kept
    reduce axis of extent 1; None where they cannot be."""
    if len(reduced) == rank - 1:
        return rank - 1
    if rank and len(reduced) == rank and reduced[-1] == 1:
        return rank - 1
    return None


def steps_in_vectors(ld: Load, var: str, width: int) -> bool:
    """Whether ``ld`` reads ``width`` contiguous, aligned elements as ``var`` steps through a
    vector of that many: ``var`` appears in the innermost index alone, with coefficient 1,
    beside terms and a constant that are multiples of ``width`` (so that, in rows of whole
    vectors, a vector starting at a multiple of ``width`` is aligned)."""
    if not ld.indices or any(var in free_vars(i) for i in ld.indices[:-1]):
        return False
    form = affine_form(ld.indices[-1])
    if form is None or form.coefs.get(var) != 1:
        return False
    return form.const % width == 0 and all(c % width == 0 for v, c in form.terms if v != var)


def unconditional_loads(e: Expr) -> list[Load]:
    """The loads every element evaluates: not those in a branch of a Select (a Concat's or
    a Pad's other side, whose indices may lie outside its tensor where it is not taken),
    nor those addressed by other loads (a gather's)."""
    found: list[Load] = []
    stack = [e]
    while stack:
        n = stack.pop()
        if isinstance(n, Load):
            if not any(isinstance(x, Load) for i in n.indices for x in walk(i)):
                found.append(n)
        elif isinstance(n, Select):
            stack.append(n.cond)
        else:
            stack.extend(n.children())
    return found


def _fills(extents: Sequence[int], threads: int) -> bool:
    """True if ``threads`` laid out over ``extents`` (:func:`thread_layout`) all have work,
    the same amount each: the extents are a whole number of the threads' register tiles."""
    tshape, reg = thread_layout(extents, threads)
    return math.prod(tshape) == threads and all(t * r == e for t, r, e in zip(tshape, reg, extents))


def thread_layout(extents: Sequence[int], threads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Threads per axis and the register tile each thread covers.

    Threads go to the innermost axis first (coalesced global accesses), then pairs of
    threads move outwards while the register tile is lopsided: a square-ish register
    tile lets each loaded value feed several outputs (a 128x128 matmul tile on 256
    threads becomes 16x16 threads of 8x8 outputs, not 2x128 threads of 64x1)."""
    shape = [1] * len(extents)
    left = threads
    for d in reversed(range(len(extents))):
        shape[d] = max(1, min(left, extents[d]))
        left //= shape[d]
        if left <= 1:
            break

    def reg(d: int) -> int:
        return -(-extents[d] // shape[d])

    for inner in reversed(range(1, len(extents))):
        outer = inner - 1
        while (
            shape[inner] >= 2 * MIN_INNER_THREADS
            and shape[inner] % 2 == 0
            and reg(outer) >= 2 * reg(inner) * 2
            and shape[outer] * 2 <= extents[outer]
        ):
            shape[inner] //= 2
            shape[outer] *= 2
    return tuple(shape), tuple(reg(d) for d in range(len(extents)))


def plan_stage(group: Group, name: str, regions: GroupRegions, threads: int) -> SimtConfig | None:
    """Threads and register tile of one stage; threads the spatial tile leaves idle split
    the reduction (a power of two, combined by shuffles).  Reduction steps and staging
    come later (``choose_steps``): they depend on what else shares the block's memory."""
    c = group.computes[name]
    extents = regions.members[name].extents
    tshape, reg = thread_layout(extents, threads)
    if math.prod(reg) > MAX_REG_TILE:
        return None
    used = math.prod(tshape)
    reduce_threads = 1
    total_reduce = math.prod(a.extent for a in c.reduce_axes)
    if c.is_reduction and used < threads:
        reduce_threads = 1 << int(math.log2(max(1, min(threads // used, total_reduce))))
    stage = SimtConfig(name, tuple(extents), tshape, reg, reduce_threads, write_global=name in group.outputs)
    if c.is_reduction:
        stage.rstep = tuple(a.extent for a in c.reduce_axes)
    return stage


def choose_steps(
    info: _GroupInfo, stages: list[SimtConfig], staging: dict[int, StepOptions], threads: int, arch: Arch
) -> int | None:
    """Reduction steps and staged inputs for the stages in ``staging`` (by position), and
    the group's shared-memory plan; returns its size, or None if nothing fits.

    Every stage starts at its largest step; while the plan exceeds the budget, the stage
    with the largest staging buffers shrinks to its next step that may fit.  The budget first keeps the
    blocks per SM that threads and registers allow (staging never costs occupancy); if even
    the smallest coalesced steps exceed it, they are sized for as many blocks as that
    smallest plan allows.  Steps that cut loads below a transaction are the last resort,
    before the tile is given up."""
    if not staging:
        smem = plan_smem(info, stages)
        return smem if smem <= arch.smem_per_block else None
    at = {k: 0 for k in staging}

    def apply() -> int:
        for k, opts in staging.items():
            _apply_step(stages[k], opts.get(at[k]), opts.whole)
        return plan_smem(info, stages)

    def shrink(budget: int, coalesced_only: bool) -> tuple[bool, int]:
        for k in at:
            at[k] = 0
        while True:
            smem = apply()
            if smem <= budget:
                return True, smem
            staged = {k: staging[k].get(at[k]).nbytes for k in staging}
            for k in sorted(staging, key=lambda k: (-staged[k], k)):
                if not staged[k]:
                    return False, smem
                nxt = staging[k].smaller(at[k], staged[k] - (smem - budget), coalesced_only)
                if nxt is not None:
                    at[k] = nxt
                    break
            else:
                return False, smem

    apply()  # the largest steps' vector widths: staging's registers count against occupancy
    regs = max(registers(st) for st in stages)
    blocks = max(1, min(_blocks_per_sm_without_smem(threads, regs, arch)))
    budget = min(arch.smem_per_block, arch.smem_per_sm // blocks)
    for coalesced_only in (True, False):
        ok, smem = shrink(budget, coalesced_only)
        if ok:
            return smem
        if smem <= arch.smem_per_block:
            fewer = min(arch.smem_per_block, arch.smem_per_sm // max(1, arch.smem_per_sm // smem))
            return shrink(fewer, coalesced_only)[1]
    return None


def share_rows(
    info: _GroupInfo,
    stages: list[SimtConfig],
    staging: dict[int, StepOptions],
    threads: int,
    arch: Arch,
    facts: _Tile,
    shape_of: ShapeOf,
) -> int | None:
    """Whole reductions staged once: each stage in ``staging`` (by position) stages its
    inputs over its whole reduction in one step, and a later stage that needs the same
    region of a tensor as the last stage that loaded it -- a reduction, or an injective
    stage such as the normalisation after them -- reads that stage's buffer, kept alive for
    it, instead of loading it again (``StagedInput.resident``).

    A LayerNorm's sum, sum of squares and normalisation read the same row: staged step by
    step, each reduction loaded it and the normalisation read it a third time, and Conformer
    b64 fp16's streaming twins still ran at 2.5 times their traffic floor.  Returns the size
    of the shared-memory plan, or None where no region is shared or the plan costs blocks
    per SM that the threads and registers allow."""
    last: dict[str, tuple[Region, StagedInput]] = {}
    shared = False
    for k, st in enumerate(stages):
        c = info.stages[st.node].compute
        if k in staging:
            opts = staging[k]
            _apply_step(st, opts.whole_step(), opts.whole)
            reads = read_regions(c, opts.region.dims, opts.shape_of, opts.whole)
            for j, sd in enumerate(st.staged):
                if sd.tensor in last and _same_on_grid(last[sd.tensor][0], reads[sd.tensor], facts.grid):
                    st.staged[j] = replace(sd, resident=True)
                    shared = True
                else:
                    last[sd.tensor] = (reads[sd.tensor], sd)
        elif not c.is_reduction and not st.staged:
            reads = read_regions(c, facts.regions.members[st.node].dims, shape_of)
            grid = facts.grid
            kept = [sd for t, (r, sd) in last.items() if t in reads and _same_on_grid(reads[t], r, grid)]
            st.staged = [replace(sd, offset=0, resident=True) for sd in kept]
            shared |= bool(kept)
    if not shared:
        return None
    smem = plan_smem(info, stages)
    regs = max(registers(st) for st in stages)
    blocks = max(1, min(_blocks_per_sm_without_smem(threads, regs, arch)))
    return smem if smem <= min(arch.smem_per_block, arch.smem_per_sm // blocks) else None


def _same_on_grid(a: Region, b: Region, grid: Sequence[int]) -> bool:
    """Whether two regions of a block, affine in its coordinates ``b<d>``, are the same box
    in every block of ``grid``: the same at block 0 and one block along each axis the grid
    has more than one of (a whole row's ``[512*b2, +512)`` is ``[0, +512)`` in a grid of one
    block along that axis)."""
    names = [f"b{d}" for d in range(len(grid))]
    blocks = [dict.fromkeys(names, 0)]
    blocks += [{**blocks[0], names[d]: 1} for d, n in enumerate(grid) if n > 1]
    return a.extents == b.extents and all(a.at(env) == b.at(env) for env in blocks)


def _apply_step(stage: SimtConfig, option: StepOption, whole: tuple[int, ...]) -> None:
    if not option.staged:
        stage.rstep, stage.staged = whole, []  # nothing worth staging: one pass over global memory
        return
    stage.rstep = option.rstep
    stage.staged = [StagedInput(t, ext, 0, v, shift) for t, ext, v, shift in option.staged]


def _distinct_loads(c: Compute) -> list[Load]:
    out, seen = [], set()
    for ld in c.loads():
        if ld.tensor not in seen:
            seen.add(ld.tensor)
            out.append(ld)
    return out


def _data_dependent(e) -> bool:
    return any(isinstance(n, Load) for n in walk(e))


def vector_width(region: Region, shape: Sequence[int], extents: Sequence[int]) -> int:
    """Widest vector (4, 2, 1 elements) that keeps every load aligned and in bounds (see
    :func:`vector_aligned`)."""
    return next((v for v in (4, 2) if vector_aligned(region, shape, extents, v)), 1)


def vector_aligned(
    region: Region, shape: Sequence[int], extents: Sequence[int], width: int, shift: int = 0
) -> bool:
    """True if loads of ``width`` elements along the innermost axis start at multiples of
    ``width`` in every block and step: the tensor's rows, the buffer's innermost extent and
    the buffer's innermost origin (the region's, ``shift`` elements earlier) all divide, so
    a vector is wholly inside the tensor or wholly outside it."""
    if not shape:
        return False
    aff = region.dims[-1].affine
    return (
        shape[-1] % width == 0
        and extents[-1] % width == 0
        and aff is not None
        and (aff.const - shift) % width == 0
        and aff.coefs_divisible_by(width)
    )


#: A staging buffer may grow by at most this share to start its vectors aligned.
SUPERSET_GROWTH = 1.5


def aligned_superset(region: Region, shape: Sequence[int], itemsize: int) -> tuple[tuple[int, ...], int, int]:
    """``(extents, vector, shift)`` of a staging buffer that starts ``shift`` elements before
    ``region`` along the innermost axis and rounds its extent up, so that 16-byte vectors
    start aligned -- where only the region's constant offset (a halo) spoils the alignment
    and the buffer grows by at most ``SUPERSET_GROWTH``; else the region as it is, in
    single elements.  A depthwise 3x3 convolution's 66-wide rows become 72 halves loaded 8
    at a time instead of 66 loads of one."""
    extents = tuple(region.extents)
    width = VECTOR_BYTES // itemsize
    aff = region.dims[-1].affine if shape else None
    if width < 2 or aff is None or shape[-1] % width or not aff.coefs_divisible_by(width):
        return extents, 1, 0
    shift = aff.const % width
    inner = -(-(shift + extents[-1]) // width) * width
    if inner > SUPERSET_GROWTH * extents[-1]:
        return extents, 1, 0
    return (*extents[:-1], inner), min(width, 4), shift


def plan_smem(info: _GroupInfo, stages: list[SimtConfig]) -> int:
    """Lay out intermediate tiles and staging buffers; fills in their offsets."""
    return place_smem(info, stages)[1]


def place_smem(
    info: _GroupInfo, stages: list[SimtConfig], extra: Sequence[Buffer] = ()
) -> tuple[dict[str, int], int]:
    """:func:`plan_smem` with ``extra`` buffers (another kind's, live over the stages they
    name) sharing the pool; the offsets of every buffer, and the pool's size."""
    buffers: list[Buffer] = list(extra)
    loaded: dict[str, int] = {}  # tensor -> the buffer that its last loading stage staged it in
    names: dict[tuple[int, int], str] = {}
    for k, st in enumerate(stages):
        si = info.stages[st.node]
        if si.last_reader is not None:
            buffers.append(Buffer(st.node, math.prod(st.tile) * si.elem, k, si.last_reader))
        for j, sd in enumerate(st.staged):
            if sd.resident:  # the loader's buffer, kept alive up to this stage
                b = buffers[loaded[sd.tensor]]
                buffers[loaded[sd.tensor]] = replace(b, end=k)
                names[k, j] = b.name
                continue
            names[k, j] = f"{st.node}/{sd.tensor}"
            loaded[sd.tensor] = len(buffers)
            buffers.append(Buffer(names[k, j], math.prod(sd.extents) * info.itemsize(sd.tensor), k, k))
        if st.reduce_threads > 32:
            # One slot per (output, warp, register) of 8 value bytes plus 4 index bytes.
            slots = math.prod(st.thread_shape) * (st.reduce_threads // 32) * math.prod(st.reg_tile)
            buffers.append(Buffer(f"{st.node}/reduce", slots * 12, k, k))
    offsets, total = plan_pool(buffers)
    for k, st in enumerate(stages):
        st.smem_offset = offsets.get(st.node)
        for j, sd in enumerate(st.staged):
            sd.offset = offsets[names[k, j]]
        st.reduce_offset = offsets.get(f"{st.node}/reduce")
    return offsets, total


def registers(stage: SimtConfig) -> int:
    staging = sum(sd.vector for sd in stage.staged if not sd.resident)
    vectors = math.prod(stage.reg_tile) * stage.rvector if stage.rvector > 1 else 0
    return BASE_REGISTERS + math.prod(stage.reg_tile) * stage.vector + staging + vectors


# -- cost -----------------------------------------------------------------------------------------


def _blocks_per_sm_without_smem(threads: int, regs: int, arch: Arch) -> list[int]:
    return [
        arch.max_blocks_per_sm,
        arch.max_threads_per_sm // threads,
        arch.regs_per_sm // (max(regs, 32) * threads),
    ]


def blocks_per_sm(threads: int, regs: int, smem: int, arch: Arch) -> int:
    """Blocks of ``threads`` threads, ``regs`` registers each and ``smem`` bytes of shared
    memory that one SM holds at once (0: none fits)."""
    per_sm = _blocks_per_sm_without_smem(threads, regs, arch)
    if smem:
        per_sm.append(arch.smem_per_sm // smem)
    return min(per_sm)


def estimate_cost(
    info: _GroupInfo, facts: _Tile, stages: list[SimtConfig], threads: int, smem: int, regs: int, arch: Arch
) -> Estimate | None:
    blocks = math.prod(facts.grid)
    per_sm = blocks_per_sm(threads, regs, smem, arch)
    if per_sm < 1:
        return None
    concurrency = per_sm * arch.sm_count
    waves = -(-blocks // concurrency)
    smem_block = sum(_smem_traffic(info, st) for st in stages)
    latency = _kernel_time(blocks, per_sm, threads, facts.dram_bytes, facts.flops_block, smem_block, arch)
    # A wave lasts at least its threads' serial chain, and the last wave's chain is exposed
    # whatever overlapped before it.
    chain = serial_points(info, stages) * SERIAL_POINT_CYCLES / (arch.clock_ghz * 1e3)
    latency = max(latency, waves * chain) + chain
    return Estimate(
        blocks=blocks,
        blocks_per_sm=per_sm,
        waves=waves,
        read_bytes=facts.read_block * blocks,
        write_bytes=facts.write_block * blocks,
        compulsory_bytes=facts.compulsory,
        flops=facts.flops_block * blocks,
        smem_bytes=smem,
        regs_per_thread=regs,
        latency_us=round(latency, 4),
    )


def io_bytes(group: Group, shape_of: ShapeOf, dtype_of: DtypeOf) -> int:
    """Bytes of every tensor the kernel reads or writes in global memory, each once."""
    return sum(
        math.prod(shape_of(t)) * np_dtype(dtype_of(t)).itemsize for t in (*group.inputs, *group.outputs)
    )


def _dram_equivalent_bytes(per_block: int, blocks: int, compulsory: int, arch: Arch) -> float:
    """Per-block traffic weighted by where it is served from.  Every tensor is fetched from
    DRAM once (compulsory traffic); blocks re-reading what another block read -- the
    weights every row tile of a matmul reads, halos -- hit L2 when the whole footprint fits
    there, which is the common case at inference batch sizes and what lets small tiles win
    when they buy parallelism."""
    total = per_block * blocks
    if total == 0:
        return 0.0
    if compulsory > arch.l2_bytes:
        return float(per_block)
    reread = (total - compulsory) / total
    return per_block * ((1 - reread) + reread * arch.global_bw_gbs / arch.l2_bw_gbs)


def _kernel_time(
    blocks: int,
    blocks_per_sm: int,
    threads: int,
    bytes_block: float,
    flops_block: int,
    smem_block: int,
    arch: Arch,
) -> float:
    """Microseconds: full waves, then the partial last wave on the SMs it occupies.

    A wave's time is set by its busiest SM.  An SM gets its share of DRAM bandwidth, or up
    to SM_BANDWIDTH_SHARE times that share when few SMs are busy, and reaches its rates only
    with enough warps in flight to hide latency: below WARPS_PER_PARTITION resident warps
    per SM partition, every rate scales down in proportion.  However little the blocks do,
    the kernel takes at least ``BLOCK_ISSUE_CYCLES`` per block to start them all."""
    dram = arch.global_bw_gbs * 1e3 * DRAM_EFFICIENCY  # bytes per microsecond
    flops_sm = arch.fp32_tflops * 1e6 * COMPUTE_EFFICIENCY / arch.sm_count
    smem_sm = arch.smem_bw_gbs * 1e3 / arch.sm_count

    def wave(per_sm: int, active: int) -> float:
        bw = min(dram / active, SM_BANDWIDTH_SHARE * dram / arch.sm_count)
        occupancy = min(1.0, per_sm * threads / arch.warp_size / (WARPS_PER_PARTITION * arch.sm_partitions))
        return per_sm * max(bytes_block / bw, flops_block / flops_sm, smem_block / smem_sm) / occupancy

    concurrency = blocks_per_sm * arch.sm_count
    full, rest = divmod(blocks, concurrency)
    t = full * wave(blocks_per_sm, arch.sm_count)
    if rest:
        active = min(arch.sm_count, rest)
        t += wave(-(-rest // active), active)
    issue = blocks * BLOCK_ISSUE_CYCLES / (arch.clock_ghz * 1e3)
    return max(t, issue) + LAUNCH_OVERHEAD_US


def serial_points(info: _GroupInfo, stages: Sequence[SimtConfig]) -> int:
    """Reduction points one thread combines in turn, over every stage of a block: a
    stage's reduction over the threads that split it, counting a vector
    (``SimtConfig.rvector``) as one point."""
    return sum(
        -(-info.stages[st.node].points // (st.reduce_threads * st.rvector))
        for st in stages
        if info.stages[st.node].compute.is_reduction
    )


def _smem_traffic(info: _GroupInfo, st: SimtConfig) -> int:
    """On-chip bytes a block reads for this stage: each thread loads a value once per
    register-tile position its index depends on, per reduction point.  Reads of shared
    memory count, and in a reduction so do global inputs it does not stage: after the first
    touch they are L1 hits, and L1 shares its array and bandwidth with shared memory -- so a
    reduction split over threads without staging is not free of the loads staging saves."""
    si = info.stages[st.node]
    c = si.compute
    on_chip = {sd.tensor for sd in st.staged} | (set(info.stages) - {st.node})
    active = math.prod(st.thread_shape) * st.reduce_threads
    reduce_points = math.prod(a.extent for a in c.reduce_axes) // max(1, st.reduce_threads)
    total = 0
    for tensor, deps, elem in si.loads:
        if tensor not in on_chip and not c.is_reduction:
            continue
        per_thread = math.prod(st.reg_tile[d] for d in deps)
        total += active * per_thread * reduce_points * elem
    return total
