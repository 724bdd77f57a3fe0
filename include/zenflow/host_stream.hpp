// host_stream and host_event: the host stand-ins for a CUDA stream and a CUDA event.
//
// The host backend of every component runs the same asynchronous schedule as the CUDA backend,
// with a host_stream (one worker thread executing work in FIFO order) playing the GPU stream and
// host_events ordering work across streams and threads. Semantics follow CUDA's:
//   - work enqueued on a stream runs in order, asynchronously to the caller;
//   - an event recorded on a stream completes when all work enqueued before the record has run;
//   - `wait(event)` makes later work on a stream wait for the event, without blocking the caller.
// Errors: an exception thrown by work is captured; later work on that stream is skipped (the
// error is sticky, as in CUDA) until `synchronize()` rethrows it to the caller and clears it.
// `host_event::synchronize()` rethrows an error raised on the stream before the record. The
// destructor drains queued work and joins the thread: work never outlives the stream.
//
// The stream is the host backend's "device", and its parallelism is the device's: work that runs
// on the stream (the sparse Adam step, gradient statistics, column gathers and scatters, state
// migration) spreads over `execution()`'s thread pool, whose participants are the stream's own
// worker and `threads - 1` helpers (started at the first `execution()`, so a stream that only
// copies, as the coordinator's own offload and write-back streams, starts none). Results never
// depend on the thread count or the SIMD path.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "zenflow/detail/cpu_adam/isa.hpp"
#include "zenflow/error.hpp"
#include "zenflow/thread_pool.hpp"

namespace zenflow {

/// How host "device" work runs (host_sparse_adam, host_gradient_stats, gather_columns,
/// scatter_columns): spread over `pool` (nullptr: the calling thread alone) with the SIMD path
/// `isa` (automatic: the best this CPU has; a path the CPU lacks throws `zenflow::error`, "isa").
/// Every result is bit-identical whatever the pool's size and the path. Work too small to be
/// worth waking the pool (a few tens of thousands of elements) runs on the calling thread.
struct host_execution {
  thread_pool* pool = nullptr;
  cpu_isa isa = cpu_isa::automatic;
};

class host_stream;

/// A point in a host_stream's work; copyable handle (copies observe the same event).
class host_event {
 public:
  host_event() : state_(std::make_shared<state>()) {}

  /// Captures all work enqueued on `stream` so far. Does not block.
  inline void record(host_stream& stream);

  /// Blocks until the last recorded point has been reached; rethrows an error the stream raised
  /// before it. Returns at once if the event was never recorded. Synchronizes (this event only).
  void synchronize() const {
    std::unique_lock lock(state_->mutex);
    const std::uint64_t target = state_->recorded;
    state_->cv.wait(lock, [&] { return state_->completed >= target; });
    if (state_->error) std::rethrow_exception(state_->error);
  }

  /// True when the last recorded point has been reached. Never blocks.
  [[nodiscard]] bool query() const {
    std::lock_guard lock(state_->mutex);
    return state_->completed >= state_->recorded;
  }

 private:
  friend class host_stream;
  struct state {
    mutable std::mutex mutex;
    std::condition_variable cv;
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
    std::exception_ptr error;  // the stream's error when the last completed record ran
  };
  std::shared_ptr<state> state_;
};

/// An in-order asynchronous work queue served by one thread: the host backend's "GPU stream".
class host_stream {
 public:
  /// `threads`: participants of the stream's device work (the worker included); 0: the CPUs this
  /// process may run on. Starts the worker thread only.
  explicit host_stream(std::size_t threads = 0) : threads_(threads), worker_([this] { run(); }) {}
  host_stream(const host_stream&) = delete;
  host_stream& operator=(const host_stream&) = delete;

  /// Drains queued work, then joins the worker. Errors still pending are dropped (noexcept).
  ~host_stream() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  /// Enqueues `work` to run after everything enqueued before it. Does not block.
  void enqueue(std::function<void()> work) {
    expects(static_cast<bool>(work), "work", "must be a callable, got an empty std::function");
    push({std::move(work), false});
  }

  /// Makes work enqueued after this call wait until `event` completes (the caller does not block).
  /// An error recorded in the event becomes this stream's error.
  void wait(const host_event& event) {
    auto target = event.state_;
    std::uint64_t generation;
    {
      std::lock_guard lock(target->mutex);
      generation = target->recorded;
    }
    push({[target, generation] {
            std::unique_lock lock(target->mutex);
            target->cv.wait(lock, [&] { return target->completed >= generation; });
            if (target->error) std::rethrow_exception(target->error);
          },
          false});
  }

  /// Blocks until all enqueued work has run; rethrows (and clears) the first error raised since
  /// the last synchronize(). Synchronizes (this stream only).
  void synchronize() {
    std::unique_lock lock(mutex_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    if (error_) {
      auto e = std::exchange(error_, nullptr);
      std::rethrow_exception(e);
    }
  }

  /// True when no work is queued or running. Never blocks.
  [[nodiscard]] bool query() const {
    std::lock_guard lock(mutex_);
    return queue_.empty() && !busy_;
  }

  /// Where the stream's device work runs: its pool (started at the first call) and
  /// cpu_isa::automatic (each kernel then takes the widest SIMD path this CPU runs). Meant for work running on the
  /// stream, and for synchronous device work of a caller that synchronized the stream first (the pool runs one job at a
  /// time). Throws `zenflow::error` if the pool's threads cannot be started.
  [[nodiscard]] host_execution execution() {
    std::call_once(pool_started_, [this] { pool_ = std::make_unique<thread_pool>(threads_); });
    return {pool_.get(), cpu_isa::automatic};
  }
  /// Participants of the stream's device work (the constructor's `threads`, 0 resolved).
  [[nodiscard]] std::size_t threads() const { return threads_ != 0 ? threads_ : detail::allowed_cpus().size(); }

 private:
  friend class host_event;
  struct task {
    std::function<void()> work;
    bool marker;  // event records run even after an error, so waiters are released
  };

  void push(task t) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(t));
    }
    cv_.notify_one();
  }

  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task t = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      const bool skip = error_ && !t.marker;
      lock.unlock();
      std::exception_ptr failure;
      if (!skip) {
        try {
          t.work();
        } catch (...) {
          failure = std::current_exception();
        }
      }
      t = task{};  // destroy captured state outside the lock
      lock.lock();
      if (failure && !error_) error_ = std::move(failure);
      busy_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
    }
  }

  // Called by host_event::record with the stream's lock not held.
  void record(const std::shared_ptr<host_event::state>& st) {
    std::uint64_t generation;
    {
      std::lock_guard lock(st->mutex);
      generation = ++st->recorded;
    }
    push({[this, st, generation] {
            std::exception_ptr error;
            {
              std::lock_guard lock(mutex_);
              error = error_;
            }
            std::lock_guard lock(st->mutex);
            if (generation > st->completed) {
              st->completed = generation;
              st->error = error;
            }
            st->cv.notify_all();
          },
          true});
  }

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<task> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::size_t threads_ = 0;
  std::once_flag pool_started_;
  std::unique_ptr<thread_pool> pool_;  // destroyed after the worker has been joined
  std::thread worker_;                 // last: started after every other member is constructed
};

inline void host_event::record(host_stream& stream) {
  stream.record(state_);
}

}  // namespace zenflow
