// Planted misuse of welder_wgmma.cuh (and one emulator-only observation): each kernel is valid CUDA
// that compiles with nvcc for sm_90a, and each misuse must be reported by the emulator
// (tests/test_emulator_wgmma.py).  The operands: A K-major without swizzle at byte 0 (LBO 128, SBO
// 256, 2048 bytes), B (N = 8) K-major without swizzle at byte 2048 (256 bytes); nbytes = 4096.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"

// mode 0: warp 3 leaves before the wgmma.  1: (launched with 96 threads) not a whole warpgroup.
// 2: a thread overwrites A before the wait.  3: B's descriptor points past the dynamic buffer.
// 4: no __syncthreads between the copy and the wgmma.  5: no fence.proxy.async.  6: the threads
// exit without waiting.  7: no wgmma.fence.
extern "C" __global__ void wgmma_misuse(const unsigned char* __restrict__ image, float* __restrict__ out, int mode) {
  WELDER_SMEM_BEGIN;
  constexpr int kBytes = 4096;
  WELDER_SHARED(unsigned char, tile, 0, kBytes);
  const int tid = threadIdx.x;
  for (int i = tid; i < kBytes / 16; i += blockDim.x) welder_vstore(tile, 16 * i, welder_vload<uint4>(image, 16 * i));
  if (mode != 5) welder_fence_proxy_async();
  if (mode != 4) __syncthreads();
  if (mode == 0 && tid >= 96) return;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint64_t desc_a = welder_wgmma_desc(tile, 0, 128, 256);
  const uint64_t desc_b = welder_wgmma_desc(tile + (mode == 3 ? kBytes - 128 : 2048), 0, 128, 256);
  if (mode != 7) welder_wgmma_fence();
  welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a, desc_b, 0);
  welder_wgmma_commit();
  if (mode == 2 && tid == 5) tile[100] = 0;
  if (mode == 6) return;
  welder_wgmma_wait<0>();
  for (int i = 0; i < 4; ++i) out[4 * tid + i] = d[i];
}

// Reading the accumulators before the wait that covers their wgmma: on the GPU undefined; here
// they still hold their old values, which `early` records (late: after the wait).  A and B as for
// wgmma_misuse; d starts as c and the wgmma accumulates onto it.
extern "C" __global__ void wgmma_early_read(const unsigned char* __restrict__ image, const float* __restrict__ c,
                                            float* __restrict__ early, float* __restrict__ late) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, tile, 0, 4096);
  const int tid = threadIdx.x;
  for (int i = tid; i < 4096 / 16; i += blockDim.x) welder_vstore(tile, 16 * i, welder_vload<uint4>(image, 16 * i));
  welder_fence_proxy_async();
  __syncthreads();
  float d[4];
  for (int i = 0; i < 4; ++i) d[i] = c[4 * tid + i];
  welder_wgmma_fence();
  welder_wgmma_m64k16_f16f32<8, 0, 0>(d, welder_wgmma_desc(tile, 0, 128, 256), welder_wgmma_desc(tile + 2048, 0, 128, 256),
                                      1);
  welder_wgmma_commit();
  for (int i = 0; i < 4; ++i) early[4 * tid + i] = d[i];
  welder_wgmma_wait<0>();
  for (int i = 0; i < 4; ++i) late[4 * tid + i] = d[i];
}
