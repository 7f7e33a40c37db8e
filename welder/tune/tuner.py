"""The GPU tuner: compile and time the cost model's top-k configs of each group, keep the
fastest one that computes the right result, and remember it in the tuning cache.

For one group (:func:`tune_group`):

1. look the group up in the cache (by structure, so the twelve layers of a BERT share one
   entry);
2. take the policy's ``topk`` configs and render each as a kernel named ``welder_c<k>_...``;
3. compile all of them in one call (nvcc is slow to start; one translation unit amortises
   that).  If the call fails, halve the set and retry each half, so one bad candidate costs
   a few extra compiles instead of all of them.  A call is limited to
   :func:`compile_timeout_s` (a minute plus seconds per kernel, five minutes at most), and a
   set that timed out is halved once only: a half that times out again is dropped whole,
   so a hanging nvcc costs minutes, not one limit per level of halving;
4. time every compiled candidate on seeded random inputs (weights: the model's own);
5. run the candidates fastest first and compare their outputs with the reference
   interpreter (``max(|a-b| / max(|b|, 1))`` within 1e-4 for fp32, 2e-3 for fp32 that a
   candidate computes on TF32 tensor cores (``--tf32``), 2e-2 for fp16, 1e-1 for bf16 --
   and for an fp32 output computed from fp16 or bf16 values inside the group, see
   :func:`welder.check.output_threshold`); the first that matches wins;
6. store the winner (or a negative entry) in the cache.

A candidate that fails to render, compile, launch, finish in time or match the reference is
dropped with a warning on the ``welder.tune`` logger; it is never fatal.

All device access goes through a :class:`~welder.tune.compile.Device` --
:class:`welder.device.gpu.GpuDevice` on a GPU, a fake in tests -- so everything here runs
without one.  Steps 2-3 are :mod:`welder.tune.compile`'s, 4-5 :mod:`welder.tune.measure`'s;
this module orders them over a model's groups and fusion checks.  :class:`GpuMeasure` makes the tuner
a latency measure for the fusion search, and :func:`tune_model` tunes a whole model into a
:class:`welder.schedule.plan.Plan` whose latencies are measured.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, TextIO

from welder.arch import Arch, match_gpu_name
from welder.check import output_thresholds
from welder.device.gpu import GpuDevice
from welder.errors import WelderError
from welder.graph import Graph
from welder.hostcpu import usable_cores
from welder.schedule.config import GroupConfig
from welder.schedule.engine import CostModel, canonical_names, downstream_within, fuse, group_signature
from welder.schedule.group import Group, InvalidGroup, execution_order, make_group
from welder.schedule.kinds import SEARCH_VERSION, Options, config_from_json
from welder.schedule.kinds.library import LibraryGroup, find_gemm_groups
from welder.schedule.kinds.mma import config_precision
from welder.schedule.plan import Plan, PlannedGroup, SplitFailure, library_planned, traffic_of
from welder.tune.cache import CacheKey, TuningCache
from welder.tune.compile import (
    Candidates,
    Device,
    Dropped,
    compile_candidates,
    kernels_per_call,
    prepare_candidates,
    ramped_per_call,
    submit_compiles,
)
from welder.tune.measure import (
    CHECK_CHANGED,
    HostSide,
    drop_summary,
    first_correct,
    group_inputs,
    time_candidates,
)
from welder.tune.phases import Phases, watch
from welder.tune.plan_cache import CachedPlan, Unfused, plan_key
from welder.tune.reference import Reference, reference
from welder.tune.search import SearchProcess

log = logging.getLogger("welder.tune")

# A fused group measuring this many times its predicted latency has its fusion re-checked
# on the GPU (see _ModelTuner.checked), at most VERIFY_DEPTH levels deep.  The kinds' median
# measured/predicted is 1.2-1.4 on the H100 (docs/results.md), so 1.4 checks the tail: at 2,
# BERT's fp32 softmax fused with the PV product (416 us measured, 227 predicted) went
# unchecked, though its two parts apart are predicted at 81 us together; at 1.5, Conformer's
# depthwise convolution fused with the GLU before it (b64 fp16, H200) was checked and split
# at 156.0 us against 103.7 predicted, and kept at 154.9 us, a 60% slower kernel than its
# two parts apart (96.3 us).
VERIFY_RATIO = 1.4
VERIFY_DEPTH = 3
# A fusion check tunes the shallower groups it weighs on the cost model's first CHECK_TOPK
# configs alone, and compares them with the fused group's best among its own first
# CHECK_TOPK, so that the verdict is fair; the groups a check keeps are then tuned on to the
# full topk.  Most checks keep the fusion (29 of 40 on mobilevit_s at batch 64), and their
# shallower groups were more than half of all candidates compiled at --topk 20.
CHECK_TOPK = 8
#: Configs a group tunes once the tune's time budget (``tune_model(budget_s=...)``) is spent.
BUDGET_TOPK = 3
# Threads making groups' inputs and references (numpy: they release the GIL), and how many
# groups ahead of the one being timed they work; each group ahead holds its arrays.
HOST_THREADS = 2
HOST_LOOKAHEAD = 4
# Threads generating candidates' code (Python, so more would only contend for the GIL).
CODEGEN_THREADS = 4
# How often the timing thread, waiting for a compile, looks for groups the search has settled.
FEED_POLL_S = 0.05
# A tune quiet for this long says what it waits on (phases.watch).  Restormer b1 fp32's
# --nofusion tune went silent for 270 s on the H200 before a call's limit stopped it, and its
# log could not say where.
WATCH_S = 60.0


class TuneError(WelderError):
    """A node has no candidate that compiles, runs and computes the right result."""


@dataclass
class TunedConfig:
    """The outcome of tuning one group: the winning config in the group's own names."""

    signature: str
    config: GroupConfig
    latency_us: float  # measured
    candidates: int  # configs tried
    from_cache: bool = False
    dropped: list[Dropped] = field(default_factory=list)
    timings_us: dict[int, float] = field(default_factory=dict)  # candidate -> median
    #: The configs tried, by rank, in the group's canonical names (none from the cache).
    ranked: dict[int, GroupConfig] = field(default_factory=dict)


# -- the cache ------------------------------------------------------------------------------------


def cache_key(
    signature: str,
    arch: Arch,
    device: Device,
    kinds: Sequence[str] = Options.kinds,
    version: int = SEARCH_VERSION,
) -> CacheKey:
    """The key of a group's tuning result; the kernel kinds that proposed the candidates are
    part of it (a tune without tensor cores must not reuse one with them), and so is the
    search's version (:data:`~welder.schedule.kinds.SEARCH_VERSION`): results from a
    search that offered the group fewer candidates are tuned again."""
    search = f"{arch.name}/{'+'.join(kinds)}/s{version}"
    return CacheKey(signature, search, device.name, device.compiler)


def group_cache_key(graph: Graph, group: Group, arch: Arch, device: Device, kinds: Sequence[str]) -> CacheKey:
    """:func:`cache_key` of ``group`` in ``graph``, at the search's current version."""
    return cache_key(group_signature(graph, group), arch, device, kinds, SEARCH_VERSION)


def _to_canonical(cfg: GroupConfig, group: Group) -> GroupConfig:
    return cfg.renamed(canonical_names(group))


def _from_canonical(cfg: GroupConfig, group: Group) -> GroupConfig:
    return cfg.renamed({v: k for k, v in canonical_names(group).items()})


def _cached(
    cache: TuningCache | None, key: CacheKey, group: Group, topk: int
) -> tuple[bool, TunedConfig | None]:
    """(hit, result): a hit with result None is a negative entry."""
    hit, result, _ = _cached_entry(cache, key, group, topk)
    return hit, result


def _cached_entry(
    cache: TuningCache | None, key: CacheKey, group: Group, topk: int
) -> tuple[bool, TunedConfig | None, int]:
    """(hit, result, how far down the ranking the entry looked); see :func:`_cached`.  A
    negative entry written before the check's inputs last changed (:data:`CHECK_CHANGED`)
    is a miss: its candidates are tried again."""
    if cache is None:
        return False, None, 0
    entry = cache.get(key)
    if entry is None or not entry.satisfies(topk) or (entry.negative and entry.created < CHECK_CHANGED):
        return False, None, 0
    if entry.config is None or entry.latency_us is None:
        return True, None, entry.topk
    try:
        cfg = _from_canonical(config_from_json(entry.config), group)
    except (KeyError, TypeError, ValueError) as e:
        log.warning("group %s: ignoring an unreadable cache entry (%s)", group.root, e)
        return False, None, 0
    result = TunedConfig(key.signature, cfg, entry.latency_us, entry.candidates, from_cache=True)
    return True, result, entry.topk


def _store(
    cache: TuningCache | None, key: CacheKey, group: Group, result: TunedConfig | None, tried: int, topk: int
) -> None:
    if cache is None:
        return
    if result is None:
        cache.put(key, None, None, tried, topk)
    else:
        cache.put(key, _to_canonical(result.config, group).to_json(), result.latency_us, tried, topk)


# -- one group ------------------------------------------------------------------------------------


def finish_candidates(
    graph: Graph,
    cands: Candidates,
    device: Device,
    cache: TuningCache | None,
    key: CacheKey,
    topk: int,
    seed: int = 0,
    phases: Phases | None = None,
    host: HostSide | None = None,
) -> TunedConfig | None:
    """Time the compiled candidates, check them fastest first, keep and store the winner
    (adding the time each step takes to ``phases``).  ``host`` holds the group's inputs and
    reference when they are being made on other threads (see :class:`HostSide`)."""
    phases = phases or Phases()
    group = cands.group
    with phases("inputs"):
        feeds = host.feeds.result() if host else group_inputs(graph, group, seed)
    inputs = [feeds[t] for t in group.inputs]
    memo: dict[str, Reference] = {}

    def expected() -> Reference:
        if "ref" not in memo:
            with phases("reference"):
                memo["ref"] = host.reference.result() if host else reference(graph, group, feeds, seed)
        return memo["ref"]

    with phases("timing"):
        timings = time_candidates(device, cands, inputs)
    phases.count("candidates timed", len(timings))
    # Each candidate is held to the arithmetic it uses: a TF32 one to 2e-3, the others to 1e-4.
    by_precision = {
        p: output_thresholds(graph, group.outputs, group.members, p)
        for p in {config_precision(cfg) for cfg in cands.configs}
    }
    limits = {i: by_precision[config_precision(cfg)] for i, cfg in enumerate(cands.configs)}
    winner = first_correct(device, cands, inputs, expected, timings, limits, phases)
    tried = len(cands.configs)
    if winner is None:
        log.warning("group %s: none of %d candidates is valid on %s", group.root, tried, device.name)
        _store(cache, key, group, None, tried, topk)
        return None
    ranked = {i: _to_canonical(cfg, group) for i, cfg in enumerate(cands.configs)}
    result = TunedConfig(
        cands.signature, cands.configs[winner], timings[winner], tried, False, cands.dropped, timings, ranked
    )
    log.info(
        "group %s: %.2f us (candidate %d of %d, %d dropped)",
        group.root,
        result.latency_us,
        winner,
        tried,
        len(cands.dropped),
    )
    _store(cache, key, group, result, tried, topk)
    return result


def _cost_model(
    graph: Graph, arch: Arch, cache: TuningCache | None, topk: int, kinds: Sequence[str] = Options.kinds
) -> CostModel:
    """The cost model a tune ranks with, its proposals kept beside the tuning database (none
    kept without one)."""
    store = cache.proposals() if cache is not None else None
    return CostModel(graph, arch, Options(topk=topk, kinds=tuple(kinds)), store=store)


def tune_group(
    graph: Graph,
    group: Group,
    arch: Arch,
    topk: int = 20,
    cache: TuningCache | None = None,
    device: Device | None = None,
    *,
    seed: int = 0,
    configs: Sequence[GroupConfig] | None = None,
    kinds: Sequence[str] = Options.kinds,
) -> TunedConfig | None:
    """The fastest correct of the cost model's ``topk`` configs of ``group`` (or of
    ``configs``), measured on ``device`` (default: the local GPU); None if none is valid.
    With a ``cache``, a group tuned before with at least this ``topk`` costs a lookup."""
    if device is None:
        with default_device() as dev:
            return tune_group(graph, group, arch, topk, cache, dev, seed=seed, configs=configs, kinds=kinds)
    key = group_cache_key(graph, group, arch, device, kinds)
    hit, result = _cached(cache, key, group, topk)
    if hit:
        return result
    if configs is None:
        configs = _cost_model(graph, arch, cache, topk, kinds).configs(group)
    cands = compile_candidates(device, prepare_candidates(graph, group, configs))
    return finish_candidates(graph, cands, device, cache, key, topk, seed)


def default_device() -> Any:
    """The local GPU (raises GpuUnavailable, a WelderError, without pycuda or a GPU)."""
    return GpuDevice()


# -- the fusion search's measure ---------------------------------------------------------------------


class GpuMeasure:
    """A ``LatencyMeasure`` for :func:`welder.schedule.engine.fuse`: a group's latency is the
    measured time of its best correct candidate (None when it has none).  Results are kept
    by structure, so every group shape is tuned once per process (and once ever with a
    cache)."""

    def __init__(
        self,
        graph: Graph,
        arch: Arch,
        device: Device,
        cache: TuningCache | None = None,
        topk: int = 20,
        seed: int = 0,
        cost: CostModel | None = None,
        phases: Phases | None = None,
    ) -> None:
        self.graph = graph
        self.arch = arch
        self.device = device
        self.cache = cache
        self.topk = topk
        self.seed = seed
        self.cost = cost or _cost_model(graph, arch, cache, topk)
        self.phases = phases or Phases()
        self.tunes = 0  # groups compiled and timed (cache misses)
        self._results: dict[str, TunedConfig | None] = {}  # signature -> result in canonical names
        self._depth: dict[str, int] = {}  # signature -> how many of the ranked configs it covers
        self._invalid: dict[str, str] = {}  # signature -> why no candidate is valid

    def __call__(self, group: Group) -> float | None:
        result = self.tuned(group)
        return result.latency_us if result is not None else None

    def known(self, group: Group) -> bool:
        return group_signature(self.graph, group) in self._results

    def depth(self, group: Group) -> int:
        """How many of the cost model's ranked configs ``group``'s result covers (0: none yet)."""
        return self._depth.get(group_signature(self.graph, group), 0)

    def tuned(self, group: Group) -> TunedConfig | None:
        signature = group_signature(self.graph, group)
        if signature not in self._results:
            key = self.cache_key(group)
            hit, result, depth = _cached_entry(self.cache, key, group, self.topk)
            dropped: list[Dropped] | None = None
            if not hit:
                self.tunes += 1
                self.phases.subject = f"group {group.root}"
                with self.phases("nvcc"):
                    cands = compile_candidates(self.device, self.candidates(group), phases=self.phases)
                result = finish_candidates(
                    self.graph, cands, self.device, self.cache, key, self.topk, self.seed, self.phases
                )
                dropped, depth = cands.dropped, self.topk
            self.remember(group, result, dropped, depth)
        return self._own(self._results[signature], group)

    def candidates(self, group: Group) -> Candidates:
        return prepare_candidates(self.graph, group, self.cost.configs(group))

    def remember(
        self,
        group: Group,
        result: TunedConfig | None,
        dropped: Sequence[Dropped] | None = None,
        depth: int | None = None,
    ) -> None:
        """Keep ``result``, the best of the first ``depth`` ranked configs (default: topk);
        for None, ``dropped`` says why (None: a negative cache entry)."""
        signature = group_signature(self.graph, group)
        self._depth[signature] = self.topk if depth is None else depth
        if result is not None:
            result = _replace_config(result, _to_canonical(result.config, group))
        else:
            self._invalid[signature] = (
                drop_summary(dropped) if dropped is not None else "a negative entry in the tuning cache"
            )
        self._results[signature] = result

    def why_invalid(self, group: Group) -> str:
        """Why ``group`` has no valid candidate (once :meth:`tuned` returned None for it)."""
        return self._invalid.get(group_signature(self.graph, group), "no valid candidate")

    def configs(self, group: Group) -> list[GroupConfig]:
        result = self.tuned(group)
        return [result.config] if result is not None else []

    def cache_key(self, group: Group) -> CacheKey:
        return group_cache_key(self.graph, group, self.arch, self.device, self.cost.options.kinds)

    @staticmethod
    def _own(result: TunedConfig | None, group: Group) -> TunedConfig | None:
        return None if result is None else _replace_config(result, _from_canonical(result.config, group))


def _replace_config(result: TunedConfig, cfg: GroupConfig) -> TunedConfig:
    return TunedConfig(
        result.signature,
        cfg,
        result.latency_us,
        result.candidates,
        result.from_cache,
        list(result.dropped),
        dict(result.timings_us),
        dict(result.ranked),
    )


def _continued(
    before: TunedConfig | None, after: TunedConfig | None, cands: Candidates, start: int
) -> tuple[TunedConfig | None, list[Dropped]]:
    """A group's result over the ranked configs ``[0, start)`` (``before``) and ``[start,
    ...)`` (``after``, tuned as ``cands``, whose indices count from 0) as one: the faster
    winner, every timing and drop under its index in the whole ranking."""
    shifted = [Dropped(d.candidate + start, d.reason, d.detail) for d in cands.dropped]
    dropped = [*(before.dropped if before else []), *shifted]
    if before is None and after is None:
        return None, dropped
    timings = {**(before.timings_us if before else {})}
    timings.update({i + start: t for i, t in (after.timings_us if after else {}).items()})
    ranked = {**(before.ranked if before else {})}
    ranked.update({i + start: c for i, c in (after.ranked if after else {}).items()})
    best = min((r for r in (before, after) if r is not None), key=lambda r: r.latency_us)
    tried = start + len(cands.configs)
    result = TunedConfig(best.signature, best.config, best.latency_us, tried, False, dropped, timings, ranked)
    return result, dropped


def best_of_first(result: TunedConfig, k: int) -> float:
    """The fastest time among the first ``k`` ranked candidates of ``result`` that were not
    dropped (those slower than the winner were never checked, and count as valid); the
    winner's time where that is unknown (a result from the cache keeps no timings)."""
    dropped = {d.candidate for d in result.dropped}
    times = [t for i, t in result.timings_us.items() if i < k and i not in dropped]
    return min(times, default=result.latency_us)


# -- a whole model -------------------------------------------------------------------------------------


@dataclass
class TunedGroup(PlannedGroup):
    """A planned group whose latency was measured on the GPU (``latency_us`` is the
    measurement; ``configs[0].estimate`` keeps the cost model's view)."""

    measured_us: float = 0.0
    candidates: int = 0
    from_cache: bool = False
    signature: str = ""
    timed: list[dict] = field(default_factory=list)  # timed_records of its tuning

    @property
    def latency_us(self) -> float:
        return self.measured_us

    @property
    def measured_latency_us(self) -> float | None:
        return self.measured_us


class ProgressBar:
    """One self-redrawing status line on a terminal; silent when the stream is not one (a
    log file or CI output should not fill with carriage returns)."""

    def __init__(
        self, total: int, label: str = "tuning", stream: TextIO | None = None, width: int = 20
    ) -> None:
        self.total = max(0, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def update(self, done: int, note: str = "") -> None:
        if not self.tty:
            return
        filled = self.width * done // self.total if self.total else self.width
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {note}"
        columns = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r" + line[: max(20, columns - 1)] + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False


def target_note(arch: Arch, device: Device) -> str | None:
    """A warning when the cost model's arch is not the GPU the kernels are timed on (a GPU
    welder.arch does not describe included): the ranking may then miss that GPU's best
    configs, though every kept config is measured and checked on it."""
    try:
        local = match_gpu_name(device.name)
    except WelderError:
        return (
            f"{device.name} has no description in welder.arch: candidates are ranked by the "
            f"{arch.name} cost model and compiled for and timed on {device.name} ({device.arch})"
        )
    if local.name != arch.name:
        return (
            f"this GPU is not a {arch.name}: candidates are ranked by the {arch.name} cost model "
            f"but compiled for and timed on {device.name} ({device.arch})"
        )
    return None


class _ModelTuner:
    """The steps of :func:`tune_model`, sharing its settings."""

    def __init__(
        self,
        graph: Graph,
        arch: Arch,
        topk: int,
        cache: TuningCache | None,
        device: Device,
        seed: int,
        workers: int | None,
        stream: TextIO | None,
        library: Sequence[LibraryGroup] = (),
        kinds: Sequence[str] = Options.kinds,
        budget_s: float | None = None,
    ) -> None:
        self.graph = graph
        self.budget_s = budget_s
        self.deadline = None if budget_s is None else time.perf_counter() + budget_s
        self.library = {lg.group.root: lg for lg in library}
        self.arch = arch
        self.topk = topk
        self.cache = cache
        self.device = device
        self.workers = workers or usable_cores()
        self.stream = stream
        self.cost = _cost_model(graph, arch, cache, topk, kinds)
        self.phases = Phases()
        self.measure = GpuMeasure(graph, arch, device, cache, topk, seed, self.cost, self.phases)
        self.log: list[str] = []
        self.split_failures: list[SplitFailure] = []
        self._ways: dict[tuple[str, tuple[str, ...]], list[tuple[str, list[Group]]] | str] = {}
        self._split_estimates: dict[str, float | None] = {}  # by group signature
        self._split_notes: dict[tuple[str, tuple[str, ...]], str] = {}  # checked()'s splits, to confirm
        self._unfused: dict[tuple[str, ...], Unfused] = {}  # by members: unfused() worked out or stored

    def fuse_by_measurement(self, nofusion: bool) -> list[Group]:
        bar = ProgressBar(len(self.graph.nodes), "tuning (fusion by measurement)", self.stream)

        def progress(k: int, n: int) -> None:
            bar.update(k + 1, f"nodes, {self.measure.tunes} groups tuned")

        try:
            result = fuse(self.graph, self.measure, nofusion=nofusion, progress=progress, library=self.fixed)
        except InvalidGroup as e:
            raise TuneError(
                f"{e} on {self.device.name}; see the welder.tune log for why candidates failed"
            ) from None
        finally:
            bar.close()
        self.log += result.log
        return result.groups

    def fuse_by_cost_model(self, nofusion: bool) -> list[Group]:
        """The cost model's groups after their fusion checks -- or, where the tuning cache
        holds this model's plan (:mod:`welder.tune.plan_cache`), those groups without the
        search."""
        key = self.plan_key(nofusion) if self.cache is not None else None
        cached = self.cached_plan(key) if key is not None else None
        if cached is not None:
            return cached
        log_start = len(self.log)
        if not nofusion and SearchProcess.usable(self.cost):
            # Tuned and checked as the search settles them: nothing waits for the whole search.
            search = SearchProcess(self.graph, self.cost, self.fixed)
            try:
                verified = self.verify_all([lg.group for lg in self.fixed], search)
            finally:
                search.close()
            assert search.log is not None
            self.log[log_start:log_start] = search.log
            groups = [verified[k] for k in execution_order(verified)]
        else:
            with self.phases("fusion search"):
                result = fuse(self.graph, self.cost, nofusion=nofusion, library=self.fixed)
            self.log += result.log
            with self.phases("unfused baseline"):
                self.prefetch_unfused(result.groups)
            if nofusion:
                self.tune_all([g for g in result.groups if g.root not in self.library])
                groups = result.groups
            else:
                verified = self.verify_all(result.groups)
                groups = [verified[k] for k in execution_order(verified)]
        if key is not None and self.cache is not None and not self.over_budget():
            unfused = [self.unfused(g) for g in groups if g.root not in self.library]
            record = CachedPlan.of(groups, self.log[log_start:], self.split_failures, unfused)
            self.cache.put_plan(key, self.arch.name, self.device.name, record.to_json())
        return groups

    def plan_key(self, nofusion: bool) -> str:
        kinds = self.cost.options.kinds
        gpu, compiler = self.device.name, self.device.compiler
        return plan_key(self.graph, self.arch, gpu, compiler, kinds, self.topk, nofusion, list(self.library))

    def cached_plan(self, key: str) -> list[Group] | None:
        """The groups of the plan stored under ``key``, tuned (from their cache entries), or
        None where there is none or it no longer fits the graph."""
        assert self.cache is not None
        stored = self.cache.get_plan(key)
        record = None if stored is None else CachedPlan.from_json(stored)
        groups = None if record is None else record.rebuild(self.graph)
        if record is None or groups is None:
            return None
        generated = [g for g in groups if g.root not in self.library]
        if len(record.unfused) == len(generated):
            self._unfused.update({tuple(g.members): u for g, u in zip(generated, record.unfused)})
        else:
            self.prefetch_unfused(groups)
        self.tune_all([g for g in groups if g.root not in self.library])
        note = f"fusion from the tuning cache ({len(groups)} groups; the search did not run)"
        self.log += [*record.log, note]
        self.split_failures += record.split_failures
        return groups

    def prefetch_unfused(self, groups: Sequence[Group]) -> None:
        """The cost model's configs of every member of ``groups`` alone -- the unfused
        baseline :meth:`plan` reports -- proposed in the cost model's worker processes, before
        the tune starts its threads (with them running it cannot fork).  The search proposes
        few of them, and a plan from the cache none: mobilevit_s at batch 64 has 237 distinct
        nodes, 20 s of proposals on one core, which were most of a tune from the cache."""
        members = [m for g in groups if g.root not in self.library for m in g.members]
        with self.cost.parallel():
            self.cost.prefetch(make_group(self.graph, [m]) for m in members)

    def verify_all(self, groups: Sequence[Group], search: SearchProcess | None = None) -> list[Group]:
        """Tune ``groups`` and check each one's fusion (:meth:`checked`), as a stream: a group
        is doubted as soon as it is timed, and the shallower groups of its ways go into the
        same :class:`_TuneQueue` at once, compiling while the model's later groups are
        timed.  Once all of a check's groups are tuned it is decided; a split chosen on the
        first configs is tuned on the rest and :meth:`confirmed`, and its parts are checked
        in turn, down to ``VERIFY_DEPTH`` levels.  (Checked level by level, each level one
        batch, the compile pool idled while each batch's last groups were timed and the next
        level's ways were worked out, and the timing thread waited for each batch's first
        group: six to eight batches a tune of mobilevit_s or Swin-T.)  With a ``search``, the
        groups it settles join the queue as they arrive, along with ``groups``."""
        final = [g for g in groups if g.root in self.library]
        unchecked: list[Group] = []

        with _TuneQueue(self) as queue:

            def check(g: Group, depth: int) -> None:
                if self.doubt(g, depth) is None:
                    final.append(g)
                elif self.over_budget():
                    unchecked.append(g)
                else:
                    with self.phases("fusion-check ways"):
                        splits = self.split_groups(g)
                    then = functools.partial(decide, g, depth)
                    queue.add(splits, "fusion-check groups tuned", self.check_topk, then)

            def decide(g: Group, depth: int) -> None:
                parts = self.checked(g, depth)
                if parts == [g]:
                    final.append(g)
                else:
                    then = functools.partial(confirm, g, depth, parts)
                    queue.add(parts, "fusion-check groups tuned on", then=then)

            def confirm(g: Group, depth: int, parts: list[Group]) -> None:
                if not self.confirmed(g, parts):
                    final.append(g)
                    return
                for p in parts:
                    check(p, depth + 1)

            def arrive(arrived: Sequence[Group]) -> None:
                queue.add([g for g in arrived if g.root not in self.library], each=lambda g: check(g, 0))

            def feed(block: bool) -> bool:
                assert search is not None
                with self.phases("fusion search"):
                    arrive(search.receive(block))
                return search.log is None

            arrive(groups)
            queue.run(feed if search is not None else None)
        if unchecked:
            self.log.append(
                f"fusion checks stopped: the time budget of {self.budget_s:.0f} s is spent; "
                f"{len(unchecked)} doubted groups kept unchecked"
            )
        return final + unchecked

    def doubt(self, g: Group, depth: int) -> tuple[TunedConfig | None, float] | None:
        """``(measured, predicted)`` where :meth:`checked` checks ``g``'s fusion, else None:
        a fused group without a valid candidate, or measuring over ``VERIFY_RATIO`` times
        its prediction, or over its prediction and ``VERIFY_RATIO`` times the cost model's
        cheapest split of it (:meth:`split_estimate`)."""
        if g.root in self.library or len(g.stages) < 2 or depth >= VERIFY_DEPTH:
            return None
        result = self.measure.tuned(g)
        predicted = self.cost(g)
        if predicted is None:
            return None
        if result is None or result.latency_us > VERIFY_RATIO * predicted:
            return result, predicted
        if result.latency_us > predicted:
            split = self.split_estimate(g)
            if split is not None and result.latency_us > VERIFY_RATIO * split:
                return result, predicted
        return None

    def split_estimate(self, g: Group) -> float | None:
        """The cost model's latency for the cheapest of the ways :meth:`checked` would split
        ``g`` (None where it cannot be split), by structure.  The fusion search never weighs
        some of those ways (the last stage apart is not a step of greedy growth), so a group
        can measure close to its own prediction and still far over a split's: BERT's fp32
        attention at batch 64 measured 274 us against 236 predicted, while the split with the
        last stage apart was predicted at 125 and measured 215."""
        signature = group_signature(self.graph, g)
        if signature not in self._split_estimates:
            ways = self.ways(g)
            costs = [] if isinstance(ways, str) else [[self.cost(p) for p in split] for _, split in ways]
            sums = [sum(c for c in parts if c is not None) for parts in costs if None not in parts]
            self._split_estimates[signature] = min(sums, default=None)
        return self._split_estimates[signature]

    def split_groups(self, g: Group) -> list[Group]:
        """Every group of the ways :meth:`checked` would split ``g`` into (tuned together
        before the checks of a level)."""
        ways = self.ways(g)
        return [] if isinstance(ways, str) else [p for _, split in ways for p in split]

    def ways(self, g: Group) -> list[tuple[str, list[Group]]] | str:
        """The ways to split ``g`` (halved; first stage apart where that differs), or why it
        cannot be split; worked out once per group."""
        key = (g.root, g.members)  # a split's part may keep its parent's root
        if key not in self._ways:
            self._ways[key] = self._find_ways(g)
        return self._ways[key]

    def _find_ways(self, g: Group) -> list[tuple[str, list[Group]]] | str:
        stages = max(1, len(g.stages) // 2)
        try:
            parts = fuse(self.graph, self.cost, only=g.members, max_stages=stages).groups
        except InvalidGroup as e:
            return f"its ops cannot be re-fused with at most {stages} stages: {e}"
        if len(parts) < 2:
            return f"re-fused with at most {stages} stages, its ops form one group again"
        ways = [("halved", parts)]
        for way, last in (("first stage apart", False), ("last stage apart", True)):
            peeled = self.peeled(g, last)
            if peeled is not None and all({p.root for p in peeled} != {p.root for p in s} for _, s in ways):
                ways.append((way, peeled))
        return ways

    def checked(self, g: Group, depth: int) -> list[Group]:
        """``g``, or shallower groups of its members if the GPU disagrees with the fusion.

        The cost model decides fusion; a fused group whose best measured latency exceeds
        ``VERIFY_RATIO`` times the model's prediction shows the model misjudged it, and so
        possibly the fusion too.  Its members are fused again under the cost model two
        ways -- with at most half as many stages per group, and with the first stage (a
        product, say) apart from the others fused together (:meth:`peeled`: a softmax
        after a product stays one kernel) -- those groups are tuned, and the faster way
        replaces ``g`` if it measures faster than ``g`` (:meth:`verify_all` checks those
        again the same way, down to ``VERIFY_DEPTH`` levels).  A split that cannot be made,
        or whose groups are not all valid, is no verdict on the fusion: it is a warning and
        a :class:`SplitFailure` in the plan, so a slow group never stays silently."""
        doubt = self.doubt(g, depth)
        if doubt is None:
            return [g]
        result, predicted = doubt
        ways = self.ways(g)
        if isinstance(ways, str):
            return self.unsplit(g, result, predicted, ways)
        parts = ways[0][1]
        measured: list[tuple[float, str, list[Group]]] = []
        why = ""
        k = self.check_topk
        for way, split in ways:
            tuned = [self.measure.tuned(p) for p in split]
            failed = [p for p, t in zip(split, tuned) if t is None]
            if failed:
                why = why or "; ".join(
                    f"{p.root} ({len(p.members)} ops) has no valid candidate: {self.measure.why_invalid(p)}"
                    for p in failed
                )
                continue
            measured.append((sum(best_of_first(t, k) for t in tuned if t is not None), way, split))
        if not measured:
            return self.unsplit(g, result, predicted, f"of the {len(parts)} shallower groups, {why}")
        split_us, way, parts = min(measured, key=lambda m: m[0])
        fused = f"{result.latency_us:.1f} us measured" if result else "no valid candidate"
        fused_us = best_of_first(result, k) if result is not None else None
        against = "" if fused_us is None else f" against {fused_us:.1f} us fused"
        if k < self.topk:
            against += f", each the best of its first {k} candidates"
        if fused_us is not None and split_us >= fused_us:
            self.log.append(
                f"fusion of {g.root} kept: {fused}, predicted {predicted:.1f} us; "
                f"{len(parts)} shallower groups ({way}) measure {split_us:.1f} us{against}"
            )
            return [g]
        self._split_notes[(g.root, g.members)] = (
            f"group {g.root} ({len(g.stages)} stages; {fused}, predicted {predicted:.1f} us) "
            f"split into {len(parts)} groups ({way}) measuring {split_us:.1f} us{against}"
        )
        return parts

    def confirmed(self, g: Group, parts: list[Group]) -> bool:
        """Whether ``parts``, which :meth:`checked` chose over ``g`` on each one's first
        ``check_topk`` candidates, are still faster now that they are tuned on all ``topk``
        (as ``g`` is): a fused group whose fastest configs rank low keeps its fusion.
        Logs the verdict."""
        message = self._split_notes.pop((g.root, g.members))
        fused = self.measure.tuned(g)
        split_us = sum(t.latency_us for t in map(self.measure.tuned, parts) if t is not None)
        if fused is not None and self.check_topk < self.topk:
            message += f"; on all {self.topk}, {split_us:.1f} us against {fused.latency_us:.1f} us"
        if fused is not None and split_us >= fused.latency_us:
            self.log.append(f"fusion of {g.root} kept: {message.split(' split into ', 1)[1]}")
            return False
        log.info(message)
        self.log.append(message)
        return True

    def peeled(self, g: Group, last: bool = False) -> list[Group] | None:
        """``g``'s first stage with what it inlines -- or, ``last``, its last reduction with
        what follows it -- as one group and the rest of its members fused again under the
        cost model (before a last reduction, kept as one group where they are one), or None
        where that is no new way to split it.  The first apart keeps a normalisation after a
        product whole; the last apart keeps one before a product whole (a softmax and the
        PV product after it: BERT's fp32 attention, which halving split five ways)."""
        if len(g.stages) < 3:
            return None  # halving already sets the first stage apart
        try:
            if last:  # the last reduction and what follows it, everything before one kernel
                *_, tail = (s for s in g.stages if g.computes[s].reduce_axes)
                alone = make_group(self.graph, downstream_within(self.graph, tail, set(g.members)))
                rest = set(g.members) - set(alone.members)
                others = self._whole(rest)
            else:
                singles = fuse(self.graph, self.cost, only=g.members, max_stages=1).groups
                alone = next(p for p in singles if g.stages[0] in p.members)
                rest = set(g.members) - set(alone.members)
                others = None
            others = others or fuse(self.graph, self.cost, only=rest, max_stages=len(g.stages) - 1).groups
        except (InvalidGroup, StopIteration):
            return None
        return [alone, *others] if others else None

    def _whole(self, members: set[str]) -> list[Group] | None:
        """``members`` as one group, or None where they cannot be one."""
        try:
            return [make_group(self.graph, members)]
        except InvalidGroup:
            return None

    def unsplit(self, g: Group, fused: TunedConfig | None, predicted: float, reason: str) -> list[Group]:
        """``g`` unchanged, after a warning that its fusion check could not split it."""
        ops = tuple(self.graph.nodes[m].op_type for m in g.members)
        measured = None if fused is None else fused.latency_us
        failure = SplitFailure(g.root, tuple(g.members), ops, measured, predicted, reason)
        log.warning(failure.message())
        self.log.append(failure.message())
        self.split_failures.append(failure)
        return [g]

    @property
    def check_topk(self) -> int:
        """The configs a fusion check tunes a shallower group on (:data:`CHECK_TOPK`)."""
        return min(self.topk, CHECK_TOPK)

    def over_budget(self) -> bool:
        """Whether the time budget, if any, is spent."""
        return self.deadline is not None and time.perf_counter() > self.deadline

    @property
    def fixed(self) -> list[LibraryGroup]:
        """The groups a library computes: never searched, tuned or measured here."""
        return list(self.library.values())

    def tune_all(self, groups: Sequence[Group], what: str = "groups tuned", topk: int | None = None) -> None:
        """Tune each distinct group on the cost model's first ``topk`` configs (default: the
        tune's), in one :class:`_TuneQueue`: compiles on the thread pools, timing and checks
        on this thread.  A group already tuned on fewer configs (a fusion check's,
        :data:`CHECK_TOPK`) is tuned on the configs after those only, and keeps the faster of
        the two winners."""
        with _TuneQueue(self) as queue:
            queue.add(groups, what, topk)
            queue.run()

    def _prepare_and_compile(
        self, group: Group, configs: list[GroupConfig], per_call: int, nvcc: ThreadPoolExecutor
    ) -> Future[Candidates]:
        """Code generation for one group (in the code generation pool), then its nvcc calls
        queued on the ``nvcc`` pool: the future of those is returned, not waited for."""
        cands = prepare_candidates(self.graph, group, configs)
        return submit_compiles(self.device, cands, per_call, nvcc, self.phases)

    def plan(self, groups: Sequence[Group]) -> tuple[list[PlannedGroup], bool]:
        """The tuned groups in execution order (a group without any valid candidate is split
        into one kernel per node; a library group keeps its estimate), and whether every
        unfused baseline was measured."""
        planned: list[PlannedGroup] = []
        all_measured = True
        with watch(self.phases, WATCH_S, log.info):  # nothing forks from here on
            for g in groups:
                if g.root in self.library:
                    planned.append(library_planned(self.library[g.root]))
                    continue
                result = self.measure.tuned(g)
                if result is None:
                    planned += self.split(g)
                    continue
                unfused_us, unfused_bytes, measured = self.unfused(g)
                all_measured &= measured
                planned.append(_tuned_group(g, result, unfused_us, unfused_bytes, measured))
        return planned, all_measured

    def split(self, g: Group) -> list[TunedGroup]:
        message = f"group {g.root} has no valid candidate; splitting it into {len(g.members)} kernels"
        log.warning(message)
        self.log.append(message)
        out = []
        for m in g.members:
            single = make_group(self.graph, [m])
            result = self.measure.tuned(single)
            if result is None:
                node = self.graph.nodes[m]
                raise TuneError(
                    f"no candidate for node {m!r} ({node.op_type} from {node.source!r}) compiled, ran and "
                    f"matched the reference on {self.device.name}: {self.measure.why_invalid(single)}"
                )
            us, nbytes, measured = self.unfused(single)
            out.append(_tuned_group(single, result, us, nbytes, measured))
        return out

    def unfused(self, g: Group) -> tuple[float, int, bool]:
        """The members as one kernel each: (latency, traffic, measured?).  Latencies are
        measured where every member was tuned on its own (as the fusion search by
        measurement does), else the cost model's estimates; remembered by members (and in
        the stored plan, :mod:`welder.tune.plan_cache`)."""
        key = tuple(g.members)
        if key not in self._unfused:
            self._unfused[key] = self._work_out_unfused(g)
        return self._unfused[key]

    def _work_out_unfused(self, g: Group) -> Unfused:
        singles = [make_group(self.graph, [m]) for m in g.members]
        estimates = [self.cost.configs(s) for s in singles]
        traffic = sum(traffic_of(c[0]) for c in estimates if c)
        if all(self.measure.known(s) for s in singles):
            results = [self.measure.tuned(s) for s in singles]
            if all(r is not None for r in results):
                return sum(r.latency_us for r in results if r is not None), traffic, True
        return sum(c[0].estimate.latency_us for c in estimates if c), traffic, False


@dataclass(eq=False)
class _Job:
    """One group's candidates in a :class:`_TuneQueue`: the configs ranked ``[start, topk)``,
    generated and compiled on the pools (``compiled``), then timed in turn; ``waiters`` run
    once its result is remembered."""

    group: Group
    signature: str
    start: int
    topk: int
    what: str
    configs: list[GroupConfig]
    compiled: Future[Future[Candidates]] | None = None
    waiters: list[Callable[[], None]] = field(default_factory=list)


class _TuneQueue:
    """A tune's groups in flight.  Groups may be added at any time, also by the callbacks
    of groups already tuned (a fusion check adds a group's ways as soon as it is timed):
    each is generated on the code generation threads and compiled on the nvcc pool at
    once, and timed and checked on the calling thread in the order it was added, while its
    inputs and reference are made :data:`HOST_LOOKAHEAD` groups ahead on the host threads.
    A group whose structure is already queued waits for that one instead of compiling
    again (and is tuned on further where it asks for more configs)."""

    def __init__(self, tuner: _ModelTuner) -> None:
        self.tuner = tuner
        self.jobs: list[_Job] = []
        self.position = 0  # the next job to time
        self.queued: dict[str, _Job] = {}  # by signature, until timed
        self.ready: list[Callable[[], None]] = []  # callbacks whose groups are all tuned
        self.nvcc = ThreadPoolExecutor(max_workers=tuner.workers, thread_name_prefix="welder-nvcc")
        self.codegen = ThreadPoolExecutor(max_workers=CODEGEN_THREADS, thread_name_prefix="welder-codegen")
        self.host_pool = ThreadPoolExecutor(max_workers=HOST_THREADS, thread_name_prefix="welder-host")
        self.host: dict[int, HostSide] = {}  # by job index; each holds its arrays
        self.compiling = 0  # kernels queued on the pools and not compiled yet
        self._lock = threading.Lock()
        self.bar = ProgressBar(0, "tuning", tuner.stream)
        self.total_us = 0.0
        self._feed: Callable[[bool], bool] | None = None
        self._watch = contextlib.ExitStack()

    def __enter__(self) -> _TuneQueue:
        # The pools' threads make forking unsafe from here on anyway: a watch costs nothing.
        self._watch.enter_context(watch(self.tuner.phases, WATCH_S, log.info))
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # A finished tune leaves no thread behind (a fusion search started next forks only
        # where this process runs no other thread); a failed one does not wait for compiles.
        with self._watch:
            for pool in (self.codegen, self.nvcc, self.host_pool):
                pool.shutdown(wait=kind is None, cancel_futures=True)
        self.bar.close()

    def add(
        self,
        groups: Sequence[Group],
        what: str = "groups tuned",
        topk: int | None = None,
        then: Callable[[], None] | None = None,
        each: Callable[[Group], None] | None = None,
    ) -> None:
        """Tune ``groups`` on the cost model's first ``topk`` configs (default: the tune's;
        past the time budget :data:`BUDGET_TOPK`); call ``each(g)`` as each one is tuned and
        ``then()`` once all are, on the thread that runs :meth:`run`.  ``what`` names them
        in the tune's counts (:meth:`Phases.count`)."""
        t = self.tuner
        topk = min(t.topk if topk is None else topk, BUDGET_TOPK if t.over_budget() else t.topk)
        left = [len(groups)]

        def done(g: Group) -> None:
            if each is not None:
                each(g)
            left[0] -= 1
            if left[0] == 0 and then is not None:
                then()

        if not groups and then is not None:
            self.ready.append(then)
        t.phases.count(what, 0)  # named in the counts even where nothing is tuned
        new: list[_Job] = []
        for g in groups:
            self._request(g, topk, what, functools.partial(done, g), new)
        self._submit(new)

    def _request(self, g: Group, topk: int, what: str, done: Callable[[], None], new: list[_Job]) -> None:
        """``done`` once ``g`` is tuned on ``topk`` configs: after a queued job of its
        structure, after a new job (appended to ``new``), or at once (tuned before, or in
        the tuning cache)."""
        t = self.tuner
        sig = group_signature(t.graph, g)
        queued = self.queued.get(sig)
        if queued is not None:
            if queued.topk >= topk:
                queued.waiters.append(done)
            else:  # tuned on further once that one is done

                def further() -> None:
                    more: list[_Job] = []
                    self._request(g, topk, what, done, more)
                    self._submit(more)

                queued.waiters.append(further)
            return
        start = None
        if t.measure.known(g):
            depth = t.measure.depth(g)
            if depth < topk and len(t.cost.configs(g)) > depth:
                start = depth
        else:
            hit, result, depth = _cached_entry(t.cache, t.measure.cache_key(g), g, topk)
            if hit:
                t.measure.remember(g, result, depth=depth)
            else:
                start = 0
        if start is None:
            self.ready.append(done)
            return
        job = _Job(g, sig, start, topk, what, t.cost.configs(g)[start:topk], waiters=[done])
        self.queued[sig] = job
        new.append(job)

    def _submit(self, jobs: list[_Job]) -> None:
        """Queue the code generation and compiles of ``jobs``: in calls that spread what the
        pool has left to compile with these over its cores (:func:`kernels_per_call`), those
        the timing thread takes next in smaller calls (:func:`ramped_per_call`)."""
        if not jobs:
            return
        t = self.tuner
        kernels = sum(len(j.configs) for j in jobs)
        with self._lock:
            self.compiling += kernels
            per_call = kernels_per_call(self.compiling, t.workers)
        ahead = len(self.jobs) - self.position  # jobs the timing thread takes before these
        for k, job in enumerate(jobs):
            t.phases.count(job.what)
            size = ramped_per_call(ahead + k, per_call)
            compile_job = t._prepare_and_compile
            job.compiled = self.codegen.submit(compile_job, job.group, job.configs, size, self.nvcc)
            job.compiled.add_done_callback(functools.partial(self._on_codegen, len(job.configs)))
            self.jobs.append(job)

    def _take(self, block: bool) -> None:
        """What the feed has for the queue; once it says nothing more comes, no feed."""
        assert self._feed is not None
        if not self._feed(block):
            self._feed = None

    def _on_codegen(self, kernels: int, rendered: Future[Future[Candidates]]) -> None:
        """Count a job's kernels out of :attr:`compiling` once its last call is done."""

        def release(_: object = None) -> None:
            with self._lock:
                self.compiling -= kernels

        if rendered.cancelled() or rendered.exception() is not None:
            release()
        else:
            rendered.result().add_done_callback(release)

    def run(self, feed: Callable[[bool], bool] | None = None) -> None:
        """Time every job in turn, running the callbacks of each tuned group, until nothing
        is queued or ready.  ``feed(block)`` adds the groups that have arrived from elsewhere
        (waiting for some where ``block``) and says whether more may come; it is asked
        between jobs and while a job compiles."""
        t = self.tuner
        self._feed = feed
        while True:
            while self.ready:
                self.ready.pop(0)()
            if self._feed is not None:
                self._take(block=self.position >= len(self.jobs))
                continue
            if self.position >= len(self.jobs):
                return
            k = self.position
            for ahead in range(k, min(len(self.jobs), k + 1 + HOST_LOOKAHEAD)):
                if ahead not in self.host:
                    group = self.jobs[ahead].group
                    self.host[ahead] = HostSide.submit(self.host_pool, t.graph, group, t.measure.seed)
            job = self.jobs[k]
            assert job.compiled is not None
            t.phases.subject = f"group {job.group.root}"
            # What the compile pool has not finished yet; at the start, all of it.
            with t.phases("nvcc" if k else "nvcc, first group"):
                while self._feed is not None and not _compiled(job.compiled):
                    self._take(block=False)
                    futures_wait([_pending(job.compiled)], timeout=FEED_POLL_S)
                cands = job.compiled.result().result()
            g, key = job.group, t.measure.cache_key(job.group)
            result = finish_candidates(
                t.graph,
                cands,
                t.device,
                None if job.start else t.cache,
                key,
                job.topk,
                t.measure.seed,
                t.phases,
                self.host.pop(k),
            )
            dropped = cands.dropped
            if job.start:
                result, dropped = _continued(t.measure.tuned(g), result, cands, job.start)
                _store(t.cache, key, g, result, job.start + len(cands.configs), job.topk)
            t.measure.tunes += 1
            t.measure.remember(g, result, dropped, job.topk)
            self.position += 1
            del self.queued[job.signature]
            if result is not None:
                self.total_us += result.latency_us
            note = f"best {result.latency_us:.1f} us" if result else "no valid candidate"
            self.bar.total = len(self.jobs)
            self.bar.update(self.position, f"{note}, {self.total_us:.0f} us so far")
            for waiter in job.waiters:
                waiter()


def _compiled(rendered: Future[Future[Candidates]]) -> bool:
    """Whether a job's code generation and every compile call it queued are done."""
    return rendered.done() and (rendered.exception() is not None or rendered.result().done())


def _pending(rendered: Future[Future[Candidates]]) -> Future[Any]:
    """The step of a job's compile still running: its code generation, else its calls."""
    return rendered.result() if rendered.done() and rendered.exception() is None else rendered


def _tuned_group(
    g: Group, result: TunedConfig, unfused_us: float, unfused_bytes: int, unfused_measured: bool
) -> TunedGroup:
    return TunedGroup(
        g,
        [result.config],
        unfused_us,
        unfused_bytes,
        unfused_measured,
        measured_us=result.latency_us,
        candidates=result.candidates,
        from_cache=result.from_cache,
        signature=result.signature,
        timed=timed_records(result),
    )


def timed_records(result: TunedConfig) -> list[dict]:
    """Every config tried for ``result``, by rank: the config (canonical names, with the cost
    model's estimate), its median time (null where it was dropped before timing) and why it
    was dropped (null where it was not; a config slower than the winner was never checked).
    ``tuned.json`` keeps them so the cost model's ranking can be judged against the GPU
    offline (``scripts/ranking.py``); a result from the cache has none."""
    dropped = {d.candidate: d.reason for d in result.dropped}
    return [
        {
            "rank": i,
            "measured_us": None if i not in result.timings_us else round(result.timings_us[i], 4),
            "dropped": dropped.get(i),
            "config": cfg.to_json(),
        }
        for i, cfg in sorted(result.ranked.items())
    ]


def tune_model(
    graph: Graph,
    arch: Arch,
    topk: int = 20,
    cache: TuningCache | None = None,
    device: Device | None = None,
    measure_fusion: bool = False,
    *,
    nofusion: bool = False,
    model: str = "",
    seed: int = 0,
    workers: int | None = None,
    progress_stream: TextIO | None = None,
    skip_dot: bool = False,
    kinds: Sequence[str] = Options.kinds,
    budget_s: float | None = None,
) -> Plan:
    """Fuse ``graph`` and tune every group on ``device`` (default: the local GPU).

    ``measure_fusion`` makes the fusion search itself compare measured latencies (Welder's
    way: slower, every candidate group is compiled and timed); otherwise the cost model
    fuses and only the resulting groups are tuned, their compiles spread over ``workers``
    threads.  The result is a :class:`Plan` of :class:`TunedGroup` (measured latencies);
    ``Plan.measure`` says on which GPU and how fusion and the unfused baseline were rated.
    With ``skip_dot`` the matrix products go to cuBLAS: they are fixed groups that are
    neither tuned nor measured (their latency is the library estimate).  ``kinds`` are the
    kernel kinds that may propose configs (``("simt",)``: no tensor cores).  ``budget_s``
    is a soft limit on the wall time: once it is spent, groups not yet tuned try only the
    cost model's ``BUDGET_TOPK`` best configs and no further level of fusion checks starts
    (the plan's log says how many doubted groups were left unchecked); work under way
    finishes, so a tune may overrun it by one round of compiles and timings."""
    if topk < 1:
        raise WelderError("topk must be at least 1")
    if device is None:
        with default_device() as dev:
            return tune_model(
                graph,
                arch,
                topk,
                cache,
                dev,
                measure_fusion,
                nofusion=nofusion,
                model=model,
                seed=seed,
                workers=workers,
                progress_stream=progress_stream,
                skip_dot=skip_dot,
                kinds=kinds,
                budget_s=budget_s,
            )
    start = time.perf_counter()
    library = find_gemm_groups(graph, arch) if skip_dot else []
    tuner = _ModelTuner(
        graph, arch, topk, cache, device, seed, workers, progress_stream, library, kinds, budget_s
    )
    note = target_note(arch, device)
    if note:
        log.warning(note)
        tuner.log.append(note)
    if measure_fusion:
        groups = tuner.fuse_by_measurement(nofusion)
    else:
        groups = tuner.fuse_by_cost_model(nofusion)
    planned, unfused_measured = tuner.plan(groups)
    how = [
        f"gpu {device.name} ({device.arch})",
        "fusion by measurement" if measure_fusion else "fusion by cost model",
        "unfused baseline measured" if unfused_measured else "unfused baseline by cost model",
    ]
    return Plan(
        model or graph.name,
        arch,
        "; ".join(how),
        nofusion,
        topk,
        list(planned),
        time.perf_counter() - start,
        tuner.log,
        skip_dot,
        tuner.split_failures,
        tuner.phases.rounded(),
        tuner.phases.work_done(),
    )
