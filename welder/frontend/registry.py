"""The table of ONNX operator lowerings and the context each lowering receives.

A lowering is one small function registered for one or more ONNX op types.  It reads its
inputs and attributes from a :class:`LowerContext`, builds Computes with
``ctx.compute(shape, fn)`` and returns the tensor(s) standing for the node's outputs.  It
never names tensors itself: the importer renames the returned computes to the ONNX output
names and folds them to constants when every input is constant.

    @register("Relu")
    def relu(ctx):
        x = ctx.input(0)
        return ctx.compute(x.shape, lambda *i: maximum(x[i], 0))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from welder.errors import ModelError, UnsupportedError
from welder.ir.compute import Compute, Reduce, compute
from welder.ir.expr import INDEX, Const, Expr, ExprLike, Load, as_expr

_ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.UINT32: "uint32",
    onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.BOOL: "bool",
}


def dtype_from_onnx(elem_type: int, what: str) -> str:
    """Our dtype name for an ONNX element type; ``what`` names the tensor in the error."""
    if elem_type not in _ONNX_DTYPES:
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type else "undefined"
        raise UnsupportedError(f"{what}: element type {name} is not supported")
    return _ONNX_DTYPES[elem_type]


def array_dtype(arr: np.ndarray, what: str) -> str:
    """Our dtype name for a numpy array, with an error naming ``what`` if unsupported."""
    name = "bool" if arr.dtype == np.bool_ else arr.dtype.name
    if name not in _ONNX_DTYPES.values():
        raise UnsupportedError(f"{what}: element type {arr.dtype} is not supported")
    return name


def dtype_to_onnx(dtype: str) -> int:
    return next(k for k, v in _ONNX_DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class Tensor:
    """A tensor visible to lowerings: a model input, a constant or a compute's output."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __getitem__(self, idx: ExprLike | Sequence[ExprLike]) -> Load:
        if not isinstance(idx, (tuple, list)):
            idx = (idx,)
        if len(idx) != self.rank:
            raise ValueError(f"{self.name}: {len(idx)} indices for a rank-{self.rank} tensor")
        return Load(self.name, tuple(as_expr(i, INDEX) for i in idx), self.dtype)

    def broadcast(self, out_idx: Sequence[Expr]) -> Load:
        """Element for output index ``out_idx`` under numpy broadcasting rules."""
        lead = len(out_idx) - self.rank
        if lead < 0:
            raise ValueError(f"{self.name}: cannot broadcast rank {self.rank} to {len(out_idx)}")
        return self[tuple(0 if d == 1 else out_idx[lead + k] for k, d in enumerate(self.shape))]


@dataclass(frozen=True)
class Lowering:
    op_type: str
    fn: Callable[[LowerContext], Any]


LOWERINGS: dict[str, Lowering] = {}


def register(*op_types: str) -> Callable:
    def wrap(fn: Callable[[LowerContext], Any]) -> Callable[[LowerContext], Any]:
        for op in op_types:
            if op in LOWERINGS:
                raise RuntimeError(f"two lowerings registered for {op}")
            LOWERINGS[op] = Lowering(op, fn)
        return fn

    return wrap


_REQUIRED = object()


class LowerContext:
    """What a lowering may see of its node and what it may create.

    ``builder`` is the importer's graph under construction; the context only appends
    computes and constants to it and remembers which ones this node created.
    """

    def __init__(
        self, node: onnx.NodeProto, opset: int, inputs: Sequence[Tensor | None], builder: Any
    ) -> None:
        self.node = node
        self.opset = opset
        self.inputs = list(inputs)
        self._builder = builder
        self._attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.created: list[str] = []

    # -- reading the node -------------------------------------------------------------

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def label(self) -> str:
        return f"{self.node.op_type} node {self.node.name or self.node.output[0]!r}"

    @property
    def num_outputs(self) -> int:
        return len(self.node.output)

    def output_used(self, k: int) -> bool:
        return k < len(self.node.output) and bool(self.node.output[k])

    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        if name in self._attrs:
            v = self._attrs[name]
            if isinstance(v, bytes):
                return v.decode()
            if isinstance(v, list) and v and isinstance(v[0], bytes):
                return [s.decode() for s in v]
            return v
        if default is _REQUIRED:
            raise ModelError(f"{self.label}: missing required attribute {name!r}")
        return default

    def has_input(self, k: int) -> bool:
        return k < len(self.inputs) and self.inputs[k] is not None

    def input(self, k: int) -> Tensor:
        if not self.has_input(k):
            raise ModelError(f"{self.label}: missing input #{k}")
        return self.inputs[k]  # type: ignore[return-value]

    def optional_input(self, k: int) -> Tensor | None:
        return self.inputs[k] if self.has_input(k) else None

    def const_value(self, k: int) -> np.ndarray | None:
        """The value of input ``k`` if it is a constant (after folding), else None."""
        if not self.has_input(k):
            return None
        return self._builder.constant_value(self.inputs[k].name)  # type: ignore[union-attr]

    def const_input(self, k: int, what: str) -> np.ndarray:
        """Input ``k``, which must be constant; ``what`` names it in the error."""
        v = self.const_value(k)
        if v is None:
            raise UnsupportedError(
                f"{self.label}: input {what!r} ({self.inputs[k].name if self.has_input(k) else 'missing'})"
                " must be a constant after constant folding; data-dependent shapes are not supported"
            )
        return v

    def fail(self, message: str) -> UnsupportedError:
        """An error naming this node, for the lowering to raise."""
        return UnsupportedError(f"{self.label}: {message}")

    def axis(self, axis: int, rank: int) -> int:
        """Normalise a possibly negative axis, with an error naming the node."""
        if not -rank <= axis < max(rank, 1):
            raise ModelError(f"{self.label}: axis {axis} out of range for rank {rank}")
        return axis + rank if axis < 0 else axis

    # -- building ---------------------------------------------------------------------

    def compute(
        self,
        shape: Sequence[int],
        fn: Callable[..., Expr | Reduce | int | float],
        hint: str = "",
        dtype: str | None = None,
    ) -> Tensor:
        """Add ``out[shape] = fn(*axes)`` to the graph and return its tensor."""
        name = self._builder.fresh_name(self.node, hint)
        c = compute(name, shape, fn, dtype)
        return self.add(c)

    def add(self, c: Compute) -> Tensor:
        self._builder.add_compute(c, self)
        self.created.append(c.name)
        return Tensor(c.name, c.shape, c.dtype)

    def check_fits(self, shape: Sequence[int], dtype: str, what: str = "output") -> None:
        """Raise, naming this node, if a tensor of ``shape`` cannot fit in the memory the
        model is imported for; call it before allocating an array of that shape."""
        self._builder.check_fits(f"{self.label}: {what}", shape, dtype)

    def constant(self, value: np.ndarray | float | int, hint: str = "") -> Tensor:
        value = np.asarray(value)
        array_dtype(value, self.label)
        name = self._builder.fresh_name(self.node, hint or "const")
        self._builder.add_constant(name, value)
        self.created.append(name)
        return self._builder.tensor(name)

    def scalar(self, value: float | int | bool, dtype: str) -> Const:
        return Const(value, dtype)
