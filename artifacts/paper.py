"""What the paper's figure and table scripts (artifacts/Figure*/, artifacts/Table*/) share.

Each script measures *cases* -- a registry model at a batch size and precision -- on a set
of *systems* (welder's variants and the baselines), writes one CSV line per case and
system to ``artifacts/results/<GPU>/<name>.csv`` as soon as that system is measured, and
draws its PNG from the whole CSV.  Run again, it skips the lines already there (``--redo``
measures them again, ``--retry-errors`` only the failed ones), so a long reproduction is
filled by several calls of a few minutes each.

Measuring is scripts/benchmark.py's -- its export, its welder adapter (tune, build,
test_acc, main_test, the timing child) and its peers on the timing protocol of
run_torch.py -- so every figure times the systems exactly as the benchmark table does.
This module only adds what the scripts have in common on top: welder's variants in their
own prefixes (a build is reused when its export and tune command are the same), the
persistent tuning cache, the CSV store, the command line and the plots.  matplotlib is
imported only to draw: without it the CSV is written and the script says the PNG was
skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import fcntl
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "scripts", ROOT / "artifacts", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import benchmark  # noqa: E402
from benchmark import Cell, Config  # noqa: E402
from run_torch import CACHE_ENVS, UNCAPTURED, TimingPlan, compile_seconds  # noqa: E402

from welder.export import INPUTS_NPZ, PAPER_MODELS  # noqa: E402

BATCHES = (1, 64)
DTYPES = ("fp32", "fp16")
BASELINES = ("eager", "compile", "compile-max-autotune", "onnxruntime")
#: welder's variants: system name -> the ``welder tune`` flags that make it.
WELDER_VARIANTS: dict[str, tuple[str, ...]] = {
    "welder": (),
    "welder-nofusion": ("--nofusion",),
    "welder-skip-dot": ("--skip-dot",),
    "welder-no-tc": ("--no-tc",),
}
#: Legend names.
LABELS = {
    "welder": "welder",
    "welder-nofusion": "welder --nofusion",
    "welder-skip-dot": "welder --skip-dot (cuBLAS)",
    "welder-no-tc": "welder --no-tc",
    "eager": "PyTorch eager",
    "compile": "torch.compile reduce-overhead",
    "compile-max-autotune": "torch.compile max-autotune",
    "onnxruntime": "onnxruntime",
    "per-op": "one kernel per op",
}
#: The plan a machine without a GPU makes for welder's variants in a smoke run.
CPU_PLAN_ARGS = ("--cost-model", "--arch", "H100", "--no-build")
KEY = ("model", "bs", "dtype", "system")
#: The script whose lines the others take for the same case and system (its welder and
#: baselines are theirs too) rather than timing them again.
SHARED = "figure9_10"
FROM_SHARED = f"from {SHARED}.csv"
#: The columns every script writes, before its own.
COMMON_FIELDS = (*KEY, "status", "latency_ms", "build_s", "detail", "gpu", "date")
LATENCY_FIELDS = (*COMMON_FIELDS, "accuracy", "max_error", "main_test_ms")
BUILD_MARK = "paper_build.json"


# -- cases and systems -----------------------------------------------------------------------


def gpu_folder(device: str) -> str:
    """The results folder's name for this machine: welder.arch's short name of the GPU
    (``H100``), the driver's name made path-safe for a GPU welder does not describe, or
    ``cpu`` for a CPU run."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    from welder.arch import match_gpu_name
    from welder.errors import WelderError

    name = torch.cuda.get_device_name()
    try:
        return match_gpu_name(name).name
    except WelderError:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def script_module(folder: str, stem: str = "run_all") -> ModuleType:
    """artifacts/<folder>/<stem>.py as a module, loaded once: the folders are not packages
    and every figure's script is a run_all.py, so each is loaded by path under a name of its
    own (a tool beside a script imports the script this way, and the tests both)."""
    name = f"{folder.lower()}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / folder / f"{stem}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def cases(args: argparse.Namespace) -> list[Config]:
    """Every (model, batch, dtype) asked for.  The NeRF MLPs run at batch 1 only (their
    batch multiplies two million points), as in the paper; the others are said once."""
    out, left = [], []
    for model in args.models:
        for batch in args.bs:
            if batch > 1 and model in benchmark.SINGLE_BATCH:
                left.append(f"{model}:{batch}")
                continue
            out += [Config(model, batch, dtype) for dtype in args.dtype]
    if left:
        print(f"# batch 1 only for the NeRF MLPs: {', '.join(left)} left out", file=sys.stderr)
    return out


def status_of(cell: Cell) -> str:
    return "absent" if cell.absent else "error" if cell.error else "ok"


def cell_row(case: Config, system: str, cell: Cell, gpu: str) -> dict[str, Any]:
    """A Cell as a CSV line of LATENCY_FIELDS (the error or the reason it was not run in
    ``detail``)."""
    return {
        "model": case.model,
        "bs": case.batch,
        "dtype": case.dtype,
        "system": system,
        "status": status_of(cell),
        "latency_ms": cell.ms,
        "build_s": cell.build_s,
        "detail": cell.absent or cell.error or cell.detail,
        "gpu": gpu,
        "date": now(),
        "accuracy": cell.accuracy,
        "max_error": cell.max_error,
        "main_test_ms": cell.main_test_ms,
    }


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- measuring, on benchmark.py's machinery --------------------------------------------------


def export_case(case: Config, args: argparse.Namespace) -> Path:
    """The case's export under RUNS/exports (kept when already there, as benchmark does)."""
    options = args.model_options.get(case.model, {})
    prefix, _ = benchmark.ensure_export(
        case, Path(args.runs) / "exports", options, args.welder.reference_cache
    )
    return prefix


def variant_prefix(export: Path, system: str, runs: Path) -> Path:
    """RUNS/<system>/<case>: the export copied where this variant of welder is tuned and
    built, so the variants of one case never overwrite each other's runtime."""
    prefix = runs / system / export.name
    prefix.mkdir(parents=True, exist_ok=True)
    if (prefix / "export.json").is_file() and (prefix / "export.json").read_text() == (
        export / "export.json"
    ).read_text():
        return prefix
    for name in ("model.onnx", "export.json"):
        shutil.copy2(export / name, prefix / name)
    (prefix / BUILD_MARK).unlink(missing_ok=True)
    (prefix / INPUTS_NPZ).unlink(missing_ok=True)
    if (export / INPUTS_NPZ).is_file():
        try:  # tens of MB at batch 64, read only
            os.link(export / INPUTS_NPZ, prefix / INPUTS_NPZ)
        except OSError:
            shutil.copy2(export / INPUTS_NPZ, prefix / INPUTS_NPZ)
    return prefix


def welder_options(args: argparse.Namespace, system: str) -> benchmark.WelderOptions:
    """The run's welder options plus the variant's flags (and, without a GPU, the flags of
    a plan-only run from the H100's cost model)."""
    flags = [*args.welder.tune_args, *WELDER_VARIANTS[system]]
    if not args.device.startswith("cuda"):
        flags += CPU_PLAN_ARGS
    return replace(args.welder, tune_args=tuple(flags))


def build_welder(prefix: Path, options: benchmark.WelderOptions) -> tuple[float, float, bool]:
    """Tune and build PREFIX unless it already holds a build of this export with this tune
    command (recorded in PREFIX/paper_build.json); returns (tune s, build s, reused).  The
    other scripts reuse what one built: the same variant of the same case is one build."""
    from welder.runtime.layout import library_path

    command = benchmark.welder_tune_command(prefix, options)
    mark = prefix / BUILD_MARK
    export = (prefix / "export.json").read_text()
    plan_only = benchmark._has_flag(options.tune_args, "--no-build")
    if mark.is_file() and (plan_only or library_path(prefix).is_file()):
        done = json.loads(mark.read_text())
        if done.get("command") == command and done.get("export") == export:
            return float(done["tune_s"]), float(done["build_s"]), True
    mark.unlink(missing_ok=True)
    tune_s, build_s = benchmark.tune_and_build(prefix, options)
    record = {"command": command, "export": export, "tune_s": tune_s, "build_s": build_s, "date": now()}
    mark.write_text(json.dumps(record, indent=1) + "\n")
    return tune_s, build_s, False


def built_variant(case: Config, system: str, args: argparse.Namespace) -> tuple[Path, bool]:
    """RUNS/<system>/<case> holding a build of this welder variant, and whether it was made
    here because it was missing.  A line taken from SHARED's CSV may have been timed on
    another machine, at another commit: the tuning cache makes a build again, but not
    necessarily the plan that line timed, so a caller that profiles a remade build times
    it too."""
    prefix = variant_prefix(export_case(case, args), system, Path(args.runs))
    reused = build_welder(prefix, welder_options(args, system))[2]
    return prefix, not reused


def welder_cell(prefix: Path, system: str, args: argparse.Namespace) -> Cell:
    """One welder variant on PREFIX: built (or reused) and measured as benchmark.py does.
    Without a GPU the plan is made from the H100's cost model and the cell is absent: a
    smoke run exercises the scripts, it times nothing."""
    options = welder_options(args, system)
    try:
        tune_s, build_s, reused = build_welder(prefix, options)
        if not args.device.startswith("cuda"):
            return Cell(absent="no CUDA GPU: plan from the H100 cost model, not timed", build_s=tune_s)
        cell = benchmark.measure_built(prefix, options, tune_s, build_s)
    except Exception as e:
        return Cell(error=benchmark._error(e))
    if reused:
        cell.detail += ", build reused"
    return cell


def measure_case(
    case: Config, systems: Sequence[str], args: argparse.Namespace
) -> Iterator[tuple[str, Cell]]:
    """Every system asked for on one case, welder's variants first and then the peers,
    each (system, cell) yielded as soon as it is measured, so that the caller writes it
    down before the next begins.  A failed export fails each system with its message; a
    failing system leaves its error and the others go on."""
    try:
        export = export_case(case, args)
    except Exception as e:
        for system in systems:
            yield system, Cell(error=f"export failed: {benchmark._error(e)}")
        return
    runs = Path(args.runs)
    for system in systems:
        if system in WELDER_VARIANTS:
            cell = welder_cell(variant_prefix(export, system, runs), system, args)
            benchmark._log(case, system, cell)
            yield system, cell
    for system in (s for s in benchmark.TORCH_SYSTEMS if s in systems):
        cell = torch_peer(export, system, args)
        benchmark._log(case, system, cell)
        yield system, cell
    if "onnxruntime" in systems:
        provider = benchmark.ort_provider_for(args.device, args.ort_provider)
        cell = benchmark.run_ort_peer(export, provider, TimingPlan(budget_s=args.budget_s))
        benchmark._log(case, "onnxruntime", cell)
        yield "onnxruntime", cell


#: How a torch peer's line ends when it ran past --peer-timeout-s.
PEER_TIMEOUT = "(--peer-timeout-s)"


def peer_caches(export: Path, system: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment that puts a torch peer's Inductor and Triton on-disk caches in
    RUNS/inductor/CASE-SYSTEM.  A timing (:func:`torch_peer`) empties the folder first, so
    its compile is a cold one however many cases ran on the machine before (Table 4 takes
    Figure 9's max-autotune line for that reason), while a second compile in the same
    process (the mode without CUDA graphs, where the first mode's callable cannot be
    captured) finds the kernels and autotuning the first made; Figure 11's profile of the
    same case and system then finds them too, and profiles the kernels that were timed
    (Inductor's own keys decide what may be reused)."""
    folder = Path(args.runs) / "inductor" / f"{export.name}-{system}"
    return dict(zip(CACHE_ENVS, (str(folder / "inductor"), str(folder / "triton"))))


def torch_peer(export: Path, system: str, args: argparse.Namespace) -> Cell:
    """One torch system timed by run_torch.py in a process of its own (exact fp32: TF32
    off; Inductor's caches empty at its start, :func:`peer_caches`): every system starts
    cold, a crash stays in its process, and --peer-timeout-s bounds a compile that runs on
    (max-autotune's take minutes), its workers stopped too.  A system stopped after its
    compile was done keeps that compile's time (``build_s``) on its error line."""
    caches = peer_caches(export, system, args)
    for folder in caches.values():
        shutil.rmtree(folder, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="welder-peer-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        command = [sys.executable, str(ROOT / "artifacts" / "run_torch.py"), str(export), "--systems", system]
        command += ["--device", args.device, "--budget-s", str(args.budget_s), "--json", str(out)]
        try:
            proc = benchmark._run_child(command, args.peer_timeout_s, caches, log=log)
        except benchmark.StepTimeout as e:
            compiled = compile_seconds(log.read_text(errors="replace"), system) if log.is_file() else None
            done = f", its compile done in {compiled:.1f} s" if compiled is not None else ""
            return Cell(error=f"{system} {e} {PEER_TIMEOUT}{done}", build_s=compiled)
        if not out.is_file():
            return Cell(error=f"run_torch exit {proc.returncode}: {benchmark._tail(proc, 2)}")
        result = json.loads(out.read_text())[0]
    if result["error"]:
        return Cell(error=result["error"])
    call = result["call"]
    return Cell(
        ms=result["timing"]["median_ms"],
        call_ms=call["median_ms"] if call else None,
        build_s=result["compile_s"],
        detail="; ".join(result["notes"]),
    )


def case_rows(case: Config, todo: Sequence[str], args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The LATENCY_FIELDS lines of ``todo`` on ``case``, each yielded as it lands: taken
    from the SHARED script's CSV where it measured the same system on the same case (so
    the baselines and full welder are timed once for every figure), measured otherwise."""
    gpu = gpu_folder(args.device)
    fresh = []
    for system in todo:
        row = shared_row(case, system, args)
        if row is None:
            fresh.append(system)
        else:
            yield row
    if fresh:  # nothing left to measure: no export either
        for system, cell in measure_case(case, fresh, args):
            yield cell_row(case, system, cell, gpu)


def shared_row(case: Config, system: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """SHARED's measured line of this case and system (read afresh: a worker beside this
    one may have added it), or None when it is not there or --redo or --no-reuse asks
    for a measurement of this script's own.  A torch peer's line that ran past SHARED's
    --peer-timeout-s counts too where that limit is at least this run's: an error, but
    one that bounds the time, and measuring it again would only run out the same clock
    (max-autotune's compiles of the convolutional models take minutes).  (SHARED itself
    never finds its own: it measures only the lines it lacks.)"""
    if args.redo or args.no_reuse:
        return None
    row = ResultsCsv(args.out / f"{SHARED}.csv", LATENCY_FIELDS).get(case, system)
    if row is None or (row["status"] != "ok" and not _bounds(row, args.peer_timeout_s)):
        return None
    return dict(row, detail=f"{row['detail']}; {FROM_SHARED}".lstrip("; "))


def _bounds(row: Mapping[str, Any], limit_s: float) -> bool:
    """Whether ``row`` is a torch peer stopped at --peer-timeout-s of ``limit_s`` or more."""
    found = re.search(rf"timed out after ([0-9.]+) s {re.escape(PEER_TIMEOUT)}", str(row["detail"]))
    return row["status"] == "error" and found is not None and float(found.group(1)) >= limit_s


def is_shared(row: Mapping[str, Any]) -> bool:
    """Whether ``row`` was taken from SHARED's CSV rather than measured by its script."""
    return str(row["detail"]).endswith(FROM_SHARED)


# -- the CSV ---------------------------------------------------------------------------------


class ResultsCsv:
    """One script's results: a CSV of ``fields`` keyed by (model, bs, dtype, system),
    rewritten whole (through a temporary file) after every new line, so an interrupted
    run loses at most the line it was measuring."""

    def __init__(self, path: Path, fields: Sequence[str]) -> None:
        self.path = path
        self.fields = list(fields)
        self._rows = self._read()

    @staticmethod
    def key(row: Mapping[str, Any]) -> tuple[str, ...]:
        return tuple(str(row[k]) for k in KEY)

    def get(self, case: Config, system: str) -> dict[str, str] | None:
        return self._rows.get((case.model, str(case.batch), case.dtype, system))

    def done(self, case: Config, system: str, retry_errors: bool = False) -> bool:
        """Whether the CSV holds this case and system (an error counts unless retried)."""
        row = self.get(case, system)
        return row is not None and not (retry_errors and row["status"] == "error")

    def put(self, row: Mapping[str, Any]) -> None:
        """Add ``row`` to the lines on disk: the workers of a --gpus run share the file, so
        it is read again under a lock and what the others wrote meanwhile is kept."""
        with self._locked():
            self._rows = self._read()
            self._rows[self.key(row)] = {k: _text(row.get(k)) for k in self.fields}
            self.save()

    def _read(self) -> dict[tuple[str, ...], dict[str, str]]:
        rows: dict[tuple[str, ...], dict[str, str]] = {}
        if self.path.is_file():
            with self.path.open(newline="") as f:
                for row in csv.DictReader(f):
                    rows[self.key(row)] = {k: row.get(k) or "" for k in self.fields}
        return rows

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on the results folder (a lock on the folder itself leaves no
        lock file behind)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def drop(self, case: Config, systems: Iterable[str]) -> None:
        for system in systems:
            self._rows.pop((case.model, str(case.batch), case.dtype, system), None)

    def rows(self) -> list[dict[str, str]]:
        return list(self._rows.values())

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        out = io.StringIO()
        writer = csv.DictWriter(out, self.fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self._rows.values())
        tmp = self.path.with_suffix(".csv.tmp")
        tmp.write_text(out.getvalue())
        os.replace(tmp, self.path)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def number(row: Mapping[str, str] | None, field: str) -> float | None:
    """A numeric CSV cell, None when empty or absent."""
    if row is None or not row.get(field):
        return None
    try:
        return float(row[field])
    except ValueError:
        return None


# -- the command line ------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(t) for t in _names(text)]


def build_parser(
    description: str,
    *,
    models: Sequence[str] = PAPER_MODELS,
    batches: Sequence[int] = BATCHES,
    dtypes: Sequence[str] = DTYPES,
    systems: Sequence[str],
    choices: Sequence[str] | None = None,
) -> argparse.ArgumentParser:
    """The options every script takes.  ``systems`` is the default set, ``choices`` what
    --systems may name (default: the same)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    listed = ",".join(map(str, batches))
    p.add_argument("--models", type=_names, default=list(models), help=f"comma list ({','.join(models)})")
    p.add_argument("--bs", type=_ints, default=list(batches), help=f"comma list of batch sizes ({listed})")
    p.add_argument("--dtype", type=_names, default=list(dtypes), help=f"fp32, fp16 ({','.join(dtypes)})")
    p.add_argument("--systems", type=_names, default=list(systems), help=f"comma list ({','.join(systems)})")
    p.set_defaults(system_choices=list(choices or systems))
    p.add_argument("--out", help="results folder (default: artifacts/results/<GPU>, cpu without one)")
    p.add_argument(
        "--runs", default="runs/paper", help="exports and welder builds, reused across scripts (runs/paper)"
    )
    p.add_argument("--cache-dir", help="welder tuning cache (default: welder's persistent one)")
    p.add_argument(
        "--device",
        help="cuda (default when present) or cpu: a smoke run, peers timed on the CPU, welder only planned",
    )
    p.add_argument("--topk", type=int, default=20, help="welder tune --topk (default 20)")
    p.add_argument("--tune-args", default="", help="more welder tune flags for every variant (joined by '=')")
    p.add_argument("--tune-timeout-s", type=float, default=3600.0, help="cap on one welder step (3600)")
    p.add_argument("--budget-s", type=float, default=10.0, help="measuring time cap per system (default 10)")
    p.add_argument("--ort-provider", choices=("cuda", "cpu"), help="default: the device's, absent if missing")
    p.add_argument(
        "--model-options",
        type=json.loads,
        default={},
        help='per-model export options as JSON, e.g. \'{"nerf": {"points": 4096}}\'',
    )
    p.add_argument(
        "--peer-timeout-s", type=float, default=1800.0, help="cap on one torch system with its compile (1800)"
    )
    p.add_argument(
        "--no-reuse", action="store_true", help=f"time every system here, none taken from {SHARED}.csv"
    )
    p.add_argument("--gpus", type=int, default=1, help="cases at once, a GPU and core slice each (1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, help="start no new case after this many seconds")
    p.add_argument("--redo", action="store_true", help="measure the selected cases again though in the CSV")
    p.add_argument("--retry-errors", action="store_true", help="measure again the selected lines that failed")
    p.add_argument("--plot-only", action="store_true", help="draw the PNG from the CSV and measure nothing")
    p.add_argument(
        "--pending", action="store_true", help="list the cases and systems a run would measure, and stop"
    )
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and complete the options: names checked, the device, the results folder, and
    welder's options with the persistent tuning cache unless --cache-dir names another."""
    from welder.export import MODELS

    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    unknown += [d for d in args.dtype if d not in benchmark.DTYPES]
    unknown += [s for s in args.systems if s not in args.system_choices]
    if unknown:
        parser.error(f"unknown model, dtype or system: {', '.join(unknown)}")
    args.device = args.device or benchmark._default_device()
    args.out = Path(args.out) if args.out else ROOT / "artifacts" / "results" / gpu_folder(args.device)
    args.no_cuda_graph = False
    args.build_args = ""
    args.welder = benchmark.welder_options(args, Path(args.cache_dir) if args.cache_dir else None)
    return args


def run_cases(
    args: argparse.Namespace,
    store: ResultsCsv,
    measure: Callable[[Config, list[str]], Iterable[dict[str, Any]]],
) -> None:
    """Measure every case's systems that the CSV lacks, a case at a time, adding each line
    to the CSV as ``measure`` yields it; --deadline-s stops before a new case."""
    start = time.perf_counter()
    for case in cases(args):
        if args.redo:
            store.drop(case, args.systems)
        todo = missing(args, store, case)
        if not todo:
            print(f"[{case.key}] in {store.path.name}, skipped", file=sys.stderr)
            continue
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            print(f"deadline reached: {case.key} and later cases not measured", file=sys.stderr)
            break
        for row in measure(case, todo):
            store.put(row)


def missing(args: argparse.Namespace, store: ResultsCsv, case: Config) -> list[str]:
    """The systems of ``case`` a run with ``args`` measures: those the CSV lacks (or has
    failed, with --retry-errors), every one with --redo."""
    return [s for s in args.systems if args.redo or not store.done(case, s, args.retry_errors)]


def print_pending(args: argparse.Namespace, store: ResultsCsv) -> None:
    """--pending: each case a run with these options would measure, with its systems, a
    line SHARED's CSV would give (no timing of its own) marked so."""
    todo = [(case, systems) for case in cases(args) if (systems := missing(args, store, case))]
    taken = 0
    for case, systems in todo:
        names = []
        for system in systems:
            shared = store.path.stem != SHARED and shared_row(case, system, args) is not None
            taken += shared
            names.append(f"{system} ({FROM_SHARED})" if shared else system)
        print(f"{case.key}: {', '.join(names)}")
    lines = sum(len(s) for _, s in todo)
    print(f"{len(todo)} case(s) to measure, {lines} line(s) ({taken} {FROM_SHARED}), in {store.path}")


def run_on_gpus(args: argparse.Namespace, store: ResultsCsv, argv: Sequence[str]) -> None:
    """The cases with lines to measure, ``args.gpus`` at a time: each a worker run of this
    script narrowed to its case, on one GPU and one slice of the cores, the next case
    taken as one finishes.  The workers share the CSV (ResultsCsv.put); --deadline-s
    stops the handing out of cases, and a stopped parent stops its workers."""
    script = Path(sys.argv[0]).resolve()
    if script.name != "run_all.py":
        raise SystemExit("--gpus needs the script run as a program (python artifacts/<folder>/run_all.py)")
    gpus, slices = benchmark.gpu_slots(args.gpus)
    base = benchmark.worker_argv(argv, options=("--gpus", "--deadline-s"), flags=())
    pending = [c for c in cases(args) if missing(args, store, c)]

    def start(case: Config, worker: int) -> subprocess.Popen[bytes]:
        narrow = ["--models", case.model, "--bs", str(case.batch), "--dtype", case.dtype, "--worker"]
        print(f"[{case.key}] started on GPU {gpus[worker]}", file=sys.stderr, flush=True)
        return subprocess.Popen(
            [sys.executable, str(script), *base, *narrow],
            env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[worker]),
            preexec_fn=lambda cores=slices[worker]: os.sched_setaffinity(0, cores),
            start_new_session=True,
        )

    def landed(case: Config, proc: subprocess.Popen[bytes]) -> None:
        if proc.returncode:
            print(f"[{case.key}] worker exit {proc.returncode}", file=sys.stderr, flush=True)

    benchmark.run_workers(pending, len(gpus), start, landed, args.deadline_s)


def write_meta(args: argparse.Namespace, name: str, argv: Sequence[str] | None) -> None:
    """Append this run's machine, versions, date and command to ``<name>.meta.json``: the
    CSV's lines may come from several runs, each line dated, each run described here."""
    path = args.out / f"{name}.meta.json"
    runs = json.loads(path.read_text()).get("runs", []) if path.is_file() else []
    meta = benchmark.machine_meta(args)
    meta["command"] = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [*runs, meta]}, indent=1) + "\n")


# -- plots -----------------------------------------------------------------------------------


@dataclass
class Panel:
    """One picture of a script's rows: a (dtype, batch) case, its PNG, the models in the
    paper's order, pyplot to draw it with, and the rows by :meth:`ResultsCsv.key`."""

    dtype: str
    bs: str
    png: Path
    models: list[str]
    plt: Any
    cells: Mapping[tuple, Mapping[str, str]]
    gpu: str

    def row(self, model: str, system: str) -> Mapping[str, str] | None:
        return self.cells.get((model, self.bs, self.dtype, system))

    def value(self, field: str, scale: float = 1.0) -> Callable[[str, str], float | None]:
        """A :func:`grouped_bars` value: the numeric ``field`` of (model, system) over ``scale``."""

        def get(model: str, system: str) -> float | None:
            v = number(self.row(model, system), field)
            return None if v is None else v / scale

        return get

    def figure(self, panes: int, height: float) -> tuple[Any, list[Any]]:
        """A figure of ``panes`` stacked axes, wide enough for the models."""
        fig, axes = self.plt.subplots(panes, 1, figsize=(max(8, 1.1 * len(self.models) + 3), height))
        return fig, [axes] if panes == 1 else list(axes)

    def title(self, ax: Any, name: str) -> None:
        ax.set_title(f"{name} -- {self.gpu} {self.dtype}, batch {self.bs}", fontsize=10)


def panels(rows: Sequence[Mapping[str, str]], out: Path, stem: str) -> Iterator[Panel]:
    """A :class:`Panel` per (dtype, batch) of ``rows``, its PNG ``out/<stem>_<dtype>_b<bs>.png``;
    none where matplotlib is missing (``pyplot`` says so).  A panel shows every model of the
    rows, a placeholder where one is not measured yet, but for a model that runs at batch 1
    only (no case to wait for) in a batch-64 panel."""
    cells = {ResultsCsv.key(r): r for r in rows}
    gpu = next((r["gpu"] for r in rows if r["gpu"]), "")
    for dtype, bs in sorted({(r["dtype"], r["bs"]) for r in rows}):
        png = out / f"{stem}_{dtype}_b{bs}.png"
        plt = pyplot(png)
        if plt is None:
            return
        models = [m for m in PAPER_MODELS if any(r["model"] == m for r in rows)]
        models += sorted({r["model"] for r in rows} - set(models))
        if int(bs) > 1:
            models = [m for m in models if m not in benchmark.SINGLE_BATCH]
        yield Panel(dtype, bs, png, models, plt, cells, gpu)


def pyplot(png: Path) -> Any:
    """matplotlib's pyplot on the Agg backend, or None (saying the PNG is skipped) when
    matplotlib cannot be imported: the CSV is the result, the plot its picture."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(
            f"matplotlib cannot be imported ({type(e).__name__}): {png.name} skipped, the CSV is written; "
            "pip install matplotlib to draw it",
            file=sys.stderr,
        )
        return None
    return plt


def geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def grouped_bars(
    ax: Any,
    groups: Sequence[str],
    series: Sequence[str],
    value: Callable[[str, str], float | None],
    *,
    ylabel: str,
    log: bool = False,
    base: float = 0.0,
    labels: Sequence[str] | None = None,
) -> None:
    """Bars of ``value(group, series)`` side by side within each group, drawn from ``base``
    (a speedup's 1x: a slowdown hangs below it) and labelled with their values.  A missing
    value (failed, absent, not measured) is an ``x`` on the axis, so it cannot pass for
    zero.  The legend's entries are square markers in the series' colours (an empty
    series has no bar to lend its colour).  ``labels`` name the groups on the axis (the
    groups themselves by default)."""
    from matplotlib.ticker import FuncFormatter
    from matplotlib.transforms import blended_transform_factory

    width = 0.8 / max(len(series), 1)
    below = blended_transform_factory(ax.transData, ax.transAxes)
    top = 0.0
    for k, name in enumerate(series):
        colour = f"C{k}"
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [value(group, name) for group in groups]
        heights = [h if h is None or h > 0 or not log else None for h in heights]
        bars = [(x, h) for x, h in zip(xs, heights) if h is not None]
        ax.bar([x for x, _ in bars], [h - base for _, h in bars], width, bottom=base, color=colour)
        ax.plot([], [], marker="s", linestyle="", markersize=8, color=colour, label=LABELS.get(name, name))
        for x, h in bars:
            where = "bottom" if h >= base else "top"
            ax.text(x, h, f" {h:.3g} ", ha="center", va=where, rotation=90, fontsize=6)
            top = max(top, h)
        for x, h in zip(xs, heights):
            if h is None:
                ax.text(x, 0.01, "x", transform=below, ha="center", va="bottom", fontsize=7, color=colour)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups if labels is None else labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if not top:
        ax.text(0.5, 0.5, "no values measured", transform=ax.transAxes, ha="center", color="dimgray")
        ax.set_yticks([])
    elif log:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 2.5)  # room for the labels
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
    else:
        ax.set_ylim(top=top * 1.2)
    ax.grid(axis="y", alpha=0.3, which="both")


def _minor_label(v: float, _: int) -> str:
    """Log-axis minor ticks labelled at 2x and 5x their decade, plainly ("0.2", "50")."""
    mantissa = v / 10 ** math.floor(math.log10(v)) if v > 0 else 0.0
    return f"{v:g}" if any(abs(mantissa - m) < 1e-6 for m in (2.0, 5.0)) else ""


def latency_of(rows: Sequence[Mapping[str, str]]) -> dict[tuple[str, str, str, str], float]:
    """(model, bs, dtype, system) -> latency ms, for the lines that measured one."""
    ok = [r for r in rows if r["status"] == "ok" and number(r, "latency_ms")]
    return {ResultsCsv.key(r): float(r["latency_ms"]) for r in ok}


def speedup_figure(
    rows: Sequence[Mapping[str, str]],
    png: Path,
    dtype: str,
    systems: Sequence[str],
    title: str,
    models: Sequence[str] = PAPER_MODELS,
) -> bool:
    """The paper's Figures 9 and 10: per batch size, grouped bars of each system's speedup
    over PyTorch eager (eager / system latency; log scale) per model, and their geometric
    mean, for a system measured on every model of the panel.  Returns whether the PNG was drawn."""
    latency = latency_of(rows)
    batches = sorted({int(r["bs"]) for r in rows if r["dtype"] == dtype})
    if not batches:
        return False
    plt = pyplot(png)
    if plt is None:
        return False
    present = {r["model"] for r in rows if r["dtype"] == dtype}
    order = [m for m in models if m in present] + sorted(present - set(models))
    fig, axes = plt.subplots(len(batches), 1, figsize=(max(8, 1.1 * len(order) + 3), 3.6 * len(batches)))
    axes = [axes] if len(batches) == 1 else list(axes)
    gpu = next((r["gpu"] for r in rows if r["gpu"]), "")
    for ax, batch in zip(axes, batches):
        models_here = [m for m in order if any(r["model"] == m and int(r["bs"]) == batch for r in rows)]
        value = _speedups(latency, models_here, batch, dtype)
        groups = [*models_here, "geomean"]
        faster = [s for s in systems if s != "eager"]  # eager is the line at 1
        starred = {
            r["model"] for r in rows if int(r["bs"]) == batch and r["dtype"] == dtype and _uncaptured(r)
        }
        labels = [f"{g}*" if g in starred else g for g in groups]
        ylabel = "speedup over eager (x, log)"
        grouped_bars(ax, groups, faster, value, ylabel=ylabel, log=True, base=1.0, labels=labels)
        ax.axhline(1.0, color="black", linewidth=0.8, label=f"{LABELS['eager']} (1x)")
        ax.set_ylim(bottom=min(ax.get_ylim()[0], 0.5))
        ax.set_title(f"{title} -- {gpu} {dtype}, batch {batch}", fontsize=10)
    note = "x: no latency (failed, absent or not run; the CSV says why)"
    if any(_uncaptured(r) for r in rows if r["dtype"] == dtype):
        note += (
            ".  *: a torch system's call could not be captured in a CUDA graph; its device time was taken"
            " another way (the CSV says how)"
        )
    finish(fig, axes, png, note)
    plt.close(fig)
    return True


def _uncaptured(row: Mapping[str, str]) -> bool:
    """Whether the line's device time is not a CUDA graph's replays (run_torch.UNCAPTURED)."""
    return any(how in row["detail"] for how in UNCAPTURED)


def finish(fig: Any, axes: Sequence[Any], png: Path, note: str) -> None:
    """One legend above the panels (from the first), a footnote, and the PNG written."""
    handles, labels = axes[0].get_legend_handles_labels()
    # an entry (marker and up to ~30 characters at 8 points) takes about 2.3 inches
    columns = max(1, min(len(labels), 6, int(fig.get_size_inches()[0] / 2.3)))
    fig.legend(handles, labels, loc="upper center", ncol=columns, fontsize=8, frameon=False)
    fig.text(0.01, 0.005, note, fontsize=7, color="dimgray")
    top = 1 - 0.3 / fig.get_size_inches()[1] * (1 + (len(labels) - 1) // columns)
    fig.tight_layout(rect=(0, 0.02, 1, top))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}", file=sys.stderr)


def _speedups(
    latency: Mapping[tuple[str, str, str, str], float], models: Sequence[str], batch: int, dtype: str
) -> Callable[[str, str], float | None]:
    """``value(model or "geomean", system)``: eager latency / the system's.  A system's
    geometric mean is over every model of ``models``; missing one, it has none, so that
    the means side by side are of the same cases."""

    def speedup(model: str, system: str) -> float | None:
        base = latency.get((model, str(batch), dtype, "eager"))
        ms = latency.get((model, str(batch), dtype, system))
        return base / ms if base and ms else None

    def value(group: str, system: str) -> float | None:
        if group == "geomean":  # over the same models for every system, or none at all
            each = [speedup(m, system) for m in models]
            return geomean(each) if each and None not in each else None
        return speedup(group, system)

    return value


def shown(systems: Sequence[str], rows: Sequence[Mapping[str, str]], args: argparse.Namespace) -> list[str]:
    """The systems a picture or table shows: those asked for and those the CSV holds (a
    run narrowed by --systems still draws every line the CSV has)."""
    present = {r["system"] for r in rows}
    return [s for s in systems if s in args.systems or s in present]


def markdown_table(
    rows: Sequence[Mapping[str, str]], systems: Sequence[str], fields: Sequence[str] = ("latency_ms",)
) -> str:
    """The CSV as a table: one line per case, one column per system and field (an
    absent or failed cell says so); for reading the results beside the plot."""
    cases_seen: dict[tuple[str, str, str], dict[str, Mapping[str, str]]] = {}
    for r in rows:
        cases_seen.setdefault((r["model"], r["bs"], r["dtype"]), {})[r["system"]] = r
    head = ["model", "bs", "dtype", *(f"{s} {f}" for s in systems for f in fields)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, bs, dtype), by_system in cases_seen.items():
        cells = []
        for system in systems:
            r = by_system.get(system)
            for f in fields:
                if r is None:
                    cells.append("-")
                elif r["status"] != "ok" and not r.get(f):
                    cells.append(r["status"])
                else:
                    cells.append(r.get(f) or "-")
        lines.append("| " + " | ".join([model, bs, dtype, *cells]) + " |")
    return "\n".join(lines) + "\n"


def run_script(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    name: str,
    fields: Sequence[str],
    measure: Callable[[Config, list[str]], Iterable[dict[str, Any]]],
    plot: Callable[[Sequence[Mapping[str, str]], argparse.Namespace], None],
    systems: Sequence[str],
    table_fields: Sequence[str] = ("latency_ms",),
) -> int:
    """What every script does with its parsed ``args``: measure the cases ``<name>.csv``
    lacks (unless ``--plot-only``, recording the run in ``<name>.meta.json``), then draw
    every line (``plot``) and write them as ``<name>.md`` (``table_fields`` per system).
    ``--pending`` only lists what a run would measure."""
    store = ResultsCsv(args.out / f"{name}.csv", fields)
    if args.plot_only and not store.path.is_file():
        print(f"{name}: no {store.path} to plot: run without --plot-only first", file=sys.stderr)
        return 2
    if args.pending:
        print_pending(args, store)
        return 0
    if not args.plot_only:
        if not args.worker:
            write_meta(args, name, argv)
        with benchmark.exit_on_sigterm():
            if args.gpus > 1:
                run_on_gpus(args, store, sys.argv[1:] if argv is None else list(argv))
            else:
                run_cases(args, store, measure)
    if args.worker:
        return 0
    rows = ResultsCsv(store.path, fields).rows()
    plot(rows, args)
    (args.out / f"{name}.md").write_text(markdown_table(rows, shown(systems, rows, args), table_fields))
    print(f"{store.path}: {len(rows)} lines", file=sys.stderr)
    return 0


# -- the latency scripts (Figures 9, 10a, 10b, Table 5) --------------------------------------


def latency_script(
    name: str,
    description: str,
    argv: Sequence[str] | None,
    *,
    systems: Sequence[str],
    plot: Callable[[Sequence[Mapping[str, str]], argparse.Namespace], None],
    models: Sequence[str] = PAPER_MODELS,
    batches: Sequence[int] = BATCHES,
    dtypes: Sequence[str] = DTYPES,
) -> int:
    """A script that times ``systems`` on every case: ``<name>.csv`` (LATENCY_FIELDS),
    ``<name>.md`` (the same as a table), ``<name>.meta.json`` and the PNGs ``plot``
    draws from the CSV's lines."""
    parser = build_parser(description, models=models, batches=batches, dtypes=dtypes, systems=systems)
    args = parse_args(parser, argv)

    def measure(case: Config, todo: list[str]) -> Iterator[dict[str, Any]]:
        return case_rows(case, todo, args)

    return run_script(args, argv, name, LATENCY_FIELDS, measure, plot, systems)
