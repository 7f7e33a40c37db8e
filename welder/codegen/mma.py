"""Code generation for tensor-core stages (``codegen_templates/stages/mma.cu.j2``).

An ``mma`` stage (``welder.schedule.kinds.mma.MmaConfig``) is the group's first stage: a
contraction whose operands are read from global memory with the strides that
:func:`~welder.schedule.kinds.mma.contraction` proves.  :func:`emit_stage` turns those
strides and the config into the values the template prints: where each operand's slice
starts, which axis its shared-memory rows run along, and the per-lane ``ldmatrix`` (or
32-bit load) addresses that give the fragment layouts of ``m16n8k16`` (fp16) and
``m16n8k8`` (TF32).  What differs between the two is the contraction's
:class:`~welder.schedule.kinds.mma.MmaFormat`, read here as data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from welder.ir.compute import Compute
from welder.ir.expr import Const, Expr, Load, Select
from welder.ir.layout import row_major_strides, split_axes
from welder.schedule.config import StageConfig
from welder.schedule.kinds import kind
from welder.schedule.kinds.mma import (
    Contraction,
    MmaConfig,
    MmaKind,
    Operand,
    ring_elements,
    workspace_bytes,
)

from .common import STORAGE_TYPES, StageCtx, flat_index, sanitize_comment
from .cprint import HALF_FORMATS, CPrinter

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/mma.cu.j2"
HEADERS = ("welder_mma.cuh",)


def gather_types(dtype: str) -> dict[str, str]:
    """The MmaStageCtx fields of a gathered operand of ``dtype``: the pair type its registers
    hold, how two elements make one, and its zero."""
    half = HALF_FORMATS.get(dtype)
    if half is None:
        return {"gather_pair_t": "float2", "gather_pack": "make_float2", "gather_zero": "0.0f"}
    return {"gather_pair_t": half.pair, "gather_pack": half.join2, "gather_zero": f"{half.from_float}(0.0f)"}


@dataclass
class _Operand:
    """One operand's slice as the template copies and reads it."""

    name: str  # "a" or "b": the template's local names start with it
    param: str
    view: str
    offset: str  # C: element offset of this block's matrix in the tensor
    rows: int  # shared-memory rows per slice, and elements per row before padding
    cols: int
    ld: int  # padded row length
    stage_elems: int
    row_origin: str
    col_origin: str
    row_limit: int
    col_limit: int
    row_stride: int  # global stride of the row axis (the column axis has stride 1)
    loader: str  # "ldmatrix", "ldmatrix_trans" or "lds" (MmaFormat.loader)
    fragment: str  # C: this lane's ldmatrix row address, or its first element's, within a slot
    # lds: the four registers' element offsets from ``fragment``, in ldmatrix.x4's order
    offsets: tuple[int, int, int, int] | None
    # The copy loop.  A row of a slice is ``chunks`` copies; where the block's threads are a
    # whole number of rows' worth that tiles the slice (``hoisted``), each thread copies one
    # chunk column of rows row0, row0 + row_step, ... (``copies`` of them), so its addresses
    # are set up once and each slice adds only k0 x ``k_step``; otherwise the copies are
    # dealt out one by one.
    k_rows: bool  # rows run along K (the fixed-origin axis runs along the columns)
    chunks: int
    hoisted: bool
    row_step: int
    copies: int
    k_step: int  # elements the source advances per unit of k0
    fixed_origin: str  # m0 or n0: the origin along the axis that is not K
    fixed_limit: int  # M or N
    # A gathered operand (rows along K): how to read its element at K index ``gk`` and M or
    # N index ``gf`` (in range: the template guards the edges), and the element pairs each
    # thread copies per slice.  None / 0 for an affine operand.
    gather: GatherAccess | None = None
    # Gathered rows: where row gf starts (the element at K = 0) and whether it is read.
    row_gather: GatherAccess | None = None
    pairs: int = 0
    # Rows of a slice between a thread's pairs where the threads are a whole number of a
    # row's pairs (each thread then keeps one column); 0 where they are not.
    pair_rows: int = 0
    gather_dst: str = ""  # C: a pair's element offset within a slot, in ``row`` and ``col``


@dataclass(kw_only=True)
class ContractionStageCtx(StageCtx):
    """What every tensor-core template reads besides its operands: the block's place in the
    product, split-K's globals, and where the epilogue writes (the ``split_k``,
    ``store_pair`` and ``declarations`` macros of ``stages/mma.cu.j2``)."""

    storage_t: str
    elem_bytes: int
    pack2: str  # C: two fp32 accumulators as the output's pair type
    pack1: str  # C: one fp32 accumulator as the output's type
    block_k: int
    tile_m: int  # the region's rows and columns: the part of the block's products a later stage reads
    tile_n: int
    pipeline: int
    k_tiles: int
    splits: int  # blocks per tile (split-K); each sums split_tiles slices from split * split_tiles
    split_tiles: int
    threads: int
    workspace: str  # split-K: the kernel's fp32 partial tiles, and its per-tile arrival counters
    counters: str
    workspace_elems: int
    m_origin: str
    n_origin: str
    m_extent: int
    n_extent: int
    # Whether a block's block_m x block_n piece may reach outside the product (ragged tiles):
    # only then does the epilogue check each element's row and column.  The checks put every
    # element's loads and arithmetic under a branch of its own, which keeps the compiler from
    # hoisting loads or interleaving elements (a bias + GELU epilogue ran 3x slower).
    guard: bool = True
    # A gathered operand's element pair: its C type, how two elements make one, and the
    # element zero, of the operands' type (gather_types).
    gather_pair_t: str
    gather_pack: str
    gather_zero: str
    tile_view: str | None
    out_param: str | None
    out_offset: str
    # Stages computed on the accumulators (MmaConfig.epilogue), and every tensor the epilogue
    # stores then: the product where it is a group output, then each such stage that is one.
    epilogue: list[EpilogueValue] = field(default_factory=list)
    outputs: list[EpilogueOutput] = field(default_factory=list)


@dataclass
class EpilogueValue:
    """A stage the epilogue computes on the accumulators: ``const float var = value;`` with
    the element's row ``em``, column ``en`` and its accumulator ``pv`` in scope."""

    var: str
    value: str


@dataclass
class EpilogueOutput:
    """One tensor the epilogue stores, element pairs at the product's positions."""

    param: str
    storage_t: str
    pack2: str
    pack1: str
    value: str  # C: its float value in the epilogue's element loop (``res`` of it is stored)


@dataclass(kw_only=True)
class MmaStageCtx(ContractionStageCtx):
    mma_k: int
    mma: str  # the welder_mma.cuh function of one product
    convert: str | None  # the welder_mma.cuh function rounding each loaded element, if any
    products: int  # per piece and K step: 3 where each operand is split into two TF32 values
    warps_n: int
    warp_m: int
    warp_n: int
    mi: int
    ni: int
    copy_bytes: int
    copy_elems: int
    a: _Operand
    b: _Operand
    # The warp-tile column of lane t's accumulator pair in the ni-th 8-column piece: where
    # mma.sync leaves it; the ffma kind may give each lane four adjacent columns (and rows)
    # instead.
    lane_col: str = "ni * 8 + 2 * t"
    # The warp-tile row of lane g's accumulators 2h, 2h + 1 in the mi-th 16-row piece.
    lane_row: str = "mi * 16 + g + 8 * h"


def contraction_fields(kb: KernelBuilder, k: int, st: MmaConfig, con: Contraction, kind: str) -> dict:
    """The :class:`ContractionStageCtx` fields of tensor-core stage ``k`` (config ``st``)."""
    c = con.compute
    region = kb.regions.members[st.node]
    o = [kb.origin_name(k, d) for d in range(len(c.axes))]
    k_tiles = -(-con.k_extent // st.block_k)
    out_strides = row_major_strides(stored_shape(kb, st, con))
    dtype = c.dtype
    pack2, pack1 = pair_packers(dtype)
    return dict(
        comment=sanitize_comment(f"{st.node} ({kind}, {st.block_m}x{st.block_n}x{st.block_k})"),
        origins=[{"name": o[d], "expr": kb.index_c(iv.lo_expr())} for d, iv in enumerate(region.dims)],
        storage_t=STORAGE_TYPES[dtype],
        elem_bytes=con.fmt.elem_bytes,
        pack2=pack2,
        pack1=pack1,
        block_k=st.block_k,
        tile_m=st.tile[-2],
        tile_n=st.tile[-1],
        pipeline=st.pipeline,
        k_tiles=k_tiles,
        splits=st.splits,
        split_tiles=st.split_tiles(k_tiles),
        threads=kb.cfg.threads,
        workspace=f"{kb.name}_partials",
        counters=f"{kb.name}_arrivals",
        workspace_elems=workspace_bytes(st, kb.cfg.num_blocks) // 4,
        declares=st.splits > 1,
        m_origin=o[con.m_axis],
        n_origin=o[con.n_axis],
        m_extent=con.m,
        n_extent=con.n,
        guard=not _pieces_inside(kb, st, con),
        **gather_types(con.compute.dtype),
        tile_view=kb.tile_views.get(st.node),
        out_param=kb.params[st.node].name if st.node in kb.group.outputs else None,
        out_offset=" + ".join(f"{o[d]} * {out_strides[d]}" for d in con.batch_axes) or "0",
        **_epilogue(kb, st, con, o),
    )


def stored_shape(kb: KernelBuilder, st: MmaConfig, con: Contraction) -> tuple[int, ...]:
    """The shape, in the product's axes, whose row-major strides address the stage's
    outputs, all laid out like the product: that of a concatenation an output is laid out
    in (``KernelParam.storage``) where the stage stores that one output only, the output's
    dimensions up to the concatenation's axis are the product's (those after it may split
    the product's last ones), and every axis before it is a batch axis (whose strides
    ``out_offset`` applies; the M and N strides stay the product's); else the product's
    own, the offer declined."""
    c = con.compute
    stored = [t for t in (st.node, *st.epilogue) if t in kb.group.outputs]
    laid = [t for t in stored if kb.params[t].storage is not None]
    if not laid:
        return c.shape
    param = kb.params[laid[0]]
    storage, shape = param.addressed, param.shape
    axis = next(d for d, (a, b) in enumerate(zip(storage, shape)) if a != b)
    if (
        len(stored) == 1
        and shape[: axis + 1] == c.shape[: axis + 1]
        and math.prod(shape[axis + 1 :]) == math.prod(c.shape[axis + 1 :])
        and set(range(axis)) <= set(con.batch_axes)
    ):
        return (*c.shape[:axis], storage[axis], *c.shape[axis + 1 :])
    for t in laid:
        kb.decline_layout(t)
    return c.shape


def _epilogue(kb: KernelBuilder, st: MmaConfig, con: Contraction, origins: list[str]) -> dict:
    """The epilogue fields of a stage computing ``st.epilogue`` on its accumulators: each
    stage's value printed over the element's indices (the root's batch origins, ``em`` and
    ``en``), reads of the product or of an earlier such stage as its rounded value, other
    reads from global memory; and what is stored."""
    if not st.epilogue:
        return {}
    c = con.compute
    index = {d: origins[d] for d in range(len(c.axes))} | {con.m_axis: "em", con.n_axis: "en"}
    stored = {st.node: _rounded("pv", c.dtype)}
    values, outputs = [], []
    if st.node in kb.group.outputs:
        outputs.append(_output(kb, st.node, "pv"))
    for j, node in enumerate(st.epilogue):

        def load(ld: Load, p: CPrinter) -> str:
            return stored[ld.tensor] if ld.tensor in stored else kb.global_load(ld, p)

        var = f"ev{j}"
        compute = kb.group.computes[node]
        names = view_indices(compute, c.shape, index)
        values.append(EpilogueValue(var, CPrinter(load, var=names).value(compute.body)))
        stored[node] = _rounded(var, kb.group.computes[node].dtype)
        if node in kb.group.outputs:
            outputs.append(_output(kb, node, var))
    return {"epilogue": values, "outputs": outputs}


def view_indices(compute: Compute, shape: Sequence[int], index: Mapping[int, str]) -> dict[str, str]:
    """C for each axis of ``compute``, a view of a tensor of ``shape`` that splits its axes
    (:func:`~welder.ir.layout.split_axes`), from the tensor's indices ``index`` (C, by axis)."""
    split = split_axes(shape, compute.shape)
    assert split is not None, "on_accumulators admits only views that split the product's axes"
    names = {}
    for axis, part in zip(compute.axes, split):
        if part.source is None:
            names[axis.name] = "0"
            continue
        at = index[part.source]
        if part.inner > 1:
            at = f"{at} / {part.inner}"
        if not part.outermost:
            at = f"{at} % {part.extent}"
        names[axis.name] = at if at == index[part.source] else f"({at})"
    return names


def _pieces_inside(kb: KernelBuilder, st: MmaConfig, con: Contraction) -> bool:
    """Whether every block's ``block_m x block_n`` piece of the product (the rows and columns
    the epilogue visits from the tile origin) lies inside the product: the origins along M
    and N are affine in the block coordinates, and their least and greatest values over the
    grid keep the piece within ``[0, m)`` and ``[0, n)``."""
    region = kb.regions.members[st.node]
    grid = kb.cfg.grid
    for axis, rows, extent in ((con.m_axis, st.block_m, con.m), (con.n_axis, st.block_n, con.n)):
        lo = region.dims[axis].affine
        if lo is None:
            return False
        least = greatest = lo.const
        for var, coef in lo.terms:
            if not (var.startswith("b") and var[1:].isdigit() and int(var[1:]) < len(grid)):
                return False
            span = coef * (grid[int(var[1:])] - 1)
            least, greatest = least + min(0, span), greatest + max(0, span)
        if least < 0 or greatest + rows > extent:
            return False
    return True


def _rounded(value: str, dtype: str) -> str:
    """C: a float ``value`` as it reads back once stored as ``dtype``."""
    half = HALF_FORMATS.get(dtype)
    return f"{half.to_float}({half.from_float}({value}))" if half is not None else value


def pair_packers(dtype: str) -> tuple[str, str]:
    """C functions storing accumulators as ``dtype``: two fp32 values as its pair type, and
    one as the type itself (none for fp32)."""
    half = HALF_FORMATS.get(dtype)
    return (half.pack2, half.from_float) if half is not None else ("make_float2", "")


def _output(kb: KernelBuilder, tensor: str, value: str) -> EpilogueOutput:
    dtype = kb.graph.tensor(tensor).dtype
    return EpilogueOutput(kb.params[tensor].name, STORAGE_TYPES[dtype], *pair_packers(dtype), value)


def stage_contraction(kb: KernelBuilder, st: StageConfig) -> Contraction:
    """The contraction a tensor-core stage config names, in its kind's format, as that
    kind's policy found it (:meth:`~welder.schedule.kinds.mma.MmaKind.contraction_of`)."""
    assert isinstance(st, MmaConfig)
    rule = kind(st.kind)
    assert isinstance(rule, MmaKind)
    con = rule.contraction_of(kb.group.computes[st.node], kb.shape_of)
    if con is None:
        raise ValueError(f"{st.node}: not a tensor-core contraction, yet configured as one")
    return con


def pair_rows(threads: int, cols: int) -> int:
    """A gathered operand's ``pair_rows``: the rows of a slice between one thread's pairs
    where ``threads`` are a whole number of a ``cols``-wide row's pairs, else 0."""
    pairs = cols // 2
    return threads // pairs if threads % pairs == 0 else 0


@dataclass(frozen=True)
class GatherAccess:
    """C for element ``(gk, gf)`` of a gathered operand: ``param[index]`` where ``valid``
    holds, zero elsewhere.  The template reads ``param[index & -ok]`` (``ok``: ``valid`` and
    the edge guards) unconditionally and selects zero afterwards: a guard around the load
    would make it a branch, and nvcc then waits for each element before the next one's
    guard, one memory latency per element, where a branch-free slice issues all its loads
    back to back."""

    param: str
    index: str
    valid: str  # "true" where every element in range is read


def gather_access(
    kb: KernelBuilder, con: Contraction, op: Operand, origins: list[str], at_k: str = "gk"
) -> GatherAccess:
    """How to read element ``(gk, gf)`` of gathered operand ``op``'s matrix (``gk`` along
    K, ``gf`` along its own axis, the batch axes at this block's origins), as the storage
    type: the load its conditions pick (a rolled axis reads one of two), or zero where a
    padding guard fails.  The value is copied, not computed: a load, no conversion.  For
    gathered rows (:attr:`~welder.schedule.kinds.mma.Operand.rows`) ``at_k`` is ``"0"``:
    where row ``gf`` starts."""
    expr = op.gather if op.gather is not None else op.rows
    assert expr is not None
    c = con.compute
    own = con.axis_name("m" if op is con.a else "n")
    names = {c.axes[d].name: origins[d] for d in con.batch_axes} | {own: "gf", con.k: at_k}
    param = kb.params[op.tensor]

    def no_load(ld: Load, p: CPrinter) -> str:
        raise AssertionError(f"a gathered operand's index or guard reads {ld.tensor}")

    printer = CPrinter(no_load, names, eager_logic=True)

    def access(e: Expr) -> tuple[str, str | None]:
        """(where ``e`` reads, its index; None for a zero) over the shapes _gathered_load
        admits: selects of loads of one tensor and zeros."""
        if isinstance(e, Const):
            return "false", None
        if isinstance(e, Load):
            return "true", flat_index([printer(i) for i in e.indices], param.addressed)
        assert isinstance(e, Select)
        cond = printer(e.cond)
        (valid_a, index_a), (valid_b, index_b) = access(e.a), access(e.b)
        if index_a is None or index_b is None:
            index = index_b if index_a is None else index_a
        else:
            index = f"({cond} ? {index_a} : {index_b})"
        if valid_a == valid_b:
            return valid_a, index
        if (valid_a, valid_b) == ("true", "false"):
            return cond, index
        if (valid_a, valid_b) == ("false", "true"):
            return f"(!{cond})", index
        return f"({cond} ? {valid_a} : {valid_b})", index

    valid, index = access(expr)
    return GatherAccess(param.name, index or "0", valid)


def operand_offset(con: Contraction, op: Operand, origins: list[str]) -> str:
    """C: the element offset of this block's matrix of ``op`` in its tensor."""
    batch = " + ".join(
        f"{origins[d]} * {s}" for d in con.batch_axes if (s := op.strides.get(con.compute.axes[d].name, 0))
    )
    return f"{op.offset}" + (f" + {batch}" if batch else "")


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> MmaStageCtx:
    """The context of tensor-core stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    return contraction_stage(kb, k, st, stage_contraction(kb, st), TEMPLATE, "tensor cores")


def contraction_stage(
    kb: KernelBuilder, k: int, st: StageConfig, con: Contraction, template: str, where: str
) -> MmaStageCtx:
    """The context of stage ``k`` computing ``con`` in the mma kind's tiles, rendered by
    ``template`` (``where``: what computes the products, for the kernel's comment)."""
    assert isinstance(st, MmaConfig)
    o = [kb.origin_name(k, d) for d in range(len(con.compute.axes))]
    wm, wn = st.block_m // st.warps[0], st.block_n // st.warps[1]
    a_elems, b_elems = ring_elements(st, con)
    a_view, b_view = f"mma{k}_a", f"mma{k}_b"
    dtype = con.compute.dtype
    kb.add_view(a_view, dtype, st.pipeline_offset, st.pipeline * a_elems)
    fmt = con.fmt
    kb.add_view(
        b_view, dtype, st.pipeline_offset + st.pipeline * a_elems * fmt.elem_bytes, st.pipeline * b_elems
    )
    return MmaStageCtx(
        template=template,
        headers=HEADERS,
        **contraction_fields(kb, k, st, con, where),
        mma_k=fmt.mma_k,
        mma=fmt.instruction,
        convert=fmt.convert,
        products=fmt.products,
        warps_n=st.warps[1],
        warp_m=wm,
        warp_n=wn,
        mi=wm // 16,
        ni=wn // 8,
        copy_bytes=st.copy_bytes,
        copy_elems=st.copy_bytes // fmt.elem_bytes,
        a=_operand(kb, con, con.a, "m", st, a_view, a_elems, o),
        b=_operand(kb, con, con.b, "n", st, b_view, b_elems, o),
    )


def _operand(
    kb: KernelBuilder,
    con: Contraction,
    op: Operand,
    role: str,
    st: MmaConfig,
    view: str,
    stage_elems: int,
    origins: list[str],
) -> _Operand:
    """``role`` is the operand's own output axis: ``"m"`` for A, ``"n"`` for B."""
    block = st.block_m if role == "m" else st.block_n
    extent = con.m if role == "m" else con.n
    origin = "m0" if role == "m" else "n0"
    offset = operand_offset(con, op, origins)
    k_rows = op.contiguous == role  # rows run along K when the operand's own axis is contiguous
    if k_rows:
        rows, cols, row_origin, col_origin = st.block_k, block, "k0", origin
        row_limit, col_limit, row_stride = con.k_extent, extent, con.stride(op, "k")
    else:
        rows, cols, row_origin, col_origin = block, st.block_k, origin, "k0"
        row_limit, col_limit, row_stride = extent, con.k_extent, con.stride(op, role)
    fmt = con.fmt
    ld = cols + fmt.row_pad(k_rows)
    loader = fmt.loader(k_rows)
    # Along K an 8x8 ldmatrix matrix spans 16 bytes: 8 halves (one k8 half of m16n8k16's
    # fragment) or 4 floats (one k4 half of m16n8k8's, read as pairs of 16-bit elements).
    half_k = 16 // fmt.elem_bytes
    lane_matrix = "(lane / 8)"
    offsets = None
    warp = "wm0 + mi * 16" if role == "m" else "wn0 + nj * 16"
    if loader == "lds":
        # Lane (g, t) holds element k = t, m or n = g of each register's 8 x 4 piece; the
        # registers step by 8 along M or N and 4 along K (in ldmatrix.x4's order for A: a[0..3];
        # for B: b[0], b[1] of the lower n8 tile, then of the upper one).
        fragment = f"(kk + lane % 4) * {ld} + {warp} + lane / 4"
        offsets = (0, 8, 4 * ld, 4 * ld + 8) if role == "m" else (0, 4 * ld, 8, 4 * ld + 8)
    elif role == "m":
        if not k_rows:  # [m][k]: lanes 0-15 rows m, lanes 16-31 the upper k half
            fragment = f"({warp} + lane % 16) * {ld} + kk + lane / 16 * {half_k}"
        else:  # [k][m], transposed: matrix i covers m half i & 1 and k half i >> 1
            fragment = f"(kk + {lane_matrix} / 2 * 8 + lane % 8) * {ld} + {warp} + {lane_matrix} % 2 * 8"
    else:
        if k_rows:  # [k][n], transposed: lanes 0-15 rows k of the lower n half, 16-31 the upper
            fragment = f"(kk + lane % 16) * {ld} + {warp} + lane / 16 * 8"
        else:  # [n][k]: matrix i covers n half i >> 1 and k half i & 1
            fragment = (
                f"({warp} + {lane_matrix} / 2 * 8 + lane % 8) * {ld} + kk + {lane_matrix} % 2 * {half_k}"
            )
    gathered = op.gathered
    chunks = cols // (st.copy_bytes // fmt.elem_bytes)
    threads = st.threads
    hoisted = threads % chunks == 0 and rows % (threads // chunks) == 0
    row_step = threads // chunks if hoisted else 0
    copies = rows // row_step if hoisted else 0
    return _Operand(
        name="a" if role == "m" else "b",
        param=kb.params[op.tensor].name,
        view=view,
        offset=offset,
        rows=rows,
        cols=cols,
        ld=ld,
        stage_elems=stage_elems,
        row_origin=row_origin,
        col_origin=col_origin,
        row_limit=row_limit,
        col_limit=col_limit,
        row_stride=row_stride,
        loader=loader,
        fragment=fragment,
        offsets=offsets,
        k_rows=k_rows,
        chunks=chunks,
        hoisted=hoisted,
        row_step=row_step,
        copies=copies,
        k_step=row_stride if k_rows else 1,
        fixed_origin=origin,
        fixed_limit=extent,
        gather=gather_access(kb, con, op, origins) if gathered else None,
        row_gather=gather_access(kb, con, op, origins, "0") if op.rows is not None else None,
        pairs=rows * cols // 2 // threads if gathered else 0,
        pair_rows=pair_rows(threads, cols) if gathered else 0,
        gather_dst=f"row * {ld} + col",
    )
