// An io_engine that wraps another and injects faults through the engine interface: the k-th
// write (or read) completes with an errno, or comes up short. It also records what the caller
// had in flight, for the pipeline's bookkeeping tests.
#pragma once

#include <zenflow/io_engine.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace zenflow_test {

struct fault_plan {
  zenflow::io_op op = zenflow::io_op::write;
  std::uint64_t nth =
      ~std::uint64_t{0};  // 0-based submission index of the faulty request of that op (never by default)
  int error = EIO;        // errno the faulty request completes with
  std::size_t done = 0;   // bytes it reports as moved (a short transfer when error == 0)
};

struct engine_stats {
  std::size_t max_in_flight = 0, max_reads = 0, max_writes = 0;
  std::size_t reads = 0, writes = 0;  // in flight now
  std::uint64_t submitted_reads = 0, submitted_writes = 0;
};

template <zenflow::io_engine Inner>
class faulty_engine {
 public:
  explicit faulty_engine(Inner inner, fault_plan plan = {})
      : inner_(std::move(inner)), plan_(plan), stats_(std::make_shared<engine_stats>()) {}

  std::string_view name() const noexcept { return inner_.name(); }
  std::string status() const { return "faulty(" + inner_.status() + ")"; }
  std::size_t queue_depth() const noexcept { return inner_.queue_depth(); }
  std::size_t in_flight() const noexcept { return inner_.in_flight(); }
  std::uint32_t add_file(int fd, std::string_view path) { return inner_.add_file(fd, path); }
  void remove_file(std::uint32_t f) { inner_.remove_file(f); }
  bool register_buffers(std::span<const std::span<std::byte>> b) { return inner_.register_buffers(b); }
  void submit(const zenflow::io_request& r) {
    inner_.submit(r);
    if (r.op == plan_.op && submitted_of_op_++ == plan_.nth) {
      faulty_file_ = r.file;
      faulty_offset_ = r.offset;
      armed_ = true;
    }
    auto& s = *stats_;
    if (r.op == zenflow::io_op::read) {
      ++s.reads;
      ++s.submitted_reads;
    } else {
      ++s.writes;
      ++s.submitted_writes;
    }
    s.max_reads = std::max(s.max_reads, s.reads);
    s.max_writes = std::max(s.max_writes, s.writes);
    s.max_in_flight = std::max(s.max_in_flight, s.reads + s.writes);
  }
  std::size_t wait(std::span<zenflow::io_completion> out, std::size_t min) {
    const std::size_t n = inner_.wait(out, min);
    for (std::size_t i = 0; i < n; ++i) {
      auto& c = out[i];
      --(c.request.op == zenflow::io_op::read ? stats_->reads : stats_->writes);
      if (armed_ && c.request.op == plan_.op && c.request.file == faulty_file_ && c.request.offset == faulty_offset_) {
        armed_ = false;
        c.error = plan_.error;
        c.done = std::min(plan_.done, c.request.bytes);
      }
    }
    return n;
  }
  std::string describe(const zenflow::io_completion& c) const { return inner_.describe(c); }

  /// Shared with copies taken before the engine moved into its owner.
  std::shared_ptr<engine_stats> stats() const { return stats_; }

 private:
  Inner inner_;
  fault_plan plan_;
  std::uint64_t submitted_of_op_ = 0;
  std::uint32_t faulty_file_ = 0;
  std::uint64_t faulty_offset_ = 0;
  bool armed_ = false;
  std::shared_ptr<engine_stats> stats_;
};

}  // namespace zenflow_test
