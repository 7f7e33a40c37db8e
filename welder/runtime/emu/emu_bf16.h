// bfloat16 (__nv_bfloat16, __nv_bfloat162) for the CPU emulator, mirroring cuda_bf16.h.
//
// A bfloat16 is the upper half of a float: 8 exponent bits, 8 significant bits (7 stored).  To
// float is exact (the bits shifted up); every conversion to bfloat16 rounds to nearest even, from
// the exact source value (doubles and 64-bit integers included, never through a rounded float).
// Arithmetic is done in float and rounded once: float has 24 >= 2*8+2 significant bits, so for
// + - * / the double rounding is innocuous and the result is the correctly rounded bfloat16; fma
// goes through double.  Only the intrinsics generated code and the templates use are here, with the
// arithmetic and comparison operators cuda_bf16.hpp defines.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "emu_half.h"
#include "emu_types.h"

namespace welder_emu::detail {

// Rounds m * 2^exp2 (m > 0) to a bfloat16 magnitude, ties to even; returns the bit pattern without
// the sign.  Normal bfloat16 keep 8 significant bits from 2^-126 up; below, the quantum is 2^-133.
inline unsigned short round_to_bf16_bits(uint64_t m, int exp2) {
  const int msb = 63 - __builtin_clzll(m);
  const int exponent = msb + exp2;  // value lies in [2^exponent, 2^(exponent+1))
  if (exponent > 127) return 0x7F80;
  const int drop = exponent >= -126 ? msb - 7 : -133 - exp2;
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
  if (exponent < -126) return static_cast<unsigned short>(q);  // subnormal (q == 0x80 is the min normal)
  // Normal: bits = (exponent + 127) << 7 | (q - 128); a carry out of the significand moves into the
  // exponent field by itself, and overflow lands exactly on infinity (0x7F80).
  const uint64_t bits = (static_cast<uint64_t>(exponent + 126) << 7) + q;
  return static_cast<unsigned short>(bits >= 0x7F80 ? 0x7F80 : bits);
}

inline unsigned short float_to_bf16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
  const uint32_t exp = (x >> 23) & 0xFFu;
  const uint32_t mant = x & 0x7FFFFFu;
  if (exp == 0xFF) return mant ? 0x7FFF : (sign | 0x7F80);  // NaN is canonical, like CUDA
  if (exp == 0 && mant == 0) return sign;
  const uint64_t m = exp ? (mant | 0x800000u) : mant;
  const int exp2 = exp ? static_cast<int>(exp) - 150 : -149;
  return sign | round_to_bf16_bits(m, exp2);
}

inline unsigned short double_to_bf16_bits(double d) {
  uint64_t x;
  std::memcpy(&x, &d, 8);
  const unsigned short sign = static_cast<unsigned short>((x >> 48) & 0x8000u);
  const uint64_t exp = (x >> 52) & 0x7FFu;
  const uint64_t mant = x & 0xFFFFFFFFFFFFFull;
  if (exp == 0x7FF) return mant ? 0x7FFF : (sign | 0x7F80);
  if (exp == 0 && mant == 0) return sign;
  const uint64_t m = exp ? (mant | (uint64_t{1} << 52)) : mant;
  const int exp2 = exp ? static_cast<int>(exp) - 1075 : -1074;
  return sign | round_to_bf16_bits(m, exp2);
}

inline unsigned short integer_to_bf16_bits(long long v) {
  if (v == 0) return 0;
  const unsigned short sign = v < 0 ? 0x8000 : 0;
  const uint64_t m = v < 0 ? uint64_t{0} - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
  return sign | round_to_bf16_bits(m, 0);
}

inline unsigned short unsigned_to_bf16_bits(unsigned long long v) { return v == 0 ? 0 : round_to_bf16_bits(v, 0); }

inline float bf16_bits_to_float(unsigned short h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace welder_emu::detail

struct __nv_bfloat16_raw {
  unsigned short x;
};
struct __nv_bfloat162_raw {
  unsigned short x, y;
};

// Same constructors and conversion operators as cuda_bf16.hpp, so that overload resolution (and
// its ambiguities) match what nvcc sees.
struct __attribute__((aligned(2))) __nv_bfloat16 {
  unsigned short __x;

  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
  __nv_bfloat16(float f) : __x(welder_emu::detail::float_to_bf16_bits(f)) {}
  __nv_bfloat16(double d) : __x(welder_emu::detail::double_to_bf16_bits(d)) {}
  __nv_bfloat16(short v) : __x(welder_emu::detail::integer_to_bf16_bits(v)) {}
  __nv_bfloat16(unsigned short v) : __x(welder_emu::detail::unsigned_to_bf16_bits(v)) {}
  __nv_bfloat16(int v) : __x(welder_emu::detail::integer_to_bf16_bits(v)) {}
  __nv_bfloat16(unsigned int v) : __x(welder_emu::detail::unsigned_to_bf16_bits(v)) {}
  __nv_bfloat16(long v) : __x(welder_emu::detail::integer_to_bf16_bits(v)) {}
  __nv_bfloat16(unsigned long v) : __x(welder_emu::detail::unsigned_to_bf16_bits(v)) {}
  __nv_bfloat16(long long v) : __x(welder_emu::detail::integer_to_bf16_bits(v)) {}
  __nv_bfloat16(unsigned long long v) : __x(welder_emu::detail::unsigned_to_bf16_bits(v)) {}

  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
  operator float() const { return welder_emu::detail::bf16_bits_to_float(__x); }
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
    return welder_emu::detail::saturate_to<I>(std::trunc(welder_emu::detail::bf16_bits_to_float(__x)));
  }
};

struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;

  __nv_bfloat162() = default;
  constexpr __nv_bfloat162(const __nv_bfloat16& a, const __nv_bfloat16& b) : x(a), y(b) {}
  constexpr __nv_bfloat162(const __nv_bfloat162_raw& r) : x(__nv_bfloat16_raw{r.x}), y(__nv_bfloat16_raw{r.y}) {}
  operator __nv_bfloat162_raw() const { return __nv_bfloat162_raw{x.__x, y.__x}; }
};

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

// ----------------------------------------------------------------------------- conversions
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16_raw{v}; }
inline __nv_bfloat16 __short_as_bfloat16(short v) { return __nv_bfloat16_raw{static_cast<unsigned short>(v)}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return static_cast<short>(h.__x); }

inline float __bfloat162float(__nv_bfloat16 h) { return welder_emu::detail::bf16_bits_to_float(h.__x); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16_raw{welder_emu::detail::float_to_bf16_bits(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) {
  return __nv_bfloat16_raw{welder_emu::detail::double_to_bf16_bits(d)};
}
inline __nv_bfloat16 __int2bfloat16_rn(int v) { return __nv_bfloat16_raw{welder_emu::detail::integer_to_bf16_bits(v)}; }
inline __nv_bfloat16 __uint2bfloat16_rn(unsigned int v) {
  return __nv_bfloat16_raw{welder_emu::detail::unsigned_to_bf16_bits(v)};
}
inline __nv_bfloat16 __ll2bfloat16_rn(long long v) {
  return __nv_bfloat16_raw{welder_emu::detail::integer_to_bf16_bits(v)};
}
inline int __bfloat162int_rn(__nv_bfloat16 h) {
  return welder_emu::detail::saturate_to<int>(std::nearbyint(__bfloat162float(h)));
}
inline int __bfloat162int_rz(__nv_bfloat16 h) {
  return welder_emu::detail::saturate_to<int>(std::trunc(__bfloat162float(h)));
}
// Between the 16-bit float formats, as cuda_bf16.h does it: through float (exact for the widening
// half, one rounding for the narrowing one).
inline __nv_bfloat16 __half2bfloat16(__half h) { return __float2bfloat16(__half2float(h)); }

inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) { return __nv_bfloat162(lo, hi); }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) { return __nv_bfloat162(x, y); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 h) { return __nv_bfloat162(h, h); }
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __bfloat162bfloat162(__float2bfloat16(f)); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162(__float2bfloat16(lo), __float2bfloat16(hi));
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return make_float2(__bfloat162float(h.x), __bfloat162float(h.y));
}
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }

// ----------------------------------------------------------------------------- arithmetic
// cuda_bf16.h overloads the fp16 names for __nv_bfloat16.
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(__bfloat162float(a) + __bfloat162float(b));
}
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(__bfloat162float(a) - __bfloat162float(b));
}
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(__bfloat162float(a) * __bfloat162float(b));
}
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(__bfloat162float(a) / __bfloat162float(b));
}
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __double2bfloat16(std::fma(static_cast<double>(__bfloat162float(a)), static_cast<double>(__bfloat162float(b)),
                                    static_cast<double>(__bfloat162float(c))));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __nv_bfloat16_raw{static_cast<unsigned short>(a.__x ^ 0x8000u)}; }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __nv_bfloat16_raw{static_cast<unsigned short>(a.__x & 0x7FFFu)}; }
inline bool __hisnan(__nv_bfloat16 a) { return (a.__x & 0x7FFFu) > 0x7F80u; }
inline int __hisinf(__nv_bfloat16 a) { return (a.__x & 0x7FFFu) == 0x7F80u ? ((a.__x & 0x8000u) ? -1 : 1) : 0; }
// __hmax/__hmin return the other operand when one is NaN.
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(std::fmax(__bfloat162float(a), __bfloat162float(b)));
}
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(std::fmin(__bfloat162float(a), __bfloat162float(b)));
}

// Ordered comparisons are false on NaN; != is unordered, as the operator in cuda_bf16.hpp.
inline bool __heq(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) == __bfloat162float(b); }
inline bool __hne(__nv_bfloat16 a, __nv_bfloat16 b) {
  return !__hisnan(a) && !__hisnan(b) && __bfloat162float(a) != __bfloat162float(b);
}
inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) < __bfloat162float(b); }
inline bool __hle(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) <= __bfloat162float(b); }
inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) > __bfloat162float(b); }
inline bool __hge(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) >= __bfloat162float(b); }
inline bool __hneu(__nv_bfloat16 a, __nv_bfloat16 b) { return !__heq(a, b); }

// Elementary functions: evaluated in float, rounded once.
inline __nv_bfloat16 hexp(__nv_bfloat16 a) { return __float2bfloat16(std::exp(__bfloat162float(a))); }
inline __nv_bfloat16 hlog(__nv_bfloat16 a) { return __float2bfloat16(std::log(__bfloat162float(a))); }
inline __nv_bfloat16 hsqrt(__nv_bfloat16 a) { return __float2bfloat16(std::sqrt(__bfloat162float(a))); }
inline __nv_bfloat16 hrsqrt(__nv_bfloat16 a) { return __float2bfloat16(1.0f / std::sqrt(__bfloat162float(a))); }
inline __nv_bfloat16 htanh(__nv_bfloat16 a) { return __float2bfloat16(std::tanh(__bfloat162float(a))); }
inline __nv_bfloat16 hfloor(__nv_bfloat16 a) { return __float2bfloat16(std::floor(__bfloat162float(a))); }
inline __nv_bfloat16 hceil(__nv_bfloat16 a) { return __float2bfloat16(std::ceil(__bfloat162float(a))); }
inline __nv_bfloat16 hrint(__nv_bfloat16 a) { return __float2bfloat16(std::nearbyint(__bfloat162float(a))); }

// ----------------------------------------------------------------------------- __nv_bfloat162 lane-wise
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162(__hadd(a.x, b.x), __hadd(a.y, b.y));
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162(__hmul(a.x, b.x), __hmul(a.y, b.y));
}

// ----------------------------------------------------------------------------- operators
inline __nv_bfloat16 operator+(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hadd(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hsub(a, b); }
inline __nv_bfloat16 operator*(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hmul(a, b); }
inline __nv_bfloat16 operator/(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hdiv(a, b); }
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hadd(a, b); }
inline __nv_bfloat16& operator-=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hsub(a, b); }
inline __nv_bfloat16& operator*=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hmul(a, b); }
inline __nv_bfloat16& operator/=(__nv_bfloat16& a, const __nv_bfloat16& b) { return a = __hdiv(a, b); }
inline __nv_bfloat16 operator+(const __nv_bfloat16& a) { return a; }
inline __nv_bfloat16 operator-(const __nv_bfloat16& a) { return __hneg(a); }
inline bool operator==(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __heq(a, b); }
inline bool operator!=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hneu(a, b); }
inline bool operator<(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hlt(a, b); }
inline bool operator<=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hle(a, b); }
inline bool operator>(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hgt(a, b); }
inline bool operator>=(const __nv_bfloat16& a, const __nv_bfloat16& b) { return __hge(a, b); }

inline __nv_bfloat162 operator+(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hadd2(a, b); }
inline __nv_bfloat162 operator*(const __nv_bfloat162& a, const __nv_bfloat162& b) { return __hmul2(a, b); }

#define CUDART_INF_BF16 __ushort_as_bfloat16(static_cast<unsigned short>(0x7F80U))
#define CUDART_NAN_BF16 __ushort_as_bfloat16(static_cast<unsigned short>(0x7FFFU))
#define CUDART_MAX_NORMAL_BF16 __ushort_as_bfloat16(static_cast<unsigned short>(0x7F7FU))
#define CUDART_ZERO_BF16 __ushort_as_bfloat16(static_cast<unsigned short>(0x0000U))
#define CUDART_ONE_BF16 __ushort_as_bfloat16(static_cast<unsigned short>(0x3F80U))
