// CRC32C kernels: a slicing-by-8 table (any CPU) and the SSE4.2 crc32 instruction (x86-64).
// Both work on the raw register (the caller inverts before and after) and give identical bits.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ZENFLOW_CRC32C_X86 1
#include <cpuid.h>
#include <nmmintrin.h>
#else
#define ZENFLOW_CRC32C_X86 0
#endif

namespace zenflow::detail {

inline constexpr std::uint32_t crc32c_polynomial = 0x82F63B78u;  // 0x1EDC6F41, bit-reflected

// table[k][b]: the register after feeding byte b followed by k zero bytes into a zero register.
inline constexpr auto crc32c_tables = [] {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ ((c & 1u) ? crc32c_polynomial : 0u);
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xffu];
  return t;
}();

// Polynomials over GF(2) modulo the CRC's, in the reflected order the register uses: bit 31 is
// the coefficient of x^0, bit 0 that of x^31. The product a * b mod P: b * x^i summed over the
// terms x^i of a (b * x is a shift toward bit 0, reduced by P when x^31's coefficient leaves).
constexpr std::uint32_t crc32c_multiply(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (std::uint32_t term = 1u << 31; term != 0; term >>= 1) {
    if ((a & term) != 0) product ^= b;
    b = (b & 1u) != 0 ? (b >> 1) ^ crc32c_polynomial : b >> 1;
  }
  return product;
}

// x^(8 n) mod P: feeding n zero bytes multiplies the register by it (square and multiply).
constexpr std::uint32_t crc32c_x_to_8n(std::uint64_t n) noexcept {
  std::uint32_t result = 1u << 31;  // 1
  std::uint32_t power = 1u << 23;   // x^8
  for (; n != 0; n >>= 1) {
    if ((n & 1u) != 0) result = crc32c_multiply(result, power);
    power = crc32c_multiply(power, power);
  }
  return result;
}

inline std::uint32_t crc32c_portable(std::uint32_t crc, const std::byte* p, std::size_t n) noexcept {
  const auto& t = crc32c_tables;
  for (; n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0; --n, ++p)
    crc = (crc >> 8) ^ t[0][(crc ^ static_cast<std::uint32_t>(*p)) & 0xffu];
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);  // little-endian byte order, as the reflected CRC consumes it
    word ^= crc;
    crc = t[7][word & 0xffu] ^ t[6][(word >> 8) & 0xffu] ^ t[5][(word >> 16) & 0xffu] ^ t[4][(word >> 24) & 0xffu] ^
          t[3][(word >> 32) & 0xffu] ^ t[2][(word >> 40) & 0xffu] ^ t[1][(word >> 48) & 0xffu] ^ t[0][word >> 56];
  }
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ static_cast<std::uint32_t>(*p)) & 0xffu];
  return crc;
}

#if ZENFLOW_CRC32C_X86
inline bool crc32c_cpu_has_sse42() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 20) & 1u) != 0;
}

// One lane: the crc32 instruction over n bytes (p 8-byte aligned, n a multiple of 8 on x86-64).
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42_lane(std::uint32_t crc, const std::byte* p,
                                                                         std::size_t n) noexcept {
#if defined(__x86_64__)
  std::uint64_t c64 = crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  crc = static_cast<std::uint32_t>(c64);
#endif
  for (; n > 0; --n, ++p) crc = _mm_crc32_u8(crc, static_cast<unsigned char>(*p));
  return crc;
}

// Feeding n zero bytes into the register multiplies it by x^(8 n) mod P (crc32c_x_to_8n), a linear
// map of the register over GF(2): the table applies it a byte of r at a time.
struct crc32c_zero_shift {
  std::array<std::array<std::uint32_t, 256>, 4> t{};
  explicit crc32c_zero_shift(std::size_t n) noexcept {
    const std::uint32_t shift = crc32c_x_to_8n(n);
    for (std::size_t k = 0; k < 4; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = crc32c_multiply(b << (8 * k), shift);
  }
  [[nodiscard]] std::uint32_t operator()(std::uint32_t r) const noexcept {
    return t[0][r & 0xffu] ^ t[1][(r >> 8) & 0xffu] ^ t[2][(r >> 16) & 0xffu] ^ t[3][r >> 24];
  }
};

// Three lanes of `lane` bytes each, run interleaved (the instruction has a 3-cycle latency and a
// 1-cycle throughput), then joined: crc(A B C) = M(M(crc(A)) ^ crc0(B)) ^ crc0(C), where crc0
// starts from a zero register and M feeds `lane` zero bytes.
template <std::size_t Lane>
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42_3way(std::uint32_t crc, const std::byte*& p,
                                                                         std::size_t& n) noexcept {
  static const crc32c_zero_shift shift(Lane);
  while (n >= 3 * Lane) {
    std::uint64_t a = crc, b = 0, c = 0;
    const std::byte* pb = p + Lane;
    const std::byte* pc = p + 2 * Lane;
    for (std::size_t i = 0; i < Lane; i += 8) {
      std::uint64_t wa = 0, wb = 0, wc = 0;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, pb + i, 8);
      std::memcpy(&wc, pc + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      c = _mm_crc32_u64(c, wc);
    }
    crc = shift(shift(static_cast<std::uint32_t>(a)) ^ static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(c);
    p += 3 * Lane;
    n -= 3 * Lane;
  }
  return crc;
}

__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t crc, const std::byte* p,
                                                                    std::size_t n) noexcept {
  for (; n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0; --n, ++p)
    crc = _mm_crc32_u8(crc, static_cast<unsigned char>(*p));
#if defined(__x86_64__)
  crc = crc32c_sse42_3way<8192>(crc, p, n);
  crc = crc32c_sse42_3way<256>(crc, p, n);
#endif
  return crc32c_sse42_lane(crc, p, n);
}
#else
inline bool crc32c_cpu_has_sse42() noexcept {
  return false;
}
#endif

}  // namespace zenflow::detail
