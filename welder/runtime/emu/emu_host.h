// The CUDA runtime's host API on the CPU, for running a generated standalone runtime
// (nnfusion_rt.cu) under the emulator instead of a GPU.
//
// Part of the CPU emulator (see cuda_emu.h), header-only, and not needed by kernels: it is for
// host code that allocates, copies, launches and times (the runtime's kernel files include it
// too, as the includes they share with nnfusion_rt.cu; its state is inline, one copy in the
// library however many files include it).  It covers the subset of the runtime API the
// runtime templates use, with the GPU's observable behaviour where it matters for catching
// host-side bugs:
//
//   * device memory is host memory; fresh allocations read as 0xFF bytes (NaN / -1), and every
//     copy is checked to lie inside one allocation on its device side;
//   * launches go through welder_emu::launch (every check of the emulator) and, when the caller
//     gives each pointer argument's size, on guarded copies of the arguments; a failed launch is
//     a sticky cudaErrorLaunchFailure whose cudaGetErrorString carries the emulator's message;
//   * work submitted to a stream runs at once, except while the stream is being captured:
//     captured work is recorded and runs each time the instantiated graph is launched, so a
//     replay computes on the buffers' current contents, as on the GPU;
//   * events read the wall clock, so timings measure the emulation itself.
//
// Kernels are launched with welder_emu_host::launch_kernel, which a runtime's launch macro
// expands to under WELDER_EMULATE.  Not thread-safe, like the runtime it serves.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "emu_launch.h"

// ============================================================================ types and codes

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureUnmatched = 903,
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

constexpr unsigned int cudaStreamDefault = 0x0;
constexpr unsigned int cudaStreamNonBlocking = 0x1;
constexpr unsigned int cudaEventDefault = 0x0;

namespace welder_emu_host {
// Work on a stream; returns the first error it meets.
using Operation = std::function<cudaError_t()>;
}  // namespace welder_emu_host

struct CUstream_st {
  bool capturing = false;
  std::vector<welder_emu_host::Operation> captured;
};
struct CUevent_st {
  bool recorded = false;
  std::chrono::steady_clock::time_point when;
};
struct CUgraph_st {
  std::vector<welder_emu_host::Operation> operations;
};
struct CUgraphExec_st {
  std::vector<welder_emu_host::Operation> operations;
};
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;
typedef CUgraph_st* cudaGraph_t;
typedef CUgraphExec_st* cudaGraphExec_t;

namespace welder_emu_host {

// ============================================================================ state

// Device allocations: start -> size.  Copies are checked against them.
inline std::map<const unsigned char*, size_t> g_allocations;
// The sticky error of a failed launch (cudaGetLastError returns and clears it), and for the
// latest failure of each kind, what went wrong in words.
inline cudaError_t g_sticky = cudaSuccess;
inline cudaError_t g_detail_code = cudaSuccess;
inline std::string g_detail;
inline std::string g_error_text;
// Largest dynamic shared memory a kernel may opt into (sm_90), as in LaunchOptions.
constexpr int kMaxDynamicSmem = 232448;

inline cudaError_t fail(cudaError_t code, std::string what) {
  g_detail_code = code;
  g_detail = std::move(what);
  return code;
}

// True if [p, p + bytes) lies inside one device allocation.
inline bool is_device_range(const void* p, size_t bytes) {
  const auto* q = static_cast<const unsigned char*>(p);
  auto it = g_allocations.upper_bound(q);
  if (it == g_allocations.begin()) return false;
  --it;
  return q >= it->first && q + bytes <= it->first + it->second;
}

// Runs `op` now, or records it if `stream` is being captured.
inline cudaError_t submit(cudaStream_t stream, Operation op) {
  if (stream != nullptr && stream->capturing) {
    stream->captured.push_back(std::move(op));
    return cudaSuccess;
  }
  return op();
}

inline cudaError_t run_all(const std::vector<Operation>& operations) {
  for (const Operation& op : operations) {
    const cudaError_t e = op();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

inline cudaError_t check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault)
    return fail(cudaErrorInvalidValue, "unknown cudaMemcpyKind " + std::to_string(static_cast<int>(kind)));
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return fail(cudaErrorInvalidValue, "a null pointer in a copy");
  if (dst_device && !is_device_range(dst, bytes))
    return fail(cudaErrorInvalidValue, "the copy's destination (" + std::to_string(bytes) +
                                           " bytes) does not lie inside one device allocation");
  if (src_device && !is_device_range(src, bytes))
    return fail(cudaErrorInvalidValue, "the copy's source (" + std::to_string(bytes) +
                                           " bytes) does not lie inside one device allocation");
  return cudaSuccess;
}

template <class Tuple, size_t... I>
std::vector<void*> argument_addresses(Tuple& values, std::index_sequence<I...>) {
  return {static_cast<void*>(&std::get<I>(values))...};
}

// Launches `kernel` on the emulator (see the top of this file).  `arg_bytes` / `arg_readonly`
// give, per parameter, the bytes behind a pointer argument (welder_emu::kNoGuard: unguarded) and
// whether the kernel must leave them unchanged; either may be null.
template <class... P, class... A>
void launch_kernel(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, const size_t* arg_bytes, const unsigned char* arg_readonly,
                   A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "the launch passes the wrong number of arguments");
  std::tuple<P...> values(static_cast<P>(std::forward<A>(args))...);
  const std::string label = name;
  const Operation op = [=]() mutable -> cudaError_t {
    std::vector<void*> addresses = argument_addresses(values, std::index_sequence_for<P...>{});
    welder_emu::LaunchOptions options;
    options.arg_bytes = arg_bytes;
    options.arg_readonly = arg_readonly;
    const welder_emu::LaunchResult result =
        welder_emu::launch(kernel, grid, block, smem_bytes, addresses.empty() ? nullptr : addresses.data(), options);
    if (result.ok()) return cudaSuccess;
    g_sticky = cudaErrorLaunchFailure;
    return fail(cudaErrorLaunchFailure, "kernel " + label + ": " + result.message);
  };
  if (submit(stream, op) != cudaSuccess) g_sticky = cudaErrorLaunchFailure;
}

}  // namespace welder_emu_host

// ============================================================================ errors

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
  }
  return "cudaErrorUnknown";
}

// CUDA's text for `e`, followed by what the emulator knows about the latest error of that code.
inline const char* cudaGetErrorString(cudaError_t e) {
  const char* text = "unknown error";
  switch (e) {
    case cudaSuccess: text = "no error"; break;
    case cudaErrorInvalidValue: text = "invalid argument"; break;
    case cudaErrorMemoryAllocation: text = "out of memory"; break;
    case cudaErrorInitializationError: text = "initialization error"; break;
    case cudaErrorInvalidConfiguration: text = "invalid configuration argument"; break;
    case cudaErrorInvalidDevicePointer: text = "invalid device pointer"; break;
    case cudaErrorInvalidResourceHandle: text = "invalid resource handle"; break;
    case cudaErrorNotReady: text = "device not ready"; break;
    case cudaErrorLaunchFailure: text = "unspecified launch failure"; break;
    case cudaErrorStreamCaptureUnsupported: text = "operation not permitted when stream is capturing"; break;
    case cudaErrorStreamCaptureInvalidated: text = "operation failed due to a previous error during capture"; break;
    case cudaErrorStreamCaptureUnmatched: text = "capture was not initiated in this stream"; break;
  }
  using namespace welder_emu_host;
  g_error_text = text;
  if (e != cudaSuccess && e == g_detail_code && !g_detail.empty()) g_error_text += " (emulator: " + g_detail + ")";
  return g_error_text.c_str();
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = welder_emu_host::g_sticky;
  welder_emu_host::g_sticky = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return welder_emu_host::g_sticky; }

// ============================================================================ device and memory

inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : welder_emu_host::fail(cudaErrorInvalidValue, "the emulator has device 0 only");
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// The emulator runs sm_90's instructions (wgmma, TMA, clusters): it answers as a 9.0 device.
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrComputeCapabilityMinor = 76 };
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return welder_emu_host::fail(cudaErrorInvalidValue, "the emulator has device 0 only");
  *value = attribute == cudaDevAttrComputeCapabilityMajor ? 9 : 0;
  return cudaSuccess;
}

inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  using namespace welder_emu_host;
  const size_t rounded = (bytes + 255) / 256 * 256 + (bytes == 0 ? 256 : 0);
  void* memory = std::aligned_alloc(256, rounded);
  if (memory == nullptr) return fail(cudaErrorMemoryAllocation, "cannot allocate " + std::to_string(bytes) + " bytes");
  std::memset(memory, 0xFF, rounded);  // like uninitialised device memory, but visible when read
  g_allocations[static_cast<unsigned char*>(memory)] = bytes;
  *p = memory;
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}

inline cudaError_t cudaFree(void* p) {
  using namespace welder_emu_host;
  if (p == nullptr) return cudaSuccess;
  const auto it = g_allocations.find(static_cast<unsigned char*>(p));
  if (it == g_allocations.end())
    return fail(cudaErrorInvalidDevicePointer, "cudaFree of a pointer cudaMalloc did not return");
  g_allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t e = welder_emu_host::check_copy(dst, src, bytes, kind);
  if (e == cudaSuccess && bytes > 0) std::memmove(dst, src, bytes);
  return e;
}

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
  const cudaError_t e = welder_emu_host::check_copy(dst, src, bytes, kind);
  if (e != cudaSuccess) return e;
  return welder_emu_host::submit(stream, [=]() {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return cudaSuccess;
  });
}

inline cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (bytes > 0 && !welder_emu_host::is_device_range(p, bytes))
    return welder_emu_host::fail(cudaErrorInvalidValue, "cudaMemset outside a device allocation");
  if (bytes > 0) std::memset(p, value, bytes);
  return cudaSuccess;
}

inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr) {
  if (bytes > 0 && !welder_emu_host::is_device_range(p, bytes))
    return welder_emu_host::fail(cudaErrorInvalidValue, "cudaMemsetAsync outside a device allocation");
  return welder_emu_host::submit(stream, [=]() {
    if (bytes > 0) std::memset(p, value, bytes);
    return cudaSuccess;
  });
}

// Opting in to more than 48 KiB of dynamic shared memory: only the limit is checked.
template <class F>
cudaError_t cudaFuncSetAttribute(F* /*kernel*/, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize && (value < 0 || value > welder_emu_host::kMaxDynamicSmem))
    return welder_emu_host::fail(cudaErrorInvalidValue, "dynamic shared memory of " + std::to_string(value) +
                                                            " bytes exceeds the limit");
  return cudaSuccess;
}

// ============================================================================ streams and events

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int /*flags*/) {
  *stream = new CUstream_st();
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return welder_emu_host::fail(cudaErrorInvalidResourceHandle, "destroying the null stream");
  delete stream;
  return cudaSuccess;
}

inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (stream != nullptr && stream->capturing)
    return welder_emu_host::fail(cudaErrorStreamCaptureUnsupported, "synchronizing a stream that is being captured");
  return cudaSuccess;
}

inline cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st();
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) { return cudaEventCreate(event); }

inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
  if (event == nullptr) return welder_emu_host::fail(cudaErrorInvalidResourceHandle, "recording a null event");
  return welder_emu_host::submit(stream, [event]() {
    event->recorded = true;
    event->when = std::chrono::steady_clock::now();
    return cudaSuccess;
  });
}

inline cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event != nullptr ? cudaSuccess : welder_emu_host::fail(cudaErrorInvalidResourceHandle, "a null event");
}

inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop) {
  if (start == nullptr || stop == nullptr || !start->recorded || !stop->recorded)
    return welder_emu_host::fail(cudaErrorInvalidResourceHandle, "elapsed time between events not both recorded");
  *ms = std::chrono::duration<float, std::milli>(stop->when - start->when).count();
  return cudaSuccess;
}

// ============================================================================ graphs

inline cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode /*mode*/) {
  if (stream == nullptr)
    return welder_emu_host::fail(cudaErrorStreamCaptureUnsupported, "the legacy null stream cannot be captured");
  if (stream->capturing) return welder_emu_host::fail(cudaErrorInvalidValue, "the stream is already capturing");
  stream->capturing = true;
  stream->captured.clear();
  return cudaSuccess;
}

inline cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (stream == nullptr || !stream->capturing)
    return welder_emu_host::fail(cudaErrorStreamCaptureUnmatched, "ending a capture that was not begun");
  stream->capturing = false;
  *graph = new CUgraph_st{std::move(stream->captured)};
  stream->captured.clear();
  return cudaSuccess;
}

inline cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph,
                                                 unsigned long long /*flags*/ = 0) {
  if (graph == nullptr) return welder_emu_host::fail(cudaErrorInvalidValue, "instantiating a null graph");
  *exec = new CUgraphExec_st{graph->operations};
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0) {
  return cudaGraphInstantiateWithFlags(exec, graph, flags);
}

inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return welder_emu_host::fail(cudaErrorInvalidResourceHandle, "launching a null graph");
  const std::vector<welder_emu_host::Operation> operations = exec->operations;
  return welder_emu_host::submit(stream, [operations]() { return welder_emu_host::run_all(operations); });
}

inline cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
