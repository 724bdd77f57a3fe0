// state_file: layout and lifetime, range reads and writes against a RAM mirror, the streaming
// pipeline in every mode and at every small read-ahead / write-behind depth (its buffer
// accounting through an engine that records what was in flight), ranges, stop, an exception
// from the caller's function, bad configurations. Faults are in test_state_file_faults.cpp.
// Run under ThreadSanitizer and AddressSanitizer too (presets tsan, asan).
#include <zenflow/state_file.hpp>

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../support/error_text.hpp"
#include "../support/faulty_engine.hpp"
#include "../support/storage_test_utils.hpp"

using zenflow::any_io_engine;
using zenflow::basic_state_file;
using zenflow::block_range;
using zenflow::state_file;
using zenflow::state_file_config;
using zenflow::stream_block;
using zenflow::stream_mode;
using zenflow_test::contains;
using zenflow_test::error_of;

namespace {

constexpr std::size_t kib = 1024;

state_file_config config(const zenflow_test::scratch_dir& dir, std::uint64_t bytes, std::size_t block = 16 * kib,
                         std::size_t read_ahead = 2, std::size_t write_behind = 2) {
  state_file_config c;
  c.directory = dir.path();
  c.bytes = bytes;
  c.block_bytes = block;
  c.read_ahead = read_ahead;
  c.write_behind = write_behind;
  c.pin = zenflow::pin_policy::none;
  return c;
}

// The engine kinds this build can run (automatic is io_uring where it runs).
std::vector<zenflow::io_engine_config> engine_configs(std::size_t queue_depth = 16) {
  std::vector<zenflow::io_engine_config> v{{zenflow::io_engine_kind::posix, queue_depth, 4}};
  any_io_engine probe = zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 2});
  if (probe.name() == "io_uring") v.push_back({zenflow::io_engine_kind::uring, queue_depth});
  return v;
}

std::uint64_t file_size(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return static_cast<std::uint64_t>(st.st_size);
}

}  // namespace

TEST_CASE("state_file: one preallocated file of whole blocks, named per rank, removed at destruction") {
  zenflow_test::scratch_dir dir;
  state_file_config c = config(dir, 10 * 16 * kib + 1);
  c.rank = 3;
  std::string path;
  {
    state_file f(c, {zenflow::io_engine_kind::automatic, 8});
    path = f.path();
    CHECK(path == dir.str() + "/zenflow_state.rank3.bin");
    CHECK(f.bytes() == 10 * 16 * kib + 1);
    CHECK(f.block_count() == 11);
    CHECK(f.capacity() == 11 * 16 * kib);
    CHECK(f.block_bytes() == 16 * kib);
    CHECK(f.direct());
    CHECK(file_size(path) == f.capacity());
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK(static_cast<std::uint64_t>(st.st_blocks) * 512 >= f.capacity());  // allocated, not sparse
    CHECK(f.pool().size() == zenflow::stream_buffers(2, 2));
    CHECK(f.pool().size() == 5);
    CHECK(f.pool().buffer_bytes() == 16 * kib);
    CHECK(contains(f.status(), path + ": 180224 bytes in 11 blocks of 16384, O_DIRECT, preallocated"));
    CHECK(contains(f.status(), "engine: " + f.engine().status()));
    CHECK(contains(f.status(), "pool: 5 x 16384 bytes, not pinned (pin_policy::none)"));
    CHECK(f.blocks_of(0, 0).count == 0);
    CHECK(f.blocks_of(16 * kib - 1, 2).first == 0);
    CHECK(f.blocks_of(16 * kib - 1, 2).count == 2);
    // A fresh file reads as zeros, and they verify.
    std::vector<std::byte> out(f.capacity(), std::byte{0x5a});
    f.read(0, out);
    CHECK(std::all_of(out.begin(), out.end(), [](std::byte b) { return b == std::byte{0}; }));
  }
  CHECK_FALSE(std::filesystem::exists(path));

  c.keep_file = true;
  c.file_name = "kept.bin";
  {
    state_file f(c);
    f.write(5, zenflow_test::pattern(100, 1));
  }
  CHECK(std::filesystem::exists(dir.path() / "kept.bin"));
  // A stale file (a killed run) is scratch: truncated and reused.
  c.keep_file = false;
  { state_file f(c); }
  CHECK_FALSE(std::filesystem::exists(dir.path() / "kept.bin"));
}

TEST_CASE("state_file: byte ranges read and write like a RAM mirror, on every engine") {
  for (const auto& ec : engine_configs()) {
    CAPTURE(zenflow::io_engine_kind_name(ec.kind));
    zenflow_test::scratch_dir dir;
    state_file f(config(dir, 20 * 16 * kib, 16 * kib, 3, 2), ec);
    std::vector<std::byte> mirror(f.capacity(), std::byte{0});
    struct span_case {
      std::uint64_t offset, bytes;
    };
    const std::vector<span_case> cases{{0, 16 * kib},
                                       {16 * kib, 5 * 16 * kib},
                                       {1, 1},
                                       {100, 40000},
                                       {16 * kib - 3, 7},
                                       {3 * 16 * kib + 5, 9 * 16 * kib},
                                       {0, 20 * 16 * kib},
                                       {19 * 16 * kib + 10, 16 * kib - 10}};
    std::uint32_t seed = 1;
    for (const auto& sc : cases) {
      CAPTURE(sc.offset);
      CAPTURE(sc.bytes);
      const auto data = zenflow_test::pattern(sc.bytes, seed++);
      f.write(sc.offset, data);
      std::copy(data.begin(), data.end(), mirror.begin() + static_cast<std::ptrdiff_t>(sc.offset));
      std::vector<std::byte> back(sc.bytes);
      f.read(sc.offset, back);
      CHECK(back == data);
    }
    std::vector<std::byte> all(f.capacity());
    f.read(0, all);
    CHECK(all == mirror);
    CHECK(f.engine().in_flight() == 0);
    CHECK(f.counters().bytes_written > 0);
    CHECK(f.counters().bytes_read > 0);
    CHECK(f.counters().checksum_failures == 0);
    f.write(0, {});  // empty: nothing
    f.read(f.capacity(), {});
    CHECK(error_of([&] { f.read(f.capacity() - 10, std::span<std::byte>(all).first(11)); }) ==
          "zenflow: offset: bytes [327670, 327681) are outside the file's 327680 bytes");
    CHECK(error_of([&] { f.write(f.capacity() + 1, std::span<const std::byte>(all).first(0)); }) ==
          "zenflow: offset: bytes [327681, 327681) are outside the file's 327680 bytes");
  }
}

TEST_CASE("state_file: grow extends the file by zero blocks, keeps what was written, and checks them") {
  for (const auto& ec : engine_configs()) {
    CAPTURE(zenflow::io_engine_kind_name(ec.kind));
    zenflow_test::scratch_dir dir;
    state_file f(config(dir, 3 * 16 * kib), ec);
    const auto data = zenflow_test::pattern(3 * 16 * kib, 5);
    f.write(0, data);
    f.grow(2 * 16 * kib);  // a size it holds: nothing changes
    CHECK(f.block_count() == 3);
    f.grow(7 * 16 * kib + 1);  // whole blocks: 8
    CHECK(f.block_count() == 8);
    CHECK(f.capacity() == 8 * 16 * kib);
    CHECK(file_size(f.path()) == 8 * 16 * kib);
    std::vector<std::byte> all(f.capacity());
    f.read(0, all);  // every block verifies: the old ones hold their bytes, the new ones zeros
    CHECK(std::equal(data.begin(), data.end(), all.begin()));
    CHECK(std::all_of(all.begin() + static_cast<std::ptrdiff_t>(data.size()), all.end(),
                      [](std::byte b) { return b == std::byte{0}; }));
    const auto more = zenflow_test::pattern(5 * 16 * kib, 6);
    f.write(3 * 16 * kib, more);  // the new blocks stream like the others
    std::vector<std::byte> back(more.size());
    f.read(3 * 16 * kib, back);
    CHECK(back == more);
    CHECK(f.counters().checksum_failures == 0);
    CHECK(contains(error_of([&] { f.grow(std::numeric_limits<std::uint64_t>::max()); }), "bytes"));
    CHECK(f.block_count() == 8);
  }
}

TEST_CASE("state_file: stream update at every read-ahead / write-behind depth, never more buffers than the pool") {
  using tracked = zenflow_test::faulty_engine<any_io_engine>;
  for (const auto& ec : engine_configs(8)) {
    for (std::size_t r = 0; r <= 3; ++r)
      for (std::size_t w = 0; w <= 3; ++w) {
        CAPTURE(zenflow::io_engine_kind_name(ec.kind));
        CAPTURE(r);
        CAPTURE(w);
        zenflow_test::scratch_dir dir;
        constexpr std::size_t blocks = 13;
        tracked engine(zenflow::make_io_engine(ec));
        const auto stats = engine.stats();
        basic_state_file<tracked> f(config(dir, blocks * 4 * kib, 4 * kib, r, w), std::move(engine));
        REQUIRE(f.pool().size() == r + 1 + w);
        std::vector<std::byte> mirror(f.capacity(), std::byte{0});
        for (int pass = 0; pass < 3; ++pass) {
          const block_range all{0, blocks};
          std::uint64_t expected_position = 0;
          std::uint64_t reads_at_first_block = 0;
          const auto result = f.stream({&all, 1}, stream_mode::update, [&](const stream_block& b) {
            if (b.position == 0) reads_at_first_block = stats->submitted_reads;
            CHECK(b.position == expected_position++);
            CHECK(b.index == b.position);
            CHECK(b.offset == b.index * 4 * kib);
            REQUIRE(b.data.size() == 4 * kib);
            // The block as the last pass left it, then this pass's change.
            CHECK(std::equal(b.data.begin(), b.data.end(), mirror.begin() + static_cast<std::ptrdiff_t>(b.offset)));
            for (std::size_t i = 0; i < b.data.size(); i += 97)
              b.data[i] = static_cast<std::byte>(static_cast<unsigned>(b.data[i]) + b.index + 7u * pass + 1u);
            std::copy(b.data.begin(), b.data.end(), mirror.begin() + static_cast<std::ptrdiff_t>(b.offset));
          });
          CHECK(result.blocks == blocks);
          CHECK_FALSE(result.stopped);
          CHECK(f.engine().in_flight() == 0);
          CHECK(reads_at_first_block == stats->submitted_reads - blocks + std::min<std::uint64_t>(blocks, r + 1));
        }
        CHECK(stats->max_in_flight <= r + 1 + w);
        CHECK(stats->max_reads == r + 1);  // the first block's read and r more, at once
        std::vector<std::byte> back(f.capacity());
        f.read(0, back);
        CHECK(back == mirror);
      }
  }
}

TEST_CASE("state_file: stream modes, several ranges in the caller's order, checks before any I/O") {
  using tracked = zenflow_test::faulty_engine<any_io_engine>;
  zenflow_test::scratch_dir dir;
  tracked engine(zenflow::make_io_engine({zenflow::io_engine_kind::automatic, 8}));
  const auto stats = engine.stats();
  basic_state_file<tracked> f(config(dir, 16 * 8 * kib, 8 * kib), std::move(engine));
  // write: fn fills, nothing is read.
  const std::vector<block_range> ranges{{10, 3}, {0, 2}, {5, 1}};
  std::vector<std::uint64_t> order;
  f.stream(ranges, stream_mode::write, [&](const stream_block& b) {
    order.push_back(b.index);
    std::fill(b.data.begin(), b.data.end(), static_cast<std::byte>(b.index + 1));
  });
  CHECK(order == std::vector<std::uint64_t>{10, 11, 12, 0, 1, 5});
  CHECK(stats->submitted_reads == 0);
  CHECK(stats->submitted_writes == 6);
  // read: fn sees the data, nothing is written; a range may repeat.
  order.clear();
  const std::vector<block_range> again{{5, 1}, {0, 2}, {5, 1}, {6, 1}};
  f.stream(again, stream_mode::read, [&](const stream_block& b) {
    order.push_back(b.index);
    const auto expect = static_cast<std::byte>(b.index == 6 ? 0 : b.index + 1);
    CHECK(std::all_of(b.data.begin(), b.data.end(), [&](std::byte x) { return x == expect; }));
  });
  CHECK(order == std::vector<std::uint64_t>{5, 0, 1, 5, 6});
  CHECK(stats->submitted_writes == 6);
  CHECK(f.block_checksum(10) == zenflow::crc32c(std::vector<std::byte>(8 * kib, std::byte{11})));

  const auto writes_before = stats->submitted_writes, reads_before = stats->submitted_reads;
  auto nothing = [](const stream_block&) {};
  const std::vector<block_range> overlap{{0, 4}, {3, 2}};
  CHECK(error_of([&] { f.stream(overlap, stream_mode::update, nothing); }) ==
        "zenflow: ranges: blocks [0, 4) and [3, 5) overlap: a block may be written once per stream");
  CHECK(error_of([&] { f.stream(overlap, stream_mode::write, nothing); }) ==
        "zenflow: ranges: blocks [0, 4) and [3, 5) overlap: a block may be written once per stream");
  CHECK_NOTHROW(f.stream(overlap, stream_mode::read, nothing));
  const std::vector<block_range> outside{{0, 1}, {15, 2}};
  CHECK(error_of([&] { f.stream(outside, stream_mode::read, nothing); }) ==
        "zenflow: ranges: range 1 (blocks [15, 17)) is outside the file's 16 blocks");
  CHECK(error_of([&] { f.stream({}, static_cast<stream_mode>(9), nothing); }) ==
        "zenflow: mode: must be stream_mode::read, write or update");
  CHECK(stats->submitted_writes == writes_before);
  CHECK(stats->submitted_reads == reads_before + 6);  // only the valid read stream
  CHECK(f.stream({}, stream_mode::update, nothing).blocks == 0);
  const std::vector<block_range> empty_ranges{{3, 0}, {3, 0}};
  CHECK(f.stream(empty_ranges, stream_mode::update, nothing).blocks == 0);
}

TEST_CASE("state_file: a stop request ends the stream after the block in hand, with nothing in flight") {
  zenflow_test::scratch_dir dir;
  state_file f(config(dir, 12 * 4 * kib, 4 * kib, 3, 3), {zenflow::io_engine_kind::automatic, 8});
  std::stop_source stop;
  const block_range all{0, 12};
  const auto result = f.stream(
      {&all, 1}, stream_mode::update,
      [&](const stream_block& b) {
        std::fill(b.data.begin(), b.data.end(), std::byte{0x77});
        if (b.position == 4) stop.request_stop();
      },
      stop.get_token());
  CHECK(result.stopped);
  CHECK(result.blocks == 5);
  CHECK(f.engine().in_flight() == 0);
  std::vector<std::byte> back(f.capacity());
  f.read(0, back);
  for (std::size_t b = 0; b < 12; ++b) CHECK(back[b * 4 * kib + 100] == (b <= 4 ? std::byte{0x77} : std::byte{0}));
}

TEST_CASE(
    "state_file: an exception from the caller's function reaches the caller, nothing in flight, later blocks "
    "untouched") {
  for (const auto& ec : engine_configs(8)) {
    CAPTURE(zenflow::io_engine_kind_name(ec.kind));
    zenflow_test::scratch_dir dir;
    state_file f(config(dir, 12 * 4 * kib, 4 * kib, 3, 3), ec);
    const block_range all{0, 12};
    CHECK_THROWS_WITH_AS(f.stream({&all, 1}, stream_mode::update,
                                  [&](const stream_block& b) {
                                    std::fill(b.data.begin(), b.data.end(), std::byte{0x42});
                                    if (b.position == 6) throw std::runtime_error("the optimizer failed");
                                  }),
                         "the optimizer failed", std::runtime_error);
    CHECK(f.engine().in_flight() == 0);
    std::vector<std::byte> back(f.capacity());
    f.read(0, back);  // every block still verifies
    for (std::size_t b = 0; b < 12; ++b) CHECK(back[b * 4 * kib] == (b < 6 ? std::byte{0x42} : std::byte{0}));
    // The file works on.
    f.stream({&all, 1}, stream_mode::update, [](const stream_block& b) { b.data[0] = std::byte{1}; });
    f.read(0, back);
    CHECK(back[11 * 4 * kib] == std::byte{1});
  }
}

TEST_CASE("state_file: two files on one path: the second is refused while the first lives") {
  zenflow_test::scratch_dir dir;
  state_file first(config(dir, 64 * kib));
  first.write(0, zenflow_test::pattern(100, 9));
  CHECK(contains(error_of([&] { state_file second(config(dir, 64 * kib)); }),
                 "zenflow: file_name: " + first.path() + " is in use by another process (flock: "));
  std::vector<std::byte> back(100);
  first.read(0, back);  // the refused second one neither truncated nor removed it
  CHECK(back == zenflow_test::pattern(100, 9));
}

TEST_CASE("state_file: bad configurations name the field, before any file exists") {
  zenflow_test::scratch_dir dir;
  const auto with = [&](const std::function<void(state_file_config&)>& edit,
                        zenflow::io_engine_config engine = {zenflow::io_engine_kind::posix, 16}) {
    state_file_config c = config(dir, 64 * kib);
    edit(c);
    return error_of([&] { state_file f(c, engine); });
  };
  CHECK(with([](auto& c) { c.directory.clear(); }) ==
        "zenflow: directory: must name a directory on the SSD, got an empty path");
  CHECK(with([](auto& c) { c.file_name = "a/b"; }) ==
        "zenflow: file_name: must be a plain file name (no '/'), got \"a/b\"");
  CHECK(with([](auto& c) { c.file_name = ".."; }) ==
        "zenflow: file_name: must be a plain file name (no '/'), got \"..\"");
  CHECK(with([](auto& c) { c.rank = -1; }) == "zenflow: rank: must be >= 0, got -1");
  CHECK(with([](auto& c) { c.bytes = 0; }) == "zenflow: bytes: must be positive, got 0");
  CHECK(with([](auto& c) { c.block_bytes = 1000; }) ==
        "zenflow: block_bytes: must be a positive multiple of 4096 (the O_DIRECT alignment), got 1000");
  CHECK(with([](auto& c) { c.read_ahead = 5000; }) == "zenflow: read_ahead: must be at most 1024, got 5000");
  CHECK(with([](auto& c) { c.write_behind = 5000; }) == "zenflow: write_behind: must be at most 1024, got 5000");
  CHECK(with([](auto& c) { c.pin = static_cast<zenflow::pin_policy>(7); }) ==
        "zenflow: pin: must be pin_policy::automatic, required or none");
  CHECK(with([](auto& c) { c.read_ahead = 8, c.write_behind = 8; }) ==
        "zenflow: queue_depth: the engine's queue depth 16 is below the stream's read_ahead + 1 + write_behind = 17 "
        "buffers, every one of which may be in flight");
  CHECK(with([](auto& c) {
          c.hook = {"h", [](void*, std::size_t) {}, [](void*, std::size_t) {}};
        }) == "zenflow: hook: a pin hook (h) was given with pin_policy::none");
  CHECK(with([](auto&) {}, {zenflow::io_engine_kind::posix, 0}) == "zenflow: queue_depth: must be in [1, 4096], got 0");
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("state_file: the pool's pinned bytes are exactly the stream's buffers") {
  zenflow_test::scratch_dir dir;
  state_file_config c = config(dir, 1 << 20, 64 * kib, 3, 2);
  c.pin = zenflow::pin_policy::automatic;
  const long long before = zenflow_test::locked_bytes();
  state_file f(c, {zenflow::io_engine_kind::posix, 8});
  CHECK(f.pool().total_bytes() == 6 * 64 * kib);
  if (f.pool().pinned()) {
    CHECK(f.pool().pinned_bytes() == 6 * 64 * kib);
    if (!zenflow_test::mlock_is_intercepted) CHECK(zenflow_test::locked_bytes() - before == 6 * 64 * kib);
  } else {
    MESSAGE("not pinned here: " << f.pool().status());
  }
}
