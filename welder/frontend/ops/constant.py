"""Operators whose result is known at import time, and pure aliases."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import numpy_helper

from welder.errors import ModelError
from welder.frontend.registry import LowerContext, Tensor, array_dtype, register
from welder.ir.interpret import np_dtype


def filled(
    ctx: LowerContext, shape: Sequence[int], value: int | float | bool, dtype: str, hint: str = ""
) -> Tensor:
    """A tensor of one repeated value, as a compute without loads.

    Emitted as a compute rather than an array so that a large fill costs nothing in the
    weights: the importer folds it into a constant when it is small and its node's inputs
    are constant, with the same size budget it applies to every other fold.
    """
    return ctx.compute(shape, lambda *_: ctx.scalar(value, dtype), hint)


@register("Identity", "Dropout")
def identity(ctx: LowerContext) -> list[Tensor]:
    """Both alias their input; Dropout's mask output is a fill.

    In inference the mask keeps everything (all true).  Before opset 12 onnxruntime, which
    model outputs are checked against, reports an all-false mask instead; we follow it.
    """
    x = ctx.input(0)
    if ctx.op_type == "Dropout" and ctx.has_input(2):
        training = ctx.const_input(2, "training_mode")
        if bool(training):
            raise ctx.fail("training_mode input is true; only inference is supported")
    outs = [x]
    if ctx.output_used(1):
        outs.append(filled(ctx, x.shape, ctx.opset >= 12, "bool", "mask"))
    return outs


@register("Constant")
def constant(ctx: LowerContext) -> Tensor:
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        v = ctx.attr(key, None)
        if v is None:
            continue
        if key == "value":
            arr = numpy_helper.to_array(v)
        elif key.startswith("value_float"):
            arr = np.asarray(v, dtype=np.float32)
        else:
            arr = np.asarray(v, dtype=np.int64)
        return ctx.constant(arr)
    raise ctx.fail("only tensor, float(s) and int(s) values are supported")


@register("Shape")
def shape(ctx: LowerContext) -> Tensor:
    dims = list(ctx.input(0).shape)
    rank = len(dims)
    start = ctx.attr("start", 0)
    end = ctx.attr("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return ctx.constant(np.asarray(dims[start:end], dtype=np.int64))


@register("Size")
def size(ctx: LowerContext) -> Tensor:
    return ctx.constant(np.asarray(ctx.input(0).size, dtype=np.int64))


def _scalar_input(ctx: LowerContext, k: int, what: str) -> np.ndarray:
    value = ctx.const_input(k, what)
    if value.size != 1:
        raise ModelError(f"{ctx.label}: {what} must be a scalar, got shape {list(value.shape)}")
    return value.reshape(())


@register("Range")
def range_op(ctx: LowerContext) -> Tensor:
    """``start + k * delta`` for ``k < max(ceil((limit - start) / delta), 0)``.

    The difference is taken in the input type and the division in double precision, which
    is how onnxruntime sizes the output.
    """
    start, limit, delta = (_scalar_input(ctx, k, w) for k, w in enumerate(("start", "limit", "delta")))
    dtype = array_dtype(start, ctx.label)
    if dtype == "bool" or limit.dtype != start.dtype or delta.dtype != start.dtype:
        raise ModelError(f"{ctx.label}: start, limit and delta must share one numeric type")
    if delta == 0:
        raise ModelError(f"{ctx.label}: delta must be non-zero")
    count = max(math.ceil(float(limit - start) / float(delta)), 0)
    ctx.check_fits((count,), dtype)
    wide = np.float64 if np.issubdtype(start.dtype, np.floating) else np.int64
    values = start.astype(wide) + np.arange(count, dtype=wide) * delta.astype(wide)
    return ctx.constant(values.astype(np_dtype(dtype)))


@register("ConstantOfShape")
def constant_of_shape(ctx: LowerContext) -> Tensor:
    dims = [int(d) for d in ctx.const_input(0, "input").reshape(-1)]
    if min(dims, default=0) < 0:
        raise ModelError(f"{ctx.label}: negative dimension in shape {dims}")
    attr = ctx.attr("value", None)
    value = numpy_helper.to_array(attr) if attr is not None else np.zeros(1, np.float32)
    if value.size != 1:
        raise ModelError(f"{ctx.label}: value must hold one element, got shape {list(value.shape)}")
    return filled(ctx, dims, value.reshape(()).item(), array_dtype(value, ctx.label))
