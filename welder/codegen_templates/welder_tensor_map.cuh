// welder_tensor_map.cuh -- the rules a tiled tensor map's encode arguments must meet, host code
// shared by the GPU encode (welder_tma.cuh, through the driver's cuTensorMapEncodeTiled) and the
// CPU emulator's own encode (welder/runtime/emu/emu_tensor_map.cpp), so that both refuse the same
// arguments.  The rules are those the CUDA driver documents for cuTensorMapEncodeTiled with
// interleave none and element strides 1; welder/codegen/tensor_map.py checks the same ones in
// Python before it calls the driver.
//
//   welder_tensor_map_check(elem_bytes, rank, base, dims, strides_bytes, box, swizzle_bytes)
//       0, or one of the nonzero WelderTensorMapStatus codes below (never crashes on null arrays)
//   welder_tensor_map_status_text(code)  a sentence saying what the code means
#pragma once

#include <cstdint>

enum WelderTensorMapStatus : int {
  kWelderTensorMapOk = 0,
  kWelderTensorMapNullArgument = 1,     // map, base, dims, box (or strides with rank > 1) is null
  kWelderTensorMapElemBytes = 2,        // element size other than 2 or 4 bytes
  kWelderTensorMapRank = 3,             // rank outside 1..5
  kWelderTensorMapBaseAlignment = 4,    // global address not 16-byte aligned
  kWelderTensorMapDim = 5,              // a dimension of 0 or above 2^32
  kWelderTensorMapStride = 6,           // a stride not a multiple of 16 or not below 2^40
  kWelderTensorMapBox = 7,              // a box dimension outside 1..256
  kWelderTensorMapBoxInnerBytes = 8,    // box[0] * elem_bytes not a multiple of 16
  kWelderTensorMapSwizzle = 9,          // swizzle other than 0, 32, 64, 128
  kWelderTensorMapSwizzleSpan = 10,     // box[0] * elem_bytes above the swizzle span
  kWelderTensorMapNoDriver = 11,        // (GPU) cuTensorMapEncodeTiled could not be found
  kWelderTensorMapDriverRejected = 12,  // (GPU) the driver refused arguments these rules accept
};

inline const char* welder_tensor_map_status_text(int code) {
  switch (code) {
    case kWelderTensorMapOk: return "encoded";
    case kWelderTensorMapNullArgument:
      return "the map, global address, dims or box pointer (or strides, for rank > 1) is null";
    case kWelderTensorMapElemBytes: return "the element size must be 2 or 4 bytes";
    case kWelderTensorMapRank: return "the rank must be 1 to 5";
    case kWelderTensorMapBaseAlignment: return "the global address must be 16-byte aligned";
    case kWelderTensorMapDim: return "every dimension must be 1 to 2^32";
    case kWelderTensorMapStride: return "every stride must be a multiple of 16 bytes below 2^40";
    case kWelderTensorMapBox: return "every box dimension must be 1 to 256";
    case kWelderTensorMapBoxInnerBytes: return "the box's innermost extent in bytes must be a multiple of 16";
    case kWelderTensorMapSwizzle: return "the swizzle must be 0, 32, 64 or 128 bytes";
    case kWelderTensorMapSwizzleSpan: return "the box's innermost extent in bytes must not exceed the swizzle span";
    case kWelderTensorMapNoDriver: return "the CUDA driver's cuTensorMapEncodeTiled is not available";
    case kWelderTensorMapDriverRejected: return "cuTensorMapEncodeTiled rejected the arguments";
    default: return "unknown tensor-map status";
  }
}

// dims[] and box[] have `rank` entries, innermost first; strides_bytes[] has rank - 1 (dims 1..).
inline int welder_tensor_map_check(int elem_bytes, int rank, const void* base, const unsigned long long* dims,
                                   const unsigned long long* strides_bytes, const unsigned* box, int swizzle_bytes) {
  if (elem_bytes != 2 && elem_bytes != 4) return kWelderTensorMapElemBytes;
  if (rank < 1 || rank > 5) return kWelderTensorMapRank;
  if (base == nullptr || dims == nullptr || box == nullptr || (rank > 1 && strides_bytes == nullptr))
    return kWelderTensorMapNullArgument;
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return kWelderTensorMapBaseAlignment;
  for (int i = 0; i < rank; ++i)
    if (dims[i] == 0 || dims[i] > (1ull << 32)) return kWelderTensorMapDim;
  for (int i = 0; i + 1 < rank; ++i)
    if (strides_bytes[i] % 16 != 0 || strides_bytes[i] >= (1ull << 40)) return kWelderTensorMapStride;
  for (int i = 0; i < rank; ++i)
    if (box[i] == 0 || box[i] > 256) return kWelderTensorMapBox;
  const unsigned long long inner = 1ull * box[0] * static_cast<unsigned>(elem_bytes);
  if (inner % 16 != 0) return kWelderTensorMapBoxInnerBytes;
  if (swizzle_bytes != 0 && swizzle_bytes != 32 && swizzle_bytes != 64 && swizzle_bytes != 128)
    return kWelderTensorMapSwizzle;
  if (swizzle_bytes != 0 && inner > static_cast<unsigned long long>(swizzle_bytes)) return kWelderTensorMapSwizzleSpan;
  return kWelderTensorMapOk;
}
