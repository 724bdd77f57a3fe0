// What the coordinator's three threads share: the trainer thread (which runs the schedule), the
// offload worker (offload_worker.hpp) and the update worker (update_worker.hpp). One mutex guards
// every field; every change another thread may wait for is announced on the one condition variable.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>

namespace zenflow::detail {

/// Proof that the caller holds shared_state::mutex (taken by the calls that change a worker's
/// job list together with the progress counters).
using state_lock = std::lock_guard<std::mutex>;

struct shared_state {
  std::mutex mutex;
  std::condition_variable cv;

  // Offload progress.
  std::int64_t stats_ready_step = -1;        ///< the flags of steps <= this are recorded (the trainer)
  std::int64_t offloaded_through_step = -1;  ///< every gradient of steps <= this is accumulated
  std::int64_t accumulated_interval = -1;    ///< intervals <= this are fully accumulated
  /// Non-skipped steps per interval, by index % 4: at most three intervals are live at once (one
  /// awaiting its write-back, one in its CPU update, one accumulating).
  std::array<std::int64_t, 4> accumulated_counts{};
  std::int64_t& accumulated_count(std::int64_t interval) noexcept { return accumulated_counts[interval % 4]; }

  // CPU update progress.
  std::int64_t launched_interval = -1;  ///< CPU updates of intervals <= this were handed over
  std::int64_t updated_interval = -1;   ///< CPU updates of intervals <= this are done
  double last_update_seconds = 0.0;     ///< duration of the last completed CPU update
  /// NVMe state tier: the last completed CPU update's state-file I/O (zero with state in RAM).
  std::uint64_t last_update_disk_read = 0, last_update_disk_written = 0;
  double last_update_disk_wait = 0.0;  ///< seconds of last_update_seconds spent waiting on the disk

  // Failure and shutdown.
  std::exception_ptr error;  ///< the first error of any thread (never cleared)
  bool failed = false;
  bool stopping = false;

  /// Records `e` unless an error is already recorded, and wakes every waiter.
  void fail(std::exception_ptr e) {
    std::lock_guard lock(mutex);
    if (!error) error = std::move(e);
    failed = true;
    cv.notify_all();
  }
  /// Rethrows the recorded error, if any.
  void rethrow_error() {
    std::lock_guard lock(mutex);
    if (error) std::rethrow_exception(error);
  }
  /// Asks the workers to stop once their job lists are empty.
  void request_stop() noexcept {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    cv.notify_all();
  }
  /// Runs a worker's loop; an exception it throws fails the coordinator. Published after the
  /// handler has ended, so that the worker holds no reference to the exception once the trainer
  /// may rethrow and free it.
  template <class Loop>
  void run_worker(Loop&& loop) noexcept {
    std::exception_ptr e;
    try {
      std::forward<Loop>(loop)();
    } catch (...) {
      e = std::current_exception();
    }
    if (e) fail(std::move(e));
  }
};

}  // namespace zenflow::detail
