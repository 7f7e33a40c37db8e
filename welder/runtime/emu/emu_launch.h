// Kernel launch for the CPU emulator, and the C entry points the Python driver calls.
//
// welder_emu::launch(kernel, grid, block, smem_bytes, args[, options]) mirrors cudaLaunchKernel:
// args[i] points to the value of parameter i, whose type is deduced from the kernel.  It returns a
// LaunchResult instead of aborting: an error inside the kernel (a failed check, a deadlock, a
// memory fault, an assertion) stops the launch and is described in the message.  The work is done
// by run_launch in emu_launch.cpp; see there for guarded argument buffers and fault handling.
// A CUtensorMap parameter (emu_tensor_map.h) travels by value like any other; its signature name
// is "tensormap".  A kernel declared with WELDER_CLUSTER_DIMS (emu_cluster.h) runs in clusters of
// that many blocks, looked up here by the kernel's address, so every caller gets them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_half.h"
#include "emu_bf16.h"
#include "emu_runtime.h"
#include "emu_tensor_map.h"
#include "emu_types.h"

namespace welder_emu {

// In LaunchOptions::arg_bytes: a pointer argument that is passed through unguarded.
constexpr size_t kNoGuard = SIZE_MAX;

struct LaunchOptions {
  size_t stack_bytes = 256 * 1024;   // per emulated thread; register arrays live here
  size_t max_dynamic_smem = 232448;  // 227 KiB: the largest opt-in size (sm_90)
  bool check_races = true;           // shadow-state race detection on shared views
  // Optional, one entry per kernel parameter: the bytes behind a pointer argument (kNoGuard: not
  // guarded), and whether the caller's buffer must come back unchanged.
  const size_t* arg_bytes = nullptr;
  const unsigned char* arg_readonly = nullptr;
};

enum class Status : int { kOk = 0, kInvalidLaunch = 1, kKernelError = 2, kFault = 3 };

struct LaunchResult {
  Status status = Status::kOk;
  std::string message;
  bool ok() const { return status == Status::kOk; }
};

namespace detail {

// Names the Python driver matches numpy dtypes against; "?" for anything else.
template <class T>
constexpr const char* type_name() {
  using U = typename std::remove_cv<T>::type;
  if constexpr (std::is_same<U, float>::value) return "float32";
  else if constexpr (std::is_same<U, double>::value) return "float64";
  else if constexpr (std::is_same<U, __half>::value) return "float16";
  else if constexpr (std::is_same<U, __nv_bfloat16>::value) return "bfloat16";
  else if constexpr (std::is_same<U, bool>::value) return "bool";
  else if constexpr (std::is_integral<U>::value && sizeof(U) == 1) return std::is_signed<U>::value ? "int8" : "uint8";
  else if constexpr (std::is_integral<U>::value && sizeof(U) == 2) return std::is_signed<U>::value ? "int16" : "uint16";
  else if constexpr (std::is_integral<U>::value && sizeof(U) == 4) return std::is_signed<U>::value ? "int32" : "uint32";
  else if constexpr (std::is_integral<U>::value && sizeof(U) == 8) return std::is_signed<U>::value ? "int64" : "uint64";
  else if constexpr (std::is_same<U, __half2>::value) return "half2";
  else if constexpr (std::is_same<U, __nv_bfloat162>::value) return "bfloat162";
  else if constexpr (std::is_same<U, float2>::value) return "float2";
  else if constexpr (std::is_same<U, float4>::value) return "float4";
  else if constexpr (std::is_same<U, double2>::value) return "double2";
  else if constexpr (std::is_same<U, int2>::value) return "int2";
  else if constexpr (std::is_same<U, int4>::value) return "int4";
  else if constexpr (std::is_same<U, uint2>::value) return "uint2";
  else if constexpr (std::is_same<U, uint4>::value) return "uint4";
  else if constexpr (std::is_same<U, char4>::value) return "char4";
  else if constexpr (std::is_same<U, uchar4>::value) return "uchar4";
  else if constexpr (std::is_same<U, CUtensorMap>::value) return "tensormap";
  else return "?";
}

// "const float32*", "int32", ...
template <class P>
std::string parameter_name() {
  if constexpr (std::is_pointer<P>::value) {
    using E = typename std::remove_pointer<P>::type;
    return std::string(std::is_const<E>::value ? "const " : "") + type_name<E>() + "*";
  } else {
    return type_name<P>();
  }
}

// A pointer parameter inside the argument tuple; run_launch may redirect it to a guarded copy.
struct PointerArgument {
  void* slot;  // the pointer object in the tuple (all object pointers share one representation)
  unsigned index;
  std::string type;
};

// A CUtensorMap parameter inside the argument tuple; run_launch moves its base onto the guarded
// copy of the buffer it points into.
struct TensorMapArgument {
  CUtensorMap* map;
  unsigned index;
};

template <class Tuple, size_t... I>
std::vector<TensorMapArgument> tensor_map_arguments(Tuple& values, std::index_sequence<I...>) {
  std::vector<TensorMapArgument> maps;
  const auto add = [&maps](auto& value, unsigned index) {
    using P = std::remove_cv_t<std::remove_reference_t<decltype(value)>>;
    if constexpr (std::is_same<P, CUtensorMap>::value) maps.push_back({const_cast<CUtensorMap*>(&value), index});
  };
  (add(std::get<I>(values), static_cast<unsigned>(I)), ...);
  return maps;
}

template <class Tuple, size_t... I>
Tuple read_arguments(void** args, std::index_sequence<I...>) {
  return Tuple(*static_cast<typename std::tuple_element<I, Tuple>::type*>(args[I])...);
}

template <class Tuple, size_t... I>
std::vector<PointerArgument> pointer_arguments(Tuple& values, std::index_sequence<I...>) {
  std::vector<PointerArgument> pointers;
  const auto add = [&pointers](auto& value, unsigned index) {
    using P = std::remove_reference_t<decltype(value)>;
    if constexpr (std::is_pointer<P>::value)
      pointers.push_back({static_cast<void*>(&value), index, parameter_name<P>()});
  };
  (add(std::get<I>(values), static_cast<unsigned>(I)), ...);
  return pointers;
}

// Records the cluster dims `kernel` is declared with; WELDER_CLUSTER_DIMS calls it from a static
// initialiser of the kernel's module.  Launches check them (emu_launch.cpp).
bool register_cluster_dims(const void* kernel, unsigned x, unsigned y = 1, unsigned z = 1);

// Checks the configuration (cluster dims registered for `kernel` included), guards the pointer
// arguments, runs every cluster of blocks with faults turned into errors, and hands the guarded
// buffers back (emu_launch.cpp).
LaunchResult run_launch(const void* kernel, const dim3& grid, const dim3& block, size_t dynamic_smem_bytes,
                        const LaunchOptions& options, KernelInvoker invoke, void* context,
                        const std::vector<PointerArgument>& pointers, const std::vector<TensorMapArgument>& maps);

}  // namespace detail

// Launches `kernel` on the emulator and waits for it; see the top of this file.
template <class... P>
LaunchResult launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_smem_bytes, void** args,
                    const LaunchOptions& options = LaunchOptions()) {
  using Tuple = std::tuple<P...>;
  using Indices = std::index_sequence_for<P...>;
  if (sizeof...(P) > 0 && args == nullptr)
    return LaunchResult{Status::kInvalidLaunch, "args is null but the kernel takes parameters"};
  Tuple values = detail::read_arguments<Tuple>(args, Indices{});
  // What each fiber runs: the kernel on (its own copies of) the arguments.
  struct Call {
    void (*kernel)(P...);
    Tuple* values;
  } call{kernel, &values};
  const detail::KernelInvoker invoke = [](void* context) {
    Call* c = static_cast<Call*>(context);
    std::apply(c->kernel, *c->values);
  };
  return detail::run_launch(reinterpret_cast<const void*>(kernel), grid, block, dynamic_smem_bytes, options, invoke,
                            &call, detail::pointer_arguments(values, Indices{}),
                            detail::tensor_map_arguments(values, Indices{}));
}

// "const float32*,int32,..." for the Python driver.
template <class... P>
const char* signature_of(void (*)(P...)) {
  static const std::string signature = [] {
    std::string s;
    ((s += (s.empty() ? "" : ",") + detail::parameter_name<P>()), ...);
    return s;
  }();
  return signature.c_str();
}

}  // namespace welder_emu

// ============================================================================ C interface
#define WELDER_EMU_ABI_VERSION 1

extern "C" {
// One launch request from the Python driver (emulator.py mirrors this layout).
struct welder_emu_launch_params {
  unsigned int grid[3];
  unsigned int block[3];
  unsigned long long smem_bytes;
  unsigned long long stack_bytes;
  int check_races;
  int nargs;
  void** args;
  const unsigned long long* arg_bytes;  // ~0ull: not guarded
  const unsigned char* arg_readonly;
};
}

namespace welder_emu {

namespace detail {
// Fills LaunchOptions from `p`; `bytes` receives the converted per-argument sizes.
LaunchOptions options_from(const welder_emu_launch_params& p, std::vector<size_t>& bytes);
// Copies `result.message` into the caller's buffer and returns the status code.
int report(const LaunchResult& result, char* message, size_t capacity);
}  // namespace detail

// Runs the launch `p` describes; returns the Status code and writes the message into `message`.
template <class... P>
int c_launch(void (*kernel)(P...), const welder_emu_launch_params* p, char* message, size_t capacity) {
  if (p->nargs != static_cast<int>(sizeof...(P))) {
    const std::string what = detail::format("the kernel takes %zu arguments, %d were given", sizeof...(P), p->nargs);
    return detail::report(LaunchResult{Status::kInvalidLaunch, what}, message, capacity);
  }
  std::vector<size_t> bytes;
  const LaunchOptions options = detail::options_from(*p, bytes);
  const LaunchResult result =
      launch(kernel, dim3(p->grid[0], p->grid[1], p->grid[2]), dim3(p->block[0], p->block[1], p->block[2]),
             static_cast<size_t>(p->smem_bytes), p->args, options);
  return detail::report(result, message, capacity);
}

}  // namespace welder_emu
