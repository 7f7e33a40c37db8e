// Tensor maps for the CPU emulator: CUtensorMap, its encode (welder_encode_tensor_map, the host API
// of codegen_templates/welder_tma.cuh), and __grid_constant__.
//
// On the GPU a CUtensorMap is an opaque 128-byte, 64-byte-aligned object that the driver fills in
// (cuTensorMapEncodeTiled) and the copy engine reads.  Here it is a struct of the same size and
// alignment holding what the encode was given (TensorMapFields), tagged so that a map that was
// never encoded is reported.  The encode checks its arguments with the same rules as the GPU's
// (welder_tensor_map.cuh) and returns the same nonzero codes.
//
// A map passed as a kernel parameter (`const __grid_constant__ CUtensorMap name`) reaches the
// kernel by value.  When the launch guards the buffer the map's base points into (emu_launch.cpp),
// the map is moved onto the guarded copy and its whole extent must lie inside that buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "welder_tensor_map.cuh"

struct alignas(64) CUtensorMap {
  unsigned char opaque[128];
};

// A kernel parameter qualifier under nvcc; kernels here get their parameters by value anyway.
#define __grid_constant__

namespace welder_emu::detail {

constexpr uint32_t kTensorMapTag = 0x574D4150u;  // "WMAP": set by a successful encode

// What a CUtensorMap holds here (memcpy'd in and out of its bytes).
struct TensorMapFields {
  uint32_t tag;
  uint32_t rank;
  uint32_t elem_bytes;
  uint32_t swizzle;     // bytes: 0, 32, 64, 128
  uint64_t base;        // global address of element (0, ..., 0)
  uint64_t dims[5];     // elements, innermost first
  uint64_t strides[5];  // bytes; strides[0] is the element size
  uint32_t box[5];
};
static_assert(sizeof(TensorMapFields) <= sizeof(CUtensorMap), "the fields fit a CUtensorMap");

// The fields of `map`; false (fields unspecified) when it was not encoded by the emulator.
inline bool tensor_map_fields(const CUtensorMap& map, TensorMapFields& f) {
  std::memcpy(&f, map.opaque, sizeof(f));
  return f.tag == kTensorMapTag && f.rank >= 1 && f.rank <= 5;
}

inline void set_tensor_map_fields(CUtensorMap& map, const TensorMapFields& f) {
  std::memset(map.opaque, 0, sizeof(map.opaque));
  std::memcpy(map.opaque, &f, sizeof(f));
}

// Bytes from the base to one past the last element the map covers.
inline uint64_t tensor_map_extent(const TensorMapFields& f) {
  uint64_t last = 0;
  for (uint32_t i = 0; i < f.rank; ++i) last += (f.dims[i] - 1) * f.strides[i];
  return last + f.elem_bytes;
}

// "rank 2, 2-byte elements, dims [64, 100], strides [2, 256] bytes, box [64, 32], swizzle 128B"
std::string describe_tensor_map(const TensorMapFields& f);

}  // namespace welder_emu::detail

// The host API of welder_tma.cuh (see there): 0 on success, else a WelderTensorMapStatus code.
int welder_encode_tensor_map(CUtensorMap* map, int elem_bytes, int rank, const void* base,
                             const unsigned long long* dims, const unsigned long long* strides_bytes,
                             const unsigned* box, int swizzle_bytes);
