// CUDA's built-in vector types, dim3 and the index variables, for the CPU emulator.
//
// Part of the CPU emulator (see cuda_emu.h).  Everything here is plain data; nothing depends on the
// fiber runtime.
#pragma once

#include <cstddef>
#include <cstdint>

// ---------------------------------------------------------------------------------------------
// Built-in vector types with CUDA's sizes and alignments, and their make_* constructors.
// ---------------------------------------------------------------------------------------------
#define WELDER_EMU_VEC1(name, T, align)                          \
  struct __attribute__((aligned(align))) name {                 \
    T x;                                                         \
  };                                                             \
  inline constexpr name make_##name(T x) { return name{x}; }
#define WELDER_EMU_VEC2(name, T, align)                          \
  struct __attribute__((aligned(align))) name {                 \
    T x, y;                                                      \
  };                                                             \
  inline constexpr name make_##name(T x, T y) { return name{x, y}; }
#define WELDER_EMU_VEC3(name, T, align)                          \
  struct __attribute__((aligned(align))) name {                 \
    T x, y, z;                                                   \
  };                                                             \
  inline constexpr name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define WELDER_EMU_VEC4(name, T, align)                          \
  struct __attribute__((aligned(align))) name {                 \
    T x, y, z, w;                                                \
  };                                                             \
  inline constexpr name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

WELDER_EMU_VEC1(char1, signed char, 1)
WELDER_EMU_VEC2(char2, signed char, 2)
WELDER_EMU_VEC3(char3, signed char, 1)
WELDER_EMU_VEC4(char4, signed char, 4)
WELDER_EMU_VEC1(uchar1, unsigned char, 1)
WELDER_EMU_VEC2(uchar2, unsigned char, 2)
WELDER_EMU_VEC3(uchar3, unsigned char, 1)
WELDER_EMU_VEC4(uchar4, unsigned char, 4)
WELDER_EMU_VEC1(short1, short, 2)
WELDER_EMU_VEC2(short2, short, 4)
WELDER_EMU_VEC3(short3, short, 2)
WELDER_EMU_VEC4(short4, short, 8)
WELDER_EMU_VEC1(ushort1, unsigned short, 2)
WELDER_EMU_VEC2(ushort2, unsigned short, 4)
WELDER_EMU_VEC3(ushort3, unsigned short, 2)
WELDER_EMU_VEC4(ushort4, unsigned short, 8)
WELDER_EMU_VEC1(int1, int, 4)
WELDER_EMU_VEC2(int2, int, 8)
WELDER_EMU_VEC3(int3, int, 4)
WELDER_EMU_VEC4(int4, int, 16)
WELDER_EMU_VEC1(uint1, unsigned int, 4)
WELDER_EMU_VEC2(uint2, unsigned int, 8)
WELDER_EMU_VEC3(uint3, unsigned int, 4)
WELDER_EMU_VEC4(uint4, unsigned int, 16)
WELDER_EMU_VEC1(long1, long, 8)
WELDER_EMU_VEC2(long2, long, 16)
WELDER_EMU_VEC1(ulong1, unsigned long, 8)
WELDER_EMU_VEC2(ulong2, unsigned long, 16)
WELDER_EMU_VEC1(longlong1, long long, 8)
WELDER_EMU_VEC2(longlong2, long long, 16)
WELDER_EMU_VEC1(ulonglong1, unsigned long long, 8)
WELDER_EMU_VEC2(ulonglong2, unsigned long long, 16)
WELDER_EMU_VEC1(float1, float, 4)
WELDER_EMU_VEC2(float2, float, 8)
WELDER_EMU_VEC3(float3, float, 4)
WELDER_EMU_VEC4(float4, float, 16)
WELDER_EMU_VEC1(double1, double, 8)
WELDER_EMU_VEC2(double2, double, 16)

#undef WELDER_EMU_VEC1
#undef WELDER_EMU_VEC2
#undef WELDER_EMU_VEC3
#undef WELDER_EMU_VEC4

// dim3 is uint3 with every component defaulting to 1, as in CUDA.
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// The built-in index variables.  The scheduler rewrites them before it resumes a fiber, so every
// emulated thread sees its own values.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
constexpr int warpSize = 32;
