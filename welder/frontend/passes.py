"""Rewrites on the ONNX graph before lowering.

Only rewrites that need the ONNX view of the graph live here; everything that can be done
on Computes (constant folding, dead-node elimination, dropping Identity and Dropout, which
simply alias their input) happens during or after lowering.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def simplify(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fold_batchnorm_into_conv(out)
    return out


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values by tensor name."""
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return values


def fold_batchnorm_into_conv(model: onnx.ModelProto) -> int:
    """Fold inference-mode BatchNormalization into the Conv that feeds it, in place.

    ``BN(conv(x, W) + b) = conv(x, W * s) + (b - mean) * s + beta`` with
    ``s = gamma / sqrt(var + eps)`` per output channel.  Applies only when the Conv's
    weights and the BN statistics are constants and nothing else reads the Conv output.
    Returns the number of folds.
    """
    g = model.graph
    consts = constant_values(g)
    producers = {o: n for n in g.node for o in n.output}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    graph_outputs = {o.name for o in g.output}
    taken = {v for n in g.node for v in (*n.input, *n.output)} | set(consts)

    removed: list[onnx.NodeProto] = []
    folds = 0
    for bn in list(g.node):
        if bn.op_type != "BatchNormalization" or any(o for o in bn.output[1:]):
            continue
        if _attr(bn, "training_mode", 0):
            continue
        conv = producers.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or uses.get(bn.input[0]) != 1:
            continue
        if bn.input[0] in graph_outputs or conv.input[1] not in consts:
            continue
        if any(i not in consts for i in bn.input[1:5]):
            continue
        if len(conv.input) > 2 and conv.input[2] and conv.input[2] not in consts:
            continue
        w = consts[conv.input[1]]
        gamma, beta, mean, var = (consts[i].astype(np.float64) for i in bn.input[1:5])
        eps = _attr(bn, "epsilon", 1e-5)
        s = gamma / np.sqrt(var + eps)
        bias = consts[conv.input[2]].astype(np.float64) if len(conv.input) > 2 and conv.input[2] else 0.0
        new_w = (w.astype(np.float64) * s.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        new_b = ((bias - mean) * s + beta).astype(w.dtype)
        w_name = _unique(f"{conv.input[1]}:bn_folded", taken)
        b_name = _unique(f"{bn.output[0]}:bn_bias", taken)
        g.initializer.extend([numpy_helper.from_array(new_w, w_name), numpy_helper.from_array(new_b, b_name)])
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        conv.output[0] = bn.output[0]
        removed.append(bn)
        folds += 1
    for bn in removed:
        g.node.remove(bn)
    return folds


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


def _unique(stem: str, taken: set[str]) -> str:
    name, k = stem, 1
    while name in taken:
        k += 1
        name = f"{stem}{k}"
    taken.add(name)
    return name
