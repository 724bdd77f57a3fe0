// ticket_guard: the stream task of one collective of a communicator that issues its collectives
// in call order from stream worker threads (mpi_communicator, zenflow.torch's
// process_group_communicator). `Core` has rank(), size(), begin(ticket, what), end(ticket) and
// fail(local, to_peers).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "zenflow/error.hpp"

namespace zenflow::detail {

/// Runs the collective in its turn, and fails the communicator if the task is destroyed without
/// having run (its stream skipped it after an earlier error): its peers are already waiting in it.
template <class Core>
class ticket_guard {
 public:
  ticket_guard(std::shared_ptr<Core> c, std::uint64_t ticket, std::string what)
      : core_(std::move(c)), ticket_(ticket), what_(std::move(what)) {}
  ticket_guard(const ticket_guard&) = delete;
  ticket_guard& operator=(const ticket_guard&) = delete;
  ~ticket_guard() {
    if (ran_) return;
    try {
      const std::string reason = concat(what_, " was not run on rank ", core_->rank(), " of ", core_->size(),
                                        ": an earlier task on its stream failed");
      core_->fail(reason, reason);
    } catch (...) {
    }
  }

  template <class Body>
  void run(Body&& body) {
    ran_ = true;
    core_->begin(ticket_, what_);
    try {
      body(*core_, what_);
    } catch (const std::exception& e) {
      // A no-op when the collective already failed the communicator (timeout, abort, engine).
      const std::string reason =
          concat(what_, " failed on rank ", core_->rank(), " of ", core_->size(), ": ", e.what());
      core_->fail(reason, reason);
      throw;
    } catch (...) {
      const std::string reason = concat(what_, " failed with an unknown exception");
      core_->fail(reason, reason);
      throw;
    }
    core_->end(ticket_);
  }

 private:
  std::shared_ptr<Core> core_;
  std::uint64_t ticket_;
  std::string what_;
  bool ran_ = false;
};

}  // namespace zenflow::detail
