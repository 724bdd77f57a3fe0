// CRC32C (Castagnoli, the iSCSI / ext4 / NVMe checksum): the per-block checksum of the NVMe state
// tier (state_file.hpp), usable on its own.
//
// Two paths, bit-identical: the SSE4.2 `crc32` instruction (x86-64, chosen at run time from
// cpuid, compiled with a target attribute so the build machine's flags do not matter) and a
// portable slicing-by-8 table. Values follow RFC 3720 (reflected polynomial 0x82F63B78, initial
// value and final xor 0xFFFFFFFF); the RFC's test vectors are in tests/unit/test_crc32c.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "zenflow/detail/crc32c/crc32c_impl.hpp"
#include "zenflow/error.hpp"

namespace zenflow {

/// The implementations of crc32c. `automatic` picks `sse42` when the CPU has it, else `portable`.
enum class crc32c_isa : std::uint8_t { automatic, portable, sse42 };

/// "automatic", "portable" (slicing-by-8 table), "sse42" (the crc32 instruction).
constexpr std::string_view crc32c_isa_name(crc32c_isa isa) noexcept {
  switch (isa) {
    case crc32c_isa::automatic:
      return "automatic";
    case crc32c_isa::portable:
      return "portable";
    case crc32c_isa::sse42:
      return "sse42";
  }
  return "unknown";
}

/// The path `automatic` resolves to on this CPU (detected once per process).
inline crc32c_isa detect_crc32c_isa() noexcept {
  static const crc32c_isa best = detail::crc32c_cpu_has_sse42() ? crc32c_isa::sse42 : crc32c_isa::portable;
  return best;
}

/// True when `isa` can run here (`automatic` and `portable` always can).
inline bool crc32c_isa_supported(crc32c_isa isa) noexcept {
  return isa != crc32c_isa::sse42 || detect_crc32c_isa() == crc32c_isa::sse42;
}

/// The CRC32C of `data`, continuing from `previous` (the CRC32C of the bytes before it; 0 to
/// start): crc32c(b, crc32c(a)) == crc32c(a followed by b). Throws `zenflow::error` naming `isa`
/// when the CPU lacks the path asked for. Does not allocate; thread-safe.
inline std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t previous = 0,
                            crc32c_isa isa = crc32c_isa::automatic) {
  if (isa == crc32c_isa::automatic) isa = detect_crc32c_isa();
  const std::uint32_t state = ~previous;
  switch (isa) {
    case crc32c_isa::sse42:
      expects(crc32c_isa_supported(isa), "isa", "sse42 was asked for but this CPU has no SSE4.2 crc32 instruction");
#if ZENFLOW_CRC32C_X86
      return ~detail::crc32c_sse42(state, data.data(), data.size());
#else
      break;
#endif
    case crc32c_isa::portable:
    case crc32c_isa::automatic:
      break;
  }
  return ~detail::crc32c_portable(state, data.data(), data.size());
}

/// The CRC32C of a followed by b from crc32c(a), crc32c(b) and b's length in bytes, without the
/// bytes: crc32c_combine(crc32c(a), crc32c(b), size(b)) == crc32c(a followed by b). So pieces of a
/// stream checksummed apart, in any order, give the checksum of the whole. About 64 multiplications
/// in GF(2)[x] per call (0.1-1 microsecond); does not allocate; thread-safe.
constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t size_b) noexcept {
  // Feeding b into the register holding crc(a) gives crc(a) * x^(8 |b|) + crc(b) (the initial
  // value and the final xor cancel: CRC32C is affine in its input).
  return detail::crc32c_multiply(crc_a, detail::crc32c_x_to_8n(size_b)) ^ crc_b;
}

}  // namespace zenflow
