"""``welder tune`` end to end without a GPU: plan by the cost model, generate, emit and
build the runtime (nvcc), and check the built runtime through the emulator."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from models import bert_encoder_layer, mobilenetv2_block

from welder.cli import main
from welder.runtime.layout import library_path, main_test_path

HAS_TOOLCHAIN = shutil.which("cmake") is not None and (
    shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
)


@pytest.fixture
def bert_prefix(tmp_path: Path) -> Path:
    model, _ = bert_encoder_layer()
    prefix = tmp_path / "bert"
    prefix.mkdir()
    onnx.save(model, prefix / "model.onnx")
    return prefix


def test_tune_writes_plan_kernels_and_runtime_sources(bert_prefix: Path, capsys) -> None:
    code = main(["tune", str(bert_prefix), "--arch", "A100", "--cost-model", "--topk", "3", "--no-build"])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads((bert_prefix / "tuned.json").read_text())
    assert doc["arch"] == "A100" and doc["totals"]["kernels"] == len(doc["groups"])
    assert doc["totals"]["unfused_kernels"] > doc["totals"]["kernels"]
    for group in doc["groups"]:
        assert 1 <= len(group["configs"]) <= 3 and group["members"] and group["outputs"][-1] == group["root"]
        assert (
            "__global__" in group["kernel"]["source"] and group["kernel"]["name"] in group["kernel"]["source"]
        )
    assert (bert_prefix / "model.json").is_file()
    assert (bert_prefix / "nnfusion_rt" / "cuda_codegen" / "nnfusion_rt.cu").is_file()
    assert f"{len(doc['groups'])} kernels (unfused: {doc['totals']['unfused_kernels']})" in out


def test_tune_of_a_file_elsewhere_copies_the_model(tmp_path: Path, capsys) -> None:
    model, _ = mobilenetv2_block()
    onnx.save(model, tmp_path / "mbv2.onnx")
    assert main(["tune", str(tmp_path / "mbv2.onnx"), "--cost-model", "--arch", "H100", "--no-build"]) == 0
    assert (tmp_path / "mbv2" / "model.onnx").is_file() and (tmp_path / "mbv2" / "tuned.json").is_file()


def test_tune_without_gpu_asks_for_the_cost_model(bert_prefix: Path, capsys) -> None:
    pytest.importorskip("welder.gpu")
    from welder.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    assert main(["tune", str(bert_prefix), "--arch", "H100", "--no-build"]) == 2
    assert "--cost-model" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="needs cmake and nvcc")
def test_tune_builds_the_runtime_with_nvcc_and_it_checks_out_emulated(bert_prefix: Path, capsys) -> None:
    """The CI path of the design: `--cost-model --topk 1` generates and builds the whole
    runtime for a small model; the same sources then run on the CPU through the emulator
    and test_acc compares them with onnxruntime."""
    code = main(
        ["tune", str(bert_prefix), "--arch", "H100", "--cost-model", "--topk", "1", "--cuda-arch", "90"]
    )
    assert code == 0, capsys.readouterr().err
    assert library_path(bert_prefix).is_file() and main_test_path(bert_prefix).is_file()
    assert main(["build", str(bert_prefix), "--emulate"]) == 0
    acc = subprocess.run(
        [sys.executable, "artifacts/test_acc.py", str(bert_prefix)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert acc.returncode == 0, acc.stdout + acc.stderr
    assert "PASS" in acc.stdout


class _FakeGpu:
    """The fake device of the tuner tests, behind the context-manager face of GpuDevice."""

    def __init__(self, graph_holder: dict) -> None:
        self.holder = graph_holder

    def __call__(self, *args, **kwargs):
        from test_tuner import ScriptedDevice

        self.device = ScriptedDevice(self.holder["graph"])
        return self

    def __enter__(self):
        return self.device

    def __exit__(self, *exc) -> None:
        return None


def test_second_tune_takes_every_group_from_the_cache(bert_prefix: Path, tmp_path: Path, monkeypatch, capsys):
    """`welder tune` twice on the same model: the second run measures nothing."""
    import welder.pipeline as pipeline
    from welder.frontend.onnx import import_onnx

    holder = {"graph": import_onnx(bert_prefix / "model.onnx")}
    fake = _FakeGpu(holder)
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "gpu_available", lambda: True)
    monkeypatch.setattr(pipeline, "GpuDevice", fake)
    monkeypatch.setattr(pipeline, "match_gpu_name", lambda name: pipeline.get_arch("H100"))
    argv = ["tune", str(bert_prefix), "--arch", "H100", "--topk", "2", "--no-build"]
    assert main(argv) == 0
    first = json.loads((bert_prefix / "tuned.json").read_text())["groups"]
    assert not any(g["from_cache"] for g in first) and fake.device.timed
    assert main(argv) == 0
    second = json.loads((bert_prefix / "tuned.json").read_text())["groups"]
    assert all(g["from_cache"] for g in second), [g["from_cache"] for g in second]
    assert fake.device.timed == [] and fake.device.compiles == []
