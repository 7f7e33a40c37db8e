"""Convolutions on tensor cores.  A half-precision 1x1 / stride 1 / unpadded / ungrouped Conv
is lowered as a batched product over the flattened image, which the ``mma`` kind computes
with its consumers (bias, ReLU6, a residual Add) fused after it.  Any other fp16 conv whose
groups are wide enough is an implicit GEMM: the same flat product with one reduce axis over
(input channels, taps), the image a gathered operand that the ``mma`` and ``wgmma`` stages
copy element by element (also an affine image whose rows no aligned copy reaches).
Depthwise and narrow-group convs, and fp32 ones (but for patch embeddings and deep
reductions, tests/test_ffma.py), keep the image form and the CUDA cores.  Results are
compared with onnxruntime."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from onnx_util import make_model
from test_mma import copy_width_named, emulate_configs

from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.codegen import generate_kernel, model_source
from welder.frontend.onnx import import_onnx
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import available
from welder.schedule.group import make_group
from welder.schedule.kinds import Options, ScheduleContext, mma, tf32x3, wgmma
from welder.schedule.plan import plan_model
from welder.session import check_model

ARCH = get_arch("H100")
RNG = np.random.default_rng(11)

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")


def _conv_model(
    shape: tuple[int, int, int, int],
    out: int,
    after: str,
    dtype: type = np.float16,
    kernel: int = 1,
    stride: int = 1,
    pad: int = 0,
    group: int = 1,
    dilation: int = 1,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``Conv(x, w, b)`` then ``after``: ``"relu6"`` (Clip 0..6), ``"add"`` (the input added
    back: a residual, so ``out`` equals the input channels and the conv keeps the image's
    size), ``"relu+add"`` (a ReLU, then the residual) or ``""``."""
    x = RNG.standard_normal(shape).astype(dtype)
    fan_in = shape[1] // group * kernel * kernel
    w = (RNG.standard_normal((out, shape[1] // group, kernel, kernel)) / np.sqrt(fan_in)).astype(dtype)
    consts = {"w": w, "b": RNG.standard_normal(out).astype(dtype)}
    attrs = {"strides": [stride, stride], "pads": [pad] * 4, "group": group, "dilations": [dilation] * 2}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if after else "y"], **attrs)]
    if after == "relu6":
        consts |= {"lo": np.array(0, dtype), "hi": np.array(6, dtype)}
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif after == "add":
        nodes.append(helper.make_node("Add", ["c", "x"], ["y"]))
    elif after == "relu+add":
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        nodes.append(helper.make_node("Add", ["r", "x"], ["y"]))
    return make_model(nodes, {"x": x}, ["y"], consts, opset=17), {"x": x}


def _onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feeds)[0]


def _mma_stages(graph_plan) -> list[str]:
    return [
        st.kind
        for g in graph_plan.groups
        for st in g.configs[0].stages
        if st.kind.startswith(("mma", "wgmma"))
    ]


POINTWISE = {
    "1x32x28x28 -> 64, bias + ReLU6": lambda: _conv_model((1, 32, 28, 28), 64, "relu6"),
    "2x48x10x10 -> 40 (ragged M and N), bias + ReLU6": lambda: _conv_model((2, 48, 10, 10), 40, "relu6"),
    "1x64x14x14 -> 64, bias + residual Add": lambda: _conv_model((1, 64, 14, 14), 64, "add"),
    # An image row of 196 halves is 392 bytes: 8-byte copies, the widest aligned one.
    "2x32x14x14 -> 64, bias + ReLU6, 8-byte copies": lambda: _conv_model((2, 32, 14, 14), 64, "relu6"),
}


@needs_emulator
@pytest.mark.parametrize("label", list(POINTWISE))
def test_pointwise_conv_runs_on_tensor_cores_and_matches_onnxruntime(label: str) -> None:
    """The whole graph as one group: its first stage is the product, the bias and ReLU6 or
    residual computed on its accumulators (the product is ``[n, c, h * w]``, its consumers
    ``[n, c, h, w]``: the same element at the same flat position); every proposed config is
    emulated."""
    model, feeds = POINTWISE[label]()
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=3)
    )
    configs = mma.KIND.propose(group, ctx)
    assert configs, f"{label}: the tensor-core rule proposed nothing"
    assert all(cfg.stages[0].kind == "mma" for cfg in configs)
    assert all(len(cfg.stages) == 1 and cfg.stages[0].epilogue == group.stages[1:] for cfg in configs)
    width = copy_width_named(label)
    if width:
        assert {cfg.stages[0].copy_bytes for cfg in configs} == {width}
    reference = _onnxruntime(model, feeds)
    for cfg, runs in zip(configs, emulate_configs(graph, group, configs, feeds)):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for("float16"), f"{label}: {cfg.stages[0]} error {err:.3e}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_ragged_epilogue_loads_its_bias_and_bounds_once_a_row(tmp_path: Path) -> None:
    """Over a 14 x 14 image every N tile but 196's divisors reaches past the product, so the
    epilogue is guarded; its bias and Clip's bounds must still be loaded once per row a thread
    holds, not once per element (nvcc keeps a load behind each element's own branch: three
    an element, 96 a thread here, before the rows and columns were clamped instead), and the
    image rows of 392 bytes are copied 8 bytes at a time."""
    model, _ = POINTWISE["2x32x14x14 -> 64, bias + ReLU6, 8-byte copies"]()
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=3)
    )
    for j, cfg in enumerate(mma.KIND.propose(group, ctx)):
        st = cfg.stages[0]
        assert 196 % st.block_n != 0, "a tile of N that divides 196 leaves the epilogue unguarded"
        source = tmp_path / f"k{j}.cu"
        source.write_text(model_source([generate_kernel(graph, group, cfg, "k")]))
        ptx = tmp_path / f"k{j}.ptx"
        flags = ["-std=c++17", "-arch=sm_80", "-I", str(TEMPLATE_DIR), "-ptx"]
        subprocess.run(["nvcc", *flags, str(source), "-o", str(ptx)], check=True, capture_output=True)
        text = ptx.read_text()
        elements = st.block_m * st.block_n // cfg.threads
        assert len(re.findall(r"\bld\.global", text)) < elements // 4, st
        assert re.search(r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], 8,", text), st


@needs_emulator
@pytest.mark.parametrize("after", ["relu6", "add"])
def test_planner_puts_a_batched_pointwise_conv_on_tensor_cores(after: str, tmp_path: Path) -> None:
    """At a size the cost model gives to tensor cores, the planned kernel is a tensor-core
    kind's (``mma``, or ``wgmma`` on the H100) with the consumers on its accumulators, and
    the emulated plan matches onnxruntime."""
    model, _ = _conv_model((8, 64, 28, 28), 64 if after == "add" else 128, after)
    path = tmp_path / "conv.onnx"
    onnx.save(model, str(path))
    plan = plan_model(import_onnx(path), ARCH, topk=1)
    mma_groups = [g for g in plan.groups if g.configs[0].stages[0].kind in ("mma", "wgmma")]
    assert mma_groups and all(g.configs[0].stages[0].epilogue for g in mma_groups)
    report = check_model(path, backend="emulate")
    assert report.passed, report


#: Narrow groups: depthwise (one channel per group), and 8 output channels per group.
NARROW_CONVS = {
    "3x3 depthwise": {"kernel": 3, "pad": 1, "group": 32},
    "3x3, 4 groups of 8 channels": {"kernel": 3, "pad": 1, "group": 4},
}


@needs_emulator
@pytest.mark.parametrize("label", list(NARROW_CONVS))
def test_narrow_group_convs_stay_off_tensor_cores_and_match(label: str, tmp_path: Path) -> None:
    model, _ = _conv_model((2, 32, 12, 12), 32, "relu6", **NARROW_CONVS[label])
    path = tmp_path / "conv.onnx"
    onnx.save(model, str(path))
    graph = import_onnx(path)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    assert all(mma.contraction(n.compute, shape_of) is None for n in graph.nodes.values())
    assert _mma_stages(plan_model(graph, ARCH, topk=1)) == []
    report = check_model(path, backend="emulate")
    assert report.passed, report


@pytest.mark.parametrize("kernel", [1, 3])
def test_fp32_conv_keeps_exact_arithmetic(kernel: int) -> None:
    """A shallow fp32 convolution (64 products an output) keeps the image form, which the
    CUDA-core kind tiles better; a deep one (576) is a flat product, its image gathered in
    fp32, which the exact kinds take (FMAs, or three TF32 products a piece) and the plain
    TF32 stage does not.  So no tensor-core stage computes either below fp32's accuracy,
    with or without TF32 allowed."""
    model, _ = _conv_model((8, 64, 28, 28), 128, "relu6", dtype=np.float32, kernel=kernel, pad=kernel // 2)
    graph = import_onnx(model)
    assert all(len(n.compute.shape) == 4 for n in graph.nodes.values()) == (kernel == 1)
    exact = {"mma_tf32x3"}
    assert set(_mma_stages(plan_model(graph, ARCH, topk=1))) <= exact
    assert set(_mma_stages(plan_model(graph, ARCH, topk=1, kinds=(*Options.kinds, "mma_tf32")))) <= exact
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    ctx = ScheduleContext(shape_of, lambda t: graph.tensor(t).dtype, ARCH)
    proposed = [tf32x3.KIND.propose(make_group(graph, [name]), ctx) for name in graph.nodes]
    assert any(proposed) == (kernel == 3)


def test_the_flat_product_keeps_the_image_output() -> None:
    """The lowering's reshape restores the image: the graph's output is [n, c, h, w] and
    the product's operand strides are X's own (N contiguous, K a whole image apart)."""
    model, _ = _conv_model((2, 48, 10, 10), 40, "")
    graph = import_onnx(model)
    assert graph.tensor("y").shape == (2, 40, 10, 10)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    found = [con for n in graph.nodes.values() if (con := mma.contraction(n.compute, shape_of)) is not None]
    assert len(found) == 1
    con = found[0]
    assert (con.m, con.n, con.k_extent) == (40, 100, 48)
    assert con.b.tensor == "x" and con.b.contiguous == "n"
    assert con.b.strides[con.k] == 100 and con.b.strides[con.axis_name("n")] == 1


# -- implicit GEMM: any fp16 conv with wide groups -------------------------------------------

#: (input shape, output channels, Conv attributes, what follows): each sized so that both
#: kinds have configs (wgmma's tiles are 64 wide) and the emulator runs them in seconds.
IMPLICIT = {
    "3x3 s1 p1": ((2, 16, 10, 10), 32, {"kernel": 3, "pad": 1}, "relu6"),
    "3x3 s2 p1": ((1, 16, 14, 14), 32, {"kernel": 3, "stride": 2, "pad": 1}, ""),
    "7x7 s2 p3 over 3 channels (K = 147)": ((1, 3, 20, 20), 32, {"kernel": 7, "stride": 2, "pad": 3}, ""),
    "4x4 s4 patch embedding": ((1, 8, 32, 32), 32, {"kernel": 4, "stride": 4}, ""),
    "3x3 dilation 2": ((1, 16, 12, 12), 32, {"kernel": 3, "pad": 2, "dilation": 2}, ""),
    "3x3, 2 groups of 32": ((1, 32, 10, 10), 64, {"kernel": 3, "pad": 1, "group": 2}, ""),
    "3x3, bias + ReLU + residual": ((1, 32, 10, 10), 32, {"kernel": 3, "pad": 1}, "relu+add"),
    "1x1 s2": ((1, 32, 16, 16), 32, {"stride": 2}, ""),
    # Rows of 49 halves start on odd elements, which no aligned copy reaches: the image is
    # gathered although its addressing is affine.
    "1x1 over a 7x7 image, bias + ReLU6": ((2, 32, 7, 7), 64, {}, "relu6"),
}
KINDS = {"mma": mma.KIND, "wgmma": wgmma.KIND}


def _implicit(label: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    shape, out, attrs, after = IMPLICIT[label]
    return _conv_model(shape, out, after, **attrs)


@needs_emulator
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("label", list(IMPLICIT))
def test_implicit_gemm_conv_runs_on_tensor_cores_and_matches_onnxruntime(label: str, kind: str) -> None:
    """The whole graph as one group under the kind's best configs of two block tiles: the
    first stage is the tensor-core product with the image gathered, its consumers later
    stages; the emulated output matches onnxruntime."""
    model, feeds = _implicit(label)
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=50)
    )
    con = mma.contraction(group.computes[group.stages[0]], ctx.shape_of)
    assert con is not None and con.gathered is con.b and con.b.tensor == "x"
    configs = KINDS[kind].propose(group, ctx)
    assert configs, f"{label}: the {kind} rule proposed nothing"
    assert all(cfg.stages[0].kind == kind for cfg in configs)
    chosen = list({cfg.stages[0].block: cfg for cfg in reversed(configs)}.values())[-2:]
    reference = _onnxruntime(model, feeds)
    for cfg, runs in zip(chosen, emulate_configs(graph, group, chosen, feeds)):
        err = error_metric(runs[0]["y"], reference)
        assert err <= threshold_for("float16"), f"{label}: {cfg.stages[0]} error {err:.3e}"


def test_the_implicit_gemm_lowering_pads_ragged_weight_rows() -> None:
    """ResNet's stem: K = 3 x 7 x 7 = 147 halves a weight row, which no 16-byte copy starts
    on; the lowering reads padded constant rows of 152 (zeros past 147) and still sums 147."""
    model, _ = _implicit("7x7 s2 p3 over 3 channels (K = 147)")
    graph = import_onnx(model)
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    (con,) = [c for n in graph.nodes.values() if (c := mma.contraction(n.compute, shape_of)) is not None]
    assert (con.m, con.n, con.k_extent) == (32, 100, 147)
    assert con.a.strides[con.axis_name("m")] == 152 and con.a.contiguous == "k"
    padded = graph.constants[con.a.tensor]
    weights = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    assert padded.shape == (32, 152) and not padded[:, 147:].any()
    assert np.array_equal(padded[:, :147], weights.reshape(32, 147))


@needs_emulator
@pytest.mark.parametrize(("arch", "kind"), [("A100", "mma"), ("H100", "wgmma")])
def test_planner_puts_a_3x3_conv_on_the_arch_tensor_core_kind(arch: str, kind: str, tmp_path: Path) -> None:
    """A large 3x3 conv (batch 64, 256 channels at 14 x 14: tensor-core time over the
    gather's) is planned on the arch's tensor-core kind with bias, ReLU and the residual on
    its accumulators; a small one, on a tensor-core kind of the arch too (on the H100 the
    estimate gives such gather-bound convs to ``mma``, whose gather adds to its products
    where ``wgmma``'s overlaps them but whose products are cheaper), matches onnxruntime
    emulated."""
    large, _ = _conv_model((64, 256, 14, 14), 256, "relu+add", kernel=3, pad=1)
    stages = [g.configs[0].stages[0] for g in plan_model(import_onnx(large), get_arch(arch), topk=1).groups]
    assert [st.kind for st in stages] == [kind] and stages[0].epilogue == ("y",)
    model, _ = _conv_model((8, 32, 16, 16), 32, "relu+add", kernel=3, pad=1)
    path = tmp_path / "conv.onnx"
    onnx.save(model, str(path))
    plan = plan_model(import_onnx(path), get_arch(arch), topk=1)
    ours = [g.configs[0].stages[0] for g in plan.groups if g.configs[0].stages[0].kind in ("mma", "wgmma")]
    assert ours and all(st.epilogue == ("y",) for st in ours)
    report = check_model(path, backend="emulate", arch=arch)
    assert report.passed, report


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_gathered_element_is_read_without_a_branch(kind: str) -> None:
    """A padded 3x3 convolution's gathered image: the element's guards join with ``&``
    (nvcc turns a ``&&`` whose right side costs divisions into a branch, and a branch per
    element serialises the slice's loads), and the load reads ``p[index & -ok]``
    unconditionally, zero selected afterwards.  The emulator tests above check the values."""
    from welder.codegen import generate_kernel

    model, _ = _conv_model((1, 16, 8, 8), 32, "", kernel=3, pad=1)
    graph = import_onnx(model)
    group = make_group(graph, list(graph.nodes))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=2)
    )
    configs = KINDS[kind].propose(group, ctx)
    assert configs
    source = generate_kernel(graph, group, configs[0], "k").source
    start = source.index("_element = [&]")
    element = source[start : source.index("};", start)]
    guard, load = element.split("\n")[1:3]
    assert "const int ok = " in guard and "&&" not in guard and "?" not in guard
    assert load.rstrip().endswith("& -ok];") and "?" not in load
    assert "return ok ? v :" in element
