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
* **rho**: the Spearman rank correlation of the estimates with the times (1: the same order);
* **time / estimate**: over every timed config, the median of its time over its estimate
  and the standard deviation of that ratio's log (how far off the estimates are, and how
  unevenly: what the fusion search, which adds estimates up, depends on).

grouped by the kernel kind of the configs' first stage and the precision (``fp16`` where the
file's path says so, as ``scripts/calibration.py`` decides), as the median and worst decile
of the regret, the share of groups whose fastest config was ranked first, the median rank
of the fastest, and the median rho; ``--worst N`` lists the N groups of largest regret.
Configs dropped before they were timed are left out, and so are those timed and then found
wrong (their time says nothing of a kernel that is not used).  Files tuned from the cache
have no timed table: a group counts only where this run tuned it.

``--rerank`` judges today's cost model on the same times: each group is rebuilt from the
``model.onnx`` beside its tuned.json (as ``scripts/candidates.py`` does), proposed for again
with the kinds the tune used, and its timed configs are put in the new order; the table then
shows the regret and first place of that order, and today's time / estimate, beside the
tune's own (``now``).  A config
the search no longer proposes drops out of the new order; a group none of whose timed
configs it proposes is left out of both columns.  So a change to the estimates can be
tried on the CPU against every ranking a GPU round recorded.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from calibration import existing, kind_of, precision_of, quantile, read_tuned, tuned_parser
from google.protobuf.message import DecodeError

from welder.errors import WelderError


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
    #: The timed configs' JSON (canonical names), for --rerank.
    configs: tuple[dict, ...] = ()
    #: With --rerank: each timed config's rank in today's proposals (None: not proposed).
    reranked: tuple[int | None, ...] | None = None
    #: With --rerank: each timed config's estimate today (None: not proposed).
    estimates_now: tuple[float | None, ...] | None = None

    @property
    def regret(self) -> float:
        return self.times[0] / min(self.times)

    @property
    def regret_now(self) -> float | None:
        """The regret of today's order: the time of the timed config it ranks first."""
        placed = [(r, t) for r, t in zip(self.reranked or (), self.times) if r is not None]
        return min(placed)[1] / min(self.times) if placed else None

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
    #: Time over estimate of every timed config: median and log standard deviation.
    ratio_median: float = math.nan
    ratio_log_sd: float = math.nan
    regret_median_now: float | None = None
    regret_p90_now: float | None = None
    first_share_now: float | None = None
    ratio_median_now: float | None = None
    ratio_log_sd_now: float | None = None


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
        precision = precision_of(path, doc)
        for signature, records in sorted(doc.get("timed", {}).items()):
            kept = [r for r in records if r["measured_us"] is not None and r["dropped"] is None]
            if len(kept) < 2:
                continue
            found.append(
                GroupRanking(
                    path.name,
                    signature,
                    kind_of(kept[0]["config"]),
                    precision,
                    tuple(r["rank"] for r in kept),
                    tuple(r["config"]["estimate"]["latency_us"] for r in kept),
                    tuple(r["measured_us"] for r in kept),
                    tuple(r["config"] for r in kept),
                )
            )
    return found


def rerank(found: Sequence[GroupRanking], doc: dict, graph: Any) -> list[GroupRanking]:
    """One file's groups with their timed configs placed in today's order: ``doc`` is the
    tuned.json they came from and ``graph`` the graph it planned (``planned_import`` of its
    model).  Groups none of whose timed configs is proposed today are left out."""
    from candidates import same_kernel, tuner_order

    from welder.arch import get_arch
    from welder.schedule.engine import canonical_names
    from welder.schedule.group import make_group
    from welder.schedule.kinds import Options, ScheduleContext, config_from_json

    members = {g["signature"]: g["members"] for g in doc["groups"]}
    options = Options(topk=int(doc.get("topk") or 1), kinds=tuple(doc.get("kinds") or Options.kinds))
    shape_of, dtype_of = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    ctx = ScheduleContext(shape_of, dtype_of, get_arch(doc["arch"]), options)
    out = []
    for g in found:
        group = make_group(graph, members[g.signature])
        names = canonical_names(group)
        order = [c.renamed(names) for c in tuner_order(group, ctx, options.topk)[0]]
        timed = [config_from_json(c) for c in g.configs]
        placed = tuple(next((i for i, c in enumerate(order) if same_kernel(c, t)), None) for t in timed)
        if any(r is not None for r in placed):
            now = tuple(None if i is None else order[i].estimate.latency_us for i in placed)
            out.append(replace(g, reranked=placed, estimates_now=now))
    return out


def summarise(found: Sequence[GroupRanking]) -> list[KindRanking]:
    by_kind: dict[tuple[str, str], list[GroupRanking]] = {}
    for g in found:
        by_kind.setdefault((g.kind, g.precision), []).append(g)
    return [_kind_ranking(kind, precision, gs) for (kind, precision), gs in sorted(by_kind.items())]


def ratio_spread(pairs: Iterable[tuple[float, float | None]]) -> tuple[float, float]:
    """(median, log standard deviation) of time over estimate, over the (time, estimate)
    pairs that have an estimate: how far the estimates are off, and how unevenly."""
    ratios = [t / e for t, e in pairs if e]
    if not ratios:
        return math.nan, math.nan
    return quantile(ratios, 0.5), statistics.pstdev(math.log(r) for r in ratios)


def _kind_ranking(kind: str, precision: str, gs: Sequence[GroupRanking]) -> KindRanking:
    regrets = [g.regret for g in gs]
    ratio_median, ratio_log_sd = ratio_spread((t, e) for g in gs for t, e in zip(g.times, g.estimates))
    stats = KindRanking(
        kind,
        precision,
        len(gs),
        quantile(regrets, 0.5),
        quantile(regrets, 0.9),
        sum(g.fastest_rank == g.ranks[0] for g in gs) / len(gs),
        quantile([float(g.fastest_rank) for g in gs], 0.5),
        quantile([g.rho for g in gs], 0.5),
        ratio_median,
        ratio_log_sd,
    )
    now = [g.regret_now for g in gs]
    if any(r is None for r in now):
        return stats
    median_now, log_sd_now = ratio_spread((t, e) for g in gs for t, e in zip(g.times, g.estimates_now or ()))
    return replace(
        stats,
        regret_median_now=quantile(now, 0.5),
        regret_p90_now=quantile(now, 0.9),
        first_share_now=sum(r == 1.0 for r in now) / len(now),
        ratio_median_now=median_now,
        ratio_log_sd_now=log_sd_now,
    )


def format_table(stats: Sequence[KindRanking]) -> str:
    lines = [
        "| kind | precision | groups | regret median | regret p90 | fastest ranked first "
        "| rank of fastest | rho | time / estimate | log sd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s.kind} | {s.precision} | {s.groups} | {s.regret_median:.2f} | {s.regret_p90:.2f} "
        f"| {s.first_share:.0%} | {s.fastest_rank_median:.0f} | {s.rho_median:.2f} "
        f"| {s.ratio_median:.2f} | {s.ratio_log_sd:.3f} |"
        for s in stats
    ]
    if any(s.regret_median_now is not None for s in stats):
        lines += [
            "",
            "| kind | precision | regret median, tune -> now | regret p90 | fastest ranked first "
            "| time / estimate | log sd |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s.kind} | {s.precision} | {s.regret_median:.2f} -> {s.regret_median_now:.2f} "
            f"| {s.regret_p90:.2f} -> {s.regret_p90_now:.2f} "
            f"| {s.first_share:.0%} -> {s.first_share_now:.0%} "
            f"| {s.ratio_median:.2f} -> {s.ratio_median_now:.2f} "
            f"| {s.ratio_log_sd:.3f} -> {s.ratio_log_sd_now:.3f} |"
            for s in stats
            if s.regret_median_now is not None
        ]
    lines.append(
        "\nregret: time of the config ranked first / the fastest time; rho: Spearman, estimates vs times; "
        "time / estimate: median over every timed config, and the standard deviation of its log"
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


def planned_model(path: Path, arch: str) -> Any:
    """The graph ``welder tune`` planned on ``arch`` for the model at ``path`` (or its gzipped
    skeleton: ``scripts/model_skeleton.py``)."""
    from model_skeleton import load

    from welder.arch import get_arch
    from welder.pipeline import planned_import

    if not path.is_file():
        raise OSError("no such file")
    return planned_import(load(path), get_arch(arch), name=path.name.split(".")[0])


def main(argv: Sequence[str] | None = None) -> int:
    p = tuned_parser(__doc__)
    p.add_argument("--worst", type=int, default=0, metavar="N", help="list the N groups of largest regret")
    p.add_argument(
        "--rerank",
        action="store_true",
        help="also order the timed configs by today's cost model (needs model.onnx beside each tuned.json)",
    )
    p.add_argument(
        "--model",
        help="with --rerank and one tuned.json: the model.onnx it was tuned from, or its skeleton "
        "(scripts/model_skeleton.py)",
    )
    args = p.parse_args(argv)
    paths = existing("ranking", args.tuned)
    if paths is None:
        return 2
    if args.model and (not args.rerank or len(paths) != 1):
        print("ranking: --model goes with --rerank and one tuned.json", file=sys.stderr)
        return 2
    found = [] if args.rerank else groups(paths)
    for path in paths if args.rerank else ():
        model = Path(args.model) if args.model else path.parent / "model.onnx"
        try:
            doc = read_tuned(path)
            found += rerank(groups([path]), doc, planned_model(model, doc["arch"]))
        except (OSError, ValueError, DecodeError, WelderError) as e:
            print(f"ranking: --rerank needs {model}, the model {path} was tuned from ({e})", file=sys.stderr)
            return 2
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
