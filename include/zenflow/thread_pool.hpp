// A small persistent thread pool owned by the library (no OpenMP in the public API).
//
// `thread_pool(n)` starts n - 1 worker threads; the thread that calls `parallel_for` is the n-th
// participant. Workers sleep on a condition variable between calls and are joined by the
// destructor. Tasks are handed out dynamically (one atomic counter), so unequal tasks balance.
//
// - `parallel_for` synchronizes: it returns when every task has run and no worker touches the
//   callable any more; the first exception thrown by a task is rethrown in the caller (the
//   remaining unstarted tasks are then skipped).
// - Calls from several threads at once are serialized (one job at a time).
// - A call from inside a task (nested) runs its tasks serially on the calling thread instead of
//   deadlocking.
// - `cpus`: the CPUs the workers may run on (Linux; empty: every CPU this process may run on, and
//   the workers are left where the system puts them). `pin_to_cores`: worker i is pinned to the
//   (i+1)-th of those CPUs. Either way the caller's thread is left alone (a caller that must stay
//   off some CPUs restricts itself: detail::restrict_thread).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "zenflow/error.hpp"

namespace zenflow {

namespace detail {
/// The CPUs this process may run on (sched_getaffinity), in ascending order; falls back to
/// 0 .. hardware_concurrency-1 elsewhere.
inline std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
#endif
  if (cpus.empty()) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

/// Checks that `cpus` lists distinct CPUs this process may run on (throws zenflow::error naming
/// `argument`). An empty list is valid (it means every such CPU).
inline void check_cpus(const std::vector<int>& cpus, const char* argument) {
  const std::vector<int> allowed = allowed_cpus();
  for (std::size_t i = 0; i < cpus.size(); ++i) {
    expects(std::binary_search(allowed.begin(), allowed.end(), cpus[i]), argument, "CPU ", cpus[i],
            " is not one this process may run on (sched_getaffinity allows ", allowed.size(), " CPUs, ",
            allowed.front(), " to ", allowed.back(), ")");
    expects(std::find(cpus.begin(), cpus.begin() + static_cast<std::ptrdiff_t>(i), cpus[i]) ==
                cpus.begin() + static_cast<std::ptrdiff_t>(i),
            argument, "CPU ", cpus[i], " is listed twice");
  }
}

/// Restricts thread `t` to `cpus` (Linux: pthread_setaffinity_np; elsewhere nothing). Empty:
/// unchanged. Best effort: a refusal leaves the thread where it was.
inline void restrict_thread(std::thread& t, const std::vector<int>& cpus) noexcept {
#if defined(__linux__)
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  (void)pthread_setaffinity_np(t.native_handle(), sizeof set, &set);
#else
  (void)t;
  (void)cpus;
#endif
}

/// Names thread `t` (Linux: pthread_setname_np, what top, gdb and profilers show; at most 15
/// characters are kept). Best effort.
inline void name_thread(std::thread& t, const char* name) noexcept {
#if defined(__linux__)
  char kept[16] = {};
  for (std::size_t i = 0; i + 1 < sizeof kept && name[i] != '\0'; ++i) kept[i] = name[i];
  (void)pthread_setname_np(t.native_handle(), kept);
#else
  (void)t;
  (void)name;
#endif
}

inline thread_local const void* current_pool_job = nullptr;  // set while a thread runs a pool task
}  // namespace detail

/// Persistent workers for data-parallel loops. Not copyable or movable.
class thread_pool {
 public:
  /// `threads` participants in every `parallel_for` (the caller included); 0 means the number of
  /// CPUs the workers may run on: `cpus` (distinct CPUs this process may run on), or when it is
  /// empty every CPU this process may run on. Throws `zenflow::error` if `cpus` lists a CPU this
  /// process may not run on or lists one twice (argument "cpus"), or if a thread cannot be started.
  /// The workers are named `name` (Linux; at most 15 characters are kept).
  explicit thread_pool(std::size_t threads = 0, bool pin_to_cores = false, std::vector<int> cpus = {},
                       const char* name = "zf-pool") {
    detail::check_cpus(cpus, "cpus");
    const bool restricted = !cpus.empty();
    if (!restricted) cpus = detail::allowed_cpus();
    size_ = threads == 0 ? cpus.size() : threads;
    cpus_ = restricted ? cpus : std::vector<int>{};
    workers_.reserve(size_ - 1);
    try {
      for (std::size_t w = 0; w + 1 < size_; ++w) {
        workers_.emplace_back([this, w] { worker_loop(w); });
        detail::name_thread(workers_.back(), name);
        if (pin_to_cores)
          detail::restrict_thread(workers_.back(), {cpus[(w + 1) % cpus.size()]});
        else
          detail::restrict_thread(workers_.back(), cpus_);
      }
    } catch (const std::exception& e) {
      shutdown();
      throw error("threads", detail::concat("could not start worker threads: ", e.what()));
    }
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  /// Joins every worker. Never leaves work running (a `parallel_for` in flight has returned).
  ~thread_pool() { shutdown(); }

  /// Participants of a `parallel_for`: the worker threads plus the caller.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// The CPUs the workers were restricted to (empty: not restricted).
  [[nodiscard]] const std::vector<int>& cpus() const noexcept { return cpus_; }

  /// Runs fn(i) for every i in [0, task_count) across the workers and the calling thread.
  /// Synchronizes: returns when all tasks are done; rethrows the first exception of a task.
  void parallel_for(std::size_t task_count, const std::function<void(std::size_t)>& fn) {
    if (task_count == 0) return;
    if (detail::current_pool_job != nullptr || workers_.empty() || task_count == 1) {
      for (std::size_t i = 0; i < task_count; ++i) fn(i);  // nested, single-threaded or trivial
      return;
    }
    std::lock_guard<std::mutex> one_job_at_a_time(call_mutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      task_count_ = task_count;
      next_.store(0, std::memory_order_relaxed);
      error_ = nullptr;
      busy_workers_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    run_tasks();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_workers_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void run_tasks() noexcept {
    const auto& fn = *job_;
    detail::current_pool_job = this;
    for (;;) {
      const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= task_count_) break;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(task_count_, std::memory_order_relaxed);  // skip the tasks not yet started
      }
    }
    detail::current_pool_job = nullptr;
  }

  void worker_loop(std::size_t) noexcept {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run_tasks();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (--busy_workers_ == 0) done_.notify_one();
      }
    }
  }

  void shutdown() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
    workers_.clear();
  }

  std::size_t size_ = 1;
  std::vector<int> cpus_;
  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // serializes parallel_for callers
  std::mutex mutex_;       // guards the fields below (next_ aside)
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t task_count_ = 0;
  std::atomic<std::size_t> next_{0};
  std::exception_ptr error_;
  std::size_t busy_workers_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace zenflow
