// host_transfer_queue (the host backend) against a plain memcpy roofline, in one binary.
//
// These are HOST-BACKEND figures: "device" memory is host memory and the copy engine is one
// worker thread doing memcpy, so the roofline is one memcpy of the same bytes on one thread.
// They measure the queue's own overhead (events, slot hand-off, the worker), not PCIe.
//   roofline          one memcpy of 128 MiB (both: two memcpy threads at once)
//   queue             the worker copies into the slots, the consumer reads each slot in place
//                     (device_to_host) / the producer wrote each slot in place (host_to_device)
//   pipelined_copy    pipelined_copy_to_host / _to_device: the caller also copies each slot
//                     out of / into a second buffer (every byte is copied twice, on two threads)
// Counters: GB/s (1e9 bytes/s), fraction = GB/s / the same mode's roofline, and
// fraction_of_chunked = GB/s / memcpy of the same bytes in slot-sized chunks on the same number of
// threads. The second one isolates the queue's overhead: glibc's memcpy switches to non-temporal
// stores for very large single copies (here between 64 and 128 MiB), so one 128 MiB memcpy is
// ~1.5x faster than the same bytes copied in <= 64 MiB pieces, queue or no queue.
//
//   build/default/bench/bench_transfer_queue_host --benchmark_min_time=0.5
#include <zenflow/transfer_queue.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using zenflow::host_stream;
using zenflow::host_transfer_queue;
using zenflow::transfer_direction;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t total_bytes = 128 * MiB;
enum mode : int { down = 0, up = 1, both = 2 };
const char* mode_name(int m) {
  return m == down ? "d2h" : m == up ? "h2d" : "bidirectional";
}

struct buffers {
  std::vector<std::byte> dev_down = std::vector<std::byte>(total_bytes, std::byte{1});
  std::vector<std::byte> dev_up = std::vector<std::byte>(total_bytes, std::byte{2});
  std::vector<std::byte> host_down = std::vector<std::byte>(total_bytes, std::byte{3});
  std::vector<std::byte> host_up = std::vector<std::byte>(total_bytes, std::byte{4});
  host_stream s_down, s_up;
  static buffers& get() {
    static buffers b;
    return b;
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double roofline_once(int m) {
  auto& b = buffers::get();
  const auto t0 = std::chrono::steady_clock::now();
  if (m == both) {
    std::thread other([&] { std::memcpy(b.dev_up.data(), b.host_up.data(), total_bytes); });
    std::memcpy(b.host_down.data(), b.dev_down.data(), total_bytes);
    other.join();
  } else if (m == down) {
    std::memcpy(b.host_down.data(), b.dev_down.data(), total_bytes);
  } else {
    std::memcpy(b.dev_up.data(), b.host_up.data(), total_bytes);
  }
  benchmark::ClobberMemory();
  return seconds_since(t0);
}

// The same bytes memcpy'd in `chunk`-sized pieces (both: two threads, one per direction).
double chunked_once(int m, std::size_t chunk) {
  auto& b = buffers::get();
  auto copy = [chunk](std::byte* dst, const std::byte* src) {
    for (std::size_t o = 0; o < total_bytes; o += chunk)
      std::memcpy(dst + o, src + o, std::min(chunk, total_bytes - o));
  };
  const auto t0 = std::chrono::steady_clock::now();
  if (m == both) {
    std::thread other([&] { copy(b.dev_up.data(), b.host_up.data()); });
    copy(b.host_down.data(), b.dev_down.data());
    other.join();
  } else if (m == down) {
    copy(b.host_down.data(), b.dev_down.data());
  } else {
    copy(b.dev_up.data(), b.host_up.data());
  }
  benchmark::ClobberMemory();
  return seconds_since(t0);
}

double chunked_gbps(int m, std::size_t chunk) {
  chunked_once(m, chunk);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) best = std::min(best, chunked_once(m, chunk));
  return (m == both ? 2.0 : 1.0) * total_bytes / best / 1e9;
}

double roofline_gbps(int m) {
  static double cache[3] = {0, 0, 0};
  if (cache[m] == 0) {
    roofline_once(m);
    double best = 1e30;
    for (int i = 0; i < 5; ++i) best = std::min(best, roofline_once(m));
    cache[m] = (m == both ? 2.0 : 1.0) * total_bytes / best / 1e9;
  }
  return cache[m];
}

void queue_down(host_transfer_queue& q, host_stream& stream, bool pipelined) {
  auto& b = buffers::get();
  if (pipelined) return zenflow::pipelined_copy_to_host(q, b.host_down.data(), b.dev_down.data(), total_bytes, stream);
  std::size_t submitted = 0, consumed = 0;
  while (consumed < total_bytes) {
    if (submitted < total_bytes) {
      if (auto slot = q.try_acquire()) {
        const std::size_t n = std::min(q.slot_bytes(), total_bytes - submitted);
        q.submit_device_to_host(*slot, b.dev_down.data() + submitted, n, stream);
        submitted += n;
        continue;
      }
    }
    const auto slot = q.next();
    benchmark::DoNotOptimize(slot.data[0]);
    consumed += slot.bytes;
    q.release(slot);
  }
}

void queue_up(host_transfer_queue& q, host_stream& stream, bool pipelined) {
  auto& b = buffers::get();
  if (pipelined) return zenflow::pipelined_copy_to_device(q, b.dev_up.data(), b.host_up.data(), total_bytes, stream);
  for (std::size_t offset = 0; offset < total_bytes;) {
    const auto slot = q.acquire();
    const std::size_t n = std::min(q.slot_bytes(), total_bytes - offset);
    q.submit_host_to_device(slot, b.dev_up.data() + offset, n, stream);
    offset += n;
  }
  q.drain();
}

void report(benchmark::State& state, int m, double seconds, std::size_t moved, std::size_t chunk = 0) {
  const double gbps = moved / seconds / 1e9;
  state.counters["GB/s"] = gbps;
  if (chunk != 0) state.counters["fraction_of_chunked"] = gbps / chunked_gbps(m, chunk);
  state.counters["roofline_GB/s"] = roofline_gbps(m);
  state.counters["fraction"] = gbps / roofline_gbps(m);
  state.SetLabel(mode_name(m));
}

void BM_host_roofline(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0));
  double seconds = 0;
  std::size_t moved = 0;
  for (auto _ : state) {
    const double t = roofline_once(m);
    state.SetIterationTime(t);
    seconds += t;
    moved += (m == both ? 2 : 1) * total_bytes;
  }
  report(state, m, seconds, moved);
}

void run_queue(benchmark::State& state, bool pipelined) {
  const int m = static_cast<int>(state.range(0));
  const std::size_t slot = static_cast<std::size_t>(state.range(1)) * MiB;
  auto& b = buffers::get();
  host_transfer_queue qd(transfer_direction::device_to_host, slot, 2);
  host_transfer_queue qu(transfer_direction::host_to_device, slot, 2);
  double seconds = 0;
  std::size_t moved = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    if (m == down) {
      queue_down(qd, b.s_down, pipelined);
    } else if (m == up) {
      queue_up(qu, b.s_up, pipelined);
    } else {
      std::thread uploader([&] { queue_up(qu, b.s_up, pipelined); });
      queue_down(qd, b.s_down, pipelined);
      uploader.join();
    }
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    seconds += t;
    moved += (m == both ? 2 : 1) * total_bytes;
  }
  report(state, m, seconds, moved, pipelined ? 0 : slot);
}

void BM_host_queue(benchmark::State& state) {
  run_queue(state, false);
}
void BM_host_pipelined_copy(benchmark::State& state) {
  run_queue(state, true);
}

BENCHMARK(BM_host_roofline)->ArgName("mode")->DenseRange(0, 2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_host_queue)
    ->ArgNames({"mode", "slot_MiB"})
    ->ArgsProduct({{down, up, both}, {1, 4, 16, 64}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_host_pipelined_copy)
    ->ArgNames({"mode", "slot_MiB"})
    ->ArgsProduct({{down, up}, {1, 4, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
