"""Hostile and old input at import: opsets older than 11 upgraded, malformed graph wiring,
empty files and tensors too large for memory -- each a clear error naming the fault (exit
2 from the command line) and nothing written."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx_util import assert_close, make_model

from welder.check import onnxruntime_outputs
from welder.cli import main
from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import MIN_OPSET, MemoryLimit, OpsetUpgradeWarning, host_memory, import_onnx

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(0)


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _legacy_model(opset: int) -> onnx.ModelProto:
    """A small conv net written with the operator versions of opset 9 or 10, several of
    which changed meaning later: BatchNormalization (training outputs), Dropout (ratio
    an attribute until 12), Upsample (removed in 10) / Resize (new coordinate modes in 11),
    Slice (attributes until 10), Pad (pads an attribute until 11)."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"], epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Dropout", ["r"], ["d"], ratio=0.3),
        helper.make_node("MaxPool", ["d"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Pad", ["p"], ["pp"], pads=[0, 0, 1, 0, 0, 0, 0, 1], mode="edge"),
    ]
    if opset == 9:
        nodes.append(helper.make_node("Upsample", ["pp", "scales"], ["u"], mode="nearest"))
        nodes.append(helper.make_node("Slice", ["u"], ["sl"], starts=[1, 0], ends=[9, 8], axes=[2, 3]))
        inits = {}
    else:
        nodes.append(helper.make_node("Resize", ["pp", "scales"], ["u"], mode="linear"))
        nodes.append(helper.make_node("Slice", ["u", "st", "en", "ax"], ["sl"]))
        inits = {"st": np.array([1, 0]), "en": np.array([9, 8]), "ax": np.array([2, 3])}
    nodes += [
        helper.make_node("Flatten", ["sl"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "g", "gb"], ["y"], transB=1),
    ]
    inits |= {
        "w": _f32(4, 3, 3, 3),
        "s": RNG.random(4).astype(np.float32) + 0.5,
        "b": _f32(4),
        "m": _f32(4),
        "v": RNG.random(4).astype(np.float32) + 0.5,
        "scales": np.array([1, 1, 2, 2], np.float32),
        "g": _f32(5, 4 * 8 * 8),
        "gb": _f32(5),
    }
    model = make_model(nodes, {"x": _f32(1, 3, 8, 8)}, ["y"], inits, opset)
    model.ir_version = 5
    return model


@pytest.mark.parametrize("opset", [9, 10])
def test_models_older_than_opset_11_are_upgraded_and_match_onnxruntime(opset):
    model = _legacy_model(opset)
    x = _f32(1, 3, 8, 8)
    with pytest.warns(OpsetUpgradeWarning, match=f"opset {opset}.*opset {MIN_OPSET}"):
        graph = import_onnx(model)
    reference = onnxruntime_outputs(model, {"x": x}, ["y"])  # the original, un-upgraded model
    assert_close(graph.run({"x": x}), reference)


def test_the_upgrade_is_said_once_on_stderr(tmp_path):
    onnx.save(_legacy_model(9), tmp_path / "old.onnx")
    done = subprocess.run(
        [sys.executable, "-m", "welder.cli", "check", str(tmp_path / "old.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "PASS"
    assert done.stderr.count("upgrading it to opset 11") == 1, done.stderr


def _old_model(nodes, opset: int, inputs=("x",)) -> onnx.ModelProto:
    model = make_model(nodes, {name: _f32(2, 3) for name in inputs}, ["y"], opset=opset)
    model.ir_version = 4
    return model


def test_what_the_converter_cannot_upgrade_names_opset_and_reason():
    gru = _old_model([helper.make_node("GRU", ["x", "x", "x"], ["y"], hidden_size=3)], 3)
    with pytest.raises(ModelError) as e:
        import_onnx(gru)
    text = str(e.value)
    assert "opset 3" in text and "cannot upgrade" in text and "GRU" in text
    assert "convert.cc" not in text and "Assertion" not in text
    # An operator that never was part of ONNX at that opset is named with its node.
    stray = _old_model([helper.make_node("DynamicSlice", ["x", "x", "x"], ["y"], name="ds")], 9)
    with pytest.raises(ModelError, match=r"opset 9.*DynamicSlice node 'ds' is no operator of ONNX opset 9"):
        import_onnx(stray)


def _wiring_models() -> dict[str, tuple[onnx.ModelProto, str]]:
    x = {"x": _f32(2, 3)}
    return {
        "no outputs": (make_model([helper.make_node("Relu", ["x"], ["y"])], x, []), "no graph outputs"),
        "two producers": (
            make_model(
                [
                    helper.make_node("Relu", ["x"], ["Y"], name="first"),
                    helper.make_node("Exp", ["x"], ["Y"], name="second"),
                ],
                x,
                ["Y"],
            ),
            "tensor 'Y' is written by Relu node 'first' and is also written by Exp node 'second'",
        ),
        "output twice": (
            make_model([helper.make_node("Relu", ["x"], ["Y"])], x, ["Y", "Y"]),
            "graph output 'Y' is listed twice",
        ),
        "input produced": (
            make_model([helper.make_node("Relu", ["x"], ["x"], name="r")], x, ["x"]),
            "tensor 'x' is a graph input and is also written by Relu node 'r'",
        ),
        "output from nowhere": (
            make_model([helper.make_node("Relu", ["x"], ["y"])], x, ["y", "ghost"]),
            "graph output 'ghost' is not produced",
        ),
    }


@pytest.mark.parametrize("case", list(_wiring_models()))
def test_malformed_wiring_is_named(tmp_path, capsys, case):
    model, message = _wiring_models()[case]
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["import", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_empty_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / "model.onnx").write_bytes(b"")
    assert main(["check", str(tmp_path)]) == 2
    assert "is empty (0 bytes)" in capsys.readouterr().err


def test_tensors_larger_than_the_memory_limit():
    """Sizes against an explicit limit, with the byte counts computed here by numpy."""
    x = _f32(2, 3)
    nodes = [
        helper.make_node("Expand", ["x", "shape"], ["big"], name="expand"),
        helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0),
    ]
    model = make_model(nodes, {"x": x}, ["y"], {"shape": np.array([50, 2, 3])})
    assert import_onnx(model, memory=MemoryLimit(10_000, "test memory")).run({"x": x})
    needed = np.empty((50, 2, 3), np.float32).nbytes
    with pytest.raises(ModelError) as e:
        import_onnx(model, memory=MemoryLimit(needed - 1, "test memory"))
    text = str(e.value)
    assert "Expand node 'expand'" in text and f"[50, 2, 3]) takes 1.2 KiB ({needed:,} bytes)" in text
    with pytest.raises(ModelError, match=r"model input 'x' \(float32 \[2, 3\]\) takes 24 bytes"):
        import_onnx(model, memory=MemoryLimit(23, "test memory"))
    weights = make_model([helper.make_node("Add", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": _f32(40, 3)})
    with pytest.raises(ModelError, match="initializer 'w'"):
        import_onnx(weights, memory=MemoryLimit(400, "test memory"))


def test_host_memory_is_at_most_the_physical_memory():
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < host_memory().bytes <= physical


def _run_limited(args: list[str], gib: int = 4) -> subprocess.CompletedProcess:
    """``welder ARGS`` in a child that cannot map more than ``gib`` GiB: a tensor allocated
    before its size is checked fails there with MemoryError (exit 1), not the machine."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))

    return subprocess.run(
        [sys.executable, "-m", "welder.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        preexec_fn=limit,
    )


def test_huge_input_shape_fails_at_import(tmp_path):
    model = make_model([helper.make_node("Relu", ["X"], ["y"])], {"X": _f32(1, 8)}, ["y"])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    onnx.save(model, tmp_path / "m.onnx")
    done = _run_limited(["check", str(tmp_path / "m.onnx"), "--input-shape", "X=99999999999x8"])
    assert done.returncode == 2, done.stderr
    assert (
        f"model input 'X' (float32 [99999999999, 8]) takes 2.9 TiB ({99999999999 * 8 * 4:,} bytes)"
        in done.stderr
    )
    assert "--input-shape" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("op", ["ConstantOfShape", "Range"])
def test_huge_constant_subgraphs_fail_before_allocating(tmp_path, op):
    if op == "ConstantOfShape":
        value = numpy_helper.from_array(np.ones(1, np.float32))
        node = helper.make_node(op, ["dims"], ["c"], name="huge", value=value)
        inits = {"dims": np.array([100_000, 100_000, 100])}
        expected = "ConstantOfShape node 'huge'"
    else:
        node = helper.make_node(op, ["start", "limit", "delta"], ["c"], name="huge")
        inits = {"start": np.array(0.0, np.float32), "limit": np.array(2.0**40, np.float32)}
        inits["delta"] = np.array(1.0, np.float32)
        expected = f"Range node 'huge': output (float32 [{2**40}]) takes 4.0 TiB"
    model = make_model([node, helper.make_node("Max", ["c", "x"], ["y"])], {"x": _f32(1)}, ["y"], inits)
    onnx.save(model, tmp_path / "m.onnx")
    done = _run_limited(["check", str(tmp_path / "m.onnx")])
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "of available host memory" in done.stderr, done.stderr


def test_unsupported_ops_of_other_domains_in_old_models_are_listed():
    model = _old_model([helper.make_node("Fancy", ["x"], ["y"], domain="com.example")], 9)
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedError, match=r"com\.example\.Fancy \(opset 1\)"):
        import_onnx(model)


@pytest.mark.parametrize(
    "op, opset, mode, scales",
    [
        ("Upsample", 9, "linear", [1, 1, 2, 2]),
        ("Upsample", 9, "nearest", [1, 1, 1.5, 2.5]),
        ("Resize", 10, "linear", [1, 1, 0.5, 1.7]),
        ("Resize", 10, "nearest", [1, 1, 3, 2.5]),
        ("Resize", 10, "nearest", [1, 1, 0.5, 0.6]),
        ("Resize", 10, "nearest", [1, 1, 3, 0.7]),
    ],
)
def test_resizes_before_opset_11_keep_their_coordinates(op, opset, mode, scales):
    """onnx.version_converter alone gives these opset 11's half-pixel coordinates; compared
    with onnxruntime running the original opset-9/10 model."""
    x = _f32(1, 2, 7, 9)
    node = helper.make_node(op, ["x", "scales"], ["y"], mode=mode, name="rs")
    model = make_model([node], {"x": x}, ["y"], {"scales": np.array(scales, np.float32)}, opset)
    model.ir_version = 5
    with pytest.warns(OpsetUpgradeWarning):
        graph = import_onnx(model)
    assert_close(graph.run({"x": x}), onnxruntime_outputs(model, {"x": x}, ["y"]))
