// Per-element math of the importance selector, shared by the host reference and the CUDA kernels:
// the score term of one gradient element and the order-preserving float -> uint32 key that the
// top-k works on.
#pragma once

#include <cstdint>

#include "zenflow/config.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

/// The column score: the L1 norm (sum of |g|) or the squared L2 norm (sum of g*g) of a column.
enum class score_norm : std::uint8_t { l1 = 0, l2_squared = 1 };

namespace detail::selector {

/// The contribution of one gradient element to its column's score (|g| or g*g), in fp32.
template <score_norm Norm>
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float score_term(float g) noexcept {
  if constexpr (Norm == score_norm::l1) {
    return detail::bits_to_float(detail::float_to_bits(g) & 0x7fffffffu);  // |g|, exact, NaN stays NaN
  } else {
    return g * g;
  }
}

/// Runtime-norm variant (host code; kernels use the template).
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float score_term(float g, score_norm norm) noexcept {
  return norm == score_norm::l1 ? score_term<score_norm::l1>(g) : score_term<score_norm::l2_squared>(g);
}

/// True when the float's bits encode a NaN.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE bool is_nan_bits(std::uint32_t bits) noexcept {
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

/// The order-preserving key of a score: for floats a < b (IEEE order), key(a) < key(b) as
/// unsigned integers. -0 and +0 map to the same key (they compare equal, so the tie rule decides
/// between them). Every NaN maps to 0, below the key of -infinity (0x007fffff): the host rejects
/// NaN scores before ranking, and the device ranks a NaN column last and reports it.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE std::uint32_t orderable_key(float score) noexcept {
  std::uint32_t bits = detail::float_to_bits(score);
  if (is_nan_bits(bits)) return 0u;
  if (bits == 0x80000000u) bits = 0u;  // -0 -> +0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

/// Inverse of orderable_key for non-NaN keys (tests and diagnostics).
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float key_to_float(std::uint32_t key) noexcept {
  return detail::bits_to_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

/// The radix-select digits, most significant first: 11 + 11 + 10 bits.
inline constexpr int radix_pass_count = 3;
ZENFLOW_HOST_DEVICE constexpr int radix_shift(int pass) noexcept {
  return pass == 0 ? 21 : pass == 1 ? 10 : 0;
}
ZENFLOW_HOST_DEVICE constexpr int radix_bits(int pass) noexcept {
  return pass == 2 ? 10 : 11;
}
inline constexpr int radix_max_bins = 1 << 11;

}  // namespace detail::selector
}  // namespace zenflow
