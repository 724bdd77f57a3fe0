// The CUDA copy engine of cuda_transfer_queue (see basic_queue.hpp for the engine contract and
// zenflow/transfer_queue.cuh for the schedule). Included by zenflow/transfer_queue.cuh after
// pinned_pool and event_wait, which it uses; not a public header.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/error.hpp"

namespace zenflow::detail {

/// The CUDA engine: a pinned_pool, the queue's own non-blocking copy stream on the device
/// current at construction, one timing-free event per slot. See basic_queue.hpp.
class cuda_copy_engine {
 public:
  using stream_type = cudaStream_t;

  cuda_copy_engine(std::size_t slot_bytes, std::size_t slot_count, pinned_allocation kind, event_wait wait)
      : pool_(slot_bytes, slot_count, kind), copy_(cudaStreamNonBlocking) {
    const unsigned flags = cudaEventDisableTiming | (wait == event_wait::block ? cudaEventBlockingSync : 0u);
    try {
      events_.reserve(slot_count);
      for (std::size_t i = 0; i < slot_count; ++i) {
        events_.emplace_back(flags);
        events_.back().create();
      }
    } catch (...) {
      destroy();
      throw;
    }
  }
  cuda_copy_engine(const cuda_copy_engine&) = delete;
  cuda_copy_engine& operator=(const cuda_copy_engine&) = delete;
  /// Waits for every copy (slot events only), then destroys events, stream and memory.
  ~cuda_copy_engine() { destroy(); }

  std::byte* slot_data(std::size_t i) const noexcept { return pool_.slot(i); }
  cudaStream_t copy_stream() const noexcept { return copy_.get(); }

  void submit_device_to_host(std::size_t i, const void* src, std::size_t n, cudaStream_t caller) {
    cuda_event& event = events_[i];
    event.record(caller);
    event.wait(copy_.get());
    if (n > 0) ZENFLOW_CUDA_TRY(cudaMemcpyAsync(pool_.slot(i), src, n, cudaMemcpyDeviceToHost, copy_.get()));
    event.record(copy_.get());
  }

  void submit_host_to_device(std::size_t i, void* dst, std::size_t n, cudaStream_t caller) {
    cuda_event& event = events_[i];
    event.record(caller);  // `dst` may still be in use there
    event.wait(copy_.get());
    if (n > 0) ZENFLOW_CUDA_TRY(cudaMemcpyAsync(dst, pool_.slot(i), n, cudaMemcpyHostToDevice, copy_.get()));
    event.record(copy_.get());
    event.wait(caller);
  }

  void wait(std::size_t i) const { events_[i].synchronize(); }
  bool query(std::size_t i) const { return events_[i].query(); }

 private:
  void destroy() noexcept {
    // The queue's own stream first: it also covers a copy whose submit failed half-way (its event
    // may not have been recorded after it). Never the caller's stream.
    if (copy_) ZENFLOW_CUDA_ASSERT(cudaStreamSynchronize(copy_.get()));
    for (cuda_event& event : events_) {  // no DMA into or out of freed memory
      if (event.created()) ZENFLOW_CUDA_ASSERT(cudaEventSynchronize(event.native()));
      event.reset();
    }
    events_.clear();
    copy_.reset();
  }

  pinned_pool pool_;  // first: freed after the events were waited for
  cuda_stream copy_;
  std::vector<cuda_event> events_;  // one per slot
};

}  // namespace zenflow::detail
