"""Figure 13: the fusion ablation -- one kernel per operator, welder without tile-graph
fusion (``--nofusion``), and full welder: kernels, intermediate bytes, latency.

    python artifacts/Figure13/run_all.py [--models bert,nerf] [--bs 1] [--dtype fp16]

``welder`` and ``welder-nofusion`` are built and timed as in Figure 9 (their prefixes,
builds and the persistent tuning cache shared with Figures 9 and 11); their kernels and
bytes come from the plan the build ran (PREFIX/tuned.json, PREFIX/model.json).
``per-op`` is read from full welder's plan as well: every operator a kernel of its own,
its latency the sum of those kernels' latencies as the tuner measured them one by one in
isolation (``tuned.json``'s unfused totals; the CSV's ``latency_basis`` says whether they
were measured or predicted) -- no runtime of that form is built or timed end to end.

Columns: ``kernels`` (groups launched; views included), ``intermediate_bytes`` (bytes of
the tensors kernels write to global memory for other kernels: the outputs of groups that
are not model outputs), ``traffic_bytes`` (the plan's modelled DRAM traffic) and
``latency_ms``.  Writes figure13.csv, figure13.md, figure13.meta.json and
figure13_<dtype>_b<bs>.png (three panels, log scales) to artifacts/results/<GPU>/.  Cases
already in the CSV are skipped; ``--device cpu`` is a smoke run (plans from the H100 cost
model, no latency).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

benchmark = paper.benchmark

NAME = "figure13"
SYSTEMS = ("per-op", "welder-nofusion", "welder")
FACTS = ("kernels", "intermediate_bytes", "traffic_bytes")
FIELDS = (*paper.COMMON_FIELDS, *FACTS, "latency_basis")


def plan_facts(prefix: Path) -> dict[str, Any]:
    """Kernels, intermediate and modelled traffic bytes of the plan built in PREFIX, and
    the same for one kernel per operator (``per_op_*``, from the plan's unfused totals)."""
    from welder.ir.interpret import np_dtype

    tuned = json.loads((prefix / "tuned.json").read_text())
    graph = json.loads((prefix / "model.json").read_text())
    size = {n["name"]: int(_prod(n["shape"])) * np_dtype(n["dtype"]).itemsize for n in graph["nodes"]}
    outputs = {o["name"] for o in graph["outputs"]}
    written = {t for g in tuned["groups"] for t in g["outputs"]}
    totals = tuned["totals"]
    return {
        "kernels": totals["kernels"] + totals["library_calls"],
        "intermediate_bytes": sum(size[t] for t in written if t in size and t not in outputs),
        "traffic_bytes": totals["traffic_bytes"],
        "per_op_kernels": totals["unfused_kernels"],
        "per_op_intermediate_bytes": sum(b for t, b in size.items() if t not in outputs),
        "per_op_traffic_bytes": totals["unfused_traffic_bytes"],
        "per_op_latency_ms": totals["unfused_latency_us"] / 1e3,
        "per_op_basis": f"sum of per-op kernels in isolation ({totals['unfused_basis']})",
    }


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def measure(case: benchmark.Config, todo: list[str], args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The welder variants asked for (full welder too when ``per-op`` is: its plan holds
    the per-operator figures), each line completed with its plan's facts and yielded as
    its variant lands."""
    variants = [s for s in ("welder-nofusion", "welder") if s in todo or (s == "welder" and "per-op" in todo)]
    gpu = paper.gpu_folder(args.device)
    for system, cell in paper.measure_case(case, variants, args):
        row = {k: v for k, v in paper.cell_row(case, system, cell, gpu).items() if k in FIELDS}
        facts: dict[str, Any] = {}
        try:
            facts = plan_facts(Path(args.runs) / system / case.key)
        except (OSError, KeyError, ValueError) as e:
            row["detail"] = f"{row['detail']}; no plan facts ({type(e).__name__}: {e})".lstrip("; ")
        row.update({k: facts.get(k) for k in FACTS})
        row["latency_basis"] = "runtime end to end" if cell.ms is not None else ""
        if system in todo:
            yield row
        if system == "welder" and "per-op" in todo:
            per_op = dict(row, system="per-op", build_s=None, latency_ms=facts.get("per_op_latency_ms"))
            per_op.update({k: facts.get(f"per_op_{k}") for k in FACTS})
            per_op["latency_basis"] = facts.get("per_op_basis", "")
            per_op["status"] = "ok" if facts else "error"
            per_op["detail"] = "from full welder's plan" if facts else row["detail"]
            yield per_op


def plot(rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> None:
    systems = paper.shown(SYSTEMS, rows, args)
    for panel in paper.panels(rows, args.out, "figure13"):
        fig, axes = panel.figure(3, 10)
        panes = [
            ("kernels", 1.0, "kernels per inference (log)"),
            ("intermediate_bytes", 1e6, "intermediate tensors (MB, log)"),
            ("latency_ms", 1.0, "latency (ms, log)"),
        ]
        for ax, (field, scale, label) in zip(axes, panes):
            paper.grouped_bars(ax, panel.models, systems, panel.value(field, scale), ylabel=label, log=True)
        panel.title(axes[0], "Figure 13")
        note = "per-op latency: its kernels one by one, summed (see latency_basis); x: no value"
        paper.finish(fig, axes, panel.png, note)
        panel.plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = paper.parse_args(paper.build_parser(__doc__, systems=SYSTEMS), argv)
    return paper.run_script(
        args,
        argv,
        NAME,
        FIELDS,
        lambda case, todo: measure(case, todo, args),
        plot,
        SYSTEMS,
        ("kernels", "intermediate_bytes", "latency_ms"),
    )


if __name__ == "__main__":
    sys.exit(main())
