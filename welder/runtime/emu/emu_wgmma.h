// Hopper warpgroup MMA (codegen_templates/welder_wgmma.cuh) for the CPU emulator:
// wgmma.mma_async m64nNk16 with f16/bf16 operands from shared memory through matrix descriptors,
// wgmma.fence / commit_group / wait_group, fence.proxy.async, and the descriptors themselves.
//
// Model.  Every call is a warpgroup collective: the 128 threads of warps 4i..4i+3 meet at the same
// call site (warpgroup_meet in the runtime), and the first to resume does the work for all.
//  - wgmma.mma_async decodes both descriptors (start address, LBO, SBO, swizzle), reads A (64x16)
//    and B (16xN) from the dynamic buffer, checks that every byte lies in it, was written before a
//    __syncthreads preceding the wgmma with a fence.proxy.async of the writer in between, and is not
//    the destination of a cp.async in flight; computes D at once (each k16 step's sum rounded
//    towards zero, as emu_mma.h's mma.sync) and queues it.  D reaches the members' accumulator
//    arrays only when a wgmma.wait_group covers the group, so a kernel that reads them earlier
//    sees the old values, and the bytes read stay "in use" until then: writing them is an error.  A wgmma whose accumulators are those of a queued wgmma (the usual chain of
//    k16 steps) accumulates onto that wgmma's result, as the hardware orders such a chain.
//  - every wgmma must follow a wgmma.fence of its warpgroup issued since the warpgroup's last
//    wgmma.wait_group (the fence orders the threads' own accesses of the accumulators).
//  - a thread exiting while its warpgroup has wgmma in flight is an error.
//
// Address of element (mn, k) of an operand (16-bit elements; mn indexes M for A, N for B), as an
// offset from the descriptor's start address, before the swizzle (W = swizzle width in bytes):
//   K-major,  no swizzle: (mn % 8) * 16 + (mn / 8) * SBO + (k % 8) * 2 + (k / 8) * LBO
//   K-major,  swizzle W:  (mn % 8) * W  + (mn / 8) * SBO + k * 2                  (LBO unused)
//   MN-major, no swizzle: (k % 8) * 16 + (k / 8) * LBO  + (mn % 8) * 2 + (mn / 8) * SBO
//   MN-major, swizzle W:  (k % 8) * W  + (k / 8) * SBO  + (mn % (W/2)) * 2 + (mn / (W/2)) * LBO
// The swizzle then XORs bits [4, 4+b) of the absolute shared address with bits [7, 7+b), b = 3, 2,
// 1 for W = 128, 64, 32.  docs/emulator.md has the table and where it comes from.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "emu_half.h"
#include "emu_mma.h"
#include "emu_runtime.h"
#include "emu_shared.h"

namespace welder_emu::detail {

enum class WgmmaType { kF16, kBf16 };

// One member's operands, on its stack while it waits at the collective.
struct WgmmaMember {
  uint64_t desc_a;
  uint64_t desc_b;
  int accumulate;
  float* d;
};

struct WgmmaDescriptor {
  unsigned start;      // shared-window address of the operand
  unsigned lbo, sbo;   // bytes
  unsigned swizzle;    // 0, 32, 64 or 128 bytes
  unsigned base_offset;
};

inline WgmmaDescriptor decode_wgmma_descriptor(uint64_t desc) {
  static constexpr unsigned kSwizzle[4] = {0, 128, 64, 32};
  return WgmmaDescriptor{static_cast<unsigned>(desc & 0x3FFF) << 4, static_cast<unsigned>((desc >> 16) & 0x3FFF) << 4,
                         static_cast<unsigned>((desc >> 32) & 0x3FFF) << 4, kSwizzle[(desc >> 62) & 3],
                         static_cast<unsigned>((desc >> 49) & 7)};
}

// Shared-window address of element (mn, k) of a k16 operand with 16-bit elements.
inline unsigned wgmma_element_address(const WgmmaDescriptor& d, bool mn_major, unsigned mn, unsigned k) {
  unsigned offset;
  if (d.swizzle == 0) {
    offset = mn_major ? (k % 8) * 16 + (k / 8) * d.lbo + (mn % 8) * 2 + (mn / 8) * d.sbo
                      : (mn % 8) * 16 + (mn / 8) * d.sbo + (k % 8) * 2 + (k / 8) * d.lbo;
  } else {
    const unsigned atom = d.swizzle / 2;  // elements along the contiguous dimension of a swizzle row
    offset = mn_major ? (k % 8) * d.swizzle + (k / 8) * d.sbo + (mn % atom) * 2 + (mn / atom) * d.lbo
                      : (mn % 8) * d.swizzle + (mn / 8) * d.sbo + k * 2;
  }
  const unsigned address = d.start + offset;
  const unsigned bits = d.swizzle == 128 ? 7u : d.swizzle == 64 ? 3u : d.swizzle == 32 ? 1u : 0u;
  return address ^ (((address >> 7) & bits) << 4);
}

inline double wgmma_value(uint16_t bits, WgmmaType type) {
  if (type == WgmmaType::kF16) return half_bits_to_float(bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// Row and column of D held by accumulator i of warpgroup member m (PTX ISA, wgmma .m64nNk16 D).
inline void wgmma_d_position(unsigned m, int i, unsigned& row, unsigned& col) {
  const unsigned warp = m / 32, g = (m % 32) / 4, t = m % 4;
  row = 16 * warp + g + 8 * ((i / 2) % 2);
  col = 8 * (i / 4) + 2 * t + i % 2;
}

template <int N, WgmmaType kType, int kTransA, int kTransB>
void wgmma(float* d, uint64_t desc_a, uint64_t desc_b, int accumulate, const char* primitive, const Site& site) {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma .m64nNk16: N is a multiple of 8 from 8 to 256");
  static_assert((kTransA == 0 || kTransA == 1) && (kTransB == 0 || kTransB == 1), "imm-trans-a/b are 0 or 1");
  WgmmaMember me{desc_a, desc_b, accumulate, d};
  void* const* members = nullptr;
  if (!warpgroup_meet(primitive, &me, &members, site)) return;

  const std::string where = format("%s at %s", primitive, describe(site).c_str());
  const auto member = [&](unsigned m) -> const WgmmaMember& { return *static_cast<const WgmmaMember*>(members[m]); };
  const unsigned warpgroup = current_warpgroup();
  for (unsigned m = 1; m < kWarpgroupSize; ++m) {
    const WgmmaMember& a = member(0);
    const WgmmaMember& b = member(m);
    if (a.desc_a != b.desc_a || a.desc_b != b.desc_b || (a.accumulate != 0) != (b.accumulate != 0))
      raise_error(format("%s: the threads of warpgroup %u pass different operands (thread %u: desc-a 0x%016llx, "
                         "desc-b 0x%016llx, scale-d %d; thread %u: 0x%016llx, 0x%016llx, %d)",
                         where.c_str(), warpgroup, warpgroup * kWarpgroupSize, (unsigned long long)a.desc_a,
                         (unsigned long long)a.desc_b, a.accumulate != 0, warpgroup * kWarpgroupSize + m,
                         (unsigned long long)b.desc_a, (unsigned long long)b.desc_b, b.accumulate != 0));
  }
  WgmmaQueue& queue = wgmma_queue(warpgroup);
  if (!queue.fenced)
    raise_error(format("%s: no wgmma.fence of warpgroup %u since it started or since its last wgmma.wait_group "
                       "(welder_wgmma_fence must order the threads' accumulator accesses before a wgmma)",
                       where.c_str(), warpgroup));

  // Operand addresses, bounds, and the 16-byte units read.
  const size_t smem_bytes = dynamic_smem_bytes();
  std::vector<uint32_t> chunks;
  const auto locate = [&](const char* operand, uint64_t raw, bool mn_major, int extent, std::vector<unsigned>& at) {
    const WgmmaDescriptor desc = decode_wgmma_descriptor(raw);
    if (desc.base_offset != 0)
      raise_error(format("%s: the %s descriptor 0x%016llx sets base_offset %u, which the emulator does not model "
                         "(align the swizzled tile instead)",
                         where.c_str(), operand, (unsigned long long)raw, desc.base_offset));
    at.resize(static_cast<size_t>(extent) * 16);
    for (int mn = 0; mn < extent; ++mn)
      for (int k = 0; k < 16; ++k) {
        const unsigned address = wgmma_element_address(desc, mn_major, mn, k);
        if (address < kSharedWindowBase || address + 2 > kSharedWindowBase + smem_bytes)
          raise_error(format("%s: operand %s element (%s %d, k %d) lies at shared address 0x%x, outside the %zu "
                             "bytes of dynamic shared memory given at launch (addresses 0x%x-0x%zx; descriptor "
                             "0x%016llx)",
                             where.c_str(), operand, operand[0] == 'A' ? "m" : "n", mn, k, address, smem_bytes,
                             kSharedWindowBase, kSharedWindowBase + smem_bytes - 1, (unsigned long long)raw));
        at[static_cast<size_t>(mn) * 16 + k] = address - kSharedWindowBase;
        chunks.push_back((address - kSharedWindowBase) / 16);
      }
  };
  std::vector<unsigned> a_at, b_at;
  locate("A", desc_a, kTransA == 1, 64, a_at);
  locate("B", desc_b, kTransB == 1, N, b_at);
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  wgmma_check_reads(chunks, primitive, site);

  const unsigned char* smem = dynamic_smem_base();
  const auto load = [&](unsigned offset) {
    uint16_t bits;
    std::memcpy(&bits, smem + offset, 2);
    return wgmma_value(bits, kType);
  };
  std::vector<double> a(64 * 16), b(static_cast<size_t>(N) * 16);
  for (size_t i = 0; i < a.size(); ++i) a[i] = load(a_at[i]);
  for (size_t i = 0; i < b.size(); ++i) b[i] = load(b_at[i]);

  WgmmaOp op{primitive, site, N, std::vector<float>(64 * static_cast<size_t>(N), 0.0f), {}, std::move(chunks)};
  for (unsigned m = 0; m < kWarpgroupSize; ++m) op.dest[m] = member(m).d;
  // The accumulator: zero (scale-d = 0), the result of a queued wgmma on the same registers, or the
  // members' registers as they are.
  if (member(0).accumulate != 0) {
    const WgmmaOp* chained = nullptr;
    const auto consider = [&](const WgmmaOp& q) {
      const float* lo = q.dest[0];
      const float* hi = lo + q.n / 2;
      if (q.dest[0] == d && q.n == N) chained = &q;
      else if (d < hi && lo < d + N / 2)
        raise_error(format("%s: its accumulators overlap those of the in-flight %s at %s without being the same "
                           "registers of the same shape",
                           where.c_str(), q.primitive, describe(q.site).c_str()));
    };
    for (const auto& group : queue.committed)
      for (const WgmmaOp& q : group) consider(q);
    for (const WgmmaOp& q : queue.open) consider(q);
    for (unsigned m = 0; m < kWarpgroupSize; ++m)
      for (int i = 0; i < N / 2; ++i) {
        unsigned row, col;
        wgmma_d_position(m, i, row, col);
        op.d[row * N + col] = chained ? chained->d[row * N + col] : member(m).d[i];
      }
  }
  for (int row = 0; row < 64; ++row)
    for (int col = 0; col < N; ++col) {
      double sum = op.d[row * N + col];
      for (int k = 0; k < 16; ++k) sum += a[row * 16 + k] * b[col * 16 + k];
      op.d[row * N + col] = toward_zero(sum);
    }
  wgmma_issue(warpgroup, std::move(op));
}

// wgmma.fence / commit_group / wait_group: warpgroup collectives with no operands.
enum class WgmmaSync { kFence, kCommit, kWait };

inline void wgmma_sync(WgmmaSync what, int pending, const char* primitive, const Site& site) {
  void* const* members = nullptr;
  if (!warpgroup_meet(primitive, nullptr, &members, site)) return;
  const unsigned warpgroup = current_warpgroup();
  switch (what) {
    case WgmmaSync::kFence: wgmma_queue(warpgroup).fenced = true; break;
    case WgmmaSync::kCommit: wgmma_commit(warpgroup); break;
    case WgmmaSync::kWait: wgmma_wait(warpgroup, pending); break;
  }
}

inline uint64_t wgmma_descriptor(unsigned address, int swizzle_bytes, int lbo_bytes, int sbo_bytes, const Site& site) {
  const auto fail = [&](const std::string& problem) {
    raise_error(format("welder_wgmma_desc at %s: %s", describe(site).c_str(), problem.c_str()));
  };
  if (swizzle_bytes != 0 && swizzle_bytes != 32 && swizzle_bytes != 64 && swizzle_bytes != 128)
    fail(format("swizzle %d is not 0, 32, 64 or 128 bytes", swizzle_bytes));
  if (address % 16 != 0) fail(format("the start address 0x%x is not 16-byte aligned", address));
  for (const auto& [name, value] : {std::pair<const char*, int>{"LBO", lbo_bytes}, {"SBO", sbo_bytes}})
    if (value < 0 || value % 16 != 0 || value >= (1 << 18))
      fail(format("%s %d is not a multiple of 16 bytes in [0, 2^18)", name, value));
  const uint64_t layout = swizzle_bytes == 128 ? 1 : swizzle_bytes == 64 ? 2 : swizzle_bytes == 32 ? 3 : 0;
  return uint64_t{(address & 0x3FFFFu) >> 4} | uint64_t{static_cast<unsigned>(lbo_bytes) >> 4} << 16 |
         uint64_t{static_cast<unsigned>(sbo_bytes) >> 4} << 32 | layout << 62;
}

}  // namespace welder_emu::detail

// ---------------------------------------------------------------------------------- the API

// The shared-window address of a view position (cvta.to.shared / __cvta_generic_to_shared).
template <class T>
inline unsigned welder_shared_address(const welder_emu::SharedPtr<T>& p) {
  return welder_emu::detail::kSharedWindowBase + static_cast<unsigned>(p.byte_offset_of(0));
}
template <class T>
inline size_t __cvta_generic_to_shared(const welder_emu::SharedPtr<T>& p) {
  return welder_shared_address(p);
}

template <class T>
inline uint64_t welder_wgmma_desc(const welder_emu::SharedPtr<T>& p, int swizzle_bytes, int lbo_bytes, int sbo_bytes,
                                  const welder_emu::Site& site = welder_emu::Site::here()) {
  return welder_emu::detail::wgmma_descriptor(welder_shared_address(p), swizzle_bytes, lbo_bytes, sbo_bytes, site);
}

template <int N, int kTransA, int kTransB>
inline void welder_wgmma_m64k16_f16f32(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate,
                                       const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::wgmma<N, welder_emu::detail::WgmmaType::kF16, kTransA, kTransB>(
      d, desc_a, desc_b, accumulate, "wgmma.mma_async.sync.aligned.m64nNk16.f32.f16.f16", site);
}

template <int N, int kTransA, int kTransB>
inline void welder_wgmma_m64k16_bf16f32(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate,
                                        const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::wgmma<N, welder_emu::detail::WgmmaType::kBf16, kTransA, kTransB>(
      d, desc_a, desc_b, accumulate, "wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16", site);
}

inline void welder_wgmma_fence(const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::wgmma_sync(welder_emu::detail::WgmmaSync::kFence, 0, "wgmma.fence.sync.aligned", site);
}

inline void welder_wgmma_commit(const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::wgmma_sync(welder_emu::detail::WgmmaSync::kCommit, 0, "wgmma.commit_group.sync.aligned", site);
}

template <int N>
inline void welder_wgmma_wait(const welder_emu::Site& site = welder_emu::Site::here()) {
  static_assert(N >= 0, "wgmma.wait_group takes a count of groups >= 0");
  welder_emu::detail::wgmma_sync(welder_emu::detail::WgmmaSync::kWait, N, "wgmma.wait_group.sync.aligned", site);
}

inline void welder_fence_proxy_async() { welder_emu::detail::fence_proxy_async(); }

// Orders the compiler's accesses of accumulators around wgmma under nvcc; nothing to do here.
template <int N>
inline void welder_wgmma_fence_operand(float (&)[N]) {}
