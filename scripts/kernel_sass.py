"""What nvcc makes of a tuned group's kernel: registers, spills and the SASS instruction mix.

For the groups of ``DIR/tuned.json`` whose root contains ``--group`` (all of them without
it), regenerates each group's kernel from the recorded config over ``DIR/model.onnx`` --
the kernel the tune measured, from today's code generator -- compiles it with nvcc for
``--sm`` (default sm_90; sm_90a where the kernel needs it), and prints ptxas's registers,
spills and stack, its static instruction count (from the cubin), and the count of each
SASS opcode class (``IMAD``, ``LDG``, ``HMMA``, ...: predicated instructions included)
where ``cuobjdump`` is on PATH.  The counts are static: an instruction inside a loop counts
once.  This is how the gather's integer arithmetic was measured (docs/tensor_cores.md, "The
gathered operand").  ``--recorded`` compiles the source tuned.json recorded instead (the
kernel as the tune generated it; no model.onnx needed).

Last, the kernels of at most one wave (blocks <= the arch's SMs) with the most
instructions: code that a run fetches cold, which the tune's timing alone does not see
(docs/codegen.md, "Exact-fp32 attention from a cold instruction cache").

    python scripts/kernel_sass.py DIR [--group ROOT_PART] [--top 12] [--recorded] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from welder.arch import get_arch  # noqa: E402
from welder.codegen import generate_kernel  # noqa: E402
from welder.device.cubin import text_instructions  # noqa: E402
from welder.device.gpu import CompileError, GpuUnavailable, compile_cubin, compile_ptx  # noqa: E402
from welder.pipeline import planned_import  # noqa: E402
from welder.schedule.group import make_group  # noqa: E402
from welder.schedule.kinds import config_from_json  # noqa: E402

#: ptxas -v's lines: "Used 136 registers", "0 bytes stack frame, 0 bytes spill stores, ...".
_REGISTERS = re.compile(r"Used (\d+) registers")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
#: A PTX branch (``@%p3 bra.uni $L__BB0_5;``) and a PTX label (``$L__BB0_5:``).
_BRANCH = re.compile(r"^\s*(?:@!?%\w+\s+)?bra(?:\.uni)?\s+(\$\w+);")
_LABEL = re.compile(r"^(\$\w+):")
#: A SASS line: ``/*0040*/  @!P0 IMAD.MOV.U32 R1, ...`` -> the opcode's class, ``IMAD``.
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


@dataclass
class KernelSass:
    group: str
    ops: str
    measured_us: float | None
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    instructions: int  # static SASS instructions (the cubin's .text section)
    straight_line: float  # share of its PTX instructions in no loop (straight_line_fraction)
    blocks: int | None  # the kernel's grid, as tuned.json records it
    opcodes: dict[str, int] = field(default_factory=dict)  # empty without cuobjdump


def opcode_counts(sass: str) -> dict[str, int]:
    """Opcode classes of a ``cuobjdump -sass`` listing, most frequent first."""
    counts = Counter(m.group(1) for m in _OPCODE.finditer(sass))
    return dict(counts.most_common())


def straight_line_fraction(ptx: str, kernel: str) -> float:
    """The share of ``kernel``'s PTX instructions that lie in no loop: not between a label
    and a later branch back to it.  Each thread runs those once, so a kernel of one wave
    fetches them cold once a run (the rest it fetches once and reruns)."""
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(".visible .entry " + kernel + "("))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    body = lines[start:end]
    labels = {m.group(1): i for i, line in enumerate(body) if (m := _LABEL.match(line))}
    in_loop = [False] * len(body)
    for i, line in enumerate(body):
        m = _BRANCH.match(line)
        if m and labels.get(m.group(1), len(body)) < i:
            for j in range(labels[m.group(1)], i + 1):
                in_loop[j] = True
    instructions = [
        i
        for i, line in enumerate(body)
        if line.strip().endswith(";") and not line.strip().startswith((".", "//"))
    ]
    if not instructions:
        return 1.0
    return sum(not in_loop[i] for i in instructions) / len(instructions)


def ptxas_facts(log: str) -> tuple[int, int, int, int]:
    """(registers, stack, spill stores, spill loads) from ``ptxas -v``'s report of one kernel."""
    regs = _REGISTERS.search(log)
    stack = _STACK.search(log)
    if regs is None or stack is None:
        raise ValueError(f"no ptxas report in: {log[-500:]}")
    return int(regs.group(1)), int(stack.group(1)), int(stack.group(2)), int(stack.group(3))


@dataclass
class Studied:
    """What nvcc made of one kernel (see :class:`KernelSass`)."""

    facts: tuple[int, int, int, int]  # ptxas_facts
    instructions: int
    straight_line: float
    opcodes: dict[str, int]


def study(source: str, name: str, sm: str, work: Path) -> Studied:
    """Compile one kernel's source: ptxas's facts, the static instruction count of kernel
    ``name``, the share of its PTX in no loop and, where cuobjdump exists, its opcodes."""
    logs: list[str] = []
    try:
        image = compile_cubin(source, sm, options=("-Xptxas", "-v"), report=logs.append)
        ptx = compile_ptx(source, sm)
    except (CompileError, GpuUnavailable) as e:
        raise SystemExit(f"kernel_sass: {e}") from None
    facts = ptxas_facts(logs[0])
    instructions = text_instructions(image)[name]
    straight = straight_line_fraction(ptx, name)
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        return Studied(facts, instructions, straight, {})
    cubin = work / "kernel.cubin"
    cubin.write_bytes(image)
    dump = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True)
    return Studied(facts, instructions, straight, opcode_counts(dump.stdout))


def one_wave_by_size(results: list[KernelSass], sms: int, top: int) -> list[str]:
    """The ``top`` kernels of at most ``sms`` blocks with the most instructions in no loop
    (each run once a run, and fetched cold), as lines."""
    lines = [f"kernels of at most one wave ({sms} blocks), most instructions in no loop first:"]
    alike: dict[tuple[str, int, int], list[KernelSass]] = {}
    for r in results:
        if r.blocks is not None and r.blocks <= sms:
            alike.setdefault((r.ops, r.instructions, r.blocks), []).append(r)
    few = sorted(alike.values(), key=lambda rs: -rs[0].instructions * rs[0].straight_line)
    for rs in few[:top]:
        r, times = rs[0], [x.measured_us for x in rs if x.measured_us is not None]
        measured = f"{sum(times) / len(times):.1f}" if times else "-"
        once = round(r.instructions * r.straight_line)
        lines.append(
            f"  {once:6d} of {r.instructions:6d} instr  {r.blocks:5d} blocks  {measured:>8} us"
            f"  x{len(rs):<3d}"
            f"  {r.ops[:44]}  {r.group[-36:]}"
        )
    if not few:
        lines.append("  none")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a folder holding model.onnx and tuned.json")
    parser.add_argument("--group", default="", help="only groups whose root contains this")
    parser.add_argument("--sm", default="sm_90", help="nvcc's architecture (default sm_90)")
    parser.add_argument("--top", type=int, default=12, help="opcode classes printed per kernel")
    parser.add_argument(
        "--recorded", action="store_true", help="compile tuned.json's recorded source instead of regenerating"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    for name in ("tuned.json",) if args.recorded else ("model.onnx", "tuned.json"):
        if not (args.dir / name).is_file():
            print(f"kernel_sass: {args.dir / name} does not exist", file=sys.stderr)
            return 2
    tuned = json.loads((args.dir / "tuned.json").read_text())
    arch = get_arch(tuned["arch"])
    graph = None if args.recorded else planned_import(str(args.dir / "model.onnx"), arch)
    chosen = [
        g
        for g in tuned["groups"]
        if args.group in g["root"] and not g.get("library") and (g.get("kernel") or not args.recorded)
    ]
    if not chosen:
        print(f"kernel_sass: no generated group's root contains {args.group!r}", file=sys.stderr)
        return 2
    results = []
    studied: dict[str, Studied] = {}
    with tempfile.TemporaryDirectory(prefix="welder-sass-") as work:
        for g in chosen:
            key = g.get("signature") or g["root"]  # repeated layers: one kernel, studied once
            if key not in studied:
                if graph is None:
                    source, name = g["kernel"]["source"], g["kernel"]["name"]
                    specific = "welder_wgmma" in source
                else:
                    group = make_group(graph, g["members"])
                    kernel = generate_kernel(graph, group, config_from_json(g["configs"][0]), "welder_study")
                    source, name, specific = kernel.source, "welder_study", kernel.arch_specific
                sm = f"{args.sm}a" if specific and not args.sm.endswith("a") else args.sm
                studied[key] = study(source, name, sm, Path(work))
            found = studied[key]
            regs, stack, stores, loads = found.facts
            instructions, opcodes = found.instructions, found.opcodes
            ops = "+".join(dict.fromkeys(g["ops"]))
            blocks = (g.get("kernel") or {}).get("grid")
            result = KernelSass(
                g["root"],
                ops,
                g.get("measured_latency_us"),
                regs,
                stack,
                stores,
                loads,
                instructions,
                found.straight_line,
                None if blocks is None else int(blocks),
                opcodes,
            )
            results.append(result)
            measured = f"{result.measured_us:.1f} us" if result.measured_us is not None else "not measured"
            print(f"{g['root']} ({ops[:60]}; {measured})")
            print(
                f"  {regs} registers, {stack} B stack, spills {stores} B stored / {loads} B loaded, "
                f"{instructions} instructions ({found.straight_line:.0%} in no loop), "
                f"{'?' if blocks is None else blocks} blocks"
            )
            if opcodes:
                top = ", ".join(f"{op} {n}" for op, n in list(opcodes.items())[: args.top])
                print(f"  {sum(opcodes.values())} instructions: {top}")
            else:
                print("  (cuobjdump is not on PATH: no opcode classes)")
    print("\n".join(one_wave_by_size(results, arch.sm_count, args.top)))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
