"""The ``mma`` kind: a contraction on tensor cores, fp16 and bf16 always and fp32 as TF32 on
request.

A group qualifies when its first tile-owning stage is a contraction
``C[..., m, n] = sum_k A[..] * B[..]`` of two loads of the product's dtype (an
:class:`MmaFormat` of :data:`FORMATS`) whose flat offsets are affine in
the axes (proved as ``--skip-dot`` proves them, :func:`~.library.affine_layout`): the
output's last axis is N (B varies along it, A does not), the one before it M (A varies, B
does not), every other output axis is a batch the block walks one matrix at a time, and
one reduce axis is K.  Injective producers are already inlined into the loads, so a
transpose or reshape in front of the product costs nothing but different strides.

The stage computes a ``block_m x block_n`` tile per block with ``warps`` warps, each
owning a ``warp_m x warp_n`` piece of ``m16n8k<mma_k>`` products.  Operands reach shared
memory through a ``pipeline``-deep ``cp.async`` ring of ``block_k``-deep slices (16-byte
copies where every stride allows, 4-byte ones otherwise; ragged edges zero-filled), and
registers through ``ldmatrix`` (``.trans`` where the operand's contiguous axis needs it) or,
for 32-bit elements whose rows run along K (``ldmatrix`` cannot transpose them), plain
32-bit shared loads.  Rows are padded so that a fragment load touches distinct banks: 16
bytes for ``ldmatrix`` (its eight 16-byte rows), 8 words for 32-bit loads (four rows of
eight consecutive words).  Accumulators are fp32.

fp32 contractions run as TF32 (``m16n8k8``): each operand element is rounded to TF32 with
``cvt.rna`` (to nearest) as it reaches registers -- the tensor core would otherwise drop the
low 13 mantissa bits, a truncation with twice the error, all of it towards zero.  TF32 keeps
10 mantissa bits, so results differ from exact fp32 by up to about 1e-3 relative: only the
``mma_tf32`` kind proposes them, and the default :attr:`~.base.Options.kinds` does not list
it (``welder tune --tf32`` does).

The tile lands in shared memory for later stages of the group (SIMT stages: bias,
activations, softmax over a row, layer norms) and/or in global memory.  Those stages may
reshape and transpose it (tokens written out as an image, a projection split into heads):
the root tile is derived from the contraction's block tile (:func:`_root_tile`), so that
every block still computes one ``block_m x block_n`` tile of one matrix.

Split-K: where the output tiles cannot fill the SMs (few rows times a weight: batch-1
transformer layers), ``splits`` blocks share each tile, each summing a contiguous run of K
slices.  Each leaves its fp32 partial sums in a workspace; the last to arrive (an atomic
counter per tile, which it resets for the next launch) adds all of them in split order --
deterministic whichever block arrives last -- and carries on as an unsplit block would,
later stages included.  The workspace and counters are device globals of the kernel's own
module, so launches on one stream never share them.

The rule proposes nothing (None) for anything else; the SIMT kind still covers it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from welder.ir.compute import Compute
from welder.ir.expr import Binary, Const, Expr, Load, Select, Var, free_vars, walk
from welder.ir.layout import affine_layout, reads_own_flat_point, split_axes
from welder.schedule.config import Estimate, GroupConfig, StageConfig
from welder.schedule.group import Group
from welder.schedule.kinds import simt
from welder.schedule.kinds.base import LAUNCH_OVERHEAD_US, ScheduleContext, ShapeOf, top_by_family
from welder.tile.footprint import Buffer
from welder.tile.propagate import GroupRegions, Region, partitions_output, propagate_group
from welder.tile.region import Affine, Interval

#: mma.sync (m16n8k16 and m16n8k8.tf32), ldmatrix and cp.async arrived with Ampere; a V100
#: cost model proposes no tensor-core stage of this kind.
MIN_COMPUTE_CAPABILITY = (8, 0)
#: The instructions' tile of the output: m16n8 (K is the format's ``mma_k``).
MMA_M, MMA_N = 16, 8


@dataclass(frozen=True)
class MmaFormat:
    """What differs between the operand types the kind computes: plain data that the policy,
    the emitter and the template read, so that every type runs through the same code."""

    kind: str  # the kernel kind that computes it, and its stage configs' kind
    precision: str  # the arithmetic's name in welder.check.THRESHOLDS
    dtype: str  # the operands' and the product's IR dtype
    elem_bytes: int
    mma_k: int  # the instruction's K: m16n8k<mma_k>
    instruction: str  # the welder_mma.cuh function of one product
    convert: str | None  # the welder_mma.cuh function rounding a loaded element, if any
    peak: str  # the Arch field with the dense tensor-core rate of this type
    block_ks: tuple[int, ...]  # slice depths tried, in elements (64 to 256 bytes a row)
    products: int = 1  # tensor-core products a piece takes per K step (split operands: 3)

    def loader(self, k_rows: bool) -> str:
        """How an operand slice reaches registers: ``"ldmatrix"`` where its rows run along
        M or N (K contiguous), ``"ldmatrix_trans"`` where they run along K; ``.trans``
        swaps 16-bit elements only, so 32-bit elements there take ``"lds"`` (32-bit loads)."""
        if not k_rows:
            return "ldmatrix"
        return "ldmatrix_trans" if self.elem_bytes == 2 else "lds"

    def row_pad(self, k_rows: bool) -> int:
        """Elements of padding at the end of every shared-memory row: 16 bytes, so that the
        eight 16-byte rows one ``ldmatrix`` matrix reads start in distinct bank groups (rows
        are a multiple of 64 bytes long); 8 words for 32-bit loads, whose 32 lanes read
        eight consecutive words of four rows (rows a multiple of 16 words long: the four
        then start 8, 16 and 24 banks apart)."""
        return 8 if self.loader(k_rows) == "lds" else 16 // self.elem_bytes


FP16 = MmaFormat(
    "mma", "fp16", "float16", 2, 16, "welder_mma_m16n8k16_f16f32", None, "fp16_tc_tflops", (32, 64, 128)
)
#: bf16 runs as fp16 does (same shapes, fragments and layouts; only the instruction's types
#: differ), at the same dense rate on Ampere and Hopper.
BF16 = MmaFormat(
    "mma", "bf16", "bfloat16", 2, 16, "welder_mma_m16n8k16_bf16f32", None, "fp16_tc_tflops", (32, 64, 128)
)
TF32 = MmaFormat(
    "mma_tf32",
    "tf32",
    "float32",
    4,
    8,
    "welder_mma_m16n8k8_tf32",
    "welder_float_to_tf32",
    "tf32_tc_tflops",
    (16, 32, 64),
)
#: The formats by the IR dtype of a contraction they compute.
FORMATS = {f.dtype: f for f in (FP16, BF16, TF32)}
#: Block tiles (block_m, block_n, warps along m, warps along n), largest first.  Each warp's
#: piece is a multiple of 16 x 16 (``ldmatrix.x4`` feeds two n8 products at a time).
BLOCK_TILES: tuple[tuple[int, int, int, int], ...] = (
    (128, 256, 2, 4),
    (128, 128, 2, 4),
    (128, 128, 2, 2),
    (128, 64, 2, 2),
    (64, 256, 2, 4),
    (64, 128, 2, 2),
    (64, 64, 2, 2),
    (64, 32, 2, 1),
    (32, 256, 1, 4),
    (32, 64, 1, 2),
    (32, 32, 1, 1),
    (16, 256, 1, 4),
    (16, 64, 1, 2),
    (16, 32, 1, 1),
    (16, 16, 1, 1),
)
#: cp.async widths in bytes, widest first: a tile whose origins are not aligned to the widest
#: width its rows allow is copied at the next one.
COPY_WIDTHS = (16, 8, 4)
#: Ring depths: slices in flight while one is multiplied is the depth less one.
PIPELINES = (3, 4)
#: The operand ring's name among the group's shared-memory buffers.
RING = "mma/ring"
#: Split-K factors tried where the output tiles leave SMs idle.
SPLITS = (2, 3, 4, 6, 8, 12, 16)
#: Largest split-K workspace (fp32 partial tiles) one kernel may own.
WORKSPACE_LIMIT = 32 << 20
#: Time from issuing a slice's copies to the barrier after its wait, on a loaded GPU: a block
#: walks its K slices in a chain, ``pipeline - 1`` of them in flight (measured on an H100:
#: 12 slices of 64 at depth 3 took 11.9 us whatever the block tile, 2 us of it the launch).
SLICE_LATENCY_US = 1.4
#: Share of the tensor cores' dense peak that ``mma.sync`` kernels reach (Hopper's full rate
#: needs wgmma); the ranking only needs it to be roughly right against the SIMT kind's.
TC_EFFICIENCY = 0.45
#: Resident blocks per SM that saturate DRAM with a 3-deep pipeline (measured on an H100: 36
#: blocks of 128 x 64 streaming 768 x 2304 weights reached 11% of the bandwidth).
STREAMING_BLOCKS_PER_SM = 2
#: Registers besides the accumulators and fragments: addresses, loop state, the epilogue.
BASE_REGISTERS = 48
#: Thread instructions per element of a gathered operand: its index arithmetic (divisions by
#: constants are multiply-shifts), the padding guard, the 2-byte load, half a 4-byte shared
#: store (elements go in pairs).  Counted against the SM's 4 x 32 lanes issued per clock.
GATHER_ISSUE = 26
#: Registers a thread holds per gathered element pair (one ``__half2``) of the slice it
#: keeps in registers while the current one is multiplied.
GATHER_PAIR_REGISTERS = 1


@dataclass
class MmaConfig(StageConfig):
    """How one contraction stage runs on tensor cores (see the module docstring)."""

    kind: ClassVar[str] = "mma"

    tile: tuple[int, ...]  # extents of the stage's region per block: 1 ... 1, rows, columns
    block: tuple[int, int]  # block_m, block_n: the products' tile (covers the region's last two)
    block_k: int
    warps: tuple[int, int]  # along M, along N
    pipeline: int  # cp.async stages in flight
    copy_bytes: int  # per cp.async: 16, else 8 or 4 where strides or origins are not aligned to 16 bytes
    pipeline_offset: int  # byte offset of the operand ring in the group's shared pool
    smem_offset: int | None = None  # where its tile lives when consumed inside the group
    splits: int = 1  # blocks per output tile, each summing a part of K (split-K)
    # Persistent blocks: where nonzero, the kernel launches this many blocks (one wave) and
    # each walks the root tiles blockIdx.x, + gridDim.x, ...; the ring (and its barriers)
    # carries on from one tile to the next, so a tile's fill and epilogue overlap another's.
    persistent: int = 0
    # The group's later stages, in order, where each is an elementwise function of the
    # product at the same point (bias, activation, residual add, cast): the epilogue computes
    # them on the accumulators and stores them; the config then has no other stage.
    epilogue: tuple[str, ...] = ()

    @property
    def block_m(self) -> int:
        return self.block[0]

    @property
    def block_n(self) -> int:
        return self.block[1]

    @property
    def threads(self) -> int:
        return self.warps[0] * self.warps[1] * 32

    @property
    def cluster(self) -> int:
        """Blocks per thread-block cluster (1: no clusters)."""
        return 1

    @property
    def blocks_per_tile(self) -> int:
        return self.splits

    def renamed(self, names: Mapping[str, str]) -> MmaConfig:
        return replace(
            self, node=names.get(self.node, self.node), epilogue=tuple(names.get(e, e) for e in self.epilogue)
        )

    @property
    def family(self) -> str:
        # The estimate is least sure of split-K (on the H100 it ranked 1-warp unsplit tiles
        # first for 128 x 768 x 2304: 12.3 us; 4-warp tiles split three ways took 9.5 us).
        return "mma/split-k" if self.splits > 1 else "mma"

    def split_tiles(self, k_tiles: int) -> int:
        """K slices each split sums (the last split may sum fewer)."""
        return -(-k_tiles // self.splits)


@dataclass
class Tf32MmaConfig(MmaConfig):
    """An :class:`MmaConfig` of an fp32 contraction, computed as TF32: a kind of its own, so
    that ``tuned.json``, the tuning cache and the tuner's check tell it from exact fp32."""

    kind: ClassVar[str] = "mma_tf32"


#: The config type of each format's stages, by kind name.
CONFIG_TYPES: dict[str, type[MmaConfig]] = {c.kind: c for c in (MmaConfig, Tf32MmaConfig)}


# -- recognising a contraction ----------------------------------------------------------------


@dataclass(frozen=True)
class Operand:
    """One operand's addressing: element ``(.., m or n, k)`` of the matrix the block reads is
    at ``offset + sum(stride[axis] * index)`` of ``tensor``; ``contiguous`` names the
    axis of stride 1 (``"k"``, or ``"m"`` for A / ``"n"`` for B) -- the rows of its
    shared-memory slice run along the other one.

    A *gathered* operand (``gather`` set: a convolution's image read through ``//`` and
    ``%`` of the flattened axes, padding as a select) has no strides: each element's
    address is ``gather``'s own index expression, which the stage evaluates per element.
    Its slice is stored with rows along K (``contiguous`` is its own axis, ``"m"`` or
    ``"n"``), so that consecutive threads fill consecutive elements of a row."""

    load: Load
    tensor: str
    offset: int
    strides: Mapping[str, int]
    contiguous: str
    gather: Expr | None = None  # the operand's expression: a Load, or select(cond, Load, 0)
    # Gathered rows: the operand's expression where only whole rows are gathered -- each
    # row (an index along its own axis) is contiguous along K from an address the
    # expression gives at K = 0 (Swin's window partition, a rolled one a select between two
    # such loads).  The slice is copied as an affine operand's is, with ``cp.async`` along K
    # from each row's address, worked out once per row; ``strides`` holds K's stride (1)
    # alone and ``row_unit`` the elements every row's address is a multiple of.
    rows: Expr | None = None
    row_unit: int = 1

    @property
    def gathered(self) -> bool:
        return self.gather is not None


@dataclass(frozen=True)
class Contraction:
    """A stage compute as a batched matrix product (see the module docstring)."""

    compute: Compute
    fmt: MmaFormat
    a: Operand
    b: Operand
    m_axis: int  # position among the compute's axes
    n_axis: int
    k: str  # name of the reduce axis that is K
    batch_axes: tuple[int, ...]

    @property
    def m(self) -> int:
        return self.compute.axes[self.m_axis].extent

    @property
    def n(self) -> int:
        return self.compute.axes[self.n_axis].extent

    @property
    def k_extent(self) -> int:
        return next(a.extent for a in self.compute.reduce_axes if a.name == self.k)

    @property
    def batch(self) -> int:
        return math.prod(self.compute.axes[d].extent for d in self.batch_axes)

    @property
    def gathered(self) -> Operand | None:
        """The operand copied element by element, if one is (at most one is)."""
        return next((o for o in (self.a, self.b) if o.gathered), None)

    @property
    def gathered_rows(self) -> Operand | None:
        """The operand whose rows are gathered (:attr:`Operand.rows`), if one is."""
        return next((o for o in (self.a, self.b) if o.rows is not None), None)

    @property
    def copied(self) -> tuple[Operand, ...]:
        """The operands copied with ``cp.async`` (the affine ones and gathered rows)."""
        return tuple(o for o in (self.a, self.b) if not o.gathered)

    def stride(self, operand: Operand, role: str) -> int:
        """``operand``'s stride along ``role`` (``"m"``, ``"n"`` or ``"k"``)."""
        return operand.strides.get(self.axis_name(role), 0)

    def axis_name(self, role: str) -> str:
        """The name of the axis that plays ``role``."""
        axis = {"m": self.m_axis, "n": self.n_axis}.get(role)
        return self.k if axis is None else self.compute.axes[axis].name

    def copy_bytes(self) -> int | None:
        """Widest cp.async (16, 8 or 4 bytes) every row of both operands allows: each copy
        starts at a multiple of its width along the contiguous axis, so the other strides and
        the offset must be multiples of it too (in elements: 8, 4 or 2 halves, 4, 2 or 1
        floats).  A 14 x 14 image's rows of 196 halves are 8-byte aligned only."""
        item = self.fmt.elem_bytes
        for width in (w // item for w in COPY_WIDTHS):
            if all(
                o.offset % width == 0
                and (o.rows is None or o.row_unit % width == 0)
                and all(
                    s % width == 0 for name, s in o.strides.items() if name != self.axis_name(o.contiguous)
                )
                for o in self.copied
            ):
                return width * item
        return None


def _gathered_load(e: Expr) -> Load | None:
    """The first load of an operand a stage may gather element by element, or None.  The
    operand must copy elements of one tensor: a load, zero, or ``select(cond, x, y)`` of
    such (a padded window: ``select(inside, load, 0)``; a rolled axis -- Swin's shifted
    windows, a Concat of two slices -- ``select(cond, load, load)``), with no index or
    condition that reads data.  A computed value is not gathered."""
    loads = _copied_loads(e)
    if not loads or len({ld.tensor for ld in loads}) != 1:
        return None
    return loads[0]


def _copied_loads(e: Expr) -> list[Load] | None:
    """The loads whose elements ``e`` copies (see :func:`_gathered_load`), or None."""
    if isinstance(e, Const):
        return [] if e.value == 0 else None
    if isinstance(e, Load):
        return None if any(isinstance(x, Load) for i in e.indices for x in walk(i)) else [e]
    if isinstance(e, Select) and not any(isinstance(x, Load) for x in walk(e.cond)):
        a, b = _copied_loads(e.a), _copied_loads(e.b)
        return None if a is None or b is None else a + b
    return None


def contraction(c: Compute, shape_of: ShapeOf, gather_32bit: bool = False) -> Contraction | None:
    """``c`` as a tensor-core contraction, or None (see the module docstring).  One operand
    may be gathered (:class:`Operand`): its load is not affine, but it varies along K and
    one of M or N only, and the other operand is affine.  The tensor-core stages gather
    16-bit elements only; ``gather_32bit`` admits fp32 ones too (the ``ffma`` kind's)."""
    body = c.body
    if (
        c.reduce_op != "sum"
        or c.dtype not in FORMATS
        or not isinstance(body, Binary)
        or body.op != "mul"
        or body.a.dtype != c.dtype
        or body.b.dtype != c.dtype
        or len(c.axes) < 2
        or 0 in c.shape
    ):
        return None
    ks = [a for a in c.reduce_axes if a.extent > 1]
    if len(ks) != 1:
        return None
    axes = (*c.axes, *c.reduce_axes)
    m_axis, n_axis, k = len(c.axes) - 2, len(c.axes) - 1, ks[0].name
    m_name, n_name = c.axes[m_axis].name, c.axes[n_axis].name
    exprs = (body.a, body.b)
    layouts = [affine_layout(e, shape_of(e.tensor), axes) if isinstance(e, Load) else None for e in exprs]
    if layouts[0] is None and layouts[1] is None:
        return None
    if layouts[0] is None or layouts[1] is None:
        return _gathered_contraction(c, exprs, layouts, m_axis, n_axis, k, shape_of, gather_32bit)
    ops = list(zip((body.a, body.b), layouts))
    # A does not move along N, B not along M; the product commutes, so either load may be A.
    if ops[0][1][1][n_name] != 0 or ops[1][1][1][m_name] != 0:
        ops.reverse()
    (la, (off_a, sa)), (lb, (off_b, sb)) = ops
    if sa[n_name] != 0 or sb[m_name] != 0 or sa[k] == 0 or sb[k] == 0:
        return None
    a_contig = "k" if sa[k] == 1 else "m" if sa[m_name] == 1 else None
    b_contig = "n" if sb[n_name] == 1 else "k" if sb[k] == 1 else None
    if a_contig is None or b_contig is None:
        return None
    found = Contraction(
        c,
        FORMATS[c.dtype],
        Operand(la, la.tensor, off_a, sa, a_contig),
        Operand(lb, lb.tensor, off_b, sb, b_contig),
        m_axis,
        n_axis,
        k,
        tuple(range(len(c.axes) - 2)),
    )
    if found.copy_bytes() is not None:
        return found
    # An affine operand whose rows cannot be copied in aligned 4-byte pieces (a 1x1
    # convolution over a 7x7 image: rows of 49 halves) is still a gathered one.
    for j in (1, 0):
        lays = [None if i == j else lay for i, lay in enumerate(layouts)]
        gathered = _gathered_contraction(c, exprs, lays, m_axis, n_axis, k, shape_of, gather_32bit)
        if gathered is not None:
            return gathered
    return None


def _gathered_contraction(
    c: Compute,
    exprs: tuple[Expr, Expr],
    layouts: list[tuple[int, dict[str, int]] | None],
    m_axis: int,
    n_axis: int,
    k: str,
    shape_of: ShapeOf,
    gather_32bit: bool = False,
) -> Contraction | None:
    """``contraction`` where one operand is not affine: that one is gathered if it is a
    (guarded) load free of the other output axis, and the affine one is A's or B's -- by
    rows where it gathers whole rows along K that copies can start on, else element by
    element (16-bit elements, or ``gather_32bit``)."""
    j = 0 if layouts[0] is None else 1
    gather, (affine, layout) = exprs[j], (exprs[1 - j], layouts[1 - j])
    assert layout is not None and isinstance(affine, Load)
    load = _gathered_load(gather)
    if load is None:
        return None
    m_name, n_name = c.axes[m_axis].name, c.axes[n_axis].name
    used = free_vars(gather)
    if k not in used or not used <= {a.name for a in c.axes} | {k}:
        return None
    if m_name not in used:
        role, other, other_role = "n", m_name, "m"  # the gather is B, the affine operand A
    elif n_name not in used:
        role, other, other_role = "m", n_name, "n"
    else:
        return None
    offset, strides = layout
    own = n_name if role == "n" else m_name  # the gathered operand's axis, along which A or B must not move
    if strides[own] != 0 or strides[k] == 0:
        return None
    contig = "k" if strides[k] == 1 else other_role if strides[other] == 1 else None
    if contig is None:
        return None
    fixed = Operand(affine, affine.tensor, offset, strides, contig)
    unit = _row_unit(gather, k, load, shape_of)
    ways = [Operand(load, load.tensor, 0, {k: 1}, "k", rows=gather, row_unit=unit)] if unit else []
    if FORMATS[c.dtype].elem_bytes == 2 or gather_32bit:
        ways.append(Operand(load, load.tensor, 0, {}, role, gather))
    for gathered in ways:
        a, b = (fixed, gathered) if role == "n" else (gathered, fixed)
        found = Contraction(c, FORMATS[c.dtype], a, b, m_axis, n_axis, k, tuple(range(len(c.axes) - 2)))
        if found.copy_bytes() is not None:
            return found
    return None


def _row_unit(gather: Expr, k: str, load: Load, shape_of: ShapeOf) -> int | None:
    """Where ``gather`` (an operand's expression, of ``load``'s tensor) gathers whole rows
    contiguous along ``k`` (:attr:`Operand.rows`): the extent of the tensor's last axis, a
    factor of every row's address; else None.  Every load indexes the last axis with ``k``
    alone and no other index, and no condition, uses ``k``."""
    found = _copied_loads(gather)
    assert found
    for ld in found:
        last = ld.indices[-1]
        if not (isinstance(last, Var) and last.name == k) or any(k in free_vars(i) for i in ld.indices[:-1]):
            return None
    if any(isinstance(e, Select) and k in free_vars(e.cond) for e in walk(gather)):
        return None
    return shape_of(load.tensor)[-1]


# -- the policy --------------------------------------------------------------------------------


def ring_elements(cfg: MmaConfig, con: Contraction) -> tuple[int, int]:
    """Elements of one pipeline stage of A and of B in shared memory, padded rows included."""
    bm, bn, bk, pad = cfg.block_m, cfg.block_n, cfg.block_k, con.fmt.row_pad
    a = bm * (bk + pad(False)) if con.a.contiguous == "k" else bk * (bm + pad(True))
    b = bk * (bn + pad(True)) if con.b.contiguous == "n" else bn * (bk + pad(False))
    return a, b


def ring_bytes(cfg: MmaConfig, con: Contraction) -> int:
    a, b = ring_elements(cfg, con)
    return cfg.pipeline * (a + b) * con.fmt.elem_bytes


def registers(cfg: MmaConfig) -> int:
    wm, wn = cfg.block_m // cfg.warps[0], cfg.block_n // cfg.warps[1]
    accumulators = (wm // MMA_M) * (wn // MMA_N) * 4
    fragments = (wm // MMA_M) * 4 + (wn // MMA_N) * 2
    return BASE_REGISTERS + accumulators + fragments


def gather_pairs(cfg: MmaConfig, con: Contraction) -> int:
    """Element pairs of a gathered operand's slice each thread loads (0 without one): the
    slice is ``block_k`` rows of the block's M or N, dealt out two adjacent elements of a
    row at a time, thread-major (pair ``tid + j * threads``)."""
    op = con.gathered
    if op is None:
        return 0
    block = cfg.block_m if op.contiguous == "m" else cfg.block_n
    return cfg.block_k * block // 2 // cfg.threads


def gather_fits(cfg: MmaConfig, con: Contraction) -> str | None:
    """Why the block's threads cannot deal out a gathered slice evenly, or None."""
    op = con.gathered
    if op is None:
        return None
    block = cfg.block_m if op.contiguous == "m" else cfg.block_n
    if (cfg.block_k * block // 2) % cfg.threads:
        return f"gather: {cfg.block_k} x {block} elements are not whole pairs per thread of {cfg.threads}"
    return None


class MmaKind:
    """Tensor-core contractions of some operand formats (see the module docstring).  One
    rule, one instance per kind: ``mma`` (fp16 and bf16, on by default) and ``mma_tf32``
    (fp32 as TF32, listed in the kinds only on request), whose stages one emitter and one
    template render; a stage's format follows from its contraction's dtype.

    The search (block tiles, slice and ring depths, split-K, the root tile, later stages,
    the estimate) is the same for every tensor-core kind; what differs is data and a few
    methods here, which a kind for another instruction family overrides
    (:class:`~.wgmma.WgmmaKind`)."""

    block_tiles: tuple[tuple[int, int, int, int], ...] = BLOCK_TILES
    pipelines: tuple[int, ...] = PIPELINES
    efficiency: float = TC_EFFICIENCY
    slice_latency_us: float = SLICE_LATENCY_US
    streaming_blocks_per_sm: int = STREAMING_BLOCKS_PER_SM
    #: Split-K's reduction: a fixed cost (the arrival round trip) and one per further split.
    split_fixed_us: float = SLICE_LATENCY_US
    split_step_us: float = 0.0
    #: The rows of a block tile one warp's products start on (the instruction's M).
    m_granule: int = MMA_M
    #: Whether a gathered operand may have 32-bit elements, copied by threads in pairs (the
    #: exact fp32 kinds'; ``ldmatrix``-fed TF32 leaves them to 16-bit types).
    gather_32bit: bool = False
    #: Whether a gathered operand's element copies run beside the tensor cores (an
    #: asynchronous instruction) rather than in the issue slots of the warps' own
    #: ``mma.sync`` and ``ldmatrix`` (the ``mma`` kind: they add up).
    gather_overlaps: bool = False

    def __init__(self, formats: tuple[MmaFormat, ...], config_type: type[MmaConfig] | None = None) -> None:
        self.formats = formats
        self.config_type = config_type or CONFIG_TYPES[formats[0].kind]
        self.name = self.config_type.kind

    def propose(self, group: Group, ctx: ScheduleContext) -> list[GroupConfig] | None:
        con = self._contraction(group, ctx)
        if con is None:
            return None
        found = [cfg for v in _search(self, group, con, ctx) for cfg in v.configs]
        found.sort(key=lambda c: c.estimate.latency_us)
        return top_by_family(found, ctx.options.topk)

    def explain(self, group: Group, ctx: ScheduleContext) -> list[Verdict] | None:
        """What :meth:`propose` made of every candidate shape: the configs of each, or the
        check that rejected it; None where the group is not this kind's contraction.  For
        diagnostics (``scripts/mma_why.py``): it walks the very checks the rule applies."""
        con = self._contraction(group, ctx)
        return None if con is None else list(_search(self, group, con, ctx))

    def _contraction(self, group: Group, ctx: ScheduleContext) -> Contraction | None:
        if not self.runs_on(ctx.arch.compute_capability):
            return None
        return self.contraction_of(group.computes[group.stages[0]], ctx.shape_of)

    def contraction_of(self, c: Compute, shape_of: ShapeOf) -> Contraction | None:
        """``c`` as this kind computes it: its contraction (with 32-bit gathered operands
        where :attr:`gather_32bit`) in the kind's format for its dtype, or None.  The policy
        and the codegen both ask here, so that they see one contraction."""
        con = contraction(c, shape_of, self.gather_32bit)
        fmt = next((f for f in self.formats if con is not None and f.dtype == con.fmt.dtype), None)
        return None if con is None or fmt is None else replace(con, fmt=fmt)

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether the GPU of ``capability`` has this kind's instructions."""
        return capability >= MIN_COMPUTE_CAPABILITY

    def block_ks(self, con: Contraction) -> tuple[int, ...]:
        """Slice depths to try for ``con``."""
        return con.fmt.block_ks

    def copy_widths(self, con: Contraction) -> tuple[int, ...]:
        """cp.async widths in bytes the operands may be copied at, widest first."""
        return tuple(w for w in COPY_WIDTHS if w <= con.copy_bytes())

    def ring_bytes(self, cfg: MmaConfig, con: Contraction) -> int:
        return ring_bytes(cfg, con)

    def ring_fits(self, offset: int) -> str | None:
        """Why the operand ring cannot start at byte ``offset`` of the pool, or None."""
        return None

    def registers(self, cfg: MmaConfig) -> int:
        return registers(cfg)

    def in_flight(self, cfg: MmaConfig) -> int:
        """Slices being copied while one is multiplied."""
        return cfg.pipeline - 1

    def variants(self, stage: MmaConfig, con: Contraction) -> list[MmaConfig]:
        """The stage configs one block tile, slice depth and ring depth give: ways of
        feeding the same tile that the kind tells apart (one here)."""
        return [stage]

    def splittable(self, cfg: MmaConfig) -> bool:
        """Whether split-K variants of ``cfg`` are tried."""
        return True

    def persistable(self, cfg: MmaConfig) -> bool:
        """Whether a persistent variant of ``cfg`` (:attr:`MmaConfig.persistent`) is tried
        where its tiles take more than one wave and nothing follows the contraction."""
        return False

    def cluster_variants(
        self, cfg: MmaConfig, con: Contraction, region: Region, grid: tuple[int, ...]
    ) -> list[tuple[MmaConfig, int]]:
        """Variants of ``cfg`` whose blocks pair up in clusters, each with the root axis along
        which the two blocks of a pair are neighbours (it then varies fastest in
        ``blockIdx.x``); tried, like persistent blocks, where nothing follows the
        contraction."""
        return []

    def output_variants(self, cfg: MmaConfig, group: Group, con: Contraction) -> list[MmaConfig]:
        """Variants of ``cfg`` that write the group's output another way (each is placed and
        estimated like ``cfg``)."""
        return []

    def l2_operand_rows(self, cfg: MmaConfig) -> int:
        """Rows of operand slices (of ``block_k`` elements) a block draws from L2 per slice."""
        return cfg.block_m + cfg.block_n

    def cost_constants(self, cfg: MmaConfig) -> tuple[float, float]:
        """The share of the tensor cores' peak ``cfg`` reaches, and its slice latency (us)."""
        return self.efficiency, self.slice_latency_us


@dataclass
class Verdict:
    """One candidate shape of the search: its configs, or why there are none."""

    block: tuple[int, int, int, int]  # block_m, block_n, warps along m, warps along n
    block_k: int
    pipeline: int
    configs: list[GroupConfig]
    reason: str | None = None  # the check that rejected the shape, where configs is empty


def _search(rule: MmaKind, group: Group, con: Contraction, ctx: ScheduleContext) -> Iterator[Verdict]:
    """Every block tile, slice depth and ring depth ``rule`` considers, with its verdict."""
    for bm, bn, wm, wn in rule.block_tiles:
        padding = _padding(con, bm, bn, rule.m_granule)
        block_ks = rule.block_ks(con)
        for bk in block_ks:
            if bk > block_ks[0] and con.k_extent < 2 * bk:
                continue  # a deeper slice than K needs: the shallowest one is tried
            for depth in rule.pipelines:
                if padding:
                    yield Verdict((bm, bn, wm, wn), bk, depth, [], padding)
                    continue
                found = _configs(rule, group, con, (bm, bn, wm, wn, bk), depth, ctx)
                if isinstance(found, str):
                    yield Verdict((bm, bn, wm, wn), bk, depth, [], found)
                else:
                    yield Verdict((bm, bn, wm, wn), bk, depth, found, None if found else "no estimate")


def _padding(con: Contraction, bm: int, bn: int, m_granule: int) -> str | None:
    """Why a block tile is mostly padding for this contraction, or None."""
    if bm // 2 >= _round_up(con.m, m_granule):
        return f"padding: half of block_m {bm} covers M = {con.m}"
    if bn // 2 >= _round_up(con.n, 16):
        return f"padding: half of block_n {bn} covers N = {con.n}"
    return None


KIND = MmaKind((FP16, BF16))
TF32_KIND = MmaKind((TF32,))


def config_precision(cfg: GroupConfig) -> str:
    """The arithmetic of ``cfg``'s fp32 results (a name in ``welder.check.THRESHOLDS``):
    ``"tf32"`` when a stage computes fp32 on TF32 tensor cores, else ``"fp32"``."""
    return TF32.precision if any(st.kind == TF32.kind for st in cfg.stages) else "fp32"


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _root_tile(
    group: Group, con: Contraction, bm: int, bn: int, ctx: ScheduleContext
) -> tuple[tuple[int, ...], GroupRegions] | str:
    """The root tile whose block computes one ``bm x bn`` tile of one matrix of the
    contraction, with the regions of every stage; where there is none, why not.

    The root need not be the contraction's shape: later stages may reshape and transpose
    the product (``[tokens, channels]`` written out as ``[B, C, H, W]``, or split into
    heads).  Propagating a one-element root tile says how each root axis moves the
    contraction's region: ``coef`` elements along one of its axes per step (an axis that
    moves none, as after a row-wise stage that reads a whole row, is tiled whole).  Along M
    and along N the root axes are then grown as mixed-radix digits, innermost (coefficient
    1) first, while the region stays within ``bm`` or ``bn``: an axis is tiled whole before
    the next one grows, and only the outermost digit of M or N may be tiled raggedly (its
    last block's overhang falls outside the contraction, not into the next digit's range).
    Batch axes of the contraction get one index per block.  Propagating the resulting tile
    must give the contraction a region of one matrix within ``bm x bn`` (a row softmax after
    QK^T makes it a whole row: it fits when ``bn`` covers N)."""
    first = group.stages[0]
    members = [group.computes[s] for s in group.stages]
    root_shape = ctx.shape_of(group.root)
    unit = propagate_group(members, group.root, (1,) * len(root_shape), ctx.shape_of).members[first]
    digits: dict[int, list[tuple[int, int]]] = {}  # contraction axis: (coefficient, root axis)
    moves: dict[int, int] = {}  # root axis: the contraction axis it moves
    radix = _radix_axes(unit.dims, con)
    if isinstance(radix, str):
        return radix
    for j, d in enumerate(unit.dims):
        if d.affine is None:
            continue  # a digit of a radix root axis (checked by _radix_axes)
        for var, coef in d.affine.terms:
            k = int(var[1:])
            if moves.setdefault(k, j) != j:
                return f"root tile: root axis {k} moves the contraction along two axes"
            digits.setdefault(j, []).append((coef, k))
    tile = list(root_shape)  # a root axis that does not move the contraction is tiled whole
    for axis, found in digits.items():
        found.sort()
        for _, k in found:
            tile[k] = 1
        if axis not in (con.m_axis, con.n_axis):
            continue
        limit = bm if axis == con.m_axis else bn
        span = unit.dims[axis].extent
        for pos, (coef, k) in enumerate(found):
            if coef != span or limit // span < 2:
                break
            fits = limit // span
            size = root_shape[k]
            if pos == len(found) - 1:
                tile[k] = min(size, fits)
            else:
                tile[k] = max(t for t in range(1, min(size, fits) + 1) if size % t == 0)
            if tile[k] < size:
                break
            span *= size
    for k, (size, axis) in radix.items():
        limit = bm if axis == con.m_axis else bn if axis == con.n_axis else 1
        tile[k] = max(t for t in range(1, min(size, limit) + 1) if size % t == 0)
    regions = propagate_group(members, group.root, tile, ctx.shape_of)
    region = regions.members[first].extents
    if any(region[d] != 1 for d in con.batch_axes):
        return f"root tile: the contraction's region {region} spans several matrices"
    if region[con.m_axis] > bm or region[con.n_axis] > bn:
        return f"root tile: the contraction's region {region} exceeds one {bm} x {bn} tile"
    return tuple(tile), regions


def _radix_axes(dims: Sequence[Interval], con: Contraction) -> dict[int, tuple[int, int]] | str:
    """Root axes that move the contraction along two of its axes as mixed-radix digits, the
    inner one along M, N or a batch axis and the outer one along a batch axis: a grouped
    convolution's channels, ``c = g * Mg + c'``, whose one-element root tile has origins
    ``b // Mg`` (the group, a batch axis) and ``b % Mg`` (M).  By root axis: (the inner
    digit's size, the contraction axis it moves).  Any other origin that is not affine in
    the block: why the root tile cannot be placed."""
    found: dict[int, tuple[int, int]] = {}
    for j, d in enumerate(dims):
        if d.affine is not None:
            continue
        lo = d.lo
        if not (
            isinstance(lo, Binary)
            and lo.op in ("floordiv", "mod")
            and isinstance(lo.a, Var)
            and lo.a.name.startswith("b")
            and isinstance(lo.b, Const)
        ):
            return f"root tile: the contraction's origin along axis {j} is not affine in the block ({d})"
        k, size = int(lo.a.name[1:]), int(lo.b.value)
        if lo.op == "floordiv" and j not in con.batch_axes:
            return (
                f"root tile: the contraction's origin along axis {j} is not affine in the block ({d}),"
                f" and it is not a batch axis that root axis {k} steps every {size} elements"
            )
        if lo.op == "mod":
            found[k] = (size, j)
    return found


def _configs(
    rule: MmaKind,
    group: Group,
    con: Contraction,
    shape: tuple[int, int, int, int, int],
    depth: int,
    ctx: ScheduleContext,
) -> list[GroupConfig] | str:
    """The config of one block tile, slice depth and ring depth, unsplit and with each
    useful split-K factor; where the tile does not fit the group or the arch, the check
    that says so."""
    bm, bn, wm, wn, bk = shape
    placed = _root_tile(group, con, bm, bn, ctx)
    if isinstance(placed, str):
        return placed
    tile, regions = placed
    root_shape = ctx.shape_of(group.root)
    grid = tuple(-(-s // t) for s, t in zip(root_shape, tile))
    copy_bytes = _copy_bytes(con, regions.members[group.stages[0]], grid, rule.copy_widths(con))
    if copy_bytes is None:
        return "aligned origin: a block's matrix tile starts off every copy width"
    for out in group.outputs:
        if out != group.root and not partitions_output(regions.members[out], ctx.shape_of(out), tile, grid):
            return f"partitions_output: blocks do not tile output {out}"
    first = group.stages[0]
    base = rule.config_type(
        first,
        tile=regions.members[first].extents,
        block=(bm, bn),
        block_k=bk,
        warps=(wm, wn),
        pipeline=depth,
        copy_bytes=copy_bytes,
        pipeline_offset=0,
    )
    variants = rule.variants(base, con)
    if not variants:
        return f"ring depth {depth}: no way of feeding the {rule.name} kind takes it here"
    found: list[GroupConfig] = []
    reasons = []
    # Each way of feeding the ring, with each way of writing the output (those first: a tie
    # goes to them).
    shaped = [v for fed in variants for v in (*rule.output_variants(fed, group, con), fed)]
    for stage in shaped:
        placed_configs = _placed(rule, group, con, stage, tile, regions, grid, ctx)
        if isinstance(placed_configs, str):
            reasons.append(placed_configs)
        else:
            found += placed_configs
    return found or reasons[0]


def _placed(
    rule: MmaKind,
    group: Group,
    con: Contraction,
    stage: MmaConfig,
    tile: tuple[int, ...],
    regions: GroupRegions,
    grid: tuple[int, ...],
    ctx: ScheduleContext,
) -> list[GroupConfig] | str:
    """The configs of one stage variant: its later stages, shared memory and registers
    placed, unsplit and with each useful split-K factor; or the check that failed."""
    arch = ctx.arch
    threads = stage.threads
    first = group.stages[0]
    epilogue = on_accumulators(group)
    later = [] if epilogue is not None else _later_stages(group, regions, threads)
    if isinstance(later, str):
        return later
    if epilogue:
        stage = replace(stage, epilogue=epilogue)
    info = simt.group_info(group, ctx.shape_of, ctx.dtype_of, arch)
    placeholder = simt.SimtConfig(first, stage.tile, (1,) * len(tile), (1,) * len(tile))
    # The operand ring is live during the contraction only: later stages' buffers (written
    # after the barrier that ends it) may take its place; its own tile may not.
    ring = Buffer(RING, rule.ring_bytes(stage, con), 0, 0)
    # On the accumulators, the product needs no tile: nothing reads it from shared memory.
    offsets, smem = simt.place_smem(info, [] if epilogue else [placeholder, *later], [ring])
    stage.smem_offset = placeholder.smem_offset
    stage.pipeline_offset = offsets[RING]
    misplaced = rule.ring_fits(stage.pipeline_offset)
    if misplaced:
        return misplaced
    if smem > arch.smem_per_block:
        return f"smem: {smem} bytes > {arch.smem_per_block}"
    misfit = gather_fits(stage, con)
    if misfit:
        return misfit
    own = rule.registers(stage) + gather_pairs(stage, con) * GATHER_PAIR_REGISTERS
    regs = max([own, *(simt.registers(st) for st in later)])
    if regs > arch.max_regs_per_thread:
        return f"registers: {regs} > {arch.max_regs_per_thread}"
    order = tuple(range(len(tile)))
    found = []
    splits_tried = split_choices(con, stage, math.prod(grid), ctx) if rule.splittable(stage) else []
    for splits in (1, *splits_tried):
        split = replace(stage, splits=splits)
        lone = splits == 1 and not later
        shapes = [(split, order)]
        if lone and ctx.options.clusters:  # clustered variants: the pairing axis varies fastest
            shapes += [
                (paired, (*(a for a in order if a != axis), axis))
                for paired, axis in rule.cluster_variants(split, con, regions.members[first], grid)
            ]
        for shaped, shaped_order in shapes:
            estimate = _estimate(rule, group, con, shaped, later, regions, grid, threads, smem, regs, ctx)
            if estimate is None:
                continue
            # More than a wave of tiles and a lone stage: a persistent variant too, placed first
            # so that it wins a tie with the launch-per-tile kernel.
            if lone and estimate.waves > 1 and rule.persistable(shaped):
                wave = estimate.blocks_per_sm * arch.sm_count // shaped.cluster * shaped.cluster
                resident = replace(shaped, persistent=wave)
                again = _estimate(rule, group, con, resident, later, regions, grid, threads, smem, regs, ctx)
                assert again is not None
                found.append(
                    GroupConfig(group.root, tile, grid, shaped_order, threads, [resident], smem, again)
                )
            plain = GroupConfig(
                group.root, tile, grid, shaped_order, threads, [shaped, *later], smem, estimate
            )
            found.append(plain)
            # The later stage writing the root in 16-byte vectors (heads split from a
            # projection's tile): the estimate cannot tell the two apart; the tuner can.
            twin = simt.vector_twin(group, plain, ctx.shape_of, ctx.dtype_of) if later else None
            if twin is not None:
                found.append(twin)
    return found if found else "estimate: no block fits an SM"


def split_choices(con: Contraction, cfg: MmaConfig, tiles: int, ctx: ScheduleContext) -> list[int]:
    """Split-K factors worth trying for ``tiles`` output tiles of ``cfg``: only where the
    tiles leave SMs idle, every split gets at least one K slice, and the workspace fits."""
    if tiles >= ctx.arch.sm_count:
        return []
    k_tiles = -(-con.k_extent // cfg.block_k)
    found = []
    for splits in SPLITS:
        per = -(-k_tiles // splits)
        if (splits - 1) * per >= k_tiles or tiles * splits > 4 * ctx.arch.sm_count:
            continue
        if workspace_bytes(replace(cfg, splits=splits), tiles) > WORKSPACE_LIMIT:
            continue
        found.append(splits)
    return found


def workspace_bytes(cfg: MmaConfig, tiles: int) -> int:
    """The split-K workspace of ``tiles`` output tiles: one fp32 partial tile per block."""
    return 0 if cfg.splits == 1 else cfg.splits * tiles * cfg.block_m * cfg.block_n * 4


def _copy_bytes(con: Contraction, region: Region, grid: Sequence[int], widths: Sequence[int]) -> int | None:
    """The widest copy of ``widths`` (those the kind may use) at which every block's matrix
    tile starts aligned, or None.  Copies run along each operand's contiguous axis, so only
    an origin along M (A M-contiguous) or N (B N-contiguous) must be a multiple of the
    copy's elements; the origin along N must be even besides (the epilogue stores pairs).
    A block coordinate whose grid extent is 1 is always 0 and constrains nothing (an M of
    1, whose one-row tile steps by 1)."""
    fixed = {f"b{k}" for k, g in enumerate(grid) if g == 1}
    for width in widths:
        elements = width // con.fmt.elem_bytes
        need = {con.n_axis: 2}
        for op, role, axis in ((con.a, "m", con.m_axis), (con.b, "n", con.n_axis)):
            if op.contiguous == role and not op.gathered:
                need[axis] = math.lcm(need.get(axis, 1), elements)
        if all(_aligned_origin(region.dims[axis].lo, step, fixed) for axis, step in need.items()):
            return width
    return None


def _aligned_origin(lo: object, elements: int, fixed: set[str]) -> bool:
    """Whether an origin is a multiple of ``elements`` for every block (the block
    coordinates in ``fixed`` are 0)."""
    if not isinstance(lo, Affine):
        return False
    return lo.const % elements == 0 and all(c % elements == 0 for v, c in lo.terms if v not in fixed)


def on_accumulators(group: Group) -> tuple[str, ...] | None:
    """The stages after the contraction where every one of them is an elementwise function of
    the product, and of the stages before it, at the same point (bias, activation, residual
    add, cast to a float type): the epilogue computes them on the accumulators, with no tile
    in shared memory and no pass over it.  A stage may have the product's shape with axes
    split (a convolution's ``[N, C, H * W]`` product read as ``[N, C, H, W]``): the same
    point is then the same flat position, and each output is stored where the product's
    element would be.  None where any stage is not such a function (a reduction, a shape
    that merges or reorders axes, a read of the product at another point: those run as
    SIMT stages)."""
    first = group.stages[0]
    shape = group.computes[first].shape
    done = {first}
    for s in group.stages[1:]:
        c = group.computes[s]
        if c.reduce_op is not None or c.dtype not in FLOAT_OUTPUTS or split_axes(shape, c.shape) is None:
            return None
        for ld in c.loads():
            if ld.tensor in done and not reads_own_flat_point(ld, group.computes[ld.tensor].shape, c.axes):
                return None
        done.add(s)
    return tuple(group.stages[1:])


#: Output types an epilogue stores (its values are computed in float).
FLOAT_OUTPUTS = ("float16", "bfloat16", "float32")


def _later_stages(group: Group, regions: GroupRegions, threads: int) -> list[simt.SimtConfig] | str:
    """SIMT configs of the stages after the contraction: each reads global inputs directly
    and earlier tiles from shared memory (no staging: their reductions, if any, run over a
    tile already on chip); the stage none fits, where one does not."""
    later = []
    for s in group.stages[1:]:
        st = simt.plan_stage(group, s, regions, threads)
        if st is None:
            return f"later stages: {s} {regions.members[s].extents} does not fit {threads} threads"
        later.append(st)
    return later


def _estimate(
    rule: MmaKind,
    group: Group,
    con: Contraction,
    stage: MmaConfig,
    later: Sequence[simt.SimtConfig],
    regions: GroupRegions,
    grid: tuple[int, ...],
    threads: int,
    smem: int,
    regs: int,
    ctx: ScheduleContext,
) -> Estimate | None:
    """Tensor-core time of the padded tiles over the SMs' share of the peak, against DRAM
    (each tensor once) and L2 (operand slices every block re-reads); later stages add
    their arithmetic at the SIMT rate."""
    arch = ctx.arch
    splits = stage.splits
    tiles = math.prod(grid)
    blocks = tiles * splits
    blocks_per_sm = simt.blocks_per_sm(threads, regs, smem, arch)
    if blocks_per_sm < 1:
        return None
    waves = -(-blocks // (blocks_per_sm * arch.sm_count))
    k_tiles = -(-con.k_extent // stage.block_k)
    split_tiles = stage.split_tiles(k_tiles)
    item = con.fmt.elem_bytes
    flops_block = 2 * stage.block_m * stage.block_n * split_tiles * stage.block_k
    efficiency, slice_latency_us = rule.cost_constants(stage)
    sm_rate = getattr(arch, con.fmt.peak) * 1e12 * efficiency / arch.sm_count / con.fmt.products
    tc_us = -(-blocks // arch.sm_count) * flops_block / sm_rate * 1e6
    # A gathered operand: every element of its slices is addressed and copied by a thread.
    gather_us = 0.0
    if con.gathered is not None:
        elements = 2 * gather_pairs(stage, con) * threads * split_tiles
        issue = 4 * 32 * arch.clock_ghz * 1e9  # lanes an SM issues per second
        gather_us = -(-blocks // arch.sm_count) * elements * GATHER_ISSUE / issue * 1e6
    core_us = max(tc_us, gather_us) if rule.gather_overlaps else tc_us + gather_us
    # The ring fills once per block; a persistent block carries it on across its tiles.
    fills = 1 if stage.persistent else waves
    # A gathered operand is loaded into registers one slice ahead: one slice in flight.
    in_flight = 1 if con.gathered is not None else rule.in_flight(stage)
    chain_us = (waves * split_tiles / in_flight + fills) * slice_latency_us
    simt_flops = sum(
        math.prod(regions.members[st.node].extents) * group.computes[st.node].point_flops for st in later
    )
    simt_us = -(-tiles // arch.sm_count) * simt_flops / (arch.fp32_tflops * 1e12 / arch.sm_count) * 1e6
    operand_block = rule.l2_operand_rows(stage) * split_tiles * stage.block_k * item
    # Split-K: every block writes its fp32 partial tile; the last of each tile reads the
    # others back, after one more round trip (the counter), at one SM's share of L2.
    partial = stage.block_m * stage.block_n * 4
    reduce_us = 0.0
    if splits > 1:
        read_us = partial / (arch.l2_bw_gbs * 1e9 / arch.sm_count) * 1e6
        reduce_us = rule.split_fixed_us + (splits - 1) * (read_us + rule.split_step_us)
    other_inputs = [t for t in regions.inputs if t not in (con.a.tensor, con.b.tensor)]
    # Per tile (the last block of a split tile does the later stages and the writes).
    shape_of, dtype_of = ctx.shape_of, ctx.dtype_of
    tile_reads = simt.block_bytes(regions.inputs, other_inputs, shape_of, dtype_of, arch.read_transaction)
    tile_writes = simt.block_bytes(regions.members, group.outputs, shape_of, dtype_of, arch.write_transaction)
    workspace = 2 * partial * blocks if splits > 1 else 0
    read_bytes = operand_block * blocks + tile_reads * tiles + workspace // 2
    write_bytes = tile_writes * tiles + workspace // 2
    compulsory = simt.io_bytes(group, ctx.shape_of, ctx.dtype_of)
    # A block keeps only its next operand slices in flight, so DRAM and L2 reach their
    # bandwidth only with ``streaming_blocks_per_sm`` resident blocks per SM; fewer blocks (128
    # rows of a weight-streaming product in 36 blocks) get their share of it.
    resident = min(blocks, blocks_per_sm * arch.sm_count)
    share = min(1.0, resident / (rule.streaming_blocks_per_sm * arch.sm_count))
    dram_us = compulsory / (arch.global_bw_gbs * 1e9 * simt.DRAM_EFFICIENCY * share) * 1e6
    l2_us = (read_bytes + write_bytes) / (arch.l2_bw_gbs * 1e9 * share) * 1e6
    latency = max(core_us + simt_us, dram_us, l2_us, chain_us) + reduce_us + LAUNCH_OVERHEAD_US
    return Estimate(
        blocks=blocks,
        blocks_per_sm=blocks_per_sm,
        waves=waves,
        read_bytes=read_bytes,
        write_bytes=write_bytes,
        compulsory_bytes=compulsory,
        flops=flops_block * blocks + simt_flops * tiles,
        smem_bytes=smem,
        regs_per_thread=regs,
        latency_us=round(latency, 4),
    )
