"""The ``ffma`` kind: exact fp32 contractions on CUDA cores, in the tensor-core kind's tiles.

Without ``--tf32`` an fp32 matrix product may not touch the tensor cores, and the SIMT kind
computes it as it computes any reduction: every thread keeps a small register tile and
reads each operand element from shared memory as a scalar, about one load per 2.7
multiply-adds.  On the H100 that reached 30 TFLOP/s on BERT's products at batch 64 (of 67),
where cuBLAS's exact SGEMM under torch.compile reached 42.

This kind reuses everything of the ``mma`` kind but the instruction
(:class:`~.mma.MmaKind`: the search over block tiles, slice and ring depths, split-K, later
stages on the accumulators; the template's cp.async ring and epilogue): each warp still owns
a ``warp_m x warp_n`` piece made of 16 x 8 pieces, and each lane holds the accumulators that
``mma.sync`` would leave it (rows ``g`` and ``g + 8`` of every piece, two adjacent columns),
but fills them with FMAs of its own rows of A and columns of B.  Where B's N axis is
contiguous a lane owns columns ``4t .. 4t + 3`` of every 16 (codegen's ``FfmaStageCtx``), so
one 16-byte load brings its columns of two pieces; where A's M axis is contiguous, rows
``4g .. 4g + 3`` of every 32 likewise.  A 64 x 64 warp tile gives every lane 8 rows and 16
columns: 128 FMAs per K step against two 16-byte loads of A (four K steps at a time, where
A's K axis is contiguous) and four 16-byte loads of B -- about twenty FMAs per shared-memory
load, with the rows padded as the mma kind pads them, so the eight rows a load of A touches
lie in distinct banks.

Accumulation runs along K in order, one FMA per element, as a sequential dot product would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from welder.schedule.kinds.mma import (
    BLOCK_TILES,
    MMA_M,
    MMA_N,
    Contraction,
    MmaConfig,
    MmaFormat,
    MmaKind,
)

#: The format of the kind's contractions: fp32 operands, no instruction of its own (the
#: template's FMAs), the CUDA cores' fp32 rate, slices of 16 or 32 elements (64 or 128 bytes
#: a row: the A loads take four K steps at a time).
FP32 = MmaFormat("ffma", "fp32", "float32", 4, 4, "", None, "fp32_tflops", (16, 32))
#: Registers a thread needs besides its values (addresses, indices), fitted to ptxas (nvcc
#: 13, sm_90, bert's FFN-out): warp tiles of 64 x 32 and 32 x 64 took 121-128 registers (this
#: gives 128 and 120), 16 x 64 80-93 (80), 16 x 16 and 16 x 32 61-63 (64, the floor), 32 x 32
#: 96 (80); 64 x 64 took all 255 (200), one block of 4 or 8 warps an SM either way.
FFMA_BASE_REGISTERS = 24
#: Share of the fp32 peak the kind's kernels are expected to reach: the inner loop issues
#: about one load and some addressing per ten FMAs.
FFMA_EFFICIENCY = 0.7


@dataclass
class FfmaConfig(MmaConfig):
    """An :class:`~.mma.MmaConfig` computed with FMAs on CUDA cores (exact fp32)."""

    kind: ClassVar[str] = "ffma"

    @property
    def family(self) -> str:
        # Split-K as in the mma kind; the sixteen-warp blocks apart too, so that the search
        # measures some whatever their estimate (Swin's fp32 products took them on the H100).
        if self.splits > 1:
            return "ffma/split-k"
        return "ffma/16-warps" if self.threads > 256 else "ffma"


class FfmaKind(MmaKind):
    """The mma rule with the fp32 format, gathered fp32 operands, and the CUDA cores'
    costs."""

    gather_32bit = True

    efficiency = FFMA_EFFICIENCY
    #: The mma kind's tiles, and 16 warps of 64 x 32 over 128 x 256 or 256 x 128: cuBLAS's
    #: block size (twice the FMAs per byte a 128 x 64 block reads from L2) at the warp tile
    #: that measured fastest, in 128 registers a thread.
    block_tiles = (*BLOCK_TILES, (128, 256, 2, 8), (256, 128, 4, 4))

    def splittable(self, cfg: MmaConfig) -> bool:
        # Sixteen-warp tiles serve products with tiles to spare, and their split-K code
        # spills at 128 registers a thread (ptxas: 52-192 bytes).
        return cfg.threads <= 256

    def cost_constants(self, cfg: MmaConfig) -> tuple[float, float]:
        return self.efficiency * smem_share(cfg), self.slice_latency_us

    def registers(self, cfg: MmaConfig) -> int:
        wm, wn = cfg.block_m // cfg.warps[0], cfg.block_n // cfg.warps[1]
        rows, cols = 2 * (wm // MMA_M), 2 * (wn // MMA_N)
        # The accumulators, four K steps of the lane's rows of A, one of its columns of B.
        return max(64, FFMA_BASE_REGISTERS + rows * cols + 4 * rows + cols)


def smem_share(cfg: MmaConfig) -> float:
    """The share of the FMA rate that shared memory lets a warp tile reach.

    Per K step a lane issues ``F = (2 mi) (2 ni)`` FMAs and its warp reads its rows of A
    (16-byte loads of four K steps: about ``2 mi`` wavefronts, a quarter warp each) and its
    columns of B (``ni / 2`` 16-byte loads, a quarter warp a wavefront: ``2 ni``).  An SM serves
    one wavefront per clock to its four schedulers, each of which issues one warp's FMA per
    clock, so the warp's FMAs take ``F`` clocks and its loads ``4 (2 mi + 2 ni)``: a 64 x 64
    warp tile keeps the FMA units busy, a 16 x 32 one waits on shared memory 60% of the time."""
    wm, wn = cfg.block_m // cfg.warps[0], cfg.block_n // cfg.warps[1]
    mi, ni = wm // MMA_M, wn // MMA_N
    fmas, wavefronts = 4 * mi * ni, 2 * mi + 2 * ni
    return min(1.0, fmas / (4 * wavefronts))


def as_ffma(con: Contraction) -> Contraction | None:
    """``con`` (an fp32 contraction, which :func:`~.mma.contraction` gives the TF32 format)
    with the fp32 format; None for other dtypes."""
    return replace(con, fmt=FP32) if con.fmt.dtype == FP32.dtype else None


KIND = FfmaKind((FP32,), FfmaConfig)
