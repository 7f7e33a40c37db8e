"""Each kernel of a welder build timed inside one inference, beside its time alone in the tune.

    python artifacts/Figure11/kernel_context.py PREFIX [--ncu PATH] [--top 15] [--json OUT]

The tune times every kernel on its own, launched back to back on the same inputs
(``tuned.json``'s ``measured_latency_us``); the runtime runs them one after another, each
on what the previous left in the caches.  When a plan's runtime takes longer than its
kernels' sum (ViT-S/32 at batch 1 in fp32: 778 us against 717, where ``--nofusion``'s
runtime is 152 us shorter than its sum), this says which kernels are slower in place
(`welder profile` times each step alone too, on the runtime's buffers, and the gap
between the whole run and that sum; this times each kernel in its sequence).
One warmed-up inference of PREFIX (profile_once.py) runs under ``ncu --cache-control none
--clock-control none --metrics gpu__time_duration.sum``: the caches are left as the
previous kernel left them and the clocks as they run, one pass a kernel, so each
duration is that kernel's in the sequence (ncu's serialisation adds time between
kernels, not inside them).  Each profiled kernel is matched to its group by name, in
launch order.

Prints the sums (alone, in place, the runtime's timing from the tune), then the groups
whose kernels gain the most in place.  Exit 0, or 2 when it could not run (no build, no
ncu, no permission for the counters).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

FIGURE11 = paper.script_module("Figure11")
METRIC = "gpu__time_duration.sum"


@dataclass
class Placed:
    """One launch of the inference: its kernel, its group (None for a kernel no group
    names, a library's), and its time alone (the tune's) and in place, in us."""

    kernel: str
    group: str | None
    ops: str
    alone_us: float | None
    placed_us: float


def ncu_command(ncu: str, prefix: Path) -> list[str]:
    return FIGURE11.ncu_command(ncu, "welder", prefix, (METRIC,), ("--cache-control", "none"))


def place(kernels: Sequence[tuple[str, Sequence[float]]], tuned: Mapping[str, Any]) -> list[Placed]:
    """Each profiled (name, [seconds]) matched to the tuned.json group whose kernel has
    that name; a kernel launched twice (a group run on two inputs) matches it each time."""
    groups = {g["kernel"]["name"]: g for g in tuned["groups"] if g.get("kernel")}
    out = []
    for name, (seconds, *_) in kernels:
        group = groups.get(name)
        alone = (
            None
            if group is None or group.get("measured_latency_us") is None
            else float(group["measured_latency_us"])
        )
        out.append(
            Placed(
                kernel=name,
                group=None if group is None else group["name"],
                ops=" ".join(dict.fromkeys(group["ops"])) if group else "",
                alone_us=alone,
                placed_us=seconds * 1e6,
            )
        )
    return out


def report(placed: Sequence[Placed], totals: Mapping[str, Any], top: int) -> list[str]:
    """The sums and the ``top`` launches that take longest in place over alone."""
    matched = [p for p in placed if p.alone_us is not None]
    alone = sum(p.alone_us for p in matched)  # type: ignore[misc]
    in_place = sum(p.placed_us for p in matched)
    other = sum(p.placed_us for p in placed if p.alone_us is None)
    runtime = totals.get("measured_runtime_us")
    lines = [
        f"{len(placed)} kernels in one inference, {len(matched)} of them the plan's groups",
        f"  alone (the tune, summed):  {alone:10.1f} us",
        f"  in place (ncu, summed):    {in_place:10.1f} us"
        + (f"  (+{other:.1f} us in other kernels)" if other else ""),
        f"  the runtime (the tune's):  {runtime:10.1f} us"
        if runtime is not None
        else "  the runtime: not timed",
        "",
        f"{'group':<12}{'alone':>9}{'placed':>9}{'+us':>8}  ops",
    ]
    worst = sorted(matched, key=lambda p: p.alone_us - p.placed_us)[:top]  # type: ignore[operator]
    for p in worst:
        gain = p.placed_us - p.alone_us  # type: ignore[operator]
        lines.append(f"{p.group:<12}{p.alone_us:9.2f}{p.placed_us:9.2f}{gain:+8.2f}  {p.ops[:70]}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prefix", type=Path, help="a welder build (welder tune and build wrote it)")
    parser.add_argument("--ncu", help="Nsight Compute's ncu (default: the one on PATH)")
    parser.add_argument("--top", type=int, default=15, help="groups listed (15)")
    parser.add_argument("--json", type=Path, help="also write every launch here")
    args = parser.parse_args(argv)
    tuned_path = args.prefix / "tuned.json"
    if not tuned_path.is_file():
        print(
            f"kernel_context: {tuned_path} not found: run welder tune and build on {args.prefix}",
            file=sys.stderr,
        )
        return 2
    ncu = args.ncu or shutil.which("ncu")
    if ncu is None:
        print("kernel_context: ncu not found (--ncu PATH)", file=sys.stderr)
        return 2
    proc = subprocess.run(ncu_command(ncu, args.prefix), capture_output=True, text=True)
    try:
        kernels = FIGURE11.ncu_named_kernels(proc.stdout, [METRIC])
    except ValueError as e:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        print(f"kernel_context: {e} (ncu exit {proc.returncode}): {' | '.join(tail)}", file=sys.stderr)
        return 2
    tuned = json.loads(tuned_path.read_text())
    placed = place(kernels, tuned)
    print("\n".join(report(placed, tuned.get("totals", {}), args.top)))
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in placed], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
