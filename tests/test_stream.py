"""Streaming twins on the SIMT kind (``SimtConfig.stream``, :func:`simt.stream_twin`).

A reduction whose threads split a row reads it one element per load; its streaming twin
stages the row through shared memory in 16-byte vectors even though each element is read
once.  The twins must be proposed as a family of their own, stage with the widest vectors,
and compute what onnxruntime computes: a LayerNorm (three stages, the input staged by two
of them), one with a residual add in front (two inputs staged) and a softmax, in fp16 and
fp32, emulated on the CPU.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from onnx_util import make_model
from test_mma import emulate_configs
from test_mma_tf32 import ptx_of

from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel
from welder.frontend.onnx import import_onnx
from welder.runtime.emu import available
from welder.schedule.group import make_group
from welder.schedule.kinds import Options, ScheduleContext, propose, simt

ARCH = get_arch("H100")
RNG = np.random.default_rng(5)

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")


def _layernorm(dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    x = RNG.standard_normal((2, 24, 512)).astype(dtype)
    consts = {"g": RNG.standard_normal(512).astype(dtype), "b": RNG.standard_normal(512).astype(dtype)}
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    return make_model(nodes, {"x": x}, ["y"], consts), {"x": x}


def _residual_layernorm(dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A residual add in front of the norm: two inputs staged by each reduction."""
    x, r = (RNG.standard_normal((2, 16, 768)).astype(dtype) for _ in range(2))
    consts = {"g": RNG.standard_normal(768).astype(dtype), "b": RNG.standard_normal(768).astype(dtype)}
    nodes = [
        helper.make_node("Add", ["x", "r"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
    ]
    return make_model(nodes, {"x": x, "r": r}, ["y"], consts), {"x": x, "r": r}


def _softmax(dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    x = RNG.standard_normal((3, 20, 256)).astype(dtype)
    return make_model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, ["y"], {}), {"x": x}


def _rmsnorm(dtype: type) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One reduction (the mean of squares) and the normalisation reading the same row."""
    x = RNG.standard_normal((2, 20, 384)).astype(dtype)
    consts = {"g": RNG.standard_normal(384).astype(dtype), "eps": np.array(1e-5, dtype)}
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


CASES = {
    "layernorm_fp16": lambda: _layernorm(np.float16),
    "layernorm_fp32": lambda: _layernorm(np.float32),
    "residual_layernorm_fp16": lambda: _residual_layernorm(np.float16),
    "softmax_fp16": lambda: _softmax(np.float16),
    "softmax_fp32": lambda: _softmax(np.float32),
    "rmsnorm_fp16": lambda: _rmsnorm(np.float16),
}


def _proposed(model: onnx.ModelProto):
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    shape_of, dtype_of = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    found = propose(group, ScheduleContext(shape_of, dtype_of, ARCH, Options(topk=12)), kinds=("simt",))
    return graph, group, found, shape_of, dtype_of


@pytest.mark.parametrize("label", list(CASES))
def test_streaming_twins_are_proposed_and_stage_whole_vectors(label: str) -> None:
    """Some of the measured places go to streaming twins; each stages the input its
    reductions read in 16-byte vectors, the original stages nothing, and a twin has no twin."""
    graph, group, found, shape_of, dtype_of = _proposed(CASES[label]()[0])
    streams = [c for c in found if c.stages[0].family == "simt_stream"]
    plain = [c for c in found if c.stages[0].family == "simt"]
    assert streams and plain
    wide = "uint4" if graph.tensor("x").dtype == "float16" else "float4"  # 16 bytes
    for cfg in streams:
        staged = [sd for st in cfg.stages for sd in st.staged]
        assert staged and all(sd.tensor in ("x", "r") and sd.vector > 1 for sd in staged)
        assert all(st.stream == bool(st.staged) for st in cfg.stages)
        assert simt.stream_twin(group, cfg, shape_of, dtype_of, ARCH) is None
        assert f"welder_vload<{wide}>(p0," in generate_kernel(graph, group, cfg, "probe").source  # p0: x
    assert all(not st.staged for c in plain for st in c.stages if st.reduce_threads > 1)


@pytest.mark.parametrize("op", ["Relu", "MatMul", "MaxPool"])
def test_no_twin_without_a_reduction_that_reads_once(op: str) -> None:
    """An elementwise group has no reduction to stream; a matmul reuses its operands (each
    element of x feeds every column) and a 3x3 max pool its windows' overlap, which
    staging already serves when it pays."""
    x = RNG.standard_normal((8, 512)).astype(np.float32)
    if op == "Relu":
        model = make_model([helper.make_node("Relu", ["x"], ["y"])], {"x": x}, ["y"], {})
    elif op == "MatMul":
        w = RNG.standard_normal((512, 16)).astype(np.float32)
        model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    else:  # a window over one input: only the overlap of neighbouring windows reuses it
        x = RNG.standard_normal((1, 8, 16, 16)).astype(np.float32)
        pool = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        model = make_model([pool], {"x": x}, ["y"], {})
    _, group, found, shape_of, dtype_of = _proposed(model)
    assert not simt.streams(group, shape_of, dtype_of, ARCH)
    plain = [c for c in found if isinstance(c.stages[0], simt.SimtConfig)]
    assert plain and all(simt.stream_twin(group, c, shape_of, dtype_of, ARCH) is None for c in plain)


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_streaming_twins_match_onnxruntime(label: str) -> None:
    model, feeds = CASES[label]()
    graph, group, found, _, _ = _proposed(model)
    streams = [c for c in found if c.stages[0].family == "simt_stream"][:4]
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], feeds
    )[0]
    dtype = graph.tensor("y").dtype
    for cfg, runs in zip(streams, emulate_configs(graph, group, streams, feeds)):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for(dtype), f"{label}: {[str(st) for st in cfg.stages]} error {err:.3e}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_streaming_twins_load_128_bits(tmp_path: Path) -> None:
    """nvcc builds a layer norm's streaming twins for sm_80 and sm_90 without warnings, and
    their PTX reads the input in 128-bit global loads, which the original's does not."""
    graph, group, found, _, _ = _proposed(CASES["layernorm_fp16"]()[0])
    for family, wide in (("simt_stream", True), ("simt", False)):
        cfg = next(c for c in found if c.stages[0].family == family and c.stages[-1].vector == 1)
        kernel = generate_kernel(graph, group, cfg, f"ln_{family}")
        for text in ptx_of([kernel], tmp_path):
            assert bool(re.search(r"ld\.global(\.nc)?\.v4\.(u32|b32)", text)) == wide, family


@pytest.mark.parametrize("label", list(CASES))
def test_later_stages_read_the_rows_the_first_staged(label: str) -> None:
    """The twin reads each input from global memory once: the first reduction stages its
    rows whole, and the second (the sum of squares after the sum, the sum after the max)
    and the normalisation after them read that buffer, where the step-by-step twin loaded
    the rows in each reduction and the normalisation read them again."""
    graph, group, found, _, _ = _proposed(CASES[label]()[0])
    twins = [c for c in found if c.stages[0].family == "simt_stream"]
    assert twins
    for cfg in twins:
        first, *later = cfg.stages
        assert first.rstep == tuple(a.extent for a in group.computes[first.node].reduce_axes)
        assert not any(sd.resident for sd in first.staged)
        loaded = {(sd.tensor, sd.offset) for sd in first.staged}
        for st in later:
            assert all(sd.resident for sd in st.staged)
            assert {(sd.tensor, sd.offset) for sd in st.staged} == loaded
        kernel = generate_kernel(graph, group, cfg, "probe")
        for p in kernel.params:
            if p.tensor in {t for t, _ in loaded}:
                reads = kernel.source.count(f"({p.name}, ") + kernel.source.count(f"{p.name}[")
                assert reads == 1, f"{p.tensor} read from global memory {reads} times"


def test_rows_that_do_not_fit_are_staged_step_by_step() -> None:
    """On a GPU with 2 KB of shared memory a block, a layer norm's 512 halves (1 KB) kept
    whole beside the block's other buffers do not fit: its twins stage each reduction's
    rows in steps, each loading them, as before rows were shared."""
    model, _ = _layernorm(np.float16)
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    small = dataclasses.replace(ARCH, smem_per_block=2048, smem_per_sm=8192)
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, small, Options(topk=12)
    )
    twins = [c for c in propose(group, ctx, kinds=("simt",)) if c.stages[0].family == "simt_stream"]
    assert twins
    for cfg in twins:
        staged = [st for st in cfg.stages if st.staged]
        assert len(staged) == 2 and all(st.rstep[0] < 512 for st in staged)
        assert not any(sd.resident for st in staged for sd in st.staged)


@needs_emulator
@pytest.mark.parametrize(
    ("op", "shape", "dtype"), [("ln", (3, 7, 100), np.float32), ("softmax", (5, 33), np.float16)]
)
def test_shared_rows_of_odd_lengths_match_onnxruntime(op: str, shape: tuple[int, ...], dtype: type) -> None:
    """Rows that are not whole 16-byte vectors (100 floats, 33 halves) and tiles that do
    not divide the rows: the normalisation reads the kept rows element by element, and the
    results still match onnxruntime."""
    x = RNG.standard_normal(shape).astype(dtype)
    if op == "ln":
        n = shape[-1]
        consts = {"g": RNG.standard_normal(n).astype(dtype), "b": RNG.standard_normal(n).astype(dtype)}
        node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    else:
        consts, node = {}, helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    model = make_model([node], {"x": x}, ["y"], consts)
    graph, group, found, _, _ = _proposed(model)
    twins = [c for c in found if c.stages[0].family == "simt_stream"][:2]
    assert twins
    for cfg in twins:  # the normalisation reads the rows the reductions kept
        assert cfg.stages[-1].staged and all(sd.resident for sd in cfg.stages[-1].staged)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": x}
    )[0]
    for runs in emulate_configs(graph, group, twins, {"x": x}):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for(graph.tensor("y").dtype), f"{op} {shape}: error {err:.3e}"
