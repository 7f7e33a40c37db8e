"""The configs the search proposes for a tuned model's groups, best estimate first, and which
of them the tuner timed.

    python scripts/candidates.py DIR [--group N ...] [--show 30] [--topk K] [--no-tc | --tf32] [--time]

``DIR`` holds ``model.onnx`` and the ``tuned.json`` of a ``welder tune`` run; each group is
rebuilt from its members in the graph the tuner planned, and proposed for as the tuner does
(the same ``propose`` call, on tuned.json's arch, topk and kinds unless ``--topk``, or
``--no-tc`` and ``--tf32`` as the run's flags were, say otherwise).  For each group: its proposals in the
order the tuner ranks them, up to ``--show``, each with its family, block tile, threads and
estimate (latency, blocks, blocks an SM, waves, shared memory, registers a thread); ``*``
marks the ``topk`` the tuner timed and ``=`` the config tuned.json holds.  A kernel that
measured far from its floor may have had better configs the search never timed: here is
where to see whether they were offered.  Where the tune timed the group (tuned.json's
``timed`` table), a ``meas us`` column gives its time of each proposal it timed.  Groups
that a library call computes are left out.

``--time`` (needs pycuda and a GPU; exit 2 and a one-line error without them) also compiles
and times the listed proposals on the local GPU with the tuner's own machinery -- the same
kernels, inputs (seed 0) and timing loop -- in a ``meas us`` column beside the estimate,
then names the fastest of them by rank.  As in the tuner, proposals are timed in rank order
and one already 1.25 times slower than the fastest so far is timed only roughly; a proposal
that fails to render, compile or launch has a blank time, its reason under the table.
Timing is not checking: the fastest listed is not known to compute the right result.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from welder.arch import get_arch  # noqa: E402
from welder.errors import WelderError  # noqa: E402
from welder.graph import Graph  # noqa: E402
from welder.pipeline import TuneOptions, planned_import  # noqa: E402
from welder.schedule.config import GroupConfig  # noqa: E402
from welder.schedule.engine import canonical_names  # noqa: E402
from welder.schedule.group import Group, make_group  # noqa: E402
from welder.schedule.kinds import Options, ScheduleContext, config_from_json, propose  # noqa: E402
from welder.tune.compile import Candidates, Device, compile_candidates, prepare_candidates  # noqa: E402
from welder.tune.measure import drop_summary, group_inputs, time_candidates  # noqa: E402
from welder.tune.tuner import default_device  # noqa: E402

#: Enough to see past the configs the tuner timed at its default topk (20).
ALL = 10_000


def same_kernel(a: GroupConfig, b: GroupConfig) -> bool:
    """Whether two configs make the same kernel (their estimates may differ: tuned.json's
    was calibrated at another time)."""
    keys = ("block_tile", "grid", "block_order", "threads", "stages", "smem_bytes")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def row(rank: int, config: GroupConfig, timed: bool, chosen: bool, measured: str | None = None) -> str:
    """One proposal's line; ``measured`` (the ``meas us`` column, blank for a proposal that
    has no time) only with ``--time``."""
    e = config.estimate
    tile = "x".join(map(str, config.block_tile))
    marks = ("*" if timed else " ") + ("=" if chosen else " ")
    meas = "" if measured is None else f"  {measured:>9}"
    return (
        f"{marks} {rank:>4}  {e.latency_us:>9.2f}{meas}  {config.family:<14} {tile:<16} "
        f"{config.threads:>4}  {e.blocks:>7}  {e.blocks_per_sm:>3}  {e.waves:>5}  {e.smem_bytes:>6}  "
        f"{e.regs_per_thread:>4}"
    )


HEADER = "  rank  est us     family         block tile        thr   blocks  bps  waves    smem  regs"
TIMED_HEADER = HEADER.replace("est us     ", "est us        meas us  ", 1)


def tuner_order(group: Group, ctx: ScheduleContext, topk: int) -> tuple[list[GroupConfig], list[GroupConfig]]:
    """(every proposal in the tuner's order, the first ``topk`` of them the tuner times): what
    it times, by estimate, then the rest by estimate."""
    proposals = propose(group, replace(ctx, options=replace(ctx.options, topk=ALL)))
    timed = propose(group, replace(ctx, options=replace(ctx.options, topk=topk)))
    return timed + [c for c in proposals if not any(c is t or same_kernel(c, t) for t in timed)], timed


def measure(
    graph: Graph, group: Group, configs: list[GroupConfig], device: Device
) -> tuple[dict[int, float], Candidates]:
    """Each config's time on ``device`` (by index in ``configs``; a config that fails to
    render, compile or launch has none, and its reason is in the candidates' ``dropped``),
    measured as the tuner measures: one kernel a config, compiled together, timed in order on
    the group's seeded inputs (see :func:`welder.tune.tuner.finish_candidates`)."""
    cands = compile_candidates(device, prepare_candidates(graph, group, configs))
    feeds = group_inputs(graph, group)
    return time_candidates(device, cands, [feeds[t] for t in group.inputs]), cands


def explain(
    graph: Graph,
    entry: dict[str, Any],
    ctx: ScheduleContext,
    topk: int,
    show: int,
    device: Device | None = None,
    recorded: list[dict] | None = None,
) -> list[str]:
    group = make_group(graph, entry["members"])
    ranked, timed = tuner_order(group, ctx, topk)
    chosen = config_from_json(entry["configs"][0])
    listed = ranked[:show]
    timings, cands = measure(graph, group, listed, device) if device is not None else ({}, None)
    times = {i: f"{t:.2f}" for i, t in timings.items()}
    if device is None and recorded:
        times = tuned_times(group, listed, recorded)
    ops = "+".join(entry["ops"])[:70]
    lines = [f"group {entry['index']} {ops}: {len(ranked)} proposals, {len(timed)} timed"]
    lines.append(HEADER if device is None and not recorded else TIMED_HEADER)
    for i, c in enumerate(listed, 1):
        measured = None if device is None and not recorded else times.get(i - 1, "")
        lines.append(row(i, c, i <= len(timed), same_kernel(c, chosen), measured))
    if device is None and recorded:
        lines.append("  meas us: the tune's own times (tuned.json's timed table; 'wrong': timed, then wrong)")
    if not any(same_kernel(c, chosen) for c in ranked):
        lines.append("  tuned.json's config is not among the proposals (the search has changed since)")
    elif not any(same_kernel(c, chosen) for c in listed):
        rank = next(i for i, c in enumerate(ranked, 1) if same_kernel(c, chosen))
        lines.append(f"  tuned.json's config is proposal {rank}")
    if cands is not None:
        lines.extend(timing_notes(entry, listed, chosen, timings, cands))
    return lines


def tuned_times(group: Group, listed: list[GroupConfig], recorded: list[dict]) -> dict[int, str]:
    """The tune's time of each listed config that it timed (by index in ``listed``), from
    tuned.json's timed records of the group (canonical names); a config found wrong after
    timing says so."""
    names = canonical_names(group)
    configs = [(config_from_json(r["config"]), r) for r in recorded]
    times = {}
    for i, c in enumerate(listed):
        mine = c.renamed(names)
        r = next((r for t, r in configs if same_kernel(mine, t)), None)
        if r is not None and r["measured_us"] is not None:
            times[i] = "wrong" if r["dropped"] == "wrong" else f"{r['measured_us']:.2f}"
    return times


def timing_notes(
    entry: dict[str, Any],
    listed: list[GroupConfig],
    chosen: GroupConfig,
    timings: dict[int, float],
    cands: Candidates,
) -> list[str]:
    """The lines under a timed table: the fastest proposal measured, how tuned.json's config
    measured here and there, and why proposals have no time."""
    lines = []
    if timings:
        best = min(timings, key=lambda k: (timings[k], k))
        lines.append(f"  fastest measured: proposal {best + 1}, {timings[best]:.2f} us")
    else:
        lines.append(f"  none of the {len(listed)} proposals listed was timed")
    kept = next((k for k, c in enumerate(listed) if same_kernel(c, chosen)), None)
    recorded = entry.get("measured_latency_us")
    if kept is not None and (kept in timings or recorded is not None):
        here = f"{timings[kept]:.2f} us here" if kept in timings else "no time here"
        there = f", {recorded:.2f} us in tuned.json" if recorded is not None else ""
        lines.append(f"  tuned.json's config (proposal {kept + 1}): {here}{there}")
    if cands.dropped:
        ranks = ", ".join(str(d.candidate + 1) for d in sorted(cands.dropped, key=lambda d: d.candidate))
        lines.append(f"  not timed: proposal {ranks}: {drop_summary(cands.dropped)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a folder `welder tune` wrote (model.onnx and tuned.json)")
    parser.add_argument("--group", type=int, nargs="*", help="group indices (default: every kernel group)")
    parser.add_argument("--show", type=int, default=30, help="proposals listed a group (default: 30)")
    parser.add_argument("--topk", type=int, help="candidates timed a group (default: tuned.json's)")
    flags = parser.add_mutually_exclusive_group()
    flags.add_argument("--no-tc", action="store_true", help="the run was tuned with --no-tc")
    flags.add_argument("--tf32", action="store_true", help="the run was tuned with --tf32")
    parser.add_argument(
        "--time",
        action="store_true",
        help="also compile and time the listed proposals on the local GPU (needs pycuda), as the tuner "
        "does: one already 1.25x slower than the fastest so far is timed only roughly",
    )
    args = parser.parse_args(argv)
    try:
        tuned = json.loads((args.dir / "tuned.json").read_text())
        graph = planned_import(str(args.dir / "model.onnx"), get_arch(tuned["arch"]))
    except (OSError, ValueError) as e:
        print(f"candidates: {args.dir} holds no readable model.onnx and tuned.json ({e})", file=sys.stderr)
        return 2
    kinds = TuneOptions(tensor_cores=not args.no_tc, tf32=args.tf32).kinds
    if not (args.no_tc or args.tf32) and tuned.get("kinds"):
        kinds = tuple(tuned["kinds"])  # what the tune proposed with
    topk = args.topk or int(tuned.get("topk") or 1)
    options = Options(topk=topk, kinds=kinds)
    ctx = ScheduleContext(
        lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, get_arch(tuned["arch"]), options
    )
    wanted = set(args.group) if args.group else None
    kernels = [g for g in tuned["groups"] if not g.get("library")]
    entries = [g for g in kernels if wanted is None or g["index"] in wanted]
    if wanted is not None and len(entries) != len(wanted):
        missing = sorted(wanted - {g["index"] for g in entries})
        print(f"candidates: no kernel group {missing} in {args.dir / 'tuned.json'}", file=sys.stderr)
        return 2
    try:
        if not args.time:
            recorded = tuned.get("timed", {})
            for entry in entries:
                print(
                    "\n".join(
                        explain(graph, entry, ctx, topk, args.show, None, recorded.get(entry["signature"]))
                    )
                )
                print()
            return 0
        with default_device() as device:
            for entry in entries:
                print("\n".join(explain(graph, entry, ctx, topk, args.show, device)), flush=True)
                print(flush=True)
    except WelderError as e:  # GpuUnavailable above all: no pycuda, driver, GPU or nvcc
        print(f"candidates: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
