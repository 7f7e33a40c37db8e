// Planted misuse of welder_tma.cuh's TMA stores: valid CUDA that compiles with nvcc for sm_90a, each
// mode a mistake the emulator must report (tests/test_emulator_tma.py).  One warp; `map` covers C
// (32 x 64 fp16) with a box of 16 rows and the 128B swizzle.  The warp writes rows 0-15 of 2 x + 1
// (x: 32 x 64 fp32) into a staging panel, as tma_store_units.cu's epilogue does, and lane 0 stores
// it; then the same with rows 16-31, through the same panel.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

namespace tma_store_bugs {

// Rows [0, rows) of the 16 x 64 strip of 2 x + 1 into the 128B-swizzled panel, lane (g, t) holding
// columns 8j + 2t, 8j + 2t + 1 of rows g and g + 8.
__device__ void stage(WELDER_SMEM_PTR(__half2) panel, const float* __restrict__ x, int rows) {
  const int g = threadIdx.x / 4, t = threadIdx.x % 4;
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h, c = 8 * j + 2 * t;
      if (r >= rows) continue;
      const int at = r * 128 + ((c * 2 / 16) ^ (r % 8)) * 16 + c * 2 % 16;
      panel[at / 4] = __floats2half2_rn(2.0f * x[r * 64 + c] + 1.0f, 2.0f * x[r * 64 + c + 1] + 1.0f);
    }
}

}  // namespace tma_store_bugs

// mode 0: only lane 0 runs fence.proxy.async; the other lanes' writes reach the store unfenced.
//      1: every lane fences, but a __shfl_sync (which orders no memory) stands where the __syncwarp
//         belongs.
//      2: the lanes write the panel again (rows 16-31) before lane 0 waited for the first store to
//         read it.
//      3: lane 0 commits the second store and exits without waiting for it.
//      4: the panel is 128 bytes past a 1024-byte boundary (the 128B swizzle needs 1024).
//      5: the box starts 4 elements (8 bytes) into a row.
//      6: lane 0 waits, but the others rewrite the panel without a __syncwarp after its wait.
//      7: lane 0 never commits the second store: its final wait leaves the open group in flight.
//      8: rows 8-15 of the first strip are never written.
//      9: lane 0 stores while its cp.async into the panel is still in flight.
//     10: lane 0 loads the next strip by TMA into the panel the first store still reads.
//     11: lane 0 waits with N = 1, which leaves the first store's group (the only one) in flight.
//     12: lane 0 never commits the first store: its wait leaves the open group in flight.
//     -1: everything right: c = 2 x + 1.
extern "C" __global__ void tma_store_misuse(const float* __restrict__ x, [[maybe_unused]] __half* __restrict__ c,
                                            const __grid_constant__ CUtensorMap map, int mode) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(__half2, panel, pad + (mode == 4 ? 128 : 0), 16 * 64 / 2);
  WELDER_SHARED(uint64_t, bar, pad + 3072, 1);
  const int lane = threadIdx.x, c0 = mode == 5 ? 4 : 0;
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      if (lane == 0 && mode == 11) welder_tma_store_wait_read<1>();
      if (lane == 0 && mode != 2 && mode != 11) welder_tma_store_wait_read<0>();
      if (mode != 6) __syncwarp();
    }
    tma_store_bugs::stage(panel, x + round * 16 * 64, mode == 8 ? 8 : 16);
    if (mode != 0 || lane == 0) welder_fence_proxy_async();
    if (mode == 1) {
      (void)__shfl_sync(0xffffffffu, lane, 0);
    } else {
      __syncwarp();
    }
    if (lane == 0) {
      if (mode == 9) welder_cp_async<16>(panel, x);
      welder_tma_store_2d(&map, panel, c0, 16 * round);
      if ((mode != 7 || round == 0) && (mode != 12 || round == 1)) welder_tma_store_commit();
      if (mode == 10 && round == 0) {
        welder_mbarrier_init(bar, 1);
        welder_mbarrier_init_fence();
        welder_mbarrier_arrive_expect_tx(bar, 16 * 64 * 2);
        welder_tma_load_2d(panel, &map, bar, 0, 16);
      }
    }
  }
  if (lane == 0 && mode != 3) welder_tma_store_wait<0>();
}
