"""How well the cost model ranks each group's configs, judged by the GPU's times of them.

    python scripts/ranking.py runs/bench/*/tuned.json [--json out.json] [--worst 10]

The tuner times a group's ``topk`` configs in the cost model's order and keeps the fastest
that is right; ``tuned.json`` records every config it timed, by rank (its ``timed`` table:
each distinct group once, with the config's estimate).  A good ranking puts the fastest
config near the top, so a smaller ``topk`` would find it, and gives the fusion search
estimates that order kernels as the GPU does.  For every group with two or more timed
configs this reports:

* **regret**: the time of the config ranked first over the fastest time (1.00: the cost
  model's first choice was the fastest);
* **first**: the rank of the fastest config (0: first);
* **rho**: the Spearman rank correlation of the estimates with the times (1: the same order).

grouped by the kernel kind of the configs' first stage and the precision (``fp16`` where the
file's path says so, as ``scripts/calibration.py`` decides), as the median and worst decile
of the regret, the share of groups whose fastest config was ranked first, the median rank
of the fastest, and the median rho; ``--worst N`` lists the N groups of largest regret.
Configs dropped before they were timed are left out, and so are those timed and then found
wrong (their time says nothing of a kernel that is not used).  Files tuned from the cache
have no timed table: a group counts only where this run tuned it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration import existing, quantile, read_tuned, tuned_parser


@dataclass(frozen=True)
class GroupRanking:
    """One group's timed configs: (estimate, time) by rank, and where they came from."""

    source: str
    signature: str
    kind: str
    precision: str
    ranks: tuple[int, ...]
    estimates: tuple[float, ...]
    times: tuple[float, ...]

    @property
    def regret(self) -> float:
        return self.times[0] / min(self.times)

    @property
    def fastest_rank(self) -> int:
        return self.ranks[self.times.index(min(self.times))]

    @property
    def rho(self) -> float:
        return spearman(self.estimates, self.times)


@dataclass(frozen=True)
class KindRanking:
    kind: str
    precision: str
    groups: int
    regret_median: float
    regret_p90: float
    first_share: float
    fastest_rank_median: float
    rho_median: float


def ranks_of(values: Sequence[float]) -> list[float]:
    """Ranks from 0, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson's correlation of the ranks; 0 where either side is constant."""
    ra, rb = ranks_of(a), ranks_of(b)
    n = len(ra)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else 0.0


def groups(paths: Iterable[Path]) -> list[GroupRanking]:
    """Every group with two or more configs timed and kept, from each file's timed table."""
    found = []
    for path in paths:
        doc = read_tuned(path)
        precision = "fp16" if "fp16" in str(path) else doc.get("precision", "fp32")
        for signature, records in sorted(doc.get("timed", {}).items()):
            kept = [r for r in records if r["measured_us"] is not None and r["dropped"] is None]
            if len(kept) < 2:
                continue
            kind = kept[0]["config"]["stages"][0].get("kind", "simt")
            found.append(
                GroupRanking(
                    path.name,
                    signature,
                    kind,
                    precision,
                    tuple(r["rank"] for r in kept),
                    tuple(r["config"]["estimate"]["latency_us"] for r in kept),
                    tuple(r["measured_us"] for r in kept),
                )
            )
    return found


def summarise(found: Sequence[GroupRanking]) -> list[KindRanking]:
    by_kind: dict[tuple[str, str], list[GroupRanking]] = {}
    for g in found:
        by_kind.setdefault((g.kind, g.precision), []).append(g)
    return [
        KindRanking(
            kind,
            precision,
            len(gs),
            quantile([g.regret for g in gs], 0.5),
            quantile([g.regret for g in gs], 0.9),
            sum(g.fastest_rank == g.ranks[0] for g in gs) / len(gs),
            quantile([float(g.fastest_rank) for g in gs], 0.5),
            quantile([g.rho for g in gs], 0.5),
        )
        for (kind, precision), gs in sorted(by_kind.items())
    ]


def format_table(stats: Sequence[KindRanking]) -> str:
    lines = [
        "| kind | precision | groups | regret median | regret p90 | fastest ranked first "
        "| rank of fastest | rho |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s.kind} | {s.precision} | {s.groups} | {s.regret_median:.2f} | {s.regret_p90:.2f} "
        f"| {s.first_share:.0%} | {s.fastest_rank_median:.0f} | {s.rho_median:.2f} |"
        for s in stats
    ]
    lines.append(
        "\nregret: time of the config ranked first / the fastest time; rho: Spearman, estimates vs times"
    )
    return "\n".join(lines)


def format_worst(found: Sequence[GroupRanking], n: int) -> str:
    worst = sorted(found, key=lambda g: -g.regret)[:n]
    lines = [
        "| file | signature | kind | regret | rank of fastest | first us | fastest us |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {g.source} | {g.signature[:12]} | {g.kind} | {g.regret:.2f} | {g.fastest_rank} "
        f"| {g.times[0]:.2f} | {min(g.times):.2f} |"
        for g in worst
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = tuned_parser(__doc__)
    p.add_argument("--worst", type=int, default=0, metavar="N", help="list the N groups of largest regret")
    args = p.parse_args(argv)
    paths = existing("ranking", args.tuned)
    if paths is None:
        return 2
    found = groups(paths)
    if not found:
        print(
            "ranking: no group with two or more timed configs in these files (tuned from the cache, "
            "without a GPU, or before tuned.json kept its timed table?)",
            file=sys.stderr,
        )
        return 2
    stats = summarise(found)
    print(format_table(stats))
    if args.worst:
        print()
        print(format_worst(found, args.worst))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in stats], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
