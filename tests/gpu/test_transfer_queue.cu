// cuda_transfer_queue on a real GPU: pinned memory, data integrity from 1 byte to 256 MB in both
// directions, both directions at once, copies overlapping a longer kernel, shutdown, errors.
#include <zenflow/concepts.hpp>
#include <zenflow/transfer_queue.cuh>

#include <doctest/doctest.h>

#include "../support/cuda_test_utils.cuh"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using zenflow::cuda_transfer_queue;
using zenflow::pinned_allocation;
using zenflow::pinned_buffer;
using zenflow::transfer_direction;

static_assert(zenflow::transfer_queue<cuda_transfer_queue>);
static_assert(std::is_same_v<cuda_transfer_queue::stream_type, cudaStream_t>);

namespace {

constexpr auto d2h = transfer_direction::device_to_host;
constexpr auto h2d = transfer_direction::host_to_device;
constexpr std::size_t MiB = std::size_t{1} << 20;

void fill_pattern(std::byte* p, std::size_t n, std::uint32_t seed) {
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<std::byte>(x);
  }
}

using zenflow_test::cuda_stream;  // non-blocking
using zenflow_test::device_buffer;
using zenflow_test::mapped_flags;
using zenflow_test::spin_until_flag;

// Round trip host -> device -> host through two queues; checks every byte.
void round_trip(std::size_t bytes, std::size_t slot_bytes, std::size_t slots, pinned_allocation up_kind,
                zenflow::event_wait wait = zenflow::event_wait::spin) {
  CAPTURE(bytes);
  CAPTURE(slot_bytes);
  CAPTURE(static_cast<int>(wait));
  cuda_stream stream;
  std::vector<std::byte> src(bytes), back(bytes);
  fill_pattern(src.data(), bytes, static_cast<std::uint32_t>(bytes));
  device_buffer dev(bytes);
  cuda_transfer_queue up(h2d, slot_bytes, slots, up_kind, wait),
      down(d2h, slot_bytes, slots, pinned_allocation::host_alloc, wait);
  zenflow::pipelined_copy_to_device(up, dev.data(), src.data(), bytes, stream.get());
  zenflow::pipelined_copy_to_host(down, back.data(), dev.data(), bytes, stream.get());
  CHECK(std::memcmp(src.data(), back.data(), bytes) == 0);
  CHECK(up.counters().bytes == bytes);
  CHECK(down.counters().bytes == bytes);
  CHECK(down.idle());
}

}  // namespace

TEST_CASE("pinned_buffer: every allocation kind is pinned, exact, moved and freed once") {
  for (auto kind : {pinned_allocation::host_alloc, pinned_allocation::write_combined, pinned_allocation::registered}) {
    CAPTURE(static_cast<int>(kind));
    pinned_buffer a(12345, kind);
    CHECK(a.size() == 12345);
    CHECK(a.allocation() == kind);
    cudaPointerAttributes attr{};
    REQUIRE(cudaPointerGetAttributes(&attr, a.data()) == cudaSuccess);
    CHECK(attr.type == cudaMemoryTypeHost);
    std::memset(a.data(), 1, a.size());
    pinned_buffer b(std::move(a));
    CHECK(!a);
    CHECK(b.size() == 12345);
    b = pinned_buffer(64, kind);
    CHECK(b.size() == 64);
    b.reset();
    CHECK(!b);
  }
  CHECK_THROWS_AS(pinned_buffer(0), zenflow::error);
  zenflow::pinned_pool pool(1000, 3);
  CHECK(pool.stride() == 1024);
  CHECK(pool.buffer().size() == 3 * 1024);  // one exact allocation
  CHECK(pool.slot(2) == pool.slot(0) + 2048);
}

TEST_CASE("data integrity from 1 byte to 256 MB, both directions") {
  for (std::size_t bytes : {std::size_t{1}, std::size_t{255}, std::size_t{4096}, MiB + 3, 16 * MiB + 17})
    round_trip(bytes, 4 * MiB, 2, pinned_allocation::host_alloc);
  round_trip(1 * MiB + 1, 1 * MiB, 3, pinned_allocation::write_combined);
  round_trip(256 * MiB, 16 * MiB, 2, pinned_allocation::write_combined);
  round_trip(256 * MiB, 64 * MiB, 4, pinned_allocation::registered);
  round_trip(64 * MiB + 3, 4 * MiB, 2, pinned_allocation::host_alloc, zenflow::event_wait::block);  // sleeping waits
}

TEST_CASE("slot-level use: order, sizes, release, the legacy default stream") {
  cuda_transfer_queue q(d2h, 1 * MiB, 2);
  device_buffer dev(3 * MiB);
  std::vector<std::byte> src(3 * MiB);
  fill_pattern(src.data(), src.size(), 42);
  zenflow_test::upload(dev.data(), src.data(), src.size());
  const auto* d = static_cast<const std::byte*>(dev.data());
  for (int round = 0; round < 3; ++round) {
    auto s0 = q.acquire();
    auto s1 = q.acquire();
    CHECK(!q.try_acquire());
    q.submit_device_to_host(s0, d + round * MiB, MiB, nullptr);  // legacy default stream
    q.submit_device_to_host(s1, d + round * MiB + 7, 1, nullptr);
    auto r0 = q.next();
    CHECK(r0.sequence == s0.sequence);
    CHECK(std::memcmp(r0.data, src.data() + round * MiB, MiB) == 0);
    auto r1 = q.next();
    CHECK(r1.bytes == 1);
    CHECK(r1.data[0] == src[round * MiB + 7]);
    q.release(r0);
    q.release(r1);
  }
  CHECK(q.counters().transfers == 6);
  cuda_transfer_queue other(d2h, 1 * MiB, 2);
  auto foreign = other.acquire();
  CHECK_THROWS_AS(q.release(foreign), zenflow::error);
  other.release(foreign);
}

TEST_CASE("both directions at once") {
  constexpr std::size_t bytes = 128 * MiB;
  std::vector<std::byte> up_src(bytes), down_src(bytes), down_dst(bytes), up_back(bytes);
  fill_pattern(up_src.data(), bytes, 1);
  fill_pattern(down_src.data(), bytes, 2);
  device_buffer up_dev(bytes), down_dev(bytes);
  zenflow_test::upload(down_dev.data(), down_src.data(), bytes);
  cuda_stream s1, s2;
  cuda_transfer_queue up(h2d, 8 * MiB, 2, pinned_allocation::write_combined), down(d2h, 8 * MiB, 2);
  std::thread uploader([&] { zenflow::pipelined_copy_to_device(up, up_dev.data(), up_src.data(), bytes, s1.get()); });
  zenflow::pipelined_copy_to_host(down, down_dst.data(), down_dev.data(), bytes, s2.get());
  uploader.join();
  CHECK(std::memcmp(down_dst.data(), down_src.data(), bytes) == 0);
  ZENFLOW_CUDA_TRY(cudaMemcpy(up_back.data(), up_dev.data(), bytes, cudaMemcpyDeviceToHost));
  CHECK(std::memcmp(up_back.data(), up_src.data(), bytes) == 0);
}

TEST_CASE("a copy completes while a longer kernel still runs on another stream") {
  // The kernel runs on a non-blocking stream and then on the legacy default stream: the queue's
  // copy stream must not be ordered after either (it is non-blocking itself).
  for (bool legacy : {false, true})
    for (auto direction : {d2h, h2d}) {
      CAPTURE(legacy);
      CAPTURE(static_cast<int>(direction));
      constexpr std::size_t bytes = 64 * MiB;
      mapped_flags flags;
      cuda_stream kernel_stream, caller;
      device_buffer dev(bytes);
      ZENFLOW_CUDA_TRY(cudaMemset(dev.data(), 0, bytes));  // copied out below (initcheck)
      ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
      cuda_transfer_queue q(direction, bytes, 2);
      const cudaStream_t spin_stream = legacy ? cudaStream_t{nullptr} : kernel_stream.get();
      spin_until_flag<<<1, 1, 0, spin_stream>>>(flags.device, flags.device + 1, 10'000'000'000ull);  // 10 s cap
      ZENFLOW_CUDA_TRY(cudaGetLastError());
      auto slot = q.acquire();
      if (direction == d2h) {
        q.submit_device_to_host(slot, dev.data(), bytes, caller.get());
        q.release(q.next());  // waits on the slot's event only
      } else {
        std::memset(slot.data, 3, bytes);
        q.submit_host_to_device(slot, dev.data(), bytes, caller.get());
        q.drain();
      }
      // The copy is done; the kernel must still be spinning (it was launched first and is longer).
      CHECK(cudaStreamQuery(spin_stream) == cudaErrorNotReady);
      (void)cudaGetLastError();
      CHECK(flags.outcome() == 0);
      flags.set();
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(spin_stream));
      CHECK(flags.outcome() == 1);  // released by the host, not by the timeout
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(caller.get()));
    }
}

TEST_CASE("the caller's stream waits for a host_to_device copy, without the host blocking") {
  constexpr std::size_t bytes = 32 * MiB;
  cuda_stream caller;
  device_buffer dev(bytes);
  ZENFLOW_CUDA_TRY(cudaMemset(dev.data(), 0, bytes));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  pinned_buffer back(bytes);
  mapped_flags flags;
  cuda_transfer_queue q(h2d, bytes, 2);
  // Hold the queue's own stream, so the copy cannot have finished by chance when the caller's
  // work runs: only the event wait orders the caller after it.
  spin_until_flag<<<1, 1, 0, q.copy_stream()>>>(flags.device, flags.device + 1, 10'000'000'000ull);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
  auto slot = q.acquire();
  std::memset(slot.data, 0x5a, bytes);
  q.submit_host_to_device(slot, dev.data(), bytes, caller.get());  // returns at once
  ZENFLOW_CUDA_TRY(cudaMemcpyAsync(back.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, caller.get()));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(cudaStreamQuery(caller.get()) == cudaErrorNotReady);  // waiting for the queue's copy
  (void)cudaGetLastError();
  flags.set();
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(caller.get()));
  CHECK(flags.outcome() == 1);
  const auto* b = back.data();
  CHECK(std::all_of(b, b + bytes, [](std::byte x) { return x == std::byte{0x5a}; }));
  q.drain();
}

TEST_CASE("a device_to_host copy is ordered after the caller's earlier work") {
  device_buffer dev(MiB);
  ZENFLOW_CUDA_TRY(cudaMemset(dev.data(), 0, MiB));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  cuda_stream caller;
  mapped_flags flags;
  cuda_transfer_queue q(d2h, MiB, 2);
  spin_until_flag<<<1, 1, 0, caller.get()>>>(flags.device, flags.device + 1, 10'000'000'000ull);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
  ZENFLOW_CUDA_TRY(cudaMemsetAsync(dev.data(), 0x77, MiB, caller.get()));  // the "gradient" the copy must see
  auto slot = q.acquire();
  q.submit_device_to_host(slot, dev.data(), MiB, caller.get());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!q.try_next());  // the copy waits for the caller's stream
  flags.set();
  auto r = q.next();
  CHECK(flags.outcome() == 1);
  CHECK(std::all_of(r.data, r.data + MiB, [](std::byte x) { return x == std::byte{0x77}; }));
  q.release(r);
}

TEST_CASE("a host_to_device copy is ordered after the caller's earlier work") {
  device_buffer dev(MiB);
  cuda_stream caller;
  mapped_flags flags;
  cuda_transfer_queue q(h2d, MiB, 2);
  spin_until_flag<<<1, 1, 0, caller.get()>>>(flags.device, flags.device + 1, 10'000'000'000ull);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
  ZENFLOW_CUDA_TRY(cudaMemsetAsync(dev.data(), 0x11, MiB, caller.get()));  // earlier work still using dst
  auto slot = q.acquire();
  std::memset(slot.data, 0x22, MiB);
  q.submit_host_to_device(slot, dev.data(), MiB, caller.get());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  flags.set();
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(caller.get()));
  CHECK(flags.outcome() == 1);
  // Copy first (not waiting for the caller) would leave the memset's 0x11.
  std::vector<std::byte> back(MiB);
  ZENFLOW_CUDA_TRY(cudaMemcpy(back.data(), dev.data(), MiB, cudaMemcpyDeviceToHost));
  CHECK(std::all_of(back.begin(), back.end(), [](std::byte x) { return x == std::byte{0x22}; }));
  q.drain();
}

TEST_CASE("destroying a queue with copies in flight waits for them") {
  device_buffer dev(64 * MiB);
  ZENFLOW_CUDA_TRY(cudaMemset(dev.data(), 0, 64 * MiB));  // copied out below (initcheck)
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  cuda_stream caller;
  for (auto direction : {d2h, h2d}) {
    CAPTURE(static_cast<int>(direction));
    mapped_flags flags;
    auto q = std::make_unique<cuda_transfer_queue>(direction, 32 * MiB, 2);
    std::atomic<bool> destroyed{false};
    if (direction == d2h) {
      // The copies wait for the caller's stream, held by the kernel.
      spin_until_flag<<<1, 1, 0, caller.get()>>>(flags.device, flags.device + 1, 10'000'000'000ull);
      q->submit_device_to_host(q->acquire(), dev.data(), 32 * MiB, caller.get());
      q->submit_device_to_host(q->acquire(), static_cast<std::byte*>(dev.data()) + 32 * MiB, 32 * MiB, caller.get());
    } else {
      // The copy runs on the queue's stream, held by the kernel.
      spin_until_flag<<<1, 1, 0, q->copy_stream()>>>(flags.device, flags.device + 1, 10'000'000'000ull);
      q->submit_host_to_device(q->acquire(), dev.data(), 32 * MiB, caller.get());
    }
    ZENFLOW_CUDA_TRY(cudaGetLastError());
    std::thread destroyer([&] {
      q.reset();  // must block until the copies that use its pinned slots are done
      destroyed = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(!destroyed.load());
    flags.set();
    destroyer.join();
    CHECK(destroyed.load());
    CHECK(flags.outcome() == 1);  // released by the host, not by the timeout
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(caller.get()));
  }
}

TEST_CASE("errors: a failed CUDA call throws cuda_error; bad arguments throw before any CUDA call") {
  CHECK_THROWS_AS(pinned_buffer(std::size_t{1} << 50), zenflow::cuda_error);  // 1 PiB of pinned memory
  CHECK_THROWS_WITH_AS(cuda_transfer_queue(d2h, MiB, 2, pinned_allocation::write_combined), doctest::Contains("kind"),
                       zenflow::error);
  cuda_stream caller;
  cuda_transfer_queue q(d2h, 1 * MiB, 2);
  auto slot = q.acquire();
  device_buffer dev(2 * MiB);
  ZENFLOW_CUDA_TRY(cudaMemset(dev.data(), 0, 2 * MiB));  // copied out below (initcheck)
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());             // `caller` is non-blocking
  CHECK_THROWS_AS(q.submit_device_to_host(slot, dev.data(), 1 * MiB + 1, caller.get()), zenflow::error);
  q.submit_device_to_host(slot, dev.data(), 1 * MiB, caller.get());  // the slot was left usable
  q.release(q.next());
  CHECK(q.idle());
}
