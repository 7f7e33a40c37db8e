"""Build small runtimes with ``welder tune`` and run each ``main_test`` under every
compute-sanitizer tool; exit 1 on any report.

The runtimes cover each code path a model can take: generated kernels only (a BERT stack
with embeddings, a MobileNetV2 block), half-precision products on tensor cores with SIMT
stages after them, the same BERT with ``--skip-dot`` (cuBLAS calls in the runtime), and a
GPT-2 whose token ids are fed from a file holding hostile values (far past the vocabulary,
negative), which the generated Gather must survive without touching memory outside the
embedding table.

    python scripts/sanitize.py [--out DIR] [--topk K] [--tools memcheck,racecheck,...]

Runs on the GPU machine (scripts/gpu_suite.sh calls it); needs compute-sanitizer on PATH or
under the CUDA toolkit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from models import bert_encoder_layer, gpt2_model, mobilenetv2_block  # noqa: E402

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# main_test's own work per run: one warm-up and two timed inferences are enough for the
# tools to see every kernel, and racecheck/initcheck slow each launch by orders of magnitude.
MAIN_TEST_ARGS = ["--iters", "2", "--warmup", "1"]


@dataclass
class Run:
    runtime: str
    tool: str
    errors: int | None  # None: the sanitizer printed no summary (it or main_test failed)
    exit_code: int
    seconds: float
    first_report: str


def find_sanitizer() -> str:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        candidate = Path(base, "bin", "compute-sanitizer") if base else None
        if candidate and candidate.is_file():
            return str(candidate)
    sys.exit("sanitize: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")


def runtimes() -> list[tuple[str, onnx.ModelProto, list[str], list[np.ndarray] | None]]:
    """(name, model, extra `welder tune` flags, input arrays for main_test or None)."""
    bert, _ = bert_encoder_layer(batch=1, seq=64, hidden=128, heads=4, ffn=256, layers=2, embeddings=True)
    gpt2, feeds = gpt2_model(layers=1, hidden=128, seq=32, heads=4, vocab=1000)
    hostile = feeds["input_ids"].copy()
    hostile.flat[::4] = 50257  # past the vocabulary
    hostile.flat[1::4] = -(1 << 40)  # negative beyond any wrap
    hostile.flat[2::4] = np.iinfo(np.int64).max
    block, _ = mobilenetv2_block()
    return [
        ("fp16-tensor-cores", half_block(), [], None),
        ("bert", bert, [], None),
        ("bert-skip-dot", bert, ["--skip-dot"], None),
        ("mobilenetv2-block", block, [], None),
        ("gpt2-hostile-ids", gpt2, [], [hostile]),
    ]


def half_block() -> onnx.ModelProto:
    """A half-precision MLP and attention scores: products on tensor cores (the ``mma`` kind:
    cp.async, ldmatrix, mma.sync) with SIMT stages after them (bias, ReLU, row softmax)."""
    rng = np.random.default_rng(0)

    def half(*shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float16))

    inits = {"w1": half(512, 1024), "b1": half(1024), "w2": half(1024, 512), "k": half(4, 192, 512)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
        helper.make_node("Reshape", ["y", "heads"], ["q"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
    ]
    tensors = [numpy_helper.from_array(np.asarray([4, 240, 512], np.int64), "heads")]
    tensors += [numpy_helper.from_array(numpy_helper.to_array(t), name) for name, t in inits.items()]
    graph = helper.make_graph(
        nodes,
        "half_block",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, [960, 512])],
        [helper.make_tensor_value_info("p", onnx.TensorProto.FLOAT16, [4, 240, 192])],
        tensors,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def build(name: str, model: onnx.ModelProto, flags: list[str], out: Path, topk: int) -> Path:
    prefix = out / name
    prefix.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(prefix / "model.onnx"))
    command = [sys.executable, "-m", "welder.cli", "tune", str(prefix), "--arch", "auto", "--topk", str(topk)]
    print(f"[sanitize] tune {name}: {' '.join(command[3:] + flags)}", flush=True)
    done = subprocess.run(command + flags, cwd=ROOT, capture_output=True, text=True)
    (out / f"{name}.tune.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"welder tune {name} failed (exit {done.returncode}); see {name}.tune.log")
    return prefix / "nnfusion_rt" / "cuda_codegen" / "build" / "main_test"


def sanitize(sanitizer: str, name: str, main_test: Path, inputs: list[Path], tool: str, out: Path) -> Run:
    command = [sanitizer, "--tool", tool, "--error-exitcode", "1", "--print-limit", "20"]
    if tool == "racecheck":
        command += ["--racecheck-report", "all"]
    command += [str(main_test), *MAIN_TEST_ARGS, *map(str, inputs)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=main_test.parent, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    log = done.stdout + done.stderr
    (out / f"{name}.{tool}.log").write_text(log)
    # racecheck sums up as "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)";
    # a warning there is a hazard too, so both count.
    race = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    summary = re.search(r"ERROR SUMMARY: (\d+) error", log)
    errors = int(race.group(1)) + int(race.group(2)) if race else int(summary.group(1)) if summary else None
    reports = [line for line in log.splitlines() if line.startswith("========= ") and "SUMMARY" not in line]
    return Run(
        runtime=name,
        tool=tool,
        errors=errors,
        exit_code=done.returncode,
        seconds=round(seconds, 1),
        first_report=(reports[0][10:] if reports else "")[:160],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/welder-sanitize")))
    parser.add_argument("--topk", type=int, default=2, help="configs measured per group (default: 2)")
    parser.add_argument(
        "--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}"
    )
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    if unknown := sorted(set(tools) - set(TOOLS)):
        parser.error(f"unknown tool(s) {unknown}; choose from {TOOLS}")
    sanitizer = find_sanitizer()
    work = args.out / "sanitize"
    work.mkdir(parents=True, exist_ok=True)

    results: list[Run] = []
    failures: list[str] = []
    for name, model, flags, arrays in runtimes():
        try:
            main_test = build(name, model, flags, work, args.topk)
        except RuntimeError as exc:
            failures.append(str(exc))
            continue
        inputs = []
        for i, array in enumerate(arrays or []):
            path = work / f"{name}.in{i}.bin"
            path.write_bytes(np.ascontiguousarray(array).tobytes())
            inputs.append(path)
        for tool in tools:
            run = sanitize(sanitizer, name, main_test, inputs, tool, work)
            print(
                f"[sanitize] {name:<20} {tool:<10} errors={run.errors} exit={run.exit_code} {run.seconds}s",
                flush=True,
            )
            results.append(run)
            if run.errors != 0 or run.exit_code != 0:
                failures.append(
                    f"{name} {tool}: {run.errors} errors, exit {run.exit_code}: {run.first_report}"
                )

    (args.out / "sanitize.json").write_text(
        json.dumps({"runs": [asdict(r) for r in results], "failures": failures}, indent=1)
    )
    print(f"\n{'runtime':<20} " + " ".join(f"{t:>10}" for t in tools))
    for name in dict.fromkeys(r.runtime for r in results):
        cells = {r.tool: r for r in results if r.runtime == name}
        print(f"{name:<20} " + " ".join(f"{_cell(cells.get(t)):>10}" for t in tools))
    for line in failures:
        print(f"FAIL {line}")
    print(f"sanitize: {'PASS' if not failures else 'FAIL'}")
    return 1 if failures else 0


def _cell(run: Run | None) -> str:
    if run is None:
        return "-"
    if run.errors is None:
        return f"exit {run.exit_code}"
    return "clean" if run.errors == 0 and run.exit_code == 0 else f"{run.errors} err"


if __name__ == "__main__":
    sys.exit(main())
