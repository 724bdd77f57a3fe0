// host_transfer_queue: ordering, slot reuse, backpressure, pipelining, shutdown, errors, counters.
// Run under ThreadSanitizer and AddressSanitizer too (presets tsan, asan).
#include <zenflow/concepts.hpp>
#include <zenflow/transfer_queue.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace std::chrono_literals;
using zenflow::host_stream;
using zenflow::host_transfer_queue;
using zenflow::transfer_direction;
using zenflow::transfer_slot;

static_assert(zenflow::transfer_queue<host_transfer_queue>);
static_assert(std::is_same_v<host_transfer_queue::stream_type, host_stream&>);

namespace {

constexpr auto d2h = transfer_direction::device_to_host;
constexpr auto h2d = transfer_direction::host_to_device;

std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::byte>(x);
  }
  return v;
}

// A gate a copy hook can block on, so a test holds copies in flight deterministically.
struct gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  void wait() {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return open; });
  }
  void release() {
    {
      std::lock_guard lock(m);
      open = true;
    }
    cv.notify_all();
  }
};

}  // namespace

TEST_CASE("construction validates its arguments") {
  CHECK_THROWS_AS(host_transfer_queue(d2h, 64, 1), zenflow::error);
  CHECK_THROWS_AS(host_transfer_queue(d2h, 0, 2), zenflow::error);
  CHECK_THROWS_AS(host_transfer_queue(static_cast<transfer_direction>(7), 64, 2), zenflow::error);
  try {
    host_transfer_queue q(h2d, 64, 1);
  } catch (const zenflow::error& e) {
    CHECK(e.argument() == "slot_count");
  }
  host_transfer_queue q(h2d, 100, 3);
  CHECK(q.direction() == h2d);
  CHECK(q.slot_count() == 3);
  CHECK(q.slot_bytes() == 100);
  CHECK(q.idle());
  CHECK(q.counters().bytes == 0);
}

TEST_CASE("device_to_host: slots come out in submission order with their data") {
  host_stream stream;
  host_transfer_queue q(d2h, 1000, 2);
  const auto a = pattern(1000, 1), b = pattern(700, 2);
  const transfer_slot s0 = q.acquire();
  const transfer_slot s1 = q.acquire();
  CHECK(s0.index != s1.index);
  CHECK(s0.sequence < s1.sequence);
  CHECK(s0.capacity == 1000);
  CHECK(s0.bytes == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(s0.data) % zenflow::detail::slot_alignment == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(s1.data) % zenflow::detail::slot_alignment == 0);
  q.submit_device_to_host(s0, a.data(), a.size(), stream);
  q.submit_device_to_host(s1, b.data(), b.size(), stream);
  CHECK(!q.idle());

  const transfer_slot r0 = q.next();
  CHECK(r0.index == s0.index);
  CHECK(r0.sequence == s0.sequence);
  REQUIRE(r0.bytes == a.size());
  CHECK(std::memcmp(r0.data, a.data(), a.size()) == 0);
  const transfer_slot r1 = q.next();
  CHECK(r1.index == s1.index);
  REQUIRE(r1.bytes == b.size());
  CHECK(std::memcmp(r1.data, b.data(), b.size()) == 0);
  q.release(r1);  // release order need not follow consumption order
  q.release(r0);
  CHECK(q.idle());
  CHECK(q.counters().bytes == 1700);
  CHECK(q.counters().transfers == 2);
  CHECK(!q.try_next());
}

TEST_CASE("device_to_host copies are ordered after the caller's stream work (event, caller not blocked)") {
  host_stream stream;
  host_transfer_queue q(d2h, 64, 2);
  std::vector<std::byte> src(64, std::byte{0});
  std::atomic<bool> go{false};
  stream.enqueue([&] {
    while (!go) std::this_thread::sleep_for(1ms);
    std::memset(src.data(), 0x5a, src.size());  // the "kernel" producing the gradient
  });
  const auto slot = q.acquire();
  q.submit_device_to_host(slot, src.data(), src.size(), stream);  // returns at once
  std::this_thread::sleep_for(10ms);
  CHECK(!q.try_next());  // the copy waits for the caller's stream
  go = true;
  const auto r = q.next();
  for (std::size_t i = 0; i < r.bytes; ++i) CHECK(r.data[i] == std::byte{0x5a});
  q.release(r);
}

TEST_CASE("a slot is reused only after its consumer released it") {
  host_stream stream;
  host_transfer_queue q(d2h, 16, 2);
  const auto src = pattern(16, 3);
  auto s0 = q.acquire();
  auto s1 = q.acquire();
  CHECK(!q.try_acquire());  // backpressure: both slots busy
  q.submit_device_to_host(s0, src.data(), 16, stream);
  q.submit_device_to_host(s1, src.data(), 16, stream);
  const auto r0 = q.next();
  CHECK(!q.try_acquire());  // consumed but not released: still busy
  const auto r1 = q.next();
  CHECK(!q.try_acquire());
  q.release(r0);
  const auto again = q.try_acquire();
  REQUIRE(again);
  CHECK(again->index == r0.index);
  CHECK(again->sequence > r1.sequence);
  CHECK(!q.try_acquire());
  q.release(r1);
  q.release(*again);  // abandoning an acquired, never submitted slot is allowed
  CHECK(q.idle());
}

TEST_CASE("host_to_device: a slot frees itself only after its copy completed") {
  host_stream stream;
  host_transfer_queue q(h2d, 32, 2);
  gate g;
  q.set_copy_hook([&](std::size_t, std::size_t) { g.wait(); });
  std::vector<std::byte> dst0(32), dst1(32);
  auto s0 = q.acquire();
  auto s1 = q.acquire();
  std::memset(s0.data, 1, 32);
  std::memset(s1.data, 2, 32);
  q.submit_host_to_device(s0, dst0.data(), 32, stream);
  q.submit_host_to_device(s1, dst1.data(), 32, stream);
  CHECK(q.idle());          // nobody holds a slot ...
  CHECK(!q.try_acquire());  // ... but both copies are still in flight
  std::atomic<bool> got{false};
  auto waiter = std::async(std::launch::async, [&] {
    auto s = q.acquire();  // blocks on the oldest slot's copy
    got = true;
    return s;
  });
  std::this_thread::sleep_for(20ms);
  CHECK(!got);
  g.release();
  const auto s = waiter.get();
  CHECK(s.index == s0.index);
  CHECK(dst0[31] == std::byte{1});  // the copy completed before the slot came back
  stream.synchronize();             // the caller's stream was ordered after both copies
  CHECK(dst1[0] == std::byte{2});
  q.release(s);
  q.drain();
  CHECK(q.counters().bytes == 64);
}

TEST_CASE("host_to_device: later work on the caller's stream waits for the copy") {
  host_stream stream;
  host_transfer_queue q(h2d, 8, 2);
  gate g;
  q.set_copy_hook([&](std::size_t, std::size_t) { g.wait(); });
  std::vector<std::byte> dst(8);
  auto s = q.acquire();
  std::memset(s.data, 7, 8);
  q.submit_host_to_device(s, dst.data(), 8, stream);  // does not block
  std::atomic<int> seen{-1};
  stream.enqueue([&] { seen = static_cast<int>(dst[0]); });
  std::this_thread::sleep_for(10ms);
  CHECK(seen == -1);
  g.release();
  stream.synchronize();
  CHECK(seen == 7);
}

TEST_CASE("host_to_device: the copy waits for work already on the caller's stream") {
  host_stream stream;
  host_transfer_queue q(h2d, 8, 2);
  std::vector<std::byte> dst(8, std::byte{0});
  gate g;
  std::atomic<int> read_by_earlier_work{-1};
  stream.enqueue([&] {  // earlier work on the caller's stream, still using dst
    g.wait();
    read_by_earlier_work = static_cast<int>(dst[0]);
  });
  auto s = q.acquire();
  std::memset(s.data, 9, 8);
  q.submit_host_to_device(s, dst.data(), 8, stream);  // does not block
  std::this_thread::sleep_for(10ms);
  CHECK(dst[0] == std::byte{0});  // not overwritten under the earlier work
  g.release();
  stream.synchronize();
  CHECK(read_by_earlier_work == 0);
  CHECK(dst[0] == std::byte{9});
}

TEST_CASE("backpressure: acquire blocks until a consumer releases (device_to_host)") {
  host_stream stream;
  host_transfer_queue q(d2h, 8, 2);
  const auto src = pattern(8, 4);
  for (int i = 0; i < 2; ++i) q.submit_device_to_host(q.acquire(), src.data(), 8, stream);
  CHECK(!q.try_acquire());
  std::atomic<bool> got{false};
  auto producer = std::async(std::launch::async, [&] {
    auto s = q.acquire();
    got = true;
    return s;
  });
  std::this_thread::sleep_for(20ms);
  CHECK(!got);
  const auto r = q.next();
  std::this_thread::sleep_for(5ms);
  CHECK(!got);  // consumed is not released
  q.release(r);
  const auto s = producer.get();
  CHECK(s.index == r.index);
  q.release(s);
  q.release(q.next());
}

TEST_CASE("a producer thread and a consumer thread: order and data hold under contention") {
  host_stream stream;
  constexpr std::size_t slot = 256, count = 3;
  constexpr int transfers = 2000;
  host_transfer_queue q(d2h, slot, count);
  std::vector<std::vector<std::byte>> sources;
  for (int i = 0; i < transfers; ++i) sources.push_back(pattern(1 + (i * 37) % slot, static_cast<std::uint32_t>(i)));
  std::thread producer([&] {
    for (int i = 0; i < transfers; ++i) {
      auto s = q.acquire();
      q.submit_device_to_host(s, sources[i].data(), sources[i].size(), stream);
    }
  });
  std::uint64_t last_sequence = 0;
  bool ok = true;
  for (int i = 0; i < transfers; ++i) {
    auto s = (i % 2) ? q.next() : [&] {
      for (;;) {
        if (auto t = q.try_next()) return *t;
        std::this_thread::yield();
      }
    }();
    ok = ok && (i == 0 || s.sequence > last_sequence);
    last_sequence = s.sequence;
    ok = ok && s.bytes == sources[i].size() && std::memcmp(s.data, sources[i].data(), s.bytes) == 0;
    q.release(s);
  }
  producer.join();
  CHECK(ok);
  CHECK(q.counters().transfers == transfers);
  CHECK(q.idle());
}

TEST_CASE("pipelined copies larger than all slots together, both directions") {
  host_stream stream;
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{4096}, std::size_t{1234567}}) {
    CAPTURE(bytes);
    const auto src = pattern(bytes, 9);
    std::vector<std::byte> mid(bytes), back(bytes);
    host_transfer_queue down(d2h, 4096, 3), up(h2d, 4096, 2);
    zenflow::pipelined_copy_to_host(down, mid.data(), src.data(), bytes, stream);
    CHECK(mid == src);
    CHECK(down.idle());
    CHECK(down.counters().bytes == bytes);
    CHECK(down.counters().transfers == (bytes + 4095) / 4096);
    zenflow::pipelined_copy_to_device(up, back.data(), mid.data(), bytes, stream);
    CHECK(back == src);  // synchronous: the bytes are there on return
    CHECK(up.idle());
    CHECK(up.counters().bytes == bytes);
    // The queues are reusable afterwards.
    zenflow::pipelined_copy_to_host(down, mid.data(), src.data(), bytes, stream);
    zenflow::pipelined_copy_to_device(up, back.data(), mid.data(), bytes, stream);
    CHECK(back == src);
  }
}

TEST_CASE("pipelined copies check their arguments") {
  host_stream stream;
  host_transfer_queue down(d2h, 64, 2), up(h2d, 64, 2);
  std::vector<std::byte> a(128), b(128);
  CHECK_THROWS_AS(zenflow::pipelined_copy_to_host(up, a.data(), b.data(), 128, stream), zenflow::error);
  CHECK_THROWS_AS(zenflow::pipelined_copy_to_device(down, a.data(), b.data(), 128, stream), zenflow::error);
  CHECK_THROWS_AS(zenflow::pipelined_copy_to_host(down, nullptr, b.data(), 128, stream), zenflow::error);
  auto held = down.acquire();
  CHECK_THROWS_AS(zenflow::pipelined_copy_to_host(down, a.data(), b.data(), 128, stream), zenflow::error);
  down.release(held);
}

TEST_CASE("destroying a queue with copies in flight drains them (no use-after-free)") {
  host_stream stream;
  const auto src = pattern(1 << 16, 5);
  std::vector<std::byte> dst(1 << 16);
  {
    host_transfer_queue q(d2h, 1 << 16, 2);
    q.set_copy_hook([](std::size_t, std::size_t) { std::this_thread::sleep_for(5ms); });
    q.submit_device_to_host(q.acquire(), src.data(), src.size(), stream);
    q.submit_device_to_host(q.acquire(), src.data(), src.size(), stream);
    (void)q.next();  // one consumed and held, one in flight, when the queue goes away
  }
  {
    host_transfer_queue q(h2d, 1 << 16, 2);
    q.set_copy_hook([](std::size_t, std::size_t) { std::this_thread::sleep_for(5ms); });
    auto s = q.acquire();
    std::memcpy(s.data, src.data(), src.size());
    q.submit_host_to_device(s, dst.data(), dst.size(), stream);
  }
  CHECK(dst == src);  // the destructor finished the copy
  stream.synchronize();
  std::atomic<bool> go{false};  // outlives the stream's task that reads it
  std::thread releaser([&] {
    std::this_thread::sleep_for(10ms);
    go = true;
  });
  {
    // A copy still blocked behind the caller's stream when the queue goes away.
    host_transfer_queue q(d2h, 64, 2);
    stream.enqueue([&] {
      while (!go) std::this_thread::sleep_for(1ms);
    });
    q.submit_device_to_host(q.acquire(), src.data(), 64, stream);
  }
  releaser.join();
  stream.synchronize();
}

TEST_CASE("an error on the caller's stream reaches the consumer through the copy path") {
  host_stream stream;
  host_transfer_queue q(d2h, 64, 2);
  const auto src = pattern(64, 6);
  stream.enqueue([] { throw std::runtime_error("backward kernel failed"); });
  q.submit_device_to_host(q.acquire(), src.data(), 64, stream);
  CHECK_THROWS_WITH_AS(q.next(), "backward kernel failed", std::runtime_error);
  // Sticky: every later call (but release) reports it.
  CHECK_THROWS_AS(q.acquire(), std::runtime_error);
  CHECK_THROWS_AS(q.try_acquire(), std::runtime_error);
  CHECK_THROWS_AS(q.drain(), std::runtime_error);
  CHECK_THROWS_AS(stream.synchronize(), std::runtime_error);
}

TEST_CASE("an exception in the copy worker reaches acquire(), try_next() and drain()") {
  host_stream stream;
  SUBCASE("host_to_device, seen by acquire()") {
    host_transfer_queue q(h2d, 64, 2);
    std::vector<std::byte> dst(64);
    q.set_copy_hook([](std::size_t, std::size_t) { throw std::runtime_error("copy failed"); });
    q.submit_host_to_device(q.acquire(), dst.data(), 64, stream);
    q.submit_host_to_device(q.acquire(), dst.data(), 64, stream);
    CHECK_THROWS_WITH_AS(q.acquire(), "copy failed", std::runtime_error);
    CHECK_THROWS_AS(q.drain(), std::runtime_error);
    CHECK_THROWS_AS(stream.synchronize(), std::runtime_error);  // the caller's stream waited on it
  }
  SUBCASE("device_to_host, seen by try_next()") {
    host_transfer_queue q(d2h, 64, 2);
    const auto src = pattern(64, 7);
    q.set_copy_hook([](std::size_t, std::size_t) { throw std::runtime_error("copy failed"); });
    q.submit_device_to_host(q.acquire(), src.data(), 64, stream);
    bool thrown = false;
    for (int i = 0; i < 1000 && !thrown; ++i) {
      try {
        (void)q.try_next();
        std::this_thread::sleep_for(1ms);
      } catch (const std::runtime_error&) {
        thrown = true;
      }
    }
    CHECK(thrown);
    CHECK_THROWS_AS(q.next(), std::runtime_error);
  }
  SUBCASE("device_to_host, seen by drain() and by a pipelined copy") {
    host_transfer_queue q(d2h, 64, 2);
    const auto src = pattern(1000, 8);
    std::vector<std::byte> dst(1000);
    std::atomic<int> copies{0};
    q.set_copy_hook([&](std::size_t, std::size_t) {
      if (++copies == 3) throw std::runtime_error("copy 3 failed");
    });
    CHECK_THROWS_WITH_AS(zenflow::pipelined_copy_to_host(q, dst.data(), src.data(), 1000, stream), "copy 3 failed",
                         std::runtime_error);
    CHECK_THROWS_AS(q.drain(), std::runtime_error);
  }
}

TEST_CASE("releasing or submitting a slot one does not hold throws, before any change") {
  host_stream stream;
  host_transfer_queue q(d2h, 64, 2), other(d2h, 64, 2);
  const auto src = pattern(64, 9);
  const auto foreign = other.acquire();
  auto check_argument = [](auto&& call, const char* argument) {
    try {
      call();
      FAIL("expected zenflow::error");
    } catch (const zenflow::error& e) {
      CHECK(e.argument() == argument);
    }
  };
  check_argument([&] { q.release(foreign); }, "slot");  // same index and sequence, other queue
  transfer_slot made_up{};
  made_up.index = 5;
  check_argument([&] { q.release(made_up); }, "slot");
  const auto s = q.acquire();
  check_argument([&] { q.submit_device_to_host(foreign, src.data(), 64, stream); }, "slot");
  check_argument([&] { q.submit_device_to_host(s, src.data(), 65, stream); }, "bytes");  // too big
  check_argument([&] { q.submit_device_to_host(s, nullptr, 64, stream); }, "src");
  check_argument([&] { q.submit_host_to_device(s, nullptr, 64, stream); }, "direction");
  q.submit_device_to_host(s, src.data(), 64, stream);                                   // still acquired: fine
  check_argument([&] { q.release(s); }, "slot");                                        // in flight
  check_argument([&] { q.submit_device_to_host(s, src.data(), 64, stream); }, "slot");  // twice
  const auto r = q.next();
  q.release(r);
  check_argument([&] { q.release(r); }, "slot");  // double release
  const auto again = q.acquire();
  check_argument([&] { q.release(s); }, "slot");  // stale handle of a reused slot
  q.release(again);
  other.release(foreign);
  host_transfer_queue up(h2d, 64, 2);
  check_argument([&] { (void)up.next(); }, "direction");
  check_argument([&] { (void)up.try_next(); }, "direction");
  CHECK(q.counters().transfers == 1);
}

TEST_CASE("counters count each direction's submitted bytes") {
  host_stream stream;
  host_transfer_queue down(d2h, 100, 2), up(h2d, 100, 2);
  const auto src = pattern(100, 10);
  std::vector<std::byte> dst(100);
  for (int i = 0; i < 5; ++i) {
    down.submit_device_to_host(down.acquire(), src.data(), 10u * (i + 1), stream);
    down.release(down.next());
    auto s = up.acquire();
    up.submit_host_to_device(s, dst.data(), 7, stream);
  }
  up.drain();
  CHECK(down.counters().bytes == 150);
  CHECK(down.counters().transfers == 5);
  CHECK(up.counters().bytes == 35);
  CHECK(up.counters().transfers == 5);
}

TEST_CASE("mapped_region: page-aligned, zero-filled, exact, moved and freed once") {
  using zenflow::detail::mapped_region;
  CHECK_THROWS_AS(mapped_region(0), zenflow::error);
  mapped_region a(12345);
  CHECK(a.size() == 12345);
  CHECK(a.mapped_bytes() % zenflow::detail::page_size() == 0);
  CHECK(a.mapped_bytes() - a.size() < zenflow::detail::page_size());  // no power-of-two rounding
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % zenflow::detail::page_size() == 0);
  CHECK(std::all_of(a.data(), a.data() + a.size(), [](std::byte b) { return b == std::byte{0}; }));
  mapped_region b(std::move(a));
  CHECK(!a);
  CHECK(b.size() == 12345);
  mapped_region big(std::size_t{300} << 20, 4);  // several pre-fault threads
  big.data()[big.size() - 1] = std::byte{1};
  b = std::move(big);
  CHECK(b.size() == (std::size_t{300} << 20));
}

}  // namespace ZENFLOW_TEST_FILE_ID
