// What the GPU tests and the GPU benchmarks share (not part of the library): device memory,
// mapped pinned memory, streams and events (the library's owners, detail/cuda/memory.cuh), a
// kernel that holds a stream until the host releases it, and the device's residency limit. CUDA
// errors throw zenflow::cuda_error (ZENFLOW_CUDA_TRY), as in the library.
#pragma once

#include <zenflow/detail/cuda/memory.cuh>
#include <zenflow/error.hpp>

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <span>
#include <vector>

namespace zenflow_test {

/// Owning device memory (cudaMalloc / cudaFree): data<T>(), bytes(); movable.
using device_buffer = zenflow::detail::cuda_device_buffer;
/// Owning stream, cudaStreamNonBlocking unless other flags are given.
using cuda_stream = zenflow::detail::cuda_stream;
/// Owning event, created with its flags on first use (cudaEventDefault: a timing event).
using cuda_event = zenflow::detail::cuda_event;

/// Copies `bytes` from host memory to device memory and returns once they are there. A pageable
/// cudaMemcpy returns as soon as the source is staged, before its DMA landed, on the legacy stream,
/// which work on a non-blocking stream does not wait for: a kernel enqueued there next could read
/// the old bytes. Hence the device-wide synchronization (tests only: uploads are not timed).
inline void upload(void* device_dst, const void* host_src, std::size_t bytes) {
  ZENFLOW_CUDA_TRY(cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice));
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
}

/// A device copy of a host vector: span()/cspan() for the device, download() back to the host.
/// The upload has landed when the constructor returns (upload()), whatever stream reads it next.
template <class T>
struct device_vector {
  explicit device_vector(const std::vector<T>& values) : n(values.size()), buffer(values.size() * sizeof(T)) {
    upload(buffer.data(), values.data(), n * sizeof(T));
  }
  /// Reads the device copy back; the caller first synchronizes the stream that last wrote it.
  std::vector<T> download() const {
    std::vector<T> out(n);
    ZENFLOW_CUDA_TRY(cudaMemcpy(out.data(), buffer.data(), n * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  std::span<T> span() { return {buffer.data<T>(), n}; }
  std::span<const T> cspan() const { return {buffer.data<T>(), n}; }
  std::size_t n;
  device_buffer buffer;
};

/// `count` values of T in mapped pinned host memory (cudaHostAllocMapped), zero-initialized:
/// host() for the CPU, device() for kernels and the library's device-pointer arguments.
template <class T>
class mapped_pinned {
 public:
  explicit mapped_pinned(std::size_t count = 1) : memory_(count * sizeof(T)) {
    for (std::size_t i = 0; i < count; ++i) host()[i] = T{};
  }
  [[nodiscard]] T* host() const noexcept { return memory_.data<T>(); }
  [[nodiscard]] T* device() const noexcept { return memory_.device_data<T>(); }

 private:
  zenflow::detail::cuda_mapped_host_buffer memory_;
};

// --- holding a stream ----------------------------------------------------------------------------
//
// A one-thread kernel spins on a host-mapped flag until the host releases it, so that what the
// host enqueues meanwhile provably waits behind it (and what does not wait can be told apart by
// the kernel still spinning), and so that the host's launch cost never shows up as device time.

inline __device__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// Spins until the host sets *flag (outcome 1) or `timeout_ns` passed (outcome 2). (Not static:
/// a test or benchmark that does not hold a stream would warn about an unused kernel; every test
/// and benchmark is a single CUDA translation unit.)
__global__ void spin_until_flag(const volatile int* flag, volatile int* outcome, unsigned long long timeout_ns) {
  const unsigned long long start = global_timer_ns();
  while (*flag == 0) {
    if (global_timer_ns() - start > timeout_ns) {
      *outcome = 2;
      return;
    }
    __nanosleep(1000);
  }
  *outcome = 1;
}

/// The two mapped pinned ints spin_until_flag and the host share, zero at first: device[0] is the
/// flag (set()), device[1] the outcome (0 while the kernel spins, 1 released, 2 timed out).
struct mapped_flags {
  mapped_pinned<int> memory{2};
  int* host = memory.host();
  int* device = memory.device();

  mapped_flags() = default;
  mapped_flags(const mapped_flags&) = delete;
  mapped_flags& operator=(const mapped_flags&) = delete;
  void set() { std::atomic_ref<int>(host[0]).store(1); }
  int outcome() { return std::atomic_ref<int>(host[1]).load(); }
};

// --- device limits -------------------------------------------------------------------------------

/// The most blocks of `threads` threads the current device can keep resident at once, from its
/// threads-per-SM limit alone: no register or shared-memory budget allows more. A launch of more
/// tiles than this makes a grid-stride kernel's blocks walk several tiles on any build.
inline long long max_resident_blocks(int threads) {
  int device = 0, sms = 0, threads_per_sm = 0;
  ZENFLOW_CUDA_TRY(cudaGetDevice(&device));
  ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  return static_cast<long long>(sms) * (threads_per_sm / threads);
}

}  // namespace zenflow_test
