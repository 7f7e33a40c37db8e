"""The ``attention`` kind: two products joined by row reductions, in one kernel on tensor
cores, with the scores never leaving registers.

A group qualifies by its structure, not by op names.  Its first stage is a contraction
``S = Q.K`` (:func:`~.mma.contraction`, fp16 or bf16, both operands affine) whose N axis
-- the *keys* -- fits one block (at most :data:`MAX_KEYS`); then come any number of
*row stages*, reductions over the keys of an expression that reads ``S`` at
``(.., row, key)``, the row stages before it at ``(.., row)`` and global tensors anywhere
(a scale, a mask, a relative-position bias); then a second contraction ``O = P.V`` over
the keys, whose one factor ``P`` is such an expression (a softmax's ``exp(s - max) /
sum``) and whose other is an affine load of a global tensor ``V``.  ``S`` and the row
stages must not be group outputs: they are never stored.  Later stages (heads merged back
into tokens) are SIMT stages reading ``O``'s tile from shared memory, as after the ``mma``
kind.

Each warp owns 16 rows of the block's ``16 x warps`` rows: ``S``'s row of every key sits
in its accumulators (``m16n8k16`` C fragments: lane ``(g, t)`` holds rows ``g`` and
``g + 8``, keys ``2t, 2t + 1`` of every 8), so a row stage is a local reduction and two
shuffles within the quad; ``P``'s values, computed from those accumulators, are exactly
the A fragments of ``O``'s products (the C layout of two n8 tiles is the A layout of one
k16 slice).  ``Q``'s rows, all of ``K`` and all of ``V`` are copied once into shared memory
with ``cp.async``.

Where the keys do not fit one block (more than :data:`MAX_KEYS`), the group is still
taken if its row stages are a softmax's -- ``m = max(L)``, ``l = sum(exp(L - m))`` and ``P
= exp(L - m) / l`` for one logit expression ``L`` of ``S`` (:func:`online_softmax`) -- and
the kernel walks the keys in chunks (:data:`CHUNKS`) through a two-slot ring of K and V,
keeping each row's running maximum and sum: a chunk whose maximum is larger rescales the
sum and ``O``'s accumulators by ``exp(m_old - m_new)``, and ``O`` is divided by ``l`` once,
at the end.  ``exp(L - m)`` is at most one, so in fp16 the unnormalised ``P`` rounds as
well as the normalised one does.  A softmax over fewer keys is offered in chunks too
(:data:`SHORT_CHUNKS`), beside the one-pass configs: a chunk holds fewer keys' K and V in
shared memory and fewer of ``S``'s accumulators in registers, so more blocks fit an SM.
Where the rows make few warps (a batch of one), a slot may hold ``splits`` chunks, each
multiplied by a warp of its own, the warps of a row group combining their maxima, sums and
``O`` at the end (:attr:`AttentionConfig.key_splits`).

The rule proposes nothing (None) for anything else; ``mma`` and SIMT stages still cover
the group's parts.

Exact fp32 attention (``attention_ffma``, :data:`FFMA_KIND`) is the same kernel with FMAs for
both products, as the ``ffma`` kind computes the ``mma`` kind's tiles: each lane fills the
accumulators ``mma.sync`` would leave it from its rows of Q (four head elements a load) and
its keys of K; for ``O`` it gathers the 8 keys of each piece of ``P`` from its quad by
shuffles and multiplies them by its column pairs of V.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from welder.ir.compute import Compute
from welder.ir.expr import (
    INDEX,
    Binary,
    Call,
    Const,
    Expr,
    Load,
    Var,
    free_vars,
    loads,
    rewrite,
    substitute,
    walk,
)
from welder.ir.layout import affine_layout
from welder.schedule.config import Estimate, GroupConfig, StageConfig
from welder.schedule.group import Group
from welder.schedule.kinds import ffma, mma, simt
from welder.schedule.kinds.base import LAUNCH_OVERHEAD_US, ScheduleContext, ShapeOf, top_by_family
from welder.tile.footprint import Buffer
from welder.tile.propagate import GroupRegions, partitions_output, propagate_group

#: Keys one block holds (padded to 16): ``S``'s accumulators take ``keys / 2`` registers a thread.
MAX_KEYS = 256
#: Keys per pass of the online softmax (:func:`online_softmax`), for more than MAX_KEYS.
CHUNKS = (64, 128)
#: The same for a softmax over at most MAX_KEYS keys, offered where shorter than the keys:
#: bert's fp32 attention (128 keys of width 64) holds 105 KB of operands a block in one
#: pass, two blocks an SM, and measured 1.8x its estimate (docs/schedule.md).
SHORT_CHUNKS = (32, 64)
#: Widest head (``K`` of the first product, ``N`` of the second), padded to 16.
MAX_HEAD = 128
#: Warps per block (16 rows each).
WARPS = (1, 2, 4, 8)
#: Warps sharing each ring slot's keys (:attr:`AttentionConfig.key_splits`), offered in chunks
#: where the rows make fewer than SPLIT_BELOW_WARPS warps an SM: Conformer's attention at
#: batch 1 is 128 blocks of 2 warps, each walking 512 keys alone (15.3 us a layer on an H200
#: against 8.9 estimated; a sub-partition of an SM without a warp leaves its tensor core idle).
SPLITS = (2, 4)
SPLIT_BELOW_WARPS = 8
#: Reductions a row stage may compute (in registers, combined by shuffles).
ROW_REDUCTIONS = ("sum", "max", "min")
#: The shared-memory buffer holding Q's rows, K and V.
OPERANDS = "attention/operands"
#: Registers a thread needs besides its accumulators: addresses, fragments, row values.
BASE_REGISTERS = 56
#: The share of DRAM bandwidth the kernel streams at.  A block copies its operands, then
#: computes, then stores, so an SM's few blocks leave DRAM idle part of the time: on the
#: H100 (scripts/attention_bench.py) BERT's, ViT's and Swin's attention at batch 64 all took
#: 1.42-1.44x the time the SIMT kinds' 0.8 predicted, the memory term dominating each.
DRAM_EFFICIENCY = 0.56
#: The same for persistent blocks (:attr:`AttentionConfig.persistent`), which copy the next
#: tile's operands while multiplying this one's: a wave streams as the SIMT kinds' loads do
#: (their 0.8).  Written before measuring (docs/codegen.md, "Attention across heads").
STREAMING_DRAM_EFFICIENCY = 0.8
#: Tiles a persistent block walks at the least: fewer and the ring has nothing to overlap.
MIN_TILES_PER_BLOCK = 2
#: Warps an SM holds of persistent blocks at the least.  Their ring doubles the operands,
#: so fewer blocks fit: BERT-base's at batch 64 on the H200 (docs/codegen.md, "Attention
#: across heads") with 2 warps a block (2 blocks, 4 warps an SM) took 1.3-1.8x their
#: one-block-a-tile twins in both the tuner and the attention bench, with 1 warp 2.5x.
MIN_PERSISTENT_WARPS_PER_SM = 8
#: Share of the CUDA cores' fp32 peak the fp32 kernel's products are expected to reach: about
#: four FMAs per shared-memory load in ``O``'s product and eight in ``S``'s, plus the shuffles
#: that gather ``P``; the ``ffma`` kind reaches 0.55-0.6 with some sixteen FMAs per load.  On
#: the H100 Swin's attention took 1.06x the estimate this gives, ViT's 1.52x and bert's 1.81x
#: (fewer warps an SM as the operands fill shared memory): welder.schedule.calibration's
#: factor for the kind corrects the median.
FFMA_EFFICIENCY = 0.35


@dataclass
class AttentionConfig(StageConfig):
    """The fused stages of one attention group: ``fused`` (the first product, then the row
    stages) computed in registers, and ``node``, the second product, whose tile later
    stages read at ``smem_offset``."""

    kind: ClassVar[str] = "attention"

    tile: tuple[int, ...]  # the second product's region per block
    warps: int  # 16 rows each
    keys: int  # the key axis padded to 16 (to 8 with FMAs)
    head: int  # K of the first product padded to 16
    width: int  # N of the second product padded to 16
    copy_bytes: int  # per cp.async: 16, else 8 or 4 where strides or origins are not aligned to 16 bytes
    operands_offset: int  # byte offset of Q's rows, K and V in the shared pool
    fused: tuple[str, ...] = ()  # the first product, then the row stages, in order
    smem_offset: int | None = None  # where the second product's tile lives when read in the group
    chunk: int = 0  # keys per pass of the online softmax; 0: all keys in one pass
    # Warps per 16 rows, each multiplying its own chunk of every ring slot (only in chunks):
    # the parallelism of a batch-1 attention, whose rows make few warps (:data:`SPLITS`).
    key_splits: int = 1
    # Blocks launched, each walking root tiles blockIdx.x, + gridDim.x, ... with Q, K and V in
    # two slots, the next tile's copied while this one's are multiplied (0: a block a tile;
    # only in one pass, fp16 or bf16, keys not split).
    persistent: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AttentionConfig:
        """As the base's; reads ``splits``, this field's name in search version 12's
        ``tuned.json`` files, as ``key_splits`` (renamed: the kernel took a stage's
        ``splits`` for blocks per tile, ``MmaConfig.splits``)."""
        if "splits" in d:
            d = {("key_splits" if k == "splits" else k): v for k, v in d.items()}
        return super().from_json(d)

    @property
    def chunk_keys(self) -> int:
        """Keys whose K and V rows one ring slot holds (all of them without chunks)."""
        return self.chunk * self.key_splits or self.keys

    @property
    def warp_keys(self) -> int:
        """Keys a warp multiplies a pass."""
        return self.chunk or self.keys

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.key_splits

    @property
    def family(self) -> str:
        if self.persistent:
            return f"{self.kind}/persistent"
        return f"{self.kind}/split" if self.key_splits > 1 else self.kind

    @property
    def block_m(self) -> int:
        return 16 * self.warps

    def renamed(self, names: Mapping[str, str]) -> AttentionConfig:
        return replace(
            self, node=names.get(self.node, self.node), fused=tuple(names.get(f, f) for f in self.fused)
        )


@dataclass
class AttentionFfmaConfig(AttentionConfig):
    """An :class:`AttentionConfig` computed with FMAs on CUDA cores (exact fp32)."""

    kind: ClassVar[str] = "attention_ffma"


@dataclass(frozen=True)
class Attention:
    """A group's attention structure (see the module docstring)."""

    scores: mma.Contraction  # S = Q.K, the group's first stage
    rows: tuple[str, ...]  # the row stages, in order
    out: Compute  # O = P.V
    probs: Expr  # P: O's computed factor
    values: mma.Operand  # V: O's loaded factor (contiguous "n" or "k" as a B operand)
    key: str  # O's reduce axis (the keys)
    online: bool = False  # a softmax (online_softmax): may be walked in chunks, must be past MAX_KEYS

    @property
    def keys(self) -> int:
        return self.scores.n

    @property
    def head(self) -> int:
        return self.scores.k_extent

    @property
    def width(self) -> int:
        return self.out.shape[-1]

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages the kernel computes in registers, then ``O``."""
        return (self.scores.compute.name, *self.rows, self.out.name)

    def values_contraction(self) -> mma.Contraction:
        """``O`` as a contraction whose B operand is ``V`` (how codegen copies it); A is
        computed, never copied, so ``V`` stands in for it."""
        c = self.out
        return mma.Contraction(
            c,
            self.scores.fmt,
            self.values,
            self.values,
            len(c.axes) - 2,
            len(c.axes) - 1,
            self.key,
            tuple(range(len(c.axes) - 2)),
        )


def _row_load(ld: Load, rows: tuple[int, ...], key: str | None) -> bool:
    """Whether ``ld`` reads its tensor at ``(i0, .., i<n-1>)`` over the row axes of extents
    ``rows`` (0 where one has one element) then, where ``key`` is given, at ``key``: the
    point a row stage or ``P`` is computed at."""
    want = [f"i{d}" for d in range(len(rows))] + ([key] if key else [])
    extents = [*rows, 0]
    return len(ld.indices) == len(want) and all(
        (isinstance(i, Var) and i.name == w) or (extents[d] == 1 and isinstance(i, Const) and i.value == 0)
        for d, (i, w) in enumerate(zip(ld.indices, want))
    )


def _reads_in_registers(
    e: Expr, scores: str, rows: tuple[str, ...], row_shape: tuple[int, ...], key: str, group: Group
) -> bool:
    """Whether every load of ``e`` is of ``S`` at ``(.., row, key)``, of a row stage at
    ``(.., row)``, or of a global tensor (with indices reading no group member)."""
    for ld in loads(e):
        if ld.tensor == scores:
            if not _row_load(ld, row_shape, key):
                return False
        elif ld.tensor in rows:
            if not _row_load(ld, row_shape, None):
                return False
        elif ld.tensor in group.members:
            return False
    return True


def attention(group: Group, shape_of: ShapeOf, fp32: bool = False) -> Attention | None:
    """``group`` as an attention group, or None (see the module docstring): in fp16 or bf16,
    or with ``fp32`` in exact fp32 (the ``ffma`` format)."""
    if len(group.stages) < 2:
        return None
    scores = mma.contraction(group.computes[group.stages[0]], shape_of)
    if scores is not None and fp32:
        scores = ffma.as_ffma(scores)
    if scores is None or (scores.fmt.elem_bytes != 2 and not fp32) or scores.gathered or scores.gathered_rows:
        return None
    s_name = scores.compute.name
    if scores.n_axis != len(scores.compute.axes) - 1 or s_name in group.outputs:
        return None
    if scores.k_extent > MAX_HEAD:
        return None
    row_shape = scores.compute.shape[:-1]
    rows: list[str] = []
    for pos, name in enumerate(group.stages[1:], start=1):
        c = group.computes[name]
        if c.shape == row_shape and c.reduce_op in ROW_REDUCTIONS and len(c.reduce_axes) == 1:
            key = c.reduce_axes[0]
            if key.extent != scores.n or name in group.outputs:
                return None
            if not _reads_in_registers(c.body, s_name, tuple(rows), row_shape, key.name, group):
                return None
            rows.append(name)
            continue
        found = _second_product(group, c, scores, tuple(rows), shape_of)
        if found is None:
            return None
        # Later stages read O (from shared memory) and global tensors only.
        in_registers = {s_name, *rows}
        for later in group.stages[pos + 1 :]:
            if any(ld.tensor in in_registers for ld in group.computes[later].loads()):
                return None
        softmax = online_softmax(group, found)
        if found.keys > MAX_KEYS and not softmax:
            return None
        return replace(found, online=softmax)
    return None


def online_softmax(group: Group, att: Attention) -> bool:
    """Whether ``att``'s row stages are ``m = max(L)`` and ``l = sum(exp(L - m))`` and its
    ``P`` is ``exp(L - m) / l``, for one expression ``L`` (of ``S`` and global tensors): then
    ``O = (sum exp(L - m) V) / l`` can be accumulated chunk by chunk, rescaled whenever the
    running maximum grows.  Expressions are compared with their keys renamed alike and their
    loads of ``S`` and of the row stages reduced to names (:func:`attention` proved them to
    read the row's element, however its indices spell it)."""
    if len(att.rows) != 2:
        return False
    top, total = (group.computes[r] for r in att.rows)
    if top.reduce_op != "max" or total.reduce_op != "sum":
        return False
    key = Var("key")
    in_registers = {att.scores.compute.name, *att.rows}

    def plain(e: Expr, axis: str) -> Expr:
        e = substitute(e, {axis: key})
        return rewrite(e, lambda n: named(n) if isinstance(n, Load) and n.tensor in in_registers else None)

    def named(ld: Load) -> Load:
        return Load(ld.tensor, (), ld.dtype)

    logit = plain(top.body, top.reduce_axes[0].name)
    term = plain(total.body, total.reduce_axes[0].name)
    probs = plain(att.probs, att.key)
    m, l_ = (Load(r, (), group.computes[r].dtype) for r in att.rows)
    return term == Call("exp", (Binary("sub", logit, m),)) and probs == Binary("div", term, l_)


def _second_product(
    group: Group, c: Compute, scores: mma.Contraction, rows: tuple[str, ...], shape_of: ShapeOf
) -> Attention | None:
    """``c`` as ``O = P.V`` over the keys of ``scores``, or None."""
    body = c.body
    row_shape = scores.compute.shape[:-1]
    if (
        not c.is_product
        or c.dtype != scores.compute.dtype
        or len(c.reduce_axes) != 1
        or c.reduce_axes[0].extent != scores.n
        or c.shape[:-1] != row_shape
        or c.shape[-1] > MAX_HEAD
    ):
        return None
    assert isinstance(body, Binary)
    key = c.reduce_axes[0].name
    n_name = c.axes[-1].name
    m_name = c.axes[-2].name
    axes = (*c.axes, *c.reduce_axes)
    for probs, v in ((body.a, body.b), (body.b, body.a)):
        if not isinstance(v, Load) or v.tensor in group.members or v.dtype != c.dtype:
            continue
        if n_name in free_vars(probs) or probs.dtype != c.dtype:
            continue
        if not _reads_in_registers(probs, scores.compute.name, rows, row_shape, key, group):
            continue
        layout = affine_layout(v, shape_of(v.tensor), axes)
        if layout is None:
            continue
        offset, strides = layout
        if strides[m_name] != 0 or strides[key] == 0:
            continue
        contiguous = "n" if strides[n_name] == 1 else "k" if strides[key] == 1 else None
        if contiguous is None:
            continue
        return Attention(scores, rows, c, probs, mma.Operand(v, v.tensor, offset, strides, contiguous), key)
    return None


# -- the policy --------------------------------------------------------------------------------


def _pad16(x: int) -> int:
    return mma._round_up(x, 16)


def operand_elements(att: Attention, warps: int, chunk: int = 0, splits: int = 1) -> tuple[int, int, int]:
    """Elements (padded rows included) of Q's rows and of one ring slot of K and of V (all
    keys, or ``splits`` chunks of them)."""
    q, k = mma.ring_elements(scores_config(att, warps, 16, chunk, splits), att.scores)
    v = mma.ring_elements(values_config(att, warps, 16, chunk, splits), att.values_contraction())[1]
    return q, k, v


def ring_slots(chunk: int, persistent: bool = False) -> int:
    """Slots of K and V in shared memory: one holding every key, or two chunks (one being
    multiplied while the next lands), or, in a persistent block, two tiles' keys."""
    return 2 if chunk or persistent else 1


def q_slots(persistent: bool) -> int:
    """Slots of Q's rows in shared memory: a persistent block's two tiles', else one."""
    return 2 if persistent else 1


def operand_bytes(
    att: Attention, warps: int, chunk: int = 0, splits: int = 1, persistent: bool = False
) -> int:
    """Shared memory for Q's rows and the ring slots of K and V (Q's too in a persistent
    block) -- with ``splits``, at least what the warps of a row group leave there for each
    other after the keys (:func:`combine_floats`)."""
    q, k, v = operand_elements(att, warps, chunk, splits)
    ring = (q_slots(persistent) * q + ring_slots(chunk, persistent) * (k + v)) * att.scores.fmt.elem_bytes
    return max(ring, 4 * combine_floats(att, warps, splits)) if splits > 1 else ring


def lane_floats(att: Attention) -> int:
    """Floats a lane of split keys leaves for the first warp of its row group to combine:
    two row maxima, two sums and its ``O`` accumulators."""
    return 4 + _pad16(att.width) // 2


def combine_floats(att: Attention, warps: int, splits: int) -> int:
    """Floats the ``warps x splits`` warps of split keys leave (:func:`lane_floats` a lane)."""
    return 32 * warps * splits * lane_floats(att)


def _one_slice(node: str, warps: int, n: int, k: int, copy_bytes: int, splits: int = 1) -> mma.MmaConfig:
    """A product of the kernel as a one-slice ``mma`` stage of ``16 x warps`` rows, ``n``
    columns and depth ``k`` (both padded to 16): how its operands are laid out and copied
    (by every thread of the ``warps x splits`` warps)."""
    return mma.MmaConfig(
        node,
        tile=(),
        block=(16 * warps, _pad16(n)),
        block_k=_pad16(k),
        warps=(warps, splits),
        pipeline=1,
        copy_bytes=copy_bytes,
        pipeline_offset=0,
    )


def scores_config(
    att: Attention, warps: int, copy_bytes: int, chunk: int = 0, splits: int = 1
) -> mma.MmaConfig:
    """``S``'s product (of every key, or of a ring slot's ``splits`` chunks) as a one-slice
    ``mma`` stage (Q is A, K is B)."""
    keys = chunk * splits or att.keys
    return _one_slice(att.scores.compute.name, warps, keys, att.head, copy_bytes, splits)


def values_config(
    att: Attention, warps: int, copy_bytes: int, chunk: int = 0, splits: int = 1
) -> mma.MmaConfig:
    """``O``'s product (over every key, or a ring slot's ``splits`` chunks) as a one-slice
    ``mma`` stage (V is B)."""
    keys = chunk * splits or att.keys
    return _one_slice(att.out.name, warps, att.width, keys, copy_bytes, splits)


def registers(att: Attention, warps: int, chunk: int = 0) -> int:
    """Per thread: ``S``'s accumulators (of every key or a chunk's) and ``O``'s, two values
    per row stage, the rest (in fp32 also a piece's 16 values of ``P`` and 8 of Q)."""
    fp32 = 24 if att.scores.fmt.elem_bytes == 4 else 0
    return BASE_REGISTERS + _pad16(chunk or att.keys) // 2 + _pad16(att.width) // 2 + 2 * len(att.rows) + fp32


def chunk_choices(att: Attention) -> tuple[int, ...]:
    """Keys per pass to offer (0: one pass): chunks past MAX_KEYS; for a softmax within it
    one pass and the shorter chunks; else one pass."""
    if att.keys > MAX_KEYS:
        return CHUNKS
    if not att.online:
        return (0,)
    return (0, *(c for c in SHORT_CHUNKS if c < att.keys))


class AttentionKind:
    """The policy rule of the ``attention`` kind, or with ``fp32`` of ``attention_ffma`` (see
    the module docstring)."""

    def __init__(self, config_type: type[AttentionConfig], fp32: bool, efficiency: float) -> None:
        self.config_type = config_type
        self.name = config_type.kind
        self.fp32 = fp32
        self.efficiency = efficiency  # of the format's peak, for both products

    def propose(self, group: Group, ctx: ScheduleContext) -> list[GroupConfig] | None:
        if ctx.arch.compute_capability < mma.MIN_COMPUTE_CAPABILITY:
            return None
        att = attention(group, ctx.shape_of, self.fp32)
        if att is None:
            return None
        found = []
        for warps in WARPS:
            for chunk in chunk_choices(att):
                for splits in (1, *(SPLITS if chunk and not self.fp32 else ())):
                    found += _config(group, att, warps, chunk, ctx, self, splits)
                if chunk == 0 and not self.fp32:
                    found += _config(group, att, warps, 0, ctx, self, persistent=True)
        found.sort(key=lambda c: c.estimate.latency_us)
        return top_by_family(found, ctx.options.topk)


def persistent_configs(group: Group, ctx: ScheduleContext, resident: int) -> list[GroupConfig]:
    """``group``'s persistent configs (:attr:`AttentionConfig.persistent`) of at most
    ``resident`` blocks, whatever the SMs would hold: a small grid whose blocks each walk
    several tiles, as the emulator's tests need; none where the group is no attention."""
    att = attention(group, ctx.shape_of)
    if att is None or ctx.arch.compute_capability < mma.MIN_COMPUTE_CAPABILITY or 0 not in chunk_choices(att):
        return []
    found = []
    for warps in WARPS:
        found += _config(group, att, warps, 0, ctx, KIND, persistent=True, resident=resident)
    return found


def _config(
    group: Group,
    att: Attention,
    warps: int,
    chunk: int,
    ctx: ScheduleContext,
    rule: AttentionKind,
    splits: int = 1,
    persistent: bool = False,
    resident: int | None = None,
) -> list[GroupConfig]:
    """The configs of ``warps`` warps (16 rows each) taking ``chunk`` keys a pass (0: all),
    each with ``splits`` warps sharing a ring slot's keys; none where they do not fit, nor
    split keys where the rows alone make warps enough (:data:`SPLIT_BELOW_WARPS`).  With
    ``persistent``, blocks that walk the tiles (as many as fit the SMs at once, or
    ``resident``), none where each would walk fewer than :data:`MIN_TILES_PER_BLOCK` or,
    without ``resident``, where an SM would hold fewer than
    :data:`MIN_PERSISTENT_WARPS_PER_SM` warps of them."""
    bm = 16 * warps
    if warps > 1 and bm // 2 >= _pad16(att.scores.m):
        return []  # mostly padding
    placed = root_tile(group, att, bm, ctx.shape_of)
    if placed is None:
        return []
    tile, regions = placed
    out_region = regions.members[att.out.name].extents
    if any(e != 1 for e in out_region[:-2]) or out_region[-2] > bm or out_region[-1] != att.width:
        return []
    root_shape = ctx.shape_of(group.root)
    grid = tuple(-(-s // t) for s, t in zip(root_shape, tile))
    if splits > 1 and math.prod(grid) * warps >= SPLIT_BELOW_WARPS * ctx.arch.sm_count:
        return []
    for out in group.outputs:
        if out != group.root and not partitions_output(regions.members[out], ctx.shape_of(out), tile, grid):
            return []
    copy_bytes = _copy_bytes(att, regions, grid)
    if copy_bytes is None:
        return []
    stage = rule.config_type(
        att.out.name,
        tile=tuple(out_region),
        warps=warps,
        # FMAs walk the keys in pieces of 8 (Swin's 49 as 56); mma.sync in k16 slices;
        # chunks in whole chunks.
        keys=mma._round_up(att.keys, chunk * splits or (8 if rule.fp32 else 16)),
        head=_pad16(att.head),
        width=_pad16(att.width),
        copy_bytes=copy_bytes,
        operands_offset=0,
        fused=att.stages[:-1],
        chunk=chunk,
        key_splits=splits,
    )
    threads = stage.threads
    later = []
    for s in group.stages[len(att.stages) :]:
        st = simt.plan_stage(group, s, regions, threads)
        if st is None:
            return []
        later.append(st)
    info = simt.group_info(group, ctx.shape_of, ctx.dtype_of, ctx.arch)
    operands = Buffer(OPERANDS, operand_bytes(att, warps, chunk, splits, persistent), 0, 0)
    placeholder = simt.SimtConfig(att.out.name, stage.tile, (1,) * len(tile), (1,) * len(tile))
    # Without later stages O goes straight to global memory and needs no tile.
    offsets, smem = simt.place_smem(info, [placeholder, *later] if later else [], [operands])
    stage.smem_offset = placeholder.smem_offset if later else None
    stage.operands_offset = offsets[OPERANDS]
    if smem > ctx.arch.smem_per_block:
        return []
    regs = max([registers(att, warps, chunk), *(simt.registers(st) for st in later)])
    if regs > ctx.arch.max_regs_per_thread:
        return []
    if persistent:
        per_sm = simt.blocks_per_sm(threads, regs, smem, ctx.arch)
        if resident is None and per_sm * warps < MIN_PERSISTENT_WARPS_PER_SM:
            return []
        stage.persistent = min(resident or per_sm * ctx.arch.sm_count, per_sm * ctx.arch.sm_count)
        if stage.persistent < 1 or math.prod(grid) < MIN_TILES_PER_BLOCK * stage.persistent:
            return []
    estimate = _estimate(group, att, stage, later, regions, grid, smem, regs, ctx, rule.efficiency)
    if estimate is None:
        return []
    order = tuple(range(len(tile)))
    plain = GroupConfig(group.root, tile, grid, order, threads, [stage, *later], smem, estimate)
    # Heads merged back in 16-byte vectors, where they can be: the tuner measures both.
    twin = simt.vector_twin(group, plain, ctx.shape_of, ctx.dtype_of) if later else None
    return [plain] if twin is None else [plain, twin]


def _divisors(n: int) -> list[int]:
    """Divisors of ``n``, largest first."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _largest(hi: int, holds: Callable[[int], bool]) -> int:
    """The largest ``t`` in 1..hi for which ``holds``, 1 where none does; ``holds`` is true
    up to a bound and false past it (a tile's regions grow with it), so a bisection finds
    it in log(hi) tests, where a NeRF's two million rows would take as many one by one."""
    if holds(hi):
        return hi
    lo = 1
    if hi == 1 or not holds(lo):
        return 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


def root_tile(
    group: Group, att: Attention, bm: int, shape_of: ShapeOf
) -> tuple[tuple[int, ...], GroupRegions] | None:
    """The largest root tile whose block computes rows of one matrix of both products (at
    most ``bm`` of them, every key, O's whole width), with every stage's region; None where
    none does.  Root axes are tiled by divisors of their extent: first each as large as
    keeps both products within one matrix with the others at one element (a head's slice of
    ``[tokens, heads x width]`` is its width), then shrunk in order until the rows fit
    (to any size: ``tile`` need not divide the axis)."""
    members = [group.computes[s] for s in group.stages]
    root_shape = shape_of(group.root)
    s_name, o_name = att.scores.compute.name, att.out.name

    def regions(tile: list[int]) -> GroupRegions:
        return propagate_group(members, group.root, tuple(tile), shape_of)

    def one_matrix(r: GroupRegions) -> bool:
        return all(e == 1 for e in r.members[s_name].extents[:-2]) and all(
            e == 1 for e in r.members[o_name].extents[:-2]
        )

    tile = [1] * len(root_shape)
    for k, size in enumerate(root_shape):
        unit = [1] * len(root_shape)
        fits = next((t for t in _divisors(size) if one_matrix(regions([*unit[:k], t, *unit[k + 1 :]]))), None)
        if fits is None:
            return None  # one root element already spans several matrices
        tile[k] = fits

    def fits(k: int, t: int) -> bool:
        found = regions([*tile[:k], t, *tile[k + 1 :]])
        return one_matrix(found) and found.members[s_name].extents[-2] <= bm

    for k in range(len(root_shape)):
        # Rows fill the block: the last block of a ragged axis is partly empty, and its
        # stages skip rows past the end.
        tile[k] = _largest(tile[k], lambda t, k=k: fits(k, t))
    found = regions(tile)
    s_region, o_region = found.members[s_name].extents, found.members[o_name].extents
    if not one_matrix(found) or s_region[-2] > bm or s_region[-1] != att.keys or o_region[-1] != att.width:
        return None
    return tuple(tile), found


def _copy_bytes(att: Attention, regions: GroupRegions, grid: tuple[int, ...]) -> int | None:
    """The widest copy both products' operands allow: the block's Q rows start on a copy
    along Q's contiguous axis (``mma``'s rule), and V's strides and offset are multiples
    of it (a block reads V whole)."""
    region = regions.members[att.scores.compute.name]
    first = mma._copy_bytes(att.scores, region, grid, mma.KIND.copy_widths(att.scores))
    second = att.values_contraction().copy_bytes()
    if first is None or second is None:
        return None
    return min(first, second)


def _estimate(
    group: Group,
    att: Attention,
    stage: AttentionConfig,
    later: list[simt.SimtConfig],
    regions: GroupRegions,
    grid: tuple[int, ...],
    smem: int,
    regs: int,
    ctx: ScheduleContext,
    efficiency: float,
) -> Estimate | None:
    """Both products at ``efficiency`` of the format's peak (the tensor cores' or the CUDA
    cores'), the row stages' and ``P``'s arithmetic on every (row, key) at the SIMT rate,
    against DRAM (each tensor once) and L2 (each block reads its Q rows, K and V whole); one
    fill of the operands; the launch."""
    arch = ctx.arch
    threads = stage.threads
    blocks = math.prod(grid)
    blocks_per_sm = simt.blocks_per_sm(threads, regs, smem, arch)
    if blocks_per_sm < 1:
        return None
    waves = -(-blocks // (blocks_per_sm * arch.sm_count))
    bm = stage.block_m
    flops_block = 2 * bm * stage.keys * (stage.head + stage.width)
    sm_rate = getattr(arch, att.scores.fmt.peak) * 1e12 * efficiency / arch.sm_count
    rounds = -(-blocks // arch.sm_count)
    tc_us = rounds * flops_block / sm_rate * 1e6
    # Row stages (their point_flops already count every key), then P at every (row, key).
    probs = sum(1 for e in walk(att.probs) if isinstance(e, (Binary, Call)) and e.dtype != INDEX)
    rows = sum(group.computes[r].point_flops for r in att.rows)
    simt_flops = bm * (rows + stage.keys * probs) + sum(
        math.prod(regions.members[st.node].extents) * group.computes[st.node].point_flops for st in later
    )
    simt_us = rounds * simt_flops / (arch.fp32_tflops * 1e12 * simt.COMPUTE_EFFICIENCY / arch.sm_count) * 1e6
    q, k, v = operand_elements(att, stage.warps, stage.chunk, stage.key_splits)
    item = att.scores.fmt.elem_bytes
    read_block = (q + (k + v) * stage.keys // stage.chunk_keys) * item
    write_block = simt.block_bytes(
        regions.members, group.outputs, ctx.shape_of, ctx.dtype_of, arch.write_transaction
    )
    compulsory = simt.io_bytes(group, ctx.shape_of, ctx.dtype_of)
    # A persistent block copies its next tile during this one's products: its operands
    # stream, and it waits for a fill once, not once a wave.
    dram_share = STREAMING_DRAM_EFFICIENCY if stage.persistent else DRAM_EFFICIENCY
    dram_us = compulsory / (arch.global_bw_gbs * 1e9 * dram_share) * 1e6
    l2_us = (read_block + write_block) * blocks / (arch.l2_bw_gbs * 1e9) * 1e6
    fills = 1 if stage.persistent else waves
    fill_us = fills * mma.SLICE_LATENCY_US / max(1, blocks_per_sm)
    latency = max(tc_us + simt_us, dram_us, l2_us) + fill_us + LAUNCH_OVERHEAD_US
    return Estimate(
        blocks=blocks,
        blocks_per_sm=blocks_per_sm,
        waves=waves,
        read_bytes=read_block * blocks,
        write_bytes=write_block * blocks,
        compulsory_bytes=compulsory,
        flops=flops_block * blocks + simt_flops * blocks,
        smem_bytes=smem,
        regs_per_thread=regs,
        latency_us=round(latency, 4),
    )


KIND = AttentionKind(AttentionConfig, fp32=False, efficiency=mma.TC_EFFICIENCY)
FFMA_KIND = AttentionKind(AttentionFfmaConfig, fp32=True, efficiency=FFMA_EFFICIENCY)
