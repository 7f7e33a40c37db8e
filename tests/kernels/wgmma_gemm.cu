// C[M,N] (fp16) = A[M,K] B on Hopper's warpgroup MMA with fp32 accumulation: the model for
// welder's wgmma kernel template, written against welder_wgmma.cuh so that the same text runs on
// the GPU (nvcc, sm_90a) and on the CPU emulator.  A is row-major [M][K]; B is either row-major
// [K][N] (MN-major in shared memory, imm-trans-b = 1) or [N][K] (K-major, imm-trans-b = 0).
//
// Block tile 128x128x64, 256 threads = 2 warpgroups; warpgroup w computes rows 64w..64w+63 of the
// tile with one wgmma m64n128k16 per k16 step (64 fp32 accumulators per thread).
//
// Shared memory: 4 stages of (A tile, B tile), each tile 16 KB with the 128-byte swizzle, the
// first stage at a 1024-byte aligned shared address (the swizzle is keyed on absolute address bits
// 7-9, so an atom of 8 rows x 128 bytes must start at a multiple of 1024).  16-byte unit u of row r
// of an atom is stored at unit u ^ (r % 8).
//   A (K-major): row m (64 k = 128 bytes) at m * 128; atoms of 8 rows 1024 apart (SBO = 1024, LBO
//     unused); the k16 step kk advances the descriptor's start by 32 bytes inside the atom row.
//   B [N][K] (K-major): the same with rows n.
//   B [K][N] (MN-major): two columns of atoms, n 0-63 and 64-127 (LBO = 64 rows * 128 = 8192
//     bytes apart), each a stack of k-rows of 64 n (128 bytes); 8 k-rows per atom (SBO = 1024);
//     the k16 step kk advances the start by 2 atoms = 2048 bytes.
//
// Pipeline: cp.async fills stage (kt + 2) % 4 while the wgmma of tile kt run, two tiles ahead.
// Per tile: wait for this thread's copies of tile kt (cp.async.wait_group 1), fence.proxy.async
// (the copies are generic-proxy writes that wgmma must see), __syncthreads (everyone's copies; and
// every warpgroup has finished the wgmma of tile kt - 2, whose stage is refilled next); then
// wgmma.fence, 4 chained wgmma, commit, and wgmma.wait_group 1: the group of tile kt - 1 is done,
// the one just issued stays in flight through the next tile's copies.
//
// Ragged edges: copies that straddle M, N or K read only their valid bytes and zero-fill the rest,
// so out-of-range products are exact zeros; stores are guarded.  Requirements: A and B 16-byte
// aligned, K (and N for [K][N]) multiples of the copy width (8 elements for 16-byte copies, 4 for
// 8-byte ones).
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"

namespace wgmma_gemm {

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 4, kThreads = 256;
constexpr int kATile = kBM * kBK * 2, kBTile = kBK * kBN * 2, kStageBytes = kATile + kBTile;  // bytes
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // 132096: the launch's dynamic size
static_assert(kSmemBytes <= 227 * 1024, "fits the shared memory of an sm_90 block");

// Byte offset of element e (0..63) of row r in a K-major 128-byte-swizzled tile of 128-byte rows.
__device__ __forceinline__ int swizzled_128(int r, int e) { return r * 128 + ((e / 8) ^ (r % 8)) * 16 + (e % 8) * 2; }

// kKN: B is [K][N]; kCopyBytes: 16 or 8.
template <bool kKN, int kCopyBytes>
__device__ __forceinline__ void gemm(const __half* __restrict__ A, const __half* __restrict__ B, __half* __restrict__ C,
                                     int M, int N, int K) {
  constexpr int kE = kCopyBytes / 2;  // elements per copy
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, whole, 0, kSmemBytes);
  const int pad = static_cast<int>((1024u - welder_shared_address(whole) % 1024u) % 1024u);
  WELDER_SHARED(__half, tiles, pad, kStages * kStageBytes / 2);

  const int tid = threadIdx.x, warpgroup = tid / 128;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int ktiles = (K + kBK - 1) / kBK;

  // Issues the copies of k-tile kt into `stage` (every byte of the stage is written).
  auto load_tile = [&](int stage, int kt) {
    const int k0 = kt * kBK, base = stage * kStageBytes;
#pragma unroll
    for (int c = tid; c < kBM * kBK / kE; c += kThreads) {
      const int row = c / (kBK / kE), e = c % (kBK / kE) * kE;
      const int gm = m0 + row, gk = k0 + e;
      const int valid = gm < M ? min(max(K - gk, 0), kE) : 0;
      welder_cp_async<kCopyBytes>(tiles + (base + swizzled_128(row, e)) / 2, valid > 0 ? A + (size_t)gm * K + gk : A,
                                  valid * 2);
    }
#pragma unroll
    for (int c = tid; c < kBK * kBN / kE; c += kThreads) {
      if constexpr (kKN) {
        const int krow = c / (kBN / kE), e = c % (kBN / kE) * kE;
        const int gk = k0 + krow, gn = n0 + e;
        const int valid = gk < K ? min(max(N - gn, 0), kE) : 0;
        const int byte = base + kATile + (e / 64) * (kBK * 128) + swizzled_128(krow, e % 64);
        welder_cp_async<kCopyBytes>(tiles + byte / 2, valid > 0 ? B + (size_t)gk * N + gn : B, valid * 2);
      } else {
        const int row = c / (kBK / kE), e = c % (kBK / kE) * kE;
        const int gn = n0 + row, gk = k0 + e;
        const int valid = gn < N ? min(max(K - gk, 0), kE) : 0;
        welder_cp_async<kCopyBytes>(tiles + (base + kATile + swizzled_128(row, e)) / 2,
                                    valid > 0 ? B + (size_t)gn * K + gk : B, valid * 2);
      }
    }
  };

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if (s < ktiles) load_tile(s, s);
    welder_cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    welder_cp_async_wait<1>();
    welder_fence_proxy_async();
    __syncthreads();
    if (kt + 2 < ktiles) load_tile((kt + 2) % kStages, kt + 2);
    welder_cp_async_commit();

    const int base = kt % kStages * kStageBytes;
    const uint64_t desc_a = welder_wgmma_desc(tiles + (base + warpgroup * 64 * 128) / 2, 128, 16, 1024);
    const uint64_t desc_b = welder_wgmma_desc(tiles + (base + kATile) / 2, 128, kKN ? kBK * 128 : 16, 1024);
    welder_wgmma_fence_operand(acc);
    welder_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      // Descriptor units are 16 bytes: A moves 32 bytes per k16 step, B 32 (K-major) or 2048.
      welder_wgmma_m64k16_f16f32<kBN, 0, kKN ? 1 : 0>(acc, desc_a + 2 * kk, desc_b + (kKN ? 128 : 2) * kk, 1);
    }
    welder_wgmma_commit();
    welder_wgmma_fence_operand(acc);
    welder_wgmma_wait<1>();
  }
  welder_wgmma_wait<0>();
  welder_wgmma_fence_operand(acc);

  // Accumulator 4j + r of thread m: D[16w + g + 8(r / 2)][8j + 2t + r % 2] of the warpgroup's 64 rows.
  const int m = tid % 128, g = m % 32 / 4, t = m % 4;
  const int row0 = m0 + warpgroup * 64 + m / 32 * 16 + g;
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + 8 * (r / 2), col = n0 + 8 * j + 2 * t + r % 2;
      if (row < M && col < N) C[(size_t)row * N + col] = __float2half(acc[4 * j + r]);
    }
}

}  // namespace wgmma_gemm

#define WGMMA_GEMM(name, kn, copy_bytes)                                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                                              \
      name(const __half* __restrict__ A, const __half* __restrict__ B, __half* __restrict__ C, int M, int N, int K) { \
    wgmma_gemm::gemm<kn, copy_bytes>(A, B, C, M, N, K);                                                          \
  }
WGMMA_GEMM(wgmma_gemm_kn, true, 16)          // B [K][N]; K and N multiples of 8
WGMMA_GEMM(wgmma_gemm_nk, false, 16)         // B [N][K]; K a multiple of 8
WGMMA_GEMM(wgmma_gemm_kn_narrow, true, 8)    // 8-byte copies: K and N multiples of 4
WGMMA_GEMM(wgmma_gemm_nk_narrow, false, 8)   // K a multiple of 4
#undef WGMMA_GEMM
