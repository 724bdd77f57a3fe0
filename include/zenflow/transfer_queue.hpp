// The pinned double-buffer transfer queue: host backend (plain C++20, no GPU needed).
//
// A transfer queue moves bytes in one direction through N >= 2 fixed-size slots:
//
//   device_to_host (gradients)                 host_to_device (parameters)
//   producer: s = acquire()                    producer: s = acquire()
//             submit_device_to_host(s, src,...)          write s.data[0, n)
//   consumer: s = next()   // waits on s's event          submit_host_to_device(s, dst, n, stream)
//             read s.data[0, s.bytes)          (s frees itself once its copy completed)
//             release(s)
//
// A slot is never handed out again before its consumer released it AND its copy completed.
// When every slot is busy, acquire() blocks and try_acquire() returns std::nullopt
// (backpressure). Copies run on the queue's own copy stream, in submission order; the caller's
// stream is only ever ordered through events. Errors on the copy path are sticky: the call that
// observes one (next(), acquire(), drain(), ...) throws it, and so does every later call except
// release(). The destructor waits for copies still in flight (never a use-after-free).
//
// This header is the host backend: `host_transfer_queue`, whose "device memory" is host memory
// and whose copy stream is a host_stream (one worker thread doing memcpy in order). The CUDA
// backend, `cuda_transfer_queue` in transfer_queue.cuh, has the same interface with
// stream_type = cudaStream_t, so a coordinator can be a template over either.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/detail/transfer_queue/host_copy_engine.hpp"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"

namespace zenflow {

/// Host backend of the transfer queue (models zenflow::transfer_queue). stream_type is
/// `host_stream&`: callers pass the host_stream that plays their GPU stream. Thread-safe: any
/// number of producer and consumer threads may share one queue.
class host_transfer_queue final : public detail::basic_transfer_queue<detail::host_copy_engine> {
 public:
  /// A queue of `slot_count` (>= 2) slots of `slot_bytes` (> 0) bytes in one allocation, moving
  /// bytes in `direction`. Throws zenflow::error naming the bad argument before allocating.
  host_transfer_queue(transfer_direction direction, std::size_t slot_bytes, std::size_t slot_count = 2)
      : basic_transfer_queue(direction, slot_bytes, slot_count) {}

  /// Test and fault-injection hook: `hook(slot, bytes)` runs on the copy worker before each copy
  /// submitted after this call (an exception it throws is a copy-path error; a hook that blocks
  /// holds the copy in flight). Set it while no other thread submits. Does not block.
  void set_copy_hook(detail::host_copy_engine::copy_hook hook) { engine().set_copy_hook(std::move(hook)); }
};

/// Copies `bytes` bytes from `src` ("device" memory) into `dst` (any host memory) through the
/// slots of `q` (an idle device_to_host queue), pipelined; any size, also more than all slots
/// together. The copies are ordered after the work already enqueued on `stream`.
/// Synchronizes: returns once `dst` holds the bytes (waits on slot events only).
inline void pipelined_copy_to_host(host_transfer_queue& q, void* dst, const void* src, std::size_t bytes,
                                   host_stream& stream) {
  detail::pipelined_copy_to_host(q, dst, src, bytes, stream);
}

/// Copies `bytes` bytes from `src` (any host memory) into `dst` ("device" memory) through the
/// slots of `q` (a host_to_device queue), pipelined. The copies start after the work already on
/// `stream`; work enqueued on `stream` afterwards is ordered after them. Synchronizes: returns once
/// the copies completed (slot events only).
inline void pipelined_copy_to_device(host_transfer_queue& q, void* dst, const void* src, std::size_t bytes,
                                     host_stream& stream) {
  detail::pipelined_copy_to_device(q, dst, src, bytes, stream);
}

}  // namespace zenflow
