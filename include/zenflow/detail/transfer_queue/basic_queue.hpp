// The slot bookkeeping shared by both transfer-queue backends, and the public slot types.
//
// basic_transfer_queue<Engine> owns the slot states (free -> acquired -> in flight -> ... -> free),
// the FIFO of submitted slots, backpressure, counters and the sticky copy-path error. The Engine
// owns the memory, the copy stream and one event per slot, and provides:
//   using stream_type;                                     the caller's stream handle
//   Engine(std::size_t slot_bytes, std::size_t slot_count, extra...)
//   std::byte* slot_data(std::size_t i) const
//   void submit_device_to_host(i, const void* src, std::size_t n, stream_type caller)
//        record slot i's event on `caller`, make the copy stream wait for it, copy src -> slot,
//        record slot i's event on the copy stream. Never blocks.
//   void submit_host_to_device(i, void* dst, std::size_t n, stream_type caller)
//        record slot i's event on `caller`, make the copy stream wait for it, copy slot -> dst,
//        record slot i's event on the copy stream, make `caller` wait for it. Never blocks.
//   void wait(i)    blocks on slot i's event only; throws the copy path's error
//   bool query(i)   never blocks; true when slot i's event completed
//   destructor      waits for every copy it enqueued before freeing the slots
// So the host backend and the CUDA backend run the very same schedule.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "zenflow/error.hpp"

namespace zenflow {

/// Which way a transfer queue moves bytes.
enum class transfer_direction : std::uint8_t {
  device_to_host,  ///< gradients: device memory -> slot; a consumer reads the slot
  host_to_device,  ///< parameters: a producer writes the slot; slot -> device memory
};

/// "device_to_host" / "host_to_device".
inline const char* to_string(transfer_direction d) noexcept {
  return d == transfer_direction::device_to_host ? "device_to_host" : "host_to_device";
}

/// A handle to one slot of a transfer queue, valid while its holder holds it.
struct transfer_slot {
  std::size_t index = 0;       ///< the slot's position in its queue
  std::byte* data = nullptr;   ///< the slot's (pinned, in the CUDA backend) buffer
  std::size_t capacity = 0;    ///< the slot's size in bytes (the queue's slot_bytes())
  std::size_t bytes = 0;       ///< bytes filled: 0 from acquire(), the copied size from next()
  std::uint64_t sequence = 0;  ///< the queue's acquire() order; identifies this use of the slot
};

/// What a queue has moved in its direction (counted when a copy is submitted).
struct transfer_counters {
  std::uint64_t bytes = 0;      ///< bytes submitted for copy
  std::uint64_t transfers = 0;  ///< copies submitted
};

namespace detail {

/// The one slot size-and-alignment rule of both backends: slots start on 256-byte boundaries,
/// so a pool is slot_count * round_up(slot_bytes, 256) bytes (exact, no power-of-two rounding).
inline constexpr std::size_t slot_alignment = 256;

/// The distance between two slots; throws when the pool's size overflows size_t, naming the
/// caller's fields for the slot size and the slot count (slot_count >= 1).
inline std::size_t slot_stride(std::size_t slot_bytes, std::size_t slot_count,
                               const char* slot_bytes_name = "slot_bytes", const char* slot_count_name = "slot_count") {
  expects(slot_bytes <= std::numeric_limits<std::size_t>::max() - (slot_alignment - 1), slot_bytes_name,
          "too large: ", slot_bytes);
  const std::size_t stride = (slot_bytes + slot_alignment - 1) & ~(slot_alignment - 1);
  expects(stride <= std::numeric_limits<std::size_t>::max() / slot_count, slot_count_name, slot_count_name, " ",
          slot_count, " x ", slot_bytes_name, " ", slot_bytes, " overflows size_t");
  return stride;
}

template <class Engine>
class basic_transfer_queue {
 public:
  using engine_type = Engine;
  using stream_type = typename Engine::stream_type;
  using slot_type = transfer_slot;

  /// Validates the geometry before allocating anything. Synchronizes only while allocating.
  template <class... EngineArgs>
  basic_transfer_queue(transfer_direction direction, std::size_t slot_bytes, std::size_t slot_count,
                       EngineArgs&&... engine_args)
      : direction_(validated(direction, slot_bytes, slot_count)),
        slot_bytes_(slot_bytes),
        slot_count_(slot_count),
        engine_(slot_bytes, slot_count, std::forward<EngineArgs>(engine_args)...),
        slots_(slot_count) {
    for (std::size_t i = 0; i < slot_count; ++i) free_.push_back(i);
  }

  basic_transfer_queue(const basic_transfer_queue&) = delete;
  basic_transfer_queue& operator=(const basic_transfer_queue&) = delete;

  /// Waits for every copy still in flight (the engine's destructor), then frees the slots.
  /// Outstanding slot handles become invalid. No other thread may be inside a member function
  /// (a consumer blocked in next() included). Never throws.
  ~basic_transfer_queue() = default;

  [[nodiscard]] transfer_direction direction() const noexcept { return direction_; }
  [[nodiscard]] std::size_t slot_count() const noexcept { return slot_count_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_bytes_; }

  /// Bytes and copies submitted so far. Never blocks on a copy.
  [[nodiscard]] transfer_counters counters() const {
    std::lock_guard lock(mutex_);
    return counters_;
  }

  /// True when no slot is held by a producer or a consumer and, for device_to_host, none waits
  /// for its consumer. (host_to_device slots in flight free themselves.) Never blocks.
  [[nodiscard]] bool idle() const {
    std::lock_guard lock(mutex_);
    const std::size_t self_freeing = direction_ == transfer_direction::host_to_device ? in_flight_.size() : 0;
    return free_.size() + self_freeing == slot_count_;
  }

  /// Producer: blocks until a slot is free — released by its consumer (device_to_host) or its
  /// copy completed (host_to_device: waits on the oldest in-flight slot's event only) — and hands
  /// it out with bytes = 0. Rethrows a copy-path error. Synchronizes (one slot event at most).
  /// Note: device_to_host slots are freed only by release(); a thread that holds every slot
  /// itself must consume (next()) before acquiring again, or use try_acquire().
  transfer_slot acquire() {
    std::unique_lock lock(mutex_);
    for (;;) {
      throw_if_failed();
      if (!free_.empty()) {
        const std::size_t i = free_.front();
        free_.pop_front();
        return hand_out(i);
      }
      if (direction_ == transfer_direction::host_to_device && !in_flight_.empty()) {
        const std::size_t i = in_flight_.front();
        in_flight_.pop_front();
        slots_[i].state = slot_state::waiting;
        lock.unlock();
        wait_slot(i);
        lock.lock();
        return hand_out(i);
      }
      cv_.wait(lock);
    }
  }

  /// Producer: like acquire() but returns std::nullopt instead of blocking. Never blocks.
  std::optional<transfer_slot> try_acquire() {
    std::lock_guard lock(mutex_);
    throw_if_failed();
    if (!free_.empty()) {
      const std::size_t i = free_.front();
      free_.pop_front();
      return hand_out(i);
    }
    if (direction_ == transfer_direction::host_to_device && !in_flight_.empty() && query_slot(in_flight_.front())) {
      const std::size_t i = in_flight_.front();
      in_flight_.pop_front();
      return hand_out(i);
    }
    return std::nullopt;
  }

  /// Producer, device_to_host: enqueues on the queue's copy stream a copy of `bytes` bytes from
  /// `src` (device memory; host memory in the host backend) into the slot, ordered after all
  /// work enqueued so far on `stream` (an event, never a stream or device sync). The slot goes
  /// to the consumer side (next()). `src` must stay unchanged until the slot comes out of next().
  /// Does not block.
  void submit_device_to_host(transfer_slot slot, const void* src, std::size_t bytes, stream_type stream) {
    expects(direction_ == transfer_direction::device_to_host, "direction",
            "submit_device_to_host needs a device_to_host queue, this one is ", to_string(direction_));
    expects(src != nullptr || bytes == 0, "src", "must not be null");
    submit(slot, bytes, [&](std::size_t i) { engine_.submit_device_to_host(i, src, bytes, stream); });
  }

  /// Producer, host_to_device: the producer has written slot.data[0, bytes); enqueues on the
  /// copy stream, after an event from `stream` (so after the work enqueued there so far, which
  /// may still use `dst`), a copy into `dst` (device memory); work enqueued on `stream` after
  /// this call waits for it (event waits; the caller does not block). The slot frees itself once
  /// the copy completed. Does not block.
  void submit_host_to_device(transfer_slot slot, void* dst, std::size_t bytes, stream_type stream) {
    expects(direction_ == transfer_direction::host_to_device, "direction",
            "submit_host_to_device needs a host_to_device queue, this one is ", to_string(direction_));
    expects(dst != nullptr || bytes == 0, "dst", "must not be null");
    submit(slot, bytes, [&](std::size_t i) { engine_.submit_host_to_device(i, dst, bytes, stream); });
  }

  /// Consumer, device_to_host: blocks until a slot was submitted, then waits for the oldest
  /// submitted slot's copy (its event only) and returns it with `bytes` filled. Read slot.data,
  /// then release(slot). Rethrows a copy-path error. Synchronizes (one slot event).
  transfer_slot next() {
    expects(direction_ == transfer_direction::device_to_host, "direction",
            "next() consumes a device_to_host queue, this one is ", to_string(direction_));
    std::unique_lock lock(mutex_);
    for (;;) {
      throw_if_failed();
      if (!in_flight_.empty()) break;
      cv_.wait(lock);
    }
    const std::size_t i = in_flight_.front();
    in_flight_.pop_front();
    slots_[i].state = slot_state::waiting;
    lock.unlock();
    wait_slot(i);
    lock.lock();
    slots_[i].state = slot_state::delivered;
    return handle(i);
  }

  /// Consumer: like next() but returns std::nullopt when nothing was submitted or the oldest
  /// copy has not completed. Never blocks.
  std::optional<transfer_slot> try_next() {
    expects(direction_ == transfer_direction::device_to_host, "direction",
            "try_next() consumes a device_to_host queue, this one is ", to_string(direction_));
    std::lock_guard lock(mutex_);
    throw_if_failed();
    if (in_flight_.empty() || !query_slot(in_flight_.front())) return std::nullopt;
    const std::size_t i = in_flight_.front();
    in_flight_.pop_front();
    slots_[i].state = slot_state::delivered;
    return handle(i);
  }

  /// Hands back a slot this side holds: one returned by next() (consumed), or one returned by
  /// acquire()/try_acquire() and not submitted (abandoned). Throws zenflow::error naming `slot`
  /// for any other handle (free, in flight, stale, or another queue's). Works after a copy-path
  /// error too. Never blocks.
  void release(transfer_slot slot) {
    std::lock_guard lock(mutex_);
    const std::size_t i = slot.index;
    expects(owns(slot) && (slots_[i].state == slot_state::acquired || slots_[i].state == slot_state::delivered), "slot",
            "this queue does not hand out slot ", i, " with sequence ", slot.sequence,
            " to anyone who could release it (free, in flight, stale or another queue's handle)");
    slots_[i].state = slot_state::free;
    slots_[i].bytes = 0;
    free_.push_back(i);
    cv_.notify_all();
  }

  /// Waits for every copy submitted so far (their events only), then rethrows a copy-path error
  /// (raised now or earlier). host_to_device slots whose copy completed become free.
  /// Synchronizes (the queue's events, never the caller's stream or the device).
  void drain() {
    std::vector<std::pair<std::size_t, std::uint64_t>> pending;
    {
      std::lock_guard lock(mutex_);
      for (std::size_t i : in_flight_) pending.emplace_back(i, slots_[i].sequence);
    }
    for (const auto& [i, sequence] : pending) {
      try {
        engine_.wait(i);
      } catch (...) {
        record_failure(std::current_exception());
      }
    }
    std::lock_guard lock(mutex_);
    if (direction_ == transfer_direction::host_to_device) {
      for (const auto& [i, sequence] : pending) {
        if (slots_[i].state != slot_state::in_flight || slots_[i].sequence != sequence) continue;
        in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), i));
        slots_[i].state = slot_state::free;
        free_.push_back(i);
      }
      cv_.notify_all();
    }
    throw_if_failed();
  }

 protected:
  Engine& engine() noexcept { return engine_; }
  const Engine& engine() const noexcept { return engine_; }

 private:
  enum class slot_state : std::uint8_t {
    free,       // in free_
    acquired,   // held by a producer
    in_flight,  // submitted, in in_flight_
    waiting,    // a thread waits on its event (consumer in next(), producer reclaiming in acquire())
    delivered,  // device_to_host: held by a consumer
  };
  struct slot_record {
    slot_state state = slot_state::free;
    std::size_t bytes = 0;
    std::uint64_t sequence = 0;
  };

  static transfer_direction validated(transfer_direction direction, std::size_t slot_bytes, std::size_t slot_count) {
    expects(direction == transfer_direction::device_to_host || direction == transfer_direction::host_to_device,
            "direction", "not a transfer_direction value: ", static_cast<int>(direction));
    expects(slot_bytes > 0, "slot_bytes", "must be positive, got 0");
    expects(slot_count >= 2, "slot_count", "must be at least 2 (double buffering), got ", slot_count);
    (void)slot_stride(slot_bytes, slot_count);  // overflow check
    return direction;
  }

  bool owns(const transfer_slot& slot) const {
    return slot.index < slot_count_ && slot.data == engine_.slot_data(slot.index) &&
           slot.sequence == slots_[slot.index].sequence;
  }

  // Holding the lock.
  transfer_slot hand_out(std::size_t i) {
    slots_[i] = {slot_state::acquired, 0, next_sequence_++};
    return handle(i);
  }
  transfer_slot handle(std::size_t i) {
    return {i, engine_.slot_data(i), slot_bytes_, slots_[i].bytes, slots_[i].sequence};
  }
  void throw_if_failed() const {
    if (error_) std::rethrow_exception(error_);
  }

  template <class Enqueue>
  void submit(const transfer_slot& slot, std::size_t bytes, Enqueue&& enqueue) {
    std::lock_guard lock(mutex_);
    throw_if_failed();
    expects(owns(slot) && slots_[slot.index].state == slot_state::acquired, "slot",
            "submit needs a slot this producer acquired and has not submitted (slot ", slot.index, ", sequence ",
            slot.sequence, ")");
    expects(bytes <= slot_bytes_, "bytes", "must fit the slot: ", bytes, " > slot_bytes ", slot_bytes_);
    try {
      enqueue(slot.index);  // under the lock: the copy stream's order is the FIFO's order
    } catch (...) {
      // Part of the copy may be enqueued already and is tracked by no slot: the queue is failed
      // from now on, so the slot's memory is never handed out again while that DMA may run.
      if (!error_) error_ = std::current_exception();
      cv_.notify_all();
      throw;
    }
    slots_[slot.index].state = slot_state::in_flight;
    slots_[slot.index].bytes = bytes;
    in_flight_.push_back(slot.index);
    counters_.bytes += bytes;
    counters_.transfers += 1;
    cv_.notify_all();
  }

  // Waits without the lock; a failure becomes the queue's sticky error.
  void wait_slot(std::size_t i) {
    try {
      engine_.wait(i);
    } catch (...) {
      record_failure(std::current_exception());
      throw;
    }
  }
  // Holding the lock; engine_.wait returns at once on a completed event and reports its error.
  bool query_slot(std::size_t i) {
    try {
      if (!engine_.query(i)) return false;
      engine_.wait(i);
      return true;
    } catch (...) {
      if (!error_) error_ = std::current_exception();
      cv_.notify_all();
      throw;
    }
  }
  void record_failure(std::exception_ptr e) {
    std::lock_guard lock(mutex_);
    if (!error_) error_ = std::move(e);
    cv_.notify_all();
  }

  transfer_direction direction_;
  std::size_t slot_bytes_;
  std::size_t slot_count_;
  Engine engine_;  // destroyed after the bookkeeping; its destructor waits for the copies in flight
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<slot_record> slots_;
  std::deque<std::size_t> free_;       // free slots, reused round-robin
  std::deque<std::size_t> in_flight_;  // submitted slots, in submission (= copy stream) order
  std::uint64_t next_sequence_ = 0;
  transfer_counters counters_;
  std::exception_ptr error_;  // the first copy-path error: sticky, every later call rethrows it
};

/// Device -> host through the slots, pipelined: the copy of chunk k+1 runs while chunk k is
/// copied out of its slot into `dst`. Needs an idle device_to_host queue. Synchronizes: returns
/// when `dst` holds all `bytes` (waits on slot events only). On a copy-path error it waits for
/// the copies it started, then rethrows.
template <class Queue>
void pipelined_copy_to_host(Queue& q, void* dst, const void* src, std::size_t bytes,
                            typename Queue::stream_type stream) {
  expects(q.direction() == transfer_direction::device_to_host, "q", "needs a device_to_host queue, got ",
          to_string(q.direction()));
  expects(bytes == 0 || (dst != nullptr && src != nullptr), bytes == 0 || dst ? "src" : "dst", "must not be null");
  expects(q.idle(), "q", "must be idle (no slot acquired, submitted or held by a consumer)");
  auto* out = static_cast<std::byte*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  std::size_t submitted = 0, consumed = 0;
  try {
    while (consumed < bytes) {
      if (submitted < bytes) {
        if (auto slot = q.try_acquire()) {
          const std::size_t n = std::min(q.slot_bytes(), bytes - submitted);
          try {
            q.submit_device_to_host(*slot, in + submitted, n, stream);
          } catch (...) {
            q.release(*slot);
            throw;
          }
          submitted += n;
          continue;
        }
      }
      const transfer_slot slot = q.next();
      std::memcpy(out + consumed, slot.data, slot.bytes);
      consumed += slot.bytes;
      q.release(slot);
    }
  } catch (...) {
    try {
      q.drain();  // no copy still reads `src` when we return
    } catch (...) {
    }
    throw;
  }
}

/// Host -> device through the slots, pipelined: chunk k+1 is written into a slot while chunk k
/// is copied to `dst`. Synchronizes: returns when the copies completed (slot events only), so
/// `src` may be reused and `dst` holds the bytes; work enqueued on `stream` afterwards is
/// ordered after them too. On an error it waits for the copies it started, then rethrows.
template <class Queue>
void pipelined_copy_to_device(Queue& q, void* dst, const void* src, std::size_t bytes,
                              typename Queue::stream_type stream) {
  expects(q.direction() == transfer_direction::host_to_device, "q", "needs a host_to_device queue, got ",
          to_string(q.direction()));
  expects(bytes == 0 || (dst != nullptr && src != nullptr), bytes == 0 || dst ? "src" : "dst", "must not be null");
  auto* out = static_cast<std::byte*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  std::size_t offset = 0;
  try {
    while (offset < bytes) {
      const transfer_slot slot = q.acquire();
      const std::size_t n = std::min(q.slot_bytes(), bytes - offset);
      try {
        std::memcpy(slot.data, in + offset, n);
        q.submit_host_to_device(slot, out + offset, n, stream);
      } catch (...) {
        q.release(slot);
        throw;
      }
      offset += n;
    }
  } catch (...) {
    try {
      q.drain();
    } catch (...) {
    }
    throw;
  }
  q.drain();
}

}  // namespace detail
}  // namespace zenflow
