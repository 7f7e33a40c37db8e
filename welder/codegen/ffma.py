"""Code generation for exact fp32 contractions on CUDA cores
(``codegen_templates/stages/ffma.cu.j2``).

An ``ffma`` stage (:mod:`welder.schedule.kinds.ffma`) is an ``mma`` stage whose slices are
multiplied with FMAs instead of ``mma.sync``: the same context (:mod:`.mma`), built over the
contraction in the fp32 format, whose shared-memory rows are padded as TF32's are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from welder.schedule.config import StageConfig
from welder.schedule.kinds.ffma import as_ffma

from .mma import MmaStageCtx, contraction_stage, stage_contraction

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/ffma.cu.j2"


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> MmaStageCtx:
    """The context of fp32 FMA stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    con = as_ffma(stage_contraction(kb, st, gather_32bit=True))
    if con is None:
        raise ValueError(f"{st.node}: an ffma stage needs an fp32 contraction")
    return contraction_stage(kb, k, st, con, TEMPLATE, "CUDA cores, fp32 FMAs")
