"""Code generation for exact fp32 contractions on CUDA cores
(``codegen_templates/stages/ffma.cu.j2``).

An ``ffma`` stage (:mod:`welder.schedule.kinds.ffma`) is an ``mma`` stage whose slices are
multiplied with FMAs instead of ``mma.sync``: the same context (:mod:`.mma`), built over the
contraction in the fp32 format, whose shared-memory rows are padded as TF32's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from welder.schedule.config import StageConfig

from .mma import MmaStageCtx, contraction_stage, stage_contraction

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/ffma.cu.j2"


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> FfmaStageCtx:
    """The context of fp32 FMA stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    ctx = contraction_stage(kb, k, st, stage_contraction(kb, st), TEMPLATE, "CUDA cores, fp32 FMAs")
    cols = ctx.b.k_rows and ctx.ni % 2 == 0
    rows = ctx.a.k_rows and ctx.mi % 2 == 0
    return FfmaStageCtx(
        **vars(ctx)
        | ({"lane_col": QUAD_COLUMNS} if cols else {})
        | ({"lane_row": QUAD_ROWS} if rows else {}),
        quad_columns=cols,
        quad_rows=rows,
    )


#: The warp-tile column of lane t's accumulator pair in piece ni when each lane owns four
#: adjacent columns of every 16 (pieces 2j and 2j + 1 side by side).
QUAD_COLUMNS = "ni / 2 * 16 + 4 * t + ni % 2 * 2"
#: The warp-tile row of lane g's accumulators 2h, 2h + 1 in piece mi when each lane owns
#: four adjacent rows of every 32 (pieces 2j and 2j + 1 side by side).
QUAD_ROWS = "mi / 2 * 32 + 4 * g + mi % 2 * 2 + h"


@dataclass(kw_only=True)
class FfmaStageCtx(MmaStageCtx):
    """An mma stage's context and how the lanes split B's columns and A's rows.

    Where B's N axis is contiguous (weights), the lanes' column pairs 8 apart (mma.sync's
    layout) cost one 8-byte shared load each per K step; owning columns ``4t .. 4t + 3`` of
    every 16 instead, a lane loads two pieces' columns with one 16-byte load: 6 loads per 128
    FMAs of a 64 x 64 warp tile, not 10.  Where A's M axis is contiguous (an activation
    transposed into windows or heads), the lanes' rows 8 apart cost a 4-byte load each per K
    step; owning rows ``4g .. 4g + 3`` of every 32, one 16-byte load brings two pieces' rows.
    Only the epilogue's row and column of each pair (``lane_row``, ``lane_col``) change."""

    quad_columns: bool = False
    quad_rows: bool = False
