"""Softmax and the normalisations against onnxruntime, their stage structure, and the
BatchNormalization-into-Conv folding."""

from __future__ import annotations

import networkx as nx
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_util import assert_matches_ort, make_model, single_op

from welder.check import error_metric, onnxruntime_outputs
from welder.errors import ModelError, UnsupportedError
from welder.frontend.onnx import import_onnx
from welder.frontend.passes import simplify
from welder.frontend.registry import LOWERINGS

FP16 = 2e-2


def randn(shape, dtype=np.float32, seed=0, scale=1.0, offset=0.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale + offset).astype(dtype)


def reductions(graph):
    return [n.compute for n in graph if n.compute.is_reduction]


# -- Softmax / LogSoftmax --------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax(op, axis, opset):
    x = randn((2, 3, 5), scale=3)
    assert_matches_ort(single_op(op, {"x": x}, {"axis": axis}, opset=opset), {"x": x})


# -- LayerNormalization ------------------------------------------------------------------------------


def layer_norm_model(x, axis, scale_shape, with_bias, opset=17, epsilon=None, outputs=3, param_dtype=None):
    rng = np.random.default_rng(1)
    dtype = param_dtype or x.dtype
    inits = {"scale": rng.standard_normal(scale_shape).astype(dtype)}
    if with_bias:
        inits["bias"] = rng.standard_normal(scale_shape).astype(dtype)
    attrs = {"axis": axis}
    if epsilon is not None:
        attrs["epsilon"] = epsilon
    return single_op("LayerNormalization", {"x": x}, attrs, inits, n_outputs=outputs, opset=opset)


@pytest.mark.parametrize("opset", [17, 21])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(
    "shape,axis",
    [((6, 16), -1), ((6, 16), 0), ((2, 5, 8), -1), ((2, 5, 8), 1), ((2, 3, 4, 6), -2), ((2, 3, 4, 6), 1)],
    ids=str,
)
def test_layer_norm(shape, axis, with_bias, opset):
    x = randn(shape, seed=len(shape), scale=2, offset=0.5)
    norm_shape = shape[axis:]
    model = layer_norm_model(x, axis, norm_shape, with_bias, opset)
    assert_matches_ort(model, {"x": x})


@pytest.mark.parametrize("epsilon", [1e-5, 1e-2, 0.5])
def test_layer_norm_epsilon_and_broadcast_scale(epsilon):
    """A Scale of shape [1, D] broadcasts over the normalised [S, D]."""
    x = randn((2, 4, 10), seed=3)
    model = layer_norm_model(x, -2, (1, 10), True, epsilon=epsilon)
    assert_matches_ort(model, {"x": x})


@pytest.mark.parametrize("outputs", [1, 2, 3])
def test_layer_norm_optional_outputs(outputs):
    x = randn((3, 7, 9), seed=4)
    assert_matches_ort(layer_norm_model(x, -1, (9,), True, outputs=outputs), {"x": x})


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_float16_stashes_float32(axis):
    """Y is float16; Mean and InvStdDev are float32 (stash_type 1, the default)."""
    x = randn((2, 6, 40), np.float16, seed=5, scale=3, offset=2)
    model = layer_norm_model(x, axis, x.shape[axis:], True)
    assert_matches_ort(model, {"x": x}, threshold=FP16)


def test_layer_norm_float16_large_sum_of_squares():
    """Squares of float16 values this large overflow float16; the statistics must not."""
    x = randn((2, 512), np.float16, seed=6, scale=300)
    assert_matches_ort(layer_norm_model(x, -1, (512,), True), {"x": x}, threshold=FP16)


def test_layer_norm_is_stages_with_one_reduction_each():
    x = randn((4, 6, 32), seed=7)
    graph = import_onnx(layer_norm_model(x, 1, (6, 32), True))
    reds = reductions(graph)
    assert len(reds) == 2, [str(c) for c in reds]
    for c in reds:
        assert c.reduce_op == "sum"
        assert sorted(a.extent for a in c.reduce_axes) == [6, 32]
        # keepdims statistics: the reduction itself has the [4, 1, 1] shape of Mean.
        assert c.shape == (4, 1, 1)
    assert len(graph) > len(reds)
    # Two-pass variance: the second reduction sums deviations from the first one's mean.
    total, squares = reds
    assert total.inputs == ("x",)
    assert "x" not in squares.inputs
    assert nx.has_path(graph.nx, total.name, squares.name)


def test_layer_norm_bad_scale_rejected():
    x = randn((2, 5, 8))
    with pytest.raises(ModelError, match=r"layernormalization_0.*Scale"):
        import_onnx(layer_norm_model(x, -1, (3, 8), False, outputs=1))


def test_layer_norm_integer_stash_type_rejected():
    x = randn((2, 8))
    model = single_op(
        "LayerNormalization",
        {"x": x},
        {"stash_type": onnx.TensorProto.INT32},
        {"scale": np.ones(8, np.float32)},
    )
    with pytest.raises(UnsupportedError, match=r"layernormalization_0.*int32"):
        import_onnx(model)


# -- BatchNormalization -------------------------------------------------------------------------------


def bn_params(channels, dtype=np.float32, stats_dtype=None, seed=0):
    rng = np.random.default_rng(seed)
    stats_dtype = stats_dtype or dtype
    return {
        "scale": rng.standard_normal(channels).astype(dtype),
        "bias": rng.standard_normal(channels).astype(dtype),
        "mean": rng.standard_normal(channels).astype(stats_dtype),
        "var": rng.uniform(0.2, 2.0, channels).astype(stats_dtype),
    }


@pytest.mark.parametrize("opset", [11, 14, 15])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 7), (2, 3, 5, 6), (1, 4, 2, 3, 4)], ids=str)
def test_batch_norm(shape, opset):
    x = randn(shape, seed=len(shape), scale=2)
    for epsilon in (1e-5, 0.1):
        model = single_op(
            "BatchNormalization", {"x": x}, {"epsilon": epsilon}, bn_params(shape[1]), opset=opset
        )
        assert_matches_ort(model, {"x": x})


def test_batch_norm_parameters_as_graph_inputs():
    x = randn((2, 4, 3, 3))
    feeds = {"x": x, **bn_params(4, seed=2)}
    assert_matches_ort(single_op("BatchNormalization", feeds, opset=15), feeds)


@pytest.mark.parametrize("stats_dtype", [np.float16, np.float32])
def test_batch_norm_float16(stats_dtype):
    x = randn((2, 5, 6, 7), np.float16, seed=3, scale=2)
    model = single_op("BatchNormalization", {"x": x}, {}, bn_params(5, np.float16, stats_dtype), opset=15)
    assert_matches_ort(model, {"x": x}, threshold=FP16)


def test_batch_norm_training_rejected():
    x = randn((2, 3, 4))
    model = single_op("BatchNormalization", {"x": x}, {"training_mode": 1}, bn_params(3), opset=15)
    with pytest.raises(UnsupportedError, match=r"batchnormalization_0.*training_mode"):
        import_onnx(model)


def test_batch_norm_training_outputs_rejected():
    x = randn((2, 3, 4))
    model = single_op("BatchNormalization", {"x": x}, {}, bn_params(3), n_outputs=3, opset=11)
    with pytest.raises(UnsupportedError, match=r"batchnormalization_0.*training"):
        import_onnx(model)


def test_batch_norm_wrong_parameter_shape_rejected():
    x = randn((2, 3, 4))
    params = bn_params(3)
    params["var"] = np.ones(4, np.float32)
    with pytest.raises(ModelError, match=r"batchnormalization_0.*var.*\[3\]"):
        import_onnx(single_op("BatchNormalization", {"x": x}, {}, params, opset=15))


# -- BatchNormalization folded into Conv ---------------------------------------------------------------

needs_conv = pytest.mark.skipif("Conv" not in LOWERINGS, reason="no Conv lowering registered")


def conv_bn_model(with_conv_bias=True, extra_conv_use=False, opset=15):
    rng = np.random.default_rng(5)
    x = randn((2, 3, 8, 8), seed=6)
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), **bn_params(4, seed=7)}
    conv_inputs = ["x", "w"]
    if with_conv_bias:
        inits["b"] = rng.standard_normal(4).astype(np.float32)
        conv_inputs.append("b")
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"], name="bn"),
    ]
    outputs = ["y"]
    if extra_conv_use:
        nodes.append(helper.make_node("Relu", ["c"], ["r"], name="relu"))
        outputs.append("r")
    return make_model(nodes, {"x": x}, outputs, inits, opset=opset), {"x": x}


@pytest.mark.parametrize("with_conv_bias", [True, False])
def test_batchnorm_folding_preserves_the_model(with_conv_bias):
    """The rewritten ONNX model computes the same as the original (both in onnxruntime)."""
    model, feeds = conv_bn_model(with_conv_bias)
    folded = simplify(model)
    assert [n.op_type for n in folded.graph.node] == ["Conv"]
    before = onnxruntime_outputs(model, feeds, ["y"])["y"]
    after = onnxruntime_outputs(folded, feeds, ["y"])["y"]
    assert error_metric(after, before) <= 1e-4


def test_batchnorm_not_folded_when_conv_output_is_shared():
    model, _ = conv_bn_model(extra_conv_use=True)
    assert "BatchNormalization" in [n.op_type for n in simplify(model).graph.node]


@needs_conv
@pytest.mark.parametrize("with_conv_bias", [True, False])
def test_conv_batchnorm_imports_folded(with_conv_bias):
    model, feeds = conv_bn_model(with_conv_bias)
    graph = import_onnx(model)
    assert "BatchNormalization" not in {n.op_type for n in graph}
    assert_matches_ort(model, feeds)


@needs_conv
def test_conv_batchnorm_unfolded_when_conv_output_is_shared():
    model, feeds = conv_bn_model(extra_conv_use=True)
    assert "BatchNormalization" in {n.op_type for n in import_onnx(model)}
    assert_matches_ort(model, feeds)


# -- InstanceNormalization --------------------------------------------------------------------------------


def channel_params(channels, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "scale": rng.standard_normal(channels).astype(dtype),
        "bias": rng.standard_normal(channels).astype(dtype),
    }


@pytest.mark.parametrize("epsilon", [1e-5, 0.3])
@pytest.mark.parametrize("shape", [(2, 3, 11), (2, 4, 5, 6), (1, 2, 3, 4, 5)], ids=str)
def test_instance_norm(shape, epsilon):
    x = randn(shape, seed=len(shape), scale=2, offset=1)
    model = single_op("InstanceNormalization", {"x": x}, {"epsilon": epsilon}, channel_params(shape[1]))
    assert_matches_ort(model, {"x": x})


def test_instance_norm_float16():
    x = randn((2, 3, 9, 10), np.float16, seed=8, scale=4, offset=3)
    model = single_op("InstanceNormalization", {"x": x}, {}, channel_params(3, np.float16))
    assert_matches_ort(model, {"x": x}, threshold=FP16)


def test_float16_statistics_do_not_overflow():
    """Sums of squares of these float16 values exceed float16's range; the outputs do not."""
    x = randn((2, 4, 8, 8), np.float16, seed=11, scale=300)
    model = single_op("InstanceNormalization", {"x": x}, {}, channel_params(4, np.float16))
    assert_matches_ort(model, {"x": x}, threshold=FP16)
    assert_matches_ort(group_norm_model(x, 2, 21), {"x": x}, threshold=FP16)


def test_instance_norm_structure():
    x = randn((2, 3, 4, 5))
    graph = import_onnx(single_op("InstanceNormalization", {"x": x}, {}, channel_params(3)))
    reds = reductions(graph)
    assert len(reds) == 2
    assert all(c.shape == (2, 3) and [a.extent for a in c.reduce_axes] == [4, 5] for c in reds)


def test_instance_norm_rank2_rejected():
    x = randn((2, 3))
    with pytest.raises(ModelError, match=r"instancenormalization_0.*rank"):
        import_onnx(single_op("InstanceNormalization", {"x": x}, {}, channel_params(3)))


# -- GroupNormalization ---------------------------------------------------------------------------------


def group_norm_model(x, groups, opset, epsilon=None, dtype=None):
    params = x.shape[1] if opset >= 21 else groups
    attrs = {"num_groups": groups}
    if epsilon is not None:
        attrs["epsilon"] = epsilon
    inits = channel_params(params, dtype or x.dtype, seed=groups)
    return single_op("GroupNormalization", {"x": x}, attrs, inits, opset=opset)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("groups", [1, 2, 3, 6])
@pytest.mark.parametrize("shape", [(2, 6, 10), (2, 6, 4, 5)], ids=str)
def test_group_norm(shape, groups, opset):
    x = randn(shape, seed=groups, scale=2, offset=-1)
    assert_matches_ort(group_norm_model(x, groups, opset), {"x": x})


@pytest.mark.parametrize("opset", [18, 21])
def test_group_norm_epsilon_and_float16(opset):
    x = randn((2, 8, 5, 5), seed=9)
    assert_matches_ort(group_norm_model(x, 4, opset, epsilon=0.2), {"x": x})
    x16 = randn((2, 8, 6, 6), np.float16, seed=10, scale=3, offset=2)
    assert_matches_ort(group_norm_model(x16, 2, opset), {"x": x16}, threshold=FP16)


def test_group_norm_structure():
    x = randn((2, 6, 4, 5))
    graph = import_onnx(group_norm_model(x, 3, 21))
    reds = reductions(graph)
    assert len(reds) == 2
    assert all(c.shape == (2, 3) and [a.extent for a in c.reduce_axes] == [2, 4, 5] for c in reds)


def test_group_norm_bad_groups_rejected():
    x = randn((2, 6, 4))
    with pytest.raises(ModelError, match=r"groupnormalization_0.*num_groups=4"):
        import_onnx(group_norm_model(x, 4, 21))


def test_group_norm_opset18_needs_per_group_scale():
    x = randn((2, 6, 4))
    model = single_op("GroupNormalization", {"x": x}, {"num_groups": 3}, channel_params(6), opset=18)
    with pytest.raises(ModelError, match=r"groupnormalization_0.*scale.*\[3\]"):
        import_onnx(model)
