// Units of welder_cluster.cuh, run by tests/test_emulator_cluster.py and test_gpu_cluster.py:
//  - cluster_box_<X>: the blocks of a cluster of X each load 1/X of a box by TMA with multicast to
//    every block of the cluster; each block then holds the whole box and copies it out, for a numpy
//    model of the copy engine (tests/tma_reference.py) to check;
//  - cluster_exchange_<X>: each block writes a value to global memory, and after a cluster barrier
//    reads the one of the next block of its cluster (rank + 1 modulo X), and writes its rank.
// X = 1 is a kernel without cluster dims: each block is a cluster of one.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

namespace cluster_units {

// Shared memory: up to 1023 bytes of padding so that `bar` sits at a 1024-aligned shared address
// (the same in every block, as multicast needs), the mbarrier, and the box 1024 bytes past it.
// Launch with 2048 + kX * part_bytes bytes.  Block rank r of cluster c loads `map`'s box at
// (c0, c1 + (c kX + r) rows) into part r of the tile; out[blockIdx.x] receives the whole tile.
template <unsigned kX>
__device__ void box(const CUtensorMap& map, unsigned char* __restrict__ out, int part_bytes, int rows, int c0, int c1) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(uint64_t, bar, pad, 1);
  WELDER_SHARED(unsigned char, tile, pad + 1024, kX * part_bytes);
  const unsigned rank = welder_cluster_ctarank();
  const int cluster = blockIdx.x / kX, tile_bytes = kX * part_bytes;
  if (threadIdx.x == 0) {
    welder_mbarrier_init(bar, 1);
    welder_mbarrier_init_fence();
  }
  // The peers' loads complete on this block's mbarrier: its init must be visible to them.
  welder_cluster_sync();
  if (threadIdx.x == 0) {
    welder_mbarrier_arrive_expect_tx(bar, tile_bytes);  // every part, the peers' included
    welder_tma_load_2d_multicast(tile + rank * part_bytes, &map, bar, (1u << kX) - 1u, c0,
                                 c1 + (cluster * static_cast<int>(kX) + static_cast<int>(rank)) * rows);
  }
  welder_mbarrier_wait(bar, 0);
  for (int i = threadIdx.x; i < tile_bytes; i += blockDim.x) out[(size_t)blockIdx.x * tile_bytes + i] = tile[i];
  // No block may exit while a peer's load may still write into it.
  welder_cluster_sync();
}

template <unsigned kX>
__device__ void exchange(const float* __restrict__ in, float* __restrict__ scratch, float* __restrict__ out,
                         unsigned* __restrict__ ranks) {
  const unsigned rank = welder_cluster_ctarank();
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  scratch[i] = 2.0f * in[i];
  if (threadIdx.x == 0) ranks[blockIdx.x] = rank;
  welder_cluster_sync();  // orders the peers' writes before these reads
  const unsigned peer = blockIdx.x - rank + (rank + 1) % kX;
  out[i] = scratch[peer * blockDim.x + threadIdx.x];
}

}  // namespace cluster_units

extern "C" __global__ void cluster_box_1(const __grid_constant__ CUtensorMap map,
                                         [[maybe_unused]] const unsigned char* __restrict__ src,
                                         unsigned char* __restrict__ out, int part_bytes, int rows, int c0, int c1) {
  cluster_units::box<1>(map, out, part_bytes, rows, c0, c1);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1)
    cluster_box_2(const __grid_constant__ CUtensorMap map, [[maybe_unused]] const unsigned char* __restrict__ src,
                  unsigned char* __restrict__ out, int part_bytes, int rows, int c0, int c1) {
  cluster_units::box<2>(map, out, part_bytes, rows, c0, c1);
}
WELDER_CLUSTER_DIMS(cluster_box_2, 2)

extern "C" __global__ void __cluster_dims__(4, 1, 1)
    cluster_box_4(const __grid_constant__ CUtensorMap map, [[maybe_unused]] const unsigned char* __restrict__ src,
                  unsigned char* __restrict__ out, int part_bytes, int rows, int c0, int c1) {
  cluster_units::box<4>(map, out, part_bytes, rows, c0, c1);
}
WELDER_CLUSTER_DIMS(cluster_box_4, 4)

extern "C" __global__ void cluster_exchange_1(const float* __restrict__ in, float* __restrict__ scratch,
                                              float* __restrict__ out, unsigned* __restrict__ ranks) {
  cluster_units::exchange<1>(in, scratch, out, ranks);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1)
    cluster_exchange_2(const float* __restrict__ in, float* __restrict__ scratch, float* __restrict__ out,
                       unsigned* __restrict__ ranks) {
  cluster_units::exchange<2>(in, scratch, out, ranks);
}
WELDER_CLUSTER_DIMS(cluster_exchange_2, 2)

extern "C" __global__ void __cluster_dims__(4, 1, 1)
    cluster_exchange_4(const float* __restrict__ in, float* __restrict__ scratch, float* __restrict__ out,
                       unsigned* __restrict__ ranks) {
  cluster_units::exchange<4>(in, scratch, out, ranks);
}
WELDER_CLUSTER_DIMS(cluster_exchange_4, 4)
