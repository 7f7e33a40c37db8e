"""Time the runtime built under PREFIX, as ``welder run`` does.

    python artifacts/run_welder.py runs/bert_b1 [--iters 100] [--warmup 5] [--number 1] [--no-cuda-graph]

Inputs and outputs stay on the GPU; after the warm-up each of ``--iters`` timings is the
CUDA-event time of ``--number`` back-to-back runs divided by ``--number`` (1: single runs,
each waited for, as main_test times them); each run replays one CUDA graph unless
``--no-cuda-graph``.  Prints the median and main_test's summary line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from welder.errors import WelderError
from welder.runtime.library import measure_runtime


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", help="the folder `welder tune` wrote")
    parser.add_argument("--iters", type=int, default=100, help="timings (default: 100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default: 5)")
    parser.add_argument("--number", type=int, default=1, help="back-to-back runs per timing (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    parser.add_argument("--no-cuda-graph", action="store_true", help="do not replay each run as a CUDA graph")
    args = parser.parse_args(argv)
    try:
        latency = measure_runtime(
            args.prefix,
            args.iters,
            args.warmup,
            args.number,
            seed=args.seed,
            cuda_graph=not args.no_cuda_graph,
        )
    except WelderError as e:
        print(f"run_welder: error: {e}", file=sys.stderr)
        return 2
    print(f"median {latency.median:.4f} ms")
    print(latency.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
