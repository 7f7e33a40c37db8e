// Hopper bulk tensor copies (TMA) and mbarriers (codegen_templates/welder_tma.cuh) for the CPU
// emulator.  The state lives in the runtime (emu_runtime.cpp); emu_scheduler.h describes the model:
//  - an mbarrier counts the arrivals and transaction bytes its current phase still needs; the phase
//    completes when both reach zero.  An arrival beyond the expected count, a transaction count
//    below zero once the phase has all its arrivals (or when the block exits), use by another
//    thread before a __syncthreads made the init visible, and a block whose threads all wait for
//    phases that cannot complete are errors naming the mbarrier.
//  - a TMA load reads its box from global memory when issued (out-of-bounds elements are zeros) and
//    lands it in shared memory, in the swizzled layout of its tensor map, only when a thread waits on
//    its mbarrier: reading or writing the destination earlier, or a wgmma whose descriptor covers
//    it, is an error.  The landed bytes count as written by the async proxy and ordered by the
//    wait, so a wgmma may read them without fence.proxy.async.
//  - a TMA store writes its box to global memory when issued (clipped to the tensor, the innermost
//    axis in whole 16-byte units; a negative coordinate is an error, as on an H100), reading it from
//    shared memory in the layout a load of the box lands: each byte the block wrote there needs a
//    fence.proxy.async of its writer ordered before the issue (by being the issuing thread, a
//    __syncwarp or a barrier), and bytes of elements inside the tensor must have been written.  The
//    source stays in use until a cp.async.bulk.wait_group(.read) of the issuing thread covers the
//    store's bulk group: a write of it by any thread, or the issuing thread's exit, is an error.
//  - setmaxnreg checks its count (a multiple of 8 in [24, 256], at compile time) and that the whole
//    warpgroup executes it; registers are not modelled.
// The destination of a load and the source of a store are shared view positions of any element type
// (a void* under nvcc); an mbarrier is a position in a view of uint64_t.
#pragma once

#include <cstdint>

#include "emu_runtime.h"
#include "emu_shared.h"
#include "emu_tensor_map.h"

namespace welder_emu::detail {

template <class T>
inline SharedSpot spot_of(const SharedPtr<T>& p) {
  return SharedSpot{p.name(), p.view_offset(), p.count(), sizeof(T), p.index()};
}

template <int kRank, class T>
inline void tma_load_nd(const SharedPtr<T>& dst, const CUtensorMap* map, const SharedPtr<uint64_t>& bar,
                        const int (&coords)[kRank], const Site& site) {
  static constexpr const char* kNames[] = {
      "", "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"};
  tma_load(spot_of(dst), map, spot_of(bar), coords, kRank, kNames[kRank], site);
}

template <int kRank, class T>
inline void tma_store_nd(const CUtensorMap* map, const SharedPtr<T>& src, const int (&coords)[kRank],
                         const Site& site) {
  static constexpr const char* kNames[] = {"", "cp.async.bulk.tensor.1d.global.shared::cta.bulk_group",
                                           "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group",
                                           "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group",
                                           "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group",
                                           "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group"};
  tma_store(map, spot_of(src), coords, kRank, kNames[kRank], site);
}

inline void setmaxnreg(const char* primitive, const Site& site) {
  void* const* members = nullptr;
  warpgroup_meet(primitive, nullptr, &members, site);
}

}  // namespace welder_emu::detail

// ---------------------------------------------------------------------------------- mbarriers

inline void welder_mbarrier_init(const welder_emu::SharedPtr<uint64_t>& bar, unsigned arrivals,
                                 const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mbarrier_init(welder_emu::detail::spot_of(bar), arrivals, site);
}

inline void welder_mbarrier_init_fence() { welder_emu::detail::mbarrier_init_fence(); }

inline void welder_mbarrier_arrive(const welder_emu::SharedPtr<uint64_t>& bar,
                                   const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mbarrier_arrive(welder_emu::detail::spot_of(bar), false, 0, "mbarrier.arrive.shared::cta.b64",
                                      site);
}

inline void welder_mbarrier_arrive_expect_tx(const welder_emu::SharedPtr<uint64_t>& bar, unsigned bytes,
                                             const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mbarrier_arrive(welder_emu::detail::spot_of(bar), true, bytes,
                                      "mbarrier.arrive.expect_tx.shared::cta.b64", site);
}

inline void welder_mbarrier_wait(const welder_emu::SharedPtr<uint64_t>& bar, unsigned parity,
                                 const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mbarrier_wait(welder_emu::detail::spot_of(bar), parity, site);
}

// ---------------------------------------------------------------------------------- TMA loads

template <class T>
inline void welder_tma_load_1d(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                               const welder_emu::SharedPtr<uint64_t>& bar, int c0,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_nd<1>(dst, map, bar, {c0}, site);
}

template <class T>
inline void welder_tma_load_2d(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                               const welder_emu::SharedPtr<uint64_t>& bar, int c0, int c1,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_nd<2>(dst, map, bar, {c0, c1}, site);
}

template <class T>
inline void welder_tma_load_3d(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                               const welder_emu::SharedPtr<uint64_t>& bar, int c0, int c1, int c2,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_nd<3>(dst, map, bar, {c0, c1, c2}, site);
}

template <class T>
inline void welder_tma_load_4d(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                               const welder_emu::SharedPtr<uint64_t>& bar, int c0, int c1, int c2, int c3,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_nd<4>(dst, map, bar, {c0, c1, c2, c3}, site);
}

template <class T>
inline void welder_tma_load_5d(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                               const welder_emu::SharedPtr<uint64_t>& bar, int c0, int c1, int c2, int c3, int c4,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_nd<5>(dst, map, bar, {c0, c1, c2, c3, c4}, site);
}

inline void welder_tma_prefetch_map(const CUtensorMap* map, const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_prefetch(map, "prefetch.tensormap", site);
}

// ---------------------------------------------------------------------------------- TMA stores

template <class T>
inline void welder_tma_store_1d(const CUtensorMap* map, const welder_emu::SharedPtr<T>& src, int c0,
                                const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_store_nd<1>(map, src, {c0}, site);
}

template <class T>
inline void welder_tma_store_2d(const CUtensorMap* map, const welder_emu::SharedPtr<T>& src, int c0, int c1,
                                const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_store_nd<2>(map, src, {c0, c1}, site);
}

template <class T>
inline void welder_tma_store_3d(const CUtensorMap* map, const welder_emu::SharedPtr<T>& src, int c0, int c1, int c2,
                                const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_store_nd<3>(map, src, {c0, c1, c2}, site);
}

template <class T>
inline void welder_tma_store_4d(const CUtensorMap* map, const welder_emu::SharedPtr<T>& src, int c0, int c1, int c2,
                                int c3, const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_store_nd<4>(map, src, {c0, c1, c2, c3}, site);
}

template <class T>
inline void welder_tma_store_5d(const CUtensorMap* map, const welder_emu::SharedPtr<T>& src, int c0, int c1, int c2,
                                int c3, int c4, const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_store_nd<5>(map, src, {c0, c1, c2, c3, c4}, site);
}

inline void welder_tma_store_commit() { welder_emu::detail::tma_store_commit(); }

// Both waits cover the same groups here: a store writes global memory when issued, so a group has
// completed as soon as it has read its source.
template <int N>
inline void welder_tma_store_wait_read() {
  static_assert(N >= 0, "cp.async.bulk.wait_group.read takes a count of groups >= 0");
  welder_emu::detail::tma_store_wait(N);
}

template <int N>
inline void welder_tma_store_wait() {
  static_assert(N >= 0, "cp.async.bulk.wait_group takes a count of groups >= 0");
  welder_emu::detail::tma_store_wait(N);
}

// ---------------------------------------------------------------------------------- setmaxnreg

template <int N>
inline void welder_setmaxnreg_inc(const welder_emu::Site& site = welder_emu::Site::here()) {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
  welder_emu::detail::setmaxnreg("setmaxnreg.inc.sync.aligned.u32", site);
}

template <int N>
inline void welder_setmaxnreg_dec(const welder_emu::Site& site = welder_emu::Site::here()) {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
  welder_emu::detail::setmaxnreg("setmaxnreg.dec.sync.aligned.u32", site);
}
