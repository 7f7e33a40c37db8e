// Planted misuse of welder_cluster.cuh: valid CUDA that compiles with nvcc for sm_90a, each mode a
// mistake the emulator must report (tests/test_emulator_cluster.py).  Clusters of two blocks of 128
// threads; `map` covers src (16 x 64 fp16) with boxes of 8 rows, unswizzled.  Block rank r loads
// rows 8r .. 8r + 7 into half r of its tile with multicast to both blocks, so that, done right,
// every block ends up with all of src and copies it to out[blockIdx.x].  A second mbarrier, `late`,
// serves the modes that go on after that.  Launch with 5120 bytes of shared memory.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

// mode 0: rank 1 arrives on rank 0's mbarrier after its init and fence but before the cluster
//         barrier that publishes them.
//      1: no cluster barrier at the end: rank 0 signals rank 1 and exits; rank 1 answers on rank
//         0's mbarrier.
//      2: expect_tx announces the block's own half only; the peer's half is surplus.
//      3: the two blocks wait at different cluster barriers.
//      4: rank 0 multicasts before the cluster barrier: rank 1 has not initialised its mbarrier.
//      5: half of rank 1's threads exit before the first cluster barrier.
//      6: rank 1 multicasts into `spare` of both blocks, and rank 0 exits without waiting for it.
//      7: an arrival on block rank 2 of a cluster of two.
//      8: a multicast mask naming rank 2.
//      9: rank 1 omits fence.mbarrier_init; rank 0 arrives on rank 1's mbarrier after the barrier.
//     10: every thread waits on its block's `late`, on which no block arrives: the cluster deadlocks.
//     11: rank 0 multicasts into rank 1's `spare` alone, twice, before any wait.
//     -1: everything right.
extern "C" __global__ void __cluster_dims__(2, 1, 1)
    cluster_misuse(const __grid_constant__ CUtensorMap map, [[maybe_unused]] const __half* __restrict__ src,
                   __half* __restrict__ out, int mode) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(uint64_t, bar, pad, 1);
  WELDER_SHARED(uint64_t, late, pad + 8, 1);
  WELDER_SHARED(__half, tile, pad + 1024, 2 * 8 * 64);
  WELDER_SHARED(__half, spare, pad + 1024 + 2048, 8 * 64);
  const unsigned rank = welder_cluster_ctarank(), peer = rank ^ 1u;
  const int tid = threadIdx.x;
  if (tid == 0) {
    welder_mbarrier_init(bar, 1);
    welder_mbarrier_init(late, 1);
    if (mode != 9 || rank != 1) welder_mbarrier_init_fence();
  }
  if (mode == 0 && rank == 1 && tid == 0) welder_mbarrier_arrive_cluster(bar, peer);
  if (mode == 4 && rank == 0 && tid == 0) {
    welder_mbarrier_arrive_expect_tx(bar, 2048);
    welder_tma_load_2d_multicast(tile, &map, bar, 0x3, 0, 0);
  }
  if (mode == 5 && rank == 1 && tid >= 64) return;
  if (mode == 3 && rank == 1) {
    welder_cluster_sync();
  } else {
    welder_cluster_sync();
  }
  if (mode == 9 && rank == 0 && tid == 0) welder_mbarrier_arrive_cluster(late, peer);
  if (mode == 7 && tid == 0) welder_mbarrier_arrive_cluster(bar, 2);
  if (mode == 11 && rank == 0 && tid == 0)
    for (int i = 0; i < 2; ++i) welder_tma_load_2d_multicast(spare, &map, late, 0x2, 0, 0);
  if (tid == 0) {
    welder_mbarrier_arrive_expect_tx(bar, mode == 2 ? 1024 : 2048);
    welder_tma_load_2d_multicast(tile + rank * 8 * 64, &map, bar, mode == 8 ? 0x5 : 0x3, 0, 8 * rank);
  }
  welder_mbarrier_wait(bar, 0);
  for (int i = tid; i < 2 * 8 * 64; i += blockDim.x) out[blockIdx.x * 2 * 8 * 64 + i] = tile[i];
  if (mode == 1) {
    if (rank == 0 && tid == 0) welder_mbarrier_arrive_cluster(late, peer);
    if (rank == 1 && tid == 0) {
      welder_mbarrier_wait(late, 0);
      welder_mbarrier_arrive_cluster(late, peer);
    }
    return;
  }
  if (mode == 6 && tid == 0) {
    welder_mbarrier_arrive_expect_tx(late, 1024);
    if (rank == 1) welder_tma_load_2d_multicast(spare, &map, late, 0x3, 0, 0);
  }
  if (mode == 10) welder_mbarrier_wait(late, 0);
  welder_cluster_sync();
  if (mode == 6 && rank == 1) welder_mbarrier_wait(late, 0);
}
WELDER_CLUSTER_DIMS(cluster_misuse, 2)
