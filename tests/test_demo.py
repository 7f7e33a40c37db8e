"""``welder demo``: its built-in models are what they claim (the interpreter against
onnxruntime), and the command runs them end to end on the emulator, reports each check and
exits 0, or 1 when a check fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from welder.check import compare, onnxruntime_outputs, random_inputs
from welder.cli import main
from welder.demo import MODELS, DemoError, conv_block, select_models, transformer_encoder
from welder.device.gpu import gpu_available
from welder.frontend.onnx import import_onnx
from welder.runtime.emu import available

ROOT = Path(__file__).resolve().parents[1]
needs_emulator = pytest.mark.skipif(not available(), reason="the emulator needs Linux and g++")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("seed", [0, 1])
def test_demo_models_interpret_like_onnxruntime(name: str, seed: int, tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(MODELS[name][1](), str(path))
    graph = import_onnx(path)
    feeds = random_inputs(graph, seed)
    reference = onnxruntime_outputs(path, feeds, list(graph.outputs))
    assert all(np.abs(v).max() > 0.1 for v in reference.values())  # not a trivially zero model
    results = compare(graph.run(feeds), reference)
    assert results and all(r.passed for r in results), results


def test_demo_models_have_the_operators_they_advertise() -> None:
    ops = {n.op_type for n in transformer_encoder().graph.node}
    assert {"Gather", "MatMul", "Add", "Softmax", "LayerNormalization", "Erf", "Transpose"} <= ops
    conv = [n.op_type for n in conv_block().graph.node]
    assert conv.count("Conv") == 3 and {"BatchNormalization", "Relu", "MaxPool", "Gemm"} <= set(conv)
    layers = sum(n.op_type == "Softmax" for n in transformer_encoder(layers=3).graph.node)
    assert layers == 3


def test_model_selection() -> None:
    assert select_models(None) == list(MODELS)
    assert select_models(["convnet", "transformer", "convnet"]) == ["convnet", "transformer"]
    with pytest.raises(DemoError, match=r"'resnet'.*transformer, convnet"):
        select_models(["resnet"])


def test_an_unknown_model_is_exit_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--models", "resnet", "--emulate"]) == 2
    err = capsys.readouterr().err
    assert "resnet" in err and "transformer" in err and "Traceback" not in err


def test_a_prefix_that_is_a_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert main(["demo", "--emulate", "--prefix", str(taken)]) == 2
    assert "taken is a file" in capsys.readouterr().err
    assert taken.read_text() == "mine" and sorted(tmp_path.iterdir()) == [taken]


ROW = re.compile(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+) us\s+(PASS|FAIL)\s+(\S+)", re.M)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """``welder demo --emulate --prefix P`` once, as a user runs it (a child process, in
    another folder): exit code, stdout, P."""
    if not available():
        pytest.skip("the emulator needs Linux and g++")
    prefix = tmp_path_factory.mktemp("demo")
    command = [sys.executable, "-m", "welder.cli", "demo", "--emulate", "--prefix", str(prefix)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)  # this checkout's welder, whatever is installed
    done = subprocess.run(command, capture_output=True, text=True, cwd=prefix, env=env, timeout=900)
    return done.returncode, done.stdout + done.stderr, prefix


@needs_emulator
def test_demo_runs_every_model_on_the_emulator_and_passes(demo_run: tuple[int, str, Path]) -> None:
    code, text, prefix = demo_run
    assert code == 0, text
    rows = {m[1]: m for m in ROW.finditer(text)}
    assert set(rows) == set(MODELS), text
    for name, row in rows.items():
        groups, kernels = int(row[3]), int(row[4])
        assert 1 <= kernels <= groups and float(row[5]) > 0, row[0]
        assert row[6] == "PASS" and float(row[7]) <= 1e-4, row[0]
        assert (prefix / name / "model.onnx").is_file() and (prefix / name / "tuned.json").is_file()
    assert text.strip().splitlines()[-2] == "PASS: 2/2 models match onnxruntime"
    stages = ("tuning (cost model of H100)", "compiling", "running them on the emulator", "check against")
    for stage in stages:
        assert all(f"[{n}] {stage}" in text for n in MODELS), stage


@needs_emulator
def test_demo_without_prefix_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--emulate", "--models", "convnet"]) == 0
    assert "PASS: 1/1" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@needs_emulator
def test_a_wrong_kernel_result_is_a_fail_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel that computes something else (here: outputs nudged by 1%) must be caught."""
    from welder.runtime.emulate import EmulatedModel

    honest = EmulatedModel.run

    def nudged(self: EmulatedModel, feeds: dict) -> dict:
        return {k: v * np.float32(1.01) for k, v in honest(self, feeds).items()}

    monkeypatch.setattr(EmulatedModel, "run", nudged)
    assert main(["demo", "--emulate", "--models", "convnet"]) == 1
    text = capsys.readouterr().out
    [row] = list(ROW.finditer(text))
    assert row[6] == "FAIL" and float(row[7]) > 1e-3
    assert text.strip().splitlines()[-1] == "FAIL: 0/1 models match onnxruntime"


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs pycuda and an NVIDIA GPU")
def test_demo_on_the_gpu_tunes_builds_times_and_checks(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--models", "convnet", "--prefix", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "; running main_test" in text and "checking the built runtime" in text
    row = re.search(r"^convnet\s+\d+\s+\d+\s+\d+\s+[\d.]+ us\s+([\d.]+) us\s+([\d.]+) us\s+PASS", text, re.M)
    assert row is not None and float(row[1]) > 0 and float(row[2]) > 0, text
    assert (tmp_path / "convnet" / "nnfusion_rt" / "cuda_codegen" / "build" / "main_test").is_file()
