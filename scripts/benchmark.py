"""Side-by-side latency of welder, PyTorch eager, torch.compile and onnxruntime.

    python scripts/benchmark.py --configs bert:1:fp32,bert:1:fp16 --runs runs/bench \\
        --out runs/bench/benchmark.md --json runs/bench/benchmark.json

For each config (model:batch:dtype) this exports the model if PREFIX does not already
hold the same export, tunes and times welder, then times the peers on the very module the
ONNX came from -- all in one run on one machine, so the ratios compare like with like.
Every system uses the protocol of artifacts/run_torch.py (inputs and outputs on the GPU,
warm-up, CUDA-event or synchronous wall time, median of repeats).  A system that fails
on a model leaves its error in that cell and the run goes on.

Results are written after every config (markdown table to --out and stdout at the end,
rows to --json), so a run cut short still leaves what it measured; rows already in the
--json file for other configs are kept, which lets a long table be filled by several
runs -- each row's ratios still come from one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "artifacts"))
sys.path.insert(0, str(ROOT))

from run_onnxrt import run_onnxrt  # noqa: E402
from run_torch import TimingPlan, load, time_system  # noqa: E402

SYSTEMS = ("welder", "eager", "compile", "onnxruntime")
PEERS = ("eager", "compile", "onnxruntime")
DTYPES = {"fp32": "float32", "fp16": "float16"}
TABLE_MODELS = ("bert", "vit_small_p32", "swin_tiny", "mobilenet_v2", "mobilevit_s", "nerf")


@dataclass(frozen=True)
class Config:
    """One row of the table: a registry model at a batch size and precision."""

    model: str
    batch: int
    dtype: str  # fp32 or fp16

    @classmethod
    def parse(cls, text: str) -> Config:
        """``model:batch:dtype``, e.g. ``bert:64:fp16`` (batch and dtype optional)."""
        parts = text.strip().split(":")
        if not parts[0] or len(parts) > 3:
            raise argparse.ArgumentTypeError(f"expected MODEL:BATCH:DTYPE like bert:1:fp16, got {text!r}")
        batch = int(parts[1]) if len(parts) > 1 and parts[1] else 1
        dtype = parts[2] if len(parts) > 2 else "fp32"
        if dtype not in DTYPES:
            raise argparse.ArgumentTypeError(f"dtype must be fp32 or fp16, got {dtype!r} in {text!r}")
        return cls(parts[0], batch, dtype)

    @property
    def key(self) -> str:
        return f"{self.model}_b{self.batch}_{self.dtype}"


def reference_configs() -> list[Config]:
    """The rows of the reference latency table: every model at batch 1, all but the NeRF
    MLP at batch 64, each in fp32 and fp16."""
    rows = [Config(m, 1, d) for m in TABLE_MODELS for d in DTYPES]
    return rows + [Config(m, 64, d) for m in TABLE_MODELS if m != "nerf" for d in DTYPES]


@dataclass
class Cell:
    """One system's figure for one config: latency, or the error instead."""

    ms: float | None = None
    build_s: float | None = None  # welder tune / torch.compile wall time
    error: str | None = None
    detail: str = ""


@dataclass
class Row:
    config: Config
    cells: dict[str, Cell] = field(default_factory=dict)
    device: str = ""
    date: str = ""
    export_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        cells = {k: Cell(**v) for k, v in data.get("cells", {}).items()}
        return cls(
            Config(**data["config"]),
            cells,
            data.get("device", ""),
            data.get("date", ""),
            data.get("export_s"),
        )


# -- welder: the adapter -------------------------------------------------------------------


@dataclass(frozen=True)
class WelderOptions:
    """How welder is tuned and timed in the benchmark (see run_welder)."""

    topk: int = 20
    tune_args: tuple[str, ...] = ()
    build_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0
    budget_s: float = 10.0
    cuda_graph: bool = True
    cache_dir: Path | None = None


# Times the built runtime in a child process with the peers' protocol: a short probe sizes
# back-to-back runs per CUDA-event pair (~50 ms) and the repeats (<= 30, ~10 s), median.
WELDER_TIMING = """
import sys
from welder.runtime.library import RuntimeLibrary
prefix, graph, budget_ms = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3])
with RuntimeLibrary(prefix) as lib:
    lib.use_cuda_graph(graph)
    lib.run(lib.sample_inputs(0))
    probe = max(lib.time(iters=5, warmup=10).median, 1e-3)
    number = max(1, round(50.0 / probe))
    iters = max(3, min(30, int(budget_ms / (probe * number))))
    print(lib.time(iters=iters, warmup=3, number=number).median)
"""


def run_welder(prefix: Path, options: WelderOptions) -> Cell:
    """Tune and build PREFIX with the welder command line, then time the runtime.  The one
    place that knows how welder is driven: change it here when the commands move.

    Every step runs in a child process, so a kernel that faults cannot poison the CUDA
    context the peers are timed in afterwards; the tuning cache is the run's own
    (``options.cache_dir``), so tune times are cold, as Welder's published ones are."""
    env = {"WELDER_CACHE_DIR": str(options.cache_dir)} if options.cache_dir else {}
    tune = ["tune", str(prefix), "--arch", "auto", "--topk", str(options.topk), *options.tune_args]
    start = time.perf_counter()
    _python(["-m", "welder.cli", *tune], options.timeout_s, env)
    tuned = time.perf_counter()
    _python(["-m", "welder.cli", "build", str(prefix), *options.build_args], options.timeout_s, env)
    built = time.perf_counter()
    accuracy = _accuracy(prefix, env)
    budget_ms = str(1e3 * options.budget_s)
    out = _python(["-c", WELDER_TIMING, str(prefix), "1" if options.cuda_graph else "0", budget_ms], 600, env)
    return Cell(
        ms=float(out.split()[-1]),
        build_s=built - start,
        detail=f"tune {tuned - start:.0f} s + build {built - tuned:.0f} s, topk {options.topk}, {accuracy}"
        + (", CUDA graph" if options.cuda_graph else ""),
    )


def _accuracy(prefix: Path, env: dict[str, str]) -> str:
    """test_acc's verdict and worst metric, so every timing is next to its correctness."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "artifacts" / "test_acc.py"), str(prefix)],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, **env),
        cwd=ROOT,
    )
    verdict = "PASS" if proc.returncode == 0 else "FAIL"
    # Rows of the report end "<max rel err> <limit> PASS|FAIL".
    errors = [
        float(line.split()[-3])
        for line in proc.stdout.splitlines()
        if line.split()[-1:] in (["PASS"], ["FAIL"]) and len(line.split()) >= 4
    ]
    worst = f" (max err {max(errors):.1e})" if errors else ""
    return f"test_acc {verdict}{worst}"


def _python(args: Sequence[str], timeout_s: float, extra_env: dict[str, str] | None = None) -> str:
    """Run this Python with the project importable; stdout, or an error with the tail of
    stderr (where welder explains itself)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **(extra_env or {}))
    try:
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {proc.returncode}: {' / '.join(tail)}")
    return proc.stdout


# -- the peers -----------------------------------------------------------------------------


def run_torch_peers(prefix: Path, systems: Sequence[str], device: str, plan: TimingPlan) -> dict[str, Cell]:
    """Eager and/or compile on one rebuilt module (built once: bert-base takes seconds)."""
    wanted = [s for s in ("eager", "compile") if s in systems]
    if not wanted:
        return {}
    try:
        module, args, _, notes = load(prefix, device)
    except Exception as e:
        return {s: Cell(error=_error(e)) for s in wanted}
    cells = {}
    for system in wanted:
        try:
            timing, compile_s = time_system(system, module, args, device, plan)
            cells[system] = Cell(ms=timing.median_ms, build_s=compile_s, detail="; ".join(notes))
        except Exception as e:
            cells[system] = Cell(error=_error(e))
    del module, args
    _free_gpu()
    return cells


def run_ort_peer(prefix: Path, provider: str | None, plan: TimingPlan) -> Cell:
    try:
        res = run_onnxrt(prefix, provider, plan)
    except Exception as e:
        return Cell(error=_error(e))
    if res.error or res.timing is None:
        return Cell(error=res.error or "no timing", detail=res.system)
    return Cell(ms=res.timing.median_ms, detail=res.system)


def _free_gpu() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


# -- one config ----------------------------------------------------------------------------


def ensure_export(config: Config, runs: Path, options: dict[str, Any]) -> tuple[Path, float | None]:
    """PREFIX for the config, exported unless it already holds this very export;
    returns (prefix, export seconds or None when reused)."""
    from welder.export import SEED, export_onnx, read_export

    prefix = runs / config.key
    if (prefix / "model.onnx").is_file() and (prefix / "export.json").is_file():
        info = read_export(prefix)
        same = (info.model, info.batch, info.dtype, info.options, info.seed)
        if same == (config.model, config.batch, DTYPES[config.dtype], options, SEED):
            return prefix, None
    start = time.perf_counter()
    export_onnx(config.model, prefix, config.batch, config.dtype == "fp16", options=options)
    return prefix, time.perf_counter() - start


def measure_row(config: Config, args: argparse.Namespace, device_name: str) -> Row:
    row = Row(
        config, device=device_name, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    )
    options = args.model_options.get(config.model, {})
    try:
        prefix, row.export_s = ensure_export(config, Path(args.runs), options)
    except Exception as e:
        row.cells = {s: Cell(error=f"export failed: {_error(e)}") for s in args.systems}
        return row
    plan = TimingPlan(budget_s=args.budget_s)
    if "welder" in args.systems:
        try:
            row.cells["welder"] = run_welder(prefix, args.welder)
        except Exception as e:
            row.cells["welder"] = Cell(error=_error(e))
        _log(config, "welder", row.cells["welder"])
    for system, cell in run_torch_peers(prefix, args.systems, args.device, plan).items():
        row.cells[system] = cell
        _log(config, system, cell)
    if "onnxruntime" in args.systems:
        row.cells["onnxruntime"] = run_ort_peer(prefix, args.ort_provider, plan)
        _log(config, "onnxruntime", row.cells["onnxruntime"])
    return row


def _log(config: Config, system: str, cell: Cell) -> None:
    what = f"{cell.ms:.3f} ms" if cell.ms is not None else f"ERROR {cell.error}"
    build = f" (build {cell.build_s:.1f} s)" if cell.build_s is not None else ""
    print(f"[{config.key}] {system}: {what}{build}", file=sys.stderr, flush=True)


# -- the table -----------------------------------------------------------------------------


def _ms(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if cell.error is not None:
        short = cell.error.replace("|", "/").replace("\n", " ")
        return f"error: {short[:60]}{'...' if len(short) > 60 else ''}"
    return f"{cell.ms:.3f}" if cell.ms is not None else "-"


def _speedup(welder: Cell | None, peer: Cell | None) -> str:
    """peer / welder: above 1 means welder is faster."""
    if welder is None or peer is None or welder.ms is None or peer.ms is None or welder.ms <= 0:
        return "-"
    return f"{peer.ms / welder.ms:.2f}x"


def _seconds(cell: Cell | None) -> str:
    return f"{cell.build_s:.0f}" if cell is not None and cell.build_s is not None else "-"


def render_markdown(rows: Sequence[Row], meta: dict[str, str]) -> str:
    """The results table: latencies (ms), welder's speedup over each peer (peer/welder),
    and welder's tune and torch.compile's compile wall time; full errors listed below."""
    ort_name = next(
        (
            r.cells["onnxruntime"].detail
            for r in rows
            if "onnxruntime" in r.cells and r.cells["onnxruntime"].detail
        ),
        "onnxruntime",
    )
    header = (
        f"| model | bs | dtype | welder ms | eager ms | compile ms | {ort_name} ms "
        "| vs eager | vs compile | vs ort | welder tune+build s | compile s |"
    )
    lines = [f"{k}: {v}  " for k, v in meta.items()]
    lines += ["", header, "|" + "---|" * 12]
    for r in rows:
        c = r.cells
        w = c.get("welder")
        lines.append(
            f"| {r.config.model} | {r.config.batch} | {r.config.dtype} | {_ms(w)} | {_ms(c.get('eager'))} "
            f"| {_ms(c.get('compile'))} | {_ms(c.get('onnxruntime'))} | {_speedup(w, c.get('eager'))} "
            f"| {_speedup(w, c.get('compile'))} | {_speedup(w, c.get('onnxruntime'))} | {_seconds(w)} "
            f"| {_seconds(c.get('compile'))} |"
        )
    devices = sorted({r.device for r in rows if r.device})
    if len(devices) > 1:
        lines += [
            "",
            f"Rows were measured on different machines ({', '.join(devices)}): compare within rows.",
        ]
    errors = _error_lines(rows)
    if errors:
        lines += ["", "Errors:", "", *errors]
    lines.append("")
    lines.append(
        "Speedups are peer latency / welder latency (above 1: welder is faster), per row from one run."
    )
    return "\n".join(lines) + "\n"


def _error_lines(rows: Sequence[Row]) -> list[str]:
    """Full error messages, one line per row and message (a failed export fails every
    system of its row with the same message: it is listed once)."""
    lines = []
    for r in rows:
        by_message: dict[str, list[str]] = {}
        for system, cell in r.cells.items():
            if cell.error:
                by_message.setdefault(cell.error, []).append(system)
        lines += [f"- {r.config.key} ({', '.join(systems)}): {msg}" for msg, systems in by_message.items()]
    return lines


def machine_meta(args: argparse.Namespace) -> dict[str, str]:
    """What the table was measured on, for its header."""
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        import torch

        meta["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA GPU)"
        meta["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        meta["device"] = "unknown (no torch)"
    try:
        import onnxruntime as ort

        meta["onnxruntime"] = f"{ort.__version__}, providers {', '.join(ort.get_available_providers())}"
    except ImportError:
        pass
    import welder

    meta["welder"] = f"{welder.__version__} {_git_commit()}".strip()
    meta["protocol"] = "inputs/outputs on the device, warm-up, median of repeats (ms per inference)"
    w = args.welder
    meta["welder"] += f"; tune --arch auto --topk {w.topk} {' '.join(w.tune_args)}".rstrip()
    meta["welder"] += ", runtime replayed as a CUDA graph" if w.cuda_graph else ""
    return meta


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10
        )
        return f"@ {out.stdout.strip()}" if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


# -- persistence ---------------------------------------------------------------------------


def load_rows(path: Path | None) -> dict[str, Row]:
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    rows = [Row.from_dict(r) for r in data.get("rows", [])]
    return {r.config.key: r for r in rows}


def save(rows: dict[str, Row], meta: dict[str, str], args: argparse.Namespace) -> str:
    table = render_markdown(list(rows.values()), meta)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta, "rows": [r.to_dict() for r in rows.values()]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return table


# -- command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--configs",
        type=lambda s: [Config.parse(c) for c in s.split(",") if c.strip()],
        help="comma list of MODEL:BATCH:DTYPE (default: the reference table's 22 rows)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--runs", default="runs/bench", help="folder of the exported models (default runs/bench)")
    p.add_argument("--out", help="write the markdown table here (it is printed either way)")
    p.add_argument("--json", help="rows as JSON; rows of other configs already there are kept")
    p.add_argument("--topk", type=int, default=20, help="welder tune --topk (default 20)")
    p.add_argument(
        "--tune-args",
        default="",
        help="more welder tune flags, joined with '=' since they start with a dash: --tune-args=--skip-dot",
    )
    p.add_argument(
        "--build-args",
        default="",
        help="more welder build flags, joined with '=': --build-args=--emulate (CPU smoke test)",
    )
    p.add_argument("--tune-timeout-s", type=float, default=3600.0, help="cap on one welder step")
    p.add_argument("--no-cuda-graph", action="store_true", help="time welder's runtime without CUDA graphs")
    p.add_argument(
        "--cache-dir", help="welder tuning cache (default: a fresh one per run, so tunes are cold)"
    )
    p.add_argument("--budget-s", type=float, default=10.0, help="measuring time cap per peer (default 10)")
    p.add_argument("--device", help="torch device: cuda (default when present) or cpu (a smoke test only)")
    p.add_argument("--ort-provider", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument(
        "--model-options",
        type=json.loads,
        default={},
        help='JSON of per-model export options, e.g. \'{"nerf": {"points": 262144}}\'',
    )
    p.add_argument("--deadline-s", type=float, help="start no new config after this many seconds")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"benchmark: unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="welder-bench-cache-"))
    args.welder = WelderOptions(
        topk=args.topk,
        tune_args=tuple(args.tune_args.split()),
        build_args=tuple(args.build_args.split()),
        timeout_s=args.tune_timeout_s,
        budget_s=args.budget_s,
        cuda_graph=not args.no_cuda_graph,
        cache_dir=cache,
    )
    if args.device is None:
        args.device = _default_device()
    configs = args.configs or reference_configs()
    meta = machine_meta(args)
    rows = load_rows(Path(args.json) if args.json else None)
    start = time.perf_counter()
    for config in configs:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            print(f"deadline reached: {config.key} and later configs not measured", file=sys.stderr)
            break
        rows[config.key] = measure_row(config, args, meta["device"])
        save(rows, meta, args)
    print(save(rows, meta, args))
    return 0


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
