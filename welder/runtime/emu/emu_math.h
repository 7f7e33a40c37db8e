// CUDA's device math library for the CPU emulator: the float/double functions glibc lacks, the
// fast-math and rounding-mode intrinsics, integer intrinsics, and the global min/max overloads.
//
// The fast intrinsics (__expf, __fdividef, ...) are computed exactly here; CUDA's versions are
// approximations, so tolerances in tests must allow for the GPU, not for this file.
#pragma once

#include <math.h>  // puts the float overloads and isnan/isinf/isfinite into the global namespace

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "emu_half.h"

// ----------------------------------------------------------------------------- float functions
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline double rcbrt(double x) { return 1.0 / cbrt(x); }
inline float sinpif(float x) { return sinf(static_cast<float>(M_PI) * x); }
inline float cospif(float x) { return cosf(static_cast<float>(M_PI) * x); }
inline double sinpi(double x) { return sin(M_PI * x); }
inline double cospi(double x) { return cos(M_PI * x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * static_cast<float>(M_SQRT1_2)); }
inline double normcdf(double x) { return 0.5 * erfc(-x * M_SQRT1_2); }
inline float fdividef(float a, float b) { return a / b; }

inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) {
  *s = sinf(x);
  *c = cosf(x);
}
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0

// Explicitly rounded operations; the emulator always runs in round-to-nearest, so _rn is exact and
// the directed variants are provided only where code generators print them.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }

// Float -> integer conversions saturate and map NaN to 0, like the cvt instructions.
inline int __float2int_rn(float x) { return welder_emu::detail::saturate_to<int>(nearbyint(x)); }
inline int __float2int_rz(float x) { return welder_emu::detail::saturate_to<int>(trunc(x)); }
inline int __float2int_rd(float x) { return welder_emu::detail::saturate_to<int>(floor(x)); }
inline int __float2int_ru(float x) { return welder_emu::detail::saturate_to<int>(ceil(x)); }
inline unsigned int __float2uint_rn(float x) { return welder_emu::detail::saturate_to<unsigned int>(nearbyint(x)); }
inline unsigned int __float2uint_rz(float x) { return welder_emu::detail::saturate_to<unsigned int>(trunc(x)); }
inline long long __float2ll_rn(float x) { return welder_emu::detail::saturate_to<long long>(nearbyint(x)); }
inline long long __float2ll_rz(float x) { return welder_emu::detail::saturate_to<long long>(trunc(x)); }
inline int __double2int_rn(double x) { return welder_emu::detail::saturate_to<int>(nearbyint(x)); }
inline int __double2int_rz(double x) { return welder_emu::detail::saturate_to<int>(trunc(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned int x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline double __int2double_rn(int x) { return static_cast<double>(x); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }

// ----------------------------------------------------------------------------- bit casts
namespace welder_emu::detail {
template <class To, class From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}
}  // namespace welder_emu::detail

inline int __float_as_int(float x) { return welder_emu::detail::bit_cast<int>(x); }
inline unsigned int __float_as_uint(float x) { return welder_emu::detail::bit_cast<unsigned int>(x); }
inline float __int_as_float(int x) { return welder_emu::detail::bit_cast<float>(x); }
inline float __uint_as_float(unsigned int x) { return welder_emu::detail::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return welder_emu::detail::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return welder_emu::detail::bit_cast<double>(x); }

// ----------------------------------------------------------------------------- integer intrinsics
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
  unsigned int r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(static_cast<unsigned int>(x))) << 32) |
         __brev(static_cast<unsigned int>(x >> 32));
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) {
  return static_cast<long long>((static_cast<__int128>(a) * b) >> 64);
}
// 24-bit multiplies use the low 24 bits of each operand (sign-extended for __mul24).
inline int __mul24(int a, int b) {
  const long long sa = static_cast<long long>(static_cast<int>(static_cast<unsigned int>(a) << 8) >> 8);
  const long long sb = static_cast<long long>(static_cast<int>(static_cast<unsigned int>(b) << 8) >> 8);
  return static_cast<int>(static_cast<unsigned long long>(sa * sb));
}
inline unsigned int __umul24(unsigned int a, unsigned int b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long bytes = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned int selector = (s >> (4 * i)) & 7u;
    r |= static_cast<unsigned int>((bytes >> (8 * selector)) & 0xFFu) << (8 * i);
  }
  return r;
}
inline unsigned int __sad(int a, int b, unsigned int c) {
  return c + static_cast<unsigned int>(a > b ? static_cast<long long>(a) - b : static_cast<long long>(b) - a);
}

// Cache-hinted loads and stores are plain memory accesses here.
template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldca(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
template <class T>
inline T __ldcs(const T* p) { return *p; }
template <class T>
inline T __ldlu(const T* p) { return *p; }
template <class T>
inline T __ldcv(const T* p) { return *p; }
template <class T>
inline void __stcg(T* p, T v) { *p = v; }
template <class T>
inline void __stcs(T* p, T v) { *p = v; }
template <class T>
inline void __stwb(T* p, T v) { *p = v; }
template <class T>
inline void __stwt(T* p, T v) { *p = v; }

// ----------------------------------------------------------------------------- min / max
// CUDA declares these in the global namespace for every arithmetic pairing a kernel may print;
// mixed signed/unsigned pairs compare as unsigned, as in CUDA's math_functions.hpp.
#define WELDER_EMU_MINMAX(R, A, B)                                                                       \
  inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
  inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
WELDER_EMU_MINMAX(int, int, int)
WELDER_EMU_MINMAX(unsigned int, unsigned int, unsigned int)
WELDER_EMU_MINMAX(unsigned int, int, unsigned int)
WELDER_EMU_MINMAX(unsigned int, unsigned int, int)
WELDER_EMU_MINMAX(long, long, long)
WELDER_EMU_MINMAX(unsigned long, unsigned long, unsigned long)
WELDER_EMU_MINMAX(unsigned long, long, unsigned long)
WELDER_EMU_MINMAX(unsigned long, unsigned long, long)
WELDER_EMU_MINMAX(long long, long long, long long)
WELDER_EMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
WELDER_EMU_MINMAX(unsigned long long, long long, unsigned long long)
WELDER_EMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef WELDER_EMU_MINMAX
// Floating point min/max follow fminf/fmaxf (a NaN operand yields the other operand).
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline unsigned int umin(unsigned int a, unsigned int b) { return min(a, b); }
inline unsigned int umax(unsigned int a, unsigned int b) { return max(a, b); }
inline long long llmin(long long a, long long b) { return min(a, b); }
inline long long llmax(long long a, long long b) { return max(a, b); }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return min(a, b); }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return max(a, b); }
