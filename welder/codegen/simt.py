"""Code generation for SIMT stages (``codegen_templates/stages/simt.cu.j2``).

A SIMT stage (``welder.schedule.kinds.simt.SimtConfig``) computes its tile with one
register tile per thread: thread coordinates over the tile's axes, an inner loop over the
register tile, reduction points walked per thread (or split across threads and combined
with shuffles), global inputs staged in shared memory one reduction step at a time, and the
tile written to shared memory and/or global memory.  :func:`emit_stage` works out every
value the template prints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from welder.ir.compute import Compute, reduce_identity
from welder.ir.expr import Binary, Const, Expr, Load, Select, free_vars, is_half, rewrite, walk
from welder.ir.interpret import np_dtype
from welder.ir.window import sliding_window
from welder.schedule.config import GroupConfig, StageConfig
from welder.schedule.kinds.simt import (
    SimtConfig,
    StagedInput,
    held_rows,
    steps_in_vectors,
    unconditional_loads,
    vector_aligned,
)
from welder.tile.propagate import Region, read_regions
from welder.tile.region import Affine, Interval, affine_form

from .common import StageCtx, flat_index, read_value, sanitize_comment
from .cprint import COMPUTE_TYPES, HALF_FORMATS, STORAGE_TYPES, CPrinter, literal

if TYPE_CHECKING:
    from .kernel import KernelBuilder

TEMPLATE = "stages/simt.cu.j2"
#: Vector types for staged loads, by (storage dtype, elements): the type one load moves and
#: its all-zero value (the fill of out-of-bounds elements; zero bits are +0.0 in both
#: formats).  16-bit floats move as pairs (__half2, __nv_bfloat162) or as raw 8- and
#: 16-byte words: the bits land in shared memory unchanged and are read back one element at
#: a time.
VECTOR_TYPES: dict[tuple[str, int], tuple[str, str]] = {
    ("float32", 2): ("float2", "make_float2(0.0f, 0.0f)"),
    ("float32", 4): ("float4", "make_float4(0.0f, 0.0f, 0.0f, 0.0f)"),
    **{
        (dtype, n): vector
        for dtype, half in HALF_FORMATS.items()
        for n, vector in (
            (2, (half.pair, f"{half.pair_from_float}(0.0f)")),
            (4, ("uint2", "make_uint2(0u, 0u)")),
            (8, ("uint4", "make_uint4(0u, 0u, 0u, 0u)")),
        )
    },
}
#: The widest load a thread issues (LDG.128).
MAX_VECTOR_BYTES = 16
#: Iterations of a reduction read in vectors that a thread unrolls, so that as many 16-byte
#: loads are in flight at once: without it nvcc kept one (BSRN's contrast mean, sm_90 PTX).
VECTORS_IN_FLIGHT = 4


# -- the context the template reads --------------------------------------------------------


@dataclass
class _Dim:
    axis: int
    local: str
    origin: str
    suffix: str = ""  # "v" on a vectorised stage's innermost axis: l<axis>v is a vector's start


@dataclass
class _VectorLoad:
    """One vector of an input, loaded before the stage's per-element loop: from the global
    parameter, from the shared buffer a reduction before the stage staged it in, or from an
    earlier stage's tile in shared memory."""

    name: str
    type: str
    param: str  # the pointer read: a parameter or a shared view
    flat: str
    keep: str = ""  # the register array it is also kept in (a held reduction: SimtConfig.hold)
    held: str = ""  # the register array it is read from instead (an earlier stage kept it)
    slot: str = ""  # the array's index: the reduction's pass or the vector stage's j
    source: Load | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class _RowWalk:
    """Which vector of an input each thread of a reduction in vectors loads in which pass:
    the parameter and the vector's flat index as printed (with the reduce variable
    ``rvar``), and the layout the printed names stand for.  Two reductions of one kernel
    with equal walks load the same vectors."""

    param: str
    flat: str
    rvar: str
    passes: int
    width: int
    reduce_threads: int
    threads: tuple[int, ...]  # the reduction's thread shape (simt.held_rows: which are rows)
    origins: tuple[str, ...]  # its tile origin


@dataclass(frozen=True)
class _Held:
    """The register array a held reduction (``SimtConfig.hold``) keeps one input's vectors
    in, a slot a pass, and how it loaded them."""

    array: str
    walk: _RowWalk


@dataclass
class _StagedDim:
    axis: int
    extent: int
    origin_name: str
    origin: str


@dataclass
class _Staged:
    view: str
    param: str
    count: int
    vector: int
    dims: list[_StagedDim]
    in_bounds: str
    global_flat: str
    zero: str
    vector_t: str = ""
    vector_zero: str = ""
    load: bool = True  # False: an earlier stage left it in the buffer (StagedInput.resident)

    @property
    def dims_inner_first(self) -> list[_StagedDim]:
        return list(reversed(self.dims))


@dataclass
class _ReduceDim:
    """One reduce axis.  ``stride`` is its place value when the reduction points are
    enumerated as one flat range split across threads: over the whole reduction, or for a
    staged stage over one step (``step`` points of it; ``partial`` when the last step runs
    past ``extent``)."""

    axis: int
    extent: int
    stride: int = 1
    step: int = 0
    value: str = ""
    partial: bool = False
    width: int = 1  # counts vectors of this many elements (SimtConfig.rvector): r<axis>v


@dataclass
class _Window:
    """A sliding-window stage's reduction (:class:`~welder.ir.window.SlidingWindow`): per
    thread and window row, the distinct values of the windowed factor ``x`` along the
    innermost axis (``reps``: the first ``(output, tap)`` reading each), then every
    ``(output, tap, value)`` multiply-add with the other factor ``w``.  ``rest`` counts the
    register tile's points on the other axes; ``tap`` is the reduce axis the values slide
    along, set per value."""

    reg: int
    rest: int
    tap: str
    reps: list[tuple[int, int]]
    uses: list[tuple[int, int, int]]
    x: str
    w: str  # free of the innermost axis: read once per tap
    taps: int
    value_t: str
    zero: str
    w_t: str
    w_zero: str
    # Loads of the windowed factor free of the window's axis and tap (a bias, a clip's
    # bounds): read once per row into registers, as (C type, name, value, zero).
    hoisted: list[tuple[str, str, str, str]] = field(default_factory=list)


@dataclass(kw_only=True)
class SimtStageCtx(StageCtx):
    """What ``stages/simt.cu.j2`` reads of one stage."""

    reduce_op: str | None
    reduce_threads: int
    active: int
    thread_coords: list[dict]
    nreg: int
    dims: list[_Dim]
    valid: str
    body: str
    value_t: str
    out_dtype: str
    tile_view: str | None
    local_flat: str
    out_param: str | None
    global_flat: str
    acc_t: str = ""
    init: str = ""
    result: str = ""
    arg: bool = False
    staged: list[_Staged] = field(default_factory=list)
    step_axes: list[dict] = field(default_factory=list)
    reduce_dims: list[_ReduceDim] = field(default_factory=list)
    reduce_total: int = 1
    step_total: int = 1  # reduction points per step (staged stages)
    shuffle_start: int = 0
    warps_per_output: int = 1
    red_view: str = ""
    redi_view: str = ""
    vector: int = 1  # elements per vector on the innermost axis (an elementwise stage)
    vaxis: int = 0
    rvector: int = 1  # elements per vector on the innermost reduce axis (a reduction)
    rvaxis: int = 0
    unroll: int = 1  # iterations of a reduction in vectors unrolled (VECTORS_IN_FLIGHT at most)
    passes: int = 0  # a reduction in vectors walked in this many passes u (held vectors' slots)
    vloads: list[_VectorLoad] = field(default_factory=list)
    vout_type: str = ""
    vflat: str = ""  # the output's flat index of a vector's first element
    unroll_reduce: bool = False  # a sliding window's taps unrolled (SimtConfig.window)
    window: _Window | None = None
    window_tap: int = -1  # the reduce axis a window's values slide along (no loop of its own)

    def combine(self, a: str, b: str) -> str:
        return combine(self.reduce_op, a, b)

    def to_storage(self, v: str) -> str:
        half = HALF_FORMATS.get(self.out_dtype)
        if half is not None:
            return f"{half.from_float}({v})"
        return f"({STORAGE_TYPES[self.out_dtype]})({v})"


def combine(op: str, a: str, b: str) -> str:
    """C: two partial results ``a`` and ``b`` of a ``op`` reduction combined."""
    if op == "sum":
        return f"{a} + {b}"
    if op == "prod":
        return f"{a} * {b}"
    return f"welder_{op}({a}, {b})"


# -- the generator ------------------------------------------------------------------------------


# -- the emitter ---------------------------------------------------------------------------------


def emit_stage(kb: KernelBuilder, k: int, st: StageConfig) -> SimtStageCtx:
    """The context of SIMT stage ``k`` (config ``st``) of the kernel ``kb`` builds."""
    assert isinstance(st, SimtConfig)
    c = kb.group.computes[st.node]
    region = kb.regions.members[st.node]
    shape = c.shape
    origins = [
        {"name": kb.origin_name(k, d), "expr": kb.index_c(iv.lo_expr())} for d, iv in enumerate(region.dims)
    ]
    nonneg_origin = all(_nonneg_interval(iv) for iv in region.dims)
    tcoords, stride = [], 1
    for d in reversed(range(len(shape))):
        tcoords.append({"axis": d, "stride": stride, "extent": st.thread_shape[d]})
        stride *= st.thread_shape[d]
    dims, rstride = [], 1
    valid = []
    last = len(shape) - 1
    for d in reversed(range(len(shape))):
        local = f"t{d}"
        if st.reg_tile[d] > 1 and st.window and d == last:
            local = f"t{d} * {st.reg_tile[d]} + j / {rstride} % {st.reg_tile[d]}"
        elif st.reg_tile[d] > 1:
            local = f"t{d} + (j / {rstride} % {st.reg_tile[d]}) * {st.thread_shape[d]}"
        width, suffix = (st.vector, "v") if d == last and st.vector > 1 else (1, "")
        if width > 1:
            local = f"({local}) * {width}"
        dims.append(_Dim(d, local, kb.origin_name(k, d), suffix))
        rstride *= st.reg_tile[d]
        if st.thread_shape[d] * st.reg_tile[d] * width != st.tile[d]:
            valid.append(f"l{d}{suffix} < {st.tile[d]}")
        if not nonneg_origin:
            valid.append(f"i{d}{suffix} >= 0")
        if not _tile_inside(region.dims[d], st.tile[d], shape[d], kb.cfg):
            valid.append(f"i{d}{suffix} < {shape[d]}")
    dims.reverse()
    out_dtype = c.dtype
    is_arg = c.reduce_op in ("argmax", "argmin")
    staged_names = {sd.tensor: f"stage{k}_{j}" for j, sd in enumerate(st.staged)}
    printer = _printer(kb, k, st, staged_names, nonneg_origin)
    body = _padding_read_staged(c, st, kb.shape_of)
    ctx = SimtStageCtx(
        template=TEMPLATE,
        comment=sanitize_comment(f"{st.node} ({'reduce ' + c.reduce_op if c.reduce_op else 'injective'})"),
        reduce_op=c.reduce_op,
        reduce_threads=st.reduce_threads,
        active=math.prod(st.thread_shape),
        thread_coords=tcoords,
        nreg=math.prod(st.reg_tile),
        dims=dims,
        valid=" && ".join(valid) or "true",
        body=printer.value(body),
        value_t=COMPUTE_TYPES[out_dtype],
        out_dtype=out_dtype,
        tile_view=kb.tile_views.get(st.node),
        local_flat=flat_index([f"l{d}" for d in range(len(shape))], st.tile),
        out_param=kb.params[st.node].name if st.node in kb.group.outputs else None,
        global_flat=flat_index([f"i{d}" for d in range(len(shape))], _addressed(kb, st.node)),
        origins=origins,
        unroll_reduce=st.window,
    )
    if c.reduce_op:
        _reduction(kb, ctx, k, c, st, staged_names, is_arg, printer)
        if st.window and nonneg_origin:
            _window(ctx, c, body, st, printer, kb.shape_of)
        return ctx
    # an injective stage's staged inputs are all resident: rows a reduction before it staged
    ctx.staged = [_staged(kb, k, st, c, sd, staged_names[sd.tensor]) for sd in st.staged]
    if st.vector > 1:
        _vectorize(kb, ctx, st, c, printer, {sd.tensor: (sd, staged_names[sd.tensor]) for sd in st.staged})
    return ctx


def _addressed(kb: KernelBuilder, node: str) -> tuple[int, ...]:
    """The shape whose strides address stage ``node``'s stores: its output param's (its own,
    or a concatenation's it is laid out in), or its own where it is no output."""
    return kb.params[node].addressed if node in kb.group.outputs else kb.graph.tensor(node).shape


def _padding_read_staged(c: Compute, st: SimtConfig, shape_of) -> Expr:
    """``c``'s body with every padding select around a load of a tensor the stage stages --
    ``select(index in bounds, load, 0)`` -- read as the load alone: the staging copy writes
    zero wherever an index lies outside the tensor (:func:`_staged`), which is the select's
    value there, and the staged region holds every index the select guards (it bounds the
    load's indices, not the condition).  A depthwise convolution's taps each paid four
    compares and a select for it, which made Restormer's bound by issue.  A sliding
    window reads each distinct value once, from the same tile; streaming stages read their
    rows their own way and keep the select."""
    staged = {sd.tensor for sd in st.staged if not sd.resident}
    if not c.reduce_op or st.stream or not staged:
        return c.body

    def read(e: Expr) -> Expr | None:
        padding = (
            isinstance(e, Select)
            and isinstance(e.a, Load)
            and e.a.tensor in staged
            and _zero(e.b)
            and _out_of_bounds_when_false(e.cond, e.a, shape_of(e.a.tensor))
        )
        return e.a if padding else None

    return rewrite(c.body, read)


def _zero(e: Expr) -> bool:
    """Whether ``e`` is the constant +0 (the staging copy's fill)."""
    return isinstance(e, Const) and e.value == 0 and math.copysign(1.0, float(e.value)) > 0


def _out_of_bounds_when_false(cond: Expr, ld: Load, shape: Sequence[int]) -> bool:
    """Whether ``cond`` is a conjunction of bounds each of which fails only where an index of
    ``ld`` lies outside the tensor: ``x >= c`` or ``x < c``, where the index is ``x + d``
    for a constant d (an inlined Pad checks ``i + r >= 1`` and reads ``i + r - 1``) and
    ``c + d <= 0`` or ``c + d`` at least the extent."""
    if isinstance(cond, Binary) and cond.op == "and":
        return _out_of_bounds_when_false(cond.a, ld, shape) and _out_of_bounds_when_false(cond.b, ld, shape)
    if not (isinstance(cond, Binary) and cond.op in ("ge", "lt") and isinstance(cond.b, Const)):
        return False
    x = affine_form(cond.a)
    for index, extent in zip(ld.indices, shape):
        i = affine_form(index)
        if x is None or i is None or not i.same_terms(x):
            continue
        edge = cond.b.value + i.const - x.const  # the bound, on the index
        if (edge <= 0) if cond.op == "ge" else (edge >= extent):
            return True
    return False


def _guarded(ld: Load, shape: Sequence[int], printer: CPrinter) -> str:
    """``ld`` read only where its indices lie inside the tensor (zero elsewhere).  A load
    hoisted out of the window's selects runs where the original may not have: a padding
    select can hold an index outside the tensor back, which the hoisted read must not make."""
    checks = []
    for index, extent in zip(ld.indices, shape):
        if free_vars(index):
            i = printer(index)
            checks.append(f"({i}) >= 0 && ({i}) < {extent}")
    value = printer(ld)
    return f"(({' && '.join(checks)}) ? {value} : {literal(0, ld.dtype)})" if checks else value


def _window(ctx: SimtStageCtx, c: Compute, body: Expr, st: SimtConfig, printer: CPrinter, shape_of) -> None:
    """A sliding window's reduction with each distinct value of the windowed factor read once
    per thread and row (SimtConfig.window; the kind proposes it only where
    :func:`~welder.ir.window.sliding_window` holds).  Without a non-negative tile origin the
    stage keeps the generic loops, unrolled: a value's first reader must be valid whenever
    a later one is, which outputs of increasing index guarantee only from a valid start.
    ``body`` is ``c``'s, its padding of staged reads dropped (:func:`_padding_read_staged`)."""
    win = sliding_window(c)
    assert win is not None and isinstance(body, Binary), f"{st.node}: no sliding window"
    reg = st.reg_tile[-1]
    tap = [a.name for a in c.reduce_axes].index(win.tap)
    taps = c.reduce_axes[tap].extent
    reps, uses = win.slots(reg, taps)
    x, w = (body.a, body.b) if win.x == 0 else (body.b, body.a)
    slides = {win.axis, win.tap}
    invariant = list(
        dict.fromkeys(ld for ld in walk(x) if isinstance(ld, Load) and not free_vars(ld) & slides)
    )
    names = {ld: f"xh{n}" for n, ld in enumerate(invariant)}
    hoisted = [
        (COMPUTE_TYPES[ld.dtype], names[ld], _guarded(ld, shape_of(ld.tensor), printer), literal(0, ld.dtype))
        for ld in invariant
    ]
    ctx.window_tap = tap
    ctx.window = _Window(
        reg,
        ctx.nreg // reg,
        win.tap,
        reps,
        uses,
        printer.with_loads(names)(x),
        printer(w),
        taps,
        COMPUTE_TYPES[x.dtype],
        literal(0, x.dtype),
        COMPUTE_TYPES[w.dtype],
        literal(0, w.dtype),
        hoisted,
    )


def _vectorize(
    kb: KernelBuilder,
    ctx: SimtStageCtx,
    st: SimtConfig,
    c: Compute,
    scalar: CPrinter,
    staged: Mapping[str, tuple[StagedInput, str]],
) -> None:
    """An elementwise stage that moves ``st.vector`` contiguous elements per instruction:
    each input read at the output's innermost index plus a multiple of the width is loaded
    as one vector before the per-element loop (the others stay scalar reads), and the
    results are stored as one vector.  The policy proposes it only where rows and tiles are
    whole vectors (``welder.schedule.kinds.simt.elementwise_vector``).  An input a reduction
    before it left in shared memory (``staged``: tensor -> its buffer and view) is read from
    there, a vector at a time where its buffer holds whole rows."""
    width, axis = st.vector, len(c.shape) - 1
    ctx.vector, ctx.vaxis = width, axis
    ctx.vout_type = _vec_type(c.dtype, width)
    vaxes = [f"i{d}" + ("v" if d == axis else "") for d in range(len(c.shape))]
    ctx.vflat = flat_index(vaxes, _addressed(kb, st.node))
    _vector_reads(kb, ctx, c, scalar, f"i{axis}", width, staged)
    _read_held(kb, ctx, st, c, scalar)


def _read_held(kb: KernelBuilder, ctx: SimtStageCtx, st: SimtConfig, c: Compute, scalar: CPrinter) -> None:
    """An elementwise stage in vectors laid out as a held reduction before it (its rows at
    the same threads, its innermost axis the reduce axis from 0, its ``j``-th vector the
    reduction's pass ``j``: ``welder.schedule.kinds.simt.held_twin``) reads the vectors that
    reduction kept wherever it loads the same elements: the same parameter at the same
    index once its innermost variable is named as the reduction's."""
    last = len(c.shape) - 1
    if ctx.valid != "true" or math.prod(st.reg_tile[:-1]) != 1:
        return
    if not _zero_on_grid(kb.regions.members[st.node].dims[last], kb.cfg):
        return
    layout = (st.reg_tile[-1], st.vector, st.thread_shape[-1], tuple(st.thread_shape[:-1]))
    origins = tuple(o["expr"] for o in ctx.origins[:-1])
    for v in _global(kb, ctx.vloads):
        ld = v.source
        assert ld is not None
        for held in kb.held:
            w = held.walk
            rows = held_rows(w.threads, len(c.shape))
            if rows is None or w.param != v.param or w.origins[:rows] != origins:
                continue
            if (w.passes, w.width, w.reduce_threads, w.threads[:rows]) != layout:
                continue
            at = CPrinter(kb.global_load, var={f"i{last}": f"{w.rvar}v"}, nonneg=scalar.nonneg)
            if flat_index([at(i) for i in ld.indices], kb.params[ld.tensor].addressed) == w.flat:
                v.held, v.slot = held.array, "j"
                break


def _zero_on_grid(iv: Interval, cfg: GroupConfig) -> bool:
    """Whether a tile's origin along one axis is 0 in every block of the grid."""
    lo = iv.lo
    if not isinstance(lo, Affine) or lo.const != 0:
        return False
    return all(v.startswith("b") and cfg.grid[int(v[1:])] == 1 for v, coef in lo.terms if coef)


def _vectorize_reduction(
    kb: KernelBuilder, ctx: SimtStageCtx, st: SimtConfig, c: Compute, scalar: CPrinter
) -> None:
    """A reduction split over threads that walks its innermost reduce axis ``r<axis>`` in
    vectors of ``st.rvector`` elements (``welder.schedule.kinds.simt.reduce_vector``): a
    thread's point is a vector starting at ``r<axis>v``; each input whose innermost index
    steps with the axis is loaded there as one vector, and the body is combined per element
    of it (the other inputs stay scalar reads)."""
    width, axis = st.rvector, len(c.reduce_axes) - 1
    ctx.rvector, ctx.rvaxis = width, axis
    per_thread = -(-ctx.reduce_total // (width * st.reduce_threads))
    ctx.unroll = max(1, min(VECTORS_IN_FLIGHT, per_thread))
    _vector_reads(kb, ctx, c, scalar, f"r{axis}", width, {})
    _hold(kb, ctx, st, c, per_thread)


def _hold(kb: KernelBuilder, ctx: SimtStageCtx, st: SimtConfig, c: Compute, passes: int) -> None:
    """A held reduction (``st.hold``) keeps each vector it loads from a global input in a
    register array, one slot a pass; a later reduction walking the same elements in the same
    passes at the same threads (the same layout and the same printed index) reads them from
    there.  Either walks its reduction in ``passes`` unrolled passes ``u``, the slots'
    indices.  Only where every thread takes ``passes`` vectors, one output each."""
    if len(c.reduce_axes) != 1 or ctx.nreg != 1 or ctx.valid != "true":
        return
    if ctx.reduce_total % (st.rvector * st.reduce_threads) or tuple(st.thread_shape) != tuple(st.tile):
        return
    rvar, threads, origins = f"r{ctx.rvaxis}", tuple(st.thread_shape), tuple(o["expr"] for o in ctx.origins)
    used = False
    for v in _global(kb, ctx.vloads):
        walk = _RowWalk(v.param, v.flat, rvar, passes, st.rvector, st.reduce_threads, threads, origins)
        held = next((h for h in kb.held if h.walk == walk), None)
        if held is not None:
            v.held, v.slot, used = held.array, "u", True
        elif st.hold:
            array = f"held{len(kb.registers)}"
            kb.add_registers(array, v.type, passes)
            kb.held.append(_Held(array, walk))
            v.keep, v.slot, used = array, "u", True
    if used:
        ctx.passes = passes


def _vector_reads(
    kb: KernelBuilder,
    ctx: SimtStageCtx,
    c: Compute,
    scalar: CPrinter,
    var: str,
    width: int,
    staged: Mapping[str, tuple[StagedInput, str]],
) -> None:
    """The stage's body with each input whose innermost index steps with ``var`` read from
    one vector loaded where ``var`` starts a vector (``<var>v``; ``ctx.vloads``) and the
    others as ``scalar`` reads them.  An input staged in shared memory (``staged``: tensor
    -> its buffer and view) is loaded from the buffer where it holds whole rows and read
    element by element from it otherwise; a member an earlier stage keeps as a tile of whole
    rows is loaded from the tile."""
    at_start = CPrinter(kb.global_load, var={var: f"{var}v"}, nonneg=scalar.nonneg)
    names: dict[Load, str] = {}
    for ld in unconditional_loads(c.body):
        if ld in names or not _vector_loadable(kb, ld, var, width):
            continue
        idx = [at_start(i) for i in ld.indices]
        if ld.tensor in kb.tile_views:
            src, source = kb.stage_index[ld.tensor], kb.tile_views[ld.tensor]
            local = [f"({i} - {kb.origin_name(src, d)})" for d, i in enumerate(idx)]
            flat = flat_index(local, kb.tiles[ld.tensor])
        elif ld.tensor in staged:
            sd, view = staged[ld.tensor]
            if not _whole_rows(sd, kb.params[ld.tensor].shape, width):
                continue
            local = [f"({i} - {view}_o{d})" for d, i in enumerate(idx)]
            source, flat = view, flat_index(local, sd.extents)
        else:
            param = kb.params[ld.tensor]
            source, flat = param.name, flat_index(idx, param.addressed)
        names[ld] = f"vl{len(names)}"
        ctx.vloads.append(_VectorLoad(names[ld], _vec_type(ld.dtype, width), source, flat, source=ld))

    vectors = {ld: read_value(f"{name}.v[e]", ld.dtype) for ld, name in names.items()}
    ctx.body = scalar.with_loads(vectors).value(c.body)


def _global(kb: KernelBuilder, vloads: Sequence[_VectorLoad]) -> list[_VectorLoad]:
    """The vector loads that read a global parameter (not a shared buffer)."""
    params = {p.name for p in kb.params.values()}
    return [v for v in vloads if v.source is not None and v.param in params]


def _whole_rows(sd: StagedInput, shape: Sequence[int], width: int) -> bool:
    """Whether a staging buffer's rows are the tensor's whole rows, unshifted and a whole
    number of ``width``-element vectors long: then an aligned vector of the tensor is an
    aligned vector of the buffer (whose offset is 16-byte aligned)."""
    return sd.shift == 0 and sd.extents[-1] == shape[-1] and sd.extents[-1] % width == 0


def _vec_type(dtype: str, width: int) -> str:
    return f"welder_vec<{STORAGE_TYPES[dtype]}, {width}>"


def _vector_loadable(kb: KernelBuilder, ld: Load, var: str, width: int) -> bool:
    """Whether ``ld`` reads ``width`` contiguous, aligned elements as the index ``var`` steps
    through a vector: a global parameter of a float type at most 16 bytes a vector, in rows
    of whole vectors, whose innermost index steps with ``var`` (``steps_in_vectors``); or
    the shared-memory tile of an earlier stage holding whole such rows, 16-byte aligned."""
    if not ld.indices or ld.dtype not in ("float16", "bfloat16", "float32"):
        return False
    if ld.tensor in kb.tile_views:
        view = kb.tile_views[ld.tensor]
        # the view's own offset: an attention config has fewer stages than its group
        offset = next(v["offset"] for v in kb.views if v["name"] == view)
        shape = kb.graph.tensor(ld.tensor).shape
        if kb.tiles[ld.tensor][-1] != shape[-1] or offset % MAX_VECTOR_BYTES:
            return False
    elif ld.tensor in kb.params:
        shape = kb.params[ld.tensor].shape
    else:
        return False
    if np_dtype(ld.dtype).itemsize * width > MAX_VECTOR_BYTES or shape[-1] % width:
        return False
    return steps_in_vectors(ld, var, width)


def _reduction(
    kb: KernelBuilder,
    ctx: SimtStageCtx,
    k: int,
    c: Compute,
    st: SimtConfig,
    staged_names: dict[str, str],
    is_arg: bool,
    printer: CPrinter,
) -> None:
    body_dtype = c.body.dtype
    ctx.acc_t = COMPUTE_TYPES[body_dtype]
    ctx.arg = is_arg
    ctx.init = literal(
        reduce_identity(c.reduce_op, body_dtype), body_dtype if body_dtype != "index" else "int32"
    )
    ctx.result = "(long long)acci[j]" if is_arg else "acc[j]"
    extents = [a.extent for a in c.reduce_axes]
    ctx.reduce_total = math.prod(extents)
    if st.staged:
        ctx.step_axes = [
            {"axis": r, "steps": -(-e // s)} for r, (e, s) in enumerate(zip(extents, st.rstep)) if s < e
        ]
        stride = 1
        dims = []
        for r in reversed(range(len(extents))):
            e, s = extents[r], st.rstep[r]
            dims.append(
                _ReduceDim(
                    r,
                    e,
                    stride=stride,
                    step=s,
                    value=f"k{r} * {s} + rr{r}" if s < e else f"rr{r}",
                    partial=s < e and e % s != 0,
                )
            )
            stride *= s
        ctx.reduce_dims = list(reversed(dims))
        ctx.step_total = stride
        ctx.staged = [_staged(kb, k, st, c, sd, staged_names[sd.tensor]) for sd in st.staged]
    else:
        stride = 1
        dims = []
        for r in reversed(range(len(extents))):
            width = st.rvector if r == len(extents) - 1 else 1
            dims.append(_ReduceDim(r, extents[r] // width, stride=stride, width=width))
            stride *= extents[r] // width
        ctx.reduce_dims = list(reversed(dims))
        if st.rvector > 1:
            _vectorize_reduction(kb, ctx, st, c, printer)
    if st.reduce_threads > 1:
        ctx.shuffle_start = min(st.reduce_threads, 32) // 2
        ctx.warps_per_output = max(1, st.reduce_threads // 32)
        if ctx.warps_per_output > 1:
            base = _reduce_buffer_offset(st)
            slots = ctx.active * ctx.warps_per_output * ctx.nreg
            ctx.red_view = f"red{k}"
            kb.add_view(ctx.red_view, "float32" if is_half(body_dtype) else body_dtype, base, slots)
            if is_arg:
                ctx.redi_view = f"redi{k}"
                kb.add_view(ctx.redi_view, "int32", base + 8 * slots, slots)


def _reduce_buffer_offset(st: SimtConfig) -> int:
    offset = st.reduce_offset
    if offset is None:
        raise ValueError(f"{st.node}: config has no shared buffer for its cross-warp reduction")
    return offset


def _staged(kb: KernelBuilder, k: int, st: SimtConfig, c: Compute, sd: StagedInput, view: str) -> _Staged:
    region = read_regions(c, kb.regions.members[st.node].dims, kb.shape_of, st.rstep)[sd.tensor]
    info = kb.graph.tensor(sd.tensor)
    kb.add_view(view, info.dtype, sd.offset, math.prod(sd.extents))
    last = len(sd.extents) - 1
    dims = [
        _StagedDim(d, e, f"{view}_o{d}", _origin(kb.index_c(iv.lo_expr()), sd.shift if d == last else 0))
        for d, (e, iv) in enumerate(zip(sd.extents, region.dims))
    ]
    xs = [f"({d.origin_name} + c{d.axis})" for d in dims]
    vector = _load_vector(sd.vector, region, info.shape, sd.extents, info.dtype, sd.shift)
    bounds = []
    for d, x, size in zip(dims, xs, info.shape):
        hi = size - vector + 1 if d.axis == len(dims) - 1 else size
        bounds.append(f"{x} >= 0 && {x} < {hi}")
    half = HALF_FORMATS.get(info.dtype)
    zero = f"{half.from_float}(0.0f)" if half is not None else literal(0, info.dtype)
    staged = _Staged(
        view,
        kb.params[sd.tensor].name,
        math.prod(sd.extents),
        vector,
        dims,
        " && ".join(bounds) or "true",
        flat_index(xs, info.shape),
        zero,
        load=not sd.resident,
    )
    if vector > 1:
        staged.vector_t, staged.vector_zero = VECTOR_TYPES[info.dtype, vector]
    return staged


# -- expressions ---------------------------------------------------------------------------


def _printer(
    kb: KernelBuilder, k: int, st: SimtConfig, staged: dict[str, str], nonneg_origin: bool
) -> CPrinter:
    c = kb.group.computes[st.node]
    nonneg = {f"r{d}" for d in range(len(c.reduce_axes))}
    if nonneg_origin:
        nonneg |= {f"i{d}" for d in range(len(c.axes))}

    def load(ld: Load, p: CPrinter) -> str:
        if ld.tensor in staged:
            view = staged[ld.tensor]
            idx = [f"({p(i)} - {view}_o{d})" for d, i in enumerate(ld.indices)]
            extents = next(sd.extents for sd in st.staged if sd.tensor == ld.tensor)
            return read_value(f"{view}[{flat_index(idx, extents)}]", ld.dtype)
        from_tile = kb.tile_load(ld, p)
        return from_tile if from_tile is not None else kb.global_load(ld, p)

    return CPrinter(load, nonneg=nonneg)


def _origin(origin: str, shift: int) -> str:
    """A staging buffer's origin along one axis: the region's, ``shift`` elements earlier."""
    return f"({origin}) - {shift}" if shift else origin


def _load_vector(
    requested: int, region: Region, shape: Sequence[int], extents: Sequence[int], dtype: str, shift: int = 0
) -> int:
    """Elements each staged load moves.  The policy asks for vector loads (``requested`` > 1)
    and counts elements, up to 4; the hardware's limit is bytes, 16 per load, which is 8
    halves.  So where vectors are asked for, this takes the widest vector type of the dtype
    whose every load stays aligned -- re-checked here, so a wrong width from the policy
    costs speed, not a misaligned access."""
    if requested < 2:
        return 1
    item = np_dtype(dtype).itemsize
    widths = sorted((w for d, w in VECTOR_TYPES if d == dtype and w * item <= MAX_VECTOR_BYTES), reverse=True)
    return next((w for w in widths if vector_aligned(region, shape, extents, w, shift)), 1)


def _nonneg_interval(iv: Interval) -> bool:
    lo = iv.lo
    return isinstance(lo, Affine) and lo.const >= 0 and all(c >= 0 for _, c in lo.terms)


def _tile_inside(iv: Interval, tile: int, size: int, cfg: GroupConfig) -> bool:
    """True if this dimension of every block's tile lies inside the tensor (no upper check)."""
    lo = iv.lo
    if not isinstance(lo, Affine) or lo.const < 0:
        return False
    # Largest origin over all blocks: each block coordinate at its last value.
    hi = lo.const + sum(c * (cfg.grid[int(v[1:])] - 1) for v, c in lo.terms if v.startswith("b") and c > 0)
    return hi + tile <= size
