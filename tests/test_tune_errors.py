"""``welder tune`` and ``welder build`` on bad input: exit 2, a message naming the fault,
and nothing created; the PREFIX lock against a second process; hints that work."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import make_model

from welder.cli import build_parser, main
from welder.lock import LOCK_NAME
from welder.runtime.build import build_runtime
from welder.runtime.emit import CudaArchError

ROOT = Path(__file__).resolve().parents[1]
HAS_TOOLCHAIN = shutil.which("cmake") is not None and (
    shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
)


def _tiny_model() -> onnx.ModelProto:
    x = np.zeros((2, 8), np.float32)
    w = np.arange(8, dtype=np.float32)
    nodes = [helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    return make_model(nodes, {"x": x}, ["y"], {"w": w})


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _cost_model(*extra: str) -> list[str]:
    return ["--arch", "H100", "--cost-model", "--topk", "1", *extra]


@pytest.fixture
def fake_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An nvcc (through $CUDACXX) that lists the architectures of a CUDA 13 toolkit."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(
        '#!/bin/sh\nif [ "$1" = --list-gpu-arch ]; then printf "compute_75\\ncompute_80\\ncompute_90\\n"; '
        "exit 0; fi\nexit 1\n"
    )
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDACXX", str(nvcc))
    return nvcc


def _bad_inputs(work: Path) -> dict[str, tuple[list[str], str]]:
    (work / "notonnx.txt").write_text("this is not a model\n")
    (work / "empty.onnx").write_bytes(b"")
    onnx.save(_tiny_model(), work / "good.onnx")
    model = str(work / "good.onnx")
    return {
        "missing": (["tune", str(work / "does" / "not" / "exist"), *_cost_model()], "no ONNX model at"),
        "not onnx": (["tune", str(work / "notonnx.txt"), *_cost_model()], "not a readable ONNX model"),
        "empty": (["tune", str(work / "empty.onnx"), *_cost_model()], "is empty (0 bytes)"),
        "input shape": (["tune", model, "--input-shape", "z=1x8", *_cost_model()], "--input-shape names 'z'"),
        "arch": (["tune", model, "--arch", "V999", "--cost-model"], "unknown arch 'V999'"),
        "cuda arch": (["tune", model, *_cost_model("--cuda-arch", "sm_x")], "not a compute capability"),
        "topk": (["tune", model, "--arch", "H100", "--cost-model", "--topk", "0"], "--topk"),
    }


@pytest.mark.parametrize("case", ["missing", "not onnx", "empty", "input shape", "arch", "cuda arch", "topk"])
def test_bad_input_to_tune_creates_nothing(tmp_path: Path, capsys, case: str) -> None:
    args, message = _bad_inputs(tmp_path)[case]
    before = _tree(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert _tree(tmp_path) == before


def test_cuda_arch_unsupported_by_nvcc_is_refused_before_any_work(tmp_path: Path, capsys, fake_nvcc) -> None:
    onnx.save(_tiny_model(), tmp_path / "m.onnx")
    before = _tree(tmp_path)
    assert main(["tune", str(tmp_path / "m.onnx"), *_cost_model("--cuda-arch", "70")]) == 2
    err = capsys.readouterr().err
    assert "cannot compile for CUDA architecture 70" in err and "it supports 75, 80, 90" in err, err
    assert _tree(tmp_path) == before
    # The same check guards `welder build` (on sources emitted for 70 by --no-build): before CMake.
    assert main(["tune", str(tmp_path / "m.onnx"), *_cost_model("--cuda-arch", "70", "--no-build")]) == 0
    with pytest.raises(CudaArchError, match="it supports 75, 80, 90"):
        build_runtime(tmp_path / "m")
    assert main(["build", str(tmp_path / "m"), "--cuda-arch", "sm_70"]) == 2
    assert not (tmp_path / "m" / "nnfusion_rt" / "cuda_codegen" / "build").exists()
    # --arch V100 stays a valid cost model; only compiling for it is refused.
    assert main(["tune", str(tmp_path / "m.onnx"), "--arch", "V100", "--cost-model", "--no-build"]) == 0


def _without_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **k: None if name == "nvidia-smi" else which(name, *a, **k)
    )


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="needs cmake and nvcc")
def test_no_gpu_hint_gives_a_command_that_works(tmp_path: Path, capsys, monkeypatch) -> None:
    """`welder tune --cost-model` on a machine without a GPU says how to build; `welder
    build` without an architecture says the same, before CMake; the command given builds."""
    _without_nvidia_smi(monkeypatch)
    prefix = tmp_path / "tiny"
    prefix.mkdir()
    onnx.save(_tiny_model(), prefix / "model.onnx")
    assert main(["tune", str(prefix), *_cost_model()]) == 0
    out = capsys.readouterr().out
    hint = re.search(r"run `welder (build \S+ --cuda-arch 90)`", out)
    assert hint and "rerun with --cuda-arch 90" in out, out
    assert main(["build", str(prefix)]) == 2
    assert "--cuda-arch 90" in capsys.readouterr().err
    assert not (prefix / "nnfusion_rt" / "cuda_codegen" / "build").exists()
    assert main(hint.group(1).split()) == 0
    assert (prefix / "nnfusion_rt" / "cuda_codegen" / "build" / "main_test").is_file()


_HOLDER = """
import sys
sys.path.insert(0, {root!r})
from welder.lock import prefix_lock
with prefix_lock({prefix!r}, "welder tune"):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_tune_into_one_prefix_names_the_holder(tmp_path: Path, capsys) -> None:
    prefix = tmp_path / "p"
    prefix.mkdir()
    onnx.save(_tiny_model(), prefix / "model.onnx")
    assert main(["tune", str(prefix), *_cost_model("--no-build")]) == 0
    (prefix / "tuned.json").unlink()
    code = textwrap.dedent(_HOLDER).format(root=str(ROOT), prefix=str(prefix))
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        for command in (
            ["tune", str(prefix), *_cost_model("--no-build")],
            ["build", str(prefix), "--emulate"],
        ):
            assert main(command) == 2
            err = capsys.readouterr().err
            assert f"in use by another welder: pid {holder.pid} on host" in err and "(welder tune" in err, err
        assert not (prefix / "tuned.json").exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # the lock dies with its holder
        holder.wait(timeout=60)
    assert (prefix / LOCK_NAME).exists()  # left behind, and it blocks nothing
    assert main(["tune", str(prefix), *_cost_model("--no-build")]) == 0
    assert (prefix / "tuned.json").is_file()


def test_check_help_lists_the_backends(capsys) -> None:
    from welder.session import BACKENDS

    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--help"])
    assert f"--backend {{{','.join(BACKENDS)}}}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["check", "m.onnx", "--backend", "cuda"])
    assert e.value.code == 2
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_tune_of_an_opset_9_model_upgrades_it(tmp_path: Path, capsys) -> None:
    model = _tiny_model()
    model.opset_import[0].version = 9
    model.ir_version = 4
    onnx.save(model, tmp_path / "old.onnx")
    assert main(["tune", str(tmp_path / "old.onnx"), *_cost_model("--no-build")]) == 0
    err = capsys.readouterr().err
    assert "welder tune: warning: the model uses opset 9; imported after upgrading it to opset 11" in err
    assert ".py:" not in err  # one plain line, no file and source line
    assert (tmp_path / "old" / "tuned.json").is_file()
    assert os.path.getsize(tmp_path / "old" / "model.onnx") == os.path.getsize(tmp_path / "old.onnx")
