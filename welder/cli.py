"""The ``welder`` command line.  Argument parsing only: every command calls the library."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from welder.errors import WelderError
from welder.export import parse_option


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``name=1x128`` (or ``name=1,128``) -> ("name", (1, 128))."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=DIMS like input_ids=1x128, got {text!r}")
    try:
        shape = tuple(int(d) for d in dims.replace(",", "x").split("x")) if dims else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad dimensions in {text!r}; use e.g. input_ids=1x128") from None
    if any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"negative dimension in {text!r}")
    return name, shape


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx file, or a folder holding model.onnx")
    _add_input_shape(p)


def _add_input_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input-shape",
        action="append",
        type=parse_input_shape,
        default=[],
        metavar="NAME=DIMS",
        help="fix a symbolic input shape, e.g. input_ids=1x128 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    from welder import __version__

    parser = argparse.ArgumentParser(
        prog="welder", description="Tile-graph scheduling compiler for ONNX models."
    )
    parser.add_argument("--version", action="version", version=f"welder {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("import", help="import a model and write its graph as model.json")
    _add_model_args(p)
    p.add_argument("-o", "--output", help="where to write model.json (default: beside the model)")

    p = sub.add_parser("check", help="compare a back end with onnxruntime on random inputs")
    _add_model_args(p)
    p.add_argument(
        "--backend",
        default="interpret",
        choices=("interpret", "emulate", "gpu"),  # welder.session.BACKENDS, without importing it
        help="back end to check: the IR interpreter, the runtime on the CPU emulator, or the "
        "runtime built under a PREFIX on the GPU (default: interpret)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")

    p = sub.add_parser("tune", help="compile a model: fuse, choose configs, generate and build the runtime")
    p.add_argument("prefix", help="a folder holding model.onnx, or an .onnx file")
    _add_input_shape(p)
    p.add_argument(
        "--arch",
        default="auto",
        help="GPU whose cost model drives the search: V100, A100, RTX3090, RTX4090, H100, H200 "
        "or auto (default: auto); configs are measured on the GPU present, whichever it is",
    )
    p.add_argument("--topk", type=int, default=20, help="configs tried per group (default: 20)")
    p.add_argument("--cost-model", action="store_true", help="rank configs by the cost model only (no GPU)")
    p.add_argument(
        "--nofusion",
        action="store_true",
        help="no fusion across reductions: one kernel per reduction, injective ops inlined (welder-base)",
    )
    p.add_argument(
        "--skip-dot", action="store_true", help="compute matrix products with cuBLAS, schedule the rest"
    )
    p.add_argument(
        "--no-tc",
        action="store_true",
        help="no tensor cores: half-precision contractions run on CUDA cores like everything else",
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="fp32 contractions may run on tensor cores as TF32 (10-bit mantissa operands, fp32 "
        "accumulation: results within 5e-3 instead of 1e-4, which test_acc and `welder check` then "
        "apply); off by default, exact fp32 on CUDA cores; not with --no-tc",
    )
    p.add_argument(
        "--measure-fusion", action="store_true", help="decide fusion by measured latencies (slower)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        metavar="SECONDS",
        help="soft limit on the tune's wall time: once it is spent, groups still to tune try only "
        "the cost model's 3 best configs and no further fusion check starts (default: none)",
    )
    p.add_argument(
        "--cuda-arch", help="compile for this GPU architecture, e.g. 90 (default: the GPU present)"
    )
    p.add_argument("--no-build", action="store_true", help="emit the runtime sources but do not build them")
    p.add_argument("-o", "--output", help="output folder (default: PREFIX, or beside the .onnx file)")

    p = sub.add_parser("export", help="export a PyTorch model of the benchmark set to ONNX")
    p.add_argument("name", nargs="?", help="model name (see --list)")
    p.add_argument("--prefix", help="output folder for model.onnx, export.json and inputs.npz")
    p.add_argument("--bs", type=int, default=1, help="batch size (default: 1)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="export in half precision (on a GPU if any)")
    precision.add_argument("--bf16", action="store_true", help="export in bfloat16 (on a GPU if any)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default: 17)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=parse_option,
        metavar="KEY=VALUE",
        help="model option (repeatable)",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not compare the graph's outputs under onnxruntime with the module's (checked by default)",
    )
    p.add_argument(
        "--reference-cache",
        metavar="DIR",
        help="keep the check's onnxruntime outputs in DIR, where `artifacts/test_acc.py --inputs "
        "PREFIX/inputs.npz --reference-cache DIR` reads them instead of running onnxruntime again",
    )
    p.add_argument("--list", action="store_true", help="list the models and their options")
    _add_runtime_commands(sub)
    _add_demo_command(sub)
    return parser


def _add_runtime_commands(sub: argparse._SubParsersAction) -> None:
    """``build`` and ``run``: the standalone runtime that ``tune`` writes under PREFIX."""
    p = sub.add_parser("build", help="compile the runtime under PREFIX/nnfusion_rt/cuda_codegen")
    p.add_argument("prefix", help="the folder `welder tune` wrote")
    p.add_argument(
        "--cuda-arch", help="GPU architecture, e.g. 90 (default: as generated, else the GPU present)"
    )
    p.add_argument("--emulate", action="store_true", help="build for the CPU emulator (tests without a GPU)")
    p.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: CPU cores)")

    p = sub.add_parser("run", help="time the built runtime under PREFIX (CUDA events, per run)")
    p.add_argument("prefix", help="the folder `welder tune` wrote")
    p.add_argument("--iters", type=int, default=100, help="timed runs (default: 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (default: 5)")
    p.add_argument("--number", type=int, default=1, help="back-to-back runs per timing (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--no-cuda-graph", action="store_true", help="do not replay each run as a CUDA graph")

    p = sub.add_parser(
        "profile", help="per-kernel time, rates and floors of the model tuned into PREFIX (docs/profile.md)"
    )
    p.add_argument("prefix", help="the folder `welder tune` wrote")
    p.add_argument(
        "--source",
        choices=("run", "tuning", "predicted"),
        help="times from the built runtime on the GPU (run), tuned.json's measurements (tuning) or the "
        "cost model (predicted); default: run with a GPU, else tuning where measured, else predicted",
    )
    p.add_argument("--number", type=int, default=20, help="launches per step timing (default: 20)")
    p.add_argument("--top", type=int, default=25, help="rows shown, slowest first (default: 25; 0: all)")
    p.add_argument("--arch", help="GPU whose ceilings apply (default: the GPU timed, else the tuned arch)")
    p.add_argument("--json", help="also write the profile here as JSON")


def _add_demo_command(sub: argparse._SubParsersAction) -> None:
    from welder.demo import MODELS

    p = sub.add_parser("demo", help="compile built-in example models end to end and check them")
    p.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help=f"the models to run: {', '.join(MODELS)} (default: all)",
    )
    p.add_argument("--prefix", help="keep the outputs in PREFIX/<model> (default: a temporary folder)")
    p.add_argument(
        "--arch", help="GPU whose cost model is used (default: the GPU present, or H100 without one)"
    )
    p.add_argument(
        "--emulate", action="store_true", help="run on the CPU emulator even where a GPU is present"
    )


def cmd_import(args: argparse.Namespace) -> int:
    from welder.frontend.onnx import import_onnx

    start = time.perf_counter()
    graph = import_onnx(args.model, dict(args.input_shape))
    model = Path(args.model)
    out = Path(args.output) if args.output else (model if model.is_dir() else model.parent) / "model.json"
    graph.write_json(str(out))
    print(f"{graph.summary()}\nwrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from welder.session import check_model

    report = check_model(
        args.model, backend=args.backend, input_shapes=dict(args.input_shape), seed=args.seed
    )
    print(report.format())
    return 0 if report.passed else 1


def cmd_tune(args: argparse.Namespace) -> int:
    from welder.pipeline import TuneOptions, output_folder, tune
    from welder.schedule.plan import format_summary

    options = TuneOptions(
        arch=args.arch,
        topk=args.topk,
        cost_model=args.cost_model,
        nofusion=args.nofusion,
        measure_fusion=args.measure_fusion,
        skip_dot=args.skip_dot,
        tensor_cores=not args.no_tc,
        tf32=args.tf32,
        budget_s=args.budget_s,
        cuda_arch=args.cuda_arch,
        build=not args.no_build,
        input_shapes=dict(args.input_shape),
    )
    out = output_folder(args.prefix, args.output)
    progress = _Progress("fusing")
    result = tune(args.prefix, out, options, progress=progress)
    progress.done()
    print(format_summary(result.plan, result.graph))
    if result.runtime is not None:
        plan = result.plan
        kernels = plan.measured_kernels_us
        one_by_one = f"; kernels timed one by one: {kernels:.1f} us" if kernels is not None else ""
        print(
            f"model latency: predicted {plan.predicted_latency_us:.1f} us, measured "
            f"{result.runtime.median_us:.1f} us end to end{one_by_one}"
        )
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"wrote {out / 'model.json'}, {out / 'tuned.json'} and the runtime sources in {out / 'nnfusion_rt'}"
    )
    if result.built is not None:
        print(f"built {result.built} (main_test and the library)")
    print(
        f"time: tuning {result.tuning_seconds:.1f} s, build {result.build_seconds:.1f} s, "
        f"{result.seconds:.1f} s in all"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from welder.export import describe, export_onnx

    if args.list:
        print(describe())
        return 0
    if not args.name or not args.prefix:
        raise WelderError("export needs a model name and --prefix (see welder export --list)")
    options = dict(args.option)
    path = export_onnx(
        args.name,
        args.prefix,
        args.bs,
        args.fp16,
        args.opset,
        bf16=args.bf16,
        options=options,
        seed=args.seed,
        check=not args.no_check,
        reference_cache=args.reference_cache,
    )
    folder = Path(path).parent
    print(f"wrote {path}, {folder / 'export.json'} and {folder / 'inputs.npz'}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from welder.runtime.build import build_runtime
    from welder.runtime.layout import LIBRARY_NAME, MAIN_TEST_NAME

    start = time.perf_counter()
    build = build_runtime(args.prefix, args.cuda_arch, emulate=args.emulate, jobs=args.jobs)
    print(f"built in {time.perf_counter() - start:.1f} s")
    print(f"  {build / MAIN_TEST_NAME}\n  {build / LIBRARY_NAME}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from welder.runtime.library import measure_runtime

    cuda_graph = not args.no_cuda_graph
    latency = measure_runtime(args.prefix, args.iters, args.warmup, args.number, args.seed, cuda_graph)
    graph = "on" if cuda_graph else "off"
    print(f"{args.prefix}: {args.iters} x {args.number} runs after {args.warmup} warm-up, CUDA graph {graph}")
    print(f"median {latency.median:.4f} ms")
    print(latency.summary())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from welder.profile import ProfileError, format_profile, profile_prefix

    if args.number < 1 or args.top < 0:
        raise ProfileError(f"--number must be >= 1 and --top >= 0 (got {args.number} and {args.top})")
    profile = profile_prefix(args.prefix, args.source, number=args.number, arch=args.arch)
    print(format_profile(profile, top=args.top or None))
    if args.json:
        Path(args.json).write_text(json.dumps(profile.to_json(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from welder.demo import format_report, run_demo

    results = run_demo(args.models, args.prefix, args.arch, gpu=False if args.emulate else None)
    print(format_report(results))
    if args.prefix:
        print(f"outputs kept in {args.prefix}")
    return 0 if all(r.passed for r in results) else 1


class _Progress:
    """One rewritten status line on stderr while a long step runs (only on a terminal)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.tty = sys.stderr.isatty()

    def __call__(self, k: int, n: int) -> None:
        if self.tty and (k % 16 == 0 or k == n - 1):
            print(f"\r{self.what}: {k + 1}/{n} nodes", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


COMMANDS = {
    "import": cmd_import,
    "check": cmd_check,
    "tune": cmd_tune,
    "export": cmd_export,
    "build": cmd_build,
    "run": cmd_run,
    "profile": cmd_profile,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shown = warnings.showwarning
    warnings.showwarning = _plain_warnings(args.command, shown)
    try:
        return COMMANDS[args.command](args)
    except WelderError as e:
        print(f"welder {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"welder {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


def _plain_warnings(command: str, fallback: Callable[..., None]) -> Callable[..., None]:
    """Welder's own warnings (an upgraded opset, a shape inference disagreement) as one
    line like the errors, without the file and source line Python adds for programmers."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if category.__module__.startswith("welder"):
            print(f"welder {command}: warning: {message}", file=file or sys.stderr)
        else:
            fallback(message, category, filename, lineno, file, line)

    return show


if __name__ == "__main__":
    sys.exit(main())
