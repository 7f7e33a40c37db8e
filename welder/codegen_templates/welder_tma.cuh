// welder_tma.cuh -- Hopper bulk tensor copies (TMA) and mbarriers (sm_90a), after welder_wgmma.cuh.
//
// Under nvcc each device call is one PTX instruction (the wait: a loop on one); under the CPU
// emulator (WELDER_EMULATE) they are implemented in welder/runtime/emu/emu_tma.h with extra checks.
//
// mbarriers: 64-bit objects in shared memory (a uint64_t view position).
//   welder_mbarrier_init(bar, arrivals)        mbarrier.init.shared::cta.b64: a phase completes after
//                                              `arrivals` arrivals and all expected transaction bytes
//   welder_mbarrier_init_fence()               fence.mbarrier_init.release.cluster: makes this thread's
//                                              inits visible to the copy engine; then __syncthreads
//   welder_mbarrier_arrive(bar)                mbarrier.arrive.shared::cta.b64 (release, cta)
//   welder_mbarrier_arrive_expect_tx(bar, n)   mbarrier.arrive.expect_tx.shared::cta.b64: expects n
//                                              more transaction bytes in this phase, then arrives
//   welder_mbarrier_wait(bar, parity)          loops on mbarrier.try_wait.parity.shared::cta.b64 until
//                                              the phase of that parity (0 for phases 0, 2, 4, ...)
//                                              completed
// TMA, tile mode, global -> shared, completing the box's bytes on `bar`; coordinates in elements,
// innermost first, may be negative or past the end (those elements arrive as zeros):
//   welder_tma_load_1d(dst, map, bar, c0) ... welder_tma_load_5d(dst, map, bar, c0, ..., c4)
//       cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes; dst is
//       128-byte aligned (1024 with the 128B swizzle); the box lands row-major (innermost
//       contiguous), each 16-byte unit at address bits 4.. XORed with bits 7.. (1, 2 or 3 bits for
//       the 32, 64 or 128B swizzle): the layouts welder_wgmma_desc describes.  c0 times the
//       element size must be a multiple of 16 bytes (an H100 faults otherwise).
// TMA, tile mode, shared -> global, in bulk groups of the issuing thread:
//   welder_tma_store_1d(map, src, c0) ... welder_tma_store_5d(map, src, c0, ..., c4)
//       cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group: writes the box at coordinates c (as
//       for loads: innermost first, c0 times the element size a multiple of 16 bytes) from src,
//       aligned as a load's dst, where the box lies as a load of it would land (swizzled alike);
//       elements outside the tensor are not written.  The copy engine reads src through the async
//       proxy: each thread that wrote it runs welder_fence_proxy_async() after its writes, and a
//       __syncwarp or __syncthreads orders that before the store.
//   welder_tma_store_commit()                  cp.async.bulk.commit_group: closes this thread's open
//                                              bulk group
//   welder_tma_store_wait_read<N>()            cp.async.bulk.wait_group.read N: all but the N most
//                                              recent committed groups have read their sources, which
//                                              may then be written again (other threads: after a
//                                              __syncwarp or barrier following the wait); every group
//                                              must have been read before the thread exits
//   welder_tma_store_wait<N>()                 cp.async.bulk.wait_group N: all but the N most recent
//                                              committed groups have completed (global writes done)
//   welder_tma_prefetch_map(map)               prefetch.tensormap
//   welder_setmaxnreg_inc<N>() / _dec<N>()     setmaxnreg.{inc,dec}.sync.aligned.u32 N (warpgroup-wide;
//                                              N a multiple of 8 in [24, 256])
// Maps are kernel parameters `const __grid_constant__ CUtensorMap name`, passed on as `&name`.
// Clusters -- cluster barrier, arrivals on a peer block's mbarrier, multicast loads -- are in
// welder_cluster.cuh, included at the end of this file.
//
// Host side (also for the generated runtime's C++):
//   welder_encode_tensor_map(map, elem_bytes, rank, base, dims, strides_bytes, box, swizzle_bytes)
//       a tiled map over `rank` (1..5) dims: dims[] and box[] innermost first, strides_bytes[] the
//       rank - 1 byte strides of dims 1..; elem_bytes 2 (fp16) or 4 (fp32); swizzle 0/32/64/128.
//       Interleave none, L2 promotion 128B, out-of-bounds fill zeros, element strides 1.  0 on
//       success, else a WelderTensorMapStatus code (welder_tensor_map.cuh, which states the rules).
//       On the GPU it calls the driver's cuTensorMapEncodeTiled, found through the runtime's
//       cudaGetDriverEntryPointByVersion, so nothing links -lcuda.
#pragma once

#include "welder_tensor_map.cuh"
#include "welder_wgmma.cuh"

#ifdef WELDER_EMULATE

#include "emu_tma.h"

#else  // nvcc

#include <cuda.h>  // CUtensorMap and the driver's enums (declarations only)
#include <cuda_runtime_api.h>

#include <cstdint>

__device__ __forceinline__ void welder_mbarrier_init(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(welder_shared_address(bar)), "r"(arrivals)
               : "memory");
}

__device__ __forceinline__ void welder_mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void welder_mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                   welder_shared_address(bar))
               : "memory");
}

__device__ __forceinline__ void welder_mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                   welder_shared_address(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void welder_mbarrier_wait(uint64_t* bar, unsigned parity) {
  const unsigned address = welder_shared_address(bar);
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
}

#define WELDER_TMA_LOAD(N, COORDS, ...)                                                                              \
  asm volatile("cp.async.bulk.tensor." #N "d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, " \
               COORDS "], [%2];\n" ::"r"(welder_shared_address(dst)),                                                 \
               "l"(reinterpret_cast<uint64_t>(map)), "r"(welder_shared_address(bar)), __VA_ARGS__                     \
               : "memory")

__device__ __forceinline__ void welder_tma_load_1d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0) {
  WELDER_TMA_LOAD(1, "{%3}", "r"(c0));
}
__device__ __forceinline__ void welder_tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  WELDER_TMA_LOAD(2, "{%3, %4}", "r"(c0), "r"(c1));
}
__device__ __forceinline__ void welder_tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                   int c2) {
  WELDER_TMA_LOAD(3, "{%3, %4, %5}", "r"(c0), "r"(c1), "r"(c2));
}
__device__ __forceinline__ void welder_tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                   int c2, int c3) {
  WELDER_TMA_LOAD(4, "{%3, %4, %5, %6}", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}
__device__ __forceinline__ void welder_tma_load_5d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                   int c2, int c3, int c4) {
  WELDER_TMA_LOAD(5, "{%3, %4, %5, %6, %7}", "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4));
}
#undef WELDER_TMA_LOAD

#define WELDER_TMA_STORE(N, COORDS, ...)                                                                             \
  asm volatile("cp.async.bulk.tensor." #N "d.global.shared::cta.bulk_group [%0, " COORDS "], [%1];\n" ::"l"(         \
                   reinterpret_cast<uint64_t>(map)),                                                                 \
               "r"(welder_shared_address(src)), __VA_ARGS__                                                          \
               : "memory")

__device__ __forceinline__ void welder_tma_store_1d(const CUtensorMap* map, const void* src, int c0) {
  WELDER_TMA_STORE(1, "{%2}", "r"(c0));
}
__device__ __forceinline__ void welder_tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  WELDER_TMA_STORE(2, "{%2, %3}", "r"(c0), "r"(c1));
}
__device__ __forceinline__ void welder_tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  WELDER_TMA_STORE(3, "{%2, %3, %4}", "r"(c0), "r"(c1), "r"(c2));
}
__device__ __forceinline__ void welder_tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                                    int c3) {
  WELDER_TMA_STORE(4, "{%2, %3, %4, %5}", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}
__device__ __forceinline__ void welder_tma_store_5d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                                    int c3, int c4) {
  WELDER_TMA_STORE(5, "{%2, %3, %4, %5, %6}", "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4));
}
#undef WELDER_TMA_STORE

__device__ __forceinline__ void welder_tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void welder_tma_store_wait_read() {
  static_assert(N >= 0, "cp.async.bulk.wait_group.read takes a count of groups >= 0");
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void welder_tma_store_wait() {
  static_assert(N >= 0, "cp.async.bulk.wait_group takes a count of groups >= 0");
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void welder_tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

template <int N>
__device__ __forceinline__ void welder_setmaxnreg_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void welder_setmaxnreg_dec() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ------------------------------------------------------------------------------------ host side

// The driver's element type for an element size.  bf16 (CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) will take
// a parameter of its own: 2 bytes alone cannot tell it from fp16.
inline CUtensorMapDataType welder_tensor_map_data_type(int elem_bytes) {
  return elem_bytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

inline int welder_encode_tensor_map(CUtensorMap* map, int elem_bytes, int rank, const void* base,
                                    const unsigned long long* dims, const unsigned long long* strides_bytes,
                                    const unsigned* box, int swizzle_bytes) {
  if (map == nullptr) return kWelderTensorMapNullArgument;
  const int status = welder_tensor_map_check(elem_bytes, rank, base, dims, strides_bytes, box, swizzle_bytes);
  if (status != kWelderTensorMapOk) return status;
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t error =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return error == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<Encode>(fn) : nullptr;
  }();
  if (encode == nullptr) return kWelderTensorMapNoDriver;
  cuuint64_t global_dims[5], global_strides[4];
  cuuint32_t box_dims[5], element_strides[5];
  for (int i = 0; i < rank; ++i) {
    global_dims[i] = dims[i];
    box_dims[i] = box[i];
    element_strides[i] = 1;
    if (i + 1 < rank) global_strides[i] = strides_bytes[i];
  }
  const CUtensorMapSwizzle swizzle = swizzle_bytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                     : swizzle_bytes == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                           : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUresult result = encode(map, welder_tensor_map_data_type(elem_bytes), static_cast<cuuint32_t>(rank),
                                 const_cast<void*>(base), global_dims, global_strides, box_dims, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? kWelderTensorMapOk : kWelderTensorMapDriverRejected;
}

#endif

#include "welder_cluster.cuh"
