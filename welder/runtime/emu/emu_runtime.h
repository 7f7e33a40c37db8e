// What kernel code needs from the CPU emulator's runtime: call sites, error reporting, and the
// blocking primitives (barriers, warp collectives) and checked shared-memory access that the
// intrinsics in emu_device.h, emu_shared.h, emu_wmma.h and emu_mma.h are built on.
//
// The runtime itself -- fibers, the block scheduler, the shadow state -- lives in
// emu_runtime.cpp (see emu_scheduler.h for its model), compiled once and linked into every module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "emu_tensor_map.h"
#include "emu_types.h"

namespace welder_emu {

// A source location, captured at the call site through default arguments.
struct Site {
  const char* file;
  int line;
  static constexpr Site here(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return Site{file, line};
  }
};

inline bool operator==(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}
inline bool operator!=(const Site& a, const Site& b) { return !(a == b); }

namespace detail {

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string describe(const Site& site);  // "file:line"

// Reports an error from inside a kernel and abandons the launch: control returns to the
// scheduler and the calling fiber is never resumed.
[[noreturn]] void raise_error(const std::string& what);

enum class AccessKind { kRead, kWrite, kAtomic };

// Validates an access of `nbytes` at element `index` of a shared view (named `view`, starting at
// byte `view_offset` of the dynamic buffer, `count` elements of `elem_size` bytes) and returns its
// address.  Bounds are checked against the view and the dynamic size given at launch; reads and
// writes also go through the race check, atomics do not.
unsigned char* shared_access(const char* view, size_t view_offset, long long count, size_t elem_size, long long index,
                             size_t nbytes, AccessKind kind);

enum class WarpOp : uint8_t {
  kShfl,
  kShflUp,
  kShflDown,
  kShflXor,
  kBallot,      // also __any_sync / __all_sync, which reduce the ballot
  kSyncwarp,    // also orders shared-memory accesses between the lanes, for the race check
  kReduce,      // __reduce_*_sync; `param` is a ReduceOp
  kRendezvous,  // wmma operations: meet, then each lane does its own work
  kCombine,     // mma.sync, ldmatrix: one function computes every lane's result from all lanes' operands
};

enum class ReduceOp : int { kAdd, kMinSigned, kMaxSigned, kMinUnsigned, kMaxUnsigned, kAnd, kOr, kXor };

// Waits at a __syncthreads-style barrier; returns how many threads passed a nonzero predicate.
int block_barrier(const char* primitive, int predicate, const Site& site);

// Waits until every lane of `mask` reaches the same collective at `site`; returns this lane's
// result (shuffled value, ballot, reduction) as raw bits.
uint64_t warp_collective(const char* primitive, WarpOp op, unsigned mask, uint64_t value, int param, int width,
                         const Site& site);

// Meets every lane of the warp (which must be complete) at a warp-wide operation such as wmma.
void warp_rendezvous(const char* primitive, const Site& site);

// A warp-wide operation whose results depend on the operands of every lane (mma.sync, ldmatrix).
// Once all 32 lanes wait at the same `site`, `combine` runs once, in the scheduler, with lane l's
// `data` at lanes[l]; it reads the operands and writes each lane's results there, while every lane
// is suspended.  It cannot report errors: the lanes check their own operands before arriving.
using WarpCombine = void (*)(void* const* lanes);
void warp_combine(const char* primitive, WarpCombine combine, void* data, const Site& site);

// cp.async, per thread (see emu_scheduler.h): records a copy of `nbytes` (4, 8 or 16) into the
// shared view (as in shared_access) at element `index`, of which the first `src_bytes` come from
// `src` (read now) and the rest are zeros.  The copy lands in shared memory when a wait covers its
// group.  Checks the sizes, the alignment of both addresses, the view's bounds, overlap with copies
// still pending, and races of the destination like a write.
void cp_async_issue(const char* view, size_t view_offset, long long count, size_t elem_size, long long index,
                    const void* src, unsigned nbytes, unsigned src_bytes, const char* primitive, const Site& site);
// cp.async.commit_group: closes the calling thread's open group (possibly empty).
void cp_async_commit();
// cp.async.wait_group n: performs the calling thread's copies of every committed group but the
// `pending` most recent ones, in issue order; copies not committed yet stay pending.
void cp_async_wait(int pending);

// ---------------------------------------------------------------------------- warpgroups (wgmma)

constexpr unsigned kWarpgroupSize = 128;
// The shared-window address (what __cvta_generic_to_shared gives) of byte 0 of the dynamic buffer.
// 1024-aligned, as on the GPU, so that swizzle patterns keyed on absolute address bits line up
// with offsets in the buffer.
constexpr unsigned kSharedWindowBase = 1024;

// Meets all 128 threads of the caller's warpgroup (warps 4i..4i+3) at `site`; the block must consist
// of whole warpgroups.  Returns true in exactly one member, the first to resume, which may read
// every member's `data` through `*members` (indexed by thread within the warpgroup) while the other
// members have not resumed yet; they get false.
bool warpgroup_meet(const char* primitive, void* data, void* const** members, const Site& site);
unsigned current_warpgroup();

// One wgmma.mma_async in flight: its result, computed at issue, is written into every member's
// accumulator array when a wgmma.wait_group covers its group.
struct WgmmaOp {
  const char* primitive;
  Site site;
  int n;                           // D is 64 x n
  std::vector<float> d;            // row-major
  float* dest[kWarpgroupSize];     // each member's accumulator array (n / 2 floats)
  std::vector<uint32_t> chunks;    // 16-byte units of the dynamic buffer it reads (offset / 16)
};

// A warpgroup's wgmma state: operations issued since the last commit, committed groups (oldest
// first), and whether a wgmma.fence came since the last wait.
struct WgmmaQueue {
  std::vector<WgmmaOp> open;
  std::deque<std::vector<WgmmaOp>> committed;
  bool fenced = false;
};
WgmmaQueue& wgmma_queue(unsigned warpgroup);

// Checks that the calling thread's wgmma may read the 16-byte units `chunks` (offset / 16 in the
// dynamic buffer): no cp.async in flight into them, and, with race checks on, every byte last
// written before a barrier that precedes this call, with a fence.proxy.async of the writing thread
// between the write and such a barrier.
void wgmma_check_reads(const std::vector<uint32_t>& chunks, const char* primitive, const Site& site);
// Queues `op` in the warpgroup's open group and marks its chunks in use.
void wgmma_issue(unsigned warpgroup, WgmmaOp&& op);
// wgmma.commit_group; wgmma.wait_group `pending` (writes the results of every group but the
// `pending` most recent into the members' accumulators and releases their chunks).
void wgmma_commit(unsigned warpgroup);
void wgmma_wait(unsigned warpgroup, int pending);
// fence.proxy.async.shared::cta by the calling thread.
void fence_proxy_async();

// ---------------------------------------------------------------------------- mbarriers and TMA

// Where a shared-view position points (a SharedPtr's parts): for checked accesses by the runtime.
struct SharedSpot {
  const char* view;
  size_t view_offset;
  long long count;
  size_t elem_size;
  long long index;
};

// mbarrier.init / fence.mbarrier_init / arrive (with expect_tx when `expect_tx`) /
// try_wait.parity in a loop (suspends until the phase of `parity` completed); see emu_scheduler.h.
void mbarrier_init(const SharedSpot& bar, unsigned arrivals, const Site& site);
void mbarrier_init_fence();
void mbarrier_arrive(const SharedSpot& bar, bool expect_tx, unsigned tx_bytes, const char* primitive,
                     const Site& site);
void mbarrier_wait(const SharedSpot& bar, unsigned parity, const Site& site);
// cp.async.bulk.tensor.Nd tile-mode load of the box at `coords` (rank of them) of `map` into the
// shared view position `dst`, completing its bytes on the mbarrier `bar`.
void tma_load(const SharedSpot& dst, const CUtensorMap* map, const SharedSpot& bar, const int* coords, int rank,
              const char* primitive, const Site& site);
// prefetch.tensormap: only checks that `map` was encoded.
void tma_prefetch(const CUtensorMap* map, const char* primitive, const Site& site);
// cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group: writes the box at `coords` (rank of them) of
// `map` to global memory, clipped to the tensor, from the shared view position `src`, where it lies
// as a load of the box would land it; now, after checking that the async proxy may read the source.
// The source stays in use, in the calling thread's open bulk group, until a wait covers that group.
void tma_store(const CUtensorMap* map, const SharedSpot& src, const int* coords, int rank, const char* primitive,
               const Site& site);
// cp.async.bulk.commit_group: closes the calling thread's open bulk group (possibly empty).
void tma_store_commit();
// cp.async.bulk.wait_group(.read) n: every bulk group of the calling thread but the `pending` most
// recent committed ones has finished reading its sources (and writing global memory, which a store
// does when issued here), so they may be written again.
void tma_store_wait(int pending);

// ---------------------------------------------------------------------------- clusters

// %cluster_ctarank: the calling thread's block's rank in its cluster (0 without cluster dims).
unsigned cluster_ctarank();
// barrier.cluster.arrive.release + barrier.cluster.wait.acquire: waits until every thread of every
// block of the cluster waits at the same call site.
void cluster_barrier(const char* primitive, const Site& site);
// mbarrier.arrive.release.cluster.shared::cluster on the mbarrier at `bar`'s offset in the block of
// rank `cta` (which may be the caller's own).
void mbarrier_arrive_cluster(const SharedSpot& bar, unsigned cta, const char* primitive, const Site& site);
// tma_load with .multicast::cluster: the box lands at `dst`'s offset in every block whose rank bit is
// set in `mask`, completing its bytes on the mbarrier at `bar`'s offset there.
void tma_load_multicast(const SharedSpot& dst, const CUtensorMap* map, const SharedSpot& bar, unsigned mask,
                        const int* coords, int rank, const char* primitive, const Site& site);

// __activemask(): the lanes of this warp that wait at the same call site when the block stalls.
unsigned active_mask(const Site& site);

// What each fiber runs: the kernel applied to a copy of the launch's arguments.
using KernelInvoker = void (*)(void* context);

unsigned current_lane();
unsigned block_thread_count();
unsigned current_warp_lanes();  // mask of the lanes of the caller's warp that exist
unsigned char* dynamic_smem_base();
size_t dynamic_smem_bytes();

}  // namespace detail
}  // namespace welder_emu
