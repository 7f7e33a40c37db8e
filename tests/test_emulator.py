"""The CUDA emulator runs real kernel text on the CPU, agrees with numpy, and catches planted bugs.

Every kernel here is CUDA source that must also compile with nvcc for sm_80 and sm_90 (checked at
the end when nvcc is on PATH).  The kernels are built in two modules per session: the working ones
and the planted bugs.
"""

from __future__ import annotations

import math
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from welder.errors import WelderError
from welder.runtime import emu
from welder.runtime.emu import EmulationError, compile_kernels, emulator

pytestmark = pytest.mark.skipif(not emu.available(), reason="kernel emulation needs Linux and g++")

# The emulator must not add warnings to a kernel's build (nor to its own runtime objects).
WARNINGS_AS_ERRORS = ("-Wall", "-Wextra", "-Werror")

GOOD_SOURCE = r"""
#include "welder_prelude.cuh"

using namespace nvcuda;

// c = a + b; float4 loads for the bulk, one element per thread for the n % 4 tail.
__global__ void __launch_bounds__(64) vec_add_f4(const float* __restrict__ a, const float* __restrict__ b,
                                                 float* __restrict__ c, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int vectors = n / 4;
  if (i < vectors) {
    const float4 x = welder_vload<float4>(a, 4 * i);
    const float4 y = welder_vload<float4>(b, 4 * i);
    welder_vstore(c, 4 * i, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
  }
  if (i < n - 4 * vectors) c[4 * vectors + i] = a[4 * vectors + i] + b[4 * vectors + i];
}

#define TILE 16
// C[M,N] = A[M,K] B[K,N] with 16x16 tiles staged in shared memory; sizes need not divide.
__global__ void __launch_bounds__(TILE * TILE) matmul_tiled(const float* __restrict__ A,
                                                            const float* __restrict__ B,
                                                            float* __restrict__ C, int M, int N, int K) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, As, 0, TILE * TILE);
  WELDER_SHARED(float, Bs, TILE * TILE * sizeof(float), TILE * TILE);
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
  float acc = 0.0f;
  for (int k0 = 0; k0 < K; k0 += TILE) {
    As[ty * TILE + tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
    Bs[ty * TILE + tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < TILE; ++k) acc += As[ty * TILE + k] * Bs[k * TILE + tx];
    __syncthreads();
  }
  if (row < M && col < N) C[row * N + col] = acc;
}

__device__ __forceinline__ float warp_sum_down(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// out[b] = sum of the grid-strided elements block b visits: warp shuffles, then one slot per warp.
__global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, partial, 0, 32);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  float v = 0.0f;
  for (int i = blockIdx.x * blockDim.x + tid; i < n; i += gridDim.x * blockDim.x) v += x[i];
  v = warp_sum_down(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x / 32) ? float(partial[lane]) : 0.0f;
    v = warp_sum_down(v);
    if (lane == 0) out[blockIdx.x] = v;
  }
}

__device__ __forceinline__ float warp_all_reduce(float v, bool is_max) {
  for (int mask = 16; mask > 0; mask >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, v, mask);
    v = is_max ? fmaxf(v, other) : v + other;
  }
  return v;
}

// Block-wide all-reduce through one shared slot per warp.
__device__ float block_all_reduce(float v, WELDER_SMEM_PTR(float) scratch, bool is_max) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_all_reduce(v, is_max);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const float identity = is_max ? __int_as_float(0xff800000) : 0.0f;
  v = warp_all_reduce(lane < warps ? float(scratch[lane]) : identity, is_max);
  __syncthreads();  // the next reduction overwrites scratch
  return v;
}

// One block per row: y = softmax(x) along the row.
__global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int cols) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, scratch, 0, 32);
  const float* row = x + (size_t)blockIdx.x * cols;
  float* out = y + (size_t)blockIdx.x * cols;
  float m = __int_as_float(0xff800000);
  for (int j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j]);
  m = block_all_reduce(m, scratch, true);
  float s = 0.0f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) s += __expf(row[j] - m);
  const float inv = 1.0f / block_all_reduce(s, scratch, false);
  for (int j = threadIdx.x; j < cols; j += blockDim.x) out[j] = __expf(row[j] - m) * inv;
}

// y = half(float(a) * scale + float(b)), two halves per thread, fp32 arithmetic.
__global__ void half_scale_add(const __half* __restrict__ a, const __half* __restrict__ b,
                               __half* __restrict__ y, float scale, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (2 * i + 1 < n) {
    const float2 fa = __half22float2(welder_vload<half2>(a, 2 * i));
    const float2 fb = __half22float2(welder_vload<half2>(b, 2 * i));
    welder_vstore(y, 2 * i, __floats2half2_rn(fa.x * scale + fb.x, fa.y * scale + fb.y));
  } else if (2 * i < n) {
    y[2 * i] = __float2half(__half2float(a[2 * i]) * scale + __half2float(b[2 * i]));
  }
}

// out[r] = sum_j x[r, j] * w[j] over halves, accumulated in fp32, one warp per row.
__global__ void half_row_dot(const __half* __restrict__ x, const __half* __restrict__ w,
                             float* __restrict__ out, int cols) {
  const __half* row = x + (size_t)blockIdx.x * cols;
  float acc = 0.0f;
  for (int j = threadIdx.x; j < cols; j += 32) acc = fmaf(__half2float(row[j]), __half2float(w[j]), acc);
  acc = warp_sum_down(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// Stages n halves (n % 8 == 0) in shared memory the way generated kernels do -- as 16-, 8- and
// 4-byte vectors of raw half bits (uint4, uint2, __half2), zero vectors past n -- and reads them
// back one __half at a time, each thread elements another thread wrote:
// y[i] = 7 * x[255 - i] (0 past n).
__global__ void __launch_bounds__(64) half_stage_vectors(const __half* __restrict__ x, float* __restrict__ y,
                                                         int n) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(__half, s8, 0, 256);
  WELDER_SHARED(__half, s4, 512, 256);
  WELDER_SHARED(__half, s2, 1024, 256);
  const int t = threadIdx.x;
  for (int e = t; e < 32; e += blockDim.x)
    welder_vstore(s8, e * 8, (e * 8 < n) ? welder_vload<uint4>(x, e * 8) : make_uint4(0u, 0u, 0u, 0u));
  for (int e = t; e < 64; e += blockDim.x)
    welder_vstore(s4, e * 4, (e * 4 < n) ? welder_vload<uint2>(x, e * 4) : make_uint2(0u, 0u));
  for (int e = t; e < 128; e += blockDim.x)
    welder_vstore(s2, e * 2, (e * 2 < n) ? welder_vload<__half2>(x, e * 2) : __float2half2_rn(0.0f));
  __syncthreads();
  for (int i = t; i < 256; i += blockDim.x) {
    const int j = 255 - i;
    y[i] = __half2float(s8[j]) + 2.0f * __half2float(s4[j]) + 4.0f * __half2float(s2[j]);
  }
}

// Half arithmetic through cuda_fp16's operators and intrinsics, four results per element.
__global__ void half_arith(const __half* __restrict__ a, const __half* __restrict__ b,
                           __half* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __half x = a[i], y = b[i];
  out[4 * i + 0] = x * y + x;
  out[4 * i + 1] = x / y;
  out[4 * i + 2] = __hmax(x, y);
  out[4 * i + 3] = -x + __habs(y);
}

// bits[i] = float -> half of x[i]; values[i] = half -> float of the bit pattern patterns[i].
__global__ void half_convert(const float* __restrict__ x, unsigned short* __restrict__ bits,
                             const unsigned short* __restrict__ patterns, float* __restrict__ values, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  bits[i] = __half_as_ushort(__float2half_rn(x[i]));
  values[i] = __half2float(__ushort_as_half(patterns[i]));
}

// hist[b] = number of values equal to b: shared-memory histogram with atomics, then merged.
__global__ void histogram(const int* __restrict__ values, unsigned int* __restrict__ hist, int n, int bins) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned int, local, 0, bins);
  for (int b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0u;
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    atomicAdd(&local[values[i]], 1u);
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) atomicAdd(&hist[b], local[b]);
}

// C = alpha * A B: A row-major [M,K], B column-major [N,K], halves with fp32 accumulation.
// One warp per 16x16 tile of C; A's tile is staged in shared memory, B is read from global memory.
__global__ void wmma_gemm_f16(const __half* __restrict__ A, const __half* __restrict__ B,
                              float* __restrict__ C, int N, int K, float alpha) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(__half, As, 0, 16 * 16);
  const int tile_m = blockIdx.y, tile_n = blockIdx.x;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int k0 = 0; k0 < K; k0 += 16) {
    for (int e = threadIdx.x; e < 16 * 16; e += 32)
      As[e] = A[(size_t)(tile_m * 16 + e / 16) * K + k0 + e % 16];
    __syncthreads();
    wmma::load_matrix_sync(a, As, 16);
    wmma::load_matrix_sync(b, B + (size_t)tile_n * 16 * K + k0, K);
    wmma::mma_sync(acc, a, b, acc);
    __syncthreads();
  }
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= alpha;
  wmma::store_matrix_sync(C + (size_t)tile_m * 16 * N + tile_n * 16, acc, N, wmma::mem_row_major);
}

// C = A B in TF32 (m16n16k8), A [M,K] and B [K,N] row-major floats.
__global__ void wmma_gemm_tf32(const float* __restrict__ A, const float* __restrict__ B,
                               float* __restrict__ C, int N, int K) {
  const int tile_m = blockIdx.y, tile_n = blockIdx.x;
  wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b;
  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int k0 = 0; k0 < K; k0 += 8) {
    wmma::load_matrix_sync(a, A + (size_t)tile_m * 16 * K + k0, K);
    wmma::load_matrix_sync(b, B + (size_t)k0 * N + tile_n * 16, N);
    for (int i = 0; i < a.num_elements; ++i) a.x[i] = wmma::__float_to_tf32(a.x[i]);
    for (int i = 0; i < b.num_elements; ++i) b.x[i] = wmma::__float_to_tf32(b.x[i]);
    wmma::mma_sync(acc, a, b, acc);
  }
  wmma::store_matrix_sync(C + (size_t)tile_m * 16 * N + tile_n * 16, acc, N, wmma::mem_row_major);
}

// C = A B + 1 with a half accumulator (m32n8k16): A [32,16] and B [16,8] row-major, C column-major.
__global__ void wmma_m32n8k16(const __half* __restrict__ A, const __half* __restrict__ B,
                              __half* __restrict__ C) {
  wmma::fragment<wmma::matrix_a, 32, 8, 16, __half, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 32, 8, 16, __half, wmma::row_major> b;
  wmma::fragment<wmma::accumulator, 32, 8, 16, __half> acc;
  wmma::fill_fragment(acc, __float2half(1.0f));
  wmma::load_matrix_sync(a, A, 16);
  wmma::load_matrix_sync(b, B, 8);
  wmma::mma_sync(acc, a, b, acc);
  wmma::store_matrix_sync(C, acc, 32, wmma::mem_col_major);
}

__global__ void say_hello(int tag) {
  if (threadIdx.x == 0) printf("hello from block %d, tag %d\n", blockIdx.x, tag);
}

// Eight results per thread from the warp-level votes and shuffles.
__global__ void warp_votes(const int* __restrict__ flags, unsigned int* __restrict__ out) {
  const int t = threadIdx.x, lane = t % 32;
  const int f = flags[t];
  unsigned int* o = out + 8 * t;
  o[0] = __ballot_sync(0xffffffffu, f);
  o[1] = __any_sync(0xffffffffu, f);
  o[2] = __all_sync(0xffffffffu, f);
  o[3] = (unsigned int)__shfl_sync(0xffffffffu, t, 3, 8);
  o[4] = (unsigned int)__shfl_up_sync(0xffffffffu, t, 1, 16);
  o[5] = (unsigned int)__shfl_xor_sync(0xffffffffu, t, 5);
  o[6] = (unsigned int)__syncthreads_count(f);
  unsigned int active = 0u;
  if (lane % 3 == 0) active = __activemask();
  o[7] = active;
}

// Shuffles of 8-byte and half types.
__global__ void shuffle_types(double* __restrict__ d, long long* __restrict__ ll, __half* __restrict__ h,
                              __half2* __restrict__ h2) {
  const int t = threadIdx.x;
  d[t] = __shfl_xor_sync(0xffffffffu, 0.5 * t, 1);
  ll[t] = __shfl_down_sync(0xffffffffu, (long long)t << 33, 2);
  h[t] = __shfl_sync(0xffffffffu, __float2half((float)t), 7);
  h2[t] = __shfl_up_sync(0xffffffffu, __floats2half2_rn((float)t, -(float)t), 1);
}

__device__ __noinline__ float clamp_unit(float v) { return __saturatef(v); }

// Float math as a code generator prints it, eight functions per element.
__global__ void math_ops(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  __align__(16) float r[8];
  r[0] = expf(v);
  r[1] = logf(fabsf(v) + 1.0f);
  r[2] = tanhf(v);
  r[3] = erff(v);
  r[4] = rsqrtf(fabsf(v) + 1.0f);
  r[5] = clamp_unit(v);
  r[6] = roundf(v * 4.0f);
  r[7] = rintf(v * 4.0f) + fminf(v, 0.25f) + copysignf(1.0f, v) + fmodf(v, 0.75f);
  for (int k = 0; k < 8; k += 4) welder_vstore(y, 8 * i + k, welder_vload<float4>(r, k));
}

// More float math, eight sums per element, and three classification flags.
__global__ void math_more(const float* __restrict__ x, float* __restrict__ y, int* __restrict__ flags,
                          int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i], a = fabsf(v);
  float* r = y + 8 * i;
  r[0] = exp2f(v) + log2f(a + 1.0f);
  r[1] = sqrtf(a) + erfcf(v);
  r[2] = sinf(v) + cosf(v);
  r[3] = floorf(v) + ceilf(v) + truncf(v);
  r[4] = powf(a + 1.0f, 1.5f) + fmaf(v, v, 1.0f) + fmaxf(v, 0.0f) + min(v, 1.0f);
  r[5] = __expf(v) + __logf(a + 1.0f) + __powf(2.0f, v);
  r[6] = __fdividef(v, 3.0f) + __frcp_rn(a + 10.0f) + __fsqrt_rn(a);
  r[7] = __fmul_rn(v, 3.0f) + __fadd_rn(v, 0.5f) + __int2float_rn(__float2int_rn(v));
  flags[3 * i + 0] = isnan(sqrtf(v)) ? 1 : 0;
  flags[3 * i + 1] = isinf(expf(100.0f * v)) ? 1 : 0;
  flags[3 * i + 2] = isfinite(logf(v)) ? 1 : 0;
}

// Integer intrinsics and CUDA's global min/max overloads, eight results per element.
__global__ void int_ops(const int* __restrict__ a, const int* __restrict__ b, int* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int x = a[i], y = b[i];
  int* o = out + 8 * i;
  o[0] = min(x, y);
  o[1] = max(x, y);
  o[2] = (int)max((unsigned int)x, (unsigned int)y);
  o[3] = __popc((unsigned int)x);
  o[4] = __clz(x);
  o[5] = __ffs(y);
  o[6] = (int)__umulhi((unsigned int)x, (unsigned int)y);
  o[7] = __float2int_rn((float)x * 0.5f);
}
"""

GOOD_KERNELS = [
    "vec_add_f4",
    "matmul_tiled",
    "block_sum",
    "softmax_rows",
    "half_scale_add",
    "half_row_dot",
    "half_stage_vectors",
    "half_arith",
    "half_convert",
    "histogram",
    "wmma_gemm_f16",
    "wmma_gemm_tf32",
    "warp_votes",
    "shuffle_types",
    "math_ops",
    "math_more",
    "int_ops",
    "wmma_m32n8k16",
    "say_hello",
]

BUG_SOURCE = r"""
#include "welder_prelude.cuh"

// Each thread writes its slot and reads its left neighbour's, with no barrier in between.
__global__ void missing_barrier(float* out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, buf, 0, 64);
  const int t = threadIdx.x;
  buf[t] = (float)t;
  out[t] = buf[(t + 63) % 64];
}

// Reads the right neighbour first, then writes its own slot: a write after another thread's read.
__global__ void write_after_read(float* out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, buf, 0, 64);
  const int t = threadIdx.x;
  out[t] = buf[(t + 1) % 64];
  buf[t] = (float)t;
}

// The last thread reads one past the end of the view.
__global__ void shared_out_of_bounds(float* out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, tile, 0, 32);
  const int t = threadIdx.x;
  tile[t] = 1.0f;
  __syncthreads();
  out[t] = tile[t + 1];
}

// Half of the block skips the barrier.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// The two halves of the block wait at different barriers.
__global__ void divergent_barrier_sites(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// The upper half-warp exits, but the shuffle's mask still names it.
__global__ void shuffle_after_exit(float* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  float v = (float)lane;
  v += __shfl_down_sync(0xffffffffu, v, 8);
  out[lane] = v;
}

// Most lanes leave before a warp-collective wmma load.
__global__ void wmma_missing_lanes(const __half* a, float* out) {
  if (threadIdx.x >= 8) return;
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> frag;
  nvcuda::wmma::load_matrix_sync(frag, a, 16);
  out[threadIdx.x] = __half2float(frag.x[0]);
}

// A warp-level tree reduction in shared memory; correct only with the __syncwarp calls.
__global__ void warp_smem_reduce(float* out, int use_syncwarp) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, s, 0, 32);
  const int lane = threadIdx.x;
  s[lane] = (float)lane;
  if (use_syncwarp) __syncwarp();
  for (int offset = 16; offset > 0; offset >>= 1) {
    float other = 0.0f;
    if (lane < offset) other = s[lane + offset];
    if (use_syncwarp) __syncwarp();
    if (lane < offset) s[lane] += other;
    if (use_syncwarp) __syncwarp();
  }
  if (lane == 0) out[0] = s[0];
}

// Reads past the end of its input.
__global__ void global_out_of_bounds(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i + n];
}

// Writes three elements past the end of its output (into the alignment slack).
__global__ void write_past_end(float* y, int n) {
  const int i = threadIdx.x;
  if (i < n + 3) y[i] = 1.0f;
}

// A float4 load at an address that is only 4-byte aligned.
__global__ void misaligned_vector(const float* x, float* y) {
  const float4 v = welder_vload<float4>(x, 1);
  y[threadIdx.x] = v.x;
}

// A 16-byte load from a half view at an element that is only 8-byte aligned.
__global__ void misaligned_half_vector(const __half* x, float* y) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(__half, h, 0, 16);
  if (threadIdx.x == 0) welder_vstore(h, 0, welder_vload<uint4>(x, 0));
  __syncthreads();
  const uint4 v = welder_vload<uint4>(h, 4);
  y[threadIdx.x] = (float)v.x;
}

// 256 KiB of locals per thread overflow a small fiber stack.
__global__ void stack_hog(float* y, int n) {
  volatile float big[65536];
  for (int i = 0; i < n; ++i) big[i] = (float)i;
  y[threadIdx.x] = big[n - 1];
}

__global__ void divide(int* y, int d) { y[threadIdx.x] = 100 / d; }

__global__ void asserting(float* y) {
  assert(threadIdx.x < 8);
  y[threadIdx.x] = 1.0f;
}

__global__ void declares_too_much(float* y) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, big, 64, 64);
  big[0] = 1.0f;
  y[0] = big[0];
}
"""

BUG_KERNELS = [
    "missing_barrier",
    "write_after_read",
    "shared_out_of_bounds",
    "divergent_barrier",
    "divergent_barrier_sites",
    "shuffle_after_exit",
    "wmma_missing_lanes",
    "warp_smem_reduce",
    "global_out_of_bounds",
    "write_past_end",
    "misaligned_vector",
    "misaligned_half_vector",
    "stack_hog",
    "divide",
    "asserting",
    "declares_too_much",
]


def line_of(source: str, text: str) -> int:
    """1-based line of the first occurrence of `text` in `source` (kernel.cu line numbers)."""
    return source[: source.index(text)].count("\n") + 1


@pytest.fixture(scope="session")
def cache() -> Path:
    """The session's emulator cache (conftest.py: one for every worker), where the runtime
    objects for these flags are built once."""
    return emulator._cache_root(None)


@pytest.fixture(scope="session")
def good(cache: Path) -> emu.EmulatedModule:
    return compile_kernels(GOOD_SOURCE, GOOD_KERNELS, cache_dir=cache, extra_flags=WARNINGS_AS_ERRORS)


@pytest.fixture(scope="session")
def bugs(cache: Path, good: emu.EmulatedModule) -> emu.EmulatedModule:
    # Built after `good` so that the two builds share the emulator's runtime objects.
    return compile_kernels(BUG_SOURCE, BUG_KERNELS, cache_dir=cache, extra_flags=WARNINGS_AS_ERRORS)


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


# ------------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("n", [4096, 1003])
def test_vec_add_float4_with_tail(good, rng, n):
    a, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    c = np.full(n, np.nan, dtype=np.float32)
    good.launch("vec_add_f4", (n // 4 + 63) // 64, 64, 0, [a, b, c, n])
    np.testing.assert_array_equal(c, a + b)


def test_tiled_matmul_with_non_dividing_sizes(good, rng):
    m, n, k = 37, 29, 45
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    c = np.zeros((m, n), dtype=np.float32)
    good.launch(
        "matmul_tiled", ((n + 15) // 16, (m + 15) // 16), (16, 16), 2 * 16 * 16 * 4, [a, b, c, m, n, k]
    )
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [256, 1024])
def test_block_reduction_with_shuffles_and_shared_memory(good, rng, threads):
    n, blocks = 10_000, 3
    x = rng.standard_normal(n, dtype=np.float32)
    out = np.zeros(blocks, dtype=np.float32)
    good.launch("block_sum", blocks, threads, 32 * 4, [x, out, n])
    stride = blocks * threads
    expected = [
        sum(x[i::stride].astype(np.float64).sum() for i in range(b * threads, (b + 1) * threads))
        for b in range(blocks)
    ]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_softmax_rows(good, rng):
    rows, cols = 5, 300
    x = 3 * rng.standard_normal((rows, cols), dtype=np.float32)
    y = np.zeros_like(x)
    good.launch("softmax_rows", rows, 128, 32 * 4, [x, y, cols])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [512, 257])
def test_half_elementwise_with_fp32_arithmetic(good, rng, n):
    a = rng.standard_normal(n).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float16)
    y = np.zeros(n, dtype=np.float16)
    good.launch("half_scale_add", (n + 127) // 128, 64, 0, [a, b, y, 0.37, n])
    expected = (a.astype(np.float32) * np.float32(0.37) + b.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("n", [256, 104])
def test_half_vectors_stage_raw_bits_in_shared_memory(good, rng, n):
    x = rng.standard_normal(n).astype(np.float16)
    y = np.full(256, np.nan, dtype=np.float32)
    good.launch("half_stage_vectors", 1, 64, 3 * 512, [x, y, n])
    padded = np.concatenate([x.astype(np.float32), np.zeros(256 - n, np.float32)])
    np.testing.assert_array_equal(y, 7 * padded[::-1])


def test_half_dot_accumulates_in_fp32(good, rng):
    rows, cols = 4, 1000
    x = rng.standard_normal((rows, cols)).astype(np.float16)
    w = rng.standard_normal(cols).astype(np.float16)
    out = np.zeros(rows, dtype=np.float32)
    good.launch("half_row_dot", rows, 32, 0, [x, w, out, cols])
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_half_operators_round_like_numpy(good, rng):
    n = 1000
    a = (rng.standard_normal(n) * 100).astype(np.float16)
    b = (rng.standard_normal(n) * 0.01).astype(np.float16)
    out = np.zeros((n, 4), dtype=np.float16)
    good.launch("half_arith", (n + 127) // 128, 128, 0, [a, b, out, n])
    with np.errstate(all="ignore"):
        expected = np.stack([a * b + a, a / b, np.fmax(a, b), -a + np.abs(b)], axis=1)
    np.testing.assert_array_equal(out, expected)


def test_half_conversions_are_ieee_round_to_nearest_even(good, rng):
    patterns = np.arange(65536, dtype=np.uint16)
    halves = patterns.view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    # Exact halves, midpoints between neighbours (ties), points near them, and random floats
    # spanning subnormals to overflow.
    ordered = np.unique(finite)
    mids = ((ordered[:-1].astype(np.float64) + ordered[1:]) / 2).astype(np.float32)
    nudged = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    random = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 5, 20000)).astype(np.float32)
    edges = np.array(
        [65504, 65519.99, 65520, 1e6, -1e6, 2.0**-25, 2.0**-24, 3 * 2.0**-26, 0.0, -0.0, np.inf, -np.inf],
        np.float32,
    )
    x = np.concatenate([finite, mids, nudged, random, edges])[:65536]
    x = np.pad(x, (0, 65536 - x.size))
    bits = np.zeros(65536, dtype=np.uint16)
    values = np.zeros(65536, dtype=np.float32)
    good.launch("half_convert", 256, 256, 0, [x, bits, patterns, values, 65536])
    np.testing.assert_array_equal(bits, x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(values, halves)  # NaN compares equal to NaN here


def test_shared_histogram_with_atomics(good, rng):
    n, bins = 5000, 37
    values = rng.integers(0, bins, n, dtype=np.int32)
    hist = np.zeros(bins, dtype=np.uint32)
    good.launch("histogram", 4, 128, bins * 4, [values, hist, n, bins])
    np.testing.assert_array_equal(hist, np.bincount(values, minlength=bins))


def test_wmma_half_gemm_with_fp32_accumulators(good, rng):
    m, n, k = 32, 48, 64
    a = rng.standard_normal((m, k)).astype(np.float16)
    b_t = rng.standard_normal((n, k)).astype(np.float16)  # B in column-major order
    c = np.zeros((m, n), dtype=np.float32)
    good.launch("wmma_gemm_f16", (n // 16, m // 16), 32, 16 * 16 * 2, [a, b_t, c, n, k, 0.5])
    expected = 0.5 * (a.astype(np.float64) @ b_t.astype(np.float64).T)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4)


def test_wmma_tf32_gemm(good, rng):
    m, n, k = 32, 32, 40
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    c = np.zeros((m, n), dtype=np.float32)
    good.launch("wmma_gemm_tf32", (n // 16, m // 16), 32, 0, [a, b, c, n, k])
    reference = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    error = np.abs(c - reference) / scale
    assert error.max() <= 2e-3  # TF32 keeps 10 mantissa bits
    assert error.max() > 1e-6  # ... and really drops the rest


def test_wmma_m32n8k16_with_half_accumulator(good, rng):
    a = rng.standard_normal((32, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    c = np.zeros((8, 32), dtype=np.float16)  # column-major 32x8
    good.launch("wmma_m32n8k16", 1, 32, 0, [a, b, c])
    expected = (a.astype(np.float64) @ b.astype(np.float64) + 1).astype(np.float16)
    np.testing.assert_allclose(c.T.astype(np.float32), expected.astype(np.float32), rtol=1e-3, atol=1e-3)


def test_device_printf(good, capfd):
    good.launch("say_hello", 2, 32, 0, [7])
    assert capfd.readouterr().out == "hello from block 0, tag 7\nhello from block 1, tag 7\n"


def test_warp_votes_shuffles_and_active_mask(good, rng):
    threads = 64
    flags = (rng.random(threads) < 0.5).astype(np.int32)
    flags[32:] = 1  # the second warp votes unanimously
    out = np.zeros((threads, 8), dtype=np.uint32)
    good.launch("warp_votes", 1, threads, 0, [flags, out])
    t = np.arange(threads)
    lane = t % 32
    ballots = [sum(int(flags[w * 32 + i]) << i for i in range(32)) for w in range(2)]
    expected = np.zeros((threads, 8), dtype=np.int64)
    expected[:, 0] = [ballots[w] for w in t // 32]
    expected[:, 1] = [ballots[w] != 0 for w in t // 32]
    expected[:, 2] = [ballots[w] == 0xFFFFFFFF for w in t // 32]
    expected[:, 3] = (t // 8) * 8 + 3
    expected[:, 4] = np.where(lane % 16 == 0, t, t - 1)
    expected[:, 5] = (t // 32) * 32 + (lane ^ 5)
    expected[:, 6] = flags.sum()
    expected[:, 7] = np.where(lane % 3 == 0, sum(1 << i for i in range(0, 32, 3)), 0)
    np.testing.assert_array_equal(out, expected.astype(np.uint32))


def test_shuffles_of_wide_and_half_types(good):
    t = np.arange(32)
    d, ll = np.zeros(32), np.zeros(32, dtype=np.int64)
    h, h2 = np.zeros(32, dtype=np.float16), np.zeros((32, 2), dtype=np.float16)
    good.launch("shuffle_types", 1, 32, 0, [d, ll, h, h2])
    np.testing.assert_array_equal(d, 0.5 * (t ^ 1))
    np.testing.assert_array_equal(ll, np.where(t < 30, t + 2, t).astype(np.int64) << 33)
    np.testing.assert_array_equal(h, np.full(32, 7, np.float16))
    src = np.where(t == 0, 0, t - 1)
    np.testing.assert_array_equal(h2, np.stack([src, -src], axis=1).astype(np.float16))


def test_math_functions(good, rng):
    n = 500
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    y = np.zeros((n, 8), dtype=np.float32)
    good.launch("math_ops", (n + 127) // 128, 128, 0, [x, y, n])
    x64 = x.astype(np.float64)
    expected = np.stack(
        [
            np.exp(x64),
            np.log(np.abs(x64) + 1),
            np.tanh(x64),
            np.vectorize(math.erf)(x64),
            1 / np.sqrt(np.abs(x64) + 1),
            np.clip(x64, 0, 1),
            np.sign(x64) * np.floor(np.abs(x64 * 4) + 0.5),
            np.rint(x64 * 4) + np.minimum(x64, 0.25) + np.sign(x64) + np.fmod(x, np.float32(0.75)),
        ],
        axis=1,
    )
    np.testing.assert_allclose(y, expected, rtol=2e-6, atol=2e-6)


def test_more_math_functions_and_classification(good, rng):
    n = 400
    x = (rng.standard_normal(n) * 2).astype(np.float32)
    x[:3] = [0.0, -1.0, 3.0]
    y = np.zeros((n, 8), dtype=np.float32)
    flags = np.zeros((n, 3), dtype=np.int32)
    good.launch("math_more", (n + 127) // 128, 128, 0, [x, y, flags, n])
    v = x.astype(np.float64)
    a = np.abs(v)
    erfc = np.vectorize(math.erfc)
    expected = np.stack(
        [
            np.exp2(v) + np.log2(a + 1),
            np.sqrt(a) + erfc(v),
            np.sin(v) + np.cos(v),
            np.floor(v) + np.ceil(v) + np.trunc(v),
            (a + 1) ** 1.5 + v * v + 1 + np.maximum(v, 0) + np.minimum(v, 1),
            np.exp(v) + np.log(a + 1) + 2**v,
            v / 3 + 1 / (a + 10) + np.sqrt(a),
            3 * v + v + 0.5 + np.rint(v),
        ],
        axis=1,
    )
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    with np.errstate(all="ignore"):
        x32 = x.astype(np.float32)
        nan_sqrt, inf_exp = np.isnan(np.sqrt(x32)), np.isinf(np.exp(np.float32(100) * x32))
        expected_flags = np.stack([nan_sqrt, inf_exp, np.isfinite(np.log(x32))], axis=1)
    np.testing.assert_array_equal(flags, expected_flags.astype(np.int32))


def test_integer_intrinsics(good, rng):
    n = 300
    a = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    b = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    a[:3], b[:3] = [0, -1, 7], [0, 5, -8]
    out = np.zeros((n, 8), dtype=np.int32)
    good.launch("int_ops", (n + 127) // 128, 128, 0, [a, b, out, n])
    ua, ub = a.view(np.uint32).astype(np.uint64), b.view(np.uint32).astype(np.uint64)
    expected = np.stack(
        [
            np.minimum(a, b),
            np.maximum(a, b),
            np.maximum(ua, ub).astype(np.uint32).view(np.int32),
            [bin(int(v)).count("1") for v in ua],
            [32 - int(v).bit_length() for v in ua],
            [(int(v) & -int(v)).bit_length() for v in ub],
            ((ua * ub) >> 32).astype(np.uint32).view(np.int32),
            np.rint(a.astype(np.float32) * np.float32(0.5)).astype(np.int32),
        ],
        axis=1,
    )
    np.testing.assert_array_equal(out, expected)


# ------------------------------------------------------------------------------ planted bugs


def launch_error(module: emu.EmulatedModule, *launch_args, **options) -> str:
    with pytest.raises(EmulationError) as caught:
        module.launch(*launch_args, **options)
    return str(caught.value)


def test_missing_barrier_is_a_race(bugs):
    message = launch_error(bugs, "missing_barrier", 1, 64, 64 * 4, [np.zeros(64, np.float32)])
    assert re.search(
        r"data race on shared view 'buf' index 0: thread 1 \(1,0,0\) reads it, "
        r"but thread 0 \(0,0,0\) wrote it with no barrier in between \(since the block started\)",
        message,
    ), message


def test_write_after_another_threads_read_is_a_race(bugs):
    message = launch_error(bugs, "write_after_read", 1, 64, 64 * 4, [np.zeros(64, np.float32)])
    assert (
        "data race on shared view 'buf' index 1: thread 1 (1,0,0) writes it, but thread 0 (0,0,0) read it"
        in message
    )


def test_shared_view_index_out_of_bounds(bugs):
    message = launch_error(bugs, "shared_out_of_bounds", 1, 32, 256, [np.zeros(32, np.float32)])
    assert message.endswith(
        "block (0,0,0), thread 31 (31,0,0): shared view 'tile' index 32 is out of bounds (count 32)"
    )


def test_view_larger_than_the_launch_shared_memory(bugs):
    message = launch_error(bugs, "declares_too_much", 1, 1, 128, [np.zeros(1, np.float32)])
    line = line_of(BUG_SOURCE, "WELDER_SHARED(float, big")
    assert f"shared view 'big' (kernel.cu:{line}) spans bytes [64, 320), beyond the 128 bytes" in message


def test_barrier_skipped_by_exiting_threads(bugs):
    message = launch_error(bugs, "divergent_barrier", 1, 32, 0, [np.zeros(32, np.float32)])
    line = line_of(BUG_SOURCE, "if (threadIdx.x < 16) __syncthreads();")
    assert (
        f"__syncthreads at kernel.cu:{line}: threads 0-15 wait at the barrier but threads 16-31 exited"
        in message
    )


def test_divergent_barrier_sites(bugs):
    message = launch_error(bugs, "divergent_barrier_sites", 1, 32, 0, [np.zeros(32, np.float32)])
    first = line_of(BUG_SOURCE, "  if (threadIdx.x < 16) {\n    __syncthreads();") + 1
    assert (
        f"divergent barrier: threads 0-15 wait at __syncthreads (kernel.cu:{first}); "
        f"threads 16-31 wait at __syncthreads (kernel.cu:{first + 2})"
    ) in message


def test_shuffle_naming_an_exited_lane(bugs):
    message = launch_error(bugs, "shuffle_after_exit", 1, 32, 0, [np.zeros(32, np.float32)])
    line = line_of(BUG_SOURCE, "v += __shfl_down_sync")
    assert (
        f"__shfl_down_sync at kernel.cu:{line} (warp 0, mask 0xffffffff) cannot complete: "
        "lanes 0-15 arrived; lanes 16-31 have exited"
    ) in message


def test_wmma_is_warp_collective(bugs):
    message = launch_error(
        bugs, "wmma_missing_lanes", 1, 32, 0, [np.zeros(256, np.float16), np.zeros(32, np.float32)]
    )
    assert "wmma::load_matrix_sync at kernel.cu:" in message
    assert "cannot complete: lanes 0-7 arrived; lanes 8-31 have exited" in message


def test_syncwarp_orders_warp_synchronous_shared_memory(bugs):
    out = np.zeros(1, np.float32)
    bugs.launch("warp_smem_reduce", 1, 32, 32 * 4, [out, 1])
    assert out[0] == sum(range(32))
    message = launch_error(bugs, "warp_smem_reduce", 1, 32, 32 * 4, [out, 0])
    assert (
        "data race on shared view 's' index 1: thread 1 (1,0,0) writes it, but thread 0 (0,0,0) read it"
        in message
    )


@pytest.mark.parametrize(("n", "thread"), [(96, 0), (100, 4)])
def test_global_read_past_the_end_faults_in_the_guard(bugs, n, thread):
    # 96 floats end at the guard page; 100 floats leave 16 bytes of slack (the copy is 32-byte aligned).
    message = launch_error(
        bugs, "global_out_of_bounds", 4, 32, 0, [np.zeros(n, np.float32), np.zeros(n, np.float32), n]
    )
    pattern = (
        rf"thread {thread} \({thread},0,0\): segmentation fault at address 0x[0-9a-f]+, "
        rf"byte {4 * (n + thread)} of argument 0 \(const float32\*, {4 * n} bytes\), past its end"
    )
    assert re.search(pattern, message), message


def test_write_into_the_alignment_slack_is_reported(bugs):
    n = 29
    y = np.zeros(n, np.float32)
    message = launch_error(bugs, "write_past_end", 1, 32, 0, [y, n])
    assert message == (
        "kernel 'write_past_end': "
        "the kernel wrote to byte 116 of argument 0 (float32*, 116 bytes), past its end"
    )


def test_misaligned_vector_load(bugs):
    message = launch_error(
        bugs, "misaligned_vector", 1, 1, 0, [np.zeros(8, np.float32), np.zeros(1, np.float32)]
    )
    assert "misaligned 16-byte vector load from global address" in message


def test_misaligned_half_vector_load_from_shared_memory(bugs):
    x, y = np.ones(16, np.float16), np.zeros(4, np.float32)
    message = launch_error(bugs, "misaligned_half_vector", 1, 4, 32, [x, y])
    assert "misaligned 16-byte vector load from shared view 'h' index 4 (byte 8)" in message


def test_fiber_stack_overflow(bugs):
    message = launch_error(
        bugs, "stack_hog", 1, 2, 0, [np.zeros(2, np.float32), 65536], stack_bytes=64 * 1024
    )
    assert "thread 0 (0,0,0): stack overflow (the fiber stack has 65536 bytes; raise stack_bytes)" in message
    y = np.zeros(2, np.float32)
    bugs.launch("stack_hog", 1, 2, 0, [y, 65536], stack_bytes=1 << 20)
    assert y.tolist() == [65535.0, 65535.0]


def test_integer_division_by_zero(bugs):
    message = launch_error(bugs, "divide", 1, 4, 0, [np.zeros(4, np.int32), 0])
    assert message.endswith("thread 0 (0,0,0): arithmetic exception (integer division by zero?)")


def test_device_assert(bugs):
    message = launch_error(bugs, "asserting", 1, 16, 0, [np.zeros(16, np.float32)])
    line = line_of(BUG_SOURCE, "assert(threadIdx.x < 8);")
    assert f"thread 8 (8,0,0): assertion `threadIdx.x < 8` failed at kernel.cu:{line}" in message


def test_module_keeps_working_after_errors(bugs):
    launch_error(bugs, "divide", 1, 4, 0, [np.zeros(4, np.int32), 0])
    launch_error(bugs, "missing_barrier", 1, 64, 64 * 4, [np.zeros(64, np.float32)])
    y = np.zeros(4, np.int32)
    bugs.launch("divide", 1, 4, 0, [y, 7])
    assert y.tolist() == [14] * 4


# ------------------------------------------------------------------------------ the driver


def test_faults_outside_kernels_still_crash(good, bugs, cache):
    # Each module chains its fault handler to the one installed before it; a fault that is not a
    # kernel's must travel down that chain to Python's faulthandler (never loop between modules).
    script = f"""
import ctypes, sys
import numpy as np
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_emulator as t
from welder.runtime.emu import compile_kernels
options = dict(cache_dir={str(cache)!r}, extra_flags=t.WARNINGS_AS_ERRORS)
good = compile_kernels(t.GOOD_SOURCE, t.GOOD_KERNELS, **options)
bugs = compile_kernels(t.BUG_SOURCE, t.BUG_KERNELS, **options)
good.launch("say_hello", 1, 32, 0, [1])
bugs.launch("divide", 1, 4, 0, [np.zeros(4, np.int32), 1])
good.launch("say_hello", 1, 32, 0, [2])
ctypes.string_at(0)
"""
    command = [sys.executable, "-X", "faulthandler", "-c", script]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.stdout == "hello from block 0, tag 1\nhello from block 0, tag 2\n"
    assert result.returncode == -signal.SIGSEGV, result.stderr
    assert "Fatal Python error: Segmentation fault" in result.stderr


def test_arguments_are_checked_against_the_signature(good):
    assert good.signature("vec_add_f4") == ("const float32*", "const float32*", "float32*", "int32")
    x = np.zeros(8, np.float32)
    with pytest.raises(EmulationError, match=r"argument 1 \(const float32\*\): got an array of float64"):
        good.launch("vec_add_f4", 1, 32, 0, [x, np.zeros(8), x, 8])
    with pytest.raises(EmulationError, match="takes 4 arguments, 3 were given"):
        good.launch("vec_add_f4", 1, 32, 0, [x, x, x])
    with pytest.raises(EmulationError, match="not C-contiguous"):
        good.launch("vec_add_f4", 1, 32, 0, [x, np.zeros(16, np.float32)[::2], x, 8])
    with pytest.raises(EmulationError, match=r"argument 3 \(int32\): needs an integer"):
        good.launch("vec_add_f4", 1, 32, 0, [x, x, x, 8.0])
    with pytest.raises(EmulationError, match=r"block \(2048,1,1\) exceeds the limits"):
        good.launch("vec_add_f4", 1, 2048, 0, [x, x, x, 8])
    with pytest.raises(EmulationError, match="no kernel 'nope'"):
        good.launch("nope", 1, 1, 0, [])


def test_read_only_arrays_must_not_change(good):
    a = np.ones(8, np.float32)
    a.flags.writeable = False
    message = launch_error(good, "vec_add_f4", 1, 32, 0, [a, a, a, 8])
    assert "the kernel wrote to argument 2 (float32*), a read-only buffer" in message


def test_emulation_error_is_a_welder_error():
    assert issubclass(EmulationError, WelderError)


def test_compile_errors_carry_the_compiler_message(cache):
    with pytest.raises(EmulationError, match=r"(?s)g\+\+ could not compile.*kernel\.cu:3.*undeclared"):
        compile_kernels(
            '#include "welder_prelude.cuh"\n__global__ void k(float* y) {\n  y[0] = undeclared;\n}\n',
            ["k"],
            cache_dir=cache,
            extra_flags=WARNINGS_AS_ERRORS,
        )


def test_builds_are_cached(good, cache):
    again = compile_kernels(GOOD_SOURCE, GOOD_KERNELS, cache_dir=cache, extra_flags=WARNINGS_AS_ERRORS)
    assert again is good
    assert good.path.parent == cache and good.path.is_file()


@pytest.fixture
def compiled_sources(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sources g++ compiles from here on (each compile's ``-x c++`` file), in order."""
    compiled: list[str] = []
    run = emulator._run_compilers

    def recording(commands):
        compiled.extend(c[c.index("-x") + 2] for c in commands if "-x" in c)
        return run(commands)

    monkeypatch.setattr(emulator, "_run_compilers", recording)
    return compiled


def test_builders_racing_for_one_cache_compile_its_runtime_objects_once(tmp_path, compiled_sources):
    """Modules built at once into a new cache (threads here, processes alike: each takes its
    own lock on the file) compile the emulator's runtime objects once between them, and
    each module still links and runs."""
    source = '#include "welder_prelude.cuh"\n__global__ void k(float* y) {\n  y[threadIdx.x] = %d.0f;\n}\n'
    with ThreadPoolExecutor(3) as pool:
        modules = list(pool.map(lambda v: compile_kernels(source % v, ["k"], cache_dir=tmp_path), [1, 2, 3]))
    runtime = sorted(str(p) for p in emulator.EMU_DIR.glob("*.cpp"))
    assert sorted(c for c in compiled_sources if c in runtime) == runtime
    for value, module in zip([1, 2, 3], modules):
        y = np.zeros(32, np.float32)
        module.launch("k", 1, 32, 0, [y])
        np.testing.assert_array_equal(y, np.full(32, value, np.float32))


def test_modules_at_other_optimisation_levels_and_include_folders_share_the_runtime_objects(
    cache, tmp_path, request
):
    """The emulator's runtime objects depend on the flags that change what they compile to
    (a define), not on a module's optimisation level or include folders: a module built
    with those (a folder no build used before) compiles no runtime source of its own once
    the plain set is there, links that set, and runs."""
    digest = emulator._emulator_digest()

    def objects(extra: list[str]) -> dict[Path, Path]:
        return emulator._runtime_objects(emulator._runtime_flags(extra), cache, digest)

    assert objects(["-DWELDER_UNCHECKED_INDICES"]) != objects([])
    source = '#include "welder_prelude.cuh"\n__global__ void k(float* y) {\n  y[threadIdx.x] = %d.0f;\n}\n'
    compile_kernels(source % 4, ["k"], cache_dir=cache)  # the plain set, built once a session
    assert all(obj.is_file() for obj in objects([]).values())
    compiled = request.getfixturevalue("compiled_sources")  # recording from here on
    module = compile_kernels(source % 5, ["k"], cache_dir=cache, extra_flags=[f"-I{tmp_path}", "-O0"])
    assert compiled and not [c for c in compiled if Path(c).parent == emulator.EMU_DIR], compiled
    y = np.zeros(32, np.float32)
    module.launch("k", 1, 32, 0, [y])
    np.testing.assert_array_equal(y, np.full(32, 5.0, np.float32))


def test_a_caches_second_module_compiles_against_the_precompiled_prelude(tmp_path, rng, cache, good):
    """The first module a cache builds parses the prelude; the second precompiles it beside
    the modules, and g++ takes that .gch for a module's compile (-H marks it with "!").
    (The new cache starts with the session's runtime objects for these flags, which ``good``
    built: they are not what is tested here.)"""
    session, cache = cache, tmp_path / "emu"
    digest = emulator._emulator_digest()
    cache.mkdir()
    for obj in emulator._runtime_objects(
        emulator._runtime_flags(WARNINGS_AS_ERRORS), session, digest
    ).values():
        shutil.copy(obj, cache / obj.name)
    source = '#include "welder_prelude.cuh"\n__global__ void k(float* y) {\n  y[threadIdx.x] = 2.0f;\n}\n'
    compile_kernels(source, ["k"], cache_dir=cache, extra_flags=WARNINGS_AS_ERRORS)
    assert not list(cache.glob("pch-*"))
    second = compile_kernels(
        source.replace("2.0f", "3.0f"), ["k"], cache_dir=cache, extra_flags=WARNINGS_AS_ERRORS
    )
    [folder] = cache.glob("pch-*")
    header = folder / emulator.PRELUDE.name
    assert header.with_name(header.name + ".gch").is_file()
    y = np.zeros(32, np.float32)
    second.launch("k", 1, 32, 0, [y])
    np.testing.assert_array_equal(y, np.full(32, 3.0, np.float32))  # the module still computes

    flags = [f for f in [*emulator._BASE_FLAGS, *WARNINGS_AS_ERRORS] if f != "-shared"]
    (tmp_path / "k.cpp").write_text(source)
    command = emulator._compile_command(
        [*flags, "-fsyntax-only", "-H"], tmp_path / "k.cpp", tmp_path / "k.o", header
    )
    shown = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and shown.stderr.startswith(f"! {header}.gch"), shown.stderr[:500]


def test_default_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("WELDER_CACHE_DIR", str(tmp_path))
    assert emulator._cache_root(None) == tmp_path / "emu"
    monkeypatch.delenv("WELDER_CACHE_DIR")
    assert emulator._cache_root(None) == Path.home() / ".cache" / "welder" / "emu"
    assert emulator._cache_root(tmp_path / "x") == tmp_path / "x"


def test_kernels_and_emulator_compile_without_warnings(good, bugs):
    # Both session modules (and the emulator's runtime objects) are built with WARNINGS_AS_ERRORS.
    assert set(good.kernel_names) == set(GOOD_KERNELS) and set(bugs.kernel_names) == set(BUG_KERNELS)


@pytest.mark.slow
def test_ucontext_fallback_runs_kernels(cache, rng):
    module = compile_kernels(
        GOOD_SOURCE, ["block_sum"], cache_dir=cache, extra_flags=("-DWELDER_EMU_USE_UCONTEXT",)
    )
    x = rng.standard_normal(1000, dtype=np.float32)
    out = np.zeros(1, dtype=np.float32)
    module.launch("block_sum", 1, 128, 32 * 4, [x, out, x.size])
    np.testing.assert_allclose(out, x.astype(np.float64).sum(), rtol=1e-4, atol=1e-4)
    message = launch_error(module, "block_sum", 1, 128, 4, [x, out, x.size])
    assert "shared view 'partial'" in message and "beyond the 4 bytes of dynamic shared memory" in message


# ------------------------------------------------------------------------------ nvcc


@pytest.fixture(scope="session")
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH")
    return path


def test_every_kernel_compiles_with_nvcc(nvcc, tmp_path):
    source = tmp_path / "kernels.cu"
    source.write_text(GOOD_SOURCE + BUG_SOURCE)
    commands = {
        arch: [
            nvcc,
            f"-arch={arch}",
            "-cubin",
            "-std=c++17",
            "-Werror",
            "all-warnings",
            "-I",
            str(emu.PRELUDE_DIR),
            "-o",
            str(tmp_path / f"{arch}.cubin"),
            str(source),
        ]
        for arch in ("sm_80", "sm_90")
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        results = dict(
            zip(
                commands,
                pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands.values()),
            )
        )
    for arch, result in results.items():
        assert result.returncode == 0 and not result.stderr.strip(), f"{arch}:\n{result.stderr}"
