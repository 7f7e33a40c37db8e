// CPU emulation of the CUDA device language, for running generated kernels under g++.
//
// Include this (through codegen_templates/welder_prelude.cuh with WELDER_EMULATE defined) before
// kernel source, compile emu_runtime.cpp and emu_launch.cpp alongside (same flags), then call
// welder_emu::launch or the C entry points the Python driver generates.  The pieces, each
// documented in its own file:
//
//   emu_types.h     vector types (float4, ...), dim3, threadIdx/blockIdx/blockDim/gridDim, warpSize
//   emu_half.h      __half / __half2 with round-to-nearest-even conversions and cuda_fp16 intrinsics
//   emu_bf16.h      __nv_bfloat16 / __nv_bfloat162 likewise, with the cuda_bf16 intrinsics kernels use
//   emu_math.h      device math: rsqrtf, __expf, __float2int_rn, __popc, global min/max, ...
//   emu_runtime.h   call sites, errors, and the blocking primitives the intrinsics are built on
//   emu_shared.h    checked shared-memory views (WELDER_SHARED) and welder_vload / welder_vstore
//   emu_device.h    __syncthreads*, __shfl*_sync, votes, __syncwarp, atomics, fences, __trap, assert
//   emu_wmma.h      nvcuda::wmma fragments (half, int8, tf32) as warp-collective operations
//   emu_mma.h       mma.sync, ldmatrix and cp.async with the PTX register layouts (included by
//                   codegen_templates/welder_mma.cuh, not here)
//   emu_wgmma.h     Hopper wgmma from shared-memory descriptors, its fences and groups (included
//                   by codegen_templates/welder_wgmma.cuh, not here)
//   emu_tma.h       Hopper TMA loads, mbarriers and setmaxnreg (included by
//                   codegen_templates/welder_tma.cuh, not here)
//   emu_cluster.h   thread-block clusters: cluster barrier, remote arrivals, multicast loads,
//                   WELDER_CLUSTER_DIMS (included by codegen_templates/welder_cluster.cuh, not here)
//   emu_tensor_map.h  CUtensorMap, welder_encode_tensor_map, __grid_constant__
//   emu_launch.h    launch(), kernel signatures, the C interface
// and, compiled once rather than into every module:
//   emu_scheduler.h, emu_runtime.cpp   block scheduler, barriers, collectives, race shadow state
//   emu_fiber.h                        fibers: an x86-64 stack switch (or ucontext), guarded stacks
//   emu_launch.cpp                     configuration checks, guarded arguments, fault handling
//   emu_tensor_map.cpp                 the tensor-map encode and its C entry point
#pragma once

// Standard headers first: the qualifier macros at the end of this file (notably __noinline__)
// must not reach library headers.
#include <math.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_types.h"
#include "emu_half.h"
#include "emu_bf16.h"
#include "emu_math.h"
#include "emu_runtime.h"
#include "emu_tensor_map.h"
#include "emu_shared.h"
#include "emu_device.h"
#include "emu_wmma.h"
#include "emu_launch.h"

// Function and variable space qualifiers vanish: everything runs on the host.
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Cluster dims reach the emulator through WELDER_CLUSTER_DIMS (emu_cluster.h), which a launch can
// look up by the kernel's address; the attribute itself is for nvcc.
#define __cluster_dims__(...)
#define __align__(n) __attribute__((aligned(n)))
// Blocks run one after another and launches are serialised, so a function-local static is exactly
// as shared as a __shared__ array -- except between the blocks of a cluster, which run together
// here and would share it.  Such arrays are neither bounds- nor race-checked, and
// `extern __shared__` does not compile: checked kernels use WELDER_SHARED views of the dynamic
// buffer instead (cluster kernels must).
#define __shared__ static
// __restrict__ is a g++ keyword already; `#pragma unroll` is ignored (the driver passes
// -Wno-unknown-pragmas).
