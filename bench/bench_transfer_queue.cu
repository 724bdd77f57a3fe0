// cuda_transfer_queue against the PCIe roofline, in one binary.
//
// Roofline: one cudaMemcpyAsync of a 256 MiB pinned buffer per direction (and both directions at
// once on two streams). Then the queue moves the same bytes through slots of 1, 4, 16 and 64 MiB,
// each direction alone and both at once; the consumer (device_to_host) reads each slot in place
// and releases it, the producer (host_to_device) has written each slot in place, as the
// coordinator does. `pipelined_*` adds the CPU copy between the slots and a pageable buffer.
// Counters: GB/s (1e9 bytes/s) and fraction = GB/s / the same direction's roofline.
// Bars: fraction >= 0.90 for slots >= 4 MiB; bidirectional >= 1.6x one direction when
// the GPU has two copy engines (see `copy_engines` in the context).
//
//   build/default/bench/bench_transfer_queue
#include <zenflow/transfer_queue.cuh>

#include <benchmark/benchmark.h>

#include "../tests/support/cuda_test_utils.cuh"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using zenflow::cuda_transfer_queue;
using zenflow::pinned_allocation;
using zenflow::transfer_direction;

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t total_bytes = 256 * MiB;

enum mode : int { down = 0, up = 1, both = 2 };
const char* mode_name(int m) {
  return m == down ? "d2h" : m == up ? "h2d" : "bidirectional";
}

struct fixture {
  zenflow::pinned_buffer pinned_down{total_bytes};
  zenflow::pinned_buffer pinned_up{total_bytes, pinned_allocation::write_combined};
  std::vector<std::byte> pageable = std::vector<std::byte>(total_bytes);
  zenflow_test::device_buffer down_memory{total_bytes}, up_memory{total_bytes};
  void* dev_down = down_memory.data();  // source of device_to_host
  void* dev_up = up_memory.data();      // destination of host_to_device
  zenflow_test::cuda_stream down_stream, up_stream;
  cudaStream_t s_down = down_stream.get(), s_up = up_stream.get();
  fixture() {
    ZENFLOW_CUDA_TRY(cudaMemset(dev_down, 1, total_bytes));
    std::fill(pageable.begin(), pageable.end(), std::byte{2});
    std::memset(pinned_up.data(), 3, total_bytes);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(nullptr));  // setup: the legacy stream's memset
  }
  static fixture& get() {
    static fixture& f = *new fixture;  // never destroyed: no CUDA calls after the runtime unloads
    return f;
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One-shot copies; returns seconds.
double roofline_once(int m) {
  auto& f = fixture::get();
  const auto t0 = std::chrono::steady_clock::now();
  if (m != up)
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(f.pinned_down.data(), f.dev_down, total_bytes, cudaMemcpyDeviceToHost, f.s_down));
  if (m != down)
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(f.dev_up, f.pinned_up.data(), total_bytes, cudaMemcpyHostToDevice, f.s_up));
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(f.s_down));
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(f.s_up));
  return seconds_since(t0);
}

// Best of several one-shot copies: the roofline every fraction refers to (cached per mode).
double roofline_gbps(int m) {
  static double cache[3] = {0, 0, 0};
  if (cache[m] == 0) {
    roofline_once(m);  // warm-up
    double best = 1e30;
    for (int i = 0; i < 5; ++i) best = std::min(best, roofline_once(m));
    cache[m] = (m == both ? 2.0 : 1.0) * total_bytes / best / 1e9;
  }
  return cache[m];
}

void queue_down(cuda_transfer_queue& q, const void* src, cudaStream_t stream, void* pageable_dst) {
  if (pageable_dst != nullptr) return zenflow::pipelined_copy_to_host(q, pageable_dst, src, total_bytes, stream);
  const auto* in = static_cast<const std::byte*>(src);
  std::size_t submitted = 0, consumed = 0;
  while (consumed < total_bytes) {
    if (submitted < total_bytes) {
      if (auto slot = q.try_acquire()) {
        const std::size_t n = std::min(q.slot_bytes(), total_bytes - submitted);
        q.submit_device_to_host(*slot, in + submitted, n, stream);
        submitted += n;
        continue;
      }
    }
    const auto slot = q.next();
    benchmark::DoNotOptimize(slot.data[0]);  // the consumer reads the slot in place
    consumed += slot.bytes;
    q.release(slot);
  }
}

void queue_up(cuda_transfer_queue& q, void* dst, cudaStream_t stream, const void* pageable_src) {
  if (pageable_src != nullptr) return zenflow::pipelined_copy_to_device(q, dst, pageable_src, total_bytes, stream);
  auto* out = static_cast<std::byte*>(dst);
  for (std::size_t offset = 0; offset < total_bytes;) {
    const auto slot = q.acquire();  // the producer has written it in place
    const std::size_t n = std::min(q.slot_bytes(), total_bytes - offset);
    q.submit_host_to_device(slot, out + offset, n, stream);
    offset += n;
  }
  q.drain();
}

void report(benchmark::State& state, int m, double seconds, std::size_t moved) {
  const double gbps = moved / seconds / 1e9;
  state.counters["GB/s"] = gbps;
  state.counters["roofline_GB/s"] = roofline_gbps(m);
  state.counters["fraction"] = gbps / roofline_gbps(m);
  if (m == both) state.counters["x_one_direction"] = gbps / std::max(roofline_gbps(down), roofline_gbps(up));
  state.SetLabel(mode_name(m));
}

void BM_roofline(benchmark::State& state) {
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
  auto& f = fixture::get();
  cuda_transfer_queue qd(transfer_direction::device_to_host, slot, 2);
  cuda_transfer_queue qu(transfer_direction::host_to_device, slot, 2, pinned_allocation::write_combined);
  void* pageable = pipelined ? f.pageable.data() : nullptr;
  double seconds = 0;
  std::size_t moved = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    if (m == down) {
      queue_down(qd, f.dev_down, f.s_down, pageable);
    } else if (m == up) {
      queue_up(qu, f.dev_up, f.s_up, pageable);
    } else {
      std::thread uploader([&] { queue_up(qu, f.dev_up, f.s_up, pageable); });
      queue_down(qd, f.dev_down, f.s_down, pageable);
      uploader.join();
    }
    const double t = seconds_since(t0);
    state.SetIterationTime(t);
    seconds += t;
    moved += (m == both ? 2 : 1) * total_bytes;
  }
  report(state, m, seconds, moved);
}

void BM_queue(benchmark::State& state) {
  run_queue(state, false);
}
void BM_pipelined_copy(benchmark::State& state) {
  run_queue(state, true);
}

BENCHMARK(BM_roofline)->ArgName("mode")->DenseRange(0, 2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_queue)
    ->ArgNames({"mode", "slot_MiB"})
    ->ArgsProduct({{down, up, both}, {1, 4, 16, 64}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_pipelined_copy)
    ->ArgNames({"mode", "slot_MiB"})
    ->ArgsProduct({{down, up}, {4, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  int device = 0, engines = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "bench_transfer_queue: no CUDA device\n");
    return 1;
  }
  if (cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, device) != cudaSuccess) engines = 0;
  benchmark::AddCustomContext("gpu", prop.name);
  benchmark::AddCustomContext("copy_engines", std::to_string(engines));
  benchmark::AddCustomContext("total_bytes", std::to_string(total_bytes));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
