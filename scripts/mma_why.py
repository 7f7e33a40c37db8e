"""Why the tensor-core kind proposes (or does not propose) configs for a planned model's groups.

For every group of ``DIR/tuned.json`` whose first stage is a contraction the ``mma`` kind
accepts, prints the contraction's and the root's shapes, how many configs the rule
proposes, and for each block tile (``block_m x block_n``) the check that rejected it --
the reason of its first slice and ring depth; a tile whose depths disagree lists each
reason once.  The checks are the rule's own (``MmaKind.explain``), so this cannot drift
from what ``welder tune`` does.

    python scripts/mma_why.py DIR [--arch H100] [--tf32 | --kind wgmma] [--all]

``DIR`` holds ``model.onnx`` and the ``tuned.json`` of a ``welder tune`` run (its
grouping is reused); ``--all`` lists groups that get configs too, with the best estimate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from welder.arch import get_arch  # noqa: E402
from welder.pipeline import planned_import  # noqa: E402
from welder.schedule.group import make_group  # noqa: E402
from welder.schedule.kinds import Options, ScheduleContext, kind, mma  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--arch", default="H100")
    parser.add_argument("--tf32", action="store_true", help="the fp32 (TF32) kind instead of fp16")
    parser.add_argument(
        "--kind", default="mma", choices=("mma", "wgmma"), help="the fp16 kind to explain (default mma)"
    )
    parser.add_argument("--all", action="store_true", help="also list groups that get configs")
    args = parser.parse_args(argv)
    tuned = json.loads((args.dir / "tuned.json").read_text())
    graph = planned_import(str(args.dir / "model.onnx"), get_arch(tuned["arch"]))
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, get_arch(args.arch), Options(topk=1)
    )
    rule = mma.TF32_KIND if args.tf32 else kind(args.kind)
    accepted = proposed = 0
    for g in tuned["groups"]:
        if g.get("library"):
            continue
        group = make_group(graph, g["members"])
        verdicts = rule.explain(group, ctx)
        if verdicts is None:
            continue
        accepted += 1
        configs = [c for v in verdicts for c in v.configs]
        proposed += bool(configs)
        if configs and not args.all:
            continue
        con = mma.contraction(group.computes[group.stages[0]], ctx.shape_of)
        ops = "+".join(g["ops"])[:60]
        print(f"group {g['index']} {ops}")
        print(
            f"  contraction {con.compute.shape} (M {con.m}, N {con.n}, K {con.k_extent}), "
            f"root {ctx.shape_of(group.root)}, {len(group.stages)} stages, outputs {len(group.outputs)}"
        )
        if configs:
            best = min(c.estimate.latency_us for c in configs)
            print(f"  {len(configs)} configs, best {best:.2f} us")
        by_tile: dict[tuple[int, int], list[str]] = {}
        for v in verdicts:
            if v.reason is not None:
                reasons = by_tile.setdefault(v.block[:2], [])
                if v.reason not in reasons:
                    reasons.append(v.reason)
        for (bm, bn), reasons in by_tile.items():
            print(f"  {bm:>3} x {bn:<3} " + "; ".join(reasons))
    print(f"{accepted} groups with an accepted contraction, {proposed} with configs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
