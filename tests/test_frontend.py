"""The importer's behaviour around the lowerings: loading, shapes, checks, folding."""

import json
import re
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx_util import assert_close, assert_matches_ort, contrast_nodes, make_model, onnxruntime_outputs

import welder
from welder.arch import get_arch
from welder.check import error_metric, threshold_for
from welder.cli import parse_input_shape
from welder.codegen import generate_model
from welder.errors import ModelError, ShapeError, UnsupportedError
from welder.frontend.onnx import import_onnx, load_model
from welder.ir.expr import Binary, Const, Load, walk
from welder.pipeline import planned_graph
from welder.runtime.emu import available as emulator_available
from welder.runtime.emulate import EmulatedModel
from welder.schedule.plan import plan_model

RNG = np.random.default_rng(0)


def small_model(opset=17):
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Add", ["x", "w"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    return make_model(nodes, {"x": x}, ["y"], {"w": RNG.standard_normal((3,)).astype(np.float32)}, opset), x


def with_symbolic_input(model, dims):
    shape = model.graph.input[0].type.tensor_type.shape
    shape.Clear()
    for d in dims:
        if isinstance(d, str):
            shape.dim.add().dim_param = d
        else:
            shape.dim.add().dim_value = d
    return model


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(ModelError, match="no ONNX model"):
        load_model(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not a protobuf\xff" * 10)
    with pytest.raises(ModelError, match="not a readable ONNX model"):
        load_model(bad)


def test_folder_with_model_onnx(tmp_path):
    model, _x = small_model()
    onnx.save(model, tmp_path / "model.onnx")
    assert welder.InferenceSession(tmp_path).get_inputs()[0].name == "x"


def test_external_data_inside_folder_loads(tmp_path):
    model, x = small_model()
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    onnx.save(
        model, tmp_path / "m.onnx", save_as_external_data=True, location="weights.bin", size_threshold=0
    )
    assert (tmp_path / "weights.bin").exists()
    sess = welder.InferenceSession(tmp_path / "m.onnx")
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], np.maximum(x + w, 0), rtol=1e-6)


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd", "sub/../../outside.bin"])
def test_external_data_outside_folder_is_refused(tmp_path, location):
    model, _ = small_model()
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    onnx.save(model, folder / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    loaded = onnx.load(str(folder / "m.onnx"), load_external_data=False)
    for entry in loaded.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(loaded, folder / "m.onnx")
    with pytest.raises(ModelError, match="outside the model folder"):
        load_model(folder / "m.onnx")


def test_symbolic_dims_need_input_shape():
    model, _x = small_model()
    with_symbolic_input(model, ["batch", 3])
    with pytest.raises(ShapeError) as e:
        import_onnx(model)
    assert "x: [batch, 3]" in str(e.value)
    # The suggested flag can be pasted as it is: parse it the way the command line does.
    flag = re.search(r"--input-shape (\S+)", str(e.value)).group(1)
    name, dims = parse_input_shape(flag)
    assert (name, dims) == ("x", (1, 3))
    assert import_onnx(model, {name: dims}).inputs[0].shape == (1, 3)
    graph = import_onnx(model, {"x": (5, 3)})
    assert graph.inputs[0].shape == (5, 3)


def test_symbolic_example_guesses_batch_and_sequence():
    model, _x = small_model()
    with_symbolic_input(model, ["n", "len"])
    with pytest.raises(ShapeError, match=r"--input-shape x=1x128\n"):
        import_onnx(model)


@pytest.mark.parametrize(
    "shapes, message",
    [({"y": (1, 3)}, "model's inputs are 'x'"), ({"x": (2, 3, 1)}, "rank 2"), ({"x": (2, 4)}, "fixed to 3")],
)
def test_bad_input_shape_overrides(shapes, message):
    model, _ = small_model()
    with_symbolic_input(model, ["batch", 3])
    with pytest.raises(ShapeError, match=message):
        import_onnx(model, shapes)


def test_opset_above_range():
    model, _ = small_model(22)
    with pytest.raises(UnsupportedError, match="opset 22"):
        import_onnx(model)


def test_every_unsupported_op_is_listed_once():
    x = np.zeros((4,), np.float32)
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="first_nz"),
        helper.make_node("NonZero", ["x"], ["nz2"], name="second_nz"),
        helper.make_node("FancyOp", ["x"], ["f"], name="ms", domain="com.microsoft"),
        helper.make_node("Relu", ["x"], ["r"], name="ok"),
    ]
    model = make_model(nodes, {"x": x}, ["nz", "nz2", "f", "r"])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedError) as e:
        import_onnx(model)
    text = str(e.value)
    assert "2 unsupported" in text
    assert "NonZero (opset 17), first at node 'first_nz'" in text
    assert "com.microsoft.FancyOp (opset 1), first at node 'ms'" in text
    assert "second_nz" not in text and "Relu" not in text


def test_every_refused_node_is_listed_and_its_readers_are_skipped():
    """Attribute values a lowering refuses are collected over the whole model, like
    unsupported op types, so a user fixes them in one pass."""
    x = RNG.standard_normal((1, 1, 4, 4)).astype(np.float32)
    scales = np.asarray([1.0, 1.0, 2.0, 2.0], np.float32)
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["r1"], name="r1", mode="cubic", antialias=1),
        helper.make_node("Relu", ["r1"], ["after_r1"], name="after_r1"),
        helper.make_node(
            "Resize", ["x", "", "scales"], ["r2"], name="r2", mode="nearest", nearest_mode="banker"
        ),
        helper.make_node("Relu", ["x"], ["ok"], name="ok"),
    ]
    model = make_model(nodes, {"x": x}, ["after_r1", "r2", "ok"], {"scales": scales}, opset=18)
    with pytest.raises(UnsupportedError) as e:
        import_onnx(model)
    text = str(e.value)
    assert text.startswith("2 node(s) use features welder does not support")
    assert "'r1'" in text and "'r2'" in text and "nearest_mode" in text
    assert "after_r1" not in text


def test_nodes_out_of_order_and_cycles():
    model, x = small_model()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    assert_matches_ort(
        make_model(
            list(model.graph.node),
            {"x": x},
            ["y"],
            {"w": onnx.numpy_helper.to_array(model.graph.initializer[0])},
        ),
        {"x": x},
    )
    cyclic = make_model(
        [
            helper.make_node("Relu", ["b"], ["a"], name="r1"),
            helper.make_node("Relu", ["a"], ["b"], name="r2"),
        ],
        {"x": x},
        ["a"],
    )
    with pytest.raises(ModelError, match="cycle"):
        import_onnx(cyclic)


def test_constant_subgraphs_fold_and_dead_nodes_vanish():
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["c1", "c2"], ["c3"], name="const_mul"),
        helper.make_node("Add", ["x", "c3"], ["y"], name="add"),
        helper.make_node("Exp", ["x"], ["unused"], name="dead"),
    ]
    c = {
        "c1": RNG.standard_normal((3,)).astype(np.float32),
        "c2": RNG.standard_normal((3,)).astype(np.float32),
    }
    model = make_model(nodes, {"x": x}, ["y"], c)
    graph = import_onnx(model)
    assert [n.op_type for n in graph.topo_order()] == ["Add"]
    np.testing.assert_allclose(graph.constants["c3"], c["c1"] * c["c2"])
    assert "c1" not in graph.constants
    assert_matches_ort(model, {"x": x})


def test_repeated_computations_are_computed_once():
    """What an exporter repeats per layer -- the same ops on the same tensors, with equal
    constants of their own (BERT's mask made additive in every layer) -- is one node; the
    results still match onnxruntime.  Different constants, a graph output, and a weight too
    big to compare keep their nodes."""
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    mask = RNG.random((4, 8)) > 0.5
    fill = np.array(-1e4, np.float32)
    big = RNG.standard_normal((4096, 8)).astype(np.float32)
    nodes = []
    for k in range(3):
        nodes += [
            helper.make_node("Constant", [], [f"fill{k}"], value=numpy_helper.from_array(fill)),
            helper.make_node("Where", ["mask", f"fill{k}", "zero"], [f"additive{k}"]),
            helper.make_node("Add", ["x", f"additive{k}"], [f"scores{k}"]),
            helper.make_node("Softmax", [f"scores{k}"], [f"probs{k}"], axis=-1),
        ]
    nodes += [
        helper.make_node("Where", ["mask", "other_fill", "zero"], ["other"]),
        helper.make_node("Relu", ["x"], ["out_relu"]),
        helper.make_node("Relu", ["x"], ["out_relu_again"]),
        helper.make_node("Gather", ["big", "rows"], ["g0"], axis=0),
        helper.make_node("Gather", ["big_copy", "rows"], ["g1"], axis=0),
        helper.make_node("Sum", ["probs0", "probs1", "probs2", "other"], ["y"]),
        helper.make_node("Sub", ["g0", "g1"], ["gd"]),
    ]
    consts = {
        "zero": np.array(0.0, np.float32),
        "other_fill": np.array(-2e4, np.float32),
        "big": big,
        "big_copy": big.copy(),
    }
    feeds = {"x": x, "mask": mask, "rows": np.array([1, 3], np.int64)}
    model = make_model(nodes, feeds, ["y", "out_relu", "out_relu_again", "gd"], consts)
    graph = import_onnx(model)
    ops = Counter(n.op_type for n in graph.topo_order())
    layer = Counter(
        n.op_type for n in import_onnx(make_model(nodes[:4], {"x": x, "mask": mask}, ["probs0"], consts))
    )
    assert (ops["Add"], ops["Softmax"]) == (1, layer["Softmax"])
    assert ops["Where"] == 2 and ops["Relu"] == 2 and ops["Gather"] == 2
    assert_matches_ort(model, feeds)


def _sdpa_scores(extra: list, outputs: list[str]) -> tuple:
    """Attention scores as PyTorch's scaled_dot_product_attention exports them -- queries
    and transposed keys each multiplied by a scalar, then their product -- with ``extra``
    nodes beside them."""
    q, k = (RNG.standard_normal((2, 3, 5, 8)).astype(np.float32) for _ in range(2))
    nodes = [
        helper.make_node("Mul", ["q", "root_scale"], ["qs"], name="scale_q"),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["kt", "root_scale"], ["ks"], name="scale_k"),
        helper.make_node("MatMul", ["qs", "ks"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        *extra,
    ]
    consts = {
        "root_scale": np.array(8**-0.25, np.float32),
        "two": np.array([2.0], np.float32),
        "per_row": RNG.standard_normal((5, 1)).astype(np.float32),
    }
    return make_model(nodes, {"q": q, "k": k}, outputs, consts), {"q": q, "k": k}


def test_scales_move_past_the_products_they_feed():
    """A product of scaled operands sums the unscaled ones and scales the sum: the scaled
    queries and keys (a view of the keys) are no nodes any more; results match onnxruntime.
    A factor that is not one scalar, a scaled tensor something else reads too, and a graph
    output keep their nodes.  The import itself leaves the scales where the model has them
    (the rewrite rounds differently: ``welder tune`` applies it)."""
    model, feeds = _sdpa_scores([], ["p"])
    assert {"qs", "ks"} <= set(import_onnx(model).nodes)
    graph = import_onnx(model).move_scales_past_products()
    (product,) = [n for n in graph.topo_order() if n.compute.is_product]
    assert product.name == "s:unscaled" and set(product.inputs) <= {"q", "k", "kt"}
    assert not {"qs", "ks"} & set(graph.nodes)
    # both operands' scales, one multiply a score: the sum times the factors' product
    scale = graph.nodes["s"].compute.body
    assert isinstance(scale, Binary) and scale.op == "mul" and isinstance(scale.a, Load)
    assert scale.a.tensor == "s:unscaled" and not any(
        isinstance(e, Load) and e.tensor == "s:unscaled" for e in walk(scale.b)
    )
    _assert_graph_matches_ort(graph, model, feeds)

    divided = [
        helper.make_node("Div", ["q", "two"], ["qd"]),
        helper.make_node("MatMul", ["qd", "kt"], ["by_div"]),
        helper.make_node("Mul", ["q", "per_row"], ["qr"]),
        helper.make_node("MatMul", ["qr", "kt"], ["by_rows"]),
        helper.make_node("Mul", ["q", "two"], ["shared"]),
        helper.make_node("MatMul", ["shared", "kt"], ["by_shared"]),
        helper.make_node("Relu", ["shared"], ["shared_relu"]),
        helper.make_node("Mul", ["kt", "two"], ["out"]),
        helper.make_node("MatMul", ["q", "out"], ["by_output"]),
    ]
    outputs = ["p", "by_div", "by_rows", "by_shared", "shared_relu", "out", "by_output"]
    model, feeds = _sdpa_scores(divided, outputs)
    graph = import_onnx(model).move_scales_past_products()
    assert "by_div:unscaled" in graph.nodes and "qd" not in graph.nodes
    assert graph.nodes["by_div"].compute.body.op == "div"
    assert {"qr", "shared", "out"} <= set(graph.nodes)
    assert not {"by_rows:unscaled", "by_shared:unscaled", "by_output:unscaled"} & set(graph.nodes)
    _assert_graph_matches_ort(graph, model, feeds)


def test_integer_division_stays_before_the_product():
    """Integers' division truncates, so ``(x // 3) . y`` is not ``(x . y) // 3``: the
    division keeps its node, and the rewritten graph computes what the import does."""
    x = RNG.integers(-20, 20, (4, 5)).astype(np.int64)
    y = RNG.integers(-20, 20, (5, 3)).astype(np.int64)
    nodes = [helper.make_node("Div", ["x", "three"], ["xd"]), helper.make_node("MatMul", ["xd", "y"], ["z"])]
    graph = import_onnx(make_model(nodes, {"x": x, "y": y}, ["z"], {"three": np.array(3, np.int64)}))
    moved = graph.move_scales_past_products()
    assert "xd" in moved.nodes and "z:unscaled" not in moved.nodes
    np.testing.assert_array_equal(moved.run({"x": x, "y": y})["z"], np.trunc(x / 3).astype(np.int64) @ y)


def test_long_reductions_of_few_outputs_are_split_in_two():
    """A global pool over 128 x 256 pixels of 16 channels, and a max over 32768 elements
    of 2 rows, become a partial reduction over slices of their outermost reduced axis and a
    reduction of the partials; onnxruntime agrees with the result.  A pool of many outputs
    (batch 64 x 16 channels), a short reduction, a product, and a mean with the variance
    around it (one kernel computes both) are left as they were."""
    x = RNG.standard_normal((1, 16, 128, 256)).astype(np.float32)
    y = RNG.standard_normal((2, 32768)).astype(np.float32)
    wide = RNG.standard_normal((64, 16, 16, 64)).astype(np.float32)
    short = RNG.standard_normal((1, 16, 64, 64)).astype(np.float32)
    a = RNG.standard_normal((2, 32768)).astype(np.float32)
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
        helper.make_node("Mul", ["x", "pooled"], ["scaled"]),
        helper.make_node("ReduceMax", ["y"], ["ymax"], axes=[1], keepdims=0),
        helper.make_node("GlobalAveragePool", ["wide"], ["wide_pooled"]),
        helper.make_node("GlobalAveragePool", ["short"], ["short_pooled"]),
        helper.make_node("MatMul", ["y", "at"], ["product"]),
        helper.make_node("ReduceMean", ["z"], ["mean"], axes=[2, 3], keepdims=1),
        helper.make_node("Sub", ["z", "mean"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["squares"]),
        helper.make_node("ReduceMean", ["squares"], ["variance"], axes=[2, 3], keepdims=1),
    ]
    at = np.ascontiguousarray(a.T[:, :1])
    z = RNG.standard_normal((1, 8, 128, 256)).astype(np.float32)
    feeds = {"x": x, "y": y, "wide": wide, "short": short, "z": z}
    outputs = ["scaled", "ymax", "wide_pooled", "short_pooled", "product", "variance"]
    model = make_model(nodes, feeds, outputs, {"at": at})
    graph = import_onnx(model).split_long_reductions()
    parts = {n for n in graph.nodes if n.endswith(":part")}
    assert len(parts) == 2
    for part in parts:
        c = graph.nodes[part].compute
        whole = graph.nodes[part[: -len(":part")]].compute
        reduced = int(np.prod([ax.extent for ax in c.reduce_axes]))
        assert c.shape == (*whole.shape, whole.reduce_axes[0].extent) and reduced >= 2048
        assert reduced * whole.reduce_axes[0].extent in (128 * 256, 32768)
    assert not any(graph.nodes[n].compute.is_product and n.endswith(":part") for n in graph.nodes)
    _assert_graph_matches_ort(graph, model, feeds)


@pytest.mark.skipif(not emulator_available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_split_reductions_run_as_generated_kernels(dtype) -> None:
    """A NAFNet-like channel attention (a pool over 128 x 256 pixels scaling its input)
    and a long ReduceSum, planned, through the H100 plan's kernels on the emulator, against
    the interpreter of the graph as imported.  Partial sums are fp32 (the pool sums in fp32;
    a half ReduceSum's partials and total are made fp32 and cast back)."""
    x = RNG.standard_normal((1, 16, 128, 256)).astype(dtype)
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
        helper.make_node("Mul", ["x", "pooled"], ["scaled"]),
        helper.make_node("ReduceSum", ["x", "hw"], ["summed"], keepdims=1),
    ]
    model = make_model(nodes, {"x": x}, ["scaled", "pooled", "summed"], {"hw": np.array([2, 3], np.int64)})
    graph = planned_graph(import_onnx(model))
    parts = [graph.nodes[n].compute for n in graph.nodes if n.endswith(":part")]
    assert [c.dtype for c in parts] == ["float32", "float32"]
    assert (dtype == np.float16) == any(n.endswith(":total") for n in graph.nodes)
    plan = plan_model(graph, get_arch("H100"), topk=1)
    kernels = generate_model(graph, [(p.group, p.configs[0]) for p in plan.groups])
    ours = EmulatedModel(graph, kernels).run({"x": x})
    reference = import_onnx(model).run({"x": x})
    for name in ("scaled", "pooled", "summed"):
        assert error_metric(ours[name], reference[name]) <= threshold_for(graph.tensor(name).dtype), name


@pytest.mark.skipif(not emulator_available(), reason="the CPU emulator needs Linux and g++")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_contrast_of_few_channels_runs_in_blocks_past_the_default_limit(dtype) -> None:
    """BSRN's contrast (a channel's mean plus its standard deviation) over 64 x 128 pixels
    of 4 channels is at most 4 blocks: the policy offers blocks of 512 and 1024 threads
    splitting the reduction, and each runs on the emulator as the interpreter computes the
    graph."""
    x = RNG.standard_normal((1, 4, 64, 128)).astype(dtype)
    nodes = contrast_nodes("x", "contrast")
    model = make_model(nodes, {"x": x}, ["contrast"])
    graph = planned_graph(import_onnx(model))
    [planned] = plan_model(graph, get_arch("H100"), topk=8).groups
    large = {(c.threads, c.grid): c for c in planned.configs if c.threads > 256}
    assert {threads for threads, _ in large} == {512, 1024}
    reference = import_onnx(model).run({"x": x})["contrast"]
    for cfg in large.values():
        assert cfg.estimate.blocks <= 4 and max(st.reduce_threads for st in cfg.stages) > 32
        ours = EmulatedModel(graph, generate_model(graph, [(planned.group, cfg)])).run({"x": x})["contrast"]
        assert error_metric(ours, reference) <= threshold_for(graph.tensor("contrast").dtype), cfg.threads


def test_a_half_global_average_pool_sums_in_fp32() -> None:
    """256 x 128 halves of 40 sum past fp16's largest value; their mean is 40."""
    x = np.full((1, 2, 128, 256), 40, np.float16)
    model = make_model([helper.make_node("GlobalAveragePool", ["x"], ["p"])], {"x": x}, ["p"])
    graph = import_onnx(model)
    assert graph.tensor("p").dtype == "float16"
    np.testing.assert_array_equal(graph.run({"x": x})["p"], np.full((1, 2, 1, 1), 40, np.float16))
    _assert_graph_matches_ort(graph, model, {"x": x})


def _assert_graph_matches_ort(graph, model, feeds) -> None:
    assert_close(graph.run(feeds), onnxruntime_outputs(model, feeds, [o.name for o in model.graph.output]))


def test_outputs_that_alias_inputs_constants_or_each_other():
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Identity", ["x"], ["same_as_x"]),
        helper.make_node("Identity", ["w"], ["same_as_w"]),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Identity", ["r"], ["r_again"]),
    ]
    model = make_model(
        nodes, {"x": x}, ["same_as_x", "same_as_w", "r", "r_again"], {"w": np.arange(3, dtype=np.float32)}
    )
    graph = import_onnx(model)
    assert graph.outputs == ["same_as_x", "same_as_w", "r", "r_again"]
    assert_matches_ort(model, {"x": x})


def test_model_json_is_stable_and_readable(tmp_path):
    model, _ = small_model()
    a = import_onnx(model).to_json()
    b = import_onnx(model).to_json()
    assert json.dumps(a) == json.dumps(b)
    assert a["nodes"][-1]["compute"] == "y[i0:2, i1:3] = max(a[i0, i1], 0.0)"
    assert a["edges"] == [{"src": "a", "dst": "y", "tensor": "a"}]


def test_session_validates_feeds(tmp_path):
    model, x = small_model()
    onnx.save(model, tmp_path / "m.onnx")
    sess = welder.InferenceSession(tmp_path / "m.onnx")
    assert sess.get_inputs()[0].type == "tensor(float)"
    with pytest.raises(ModelError, match="missing input 'x'"):
        sess.run(None, {})
    with pytest.raises(ModelError, match="dtype float64"):
        sess.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(ModelError, match=r"shape \[3, 2\]"):
        sess.run(None, {"x": x.T.copy()})
    with pytest.raises(ModelError, match="unknown output"):
        sess.run(["nope"], {"x": x})
    with pytest.raises(ModelError, match="unknown input"):
        sess.run(None, {"x": x, "z": x})


def test_shape_inference_disagreement_is_reported(monkeypatch):
    """A lowering whose shape differs from ONNX shape inference is reported, naming the node;
    a dtype difference is an error."""
    from welder.frontend import registry
    from welder.frontend.onnx import ShapeInferenceWarning

    model, _x = small_model()
    bad = registry.Lowering("Relu", lambda ctx: ctx.compute((7,), lambda i: ctx.input(0)[0, 0]))
    monkeypatch.setitem(registry.LOWERINGS, "Relu", bad)
    with pytest.warns(ShapeInferenceWarning, match=r"Relu node 'relu'.*\[7\].*\[2, 3\]"):
        import_onnx(model)
    wrong_dtype = registry.Lowering("Relu", lambda ctx: ctx.compute((2, 3), lambda i, j: Const(1, "int64")))
    monkeypatch.setitem(registry.LOWERINGS, "Relu", wrong_dtype)
    with pytest.raises(ModelError, match="dtype int64 here but float32"):
        import_onnx(model)


def test_malformed_einsum_fails_fast_instead_of_hanging_shape_inference(tmp_path):
    """ONNX shape inference loops forever on this equation; the lowering must reject it
    before shape inference ever sees the model."""
    import subprocess
    import sys

    x = np.zeros((2, 3), np.float32)
    model = make_model(
        [helper.make_node("Einsum", ["x"], ["y"], equation="i..j->ij")], {"x": x}, ["y"], opset=17
    )
    path = tmp_path / "bad_einsum.onnx"
    onnx.save(model, path)
    code = (
        "import sys, welder\n"
        "try:\n    welder.import_onnx(sys.argv[1])\n"
        "except welder.ModelError as e:\n    print('rejected:', e)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120
    )
    assert "rejected:" in result.stdout and "Einsum" in result.stdout, result.stdout + result.stderr
