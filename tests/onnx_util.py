"""Building small ONNX models in tests and checking them against onnxruntime (or, where
it cannot serve, onnx's reference evaluator)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from welder.check import error_metric, onnxruntime_outputs, threshold_for
from welder.frontend.onnx import import_onnx

NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    """A model whose inputs take the shapes and dtypes of the example arrays; output
    types are left to shape inference."""
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(k, NP_TO_ONNX[v.dtype], v.shape) for k, v in inputs.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def contrast_nodes(x: str, y: str) -> list[onnx.NodeProto]:
    """BSRN's contrast: each channel's mean plus its standard deviation over the pixels of
    ``x`` (N, C, H, W), as ``y`` (N, C, 1, 1)."""
    return [
        helper.make_node("ReduceMean", [x], ["mean"], axes=[2, 3], keepdims=1),
        helper.make_node("Sub", [x, "mean"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["squares"]),
        helper.make_node("ReduceMean", ["squares"], ["variance"], axes=[2, 3], keepdims=1),
        helper.make_node("Sqrt", ["variance"], ["deviation"]),
        helper.make_node("Add", ["deviation", "mean"], [y]),
    ]


def run_both(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]):
    """(welder interpreter outputs, onnxruntime outputs), keyed by output name."""
    graph = import_onnx(model)
    ours = graph.run(feeds)
    ref = onnxruntime_outputs(model, feeds, [o.name for o in model.graph.output])
    return ours, ref


def assert_matches_ort(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], threshold: float | None = None
) -> None:
    """Import ``model``, interpret it and compare every output with onnxruntime."""
    ours, ref = run_both(model, feeds)
    assert_close(ours, ref, threshold)


def assert_matches_onnx_reference(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Compare with onnx's reference evaluator: the spec's own semantics, for the cases where
    onnxruntime's CPU provider has no kernel or departs from the spec."""
    ours = import_onnx(model).run(feeds)
    names = [o.name for o in model.graph.output]
    assert_close(ours, dict(zip(names, ReferenceEvaluator(model).run(None, dict(feeds)))))


def assert_close(
    ours: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], threshold: float | None = None
) -> None:
    """Every reference output is matched in shape, dtype and value (the design's metric)."""
    for name, expected in ref.items():
        got = ours[name]
        assert got.shape == expected.shape, f"{name}: shape {got.shape} != {expected.shape}"
        assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
        dtype = "bool" if expected.dtype == np.bool_ else expected.dtype.name
        limit = threshold_for(dtype) if threshold is None else threshold
        err = error_metric(got, expected)
        assert err <= limit, f"{name}: error {err:.3e} > {limit:.1e}"


def single_op(
    op: str,
    inputs: Mapping[str, np.ndarray],
    attrs: Mapping | None = None,
    initializers: Mapping[str, np.ndarray] | None = None,
    n_outputs: int = 1,
    opset: int = 17,
    input_order: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """A model of one node; ``input_order`` lists the node inputs ('' for omitted ones)
    when they mix graph inputs and initializers."""
    names = list(input_order) if input_order is not None else [*inputs, *(initializers or {})]
    outs = [f"out{k}" for k in range(n_outputs)]
    node = helper.make_node(op, names, outs, name=f"{op.lower()}_0", **(attrs or {}))
    return make_model([node], inputs, outs, initializers, opset)


def to_half(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float32 tensor in float16: initializers, Constant values, graph
    inputs and outputs, value infos and the targets of Casts (what exporters produce when a
    module is converted with ``.half()``)."""
    half = onnx.ModelProto()
    half.CopyFrom(model)
    graph = half.graph

    def convert(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name)
            )

    for tensor in graph.initializer:
        convert(tensor)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                convert(attr.t)
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = TensorProto.FLOAT16
    return half


def to_bfloat16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float32 and float16 tensor in bfloat16, as :func:`to_half` does
    it for float16 (what exporters produce from a module converted with
    ``.to(torch.bfloat16)``)."""
    narrow = onnx.ModelProto()
    narrow.CopyFrom(model)
    graph = narrow.graph
    wide = (TensorProto.FLOAT, TensorProto.FLOAT16)

    def convert(tensor: onnx.TensorProto) -> None:
        if tensor.data_type in wide:
            values = numpy_helper.to_array(tensor).astype(np.float32).astype(ml_dtypes.bfloat16)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))

    for tensor in graph.initializer:
        convert(tensor)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                convert(attr.t)
            if node.op_type == "Cast" and attr.name == "to" and attr.i in wide:
                attr.i = TensorProto.BFLOAT16
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.tensor_type.elem_type in wide:
            info.type.tensor_type.elem_type = TensorProto.BFLOAT16
    return narrow
