// Units of welder_tma.cuh: one TMA load of a box (rank 1-5, any swizzle) into shared memory, whose
// bytes the kernel copies out so that tests/test_emulator_tma.py and test_gpu_tma.py can compare
// them with a numpy model of the copy engine; and a single wgmma whose operands both arrive by TMA
// (32B swizzle), which shows that the TMA's swizzled layout is the one wgmma's descriptors read.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

// Shared memory: up to 1023 bytes of padding so that `bar` sits at a 1024-aligned shared address,
// the mbarrier, and the box at 1024 + dst_offset past it.  Launch with 2048 + dst_offset +
// box_bytes bytes.  `src` is the tensor `map` covers (it only travels with the map).
extern "C" __global__ void tma_box(const __grid_constant__ CUtensorMap map, [[maybe_unused]] const unsigned char* __restrict__ src,
                                   unsigned char* __restrict__ out, int rank, int box_bytes, int dst_offset, int c0,
                                   int c1, int c2, int c3, int c4) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(uint64_t, bar, pad, 1);
  WELDER_SHARED(unsigned char, tile, pad + 1024 + dst_offset, box_bytes);
  if (threadIdx.x == 0) {
    welder_mbarrier_init(bar, 1);
    welder_mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    welder_tma_prefetch_map(&map);
    welder_mbarrier_arrive_expect_tx(bar, box_bytes);
    switch (rank) {
      case 1: welder_tma_load_1d(tile, &map, bar, c0); break;
      case 2: welder_tma_load_2d(tile, &map, bar, c0, c1); break;
      case 3: welder_tma_load_3d(tile, &map, bar, c0, c1, c2); break;
      case 4: welder_tma_load_4d(tile, &map, bar, c0, c1, c2, c3); break;
      default: welder_tma_load_5d(tile, &map, bar, c0, c1, c2, c3, c4); break;
    }
  }
  welder_mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) out[i] = tile[i];
}

// D (64x8, fp32) = A (64x16) B (16x8) with A [64][16] and B [8][16] (K-major, fp16) loaded by TMA
// with the 32B swizzle (a row of 16 k is one 32-byte span; atoms of 8 rows, SBO 256), straight into
// wgmma: no fence.proxy.async is needed for bytes the copy engine wrote.  out: 128 x 4 accumulators.
extern "C" __global__ void tma_wgmma(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                     [[maybe_unused]] const __half* __restrict__ a, [[maybe_unused]] const __half* __restrict__ b,
                                     float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(uint64_t, bar, pad, 1);
  WELDER_SHARED(__half, tile_a, pad + 1024, 64 * 16);
  WELDER_SHARED(__half, tile_b, pad + 1024 + 2048, 8 * 16);
  const int tid = threadIdx.x;
  if (tid == 0) {
    welder_mbarrier_init(bar, 1);
    welder_mbarrier_init_fence();
  }
  __syncthreads();
  if (tid == 0) {
    welder_mbarrier_arrive_expect_tx(bar, (64 + 8) * 16 * 2);
    welder_tma_load_2d(tile_a, &map_a, bar, 0, 0);
    welder_tma_load_2d(tile_b, &map_b, bar, 0, 0);
  }
  welder_mbarrier_wait(bar, 0);
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  welder_wgmma_fence();
  welder_wgmma_m64k16_f16f32<8, 0, 0>(d, welder_wgmma_desc(tile_a, 32, 16, 256), welder_wgmma_desc(tile_b, 32, 16, 256),
                                      0);
  welder_wgmma_commit();
  welder_wgmma_wait<0>();
  welder_wgmma_fence_operand(d);
  for (int i = 0; i < 4; ++i) out[4 * tid + i] = d[i];
}

// dst[20][44] = src (fp32) through 8x32 TMA boxes, one per block (grid 2 x 3): the shape of a
// generated kernel, whose parameters are its buffers followed by its tensor maps (map covers src).
extern "C" __global__ void tma_tile_copy([[maybe_unused]] const float* __restrict__ src, float* __restrict__ dst,
                                         const __grid_constant__ CUtensorMap map) {
  constexpr int rows = 20, cols = 44;
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(uint64_t, bar, pad, 1);
  WELDER_SHARED(float, tile, pad + 1024, 8 * 32);
  const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 8;
  if (threadIdx.x == 0) {
    welder_mbarrier_init(bar, 1);
    welder_mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    welder_mbarrier_arrive_expect_tx(bar, 8 * 32 * 4);
    welder_tma_load_2d(tile, &map, bar, c0, r0);
  }
  welder_mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < 8 * 32; i += blockDim.x) {
    const int r = r0 + i / 32, c = c0 + i % 32;
    if (r < rows && c < cols) dst[(size_t)r * cols + c] = float(tile[i]);
  }
}
