"""Table 5: compute-intensive models -- welder's generated kernels, welder with its
matrix products on cuBLAS (``--skip-dot``), and the baselines.

    python artifacts/Table5/run_all.py [--models resnet50] [--bs 64] [--dtype fp16]

ResNet-50 and BERT-base at batch 64 (``--bs 64,128`` adds a larger one), fp32 and fp16:
each tuned twice (RUNS/welder and RUNS/welder-skip-dot, the persistent tuning cache
reused), checked with test_acc, and timed beside PyTorch eager, torch.compile
(reduce-overhead and max-autotune) and onnxruntime's CUDA provider with the benchmark's
protocol.  Where the products dominate, the two welder columns show how close the
generated kernels come to the vendor library inside the same schedule.

Writes to artifacts/results/<GPU>/: table5.csv, table5.md (the table), table5.meta.json
and table5_<dtype>.png (speedup over eager per model and batch, log scale).  Cases already
in the CSV are skipped; ``--device cpu`` is a smoke run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

NAME = "table5"
SYSTEMS = ("welder", "welder-skip-dot", *paper.BASELINES)
MODELS = ("resnet50", "bert")


def plot(rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> None:
    systems = paper.shown(SYSTEMS, rows, args)
    for dtype in args.dtype:
        paper.speedup_figure(rows, args.out / f"table5_{dtype}.png", dtype, systems, "Table 5", MODELS)


def main(argv: Sequence[str] | None = None) -> int:
    return paper.latency_script(NAME, __doc__, argv, systems=SYSTEMS, plot=plot, models=MODELS, batches=(64,))


if __name__ == "__main__":
    sys.exit(main())
