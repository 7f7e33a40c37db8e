"""Built runtimes timed under settings of the runtime's environment, in turns.

    python scripts/env_ab.py PREFIX [PREFIX ...] --set WELDER_PDL=0 --set WELDER_PDL=1 \
        [--rounds 3] [--iters 200] [--number 10] [--warmup 5]

A runtime reads its launch settings (WELDER_PDL, WELDER_SMEM_CARVEOUT: docs/runtime.md)
once, when it is loaded, so each timing is a ``welder run`` of its own with the setting in
its environment and every other setting of the list taken out.  The settings take turns
within each round, and the rounds repeat the turns, so that a drift of the machine's clocks
falls on all of them alike.  Prints, per build, each setting's median over the rounds (of
``welder run``'s medians) and its ratio to the first setting's; exit 1 if a run failed
(its message is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from welder.runtime.layout import library_path

#: ``welder`` in the interpreter running this script (the one it was installed into).
WELDER = "import sys; from welder.cli import main; sys.exit(main(sys.argv[1:]))"
MEDIAN = re.compile(r"^median ([0-9.]+) ms$", re.MULTILINE)


def setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def run_once(prefix: Path, chosen: tuple[str, str], names: set[str], args: argparse.Namespace) -> float | str:
    """``welder run``'s median in ms with ``chosen`` set, or the failure's last line."""
    env = {k: v for k, v in os.environ.items() if k not in names}
    env[chosen[0]] = chosen[1]
    command = [sys.executable, "-c", WELDER, "run", str(prefix), "--iters", str(args.iters)]
    command += ["--number", str(args.number), "--warmup", str(args.warmup)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    found = MEDIAN.search(done.stdout)
    if done.returncode != 0 or found is None:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit {done.returncode}"
    return float(found.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prefixes", nargs="+", type=Path, help="folders welder build built a runtime in")
    parser.add_argument(
        "--set",
        dest="settings",
        type=setting,
        action="append",
        required=True,
        help="NAME=VALUE, once per setting compared (the first is the reference)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns of every setting (3)")
    parser.add_argument("--iters", type=int, default=200, help="welder run --iters (200)")
    parser.add_argument("--number", type=int, default=10, help="welder run --number (10)")
    parser.add_argument("--warmup", type=int, default=5, help="welder run --warmup (5)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="cap on one welder run (300)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.iters < 1 or args.number < 1 or args.warmup < 0:
        parser.error("--rounds, --iters and --number must be positive, --warmup not negative")
    missing = [str(p) for p in args.prefixes if not library_path(p).is_file()]
    if missing:
        parser.error(f"no runtime built under {', '.join(missing)} (welder build PREFIX)")
    names = {name for name, _ in args.settings}
    labels = [f"{name}={value}" for name, value in args.settings]
    failed = False
    print(f"{'build':<48}" + "".join(f"{label:>24}" for label in labels))
    for prefix in args.prefixes:
        times: dict[str, list[float]] = {label: [] for label in labels}
        for _ in range(args.rounds):
            for label, chosen in zip(labels, args.settings):
                result = run_once(prefix, chosen, names, args)
                if isinstance(result, str):
                    print(f"{prefix}: {label}: {result}", file=sys.stderr)
                    failed = True
                else:
                    times[label].append(result)
        medians = [statistics.median(t) if t else None for t in times.values()]
        cells = []
        for m in medians:
            if m is None:
                cells.append(f"{'failed':>24}")
            elif medians[0] is None:
                cells.append(f"{m:>14.4f} ms{'':>8}")
            else:
                cells.append(f"{m:>14.4f} ms {m / medians[0]:>6.3f}x")
        print(f"{str(prefix)[-48:]:<48}" + "".join(cells))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
