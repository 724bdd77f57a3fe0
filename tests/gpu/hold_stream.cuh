// Holding a CUDA stream from a test: a one-thread kernel spins on a host-mapped flag until the
// host releases it, so that what the host enqueues meanwhile provably waits behind it (and what
// does not wait can be told apart by the kernel still spinning).
#pragma once

#include <zenflow/error.hpp>

#include <cuda_runtime.h>

#include <atomic>

namespace {

__device__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until the host sets *flag (outcome 1) or `timeout_ns` passed (outcome 2).
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

// Host-mapped pinned ints the kernel and the host both see.
struct mapped_flags {
  int* host = nullptr;
  int* device = nullptr;
  mapped_flags() {
    ZENFLOW_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&host), 2 * sizeof(int), cudaHostAllocMapped));
    host[0] = host[1] = 0;
    ZENFLOW_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0));
  }
  ~mapped_flags() { ZENFLOW_CUDA_ASSERT(cudaFreeHost(host)); }
  void set() { std::atomic_ref<int>(host[0]).store(1); }
  int outcome() { return std::atomic_ref<int>(host[1]).load(); }
};

}  // namespace
