"""Operators whose result is known at import time, and pure aliases."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from welder.frontend.registry import LowerContext, Tensor, register


@register("Identity", "Dropout")
def identity(ctx: LowerContext) -> list[Tensor]:
    """Both alias their input; Dropout's mask output (inference: all true) is a constant."""
    x = ctx.input(0)
    if ctx.op_type == "Dropout" and ctx.attr("training_mode", 0):
        raise ctx.fail("training_mode=1 is not supported (inference only)")
    if ctx.op_type == "Dropout" and ctx.has_input(2):
        training = ctx.const_input(2, "training_mode")
        if bool(training):
            raise ctx.fail("training_mode input is true; only inference is supported")
    outs = [x]
    if ctx.output_used(1):
        outs.append(ctx.constant(np.ones(x.shape, dtype=np.bool_), "mask"))
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
