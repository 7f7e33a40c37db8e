// welder_mma.cuh -- tensor-core building blocks for mma kernels (sm_80 and later), after the prelude.
//
// Under nvcc each function is one PTX instruction; under the CPU emulator (WELDER_EMULATE) they are
// implemented in welder/runtime/emu/emu_mma.h with the same register contents and extra checks.
// A "register" is a uint32_t; two 16-bit elements share one, the lower-indexed in the low half.
// g = lane / 4, t = lane % 4:
//
//   welder_mma_m16n8k16_f16f32(d, a, b, c)   d = a * b + c; A 16x16 and B 16x8 in fp16, C/D 16x8 fp32
//   welder_mma_m16n8k16_bf16f32(d, a, b, c)  the same with bf16 operands
//   welder_mma_m16n8k8_tf32(d, a, b, c)      A 16x8, B 8x8 as tf32 (fp32 bit patterns), C/D fp32
//       float d[4], const uint32_t a[4], b[2], const float c[4]; d may be c.
//       m16n8k16: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//                 b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//       m16n8k8:  a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4]
//                 b[0] = B[t][g], b[1] = B[t+4][g]
//       C, D:     c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
//   welder_float_to_tf32(f)                  f rounded to tf32 (cvt.rna), as a uint32_t operand
//   welder_tf32_split(x, lo)                 x (fp32 bits) becomes its tf32 rounding hi, lo x - hi,
//                                            which the tensor core truncates: x = hi + lo to 2^-21
//   welder_register(pair)                    a __half2 or __nv_bfloat162 as the register holding it
//
//   welder_ldmatrix_x1/x2/x4(r, p)           loads 1/2/4 8x8 matrices of 16-bit elements from shared
//   welder_ldmatrix_x1/x2/x4_trans(r, p)     memory; p is a view plus an element offset (a T* under
//       nvcc).  Lane 8i+j passes the address of row j of matrix i (16 bytes, 16-byte aligned; lanes
//       past 8 * count pass anything).  r[i] of lane l = elements 2t, 2t+1 of row g of matrix i;
//       _trans: element g of rows 2t and 2t+1.  A 16x16 A operand is one x4 (lane l addresses row
//       l % 16, column 8 * (l / 16)); a k16 x n16 row-major B tile is one x4_trans, giving b for two
//       n8 tiles (r[0], r[1] and r[2], r[3]).
//
//   welder_cp_async<B>(dst, src, src_bytes = B)  asynchronous copy of B = 4, 8 or 16 bytes from global
//       src to the shared view position dst, both B-aligned; only the first src_bytes are read and
//       the rest of the B bytes are zero-filled (0 reads nothing: how ragged tile edges are loaded).
//   welder_cp_async_commit()                 closes this thread's current group of copies
//   welder_cp_async_wait<N>()                waits until at most the N most recent committed groups
//                                            of this thread are pending (copies are per thread: a
//                                            __syncthreads must follow before other threads read)
//   welder_cp_async_wait_all()               commits, then waits for every copy of this thread
//
// mma and ldmatrix are warp-synchronous: every lane of the warp must execute the same call.
#pragma once

#include "welder_prelude.cuh"

#ifdef WELDER_EMULATE

#include "emu_mma.h"

#else  // nvcc

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "welder_mma.cuh needs sm_80 or later (mma.sync m16n8k16, ldmatrix, cp.async)"
#endif

__device__ __forceinline__ void welder_mma_m16n8k16_f16f32(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

__device__ __forceinline__ void welder_mma_m16n8k16_bf16f32(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

__device__ __forceinline__ void welder_mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                        const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
}

__device__ __forceinline__ uint32_t welder_float_to_tf32(float f) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(out) : "f"(f));
  return out;
}

__device__ __forceinline__ unsigned welder_shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The "memory" clobbers keep the compiler from moving ordinary shared-memory accesses across these.
template <class T>
__device__ __forceinline__ void welder_ldmatrix_x1(uint32_t (&r)[1], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(welder_shared_address(p))
               : "memory");
}
template <class T>
__device__ __forceinline__ void welder_ldmatrix_x2(uint32_t (&r)[2], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(welder_shared_address(p))
               : "memory");
}
template <class T>
__device__ __forceinline__ void welder_ldmatrix_x4(uint32_t (&r)[4], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(welder_shared_address(p))
               : "memory");
}
template <class T>
__device__ __forceinline__ void welder_ldmatrix_x1_trans(uint32_t (&r)[1], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(welder_shared_address(p))
               : "memory");
}
template <class T>
__device__ __forceinline__ void welder_ldmatrix_x2_trans(uint32_t (&r)[2], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(welder_shared_address(p))
               : "memory");
}
template <class T>
__device__ __forceinline__ void welder_ldmatrix_x4_trans(uint32_t (&r)[4], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(welder_shared_address(p))
               : "memory");
}

// 16-byte copies bypass L1 (.cg); 4- and 8-byte copies can only go through it (.ca).
template <int kBytes, class T, class S>
__device__ __forceinline__ void welder_cp_async(T* dst, const S* src, int src_bytes = kBytes) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(welder_shared_address(dst)), "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :
                 : "r"(welder_shared_address(dst)), "l"(__cvta_generic_to_global(src)), "n"(kBytes), "r"(src_bytes)
                 : "memory");
  }
}

__device__ __forceinline__ void welder_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void welder_cp_async_wait() {
  static_assert(kPending >= 0, "cp.async.wait_group takes a count of groups >= 0");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void welder_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

#endif

template <class T2>
__device__ __forceinline__ uint32_t welder_register(T2 pair) {
  static_assert(sizeof(T2) == 4, "a register holds two 16-bit elements");
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// hi is x rounded to nearest, ties away, as cvt.rna rounds finite values below the largest
// (two integer instructions where sm_90's cvt.rna.tf32 takes four); x - hi is exact in fp32,
// and the tensor core reads its leading 11 bits as lo.  An infinite x has a NaN lo: its
// products are NaN where exact fp32's are infinite.
__device__ __forceinline__ void welder_tf32_split(uint32_t& x, uint32_t& lo) {
  const float f = __uint_as_float(x);
  x = (x + 0x1000u) & 0xFFFFE000u;
  lo = __float_as_uint(f - __uint_as_float(x));
}
