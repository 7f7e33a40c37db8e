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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from welder.ir.interpret import np_dtype
from welder.ir.layout import row_major_strides
from welder.schedule.config import StageConfig
from welder.schedule.kinds.mma import Contraction, Operand
from welder.schedule.kinds.wgmma import (
    ATOM_BYTES,
    BLOCK_K,
    WgmmaConfig,
    copies_divide,
    output_batch_axes,
    tma_dims,
)

from .mma import (
    ContractionStageCtx,
    GatherAccess,
    contraction_fields,
    gather_access,
    operand_offset,
    pair_rows,
    stage_contraction,
    stored_shape,
)

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/wgmma.cu.j2"
HEADERS = ("welder_mma.cuh", "welder_wgmma.cuh")
#: What the producer variant adds: mbarriers and TMA copies.
TMA_HEADERS = ("welder_tma.cuh",)
#: Bytes of one swizzled row (64 16-bit elements).
ROW_BYTES = 128
#: The welder_wgmma.cuh function of one m64nNk16 product, by the contraction's dtype.
INSTRUCTIONS = {"float16": "welder_wgmma_m64k16_f16f32", "bfloat16": "welder_wgmma_m64k16_bf16f32"}


@dataclass
class _TmaLoad:
    """One TMA box of an operand's slice: where it lands in the slot (elements) and its
    coordinates in the tensor map (C expressions, innermost first)."""

    dst: str
    coords: list[str]


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
    cols: int  # elements per slice along the row axis
    # A gathered operand (always MN-major): as the mma stage's (codegen/mma.py), with
    # ``gather_dst`` placing a pair in the swizzled slot.
    gather: GatherAccess | None = None
    row_gather: GatherAccess | None = None  # gathered rows: as the mma stage's
    pairs: int = 0
    pair_rows: int = 0
    gather_dst: str = ""
    map: str | None = None  # the producer variant: the operand's tensor-map parameter
    loads: list[_TmaLoad] = field(default_factory=list)  # and the boxes of one slice
    multicast: bool = False  # the cluster shares it: this block copies its half into both


@dataclass(kw_only=True)
class WgmmaStageCtx(ContractionStageCtx):
    wgmma: str  # the welder_wgmma.cuh function of one product (:data:`INSTRUCTIONS`)
    block_n: int
    wg_m: int  # rows of the block tile per warpgroup
    mi: int  # m64 pieces per warpgroup
    a: _Operand
    b: _Operand
    producer: bool  # TMA copies issued by a producer warpgroup (see the template)
    consumers: int  # threads of the warpgroups that multiply
    barriers: str | None  # the producer variant's mbarriers: full[pipeline], empty[pipeline]
    persistent: bool = False  # the block walks tiles; the template's setup runs once before them
    cluster: int = 1  # blocks per cluster (2: the multicast variant)
    releases: int = 0  # arrivals that free a slot: each warp that multiplied it (of the cluster)
    # The TMA store (WgmmaConfig.tma_store): the output's map, its rank, the staging view,
    # and the map coordinates of the block's batch axes after N and M.
    store_map: str | None = None
    store_rank: int = 0
    staging: str = ""
    store_batch: list[str] = field(default_factory=list)


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
    a = _operand(kb, con, con.a, "m", st, a_view, a_elems, o)
    b = _operand(kb, con, con.b, "n", st, b_view, b_elems, o)
    barriers = None
    if st.producer:
        barriers = f"wgmma{k}_barriers"
        kb.add_view(barriers, dtype, st.barrier_offset, st.barriers, ctype="uint64_t")
        for out, op in ((a, con.a), (b, con.b)):
            _tma(kb, con, op, out, st, o)
    return WgmmaStageCtx(
        template=TEMPLATE,
        headers=(*HEADERS, *TMA_HEADERS) if st.producer else HEADERS,
        arch_specific=True,
        **contraction_fields(kb, k, st, con, "wgmma"),
        wgmma=INSTRUCTIONS[dtype],
        block_n=st.block_n,
        wg_m=st.wg_m,
        mi=st.wg_m // 64,
        a=a,
        b=b,
        producer=st.producer,
        consumers=st.warpgroups * 128,
        barriers=barriers,
        persistent=bool(st.persistent),
        cluster=st.cluster,
        releases=st.warpgroups * st.cluster * 4,
        **(_tma_store(kb, k, st, con, o) if st.tma_store else {}),
    )


def _tma_store(kb: KernelBuilder, k: int, st: WgmmaConfig, con: Contraction, origins: list[str]) -> dict:
    """The TMA store's fields: a map over the group's output (laid out as the product: N
    contiguous, then M, then the batch axes of more than one element), boxes of 64 columns
    (one 128-byte swizzled row) by a warp's 16 rows, and the staging view of the whole tile."""
    out = kb.group.outputs[0]
    shape = con.compute.shape
    strides = row_major_strides(stored_shape(kb, st, con))
    batch = output_batch_axes(con)
    item = np_dtype(kb.graph.tensor(out).dtype).itemsize
    dims = (con.n, con.m, *(shape[d] for d in batch))
    byte_strides = (con.n * item, *(strides[d] * item for d in batch))
    box = (64, 16, *(1 for _ in batch))
    staging = f"wgmma{k}_out"
    kb.add_view(staging, kb.graph.tensor(out).dtype, st.staging_offset, st.block_m * st.block_n)
    return {
        "store_map": kb.add_tensor_map(out, 0, dims, byte_strides, box, 128),
        "store_rank": len(dims),
        "staging": staging,
        "store_batch": [origins[d] for d in batch],
    }


def _tma(
    kb: KernelBuilder, con: Contraction, op: Operand, out: _Operand, st: WgmmaConfig, origins: list[str]
) -> None:
    """Gives ``out`` its tensor map and the boxes of one slice.  The map's axes are
    :func:`~welder.schedule.kinds.wgmma.tma_dims`'s, with the contraction's extents (the
    copies zero-fill what lies beyond, as the cp.async variant's do); a box is 64 elements
    (one 128-byte swizzled row) along the contiguous axis: a K-major slice is one box of all
    its rows, an MN-major one a box of 64 K rows per 64-column panel.  An operand the
    blocks of a cluster share is copied half by each (``rank`` is the block's rank in the
    cluster): half the rows of a K-major slice (whole 8-row swizzle atoms, so the layout is
    the same as one box's), or half the panels of an MN-major one."""
    names = tma_dims(con, op)
    assert names is not None, "the policy proposes the producer variant only where maps fit"
    axes = {a.name: a.extent for a in (*con.compute.axes, *con.compute.reduce_axes)}
    item = con.fmt.elem_bytes
    dims = tuple(axes[n] for n in names)
    # A stride of 0 (an axis of extent 1) would be refused; any multiple of 16 bytes will do.
    strides = tuple(op.strides.get(n, 0) * item or 16 for n in names[1:])
    batch = [origins[d] for d in con.batch_axes if con.compute.axes[d].name in names[2:]]
    own0 = out.fixed_origin
    out.multicast = st.multicast == out.name
    parts = st.cluster if out.multicast else 1

    def at(part: int, extra: int) -> tuple[str, str]:
        """C offsets of a box ``extra`` along the operand's own axis into this block's part
        of the slice (parts of ``part`` each): in the slot (elements; a step along the own
        axis is a 64-element swizzled row, or a 64-deep column of a panel) and in the map."""
        own = f"{own0} + {extra}" if extra else own0
        dst = str(extra * 64)
        if out.multicast:
            own = f"{own} + rank * {part}"
            dst = f"rank * {part * 64} + {dst}"
        return dst, own

    if out.k_rows:  # [k][own]: panels of 64 columns
        box = (64, BLOCK_K, *(1 for _ in batch))
        panels = (st.block_m if out.name == "a" else st.block_n) // 64 // parts
        loads = []
        for p in range(panels):
            dst, own = at(panels * 64, p * 64)
            loads.append(_TmaLoad(dst, [own, "k0", *batch]))
    else:
        rows = out.rows // parts
        box = (BLOCK_K, rows, *(1 for _ in batch))
        dst, own = at(rows, 0)
        loads = [_TmaLoad(dst, ["k0", own, *batch])]
    out.map = kb.add_tensor_map(op.tensor, op.offset, dims, strides, box, 128)
    out.loads = loads


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
    gathered = op.gathered
    if st.producer:  # no cp.async copies: the copy loop's fields go unused
        row_step = rows
    else:
        assert copies_divide(st, con), "the policy proposes cp.async rings only where the copies divide"
        row_step = max(threads // chunks, 1)
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
        cols=cols,
        gather=gather_access(kb, con, op, origins) if gathered else None,
        row_gather=gather_access(kb, con, op, origins, "0") if op.rows is not None else None,
        pairs=rows * cols // 2 // threads if gathered else 0,
        pair_rows=pair_rows(threads, cols) if gathered else 0,
        # Panel col / 64 of 64-element rows, 16-byte unit (col % 64 / 8) ^ (row % 8) of its row.
        gather_dst=f"col / 64 * {rows * 64} + row * 64 + ((col % 64 / 8) ^ (row & 7)) * 8 + col % 8",
    )
