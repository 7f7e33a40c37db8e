"""The library kernel kind: matrix products that a vendor library computes instead of a
generated kernel (``--skip-dot``).  Its stage config is :class:`LibraryConfig`; its
"template" is the call the runtime makes (``codegen_templates/runtime/cublas.j2``), so
codegen renders no kernel for it.

A product is recognised in the IR, not by operator name: a ``sum`` reduction of fp32, fp16 or bf16
whose body is the product of two loads, ``C[...] = sum_r A[...] * B[...]``, where the flat
row-major offset of every operand is affine in the axes -- so MatMul (batched, broadcast,
1-D), Gemm with transposes and Einsum contractions like ``bhid,bhjd->bhij`` all qualify.
:func:`match_gemm` proves the affinity exactly (per independent group of axes, as
``welder.ir.views`` does for reshapes) and describes the product as a
:class:`GemmSpec`: batch, M, N, K, transposes, leading dimensions,
batch strides (0 for a broadcast operand) and offsets.

Operands that are *movement* computes -- a transpose, reshape, squeeze, slice or expand,
whose body is one plain load -- are read through: the product's group absorbs the chain of
such producers that feed only it, and the GEMM addresses the tensor underneath with strides.
If that addressing is not a strided batched matrix, the moved operand is read as a tensor of
its own instead -- but only where the movement starts from a computing node (a bias add),
whose kernel then writes the moved layout at no extra cost.  Otherwise (a transpose of a
GEMM's output that interleaves the reduction axis, say) the product stays a generated
kernel, where the movement costs nothing.  Any other producer (a bias add, a normalisation)
is an ordinary tensor the GEMM reads.

Movement *after* a product is written through the same way: when the product's only
consumer is a chain of movement computes (attention's ``ctx [B, heads, S, d] -> [B, S,
heads * d]`` before the output projection), the group absorbs the chain and the GEMM writes
the moved layout directly, through its output's leading dimension and batch stride -- the
batch's matrices may then sit side by side inside each row.  That spares the consumer both
the copy kernel and the unaddressable read.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from welder.arch import Arch
from welder.graph import Graph
from welder.ir.compute import Compute
from welder.ir.expr import INDEX, Binary, Load, row_major_offset, walk
from welder.ir.interpret import evaluate, np_dtype
from welder.ir.layout import MAX_PROOF_POINTS, affine_layout, affine_strides, row_major_strides
from welder.schedule.config import Estimate, GroupConfig, StageConfig
from welder.schedule.group import Group, make_group
from welder.schedule.kinds.base import LAUNCH_OVERHEAD_US, ScheduleContext

#: Element types the library computes (inputs and output alike; products accumulate in fp32).
GEMM_DTYPES = frozenset({"float32", "float16", "bfloat16"})
#: Most library calls one product may take when its batch is two axes no single stride spans
#: (windows x heads): one strided batched call per index of the outer axis.
MAX_OUTER_CALLS = 16

ShapeOf = Callable[[str], tuple[int, ...]]


@dataclass(frozen=True)
class GemmSpec:
    """A group that one strided batched matrix product of a vendor library computes:
    ``C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]`` for ``b < batch``, in row-major terms.

    Element ``(b, m, k)`` of A is at ``offset_a + b * stride_a + m * lda + k`` in tensor ``a``
    (``k * lda + m`` when ``trans_a``: A is stored as K x M); element ``(b, k, n)`` of B at
    ``offset_b + b * stride_b + k * ldb + n`` (``n * ldb + k`` when ``trans_b``); C is the
    group's output, ``b * stride_c + m * ldc + n``.  Units are elements; a batch stride of 0
    broadcasts that operand over the batch.  A, B and C share ``dtype``; products accumulate
    in ``compute_dtype``.

    A batch that no single stride spans (windows x heads) takes ``outer`` such calls, call
    ``o`` with every address moved by ``o * outer_a``, ``o * outer_b``, ``o * outer_c``.
    """

    a: str
    b: str
    c: str
    batch: int
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    offset_a: int
    offset_b: int
    dtype: str
    compute_dtype: str = "float32"
    library: str = "cublas"
    outer: int = 1
    outer_a: int = 0
    outer_b: int = 0
    outer_c: int = 0


@dataclass
class LibraryConfig(StageConfig):
    """A group computed by vendor library calls: the one stage of its group, ``node`` being
    the group's root (the GEMM's output)."""

    kind: ClassVar[str] = "library"
    in_kernel: ClassVar[bool] = False

    gemm: GemmSpec

    def renamed(self, names: Mapping[str, str]) -> LibraryConfig:
        def n(x: str) -> str:
            return names.get(x, x)

        gemm = replace(self.gemm, a=n(self.gemm.a), b=n(self.gemm.b), c=n(self.gemm.c))
        return replace(self, node=n(self.node), gemm=gemm)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LibraryConfig:
        return cls(d["node"], GemmSpec(**d["gemm"]))


def library_call(cfg: GroupConfig) -> LibraryConfig | None:
    """The library stage of a group that is one library call, None for a generated kernel."""
    stage = cfg.stages[0] if len(cfg.stages) == 1 else None
    return stage if isinstance(stage, LibraryConfig) else None


class LibraryKind:
    """The rule: a group whose first stage is a product the library computes -- read through
    movement inlined into it, written through the group's other stage, if any -- is one GEMM
    (or a few at fixed strides apart); any other group is not this kind's."""

    name = "library"
    config_type = LibraryConfig

    def propose(self, group: Group, ctx: ScheduleContext) -> list[GroupConfig] | None:
        gemm = gemm_of(group, ctx.shape_of)
        return None if gemm is None else [library_config(group, gemm, ctx.arch)]


KIND = LibraryKind()


@dataclass(frozen=True)
class LibraryGroup:
    """A group run by one library call: the product, the movement nodes it reads through,
    and its config (no tiling, the GEMM description, the library's estimated time)."""

    group: Group
    config: GroupConfig

    @property
    def gemm(self) -> GemmSpec:
        stage = library_call(self.config)
        assert stage is not None
        return stage.gemm

    @property
    def latency_us(self) -> float:
        return self.config.estimate.latency_us


def find_gemm_groups(graph: Graph, arch: Arch) -> list[LibraryGroup]:
    """Every matrix product of ``graph`` that the library can compute, as its own group, in
    topological order.  The groups are disjoint: an absorbed movement node feeds one product
    (before it or after it), and a node one group took is a plain tensor to the later ones."""
    found: list[LibraryGroup] = []
    taken: set[str] = set()
    for node in graph.topo_order():
        matched = None if node.name in taken else product_group(graph, node.name, frozenset(taken))
        if matched is not None:
            found.append(LibraryGroup(matched[0], library_config(matched[0], matched[1], arch)))
            taken.update(matched[0].members)
    return found


def product_group(
    graph: Graph, name: str, taken: frozenset[str] = frozenset()
) -> tuple[Group, GemmSpec] | None:
    """The group that computes node ``name`` as one GEMM (the node, the movement nodes it
    reads through and those it writes through) and that GEMM, or None if the library cannot
    compute the node.  Nodes in ``taken`` belong to other groups and are never absorbed."""
    if not _is_product(graph.nodes[name].compute):
        return None
    # Writing the movement after the product through matters most (it spares a kernel and
    # frees the next product), then one call rather than several.
    choices = _member_choices(graph, name, taken)
    for chain in _written_through(graph, name, taken):
        for max_outer, members in itertools.product((1, MAX_OUTER_CALLS), choices):
            group = make_group(graph, members | set(chain))
            if group.stages[0] != name:
                continue
            gemm = gemm_of(group, _shapes(graph), (max_outer,))
            if gemm is not None:
                return group, gemm
    return None


def gemm_of(
    group: Group, shape_of: ShapeOf, max_outer: Sequence[int] = (1, MAX_OUTER_CALLS)
) -> GemmSpec | None:
    """``group`` as library calls, or None: its first stage must be a product and its only
    other stage, if any, the root writing that product through movement.  Each limit of
    ``max_outer`` on the calls one product may take is tried in turn (by default one strided
    batched call first, then a few)."""
    name, out = group.stages[0], group.root
    if group.stages != tuple(dict.fromkeys((name, out))):
        return None
    layout = _output_strides(group, name, out)
    if layout is None:
        return None
    for outer in max_outer:
        gemm = match_gemm(group.computes[name], shape_of, out, layout, outer)
        if gemm is not None:
            return gemm
    return None


def _shapes(graph: Graph) -> ShapeOf:
    return lambda t: graph.tensor(t).shape


def _member_choices(graph: Graph, name: str, taken: frozenset[str]) -> list[set[str]]:
    """The product with the movement it reads through; failing that, the product alone when
    every moved operand starts from a computing node, whose kernel can write the moved layout
    at no cost (BERT at batch > 1: the heads of [B, S, H] are no single batch stride, but the
    bias add can write them as [B, heads, S, d]).  A movement starting from a GEMM, an input or a
    weight would need a copy kernel: that product stays generated -- unless the GEMM before
    already wrote the moved layout (``taken``), which makes it a plain tensor here."""
    absorbed = absorbed_movement(graph, name, taken)
    if absorbed == {name} or not all(_moved_cheaply(graph, t, taken) for t in graph.nodes[name].inputs):
        return [absorbed]
    return [absorbed, {name}]


def _moved_cheaply(graph: Graph, tensor: str, taken: frozenset[str]) -> bool:
    """``tensor`` is no movement (or one another group writes), or a movement of a computing
    (injective, non-movement) node."""
    if not _is_free_movement(graph, tensor, taken):
        return True
    while _is_free_movement(graph, tensor, taken):
        tensor = graph.nodes[tensor].inputs[0]
    node = graph.nodes.get(tensor)
    return node is not None and node.compute.is_injective


def _is_free_movement(graph: Graph, tensor: str, taken: frozenset[str]) -> bool:
    return tensor in graph.nodes and tensor not in taken and is_movement(graph.nodes[tensor].compute)


def _written_through(graph: Graph, product: str, taken: frozenset[str]) -> list[list[str]]:
    """The chains of movement nodes ``product`` could write through, longest first and ending
    with the empty chain: each link is the only consumer of the tensor before it, which is
    no graph output (the chain's last tensor may be one)."""
    chain: list[str] = []
    tensor = product
    while tensor not in graph.outputs:
        consumers = graph.consumers(tensor)
        if len(consumers) != 1:
            break
        node = consumers[0]
        if node.name in taken or tuple(node.inputs) != (tensor,) or not is_movement(node.compute):
            break
        chain.append(node.name)
        tensor = node.name
    return [chain[:k] for k in range(len(chain), -1, -1)]


def _output_strides(group: Group, product: str, out: str) -> list[int] | None:
    """Where each element of ``product`` lands in the group's output ``out``, as one stride
    per axis of ``product`` (row-major strides when ``out`` is the product itself); None
    unless the written-through movement is a permutation of the elements, affine in the
    product's axes and starting at offset 0.

    The stage ``out`` has the chain inlined: one load of ``product`` at composed indices, whose
    flat offset over the output's points gives, inverted, each product element's place."""
    compute = group.computes[product]
    if out == product:
        return row_major_strides(compute.shape)
    stage = group.computes[out]
    size = math.prod(compute.shape)
    if not isinstance(stage.body, Load) or stage.body.tensor != product or math.prod(stage.shape) != size:
        return None
    if size > MAX_PROOF_POINTS:
        return None
    flat = row_major_offset(stage.body.indices, compute.shape)
    landed = np.asarray(evaluate(Compute("gemm_output", stage.axes, flat, INDEX), {}), dtype=np.int64)
    landed = np.broadcast_to(landed, stage.shape).reshape(-1)
    if not np.array_equal(np.sort(landed), np.arange(size)):
        return None
    where = np.empty(size, dtype=np.int64)
    where[landed] = np.arange(size)
    found = affine_strides(where.reshape(compute.shape), compute.axes, 0)
    return None if found is None else [found[a.name] for a in compute.axes]


def absorbed_movement(graph: Graph, product: str, taken: frozenset[str] = frozenset()) -> set[str]:
    """``product`` plus the movement nodes it reads through: each feeds only nodes already
    absorbed and is not a graph output, so inlining it into the product frees its buffer."""
    members = {product}
    grown = True
    while grown:
        grown = False
        candidates = {t for m in members for t in graph.nodes[m].inputs if t in graph.nodes} - members
        for t in sorted(candidates):
            if t in taken or not is_movement(graph.nodes[t].compute) or t in graph.outputs:
                continue
            if all(c.name in members for c in graph.consumers(t)):
                members.add(t)
                grown = True
    return members


def is_movement(c: Compute) -> bool:
    """An injective compute that only moves data: one plain load of a tensor of its own
    dtype at data-independent indices (transpose, reshape, squeeze, slice, expand)."""
    body = c.body
    return (
        c.is_injective
        and isinstance(body, Load)
        and body.dtype == c.dtype
        and not any(isinstance(e, Load) for i in body.indices for e in walk(i))
    )


def _is_product(c: Compute) -> bool:
    """A sum of products of two different loads (a sum of squares is a norm, not a GEMM)."""
    body = c.body
    return (
        c.reduce_op == "sum"
        and c.dtype in GEMM_DTYPES
        and isinstance(body, Binary)
        and body.op == "mul"
        and isinstance(body.a, Load)
        and isinstance(body.b, Load)
        and body.a != body.b
    )


# -- matching ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dim:
    """One GEMM dimension: its extent and its stride in A, B and C (elements, 0 if absent)."""

    extent: int
    a: int
    b: int
    c: int


def match_gemm(
    c: Compute,
    shape_of: ShapeOf,
    out: str | None = None,
    out_strides: Sequence[int] | None = None,
    max_outer: int = 1,
) -> GemmSpec | None:
    """``c`` as one strided batched GEMM -- or up to ``max_outer`` of them at fixed strides
    apart -- or None.  ``c`` must read its operands directly (movement producers already
    inlined); ``shape_of`` gives the shapes of the tensors it loads.  The output is tensor
    ``out`` (default ``c`` itself), where element ``i`` of ``c`` sits at ``sum(i * out_strides)``
    (default row-major)."""
    if not _is_product(c) or 0 in c.shape or any(a.extent == 0 for a in c.reduce_axes):
        return None
    assert isinstance(c.body, Binary) and isinstance(c.body.a, Load) and isinstance(c.body.b, Load)
    axes = (*c.axes, *c.reduce_axes)
    first = affine_layout(c.body.a, shape_of(c.body.a.tensor), axes)
    second = affine_layout(c.body.b, shape_of(c.body.b.tensor), axes)
    if first is None or second is None:
        return None
    out_strides = row_major_strides(c.shape) if out_strides is None else out_strides
    spatial = [
        _Dim(a.extent, first[1][a.name], second[1][a.name], out_strides[k])
        for k, a in enumerate(c.axes)
        if a.extent > 1
    ]
    reduce = [_Dim(a.extent, first[1][a.name], second[1][a.name], 0) for a in c.reduce_axes if a.extent > 1]
    if any(d.a == 0 or d.b == 0 for d in reduce):
        return None  # a broadcast along the reduction is not a matrix product
    # The operand carrying the output's innermost axis is B (its N); C = A.B then needs no
    # transposed output.  Swapping the loads is exact: the product commutes.
    loads, layouts = (c.body.a, c.body.b), (first, second)
    if spatial and spatial[-1].a != 0 and spatial[-1].b == 0:
        loads, layouts = loads[::-1], layouts[::-1]
        spatial = [_Dim(d.extent, d.b, d.a, d.c) for d in spatial]
        reduce = [_Dim(d.extent, d.b, d.a, d.c) for d in reduce]
    dims = _gemm_dims(spatial, reduce, max_outer)
    if dims is None or dims[2].extent == dims[3].extent == 1:
        return None  # dot products reuse nothing: a reduction kernel that fuses serves them better
    return _describe(out or c.name, loads, (layouts[0][0], layouts[1][0]), *dims, c.dtype)


def _gemm_dims(
    spatial: list[_Dim], reduce: list[_Dim], max_outer: int
) -> tuple[_Dim, _Dim, _Dim, _Dim, _Dim] | None:
    """(outer, batch, M, N, K): N from the B-only axes ending at the output's innermost axis,
    M from the A-only axes, each merged outwards while they stay one strided dimension; every
    other output axis is batch (broadcast where one operand lacks it), split into a batch and
    an outer loop of calls when no single stride spans it."""
    n_axes = _merge_run(spatial, lambda d: d.b != 0 and d.a == 0, start=len(spatial) - 1)
    rest = [d for k, d in enumerate(spatial) if k not in n_axes[1]]
    a_only = [k for k, d in enumerate(rest) if d.a != 0 and d.b == 0]
    m_axes = _merge_run(rest, lambda d: d.a != 0 and d.b == 0, start=a_only[-1] if a_only else -1)
    batch = [d for k, d in enumerate(rest) if k not in m_axes[1]]
    split = _split_batch(batch, max_outer)
    merged_k = _merge(reduce)
    if split is None or merged_k is None:
        return None
    return split[0], split[1], m_axes[0], n_axes[0], merged_k


def _split_batch(batch: list[_Dim], max_outer: int) -> tuple[_Dim, _Dim] | None:
    """(outer, inner): the batch axes as one strided batch (outer of extent 1), or else split
    into two that each merge, with the fewest outer calls, at most ``max_outer``."""
    merged = _merge(batch)
    if merged is not None:
        return _Dim(1, 0, 0, 0), merged
    best: tuple[_Dim, _Dim] | None = None
    for mask in range(1, (1 << len(batch)) - 1):
        outer = _merge([d for k, d in enumerate(batch) if mask >> k & 1])
        inner = _merge([d for k, d in enumerate(batch) if not mask >> k & 1])
        if outer is None or inner is None or outer.extent > max_outer:
            continue
        if best is None or outer.extent < best[0].extent:
            best = (outer, inner)
    return best


def _merge_run(dims: list[_Dim], belongs: Callable[[_Dim], bool], start: int) -> tuple[_Dim, set[int]]:
    """The dimension ``dims[start]`` merged with the axes just outside it that also belong
    and keep one stride in every operand; (extent 1, no axes) when ``start`` does not belong."""
    if start < 0 or not belongs(dims[start]):
        return _Dim(1, 0, 0, 0), set()
    merged, used = dims[start], {start}
    for k in range(start - 1, -1, -1):
        joined = _join(dims[k], merged)
        if not belongs(dims[k]) or joined is None:
            break
        merged = joined
        used.add(k)
    return merged, used


def _merge(dims: list[_Dim]) -> _Dim | None:
    """All of ``dims`` (outermost first) as one strided dimension, or None."""
    merged = _Dim(1, 0, 0, 0)
    for d in reversed(dims):
        joined = _join(d, merged) if merged.extent > 1 else d
        if joined is None:
            return None
        merged = joined
    return merged


def _join(outer: _Dim, inner: _Dim) -> _Dim | None:
    """``outer`` and ``inner`` as one dimension: in each operand the outer stride must step
    over the whole inner extent (or both be 0: broadcast)."""
    for so, si in ((outer.a, inner.a), (outer.b, inner.b), (outer.c, inner.c)):
        if so != si * inner.extent:
            return None
    return _Dim(outer.extent * inner.extent, inner.a, inner.b, inner.c)


def _describe(
    out: str,
    loads: tuple[Load, Load],
    offsets: tuple[int, int],
    outer: _Dim,
    batch: _Dim,
    m: _Dim,
    n: _Dim,
    k: _Dim,
    dtype: str,
) -> GemmSpec | None:
    """The GemmSpec, if every matrix is row-major or transposed with unit stride inside."""
    a = _matrix(m.extent, m.a, k.extent, k.a)
    b = _matrix(k.extent, k.b, n.extent, n.b)
    out_ld = _row_major_ld(m.extent, m.c, n.extent, n.c)
    single = batch.extent == 1
    if a is None or b is None or out_ld is None or not _disjoint_outputs(batch, m.extent, n.extent, out_ld):
        return None
    return GemmSpec(
        a=loads[0].tensor,
        b=loads[1].tensor,
        c=out,
        batch=batch.extent,
        m=m.extent,
        n=n.extent,
        k=k.extent,
        trans_a=a[0],
        trans_b=b[0],
        lda=a[1],
        ldb=b[1],
        ldc=out_ld,
        stride_a=0 if single else batch.a,
        stride_b=0 if single else batch.b,
        stride_c=m.extent * out_ld if single else batch.c,
        offset_a=offsets[0],
        offset_b=offsets[1],
        dtype=dtype,
        outer=outer.extent,
        outer_a=outer.a,
        outer_b=outer.b,
        outer_c=outer.c,
    )


def _disjoint_outputs(batch: _Dim, rows: int, cols: int, ld: int) -> bool:
    """The batch's output matrices share no element: stacked one after another, or side by
    side within each row (the heads of attention written as ``[S, heads * d]``)."""
    if batch.extent == 1 or batch.c >= rows * ld:
        return True
    return batch.c >= cols and (batch.extent - 1) * batch.c + cols <= ld


def _matrix(rows: int, row_stride: int, cols: int, col_stride: int) -> tuple[bool, int] | None:
    """(transposed, leading dimension) of a rows x cols matrix, or None if it is neither
    row-major nor column-major with unit stride inside."""
    ld = _row_major_ld(rows, row_stride, cols, col_stride)
    if ld is not None:
        return False, ld
    ld = _row_major_ld(cols, col_stride, rows, row_stride)
    return None if ld is None else (True, ld)


def _row_major_ld(rows: int, row_stride: int, cols: int, col_stride: int) -> int | None:
    """The leading dimension if elements ``(r, c)`` sit at ``r * ld + c`` with ``ld >= cols``
    (what BLAS requires); a dimension of extent 1 takes any stride."""
    if cols > 1 and col_stride != 1:
        return None
    if rows == 1:
        return max(1, cols)
    return row_stride if row_stride >= max(1, cols) else None


# -- affine addressing --------------------------------------------------------------------------


# -- the config ---------------------------------------------------------------------------------


def library_config(group: Group, gemm: GemmSpec, arch: Arch) -> GroupConfig:
    """The config of a library group: no tiling, one library stage, and an estimate of its
    time as the roofline of its arithmetic and its compulsory traffic (the library picks its
    own tiles)."""
    return GroupConfig(
        root=group.root,
        block_tile=(),
        grid=(),
        block_order=(),
        threads=0,
        stages=[LibraryConfig(group.root, gemm)],
        smem_bytes=0,
        estimate=gemm_estimate(gemm, arch),
    )


def gemm_estimate(gemm: GemmSpec, arch: Arch) -> Estimate:
    """Roofline time of a product's GEMM calls: max(flops / peak, bytes / DRAM bandwidth) plus
    a launch per call."""
    size = np_dtype(gemm.dtype).itemsize
    read = size * (
        _batches(gemm.stride_a, gemm.batch) * _batches(gemm.outer_a, gemm.outer) * gemm.m * gemm.k
        + _batches(gemm.stride_b, gemm.batch) * _batches(gemm.outer_b, gemm.outer) * gemm.k * gemm.n
    )
    write = size * gemm.outer * gemm.batch * gemm.m * gemm.n
    flops = 2 * gemm.outer * gemm.batch * gemm.m * gemm.n * gemm.k
    peak_tflops = arch.fp16_tc_tflops if gemm.dtype in ("float16", "bfloat16") else arch.fp32_tflops
    compute_us = flops / (peak_tflops * 1e6)
    memory_us = (read + write) / (arch.global_bw_gbs * 1e3)
    return Estimate(
        blocks=0,
        blocks_per_sm=0,
        waves=0,
        read_bytes=read,
        write_bytes=write,
        compulsory_bytes=read + write,
        flops=flops,
        smem_bytes=0,
        regs_per_thread=0,
        latency_us=max(compute_us, memory_us) + gemm.outer * LAUNCH_OVERHEAD_US,
    )


def _batches(stride: int, batch: int) -> int:
    """How many distinct matrices an operand holds: one when broadcast over the batch."""
    return batch if stride else 1
