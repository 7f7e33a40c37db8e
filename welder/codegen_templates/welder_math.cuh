// welder_math.cuh -- small device functions generated kernels call.  Valid CUDA and valid
// under the CPU emulator alike; included right after welder_prelude.cuh.
// A guard, not #pragma once: an emulated runtime includes its folder's copy of this file after
// the precompiled copy in welder's cache (emu_runtime_prelude.h), and only a guard makes them one.
#ifndef WELDER_MATH_CUH
#define WELDER_MATH_CUH

// Floor division and modulo for index arithmetic whose operands may be negative (C's / and %
// truncate towards zero; the IR's floordiv/mod round towards minus infinity).
__device__ __forceinline__ int welder_floordiv(int a, int b) {
  const int q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int welder_mod(int a, int b) {
  const int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ long long welder_floordiv(long long a, long long b) {
  const long long q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long welder_mod(long long a, long long b) {
  const long long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float welder_fmod_floor(float a, float b) { return a - floorf(a / b) * b; }

// max/min: integers through one template, floats propagating NaN like numpy (fmaxf would drop
// it), bool as or/and.
template <class T>
__device__ __forceinline__ T welder_max(T a, T b) { return a > b ? a : b; }
template <class T>
__device__ __forceinline__ T welder_min(T a, T b) { return a < b ? a : b; }
// On sm_80 and later a float's is one instruction (FMNMX.NAN), where the comparisons take three:
// a softmax's maximum runs over every score.
#if !defined(WELDER_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ float welder_max(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float welder_min(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
#else
__device__ __forceinline__ float welder_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ float welder_min(float a, float b) { return (a != a || a < b) ? a : b; }
#endif
__device__ __forceinline__ double welder_max(double a, double b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ double welder_min(double a, double b) { return (a != a || a < b) ? a : b; }
__device__ __forceinline__ bool welder_max(bool a, bool b) { return a || b; }
__device__ __forceinline__ bool welder_min(bool a, bool b) { return a && b; }

// a / b of a 16-bit result, computed in float: b's reciprocal (rcp.approx, within an ulp) times
// a, within 2 ulp of float as __fdividef is.  __fdividef adds a range check for divisors past
// 2^126 to every division, two or three instructions an element; there the flushed reciprocal
// makes the quotient 0 (NaN for an infinite a), as __fdividef's is.  No 16-bit float but bf16
// reaches 2^126, which is why bf16 keeps IEEE division (codegen/cprint.py's _divide).
__device__ __forceinline__ float welder_div16(float a, float b) {
#if !defined(WELDER_EMULATE) && defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return a * r;
#else
  const float r = 1.0f / b;
  return a * (fabsf(r) < 1.17549435e-38f ? copysignf(0.0f, r) : r);
#endif
}

// erf of a value a 16-bit float will hold: x P(x^2) / Q(x^2) on the input clamped to +-4, the
// result clamped to +-1, which the fit reaches before 4 (scripts/fit_erf16.py fits and checks
// the coefficients).  Its error, under 5e-6, is a fiftieth of an fp16 ulp at 1, and it is
// exactly +-1 far out, as erff is (GELU's 1 + erf(x) vanishes there).  The clamps are
// welder_max/min, which keep a NaN in one instruction each on sm_80 and later, and Q (1 to 81
// on the clamped range) is divided by its reciprocal: 15 instructions on sm_90, against erff's
// 24 (its two ranges' coefficient selects and an ex2).
__device__ __forceinline__ float welder_erf16(float x) {
  const float c = welder_min(welder_max(x, -4.0f), 4.0f);
  const float s = c * c;
  const float p = (((-4.50629614e-06f * s + 0.00107376336f) * s + 0.0472299792f) * s + 0.163363621f) * s +
                  1.12838447f;
  const float q = ((0.0110491896f * s + 0.100915395f) * s + 0.478209794f) * s + 1.0f;
  return welder_min(welder_max(welder_div16(c * p, q), -1.0f), 1.0f);
}

// 2^x of a value a 16-bit float will hold: ex2.approx, flushing results under 2^-126 to zero.
__device__ __forceinline__ float welder_exp2_16(float x) {
#ifdef WELDER_EMULATE
  const float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;
#else
  float d;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(x));
  return d;
#endif
}

// exp of a value a 16-bit float will hold: ex2.approx of x log2(e), as __expf, but flushing
// results under 2^-126 to zero, which spares __expf's rescaling around the ex2 (a compare and
// two predicated multiplies: five instructions become two).  No 16-bit float is that small
// but bf16's subnormals, whose absolute error this stays under; elsewhere the two agree.
__device__ __forceinline__ float welder_exp16(float x) { return welder_exp2_16(x * 1.44269504f); }

// exp(a - b) of a 16-bit result, a softmax's exp(x - max): a log2(e) - b log2(e) in one FFMA
// where (a - b) log2(e) takes a subtraction and a multiply; b log2(e) is the same for a row's
// elements, so the compiler computes it once.  Rounding b log2(e) costs half a float ulp of it:
// under 2^-6 of an fp16 ulp for |b| < 64, and 0.7 of one at |b| = 10^4 (a row masked whole).
__device__ __forceinline__ float welder_exp16_sub(float a, float b) {
  return welder_exp2_16(fmaf(a, 1.44269504f, -(b * 1.44269504f)));
}

// Integer power with a non-negative exponent (negative exponents give 0 except for base 1/-1,
// which the IR never produces from ONNX's integer Pow).
template <class T>
__device__ __forceinline__ T welder_ipow(T base, T exp) {
  T result = 1;
  while (exp > 0) {
    if (exp & 1) result *= base;
    base *= base;
    exp >>= 1;
  }
  return result;
}

// Argmax/argmin accumulators: the smaller index wins ties, so the first occurrence is kept
// however the reduction is split across threads.
template <class T>
__device__ __forceinline__ void welder_argmax_step(T& best, int& at, T v, int i) {
  if (v > best || (v == best && i < at) || (v != v && best == best)) { best = v; at = i; }
}
template <class T>
__device__ __forceinline__ void welder_argmin_step(T& best, int& at, T v, int i) {
  if (v < best || (v == best && i < at) || (v != v && best == best)) { best = v; at = i; }
}

// A tensor value used as an index into a dimension of n >= 1 (Gather's indices, token ids).
// Negative values count from the end, as ONNX allows; anything outside [-n, n) is bad input.  On
// the GPU the position is clamped into [0, n), so no input value makes a kernel touch memory
// outside a tensor (the host checks model inputs before a run; see docs/runtime.md).  Under the
// emulator the launch fails instead, naming `node`, the value and the range -- unless
// WELDER_UNCHECKED_INDICES asks for the GPU behaviour (tests of memory safety use that).
__device__ __forceinline__ int welder_index(long long i, int n, const char* node) {
  const long long w = i < 0 ? i + n : i;
#if defined(WELDER_EMULATE) && !defined(WELDER_UNCHECKED_INDICES)
  if (w < 0 || w >= n)
    ::welder_emu::detail::raise_error(
        ::welder_emu::detail::format("%s: index %lld is out of range [%d, %d]", node, i, -n, n - 1));
#endif
  (void)node;
  return w < 0 ? 0 : (w >= n ? n - 1 : static_cast<int>(w));
}

#endif  // WELDER_MATH_CUH
