// The coordinator's update worker: once an interval's gradients are accumulated, runs the CPU
// Adam on their mean for the CPU columns (the host optimizer's thread pool), copies the updated
// columns out in the parameters' dtype and uploads them through the host_to_device transfer queue
// (on its own stream) into the device staging the write-back scatters from. The copy-out goes
// through a bounded host window, a wave of columns at a time (a CUDA backend); the host backend,
// whose device memory is host memory, has the CPU Adam write that staging itself, no upload
// (concepts.hpp, R14).
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
class update_worker : public worker_thread<Backend, update_job<Backend, typename HostOptimizer::hyper_parameters>> {
  using hyper_parameters = typename HostOptimizer::hyper_parameters;
  using base = worker_thread<Backend, update_job<Backend, hyper_parameters>>;
  using task = optimizer_task<hyper_parameters>;
  using item_type = update_item<hyper_parameters>;
  using base::jobs_;
  using base::queue_;
  using base::state_;
  using base::stream_;

 public:
  using typename base::job;

  /// `window_bytes`: coordinator_config::copy_out_window_bytes (validated by the coordinator).
  update_worker(shared_state& state, HostOptimizer& optimizer, std::size_t slot_bytes, std::size_t slots,
                std::size_t window_bytes)
      : base(state, transfer_direction::host_to_device, slot_bytes, slots),
        optimizer_(optimizer),
        window_bytes_(window_bytes) {}
  ~update_worker() { this->join(); }  // the thread runs this class's loop

  /// Starts the thread with `device` as its current device, on `cpus` (empty: unrestricted).
  void start(int device, const std::vector<int>& cpus) {
    this->start_thread("zf-update", device, cpus, [this] { loop(); });
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
  /// The copy-out window's bytes (0 until a CPU update needs it). Read only while no update runs
  /// (after the coordinator has waited for the launched ones under the shared mutex).
  [[nodiscard]] std::size_t copy_out_window_bytes() const noexcept { return window_.size(); }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr bool in_place = copies_out_in_place<Backend>;

  void loop();
  void run(job& j);
  void step_in_waves(std::span<const task> tasks, std::span<const item_type* const> items);

  HostOptimizer& optimizer_;
  std::vector<update_record> trace_;  // guarded by state_.mutex
  const std::size_t window_bytes_;
  std::vector<std::byte> window_;  // the copy-out window (!in_place); this thread's only
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
    std::vector<task> tasks;
    std::vector<const item_type*> updated;
    for (const auto& item : j.items) {
      const std::int64_t accumulated = *item.accumulated;
      if (accumulated == 0) continue;
      if (item.columns.empty()) {
        // Data parallel: the other ranks update this parameter's CPU columns; its count follows.
        ++*item.cpu_steps;
        continue;
      }
      task t{};
      t.options = &item.hyper;
      t.tensor = item.tensor;
      t.grad = item.accumulator.data();
      t.grad_type = dtype::f32;
      t.columns = item.columns;
      t.grad_compact = true;
      // In place: the CPU Adam writes the write-back staging itself. Else step_in_waves points
      // each wave's copy_out into the window.
      t.copy_out = item.device_out;
      t.copy_out_type = item.out_type;
      t.out_compact = true;
      t.grad_scale = 1.0f / static_cast<float>(accumulated);
      if (item.in_place != nullptr) {
        // One step's fp32 gradient where the trainer left it, scaled as its accumulation would
        // have been (g * scale, the product the CPU Adam forms with a grad_scale of scale / 1).
        t.grad = item.gradient;
        t.grad_compact = false;
        t.out_compact = false;
        t.grad_scale = item.in_place->scale;
      }
      t.step = *item.cpu_steps + 1;
      tasks.push_back(t);
      updated.push_back(&item);
    }
    auto update = [&] {
      if constexpr (in_place)
        optimizer_.step(std::span<const task>(tasks), 1.0f, /*check_finite=*/false);
      else
        step_in_waves(tasks, updated);
    };
    if (!tasks.empty()) {
      if constexpr (requires { optimizer_.nvme_file(); }) {
        // The one-block file a cpu_adam makes at construction moves no byte before the first
        // step replaces it: its counters are zero, so after - before holds across the swap.
        const auto* file = optimizer_.nvme_file();
        const state_file_counters before = file != nullptr ? file->counters() : state_file_counters{};
        update();
        if ((file = optimizer_.nvme_file()) != nullptr) {
          const state_file_counters& after = file->counters();
          std::lock_guard lock(state_.mutex);
          state_.last_update_disk_read = after.bytes_read - before.bytes_read;
          state_.last_update_disk_written = after.bytes_written - before.bytes_written;
          state_.last_update_disk_wait = after.wait_seconds - before.wait_seconds;
        }
      } else {
        update();
      }
    }
    for (const item_type* x : updated) ++*x->cpu_steps;
    Backend::synchronize(stream_.get());
  }
  std::lock_guard lock(state_.mutex);
  state_.last_update_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  for (auto& r : trace_)
    if (r.interval == j.interval) r.accumulated_steps = count;
  state_.updated_interval = j.interval;
  state_.cv.notify_all();
}

// The update in waves: whole columns, taken in order, fill the window; each full window is one
// optimizer step (its columns' copy_out pointing into the window), then uploaded into the device
// staging. Columns are independent, so the results are those of one step over every task (each
// task keeps its step and scale); the optimizer's count is set to one more than before, as one
// step leaves it.
template <class Backend, class HostOptimizer>
void update_worker<Backend, HostOptimizer>::step_in_waves(std::span<const task> tasks,
                                                          std::span<const item_type* const> items) {
  std::size_t total = 0, widest = 0;
  for (std::size_t k = 0; k < tasks.size(); ++k) {
    const std::size_t column = items[k]->rows * dtype_size(tasks[k].copy_out_type);
    total += tasks[k].columns.size() * column;
    widest = std::max(widest, column);
  }
  const std::size_t want = std::max(widest, std::min(window_bytes_, total));
  if (window_.size() < want) {
    window_ = std::vector<std::byte>();  // released before the larger one is allocated
    window_.resize(want);
  }
  struct upload {
    std::byte* dst;
    const std::byte* src;
    std::size_t bytes;
  };
  std::vector<task> wave;
  std::vector<upload> uploads;
  std::size_t used = 0;
  auto flush = [&] {
    optimizer_.step(std::span<const task>(wave), 1.0f, /*check_finite=*/false);
    for (const upload& u : uploads)
      pipelined_copy_to_device(queue_, u.dst, u.src, u.bytes, Backend::queue_stream(stream_.get()));
    wave.clear();
    uploads.clear();
    used = 0;
  };
  const std::int64_t count = optimizer_.step_count();
  for (std::size_t k = 0; k < tasks.size(); ++k) {
    const task& t = tasks[k];
    const std::size_t rows = items[k]->rows;
    const std::size_t column = rows * dtype_size(t.copy_out_type);
    for (std::size_t c = 0; c < t.columns.size();) {
      const std::size_t fit = std::min((window_.size() - used) / column, t.columns.size() - c);
      if (fit == 0) {
        flush();  // not empty: the window holds at least one column
        continue;
      }
      task w = t;
      w.columns = t.columns.subspan(c, fit);
      w.grad = static_cast<const float*>(t.grad) + c * rows;
      w.copy_out = window_.data() + used;
      wave.push_back(w);
      uploads.push_back({items[k]->device_out + c * column, window_.data() + used, fit * column});
      used += fit * column;
      c += fit;
    }
  }
  if (!wave.empty()) flush();
  optimizer_.set_step_count(count + 1);
}

}  // namespace zenflow::detail
