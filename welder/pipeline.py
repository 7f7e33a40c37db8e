"""``welder tune``: the whole compiler, from an ONNX file to a built runtime.

import -> fuse and choose configs (cost model, or measured on the GPU with the tuning
cache) -> generate kernels -> emit the runtime -> build it -> ``tuned.json``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

import welder
from welder.arch import Arch, get_arch
from welder.check import model_file
from welder.codegen import Kernel
from welder.device.gpu import GpuDevice, gpu_available
from welder.errors import WelderError
from welder.files import write_json
from welder.frontend.onnx import MemoryLimit, import_onnx, load_model
from welder.graph import Graph
from welder.lock import prefix_lock
from welder.runtime.build import build_runtime, check_cuda_arch, find_nvcc
from welder.runtime.emit import emit_runtime, normalize_cuda_arch
from welder.runtime.library import parse_summary
from welder.runtime.spec import generate_laid_out
from welder.schedule.kinds import Options
from welder.schedule.kinds.mma import TF32_KIND
from welder.schedule.plan import Plan, plan_model, tuned_json
from welder.tune.cache import TuningCache
from welder.tune.tuner import tune_model

log = logging.getLogger("welder.tune")


@dataclass
class TuneOptions:
    arch: str = "auto"
    topk: int = 20
    cost_model: bool = False
    nofusion: bool = False
    measure_fusion: bool = False
    skip_dot: bool = False  # matrix products to cuBLAS
    tensor_cores: bool = True  # False: --no-tc, every stage on CUDA cores
    tf32: bool = False  # --tf32: fp32 contractions may run on TF32 tensor cores
    budget_s: float | None = None  # --budget-s: soft limit on the tune's wall time (tune_model)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kernel kinds that may propose configs (the tuning cache keys results by them,
        so TF32 results never stand in for exact fp32 ones)."""
        if not self.tensor_cores:
            return ("simt",)
        return (TF32_KIND.name, *Options.kinds) if self.tf32 else Options.kinds

    @property
    def precision(self) -> str:
        """The arithmetic the fp32 outputs are checked at (``welder.check.THRESHOLDS``);
        ``tuned.json`` records it for test_acc and ``welder check``."""
        return "tf32" if self.tf32 and self.tensor_cores else "fp32"

    cuda_arch: str | None = None  # e.g. "90"; default: the GPU present
    build: bool = True
    input_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    time_runtime: bool = True  # time the built runtime end to end when a GPU is here


@dataclass(frozen=True)
class RuntimeTiming:
    """The built runtime timed end to end through its library, as ``welder run`` does: whole
    inferences, launch gaps included -- what a user gets, unlike the sum of kernels timed
    one by one during tuning."""

    median_us: float
    mean_us: float
    iters: int
    warmup: int

    def describe(self) -> str:
        return (
            f"welder run: median of {self.iters} runs after {self.warmup} warm-up, CUDA events, "
            "inputs on the GPU, each run a CUDA graph replay"
        )


@dataclass
class TuneResult:
    prefix: Path
    graph: Graph
    plan: Plan
    kernels: list[Kernel]
    built: Path | None
    seconds: float  # everything, import to timing (tuned.json: totals.total_seconds)
    notes: list[str]
    build_seconds: float = 0.0
    runtime: RuntimeTiming | None = None

    @property
    def tuning_seconds(self) -> float:
        """Fusion and config search (tuned.json: totals.tuning_seconds)."""
        return self.plan.seconds


def output_folder(model: str | os.PathLike, output: str | os.PathLike | None) -> Path:
    """Where ``tune`` writes: ``output``, the PREFIX folder, or ``<dir>/<stem>`` for an
    ``.onnx`` file (``<dir>`` itself when the file is called model.onnx)."""
    if output:
        return Path(output)
    p = Path(model)
    if p.is_dir():
        return p
    return p.parent if p.name == "model.onnx" else p.with_suffix("")


def tune(
    model: str | os.PathLike,
    out: Path,
    options: TuneOptions,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    """Compile ``model`` into ``out``.  Everything the user gave is checked -- the model
    imports, the arch exists, nvcc supports ``cuda_arch`` -- before ``out`` is created, so
    bad input leaves nothing behind; then ``out`` is locked against a second tune."""
    if options.topk < 1:
        raise WelderError("--topk must be at least 1")
    if options.tf32 and not options.tensor_cores:
        raise WelderError(
            "--tf32 puts fp32 products on tensor cores, which --no-tc rules out; pass one of them"
        )
    if options.budget_s is not None and not options.budget_s > 0:
        raise WelderError(f"--budget-s must be a positive number of seconds, got {options.budget_s}")
    if options.budget_s is not None and options.cost_model:
        raise WelderError("--budget-s limits tuning on the GPU; --cost-model measures nothing")
    start = time.perf_counter()
    notes: list[str] = []
    source = Path(model_file(model))
    proto = load_model(source)
    arch = get_arch(options.arch)
    _check_cuda_arch(options)
    device = MemoryLimit(arch.memory_bytes, f"device memory of the {arch.name} (--arch)")
    graph = planned_import(proto, arch, options.input_shapes, Path(model).stem, device)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WelderError(f"cannot create the output folder {out}: {e.strerror}") from None
    with prefix_lock(out, "welder tune"):
        return _tune_into(out, str(model), source, proto, graph, arch, options, progress, start, notes)


def merge_limit(arch: Arch) -> int:
    """The most output elements of a product merged with its siblings: one wave of 128 x 128
    tiles.  Below it the merge fills SMs the parts leave idle (BERT at batch 1 on the H200:
    0.55 -> 0.43 ms); above it each part fills the GPU alone and the merged output leaves L2
    sooner (BERT at batch 64: 1.5% slower), docs/tensor_cores.md."""
    return arch.sm_count * 128 * 128


def planned_import(
    model: str | os.PathLike | onnx.ModelProto,
    arch: Arch,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    name: str | None = None,
    memory: MemoryLimit | None = None,
) -> Graph:
    """The graph ``welder tune`` plans for ``model`` on ``arch``: imported with the arch's
    :func:`merge_limit`, then :func:`planned_graph`.  Tools that rebuild a tune's groups from
    its ``model.onnx`` take it from here, with ``tuned.json``'s arch, so that they see the
    graph the tune saw."""
    return planned_graph(import_onnx(model, input_shapes, name, memory, merge_limit(arch)))


def planned_graph(graph: Graph) -> Graph:
    """The graph ``tune`` plans: the imported one after the rewrites that change only the
    rounding (docs/frontend.md, "Before scheduling").  They are the compiler's, not the
    import's, which keeps the model's semantics to the last bit."""
    return graph.move_scales_past_products().split_long_reductions()


def _tune_into(
    out: Path,
    model: str,
    source: Path,
    proto: onnx.ModelProto,
    graph: Graph,
    arch: Arch,
    options: TuneOptions,
    progress: Callable[[int, int], None] | None,
    start: float,
    notes: list[str],
) -> TuneResult:
    _place_model(source, proto, out)
    graph.write_json(str(out / "model.json"))
    if options.cost_model:
        plan = plan_model(
            graph,
            arch,
            topk=options.topk,
            nofusion=options.nofusion,
            model=str(model),
            progress=progress,
            skip_dot=options.skip_dot,
            kinds=options.kinds,
        )
    else:
        plan = _tune_on_gpu(graph, arch, options, str(model))
    groups = [(g.group, g.configs[0]) for g in plan.groups]
    kernels = generate_laid_out(graph, groups)
    emit_runtime(out, graph, groups, kernels, options.cuda_arch)
    build_start = time.perf_counter()
    built = _build(out, options, notes)
    build_seconds = time.perf_counter() - build_start
    runtime = _time_built(out, options, notes, plan.measured_kernels_us) if built is not None else None
    doc = tuned_json(plan, graph)
    doc["precision"] = options.precision
    doc["kinds"] = list(options.kinds)  # what proposed the candidates (scripts/ranking.py --rerank)
    generated = iter(kernels)
    for entry in doc["groups"]:
        if entry["library"] is None:
            kernel = next(generated)
            entry["kernel"] = {
                "name": kernel.name,
                "grid": kernel.grid,
                "threads": kernel.threads,
                "smem_bytes": kernel.smem_bytes,
                "source": kernel.source,
            }
    seconds = time.perf_counter() - start
    totals = doc["totals"]
    if runtime is not None:
        totals["measured_runtime_us"] = round(runtime.median_us, 3)
        totals["measured_runtime_mean_us"] = round(runtime.mean_us, 3)
        totals["runtime_timing"] = runtime.describe()
    totals["build_seconds"] = round(build_seconds, 2)
    totals["total_seconds"] = round(seconds, 2)
    write_json(doc, str(out / "tuned.json"))
    return TuneResult(out, graph, plan, kernels, built, seconds, notes, build_seconds, runtime)


def _check_cuda_arch(options: TuneOptions) -> None:
    """A --cuda-arch that is malformed, or that the local nvcc cannot compile for, is an
    error before any tuning (an absent nvcc is a note later: the sources are still made)."""
    arch = normalize_cuda_arch(options.cuda_arch)
    if arch is None or not options.build:
        return
    try:
        nvcc = find_nvcc()
    except WelderError:
        return
    check_cuda_arch(arch, nvcc)


def _place_model(source: Path, proto: onnx.ModelProto, out: Path) -> None:
    """PREFIX must hold model.onnx (test_acc and the session read it there); a model from
    elsewhere is copied in, with its external-data files.  ``proto`` is ``source`` as
    ``load_model`` read it (external data checked to stay inside its folder)."""
    target = out / "model.onnx"
    if target.exists() and source.resolve() == target.resolve():
        return
    if any(
        t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(str(source), load_external_data=False).graph.initializer
    ):
        onnx.save(proto, str(target), save_as_external_data=True, location="model.onnx.data")
    else:
        shutil.copyfile(source, target)


def _tune_on_gpu(graph: Graph, arch: Arch, options: TuneOptions, model: str) -> Plan:
    """Tune on the GPU present with ``arch``'s cost model ranking the candidates.  The GPU need
    not be ``arch``, nor even described in welder.arch: configs are compiled for and measured
    on it all the same, and the tuner says once that the ranking comes from another GPU."""
    if not gpu_available():
        raise WelderError(
            "tuning measures kernels on a GPU and none is usable here (needs pycuda and a "
            "driver); pass --cost-model to choose configs by the cost model instead"
        )
    _log_tuning_to_stderr()
    with GpuDevice() as device:
        return tune_model(
            graph,
            arch,
            topk=options.topk,
            cache=TuningCache(),
            device=device,
            measure_fusion=options.measure_fusion,
            nofusion=options.nofusion,
            model=model,
            progress_stream=sys.stderr,
            skip_dot=options.skip_dot,
            kinds=options.kinds,
            budget_s=options.budget_s,
        )


class _StderrHandler(logging.Handler):
    """Writes to ``sys.stderr`` as it is when a record comes (a StreamHandler keeps the
    stream it was made with, which outlives a redirection or a test's capture)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _Elapsed(logging.Formatter):
    """A message after the seconds since the process started: where a long tune spends its
    time, read from its log alone."""

    def format(self, record: logging.LogRecord) -> str:
        return f"[{record.relativeCreated / 1e3:6.1f} s] {super().format(record)}"


def _log_tuning_to_stderr() -> None:
    """Show the tuner's messages on stderr, unless logging is configured already (then a
    handler of ours would print every message a second time)."""
    logger = logging.getLogger("welder.tune")
    if not logger.hasHandlers():
        handler = _StderrHandler()
        handler.setFormatter(_Elapsed())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _build(out: Path, options: TuneOptions, notes: list[str]) -> Path | None:
    """Build when it can work: cmake and nvcc present, and a GPU or an explicit arch."""
    if not options.build:
        return None
    missing = [] if shutil.which("cmake") else ["cmake"]
    try:
        find_nvcc()
    except WelderError:
        missing.append("nvcc")
    if missing:
        notes.append(f"runtime not built: {' and '.join(missing)} not found; run `welder build` later")
        return None
    if options.cuda_arch is None and shutil.which("nvidia-smi") is None:
        notes.append(
            "runtime not built: no GPU here to build for; rerun with --cuda-arch 90 (your GPU's "
            f"compute capability) or run `welder build {out} --cuda-arch 90`"
        )
        return None
    return build_runtime(out, options.cuda_arch)


RUNTIME_ITERS = 50
RUNTIME_WARMUP = 10
#: What the timing's runs may take together where inferences are long: fifty runs and ten
#: warm-ups of Restormer at batch 64 (1.1 to 1.4 s each) were over a minute of each tune of
#: it, and a median of twenty second-long replays of one CUDA graph is as steady.
RUNTIME_RUNS_S = 30.0
RUNTIME_MIN_ITERS = 5
RUNTIME_MIN_WARMUP = 2
#: How long timing a runtime may take where nothing bounds it better.
RUNTIME_TIMEOUT_S = 600.0
_MEDIAN = re.compile(r"^median (\S+) ms$", re.M)
#: A replay saves each kernel the launch it pays when timed alone, so a runtime comes in under
#: its kernels' sum (0.7-3.7 us a kernel on the H200 at batch 1); over it by more than this
#: share (beyond the spread of a few long kernels' timings: NeRF's seven ran 0.7% over), some
#: kernel is slower in its place than alone, which none of the tuner's choices saw.
RUNTIME_OVER_KERNELS = 0.02


def _time_built(
    out: Path, options: TuneOptions, notes: list[str], kernels_us: float | None
) -> RuntimeTiming | None:
    """The built runtime's end-to-end latency, when a GPU is here to run it; a runtime that
    fails to run is a note, not a failed tune (the build and tuned.json are still good).
    ``kernels_us`` (the plan's kernels, timed one by one) bounds how long that may take."""
    if not options.time_runtime or (options.cost_model and shutil.which("nvidia-smi") is None):
        return None
    iters, warmup = runtime_iterations(kernels_us)
    timeout_s = runtime_timeout_s(kernels_us, iters, warmup)
    log.info(
        "timing the runtime: `welder run %s`, %d runs after %d warm-ups (at most %.0f s)",
        out,
        iters,
        warmup,
        timeout_s,
    )
    try:
        timing = time_runtime(out, iters=iters, warmup=warmup, timeout_s=timeout_s)
    except WelderError as e:
        notes.append(f"runtime not timed: {e}")
        return None
    if kernels_us is not None and timing.median_us > kernels_us * (1 + RUNTIME_OVER_KERNELS):
        notes.append(
            f"the runtime took {timing.median_us:.1f} us, more than its kernels timed one by one "
            f"({kernels_us:.1f} us): some kernel is slower in its place in the run than alone; "
            f"`welder profile {out}` times each step apart and the gap"
        )
    return timing


#: What starting a runtime may take before its first inference: CUDA, the weights, the graph.
RUNTIME_START_S = 120.0


def runtime_iterations(kernels_us: float | None) -> tuple[int, int]:
    """``(iters, warmup)`` for timing a runtime whose kernels take ``kernels_us`` in all:
    ``RUNTIME_ITERS`` and ``RUNTIME_WARMUP`` where those fit in ``RUNTIME_RUNS_S``, else as
    many runs as fit, a sixth of them warm-ups, never under the minimums."""
    if kernels_us is None or kernels_us <= 0:
        return RUNTIME_ITERS, RUNTIME_WARMUP
    runs = int(RUNTIME_RUNS_S / (kernels_us * 1e-6))
    if runs >= RUNTIME_ITERS + RUNTIME_WARMUP:
        return RUNTIME_ITERS, RUNTIME_WARMUP
    warmup = max(RUNTIME_MIN_WARMUP, runs // 6)
    return max(RUNTIME_MIN_ITERS, runs - warmup), warmup


def runtime_timeout_s(
    kernels_us: float | None, iters: int = RUNTIME_ITERS, warmup: int = RUNTIME_WARMUP
) -> float:
    """How long timing a runtime may take: its start, then twenty times the inferences at the
    kernels' own times.  A kernel that hangs only in the runtime (the tuner timed it alone,
    and well) then costs the tune two minutes, not ten."""
    if kernels_us is None:
        return RUNTIME_TIMEOUT_S
    return RUNTIME_START_S + 20 * (iters + warmup) * kernels_us * 1e-6


def time_runtime(
    prefix: Path,
    iters: int = RUNTIME_ITERS,
    warmup: int = RUNTIME_WARMUP,
    timeout_s: float = RUNTIME_TIMEOUT_S,
) -> RuntimeTiming:
    """Time the runtime under ``prefix`` with ``welder run`` in a child process: a kernel
    that faults or hangs there cannot take ``welder tune`` down with it, and this process's
    CUDA state stays as tuning left it."""
    command = [sys.executable, "-m", "welder.cli", "run", str(prefix), "--iters", str(iters)]
    command += ["--warmup", str(warmup)]
    root = str(Path(welder.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise WelderError(f"`welder run {prefix}` did not finish within {timeout_s:.0f} s") from None
    median, summary = _MEDIAN.search(proc.stdout), parse_summary(proc.stdout)
    if proc.returncode != 0 or median is None or summary is None:
        tail = " / ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise WelderError(f"`welder run {prefix}` failed (exit {proc.returncode}): {tail}")
    return RuntimeTiming(1e3 * float(median.group(1)), 1e3 * summary[2], iters, warmup)
