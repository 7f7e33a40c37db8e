"""Check the runtime built under PREFIX against onnxruntime (CPU) on the same seeded inputs.

    python artifacts/test_acc.py runs/bert_b1 [--seed 0] [--precision tf32] [--json report.json]
        [--reference-cache DIR] [--inputs FILE.npz]

PREFIX is the folder ``welder tune`` wrote: it holds model.onnx and the built
nnfusion_rt/cuda_codegen/build/libnnfusion_naive_rt.so.  Inputs come from
``welder.check.random_inputs`` (normal floats, valid indices, ones for masks) on the model
imported with the shapes the runtime was built for; integer inputs that feed indices are
checked against the dimensions they index before the run (``welder.index_check``).  Prints
per output ``max(|a - b| / max(|b|, 1))`` with its limit (``welder.check.output_threshold``:
the fp16 limit for an output computed from fp16 values, the bf16 one for bf16 values;
fp32 outputs at the precision the runtime was tuned for, which ``tuned.json`` records:
TF32's 2e-3 after ``welder tune --tf32``, else 1e-4) and PASS/FAIL; the exit code is 0
when every output passes, 1 when one fails and 2 when the check cannot run.  A bf16 model
is compared with onnxruntime running the model converted to fp32, its bf16 weights and
inputs upcast exactly (onnxruntime's CPU provider has no bf16 arithmetic;
``welder.check.bfloat16_as_float``), at the bf16 limit; the report's header says so
(``reference=``).  ``--json`` also writes the
report for programs (scripts/benchmark.py), so they need not parse the table.
``--reference-cache DIR`` keeps onnxruntime's outputs there, so a second check of the same
model on the same inputs (another variant's build of one export) skips onnxruntime.
``--inputs FILE.npz`` checks on those inputs instead (an export's ``inputs.npz``, on which
``welder export --reference-cache DIR`` already ran onnxruntime).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from welder.check import (
    THRESHOLDS,
    CheckReport,
    cached_onnxruntime_outputs,
    compare,
    output_thresholds,
    random_inputs,
    recorded_precision,
    reference_name,
    saved_inputs,
)
from welder.errors import WelderError
from welder.frontend.onnx import import_onnx
from welder.index_check import check_index_inputs, index_sites
from welder.runtime.library import RuntimeLibrary


def check_runtime(
    prefix: Path,
    seed: int = 0,
    precision: str | None = None,
    reference_cache: Path | None = None,
    inputs: Path | None = None,
) -> CheckReport:
    """Runs the built runtime and onnxruntime on the same inputs and compares every output
    (``precision`` None: the one the runtime was tuned for; ``reference_cache``: a folder
    of onnxruntime's outputs, see :func:`welder.check.cached_onnxruntime_outputs`;
    ``inputs``: an ``.npz`` of the inputs to run instead of seeded random ones)."""
    model = prefix / "model.onnx"
    if not model.is_file():
        raise WelderError(f"{prefix} holds no model.onnx to check the runtime against")
    if precision is None:
        precision = recorded_precision(prefix)
    with RuntimeLibrary(prefix) as lib:
        graph = import_onnx(model, {t.name: t.shape for t in lib.inputs})
        feeds = random_inputs(graph, seed) if inputs is None else saved_inputs(inputs, graph)
        # The kernels would clamp a bad index; the host names it instead.
        check_index_inputs(graph, index_sites(graph), feeds)
        ours = lib.run(feeds)
    reference = cached_onnxruntime_outputs(model, feeds, list(graph.outputs), reference_cache)
    limits = output_thresholds(graph, list(graph.outputs), precision=precision)
    results = compare(ours, reference, precision, limits)
    source = str(inputs) if inputs is not None else ""
    return CheckReport(str(prefix), "welder runtime", seed, results, reference_name(model), source)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", type=Path, help="the folder `welder tune` wrote")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    parser.add_argument(
        "--precision",
        choices=sorted(THRESHOLDS),
        help="arithmetic of the kernels, which sets the fp32 outputs' limit (default: what "
        "PREFIX/tuned.json records, tf32 after `welder tune --tf32`, else fp32)",
    )
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    parser.add_argument(
        "--reference-cache",
        type=Path,
        help="folder keeping onnxruntime's outputs for the next check of the same model and inputs",
    )
    parser.add_argument(
        "--inputs",
        type=Path,
        help="an .npz of the model's inputs to check on instead of seeded random ones (an "
        "export's inputs.npz: with the same --reference-cache as `welder export`, its check's "
        "onnxruntime run serves this one)",
    )
    args = parser.parse_args(argv)
    try:
        report = check_runtime(args.prefix, args.seed, args.precision, args.reference_cache, args.inputs)
    except WelderError as e:
        print(f"test_acc: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    if args.json is not None:
        write_report(report, args.json)
    return 0 if report.passed else 1


def write_report(report: CheckReport, path: Path) -> None:
    """``passed``, ``max_error`` (the worst metric; Infinity for a non-finite output) and
    every output's metric, limit and verdict."""
    outputs = [{**asdict(o), "passed": o.passed} for o in report.outputs]
    worst = max((o.metric for o in report.outputs), default=0.0)
    doc = {"prefix": report.model, "seed": report.seed, "passed": report.passed, "max_error": worst}
    doc["reference"] = report.reference
    path.write_text(json.dumps({**doc, "outputs": outputs}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
