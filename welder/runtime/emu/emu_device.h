// Device-side intrinsics of the CPU emulator: barriers, warp collectives, atomics, fences, traps.
//
// Every synchronising call captures its call site through a defaulted Site argument; threads
// meet only at the same site, which is how divergent barriers and mismatched collectives are told
// apart from matching ones.
#pragma once

#include <cassert>  // included first so that the emulator's assert below stays in force
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emu_half.h"
#include "emu_bf16.h"
#include "emu_runtime.h"
#include "emu_shared.h"

namespace welder_emu::detail {

template <class T>
inline uint64_t to_bits(const T& v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp collectives move at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
inline T from_bits(uint64_t bits) {
  T v;
  std::memcpy(static_cast<void*>(&v), &bits, sizeof(T));
  return v;
}

template <class T>
inline T shuffle(const char* primitive, WarpOp op, unsigned mask, const T& v, int param, int width, const Site& site) {
  return from_bits<T>(warp_collective(primitive, op, mask, to_bits(v), param, width, site));
}

inline unsigned ballot(const char* primitive, unsigned mask, int predicate, const Site& site) {
  return static_cast<unsigned>(warp_collective(primitive, WarpOp::kBallot, mask, predicate != 0, 0, 32, site));
}

inline uint32_t warp_reduce(const char* primitive, ReduceOp op, unsigned mask, uint32_t v, const Site& site) {
  return static_cast<uint32_t>(warp_collective(primitive, WarpOp::kReduce, mask, v, static_cast<int>(op), 32, site));
}

[[noreturn]] inline void assertion_failed(const char* expr, const char* file, int line) {
  raise_error(format("assertion `%s` failed at %s:%d", expr, file, line));
}

}  // namespace welder_emu::detail

// ------------------------------------------------------------------------------- block barriers
inline void __syncthreads(const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::block_barrier("__syncthreads", 0, site);
}
inline int __syncthreads_count(int predicate, const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::block_barrier("__syncthreads_count", predicate, site);
}
inline int __syncthreads_and(int predicate, const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::block_barrier("__syncthreads_and", predicate, site) ==
         static_cast<int>(welder_emu::detail::block_thread_count());
}
inline int __syncthreads_or(int predicate, const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::block_barrier("__syncthreads_or", predicate, site) > 0;
}

// Fences order memory on the GPU; one OS thread runs everything here, so they have nothing to do
// (and they do not synchronise threads in the race model either).
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned int) {}

// ------------------------------------------------------------------------------- warp level
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu, const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::warp_collective("__syncwarp", welder_emu::detail::WarpOp::kSyncwarp, mask, 0, 0, 32, site);
}
inline unsigned __activemask(const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::active_mask(site);
}
inline unsigned __ballot_sync(unsigned mask, int predicate, const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::ballot("__ballot_sync", mask, predicate, site);
}
inline int __any_sync(unsigned mask, int predicate, const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::ballot("__any_sync", mask, predicate, site) != 0;
}
inline int __all_sync(unsigned mask, int predicate, const welder_emu::Site& site = welder_emu::Site::here()) {
  // All lanes of the mask that exist must vote yes.
  const unsigned yes = welder_emu::detail::ballot("__all_sync", mask, predicate, site);
  return yes == (mask & welder_emu::detail::current_warp_lanes());
}

// Shuffles for every type CUDA overloads them for.  A lane reading from a lane outside the mask
// gets an all-ones bit pattern (NaN / -1): undefined on the GPU, visible here.
#define WELDER_EMU_SHUFFLES(T)                                                                                   \
  inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,                                 \
                       const welder_emu::Site& site = welder_emu::Site::here()) {                                \
    return welder_emu::detail::shuffle("__shfl_sync", welder_emu::detail::WarpOp::kShfl, mask, var, src_lane, width, \
                                       site);                                                                    \
  }                                                                                                              \
  inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = warpSize,                        \
                          const welder_emu::Site& site = welder_emu::Site::here()) {                             \
    return welder_emu::detail::shuffle("__shfl_up_sync", welder_emu::detail::WarpOp::kShflUp, mask, var,          \
                                       static_cast<int>(delta), width, site);                                    \
  }                                                                                                              \
  inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = warpSize,                      \
                            const welder_emu::Site& site = welder_emu::Site::here()) {                           \
    return welder_emu::detail::shuffle("__shfl_down_sync", welder_emu::detail::WarpOp::kShflDown, mask, var,      \
                                       static_cast<int>(delta), width, site);                                    \
  }                                                                                                              \
  inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,                            \
                           const welder_emu::Site& site = welder_emu::Site::here()) {                            \
    return welder_emu::detail::shuffle("__shfl_xor_sync", welder_emu::detail::WarpOp::kShflXor, mask, var,        \
                                       lane_mask, width, site);                                                  \
  }
WELDER_EMU_SHUFFLES(int)
WELDER_EMU_SHUFFLES(unsigned int)
WELDER_EMU_SHUFFLES(long)
WELDER_EMU_SHUFFLES(unsigned long)
WELDER_EMU_SHUFFLES(long long)
WELDER_EMU_SHUFFLES(unsigned long long)
WELDER_EMU_SHUFFLES(float)
WELDER_EMU_SHUFFLES(double)
WELDER_EMU_SHUFFLES(__half)
WELDER_EMU_SHUFFLES(__half2)
WELDER_EMU_SHUFFLES(__nv_bfloat16)
WELDER_EMU_SHUFFLES(__nv_bfloat162)
#undef WELDER_EMU_SHUFFLES

// sm_80 warp reductions.
#define WELDER_EMU_REDUCE(name, T, signed_op, unsigned_op)                                                    \
  inline T name(unsigned mask, T value, const welder_emu::Site& site = welder_emu::Site::here()) {            \
    constexpr auto op = std::is_signed<T>::value ? welder_emu::detail::ReduceOp::signed_op                    \
                                                 : welder_emu::detail::ReduceOp::unsigned_op;                 \
    return static_cast<T>(welder_emu::detail::warp_reduce(#name, op, mask, static_cast<uint32_t>(value), site)); \
  }
WELDER_EMU_REDUCE(__reduce_add_sync, int, kAdd, kAdd)
WELDER_EMU_REDUCE(__reduce_add_sync, unsigned int, kAdd, kAdd)
WELDER_EMU_REDUCE(__reduce_min_sync, int, kMinSigned, kMinUnsigned)
WELDER_EMU_REDUCE(__reduce_min_sync, unsigned int, kMinSigned, kMinUnsigned)
WELDER_EMU_REDUCE(__reduce_max_sync, int, kMaxSigned, kMaxUnsigned)
WELDER_EMU_REDUCE(__reduce_max_sync, unsigned int, kMaxSigned, kMaxUnsigned)
WELDER_EMU_REDUCE(__reduce_and_sync, unsigned int, kAnd, kAnd)
WELDER_EMU_REDUCE(__reduce_or_sync, unsigned int, kOr, kOr)
WELDER_EMU_REDUCE(__reduce_xor_sync, unsigned int, kXor, kXor)
#undef WELDER_EMU_REDUCE

// ------------------------------------------------------------------------------- atomics
// Only one fiber runs at a time and none is interrupted inside an atomic, so a plain
// read-modify-write is atomic.  On shared views the access is bounds-checked but exempt from the
// race check.  Each returns the old value, as in CUDA.
namespace welder_emu::detail {

template <class T>
inline T* atomic_target(T* p) {
  return p;
}
template <class T>
inline T* atomic_target(const SharedPtr<T>& p) {
  return reinterpret_cast<T*>(p.access(0, sizeof(T), AccessKind::kAtomic));
}

template <class P, class F>
inline auto atomic_update(const P& p, F f) {
  auto* target = atomic_target(p);
  const auto old = *target;
  *target = f(old);
  return old;
}

}  // namespace welder_emu::detail

#define WELDER_EMU_ATOMIC(name, T, expr)                                                   \
  inline T name(T* p, T v) {                                                               \
    return welder_emu::detail::atomic_update(p, [&]([[maybe_unused]] T old) -> T { return expr; }); \
  }                                                                                        \
  inline T name(const welder_emu::SharedPtr<T>& p, T v) {                                  \
    return welder_emu::detail::atomic_update(p, [&]([[maybe_unused]] T old) -> T { return expr; }); \
  }
WELDER_EMU_ATOMIC(atomicAdd, int, old + v)
WELDER_EMU_ATOMIC(atomicAdd, unsigned int, old + v)
WELDER_EMU_ATOMIC(atomicAdd, unsigned long long, old + v)
WELDER_EMU_ATOMIC(atomicAdd, float, old + v)
WELDER_EMU_ATOMIC(atomicAdd, double, old + v)
WELDER_EMU_ATOMIC(atomicAdd, __half, __hadd(old, v))
WELDER_EMU_ATOMIC(atomicAdd, __half2, __hadd2(old, v))
WELDER_EMU_ATOMIC(atomicAdd, __nv_bfloat16, __hadd(old, v))
WELDER_EMU_ATOMIC(atomicAdd, __nv_bfloat162, __hadd2(old, v))
WELDER_EMU_ATOMIC(atomicSub, int, old - v)
WELDER_EMU_ATOMIC(atomicSub, unsigned int, old - v)
WELDER_EMU_ATOMIC(atomicExch, int, v)
WELDER_EMU_ATOMIC(atomicExch, unsigned int, v)
WELDER_EMU_ATOMIC(atomicExch, unsigned long long, v)
WELDER_EMU_ATOMIC(atomicExch, float, v)
WELDER_EMU_ATOMIC(atomicMax, int, old > v ? old : v)
WELDER_EMU_ATOMIC(atomicMax, unsigned int, old > v ? old : v)
WELDER_EMU_ATOMIC(atomicMax, long long, old > v ? old : v)
WELDER_EMU_ATOMIC(atomicMax, unsigned long long, old > v ? old : v)
WELDER_EMU_ATOMIC(atomicMin, int, old < v ? old : v)
WELDER_EMU_ATOMIC(atomicMin, unsigned int, old < v ? old : v)
WELDER_EMU_ATOMIC(atomicMin, long long, old < v ? old : v)
WELDER_EMU_ATOMIC(atomicMin, unsigned long long, old < v ? old : v)
WELDER_EMU_ATOMIC(atomicAnd, int, old & v)
WELDER_EMU_ATOMIC(atomicAnd, unsigned int, old & v)
WELDER_EMU_ATOMIC(atomicAnd, unsigned long long, old & v)
WELDER_EMU_ATOMIC(atomicOr, int, old | v)
WELDER_EMU_ATOMIC(atomicOr, unsigned int, old | v)
WELDER_EMU_ATOMIC(atomicOr, unsigned long long, old | v)
WELDER_EMU_ATOMIC(atomicXor, int, old ^ v)
WELDER_EMU_ATOMIC(atomicXor, unsigned int, old ^ v)
WELDER_EMU_ATOMIC(atomicXor, unsigned long long, old ^ v)
// atomicInc/atomicDec wrap at `v` like CUDA's.
WELDER_EMU_ATOMIC(atomicInc, unsigned int, old >= v ? 0u : old + 1u)
WELDER_EMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > v) ? v : old - 1u)
#undef WELDER_EMU_ATOMIC

#define WELDER_EMU_ATOMIC_CAS(T)                                                                      \
  inline T atomicCAS(T* p, T compare, T v) {                                                           \
    return welder_emu::detail::atomic_update(p, [&](T old) -> T { return old == compare ? v : old; }); \
  }                                                                                                    \
  inline T atomicCAS(const welder_emu::SharedPtr<T>& p, T compare, T v) {                              \
    return welder_emu::detail::atomic_update(p, [&](T old) -> T { return old == compare ? v : old; }); \
  }
WELDER_EMU_ATOMIC_CAS(int)
WELDER_EMU_ATOMIC_CAS(unsigned int)
WELDER_EMU_ATOMIC_CAS(unsigned long long)
WELDER_EMU_ATOMIC_CAS(unsigned short)
#undef WELDER_EMU_ATOMIC_CAS

// ------------------------------------------------------------------------------- misc
inline long long clock64() {
  static long long ticks = 0;
  return ticks += 1000;
}

[[noreturn]] inline void __trap() { welder_emu::detail::raise_error("the kernel executed __trap()"); }
[[noreturn]] inline void __brkpt() { welder_emu::detail::raise_error("the kernel executed __brkpt()"); }

// Device-side assert: a failure stops the launch with a message instead of aborting the process.
#undef assert
#ifdef NDEBUG
#define assert(expr) static_cast<void>(0)
#else
#define assert(expr) \
  (static_cast<bool>(expr) ? static_cast<void>(0) : ::welder_emu::detail::assertion_failed(#expr, __FILE__, __LINE__))
#endif
