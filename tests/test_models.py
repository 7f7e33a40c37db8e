"""Whole models shaped like exporter output (tests/models.py), through the Python API and
the command line, checked against onnxruntime with the design's metric."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from models import (
    Feeds,
    bert_encoder_layer,
    conformer_conv_module,
    gpt2_model,
    mobilenetv2_block,
    swin_window_attention_block,
    unsupported_ops_model,
    vit_block,
)

import welder
from welder import session
from welder.check import error_metric, onnxruntime_outputs, threshold_for
from welder.cli import main
from welder.frontend.passes import simplify
from welder.graph import Graph
from welder.ir.expr import format_tensor_name

REDUCTION = re.compile(r"(sum|prod|max|min|argmax|argmin)\[r\d")

Builder = Callable[[], tuple[onnx.ModelProto, Feeds]]

CASES: dict[str, Builder] = {
    "bert_layer": bert_encoder_layer,
    "bert_2_layers_decomposed_ln": partial(bert_encoder_layer, layers=2, decomposed_layernorm=True),
    "bert_embeddings_batch2": partial(bert_encoder_layer, batch=2, embeddings=True),
    "bert_sdpa_batch2": partial(bert_encoder_layer, batch=2, sdpa=True),
    "mobilenetv2": mobilenetv2_block,
    "mobilenetv2_batch2_28px": partial(mobilenetv2_block, batch=2, size=28),
    "vit": vit_block,
    "vit_einsum": partial(vit_block, einsum=True),
    "vit_gelu_op_depth2": partial(vit_block, gelu_op=True, depth=2),
    "swin_shifted": swin_window_attention_block,
    "swin_shifted_batch2": partial(swin_window_attention_block, batch=2),
    "swin_regular": partial(swin_window_attention_block, shift=0),
    "conformer_k15": conformer_conv_module,
    "conformer_k31_slice_glu": partial(conformer_conv_module, kernel=31, glu_by_slice=True),
    "conformer_causal_batch2": partial(conformer_conv_module, batch=2, causal=True),
    "gpt2_2_layers": gpt2_model,
}

# Operator types each model uses only on values known at import time (shape arithmetic,
# constant tables): the import must fold them away.
FOLDED = {
    "bert_layer": {"Shape", "Gather", "Unsqueeze", "Concat"},
    "bert_2_layers_decomposed_ln": {"Shape", "Gather", "Unsqueeze", "Concat"},
    "bert_embeddings_batch2": {"Shape", "Gather", "Unsqueeze", "Slice"},
    "bert_sdpa_batch2": {"Shape", "Slice", "Cast", "Sqrt", "Div", "ConstantOfShape", "Equal", "Where"},
    "vit": {"Shape", "Slice", "Concat", "ConstantOfShape", "Equal", "Where", "Expand"},
    "swin_shifted": {"Shape", "Gather", "Div", "Unsqueeze", "Reshape", "Transpose"},
}

SYMBOLIC_SHAPES = {"input_ids": (2, 12), "token_type_ids": (2, 12), "attention_mask": (2, 12)}
SHAPE_ARGS = [arg for k, (b, s) in SYMBOLIC_SHAPES.items() for arg in ("--input-shape", f"{k}={b}x{s}")]


def save(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    path = folder / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path, onnx.ModelProto, Feeds]:
    """(case name, saved model path, model, feeds) for every model of CASES."""
    model, feeds = CASES[request.param]()
    return request.param, save(model, tmp_path, request.param), model, feeds


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_outputs_match(ours: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> None:
    assert set(ours) == set(reference)
    for name, ref in reference.items():
        got = ours[name]
        assert got.shape == ref.shape, name
        assert got.dtype == ref.dtype, name
        err = error_metric(got, ref)
        assert err <= threshold_for(ref.dtype.name), f"{name}: error {err:.3e}"


# -- the models themselves --------------------------------------------------------------------


def test_models_are_valid_onnx(case: tuple[str, Path, onnx.ModelProto, Feeds]) -> None:
    _, path, model, feeds = case
    onnx.checker.check_model(model, full_check=True)
    outputs = onnxruntime_outputs(path, feeds)
    assert all(np.isfinite(v).all() and np.abs(v).max() > 1e-3 for v in outputs.values())


# -- Python API -------------------------------------------------------------------------------


def test_session_matches_onnxruntime(case: tuple[str, Path, onnx.ModelProto, Feeds]) -> None:
    _, path, _, feeds = case
    sess = welder.InferenceSession(path, backend="interpret")
    ref_sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ours_in, ref_in = sess.get_inputs(), ref_sess.get_inputs()
    assert [(i.name, i.shape, i.type) for i in ours_in] == [(i.name, i.shape, i.type) for i in ref_in]
    assert [i.shape for i in ours_in] == [list(feeds[i.name].shape) for i in ours_in]
    names = [o.name for o in ref_sess.get_outputs()]
    assert [(o.name, o.type) for o in sess.get_outputs()] == [
        (o.name, o.type) for o in ref_sess.get_outputs()
    ]

    outs = sess.run(None, feeds)
    reference = dict(zip(names, ref_sess.run(None, feeds)))
    assert [o.shape for o in sess.get_outputs()] == [list(reference[n].shape) for n in names]
    assert_outputs_match(dict(zip(names, outs)), reference)
    # Asking for one output by name gives that output.
    [last] = sess.run([names[-1]], feeds)
    np.testing.assert_array_equal(last, outs[-1])


def import_time_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """Name -> op type of the ONNX nodes whose outputs are known at import time: shapes,
    and nodes reading only initializers and such outputs."""
    known = {t.name for t in model.graph.initializer}
    static = {}
    for n in model.graph.node:
        if n.op_type == "Shape" or all(i in known for i in n.input if i):
            known.update(n.output)
            static[n.name] = n.op_type
    return static


def test_import_folds_what_is_known_at_import(case: tuple[str, Path, onnx.ModelProto, Feeds]) -> None:
    name, _, model, _ = case
    static = import_time_nodes(model)
    assert FOLDED.get(name, set()) <= set(static.values())
    graph = welder.import_onnx(model)
    left = {n.source: n.op_type for n in graph.nodes.values() if n.source in static}
    assert not left, f"not folded: {left}"


def test_bert_embeddings_keep_only_the_data_dependent_gathers() -> None:
    """The position ids are a slice of a buffer (constant); the word and token-type
    lookups and the pooler's ``h[:, 0]`` read inputs and stay."""
    model, _ = bert_encoder_layer(embeddings=True)
    graph = welder.import_onnx(model)
    gathers = {n.source for n in graph.nodes.values() if n.op_type == "Gather"}
    assert gathers == {"/embeddings/Gather_1", "/embeddings/Gather_2", "/pooler/Gather"}


@pytest.mark.parametrize(
    "builder", [mobilenetv2_block, conformer_conv_module], ids=["mobilenetv2", "conformer"]
)
def test_batchnorm_folds_into_the_conv_before_it(builder: Builder) -> None:
    model, _ = builder()
    assert any(n.op_type == "BatchNormalization" for n in model.graph.node)
    graph = welder.import_onnx(model)
    assert not [n.name for n in graph.nodes.values() if n.op_type == "BatchNormalization"]
    convs = {n.name for n in model.graph.node if n.op_type == "Conv"}
    assert {n.source for n in graph.nodes.values() if n.op_type == "Conv"} == convs


def test_symbolic_bert_through_python_api(tmp_path: Path) -> None:
    model, feeds = bert_encoder_layer(batch=2, seq=12, embeddings=True, symbolic=True)
    path = save(model, tmp_path, "bert_symbolic")
    with pytest.raises(welder.ShapeError, match="input_ids"):
        welder.InferenceSession(path)
    sess = welder.InferenceSession(path, input_shapes=SYMBOLIC_SHAPES)
    assert {i.name: tuple(i.shape) for i in sess.get_inputs()} == SYMBOLIC_SHAPES
    names = [o.name for o in sess.get_outputs()]
    assert_outputs_match(dict(zip(names, sess.run(None, feeds))), onnxruntime_outputs(path, feeds, names))


# -- command line -----------------------------------------------------------------------------


def test_cli_check_passes(case: tuple[str, Path, onnx.ModelProto, Feeds], capsys) -> None:
    _, path, model, _ = case
    code, out, err = run_cli(["check", str(path), "--backend", "interpret", "--seed", "0"], capsys)
    assert code == 0, out + err
    assert out.splitlines()[-1] == "PASS"
    assert "FAIL" not in out
    assert all(o.name in out for o in model.graph.output)


#: Models `welder check` runs emulated: all but GPT-2, which goes through the same planning,
#: kernels and emulated run from the Python API, from a cold cache, in
#: test_emulated_session_matches_onnxruntime_in_time.
CLI_CHECKED = [name for name in CASES if name != "gpt2_2_layers"]


@pytest.mark.parametrize("name", CLI_CHECKED)
def test_cli_check_passes_with_emulated_kernels(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole compiler -- fusion, configs, generated CUDA -- run on the CPU, for every
    model (each compiles its kernels with g++ for the emulator: 1-7 s apiece)."""
    model, _ = CASES[name]()
    path = save(model, tmp_path, name)
    code, out, err = run_cli(["check", str(path), "--backend", "emulate", "--seed", "1"], capsys)
    assert code == 0, out + err
    assert out.splitlines()[-1] == "PASS"
    assert all(o.name in out for o in model.graph.output)


# The design's bound for a 2-layer GPT-2 (hidden 256, 64 tokens) through the emulator; on
# the 2-core build machine it took 35 s alone and 45 s beside the rest of the suite
# (2026-11-30: planning 11 s, g++ 8 s, the emulated run 10 s).
GPT2_EMULATE_LIMIT_S = 60.0


def test_emulated_session_matches_onnxruntime_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``InferenceSession(path, backend="emulate")`` mirrors onnxruntime's inputs, outputs
    and results; a 2-layer GPT-2 goes from the file to its outputs within the design's
    bound, timed from a cold kernel cache (planning, generation, g++ and the emulated run)."""
    model, feeds = gpt2_model()
    path = save(model, tmp_path, "gpt2")
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path / "cache"))
    start = time.perf_counter()
    sess = welder.InferenceSession(path, backend="emulate")
    outs = sess.run(None, feeds)
    seconds = time.perf_counter() - start
    assert seconds < GPT2_EMULATE_LIMIT_S, f"{seconds:.1f} s"
    assert any((tmp_path / "cache" / "emu").glob("*.so"))  # the kernels were built, not found
    assert sess.get_providers() == ["emulate"]

    ref_sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref_in, ref_out = ref_sess.get_inputs(), ref_sess.get_outputs()
    assert [(i.name, i.shape, i.type) for i in sess.get_inputs()] == [
        (i.name, i.shape, i.type) for i in ref_in
    ]
    assert [(o.name, o.type) for o in sess.get_outputs()] == [(o.name, o.type) for o in ref_out]
    names = [o.name for o in ref_out]
    reference = dict(zip(names, ref_sess.run(None, feeds)))
    assert [o.shape for o in sess.get_outputs()] == [list(reference[n].shape) for n in names]
    assert_outputs_match(dict(zip(names, outs)), reference)
    [last] = sess.run([names[-1]], feeds)  # a second run reuses the compiled kernels
    np.testing.assert_array_equal(last, outs[-1])


def test_cli_import_writes_model_json(
    case: tuple[str, Path, onnx.ModelProto, Feeds], tmp_path, capsys
) -> None:
    name, path, model, _ = case
    target = tmp_path / "out" / "model.json"
    target.parent.mkdir()
    code, out, err = run_cli(["import", str(path), "-o", str(target)], capsys)
    assert code == 0, err
    assert str(target) in out
    doc = json.loads(target.read_text())
    assert doc["format"] == "welder.graph/1"
    assert [t["name"] for t in doc["outputs"]] == [o.name for o in model.graph.output]
    assert {t["name"] for t in doc["inputs"]} == {i.name for i in model.graph.input}
    known = {t["name"] for t in doc["inputs"]} | {t["name"] for t in doc["constants"]}
    for node in doc["nodes"]:
        # Topological order: every input is a model input, a constant or an earlier node.
        assert set(node["inputs"]) <= known, node["name"]
        known.add(node["name"])
        lhs = format_tensor_name(node["name"]) + "["
        assert node["compute"].startswith(lhs), node
        rhs = node["compute"].split("] = ", 1)[1]
        assert (node["kind"] == "reduction") == bool(REDUCTION.match(rhs)), node
    assert {e["src"] for e in doc["edges"]} <= {n["name"] for n in doc["nodes"]}
    # Every contraction of the model, as the import's ONNX rewrites leave it (sibling products
    # merged), owns a sum reduction (its bias may be a compute of its own).
    rewritten = simplify(model).graph.node
    onnx_ops = {n.op_type for n in rewritten}
    contractions = {n.name for n in rewritten if n.op_type in ("MatMul", "Gemm", "Conv", "Einsum")}
    summed = {n["source"] for n in doc["nodes"] if n["kind"] == "reduction" and "= sum[" in n["compute"]}
    assert contractions and contractions <= summed
    assert {n["op_type"] for n in doc["nodes"]} <= onnx_ops | {"Copy", "Identity"}, name


def test_cli_symbolic_dims_need_input_shape(tmp_path, capsys) -> None:
    model, _ = bert_encoder_layer(embeddings=True, symbolic=True)
    path = save(model, tmp_path, "bert_symbolic")
    code, out, err = run_cli(["check", str(path), "--backend", "interpret", "--seed", "0"], capsys)
    assert code == 2
    assert "PASS" not in out
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        assert f"--input-shape {name}=" in err
    assert "batch" in err and "seq" in err


def test_cli_symbolic_dims_with_input_shape(tmp_path, capsys) -> None:
    model, _ = bert_encoder_layer(embeddings=True, symbolic=True)
    path = save(model, tmp_path, "bert_symbolic")
    code, out, err = run_cli(
        ["check", str(path), "--backend", "interpret", "--seed", "0", *SHAPE_ARGS], capsys
    )
    assert code == 0, out + err
    assert "[2, 12, 64]" in out and out.splitlines()[-1] == "PASS"


@pytest.mark.parametrize("command", ["check", "import"])
def test_cli_lists_every_unsupported_op(command: str, tmp_path, capsys) -> None:
    model, feeds = unsupported_ops_model()
    onnxruntime_outputs(model, feeds)  # a valid model: only welder lacks the operators
    path = save(model, tmp_path, "unsupported")
    code, out, err = run_cli([command, str(path)], capsys)
    assert code == 2
    assert "3 unsupported operator type(s)" in err
    assert "NonZero (opset 17), first at node '/first/NonZero'" in err
    assert "com.microsoft.BiasGelu (opset 1), first at node '/first/BiasGelu'" in err
    assert "Unique (opset 17), first at node '/first/Unique'" in err
    assert "/second/" not in err
    assert "Traceback" not in err and "PASS" not in out


class _PerturbedBackend:
    """Interpreter results pushed just past the fp32 limit (relative error 1e-3)."""

    def __init__(self, graph: Graph, **_: object) -> None:
        self.graph = graph

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {
            k: v + (np.maximum(np.abs(v), 1) * 1e-3).astype(v.dtype) for k, v in self.graph.run(feeds).items()
        }


class _NanBackend(_PerturbedBackend):
    """Correct results except for one NaN."""

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.graph.run(feeds)
        for v in outs.values():
            v.reshape(-1)[-1] = np.nan
        return outs


@pytest.mark.parametrize("backend", [_PerturbedBackend, _NanBackend], ids=["perturbed", "nan"])
def test_cli_check_fails_on_wrong_outputs(backend: type, tmp_path, capsys, monkeypatch) -> None:
    # The command line offers the registered back ends only: a wrong one stands in for one.
    monkeypatch.setitem(session.BACKENDS, "interpret", backend)
    model, _ = conformer_conv_module()
    path = save(model, tmp_path, "conformer")
    code, out, err = run_cli(["check", str(path), "--backend", "interpret", "--seed", "0"], capsys)
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[-1] == "FAIL"
    # The table row of the model's output ("output") carries the verdict too.
    assert any(line.split()[0] == "output" and line.endswith("FAIL") for line in lines[2:-1])


def _welder_command() -> list[str]:
    """The installed console script of this interpreter's environment, else ``-m``."""
    script = Path(sys.executable).parent / "welder"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "welder.cli"]


def test_cli_check_in_a_subprocess(tmp_path) -> None:
    model, _ = bert_encoder_layer(embeddings=True, symbolic=True)
    path = save(model, tmp_path, "bert_symbolic")
    base = [sys.executable, "-m", "welder.cli", "check", str(path), "--backend", "interpret", "--seed", "0"]
    done = subprocess.run([*base, *SHAPE_ARGS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "PASS"

    missing = subprocess.run([*_welder_command(), *base[3:]], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert "--input-shape input_ids=" in missing.stderr and "Traceback" not in missing.stderr
