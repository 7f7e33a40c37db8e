"""Each config's latest row across benchmark tables, and welder's geometric-mean speedup
over torch.compile on those rows: the figure docs/results.md quotes while no single run
has measured every config.

    python scripts/latest_rows.py [TABLE.json ...] [--models all|bert,vit_small_p32,...]

The tables are ``scripts/benchmark.py --json`` files (default: every
``artifacts/results/*/benchmark*.json``).  A row's date is its own or its table's; the
latest row of a config stands for it whatever it says, so a config whose latest run failed
test_acc is listed as failing, not replaced by an older pass.  The means use device time and
leave out rows without both figures or failing test_acc, as benchmark.py's own do.  By
default only the reference table's models count (benchmark.TABLE_MODELS).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import TABLE_MODELS, Row, geomean_speedups  # noqa: E402


@dataclass(frozen=True)
class Sourced:
    """A row and where it comes from."""

    row: Row
    date: str
    commit: str
    table: str


def latest_rows(paths: Sequence[Path], models: Sequence[str] | None = TABLE_MODELS) -> dict[str, Sourced]:
    """Each config's latest row among ``paths`` (configs of ``models`` only; None: all)."""
    found: dict[str, Sourced] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = data.get("meta", {})
        commit = meta.get("welder", "").partition("@")[2].split(";")[0].strip()
        for entry in data.get("rows", []):
            row = Row.from_dict(entry)
            if models is not None and row.config.model not in models:
                continue
            here = Sourced(row, row.date or meta.get("date", ""), commit, Path(path).name)
            known = found.get(row.config.key)
            if known is None or here.date >= known.date:
                found[row.config.key] = here
    return found


def report(found: dict[str, Sourced]) -> str:
    rows = sorted(found.values(), key=lambda s: (s.row.config.dtype, s.row.config.model, s.row.config.batch))
    lines = [
        "| model | bs | dtype | welder ms | compile ms | vs compile | test_acc | date | commit | table |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        c, w, p = s.row.config, s.row.cells.get("welder"), s.row.cells.get("compile")
        wm, pm = (w.ms if w else None), (p.ms if p else None)
        speed = f"{pm / wm:.2f}x" if wm and pm else "-"
        fmt = [f"{v:.3f}" if v else "-" for v in (wm, pm)]
        acc = (w.accuracy if w else None) or "-"
        lines.append(
            f"| {c.model} | {c.batch} | {c.dtype} | {fmt[0]} | {fmt[1]} | {speed} | {acc} "
            f"| {s.date} | {s.commit} | {s.table} |"
        )
    lines.append("")
    for dtype, (mean, used) in sorted(geomean_speedups([s.row for s in rows]).items()):
        lines.append(f"- {dtype}: **{mean:.2f}x** over {len(used)} rows")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "tables", nargs="*", help="benchmark.py --json files (default: artifacts/results/*/benchmark*.json)"
    )
    p.add_argument(
        "--models", default=",".join(TABLE_MODELS), help="models to count, comma-separated, or 'all'"
    )
    args = p.parse_args(argv)
    paths = [Path(t) for t in args.tables] or sorted(
        (ROOT / "artifacts" / "results").glob("*/benchmark*.json")
    )
    missing = [str(t) for t in paths if not t.is_file()]
    if missing or not paths:
        print(f"latest_rows: no such table: {', '.join(missing) or 'none found'}", file=sys.stderr)
        return 2
    models = None if args.models == "all" else [m for m in args.models.split(",") if m]
    print(report(latest_rows(paths, models)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
