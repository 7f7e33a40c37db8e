"""The scheduling policy: candidate configs for one fused group, ranked by the cost model.

1. The *base tile* is the smallest root tile that makes no block recompute a whole
   intermediate another block also computes: a root axis that some intermediate stage
   does not depend on (a softmax row statistic along the row) must be one block wide.
2. A best-first search grows the tile one axis at a time through powers of two,
   divisors and the full extent, ranking each by estimated latency (traffic rounded to
   transactions, times waves).
3. For every tile the per-stage decisions follow: threads over the tile's axes (innermost
   first, so loads and stores coalesce), a register tile per thread, inter-thread
   reduction where the spatial tile is smaller than the block, which global inputs to
   stage in shared memory and the reduction step that keeps those loads coalesced and
   fits, vector widths, and a best-fit shared-memory plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from welder.arch import Arch
from welder.ir.compute import Compute
from welder.ir.expr import Binary, Call, Load, free_vars, walk
from welder.ir.interpret import np_dtype
from welder.schedule.config import Estimate, GroupConfig, StageConfig, StagedInput
from welder.schedule.group import Group
from welder.tile.footprint import Buffer, plan_pool, transaction_bytes
from welder.tile.propagate import (
    GroupRegions,
    Region,
    partitions_output,
    propagate_group,
    read_regions,
)
from welder.tile.region import Affine

MAX_THREADS = 256
MAX_REG_TILE = 64  # outputs per thread, so accumulators stay in registers
MIN_INNER_THREADS = 8  # consecutive threads along the innermost axis: 32-byte sectors for fp32
BASE_REGISTERS = 24
LAUNCH_OVERHEAD_US = 2.0
DRAM_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.6
SM_BANDWIDTH_SHARE = 3.0
SATURATING_WARPS = 16


ShapeOf = Callable[[str], tuple[int, ...]]
DtypeOf = Callable[[str], str]


@dataclass(frozen=True)
class Options:
    topk: int = 1
    max_candidates: int = 256
    max_threads: int = MAX_THREADS


def schedule_group(
    group: Group, shape_of: ShapeOf, dtype_of: DtypeOf, arch: Arch, options: Options = Options()
) -> list[GroupConfig]:
    """The ``topk`` best valid configs, best first; empty if none fits the arch."""
    root_shape = shape_of(group.root)
    base = base_tile(group, shape_of)
    axis_choices = [axis_candidates(e, b) for e, b in zip(root_shape, base)]
    start = tuple(c[0] for c in axis_choices)

    def evaluate(pos: tuple[int, ...]) -> GroupConfig | None:
        tile = tuple(c[p] for c, p in zip(axis_choices, pos))
        return make_config(group, tile, shape_of, dtype_of, arch, options)

    seen = {(0,) * len(start)}
    first = evaluate((0,) * len(start))
    heap: list[tuple[float, tuple[int, ...], GroupConfig]] = []
    if first is not None:
        heap.append((first.estimate.latency_us, (0,) * len(start), first))
    results: list[GroupConfig] = []
    evaluated = 1
    while heap and evaluated < options.max_candidates:
        _, pos, cfg = heapq.heappop(heap)
        results.append(cfg)
        for d in range(len(pos)):
            nxt = (*pos[:d], pos[d] + 1, *pos[d + 1 :])
            if nxt[d] >= len(axis_choices[d]) or nxt in seen:
                continue
            seen.add(nxt)
            evaluated += 1
            cand = evaluate(nxt)
            if cand is not None:
                heapq.heappush(heap, (cand.estimate.latency_us, nxt, cand))
    results.extend(c for _, _, c in heap)
    results.sort(
        key=lambda c: (c.estimate.latency_us, c.estimate.read_bytes + c.estimate.write_bytes, c.block_tile)
    )
    return diverse_topk(results, options.topk)


def diverse_topk(ranked: list[GroupConfig], k: int) -> list[GroupConfig]:
    """The best ``k`` configs, except that no block size takes more than a third of the
    places while others are available: the cost model is least sure how block size trades
    occupancy against reuse, so measurement should see several."""
    cap = max(1, -(-k // 3))
    chosen: list[GroupConfig] = []
    per_size: dict[int, int] = {}
    for cfg in ranked:
        if len(chosen) < k and per_size.get(cfg.threads, 0) < cap:
            chosen.append(cfg)
            per_size[cfg.threads] = per_size.get(cfg.threads, 0) + 1
    chosen += [c for c in ranked if all(c is not x for x in chosen)][: k - len(chosen)]
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


# -- one config ---------------------------------------------------------------------------------


def make_config(
    group: Group,
    tile: tuple[int, ...],
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
    options: Options = Options(),
) -> GroupConfig | None:
    """Every per-stage decision for one root tile, or None if it breaks a limit."""
    root_shape = shape_of(group.root)
    grid = tuple(-(-s // t) for s, t in zip(root_shape, tile))
    regions = _propagate(group, tile, shape_of)
    for out in group.outputs:
        if out != group.root and not partitions_output(regions.members[out], shape_of(out), tile, grid):
            return None
    root_elems = math.prod(tile)
    threads = choose_threads(root_elems, options.max_threads, arch.warp_size)
    stages: list[StageConfig] = []
    for s in group.stages:
        stage = plan_stage(group, s, regions, threads, shape_of, dtype_of)
        if stage is None:
            return None
        stages.append(stage)
    smem = _plan_smem(group, stages, dtype_of)
    if smem > arch.smem_per_block:
        return None
    regs = max(_registers(st) for st in stages)
    if regs > arch.max_regs_per_thread:
        return None
    estimate = estimate_cost(group, stages, regions, grid, threads, smem, regs, shape_of, dtype_of, arch)
    if estimate is None:
        return None
    order = tuple(range(len(tile)))
    return GroupConfig(group.root, tile, grid, order, threads, stages, smem, estimate)


def choose_threads(root_elems: int, max_threads: int, warp: int) -> int:
    """A multiple of the warp size, about 8 root outputs per thread, at most ``max_threads``."""
    want = max(warp, 1 << max(0, math.ceil(math.log2(max(1, root_elems / 8)))))
    return min(max_threads, want)


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


def plan_stage(
    group: Group, name: str, regions: GroupRegions, threads: int, shape_of: ShapeOf, dtype_of: DtypeOf
) -> StageConfig | None:
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
    stage = StageConfig(name, tuple(extents), tshape, reg, reduce_threads, write_global=name in group.outputs)
    if c.is_reduction:
        stage.rstep = tuple(a.extent for a in c.reduce_axes)
        if reduce_threads == 1:
            _choose_staging(c, stage, regions.members[name], shape_of, set(group.inputs))
    return stage


def _choose_staging(
    c: Compute, stage: StageConfig, region: Region, shape_of: ShapeOf, external: set[str]
) -> None:
    """Stage global inputs (``external``) that several threads reuse, one reduction step
    at a time."""
    elem = np_dtype(c.dtype).itemsize
    target = max(1, 128 // elem)  # one 128-byte line along the innermost reduce axis
    rstep = []
    budget = target
    for a in reversed(c.reduce_axes):
        r = a.extent if a.extent <= budget else _pow2_floor(budget)
        rstep.append(max(1, r))
        budget = max(1, budget // max(1, r))
    stage.rstep = tuple(reversed(rstep))
    per_step = read_regions(c, region.dims, shape_of, stage.rstep)
    outputs = math.prod(stage.tile)
    step_points = outputs * math.prod(stage.rstep)
    for ld in _distinct_loads(c):
        if ld.tensor not in external or ld.tensor in (s.tensor for s in stage.staged):
            continue
        # The buffer spans the whole region, halo outside the tensor included (zero-filled),
        # so kernels index it with the same offsets the region was computed with.
        extents = per_step[ld.tensor].extents
        if any(_data_dependent(i) for i in ld.indices):
            continue
        if step_points < 2 * math.prod(per_step[ld.tensor].clipped_extents(shape_of(ld.tensor))):
            continue  # read about once per element: staging buys nothing
        stage.staged.append(
            StagedInput(
                ld.tensor, extents, 0, _vector_width(per_step[ld.tensor], shape_of(ld.tensor), extents)
            )
        )


def _distinct_loads(c: Compute) -> list[Load]:
    out, seen = [], set()
    for ld in c.loads():
        if ld.tensor not in seen:
            seen.add(ld.tensor)
            out.append(ld)
    return out


def _data_dependent(e) -> bool:
    return any(isinstance(n, Load) for n in walk(e))


def _vector_width(region: Region, shape: Sequence[int], extents: Sequence[int]) -> int:
    """Widest vector (4, 2, 1 elements) that keeps every load aligned and in bounds."""
    if not shape:
        return 1
    inner = region.dims[-1]
    aff = inner.affine
    for v in (4, 2):
        if shape[-1] % v or extents[-1] % v:
            continue
        if aff is None or aff.const % v or not aff.coefs_divisible_by(v):
            continue
        return v
    return 1


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _plan_smem(group: Group, stages: list[StageConfig], dtype_of: DtypeOf) -> int:
    """Lay out intermediate tiles and staging buffers; fills in their offsets."""
    position = {s.node: k for k, s in enumerate(stages)}
    buffers: list[Buffer] = []
    for k, st in enumerate(stages):
        elem = np_dtype(dtype_of(st.node)).itemsize
        readers = [position[r] for r in group.stages if r != st.node and st.node in group.computes[r].inputs]
        if readers:
            buffers.append(Buffer(st.node, math.prod(st.tile) * elem, k, max(readers)))
        for sd in st.staged:
            buffers.append(
                Buffer(
                    f"{st.node}/{sd.tensor}",
                    math.prod(sd.extents) * np_dtype(dtype_of(sd.tensor)).itemsize,
                    k,
                    k,
                )
            )
        if st.reduce_threads > 32:
            # One slot per (output, warp, register) of 8 value bytes plus 4 index bytes.
            slots = math.prod(st.thread_shape) * (st.reduce_threads // 32) * math.prod(st.reg_tile)
            buffers.append(Buffer(f"{st.node}/reduce", slots * 12, k, k))
    offsets, total = plan_pool(buffers)
    for st in stages:
        if st.node in offsets:
            st.smem_offset = offsets[st.node]
        for sd in st.staged:
            sd.offset = offsets[f"{st.node}/{sd.tensor}"]
        st.reduce_offset = offsets.get(f"{st.node}/reduce")
    return total


def _registers(stage: StageConfig) -> int:
    staging = sum(sd.vector for sd in stage.staged)
    return BASE_REGISTERS + math.prod(stage.reg_tile) + staging


# -- cost -----------------------------------------------------------------------------------------


def estimate_cost(
    group: Group,
    stages: list[StageConfig],
    regions: GroupRegions,
    grid: Sequence[int],
    threads: int,
    smem: int,
    regs: int,
    shape_of: ShapeOf,
    dtype_of: DtypeOf,
    arch: Arch,
) -> Estimate | None:
    blocks = math.prod(grid)
    per_sm = [
        arch.max_blocks_per_sm,
        arch.max_threads_per_sm // threads,
        arch.regs_per_sm // (max(regs, 32) * threads),
    ]
    if smem:
        per_sm.append(arch.smem_per_sm // smem)
    blocks_per_sm = min(per_sm)
    if blocks_per_sm < 1:
        return None
    concurrency = blocks_per_sm * arch.sm_count
    waves = -(-blocks // concurrency)

    read_block = sum(
        transaction_bytes(
            r.clipped_extents(shape_of(t)), shape_of(t), np_dtype(dtype_of(t)).itemsize, arch.read_transaction
        )
        for t, r in regions.inputs.items()
    )
    write_block = sum(
        transaction_bytes(
            regions.members[o].clipped_extents(shape_of(o)),
            shape_of(o),
            np_dtype(dtype_of(o)).itemsize,
            arch.write_transaction,
        )
        for o in group.outputs
    )
    flops_block = 0
    smem_block = 0
    for st in stages:
        c = group.computes[st.node]
        points = math.prod(st.tile) * math.prod(a.extent for a in c.reduce_axes)
        flops_block += points * max(1, _arith_ops(c))
        smem_block += _smem_traffic(c, st, group, dtype_of)
    compulsory = min((read_block + write_block) * blocks, _io_bytes(group, shape_of, dtype_of))
    dram_bytes = _dram_equivalent_bytes(read_block + write_block, blocks, compulsory, arch)
    latency = _kernel_time(blocks, blocks_per_sm, threads, dram_bytes, flops_block, smem_block, arch)
    return Estimate(
        blocks=blocks,
        blocks_per_sm=blocks_per_sm,
        waves=waves,
        read_bytes=read_block * blocks,
        write_bytes=write_block * blocks,
        compulsory_bytes=compulsory,
        flops=flops_block * blocks,
        smem_bytes=smem,
        regs_per_thread=regs,
        latency_us=round(latency, 4),
    )


def _io_bytes(group: Group, shape_of: ShapeOf, dtype_of: DtypeOf) -> int:
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
    with enough warps in flight to hide latency: below SATURATING_WARPS resident warps,
    every rate scales down in proportion."""
    dram = arch.global_bw_gbs * 1e3 * DRAM_EFFICIENCY  # bytes per microsecond
    flops_sm = arch.fp32_tflops * 1e6 * COMPUTE_EFFICIENCY / arch.sm_count
    smem_sm = arch.smem_bw_gbs * 1e3 / arch.sm_count

    def wave(per_sm: int, active: int) -> float:
        bw = min(dram / active, SM_BANDWIDTH_SHARE * dram / arch.sm_count)
        occupancy = min(1.0, per_sm * threads / arch.warp_size / SATURATING_WARPS)
        return per_sm * max(bytes_block / bw, flops_block / flops_sm, smem_block / smem_sm) / occupancy

    concurrency = blocks_per_sm * arch.sm_count
    full, rest = divmod(blocks, concurrency)
    t = full * wave(blocks_per_sm, arch.sm_count)
    if rest:
        active = min(arch.sm_count, rest)
        t += wave(-(-rest // active), active)
    return t + LAUNCH_OVERHEAD_US


def _arith_ops(c: Compute) -> int:
    return sum(1 for n in walk(c.body) if isinstance(n, (Binary, Call)) and n.dtype != "index")


def _smem_traffic(c: Compute, st: StageConfig, group: Group, dtype_of: DtypeOf) -> int:
    """Shared-memory bytes a block reads for this stage: each thread loads a value once per
    register-tile position its index depends on, per reduction point."""
    in_smem = {sd.tensor for sd in st.staged} | {s for s in group.stages if s != st.node}
    axis_of = {a.name: k for k, a in enumerate(c.axes)}
    active = math.prod(st.thread_shape) * st.reduce_threads
    reduce_points = math.prod(a.extent for a in c.reduce_axes) // max(1, st.reduce_threads)
    total = 0
    for ld in _distinct_loads(c):
        if ld.tensor not in in_smem:
            continue
        deps = {axis_of[v] for i in ld.indices for v in free_vars(i) if v in axis_of}
        per_thread = math.prod(st.reg_tile[d] for d in deps) if deps else 1
        total += active * per_thread * reduce_points * np_dtype(ld.dtype).itemsize
    return total
