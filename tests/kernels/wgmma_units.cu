// One kernel per wgmma shape under test, for checking welder_wgmma.cuh's shared-memory layouts,
// descriptors and accumulator layout against tests/wgmma_reference.py (numpy, from the PTX ISA's
// canonical layouts) on the emulator (test_emulator_wgmma.py) and on an sm_90a GPU
// (test_gpu_wgmma.py).  Launch with one warpgroup (128 threads) and nbytes + 1024 bytes of
// dynamic shared memory.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"
#include "welder_wgmma.cuh"

namespace wgmma_units {

// params: [0] swizzle of A, [1] LBO of A, [2] SBO of A, [3..5] the same for B, [6] k16 steps (at most
// 8), [7] scale-d of the first step (later steps accumulate), [8..15] byte offset of A's k16 step s
// in the tile, [16..23] the same for B.
constexpr int kMaxSteps = 8;

// Copies the numpy-made shared-memory image (nbytes, a multiple of 16) to a 1024-byte aligned
// shared address, then runs the steps from descriptors built at the tile's start and advanced by
// each step's offset; thread m loads d from c[m * N/2 ..] and stores it to out[m * N/2 ..].
template <int N, bool kBf16, int kTransA, int kTransB>
__device__ __forceinline__ void run(const unsigned char* __restrict__ image, int nbytes, const int* __restrict__ params,
                                    const float* __restrict__ c, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, whole, 0, nbytes + 1024);
  const int pad = static_cast<int>((1024u - welder_shared_address(whole) % 1024u) % 1024u);
  WELDER_SHARED(unsigned char, tile, pad, nbytes);
  const int tid = threadIdx.x;
  for (int i = tid; i < nbytes / 16; i += blockDim.x) welder_vstore(tile, 16 * i, welder_vload<uint4>(image, 16 * i));
  welder_fence_proxy_async();
  __syncthreads();

  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = c[tid * (N / 2) + i];
  const uint64_t desc_a = welder_wgmma_desc(tile, params[0], params[1], params[2]);
  const uint64_t desc_b = welder_wgmma_desc(tile, params[3], params[4], params[5]);
  const int steps = min(params[6], kMaxSteps);
  welder_wgmma_fence();
  for (int s = 0; s < steps; ++s) {
    const uint64_t a = desc_a + static_cast<uint64_t>(params[8 + s] >> 4);
    const uint64_t b = desc_b + static_cast<uint64_t>(params[16 + s] >> 4);
    const int accumulate = s > 0 ? 1 : params[7];
    if constexpr (kBf16) {
      welder_wgmma_m64k16_bf16f32<N, kTransA, kTransB>(d, a, b, accumulate);
    } else {
      welder_wgmma_m64k16_f16f32<N, kTransA, kTransB>(d, a, b, accumulate);
    }
  }
  welder_wgmma_commit();
  welder_wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) out[tid * (N / 2) + i] = d[i];
}

// trans = 2 * kTransA + kTransB.
template <int N, bool kBf16>
__device__ __forceinline__ void dispatch(const unsigned char* image, int nbytes, const int* params, const float* c,
                                         float* out, int trans) {
  switch (trans) {
    case 0: run<N, kBf16, 0, 0>(image, nbytes, params, c, out); break;
    case 1: run<N, kBf16, 0, 1>(image, nbytes, params, c, out); break;
    case 2: run<N, kBf16, 1, 0>(image, nbytes, params, c, out); break;
    default: run<N, kBf16, 1, 1>(image, nbytes, params, c, out); break;
  }
}

}  // namespace wgmma_units

#define WGMMA_UNIT(name, N, bf16)                                                                            \
  extern "C" __global__ void __launch_bounds__(128)                                                          \
      name(const unsigned char* __restrict__ image, int nbytes, const int* __restrict__ params,             \
           const float* __restrict__ c, float* __restrict__ out, int trans) {                               \
    wgmma_units::dispatch<N, bf16>(image, nbytes, params, c, out, trans);                                    \
  }
WGMMA_UNIT(wgmma_unit_n8_f16, 8, false)
WGMMA_UNIT(wgmma_unit_n64_f16, 64, false)
WGMMA_UNIT(wgmma_unit_n256_f16, 256, false)
WGMMA_UNIT(wgmma_unit_n24_f16, 24, false)
WGMMA_UNIT(wgmma_unit_n64_bf16, 64, true)
#undef WGMMA_UNIT
