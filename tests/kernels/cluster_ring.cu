// C[M,N] (fp32) = A[M,K] B[N,K]^T on a warp-specialised ring shared by a cluster of two blocks: the
// model of the wgmma producer variant whose two blocks share one operand.  tests/kernels/tma_ring.cu
// is the one-block ring this extends; run by tests/test_emulator_cluster.py and test_gpu_cluster.py.
//
// The two blocks of a cluster compute neighbouring 128x64 tiles along N (blockIdx.x = 2c, 2c + 1),
// so they need the same 128x64 slice of A at every k-step.  Each block's producer thread loads its
// own B slice and half of the A slice -- rows 64 r .. 64 r + 63 for cluster rank r -- by TMA with
// multicast to both blocks, so A crosses the memory system once per cluster.  Per slot s:
//   full[s]  (1 arrival): the block's own producer expects the whole slot (both A halves and its
//            B); the peer's half may land before that expect_tx.
//   empty[s] (4 arrivals): one thread of each consumer warpgroup of *both* blocks arrives once its
//            wgmma that read the slot completed -- the producer's next multicast writes the slot in
//            both blocks, so it waits until both have released it.
// A cluster barrier after the inits publishes them to the peer (its arrivals and multicasts use
// them); one at the end keeps either block from exiting while the other may still use its shared
// memory.  Launch with grid (2 ceil(N / 128), ceil(M / 128)); requirements as for tma_ring.cu.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

namespace cluster_ring {

constexpr int kBM = 128, kBN = 64, kBK = 64, kStages = 4, kCluster = 2;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kSlotBytes = kABytes + kBBytes;
constexpr int kAHalfBytes = kABytes / kCluster;
// The launch's dynamic size: 1024 bytes of alignment slack, the slots, then 2 * kStages mbarriers.
static_assert(1024 + kStages * kSlotBytes + 2 * kStages * 8 == 99392, "cluster_reference.RING_SMEM_BYTES");

}  // namespace cluster_ring

extern "C" __global__ void __launch_bounds__(384, 1) __cluster_dims__(2, 1, 1)
    cluster_ring_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      [[maybe_unused]] const __half* __restrict__ A, [[maybe_unused]] const __half* __restrict__ B,
                      float* __restrict__ C, int M, int N, int K) {
  using namespace cluster_ring;
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(__half, slots, pad, kStages * kSlotBytes / 2);
  WELDER_SHARED(uint64_t, full, pad + kStages * kSlotBytes, kStages);
  WELDER_SHARED(uint64_t, empty, pad + kStages * kSlotBytes + kStages * 8, kStages);

  const int tid = threadIdx.x, warpgroup = tid / 128;
  const int rank = static_cast<int>(welder_cluster_ctarank());
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int slices = (K + kBK - 1) / kBK;
  if (tid == 0) {
    welder_tma_prefetch_map(&map_a);
    welder_tma_prefetch_map(&map_b);
    for (int s = 0; s < kStages; ++s) {
      welder_mbarrier_init(full + s, 1);
      welder_mbarrier_init(empty + s, 2 * kCluster);
    }
    welder_mbarrier_init_fence();
  }
  welder_cluster_sync();

  if (warpgroup == 0) {
    welder_setmaxnreg_dec<40>();
    if (tid == 0) {
      for (int kt = 0; kt < slices; ++kt) {
        const int s = kt % kStages, round = kt / kStages;
        welder_mbarrier_wait(empty + s, (round & 1) ^ 1);
        welder_mbarrier_arrive_expect_tx(full + s, kSlotBytes);
        welder_tma_load_2d_multicast(slots + (s * kSlotBytes + rank * kAHalfBytes) / 2, &map_a, full + s,
                                     (1u << kCluster) - 1u, kt * kBK, m0 + rank * (kBM / kCluster));
        welder_tma_load_2d(slots + (s * kSlotBytes + kABytes) / 2, &map_b, full + s, kt * kBK, n0);
      }
    }
  } else {
    welder_setmaxnreg_inc<232>();
    const int consumer = warpgroup - 1;
    float acc[kBN / 2];
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < slices; ++kt) {
      const int s = kt % kStages;
      welder_mbarrier_wait(full + s, (kt / kStages) & 1);
      const uint64_t desc_a = welder_wgmma_desc(slots + (s * kSlotBytes + consumer * 64 * 128) / 2, 128, 16, 1024);
      const uint64_t desc_b = welder_wgmma_desc(slots + (s * kSlotBytes + kABytes) / 2, 128, 16, 1024);
      welder_wgmma_fence_operand(acc);
      welder_wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        welder_wgmma_m64k16_f16f32<kBN, 0, 0>(acc, desc_a + 2 * kk, desc_b + 2 * kk, 1);
      welder_wgmma_commit();
      welder_wgmma_fence_operand(acc);
      welder_wgmma_wait<1>();
      // The group of slice kt - 1 is complete: its slot may be refilled, in both blocks.
      if (kt > 0 && tid % 128 == 0)
        for (int cta = 0; cta < kCluster; ++cta) welder_mbarrier_arrive_cluster(empty + (kt - 1) % kStages, cta);
    }
    welder_wgmma_wait<0>();
    welder_wgmma_fence_operand(acc);

    // Accumulator 4j + r of thread m: D[16w + g + 8(r / 2)][8j + 2t + r % 2] of the warpgroup's 64 rows.
    const int m = tid % 128, g = m % 32 / 4, t = m % 4;
    const int row0 = m0 + consumer * 64 + m / 32 * 16 + g;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = row0 + 8 * (r / 2), col = n0 + 8 * j + 2 * t + r % 2;
        if (row < M && col < N) C[(size_t)row * N + col] = acc[4 * j + r];
      }
  }
  welder_cluster_sync();
}
WELDER_CLUSTER_DIMS(cluster_ring_gemm, 2)
