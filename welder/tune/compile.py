"""A group's candidates: one kernel per config, compiled by nvcc in as few calls as keep
every core busy.

:func:`prepare_candidates` renders the cost model's configs (a config the code generator
rejects is dropped, never fatal); :func:`compile_candidates` and :func:`submit_compiles`
compile them, halving a call that fails so that one bad candidate costs a few small
compiles, and halving a call that outlives :func:`compile_timeout_s` only once.  The
:class:`Device` protocol is what compiles, runs and times them: a GPU
(:class:`welder.device.gpu.GpuDevice`) or a fake in tests.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from welder.codegen import generate_kernel, sanitize_identifier
from welder.device.gpu import CompileError
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.engine import group_signature
from welder.schedule.group import Group
from welder.tune.phases import Phases

log = logging.getLogger("welder.tune")

CANDIDATE_PREFIX = "welder_c"
_CANDIDATE = re.compile(rf"^{CANDIDATE_PREFIX}(\d+)_")


class Device(Protocol):
    """Where candidates are compiled, run and timed.

    ``compile`` raises :class:`welder.device.gpu.CompileError`, also when it outlives ``timeout_s``
    (the tuner's limit for that call; None: the device's own); ``run`` and ``time`` raise
    :class:`welder.device.gpu.LaunchError` (``KernelTimeout`` included) for a kernel that cannot be
    launched, faults or hangs.  ``inputs`` are the kernel's input parameters in order; ``run``
    returns its outputs in order, or with ``rows`` only those ranges of their first axis (one
    after another: :func:`welder.tune.reference.select_rows`); ``time`` returns the median
    microseconds of one launch, and may stop refining it once it is clearly above
    ``give_up_us``."""

    @property
    def name(self) -> str: ...  # the GPU, as its driver names it

    @property
    def arch(self) -> str: ...  # what kernels are compiled for, e.g. sm_90

    @property
    def compiler(self) -> str: ...  # the compiler's version line

    def compile(self, kernels: Sequence[Any], timeout_s: float | None = None) -> Any: ...

    def run(
        self,
        program: Any,
        kernel: Any,
        inputs: Sequence[np.ndarray],
        rows: Sequence[tuple[int, int]] | None = None,
    ) -> list[np.ndarray]: ...

    def time(
        self, program: Any, kernel: Any, inputs: Sequence[np.ndarray], give_up_us: float | None = None
    ) -> float: ...


@dataclass(frozen=True)
class Dropped:
    candidate: int  # index in the cost model's ranking
    reason: str  # codegen | compile | launch | timeout (nvcc or the kernel) | wrong
    detail: str


def candidate_name(index: int, group: Group) -> str:
    """Kernel name of candidate ``index`` (unique within the group's translation unit)."""
    return f"{CANDIDATE_PREFIX}{index}_{sanitize_identifier(group.root, 32)}"


def candidate_index(kernel_name: str) -> int:
    """Inverse of :func:`candidate_name`."""
    m = _CANDIDATE.match(kernel_name)
    if m is None:
        raise ValueError(f"{kernel_name!r} is not a candidate kernel name")
    return int(m.group(1))


@dataclass
class Candidates:
    """A group's candidate configs, their kernels and, once compiled, their programs."""

    group: Group
    signature: str
    configs: list[GroupConfig]
    kernels: dict[int, Any] = field(default_factory=dict)  # candidate -> codegen.Kernel
    programs: dict[int, Any] = field(default_factory=dict)  # candidate -> compiled program
    dropped: list[Dropped] = field(default_factory=list)

    def drop(self, index: int, reason: str, detail: str) -> None:
        log.warning(
            "group %s: candidate %d dropped (%s): %s", self.group.root, index, reason, one_line(detail)
        )
        self.dropped.append(Dropped(index, reason, detail))
        self.kernels.pop(index, None)
        self.programs.pop(index, None)


def prepare_candidates(graph: Graph, group: Group, configs: Sequence[GroupConfig]) -> Candidates:
    """Render one kernel per config; a config the code generator rejects is dropped."""
    cands = Candidates(group, group_signature(graph, group), list(configs))
    for k, cfg in enumerate(configs):
        try:
            cands.kernels[k] = generate_kernel(graph, group, cfg, candidate_name(k, group))
        except Exception as e:  # a code generator bug must cost one candidate, not the tune
            cands.drop(k, "codegen", f"{type(e).__name__}: {e}")
    return cands


CALLS_PER_WORKER = 1
MIN_KERNELS_PER_CALL = 2
COMPILE_TIMEOUT_BASE_S = 60.0
COMPILE_TIMEOUT_PER_KERNEL_S = 10.0
COMPILE_TIMEOUT_MAX_S = 300.0


def compile_timeout_s(kernels: int) -> float:
    """nvcc's time limit for one call on ``kernels`` candidates.  A healthy call takes
    seconds per kernel, even with every core busy; one that runs for minutes is stuck
    (unrolling gone wild, a compiler bug), and waiting longer only delays the tune."""
    return min(COMPILE_TIMEOUT_MAX_S, COMPILE_TIMEOUT_BASE_S + COMPILE_TIMEOUT_PER_KERNEL_S * kernels)


def compile_candidates(
    device: Device,
    cands: Candidates,
    per_call: int | None = None,
    pool: ThreadPoolExecutor | None = None,
    phases: Phases | None = None,
) -> Candidates:
    """Compile every kernel, in calls of ``per_call`` kernels (default: all in one) when they
    all compile, the calls spread over ``pool`` when given (see :func:`submit_compiles`).
    ``phases`` counts the calls, the kernels and nvcc's seconds (see :meth:`Phases.count`)."""
    if pool is not None:
        return submit_compiles(device, cands, per_call, pool, phases).result()
    for chunk in _chunks(cands, per_call):
        _compile_split(device, cands, chunk, True, phases)
    return cands


def submit_compiles(
    device: Device,
    cands: Candidates,
    per_call: int | None,
    pool: ThreadPoolExecutor,
    phases: Phases | None = None,
) -> Future[Candidates]:
    """Queue every call that compiles ``cands`` on ``pool`` and return at once; the future
    is done when the last call is.  Nothing waits in between: a group's calls take whatever
    of the pool's cores are free, so the model's groups keep every core busy however few
    calls each makes (a thread that waited for its group's calls would cap the compiles
    running at once by the number of such threads)."""
    chunks = _chunks(cands, per_call)
    done: Future[Candidates] = Future()
    if not chunks:
        done.set_result(cands)
        return done
    left = [len(chunks)]
    lock = threading.Lock()

    def finished(call: Future[None]) -> None:
        error = CancelledError() if call.cancelled() else call.exception()
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if error is not None and not done.done():
            with suppress(InvalidStateError):  # another call failed first
                done.set_exception(error)
        elif last and not done.done():
            with suppress(InvalidStateError):
                done.set_result(cands)

    for chunk in chunks:
        pool.submit(_compile_split, device, cands, chunk, True, phases).add_done_callback(finished)
    return done


def _chunks(cands: Candidates, per_call: int | None) -> list[list[int]]:
    """The kernels in as few calls of at most ``per_call`` as there can be, evened out (20
    in calls of at most 19 are two of 10, not 19 and a call of one that pays nvcc's fixed
    second for a single kernel)."""
    indices = sorted(cands.kernels)
    calls = -(-len(indices) // max(1, per_call or len(indices)))
    return [indices[len(indices) * k // calls : len(indices) * (k + 1) // calls] for k in range(calls)]


def kernels_per_call(kernels: int, workers: int) -> int:
    """Candidates per nvcc call when ``kernels`` are to be compiled on ``workers`` cores:
    enough calls (``CALLS_PER_WORKER`` per core) that no core waits for a long one, and no
    fewer than ``MIN_KERNELS_PER_CALL`` kernels each, since every call parses the headers again."""
    return max(MIN_KERNELS_PER_CALL, -(-kernels // (CALLS_PER_WORKER * max(1, workers))))


def ramped_per_call(position: int, per_call: int) -> int:
    """Candidates per nvcc call for the group at ``position`` in a batch compiled with calls
    of ``per_call``: the first groups in smaller calls (``MIN_KERNELS_PER_CALL``, doubling
    with each group).  The tune times groups in order, so at the start of a batch it waits
    for the first group's slowest call, a long one when a few calls hold that group's
    kernels and the other cores start on later groups; in calls of two, the first group
    spreads over the idle cores (the tune's phase ``nvcc, first group``)."""
    return min(per_call, MIN_KERNELS_PER_CALL << min(position, 16))


def _compile_split(
    device: Device,
    cands: Candidates,
    indices: list[int],
    may_split_timeout: bool,
    phases: Phases | None = None,
) -> None:
    """Compile ``indices`` in one call; on failure, compile each half.  A timed-out set is
    split only while ``may_split_timeout``, which the halves of a timed-out set lose: the
    halving that isolates a bad candidate in a few quick compiles would otherwise cost one
    full time limit per level.  The halves of a timed-out set compile at once, each in an
    nvcc of its own: a set too slow for its limit is most often a set of slow kernels, not
    one that hangs, and one after the other its halves waited out two limits (BSRN's ten
    wgmma candidates with a Resize-of-GELU epilogue: 160 s, then 160 s more)."""
    if not indices:
        return
    limit = compile_timeout_s(len(indices))
    start = time.perf_counter()
    try:
        program = device.compile([cands.kernels[i] for i in indices], timeout_s=limit)
    except CompileError as e:
        elapsed = time.perf_counter() - start
        _count_compile(phases, len(indices), elapsed)
        timed_out = _is_compile_timeout(e, elapsed, limit)
        if len(indices) == 1 or (timed_out and not may_split_timeout):
            for i in indices:
                cands.drop(i, "timeout" if timed_out else "compile", str(e))
            return
        if timed_out:
            log.warning(
                "group %s: nvcc did not finish %d candidates within %.0f s; compiling each half once "
                "more, and dropping a half that times out too",
                cands.group.root,
                len(indices),
                limit,
            )
        half = len(indices) // 2
        halves = (indices[:half], indices[half:])
        if timed_out:
            with ThreadPoolExecutor(2, thread_name_prefix="nvcc-half") as both:
                for done in [both.submit(_compile_split, device, cands, h, False, phases) for h in halves]:
                    done.result()
            return
        for h in halves:
            _compile_split(device, cands, h, may_split_timeout, phases)
        return
    _count_compile(phases, len(indices), time.perf_counter() - start)
    for i in indices:
        cands.programs[i] = program


def _count_compile(phases: Phases | None, kernels: int, seconds: float) -> None:
    if phases is not None:
        phases.count("nvcc calls")
        phases.count("nvcc kernels", kernels)
        phases.count("nvcc seconds, all calls", seconds)


def _is_compile_timeout(error: CompileError, elapsed_s: float, limit_s: float) -> bool:
    """nvcc was stopped for time, or (on a device with its own, longer limit) failed only
    after the tuner's limit had passed: either way the set is too slow to halve again."""
    return "did not finish" in str(error) or elapsed_s >= limit_s


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (its lines joined by `` | ``), cut to ``limit`` characters."""
    flat = " | ".join(ln.strip() for ln in text.strip().splitlines() if ln.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
