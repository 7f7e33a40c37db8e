"""Export a model of the benchmark to ONNX, as ``welder export`` does.

    python artifacts/torch2onnx.py --model bert --prefix runs/bert_b1 --bs 1 [--fp16 | --bf16]

Writes PREFIX/model.onnx and PREFIX/export.json (what run_torch.py needs to rebuild the
same module), after checking with onnxruntime that the graph computes the module's
outputs (``--no-check`` skips it).  Models are built with random weights from a fixed seed: nothing is
downloaded.  ``--option KEY=VALUE`` changes a model knob (``--option points=65536`` for
the NeRF MLP, ``--option num_hidden_layers=2`` for a small BERT).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from welder.errors import WelderError
from welder.export import DEFAULT_OPSET, MODELS, SEED, describe, export_onnx, parse_option


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), help="model to export (see --list)")
    p.add_argument("--prefix", help="output folder for model.onnx and export.json")
    p.add_argument("--bs", type=int, default=1, help="batch size (default: 1)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="export in half precision (on a GPU if any)")
    precision.add_argument("--bf16", action="store_true", help="export in bfloat16 (on a GPU if any)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default: {DEFAULT_OPSET})")
    p.add_argument("--seed", type=int, default=SEED, help=f"seed of weights and inputs (default: {SEED})")
    p.add_argument(
        "--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE", help="model knob"
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not compare the graph's outputs under onnxruntime with the module's (checked by default)",
    )
    p.add_argument("--list", action="store_true", help="list the models and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(describe())
        return 0
    if not args.model or not args.prefix:
        parser.error("--model and --prefix are required")
    start = time.perf_counter()
    try:
        path = export_onnx(
            args.model,
            args.prefix,
            args.bs,
            args.fp16,
            args.opset,
            bf16=args.bf16,
            options=dict(args.option),
            seed=args.seed,
            check=not args.no_check,
        )
    except WelderError as e:
        print(f"torch2onnx: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {path.parent / 'export.json'} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
