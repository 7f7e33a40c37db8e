"""``welder profile``: each group's arithmetic and bytes against independent counts from the ONNX
model, floors and rates against the arch's figures, the three sources of times, the JSON, and
errors for what cannot be profiled."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx_util import make_model

from welder import profile
from welder.arch import get_arch
from welder.cli import main as welder_main
from welder.runtime.build import build_runtime
from welder.runtime.emu import available as emulator_available

M, K, N = 48, 80, 56
ARCH = get_arch("H100")


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=1, axes=None),
    ]
    model = make_model(nodes, {"x": x}, ["y", "s"], {"w": w, "b": b})
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    model.graph.initializer.append(axes)
    model.graph.node[2].input.append("axes")
    return model


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model tuned by the cost model (nothing built, nothing measured)."""
    out = tmp_path_factory.mktemp("profile") / "mlp"
    out.mkdir()
    onnx.save(_model(), str(out / "model.onnx"))
    assert welder_main(["tune", str(out), "--arch", "H100", "--cost-model", "--no-build"]) == 0
    return out


def _sizes() -> dict[str, int]:
    """Bytes of every tensor of the model, from the ONNX model itself."""
    return {"x": M * K * 4, "w": K * N * 4, "b": N * 4, "h": M * N * 4, "y": M * N * 4, "s": M * 4}


def _flops(ops: list[str]) -> int:
    per_op = {"MatMul": 2 * M * N * K, "Add": M * N, "ReduceSum": M * N}
    return sum(per_op[op] for op in ops)


def _profile(prefix: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "profile.json"
    assert welder_main(["profile", str(prefix), "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_groups_count_the_model_s_arithmetic_and_bytes(prefix: Path, tmp_path: Path, capsys) -> None:
    tuned = json.loads((prefix / "tuned.json").read_text())
    report = _profile(prefix, tmp_path, "--source", "predicted")
    printed = capsys.readouterr().out
    assert "the cost model's predictions" in printed and "floor of the model" in printed
    by_root = {g["root"]: g for g in report["groups"]}
    assert set(by_root) == {g["root"] for g in tuned["groups"]}
    sizes = _sizes()
    for g in tuned["groups"]:
        p = by_root[g["root"]]
        assert p["flops"] == _flops(g["ops"]), g["ops"]
        assert p["bytes"] == sum(sizes[t] for t in (*g["inputs"], *g["outputs"]))
        assert p["time_us"] == pytest.approx(g["predicted_latency_us"])
        compute, memory = p["flops"] / (ARCH.fp32_tflops * 1e6), p["bytes"] / (ARCH.global_bw_gbs * 1e3)
        assert p["floor_us"] == pytest.approx(max(compute, memory))
        assert p["bound"] == ("compute" if compute >= memory else "memory")
        assert p["tflops"] == pytest.approx(p["flops"] / p["time_us"] / 1e6, rel=1e-3)
    assert sum(g["share"] for g in report["groups"]) == pytest.approx(1.0)
    times = [g["time_us"] for g in report["groups"]]
    assert times == sorted(times, reverse=True)
    # The model: its FLOPs once, its inputs, weights and outputs once (ReduceSum's axes are an
    # attribute once imported, not data); fp32, so every FLOP is at the fp32 ceiling.
    assert report["model_flops"] == _flops(["MatMul", "Add", "ReduceSum"])
    model_bytes = sizes["x"] + sizes["w"] + sizes["b"] + sizes["y"] + sizes["s"]
    assert report["model_bytes"] == model_bytes
    floor = max(report["model_flops"] / (ARCH.fp32_tflops * 1e6), model_bytes / (ARCH.global_bw_gbs * 1e3))
    assert report["model_floor_us"] == pytest.approx(floor, rel=1e-3)


def test_the_tuner_s_measurements_are_used_where_they_exist(
    prefix: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "measured"
    shutil.copytree(prefix, copy)
    tuned = json.loads((copy / "tuned.json").read_text())
    for k, g in enumerate(tuned["groups"]):
        g["measured_latency_us"] = 10.0 * (k + 1)
    (copy / "tuned.json").write_text(json.dumps(tuned))
    monkeypatch.setattr(profile, "_gpu_present", lambda: False)  # so the default is the tuning source
    report = _profile(copy, tmp_path)
    assert "tuner's measurements" in report["source"]
    measured = {g["root"]: g["measured_latency_us"] for g in tuned["groups"]}
    for p in report["groups"]:
        assert p["time_us"] == measured[p["root"]]
        assert p["efficiency"] == pytest.approx(p["floor_us"] / p["time_us"], rel=1e-3)
    assert report["total_us"] == pytest.approx(sum(measured.values()))


def test_what_cannot_be_profiled_is_said(prefix: Path, tmp_path: Path, capsys) -> None:
    assert welder_main(["profile", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder that `welder tune` wrote" in capsys.readouterr().err
    assert welder_main(["profile", str(tmp_path)]) == 2
    assert "no model.json" in capsys.readouterr().err
    assert welder_main(["profile", str(prefix), "--source", "tuning"]) == 2
    assert "holds no measurements" in capsys.readouterr().err
    assert welder_main(["profile", str(prefix), "--number", "0"]) == 2
    assert "--number must be >= 1" in capsys.readouterr().err
    assert welder_main(["profile", str(prefix), "--source", "predicted", "--arch", "Z80"]) == 2
    assert "Z80" in capsys.readouterr().err
    # tuned.json of another tune (another export's tensor names) beside this model.json
    other = tmp_path / "other"
    shutil.copytree(prefix, other)
    tuned = json.loads((other / "tuned.json").read_text())
    tuned["groups"][0]["inputs"][0] = "onnx::MatMul_1348"
    (other / "tuned.json").write_text(json.dumps(tuned))
    assert welder_main(["profile", str(other), "--source", "predicted"]) == 2
    assert "names tensors that" in (err := capsys.readouterr().err) and "'onnx::MatMul_1348'" in err
    assert "different tunes" in err


@pytest.mark.skipif(not (emulator_available() and shutil.which("cmake")), reason="needs g++ and cmake")
def test_steps_of_the_built_runtime_are_timed_per_group(prefix: Path, tmp_path: Path, capsys) -> None:
    """Built for the emulator, the run source times every step through the runtime's
    measure_steps and sums them per group (the emulator's wall-clock times: the plumbing, not
    a GPU's speed)."""
    copy = tmp_path / "built"
    shutil.copytree(prefix, copy)
    build_runtime(copy, emulate=True)
    report = _profile(copy, tmp_path, "--source", "run", "--number", "2")
    assert "emulator" in report["device"] and report["end_to_end_us"] > 0
    tuned = json.loads((copy / "tuned.json").read_text())
    assert {g["root"] for g in report["groups"]} <= {g["root"] for g in tuned["groups"]}
    assert all(g["time_us"] > 0 and g["launches"] >= 1 for g in report["groups"])
    assert math.isclose(sum(g["share"] for g in report["groups"]), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("kind", "half", "ceiling"),
    [
        ("attention+simt", True, "fp16_tc_tflops"),
        ("wgmma+simt", True, "fp16_tc_tflops"),
        ("attention_ffma+simt", False, "fp32_tflops"),
        ("ffma", False, "fp32_tflops"),
        ("mma_tf32", False, "tf32_tc_tflops"),
        ("simt", True, "fp32_tflops"),
    ],
)
def test_each_kind_is_held_to_the_ceiling_of_its_units(kind: str, half: bool, ceiling: str) -> None:
    """The FLOP rate a group is compared with: tensor cores for the fp16 attention kernel as
    for the product kinds, CUDA cores for the exact fp32 kinds and the SIMT kind."""
    assert profile._ceiling(kind, half, ARCH) == getattr(ARCH, ceiling)


def test_three_tf32_products_are_held_to_a_third_of_the_tf32_rate() -> None:
    assert profile._ceiling("mma_tf32x3+simt", False, ARCH) == ARCH.tf32_tc_tflops / 3


def test_a_tf32_tune_s_floor_counts_its_contractions_at_the_tf32_rate(prefix: Path, tmp_path: Path) -> None:
    """Allowed TF32 (tuned.json's precision), the fp32 contractions' ceiling is the TF32
    tensor cores', the rest stays at the fp32 rate; the same files without it keep fp32.
    The model's FLOPs are scaled up a millionfold so that compute, not memory, bounds it."""
    from welder.profile import model_floor, prefix_floor

    model = json.loads((prefix / "model.json").read_text())
    for n in model["nodes"]:
        n["flops"] = int(n.get("flops", 0)) * 10**6
    sizes = _sizes()
    memory = (sizes["x"] + sizes["w"] + sizes["b"] + sizes["y"] + sizes["s"]) / (ARCH.global_bw_gbs * 1e3)
    contractions = 10**6 * _flops(["MatMul", "ReduceSum"]) / (ARCH.tf32_tc_tflops * 1e6)
    tf32 = contractions + 10**6 * _flops(["Add"]) / (ARCH.fp32_tflops * 1e6)
    exact = 10**6 * _flops(["MatMul", "Add", "ReduceSum"]) / (ARCH.fp32_tflops * 1e6)
    assert memory < tf32 < exact
    assert model_floor(model, ARCH, "tf32").floor_us == pytest.approx(tf32, rel=1e-3)
    assert model_floor(model, ARCH, "fp32").floor_us == pytest.approx(exact, rel=1e-3)
    # prefix_floor reads the precision from tuned.json
    other = tmp_path / "tf32"
    shutil.copytree(prefix, other)
    (other / "model.json").write_text(json.dumps(model))
    tuned = json.loads((other / "tuned.json").read_text())
    assert prefix_floor(other).floor_us == pytest.approx(exact, rel=1e-3)
    tuned["precision"] = "tf32"
    (other / "tuned.json").write_text(json.dumps(tuned))
    assert prefix_floor(other).floor_us == pytest.approx(tf32, rel=1e-3)
