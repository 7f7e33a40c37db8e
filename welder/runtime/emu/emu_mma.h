// The tensor-core instructions of codegen_templates/welder_mma.cuh for the CPU emulator:
// mma.sync (m16n8k16 f16/bf16, m16n8k8 tf32), ldmatrix (x1/x2/x4, .trans) and cp.async.
//
// Unlike nvcuda::wmma, whose fragment layout CUDA leaves unspecified, these instructions fix which
// lane holds which matrix element, and kernels written against them depend on it (epilogues index
// the accumulators by lane).  So here every lane's registers hold exactly what the PTX ISA says
// they hold on the GPU.  Notation of the ISA: g = lane / 4 ("groupID"), t = lane % 4
// ("threadID_in_group"); a 32-bit register holding two 16-bit elements has the lower-indexed one in
// its low half.
//
//   m16n8k16 A (16x16, row): a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
//                            a[2] = A[g][2t+8..2t+9]  a[3] = A[g+8][2t+8..2t+9]
//            B (16x8, col):  b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   m16n8k8 tf32 A (16x8):   a[0] = A[g][t]  a[1] = A[g+8][t]  a[2] = A[g][t+4]  a[3] = A[g+8][t+4]
//                B (8x8):    b[0] = B[t][g]  b[1] = B[t+4][g]
//   C and D (16x8, f32):     c[0..1] = C[g][2t..2t+1]   c[2..3] = C[g+8][2t..2t+1]
//   ldmatrix: lane 8i+r gives the address of row r of matrix i (16 bytes, 8 elements); register
//             i of lane l holds row l/4, elements 2(l%4) and 2(l%4)+1 of matrix i; with .trans,
//             element l/4 of rows 2(l%4) and 2(l%4)+1.  x1 uses lanes 0-7's addresses, x2 0-15's.
//
// mma.sync and ldmatrix are warp collectives: all 32 lanes must reach the same call site.  Each
// lane checks its own operands first (ldmatrix reads its row through the checked view, so bounds
// and races are checked against the lane that supplied the address); then one function computes
// every lane's registers.  Products of f16/bf16 operands are exact; the sum of a k-step's
// products and c is formed in double and rounded once to float towards zero: the hardware's
// adder is reported to align its terms and truncate, and a deep product that adds every mma
// into one accumulator drifts towards zero by about half an ulp of it a step (the alignment
// drops a few more low bits than one rounding: the emulator's result is the nearer to exact).
// TF32 operands are fp32 bit patterns of which the low 13 mantissa bits are ignored, as the
// hardware does; welder_float_to_tf32 rounds them first (cvt.rna).
//
// cp.async: see emu_scheduler.h for the model (copies land when a wait covers their group).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "emu_half.h"
#include "emu_runtime.h"
#include "emu_shared.h"

namespace welder_emu::detail {

// -------------------------------------------------------------------------------- mma.sync

enum class MmaKind { kF16, kBf16, kTf32 };

// One lane's operands and result, on the lane's stack while it waits at the collective.
struct MmaLane {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
  float d[4];
};

// sum rounded to float towards zero, as the tensor cores' adder normalises its result
// (an infinite or NaN sum stays as it is; a finite one past the range becomes the largest float).
inline float toward_zero(double sum) {
  const float nearest = static_cast<float>(sum);
  if (std::fabs(static_cast<double>(nearest)) > std::fabs(sum)) return std::nextafter(nearest, 0.0f);
  return nearest;
}

inline double b16_value(uint16_t bits, MmaKind kind) {
  if (kind == MmaKind::kF16) return half_bits_to_float(bits);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;  // bf16 is the top half of a float
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

inline double tf32_value(uint32_t bits) {
  bits &= 0xFFFFE000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element `half` (0 low, 1 high) of a register holding two 16-bit elements.
inline uint16_t b16_of(uint32_t reg, int half) { return static_cast<uint16_t>(half ? reg >> 16 : reg & 0xFFFFu); }

template <MmaKind kKind>
void mma_combine(void* const* lanes) {
  constexpr int kK = kKind == MmaKind::kTf32 ? 8 : 16;
  double a[16][kK], b[kK][8];
  for (int l = 0; l < 32; ++l) {
    const auto& in = *static_cast<const MmaLane*>(lanes[l]);
    const int g = l / 4, t = l % 4;
    if constexpr (kKind == MmaKind::kTf32) {
      a[g][t] = tf32_value(in.a[0]);
      a[g + 8][t] = tf32_value(in.a[1]);
      a[g][t + 4] = tf32_value(in.a[2]);
      a[g + 8][t + 4] = tf32_value(in.a[3]);
      b[t][g] = tf32_value(in.b[0]);
      b[t + 4][g] = tf32_value(in.b[1]);
    } else {
      for (int h = 0; h < 2; ++h) {
        a[g][2 * t + h] = b16_value(b16_of(in.a[0], h), kKind);
        a[g + 8][2 * t + h] = b16_value(b16_of(in.a[1], h), kKind);
        a[g][2 * t + 8 + h] = b16_value(b16_of(in.a[2], h), kKind);
        a[g + 8][2 * t + 8 + h] = b16_value(b16_of(in.a[3], h), kKind);
        b[2 * t + h][g] = b16_value(b16_of(in.b[0], h), kKind);
        b[2 * t + 8 + h][g] = b16_value(b16_of(in.b[1], h), kKind);
      }
    }
  }
  for (int l = 0; l < 32; ++l) {
    auto& lane = *static_cast<MmaLane*>(lanes[l]);
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
      double sum = lane.c[i];
      for (int k = 0; k < kK; ++k) sum += a[row][k] * b[k][col];
      lane.d[i] = toward_zero(sum);
    }
  }
}

template <MmaKind kKind>
inline void mma_sync(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                     const char* primitive, const Site& site) {
  MmaLane me;
  std::memcpy(me.a, a, sizeof(me.a));
  std::memcpy(me.b, b, sizeof(me.b));
  std::memcpy(me.c, c, sizeof(me.c));
  warp_combine(primitive, &mma_combine<kKind>, &me, site);
  std::memcpy(d, me.d, sizeof(me.d));
}

// -------------------------------------------------------------------------------- ldmatrix

struct LdmatrixLane {
  uint16_t row[8];  // the row this lane addressed (lanes 0 .. 8 * count - 1)
  uint32_t r[4];
};

template <int kCount, bool kTrans>
void ldmatrix_combine(void* const* lanes) {
  for (int l = 0; l < 32; ++l) {
    auto& out = *static_cast<LdmatrixLane*>(lanes[l]);
    const int q = l / 4, p = l % 4;
    for (int i = 0; i < kCount; ++i) {
      const auto& rows = [&](int r) -> const LdmatrixLane& { return *static_cast<const LdmatrixLane*>(lanes[8 * i + r]); };
      const uint16_t lo = kTrans ? rows(2 * p).row[q] : rows(q).row[2 * p];
      const uint16_t hi = kTrans ? rows(2 * p + 1).row[q] : rows(q).row[2 * p + 1];
      out.r[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
}

template <int kCount, bool kTrans, class T>
inline void ldmatrix(uint32_t* r, const SharedPtr<T>& p, const char* primitive, const Site& site) {
  static_assert(16 % sizeof(T) == 0, "ldmatrix: the view's element type must divide a 16-byte row");
  LdmatrixLane me{};
  if (current_lane() < 8 * kCount) {
    if (p.byte_offset_of(0) % 16 != 0)
      raise_error(format("%s at %s: the row address, shared view '%s' index %lld (byte %lld), is not 16-byte aligned",
                         primitive, describe(site).c_str(), p.name(), p.index(), p.byte_offset_of(0)));
    std::memcpy(me.row, p.access(0, 16, AccessKind::kRead), 16);
  }
  warp_combine(primitive, &ldmatrix_combine<kCount, kTrans>, &me, site);
  std::memcpy(r, me.r, kCount * sizeof(uint32_t));
}

// -------------------------------------------------------------------------------- cp.async

template <int kBytes, class T, class S>
inline void cp_async(const SharedPtr<T>& dst, const S* src, int src_bytes, const Site& site) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  constexpr const char* primitive = kBytes == 16 ? "cp.async.cg.shared.global 16" :
                                    kBytes == 8  ? "cp.async.ca.shared.global 8" :
                                                   "cp.async.ca.shared.global 4";
  if (src_bytes < 0)
    raise_error(format("%s at %s: src_bytes %d is negative", primitive, describe(site).c_str(), src_bytes));
  cp_async_issue(dst.name(), dst.view_offset(), dst.count(), sizeof(T), dst.index(), src, kBytes,
                 static_cast<unsigned>(src_bytes), primitive, site);
}

}  // namespace welder_emu::detail

// ---------------------------------------------------------------------------------- the API

inline void welder_mma_m16n8k16_f16f32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                       const float (&c)[4], const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mma_sync<welder_emu::detail::MmaKind::kF16>(
      d, a, b, c, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", site);
}

inline void welder_mma_m16n8k16_bf16f32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                        const float (&c)[4], const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mma_sync<welder_emu::detail::MmaKind::kBf16>(
      d, a, b, c, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", site);
}

inline void welder_mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                    const float (&c)[4], const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::mma_sync<welder_emu::detail::MmaKind::kTf32>(
      d, a, b, c, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", site);
}

// cvt.rna.tf32.f32: to nearest, ties away from zero; the result is an fp32 bit pattern.
inline uint32_t welder_float_to_tf32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) != 0x7F800000u) bits = (bits + 0x1000u) & 0xFFFFE000u;
  return bits;
}

template <class T>
inline void welder_ldmatrix_x1(uint32_t (&r)[1], const welder_emu::SharedPtr<T>& p,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::ldmatrix<1, false>(r, p, "ldmatrix.sync.aligned.m8n8.x1.shared.b16", site);
}
template <class T>
inline void welder_ldmatrix_x2(uint32_t (&r)[2], const welder_emu::SharedPtr<T>& p,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::ldmatrix<2, false>(r, p, "ldmatrix.sync.aligned.m8n8.x2.shared.b16", site);
}
template <class T>
inline void welder_ldmatrix_x4(uint32_t (&r)[4], const welder_emu::SharedPtr<T>& p,
                               const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::ldmatrix<4, false>(r, p, "ldmatrix.sync.aligned.m8n8.x4.shared.b16", site);
}
template <class T>
inline void welder_ldmatrix_x1_trans(uint32_t (&r)[1], const welder_emu::SharedPtr<T>& p,
                                     const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::ldmatrix<1, true>(r, p, "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16", site);
}
template <class T>
inline void welder_ldmatrix_x2_trans(uint32_t (&r)[2], const welder_emu::SharedPtr<T>& p,
                                     const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::ldmatrix<2, true>(r, p, "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16", site);
}
template <class T>
inline void welder_ldmatrix_x4_trans(uint32_t (&r)[4], const welder_emu::SharedPtr<T>& p,
                                     const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::ldmatrix<4, true>(r, p, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", site);
}

template <int kBytes, class T, class S>
inline void welder_cp_async(const welder_emu::SharedPtr<T>& dst, const S* src, int src_bytes = kBytes,
                            const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::cp_async<kBytes>(dst, src, src_bytes, site);
}

inline void welder_cp_async_commit() { welder_emu::detail::cp_async_commit(); }

template <int kPending>
inline void welder_cp_async_wait() {
  static_assert(kPending >= 0, "cp.async.wait_group takes a count of groups >= 0");
  welder_emu::detail::cp_async_wait(kPending);
}

inline void welder_cp_async_wait_all() {
  welder_emu::detail::cp_async_commit();
  welder_emu::detail::cp_async_wait(0);
}
