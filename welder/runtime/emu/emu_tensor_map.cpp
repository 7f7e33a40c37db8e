// The emulator's tensor-map encode (see emu_tensor_map.h), and its C entry point for the Python
// driver (emulator.py encodes the maps of tensor-map kernel parameters through it).
#include "emu_tensor_map.h"

#include <cstdio>
#include <string>

#include "emu_runtime.h"

namespace welder_emu::detail {

std::string describe_tensor_map(const TensorMapFields& f) {
  std::string dims, strides, box;
  for (uint32_t i = 0; i < f.rank; ++i) {
    const char* sep = i == 0 ? "" : ", ";
    dims += format("%s%llu", sep, static_cast<unsigned long long>(f.dims[i]));
    strides += format("%s%llu", sep, static_cast<unsigned long long>(f.strides[i]));
    box += format("%s%u", sep, f.box[i]);
  }
  return format("rank %u, %u-byte elements, dims [%s], strides [%s] bytes, box [%s], swizzle %s", f.rank,
                f.elem_bytes, dims.c_str(), strides.c_str(), box.c_str(),
                f.swizzle == 0 ? "none" : format("%uB", f.swizzle).c_str());
}

}  // namespace welder_emu::detail

int welder_encode_tensor_map(CUtensorMap* map, int elem_bytes, int rank, const void* base,
                             const unsigned long long* dims, const unsigned long long* strides_bytes,
                             const unsigned* box, int swizzle_bytes) {
  if (map == nullptr) return kWelderTensorMapNullArgument;
  const int status = welder_tensor_map_check(elem_bytes, rank, base, dims, strides_bytes, box, swizzle_bytes);
  if (status != kWelderTensorMapOk) return status;
  welder_emu::detail::TensorMapFields f{};
  f.tag = welder_emu::detail::kTensorMapTag;
  f.rank = static_cast<uint32_t>(rank);
  f.elem_bytes = static_cast<uint32_t>(elem_bytes);
  f.swizzle = static_cast<uint32_t>(swizzle_bytes);
  f.base = reinterpret_cast<uintptr_t>(base);
  for (int i = 0; i < rank; ++i) {
    f.dims[i] = dims[i];
    f.strides[i] = i == 0 ? static_cast<uint64_t>(elem_bytes) : strides_bytes[i - 1];
    f.box[i] = box[i];
  }
  welder_emu::detail::set_tensor_map_fields(*map, f);
  return kWelderTensorMapOk;
}

// For emulator.py: encodes into the 128 bytes at `map` (64-byte aligned) and, on failure, writes
// what was wrong into `message`.
extern "C" __attribute__((visibility("default"))) int welder_emu_encode_tensor_map(
    void* map, int elem_bytes, int rank, unsigned long long base, const unsigned long long* dims,
    const unsigned long long* strides_bytes, const unsigned* box, int swizzle_bytes, char* message,
    unsigned long long capacity) {
  const int status = welder_encode_tensor_map(static_cast<CUtensorMap*>(map), elem_bytes, rank,
                                              reinterpret_cast<const void*>(static_cast<uintptr_t>(base)), dims,
                                              strides_bytes, box, swizzle_bytes);
  if (message != nullptr && capacity > 0)
    std::snprintf(message, capacity, "%s", welder_tensor_map_status_text(status));
  return status;
}
