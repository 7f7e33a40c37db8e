"""bfloat16 end to end on the CPU: ONNX BFLOAT16 graphs imported and interpreted against
numpy in float64 (onnxruntime's CPU provider has no bf16 arithmetic) or onnxruntime where it
runs them; the reference test_acc uses for bf16 models; the emulator's bf16 host type; the
generated SIMT, ``mma`` and ``wgmma`` kernels emulated against the interpreter, with the
products on tensor cores; and the errors bf16 input can meet.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from models import bert_encoder_layer, vit_block
from onnx import TensorProto, helper
from onnx_util import make_model, to_bfloat16
from test_mma import CASES, SPLIT_CASES, _context, _whole_group, emulate_configs

from welder.arch import get_arch
from welder.check import (
    BF16_AS_FP32,
    THRESHOLDS,
    error_metric,
    onnxruntime_outputs,
    output_threshold,
    recorded_precision,
    reference_name,
    saved_inputs,
    threshold_for,
)
from welder.codegen import generate_kernel, generate_model, model_source
from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.resources import TEMPLATE_DIR
from welder.runtime.emu import available, compile_kernels
from welder.runtime.emulate import EmulatedModel
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group
from welder.schedule.kinds import Options, ScheduleContext, mma, wgmma
from welder.schedule.kinds.mma import MmaConfig, split_choices
from welder.schedule.kinds.wgmma import WgmmaConfig
from welder.schedule.plan import plan_model
from welder.session import InferenceSession, check_model

BF16 = ml_dtypes.bfloat16
LIMIT = threshold_for("bfloat16")
RNG = np.random.default_rng(16)

needs_emulator = pytest.mark.skipif(not available(), reason="the CPU emulator needs Linux and g++")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _b(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(BF16)


def _f(x: np.ndarray) -> np.ndarray:
    """bf16 values exactly, in float64: the reference computes on what the model holds."""
    return np.asarray(x).astype(np.float64)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _erf(x: np.ndarray) -> np.ndarray:
    import math

    return np.vectorize(math.erf)(x)


# -- graphs and their float64 references --------------------------------------------------------


def _elementwise() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    x, y = _b(4, 33), _b(4, 33)
    c = np.array(0.75, BF16)
    n = helper.make_node
    nodes = [
        n("Mul", ["x", "c"], ["xc"]),
        n("Add", ["xc", "y"], ["s"]),
        n("Tanh", ["s"], ["t"]),
        n("Sigmoid", ["y"], ["g"]),
        n("Erf", ["x"], ["e"]),
        n("Max", ["t", "e"], ["m"]),
        n("Div", ["m", "g"], ["out"]),
        n("Relu", ["x"], ["r"]),
        n("Sqrt", ["r"], ["root"]),
    ]

    def ref(feeds: dict) -> dict:
        x, y = _f(feeds["x"]), _f(feeds["y"])
        out = np.maximum(np.tanh(x * 0.75 + y), _erf(x)) * (1 + np.exp(-y))
        return {"out": out, "root": np.sqrt(np.maximum(x, 0))}

    return make_model(nodes, {"x": x, "y": y}, ["out", "root"], {"c": c}), {"x": x, "y": y}, ref


def _casts() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    """float32 -> bf16 (rounded to nearest even, past the largest bf16 to infinity), bf16
    -> float32 (exact), bf16 -> float16, and bf16 -> int32 (truncated) of values in range."""
    x = (RNG.standard_normal((5, 40)) * 50).astype(np.float32)
    x.flat[:4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(2.0 + 2**-7), 3.4e38]  # ties both ways, overflow
    z = _b(5, 40, scale=300.0)
    n = helper.make_node
    nodes = [
        n("Cast", ["x"], ["b"], to=TensorProto.BFLOAT16),
        n("Cast", ["b"], ["wide"], to=TensorProto.FLOAT),
        n("Cast", ["b"], ["half"], to=TensorProto.FLOAT16),
        n("Cast", ["z"], ["ints"], to=TensorProto.INT32),
    ]

    def ref(feeds: dict) -> dict:
        b = feeds["x"].astype(BF16)
        with np.errstate(over="ignore"):
            half = b.astype(np.float32).astype(np.float16)
        return {
            "b": b,
            "wide": b.astype(np.float32),
            "half": half,
            "ints": np.trunc(_f(feeds["z"])).astype(np.int32),
        }

    feeds = {"x": x, "z": z}
    return make_model(nodes, feeds, ["b", "wide", "half", "ints"]), feeds, ref


def _matmul() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    x, w = _b(3, 40, 64), _b(64, 48, scale=1 / 8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"], {"w": w}), {"x": x}, lambda f: {"y": _f(f["x"]) @ _f(w)}


def _gemm() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    x, w, bias = _b(24, 80), _b(56, 80, scale=1 / 9), _b(56)
    nodes = [helper.make_node("Gemm", ["x", "w", "bias"], ["y"], transB=1, alpha=0.5, beta=2.0)]

    def ref(f: dict) -> dict:
        return {"y": 0.5 * _f(f["x"]) @ _f(w).T + 2.0 * _f(bias)}

    return make_model(nodes, {"x": x}, ["y"], {"w": w, "bias": bias}), {"x": x}, ref


def _softmax_model() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    x = _b(2, 6, 50, scale=3.0)
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1)]
    return make_model(nodes, {"x": x}, ["y"]), {"x": x}, lambda f: {"y": _softmax(_f(f["x"]))}


def _layer_norm() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    x, gamma, beta = _b(2, 10, 96, scale=4.0), _b(96), _b(96)
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]

    def ref(f: dict) -> dict:
        v = _f(f["x"])
        mean, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        return {"y": (v - mean) / np.sqrt(var + 1e-5) * _f(gamma) + _f(beta)}

    return make_model(nodes, {"x": x}, ["y"], {"g": gamma, "b": beta}), {"x": x}, ref


def _conv() -> tuple[onnx.ModelProto, dict, Callable[[dict], dict]]:
    """A 3x3 convolution with bias and a pointwise one after it (the flat product form)."""
    x, w1, b1, w2 = _b(1, 8, 10, 12), _b(16, 8, 3, 3, scale=1 / 8), _b(16), _b(24, 16, 1, 1, scale=1 / 4)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c1", "w2"], ["y"], kernel_shape=[1, 1]),
    ]

    def ref(f: dict) -> dict:
        v = np.pad(_f(f["x"]), ((0, 0), (0, 0), (1, 1), (1, 1)))
        c1 = np.zeros((1, 16, 10, 12))
        for i in range(3):
            for j in range(3):
                c1 += np.einsum("oc,nchw->nohw", _f(w1)[:, :, i, j], v[:, :, i : i + 10, j : j + 12])
        c1 = (c1 + _f(b1)[None, :, None, None]).astype(BF16).astype(np.float64)  # stored as bf16
        return {"y": np.einsum("oc,nchw->nohw", _f(w2)[:, :, 0, 0], c1)}

    consts = {"w1": w1, "b1": b1, "w2": w2}
    return make_model(nodes, {"x": x}, ["y"], consts), {"x": x}, ref


GRAPHS = {
    "elementwise": _elementwise,
    "casts": _casts,
    "matmul": _matmul,
    "gemm": _gemm,
    "softmax": _softmax_model,
    "layer norm": _layer_norm,
    "conv": _conv,
}


def _assert_matches(ours: dict, reference: dict, label: str) -> None:
    for name, expected in reference.items():
        got = ours[name]
        if isinstance(expected, np.ndarray) and expected.dtype != np.float64:
            assert got.dtype == expected.dtype, f"{label} {name}: {got.dtype} != {expected.dtype}"
            assert np.array_equal(got, expected, equal_nan=True), f"{label} {name}: not exact"
        else:
            err = error_metric(got.astype(np.float64), expected)
            assert err <= LIMIT, f"{label} {name}: error {err:.3e} > {LIMIT}"


# -- frontend and interpreter ----------------------------------------------------------------------


@pytest.mark.parametrize("label", list(GRAPHS))
def test_bf16_graph_is_imported_and_interpreted(label: str) -> None:
    model, feeds, ref = GRAPHS[label]()
    graph = import_onnx(model)
    assert {t.dtype for t in graph.inputs} <= {"bfloat16", "float32"}
    ours = graph.run(feeds)
    for name in ours:
        if graph.tensor(name).dtype == "bfloat16":
            assert ours[name].dtype == BF16, name
    _assert_matches(ours, ref(feeds), label)


def test_interpreter_computes_in_fp32_and_rounds_where_values_are_stored() -> None:
    """Each node's bf16 result is rounded once from its fp32 value: (x + c) * d rounds the
    sum before the product, which differs from rounding only the end result."""
    x = _b(4096)
    c, d = np.array(1.3, BF16), np.array(0.7, BF16)
    n = helper.make_node
    model = make_model(
        [n("Add", ["x", "c"], ["s"]), n("Mul", ["s", "d"], ["y"])], {"x": x}, ["y"], {"c": c, "d": d}
    )
    y = import_onnx(model).run({"x": x})["y"]
    f32 = np.float32
    per_node = ((x.astype(f32) + f32(c)).astype(BF16).astype(f32) * f32(d)).astype(BF16)
    once = ((x.astype(f32) + f32(c)) * f32(d)).astype(BF16)
    assert np.array_equal(y, per_node)
    assert not np.array_equal(per_node, once)  # the case tells the two apart


def test_bf16_initializer_and_constant_values_are_kept_exactly() -> None:
    w = _b(7, 5)
    node = helper.make_node("Constant", [], ["k"], value=onnx.numpy_helper.from_array(_b(5), "k"))
    model = make_model([node, helper.make_node("Add", ["w", "k"], ["y"])], {"w": w}, ["y"])
    graph = import_onnx(model)
    k = onnx.numpy_helper.to_array(node.attribute[0].t)
    assert np.array_equal(graph.run({"w": w})["y"], (_f(w) + _f(k)).astype(BF16))


# -- the reference for bf16 models ------------------------------------------------------------------


def test_onnxruntime_runs_what_it_has_bf16_kernels_for() -> None:
    """Transpose and LayerNormalization have bf16 CPU kernels: onnxruntime runs such a model
    itself (inputs and outputs as raw bf16 bits), and the interpreter agrees with it."""
    x, gamma, beta = _b(3, 40, 16, scale=3.0), _b(40), _b(40)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node("LayerNormalization", ["t", "g", "b"], ["y"], axis=-1),
    ]
    model = make_model(nodes, {"x": x}, ["y", "t"], {"g": gamma, "b": beta})
    assert reference_name(model) == "onnxruntime"
    ref = onnxruntime_outputs(model, {"x": x})
    assert ref["t"].dtype == BF16 and np.array_equal(ref["t"], x.transpose(0, 2, 1))
    ours = import_onnx(model).run({"x": x})
    assert error_metric(ours["y"], ref["y"]) <= LIMIT


def test_bf16_arithmetic_is_checked_against_the_exact_result() -> None:
    """No bf16 Add or Mul on onnxruntime's CPU: the reference is the model in fp32, its bf16
    values upcast and nothing rounded but the output -- numpy's fp32 (x + c) * d.  The
    interpreter rounds the sum first, as the kernels store it, and stays within the limit."""
    x = _b(4096)
    c, d = np.array(1.3, BF16), np.array(0.7, BF16)
    n = helper.make_node
    model = make_model(
        [n("Add", ["x", "c"], ["s"]), n("Mul", ["s", "d"], ["y"])], {"x": x}, ["y"], {"c": c, "d": d}
    )
    assert reference_name(model) == BF16_AS_FP32
    ref = onnxruntime_outputs(model, {"x": x})["y"]
    f32 = np.float32
    assert ref.dtype == BF16
    assert np.array_equal(ref, ((x.astype(f32) + f32(c)) * f32(d)).astype(BF16))
    ours = import_onnx(model).run({"x": x})["y"]
    assert not np.array_equal(ours, ref) and error_metric(ours, ref) <= LIMIT


def test_explicit_casts_to_bf16_still_round_in_the_reference() -> None:
    x = (RNG.standard_normal(1000) * 10).astype(np.float32)
    n = helper.make_node
    nodes = [n("Cast", ["x"], ["b"], to=TensorProto.BFLOAT16), n("Cast", ["b"], ["y"], to=TensorProto.FLOAT)]
    ref = onnxruntime_outputs(make_model(nodes, {"x": x}, ["y"]), {"x": x})["y"]
    assert ref.dtype == np.float32 and np.array_equal(ref, x.astype(BF16).astype(np.float32))


def test_saved_bf16_inputs_read_back_as_bf16(tmp_path: Path) -> None:
    """numpy keeps an ml_dtypes bfloat16 array in an .npz as raw 2-byte values; an
    export's inputs.npz of a bf16 model still reads back as the graph's bf16 inputs."""
    x = RNG.standard_normal((2, 3)).astype(BF16)
    graph = import_onnx(make_model([helper.make_node("Identity", ["x"], ["y"])], {"x": x}, ["y"]))
    np.savez(tmp_path / "inputs.npz", x=x)
    got = saved_inputs(tmp_path / "inputs.npz", graph)["x"]
    assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), x.view(np.uint16))


@pytest.mark.parametrize("label", ["matmul", "softmax", "conv"])
def test_the_fp32_reference_of_a_bf16_model_agrees_with_numpy(label: str) -> None:
    model, feeds, ref = GRAPHS[label]()
    _assert_matches(onnxruntime_outputs(model, feeds), ref(feeds), label)


def test_thresholds_follow_bf16_values() -> None:
    """bf16 outputs and fp32 outputs computed from bf16 values get the bf16 limit (above
    fp16's: bf16's unit roundoff is 8 times fp16's)."""
    assert THRESHOLDS["fp16"] < LIMIT <= 8 * THRESHOLDS["fp16"]
    x = _b(4, 16)
    n = helper.make_node
    model = make_model(
        [
            n("Softmax", ["x"], ["s"]),
            n("Cast", ["s"], ["wide"], to=TensorProto.FLOAT),
            n("Exp", ["wide"], ["y"]),
        ],
        {"x": x},
        ["y", "s"],
    )
    graph = import_onnx(model)
    assert output_threshold(graph, "s") == LIMIT
    assert output_threshold(graph, "y") == LIMIT  # an fp32 value carrying bf16 rounding


def test_recorded_precision_refuses_half_precisions(tmp_path: Path) -> None:
    (tmp_path / "tuned.json").write_text('{"precision": "bf16"}')
    with pytest.raises(ModelError, match="bf16"):
        recorded_precision(tmp_path)


# -- errors --------------------------------------------------------------------------------------


def test_a_bf16_op_welder_cannot_lower_is_named() -> None:
    x = _b(4, 4)
    model = make_model([helper.make_node("Det", ["x"], ["y"], name="the_det")], {"x": x}, ["y"])
    with pytest.raises(UnsupportedError, match="Det"):
        import_onnx(model)


def test_a_float32_array_for_a_bf16_input_is_refused(tmp_path: Path) -> None:
    model, feeds, _ = _matmul()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    sess = InferenceSession(path, backend="interpret")
    assert sess.get_inputs()[0].type == "tensor(bfloat16)"
    with pytest.raises(ModelError, match="bfloat16"):
        sess.run(None, {"x": feeds["x"].astype(np.float32)})


# -- the emulator's bf16 host type ------------------------------------------------------------------

_CONVERSIONS = r"""
extern "C" __global__ void from_float(const float* x, unsigned short* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __bfloat16_as_ushort(__float2bfloat16(x[i]));
}
extern "C" __global__ void from_double(const double* x, unsigned short* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __bfloat16_as_ushort(__double2bfloat16(x[i]));
}
extern "C" __global__ void from_integer(const long long* x, unsigned short* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __bfloat16_as_ushort(__nv_bfloat16(x[i]));
}
extern "C" __global__ void fma_like(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c,
                                    __nv_bfloat16* y, float* wide, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    y[i] = a[i] * b[i] + c[i];
    const __nv_bfloat162 pair = __floats2bfloat162_rn(__bfloat162float(a[i]), 0.5f);
    wide[i] = __low2float(pair) + __high2float(pair);
  }
}
"""


@pytest.fixture(scope="module")
def conversions():
    if not available():
        pytest.skip("the CPU emulator needs Linux and g++")
    return compile_kernels(
        '#include "welder_prelude.cuh"\n' + _CONVERSIONS,
        ["from_float", "from_double", "from_integer", "fma_like"],
        extra_flags=[f"-I{TEMPLATE_DIR}"],
    )


def _launch(module, name: str, x: np.ndarray, out_dtype=np.uint16) -> np.ndarray:
    y = np.zeros(x.shape, out_dtype)
    module.launch(name, -(-x.size // 64), 64, 0, [x, y, np.int32(x.size)])
    return y


def test_float_to_bf16_rounds_to_nearest_even(conversions) -> None:
    """Against ml_dtypes: ties both ways, subnormals, the largest finite values, infinities."""
    bits = RNG.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    bits[:1000] = (bits[:1000] & 0xFFFF0000) | 0x8000  # exact ties
    bits[1000:1100] &= 0x807FFFFF  # subnormal floats
    x = bits.view(np.float32)
    x = np.concatenate([x, np.array([3.4e38, -3.4e38, np.inf, -np.inf, 0.0, -0.0], np.float32)])
    y = _launch(conversions, "from_float", x)
    with np.errstate(invalid="ignore"):
        expected = x.astype(BF16)
    nan = np.isnan(x)
    assert np.array_equal(y[~nan], expected[~nan].view(np.uint16))
    assert np.all(np.isnan(y[nan].view(BF16)))


def test_double_and_integer_to_bf16_round_once_from_the_exact_value(conversions) -> None:
    """Just above a bf16 midpoint by less than a float ulp: through float the value would
    land on the midpoint and round to even (down); rounded from the exact value it goes up."""
    v = np.array([1.0, 1.5, 3.0, 2.0**-130], np.float64)  # even bf16 significands
    ulp = np.array([2.0**-7, 2.0**-7, 2.0**-6, 2.0**-133])
    x = v + ulp / 2 + ulp * 2.0**-20
    up = _launch(conversions, "from_double", x)
    assert np.array_equal(up, (v + ulp).astype(np.float32).astype(BF16).view(np.uint16))
    ints = np.array([2**30 + 2**22 + 1, -(2**40 + 2**32 + 1), 2**62 + 2**54, 255, 257], np.int64)
    expected = np.array([2**30 + 2**23, -(2**40 + 2**33), 2**62, 255, 256], np.float64)
    got = _launch(conversions, "from_integer", ints)
    assert np.array_equal(got, expected.astype(np.float32).astype(BF16).view(np.uint16))


def test_bf16_operators_round_each_result(conversions) -> None:
    a, b, c = _b(500), _b(500), _b(500)
    y, wide = np.zeros(500, BF16), np.zeros(500, np.float32)
    conversions.launch("fma_like", 8, 64, 0, [a, b, c, y, wide, np.int32(500)])
    f32 = np.float32
    product = (a.astype(f32) * b.astype(f32)).astype(BF16).astype(f32)
    assert np.array_equal(y, (product + c.astype(f32)).astype(BF16))
    assert np.array_equal(wide, a.astype(f32) + f32(0.5))


# -- generated kernels on the emulator -------------------------------------------------------------


def _emulate_model(graph: Graph, kinds: tuple[str, ...]) -> tuple[EmulatedModel, list[str]]:
    """The graph's kernels under the H100 plan of ``kinds``, and the kinds of its stages."""
    plan = plan_model(graph, get_arch("H100"), topk=1, kinds=kinds)
    kernels = generate_model(graph, [(p.group, p.configs[0]) for p in plan.groups])
    return EmulatedModel(graph, kernels), [st.kind for p in plan.groups for st in p.configs[0].stages]


@needs_emulator
@pytest.mark.parametrize("label", list(GRAPHS))
def test_simt_kernels_of_bf16_graphs_match_the_interpreter(label: str) -> None:
    model, feeds, ref = GRAPHS[label]()
    graph = import_onnx(model)
    emulated, kinds = _emulate_model(graph, kinds=("simt",))
    assert set(kinds) == {"simt"}
    ours = emulated.run(feeds)
    reference = graph.run(feeds)
    for name, value in ours.items():
        assert value.dtype == reference[name].dtype
        err = error_metric(value, reference[name])
        assert err <= threshold_for(graph.tensor(name).dtype), f"{label} {name}: {err:.3e}"
    _assert_matches(ours, ref(feeds), label)


def _bf16_case(label: str, cases: dict = CASES) -> tuple[Graph, Group, dict]:
    model, feeds = cases[label]()
    feeds = {k: v.astype(np.float32).astype(BF16) for k, v in feeds.items()}
    graph = import_onnx(to_bfloat16(model))
    return graph, _whole_group(graph), feeds


def _failures(
    graph: Graph, group: Group, configs: list[GroupConfig], feeds: dict, launches: int = 1
) -> list[str]:
    reference = graph.run(feeds)
    failures = []
    for cfg, runs in zip(configs, emulate_configs(graph, group, configs, feeds, launches)):
        for launch, outputs in enumerate(runs):
            for name, value in outputs.items():
                assert value.dtype == reference[name].dtype
                err = error_metric(value, reference[name])
                if err > threshold_for(graph.tensor(name).dtype):
                    failures.append(f"{cfg.stages[0]} launch {launch}: {name} error {err:.3e}")
    return failures


MMA_CASES = [
    "ragged 40x72x48",
    "ragged K and N, 4-byte copies",
    "A transposed (Gemm)",
    "B transposed (Gemm)",
    "bias + GELU, product also written",
    "QK^T + softmax",
    "residual add + LayerNorm, sum also written",
    "classifier, M = 1",
]


@needs_emulator
@pytest.mark.parametrize("label", MMA_CASES)
def test_mma_kind_computes_bf16_products(label: str) -> None:
    graph, group, feeds = _bf16_case(label)
    configs = mma.KIND.propose(group, _context(graph))
    assert configs and all(isinstance(c.stages[0], MmaConfig) for c in configs)
    kernel = generate_kernel(graph, group, configs[0], "bf16_probe")
    assert "welder_mma_m16n8k16_bf16f32" in kernel.source and "__nv_bfloat16" in kernel.source
    assert _failures(graph, group, configs[:2], feeds) == []


@needs_emulator
def test_mma_split_k_on_bf16() -> None:
    graph, group, feeds = _bf16_case("K of 7 slices, the last split shorter", SPLIT_CASES)
    ctx = _context(graph, topk=200)
    cfg = next(c for c in mma.KIND.propose(group, ctx) if c.stages[0].splits == 1)
    con = mma.contraction(group.computes[cfg.stages[0].node], ctx.shape_of)
    splits = split_choices(con, cfg.stages[0], cfg.num_blocks, ctx)
    assert splits
    configs = [replace(cfg, stages=[replace(cfg.stages[0], splits=s)]) for s in splits[:2]]
    assert _failures(graph, group, configs, feeds, launches=2) == []


def _padded_along_k(batch: int = 2, m: int = 40, k: int = 60, pad: int = 4, n: int = 48):
    """``pad(x, K) @ w`` in fp16: A's guard reads K, so A is gathered element by element."""
    rng = np.random.default_rng(23)
    x = rng.standard_normal((batch, m, k)).astype(np.float16)
    w = (rng.standard_normal((k + pad, n)) / np.sqrt(k)).astype(np.float16)
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["xp"]),
        helper.make_node("MatMul", ["xp", "w"], ["y"]),
    ]
    pads = np.array([0, 0, 0, 0, 0, pad], np.int64)
    return make_model(nodes, {"x": x}, ["y"], {"w": w, "pads": pads}, opset=17), {"x": x}


@needs_emulator
@pytest.mark.parametrize("kind", ["mma", "wgmma"])
@pytest.mark.parametrize("way", ["elements", "rows"])
def test_a_gathered_bf16_operand_is_copied_in_bf16(kind: str, way: str) -> None:
    """A operand padded along K is gathered into registers two elements at a time: in bf16
    the pairs are bfloat162 (a half2 there failed to compile); a rolled one (Swin's shifted
    windows) gathers whole rows, copied as bf16 bytes from each row's start.  Every config
    matches the interpreter."""
    from test_mma import rolled_product

    model, feeds = _padded_along_k() if way == "elements" else rolled_product(np.float16)
    feeds = {k: v.astype(np.float32).astype(BF16) for k, v in feeds.items()}
    graph = import_onnx(to_bfloat16(model))
    group = _whole_group(graph)
    configs = {"mma": mma.KIND, "wgmma": wgmma.KIND}[kind].propose(group, _context(graph, topk=4))
    assert configs and all(c.stages[0].kind == kind for c in configs)
    source = generate_kernel(graph, group, configs[0], "bf16_gather_probe").source
    assert ("__nv_bfloat162 a_pairs" if way == "elements" else "a_starts[j]") in source
    assert "__half" not in source
    assert _failures(graph, group, configs[:2], feeds) == []


WGMMA_CASES = ["ragged 40x72x48", "A transposed (Gemm)", "B transposed (Gemm)", "QK^T + softmax"]


@needs_emulator
@pytest.mark.parametrize("label", WGMMA_CASES)
def test_wgmma_kind_computes_bf16_products(label: str) -> None:
    """On the H100 (compute capability 9.0), both operand majornesses: the transpose flag
    serves bf16 as it serves fp16."""
    graph, group, feeds = _bf16_case(label)
    configs = wgmma.KIND.propose(group, _context(graph))
    assert configs and all(isinstance(c.stages[0], WgmmaConfig) for c in configs)
    source = generate_kernel(graph, group, configs[0], "bf16_wg_probe").source
    assert "welder_wgmma_m64k16_bf16f32" in source
    if label.startswith("A transposed"):  # A is MN-major: the instruction transposes it
        assert re.search(r"welder_wgmma_m64k16_bf16f32<\d+, 1, \d>", source)
    assert _failures(graph, group, configs[:2], feeds) == []


def test_tensor_core_kinds_take_bf16_only_where_the_instructions_exist() -> None:
    graph, group, _ = _bf16_case("ragged 40x72x48")
    shape, dtype = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    for arch, kind, proposes in (
        ("A100", mma.KIND, True),
        ("V100", mma.KIND, False),
        ("H100", wgmma.KIND, True),
        ("A100", wgmma.KIND, False),
    ):
        ctx = ScheduleContext(shape, dtype, get_arch(arch), Options(topk=4))
        assert bool(kind.propose(group, ctx)) == proposes, (arch, kind.name)


#: Transformer pieces whose products the H100 plan puts on tensor cores (as test_mma_models).
MODELS = {
    "bert layer": lambda: bert_encoder_layer(seq=64, hidden=256, heads=4, ffn=512)[0],
    "vit block": lambda: vit_block(image=64, patch=8, dim=256, heads=4, mlp=1024)[0],
}


@needs_emulator
@pytest.mark.parametrize("label", list(MODELS))
def test_bf16_model_on_tensor_cores_matches_the_reference(label: str, tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(to_bfloat16(MODELS[label]()), str(path))
    graph = import_onnx(path)
    plan = plan_model(graph, get_arch("H100"), topk=1)
    kinds = {st.kind for g in plan.groups for st in g.configs[0].stages}
    assert {"mma", "wgmma", "attention"} & kinds, f"{label}: no product on tensor cores ({kinds})"
    report = check_model(path, backend="emulate")
    assert report.reference == BF16_AS_FP32
    assert report.passed, report.format()


# -- nvcc ------------------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize(
    ("arch", "kind", "instruction"),
    [
        ("sm_80", "mma", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
        ("sm_90a", "wgmma", "wgmma.mma_async.sync.aligned.m64n"),
    ],
)
def test_bf16_kernels_compile_for_the_gpu(arch: str, kind: str, instruction: str, tmp_path: Path) -> None:
    """A bf16 BERT layer's kernels as the A100 plans them (mma), and a bf16 product's best
    wgmma kernels with both operand majornesses, compiled by nvcc to cubins."""
    if kind == "mma":
        graph = import_onnx(to_bfloat16(MODELS["bert layer"]()))
        plan = plan_model(graph, get_arch("A100"), topk=1)
        # mma.sync stages: the mma kind's, and the attention kind's (it also fuses an FFN whose
        # hidden rows fit a block)
        assert any(st.kind in (kind, "attention") for g in plan.groups for st in g.configs[0].stages)
        kernels = generate_model(graph, [(g.group, g.configs[0]) for g in plan.groups])
    else:
        kernels = []
        for j, label in enumerate(("ragged 40x72x48", "A transposed (Gemm)")):
            graph, group, _ = _bf16_case(label)
            cfg = wgmma.KIND.propose(group, _context(graph))[0]
            kernels.append(generate_kernel(graph, group, cfg, f"bf16_wgmma_{j}"))
    source = tmp_path / "model.cu"
    source.write_text(model_source(kernels))
    common = ["nvcc", "-std=c++17", f"-arch={arch}", "-I", str(TEMPLATE_DIR), str(source)]
    subprocess.run([*common, "-cubin", "-o", str(tmp_path / "m.cubin")], check=True, capture_output=True)
    ptx = tmp_path / "m.ptx"
    subprocess.run([*common, "-ptx", "-o", str(ptx)], check=True, capture_output=True)
    text = ptx.read_text()
    assert instruction in text and ".bf16" in text
