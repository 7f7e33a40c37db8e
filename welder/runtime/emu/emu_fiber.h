// Cooperative fibers for the CPU emulator: one execution context per emulated CUDA thread.
//
// On x86-64 a context switch is a dozen instructions (below); elsewhere, or with
// -DWELDER_EMU_USE_UCONTEXT, it falls back to swapcontext, which is correct but makes a system call
// per switch.  Stacks come from one mmap per launch, each with a PROT_NONE guard region below it so
// that an overflow faults (and is reported) instead of corrupting the neighbouring fiber; the
// driver also compiles with -fstack-clash-protection so that large frames cannot jump the guard.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && !defined(WELDER_EMU_USE_UCONTEXT)
#define WELDER_EMU_ASM_SWITCH 1
#else
#define WELDER_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

namespace welder_emu::detail {

using FiberEntry = void (*)(void*);

// Where a suspended context resumes.
struct Context {
#if WELDER_EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

#if WELDER_EMU_ASM_SWITCH

// switch_stack(save, load): pushes the callee-saved registers plus the SSE and x87 control words
// (callee-saved in the SysV ABI) on the current stack, stores the stack pointer in *save, adopts
// `load` as the stack pointer and pops the same frame from there.  Everything else is
// caller-saved, so the compiler already treats this like any opaque call.
__attribute__((naked, noinline)) static void switch_stack(void** /*save*/, void* /*load*/) {
  __asm__(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

// First code a new fiber runs: the hand-made frame left the argument in r12 and the entry point in
// r13.  The entry never returns (a finished fiber switches away for good).
__attribute__((naked, noinline)) static void fiber_trampoline() {
  __asm__(
      "movq %r12, %rdi\n\t"
      "callq *%r13\n\t"
      "ud2\n\t");
}

// Prepares `c` so that switching to it calls entry(arg) on the given stack.
inline void context_init(Context& c, unsigned char* stack_lo, size_t size, FiberEntry entry, void* arg) {
  // After switch_stack pops the frame, `ret` jumps to the trampoline with rsp == top, 16-byte
  // aligned, so the trampoline's call gives the entry the alignment the ABI promises.
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t{15};
  void** sp = reinterpret_cast<void**>(top);
  *--sp = reinterpret_cast<void*>(&fiber_trampoline);  // return address of switch_stack
  *--sp = nullptr;                                       // rbp
  *--sp = nullptr;                                       // rbx
  *--sp = arg;                                           // r12
  *--sp = reinterpret_cast<void*>(entry);                // r13
  *--sp = nullptr;                                       // r14
  *--sp = nullptr;                                       // r15
  --sp;                                                  // mxcsr (4 bytes) and x87 control word
  uint32_t mxcsr;
  uint16_t fpu_control;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpu_control));
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<unsigned char*>(sp) + 4, &fpu_control, 2);
  c.sp = sp;
}

inline void context_switch(Context& from, const Context& to) { switch_stack(&from.sp, to.sp); }

#else  // ucontext fallback

// makecontext passes int arguments only, so the two pointers travel as 32-bit halves.
inline void ucontext_entry(unsigned entry_hi, unsigned entry_lo, unsigned arg_hi, unsigned arg_lo) {
  const auto join = [](unsigned hi, unsigned lo) { return (static_cast<uintptr_t>(hi) << 32) | lo; };
  const auto entry = reinterpret_cast<FiberEntry>(join(entry_hi, entry_lo));
  entry(reinterpret_cast<void*>(join(arg_hi, arg_lo)));
  __builtin_trap();  // entries never return
}

inline void context_init(Context& c, unsigned char* stack_lo, size_t size, FiberEntry entry, void* arg) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack_lo;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  const auto e = reinterpret_cast<uintptr_t>(entry);
  const auto a = reinterpret_cast<uintptr_t>(arg);
  makecontext(&c.uc, reinterpret_cast<void (*)()>(&ucontext_entry), 4, static_cast<unsigned>(e >> 32),
              static_cast<unsigned>(e), static_cast<unsigned>(a >> 32), static_cast<unsigned>(a));
}

inline void context_switch(Context& from, const Context& to) { swapcontext(&from.uc, &to.uc); }

#endif

// One mmap holding `count` stacks, each preceded (at its low end) by a guard region.
class StackPool {
 public:
  StackPool() = default;
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  ~StackPool() { release(); }

  // Returns false when the memory cannot be mapped.
  bool allocate(unsigned count, size_t stack_bytes) {
    release();
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    guard_ = 16 * page_;
    stack_bytes_ = (stack_bytes + page_ - 1) / page_ * page_;
    slot_ = stack_bytes_ + guard_;
    total_ = slot_ * count;
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      base_ = nullptr;
      return false;
    }
    base_ = static_cast<unsigned char*>(p);
    for (unsigned i = 0; i < count; ++i) mprotect(base_ + i * slot_, guard_, PROT_NONE);
    return true;
  }

  unsigned char* stack_lo(unsigned i) const { return base_ + i * slot_ + guard_; }
  size_t stack_bytes() const { return stack_bytes_; }

  // Index of the stack whose guard region contains `addr`, or -1.
  long guard_owner(const void* addr) const {
    const auto a = reinterpret_cast<uintptr_t>(addr);
    const auto b = reinterpret_cast<uintptr_t>(base_);
    if (base_ == nullptr || a < b || a >= b + total_) return -1;
    const size_t slot = (a - b) / slot_;
    return (a - b) % slot_ < guard_ ? static_cast<long>(slot) : -1;
  }

 private:
  void release() {
    if (base_ != nullptr) munmap(base_, total_);
    base_ = nullptr;
  }

  unsigned char* base_ = nullptr;
  size_t page_ = 4096, guard_ = 0, stack_bytes_ = 0, slot_ = 0, total_ = 0;
};

}  // namespace welder_emu::detail
