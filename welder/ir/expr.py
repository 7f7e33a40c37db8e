"""Index and value expressions of the tensor-expression IR.

Every later stage walks these trees: the interpreter evaluates them with numpy, tile
propagation bounds them with interval arithmetic, and code generation prints them as C.
They are immutable and compare structurally, so identical subgraphs hash identically and
tests can compare expressions directly.

Two kinds of integers are kept apart on purpose: ``index`` is the type of loop axes and of
all address arithmetic (32-bit in generated code), while ``int64``/``int32`` are tensor
data.  A data value becomes an index through an explicit ``Cast`` where the lowering
proves it in range, and through :class:`DataIndex` where only the input data decide (Gather's
indices): that node carries the dimension's extent and the ONNX node it came from, so every
back end can check or clamp it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

INDEX = "index"
BOOL = "bool"
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
#: The 16-bit floats: stored narrow, computed in float32 by every back end (loads widen,
#: stores and explicit casts round to nearest even).
HALF_DTYPES = frozenset({"float16", "bfloat16"})
INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
DTYPES = FLOAT_DTYPES | INT_DTYPES | {BOOL, INDEX}

ARITH_OPS = frozenset({"add", "sub", "mul", "div", "floordiv", "mod", "max", "min", "pow"})
COMPARE_OPS = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
LOGIC_OPS = frozenset({"and", "or", "xor"})
BINARY_OPS = ARITH_OPS | COMPARE_OPS | LOGIC_OPS

# Math functions a body may call; the interpreter, the code generator and the CPU emulator
# each implement exactly this set.  Composite activations (GELU, softplus, ...) are built
# from these by the lowerings so the back ends stay small.
CALLS: dict[str, int] = {
    "exp": 1,
    "log": 1,
    "sqrt": 1,
    "rsqrt": 1,
    "erf": 1,
    "tanh": 1,
    "sigmoid": 1,
    "abs": 1,
    "neg": 1,
    "floor": 1,
    "ceil": 1,
    "round": 1,
    "sin": 1,
    "cos": 1,
    "not": 1,
    "isnan": 1,
    "isinf": 1,
    "fmod": 2,
}
PREDICATE_CALLS = frozenset({"not", "isnan", "isinf"})
#: Calls that GPUs evaluate on their special-function units or as polynomials: many times
#: the cost of an add, worth computing once rather than again for every reader.
TRANSCENDENTAL_CALLS = frozenset({"exp", "log", "sqrt", "rsqrt", "erf", "tanh", "sigmoid", "sin", "cos"})


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_half(dtype: str) -> bool:
    """Whether ``dtype`` is a 16-bit float (:data:`HALF_DTYPES`)."""
    return dtype in HALF_DTYPES


def is_integer(dtype: str) -> bool:
    return dtype in INT_DTYPES or dtype == INDEX


class Expr:
    """Base of all expressions.  Python operators build new expressions; Python scalars
    on either side are converted to constants of the other operand's dtype."""

    __slots__ = ()
    dtype: str

    def __add__(self, o: ExprLike) -> Expr:
        return binary("add", self, o)

    def __radd__(self, o: ExprLike) -> Expr:
        return binary("add", o, self)

    def __sub__(self, o: ExprLike) -> Expr:
        return binary("sub", self, o)

    def __rsub__(self, o: ExprLike) -> Expr:
        return binary("sub", o, self)

    def __mul__(self, o: ExprLike) -> Expr:
        return binary("mul", self, o)

    def __rmul__(self, o: ExprLike) -> Expr:
        return binary("mul", o, self)

    def __truediv__(self, o: ExprLike) -> Expr:
        return binary("div", self, o)

    def __rtruediv__(self, o: ExprLike) -> Expr:
        return binary("div", o, self)

    def __floordiv__(self, o: ExprLike) -> Expr:
        return binary("floordiv", self, o)

    def __mod__(self, o: ExprLike) -> Expr:
        return binary("mod", self, o)

    def __neg__(self) -> Expr:
        return call("neg", self)

    def __pow__(self, o: ExprLike) -> Expr:
        return binary("pow", self, o)

    def children(self) -> tuple[Expr, ...]:
        return ()

    def __str__(self) -> str:
        return format_expr(self)


ExprLike = Expr | int | float | bool


@dataclass(frozen=True, eq=True, repr=False)
class Var(Expr):
    """A loop axis of the enclosing Compute (spatial or reduce)."""

    name: str
    dtype: ClassVar[str] = INDEX

    def __repr__(self) -> str:
        return f"Var({self.name})"


@dataclass(frozen=True, eq=True, repr=False)
class Const(Expr):
    value: int | float | bool
    dtype: str = INDEX

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        v = self.value
        if self.dtype == BOOL:
            v = bool(v)
        elif is_integer(self.dtype):
            if isinstance(v, float) and not v.is_integer():
                raise TypeError(f"non-integral constant {v} for dtype {self.dtype}")
            v = int(v)
        else:
            v = float(v)
        object.__setattr__(self, "value", v)

    def __repr__(self) -> str:
        return f"Const({self.value!r}, {self.dtype})"


@dataclass(frozen=True, eq=True, repr=False)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    dtype: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.op not in BINARY_OPS:
            raise ValueError(f"unknown binary op {self.op!r}")
        if self.a.dtype != self.b.dtype:
            raise TypeError(f"{self.op}: operand dtypes differ ({self.a.dtype} vs {self.b.dtype})")
        if self.op in LOGIC_OPS and self.a.dtype != BOOL:
            raise TypeError(f"{self.op} needs bool operands, got {self.a.dtype}")
        out = BOOL if self.op in COMPARE_OPS else self.a.dtype
        object.__setattr__(self, "dtype", out)

    def children(self) -> tuple[Expr, ...]:
        return (self.a, self.b)

    def __repr__(self) -> str:
        return f"Binary({self.op}, {self.a!r}, {self.b!r})"


@dataclass(frozen=True, eq=True, repr=False)
class Call(Expr):
    fn: str
    args: tuple[Expr, ...]
    dtype: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.fn not in CALLS:
            raise ValueError(f"unknown function {self.fn!r}")
        if len(self.args) != CALLS[self.fn]:
            raise TypeError(f"{self.fn} takes {CALLS[self.fn]} argument(s)")
        if self.fn == "not" and self.args[0].dtype != BOOL:
            raise TypeError("not needs a bool operand")
        out = BOOL if self.fn in PREDICATE_CALLS else self.args[0].dtype
        object.__setattr__(self, "dtype", out)

    def children(self) -> tuple[Expr, ...]:
        return self.args

    def __repr__(self) -> str:
        return f"Call({self.fn}, {', '.join(map(repr, self.args))})"


@dataclass(frozen=True, eq=True, repr=False)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr
    dtype: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.cond.dtype != BOOL:
            raise TypeError(f"select condition must be bool, got {self.cond.dtype}")
        if self.a.dtype != self.b.dtype:
            raise TypeError(f"select branches differ ({self.a.dtype} vs {self.b.dtype})")
        object.__setattr__(self, "dtype", self.a.dtype)

    def children(self) -> tuple[Expr, ...]:
        return (self.cond, self.a, self.b)

    def __repr__(self) -> str:
        return f"Select({self.cond!r}, {self.a!r}, {self.b!r})"


@dataclass(frozen=True, eq=True, repr=False)
class Cast(Expr):
    x: Expr
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)

    def children(self) -> tuple[Expr, ...]:
        return (self.x,)

    def __repr__(self) -> str:
        return f"Cast({self.x!r}, {self.dtype})"


@dataclass(frozen=True, eq=True, repr=False)
class Load(Expr):
    """Element ``tensor[indices]``; indices are ``index`` expressions, possibly containing
    loads themselves (data-dependent addressing)."""

    tensor: str
    indices: tuple[Expr, ...]
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        for i in self.indices:
            if i.dtype != INDEX:
                raise TypeError(f"index of {self.tensor!r} has dtype {i.dtype}, expected index")

    def children(self) -> tuple[Expr, ...]:
        return self.indices

    def __repr__(self) -> str:
        return f"Load({self.tensor}, {list(self.indices)!r})"


@dataclass(frozen=True, eq=True, repr=False)
class DataIndex(Expr):
    """A tensor value used as a position along a dimension of ``extent``.

    Values in ``[-extent, -1]`` count from the end, as ONNX's index operators allow; any
    other value outside ``[0, extent)`` is bad input.  The interpreter and the emulator raise
    an error naming ``origin`` (the ONNX node), the value and the range; GPU kernels clamp it
    into the dimension so that no input makes them touch memory outside a tensor.
    ``origin`` serves messages only: it is left out of equality and printing so that
    repeated layers still compare, hash and tune alike.
    """

    value: Expr
    extent: int
    origin: str = field(default="", compare=False)
    dtype: ClassVar[str] = INDEX

    def __post_init__(self) -> None:
        if self.value.dtype not in INT_DTYPES:
            raise TypeError(f"a data index needs integer data, got {self.value.dtype}")
        if self.extent < 1:
            raise ValueError(f"a data index into an empty dimension ({self.origin or 'unnamed'})")

    def children(self) -> tuple[Expr, ...]:
        return (self.value,)

    def __repr__(self) -> str:
        return f"DataIndex({self.value!r}, {self.extent})"


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise TypeError(f"unknown dtype {dtype!r}")


# ---------------------------------------------------------------------------------------
# Construction with light simplification.  Only rewrites that are exact for every dtype
# are applied, so simplified and unsimplified trees evaluate identically.


def const(value: int | float | bool, dtype: str = INDEX) -> Const:
    return Const(value, dtype)


def as_expr(x: ExprLike, like: Expr | str | None = None) -> Expr:
    """Convert a Python scalar to a constant with the dtype of ``like`` (an expression or a
    dtype name); expressions pass through unchanged."""
    if isinstance(x, Expr):
        return x
    if like is None:
        dtype = BOOL if isinstance(x, bool) else INDEX if isinstance(x, int) else "float32"
    else:
        dtype = like if isinstance(like, str) else like.dtype
    return Const(x, dtype)


def _const_value(e: Expr) -> int | float | bool | None:
    return e.value if isinstance(e, Const) else None


def binary(op: str, a: ExprLike, b: ExprLike) -> Expr:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        a = as_expr(a)
    a = as_expr(a, b if isinstance(b, Expr) else None)
    b = as_expr(b, a)
    ca, cb = _const_value(a), _const_value(b)
    if ca is not None and cb is not None and op in ARITH_OPS and is_integer(a.dtype):
        return Const(_fold_int(op, ca, cb), a.dtype)
    if is_integer(a.dtype) or op in ("add", "sub", "mul"):
        # x + 0, x - 0, x * 1, x // 1 and x * 0 (index only) are exact.
        if op == "add" and ca == 0 and not isinstance(ca, bool):
            return b
        if op in ("add", "sub") and cb == 0 and not isinstance(cb, bool):
            return a
        if op == "mul" and cb == 1:
            return a
        if op == "mul" and ca == 1:
            return b
        if op in ("floordiv", "div") and cb == 1 and is_integer(a.dtype):
            return a
        if a.dtype == INDEX and op == "mul" and (ca == 0 or cb == 0):
            return Const(0, INDEX)
        if a.dtype == INDEX and op == "mod" and cb == 1:
            return Const(0, INDEX)
    if a.dtype == INDEX and op == "add":
        # (x // c) * c + x % c -> x: a flat index split into digits and joined again (a
        # reshape read through another); exact, as floordiv and mod both floor.
        joined = _joined(a, b) or _joined(b, a)
        if joined is not None:
            return joined
    if a.dtype == INDEX and op in ("add", "sub") and isinstance(cb, int) and isinstance(a, Binary):
        # (x + c1) + c2 -> x + (c1 + c2): keeps conv/slice offsets as one constant.
        inner = _const_value(a.b)
        if a.op in ("add", "sub") and isinstance(inner, int):
            total = (inner if a.op == "add" else -inner) + (cb if op == "add" else -cb)
            return binary("add", a.a, total) if total >= 0 else binary("sub", a.a, -total)
    return Binary(op, a, b)


def _joined(high: Expr, low: Expr) -> Expr | None:
    """``x`` where ``high + low`` is ``(x // c) * c + x % c`` for a constant ``c``, else None."""
    if not (isinstance(high, Binary) and high.op == "mul" and isinstance(low, Binary) and low.op == "mod"):
        return None
    quotient, c = high.a, high.b
    if (
        isinstance(c, Const)
        and isinstance(quotient, Binary)
        and quotient.op == "floordiv"
        and quotient.a == low.a
        and quotient.b == c
        and low.b == c
    ):
        return low.a
    return None


def _fold_int(op: str, a: int, b: int) -> int:
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "floordiv":
        return a // b
    if op == "div":  # C semantics: truncate towards zero
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    if op == "mod":
        return a % b
    if op == "max":
        return max(a, b)
    if op == "min":
        return min(a, b)
    return a**b


def call(fn: str, *args: ExprLike) -> Expr:
    first = next((x for x in args if isinstance(x, Expr)), None)
    return Call(fn, tuple(as_expr(x, first) for x in args))


def select(cond: Expr, a: ExprLike, b: ExprLike) -> Expr:
    a = as_expr(a, b if isinstance(b, Expr) else None)
    b = as_expr(b, a)
    c = _const_value(cond)
    if c is not None:
        return a if c else b
    if a == b:
        return a
    return Select(cond, a, b)


def cast(x: ExprLike, dtype: str) -> Expr:
    x = as_expr(x, dtype)
    if x.dtype == dtype:
        return x
    if isinstance(x, Const) and is_integer(x.dtype) and is_integer(dtype):
        return Const(x.value, dtype)
    return Cast(x, dtype)


def maximum(a: ExprLike, b: ExprLike) -> Expr:
    return binary("max", a, b)


def minimum(a: ExprLike, b: ExprLike) -> Expr:
    return binary("min", a, b)


def lt(a: ExprLike, b: ExprLike) -> Expr:
    return binary("lt", a, b)


def le(a: ExprLike, b: ExprLike) -> Expr:
    return binary("le", a, b)


def gt(a: ExprLike, b: ExprLike) -> Expr:
    return binary("gt", a, b)


def ge(a: ExprLike, b: ExprLike) -> Expr:
    return binary("ge", a, b)


def eq(a: ExprLike, b: ExprLike) -> Expr:
    return binary("eq", a, b)


def ne(a: ExprLike, b: ExprLike) -> Expr:
    return binary("ne", a, b)


def logical_and(*conds: Expr) -> Expr:
    """Conjunction that drops constant-true terms (bounds checks that are always true)."""
    terms = [c for c in conds if _const_value(c) is not True]
    if any(_const_value(c) is False for c in terms):
        return Const(False, BOOL)
    if not terms:
        return Const(True, BOOL)
    out = terms[0]
    for c in terms[1:]:
        out = Binary("and", out, c)
    return out


def logical_or(a: Expr, b: Expr) -> Expr:
    return binary("or", a, b)


def in_range(x: Expr, lo: int, hi: int) -> Expr:
    """``lo <= x < hi`` as a bool expression (used for padding and bounds guards)."""
    return logical_and(ge(x, lo), lt(x, hi))


# ---------------------------------------------------------------------------------------
# Traversal


def row_major_offset(indices: Sequence[Expr], shape: Sequence[int]) -> Expr:
    """Flat offset of ``indices`` in a row-major tensor of ``shape``, as an index expression."""
    flat: Expr = Const(0)
    stride = 1
    for index, extent in zip(reversed(indices), reversed(shape)):
        flat = flat + index * stride
        stride *= extent
    return flat


def walk(e: Expr) -> Iterator[Expr]:
    """Pre-order traversal of every node in ``e``."""
    stack = [e]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children()))


def loads(e: Expr) -> list[Load]:
    return [n for n in walk(e) if isinstance(n, Load)]


def free_vars(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Var)}


#: Calls whose result is never negative, whatever their argument.
_NONNEGATIVE_CALLS = frozenset({"exp", "sqrt", "rsqrt", "abs", "sigmoid"})
#: Arithmetic that keeps two nonnegative operands nonnegative.
_NONNEGATIVE_OPS = frozenset({"add", "mul", "div", "max", "min", "pow"})


def nonnegative(e: Expr) -> bool:
    """Whether ``e`` is provably never negative (NaN aside): an exponential, a ReLU, a
    square.  A conservative sign analysis: False means only that it could not tell."""
    if isinstance(e, Const):
        return e.dtype != BOOL and e.value >= 0
    if isinstance(e, Call):
        return e.fn in _NONNEGATIVE_CALLS
    if isinstance(e, Cast):
        return nonnegative(e.x)
    if isinstance(e, Select):
        return nonnegative(e.a) and nonnegative(e.b)
    if isinstance(e, Binary):
        if e.op == "max" and any(isinstance(side, Const) and nonnegative(side) for side in (e.a, e.b)):
            return True  # a ReLU (a side that may be NaN would not do: max drops a NaN)
        if e.op == "mul" and e.a == e.b:
            return True
        return e.op in _NONNEGATIVE_OPS and nonnegative(e.a) and nonnegative(e.b)
    return False


def rewrite(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Bottom-up rebuild: ``fn`` sees each node once, after its children were rewritten, and
    returns a replacement, or None to keep the (rebuilt) node.

    ``fn`` sees the node as rebuilt, before the constructors simplify it: a simplification
    may fold a node into one of its rewritten parts (``x * 1``, ``select(true, a, b)``), and
    ``fn`` applied to that part again would rewrite it twice -- a substitution ``{i0: i0 //
    4}`` would turn an index that folds to ``i0`` into ``i0 // 4``."""
    if isinstance(e, (Var, Const)):
        out = fn(e)
        return e if out is None else out
    if isinstance(e, Binary):
        a, b = rewrite(e.a, fn), rewrite(e.b, fn)
        raw: Expr = Binary(e.op, a, b)
        build = lambda: binary(e.op, a, b)  # noqa: E731
    elif isinstance(e, Call):
        args = tuple(rewrite(x, fn) for x in e.args)
        raw = Call(e.fn, args)
        build = lambda: call(e.fn, *args)  # noqa: E731
    elif isinstance(e, Select):
        cond, a, b = rewrite(e.cond, fn), rewrite(e.a, fn), rewrite(e.b, fn)
        raw = Select(cond, a, b)
        build = lambda: select(cond, a, b)  # noqa: E731
    elif isinstance(e, Cast):
        x = rewrite(e.x, fn)
        raw = Cast(x, e.dtype)
        build = lambda: cast(x, e.dtype)  # noqa: E731
    elif isinstance(e, Load):
        raw = Load(e.tensor, tuple(rewrite(i, fn) for i in e.indices), e.dtype)
        build = lambda: raw  # noqa: E731
    elif isinstance(e, DataIndex):
        raw = DataIndex(rewrite(e.value, fn), e.extent, e.origin)
        build = lambda: raw  # noqa: E731
    else:
        raise TypeError(f"not an expression: {e!r}")
    out = fn(raw)
    return build() if out is None else out


def substitute(e: Expr, mapping: dict[str, Expr]) -> Expr:
    """Replace axis variables by expressions."""
    if not mapping:
        return e
    return rewrite(e, lambda n: mapping.get(n.name) if isinstance(n, Var) else None)


def rename_tensors(e: Expr, mapping: dict[str, str]) -> Expr:
    if not mapping:
        return e

    def fn(n: Expr) -> Expr | None:
        if isinstance(n, Load) and n.tensor in mapping:
            return Load(mapping[n.tensor], n.indices, n.dtype)
        return None

    return rewrite(e, fn)


# ---------------------------------------------------------------------------------------
# Printing (einsum-like notation used in model.json and error messages)

_INFIX = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "div": "/",
    "floordiv": "//",
    "mod": "%",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "eq": "==",
    "ne": "!=",
    "and": "&&",
    "or": "||",
    "xor": "^",
}
_NAME_RE = re.compile(r"^[A-Za-z_][\w.:/\-]*$")


def format_tensor_name(name: str) -> str:
    return name if _NAME_RE.match(name) else '"' + name.replace('"', '\\"') + '"'


def format_expr(e: Expr) -> str:
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        if e.dtype in (INDEX, BOOL):
            return str(e.value).lower() if e.dtype == BOOL else str(e.value)
        v = e.value
        text = repr(v) if not (isinstance(v, float) and math.isinf(v)) else ("inf" if v > 0 else "-inf")
        return text if e.dtype in ("float32",) else f"{e.dtype}({text})"
    if isinstance(e, Binary):
        if e.op in _INFIX:
            return f"({format_expr(e.a)} {_INFIX[e.op]} {format_expr(e.b)})"
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(format_expr(a) for a in e.args)})"
    if isinstance(e, Select):
        return f"select({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"{e.dtype}({format_expr(e.x)})"
    if isinstance(e, Load):
        return f"{format_tensor_name(e.tensor)}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, DataIndex):
        return f"index({format_expr(e.value)}, {e.extent})"
    raise TypeError(f"not an expression: {e!r}")
