"""Small whole-model ONNX graphs shaped like what real exporters emit.

Each builder returns ``(model, feeds)``.  The graphs reproduce the node patterns that
``torch.onnx.export`` writes for HF transformers, torchvision and timm modules, quirks
included: shape arithmetic through ``Shape -> Gather -> Unsqueeze -> Concat`` chains,
``expand`` through ``ConstantOfShape/Equal/Where``, ``flatten(2)`` as a sliced shape,
``torch.roll`` as ``Slice + Concat`` with ``INT64_MAX`` ends, ``unbind`` as
``Split + Squeeze``, BatchNormalization left unfolded, Gelu written out with ``Erf``.
Weights come from a seeded generator, scaled so activations stay of order one, and the
models are small enough for the reference interpreter to run each in well under a second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

Feeds = dict[str, np.ndarray]
INT64_MAX = np.iinfo(np.int64).max
FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


class ModelBuilder:
    """Collects nodes, weights and inputs, naming them the way the torch exporter does
    (``/encoder/layer.0/attention/MatMul`` with outputs ``..._output_0``)."""

    def __init__(self, seed: int = 0, opset: int = 17) -> None:
        self.rng = np.random.default_rng(seed)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.domains: dict[str, int] = {}
        self._names: set[str] = set()

    # -- primitives ---------------------------------------------------------------------

    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        """A graph input; string dimensions are symbolic."""
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def init(self, name: str, value: np.ndarray) -> str:
        """A named initializer (a parameter or a registered buffer)."""
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(
        self, scope: str, shape: Sequence[int], fan_in: int | None = None, kind: str = "weight"
    ) -> str:
        """Normal weights with std ``1/sqrt(fan_in)`` (the first dim is the fan-in unless
        given), stored as ``scope.kind`` like a state-dict entry."""
        std = 1.0 / math.sqrt(fan_in if fan_in is not None else shape[0])
        value = (self.rng.standard_normal(shape) * std).astype(np.float32)
        return self.init(_param_name(scope, kind), value)

    def const(self, value: object, dtype: type = np.int64, scope: str = "") -> str:
        """A ``Constant`` node, as the exporter emits for literals in the Python code."""
        arr = np.asarray(value, dtype=dtype)
        name = self._fresh(f"{scope}/Constant")
        self.nodes.append(
            helper.make_node(
                "Constant", [], [f"{name}_output_0"], name=name, value=numpy_helper.from_array(arr)
            )
        )
        return f"{name}_output_0"

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        scope: str = "",
        outputs: int = 1,
        out_name: str | None = None,
        domain: str = "",
        **attrs: object,
    ) -> str:
        """Append one node and return its (first) output name."""
        return self.op_multi(op_type, inputs, scope, outputs, out_name, domain, **attrs)[0]

    def op_multi(
        self,
        op_type: str,
        inputs: Sequence[str],
        scope: str = "",
        outputs: int = 1,
        out_name: str | None = None,
        domain: str = "",
        **attrs: object,
    ) -> list[str]:
        """Append one node and return all its output names."""
        name = self._fresh(f"{scope}/{op_type}")
        outs = [f"{name}_output_{k}" for k in range(outputs)]
        if out_name is not None:
            outs[0] = out_name
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outs, name=name, domain=domain or None, **attrs)
        )
        return outs

    def _fresh(self, stem: str) -> str:
        name, k = stem, 0
        while name in self._names:
            k += 1
            name = f"{stem}_{k}"
        self._names.add(name)
        return name

    def finish(self, outputs: Sequence[str], name: str) -> onnx.ModelProto:
        """The model, with output types filled in by ONNX shape inference."""
        graph = helper.make_graph(
            self.nodes,
            name,
            self.inputs,
            [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
            self.initializers,
        )
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, v) for d, v in self.domains.items()]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="welder-tests")
        model.ir_version = helper.find_min_ir_version_for(opsets, ignore_unknown=True)
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph.output
        for out, vi in zip(model.graph.output, inferred):
            out.type.CopyFrom(vi.type)
        return model

    # -- exporter idioms ------------------------------------------------------------------

    def unsqueeze(self, x: str, axes: Sequence[int], scope: str = "") -> str:
        """``Unsqueeze`` with the axes as an input (opset 13 on)."""
        return self.op("Unsqueeze", [x, self.const(list(axes), scope=scope)], scope)

    def squeeze(self, x: str, axes: Sequence[int], scope: str = "") -> str:
        """``Squeeze`` with the axes as an input (opset 13 on)."""
        return self.op("Squeeze", [x, self.const(list(axes), scope=scope)], scope)

    def reduce_mean(self, x: str, axes: Sequence[int], scope: str = "") -> str:
        """``ReduceMean`` keeping dims; the axes became an input in opset 18."""
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const(list(axes), scope=scope)], scope, keepdims=1)
        return self.op("ReduceMean", [x], scope, axes=list(axes), keepdims=1)

    def slice(
        self, x: str, starts: Sequence[int], ends: Sequence[int] | str, axes: Sequence[int], scope: str = ""
    ) -> str:
        """``Slice``; ``ends`` may be a tensor name (a size read off a shape)."""
        ends_name = ends if isinstance(ends, str) else self.const(list(ends), scope=scope)
        return self.op(
            "Slice",
            [x, self.const(list(starts), scope=scope), ends_name, self.const(list(axes), scope=scope)],
            scope,
        )

    def dim(self, x: str, k: int, scope: str = "") -> str:
        """``x.size(k)`` as a 1-element int64 tensor: ``Shape -> Gather -> Unsqueeze``."""
        size = self.op("Gather", [self.op("Shape", [x], scope), self.const(k, scope=scope)], scope, axis=0)
        return self.unsqueeze(size, [0], scope)

    def dynamic_shape(self, parts: Sequence[str | int], scope: str = "") -> str:
        """A shape tensor concatenated from traced sizes (names) and literals (ints)."""
        pieces = [p if isinstance(p, str) else self.const([p], scope=scope) for p in parts]
        return self.op("Concat", pieces, scope, axis=0)

    def reshape(self, x: str, parts: Sequence[str | int], scope: str = "") -> str:
        """``x.view(...)``: a constant shape when every part is a literal, else a
        ``Concat`` of traced sizes."""
        if all(isinstance(p, int) for p in parts):
            return self.op("Reshape", [x, self.const(list(parts), scope=scope)], scope)
        return self.op("Reshape", [x, self.dynamic_shape(parts, scope)], scope)

    def expand(self, x: str, parts: Sequence[str | int], scope: str = "") -> str:
        """``x.expand(*sizes)`` with ``-1`` meaning "keep": the exporter turns -1 into 1
        through ``ConstantOfShape``, ``Equal`` and ``Where`` before the ``Expand``."""
        size = self.op("Reshape", [self.dynamic_shape(parts, scope), self.const([-1], scope=scope)], scope)
        ones = self.op(
            "ConstantOfShape",
            [self.op("Shape", [size], scope)],
            scope,
            value=numpy_helper.from_array(np.ones(1, np.int64)),
        )
        neg_ones = self.op("Mul", [ones, self.const(-1, scope=scope)], scope)
        keep = self.op("Equal", [size, neg_ones], scope)
        size = self.op("Where", [keep, ones, size], scope)
        return self.op("Expand", [x, size], scope)

    def flatten_from(self, x: str, start: int, scope: str = "") -> str:
        """``x.flatten(start)`` for ``start > 1``: reshape to ``shape[:start] + [-1]``."""
        head = self.slice(self.op("Shape", [x], scope), [0], [start], [0], scope)
        return self.op("Reshape", [x, self.dynamic_shape([head, -1], scope)], scope)

    def linear(self, x: str, d_in: int, d_out: int, scope: str, out_name: str | None = None) -> str:
        """``nn.Linear`` on a rank > 2 input: ``MatMul`` with the transposed weight, then
        ``Add`` of the bias."""
        w = self.weight(scope, (d_in, d_out))
        y = self.op("MatMul", [x, w], scope)
        return self.op("Add", [self.bias(scope, d_out), y], scope, out_name=out_name)

    def gemm(self, x: str, d_in: int, d_out: int, scope: str, out_name: str | None = None) -> str:
        """``nn.Linear`` on a 2-D input: ``Gemm`` with ``transB=1``."""
        w = self.weight(scope, (d_out, d_in), fan_in=d_in)
        inputs = [x, w, self.bias(scope, d_out)]
        return self.op("Gemm", inputs, scope, out_name=out_name, alpha=1.0, beta=1.0, transB=1)

    def bias(self, scope: str, n: int) -> str:
        """A small random bias vector ``scope.bias``."""
        return self.init(_param_name(scope, "bias"), (self.rng.standard_normal(n) * 0.1).astype(np.float32))

    def conv(
        self,
        x: str,
        c_in: int,
        c_out: int,
        kernel: Sequence[int],
        scope: str,
        stride: int = 1,
        groups: int = 1,
        bias: bool = True,
        pads: Sequence[int] | None = None,
    ) -> str:
        """``nn.Conv1d/2d`` with explicit pads (``same`` padding for odd kernels by default)."""
        fan_in = c_in // groups * int(np.prod(kernel))
        w = self.weight(scope, (c_out, c_in // groups, *kernel), fan_in=fan_in)
        inputs = [x, w] + ([self.bias(scope, c_out)] if bias else [])
        if pads is None:
            pads = [k // 2 for k in kernel] * 2
        return self.op(
            "Conv",
            inputs,
            scope,
            dilations=[1] * len(kernel),
            group=groups,
            kernel_shape=list(kernel),
            pads=list(pads),
            strides=[stride] * len(kernel),
        )

    def batch_norm(self, x: str, channels: int, scope: str) -> str:
        """Inference-mode ``BatchNorm`` with non-trivial running statistics."""
        rng = self.rng
        params = {
            "weight": rng.uniform(0.5, 1.5, channels),
            "bias": rng.standard_normal(channels) * 0.1,
            "running_mean": rng.standard_normal(channels) * 0.1,
            "running_var": rng.uniform(0.5, 1.5, channels),
        }
        names = [self.init(_param_name(scope, k), v.astype(np.float32)) for k, v in params.items()]
        return self.op("BatchNormalization", [x, *names], scope, epsilon=1e-5, momentum=0.9)

    def layer_norm(self, x: str, width: int, scope: str, eps: float = 1e-5, decomposed: bool = False) -> str:
        """``nn.LayerNorm`` over the last axis: the opset-17 op, or the
        ``ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add`` chain of older exports."""
        gamma = self.init(_param_name(scope, "weight"), self.rng.uniform(0.5, 1.5, width).astype(np.float32))
        beta = self.bias(scope, width)
        if not decomposed:
            return self.op("LayerNormalization", [x, gamma, beta], scope, axis=-1, epsilon=eps)
        centred = self.op("Sub", [x, self.reduce_mean(x, [-1], scope)], scope)
        square = self.op("Pow", [centred, self.const(2.0, np.float32, scope=scope)], scope)
        var = self.reduce_mean(square, [-1], scope)
        std = self.op("Sqrt", [self.op("Add", [var, self.const(eps, np.float32, scope=scope)], scope)], scope)
        normed = self.op("Div", [centred, std], scope)
        return self.op("Add", [self.op("Mul", [normed, gamma], scope), beta], scope)

    def gelu(self, x: str, scope: str, use_op: bool = False) -> str:
        """GELU: the opset-20 ``Gelu`` op, or ``x * 0.5 * (1 + erf(x / sqrt 2))``."""
        if use_op:
            return self.op("Gelu", [x], scope)
        scaled = self.op("Div", [x, self.const(1.4142135381698608, np.float32, scope=scope)], scope)
        erf1 = self.op(
            "Add", [self.op("Erf", [scaled], scope), self.const(1.0, np.float32, scope=scope)], scope
        )
        return self.op(
            "Mul", [self.op("Mul", [x, erf1], scope), self.const(0.5, np.float32, scope=scope)], scope
        )

    def roll(self, x: str, shifts: Sequence[int], axes: Sequence[int], scope: str) -> str:
        """``torch.roll``: per axis, ``Concat(x[-shift:], x[:-shift])`` through ``Slice``
        with ``INT64_MAX`` as the open end."""
        for shift, axis in zip(shifts, axes):
            tail = self.slice(x, [-shift], [INT64_MAX], [axis], scope)
            head = self.slice(x, [0], [-shift], [axis], scope)
            x = self.op("Concat", [tail, head], scope, axis=axis)
        return x


def _param_name(scope: str, kind: str) -> str:
    """``/encoder/layer.0/query`` + ``bias`` -> ``encoder.layer.0.query.bias``."""
    stem = scope.strip("/").replace("/", ".")
    return f"{stem}.{kind}" if kind else stem


def _normal(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# -- BERT -----------------------------------------------------------------------------------


def bert_encoder_layer(
    batch: int = 1,
    seq: int = 16,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    *,
    layers: int = 1,
    embeddings: bool = False,
    symbolic: bool = False,
    decomposed_layernorm: bool = False,
    sdpa: bool = False,
    vocab: int = 100,
    max_positions: int = 64,
    seed: int = 0,
) -> tuple[onnx.ModelProto, Feeds]:
    """HF ``BertLayer`` stack as exported by torch.

    Inputs: ``hidden_states`` [batch, seq, hidden] and an int64 ``attention_mask``; with
    ``embeddings`` the model starts from int64 ``input_ids`` and ``token_type_ids``
    (word + token-type + position embeddings, positions sliced out of a buffer) and also
    has the pooler (``tanh(dense(h[:, 0]))``).  ``symbolic`` declares the inputs with
    ``batch``/``seq`` dimensions; ``decomposed_layernorm`` writes LayerNorm out as the
    opset-14 exporters did (and the model then uses opset 14).  ``sdpa`` is the recent HF
    export through ``scaled_dot_product_attention``: the mask expanded to
    ``[batch, 1, seq, seq]`` and filled with the float32 minimum by ``Where``, the scale
    computed from the head size read off the shape, ``sqrt(scale)`` applied to q and k.
    """
    b = ModelBuilder(seed, opset=14 if decomposed_layernorm else 17)
    dims: list[int | str] = ["batch", "seq"] if symbolic else [batch, seq]
    rng = np.random.default_rng(seed + 1)
    feeds: Feeds = {}
    if embeddings:
        ids = b.input("input_ids", INT64, dims)
        types = b.input("token_type_ids", INT64, dims)
        feeds["input_ids"] = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
        feeds["token_type_ids"] = (np.arange(seq) >= seq // 2).astype(np.int64)[None].repeat(batch, 0)
        x = _bert_embeddings(b, ids, types, hidden, vocab, max_positions, decomposed_layernorm)
    else:
        x = b.input("hidden_states", FLOAT, [*dims, hidden])
        feeds["hidden_states"] = _normal(rng, (batch, seq, hidden))
    mask = b.input("attention_mask", INT64, dims)
    # Every sequence but the longest ends in padding.
    lengths = [seq - (k + 1) * seq // (2 * batch + 2) for k in range(batch)]
    feeds["attention_mask"] = (np.arange(seq)[None] < np.array(lengths)[:, None]).astype(np.int64)

    ext = _bert_additive_mask(b, mask, sdpa)
    for k in range(layers):
        x = _bert_layer(b, x, ext, f"/encoder/layer.{k}", hidden, heads, ffn, decomposed_layernorm, sdpa)
    x = b.op("Identity", [x], "/encoder", out_name="last_hidden_state")
    outputs = [x]
    if embeddings:
        first = b.op("Gather", [x, b.const(0, scope="/pooler")], "/pooler", axis=1)
        pooled = b.gemm(first, hidden, hidden, "/pooler/dense")
        outputs = [x, b.op("Tanh", [pooled], "/pooler/activation", out_name="pooler_output")]
    return b.finish(outputs, "bert"), feeds


def _bert_additive_mask(b: ModelBuilder, mask: str, sdpa: bool) -> str:
    """``(1 - mask[:, None, None, :]) * -10000``, or for SDPA the mask expanded to
    ``[B, 1, S, S]`` with ``masked_fill(inverted.bool(), finfo.min)``."""
    scope = "/bert"
    ext = b.unsqueeze(b.unsqueeze(mask, [1], scope), [2], scope)
    if sdpa:
        seq = b.dim(mask, 1, scope)
        ext = b.expand(ext, [b.dim(mask, 0, scope), 1, seq, seq], scope)
    ext = b.op("Cast", [ext], scope, to=FLOAT)
    ext = b.op("Sub", [b.const(1.0, np.float32, scope=scope), ext], scope)
    if not sdpa:
        return b.op("Mul", [ext, b.const(-10000.0, np.float32, scope=scope)], scope)
    flag = b.op("Cast", [ext], scope, to=TensorProto.BOOL)
    lowest = b.const(np.finfo(np.float32).min, np.float32, scope=scope)
    return b.op("Where", [flag, lowest, ext], scope)


def _bert_embeddings(
    b: ModelBuilder, ids: str, types: str, hidden: int, vocab: int, max_positions: int, decomposed: bool
) -> str:
    scope = "/embeddings"
    positions = b.init("embeddings.position_ids", np.arange(max_positions, dtype=np.int64)[None])
    seq_len = b.dim(ids, 1, scope)
    position_ids = b.slice(positions, [0], seq_len, [1], scope)
    words = b.op("Gather", [b.weight(f"{scope}/word_embeddings", (vocab, hidden), fan_in=1), ids], scope)
    tokens = b.op("Gather", [b.weight(f"{scope}/token_type_embeddings", (2, hidden), fan_in=1), types], scope)
    pos_table = b.weight(f"{scope}/position_embeddings", (max_positions, hidden), fan_in=1)
    x = b.op("Add", [words, tokens], scope)
    x = b.op("Add", [x, b.op("Gather", [pos_table, position_ids], scope)], scope)
    return b.layer_norm(x, hidden, f"{scope}/LayerNorm", eps=1e-12, decomposed=decomposed)


def _bert_layer(
    b: ModelBuilder,
    x: str,
    mask: str,
    scope: str,
    hidden: int,
    heads: int,
    ffn: int,
    decomposed: bool,
    sdpa: bool,
) -> str:
    """One ``BertLayer``: self-attention, dense + residual + LayerNorm, erf-Gelu FFN."""
    d = hidden // heads
    att = f"{scope}/attention/self"

    def heads_first(t: str, perm: list[int]) -> str:
        # transpose_for_scores: view(B, S, heads, d) with B, S read off the shape.
        split = b.reshape(t, [b.dim(t, 0, att), b.dim(t, 1, att), heads, d], att)
        return b.op("Transpose", [split], att, perm=perm)

    q = heads_first(b.linear(x, hidden, hidden, f"{att}/query"), [0, 2, 1, 3])
    v = heads_first(b.linear(x, hidden, hidden, f"{att}/value"), [0, 2, 1, 3])
    if sdpa:
        k = heads_first(b.linear(x, hidden, hidden, f"{att}/key"), [0, 2, 1, 3])
        ctx = _sdpa(b, q, k, v, mask, att)
    else:
        # key.transpose(-1, -2) merged into the head transpose by the exporter's peephole pass.
        k_t = heads_first(b.linear(x, hidden, hidden, f"{att}/key"), [0, 2, 3, 1])
        scores = b.op("MatMul", [q, k_t], att)
        scores = b.op("Div", [scores, b.const(math.sqrt(d), np.float32, scope=att)], att)
        probs = b.op("Softmax", [b.op("Add", [scores, mask], att)], att, axis=-1)
        ctx = b.op("MatMul", [probs, v], att)
    ctx = b.op("Transpose", [ctx], att, perm=[0, 2, 1, 3])
    ctx = b.reshape(ctx, [b.dim(ctx, 0, att), b.dim(ctx, 1, att), hidden], att)

    out = f"{scope}/attention/output"
    y = b.op("Add", [b.linear(ctx, hidden, hidden, f"{out}/dense"), x], out)
    x = b.layer_norm(y, hidden, f"{out}/LayerNorm", eps=1e-12, decomposed=decomposed)

    h = b.gelu(b.linear(x, hidden, ffn, f"{scope}/intermediate/dense"), f"{scope}/intermediate")
    y = b.op("Add", [b.linear(h, ffn, hidden, f"{scope}/output/dense"), x], f"{scope}/output")
    return b.layer_norm(y, hidden, f"{scope}/output/LayerNorm", eps=1e-12, decomposed=decomposed)


def _sdpa(b: ModelBuilder, q: str, k: str, v: str, mask: str, scope: str) -> str:
    """``F.scaled_dot_product_attention`` as torch exports it: the scale ``1/sqrt(d)``
    from the shape of q, its square root multiplied into q and into k transposed."""
    size = b.op("Cast", [b.slice(b.op("Shape", [q], scope), [-1], [INT64_MAX], [0], scope)], scope, to=FLOAT)
    scale = b.op("Div", [b.const(1.0, np.float32, scope=scope), b.op("Sqrt", [size], scope)], scope)
    root = b.op("Sqrt", [b.op("Cast", [scale], scope, to=FLOAT)], scope)
    k_t = b.op("Transpose", [k], scope, perm=[0, 1, 3, 2])
    scores = b.op("MatMul", [b.op("Mul", [q, root], scope), b.op("Mul", [k_t, root], scope)], scope)
    probs = b.op("Softmax", [b.op("Add", [scores, mask], scope)], scope, axis=-1)
    return b.op("MatMul", [probs, v], scope)


# -- GPT-2 ------------------------------------------------------------------------------------


def gpt2_model(
    layers: int = 2, hidden: int = 256, seq: int = 64, heads: int = 4, vocab: int = 2048, seed: int = 0
) -> tuple[onnx.ModelProto, Feeds]:
    """A GPT-2 as HF exports it, small: token and position embeddings (Gather), pre-norm
    blocks whose ``c_attn`` projects to 3x the width and Splits into q, k, v, a causal mask
    applied with Where from a constant lower-triangular buffer, the tanh GELU written out,
    a final LayerNorm and the tied LM head (MatMul with the transposed embedding)."""
    b = ModelBuilder(seed)
    ids = b.input("input_ids", INT64, [1, seq])
    feeds = {"input_ids": np.random.default_rng(seed + 1).integers(0, vocab, (1, seq)).astype(np.int64)}
    wte = b.weight("transformer/wte", (vocab, hidden), fan_in=hidden)
    wpe = b.weight("transformer/wpe", (seq, hidden), fan_in=hidden)
    positions = b.init("position_ids", np.arange(seq, dtype=np.int64)[None])
    x = b.op(
        "Add",
        [
            b.op("Gather", [wte, ids], "/transformer/wte"),
            b.op("Gather", [wpe, positions], "/transformer/wpe"),
        ],
        "/transformer",
    )
    causal = b.init("attn_bias", np.tril(np.ones((1, 1, seq, seq), dtype=bool)))
    d = hidden // heads
    for k in range(layers):
        scope = f"/transformer/h.{k}"
        h = b.layer_norm(x, hidden, f"{scope}/ln_1")
        qkv = b.linear(h, hidden, 3 * hidden, f"{scope}/attn/c_attn")
        q, key, v = b.op_multi("Split", [qkv, b.const([hidden] * 3, scope=scope)], scope, outputs=3, axis=2)

        def split_heads(t: str, perm: list[int], scope: str = scope) -> str:
            return b.op("Transpose", [b.reshape(t, [1, seq, heads, d], scope)], scope, perm=perm)

        scores = b.op("MatMul", [split_heads(q, [0, 2, 1, 3]), split_heads(key, [0, 2, 3, 1])], scope)
        scores = b.op("Div", [scores, b.const(math.sqrt(d), np.float32, scope=scope)], scope)
        lowest = b.const(np.finfo(np.float32).min, np.float32, scope=scope)
        scores = b.op("Where", [causal, scores, lowest], scope)
        probs = b.op("Softmax", [scores], scope, axis=-1)
        ctx = b.op("MatMul", [probs, split_heads(v, [0, 2, 1, 3])], scope)
        ctx = b.reshape(b.op("Transpose", [ctx], scope, perm=[0, 2, 1, 3]), [1, seq, hidden], scope)
        x = b.op("Add", [x, b.linear(ctx, hidden, hidden, f"{scope}/attn/c_proj")], scope)
        h = b.linear(b.layer_norm(x, hidden, f"{scope}/ln_2"), hidden, 4 * hidden, f"{scope}/mlp/c_fc")
        cube = b.op("Mul", [b.op("Mul", [h, h], scope), h], scope)
        inner = b.op(
            "Mul",
            [
                b.op(
                    "Add", [h, b.op("Mul", [cube, b.const(0.044715, np.float32, scope=scope)], scope)], scope
                ),
                b.const(math.sqrt(2 / math.pi), np.float32, scope=scope),
            ],
            scope,
        )
        gelu = b.op(
            "Mul",
            [
                b.op("Mul", [h, b.const(0.5, np.float32, scope=scope)], scope),
                b.op("Add", [b.op("Tanh", [inner], scope), b.const(1.0, np.float32, scope=scope)], scope),
            ],
            scope,
        )
        x = b.op("Add", [x, b.linear(gelu, 4 * hidden, hidden, f"{scope}/mlp/c_proj")], scope)
    x = b.layer_norm(x, hidden, "/transformer/ln_f")
    logits = b.op(
        "MatMul", [x, b.op("Transpose", [wte], "/lm_head", perm=[1, 0])], "/lm_head", out_name="logits"
    )
    return b.finish([logits], "gpt2"), feeds


# -- MobileNetV2 ------------------------------------------------------------------------------


def mobilenetv2_block(
    batch: int = 1, size: int = 32, width: int = 8, classes: int = 10, seed: int = 0
) -> tuple[onnx.ModelProto, Feeds]:
    """torchvision MobileNetV2 in miniature, BatchNormalization kept as separate nodes (as
    exporters that do not fold it, or torch with ``training=PRESERVE``, leave it):
    stem ``Conv3x3/2 + BN + ReLU6``; inverted residuals (expand ``1x1 + BN + ReLU6``,
    depthwise ``3x3`` stride 1 or 2 ``+ BN + ReLU6``, project ``1x1 + BN``, ``Add`` when
    the shape is kept); head ``1x1 + BN + ReLU6``, ``GlobalAveragePool``, ``Flatten``,
    ``Gemm``."""
    b = ModelBuilder(seed)
    x = b.input("input", FLOAT, [batch, 3, size, size])
    feeds = {"input": _normal(np.random.default_rng(seed + 1), (batch, 3, size, size))}

    def conv_bn(
        t: str,
        c_in: int,
        c_out: int,
        k: int,
        scope: str,
        stride: int = 1,
        groups: int = 1,
        relu6: bool = True,
    ) -> str:
        """``Conv2dNormActivation``: bias-free conv, BatchNorm, optional ReLU6 (``Clip``)."""
        t = b.conv(t, c_in, c_out, (k, k), f"{scope}/0", stride=stride, groups=groups, bias=False)
        t = b.batch_norm(t, c_out, f"{scope}/1")
        if relu6:
            relu = f"{scope}/2"
            bounds = [b.const(v, np.float32, scope=relu) for v in (0.0, 6.0)]
            t = b.op("Clip", [t, *bounds], relu)
        return t

    x = conv_bn(x, 3, width, 3, "/features/features.0", stride=2)
    c = width
    # (expansion, output channels, stride) per block, as torchvision's settings table.
    for k, (t, c_out, stride) in enumerate([(4, width, 1), (4, 2 * width, 2), (4, 2 * width, 1)], start=1):
        scope = f"/features/features.{k}/conv"
        hidden = c * t
        y = conv_bn(x, c, hidden, 1, f"{scope}/conv.0")
        y = conv_bn(y, hidden, hidden, 3, f"{scope}/conv.1", stride=stride, groups=hidden)
        y = conv_bn(y, hidden, c_out, 1, f"{scope}/conv.2", relu6=False)
        x = b.op("Add", [x, y], f"/features/features.{k}") if stride == 1 and c == c_out else y
        c = c_out
    x = conv_bn(x, c, 4 * width, 1, "/features/features.4")
    x = b.op("GlobalAveragePool", [x], "")
    x = b.op("Flatten", [x], "", axis=1)
    logits = b.gemm(x, 4 * width, classes, "/classifier/classifier.1", out_name="logits")
    return b.finish([logits], "mobilenetv2"), feeds


# -- ViT ----------------------------------------------------------------------------------------


def vit_block(
    batch: int = 1,
    image: int = 32,
    patch: int = 8,
    dim: int = 32,
    heads: int = 4,
    mlp: int = 64,
    classes: int = 10,
    *,
    depth: int = 1,
    einsum: bool = False,
    gelu_op: bool = False,
    seed: int = 0,
) -> tuple[onnx.ModelProto, Feeds]:
    """timm ``VisionTransformer`` in miniature: patch embedding ``Conv`` with
    ``stride=patch``, ``flatten(2).transpose(1, 2)``, class token expanded and
    concatenated, position embedding, pre-norm blocks (``qkv`` linear, ``unbind`` as
    ``Split + Squeeze``, attention by ``MatMul`` or ``Einsum``, MLP with Gelu), final norm
    and a head on the class token.  ``gelu_op`` uses the opset-20 ``Gelu`` op."""
    b = ModelBuilder(seed, opset=20 if gelu_op else 17)
    x = b.input("pixel_values", FLOAT, [batch, 3, image, image])
    feeds = {"pixel_values": _normal(np.random.default_rng(seed + 1), (batch, 3, image, image))}
    tokens = (image // patch) ** 2 + 1

    x = b.conv(x, 3, dim, (patch, patch), "/patch_embed/proj", stride=patch, pads=[0, 0, 0, 0])
    x = b.op("Transpose", [b.flatten_from(x, 2, "/patch_embed")], "/patch_embed", perm=[0, 2, 1])
    cls = b.weight("/cls_token", (1, 1, dim), fan_in=1, kind="")
    cls = b.expand(cls, [b.dim(x, 0, ""), -1, -1], "")
    x = b.op("Concat", [cls, x], "", axis=1)
    x = b.op("Add", [x, b.weight("/pos_embed", (1, tokens, dim), fan_in=1, kind="")], "")

    for k in range(depth):
        scope = f"/blocks/blocks.{k}"
        y = b.layer_norm(x, dim, f"{scope}/norm1", eps=1e-6)
        x = b.op("Add", [x, _vit_attention(b, y, dim, heads, f"{scope}/attn", einsum)], scope)
        y = b.layer_norm(x, dim, f"{scope}/norm2", eps=1e-6)
        y = b.gelu(b.linear(y, dim, mlp, f"{scope}/mlp/fc1"), f"{scope}/mlp/act", use_op=gelu_op)
        x = b.op("Add", [x, b.linear(y, mlp, dim, f"{scope}/mlp/fc2")], scope)
    x = b.layer_norm(x, dim, "/norm", eps=1e-6)
    first = b.op("Gather", [x, b.const(0)], "", axis=1)
    logits = b.gemm(first, dim, classes, "/head", out_name="logits")
    return b.finish([logits], "vit"), feeds


def _vit_attention(b: ModelBuilder, x: str, dim: int, heads: int, scope: str, einsum: bool) -> str:
    d = dim // heads
    qkv = b.linear(x, dim, 3 * dim, f"{scope}/qkv")
    qkv = b.reshape(qkv, [b.dim(x, 0, scope), b.dim(x, 1, scope), 3, heads, d], scope)
    qkv = b.op("Transpose", [qkv], scope, perm=[2, 0, 3, 1, 4])
    parts = b.op_multi("Split", [qkv, b.const([1, 1, 1], scope=scope)], scope, outputs=3, axis=0)
    q, k, v = (b.squeeze(p, [0], scope) for p in parts)
    q = b.op("Mul", [q, b.const(d**-0.5, np.float32, scope=scope)], scope)
    if einsum:
        probs = b.op("Softmax", [b.op("Einsum", [q, k], scope, equation="bhid,bhjd->bhij")], scope, axis=-1)
        y = b.op("Einsum", [probs, v], scope, equation="bhij,bhjd->bhid")
    else:
        scores = b.op("MatMul", [q, b.op("Transpose", [k], scope, perm=[0, 1, 3, 2])], scope)
        y = b.op("MatMul", [b.op("Softmax", [scores], scope, axis=-1), v], scope)
    y = b.op("Transpose", [y], scope, perm=[0, 2, 1, 3])
    y = b.reshape(y, [b.dim(x, 0, scope), b.dim(x, 1, scope), dim], scope)
    return b.linear(y, dim, dim, f"{scope}/proj")


# -- Swin -----------------------------------------------------------------------------------------


def swin_window_attention_block(
    batch: int = 1,
    size: int = 8,
    dim: int = 32,
    heads: int = 2,
    window: int = 4,
    shift: int = 2,
    mlp: int = 64,
    seed: int = 0,
) -> tuple[onnx.ModelProto, Feeds]:
    """torchvision ``SwinTransformerBlock`` on a ``[batch, size, size, dim]`` input:
    ``norm1``, the (no-op) ``Pad`` to a multiple of the window, cyclic shift by
    ``torch.roll``, window partition, window attention with the relative position bias
    gathered from its table by a constant index, the shifted-window mask added per window,
    window reverse, reverse roll, crop, residual, ``norm2`` and the MLP."""
    b = ModelBuilder(seed)
    x = b.input("x", FLOAT, [batch, size, size, dim])
    feeds = {"x": _normal(np.random.default_rng(seed + 1), (batch, size, size, dim))}
    n = window * window
    n_windows = (size // window) ** 2
    d = dim // heads
    scope = "/attn"

    y = b.layer_norm(x, dim, "/norm1")
    y = b.op("Pad", [y, b.const([0] * 8, scope=scope)], scope, mode="constant")
    if shift:
        y = b.roll(y, [-shift, -shift], [1, 2], scope)
    w = size // window
    y = b.reshape(y, [b.dim(x, 0, scope), w, window, w, window, dim], scope)
    y = b.op("Transpose", [y], scope, perm=[0, 1, 3, 2, 4, 5])
    y = b.reshape(y, [-1, n, dim], scope)

    qkv = b.linear(y, dim, 3 * dim, f"{scope}/qkv")
    qkv = b.reshape(qkv, [b.dim(y, 0, scope), b.dim(y, 1, scope), 3, heads, d], scope)
    qkv = b.op("Transpose", [qkv], scope, perm=[2, 0, 3, 1, 4])
    q, k, v = (b.op("Gather", [qkv, b.const(j, scope=scope)], scope, axis=0) for j in range(3))
    q = b.op("Mul", [q, b.const(d**-0.5, np.float32, scope=scope)], scope)
    attn = b.op("MatMul", [q, b.op("Transpose", [k], scope, perm=[0, 1, 3, 2])], scope)

    table = b.weight(f"{scope}/relative_position_bias_table", ((2 * window - 1) ** 2, heads), fan_in=1)
    index = b.init("attn.relative_position_index", relative_position_index(window).reshape(-1))
    bias = b.reshape(b.op("Gather", [table, index], scope, axis=0), [n, n, -1], scope)
    bias = b.unsqueeze(b.op("Transpose", [bias], scope, perm=[2, 0, 1]), [0], scope)
    attn = b.op("Add", [attn, bias], scope)
    if shift:
        mask = b.init("attn_mask", shifted_window_mask(size, window, shift))
        per_image = b.op("Div", [b.dim(attn, 0, scope), b.const([n_windows], scope=scope)], scope)
        attn = b.reshape(attn, [per_image, n_windows, heads, n, n], scope)
        mask = b.unsqueeze(b.unsqueeze(mask, [1], scope), [0], scope)
        attn = b.reshape(b.op("Add", [attn, mask], scope), [-1, heads, n, n], scope)
    probs = b.op("Softmax", [attn], scope, axis=-1)
    y = b.op("Transpose", [b.op("MatMul", [probs, v], scope)], scope, perm=[0, 2, 1, 3])
    y = b.reshape(y, [b.dim(y, 0, scope), b.dim(y, 1, scope), dim], scope)
    y = b.linear(y, dim, dim, f"{scope}/proj")

    y = b.reshape(y, [b.dim(x, 0, scope), w, w, window, window, dim], scope)
    y = b.op("Transpose", [y], scope, perm=[0, 1, 3, 2, 4, 5])
    y = b.reshape(y, [b.dim(x, 0, scope), size, size, dim], scope)
    if shift:
        y = b.roll(y, [shift, shift], [1, 2], scope)
    y = b.slice(y, [0, 0], [size, size], [1, 2], scope)
    x = b.op("Add", [x, y], "")

    h = b.layer_norm(x, dim, "/norm2")
    h = b.gelu(b.linear(h, dim, mlp, "/mlp/mlp.0"), "/mlp/mlp.1")
    out = b.op("Add", [x, b.linear(h, mlp, dim, "/mlp/mlp.3")], "", out_name="output")
    return b.finish([out], "swin"), feeds


def relative_position_index(window: int) -> np.ndarray:
    """Swin's ``[window², window²]`` index into the ``(2·window - 1)²``-row bias table."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + (window - 1)
    return (rel[..., 0] * (2 * window - 1) + rel[..., 1]).astype(np.int64)


def shifted_window_mask(size: int, window: int, shift: int) -> np.ndarray:
    """Swin's ``[windows, window², window²]`` mask: -100 between tokens that the cyclic
    shift brought from different regions of the image into one window."""
    regions = np.zeros((size, size), np.float32)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for k, (hs, ws) in enumerate((h, w) for h in bounds for w in bounds):
        regions[hs, ws] = k
    w = size // window
    windows = regions.reshape(w, window, w, window).transpose(0, 2, 1, 3).reshape(-1, window * window)
    diff = windows[:, None, :] - windows[:, :, None]
    return np.where(diff != 0, -100.0, 0.0).astype(np.float32)


# -- Conformer ----------------------------------------------------------------------------------


def conformer_conv_module(
    batch: int = 1,
    frames: int = 32,
    channels: int = 16,
    kernel: int = 15,
    *,
    glu_by_slice: bool = False,
    causal: bool = False,
    seed: int = 0,
) -> tuple[onnx.ModelProto, Feeds]:
    """torchaudio's Conformer convolution module with its residual on ``[batch, frames,
    channels]``: ``LayerNorm``, ``transpose(1, 2)``, pointwise ``Conv1d`` to 2C, GLU
    (``Split`` as torch exports ``F.glu``, or two ``Slice``s as hand-written chunking),
    depthwise ``Conv1d`` (odd ``kernel``, same padding) directly followed by
    ``BatchNorm1d``, Swish as ``x * Sigmoid(x)``, pointwise ``Conv1d``, transpose back.
    ``causal`` is the streaming variant (WeNet): a left ``Pad`` of ``kernel - 1`` frames
    and an unpadded depthwise conv."""
    b = ModelBuilder(seed)
    x = b.input("features", FLOAT, [batch, frames, channels])
    feeds = {"features": _normal(np.random.default_rng(seed + 1), (batch, frames, channels))}
    scope = "/conv_module"
    c = channels

    y = b.layer_norm(x, c, f"{scope}/layer_norm")
    y = b.op("Transpose", [y], scope, perm=[0, 2, 1])
    y = b.conv(y, c, 2 * c, (1,), f"{scope}/sequential/sequential.0")
    if glu_by_slice:
        first = b.slice(y, [0], [c], [1], f"{scope}/sequential/sequential.1")
        second = b.slice(y, [c], [INT64_MAX], [1], f"{scope}/sequential/sequential.1")
    else:
        first, second = b.op_multi("Split", [y], f"{scope}/sequential/sequential.1", outputs=2, axis=1)
    y = b.op("Mul", [first, b.op("Sigmoid", [second], scope)], f"{scope}/sequential/sequential.1")
    depthwise = f"{scope}/sequential/sequential.2"
    if causal:
        y = b.op(
            "Pad", [y, b.const([0, 0, kernel - 1, 0, 0, 0], scope=depthwise)], depthwise, mode="constant"
        )
    y = b.conv(y, c, c, (kernel,), depthwise, groups=c, pads=[0, 0] if causal else None)
    y = b.batch_norm(y, c, f"{scope}/sequential/sequential.3")
    y = b.op("Mul", [y, b.op("Sigmoid", [y], f"{scope}/sequential/sequential.4")], scope)
    y = b.conv(y, c, c, (1,), f"{scope}/sequential/sequential.5")
    y = b.op("Transpose", [y], scope, perm=[0, 2, 1])
    out = b.op("Add", [x, y], "", out_name="output")
    return b.finish([out], "conformer_conv"), feeds


# -- a model welder cannot import --------------------------------------------------------------


def unsupported_ops_model() -> tuple[onnx.ModelProto, Feeds]:
    """A model onnxruntime runs but welder cannot import: three operator types it does
    not lower, two of them used twice: ``NonZero`` (data-dependent shape),
    ``com.microsoft.BiasGelu`` (a contrib op) and ``Unique``."""
    b = ModelBuilder(0)
    b.domains["com.microsoft"] = 1
    x = b.input("x", FLOAT, [4, 8])
    h = b.op("Relu", [x], "/pre")
    nz = b.op("NonZero", [h], "/first")
    nz2 = b.op("NonZero", [x], "/second")
    bias = b.bias("/gelu", 8)
    g = b.op("BiasGelu", [h, bias], "/first", domain="com.microsoft")
    g2 = b.op("BiasGelu", [g, bias], "/second", domain="com.microsoft")
    u = b.op("Unique", [h], "/first", sorted=1)
    model = b.finish([nz, nz2, g2, u], "unsupported")
    # ONNX shape inference does not know the contrib op; declare its output as exporters do.
    model.graph.output[2].type.CopyFrom(helper.make_tensor_type_proto(FLOAT, [4, 8]))
    return model, {"x": _normal(np.random.default_rng(1), (4, 8))}
