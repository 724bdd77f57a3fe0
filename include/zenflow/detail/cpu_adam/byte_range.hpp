// Byte ranges of the buffers a cpu_adam step reads and writes, for its overlap checks. Not a
// public header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zenflow::detail {

/// A half-open byte range [lo, hi) and the task (or tensor) it belongs to.
struct byte_range {
  std::uintptr_t lo = 0, hi = 0;
  std::size_t task = 0;
};

inline byte_range make_range(const void* p, std::size_t bytes, std::size_t task) noexcept {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  return {lo, lo + bytes, task};
}
inline bool overlaps(const byte_range& a, const byte_range& b) noexcept {
  return a.lo < b.hi && b.lo < a.hi;
}

}  // namespace zenflow::detail
