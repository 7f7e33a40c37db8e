// welder_cluster.cuh -- Hopper thread-block clusters (sm_90a), included by welder_tma.cuh.
//
// Under nvcc each device call is one PTX instruction (two for the barrier); under the CPU emulator
// (WELDER_EMULATE) they are implemented in welder/runtime/emu/emu_cluster.h with extra checks.
//
// A kernel that uses clusters is declared `__global__ void __cluster_dims__(X, 1, 1) name(...)` and
// followed by one line `WELDER_CLUSTER_DIMS(name, X)`: nothing under nvcc (cuLaunchKernel honours the
// compile-time attribute), a registration the emulator's launch looks up under WELDER_EMULATE.  grid.x
// must be a multiple of X; the blocks blockIdx.x = c X .. c X + X - 1 form cluster c.  Without cluster
// dims each block is a cluster of one, and every call below still works.
//
//   welder_cluster_ctarank()                   %cluster_ctarank: this block's rank in its cluster
//   welder_cluster_sync()                      barrier.cluster.arrive.release.aligned +
//                                              barrier.cluster.wait.acquire.aligned: every thread of
//                                              every block of the cluster; it also makes mbarrier
//                                              inits (after welder_mbarrier_init_fence) visible to
//                                              the peers.  A block must not exit while a peer may
//                                              still use its shared memory: end with it.
//   welder_mbarrier_arrive_cluster(bar, cta)   mapa.shared::cluster + mbarrier.arrive.release.cluster.
//                                              shared::cluster.b64: one arrival on the mbarrier at
//                                              bar's shared position in the block of rank `cta`
//                                              (the caller's own rank included)
// TMA with multicast: like welder_tma_load_Nd, but the box lands at dst's shared position in every
// block whose rank bit is set in `mask`, completing its bytes on the mbarrier at bar's position in
// each of them (whose expect_tx must count them; they may arrive before it):
//   welder_tma_load_1d_multicast(dst, map, bar, mask, c0) ... welder_tma_load_5d_multicast(...)
//       cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes
//       .multicast::cluster
#pragma once

#include "welder_tensor_map.cuh"
#include "welder_wgmma.cuh"

#ifdef WELDER_EMULATE

#include "emu_cluster.h"

#else  // nvcc

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#define WELDER_CLUSTER_DIMS(kernel, ...)

__device__ __forceinline__ unsigned welder_cluster_ctarank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ void welder_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void welder_mbarrier_arrive_cluster(uint64_t* bar, unsigned cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(welder_shared_address(bar)),
      "r"(cta)
      : "memory");
}

#define WELDER_TMA_LOAD_MULTICAST(N, COORDS, ...)                                                                \
  asm volatile("cp.async.bulk.tensor." #N "d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"           \
               ".multicast::cluster [%0], [%1, " COORDS "], [%2], %3;\n" ::"r"(welder_shared_address(dst)),      \
               "l"(reinterpret_cast<uint64_t>(map)), "r"(welder_shared_address(bar)), "h"(mask), __VA_ARGS__ \
               : "memory")

__device__ __forceinline__ void welder_tma_load_1d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                             unsigned short mask, int c0) {
  WELDER_TMA_LOAD_MULTICAST(1, "{%4}", "r"(c0));
}
__device__ __forceinline__ void welder_tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                             unsigned short mask, int c0, int c1) {
  WELDER_TMA_LOAD_MULTICAST(2, "{%4, %5}", "r"(c0), "r"(c1));
}
__device__ __forceinline__ void welder_tma_load_3d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                             unsigned short mask, int c0, int c1, int c2) {
  WELDER_TMA_LOAD_MULTICAST(3, "{%4, %5, %6}", "r"(c0), "r"(c1), "r"(c2));
}
__device__ __forceinline__ void welder_tma_load_4d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                             unsigned short mask, int c0, int c1, int c2, int c3) {
  WELDER_TMA_LOAD_MULTICAST(4, "{%4, %5, %6, %7}", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}
__device__ __forceinline__ void welder_tma_load_5d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                             unsigned short mask, int c0, int c1, int c2, int c3,
                                                             int c4) {
  WELDER_TMA_LOAD_MULTICAST(5, "{%4, %5, %6, %7, %8}", "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4));
}
#undef WELDER_TMA_LOAD_MULTICAST

#endif
