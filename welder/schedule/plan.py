"""A whole model's schedule: fusion plus configs, its report and ``tuned.json``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from welder.arch import Arch
from welder.graph import Graph
from welder.schedule.config import GroupConfig
from welder.schedule.engine import CostModel, fuse, group_signature
from welder.schedule.group import Group, make_group
from welder.schedule.library import LibraryGroup, find_gemm_groups
from welder.schedule.policy import Options


@dataclass
class PlannedGroup:
    group: Group
    configs: list[GroupConfig]  # best first
    unfused_us: float  # its members as one kernel each
    unfused_bytes: int

    @property
    def latency_us(self) -> float:
        return self.configs[0].estimate.latency_us

    @property
    def traffic_bytes(self) -> int:
        return traffic_of(self.configs[0])

    @property
    def library(self) -> str | None:
        """The vendor library that computes this group ("cublas"), None for a generated kernel."""
        gemm = self.configs[0].gemm
        return gemm.library if gemm is not None else None


def library_planned(lg: LibraryGroup) -> PlannedGroup:
    """A library group in a plan: its one marker config; it has no unfused alternative, so
    its unfused baseline is itself."""
    return PlannedGroup(lg.group, [lg.config], lg.latency_us, traffic_of(lg.config))


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
) -> Plan:
    """Fuse ``graph`` and pick configs with the cost model; with ``skip_dot`` every matrix
    product the library can compute is a cuBLAS call instead of a kernel."""
    start = time.perf_counter()
    cost = CostModel(graph, arch, Options(topk=topk))
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
    """The plan as JSON (``tuned.json``); measured plans add, per group, whether its
    config came from the tuning cache and how many candidates were tried."""
    groups = []
    for k, g in enumerate(plan.groups):
        grp = g.group
        measured = {x: getattr(g, x) for x in ("measured_us", "candidates", "from_cache") if hasattr(g, x)}
        groups.append(
            {
                "index": k,
                "name": f"group_{k}",
                "signature": group_signature(graph, grp),
                "root": grp.root,
                "members": list(grp.members),
                "ops": [graph.nodes[m].op_type for m in grp.members],
                "inputs": list(grp.inputs),
                "outputs": list(grp.outputs),
                "stages": list(grp.stages),
                "latency_us": g.latency_us,
                "unfused_latency_us": round(g.unfused_us, 4),
                "gain_us": round(g.unfused_us - g.latency_us, 4),
                "library": g.library,
                "configs": [c.to_json() for c in g.configs],
                **measured,
            }
        )
    return {
        "format": "welder.tuned/1",
        "model": plan.model,
        "arch": plan.arch.name,
        "measure": plan.measure,
        "topk": plan.topk,
        "nofusion": plan.nofusion,
        "skip_dot": plan.skip_dot,
        "groups": groups,
        "totals": {
            "kernels": plan.kernels,
            "library_calls": plan.library_calls,
            "estimated_latency_us": round(plan.latency_us, 3),
            "traffic_bytes": plan.traffic_bytes,
            "unfused_kernels": plan.unfused_kernels,
            "unfused_latency_us": round(plan.unfused_latency_us, 3),
            "unfused_traffic_bytes": plan.unfused_traffic_bytes,
            "tuning_seconds": round(plan.seconds, 2),
        },
    }


def write_tuned_json(plan: Plan, graph: Graph, path: str) -> None:
    write_json(tuned_json(plan, graph), path)


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def format_summary(plan: Plan, graph: Graph, width: int = 44) -> str:
    """The terminal table: one row per group, then totals."""
    rows = [
        f"{'#':>3}  {'group (root)':<{width}} {'ops':>4} {'stages':>6} {'tile':<16} {'smem KB':>7} "
        f"{'DRAM MB':>10} {'us':>8} {'gain us':>8}"
    ]
    for k, g in enumerate(plan.groups):
        grp = g.group
        cfg = g.configs[0]
        root = grp.root if len(grp.root) <= width else "..." + grp.root[-(width - 3) :]
        tile = "cuBLAS" if g.library == "cublas" else "x".join(map(str, cfg.block_tile)) or "1"
        rows.append(
            f"{k:>3}  {root:<{width}} {len(grp.members):>4} {len(grp.stages):>6} {tile:<16} "
            f"{cfg.smem_bytes / 1024:>7.1f} {g.traffic_bytes / 1e6:>10.3f} {g.latency_us:>8.2f} "
            f"{g.unfused_us - g.latency_us:>8.2f}"
        )
    mb = 1e6
    predicted = sum(g.configs[0].estimate.latency_us for g in plan.groups)
    measured = any(hasattr(g, "measured_us") for g in plan.groups)
    latency = (
        f"measured latency {plan.latency_us:.1f} us (cost model predicted {predicted:.1f} us)"
        if measured
        else f"estimated latency {plan.latency_us:.1f} us"
    )
    calls = f" + {plan.library_calls} cuBLAS calls" if plan.library_calls else ""
    rows.append(
        f"{plan.kernels} kernels{calls} (unfused: {plan.unfused_kernels}); {latency} "
        f"(unfused: {plan.unfused_latency_us:.1f} us); compulsory DRAM traffic "
        f"{plan.traffic_bytes / mb:.2f} MB (unfused: {plan.unfused_traffic_bytes / mb:.2f} MB); "
        f"arch {plan.arch.name}, {plan.measure}, {plan.seconds:.1f} s"
    )
    return "\n".join(rows)
