"""Table 4: compile time per model -- welder with a cold and a warm tuning cache, the
candidates it measured, and torch.compile max-autotune's compile time beside it.

    python artifacts/Table4/run_all.py [--models bert,nerf] [--bs 1] [--dtype fp16]

For each case welder tunes and builds the export twice, each run in a prefix of its own
(RUNS/table4-cold/<case>, RUNS/table4-warm/<case>: the cold run's tuned.json and tune log
are kept beside the warm run's), with one tuning cache (RUNS/table4-cache/<case>): first
emptied (``welder-cold``: every candidate compiled and measured, as Welder's published
compile times are), then again on the cache the first run filled (``welder-warm``: what a
user pays the second time).  ``tune_s`` is ``welder tune``'s wall time, ``build_s`` tune
plus the runtime build; ``candidates`` is the number of configs the tuner measured over
all groups (tuned.json), ``cached_groups`` how many groups came from the cache.
``compile-max-autotune`` is the wall time of torch.compile(mode="max-autotune")'s first
call with TorchInductor's and Triton's caches empty at its start (as every torch peer of
these scripts runs; older lines had them off, TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), so it
is cold too; its latency is recorded beside it.  Figure 9's line of the same case is taken
where it was measured so (its note says "a cold compile"), or where it ran past Figure 9's
--peer-timeout-s and that limit is at least this run's, unless --no-reuse or --redo.  Such
an error line bounds the compile from below only where it names no compile time: the
limit covers the compile and the timing after it, and a line stopped in its timing keeps
the compile's seconds (``build_s``, "its compile done in").

Writes table4.csv, table4.md, table4.meta.json and table4_<dtype>_b<bs>.png (compile
seconds per model, log scale) to artifacts/results/<GPU>/.  Cases already in the CSV are
skipped; ``--device cpu`` is a smoke run (welder plans from the H100 cost model: its times
are of that, not of tuning).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper
from run_torch import COLD

benchmark = paper.benchmark

NAME = "table4"
MAX_AUTOTUNE = "compile-max-autotune"
SYSTEMS = ("welder-cold", "welder-warm", MAX_AUTOTUNE)
FIELDS = (*paper.COMMON_FIELDS, "tune_s", "candidates", "cached_groups", "groups")


def plan_counts(prefix: Path) -> dict[str, Any]:
    """What tuned.json says of the tuning: candidates this run timed (the tuner's count,
    else those of the groups it did not take from the cache: a cached group's count is of
    the run that measured it), groups from the cache."""
    tuned = json.loads((prefix / "tuned.json").read_text())
    groups = tuned["groups"]
    work = tuned.get("totals", {}).get("tuning_work")
    timed = (
        int(work.get("candidates timed", 0))
        if work is not None
        else sum(int(g.get("candidates") or 0) for g in groups if not g.get("from_cache"))
    )
    return {
        "candidates": timed,
        "cached_groups": sum(1 for g in groups if g.get("from_cache")),
        "groups": len(groups),
    }


def tune(prefix: Path, cache: Path, args: argparse.Namespace) -> tuple[float, float]:
    options = replace(paper.welder_options(args, "welder"), cache_dir=cache)
    return benchmark.tune_and_build(prefix, options)


def measure(case: benchmark.Config, todo: list[str], args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    gpu = paper.gpu_folder(args.device)
    runs = Path(args.runs)
    shared = paper.shared_row(case, MAX_AUTOTUNE, args) if MAX_AUTOTUNE in todo else None
    # Figure 9 compiled it cold too, or ran out of time: in its compile (more than the limit)
    # or in its timing, its compile time kept.
    if shared is not None and (COLD in shared["detail"] or shared["status"] == "error"):
        yield {k: v for k, v in shared.items() if k in FIELDS}
        todo = [s for s in todo if s != MAX_AUTOTUNE]
        if not todo:
            return
    try:
        export = paper.export_case(case, args)
    except Exception as e:
        cell = benchmark.Cell(error=f"export failed: {benchmark._error(e)}")
        yield from (paper.cell_row(case, s, cell, gpu) for s in todo)
        return
    cache = runs / "table4-cache" / case.key
    for system in ("welder-cold", "welder-warm"):
        if system not in todo:
            continue
        prefix = paper.variant_prefix(export, system.replace("welder", "table4"), runs)
        row = {k: v for k, v in paper.cell_row(case, system, benchmark.Cell(), gpu).items() if k in FIELDS}
        try:
            if system == "welder-cold" or not cache.is_dir():
                shutil.rmtree(cache, ignore_errors=True)  # cold: an empty cache
                tune_s, build_s = tune(prefix, cache, args)
            if system == "welder-warm":
                tune_s, build_s = tune(prefix, cache, args)
            row.update(tune_s=tune_s, build_s=tune_s + build_s, **plan_counts(prefix))
            if not args.device.startswith("cuda"):
                row.update(status="absent", detail="no CUDA GPU: plan from the H100 cost model, not tuned")
        except Exception as e:
            row.update(status="error", detail=benchmark._error(e))
        what = f"{row['build_s']:.1f} s, {row.get('candidates')} candidates" if row.get("build_s") else ""
        print(f"[{case.key}] {system}: {row['status']} {what} {row['detail'] or ''}", file=sys.stderr)
        yield row
    if MAX_AUTOTUNE in todo:
        cell = paper.torch_peer(export, MAX_AUTOTUNE, args)
        benchmark._log(case, MAX_AUTOTUNE, cell)
        yield {k: v for k, v in paper.cell_row(case, MAX_AUTOTUNE, cell, gpu).items() if k in FIELDS}


def plot(rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> None:
    systems = paper.shown(SYSTEMS, rows, args)
    for panel in paper.panels(rows, args.out, "table4"):
        fig, axes = panel.figure(1, 4.2)
        seconds = panel.value("build_s")
        paper.grouped_bars(axes[0], panel.models, systems, seconds, ylabel="compile time (s, log)", log=True)
        panel.title(axes[0], "Table 4")
        note = "welder: tune + build; torch.compile: first call, cold Inductor caches; x: no value (the CSV)"
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
        ("build_s", "tune_s", "candidates", "latency_ms"),
    )


if __name__ == "__main__":
    sys.exit(main())
