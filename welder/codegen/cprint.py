"""Printing IR expressions as C expressions.

Value arithmetic on ``float16`` and ``bfloat16`` data is carried out in ``float`` (loads
widen, stores narrow, an explicit Cast to a 16-bit float rounds to nearest even), so
fp16 and bf16 kernels accumulate and evaluate activations in fp32.  Index arithmetic is
``int``; floor division and modulo print as plain ``/`` and ``%`` only where both operands
are provably non-negative.  A data value used as an index prints as
``welder_index(value, extent, "node")`` (welder_math.cuh), which clamps on the GPU and
reports under the emulator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from welder.ir.expr import INDEX, Binary, Call, Cast, Const, DataIndex, Expr, Load, Select, Var, is_float


@dataclass(frozen=True)
class HalfFormat:
    """The CUDA names of a 16-bit float type (``cuda_fp16.h``, ``cuda_bf16.h``): kernels
    only ever convert it to and from float, so these are all the code needs."""

    storage: str  # the element type
    pair: str  # two elements in one 32-bit word
    to_float: str  # one element to float (exact)
    from_float: str  # float to one element, rounded to nearest even
    pair_from_float: str  # float to both elements of a pair
    pack2: str  # two floats to a pair (low, high), rounded to nearest even
    join2: str  # two elements to a pair (low, high)


HALF_FORMATS = {
    "float16": HalfFormat(
        "__half",
        "__half2",
        "__half2float",
        "__float2half",
        "__float2half2_rn",
        "__floats2half2_rn",
        "__halves2half2",
    ),
    "bfloat16": HalfFormat(
        "__nv_bfloat16",
        "__nv_bfloat162",
        "__bfloat162float",
        "__float2bfloat16",
        "__float2bfloat162_rn",
        "__floats2bfloat162_rn",
        "__halves2bfloat162",
    ),
}

# Storage type in memory, and the type arithmetic on the value happens in.
STORAGE_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float64": "double",
    "int64": "long long",
    "int32": "int",
    "int16": "short",
    "int8": "signed char",
    "uint8": "unsigned char",
    "uint16": "unsigned short",
    "uint32": "unsigned int",
    "uint64": "unsigned long long",
    "bool": "bool",
    INDEX: "int",
}
COMPUTE_TYPES = {**STORAGE_TYPES, **{dtype: "float" for dtype in HALF_FORMATS}}

_INFIX = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "eq": "==",
    "ne": "!=",
    "and": "&&",
    "or": "||",
    "xor": "!=",
}

_FLOAT_FN = {
    "exp": "expf",
    "log": "logf",
    "sqrt": "sqrtf",
    "rsqrt": "rsqrtf",
    "erf": "erff",
    "tanh": "tanhf",
    "abs": "fabsf",
    "floor": "floorf",
    "ceil": "ceilf",
    "round": "rintf",
    "sin": "sinf",
    "cos": "cosf",
    "fmod": "fmodf",
}

# Functions of 16-bit floats (computed in float, then rounded to 11 or 8 significant bits) by
# cheaper forms whose error stays far under the rounding: welder_exp16 is one ex2.approx, within
# 2 + 1.173 |x| float ulp, under 2^-6 of an fp16 ulp for every |x| < 88, where float's
# exponential is finite (results under 2^-126 flushed to zero), and of a difference
# (welder_exp16_sub, a softmax's exp(x - max)) with the two scaled by log2(e) apart, in one
# FFMA, within 2^-6 of an fp16 ulp for |x|, |max| under 64 (tests/test_fast_math.py);
# welder_erf16 is a rational fit within 5e-6 (welder_math.cuh).  Float keeps the exact forms
# (within 2 ulp): exact fp32 is what fp32 promises.
_FAST_16 = {"exp": "welder_exp16", "erf": "welder_erf16"}


# Longest node name a kernel carries into its error messages.
_ORIGIN_CHARS = 200


def c_string(text: str) -> str:
    """``text`` as a C string literal: printable ASCII kept, everything else (and the
    characters that could end or alter the literal) as three-digit octal escapes."""
    out = []
    for byte in text.encode():
        ch = chr(byte)
        if 0x20 <= byte < 0x7F and ch not in '"\\?':
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def literal(value: int | float | bool, dtype: str) -> str:
    """A C literal of the compute type of ``dtype``."""
    if dtype == "bool":
        return "true" if value else "false"
    if is_float(dtype):
        v = float(value)
        suffix = "" if dtype == "float64" else "f"
        if math.isinf(v):
            return ("" if v > 0 else "-") + ("INFINITY" if suffix else "(double)INFINITY")
        if math.isnan(v):
            return "NAN"
        text = repr(v)
        if "e" not in text and "." not in text:
            text += ".0"
        return text + suffix
    if dtype in ("int64",):
        return f"{int(value)}LL"
    if dtype in ("uint64",):
        return f"{int(value)}ULL"
    if dtype in ("uint32",):
        return f"{int(value)}U"
    return str(int(value))


def nonnegative(e: Expr, nonneg_vars: frozenset[str] | set[str]) -> bool:
    """Conservative: True only if ``e`` cannot be negative."""
    if isinstance(e, Var):
        return e.name in nonneg_vars
    if isinstance(e, Const):
        return e.value >= 0
    if isinstance(e, DataIndex):
        return True
    if isinstance(e, Binary) and e.op in ("add", "mul", "floordiv", "mod", "max", "min"):
        a, b = nonnegative(e.a, nonneg_vars), nonnegative(e.b, nonneg_vars)
        if e.op == "max":
            return a or b
        return a and b
    return False


class CPrinter:
    """Prints expressions; ``load`` decides how a tensor element is addressed (global
    pointer, shared tile, staging buffer) and ``var`` names the loop variables."""

    def __init__(
        self,
        load: Callable[[Load, CPrinter], str],
        var: Mapping[str, str] | None = None,
        nonneg: frozenset[str] | set[str] = frozenset(),
        eager_logic: bool = False,
    ) -> None:
        self._load = load
        self._var = dict(var or {})
        self.nonneg = set(nonneg) | set(self._var.values()) | set(self._var)
        # "and" / "or" as C's & and | (both sides evaluated) rather than && and ||: nvcc
        # turns a short-circuit whose right side is costly into a branch, which ends the
        # basic block (the gathered copies want one block for their loads to be scheduled
        # together); the operands are side-effect free bools, so the value is the same.
        self.eager_logic = eager_logic
        self._bound: dict[Expr, str] = {}  # subexpressions printed as a name (see value)

    def __call__(self, e: Expr) -> str:
        return self.expr(e)

    def value(self, e: Expr) -> str:
        """``e`` with every subexpression that it always evaluates more than once computed
        once, into a local of an immediately called lambda (the plain expression where
        nothing repeats).  A stage's body printed as a tree repeats whatever its inlined
        producers share -- a bilinear Resize of a GELU evaluates the GELU and its
        coordinates at four corners, each coordinate a dozen times -- and a kernel unrolls it
        for every element a thread owns: nvcc's front end then spends most of a minute on a
        tensor-core kernel with such an epilogue.  Only subexpressions outside a Select's
        branches and a short-circuit's right side are taken: those the expression evaluates
        whatever its values, so computing them first changes no result and makes no access
        the expression would skip."""
        shared = repeated_subexpressions(e, self.eager_logic)
        if not shared:
            return self.expr(e)
        printer = CPrinter(self._load, self._var, self.nonneg, self.eager_logic)
        lets = []
        for k, sub in enumerate(shared):
            lets.append((f"cse{k}", printer.expr(sub)))
            printer._bound[sub] = f"cse{k}"
        text = printer.expr(e)
        # a printing rule may not print an operand as such (exp16_sub prints a difference's
        # sides): a local nothing reads is left out
        used = set(re.findall(r"\bcse\d+\b", " ".join([text, *(v for _, v in lets)])))
        body = " ".join(f"const auto {name} = {v};" for name, v in lets if name in used)
        return f"[&]() {{ {body} return {text}; }}()" if body else text

    def with_loads(self, values: Mapping[Load, str]) -> CPrinter:
        """This printer with the loads in ``values`` printed as the given C values (loads
        hoisted into registers); the variables and other loads as before."""
        outer = self._load
        return CPrinter(
            lambda ld, p: values[ld] if ld in values else outer(ld, p),
            self._var,
            self.nonneg,
            self.eager_logic,
        )

    def expr(self, e: Expr) -> str:
        if self._bound and e in self._bound:
            return self._bound[e]
        if isinstance(e, Var):
            return self._var.get(e.name, e.name)
        if isinstance(e, Const):
            return literal(e.value, e.dtype)
        if isinstance(e, Load):
            return self._load(e, self)
        if isinstance(e, Select):
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, Cast):
            return self._cast(e)
        if isinstance(e, Binary):
            return self._binary(e)
        if isinstance(e, Call):
            return self._call(e)
        if isinstance(e, DataIndex):
            value = self.expr(e.value)
            return f"welder_index((long long)({value}), {e.extent}, {c_string(e.origin[:_ORIGIN_CHARS])})"
        raise TypeError(f"cannot print {e!r}")

    def _cast(self, e: Cast) -> str:
        inner = self.expr(e.x)
        half = HALF_FORMATS.get(e.dtype)
        if half is not None:
            return f"{half.to_float}({half.from_float}((float)({inner})))"
        return f"(({COMPUTE_TYPES[e.dtype]})({inner}))"

    def _binary(self, e: Binary) -> str:
        a, b = self.expr(e.a), self.expr(e.b)
        dt = e.a.dtype
        if self.eager_logic and e.op in ("and", "or"):
            return f"({a} {'&' if e.op == 'and' else '|'} {b})"
        if e.op in _INFIX:
            return f"({a} {_INFIX[e.op]} {b})"
        if e.op == "div":
            return _divide(a, b, dt)
        if e.op in ("floordiv", "mod"):
            if is_float(dt):
                return f"floorf({a} / {b})" if e.op == "floordiv" else f"welder_fmod_floor({a}, {b})"
            if nonnegative(e.a, self.nonneg) and nonnegative(e.b, self.nonneg):
                return f"({a} {'/' if e.op == 'floordiv' else '%'} {b})"
            return f"welder_{e.op}({a}, {b})"
        if e.op in ("max", "min"):
            return f"welder_{e.op}({a}, {b})"
        if e.op == "pow":
            if dt == "float64":
                return f"pow({a}, {b})"
            if is_float(dt):
                return f"powf({a}, {b})"
            return f"welder_ipow({a}, {b})"
        raise ValueError(f"unknown binary op {e.op}")

    def _call(self, e: Call) -> str:
        args = [self.expr(a) for a in e.args]
        x = args[0]
        double = e.args[0].dtype == "float64"
        if e.fn == "neg":
            return f"(-{x})"
        if e.fn == "not":
            return f"(!{x})"
        if e.fn in ("isnan", "isinf"):
            return f"{e.fn}({x})" if is_float(e.args[0].dtype) else "false"
        dtype = e.args[0].dtype
        if e.fn == "sigmoid":
            if double:
                return f"(1.0 / (1.0 + exp(-{x})))"
            return _divide("1.0f", f"(1.0f + {_float_fn('exp', dtype)}(-{x}))", dtype)
        arg = e.args[0]
        if e.fn == "exp" and dtype in HALF_FORMATS and isinstance(arg, Binary) and arg.op == "sub":
            # a softmax's exp(x - max): one FFMA, x log2(e) - max log2(e), the row's term once
            return f"welder_exp16_sub({self.expr(arg.a)}, {self.expr(arg.b)})"
        fn = _float_fn(e.fn, dtype)
        if double:
            fn = fn[:-1]
        return f"{fn}({', '.join(args)})"


def repeated_subexpressions(e: Expr, eager_logic: bool = False) -> list[Expr]:
    """The subexpressions (not variables or constants) that ``e`` always evaluates at least
    twice, each before any that contains it.  A repeat is counted where it occurs outside
    every earlier occurrence of a larger repeat: the parts of a repeated subexpression that
    occur nowhere else are computed with it, once, and are not taken apart.  A Select's
    branches and the right side of ``and``/``or`` (unless ``eager_logic``, which prints both
    sides evaluated) are conditional: what occurs only there is not counted."""
    seen: dict[Expr, int] = {}
    order: list[Expr] = []

    def visit(x: Expr) -> None:
        if isinstance(x, (Var, Const)):
            return
        if x in seen:
            seen[x] += 1
            return
        seen[x] = 1
        for child in _always_evaluated(x, eager_logic):
            visit(child)
        order.append(x)

    visit(e)
    return [x for x in order if seen[x] > 1]


def _always_evaluated(e: Expr, eager_logic: bool) -> tuple[Expr, ...]:
    """The operands of ``e`` that its C form evaluates whatever the values."""
    if isinstance(e, Select):
        return (e.cond,)
    if isinstance(e, Binary) and e.op in ("and", "or") and not eager_logic:
        return (e.a,)
    return e.children()


def _divide(a: str, b: str, dtype: str) -> str:
    """C for ``a / b`` of ``dtype`` values.  fp16 values, computed in float, take the fast
    division (welder_div16: a reciprocal and a product, 2 ulp of float, exact once rounded to
    fp16; it differs only for divisors over 2^126, beyond fp16's range) instead of IEEE
    division's check and slow-path call, which ends a basic block at every element.  bf16's
    range reaches 2^126: it keeps the IEEE division, as float and double do."""
    return f"welder_div16({a}, {b})" if dtype == "float16" else f"({a} / {b})"


def _float_fn(fn: str, dtype: str) -> str:
    """The C function computing ``fn`` of a ``dtype`` value in float (see ``_FAST_16``)."""
    return _FAST_16.get(fn, _FLOAT_FN[fn]) if dtype in HALF_FORMATS else _FLOAT_FN[fn]
