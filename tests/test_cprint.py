"""Printing with shared subexpressions (CPrinter.value): it takes only what the expression
always evaluates, and the printed C computes what the plain form computes, reading nothing
the plain form would not read."""

from __future__ import annotations

import subprocess

import numpy as np
from kernel_fixtures import EMULATOR
from scalar_eval import eval_expr

from welder.codegen.cprint import CPrinter, repeated_subexpressions
from welder.ir.expr import Expr, Load, Var, binary, call, cast, const, select

I = Var("i")
A = np.array([0.5, -1.25, 2.0, 3.5, -0.75, 1.0, 4.25, -2.5], dtype=np.float32)


def at(index: Expr) -> Load:
    return Load("a", (index,), "float32")


def printer() -> CPrinter:
    return CPrinter(lambda ld, p: f"at({p(ld.indices[0])})", nonneg={"i"})


# a[i] only where i < 8: read in a Select's branch, twice, and nowhere else
INSIDE = binary("lt", I, const(8))
PADDED = select(INSIDE, at(I), const(0.0, "float32"))
WRAPPED = binary("mod", binary("add", binary("mul", I, const(3)), const(1)), const(8))
FLOOR = call("floor", binary("div", cast(I, "float32"), const(3.0, "float32")))
EXPR = (
    PADDED * PADDED
    + at(WRAPPED) * at(WRAPPED)
    + select(INSIDE, at(I), const(1.0, "float32"))
    + FLOOR * FLOOR
    - FLOOR
)


def test_only_repeats_always_evaluated_are_shared():
    shared = repeated_subexpressions(EXPR)
    # the padded read as a whole (both occurrences unconditional), its condition (also the
    # third Select's), the wrapped read and the floor; not a[i] (only in branches) and not
    # the wrapped index (only inside the wrapped read, computed once with it)
    assert set(shared) == {INSIDE, PADDED, at(WRAPPED), FLOOR}
    assert at(I) not in shared and WRAPPED not in shared
    assert shared.index(INSIDE) < shared.index(PADDED), "a part is bound before what contains it"
    # the right side of && is conditional, of the eager & not
    small = binary("lt", at(WRAPPED), const(1.0, "float32"))
    twice = binary("or", binary("and", binary("gt", I, const(2)), small), small)
    assert repeated_subexpressions(twice) == []
    assert repeated_subexpressions(twice, eager_logic=True) == [small]


def test_an_expression_without_repeats_prints_plainly():
    e = at(WRAPPED) * const(2.0, "float32") + FLOOR
    assert printer().value(e) == printer()(e)


HARNESS = """
#include <cmath>
#include <cstdio>
#include <cstdlib>
static const float a_data[8] = {%s};
static float at(int k) {
  if (k < 0 || k >= 8) { std::fprintf(stderr, "read a[%%d]\\n", k); std::exit(3); }
  return a_data[k];
}
int main() {
  for (int i = 0; i < 12; ++i) {
    const float plain = %s;
    const float shared = %s;
    std::printf("%%d %%.9g %%.9g\\n", i, plain, shared);
  }
}
"""


@EMULATOR
def test_shared_form_computes_the_plain_value_and_reads_nothing_more(tmp_path):
    p = printer()
    shared = p.value(EXPR)
    assert shared.startswith("[&]") and shared.count("const auto") == 4
    src = tmp_path / "cse.cpp"
    src.write_text(HARNESS % (", ".join(f"{v!r}f" for v in A.tolist()), p(EXPR), shared))
    exe = tmp_path / "cse"
    subprocess.run(["g++", "-std=c++17", "-O1", str(src), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, f"the shared form read outside the tensor: {run.stderr}"
    rows = [line.split() for line in run.stdout.splitlines()]
    assert len(rows) == 12
    for i, plain, value in rows:
        expected = eval_expr(EXPR, {"i": int(i)}, {"a": A})
        assert float(value) == float(plain)
        assert np.isclose(float(value), expected, rtol=1e-6), (i, value, expected)
