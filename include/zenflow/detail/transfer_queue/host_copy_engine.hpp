// The host copy engine of host_transfer_queue (see basic_queue.hpp for the engine contract and
// zenflow/transfer_queue.hpp for the schedule). Not a public header.
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/detail/transfer_queue/mapped_region.hpp"
#include "zenflow/host_stream.hpp"

namespace zenflow::detail {

/// The host engine: slots in one mapped_region, one host_event per slot, a host_stream as the
/// copy stream. See basic_queue.hpp for the engine contract.
class host_copy_engine {
 public:
  using stream_type = host_stream&;
  /// Called on the copy worker before each copy, with the slot and the byte count.
  using copy_hook = std::function<void(std::size_t slot, std::size_t bytes)>;

  host_copy_engine(std::size_t slot_bytes, std::size_t slot_count)
      : stride_(slot_stride(slot_bytes, slot_count)), memory_(stride_ * slot_count), events_(slot_count) {}

  std::byte* slot_data(std::size_t i) const noexcept { return memory_.data() + i * stride_; }

  void submit_device_to_host(std::size_t i, const void* src, std::size_t n, host_stream& caller) {
    host_event& event = events_[i];
    event.record(caller);
    copy_.wait(event);
    copy_.enqueue([hook = hook_, i, dst = slot_data(i), src, n] {
      if (hook) hook(i, n);
      if (n > 0) std::memcpy(dst, src, n);
    });
    event.record(copy_);
  }

  void submit_host_to_device(std::size_t i, void* dst, std::size_t n, host_stream& caller) {
    host_event& event = events_[i];
    event.record(caller);  // `dst` may still be in use there
    copy_.wait(event);
    copy_.enqueue([hook = hook_, i, dst, src = slot_data(i), n] {
      if (hook) hook(i, n);
      if (n > 0) std::memcpy(dst, src, n);
    });
    event.record(copy_);
    caller.wait(event);
  }

  void wait(std::size_t i) const { events_[i].synchronize(); }
  bool query(std::size_t i) const { return events_[i].query(); }

  void set_copy_hook(copy_hook hook) { hook_ = std::move(hook); }

 private:
  std::size_t stride_;
  mapped_region memory_;  // outlives copy_, whose destructor drains the copies
  std::vector<host_event> events_;
  copy_hook hook_;
  host_stream copy_;  // last: destroyed first, finishing every queued copy before the slots go
};

}  // namespace zenflow::detail
