"""Figures 9 and 10a: welder's latency beside the baselines on the paper's ten models.

    python artifacts/Figure9_10/run_all.py [--models bert,nerf] [--bs 1] [--dtype fp16]

Every (model, batch, dtype) case -- the ten models at batch 1 and 64 (NeRF at 1), fp32
and fp16 -- is exported once, tuned and built with welder (the persistent tuning cache
reused), checked with test_acc and timed beside PyTorch eager, torch.compile
(reduce-overhead and max-autotune) and onnxruntime's CUDA provider, all with the
benchmark's protocol (scripts/benchmark.py, docs/benchmarks.md).

Writes to artifacts/results/<GPU>/: figure9_10.csv (one line per case and system: latency,
status, build or compile time, test_acc's verdict), figure9_10.md, figure9_10.meta.json
(machine, versions, date and command of each run), and figure9_fp32.png (Figure 9) and
figure10a_fp16.png (Figure 10a): per batch size, each system's speedup over eager per
model on a log scale, with the geometric mean.  Cases already in the CSV are skipped;
``--device cpu`` is a smoke run (peers on the CPU, welder only planned).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

NAME = "figure9_10"
SYSTEMS = ("welder", *paper.BASELINES)
PNGS = {"fp32": "figure9_fp32.png", "fp16": "figure10a_fp16.png"}
TITLES = {"fp32": "Figure 9", "fp16": "Figure 10a"}


def plot(rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> None:
    systems = paper.shown(SYSTEMS, rows, args)
    for dtype, png in PNGS.items():
        paper.speedup_figure(rows, args.out / png, dtype, systems, TITLES[dtype])


def main(argv: Sequence[str] | None = None) -> int:
    return paper.latency_script(NAME, __doc__, argv, systems=SYSTEMS, plot=plot)


if __name__ == "__main__":
    sys.exit(main())
