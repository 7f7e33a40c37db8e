"""The import's merge of sibling products (``frontend.passes.merge_sibling_products``).

MatMuls that multiply one tensor by constant matrices become one product and a Split; a
Linear's bias on each goes with them.  Every rewritten model is run in onnxruntime beside
the original, and imported models are interpreted and compared with onnxruntime on the
original, so a wrong offset, order or bias shows as a wrong output.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from models import bert_encoder_layer
from onnx import helper
from onnx_util import assert_matches_ort, make_model, to_half

from welder.arch import get_arch
from welder.check import error_metric, onnxruntime_outputs, threshold_for
from welder.frontend.onnx import import_onnx
from welder.frontend.passes import merge_sibling_products, simplify
from welder.pipeline import merge_limit, planned_import

WIDTHS = (16, 24, 8)


def siblings(
    opset: int = 17,
    bias: str = "all",
    extra_reader: bool = False,
    dynamic_weight: bool = False,
    batch: int = 2,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Three products of ``x`` [batch, 5, 12] with weights of widths :data:`WIDTHS`, each read by
    a Relu; ``bias``: "all" (an Add of a constant vector on each, operands in both orders,
    the last vector an Identity of an initializer),
    "some" (on the first only) or "none"; ``extra_reader`` has a Sigmoid read the second
    product too; ``dynamic_weight`` makes the third weight an input."""
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((batch, 5, 12)).astype(np.float32)}
    inits: dict[str, np.ndarray] = {}
    nodes, outputs = [], []
    for k, width in enumerate(WIDTHS):
        w = rng.standard_normal((12, width)).astype(np.float32)
        if dynamic_weight and k == 2:
            feeds[f"w{k}"] = w
        else:
            inits[f"w{k}"] = w
        nodes.append(helper.make_node("MatMul", ["x", f"w{k}"], [f"p{k}"], name=f"mm{k}"))
        read = f"p{k}"
        if bias == "all" or (bias == "some" and k == 0):
            inits[f"b{k}"] = rng.standard_normal(width).astype(np.float32)
            if k == 2:  # as the torch exporter writes a weight equal to another one
                inits[f"b{k}:source"] = inits.pop(f"b{k}")
                nodes.append(helper.make_node("Identity", [f"b{k}:source"], [f"b{k}"]))
            operands = [f"b{k}", f"p{k}"] if k % 2 else [f"p{k}", f"b{k}"]
            nodes.append(helper.make_node("Add", operands, [f"a{k}"], name=f"add{k}"))
            read = f"a{k}"
        nodes.append(helper.make_node("Relu", [read], [f"y{k}"]))
        outputs.append(f"y{k}")
    if extra_reader:
        nodes.append(helper.make_node("Sigmoid", ["p1"], ["s1"]))
        outputs.append("s1")
    return make_model(nodes, feeds, outputs, inits, opset=opset), feeds


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> None:
    names = [o.name for o in before.graph.output]
    want = onnxruntime_outputs(before, feeds, names)
    got = onnxruntime_outputs(after, feeds, names)
    dtype = next(iter(want.values())).dtype.name
    for name in names:
        assert got[name].shape == want[name].shape
        assert error_metric(got[name], want[name]) <= threshold_for(dtype), name


@pytest.mark.parametrize("opset", [12, 17])
@pytest.mark.parametrize("bias", ["all", "some", "none"])
def test_sibling_products_merge_and_compute_the_same(opset: int, bias: str) -> None:
    model, feeds = siblings(opset, bias)
    merged = simplify(model)
    ops = _ops(merged)
    assert ops.count("MatMul") == 1 and ops.count("Split") == 1
    # Biases travel with the product only when every product has one.
    assert ops.count("Add") == {"all": 1, "some": 1, "none": 0}[bias]
    split = next(n for n in merged.graph.node if n.op_type == "Split")
    sizes = [a for a in split.attribute if a.name == "split"]
    assert bool(sizes) == (opset < 13)  # an attribute before opset 13, an input from it on
    _same_outputs(model, merged, feeds)
    assert_matches_ort(model, feeds)  # the import merges too: interpreted against the original


def test_half_precision_products_merge() -> None:
    model, feeds = siblings()
    model = to_half(model)
    feeds = {k: v.astype(np.float16) for k, v in feeds.items()}
    merged = simplify(model)
    assert _ops(merged).count("MatMul") == 1
    _same_outputs(model, merged, feeds)


def test_a_product_read_twice_keeps_its_bias_apart() -> None:
    """The second product is read by its Add and by a Sigmoid: the products still merge,
    but no bias joins them (the Sigmoid needs the product without it)."""
    model, feeds = siblings(extra_reader=True)
    merged = simplify(model)
    assert _ops(merged).count("MatMul") == 1 and _ops(merged).count("Add") == 3
    _same_outputs(model, merged, feeds)


def test_nothing_merges_without_two_constant_weights() -> None:
    model, _ = siblings(dynamic_weight=True)
    assert merge_sibling_products(model) == 1  # the two constant ones
    assert _ops(model).count("MatMul") == 2
    lone = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        {"x": np.ones((3, 4), np.float32)},
        ["y"],
        {"w": np.ones((4, 5), np.float32)},
    )
    assert merge_sibling_products(lone) == 0 and _ops(lone) == ["MatMul"]


def test_weights_only_the_merged_product_read_are_dropped() -> None:
    """The merged weights and biases go, except one another node reads (w0, by a product of
    another tensor) and one an old exporter also lists as a graph input (b0: without its
    initializer it would become an input to feed)."""
    model, _ = siblings()
    g = model.graph
    g.input.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [3, 12]))
    g.node.append(helper.make_node("MatMul", ["z", "w0"], ["zw"]))
    g.output.append(helper.make_value_info("zw", onnx.TypeProto()))
    g.input.append(helper.make_tensor_value_info("b0", onnx.TensorProto.FLOAT, [WIDTHS[0]]))
    assert merge_sibling_products(model) == 2
    names = {t.name for t in g.initializer}
    assert {"w0", "b0"} <= names and not names & {"w1", "w2", "b1"}


def test_a_bert_layer_imports_with_one_projection_product() -> None:
    """HF BERT projects queries, keys and values separately; after import the layer holds
    one product of width three hidden sizes where it held three."""
    model, feeds = bert_encoder_layer(seq=8, hidden=32, heads=2, ffn=64)
    products = [n for n in import_onnx(model) if n.op_type == "MatMul"]
    projections = [n for n in products if "/attention/self/" in n.source and "/self/MatMul" not in n.source]
    assert [n.compute.axes[-1].extent for n in projections] == [96]
    assert len(products) == 6  # the projection, scores, context, output dense, FFN up and down
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("limit", [10 * max(WIDTHS) - 1, 10 * max(WIDTHS)])
def test_products_larger_than_the_limit_stay_apart(limit: int) -> None:
    """The widest product has 10 x 24 outputs: a limit one element smaller keeps all three
    apart, that limit merges them."""
    model, feeds = siblings()
    out = simplify(model, merge_limit=limit)
    assert _ops(out).count("MatMul") == (3 if limit < 10 * max(WIDTHS) else 1)
    _same_outputs(model, out, feeds)


def test_the_limit_reads_an_inferred_row_count() -> None:
    """In a BERT layer the products read a LayerNorm's output, whose rows only shape
    inference tells: 8 rows of 32, so a limit of 256 merges the projections and 255 not."""
    model, _ = bert_encoder_layer(seq=8, hidden=32, heads=2, ffn=64)
    for limit, products in ((255, 8), (256, 6)):
        graph = import_onnx(model, merge_limit=limit)
        assert sum(n.op_type == "MatMul" for n in graph) == products


@pytest.mark.parametrize("batch", [2, 40_000])
def test_tune_merges_products_too_small_to_fill_the_gpu(tmp_path, batch: int) -> None:
    """``welder tune`` merges below one wave of 128 x 128 tiles of the target (the H100:
    132 SMs, 2,162,688 elements): 10 x 24 outputs merge, 200,000 x 24 stay apart."""
    from welder.cli import main as welder_main

    model, _ = siblings(batch=batch)
    onnx.save(model, tmp_path / "model.onnx")
    assert welder_main(["tune", str(tmp_path), "--arch", "H100", "--cost-model", "--no-build"]) == 0
    doc = json.loads((tmp_path / "tuned.json").read_text())
    products = sum("MatMul" in g["ops"] for g in doc["groups"])  # a group holds at most one
    apart = 5 * batch * max(WIDTHS) > merge_limit(get_arch("H100"))
    assert products == (3 if apart else 1)
    # The tools that rebuild a tune's groups from its model (ranking, candidates) see its graph.
    graph = planned_import(model, get_arch(doc["arch"]))
    assert {m for g in doc["groups"] for m in g["members"]} <= set(graph.nodes)
