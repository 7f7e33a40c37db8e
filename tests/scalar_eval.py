"""A deliberately naive evaluator: one Python scalar at a time, loops over every point.

It shares no code with welder.ir.interpret, so agreement between the two is evidence
that the vectorised interpreter is right.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from welder.ir.compute import Compute
from welder.ir.expr import Binary, Call, Cast, Const, Expr, Load, Select, Var

_FLOAT = ("float16", "float32", "float64")


def eval_expr(e: Expr, env: dict[str, int], tensors: dict[str, np.ndarray]):
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Load):
        idx = tuple(int(eval_expr(i, env, tensors)) for i in e.indices)
        return tensors[e.tensor][idx].item()
    if isinstance(e, Cast):
        v = eval_expr(e.x, env, tensors)
        if e.dtype == "bool":
            return bool(v)
        if e.dtype in _FLOAT:
            return float(v)
        return int(v)  # int() truncates towards zero, like C
    if isinstance(e, Select):
        c = eval_expr(e.cond, env, tensors)
        return eval_expr(e.a, env, tensors) if c else eval_expr(e.b, env, tensors)
    if isinstance(e, Binary):
        a, b = eval_expr(e.a, env, tensors), eval_expr(e.b, env, tensors)
        return _binary(e.op, a, b, e.a.dtype)
    if isinstance(e, Call):
        args = [eval_expr(a, env, tensors) for a in e.args]
        return _call(e.fn, args)
    raise TypeError(e)


def _binary(op, a, b, dtype):
    if op == "div" and dtype not in _FLOAT:
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    return {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "div": lambda: a / b if b != 0 else math.copysign(math.inf, a) if a else math.nan,
        "floordiv": lambda: a // b if dtype not in _FLOAT else math.floor(a / b),
        "mod": lambda: a % b,
        "max": lambda: max(a, b),
        "min": lambda: min(a, b),
        "pow": lambda: a**b,
        "lt": lambda: a < b,
        "le": lambda: a <= b,
        "gt": lambda: a > b,
        "ge": lambda: a >= b,
        "eq": lambda: a == b,
        "ne": lambda: a != b,
        "and": lambda: a and b,
        "or": lambda: a or b,
        "xor": lambda: a != b,
    }[op]()


def _call(fn, args):
    x = args[0]
    return {
        "exp": lambda: math.exp(x),
        "log": lambda: math.log(x),
        "sqrt": lambda: math.sqrt(x),
        "rsqrt": lambda: 1 / math.sqrt(x),
        "erf": lambda: math.erf(x),
        "tanh": lambda: math.tanh(x),
        "sigmoid": lambda: 1 / (1 + math.exp(-x)),
        "abs": lambda: abs(x),
        "neg": lambda: -x,
        "floor": lambda: math.floor(x),
        "ceil": lambda: math.ceil(x),
        "round": lambda: round(x),
        "sin": lambda: math.sin(x),
        "cos": lambda: math.cos(x),
        "not": lambda: not x,
        "isnan": lambda: math.isnan(x),
        "isinf": lambda: math.isinf(x),
        "fmod": lambda: math.fmod(x, args[1]),
    }[fn]()


def eval_compute(c: Compute, tensors: dict[str, np.ndarray]) -> np.ndarray:
    out = np.zeros(c.shape, dtype=np.float64 if c.dtype in _FLOAT else object)
    for point in itertools.product(*(range(a.extent) for a in c.axes)):
        env = {a.name: p for a, p in zip(c.axes, point)}
        if c.reduce_op is None:
            out[point] = eval_expr(c.body, env, tensors)
            continue
        values = []
        for rpoint in itertools.product(*(range(a.extent) for a in c.reduce_axes)):
            env.update({a.name: p for a, p in zip(c.reduce_axes, rpoint)})
            values.append(eval_expr(c.body, env, tensors))
        out[point] = {
            "sum": lambda v: sum(v),
            "prod": math.prod,
            "max": max,
            "min": min,
            "argmax": lambda v: max(range(len(v)), key=lambda k: (v[k], -k)),
            "argmin": lambda v: min(range(len(v)), key=lambda k: (v[k], k)),
        }[c.reduce_op](values)
    return out
