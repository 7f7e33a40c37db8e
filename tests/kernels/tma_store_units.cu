// Units of welder_tma.cuh's TMA stores, run by tests/test_emulator_tma.py and test_gpu_tma.py:
//  - tma_store_box: one store of a box (rank 1-5, any swizzle) from a shared image that the test lays
//    out with tests/tma_reference.py's numpy model of the copy engine; afterwards the tensor must hold
//    the box's elements that lie inside it, and nothing else may have changed;
//  - tma_store_epilogue: the staged epilogue of a persistent wgmma kernel.  Each block walks tiles of
//    16 * warps rows and 128 columns of C (fp16); each warp writes its 16-row strip, as the values of
//    a wgmma accumulator fragment, with half2 stores into a staging area of two 128B-swizzled
//    64-column panels, fences, __syncwarp()s, and lane 0 stores the panels by TMA as one bulk group.
//    Each warp has two staging areas used by alternate tiles: before rewriting one, lane 0 waits
//    until all but the latest group (the other area's) have read their panels, then __syncwarp().
//    tma_store_epilogue_cluster runs the same in clusters of two blocks.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

// Shared memory: up to 1023 bytes of padding so that the box starts 1024 + src_offset bytes past a
// 1024-aligned shared address, as tma_box's does.  Launch with 2048 + src_offset + box_bytes bytes.
// `image` holds the box's shared bytes; `map` covers `dst` (which only travels with the map).
extern "C" __global__ void tma_store_box(const __grid_constant__ CUtensorMap map,
                                         [[maybe_unused]] unsigned char* __restrict__ dst,
                                         const unsigned char* __restrict__ image, int rank, int box_bytes,
                                         int src_offset, int c0, int c1, int c2, int c3, int c4) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(unsigned char, tile, pad + 1024 + src_offset, box_bytes);
  for (int i = threadIdx.x; i < box_bytes; i += blockDim.x) tile[i] = image[i];
  // Every writer's fence, then the barrier, before thread 0 hands the bytes to the copy engine.
  welder_fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    switch (rank) {
      case 1: welder_tma_store_1d(&map, tile, c0); break;
      case 2: welder_tma_store_2d(&map, tile, c0, c1); break;
      case 3: welder_tma_store_3d(&map, tile, c0, c1, c2); break;
      case 4: welder_tma_store_4d(&map, tile, c0, c1, c2, c3); break;
      default: welder_tma_store_5d(&map, tile, c0, c1, c2, c3, c4); break;
    }
    welder_tma_store_commit();
    welder_tma_store_wait_read<0>();
  }
}

namespace tma_store_units {

constexpr int kPanelBytes = 16 * 128;        // 16 rows of 64 fp16 columns
constexpr int kStageBytes = 2 * kPanelBytes;  // one staging area: the strip's two panels

// C = 2 x + 1 (x fp32 [m][n], C fp16 with the map's row pitch) through the staging described at the
// top.  Launch with 1024 + warps * 2 * kStageBytes bytes of shared memory.
__device__ void epilogue(const float* __restrict__ x, const CUtensorMap& map, int m, int n) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  WELDER_SHARED(__half2, stage, pad + warp * 2 * kStageBytes, 2 * kStageBytes / 4);
  const int tile_rows = 16 * warps, tiles_n = (n + 127) / 128, tiles = (m + tile_rows - 1) / tile_rows * tiles_n;
  const int g = lane / 4, t = lane % 4;
  int round = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++round) {
    const int area = round % 2;
    // The stores of two tiles ago read this area: wait for them (the last tile's may go on).
    if (lane == 0) welder_tma_store_wait_read<1>();
    __syncwarp();
    const int row0 = tile / tiles_n * tile_rows + 16 * warp, col0 = tile % tiles_n * 128;
    // Lane (g, t) holds columns 8j + 2t, 8j + 2t + 1 of rows g and g + 8 of the strip (the wgmma
    // D fragment).  Column c of a panel row sits in 16-byte unit (2c / 16) XOR (row % 8).
    for (int j = 0; j < 16; ++j)
      for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h, c = 8 * j + 2 * t, gr = row0 + r, gc = col0 + c;
        // Values outside C must not reach it: the store clips them.
        float v0 = -7.0f, v1 = -7.0f;
        if (gr < m && gc < n) v0 = 2.0f * x[(size_t)gr * n + gc] + 1.0f;
        if (gr < m && gc + 1 < n) v1 = 2.0f * x[(size_t)gr * n + gc + 1] + 1.0f;
        const int byte = c % 64 * 2;
        const int at = area * kStageBytes + c / 64 * kPanelBytes + r * 128 + ((byte / 16) ^ (r % 8)) * 16 + byte % 16;
        stage[at / 4] = __floats2half2_rn(v0, v1);
      }
    welder_fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
      for (int p = 0; p < 2; ++p)
        welder_tma_store_2d(&map, stage + (area * kStageBytes + p * kPanelBytes) / 4, col0 + 64 * p, row0);
      welder_tma_store_commit();
    }
  }
  if (lane == 0) welder_tma_store_wait<0>();
}

}  // namespace tma_store_units

extern "C" __global__ void tma_store_epilogue(const float* __restrict__ x, [[maybe_unused]] __half* __restrict__ c,
                                              const __grid_constant__ CUtensorMap map, int m, int n) {
  tma_store_units::epilogue(x, map, m, n);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1)
    tma_store_epilogue_cluster(const float* __restrict__ x, [[maybe_unused]] __half* __restrict__ c,
                               const __grid_constant__ CUtensorMap map, int m, int n) {
  tma_store_units::epilogue(x, map, m, n);
}
WELDER_CLUSTER_DIMS(tma_store_epilogue_cluster, 2)
