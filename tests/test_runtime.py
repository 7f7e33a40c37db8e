"""The standalone runtime: view detection, the memory plan, and generated runtimes built with
CMake -- against the CPU emulator and executed (main_test, the ctypes loader, the scripts,
the command line), and with nvcc for sm_90 -- checked against onnxruntime with the design's
metric and against brute force."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from models import Feeds, bert_encoder_layer, mobilenetv2_block
from onnx import helper
from onnx_util import make_model, to_bfloat16

import welder.check
from welder.arch import get_arch
from welder.check import compare, error_metric, onnxruntime_outputs, random_inputs, threshold_for
from welder.cli import main as welder_main
from welder.codegen import generate_model
from welder.frontend.onnx import import_onnx
from welder.frontend.ops.shape import reshape_index
from welder.graph import Graph
from welder.ir.compute import Compute, compute
from welder.ir.expr import Load, cast, lt, select
from welder.ir.interpret import evaluate, np_dtype
from welder.ir.views import Slab, concat_slabs, is_view
from welder.resources import EMU_DIR, TEMPLATE_DIR
from welder.runtime.build import RuntimeBuildError, build_runtime, find_nvcc
from welder.runtime.emit import PRELUDE_HEADERS, emit_runtime, normalize_cuda_arch
from welder.runtime.emu import available as emulator_available
from welder.runtime.layout import (
    BUILD_SUBDIR,
    LIBRARY_NAME,
    kernel_sources,
    library_path,
    main_test_path,
    runtime_dir,
    runtime_sources,
)
from welder.runtime.library import GpuBackend, RuntimeLibrary, RuntimeLibraryError
from welder.runtime.memory import Place, Storage
from welder.runtime.spec import (
    KERNEL_FILES,
    RuntimeSpec,
    c_string,
    execution_order,
    runtime_spec,
    split_kernels,
)
from welder.schedule.plan import plan_model
from welder.session import InferenceSession

ARCH = get_arch("H100")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SUMMARY = re.compile(r"^Summary: \[min, max, mean\] = \[(\d+\.\d+), (\d+\.\d+), (\d+\.\d+)\] ms$")
ODD_NAME = 'x "odd" \\ name?'  # every character a C string literal must escape


def _has_nvcc() -> bool:
    try:
        find_nvcc()
    except RuntimeBuildError:
        return False
    return True


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "GPU" in listed


needs_emulated_build = pytest.mark.skipif(
    not (emulator_available() and shutil.which("cmake")), reason="needs g++ and cmake"
)
needs_nvcc_build = pytest.mark.skipif(
    not (_has_nvcc() and shutil.which("cmake")), reason="needs nvcc and cmake"
)


def needs_gpu(test: Callable) -> Callable:
    """Marked ``gpu``, and skipped unless a GPU, nvcc and cmake are all here."""
    present = _gpu_present() and _has_nvcc() and shutil.which("cmake")
    return pytest.mark.gpu(pytest.mark.skipif(not present, reason="needs a GPU, nvcc and cmake")(test))


# -- models ---------------------------------------------------------------------------------


def views_model() -> tuple[onnx.ModelProto, Feeds]:
    """Reshapes that are views -- of a kernel output, of an input, of another view -- next to
    a transpose that is not, and outputs that are a constant, a copy of the input, a bool and
    an int64.  The input's name needs escaping in C."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", [ODD_NAME, "W"], ["y"]),
        helper.make_node("Reshape", ["y", "shape66"], ["z"]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("Reshape", ["r", "shape326"], ["r2"]),
        helper.make_node("Flatten", ["r2"], ["r3"], axis=1),
        helper.make_node("Transpose", ["r3"], ["t"], perm=[1, 0]),
        helper.make_node("Identity", [ODD_NAME], ["x_copy"]),
        helper.make_node("Identity", ["C"], ["c_out"]),
        helper.make_node("Greater", [ODD_NAME, "zero"], ["positive"]),
        helper.make_node("ArgMax", [ODD_NAME], ["argmax"], axis=2, keepdims=0),
    ]
    weights = {
        "W": rng.standard_normal((4, 6)).astype(np.float32),
        "C": rng.standard_normal(5).astype(np.float32),
        "zero": np.zeros((), np.float32),
        "shape66": np.array([6, 6]),
        "shape326": np.array([3, 2, 6]),
    }
    # r and r2 are outputs as well, so that without fusion they are not inlined into the
    # kernel of r3 and r3 stays a view of a view.
    outputs = ["z", "t", "x_copy", "c_out", "r3", "positive", "argmax", "r2", "r"]
    return make_model(nodes, {ODD_NAME: x}, outputs, weights), {ODD_NAME: x}


def fp16_model() -> tuple[onnx.ModelProto, Feeds]:
    """An fp16 matmul with bias and ReLU: fp16 crosses the C interface as raw bits."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 16)).astype(np.float16)
    weights = {
        "W": (rng.standard_normal((16, 8)) / 4).astype(np.float16),
        "B": rng.standard_normal(8).astype(np.float16),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "B"], ["biased"]),
        helper.make_node("Relu", ["biased"], ["out"]),
    ]
    return make_model(nodes, {"x": x}, ["out"], weights), {"x": x}


def bf16_model() -> tuple[onnx.ModelProto, Feeds]:
    """The same in bfloat16 (its bits cross the C interface); onnxruntime checks it on the
    model in fp32."""
    model, feeds = fp16_model()
    return to_bfloat16(model), {k: v.astype(np.float32).astype(ml_dtypes.bfloat16) for k, v in feeds.items()}


@dataclass(frozen=True)
class Case:
    build: Callable[[], tuple[onnx.ModelProto, Feeds]]
    nofusion: bool = False


CASES = {
    "bert_layer": Case(bert_encoder_layer),
    "mobilenetv2": Case(mobilenetv2_block),
    "views": Case(views_model),
    "views_unfused": Case(views_model, nofusion=True),
    "fp16": Case(fp16_model),
    "bf16": Case(bf16_model),
    "bert_embeddings_unfused": Case(partial(bert_encoder_layer, seq=8, embeddings=True), nofusion=True),
}


@dataclass
class Emitted:
    prefix: Path
    graph: Graph
    model: onnx.ModelProto
    feeds: Feeds
    spec: RuntimeSpec


def emit_case(prefix: Path, case: Case, cuda_arch: str | None = None) -> Emitted:
    """Imports, schedules (cost model, top-1), generates and emits a case into ``prefix``."""
    model, feeds = case.build()
    prefix.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(prefix / "model.onnx"))
    graph = import_onnx(model)
    plan = plan_model(graph, ARCH, topk=1, nofusion=case.nofusion)
    groups = [(p.group, p.configs[0]) for p in plan.groups]
    kernels = generate_model(graph, groups)
    emit_runtime(prefix, graph, groups, kernels, cuda_arch)
    return Emitted(prefix, graph, model, feeds, runtime_spec(graph, groups, kernels, cuda_arch))


class Builds:
    """Each case emitted and built once per test module: for the emulator, or for the GPU
    present (its architecture detected by the CMake build)."""

    def __init__(self, root: Path, emulate: bool) -> None:
        self.root = root
        self.emulate = emulate
        self.done: dict[str, Emitted] = {}

    def __call__(self, name: str) -> Emitted:
        if name not in self.done:
            emitted = emit_case(self.root / name, CASES[name])
            build_runtime(emitted.prefix, emulate=self.emulate)
            self.done[name] = emitted
        return self.done[name]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    return Builds(tmp_path_factory.mktemp("runtimes"), emulate=True)


@pytest.fixture(scope="module")
def gpu_builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    return Builds(tmp_path_factory.mktemp("gpu_runtimes"), emulate=False)


def assert_matches(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert list(ours) == list(reference)
    for result in compare(ours, reference):
        assert ours[result.name].dtype == reference[result.name].dtype, result.name
        assert result.passed, f"{result.name}: error {result.metric:.3e} > {result.threshold:.1e}"


def copy_prefix(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


# -- is_view ----------------------------------------------------------------------------------


def brute_force_is_view(c: Compute, in_shape: Sequence[int]) -> bool:
    """The compute applied to 0, 1, 2, ... in row-major order gives 0, 1, 2, ... back, unconverted."""
    (tensor,) = c.inputs
    dtype = np_dtype(next(ld.dtype for ld in c.loads() if ld.tensor == tensor))
    numbers = np.arange(math.prod(in_shape)).astype(dtype).reshape(in_shape)
    out = evaluate(c, {tensor: numbers})
    same = out.dtype == numbers.dtype and out.size == numbers.size
    return same and np.array_equal(out.reshape(-1), numbers.reshape(-1))


def reshape_of(
    in_shape: Sequence[int], out_shape: Sequence[int], perm: Sequence[int] | None = None
) -> Compute:
    """``reshape(transpose(x, perm), out_shape)`` as one compute, the way inlining builds it."""
    perm = list(perm) if perm is not None else list(range(len(in_shape)))
    mid = [in_shape[p] for p in perm]

    def body(*i):
        t = reshape_index(i, out_shape, mid)
        x_index = [None] * len(in_shape)
        for k, p in enumerate(perm):
            x_index[p] = t[k]
        return Load("x", tuple(x_index), "float64")

    return compute("v", out_shape, body)


VIEW_CASES = {
    "merge": (reshape_of((2, 3, 4), (6, 4)), (2, 3, 4), True),
    "flatten": (reshape_of((2, 3, 4), (24,)), (2, 3, 4), True),
    "split_heads": (reshape_of((1, 16, 64), (1, 16, 4, 16)), (1, 16, 64), True),
    "squeeze": (reshape_of((4, 1, 6), (4, 6)), (4, 1, 6), True),
    "unsqueeze": (reshape_of((6,), (1, 6, 1)), (6,), True),
    "scalar": (reshape_of((), (1, 1)), (), True),
    "regroup": (reshape_of((6, 4), (4, 6)), (6, 4), True),
    "identity": (compute("v", (3, 5), lambda i, j: Load("x", (i, j), "float64")), (3, 5), True),
    "transpose": (reshape_of((2, 3), (3, 2), perm=(1, 0)), (2, 3), False),
    "transpose_unit_dim": (reshape_of((1, 5), (5, 1), perm=(1, 0)), (1, 5), True),
    "transpose_then_merge": (reshape_of((2, 3, 4), (4, 6), perm=(2, 0, 1)), (2, 3, 4), False),
    "reverse": (compute("v", (5,), lambda i: Load("x", (4 - i,), "float64")), (5,), False),
    "slice": (compute("v", (4,), lambda i: Load("x", (i + 1,), "float64")), (5,), False),
    "broadcast": (compute("v", (2, 3), lambda i, j: Load("x", (j,), "float64")), (3,), False),
    "cast": (compute("v", (4,), lambda i: cast(Load("x", (i,), "float64"), "float32")), (4,), False),
    "select": (
        compute("v", (4,), lambda i: select(lt(i, 2), Load("x", (i,), "float64"), 0.0)),
        (4,),
        False,
    ),
    # The flat offsets agree, but each index leaves its dimension.
    "out_of_range": (
        compute("v", (6,), lambda i: Load("x", (i // 3 - 1, i % 3 + 3), "float64")),
        (2, 3),
        False,
    ),
    "gather": (
        compute("v", (4,), lambda i: Load("x", (cast(Load("idx", (i,), "int64"), "index"),), "float64")),
        (4,),
        False,
    ),
}


@pytest.mark.parametrize("name", list(VIEW_CASES))
def test_is_view(name: str) -> None:
    c, in_shape, expected = VIEW_CASES[name]
    assert is_view(c, in_shape) is expected
    if name != "gather":
        assert brute_force_is_view(c, in_shape) is expected


def test_is_view_rejects_reductions_and_size_changes() -> None:
    from welder.ir.compute import reduce, reduce_axis

    k = reduce_axis(1)
    summed = compute("v", (4,), lambda i: reduce("sum", Load("x", (i, k), "float64"), k))
    assert not is_view(summed, (4, 1))
    assert not is_view(reshape_of((2, 3), (6,)), (7,))  # the input is not the size it claims


def test_is_view_agrees_with_brute_force_on_random_reshapes() -> None:
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(60):
        rank = int(rng.integers(1, 5))
        in_shape = tuple(int(d) for d in rng.choice([1, 2, 3, 4], size=rank))
        perm = rng.permutation(rank) if rng.random() < 0.6 else np.arange(rank)
        # Out shape: the elements regrouped into random factors.
        size, out_shape = math.prod(in_shape), []
        while size > 1:
            factor = int(rng.choice([f for f in range(2, size + 1) if size % f == 0]))
            out_shape.append(factor)
            size //= factor
        out_shape += [1] * int(rng.integers(0, 2))
        c = reshape_of(in_shape, tuple(out_shape), perm)
        expected = brute_force_is_view(c, in_shape)
        assert is_view(c, in_shape) is expected, (in_shape, list(perm), out_shape)
        seen.add(expected)
    assert seen == {True, False}


def test_is_view_on_every_lowered_node_of_bert() -> None:
    """Each node of a real model, judged alone, against brute force: reshapes, squeezes and
    identities are views; transposes, gathers, casts and arithmetic are not."""
    model, _ = bert_encoder_layer(embeddings=True, seq=8)
    graph = import_onnx(model)
    verdicts = {}
    for node in graph.topo_order():
        c = node.compute
        if c.is_reduction or not isinstance(c.body, Load) or len(c.inputs) != 1:
            continue
        in_shape = graph.tensor(c.inputs[0]).shape
        verdict = is_view(c, in_shape)
        assert verdict is brute_force_is_view(c, in_shape), node.name
        verdicts.setdefault(node.op_type, set()).add(verdict)
    assert True in verdicts["Reshape"]
    assert verdicts["Transpose"] == {False}


# -- the memory plan ----------------------------------------------------------------------------


def spec_of(case: Case) -> tuple[Graph, RuntimeSpec]:
    model, _ = case.build()
    graph = import_onnx(model)
    plan = plan_model(graph, ARCH, topk=1, nofusion=case.nofusion)
    groups = [(p.group, p.configs[0]) for p in plan.groups]
    return graph, runtime_spec(graph, groups, generate_model(graph, groups))


@pytest.mark.parametrize("name", ["bert_layer", "bert_embeddings_unfused", "mobilenetv2", "views_unfused"])
def test_pool_never_overlaps_live_tensors(name: str) -> None:
    graph, spec = spec_of(CASES[name])
    memory = spec.memory
    pool = {t: s.offset for t, s in memory.storage.items() if s.place is Place.POOL and t not in spec.views}
    assert set(pool) == set(memory.lifetimes)
    for t, offset in pool.items():
        assert offset % 256 == 0
        assert offset + graph.tensor(t).nbytes <= memory.pool_bytes
    for a in pool:
        for b in pool:
            (s1, e1), (s2, e2) = memory.lifetimes[a], memory.lifetimes[b]
            if a < b and s1 <= e2 and s2 <= e1:
                lo = max(pool[a], pool[b])
                hi = min(pool[a] + graph.tensor(a).nbytes, pool[b] + graph.tensor(b).nbytes)
                assert lo >= hi, f"{a} and {b} are alive together and share bytes"
    for w in spec.weights:
        assert w.offset % 256 == 0
    if name == "bert_embeddings_unfused":  # many short-lived intermediates: the pool reuses bytes
        assert memory.pool_bytes < sum(graph.tensor(t).nbytes for t in pool)


def test_views_alias_and_outputs_are_placed() -> None:
    graph, spec = spec_of(CASES["views_unfused"])
    storage = spec.memory.storage
    assert spec.views == {"z": "y", "r2": "r", "r3": "r2", "x_copy": ODD_NAME, "c_out": "C"}
    # z is a graph output viewing y: y is computed straight into z's output buffer.
    assert storage["y"] == storage["z"] == Storage(Place.OUTPUT, graph.outputs.index("z"))
    assert storage["r"] == storage["r2"] == storage["r3"]
    assert storage["r"].place is Place.OUTPUT
    copies = {c.output: c.source for c in spec.copies}
    r3_out = f"out{graph.outputs.index('r3')}"  # r and r2 share r3's buffer: their outputs are copies
    assert copies == {
        graph.outputs.index("x_copy"): "in0",
        graph.outputs.index("c_out"): "g_weights + 256",
        graph.outputs.index("r2"): r3_out,
        graph.outputs.index("r"): r3_out,
    }
    launched = {k.comment for k in spec.launches}
    assert not launched & set(spec.views)


@pytest.mark.parametrize("name", ["views", "bert_embeddings_unfused", "mobilenetv2"])
def test_groups_run_after_the_groups_they_read(name: str) -> None:
    """Groups sorted by their roots are not enough: in the views model the group (y, r) is
    rooted after z, which reads y."""
    model, _ = CASES[name].build()
    graph = import_onnx(model)
    groups = [p.group for p in plan_model(graph, ARCH, topk=1, nofusion=CASES[name].nofusion).groups]
    order = execution_order(groups)
    assert sorted(order) == list(range(len(groups)))
    available = {t.name for t in graph.inputs} | set(graph.constants)
    for k in order:
        assert set(groups[k].inputs) <= available, groups[k].root
        available |= set(groups[k].outputs)


def test_c_string_escapes_what_could_break_the_literal() -> None:
    assert c_string("plain_name.0") == '"plain_name.0"'
    assert c_string('a"b\\c?d\né') == '"a\\042b\\134c\\077d\\012\\303\\251"'
    assert bytes(c_string(ODD_NAME)[1:-1], "ascii").decode("unicode_escape") == ODD_NAME


@pytest.mark.parametrize(
    "arch, expected", [("90", "90"), ("sm_80", "80"), ("8.6", "86"), ("compute_90a", "90a"), (None, None)]
)
def test_cuda_arch_spellings(arch: str | None, expected: str | None) -> None:
    assert normalize_cuda_arch(arch) == expected


def test_bad_cuda_arch_is_a_user_error(tmp_path: Path) -> None:
    from welder.errors import WelderError

    with pytest.raises(WelderError, match="'hopper' is not a compute capability"):
        emit_case(tmp_path, CASES["views"], cuda_arch="hopper")


# -- the emitted folder ---------------------------------------------------------------------------


def test_emit_writes_a_self_contained_folder(tmp_path: Path) -> None:
    emitted = emit_case(tmp_path / "p", CASES["views"])
    folder = runtime_dir(emitted.prefix)
    names = {p.name for p in folder.iterdir()}
    expected = {"CMakeLists.txt", "nnfusion_rt.cu", "nnfusion_rt.h", "main_test.cpp", "Constant"}
    assert expected | {"kernels_0.cu", "welder_prelude.cuh", "welder_math.cuh"} <= names
    # One raw little-endian file per constant the runtime reads, byte for byte.
    files = {w.tensor: folder / "Constant" / w.file for w in emitted.spec.weights}
    assert set(files) == {"W", "C", "zero"}
    for tensor, path in files.items():
        value = emitted.graph.constants[tensor]
        loaded = np.fromfile(path, dtype=value.dtype.newbyteorder("<")).reshape(value.shape)
        np.testing.assert_array_equal(loaded, value)
    source = (folder / "nnfusion_rt.cu").read_text()
    assert source.count("welder_k") > 0 and "cudaMalloc" in source
    assert "__launch_bounds__" in (folder / "kernels_0.cu").read_text()
    # Re-emitting another model into the same folder leaves no stale weights behind.
    (folder / "Constant" / "9999_stale.bin").write_bytes(b"x")
    emit_case(tmp_path / "p", CASES["fp16"])
    assert {p.name for p in (folder / "Constant").iterdir()} == {
        f"{k:04d}_{n}.bin" for k, n in enumerate(["W", "B"])
    }


def test_cmake_architecture_is_fixed_or_detected(tmp_path: Path) -> None:
    cmake = (
        emit_case(tmp_path / "auto", CASES["views"]).prefix / "nnfusion_rt/cuda_codegen/CMakeLists.txt"
    ).read_text()
    assert "nvidia-smi --query-gpu=compute_cap" in cmake and "CMAKE_CUDA_ARCHITECTURES 90" not in cmake
    fixed = (
        emit_case(tmp_path / "fixed", CASES["views"], "sm_90").prefix
        / "nnfusion_rt/cuda_codegen/CMakeLists.txt"
    )
    assert "set(CMAKE_CUDA_ARCHITECTURES 90)" in fixed.read_text()


# -- kernel files ------------------------------------------------------------------------------------

#: A kernel's definition in its file (group_kernel.cu.j2) and its declaration in nnfusion_rt.cu.
KERNEL_DEFINITION = re.compile(
    r'^extern "C" __global__ void __launch_bounds__\(\d+\) (?:__cluster_dims__\([^)]*\) )?(\w+)\(', re.M
)
KERNEL_DECLARATION = re.compile(r'^extern "C" __global__ void (\w+)\([^;{]*\);$', re.M)


def shortest_longest_run(sizes: Sequence[int], runs: int) -> int:
    """Brute force: the least total of the longest run over every cut of ``sizes`` into at
    most ``runs`` contiguous runs."""

    @functools.cache
    def best(start: int, left: int) -> float:
        if start == len(sizes):
            return 0
        if left == 0:
            return math.inf
        return min(
            max(sum(sizes[start:stop]), best(stop, left - 1)) for stop in range(start + 1, len(sizes) + 1)
        )

    return int(best(0, runs))


def test_split_kernels_cuts_the_order_into_runs_with_the_shortest_longest() -> None:
    """The kernels in order, each once, in at most KERNEL_FILES runs and at most one run per
    ``per_file`` kernels, the longest run as short as any such cut allows."""
    assert split_kernels([]) == []
    assert split_kernels([900, 5, 7]) == [range(3)]  # few kernels: one file
    assert split_kernels([1] * 8) == [range(4), range(4, 8)]
    assert split_kernels([1] * 1000) == [range(k * 63, min(k * 63 + 63, 1000)) for k in range(KERNEL_FILES)]
    assert split_kernels([40, 10, 10, 10, 10, 10, 10, 10], per_file=2) == [range(1), range(1, 5), range(5, 8)]
    rng = np.random.default_rng(0)
    for _ in range(300):
        count = int(rng.integers(1, 24))
        sizes = [int(v) for v in rng.integers(1, 100, count)]
        files, per_file = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        runs = split_kernels(sizes, files, per_file)
        assert [k for run in runs for k in run] == list(range(count)) and all(runs)
        most = max(1, min(files, count // per_file))
        assert len(runs) <= most
        longest = max(sum(sizes[k] for k in run) for run in runs)
        assert longest == shortest_longest_run(sizes, most), (sizes, files, per_file)


def test_kernels_are_split_over_files_defined_once_and_declared(tmp_path: Path) -> None:
    """The kernels go into several files, each a run of them in execution order, every kernel
    defined once there and declared in nnfusion_rt.cu, which defines none and launches them
    all; CMakeLists.txt compiles every file in both modes.  Emitting the plan again rewrites
    nothing, and a runtime of fewer files emitted into the folder leaves none of the others."""
    emitted = emit_case(tmp_path / "p", CASES["bert_embeddings_unfused"])
    folder = runtime_dir(emitted.prefix)
    files = kernel_sources(folder)
    assert [f.name for f in files] == [f.name for f in emitted.spec.kernel_files]
    assert [f.name for f in files] == [f"kernels_{n}.cu" for n in range(len(files))] and len(files) > 1
    launched = [k.name for k in emitted.spec.launches]
    defined = [KERNEL_DEFINITION.findall(f.read_text()) for f in files]
    assert all(defined) and [name for names in defined for name in names] == launched
    host = (folder / "nnfusion_rt.cu").read_text()
    assert not KERNEL_DEFINITION.findall(host) and "__launch_bounds__" not in host
    assert KERNEL_DECLARATION.findall(host) == launched
    cmake = (folder / "CMakeLists.txt").read_text()
    assert f"set(welder_sources nnfusion_rt.cu {' '.join(f.name for f in files)})" in cmake
    assert "add_library(nnfusion_naive_rt SHARED ${welder_sources})" in cmake
    assert "set_source_files_properties(${welder_sources} PROPERTIES LANGUAGE CXX)" in cmake
    # Emitting the same runtime again touches no source or header (make would rebuild it all).
    sources = [*runtime_sources(folder), *(folder / h for h in PRELUDE_HEADERS)]
    written = {path: path.stat().st_mtime_ns for path in sources}
    emit_case(tmp_path / "p", CASES["bert_embeddings_unfused"])
    assert {path: path.stat().st_mtime_ns for path in sources} == written
    emit_case(tmp_path / "p", CASES["views"])
    assert [f.name for f in kernel_sources(folder)] == ["kernels_0.cu"]


# -- emulated builds, executed ----------------------------------------------------------------------


@needs_emulated_build
@pytest.mark.parametrize("name", list(CASES))
def test_runtime_matches_onnxruntime(builds: Builds, name: str) -> None:
    emitted = builds(name)
    with RuntimeLibrary(emitted.prefix) as lib:
        assert [t.name for t in lib.inputs] == [t.name for t in emitted.graph.inputs]
        assert [(t.dtype, t.shape) for t in lib.outputs] == [
            (emitted.graph.tensor(o).dtype, emitted.graph.tensor(o).shape) for o in emitted.graph.outputs
        ]
        for feeds in (emitted.feeds, random_inputs(emitted.graph, seed=5)):
            ours = lib.run(feeds)
            assert_matches(ours, onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))


@needs_emulated_build
def test_kernels_of_several_files_run_on_the_emulator(builds: Builds) -> None:
    """The kernel files compile into the library beside nnfusion_rt.cu, whose launches reach
    kernels of the other translation units: runs, plain and replayed from a CUDA graph, match
    onnxruntime."""
    emitted = builds("bert_embeddings_unfused")
    assert len(emitted.spec.kernel_files) > 1
    objects = runtime_dir(emitted.prefix) / "build" / "CMakeFiles" / "nnfusion_naive_rt.dir"
    assert all((objects / f"{f.name}.o").is_file() for f in emitted.spec.kernel_files)
    feeds = random_inputs(emitted.graph, seed=7)
    with RuntimeLibrary(emitted.prefix) as lib:
        for graph_mode in (False, True):
            lib.use_cuda_graph(graph_mode)
            assert_matches(lib.run(feeds), onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))


@needs_emulated_build
@pytest.mark.parametrize("name", ["bert_layer", "views_unfused"])
def test_cuda_graph_replays_on_new_inputs(builds: Builds, name: str) -> None:
    """Graph replay is the default: the first run captures, later runs replay on the fixed
    device buffers' new contents and stay right; turned off, runs are enqueued again."""
    emitted = builds(name)
    with RuntimeLibrary(emitted.prefix) as lib:
        assert lib.cuda_graph_state == "on"
        for seed in (1, 2, 3):
            feeds = random_inputs(emitted.graph, seed)
            assert_matches(lib.run(feeds), onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))
            assert lib.cuda_graph_state == "captured"
        lib.use_cuda_graph(False)
        assert lib.cuda_graph_state == "off"
        feeds = random_inputs(emitted.graph, 4)
        assert_matches(lib.run(feeds), onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))
        assert lib.cuda_graph_state == "off"


@needs_emulated_build
@pytest.mark.parametrize("name", ["bert_layer", "views_unfused"])
def test_each_step_is_timed_apart_and_named_after_its_group(builds: Builds, name: str) -> None:
    """measure_steps times every launch on its own and says which kernel and plan group each
    is; the runtime's outputs stay right after it (it reruns steps out of order)."""
    emitted = builds(name)
    kernels = [k for k in emitted.spec.steps if k.kind == "kernel"]
    with RuntimeLibrary(emitted.prefix) as lib:
        assert [(s.name, s.group) for s in lib.steps] == [(k.name, k.group) for k in kernels]
        assert all(k.group and k.comment == k.group for k in kernels)  # the kernel computes its root
        assert len({s.group for s in lib.steps}) == len(kernels)
        feeds = random_inputs(emitted.graph, seed=3)
        lib.run(feeds)
        times = lib.time_steps(number=2, warmup=1)
        assert len(times) == len(kernels) and all(t > 0 for t in times)
        assert_matches(lib.run(feeds), onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))
        with pytest.raises(RuntimeLibraryError, match="number >= 1"):
            lib.time_steps(number=0)


@needs_emulated_build
def test_inference_session_replays_a_graph_unless_told_not_to(builds: Builds) -> None:
    emitted = builds("bert_layer")
    for options, state in (({}, "captured"), ({"cuda_graph": False}, "off")):
        sess = InferenceSession(emitted.prefix, backend="gpu", **options)
        try:
            for seed in (1, 2):
                feeds = random_inputs(emitted.graph, seed)
                ours = dict(zip(emitted.graph.outputs, sess.run(None, feeds)))
                assert_matches(ours, onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))
            assert sess._backend.library.cuda_graph_state == state
        finally:
            sess._backend.library.close()


def parse_main_test(stdout: str) -> tuple[dict[str, list[float]], tuple[float, float, float]]:
    """First values per output name, and the summary's (min, max, mean)."""
    lines = stdout.strip().splitlines()
    match = SUMMARY.match(lines[-1])
    assert match, lines[-1]
    values = {}
    for line in lines[:-1]:
        head, _, tail = line.partition(":")
        name = head.split(" ")[1]
        values[name] = [float(v) for v in tail.split("(")[0].replace("...", "").split()]
    low, high, mean = (float(g) for g in match.groups())
    return values, (low, high, mean)


@needs_emulated_build
def test_main_test_prints_outputs_and_summary(builds: Builds, tmp_path: Path) -> None:
    """With graph replay (the default) and without, the same outputs and a summary."""
    emitted = builds("bert_layer")
    printed = []
    for extra in ([], ["--no-cuda-graph"]):
        done = subprocess.run(
            [str(main_test_path(emitted.prefix)), "--iters", "3", "--warmup", "1", *extra],
            capture_output=True,
            text=True,
            cwd=tmp_path,  # weights are found beside the library, not in the working directory
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        values, (low, high, mean) = parse_main_test(done.stdout)
        assert list(values) == ["last_hidden_state"] and len(values["last_hidden_state"]) == 10
        assert 0 < low <= mean <= high
        printed.append(values)
    assert printed[0] == printed[1]


@needs_emulated_build
@pytest.mark.parametrize(
    ("variable", "good", "bad", "expected"),
    [
        ("WELDER_SMEM_CARVEOUT", ("0", "100"), ("101", "-1", "half", ""), "expected a percent from 0 to 100"),
        ("WELDER_PDL", ("0", "1"), ("2", "yes", ""), "expected 0 or 1"),
    ],
)
def test_a_launch_setting_from_the_environment_changes_no_output(
    builds: Builds, tmp_path: Path, variable: str, good: tuple[str, ...], bad: tuple[str, ...], expected: str
) -> None:
    """WELDER_SMEM_CARVEOUT (every kernel's carveout) and WELDER_PDL (programmatic dependent
    launches) are read once at set-up and leave the outputs as they were; a value they do not
    take stops the runtime with a message naming the variable."""
    emitted = builds("bert_layer")
    command = [str(main_test_path(emitted.prefix)), "--iters", "1", "--warmup", "0"]

    def run(value: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != variable}
        if value is not None:
            env[variable] = value
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)

    plain = run(None)
    assert plain.returncode == 0, plain.stderr
    for value in good:
        done = run(value)
        assert done.returncode == 0, done.stderr
        assert parse_main_test(done.stdout)[0] == parse_main_test(plain.stdout)[0]
    for value in bad:
        done = run(value)
        assert done.returncode != 0 and f"{variable}={value}: {expected}" in done.stderr, (value, done.stderr)


@needs_emulated_build
def test_env_ab_times_each_setting_in_turns_and_names_a_failing_one(builds: Builds) -> None:
    """scripts/env_ab.py runs the build once per setting and round and reports each
    setting's median and ratio; a setting the runtime refuses is a failure with its
    message, the others still reported."""
    emitted = builds("views")
    script = Path(__file__).resolve().parents[1] / "scripts" / "env_ab.py"
    sets = ["--set", "WELDER_PDL=0", "--set", "WELDER_PDL=1", "--set", "WELDER_PDL=2"]
    command = [
        sys.executable,
        str(script),
        str(emitted.prefix),
        *sets,
        "--rounds",
        "2",
        "--iters",
        "1",
        "--number",
        "1",
        "--warmup",
        "0",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("WELDER_PDL=2: expected 0 or 1") == 2  # once a round
    header, row = done.stdout.strip().splitlines()
    assert header.split() == ["build", "WELDER_PDL=0", "WELDER_PDL=1", "WELDER_PDL=2"]
    _, first, unit, ratio, second, unit2, _, third = row.split()
    assert float(first) > 0 and float(second) > 0 and unit == unit2 == "ms"
    assert ratio == "1.000x" and third == "failed"


def test_build_ab_refuses_what_is_no_source_tree(tmp_path: Path) -> None:
    """scripts/build_ab.sh needs an older welder tree and a model: without either it says
    so (exit 2) before exporting or tuning anything."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_ab.sh"
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"))
    for args in ([], [str(tmp_path)], [str(tmp_path), "bsrn"]):
        command = ["bash", str(script), *args]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2 and "usage:" in done.stderr, (args, done.stderr)
    assert not (tmp_path / "work").exists()


@needs_emulated_build
@pytest.mark.parametrize("name", ["bert_layer", "views", "fp16", "bf16"])
def test_main_test_reads_inputs_from_files(builds: Builds, tmp_path: Path, name: str) -> None:
    emitted = builds(name)
    feeds = random_inputs(emitted.graph, seed=7)
    files = []
    for k, t in enumerate(emitted.graph.inputs):
        files.append(tmp_path / f"in{k}.bin")
        np.ascontiguousarray(feeds[t.name]).tofile(files[-1])
    done = subprocess.run(
        [str(main_test_path(emitted.prefix)), *map(str, files), "--iters", "1", "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    printed, _ = parse_main_test(done.stdout)
    reference = onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs)
    for output, expected in reference.items():
        first = np.asarray(printed[output])
        want = expected.reshape(-1)[: len(first)].astype(np.float64)
        limit = max(threshold_for(expected.dtype.name), 1e-5)  # printed with 6 significant digits
        assert error_metric(first, want) <= limit, output


@needs_emulated_build
def test_main_test_rejects_bad_arguments(builds: Builds, tmp_path: Path) -> None:
    emitted = builds("bert_layer")
    main_test = str(main_test_path(emitted.prefix))
    short = tmp_path / "short.bin"
    short.write_bytes(b"\0" * 8)
    cases = {
        "takes 2 inputs, 1 files": [str(short)],
        "must hold exactly 4096 bytes": [str(short), str(short)],
        "--iters needs a positive integer": ["--iters", "0"],
        "usage: main_test": ["--frobnicate"],
        "[--no-cuda-graph]": ["--cuda-graph"],  # replay is the default; only turning it off is a flag
    }
    for message, argv in cases.items():
        done = subprocess.run([main_test, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (argv, done.stderr)


@needs_emulated_build
def test_weights_live_beside_the_library(builds: Builds, tmp_path: Path) -> None:
    """The library finds Constant/ beside itself or beside its build folder, and says which
    file is missing or wrong when the weights are not what it was built with."""
    emitted = builds("views")
    built = library_path(emitted.prefix)
    constants = built.parent.parent / "Constant"
    last, w = emitted.spec.weights[-1], next(w for w in emitted.spec.weights if w.tensor == "W")

    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(built, alone / built.name)
    with pytest.raises(RuntimeLibraryError, match=r"cannot find the weights.*alone/Constant"):
        RuntimeLibrary(emitted.prefix, library=alone / built.name)

    beside = tmp_path / "beside"
    shutil.copytree(constants, beside / "Constant")
    shutil.copy(built, beside / built.name)
    with RuntimeLibrary(emitted.prefix, library=beside / built.name) as lib:
        assert_matches(lib.run(emitted.feeds), onnxruntime_outputs(emitted.model, emitted.feeds))

    missing = tmp_path / "missing"
    shutil.copytree(beside, missing)
    (missing / "Constant" / last.file).unlink()
    with pytest.raises(RuntimeLibraryError, match=f"cannot open weight file .*{re.escape(last.file)}"):
        RuntimeLibrary(emitted.prefix, library=missing / built.name)

    short = tmp_path / "short"
    shutil.copytree(beside, short)
    (short / "Constant" / w.file).write_bytes(b"\0" * 4)
    with pytest.raises(RuntimeLibraryError, match=f"{re.escape(w.file)} does not hold the 96 bytes expected"):
        RuntimeLibrary(emitted.prefix, library=short / built.name)


@needs_emulated_build
def test_library_checks_feeds_and_arguments(builds: Builds) -> None:
    emitted = builds("bert_layer")
    good = dict(emitted.feeds)
    with RuntimeLibrary(emitted.prefix) as lib:
        wrong = {
            "is float64, the runtime takes float32": {
                **good,
                "hidden_states": good["hidden_states"].astype(np.float64),
            },
            r"has shape \[1, 16\], the runtime was built for \[1, 16, 64\]": {
                **good,
                "hidden_states": good["hidden_states"][:, :, 0],
            },
            "missing input 'attention_mask'": {"hidden_states": good["hidden_states"]},
            r"unknown input\(s\) \['extra'\]": {**good, "extra": good["hidden_states"]},
        }
        for message, feeds in wrong.items():
            with pytest.raises(RuntimeLibraryError, match=message):
                lib.run(feeds)
        with pytest.raises(RuntimeLibraryError, match="need iters >= 1"):
            lib.time(iters=0)
        latency = lib.time(iters=2, warmup=0, number=2)
        assert len(latency.times_ms) == 2 and SUMMARY.match(latency.summary())
        # One synchronised call runs the whole model: about as long as a run from host arrays,
        # whose copies are small beside the emulated kernels.
        start = time.perf_counter()
        lib.run(good)
        run_ms = (time.perf_counter() - start) * 1e3
        with pytest.raises(RuntimeLibraryError, match="need iters >= 1"):
            lib.call_latency(iters=0)
        calls = lib.call_latency(iters=3, warmup=1)
        assert len(calls.times_ms) == 3 and calls.min > 0.3 * run_ms
        # Non-contiguous feeds are fine: the loader makes them contiguous.
        strided = {**good, "hidden_states": np.asfortranarray(good["hidden_states"])}
        assert_matches(lib.run(strided), onnxruntime_outputs(emitted.model, good))
    with pytest.raises(RuntimeLibraryError, match="was closed"):
        lib.run(good)


@needs_emulated_build
def test_gpu_backend_runs_only_its_own_model(builds: Builds) -> None:
    emitted = builds("bert_layer")
    backend = GpuBackend(emitted.graph, prefix=emitted.prefix)
    assert_matches(backend.run(emitted.feeds), onnxruntime_outputs(emitted.model, emitted.feeds))
    backend.library.close()
    other = import_onnx(bert_encoder_layer(seq=8)[0])
    with pytest.raises(RuntimeLibraryError, match=r"built for another model or other shapes"):
        GpuBackend(other, prefix=emitted.prefix)
    with pytest.raises(RuntimeLibraryError, match="needs prefix="):
        GpuBackend(emitted.graph)


@needs_emulated_build
def test_sample_inputs_follow_the_check_rules(builds: Builds) -> None:
    """The library's own input rules agree with welder.check.random_inputs: same arrays."""
    emitted = builds("bert_embeddings_unfused")
    with RuntimeLibrary(emitted.prefix) as lib:
        sampled = lib.sample_inputs(seed=3)
    expected = random_inputs(emitted.graph, seed=3)
    assert list(sampled) == list(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(sampled[name], value)


# -- command line and scripts -----------------------------------------------------------------------


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ARTIFACTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_emulated_build
def test_cli_build_and_run(builds: Builds, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prefix = builds("views").prefix
    assert welder_main(["build", str(prefix), "--emulate"]) == 0
    out = capsys.readouterr().out
    assert str(main_test_path(prefix)) in out and str(library_path(prefix)) in out
    for extra, state in (([], "on"), (["--no-cuda-graph"], "off")):
        assert welder_main(["run", str(prefix), "--iters", "2", "--warmup", "0", *extra]) == 0
        out = capsys.readouterr().out
        assert f"CUDA graph {state}" in out and SUMMARY.match(out.strip().splitlines()[-1])
    assert welder_main(["build", str(tmp_path)]) == 2
    assert "run `welder tune` first" in capsys.readouterr().err
    assert welder_main(["run", str(tmp_path)]) == 2
    assert "build it with `welder build" in capsys.readouterr().err


@needs_emulated_build
def test_test_acc_passes_and_fails(
    builds: Builds, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test_acc = load_script("test_acc")
    emitted = builds("views")
    assert test_acc.main([str(emitted.prefix), "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "PASS" and all(o in out for o in emitted.graph.outputs)

    # Same-sized but different weights: the runtime runs and test_acc must notice.
    altered = copy_prefix(emitted.prefix, tmp_path / "altered")
    weight = next(w for w in emitted.spec.weights if w.tensor == "W")
    path = runtime_dir(altered) / "Constant" / weight.file
    path.write_bytes((np.fromfile(path, np.float32) * 1.01).astype(np.float32).tobytes())
    assert test_acc.main([str(altered)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "FAIL" and any(line.split()[0] == "z" and line.endswith("FAIL") for line in lines)

    assert test_acc.main([str(tmp_path / "nothing")]) == 2


@needs_emulated_build
def test_test_acc_keeps_onnxruntime_s_outputs_for_the_next_check(
    builds: Builds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --reference-cache a second check of the same model on the same inputs (another
    build of the export) reads onnxruntime's outputs back instead of running it; other
    inputs, or an entry that cannot be read, run onnxruntime again."""
    test_acc = load_script("test_acc")
    emitted = builds("views")
    cache = tmp_path / "references"
    calls = count_onnxruntime_runs(monkeypatch)
    argv = [str(emitted.prefix), "--reference-cache", str(cache)]
    assert test_acc.main(argv) == 0 and len(calls) == 1
    (entry,) = cache.glob("*.npz")
    other = copy_prefix(emitted.prefix, tmp_path / "other")
    assert test_acc.main([str(other), "--reference-cache", str(cache)]) == 0 and len(calls) == 1
    # The cached outputs are onnxruntime's: a runtime that computes something else fails.
    weight = next(w for w in emitted.spec.weights if w.tensor == "W")
    path = runtime_dir(other) / "Constant" / weight.file
    path.write_bytes((np.fromfile(path, np.float32) * 1.01).astype(np.float32).tobytes())
    assert test_acc.main([str(other), "--reference-cache", str(cache)]) == 1 and len(calls) == 1
    assert test_acc.main([*argv, "--seed", "3"]) == 0 and len(calls) == 2
    entry.write_bytes(b"not an archive")
    assert test_acc.main(argv) == 0 and len(calls) == 3
    assert not list(cache.glob("*.tmp.npz"))
    capsys.readouterr()


def count_onnxruntime_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time onnxruntime runs a model for a check."""
    calls: list[int] = []
    real = welder.check.onnxruntime_outputs

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(welder.check, "onnxruntime_outputs", counted)
    return calls


@needs_emulated_build
def test_test_acc_checks_on_saved_inputs(
    builds: Builds, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--inputs runs the file's inputs (an export's inputs.npz), and with --reference-cache
    reads the outputs onnxruntime gave for them in an earlier run (the export's check)
    instead of running it again; those outputs still fail a runtime that computes something
    else.  A file that is not the model's inputs is refused by name, exit 2."""
    test_acc = load_script("test_acc")
    emitted = builds("views")
    feeds = random_inputs(emitted.graph, seed=5)
    saved = tmp_path / "inputs.npz"
    np.savez(saved, **feeds)
    cache = tmp_path / "references"
    model = emitted.prefix / "model.onnx"
    welder.check.cached_onnxruntime_outputs(model, feeds, list(emitted.graph.outputs), cache)
    calls = count_onnxruntime_runs(monkeypatch)
    argv = ["--inputs", str(saved), "--reference-cache", str(cache)]
    assert test_acc.main([str(emitted.prefix), *argv]) == 0 and not calls
    assert f"inputs={saved}" in capsys.readouterr().out
    altered = copy_prefix(emitted.prefix, tmp_path / "altered")
    weight = next(w for w in emitted.spec.weights if w.tensor == "W")
    path = runtime_dir(altered) / "Constant" / weight.file
    path.write_bytes((np.fromfile(path, np.float32) * 1.01).astype(np.float32).tobytes())
    assert test_acc.main([str(altered), *argv]) == 1 and not calls
    capsys.readouterr()

    name, value = next(iter(feeds.items()))
    bad = {
        "missing.npz": {k: v for k, v in feeds.items() if k != name},
        "shape.npz": {**feeds, name: value[..., :1]},
        "dtype.npz": {**feeds, name: value.astype(np.float64)},
        "extra.npz": {**feeds, "stray": value},
    }
    for file, content in bad.items():
        np.savez(tmp_path / file, **content)
        assert test_acc.main([str(emitted.prefix), "--inputs", str(tmp_path / file)]) == 2
        err = capsys.readouterr().err
        assert file in err and ("stray" if file == "extra.npz" else repr(name)) in err, err
    (tmp_path / "garbled.npz").write_bytes(b"not an archive")
    assert test_acc.main([str(emitted.prefix), "--inputs", str(tmp_path / "garbled.npz")]) == 2
    assert "cannot read inputs from" in capsys.readouterr().err
    np.save(tmp_path / "one.npy", value)
    assert test_acc.main([str(emitted.prefix), "--inputs", str(tmp_path / "one.npy")]) == 2
    assert "one.npy is one array" in capsys.readouterr().err
    assert not calls


@needs_emulated_build
def test_run_welder_script(builds: Builds, capsys: pytest.CaptureFixture[str]) -> None:
    run_welder = load_script("run_welder")
    assert (
        run_welder.main([str(builds("views").prefix), "--iters", "2", "--warmup", "1", "--number", "2"]) == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("median ") and SUMMARY.match(lines[-1])


@needs_emulated_build
def test_emulated_builds_link_the_emulator_compiled_once(builds: Builds, tmp_path: Path) -> None:
    """An emulated build links the emulator's own sources compiled once for every build
    (CMake's WELDER_EMU_OBJECTS, kept in the tuning cache's folder): it compiles none of
    them, and its runtime matches onnxruntime as the cases above check.  The emitted folder
    built by hand with CMake, without the objects, compiles them itself."""
    emitted = builds("views")
    folder = runtime_dir(emitted.prefix)
    build = folder / BUILD_SUBDIR
    cache = (build / "CMakeCache.txt").read_text()
    objects = re.search(r"^WELDER_EMU_OBJECTS:\w+=(.*)$", cache, re.M).group(1).split(";")
    assert len(objects) == 3 and all(Path(o).is_file() for o in objects), objects
    assert not list(build.rglob("emu_*.cpp.o"))
    # Its sources start from the standard headers, the host API and the prelude precompiled
    # once (WELDER_EMU_PCH): GCC takes the .gch for each of them.
    header = Path(re.search(r"^WELDER_EMU_PCH:\w+=(.*)$", cache, re.M).group(1))
    assert header.with_name(header.name + ".gch").is_file()
    commands = json.loads((build / "compile_commands.json").read_text())
    sources = [c for c in commands if Path(c["file"]).name in ("nnfusion_rt.cu", "kernels_0.cu")]
    assert len(sources) == 2
    for c in sources:
        shown = subprocess.run(
            [*shlex.split(c["command"]), "-H", "-fsyntax-only"],
            cwd=c["directory"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert shown.returncode == 0 and "invalid" not in shown.stderr, shown.stderr[-2000:]
        assert shown.stderr.startswith(f"! {header}.gch"), shown.stderr[:500]
    by_hand = tmp_path / "by-hand"
    for command in (
        [
            "cmake",
            "-S",
            str(folder),
            "-B",
            str(by_hand),
            "-DWELDER_EMULATE=ON",
            f"-DWELDER_EMU_DIR={EMU_DIR}",
        ],
        ["cmake", "--build", str(by_hand), "--parallel", "2"],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(list(by_hand.rglob("emu_*.cpp.o"))) == 3 and (by_hand / LIBRARY_NAME).is_file()


def test_the_precompiled_runtime_prelude_holds_every_standard_header_before_the_prelude():
    """emu_runtime_prelude.h is forced in ahead of an emulated runtime's sources, so the
    prelude's qualifier macros come before whatever standard header the sources include
    before it (preamble.j2, the cuBLAS and interface headers): each must be in it already."""
    runtime_templates = TEMPLATE_DIR / "runtime"
    before = "".join(
        [
            (runtime_templates / "preamble.j2").read_text().split('#include "welder_prelude.cuh"')[0],
            (runtime_templates / "nnfusion_rt.h.j2").read_text(),
            (EMU_DIR / "emu_cublas.h").read_text(),
        ]
    )

    def included(text: str) -> set[str]:
        return set(re.findall(r"^#include <([^>]+)>", text, re.M))

    wanted = included(before) - {"cuda_runtime.h", "cublas_v2.h"}  # CUDA's, not the emulator's
    assert {"dlfcn.h", "vector", "algorithm", "stdint.h"} <= wanted
    assert wanted <= included((EMU_DIR / "emu_runtime_prelude.h").read_text())


@needs_emulated_build
def test_a_failing_kernel_is_reported_not_fatal(builds: Builds, tmp_path: Path) -> None:
    """A kernel that writes out of bounds fails the run with the kernel's name and what went
    wrong (the emulator's guards stand in for the GPU's illegal-address error), and the
    library stays usable.  The fault is made by declaring the output smaller than it is."""
    broken = copy_prefix(builds("views").prefix, tmp_path / "oob")
    source = runtime_dir(broken) / "nnfusion_rt.cu"
    text = source.read_text()
    sizes = re.search(r"static const size_t bytes\[\] = \{([\d, ]+)\};\n.*\n\s*WELDER_LAUNCH\((\w+),", text)
    shrunk = ", ".join([*sizes.group(1).split(", ")[:-1], "4"])
    source.write_text(text.replace(sizes.group(1), shrunk, 1))
    build_runtime(broken, emulate=True)
    name = sizes.group(2)
    feeds = builds("views").feeds
    with RuntimeLibrary(broken) as lib:
        for _ in range(2):
            # Replayed from a CUDA graph (the default) the failure surfaces at the graph's launch;
            # either way the message names the kernel and the fault.
            with pytest.raises(
                RuntimeLibraryError, match=rf"(?s)(launching {name}|kernel {name}:).*past its end"
            ):
                lib.run(feeds)


@needs_emulated_build
def test_build_failure_shows_the_compiler_message(builds: Builds, tmp_path: Path) -> None:
    broken = copy_prefix(builds("views").prefix, tmp_path / "broken")
    source = runtime_dir(broken) / "nnfusion_rt.cu"
    source.write_text(source.read_text() + "\nthis_is_not_cxx;\n")
    with pytest.raises(RuntimeBuildError, match=r"(?s)compiling the runtime failed.*this_is_not_cxx"):
        build_runtime(broken, emulate=True)


# -- the GPU build, compiled ---------------------------------------------------------------------------


@needs_nvcc_build
@pytest.mark.parametrize(("arch", "waits"), [("90", True), ("80", False)])
def test_an_sm90_kernel_waits_for_its_predecessor_before_touching_memory(
    tmp_path: Path, arch: str, waits: bool
) -> None:
    """Under programmatic dependent launch a kernel may start while the one before it
    still runs: in the PTX of every sm_90 kernel, griddepcontrol.wait comes before any
    global load, store or asynchronous copy (and lets the next launch right after); an
    sm_80 kernel has neither instruction."""
    emitted = emit_case(tmp_path / "gpu", CASES["bert_layer"], cuda_arch=arch)
    source = emitted.prefix / "nnfusion_rt" / "cuda_codegen"
    entries = 0
    for kernels in sorted(source.glob("kernels_*.cu")):
        ptx = tmp_path / f"{kernels.stem}.ptx"
        cmd = ["nvcc", f"-arch=sm_{arch}", "-std=c++17", "-ptx", f"-I{source}", str(kernels), "-o", str(ptx)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        for body in ptx.read_text().split(".entry ")[1:]:
            entries += 1
            memory = re.search(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)", body)
            assert memory is not None
            if waits:
                wait, launch = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
                assert 0 <= wait < launch < memory.start(), body[:200]
            else:
                assert "griddepcontrol" not in body
    assert entries > 0


@needs_nvcc_build
def test_nvcc_compiles_every_case(tmp_path: Path) -> None:
    """Every source of the other cases' runtimes, nnfusion_rt.cu and the kernel files,
    compiles for sm_90 (compile only)."""
    nvcc = find_nvcc()
    for name in ("views_unfused", "fp16", "mobilenetv2"):
        folder = runtime_dir(emit_case(tmp_path / name, CASES[name], cuda_arch="90").prefix)
        for source in runtime_sources(folder):
            done = subprocess.run(
                [
                    nvcc,
                    "-std=c++17",
                    "-arch=sm_90",
                    "-I",
                    str(folder),
                    "-c",
                    str(source),
                    "-o",
                    str(tmp_path / f"{name}.{source.stem}.o"),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, done.stderr


def library_symbols(build: Path, *flags: str) -> str:
    """``nm [flags]`` of the runtime library a build folder holds."""
    library = build / "libnnfusion_naive_rt.so"
    return subprocess.run(["nm", *flags, str(library)], capture_output=True, text=True, check=True).stdout


@needs_nvcc_build
def test_nvcc_builds_and_links_kernels_of_several_files(tmp_path: Path) -> None:
    """The full CMake build for sm_90 (no GPU needed) compiles each kernel file on its own
    at -O3 and links them with nnfusion_rt.cu: every kernel defined once in the library,
    none left undefined, main_test linked, and only the C interface exported."""
    emitted = emit_case(tmp_path / "gpu", CASES["bert_embeddings_unfused"], cuda_arch="90")
    assert len(emitted.spec.kernel_files) > 1
    build = build_runtime(emitted.prefix)
    objects = build / "CMakeFiles" / "nnfusion_naive_rt.dir"
    assert all((objects / f"{f.name}.o").is_file() for f in emitted.spec.kernel_files)
    assert (build / "libnnfusion_naive_rt.so").is_file() and (build / "main_test").is_file()
    flags = (objects / "flags.make").read_text()
    assert "arch=compute_90,code=[compute_90,sm_90]" in flags and "-O3" in flags
    symbols = library_symbols(build)
    for kernel in emitted.spec.launches:
        kinds = re.findall(rf"^\S* *([A-Za-z]) {kernel.name}$", symbols, re.MULTILINE)
        assert kinds in (["t"], ["T"]), (kernel.name, kinds)
    exported = library_symbols(build, "-D", "--defined-only")
    for symbol in (
        "cuda_init",
        "cuda_free",
        "kernel_entry",
        "kernel_entry_host",
        "measure_latency",
        "run_on_device",
        "set_use_cuda_graph",
        "get_cuda_graph_state",
        "get_input_shape",
        "get_last_error",
    ):
        assert re.search(rf"\bT {symbol}$", exported, re.MULTILINE), symbol
    assert not any(k.name in exported for k in emitted.spec.launches)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be present")
@needs_nvcc_build
def test_no_gpu_and_no_architecture_is_a_clear_error(tmp_path: Path) -> None:
    emitted = emit_case(tmp_path / "auto", CASES["views"])
    with pytest.raises(RuntimeBuildError, match=r"(?s)No GPU found to build for.*--cuda-arch 90"):
        build_runtime(emitted.prefix)


# -- on the GPU ---------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_runtime_matches_onnxruntime(gpu_builds: Builds, name: str) -> None:
    """Built for the GPU present and run there: plain runs, CUDA-graph replays, timing."""
    emitted = gpu_builds(name)
    with RuntimeLibrary(emitted.prefix) as lib:
        for graph_mode in (False, True):
            lib.use_cuda_graph(graph_mode)
            for feeds in (emitted.feeds, random_inputs(emitted.graph, seed=5)):
                ours = lib.run(feeds)
                assert_matches(ours, onnxruntime_outputs(emitted.model, feeds, emitted.graph.outputs))
            latency = lib.time(iters=20, warmup=5)
            assert 0 < latency.min <= latency.median <= latency.max


@needs_gpu
def test_gpu_main_test_and_test_acc(gpu_builds: Builds, capsys: pytest.CaptureFixture[str]) -> None:
    emitted = gpu_builds("bert_layer")
    for extra in ([], ["--no-cuda-graph"]):
        done = subprocess.run(
            [str(main_test_path(emitted.prefix)), *extra], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr
        _, (low, high, mean) = parse_main_test(done.stdout)
        assert 0 < low <= mean <= high
    assert load_script("test_acc").main([str(emitted.prefix)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "PASS"


def _concat_model(batch: int, outputs: Sequence[str] = ("y", "r", "c")) -> tuple[onnx.ModelProto, Feeds]:
    """Two convolutions concatenated along channels, the concatenation read by a third
    (and a graph output itself), one of its inputs read by a ReLU too."""
    rng = np.random.default_rng(3)
    weights = {
        "w1": rng.standard_normal((8, 4, 1, 1)).astype(np.float32),
        "w2": rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
        "w3": rng.standard_normal((4, 16, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Conv", ["x", "w2"], ["b"], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
        helper.make_node("Conv", ["c", "w3"], ["y"]),
        helper.make_node("Relu", ["a"], ["r"]),
    ]
    feeds = {"x": rng.standard_normal((batch, 4, 8, 8)).astype(np.float32)}
    return make_model(nodes, feeds, list(outputs), weights), feeds


@needs_emulated_build
@pytest.mark.parametrize("batch", [1, 2])
def test_a_concatenation_of_contiguous_runs_is_written_in_place(tmp_path: Path, batch: int) -> None:
    """One op a group (as when a tensor-core consumer cannot read the concatenation through
    its loads): at batch 1 the channel concatenation is not launched -- the convolutions
    write their runs of it, a graph output here -- and at batch 2, where its inputs' runs
    interleave and one is read by the ReLU too, it is; both match onnxruntime."""
    from welder.schedule.engine import CostModel
    from welder.schedule.group import make_group
    from welder.schedule.kinds import propose

    model, feeds = _concat_model(batch)
    graph = import_onnx(model)
    context = CostModel(graph, ARCH, workers=1).context
    groups = [make_group(graph, [node]) for node in graph.nodes]
    chosen = [(g, propose(g, context)[0]) for g in groups]
    kernels = generate_model(graph, chosen)
    spec = runtime_spec(graph, chosen, kernels)
    laid = batch == 1
    assert (set(spec.slabs) == {"a", "b"}) == laid and bool(spec.slabs) == laid
    assert len(spec.launches) == len(groups) - laid
    if laid:
        size = np.dtype(np.float32).itemsize
        assert spec.slabs == {"a": ("c", 0), "b": ("c", 8 * 64 * size)}
        outputs = spec.memory.storage
        assert outputs["c"].place is Place.OUTPUT
        assert outputs["b"] == Storage(Place.OUTPUT, outputs["c"].index, 8 * 64 * size)
    emit_runtime(tmp_path, graph, chosen, kernels, None)
    build_runtime(tmp_path, emulate=True)
    with RuntimeLibrary(tmp_path) as lib:
        assert_matches(lib.run(feeds), onnxruntime_outputs(model, feeds, graph.outputs))


def _strided_concat_model(dtype: type) -> tuple[onnx.ModelProto, Feeds]:
    """Two images: a sigmoid and a convolution concatenated along channels (each read by
    the concatenation alone), the concatenation read by a second convolution and a graph
    output itself."""
    rng = np.random.default_rng(5)
    weights = {
        "w2": (rng.standard_normal((64, 32, 1, 1)) / 4).astype(dtype),
        "w3": (rng.standard_normal((16, 96, 1, 1)) / 8).astype(dtype),
    }
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["a"]),
        helper.make_node("Conv", ["x", "w2"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
        helper.make_node("Conv", ["c", "w3"], ["y"]),
    ]
    feeds = {"x": rng.standard_normal((2, 32, 16, 16)).astype(dtype)}
    return make_model(nodes, feeds, ["y", "c"], weights), feeds


@needs_emulated_build
@pytest.mark.parametrize(
    ("dtype", "kind", "declined"),
    [
        (np.float32, "simt", False),
        (np.float32, "simt", True),
        (np.float16, "mma", False),
        (np.float16, "wgmma", False),
    ],
)
def test_a_strided_concatenation_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: type, kind: str, declined: bool
) -> None:
    """At batch 2 the inputs' runs interleave: the kernels writing them -- the sigmoid's
    SIMT stage, the convolution's stage of ``kind`` (its epilogue storing the fp16
    product) -- offered the concatenation's strides, write there and the concatenation is
    not launched.  Where the sigmoid's stage declines the offer, the convolution's kernel
    is generated again at its own strides and the concatenation launched.  Both match
    onnxruntime."""
    from welder.runtime import spec as spec_module
    from welder.runtime.spec import generate_laid_out
    from welder.schedule.engine import CostModel
    from welder.schedule.group import make_group
    from welder.schedule.kinds import propose

    model, feeds = _strided_concat_model(dtype)
    graph = import_onnx(model)
    context = CostModel(graph, ARCH, workers=1).context
    members: dict[str, list[str]] = {}
    for node in graph.nodes:  # a half-precision convolution's accumulation with its cast
        members.setdefault(node.split(":")[0], []).append(node)
    groups = [make_group(graph, nodes) for nodes in members.values()]
    chosen = [(g, propose(g, context, kinds=(kind,) if g.root == "b" else None)[0]) for g in groups]
    assert [st.kind for g, cfg in chosen if g.root == "b" for st in cfg.stages] == [kind]
    if declined:
        real = spec_module.generate_model

        def sigmoid_declines(graph, groups, layouts=None):  # type: ignore[no-untyped-def]
            return real(graph, groups, {t: s for t, s in (layouts or {}).items() if t != "a"})

        monkeypatch.setattr(spec_module, "generate_model", sigmoid_declines)
    kernels = generate_laid_out(graph, chosen)
    storage = {p.tensor: p.storage for k in kernels for p in k.params if p.is_output}
    spec = runtime_spec(graph, chosen, kernels)
    if declined:
        assert storage["a"] is None and storage["b"] is None and not spec.slabs
        assert len(spec.launches) == len(groups)
    else:
        assert storage["a"] == (2, 96, 16, 16) and storage["b"] == (2, 96, 16, 16)
        size = np.dtype(dtype).itemsize
        assert spec.slabs == {"a": ("c", 0), "b": ("c", 32 * 256 * size)}
        assert len(spec.launches) == len(groups) - 1
    emit_runtime(tmp_path, graph, chosen, kernels, None)
    build_runtime(tmp_path, emulate=True)
    with RuntimeLibrary(tmp_path) as lib:
        assert_matches(lib.run(feeds), onnxruntime_outputs(model, feeds, graph.outputs))
    if not declined:  # a kernel written at strides the runtime would not lay out is refused
        unlaid = [k if k.root != "b" else copy.deepcopy(k) for k in kernels]
        for k in unlaid:
            for p in k.params:
                p.storage = None if k.root == "b" else p.storage
        with pytest.raises(ValueError, match=r"write \['a'\] at a concatenation's strides"):
            runtime_spec(graph, chosen, unlaid)


def _concat_of(shapes: Sequence[tuple[int, ...]], axis: int, perm: Sequence[int] | None = None) -> Graph:
    """``Concat`` of inputs ``x0, x1, ...`` of ``shapes`` (the last transposed by ``perm``)."""
    nodes, names = [], [f"x{k}" for k in range(len(shapes))]
    if perm is not None:
        nodes.append(helper.make_node("Transpose", [names[-1]], ["t"], perm=list(perm)))
        names[-1] = "t"
    nodes.append(helper.make_node("Concat", names, ["y"], axis=axis))
    feeds = {f"x{k}": np.zeros(shape, np.float32) for k, shape in enumerate(shapes)}
    return import_onnx(make_model(nodes, feeds, ["y"]))


def laid_by_brute_force(c: Compute, shape_of: Callable[[str], Sequence[int]], slabs: Sequence[Slab]) -> bool:
    """Whether ``slabs`` lay ``c``'s inputs out as ``c`` computes them: each input written
    into a flat buffer of ``c``'s size at its offset and its storage's row-major strides
    (by numpy's strided view), the buffer equals ``c`` evaluated by the interpreter, and
    every element is written once."""
    values = {
        t: (1000 * (k + 1) + np.arange(math.prod(shape_of(t)))).reshape(shape_of(t))
        for k, t in enumerate(c.inputs)
    }
    out = np.asarray(evaluate(c, values)).ravel()
    buffer = np.full(out.size, -1, dtype=np.int64)
    written = np.zeros(out.size, dtype=np.int64)
    for slab in slabs:
        shape = tuple(shape_of(slab.tensor))
        strides = [math.prod(slab.storage[d + 1 :]) * buffer.itemsize for d in range(len(shape))]
        if slab.offset + sum((n - 1) * s // buffer.itemsize for n, s in zip(shape, strides)) >= out.size:
            return False
        for target in (buffer, written):
            view = np.lib.stride_tricks.as_strided(target[slab.offset :], shape, strides)
            view[...] = values[slab.tensor] if target is buffer else view + 1
    return bool(np.array_equal(buffer, out) and np.all(written == 1))


@pytest.mark.parametrize(
    ("shapes", "axis", "perm", "strided"),
    [
        ([(1, 3, 4, 4), (1, 5, 4, 4)], 1, None, False),  # a batch of one along channels
        ([(2, 3, 4, 4), (2, 5, 4, 4)], 1, None, True),  # two images: runs interleave
        ([(3, 4), (5, 4), (1, 4)], 0, None, False),  # along the first axis, three inputs
        ([(1, 1, 1, 3), (1, 1, 1, 5)], 3, None, False),  # along the last, ones before it
        ([(1, 1, 2, 3), (1, 1, 2, 5)], 3, None, True),  # along the last, rows before it
        ([(1, 3, 4, 4), (1, 4, 5, 4)], 1, (0, 2, 1, 3), False),  # a transposed input, its own kernel
    ],
)
def test_concat_slabs_agree_with_brute_force(
    shapes: list[tuple[int, ...]], axis: int, perm: tuple[int, ...] | None, strided: bool
) -> None:
    graph = _concat_of(shapes, axis, perm)
    c = graph.nodes["y"].compute
    slabs = concat_slabs(c, lambda t: graph.tensor(t).shape)
    assert slabs is not None and laid_by_brute_force(c, lambda t: graph.tensor(t).shape, slabs)
    assert {s.strided for s in slabs} == {strided} and {s.axis for s in slabs} == {axis}


def test_concat_slabs_refuse_an_input_read_out_of_order() -> None:
    """A concatenation whose second input is read transposed in place (a select over the
    channels, one leaf loading ``x1[n, c - 3, w, h]``) is no run of its output, at a batch
    of one or two."""
    for batch in (1, 2):
        shapes = {"x0": (batch, 3, 4, 4), "x1": (batch, 5, 4, 4)}
        for transposed in (False, True):
            c = compute(
                "y",
                (batch, 8, 4, 4),
                lambda n, ch, h, w, t=transposed: select(
                    lt(ch, 3),
                    Load("x0", (n, ch, h, w), "float32"),
                    Load("x1", (n, ch - 3, w, h) if t else (n, ch - 3, h, w), "float32"),
                ),
            )
            slabs = concat_slabs(c, shapes.__getitem__)
            assert (slabs is None) == transposed
            if slabs is not None:
                assert laid_by_brute_force(c, shapes.__getitem__, slabs)


def test_a_concatenation_laid_in_place_lives_from_its_first_input_to_its_last_reader() -> None:
    """The pool holds the concatenation from the first write of an input to its last
    reader, its inputs at their runs' offsets; a kernel reading it before every input is
    written is refused."""
    from welder.runtime.memory import KernelIO, plan_memory

    model, _ = _concat_model(1, outputs=("y", "r"))
    graph = import_onnx(model)
    run = 8 * 64 * 4
    slabs = {"a": ("c", 0), "b": ("c", run)}
    kernels = [
        KernelIO(("x", "w1"), ("a",)),
        KernelIO(("a",), ("r",)),
        KernelIO(("x", "w2"), ("b",)),
        KernelIO(("c", "w3"), ("y",)),
    ]
    memory = plan_memory(graph, kernels, {}, slabs=slabs)
    assert memory.lifetimes == {"c": (0, 3)}
    assert memory["a"] == memory["c"] and memory["a"].place is Place.POOL
    assert memory["b"] == Storage(Place.POOL, 0, memory["c"].offset + run)
    early = [kernels[0], KernelIO(("c",), ("r",)), *kernels[2:]]
    with pytest.raises(ValueError, match="reads 'c' before"):
        plan_memory(graph, early, {}, slabs=slabs)
    with pytest.raises(ValueError, match="no kernel writes it"):
        plan_memory(graph, kernels[:2], {}, slabs=slabs)
