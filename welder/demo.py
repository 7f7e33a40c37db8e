"""``welder demo``: the whole compiler on small built-in models, for a first run with no
model at hand.

The models are built in memory with ``onnx.helper`` (nothing is downloaded) and put through
the same steps a user's model takes.  With a GPU: ``welder tune`` (configs measured on it),
the runtime build, ``main_test``, the check of the built runtime against onnxruntime and its
measured latency beside the cost model's prediction.  Without one: configs from the cost
model, the generated kernels run on the CPU emulator, and the same check against
onnxruntime -- slow arithmetic, but the very CUDA text the GPU would run.
"""

from __future__ import annotations

import functools
import math
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from welder.check import CheckReport, compare, onnxruntime_outputs, output_thresholds, random_inputs
from welder.errors import WelderError
from welder.session import check_model

if TYPE_CHECKING:
    from welder.pipeline import TuneResult

#: The opset the models are written in (LayerNormalization needs 17).
OPSET = 17


class _Builder:
    """Collects nodes and seeded random initializers of one graph."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def constant(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape: Sequence[int], scale: float | None = None) -> str:
        """Normal values scaled by 1/sqrt(fan-in), so activations stay near unit size and
        the check's relative error means something."""
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        std = scale if scale is not None else 1.0 / math.sqrt(max(fan_in, 1))
        return self.constant(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        hint: str | None = None,
        out: str | None = None,
        **attrs: object,
    ) -> str:
        """Appends a node; its output is ``out``, else a fresh name from ``hint``."""
        out = out or self.fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def model(
        self, name: str, inputs: Sequence[onnx.ValueInfoProto], outputs: Sequence[onnx.ValueInfoProto]
    ) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, list(inputs), list(outputs), self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8  # readable by every onnxruntime welder supports
        onnx.checker.check_model(model, full_check=True)
        return model


def transformer_encoder(
    layers: int = 2,
    seq: int = 16,
    hidden: int = 32,
    heads: int = 2,
    ffn: int = 64,
    vocab: int = 64,
    seed: int = 0,
) -> onnx.ModelProto:
    """A BERT-style encoder: token and position embeddings, then per layer multi-head
    self-attention (MatMul/Add projections, scaled Softmax scores) and a GELU feed-forward
    block (the Erf form exporters emit), each with a residual Add and LayerNormalization."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads")
    b = _Builder(seed)
    head = hidden // heads
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])
    x = b.op("Gather", [b.weight("word_embeddings", [vocab, hidden], 1.0), "input_ids"], "embed")
    x = b.op("Add", [x, b.weight("position_embeddings", [1, seq, hidden], 1.0)], "embed")
    x = _layer_norm(b, x, hidden, "embed_ln")
    split = b.constant("split_heads", np.array([1, seq, heads, head], np.int64))
    merge = b.constant("merge_heads", np.array([1, seq, hidden], np.int64))
    scale = b.constant("score_scale", np.array(1.0 / math.sqrt(head), np.float32))
    half, one = b.constant("half", np.array(0.5, np.float32)), b.constant("one", np.array(1.0, np.float32))
    root2 = b.constant("sqrt2", np.array(math.sqrt(2.0), np.float32))
    for i in range(layers):
        p = f"layer{i}"
        q, k, v = (_dense(b, x, hidden, hidden, f"{p}_{n}") for n in "qkv")
        q = b.op("Transpose", [b.op("Reshape", [q, split])], perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [k, split])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, split])], perm=[0, 2, 1, 3])
        scores = b.op("Mul", [b.op("MatMul", [q, k], f"{p}_scores"), scale])
        probs = b.op("Softmax", [scores], f"{p}_probs", axis=-1)
        context = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        context = b.op("Reshape", [context, merge], f"{p}_context")
        x = _layer_norm(b, b.op("Add", [x, _dense(b, context, hidden, hidden, f"{p}_o")]), hidden, f"{p}_ln1")
        h = _dense(b, x, hidden, ffn, f"{p}_ffn1")
        gelu = b.op(
            "Mul", [b.op("Mul", [h, half]), b.op("Add", [b.op("Erf", [b.op("Div", [h, root2])]), one])]
        )
        last = i == layers - 1
        y = b.op("Add", [x, _dense(b, gelu, ffn, hidden, f"{p}_ffn2")])
        x = _layer_norm(b, y, hidden, f"{p}_ln2", out="hidden_states" if last else None)
    if layers == 0:
        x = b.op("Identity", [x], out="hidden_states")
    result = helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, seq, hidden])
    return b.model("demo_transformer", [ids], [result])


def _dense(b: _Builder, x: str, n_in: int, n_out: int, name: str) -> str:
    y = b.op("MatMul", [x, b.weight(f"{name}_weight", [n_in, n_out], 1.0 / math.sqrt(n_in))], name)
    return b.op("Add", [y, b.weight(f"{name}_bias", [n_out], 0.1)], name)


def _layer_norm(b: _Builder, x: str, hidden: int, name: str, out: str | None = None) -> str:
    gamma = b.constant(f"{name}_gamma", (1.0 + 0.1 * b.rng.standard_normal(hidden)).astype(np.float32))
    beta = b.weight(f"{name}_beta", [hidden], 0.1)
    return b.op("LayerNormalization", [x, gamma, beta], name, out, axis=-1, epsilon=1e-5)


def conv_block(
    channels: int = 8, width: int = 16, features: int = 16, classes: int = 10, seed: int = 0
) -> onnx.ModelProto:
    """A ResNet-style block and head: two 3x3 convolutions with BatchNormalization and Relu,
    a 1x1 projection shortcut added back, max pooling, global average pooling, Flatten and a
    Gemm classifier."""
    b = _Builder(seed)
    image = helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, channels, width, width])
    y = _conv_bn(b, "image", channels, features, 3, "conv1")
    y = b.op("Relu", [y], "relu1")
    y = _conv_bn(b, y, features, features, 3, "conv2")
    shortcut = b.op("Conv", ["image", b.weight("shortcut_weight", [features, channels, 1, 1])], "shortcut")
    y = b.op("Relu", [b.op("Add", [y, shortcut], "residual")], "relu2")
    y = b.op("MaxPool", [y], "pool", kernel_shape=[2, 2], strides=[2, 2])
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y], "gap")], "flatten", axis=1)
    fc_w, fc_b = b.weight("fc_weight", [classes, features]), b.weight("fc_bias", [classes], 0.1)
    b.op("Gemm", [y, fc_w, fc_b], out="logits", transB=1)
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])
    return b.model("demo_convnet", [image], [logits])


def _conv_bn(b: _Builder, x: str, c_in: int, c_out: int, k: int, name: str) -> str:
    w = b.weight(f"{name}_weight", [c_out, c_in, k, k])
    y = b.op("Conv", [x, w, b.weight(f"{name}_bias", [c_out], 0.1)], name, pads=[k // 2] * 4)
    scale = b.constant(f"{name}_bn_scale", (1.0 + 0.1 * b.rng.standard_normal(c_out)).astype(np.float32))
    shift = b.weight(f"{name}_bn_shift", [c_out], 0.1)
    mean = b.weight(f"{name}_bn_mean", [c_out], 0.1)
    var = b.constant(f"{name}_bn_var", b.rng.uniform(0.5, 1.5, c_out).astype(np.float32))
    return b.op("BatchNormalization", [y, scale, shift, mean, var], f"{name}_bn", epsilon=1e-5)


#: Demo model name -> (what it is, its builder).
MODELS: dict[str, tuple[str, Callable[[], onnx.ModelProto]]] = {
    "transformer": ("2-layer transformer encoder, 16 tokens, hidden 32", transformer_encoder),
    "convnet": ("conv block: Conv/BatchNorm/Relu, residual, pooling, classifier", conv_block),
}


class DemoError(WelderError):
    """A demo model name that does not exist, or an output folder that cannot be one."""


def select_models(names: Sequence[str] | None) -> list[str]:
    """The demo models to run, in the order given; all of them for None or empty."""
    if not names:
        return list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise DemoError(f"no demo model {', '.join(map(repr, unknown))}; choose from {', '.join(MODELS)}")
    return list(dict.fromkeys(names))


@dataclass
class DemoResult:
    """What one model's run gives the report."""

    model: str
    nodes: int
    groups: int
    kernels: int
    unfused_kernels: int
    predicted_us: float
    check: CheckReport
    seconds: float
    measured_us: float | None = None  # end to end through the library (`welder run`)
    main_test_ms: float | None = None  # mean of main_test's timed runs

    @property
    def passed(self) -> bool:
        return self.check.passed

    @property
    def max_error(self) -> float:
        return max((o.metric for o in self.check.outputs), default=0.0)


def run_demo(
    names: Sequence[str] | None = None,
    prefix: str | Path | None = None,
    arch: str | None = None,
    gpu: bool | None = None,
    topk: int = 4,
    log: Callable[[str], None] | None = None,
) -> list[DemoResult]:
    """Runs each demo model through welder; ``log`` gets one line per stage.

    Outputs go under ``prefix/<model>`` (kept), or into a temporary folder removed at the
    end.  ``gpu`` None means: on the GPU if one is usable.  ``arch`` names the cost model
    (default: the GPU present, or H100 without one); ``topk`` is how many configs per group
    tuning measures on the GPU.  ``log`` defaults to printing, flushed (the stages are slow).
    """
    from welder.device.gpu import gpu_available

    log = log or functools.partial(print, flush=True)
    chosen = select_models(names)
    on_gpu = gpu_available() if gpu is None else gpu
    arch = arch or ("auto" if on_gpu else "H100")
    if prefix is not None:
        folder = Path(prefix)
        if folder.exists() and not folder.is_dir():
            raise DemoError(f"--prefix {prefix} is a file; the demo needs a folder to write into")
        return [_run_one(n, folder / n, arch, on_gpu, topk, log) for n in chosen]
    with tempfile.TemporaryDirectory(prefix="welder-demo-") as scratch:
        return [_run_one(n, Path(scratch) / n, arch, on_gpu, topk, log) for n in chosen]


def _run_one(
    name: str, out: Path, arch: str, on_gpu: bool, topk: int, log: Callable[[str], None]
) -> DemoResult:
    from welder.pipeline import TuneOptions, tune

    start = time.perf_counter()
    description, build = MODELS[name]
    model = build()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.onnx"
    onnx.save(model, str(path))
    log(f"[{name}] built {description}: {len(model.graph.node)} ONNX nodes -> {path}")
    how = f"measuring configs on the GPU, cost model {arch}" if on_gpu else f"cost model of {arch}"
    log(f"[{name}] tuning ({how})")
    options = TuneOptions(arch=arch, topk=topk if on_gpu else 1, cost_model=not on_gpu, build=on_gpu)
    result = tune(path, out, options)
    plan = result.plan
    log(
        f"[{name}] scheduled {len(result.graph.nodes)} operators into {len(plan.groups)} groups: "
        f"{plan.kernels} kernels (unfused: {plan.unfused_kernels}), predicted "
        f"{plan.predicted_latency_us:.1f} us on {plan.arch.name}; CUDA and runtime sources in {out}"
    )
    for note in result.notes:
        log(f"[{name}] note: {note}")
    if on_gpu:
        check, measured_us, main_test_ms = _on_gpu(name, out, result, log)
        log(
            f"[{name}] latency: predicted {plan.predicted_latency_us:.1f} us, measured "
            + (f"{measured_us:.1f} us end to end, " if measured_us is not None else "")
            + f"main_test mean {1e3 * main_test_ms:.1f} us"
        )
    else:
        check, measured_us, main_test_ms = _on_emulator(name, path, result, log), None, None
    demo = DemoResult(
        name,
        len(result.graph.nodes),
        len(plan.groups),
        plan.kernels,
        plan.unfused_kernels,
        plan.predicted_latency_us,
        check,
        time.perf_counter() - start,
        measured_us,
        main_test_ms,
    )
    verdict = "PASS" if demo.passed else "FAIL"
    log(f"[{name}] check against onnxruntime: {verdict}, max error {demo.max_error:.2e}")
    return demo


def _on_emulator(name: str, path: Path, result: TuneResult, log: Callable[[str], None]) -> CheckReport:
    """The tuned kernels compiled with g++ against the emulator and run in order, on the
    inputs onnxruntime gets too."""
    from welder.runtime.emulate import EmulatedModel

    log(f"[{name}] compiling {len(result.kernels)} kernels for the CPU emulator (g++)")
    emulated = EmulatedModel(result.graph, result.kernels)
    log(f"[{name}] running them on the emulator and the model on onnxruntime")
    feeds = random_inputs(result.graph)
    names = list(result.graph.outputs)
    ours = emulated.run(feeds)
    reference = onnxruntime_outputs(path, feeds, names)
    limits = output_thresholds(result.graph, names)
    return CheckReport(name, "emulate", 0, compare(ours, reference, thresholds=limits))


def _on_gpu(
    name: str, out: Path, result: TuneResult, log: Callable[[str], None]
) -> tuple[CheckReport, float | None, float]:
    """main_test, then the built library against onnxruntime: (the check, the end-to-end
    latency ``tune`` measured in us, main_test's mean in ms)."""
    from welder.runtime.layout import main_test_path

    if result.built is None:
        raise WelderError(f"the {name} runtime was not built: {'; '.join(result.notes) or 'no reason given'}")
    log(f"[{name}] built the runtime in {result.build_seconds:.1f} s; running main_test")
    main_test_ms = _main_test_mean_ms(main_test_path(out))
    log(f"[{name}] checking the built runtime against onnxruntime")
    check = check_model(out, backend="gpu")
    measured_us = result.runtime.median_us if result.runtime is not None else None
    return check, measured_us, main_test_ms


def _main_test_mean_ms(binary: Path) -> float:
    """The mean of main_test's timed runs, from its Summary line."""
    from welder.runtime.library import parse_summary

    done = subprocess.run([str(binary), "--iters", "20"], capture_output=True, text=True, timeout=600)
    summary = parse_summary(done.stdout)
    if done.returncode != 0 or summary is None:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise WelderError(f"{binary} failed (exit {done.returncode}): {tail}")
    return summary[2]


def format_report(results: Sequence[DemoResult]) -> str:
    """One row per model, then the overall verdict."""
    measured = any(r.measured_us is not None or r.main_test_ms is not None for r in results)
    head = f"{'model':<12} {'ops':>4} {'groups':>6} {'kernels':>7} {'predicted':>10}"
    head += f" {'measured':>10} {'main_test':>10}" if measured else ""
    lines = [head + f"  {'check':<7} {'max error':>9} {'time':>6}"]
    for r in results:
        row = f"{r.model:<12} {r.nodes:>4} {r.groups:>6} {r.kernels:>7} {r.predicted_us:>7.1f} us"
        if measured:
            row += _us(r.measured_us) + _us(None if r.main_test_ms is None else 1e3 * r.main_test_ms)
        row += f"  {'PASS' if r.passed else 'FAIL':<7} {r.max_error:>9.2e} {r.seconds:>5.0f}s"
        lines.append(row)
    good = sum(r.passed for r in results)
    lines.append(
        f"{'PASS' if good == len(results) else 'FAIL'}: {good}/{len(results)} models match onnxruntime"
    )
    return "\n".join(lines)


def _us(value: float | None) -> str:
    return f" {'-':>10}" if value is None else f" {value:>7.1f} us"
