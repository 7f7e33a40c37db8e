// Internal to the emulator runtime (emu_runtime.cpp, emu_launch.cpp): the state of a launch, one
// LaunchState per block of a cluster.
//
// Execution model.  Clusters of blocks run one after another on the calling OS thread; without
// cluster dims (WELDER_CLUSTER_DIMS) a cluster is one block.  Each block of a cluster has its own
// LaunchState -- threads, shared memory, mbarriers, TMA copies in flight, warpgroups, barrier epochs,
// shadow state -- and g_launch points at the block of the fiber being resumed.  The threads of a
// block are fibers; the scheduler resumes every runnable fiber of each block in turn (rank order,
// thread order) until it blocks (at a barrier, a warp collective, an mbarrier or the cluster
// barrier) or exits.  When no fiber of the cluster can run, the scheduler settles, block by block,
// what the fibers wait for, in this order:
//   1. warp collectives whose whole mask has arrived at the same call site complete;
//   2. __activemask() calls complete, each with the set of lanes waiting at that call site;
//   3. mbarrier waits whose phase completed return;
//   4. a block barrier completes when every live thread waits at the same __syncthreads site;
// (a warpgroup meeting -- the wgmma instructions -- is settled right after the warp collectives:
// it completes when all 128 threads of the warpgroup wait at the same call site)
// and if no block moved, the cluster barrier (welder_cluster_sync) completes when every thread of
// every block waits at the same call site.  Anything else would hang the GPU; it is reported as an
// error that says which threads of which blocks are where.  The first error stops the launch: the
// failing fiber switches back to the scheduler and is never resumed.
//
// Race model.  Every byte of dynamic shared memory has shadow state: the last write and up to two
// reads, each stamped with the barrier epoch and a per-warp vector clock.  Two accesses by
// different threads conflict unless a __syncthreads or cluster barrier (new epoch) or a __syncwarp
// naming both threads (vector clock) lies between them; a conflicting pair that includes a write is
// an error.  Blocks reach each other's shared memory only through mbarrier arrivals and multicast
// TMA loads, so shadow state stays per block.
//
// cp.async.  Each thread keeps its own queue of copies.  A copy reads its source when issued and is
// checked (and recorded in the shadow state) as a write of its destination then; it lands in shared
// memory, recorded as a write again, only when a cp.async.wait_group of the issuing thread covers
// its group, or when that thread exits (the hardware completes copies in flight).  Until then its
// destination bytes are marked pending: any access of them, by any thread, is an error, as is a
// second copy into them.
//
// mbarriers and TMA (emu_tma.h).  An mbarrier lives in a side table keyed by its byte offset (its 8
// bytes are marked as an mbarrier object: a plain access of them is an error): the expected
// arrival count, the arrivals and transaction bytes still pending in the current phase, and the
// number of completed phases.  A TMA load reads its box from global memory when issued and is
// queued on its mbarrier; it lands in shared memory (swizzled, recorded as a write by the copy
// engine, kCopyEngine, which the wait orders before every later access) only when some thread waits
// on that mbarrier, or when every thread is blocked and one of them waits on it.  Until then its
// destination bytes are marked pending, like a cp.async's.  A wait suspends the fiber
// (WaitKind::kMbarrier) until the phase of its parity completed.  A phase's transaction count may
// drop below zero while arrivals are pending (a peer's multicast can land before this block's
// expect_tx); with all arrivals in, or once the block's threads have all exited, below zero is an
// error.
//
// Clusters.  A remote arrival or a multicast load acts on the mbarriers, TMA queue and pending
// bytes of each target block.  A target mbarrier must have been published to the cluster: a
// fence.mbarrier_init of its initialising thread, then a completed cluster barrier (ClusterState's
// epoch counts them; each thread records the epoch at each of its fences).  A block whose threads
// have all exited (LaunchState::live == 0) may no longer be a target.
//
// wgmma (emu_wgmma.h).  Per warpgroup, a queue of operations issued, committed groups, and whether a
// wgmma.fence came since the last wait.  The 16-byte units an operation reads are counted in
// wgmma_in_use until the wait that covers it; a write of them is an error.  Each thread records
// the epoch (and its own vector-clock entry) of every fence.proxy.async it executes, and each byte's
// shadow records how many the writer had executed before the write, so a wgmma (or a bulk store)
// can tell whether a proxy fence and then a barrier (or __syncwarp) lie between the write and the
// read.
//
// Bulk tensor stores (emu_tma.h).  A store reads its box from shared memory and writes it to global
// memory (clipped to the tensor) when issued.  Every byte it reads must be ordered before the issue
// for the async proxy: landed by the copy engine, or written by a thread that then executed
// fence.proxy.async, that fence ordered before the issue (the same thread, a __syncwarp naming both
// -- each fence records the thread's own vector-clock entry -- or a barrier); bytes of elements
// inside the tensor must have been written by the block at all.  The store is then queued on its
// thread with the thread's open bulk group, and the 16-byte units it read are counted in
// store_in_use until a cp.async.bulk.wait_group(.read) of that thread covers the group: a write of
// them by any thread is an error, and the wait records the read in the shadow state as the issuing
// thread's, so that other threads need a __syncwarp or barrier after the wait before writing.  A
// thread that exits with stores not covered by a wait is an error.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "emu_fiber.h"
#include "emu_runtime.h"
#include "emu_types.h"

namespace welder_emu::detail {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

enum class WaitKind : uint8_t {
  kRunnable,
  kBarrier,
  kWarpCollective,
  kWarpgroup,
  kActiveMask,
  kMbarrier,
  kClusterBarrier,
  kExited
};

// What marks a byte of the dynamic buffer in LaunchState::pending.
enum PendingKind : uint8_t { kNotPending = 0, kPendingCpAsync = 1, kPendingTma = 2, kMbarrierObject = 3 };

// One cp.async in flight: where it goes, what it writes (source bytes then zeros), where it came from.
struct AsyncCopy {
  size_t offset;  // byte offset in the dynamic buffer
  uint32_t group;
  uint32_t nbytes;
  unsigned char data[16];
  const char* view;  // for the shadow state's messages
  size_t view_offset;
  size_t elem_size;
  const char* primitive;
  Site site;
};

// One fence.proxy.async: the block's epoch and the thread's own vector-clock entry when it ran, which
// tell whether a barrier or a __syncwarp has ordered it before another thread's later operation.
struct ProxyFence {
  uint32_t epoch;
  uint32_t stamp;
};

// One bulk tensor store whose shared source a wait has not covered yet: the box's bytes in the
// dynamic buffer, its bulk group, and where it came from (for messages, and for the read the wait
// records in the shadow state).
struct BulkStore {
  size_t begin;  // byte offset in the dynamic buffer
  size_t nbytes;
  uint32_t group;
  const char* view;
  size_t view_offset;
  size_t elem_size;
  long long index;
  const char* primitive;
  Site site;
};

struct ThreadState {
  Context context;
  uint3 index{0, 0, 0};
  unsigned linear = 0, lane = 0, warp = 0;
  WaitKind wait = WaitKind::kRunnable;
  // Where the thread waits, and in which primitive (for messages and for matching call sites).
  Site site{"", 0};
  const char* primitive = "";
  // Block barrier operands.
  int predicate = 0;
  int barrier_count = 0;
  // Warp collective operands and result.
  WarpOp op = WarpOp::kRendezvous;
  unsigned mask = 0;
  uint64_t value = 0;
  int param = 0;
  int width = 32;
  uint64_t result = 0;
  WarpCombine combine = nullptr;  // for WarpOp::kCombine
  // Vector clock over the lanes of this thread's warp; advanced by __syncwarp.
  uint32_t clock[kWarpSize] = {};
  // cp.async copies not yet performed, oldest first from copies_head, and the number of groups
  // this thread has committed (the open group's number).
  std::vector<AsyncCopy> copies;
  size_t copies_head = 0;
  uint32_t groups_committed = 0;
  // Each fence.proxy.async this thread executed, in order.
  std::vector<ProxyFence> proxy_fences;
  // Bulk tensor stores whose source no wait has covered yet, oldest first, and the number of bulk
  // groups this thread has committed (the open group's number).
  std::vector<BulkStore> stores;
  uint32_t bulk_groups_committed = 0;
  // The cluster epoch at each fence.mbarrier_init this thread executed, in order; and, while
  // waiting at an mbarrier, its byte offset.
  std::vector<uint32_t> mbarrier_init_fences;
  size_t wait_barrier = 0;
};

// One mbarrier of the block (see the model above).
struct Mbarrier {
  size_t offset;  // byte offset in the dynamic buffer
  const char* view;
  long long index;
  unsigned expected;  // arrivals per phase
  unsigned pending;   // arrivals the current phase still needs
  long long tx;       // transaction bytes the current phase still needs (expected minus completed)
  uint64_t phase;     // phases completed
  Site init_site;
  unsigned init_thread;
  uint32_t init_epoch;
  uint32_t init_fences;  // how many fence.mbarrier_init the initialising thread had executed before
};

// One TMA load in flight into this block: the box as read from global memory (row-major, innermost
// first), where it goes, the mbarrier it completes on, and who issued it (a multicast load from a
// peer block is queued in every destination block).
struct TmaCopy {
  size_t dst;  // byte offset of the box in the dynamic buffer
  size_t barrier;
  uint32_t swizzle;
  std::vector<unsigned char> data;
  const char* view;
  long long index;
  const char* primitive;
  Site site;
  unsigned issuer;       // thread
  unsigned issuer_rank;  // its block's rank in the cluster
};

// One access in the shadow state; epoch 0 means "none".
struct Access {
  uint32_t epoch;
  uint32_t stamp;
  uint16_t thread;
};

// Access::thread of a write by the copy engine (a landed TMA load): the mbarrier wait that landed it
// orders it before every later access, and the async proxy needs no fence to read it.
constexpr uint16_t kCopyEngine = 0xFFFF;

struct ByteShadow {
  Access write;
  Access read[2];
  uint32_t write_fences;  // how many fence.proxy.async the writer had executed before the write
};

// A warpgroup's meeting point (warpgroup_meet) and wgmma state.
struct WarpgroupState {
  void* members[kWarpgroupSize] = {};
  uint64_t generation = 0;  // meetings completed
  uint64_t claimed = 0;     // meetings whose first member has resumed
  WgmmaQueue queue;
};

struct ClusterState;

// One block's view of the launch: the launch's configuration and the state of the block that runs
// as cluster rank `rank` (one per rank, reused by each cluster in turn).
struct LaunchState {
  dim3 grid, block;
  size_t smem_bytes = 0;
  unsigned nthreads = 0;
  bool check_races = true;

  KernelInvoker invoke = nullptr;
  void* invoke_context = nullptr;

  std::vector<ThreadState> threads;
  StackPool stacks;
  std::vector<unsigned char> smem_storage;
  unsigned char* smem = nullptr;  // 128-byte aligned start of the dynamic buffer
  std::vector<ByteShadow> shadow;
  // Per byte of the dynamic buffer, with race checks on: a PendingKind (a cp.async or TMA will
  // still write it, or it holds an mbarrier); pending_bytes counts the marked ones, so that
  // accesses need not look while there are none.
  std::vector<uint8_t> pending;
  size_t pending_bytes = 0;
  // Per 16-byte unit of the dynamic buffer: how many wgmma in flight read it (race checks on).
  std::vector<uint16_t> wgmma_in_use;
  size_t wgmma_in_use_units = 0;
  // Per 16-byte unit of the dynamic buffer: how many bulk stores in flight read it (race checks on).
  std::vector<uint16_t> store_in_use;
  size_t store_in_use_units = 0;
  std::vector<WarpgroupState> warpgroups;  // nthreads / 128 of them (none for a partial one)
  std::map<size_t, Mbarrier> mbarriers;      // by byte offset, this block's
  std::vector<TmaCopy> tma_copies;           // in flight, in issue order
  uint32_t block_epoch = 0;                // the epoch the current block started in

  ClusterState* cluster = nullptr;
  unsigned rank = 0;  // %cluster_ctarank
  unsigned live = 0;  // threads of the current block that have not exited

  uint3 block_index{0, 0, 0};
  uint32_t epoch = 0;  // advanced at every completed barrier and at every block start
  Site last_barrier{"", 0};
  bool barrier_seen = false;  // whether last_barrier refers to this block

  ThreadState* current = nullptr;
  Context scheduler;
  bool failed = false;
  std::string message;
};

// A guarded pointer argument of the launch (emu_launch.cpp): the kernel's copy, which a tensor map
// over it points into.
struct ArgumentBuffer {
  uintptr_t begin;
  size_t bytes;
  unsigned index;
  std::string type;  // "const float16*"
  bool readonly;     // the caller's buffer must come back unchanged
};

// The blocks of the cluster in progress (all of them for cluster dims X, one without).
struct ClusterState {
  std::vector<std::unique_ptr<LaunchState>> ctas;  // by rank
  uint32_t epoch = 0;                              // cluster barriers completed
  std::vector<ArgumentBuffer> arguments;           // of the whole launch
  std::string message;                             // the first error
};

// The block whose fiber runs (or ran last); launches are serialised (emu_launch.cpp).
inline LaunchState* g_launch = nullptr;

std::string describe_block(const uint3& block);
std::string describe_thread(const ThreadState& t);

// Sizes one block's threads, stacks, shared memory and shadow state; "" or the reason it failed.
std::string prepare_launch(LaunchState& launch, size_t stack_bytes);

// Runs every cluster of blocks, x fastest; false with cluster.message set on the first error.
bool run_grid(ClusterState& cluster);

}  // namespace welder_emu::detail
