"""The ``wgmma`` kind: fp16 and bf16 contractions on Hopper's warpgroup tensor-core
instructions.

``mma.sync`` is Ampere's instruction: on an H100 the ``mma`` kind's kernels reach about a
third of what cuBLAS reaches on large products, because a warp-level instruction must be
fed from registers (``ldmatrix`` for every fragment, every k16 step) and issues at a
fraction of the tensor cores' rate.  Hopper's ``wgmma.mma_async`` instead multiplies a
64 x N x 16 piece per warpgroup (four warps, 128 threads) straight from shared memory,
asynchronously, through two 64-bit *matrix descriptors*; only the fp32 accumulators live in
registers.  The kind is the ``mma`` kind's search (:mod:`.mma`: the same contraction
recognition, root tile, later stages, split-K and estimate) with other data:

- block tiles are whole warpgroups: each owns ``block_m / warpgroups`` rows (one or two
  m64 products) and the whole ``block_n`` (one ``wgmma`` of N = ``block_n`` per m64 and k16);
- slices are 64 elements deep: a 128-byte row of the 128-byte-swizzled shared-memory
  layout the descriptors describe (no padding: the XOR swizzle spreads an 8-row group's
  16-byte chunks over all banks), so the operand ring starts 1024-byte aligned;
- operands stream through the same ``cp.async`` ring (16-byte copies only: each is one
  16-byte unit of the swizzled layout), waited for, made visible to the tensor cores'
  asynchronous proxy (``fence.proxy.async``) and a barrier; a slot is refilled only after
  the ``wgmma`` group that read it has completed (``wgmma.wait_group 1`` keeps one in flight);
- an operand may be K-major (rows along M or N, A as ``[m][k]``, B as ``[n][k]``) or
  MN-major (rows along K: a ``[k][n]`` weight), the latter through the instruction's
  transpose flag, which fp16 and bf16 have (TF32 has not).

The instructions exist on compute capability 9.0 only (``sm_90a``: not on later GPUs), so
the rule proposes nothing elsewhere; kernels holding them are compiled for ``sm_90a``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from welder.schedule.group import Group
from welder.schedule.kinds.base import ScheduleContext
from welder.schedule.kinds.mma import BF16, FP16, Contraction, MmaConfig, MmaKind, Operand, on_accumulators
from welder.tile.propagate import Region
from welder.tile.region import Affine

#: The GPU generation with wgmma (sm_90a code runs on 9.0 alone).
COMPUTE_CAPABILITY = (9, 0)
#: The instruction's rows, and its K for 16-bit operands.
WGMMA_M, WGMMA_K = 64, 16
#: Elements of one 128-byte swizzled row: a slice's depth along K.
BLOCK_K = 64
#: Bytes of one swizzle atom (8 rows of 128 bytes); ring slots start on multiples of it.
ATOM_BYTES = 1024
#: Block tiles (block_m, block_n, warps along m, 1): ``warps // 4`` warpgroups split M.
BLOCK_TILES: tuple[tuple[int, int, int, int], ...] = (
    (128, 256, 8, 1),
    (256, 128, 8, 1),
    (128, 192, 8, 1),
    (192, 128, 12, 1),
    (128, 128, 8, 1),
    (128, 128, 4, 1),
    (128, 64, 8, 1),
    (64, 256, 4, 1),
    (64, 128, 4, 1),
    (64, 64, 4, 1),
)
#: Ring depths.  The cp.async variant keeps ``depth - 2`` slices in flight ahead of the one
#: multiplied, as the slot of the previous slice stays busy until its wgmma group completes;
#: the producer variant ``depth - 1``.  Few-row products are chains of slices (latency): on
#: the H100 a 64 x 64 tile of 128 x 768 x 2304 took 6.9 us at depth 4 and 5.9 us at depth 5,
#: so deeper rings are tried where they fit.
PIPELINES = (3, 4, 5, 6, 8)
#: Shallowest ring the cp.async variant takes (at depth 3 one slice would be in flight); the
#: producer variant keeps ``depth - 1`` in flight, so 3 slots leave room for two 128 x 128
#: blocks per SM, each block's fill and epilogue overlapping the other's products.
MIN_CP_ASYNC_PIPELINE = 4
#: Share of the dense fp16/bf16 peak the kernels are expected to reach (cp.async-fed, one
#: warpgroup role; TMA and producer warpgroups would add to it).
WGMMA_EFFICIENCY = 0.65
#: A slice's step in a block's chain (copy issued to barrier passed), measured on the H100:
#: 64 x 64 tiles of 128 x 768 x 2304 (12 slices) took 6.9 us at depth 4 and 5.9 us at depth
#: 5, i.e. 0.7-0.8 us per step of the chain besides the 2 us launch (``mma``: 1.4 us).
SLICE_LATENCY_US = 0.75
#: Registers besides the accumulators: descriptors, copy addresses, loop state, epilogue.
BASE_REGISTERS = 40
#: Bytes of an operand element (the kind's formats are 16-bit) and of one mbarrier.
ELEM_BYTES = 2
MBARRIER_BYTES = 8
#: The producer variant (TMA copies issued by a warpgroup of their own): the consumers only
#: wait and multiply, so more of the peak and a shorter step per slice are expected (first
#: guesses, to be fitted on the H100 like the cp.async variant's).
TMA_EFFICIENCY = 0.8
TMA_SLICE_LATENCY_US = 0.6
#: Threads of the producer warpgroup (one thread issues the copies; a whole warpgroup keeps
#: the consumers' warpgroup numbering and register budget simple).
PRODUCER_THREADS = 128
#: Dimensions a TMA tensor map may have; two are the slice's, the rest batch axes.
TMA_MAX_RANK = 5
#: Blocks per cluster of the multicast variant: a pair whose tiles share one operand's slices.
CLUSTER = 2


@dataclass
class WgmmaConfig(MmaConfig):
    """An :class:`MmaConfig` whose contraction runs as ``wgmma`` (fields as there; ``warps``
    is (4 x warpgroups, 1) and ``block_k`` is :data:`BLOCK_K`)."""

    kind: ClassVar[str] = "wgmma"

    # A warpgroup of its own feeds the ring with TMA copies (tensor maps the kernel takes as
    # parameters), each slot guarded by a full and an empty mbarrier; the ``warps`` are the
    # consumers.
    producer: bool = False
    # The producer variant in clusters of two blocks whose root tiles share this operand
    # ("a": the same rows of A, "b": the same columns of B): each block's producer copies
    # half of the shared slice and multicasts it into both blocks' rings, so the pair draws
    # that operand from L2 once (see :meth:`WgmmaKind.cluster_variants`); "" for none.
    multicast: str = ""
    # The producer variant's output through shared memory: each consumer warp stages its
    # 16-row strips of the tile (128-byte-swizzled 64-column panels) and stores them with TMA
    # (see :meth:`WgmmaKind.output_variants`); the stores run on while the warp goes on.
    tma_store: bool = False

    @property
    def threads(self) -> int:
        return self.warps[0] * self.warps[1] * 32 + (PRODUCER_THREADS if self.producer else 0)

    @property
    def warpgroups(self) -> int:
        """Consumer warpgroups: those that multiply."""
        return self.warps[0] // 4

    @property
    def wg_m(self) -> int:
        """Rows of the block tile each warpgroup owns."""
        return self.block_m // self.warpgroups

    @property
    def cluster(self) -> int:
        return CLUSTER if self.multicast else 1

    def shared_rows(self) -> int:
        """Rows of the slice the blocks of a cluster share (0 without multicast)."""
        return {"a": self.block_m, "b": self.block_n}.get(self.multicast, 0)

    @property
    def family(self) -> str:
        if self.producer:
            # The forms only a lone contraction takes (persistent blocks, clusters, TMA
            # stores) apart from the plain one: they tie with it in the estimate and are
            # listed first, and a tune should measure the plain form beside them.
            return "wgmma/tma+" if self.persistent or self.multicast or self.tma_store else "wgmma/tma"
        return "wgmma/split-k" if self.splits > 1 else "wgmma"

    @property
    def slots_bytes(self) -> int:
        """Bytes of the ring's slots: ``pipeline`` slices of A and of B (16-bit elements)."""
        return self.pipeline * (self.block_m + self.block_n) * self.block_k * ELEM_BYTES

    @property
    def barrier_offset(self) -> int:
        """Byte offset of the producer variant's mbarriers in the shared pool: after the ring's
        slots, ``pipeline`` full ones then ``pipeline`` empty ones."""
        return self.pipeline_offset + self.slots_bytes

    @property
    def barriers(self) -> int:
        return 2 * self.pipeline

    @property
    def staging_offset(self) -> int:
        """Byte offset of the TMA-store staging (the whole tile, one swizzle atom aligned),
        after the barriers."""
        end = self.barrier_offset + self.barriers * MBARRIER_BYTES
        return -(-end // ATOM_BYTES) * ATOM_BYTES

    @property
    def staging_bytes(self) -> int:
        return self.block_m * self.block_n * ELEM_BYTES if self.tma_store else 0

    @property
    def staging_end(self) -> int:
        """Byte offset where the TMA-stored variant's shared memory ends."""
        return self.staging_offset + self.staging_bytes


def _producer(cfg: MmaConfig) -> bool:
    """Whether ``cfg`` is the producer variant (the rule's hooks take any tensor-core config)."""
    return isinstance(cfg, WgmmaConfig) and cfg.producer


class WgmmaKind(MmaKind):
    """The rule (see the module docstring)."""

    block_tiles = BLOCK_TILES
    pipelines = PIPELINES
    efficiency = WGMMA_EFFICIENCY
    m_granule = WGMMA_M
    slice_latency_us = SLICE_LATENCY_US
    #: Fitted on the H100's 128-row products: 64 x 64 tiles split 2, 3, 4 and 6 ways took
    #: 1.5-5 us over their chains (2.3 us, and about 0.5 us per further split).
    split_fixed_us = 2.3
    split_step_us = 0.5
    #: wgmma runs asynchronously: a gathered operand's copies of the next slice overlap it.
    gather_overlaps = True
    #: One block per SM keeps enough in flight with a ring 4 to 8 slices deep (the 128 x 256
    #: tiles, one per SM, drew about 4 TB/s from L2 on the H100).
    streaming_blocks_per_sm = 1

    def runs_on(self, capability: tuple[int, int]) -> bool:
        return capability == COMPUTE_CAPABILITY

    def _contraction(self, group: Group, ctx: ScheduleContext) -> Contraction | None:
        con = super()._contraction(group, ctx)
        # Every copy is one 16-byte unit of the swizzled layout.
        return con if con is not None and con.copy_bytes() == 16 else None

    def block_ks(self, con: Contraction) -> tuple[int, ...]:
        return (BLOCK_K,)

    def copy_widths(self, con: Contraction) -> tuple[int, ...]:
        return (16,)

    def ring_bytes(self, cfg: MmaConfig, con: Contraction) -> int:
        assert isinstance(cfg, WgmmaConfig) and con.fmt.elem_bytes == ELEM_BYTES
        if cfg.tma_store:
            return cfg.staging_end - cfg.pipeline_offset
        return cfg.slots_bytes + (cfg.barriers * MBARRIER_BYTES if cfg.producer else 0)

    def output_variants(self, cfg: MmaConfig, group: Group, con: Contraction) -> list[MmaConfig]:
        # The TMA store: the producer variant of a contraction with no SIMT stage after it,
        # writing one 16-bit output (the product, or the last stage of its epilogue, laid
        # out as the product) whose rows are whole 16-byte units and whose batch axes a map
        # holds.
        lone = len(group.stages) == 1 or on_accumulators(group) is not None
        if not _producer(cfg) or not lone or len(group.outputs) != 1:
            return []
        if group.computes[group.outputs[0]].dtype not in (FP16.dtype, BF16.dtype) or con.n % 8:
            return []
        if len(output_batch_axes(con)) > TMA_MAX_RANK - 2:
            return []
        return [replace(cfg, tma_store=True)]

    def ring_fits(self, offset: int) -> str | None:
        if offset % ATOM_BYTES:
            return f"ring: offset {offset} is not {ATOM_BYTES}-byte aligned (the swizzle needs it)"
        return None

    def in_flight(self, cfg: MmaConfig) -> int:
        # The producer refills a slot as soon as its consumers release it; cp.async copies
        # wait a slice longer (the slot is reissued before the previous wgmma group is done).
        return cfg.pipeline - 1 if _producer(cfg) else cfg.pipeline - 2

    def variants(self, stage: MmaConfig, con: Contraction) -> list[MmaConfig]:
        found = [stage] if stage.pipeline >= MIN_CP_ASYNC_PIPELINE and copies_divide(stage, con) else []
        if tma_maps_fit(con):
            found.append(replace(stage, producer=True))
        return found

    def splittable(self, cfg: MmaConfig) -> bool:
        return not _producer(cfg)

    def persistable(self, cfg: MmaConfig) -> bool:
        # The producer runs ahead into the next tile while the consumers store this one.
        return _producer(cfg)

    def cluster_variants(
        self, cfg: MmaConfig, con: Contraction, region: Region, grid: tuple[int, ...]
    ) -> list[tuple[MmaConfig, int]]:
        # The two blocks of a cluster are neighbours along one root axis that moves only the
        # contraction's M (they share B) or only its N (they share A), with an even number of
        # blocks along it; a shared slice is halved into whole swizzle atoms (K-major rows) or
        # whole 64-column panels (MN-major).
        if not _producer(cfg) or cfg.splits > 1:
            return []
        assert isinstance(cfg, WgmmaConfig)
        found: list[tuple[MmaConfig, int]] = []
        for name, operand, partner, rows in (
            ("a", con.a, con.n_axis, cfg.block_m),
            ("b", con.b, con.m_axis, cfg.block_n),
        ):
            halves = rows // 2 % 8 == 0 if operand.contiguous == "k" else rows % 128 == 0
            axis = _pairing_axis(region, partner, grid)
            if halves and axis is not None:
                found.append((replace(cfg, multicast=name), axis))
        return found

    def l2_operand_rows(self, cfg: MmaConfig) -> int:
        shared = cfg.shared_rows() if isinstance(cfg, WgmmaConfig) else 0
        return cfg.block_m + cfg.block_n - shared // CLUSTER

    def cost_constants(self, cfg: MmaConfig) -> tuple[float, float]:
        if _producer(cfg):
            return TMA_EFFICIENCY, TMA_SLICE_LATENCY_US
        return self.efficiency, self.slice_latency_us

    def registers(self, cfg: MmaConfig) -> int:
        assert isinstance(cfg, WgmmaConfig)
        return BASE_REGISTERS + cfg.wg_m * cfg.block_n // 128


def copies_divide(stage: MmaConfig, con: Contraction) -> bool:
    """Whether the cp.async variant's threads split each operand slice evenly: rows of
    16-byte units, each thread a whole number of them (a gathered operand: of element
    pairs).  Three-warpgroup tiles and 192-wide slices need not: they are the producer
    variant's."""
    for role, op in (("m", con.a), ("n", con.b)):
        block = stage.block_m if role == "m" else stage.block_n
        rows, cols = (BLOCK_K, block) if op.contiguous == role else (block, BLOCK_K)
        chunks = cols // 8
        if op.gathered:
            if rows * cols // 2 % stage.threads:
                return False
        elif stage.threads % chunks or rows % (stage.threads // chunks):
            return False
    return True


def _pairing_axis(region: Region, partner: int, grid: tuple[int, ...]) -> int | None:
    """The root axis whose neighbouring blocks differ only along the contraction's axis
    ``partner`` (their origins along every other axis agree), with an even number of blocks;
    None where there is none."""
    origins = [d.lo for d in region.dims]
    if not all(isinstance(lo, Affine) for lo in origins):
        return None
    for var, _ in origins[partner].terms:
        if not var.startswith("b"):
            continue
        axis = int(var[1:])
        others = (lo for d, lo in enumerate(origins) if d != partner)
        if grid[axis] % CLUSTER == 0 and not any(var in lo.coefs for lo in others):
            return axis
    return None


def output_batch_axes(con: Contraction) -> list[int]:
    """The product's batch axes a TMA-store map steps along (those of more than one element),
    innermost first."""
    return [d for d in reversed(con.batch_axes) if con.compute.axes[d].extent > 1]


def tma_dims(con: Contraction, operand: Operand) -> list[str] | None:
    """The axes of ``operand``'s tensor map, innermost first: its contiguous axis, the other
    one of its slice (K, or its own M or N), then every batch axis it moves along; None
    where a map cannot describe it (more than :data:`TMA_MAX_RANK` axes)."""
    own = "m" if operand is con.a else "n"
    inner, outer = (own, "k") if operand.contiguous == own else ("k", own)
    names = [con.axis_name(inner), con.axis_name(outer)]
    batch = [n for d in con.batch_axes if operand.strides.get(n := con.compute.axes[d].name, 0)]
    extent = {a.name: a.extent for a in (*con.compute.axes, *con.compute.reduce_axes)}
    # An axis of extent 1 may have no stride (the map then never steps along it).
    if len(names) + len(batch) > TMA_MAX_RANK or any(
        operand.strides.get(n, 0) <= 0 and extent[n] > 1 for n in names + batch
    ):
        return None
    return names + batch


def tma_maps_fit(con: Contraction) -> bool:
    """Whether both operands of one of the kind's contractions can be read through TMA tensor
    maps: 16-byte aligned starts and strides (the 16-byte copies the kind requires already
    prove both), no gathered operand (an image read through a window has no map), and few
    enough axes."""
    return all(not op.gathered and tma_dims(con, op) is not None for op in (con.a, con.b))


KIND = WgmmaKind((FP16, BF16), WgmmaConfig)
