"""ONNX's backend conformance suite (``onnx.backend.test``) run through ``welder.onnx_backend``.

What is collected:

* every test of the suite whose graph uses nothing but default-domain operators welder
  claims (``CLAIMED_OPS``): the node tests, including the expanded function bodies built
  from claimed operators, and the small model tests shipped with onnx (simple,
  pytorch-converted, pytorch-operator and the "light" versions of the real models);
* of those, the cases exercising something welder deliberately does not do are skipped
  with a one-line reason: an element type outside welder's set, sequence/optional
  values, training mode, an opset-22+ feature that ONNX cannot express in opsets 11..21,
  and ill-conditioned data (``EXCLUDED`` and ``_automatic_exclusion``);
* tests of other operators and of the CUDA device are not collected at all.

An included case that fails is a bug (or a missing feature) of the lowering of its
operator and stays included until the lowering is fixed.  The suite runs in CI; the three
light models that take over 30 s on the interpreter run when ``WELDER_SLOW_TESTS=1``.
"""

from __future__ import annotations

import os
import re
import unittest
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.backend.test
import pytest
from onnx import helper
from onnx.backend.test.loader import load_model_tests

import welder.onnx_backend as welder_backend
from welder.errors import UnsupportedError
from welder.frontend.registry import dtype_from_onnx
from welder.onnx_backend import WelderBackend

# The operators welder claims to implement, by family.
CLAIMED_OPS = frozenset(
    (
        *("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Min", "Max", "Mean", "Sum", "Where"),
        *("Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Sin", "Cos", "Abs", "Neg", "Sign"),
        *("Floor", "Ceil", "Round", "Tanh", "Sigmoid", "Relu", "LeakyRelu", "PRelu", "Elu"),
        *("Celu", "Selu", "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Mish", "Gelu"),
        *("ThresholdedRelu", "Clip"),
        *("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor"),
        *("Cast", "CastLike", "IsNaN", "IsInf"),
        *("MatMul", "Gemm", "Einsum", "Conv", "ConvTranspose"),
        *("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"),
        *("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1"),
        *("ReduceL2", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin"),
        *("Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization"),
        *("InstanceNormalization", "GroupNormalization"),
        *("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Split", "Concat"),
        *("Pad", "Expand", "Tile", "Gather", "GatherElements", "GatherND", "OneHot"),
        *("DepthToSpace", "SpaceToDepth"),
        *("Resize", "Range", "Shape", "Size", "ConstantOfShape", "Constant", "Identity", "Dropout"),
    )
)

# Cases welder deliberately does not handle, by test-name pattern.  Element types and
# non-tensor values are found from the models themselves (_automatic_exclusion).
EXCLUDED: dict[str, str] = {
    r"^test_training_dropout": "training-mode Dropout draws random masks; welder compiles inference graphs",
    r"^test_batchnorm_.*training_mode": "training-mode BatchNormalization (batch statistics); inference only",
    r"^test_globalmaxpool": "opset-22 model and onnx.version_converter has no GlobalMaxPool adapter to 21",
    r"^test_mod_float.*fmod_0": "Mod with fmod=0 on floats is new in opset 28; opsets <= 21 require fmod=1",
    r"^test_range_float16_type": "float16 Range is new in opset 27",
    r"^test_celu_float16": "float16 Celu is new in opset 28",
    r"^test_range_bfloat16_type": "bfloat16 Range is new in opset 27",
    r"^test_celu_bfloat16": "bfloat16 Celu is new in opset 28",
    r"^test_einsum_.*bfloat16": "bfloat16 Einsum is new in opset 28",
    r"^test_onehot_with_bfloat16": "bfloat16 OneHot values are new in opset 28",
    r"^test_spacetodepth_crd_mode": "SpaceToDepth's mode attribute is new in opset 28",
    r"^test_PReLU_\dd_multiparam": (
        "opset-6 per-channel PRelu slope; onnx.version_converter keeps a shape that opset 7+ cannot broadcast"
    ),
    r"^test_resize_.*cubic": "cubic interpolation is not supported (nearest and linear are); import says so",
    r"^test_resize_.*antialias": "antialiased resizing is not supported; import says so",
    r"^test_maxpool_with_argmax": "MaxPool's Indices output is not supported; import says so",
    r"^test_resize_downsample_scales_linear_align_corners$": (
        "onnxruntime and the ONNX reference disagree (align_corners with a fractional scaled length); "
        "welder follows onnxruntime, checked in test_ops_resize"
    ),
    r"^test_squeezenet": (
        "identical logits of ~1e10 into Softmax: one-ulp summation differences make a uniform output one-hot"
    ),
}

# Light real models that take over 30 s each on the interpreter (two cores).
SLOW_MODELS = ("test_densenet121", "test_inception_v2", "test_vgg19")
RUN_SLOW = os.environ.get("WELDER_SLOW_TESTS", "") not in ("", "0")

_MODEL_KINDS = ("simple", "pytorch-converted", "pytorch-operator", "real")


def _cases() -> Iterator[tuple[str, onnx.ModelProto]]:
    """(test name, model) for every test of the suite that is stored with the package."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        for case in load_model_tests(kind="node"):
            yield case.name, case.model
    for kind in _MODEL_KINDS:
        for case in load_model_tests(kind=kind):
            if case.model_dir is not None:
                path = Path(case.model_dir) / "model.onnx"
            elif case.url and case.url.startswith("onnx/backend/test/data/light/"):
                path = Path(onnx.__file__).parent.parent / case.url
            else:  # a download; the tests run offline
                continue
            yield case.name, onnx.load(str(path), load_external_data=False)


def _uses_only_claimed_ops(model: onnx.ModelProto) -> bool:
    return all(n.domain in ("", "ai.onnx") and n.op_type in CLAIMED_OPS for n in model.graph.node)


def _elem_types(model: onnx.ModelProto) -> Iterator[int]:
    """Every element type the model declares, initialises, creates or casts to."""
    g = model.graph
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.type.WhichOneof("value") == "tensor_type":
            yield vi.type.tensor_type.elem_type
    for t in g.initializer:
        yield t.data_type
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t.data_type
            elif node.op_type == "Cast" and a.name == "to":
                yield a.i


def _automatic_exclusion(model: onnx.ModelProto) -> str | None:
    """Why welder cannot run ``model`` by design, judged from its types; None if it can."""
    g = model.graph
    for vi in (*g.input, *g.output):
        kind = vi.type.WhichOneof("value")
        if kind != "tensor_type":
            return f"{kind} values (welder handles tensors only)"
    for elem in _elem_types(model):
        if elem == onnx.TensorProto.UNDEFINED:
            continue
        try:
            dtype_from_onnx(elem, "")
        except UnsupportedError:
            return f"element type {onnx.TensorProto.DataType.Name(elem)} is not a welder dtype"
    return None


def _plan() -> tuple[set[str], dict[str, str]]:
    """Names of the collected cases and, for the skipped ones, the reason."""
    collected: set[str] = set()
    reasons: dict[str, str] = {}
    for name, model in _cases():
        if not _uses_only_claimed_ops(model):
            continue
        collected.add(name)
        reason = next((r for p, r in EXCLUDED.items() if re.search(p, name)), None)
        reason = reason or _automatic_exclusion(model)
        if reason is None and name in SLOW_MODELS and not RUN_SLOW:
            reason = "over 30 s on the interpreter; set WELDER_SLOW_TESTS=1 to run it"
        if reason is not None:
            reasons[name] = reason
    return collected, reasons


COLLECTED, SKIP_REASONS = _plan()
INCLUDED = sorted(COLLECTED - set(SKIP_REASONS))


def _test_classes() -> dict[str, type[unittest.TestCase]]:
    """onnx's generated TestCase classes, reduced to the collected CPU cases, with the
    excluded ones marked skipped."""
    backend_test = onnx.backend.test.BackendTest(WelderBackend, __name__)
    backend_test.include("^(" + "|".join(map(re.escape, sorted(COLLECTED))) + ")_cpu$")
    classes = backend_test.test_cases
    for case in classes.values():
        for attr in [a for a in vars(case) if a.startswith("test_")]:
            name = attr.removesuffix("_cpu")
            if not attr.endswith("_cpu") or name not in COLLECTED:
                delattr(case, attr)
            elif name in SKIP_REASONS:
                setattr(case, attr, unittest.skip(SKIP_REASONS[name])(getattr(case, attr)))
    return classes


globals().update(_test_classes())


@pytest.fixture(autouse=True, scope="module")
def _onnx_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The light real-model tests write their input data under ONNX_HOME; keep it out
    of the user's home directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONNX_HOME", str(tmp_path_factory.mktemp("onnx_home")))
        yield


def test_every_exclusion_pattern_is_used() -> None:
    """A pattern that matches no collected case is stale (renamed upstream, or fixed) and
    must be removed rather than silently kept."""
    stale = [p for p in EXCLUDED if not any(re.search(p, n) for n in COLLECTED)]
    assert not stale, f"exclusion patterns matching nothing: {stale}"


def test_suite_is_not_empty() -> None:
    """Guards the include list against a change of test names in onnx."""
    assert len(INCLUDED) > 500


# -- the backend API itself ------------------------------------------------------------------


def _add_model(shape: Sequence[int | str] = (2, 3), opset: int = 17) -> onnx.ModelProto:
    """z = x + y over ``shape``, whose entries may be symbolic (strings)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"])],
        "add",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(shape)) for n in ("x", "y")],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_run_takes_a_sequence_or_a_mapping() -> None:
    x, y = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 0.5, np.float32)
    rep = welder_backend.prepare(_add_model())
    np.testing.assert_array_equal(rep.run([x, y])[0], x + y)
    out = rep.run({"y": y, "x": x})
    np.testing.assert_array_equal(out["z"], x + y)


def test_symbolic_dimensions_take_the_shapes_of_each_run() -> None:
    rep = welder_backend.prepare(_add_model(("N", 3)))
    for n in (1, 4):
        x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
        np.testing.assert_array_equal(rep.run([x, x])[0], x + x)


def test_shape_inputs_are_specialised_per_value() -> None:
    """Reshape's shape as a model input: each value gets its own import, none is reused
    for another value."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"])],
        "reshape",
        [
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 6]),
            helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )
    rep = welder_backend.prepare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    for shape in ([3, 4], [4, 3], [3, 4]):
        np.testing.assert_array_equal(rep.run([x, np.array(shape)])[0], x.reshape(shape))


def test_models_of_newer_opsets_are_converted() -> None:
    x = np.linspace(-3, 3, 6, dtype=np.float32).reshape(2, 3)
    expected = np.where(x < 0, np.expm1(x), x)
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Elu", ["x"], ["y"])],
            "elu",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        ),
        opset_imports=[helper.make_opsetid("", 22)],
    )
    np.testing.assert_allclose(welder_backend.run_model(model, [x])[0], expected, rtol=1e-6)


def test_run_node() -> None:
    a, b = np.ones((2, 1), np.float32), np.arange(3, dtype=np.float32)
    (out,) = welder_backend.run_node(helper.make_node("Mul", ["a", "b"], ["c"]), [a, b])
    np.testing.assert_array_equal(out, a * b)


def test_cpu_only() -> None:
    assert welder_backend.supports_device("CPU")
    assert not welder_backend.supports_device("CUDA")
    assert not welder_backend.supports_device("TPU")
    with pytest.raises(UnsupportedError, match="CUDA"):
        welder_backend.prepare(_add_model(), "CUDA")


def test_unsupported_models_fail_at_prepare() -> None:
    model = _add_model()
    model.graph.node[0].op_type = "BitShift"
    assert not welder_backend.is_compatible(model)
    assert welder_backend.is_compatible(_add_model())
    with pytest.raises(UnsupportedError, match="BitShift"):
        welder_backend.prepare(model)
