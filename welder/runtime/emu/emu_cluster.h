// Hopper thread-block clusters (codegen_templates/welder_cluster.cuh) for the CPU emulator.  The
// state lives in the runtime (emu_runtime.cpp); emu_scheduler.h describes the model:
//  - the blocks of a cluster run together, their threads interleaved fibers, each block with its
//    own shared memory and mbarriers; clusters run one after another.  Cluster dims come from
//    WELDER_CLUSTER_DIMS, which registers them for the launch to find (emu_launch.cpp); a kernel
//    without them runs as clusters of one block, where every call below still works.
//  - welder_cluster_sync is a barrier over every thread of every block of the cluster (same call
//    site; a thread that exited or waits elsewhere is reported).  It also publishes mbarrier inits
//    to the peers: a remote arrival or multicast needs the target's init, a fence.mbarrier_init of
//    its thread and then a cluster barrier.
//  - a remote arrival or a multicast load into a block whose threads have all exited is an error
//    (kernels end with welder_cluster_sync); so is a block exiting with multicast loads still in
//    flight into it, as for its own loads.
#pragma once

#include <cstdint>

#include "emu_runtime.h"
#include "emu_shared.h"
#include "emu_tensor_map.h"
#include "emu_tma.h"

namespace welder_emu::detail {

template <int kRank, class T>
inline void tma_load_multicast_nd(const SharedPtr<T>& dst, const CUtensorMap* map, const SharedPtr<uint64_t>& bar,
                                  unsigned short mask, const int (&coords)[kRank], const Site& site) {
  static constexpr const char* kNames[] = {
      "",
      "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster",
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster",
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster",
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster",
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"};
  tma_load_multicast(spot_of(dst), map, spot_of(bar), mask, coords, kRank, kNames[kRank], site);
}

}  // namespace welder_emu::detail

// After a kernel's definition, with the dims of its __cluster_dims__ (x, then optionally y and z,
// which a launch refuses unless 1): a static registration by the kernel's address.  The extra
// macro level expands __COUNTER__ before ## pastes it into a name unique in the source.
#define WELDER_CLUSTER_DIMS(kernel, ...) WELDER_EMU_CLUSTER_DIMS_AT(__COUNTER__, kernel, __VA_ARGS__)
#define WELDER_EMU_CLUSTER_DIMS_AT(n, kernel, ...) WELDER_EMU_CLUSTER_DIMS_NAMED(n, kernel, __VA_ARGS__)
#define WELDER_EMU_CLUSTER_DIMS_NAMED(n, kernel, ...)              \
  [[maybe_unused]] static const bool welder_emu_cluster_dims_##n = \
      ::welder_emu::detail::register_cluster_dims(reinterpret_cast<const void*>(&kernel), __VA_ARGS__);

// ---------------------------------------------------------------------------------- the cluster

inline unsigned welder_cluster_ctarank() { return welder_emu::detail::cluster_ctarank(); }

inline void welder_cluster_sync(const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::cluster_barrier("welder_cluster_sync", site);
}

inline void welder_mbarrier_arrive_cluster(const welder_emu::SharedPtr<uint64_t>& bar, unsigned cta,
                                           const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mbarrier_arrive_cluster(welder_emu::detail::spot_of(bar), cta,
                                              "mbarrier.arrive.release.cluster.shared::cluster.b64", site);
}

// ---------------------------------------------------------------------------------- multicast loads

template <class T>
inline void welder_tma_load_1d_multicast(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                                         const welder_emu::SharedPtr<uint64_t>& bar, unsigned short mask, int c0,
                                         const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_multicast_nd<1>(dst, map, bar, mask, {c0}, site);
}

template <class T>
inline void welder_tma_load_2d_multicast(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                                         const welder_emu::SharedPtr<uint64_t>& bar, unsigned short mask, int c0,
                                         int c1, const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_multicast_nd<2>(dst, map, bar, mask, {c0, c1}, site);
}

template <class T>
inline void welder_tma_load_3d_multicast(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                                         const welder_emu::SharedPtr<uint64_t>& bar, unsigned short mask, int c0,
                                         int c1, int c2, const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_multicast_nd<3>(dst, map, bar, mask, {c0, c1, c2}, site);
}

template <class T>
inline void welder_tma_load_4d_multicast(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                                         const welder_emu::SharedPtr<uint64_t>& bar, unsigned short mask, int c0,
                                         int c1, int c2, int c3,
                                         const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_multicast_nd<4>(dst, map, bar, mask, {c0, c1, c2, c3}, site);
}

template <class T>
inline void welder_tma_load_5d_multicast(const welder_emu::SharedPtr<T>& dst, const CUtensorMap* map,
                                         const welder_emu::SharedPtr<uint64_t>& bar, unsigned short mask, int c0,
                                         int c1, int c2, int c3, int c4,
                                         const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::tma_load_multicast_nd<5>(dst, map, bar, mask, {c0, c1, c2, c3, c4}, site);
}
