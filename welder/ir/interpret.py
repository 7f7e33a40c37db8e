"""Reference evaluation of Computes with numpy.

This is the ground truth every generated kernel is compared against, so it is written for
obvious correctness first and speed second -- but it must still run a ResNet-50 in
seconds.  Two ideas make that possible:

* every axis is a numpy array broadcast along its own dimension, so a sub-expression only
  materialises the axes it actually depends on (a conv's input load spans
  ``n, ci, h, kh, w, kw`` but not ``co``);
* a sum over a product of factors is handed to ``np.einsum``, which contracts with BLAS
  instead of materialising the whole iteration space.

Indices that fall outside a tensor are clamped before the gather.  Lowerings guard every
such access with a ``select`` (padding, bounds), so the clamped value is never used.  Data
values used as indices (:class:`~welder.ir.expr.DataIndex`) are different: nothing guards
them, so one outside its dimension raises :class:`~welder.errors.IndexRangeError`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from welder.errors import IndexRangeError
from welder.ir.compute import Compute, reduce_identity
from welder.ir.expr import (
    BOOL,
    INDEX,
    Binary,
    Call,
    Cast,
    Const,
    DataIndex,
    Expr,
    Load,
    Select,
    Var,
    is_float,
    is_half,
)

# Chunk the outermost spatial axis when the iteration space exceeds this many points.
_ELEMENTWISE_LIMIT = 1 << 24
_EINSUM_LIMIT = 1 << 28

_NP_DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "bool": np.bool_,
    INDEX: np.int64,
}


@functools.cache  # asked for every tensor of every config the search rates
def np_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a tensor of ``dtype`` is stored in (bfloat16: ml_dtypes')."""
    return np.dtype(_NP_DTYPES[dtype])


def value_dtype(dtype: str) -> np.dtype:
    """The numpy dtype values of ``dtype`` are computed in: bfloat16 in float32, as the
    generated code computes it (loads widen, and only stores and explicit casts round to
    bfloat16), everything else in its own type."""
    return np.dtype(np.float32) if dtype == "bfloat16" else np_dtype(dtype)


def evaluate(
    c: Compute, tensors: Mapping[str, np.ndarray], rows: tuple[int, int] | None = None
) -> np.ndarray:
    """Value of compute ``c`` given arrays for every tensor it loads; with ``rows`` =
    (start, stop), only those indices of its first axis (the tensors are still indexed
    absolutely: rows the compute reads must hold their values)."""
    for name in c.inputs:
        if name not in tensors:
            raise KeyError(f"{c.name}: no value for input tensor {name!r}")
    shape = list(c.shape)
    if rows is not None:
        shape[0] = rows[1] - rows[0]
    if 0 in shape or (c.reduce_axes and 0 in [a.extent for a in c.reduce_axes]):
        return _empty_or_identity(c) if rows is None else np.zeros(shape, np_dtype(c.dtype))
    points = int(np.prod(shape, dtype=np.int64)) * int(
        np.prod([a.extent for a in c.reduce_axes], dtype=np.int64)
    )
    limit = _EINSUM_LIMIT if _factors(c) is not None else _ELEMENTWISE_LIMIT
    first = rows[0] if rows is not None else 0
    if points <= limit or not shape:
        return _evaluate_range(c, tensors, first, first + shape[0] if shape else 0)
    # Split the outermost axis that is larger than one (the first, when rows are asked for).
    axis = 0 if rows is not None else next((k for k, s in enumerate(shape) if s > 1), 0)
    offset = first if axis == 0 else 0
    step = max(1, int(shape[axis] * limit // points))
    parts = []
    for start in range(0, shape[axis], step):
        stop = min(shape[axis], start + step)
        parts.append(_evaluate_range(c, tensors, offset + start, offset + stop, axis))
    return np.concatenate(parts, axis=axis)


def _empty_or_identity(c: Compute) -> np.ndarray:
    if c.reduce_op in ("argmax", "argmin"):
        raise ValueError(f"{c.name}: {c.reduce_op} over an empty axis")
    fill = reduce_identity(c.reduce_op, c.dtype) if c.reduce_op else 0
    return np.full(c.shape, fill, dtype=np_dtype(c.dtype))


def _evaluate_range(
    c: Compute, tensors: Mapping[str, np.ndarray], start: int, stop: int, split_axis: int = 0
) -> np.ndarray:
    all_axes = list(c.axes) + list(c.reduce_axes)
    ndim = len(all_axes)
    domain: dict[str, np.ndarray] = {}
    for k, a in enumerate(all_axes):
        lo, hi = (start, stop) if (k == split_axis and k < len(c.axes)) else (0, a.extent)
        shape = [1] * ndim
        shape[k] = hi - lo
        domain[a.name] = np.arange(lo, hi, dtype=np.int64).reshape(shape)
    out_shape = [domain[a.name].shape[k] for k, a in enumerate(c.axes)]
    nsp = len(c.axes)
    ev = _Evaluator(domain, tensors, ndim)

    if c.reduce_op is None:
        value = ev(c.body)
        return np.broadcast_to(_as_array(value, c.dtype), out_shape).astype(np_dtype(c.dtype))

    red = tuple(range(nsp, ndim))
    factors = _factors(c)
    if factors is not None:
        return _einsum(ev, factors, c, out_shape, red)
    value = np.broadcast_to(
        _as_array(ev(c.body), c.body.dtype), out_shape + [a.extent for a in c.reduce_axes]
    )
    if c.reduce_op in ("argmax", "argmin"):
        fn = np.argmax if c.reduce_op == "argmax" else np.argmin
        return fn(value, axis=nsp).astype(np.int64)
    acc = _accumulator(c.dtype)
    if c.reduce_op == "sum":
        out = np.sum(value, axis=red, dtype=acc)
    elif c.reduce_op == "prod":
        out = np.prod(value, axis=red, dtype=acc)
    elif c.reduce_op == "max":
        out = np.max(value, axis=red)
    else:
        out = np.min(value, axis=red)
    return np.asarray(out).astype(np_dtype(c.dtype))


def _accumulator(dtype: str) -> np.dtype:
    """16-bit float sums accumulate in fp32, as every serious back end does."""
    return np.dtype(np.float32) if is_half(dtype) else np_dtype(dtype)


def _factors(c: Compute) -> list[Expr] | None:
    """The factors of a sum-of-products body, or None if einsum does not apply."""
    if c.reduce_op != "sum" or c.dtype == BOOL:
        return None
    out: list[Expr] = []
    stack = [c.body]
    while stack:
        e = stack.pop()
        if isinstance(e, Binary) and e.op == "mul":
            stack.extend((e.b, e.a))
        else:
            out.append(e)
    return out


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _einsum(
    ev: _Evaluator, factors: list[Expr], c: Compute, out_shape: list[int], red: tuple[int, ...]
) -> np.ndarray:
    acc = _accumulator(c.dtype)
    ndim = len(c.axes) + len(c.reduce_axes)
    operands, subscripts = [], []
    present = [False] * ndim
    for f in factors:
        arr = _as_array(ev(f), f.dtype).astype(acc, copy=False)
        arr = arr.reshape((1,) * (ndim - arr.ndim) + arr.shape)
        keep = [k for k in range(ndim) if arr.shape[k] > 1]
        for k in keep:
            present[k] = True
        operands.append(arr.reshape([arr.shape[k] for k in keep]))
        subscripts.append("".join(_LETTERS[k] for k in keep))
    out_axes = [k for k in range(len(c.axes)) if present[k]]
    spec = ",".join(subscripts) + "->" + "".join(_LETTERS[k] for k in out_axes)
    result = np.einsum(spec, *operands, optimize=len(operands) > 1)
    # Reduce axes no factor depends on contribute a constant multiplier.
    missing = [c.reduce_axes[k - len(c.axes)].extent for k in red if not present[k]]
    if missing:
        result = result * acc.type(np.prod(missing))
    shaped = np.reshape(result, [out_shape[k] if present[k] else 1 for k in range(len(c.axes))])
    return np.broadcast_to(shaped, out_shape).astype(np_dtype(c.dtype))


def _as_array(v: np.ndarray | np.generic, dtype: str) -> np.ndarray:
    """A value of ``dtype`` as an array of its compute type (:func:`value_dtype`)."""
    return np.asarray(v, dtype=value_dtype(dtype))


class _Evaluator:
    """Evaluates expressions over a broadcast domain; memoises shared sub-trees."""

    def __init__(self, domain: dict[str, np.ndarray], tensors: Mapping[str, np.ndarray], ndim: int):
        self.domain = domain
        self.tensors = tensors
        self.ndim = ndim
        self.memo: dict[Expr, np.ndarray] = {}

    def __call__(self, e: Expr) -> np.ndarray:
        hit = self.memo.get(e)
        if hit is None:
            hit = self._eval(e)
            self.memo[e] = hit
        return hit

    def _eval(self, e: Expr) -> np.ndarray:
        if isinstance(e, Var):
            return self.domain[e.name]
        if isinstance(e, Const):
            return np.asarray(e.value, dtype=value_dtype(e.dtype))
        if isinstance(e, Load):
            return self._load(e)
        if isinstance(e, Cast):
            return _cast(self(e.x), e.x.dtype, e.dtype)
        if isinstance(e, Select):
            return np.where(self(e.cond), self(e.a), self(e.b)).astype(value_dtype(e.dtype), copy=False)
        if isinstance(e, Binary):
            return _binary(e.op, self(e.a), self(e.b), e.a.dtype)
        if isinstance(e, Call):
            return _call(e.fn, [self(a) for a in e.args], e.args[0].dtype)
        if isinstance(e, DataIndex):
            return data_index(self(e.value), e.extent, e.origin)
        raise TypeError(f"cannot evaluate {e!r}")

    def _load(self, e: Load) -> np.ndarray:
        t = np.asarray(self.tensors[e.tensor])
        if t.ndim != len(e.indices):
            raise ValueError(f"load of {e.tensor!r} with {len(e.indices)} indices, tensor has rank {t.ndim}")
        if t.ndim == 0:
            return t.astype(value_dtype(e.dtype), copy=False)
        sliced = self._slice(e, t)
        if sliced is not None:
            return sliced.astype(value_dtype(e.dtype), copy=False)
        idx = [np.clip(self(i), 0, n - 1) if n > 0 else self(i) for i, n in zip(e.indices, t.shape)]
        return t[tuple(np.asarray(i, dtype=np.int64) for i in idx)].astype(value_dtype(e.dtype), copy=False)

    def _slice(self, e: Load, t: np.ndarray) -> np.ndarray | None:
        """The load as a view where each index is a distinct axis variable whose range lies
        inside its dimension (an elementwise read, possibly transposed): no index arrays and
        no gather; None otherwise."""
        if not all(isinstance(i, Var) and i.name in self.domain for i in e.indices):
            return None
        names = [i.name for i in e.indices]  # type: ignore[attr-defined]
        ranges = [self.domain[n] for n in names]
        if len(set(names)) != len(names) or any(
            r.size == 0 or r.flat[-1] >= n for r, n in zip(ranges, t.shape)
        ):
            return None
        view = t[tuple(slice(int(r.flat[0]), int(r.flat[-1]) + 1) for r in ranges)]
        position = list(self.domain)  # the domain's axes in broadcast order
        order = sorted(range(len(names)), key=lambda d: position.index(names[d]))
        shape = [1] * self.ndim
        for d in order:
            shape[position.index(names[d])] = view.shape[d]
        return view.transpose(order).reshape(shape)


def data_index(values: np.ndarray, extent: int, origin: str) -> np.ndarray:
    """``values`` as positions in a dimension of ``extent``, negative ones counted from the
    end; raises IndexRangeError naming ``origin`` for the first value outside
    ``[-extent, extent)``."""
    v = np.asarray(values)
    if v.dtype.kind == "u":
        bad = v >= extent
    else:
        bad = (v < -extent) | (v >= extent)
    if np.any(bad):
        first = int(v[bad].flat[0]) if v.ndim else int(v)
        raise IndexRangeError(
            f"{origin or 'a data-dependent index'}: index {first} is out of range [{-extent}, {extent - 1}]"
        )
    v = v.astype(np.int64)
    return np.where(v < 0, v + extent, v)


def _cast(x: np.ndarray, src: str, dst: str) -> np.ndarray:
    if is_float(src) and not is_float(dst) and dst != BOOL:
        # C semantics: truncate towards zero; NaN/inf have no defined result, use 0.
        x = np.trunc(np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
    with np.errstate(invalid="ignore", over="ignore"):
        # To bfloat16: rounded to it, then carried on in its compute type.
        return x.astype(np_dtype(dst)).astype(value_dtype(dst), copy=False)


def _binary(op: str, a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    npd = value_dtype(dtype)
    with np.errstate(all="ignore"):
        if op == "add":
            return np.add(a, b, dtype=npd)
        if op == "sub":
            return np.subtract(a, b, dtype=npd)
        if op == "mul":
            return np.multiply(a, b, dtype=npd)
        if op == "div":
            if is_float(dtype):
                return np.divide(a, b, dtype=npd)
            return _trunc_div(a, b).astype(npd)
        if op == "floordiv":
            return np.floor_divide(a, b).astype(npd) if not is_float(dtype) else np.floor(a / b).astype(npd)
        if op == "mod":
            return np.mod(a, b).astype(npd)
        if op == "max":
            return np.maximum(a, b)
        if op == "min":
            return np.minimum(a, b)
        if op == "pow":
            if is_float(dtype):
                return np.power(a, b, dtype=npd)
            return np.power(a.astype(np.int64), np.maximum(b, 0).astype(np.int64)).astype(npd)
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            return getattr(
                np,
                {
                    "lt": "less",
                    "le": "less_equal",
                    "gt": "greater",
                    "ge": "greater_equal",
                    "eq": "equal",
                    "ne": "not_equal",
                }[op],
            )(a, b)
        if op == "and":
            return np.logical_and(a, b)
        if op == "or":
            return np.logical_or(a, b)
        if op == "xor":
            return np.logical_xor(a, b)
    raise ValueError(f"unknown binary op {op!r}")


def _trunc_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = np.asarray(a, np.int64), np.asarray(b, np.int64)
    safe = np.where(b64 == 0, 1, b64)
    q = np.abs(a64) // np.abs(safe)
    return np.where((a64 < 0) != (safe < 0), -q, q)


def _call(fn: str, args: list[np.ndarray], dtype: str) -> np.ndarray:
    x = args[0]
    npd = value_dtype(dtype)
    with np.errstate(all="ignore"):
        if fn == "exp":
            return np.exp(x).astype(npd)
        if fn == "log":
            return np.log(x).astype(npd)
        if fn == "sqrt":
            return np.sqrt(x).astype(npd)
        if fn == "rsqrt":
            return (1 / np.sqrt(x)).astype(npd)
        if fn == "erf":
            return _erf(x).astype(npd)
        if fn == "tanh":
            return np.tanh(x).astype(npd)
        if fn == "sigmoid":
            xf = x.astype(np.float64)
            return (0.5 * (1 + np.tanh(0.5 * xf))).astype(npd)
        if fn == "abs":
            return np.abs(x).astype(npd)
        if fn == "neg":
            return np.negative(x).astype(npd)
        if fn == "floor":
            return np.floor(x).astype(npd)
        if fn == "ceil":
            return np.ceil(x).astype(npd)
        if fn == "round":
            return np.rint(x).astype(npd)
        if fn == "sin":
            return np.sin(x).astype(npd)
        if fn == "cos":
            return np.cos(x).astype(npd)
        if fn == "not":
            return np.logical_not(x)
        if fn == "isnan":
            return np.isnan(x) if is_float(dtype) else np.zeros(np.shape(x), bool)
        if fn == "isinf":
            return np.isinf(x) if is_float(dtype) else np.zeros(np.shape(x), bool)
        if fn == "fmod":
            return np.fmod(x, args[1]).astype(npd)
    raise ValueError(f"unknown function {fn!r}")


def _erf(x: np.ndarray) -> np.ndarray:
    """Vectorised erf (no scipy): the Chebyshev-fitted erfc of Numerical Recipes, whose
    relative error is below 1.2e-7 everywhere -- well inside the fp32 threshold."""
    z = np.abs(np.asarray(x, dtype=np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (
        -z * z
        - 1.26551223
        + t
        * (
            1.00002368
            + t
            * (
                0.37409196
                + t
                * (
                    0.09678418
                    + t
                    * (
                        -0.18628806
                        + t
                        * (
                            0.27886807
                            + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))
                        )
                    )
                )
            )
        )
    )
    erfc = t * np.exp(poly)
    return np.where(np.asarray(x) >= 0, 1.0 - erfc, erfc - 1.0)
