"""Random small ONNX graphs for differential testing against onnxruntime.

``random_graph(seed)`` builds a valid ONNX graph (``onnx.checker`` with full shape
inference) of a few operators drawn from elementwise and broadcast chains, reductions,
MatMul/Gemm, Conv with random strides/pads/dilations/groups, Softmax, LayerNorm and the
data-movement operators (Reshape, Transpose, Slice, Concat, Pad, Gather, Expand, ...),
on random shapes full of 1s and odd sizes, in float32 or float16.  Each operator usually
takes the value made just before it, so chains form that the scheduler fuses: elementwise
after reductions, reductions after matrix products, movement between them; now and then
it takes an earlier value, so a value has several readers.

Why a seeded generator rather than hypothesis strategies: the emulator compiles each
model with g++ (about two seconds), which would dominate a run of one model per example
and make shrinking -- hundreds of recompilations -- impractical.  Here many graphs are
merged into one model of disjoint components (``batch_model``), so one compilation serves
a whole batch, and every graph is named by its seed, which is all it takes to rebuild it.
A failing seed becomes a fixed regression case in ``tests/test_fuzz.py``.

Numerics are kept where a comparison means something: weights are scaled by one over
the square root of their fan-in so values stay near unit size, and operators with a
restricted domain (Sqrt, Log, Div, Pow) are applied to values made positive first.
Discontinuous operators (comparisons, ArgMax) only read graph inputs, since an ulp of
difference upstream may legitimately flip them.  Inputs are finite: onnxruntime's NaN
handling differs between its kernels (MaxPool and ArgMax pass over a NaN that Max and
ReduceMax propagate).

Run it on its own to explore::

    python tests/fuzz_graphs.py --cases 400 --seed random      # fresh graphs, both back ends
    python tests/fuzz_graphs.py --seed 7 --index 3 --save g.onnx   # rebuild one graph
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# Element limit of any value: keeps the emulated kernels fast.  A "large" graph (one in
# four) also draws extents past the usual tile sizes, where remainders and partial tiles
# show.
MAX_ELEMENTS = 3072
MAX_ELEMENTS_LARGE = 12288
DIMS = (1, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16)
DIMS_LARGE = (17, 31, 33, 63, 64, 65, 100, 129)
ONNX_TYPE = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    integer: bool = False  # an index (ArgMax): only ever a graph output

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class FuzzGraph:
    """One random graph: its nodes, inputs with their feeds, initializers and outputs."""

    label: str
    dtype: type
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)

    def model(self) -> onnx.ModelProto:
        return batch_model([self])

    def describe(self) -> str:
        dt = "fp16" if self.dtype == np.float16 else "fp32"
        ins = ", ".join(f"{k}{list(v.shape)}" for k, v in self.feeds.items())
        return f"graph {self.label} ({dt}; {ins}): {' -> '.join(self.ops)}"


def batch_model(graphs: Sequence[FuzzGraph]) -> onnx.ModelProto:
    """One model holding every graph as a disjoint component (names are already unique)."""
    nodes = [n for g in graphs for n in g.nodes]
    inputs = [
        helper.make_tensor_value_info(k, ONNX_TYPE[g.dtype], v.shape)
        for g in graphs
        for k, v in g.feeds.items()
    ]
    inits = [numpy_helper.from_array(v, k) for g in graphs for k, v in g.initializers.items()]
    graph = helper.make_graph(nodes, "fuzz", inputs, [], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    known = {v.name: v for v in inferred.graph.value_info}
    model.graph.output.extend(known[o] for g in graphs for o in g.outputs)
    onnx.checker.check_model(model, full_check=True)
    return model


class _GraphBuilder:
    def __init__(self, rng: np.random.Generator, label: str, prefix: str, dtype: type, large: bool) -> None:
        self.rng = rng
        self.large = large
        self.max_elements = MAX_ELEMENTS_LARGE if large else MAX_ELEMENTS
        self.coarse = bool(rng.random() < 0.15)
        self.prefix = prefix
        self.g = FuzzGraph(label, dtype)
        self.values: list[Value] = []
        self.integers: set[str] = set()
        self._count = 0

    # -- naming, inputs, constants ---------------------------------------------------------------

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}{self._count}"

    def new_input(self, shape: Sequence[int]) -> Value:
        name = self.fresh("in")
        if self.coarse:  # few distinct values: ties for max and argmax, exact zeros
            self.g.feeds[name] = self.rng.integers(-3, 4, tuple(shape)).astype(self.g.dtype)
        else:
            self.g.feeds[name] = self.rng.standard_normal(tuple(shape)).astype(self.g.dtype)
        v = Value(name, tuple(shape))
        self.values.append(v)
        return v

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.g.initializers[name] = np.asarray(array)
        return name

    def weight(self, shape: Sequence[int], fan_in: int) -> str:
        w = self.rng.standard_normal(tuple(shape)) / np.sqrt(max(fan_in, 1))
        return self.const(w.astype(self.g.dtype), "w")

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(values, dtype=np.int64), "i")

    # -- nodes -------------------------------------------------------------------------------------

    def node(self, op: str, inputs: Sequence[str], **attrs: object) -> str:
        out = self.fresh(op.lower())
        self.g.nodes.append(helper.make_node(op, list(inputs), [out], name=f"{out}_node", **attrs))
        return out

    def finish(self, name: str, label: str) -> Value | None:
        """Shape-infer the new value ``name``; None (after undoing the op) when it is empty
        or too large."""
        shape = self.infer(name)
        if shape is None or 0 in shape or int(np.prod(shape, dtype=np.int64)) > self.max_elements:
            return None
        self.g.ops.append(label)
        v = Value(name, shape, integer=name in self.integers)
        self.values.append(v)
        return v

    def infer(self, name: str) -> tuple[int, ...] | None:
        g = self.g
        graph = helper.make_graph(
            g.nodes,
            "partial",
            [helper.make_tensor_value_info(k, ONNX_TYPE[g.dtype], v.shape) for k, v in g.feeds.items()],
            [],
            [numpy_helper.from_array(v, k) for k, v in g.initializers.items()],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        for vi in inferred.graph.value_info:
            if vi.name == name:
                dims = vi.type.tensor_type.shape.dim
                if any(not d.HasField("dim_value") for d in dims):
                    return None
                return tuple(d.dim_value for d in dims)
        return None

    def floats(self) -> list[Value]:
        return [v for v in self.values if not v.integer]

    def checkpoint(self) -> tuple[int, int, int]:
        return len(self.g.nodes), len(self.g.feeds), len(self.g.initializers)

    def rollback(self, mark: tuple[int, int, int]) -> None:
        nodes, feeds, inits = mark
        del self.g.nodes[nodes:]
        for d, n in ((self.g.feeds, feeds), (self.g.initializers, inits)):
            for k in list(d)[n:]:
                del d[k]
        names = set(self.g.feeds) | {o for n in self.g.nodes for o in n.output}
        self.values = [v for v in self.values if v.name in names]

    # -- random choices ----------------------------------------------------------------------------

    def choice(self, options: Sequence):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def dim(self) -> int:
        if self.large and self.chance(0.3):
            return int(self.choice(DIMS_LARGE))
        return int(self.choice(DIMS))

    def shape(self, rank: int) -> tuple[int, ...]:
        while True:
            s = tuple(self.dim() for _ in range(rank))
            if int(np.prod(s)) <= self.max_elements // 2:
                return s

    def broadcast_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A shape that broadcasts to ``shape``: some dims 1, maybe fewer leading dims."""
        drop = int(self.rng.integers(0, len(shape) + 1)) if self.chance(0.4) else 0
        return tuple(1 if self.chance(0.4) else d for d in shape[drop:])


# -- operators: each takes the builder and an operand, returns the output name (or None) ----------

Op = Callable[[_GraphBuilder, Value], "str | None"]


def _unary(b: _GraphBuilder, x: Value) -> str:
    kind = b.choice(
        ["Relu", "Tanh", "Sigmoid", "Neg", "Abs", "Erf", "Softplus", "LeakyRelu", "Clip", "HardSigmoid",
         "Sqrt", "Log", "Exp", "Reciprocal", "Gelu-tanh", "Elu", "Floor-free"]
    )  # fmt: skip
    if kind == "LeakyRelu":
        return b.node("LeakyRelu", [x.name], alpha=float(b.choice([0.01, 0.2, 1.5])))
    if kind == "Clip":
        lo, hi = sorted(b.rng.uniform(-1.5, 1.5, 2).round(2).tolist())
        args = [x.name, b.const(np.array(lo, b.g.dtype)), b.const(np.array(hi + 0.1, b.g.dtype))]
        if b.chance(0.3):
            args = [x.name, "", args[2]]
        return b.node("Clip", args)
    if kind in ("Sqrt", "Log"):  # on |x| + 0.5: away from the domain's edge
        pos = b.node("Add", [b.node("Abs", [x.name]), b.const(np.array(0.5, b.g.dtype))])
        return b.node(kind, [pos])
    if kind == "Reciprocal":
        pos = b.node("Add", [b.node("Abs", [x.name]), b.const(np.array(1.0, b.g.dtype))])
        return b.node("Reciprocal", [pos])
    if kind == "Exp":  # of a bounded value
        return b.node("Exp", [b.node("Tanh", [x.name])])
    if kind == "Gelu-tanh":  # the decomposition exporters write
        x3 = b.node("Mul", [b.node("Mul", [x.name, x.name]), x.name])
        inner = b.node("Add", [x.name, b.node("Mul", [x3, b.const(np.array(0.044715, b.g.dtype))])])
        t = b.node("Tanh", [b.node("Mul", [inner, b.const(np.array(0.7978846, b.g.dtype))])])
        half = b.node("Mul", [x.name, b.const(np.array(0.5, b.g.dtype))])
        return b.node("Mul", [half, b.node("Add", [t, b.const(np.array(1.0, b.g.dtype))])])
    if kind == "Elu":
        return b.node("Elu", [x.name], alpha=float(b.choice([1.0, 0.5])))
    if kind == "Floor-free":  # x * sigmoid(x): SiLU
        return b.node("Mul", [x.name, b.node("Sigmoid", [x.name])])
    return b.node(kind, [x.name])


def _other_operand(b: _GraphBuilder, x: Value) -> str:
    """A second operand broadcasting with ``x``: an earlier value, a new input or a constant."""
    earlier = [v for v in b.floats() if v.name != x.name and _broadcasts(v.shape, x.shape)]
    if earlier and b.chance(0.35):
        return b.choice(earlier).name
    shape = b.broadcast_shape(x.shape)
    if b.chance(0.2):  # an operand that makes the result larger than x: x broadcasts too
        grown = [b.dim() if d == 1 else d for d in x.shape]
        lead = [b.dim()] if len(grown) < 4 and b.chance(0.5) else []
        shape = tuple(lead + grown)
        if int(np.prod(shape)) > b.max_elements // 2:
            shape = b.broadcast_shape(x.shape)
    if b.chance(0.5):
        return b.new_input(shape).name
    return b.const(b.rng.standard_normal(shape).astype(b.g.dtype))


def _broadcasts(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    if len(small) > len(big):
        return False
    return all(s in (1, d) for s, d in zip(small[::-1], big[::-1]))


def _binary(b: _GraphBuilder, x: Value) -> str:
    kind = b.choice(["Add", "Sub", "Mul", "Max", "Min", "Div", "Pow", "Sum", "Mean"])
    y = _other_operand(b, x)
    if kind == "Div":  # by |y| + 1
        pos = b.node("Add", [b.node("Abs", [y]), b.const(np.array(1.0, b.g.dtype))])
        return b.node("Div", [x.name, pos] if b.chance(0.7) else [y, pos])
    if kind == "Pow":
        if b.chance(0.5):
            return b.node("Pow", [x.name, b.const(np.array(b.choice([2.0, 3.0]), b.g.dtype))])
        base = b.node("Add", [b.node("Abs", [x.name]), b.const(np.array(0.5, b.g.dtype))])
        return b.node("Pow", [base, b.node("Tanh", [y])])
    if kind in ("Sum", "Mean"):
        return b.node(kind, [x.name, y, x.name] if b.chance(0.4) else [x.name, y])
    return b.node(kind, [x.name, y] if b.chance(0.7) else [y, x.name])


def _reduce(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    kind = b.choice(
        ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL2", "ReduceL1",
         "ReduceLogSumExp"]
    )  # fmt: skip
    n = int(b.rng.integers(1, x.rank + 1))
    axes = sorted(b.rng.choice(x.rank, n, replace=False).tolist())
    axes = [a - x.rank if b.chance(0.3) else a for a in axes]
    keep = int(b.chance(0.5))
    if kind == "ReduceSum":
        if b.chance(0.15):
            return b.node(kind, [x.name], keepdims=keep)  # no axes: all of them
        return b.node(kind, [x.name, b.ints(axes)], keepdims=keep)
    return b.node(kind, [x.name], axes=axes, keepdims=keep)


def _matmul(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    k = x.shape[-1]
    n = b.dim()
    mode = b.choice(["weight", "weight", "input", "left"])
    if x.rank >= 2 and b.chance(0.1):  # a vector on the right drops the last axis
        return b.node("MatMul", [x.name, b.weight((k,), k)])
    if mode == "weight" or x.rank == 1:
        return b.node("MatMul", [x.name, b.weight((k, n), k)])
    if mode == "input":  # both operands computed: batched, broadcasting batch dims
        batch = b.broadcast_shape(x.shape[:-2]) if x.rank > 2 else ()
        y = b.new_input((*batch, k, n))
        scaled = b.node("Mul", [y.name, b.const(np.array(1 / np.sqrt(k), b.g.dtype))])
        return b.node("MatMul", [x.name, scaled])
    m = b.dim()  # x on the right: W[m, rows] @ x
    return b.node("MatMul", [b.weight((m, x.shape[-2]), x.shape[-2]), x.name])


def _gemm(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank != 2:
        if x.rank == 0:
            return None
        x = Value(b.node("Flatten", [x.name], axis=int(b.rng.integers(0, x.rank + 1))), ())
        shape = b.infer(x.name)
        if shape is None:
            return None
        x = Value(x.name, shape)
    trans_a, trans_b = int(b.chance(0.3)), int(b.chance(0.5))
    m, k = x.shape[::-1] if trans_a else x.shape
    n = b.dim()
    w = b.weight((n, k) if trans_b else (k, n), k)
    args = [x.name, w]
    attrs: dict[str, object] = {"transA": trans_a, "transB": trans_b}
    if b.chance(0.5):
        attrs["alpha"] = float(b.choice([0.5, 1.5]))
    if b.chance(0.7):
        c_shape = b.choice([(n,), (1, n), (m, 1), (m, n), ()])
        args.append(b.const(b.rng.standard_normal(c_shape).astype(b.g.dtype)))
        if b.chance(0.4):
            attrs["beta"] = float(b.choice([0.5, 2.0]))
    return b.node("Gemm", args, **attrs)


def _conv(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank not in (3, 4):
        return None
    c = x.shape[1]
    spatial = x.shape[2:]
    group = b.choice([*[g for g in range(1, c + 1) if c % g == 0][-3:], 1])
    m = group * int(b.rng.integers(1, 4 if group > 1 else 9))
    kernel = [int(b.rng.integers(1, min(d, 3) + 1)) if b.chance(0.8) else 1 for d in spatial]
    strides = [int(b.choice([1, 1, 2, 3])) for _ in spatial]
    dil = [int(b.choice([1, 1, 2])) if k > 1 else 1 for k in kernel]
    pads = [int(b.rng.integers(0, k)) for k in kernel for _ in range(2)]
    pads = pads[0::2] + pads[1::2]
    for i, d in enumerate(spatial):
        if d + pads[i] + pads[i + len(spatial)] < dil[i] * (kernel[i] - 1) + 1:
            return None
    fan_in = c // group * int(np.prod(kernel))
    args = [x.name, b.weight((m, c // group, *kernel), fan_in)]
    if b.chance(0.6):
        args.append(b.const(b.rng.standard_normal(m).astype(b.g.dtype)))
    attrs: dict[str, object] = {"group": group, "strides": strides, "dilations": dil}
    # onnxruntime has no SAME padding with dilation (nor does it need strides of 1).
    if b.chance(0.15) and all(s == 1 for s in strides) and all(d == 1 for d in dil):
        attrs["auto_pad"] = b.choice(["SAME_UPPER", "SAME_LOWER"])
    else:
        attrs["pads"] = pads
    if b.chance(0.5):
        attrs["kernel_shape"] = kernel
    return b.node("Conv", args, **attrs)


def _pool(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank not in (3, 4):
        return None
    kind = b.choice(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"])
    if kind.startswith("Global"):
        return b.node(kind, [x.name])
    kernel = [int(b.rng.integers(1, min(d, 3) + 1)) for d in x.shape[2:]]
    pads = [int(b.rng.integers(0, k)) for k in kernel for _ in range(2)]
    attrs: dict[str, object] = {
        "kernel_shape": kernel,
        "strides": [int(b.choice([1, 2])) for _ in kernel],
        "pads": pads[0::2] + pads[1::2],
    }
    if kind == "AveragePool":
        attrs["count_include_pad"] = int(b.chance(0.5))
    return b.node(kind, [x.name], **attrs)


def _softmax(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    axis = int(b.rng.integers(-x.rank, x.rank))
    return b.node(b.choice(["Softmax", "Softmax", "LogSoftmax"]), [x.name], axis=axis)


def _layernorm(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    axis = int(b.rng.integers(-x.rank, x.rank))
    norm = x.shape[axis:]
    scale_shape = norm if b.chance(0.8) else b.broadcast_shape(norm)
    scale = b.const((1 + 0.3 * b.rng.standard_normal(scale_shape)).astype(b.g.dtype))
    args = [x.name, scale]
    if b.chance(0.6):
        args.append(b.const(b.rng.standard_normal(norm).astype(b.g.dtype)))
    return b.node("LayerNormalization", args, axis=axis, epsilon=float(b.choice([1e-5, 1e-3])))


def _reshape(b: _GraphBuilder, x: Value) -> str | None:
    shape = list(x.shape)
    kind = b.choice(["merge", "split", "unsqueeze", "squeeze", "flatten"])
    if kind == "merge" and len(shape) >= 2:
        i = int(b.rng.integers(0, len(shape) - 1))
        shape[i : i + 2] = [shape[i] * shape[i + 1]]
    elif kind == "split" and shape:
        i = int(b.rng.integers(0, len(shape)))
        factors = [f for f in range(2, shape[i]) if shape[i] % f == 0]
        f = b.choice(factors) if factors else 1
        shape[i : i + 1] = [f, shape[i] // f]
    elif kind == "unsqueeze" and len(shape) < 5:
        axis = int(b.rng.integers(0, len(shape) + 1))
        if b.chance(0.5):
            return b.node("Unsqueeze", [x.name, b.ints([axis])])
        shape.insert(axis, 1)
    elif kind == "squeeze" and 1 in shape:
        ones = [i for i, d in enumerate(shape) if d == 1]
        if b.chance(0.5):
            return b.node("Squeeze", [x.name, b.ints(ones[:1])] if b.chance(0.7) else [x.name])
        del shape[ones[0]]
    elif kind == "flatten" and shape:
        return b.node("Flatten", [x.name], axis=int(b.rng.integers(0, len(shape) + 1)))
    else:
        shape = shape[::-1]  # same elements, reversed dims
    spec = list(shape)
    if spec and b.chance(0.4):
        spec[int(b.rng.integers(0, len(spec)))] = -1
    for i in range(min(len(spec), len(x.shape))):
        if spec[i] == x.shape[i] and b.chance(0.3):
            spec[i] = 0
    if spec.count(-1) > 1 or (-1 in spec and 0 in spec and x.size == 0):
        spec = list(shape)
    return b.node("Reshape", [x.name, b.ints(spec)])


def _transpose(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank < 2:
        return None
    perm = b.rng.permutation(x.rank).tolist()
    return b.node("Transpose", [x.name], perm=perm) if b.chance(0.9) else b.node("Transpose", [x.name])


def _slice(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    axes = sorted(b.rng.choice(x.rank, int(b.rng.integers(1, x.rank + 1)), replace=False).tolist())
    starts, ends, steps = [], [], []
    for a in axes:
        d = x.shape[a]
        step = int(b.choice([1, 1, 1, 2, 3, -1, -2]))
        lo, hi = sorted(b.rng.integers(0, d + 1, 2).tolist())
        if hi == lo:
            lo, hi = 0, d
        if step > 0:
            start, end = lo, hi
        else:
            start, end = hi - 1, lo - 1
        if b.chance(0.3):
            start -= d  # the same place from the end
        if end < 0 and step < 0:
            end = -(2**63) if b.chance(0.5) else -d - 1  # before the beginning
        elif b.chance(0.2) and step > 0 and end == d:
            end = 2**63 - 1
        elif b.chance(0.3) and end >= 0:
            end -= d
        starts.append(start)
        ends.append(end)
        steps.append(step)
    args = [x.name, b.ints(starts), b.ints(ends)]
    neg = [a - x.rank if b.chance(0.3) else a for a in axes]
    if b.chance(0.8) or any(s != 1 for s in steps):
        args.append(b.ints(neg))
        if any(s != 1 for s in steps) or b.chance(0.5):
            args.append(b.ints(steps))
    elif axes != list(range(len(axes))):
        args.append(b.ints(neg))
    return b.node("Slice", args)


def _concat(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    axis = int(b.rng.integers(-x.rank, x.rank))
    parts = [x.name]
    for _ in range(int(b.rng.integers(1, 3))):
        shape = list(x.shape)
        same = [v for v in b.floats() if v.rank == x.rank and all(
            s == d for i, (s, d) in enumerate(zip(v.shape, x.shape)) if i != axis % x.rank)]  # fmt: skip
        if same and b.chance(0.5):
            parts.append(b.choice(same).name)
            continue
        shape[axis] = int(b.choice([1, 2, 3, 5]))
        parts.append(b.new_input(shape).name if b.chance(0.6) else b.const(
            b.rng.standard_normal(shape).astype(b.g.dtype)))  # fmt: skip
    b.rng.shuffle(parts)
    return b.node("Concat", parts, axis=axis)


def _pad(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    mode = b.choice(["constant", "constant", "reflect", "edge"])
    before, after = [], []
    for d in x.shape:
        limit = d - 1 if mode == "reflect" else 2
        lo, hi = (int(b.rng.integers(0, limit + 1)) for _ in range(2)) if limit > 0 else (0, 0)
        if mode == "constant" and b.chance(0.15) and d > 2:
            lo = -1  # negative padding crops
        before.append(lo if b.chance(0.7) else 0)
        after.append(hi if b.chance(0.7) else 0)
    args = [x.name, b.ints(before + after)]
    if mode == "constant" and b.chance(0.5):
        args.append(b.const(np.array(b.choice([0.0, 1.5, -2.0]), b.g.dtype)))
    return b.node("Pad", args, mode=mode)


def _gather(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    axis = int(b.rng.integers(-x.rank, x.rank))
    d = x.shape[axis]
    shape = tuple(b.dim() for _ in range(int(b.choice([0, 1, 1, 2]))))
    idx = b.rng.integers(-d, d, shape).astype(np.int64)
    return b.node("Gather", [x.name, b.const(idx, "idx")], axis=axis)


def _expand(b: _GraphBuilder, x: Value) -> str | None:
    if 1 not in x.shape and x.rank >= 3:
        return None
    target = [b.dim() if d == 1 else d for d in x.shape]
    if x.rank < 3 and b.chance(0.5):
        target.insert(0, b.dim())
    spec = (
        [1 if t == d and b.chance(0.3) else t for t, d in zip(target[-x.rank :], x.shape)] if x.rank else []
    )
    spec = target[: len(target) - x.rank] + spec
    return b.node("Expand", [x.name, b.ints(spec)])


def _split(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank == 0:
        return None
    axis = int(b.rng.integers(0, x.rank))
    d = x.shape[axis]
    if d < 2:
        return None
    cut = int(b.rng.integers(1, d))
    outs = [b.fresh("split"), b.fresh("split")]
    b.g.nodes.append(
        helper.make_node("Split", [x.name, b.ints([cut, d - cut])], outs, name=f"{outs[0]}_node", axis=axis)
    )
    first = b.infer(outs[0])
    if first is not None and not b.chance(0.5):
        b.values.append(Value(outs[0], first))  # the other part stays available too
        return outs[1]
    return outs[0]


def _select(b: _GraphBuilder, x: Value) -> str | None:
    """Where, ArgMax/ArgMin and comparisons, on graph inputs only: their results jump, so
    they must read values both sides hold bit for bit.  Integer results are compared
    exactly; an index becomes a float again through Cast."""
    inputs = [v for v in b.values if v.name in b.g.feeds]
    src = b.choice(inputs)
    kind = b.choice(["Where", "ArgMax", "ArgMin", "Greater-cast"])
    if kind == "Where":
        cond = b.node(
            b.choice(["Greater", "Less", "LessOrEqual"]), [src.name, b.const(np.array(0.3, b.g.dtype))]
        )
        other = x.name if _broadcasts(src.shape, x.shape) or _broadcasts(x.shape, src.shape) else src.name
        return b.node("Where", [cond, other, b.node("Neg", [src.name])])
    if kind == "Greater-cast":
        if not (_broadcasts(src.shape, x.shape) or _broadcasts(x.shape, src.shape)) or src.name == x.name:
            return None
        flag = b.node(
            "Cast",
            [b.node("Greater", [src.name, b.const(np.array(0.0, b.g.dtype))])],
            to=ONNX_TYPE[b.g.dtype],
        )
        return b.node("Mul", [x.name, flag])
    if src.rank == 0:
        return None
    idx = b.node(kind, [src.name], axis=int(b.rng.integers(-src.rank, src.rank)), keepdims=int(b.chance(0.5)))
    if b.chance(0.3):
        b.integers.add(idx)
        return idx  # an int64 result, compared exactly
    return b.node("Cast", [idx], to=ONNX_TYPE[b.g.dtype])


def _norm(b: _GraphBuilder, x: Value) -> str | None:
    """BatchNormalization (folded into a Conv before it, when there is one) or
    InstanceNormalization, over axis 1."""
    if x.rank < 2 or (x.rank < 3 and b.chance(0.5)):
        return None
    c = x.shape[1]
    scale = b.const((1 + 0.3 * b.rng.standard_normal(c)).astype(b.g.dtype))
    bias = b.const(b.rng.standard_normal(c).astype(b.g.dtype))
    if x.rank >= 3 and b.chance(0.4):
        return b.node("InstanceNormalization", [x.name, scale, bias], epsilon=1e-5)
    mean = b.const(b.rng.standard_normal(c).astype(b.g.dtype))
    var = b.const(b.rng.uniform(0.5, 2.0, c).astype(b.g.dtype))
    return b.node("BatchNormalization", [x.name, scale, bias, mean, var], epsilon=1e-5)


def _conv_transpose(b: _GraphBuilder, x: Value) -> str | None:
    if x.rank not in (3, 4):
        return None
    c = x.shape[1]
    group = b.choice([1, 1, c]) if c > 1 else 1
    m = group * int(b.rng.integers(1, 4))
    kernel = [int(b.rng.integers(1, 4)) for _ in x.shape[2:]]
    strides = [int(b.choice([1, 2])) for _ in kernel]
    pads = [int(b.rng.integers(0, k)) for k in kernel for _ in range(2)]
    attrs: dict[str, object] = {"group": group, "strides": strides, "pads": pads[0::2] + pads[1::2]}
    if b.chance(0.3):
        attrs["output_padding"] = [int(b.rng.integers(0, s)) for s in strides]
    fan_in = c // group * int(np.prod(kernel))
    args = [x.name, b.weight((c, m // group, *kernel), fan_in)]
    if b.chance(0.5):
        args.append(b.const(b.rng.standard_normal(m).astype(b.g.dtype)))
    return b.node("ConvTranspose", args, **attrs)


def _rearrange(b: _GraphBuilder, x: Value) -> str | None:
    """Tile, DepthToSpace, SpaceToDepth."""
    kind = b.choice(["Tile", "DepthToSpace", "SpaceToDepth"])
    if kind == "Tile" and x.rank:
        return b.node("Tile", [x.name, b.ints([int(b.choice([1, 1, 2, 3])) for _ in x.shape])])
    if x.rank != 4:
        return None
    _, c, h, w = x.shape
    if kind == "DepthToSpace" and c % 4 == 0:
        return b.node(kind, [x.name], blocksize=2, mode=b.choice(["DCR", "CRD"]))
    if kind == "SpaceToDepth" and h % 2 == 0 and w % 2 == 0:
        return b.node(kind, [x.name], blocksize=2)
    return None


OPS: dict[str, tuple[Op, float]] = {
    "norm": (_norm, 0.5),
    "conv_transpose": (_conv_transpose, 0.4),
    "rearrange": (_rearrange, 0.5),
    "select": (_select, 0.6),
    "unary": (_unary, 3.0),
    "binary": (_binary, 3.0),
    "reduce": (_reduce, 2.0),
    "matmul": (_matmul, 1.5),
    "gemm": (_gemm, 0.7),
    "conv": (_conv, 1.5),
    "pool": (_pool, 0.4),
    "softmax": (_softmax, 1.0),
    "layernorm": (_layernorm, 1.0),
    "reshape": (_reshape, 1.2),
    "transpose": (_transpose, 1.0),
    "slice": (_slice, 1.0),
    "concat": (_concat, 0.8),
    "pad": (_pad, 0.8),
    "gather": (_gather, 0.8),
    "expand": (_expand, 0.7),
    "split": (_split, 0.3),
}


def random_graph(seed: int, index: int = 0, fp16_share: float = 0.25, large_share: float = 0.25) -> FuzzGraph:
    """Graph ``index`` of the run seeded ``seed``: always the same graph for the same
    arguments.  ``fp16_share`` and ``large_share`` are the chances of a float16 graph and
    of a graph with large extents."""
    rng = np.random.default_rng([seed, index])
    dtype = np.float16 if rng.random() < fp16_share else np.float32
    large = rng.random() < large_share
    b = _GraphBuilder(rng, f"{seed}:{index}", f"g{seed}_{index}_", dtype, large)
    rank = int(b.choice([0, 1, 2, 2, 3, 3, 4, 4, 4]))
    b.new_input(b.shape(rank))
    if b.chance(0.3):
        b.new_input(b.shape(int(b.rng.integers(1, 5))))
    names = list(OPS)
    weights = np.array([OPS[n][1] for n in names])
    target = int(rng.integers(2, 8) if rng.random() < 0.85 else rng.integers(8, 15))
    attempts = 0
    while len(b.g.ops) < target and attempts < 60:
        attempts += 1
        operands = b.floats()
        x = operands[-1] if b.chance(0.7) else b.choice(operands)
        kind = names[int(rng.choice(len(names), p=weights / weights.sum()))]
        mark = b.checkpoint()
        out = OPS[kind][0](b, x)
        if out is None or b.finish(out, kind) is None:
            b.rollback(mark)
    produced = [v for v in b.values if v.name not in b.g.feeds]
    if not produced:
        produced = [b.finish(b.node("Relu", [b.values[-1].name]), "unary")]
    outputs = [produced[-1].name]
    if len(produced) > 1 and b.chance(0.35):
        outputs.append(b.choice(produced[:-1]).name)
    b.g.outputs = outputs
    _drop_unused(b.g)
    return b.g


def _drop_unused(g: FuzzGraph) -> None:
    """Remove nodes, inputs and constants no output depends on (ops that were rolled back
    leave none, but values never read do)."""
    needed = set(g.outputs)
    kept = []
    for n in reversed(g.nodes):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    g.nodes[:] = kept[::-1]
    for d in (g.feeds, g.initializers):
        for k in [k for k in d if k not in needed]:
            del d[k]
    if not g.feeds:  # every graph keeps an input, so nothing folds away entirely
        name = f"{g.outputs[0]}_unused_input"
        g.feeds[name] = np.zeros((1,), dtype=g.dtype)


# -- running -----------------------------------------------------------------------------------------


@dataclass
class Mismatch:
    graph: FuzzGraph
    backend: str
    detail: str

    def format(self) -> str:
        return f"{self.backend}: {self.graph.describe()}\n    {self.detail}"


def reference_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from welder.check import onnxruntime_outputs

    return onnxruntime_outputs(model, feeds)


# Beyond half the float16 range, whether a value overflows depends on where an
# implementation keeps float32 (onnxruntime runs many float16 operators in float32).
FP16_RANGE = 32768.0


def fp16_unfit_outputs(graphs: Sequence[FuzzGraph], reference: dict[str, np.ndarray]) -> dict[str, str]:
    """Outputs of float16 graphs that float16 cannot decide, with the reason.  The graph
    runs in onnxruntime in float32 twice: exactly, and with every value rounded to float16
    as the graph's types demand.  An output is unfit when a value leaves half the float16
    range, or when rounding the values moves it, or onnxruntime's float16 result (which
    keeps many values in float32) lies off the exact one, by over half the float16
    threshold: the graph is ill-conditioned (a cancelling sum of large terms, say), and
    two correct implementations may differ by more than the threshold.  Such outputs
    measure float16 rounding, not the compiler, and are reported rather than compared."""
    from welder.check import error_metric, threshold_for

    half = [g for g in graphs if g.dtype == np.float16]
    if not half:
        return {}
    runs = []
    for rounded in (False, True):
        twins = [_fp32_twin(g, rounded) for g in half]
        runs.append(reference_outputs(batch_model(twins), {k: v for t in twins for k, v in t.feeds.items()}))
    exact, rounded_values = runs
    unfit = {}
    for g in half:
        peak = max(
            (float(np.max(np.abs(v))) for n in g.nodes for o in n.output if (v := exact.get(o)) is not None
             and v.dtype == np.float32 and v.size),
            default=0.0,
        )  # fmt: skip
        for o in g.outputs:
            with np.errstate(over="ignore"):  # out of range: caught by the peak just below
                want = exact[o].astype(np.float16).astype(np.float32)
            drift = max(error_metric(v[o].astype(np.float32), want) for v in (reference, rounded_values))
            if peak > FP16_RANGE:
                unfit[o] = f"a float32 value reaches {peak:.3g}"
            elif drift > threshold_for("float16") / 2:
                unfit[o] = f"rounding to float16 moves it by {drift:.2e}"
    return unfit


_NOT_FLOAT = {"ArgMax", "ArgMin", "Greater", "Less", "LessOrEqual"}


def _fp32_twin(g: FuzzGraph, rounded: bool) -> FuzzGraph:
    """``g`` in float32 with every value an output; ``rounded``: every float value
    rounded to float16 and back, as the float16 graph stores it."""
    nodes = []
    for n in g.nodes:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        for a in m.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT16:
                a.i = TensorProto.FLOAT
        nodes.append(m)
        if rounded and n.op_type not in _NOT_FLOAT:
            for k, o in enumerate(n.output):
                if o:
                    m.output[k] = f"{o}_exact"
                    nodes.append(
                        helper.make_node("Cast", [f"{o}_exact"], [f"{o}_half"], to=TensorProto.FLOAT16)
                    )
                    nodes.append(helper.make_node("Cast", [f"{o}_half"], [o], to=TensorProto.FLOAT))
    return FuzzGraph(
        g.label,
        np.float32,
        nodes,
        {k: v.astype(np.float32) for k, v in g.feeds.items()},
        {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in g.initializers.items()},
        g.outputs if rounded else [o for n in g.nodes for o in n.output if o],
        g.ops,
    )


def _emulate_other_configs(path: Path, spec: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``emulate@ARCH#K``: the emulated kernels planned for ARCH, each group taking one of
    its K best configs (chosen by a hash of the group's name), since ``welder tune``
    measures all K on the GPU and any of them must compute the right thing."""
    import zlib

    from welder.arch import get_arch
    from welder.codegen import generate_model
    from welder.frontend.onnx import import_onnx
    from welder.runtime.emulate import EmulatedModel
    from welder.schedule.plan import plan_model

    arch, _, k = spec.removeprefix("emulate@").partition("#")
    graph = import_onnx(path)
    plan = plan_model(graph, get_arch(arch), topk=int(k or 1))
    chosen = [(p.group, p.configs[zlib.crc32(p.group.root.encode()) % len(p.configs)]) for p in plan.groups]
    return EmulatedModel(graph, generate_model(graph, chosen)).run(feeds)


def check_batch(
    graphs: Sequence[FuzzGraph],
    backends: Sequence[str] = ("interpret", "emulate"),
    folder: Path | None = None,
    unfit: dict[str, str] | None = None,
) -> list[Mismatch]:
    """Run the graphs merged into one model through each back end and onnxruntime; the
    mismatches, per graph.  A back end that raises is retried graph by graph so the error
    is pinned on the graph that causes it.  Outputs float16 cannot decide
    (``fp16_unfit_outputs``) are not compared; ``unfit`` receives them."""
    from welder.check import error_metric, threshold_for
    from welder.session import InferenceSession

    model = batch_model(graphs)
    feeds = {k: v for g in graphs for k, v in g.feeds.items()}
    reference = reference_outputs(model, feeds)
    skip = fp16_unfit_outputs(graphs, reference)
    if unfit is not None:
        unfit.update(skip)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "fuzz.onnx"
        onnx.save(model, str(path))
        found: list[Mismatch] = []
        for backend in backends:
            try:
                if backend.startswith("emulate@"):
                    ours = _emulate_other_configs(path, backend, feeds)
                else:
                    sess = InferenceSession(path, backend=backend)
                    ours = dict(zip(sess.graph.outputs, sess.run(None, feeds)))
            except Exception:
                if len(graphs) > 1:
                    for g in graphs:
                        found += check_batch([g], [backend], folder)
                    continue
                found.append(Mismatch(graphs[0], backend, traceback.format_exc(limit=-4).strip()))
                continue
            for g in graphs:
                for name in g.outputs:
                    ref = reference[name]
                    got = ours[name]
                    err = error_metric(got, ref)
                    limit = threshold_for(ref.dtype.name)
                    if got.dtype != ref.dtype or not (err <= limit or name in skip):
                        detail = f"output {name}: error {err:.3e} > {limit:.0e} ({got.dtype})"
                        found.append(Mismatch(g, backend, detail))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Differential fuzzing of welder against onnxruntime.")
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--seed", default="random", help="an integer, or 'random' for a fresh one")
    p.add_argument("--index", type=int, help="rebuild only graph INDEX of the seed")
    p.add_argument("--batch", type=int, default=10, help="graphs compiled together")
    p.add_argument(
        "--backends",
        default="interpret,emulate",
        help="comma-separated; emulate@ARCH#K emulates ARCH's plan with one of each group's K best configs",
    )
    p.add_argument("--save", help="with --index: write the graph's model here")
    p.add_argument("--fp16-share", type=float, default=0.25, help="chance of a float16 graph")
    p.add_argument("--large-share", type=float, default=0.25, help="chance of a graph with large extents")
    args = p.parse_args(argv)
    seed = int(np.random.SeedSequence().entropy % 10**6) if args.seed == "random" else int(args.seed)
    backends = args.backends.split(",")
    if args.index is not None:
        g = random_graph(seed, args.index, args.fp16_share, args.large_share)
        print(g.describe())
        if args.save:
            onnx.save(g.model(), args.save)
        bad = check_batch([g], backends)
        for m in bad:
            print(m.format())
        return 1 if bad else 0
    start, failures, unfit = time.time(), 0, {}
    for first in range(0, args.cases, args.batch):
        stop = min(first + args.batch, args.cases)
        graphs = [random_graph(seed, i, args.fp16_share, args.large_share) for i in range(first, stop)]
        for m in check_batch(graphs, backends, unfit=unfit):
            failures += 1
            index = m.graph.label.split(":")[1]
            share = f"--fp16-share {args.fp16_share} --large-share {args.large_share}"
            print(f"FAIL --seed {seed} --index {index} {share}  {m.format()}", flush=True)
        print(
            f"[{first + len(graphs)}/{args.cases} graphs, {time.time() - start:.0f} s, {failures} failures, "
            f"{len(unfit)} float16 outputs not compared]",
            flush=True,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
