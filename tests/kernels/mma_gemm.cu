// C[M,N] = A[M,K] B[K,N] on tensor cores, row-major throughout, fp32 accumulation and output: the
// model for welder's mma kernel template, written against welder_mma.cuh so that the same text
// runs on the GPU (nvcc, sm_80 / sm_90) and on the CPU emulator.
//
// Block tile 64x64x32, 128 threads as 2x2 warps of 32x32, each warp 2x4 mma.m16n8k16 tiles per
// k16 step.  A 3-stage cp.async pipeline fills shared memory: while tile kt is multiplied, tiles
// kt+1 and kt+2 are in flight.  Operands reach registers through ldmatrix (x4 for A, x4.trans for
// the row-major B).  Ragged edges: copies that straddle M, N or the block's K range read only
// their valid bytes and zero-fill the rest (src_bytes), so out-of-range products are exact zeros;
// stores are guarded.  Split-K: blockIdx.z takes K range [z * k_per_split, (z + 1) * k_per_split)
// and adds its partial product into C (zeroed first) with atomicAdd; with gridDim.z == 1 it stores.
//
// Requirements: K and N multiples of the copy width (8 elements for 16-byte copies, 2 for 4-byte
// copies), k_per_split a multiple of 32, A and B 16-byte aligned.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"

namespace mma_gemm {

constexpr int kBM = 64, kBN = 64, kBK = 32, kStages = 3, kThreads = 128;
// Rows padded by 8 elements (16 bytes): the 8 rows one ldmatrix matrix reads fall in distinct banks.
constexpr int kALd = kBK + 8, kBLd = kBN + 8;
constexpr int kAStage = kBM * kALd, kBStage = kBK * kBLd;  // elements per stage
constexpr int kSmemBytes = kStages * (kAStage + kBStage) * 2;  // 29184: the launch's dynamic size
static_assert(kSmemBytes <= 48 * 1024, "fits the default dynamic shared memory limit");

// T: any 16-bit storage type (the kernel only moves operand bits); kBf16 picks the mma flavour;
// kCopyBytes: 16 (8 elements per cp.async) or 4 (2 elements, for K or N not multiples of 8).
template <class T, bool kBf16, int kCopyBytes>
__device__ __forceinline__ void gemm(const T* __restrict__ A, const T* __restrict__ B, float* __restrict__ C, int M,
                                     int N, int K, int k_per_split) {
  static_assert(sizeof(T) == 2, "mma.m16n8k16 operands are 16-bit");
  constexpr int kE = kCopyBytes / 2;  // elements per copy
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(T, As, 0, kStages * kAStage);
  WELDER_SHARED(T, Bs, kStages * kAStage * 2, kStages * kBStage);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int k_begin = blockIdx.z * k_per_split;
  const int k_end = min(K, k_begin + k_per_split);
  const int ktiles = k_end > k_begin ? (k_end - k_begin + kBK - 1) / kBK : 0;

  // Issues the copies of k-tile `kt` into stage `stage` (every element of the stage is written).
  auto load_tile = [&](int stage, int kt) {
    const int k0 = k_begin + kt * kBK;
#pragma unroll
    for (int c = tid; c < kBM * kBK / kE; c += kThreads) {
      const int row = c / (kBK / kE), col = c % (kBK / kE) * kE;
      const int gm = m0 + row, gk = k0 + col;
      const int valid = gm < M ? min(max(k_end - gk, 0), kE) : 0;
      welder_cp_async<kCopyBytes>(As + stage * kAStage + row * kALd + col, valid > 0 ? A + (size_t)gm * K + gk : A,
                                  valid * 2);
    }
#pragma unroll
    for (int c = tid; c < kBK * kBN / kE; c += kThreads) {
      const int row = c / (kBN / kE), col = c % (kBN / kE) * kE;
      const int gk = k0 + row, gn = n0 + col;
      const int valid = gk < k_end ? min(max(N - gn, 0), kE) : 0;
      welder_cp_async<kCopyBytes>(Bs + stage * kBStage + row * kBLd + col, valid > 0 ? B + (size_t)gk * N + gn : B,
                                  valid * 2);
    }
  };

  const int wm = warp / 2 * 32, wn = warp % 2 * 32;
  float acc[2][4][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.0f;

  // Prologue: kStages - 1 tiles in flight, one commit group each (empty past the last tile).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_tile(s, s);
    welder_cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    welder_cp_async_wait<kStages - 2>();  // this thread's copies of tile kt have landed ...
    __syncthreads();                      // ... and everyone's; the stage refilled below is free
    const int next = kt + kStages - 1;
    if (next < ktiles) load_tile(next % kStages, next);
    welder_cp_async_commit();

    const int s = kt % kStages;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        welder_ldmatrix_x4(a[mi], As + s * kAStage + (wm + mi * 16 + lane % 16) * kALd + kk + lane / 16 * 8);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        uint32_t r[4];
        welder_ldmatrix_x4_trans(r, Bs + s * kBStage + (kk + lane % 16) * kBLd + wn + nj * 16 + lane / 16 * 8);
        b[2 * nj][0] = r[0];
        b[2 * nj][1] = r[1];
        b[2 * nj + 1][0] = r[2];
        b[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          if constexpr (kBf16) {
            welder_mma_m16n8k16_bf16f32(acc[mi][ni], a[mi], b[ni], acc[mi][ni]);
          } else {
            welder_mma_m16n8k16_f16f32(acc[mi][ni], a[mi], b[ni], acc[mi][ni]);
          }
        }
    }
  }

  // Accumulator i of lane (g, t) is C[g + 8 * (i / 2)][2t + i % 2] of its 16x8 tile.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = m0 + wm + mi * 16 + g + (i / 2) * 8, col = n0 + wn + ni * 8 + 2 * t + i % 2;
        if (row < M && col < N) {
          if (gridDim.z > 1) {
            atomicAdd(C + (size_t)row * N + col, acc[mi][ni][i]);
          } else {
            C[(size_t)row * N + col] = acc[mi][ni][i];
          }
        }
      }
}

}  // namespace mma_gemm

// fp16 operands, 16-byte copies: K and N multiples of 8.
extern "C" __global__ void __launch_bounds__(128) mma_gemm_f16(const __half* __restrict__ A, const __half* __restrict__ B,
                                                              float* __restrict__ C, int M, int N, int K,
                                                              int k_per_split) {
  mma_gemm::gemm<__half, false, 16>(A, B, C, M, N, K, k_per_split);
}

// bf16 operands as raw bits.
extern "C" __global__ void __launch_bounds__(128)
    mma_gemm_bf16(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B, float* __restrict__ C,
                  int M, int N, int K, int k_per_split) {
  mma_gemm::gemm<unsigned short, true, 16>(A, B, C, M, N, K, k_per_split);
}

// fp16 operands, 4-byte copies: K and N need only be even.
extern "C" __global__ void __launch_bounds__(128)
    mma_gemm_f16_narrow(const __half* __restrict__ A, const __half* __restrict__ B, float* __restrict__ C, int M,
                        int N, int K, int k_per_split) {
  mma_gemm::gemm<__half, false, 4>(A, B, C, M, N, K, k_per_split);
}
