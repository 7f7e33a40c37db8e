// welder_prelude.cuh -- the portable layer every generated kernel includes first.
//
// The same kernel text compiles with nvcc for the GPU and with g++ -DWELDER_EMULATE for the CPU
// emulator (welder/runtime/emu), which must be on the include path in that mode.  Kernels use:
//
//   WELDER_SMEM_BEGIN;                          first statement of a kernel that uses shared memory:
//                                               declares the dynamic buffer `welder_smem`
//   WELDER_SHARED(T, name, byte_offset, count); a view of `count` T at `byte_offset` of that
//                                               buffer; `name` behaves like a T* (name[i], name + k,
//                                               &name[i]).  The emulator checks bounds and races;
//                                               an unused view draws no warning.
//   WELDER_SMEM_PTR(T)                          the type of a view, for __device__ helper parameters
//   welder_vload<V>(p, i)                       a V (float4, float2, half2, uint4, ...) read from the
//                                               address of p[i]; p is a global pointer or a view,
//                                               the address must be aligned to V
//   welder_vstore(p, i, v)                      writes v at the address of p[i]
//   welder_vec<T, N>                            N elements of T aligned as one vector (.v[k]):
//                                               what welder_vload / welder_vstore move for an
//                                               elementwise stage in vectors (16 bytes: LDG.128)
//
// Also available in both modes: __half/__half2 (cuda_fp16), __nv_bfloat16/__nv_bfloat162
// (cuda_bf16), nvcuda::wmma (mma.h) and device
// assert (do not include <cassert> again after this file: under the emulator that would bring back
// the host assert, which aborts instead of reporting).
//
// Views differ from raw pointers in ways the templates must respect: an element read converts to
// T only (write __half2float(h[i]), not `float f = h[i]`); members of a vector element are reached
// through welder_vload or a local copy; views are not cast to other pointer types (declare another
// view over the same bytes); and `auto x = view[i]` holds a reference, not a value.
// A guard, not #pragma once: an emulated runtime includes its folder's copy of this file after
// the precompiled copy in welder's cache (emu_runtime_prelude.h), and only a guard makes them one.
#ifndef WELDER_PRELUDE_CUH
#define WELDER_PRELUDE_CUH

#ifdef WELDER_EMULATE

#include "cuda_emu.h"

#define WELDER_SMEM_BEGIN [[maybe_unused]] unsigned char* const welder_smem = ::welder_emu::detail::dynamic_smem_base()
#define WELDER_SHARED(T, name, byte_offset, count)                  \
  [[maybe_unused]] ::welder_emu::SharedPtr<T> name =                \
      ::welder_emu::detail::shared_view<T>(welder_smem, #name, (byte_offset), (count))
#define WELDER_SMEM_PTR(T) ::welder_emu::SharedPtr<T>
#define WELDER_GRID_DEPENDENCY() ((void)0)

#else  // nvcc

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cassert>

#define WELDER_SMEM_BEGIN extern __shared__ __align__(16) unsigned char welder_smem[]
#define WELDER_SHARED(T, name, byte_offset, count) \
  [[maybe_unused]] T* name = reinterpret_cast<T*>(welder_smem + (byte_offset))
#define WELDER_SMEM_PTR(T) T*

// Programmatic dependent launch (sm_90): every kernel first waits until the grid before it in
// the stream has finished and its writes are visible, then lets the grid after it launch, whose
// blocks take SMs as this grid's leave and wait there in turn.  The runtime launches with the
// attribute that allows this only when asked (WELDER_PDL=1, docs/runtime.md); launched without
// it, as the tuner's timing does, both instructions return at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WELDER_GRID_DEPENDENCY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define WELDER_GRID_DEPENDENCY() ((void)0)
#endif

template <class V, class T>
__device__ __forceinline__ V welder_vload(const T* p, long long i) {
  return *reinterpret_cast<const V*>(p + i);
}

template <class T, class V>
__device__ __forceinline__ void welder_vstore(T* p, long long i, const V& v) {
  *reinterpret_cast<V*>(p + i) = v;
}

#endif

template <class T, int N>
struct alignas(sizeof(T) * N) welder_vec {
  T v[N];
};

#endif  // WELDER_PRELUDE_CUH
