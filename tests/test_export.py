"""``welder export``, its peers and the benchmark table.

The first half needs nothing but the project (registry errors, export.json, the timing
protocol, the table) and runs everywhere.  The second half exports real torch modules
-- small configurations of the benchmark's models -- and checks three things against
onnxruntime with the design's metric: the torch module (so the ONNX is the module),
the module rebuilt twice from export.json (so the peers time the same module), and
welder's interpreter (the importer on real exporter output).  It skips where torch,
transformers, timm or torchvision cannot be imported.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import welder
from welder.check import error_metric, onnxruntime_outputs, threshold_for
from welder.errors import WelderError
from welder.export import (
    INPUTS_NPZ,
    MODELS,
    PAPER_MODELS,
    ExportInfo,
    export_onnx,
    get_spec,
    parse_option,
    read_export,
    rebuild,
    require,
    to_numpy,
)
from welder.session import check_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "artifacts"))

import benchmark  # noqa: E402
from run_torch import TimingPlan, WallClock, measure, measure_calls, tf32_allowed, time_system  # noqa: E402

# Small configurations that keep each model's structure (attention, windows and shifts,
# MobileViT blocks, the NeRF skip) and export in seconds.
SMALL: dict[str, dict[str, Any]] = {
    "bert": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "seq_len": 16,
    },
    "vit_small_p32": {"depth": 2, "embed_dim": 64, "num_heads": 2, "img_size": 64},
    "swin_tiny": {"depths": [1, 1, 1, 1], "embed_dim": 24, "num_heads": [1, 1, 1, 1]},
    "mobilevit_s": {"img_size": 64},
    "mobilenet_v2": {"img_size": 64, "width_mult": 0.5},
    # 128, not 64: with a 2x2 final map ResNet-50's fp32 rounding (torch and onnxruntime
    # each ~1e-4 from float64) no longer averages out below the 1e-4 threshold.
    "resnet50": {"img_size": 128},
    "nerf": {"points": 64},
    "nerf_large": {"points": 64},
    # The restoration models at 32x32 (the smallest size their four levels, or BSRN's
    # strided convolution and 7x7 pooling, divide) with fewer channels and blocks.
    "bsrn": {"img_size": 32, "channels": 16, "blocks": 2},
    "nafnet": {"img_size": 32},
    "restormer": {"img_size": 32, "dim": 8, "blocks": [1, 1, 1, 1], "heads": [1, 2, 1, 2], "refinement": 1},
    "conformer": {"input_dim": 64, "num_heads": 2, "ffn_dim": 64, "num_layers": 2, "frames": 16},
}
TOLERANCE = 1e-4


def need(*packages: str) -> None:
    """Skip unless every package imports.  Any exception counts: a torchvision built for
    another torch raises a RuntimeError on import, not an ImportError."""
    for package in packages:
        try:
            importlib.import_module(package)
        except Exception as e:
            pytest.skip(f"{package} cannot be imported here ({type(e).__name__})")


def outputs_of(module: Any, inputs: dict[str, Any]) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        out = module(*inputs.values())
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``exported(name) -> prefix``: each small model exported once per test module."""
    root = tmp_path_factory.mktemp("exports")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        need(*get_spec(name).packages)
        if name not in done:
            export_onnx(name, root / name, batch=2, options=SMALL[name])
            done[name] = root / name
        return done[name]

    return get


# -- without torch -------------------------------------------------------------------------


def test_registry_has_the_reference_models() -> None:
    for name in (*PAPER_MODELS, "nerf_large", "resnet50"):
        assert name in MODELS and MODELS[name].outputs
    assert MODELS["conformer"].outputs == ("output", "output_lengths")
    assert "torchaudio" in MODELS["conformer"].packages
    with pytest.raises(WelderError, match=r"unknown model 'gpt5'.*bert"):
        get_spec("gpt5")


def test_missing_package_names_it_and_the_extra() -> None:
    with pytest.raises(WelderError, match=r"'no_such_pkg_xyz'.*pip install -e '\.\[models\]'"):
        require("no_such_pkg_xyz", "bert")


def test_missing_torchaudio_says_to_install_the_matching_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchaudio is in no extra (each release is built for one torch): its message names
    it and says which release, whether or not this machine has it."""
    monkeypatch.setitem(sys.modules, "torchaudio", None)  # import fails as if absent
    with pytest.raises(WelderError, match=r"model 'conformer' needs the package 'torchaudio'.*built for"):
        require("torchaudio", "conformer")


def test_parse_option_reads_json_values() -> None:
    assert parse_option("seq_len=64") == ("seq_len", 64)
    assert parse_option("depths=[1,1]") == ("depths", [1, 1])
    assert parse_option("act=gelu") == ("act", "gelu")
    with pytest.raises(Exception, match="KEY=VALUE"):
        parse_option("novalue")


def test_export_json_round_trip_and_missing(tmp_path: Path) -> None:
    info = ExportInfo("nerf", 2, "float32", 0, 17, {"points": 8}, {"points": {"shape": [16, 60]}}, ["output"])
    (tmp_path / "export.json").write_text(info.to_json())
    assert read_export(tmp_path) == info
    assert read_export(tmp_path / "model.onnx") == info
    (tmp_path / "empty").mkdir()
    with pytest.raises(WelderError, match="welder export"):
        read_export(tmp_path / "empty")
    (tmp_path / "export.json").write_text('{"model": "bert"}')
    with pytest.raises(WelderError, match="lacks"):
        read_export(tmp_path)


def test_measure_sizes_repeats_to_the_budget() -> None:
    calls = []
    plan = TimingPlan(warmup=2, warmup_s=0.0, repeats=5, repeat_ms=2.0, budget_s=0.5)
    timing = measure(lambda: calls.append(1), WallClock(), plan)
    assert 0 < timing.min_ms <= timing.median_ms
    assert timing.repeats == 5 and timing.number >= 1 and timing.clock == "wall"
    assert len(calls) >= 2 + 5 * timing.number


def test_benchmark_configs_parse_and_cover_the_reference_table() -> None:
    assert benchmark.Config.parse("bert:64:fp16") == benchmark.Config("bert", 64, "fp16")
    assert benchmark.Config.parse("nerf") == benchmark.Config("nerf", 1, "fp32")
    with pytest.raises(Exception, match="fp32, fp16, tf32"):
        benchmark.Config.parse("bert:1:int8")
    assert benchmark.Config.parse(benchmark.Config("swin_tiny", 64, "tf32").text) == benchmark.Config(
        "swin_tiny", 64, "tf32"
    )
    configs = benchmark.reference_configs()
    assert len(configs) == 22 and len(set(configs)) == 22
    assert benchmark.Config("nerf_large", 1, "fp16") in configs
    assert benchmark.Config("nerf_large", 64, "fp32") not in configs
    assert not any(c.model == "nerf" for c in configs)
    assert {c.dtype for c in configs} == {"fp32", "fp16"}
    twins = benchmark.with_tf32_twins(configs)
    assert len(twins) == 33
    for c in configs:
        if c.dtype == "fp32":
            assert twins[twins.index(c) + 1] == benchmark.Config(c.model, c.batch, "tf32")


def test_benchmark_geomean_over_compile_leaves_out_failed_rows() -> None:
    """Checked against the definition: the n-th root of the product of the ratios."""
    speedups = {"bert": (1.0, 0.5), "vit_small_p32": (2.0, 3.0), "swin_tiny": (1.0, 1.5)}
    rows = [
        benchmark.Row(
            benchmark.Config(m, 64, "fp16"),
            {"welder": benchmark.Cell(ms=w, accuracy="PASS"), "compile": benchmark.Cell(ms=c)},
        )
        for m, (w, c) in speedups.items()
    ]
    rows.append(
        benchmark.Row(
            benchmark.Config("mobilenet_v2", 64, "fp16"),
            {"welder": benchmark.Cell(ms=0.1, accuracy="FAIL"), "compile": benchmark.Cell(ms=9.0)},
        )
    )
    rows.append(benchmark.Row(benchmark.Config("bert", 1, "fp32"), {"welder": benchmark.Cell(ms=1.0)}))
    means = benchmark.geomean_speedups(rows)
    assert set(means) == {"fp16"}
    mean, used = means["fp16"]
    assert mean == pytest.approx((0.5 * 1.5 * 1.5) ** (1 / 3))
    assert [r.config.model for r in used] == list(speedups)
    table = benchmark.render_markdown(rows, {})
    assert f"- fp16: **{mean:.2f}x** over 3 rows; behind on bert b64 0.50x" in table
    assert "left out, test_acc FAIL: mobilenet_v2_b64_fp16" in table


def test_tf32_switches_are_set_inside_and_restored_after() -> None:
    need("torch")
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    for allowed in (True, False):
        with tf32_allowed(allowed) as note:
            assert torch.backends.cuda.matmul.allow_tf32 is allowed
            assert torch.backends.cudnn.allow_tf32 is allowed
            assert note.endswith(f"tf32={allowed}")
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved


def test_benchmark_workers_get_their_own_gpu_cores_and_options() -> None:
    argv = ["--configs", "bert:1:fp16", "--topk", "20", "--json=x.json", "--gpus", "4", "--skip-done"]
    argv += ["--out", "t.md", "--tf32", "--cache-dir", "c", "--deadline-s", "9"]
    assert benchmark.worker_argv(argv) == ["--topk", "20", "--cache-dir", "c"]
    slices = benchmark.core_slices(list(range(64)), 4)
    assert [len(s) for s in slices] == [16] * 4
    assert sorted(c for s in slices for c in s) == list(range(64))
    assert benchmark.core_slices([3, 5], 4) == [[3], [5], [3], [5]]


def test_call_latency_waits_for_every_call() -> None:
    """Each timed call is followed by its synchronise before the next one starts."""
    events: list[str] = []
    plan = TimingPlan(warmup=2, warmup_s=0.0, repeats=4, min_repeats=3, budget_s=1.0)
    timing = measure_calls(lambda: events.append("call"), lambda: events.append("sync"), plan)
    assert timing.number == 1 and 3 <= timing.repeats <= 12 and timing.min_ms >= 0
    assert events.count("call") >= 2 + timing.repeats
    assert "call,call" not in ",".join(events)


def test_torch_system_reports_device_time_and_call_latency() -> None:
    """On the CPU (no graphs to capture) both figures are wall clock, and both come back."""
    need("torch")
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval()
    plan = TimingPlan(warmup=2, warmup_s=0.0, repeats=3, repeat_ms=1.0, budget_s=0.5)
    timing = time_system("eager", module, (torch.randn(8, 64),), "cpu", plan)
    assert timing.device.median_ms > 0 and timing.call.median_ms > 0 and timing.compile_s is None
    assert timing.call.number == 1 and timing.notes == []
    with pytest.raises(ValueError, match="unknown torch system"):
        time_system("jit", module, (torch.randn(8, 64),), "cpu", plan)


def test_benchmark_table_has_speedups_and_errors() -> None:
    cfg = benchmark.Config("bert", 1, "fp16")
    row = benchmark.Row(
        cfg,
        {
            "welder": benchmark.Cell(ms=0.5, build_s=244.0),
            "eager": benchmark.Cell(ms=4.0),
            "compile": benchmark.Cell(ms=1.0, build_s=30.0),
            "compile-max-autotune": benchmark.Cell(ms=0.25, build_s=600.0),
            "onnxruntime": benchmark.Cell(error="Fail: no | kernel\nfor op", detail="onnxruntime-cpu"),
        },
    )
    table = benchmark.render_markdown([row], {"device": "NVIDIA H200"})
    line = next(x for x in table.splitlines() if x.startswith("| bert"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:7] == ["bert", "1", "fp16", "0.500", "4.000", "1.000", "0.250"]
    assert cells[7].startswith("error: Fail: no / kernel for op")
    assert cells[8:] == ["8.00x", "2.00x", "0.50x", "-", "244", "30", "600"]
    assert "onnxruntime-cpu ms" in table and "- bert_b1_fp16 (onnxruntime): Fail" in table

    row.cells["onnxruntime"] = benchmark.Cell(absent="CUDAExecutionProvider absent")
    table = benchmark.render_markdown([row], {})
    line = next(x for x in table.splitlines() if x.startswith("| bert"))
    assert [c.strip() for c in line.strip("|").split("|")][7] == "absent"
    assert "- bert_b1_fp16 (onnxruntime): CUDAExecutionProvider absent" in table
    assert benchmark.Row.from_dict(row.to_dict()) == row
    assert "Call latency" not in table  # no system measured one

    row.cells["welder"].call_ms = 0.75
    row.cells["compile"].call_ms = 1.5
    row.cells["compile"].detail = "torch 2.x; its callable could not be captured (RuntimeError: x)"
    table = benchmark.render_markdown([row], {})
    calls = table[table.index("Call latency") :]
    header = next(x for x in calls.splitlines() if x.startswith("| model"))
    line = next(x for x in calls.splitlines() if x.startswith("| bert"))
    columns = dict(zip(header.strip("|").split("|"), line.strip("|").split("|")))
    assert {k.strip(): v.strip() for k, v in columns.items()} == {
        "model": "bert",
        "bs": "1",
        "dtype": "fp16",
        "welder": "0.750",
        "eager": "-",
        "compile": "1.500",
        "compile-max-autotune": "-",
        "onnxruntime": "-",
    }
    assert "- bert_b1_fp16 (compile): its callable could not be captured (RuntimeError: x)" in table
    assert benchmark.Row.from_dict(row.to_dict()) == row


def test_onnxruntime_without_the_cuda_provider_is_absent_not_timed_on_the_cpu(tmp_path: Path) -> None:
    """Beside a GPU the onnxruntime peer is its CUDA provider; a build without it leaves
    the cell absent, naming the providers it has, and nothing is timed."""
    import onnxruntime as ort

    assert benchmark.ort_provider_for("cuda") == "cuda" and benchmark.ort_provider_for("cpu") == "cpu"
    assert benchmark.ort_provider_for("cuda", "cpu") == "cpu"
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    cell = benchmark.run_ort_peer(tmp_path / "not-exported", "cuda", TimingPlan())
    assert cell.ms is None and cell.error is None
    assert cell.absent and "CUDAExecutionProvider absent" in cell.absent
    assert "CPUExecutionProvider" in cell.absent


def test_benchmark_keeps_rows_of_other_runs(tmp_path: Path) -> None:
    old = benchmark.Row(benchmark.Config("nerf", 1, "fp32"), {"eager": benchmark.Cell(ms=5.0)}, "H200", "d")
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": [old.to_dict()]}))
    assert benchmark.load_rows(path) == {"nerf_b1_fp32": old}


# -- with torch ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_export_matches_module_and_rebuilds_identically(name: str, exported: Any) -> None:
    """(conformer skips here without torchaudio, which cannot be installed beside every
    torch; the GPU machine has it.)"""
    prefix = exported(name)
    info = json.loads((prefix / "export.json").read_text())
    assert (info["model"], info["batch"], info["dtype"], info["seed"]) == (name, 2, "float32", 0)
    assert info["versions"]["torch"] and info["outputs"] == list(MODELS[name].outputs)
    # The export checked itself against the module, and says so in export.json.
    assert info["check"]["reference"].startswith("onnxruntime")
    assert list(info["check"]["outputs"]) == info["outputs"]
    assert all(o["metric"] <= o["limit"] for o in info["check"]["outputs"].values())

    first, inputs, _ = rebuild(prefix)
    second, inputs_again, _ = rebuild(prefix)
    assert [list(v.shape) for v in inputs.values()] == [v["shape"] for v in info["inputs"].values()]
    for k in inputs:
        assert np.array_equal(inputs[k].numpy(), inputs_again[k].numpy())
    ours, again = outputs_of(first, inputs), outputs_of(second, inputs_again)
    # Order-one outputs: vanishing ones would pass any comparison (and be zeros in fp16).
    assert all(np.abs(out).max() > 1e-2 for out in ours if out.dtype.kind == "f")
    for a, b in zip(ours, again):
        assert np.array_equal(a, b), "two rebuilds from export.json differ"

    reference = onnxruntime_outputs(prefix, to_numpy(inputs))
    assert list(reference) == info["outputs"]
    for out, ref in zip(ours, reference.values()):
        assert error_metric(out, ref) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["bert", "vit_small_p32", "swin_tiny", "mobilenet_v2", "nerf", "bsrn", "nafnet", "restormer"]
)
def test_welder_interpreter_agrees_on_exported_models(name: str, exported: Any) -> None:
    prefix = exported(name)
    _, inputs, _ = rebuild(prefix)
    feeds = to_numpy(inputs)
    sess = welder.InferenceSession(prefix, backend="interpret")
    reference = onnxruntime_outputs(prefix, feeds)
    for (out_name, ref), ours in zip(reference.items(), sess.run(list(reference), feeds)):
        assert error_metric(ours, ref) <= TOLERANCE, out_name


@pytest.mark.slow
def test_nerf_is_the_original_mlp_and_nerf_large_the_earlier_one() -> None:
    """``nerf``: 7 ReLU layers of 64 and a head of 3 over 1920x1080 points per batch
    element; ``nerf_large``: 8 layers of 256 with the input concatenated again before the
    fifth, a head of 4, 2M points."""
    need("torch")
    import torch

    from welder.export import NERF, NERF_LARGE, build_model

    assert NERF["points"] == 1920 * 1080 and NERF_LARGE["points"] == 2 * 1024 * 1024
    small, inputs = build_model("nerf", batch=3, options={"points": 5})
    linears = [m for m in small.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(60, 64)] + [(64, 64)] * 6 + [(64, 3)]
    assert list(inputs["points"].shape) == [15, 60]
    large, _ = build_model("nerf_large", options={"points": 5})
    linears = [m for m in large.modules() if isinstance(m, torch.nn.Linear)]
    assert [m.in_features for m in linears] == [60, 256, 256, 256, 316, 256, 256, 256, 256]
    assert linears[-1].out_features == 4


@pytest.mark.slow
def test_resnet50_in_fp16_stays_near_its_own_weights_in_fp32() -> None:
    """With the default initialisation a random ResNet-50 turns fp16 rounding into a 9%
    error in its logits (no fp16 export could pass its check); the quarter-scaled residual
    branches keep torch's own fp16 module within 5e-3 of the same weights run in fp32."""
    need("torch", "torchvision")
    import torch

    from welder.export import build_model

    half, inputs = build_model("resnet50", batch=2, fp16=True, options={"img_size": 128})
    with torch.no_grad():
        got = half(*inputs.values()).float().numpy()
        want = half.float()(*(v.float() for v in inputs.values())).numpy()
    assert np.abs(want).max() > 0.1
    assert error_metric(got, want) <= 5e-3


@pytest.mark.slow
def test_restoration_models_have_their_papers_sizes() -> None:
    """At their defaults the modules have the papers' parameter counts (BSRN x4: 352K in
    its paper; Restormer: 26.13M) and map a 3x256x256 image to an image (BSRN: x4)."""
    need("torch")
    from welder.export import build_model

    sizes = {}
    for name in ("bsrn", "nafnet", "restormer"):
        module, inputs = build_model(name)
        assert list(inputs["input"].shape) == [1, 3, 256, 256]
        sizes[name] = sum(p.numel() for p in module.parameters())
    assert 0.34e6 < sizes["bsrn"] < 0.37e6
    assert 26.0e6 < sizes["restormer"] < 26.2e6
    assert 1.0e6 < sizes["nafnet"] < 1.3e6  # width 16, one block per level


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nerf", "nerf_large", "bsrn"])
def test_fp16_exports_of_the_new_models_are_checked_half_graphs(name: str, tmp_path: Path) -> None:
    """fp16 by ``.half()``, traced on the CPU: a half graph whose outputs the export
    compared with the half module's within the fp16 limit.  (NAFNet and Restormer pass
    the same check but take minutes here: torch's half convolutions on the CPU are slow.)"""
    need(*get_spec(name).packages)
    import onnx

    path = export_onnx(name, tmp_path, batch=2, fp16=True, options=SMALL[name], device="cpu")
    assert _float32_weights(onnx.load(str(path))) == []
    check = read_export(tmp_path).check
    assert check["reference"] == "onnxruntime CPUExecutionProvider"
    [(out, result)] = check["outputs"].items()
    assert out == "output" and result["limit"] == threshold_for("float16") and result["metric"] <= 2e-2


@pytest.mark.slow
def test_export_whose_graph_disagrees_with_the_module_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export's own check: onnxruntime's outputs (here perturbed) must match the
    module's, or the export fails naming the output and leaves no model behind."""
    need("torch")
    import welder.check

    real = welder.check.onnxruntime_outputs

    def perturbed(*args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        return {k: v + 1.0 for k, v in real(*args, **kwargs).items()}

    monkeypatch.setattr(welder.check, "onnxruntime_outputs", perturbed)
    with pytest.raises(WelderError, match=r"does not compute the module.*output 1\.\d+e\+00 > 1e-04"):
        export_onnx("nerf", tmp_path / "bad", options={"points": 4})
    assert not (tmp_path / "bad").exists()
    export_onnx("nerf", tmp_path / "unchecked", options={"points": 4}, check=False)
    assert read_export(tmp_path / "unchecked").check == {}


@pytest.mark.slow
def test_export_keeps_its_inputs_and_onnxruntime_s_outputs_for_test_acc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """inputs.npz holds the inputs the module was exported and checked on, and with a
    reference cache the check's onnxruntime outputs are there for test_acc on those
    inputs: read back without running onnxruntime, equal to a fresh run of it."""
    need("torch")
    import welder.check
    from welder.check import cached_onnxruntime_outputs, saved_inputs
    from welder.frontend.onnx import import_onnx

    cache = tmp_path / "references"
    export_onnx("bert", tmp_path / "bert", batch=2, options=SMALL["bert"], reference_cache=cache)
    prefix = tmp_path / "bert"
    graph = import_onnx(prefix / "model.onnx")
    feeds = saved_inputs(prefix / INPUTS_NPZ, graph)
    _, inputs, _ = rebuild(prefix)
    assert set(feeds) == {t.name for t in graph.inputs}
    for name, value in feeds.items():
        assert np.array_equal(value, inputs[name].numpy()), name
    fresh = onnxruntime_outputs(prefix, feeds)

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("onnxruntime ran again")

    monkeypatch.setattr(welder.check, "onnxruntime_outputs", refused)
    kept = cached_onnxruntime_outputs(prefix / "model.onnx", feeds, list(graph.outputs), cache)
    assert list(kept) == list(graph.outputs) == list(fresh)
    for name, value in fresh.items():
        assert np.array_equal(kept[name], value), name


@pytest.mark.slow
def test_conformer_without_torchaudio_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without torchaudio (as on the development machines: it is built for one torch
    release) the conformer export stops with a message naming it; the export itself is
    checked where torchaudio is installed (test_export_matches_module_and_rebuilds...)."""
    need("torch")
    monkeypatch.setitem(sys.modules, "torchaudio", None)
    with pytest.raises(WelderError, match=r"model 'conformer' needs the package 'torchaudio'"):
        export_onnx("conformer", tmp_path / "c", options=SMALL["conformer"])
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_build_leaves_the_global_random_stream_alone() -> None:
    need("torch")
    import torch

    from welder.export import build_model

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("nerf", options={"points": 4})
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_fp16_bert_exports_as_a_half_graph_that_onnxruntime_runs(tmp_path: Path) -> None:
    """The half BertModel, traced on the CPU, is a half graph: its weights are float16,
    onnxruntime loads it and agrees with the half module within the fp16 threshold, and so
    does welder's interpreter (the check test_acc makes on a built runtime)."""
    need(*get_spec("bert").packages)
    import onnx
    import torch

    path = export_onnx("bert", tmp_path, batch=2, fp16=True, options=SMALL["bert"], device="cpu")
    assert _float32_weights(onnx.load(str(path))) == []
    module, inputs, info = rebuild(tmp_path)
    assert info.dtype == "float16"
    with torch.no_grad():
        out = module(*inputs.values())
    reference = onnxruntime_outputs(tmp_path, to_numpy(inputs))
    assert [r.dtype for r in reference.values()] == [np.float16, np.float16]
    for got, ref in zip(out, reference.values()):
        assert error_metric(got.float().numpy(), ref.astype(np.float32)) <= threshold_for("float16")
    report = check_model(tmp_path)
    assert report.passed, report.format()
    assert {o.threshold for o in report.outputs} == {threshold_for("float16")}


@pytest.mark.slow
def test_bf16_bert_exports_as_a_bf16_graph_checked_against_fp32(tmp_path: Path) -> None:
    """``--bf16``: the bfloat16 BertModel, traced on the CPU, is a bf16 graph (no float32
    weights); onnxruntime has no bf16 arithmetic, so the reference is the model in fp32 with
    its bf16 weights and inputs upcast, which the bf16 module and welder's interpreter both
    meet within the bf16 threshold."""
    need(*get_spec("bert").packages)
    import ml_dtypes
    import onnx
    import torch

    from welder.check import BF16_AS_FP32

    path = export_onnx("bert", tmp_path, batch=2, bf16=True, options=SMALL["bert"], device="cpu")
    model = onnx.load(str(path))
    assert _float32_weights(model) == []
    assert {t.data_type for t in model.graph.initializer} >= {onnx.TensorProto.BFLOAT16}
    module, inputs, info = rebuild(tmp_path)
    assert info.dtype == "bfloat16"
    with torch.no_grad():
        out = module(*inputs.values())
    feeds = to_numpy(inputs)
    assert any(v.dtype == ml_dtypes.bfloat16 for v in feeds.values()) or all(
        v.dtype == np.int64 for v in feeds.values()
    )
    reference = onnxruntime_outputs(tmp_path, feeds)
    assert [r.dtype for r in reference.values()] == [ml_dtypes.bfloat16] * 2
    for got, ref in zip(out, reference.values()):
        assert error_metric(got.float().numpy(), ref.astype(np.float32)) <= threshold_for("bfloat16")
    report = check_model(tmp_path)
    assert report.passed and report.reference == BF16_AS_FP32, report.format()
    assert {o.threshold for o in report.outputs} == {threshold_for("bfloat16")}


@pytest.mark.slow
def test_fp16_export_that_promotes_to_float32_is_refused_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the half attention symbolic, torch's exporter builds the boolean mask of
    scaled_dot_product_attention in float32 and promotes the rest of the layer: the export
    says so and leaves no model behind.  The symbolic is registered for one export only:
    after a good fp16 export, an export without it fails the same way."""
    need(*get_spec("bert").packages)
    import contextlib

    import welder.export

    export_onnx("bert", tmp_path / "good", batch=1, fp16=True, options=SMALL["bert"], device="cpu")
    monkeypatch.setattr(welder.export, "half_attention", lambda opset: contextlib.nullcontext())
    prefix = tmp_path / "bert16"
    with pytest.raises(WelderError, match=r"float32 weights beside half ones \(onnx::MatMul"):
        export_onnx("bert", prefix, batch=2, fp16=True, options=SMALL["bert"], device="cpu")
    assert not prefix.exists()


def _float32_weights(model: Any) -> list[tuple[str, list[int]]]:
    """Float32 initializers of more than one element (a scalar fill value may stay)."""
    import onnx

    return [
        (t.name, list(t.dims))
        for t in model.graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT and int(np.prod(t.dims)) > 1
    ]


@pytest.mark.slow
def test_peer_scripts_and_benchmark_run_on_the_cpu(tmp_path: Path) -> None:
    """A smoke run of the GPU-side scripts on the CPU: export, eager and onnxruntime
    timings, the table and its JSON -- the same code paths the device run takes."""
    need("torch")
    opts = json.dumps({"nerf": SMALL["nerf"]})
    cmd = [sys.executable, "scripts/benchmark.py", "--configs", "nerf:2:fp32", "--runs", str(tmp_path)]
    cmd += ["--systems", "eager,onnxruntime", "--device", "cpu", "--budget-s", "0.2"]
    cmd += ["--model-options", opts, "--json", str(tmp_path / "b.json"), "--out", str(tmp_path / "b.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert row["cells"]["eager"]["ms"] > 0 and row["cells"]["onnxruntime"]["ms"] > 0
    assert "| nerf | 2 | fp32 |" in (tmp_path / "b.md").read_text()

    # Two configs at once, each in its own worker: both rows land, beside the first run's,
    # and a resumed run with --skip-done measures nothing again.
    more = ["--configs", "nerf:2:fp32,nerf:3:fp32,nerf:4:fp32", "--gpus", "2", "--skip-done"]
    proc = subprocess.run(cmd + more, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {
        r["config"]["dtype"] + str(r["config"]["batch"]): r
        for r in json.loads((tmp_path / "b.json").read_text())["rows"]
    }
    assert set(rows) == {"fp322", "fp323", "fp324"}
    assert all(r["cells"]["eager"]["ms"] > 0 for r in rows.values())
    assert "[nerf_b2_fp32] started" not in proc.stderr and "[nerf_b4_fp32] started on GPU" in proc.stderr
    assert (tmp_path / "nerf_b4_fp32.log").is_file()

    prefix = str(tmp_path / "nerf_b2_fp32")
    for script in ("run_torch.py", "run_onnxrt.py"):
        args = [sys.executable, f"artifacts/{script}", prefix, "--budget-s", "0.2"]
        extra = ["--device", "cpu", "--systems", "eager"] if script == "run_torch.py" else []
        proc = subprocess.run(args + extra, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert " ms " in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bert", "nerf"])
def test_fp16_export_on_the_gpu_is_pure_half(name: str, tmp_path: Path) -> None:
    """fp16 is traced on the GPU: every float weight of the graph is half, and onnxruntime
    (CPU) agrees with the half module on the GPU within the fp16 threshold."""
    need(*get_spec(name).packages)
    import onnx
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = export_onnx(name, tmp_path, batch=2, fp16=True, options=SMALL[name])
    singles = _float32_weights(onnx.load(str(path)))
    assert singles == [], f"float32 initializers: {singles[:8]}"
    module, inputs, info = rebuild(tmp_path)
    assert info.dtype == "float16"
    with torch.no_grad():
        out = module.cuda()(*(v.cuda() for v in inputs.values()))
    ours = [t.float().cpu().numpy() for t in (out if isinstance(out, tuple) else (out,))]
    reference = onnxruntime_outputs(tmp_path, to_numpy(inputs))
    for got, ref in zip(ours, reference.values()):
        assert error_metric(got, ref.astype(np.float32)) <= threshold_for("float16")


def test_the_table_names_the_commit_and_says_when_the_tree_differs(tmp_path: Path, monkeypatch) -> None:
    """A tree copied over an older checkout (as on a GPU machine) or with uncommitted work is
    marked, so a table never names a commit it was not measured at; WELDER_COMMIT wins."""
    import subprocess

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    monkeypatch.delenv("WELDER_COMMIT", raising=False)
    git("init", "-q")
    (tmp_path / "welder").mkdir()
    (tmp_path / "welder" / "x.py").write_text("a = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "--short", "HEAD").strip()
    assert benchmark._git_commit(tmp_path) == f"@ {head}"
    (tmp_path / "welder" / "x.py").write_text("a = 2\n")
    assert benchmark._git_commit(tmp_path) == f"@ {head} with uncommitted changes"
    monkeypatch.setenv("WELDER_COMMIT", "abc1234")
    assert benchmark._git_commit(tmp_path) == "@ abc1234"


@pytest.mark.parametrize("profiler", [True, False])
@pytest.mark.parametrize("system", ["compile", "eager"])
def test_a_model_no_mode_can_capture_is_timed_by_the_profiler_or_events(
    monkeypatch, system, profiler
) -> None:
    """Where neither the callable nor its CUDA-graph-free twin can be captured (a forward
    that syncs with the host), the device time is the GPU's busy time from the profiler,
    or CUDA events around calls where the profiler records nothing, with every reason in
    the note -- not an error cell."""
    need("torch")
    import run_torch
    import torch

    timings = iter(run_torch.Timing(float(ms), float(ms), 1, 1, "fake") for ms in (1, 2))

    def no_capture(call, plan):
        raise RuntimeError("operation failed due to a previous error during capture")

    def busy(call, plan):
        if not profiler:
            raise RuntimeError("torch.profiler recorded no GPU work")
        return run_torch.Timing(0.5, 0.5, 1, 1, "busy")

    monkeypatch.setattr(run_torch, "_device_time", no_capture)
    monkeypatch.setattr(run_torch, "_busy_time", busy)
    monkeypatch.setattr(run_torch, "_compiled", lambda module, mode: module)
    monkeypatch.setattr(run_torch, "measure_calls", lambda call, sync, plan=None: next(timings))
    monkeypatch.setattr(run_torch, "measure", lambda call, clock, plan=None: next(timings))
    monkeypatch.setattr(run_torch, "CudaEventClock", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    module = torch.nn.Linear(4, 4)
    got = time_system(system, module, (torch.ones(1, 4),), "cuda")
    assert (got.call.median_ms, got.device.median_ms) == (1.0, 0.5 if profiler else 2.0)
    (note,) = got.notes
    assert note.endswith(run_torch.BUSY_TIME) if profiler else run_torch.AROUND_CALLS in note
    assert not profiler or run_torch.AROUND_CALLS not in note
    if system == "compile":
        assert "in any mode" in note and "mode='default'" in note


def test_busy_time_counts_kernels_copies_and_memsets_not_annotations() -> None:
    """A GPU-side annotation spans its region's kernels and the gaps between them, so it is
    no work of its own; nor is a host event.  Without ``activity_type`` (older torch) a
    device event counts unless it is a user annotation."""
    from types import SimpleNamespace as Event

    import run_torch

    def work(**kw) -> bool:
        return run_torch._gpu_work(Event(**kw), "cuda")

    assert all(work(device_type="cuda", activity_type=k) for k in ("kernel", "gpu_memcpy", "gpu_memset"))
    assert not work(device_type="cuda", activity_type="gpu_user_annotation")
    assert not work(device_type="cpu", activity_type="kernel")
    assert work(device_type="cuda") and not work(device_type="cuda", is_user_annotation=True)


@pytest.mark.parametrize("caches", ["off", "empty", "filled", "default"])
def test_a_cold_compile_says_so_and_tells_its_time_on_stderr(monkeypatch, capsys, tmp_path, caches) -> None:
    """The note that lets Table 4 take a compile time as a cold one: on a compiled system
    whose process had Inductor's caches off or both its cache folders empty, on no other;
    and the compile time on stderr as soon as it is known (what a parent that stops the
    process later keeps)."""
    need("torch")
    import run_torch
    import torch

    monkeypatch.setattr(run_torch, "_compiled", lambda module, mode: module)
    monkeypatch.delenv(run_torch.COLD_ENV, raising=False)
    for name in run_torch.CACHE_ENVS:
        monkeypatch.delenv(name, raising=False)
    if caches == "off":
        monkeypatch.setenv(run_torch.COLD_ENV, "1")
    elif caches in ("empty", "filled"):
        for name in run_torch.CACHE_ENVS:
            monkeypatch.setenv(name, str(tmp_path / name))
        (tmp_path / run_torch.CACHE_ENVS[0]).mkdir()
        if caches == "filled":
            (tmp_path / run_torch.CACHE_ENVS[-1]).mkdir()
            (tmp_path / run_torch.CACHE_ENVS[-1] / "kernel.cubin").write_bytes(b"x")
    plan = TimingPlan(warmup=1, warmup_s=0.0, repeats=3, min_repeats=1, repeat_ms=1.0, budget_s=0.1)
    module, args = torch.nn.Linear(4, 4), (torch.ones(1, 4),)
    timing = time_system("compile", module, args, "cpu", plan)
    expected = {"off": [run_torch.COLD_NOTE], "empty": [run_torch.EMPTY_NOTE]}.get(caches, [])
    assert timing.notes == expected
    assert all(run_torch.COLD in note for note in expected)
    said = run_torch.compile_seconds(capsys.readouterr().err, "compile")
    assert said == pytest.approx(timing.compile_s, abs=0.01)
    assert time_system("eager", module, args, "cpu", plan).notes == []
    assert run_torch.compile_seconds(capsys.readouterr().err, "eager") is None


def test_compile_seconds_reads_the_named_system_s_last_line() -> None:
    import run_torch

    err = "warning: x\n# compile compiled in 3.50 s\n# compile-max-autotune compiled in 95.25 s\ntrace"
    assert run_torch.compile_seconds(err, "compile-max-autotune") == 95.25
    assert run_torch.compile_seconds(err, "compile") == 3.5
    assert run_torch.compile_seconds("# compile compiled in", "compile") is None


def test_busy_time_is_the_union_of_the_spans() -> None:
    """The profiler's spans merged as intervals: against counting the covered microseconds
    of random integer spans one by one (overlaps, nesting and gaps included)."""
    import random

    import run_torch

    rng = random.Random(3)
    for _ in range(200):
        spans = [
            (a, a + rng.randint(0, 30)) for a in (rng.randint(0, 200) for _ in range(rng.randint(0, 12)))
        ]
        covered = {t for start, end in spans for t in range(start, end)}
        assert run_torch.busy_ms(spans) == pytest.approx(len(covered) / 1e3)
