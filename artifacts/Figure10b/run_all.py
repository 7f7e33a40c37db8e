"""Figure 10b: welder without tensor cores (``welder tune --no-tc``) in fp16 beside the
baselines.

    python artifacts/Figure10b/run_all.py [--models bert,nerf] [--bs 1]

The cases of Figure 9/10a in fp16 only: welder tuned with ``--no-tc`` (every stage on CUDA
cores; its own prefix under RUNS/welder-no-tc, the persistent tuning cache reused),
checked with test_acc and timed beside PyTorch eager, torch.compile (reduce-overhead and
max-autotune) and onnxruntime's CUDA provider with the benchmark's protocol.  The
baselines use tensor cores where their libraries choose to: the figure shows what
welder's scheduling does without them.

Writes to artifacts/results/<GPU>/: figure10b.csv, figure10b.md, figure10b.meta.json and
figure10b_fp16.png (speedup over eager per model, log scale, with the geometric mean).
Cases already in the CSV are skipped; ``--device cpu`` is a smoke run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

NAME = "figure10b"
SYSTEMS = ("welder-no-tc", *paper.BASELINES)


def plot(rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> None:
    systems = paper.shown(SYSTEMS, rows, args)
    for dtype in args.dtype:
        paper.speedup_figure(rows, args.out / f"figure10b_{dtype}.png", dtype, systems, "Figure 10b")


def main(argv: Sequence[str] | None = None) -> int:
    return paper.latency_script(NAME, __doc__, argv, systems=SYSTEMS, plot=plot, dtypes=("fp16",))


if __name__ == "__main__":
    sys.exit(main())
