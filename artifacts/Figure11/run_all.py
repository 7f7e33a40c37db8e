"""Figure 11: latency, kernel count, DRAM traffic and bytes written per model, for
welder, welder without tile-graph fusion (``--nofusion``) and the baselines.

    python artifacts/Figure11/run_all.py [--models bert,nerf] [--bs 1] [--dtype fp16] [--ncu PATH]

Each case is measured as in Figure 9 (RUNS/welder and RUNS/welder-nofusion, the persistent
tuning cache and earlier builds reused), then every system that ran is profiled once with
Nsight Compute: ``ncu --clock-control none --target-processes application-only
--profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum,
lts__t_sectors_srcunit_tex_op_write.sum`` (the clocks
left as the timing runs had them, Inductor compiling in the process itself, from the caches
a compile of the same system outside ncu filled just before: see COMPILED_OUTSIDE) around one
warmed-up inference (profile_once.py), which gives the number of kernels launched and the
bytes read from and written to DRAM, and the bytes the kernels wrote (32-byte sectors the
SMs wrote to L2).  ncu's default cache control flushes the caches before each kernel, outside what
it counts: the reads are each kernel's own from a cold cache (the traffic fusion removes),
and the DRAM writes only what overflows the L2 during a kernel, so the L2 column is the
one that counts every intermediate a kernel writes (which fusion removes too).  It counts
the writes that come from the SMs (source unit ``tex``): on the H200 it matched the bytes
written by kernels of known output exactly, where ``lts__t_sectors_op_write.sum``, which
counts every source, gave 1.5 times them (docs/results.md).  A
system ncu cannot profile (no ncu, no permission for the GPU counters, a failure) keeps its
latency and says why in the ``profile`` column.

Writes to artifacts/results/<GPU>/: figure11.csv (latency, kernels, dram_read_bytes,
dram_write_bytes, l2_write_bytes per case and system), figure11.md, figure11.meta.json and
figure11_<dtype>_b<bs>.png (four panels: latency, kernels, DRAM MB read + written, MB
written to L2, log scales).  Cases already in the CSV are skipped; ``--device cpu`` is a smoke run (nothing
is profiled).
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paper

benchmark = paper.benchmark

NAME = "figure11"
SYSTEMS = ("welder", "welder-nofusion", *paper.BASELINES)
FIELDS = (
    *paper.LATENCY_FIELDS,
    "kernels",
    "dram_read_bytes",
    "dram_write_bytes",
    "l2_write_bytes",
    "profile",
)
#: DRAM bytes read and written, and the L2 sectors the SMs wrote (each 32 bytes:
#: ``UNITS["sector"]``).
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_srcunit_tex_op_write.sum")
CHILD = Path(__file__).with_name("profile_once.py")
#: Inductor compiles in the profiled process itself: a pool of compile workers under ncu
#: held mobilenet_v2's torch.compile past a 540 s run.
PROFILE_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
#: The torch systems compiled once outside ncu before their profile, into the Inductor and
#: Triton caches of the same case and system's timing (RUNS/inductor/CASE-SYSTEM,
#: paper.peer_caches), so that the compile under ncu, which must happen in the profiled
#: process, finds its graph and its autotuning there: max-autotune's cold compile under
#: ncu ran past a call's limit on every model but bert.  Where Figure 9 timed the system on
#: this machine, the compile outside finds that compile's graph and autotuning, and the
#: kernels profiled are the ones it timed.
COMPILED_OUTSIDE = ("compile", "compile-max-autotune")
UNITS = {
    "byte": 1.0,
    "Kbyte": 1e3,
    "Mbyte": 1e6,
    "Gbyte": 1e9,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "sector": 32.0,
    "nsecond": 1e-9,
    "usecond": 1e-6,
    "msecond": 1e-3,
    "second": 1.0,
    "ns": 1e-9,
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
}


def ncu_command(
    ncu: str, system: str, prefix: Path, metrics: Sequence[str] = METRICS, options: Sequence[str] = ()
) -> list[str]:
    """ncu over one inference of ``system`` (profile_once.py), ``metrics`` in its raw CSV;
    ``options`` go to ncu before the rest."""
    return [
        ncu,
        *options,
        "--clock-control",
        "none",
        "--target-processes",
        "application-only",
        "--profile-from-start",
        "off",
        "--metrics",
        ",".join(metrics),
        "--csv",
        "--page",
        "raw",
        "--print-units",
        "base",
        sys.executable,
        str(CHILD),
        system,
        str(prefix),
    ]


def ncu_kernels(text: str, metrics: Sequence[str]) -> list[list[float]]:
    """Each profiled kernel's values of ``metrics`` from ``ncu --csv --page raw``
    (:func:`ncu_named_kernels` without the names)."""
    return [values for _, values in ncu_named_kernels(text, metrics)]


def ncu_named_kernels(text: str, metrics: Sequence[str]) -> list[tuple[str, list[float]]]:
    """Each profiled kernel's name and values of ``metrics`` from ``ncu --csv --page raw``:
    one line per kernel after the header, scaled by the units line where there is one
    (bytes; a sector is 32); the program's own output and ncu's ``==PROF==`` lines around
    it are skipped.  The name is the function's, without a demangled parameter list."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV in the output")
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = table[0]
    try:
        columns = [header.index(m) for m in metrics]
    except ValueError:
        raise ValueError(f"ncu CSV lacks {tuple(metrics)}: {header[:8]}...") from None
    name = header.index("Kernel Name") if "Kernel Name" in header else None
    scale, kernels = [1.0] * len(columns), []
    for row in table[1:]:
        if len(row) < len(header):
            continue
        if not row[0].strip():  # the units line
            scale = [_unit(row[c].strip(), header[c]) for c in columns]
            continue
        values = [float(row[c].replace(",", "") or 0.0) * k for c, k in zip(columns, scale)]
        kernels.append(("" if name is None else row[name].split("(")[0].strip(), values))
    return kernels


def _unit(name: str, metric: str) -> float:
    """The factor of ncu's unit ``name`` (an empty one is a plain count); an unknown unit is
    an error: read as 1, nanoseconds became microseconds a thousand times too large."""
    if not name:
        return 1.0
    if name not in UNITS:
        raise ValueError(f"ncu reports {metric} in {name!r}, a unit not in Figure11's UNITS")
    return UNITS[name]


def parse_ncu_csv(text: str) -> tuple[int, float, float, float]:
    """(kernels, DRAM bytes read, DRAM bytes written, bytes written to L2) from ``ncu
    --csv --page raw`` (:func:`ncu_kernels`)."""
    kernels = ncu_kernels(text, METRICS)
    read, written, l2_written = (sum(column) for column in zip(*kernels)) if kernels else (0.0,) * 3
    return len(kernels), read, written, l2_written


def compile_outside(system: str, prefix: Path, args: argparse.Namespace) -> dict[str, str] | str:
    """One inference of ``system`` outside ncu (profile_once.py), its compile bounded by
    --peer-timeout-s, into the caches of the same case and system's timing
    (:func:`paper.peer_caches`, kept): their environment, or why it failed.  After the
    timing it finds the timed compile's graph and autotuning; without one it compiles."""
    caches = paper.peer_caches(prefix, system, args)
    command = [sys.executable, str(CHILD), system, str(prefix)]
    try:
        proc = benchmark._run_child(command, args.peer_timeout_s, caches)
    except benchmark.StepTimeout as e:
        return f"{e} {paper.PEER_TIMEOUT}"
    if proc.returncode != 0:
        return f"exit {proc.returncode}, {benchmark._tail(proc, 2)}"
    return caches


def profile(system: str, prefix: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The ncu columns of one system on one case, or ``profile`` saying why there are none."""
    if not args.device.startswith("cuda"):
        return {"profile": "absent: no CUDA GPU"}
    ncu = args.ncu or shutil.which("ncu")
    if ncu is None:
        return {"profile": "absent: ncu not found (--ncu PATH)"}
    env = dict(PROFILE_ENV)
    if system in COMPILED_OUTSIDE:
        caches = compile_outside(system, prefix, args)
        if isinstance(caches, str):
            return {"profile": f"error: its compile outside ncu {caches}"}
        env.update(caches)
    try:
        proc = benchmark._run_child(ncu_command(ncu, system, prefix), args.profile_timeout_s, env)
    except benchmark.StepTimeout as e:
        return {"profile": f"error: {e}"}
    try:
        kernels, read, written, l2_written = parse_ncu_csv(proc.stdout)
    except ValueError as e:
        return {"profile": f"error: exit {proc.returncode}, {e}: {benchmark._tail(proc, 2)}"}
    if kernels == 0:
        return {"profile": f"error: ncu profiled no kernel: {benchmark._tail(proc, 2)}"}
    return {
        "kernels": kernels,
        "dram_read_bytes": read,
        "dram_write_bytes": written,
        "l2_write_bytes": l2_written,
        "profile": "ncu",
    }


def measure(case: benchmark.Config, todo: list[str], args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Each system's latency line (from figure9_10.csv where it is there) with its ncu
    columns: a welder variant profiled on its build, a baseline on the export.  Where this
    machine lacks the build that figure9_10.csv timed, the tuning cache makes it again and
    the remade build is timed here as well, so that a line's latency and its profile are
    of one plan (the cache may hold another plan than the one timed at an older commit)."""
    for row in paper.case_rows(case, todo, args):
        system = row["system"]
        if row["status"] == "ok" and system in paper.WELDER_VARIANTS:
            try:
                prefix, remade = paper.built_variant(case, system, args)
            except Exception as e:
                row["profile"] = f"error: no build to profile: {benchmark._error(e)}"
                yield row
                continue
            if remade and paper.is_shared(row):
                cell = paper.welder_cell(prefix, system, args)
                row = paper.cell_row(case, system, cell, paper.gpu_folder(args.device))
        if row["status"] != "ok":
            row["profile"] = f"not profiled: {row['status']}"
        elif system in paper.WELDER_VARIANTS:
            row.update(profile(system, prefix, args))
        else:
            row.update(profile(system, paper.export_case(case, args), args))
        yield row


def plot(rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> None:
    systems = paper.shown(SYSTEMS, rows, args)
    for panel in paper.panels(rows, args.out, "figure11"):

        def dram(model: str, system: str, panel: paper.Panel = panel) -> float | None:
            row = panel.row(model, system)
            parts = [paper.number(row, "dram_read_bytes"), paper.number(row, "dram_write_bytes")]
            return None if None in parts else sum(parts) / 1e6  # type: ignore[arg-type]

        def latency(model: str, system: str, panel: paper.Panel = panel) -> float | None:
            row = panel.row(model, system)
            return paper.number(row, "latency_ms") if row is not None and row["status"] == "ok" else None

        def written(model: str, system: str, panel: paper.Panel = panel) -> float | None:
            value = paper.number(panel.row(model, system), "l2_write_bytes")
            return None if value is None else value / 1e6

        fig, axes = panel.figure(4, 13)
        panes = [
            (latency, "latency (ms, log)"),
            (panel.value("kernels"), "kernels per inference (log)"),
            (dram, "DRAM read + written (MB, log)"),
            (written, "written to L2 (MB, log)"),
        ]
        for ax, (value, label) in zip(axes, panes):
            paper.grouped_bars(ax, panel.models, systems, value, ylabel=label, log=True)
        panel.title(axes[0], "Figure 11")
        note = "x: not measured or not profiled (the CSV's status and profile say why)"
        paper.finish(fig, axes, panel.png, note)
        panel.plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = paper.build_parser(__doc__, systems=SYSTEMS)
    parser.add_argument("--ncu", help="Nsight Compute's ncu (default: the one on PATH)")
    parser.add_argument("--profile-timeout-s", type=float, default=240.0, help="cap on one ncu run (240)")
    args = paper.parse_args(parser, argv)
    return paper.run_script(
        args,
        argv,
        NAME,
        FIELDS,
        lambda case, todo: measure(case, todo, args),
        plot,
        SYSTEMS,
        ("latency_ms", "kernels", "dram_read_bytes", "dram_write_bytes", "l2_write_bytes"),
    )


if __name__ == "__main__":
    sys.exit(main())
