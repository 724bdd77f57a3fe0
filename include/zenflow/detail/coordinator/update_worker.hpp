// The coordinator's update worker: once an interval's gradients are accumulated, runs the CPU
// Adam on their mean for the CPU columns (the host optimizer's thread pool), copies the updated
// columns out in the parameters' dtype and uploads them through the host_to_device transfer queue
// (on its own stream) into the device staging the write-back scatters from (the host backend,
// whose device memory is host memory: the CPU Adam writes that staging itself, no upload).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/cpu_adam.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"
#include "zenflow/detail/coordinator/shared_state.hpp"
#include "zenflow/detail/coordinator/worker_thread.hpp"
#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

/// The host_to_device side and the trace of the CPU updates: the queue, its stream, the job list
/// and the thread are worker_thread's. The coordinator starts it once, pushes jobs under the
/// shared mutex (setting launched_interval), and requests the stop (shared_state) before it joins
/// or destroys it. The items of a job stay valid until the job is done: the coordinator changes no
/// parameter's CPU columns or buffers while a CPU update is launched and not written back.
template <class Backend, class HostOptimizer>
class update_worker : public worker_thread<Backend, update_job<Backend>> {
  using base = worker_thread<Backend, update_job<Backend>>;
  using base::jobs_;
  using base::queue_;
  using base::state_;
  using base::stream_;

 public:
  using typename base::job;

  update_worker(shared_state& state, HostOptimizer& optimizer, std::size_t slot_bytes, std::size_t slots)
      : base(state, transfer_direction::host_to_device, slot_bytes, slots), optimizer_(optimizer) {}
  ~update_worker() { this->join(); }  // the thread runs this class's loop

  /// Starts the thread with `device` as its current device.
  void start(int device) {
    this->start_thread(device, [this] { loop(); });
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
  static constexpr bool host_device_memory = Backend::device_space == memory_space::host;

  void loop();
  void run(job& j);

  HostOptimizer& optimizer_;
  std::vector<update_record> trace_;  // guarded by state_.mutex
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
    // Each parameter with its own mean: over the steps that gave it a gradient (none: no update,
    // and the trainer writes nothing back for it).
    std::vector<cpu_adam_task> tasks;
    std::vector<const update_item*> updated;
    for (const auto& item : j.items) {
      const std::int64_t accumulated = *item.accumulated;
      if (accumulated == 0) continue;
      if (item.columns.empty()) {
        // Data parallel: the other ranks update this parameter's CPU columns; its count follows.
        ++*item.cpu_steps;
        continue;
      }
      cpu_adam_task t{};
      t.options = &item.adam;
      t.tensor = item.tensor;
      t.grad = item.accumulator.data();
      t.grad_type = dtype::f32;
      t.columns = item.columns;
      t.grad_compact = true;
      // "Device" memory is host memory: the CPU Adam writes the write-back staging itself.
      t.copy_out = host_device_memory ? static_cast<void*>(item.device_out) : item.out.data();
      t.copy_out_type = item.out_type;
      t.out_compact = true;
      t.grad_scale = 1.0f / static_cast<float>(accumulated);
      t.step = *item.cpu_steps + 1;
      tasks.push_back(t);
      updated.push_back(&item);
    }
    if (!tasks.empty()) {
      if constexpr (requires { optimizer_.nvme_file(); }) {
        // The one-block file a cpu_adam makes at construction moves no byte before the first
        // step replaces it: its counters are zero, so after - before holds across the swap.
        const auto* file = optimizer_.nvme_file();
        const state_file_counters before = file != nullptr ? file->counters() : state_file_counters{};
        optimizer_.step(std::span<const cpu_adam_task>(tasks), 1.0f, /*check_finite=*/false);
        if ((file = optimizer_.nvme_file()) != nullptr) {
          const state_file_counters& after = file->counters();
          std::lock_guard lock(state_.mutex);
          state_.last_update_disk_read = after.bytes_read - before.bytes_read;
          state_.last_update_disk_written = after.bytes_written - before.bytes_written;
          state_.last_update_disk_wait = after.wait_seconds - before.wait_seconds;
        }
      } else {
        optimizer_.step(std::span<const cpu_adam_task>(tasks), 1.0f, /*check_finite=*/false);
      }
    }
    for (const update_item* item : updated) {
      ++*item->cpu_steps;
      if constexpr (!host_device_memory)
        pipelined_copy_to_device(queue_, item->device_out, item->out.data(), item->out.size(),
                                 Backend::queue_stream(stream_.get()));
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
