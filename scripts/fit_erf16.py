"""Fit the rational erf that kernels use for 16-bit floats (welder_erf16 in
welder/codegen_templates/welder_math.cuh) and print its coefficients and errors.

erf(x) ~ x P(x^2) / Q(x^2), P of degree 4 and Q of degree 3 with Q(0) = 1, fitted for
relative error over (0, 4]: linearised least squares (x P - erf Q = 0, scaled by the last
Q) with Lawson's reweighting, which drives the weighted fit towards the minimax one.  The
result is evaluated in float32 as the kernel does: the input clamped to +-4 (past it the
fit's last term runs away) and the result to +-1, which the fit passes before 4, so that
erf saturates at exactly 1 as erff does (1 + erf(x) is then exactly 0 far left, as GELU
needs).

    python scripts/fit_erf16.py
"""

from __future__ import annotations

import math

import numpy as np

P_DEGREE, Q_DEGREE = 4, 3


def fit(iterations: int = 300) -> tuple[float, np.ndarray, np.ndarray]:
    """(max relative error, P's coefficients, Q's coefficients), lowest power first."""
    x = np.linspace(1e-4, 4.0, 20001)
    target = np.array([math.erf(v) for v in x])
    s = x * x
    weight = np.ones_like(x)
    q_last = np.ones_like(x)
    best = (math.inf, np.zeros(0), np.zeros(0))
    for _ in range(iterations):
        cols = [x * s**i for i in range(P_DEGREE + 1)] + [-target * s**j for j in range(1, Q_DEGREE + 1)]
        scale = target * q_last
        a = np.stack(cols, 1) / scale[:, None]
        root = np.sqrt(weight)
        c, *_ = np.linalg.lstsq(a * root[:, None], target / scale * root, rcond=None)
        p, q = c[: P_DEGREE + 1], np.concatenate([[1.0], c[P_DEGREE + 1 :]])
        q_last = np.polyval(q[::-1], s)
        rel = np.abs(x * np.polyval(p[::-1], s) / q_last - target) / target
        if rel.max() < best[0]:
            best = (float(rel.max()), p, q)
        weight = weight * rel
        weight /= weight.sum()
    return best


def evaluate32(x: np.ndarray, p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic in float32: Horner's rule on the clamped input."""
    f32 = np.float32
    c = np.clip(x.astype(f32), f32(-4), f32(4))
    s = c * c
    num, den = f32(p[-1]), f32(q[-1])
    for k in p[-2::-1]:
        num = num * s + f32(k)
    for k in q[-2::-1]:
        den = den * s + f32(k)
    return np.clip(c * num / den, f32(-1), f32(1)).astype(f32)


def main() -> None:
    rel, p, q = fit()
    x = np.linspace(0.0, 6.0, 600001, dtype=np.float32)
    got = evaluate32(x, p, q).astype(np.float64)
    exact = np.array([math.erf(float(v)) for v in x])
    print(f"fit: max relative error {rel:.2e} over (0, 4]")
    error, one = np.abs(got - exact).max(), x[np.argmax(got >= 1)]
    print(f"float32 over [0, 6]: max |error| {error:.2e}, exactly 1 from x = {one:.4f}")
    for name, coefs in (("P", p), ("Q", q)):
        print(name, ", ".join(f"{float(np.float32(k)):.9g}f" for k in coefs))


if __name__ == "__main__":
    main()
