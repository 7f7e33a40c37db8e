// One kernel per welder_mma.cuh instruction, for checking register layouts and results against
// the PTX ISA's formulas (tests/test_emulator_mma.py) on the emulator and on the GPU.
#include "welder_prelude.cuh"
#include "welder_mma.cuh"

// Each thread t passes a[4t..4t+3], b[2t..2t+1], c[4t..4t+3] as its fragment registers and writes
// its d registers to d[4t..4t+3].  kind: 0 f16, 1 bf16, 2 tf32.  Every warp is independent.
extern "C" __global__ void mma_fragments(const unsigned* __restrict__ a, const unsigned* __restrict__ b,
                                         const float* __restrict__ c, float* __restrict__ d, int kind) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t ra[4], rb[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) ra[i] = a[4 * t + i];
  for (int i = 0; i < 2; ++i) rb[i] = b[2 * t + i];
  for (int i = 0; i < 4; ++i) acc[i] = c[4 * t + i];
  if (kind == 0) {
    welder_mma_m16n8k16_f16f32(acc, ra, rb, acc);  // accumulating in place, as kernels do
  } else if (kind == 1) {
    welder_mma_m16n8k16_bf16f32(acc, ra, rb, acc);
  } else {
    welder_mma_m16n8k8_tf32(acc, ra, rb, acc);
  }
  for (int i = 0; i < 4; ++i) d[4 * t + i] = acc[i];
}

// x[i] rounded to tf32 (as bits), to compare cvt.rna with numpy.
extern "C" __global__ void to_tf32(const float* __restrict__ x, unsigned* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = welder_float_to_tf32(x[i]);
}

// Stages `count` 16-bit elements in shared memory; thread t addresses element offsets[t] and
// writes its registers to out[4t..4t+3] (registers the variant does not load stay 0).
// mode: 0 x1, 1 x2, 2 x4, 3 x1.trans, 4 x2.trans, 5 x4.trans.
extern "C" __global__ void ldmatrix_fragments(const unsigned short* __restrict__ tile, int count,
                                              const int* __restrict__ offsets, unsigned* __restrict__ out,
                                              int mode) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned short, s, 0, count);
  for (int i = threadIdx.x; i < count; i += blockDim.x) s[i] = tile[i];
  __syncthreads();
  const int t = threadIdx.x;
  uint32_t r[4] = {0, 0, 0, 0};
  switch (mode) {
    case 0: welder_ldmatrix_x1(reinterpret_cast<uint32_t(&)[1]>(r), s + offsets[t]); break;
    case 1: welder_ldmatrix_x2(reinterpret_cast<uint32_t(&)[2]>(r), s + offsets[t]); break;
    case 2: welder_ldmatrix_x4(r, s + offsets[t]); break;
    case 3: welder_ldmatrix_x1_trans(reinterpret_cast<uint32_t(&)[1]>(r), s + offsets[t]); break;
    case 4: welder_ldmatrix_x2_trans(reinterpret_cast<uint32_t(&)[2]>(r), s + offsets[t]); break;
    default: welder_ldmatrix_x4_trans(r, s + offsets[t]); break;
  }
  for (int i = 0; i < 4; ++i) out[4 * t + i] = r[i];
}

// Thread t copies bytes [32t, 32t + 28) of src into shared memory with a 16-, an 8- and a 4-byte
// cp.async reading sizes[3t..3t+2] source bytes each (the rest zero-filled), waits, and after a
// barrier writes the 28 bytes that its neighbour t+1 copied to out[28t ..].
extern "C" __global__ void cp_async_zero_fill(const unsigned char* __restrict__ src, const int* __restrict__ sizes,
                                              unsigned char* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned char, s, 0, 32 * blockDim.x);
  const int t = threadIdx.x, n = blockDim.x;
  welder_cp_async<16>(s + 32 * t, src + 32 * t, sizes[3 * t]);
  welder_cp_async<8>(s + 32 * t + 16, src + 32 * t + 16, sizes[3 * t + 1]);
  welder_cp_async<4>(s + 32 * t + 24, src + 32 * t + 24, sizes[3 * t + 2]);
  welder_cp_async_wait_all();
  __syncthreads();
  const int from = (t + 1) % n;
  for (int i = 0; i < 28; ++i) out[28 * t + i] = s[32 * from + i];
}

// Three groups of one 16-byte copy per thread, then a multi-stage consumer: after
// cp.async.wait_group 2, 1 and 0 (and a barrier) each thread reads the stage that has just become
// complete, from its neighbour's slot, into out[stage][t].
extern "C" __global__ void cp_async_stages(const float* __restrict__ src, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  const int t = threadIdx.x, n = blockDim.x;
  WELDER_SHARED(float, stage, 0, 3 * 4 * n);
  for (int s = 0; s < 3; ++s) {
    welder_cp_async<16>(stage + (s * n + t) * 4, src + (s * n + t) * 4);
    welder_cp_async_commit();
  }
  const int from = (t + 1) % n;
  welder_cp_async_wait<2>();
  __syncthreads();
  welder_vstore(out, (0 * n + t) * 4, welder_vload<float4>(stage, (0 * n + from) * 4));
  welder_cp_async_wait<1>();
  __syncthreads();
  welder_vstore(out, (1 * n + t) * 4, welder_vload<float4>(stage, (1 * n + from) * 4));
  welder_cp_async_wait<0>();
  __syncthreads();
  welder_vstore(out, (2 * n + t) * 4, welder_vload<float4>(stage, (2 * n + from) * 4));
}
