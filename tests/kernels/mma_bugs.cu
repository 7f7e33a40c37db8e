// Planted bugs (and emulator-only observations) for welder_mma.cuh: each kernel is valid CUDA that
// compiles with nvcc, and each misuse must be reported by the emulator (tests/test_emulator_mma.py).
#include "welder_prelude.cuh"
#include "welder_mma.cuh"

// Copies stage 0, 1, 2 (one commit group each) and a fourth, uncommitted, copy; after wait_group 2,
// 1, 0 and wait_all, each thread records its own four slots in out[step][slot][t].  Reading slots
// still in flight is itself a bug: run it with race checks off to see which copies have landed.
extern "C" __global__ void cp_async_peek(const float* __restrict__ src, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  const int t = threadIdx.x, n = blockDim.x;
  WELDER_SHARED(float, slot, 0, 4 * 4 * n);
  for (int s = 0; s < 4; ++s) {
    welder_cp_async<16>(slot + (s * n + t) * 4, src + (s * n + t) * 4);
    if (s < 3) welder_cp_async_commit();
  }
  for (int step = 0; step < 4; ++step) {
    if (step == 0) welder_cp_async_wait<2>();
    if (step == 1) welder_cp_async_wait<1>();
    if (step == 2) welder_cp_async_wait<0>();
    if (step == 3) welder_cp_async_wait_all();
    for (int s = 0; s < 4; ++s)
      welder_vstore(out, ((step * 4 + s) * n + t) * 4, welder_vload<float4>(slot, (s * n + t) * 4));
  }
}

// Thread 0 copies and exits without waiting; thread 1 (emulated after it) reads the destination.
extern "C" __global__ void cp_async_exit_pending(const float* __restrict__ src, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(float, buf, 0, 4);
  if (threadIdx.x == 0) {
    welder_cp_async<16>(buf, src);
    welder_cp_async_commit();
    return;
  }
  if (threadIdx.x == 1)
    for (int i = 0; i < 4; ++i) out[i] = buf[i];
}

// A barrier is not a wait: the copies are still in flight when the neighbour reads.
extern "C" __global__ void cp_async_no_wait(const float* __restrict__ src, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  const int t = threadIdx.x, n = blockDim.x;
  WELDER_SHARED(float, buf, 0, 4 * n);
  welder_cp_async<16>(buf + 4 * t, src + 4 * t);
  welder_cp_async_commit();
  __syncthreads();
  out[t] = buf[4 * ((t + 1) % n)];
}

// Each thread waits for its own copy, but the neighbour's copy is ordered only by a barrier.
extern "C" __global__ void cp_async_wait_no_barrier(const float* __restrict__ src, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  const int t = threadIdx.x, n = blockDim.x;
  WELDER_SHARED(float, buf, 0, 4 * n);
  welder_cp_async<16>(buf + 4 * t, src + 4 * t);
  welder_cp_async_wait_all();
  out[t] = buf[4 * ((t + 1) % n)];
}

// Refills a stage that other threads may still be reading (the barrier before the refill is missing).
extern "C" __global__ void cp_async_refill_race(const float* __restrict__ src, float* __restrict__ out) {
  WELDER_SMEM_BEGIN;
  const int t = threadIdx.x, n = blockDim.x;
  WELDER_SHARED(float, buf, 0, 4 * n);
  welder_cp_async<16>(buf + 4 * t, src + 4 * t);
  welder_cp_async_wait_all();
  __syncthreads();
  out[t] = buf[4 * ((t + 1) % n)];
  welder_cp_async<16>(buf + 4 * t, src + 4 * (n + t));
  welder_cp_async_wait_all();
  out[n + t] = buf[4 * t];
}

// mode 0: source misaligned; 1: destination misaligned; 2: src_bytes larger than the copy;
// 3: two threads copy into the same bytes; 4: the source lies past the end of its argument.
extern "C" __global__ void cp_async_misuse(const float* __restrict__ src, int n, float* __restrict__ out, int mode) {
  WELDER_SMEM_BEGIN;
  const int t = threadIdx.x;
  WELDER_SHARED(float, buf, 0, 4 * blockDim.x + 4);
  if (mode == 0) welder_cp_async<16>(buf + 4 * t, src + 4 * t + 2);
  if (mode == 1) welder_cp_async<8>(buf + 4 * t + 1, src + 4 * t);
  if (mode == 2) welder_cp_async<16>(buf + 4 * t, src + 4 * t, 20);
  if (mode == 3) welder_cp_async<16>(buf + 4 * (t / 2), src + 4 * t);
  if (mode == 4) welder_cp_async<16>(buf + 4 * t, src + n + 4 * t);
  __syncthreads();
  welder_cp_async_wait_all();
  out[t] = buf[4 * t];
}

// mode 0: lane 31 leaves before the ldmatrix; 1: a row address off 16-byte alignment;
// 2: rows past the end of the view; 3: lane 31 leaves before the mma; 4: a 48-thread block.
extern "C" __global__ void mma_misuse(const unsigned short* __restrict__ tile, float* __restrict__ out, int mode) {
  WELDER_SMEM_BEGIN;
  WELDER_SHARED(unsigned short, s, 0, 256);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) s[i] = tile[i];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  if ((mode == 0 || mode == 3) && lane == 31) return;
  uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  if (mode != 3 && mode != 4) {
    const int row = mode == 2 ? lane + 8 : lane % 16;
    welder_ldmatrix_x4(a, s + row * 16 + (mode == 1 ? 4 : 0));
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  welder_mma_m16n8k16_f16f32(acc, a, b, acc);
  out[threadIdx.x] = acc[0];
}
