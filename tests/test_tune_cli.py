"""``welder tune`` end to end without a GPU: plan by the cost model, generate, emit and
build the runtime (nvcc), and run the built runtime through the emulator -- test_acc,
``welder check --backend gpu``, ``welder.InferenceSession`` and ``welder run``; and on a
fake GPU: tuning with another GPU's cost model, the report and tuned.json."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import bert_encoder_layer, mobilenetv2_block

import welder
from welder.arch import get_arch
from welder.check import compare, onnxruntime_outputs, random_inputs
from welder.cli import main
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx
from welder.pipeline import RuntimeTiming, time_runtime
from welder.runtime.emu import available as emulator_available
from welder.runtime.layout import library_path, main_test_path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

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


def test_tune_moves_the_scales_of_queries_and_keys_past_their_product(tmp_path: Path) -> None:
    """`welder tune` plans the graph whose products read unscaled queries and keys (the
    import keeps the model's scales; Graph.move_scales_past_products): model.json and
    tuned.json show the product of views and the scale after it."""
    model, _ = bert_encoder_layer(sdpa=True)
    onnx.save(model, tmp_path / "bert.onnx")
    assert main(["tune", str(tmp_path / "bert.onnx"), "--cost-model", "--arch", "H100", "--no-build"]) == 0
    nodes = {n["name"]: n for n in json.loads((tmp_path / "bert" / "model.json").read_text())["nodes"]}
    (scores,) = [name for name in nodes if name.endswith("self/MatMul_output_0:unscaled")]
    assert not any(nodes[i]["op_type"] == "Mul" for i in nodes[scores]["inputs"] if i in nodes)
    members = {
        m for g in json.loads((tmp_path / "bert" / "tuned.json").read_text())["groups"] for m in g["members"]
    }
    assert scores in members


def test_tune_without_gpu_asks_for_the_cost_model(bert_prefix: Path, capsys) -> None:
    pytest.importorskip("welder.device.gpu")
    from welder.device.gpu import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    assert main(["tune", str(bert_prefix), "--arch", "H100", "--no-build"]) == 2
    assert "--cost-model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget-s", "0"], "--budget-s must be a positive number of seconds, got 0.0"),
        (["--budget-s", "-5"], "--budget-s must be a positive number of seconds, got -5.0"),
        (["--budget-s", "60", "--cost-model"], "--budget-s limits tuning on the GPU"),
    ],
)
def test_a_bad_time_budget_is_a_usage_error(tmp_path: Path, capsys, flags, message) -> None:
    model, _ = mobilenetv2_block()
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["tune", str(tmp_path / "m.onnx"), "--arch", "H100", "--no-build", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # nothing left behind


@dataclass(frozen=True)
class Tuned:
    prefix: Path
    nvcc_built: bool  # `welder tune` built main_test and the library with nvcc


@pytest.fixture(scope="module")
def emulated_bert(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    """The CI path of the design, once per module: `welder tune --cost-model --topk 1` on a
    BERT layer exported through scaled_dot_product_attention generates the runtime and
    builds it with nvcc (where nvcc is), then `welder build --emulate` rebuilds the same
    sources for the CPU emulator so they can run here."""
    if not (emulator_available() and shutil.which("cmake")):
        pytest.skip("needs g++ and cmake")
    prefix = tmp_path_factory.mktemp("tuned") / "bert"
    prefix.mkdir()
    onnx.save(bert_encoder_layer(sdpa=True)[0], prefix / "model.onnx")
    build = ["--cuda-arch", "90"] if HAS_TOOLCHAIN else ["--no-build"]
    assert main(["tune", str(prefix), "--arch", "H100", "--cost-model", "--topk", "1", *build]) == 0
    nvcc_built = library_path(prefix).is_file() and main_test_path(prefix).is_file()
    assert main(["build", str(prefix), "--emulate"]) == 0
    return Tuned(prefix, nvcc_built)


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="needs cmake and nvcc")
def test_tune_builds_the_runtime_with_nvcc_and_it_checks_out_emulated(emulated_bert: Tuned) -> None:
    """The whole runtime builds with nvcc; the same sources, run through the emulator, pass
    test_acc against onnxruntime."""
    assert emulated_bert.nvcc_built
    acc = subprocess.run(
        [sys.executable, "artifacts/test_acc.py", str(emulated_bert.prefix)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert acc.returncode == 0, acc.stdout + acc.stderr
    assert "PASS" in acc.stdout


def test_check_with_the_gpu_backend_runs_the_built_runtime(emulated_bert: Tuned, capsys) -> None:
    assert main(["check", str(emulated_bert.prefix), "--backend", "gpu"]) == 0
    out = capsys.readouterr().out
    assert "backend=gpu" in out and out.strip().splitlines()[-1] == "PASS"
    assert "last_hidden_state" in out


def test_inference_session_of_a_prefix_picks_the_built_runtime(
    emulated_bert: Tuned, tmp_path: Path, monkeypatch
) -> None:
    """On a machine with a driver (an nvidia-smi on PATH stands in for one), a PREFIX folder
    opens on the gpu back end: numpy in, numpy out, the same as onnxruntime."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    sess = welder.InferenceSession(emulated_bert.prefix)
    assert sess.get_providers() == ["gpu"]
    feeds = random_inputs(sess.graph, seed=2)
    names = [o.name for o in sess.get_outputs()]
    ours = dict(zip(names, sess.run(None, feeds)))
    assert all(isinstance(v, np.ndarray) for v in ours.values())
    reference = onnxruntime_outputs(emulated_bert.prefix / "model.onnx", feeds, names)
    assert all(r.passed for r in compare(ours, reference)), compare(ours, reference)


def test_a_tune_log_line_says_when_it_came(capsys) -> None:
    """Each line of the tune's log on stderr starts with the seconds since the process began,
    so a log alone (a tune cut short too) says where its time went."""
    import logging

    import welder.pipeline as pipeline

    handler = pipeline._StderrHandler()
    handler.setFormatter(pipeline._Elapsed())
    args = ("g", 12.95)
    record = logging.LogRecord("welder.tune", logging.INFO, __file__, 1, "group %s: %.2f us", args, None)
    record.relativeCreated = 205_140.0
    handler.emit(record)
    assert capsys.readouterr().err == "[ 205.1 s] group g: 12.95 us\n"


def test_time_runtime_times_the_build_in_a_child(emulated_bert: Tuned, tmp_path: Path) -> None:
    timing = time_runtime(emulated_bert.prefix, iters=2, warmup=0)
    assert timing.median_us > 0 and timing.mean_us > 0 and timing.iters == 2
    with pytest.raises(WelderError, match=r"welder run .* failed \(exit 2\).*welder build"):
        time_runtime(tmp_path, iters=1, warmup=0)


class _FakeGpu:
    """The fake device of the tuner tests, behind the context-manager face of GpuDevice;
    ``name`` is the GPU as its driver would name it."""

    def __init__(self, graph_holder: dict, name: str = "NVIDIA H100 80GB HBM3") -> None:
        self.holder = graph_holder
        self.name = name

    def __call__(self, *args, **kwargs):
        from test_tuner import ScriptedDevice

        self.device = ScriptedDevice(self.holder["graph"], name=self.name)
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
    argv = ["tune", str(bert_prefix), "--arch", "H100", "--topk", "2", "--no-build"]
    assert main(argv) == 0
    first = json.loads((bert_prefix / "tuned.json").read_text())["groups"]
    assert not any(g["from_cache"] for g in first) and fake.device.timed
    assert main(argv) == 0
    second = json.loads((bert_prefix / "tuned.json").read_text())["groups"]
    assert all(g["from_cache"] for g in second), [g["from_cache"] for g in second]
    assert fake.device.timed == [] and fake.device.compiles == []


def test_ranking_script_reranks_a_tune_by_its_model(bert_prefix: Path, tmp_path: Path, monkeypatch, capsys):
    """`welder tune` on a (fake) GPU records the kinds and every timed config; ranking.py
    --rerank rebuilds the groups from the model.onnx beside tuned.json, or from its
    skeleton, and, with the same cost model, puts every timed config back at its rank."""
    _fake_gpu(bert_prefix, tmp_path, monkeypatch, "Fake GPU")
    assert main(["tune", str(bert_prefix), "--arch", "H100", "--topk", "2", "--no-build"]) == 0
    doc = json.loads((bert_prefix / "tuned.json").read_text())
    assert doc["kinds"] and doc["timed"]
    sys.path.insert(0, str(ROOT / "scripts"))
    import ranking

    capsys.readouterr()
    assert ranking.main([str(bert_prefix / "tuned.json"), "--rerank"]) == 0
    table = capsys.readouterr().out
    assert "tune -> now" in table
    from welder.arch import get_arch
    from welder.pipeline import planned_import

    graph = planned_import(bert_prefix / "model.onnx", get_arch(doc["arch"]))
    found = ranking.rerank(ranking.groups([bert_prefix / "tuned.json"]), doc, graph)
    assert found and all(g.reranked == g.ranks for g in found)
    # candidates.py shows the tune's own times beside the proposals it timed (the fake GPU
    # takes 1 + rank microseconds), none beside the rest.
    candidates = _candidates()
    assert candidates.main([str(bert_prefix), "--show", "3"]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n")
    assert blocks and all("the tune's own times" in b for b in blocks)
    for block in blocks:
        rows = [r for r in block.splitlines()[2:] if not r.startswith("  ")]
        assert [r[MEAS].strip() for r in rows] == ["1.00", "2.00", ""][: len(rows)], block
    # The same from the model's skeleton, as a GPU round brings it back.
    import model_skeleton

    skeleton = tmp_path / "model.onnx.gz"
    model_skeleton.write(bert_prefix / "model.onnx", skeleton)
    (bert_prefix / "model.onnx").unlink()
    assert ranking.main([str(bert_prefix / "tuned.json"), "--rerank", "--model", str(skeleton)]) == 0
    assert capsys.readouterr().out == table


def _fake_gpu(prefix: Path, tmp_path: Path, monkeypatch, name: str) -> _FakeGpu:
    import welder.pipeline as pipeline
    from welder.frontend.onnx import import_onnx

    fake = _FakeGpu({"graph": import_onnx(prefix / "model.onnx")}, name)
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "gpu_available", lambda: True)
    monkeypatch.setattr(pipeline, "GpuDevice", fake)
    return fake


def _said(text: str, capsys, caplog) -> int:
    """How often ``text`` reached the user: printed, or logged (pytest's log capture takes
    the welder.tune messages that would go to stderr)."""
    captured = capsys.readouterr()
    logged = sum(text in r.getMessage() for r in caplog.records)
    return captured.out.count(text) + captured.err.count(text) + logged


def test_explicit_arch_tunes_on_a_gpu_welder_does_not_describe(
    bert_prefix: Path, tmp_path: Path, monkeypatch, capsys, caplog
) -> None:
    _fake_gpu(bert_prefix, tmp_path, monkeypatch, "NVIDIA L4")
    with caplog.at_level(logging.INFO, logger="welder.tune"):
        code = main(["tune", str(bert_prefix), "--arch", "V100", "--topk", "2", "--no-build"])
    assert code == 0
    assert _said("NVIDIA L4 has no description in welder.arch", capsys, caplog) == 1
    doc = json.loads((bert_prefix / "tuned.json").read_text())
    assert doc["arch"] == "V100" and "NVIDIA L4" in doc["measure"]


_ISSUE_COMMAND = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import test_tune_cli
import welder.pipeline as pipeline
from welder.cli import main
from welder.frontend.onnx import import_onnx

pipeline.gpu_available = lambda: True
pipeline.GpuDevice = test_tune_cli._FakeGpu({{"graph": import_onnx({model!r})}})
sys.exit(main(["tune", {prefix!r}, "--arch", "V100", "--topk", "20", "--no-build"]))
"""


def test_the_issue_command_on_an_h100_says_once_that_it_is_no_v100(bert_prefix: Path, tmp_path: Path) -> None:
    """`welder tune PREFIX --arch V100 --topk 20` on an H100 (a fake one) tunes, and says once
    -- in a plain process, where welder sets up its own logging -- that the ranking comes
    from the V100's cost model."""
    code = textwrap.dedent(_ISSUE_COMMAND).format(
        tests=str(TESTS), root=str(ROOT), model=str(bert_prefix / "model.onnx"), prefix=str(bert_prefix)
    )
    env = dict(os.environ, WELDER_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert said.count("this GPU is not a V100") == 1, said
    assert "ranked by the V100 cost model but compiled for and timed on NVIDIA H100 80GB HBM3" in said
    doc = json.loads((bert_prefix / "tuned.json").read_text())
    assert doc["arch"] == "V100" and doc["topk"] == 20


def test_tune_reports_prediction_kernel_sum_and_end_to_end_latency(
    bert_prefix: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """After a build on a GPU the runtime is timed end to end: tuned.json and the report
    keep the cost model's prediction, the sum of kernels timed one by one and the whole
    model's latency apart; the report's times are tuned.json's.  A runtime that cannot be
    timed is a note, not a failed tune."""
    import welder.pipeline as pipeline

    _fake_gpu(bert_prefix, tmp_path, monkeypatch, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(pipeline, "_build", lambda out, options, notes: out / "build")
    limits: list[float] = []
    runs: list[tuple[int, int]] = []

    def timed(prefix: Path, iters: int, warmup: int, timeout_s: float) -> RuntimeTiming:
        limits.append(timeout_s)
        runs.append((iters, warmup))
        return RuntimeTiming(123.0, 125.5, iters, warmup)

    monkeypatch.setattr(pipeline, "time_runtime", timed)
    assert main(["tune", str(bert_prefix), "--arch", "H100", "--topk", "2"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((bert_prefix / "tuned.json").read_text())
    totals = doc["totals"]
    assert totals["measured_runtime_us"] == 123.0 and totals["measured_runtime_mean_us"] == 125.5
    assert "median of 50 runs" in totals["runtime_timing"]
    kernels_us = sum(g["measured_latency_us"] for g in doc["groups"])
    assert totals["measured_kernels_us"] == pytest.approx(kernels_us, abs=1e-2)
    # A runtime that hangs costs its start and twenty times its inferences, not ten minutes.
    inferences_s = 20 * 60 * totals["measured_kernels_us"] * 1e-6
    assert limits == [pytest.approx(pipeline.RUNTIME_START_S + inferences_s)]
    assert runs == [(50, 10)], "a model of microseconds is timed fifty times after ten warm-ups"
    assert totals["predicted_latency_us"] == pytest.approx(
        sum(g["predicted_latency_us"] for g in doc["groups"]), abs=1e-2
    )
    assert all(g["gain_basis"] == "predicted unfused - measured fused" for g in doc["groups"])
    assert (
        f"model latency: predicted {totals['predicted_latency_us']:.1f} us, measured 123.0 us end to end; "
        f"kernels timed one by one: {totals['measured_kernels_us']:.1f} us"
    ) in out
    over = totals["measured_kernels_us"] * (1 + pipeline.RUNTIME_OVER_KERNELS) < 123.0
    assert ("more than its kernels timed one by one" in out) == over
    times = next(line for line in out.splitlines() if line.startswith("time: "))
    tuning, build, total = (float(w) for w in times.replace(",", " ").split() if w.replace(".", "").isdigit())
    assert tuning == pytest.approx(totals["tuning_seconds"], abs=0.051)
    assert build == pytest.approx(totals["build_seconds"], abs=0.051)
    assert total == pytest.approx(totals["total_seconds"], abs=0.051)
    assert totals["tuning_seconds"] <= totals["total_seconds"]

    # a runtime 3% over its kernels' sum: something costs in place that the tuner never saw;
    # 1% over is within the spread of a few long kernels' timings
    for share, noted in ((1.03, True), (1.01, False)):
        took = totals["measured_kernels_us"] * share
        timed_at = lambda p, iters, warmup, timeout_s, t=took: RuntimeTiming(t, t, iters, warmup)  # noqa: E731
        monkeypatch.setattr(pipeline, "time_runtime", timed_at)
        assert main(["tune", str(bert_prefix), "--arch", "H100", "--topk", "2"]) == 0
        note = f"note: the runtime took {took:.1f} us, more than its kernels timed one by one ("
        assert (note in capsys.readouterr().out) == noted

    def broken(prefix: Path, iters: int, warmup: int, timeout_s: float) -> RuntimeTiming:
        raise WelderError("`welder run` failed (exit 2): no GPU")

    monkeypatch.setattr(pipeline, "time_runtime", broken)
    assert main(["tune", str(bert_prefix), "--arch", "H100", "--topk", "2"]) == 0
    assert "note: runtime not timed: `welder run` failed" in capsys.readouterr().out
    assert json.loads((bert_prefix / "tuned.json").read_text())["totals"]["measured_runtime_us"] is None


def test_a_long_inference_is_timed_fewer_times() -> None:
    """The tune's end-to-end timing runs fifty inferences after ten warm-ups where those
    take under RUNTIME_RUNS_S together, else as many as fit (a few of them warm-ups), never
    fewer than the minimums."""
    from welder.pipeline import (
        RUNTIME_ITERS,
        RUNTIME_MIN_ITERS,
        RUNTIME_MIN_WARMUP,
        RUNTIME_RUNS_S,
        RUNTIME_WARMUP,
        runtime_iterations,
    )

    for kernels_us in (None, 0.0, 150.0, 0.9 * RUNTIME_RUNS_S / 60 * 1e6):
        assert runtime_iterations(kernels_us) == (RUNTIME_ITERS, RUNTIME_WARMUP)
    for kernels_us in (1.1 * RUNTIME_RUNS_S / 60 * 1e6, 1.35e6, 4e6):
        iters, warmup = runtime_iterations(kernels_us)
        assert (iters + warmup) * kernels_us * 1e-6 <= RUNTIME_RUNS_S
        assert RUNTIME_MIN_ITERS <= iters < RUNTIME_ITERS and RUNTIME_MIN_WARMUP <= warmup <= iters // 2
    assert runtime_iterations(100e6) == (RUNTIME_MIN_ITERS, RUNTIME_MIN_WARMUP)


# -- scripts/benchmark.py's welder steps ---------------------------------------------------------


def _benchmark():
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark

    return benchmark


# candidates.py's columns: marks and rank, the estimate, and with --time the measured time.
EST, MEAS = slice(7, 18), slice(18, 29)


def _candidates():
    sys.path.insert(0, str(ROOT / "scripts"))
    import candidates

    return candidates


def test_candidates_script_marks_what_the_tuner_timed_and_chose(
    emulated_bert: Tuned, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/candidates.py proposes for each group of a tune as the tuner did: after a
    cost-model tune with topk 1 each group's one timed proposal is the config tuned.json
    holds, and the listing ranks proposals by estimate; a folder without a tune, or a
    group that is not there, is an error naming it."""
    candidates = _candidates()
    tuned = json.loads((emulated_bert.prefix / "tuned.json").read_text())
    kernels = [g["index"] for g in tuned["groups"] if not g.get("library")]
    assert candidates.main([str(emulated_bert.prefix), "--show", "4"]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n")
    assert len(blocks) == len(kernels)
    for index, block in zip(kernels, blocks):
        lines = block.splitlines()
        assert lines[0].startswith(f"group {index} ") and "1 timed" in lines[0]
        rows = lines[2:]
        assert rows[0].startswith("*= ") and not any(r.startswith("*") for r in rows[1:]), block
        estimates = [float(r[EST]) for r in rows]
        assert estimates[1:] == sorted(estimates[1:]) and estimates[0] <= min(estimates), block
    assert candidates.main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
    assert candidates.main([str(emulated_bert.prefix), "--group", "999"]) == 2
    assert "no kernel group [999]" in capsys.readouterr().err


def test_candidates_script_times_on_the_tuners_device(
    emulated_bert: Tuned, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --time the listed proposals of each group are compiled and timed on the tuner's
    device (a fake one here) in the tuner's order: a meas us column beside the estimate,
    blank for a proposal that does not compile (its reason under the table), and the
    fastest named by rank."""
    import contextlib

    from test_tuner import ScriptedDevice

    candidates = _candidates()
    device = ScriptedDevice(import_onnx(emulated_bert.prefix / "model.onnx"), {1: "compile"}, {2: 0.5})
    monkeypatch.setattr(candidates, "default_device", lambda: contextlib.nullcontext(device))
    tuned = json.loads((emulated_bert.prefix / "tuned.json").read_text())
    index = next(g["index"] for g in tuned["groups"] if not g.get("library"))
    assert candidates.main([str(emulated_bert.prefix), "--group", str(index), "--show", "4", "--time"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "meas us" in lines[1]
    rows = lines[2:6]
    assert [r[MEAS].strip() for r in rows] == ["1.00", "", "0.50", "4.00"], lines
    assert rows[0].startswith("*= ") and float(rows[0][EST]) <= float(rows[1][EST])
    assert "  fastest measured: proposal 3, 0.50 us" in lines
    assert "  tuned.json's config (proposal 1): 1.00 us here" in lines
    assert any(line.startswith("  not timed: proposal 2: 1 compile (") for line in lines), lines
    assert [name.split("_")[1] for name in device.timed] == ["c0", "c2", "c3"]  # in rank order


def test_candidates_script_time_without_a_gpu_is_an_error(
    emulated_bert: Tuned, capsys: pytest.CaptureFixture[str]
) -> None:
    """--time needs pycuda and a GPU: without them, exit 2 with one line saying what is
    missing, before anything is listed."""
    from welder.device.gpu import gpu_available

    if gpu_available():
        pytest.skip("pycuda and a GPU are present: --time would time on it")
    assert _candidates().main([str(emulated_bert.prefix), "--show", "2", "--time"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("candidates: ") and len(err.strip().splitlines()) == 1, err
    assert "pycuda" in err or "GPU" in err or "driver" in err or "nvcc" in err, err


def test_benchmark_records_main_test_and_test_acc(emulated_bert: Tuned, tmp_path: Path) -> None:
    """Each welder row carries main_test's mean and test_acc's verdict and worst error,
    also when the check cannot run; the markdown has them in a table of their own."""
    benchmark = _benchmark()
    mean_ms, problem = benchmark.run_main_test(emulated_bert.prefix, ["--iters", "2", "--warmup", "0"])
    assert problem is None and mean_ms > 0
    accuracy = benchmark.check_accuracy(emulated_bert.prefix)
    assert accuracy.verdict == "PASS" and 0 <= accuracy.max_error <= 1e-4
    missing = benchmark.check_accuracy(tmp_path)
    assert missing.verdict.startswith("error: test_acc exit 2") and missing.max_error is None
    # Where the prefix holds the export's inputs, test_acc runs on them.
    saved = Path(shutil.copytree(emulated_bert.prefix, tmp_path / "saved", symlinks=True))
    graph = import_onnx(saved / "model.onnx")
    np.savez(saved / "inputs.npz", **random_inputs(graph, seed=7))
    assert benchmark.check_accuracy(saved).verdict == "PASS"
    np.savez(saved / "inputs.npz", stray=np.zeros(1))
    assert benchmark.check_accuracy(saved).verdict.startswith("error: test_acc exit 2")
    assert benchmark.run_main_test(tmp_path)[0] is None

    # The floor: the model's FLOPs at fp32's peak against its own bytes at DRAM bandwidth on
    # the tuned arch (H100), from model.json here.
    model = json.loads((emulated_bert.prefix / "model.json").read_text())
    h100 = get_arch("H100")
    flops = sum(int(n.get("flops", 0)) for n in model["nodes"])
    own = [t for key in ("inputs", "outputs", "constants") for t in model[key]]
    nbytes = sum(math.prod(t["shape"]) * np.dtype(t["dtype"]).itemsize for t in own)
    expected = max(flops / (h100.fp32_tflops * 1e9), nbytes / (h100.global_bw_gbs * 1e6))
    floor_ms = benchmark.model_floor_ms(emulated_bert.prefix)
    assert floor_ms == pytest.approx(expected, rel=1e-6) and floor_ms > 0
    assert benchmark.model_floor_ms(tmp_path) is None

    config = benchmark.Config("bert", 1, "fp32")
    cell = benchmark.Cell(
        ms=1.0,
        main_test_ms=mean_ms,
        accuracy=accuracy.verdict,
        max_error=accuracy.max_error,
        floor_ms=floor_ms,
    )
    row = benchmark.Row(config, {"welder": cell, "eager": benchmark.Cell(ms=2.0)})
    table = benchmark.render_markdown([row], {"device": "test"})
    assert (
        f"| bert | 1 | fp32 | {mean_ms:.3f} | PASS | {accuracy.max_error:.1e} | {floor_ms:.3f} "
        f"| {1.0 / floor_ms:.1f}x |" in table
    )
    again = benchmark.Row.from_dict(json.loads(json.dumps(row.to_dict())))
    assert again.cells["welder"] == cell


def test_benchmark_tune_args_replace_arch_and_topk(
    bert_prefix: Path, tmp_path: Path, monkeypatch, capsys, caplog
) -> None:
    """`--tune-args="--arch V100 --topk 20"` gives the issue's command, which then tunes on
    an H100 (a fake one) and says it is no V100."""
    benchmark = _benchmark()
    parser = benchmark.build_parser()
    options = benchmark.welder_options(parser.parse_args(["--tune-args=--arch V100 --topk 20"]), None)
    command = benchmark.welder_tune_command(bert_prefix, options)
    assert command == ["tune", str(bert_prefix), "--arch", "V100", "--topk", "20"]
    default = benchmark.welder_options(parser.parse_args(["--topk", "8", "--tune-args=--skip-dot"]), None)
    assert benchmark.welder_tune_command(bert_prefix, default) == [
        "tune",
        str(bert_prefix),
        "--arch",
        "auto",
        "--topk",
        "8",
        "--skip-dot",
    ]
    _fake_gpu(bert_prefix, tmp_path, monkeypatch, "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.INFO, logger="welder.tune"):
        assert main([*command, "--no-build"]) == 0
    assert _said("this GPU is not a V100", capsys, caplog) == 1
    doc = json.loads((bert_prefix / "tuned.json").read_text())
    assert (doc["arch"], doc["topk"]) == ("V100", 20)
