// The pinned double-buffer transfer queue: CUDA backend, and the pinned memory it stands on.
//
//   pinned_buffer        owning, move-only page-locked host memory of an exact size
//   pinned_pool          ONE pinned allocation per queue, carved into 256-byte-aligned slots
//   cuda_transfer_queue  the transfer queue with stream_type = cudaStream_t
//
// The queue's schedule is the host backend's (transfer_queue.hpp, where it is documented): the
// two share the slot bookkeeping. Here the copy stream is the queue's own cudaStreamNonBlocking
// stream and each slot has one cudaEvent_t (cudaEventDisableTiming):
//   device_to_host: cudaEventRecord(ev, caller); cudaStreamWaitEvent(copy, ev);
//                   cudaMemcpyAsync(slot <- src, copy); cudaEventRecord(ev, copy)
//   host_to_device: cudaMemcpyAsync(dst <- slot, copy); cudaEventRecord(ev, copy);
//                   cudaStreamWaitEvent(caller, ev)
//   consumer / reclaim: cudaEventSynchronize(ev) of that slot only.
// (cudaStreamWaitEvent captures the event's latest record when it is called, so re-recording the
// same event on the copy stream right after is safe: one event per slot is enough.)
// Never cudaDeviceSynchronize, never a synchronize of the caller's stream. CUDA errors throw
// zenflow::cuda_error (ZENFLOW_CUDA_TRY); destructors only assert (ZENFLOW_CUDA_ASSERT).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/detail/transfer_queue/mapped_region.hpp"
#include "zenflow/error.hpp"
#include "zenflow/transfer_queue.hpp"

namespace zenflow {

/// How a pinned_buffer gets its page-locked memory.
enum class pinned_allocation : std::uint8_t {
  host_alloc,      ///< cudaHostAlloc (portable): the default, good for both directions
  write_combined,  ///< cudaHostAlloc with cudaHostAllocWriteCombined: faster host->device DMA
                   ///< for memory the CPU only writes (CPU reads from it are very slow)
  registered,      ///< the library mmaps page-aligned memory, pre-faults it in parallel and
                   ///< pins it with cudaHostRegister (portable); the mapping is rounded up to
                   ///< the page size only
};

/// How a host thread waits for a slot's copy (cudaEventSynchronize on the slot's event).
enum class event_wait : std::uint8_t {
  spin,   ///< the device's schedule policy (spins while few contexts): the lowest latency
  block,  ///< cudaEventBlockingSync: the thread sleeps, leaving its core to other work (a CPU
          ///< optimizer's thread pool) at the cost of a few microseconds of wake-up latency
};

/// Owning, move-only page-locked host memory of exactly `size()` bytes (no power-of-two
/// rounding: a 4 GB request costs 4 GB). Freed exactly once — by the destructor, reset(), or a
/// move-assignment — also when construction fails half-way.
class pinned_buffer {
 public:
  pinned_buffer() noexcept = default;

  /// Allocates `bytes` (> 0) bytes. Throws zenflow::error naming `bytes`, or
  /// zenflow::cuda_error. Synchronizes (the allocation calls may synchronize the device, as
  /// cudaHostAlloc does: allocate up front, never in a training step).
  explicit pinned_buffer(std::size_t bytes, pinned_allocation kind = pinned_allocation::host_alloc) : kind_(kind) {
    expects(bytes > 0, "bytes", "must be positive, got 0");
    expects(kind == pinned_allocation::host_alloc || kind == pinned_allocation::write_combined ||
                kind == pinned_allocation::registered,
            "kind", "not a pinned_allocation value: ", static_cast<int>(kind));
    if (kind == pinned_allocation::registered) {
      detail::mapped_region region(bytes);  // unmapped by its destructor if registering throws
      registration_ = detail::cuda_host_registration(region.data(), region.mapped_bytes(), cudaHostRegisterPortable);
      region_ = std::move(region);
    } else {
      unsigned flags = cudaHostAllocPortable;
      if (kind == pinned_allocation::write_combined) flags |= cudaHostAllocWriteCombined;
      allocation_ = detail::cuda_host_buffer(bytes, flags);
    }
  }

  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  pinned_buffer(pinned_buffer&& other) noexcept = default;
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    if (this != &other) {
      reset();  // the registration goes before its mapping
      region_ = std::move(other.region_);
      registration_ = std::move(other.registration_);
      allocation_ = std::move(other.allocation_);
      kind_ = other.kind_;
    }
    return *this;
  }
  ~pinned_buffer() = default;  // members in reverse: allocation, registration, then its mapping

  [[nodiscard]] std::byte* data() const noexcept {
    return kind_ == pinned_allocation::registered ? region_.data() : allocation_.data();
  }
  /// The bytes asked for.
  [[nodiscard]] std::size_t size() const noexcept {
    return kind_ == pinned_allocation::registered ? region_.size() : allocation_.bytes();
  }
  [[nodiscard]] pinned_allocation allocation() const noexcept { return kind_; }
  explicit operator bool() const noexcept { return data() != nullptr; }

  /// Frees now (idempotent). Never throws. Synchronizes like cudaFreeHost.
  void reset() noexcept {
    registration_.reset();  // cudaHostUnregister, then munmap
    region_.reset();
    allocation_.reset();  // cudaFreeHost
  }

 private:
  pinned_allocation kind_ = pinned_allocation::host_alloc;
  detail::mapped_region region_;                 // a `registered` buffer: the mapping ...
  detail::cuda_host_registration registration_;  // ... and its page-locking
  detail::cuda_host_buffer allocation_;          // the other kinds: cudaHostAlloc memory
};

/// One pinned allocation carved into `slot_count` slots of `slot_bytes` bytes, each starting on
/// a 256-byte boundary: slot_count * round_up(slot_bytes, 256) bytes in all, allocated once.
class pinned_pool {
 public:
  /// Throws zenflow::error naming the bad argument before allocating. Synchronizes (allocation).
  pinned_pool(std::size_t slot_bytes, std::size_t slot_count, pinned_allocation kind = pinned_allocation::host_alloc)
      : slot_bytes_(checked_slot_bytes(slot_bytes)),
        slot_count_(checked_slot_count(slot_count)),
        stride_(detail::slot_stride(slot_bytes, slot_count)),
        buffer_(stride_ * slot_count, kind) {}

  [[nodiscard]] std::byte* slot(std::size_t i) const noexcept { return buffer_.data() + i * stride_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  [[nodiscard]] std::size_t slot_count() const noexcept { return slot_count_; }
  /// Distance between two slots' starts (slot_bytes rounded up to 256).
  [[nodiscard]] std::size_t stride() const noexcept { return stride_; }
  [[nodiscard]] const pinned_buffer& buffer() const noexcept { return buffer_; }

 private:
  static std::size_t checked_slot_bytes(std::size_t n) {
    expects(n > 0, "slot_bytes", "must be positive, got 0");
    return n;
  }
  static std::size_t checked_slot_count(std::size_t n) {
    expects(n > 0, "slot_count", "must be positive, got 0");
    return n;
  }

  std::size_t slot_bytes_;
  std::size_t slot_count_;
  std::size_t stride_;
  pinned_buffer buffer_;
};

}  // namespace zenflow

#include "zenflow/detail/transfer_queue/cuda_copy_engine.cuh"

namespace zenflow {

/// CUDA backend of the transfer queue (models zenflow::transfer_queue), the same interface as
/// host_transfer_queue with stream_type = cudaStream_t (any stream of the device current at
/// construction, the legacy default stream included). Thread-safe like the host backend.
/// Consumers wait with cudaEventSynchronize: by default under the device's schedule policy (a
/// spinning thread while few contexts are active), with event_wait::block asleep.
class cuda_transfer_queue : public detail::basic_transfer_queue<detail::cuda_copy_engine> {
 public:
  /// `slot_count` (>= 2) slots of `slot_bytes` (> 0) bytes in one pinned allocation of kind
  /// `kind` (write_combined suits host_to_device staging). Throws zenflow::error naming the bad
  /// argument before allocating, zenflow::cuda_error on a CUDA failure. Synchronizes (allocation).
  /// `wait` says how consumers wait for a copy (see event_wait). A device_to_host queue must not
  /// be write_combined (its consumer reads the slots: uncached reads, an order of magnitude slower).
  cuda_transfer_queue(transfer_direction direction, std::size_t slot_bytes, std::size_t slot_count = 2,
                      pinned_allocation kind = pinned_allocation::host_alloc, event_wait wait = event_wait::spin)
      : basic_transfer_queue(checked_kind(direction, kind), slot_bytes, slot_count, kind, wait) {}

  /// The queue's own cudaStreamNonBlocking copy stream (for profiling or extra ordering).
  [[nodiscard]] cudaStream_t copy_stream() const noexcept { return engine().copy_stream(); }

 private:
  static transfer_direction checked_kind(transfer_direction direction, pinned_allocation kind) {
    expects(!(direction == transfer_direction::device_to_host && kind == pinned_allocation::write_combined), "kind",
            "write_combined memory is for host_to_device staging; a device_to_host queue's consumer reads it");
    return direction;
  }
};

/// Device -> host through the slots of `q` (an idle device_to_host queue), pipelined: the DMA of
/// chunk k+1 overlaps the CPU copy of chunk k out of its pinned slot into `dst` (any host
/// memory, pageable is fine). Ordered after the work already enqueued on `stream`.
/// Synchronizes: returns once `dst` holds the bytes (slot events only, never `stream`).
inline void pipelined_copy_to_host(cuda_transfer_queue& q, void* dst, const void* src, std::size_t bytes,
                                   cudaStream_t stream) {
  detail::pipelined_copy_to_host(q, dst, src, bytes, stream);
}

/// Host -> device through the slots of `q` (a host_to_device queue), pipelined: the CPU copy of
/// chunk k+1 from `src` (any host memory) into a pinned slot overlaps the DMA of chunk k. The
/// copies start after the work already on `stream` (which may still use `dst`), and work enqueued
/// on `stream` afterwards is ordered after them (event waits). Synchronizes: returns once the
/// copies completed (slot events only, never `stream`; so also after that earlier work).
inline void pipelined_copy_to_device(cuda_transfer_queue& q, void* dst, const void* src, std::size_t bytes,
                                     cudaStream_t stream) {
  detail::pipelined_copy_to_device(q, dst, src, bytes, stream);
}

}  // namespace zenflow
