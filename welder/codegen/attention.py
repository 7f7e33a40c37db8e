"""Code generation for attention stages (``codegen_templates/stages/attention.cu.j2``).

An ``attention`` stage (``welder.schedule.kinds.attention.AttentionConfig``) computes a
group's first product ``S``, its row stages and the second product ``O`` in one pass over
registers; an ``attention_ffma`` stage the same in exact fp32, the products as FMAs.  The
operands are copied as one-slice ``mma`` stages would copy them (the same
:class:`~welder.codegen.mma._Operand` plans, rendered by ``stages/mma.cu.j2``'s copy and
fragment macros); what is new here is printing the row stages and ``P`` over the
accumulators: each element's value with ``S`` read as its accumulator (rounded to ``S``'s
type, as a stored ``S`` would read back), a row stage as the thread's value of its row,
anything else from global memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from welder.ir.compute import reduce_identity
from welder.ir.expr import Binary, Expr, Load, Var, loads, rewrite, substitute
from welder.schedule.config import StageConfig
from welder.schedule.kinds.attention import (
    Attention,
    AttentionConfig,
    AttentionFfmaConfig,
    attention,
    combine_floats,
    lane_floats,
    q_slots,
    ring_slots,
    scores_config,
    values_config,
)
from welder.schedule.kinds.mma import ring_elements

from .common import STORAGE_TYPES, StageCtx, sanitize_comment
from .cprint import CPrinter, literal
from .mma import _operand, _rounded, contraction_fields, pair_packers
from .simt import combine

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/attention.cu.j2"
HEADERS = ("welder_mma.cuh",)


@dataclass
class RowStage:
    """One row stage: ``rv<j>[h] = reduce over the thread's keys of value``, then the quad's."""

    var: str
    init: str  # the reduction's identity, as float
    combine: str  # C with ``a`` and ``b``: two partial results combined
    value: str  # C: the element's value, with gm, gn and sv (S's element) in scope
    result: str  # C: ``red`` rounded to the stage's type


@dataclass(kw_only=True)
class AttentionStageCtx(StageCtx):
    storage_t: str
    elem_bytes: int
    pack2: str
    pack1: str
    copy_bytes: int
    copy_elems: int
    convert: None
    mma: str  # the welder_mma.cuh function of one product ("" with ffma)
    ffma: bool  # both products as FMAs on CUDA cores (exact fp32)
    keys: int  # padded (to whole chunks with chunk)
    chunk: int  # keys per pass of the online softmax; 0: one pass
    chunk_keys: int  # keys in shared memory at a time (chunk x splits, or all of them)
    warp_keys: int  # keys a warp multiplies a pass (chunk, or all of them)
    splits: int  # warps sharing a ring slot's keys (AttentionConfig.key_splits)
    persistent: bool  # the block walks tiles, copying the next one's Q, K and V during this one's products
    row_warps: int  # warps of 16 rows (the block's rows)
    combine_stride: int  # floats a lane leaves for its row group's first warp, with splits
    part_view: str | None  # the float view (over the ring) they go through
    key_extent: int
    head: int  # padded K of S's product
    width: int  # padded N of O's product
    rows_extent: int  # M
    row_guard: bool  # whether a warp's rows may pass M
    m_origin: str
    rows: list[RowStage]
    probs: str  # C: P at (gm, gn), with sv (S's element) or lv (its logit) in scope
    probs_scale: str | None  # row stage P is divided by, as a product by its reciprocal
    probs_kept: bool  # P's numerator is the last row stage's value, kept in S's place
    logits: str | None  # C: the logit computed in place of S's element (_logits), if any
    q: object
    k: object
    v: object
    # O's store (the fields of stages/mma.cu.j2's store_pair)
    tile_view: str | None
    tile_m: int
    tile_n: int
    out_param: str | None
    out_offset: str
    m_extent: int
    n_extent: int
    epilogue: list
    guard: bool  # whether O's pieces may leave the product (stages/mma.cu.j2's store_pair)


def stage_attention(kb: KernelBuilder, st: StageConfig) -> Attention:
    """The attention structure an attention stage config names (as the policy proved it)."""
    assert isinstance(st, AttentionConfig)
    att = attention(kb.group, kb.shape_of, fp32=isinstance(st, AttentionFfmaConfig))
    if att is None or att.out.name != st.node:
        raise ValueError(f"{st.node}: not the second product of an attention group, yet configured as one")
    return att


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> AttentionStageCtx:
    """The context of attention stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    att = stage_attention(kb, st)
    assert isinstance(st, AttentionConfig)
    s_index = kb.stage_index[att.scores.compute.name]
    s_origins = [kb.origin_name(s_index, d) for d in range(len(att.scores.compute.axes))]
    o_origins = [kb.origin_name(k, d) for d in range(len(att.out.axes))]
    first = scores_config(att, st.warps, st.copy_bytes, st.chunk, st.key_splits)
    second = values_config(att, st.warps, st.copy_bytes, st.chunk, st.key_splits)
    values = att.values_contraction()
    q_elems, k_elems = ring_elements(first, att.scores)
    v_elems = ring_elements(second, values)[1]
    dtype = att.scores.compute.dtype
    item = att.scores.fmt.elem_bytes
    offset = st.operands_offset
    if st.persistent and (st.chunk or st.key_splits > 1 or isinstance(st, AttentionFfmaConfig)):
        raise ValueError(f"{st.node}: persistent attention is one pass of 16-bit products, keys not split")
    slots = ring_slots(st.chunk, bool(st.persistent))
    q_all = q_slots(bool(st.persistent)) * q_elems
    kb.add_view(f"att{k}_q", dtype, offset, q_all)
    kb.add_view(f"att{k}_k", dtype, offset + q_all * item, slots * k_elems)
    kb.add_view(f"att{k}_v", dtype, offset + (q_all + slots * k_elems) * item, slots * v_elems)
    if st.key_splits > 1:  # the same bytes, once the keys are done (kinds.attention.operand_bytes)
        kb.add_view(f"att{k}_part", "float32", offset, combine_floats(att, st.warps, st.key_splits))
    # Every origin of S's region and of O's: the template's group kernel prints both lists.
    s_region = kb.regions.members[att.scores.compute.name]
    # O's output fields (its tile for later stages, a global store) as its mma stage's.
    own = contraction_fields(kb, k, replace(second, tile=st.tile), values, "attention")
    origins = [{"name": s_origins[d], "expr": kb.index_c(iv.lo_expr())} for d, iv in enumerate(s_region.dims)]
    q = _operand(kb, att.scores, att.scores.a, "m", first, f"att{k}_q", q_elems, s_origins)
    kop = _operand(kb, att.scores, att.scores.b, "n", first, f"att{k}_k", k_elems, s_origins)
    v = replace(_operand(kb, values, values.b, "n", second, f"att{k}_v", v_elems, o_origins), name="v")
    pack2, pack1 = pair_packers(dtype)
    logit, bodies, probs = _logits(att, kb.group.computes)
    probs, scale = _reciprocal_scale(att, probs)
    rows = _row_stages(kb, att, bodies, s_origins)
    probs_c = _printer(kb, att, _row_names(att, o_origins, "gn"))(probs)
    return AttentionStageCtx(
        template=TEMPLATE,
        headers=HEADERS,
        comment=sanitize_comment(f"{', '.join(att.stages)} (attention, {st.block_m} rows, {_keys_note(st)})"),
        origins=origins + own["origins"],
        storage_t=STORAGE_TYPES[dtype],
        elem_bytes=item,
        pack2=pack2,
        pack1=pack1,
        copy_bytes=st.copy_bytes,
        copy_elems=st.copy_bytes // item,
        convert=None,
        mma=att.scores.fmt.instruction,
        ffma=isinstance(st, AttentionFfmaConfig),
        keys=st.keys,
        chunk=st.chunk,
        chunk_keys=st.chunk_keys,
        warp_keys=st.warp_keys,
        splits=st.key_splits,
        persistent=bool(st.persistent),
        row_warps=st.warps,
        combine_stride=lane_floats(att),
        part_view=f"att{k}_part" if st.key_splits > 1 else None,
        key_extent=att.keys,
        head=st.head,
        width=st.width,
        rows_extent=att.scores.m,
        row_guard=att.scores.m % st.block_m != 0 or st.tile[-2] != st.block_m,
        m_origin=s_origins[att.scores.m_axis],
        rows=rows,
        probs=probs_c,
        probs_scale=scale,
        probs_kept=scale is not None and bool(rows) and probs_c == rows[-1].value,
        logits=None if logit is None else _printer(kb, att, _row_names(att, s_origins, "gn"))(logit),
        q=q,
        k=kop,
        v=v,
        tile_view=own["tile_view"],
        tile_m=own["tile_m"],
        tile_n=own["tile_n"],
        out_param=own["out_param"],
        out_offset=own["out_offset"],
        m_extent=own["m_extent"],
        n_extent=own["n_extent"],
        epilogue=[],
        guard=own["guard"],
    )


def _keys_note(st: AttentionConfig) -> str:
    if not st.chunk:
        return f"{st.keys} keys"
    split = f", {st.key_splits} warps to a slot" if st.key_splits > 1 else ""
    return f"{st.keys} keys in chunks of {st.chunk}{split}"


def _printer(kb: KernelBuilder, att: Attention, names: dict[str, str]) -> CPrinter:
    """Prints an expression over the accumulators: ``S`` as ``sv``, row stage ``j`` as the
    thread's ``rv<j>[h]``, everything else from global memory."""
    s_name = att.scores.compute.name
    row_vars = {r: f"rv{j}[h]" for j, r in enumerate(att.rows)}

    def load(ld: Load, p: CPrinter) -> str:
        if ld.tensor == LOGIT:
            return LOGIT
        if ld.tensor == s_name:
            return _rounded("sv", att.scores.compute.dtype)
        if ld.tensor in row_vars:
            return row_vars[ld.tensor]
        return kb.global_load(ld, p)

    return CPrinter(load, var=names)


#: The C name of an element's logit (:func:`_logits`), and the tensor that stands for it
#: in the rewritten expressions (no graph tensor is named so: names are ONNX's).
LOGIT = "lv"


def _logits(att: Attention, group_computes: dict) -> tuple[Expr | None, list[Expr], Expr]:
    """The row stages' bodies and ``P``, with keys renamed to ``gn``, and where every one of
    them reads ``S`` only through one expression -- the first row stage's body, a softmax's
    scaled and masked scores -- that expression, replaced in all of them by :data:`LOGIT`:
    the kernel computes it once per element, in place of ``S``, instead of once per stage."""
    rows = [
        substitute(group_computes[r].body, {group_computes[r].reduce_axes[0].name: Var("gn")})
        for r in att.rows
    ]
    probs = substitute(att.probs, {att.key: Var("gn")})
    s_name = att.scores.compute.name
    if not rows or isinstance(rows[0], Load):
        return None, rows, probs
    logit = rows[0]
    marker = Load(LOGIT, (), logit.dtype)
    swap = [rewrite(e, lambda n: marker if n == logit else None) for e in (*rows, probs)]
    if any(ld.tensor == s_name for e in swap for ld in loads(e)):
        return None, rows, probs  # S is read outside the expression too
    return logit, swap[:-1], swap[-1]


def _reciprocal_scale(att: Attention, probs: Expr) -> tuple[Expr, str | None]:
    """``P = x / l`` with ``l`` a row stage (a softmax's sum), in fp32: ``x`` and the row
    stage's variable, which the kernel inverts once a row and multiplies each element by.
    An IEEE division is some twenty instructions inlined per element (28 a thread for ViT's
    50 keys, a fifth of its kernel), and the product by a reciprocal differs from it by an
    ulp or two; otherwise ``P`` as it is and None."""
    if (
        isinstance(probs, Binary)
        and probs.op == "div"
        and probs.dtype == "float32"
        and isinstance(probs.b, Load)
        and probs.b.tensor in att.rows
    ):
        return probs.a, f"rv{att.rows.index(probs.b.tensor)}"
    return probs, None


def _row_names(att: Attention, origins: list[str], key: str) -> dict[str, str]:
    """Axis names of a row stage or of ``P``: batch axes at the block's origins, the row
    ``gm`` and the key ``gn``."""
    m = att.scores.m_axis
    return {f"i{d}": origins[d] for d in range(m)} | {f"i{m}": "gm", key: "gn"}


def _row_stages(kb: KernelBuilder, att: Attention, bodies: list[Expr], origins: list[str]) -> list[RowStage]:
    found = []
    for j, (name, body) in enumerate(zip(att.rows, bodies)):
        c = kb.group.computes[name]
        op = c.reduce_op
        assert op is not None
        value = _printer(kb, att, _row_names(att, origins, "gn"))(body)
        init = literal(reduce_identity(op, "float32"), "float32")
        found.append(RowStage(f"rv{j}", init, combine(op, "a", "b"), value, _rounded("red", c.dtype)))
    return found
