// C[M,N] (fp32) = A[M,K] B[N,K]^T on a warp-specialised ring: the model of how a wgmma kernel feeds
// itself through welder_tma.cuh, run by tests/test_emulator_tma.py and test_gpu_tma.py.
//
// 384 threads = 3 warpgroups.  Warpgroup 0 is the producer: it gives registers back
// (setmaxnreg.dec), and one thread of it streams the k-slices of A and B through a ring of kStages
// slots by TMA.  Warpgroups 1 and 2 are consumers (setmaxnreg.inc): each computes 64 rows of the
// 128x64 block tile with wgmma m64n64k16 straight from the slots.
//
// Slot s holds A's 128x64 box (16 KB) and B's 64x64 box (8 KB), both K-major with the 128-byte
// swizzle (a row of 64 k is one 128-byte span; 8-row atoms, SBO 1024; a k16 step advances the
// descriptor by 32 bytes), and has two mbarriers:
//   full[s]  (1 arrival): the producer's arrive.expect_tx of the slot's bytes; the two TMA loads
//            complete them.  Consumers wait on it with the parity of the slice's round.
//   empty[s] (2 arrivals): one thread of each consumer warpgroup arrives once the wgmma that read
//            the slot completed (after the wgmma.wait_group of the next slice).  The producer waits
//            on it before refilling, with the opposite parity (so round 0 does not wait).
// Ragged edges come free: the copy engine zero-fills whatever lies outside A or B.  Requirements:
// K a multiple of 8 (16-byte row strides), A and B 16-byte aligned.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"
#include "welder_tma.cuh"

namespace tma_ring {

constexpr int kBM = 128, kBN = 64, kBK = 64, kStages = 4;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kSlotBytes = kABytes + kBBytes;
// The launch's dynamic size: 1024 bytes of alignment slack, the slots, then 2 * kStages mbarriers.
static_assert(1024 + kStages * kSlotBytes + 2 * kStages * 8 == 99392, "tma_reference.RING_SMEM_BYTES");

}  // namespace tma_ring

extern "C" __global__ void __launch_bounds__(384, 1)
    tma_ring_gemm(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  [[maybe_unused]] const __half* __restrict__ A, [[maybe_unused]] const __half* __restrict__ B,
                  float* __restrict__ C, int M, int N, int K) {
  using namespace tma_ring;
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, first, 0, 1);
  const int pad = static_cast<int>((1024u - welder_shared_address(first) % 1024u) % 1024u);
  WELDER_SHARED(__half, slots, pad, kStages * kSlotBytes / 2);
  WELDER_SHARED(uint64_t, full, pad + kStages * kSlotBytes, kStages);
  WELDER_SHARED(uint64_t, empty, pad + kStages * kSlotBytes + kStages * 8, kStages);

  const int tid = threadIdx.x, warpgroup = tid / 128;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int slices = (K + kBK - 1) / kBK;
  if (tid == 0) {
    welder_tma_prefetch_map(&map_a);
    welder_tma_prefetch_map(&map_b);
    for (int s = 0; s < kStages; ++s) {
      welder_mbarrier_init(full + s, 1);
      welder_mbarrier_init(empty + s, 2);
    }
    welder_mbarrier_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    welder_setmaxnreg_dec<40>();
    if (tid == 0) {
      for (int kt = 0; kt < slices; ++kt) {
        const int s = kt % kStages, round = kt / kStages;
        welder_mbarrier_wait(empty + s, (round & 1) ^ 1);
        welder_mbarrier_arrive_expect_tx(full + s, kSlotBytes);
        welder_tma_load_2d(slots + s * kSlotBytes / 2, &map_a, full + s, kt * kBK, m0);
        welder_tma_load_2d(slots + (s * kSlotBytes + kABytes) / 2, &map_b, full + s, kt * kBK, n0);
      }
    }
    return;
  }

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
    for (int kk = 0; kk < kBK / 16; ++kk) welder_wgmma_m64k16_f16f32<kBN, 0, 0>(acc, desc_a + 2 * kk, desc_b + 2 * kk, 1);
    welder_wgmma_commit();
    welder_wgmma_fence_operand(acc);
    welder_wgmma_wait<1>();
    // The group of slice kt - 1 is complete: its slot may be refilled.
    if (kt > 0 && tid % 128 == 0) welder_mbarrier_arrive(empty + (kt - 1) % kStages);
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
