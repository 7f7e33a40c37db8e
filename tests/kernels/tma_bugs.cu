// Planted misuse of welder_tma.cuh: valid CUDA that compiles with nvcc for sm_90a, each mode a
// mistake the emulator must report (tests/test_emulator_tma.py).  One warpgroup; `map` covers A
// (64 x 16 fp16, K-major) with a box of the whole tile and the 32B swizzle, as in tma_units.cu's
// tma_wgmma; B (8 x 16 fp16) is written into shared memory by plain stores in the same layout.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

// mode 0: the issuing thread reads the TMA destination before anyone waited on its mbarrier.
//      1: a wgmma reads the TMA destination before the wait.
//      2: a second arrival on a phase that already has its one arrival (and awaits bytes).
//      3: the mbarrier expects two arrivals, only one comes: every thread waits forever.
//      4: expect_tx announces fewer bytes than the load delivers.
//      5: no fence.mbarrier_init after the init.
//      6: the threads exit with the load in flight.
//      7: another thread arrives before a __syncthreads made the init visible.
//      8: a plain store into the mbarrier's bytes.
//      9: the destination is not 128-byte aligned.
//     10: only half the warpgroup executes setmaxnreg.
//     11: (correct TMA) B written by plain stores without fence.proxy.async before the wgmma.
//     12: the load writes into a slot a wgmma in flight still reads.
//     -1: everything right: out = D of A B.
extern "C" __global__ void tma_misuse(const __grid_constant__ CUtensorMap map, [[maybe_unused]] const __half* __restrict__ a,
                                      const __half* __restrict__ b, float* __restrict__ out, int mode) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(uint64_t, bar, pad, 1);
  WELDER_SHARED(__half, tile_a, pad + 1024 + (mode == 9 ? 64 : 0), 64 * 16);
  WELDER_SHARED(__half, tile_b, pad + 1024 + 4096, 8 * 16);
  WELDER_SHARED(unsigned char, bar_bytes, pad, 8);
  const int tid = threadIdx.x;
  // B's element i = 16n + k at byte 2i of the 1024-aligned tile, 16-byte unit bit 0 XOR address bit 7.
  for (int i = tid; i < 8 * 16; i += blockDim.x) tile_b[(2 * i ^ ((2 * i >> 7) & 1) << 4) / 2] = b[i];
  if (mode != 11) welder_fence_proxy_async();
  if (tid == 0) {
    welder_mbarrier_init(bar, mode == 3 ? 2 : 1);
    if (mode != 5) welder_mbarrier_init_fence();
  }
  if (mode == 7 && tid == 1) welder_mbarrier_arrive(bar);
  __syncthreads();
  if (mode == 10 && tid < 64) welder_setmaxnreg_dec<40>();
  if (mode == 8 && tid == 2) bar_bytes[0] = 0;
  if (tid == 0) {
    welder_mbarrier_arrive_expect_tx(bar, mode == 4 ? 1024 : 64 * 16 * 2);
    welder_tma_load_2d(tile_a, &map, bar, 0, 0);
    if (mode == 2) welder_mbarrier_arrive(bar);
  }
  __syncthreads();
  if (mode == 0 && tid == 0) out[0] = __half2float(tile_a[3]);
  if (mode == 6) return;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint64_t desc_a = welder_wgmma_desc(tile_a, 32, 16, 256), desc_b = welder_wgmma_desc(tile_b, 32, 16, 256);
  if (mode != 1) welder_mbarrier_wait(bar, 0);
  welder_wgmma_fence();
  welder_wgmma_m64k16_f16f32<8, 0, 0>(d, desc_a, desc_b, 0);
  welder_wgmma_commit();
  if (mode == 12 && tid == 0) {
    welder_mbarrier_arrive_expect_tx(bar, 64 * 16 * 2);
    welder_tma_load_2d(tile_a, &map, bar, 0, 0);
  }
  welder_wgmma_wait<0>();
  welder_wgmma_fence_operand(d);
  for (int i = 0; i < 4; ++i) out[4 * tid + i] = d[i];
}
