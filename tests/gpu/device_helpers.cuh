// Helpers shared by the GPU tests: owning device and mapped pinned allocations, and the most
// blocks of a given size the current device can keep resident.
#pragma once

#include <zenflow/error.hpp>

#include <cuda_runtime.h>

#include <cstddef>

namespace zenflow_test {

/// Owning device allocation (cudaMalloc / cudaFree).
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) { ZENFLOW_CUDA_TRY(cudaMalloc(&ptr_, bytes)); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { ZENFLOW_CUDA_ASSERT(cudaFree(ptr_)); }
  template <class T = void>
  [[nodiscard]] T* get() const noexcept {
    return static_cast<T*>(ptr_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// `count` values of T in mapped pinned host memory (cudaHostAllocMapped), zero-initialized:
/// host() for the CPU, device() for kernels and the library's device-pointer arguments.
template <class T>
class mapped_pinned {
 public:
  explicit mapped_pinned(std::size_t count = 1) {
    ZENFLOW_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&host_), count * sizeof(T), cudaHostAllocMapped));
    for (std::size_t i = 0; i < count; ++i) host_[i] = T{};
    ZENFLOW_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
  }
  mapped_pinned(const mapped_pinned&) = delete;
  mapped_pinned& operator=(const mapped_pinned&) = delete;
  ~mapped_pinned() { ZENFLOW_CUDA_ASSERT(cudaFreeHost(host_)); }
  [[nodiscard]] T* host() const noexcept { return host_; }
  [[nodiscard]] T* device() const noexcept { return device_; }

 private:
  T* host_ = nullptr;
  T* device_ = nullptr;
};

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
