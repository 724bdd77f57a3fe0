// call_order: the call order and the failure state of a communicator that issues its collectives
// from stream worker threads in the order they were called (mpi_communicator, zenflow.torch's
// process_group_communicator). Each collective takes a ticket when called and runs in its turn;
// the first failure wins and ends every wait.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "zenflow/error.hpp"

namespace zenflow::detail {

class call_order {
  using clock = std::chrono::steady_clock;

 public:
  /// `owner` names the communicator in errors; `timeout` bounds every wait.
  call_order(const char* owner, std::chrono::milliseconds timeout) : owner_(owner), timeout_(timeout) {}

  [[nodiscard]] bool failed() const noexcept { return failed_.load(); }
  [[nodiscard]] std::string failure() const {
    std::lock_guard lock(mutex_);
    return failure_;
  }

  /// The next collective's place in the call order; throws if the communicator has failed.
  std::uint64_t take_ticket(const char* operation) {
    std::lock_guard lock(mutex_);
    expects(!failed_.load(), owner_, operation, " called after the communicator failed: ", failure_);
    return next_ticket_++;
  }

  /// Waits (at most the timeout) until every collective called so far has run; false if not.
  bool wait_idle() {
    std::unique_lock lock(mutex_);
    return turn_cv_.wait_until(lock, clock::now() + timeout_, [&] {
      return turn_ == next_ticket_ || failed_.load();
    }) && !failed_.load();
  }

  /// Records `local` as the failure if it is the first; true when it was (the caller then tells
  /// the peers).
  bool record_failure(const std::string& local) {
    {
      std::lock_guard lock(mutex_);
      if (failed_.load()) return false;
      failure_ = local;
      failed_.store(true);
    }
    turn_cv_.notify_all();
    return true;
  }

  /// Waits for `ticket`'s turn (the collectives called before it have run), calling `poll()`
  /// between waits. After the timeout `fail(reason)` fails the communicator and this throws.
  template <class Poll, class Fail>
  void begin(std::uint64_t ticket, const std::string& what, int rank, int size, Poll&& poll, Fail&& fail) {
    const auto deadline = clock::now() + timeout_;
    std::unique_lock lock(mutex_);
    while (turn_ != ticket && !failed_.load()) {
      if (clock::now() >= deadline) {
        lock.unlock();
        const std::string reason =
            concat(what, " waited more than ", timeout_.count(), " ms on rank ", rank, " of ", size,
                   " for the collectives called before it to run (their streams did not reach them)");
        fail(reason);
        throw error(owner_, reason);
      }
      turn_cv_.wait_for(lock, std::chrono::milliseconds(20));
      lock.unlock();
      poll();
      lock.lock();
    }
    if (failed_.load()) throw error(owner_, concat(what, " failed: ", failure_));
  }

  /// Hands the turn to the next collective.
  void end(std::uint64_t ticket) {
    {
      std::lock_guard lock(mutex_);
      turn_ = ticket + 1;
    }
    turn_cv_.notify_all();
  }

 private:
  const char* owner_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;  // tickets, turn, failure
  std::condition_variable turn_cv_;
  std::uint64_t next_ticket_ = 0;
  std::uint64_t turn_ = 0;
  std::atomic<bool> failed_{false};
  std::string failure_;
};

}  // namespace zenflow::detail
