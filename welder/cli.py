"""The ``welder`` command line.  Argument parsing only: every command calls the library."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from welder.errors import WelderError


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
    p.add_argument("--backend", default="interpret", help="back end to check (default: interpret)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")

    p = sub.add_parser("tune", help="fuse the model, choose tile configs and write PREFIX/tuned.json")
    p.add_argument("prefix", help="a folder holding model.onnx, or an .onnx file")
    p.add_argument(
        "--input-shape",
        action="append",
        type=parse_input_shape,
        default=[],
        metavar="NAME=DIMS",
        help="fix a symbolic input shape (repeatable)",
    )
    p.add_argument(
        "--arch",
        default="auto",
        help="GPU whose cost model drives the search: "
        "V100, A100, RTX3090, RTX4090, H100, H200 or auto (default: auto)",
    )
    p.add_argument("--topk", type=int, default=20, help="configs kept per group (default: 20)")
    p.add_argument("--cost-model", action="store_true", help="rank configs by the cost model only (no GPU)")
    p.add_argument("--nofusion", action="store_true", help="one kernel per node (the unfused baseline)")
    p.add_argument("-o", "--output", help="output folder (default: PREFIX, or beside the .onnx file)")
    return parser


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
    from welder.check import check_model

    report = check_model(
        args.model, backend=args.backend, input_shapes=dict(args.input_shape), seed=args.seed
    )
    print(report.format())
    return 0 if report.passed else 1


def output_folder(prefix: str, output: str | None) -> Path:
    """Where ``tune`` writes: --output, the PREFIX folder, or ``<dir>/<stem>`` for a file
    (``<dir>`` itself when the file is called model.onnx)."""
    if output:
        return Path(output)
    p = Path(prefix)
    if p.is_dir() or p.name == "model.onnx":
        return p if p.is_dir() else p.parent
    return p.with_suffix("")


def cmd_tune(args: argparse.Namespace) -> int:
    from welder.arch import get_arch
    from welder.frontend.onnx import import_onnx
    from welder.schedule.plan import format_summary, plan_model, write_tuned_json

    if not args.cost_model:
        raise WelderError("tuning on the GPU is not implemented yet; pass --cost-model")
    if args.topk < 1:
        raise WelderError("--topk must be at least 1")
    arch = get_arch(args.arch)
    out = output_folder(args.prefix, args.output)
    out.mkdir(parents=True, exist_ok=True)
    graph = import_onnx(args.prefix, dict(args.input_shape))
    graph.write_json(str(out / "model.json"))
    print(graph.summary(), file=sys.stderr)
    progress = _Progress("fusing")
    plan = plan_model(
        graph, arch, topk=args.topk, nofusion=args.nofusion, model=str(args.prefix), progress=progress
    )
    progress.done()
    write_tuned_json(plan, graph, str(out / "tuned.json"))
    print(format_summary(plan, graph))
    print(f"wrote {out / 'model.json'} and {out / 'tuned.json'}")
    return 0


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


COMMANDS = {"import": cmd_import, "check": cmd_check, "tune": cmd_tune}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except WelderError as e:
        print(f"welder {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"welder {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
