"""Time PyTorch eager and torch.compile on the module an ONNX file was exported from.

    python artifacts/run_torch.py runs/bert_b1 [--systems eager,compile,compile-max-autotune] \\
        [--json out.json]

The module is rebuilt from PREFIX/export.json (same registry entry, options and seed, so
the same weights) and timed with the benchmark protocol that every system shares, inputs
and outputs on the GPU, two latencies each:

- device time: the call captured once in a ``torch.cuda.CUDAGraph``, then back-to-back
  replays between one pair of CUDA events, median over repeats -- the GPU's time with no
  host work inside, so a faster host loop never counts as a faster compiler;
- call latency: one call from Python followed by a synchronise, wall clock, median --
  what a user waits per call.

``compile`` is ``torch.compile(mode="reduce-overhead")`` (CUDA graphs),
``compile-max-autotune`` is ``mode="max-autotune"`` (Triton templates and their
autotuning, CUDA graphs too); a compile time is the wall time of the first call, written
to stderr as soon as it is known (``COMPILED``: a parent that stops the process later,
in its timing, keeps it), and noted as a cold compile where Inductor's caches were off or
empty when it started (``cold_note``).  Where
a compiled callable cannot be captured, its mode without CUDA graphs (the same kernels)
is compiled and captured instead, and the notes say so; where no capture works (a forward
that syncs with the host), the device time is the GPU's busy time per call from
torch.profiler, or failing that CUDA events around back-to-back calls, also noted.

This file also holds that protocol (``measure``, the clocks, ``Timing``) for
run_onnxrt.py and scripts/benchmark.py.  torch is imported only where it is used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

# -- the protocol --------------------------------------------------------------------------


class Clock(Protocol):
    """Times a stretch of calls; ``stop`` waits for the work and returns elapsed ms."""

    name: str

    def start(self) -> None: ...

    def stop(self) -> float: ...


class CudaEventClock:
    """CUDA events on the current stream: GPU time, free of Python and launch jitter at
    the ends (the calls in between are still launched from Python, as users run them)."""

    name = "cuda-events"

    def __init__(self) -> None:
        import torch

        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._begin.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return float(self._begin.elapsed_time(self._end))


class WallClock:
    """perf_counter around the calls, after ``sync`` -- for work that is synchronous by
    nature (onnxruntime's run) or on the CPU."""

    name = "wall"

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync or (lambda: None)
        self._t0 = 0.0

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return (time.perf_counter() - self._t0) * 1e3


@dataclass
class Timing:
    """Latency of one inference: median and min over ``repeats`` repeats of ``number``
    back-to-back calls each."""

    median_ms: float
    min_ms: float
    repeats: int
    number: int
    clock: str

    def format(self) -> str:
        return (
            f"{self.median_ms:9.3f} ms  (min {self.min_ms:.3f}, {self.repeats} x {self.number} calls, "
            f"{self.clock})"
        )


@dataclass(frozen=True)
class TimingPlan:
    """Knobs of ``measure``.  Repeats last about ``repeat_ms`` each so that short models
    are not dominated by event resolution; ``budget_s`` caps slow ones (a CPU peer on a
    big batch) while keeping at least ``min_repeats``; warm-up stops after 3 calls once it
    has taken ``warmup_cap_s``."""

    warmup: int = 10
    warmup_s: float = 0.5
    warmup_cap_s: float = 5.0
    repeats: int = 30
    min_repeats: int = 3
    repeat_ms: float = 50.0
    budget_s: float = 15.0


def _repeat(call: Callable[[], object], clock: Clock, number: int) -> float:
    clock.start()
    for _ in range(number):
        call()
    return clock.stop() / number


def _warm_up(call: Callable[[], object], clock: Clock, plan: TimingPlan) -> None:
    """At least ``warmup`` calls and ``warmup_s`` seconds (lazy initialisation, autotuning,
    CUDA-graph recording, clocks ramping up), fewer for slow models."""
    start = time.perf_counter()
    count = 0
    while True:
        _repeat(call, clock, 1)
        count += 1
        elapsed = time.perf_counter() - start
        if count >= plan.warmup and elapsed >= plan.warmup_s:
            return
        if count >= 3 and elapsed >= plan.warmup_cap_s:
            return


def _per_call_ms(call: Callable[[], object], clock: Clock, plan: TimingPlan) -> float:
    """A per-call estimate from a run long enough (a tenth of a repeat) to trust, doubling
    the calls until it is -- one call alone is at the mercy of a single hiccup."""
    number = 1
    while True:
        per_call = _repeat(call, clock, number)
        if per_call * number >= plan.repeat_ms / 10 or per_call * number * 2 > 1e3 * plan.budget_s / 10:
            return max(per_call, 1e-3)
        number *= 2


def measure(call: Callable[[], object], clock: Clock, plan: TimingPlan | None = None) -> Timing:
    """The benchmark protocol: warm up, size the repeats, median of per-call times."""
    plan = plan or TimingPlan()
    _warm_up(call, clock, plan)
    single = _per_call_ms(call, clock, plan)
    number = max(1, round(plan.repeat_ms / single))
    affordable = int(1e3 * plan.budget_s / (single * number))
    repeats = max(plan.min_repeats, min(plan.repeats, affordable))
    samples = [_repeat(call, clock, number) for _ in range(repeats)]
    return Timing(statistics.median(samples), min(samples), repeats, number, clock.name)


# -- the torch peers -----------------------------------------------------------------------


@dataclass
class Result:
    """One system on one model: a timing, or the error that stopped it."""

    system: str
    model: str
    batch: int
    dtype: str
    device: str
    timing: Timing | None = None  # device time (see the module docstring)
    call: Timing | None = None  # call latency
    compile_s: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        what = self.timing.format() if self.timing else f"error: {self.error}"
        what += f"; call {self.call.median_ms:.3f} ms" if self.call else ""
        extra = f"  compile {self.compile_s:.1f} s" if self.compile_s is not None else ""
        return f"{self.system:<16} {self.model} bs{self.batch} {self.dtype}: {what}{extra}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pick_device(requested: str | None) -> str:
    import torch

    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("run_torch: --device cuda, but torch sees no CUDA GPU")
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def clock_for(device: str) -> Clock:
    import torch

    if device.startswith("cuda"):
        return CudaEventClock()
    return WallClock(torch.cuda.synchronize if torch.cuda.is_available() else None)


def load(prefix: str | Path, device: str) -> tuple[Any, tuple[Any, ...], Any, list[str]]:
    """The exported module and its inputs on ``device``, with version warnings."""
    from welder.export import rebuild, version_mismatches

    module, inputs, info = rebuild(prefix)
    args = tuple(v.to(device) for v in inputs.values())
    return module.to(device), args, info, version_mismatches(info)


#: Inductor's switch for its on-disk caches, and the note a compile made with them off
#: carries: its compile time is a cold compile's.
COLD_ENV = "TORCHINDUCTOR_FORCE_DISABLE_CACHES"
COLD_NOTE = "Inductor caches off: a cold compile"
#: Where Inductor and Triton keep their on-disk caches, and the note of a compile that
#: started with both empty: as cold as one with the caches off, but what it compiled and
#: autotuned is there for a second compile in the same process (the mode without CUDA
#: graphs that a failed capture falls back to) to reuse.
CACHE_ENVS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
EMPTY_NOTE = "Inductor caches empty at its start: a cold compile"
#: What every cold compile's note ends with.
COLD = "a cold compile"
#: The line run_torch writes to stderr as soon as a compile is done, so that a parent that
#: stops it later (its timing past a limit) still knows the compile time.
COMPILED = re.compile(r"^# (\S+) compiled in ([0-9.]+) s$", re.M)


def cold_note() -> str | None:
    """The note of a compile starting now, where it is a cold one: Inductor's caches off,
    or both cache folders named and empty."""
    if os.environ.get(COLD_ENV) == "1":
        return COLD_NOTE
    folders = [os.environ.get(name) for name in CACHE_ENVS]
    if all(folders) and not any(Path(f).is_dir() and any(Path(f).iterdir()) for f in folders):
        return EMPTY_NOTE
    return None


def compile_seconds(stderr: str, system: str) -> float | None:
    """``system``'s compile time from run_torch's stderr (COMPILED), None before it was done."""
    found = [float(s) for name, s in COMPILED.findall(stderr) if name == system]
    return found[-1] if found else None


#: The torch.compile systems and their modes.
COMPILE_MODES = {"compile": "reduce-overhead", "compile-max-autotune": "max-autotune"}
TORCH_SYSTEMS = ("eager", *COMPILE_MODES)


def _compiled(module: Any, mode: str) -> Callable[..., object]:
    import torch

    torch._dynamo.reset()  # a fresh compile per model, not one grown across models
    return torch.compile(module, mode=mode)


def _step(fn: Callable[..., object], args: tuple[Any, ...], cudagraphs: bool) -> Callable[[], object]:
    """One inference call.  With CUDA graphs each call starts a new step, which tells
    torch that the previous outputs may be overwritten (as a serving loop would)."""
    import torch

    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if cudagraphs else None

    def call() -> object:
        if mark is not None:
            mark()
        return fn(*args)

    return call


#: What a note says where a system's device time could not be taken by capturing its call
#: (scripts/benchmark.py lists those notes under the table).
CAPTURE_FALLBACK = "could not be captured"
#: What such a note ends with where no capture worked: the GPU's busy time from the
#: profiler, or (no profiler records) CUDA events around calls, which hold the host's
#: launches too.  The paper's figures mark both.
BUSY_TIME = "device time is the GPU's busy time per call (torch.profiler)"
AROUND_CALLS = "device time is CUDA events around calls"
UNCAPTURED = (BUSY_TIME, AROUND_CALLS)
#: The same kernels without torch.compile's own CUDA graphs, for a capture of our own.
UNGRAPHED_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


@dataclass
class SystemTiming:
    """One torch system's figures: device time, call latency, compile seconds, and how the
    device time was taken where the plain capture did not work."""

    device: Timing
    call: Timing
    compile_s: float | None = None
    notes: list[str] = field(default_factory=list)


def captured(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` recorded once in a CUDA graph (after warm-up calls on a side stream, as
    capture requires); returns the graph's replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    return graph.replay


def measure_calls(
    call: Callable[[], object], sync: Callable[[], None], plan: TimingPlan | None = None
) -> Timing:
    """Call latency: wall time of single calls, each followed by ``sync``, after warm-up;
    median of up to ``plan.repeats * 3`` calls within the budget."""
    plan = plan or TimingPlan()
    clock = WallClock(sync)
    _warm_up(call, clock, plan)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < plan.repeats * 3:
        samples.append(_repeat(call, clock, 1))
        if len(samples) >= plan.min_repeats and time.perf_counter() - start > plan.budget_s / 2:
            break
    return Timing(statistics.median(samples), min(samples), len(samples), 1, "wall, one call + synchronize")


def _device_time(call: Callable[[], object], plan: TimingPlan | None) -> Timing:
    """Back-to-back replays of ``call``'s CUDA graph between one pair of CUDA events."""
    timing = measure(captured(call), CudaEventClock(), plan)
    timing.clock = "cuda-events, CUDA graph replays"
    return timing


def busy_ms(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) spans, in the spans' unit / 1000: the time the
    GPU had work, overlapping kernels (several streams) counted once."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e3


def _busy_time(call: Callable[[], object], plan: TimingPlan | None, number: int = 10) -> Timing:
    """Device time of a call that cannot be captured in a CUDA graph: the GPU's busy time
    (kernels, copies, memsets) per call, from torch.profiler's device records over
    ``number`` calls, median of a few repeats.  Unlike CUDA events around the calls, the
    host's launch gaps stay out; so do the small gaps between kernels that a graph replay
    keeps (welder's figure holds them), so this leans, if anything, towards the peer."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    plan = plan or TimingPlan()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < plan.min_repeats or (
        len(samples) < plan.repeats and time.perf_counter() - start < plan.budget_s / 2
    ):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(number):
                call()
            torch.cuda.synchronize()
        spans = [
            (e.time_range.start, e.time_range.end) for e in prof.events() if _gpu_work(e, DeviceType.CUDA)
        ]
        if not spans:
            raise RuntimeError("torch.profiler recorded no GPU work (CUPTI missing?)")
        samples.append(busy_ms(spans) / number)
    return Timing(
        statistics.median(samples), min(samples), len(samples), number, "torch.profiler, GPU busy time"
    )


#: The profiler's device records that are the GPU working; its GPU-side annotations span
#: a region's kernels with the gaps between them, and are left out.
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _gpu_work(event: Any, cuda: Any) -> bool:
    """Whether a torch.profiler event is a kernel, copy or memset (older torch, without
    ``activity_type``: a device event that is not a user annotation)."""
    if event.device_type != cuda:
        return False
    kind = getattr(event, "activity_type", None)
    return kind in GPU_WORK if kind else not getattr(event, "is_user_annotation", False)


def _first_line(e: BaseException) -> str:
    """An exception as its type and the first line of its message, for a note."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _uncaptured_time(call: Callable[[], object], plan: TimingPlan | None, why: str) -> tuple[Timing, str]:
    """The device time of a call no mode could capture, and the note saying how it was taken:
    the profiler's busy time, else CUDA events around back-to-back calls."""
    import torch

    try:
        return _busy_time(call, plan), f"{why}: {BUSY_TIME}"
    except Exception as e:
        torch.cuda.synchronize()
        return measure(call, CudaEventClock(), plan), f"{why}: {AROUND_CALLS} (profiler: {_first_line(e)})"


def time_system(
    system: str, module: Any, args: tuple[Any, ...], device: str, plan: TimingPlan | None = None
) -> SystemTiming:
    """Device time, call latency and compile seconds of one of TORCH_SYSTEMS under
    inference_mode.  On the CPU (a smoke test) both latencies are wall clock."""
    import torch

    if system != "eager" and system not in COMPILE_MODES:
        raise ValueError(f"unknown torch system {system!r}; choose from {', '.join(TORCH_SYSTEMS)}")
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        compile_s, setup = None, []
        if system == "eager":
            call = _step(module, args, False)
        else:
            setup = [note] if (note := cold_note()) else []
            call = _step(_compiled(module, COMPILE_MODES[system]), args, cuda)
            clock = WallClock(sync)
            clock.start()
            call()
            compile_s = clock.stop() / 1e3
            print(f"# {system} compiled in {compile_s:.2f} s", file=sys.stderr, flush=True)
        latency = measure_calls(call, sync, plan)
        if not cuda:
            return SystemTiming(measure(call, clock_for(device), plan), latency, compile_s, setup)
        try:
            return SystemTiming(_device_time(call, plan), latency, compile_s, setup)
        except Exception as e:  # any capture failure falls back, with its reason noted
            why = _first_line(e)
        torch.cuda.synchronize()
        if system == "eager":
            timing, note = _uncaptured_time(call, plan, f"eager {CAPTURE_FALLBACK} ({why})")
            return SystemTiming(timing, latency, compile_s, [*setup, note])
        ungraphed = UNGRAPHED_MODES[COMPILE_MODES[system]]
        try:
            fallback = _step(_compiled(module, ungraphed), args, False)
            note = f"its callable {CAPTURE_FALLBACK} ({why}): device time of mode={ungraphed!r}, captured"
            return SystemTiming(_device_time(fallback, plan), latency, compile_s, [*setup, note])
        except Exception as e:  # a model that syncs with the host (Conformer's lengths) captures in no mode
            why += f"; mode={ungraphed!r}: {_first_line(e)}"
        torch.cuda.synchronize()
        timing, note = _uncaptured_time(call, plan, f"its callable {CAPTURE_FALLBACK} in any mode ({why})")
        return SystemTiming(timing, latency, compile_s, [*setup, note])


def run_systems(
    prefix: str | Path, systems: Sequence[str], device: str, plan: TimingPlan | None = None
) -> list[Result]:
    """Each system in turn on the rebuilt module; a failing system is recorded, not fatal."""
    module, args, info, notes = load(prefix, device)
    results = []
    for system in systems:
        res = Result(f"torch-{system}", info.model, info.batch, info.dtype, device, notes=notes)
        try:
            timing = time_system(system, module, args, device, plan)
            res.timing, res.call, res.compile_s = timing.device, timing.call, timing.compile_s
            res.notes = [*notes, *timing.notes]
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}".strip()
        results.append(res)
    return results


def torch_setup_notes() -> list[str]:
    """The precision switches the peers run with (torch defaults unless ``tf32_allowed``
    set them)."""
    import torch

    return [
        f"torch {torch.__version__}",
        f"matmul tf32={torch.backends.cuda.matmul.allow_tf32}",
        f"cudnn tf32={torch.backends.cudnn.allow_tf32}",
    ]


@contextmanager
def tf32_allowed(allowed: bool) -> Iterator[str]:
    """torch's two TF32 switches (matmul and cuDNN) set to ``allowed`` inside, restored
    after; yields the note that says so.

    torch's defaults mix the two (cuDNN convolutions on TF32, matrix products exact), so a
    peer left at its defaults answers an exact-fp32 question with TF32 convolutions.  The
    benchmark sets both: off for its fp32 rows, on for its tf32 rows (welder ``--tf32``)."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield f"torch matmul and cuDNN tf32={allowed}"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", help="folder written by welder export (model.onnx + export.json)")
    p.add_argument("--systems", default="eager,compile", help=f"comma list of {', '.join(TORCH_SYSTEMS)}")
    p.add_argument("--device", help="cuda (default when present) or cpu (a smoke test, not the protocol)")
    p.add_argument("--budget-s", type=float, default=15.0, help="measuring time cap per system (default 15)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument(
        "--tf32",
        action="store_true",
        help="torch's matmul and cuDNN TF32 switches on (default: off, exact fp32)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from welder.errors import WelderError

    device = pick_device(args.device)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    try:
        with tf32_allowed(args.tf32) as precision:
            results = run_systems(args.prefix, systems, device, TimingPlan(budget_s=args.budget_s))
    except WelderError as e:
        print(f"run_torch: error: {e}", file=sys.stderr)
        return 2
    for res in results:
        res.notes.append(precision)
    for note in [*torch_setup_notes(), *results[0].notes] if results else []:
        print(f"# {note}")
    for res in results:
        print(res.format())
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
