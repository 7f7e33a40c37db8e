"""Generated kernels, executed on the CPU by the emulator, against the interpreter.

Covers every lowering (through the ONNX node-test models), hand-built fused chains under
several configs each -- including tiles that do not divide the shape -- fp16 kernels, and
an nvcc compile of the same sources for sm_80 and sm_90.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings

import numpy as np
import pytest
from node_cases import importable
from onnx import TensorProto, helper
from onnx_util import make_model

from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.codegen import Kernel, generate_kernel, model_source
from welder.codegen.kernel import TEMPLATE_DIR, sanitize_identifier
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.ir.interpret import np_dtype
from welder.runtime.emu import compile_kernels
from welder.schedule.group import Group, make_group
from welder.schedule.plan import plan_model
from welder.schedule.policy import Options, make_config, schedule_group

RNG = np.random.default_rng(11)
ARCH = get_arch("H100")


def _w(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


class Batch:
    """Many (graph, kernels) cases compiled as one translation unit, then run one by one."""

    def __init__(self) -> None:
        self.cases: list[tuple[str, Graph, list[Kernel], dict]] = []
        self.kernels: list[Kernel] = []

    def add(self, label: str, graph: Graph, groups: list[tuple[Group, object]], feeds: dict) -> None:
        prefix = f"c{len(self.cases)}_{sanitize_identifier(label, 24)}"
        ks = [generate_kernel(graph, g, cfg, f"{prefix}_{k}") for k, (g, cfg) in enumerate(groups)]
        self.cases.append((label, graph, ks, feeds))
        self.kernels += ks

    def source(self) -> str:
        return model_source(self.kernels)

    def run_all(self) -> list[str]:
        """Labels of the cases whose outputs differ from the interpreter (with the error)."""
        module = compile_kernels(
            self.source(), [k.name for k in self.kernels], extra_flags=[f"-I{TEMPLATE_DIR}"]
        )
        failures = []
        for label, graph, kernels, feeds in self.cases:
            env = {**graph.constants, **feeds}
            try:
                for k in kernels:
                    args = []
                    for p in k.params:
                        if p.is_output:
                            env[p.tensor] = np.zeros(p.shape, np_dtype(p.dtype))
                        env[p.tensor] = np.require(env[p.tensor], requirements="C")
                        args.append(env[p.tensor])
                    module.launch(k.name, k.grid, k.threads, k.smem_bytes, args)
            except Exception as e:  # an emulation error is a failure of this case only
                failures.append(f"{label}: {e}")
                continue
            ref = graph.run(feeds)
            for o in graph.outputs:
                err = error_metric(env[o], ref[o])
                if err > threshold_for(graph.tensor(o).dtype):
                    failures.append(f"{label}: output {o} error {err:.3e}")
        return failures


def _plan_groups(graph: Graph, config_index: int = 0, topk: int = 2):
    plan = plan_model(graph, ARCH, topk=topk)
    return [(p.group, p.configs[min(config_index, len(p.configs) - 1)]) for p in plan.groups]


# -- every lowering ------------------------------------------------------------------------------


@pytest.mark.parametrize("part", [0, 1])
def test_every_node_model_runs_emulated(part):
    """All node-test models welder imports (every op and attribute mix onnx tests), each
    fused by the cost model and run with its best and its second-best configs."""
    batch = Batch()
    cases = importable()[part::2]
    for case, graph in cases:
        inputs = case.data_sets[0][0]
        by_name = {vi.name: np.asarray(v) for vi, v in zip(case.model.graph.input, inputs)}
        feeds = {t.name: by_name[t.name] for t in graph.inputs}
        for choice in (0, 1):
            batch.add(f"{case.name}_{choice}", graph, _plan_groups(graph, choice), feeds)
    assert len(cases) > 150
    failures = batch.run_all()
    assert not failures, "\n".join(failures[:20])


# -- fused chains under several configs ------------------------------------------------------------


def _chain(name: str):
    """(graph, feeds) for the chains the design singles out."""
    if name == "matmul_bias_gelu":
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["h"]),
            helper.make_node("Gelu", ["h"], ["y"]),
        ]
        return make_model(nodes, {"x": _w(40, 24)}, ["y"], {"w": _w(24, 36), "b": _w(36)}, opset=20)
    if name == "attention":
        nodes = [
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
            helper.make_node("Mul", ["s", "scale"], ["ss"]),
            helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
        ]
        return make_model(
            nodes,
            {"q": _w(2, 20, 8), "kt": _w(2, 8, 20), "v": _w(2, 20, 8)},
            ["y"],
            {"scale": np.array(0.35, np.float32)},
        )
    if name == "layernorm":
        node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)
        return make_model([node], {"x": _w(10, 96)}, ["y"], {"s": _w(96), "b": _w(96)})
    if name == "conv_bn_relu":
        nodes = [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", "g", "be", "m", "va"], ["n"]),
            helper.make_node("Relu", ["n"], ["y"]),
        ]
        inits = {"w": _w(6, 4, 3, 3), "g": _w(6), "be": _w(6), "m": _w(6), "va": np.abs(_w(6)) + 0.5}
        return make_model(nodes, {"x": _w(1, 4, 11, 9)}, ["y"], inits)
    if name == "depthwise_chain":
        nodes = [
            helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], group=4),
            helper.make_node("Clip", ["c1", "lo", "hi"], ["r"]),
            helper.make_node("Conv", ["r", "w2"], ["c2"], pads=[1, 1, 1, 1], group=4, strides=[2, 2]),
            helper.make_node("Conv", ["c2", "w3"], ["y"]),
        ]
        inits = {
            "w1": _w(4, 1, 3, 3),
            "w2": _w(4, 1, 3, 3),
            "w3": _w(8, 4, 1, 1),
            "lo": np.array(0, np.float32),
            "hi": np.array(6, np.float32),
        }
        return make_model(nodes, {"x": _w(1, 4, 13, 13)}, ["y"], inits)
    if name == "pooling":
        nodes = [
            helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("AveragePool", ["m"], ["y"], kernel_shape=[2, 2], strides=[1, 1]),
        ]
        return make_model(nodes, {"x": _w(1, 3, 15, 15)}, ["y"])
    if name == "reduce_inner_outer":
        nodes = [
            helper.make_node("ReduceMean", ["x", "a1"], ["inner"], keepdims=1),
            helper.make_node("Sub", ["x", "inner"], ["d"]),
            helper.make_node("ReduceSum", ["d", "a0"], ["y"], keepdims=0),
        ]
        return make_model(
            nodes,
            {"x": _w(37, 19)},
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
            nodes, {"x": _w(6, 20)}, ["y"], {"shape": np.array([6, 4, 5], np.int64), "w": _w(5, 7)}
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


def _non_dividing_tiles(group: Group, graph: Graph):
    """Configs whose root tile leaves a partial last block along every axis it can."""
    shape = graph.tensor(group.root).shape
    out = []
    for frac in (3, 5):
        tile = tuple(max(1, s - s // frac) if s > 2 else s for s in shape)
        cfg = make_config(group, tile, lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH)
        if cfg is not None:
            out.append(cfg)
    return out


def test_fused_chains_under_several_configs():
    batch = Batch()
    partial = 0
    for name in CHAINS:
        graph = import_onnx(_chain(name))
        feeds = {t.name: _w(*t.shape) for t in graph.inputs}
        plan = plan_model(graph, ARCH, topk=1)
        for p in plan.groups:
            assert len(p.group.members) >= 1
        fused = max(plan.groups, key=lambda p: len(p.group.members)).group
        assert len(fused.members) > 1, f"{name}: nothing fused"
        for choice in range(4):
            batch.add(f"{name}_{choice}", graph, _plan_groups(graph, choice, topk=4), feeds)
        # The largest group, alone, under tiles that do not divide its root.
        if len(plan.groups) == 1:
            for cfg in _non_dividing_tiles(fused, graph):
                if any(s % t for s, t in zip(graph.tensor(fused.root).shape, cfg.block_tile)):
                    partial += 1
                batch.add(f"{name}_partial", graph, [(fused, cfg)], feeds)
    assert partial >= 4
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


def test_fp16_kernels_match_within_fp16_threshold():
    batch = Batch()
    f16 = np.float16
    models = {
        "matmul": make_model(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            {"x": _w(33, 40, dtype=f16)},
            ["y"],
            {"w": _w(40, 24, dtype=f16)},
        ),
        "softmax": make_model(
            [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": _w(8, 70, dtype=f16)}, ["y"]
        ),
        "layernorm": make_model(
            [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)],
            {"x": _w(6, 64, dtype=f16)},
            ["y"],
            {"s": _w(64, dtype=f16), "b": _w(64, dtype=f16)},
        ),
        "conv_relu": make_model(
            [
                helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                helper.make_node("Relu", ["c"], ["y"]),
            ],
            {"x": _w(1, 3, 9, 9, dtype=f16)},
            ["y"],
            {"w": _w(4, 3, 3, 3, dtype=f16)},
        ),
    }
    for name, model in models.items():
        graph = import_onnx(model)
        feeds = {t.name: _w(*t.shape, dtype=f16) for t in graph.inputs}
        for choice in range(2):
            batch.add(f"fp16_{name}_{choice}", graph, _plan_groups(graph, choice), feeds)
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


def test_every_config_of_a_group_is_correct():
    """Not only the favourite: the top 12 matmul configs all compute the same product."""
    graph = import_onnx(
        make_model(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": _w(50, 30)}, ["y"], {"w": _w(30, 44)}
        )
    )
    group = make_group(graph, list(graph.nodes))
    configs = schedule_group(
        group, lambda t: graph.tensor(t).shape, lambda t: graph.tensor(t).dtype, ARCH, Options(topk=12)
    )
    assert len({c.block_tile for c in configs}) >= 8
    batch = Batch()
    feeds = {"x": _w(50, 30)}
    for k, cfg in enumerate(configs):
        batch.add(f"matmul_cfg{k}", graph, [(group, cfg)], feeds)
    failures = batch.run_all()
    assert not failures, "\n".join(failures)


# -- the same sources through nvcc -----------------------------------------------------------------


@pytest.fixture(scope="module")
def nvcc():
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


@pytest.mark.parametrize("sm", ["sm_80", "sm_90"])
def test_generated_kernels_compile_with_nvcc_without_warnings(nvcc, sm, tmp_path):
    batch = Batch()
    for name in CHAINS:
        graph = import_onnx(_chain(name))
        for choice in range(2):
            batch.add(f"{name}_{choice}", graph, _plan_groups(graph, choice), {})
    for case, graph in importable()[::9]:
        batch.add(case.name, graph, _plan_groups(graph), {})
    src = tmp_path / "kernels.cu"
    src.write_text(batch.source())
    with warnings.catch_warnings():
        result = subprocess.run(
            [
                nvcc,
                f"-arch={sm}",
                "-c",
                "-O2",
                "-Werror",
                "all-warnings",
                f"-I{TEMPLATE_DIR}",
                str(src),
                "-o",
                str(tmp_path / "kernels.o"),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr[-4000:]


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
