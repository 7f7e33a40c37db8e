"""Every decision behind a generated runtime, as plain data for its templates.

Which groups are views, where each tensor lives (``memory.py``), what each launch passes,
which outputs are copies, how ``main_test`` draws each input, what C types the interface
uses: all of it is settled here, so that the templates in ``codegen_templates/runtime``
only spell it out in C++ and nothing in them decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from welder.check import integer_input_bounds
from welder.codegen.cprint import STORAGE_TYPES
from welder.codegen.kernel import Kernel, sanitize_comment, sanitize_identifier
from welder.graph import Graph
from welder.ir.expr import Load
from welder.ir.interpret import np_dtype
from welder.runtime.memory import ALIGNMENT, KernelIO, MemoryPlan, Place, Storage, plan_memory
from welder.runtime.views import is_view
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group, execution_order

#: C types of tensors in nnfusion_rt.h: fixed-width and CUDA-free, so the header is plain C
#: (fp16 data travels as its IEEE binary16 bits).
PUBLIC_TYPES = {
    "float32": "float",
    "float64": "double",
    "float16": "uint16_t",
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
    name: str
    comment: str
    grid: int
    threads: int
    smem_bytes: int
    args: tuple[ArgSpec, ...]

    @property
    def needs_smem_opt_in(self) -> bool:
        return self.smem_bytes > DEFAULT_SMEM_LIMIT


@dataclass(frozen=True)
class CopySpec:
    """Graph output ``output`` copied from ``source`` after the kernels."""

    output: int
    source: str
    nbytes: int


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
    launches: list[LaunchSpec]
    copies: list[CopySpec]
    weights: list[WeightSpec]
    memory: MemoryPlan
    views: dict[str, str]  # view tensor -> the tensor it aliases
    kernel_sources: list[str]
    staging_bytes: int
    cuda_arch: str | None = None
    cuda_libraries: tuple[str, ...] = field(default_factory=tuple)

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
        body = compute.body
        if isinstance(body, Load) and is_view(compute, graph.tensor(body.tensor).shape):
            views[compute.name] = body.tensor
    return views


def runtime_spec(
    graph: Graph,
    groups_with_configs: Sequence[tuple[Group, GroupConfig]],
    kernels: Sequence[Kernel],
    cuda_arch: str | None = None,
    cuda_libraries: Sequence[str] = (),
) -> RuntimeSpec:
    """The runtime for ``graph`` scheduled as ``groups_with_configs`` with one kernel per
    group (``kernels``, in the same order); view groups' kernels are left out."""
    if len(groups_with_configs) != len(kernels):
        raise ValueError(f"{len(groups_with_configs)} groups but {len(kernels)} kernels (one per group)")
    order = execution_order([g for g, _ in groups_with_configs])
    groups = [groups_with_configs[k][0] for k in order]
    views = find_views(graph, groups)
    launched = [kernels[k] for k, g in zip(order, groups) if g.root not in views]
    io = [
        KernelIO(
            tuple(p.tensor for p in k.params if not p.is_output),
            tuple(p.tensor for p in k.params if p.is_output),
        )
        for k in launched
    ]
    memory = plan_memory(graph, io, views)
    inputs, outputs, shapes, staging_bytes = _interface(graph)
    return RuntimeSpec(
        model=sanitize_comment(graph.name),
        inputs=inputs,
        outputs=outputs,
        shapes=shapes,
        launches=[_launch(k, memory) for k in launched],
        copies=[CopySpec(c.output, _address(c.source), c.nbytes) for c in memory.copies if c.nbytes > 0],
        weights=[_weight(k, name, offset, graph) for k, (name, offset) in enumerate(memory.weights.items())],
        memory=memory,
        views=views,
        kernel_sources=[k.source for k in launched],
        staging_bytes=staging_bytes,
        cuda_arch=cuda_arch,
        cuda_libraries=tuple(cuda_libraries),
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
        nbytes = math.prod(p.shape) * np_dtype(p.dtype).itemsize
        args.append(ArgSpec(STORAGE_TYPES[p.dtype], not p.is_output, _address(memory[p.tensor]), nbytes))
    return LaunchSpec(
        kernel.name,
        sanitize_comment(kernel.root),
        kernel.grid,
        kernel.threads,
        kernel.smem_bytes,
        tuple(args),
    )


def _address(storage: Storage) -> str:
    """The C expression for where a tensor lives (names as in nnfusion_rt.cu.j2)."""
    if storage.place is Place.INPUT:
        return f"in{storage.index}"
    if storage.place is Place.OUTPUT:
        return f"out{storage.index}"
    base = "g_weights" if storage.place is Place.WEIGHT else "g_pool"
    return f"{base} + {storage.offset}" if storage.offset else base


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


def c_string(text: str) -> str:
    """``text`` as a C string literal: printable ASCII kept, everything else (and the
    characters that could end or alter the literal) as three-digit octal escapes."""
    out = []
    for byte in text.encode():
        ch = chr(byte)
        if 0x20 <= byte < 0x7F and ch not in '"\\?':
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'
