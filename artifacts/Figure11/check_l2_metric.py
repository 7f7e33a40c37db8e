"""Checks Figure 11's L2-write counter on this GPU against kernels of known output size.

    python artifacts/Figure11/check_l2_metric.py [--ncu PATH]

Runs itself under Nsight Compute with three writes whose size is known -- two elementwise
products writing 64 MiB and 4 MiB, and a 2048 x 2048 fp32 matrix product writing 16 MiB --
and prints, per write, the 32-byte sectors it wrote against what Figure 11's counter
(``run_all.METRICS``' last) and the all-sources ``lts__t_sectors_op_write.sum`` report.
Exit 0 when Figure 11's counter is within 1% of every write, 1 when it is not (its
``l2_write_bytes`` column would be off on this GPU), 2 when it could not run (no CUDA GPU,
no torch, no ncu, no permission for the counters).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

FIGURE11 = paper.script_module("Figure11")
COUNTER = FIGURE11.METRICS[-1]
ALL_SOURCES = "lts__t_sectors_op_write.sum"
METRICS = (COUNTER, ALL_SOURCES)
SECTOR = 32
MIB = 1 << 20
#: The writes, in launch order, and the bytes each leaves in memory.
WRITES = (("mul, 64 MiB", 64 * MIB), ("mul, 4 MiB", 4 * MIB), ("fp32 matmul, 16 MiB", 16 * MIB))
#: How far Figure 11's counter may stray from the bytes written.
TOLERANCE = 0.01


def child() -> None:
    """The profiled writes, between cudaProfilerStart and Stop."""
    import torch

    big = torch.ones(64 * MIB // 4, device="cuda")
    small = torch.ones(4 * MIB // 4, device="cuda")
    a = torch.ones(2048, 2048, device="cuda")
    out = [torch.empty_like(big), torch.empty_like(small), torch.empty_like(a)]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.mul(big, 2.0, out=out[0])
    torch.mul(small, 2.0, out=out[1])
    torch.mm(a, a, out=out[2])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def compare(kernels: Sequence[Sequence[float]]) -> tuple[list[str], bool]:
    """Report lines and whether Figure 11's counter matched every write, from each kernel's
    bytes by the two counters (``run_all.ncu_kernels``).  The first two kernels are the
    products; the rest (a matrix product may launch more than one) the matmul's."""
    if len(kernels) < len(WRITES):
        return [f"expected at least {len(WRITES)} kernels, ncu profiled {len(kernels)}"], False
    groups = [kernels[:1], kernels[1:2], kernels[2:]]
    lines = [f"{'write':<22}{'sectors':>12}{COUNTER:>44}{ALL_SOURCES:>32}"]
    ok = True
    for (name, size), group in zip(WRITES, groups):
        want = size / SECTOR
        got = sum(k[0] for k in group) / SECTOR
        every = sum(k[1] for k in group) / SECTOR
        ok &= abs(got - want) <= TOLERANCE * want
        ratios = f"{got:>35,.0f} ({got / want:.2f}x){every:>23,.0f} ({every / want:.2f}x)"
        lines.append(f"{name:<22}{want:>12,.0f}{ratios}")
    verdict = "matches" if ok else "does NOT match"
    lines.append(f"{COUNTER}: {verdict} the bytes written (within {TOLERANCE:.0%})")
    return lines, ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ncu", help="the ncu executable (default: ncu on PATH)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return 0
    ncu = args.ncu or shutil.which("ncu")
    if ncu is None:
        print("check_l2_metric: ncu not found (--ncu PATH)", file=sys.stderr)
        return 2
    command = [ncu, "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv", "--page", "raw"]
    command += ["--print-units", "base", sys.executable, __file__, "--child"]
    proc = subprocess.run(command, capture_output=True, text=True)
    try:
        kernels = FIGURE11.ncu_kernels(proc.stdout, METRICS)
    except ValueError as e:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        print(f"check_l2_metric: ncu exit {proc.returncode}, {e}: {tail}", file=sys.stderr)
        return 2
    lines, ok = compare(kernels)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
