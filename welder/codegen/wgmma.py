"""Code generation for Hopper warpgroup stages (``codegen_templates/stages/wgmma.cu.j2``).

A ``wgmma`` stage (:class:`~welder.schedule.kinds.wgmma.WgmmaConfig`) shares the ``mma``
stage's contraction, epilogue and split-K (:mod:`.mma`); what is its own is how each
operand's slice lies in shared memory.  Every slice is stored in the 128-byte-swizzled
layout of ``wgmma``'s matrix descriptors: rows of 64 elements (128 bytes), the 16-byte
unit ``c`` of row ``r`` stored at unit ``c ^ (r % 8)``, rows in 8-row atoms of 1024 bytes.

- K-major operand (A as ``[m][k]``, B as ``[n][k]``): a row per M (or N) index holding the
  slice's 64 K elements; consecutive 8-row atoms are ``sbo`` = 1024 bytes apart; a k16 step
  moves the descriptor 32 bytes along the row.
- MN-major operand (A as ``[k][m]``, B as ``[k][n]``, the instruction's transpose flag): a
  row per K index holding 64 M (or N) elements; the block's ``block`` columns are panels of
  64, each 64 rows (8 KiB) deep: atoms along K are ``sbo`` = 1024 bytes apart and panels
  ``lbo`` = 8192 bytes; a k16 step moves the descriptor 16 rows (2048 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from welder.schedule.config import StageConfig
from welder.schedule.kinds.mma import Contraction, Operand
from welder.schedule.kinds.wgmma import ATOM_BYTES, BLOCK_K, WgmmaConfig

from .mma import ContractionStageCtx, contraction_fields, operand_offset, stage_contraction

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/wgmma.cu.j2"
HEADERS = ("welder_mma.cuh", "welder_wgmma.cuh")
#: Bytes of one swizzled row (64 16-bit elements).
ROW_BYTES = 128
#: The welder_wgmma.cuh function of one m64nNk16 product, by the contraction's dtype.
INSTRUCTIONS = {"float16": "welder_wgmma_m64k16_f16f32", "bfloat16": "welder_wgmma_m64k16_bf16f32"}


@dataclass
class _Operand:
    """One operand's slice as the template copies it and describes it to wgmma."""

    name: str  # "a" or "b": the template's local names start with it
    param: str
    view: str
    offset: str  # C: element offset of this block's matrix in the tensor
    rows: int  # swizzled rows per slice: 64 along K (MN-major) or the block's M or N (K-major)
    stage_elems: int
    stage_bytes: int
    k_rows: bool  # MN-major: rows run along K, the instruction transposes the operand
    trans: int  # the instruction's imm-trans flag
    lbo: int  # descriptor byte offsets (see the module docstring)
    sbo: int
    k16_bytes: int  # descriptor advance per k16 step
    chunks: int  # 16-byte copies per row
    row_step: int  # rows between one thread's copies
    copies: int
    row_stride: int  # global stride of the row axis (the other axis has stride 1)
    row_limit: int
    col_limit: int
    k_step: int  # elements the source advances per unit of k0
    fixed_origin: str  # m0 or n0
    fixed_limit: int  # M or N


@dataclass(kw_only=True)
class WgmmaStageCtx(ContractionStageCtx):
    wgmma: str  # the welder_wgmma.cuh function of one product (:data:`INSTRUCTIONS`)
    block_n: int
    wg_m: int  # rows of the block tile per warpgroup
    mi: int  # m64 pieces per warpgroup
    a: _Operand
    b: _Operand


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> WgmmaStageCtx:
    """The context of warpgroup stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    con = stage_contraction(kb, st)
    assert isinstance(st, WgmmaConfig) and st.block_k == BLOCK_K
    assert st.pipeline_offset % ATOM_BYTES == 0, "the policy places the ring on an atom"
    o = [kb.origin_name(k, d) for d in range(len(con.compute.axes))]
    dtype = con.compute.dtype
    a_elems, b_elems = st.block_m * BLOCK_K, st.block_n * BLOCK_K
    a_view, b_view = f"wgmma{k}_a", f"wgmma{k}_b"
    kb.add_view(a_view, dtype, st.pipeline_offset, st.pipeline * a_elems)
    b_offset = st.pipeline_offset + st.pipeline * a_elems * con.fmt.elem_bytes
    assert b_offset % ATOM_BYTES == 0
    kb.add_view(b_view, dtype, b_offset, st.pipeline * b_elems)
    return WgmmaStageCtx(
        template=TEMPLATE,
        headers=HEADERS,
        arch_specific=True,
        **contraction_fields(kb, k, st, con, "wgmma"),
        wgmma=INSTRUCTIONS[dtype],
        block_n=st.block_n,
        wg_m=st.wg_m,
        mi=st.wg_m // 64,
        a=_operand(kb, con, con.a, "m", st, a_view, a_elems, o),
        b=_operand(kb, con, con.b, "n", st, b_view, b_elems, o),
    )


def _operand(
    kb: KernelBuilder,
    con: Contraction,
    op: Operand,
    role: str,
    st: WgmmaConfig,
    view: str,
    stage_elems: int,
    origins: list[str],
) -> _Operand:
    """``role`` is the operand's own output axis: ``"m"`` for A, ``"n"`` for B."""
    block = st.block_m if role == "m" else st.block_n
    extent = con.m if role == "m" else con.n
    k_rows = op.contiguous == role
    if k_rows:
        rows, cols = BLOCK_K, block
        row_limit, col_limit, row_stride = con.k_extent, extent, con.stride(op, "k")
    else:
        rows, cols = block, BLOCK_K
        row_limit, col_limit, row_stride = extent, con.k_extent, con.stride(op, role)
    chunks = cols // 8
    threads = st.threads
    assert threads % chunks == 0 and rows % (threads // chunks) == 0, (threads, rows, cols)
    row_step = threads // chunks
    return _Operand(
        name="a" if role == "m" else "b",
        param=kb.params[op.tensor].name,
        view=view,
        offset=operand_offset(con, op, origins),
        rows=rows,
        stage_elems=stage_elems,
        stage_bytes=stage_elems * con.fmt.elem_bytes,
        k_rows=k_rows,
        trans=int(k_rows),
        lbo=rows * ROW_BYTES if k_rows else 16,
        sbo=8 * ROW_BYTES,
        k16_bytes=16 * ROW_BYTES if k_rows else 16 * con.fmt.elem_bytes,
        chunks=chunks,
        row_step=row_step,
        copies=rows // row_step,
        row_stride=row_stride,
        row_limit=row_limit,
        col_limit=col_limit,
        k_step=row_stride if k_rows else 1,
        fixed_origin="m0" if role == "m" else "n0",
        fixed_limit=extent,
    )
