// The coordinator's offload worker: copies each step's gathered CPU-column gradients device to
// host through the device_to_host transfer queue (on its own stream) and accumulates them in fp32
// into the interval's accumulators, then reports its progress in the shared state. A backend whose
// device memory is host memory skips the copy: it accumulates from the staging (the host backend
// with data parallel). The host backend in one process accumulates on its stream instead
// (concepts.hpp, R13): its jobs only order the markers after them.
//
// The accumulation runs on a thread pool of its own (cpu_threads participants, this thread one of
// them): it reads and writes 10 B per bf16 gradient element every step, more than one core's
// memory bandwidth can keep up with beside a GPU's step. The CPU optimizer's pool is not shared:
// it may be running the previous interval's update at the same time. A parameter's first
// accumulated step of an interval overwrites its accumulator instead of adding to it (the same
// bits as into zeros), so nothing zeroes accumulators between intervals.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "zenflow/detail/coordinator/jobs.hpp"
#include "zenflow/detail/coordinator/shared_state.hpp"
#include "zenflow/detail/coordinator/step_flags.hpp"
#include "zenflow/detail/coordinator/worker_thread.hpp"
#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/detail/cpu_adam/kernels.hpp"
#include "zenflow/detail/transfer_queue/basic_queue.hpp"
#include "zenflow/thread_pool.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

/// The device_to_host side: the queue, its copy stream, the job list and the thread are
/// worker_thread's. The coordinator starts it once, pushes jobs under the shared mutex, and
/// requests the stop (shared_state) before it joins or destroys it.
template <class Backend>
class offload_worker : public worker_thread<Backend, offload_job<Backend>> {
  using base = worker_thread<Backend, offload_job<Backend>>;
  using base::jobs_;
  using base::queue_;
  using base::state_;
  using base::stream_;

 public:
  using typename base::job;

  /// `threads` accumulate (0: as many as `cpus`, every CPU this process may run on when it is
  /// empty), on `cpus`, pinned when `pin_threads`; start() puts the worker thread on the same.
  offload_worker(shared_state& state, std::size_t slot_bytes, std::size_t slots, std::size_t threads, bool pin_threads,
                 std::vector<int> cpus)
      : base(state, transfer_direction::device_to_host, slot_bytes, slots),
        pool_(threads, pin_threads, std::move(cpus), "zf-accumulate") {}
  ~offload_worker() { this->join(); }  // the thread runs this class's loop

  /// Starts the thread with `device` as its current device, on `cpus` (empty: unrestricted).
  void start(int device, const std::vector<int>& cpus) {
    this->start_thread("zf-offload", device, cpus, [this] { loop(); });
  }

 private:
  struct in_flight {
    job j;
    std::size_t offset;
    std::size_t bytes;
  };

  // Elements per accumulate task: 256 KiB of fp32, so a 4 MiB slot of bf16 is 8 tasks.
  static constexpr std::size_t chunk_elements = std::size_t{1} << 16;

  void loop();
  void accumulate(const job& j, float* acc, const std::byte* src, std::size_t bytes, float scale);
  void consume_one(std::deque<in_flight>& flight);
  void accumulate_in_place(const job& j);
  bool wait_for_flags(std::int64_t step);

  thread_pool pool_;
};

// Adds (or, as the parameter's first step of the interval, stores) `bytes` of gradient into `acc`.
template <class Backend>
void offload_worker<Backend>::accumulate(const job& j, float* acc, const std::byte* src, std::size_t bytes,
                                         float scale) {
  // *j.accumulated counts the parameter's steps already in this interval's accumulator; only this
  // thread changes it while the interval is being accumulated.
  (void)parallel_accumulate(pool_, cpu_isa::automatic, chunk_elements, acc, src, j.type, bytes / dtype_size(j.type),
                            scale, /*overwrite=*/*j.accumulated == 0);
}

// A gradient handed over during backward can land before step() has produced the step's flags:
// wait for them (abandoned at shutdown: then nothing is accumulated, and this returns false).
template <class Backend>
bool offload_worker<Backend>::wait_for_flags(std::int64_t step) {
  std::unique_lock lock(state_.mutex);
  state_.cv.wait(lock, [&] { return state_.stats_ready_step >= step || state_.stopping || state_.failed; });
  return state_.stats_ready_step >= step;
}

template <class Backend>
void offload_worker<Backend>::consume_one(std::deque<in_flight>& flight) {
  const in_flight f = flight.front();
  if (f.j.bytes == 0) {
    // A rank that owns none of the parameter's CPU columns (data parallel) still counts the step,
    // as the ranks that own some do: every rank agrees on which parameters a CPU update covers.
    flight.pop_front();
    if (!wait_for_flags(f.j.step)) return;
    Backend::synchronize(*f.j.flags_ready);
    if (!f.j.flags->skip) ++*f.j.accumulated;
    return;
  }
  auto slot = queue_.next();
  flight.pop_front();
  if (!wait_for_flags(f.j.step)) {
    queue_.release(slot);
    return;
  }
  Backend::synchronize(*f.j.flags_ready);
  // A gradient gathered before the step's flags existed (data parallel: reduced first) is scaled here.
  if (!f.j.flags->skip) {
    accumulate(f.j, f.j.accumulator + f.offset / dtype_size(f.j.type), slot.data, f.bytes,
               f.j.scale_by_flags ? f.j.flags->scale : 1.0f);
    // The parameter's gradient of this step is in once its last chunk is: count it. Read by the
    // other threads only after this one published the interval's end under the mutex.
    if (f.offset + f.bytes == f.j.bytes) ++*f.j.accumulated;
  }
  queue_.release(slot);
}

// The host backend's D2H copy: none. Waits for the gather and the step's flags, then accumulates
// the whole gradient from the staging (the same kernel on the same values as through the slots:
// element by element, so bit-identical).
template <class Backend>
void offload_worker<Backend>::accumulate_in_place(const job& j) {
  Backend::synchronize(*j.gathered);
  if (!wait_for_flags(j.step)) return;
  Backend::synchronize(*j.flags_ready);
  if (j.flags->skip) return;
  if (j.bytes > 0) accumulate(j, j.accumulator, j.src, j.bytes, j.scale_by_flags ? j.flags->scale : 1.0f);
  ++*j.accumulated;
}

template <class Backend>
void offload_worker<Backend>::loop() {
  std::deque<in_flight> flight;
  for (;;) {
    job j;
    {
      std::unique_lock lock(state_.mutex);
      state_.cv.wait(lock, [&] { return state_.stopping || state_.failed || !jobs_.empty(); });
      if (state_.failed || jobs_.empty()) break;  // stopping with nothing left
      j = jobs_.front();
      jobs_.pop_front();
    }
    if (j.on_stream) {
      // Accumulated and counted on the stream, after the step's flags: the markers after it are
      // published once it ran.
      Backend::synchronize(*j.gathered);
      continue;
    }
    if (j.src == nullptr) {
      // A marker: everything before it must be accumulated first.
      while (!flight.empty()) consume_one(flight);
      std::lock_guard lock(state_.mutex);
      if (j.interval_end) {
        state_.accumulated_interval = j.interval;
      } else {
        if (j.flags != nullptr && !j.flags->skip) {
          ++state_.accumulated_count(j.interval);
        }
        state_.offloaded_through_step = j.step;
      }
      state_.cv.notify_all();
      continue;
    }
    if constexpr (Backend::device_space == memory_space::host) {
      // "Device" memory is host memory: the gathered gradient is accumulated where it is, with no
      // copy into a slot first (in order: nothing is in flight on this path).
      accumulate_in_place(j);
      continue;
    }
    const std::size_t chunk = queue_.slot_bytes() - queue_.slot_bytes() % 4;
    Backend::wait(stream_.get(), *j.gathered);      // the copies below read the gathered gradient
    if (j.bytes == 0) flight.push_back({j, 0, 0});  // counted in order, with no copy
    for (std::size_t off = 0; off < j.bytes; off += chunk) {
      const std::size_t n = std::min(chunk, j.bytes - off);
      auto slot = queue_.try_acquire();
      while (!slot) {
        if (!flight.empty()) consume_one(flight);
        slot = queue_.try_acquire();
        if (!slot && flight.empty()) slot = queue_.acquire();
      }
      queue_.submit_device_to_host(*slot, j.src + off, n, Backend::queue_stream(stream_.get()));
      flight.push_back({j, off, n});
    }
  }
  while (!flight.empty()) consume_one(flight);
}

}  // namespace zenflow::detail
