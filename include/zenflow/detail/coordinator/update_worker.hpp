// The coordinator's update worker: once an interval's gradients are accumulated, runs the CPU
// Adam on their mean for the CPU columns (the host optimizer's thread pool), copies the updated
// columns out in the parameters' dtype and uploads them through the host_to_device transfer queue
// (on its own stream) into the device staging the write-back scatters from.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/cpu_adam.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"
#include "zenflow/detail/coordinator/shared_state.hpp"
#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

/// Owns the host_to_device queue, its copy stream, the job list, the thread and the trace of the
/// CPU updates. The coordinator starts it once, pushes jobs under the shared mutex, and requests
/// the stop (shared_state) before it joins or destroys it. The items of a job stay valid until the
/// job is done: the coordinator changes no parameter's CPU columns or buffers while a CPU update
/// is launched and not written back.
template <class Backend, class HostOptimizer>
class update_worker {
 public:
  using job = update_job<Backend>;
  using stream_type = typename Backend::stream_type;

  /// The queue has `slots` slots of `slot_bytes` bytes (validated by the coordinator).
  update_worker(shared_state& state, HostOptimizer& optimizer, std::size_t slot_bytes, std::size_t slots)
      : state_(state), optimizer_(optimizer), queue_(transfer_direction::host_to_device, slot_bytes, slots) {}
  update_worker(const update_worker&) = delete;
  update_worker& operator=(const update_worker&) = delete;
  ~update_worker() { join(); }

  /// Starts the thread with `device` as its current device.
  void start(int device) {
    thread_ = std::thread([this, device] {
      Backend::bind_device(device);
      state_.run_worker([this] { loop(); });
    });
  }
  /// Waits for the thread (after shared_state::request_stop or a failure).
  void join() noexcept {
    if (thread_.joinable()) thread_.join();
  }
  /// Appends a job; the caller holds the shared mutex, sets launched_interval and notifies the
  /// condition variable after.
  void push(const state_lock&, job j) { jobs_.push_back(std::move(j)); }
  /// The stream of the uploads.
  [[nodiscard]] stream_type stream() noexcept { return stream_.get(); }
  /// Waits for every copy submitted to the queue (shutdown). Never throws.
  void drain() noexcept {
    try {
      queue_.drain();
    } catch (...) {
    }
  }

  /// The staleness oracle's records (coordinator_config::record_trace), guarded by the shared
  /// mutex: the coordinator adds one per launched update and marks its write-backs; this worker
  /// fills in how many steps each averaged.
  void add_record(const state_lock&, const update_record& r) { trace_.push_back(r); }
  void mark_written_back(const state_lock&, std::int64_t interval, std::int64_t at_end_of) {
    for (auto& r : trace_)
      if (r.interval == interval) {
        r.written_back_at = at_end_of;
        ++r.write_backs;
      }
  }
  [[nodiscard]] std::vector<update_record> trace(const state_lock&) const { return trace_; }

 private:
  using clock = std::chrono::steady_clock;

  void loop();
  void run(job& j);

  shared_state& state_;
  HostOptimizer& optimizer_;
  typename Backend::queue_type queue_;
  typename Backend::owned_stream stream_;
  std::deque<job> jobs_;              // guarded by state_.mutex
  std::vector<update_record> trace_;  // guarded by state_.mutex
  std::thread thread_;
};

template <class Backend, class HostOptimizer>
void update_worker<Backend, HostOptimizer>::loop() {
  for (;;) {
    job j;
    {
      std::unique_lock lock(state_.mutex);
      state_.cv.wait(lock, [&] { return state_.stopping || state_.failed || !jobs_.empty(); });
      if (state_.failed || jobs_.empty()) break;
      j = std::move(jobs_.front());
      jobs_.pop_front();
      // Every gradient of the interval must be accumulated.
      state_.cv.wait(lock,
                     [&] { return state_.failed || state_.stopping || state_.accumulated_interval >= j.interval; });
      if (state_.accumulated_interval < j.interval) break;
    }
    run(j);
  }
}

template <class Backend, class HostOptimizer>
void update_worker<Backend, HostOptimizer>::run(job& j) {
  const auto t0 = clock::now();
  std::int64_t count;
  {
    std::lock_guard lock(state_.mutex);
    count = state_.accumulated_count(j.interval);
  }
  if (count > 0) {
    Backend::synchronize(*j.written_back);
    std::vector<cpu_adam_task> tasks;
    for (const auto& item : j.items) {
      cpu_adam_task t{};
      t.options = &item.adam;
      t.tensor = item.tensor;
      t.grad = item.accumulator.data();
      t.grad_type = dtype::f32;
      t.columns = item.columns;
      t.grad_compact = true;
      t.copy_out = item.out.data();
      t.copy_out_type = item.out_type;
      t.out_compact = true;
      tasks.push_back(t);
    }
    optimizer_.step(std::span<const cpu_adam_task>(tasks), 1.0f / static_cast<float>(count), /*check_finite=*/false);
    for (const auto& item : j.items) {
      pipelined_copy_to_device(queue_, item.device_out, item.out.data(), item.out.size(),
                               Backend::queue_stream(stream_.get()));
      std::fill(item.accumulator.begin(), item.accumulator.end(), 0.0f);
    }
    Backend::synchronize(stream_.get());
  }
  std::lock_guard lock(state_.mutex);
  state_.last_update_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  for (auto& r : trace_)
    if (r.interval == j.interval) r.accumulated_steps = count;
  state_.updated_interval = j.interval;
  state_.cv.notify_all();
}

}  // namespace zenflow::detail
