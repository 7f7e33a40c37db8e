"""Code generation for fp32 contractions taken as three TF32 products a piece
(:mod:`welder.schedule.kinds.tf32x3`): the mma stage (``codegen_templates/stages/mma.cu.j2``)
over the contraction in the split format, whose ``products`` the template reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from welder.schedule.config import StageConfig
from welder.schedule.kinds.tf32x3 import as_tf32x3

from .mma import TEMPLATE, MmaStageCtx, contraction_stage, stage_contraction

if TYPE_CHECKING:
    from .kernel import KernelBuilder


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> MmaStageCtx:
    """The context of split-TF32 stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    con = as_tf32x3(stage_contraction(kb, st, gather_32bit=True))
    if con is None:
        raise ValueError(f"{st.node}: an mma_tf32x3 stage needs an fp32 contraction")
    return contraction_stage(kb, k, st, con, TEMPLATE, "tensor cores, three TF32 products")
