// The per-block integrity record of a state file, kept in RAM: the CRC32C each block must have
// when read, and the blocks whose last write failed (unreadable until written again).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace zenflow::detail {

/// "0a1b2c3d".
inline std::string hex32(std::uint32_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(8, '0');
  for (int i = 7; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = digits[v & 0xfu];
  return s;
}

struct block_checksums {
  std::vector<std::uint32_t> crc;                       // per block
  std::unordered_map<std::uint64_t, std::string> lost;  // block -> why its content is unknown

  void reset(std::uint64_t blocks, std::uint32_t initial) {
    crc.assign(blocks, initial);
    lost.clear();
  }
  void written(std::uint64_t block, std::uint32_t c) {
    crc[block] = c;
    if (!lost.empty()) lost.erase(block);
  }
};

}  // namespace zenflow::detail
