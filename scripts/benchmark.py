"""Side-by-side latency of welder, PyTorch eager, torch.compile and onnxruntime.

    python scripts/benchmark.py --configs bert:1:fp32,bert:1:fp16 --runs runs/bench \\
        --out runs/bench/benchmark.md --json runs/bench/benchmark.json

For each config (model:batch:dtype) this exports the model if PREFIX does not already
hold the same export, tunes and times welder, then times the peers on the very module the
ONNX came from -- all in one run on one machine, so the ratios compare like with like.
The peers are PyTorch eager, torch.compile in its ``reduce-overhead`` (``compile``) and
``max-autotune`` (``compile-max-autotune``) modes, and onnxruntime with the CUDA provider;
an onnxruntime without it leaves its cell ``absent`` rather than timing the CPU.
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
import contextlib
import datetime as dt
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "artifacts"))
sys.path.insert(0, str(ROOT))

from run_onnxrt import PROVIDERS, run_onnxrt  # noqa: E402
from run_torch import CAPTURE_FALLBACK, TORCH_SYSTEMS, TimingPlan, load, tf32_allowed, time_system  # noqa: E402

from welder.export import INPUTS_NPZ  # noqa: E402

SYSTEMS = ("welder", "eager", "compile", "compile-max-autotune", "onnxruntime")
#: The tune's stderr (its log: a line a group tuned, each after the seconds it came at),
#: beside the tuned.json it writes.
TUNE_LOG = "tune.log"
PEERS = ("eager", "compile", "compile-max-autotune", "onnxruntime")
#: Row precisions and the dtype each exports.  ``fp32`` is exact fp32 for every system (torch's
#: TF32 switches off, welder on CUDA cores); ``tf32`` is the same fp32 model with TF32 allowed
#: everywhere (torch's switches on, ``welder tune --tf32``), a row of its own.
DTYPES = {"fp32": "float32", "fp16": "float16", "tf32": "float32"}
#: The precisions of the reference table (tf32 rows come with --tf32).
TABLE_PRECISIONS = ("fp32", "fp16")
TABLE_MODELS = ("bert", "vit_small_p32", "swin_tiny", "mobilenet_v2", "mobilevit_s", "nerf_large")
#: Models whose batch multiplies a point count: the tables run them at batch 1 only.
SINGLE_BATCH = ("nerf", "nerf_large")


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
            choices = ", ".join(DTYPES)
            raise argparse.ArgumentTypeError(f"dtype must be one of {choices}, got {dtype!r} in {text!r}")
        return cls(parts[0], batch, dtype)

    @property
    def key(self) -> str:
        return f"{self.model}_b{self.batch}_{self.dtype}"

    @property
    def text(self) -> str:
        """The ``--configs`` spelling, which ``parse`` reads back."""
        return f"{self.model}:{self.batch}:{self.dtype}"


def reference_configs() -> list[Config]:
    """The rows of the reference latency table: every model at batch 1, all but the NeRF
    MLP at batch 64, each in fp32 and fp16."""
    rows = [Config(m, 1, d) for m in TABLE_MODELS for d in TABLE_PRECISIONS]
    return rows + [Config(m, 64, d) for m in TABLE_MODELS if m not in SINGLE_BATCH for d in TABLE_PRECISIONS]


def with_tf32_twins(configs: Sequence[Config]) -> list[Config]:
    """``configs`` with a tf32 row after every fp32 row (--tf32)."""
    return [t for c in configs for t in ([c, Config(c.model, c.batch, "tf32")] if c.dtype == "fp32" else [c])]


@dataclass
class Cell:
    """One system's figure for one config: latency, or the error instead.  welder's cell
    also holds what its standalone runtime says of itself: main_test's mean, and
    test_acc's verdict with the worst error over the outputs."""

    ms: float | None = None  # device time: back-to-back CUDA-graph replays, no host work inside
    call_ms: float | None = None  # call latency: one call from Python, synchronised
    build_s: float | None = None  # welder tune / torch.compile wall time
    error: str | None = None
    detail: str = ""
    main_test_ms: float | None = None  # main_test's Summary mean: single runs, no CUDA graph
    accuracy: str | None = None  # test_acc: PASS, FAIL, or "error: why it could not run"
    max_error: float | None = None  # test_acc's max(|a-b|/max(|b|,1)) over every output
    # welder's cell: the model's floor on the tuned arch (welder.profile.model_floor): its
    # FLOPs at the best ceiling of each operation against its compulsory DRAM bytes.
    floor_ms: float | None = None
    # Why the system was not run on this machine (onnxruntime without its CUDA provider
    # beside a GPU, welder without a GPU): not a failure of the system, and not timed
    # elsewhere instead, which would compare a CPU with a GPU.
    absent: str | None = None


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
    reference_cache: Path | None = None  # test_acc's onnxruntime outputs (--reference-cache)


# Times the built runtime in a child process with the peers' protocol.  Device time: a
# short probe sizes the back-to-back runs (CUDA-graph replays) per CUDA-event pair (~50 ms)
# and the repeats (<= 30, ~10 s), median.  Call latency: median wall time of single
# synchronised runs on the device buffers (<= 90 of them, half the budget).
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
    device = lib.time(iters=iters, warmup=3, number=number).median
    calls = lib.call_latency(iters=max(3, min(90, int(budget_ms / 2 / probe))), warmup=5).median
    print(device, calls)
"""


def welder_tune_command(prefix: Path, options: WelderOptions) -> list[str]:
    """The ``welder tune`` arguments: ``--arch auto`` and ``--topk`` from --topk unless
    --tune-args names its own (``--tune-args="--arch V100 --topk 20"`` runs the command as
    the issue spells it), then the rest of --tune-args."""
    extra = list(options.tune_args)
    command = ["tune", str(prefix)]
    if not _has_flag(extra, "--arch"):
        command += ["--arch", "auto"]
    if not _has_flag(extra, "--topk"):
        command += ["--topk", str(options.topk)]
    return command + extra


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in args)


def welder_env(options: WelderOptions) -> dict[str, str]:
    """The environment of welder's child steps: the run's tuning cache, when it has one."""
    return {"WELDER_CACHE_DIR": str(options.cache_dir)} if options.cache_dir else {}


def tune_and_build(prefix: Path, options: WelderOptions) -> tuple[float, float]:
    """``welder tune`` then ``welder build`` on PREFIX in child processes; returns their
    wall times in seconds (build 0 when the tune arguments hold --no-build, as a plan-only
    run on a machine without a GPU does)."""
    env = welder_env(options)
    start = time.perf_counter()
    progress(prefix.name, f"welder tune {' '.join(options.tune_args)}".rstrip() + " ...")
    _python(
        ["-m", "welder.cli", *welder_tune_command(prefix, options)], options.timeout_s, env, prefix / TUNE_LOG
    )
    tuned = time.perf_counter()
    progress(prefix.name, f"tuned in {tuned - start:.0f} s")
    if not _has_flag(options.tune_args, "--no-build"):
        _python(["-m", "welder.cli", "build", str(prefix), *options.build_args], options.timeout_s, env)
        progress(prefix.name, f"built in {time.perf_counter() - tuned:.0f} s")
    return tuned - start, time.perf_counter() - tuned


def run_welder(prefix: Path, options: WelderOptions) -> Cell:
    """Tune and build PREFIX with the welder command line, then time the runtime, run its
    main_test and check it with test_acc.  The one place that knows how welder is driven:
    change it here when the commands move.

    Every step runs in a child process, so a kernel that faults cannot poison the CUDA
    context the peers are timed in afterwards; the tuning cache is the run's own
    (``options.cache_dir``), so tune times are cold, as Welder's published ones are."""
    tune_s, build_s = tune_and_build(prefix, options)
    return measure_built(prefix, options, tune_s, build_s)


def measure_built(prefix: Path, options: WelderOptions, tune_s: float, build_s: float) -> Cell:
    """The built runtime under PREFIX: test_acc's verdict, main_test's mean and the
    latency with the peers' protocol, in welder's cell (``tune_s``/``build_s``: what
    building it took, for the cell's record)."""
    env = welder_env(options)
    start = time.perf_counter()
    accuracy = check_accuracy(prefix, env, reference_cache=options.reference_cache)
    progress(prefix.name, f"{accuracy.describe()} in {time.perf_counter() - start:.0f} s")
    # main_test without CUDA graphs: launch by launch, beside the library's graph replays.
    main_test_ms, main_test_error = run_main_test(prefix, ["--no-cuda-graph"])
    budget_ms = str(1e3 * options.budget_s)
    out = _python(["-c", WELDER_TIMING, str(prefix), "1" if options.cuda_graph else "0", budget_ms], 600, env)
    device_ms, call_ms = (float(v) for v in out.split()[-2:])
    floor_ms = model_floor_ms(prefix)
    notes = [f"tune {tune_s:.0f} s + build {build_s:.0f} s", f"topk {options.topk}"]
    notes += [accuracy.describe()] + ([f"main_test: {main_test_error}"] if main_test_error else [])
    return Cell(
        ms=device_ms,
        call_ms=call_ms,
        build_s=tune_s + build_s,
        detail=", ".join(notes) + (", CUDA graph" if options.cuda_graph else ""),
        main_test_ms=main_test_ms,
        accuracy=accuracy.verdict,
        max_error=accuracy.max_error,
        floor_ms=floor_ms,
    )


def model_floor_ms(prefix: Path) -> float | None:
    """The model's floor (ms) on the arch PREFIX was tuned for, None where the tune left no
    model.json to read it from."""
    from welder.errors import WelderError
    from welder.profile import prefix_floor

    try:
        return prefix_floor(prefix).floor_us / 1e3
    except WelderError:
        return None


@dataclass(frozen=True)
class Accuracy:
    """test_acc's answer for a built runtime."""

    verdict: str  # PASS, FAIL, or "error: ..." when the check could not run
    max_error: float | None = None

    def describe(self) -> str:
        worst = f" (max err {self.max_error:.1e})" if self.max_error is not None else ""
        return f"test_acc {self.verdict}{worst}"


def check_accuracy(
    prefix: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
    reference_cache: Path | None = None,
) -> Accuracy:
    """test_acc's verdict and worst metric, read from its JSON report, so every timing is
    next to its correctness; a check that cannot run or finish says why instead.  It runs
    on the export's inputs where PREFIX has them (inputs.npz), whose onnxruntime outputs
    the export's check left in ``reference_cache``, else on seeded random ones."""
    inputs = prefix / INPUTS_NPZ
    with tempfile.TemporaryDirectory(prefix="welder-acc-") as work:
        report = Path(work) / "test_acc.json"
        command = [
            sys.executable,
            str(ROOT / "artifacts" / "test_acc.py"),
            str(prefix),
            "--json",
            str(report),
            *(["--reference-cache", str(reference_cache)] if reference_cache else []),
            *(["--inputs", str(inputs)] if inputs.is_file() else []),
        ]
        try:
            proc = _run_child(command, timeout_s, env)
        except StepTimeout as e:
            return Accuracy(f"error: test_acc {e}")
        if not report.is_file():
            return Accuracy(f"error: test_acc exit {proc.returncode}: {_tail(proc, 2)}")
        doc = json.loads(report.read_text())
    return Accuracy("PASS" if doc["passed"] else "FAIL", float(doc["max_error"]))


def run_main_test(
    prefix: Path, args: Sequence[str] = (), timeout_s: float = 600.0
) -> tuple[float | None, str | None]:
    """(mean ms, None) from the generated main_test's ``Summary: [min, max, mean]`` line
    (its own settings: 100 single runs, each a CUDA graph replay unless ``args`` has
    --no-cuda-graph, as run_welder passes), or (None, why it gave none)."""
    from welder.runtime.layout import main_test_path
    from welder.runtime.library import parse_summary

    binary = main_test_path(prefix)
    if not binary.is_file():
        return None, f"no {binary}"
    try:
        proc = _run_child([str(binary), *args], timeout_s)
    except StepTimeout as e:
        return None, str(e)
    summary = parse_summary(proc.stdout)
    if proc.returncode != 0 or summary is None:
        return None, f"exit {proc.returncode}: {_tail(proc, 2)}"
    return summary[2], None


def _python(
    args: Sequence[str], timeout_s: float, extra_env: dict[str, str] | None = None, log: Path | None = None
) -> str:
    """Run this Python with the project importable; stdout, or an error with the tail of
    stderr (where welder explains itself; written to ``log`` as it comes, where given)."""
    proc = _run_child([sys.executable, *args], timeout_s, extra_env, log)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {_tail(proc, 3)}")
    return proc.stdout


class StepTimeout(RuntimeError):
    """A child step ran past its limit (and was killed)."""


def _run_child(
    command: Sequence[str], timeout_s: float, extra_env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """One child step in the project root, this checkout's welder first on the path.  It
    leads its own process group, so a timeout stops what it started too (nvcc, Inductor's
    compile workers), not the child alone.  With ``log``, stderr goes to that file as it is
    written, so a step killed part way (a timeout, a machine taken back) leaves what it
    said; the result's stderr is the file's text."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **(extra_env or {}))
    with contextlib.ExitStack() as stack:
        stderr = subprocess.PIPE if log is None else stack.enter_context(open(log, "w"))
        proc = stack.enter_context(
            subprocess.Popen(
                list(command),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            proc.communicate()
            raise StepTimeout(f"timed out after {timeout_s:.0f} s") from None
        except BaseException:
            stop_group(proc)
            raise
    if log is not None:
        err = log.read_text(errors="replace")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a child that leads its own process group: SIGTERM first, so that a child of
    ours stops the groups it started in turn (exit_on_sigterm), SIGKILL for what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM (``timeout``'s, a parent's) raises SystemExit, so that the ``finally``
    and ``except`` clauses run and stop the steps this process started in groups of their
    own.  The handler before is restored after: a process that forks workers later (a test
    session) must not hand them one, or their pool's SIGTERM no longer ends them."""
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _tail(proc: subprocess.CompletedProcess[str], lines: int) -> str:
    """The last lines a failed step wrote (stderr, where welder explains itself)."""
    return " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-lines:])


# -- the peers -----------------------------------------------------------------------------


def run_torch_peers(
    prefix: Path, systems: Sequence[str], device: str, plan: TimingPlan, tf32: bool = False
) -> dict[str, Cell]:
    """The torch systems asked for (eager and the torch.compile modes) on one rebuilt
    module (built once: bert-base takes seconds), with torch's TF32 switches set to ``tf32``."""
    wanted = [s for s in TORCH_SYSTEMS if s in systems]
    if not wanted:
        return {}
    try:
        module, args, _, notes = load(prefix, device)
    except Exception as e:
        return {s: Cell(error=_error(e)) for s in wanted}
    cells = {}
    for system in wanted:
        try:
            with tf32_allowed(tf32) as precision:
                timing = time_system(system, module, args, device, plan)
            cells[system] = Cell(
                ms=timing.device.median_ms,
                call_ms=timing.call.median_ms,
                build_s=timing.compile_s,
                detail="; ".join([*notes, precision, *timing.notes]),
            )
        except Exception as e:
            cells[system] = Cell(error=_error(e))
    del module, args
    _free_gpu()
    return cells


def ort_provider_for(device: str, requested: str | None = None) -> str | None:
    """The onnxruntime provider that matches the torch device: CUDA beside a GPU, the CPU
    provider in a CPU run; ``requested`` (--ort-provider) overrides."""
    if requested:
        return requested
    return "cuda" if device.startswith("cuda") else "cpu"


def run_ort_peer(prefix: Path, provider: str | None, plan: TimingPlan) -> Cell:
    """onnxruntime's cell.  A provider this onnxruntime lacks leaves the cell ``absent``
    (saying which providers it has) instead of timing another device."""
    try:
        import onnxruntime as ort

        available = ort.get_available_providers()
        wanted = PROVIDERS.get(provider or "", provider)
        if wanted and wanted not in available:
            return Cell(
                absent=f"{wanted} absent (onnxruntime {ort.__version__} has {', '.join(available)})",
                detail=f"onnxruntime-{provider}",
            )
        res = run_onnxrt(prefix, provider, plan)
    except Exception as e:
        return Cell(error=_error(e))
    if res.error or res.timing is None:
        return Cell(error=res.error or "no timing", detail=res.system)
    # onnxruntime's run is synchronous and not captured: one figure serves both columns.
    ms = res.timing.median_ms
    return Cell(ms=ms, call_ms=ms, detail=res.system)


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


def ensure_export(
    config: Config, runs: Path, options: dict[str, Any], reference_cache: Path | None = None
) -> tuple[Path, float | None]:
    """PREFIX for the config, exported unless it already holds this very export;
    returns (prefix, export seconds or None when reused).  The export's check keeps
    onnxruntime's outputs on PREFIX/inputs.npz in ``reference_cache``, where test_acc finds
    them (:func:`check_accuracy`)."""
    from welder.export import SEED, export_onnx, read_export

    prefix = runs / config.key
    if (prefix / "model.onnx").is_file() and (prefix / "export.json").is_file():
        info = read_export(prefix)
        same = (info.model, info.batch, info.dtype, info.options, info.seed)
        if same == (config.model, config.batch, DTYPES[config.dtype], options, SEED):
            return prefix, None
    start = time.perf_counter()
    progress(config.key, "exporting, checked against onnxruntime ...")
    export_onnx(
        config.model,
        prefix,
        config.batch,
        config.dtype == "fp16",
        options=options,
        reference_cache=reference_cache,
    )
    progress(config.key, f"exported in {time.perf_counter() - start:.0f} s")
    return prefix, time.perf_counter() - start


def measure_row(config: Config, args: argparse.Namespace, device_name: str) -> Row:
    row = Row(
        config, device=device_name, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    )
    options = args.model_options.get(config.model, {})
    try:
        prefix, row.export_s = ensure_export(config, Path(args.runs), options, args.welder.reference_cache)
    except Exception as e:
        row.cells = {s: Cell(error=f"export failed: {_error(e)}") for s in args.systems}
        return row
    plan = TimingPlan(budget_s=args.budget_s)
    tf32 = config.dtype == "tf32"
    if "welder" in args.systems:
        options = replace(args.welder, tune_args=(*args.welder.tune_args, "--tf32")) if tf32 else args.welder
        try:
            row.cells["welder"] = run_welder(prefix, options)
        except Exception as e:
            row.cells["welder"] = Cell(error=_error(e))
        _log(config, "welder", row.cells["welder"])
    for system, cell in run_torch_peers(prefix, args.systems, args.device, plan, tf32).items():
        row.cells[system] = cell
        _log(config, system, cell)
    if "onnxruntime" in args.systems:
        provider = ort_provider_for(args.device, args.ort_provider)
        row.cells["onnxruntime"] = run_ort_peer(prefix, provider, plan)
        _log(config, "onnxruntime", row.cells["onnxruntime"])
    return row


def progress(case: str, what: str) -> None:
    """One step of a case begun or done, on stderr: at batch 64 an export with its
    onnxruntime check, a tune or test_acc each take minutes, and a run cut short by a time
    limit must still say which step it was in."""
    print(f"[{case}] {what}", file=sys.stderr, flush=True)


def _log(config: Config, system: str, cell: Cell) -> None:
    what = f"{cell.ms:.3f} ms" if cell.ms is not None else f"ERROR {cell.error}"
    what += f" (call {cell.call_ms:.3f} ms)" if cell.call_ms is not None else ""
    what = f"absent: {cell.absent}" if cell.absent else what
    build = f" (build {cell.build_s:.1f} s)" if cell.build_s is not None else ""
    progress(config.key, f"{system}: {what}{build}")


# -- the table -----------------------------------------------------------------------------


def _ms(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if cell.absent is not None:
        return "absent"
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
        f"| model | bs | dtype | welder ms | eager ms | compile ms | max-autotune ms | {ort_name} ms "
        "| vs eager | vs compile | vs max-autotune | vs ort | welder tune+build s | compile s "
        "| max-autotune compile s |"
    )
    lines = [f"{k}: {v}  " for k, v in meta.items()]
    lines += ["", header, "|" + "---|" * 15]
    for r in rows:
        c = r.cells
        w = c.get("welder")
        peers = [c.get(p) for p in PEERS]
        compiled, autotune = c.get("compile"), c.get("compile-max-autotune")
        lines.append(
            f"| {r.config.model} | {r.config.batch} | {r.config.dtype} | {_ms(w)} | "
            + " | ".join(_ms(p) for p in peers)
            + " | "
            + " | ".join(_speedup(w, p) for p in peers)
            + f" | {_seconds(w)} | {_seconds(compiled)} | {_seconds(autotune)} |"
        )
    lines += _geomean_lines(rows)
    lines += _call_table(rows)
    lines += _runtime_table(rows)
    devices = sorted({r.device for r in rows if r.device})
    if len(devices) > 1:
        lines += [
            "",
            f"Rows were measured on different machines ({', '.join(devices)}): compare within rows.",
        ]
    errors = _error_lines(rows)
    if errors:
        lines += ["", "Errors:", "", *errors]
    absent = [f"- {r.config.key} ({s}): {c.absent}" for r in rows for s, c in r.cells.items() if c.absent]
    if absent:
        lines += ["", "Not run on this machine:", "", *absent]
    lines.append("")
    lines.append(
        "Speedups are peer latency / welder latency (above 1: welder is faster), per row from one run."
    )
    return "\n".join(lines) + "\n"


def geomean_speedups(rows: Sequence[Row], peer: str = "compile") -> dict[str, tuple[float, list[Row]]]:
    """Per precision: the geometric mean of ``peer``'s device time over welder's, and the
    rows it is taken over -- those where both were timed and welder's runtime did not fail
    test_acc (a wrong answer is no speedup)."""
    by_dtype: dict[str, list[Row]] = {}
    for r in rows:
        w, other = r.cells.get("welder"), r.cells.get(peer)
        if w is None or other is None or not w.ms or not other.ms or w.accuracy == "FAIL":
            continue
        by_dtype.setdefault(r.config.dtype, []).append(r)
    return {
        dtype: (math.exp(statistics.fmean(math.log(r.cells[peer].ms / r.cells["welder"].ms) for r in rs)), rs)
        for dtype, rs in by_dtype.items()
    }


def _geomean_lines(rows: Sequence[Row]) -> list[str]:
    """One line per precision: welder's geometric-mean speedup over torch.compile, and the
    rows that still lose."""
    means = geomean_speedups(rows)
    if not means:
        return []
    lines = ["", "Geometric-mean speedup over torch.compile (device time):", ""]
    for dtype, (mean, rs) in means.items():
        losing = [
            f"{r.config.model} b{r.config.batch} {_speedup(r.cells['welder'], r.cells['compile'])}"
            for r in rs
            if r.cells["compile"].ms < r.cells["welder"].ms
        ]
        lines.append(
            f"- {dtype}: **{mean:.2f}x** over {len(rs)} rows"
            + (f"; behind on {', '.join(losing)}" if losing else "; ahead on every row")
        )
    failed = [r.config.key for r in rows if "welder" in r.cells and r.cells["welder"].accuracy == "FAIL"]
    if failed:
        lines.append(f"- left out, test_acc FAIL: {', '.join(failed)}")
    return lines


def _call_table(rows: Sequence[Row]) -> list[str]:
    """Call latency per system (one call from Python, then a synchronise), and the notes of
    cells whose device time could not be taken the standard way."""
    if not any(c.call_ms is not None for r in rows for c in r.cells.values()):
        return []
    systems = [s for s in SYSTEMS if any(s in r.cells for r in rows)]
    lines = [
        "",
        "Call latency (ms): one call from Python with inputs and outputs on the device, then a "
        "synchronise -- what a user waits per call.  The speedups above use device time.",
        "",
        "| model | bs | dtype | " + " | ".join(systems) + " |",
        "|" + "---|" * (3 + len(systems)),
    ]
    for r in rows:
        calls = [r.cells.get(s) for s in systems]
        figures = [f"{c.call_ms:.3f}" if c is not None and c.call_ms is not None else "-" for c in calls]
        lines.append(
            f"| {r.config.model} | {r.config.batch} | {r.config.dtype} | " + " | ".join(figures) + " |"
        )
    fallbacks = [
        f"- {r.config.key} ({s}): {part.strip()}"
        for r in rows
        for s, c in r.cells.items()
        for part in c.detail.split(";")
        if CAPTURE_FALLBACK in part
    ]
    if fallbacks:
        lines += ["", "Device time taken another way:", "", *fallbacks]
    return lines


def _runtime_table(rows: Sequence[Row]) -> list[str]:
    """welder's runtime on its own: main_test's mean (single runs, no CUDA graph) and
    test_acc's verdict with its worst error, for every row welder ran in."""
    welder_rows = [r for r in rows if "welder" in r.cells]
    if not welder_rows:
        return []
    lines = [
        "",
        "welder's runtime: `main_test` mean (single runs, no CUDA graph), `test_acc` against onnxruntime, "
        "and the model's floor (its FLOPs at the best ceiling of each operation against its compulsory "
        "DRAM bytes, on the tuned arch) beside welder's device time.",
        "",
        "| model | bs | dtype | main_test ms | test_acc | max error | floor ms | welder / floor |",
        "|" + "---|" * 8,
    ]
    for r in welder_rows:
        w = r.cells["welder"]
        main_test = f"{w.main_test_ms:.3f}" if w.main_test_ms is not None else "-"
        verdict = (w.accuracy or "-").replace("|", "/").replace("\n", " ")
        worst = f"{w.max_error:.1e}" if w.max_error is not None else "-"
        floor = f"{w.floor_ms:.3f}" if w.floor_ms is not None else "-"
        over = f"{w.ms / w.floor_ms:.1f}x" if w.floor_ms and w.ms is not None else "-"
        lines.append(
            f"| {r.config.model} | {r.config.batch} | {r.config.dtype} | {main_test} | {verdict} | {worst} "
            f"| {floor} | {over} |"
        )
    return lines


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
    meta["protocol"] = (
        "inputs/outputs on the device, warm-up, median of repeats (ms per inference); device time: "
        "back-to-back replays of a captured CUDA graph between one pair of CUDA events (torch systems "
        "captured in torch.cuda.CUDAGraph, welder's runtime replaying its own graph; onnxruntime: wall "
        "clock of synchronous runs, its one figure in both tables); call latency: one synchronised call "
        "from Python"
    )
    w = args.welder
    meta["welder"] += f"; {' '.join(['welder', *welder_tune_command(Path('PREFIX'), w)])}"
    meta["welder"] += ", runtime replayed as a CUDA graph" if w.cuda_graph else ""
    return meta


def _git_commit(root: Path = ROOT) -> str:
    """The welder commit measured: $WELDER_COMMIT where the tree was copied without its
    history (a GPU machine), else git's HEAD -- marked where the package's tracked files
    differ from it (a tree copied over an older checkout, or uncommitted work), so that a
    table never names a commit it was not measured at."""
    if os.environ.get("WELDER_COMMIT"):
        return f"@ {os.environ['WELDER_COMMIT']}"

    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=root, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return ""
        changed = git("diff", "--quiet", "HEAD", "--", "welder", "scripts", "artifacts").returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"@ {head.stdout.strip()}{' with uncommitted changes' if changed else ''}"


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
        help="more welder tune flags, joined with '=' since they start with a dash: --tune-args=--skip-dot; "
        "--arch or --topk here replace the defaults: --tune-args='--arch V100 --topk 20'",
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
    p.add_argument(
        "--ort-provider",
        choices=("cuda", "cpu"),
        help="default: the torch device's (cuda beside a GPU: the cell says absent when this "
        "onnxruntime has no CUDA provider; cpu with --device cpu)",
    )
    p.add_argument(
        "--model-options",
        type=json.loads,
        default={},
        help='JSON of per-model export options, e.g. \'{"nerf": {"points": 262144}}\'',
    )
    p.add_argument("--deadline-s", type=float, help="start no new config after this many seconds")
    p.add_argument("--tf32", action="store_true", help="add a tf32 row after every fp32 row")
    p.add_argument(
        "--skip-done",
        action="store_true",
        help="leave out configs whose row in --json already has every system's figure (resume a long table)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="measure this many configs at once, each in its own process on its own GPU "
        "(CUDA_VISIBLE_DEVICES) and its own equal share of the cores (default 1); every row "
        "still comes from one process on one GPU",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    with exit_on_sigterm():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"benchmark: unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="welder-bench-cache-"))
    args.welder = welder_options(args, cache)
    if args.device is None:
        args.device = _default_device()
    configs = args.configs or reference_configs()
    configs = with_tf32_twins(configs) if args.tf32 else configs
    meta = machine_meta(args)
    rows = load_rows(Path(args.json) if args.json else None)
    if args.skip_done:
        configs = [c for c in configs if not _done(rows.get(c.key), args.systems)]
    if args.gpus > 1:
        run_on_gpus(configs, args, sys.argv[1:] if argv is None else list(argv), rows, meta)
        print(save(rows, meta, args))
        return 0
    start = time.perf_counter()
    for config in configs:
        if args.deadline_s is not None and time.perf_counter() - start > args.deadline_s:
            print(f"deadline reached: {config.key} and later configs not measured", file=sys.stderr)
            break
        rows[config.key] = measure_row(config, args, meta["device"])
        save(rows, meta, args)
    print(save(rows, meta, args))
    return 0


def _done(row: Row | None, systems: Sequence[str]) -> bool:
    """Every system asked for has its figure in ``row`` (or is absent on this machine)."""
    cells = row.cells if row is not None else {}
    return all(s in cells and (cells[s].ms is not None or cells[s].absent) for s in systems)


# -- several GPUs --------------------------------------------------------------------------

#: Options the parent of run_on_gpus decides per worker (value-taking, then plain flags).
_PARENT_OPTIONS = ("--configs", "--json", "--out", "--gpus", "--deadline-s")
_PARENT_FLAGS = ("--skip-done", "--tf32")


def worker_argv(
    argv: Sequence[str], options: Sequence[str] = _PARENT_OPTIONS, flags: Sequence[str] = _PARENT_FLAGS
) -> list[str]:
    """The command line of one worker: the parent's, less the options (value-taking) and
    flags the parent decides."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif arg not in flags and not any(arg.startswith(f"{o}=") for o in options):
            out.append(arg)
    return out


def core_slices(cores: Sequence[int], n: int) -> list[list[int]]:
    """``cores`` cut into ``n`` equal runs (the remainder left unused), one per worker;
    every worker gets at least one core."""
    share = len(cores) // n
    if share == 0:
        return [[cores[i % len(cores)]] for i in range(n)]
    return [list(cores[i * share : (i + 1) * share]) for i in range(n)]


def gpu_slots(n: int) -> tuple[list[str], list[list[int]]]:
    """The first ``n`` GPUs this process may use (CUDA_VISIBLE_DEVICES's, else 0..n-1) and
    a slice of its cores for each."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = (visible.split(",") if visible else [str(i) for i in range(n)])[:n]
    return gpus, core_slices(sorted(os.sched_getaffinity(0)), len(gpus))


def run_on_gpus(
    configs: Sequence[Config], args: argparse.Namespace, argv: Sequence[str], rows: dict[str, Row], meta: dict
) -> None:
    """Measure ``configs`` ``args.gpus`` at a time: each is a child run of this script on
    one GPU and one slice of the cores, taking the next config when it finishes (the slow
    batch-64 tunes do not hold a queue behind them).  A worker's row joins ``rows`` (and
    the --json file) as it lands; its output goes to ``<config>.log`` beside --json."""
    gpus, slices = gpu_slots(args.gpus)
    logs = Path(args.json).parent if args.json else Path(tempfile.mkdtemp(prefix="welder-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    base = worker_argv(argv)
    parts: dict[str, Path] = {}

    def start(config: Config, worker: int) -> subprocess.Popen[bytes]:
        proc, parts[config.key] = _start_worker(config, base, gpus[worker], slices[worker], logs)
        return proc

    def landed(config: Config, proc: subprocess.Popen[bytes]) -> None:
        rows[config.key] = _landed_row(config, proc, parts[config.key], logs, args.systems)
        save(rows, meta, args)
        for system, cell in rows[config.key].cells.items():
            _log(config, system, cell)

    run_workers(configs, len(gpus), start, landed, args.deadline_s)


def run_workers(
    configs: Sequence[Config],
    slots: int,
    start: Callable[[Config, int], subprocess.Popen[bytes]],
    landed: Callable[[Config, subprocess.Popen[bytes]], None],
    deadline_s: float | None = None,
) -> None:
    """``start(config, slot)`` for each config, ``slots`` at a time, the next started as
    one finishes (``landed(config, proc)`` then), none started after ``deadline_s``.
    Stopped from outside (timeout's SIGTERM, through exit_on_sigterm), the running
    workers are stopped with everything they started."""
    pending, free = list(configs), list(range(slots))
    running: dict[int, tuple[Config, subprocess.Popen[bytes]]] = {}
    begin = time.perf_counter()
    try:
        while pending or running:
            if pending and deadline_s is not None and time.perf_counter() - begin > deadline_s:
                print(f"deadline reached: {', '.join(c.key for c in pending)} not measured", file=sys.stderr)
                pending.clear()
            while pending and free:
                slot, config = free.pop(0), pending.pop(0)
                running[slot] = config, start(config, slot)
            time.sleep(0.5)
            for slot, (config, proc) in list(running.items()):
                if proc.poll() is not None:
                    del running[slot]
                    free.append(slot)
                    landed(config, proc)
    finally:
        for _, proc in running.values():
            stop_group(proc)


def _start_worker(
    config: Config, base: Sequence[str], gpu: str, cores: Sequence[int], logs: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """A child run of this script measuring ``config`` on ``gpu`` and ``cores``, leading its
    own process group; returns it and the JSON file its row lands in."""
    part = logs / f"{config.key}.part.json"
    part.unlink(missing_ok=True)
    command = [sys.executable, __file__, *base, "--configs", config.text, "--json", str(part)]
    with open(logs / f"{config.key}.log", "wb") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu),
            cwd=ROOT,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
            start_new_session=True,
        )
    print(f"[{config.key}] started on GPU {gpu}", file=sys.stderr, flush=True)
    return proc, part


def _landed_row(
    config: Config, proc: subprocess.Popen[bytes], part: Path, logs: Path, systems: Sequence[str]
) -> Row:
    """The row a finished worker wrote, or one whose every cell holds why it wrote none."""
    row = load_rows(part).get(config.key)
    if row is not None:
        return row
    failure = f"worker exit {proc.returncode}: {_log_tail(logs / f'{config.key}.log')}"
    return Row(config, {s: Cell(error=failure) for s in systems})


def _log_tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return " / ".join(text.strip().splitlines()[-lines:])


def welder_options(args: argparse.Namespace, cache: Path | None) -> WelderOptions:
    """How welder runs, from the command line (--tune-args and --build-args are split on
    whitespace: ``--tune-args="--arch V100 --topk 20"``)."""
    return WelderOptions(
        topk=args.topk,
        tune_args=tuple(args.tune_args.split()),
        build_args=tuple(args.build_args.split()),
        timeout_s=args.tune_timeout_s,
        budget_s=args.budget_s,
        cuda_graph=not args.no_cuda_graph,
        cache_dir=cache,
        reference_cache=Path(args.runs).resolve() / "references",
    )


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


if __name__ == "__main__":
    sys.exit(main())
