"""Rewrites on the ONNX graph before lowering.

Only rewrites that need the ONNX view of the graph live here; everything that can be done
on Computes (constant folding, dead-node elimination, dropping Identity and Dropout, which
simply alias their input) happens during or after lowering.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def simplify(model: onnx.ModelProto, merge_limit: int | None = None) -> onnx.ModelProto:
    """The model with BatchNorms folded and sibling products merged (``merge_limit``: see
    :func:`merge_sibling_products`)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fold_batchnorm_into_conv(out)
    merge_sibling_products(out, merge_limit)
    return out


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers, Constant-node values and Identities of either, by tensor name (the torch
    exporter writes a weight equal to another as an Identity of it)."""
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        elif n.op_type == "Identity" and n.input[0] in values:
            values[n.output[0]] = values[n.input[0]]
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


def merge_sibling_products(model: onnx.ModelProto, limit: int | None = None) -> int:
    """Merge MatMuls that multiply one tensor by constant matrices into one product, in place.

    ``x @ W1, x @ W2, ...`` become ``x @ [W1 W2 ...]`` and a Split of its last axis.  Models
    written layer by layer project attention's queries, keys and values this way: three
    products of one shape, each a kernel too short to fill the GPU, where the merged one is a
    single wide product (BERT at batch 1: three 128 x 768 x 768 products of 24 blocks each,
    against one 128 x 768 x 2304).  Where each product's only consumer is an Add of a constant vector
    of its width (a Linear's bias), the biases are concatenated and added before the Split, so
    they stay the product's epilogue.  The Split's parts are exact slices of the merged product,
    so the model computes what it did.  Returns the number of products merged away.

    ``limit`` keeps apart products of which one has more output elements than it, or of
    unknown size: once each product fills the GPU by itself, merging no longer shortens the
    kernels and its wider output stays less of its time in L2 (``welder tune`` passes one
    wave of 128 x 128 tiles; docs/tensor_cores.md, "One product for sibling projections").
    """
    g = model.graph
    consts = constant_values(g)
    nodes = list(g.node)  # one set of wrappers, so that id() names a node throughout
    uses: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            uses.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    taken = {v for n in nodes for v in (*n.input, *n.output)} | set(consts) | graph_outputs

    siblings: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        if n.op_type == "MatMul" and n.input[0] not in consts and _matrix(consts.get(n.input[1])):
            siblings.setdefault(n.input[0], []).append(n)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # first removed node -> what takes its place
    removed: set[int] = set()
    dropped: set[str] = set()  # weights and biases the merged ones replace
    merged = 0
    shapes: dict[str, tuple[int, ...]] | None = None  # inferred once, where a limit needs them
    for x, products in siblings.items():
        if len(products) < 2:
            continue
        if limit is not None:
            shapes = static_shapes(model) if shapes is None else shapes
            if not _small(shapes.get(x), products, consts, limit):
                continue
        biases = [_bias_of(p, consts, uses, graph_outputs) for p in products]
        with_bias = all(b is not None for b in biases)
        weights = np.concatenate([consts[p.input[1]] for p in products], axis=1)
        w_name = _unique(f"{products[0].input[1]}:merged", taken)
        y_name = _unique(f"{x}:merged_product", taken)
        g.initializer.append(numpy_helper.from_array(weights, w_name))
        new = [
            helper.make_node(
                "MatMul", [x, w_name], [y_name], name=_unique(f"{products[0].name}:merged", taken)
            )
        ]
        if with_bias:
            bias = np.concatenate([consts[_bias_input(b, p)] for b, p in zip(biases, products)])
            b_name = _unique(f"{_bias_input(biases[0], products[0])}:merged", taken)
            summed = _unique(f"{x}:merged_sum", taken)
            g.initializer.append(numpy_helper.from_array(bias, b_name))
            new.append(
                helper.make_node(
                    "Add", [y_name, b_name], [summed], name=_unique(f"{biases[0].name}:merged", taken)
                )
            )
            y_name = summed
        finals = [b.output[0] for b in biases] if with_bias else [p.output[0] for p in products]
        widths = [consts[p.input[1]].shape[1] for p in products]
        new.append(_split_last_axis(model, y_name, finals, widths, taken))
        gone = [*products, *(biases if with_bias else [])]
        removed |= {id(n) for n in gone}
        dropped |= {p.input[1] for p in products}
        dropped |= {_bias_input(b, p) for b, p in zip(biases, products)} if with_bias else set()
        replaced[id(products[0])] = new  # the first product: every reader of x comes after it
        merged += len(products) - 1
    if not replaced:
        return 0
    order = []
    for n in nodes:
        order.extend(replaced.get(id(n), []))
        if id(n) not in removed:
            order.append(n)
    del g.node[:]
    g.node.extend(order)
    # The merged weights and biases no node reads any more (the import refuses subgraphs, so
    # the top-level nodes are every reader).  One an old exporter also lists as a graph input
    # stays: without its initializer it would become an input a caller must feed.
    read = {i for n in g.node for i in n.input} | graph_outputs | {i.name for i in g.input}
    for k in reversed([k for k, t in enumerate(g.initializer) if t.name in dropped and t.name not in read]):
        del g.initializer[k]
    return merged


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape ONNX shape inference fixes, graph inputs included."""
    from welder.frontend.onnx import inferred_types  # the importer's module imports this one

    return {name: shape for name, (shape, _) in inferred_types(model).items() if shape is not None}


def _small(
    shape: tuple[int, ...] | None, products: list[onnx.NodeProto], consts: dict[str, np.ndarray], limit: int
) -> bool:
    """Whether every product's output has at most ``limit`` elements (a row count shape
    inference cannot tell is not small)."""
    if shape is None:
        return False
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return all(rows * consts[p.input[1]].shape[1] <= limit for p in products)


def _matrix(value: np.ndarray | None) -> bool:
    return value is not None and value.ndim == 2 and value.dtype.kind == "f"


def _bias_of(
    product: onnx.NodeProto,
    consts: dict[str, np.ndarray],
    uses: dict[str, list[onnx.NodeProto]],
    graph_outputs: set[str],
) -> onnx.NodeProto | None:
    """The Add of a constant vector as wide as ``product``'s output that is its only reader."""
    out = product.output[0]
    readers = uses.get(out, [])
    if out in graph_outputs or len(readers) != 1 or readers[0].op_type != "Add":
        return None
    add = readers[0]
    bias = consts.get(_bias_input(add, product))
    width = consts[product.input[1]].shape[1]
    ok = bias is not None and bias.shape == (width,) and bias.dtype == consts[product.input[1]].dtype
    return add if ok else None


def _bias_input(add: onnx.NodeProto, product: onnx.NodeProto) -> str:
    return add.input[1] if add.input[0] == product.output[0] else add.input[0]


def _split_last_axis(
    model: onnx.ModelProto, source: str, outputs: list[str], widths: list[int], taken: set[str]
) -> onnx.NodeProto:
    """A Split of ``source``'s last axis into ``widths``: the sizes are an attribute before
    opset 13 and an input from it on."""
    from welder.frontend.onnx import model_opset  # the importer's module imports this one

    name = _unique(f"{source}:split", taken)
    if model_opset(model) < 13:
        return helper.make_node("Split", [source], outputs, name=name, axis=-1, split=widths)
    sizes = _unique(f"{source}:split_sizes", taken)
    model.graph.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), sizes))
    return helper.make_node("Split", [source, sizes], outputs, name=name, axis=-1)


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
