// IEEE binary16 (__half, __half2) for the CPU emulator, mirroring cuda_fp16.h.
//
// Conversions round to nearest even.  Arithmetic is done in float and rounded once: for + - * /
// float has at least 2*11+2 significant bits, so the double rounding is innocuous and the result is
// the correctly rounded half; fma goes through double.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "emu_types.h"

namespace welder_emu::detail {

// Rounds m * 2^exp2 (m > 0) to a binary16 magnitude, ties to even; returns the bit pattern without
// the sign.  Shared by every conversion to half so that one routine carries the rounding rules.
inline unsigned short round_to_half_bits(uint64_t m, int exp2) {
  const int msb = 63 - __builtin_clzll(m);
  const int exponent = msb + exp2;  // value lies in [2^exponent, 2^(exponent+1))
  if (exponent > 15) return 0x7C00;
  // Normal halves keep 11 significant bits; below 2^-14 the quantum is fixed at 2^-24.
  const int drop = exponent >= -14 ? msb - 10 : -24 - exp2;
  uint64_t q;
  if (drop <= 0) {
    q = m << -drop;
  } else if (drop > msb + 1 || drop >= 64) {
    q = 0;  // less than half of the smallest quantum
  } else {
    q = m >> drop;
    const uint64_t rest = m & ((uint64_t{1} << drop) - 1);
    const uint64_t halfway = uint64_t{1} << (drop - 1);
    if (rest > halfway || (rest == halfway && (q & 1))) ++q;
  }
  if (exponent < -14) return static_cast<unsigned short>(q);  // subnormal (q == 0x400 is the min normal)
  // Normal: bits = (exponent + 15) << 10 | (q - 1024); a carry out of the significand moves into the
  // exponent field by itself, and overflow lands exactly on infinity (0x7C00).
  const uint64_t bits = (static_cast<uint64_t>(exponent + 14) << 10) + q;
  return static_cast<unsigned short>(bits >= 0x7C00 ? 0x7C00 : bits);
}

inline unsigned short float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xFFu;
  const uint32_t mant = x & 0x7FFFFFu;
  if (exp == 0xFF) return sign | (mant ? 0x7FFF : 0x7C00);  // NaN is canonical, like CUDA
  if (exp == 0 && mant == 0) return sign;
  const uint64_t m = exp ? (mant | 0x800000u) : mant;
  const int exp2 = exp ? static_cast<int>(exp) - 150 : -149;
  return sign | round_to_half_bits(m, exp2);
}

inline unsigned short double_to_half_bits(double d) {
  uint64_t x;
  std::memcpy(&x, &d, 8);
  const unsigned short sign = static_cast<unsigned short>((x >> 48) & 0x8000u);
  const uint64_t exp = (x >> 52) & 0x7FFu;
  const uint64_t mant = x & 0xFFFFFFFFFFFFFull;
  if (exp == 0x7FF) return sign | (mant ? 0x7FFF : 0x7C00);
  if (exp == 0 && mant == 0) return sign;
  const uint64_t m = exp ? (mant | (uint64_t{1} << 52)) : mant;
  const int exp2 = exp ? static_cast<int>(exp) - 1075 : -1074;
  return sign | round_to_half_bits(m, exp2);
}

inline unsigned short integer_to_half_bits(long long v) {
  if (v == 0) return 0;
  const unsigned short sign = v < 0 ? 0x8000 : 0;
  const uint64_t m = v < 0 ? uint64_t{0} - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
  return sign | round_to_half_bits(m, 0);
}

inline unsigned short unsigned_to_half_bits(unsigned long long v) {
  return v == 0 ? 0 : round_to_half_bits(v, 0);
}

inline float half_bits_to_float(unsigned short h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mant), -24);  // exact: 10-bit integer
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exp == 0x1F ? (sign | 0x7F800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Conversion of a float to an integer type with CUDA's saturation (NaN -> 0) after rounding.
template <class I>
inline I saturate_to(double rounded) {
  if (std::isnan(rounded)) return I{0};
  if (rounded <= static_cast<double>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
  if (rounded >= static_cast<double>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  return static_cast<I>(rounded);
}

}  // namespace welder_emu::detail

struct __half_raw {
  unsigned short x;
};
struct __half2_raw {
  unsigned short x, y;
};

struct __half;
inline float __half2float(__half h);

// Same constructors and conversion operators as cuda_fp16.hpp, so that overload resolution (and
// its ambiguities) match what nvcc sees.
struct __attribute__((aligned(2))) __half {
  unsigned short __x;

  __half() = default;
  constexpr __half(const __half_raw& r) : __x(r.x) {}
  __half(float f) : __x(welder_emu::detail::float_to_half_bits(f)) {}
  __half(double d) : __x(welder_emu::detail::double_to_half_bits(d)) {}
  __half(short v) : __x(welder_emu::detail::integer_to_half_bits(v)) {}
  __half(unsigned short v) : __x(welder_emu::detail::unsigned_to_half_bits(v)) {}
  __half(int v) : __x(welder_emu::detail::integer_to_half_bits(v)) {}
  __half(unsigned int v) : __x(welder_emu::detail::unsigned_to_half_bits(v)) {}
  __half(long v) : __x(welder_emu::detail::integer_to_half_bits(v)) {}
  __half(unsigned long v) : __x(welder_emu::detail::unsigned_to_half_bits(v)) {}
  __half(long long v) : __x(welder_emu::detail::integer_to_half_bits(v)) {}
  __half(unsigned long long v) : __x(welder_emu::detail::unsigned_to_half_bits(v)) {}

  operator __half_raw() const { return __half_raw{__x}; }
  operator float() const { return welder_emu::detail::half_bits_to_float(__x); }
  operator signed char() const { return truncated<signed char>(); }
  operator unsigned char() const { return truncated<unsigned char>(); }
  operator char() const { return truncated<char>(); }
  operator short() const { return truncated<short>(); }
  operator unsigned short() const { return truncated<unsigned short>(); }
  operator int() const { return truncated<int>(); }
  operator unsigned int() const { return truncated<unsigned int>(); }
  operator long() const { return truncated<long>(); }
  operator unsigned long() const { return truncated<unsigned long>(); }
  operator long long() const { return truncated<long long>(); }
  operator unsigned long long() const { return truncated<unsigned long long>(); }
  constexpr operator bool() const { return (__x & 0x7FFFu) != 0; }

 private:
  template <class I>
  I truncated() const {
    return welder_emu::detail::saturate_to<I>(std::trunc(welder_emu::detail::half_bits_to_float(__x)));
  }
};

struct __attribute__((aligned(4))) __half2 {
  __half x, y;

  __half2() = default;
  constexpr __half2(const __half& a, const __half& b) : x(a), y(b) {}
  constexpr __half2(const __half2_raw& r) : x(__half_raw{r.x}), y(__half_raw{r.y}) {}
  operator __half2_raw() const { return __half2_raw{x.__x, y.__x}; }
};

typedef __half half;
typedef __half2 half2;

// ----------------------------------------------------------------------------- conversions
inline __half __ushort_as_half(unsigned short v) { return __half_raw{v}; }
inline __half __short_as_half(short v) { return __half_raw{static_cast<unsigned short>(v)}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return static_cast<short>(h.__x); }

inline float __half2float(__half h) { return welder_emu::detail::half_bits_to_float(h.__x); }
inline __half __float2half(float f) { return __half_raw{welder_emu::detail::float_to_half_bits(f)}; }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline __half __double2half(double d) { return __half_raw{welder_emu::detail::double_to_half_bits(d)}; }
inline __half __int2half_rn(int v) { return __half_raw{welder_emu::detail::integer_to_half_bits(v)}; }
inline __half __uint2half_rn(unsigned int v) { return __half_raw{welder_emu::detail::unsigned_to_half_bits(v)}; }
inline __half __ll2half_rn(long long v) { return __half_raw{welder_emu::detail::integer_to_half_bits(v)}; }
inline __half __short2half_rn(short v) { return __half_raw{welder_emu::detail::integer_to_half_bits(v)}; }
inline int __half2int_rn(__half h) { return welder_emu::detail::saturate_to<int>(std::nearbyint(__half2float(h))); }
inline int __half2int_rz(__half h) { return welder_emu::detail::saturate_to<int>(std::trunc(__half2float(h))); }
inline int __half2int_rd(__half h) { return welder_emu::detail::saturate_to<int>(std::floor(__half2float(h))); }
inline int __half2int_ru(__half h) { return welder_emu::detail::saturate_to<int>(std::ceil(__half2float(h))); }

inline __half2 __halves2half2(__half lo, __half hi) { return __half2(lo, hi); }
inline __half2 make_half2(__half x, __half y) { return __half2(x, y); }
inline __half2 __half2half2(__half h) { return __half2(h, h); }
inline __half2 __float2half2_rn(float f) { return __half2half2(__float2half(f)); }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2(__float2half(lo), __float2half(hi)); }
inline __half2 __float22half2_rn(float2 f) { return __floats2half2_rn(f.x, f.y); }
inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __low2half2(__half2 h) { return __half2(h.x, h.x); }
inline __half2 __high2half2(__half2 h) { return __half2(h.y, h.y); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __lowhigh2highlow(__half2 h) { return __half2(h.y, h.x); }

// ----------------------------------------------------------------------------- arithmetic
inline __half __hadd(__half a, __half b) { return __float2half(__half2float(a) + __half2float(b)); }
inline __half __hsub(__half a, __half b) { return __float2half(__half2float(a) - __half2float(b)); }
inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }
inline __half __hdiv(__half a, __half b) { return __float2half(__half2float(a) / __half2float(b)); }
inline __half __hfma(__half a, __half b, __half c) {
  return __double2half(std::fma(static_cast<double>(__half2float(a)), static_cast<double>(__half2float(b)),
                                static_cast<double>(__half2float(c))));
}
inline __half __hneg(__half a) { return __half_raw{static_cast<unsigned short>(a.__x ^ 0x8000u)}; }
inline __half __habs(__half a) { return __half_raw{static_cast<unsigned short>(a.__x & 0x7FFFu)}; }
inline __half __hadd_rn(__half a, __half b) { return __hadd(a, b); }
inline __half __hsub_rn(__half a, __half b) { return __hsub(a, b); }
inline __half __hmul_rn(__half a, __half b) { return __hmul(a, b); }
inline bool __hisnan(__half a) { return (a.__x & 0x7FFFu) > 0x7C00u; }
inline int __hisinf(__half a) { return (a.__x & 0x7FFFu) == 0x7C00u ? ((a.__x & 0x8000u) ? -1 : 1) : 0; }
// __hmax/__hmin return the other operand when one is NaN; the _nan variants propagate NaN.
inline __half __hmax(__half a, __half b) { return __float2half(std::fmax(__half2float(a), __half2float(b))); }
inline __half __hmin(__half a, __half b) { return __float2half(std::fmin(__half2float(a), __half2float(b))); }
inline __half __hmax_nan(__half a, __half b) {
  return (__hisnan(a) || __hisnan(b)) ? __ushort_as_half(0x7FFF) : __hmax(a, b);
}
inline __half __hmin_nan(__half a, __half b) {
  return (__hisnan(a) || __hisnan(b)) ? __ushort_as_half(0x7FFF) : __hmin(a, b);
}

// Ordered comparisons are false on NaN; the "u" variants are true on NaN.
inline bool __heq(__half a, __half b) { return __half2float(a) == __half2float(b); }
inline bool __hne(__half a, __half b) { return !__hisnan(a) && !__hisnan(b) && __half2float(a) != __half2float(b); }
inline bool __hlt(__half a, __half b) { return __half2float(a) < __half2float(b); }
inline bool __hle(__half a, __half b) { return __half2float(a) <= __half2float(b); }
inline bool __hgt(__half a, __half b) { return __half2float(a) > __half2float(b); }
inline bool __hge(__half a, __half b) { return __half2float(a) >= __half2float(b); }
inline bool __hequ(__half a, __half b) { return !__hne(a, b); }
inline bool __hneu(__half a, __half b) { return !__heq(a, b); }
inline bool __hltu(__half a, __half b) { return !__hge(a, b); }
inline bool __hleu(__half a, __half b) { return !__hgt(a, b); }
inline bool __hgtu(__half a, __half b) { return !__hle(a, b); }
inline bool __hgeu(__half a, __half b) { return !__hlt(a, b); }

// Elementary functions: evaluated in float, rounded once.
inline __half hexp(__half a) { return __float2half(std::exp(__half2float(a))); }
inline __half hexp2(__half a) { return __float2half(std::exp2(__half2float(a))); }
inline __half hexp10(__half a) { return __float2half(std::pow(10.0f, __half2float(a))); }
inline __half hlog(__half a) { return __float2half(std::log(__half2float(a))); }
inline __half hlog2(__half a) { return __float2half(std::log2(__half2float(a))); }
inline __half hlog10(__half a) { return __float2half(std::log10(__half2float(a))); }
inline __half hsqrt(__half a) { return __float2half(std::sqrt(__half2float(a))); }
inline __half hrsqrt(__half a) { return __float2half(1.0f / std::sqrt(__half2float(a))); }
inline __half hrcp(__half a) { return __float2half(1.0f / __half2float(a)); }
inline __half hsin(__half a) { return __float2half(std::sin(__half2float(a))); }
inline __half hcos(__half a) { return __float2half(std::cos(__half2float(a))); }
inline __half htanh(__half a) { return __float2half(std::tanh(__half2float(a))); }
inline __half htanh_approx(__half a) { return htanh(a); }
inline __half hfloor(__half a) { return __float2half(std::floor(__half2float(a))); }
inline __half hceil(__half a) { return __float2half(std::ceil(__half2float(a))); }
inline __half htrunc(__half a) { return __float2half(std::trunc(__half2float(a))); }
inline __half hrint(__half a) { return __float2half(std::nearbyint(__half2float(a))); }

// ----------------------------------------------------------------------------- __half2 lane-wise
namespace welder_emu::detail {
template <class F>
inline __half2 lanewise(__half2 a, __half2 b, F f) {
  return __half2(f(a.x, b.x), f(a.y, b.y));
}
template <class F>
inline __half2 lanewise(__half2 a, F f) {
  return __half2(f(a.x), f(a.y));
}
}  // namespace welder_emu::detail

inline __half2 __hadd2(__half2 a, __half2 b) { return welder_emu::detail::lanewise(a, b, __hadd); }
inline __half2 __hsub2(__half2 a, __half2 b) { return welder_emu::detail::lanewise(a, b, __hsub); }
inline __half2 __hmul2(__half2 a, __half2 b) { return welder_emu::detail::lanewise(a, b, __hmul); }
inline __half2 __h2div(__half2 a, __half2 b) { return welder_emu::detail::lanewise(a, b, __hdiv); }
inline __half2 __hmax2(__half2 a, __half2 b) { return welder_emu::detail::lanewise(a, b, __hmax); }
inline __half2 __hmin2(__half2 a, __half2 b) { return welder_emu::detail::lanewise(a, b, __hmin); }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));
}
inline __half2 __hneg2(__half2 a) { return welder_emu::detail::lanewise(a, __hneg); }
inline __half2 __habs2(__half2 a) { return welder_emu::detail::lanewise(a, __habs); }
inline __half2 h2exp(__half2 a) { return welder_emu::detail::lanewise(a, hexp); }
inline __half2 h2exp2(__half2 a) { return welder_emu::detail::lanewise(a, hexp2); }
inline __half2 h2log(__half2 a) { return welder_emu::detail::lanewise(a, hlog); }
inline __half2 h2log2(__half2 a) { return welder_emu::detail::lanewise(a, hlog2); }
inline __half2 h2sqrt(__half2 a) { return welder_emu::detail::lanewise(a, hsqrt); }
inline __half2 h2rsqrt(__half2 a) { return welder_emu::detail::lanewise(a, hrsqrt); }
inline __half2 h2rcp(__half2 a) { return welder_emu::detail::lanewise(a, hrcp); }
inline __half2 h2sin(__half2 a) { return welder_emu::detail::lanewise(a, hsin); }
inline __half2 h2cos(__half2 a) { return welder_emu::detail::lanewise(a, hcos); }
inline __half2 h2tanh(__half2 a) { return welder_emu::detail::lanewise(a, htanh); }
inline __half2 h2floor(__half2 a) { return welder_emu::detail::lanewise(a, hfloor); }
inline __half2 h2ceil(__half2 a) { return welder_emu::detail::lanewise(a, hceil); }
inline __half2 h2trunc(__half2 a) { return welder_emu::detail::lanewise(a, htrunc); }
inline __half2 h2rint(__half2 a) { return welder_emu::detail::lanewise(a, hrint); }
// Lane-wise comparisons returning 1.0 / 0.0 per lane, and the "b" forms returning true if both hold.
namespace welder_emu::detail {
inline __half2 compare_lanes(__half2 a, __half2 b, bool (*holds)(__half, __half)) {
  const auto one_or_zero = [](bool v) { return __ushort_as_half(v ? 0x3C00 : 0x0000); };
  return __half2(one_or_zero(holds(a.x, b.x)), one_or_zero(holds(a.y, b.y)));
}
}  // namespace welder_emu::detail
inline __half2 __heq2(__half2 a, __half2 b) { return welder_emu::detail::compare_lanes(a, b, __heq); }
inline __half2 __hne2(__half2 a, __half2 b) { return welder_emu::detail::compare_lanes(a, b, __hne); }
inline __half2 __hgt2(__half2 a, __half2 b) { return welder_emu::detail::compare_lanes(a, b, __hgt); }
inline __half2 __hge2(__half2 a, __half2 b) { return welder_emu::detail::compare_lanes(a, b, __hge); }
inline __half2 __hlt2(__half2 a, __half2 b) { return welder_emu::detail::compare_lanes(a, b, __hlt); }
inline __half2 __hle2(__half2 a, __half2 b) { return welder_emu::detail::compare_lanes(a, b, __hle); }
inline bool __hbeq2(__half2 a, __half2 b) { return __heq(a.x, b.x) && __heq(a.y, b.y); }
inline bool __hbne2(__half2 a, __half2 b) { return __hne(a.x, b.x) && __hne(a.y, b.y); }
inline bool __hbneu2(__half2 a, __half2 b) { return __hneu(a.x, b.x) && __hneu(a.y, b.y); }
inline bool __hblt2(__half2 a, __half2 b) { return __hlt(a.x, b.x) && __hlt(a.y, b.y); }
inline bool __hble2(__half2 a, __half2 b) { return __hle(a.x, b.x) && __hle(a.y, b.y); }
inline bool __hbgt2(__half2 a, __half2 b) { return __hgt(a.x, b.x) && __hgt(a.y, b.y); }
inline bool __hbge2(__half2 a, __half2 b) { return __hge(a.x, b.x) && __hge(a.y, b.y); }

// ----------------------------------------------------------------------------- operators
inline __half operator+(const __half& a, const __half& b) { return __hadd(a, b); }
inline __half operator-(const __half& a, const __half& b) { return __hsub(a, b); }
inline __half operator*(const __half& a, const __half& b) { return __hmul(a, b); }
inline __half operator/(const __half& a, const __half& b) { return __hdiv(a, b); }
inline __half& operator+=(__half& a, const __half& b) { return a = __hadd(a, b); }
inline __half& operator-=(__half& a, const __half& b) { return a = __hsub(a, b); }
inline __half& operator*=(__half& a, const __half& b) { return a = __hmul(a, b); }
inline __half& operator/=(__half& a, const __half& b) { return a = __hdiv(a, b); }
inline __half& operator++(__half& a) { return a = __hadd(a, __ushort_as_half(0x3C00)); }
inline __half& operator--(__half& a) { return a = __hsub(a, __ushort_as_half(0x3C00)); }
inline __half operator++(__half& a, int) { const __half old = a; ++a; return old; }
inline __half operator--(__half& a, int) { const __half old = a; --a; return old; }
inline __half operator+(const __half& a) { return a; }
inline __half operator-(const __half& a) { return __hneg(a); }
inline bool operator==(const __half& a, const __half& b) { return __heq(a, b); }
inline bool operator!=(const __half& a, const __half& b) { return __hneu(a, b); }
inline bool operator<(const __half& a, const __half& b) { return __hlt(a, b); }
inline bool operator<=(const __half& a, const __half& b) { return __hle(a, b); }
inline bool operator>(const __half& a, const __half& b) { return __hgt(a, b); }
inline bool operator>=(const __half& a, const __half& b) { return __hge(a, b); }

inline __half2 operator+(const __half2& a, const __half2& b) { return __hadd2(a, b); }
inline __half2 operator-(const __half2& a, const __half2& b) { return __hsub2(a, b); }
inline __half2 operator*(const __half2& a, const __half2& b) { return __hmul2(a, b); }
inline __half2 operator/(const __half2& a, const __half2& b) { return __h2div(a, b); }
inline __half2& operator+=(__half2& a, const __half2& b) { return a = __hadd2(a, b); }
inline __half2& operator-=(__half2& a, const __half2& b) { return a = __hsub2(a, b); }
inline __half2& operator*=(__half2& a, const __half2& b) { return a = __hmul2(a, b); }
inline __half2& operator/=(__half2& a, const __half2& b) { return a = __h2div(a, b); }
inline __half2 operator+(const __half2& a) { return a; }
inline __half2 operator-(const __half2& a) { return __hneg2(a); }
inline bool operator==(const __half2& a, const __half2& b) { return __hbeq2(a, b); }
inline bool operator!=(const __half2& a, const __half2& b) { return __hbneu2(a, b); }
inline bool operator<(const __half2& a, const __half2& b) { return __hblt2(a, b); }
inline bool operator<=(const __half2& a, const __half2& b) { return __hble2(a, b); }
inline bool operator>(const __half2& a, const __half2& b) { return __hbgt2(a, b); }
inline bool operator>=(const __half2& a, const __half2& b) { return __hbge2(a, b); }

#define CUDART_INF_FP16 __ushort_as_half(static_cast<unsigned short>(0x7C00U))
#define CUDART_NAN_FP16 __ushort_as_half(static_cast<unsigned short>(0x7FFFU))
#define CUDART_MAX_NORMAL_FP16 __ushort_as_half(static_cast<unsigned short>(0x7BFFU))
#define CUDART_ZERO_FP16 __ushort_as_half(static_cast<unsigned short>(0x0000U))
#define CUDART_ONE_FP16 __ushort_as_half(static_cast<unsigned short>(0x3C00U))
