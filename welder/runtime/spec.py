"""Every decision behind a generated runtime, as plain data for its templates.

Which groups are views, where each tensor lives (``memory.py``), what each launch passes,
which outputs are copies, which kernel file holds each kernel, how ``main_test`` draws each
input, what C types the interface uses: all of it is settled here, so that the templates in
``welder/codegen_templates/runtime`` only spell it out in C++ and nothing in them decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from welder.check import integer_input_bounds
from welder.codegen import (
    Kernel,
    generate_kernel,
    generate_model,
    kernel_name,
    sanitize_comment,
    sanitize_identifier,
)
from welder.codegen.cprint import STORAGE_TYPES, c_string
from welder.codegen.tensor_map import TensorMapArg
from welder.graph import Graph
from welder.ir.interpret import np_dtype
from welder.ir.views import Slab, aliased_input, concat_slabs
from welder.runtime.layout import kernel_source_name
from welder.runtime.memory import ALIGNMENT, KernelIO, MemoryPlan, Place, Storage, plan_memory
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group, execution_order
from welder.schedule.kinds.library import GemmSpec, library_call

#: C types of tensors in nnfusion_rt.h: fixed-width and CUDA-free, so the header is plain C
#: (fp16 data travels as its IEEE binary16 bits, bf16 as its bfloat16 bits).
PUBLIC_TYPES = {
    "float32": "float",
    "float64": "double",
    "float16": "uint16_t",
    "bfloat16": "uint16_t",
    "int64": "int64_t",
    "int32": "int32_t",
    "int16": "int16_t",
    "int8": "int8_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "bool": "bool",
}

#: Dynamic shared memory a kernel gets without opting in (cudaFuncSetAttribute).
DEFAULT_SMEM_LIMIT = 48 * 1024

#: The most files the kernels are split into (kernels_0.cu, ...).  nvcc's front end and host
#: compile take one translation unit on one core however many kernels it holds, so the kernels
#: go into several files that the build compiles in parallel, as many as the H100 machine has
#: cores (mobilevit_s b64 fp16, 103 kernels: 22 s to build there in one file, 11 s in 16).
KERNEL_FILES = 16
#: The fewest kernels a file holds on average: a file costs about 2-3 s of nvcc's own work
#: (the CUDA headers, the host compile) whatever it holds, so a small model's few kernels stay
#: in one or two files.
MIN_KERNELS_PER_FILE = 4

#: cuBLAS's element types for ours.
CUDA_DATA_TYPES = {"float32": "CUDA_R_32F", "float16": "CUDA_R_16F", "bfloat16": "CUDA_R_16BF"}
#: cuBLAS's compute types for the accumulation dtype (32F: exact fp32, no TF32).
CUBLAS_COMPUTE_TYPES = {"float32": "CUBLAS_COMPUTE_32F"}
#: The workspace every cuBLAS call uses: what cuBLAS recommends for Hopper (4 MiB suffices
#: before it).  One fixed buffer keeps each CUDA-graph capture from allocating its own.
CUBLAS_WORKSPACE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output as the C interface and main_test see it."""

    index: int
    name: str
    literal: str  # the name as a C string literal
    comment: str
    dtype: str
    ctype: str  # its type in nnfusion_rt.h
    shape: tuple[int, ...]
    nbytes: int
    shape_offset: int  # where its dims start in the flat shape table
    staging_offset: int  # its device copy for kernel_entry_host and measure_latency
    fill: str = "normal"  # how main_test draws it: normal, integers (below fill_high), ones, bits
    fill_high: int = 0


@dataclass(frozen=True)
class ArgSpec:
    """One pointer a launch passes: ``address`` is a byte or entry-parameter pointer."""

    ctype: str
    readonly: bool
    address: str
    nbytes: int


@dataclass(frozen=True)
class LaunchSpec:
    kind: ClassVar[str] = "kernel"
    name: str
    comment: str
    grid: int
    threads: int
    smem_bytes: int
    args: tuple[ArgSpec, ...]
    maps: tuple[TensorMapArg, ...] = ()  # CUtensorMap arguments, encoded before the launch
    group: str = ""  # the root of the plan's group it runs (tuned.json's "root")

    @property
    def needs_smem_opt_in(self) -> bool:
        return self.smem_bytes > DEFAULT_SMEM_LIMIT


@dataclass(frozen=True)
class GemmCallSpec:
    """One ``cublasGemmStridedBatchedEx`` call, in cuBLAS's column-major terms.  The row-major
    product C = A.B is C^T = B^T.A^T in column-major storage, so ``a`` is the row-major B
    and ``b`` the row-major A, and m, n are the row-major N, M.  ``a``, ``b`` and ``c`` are
    C expressions for the matrices' first elements."""

    kind: ClassVar[str] = "gemm"
    comment: str
    transa: str  # CUBLAS_OP_N or CUBLAS_OP_T
    transb: str
    m: int
    n: int
    k: int
    a: str
    lda: int
    stride_a: int
    b: str
    ldb: int
    stride_b: int
    c: str
    ldc: int
    stride_c: int
    batch: int
    data_type: str  # CUDA_R_32F, CUDA_R_16F
    compute_type: str  # CUBLAS_COMPUTE_32F
    group: str = ""  # the root of the plan's group it runs (tuned.json's "root")

    @property
    def label(self) -> str:
        """What a failure message calls it, as a C string literal."""
        dims = f"m={self.m} n={self.n} k={self.k} batch={self.batch}"
        return c_string(f"cublasGemmStridedBatchedEx for {self.comment} ({dims})")


@dataclass(frozen=True)
class CopySpec:
    """Graph output ``output`` copied from ``source`` after the kernels."""

    output: int
    source: str
    nbytes: int


@dataclass(frozen=True)
class KernelSource:
    """A generated kernel as the runtime's files hold it: defined (``source``) in a kernel
    file, and declared in nnfusion_rt.cu, which launches it, by its name, the C declarations
    of its pointer parameters and how many ``CUtensorMap`` parameters follow them."""

    name: str
    source: str
    params: tuple[str, ...]
    tensor_maps: int


@dataclass(frozen=True)
class KernelFile:
    """One kernel file (``kernels_N.cu``): a run of kernels in execution order, ``first``
    being the index of its first among all of them."""

    name: str
    first: int
    kernels: tuple[KernelSource, ...]


@dataclass(frozen=True)
class WeightSpec:
    tensor: str
    file: str  # under Constant/
    offset: int  # into the weight block
    nbytes: int


@dataclass
class RuntimeSpec:
    model: str  # safe inside a comment
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    shapes: list[int]  # every input's then every output's dims, one flat table
    steps: list[LaunchSpec | GemmCallSpec]  # in execution order
    copies: list[CopySpec]
    weights: list[WeightSpec]
    memory: MemoryPlan
    views: dict[str, str]  # view tensor -> the tensor it aliases
    kernel_files: list[KernelFile]  # every generated kernel once, in execution order
    staging_bytes: int
    cuda_arch: str | None = None
    arch_specific: bool = False  # some kernel needs the arch-specific variant (sm_90a)
    cuda_libraries: tuple[str, ...] = field(default_factory=tuple)
    cublas_workspace_bytes: int = CUBLAS_WORKSPACE_BYTES
    slabs: dict[str, tuple[str, int]] = field(default_factory=dict)  # input -> (concatenation, bytes in)

    @property
    def laid_in_place(self) -> set[str]:
        """The concatenations not launched: their inputs' kernels write into them."""
        return laid_in_place(self.slabs)

    @property
    def launches(self) -> list[LaunchSpec]:
        return [s for s in self.steps if isinstance(s, LaunchSpec)]

    @property
    def gemms(self) -> list[GemmCallSpec]:
        return [s for s in self.steps if isinstance(s, GemmCallSpec)]

    @property
    def kernels(self) -> list[KernelSource]:
        """Every generated kernel, in execution order."""
        return [k for f in self.kernel_files for k in f.kernels]

    @property
    def uses_cublas(self) -> bool:
        return "cublas" in self.cuda_libraries

    @property
    def uses_tma(self) -> bool:
        """Whether a launch encodes TMA tensor maps (the host side of welder_tma.cuh)."""
        return any(k.maps for k in self.launches)

    @property
    def pool_bytes(self) -> int:
        return self.memory.pool_bytes

    @property
    def weight_bytes(self) -> int:
        return self.memory.weight_bytes


def find_views(graph: Graph, groups: Sequence[Group]) -> dict[str, str]:
    """View tensor -> aliased tensor, for every group that is one data-preserving reshape."""
    views = {}
    for group in groups:
        if len(group.stages) != 1 or group.outputs != group.stages:
            continue
        compute = group.computes[group.stages[0]]
        source = aliased_input(compute, lambda t: graph.tensor(t).shape)
        if source is not None:
            views[compute.name] = source
    return views


def find_slabs(
    graph: Graph,
    groups: Sequence[Group],
    views: dict[str, str],
    written_as: Mapping[str, tuple[int, ...]],
) -> dict[str, tuple[str, int]]:
    """Input -> (concatenation, byte offset) for every group that is one concatenation whose
    inputs its kernels can write straight into its memory (``welder.ir.views.concat_slabs``):
    it is not launched.  An input qualifies where it is written by a launched kernel and is
    no graph input, constant, view, graph output (nor one's aliased tensor), input of
    another such concatenation, nor itself a concatenation laid out in place, and its run
    starts on the pool's alignment.  A strided input (dimensions before the axis of more
    than one element) also needs the concatenation for its only reader, a 16-byte multiple
    for its stride over them (vector stores stay aligned), and its kernel to write it at
    the concatenation's strides: ``written_as`` maps each output a kernel writes so to the
    shape it addresses it by (``KernelParam.storage``; :func:`strided_layouts` finds what
    to offer codegen as if every kernel did)."""
    return {
        slab.tensor: (whole, slab.offset * np_dtype(graph.tensor(whole).dtype).itemsize)
        for whole, slab in _laid_slabs(graph, groups, views, written_as)
    }


def strided_layouts(graph: Graph, groups: Sequence[Group]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each strided input :func:`find_slabs` would lay into its concatenation, were every
    kernel to write it so, with that concatenation and the input's storage shape: what
    codegen offers the kernels."""
    ordered = [groups[k] for k in execution_order(groups)]
    views = find_views(graph, ordered)
    laid = _laid_slabs(graph, ordered, views, None)
    return {slab.tensor: (whole, slab.storage) for whole, slab in laid if slab.strided}


def _laid_slabs(
    graph: Graph,
    groups: Sequence[Group],
    views: dict[str, str],
    written_as: Mapping[str, tuple[int, ...]] | None,
) -> list[tuple[str, Slab]]:
    exposed = set()
    for name in graph.outputs:
        exposed.add(name)
        while name in views:
            name = views[name]
            exposed.add(name)
    written = {o for g in groups if g.root not in views for o in g.outputs}
    readers: dict[str, int] = {}
    for g in groups:
        for t in g.inputs:
            readers[t] = readers.get(t, 0) + 1
    found: dict[str, list[Slab]] = {}
    for group in groups:
        if len(group.stages) != 1 or group.outputs != group.stages or group.root in views:
            continue
        slabs = concat_slabs(group.computes[group.stages[0]], lambda t: graph.tensor(t).shape)
        if slabs is not None:
            found[group.root] = slabs
    taken: set[str] = set()
    laid = []
    for whole, slabs in found.items():
        size = np_dtype(graph.tensor(whole).dtype).itemsize

        def fits(slab: Slab, size: int = size) -> bool:
            if not slab.strided:
                return True
            stride = math.prod(slab.storage[slab.axis :]) * size
            return (
                readers.get(slab.tensor) == 1
                and stride % 16 == 0
                and (written_as is None or written_as.get(slab.tensor) == slab.storage)
            )

        if any(
            slab.tensor not in written
            or slab.tensor in views
            or slab.tensor in exposed
            or slab.tensor in taken
            or slab.tensor in found
            or slab.tensor in graph.constants
            or slab.offset * size % ALIGNMENT
            or not fits(slab)
            for slab in slabs
        ):
            continue
        taken.update(slab.tensor for slab in slabs)
        laid.extend((whole, slab) for slab in slabs)
    return laid


def generate_laid_out(graph: Graph, groups: Sequence[tuple[Group, GroupConfig]]) -> list[Kernel]:
    """:func:`~welder.codegen.generate_model`'s kernels, those writing a strided input of a
    concatenation laid out in place writing it at the concatenation's strides.  Offered the
    layouts of :func:`strided_layouts`, a stage that cannot store at other strides declines
    (``KernelParam.storage`` stays None); the concatenation is then launched after all, and
    the kernels that took the offer for its other inputs are generated again without it."""
    offers = strided_layouts(graph, [g for g, _ in groups])
    kernels = generate_model(graph, groups, {t: storage for t, (_, storage) in offers.items()})
    taken = {p.tensor for k in kernels for p in k.params if p.is_output and p.storage}
    refused = {offers[t][0] for t in offers if t not in taken}
    if not refused:
        return kernels
    kept = {t: storage for t, (whole, storage) in offers.items() if whole not in refused}
    again = taken - set(kept)
    generated = [(k, g, cfg) for k, (g, cfg) in enumerate(groups) if cfg.kernel]
    return [
        generate_kernel(graph, g, cfg, kernel_name(k, g), kept) if again & set(g.outputs) else kernel
        for (k, g, cfg), kernel in zip(generated, kernels)
    ]


def laid_in_place(slabs: dict[str, tuple[str, int]]) -> set[str]:
    """The concatenations whose inputs ``slabs`` (:func:`find_slabs`) lays into them."""
    return {whole for whole, _ in slabs.values()}


def runtime_spec(
    graph: Graph,
    groups_with_configs: Sequence[tuple[Group, GroupConfig]],
    kernels: Sequence[Kernel],
    cuda_arch: str | None = None,
    cuda_libraries: Sequence[str] = (),
) -> RuntimeSpec:
    """The runtime for ``graph`` scheduled as ``groups_with_configs``: one kernel of ``kernels``
    per generated group, in the same order, and one cuBLAS call per library group (its
    library stage's GEMM); view groups run nothing.  A runtime that calls cuBLAS links it."""
    generated = [g for g, cfg in groups_with_configs if cfg.kernel]
    if len(generated) != len(kernels):
        raise ValueError(f"{len(generated)} generated groups but {len(kernels)} kernels (one per group)")
    kernel_of = {g.root: k for g, k in zip(generated, kernels)}
    order = execution_order([g for g, _ in groups_with_configs])
    ordered = [groups_with_configs[k] for k in order]
    views = find_views(graph, [g for g, _ in ordered])
    written_as = {p.tensor: p.storage for k in kernels for p in k.params if p.is_output and p.storage}
    slabs = find_slabs(graph, [g for g, _ in ordered], views, written_as)
    stray = sorted(set(written_as) - set(slabs))
    if stray:
        raise ValueError(
            f"the kernels write {stray} at a concatenation's strides, but the runtime does not lay "
            "that concatenation out in place (generate the kernels with generate_laid_out)"
        )
    laid = laid_in_place(slabs)
    kept = [(g, cfg) for g, cfg in ordered if g.root not in views and g.root not in laid]
    runs = [_run(cfg, kernel_of.get(g.root)) for g, cfg in kept]
    memory = plan_memory(graph, [_io(r) for r in runs], views, slabs=slabs)
    inputs, outputs, shapes, staging_bytes = _interface(graph)
    libraries = [*cuda_libraries, *(["cublas"] if any(isinstance(r, GemmSpec) for r in runs) else [])]
    return RuntimeSpec(
        model=sanitize_comment(graph.name),
        inputs=inputs,
        outputs=outputs,
        shapes=shapes,
        steps=[replace(step, group=g.root) for (g, _), r in zip(kept, runs) for step in _steps(r, memory)],
        copies=[CopySpec(c.output, _address(c.source), c.nbytes) for c in memory.copies if c.nbytes > 0],
        weights=[_weight(k, name, offset, graph) for k, (name, offset) in enumerate(memory.weights.items())],
        memory=memory,
        views=views,
        slabs=slabs,
        kernel_files=kernel_files([r for r in runs if isinstance(r, Kernel)]),
        arch_specific=any(r.arch_specific for r in runs if isinstance(r, Kernel)),
        staging_bytes=staging_bytes,
        cuda_arch=cuda_arch,
        cuda_libraries=tuple(dict.fromkeys(libraries)),
    )


def split_kernels(
    sizes: Sequence[int], files: int = KERNEL_FILES, per_file: int = MIN_KERNELS_PER_FILE
) -> list[range]:
    """Kernels ``0 .. len(sizes) - 1``, whose sources are ``sizes`` characters long, cut into
    contiguous runs, one per kernel file: at most ``files`` runs and at most one per
    ``per_file`` kernels (one run if there are fewer), cut so that the longest run is as short
    as it can be.

    The build compiles the files in parallel, so it waits for the longest.  Runs keep the
    execution order, so a file reads like a stretch of the model; and the cut depends on the
    kernels alone, never on the machine, so emitting the same plan gives the same folder."""
    count = len(sizes)
    if count == 0:
        return []
    most = max(1, min(files, count // per_file))

    def runs(limit: int) -> list[range]:
        """The fewest runs whose lengths stay within ``limit`` (or hold one kernel longer)."""
        cuts, start, total = [], 0, 0
        for k, size in enumerate(sizes):
            if k > start and total + size > limit:
                cuts.append(range(start, k))
                start, total = k, 0
            total += size
        return [*cuts, range(start, count)]

    low, high = max(sizes), sum(sizes)
    while low < high:  # the least limit that needs at most `most` runs
        middle = (low + high) // 2
        if len(runs(middle)) <= most:
            high = middle
        else:
            low = middle + 1
    return runs(low)


def kernel_files(kernels: Sequence[Kernel]) -> list[KernelFile]:
    """``kernels`` (in execution order) as the runtime's kernel files, cut by
    :func:`split_kernels` on the lengths of their sources."""
    sources = [
        KernelSource(k.name, k.source, tuple(p.decl for p in k.params), len(k.tensor_maps)) for k in kernels
    ]
    return [
        KernelFile(kernel_source_name(n), run.start, tuple(sources[run.start : run.stop]))
        for n, run in enumerate(split_kernels([len(k.source) for k in sources]))
    ]


def _run(cfg: GroupConfig, kernel: Kernel | None) -> Kernel | GemmSpec:
    """What the runtime runs for a group: its generated kernel, or its library call."""
    if cfg.kernel:
        assert kernel is not None
        return kernel
    call = library_call(cfg)
    if call is None:
        kinds = sorted({st.kind for st in cfg.stages})
        raise ValueError(f"group {cfg.root}: the runtime cannot run stages of kind {kinds} outside a kernel")
    return call.gemm


def _io(run: Kernel | GemmSpec) -> KernelIO:
    """The tensors one launch or library call reads and writes."""
    if isinstance(run, GemmSpec):
        return KernelIO(tuple(dict.fromkeys((run.a, run.b))), (run.c,))
    return KernelIO(
        tuple(p.tensor for p in run.params if not p.is_output),
        tuple(p.tensor for p in run.params if p.is_output),
    )


def _interface(graph: Graph) -> tuple[list[TensorSpec], list[TensorSpec], list[int], int]:
    """Inputs and outputs of the C interface, the flat shape table and the staging size."""
    bounds = integer_input_bounds(graph)
    shapes: list[int] = []
    staging = 0

    def spec(index: int, name: str, fill: str = "normal", high: int = 0) -> TensorSpec:
        nonlocal staging
        info = graph.tensor(name)
        if info.dtype not in PUBLIC_TYPES:
            raise ValueError(f"tensor {name!r} has dtype {info.dtype}, which the runtime cannot pass")
        t = TensorSpec(
            index,
            name,
            c_string(name),
            sanitize_comment(name),
            info.dtype,
            PUBLIC_TYPES[info.dtype],
            info.shape,
            info.nbytes,
            len(shapes),
            staging,
            fill,
            high,
        )
        shapes.extend(info.shape)
        staging += _aligned(info.nbytes)
        return t

    inputs = []
    for k, t in enumerate(graph.inputs):
        fill, high = _fill(t.name, t.dtype, bounds)
        inputs.append(spec(k, t.name, fill, high))
    outputs = [spec(k, name) for k, name in enumerate(graph.outputs)]
    return inputs, outputs, shapes, staging


def _fill(name: str, dtype: str, bounds: dict[str, int]) -> tuple[str, int]:
    """How main_test draws an input: the rules of ``welder.check.random_inputs``."""
    if "mask" in name.lower():
        return "ones", 0
    if dtype == "bool":
        return "bits", 0
    if np_dtype(dtype).kind in "iu":
        return "integers", bounds.get(name, 2)
    return "normal", 0


def _weight(k: int, name: str, offset: int, graph: Graph) -> WeightSpec:
    """Constant ``name``, number ``k``: a file name that is unique, readable and safe anywhere."""
    return WeightSpec(name, f"{k:04d}_{sanitize_identifier(name, 64)}.bin", offset, graph.tensor(name).nbytes)


def _launch(kernel: Kernel, memory: MemoryPlan) -> LaunchSpec:
    args = []
    for p in kernel.params:
        nbytes = p.span * np_dtype(p.dtype).itemsize
        args.append(ArgSpec(STORAGE_TYPES[p.dtype], not p.is_output, _address(memory[p.tensor]), nbytes))
    return LaunchSpec(
        kernel.name,
        sanitize_comment(kernel.root),
        kernel.grid,
        kernel.threads,
        kernel.smem_bytes,
        tuple(args),
        tuple(kernel.tensor_maps),
    )


def _steps(run: Kernel | GemmSpec, memory: MemoryPlan) -> list[LaunchSpec | GemmCallSpec]:
    return [_launch(run, memory)] if isinstance(run, Kernel) else _gemm_calls(run, memory)


def _gemm_calls(gemm: GemmSpec, memory: MemoryPlan) -> list[GemmCallSpec]:
    """The cuBLAS calls for ``gemm``, one per outer index: row-major operands swapped into
    column-major ones."""
    size = np_dtype(gemm.dtype).itemsize
    return [
        _gemm_call(gemm, memory, o * gemm.outer_a * size, o * gemm.outer_b * size, o * gemm.outer_c * size)
        for o in range(gemm.outer)
    ]


def _gemm_call(gemm: GemmSpec, memory: MemoryPlan, at_a: int, at_b: int, at_c: int) -> GemmCallSpec:
    size = np_dtype(gemm.dtype).itemsize
    return GemmCallSpec(
        comment=sanitize_comment(gemm.c),
        transa="CUBLAS_OP_T" if gemm.trans_b else "CUBLAS_OP_N",
        transb="CUBLAS_OP_T" if gemm.trans_a else "CUBLAS_OP_N",
        m=gemm.n,
        n=gemm.m,
        k=gemm.k,
        a=_address(memory[gemm.b], gemm.offset_b * size + at_b),
        lda=gemm.ldb,
        stride_a=gemm.stride_b,
        b=_address(memory[gemm.a], gemm.offset_a * size + at_a),
        ldb=gemm.lda,
        stride_b=gemm.stride_a,
        c=_address(memory[gemm.c], at_c),
        ldc=gemm.ldc,
        stride_c=gemm.stride_c,
        batch=gemm.batch,
        data_type=CUDA_DATA_TYPES[gemm.dtype],
        compute_type=CUBLAS_COMPUTE_TYPES[gemm.compute_dtype],
    )


def _address(storage: Storage, extra_bytes: int = 0) -> str:
    """The C expression for where a tensor lives (names as in nnfusion_rt.cu.j2), plus
    ``extra_bytes`` (then a byte pointer: the interface's pointers are typed)."""
    if storage.place in (Place.INPUT, Place.OUTPUT):
        name = f"{'in' if storage.place is Place.INPUT else 'out'}{storage.index}"
        qualifier = "const " if storage.place is Place.INPUT else ""
        at = storage.offset + extra_bytes  # an output's offset: an input of it laid in place
        return f"reinterpret_cast<{qualifier}unsigned char*>({name}) + {at}" if at else name
    base = "g_weights" if storage.place is Place.WEIGHT else "g_pool"
    offset = storage.offset + extra_bytes
    return f"{base} + {offset}" if offset else base


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
