"""Fusion search with synthetic latency measures, plus the structural invariants of its
groups on whole models."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx_util import make_model

from welder.arch import get_arch
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.schedule.engine import CostModel, fuse
from welder.schedule.group import Group, InvalidGroup, make_group
from welder.schedule.plan import plan_model

RNG = np.random.default_rng(5)


def _w(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def launch_bound(graph: Graph):
    """Each kernel costs 5 us plus its global traffic at 1 byte/ns: fusing saves launches
    and intermediate round trips, so every legal fusion is taken."""

    def measure(group: Group) -> float:
        io = sum(graph.tensor(t).nbytes for t in (*group.inputs, *group.outputs))
        return 5.0 + io / 1000.0

    return measure


def _group_of(result, node_name):
    return next(g for g in result.groups if node_name in g.members)


def _members_from(graph, source_op):
    return {n.name for n in graph.topo_order() if n.op_type == source_op}


def test_matmul_bias_gelu_fuse():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["h"]),
        helper.make_node("Gelu", ["h"], ["y"]),
    ]
    g = import_onnx(make_model(nodes, {"x": _w(16, 32)}, ["y"], {"w": _w(32, 64), "b": _w(64)}, opset=20))
    result = fuse(g, launch_bound(g))
    assert len(result.groups) == 1 and result.groups[0].root == "y"


def attention(seq=16, d=8, heads=2):
    q, k, v = (f"{n}" for n in "qkv")
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], [q]),
        helper.make_node("MatMul", ["x", "wk"], [k]),
        helper.make_node("MatMul", ["x", "wv"], [v]),
        helper.make_node("Reshape", [q, "shape"], ["q4"]),
        helper.make_node("Reshape", [k, "shape"], ["k4"]),
        helper.make_node("Reshape", [v, "shape"], ["v4"]),
        helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["qt", "kt"], ["scores"]),
        helper.make_node("Div", ["scores", "scale"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "vt"], ["ctx"]),
    ]
    dim = d * heads
    inits = {
        "wq": _w(dim, dim),
        "wk": _w(dim, dim),
        "wv": _w(dim, dim),
        "shape": np.array([1, seq, heads, d], np.int64),
        "scale": np.array(np.sqrt(d), np.float32),
    }
    return import_onnx(make_model(nodes, {"x": _w(1, seq, dim)}, ["ctx"], inits))


def test_softmax_stages_fuse_with_the_attention_matmuls():
    g = attention()
    result = fuse(g, launch_bound(g))
    softmax = _members_from(g, "Softmax")
    assert len(softmax) == 4
    group = _group_of(result, "probs")
    assert softmax <= set(group.members)
    assert "scores" in group.members and group.root == "ctx"


def test_layernorm_stages_fuse():
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)
    g = import_onnx(make_model([node], {"x": _w(8, 64)}, ["y"], {"s": _w(64), "b": _w(64)}))
    result = fuse(g, launch_bound(g))
    assert len(result.groups) == 1 and len(result.groups[0].members) == len(g.nodes)
    assert sum(1 for n in g.nodes.values() if n.compute.is_reduction) >= 2


def test_a_slower_fused_kernel_is_rejected():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Relu", ["mm"], ["y"])]
    g = import_onnx(make_model(nodes, {"x": _w(16, 32)}, ["y"], {"w": _w(32, 64)}))
    result = fuse(g, lambda group: 1.0 if len(group.members) == 1 else 5.0)
    assert len(result.groups) == 2


def _check_invariants(graph: Graph, groups: list[Group]) -> None:
    seen: set[str] = set()
    for grp in groups:
        assert not seen & set(grp.members), "a node is in two groups"
        seen |= set(grp.members)
        for m in grp.members:
            used_outside = any(c.name not in grp.members for c in graph.consumers(m))
            if used_outside or m in graph.outputs:
                assert m in grp.outputs, f"{m} is needed outside its group but not written"
    assert seen == set(graph.nodes)


def test_tensor_used_by_two_groups_is_always_written():
    nodes = [
        helper.make_node("Exp", ["x"], ["t"]),
        helper.make_node("MatMul", ["t", "w1"], ["a"]),
        helper.make_node("MatMul", ["t", "w2"], ["b"]),
    ]
    g = import_onnx(make_model(nodes, {"x": _w(8, 16)}, ["a", "b"], {"w1": _w(16, 4), "w2": _w(16, 4)}))
    result = fuse(g, launch_bound(g))
    _check_invariants(g, result.groups)
    assert len(result.groups) == 2  # two sinks cannot share a kernel
    home = _group_of(result, "t")
    other = next(grp for grp in result.groups if grp is not home)
    assert "t" in home.outputs and "t" in other.inputs
    g2 = attention()
    _check_invariants(g2, fuse(g2, launch_bound(g2)).groups)


def test_groups_must_be_convex_and_single_sink():
    g = attention()
    with pytest.raises(InvalidGroup, match="exactly one sink"):
        make_group(g, ["q", "k"])
    # Leaving out the softmax's sum: exp -> sum (outside) -> probs (inside) re-enters.
    members = ["scaled", "ctx", "vt", "v4", "v", *(_members_from(g, "Softmax") - {"probs:sum"})]
    with pytest.raises(InvalidGroup, match="re-enters"):
        make_group(g, members)


def test_nofusion_is_one_group_per_node():
    g = attention()
    result = fuse(g, launch_bound(g), nofusion=True)
    assert len(result.groups) == len(g.nodes)


@pytest.mark.parametrize("builder", ["bert_encoder_layer", "mobilenetv2_block", "vit_block"])
def test_cost_model_plans_whole_models(builder):
    models = pytest.importorskip("models")
    model, _ = getattr(models, builder)()
    g = import_onnx(model)
    plan = plan_model(g, get_arch("H100"), topk=1)
    _check_invariants(g, [p.group for p in plan.groups])
    assert len(plan.groups) < len(g.nodes)
    assert plan.latency_us < plan.unfused_latency_us
    for p in plan.groups:
        assert p.configs and p.configs[0].smem_bytes <= get_arch("H100").smem_per_block


def test_cost_model_measure_caches_identical_groups():
    g = attention(heads=2)
    cost = CostModel(g, get_arch("A100"))
    a, b = make_group(g, ["q"]), make_group(g, ["k"])
    assert cost(a) == cost(b)
    assert cost.calls == 1
    [cfg] = cost.configs(b)
    assert cfg.root == "k" and cfg.stages[0].node == "k"
