// The emulator's block scheduler: fibers, barriers, warp collectives, the shared-memory shadow
// state, and error reporting.  The model is described in emu_scheduler.h.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "emu_scheduler.h"

namespace welder_emu::detail {

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&out[0], out.size() + 1, fmt, args);
  va_end(args);
  return out;
}

std::string describe(const Site& site) { return format("%s:%d", site.file, site.line); }

std::string describe_block(const uint3& b) { return format("block (%u,%u,%u)", b.x, b.y, b.z); }

std::string describe_thread(const ThreadState& t) {
  return format("thread %u (%u,%u,%u)", t.linear, t.index.x, t.index.y, t.index.z);
}

namespace {

// "threads 0-15, 17" (or "lanes ..."); `ids` ascending.
std::string describe_ids(const char* singular, const char* plural, const std::vector<unsigned>& ids) {
  std::string out = ids.size() == 1 ? singular : plural;
  out += ' ';
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (i > 0) out += ", ";
    out += j == i ? format("%u", ids[i]) : format("%u-%u", ids[i], ids[j]);
    i = j + 1;
  }
  return out;
}

std::string describe_threads(const std::vector<unsigned>& ids) { return describe_ids("thread", "threads", ids); }
std::string describe_lanes(const std::vector<unsigned>& ids) { return describe_ids("lane", "lanes", ids); }

std::vector<unsigned> lanes_of(unsigned mask) {
  std::vector<unsigned> lanes;
  for (unsigned l = 0; l < kWarpSize; ++l)
    if (mask & (1u << l)) lanes.push_back(l);
  return lanes;
}

unsigned existing_lanes(const LaunchState& launch, unsigned warp) {
  const unsigned present = launch.nthreads - warp * kWarpSize;
  return present >= kWarpSize ? kFullMask : ((1u << present) - 1u);
}

// Records an error found by the scheduler itself (no fiber is running).
void scheduler_error(LaunchState& launch, const std::string& what) {
  launch.failed = true;
  launch.message = describe_block(launch.block_index) + ": " + what;
}

ThreadState& current_thread(const char* primitive) {
  LaunchState* launch = g_launch;
  if (launch == nullptr || launch->current == nullptr) {
    std::fprintf(stderr, "welder_emu: %s called outside an emulated kernel\n", primitive);
    std::abort();
  }
  return *launch->current;
}

// Hands control to the scheduler until it makes this thread runnable again.
void suspend(ThreadState& t) { context_switch(t.context, g_launch->scheduler); }

}  // namespace

[[noreturn]] void raise_error(const std::string& what) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread("raise_error");
  launch.failed = true;
  launch.message = describe_block(launch.block_index) + ", " + describe_thread(t) + ": " + what;
  context_switch(t.context, launch.scheduler);
  __builtin_unreachable();  // a failed launch never resumes its fibers
}

// ============================================================================ shadow state

namespace {

std::string since_last_barrier(const LaunchState& launch) {
  return launch.barrier_seen ? "since the barrier at " + describe(launch.last_barrier)
                             : std::string("since the block started");
}

// Whether access `a` is ordered before the current access of thread `t`.
bool ordered_before(const Access& a, const ThreadState& t, uint32_t epoch) {
  if (a.epoch != epoch) return true;  // none, or a barrier lies between
  if (a.thread == t.linear || a.thread == kCopyEngine) return true;
  return a.thread / kWarpSize == t.warp && t.clock[a.thread % kWarpSize] >= a.stamp;
}

// Where an access of the shared view happened, for messages.
struct ViewSpot {
  const char* view;
  size_t view_begin;
  size_t elem_size;
};

[[noreturn]] void report_race(const LaunchState& launch, const ViewSpot& spot, size_t byte, const ThreadState& t,
                              bool is_write, const Access& other, bool other_wrote) {
  const ThreadState& o = launch.threads[other.thread];
  const auto index = static_cast<long long>((byte - spot.view_begin) / spot.elem_size);
  raise_error(format("data race on shared view '%s' index %lld: %s %s it, but %s %s it with no barrier in between (%s)",
                     spot.view, index, describe_thread(t).c_str(), is_write ? "writes" : "reads",
                     describe_thread(o).c_str(), other_wrote ? "wrote" : "read", since_last_barrier(launch).c_str()));
}

// Checks and records an access of bytes [begin, begin + n) of the dynamic buffer.
void shadow_access(LaunchState& launch, ThreadState& t, size_t begin, size_t n, bool is_write, const ViewSpot& spot) {
  const uint32_t epoch = launch.epoch;
  const Access me{epoch, t.clock[t.lane], static_cast<uint16_t>(t.linear)};
  ByteShadow* const shadow = launch.shadow.data();
  for (size_t b = begin; b < begin + n; ++b) {
    ByteShadow& s = shadow[b];
    if (!ordered_before(s.write, t, epoch)) report_race(launch, spot, b, t, is_write, s.write, true);
    if (is_write) {
      for (const Access& r : s.read)
        if (!ordered_before(r, t, epoch)) report_race(launch, spot, b, t, true, r, false);
      s.write = me;
      s.write_fences = static_cast<uint32_t>(t.proxy_fences.size());
      s.read[0].epoch = s.read[1].epoch = 0;
      continue;
    }
    // Keep up to two readers that no later access is ordered after.  A reader ordered before this
    // one can be dropped: whatever races with it also races with this access.
    if (s.read[0].epoch == epoch && s.read[0].thread == me.thread) {
      s.read[0] = me;
    } else if (s.read[1].epoch == epoch && s.read[1].thread == me.thread) {
      s.read[1] = me;
    } else if (ordered_before(s.read[0], t, epoch)) {
      s.read[0] = me;
    } else if (ordered_before(s.read[1], t, epoch)) {
      s.read[1] = me;
    }
  }
}

}  // namespace

namespace {

// Validates that `nbytes` at element `index` of a shared view lie in the view and in the dynamic
// size given at launch; returns their byte offset in the dynamic buffer.
size_t checked_shared_offset(const LaunchState& launch, const char* view, size_t view_offset, long long count,
                             size_t elem_size, long long index, size_t nbytes) {
  const long long view_bytes = count * static_cast<long long>(elem_size);
  const long long first = index * static_cast<long long>(elem_size);
  if (index < 0 || index >= count || first + static_cast<long long>(nbytes) > view_bytes) {
    if (nbytes == elem_size)
      raise_error(format("shared view '%s' index %lld is out of bounds (count %lld)", view, index, count));
    raise_error(format("a %zu-byte access at index %lld of shared view '%s' is out of bounds (count %lld, %zu-byte "
                       "elements)",
                       nbytes, index, view, count, elem_size));
  }
  const size_t begin = view_offset + static_cast<size_t>(first);
  if (begin + nbytes > launch.smem_bytes)
    raise_error(format("shared view '%s' index %lld lies at byte %zu, beyond the %zu bytes of dynamic shared memory "
                       "given at launch",
                       view, index, begin, launch.smem_bytes));
  return begin;
}

// The copy still in flight that will write byte `b` of the dynamic buffer, and its thread.
std::pair<const ThreadState*, const AsyncCopy*> pending_copy_at(const LaunchState& launch, size_t b) {
  for (const ThreadState& t : launch.threads)
    for (size_t i = t.copies_head; i < t.copies.size(); ++i) {
      const AsyncCopy& c = t.copies[i];
      if (c.offset <= b && b < c.offset + c.nbytes) return {&t, &c};
    }
  return {nullptr, nullptr};
}

// The first byte of [begin, begin + n) that a pending cp.async will write, or n.
size_t first_pending(const LaunchState& launch, size_t begin, size_t n) {
  if (launch.pending_bytes == 0) return n;
  for (size_t i = 0; i < n; ++i)
    if (launch.pending[begin + i]) return i;
  return n;
}

// "mbarrier 'full' index 1 (byte 8)"
std::string describe_mbarrier(const Mbarrier& m) {
  return format("mbarrier '%s' index %lld (byte %zu)", m.view, m.index, m.offset);
}

// The TMA load in flight whose destination holds byte `b`, or null.
const TmaCopy* pending_tma_at(const LaunchState& launch, size_t b) {
  for (const TmaCopy& c : launch.tma_copies)
    if (c.dst <= b && b < c.dst + c.data.size()) return &c;
  return nullptr;
}

// The mbarrier whose 8 bytes include byte `b`, or null.
const Mbarrier* mbarrier_at(const LaunchState& launch, size_t b) {
  auto it = launch.mbarriers.upper_bound(b);
  if (it == launch.mbarriers.begin()) return nullptr;
  --it;
  return b < it->first + 8 ? &it->second : nullptr;
}

// "block (1,0,0) (cluster rank 1)"
std::string describe_cta(const LaunchState& cta) {
  return format("%s (cluster rank %u)", describe_block(cta.block_index).c_str(), cta.rank);
}

// The thread that issued a TMA load in flight into `launch`: "thread 0 (0,0,0)", with its block
// when that is a peer (a multicast load).
std::string describe_issuer(const LaunchState& launch, const TmaCopy& c) {
  const LaunchState& issuer = *launch.cluster->ctas[c.issuer_rank];
  const std::string thread = describe_thread(issuer.threads[c.issuer]);
  return &issuer == &launch ? thread : thread + " of " + describe_block(issuer.block_index);
}

// "the cp.async.bulk.tensor.2d... at kernel.cu:12 that thread 0 (0,0,0) issued, completing on mbarrier ..."
std::string describe_tma(const LaunchState& launch, const TmaCopy& c) {
  auto it = launch.mbarriers.find(c.barrier);
  return format("the %s at %s that %s issued, completing on %s", c.primitive, describe(c.site).c_str(),
                describe_issuer(launch, c).c_str(),
                it == launch.mbarriers.end() ? "an mbarrier" : describe_mbarrier(it->second).c_str());
}

[[noreturn]] void report_pending_access(const LaunchState& launch, const ViewSpot& spot, size_t byte, bool is_write) {
  const auto index = static_cast<long long>((byte - spot.view_begin) / spot.elem_size);
  const char* what = is_write ? "write" : "read";
  if (launch.pending[byte] == kPendingTma) {
    const TmaCopy* c = pending_tma_at(launch, byte);
    raise_error(format("%s of a TMA destination before the wait on its mbarrier: shared view '%s' index %lld is "
                       "written by %s, and no thread has waited on that mbarrier since",
                       what, spot.view, index, c ? describe_tma(launch, *c).c_str() : "a TMA load"));
  }
  if (launch.pending[byte] == kMbarrierObject) {
    const Mbarrier* m = mbarrier_at(launch, byte);
    raise_error(format("%s of an mbarrier object: shared view '%s' index %lld is part of %s (initialised at %s); "
                       "only the welder_mbarrier_* calls may use those bytes",
                       what, spot.view, index, m ? describe_mbarrier(*m).c_str() : "an mbarrier",
                       m ? describe(m->init_site).c_str() : "?"));
  }
  const auto [issuer, copy] = pending_copy_at(launch, byte);
  raise_error(format("%s of cp.async destination before cp.async.wait_group: shared view '%s' index %lld is written "
                     "by the %s at %s that %s issued and has not waited for",
                     what, spot.view, index, copy->primitive, describe(copy->site).c_str(),
                     describe_thread(*issuer).c_str()));
}

// What still owns pending byte `b` (a cp.async, a TMA load, an mbarrier), for messages.
std::string describe_pending(const LaunchState& launch, size_t b) {
  if (launch.pending[b] == kPendingTma) {
    const TmaCopy* c = pending_tma_at(launch, b);
    return c ? describe_tma(launch, *c) + ", on which no thread has waited yet" : "a TMA load in flight";
  }
  if (launch.pending[b] == kMbarrierObject) {
    const Mbarrier* m = mbarrier_at(launch, b);
    return m ? describe_mbarrier(*m) + format(" initialised at %s", describe(m->init_site).c_str()) : "an mbarrier";
  }
  const auto [issuer, copy] = pending_copy_at(launch, b);
  return format("the %s at %s that %s issued and has not waited for", copy->primitive, describe(copy->site).c_str(),
                describe_thread(*issuer).c_str());
}

// The wgmma in flight that reads 16-byte unit `unit`, and its warpgroup.
std::pair<unsigned, const WgmmaOp*> wgmma_reading(const LaunchState& launch, uint32_t unit) {
  for (unsigned w = 0; w < launch.warpgroups.size(); ++w) {
    const WgmmaQueue& q = launch.warpgroups[w].queue;
    const auto find = [&](const std::vector<WgmmaOp>& ops) -> const WgmmaOp* {
      for (const WgmmaOp& op : ops)
        if (std::find(op.chunks.begin(), op.chunks.end(), unit) != op.chunks.end()) return &op;
      return nullptr;
    };
    if (const WgmmaOp* op = find(q.open)) return {w, op};
    for (const auto& group : q.committed)
      if (const WgmmaOp* op = find(group)) return {w, op};
  }
  return {0, nullptr};
}

// Reports a write (by `what`) of bytes [begin, begin + n) that an in-flight wgmma still reads.
void check_wgmma_in_use(const LaunchState& launch, size_t begin, size_t n, const ViewSpot& spot, const char* what) {
  if (launch.wgmma_in_use_units == 0) return;
  for (size_t b = begin; b < begin + n; ++b) {
    if (launch.wgmma_in_use[b / 16] == 0) continue;
    const auto [warpgroup, op] = wgmma_reading(launch, static_cast<uint32_t>(b / 16));
    const auto index = static_cast<long long>((b - spot.view_begin) / spot.elem_size);
    raise_error(format("shared memory read by an in-flight wgmma written before wgmma.wait_group: %s shared view '%s' "
                       "index %lld (byte %zu), which the %s at %s of warpgroup %u reads, and no wgmma.wait_group of "
                       "that warpgroup has covered it yet",
                       what, spot.view, index, b, op ? op->primitive : "wgmma", op ? describe(op->site).c_str() : "?",
                       warpgroup));
  }
}

// The bulk store in flight that reads 16-byte unit `unit`, and its thread.
std::pair<const ThreadState*, const BulkStore*> store_reading(const LaunchState& launch, size_t unit) {
  for (const ThreadState& t : launch.threads)
    for (const BulkStore& s : t.stores)
      if (s.begin / 16 <= unit && unit < (s.begin + s.nbytes) / 16) return {&t, &s};
  return {nullptr, nullptr};
}

// Reports a write (by `what`) of bytes [begin, begin + n) that an in-flight wgmma or bulk store still
// reads.
void check_in_flight_reads(const LaunchState& launch, size_t begin, size_t n, const ViewSpot& spot, const char* what) {
  check_wgmma_in_use(launch, begin, n, spot, what);
  if (launch.store_in_use_units == 0) return;
  for (size_t b = begin; b < begin + n; ++b) {
    if (launch.store_in_use[b / 16] == 0) continue;
    const auto [issuer, store] = store_reading(launch, b / 16);
    const auto index = static_cast<long long>((b - spot.view_begin) / spot.elem_size);
    raise_error(format("shared memory read by a bulk store in flight written before cp.async.bulk.wait_group.read: %s "
                       "shared view '%s' index %lld (byte %zu), which the %s at %s that %s issued reads, and no "
                       "cp.async.bulk.wait_group.read (welder_tma_store_wait_read) of that thread has covered it "
                       "yet%s",
                       what, spot.view, index, b, store->primitive, describe(store->site).c_str(),
                       describe_thread(*issuer).c_str(),
                       store->group == issuer->bulk_groups_committed
                           ? " (its bulk group is still open: no cp.async.bulk.commit_group since)"
                           : ""));
  }
}

}  // namespace

unsigned char* shared_access(const char* view, size_t view_offset, long long count, size_t elem_size, long long index,
                             size_t nbytes, AccessKind kind) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread("shared memory access");
  const size_t begin = checked_shared_offset(launch, view, view_offset, count, elem_size, index, nbytes);
  const ViewSpot spot{view, view_offset, elem_size};
  if (const size_t i = first_pending(launch, begin, nbytes); i < nbytes)
    report_pending_access(launch, spot, begin + i, kind != AccessKind::kRead);
  if (kind != AccessKind::kRead) check_in_flight_reads(launch, begin, nbytes, spot, "a write of");
  if (launch.check_races && kind != AccessKind::kAtomic)
    shadow_access(launch, t, begin, nbytes, kind == AccessKind::kWrite, spot);
  return launch.smem + begin;
}

// ============================================================================ cp.async

namespace {

// Lands one copy in shared memory: a write of its destination by the issuing thread, now.
void perform_copy(LaunchState& launch, ThreadState& t, const AsyncCopy& c) {
  std::memcpy(launch.smem + c.offset, c.data, c.nbytes);
  if (!launch.check_races) return;
  std::memset(launch.pending.data() + c.offset, 0, c.nbytes);
  launch.pending_bytes -= c.nbytes;
  shadow_access(launch, t, c.offset, c.nbytes, true, ViewSpot{c.view, c.view_offset, c.elem_size});
}

// Performs the thread's oldest copies while their group is below `limit`.
void perform_copies(LaunchState& launch, ThreadState& t, uint32_t limit) {
  while (t.copies_head < t.copies.size() && t.copies[t.copies_head].group < limit) {
    ++t.copies_head;
    perform_copy(launch, t, t.copies[t.copies_head - 1]);
  }
  if (t.copies_head == t.copies.size()) {
    t.copies.clear();
    t.copies_head = 0;
  }
}

}  // namespace

void cp_async_issue(const char* view, size_t view_offset, long long count, size_t elem_size, long long index,
                    const void* src, unsigned nbytes, unsigned src_bytes, const char* primitive, const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  if (src_bytes > nbytes)
    raise_error(format("%s: src_bytes %u exceeds the copy size of %u bytes", where.c_str(), src_bytes, nbytes));
  const long long dst_byte = static_cast<long long>(view_offset) + index * static_cast<long long>(elem_size);
  if (dst_byte % nbytes != 0)
    raise_error(format("%s: the destination, shared view '%s' index %lld (byte %lld), is not %u-byte aligned",
                       where.c_str(), view, index, dst_byte, nbytes));
  if (reinterpret_cast<uintptr_t>(src) % nbytes != 0)
    raise_error(format("%s: the global source address %p is not %u-byte aligned", where.c_str(), src, nbytes));
  const size_t begin = checked_shared_offset(launch, view, view_offset, count, elem_size, index, nbytes);
  const ViewSpot spot{view, view_offset, elem_size};
  if (const size_t i = first_pending(launch, begin, nbytes); i < nbytes) {
    if (launch.pending[begin + i] != kPendingCpAsync)
      raise_error(format("%s: the destination, shared view '%s' index %lld, is %s", where.c_str(), view, index,
                         launch.pending[begin + i] == kPendingTma
                             ? ("also the destination of " + describe_pending(launch, begin + i)).c_str()
                             : ("part of " + describe_pending(launch, begin + i)).c_str()));
    const auto [issuer, copy] = pending_copy_at(launch, begin + i);
    raise_error(format("%s: the destination, shared view '%s' index %lld, is also the destination of the %s at %s that "
                       "%s issued and has not waited for",
                       where.c_str(), view, index, copy->primitive, describe(copy->site).c_str(),
                       describe_thread(*issuer).c_str()));
  }
  check_in_flight_reads(launch, begin, nbytes, spot,
                        (std::string(primitive) + " at " + describe(site) + " into").c_str());
  if (launch.check_races) shadow_access(launch, t, begin, nbytes, true, spot);
  AsyncCopy c{begin, t.groups_committed, nbytes, {}, view, view_offset, elem_size, primitive, site};
  if (src_bytes > 0) std::memcpy(c.data, src, src_bytes);  // a source past its argument faults here
  t.copies.push_back(c);
  if (launch.check_races) {
    std::memset(launch.pending.data() + begin, kPendingCpAsync, nbytes);
    launch.pending_bytes += nbytes;
  }
}

void cp_async_commit() { ++current_thread("cp.async.commit_group").groups_committed; }

void cp_async_wait(int pending) {
  ThreadState& t = current_thread("cp.async.wait_group");
  const auto keep = static_cast<uint32_t>(pending < 0 ? 0 : pending);
  perform_copies(*g_launch, t, t.groups_committed > keep ? t.groups_committed - keep : 0);
}

// ============================================================================ mbarriers and TMA

namespace {

constexpr const char* kMbarrierWait = "mbarrier.try_wait.parity.shared::cta.b64";
constexpr long long kTxLimit = (1ll << 20) - 1;  // the tx-count's range is +-(2^20 - 1)

// The mbarrier at the view position `bar`, which must have been initialised; checks that the
// calling thread may use it (a __syncthreads since another thread's init).
Mbarrier& used_mbarrier(LaunchState& launch, const ThreadState& t, const SharedSpot& bar, const std::string& where) {
  const size_t offset = checked_shared_offset(launch, bar.view, bar.view_offset, bar.count, bar.elem_size, bar.index, 8);
  auto it = launch.mbarriers.find(offset);
  if (it == launch.mbarriers.end())
    raise_error(format("%s: shared view '%s' index %lld (byte %zu) is not an mbarrier: no welder_mbarrier_init of it "
                       "in this block",
                       where.c_str(), bar.view, bar.index, offset));
  Mbarrier& m = it->second;
  if (m.init_thread != t.linear && m.init_epoch == launch.epoch)
    raise_error(format("%s: %s was initialised by %s at %s with no __syncthreads since (the init is not visible to "
                       "other threads yet)",
                       where.c_str(), describe_mbarrier(m).c_str(), describe_thread(launch.threads[m.init_thread]).c_str(),
                       describe(m.init_site).c_str()));
  return m;
}

// The mbarrier at byte `offset` of peer block `target` (the position `bar` names in the caller's
// block), which must have been initialised there and published to the cluster: a fence.mbarrier_init
// of the initialising thread, then a completed cluster barrier.
Mbarrier& peer_mbarrier(LaunchState& target, size_t offset, const SharedSpot& bar, const std::string& where) {
  auto it = target.mbarriers.find(offset);
  if (it == target.mbarriers.end())
    raise_error(format("%s: shared view '%s' index %lld (byte %zu) of %s is not an mbarrier: no welder_mbarrier_init "
                       "of it in that block",
                       where.c_str(), bar.view, bar.index, offset, describe_cta(target).c_str()));
  Mbarrier& m = it->second;
  const std::vector<uint32_t>& fences = target.threads[m.init_thread].mbarrier_init_fences;
  if (fences.size() <= m.init_fences || fences[m.init_fences] >= target.cluster->epoch)
    raise_error(format("%s: %s of %s was initialised by %s at %s, but that init is not visible to the cluster yet: a "
                       "fence.mbarrier_init (welder_mbarrier_init_fence) of the initialising thread and then a "
                       "welder_cluster_sync must come between the init and its use by another block",
                       where.c_str(), describe_mbarrier(m).c_str(), describe_cta(target).c_str(),
                       describe_thread(target.threads[m.init_thread]).c_str(), describe(m.init_site).c_str()));
  return m;
}

// Refuses an access of peer block `target` once all its threads have exited: its shared memory is
// gone on the GPU.
void check_peer_alive(const LaunchState& target, const std::string& where, const char* access) {
  if (target.live == 0)
    raise_error(format("%s: %s %s, whose threads have all exited (a block must not exit while its peers may still use "
                       "its shared memory: end the kernel with welder_cluster_sync)",
                       where.c_str(), access, describe_cta(target).c_str()));
}

// "phase 3 in progress: 1 of 2 arrivals and 8192 transaction bytes pending"
std::string describe_phase(const Mbarrier& m) {
  return format("phase %llu in progress: %u of %u arrivals and %lld transaction bytes pending",
                static_cast<unsigned long long>(m.phase), m.pending, m.expected, m.tx);
}

// Completes the current phase when nothing is pending any more.
void settle_phase(Mbarrier& m) {
  if (m.pending == 0 && m.tx == 0) {
    ++m.phase;
    m.pending = m.expected;
  }
}

// Where the 16-byte unit at offset `offset` of the dynamic buffer goes under the swizzle of W bytes:
// address bits [4, 4+b) XOR bits [7, 7+b), b = 1, 2, 3 for 32, 64, 128B (an involution).
size_t swizzled(size_t offset, uint32_t swizzle) {
  const unsigned bits = swizzle == 128 ? 7u : swizzle == 64 ? 3u : swizzle == 32 ? 1u : 0u;
  const unsigned address = kSharedWindowBase + static_cast<unsigned>(offset);
  return (address ^ (((address >> 7) & bits) << 4)) - kSharedWindowBase;
}

// Lands every TMA load in flight on the mbarrier at `offset`, in issue order, and completes their
// bytes on it; "" or what went wrong.
std::string complete_tma(LaunchState& launch, size_t offset) {
  auto it = launch.mbarriers.find(offset);
  if (it == launch.mbarriers.end()) return "";
  Mbarrier& m = it->second;
  size_t kept = 0;
  for (size_t i = 0; i < launch.tma_copies.size(); ++i) {
    TmaCopy& c = launch.tma_copies[i];
    if (c.barrier != offset) {
      if (kept != i) launch.tma_copies[kept] = std::move(c);
      ++kept;
      continue;
    }
    for (size_t chunk = 0; chunk < c.data.size(); chunk += 16)
      std::memcpy(launch.smem + swizzled(c.dst + chunk, c.swizzle), c.data.data() + chunk, 16);
    if (launch.check_races) {
      // An async-proxy write, ordered for every thread by the mbarrier wait that completed it.
      std::memset(launch.pending.data() + c.dst, kNotPending, c.data.size());
      launch.pending_bytes -= c.data.size();
      for (size_t b = c.dst; b < c.dst + c.data.size(); ++b)
        launch.shadow[b] = ByteShadow{Access{launch.epoch, 0, kCopyEngine}, {}, 0};
    }
    // Bytes may come before the expect_tx that announces them (a peer's multicast, landed by a wait of
    // this block): the count may dip below zero until the phase has all its arrivals.
    m.tx -= static_cast<long long>(c.data.size());
    if (m.tx < 0 && m.pending == 0) {
      const std::string what = format(
          "the %zu bytes of the %s at %s (%s) take the transaction count of %s below zero (%lld): the phase "
          "expected fewer bytes (welder_mbarrier_arrive_expect_tx) than its TMA loads deliver",
          c.data.size(), c.primitive, describe(c.site).c_str(), describe_issuer(launch, c).c_str(),
          describe_mbarrier(m).c_str(), m.tx);
      launch.tma_copies.clear();
      return what;
    }
    settle_phase(m);
  }
  launch.tma_copies.resize(kept);
  return "";
}

// One arrival (after expecting `tx_bytes` more transaction bytes when `expect_tx`) on `m`, which
// `name` describes.
void arrive(Mbarrier& m, const std::string& name, bool expect_tx, unsigned tx_bytes, const std::string& where) {
  if (expect_tx) {
    if (static_cast<long long>(tx_bytes) > kTxLimit || m.tx + static_cast<long long>(tx_bytes) > kTxLimit)
      raise_error(format("%s: expecting %u more transaction bytes on %s (%s) exceeds the tx-count's limit of "
                         "2^20 - 1",
                         where.c_str(), tx_bytes, name.c_str(), describe_phase(m).c_str()));
    m.tx += tx_bytes;
  }
  if (m.pending == 0)
    raise_error(format("%s: arrival beyond the expected count on %s: its phase %llu already has all %u arrivals and "
                       "waits only for %lld transaction bytes",
                       where.c_str(), name.c_str(), static_cast<unsigned long long>(m.phase), m.expected, m.tx));
  --m.pending;
  if (m.pending == 0 && m.tx < 0)
    raise_error(format("%s: the last arrival of phase %llu on %s leaves its transaction count below zero (%lld): the "
                       "phase expected fewer bytes (welder_mbarrier_arrive_expect_tx) than its TMA loads delivered",
                       where.c_str(), static_cast<unsigned long long>(m.phase), name.c_str(), m.tx));
  settle_phase(m);
}

}  // namespace

void mbarrier_init(const SharedSpot& bar, unsigned arrivals, const Site& site) {
  LaunchState& launch = *g_launch;
  const char* primitive = "mbarrier.init.shared::cta.b64";
  ThreadState& t = current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  const size_t offset = checked_shared_offset(launch, bar.view, bar.view_offset, bar.count, bar.elem_size, bar.index, 8);
  if (offset % 8 != 0)
    raise_error(format("%s: shared view '%s' index %lld (byte %zu) is not 8-byte aligned", where.c_str(), bar.view,
                       bar.index, offset));
  if (arrivals == 0 || arrivals > static_cast<unsigned>(kTxLimit))
    raise_error(format("%s: the arrival count %u is not in [1, 2^20 - 1]", where.c_str(), arrivals));
  for (const TmaCopy& c : launch.tma_copies)
    if (c.barrier == offset)
      raise_error(format("%s: re-initialises %s while %s is still in flight on it", where.c_str(),
                         describe_mbarrier(launch.mbarriers.at(offset)).c_str(), describe_tma(launch, c).c_str()));
  if (launch.check_races) {
    for (size_t b = offset; b < offset + 8; ++b)
      if (launch.pending[b] != kNotPending && launch.pending[b] != kMbarrierObject)
        raise_error(format("%s: shared view '%s' index %lld (byte %zu) is the destination of %s", where.c_str(),
                           bar.view, bar.index, offset, describe_pending(launch, b).c_str()));
    check_in_flight_reads(launch, offset, 8, ViewSpot{bar.view, bar.view_offset, bar.elem_size}, where.c_str());
    for (size_t b = offset; b < offset + 8; ++b) {
      if (launch.pending[b] == kNotPending) ++launch.pending_bytes;
      launch.pending[b] = kMbarrierObject;
    }
  }
  // The raw bytes read as garbage if a kernel (wrongly) looks at them without race checks.
  std::memset(launch.smem + offset, 0xA5, 8);
  launch.mbarriers[offset] = Mbarrier{offset,  bar.view, bar.index, arrivals,      arrivals,
                                      0,       0,        site,      t.linear, launch.epoch,
                                      static_cast<uint32_t>(t.mbarrier_init_fences.size())};
}

void mbarrier_init_fence() {
  current_thread("fence.mbarrier_init").mbarrier_init_fences.push_back(g_launch->cluster->epoch);
}

void mbarrier_arrive(const SharedSpot& bar, bool expect_tx, unsigned tx_bytes, const char* primitive,
                     const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  Mbarrier& m = used_mbarrier(launch, t, bar, where);
  arrive(m, describe_mbarrier(m), expect_tx, tx_bytes, where);
}

void mbarrier_arrive_cluster(const SharedSpot& bar, unsigned cta, const char* primitive, const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  const size_t size = launch.cluster->ctas.size();
  if (cta >= size)
    raise_error(format("%s: block rank %u is not in the cluster of %zu block%s", where.c_str(), cta, size,
                       size == 1 ? " (the kernel has no cluster dims)" : "s"));
  if (cta == launch.rank) {
    Mbarrier& m = used_mbarrier(launch, t, bar, where);
    arrive(m, describe_mbarrier(m), false, 0, where);
    return;
  }
  LaunchState& target = *launch.cluster->ctas[cta];
  const size_t offset = checked_shared_offset(launch, bar.view, bar.view_offset, bar.count, bar.elem_size, bar.index, 8);
  check_peer_alive(target, where, format("arrives on shared view '%s' index %lld of", bar.view, bar.index).c_str());
  Mbarrier& m = peer_mbarrier(target, offset, bar, where);
  arrive(m, describe_mbarrier(m) + " of " + describe_cta(target), false, 0, where);
}

void mbarrier_wait(const SharedSpot& bar, unsigned parity, const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(kMbarrierWait);
  const std::string where = format("%s at %s", kMbarrierWait, describe(site).c_str());
  Mbarrier& m = used_mbarrier(launch, t, bar, where);
  if (parity > 1) raise_error(format("%s: the phase parity %u is not 0 or 1", where.c_str(), parity));
  if (const std::string problem = complete_tma(launch, m.offset); !problem.empty())
    raise_error(where + ": " + problem);
  if ((m.phase & 1) != parity) return;  // the phase of that parity has completed
  t.wait = WaitKind::kMbarrier;
  t.site = site;
  t.primitive = kMbarrierWait;
  t.wait_barrier = m.offset;
  t.param = static_cast<int>(parity);
  suspend(t);
}

namespace {

// The fields of `map` for a `rank`-d load or store of the box at `coords`; raises what is wrong with
// them.
TensorMapFields copy_map(const CUtensorMap* map, int rank, const int* coords, bool store, const std::string& where) {
  TensorMapFields f;
  if (map == nullptr || !tensor_map_fields(*map, f))
    raise_error(format("%s: the tensor map was not encoded by welder_encode_tensor_map", where.c_str()));
  if (static_cast<int>(f.rank) != rank)
    raise_error(format("%s: a %dd %s through a rank-%u tensor map (%s)", where.c_str(), rank,
                       store ? "store" : "load", f.rank, describe_tensor_map(f).c_str()));
  // Seen on an H100: a store may end past the tensor (it is clipped) but not start before it.
  if (store)
    for (int d = 0; d < rank; ++d)
      if (coords[d] < 0)
        raise_error(format("%s: coordinate %d (dimension %d, innermost first) starts the box before the tensor; a "
                           "load may (its elements there are zeros) but on an H100 such a store is an illegal "
                           "instruction",
                           where.c_str(), coords[d], d));
  const long long start = static_cast<long long>(coords[0]) * f.elem_bytes;
  // Seen on an H100 for loads; stores are held to the same rule.
  if (start % 16 != 0)
    raise_error(format("%s: the innermost coordinate %d starts the box at byte %lld of a row, not a multiple of 16 "
                       "bytes (%s)",
                       where.c_str(), coords[0], start,
                       store ? "as for a load, which on an H100 is an illegal instruction"
                             : "on an H100 such a load is an illegal instruction"));
  return f;
}

size_t box_bytes(const TensorMapFields& f) {
  size_t elements = 1;
  for (uint32_t i = 0; i < f.rank; ++i) elements *= f.box[i];
  return elements * f.elem_bytes;
}

// The offset in the dynamic buffer of the box of `f` at the view position `spot`, the copy's `role`
// ("destination" or "source"): the whole box inside the view and the launch's buffer, aligned as
// the swizzle needs, its rows one swizzle span (the layouts modelled).
size_t box_offset(const LaunchState& launch, const SharedSpot& spot, const TensorMapFields& f, const char* role,
                  const std::string& where) {
  const size_t nbytes = box_bytes(f);
  const long long first = spot.index * static_cast<long long>(spot.elem_size);
  if (spot.index < 0 || first + static_cast<long long>(nbytes) > spot.count * static_cast<long long>(spot.elem_size))
    raise_error(format("%s: the %zu-byte box does not fit shared view '%s' from index %lld (count %lld, %zu-byte "
                       "elements)",
                       where.c_str(), nbytes, spot.view, spot.index, spot.count, spot.elem_size));
  const size_t begin = checked_shared_offset(launch, spot.view, spot.view_offset, spot.count, spot.elem_size,
                                             spot.index, nbytes);
  const unsigned address = kSharedWindowBase + static_cast<unsigned>(begin);
  const unsigned align = f.swizzle == 128 ? 1024 : 128;
  if (address % align != 0)
    raise_error(format("%s: the %s, shared view '%s' index %lld (shared address 0x%x), is not %u-byte aligned%s",
                       where.c_str(), role, spot.view, spot.index, address, align,
                       f.swizzle == 128 ? " (the 128B swizzle's pattern spans 1024 bytes)" : ""));
  if (f.swizzle != 0 && f.box[0] * f.elem_bytes != f.swizzle)
    raise_error(format("%s: the box's innermost extent is %u bytes, less than the %uB swizzle span; the emulator "
                       "models swizzled boxes whose rows are exactly one span (%s)",
                       where.c_str(), f.box[0] * f.elem_bytes, f.swizzle, describe_tensor_map(f).c_str()));
  return begin;
}

// Calls visit(e, idx, inside, offset) for each element e of the box at `coords`, row-major with the
// innermost dimension fastest: idx its position in the box, whether every coordinate lies inside
// the tensor, and then its byte offset from the tensor's base.
// `inner_extent` bounds the innermost coordinate instead of dims[0] where it is nonzero.
template <class Visit>
void for_each_box_element(const TensorMapFields& f, const int* coords, Visit visit, uint64_t inner_extent = 0) {
  const size_t elements = box_bytes(f) / f.elem_bytes;
  uint32_t idx[5] = {0, 0, 0, 0, 0};
  for (size_t e = 0; e < elements; ++e) {
    bool inside = true;
    uint64_t offset = 0;
    for (uint32_t d = 0; d < f.rank; ++d) {
      const long long c = static_cast<long long>(coords[d]) + idx[d];
      const uint64_t extent = d == 0 && inner_extent != 0 ? inner_extent : f.dims[d];
      inside = inside && c >= 0 && static_cast<uint64_t>(c) < extent;
      offset += static_cast<uint64_t>(c) * f.strides[d];
    }
    visit(e, idx, inside, offset);
    for (uint32_t d = 0; d < f.rank && ++idx[d] == f.box[d]; ++d) idx[d] = 0;
  }
}

// A TMA tile load of the box at `coords` (rank of them) into `dst`, completing on `bar`: into the
// calling block, or, when `multicast`, into the blocks whose rank bit is set in `mask`, each at the
// same offsets.  Every destination is checked (mbarrier, pending bytes, wgmma in flight) before the
// box is read and queued on each destination's mbarrier.
void issue_tma(const SharedSpot& dst, const CUtensorMap* map, const SharedSpot& bar, bool multicast, unsigned mask,
               const int* coords, int rank, const char* primitive, const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  const TensorMapFields f = copy_map(map, rank, coords, false, where);
  const std::vector<std::unique_ptr<LaunchState>>& ctas = launch.cluster->ctas;
  if (multicast && (mask == 0 || (mask >> ctas.size()) != 0))
    raise_error(format("%s: the multicast mask 0x%x names %s of the cluster's %zu block%s", where.c_str(), mask,
                       mask == 0 ? "none" : "ranks outside those", ctas.size(), ctas.size() == 1 ? "" : "s"));
  if (!multicast) mask = 1u << launch.rank;

  // The mbarrier in each destination: this block's as for any load, a peer's published to the cluster.
  const size_t bar_offset =
      checked_shared_offset(launch, bar.view, bar.view_offset, bar.count, bar.elem_size, bar.index, 8);
  std::vector<LaunchState*> targets;
  for (unsigned r = 0; r < ctas.size(); ++r) {
    if ((mask & (1u << r)) == 0) continue;
    LaunchState& target = *ctas[r];
    targets.push_back(&target);
    if (&target != &launch) {
      check_peer_alive(target, where, "multicasts into");
      peer_mbarrier(target, bar_offset, bar, where);
      continue;
    }
    Mbarrier& m = used_mbarrier(launch, t, bar, where);
    if (launch.threads[m.init_thread].mbarrier_init_fences.size() <= m.init_fences)
      raise_error(format("%s: it completes on %s, whose init (%s at %s) no fence.mbarrier_init "
                         "(welder_mbarrier_init_fence) of that thread has followed, so the copy engine may not see it",
                         where.c_str(), describe_mbarrier(m).c_str(),
                         describe_thread(launch.threads[m.init_thread]).c_str(), describe(m.init_site).c_str()));
  }

  const size_t nbytes = box_bytes(f);
  const size_t begin = box_offset(launch, dst, f, "destination", where);
  for (LaunchState* target : targets) {
    const std::string in = target == &launch ? "" : " in " + describe_cta(*target);
    if (const size_t i = first_pending(*target, begin, nbytes); i < nbytes)
      raise_error(format("%s: the destination%s, shared view '%s' (byte %zu), is %s %s", where.c_str(), in.c_str(),
                         dst.view, begin + i,
                         target->pending[begin + i] == kMbarrierObject ? "part of" : "also the destination of",
                         describe_pending(*target, begin + i).c_str()));
    const std::string into = target == &launch ? " into" : " into " + describe_block(target->block_index) + "'s";
    check_in_flight_reads(*target, begin, nbytes, ViewSpot{dst.view, dst.view_offset, dst.elem_size},
                          (std::string(primitive) + " at " + describe(site) + into).c_str());
  }

  // Read the box now (out-of-bounds elements are zeros), row-major with the innermost fastest.
  TmaCopy copy{begin, bar_offset, f.swizzle, std::vector<unsigned char>(nbytes, 0), dst.view, dst.index, primitive,
               site, t.linear, launch.rank};
  for_each_box_element(f, coords, [&](size_t e, const uint32_t*, bool inside, uint64_t offset) {
    if (inside)
      std::memcpy(copy.data.data() + e * f.elem_bytes, reinterpret_cast<const void*>(f.base + offset), f.elem_bytes);
  });
  for (LaunchState* target : targets) {
    if (target->check_races) {
      std::memset(target->pending.data() + begin, kPendingTma, nbytes);
      target->pending_bytes += nbytes;
    }
    target->tma_copies.push_back(copy);
  }
}

}  // namespace

void tma_load(const SharedSpot& dst, const CUtensorMap* map, const SharedSpot& bar, const int* coords, int rank,
              const char* primitive, const Site& site) {
  issue_tma(dst, map, bar, false, 0, coords, rank, primitive, site);
}

void tma_load_multicast(const SharedSpot& dst, const CUtensorMap* map, const SharedSpot& bar, unsigned mask,
                        const int* coords, int rank, const char* primitive, const Site& site) {
  issue_tma(dst, map, bar, true, mask, coords, rank, primitive, site);
}

void tma_prefetch(const CUtensorMap* map, const char* primitive, const Site& site) {
  current_thread(primitive);
  TensorMapFields f;
  if (map == nullptr || !tensor_map_fields(*map, f))
    raise_error(format("%s at %s: the tensor map was not encoded by welder_encode_tensor_map", primitive,
                       describe(site).c_str()));
}

// ============================================================================ bulk tensor stores

namespace {

// The guarded argument whose copy holds global address `address`, or null.
const ArgumentBuffer* argument_holding(const ClusterState& cluster, uint64_t address) {
  for (const ArgumentBuffer& a : cluster.arguments)
    if (address >= a.begin && address < a.begin + a.bytes) return &a;
  return nullptr;
}

// Counts (+1) or releases (-1) the 16-byte units a bulk store reads.
void mark_store(LaunchState& launch, const BulkStore& s, int delta) {
  for (size_t unit = s.begin / 16; unit < (s.begin + s.nbytes) / 16; ++unit) {
    uint16_t& n = launch.store_in_use[unit];
    if (delta > 0 && n++ == 0) ++launch.store_in_use_units;
    if (delta < 0 && --n == 0) --launch.store_in_use_units;
  }
}

// Checks (race checks on) that the async proxy may read bytes [begin, begin + nbytes), the source of
// the bulk store `store` that thread `t` issues: each byte the block wrote through the generic proxy
// was followed by a fence.proxy.async of its writer, and that fence is ordered before the issue.
void check_store_source(const LaunchState& launch, const ThreadState& t, const SharedSpot& src, size_t begin,
                        size_t nbytes, const std::string& store) {
  for (size_t b = begin; b < begin + nbytes; ++b) {
    const ByteShadow& s = launch.shadow[b];
    if (s.write.epoch < launch.block_epoch || s.write.thread == kCopyEngine) continue;
    const ThreadState& writer = launch.threads[s.write.thread];
    const auto index = static_cast<long long>((b - src.view_offset) / src.elem_size);
    if (s.write_fences >= writer.proxy_fences.size())
      raise_error(format("%s reads shared view '%s' index %lld (byte %zu), which %s wrote through the generic proxy "
                         "with no fence.proxy.async (welder_fence_proxy_async) of that thread after the write, so "
                         "the copy engine may not see it",
                         store.c_str(), src.view, index, b, describe_thread(writer).c_str()));
    const ProxyFence& fence = writer.proxy_fences[s.write_fences];
    const bool ordered = &writer == &t || fence.epoch != launch.epoch ||
                         (writer.warp == t.warp && t.clock[writer.lane] >= fence.stamp);
    if (!ordered)
      raise_error(format("%s reads shared view '%s' index %lld (byte %zu), which %s wrote and then fenced "
                         "(fence.proxy.async), but no __syncwarp naming both threads or __syncthreads lies between "
                         "that fence and the store (%s)",
                         store.c_str(), src.view, index, b, describe_thread(writer).c_str(),
                         since_last_barrier(launch).c_str()));
  }
}

// "[3, 0]": the position `idx` in a box, offset by `origin` unless that is null; innermost first.
std::string describe_coords(const uint32_t* idx, uint32_t rank, const int* origin) {
  std::string out = "[";
  for (uint32_t d = 0; d < rank; ++d)
    out += format("%s%lld", d == 0 ? "" : ", ", static_cast<long long>(origin ? origin[d] : 0) + idx[d]);
  return out + "]";
}

}  // namespace

void tma_store(const CUtensorMap* map, const SharedSpot& src, const int* coords, int rank, const char* primitive,
               const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  const TensorMapFields f = copy_map(map, rank, coords, true, where);
  const std::string store = format("%s through the tensor map (%s)", where.c_str(), describe_tensor_map(f).c_str());
  const size_t nbytes = box_bytes(f);
  const size_t begin = box_offset(launch, src, f, "source", where);
  if (const ArgumentBuffer* a = argument_holding(*launch.cluster, f.base); a != nullptr && a->readonly)
    raise_error(format("%s: the tensor map points into argument %u (%s), a read-only buffer: the store would change it",
                       store.c_str(), a->index, a->type.c_str()));
  if (const size_t i = first_pending(launch, begin, nbytes); i < nbytes)
    raise_error(format("%s: the source, shared view '%s' index %lld (byte %zu), is %s %s", store.c_str(), src.view,
                       static_cast<long long>((begin + i - src.view_offset) / src.elem_size), begin + i,
                       launch.pending[begin + i] == kMbarrierObject ? "part of" : "the destination of",
                       describe_pending(launch, begin + i).c_str()));

  // The bytes of box element e lie where a load of the box would land them.
  const auto element_at = [&](size_t e) {
    const size_t linear = e * f.elem_bytes;
    return swizzled(begin + linear / 16 * 16, f.swizzle) + linear % 16;
  };
  if (launch.check_races) {
    check_store_source(launch, t, src, begin, nbytes, store);
    // An element inside the tensor that the block never wrote would put garbage into global memory.
    for_each_box_element(f, coords, [&](size_t e, const uint32_t* idx, bool inside, uint64_t) {
      if (!inside) return;
      const size_t at = element_at(e);
      for (size_t b = at; b < at + f.elem_bytes; ++b)
        if (launch.shadow[b].write.epoch < launch.block_epoch)
          raise_error(format("%s reads shared view '%s' index %lld (byte %zu), which no thread of this block has "
                             "written, for the box's element %s, inside the tensor at %s (innermost first)",
                             store.c_str(), src.view, static_cast<long long>((b - src.view_offset) / src.elem_size),
                             b, describe_coords(idx, f.rank, nullptr).c_str(),
                             describe_coords(idx, f.rank, coords).c_str()));
    });
  }

  // Global memory is written now (its races are not modelled); elements outside the tensor are dropped,
  // but in whole 16-byte units along the innermost axis, as an H100 does: a row of 300 fp16 elements
  // gets elements 300..303 too (written past its end, into the row's padding).
  const uint64_t inner = (f.dims[0] * f.elem_bytes + 15) / 16 * 16 / f.elem_bytes;
  const ArgumentBuffer* holder = argument_holding(*launch.cluster, f.base);
  for_each_box_element(
      f, coords,
      [&](size_t e, const uint32_t* idx, bool inside, uint64_t offset) {
        if (!inside) return;
        const uint64_t address = f.base + offset;
        if (holder != nullptr && address + f.elem_bytes > holder->begin + holder->bytes)
          raise_error(format("%s writes the box's element %s, past the tensor's innermost extent but in the 16-byte "
                             "unit of its last elements (a store writes whole units), beyond the end of argument %u "
                             "(%s)",
                             store.c_str(), describe_coords(idx, f.rank, coords).c_str(), holder->index,
                             holder->type.c_str()));
        std::memcpy(reinterpret_cast<void*>(address), launch.smem + element_at(e), f.elem_bytes);
      },
      inner);
  t.stores.push_back(BulkStore{begin, nbytes, t.bulk_groups_committed, src.view, src.view_offset, src.elem_size,
                               src.index, primitive, site});
  if (launch.check_races) mark_store(launch, t.stores.back(), +1);
}

void tma_store_commit() { ++current_thread("cp.async.bulk.commit_group").bulk_groups_committed; }

void tma_store_wait(int pending) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread("cp.async.bulk.wait_group");
  const auto keep = static_cast<uint32_t>(pending < 0 ? 0 : pending);
  const uint32_t limit = t.bulk_groups_committed > keep ? t.bulk_groups_committed - keep : 0;
  size_t done = 0;
  for (; done < t.stores.size() && t.stores[done].group < limit; ++done) {
    if (!launch.check_races) continue;
    const BulkStore& s = t.stores[done];
    mark_store(launch, s, -1);
    // The read is over as far as this thread knows: another thread that writes the bytes next must
    // be ordered after this wait (a __syncwarp or barrier), as after any read.
    shadow_access(launch, t, s.begin, s.nbytes, false, ViewSpot{s.view, s.view_offset, s.elem_size});
  }
  t.stores.erase(t.stores.begin(), t.stores.begin() + static_cast<std::ptrdiff_t>(done));
}

// ============================================================================ blocking primitives

int block_barrier(const char* primitive, int predicate, const Site& site) {
  ThreadState& t = current_thread(primitive);
  t.wait = WaitKind::kBarrier;
  t.site = site;
  t.primitive = primitive;
  t.predicate = predicate != 0;
  suspend(t);
  return t.barrier_count;
}

uint64_t warp_collective(const char* primitive, WarpOp op, unsigned mask, uint64_t value, int param, int width,
                         const Site& site) {
  ThreadState& t = current_thread(primitive);
  if ((mask & (1u << t.lane)) == 0)
    raise_error(format("%s at %s: mask 0x%08x does not include the calling lane %u", primitive, describe(site).c_str(),
                       mask, t.lane));
  if (width < 1 || width > static_cast<int>(kWarpSize) || (width & (width - 1)) != 0)
    raise_error(format("%s at %s: width %d is not a power of two in [1, 32]", primitive, describe(site).c_str(),
                       width));
  t.wait = WaitKind::kWarpCollective;
  t.site = site;
  t.primitive = primitive;
  t.op = op;
  t.mask = mask;
  t.value = value;
  t.param = param;
  t.width = width;
  suspend(t);
  return t.result;
}

namespace {

ThreadState& full_warp_thread(const char* primitive, const Site& site) {
  ThreadState& t = current_thread(primitive);
  const unsigned lanes = existing_lanes(*g_launch, t.warp);
  if (lanes != kFullMask)
    raise_error(format("%s at %s needs a full warp, but warp %u has only %d threads", primitive, describe(site).c_str(),
                       t.warp, __builtin_popcount(lanes)));
  return t;
}

}  // namespace

void warp_rendezvous(const char* primitive, const Site& site) {
  full_warp_thread(primitive, site);
  warp_collective(primitive, WarpOp::kRendezvous, kFullMask, 0, 0, 32, site);
}

void warp_combine(const char* primitive, WarpCombine combine, void* data, const Site& site) {
  ThreadState& t = full_warp_thread(primitive, site);
  t.combine = combine;
  warp_collective(primitive, WarpOp::kCombine, kFullMask, reinterpret_cast<uintptr_t>(data), 0, 32, site);
}

void cluster_barrier(const char* primitive, const Site& site) {
  ThreadState& t = current_thread(primitive);
  t.wait = WaitKind::kClusterBarrier;
  t.site = site;
  t.primitive = primitive;
  suspend(t);
}

unsigned cluster_ctarank() {
  current_thread("%cluster_ctarank");
  return g_launch->rank;
}

unsigned active_mask(const Site& site) {
  ThreadState& t = current_thread("__activemask");
  t.wait = WaitKind::kActiveMask;
  t.site = site;
  t.primitive = "__activemask";
  suspend(t);
  return static_cast<unsigned>(t.result);
}

// ============================================================================ warpgroups and wgmma

bool warpgroup_meet(const char* primitive, void* data, void* const** members, const Site& site) {
  LaunchState& launch = *g_launch;
  ThreadState& t = current_thread(primitive);
  if (launch.nthreads % kWarpgroupSize != 0)
    raise_error(format("%s at %s needs whole warpgroups of 128 threads (warps 4i..4i+3), but the block has %u threads",
                       primitive, describe(site).c_str(), launch.nthreads));
  t.wait = WaitKind::kWarpgroup;
  t.site = site;
  t.primitive = primitive;
  t.value = reinterpret_cast<uintptr_t>(data);
  suspend(t);
  WarpgroupState& wg = launch.warpgroups[t.linear / kWarpgroupSize];
  if (wg.claimed == wg.generation) return false;
  wg.claimed = wg.generation;
  *members = wg.members;
  return true;
}

unsigned current_warpgroup() { return current_thread("current_warpgroup").linear / kWarpgroupSize; }

WgmmaQueue& wgmma_queue(unsigned warpgroup) { return g_launch->warpgroups.at(warpgroup).queue; }

namespace {

// Marks (+1) or releases (-1) the 16-byte units an operation reads.
void mark_in_use(LaunchState& launch, const WgmmaOp& op, int delta) {
  if (!launch.check_races) return;
  for (uint32_t unit : op.chunks) {
    uint16_t& n = launch.wgmma_in_use[unit];
    if (delta > 0 && n++ == 0) ++launch.wgmma_in_use_units;
    if (delta < 0 && --n == 0) --launch.wgmma_in_use_units;
  }
}

// Writes an operation's result into each member's accumulators (lane layout of the PTX ISA's
// wgmma .m64nNk16 D fragment) and releases its chunks.
void complete_wgmma(LaunchState& launch, const WgmmaOp& op) {
  for (unsigned m = 0; m < kWarpgroupSize; ++m) {
    const unsigned warp = m / kWarpSize, g = (m % kWarpSize) / 4, t = m % 4;
    for (int j = 0; j < op.n / 8; ++j)
      for (int i = 0; i < 4; ++i) {
        const unsigned row = 16 * warp + g + 8 * (i / 2), col = 8 * j + 2 * t + i % 2;
        op.dest[m][4 * j + i] = op.d[row * op.n + col];
      }
  }
  mark_in_use(launch, op, -1);
}

}  // namespace

void wgmma_check_reads(const std::vector<uint32_t>& chunks, const char* primitive, const Site& site) {
  LaunchState& launch = *g_launch;
  current_thread(primitive);
  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  for (uint32_t unit : chunks)
    for (size_t b = 16 * size_t{unit}; b < 16 * size_t{unit} + 16; ++b) {
      const unsigned address = kSharedWindowBase + static_cast<unsigned>(b);
      if (launch.pending_bytes != 0 && launch.pending[b] == kPendingTma)
        raise_error(format("%s reads shared address 0x%x (byte %zu of the dynamic buffer), the destination of %s (a "
                           "wgmma may read TMA data only after an mbarrier wait saw it complete)",
                           where.c_str(), address, b, describe_pending(launch, b).c_str()));
      if (launch.pending_bytes != 0 && launch.pending[b] == kMbarrierObject)
        raise_error(format("%s reads shared address 0x%x (byte %zu of the dynamic buffer), which holds %s",
                           where.c_str(), address, b, describe_pending(launch, b).c_str()));
      if (launch.pending_bytes != 0 && launch.pending[b]) {
        const auto [issuer, copy] = pending_copy_at(launch, b);
        raise_error(format("%s reads shared address 0x%x (byte %zu of the dynamic buffer), which the %s at %s that %s "
                           "issued will still write (no cp.async.wait_group has covered it)",
                           where.c_str(), address, b, copy->primitive, describe(copy->site).c_str(),
                           describe_thread(*issuer).c_str()));
      }
      if (!launch.check_races) continue;
      const ByteShadow& s = launch.shadow[b];
      if (s.write.epoch == 0 || s.write.epoch < launch.block_epoch) continue;  // not written by this block
      if (s.write.thread == kCopyEngine) continue;                            // a landed TMA load
      const ThreadState& writer = launch.threads[s.write.thread];
      if (s.write.epoch == launch.epoch)
        raise_error(format("%s reads shared address 0x%x (byte %zu of the dynamic buffer), which %s wrote with no "
                           "__syncthreads between the write and the wgmma (%s)",
                           where.c_str(), address, b, describe_thread(writer).c_str(),
                           since_last_barrier(launch).c_str()));
      const bool fenced = s.write_fences < writer.proxy_fences.size() &&
                          writer.proxy_fences[s.write_fences].epoch < launch.epoch;
      if (!fenced)
        raise_error(format("%s reads shared address 0x%x (byte %zu of the dynamic buffer), which %s wrote through the "
                           "generic proxy without a fence.proxy.async (welder_fence_proxy_async) between the write "
                           "and a __syncthreads before the wgmma",
                           where.c_str(), address, b, describe_thread(writer).c_str()));
    }
}

void wgmma_issue(unsigned warpgroup, WgmmaOp&& op) {
  LaunchState& launch = *g_launch;
  mark_in_use(launch, op, +1);
  launch.warpgroups[warpgroup].queue.open.push_back(std::move(op));
}

void wgmma_commit(unsigned warpgroup) {
  WgmmaQueue& q = g_launch->warpgroups[warpgroup].queue;
  q.committed.push_back(std::move(q.open));
  q.open.clear();
}

void wgmma_wait(unsigned warpgroup, int pending) {
  LaunchState& launch = *g_launch;
  WgmmaQueue& q = launch.warpgroups[warpgroup].queue;
  const size_t keep = static_cast<size_t>(pending < 0 ? 0 : pending);
  while (q.committed.size() > keep) {
    for (const WgmmaOp& op : q.committed.front()) complete_wgmma(launch, op);
    q.committed.pop_front();
  }
  q.fenced = false;
}

void fence_proxy_async() {
  ThreadState& t = current_thread("fence.proxy.async");
  t.proxy_fences.push_back(ProxyFence{g_launch->epoch, t.clock[t.lane]});
}

unsigned current_lane() { return current_thread("current_lane").lane; }
unsigned block_thread_count() { return g_launch->nthreads; }
unsigned current_warp_lanes() { return existing_lanes(*g_launch, current_thread("current_warp_lanes").warp); }
unsigned char* dynamic_smem_base() {
  current_thread("WELDER_SMEM_BEGIN");
  return g_launch->smem;
}
size_t dynamic_smem_bytes() { return g_launch->smem_bytes; }

// ============================================================================ scheduler

namespace {

void thread_main(void* arg) {
  LaunchState& launch = *g_launch;
  launch.invoke(launch.invoke_context);
  auto* t = static_cast<ThreadState*>(arg);
  if (launch.nthreads % kWarpgroupSize == 0) {
    const WgmmaQueue& q = launch.warpgroups[t->linear / kWarpgroupSize].queue;
    const WgmmaOp* op = !q.open.empty() ? &q.open.front() : !q.committed.empty() && !q.committed.front().empty()
                                                                 ? &q.committed.front().front()
                                                                 : nullptr;
    if (op != nullptr)
      raise_error(format("exits with wgmma operations of its warpgroup in flight (the %s at %s%s): a "
                         "wgmma.wait_group 0 must cover every committed group before the threads exit",
                         op->primitive, describe(op->site).c_str(), q.open.empty() ? "" : ", never committed"));
  }
  if (!t->stores.empty()) {
    const BulkStore& s = t->stores.front();
    raise_error(format("exits with a bulk tensor store whose shared source it has not waited for (the %s at %s, from "
                       "shared view '%s' index %lld%s): a cp.async.bulk.wait_group.read 0 (welder_tma_store_wait_read"
                       "<0>) must cover every bulk group first, as the block's shared memory may be reused once its "
                       "threads exit",
                       s.primitive, describe(s.site).c_str(), s.view, s.index,
                       s.group == t->bulk_groups_committed ? ", never committed" : ""));
  }
  perform_copies(launch, *t, UINT32_MAX);  // the hardware completes copies still in flight
  t->wait = WaitKind::kExited;
  --launch.live;
  context_switch(t->context, launch.scheduler);
  __builtin_unreachable();  // an exited fiber is never resumed
}

// Source lane of a shuffle for lane `l`, or -1 when the lane keeps its own value.
long shuffle_source(const ThreadState& t, unsigned l) {
  const auto width = static_cast<unsigned>(t.width);
  const long segment = static_cast<long>(l & ~(width - 1));
  const long end = segment + static_cast<long>(width);
  const long p = t.param;
  switch (t.op) {
    case WarpOp::kShfl: return segment + static_cast<long>(static_cast<unsigned>(p) & (width - 1));
    case WarpOp::kShflUp: return static_cast<long>(l) - p < segment ? -1 : static_cast<long>(l) - p;
    case WarpOp::kShflDown: return static_cast<long>(l) + p >= end ? -1 : static_cast<long>(l) + p;
    default: {  // xor: lanes may read earlier segments, not later ones
      const long src = static_cast<long>(l ^ static_cast<unsigned>(p));
      return src >= end ? -1 : src;
    }
  }
}

uint32_t reduce(ReduceOp op, uint32_t acc, uint32_t v) {
  const auto sa = static_cast<int32_t>(acc), sv = static_cast<int32_t>(v);
  switch (op) {
    case ReduceOp::kAdd: return acc + v;
    case ReduceOp::kMinSigned: return static_cast<uint32_t>(std::min(sa, sv));
    case ReduceOp::kMaxSigned: return static_cast<uint32_t>(std::max(sa, sv));
    case ReduceOp::kMinUnsigned: return std::min(acc, v);
    case ReduceOp::kMaxUnsigned: return std::max(acc, v);
    case ReduceOp::kAnd: return acc & v;
    case ReduceOp::kOr: return acc | v;
    case ReduceOp::kXor: return acc ^ v;
  }
  return acc;
}

// Computes the results of a completed collective for the lanes in `members` and resumes them.
void finish_collective(LaunchState& launch, unsigned warp, unsigned members) {
  ThreadState* lanes = &launch.threads[warp * kWarpSize];
  const ThreadState& lead = lanes[__builtin_ctz(members)];
  const std::vector<unsigned> member_lanes = lanes_of(members);
  // A value read from a lane that does not take part is undefined on the GPU; poison it.
  constexpr uint64_t kPoison = ~uint64_t{0};

  switch (lead.op) {
    case WarpOp::kShfl:
    case WarpOp::kShflUp:
    case WarpOp::kShflDown:
    case WarpOp::kShflXor:
      for (unsigned l : member_lanes) {
        const long src = shuffle_source(lanes[l], l);
        const bool member = src >= 0 && (members & (1u << src)) != 0;
        lanes[l].result = src < 0 ? lanes[l].value : member ? lanes[src].value : kPoison;
      }
      break;
    case WarpOp::kBallot: {
      uint64_t ballot = 0;
      for (unsigned l : member_lanes)
        if (lanes[l].value != 0) ballot |= uint64_t{1} << l;
      for (unsigned l : member_lanes) lanes[l].result = ballot;
      break;
    }
    case WarpOp::kSyncwarp: {
      // Join the lanes' vector clocks, then start a new interval for each of them.
      uint32_t joined[kWarpSize] = {};
      for (unsigned l : member_lanes)
        for (unsigned k = 0; k < kWarpSize; ++k) joined[k] = std::max(joined[k], lanes[l].clock[k]);
      for (unsigned l : member_lanes) {
        std::memcpy(lanes[l].clock, joined, sizeof(joined));
        ++lanes[l].clock[l];
      }
      break;
    }
    case WarpOp::kReduce: {
      auto acc = static_cast<uint32_t>(lead.value);
      for (size_t i = 1; i < member_lanes.size(); ++i)
        acc = reduce(static_cast<ReduceOp>(lead.param), acc, static_cast<uint32_t>(lanes[member_lanes[i]].value));
      for (unsigned l : member_lanes) lanes[l].result = acc;
      break;
    }
    case WarpOp::kRendezvous: break;
    case WarpOp::kCombine: {
      void* data[kWarpSize] = {};
      for (unsigned l : member_lanes) data[l] = reinterpret_cast<void*>(lanes[l].value);
      lead.combine(data);
      break;
    }
  }
  for (unsigned l : member_lanes) lanes[l].wait = WaitKind::kRunnable;
}

bool same_collective(const ThreadState& a, const ThreadState& b) {
  return a.wait == WaitKind::kWarpCollective && b.wait == WaitKind::kWarpCollective && a.site == b.site &&
         a.op == b.op && std::strcmp(a.primitive, b.primitive) == 0;
}

// Whether every existing lane of `t`'s mask waits at t's collective with t's mask.
bool collective_ready(const LaunchState& launch, const ThreadState& t, unsigned members) {
  const ThreadState* lanes = &launch.threads[t.warp * kWarpSize];
  for (unsigned l : lanes_of(members))
    if (!same_collective(lanes[l], t) || lanes[l].mask != t.mask) return false;
  return true;
}

bool complete_warp_collectives(LaunchState& launch) {
  bool progress = false;
  for (ThreadState& t : launch.threads) {
    if (t.wait != WaitKind::kWarpCollective) continue;
    const unsigned members = t.mask & existing_lanes(launch, t.warp);
    if (!collective_ready(launch, t, members)) continue;
    finish_collective(launch, t.warp, members);
    progress = true;
  }
  return progress;
}

bool same_meeting(const ThreadState& a, const ThreadState& b) {
  return a.wait == WaitKind::kWarpgroup && b.wait == WaitKind::kWarpgroup && a.site == b.site &&
         std::strcmp(a.primitive, b.primitive) == 0;
}

bool complete_warpgroups(LaunchState& launch) {
  bool progress = false;
  for (unsigned w = 0; w < launch.warpgroups.size(); ++w) {
    ThreadState* members = &launch.threads[w * kWarpgroupSize];
    bool ready = true;
    for (unsigned m = 0; m < kWarpgroupSize && ready; ++m) ready = same_meeting(members[m], members[0]);
    if (!ready) continue;
    WarpgroupState& wg = launch.warpgroups[w];
    for (unsigned m = 0; m < kWarpgroupSize; ++m) {
      wg.members[m] = reinterpret_cast<void*>(members[m].value);
      members[m].wait = WaitKind::kRunnable;
    }
    ++wg.generation;
    progress = true;
  }
  return progress;
}

bool complete_active_masks(LaunchState& launch) {
  bool progress = false;
  for (ThreadState& t : launch.threads) {
    if (t.wait != WaitKind::kActiveMask) continue;
    ThreadState* lanes = &launch.threads[t.warp * kWarpSize];
    unsigned group = 0;
    for (unsigned l : lanes_of(existing_lanes(launch, t.warp)))
      if (lanes[l].wait == WaitKind::kActiveMask && lanes[l].site == t.site) group |= 1u << l;
    for (unsigned l : lanes_of(group)) {
      lanes[l].result = group;
      lanes[l].wait = WaitKind::kRunnable;
    }
    progress = true;
  }
  return progress;
}

// Completes the block barrier when every live thread waits at the same one; reports a barrier
// that some threads skipped by exiting, and threads waiting at different barriers.
bool complete_barrier(LaunchState& launch) {
  std::vector<unsigned> exited, waiting;
  for (const ThreadState& t : launch.threads) {
    if (t.wait == WaitKind::kExited) exited.push_back(t.linear);
    else if (t.wait == WaitKind::kBarrier) waiting.push_back(t.linear);
    else return false;  // a warp collective is stuck; the caller reports it
  }
  if (waiting.empty()) return false;
  const ThreadState& first = launch.threads[waiting.front()];
  if (!exited.empty()) {
    scheduler_error(launch, format("%s at %s: %s wait at the barrier but %s exited without reaching it (every "
                                   "thread of the block must reach each barrier)",
                                   first.primitive, describe(first.site).c_str(), describe_threads(waiting).c_str(),
                                   describe_threads(exited).c_str()));
    return false;
  }
  std::vector<std::pair<const ThreadState*, std::vector<unsigned>>> groups;  // by barrier site
  for (unsigned id : waiting) {
    const ThreadState& t = launch.threads[id];
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.first->site == t.site && std::strcmp(g.first->primitive, t.primitive) == 0;
    });
    if (it == groups.end()) groups.push_back({&t, {id}});
    else it->second.push_back(id);
  }
  if (groups.size() > 1) {
    std::string where;
    for (const auto& g : groups)
      where += format("%s%s wait at %s (%s)", where.empty() ? "" : "; ", describe_threads(g.second).c_str(),
                      g.first->primitive, describe(g.first->site).c_str());
    scheduler_error(launch, "divergent barrier: " + where);
    return false;
  }
  int count = 0;
  for (const ThreadState& t : launch.threads) count += t.predicate;
  for (ThreadState& t : launch.threads) {
    t.barrier_count = count;
    t.wait = WaitKind::kRunnable;
  }
  ++launch.epoch;
  launch.last_barrier = first.site;
  launch.barrier_seen = true;
  return true;
}

// Releases the threads waiting at an mbarrier whose phase of their parity has completed, after
// landing the TMA loads in flight on it.
bool complete_mbarrier_waits(LaunchState& launch) {
  bool progress = false;
  for (ThreadState& t : launch.threads) {
    if (t.wait != WaitKind::kMbarrier) continue;
    if (const std::string problem = complete_tma(launch, t.wait_barrier); !problem.empty()) {
      scheduler_error(launch, format("%s at %s (%s): %s", t.primitive, describe(t.site).c_str(),
                                     describe_thread(t).c_str(), problem.c_str()));
      return false;
    }
    if ((launch.mbarriers.at(t.wait_barrier).phase & 1) != static_cast<unsigned>(t.param)) {
      t.wait = WaitKind::kRunnable;
      progress = true;
    }
  }
  return progress;
}

// What thread `t` is blocked at, for a deadlock report.
std::string blocked_at(const LaunchState& launch, const ThreadState& t) {
  if (t.wait == WaitKind::kExited) return "have exited";
  if (t.wait != WaitKind::kMbarrier) return format("wait at %s (%s)", t.primitive, describe(t.site).c_str());
  const Mbarrier& m = launch.mbarriers.at(t.wait_barrier);
  return format("wait at %s (%s) on %s for the phase of parity %d (%s)", t.primitive, describe(t.site).c_str(),
                describe_mbarrier(m).c_str(), t.param, describe_phase(m).c_str());
}

// Records an error about the whole cluster, found by the scheduler; a cluster of one block is
// named like that block.
void cluster_error(ClusterState& cluster, const std::string& what) {
  const LaunchState& first = *cluster.ctas.front();
  const LaunchState& last = *cluster.ctas.back();
  cluster.message = cluster.ctas.size() == 1
                        ? describe_block(first.block_index) + ": " + what
                        : format("cluster of blocks (%u,%u,%u)-(%u,%u,%u): ", first.block_index.x, first.block_index.y,
                                 first.block_index.z, last.block_index.x, last.block_index.y, last.block_index.z) +
                              what;
}

// The threads of the cluster grouped by `state` (what each does), block by block:
// "threads 0-63 arrived; threads 64-127 have exited", each group led by its block in a cluster of
// several ("block (1,0,0) threads 0-127 ...").
template <class State>
std::string describe_states(const ClusterState& cluster, State state) {
  std::string out;
  for (const auto& cta : cluster.ctas) {
    std::vector<std::pair<std::string, std::vector<unsigned>>> states;  // threads grouped by what they do
    for (const ThreadState& t : cta->threads) {
      const std::string what = state(*cta, t);
      auto it = std::find_if(states.begin(), states.end(), [&](const auto& s) { return s.first == what; });
      if (it == states.end()) states.push_back({what, {t.linear}});
      else it->second.push_back(t.linear);
    }
    const std::string block = cluster.ctas.size() == 1 ? "" : describe_block(cta->block_index) + " ";
    for (const auto& s : states)
      out += (out.empty() ? "" : "; ") + block + describe_threads(s.second) + " " + s.first;
  }
  return out;
}

// Explains a cluster in which threads wait at mbarriers and nothing can move; false if none does.
bool report_stuck_mbarrier(ClusterState& cluster) {
  if (std::none_of(cluster.ctas.begin(), cluster.ctas.end(), [](const auto& cta) {
        return std::any_of(cta->threads.begin(), cta->threads.end(),
                           [](const ThreadState& t) { return t.wait == WaitKind::kMbarrier; });
      }))
    return false;
  cluster_error(cluster, std::string("deadlock: every thread") + (cluster.ctas.size() == 1 ? "" : " of the cluster") +
                             " is blocked and no mbarrier phase they wait for can complete: " +
                             describe_states(cluster, blocked_at));
  return true;
}

// Completes the cluster barrier when every thread of every block waits at the same one; it orders
// shared memory within each block like a __syncthreads.
bool complete_cluster_barrier(ClusterState& cluster) {
  const ThreadState& first = cluster.ctas.front()->threads.front();
  for (const auto& cta : cluster.ctas)
    for (const ThreadState& t : cta->threads)
      if (t.wait != WaitKind::kClusterBarrier || t.site != first.site) return false;
  const Site site = first.site;
  ++cluster.epoch;
  for (const auto& cta : cluster.ctas) {
    for (ThreadState& t : cta->threads) t.wait = WaitKind::kRunnable;
    ++cta->epoch;
    cta->last_barrier = site;
    cta->barrier_seen = true;
  }
  return true;
}

// Explains a cluster barrier that can never complete; false if no thread waits at one.
bool report_stuck_cluster_barrier(ClusterState& cluster) {
  for (const auto& cta : cluster.ctas)
    for (const ThreadState& t : cta->threads) {
      if (t.wait != WaitKind::kClusterBarrier) continue;
      const std::string detail = describe_states(cluster, [&](const LaunchState& l, const ThreadState& u) {
        return u.wait == WaitKind::kClusterBarrier && u.site == t.site ? std::string("arrived") : blocked_at(l, u);
      });
      cluster_error(cluster, format("%s at %s cannot complete: every thread of every block of the cluster must reach "
                                    "the same cluster barrier; %s",
                                    t.primitive, describe(t.site).c_str(), detail.c_str()));
      return true;
    }
  return false;
}

// What lane `u` does instead of joining collective `t`, or "arrived".
std::string lane_state(const ThreadState& u, const ThreadState& t) {
  if (u.wait == WaitKind::kExited) return "have exited";
  if (u.wait == WaitKind::kBarrier || u.wait == WaitKind::kWarpgroup || !same_collective(u, t))
    return format("wait at %s (%s)", u.primitive, describe(u.site).c_str());
  if (u.mask != t.mask) return format("arrived with a different mask 0x%08x", u.mask);
  return "arrived";
}

// Explains a warpgroup meeting that can never complete; false if no thread waits at one.
bool report_stuck_warpgroup(LaunchState& launch) {
  for (const ThreadState& t : launch.threads) {
    if (t.wait != WaitKind::kWarpgroup) continue;
    const unsigned w = t.linear / kWarpgroupSize;
    std::vector<std::pair<std::string, std::vector<unsigned>>> states;  // threads grouped by what they do
    for (unsigned id = w * kWarpgroupSize; id < (w + 1) * kWarpgroupSize; ++id) {
      const ThreadState& u = launch.threads[id];
      const std::string state = u.wait == WaitKind::kExited ? "have exited"
                                : same_meeting(u, t)         ? "arrived"
                                                             : format("wait at %s (%s)", u.primitive,
                                                                      describe(u.site).c_str());
      auto it = std::find_if(states.begin(), states.end(), [&](const auto& s) { return s.first == state; });
      if (it == states.end()) states.push_back({state, {id}});
      else it->second.push_back(id);
    }
    std::string detail;
    for (const auto& s : states) detail += (detail.empty() ? "" : "; ") + describe_threads(s.second) + " " + s.first;
    scheduler_error(launch, format("%s at %s (warpgroup %u, threads %u-%u) cannot complete: every thread of the "
                                   "warpgroup must reach it; %s",
                                   t.primitive, describe(t.site).c_str(), w, w * kWarpgroupSize,
                                   (w + 1) * kWarpgroupSize - 1, detail.c_str()));
    return true;
  }
  return false;
}

// Explains a warp collective that can never complete.
void report_stuck_collective(LaunchState& launch) {
  if (report_stuck_warpgroup(launch)) return;
  for (const ThreadState& t : launch.threads) {
    if (t.wait != WaitKind::kWarpCollective) continue;
    const ThreadState* lanes = &launch.threads[t.warp * kWarpSize];
    std::vector<std::pair<std::string, std::vector<unsigned>>> states;  // lanes grouped by what they do
    for (unsigned l : lanes_of(t.mask & existing_lanes(launch, t.warp))) {
      const std::string state = lane_state(lanes[l], t);
      auto it = std::find_if(states.begin(), states.end(), [&](const auto& s) { return s.first == state; });
      if (it == states.end()) states.push_back({state, {l}});
      else it->second.push_back(l);
    }
    std::string detail;
    for (const auto& s : states) detail += (detail.empty() ? "" : "; ") + describe_lanes(s.second) + " " + s.first;
    scheduler_error(launch, format("%s at %s (warp %u, mask 0x%08x) cannot complete: %s", t.primitive,
                                   describe(t.site).c_str(), t.warp, t.mask, detail.c_str()));
    return;
  }
  scheduler_error(launch, "internal error: the block is stuck but no thread waits at a warp collective");
}

void reset_thread(LaunchState& launch, ThreadState& t) {
  t.wait = WaitKind::kRunnable;
  t.predicate = 0;
  std::memset(t.clock, 0, sizeof(t.clock));
  t.clock[t.lane] = 1;  // own accesses start at stamp 1; other lanes are known up to 0
  t.copies.clear();
  t.copies_head = 0;
  t.groups_committed = 0;
  t.proxy_fences.clear();
  t.stores.clear();
  t.bulk_groups_committed = 0;
  t.mbarrier_init_fences.clear();
  context_init(t.context, launch.stacks.stack_lo(t.linear), launch.stacks.stack_bytes(), &thread_main, &t);
}

// Starts `block` on `launch`: fresh shared memory, mbarriers, warpgroups and threads.
void start_block(LaunchState& launch, const uint3& block) {
  launch.block_index = block;
  ++launch.epoch;  // the shadow state of earlier blocks no longer matters
  launch.block_epoch = launch.epoch;
  launch.barrier_seen = false;
  launch.warpgroups.assign(launch.nthreads / kWarpgroupSize, WarpgroupState{});
  if (launch.wgmma_in_use_units != 0) {  // only after a failed block
    std::fill(launch.wgmma_in_use.begin(), launch.wgmma_in_use.end(), 0);
    launch.wgmma_in_use_units = 0;
  }
  if (launch.store_in_use_units != 0) {  // only after a failed block
    std::fill(launch.store_in_use.begin(), launch.store_in_use.end(), 0);
    launch.store_in_use_units = 0;
  }
  // Fresh shared memory is garbage on the GPU; here it reads as NaN / -1 so that using it shows.
  if (launch.smem_bytes > 0) std::memset(launch.smem, 0xFF, launch.smem_bytes);
  launch.mbarriers.clear();
  launch.tma_copies.clear();
  if (launch.pending_bytes != 0) {  // after a failed block, or a block that used mbarriers
    std::fill(launch.pending.begin(), launch.pending.end(), 0);
    launch.pending_bytes = 0;
  }
  launch.live = launch.nthreads;
  for (ThreadState& t : launch.threads) reset_thread(launch, t);
}

// Resumes every runnable fiber of `launch` until it blocks or exits; false on an error.
bool resume_block(LaunchState& launch) {
  g_launch = &launch;
  blockIdx = launch.block_index;
  for (ThreadState& t : launch.threads) {
    if (t.wait != WaitKind::kRunnable) continue;
    launch.current = &t;
    threadIdx = t.index;
    context_switch(launch.scheduler, t.context);
    launch.current = nullptr;
    if (launch.failed) return false;
  }
  return true;
}

// Settles what the threads of a quiescent block wait for (the order of emu_scheduler.h); true if
// some thread can run again.
bool settle_block(LaunchState& launch) {
  return complete_warp_collectives(launch) || complete_warpgroups(launch) || complete_active_masks(launch) ||
         complete_mbarrier_waits(launch) || complete_barrier(launch);
}

// Explains a cluster in which no thread can move.
void report_deadlock(ClusterState& cluster) {
  if (report_stuck_cluster_barrier(cluster) || report_stuck_mbarrier(cluster)) return;
  // A warp collective or warpgroup meeting that cannot complete, in the first block that has one.
  LaunchState* stuck = cluster.ctas.front().get();
  for (const auto& cta : cluster.ctas)
    if (std::any_of(cta->threads.begin(), cta->threads.end(), [](const ThreadState& t) {
          return t.wait == WaitKind::kWarpCollective || t.wait == WaitKind::kWarpgroup;
        })) {
      stuck = cta.get();
      break;
    }
  report_stuck_collective(*stuck);
  cluster.message = stuck->message;
}

// What is wrong with a block whose threads have all exited, or "": transaction bytes on an mbarrier
// beyond what its phases expected, landed or still in flight (a phase in progress may hold such
// bytes only while an expect_tx is still to come), or TMA loads in flight.
std::string exit_problem(const LaunchState& launch) {
  for (const auto& [offset, m] : launch.mbarriers) {
    long long tx = m.tx;
    const TmaCopy* in_flight = nullptr;
    for (const TmaCopy& c : launch.tma_copies) {
      if (c.barrier != offset) continue;
      tx -= static_cast<long long>(c.data.size());
      if (in_flight == nullptr) in_flight = &c;
    }
    if (tx < 0)
      return format("every thread exited with %lld transaction bytes on %s that no expect_tx announced (%s%s): a "
                    "phase expected fewer bytes (welder_mbarrier_arrive_expect_tx) than its TMA loads deliver",
                    -tx, describe_mbarrier(m).c_str(), describe_phase(m).c_str(),
                    in_flight ? ("; " + describe_tma(launch, *in_flight) + ", still in flight").c_str() : "");
  }
  if (!launch.tma_copies.empty())
    return format("every thread exited with %s still in flight (no thread waited on that mbarrier after the load was "
                  "issued)",
                  describe_tma(launch, launch.tma_copies.front()).c_str());
  return "";
}

// Runs the blocks of one cluster, the first at `first`, to completion; false (with
// cluster.message) on an error.
bool run_cluster(ClusterState& cluster, const uint3& first) {
  for (const auto& cta : cluster.ctas) start_block(*cta, uint3{first.x + cta->rank, first.y, first.z});
  const auto failed = [&cluster](const LaunchState& launch) {
    cluster.message = launch.message;
    return false;
  };
  for (;;) {
    bool all_exited = true;
    for (const auto& cta : cluster.ctas) {
      LaunchState& launch = *cta;
      if (launch.live > 0 && !resume_block(launch)) return failed(launch);
      if (launch.live > 0) {
        all_exited = false;
      } else if (const std::string problem = exit_problem(launch); !problem.empty()) {
        scheduler_error(launch, problem);
        return failed(launch);
      }
    }
    if (all_exited) return true;
    bool progress = false;
    for (const auto& cta : cluster.ctas) {
      if (cta->live == 0) continue;
      progress = settle_block(*cta) || progress;
      if (cta->failed) return failed(*cta);
    }
    if (progress || complete_cluster_barrier(cluster)) continue;
    report_deadlock(cluster);
    return false;
  }
}

}  // namespace

std::string prepare_launch(LaunchState& launch, size_t stack_bytes) {
  const unsigned n = launch.block.x * launch.block.y * launch.block.z;
  launch.nthreads = n;
  launch.threads.assign(n, ThreadState{});
  for (unsigned i = 0; i < n; ++i) {
    ThreadState& t = launch.threads[i];
    t.linear = i;
    t.lane = i % kWarpSize;
    t.warp = i / kWarpSize;
    t.index = uint3{i % launch.block.x, (i / launch.block.x) % launch.block.y, i / (launch.block.x * launch.block.y)};
  }
  if (!launch.stacks.allocate(n, stack_bytes)) return format("cannot map %u fiber stacks of %zu bytes", n, stack_bytes);
  launch.smem_storage.assign(launch.smem_bytes + 128, 0);
  const auto raw = reinterpret_cast<uintptr_t>(launch.smem_storage.data());
  launch.smem = reinterpret_cast<unsigned char*>((raw + 127) & ~uintptr_t{127});
  if (launch.check_races) {
    launch.shadow.assign(launch.smem_bytes, ByteShadow{{0, 0, 0}, {{0, 0, 0}, {0, 0, 0}}, 0});
    launch.pending.assign(launch.smem_bytes, 0);
    launch.wgmma_in_use.assign((launch.smem_bytes + 15) / 16, 0);
    launch.store_in_use.assign((launch.smem_bytes + 15) / 16, 0);
  }
  launch.pending_bytes = 0;
  launch.wgmma_in_use_units = 0;
  launch.store_in_use_units = 0;
  return "";
}

bool run_grid(ClusterState& cluster) {
  const LaunchState& launch = *cluster.ctas.front();
  gridDim = launch.grid;
  blockDim = launch.block;
  const auto size = static_cast<unsigned>(cluster.ctas.size());
  for (unsigned z = 0; z < launch.grid.z; ++z)
    for (unsigned y = 0; y < launch.grid.y; ++y)
      for (unsigned x = 0; x < launch.grid.x; x += size)
        if (!run_cluster(cluster, uint3{x, y, z})) return false;
  return true;
}

}  // namespace welder_emu::detail
