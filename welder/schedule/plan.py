"""A whole model's schedule: fusion plus configs, its report and ``tuned.json``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from welder.arch import Arch
from welder.files import write_json
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.engine import CostModel, fuse, group_signature
from welder.schedule.group import Group, make_group
from welder.schedule.kinds import Options
from welder.schedule.kinds.library import LibraryGroup, find_gemm_groups, library_call
from welder.schedule.proposals import DEFAULT_STORE, ProposalStore


@dataclass
class PlannedGroup:
    group: Group
    configs: list[GroupConfig]  # best first
    unfused_us: float  # its members as one kernel each
    unfused_bytes: int
    unfused_measured: bool = False  # unfused_us measured on the GPU, not predicted

    @property
    def latency_us(self) -> float:
        """The latency the plan works with: measured where it was, else predicted."""
        return self.configs[0].estimate.latency_us

    @property
    def predicted_us(self) -> float:
        """The cost model's latency of the chosen config (kept even once measured, so the
        report can put prediction next to measurement)."""
        return self.configs[0].estimate.latency_us

    @property
    def measured_latency_us(self) -> float | None:
        """The GPU's latency of the chosen config; None where nothing was measured."""
        return None

    @property
    def traffic_bytes(self) -> int:
        return traffic_of(self.configs[0])

    @property
    def library(self) -> str | None:
        """The vendor library that computes this group ("cublas"), None for a generated kernel."""
        call = library_call(self.configs[0])
        return call.gemm.library if call is not None else None


def library_planned(lg: LibraryGroup) -> PlannedGroup:
    """A library group in a plan: its one config; it has no unfused alternative, so
    its unfused baseline is itself."""
    return PlannedGroup(lg.group, [lg.config], lg.latency_us, traffic_of(lg.config))


@dataclass(frozen=True)
class SplitFailure:
    """A fused group that measured far slower than predicted, which the fusion check could
    not replace by shallower groups: it stays fused, and the plan says so and why."""

    root: str
    members: tuple[str, ...]
    ops: tuple[str, ...]
    measured_us: float | None  # the fused group's best candidate; None: it has none
    predicted_us: float
    reason: str

    def message(self) -> str:
        measured = "no valid candidate" if self.measured_us is None else f"{self.measured_us:.1f} us measured"
        kept = "" if self.measured_us is None else "; the fused group is kept"
        return (
            f"fusion check could not split group {self.root} ({len(self.members)} ops: "
            f"{abbreviate_ops(list(self.ops), 60)}; {measured}, {self.predicted_us:.1f} us predicted): "
            f"{self.reason}{kept}"
        )

    def to_json(self) -> dict:
        return {
            "root": self.root,
            "members": list(self.members),
            "ops": list(self.ops),
            "measured_latency_us": None if self.measured_us is None else round(self.measured_us, 4),
            "predicted_latency_us": round(self.predicted_us, 4),
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, d: dict) -> SplitFailure:
        """The failure :meth:`to_json` wrote (the tuning cache keeps a model's plan so)."""
        return cls(
            d["root"],
            tuple(d["members"]),
            tuple(d["ops"]),
            d["measured_latency_us"],
            d["predicted_latency_us"],
            d["reason"],
        )


@dataclass
class Plan:
    model: str
    arch: Arch
    measure: str
    nofusion: bool
    topk: int
    groups: list[PlannedGroup]
    seconds: float
    log: list[str] = field(default_factory=list)
    skip_dot: bool = False
    split_failures: list[SplitFailure] = field(default_factory=list)
    # Seconds per phase of a measured tune (welder.tune.phases), longest first; empty otherwise.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # What a measured tune did on all its threads (welder.tune.phases.Phases.work_done):
    # groups tuned, kernels compiled, nvcc's seconds summed over its parallel calls.
    tuning_work: dict[str, float] = field(default_factory=dict)

    @property
    def library_calls(self) -> int:
        return sum(1 for g in self.groups if g.library is not None)

    @property
    def kernels(self) -> int:
        """Groups that are generated kernels (views included)."""
        return len(self.groups) - self.library_calls

    @property
    def latency_us(self) -> float:
        return sum(g.latency_us for g in self.groups)

    @property
    def predicted_latency_us(self) -> float:
        return sum(g.predicted_us for g in self.groups)

    @property
    def measured(self) -> bool:
        """Whether any group's latency was measured on a GPU."""
        return any(g.measured_latency_us is not None for g in self.groups)

    @property
    def measured_kernels_us(self) -> float | None:
        """The sum of the measured groups' latencies (library calls have none): one kernel
        at a time in isolation, not the model run end to end."""
        if not self.measured:
            return None
        return sum(g.measured_latency_us or 0.0 for g in self.groups)

    @property
    def unmeasured_groups(self) -> int:
        return sum(1 for g in self.groups if g.measured_latency_us is None)

    @property
    def unfused_basis(self) -> str:
        """How the unfused baseline was obtained: measured, predicted, or mixed."""
        return _basis([g.unfused_measured for g in self.groups])

    @property
    def traffic_bytes(self) -> int:
        return sum(g.traffic_bytes for g in self.groups)

    @property
    def unfused_latency_us(self) -> float:
        return sum(g.unfused_us for g in self.groups)

    @property
    def unfused_traffic_bytes(self) -> int:
        return sum(g.unfused_bytes for g in self.groups)

    @property
    def unfused_kernels(self) -> int:
        return sum(len(g.group.members) for g in self.groups)


def plan_model(
    graph: Graph,
    arch: Arch,
    topk: int = 1,
    nofusion: bool = False,
    model: str = "",
    progress: Callable[[int, int], None] | None = None,
    skip_dot: bool = False,
    kinds: Sequence[str] = Options.kinds,
    store: ProposalStore | None = DEFAULT_STORE,
) -> Plan:
    """Fuse ``graph`` and pick configs with the cost model; with ``skip_dot`` every matrix
    product the library can compute is a cuBLAS call instead of a kernel.  ``kinds`` are the
    kernel kinds that may propose configs (``("simt",)``: no tensor cores).  Proposals are
    kept in ``store`` (None: none kept), so planning the model again reads them."""
    start = time.perf_counter()
    cost = CostModel(graph, arch, Options(topk=topk, kinds=tuple(kinds)), store=store)
    library = {lg.group.root: lg for lg in find_gemm_groups(graph, arch)} if skip_dot else {}
    result = fuse(graph, cost, nofusion=nofusion, progress=progress, library=list(library.values()))
    groups = []
    for group in result.groups:
        if group.root in library:
            groups.append(library_planned(library[group.root]))
            continue
        singles = [cost.configs(make_group(graph, [m]))[0] for m in group.members]
        groups.append(
            PlannedGroup(
                group,
                cost.configs(group),
                sum(c.estimate.latency_us for c in singles),
                sum(traffic_of(c) for c in singles),
            )
        )
    return Plan(
        model or graph.name,
        arch,
        "cost-model",
        nofusion,
        topk,
        groups,
        time.perf_counter() - start,
        result.log,
        skip_dot,
    )


def traffic_of(cfg: GroupConfig) -> int:
    """DRAM traffic a kernel cannot avoid: each tensor it reads or writes, once.  Fusion
    lowers it by keeping intermediates on chip; re-reads across blocks (mostly L2 hits)
    are in the estimate's read_bytes instead."""
    return cfg.estimate.compulsory_bytes


def tuned_json(plan: Plan, graph: Graph) -> dict:
    """The plan as JSON (``tuned.json``).  Every latency says what it is: the cost model's
    ``predicted_latency_us``, the GPU's ``measured_latency_us`` (null without a GPU), and
    ``gain_basis`` says which two numbers ``gain_us`` subtracts -- with fusion decided by the
    cost model the unfused baseline is a prediction while the fused group is measured, and
    the reader must be able to tell.  Measured plans add whether each config came from the
    tuning cache and how many candidates were tried, and ``timed`` every config the run
    timed, per group signature (``welder.tune.tuner.timed_records``).  ``totals.measured_runtime_us`` is
    filled by ``welder tune`` once the built runtime has been timed end to end."""
    groups = []
    timed: dict[str, list[dict]] = {}
    for k, g in enumerate(plan.groups):
        grp = g.group
        measured = g.measured_latency_us
        extra = {x: getattr(g, x) for x in ("candidates", "from_cache") if hasattr(g, x)}
        signature = group_signature(graph, grp)
        if getattr(g, "timed", None):
            timed.setdefault(signature, g.timed)
        groups.append(
            {
                "index": k,
                "name": f"group_{k}",
                "signature": signature,
                "root": grp.root,
                "members": list(grp.members),
                "ops": [graph.nodes[m].op_type for m in grp.members],
                "inputs": list(grp.inputs),
                "outputs": list(grp.outputs),
                "stages": list(grp.stages),
                "predicted_latency_us": round(g.predicted_us, 4),
                "measured_latency_us": None if measured is None else round(measured, 4),
                "unfused_latency_us": round(g.unfused_us, 4),
                "unfused_basis": _basis([g.unfused_measured]),
                "gain_us": round(g.unfused_us - g.latency_us, 4),
                "gain_basis": gain_basis(_basis([g.unfused_measured]), measured is not None),
                "library": g.library,
                "configs": [c.to_json() for c in g.configs],
                **extra,
            }
        )
    kernels_us = plan.measured_kernels_us
    return {
        "format": "welder.tuned/3",
        "model": plan.model,
        "arch": plan.arch.name,
        "measure": plan.measure,
        "topk": plan.topk,
        "nofusion": plan.nofusion,
        "skip_dot": plan.skip_dot,
        "groups": groups,
        "split_failures": [f.to_json() for f in plan.split_failures],
        # The fusion check's verdicts: a fused group the GPU disproved, split or kept.
        "fusion_checks": [ln for ln in plan.log if " split into " in ln or ln.startswith("fusion of ")],
        # Every config timed for each group signature tuned in this run (none from the cache).
        "timed": timed,
        "totals": {
            "kernels": plan.kernels,
            "library_calls": plan.library_calls,
            "unfused_kernels": plan.unfused_kernels,
            "predicted_latency_us": round(plan.predicted_latency_us, 3),
            "measured_kernels_us": None if kernels_us is None else round(kernels_us, 3),
            "unmeasured_groups": plan.unmeasured_groups,
            "measured_runtime_us": None,
            "unfused_latency_us": round(plan.unfused_latency_us, 3),
            "unfused_basis": plan.unfused_basis,
            "traffic_bytes": plan.traffic_bytes,
            "unfused_traffic_bytes": plan.unfused_traffic_bytes,
            "tuning_seconds": round(plan.seconds, 2),
            "tuning_phase_seconds": dict(plan.phase_seconds),
            "tuning_work": dict(plan.tuning_work),
        },
    }


def _phases(plan: Plan) -> str:
    """`` (nvcc 120 s, reference 80 s, ..., the rest 12 s)`` for a measured tune."""
    if not plan.phase_seconds:
        return ""
    rest = max(plan.seconds - sum(plan.phase_seconds.values()), 0.0)
    parts = [f"{name} {s:.0f} s" for name, s in plan.phase_seconds.items()]
    return f" ({', '.join([*parts, f'the rest {rest:.0f} s'])})"


def gain_basis(unfused: str, fused_measured: bool) -> str:
    """What a gain subtracts, e.g. ``predicted unfused - measured fused``; ``unfused`` is
    the baseline's basis (:func:`_basis`)."""
    return f"{unfused} unfused - {'measured' if fused_measured else 'predicted'} fused"


def _basis(flags: list[bool]) -> str:
    """measured, predicted, or mixed: how latencies flagged as measured or not were had."""
    if flags and all(flags):
        return "measured"
    return "mixed" if any(flags) else "predicted"


def write_tuned_json(plan: Plan, graph: Graph, path: str) -> None:
    write_json(tuned_json(plan, graph), path)


# Short spellings of long op types, so a group's ops fit one column of the summary.
_SHORT_OPS = {
    "LayerNormalization": "LayerNorm",
    "BatchNormalization": "BatchNorm",
    "InstanceNormalization": "InstNorm",
    "GroupNormalization": "GroupNorm",
    "GlobalAveragePool": "GAvgPool",
    "ReduceMean": "RMean",
    "ReduceSum": "RSum",
    "ReduceMax": "RMax",
    "Unsqueeze": "Unsq",
    "Transpose": "Transp",
    "ConvTranspose": "ConvT",
}


def abbreviate_ops(ops: list[str], width: int = 30) -> str:
    """A group's member op types in a column of ``width``: the sequence with repeats folded
    (``MatMul+Add+Relu``), or, when that is too long, each op type once in order of first
    appearance (``Unsq Cast Sub MatMul ...``): enough to recognise the group; tuned.json
    has every member."""
    short = [_SHORT_OPS.get(op, op) for op in ops]
    folded = [op for k, op in enumerate(short) if k == 0 or short[k - 1] != op]
    text = "+".join(folded)
    if len(text) <= width:
        return text
    words = list(dict.fromkeys(short))
    kept: list[str] = []
    for word in words:
        if len(" ".join([*kept, word])) > width - 4:
            break
        kept.append(word)
    if not kept:
        return words[0][: width - 3] + "..."
    return " ".join(kept) + (" ..." if len(kept) < len(words) else "")


def format_summary(plan: Plan, graph: Graph, width: int = 28) -> str:
    """The terminal table: one row per group -- its ops, root, config (tile, threads,
    shared memory), traffic, predicted and (when tuned on a GPU) measured latency, gain
    over the unfused members -- then totals.  The gain column says which latencies it
    subtracts, as tuned.json does."""
    measured = plan.measured
    gain = gain_basis(plan.unfused_basis, measured)
    header = (
        f"{'#':>3}  {'ops':<30} {'group (root)':<{width}} {'n':>3} {'tile':<12} {'thr':>4} {'smem KB':>7} "
        f"{'DRAM MB':>8} {'pred us':>8}" + (f" {'meas us':>8}" if measured else "") + f" {'gain us':>8}"
    )
    rows = [header]
    for k, g in enumerate(plan.groups):
        grp = g.group
        cfg = g.configs[0]
        ops = abbreviate_ops([graph.nodes[m].op_type for m in grp.members])
        root = grp.root if len(grp.root) <= width else "..." + grp.root[-(width - 3) :]
        library = g.library == "cublas"
        tile = "cuBLAS" if library else "x".join(map(str, cfg.block_tile)) or "1"
        threads = "-" if library else str(cfg.threads)
        meas = g.measured_latency_us
        meas_col = (f" {meas:>8.2f}" if meas is not None else f" {'-':>8}") if measured else ""
        rows.append(
            f"{k:>3}  {ops:<30} {root:<{width}} {len(grp.members):>3} {tile:<12} {threads:>4} "
            f"{cfg.smem_bytes / 1024:>7.1f} {g.traffic_bytes / 1e6:>8.3f} {g.predicted_us:>8.2f}{meas_col} "
            f"{g.unfused_us - g.latency_us:>8.2f}"
        )
    mb = 1e6
    kernels_us = plan.measured_kernels_us
    if kernels_us is not None:
        skipped = plan.unmeasured_groups
        unmeasured = f", {skipped} library calls not measured" if skipped else ""
        latency = (
            f"predicted latency {plan.predicted_latency_us:.1f} us, measured kernels {kernels_us:.1f} us "
            f"(sum of per-kernel timings{unmeasured})"
        )
    else:
        latency = f"predicted latency {plan.predicted_latency_us:.1f} us"
    calls = f" + {plan.library_calls} cuBLAS calls" if plan.library_calls else ""
    rows.append(
        f"{plan.kernels} kernels{calls} (unfused: {plan.unfused_kernels}); {latency}; "
        f"unfused {plan.unfused_latency_us:.1f} us ({plan.unfused_basis}); gain = {gain}; compulsory DRAM "
        f"traffic {plan.traffic_bytes / mb:.2f} MB (unfused: {plan.unfused_traffic_bytes / mb:.2f} MB); "
        f"arch {plan.arch.name}, {plan.measure}; tuning {plan.seconds:.1f} s{_phases(plan)}"
    )
    rows += [f"warning: {f.message()}" for f in plan.split_failures]
    return "\n".join(rows)
