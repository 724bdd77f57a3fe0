// What each of the coordinator's two workers (offload_worker.hpp, update_worker.hpp) is built on:
// a transfer queue in its direction, the stream its copies run on, its job list (guarded by the
// shared mutex) and the thread that runs its loop with the trainer's device current.
#pragma once

#include <cstddef>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "zenflow/detail/coordinator/shared_state.hpp"
#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/thread_pool.hpp"

namespace zenflow::detail {

template <class Backend, class Job>
class worker_thread {
 public:
  using job = Job;
  using stream_type = typename Backend::stream_type;

  /// The queue has `slots` slots of `slot_bytes` bytes (validated by the coordinator).
  worker_thread(shared_state& state, transfer_direction direction, std::size_t slot_bytes, std::size_t slots)
      : state_(state), queue_(direction, slot_bytes, slots) {}
  worker_thread(const worker_thread&) = delete;
  worker_thread& operator=(const worker_thread&) = delete;
  ~worker_thread() { join(); }

  /// Waits for the thread (after shared_state::request_stop or a failure).
  void join() noexcept {
    if (thread_.joinable()) thread_.join();
  }
  /// Appends a job; the caller holds the shared mutex and notifies the condition variable after.
  void push(const state_lock&, job j) { jobs_.push_back(std::move(j)); }
  /// The stream of the copies (also usable by the coordinator while the thread is not running).
  [[nodiscard]] stream_type stream() noexcept { return stream_.get(); }
  /// Waits for every copy submitted to the queue (shutdown). Never throws.
  void drain() noexcept {
    try {
      queue_.drain();
    } catch (...) {
    }
  }

 protected:
  /// Starts the thread `name`: `loop()` with `device` current, on `cpus` (empty: unrestricted;
  /// threads it starts inherit them); an exception it throws fails the coordinator. The worker's
  /// destructor joins before its own members go.
  template <class Loop>
  void start_thread(const char* name, int device, const std::vector<int>& cpus, Loop loop) {
    thread_ = std::thread([this, device, loop] {
      Backend::bind_device(device);
      state_.run_worker(loop);
    });
    name_thread(thread_, name);
    restrict_thread(thread_, cpus);
  }

  shared_state& state_;
  typename Backend::queue_type queue_;
  typename Backend::owned_stream stream_;
  std::deque<job> jobs_;  // guarded by state_.mutex
  std::thread thread_;
};

}  // namespace zenflow::detail
