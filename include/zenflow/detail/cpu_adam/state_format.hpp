// How a cpu_adam holds its optimizer state: `cpu_state_format` and what each format costs.
//
// The fp32 master copy of the parameters is kept in every format; the formats differ in how the
// moments are stored (see cpu_adam.hpp for the behaviour and docs/BENCHMARKS.md for figures).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace zenflow {

/// The storage of a cpu_adam's moments (the fp32 master copy is kept in every format).
enum class cpu_state_format : std::uint8_t {
  /// fp32 m and v: 12 bytes held per parameter, 28 moved per update (fp32 gradient in).
  fp32 = 0,
  /// bf16 m and v, computed in fp32 and stored with deterministic stochastic rounding: 8 bytes
  /// held, 20 moved.
  bf16_moments = 1,
  /// 8-bit m and v in blocks of `q8_block_rows` rows of one column, each block with an fp32
  /// scale per moment (m: signed 8-bit float code, v: unsigned 8-bit float code), stochastic
  /// rounding: about 6.03 bytes held, 16.06 moved.
  blockwise8_moments = 2,
};

/// Rows per block of the 8-bit format: a block is up to this many consecutive rows of one column
/// (column c's rows split at multiples of it), never more than one column.
inline constexpr std::size_t q8_block_rows = 256;

/// "fp32", "bf16_moments", "blockwise8_moments" ("unknown" for any other value).
constexpr std::string_view cpu_state_format_name(cpu_state_format f) noexcept {
  switch (f) {
    case cpu_state_format::fp32:
      return "fp32";
    case cpu_state_format::bf16_moments:
      return "bf16_moments";
    case cpu_state_format::blockwise8_moments:
      return "blockwise8_moments";
  }
  return "unknown";
}

/// The format a name spells (cpu_state_format_name's spelling); nullopt for any other string.
constexpr std::optional<cpu_state_format> parse_cpu_state_format(std::string_view name) noexcept {
  for (auto f : {cpu_state_format::fp32, cpu_state_format::bf16_moments, cpu_state_format::blockwise8_moments})
    if (name == cpu_state_format_name(f)) return f;
  return std::nullopt;
}

/// True for the three named formats.
constexpr bool is_valid(cpu_state_format f) noexcept {
  return f == cpu_state_format::fp32 || f == cpu_state_format::bf16_moments ||
         f == cpu_state_format::blockwise8_moments;
}

/// Bytes of moment storage per parameter (the fp32 master adds 4), without the 8-bit format's
/// block scales (8 bytes per block of up to q8_block_rows rows).
constexpr std::size_t moment_bytes_per_parameter(cpu_state_format f) noexcept {
  return f == cpu_state_format::fp32 ? 8 : f == cpu_state_format::bf16_moments ? 4 : 2;
}

}  // namespace zenflow
