"""``welder tune --skip-dot`` end to end without a GPU: matrix products become
cublasGemmStridedBatchedEx calls in the standalone runtime, which is built against the CPU
emulator (``emu_cublas.h`` standing in for cuBLAS) and compared with onnxruntime; the same
sources are built with nvcc and linked against cuBLAS where the toolkit has it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import Feeds, bert_encoder_layer, swin_window_attention_block
from onnx import helper
from onnx_util import make_model
from test_runtime import library_symbols, needs_emulated_build, needs_gpu, needs_nvcc_build

from welder.arch import get_arch
from welder.check import compare, onnxruntime_outputs, random_inputs
from welder.cli import main as welder_main
from welder.codegen import generate_model
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.pipeline import planned_graph
from welder.runtime.build import RuntimeBuildError, build_runtime
from welder.runtime.emit import emit_runtime
from welder.runtime.layout import kernel_sources, main_test_path, runtime_dir, runtime_sources
from welder.runtime.library import RuntimeLibrary, RuntimeLibraryError
from welder.runtime.spec import RuntimeSpec, find_views, runtime_spec
from welder.schedule.kinds.library import find_gemm_groups
from welder.schedule.plan import plan_model

ARCH = get_arch("H100")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def fp16_scores() -> tuple[onnx.ModelProto, Feeds]:
    """fp16 through cuBLAS: a projection with bias and ReLU, then per batch ``h . h^T``,
    whose transposed operand the GEMM reads in place."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 32)).astype(np.float16)
    weights = {
        "W": (rng.standard_normal((32, 16)) / 6).astype(np.float16),
        "B": rng.standard_normal(16).astype(np.float16),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "B"], ["biased"]),
        helper.make_node("Relu", ["biased"], ["h"]),
        helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "ht"], ["scores"]),
    ]
    return make_model(nodes, {"x": x}, ["scores", "h"], weights), {"x": x}


def broadcast_batches() -> tuple[onnx.ModelProto, Feeds]:
    """Batch axes broadcast from both sides, [2, 1, 3, 4] . [5, 4, 6]: no single batch stride,
    so one call per outer index, each at an offset into the graph's inputs and output."""
    rng = np.random.default_rng(6)
    feeds = {"a": rng.standard_normal((2, 1, 3, 4)).astype(np.float32)}
    feeds["b"] = rng.standard_normal((5, 4, 6)).astype(np.float32)
    return make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], feeds, ["y"]), feeds


#: Models and how many of their products cuBLAS computes.  BERT at batch 1 reads its heads
#: through strides and writes its attention context with the heads side by side; at batch 2
#: it reads the heads as the bias adds write them and writes the context in two calls, one
#: per sequence; the window attention reads q, k, v at offsets into one tensor and writes its
#: context in one call per head; fp16 reads a transposed operand in place.
CASES: dict[str, tuple[Callable[[], tuple[onnx.ModelProto, Feeds]], int]] = {
    # BERT's query, key and value projections are one product after the import.
    "bert_layer": (bert_encoder_layer, 6),
    "bert_batch2": (partial(bert_encoder_layer, batch=2), 6),
    "window_attention": (swin_window_attention_block, 6),
    "fp16": (fp16_scores, 2),
    "broadcast_batches": (broadcast_batches, 1),
}


@dataclass
class Built:
    prefix: Path
    graph: Graph
    model: onnx.ModelProto
    feeds: Feeds
    spec: RuntimeSpec
    tune_output: str


def tune(prefix: Path, build: Callable[[], tuple[onnx.ModelProto, Feeds]]) -> Built:
    """``welder tune --cost-model --skip-dot`` (the command line): the runtime's sources."""
    model, feeds = build()
    prefix.mkdir(parents=True)
    onnx.save(model, str(prefix / "model.onnx"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = welder_main(
            [
                "tune",
                str(prefix),
                "--cost-model",
                "--skip-dot",
                "--arch",
                ARCH.name,
                "--topk",
                "1",
                "--no-build",
            ]
        )
    assert code == 0
    graph = planned_graph(import_onnx(model))
    plan = plan_model(graph, ARCH, topk=1, skip_dot=True)
    groups = [(g.group, g.configs[0]) for g in plan.groups]
    spec = runtime_spec(graph, groups, generate_model(graph, groups))
    return Built(prefix, graph, model, feeds, spec, out.getvalue())


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """Each case tuned once per test module."""
    root = tmp_path_factory.mktemp("skip_dot")
    done: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in done:
            done[name] = tune(root / name, CASES[name][0])
        return done[name]

    return get


@pytest.fixture(scope="module")
def built(tuned: Callable[[str], Built]) -> Callable[[str], Built]:
    """Each case tuned and built for the emulator once per test module."""
    done: set[str] = set()

    def get(name: str) -> Built:
        b = tuned(name)
        if name not in done:
            build_runtime(b.prefix, emulate=True)
            done.add(name)
        return b

    return get


def assert_matches(ours: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert list(ours) == list(reference)
    for result in compare(ours, reference):
        assert ours[result.name].dtype == reference[result.name].dtype, result.name
        assert result.passed, f"{result.name}: error {result.metric:.3e} > {result.threshold:.1e}"


# -- the emulated runtime ------------------------------------------------------------------------


@needs_emulated_build
@pytest.mark.parametrize("name", list(CASES))
def test_skip_dot_runtime_matches_onnxruntime(built: Callable[[str], Built], name: str) -> None:
    """Plain runs and CUDA-graph replays (captured cuBLAS calls) on new inputs."""
    b = built(name)
    with RuntimeLibrary(b.prefix) as lib:
        for graph_mode in (False, True):
            lib.use_cuda_graph(graph_mode)
            for feeds in (b.feeds, random_inputs(b.graph, seed=3), random_inputs(b.graph, seed=4)):
                assert_matches(lib.run(feeds), onnxruntime_outputs(b.model, feeds, b.graph.outputs))


@pytest.mark.parametrize("name", list(CASES))
def test_generated_kernels_drop_by_the_products(tuned: Callable[[str], Built], name: str) -> None:
    """Every matched product is cuBLAS calls (one per outer index) and no kernel: the runtime
    launches one kernel per remaining group (views excepted), its kernel files define those and
    nothing else, and nnfusion_rt.cu declares them."""
    b = tuned(name)
    library = find_gemm_groups(b.graph, ARCH)
    products, calls = len(library), sum(lg.gemm.outer for lg in library)
    assert products == CASES[name][1]
    plan = plan_model(b.graph, ARCH, topk=1, skip_dot=True)
    views = find_views(b.graph, [g.group for g in plan.groups])
    groups = [g for g in plan.groups if g.group.root not in views]
    assert len(b.spec.gemms) == calls
    assert len(b.spec.launches) == len(groups) - products
    source = (runtime_dir(b.prefix) / "nnfusion_rt.cu").read_text()
    kernels = "".join(path.read_text() for path in kernel_sources(runtime_dir(b.prefix)))
    assert kernels.count("__global__") == source.count("__global__") == len(b.spec.launches)
    assert source.count("cublasGemmStridedBatchedEx(g_cublas") == calls
    assert f"+ {products} cuBLAS calls" in b.tune_output and b.tune_output.count(" cuBLAS ") >= products


def test_tuned_json_lists_calls_and_kernels(tuned: Callable[[str], Built]) -> None:
    b = tuned("bert_layer")
    doc = json.loads((b.prefix / "tuned.json").read_text())
    assert doc["skip_dot"] and doc["totals"]["library_calls"] == CASES["bert_layer"][1]
    for entry in doc["groups"]:
        if entry["library"] == "cublas":
            [stage] = entry["configs"][0]["stages"]
            assert (
                "kernel" not in entry and stage["kind"] == "library" and stage["gemm"]["c"] == entry["root"]
            )
        else:
            assert entry["kernel"]["name"] in entry["kernel"]["source"]


@needs_emulated_build
def test_main_test_and_test_acc(built: Callable[[str], Built], capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    b = built("bert_layer")
    done = subprocess.run(
        [str(main_test_path(b.prefix)), "--iters", "2", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("Summary: [min, max, mean]")
    spec = importlib.util.spec_from_file_location("test_acc", ARTIFACTS / "test_acc.py")
    test_acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_acc)
    assert test_acc.main([str(b.prefix), "--seed", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "PASS"


# Breaking one cuBLAS call in the generated source: (what, pattern, replacement, message).
BREAKAGES = [
    (
        "ldc",
        r"(&beta, reinterpret_cast<void\*>\([^)]*\), CUDA_R_32F, )\d+",
        r"\g<1>1",
        r"cublasGemmStridedBatchedEx for .*merged_product.* failed: an invalid numeric value was used as an "
        r"argument \(emulator: ldc 1 is less than m\) \(CUBLAS_STATUS_INVALID_VALUE\)",
    ),
    (
        "pointer",
        r"reinterpret_cast<const void\*>\(g_weights\)",
        "reinterpret_cast<const void*>(g_weights + kWeightBytes)",
        r"failed: the GPU program failed to execute \(emulator: matrix A \(16384 bytes over the batch\) "
        r"does not lie inside one device allocation\) \(CUBLAS_STATUS_EXECUTION_FAILED\)",
    ),
    (
        "interleaved_output",  # the context's heads, side by side in each row, made to collide
        r"(&beta, reinterpret_cast<void\*>\([^)]*\), CUDA_R_32F, 64, )16LL",
        r"\g<1>8LL",
        r"cublasGemmStridedBatchedEx for .*attention/self/Reshape.* failed: an invalid numeric value was "
        r"used as an argument \(emulator: the batch's output matrices overlap \(stride_c too small\)\)",
    ),
]


@needs_emulated_build
@pytest.mark.parametrize(
    ("what", "pattern", "replacement", "message"), BREAKAGES, ids=[b[0] for b in BREAKAGES]
)
def test_a_failing_cublas_call_is_reported(
    built: Callable[[str], Built], tmp_path: Path, what: str, pattern: str, replacement: str, message: str
) -> None:
    """Every cuBLAS status is checked: a bad call fails the run with a message that names
    the call, the product and cuBLAS's status, and the library stays usable."""
    b = built("bert_layer")
    broken = tmp_path / what
    shutil.copytree(b.prefix, broken, symlinks=True)
    source = runtime_dir(broken) / "nnfusion_rt.cu"
    text, count = re.subn(pattern, replacement, source.read_text(), count=1)
    assert count == 1
    source.write_text(text)
    build_runtime(broken, emulate=True)
    with RuntimeLibrary(broken) as lib:
        for _ in range(2):
            with pytest.raises(RuntimeLibraryError, match=message):
                lib.run(b.feeds)


# -- what is generated ------------------------------------------------------------------------------


def emit(prefix: Path, skip_dot: bool, cuda_arch: str | None = None) -> Path:
    model, _ = bert_encoder_layer()
    graph = import_onnx(model)
    plan = plan_model(graph, ARCH, topk=1, skip_dot=skip_dot)
    groups = [(g.group, g.configs[0]) for g in plan.groups]
    return emit_runtime(prefix, graph, groups, generate_model(graph, groups), cuda_arch)


def test_cublas_is_linked_only_when_used(tmp_path: Path) -> None:
    plain = emit(tmp_path / "plain", skip_dot=False)
    for path in [*runtime_sources(plain), plain / "CMakeLists.txt"]:
        assert "cublas" not in path.read_text().lower(), path.name
    skipping = emit(tmp_path / "skip", skip_dot=True)
    cmake = (skipping / "CMakeLists.txt").read_text()
    assert "CUDA::cublas" in cmake and "if(NOT TARGET CUDA::cublas)" in cmake
    source = (skipping / "nnfusion_rt.cu").read_text()
    assert source.index("cublasCreate(&g_cublas)") < source.index("cublasSetWorkspace(g_cublas")
    assert "cublasDestroy(g_cublas)" in source and "cublasSetStream(g_cublas, g_stream)" in source


@needs_nvcc_build
@pytest.mark.slow
def test_nvcc_builds_and_links_the_skip_dot_runtime(tmp_path: Path) -> None:
    """The CMake build for sm_90 compiles the cuBLAS calls and links libcublas (no GPU
    needed).  Skipped where the CUDA toolkit has no cuBLAS, which the build reports."""
    folder = emit(tmp_path / "gpu", skip_dot=True, cuda_arch="90")
    try:
        build = build_runtime(folder.parent.parent)
    except RuntimeBuildError as e:
        if "This runtime calls cublas, which the CUDA toolkit" in str(e):
            pytest.skip(f"the CUDA toolkit has no cuBLAS: {e}")
        raise
    undefined = library_symbols(build, "-D", "--undefined-only")
    for symbol in ("cublasGemmStridedBatchedEx", "cublasCreate", "cublasSetWorkspace", "cublasDestroy"):
        assert re.search(rf"\b{symbol}(_v2)?@", undefined), symbol
    assert (build / "main_test").is_file()


# -- on the GPU -------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_skip_dot_runtime_matches_onnxruntime(tmp_path: Path, name: str) -> None:
    """Built for the GPU present, run with real cuBLAS: plain runs, CUDA-graph replays of
    the captured cuBLAS calls on new inputs, and timing."""
    model, feeds = CASES[name][0]()
    graph = import_onnx(model)
    prefix = tmp_path / name
    prefix.mkdir()
    onnx.save(model, str(prefix / "model.onnx"))
    plan = plan_model(graph, ARCH, topk=1, skip_dot=True)
    groups = [(g.group, g.configs[0]) for g in plan.groups]
    emit_runtime(prefix, graph, groups, generate_model(graph, groups))
    build_runtime(prefix)
    with RuntimeLibrary(prefix) as lib:
        for graph_mode in (False, True):
            lib.use_cuda_graph(graph_mode)
            for run_feeds in (feeds, random_inputs(graph, seed=3), random_inputs(graph, seed=4)):
                assert_matches(lib.run(run_feeds), onnxruntime_outputs(model, run_feeds, graph.outputs))
            latency = lib.time(iters=20, warmup=5)
            assert 0 < latency.min <= latency.median <= latency.max
