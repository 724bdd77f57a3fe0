// Element types, memory spaces and the 16-bit float storage types.
//
// `bfloat16` and `float16` are plain 16-bit storage types usable on host and device. Their
// conversions from float round to nearest even and handle NaN (kept quiet, sign kept), infinity,
// overflow (to infinity) and subnormals exactly; conversions to float are exact.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "zenflow/config.hpp"

namespace zenflow {

/// Element type of a tensor view or a buffer.
enum class dtype : std::uint8_t { f32 = 0, bf16 = 1, f16 = 2 };

/// Where a view's memory lives. Pinned host memory is `host`.
enum class memory_space : std::uint8_t { host = 0, device = 1 };

/// Size in bytes of one element of `t` (0 for an unknown value).
ZENFLOW_HOST_DEVICE constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::bf16: return 2;
    case dtype::f16: return 2;
  }
  return 0;
}

/// "f32", "bf16", "f16" (or "unknown").
constexpr std::string_view dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::bf16: return "bf16";
    case dtype::f16: return "f16";
  }
  return "unknown";
}

constexpr bool is_valid(dtype t) noexcept { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16; }

constexpr std::string_view memory_space_name(memory_space s) noexcept {
  return s == memory_space::host ? "host" : s == memory_space::device ? "device" : "unknown";
}

/// bfloat16 storage: the upper 16 bits of an IEEE binary32.
struct bfloat16 {
  std::uint16_t bits;
};
/// IEEE binary16 storage.
struct float16 {
  std::uint16_t bits;
};
static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2);
static_assert(std::is_trivially_copyable_v<bfloat16> && std::is_standard_layout_v<float16>);

namespace detail {
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE std::uint32_t float_to_bits(float f) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float bits_to_float(std::uint32_t u) noexcept {
#if ZENFLOW_IS_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
}  // namespace detail

/// float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN with its sign.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE bfloat16 to_bfloat16(float f) noexcept {
  std::uint32_t x = detail::float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bfloat16{static_cast<std::uint16_t>((x >> 16) | 0x0040u)};
  x += 0x7fffu + ((x >> 16) & 1u);  // carries into the exponent: overflow becomes infinity
  return bfloat16{static_cast<std::uint16_t>(x >> 16)};
}

/// float -> IEEE half, round to nearest even, with subnormals, overflow to infinity and NaN.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float16 to_float16(float f) noexcept {
  std::uint32_t x = detail::float_to_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  std::uint32_t h;
  if (x > 0x7f800000u) {
    h = 0x7e00u | ((x >> 13) & 0x3ffu);  // quiet NaN, keep the top payload bits
  } else if (x >= 0x477ff000u) {
    h = 0x7c00u;  // >= 65520 rounds to infinity; infinity stays infinity
  } else if (x >= 0x38800000u) {
    // Normal half: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
    const std::uint32_t odd = (x >> 13) & 1u;
    x += 0xc8000fffu + odd;
    h = x >> 13;
  } else {
    // Below 2^-14: the sum with 0.5f aligns the value so that the FPU's own round-to-nearest-even
    // produces the subnormal half in the low mantissa bits.
    const float aligned = detail::bits_to_float(x) + 0.5f;
    h = detail::float_to_bits(aligned) - 0x3f000000u;
  }
  return float16{static_cast<std::uint16_t>(sign | h)};
}

/// Exact widening conversions.
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float to_float(bfloat16 b) noexcept {
  return detail::bits_to_float(static_cast<std::uint32_t>(b.bits) << 16);
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float to_float(float16 h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  const std::uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0x1fu) return detail::bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0u) {
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -magnitude : magnitude;
  }
  return detail::bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE float to_float(float f) noexcept { return f; }

/// Generic narrowing: `from_float<T>(x)` for T in {float, bfloat16, float16}.
template <class T>
ZENFLOW_HOST_DEVICE ZENFLOW_FORCEINLINE T from_float(float f) noexcept {
  if constexpr (std::is_same_v<T, float>)
    return f;
  else if constexpr (std::is_same_v<T, bfloat16>)
    return to_bfloat16(f);
  else {
    static_assert(std::is_same_v<T, float16>, "from_float: T must be float, bfloat16 or float16");
    return to_float16(f);
  }
}

/// True for the element types zenflow stores: float, bfloat16, float16.
template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// The dtype tag of an element type.
template <class T>
inline constexpr dtype dtype_of_v = std::is_same_v<T, float> ? dtype::f32 : std::is_same_v<T, bfloat16> ? dtype::bf16 : dtype::f16;

/// Calls `f(T{})` with T the element type that `t` names. `t` must be valid.
template <class F>
decltype(auto) dispatch_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::bf16: return f(bfloat16{});
    case dtype::f16: return f(float16{});
    default: return f(float{});
  }
}

}  // namespace zenflow
