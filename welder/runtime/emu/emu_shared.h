// Checked views of the dynamic shared-memory buffer, and the vector load/store helpers.
//
// Under nvcc, WELDER_SHARED(T, name, offset, count) declares a plain `T*`.  Here it declares a
// SharedPtr<T>, which behaves like that pointer (indexing, arithmetic, comparison, &view[i]) but
// checks every element access: bounds against the view and the launch's dynamic size, and data
// races through the shadow state (see emu_scheduler.h).  view[i] yields a SharedRef<T> proxy, so a
// read is a conversion to T and a write is an assignment.
//
// Differences from a raw pointer that a template must respect (nvcc accepts both forms):
//  - an element converts to T only; chain conversions explicitly: __half2float(h[i]), float(f[i]);
//  - members of a vector element are reached through a local copy or welder_vload;
//  - views are not cast to other pointer types; declare a second view over the same bytes instead.
#pragma once

#include <cstdint>
#include <cstring>

#include "emu_runtime.h"

namespace welder_emu {

template <class T>
class SharedRef;

// A pointer to element `index` of a named shared view.
template <class T>
class SharedPtr {
 public:
  SharedPtr() = default;
  SharedPtr(const char* name, size_t byte_offset, long long count, long long index = 0)
      : name_(name), byte_offset_(byte_offset), count_(count), index_(index) {}

  SharedRef<T> operator[](long long i) const { return SharedRef<T>(*this, i); }
  SharedRef<T> operator*() const { return SharedRef<T>(*this, 0); }

  SharedPtr operator+(long long d) const { return SharedPtr(name_, byte_offset_, count_, index_ + d); }
  SharedPtr operator-(long long d) const { return SharedPtr(name_, byte_offset_, count_, index_ - d); }
  friend SharedPtr operator+(long long d, const SharedPtr& p) { return p + d; }
  long long operator-(const SharedPtr& other) const { return address() - other.address(); }
  SharedPtr& operator+=(long long d) {
    index_ += d;
    return *this;
  }
  SharedPtr& operator-=(long long d) {
    index_ -= d;
    return *this;
  }
  SharedPtr& operator++() { return *this += 1; }
  SharedPtr& operator--() { return *this -= 1; }
  SharedPtr operator++(int) {
    SharedPtr old = *this;
    ++index_;
    return old;
  }
  SharedPtr operator--(int) {
    SharedPtr old = *this;
    --index_;
    return old;
  }
  bool operator==(const SharedPtr& o) const { return address() == o.address(); }
  bool operator!=(const SharedPtr& o) const { return address() != o.address(); }
  bool operator<(const SharedPtr& o) const { return address() < o.address(); }
  bool operator<=(const SharedPtr& o) const { return address() <= o.address(); }
  bool operator>(const SharedPtr& o) const { return address() > o.address(); }
  bool operator>=(const SharedPtr& o) const { return address() >= o.address(); }

  const char* name() const { return name_; }
  long long index() const { return index_; }
  long long count() const { return count_; }               // elements in the view
  size_t view_offset() const { return byte_offset_; }      // byte offset of the view in the buffer
  // Byte offset of element `index() + i` from the start of the dynamic buffer (unchecked).
  long long byte_offset_of(long long i) const {
    return static_cast<long long>(byte_offset_) + (index_ + i) * static_cast<long long>(sizeof(T));
  }

  // Checked address of `nbytes` starting at element index() + i.
  unsigned char* access(long long i, size_t nbytes, detail::AccessKind kind) const {
    return detail::shared_access(name_, byte_offset_, count_, sizeof(T), index_ + i, nbytes, kind);
  }
  T load(long long i) const {
    T v;
    std::memcpy(static_cast<void*>(&v), access(i, sizeof(T), detail::AccessKind::kRead), sizeof(T));
    return v;
  }
  void store(long long i, const T& v) const {
    std::memcpy(access(i, sizeof(T), detail::AccessKind::kWrite), static_cast<const void*>(&v), sizeof(T));
  }

 private:
  // Position in elements of the view, comparable between pointers into the same view.
  long long address() const { return static_cast<long long>(byte_offset_ / sizeof(T)) + index_; }

  const char* name_ = "";
  size_t byte_offset_ = 0;
  long long count_ = 0;
  long long index_ = 0;
};

// One element of a shared view: reading converts to T, writing assigns.
template <class T>
class SharedRef {
 public:
  SharedRef(const SharedPtr<T>& base, long long i) : base_(base), i_(i) {}
  SharedRef(const SharedRef&) = default;

  operator T() const { return base_.load(i_); }
  SharedRef& operator=(const T& v) {
    base_.store(i_, v);
    return *this;
  }
  SharedRef& operator=(const SharedRef& other) { return *this = static_cast<T>(other); }
  SharedPtr<T> operator&() const { return base_ + i_; }

  template <class U>
  SharedRef& operator+=(const U& v) { return update([&](T& x) { x += v; }); }
  template <class U>
  SharedRef& operator-=(const U& v) { return update([&](T& x) { x -= v; }); }
  template <class U>
  SharedRef& operator*=(const U& v) { return update([&](T& x) { x *= v; }); }
  template <class U>
  SharedRef& operator/=(const U& v) { return update([&](T& x) { x /= v; }); }
  template <class U>
  SharedRef& operator%=(const U& v) { return update([&](T& x) { x %= v; }); }
  template <class U>
  SharedRef& operator&=(const U& v) { return update([&](T& x) { x &= v; }); }
  template <class U>
  SharedRef& operator|=(const U& v) { return update([&](T& x) { x |= v; }); }
  template <class U>
  SharedRef& operator^=(const U& v) { return update([&](T& x) { x ^= v; }); }
  template <class U>
  SharedRef& operator<<=(const U& v) { return update([&](T& x) { x <<= v; }); }
  template <class U>
  SharedRef& operator>>=(const U& v) { return update([&](T& x) { x >>= v; }); }
  SharedRef& operator++() { return update([](T& x) { ++x; }); }
  SharedRef& operator--() { return update([](T& x) { --x; }); }
  T operator++(int) {
    const T old = *this;
    update([](T& x) { ++x; });
    return old;
  }
  T operator--(int) {
    const T old = *this;
    update([](T& x) { --x; });
    return old;
  }

 private:
  template <class F>
  SharedRef& update(F f) {
    T x = base_.load(i_);
    f(x);
    base_.store(i_, x);
    return *this;
  }

  SharedPtr<T> base_;
  long long i_;
};

namespace detail {

// Declares a view of `count` elements of T at `byte_offset` of the dynamic buffer, after checking
// that it is aligned and lies within the dynamic size given at launch.
template <class T>
SharedPtr<T> shared_view(const unsigned char* smem, const char* name, long long byte_offset, long long count,
                         const Site& site = Site::here()) {
  const long long end = byte_offset + count * static_cast<long long>(sizeof(T));
  const auto fail = [&](const std::string& problem) {
    raise_error(format("shared view '%s' (%s) %s", name, describe(site).c_str(), problem.c_str()));
  };
  if (smem != dynamic_smem_base()) fail("is not based on this kernel's welder_smem");
  if (byte_offset < 0 || count < 0) fail(format("has a negative offset %lld or count %lld", byte_offset, count));
  if (byte_offset % static_cast<long long>(alignof(T)) != 0)
    fail(format("starts at byte %lld, which is not aligned to its %zu-byte element type", byte_offset, alignof(T)));
  if (end > static_cast<long long>(dynamic_smem_bytes()))
    fail(format("spans bytes [%lld, %lld), beyond the %zu bytes of dynamic shared memory given at launch",
                byte_offset, end, dynamic_smem_bytes()));
  return SharedPtr<T>(name, static_cast<size_t>(byte_offset), count);
}

}  // namespace detail
}  // namespace welder_emu

// ------------------------------------------------------------------------------- vector access
// welder_vload<V>(p, i) reads a V from the address of p[i]; welder_vstore(p, i, v) writes one.  The
// address must be aligned to V, as on the GPU (a misaligned vector access faults there).

template <class V, class T>
inline V welder_vload(const T* p, long long i, const welder_emu::Site& site = welder_emu::Site::here()) {
  const T* at = p + i;
  if (reinterpret_cast<uintptr_t>(at) % alignof(V) != 0)
    welder_emu::detail::raise_error(welder_emu::detail::format(
        "welder_vload at %s: misaligned %zu-byte vector load from global address %p (needs %zu-byte alignment)",
        welder_emu::detail::describe(site).c_str(), sizeof(V), static_cast<const void*>(at), alignof(V)));
  V v;
  std::memcpy(static_cast<void*>(&v), static_cast<const void*>(at), sizeof(V));
  return v;
}

template <class V, class T>
inline V welder_vload(const welder_emu::SharedPtr<T>& p, long long i,
                      const welder_emu::Site& site = welder_emu::Site::here()) {
  if (p.byte_offset_of(i) % static_cast<long long>(alignof(V)) != 0)
    welder_emu::detail::raise_error(welder_emu::detail::format(
        "welder_vload at %s: misaligned %zu-byte vector load from shared view '%s' index %lld (byte %lld)",
        welder_emu::detail::describe(site).c_str(), sizeof(V), p.name(), p.index() + i, p.byte_offset_of(i)));
  V v;
  std::memcpy(static_cast<void*>(&v), p.access(i, sizeof(V), welder_emu::detail::AccessKind::kRead), sizeof(V));
  return v;
}

template <class T, class V>
inline void welder_vstore(T* p, long long i, const V& v, const welder_emu::Site& site = welder_emu::Site::here()) {
  T* at = p + i;
  if (reinterpret_cast<uintptr_t>(at) % alignof(V) != 0)
    welder_emu::detail::raise_error(welder_emu::detail::format(
        "welder_vstore at %s: misaligned %zu-byte vector store to global address %p (needs %zu-byte alignment)",
        welder_emu::detail::describe(site).c_str(), sizeof(V), static_cast<void*>(at), alignof(V)));
  std::memcpy(static_cast<void*>(at), static_cast<const void*>(&v), sizeof(V));
}

template <class T, class V>
inline void welder_vstore(const welder_emu::SharedPtr<T>& p, long long i, const V& v,
                          const welder_emu::Site& site = welder_emu::Site::here()) {
  if (p.byte_offset_of(i) % static_cast<long long>(alignof(V)) != 0)
    welder_emu::detail::raise_error(welder_emu::detail::format(
        "welder_vstore at %s: misaligned %zu-byte vector store to shared view '%s' index %lld (byte %lld)",
        welder_emu::detail::describe(site).c_str(), sizeof(V), p.name(), p.index() + i, p.byte_offset_of(i)));
  std::memcpy(p.access(i, sizeof(V), welder_emu::detail::AccessKind::kWrite), static_cast<const void*>(&v), sizeof(V));
}
