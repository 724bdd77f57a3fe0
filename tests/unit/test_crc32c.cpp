// CRC32C: RFC 3720's test vectors on every path, the portable table and the SSE4.2 instruction
// bit-identical on every length and alignment, chaining, and the isa contract.
#include <zenflow/crc32c.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "../support/error_text.hpp"
#include "../support/storage_test_utils.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::crc32c;
using zenflow::crc32c_isa;

namespace {

std::vector<crc32c_isa> paths_here() {
  std::vector<crc32c_isa> p{crc32c_isa::portable, crc32c_isa::automatic};
  if (zenflow::crc32c_isa_supported(crc32c_isa::sse42)) p.push_back(crc32c_isa::sse42);
  return p;
}

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> v(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) v[i] = static_cast<std::byte>(s[i]);
  return v;
}

}  // namespace

TEST_CASE("crc32c: RFC 3720 B.4 test vectors on every path") {
  std::vector<std::byte> zeros(32, std::byte{0x00}), ones(32, std::byte{0xff}), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[static_cast<std::size_t>(i)] = static_cast<std::byte>(i);
    down[static_cast<std::size_t>(i)] = static_cast<std::byte>(31 - i);
  }
  // An iSCSI SCSI Read (10) command PDU (RFC 3720, B.4).
  const std::array<unsigned char, 48> pdu = {0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                             0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
                                             0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
                                             0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  std::vector<std::byte> read_pdu(pdu.size());
  for (std::size_t i = 0; i < pdu.size(); ++i) read_pdu[i] = static_cast<std::byte>(pdu[i]);

  for (const crc32c_isa isa : paths_here()) {
    CAPTURE(zenflow::crc32c_isa_name(isa));
    CHECK(crc32c(zeros, 0, isa) == 0x8a9136aau);
    CHECK(crc32c(ones, 0, isa) == 0x62a8ab43u);
    CHECK(crc32c(up, 0, isa) == 0x46dd794eu);
    CHECK(crc32c(down, 0, isa) == 0x113fdb5cu);
    CHECK(crc32c(read_pdu, 0, isa) == 0xd9963a56u);
    CHECK(crc32c(bytes_of("123456789"), 0, isa) == 0xe3069283u);  // the common check value
    CHECK(crc32c({}, 0, isa) == 0u);
  }
}

TEST_CASE("crc32c: the portable and SSE4.2 paths agree bit for bit on every length and alignment") {
  if (!zenflow::crc32c_isa_supported(crc32c_isa::sse42)) {
    MESSAGE("this CPU has no SSE4.2: only the portable path runs here");
    return;
  }
  CHECK(zenflow::detect_crc32c_isa() == crc32c_isa::sse42);
  const auto data = zenflow_test::pattern(4096 + 64, 7);
  for (std::size_t start = 0; start < 16; ++start)
    for (std::size_t len = 0; len <= 1100; len += (len < 80 ? 1 : 37)) {
      const std::span<const std::byte> s(data.data() + start, len);
      REQUIRE(crc32c(s, 0, crc32c_isa::portable) == crc32c(s, 0, crc32c_isa::sse42));
      REQUIRE(crc32c(s, 0xdeadbeefu, crc32c_isa::portable) == crc32c(s, 0xdeadbeefu, crc32c_isa::sse42));
    }
  // Around the lengths where the SSE4.2 path switches between 3 x 8192, 3 x 256 and one lane.
  const auto big = zenflow_test::pattern(std::size_t{1} << 20, 11);
  for (std::size_t start : {std::size_t{0}, std::size_t{3}, std::size_t{8}})
    for (std::size_t len :
         {767, 768, 769, 775, 24575, 24576, 24577, 24576 + 768 + 5, 3 * 24576 + 1000, 100000, (1 << 20) - 8}) {
      const std::span<const std::byte> s(big.data() + start, len);
      CAPTURE(start);
      CAPTURE(len);
      REQUIRE(crc32c(s, 0, crc32c_isa::portable) == crc32c(s, 0, crc32c_isa::sse42));
    }
}

TEST_CASE("crc32c: chaining equals the checksum of the concatenation") {
  const auto data = zenflow_test::pattern(10000, 3);
  const std::span<const std::byte> all(data);
  for (const crc32c_isa isa : paths_here())
    for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{9999}}) {
      CAPTURE(cut);
      CHECK(crc32c(all.subspan(cut), crc32c(all.first(cut), 0, isa), isa) == crc32c(all, 0, isa));
    }
}

TEST_CASE("crc32c_combine: the checksums of two pieces give that of the whole") {
  const auto data = zenflow_test::pattern(70000, 9);
  const std::span<const std::byte> all(data);
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{4096}, std::size_t{65537},
                          std::size_t{69999}, std::size_t{70000}}) {
    CAPTURE(cut);
    const auto a = all.first(cut), b = all.subspan(cut);
    CHECK(zenflow::crc32c_combine(crc32c(a), crc32c(b), b.size()) == crc32c(all));
  }
  // Three pieces, folded left to right; a combine with an empty piece changes nothing.
  const auto p0 = all.first(100), p1 = all.subspan(100, 50000), p2 = all.subspan(50100);
  const std::uint32_t left = zenflow::crc32c_combine(crc32c(p0), crc32c(p1), p1.size());
  CHECK(zenflow::crc32c_combine(left, crc32c(p2), p2.size()) == crc32c(all));
  CHECK(zenflow::crc32c_combine(0x12345678u, crc32c({}), 0) == 0x12345678u);
  // Feeding n zero bytes multiplies the register by x^(8 n): the table path agrees with the power,
  // and powers of lengths past 32 bits multiply as their exponents add.
  const std::vector<std::byte> zeros(1 << 20);
  for (std::size_t n : {std::size_t{1}, std::size_t{5}, std::size_t{4096}, zeros.size()}) {
    CAPTURE(n);
    CHECK(zenflow::detail::crc32c_portable(1u << 31, zeros.data(), n) == zenflow::detail::crc32c_x_to_8n(n));
  }
  const std::uint64_t a = (std::uint64_t{1} << 40) + 3, b = (std::uint64_t{1} << 35) + 77;
  CHECK(zenflow::detail::crc32c_multiply(zenflow::detail::crc32c_x_to_8n(a), zenflow::detail::crc32c_x_to_8n(b)) ==
        zenflow::detail::crc32c_x_to_8n(a + b));
}

TEST_CASE("crc32c: a single flipped bit changes the checksum") {
  auto data = zenflow_test::pattern(4096, 5);
  const std::uint32_t before = crc32c(data);
  for (std::size_t bit : {std::size_t{0}, std::size_t{1000}, std::size_t{32767}}) {
    data[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    CHECK(crc32c(data) != before);
    data[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
  }
  CHECK(crc32c(data) == before);
}

TEST_CASE("crc32c: names, and a path the CPU lacks is an error naming isa") {
  CHECK(zenflow::crc32c_isa_name(crc32c_isa::portable) == "portable");
  CHECK(zenflow::crc32c_isa_name(crc32c_isa::sse42) == "sse42");
  CHECK(zenflow::crc32c_isa_supported(crc32c_isa::portable));
  CHECK(zenflow::crc32c_isa_supported(crc32c_isa::automatic));
  CHECK(zenflow::detect_crc32c_isa() != crc32c_isa::automatic);
  if (!zenflow::crc32c_isa_supported(crc32c_isa::sse42)) {
    const std::string msg = zenflow_test::error_of([] { (void)crc32c({}, 0, crc32c_isa::sse42); });
    CHECK(zenflow_test::contains(msg, "isa"));
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
