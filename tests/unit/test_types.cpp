// 16-bit float storage types: exact round-to-nearest-even, NaN, Inf, subnormals, overflow.
#include <zenflow/types.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <limits>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

namespace {

float bits_f(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t f_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Independent references: enumerate the two neighbouring representable values in double and pick
// the nearer one, ties to the even encoding. Decoders are written from the format definitions.
double decode_half(std::uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 31) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (exp == 0) return sign * std::ldexp(mant, -24);
  return sign * std::ldexp(1024 + mant, exp - 25);
}
double decode_bf16(std::uint16_t b) { return static_cast<double>(bits_f(static_cast<std::uint32_t>(b) << 16)); }

template <class Decode>
std::uint16_t reference_round(float x, Decode decode, std::uint16_t inf_bits) {
  const double d = x;
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(d);
  // Largest non-negative encoding whose value is <= a (binary search over the monotone magnitudes).
  std::uint32_t lo = 0, hi = inf_bits;  // decode(inf_bits) = +inf > a
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (decode(static_cast<std::uint16_t>(mid)) <= a) lo = mid; else hi = mid;
  }
  const double below = decode(static_cast<std::uint16_t>(lo));
  if (below == a) return static_cast<std::uint16_t>(sign | lo);
  const double above = decode(static_cast<std::uint16_t>(hi));
  double up_dist = above - a, down_dist = a - below;
  if (std::isinf(above)) {
    // Overflow: rounds to infinity when a >= max + half an ulp of max (IEEE: as if unbounded exponent).
    const double max = below;
    const double ulp = max - decode(static_cast<std::uint16_t>(lo - 1));
    up_dist = (max + ulp) - a;
  }
  std::uint32_t pick;
  if (down_dist < up_dist) pick = lo;
  else if (up_dist < down_dist) pick = hi;
  else pick = (lo % 2 == 0) ? lo : hi;
  return static_cast<std::uint16_t>(sign | pick);
}

void check_pattern(std::uint32_t u) {
  const float x = bits_f(u);
  const auto h = zenflow::to_float16(x).bits;
  const auto b = zenflow::to_bfloat16(x).bits;
  if (std::isnan(x)) {
    REQUIRE(((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0));
    REQUIRE(((h & 0x200) != 0));  // quiet
    REQUIRE((h >> 15) == (u >> 31));
    REQUIRE(std::isnan(zenflow::to_float(zenflow::bfloat16{b})));
    REQUIRE((b >> 15) == (u >> 31));
    return;
  }
  const auto h_ref = reference_round(x, decode_half, 0x7c00);
  const auto b_ref = reference_round(x, decode_bf16, 0x7f80);
  if (h != h_ref || b != b_ref) {
    INFO("pattern 0x" << std::hex << u << " half " << h << " ref " << h_ref << " bf16 " << b << " ref " << b_ref);
    REQUIRE(h == h_ref);
    REQUIRE(b == b_ref);
  }
}

}  // namespace

TEST_CASE("every half and bfloat16 value widens exactly and narrows back to itself") {
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto bits = static_cast<std::uint16_t>(i);
    const float h = zenflow::to_float(zenflow::float16{bits});
    const double h_ref = decode_half(bits);
    if (std::isnan(h_ref)) {
      REQUIRE(std::isnan(h));
    } else {
      REQUIRE(static_cast<double>(h) == h_ref);
      REQUIRE(std::signbit(h) == static_cast<bool>(bits >> 15));
      REQUIRE(zenflow::to_float16(h).bits == bits);
    }
    const float b = zenflow::to_float(zenflow::bfloat16{bits});
    REQUIRE(f_bits(b) == static_cast<std::uint32_t>(bits) << 16);
    if (!std::isnan(b)) REQUIRE(zenflow::to_bfloat16(b).bits == bits);
  }
}

TEST_CASE("narrowing rounds to nearest even: a sweep over float bit patterns against a reference") {
  // Every 4099th pattern (about a million values, both signs, every exponent) ...
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) check_pattern(static_cast<std::uint32_t>(u));
  // ... and every pattern around the half-way points, the subnormal range edges and overflow.
  const std::uint32_t edges[] = {0x33000000u, 0x33800000u, 0x387fc000u, 0x38800000u, 0x477fe000u, 0x477ff000u,
                                 0x47800000u, 0x7f7f8000u, 0x7f7fffffu, 0x7f800000u, 0x00000001u, 0x3f808000u};
  for (std::uint32_t e : edges)
    for (std::uint32_t d = 0; d < 4096; ++d) {
      check_pattern(e - 2048 + d);
      check_pattern((e - 2048 + d) | 0x80000000u);
    }
}

TEST_CASE("named special cases") {
  using zenflow::to_bfloat16;
  using zenflow::to_float16;
  CHECK(to_float16(65504.0f).bits == 0x7bff);
  CHECK(to_float16(65519.99f).bits == 0x7bff);
  CHECK(to_float16(65520.0f).bits == 0x7c00);           // overflow rounds to infinity
  CHECK(to_float16(-1e30f).bits == 0xfc00);
  CHECK(to_float16(std::ldexp(1.0f, -24)).bits == 0x0001);  // smallest subnormal
  CHECK(to_float16(std::ldexp(1.0f, -25)).bits == 0x0000);  // tie: rounds to even (zero)
  CHECK(to_float16(std::ldexp(3.0f, -26)).bits == 0x0001);  // 0.75 ulp rounds up
  CHECK(to_float16(-0.0f).bits == 0x8000);
  CHECK(to_bfloat16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3f80);  // tie to even (down)
  CHECK(to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)).bits == 0x3f82);  // tie to even (up)
  CHECK(to_bfloat16(std::numeric_limits<float>::max()).bits == 0x7f80);  // overflow to infinity
  CHECK(to_bfloat16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(to_bfloat16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  CHECK(to_bfloat16(bits_f(0x00010000u)).bits == 0x0001);  // bf16 subnormal kept
  CHECK(std::isnan(zenflow::to_float(to_bfloat16(std::nanf("")))));
  CHECK(zenflow::dtype_size(zenflow::dtype::bf16) == 2);
  CHECK(zenflow::dtype_name(zenflow::dtype::f16) == "f16");
  CHECK(zenflow::from_float<zenflow::float16>(1.0f).bits == 0x3c00);
}

}  // namespace ZENFLOW_TEST_FILE_ID
