// pinned_uploader: host -> device uploads of small host arrays (selections, launch tables, the
// step counter) that the caller may reuse as soon as the call returns. Not a public header.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstring>

#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/error.hpp"

namespace zenflow::detail::sparse_adam {

/// Host -> device uploads through a small ring of pinned buffers, each guarded by an event: a
/// slot is reused only after its previous copy ran (with 8 slots, normally long since). A slot's
/// buffer grows to the largest upload it carried; its event (timing disabled) is created on the
/// slot's first upload.
class pinned_uploader {
 public:
  pinned_uploader() = default;
  pinned_uploader(const pinned_uploader&) = delete;
  pinned_uploader& operator=(const pinned_uploader&) = delete;
  /// Waits for every slot's last copy, then frees the slots in order (event, then memory).
  ~pinned_uploader() {
    for (auto& s : slots_) {
      if (s.done.created()) ZENFLOW_CUDA_ASSERT(cudaEventSynchronize(s.done.native()));
      s.done.reset();
      s.host.reset();
    }
  }

  /// Copies `bytes` from `src` (host) to `dst` (device) on `stream`; `src` may be reused on return.
  void upload(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return;
    slot& s = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    if (!s.done.created())
      s.done.create();
    else
      s.done.synchronize();  // the copy that last used this slot has run
    if (s.host.bytes() < bytes) {
      s.host.reset();  // the old buffer goes before the larger one is allocated
      s.host = cuda_host_buffer(bytes);
    }
    std::memcpy(s.host.data(), src, bytes);
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(dst, s.host.data(), bytes, cudaMemcpyHostToDevice, stream));
    s.done.record(stream);
  }

 private:
  struct slot {
    cuda_host_buffer host;  // cudaMallocHost memory (cudaHostAllocDefault)
    cuda_event done{cudaEventDisableTiming};
  };
  std::array<slot, 8> slots_{};
  std::size_t next_ = 0;
};

}  // namespace zenflow::detail::sparse_adam
