"""``--skip-dot`` scheduling: which computes are matrix products a library computes
(welder/schedule/kinds/library.py), checked by brute force -- numpy's matmul over the strided
views a GemmSpec describes must equal the interpreter's result -- and how such products
become groups of their own in the plan, the tuner and tuned.json."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from models import (
    bert_encoder_layer,
    gpt2_model,
    mobilenetv2_block,
    swin_window_attention_block,
    vit_block,
)
from onnx import helper
from onnx_util import make_model, single_op
from test_ops_einsum import CASES as EINSUM_CASES
from test_ops_linalg import MATMUL_SHAPES
from test_tuner import ScriptedDevice

from welder.arch import get_arch
from welder.check import error_metric, random_inputs, threshold_for
from welder.frontend.onnx import import_onnx
from welder.graph import Graph
from welder.ir.interpret import evaluate
from welder.schedule.kinds import config_from_json
from welder.schedule.kinds.library import (
    GemmSpec,
    LibraryConfig,
    find_gemm_groups,
    library_call,
    product_group,
)
from welder.schedule.plan import format_summary, plan_model, tuned_json
from welder.tune.tuner import tune_model

ARCH = get_arch("H100")

# -- brute force ------------------------------------------------------------------------------


def strided(base: np.ndarray, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """The elements of ``base`` (flat, row-major) at ``offset + sum(i * stride)``, after
    checking that every one of them lies inside ``base``."""
    flat = np.ascontiguousarray(base).reshape(-1)
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    assert offset >= 0 and min(strides) >= 0 and last < flat.size, "the description leaves the tensor"
    return np.lib.stride_tricks.as_strided(flat[offset:], shape, [s * flat.itemsize for s in strides])


def gemm_by_numpy(gemm: GemmSpec, env: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """The output ``gemm`` describes, computed by numpy from the operands' strided views
    and scattered into a NaN-filled tensor of ``shape`` (so an element it misses shows)."""
    a_inner = (1, gemm.lda) if gemm.trans_a else (gemm.lda, 1)
    b_inner = (1, gemm.ldb) if gemm.trans_b else (gemm.ldb, 1)
    a_dims = ((gemm.outer, gemm.batch, gemm.m, gemm.k), (gemm.outer_a, gemm.stride_a, *a_inner))
    b_dims = ((gemm.outer, gemm.batch, gemm.k, gemm.n), (gemm.outer_b, gemm.stride_b, *b_inner))
    a = strided(env[gemm.a], gemm.offset_a, *a_dims)
    b = strided(env[gemm.b], gemm.offset_b, *b_dims)
    product = np.matmul(a.astype(np.float64), b.astype(np.float64))
    covered = gemm.outer * gemm.batch * gemm.m * gemm.n
    assert covered == math.prod(shape), "the output is not covered exactly once"
    out = np.full(math.prod(shape), np.nan)
    strides = (gemm.outer_c, gemm.stride_c, gemm.ldc, 1)
    view = np.lib.stride_tricks.as_strided(out, product.shape, [s * 8 for s in strides])
    view[...] = product
    return out.reshape(shape)


def all_values(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of ``graph`` on seeded random inputs, by the interpreter."""
    env = {**graph.constants, **random_inputs(graph, seed)}
    for node in graph.topo_order():
        env[node.name] = evaluate(node.compute, env)
    return env


def members(graph: Graph, name: str) -> set[str] | None:
    """The nodes of ``name``'s library group, None if it is none."""
    found = product_group(graph, name)
    return None if found is None else set(found[0].members)


def matched(graph: Graph) -> dict[str, GemmSpec]:
    """Root -> GEMM of every product the library computes."""
    return {lg.group.root: lg.gemm for lg in find_gemm_groups(graph, ARCH)}


def assert_gemms_match_interpreter(graph: Graph) -> dict[str, GemmSpec]:
    gemms = matched(graph)
    env = all_values(graph)
    for root, gemm in gemms.items():
        expected = env[root]
        got = gemm_by_numpy(gemm, env, expected.shape).astype(expected.dtype)
        err = error_metric(got, expected)
        assert err <= threshold_for(expected.dtype.name), f"{root}: error {err:.2e} ({gemm})"
    return gemms


# -- every MatMul / Gemm / Einsum form of the op tests -------------------------------------------

#: Forms that are products but no single strided batched GEMM (or not worth one).
UNMATCHED_MATMULS = {
    ((5,), (5,)): "a dot product",
    ((1, 4), (4, 1)): "a dot product",
    ((2, 0, 3), (3, 4)): "empty",
}
#: Einsum equations that are matrix products of two operands (space-free), and the
#: shapes of them that still are no single GEMM.
PRODUCT_EQUATIONS = {
    "bij,bjk->bik",
    "bhid,bhjd->bhij",
    "bhij,bhjd->bhid",
    "ij,jk->ik",
    "bid,jd->bij",
    "...ij,...jk->...ik",
    "ij,jk",
    "nchw,oc->nohw",  # a pointwise convolution
}
UNMATCHED_EINSUMS = {
    ("ij,jk->ik", ((3, 1), (4, 5))): "an operand broadcast along the reduction",
}


def _rand(shape: tuple[int, ...], dtype=np.float32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _matmul_forms():
    for sa, sb in MATMUL_SHAPES:
        expected = (sa, sb) not in UNMATCHED_MATMULS
        yield pytest.param(
            "MatMul", {"a": _rand(sa), "b": _rand(sb, seed=1)}, {}, expected, id=f"matmul{sa}x{sb}"
        )
    for sa, sb in [((3, 8), (8, 5)), ((2, 3, 8), (8,)), ((4, 512), (512, 6))]:
        feeds = {"a": _rand(sa, np.float16), "b": _rand(sb, np.float16, seed=1)}
        yield pytest.param("MatMul", feeds, {}, True, id=f"matmul_fp16{sa}x{sb}")


def _gemm_forms():
    m, k, n = 3, 5, 4
    for ta in (0, 1):
        for tb in (0, 1):
            for extra in ({}, {"alpha": 0.5, "c": (1, n)}):
                attrs = {"transA": ta, "transB": tb, **{x: v for x, v in extra.items() if x != "c"}}
                feeds = {"a": _rand((k, m) if ta else (m, k)), "b": _rand((n, k) if tb else (k, n), seed=1)}
                if "c" in extra:
                    feeds["c"] = _rand(extra["c"], seed=2)
                yield pytest.param(
                    "Gemm", feeds, attrs, True, id=f"gemm_tA{ta}_tB{tb}{'_alpha_c' * bool(extra)}"
                )


def _einsum_forms():
    for equation, shapes in EINSUM_CASES:
        feeds = {f"x{j}": _rand(s, seed=j) for j, s in enumerate(shapes)}
        eq = equation.replace(" ", "")
        expected = eq in PRODUCT_EQUATIONS and (eq, tuple(shapes)) not in UNMATCHED_EINSUMS
        yield pytest.param(
            "Einsum", feeds, {"equation": equation}, expected, id=f"einsum[{equation.strip()}]"
        )


@pytest.mark.parametrize(
    ("op", "feeds", "attrs", "expected"), [*_matmul_forms(), *_gemm_forms(), *_einsum_forms()]
)
def test_op_forms_match_brute_force(op: str, feeds: dict, attrs: dict, expected: bool) -> None:
    """Each form is matched exactly when it should be, and a matched GEMM computes what
    the interpreter computes."""
    graph = import_onnx(single_op(op, feeds, attrs))
    gemms = assert_gemms_match_interpreter(graph)
    assert (len(gemms) == 1) is expected, gemms


# -- operands behind movement nodes -----------------------------------------------------------------


def _graph(nodes: list, inputs: dict, outputs: list, weights: dict | None = None) -> Graph:
    return import_onnx(make_model(nodes, inputs, outputs, weights or {}))


def test_transposed_operand_is_read_through() -> None:
    x, y = _rand((2, 5, 3)), _rand((2, 5, 4), seed=1)
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["xt", "y"], ["out"]),
    ]
    graph = _graph(nodes, {"x": x, "y": y}, ["out"])
    gemm = assert_gemms_match_interpreter(graph)["out"]
    assert gemm.a == "x" and gemm.trans_a and gemm.batch == 2
    assert members(graph, "out") == {"xt", "out"}


def test_attention_heads_are_strided_views_of_the_projections() -> None:
    """BERT's q and k^T are split + reshape + transpose of the merged [1, S, 3H] projection
    (the import merges the three): read with strides, batch over heads.  The attention
    output's transpose + reshape would interleave the output projection's reduction axis, so
    the product before writes them instead: its heads land side by side in each row of
    [S, H] (leading dimension H, batch stride d)."""
    graph = import_onnx(bert_encoder_layer()[0])
    gemms = assert_gemms_match_interpreter(graph)
    matmuls = [n.name for n in graph.topo_order() if n.op_type == "MatMul"]
    assert len(gemms) == len(matmuls)
    scores = next(m for m in matmuls if m.endswith("attention/self/MatMul_output_0"))
    qk = gemms[scores]
    assert (qk.batch, qk.m, qk.n, qk.k, qk.trans_b, qk.stride_a) == (4, 16, 16, 16, True, 16)
    assert {graph.nodes[m].op_type for m in members(graph, scores)} == {
        "Split",
        "Reshape",
        "Transpose",
        "MatMul",
    }
    context = next(m for m in matmuls if m.endswith("attention/self/MatMul_1_output_0"))
    written = next(r for r in gemms if context in (members_of := set(find_members(graph, r))))
    assert [graph.nodes[m].op_type for m in graph_order(graph, members_of)][-2:] == ["Transpose", "Reshape"]
    ctx = gemms[written]
    assert (ctx.c, ctx.batch, ctx.m, ctx.n, ctx.ldc, ctx.stride_c) == (written, 4, 16, 16, 64, 16)
    dense = next(m for m in matmuls if "attention/output/dense" in m)
    assert gemms[dense].a == written and find_members(graph, dense) == (dense,)


def find_members(graph: Graph, root: str) -> tuple[str, ...]:
    return next(lg.group.members for lg in find_gemm_groups(graph, ARCH) if lg.group.root == root)


def graph_order(graph: Graph, names: set[str]) -> list[str]:
    return [n.name for n in graph.topo_order() if n.name in names]


def test_movement_after_a_product_is_written_only_where_it_permutes() -> None:
    """A transpose after a product is written through (the batch's matrices side by side);
    a slice after one (no permutation), a transposed product that is also a graph output, and
    a product with two readers keep the product's own row-major output."""
    a, b = _rand((3, 4, 5)), _rand((3, 5, 6), seed=1)
    cases = {
        "transposed": ([helper.make_node("Transpose", ["p"], ["out"], perm=[1, 0, 2])], ["out"], True),
        "sliced": (
            [
                helper.make_node("Transpose", ["p"], ["t"], perm=[1, 0, 2]),
                helper.make_node("Slice", ["t", "starts", "ends", "axes"], ["out"]),
            ],
            ["out"],
            "t",
        ),
        "also_an_output": (
            [helper.make_node("Transpose", ["p"], ["out"], perm=[1, 0, 2])],
            ["out", "p"],
            False,
        ),
        "two_readers": (
            [
                helper.make_node("Transpose", ["p"], ["out"], perm=[1, 0, 2]),
                helper.make_node("Relu", ["p"], ["r"]),
            ],
            ["out", "r"],
            False,
        ),
    }
    limits = {"starts": np.array([1]), "ends": np.array([3]), "axes": np.array([0])}
    for name, (after, outputs, written) in cases.items():
        nodes = [helper.make_node("MatMul", ["a", "b"], ["p"]), *after]
        graph = _graph(nodes, {"a": a}, outputs, {"b": b, **limits})
        gemms = assert_gemms_match_interpreter(graph)
        root = {True: "out", False: "p"}.get(written, written)
        assert list(gemms) == [root], name
        if written is True:
            g = gemms["out"]
            assert (g.batch, g.m, g.n, g.ldc, g.stride_c) == (3, 4, 6, 18, 6), name


def test_batched_heads_are_written_by_the_split() -> None:
    """At batch 2 the heads of [B, S, H] are no single batch stride.  Their transposes start
    from the Split of the merged projection, whose kernels can write them as [B, heads, S, d]
    at no cost: the GEMMs read those in one call (rather than two, one per sequence), and the
    plan fuses each transpose into its part of the Split.  The context has no such producer
    after it: it is written through in two calls, each with the heads of one sequence side by
    side."""
    graph = import_onnx(bert_encoder_layer(batch=2)[0])
    gemms = assert_gemms_match_interpreter(graph)
    assert len(gemms) == 6  # the merged projection, scores, context, output dense, FFN up and down
    assert [g.outer for g in gemms.values()].count(1) == 5
    ctx = next(g for g in gemms.values() if g.outer > 1)
    assert (ctx.outer, ctx.outer_c, ctx.batch, ctx.stride_c, ctx.ldc) == (2, 16 * 64, 4, 16, 64)
    scores = next(r for r in gemms if r.endswith("attention/self/MatMul_output_0"))
    assert members(graph, scores) == {scores} and gemms[scores].batch == 8
    operands = {gemms[scores].a, gemms[scores].b}
    assert {graph.nodes[t].op_type for t in operands} == {"Transpose"}
    plan = plan_model(graph, ARCH, topk=1, skip_dot=True)
    for t in operands:
        group = next(g.group for g in plan.groups if t in g.group.members)
        assert {graph.nodes[m].op_type for m in group.members} == {"Split", "Reshape", "Transpose"}


def test_a_shared_transpose_is_read_from_memory() -> None:
    """A movement node two products read cannot be inlined into both groups: it keeps its
    buffer and both GEMMs read it plainly."""
    x, w1, w2 = _rand((6, 4)), _rand((6, 3), seed=1), _rand((6, 5), seed=2)
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "w1"], ["a"]),
        helper.make_node("MatMul", ["xt", "w2"], ["b"]),
    ]
    # w2 an input: of two constant weights the import would make one product.
    graph = _graph(nodes, {"x": x, "w2": w2}, ["a", "b"], {"w1": w1})
    gemms = assert_gemms_match_interpreter(graph)
    assert {g.a for g in gemms.values()} == {"xt"}
    assert all(members(graph, r) == {r} for r in gemms)


def test_a_transpose_that_is_an_output_keeps_its_buffer() -> None:
    x, w = _rand((6, 4)), _rand((6, 3), seed=1)
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "w"], ["a"]),
    ]
    graph = _graph(nodes, {"x": x}, ["a", "xt"], {"w": w})
    assert assert_gemms_match_interpreter(graph)["a"].a == "xt"


def test_computing_producers_are_operands_not_absorbed() -> None:
    """A bias add or an activation is no view: it stays its own node, the GEMM reads it."""
    x, w, bias = _rand((4, 6)), _rand((6, 5), seed=1), _rand((6,), seed=2)
    nodes = [helper.make_node("Add", ["x", "bias"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["out"])]
    graph = _graph(nodes, {"x": x}, ["out"], {"w": w, "bias": bias})
    assert assert_gemms_match_interpreter(graph)["out"].a == "h"
    assert members(graph, "out") == {"out"}


def test_sums_of_squares_are_not_products() -> None:
    """LayerNorm's variance is sum(c * c): a reduction that fuses, not a GEMM."""
    graph = import_onnx(bert_encoder_layer()[0])
    assert not any("LayerNorm" in root for root in matched(graph))


MODELS: dict[str, Callable[[], tuple[onnx.ModelProto, dict]]] = {
    "bert_batch2": lambda: bert_encoder_layer(batch=2),
    "bert_sdpa": lambda: bert_encoder_layer(sdpa=True),
    "vit": vit_block,
    "vit_einsum": lambda: vit_block(einsum=True),
    "swin": swin_window_attention_block,
    "gpt2": lambda: gpt2_model(layers=1, hidden=64, seq=16, vocab=128),
    "mobilenetv2": mobilenetv2_block,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_products_match_brute_force(name: str) -> None:
    """Every product matched in a real model (split qkv offsets, broadcast batches,
    pointwise convolutions) computes the interpreter's values."""
    graph = import_onnx(MODELS[name]()[0])
    assert assert_gemms_match_interpreter(graph)


# -- the plan ---------------------------------------------------------------------------------------


def bert_graph() -> Graph:
    return import_onnx(bert_encoder_layer()[0])


#: The products of :func:`bert_graph`: the merged query, key and value projection, scores,
#: context, output dense, FFN up and down.
BERT_PRODUCTS = 6


def test_plan_makes_products_groups_of_their_own() -> None:
    graph = bert_graph()
    plan = plan_model(graph, ARCH, topk=2, skip_dot=True)
    expected = {lg.group.root: set(lg.group.members) for lg in find_gemm_groups(graph, ARCH)}
    library = {g.group.root: g for g in plan.groups if g.library == "cublas"}
    assert {r: set(g.group.members) for r, g in library.items()} == expected
    assert plan.library_calls == len(expected) == BERT_PRODUCTS
    assert plan.kernels == len(plan.groups) - BERT_PRODUCTS
    for g in library.values():
        [stage] = g.configs[0].stages
        assert len(g.configs) == 1 and isinstance(stage, LibraryConfig) and stage.kind == "library"
        assert library_call(g.configs[0]) is stage and not g.configs[0].kernel
    seen: list[str] = [m for g in plan.groups for m in g.group.members]
    assert sorted(seen) == sorted(graph.nodes)  # a partition
    # The bias adds fall into other groups: a generated group reads each GEMM's output, except
    # the attention context, which the output projection's GEMM reads as it was written.
    readers = {t for g in plan.groups if g.library is None for t in g.group.inputs}
    gemms = [library_call(g.configs[0]).gemm for g in library.values()]
    gemm_operands = {t for gemm in gemms for t in (gemm.a, gemm.b)}
    assert set(expected) - readers - set(graph.outputs) == {t for t in expected if t in gemm_operands}
    assert len(gemm_operands & set(expected)) == 1
    available = {t.name for t in graph.inputs} | set(graph.constants)
    for g in plan.groups:  # execution order
        assert set(g.group.inputs) <= available, g.group.root
        available |= set(g.group.outputs)


def test_without_skip_dot_products_stay_kernels() -> None:
    graph = bert_graph()
    plain = plan_model(graph, ARCH, topk=1)
    doc = tuned_json(plain, graph)
    assert plain.library_calls == 0 and not doc["skip_dot"] and doc["totals"]["kernels"] == len(plain.groups)
    assert all(entry["library"] is None for entry in doc["groups"])
    assert {st["kind"] for entry in doc["groups"] for st in entry["configs"][0]["stages"]} == {"simt"}


def test_tuned_json_and_summary_show_cublas() -> None:
    graph = bert_graph()
    plan = plan_model(graph, ARCH, topk=1, skip_dot=True)
    doc = tuned_json(plan, graph)
    assert doc["skip_dot"] is True
    assert doc["totals"]["library_calls"] == BERT_PRODUCTS
    assert doc["totals"]["kernels"] == len(doc["groups"]) - BERT_PRODUCTS
    for entry in doc["groups"]:
        kinds = [st["kind"] for st in entry["configs"][0]["stages"]]
        assert (entry["library"] == "cublas") is (kinds == ["library"])
    summary = format_summary(plan, graph)
    rows = summary.splitlines()[1:-1]
    assert sum(" cuBLAS " in row for row in rows) == BERT_PRODUCTS
    assert f"{plan.kernels} kernels + {BERT_PRODUCTS} cuBLAS calls" in summary.splitlines()[-1]


def test_library_configs_round_trip_through_json() -> None:
    graph = bert_graph()
    lg = find_gemm_groups(graph, ARCH)[3]
    cfg = lg.config
    assert config_from_json(cfg.to_json()) == cfg
    renamed = cfg.renamed({lg.gemm.a: "in0", lg.gemm.c: "m0"})
    gemm = library_call(renamed).gemm
    assert (gemm.a, gemm.c, renamed.root, renamed.stages[0].node) == ("in0", "m0", "m0", "m0")


def test_tuner_leaves_library_groups_alone() -> None:
    """On a (fake) GPU, only generated groups are compiled and timed; library groups keep
    the library estimate."""
    graph = bert_graph()
    device = ScriptedDevice(graph)
    plan = tune_model(graph, ARCH, 2, None, device, skip_dot=True)
    library = {g.group.root for g in plan.groups if g.library == "cublas"}
    assert len(library) == BERT_PRODUCTS and plan.skip_dot
    assert not library & set(device.roots)
    assert all(hasattr(g, "measured_us") for g in plan.groups if g.library is None)
