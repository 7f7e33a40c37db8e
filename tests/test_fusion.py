"""Fusion search with synthetic latency measures, plus the structural invariants of its
groups on whole models."""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx
import numpy as np
import pytest
from models import conformer_conv_module
from onnx import helper
from onnx_util import make_model

from welder.arch import get_arch
from welder.check import compare, error_metric, threshold_for
from welder.codegen import generate_model
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.runtime.emu import available as emulator_available
from welder.runtime.emulate import EmulatedModel
from welder.runtime.spec import find_views
from welder.schedule.engine import MAX_GROUP_MEMBERS, MAX_GROUP_STAGES, CostModel, fuse
from welder.schedule.group import Group, InvalidGroup, make_group
from welder.schedule.kinds import Options
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
    """One head-split attention whose queries, keys and values project three inputs (of one
    input, the import would merge the three products into one)."""
    q, k, v = (f"{n}" for n in "qkv")
    nodes = [
        helper.make_node("MatMul", ["xq", "wq"], [q]),
        helper.make_node("MatMul", ["xk", "wk"], [k]),
        helper.make_node("MatMul", ["xv", "wv"], [v]),
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
    return import_onnx(make_model(nodes, {f"x{n}": _w(1, seq, dim) for n in "qkv"}, ["ctx"], inits))


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


def matmul_chain(length: int) -> Graph:
    """``length`` matmuls in a row, each followed by a ReLU: every legal fusion pays under
    ``launch_bound``, so only the limits stop a group."""
    nodes, x = [], "x"
    weights = {}
    for k in range(length):
        weights[f"w{k}"] = _w(16, 16)
        nodes += [
            helper.make_node("MatMul", [x, f"w{k}"], [f"mm{k}"]),
            helper.make_node("Relu", [f"mm{k}"], [f"r{k}"]),
        ]
        x = f"r{k}"
    return import_onnx(make_model(nodes, {"x": _w(8, 16)}, [x], weights))


def test_groups_stay_within_the_stage_and_member_limits():
    g = matmul_chain(12)
    unbounded = fuse(g, launch_bound(g)).groups
    assert max(len(grp.stages) for grp in unbounded) == MAX_GROUP_STAGES  # the default limit binds
    assert all(len(grp.members) <= MAX_GROUP_MEMBERS for grp in unbounded)
    capped = fuse(g, launch_bound(g), max_stages=3).groups
    assert max(len(grp.stages) for grp in capped) == 3 and len(capped) > len(unbounded)
    _check_invariants(g, capped)


def test_fusion_restricted_to_some_nodes_leaves_the_others_out():
    g = matmul_chain(4)
    only = {"mm1", "r1", "mm2", "r2"}
    groups = fuse(g, launch_bound(g), only=only).groups
    assert {m for grp in groups for m in grp.members} == only


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


def shared_exp() -> Graph:
    """exp(x) read by two matmuls: two sinks, so two kernels at least (one weight an input,
    so that the import does not merge the two products into one)."""
    nodes = [
        helper.make_node("Exp", ["x"], ["t"]),
        helper.make_node("MatMul", ["t", "w1"], ["a"]),
        helper.make_node("MatMul", ["t", "w2"], ["b"]),
    ]
    return import_onnx(make_model(nodes, {"x": _w(8, 16), "w2": _w(16, 4)}, ["a", "b"], {"w1": _w(16, 4)}))


def test_tensor_used_by_two_groups_is_always_written():
    g = shared_exp()
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


# -- --nofusion: one group per reduction ----------------------------------------------------------


def _reductions(graph: Graph, names: Iterable[str]) -> int:
    return sum(1 for n in names if graph.nodes[n].compute.is_reduction)


def unavoidable_leftovers(graph: Graph) -> int:
    """Groups without a reduction that ``--nofusion`` cannot avoid, counted from the graph.

    An injective node is written by a kernel when it is a graph output or the nodes that
    read it do not all end up in one kernel (else it is inlined there).  With no reduction
    upstream of it, no reduction's kernel can take it as an epilogue either, so its kernel
    computes no reduction.  Every other written injective node of the test models is the
    epilogue of a reduction's kernel."""
    read_by: dict[str, frozenset[str]] = {}  # the written nodes whose kernels compute a node
    for n in reversed(graph.topo_order()):
        into = frozenset().union(*(read_by[c.name] for c in graph.consumers(n.name)))
        inlined = not n.compute.is_reduction and n.name not in graph.outputs and len(into) == 1
        read_by[n.name] = into if inlined else frozenset({n.name})
    upstream: dict[str, bool] = {}  # a reduction upstream
    for n in graph.topo_order():
        producers = [t for t in n.inputs if t in graph.nodes]
        upstream[n.name] = any(graph.nodes[t].compute.is_reduction or upstream[t] for t in producers)
    return sum(
        1
        for n in graph.nodes.values()
        if read_by[n.name] == {n.name} and not n.compute.is_reduction and not upstream[n.name]
    )


def _check_nofusion(graph: Graph, groups: list[Group]) -> None:
    _check_invariants(graph, groups)
    assert all(_reductions(graph, grp.members) <= 1 for grp in groups), "two reductions in one kernel"
    assert all(_reductions(graph, grp.stages) == _reductions(graph, grp.members) for grp in groups)
    reductions = _reductions(graph, graph.nodes)
    assert len(groups) == reductions + unavoidable_leftovers(graph)


def test_nofusion_is_one_group_per_reduction():
    g = attention()
    result = fuse(g, launch_bound(g), nofusion=True)
    _check_nofusion(g, result.groups)
    assert len(result.groups) == 7 and unavoidable_leftovers(g) == 0
    # Head splits inline into the matmuls that read them; the scaling is the scores' epilogue.
    scores = _group_of(result, "scores")
    assert {"q4", "qt", "k4", "kt", "scaled"} <= set(scores.members) and scores.root == "scaled"
    assert {"v4", "vt"} <= set(_group_of(result, "ctx").members)
    # The softmax's two reductions are two kernels; exp is the epilogue of the max and the
    # division the epilogue of the sum, not a prologue of the product that reads it.
    assert _group_of(result, "probs:max") is _group_of(result, "probs:exp")
    assert _group_of(result, "probs:sum") is not _group_of(result, "probs:max")
    assert _group_of(result, "probs:sum") is _group_of(result, "probs")


def test_nofusion_leaves_an_injective_node_read_by_two_kernels_alone():
    g = shared_exp()
    result = fuse(g, launch_bound(g), nofusion=True)
    _check_nofusion(g, result.groups)
    assert unavoidable_leftovers(g) == 1 and _group_of(result, "t").members == ("t",)


def test_nofusion_writes_an_injective_graph_output_from_its_producers_kernel():
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    g = import_onnx(make_model(nodes, {"x": _w(8, 16)}, ["r", "y"], {"w1": _w(16, 8), "w2": _w(8, 4)}))
    result = fuse(g, launch_bound(g), nofusion=True)
    _check_nofusion(g, result.groups)
    assert [grp.members for grp in result.groups] == [("a", "r"), ("y",)]
    assert result.groups[0].outputs == ("r",)


def test_nofusion_makes_arithmetic_between_products_the_epilogue_of_the_first():
    """A bias and activation between two matmuls is the first one's epilogue: as the second
    one's prologue it would be recomputed at every read of its operand."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("Add", ["a", "b"], ["ab"]),
        helper.make_node("Erf", ["ab"], ["e"]),
        helper.make_node("MatMul", ["e", "w2"], ["y"]),
    ]
    inits = {"w1": _w(16, 8), "b": _w(8), "w2": _w(8, 4)}
    g = import_onnx(make_model(nodes, {"x": _w(8, 16)}, ["y"], inits))
    result = fuse(g, launch_bound(g), nofusion=True)
    _check_nofusion(g, result.groups)
    assert [grp.members for grp in result.groups] == [("a", "ab", "e"), ("y",)]


def normalised_attention(c: int = 48, pixels: int = 65536) -> Graph:
    """Restormer's transposed attention: queries and keys (c x pixels, from a product) each
    divided by its rows' L2 norms, then their c x c product."""
    nodes = []
    for n in ("q", "k"):
        nodes += [
            helper.make_node("MatMul", [f"w{n}", "x"], [n]),
            helper.make_node("ReduceL2", [n], [f"{n}l2"], axes=[1], keepdims=1),
            helper.make_node("Clip", [f"{n}l2", "eps"], [f"{n}c"]),
            helper.make_node("Div", [n, f"{n}c"], [f"{n}n"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["kn"], ["knt"], perm=[1, 0]),
        helper.make_node("MatMul", ["qn", "knt"], ["attn"]),
    ]
    inits = {"wq": _w(c, c), "wk": _w(c, c), "eps": np.array(1e-12, np.float32)}
    return import_onnx(make_model(nodes, {"x": _w(c, pixels)}, ["attn"], inits))


def test_nofusion_keeps_arithmetic_apart_where_its_prologue_is_slower():
    """Rows of 65,536 are too long for the norms' kernels to divide as their epilogue, so
    the division becomes the product's prologue only where the measure finds that no slower
    than two kernels: not on the H100's cost model, where it would put the product on CUDA
    cores without FFMA; yes where launches dominate."""
    g = normalised_attention()
    arch = get_arch("H100")
    cost = CostModel(g, arch, Options(topk=1))
    groups = [p.group for p in plan_model(g, arch, topk=1, nofusion=True).groups]
    product, *divisions = (next(grp for grp in groups if n in grp.members) for n in ("attn", "qn", "kn"))
    assert product.members == ("knt", "attn")
    assert all(d.members[-1] in ("qn", "kn") and "ql2:sum" not in d.members for d in divisions)
    union = make_group(g, set(product.members).union(*(d.members for d in divisions)))
    assert sum(cost(grp) for grp in [product, *divisions]) < cost(union)
    launches = launch_bound(g)
    result = fuse(g, lambda grp: None if cost(grp) is None else launches(grp), nofusion=True)
    _check_nofusion(g, result.groups)
    assert {"qc", "qn", "kc", "kn"} <= set(_group_of(result, "attn").members)


def test_nofusion_keeps_an_epilogue_apart_where_the_union_is_slower():
    """Restormer's upsampling: a convolution whose output is rearranged (DepthToSpace),
    concatenated with a skip and transposed.  As the convolution's epilogue the rearranging
    dictates its tiles and takes it off FFMA (an H200 measured 2.9 ms in fp32 against about
    0.3 ms for the two kernels apart), so it is an epilogue only where the measure finds
    the union no slower: not on the H100's cost model; yes where launches dominate."""
    c, h = 48, 64
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["u"], pads=[1, 1, 1, 1]),
        helper.make_node("DepthToSpace", ["u"], ["d"], blocksize=2),
        helper.make_node("Concat", ["d", "skip"], ["cat"], axis=1),
        helper.make_node("Transpose", ["cat"], ["t"], perm=[0, 2, 3, 1]),
    ]
    inputs = {"x": _w(1, c, h, h), "skip": _w(1, c // 2, 2 * h, 2 * h)}
    g = import_onnx(make_model(nodes, inputs, ["t"], {"w": _w(2 * c, c, 3, 3)}))
    arch = get_arch("H100")
    cost = CostModel(g, arch, Options(topk=1))
    groups = [p.group for p in plan_model(g, arch, topk=1, nofusion=True).groups]
    assert [grp.members for grp in groups] == [("u:conv",), ("u", "d", "cat", "t")]
    assert sum(cost(grp) for grp in groups) < cost(make_group(g, set(g.nodes)))
    launches = launch_bound(g)
    result = fuse(g, lambda grp: None if cost(grp) is None else launches(grp), nofusion=True)
    _check_nofusion(g, result.groups)
    assert [grp.members for grp in result.groups] == [("u:conv", "u", "d", "cat", "t")]


def test_nofusion_keeps_a_prologue_apart_where_the_group_is_slower():
    """BSRN's concatenation in front of a 1x1 convolution: as its prologue it keeps the
    convolution off the tensor cores, so it is a kernel of its own where the measure finds
    the two faster (the H100's cost model, in fp16), and a prologue where launches dominate."""
    c, h = 32, 128
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w"], ["y"]),
    ]
    inputs = {"a": _w(1, c, h, h).astype(np.float16), "b": _w(1, c, h, h).astype(np.float16)}
    g = import_onnx(make_model(nodes, inputs, ["y"], {"w": _w(c, 2 * c, 1, 1).astype(np.float16)}))
    arch = get_arch("H100")
    cost = CostModel(g, arch, Options(topk=1))
    groups = [p.group for p in plan_model(g, arch, topk=1, nofusion=True).groups]
    assert [grp.members for grp in groups] == [("cat",), ("y:conv", "y")]
    assert sum(cost(grp) for grp in groups) < cost(make_group(g, set(g.nodes)))
    launches = launch_bound(g)
    result = fuse(g, lambda grp: None if cost(grp) is None else launches(grp), nofusion=True)
    _check_nofusion(g, result.groups)
    assert [grp.members for grp in result.groups] == [("cat", "y:conv", "y")]


def test_nofusion_leaves_a_view_alone_for_a_computed_epilogue():
    """y feeds a reshape and a ReLU -> transpose; only one of them can be y's epilogue.  The
    reshape on its own is a view that launches nothing, so the ReLU and transpose take it."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("Reshape", ["y", "shape"], ["z"]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
    ]
    inits = {"w": _w(16, 6), "shape": np.array([2, 3, 6], np.int64)}
    g = import_onnx(make_model(nodes, {"x": _w(6, 16)}, ["z", "t"], inits))
    result = fuse(g, launch_bound(g), nofusion=True)
    _check_invariants(g, result.groups)
    assert [grp.members for grp in result.groups] == [("y", "r", "t"), ("z",)]
    assert find_views(g, result.groups) == {"z": "y"}
    # The reshape as y's only reader is its epilogue: the kernel writes z, not y.
    g2 = import_onnx(make_model(nodes[:2], {"x": _w(6, 16)}, ["z"], inits))
    assert [grp.members for grp in fuse(g2, launch_bound(g2), nofusion=True).groups] == [("y", "z")]


NOFUSION_MODELS = {
    "bert_2_layers_embeddings": (dict(seq=8, embeddings=True, layers=2), "bert_encoder_layer", 2),
    "bert_sdpa": (dict(seq=8, sdpa=True), "bert_encoder_layer", 0),
    "mobilenetv2": ({}, "mobilenetv2_block", 0),
    "vit": ({}, "vit_block", 0),
    "gpt2": ({}, "gpt2_model", 1),
}


@pytest.mark.parametrize("name", list(NOFUSION_MODELS))
def test_nofusion_on_whole_models(name):
    """The mask and the embedding sum of a two-layer BERT, and GPT-2's token + position sum,
    read by several kernels with nothing upstream, are the only kernels without a reduction."""
    models = pytest.importorskip("models")
    kwargs, builder, leftovers = NOFUSION_MODELS[name]
    model, _ = getattr(models, builder)(**kwargs)
    g = import_onnx(model)
    plan = plan_model(g, get_arch("H100"), topk=1, nofusion=True)
    groups = [p.group for p in plan.groups]
    _check_nofusion(g, groups)
    assert unavoidable_leftovers(g) == leftovers
    assert plan.kernels == _reductions(g, g.nodes) + leftovers < len(g.nodes)
    assert len(plan_model(g, get_arch("H100"), topk=1).groups) <= plan.kernels


@pytest.mark.skipif(not emulator_available(), reason="needs g++")
def test_nofusion_kernels_compute_the_model():
    """A two-layer BERT with embeddings scheduled with ``nofusion``, its generated kernels run
    by the CPU emulator, against the reference interpreter."""
    models = pytest.importorskip("models")
    model, feeds = models.bert_encoder_layer(seq=8, embeddings=True, layers=2)
    g = import_onnx(model)
    plan = plan_model(g, get_arch("H100"), topk=1, nofusion=True)
    kernels = generate_model(g, [(p.group, p.configs[0]) for p in plan.groups])
    ours = EmulatedModel(g, kernels).run(feeds)
    reference = g.run(feeds)
    for result in compare(ours, reference):
        assert result.passed, f"{result.name}: error {result.metric:.3e} > {result.threshold:.1e}"


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


def _projection_then_window_norm(batch: int = 8) -> Graph:
    """Swin's block end and patch merging: a projection, its bias and the residual, the 2x2
    window partition (reshapes and a transpose) and the LayerNorm before the next product."""
    rng = np.random.default_rng(0)
    inputs = {
        "h": rng.standard_normal((batch, 3136, 384)).astype(np.float16),
        "r": rng.standard_normal((batch, 3136, 96)).astype(np.float16),
    }
    consts = {
        "w": (rng.standard_normal((384, 96)) / 20).astype(np.float16),
        "b": np.zeros(96, np.float16),
        "s1": np.array([batch, 56, 56, 96], np.int64),
        "s2": np.array([batch, 28, 2, 28, 2, 96], np.int64),
        "s3": np.array([batch, 28, 28, 384], np.int64),
        "g": np.ones(384, np.float16),
        "beta": np.zeros(384, np.float16),
        "w2": (rng.standard_normal((384, 192)) / 20).astype(np.float16),
    }
    nodes = [
        helper.make_node("MatMul", ["h", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["mb"]),
        helper.make_node("Add", ["mb", "r"], ["y"]),
        helper.make_node("Reshape", ["y", "s1"], ["y1"]),
        helper.make_node("Reshape", ["y1", "s2"], ["y2"]),
        helper.make_node("Transpose", ["y2"], ["y3"], perm=[0, 1, 3, 4, 2, 5]),
        helper.make_node("Reshape", ["y3", "s3"], ["y4"]),
        helper.make_node("LayerNormalization", ["y4", "g", "beta"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w2"], ["out"]),
    ]
    return import_onnx(make_model(nodes, inputs, ["out"], consts, opset=17))


def test_a_span_must_beat_the_greedy_fusion_of_its_nodes() -> None:
    """The span from the projection to the LayerNorm's sum of squares (a product too) beats
    one kernel per node, but as one group its projection runs on CUDA cores, which a
    tensor-core group and a fused normalisation apart beat; the span is dropped and the
    projection stays on tensor cores."""
    graph = _projection_then_window_norm()
    cm = CostModel(graph, get_arch("H100"))
    result = fuse(graph, cm)
    (home,) = [g for g in result.groups if "m" in g.members]
    assert cm.configs(home)[0].stages[0].kind in ("mma", "wgmma")
    assert not any(line.startswith("span") and "'m'" in line for line in result.log)
    whole = make_group(graph, [*home.members, "y4", "n:sum", "n:mean", "n:centred", "n:sqsum"])
    assert cm(whole) > result.latency_us - sum(cm(g) for g in result.groups if "out" in g.members)


def test_no_span_runs_between_two_norms() -> None:
    """Two LayerNorms in a row, the first's output read again later (Conformer's layer
    boundary: the final norm of one layer, the first of the next, the residual): each
    norm's sum of squares is a product by its body, but a span between them holds no
    matrix product to pay for its steps.  No span is formed, and no norm is split across
    kernels, as the span split the first norm on the H200 at batch 64."""
    shape = (512, 64, 512)
    ones = np.ones(512, np.float16)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["y1"], axis=-1, epsilon=1e-5),
        helper.make_node("LayerNormalization", ["y1", "s", "b"], ["y2"], axis=-1, epsilon=1e-5),
        helper.make_node("Add", ["y1", "y2"], ["out"]),
    ]
    graph = import_onnx(
        make_model(nodes, {"x": np.zeros(shape, np.float16)}, ["out"], {"s": ones, "b": ones}, opset=17)
    )
    result = fuse(graph, CostModel(graph, get_arch("H200"), Options(topk=20)))
    assert not any(line.startswith("span") for line in result.log)
    for norm in ("y1", "y2"):
        nodes_of_norm = {n for n in graph.nodes if n == norm or n.startswith(f"{norm}:")}
        assert len(nodes_of_norm) > 3
        assert sum(1 for g in result.groups if nodes_of_norm & set(g.members)) == 1, norm


def test_repeated_spans_are_searched_once_with_the_costs_of_each(monkeypatch) -> None:
    """The spans' greedy costs are searched once per structure: a two-layer GPT-2's layers
    have the same spans, and every span gets the cost a search of its own nodes gives."""
    from models import gpt2_model

    import welder.schedule.engine as engine

    graph = import_onnx(gpt2_model(layers=2)[0])
    cm = CostModel(graph, get_arch("H100"), workers=1)
    asked: list[tuple[list[set[str]], list[str]]] = []
    searched: list[set[str]] = []
    greedy_costs, greedy_cost = engine._greedy_costs, engine._greedy_cost

    def spy_costs(graph, spans, signatures, *rest):
        asked.append((spans, signatures))
        return greedy_costs(graph, spans, signatures, *rest)

    def spy_cost(graph, span, *rest):
        searched.append(set(span))
        return greedy_cost(graph, span, *rest)

    monkeypatch.setattr(engine, "_greedy_costs", spy_costs)
    monkeypatch.setattr(engine, "_greedy_cost", spy_cost)
    fuse(graph, cm)
    ((spans, signatures),) = asked
    assert len(set(signatures)) < len(spans)  # the layers repeat
    assert len(searched) == len(set(signatures))
    monkeypatch.undo()
    costs = engine._greedy_costs(graph, spans, signatures, cm, MAX_GROUP_STAGES)
    assert costs == [engine._greedy_cost(graph, span, cm, MAX_GROUP_STAGES) for span in spans]


def test_worker_processes_search_as_one_process_would() -> None:
    """A whole graph's search proposes groups in forked worker processes (CostModel.parallel:
    the nodes alone, each growth step's trials, the spans and their greedy costs): on a BERT
    layer the groups, latencies and log equal one process's, and the workers proposed all
    but a couple of the groups.  In a process of its own, since a pytest worker runs threads
    and no fork is taken among threads."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys; sys.path.insert(0, 'tests')\n"
        "from models import bert_encoder_layer\n"
        "from welder.arch import get_arch\n"
        "from welder.frontend.onnx import import_onnx\n"
        "from welder.schedule.engine import CostModel, fuse\n"
        "graph = import_onnx(bert_encoder_layer()[0])\n"
        "out = {}\n"
        "for workers in (1, 2):\n"
        "    cost = CostModel(graph, get_arch('H100'), workers=workers)\n"
        "    result = fuse(graph, cost)\n"
        "    groups = [sorted(g.members) for g in result.groups]\n"
        "    out[workers] = [groups, result.latencies, result.log, cost.forked, cost.calls - cost.forked]\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    alone, forked = out["1"], out["2"]
    assert alone[:3] == forked[:3]
    assert any(line.startswith("span") for line in alone[2])
    assert alone[3] == 0 and forked[3] > 0
    # Each growth step prefetches the next step's trials too, so the parent proposes almost
    # nothing itself (3 groups of 93; 6 of 89 when a step prefetched only its own trials, on
    # the layer before its projections were merged).
    assert forked[4] <= 3


def test_no_worker_processes_while_other_threads_run() -> None:
    import threading

    cost = CostModel(attention(heads=2), get_arch("H100"), workers=2)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with cost.parallel():
            assert cost._pool is None
    finally:
        stop.set()
        thread.join()


# -- members a window reads ------------------------------------------------------------------------


def _window_reads(activation: str, then: str) -> Graph:
    """``activation`` over [1, 8, 24], then ``then``: a depthwise convolution of 5 taps or a
    product with a weight."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 8, 24)).astype(np.float32)
    if then == "conv":
        last = helper.make_node("Conv", ["a", "w"], ["y"], group=8, pads=[2, 2])
        consts = {"w": rng.standard_normal((8, 1, 5)).astype(np.float32)}
    else:
        last = helper.make_node("MatMul", ["a", "w"], ["y"])
        consts = {"w": rng.standard_normal((24, 6)).astype(np.float32)}
    return import_onnx(
        make_model([helper.make_node(activation, ["x"], ["a"]), last], {"x": x}, ["y"], consts)
    )


def test_a_call_a_window_reads_is_a_stage():
    """A sigmoid or tanh that a convolution reads through its window is computed once a
    point (a stage), not at every tap; a ReLU or a negation (cheap) and a sigmoid a product
    reads point by point stay inlined.  Along GLU -> depthwise convolution, the GLU's
    product is the stage, the sigmoid inside it stays inlined."""
    for activation, then, staged in (
        ("Sigmoid", "conv", True),
        ("Tanh", "conv", True),
        ("Relu", "conv", False),
        ("Neg", "conv", False),
        ("Sigmoid", "matmul", False),
    ):
        graph = _window_reads(activation, then)
        group = make_group(graph, graph.nodes)
        assert ("a" in group.stages) == staged, (activation, then, group.stages)
    graph = import_onnx(conformer_conv_module(kernel=15)[0])
    group = _glu_and_depthwise(graph)
    glu = [s for s in group.stages if s.endswith("sequential.1/Mul_output_0")]
    assert glu and not any("Sigmoid" in s for s in group.stages)


def _glu_and_depthwise(graph: Graph) -> Group:
    """Conformer's GLU (its split and sigmoid) with the depthwise convolution reading it."""
    root = next(n for n in graph.nodes if n.endswith("sequential.3/BatchNormalization_output_0"))
    pointwise = next(n for n in graph.nodes if n.endswith("sequential.0/Conv_output_0"))
    before = nx.ancestors(graph.nx, pointwise) | {pointwise}
    return make_group(graph, [n for n in nx.ancestors(graph.nx, root) if n not in before] + [root])


def _silu_then_strided_depthwise() -> tuple[Graph, dict[str, np.ndarray]]:
    """MobileViT's inverted residual: SiLU, then a 3 x 3 depthwise convolution of stride 2
    (a two-dimensional window with a halo on both axes)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 8, 13, 13)).astype(np.float32)
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["a"]),
        helper.make_node("Conv", ["a", "w"], ["y"], group=8, pads=[1, 1, 1, 1], strides=[2, 2]),
    ]
    consts = {"w": rng.standard_normal((8, 1, 3, 3)).astype(np.float32)}
    graph = import_onnx(make_model(nodes, {"x": x}, ["y"], consts))
    return graph, {"x": x}


def _glu_then_depthwise_fp16() -> tuple[Graph, dict[str, np.ndarray]]:
    """A GLU, then a 31-tap depthwise convolution, in fp16 (the stage's tile in halves)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 16, 40)).astype(np.float16)
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], axis=1),
        helper.make_node("Sigmoid", ["b"], ["s"]),
        helper.make_node("Mul", ["a", "s"], ["g"]),
        helper.make_node("Conv", ["g", "w"], ["y"], group=8, pads=[15, 15]),
    ]
    consts = {"w": (rng.standard_normal((8, 1, 31)) / 5).astype(np.float16)}
    return import_onnx(make_model(nodes, {"x": x}, ["y"], consts)), {"x": x}


@pytest.mark.skipif(not emulator_available(), reason="needs g++ for the emulator")
@pytest.mark.parametrize("case", ["glu, 31 taps", "glu fp16, 31 taps", "silu, 3 x 3 stride 2"])
def test_a_staged_call_computes_what_the_interpreter_does(case: str):
    """Every config the cost model proposes for a group whose windowed call is a stage
    (its tile with the window's halo, zero padding at the edges), emulated against the
    interpreter: Conformer's GLU and 31-tap depthwise convolution (fp32, and fp16), and
    MobileViT's SiLU and strided 3 x 3 one."""
    from test_mma import emulate_configs

    from welder.ir.interpret import evaluate

    if case.startswith("glu"):
        model, feeds = conformer_conv_module(batch=2, frames=40, channels=16, kernel=31)
        graph = import_onnx(model)
        group = _glu_and_depthwise(graph)
    else:
        graph, feeds = _glu_then_depthwise_fp16() if "fp16" in case else _silu_then_strided_depthwise()
        group = make_group(graph, graph.nodes)
        assert {"a", "g"} & set(group.stages)
    values = {**graph.constants, **feeds}
    for node in graph.topo_order():
        values[node.name] = evaluate(node.compute, values)
    configs = CostModel(graph, get_arch("H100"), Options(topk=4)).configs(group)
    assert configs
    inputs = {t: values[t] for t in group.inputs if t not in graph.constants}
    for cfg, (outputs,) in zip(configs, emulate_configs(graph, group, configs, inputs)):
        for name, got in outputs.items():
            err = error_metric(got, values[name])
            assert err <= threshold_for(got.dtype.name), (cfg.block_tile, name, err)
