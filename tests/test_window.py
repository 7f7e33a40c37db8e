"""Sliding windows on the SIMT kind (welder/ir/window.py, ``SimtConfig.window``).

The analysis finds the windowed factor, its tap and step by evaluating the factor's indices
and conditions, so it is checked against convolutions whose stride and dilation are known,
and against reductions that are no window.  The window layout's kernels are emulated against
onnxruntime (depthwise convolutions with padding, strides, dilation, a fused ReLU6 and a
producer inlined in front), and nvcc's PTX shows the point: fewer shared-memory loads than
multiply-adds, where the generic layout loads once per multiply-add.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import replace
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
from welder.ir import window
from welder.ir.window import sliding_window
from welder.runtime.emu import available
from welder.schedule.group import make_group
from welder.schedule.kinds import Options, ScheduleContext, propose, simt

ARCH = get_arch("H100")
RNG = np.random.default_rng(17)

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")


def _depthwise(
    shape: tuple[int, int, int, int],
    dtype: type = np.float16,
    kernel: int = 3,
    stride: int = 1,
    pad: int = 1,
    dilation: int = 1,
    before: str = "",
    draw: bool = True,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A depthwise Conv with bias and ReLU6 after it; ``before`` puts a producer in front,
    which the window's values inline: ``"relu"``, or ``"shift+clip"`` (a per-channel Add
    and a Clip: loads free of the window, which the stage reads once per row).  Without
    ``draw`` the input is a zero-stride view of one zero (a batch-64 tensor's model only)."""
    channels = shape[1]
    x = RNG.standard_normal(shape).astype(dtype) if draw else np.broadcast_to(np.zeros((), dtype), shape)
    consts = {
        "w": (RNG.standard_normal((channels, 1, kernel, kernel)) / kernel).astype(dtype),
        "b": RNG.standard_normal(channels).astype(dtype),
        "lo": np.array(0, dtype),
        "hi": np.array(6, dtype),
    }
    attrs = {"strides": [stride] * 2, "pads": [pad] * 4, "group": channels, "dilations": [dilation] * 2}
    nodes = []
    if before == "relu":
        nodes.append(helper.make_node("Relu", ["x"], ["xr"]))
    elif before == "shift+clip":
        consts["shift"] = RNG.standard_normal((channels, 1, 1)).astype(dtype)
        nodes.append(helper.make_node("Add", ["x", "shift"], ["xs"]))
        nodes.append(helper.make_node("Clip", ["xs", "lo", "hi"], ["xr"]))
    nodes += [
        helper.make_node("Conv", ["xr" if before else "x", "w", "b"], ["c"], **attrs),
        helper.make_node("Clip", ["c", "lo", "hi"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


def _glu_depthwise(
    shape: tuple[int, int, int], kernel: int = 7, dtype: type = np.float16
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Conformer's convolution module on ``shape`` ``[batch, 2 x channels, time]``: a GLU
    (Split, Sigmoid, Mul), a depthwise Conv1d padded to the same length, then SiLU.  The
    GLU is a stage of its own in front of the convolution (read through the window, it is
    not inlined), so the window is the group's second stage."""
    channels = shape[1] // 2
    x = RNG.standard_normal(shape).astype(dtype)
    consts = {
        "w": (RNG.standard_normal((channels, 1, kernel)) / kernel).astype(dtype),
        "b": RNG.standard_normal(channels).astype(dtype),
        "halves": np.array([channels, channels], np.int64),
    }
    nodes = [
        helper.make_node("Split", ["x", "halves"], ["a", "gate"], axis=1),
        helper.make_node("Sigmoid", ["gate"], ["sg"]),
        helper.make_node("Mul", ["a", "sg"], ["glu"]),
        helper.make_node("Conv", ["glu", "w", "b"], ["c"], pads=[kernel // 2] * 2, group=channels),
        helper.make_node("Sigmoid", ["c"], ["sc"]),
        helper.make_node("Mul", ["c", "sc"], ["y"]),
    ]
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


def _conv_compute(model: onnx.ModelProto):
    graph = import_onnx(model)
    (name,) = [n for n, node in graph.nodes.items() if node.compute.reduce_axes]
    return graph, graph.nodes[name].compute


@pytest.mark.parametrize(("stride", "dilation"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_analysis_finds_the_window_step(stride: int, dilation: int) -> None:
    _, c = _conv_compute(_depthwise((1, 8, 12, 12), stride=stride, pad=dilation, dilation=dilation)[0])
    win = sliding_window(c)
    assert win is not None
    assert (win.axis, win.tap) == (c.axes[-1].name, c.reduce_axes[-1].name)
    common = math.gcd(stride, dilation)  # only the ratio decides which values are shared
    assert (win.stride, win.dilation) == (stride // common, dilation // common)


def test_the_slots_of_a_run_are_its_distinct_positions() -> None:
    _, c = _conv_compute(_depthwise((1, 8, 12, 12), stride=2)[0])
    win = sliding_window(c)
    assert win is not None
    reps, uses = win.slots(4, 3)
    assert len(reps) == 3 * 2 + 3  # positions 0..8 of four outputs two apart, three taps
    for v, k, slot in uses:
        rv, rk = reps[slot]
        assert rv * 2 + rk == v * 2 + k and rv <= v


def test_reductions_without_a_window_are_refused() -> None:
    matmul = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        {"x": np.ones((16, 32), np.float32)},
        ["y"],
        {"w": np.ones((32, 8), np.float32)},
    )
    pointwise = _depthwise((1, 8, 6, 6), kernel=1, pad=0, dtype=np.float32)[0]
    pool = make_model(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        {"x": np.ones((4, 6, 10), np.float32)},
        ["y"],
        {"axes": np.array([2], np.int64)},
    )
    for model in (matmul, pointwise, pool):
        graph = import_onnx(model)
        assert all(sliding_window(n.compute) is None for n in graph.nodes.values() if n.compute.reduce_axes)


def test_the_proof_stays_within_its_point_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-precision stem convolution (3 channels in, stride 2) is lowered as an implicit
    product over a flattened image of 12544 positions and 27 taps: evaluating each took 16 s
    a call in the fusion search, which asks for every group the stage joins.  The proof gives
    up past ``MAX_POINTS`` and the answer is cached."""
    x = RNG.standard_normal((1, 3, 224, 224)).astype(np.float16)
    stem = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 2], pads=[1, 1, 1, 1])],
        {"x": x},
        ["y"],
        {"w": RNG.standard_normal((32, 3, 3, 3)).astype(np.float16)},
    )
    graph = import_onnx(stem)
    (c,) = [n.compute for n in graph.nodes.values() if n.compute.reduce_axes]
    assert c.axes[-1].extent * c.reduce_axes[-1].extent > window.MAX_POINTS
    evaluated = []
    real = window._value
    monkeypatch.setattr(window, "_value", lambda e, env: evaluated.append(1) or real(e, env))
    sliding_window.cache_clear()
    assert sliding_window(c) is None
    assert sliding_window(c) is None
    leaves = len(window._leaves(c.body.a) or []) + len(window._leaves(c.body.b) or [])
    assert len(evaluated) <= 3 * window.MAX_POINTS * leaves


CASES = {
    "3x3 s1 p1, fp16": lambda: _depthwise((2, 8, 14, 16)),
    "3x3 s2 p1, fp16": lambda: _depthwise((1, 8, 15, 15), stride=2),
    "3x3 dilation 2, fp32": lambda: _depthwise((1, 4, 12, 16), np.float32, pad=2, dilation=2),
    "5x5 s1 p2 behind a ReLU, fp16": lambda: _depthwise((1, 8, 10, 24), kernel=5, pad=2, before="relu"),
    "3x3 s2 behind a shift and a clip, fp16": lambda: _depthwise(
        (2, 8, 13, 16), stride=2, before="shift+clip"
    ),
    "3x3 s1 behind a shift and a clip, fp32": lambda: _depthwise(
        (1, 4, 9, 32), np.float32, before="shift+clip"
    ),
    "1D, 7 taps, behind a GLU stage, fp16": lambda: _glu_depthwise((2, 16, 48)),
    "1D, 7 taps, behind a GLU stage, fp32": lambda: _glu_depthwise((1, 8, 40), dtype=np.float32),
}


def _window_stage(cfg) -> int | None:
    """The index of ``cfg``'s window stage, or None."""
    return next((k for k, st in enumerate(cfg.stages) if st.window), None)


def _window_configs(model: onnx.ModelProto):
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    shape_of, dtype_of = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    ctx = ScheduleContext(shape_of, dtype_of, ARCH, Options(topk=12))
    found = propose(group, ctx, kinds=("simt",))
    return graph, group, [c for c in found if _window_stage(c) is not None]


@needs_emulator
@pytest.mark.parametrize("label", list(CASES))
def test_window_configs_match_onnxruntime(label: str) -> None:
    """The search offers window twins (a family of their own) and each matches onnxruntime,
    its generic twin too (the same tile and threads, loops over the taps); behind a GLU
    stage the twin is the group's second stage, reading the GLU's tile from shared memory."""
    model, feeds = CASES[label]()
    graph, group, windows = _window_configs(model)
    assert windows, f"{label}: no window config proposed"
    if "GLU" in label:  # the twin of a later stage is a family of its own, as a first stage's
        assert len(group.stages) == 3 and all(_window_stage(c) == 1 for c in windows), label
        assert {c.family for c in windows} == {"simt_window"}, label
    dtype = graph.tensor("y").dtype
    plain = [replace(c, stages=[replace(st, window=False) for st in c.stages]) for c in windows[:2]]
    chosen = windows[:3] + plain
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], feeds
    )[0]
    for cfg, runs in zip(chosen, emulate_configs(graph, group, chosen, feeds)):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for(dtype), f"{label}: {cfg.stages[0]} error {err:.3e}"


def _longest_run(windows: list) -> object:
    return max(windows, key=lambda c: c.stages[0].reg_tile[-1])


def test_the_twin_runs_contiguous_outputs_per_thread() -> None:
    graph, group, windows = _window_configs(_depthwise((4, 16, 28, 32))[0])
    cfg = _longest_run(windows)
    st = cfg.stages[0]
    assert st.reg_tile[-1] >= 4 and st.thread_shape[-1] * st.reg_tile[-1] >= st.tile[-1]
    source = generate_kernel(graph, group, cfg, "probe").source
    assert f"t3 * {st.reg_tile[-1]} + j / 1 % {st.reg_tile[-1]}" in source
    assert "xw[" in source and "ww[" in source
    graph, group, windows = _window_configs(_depthwise((2, 8, 14, 32), before="shift+clip")[0])
    source = generate_kernel(graph, group, _longest_run(windows), "probe").source
    assert "xh0" in source and "xh1" in source  # the shift and a bound, read once per row
    assert simt.window_twin(group, cfg) is None  # a twin has no twin


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_window_kernels_load_fewer_values_than_they_multiply(tmp_path: Path) -> None:
    """nvcc builds the window kernel without warnings for sm_80 and sm_90, and its PTX has
    fewer shared-memory loads than fp32 multiply-adds: each staged value feeds several
    outputs (the generic layout loads once per multiply-add, and more)."""
    model = _depthwise((4, 16, 28, 32), np.float32, before="shift+clip")[0]
    graph, group, windows = _window_configs(model)
    kernel = generate_kernel(graph, group, _longest_run(windows), "window_ptx")
    for text in ptx_of([kernel], tmp_path):
        loads = len(re.findall(r"ld\.shared", text))
        fmas = len(re.findall(r"fma\.rn\.f32", text))
        assert fmas >= 9 * 8 and loads < fmas * 2 // 3, (loads, fmas)


def _simt_configs(model: onnx.ModelProto, topk: int = 12):
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    shape_of, dtype_of = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    ctx = ScheduleContext(shape_of, dtype_of, ARCH, Options(topk=topk))
    return graph, group, propose(group, ctx, kinds=("simt",))


def _rows_in_vectors(cfg) -> bool:
    st = cfg.stages[0]
    return cfg.block_tile[-1] in (28, 56) and bool(st.staged) and st.staged[0].vector > 1


def test_the_search_steps_past_a_ragged_width() -> None:
    """MobileNetV2's depthwise convolution at batch 64, 56 wide: from 14 the next width, 16,
    leaves a ragged tile and estimates worse, so the search steps to 28 as well, and its best
    configs stage whole rows in vectors; each 14-wide tile (what it stopped at before, read
    element by element) estimates higher."""
    widths = simt.axis_candidates(56, 1)
    assert widths == [1, 2, 4, 8, 14, 16, 28, 32, 56]
    assert simt.next_sizes(widths, 56, widths.index(14)) == [widths.index(16), widths.index(28)]
    assert simt.next_sizes(widths, 56, widths.index(8)) == [widths.index(14)]
    assert simt.next_sizes(widths, 56, widths.index(56)) == []
    _, _, found = _simt_configs(_depthwise((64, 144, 56, 56), draw=False)[0])
    assert _rows_in_vectors(found[0]), found[0]
    narrow = [c.estimate.latency_us for c in found if c.block_tile[-1] == 14]
    assert all(found[0].estimate.latency_us < e for e in narrow)


@needs_emulator
def test_whole_rows_read_in_vectors_match_onnxruntime() -> None:
    """The whole-row tiles of a 56-wide depthwise convolution, staged in vectors from a
    shifted origin (the row's left pad before the first vector), plain and as window twins,
    match onnxruntime."""
    model, feeds = _depthwise((4, 32, 56, 56))
    graph, group, found = _simt_configs(model)
    chosen = [c for c in found if _rows_in_vectors(c)]
    assert {_window_stage(c) is not None for c in chosen} == {True, False}
    assert any(st.shift for c in chosen for st in c.stages[0].staged)
    chosen = chosen[:4]
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], feeds
    )[0]
    for cfg, runs in zip(chosen, emulate_configs(graph, group, chosen, feeds)):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for("float16"), f"{cfg.stages[0]} error {err:.3e}"
