// nvcuda::wmma for the CPU emulator.
//
// CUDA leaves the distribution of fragment elements over lanes unspecified, so here every lane
// holds the whole tile: num_elements is rows * cols and x[i] is element i in row-major order.
// Element-wise code over frag.x[0 .. num_elements) therefore computes the same result as on the
// GPU.  load/store/mma are warp-collective: all 32 lanes must reach the same call site (a missing
// lane is reported like a broken shuffle).  Loads from shared views are bounds- and race-checked
// element by element; a store has lane l write the elements i with i % 32 == l, so each element
// has one writer as on the GPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "emu_half.h"
#include "emu_runtime.h"
#include "emu_shared.h"

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}  // namespace precision

enum layout_t { mem_row_major, mem_col_major };

template <class T>
struct helper_traits {
  typedef T element_type;
  typedef T storage_element_type;
  typedef T fill_argument_type;
};
template <>
struct helper_traits<precision::tf32> {
  typedef precision::tf32 element_type;
  typedef float storage_element_type;
  typedef float fill_argument_type;
};

// Rounds to TF32 (10 explicit mantissa bits), to nearest with ties away from zero like cvt.rna.
inline float __float_to_tf32(float in) {
  uint32_t bits;
  std::memcpy(&bits, &in, 4);
  if ((bits & 0x7F800000u) != 0x7F800000u) bits = (bits + 0x1000u) & 0xFFFFE000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

template <class T, int Size>
struct __frag_base {
  enum { num_elements = Size, num_storage_elements = Size };
  typedef T element_type;
  typedef typename helper_traits<T>::storage_element_type storage_element_type;
  storage_element_type x[Size];
};

namespace detail {

template <class Use, int M, int N, int K>
struct tile_shape;
template <int M, int N, int K>
struct tile_shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K, elements = M * K;
};
template <int M, int N, int K>
struct tile_shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N, elements = K * N;
};
template <int M, int N, int K>
struct tile_shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N, elements = M * N;
};

template <int M, int N, int K>
constexpr bool is_half_shape = (M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) ||
                               (M == 8 && N == 32 && K == 16);

// The (use, shape, type, layout) combinations CUDA defines for half, int8 and tf32.
template <class Use, int M, int N, int K, class T, class Layout>
constexpr bool is_supported() {
  constexpr bool operand = std::is_same<Use, matrix_a>::value || std::is_same<Use, matrix_b>::value;
  constexpr bool layout_ok =
      operand ? (std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value)
              : std::is_same<Layout, void>::value;
  if (!layout_ok) return false;
  if (M == 16 && N == 16 && K == 8)
    return operand ? std::is_same<T, precision::tf32>::value : std::is_same<T, float>::value;
  if (!is_half_shape<M, N, K>) return false;
  if (operand)
    return std::is_same<T, __half>::value || std::is_same<T, signed char>::value ||
           std::is_same<T, unsigned char>::value;
  return std::is_same<T, __half>::value || std::is_same<T, float>::value || std::is_same<T, int>::value;
}

}  // namespace detail

template <class Use, int m, int n, int k, class T, class Layout = void>
class fragment : public __frag_base<T, detail::tile_shape<Use, m, n, k>::elements> {
  static_assert(detail::is_supported<Use, m, n, k, T, Layout>(), "wmma: unsupported fragment type");

 public:
  static constexpr int rows = detail::tile_shape<Use, m, n, k>::rows;
  static constexpr int cols = detail::tile_shape<Use, m, n, k>::cols;
};

template <class T, int Size>
inline void fill_fragment(__frag_base<T, Size>& f, const typename helper_traits<T>::fill_argument_type& v) {
  for (int i = 0; i < Size; ++i) f.x[i] = v;
}

namespace detail {

using welder_emu::Site;

// Element `e` of the matrix at p with leading dimension ldm, for raw pointers and shared views.
template <class S>
inline S read_element(const S* p, long long e) {
  return p[e];
}
template <class S>
inline S read_element(const welder_emu::SharedPtr<S>& p, long long e) {
  return p.load(e);
}
template <class S>
inline void write_element(S* p, long long e, const S& v) {
  p[e] = v;
}
template <class S>
inline void write_element(const welder_emu::SharedPtr<S>& p, long long e, const S& v) {
  p.store(e, v);
}

// Element type behind a raw pointer or a shared view (declarations only, for decltype).
template <class S>
S element_of(const S*);
template <class S>
S element_of(const welder_emu::SharedPtr<S>&);
template <class P>
using element_t = decltype(element_of(std::declval<P>()));

template <class S>
inline long long byte_alignment_offset(const S* p) {
  return static_cast<long long>(reinterpret_cast<uintptr_t>(p) % 32);
}
template <class S>
inline long long byte_alignment_offset(const welder_emu::SharedPtr<S>& p) {
  return p.byte_offset_of(0) % 32;
}

// The GPU requires 256-bit aligned matrix pointers and a leading dimension of 16-byte multiples.
template <class S, class P>
inline void check_matrix_pointer(const char* primitive, const P& p, unsigned ldm, const Site& site) {
  if (byte_alignment_offset(p) != 0)
    welder_emu::detail::raise_error(welder_emu::detail::format("%s at %s: the matrix pointer is not 32-byte aligned",
                                                               primitive, welder_emu::detail::describe(site).c_str()));
  if ((ldm * sizeof(S)) % 16 != 0)
    welder_emu::detail::raise_error(welder_emu::detail::format(
        "%s at %s: ldm %u is not a multiple of %zu elements", primitive, welder_emu::detail::describe(site).c_str(),
        ldm, 16 / sizeof(S)));
}

template <class Frag, class P>
inline void load_tile(Frag& f, const P& p, unsigned ldm, bool row_major_memory, const char* primitive,
                      const Site& site) {
  using S = typename Frag::storage_element_type;
  static_assert(std::is_same<element_t<P>, S>::value, "wmma: the pointer type does not match the fragment");
  check_matrix_pointer<S>(primitive, p, ldm, site);
  welder_emu::detail::warp_rendezvous(primitive, site);
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c) {
      const long long e = row_major_memory ? 1LL * r * ldm + c : 1LL * c * ldm + r;
      f.x[r * Frag::cols + c] = read_element(p, e);
    }
}

}  // namespace detail

// Operand fragments take their memory layout from the fragment type.
template <class Use, int m, int n, int k, class T, class Layout, class P>
inline void load_matrix_sync(fragment<Use, m, n, k, T, Layout>& f, const P& p, unsigned ldm,
                             const welder_emu::Site& site = welder_emu::Site::here()) {
  static_assert(!std::is_same<Use, accumulator>::value, "wmma: accumulator loads take a layout_t");
  detail::load_tile(f, p, ldm, std::is_same<Layout, row_major>::value, "wmma::load_matrix_sync", site);
}

template <int m, int n, int k, class T, class P>
inline void load_matrix_sync(fragment<accumulator, m, n, k, T>& f, const P& p, unsigned ldm, layout_t layout,
                             const welder_emu::Site& site = welder_emu::Site::here()) {
  detail::load_tile(f, p, ldm, layout == mem_row_major, "wmma::load_matrix_sync", site);
}

template <class P, int m, int n, int k, class T>
inline void store_matrix_sync(const P& p, const fragment<accumulator, m, n, k, T>& f, unsigned ldm, layout_t layout,
                              const welder_emu::Site& site = welder_emu::Site::here()) {
  using Frag = fragment<accumulator, m, n, k, T>;
  static_assert(std::is_same<detail::element_t<P>, T>::value, "wmma: the pointer type does not match the fragment");
  constexpr const char* primitive = "wmma::store_matrix_sync";
  detail::check_matrix_pointer<T>(primitive, p, ldm, site);
  welder_emu::detail::warp_rendezvous(primitive, site);
  const unsigned lane = welder_emu::detail::current_lane();
  for (int i = static_cast<int>(lane); i < Frag::num_elements; i += 32) {
    const int r = i / Frag::cols, c = i % Frag::cols;
    const long long e = layout == mem_row_major ? 1LL * r * ldm + c : 1LL * c * ldm + r;
    detail::write_element(p, e, f.x[i]);
  }
}

namespace detail {

// Operand values as the tensor core sees them: halves and int8 exactly, TF32 with the low 13
// mantissa bits ignored (what the hardware does with unconverted fp32 data).
inline float operand_value(__half v) { return __half2float(v); }
inline int operand_value(signed char v) { return v; }
inline int operand_value(unsigned char v) { return v; }
inline float operand_value(float tf32) {
  uint32_t bits;
  std::memcpy(&bits, &tf32, 4);
  bits &= 0xFFFFE000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float accumulator_value(float v) { return v; }
inline float accumulator_value(__half v) { return __half2float(v); }
inline int accumulator_value(int v) { return v; }

}  // namespace detail

// d = a * b + c, products and sums in float (int for int8), rounded once to d's type.
template <int m, int n, int k, class TD, class TA, class LA, class TB, class LB, class TC>
inline void mma_sync(fragment<accumulator, m, n, k, TD>& d, const fragment<matrix_a, m, n, k, TA, LA>& a,
                     const fragment<matrix_b, m, n, k, TB, LB>& b, const fragment<accumulator, m, n, k, TC>& c,
                     const welder_emu::Site& site = welder_emu::Site::here()) {
  welder_emu::detail::warp_rendezvous("wmma::mma_sync", site);
  using Acc = decltype(detail::accumulator_value(c.x[0]));
  TD out[m * n];
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      Acc sum = detail::accumulator_value(c.x[i * n + j]);
      for (int p = 0; p < k; ++p) sum += detail::operand_value(a.x[i * k + p]) * detail::operand_value(b.x[p * n + j]);
      out[i * n + j] = static_cast<TD>(sum);
    }
  std::memcpy(static_cast<void*>(d.x), static_cast<const void*>(out), sizeof(out));
}

}  // namespace wmma
}  // namespace nvcuda
