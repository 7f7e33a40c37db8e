"""How far the cost model's predictions are from the GPU's measurements, per kernel kind.

    python scripts/calibration.py runs/bench/*/tuned.json [--json out.json]

Reads ``tuned.json`` files written by ``welder tune`` on a GPU, plain or gzipped
(``.json.gz``, as the recorded ones under artifacts/results are kept), and, for every group
that was measured, the ratio of its measured latency to its predicted one.  The ratios are
grouped by the kind of the group's first stage and the model's precision, and summarised
as the median and the deciles: the calibration target is a median within 1.3x and a worst
decile within 2x.  The precision is ``fp16`` where the file's path says so (the benchmark
names its runs ``MODEL_bBATCH_fp16``; tuned.json records only the arithmetic of fp32
outputs), else tuned.json's ``precision`` (fp32 or tf32).  Groups without a measurement
are skipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

#: The calibration target: measured / predicted within these, at the median and the worst decile.
MEDIAN_LIMIT = 1.3
DECILE_LIMIT = 2.0


@dataclass(frozen=True)
class KindStats:
    kind: str
    precision: str
    groups: int
    median: float
    p10: float
    p90: float

    @property
    def on_target(self) -> bool:
        """Within the target both ways: a ratio under 1 counts by its inverse."""
        worst = max(self.p90, 1 / self.p10) if self.p10 > 0 else math.inf
        return max(self.median, 1 / self.median) <= MEDIAN_LIMIT and worst <= DECILE_LIMIT


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by linear interpolation between order statistics
    (numpy's default method)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def read_tuned(path: str | Path) -> dict:
    """A tuned.json, plain or gzipped (``.gz``): the recorded rounds are kept compressed."""
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)


def precision_of(path: Path, doc: dict) -> str:
    """``fp16`` where the file's path says so, else tuned.json's ``precision`` (see above)."""
    return "fp16" if "fp16" in str(path) else doc.get("precision", "fp32")


def kind_of(config: dict) -> str:
    """The kernel kind of a config's first stage, from its JSON."""
    return config["stages"][0].get("kind", "simt")


def ratios(paths: Iterable[Path]) -> dict[tuple[str, str], list[float]]:
    """measured / predicted of every measured group, by (first stage's kind, precision)."""
    found: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        doc = read_tuned(path)
        precision = precision_of(path, doc)
        for group in doc.get("groups", []):
            measured, predicted = group.get("measured_latency_us"), group.get("predicted_latency_us")
            if measured is None or not predicted or not group.get("configs"):
                continue
            found.setdefault((kind_of(group["configs"][0]), precision), []).append(measured / predicted)
    return found


def summarise(found: dict[tuple[str, str], list[float]]) -> list[KindStats]:
    return [
        KindStats(kind, precision, len(v), quantile(v, 0.5), quantile(v, 0.1), quantile(v, 0.9))
        for (kind, precision), v in sorted(found.items())
    ]


def format_table(stats: Sequence[KindStats]) -> str:
    lines = [
        "| kind | precision | groups | median | p10 | p90 | on target |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s.kind} | {s.precision} | {s.groups} | {s.median:.2f} | {s.p10:.2f} | {s.p90:.2f} "
        f"| {'yes' if s.on_target else 'no'} |"
        for s in stats
    ]
    lines.append(
        f"\nmeasured / predicted per group; target: median within {MEDIAN_LIMIT}x, worst decile within "
        f"{DECILE_LIMIT}x"
    )
    return "\n".join(lines)


def tuned_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of the scripts that read tuned.json files: the files, ``--json``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "tuned", nargs="+", help="tuned.json (or .json.gz) files written by `welder tune` on a GPU"
    )
    p.add_argument("--json", help="also write the figures as JSON here")
    return p


def existing(prog: str, files: Sequence[str]) -> list[Path] | None:
    """``files`` as paths, or None after saying which do not exist."""
    missing = [t for t in files if not Path(t).is_file()]
    if missing:
        print(f"{prog}: no such file: {', '.join(missing)}", file=sys.stderr)
        return None
    return [Path(t) for t in files]


def main(argv: Sequence[str] | None = None) -> int:
    args = tuned_parser(__doc__).parse_args(argv)
    paths = existing("calibration", args.tuned)
    if paths is None:
        return 2
    stats = summarise(ratios(paths))
    if not stats:
        print("calibration: no measured group in these files (tuned without a GPU?)", file=sys.stderr)
        return 2
    print(format_table(stats))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in stats], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
