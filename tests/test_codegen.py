"""Generated kernels, executed on the CPU by the emulator, against the interpreter.

Covers every lowering (through the ONNX node-test models), hand-built fused chains under
several distinct configs each -- including tiles that do not divide the shape --,
reductions stepped through shared memory with a last step that runs past the reduction
(fp32 and fp16, vector loads of every width), reductions split across warps, fp16 kernels,
the kernel signature, and one nvcc compile of all of these sources for sm_80 and sm_90.

The cases are built once per process by the ``*_batch`` functions below, which
tests/test_gpu.py reuses to run the very same kernels natively.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cache

import numpy as np
import onnx
import pytest
from node_cases import importable
from onnx import TensorProto, helper
from onnx_util import contrast_nodes, make_model

from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.codegen import TEMPLATE_DIR, Kernel, generate_kernel, model_source, sanitize_identifier
from welder.codegen.cprint import STORAGE_TYPES
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.ir.compute import Compute
from welder.ir.expr import Load, walk
from welder.ir.interpret import np_dtype
from welder.runtime.emu import compile_kernels
from welder.schedule.config import Estimate, GroupConfig
from welder.schedule.group import Group, make_group
from welder.schedule.kinds import Options, ScheduleContext, tf32x3
from welder.schedule.kinds.simt import (
    SimtConfig,
    StagedInput,
    held_twin,
    make_config,
    reduce_vector_twin,
    schedule_group,
    window_twin,
)
from welder.schedule.plan import plan_model
from welder.tile.propagate import partitions_output, propagate_group, read_regions

ARCH = get_arch("H100")
NVCC_ARCHS = ("sm_80", "sm_90")


def _w(rng: np.random.Generator, *shape: int, dtype: type = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


@dataclass
class Case:
    """One model's kernels under one choice of configs, and the inputs to run it on."""

    label: str
    graph: Graph
    configs: list[tuple[Group, GroupConfig]]
    kernels: list[Kernel]
    feeds: dict[str, np.ndarray]


@dataclass
class Batch:
    """Many cases compiled as one translation unit, then run one by one.  ``prefix`` keeps
    kernel names unique when batches are concatenated (the nvcc test, the GPU tests)."""

    prefix: str
    cases: list[Case] = field(default_factory=list)

    def add(self, label: str, graph: Graph, groups: list[tuple[Group, GroupConfig]], feeds: dict) -> None:
        name = f"{self.prefix}{len(self.cases)}_{sanitize_identifier(label, 24)}"
        kernels = [generate_kernel(graph, g, cfg, f"{name}_{k}") for k, (g, cfg) in enumerate(groups)]
        self.cases.append(Case(label, graph, list(groups), kernels, feeds))

    @property
    def kernels(self) -> list[Kernel]:
        return [k for c in self.cases for k in c.kernels]

    def source(self) -> str:
        return model_source(self.kernels)

    def emulate(self):
        """The batch's kernels built for the emulator (one g++ call, cached by content), at
        -O0: each case runs once on small inputs, so the compile is the cost (half the node
        models: 10.5 s against 23.7 s at -O2, their runs 0.8 s either way)."""
        return compile_kernels(
            self.source(), [k.name for k in self.kernels], extra_flags=[f"-I{TEMPLATE_DIR}", "-O0"]
        )

    def run_all(self) -> list[str]:
        """Labels of the cases whose outputs differ from the interpreter (with the error)."""
        module = self.emulate()
        failures = []
        for case in self.cases:
            try:
                outs = run_emulated(case, module)
            except Exception as e:  # an emulation error is a failure of this case only
                failures.append(f"{case.label}: {e}")
                continue
            ref = case.graph.run(case.feeds)
            for o in case.graph.outputs:
                err = error_metric(outs[o], ref[o])
                if err > threshold_for(case.graph.tensor(o).dtype):
                    failures.append(f"{case.label}: output {o} error {err:.3e}")
        return failures


def run_emulated(case: Case, module) -> dict[str, np.ndarray]:
    """Launch a case's kernels in order through the emulator; the graph outputs."""
    env = {**case.graph.constants, **case.feeds}
    for k in case.kernels:
        args = []
        for p in k.params:
            if p.is_output:
                env[p.tensor] = np.zeros(p.shape, np_dtype(p.dtype))
            env[p.tensor] = np.require(env[p.tensor], np_dtype(p.dtype), "C")
            args.append(env[p.tensor])
        module.launch(k.name, k.grid, k.threads, k.smem_bytes, args)
    return {o: env[o] for o in case.graph.outputs}


def _plan_groups(graph: Graph, config_index: int = 0, topk: int = 2) -> list[tuple[Group, GroupConfig]]:
    return _plan_choices(graph, topk)[config_index]


def _plan_choices(graph: Graph, topk: int = 2) -> list[list[tuple[Group, GroupConfig]]]:
    """The groups of one plan with each group's best, second-best, ... config (the last it
    has where it has fewer): ``topk`` lists from one search."""
    plan = plan_model(graph, ARCH, topk=topk)
    return [[(p.group, p.configs[min(k, len(p.configs) - 1)]) for p in plan.groups] for k in range(topk)]


def _whole(graph: Graph) -> Group:
    return make_group(graph, list(graph.nodes))


def _feeds(graph: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {t.name: _w(rng, *t.shape, dtype=np_dtype(t.dtype)) for t in graph.inputs}


# -- configs built by hand ---------------------------------------------------------------------

Rstep = Callable[[Compute], tuple[int, ...]]


def inner_step(n: int) -> Rstep:
    """Reduction steps of ``n`` points along the innermost reduce axis, others whole."""
    return lambda c: (*(a.extent for a in c.reduce_axes[:-1]), min(n, c.reduce_axes[-1].extent))


def steps(*rstep: int) -> Rstep:
    """This step per reduce axis for stages with as many reduce axes; others whole."""

    def pick(c: Compute) -> tuple[int, ...]:
        extents = [a.extent for a in c.reduce_axes]
        if len(extents) != len(rstep):
            return tuple(extents)
        return tuple(min(s, e) for s, e in zip(rstep, extents))

    return pick


def hand_config(
    graph: Graph,
    group: Group,
    tile: Sequence[int],
    threads: int,
    reduce_threads: int = 1,
    rstep: Rstep | None = None,
    vector: int = 4,
    stage_inputs: bool = True,
    block_order: Sequence[int] | None = None,
) -> GroupConfig:
    """A config built here rather than by the policy, so that the tests reach the template
    paths they are about whatever the policy currently prefers.

    Every reduction stage splits each output over ``reduce_threads`` threads (halved while
    a thread would own more than 64 outputs) and, with ``stage_inputs``, stages each global
    input it reads with affine indices, ``rstep(compute)`` points per step (whole
    reductions without ``rstep``), asking for vector loads when ``vector`` > 1.  Shared
    buffers are laid out one after another, 16-byte aligned."""
    shape_of = lambda t: graph.tensor(t).shape  # noqa: E731
    tile = tuple(tile)
    grid = tuple(-(-s // t) for s, t in zip(shape_of(group.root), tile))
    regions = propagate_group([group.computes[s] for s in group.stages], group.root, tile, shape_of)
    for out in group.outputs:
        if out != group.root:
            assert partitions_output(regions.members[out], shape_of(out), tile, grid), out
    top = 0

    def alloc(nbytes: int) -> int:
        nonlocal top
        offset, top = top, top + -(-nbytes // 16) * 16
        return offset

    stages = []
    for name in group.stages:
        c = group.computes[name]
        region = regions.members[name]
        split = reduce_threads if c.is_reduction else 1
        while True:
            tshape, reg = _thread_layout(region.extents, threads // split)
            if split == 1 or math.prod(reg) <= 64:
                break
            split //= 2
        st = SimtConfig(name, region.extents, tshape, reg, split, write_global=name in group.outputs)
        if any(name in group.computes[r].inputs for r in group.stages if r != name):
            st.smem_offset = alloc(math.prod(st.tile) * np_dtype(c.dtype).itemsize)
        if c.is_reduction:
            st.rstep = rstep(c) if rstep else tuple(a.extent for a in c.reduce_axes)
            per_step = read_regions(c, region.dims, shape_of, st.rstep)
            for ld in _distinct_loads(c) if stage_inputs else []:
                if ld.tensor in group.inputs and not any(
                    isinstance(n, Load) for i in ld.indices for n in walk(i)
                ):
                    extents = per_step[ld.tensor].extents
                    nbytes = math.prod(extents) * np_dtype(ld.dtype).itemsize
                    st.staged.append(StagedInput(ld.tensor, extents, alloc(nbytes), vector))
            if split > 32:
                slots = math.prod(tshape) * (split // 32) * math.prod(reg)
                st.reduce_offset = alloc(slots * 12)
        stages.append(st)
    order = tuple(block_order) if block_order is not None else tuple(range(len(tile)))
    estimate = Estimate(math.prod(grid), 1, 1, 0, 0, 0, 0, top, 0, 0.0)
    return GroupConfig(group.root, tile, grid, order, threads, stages, top, estimate)


def _thread_layout(extents: Sequence[int], threads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Threads over the axes, innermost first, and the register tile each covers."""
    shape, left = [1] * len(extents), threads
    for d in reversed(range(len(extents))):
        shape[d] = max(1, min(left, extents[d]))
        left //= shape[d]
    return tuple(shape), tuple(-(-e // t) for e, t in zip(extents, shape))


def _distinct_loads(c: Compute) -> list[Load]:
    """The first load of each tensor, in the order of the body."""
    first: dict[str, Load] = {}
    for ld in c.loads():
        first.setdefault(ld.tensor, ld)
    return list(first.values())


def config_key(cfg: GroupConfig) -> str:
    """Everything codegen reads from a config (the estimate is not part of it)."""
    return json.dumps({**asdict(cfg), "estimate": None}, sort_keys=True)


def _replacing(groups: list[tuple[Group, GroupConfig]], group: Group, cfg: GroupConfig):
    return [(g, cfg if g.root == group.root else c) for g, c in groups]


# -- every lowering ------------------------------------------------------------------------------


@cache
def node_model_batch(part: int) -> Batch:
    """All node-test models welder imports (every op and attribute mix onnx tests), half of
    them per part, each fused by the cost model and run with its best and second-best
    configs."""
    batch = Batch(f"n{part}_")
    for case, graph in importable()[part::2]:
        inputs = case.data_sets[0][0]
        by_name = {vi.name: np.asarray(v) for vi, v in zip(case.model.graph.input, inputs)}
        feeds = {t.name: by_name[t.name] for t in graph.inputs}
        for choice, groups in enumerate(_plan_choices(graph)):
            batch.add(f"{case.name}_{choice}", graph, groups, feeds)
    return batch


@pytest.mark.parametrize("part", [0, 1])
def test_every_node_model_runs_emulated(part):
    batch = node_model_batch(part)
    assert len(batch.cases) > 150
    failures = batch.run_all()
    assert not failures, "\n".join(failures[:20])


# -- fused chains under several configs ------------------------------------------------------------


def _chain(name: str, rng: np.random.Generator) -> onnx.ModelProto:
    """The chains the design singles out."""

    def w(*shape: int) -> np.ndarray:
        return _w(rng, *shape)

    if name == "matmul_bias_gelu":
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["h"]),
            helper.make_node("Gelu", ["h"], ["y"]),
        ]
        return make_model(nodes, {"x": w(40, 24)}, ["y"], {"w": w(24, 36), "b": w(36)}, opset=20)
    if name == "attention":
        nodes = [
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
            helper.make_node("Mul", ["s", "scale"], ["ss"]),
            helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
        ]
        return make_model(
            nodes,
            {"q": w(2, 20, 8), "kt": w(2, 8, 20), "v": w(2, 20, 8)},
            ["y"],
            {"scale": np.array(0.35, np.float32)},
        )
    if name == "layernorm":
        node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)
        return make_model([node], {"x": w(10, 96)}, ["y"], {"s": w(96), "b": w(96)})
    if name == "conv_bn_relu":
        nodes = [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "g", "be", "m", "va"], ["n"]),
            helper.make_node("Relu", ["n"], ["y"]),
        ]
        inits = {"w": w(6, 4, 3, 3), "g": w(6), "be": w(6), "m": w(6), "va": np.abs(w(6)) + 0.5}
        return make_model(nodes, {"x": w(1, 4, 11, 9)}, ["y"], inits)
    if name == "depthwise_chain":
        nodes = [
            helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], group=4),
            helper.make_node("Clip", ["c1", "lo", "hi"], ["r"]),
            helper.make_node("Conv", ["r", "w2"], ["c2"], pads=[1, 1, 1, 1], group=4, strides=[2, 2]),
            helper.make_node("Conv", ["c2", "w3"], ["y"]),
        ]
        inits = {
            "w1": w(4, 1, 3, 3),
            "w2": w(4, 1, 3, 3),
            "w3": w(8, 4, 1, 1),
            "lo": np.array(0, np.float32),
            "hi": np.array(6, np.float32),
        }
        return make_model(nodes, {"x": w(1, 4, 13, 13)}, ["y"], inits)
    if name == "pooling":
        nodes = [
            helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("AveragePool", ["m"], ["y"], kernel_shape=[2, 2], strides=[1, 1]),
        ]
        return make_model(nodes, {"x": w(1, 3, 15, 15)}, ["y"])
    if name == "reduce_inner_outer":
        nodes = [
            helper.make_node("ReduceMean", ["x", "a1"], ["inner"], keepdims=1),
            helper.make_node("Sub", ["x", "inner"], ["d"]),
            helper.make_node("ReduceSum", ["d", "a0"], ["y"], keepdims=0),
        ]
        return make_model(
            nodes,
            {"x": w(37, 19)},
            ["y"],
            {"a1": np.array([1], np.int64), "a0": np.array([0], np.int64)},
            opset=18,
        )
    if name == "transposed_reshaped_producer":
        nodes = [
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("Reshape", ["e", "shape"], ["r"]),
            helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0, 2]),
            helper.make_node("MatMul", ["t", "w"], ["y"]),
        ]
        return make_model(
            nodes, {"x": w(6, 20)}, ["y"], {"shape": np.array([6, 4, 5], np.int64), "w": w(5, 7)}
        )
    raise KeyError(name)


CHAINS = [
    "matmul_bias_gelu",
    "attention",
    "layernorm",
    "conv_bn_relu",
    "depthwise_chain",
    "pooling",
    "reduce_inner_outer",
    "transposed_reshaped_producer",
]
CONFIGS_PER_CHAIN = 4

# Configs for a chain's fused group when the cost model's top choices are too few or alike:
# other block sizes, reductions split across threads and warps, steps through shared memory,
# the block order reversed.
CHAIN_VARIANTS = [
    {"threads": 64, "reduce_threads": 2, "rstep": inner_step(8)},
    {"threads": 256, "reduce_threads": 64, "rstep": inner_step(16), "reverse": True},
    {"threads": 32, "stage_inputs": False},
    {"threads": 128, "reduce_threads": 8, "rstep": inner_step(5), "vector": 1},
]


def _non_dividing_tiles(group: Group, graph: Graph) -> list[GroupConfig]:
    """Configs whose root tile leaves a partial last block along every axis it can."""
    shape = graph.tensor(group.root).shape
    out = []
    for frac in (3, 5):
        tile = tuple(max(1, s - s // frac) if s > 2 else s for s in shape)
        cfg = make_config(group, tile, lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH)
        if cfg is not None:
            out.append(cfg)
    return out


@dataclass
class ChainStats:
    distinct: dict[str, int] = field(default_factory=dict)
    partial: int = 0


CHAIN_STATS = ChainStats()


@cache
def chain_batch() -> Batch:
    """Every chain under CONFIGS_PER_CHAIN distinct configs (the cost model's top choices,
    then hand-built ones), plus its fused group alone under tiles that do not divide it."""
    rng = np.random.default_rng(11)
    batch = Batch("ch")
    for name in CHAINS:
        graph = import_onnx(_chain(name, rng))
        feeds = _feeds(graph, rng)
        plan = plan_model(graph, ARCH, topk=CONFIGS_PER_CHAIN)
        fused = max(plan.groups, key=lambda p: len(p.group.members))
        assert len(fused.group.members) > 1, f"{name}: nothing fused"
        choices = [
            [(p.group, p.configs[min(choice, len(p.configs) - 1)]) for p in plan.groups]
            for choice in range(CONFIGS_PER_CHAIN)
        ]
        for variant in CHAIN_VARIANTS:
            v = dict(variant)
            tile = fused.configs[0].block_tile
            if v.pop("reverse", False):
                v["block_order"] = tuple(reversed(range(len(tile))))
            cfg = hand_config(graph, fused.group, tile, **v)
            choices.append(_replacing(choices[0], fused.group, cfg))
        seen = set()
        for groups in choices:
            key = tuple(config_key(c) for _, c in groups)
            if key not in seen and len(seen) < CONFIGS_PER_CHAIN:
                seen.add(key)
                batch.add(f"{name}_{len(seen) - 1}", graph, groups, feeds)
        CHAIN_STATS.distinct[name] = len(seen)
        if len(plan.groups) == 1:
            for cfg in _non_dividing_tiles(fused.group, graph):
                if any(s % t for s, t in zip(graph.tensor(fused.group.root).shape, cfg.block_tile)):
                    CHAIN_STATS.partial += 1
                batch.add(f"{name}_partial", graph, [(fused.group, cfg)], feeds)
    return batch


def test_fused_chains_under_several_configs():
    batch = chain_batch()
    assert CHAIN_STATS.distinct == {name: CONFIGS_PER_CHAIN for name in CHAINS}
    assert CHAIN_STATS.partial >= 4
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


# -- reductions stepped through shared memory ---------------------------------------------------


def _matmul_chain(rng: np.random.Generator, m: int, k: int, n: int, dtype: type) -> Graph:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["h"]),
        helper.make_node("Gelu", ["h"], ["y"]),
    ]
    inits = {"w": _w(rng, k, n, dtype=dtype), "b": _w(rng, n, dtype=dtype)}
    return import_onnx(make_model(nodes, {"x": _w(rng, m, k, dtype=dtype)}, ["y"], inits, opset=20))


def _conv_relu(rng: np.random.Generator, dtype: type) -> Graph:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    x, w = _w(rng, 1, 5, 9, 9, dtype=dtype), _w(rng, 6, 5, 3, 3, dtype=dtype)
    return import_onnx(make_model(nodes, {"x": x}, ["y"], {"w": w}))


def _reduce_sum(rng: np.random.Generator, rows: int, cols: int, dtype: type = np.float32) -> Graph:
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    model = make_model(
        [node], {"x": _w(rng, rows, cols, dtype=dtype)}, ["y"], {"axes": np.array([1], np.int64)}, opset=18
    )
    return import_onnx(model)


# (tile, threads, reduce threads, steps) per case: steps that divide nothing, several steps
# with a short last one, odd steps (no vectors), a stepped reduction split across threads
# and across warps, tiles that do not divide the output.
MATMUL_STEPS = [
    ((16, 12), 64, 1, inner_step(32)),
    ((8, 36), 128, 1, inner_step(24)),
    ((16, 12), 64, 1, inner_step(7)),
    ((16, 12), 128, 4, inner_step(32)),
    ((4, 12), 256, 64, inner_step(64)),
    ((16, 16), 64, 1, inner_step(32)),
]
# fp16 with K = 104: 8-half (uint4), 4-half (uint2) and 2-half (__half2) loads.
MATMUL_STEPS_FP16 = [
    ((8, 8), 64, 1, inner_step(32)),
    ((8, 4), 32, 1, inner_step(32)),
    ((8, 2), 32, 1, inner_step(6)),
    ((12, 10), 64, 2, inner_step(16)),
    ((8, 8), 256, 64, inner_step(64)),
]
# Conv reduces over (ci, kh, kw) = (5, 3, 3).
CONV_STEPS = [
    ((1, 6, 9, 9), 128, 1, steps(2, 3, 3)),
    ((1, 3, 5, 9), 64, 1, steps(2, 2, 3)),
    ((1, 6, 4, 9), 128, 8, steps(5, 3, 2)),
]


@cache
def reduction_step_batch() -> Batch:
    """Reductions staged one step at a time whose steps do not divide the reduction (the
    last step is cut short), fp32 and fp16, over one and several reduce axes."""
    rng = np.random.default_rng(12)
    batch = Batch("rs")
    for dtype, (m, k, n), cases in (
        (np.float32, (40, 100, 36), MATMUL_STEPS),
        (np.float16, (24, 104, 40), MATMUL_STEPS_FP16),
    ):
        graph = _matmul_chain(rng, m, k, n, dtype)
        feeds = _feeds(graph, rng)
        for j, (tile, threads, split, rstep) in enumerate(cases):
            cfg = hand_config(graph, _whole(graph), tile, threads, split, rstep, vector=8)
            batch.add(f"matmul_k{k}_{np.dtype(dtype).name}_{j}", graph, [(_whole(graph), cfg)], feeds)
    for dtype in (np.float32, np.float16):
        graph = _conv_relu(rng, dtype)
        feeds = _feeds(graph, rng)
        for j, (tile, threads, split, rstep) in enumerate(CONV_STEPS):
            cfg = hand_config(graph, _whole(graph), tile, threads, split, rstep)
            batch.add(f"conv_{np.dtype(dtype).name}_{j}", graph, [(_whole(graph), cfg)], feeds)
    graph = _reduce_sum(rng, 6, 1000)
    feeds = _feeds(graph, rng)
    for j, (tile, threads, split, rstep) in enumerate(
        [((2,), 32, 1, inner_step(128)), ((3,), 96, 32, inner_step(96)), ((4,), 64, 16, inner_step(64))]
    ):
        cfg = hand_config(graph, _whole(graph), tile, threads, split, rstep)
        batch.add(f"reduce_sum_steps_{j}", graph, [(_whole(graph), cfg)], feeds)
    return batch


def _vector_types(source: str) -> set[str]:
    return set(re.findall(r"welder_vload<(\w+)>", source))


def test_reduction_steps_with_a_short_last_step():
    batch = reduction_step_batch()
    stepped = partial = 0
    for case in batch.cases:
        for group, cfg in case.configs:
            for st, c in ((st, group.computes[st.node]) for st in cfg.stages):
                extents = [a.extent for a in c.reduce_axes]
                if st.staged and any(s < e for s, e in zip(st.rstep, extents)):
                    stepped += 1
                    partial += any(e % s for s, e in zip(st.rstep, extents))
    assert stepped == len(batch.cases) and partial == len(batch.cases)
    source = batch.source()
    assert "break;" in source and "continue;" in source  # the tails, per thread and split
    assert {"float4", "__half2", "uint2", "uint4"} <= _vector_types(source)
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


# -- reductions split across warps -----------------------------------------------------------------


def _row_op(op: str, x: np.ndarray, **attrs: object) -> Graph:
    if op == "LayerNormalization":
        cols = x.shape[-1]
        inits = {
            "s": np.linspace(0.5, 1.5, cols).astype(x.dtype),
            "b": np.linspace(-1, 1, cols).astype(x.dtype),
        }
        node = helper.make_node(op, ["x", "s", "b"], ["y"], axis=-1)
        return import_onnx(make_model([node], {"x": x}, ["y"], inits))
    return import_onnx(make_model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": x}, ["y"]))


@cache
def cross_warp_batch() -> Batch:
    """Wide rows reduced by 64 to 256 threads each (shuffles within warps, then shared
    memory across them): sums, argmax/argmin with many ties (the first index must win
    however the row is split), softmax and layernorm, fp32 and fp16, some staged."""
    rng = np.random.default_rng(13)
    batch = Batch("xw")
    ties = rng.integers(-3, 4, (5, 700)).astype(np.float32)
    cases = [
        (
            "sum",
            _reduce_sum(rng, 6, 1000),
            [((1,), 256, 256, None), ((2,), 256, 128, None), ((4,), 256, 64, None)],
        ),
        ("sum_staged", _reduce_sum(rng, 6, 1000), [((2,), 256, 128, inner_step(256))]),
        (
            "sum_fp16",
            _reduce_sum(rng, 6, 1000, np.float16),
            [((1,), 256, 256, None), ((2,), 128, 64, inner_step(96))],
        ),
        ("argmax", _row_op("ArgMax", ties, axis=1), [((1, 1), 256, 256, None), ((4, 1), 256, 64, None)]),
        ("argmax_staged", _row_op("ArgMax", ties, axis=1), [((2, 1), 256, 128, inner_step(128))]),
        ("argmin", _row_op("ArgMin", ties, axis=1, keepdims=0), [((2,), 256, 128, None)]),
        (
            "softmax",
            _row_op("Softmax", _w(rng, 4, 1500), axis=-1),
            [((1, 1500), 256, 256, None), ((2, 1500), 256, 128, None)],
        ),
        (
            "softmax_staged",
            _row_op("Softmax", _w(rng, 4, 1500), axis=-1),
            [((1, 1500), 128, 64, inner_step(256))],
        ),
        (
            "softmax_fp16",
            _row_op("Softmax", _w(rng, 4, 1500, dtype=np.float16), axis=-1),
            [((2, 1500), 256, 128, None)],
        ),
        ("layernorm", _row_op("LayerNormalization", _w(rng, 3, 2000)), [((1, 2000), 256, 256, None)]),
    ]
    for label, graph, configs in cases:
        feeds = {"x": ties} if label.startswith("arg") else _feeds(graph, rng)
        for j, (tile, threads, split, rstep) in enumerate(configs):
            cfg = hand_config(
                graph, _whole(graph), tile, threads, split, rstep, stage_inputs=rstep is not None
            )
            batch.add(f"{label}_{j}", graph, [(_whole(graph), cfg)], feeds)
    return batch


def test_cross_warp_reductions():
    batch = cross_warp_batch()
    for case in batch.cases:
        splits = [st.reduce_threads for _, cfg in case.configs for st in cfg.stages]
        assert max(splits) >= 64, case.label
    source = batch.source()
    assert re.search(r"WELDER_SHARED\(float, red\d", source)  # partial values per warp
    assert re.search(r"WELDER_SHARED\(int, redi\d", source)  # and their indices (argmax)
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


# -- fp16 -------------------------------------------------------------------------------------------


@cache
def fp16_batch() -> Batch:
    rng = np.random.default_rng(14)
    f16 = np.float16
    models = {
        "matmul": make_model(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            {"x": _w(rng, 33, 40, dtype=f16)},
            ["y"],
            {"w": _w(rng, 40, 24, dtype=f16)},
        ),
        "softmax": make_model(
            [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": _w(rng, 8, 70, dtype=f16)}, ["y"]
        ),
        "layernorm": make_model(
            [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
            {"x": _w(rng, 6, 64, dtype=f16)},
            ["y"],
            {"s": _w(rng, 64, dtype=f16), "b": _w(rng, 64, dtype=f16)},
        ),
        "conv_relu": make_model(
            [
                helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                helper.make_node("Relu", ["c"], ["y"]),
            ],
            {"x": _w(rng, 1, 3, 9, 9, dtype=f16)},
            ["y"],
            {"w": _w(rng, 4, 3, 3, 3, dtype=f16)},
        ),
    }
    batch = Batch("h")
    for name, model in models.items():
        graph = import_onnx(model)
        feeds = _feeds(graph, rng)
        for choice, groups in enumerate(_plan_choices(graph)):
            batch.add(f"fp16_{name}_{choice}", graph, groups, feeds)
    return batch


def test_fp16_kernels_match_within_fp16_threshold():
    failures = fp16_batch().run_all()
    assert not failures, "\n".join(failures)


@cache
def config_sweep_batch() -> Batch:
    """Not only the favourite: the top 12 configs of one matmul."""
    rng = np.random.default_rng(15)
    graph = import_onnx(
        make_model(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            {"x": _w(rng, 50, 30)},
            ["y"],
            {"w": _w(rng, 30, 44)},
        )
    )
    group = _whole(graph)
    configs = schedule_group(
        group, lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=12)
    )
    batch = Batch("sw")
    feeds = _feeds(graph, rng)
    for k, cfg in enumerate(configs):
        batch.add(f"matmul_cfg{k}", graph, [(group, cfg)], feeds)
    return batch


def test_every_config_of_a_group_is_correct():
    batch = config_sweep_batch()
    assert len({c.configs[0][1].block_tile for c in batch.cases}) >= 8
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


def _twins_of_top12(model: onnx.ModelProto, twin) -> tuple[Graph, Group, list[GroupConfig]]:
    """The model's graph, its whole group and the twins ``twin(group, cfg, shape_of,
    dtype_of, arch)`` makes of its twelve best SIMT configs, where it makes one."""
    graph = import_onnx(model)
    group = _whole(graph)
    shape_of, dtype_of = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
    configs = schedule_group(group, shape_of, dtype_of, ARCH, Options(topk=12))
    return graph, group, [t for c in configs if (t := twin(group, c, shape_of, dtype_of, ARCH))]


def _each_config(prefix: str, models: dict[str, onnx.ModelProto], configs_of, rng) -> Batch:
    """A batch of one case for every config ``configs_of(model)`` gives (as the graph, its
    whole group and the configs) of every model, none of them without one."""
    batch = Batch(prefix)
    for name, model in models.items():
        graph, group, configs = configs_of(model)
        assert configs, name
        for k, cfg in enumerate(configs):
            batch.add(f"{name}_{k}", graph, [(group, cfg)], _feeds(graph, rng))
    return batch


def two_layernorms(rng: np.random.Generator, dtype: type, *shape: int) -> onnx.ModelProto:
    """Two LayerNorms in a row over the last axis, both outputs written (Conformer's: the
    first is a residual too)."""
    return make_model(
        [
            helper.make_node("LayerNormalization", ["x", "s1", "b1"], ["y1"], axis=-1),
            helper.make_node("LayerNormalization", ["y1", "s2", "b2"], ["y2"], axis=-1),
        ],
        {"x": _w(rng, *shape, dtype=dtype)},
        ["y1", "y2"],
        {n: _w(rng, shape[-1], dtype=dtype) for n in ("s1", "b1", "s2", "b2")},
    )


def reduce_vector_batch() -> Batch:
    """The twins reading reductions in 16-byte vectors (``SimtConfig.rvector``) of the
    first twelve configs of: BSRN's contrast over 64 x 128 pixels in both precisions (two
    reductions over x, the second with the mean as a scalar beside x's vectors), a half
    LayerNorm of four rows of 2048 (vector reductions, then a vectorised normalisation) and
    two LayerNorms in a row, both outputs written, in both precisions (the second norm's
    reductions read the first's output from its shared-memory tile in vectors)."""
    rng = np.random.default_rng(17)
    models = {
        f"contrast_{dtype.__name__}": make_model(
            contrast_nodes("x", "y"), {"x": _w(rng, 1, 4, 64, 128, dtype=dtype)}, ["y"]
        )
        for dtype in (np.float32, np.float16)
    }
    models["layernorm_f16"] = make_model(
        [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
        {"x": _w(rng, 4, 2048, dtype=np.float16)},
        ["y"],
        {"s": _w(rng, 2048, dtype=np.float16), "b": _w(rng, 2048, dtype=np.float16)},
    )
    for dtype, width in ((np.float16, 512), (np.float32, 256)):
        models[f"two_layernorms_{dtype.__name__}"] = two_layernorms(rng, dtype, 4, 8, width)
    return _each_config("rv", models, lambda m: _twins_of_top12(m, reduce_vector_twin), rng)


def test_reductions_read_in_vectors_are_correct():
    batch = reduce_vector_batch()
    assert all("welder_vload" in k.source for k in batch.kernels)
    second = [c for c in batch.cases if c.label.startswith("two_layernorms")]
    assert second
    for case in second:
        (_, cfg), (k,) = case.configs[0], case.kernels
        # the second norm's sum and sum of squares read the first norm's tile in vectors
        width = 16 // np.dtype(case.graph.tensor("x").dtype).itemsize
        assert [st.rvector for st in cfg.stages] == [width, width, 1, width, width, 1], case.label
        assert ">>(tile2, " in k.source, case.label  # stage 2, the first norm, keeps the tile
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


def held_batch() -> Batch:
    """The twins whose first reduction in vectors keeps its row in registers for the stages
    after it (``SimtConfig.hold``: :func:`held_twin`), from every config of: a LayerNorm in
    fp16 and fp32 (the sum of squares and the normalisation read the held row), a softmax
    in fp16 (the sum of exponentials and the division do), an RMS norm in fp32, and two
    LayerNorms in a row in fp16, both outputs written (the first's sum of squares reads the
    held row; the second norm reads the first's tile in vectors)."""
    rng = np.random.default_rng(41)
    models = {
        f"layernorm_{dtype.__name__}": make_model(
            [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
            {"x": _w(rng, 2, 16, width, dtype=dtype)},
            ["y"],
            {"s": _w(rng, width, dtype=dtype), "b": _w(rng, width, dtype=dtype)},
        )
        for dtype, width in ((np.float16, 512), (np.float32, 256))
    }
    models["softmax_float16"] = make_model(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": _w(rng, 32, 512, dtype=np.float16)}, ["y"]
    )
    models["two_layernorms_float16"] = two_layernorms(rng, np.float16, 2, 16, 512)
    models["rmsnorm_float32"] = make_model(
        [
            helper.make_node("Mul", ["x", "x"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
            helper.make_node("Add", ["ms", "eps"], ["a"]),
            helper.make_node("Sqrt", ["a"], ["r"]),
            helper.make_node("Div", ["x", "r"], ["n"]),
            helper.make_node("Mul", ["n", "s"], ["y"]),
        ],
        {"x": _w(rng, 24, 128)},
        ["y"],
        {"s": _w(rng, 128), "eps": np.array(1e-6, np.float32)},
    )

    def held(group, cfg, shape_of, dtype_of, arch):
        vectors = reduce_vector_twin(group, cfg, shape_of, dtype_of, arch)
        return held_twin(group, vectors, shape_of, dtype_of, arch)

    batch = _each_config("hd", models, lambda m: _twins_of_top12(m, held), rng)
    assert all(c.configs[0][1].family == "simt_held" for c in batch.cases)
    return batch


def split_tf32_batch() -> Batch:
    """fp32 products as three TF32 products a piece (the ``mma_tf32x3`` kind), the rule's
    top four configs of each: a MatMul 3072 deep (BERT's FFN output) and a Gemm with B
    transposed and a bias, 768 deep.  Natively their sums run through the tensor cores' own
    adder, which the emulator does not model (three truncations a K step, if it truncates,
    could bias a deep sum): the GPU test holds them to fp32's limit against the interpreter
    (tests/test_tf32x3.py checks the emulated kernels against fp64)."""
    rng = np.random.default_rng(43)
    models = {
        "matmul_k3072": make_model(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            {"x": _w(rng, 64, 3072)},
            ["y"],
            {"w": _w(rng, 3072, 96) / np.float32(55.4)},
        ),
        "gemm_bt_bias_k768": make_model(
            [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
            {"x": _w(rng, 96, 768)},
            ["y"],
            {"w": _w(rng, 128, 768) / np.float32(27.7), "b": _w(rng, 128)},
        ),
    }

    def split(model: onnx.ModelProto):
        graph = import_onnx(model)
        group = _whole(graph)
        shape_of, dtype_of = (lambda t: graph.tensor(t).shape), (lambda t: graph.tensor(t).dtype)
        ctx = ScheduleContext(shape_of, dtype_of, ARCH, Options(topk=4))
        return graph, group, tf32x3.KIND.propose(group, ctx)

    return _each_config("tx", models, split, rng)


def test_rows_held_in_registers_are_correct():
    batch = held_batch()
    for case in batch.cases:
        # the row is loaded once, kept, and read back by the later stages: the second
        # reduction (not the RMS norm's, which has one) and the normalisation
        (k,) = case.kernels
        assert len(re.findall(r"welder_vload<[^>]*>>\(p0,", k.source)) == 1, k.name
        assert "held0[u] = welder_vload" in k.source, k.name
        # two layer norms: the second normalises the first's tile, read in vectors
        two = case.label.startswith("two_layernorms")
        assert ("= held0[j];" in k.source) != two and (">>(tile2, " in k.source) == two, k.name
        assert ("= held0[u];" in k.source) != case.label.startswith("rmsnorm"), k.name
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


def padded_read_batch() -> Batch:
    """Reductions reading a padded input they stage (the padding select read as the staged
    load alone: ``_padding_read_staged``) under hand-built tiles, dividing the output or
    not, with scalar and vector staging: a depthwise 3x3 convolution in fp32 and fp16, a
    dense one with uneven pads, and a Pad of 1.5 in front of a convolution, whose select
    must stay (the staging fill is zero)."""
    rng = np.random.default_rng(29)
    models = {
        f"depthwise_{dtype.__name__}": make_model(
            [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=8)],
            {"x": _w(rng, 1, 8, 24, 40, dtype=dtype)},
            ["y"],
            {"w": _w(rng, 8, 1, 3, 3, dtype=dtype)},
        )
        for dtype in (np.float32, np.float16)
    }
    models["dense"] = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 2, 1, 0])],
        {"x": _w(rng, 1, 3, 12, 20)},
        ["y"],
        {"w": _w(rng, 4, 3, 3, 3)},
    )
    models["pad_one_and_a_half"] = make_model(
        [
            helper.make_node("Pad", ["x", "pads", "v"], ["p"], mode="constant"),
            helper.make_node("Conv", ["p", "w"], ["y"]),
        ],
        {"x": _w(rng, 1, 4, 16, 16)},
        ["y"],
        {
            "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
            "v": np.array(1.5, np.float32),
            "w": _w(rng, 4, 4, 3, 3),
        },
    )
    batch = Batch("pad")
    for name, model in models.items():
        graph = import_onnx(model)
        group = _whole(graph)
        out = graph.tensor(group.root).shape
        for tile in ((1, 2, 8, 8), (1, 1, 5, 7), (1, 2, 4, 16), (1, out[1], out[2], out[3])):
            for vector in (1, 4):
                cfg = hand_config(graph, group, tile, 32, vector=vector)
                label = f"{name}_{'x'.join(map(str, tile))}_v{vector}"
                batch.add(label, graph, [(group, cfg)], _feeds(graph, rng))
                twin = window_twin(group, cfg)  # the same staged tile read as a sliding window
                if twin is not None:
                    batch.add(f"{label}_window", graph, [(group, twin)], _feeds(graph, rng))
    return batch


def test_padded_reads_of_staged_inputs_are_correct():
    batch = padded_read_batch()
    assert sum(c.label.endswith("_window") for c in batch.cases) >= 4
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


def test_a_padding_select_is_dropped_only_where_it_fails_outside_the_tensor():
    """``_out_of_bounds_when_false`` against brute force: a select may go only where, for
    every index value, its condition failing means the index lies outside [0, 8)."""
    from welder.codegen.simt import _out_of_bounds_when_false
    from welder.ir.expr import Var, binary, const, logical_and, logical_or

    x, y = Var("i0"), Var("i1")
    ld = Load("t", (x - 1, y), "float32")
    conditions = [
        *(binary(op, x - 1, const(c)) for op in ("ge", "lt", "gt", "le") for c in (-1, 0, 1, 7, 8, 9)),
        logical_and(binary("ge", x - 1, const(0)), binary("lt", x - 1, const(8))),
        logical_and(binary("ge", y, const(0)), binary("lt", x - 1, const(9))),
        logical_or(binary("ge", x - 1, const(0)), binary("lt", x - 1, const(8))),
        binary("ge", x, const(0)),
        binary("lt", x + 0 * y - 1 + 1, const(8)),
        logical_and(binary("ge", x, const(1)), binary("lt", x, const(9))),  # an inlined Pad's form
    ]
    for cond in conditions:
        safe = all(
            _evaluates(cond, {"i0": a, "i1": b}) or not (0 <= a - 1 < 8 and 0 <= b < 8)
            for a in range(-4, 14)
            for b in range(-4, 14)
        )
        if _out_of_bounds_when_false(cond, ld, (8, 8)):
            assert safe, cond
    assert _out_of_bounds_when_false(conditions[-5], ld, (8, 8))
    assert _out_of_bounds_when_false(conditions[-1], ld, (8, 8))


def _evaluates(e, env: dict[str, int]) -> int | bool:
    """An index or bool expression's value at one point (Var, Const and Binary only)."""
    from welder.ir.expr import Binary, Const, Var

    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        return e.value
    assert isinstance(e, Binary), e
    a, b = _evaluates(e.a, env), _evaluates(e.b, env)
    ops = {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "ge": lambda: a >= b,
        "gt": lambda: a > b,
        "le": lambda: a <= b,
        "lt": lambda: a < b,
        "and": lambda: a and b,
        "or": lambda: a or b,
    }
    return ops[e.op]()


def all_batches() -> list[Batch]:
    """Every batch of this file: what the nvcc test compiles and the GPU tests run."""
    return [
        node_model_batch(0),
        node_model_batch(1),
        chain_batch(),
        reduction_step_batch(),
        cross_warp_batch(),
        fp16_batch(),
        config_sweep_batch(),
        reduce_vector_batch(),
        held_batch(),
        padded_read_batch(),
        split_tf32_batch(),
    ]


# -- the kernel's interface ---------------------------------------------------------------------------

_SIGNATURE = re.compile(
    r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(\n((?:    .*\n)+)(?=  \S)'
)
_PARAM = re.compile(r"    (const )?(.+)\* __restrict__ (p\d+)([,)])(?: \{)?  // (in|out) ")
_VIEW = re.compile(r"WELDER_SHARED\(([\w ]+), (\w+), (\d+), (\d+)\);")
_SIZES = {STORAGE_TYPES[d]: np_dtype(d).itemsize for d in STORAGE_TYPES if d != "index"}


def test_kernel_signature_and_launch_shape():
    """Inputs (const) then outputs, every pointer ``__restrict__``, launch bounds equal to
    the threads reported, and grid, block and shared memory what the config says, every
    shared view inside the reported size -- for the cost model's and hand-built configs."""
    batches = [chain_batch(), cross_warp_batch(), reduction_step_batch()]
    checked = 0
    for case in (c for b in batches for c in b.cases):
        for (group, cfg), k in zip(case.configs, case.kernels):
            [(bounds, name, params)] = _SIGNATURE.findall(k.source)
            assert name == k.name and int(bounds) == k.threads == cfg.threads
            splits = max(getattr(st, "splits", 1) for st in cfg.stages)  # split-K: blocks per tile
            assert k.grid == math.prod(cfg.grid) * splits and k.smem_bytes == cfg.smem_bytes
            assert f"grid {k.grid} x block {k.threads}, {k.smem_bytes} bytes" in k.source
            assert cfg.threads % 32 == 0 and cfg.threads <= 1024
            for st in (st for st in cfg.stages if st.kind == "simt"):  # a product's FMA stage has warps
                assert math.prod(st.thread_shape) * st.reduce_threads <= cfg.threads, st.node
            lines = params.splitlines()
            parsed = [_PARAM.match(line) for line in lines]
            assert all(parsed), lines
            assert [p.tensor for p in k.params] == [*group.inputs, *group.outputs]
            assert [m.group(3) for m in parsed] == [f"p{i}" for i in range(len(k.params))]
            assert [m.group(4) for m in parsed] == [","] * (len(lines) - 1) + [")"]
            for m, p in zip(parsed, k.params):
                assert (m.group(5) == "out") == p.is_output and bool(m.group(1)) == (not p.is_output)
                assert m.group(2) == STORAGE_TYPES[p.dtype]
            assert [p.is_output for p in k.params] == sorted(p.is_output for p in k.params)
            for ctype, view, offset, count in _VIEW.findall(k.source):
                size = _SIZES[ctype]
                assert int(offset) % size == 0, view
                assert int(offset) + int(count) * size <= k.smem_bytes, view
            assert ("WELDER_SMEM_BEGIN" in k.source) == (k.smem_bytes > 0)
            checked += 1
    assert checked > 60
    # The emulator reads the same signature from the compiled kernel.
    case = chain_batch().cases[0]
    module = compile_kernels(
        model_source(case.kernels), [k.name for k in case.kernels], extra_flags=[f"-I{TEMPLATE_DIR}"]
    )
    for k in case.kernels:
        expected = tuple(f"{'' if p.is_output else 'const '}{p.dtype}*" for p in k.params)
        assert module.signature(k.name) == expected


def test_fp16_staged_loads_take_the_widest_aligned_vector():
    """The policy asks for vectors in elements (up to 4); half data gets up to 16 bytes."""
    rng = np.random.default_rng(16)
    graph = _matmul_chain(rng, 24, 104, 40, np.float16)
    group = _whole(graph)
    expected = {8: ("uint4", "uint4"), 4: ("uint4", "uint2"), 2: ("uint4", "__half2")}
    for n, (x_type, w_type) in expected.items():
        cfg = hand_config(graph, group, (8, n), 32, rstep=inner_step(32), vector=2)
        source = generate_kernel(graph, group, cfg, "k").source
        loads = {p: t for t, p in re.findall(r"welder_vload<(\w+)>\((p\d+),", source)}
        assert loads == {"p0": x_type, "p1": w_type}, n
    no_vectors = hand_config(graph, group, (8, 8), 32, rstep=inner_step(32), vector=1)
    assert "welder_vload" not in generate_kernel(graph, group, no_vectors, "k").source
    odd = hand_config(graph, group, (8, 5), 32, rstep=inner_step(5), vector=4)
    assert "welder_vload" not in generate_kernel(graph, group, odd, "k").source


# -- the same sources through nvcc -----------------------------------------------------------------


@pytest.fixture(scope="module")
def nvcc():
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


_NUMBER = re.compile(r"\b\d+(\.\d*)?([eE][-+]?\d+)?[fFuUlL]*\b")


def distinct_forms(kernels: Sequence[Kernel]) -> list[Kernel]:
    """One kernel of each form: kernels equal but for their names, comments and numbers
    (shapes, tiles, strides) take the same paths through the templates and through the
    prelude's architecture branches."""
    forms: dict[str, Kernel] = {}
    for k in kernels:
        code = "\n".join(line.split("//")[0] for line in k.source.replace(k.name, "K").splitlines())
        forms.setdefault(_NUMBER.sub("N", code), k)
    return list(forms.values())


def test_distinct_forms_keep_one_kernel_a_form():
    kernels = [k for b in (chain_batch(), config_sweep_batch()) for k in b.kernels]
    forms = distinct_forms(kernels)
    assert 1 < len(forms) < len(kernels)
    assert len(distinct_forms(forms)) == len(forms) and set(map(id, forms)) <= set(map(id, kernels))
    sweep = config_sweep_batch().kernels
    assert len(distinct_forms(sweep)) < len({k.source for k in sweep})


def test_generated_kernels_compile_with_nvcc_without_warnings(nvcc, tmp_path):
    """Every kernel of every batch above, one translation unit, one nvcc call per target
    (device code only: the host side of a kernel is a launch stub nvcc writes itself).
    The two compiles split the checks between them: sm_90 compiles every kernel, for the
    warnings that depend on a kernel's numbers (its shapes, tiles and strides), with
    NVVM at -O1 (the front end's warnings are the same at every level; 42 s instead of
    62 on the development machine); sm_80 compiles one kernel of each form
    (:func:`distinct_forms`; 860 of 1,333) at nvcc's default optimisation, for what the
    optimiser says of a form (a loop it cannot unroll as asked).  ptxas assembles without
    optimising (-O0): every instruction is still checked."""
    kernels = [k for b in all_batches() for k in b.kernels]
    sources = {"sm_90": (kernels, ["-Xcicc", "-O1"]), "sm_80": (distinct_forms(kernels), [])}
    assert set(sources) == set(NVCC_ARCHS)
    commands = []
    for sm in NVCC_ARCHS:
        src = tmp_path / f"{sm}.cu"
        chosen, optimiser = sources[sm]
        src.write_text(model_source(chosen))
        commands.append(
            [
                nvcc,
                f"-arch={sm}",
                "-cubin",
                "-Werror",
                "all-warnings",
                *optimiser,
                "-Xptxas",
                "-O0",
                f"-I{TEMPLATE_DIR}",
                str(src),
                "-o",
                str(tmp_path / f"{sm}.cubin"),
            ]
        )
    with ThreadPoolExecutor(len(commands)) as pool:
        results = list(
            pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, timeout=900), commands)
        )
    for sm, result in zip(NVCC_ARCHS, results):
        assert result.returncode == 0 and not result.stderr.strip(), f"{sm}:\n{result.stderr[-4000:]}"


def test_model_names_never_reach_source_unsanitised():
    nasty = 'x"; system("rm -rf /"); //\n*/'
    x = helper.make_tensor_value_info(nasty, TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("out/*evil*/", TensorProto.FLOAT, [4])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", [nasty], ["out/*evil*/"])], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    graph = import_onnx(model)
    [(group, cfg)] = _plan_groups(graph)
    src = generate_kernel(graph, group, cfg, "k").source
    code = "\n".join(line.split("//")[0] for line in src.splitlines())
    assert "system" not in code and "evil" not in code and "/*" not in src
    assert "system(" in src  # the name is kept, readable, in a line comment
