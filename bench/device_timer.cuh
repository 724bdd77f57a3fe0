// How the GPU benchmarks time device work (shared by bench_importance_selector and
// bench_sparse_adam; not part of the library). Its memory, events and stream hold are the ones the
// GPU tests use too (tests/support/cuda_test_utils.cuh).
//
// A kernel on the stream spins on a host-mapped flag while the host enqueues the timed calls, so
// the host's launch and validation cost never shows up as device time; each call is preceded by
// a read-only sweep over 4x the L2 size with evict-normal loads (ld.global.cg), so the timed call
// and its roofline both start from HBM, not from data the previous repetition left in L2 (an
// evict-first sweep would mostly evict its own lines and leave the timed kernels' evict-normal
// lines in place); and each call has its own event pair, so the flush is not timed. The read
// roofline loads like the score kernel it is compared with (ld.global.nc, evict-normal). A call
// that synchronizes with the host would stall behind the spinning kernel: the kernel gives up
// after 5 s and the timer throws instead of reporting a figure.
#pragma once

#include <zenflow/error.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "../tests/support/cuda_test_utils.cuh"

namespace zenflow_bench {

/// How a streaming kernel loads: the L2 eviction priority decides which lines survive the next
/// sweep.
enum class load_policy {
  read_only,  ///< ld.global.nc (__ldg), evict-normal: the library's gradient and score loads
  global,     ///< ld.global.cg (__ldcg), evict-normal, not cached in L1: the L2 flush
};

/// Reads n 16-byte words with `Policy` (the read-only streaming roofline, and the L2 flush).
template <load_policy Policy>
__global__ void read_stream_kernel(const uint4* data, long long n, unsigned* sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const uint4 v = Policy == load_policy::read_only ? __ldg(data + i) : __ldcg(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

/// Blocks for a streaming kernel: 8 per SM.
inline int streaming_blocks() {
  int device = 0, sms = 0;
  ZENFLOW_CUDA_TRY(cudaGetDevice(&device));
  ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms * 8;
}

class device_timer {
 public:
  /// Times work on `stream` (nullptr: the legacy stream). Allocates the flush buffer, the mapped
  /// flags and the events once.
  explicit device_timer(cudaStream_t stream) : stream_(stream), blocks_(streaming_blocks()) {
    int device = 0, l2 = 0;
    ZENFLOW_CUDA_TRY(cudaGetDevice(&device));
    ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    flush_ = zenflow_test::device_buffer((4 * static_cast<std::size_t>(l2) + 15) / 16 * 16);
    ZENFLOW_CUDA_TRY(cudaMemset(flush_.data(), 0, flush_.bytes()));
    ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  }
  device_timer(const device_timer&) = delete;
  device_timer& operator=(const device_timer&) = delete;

  /// Mean device milliseconds of one call of `f` over `reps` calls, after one untimed warm-up
  /// call (uploads, allocations, lazy module loading). With `hold` false the stream is not held
  /// (for work that synchronizes with the host by design, such as a library's temporary
  /// allocations); its launch gaps are then part of the time.
  template <class F>
  double mean_ms(F&& f, int reps = 10, bool hold = true) {
    f();
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream_));
    while (events_.size() < 2 * static_cast<std::size_t>(reps)) {
      events_.emplace_back(cudaEventDefault);  // timing enabled
      events_.back().create();
    }
    flags_.host[0] = flags_.host[1] = 0;
    if (hold) {
      zenflow_test::spin_until_flag<<<1, 1, 0, stream_>>>(flags_.device, flags_.device + 1, 5'000'000'000ull);
      ZENFLOW_CUDA_TRY(cudaGetLastError());
    }
    for (int i = 0; i < reps; ++i) {
      read<load_policy::global>(flush_.data(), flush_.bytes());
      events_[2 * i].record(stream_);
      f();
      events_[2 * i + 1].record(stream_);
    }
    flags_.set();
    events_[2 * reps - 1].synchronize();
    if (flags_.outcome() == 2)  // the kernel gave up waiting for the release
      throw zenflow::error("device_timer", "the timed calls synchronized with the host while the stream was held");
    double total = 0;
    for (int i = 0; i < reps; ++i) {
      float ms = 0;
      ZENFLOW_CUDA_TRY(cudaEventElapsedTime(&ms, events_[2 * i].native(), events_[2 * i + 1].native()));
      total += ms;
    }
    return total / reps;
  }

  /// The read-only streaming roofline over `bytes` at `data` (ld.global.nc loads), timed like
  /// everything else.
  double read_roofline_ms(const void* data, std::size_t bytes, int reps = 10) {
    return mean_ms([&] { read<load_policy::read_only>(data, bytes); }, reps);
  }

 private:
  template <load_policy Policy>
  void read(const void* data, std::size_t bytes) {
    read_stream_kernel<Policy><<<blocks_, 256, 0, stream_>>>(
        static_cast<const uint4*>(data), static_cast<long long>(bytes / 16), sink_.data<unsigned>());
    ZENFLOW_CUDA_TRY(cudaGetLastError());
  }

  cudaStream_t stream_;
  int blocks_;
  zenflow_test::device_buffer flush_;  // 4x the L2 size, read before each timed call
  zenflow_test::device_buffer sink_{sizeof(unsigned)};
  zenflow_test::mapped_flags flags_;  // the hold kernel's release flag and outcome
  std::vector<zenflow_test::cuda_event> events_;
};

}  // namespace zenflow_bench
