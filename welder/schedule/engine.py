"""Fusion search: which nodes share a kernel.

Groups grow from the graph's inputs towards its outputs.  Starting at the first node not
yet in a group, the search tries each consumer of the group's outputs, together with that
consumer's other producers that are not scheduled yet, and keeps the bigger group only if
its latency is no worse than the latencies of its parts run separately.  Latency comes
from a pluggable *measure*: the cost model here, the GPU profiler when tuning on a GPU.

``nofusion`` is Welder's "welder-base" ablation: no tile-graph fusion across reductions,
but injective operators still travel with the reduction next to them (see
:func:`nofusion_partition`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import multiprocessing
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import networkx as nx

from welder.arch import Arch
from welder.graph import Graph
from welder.hostcpu import usable_cores
from welder.ir.compute import Compute
from welder.ir.expr import Binary, Call, Load, format_expr, is_float, rename_tensors, walk
from welder.ir.views import aliased_input
from welder.schedule.config import GroupConfig
from welder.schedule.group import Group, InvalidGroup, execution_order, make_group
from welder.schedule.kinds import Options, ScheduleContext, propose
from welder.schedule.kinds.library import LibraryGroup
from welder.schedule.proposals import ProposalStore

#: Bumped when the fusion search or ``nofusion_partition`` changes which groups it forms: a
#: model's plan stored before (``welder.tune.plan_cache``) is no answer for it now.
FUSION_VERSION = 6  # 2: --nofusion's arithmetic is the epilogue of its reduction;
# 3: no product span between two sums of squares (_matrix_product);
# 4: --nofusion's deferred arithmetic joins its reader only where the measure finds it no slower;
# 5: so does an epilogue (step 2); 6: a prologue goes apart where the measure finds that faster
MAX_GROUP_MEMBERS = 48
MAX_GROUP_STAGES = 8
#: Groups the parent of CostModel's worker processes memoises before it forks them again.
REFORK_AFTER = 32
#: Graphs with fewer nodes are searched in one process: starting CostModel's workers costs
#: about 45 ms a search, more than they save there (the 226 graphs of half the ONNX node
#: tests, up to 22 nodes each: 15.5 s with two workers, 5.4 s without).
PARALLEL_MIN_NODES = 24
T = TypeVar("T")


class LatencyMeasure(Protocol):
    """Anything that rates a candidate group: microseconds, or None if it cannot run."""

    def __call__(self, group: Group) -> float | None: ...


class CostModel:
    """Latency of a group under the cost model (its best config's estimate over the kernel
    kinds ``options.kinds`` names); memoised by group structure, so the twelve identical
    layers of a BERT are scheduled once.

    Proposing a group's configs is pure Python and the search's whole cost (a tenth of a
    second a group, hundreds of distinct groups a model), so within :meth:`parallel` the
    search hands the groups it is about to rate to :meth:`prefetch`, which proposes the
    new ones in ``workers`` forked processes; the ratings, and so the search, are the same
    as one process would make.

    With a ``store`` (:mod:`welder.schedule.proposals`), a group proposed in an earlier run,
    or by another process, is read from disk rather than proposed again."""

    def __init__(
        self,
        graph: Graph,
        arch: Arch,
        options: Options | None = None,
        workers: int | None = None,
        store: ProposalStore | None = None,
    ) -> None:
        self.graph = graph
        self.arch = arch
        self.options = options or Options()
        self.context = ScheduleContext(self._shape, self._dtype, arch, self.options)
        self._cache: dict[str, list[GroupConfig]] = {}
        self._tensor = functools.cache(graph.tensor)  # asked a million times a search
        self.store = store
        self.calls = 0  # groups proposed here, or learned from a worker process
        self.forked = 0  # of which learned (a worker proposed them, or read them from the store)
        self.stored = 0  # groups read from the store here
        self.workers = usable_cores() if workers is None else workers
        self._pool: multiprocessing.pool.Pool | None = None
        self._forked_with = 0  # memoised groups when the workers were forked

    @contextlib.contextmanager
    def parallel(self) -> Iterator[None]:
        """Worker processes for :meth:`prefetch` while the block runs (a nested call reuses
        them).  None where there is one worker, where ``fork`` is missing, or where other
        threads run: a fork copies their locks in whatever state they are."""
        global _FORKED_MODEL
        usable = self.workers > 1 and "fork" in multiprocessing.get_all_start_methods()
        if self._pool is not None or not usable or threading.active_count() > 1:
            yield
            return
        _FORKED_MODEL = self  # what the forked processes read the graph and options from
        self._fork()
        try:
            yield
        finally:
            self._stop()
            _FORKED_MODEL = None

    def _fork(self) -> None:
        self._pool = multiprocessing.get_context("fork").Pool(self.workers, initializer=_forked_start)
        self._forked_with = len(self._cache)

    def _stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()

    def _workers(self) -> multiprocessing.pool.Pool:
        """The pool, forked again once this process has memoised REFORK_AFTER groups more
        than its workers know: a worker proposes again what it does not have (the nodes
        alone a span's greedy cost weighs, say), and forking is cheap beside that."""
        assert self._pool is not None
        if len(self._cache) >= self._forked_with + REFORK_AFTER:
            self._stop()
            self._fork()
        assert self._pool is not None
        return self._pool

    @property
    def prefetching(self) -> bool:
        """Whether :meth:`prefetch` proposes (inside :meth:`parallel`, with workers)."""
        return self._pool is not None

    def prefetch(self, groups: Iterable[Group]) -> None:
        """Propose the configs of ``groups`` not memoised yet, in the worker processes of
        :meth:`parallel` (nothing outside it).  A group the worker fails on is left to
        :meth:`configs`, which raises as it would have."""
        if self._pool is None:
            return
        todo: dict[str, list[str]] = {}
        for group in groups:
            key = group_signature(self.graph, group)
            if key not in self._cache and key not in todo:
                todo[key] = sorted(group.members)
        if len(todo) >= 2:
            self.map_forked(_rate_forked, [(members,) for members in todo.values()])

    def map_forked(self, fn: Callable[..., T], calls: Sequence[tuple]) -> list[T]:
        """``[fn(self, *args) for args in calls]``, in the worker processes of :meth:`parallel`
        where there are any: each runs with its own copy of this model, whose new memoised
        configs come back into this one.  ``fn`` and ``args`` must pickle (names, not groups);
        a call that raises in a worker is made again here."""
        if self._pool is None or len(calls) < 2:
            return [fn(self, *args) for args in calls]
        results = []
        done = self._workers().map(_call_forked, [(fn, args) for args in calls], chunksize=1)
        for args, (ok, value, learned) in zip(calls, done):
            for key, configs in learned.items():
                self.learn(key, configs)
            results.append(value if ok else fn(self, *args))
        return results

    def memoised(self) -> dict[str, list[GroupConfig]]:
        """The configs proposed so far, by group signature, in canonical names."""
        return self._cache

    def learn(self, key: str, configs: list[GroupConfig] | None) -> None:
        """Take the configs another process proposed for the group of signature ``key``."""
        if configs is not None and key not in self._cache:
            self.calls += 1
            self.forked += 1
            self._cache[key] = configs

    def configs(self, group: Group) -> list[GroupConfig]:
        key = group_signature(self.graph, group)
        names = canonical_names(group)
        if key not in self._cache:
            self._cache[key] = self._stored_or_proposed(group, key, names)
        back = {v: k for k, v in names.items()}
        return [c.renamed(back) for c in self._cache[key]]

    def _stored_or_proposed(self, group: Group, signature: str, names: dict[str, str]) -> list[GroupConfig]:
        store, stored_as = self.store, ""
        if store is not None:
            stored_as = store.key(signature, self.arch, self.options)
            found = store.get(stored_as)
            if found is not None:
                self.stored += 1
                return found
        self.calls += 1
        found = [c.renamed(names) for c in propose(group, self.context)]
        if store is not None:
            store.put(stored_as, found)
        return found

    def __call__(self, group: Group) -> float | None:
        cfgs = self.configs(group)
        return cfgs[0].estimate.latency_us if cfgs else None

    def _shape(self, t: str) -> tuple[int, ...]:
        return self._tensor(t).shape

    def _dtype(self, t: str) -> str:
        return self._tensor(t).dtype


#: The CostModel a forked :meth:`CostModel.prefetch` process proposes for (set before the fork).
_FORKED_MODEL: CostModel | None = None


def _rate_forked(model: CostModel, members: list[str]) -> None:
    """For :meth:`CostModel.prefetch` in a worker: memoise the group of ``members``.  A group
    that fails here is left to the parent's configs(), which raises only if the search
    rates it."""
    with contextlib.suppress(Exception):
        model.configs(make_group(model.graph, members))


def _forked_start() -> None:
    """A worker process's start: its copy of the model proposes alone (no pool of its own)."""
    assert _FORKED_MODEL is not None
    _FORKED_MODEL.workers = 1


def _call_forked(task: tuple[Callable[..., Any], tuple]) -> tuple[bool, Any, dict[str, list[GroupConfig]]]:
    """In a forked process: ``fn(model, *args)``, whether it returned, and the configs the
    model memoised meanwhile."""
    fn, args = task
    model = _FORKED_MODEL
    assert model is not None
    before = set(model._cache)
    try:
        ok, value = True, fn(model, *args)
    except Exception:  # made again in the parent, which raises as it would have
        ok, value = False, None
    return ok, value, {k: v for k, v in model._cache.items() if k not in before}


def _prefetch(measure: LatencyMeasure, groups: Iterable[Group]) -> None:
    """Let a measure that proposes in parallel (CostModel.prefetch) rate ``groups`` ahead."""
    prefetch = getattr(measure, "prefetch", None)
    if prefetch is not None:
        prefetch(groups)


def canonical_names(group: Group) -> dict[str, str]:
    """Tensor name -> position-based name (inputs ``in0..``, stages ``s0..``)."""
    names = {t: f"in{k}" for k, t in enumerate(group.inputs)}
    names.update({m: f"m{k}" for k, m in enumerate(group.members)})
    return names


def group_signature(graph: Graph, group: Group) -> str:
    """Hash of a group's structure: its stage computes with tensors named by position,
    plus the shapes and dtypes of its inputs.  Equal for the repeated layers of a model."""
    names = canonical_names(group)
    h = hashlib.sha256()
    for t in group.inputs:
        info = graph.tensor(t)
        h.update(f"{names[t]}:{info.shape}:{info.dtype};".encode())
    for s in group.stages:
        c = group.computes[s]
        body = format_expr(rename_tensors(c.body, names))
        reduce = [a.extent for a in c.reduce_axes]
        h.update(f"{names[s]}={c.shape}:{c.dtype}:{c.reduce_op}:{reduce}:{body};".encode())
        h.update(f"out={s in group.outputs};".encode())
    return h.hexdigest()[:24]


def graph_signature(graph: Graph) -> str:
    """Hash of a whole graph's structure, tensor names included: every node's compute in
    topological order, the shapes and dtypes of everything it reads, and the outputs.  Two
    graphs with equal signatures fuse into the same groups of the same names (weights'
    values play no part in a plan)."""
    h = hashlib.sha256()
    for node in graph.topo_order():
        c = node.compute
        reads = ",".join(f"{t}:{graph.tensor(t).shape}:{graph.tensor(t).dtype}" for t in c.inputs)
        reduce = [a.extent for a in c.reduce_axes]
        h.update(
            f"{c.name}({reads})={c.shape}:{c.dtype}:{c.reduce_op}:{reduce}:{format_expr(c.body)};".encode()
        )
    h.update(f"outputs={list(graph.outputs)}".encode())
    return h.hexdigest()[:24]


@dataclass
class FusionResult:
    groups: list[Group]  # execution order
    latencies: list[float]
    log: list[str] = field(default_factory=list)

    @property
    def latency_us(self) -> float:
        return sum(self.latencies)


def fuse(
    graph: Graph,
    measure: LatencyMeasure,
    nofusion: bool = False,
    progress: Callable[[int, int], None] | None = None,
    library: Sequence[LibraryGroup] = (),
    only: Collection[str] | None = None,
    max_stages: int = MAX_GROUP_STAGES,
    product_spans: bool = True,
    on_group: Callable[[Group], None] | None = None,
) -> FusionResult:
    """Partition the graph into groups, in execution order.

    ``library`` lists groups a vendor library computes (``--skip-dot``: see
    ``welder.schedule.kinds.library``).  They are fixed before the search, nothing fuses with them
    and they are not measured: their latency is the library's estimate.  With ``nofusion``
    the groups are :func:`nofusion_partition`'s.  ``only`` restricts the search to those
    nodes (re-fusing one group's members), ``max_stages`` caps the tile-owning stages of a
    group; ``product_spans=False`` leaves :func:`_product_spans` out (greedy growth only).
    ``on_group`` is told of each group as the search settles it (none changes after), so
    that a tuner can compile the first groups while the search goes on."""
    # Worker processes for a whole graph's search; re-fusing one group's members (``only``:
    # the tuner's fusion checks, a span's greedy cost) or a small graph is too little work
    # to pay for starting them.
    whole = only is None and len(graph.nodes) >= PARALLEL_MIN_NODES
    parallel = getattr(measure, "parallel", None) if whole else None
    with parallel() if parallel is not None else contextlib.nullcontext():
        return _fuse(graph, measure, nofusion, progress, library, only, max_stages, product_spans, on_group)


def _fuse(
    graph: Graph,
    measure: LatencyMeasure,
    nofusion: bool,
    progress: Callable[[int, int], None] | None,
    library: Sequence[LibraryGroup],
    only: Collection[str] | None,
    max_stages: int,
    product_spans: bool,
    on_group: Callable[[Group], None] | None,
) -> FusionResult:
    order = [n.name for n in graph.topo_order()]
    rank = {n: k for k, n in enumerate(order)}
    scheduled: set[str] = {m for lg in library for m in lg.group.members}
    if only is not None:
        scheduled |= set(order) - set(only)
    found: list[tuple[Group, float]] = [(lg.group, lg.latency_us) for lg in library]
    log: list[str] = []
    part_of: dict[str, set[str]] = {}
    if nofusion:
        part_of = {m: part for part in nofusion_partition(graph, measure, scheduled, log) for m in part}
    search = product_spans and not nofusion
    if not nofusion and getattr(measure, "prefetching", False):
        # every node alone: the seeds of the growth and the parts it weighs
        _prefetch(measure, (make_group(graph, [n]) for n in order if n not in scheduled))
    spans = _product_spans(graph, order, scheduled, measure, rank, log, max_stages) if search else {}
    span_of = {m: span for span in spans.values() for m in span}
    reserved = set(span_of)
    for k, name in enumerate(order):
        if progress:
            progress(k, len(order))
        if name in scheduled:
            continue
        if nofusion:
            members = part_of[name]
        else:
            if name in reserved and name not in spans:
                continue  # a span's node: its first product starts it
            if name in spans:  # a span grows as any group, taking other spans whole
                members = _grow(graph, spans[name], scheduled, measure, rank, log, max_stages, span_of)
            else:  # other groups leave the spans alone
                members = _grow(graph, {name}, scheduled | reserved, measure, rank, log, max_stages)
        group = make_group(graph, members)
        latency = measure(group)
        if latency is None:
            node = graph.nodes[name]
            raise InvalidGroup(f"no valid schedule for node {name!r} ({node.op_type} from {node.source!r})")
        scheduled |= members
        found.append((group, latency))
        if on_group is not None and (only is None or group.root in only):
            on_group(group)
    found = [(g, lat) for g, lat in found if only is None or g.root in only]
    found.sort(key=lambda gl: rank[gl[0].root])
    order = execution_order([g for g, _ in found])
    return FusionResult([found[k][0] for k in order], [found[k][1] for k in order], log)


def nofusion_partition(
    graph: Graph, measure: LatencyMeasure, fixed: Collection[str] = (), log: list[str] | None = None
) -> list[set[str]]:
    """The groups of ``--nofusion``: at most one reduction each, and one group per reduction
    wherever the graph allows, because an injective node is never a kernel of its own when
    a reduction's kernel can compute it.  ``fixed`` nodes (library calls) take no part.

    1. Prologues, walking backwards: an injective node whose readers all lie in one group
       joins that group, where ``make_group`` inlines it (chains of reshapes, transposes,
       padding and casts in front of a matmul).  A graph output does not: it must be
       written whole, which a consumer's tiles need not cover.  Nor does arithmetic on a
       reduction's result (a bias add, an activation) in front of another reduction: a
       product reads each operand element many times, so a prologue would recompute it at
       every read, and it would keep the product off its tensor-core and FFMA kinds, which
       take their operands as loads; it waits to be the epilogue of the reduction it comes
       from (step 2), as rule-based fusion does.  Every other node anchors a group: each
       reduction, and each injective node read by several groups or none.
    2. Epilogues, walking forwards: a group anchored at an injective node joins a group
       holding a reduction whose sink it reads, becoming that group's sink, if the union is
       still one convex kernel the measure can schedule and finds no slower than the two
       apart: a rearranging epilogue (Restormer's DepthToSpace, concatenation and transpose
       after its upsampling convolution) dictates the reduction's tiles and can take it off
       FFMA, 2.9 ms against about 0.3 apart in fp32 on an H200.  The latest such sink is tried
       first: joining an earlier one fails when the later one depends on it (a path would
       leave the group and come back).  A lone view
       (a reshape that moves no data) joins only if it is its producer's only reader: left
       alone it is an alias that launches nothing, and the producer's sink stays free for a
       computation that would otherwise be a kernel of its own.
    3. Arithmetic that step 1 kept out of a prologue and that no epilogue took becomes
       the prologue it would have been after all (a scaling of one head of a shared
       projection, say), rather than a kernel of its own -- where the measure finds the
       union no slower than the two kernels apart.  Restormer's normalised queries and keys
       (each row divided by its L2 norm over 65,536 pixels) took their product off FFMA as
       its prologue: 1,789 us an attention block on an H200 in fp32, against 99 us for the
       product and 15 us for the division apart.
    4. Prologues apart: each connected piece of what a reduction's group computes in front
       of the reduction becomes a kernel of its own where the measure finds the two
       kernels faster than the group.  A concatenation in front of BSRN's 1x1 convolutions
       kept them off the tensor cores (1.59 ms of its fp16 `--nofusion` on an H200; full
       welder's search splits them).
    5. The groups left anchored at an injective node (nothing upstream to join, or the sink
       taken) are kernels of their own; a group that cannot be scheduled as one kernel
       falls back to one group per node.
    """
    order = [n.name for n in graph.topo_order() if n.name not in fixed]
    rank = {n: k for k, n in enumerate(order)}

    def shape_of(t: str) -> tuple[int, ...]:
        return graph.tensor(t).shape

    after_reduction: dict[str, bool] = {}  # an injective node a reduction's epilogue could take
    for name in order:
        producers = [graph.nodes[t] for t in graph.nodes[name].inputs if t in rank]
        after_reduction[name] = graph.nodes[name].compute.is_injective and any(
            p.compute.is_reduction or after_reduction[p.name] for p in producers
        )
    home: dict[str, int] = {}
    parts: list[set[str]] = []
    anchored_by_reduction: set[int] = set()
    deferred: set[int] = set()  # arithmetic kept out of a reduction's prologue
    for name in reversed(order):
        readers = {home.get(c.name, -1) for c in graph.consumers(name)}  # -1: a fixed node
        compute = graph.nodes[name].compute
        inlined = compute.is_injective and name not in graph.outputs
        if inlined and len(readers) == 1 and -1 not in readers:
            part = readers.pop()
            if part in anchored_by_reduction and after_reduction[name] and _arithmetic(compute):
                part = len(parts)
                parts.append(set())
                deferred.add(part)
        else:
            if compute.is_reduction:
                anchored_by_reduction.add(len(parts))
            part = len(parts)
            parts.append(set())
        parts[part].add(name)
        home[name] = part
    root = {k: max(part, key=rank.__getitem__) for k, part in enumerate(parts)}

    def cost(members: set[str]) -> float | None:
        try:
            return measure(make_group(graph, members))
        except InvalidGroup:
            return None

    def join(k: int, target: int, within: float | None = None) -> bool:
        """Part ``k`` into part ``target``, if the union is one group the measure schedules
        (in at most ``within`` us, where given)."""
        union = cost(parts[target] | parts[k])
        if union is None or (within is not None and union > within):
            return False
        parts[target] |= parts[k]
        home.update(dict.fromkeys(parts[k], target))
        parts[k] = set()
        return True

    def join_if_no_slower(k: int, target: int) -> bool:
        """:func:`join`, where the measure finds the union no slower than the two kernels
        (unconditionally where it cannot measure one of them alone)."""
        alone, other = cost(parts[k]), cost(parts[target])
        return join(k, target, None if alone is None or other is None else alone + other)

    reducing = {k for k, part in enumerate(parts) if any(graph.nodes[m].compute.is_reduction for m in part)}
    for k in sorted(set(range(len(parts))) - reducing, key=lambda k: rank[root[k]]):
        part = parts[k]
        read = {t for m in part for t in graph.nodes[m].inputs if t in home and t not in part}
        sinks = sorted((t for t in read if home[t] in reducing and root[home[t]] == t), key=rank.__getitem__)
        lone_view = len(part) == 1 and aliased_input(graph.nodes[root[k]].compute, shape_of) is not None
        for t in reversed(sinks):
            if lone_view and len(graph.consumers(t)) > 1:
                continue
            target = home[t]
            if join_if_no_slower(k, target):
                root[target] = root[k]
                break
    for k in sorted(deferred, key=lambda k: rank[root[k]], reverse=True):
        part = parts[k]
        readers = {home.get(c.name, -1) for m in part for c in graph.consumers(m) if c.name not in part}
        if part and len(readers) == 1 and -1 not in readers and not any(m in graph.outputs for m in part):
            join_if_no_slower(k, readers.pop())
    for k in sorted(reducing, key=lambda k: rank[root[k]]):
        for piece in _prologue_pieces(graph, parts[k]):
            whole, rest, alone = cost(parts[k]), cost(parts[k] - piece), cost(piece)
            if None not in (whole, rest, alone) and rest + alone < whole:
                if log is not None:
                    log.append(
                        f"nofusion: prologue {sorted(piece)} apart: {rest + alone:.2f} < {whole:.2f} us"
                    )
                parts[k] -= piece
                parts.append(piece)
    found = []
    for part in filter(None, parts):
        if len(part) > 1 and measure(make_group(graph, part)) is None:
            if log is not None:
                log.append(f"nofusion: {sorted(part)} cannot be one kernel; one group per node")
            found.extend({m} for m in part)
        else:
            found.append(part)
    return found


def _prologue_pieces(graph: Graph, members: set[str]) -> list[set[str]]:
    """The members a group's reduction reads, directly or through others (its prologue),
    in connected pieces: each may be a kernel of its own."""
    within = graph.nx.subgraph(members)
    ahead = set().union(*(nx.ancestors(within, m) for m in members if graph.nodes[m].compute.is_reduction))
    return sorted((set(p) for p in nx.weakly_connected_components(within.subgraph(ahead))), key=sorted)


def _arithmetic(compute: Compute) -> bool:
    """Whether the body computes on values (float arithmetic or a call), not only moves them."""
    return any(isinstance(n, (Binary, Call)) and is_float(n.dtype) for n in walk(compute.body))


def _grow(
    graph: Graph,
    members: set[str],
    scheduled: set[str],
    measure: LatencyMeasure,
    rank: dict[str, int],
    log: list[str],
    max_stages: int = MAX_GROUP_STAGES,
    span_of: dict[str, set[str]] | None = None,
) -> set[str]:
    """Grow ``members`` one consumer at a time (with its unscheduled producers) while the
    fused group is no slower than its parts; a node of a product span (``span_of``) joins
    only with its whole span."""
    span_of = span_of or {}
    current = measure(make_group(graph, members))
    if current is None:
        return members
    grown = True
    while grown:
        grown = False
        trials: Iterable[tuple[set[str], set[str], Group]] = _trials(
            graph, members, scheduled, rank, max_stages, span_of
        )
        if getattr(measure, "prefetching", False):  # all of them at once, in parallel
            trials = list(trials)
            ahead = _ahead(trials, graph, scheduled, rank, max_stages, span_of)
            _prefetch(measure, [*(group for _, _, group in trials), *ahead])
        for extra, trial, group in trials:
            fused = measure(group)
            parts = _separate_cost(graph, extra, measure)
            if fused is None or parts is None:
                continue
            if fused <= current + parts:
                log.append(f"fuse {sorted(extra)} into {group.root}: {fused:.2f} <= {current + parts:.2f} us")
                members, current, grown = trial, fused, True
                break
    return members


def _ahead(
    trials: Sequence[tuple[set[str], set[str], Group]],
    graph: Graph,
    scheduled: set[str],
    rank: dict[str, int],
    max_stages: int,
    span_of: dict[str, set[str]],
) -> list[Group]:
    """The trials of the next growth step if the first of ``trials`` is taken (it mostly is):
    rated with them, the step after needs no wait either where a step has one trial, which
    alone would leave the workers idle."""
    if not trials:
        return []
    _, first, _ = trials[0]
    return [group for _, _, group in _trials(graph, first, scheduled, rank, max_stages, span_of)]


def _trials(
    graph: Graph,
    members: set[str],
    scheduled: set[str],
    rank: dict[str, int],
    max_stages: int,
    span_of: dict[str, set[str]],
) -> Iterator[tuple[set[str], set[str], Group]]:
    """The groups one growth step of ``members`` may become, in the order it tries them:
    (the nodes added, the members then, the group); made as they are asked for, since the
    step usually stops at the first."""
    for cand in _candidates(graph, members, scheduled, rank):
        extra = _with_spans(graph, cand, members, scheduled, span_of)
        if extra is None:
            continue
        trial = members | extra
        try:
            group = make_group(graph, trial)
        except InvalidGroup:
            continue
        if len(group.members) <= MAX_GROUP_MEMBERS and len(group.stages) <= max_stages:
            yield extra, trial, group


def _product_spans(
    graph: Graph,
    order: Sequence[str],
    scheduled: set[str],
    measure: LatencyMeasure,
    rank: dict[str, int],
    log: list[str],
    max_stages: int,
) -> dict[str, set[str]]:
    """Groups that span from a product to the nearest product its result flows into (every
    node on a path between them), kept where that group is estimated faster than its nodes
    apart; by the first product.  Greedy growth one consumer at a time cannot find them: the
    steps between (scores, a softmax) each cost more fused than apart, and only the second
    product pays for them (the ``attention`` kind keeps the scores in registers).  The
    spans are fixed before the search, so that no other group claims their nodes first (a
    projection taking the first product as a later stage)."""
    candidates: list[tuple[str, set[str], Group]] = []
    for name in order:
        if name in scheduled or not graph.nodes[name].compute.is_product:
            continue
        down = _downstream(graph, name, scheduled)
        other = next(
            (
                n
                for n in sorted(down, key=rank.__getitem__)
                if n != name and graph.nodes[n].compute.is_product
            ),
            None,
        )
        if other is None or not (
            _matrix_product(graph.nodes[name].compute) or _matrix_product(graph.nodes[other].compute)
        ):
            continue
        span = _with_copies_in(graph, _upstream_within(graph, other, down), scheduled)
        try:
            group = make_group(graph, span)
        except InvalidGroup:
            continue
        if len(group.stages) <= max_stages:
            candidates.append((name, span, group))
    _prefetch(measure, (group for _, _, group in candidates))
    rated: list[tuple[str, set[str], float, float]] = []
    signatures: list[str] = []
    for name, span, group in candidates:
        fused = measure(group)
        parts = _separate_cost(graph, span, measure)
        if fused is not None and parts is not None and fused < parts:
            rated.append((name, span, fused, parts))
            signatures.append(group_signature(graph, group))
    greedy = _greedy_costs(graph, [span for _, span, _, _ in rated], signatures, measure, max_stages)
    found = [
        (parts - fused, name, span)
        for (name, span, fused, parts), alone in zip(rated, greedy)
        if fused <= alone  # often the span itself
    ]
    # Largest gain first: of a chain of products (a projection, the scores, their product
    # with values, the next projection) each overlapping span competes with its neighbours.
    spans: dict[str, set[str]] = {}
    taken: set[str] = set()
    for gain, name, span in sorted(found, key=lambda f: (-f[0], rank[f[1]])):
        if span & taken:
            continue
        log.append(f"span {sorted(span)} from {name}: {gain:.2f} us faster than apart")
        spans[name] = span
        taken |= span
    return spans


def _matrix_product(c: Compute) -> bool:
    """Whether ``c`` is a product of two different operands (a matmul, a convolution) rather
    than a sum of squares (a LayerNorm's variance, a product by its body).  A span needs
    one: it exists for a product kind that keeps the steps before or after it on chip.
    Between two norms' sums of squares nothing pays for the steps, and such a span claimed
    the second half of one LayerNorm and all of the next: at Conformer's layer boundaries
    (b64 fp16, H200) the final LayerNorm ran as two kernels, 95 us with the next layer's,
    against 51 us for the two norms apart."""
    return c.is_product and isinstance(c.body, Binary) and c.body.a != c.body.b


def _greedy_costs(
    graph: Graph, spans: list[set[str]], signatures: list[str], measure: LatencyMeasure, max_stages: int
) -> list[float]:
    """:func:`_greedy_cost` of each span, once per structure (``signatures``: the spans'
    group signatures; a model's repeated layers have the same spans, and each search is a
    chain of proposals before the search's first group): in parallel where the measure runs
    calls in worker processes (``CostModel.map_forked``; the searches are independent)."""
    first: dict[str, int] = {}
    for k, key in enumerate(signatures):
        first.setdefault(key, k)
    todo = [spans[k] for k in first.values()]
    run = getattr(measure, "map_forked", None)
    if run is None:
        costs = [_greedy_cost(graph, span, measure, max_stages) for span in todo]
    else:
        costs = run(_forked_greedy_cost, [(sorted(span), max_stages) for span in todo])
    by_signature = dict(zip(first, costs))
    return [by_signature[key] for key in signatures]


def _forked_greedy_cost(model: CostModel, span: list[str], max_stages: int) -> float:
    return _greedy_cost(model.graph, set(span), model, max_stages)


def _greedy_cost(graph: Graph, span: set[str], measure: LatencyMeasure, max_stages: int) -> float:
    """What a span's nodes cost fused greedily without it (inf where they cannot be).  A span
    must beat this as well as one kernel per node: against the latter alone, a span whose
    product falls to CUDA cores (a projection fused with the window partition and LayerNorm
    after it, which no tensor-core kind takes as later stages) still looks cheap, though a
    tensor-core group and a fused normalisation measure three times faster."""
    try:
        return fuse(graph, measure, only=span, max_stages=max_stages, product_spans=False).latency_us
    except InvalidGroup:
        return math.inf


def _with_copies_in(graph: Graph, span: set[str], scheduled: set[str]) -> set[str]:
    """``span`` and the copies feeding it (reshapes, transposes, slices: a body that is one
    load) that only it reads: inlined, they leave the products reading their sources through
    strides, where a transposed copy of its own could have rows no copy width divides
    (Swin's keys: 49 halves a row)."""
    span = set(span)
    grown = True
    while grown:
        grown = False
        for t in {t for m in span for t in graph.nodes[m].inputs}:
            node = graph.nodes.get(t)
            if node is None or t in span or t in scheduled:
                continue
            if not node.compute.is_injective or not isinstance(node.compute.body, Load):
                continue
            if t not in graph.outputs and all(c.name in span for c in graph.consumers(t)):
                span.add(t)
                grown = True
    return span


def _downstream(graph: Graph, name: str, taken: set[str]) -> set[str]:
    """``name`` and the nodes its result reaches, at most a group's worth, none taken."""
    found, frontier = {name}, [name]
    while frontier and len(found) < MAX_GROUP_MEMBERS:
        for c in graph.consumers(frontier.pop(0)):
            if c.name not in found and c.name not in taken:
                found.add(c.name)
                frontier.append(c.name)
    return found


def downstream_within(graph: Graph, name: str, within: set[str]) -> set[str]:
    """``name`` and the nodes of ``within`` its result reaches."""
    found, stack = {name}, [name]
    while stack:
        for c in graph.consumers(stack.pop()):
            if c.name in within and c.name not in found:
                found.add(c.name)
                stack.append(c.name)
    return found


def _upstream_within(graph: Graph, name: str, within: set[str]) -> set[str]:
    """``name`` and the nodes of ``within`` it depends on."""
    found, stack = {name}, [name]
    while stack:
        for t in graph.nodes[stack.pop()].inputs:
            if t in within and t not in found:
                found.add(t)
                stack.append(t)
    return found


def _candidates(graph: Graph, members: set[str], scheduled: set[str], rank: dict[str, int]) -> list[str]:
    out = {c.name for m in members for c in graph.consumers(m)} - members - scheduled
    return sorted(out, key=rank.__getitem__)


def _with_spans(
    graph: Graph, cand: str, members: set[str], scheduled: set[str], span_of: dict[str, set[str]]
) -> set[str] | None:
    """:func:`_with_producers` of ``cand``, and of every node of a span any of them is in."""
    extra: set[str] = set()
    todo = [cand]
    while todo:
        node = todo.pop()
        if node in extra or node in members:
            continue
        more = _with_producers(graph, node, members | extra, scheduled)
        if more is None or len(extra | more) > MAX_GROUP_MEMBERS:
            return None
        extra |= more
        todo += [m for n in more for m in span_of.get(n, ()) if m not in extra and m not in members]
    return extra


def _with_producers(graph: Graph, cand: str, members: set[str], scheduled: set[str]) -> set[str] | None:
    """``cand`` plus every not-yet-scheduled node it depends on that is not a member (the
    other operand of an attention matmul and its projection, say)."""
    extra = {cand}
    stack = [cand]
    while stack:
        for t in graph.nodes[stack.pop()].inputs:
            if t in graph.nodes and t not in members and t not in scheduled and t not in extra:
                extra.add(t)
                stack.append(t)
                if len(extra) > MAX_GROUP_MEMBERS:
                    return None
    return extra


def _separate_cost(graph: Graph, nodes: Iterable[str], measure: LatencyMeasure) -> float | None:
    total = 0.0
    for n in nodes:
        lat = measure(make_group(graph, [n]))
        if lat is None:
            return None
        total += lat
    return total


def unfused_latency(graph: Graph, members: Sequence[str], measure: LatencyMeasure) -> float | None:
    """Sum of the members' latencies as one kernel each (the no-fusion baseline)."""
    return _separate_cost(graph, members, measure)
