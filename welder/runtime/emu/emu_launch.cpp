// Launching on the emulator: configuration checks, guarded argument buffers, fault handling.
//
// Guarded arguments.  When the caller says how many bytes lie behind a pointer argument, the
// kernel works on a copy placed at the end of its own mapping, right before an inaccessible page
// (and after another): reading or writing past either end faults and is reported against the
// argument instead of silently touching other memory.  The copy starts 32-byte aligned, so up to
// 31 bytes of slack may follow the data; they hold 0xFF (NaN / -1 when read) and a write to them is
// reported after the launch.  Results are copied back into the caller's buffer, except for
// read-only buffers, which must come back unchanged.  A tensor map over a guarded buffer is moved
// onto its copy, and the runtime learns the guarded buffers (ClusterState::arguments), so that a TMA
// store through a map over a read-only one is reported where it is issued.
//
// Clusters.  WELDER_CLUSTER_DIMS registers a kernel's cluster dims here, by the kernel's address,
// when its module is loaded; a launch of that kernel runs as clusters of that many blocks along x
// (emu_scheduler.h), one LaunchState per block of a cluster.
//
// Faults.  While a launch runs, SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT raised on the launching
// thread jump back to run_protected (the handler runs on an alternate stack, so a fiber stack
// overflow is caught too); other threads' signals go to the previously installed handlers.  A
// fault abandons the fibers where they stand, like any other error.
#include "emu_launch.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "emu_scheduler.h"

namespace welder_emu::detail {
namespace {

// ============================================================================ guarded buffers

// The kernel's copy of one pointer argument (see the top of this file).
class GuardedBuffer {
 public:
  GuardedBuffer() = default;
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  GuardedBuffer(GuardedBuffer&& o) noexcept { *this = std::move(o); }
  GuardedBuffer& operator=(GuardedBuffer&& o) noexcept {
    std::swap(map_, o.map_);
    std::swap(map_len_, o.map_len_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(page_, o.page_);
    std::swap(user_, o.user_);
    std::swap(readonly_, o.readonly_);
    std::swap(argument_, o.argument_);
    std::swap(type_, o.type_);
    return *this;
  }
  ~GuardedBuffer() {
    if (map_ != nullptr) munmap(map_, map_len_);
  }

  // Copies `bytes` from `user` into a fresh guarded mapping; false if it cannot be mapped.
  bool create(void* user, size_t bytes, bool readonly, unsigned argument, std::string type) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t slack = (32 - bytes % 32) % 32;
    const size_t usable = (bytes + slack + page_ - 1) / page_ * page_ + (bytes + slack == 0 ? page_ : 0);
    map_len_ = usable + 2 * page_;
    void* p = mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    map_ = static_cast<unsigned char*>(p);
    mprotect(map_, page_, PROT_NONE);
    mprotect(map_ + page_ + usable, page_, PROT_NONE);
    std::memset(map_ + page_, 0xFF, usable);
    data_ = map_ + page_ + usable - slack - bytes;
    bytes_ = bytes;
    if (bytes > 0) std::memcpy(data_, user, bytes);
    user_ = user;
    readonly_ = readonly;
    argument_ = argument;
    type_ = std::move(type);
    return true;
  }

  void* data() const { return data_; }

  // Whether `address` lies in the caller's buffer this guards; if so, `offset` is its byte offset.
  bool holds(uint64_t address, uint64_t& offset) const {
    const auto user = reinterpret_cast<uintptr_t>(user_);
    if (address < user || address >= user + bytes_) return false;
    offset = address - user;
    return true;
  }
  size_t bytes() const { return bytes_; }
  bool readonly() const { return readonly_; }
  unsigned argument() const { return argument_; }
  const std::string& type() const { return type_; }

  // If `addr` lies in one of the guard pages, says where it is relative to the argument.
  bool explain(const void* addr, std::string& what) const {
    const auto a = reinterpret_cast<uintptr_t>(addr);
    const auto map = reinterpret_cast<uintptr_t>(map_);
    const bool before = a >= map && a < map + page_;
    const bool after = a >= map + map_len_ - page_ && a < map + map_len_;
    if (!before && !after) return false;
    what = describe_offset(static_cast<long long>(a - reinterpret_cast<uintptr_t>(data_)));
    return true;
  }

  // Hands the results back to the caller; "" or what went wrong.
  std::string finish() const {
    for (const unsigned char* b = map_ + page_; b < map_ + map_len_ - page_; ++b) {
      if (b == data_) b += bytes_;  // only the padding around the data must still hold 0xFF
      if (b < map_ + map_len_ - page_ && *b != 0xFF)
        return "the kernel wrote to " + describe_offset(static_cast<long long>(b - data_));
    }
    if (readonly_) {
      for (size_t i = 0; i < bytes_; ++i)
        if (data_[i] != static_cast<const unsigned char*>(user_)[i])
          return format("the kernel wrote to argument %u (%s), a read-only buffer (first change at byte %zu)",
                        argument_, type_.c_str(), i);
      return "";
    }
    if (bytes_ > 0) std::memcpy(user_, data_, bytes_);
    return "";
  }

 private:
  // "byte 400 of argument 0 (const float32*, 400 bytes), past its end"
  std::string describe_offset(long long offset) const {
    const char* where = offset < 0 ? "before its start" : "past its end";
    return format("byte %lld of argument %u (%s, %zu bytes), %s", offset, argument_, type_.c_str(), bytes_, where);
  }

  unsigned char* map_ = nullptr;
  size_t map_len_ = 0;
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0;
  size_t page_ = 4096;
  void* user_ = nullptr;
  bool readonly_ = false;
  unsigned argument_ = 0;
  std::string type_;
};

// ============================================================================ faults

// SIGABRT covers a glibc assert() that a kernel re-enabled by including <cassert> after the prelude.
constexpr int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

struct FaultTrap {
  sigjmp_buf jump;
  pthread_t thread;
  volatile sig_atomic_t armed = 0;
  int signal = 0;
  void* address = nullptr;
};

FaultTrap* g_fault_trap = nullptr;
struct sigaction g_previous_actions[NSIG];

void on_fault_signal(int sig, siginfo_t* info, void* context) {
  FaultTrap* trap = g_fault_trap;
  if (trap != nullptr && trap->armed && pthread_equal(trap->thread, pthread_self())) {
    trap->armed = 0;
    trap->signal = sig;
    trap->address = info->si_addr;
    siglongjmp(trap->jump, 1);
  }
  // Not raised by an emulated kernel: behave as if this handler had never been installed.
  const struct sigaction& previous = g_previous_actions[sig];
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler == SIG_DFL) {
    sigaction(sig, &previous, nullptr);  // the faulting instruction re-executes under the default action
  } else if (previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  }
}

// Puts on_fault_signal first in line for the fault signals, once per loaded module: each module
// chains to whatever was installed before it, so modules and Python's faulthandler stack up
// without ever forming a cycle.  Called with g_launch_mutex held.
void install_fault_handlers() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  for (int sig : kFaultSignals) {
    struct sigaction mine;
    std::memset(&mine, 0, sizeof(mine));
    mine.sa_sigaction = &on_fault_signal;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&mine.sa_mask);
    sigaction(sig, &mine, &g_previous_actions[sig]);
  }
}

// An alternate signal stack for the calling thread while a launch runs: a fiber that overflows
// its stack cannot run the handler on it.
class AltSignalStack {
 public:
  AltSignalStack() : memory_(kBytes) {
    stack_t mine;
    mine.ss_sp = memory_.data();
    mine.ss_size = memory_.size();
    mine.ss_flags = 0;
    sigaltstack(&mine, &previous_);
  }
  ~AltSignalStack() {
    if (previous_.ss_flags & SS_DISABLE) {
      stack_t off;
      std::memset(&off, 0, sizeof(off));
      off.ss_flags = SS_DISABLE;
      sigaltstack(&off, nullptr);
    } else {
      sigaltstack(&previous_, nullptr);
    }
  }
  AltSignalStack(const AltSignalStack&) = delete;
  AltSignalStack& operator=(const AltSignalStack&) = delete;

 private:
  static constexpr size_t kBytes = 256 * 1024;
  std::vector<unsigned char> memory_;
  stack_t previous_;
};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "segmentation fault";
    case SIGBUS: return "bus error";
    case SIGFPE: return "arithmetic exception (integer division by zero?)";
    case SIGILL: return "illegal instruction (a trap)";
    case SIGABRT: return "abort (a failed host assert?)";
    default: return "signal";
  }
}

// The block that ran last (g_launch) is the one that faulted: blocks of a cluster run one at a time.
std::string describe_fault(const LaunchState& launch, const FaultTrap& trap,
                           const std::vector<GuardedBuffer>& guards) {
  std::string where = launch.current != nullptr
                          ? describe_block(launch.block_index) + ", " + describe_thread(*launch.current)
                          : describe_block(launch.block_index) + ", in the emulator itself";
  const long stack = launch.stacks.guard_owner(trap.address);
  if (stack >= 0)
    return where + format(": stack overflow (the fiber stack has %zu bytes; raise stack_bytes)",
                          launch.stacks.stack_bytes());
  if (trap.signal != SIGSEGV && trap.signal != SIGBUS) return where + ": " + signal_name(trap.signal);
  std::string detail;
  for (const GuardedBuffer& g : guards)
    if (g.explain(trap.address, detail)) break;
  where += format(": %s at address %p", signal_name(trap.signal), trap.address);
  return detail.empty() ? where : where + ", " + detail;
}

// Serialises launches: the emulated threads share the globals threadIdx, g_launch, ...
std::mutex g_launch_mutex;

// Runs the grid with faults turned into errors.
LaunchResult run_protected(ClusterState& cluster, const std::vector<GuardedBuffer>& guards) {
  FaultTrap trap;
  trap.thread = pthread_self();
  AltSignalStack alt_stack;
  install_fault_handlers();
  g_fault_trap = &trap;
  g_launch = cluster.ctas.front().get();
  LaunchResult result;
  if (sigsetjmp(trap.jump, 1) == 0) {
    trap.armed = 1;
    const bool ok = run_grid(cluster);
    trap.armed = 0;
    if (!ok) result = LaunchResult{Status::kKernelError, cluster.message};
  } else {
    result = LaunchResult{Status::kFault, describe_fault(*g_launch, trap, guards)};
  }
  g_fault_trap = nullptr;
  g_launch = nullptr;
  return result;
}

std::string check_configuration(const dim3& grid, const dim3& block, size_t smem, const LaunchOptions& o) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0)
    return "grid and block dimensions must be positive";
  if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u)
    return format("grid (%u,%u,%u) exceeds the limits (2^31-1, 65535, 65535)", grid.x, grid.y, grid.z);
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (block.x > 1024 || block.y > 1024 || block.z > 64 || threads > 1024)
    return format("block (%u,%u,%u) exceeds the limits (1024 threads; x, y <= 1024; z <= 64)", block.x, block.y,
                  block.z);
  if (smem > o.max_dynamic_smem)
    return format("%zu bytes of dynamic shared memory exceed the limit of %zu", smem, o.max_dynamic_smem);
  if (o.stack_bytes < 16 * 1024) return format("stack_bytes %zu is below the minimum of 16384", o.stack_bytes);
  return "";
}

// Cluster dims by kernel address (see the top of this file).
std::map<const void*, dim3>& cluster_registry() {
  static std::map<const void*, dim3> registry;
  return registry;
}
std::mutex g_cluster_registry_mutex;

// The blocks per cluster of a launch of `kernel` over `grid` (1 without registered dims) in `size`;
// "" or why the launch is invalid.
std::string cluster_size_of(const void* kernel, const dim3& grid, unsigned& size) {
  std::lock_guard<std::mutex> lock(g_cluster_registry_mutex);
  size = 1;
  const auto it = cluster_registry().find(kernel);
  if (it == cluster_registry().end()) return "";
  const dim3& d = it->second;
  if (d.y != 1 || d.z != 1)
    return format("the kernel declares cluster dims (%u,%u,%u): the emulator supports clusters along x only (y and z "
                  "must be 1)",
                  d.x, d.y, d.z);
  if (d.x == 0 || d.x > 8)
    return format("the kernel declares cluster dims (%u,%u,%u): a cluster has 1 to 8 blocks (the portable cluster "
                  "size)",
                  d.x, d.y, d.z);
  if (grid.x % d.x != 0)
    return format("grid (%u,%u,%u) is not a whole number of clusters: the kernel declares cluster dims (%u,1,1), so "
                  "grid.x must be a multiple of %u (the GPU refuses the launch: cudaErrorInvalidClusterSize)",
                  grid.x, grid.y, grid.z, d.x, d.x);
  size = d.x;
  return "";
}

// Moves each tensor map whose base lies in a guarded buffer onto that buffer's copy, after checking
// that everything it covers lies in the buffer; "" or what is wrong.
std::string relocate_tensor_maps(const std::vector<TensorMapArgument>& maps, const std::vector<GuardedBuffer>& guards) {
  for (const TensorMapArgument& a : maps) {
    TensorMapFields f;
    if (!tensor_map_fields(*a.map, f))
      return format("argument %u (tensormap) was not encoded by welder_encode_tensor_map", a.index);
    for (const GuardedBuffer& g : guards) {
      uint64_t offset = 0;
      if (!g.holds(f.base, offset)) continue;
      const uint64_t extent = tensor_map_extent(f);
      if (offset + extent > g.bytes())
        return format("argument %u (tensormap: %s) covers bytes [%llu, %llu) of argument %u (%s, %zu bytes), past "
                      "its end",
                      a.index, describe_tensor_map(f).c_str(), static_cast<unsigned long long>(offset),
                      static_cast<unsigned long long>(offset + extent), g.argument(), g.type().c_str(), g.bytes());
      f.base = reinterpret_cast<uintptr_t>(g.data()) + offset;
      set_tensor_map_fields(*a.map, f);
      break;
    }
  }
  return "";
}

}  // namespace

bool register_cluster_dims(const void* kernel, unsigned x, unsigned y, unsigned z) {
  std::lock_guard<std::mutex> lock(g_cluster_registry_mutex);
  cluster_registry()[kernel] = dim3(x, y, z);
  return true;
}

LaunchResult run_launch(const void* kernel, const dim3& grid, const dim3& block, size_t dynamic_smem_bytes,
                        const LaunchOptions& options, KernelInvoker invoke, void* context,
                        const std::vector<PointerArgument>& pointers, const std::vector<TensorMapArgument>& maps) {
  std::string error = check_configuration(grid, block, dynamic_smem_bytes, options);
  unsigned cluster_size = 1;
  if (error.empty()) error = cluster_size_of(kernel, grid, cluster_size);
  if (!error.empty()) return LaunchResult{Status::kInvalidLaunch, error};
  std::lock_guard<std::mutex> lock(g_launch_mutex);

  std::vector<GuardedBuffer> guards;
  for (const PointerArgument& p : pointers) {
    void* user;
    std::memcpy(&user, p.slot, sizeof(user));
    if (options.arg_bytes == nullptr || options.arg_bytes[p.index] == kNoGuard || user == nullptr) continue;
    const bool readonly = options.arg_readonly != nullptr && options.arg_readonly[p.index] != 0;
    GuardedBuffer g;
    if (!g.create(user, options.arg_bytes[p.index], readonly, p.index, p.type))
      return LaunchResult{Status::kInvalidLaunch, format("cannot map a guarded copy of argument %u (%zu bytes)",
                                                         p.index, options.arg_bytes[p.index])};
    void* copy = g.data();
    std::memcpy(p.slot, &copy, sizeof(copy));
    guards.push_back(std::move(g));
  }

  error = relocate_tensor_maps(maps, guards);
  if (!error.empty()) return LaunchResult{Status::kInvalidLaunch, error};

  ClusterState cluster;
  for (const GuardedBuffer& g : guards)
    cluster.arguments.push_back(ArgumentBuffer{reinterpret_cast<uintptr_t>(g.data()), g.bytes(), g.argument(),
                                               g.type(), g.readonly()});
  for (unsigned rank = 0; rank < cluster_size; ++rank) {
    auto state = std::make_unique<LaunchState>();
    state->grid = grid;
    state->block = block;
    state->smem_bytes = dynamic_smem_bytes;
    state->check_races = options.check_races;
    state->invoke = invoke;
    state->invoke_context = context;
    state->cluster = &cluster;
    state->rank = rank;
    error = prepare_launch(*state, options.stack_bytes);
    if (!error.empty()) return LaunchResult{Status::kInvalidLaunch, error};
    cluster.ctas.push_back(std::move(state));
  }

  LaunchResult result = run_protected(cluster, guards);
  std::fflush(stdout);  // device printf output appears before the caller continues
  for (const GuardedBuffer& g : guards) {
    const std::string problem = g.finish();
    if (result.ok() && !problem.empty()) result = LaunchResult{Status::kKernelError, problem};
  }
  return result;
}

LaunchOptions options_from(const welder_emu_launch_params& p, std::vector<size_t>& bytes) {
  bytes.assign(static_cast<size_t>(p.nargs) + 1, kNoGuard);
  for (int i = 0; i < p.nargs && p.arg_bytes != nullptr; ++i)
    bytes[static_cast<size_t>(i)] = p.arg_bytes[i] == ~0ull ? kNoGuard : static_cast<size_t>(p.arg_bytes[i]);
  LaunchOptions options;
  options.stack_bytes = static_cast<size_t>(p.stack_bytes);
  options.check_races = p.check_races != 0;
  options.arg_bytes = bytes.data();
  options.arg_readonly = p.arg_readonly;
  return options;
}

int report(const LaunchResult& result, char* message, size_t capacity) {
  if (message != nullptr && capacity > 0) std::snprintf(message, capacity, "%s", result.message.c_str());
  return static_cast<int>(result.status);
}

}  // namespace welder_emu::detail
