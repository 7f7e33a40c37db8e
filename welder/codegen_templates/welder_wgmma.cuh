// welder_wgmma.cuh -- Hopper warpgroup MMA for mma kernels (sm_90a), after welder_mma.cuh.
//
// Under nvcc each call is one PTX instruction; under the CPU emulator (WELDER_EMULATE) they are
// implemented in welder/runtime/emu/emu_wgmma.h with the same results and extra checks.
//
//   welder_wgmma_desc(p, swizzle_bytes, lbo_bytes, sbo_bytes)
//       the 64-bit matrix descriptor of an operand at shared view position p (a T* under nvcc):
//       start address (bits 0-13, address >> 4), LBO (16-29, >> 4), SBO (32-45, >> 4), base offset
//       0, layout (62-63: 0 none, 1 128B, 2 64B, 3 32B swizzle).  Adding k to the descriptor
//       advances its start address by 16k bytes (how a chain of k16 steps walks a tile).
//   welder_wgmma_m64k16_f16f32<N, kTransA, kTransB>(d, desc_a, desc_b, accumulate)
//   welder_wgmma_m64k16_bf16f32<...>(...)   the same with bf16 operands
//       D (64xN, fp32) = A (64x16) * B (16xN) + (accumulate ? D : 0), both operands in shared
//       memory; kTransA / kTransB = 1: the operand is MN-major there (0: K-major).  N is a
//       multiple of 8 from 8 to 256; float d[N / 2] per thread.  Thread m of the warpgroup
//       (warp w = m / 32, g = (m % 32) / 4, t = m % 4) holds, for j < N / 8:
//         d[4j + 0..1] = D[16w + g][8j + 2t .. +1],  d[4j + 2..3] = D[16w + g + 8][8j + 2t .. +1]
//       Asynchronous: D is written, and the operands may be read, until a welder_wgmma_wait
//       covers the operation's group.
//   welder_wgmma_fence()          wgmma.fence: before the first wgmma, and after touching the
//                                 accumulators (so after each wait) before the next wgmma
//   welder_wgmma_commit()         wgmma.commit_group: closes the warpgroup's group of wgmma
//   welder_wgmma_wait<N>()        wgmma.wait_group N: all but the N most recent groups complete
//   welder_fence_proxy_async()    fence.proxy.async.shared::cta: makes this thread's shared-memory
//                                 writes (stores, landed cp.async) visible to wgmma and TMA stores
//                                 (the async proxy); a __syncthreads must follow before the wgmma
//                                 (before a TMA store by a lane of the same warp, a __syncwarp)
//   welder_wgmma_fence_operand(d) keeps nvcc from moving accumulator accesses across wgmma and
//                                 its waits (no instruction; nothing under the emulator)
//
// Everything here is warpgroup-synchronous: all 128 threads of warps 4i..4i+3 execute the same
// call.  Shared-memory layouts of the operands (canonical layouts of the PTX ISA): see
// docs/emulator.md or emu_wgmma.h.
#pragma once

#include "welder_mma.cuh"

#ifdef WELDER_EMULATE

#include "emu_wgmma.h"

#else  // nvcc

#include <cstdint>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "welder_wgmma.cuh needs sm_90a (wgmma is not in the portable sm_90 target): compile with -arch=sm_90a"
#endif

#include "welder_wgmma_asm.cuh"

template <class T>
__device__ __forceinline__ uint64_t welder_wgmma_desc(const T* p, int swizzle_bytes, int lbo_bytes, int sbo_bytes) {
  const uint64_t layout = swizzle_bytes == 128 ? 1 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 3 : 0;
  return uint64_t{(welder_shared_address(p) & 0x3FFFFu) >> 4} | uint64_t{static_cast<unsigned>(lbo_bytes) >> 4} << 16 |
         uint64_t{static_cast<unsigned>(sbo_bytes) >> 4} << 32 | layout << 62;
}

template <int N, int kTransA, int kTransB>
__device__ __forceinline__ void welder_wgmma_m64k16_f16f32(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                           int accumulate) {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma .m64nNk16: N is a multiple of 8 from 8 to 256");
  welder_wgmma_detail::Mma<N>::template f16<kTransA, kTransB>(d, desc_a, desc_b, accumulate);
}

template <int N, int kTransA, int kTransB>
__device__ __forceinline__ void welder_wgmma_m64k16_bf16f32(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                            int accumulate) {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma .m64nNk16: N is a multiple of 8 from 8 to 256");
  welder_wgmma_detail::Mma<N>::template bf16<kTransA, kTransB>(d, desc_a, desc_b, accumulate);
}

__device__ __forceinline__ void welder_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void welder_wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void welder_wgmma_wait() {
  static_assert(N >= 0, "wgmma.wait_group takes a count of groups >= 0");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void welder_fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void welder_wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#endif
