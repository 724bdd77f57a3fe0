// uring_io_engine's definitions (zenflow::uring): one io_uring per engine, a slot per request in
// flight (its index is the SQE's user data), every CQE checked and a short transfer resubmitted
// for its remainder. Included by io_engine.hpp when ZENFLOW_WITH_URING is set.
#pragma once

#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <vector>

#include "zenflow/detail/io_engine/transfer.hpp"

namespace zenflow {

namespace detail {
/// The value of /proc/sys/kernel/io_uring_disabled (0, 1, 2), or -1 when the file is absent.
inline int io_uring_disabled_setting() noexcept {
  std::FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "r");
  if (f == nullptr) return -1;
  int v = -1;
  if (std::fscanf(f, "%d", &v) != 1) v = -1;
  std::fclose(f);
  return v;
}

/// Why io_uring_setup failed with `err`, in words a user can act on.
inline std::string io_uring_setup_failure(int err) {
  std::string s = concat("io_uring_setup failed: ", std::strerror(err), " (errno ", err, ")");
  const int disabled = io_uring_disabled_setting();
  if (disabled == 2) return s + "; kernel.io_uring_disabled = 2: io_uring is disabled on this machine";
  if (disabled == 1 && err == EPERM)
    return s + "; kernel.io_uring_disabled = 1: only members of kernel.io_uring_group may create rings";
  if (err == EPERM) return s + "; blocked by a seccomp filter (container runtimes install one that denies io_uring)";
  if (err == ENOSYS) return s + "; the kernel has no io_uring (or a seccomp filter answers ENOSYS)";
  if (err == ENOMEM) return s + "; the ring's memory could not be allocated (RLIMIT_MEMLOCK on kernels before 5.12)";
  return s;
}
}  // namespace detail

struct uring_io_engine::state {
  struct slot {
    std::optional<detail::transfer_progress> progress;
    int fd = -1;
    bool fixed = false;
  };

  io_uring ring{};
  bool ring_ready = false;
  std::size_t depth = 0;
  std::size_t in_flight = 0;  // submitted, not yet returned by wait (ready included)
  std::vector<slot> slots;
  std::vector<std::uint32_t> free_slots;
  std::deque<io_completion> ready;  // finished, not yet returned
  detail::file_table files;
  std::vector<iovec> registered;
  std::string buffers_note = "no buffers registered";
  std::string failure;  // set when the ring itself failed: every later call throws it

  ~state() {
    if (!ring_ready) return;
    // Never leave the kernel writing into the caller's buffers: reap every SQE still in flight.
    while (failure.empty() && slots.size() != free_slots.size()) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) break;  // the ring is broken; closing it cancels what is left
      reap([](slot&) { return true; });
    }
    io_uring_queue_exit(&ring);
  }

  void check_usable() const { expects(failure.empty(), "engine", "the io_uring engine failed earlier: ", failure); }

  // Queues the remainder of slot i's transfer as one SQE (not yet submitted). False when the
  // submission queue has no room, which the bookkeeping rules out (at most `depth` requests are
  // outstanding and the SQ holds `depth` entries).
  bool prepare(std::uint32_t i) noexcept {
    slot& s = slots[i];
    auto& p = *s.progress;
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (sqe == nullptr) return false;
    constexpr std::size_t max_sqe_bytes = std::size_t{1} << 30;  // SQE lengths are 32-bit; the kernel caps ~2 GiB
    const auto len = static_cast<unsigned>(std::min(p.remaining(), max_sqe_bytes));
    const auto off = static_cast<__u64>(p.next_offset());
    const int idx = p.c.request.buffer_index;
    if (p.c.request.op == io_op::read) {
      if (s.fixed)
        io_uring_prep_read_fixed(sqe, s.fd, p.next_buffer(), len, off, idx);
      else
        io_uring_prep_read(sqe, s.fd, p.next_buffer(), len, off);
    } else {
      if (s.fixed)
        io_uring_prep_write_fixed(sqe, s.fd, p.next_buffer(), len, off, idx);
      else
        io_uring_prep_write(sqe, s.fd, p.next_buffer(), len, off);
    }
    io_uring_sqe_set_data64(sqe, i);
    return true;
  }
  void finish(std::uint32_t i) {
    ready.push_back(slots[i].progress->c);
    slots[i].progress.reset();
    free_slots.push_back(i);
  }

  void submit_prepared() {
    for (;;) {
      const int rc = io_uring_submit(&ring);
      if (rc >= 0) return;
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY) {  // kernel resources or a CQ backlog: reap, then try again
        reap_into_ready();
        continue;
      }
      failure = detail::concat("io_uring_submit failed: ", std::strerror(-rc), " (errno ", -rc, ")");
      throw error("engine", failure);
    }
  }

  // Handles every CQE available now. `end_short(slot)` says whether a short transfer ends there
  // instead of being resubmitted (the destructor ends them all).
  template <class EndShort>
  void reap(EndShort&& end_short) {
    io_uring_cqe* cqes[64];
    bool resubmitted = false;
    for (;;) {
      const unsigned n = io_uring_peek_batch_cqe(&ring, cqes, 64);
      if (n == 0) break;
      for (unsigned k = 0; k < n; ++k) {
        const auto i = static_cast<std::uint32_t>(io_uring_cqe_get_data64(cqes[k]));
        const int res = cqes[k]->res;
        if (i >= slots.size() || !slots[i].progress) continue;  // not ours (cannot happen)
        slot& s = slots[i];
        if (s.progress->advance(res) || end_short(s)) {
          finish(i);
        } else if (prepare(i)) {
          resubmitted = true;  // the remainder of a short (or interrupted) transfer
        } else {
          s.progress->c.error = EBUSY;
          finish(i);
        }
      }
      io_uring_cq_advance(&ring, n);
    }
    if (resubmitted) submit_prepared();
  }
  void reap_into_ready() {
    reap([](slot&) { return false; });
  }
};

inline uring_io_engine::uring_io_engine(std::size_t queue_depth) {
  expects(queue_depth >= 1 && queue_depth <= max_queue_depth, "queue_depth", "must be in [1, ", max_queue_depth,
          "], got ", queue_depth);
  s_ = std::make_unique<state>();
  io_uring_params params{};
  const int rc = io_uring_queue_init_params(static_cast<unsigned>(queue_depth), &s_->ring, &params);
  if (rc < 0) throw error("io_uring", detail::io_uring_setup_failure(-rc));
  s_->ring_ready = true;
  if (params.sq_entries < queue_depth || params.cq_entries < queue_depth)
    throw error("queue_depth", detail::concat("io_uring gave ", params.sq_entries, " SQ / ", params.cq_entries,
                                              " CQ entries, fewer than the queue depth ", queue_depth));
  s_->depth = queue_depth;
  s_->slots.resize(queue_depth);
  for (std::size_t i = queue_depth; i-- > 0;) s_->free_slots.push_back(static_cast<std::uint32_t>(i));
  if (io_uring_probe* probe = io_uring_get_probe_ring(&s_->ring)) {
    const bool ok = io_uring_opcode_supported(probe, IORING_OP_READ) &&
                    io_uring_opcode_supported(probe, IORING_OP_WRITE) &&
                    io_uring_opcode_supported(probe, IORING_OP_READ_FIXED) &&
                    io_uring_opcode_supported(probe, IORING_OP_WRITE_FIXED);
    io_uring_free_probe(probe);
    expects(ok, "io_uring", "this kernel's io_uring lacks IORING_OP_READ / WRITE (Linux 5.6 or later needed)");
  }
}

inline uring_io_engine::uring_io_engine(uring_io_engine&&) noexcept = default;
inline uring_io_engine& uring_io_engine::operator=(uring_io_engine&&) noexcept = default;
inline uring_io_engine::~uring_io_engine() = default;

inline std::string uring_io_engine::status() const {
  return detail::concat("io_uring: queue depth ", s_->depth, ", ", s_->buffers_note);
}
inline std::size_t uring_io_engine::queue_depth() const noexcept {
  return s_->depth;
}
inline std::size_t uring_io_engine::in_flight() const noexcept {
  return s_->in_flight;
}
inline std::uint32_t uring_io_engine::add_file(int fd, std::string_view path) {
  return s_->files.add(fd, path);
}
inline void uring_io_engine::remove_file(std::uint32_t file) {
  s_->files.remove(file);
}

inline bool uring_io_engine::register_buffers(std::span<const std::span<std::byte>> buffers) {
  s_->check_usable();
  expects(s_->in_flight == 0, "buffers", "cannot change the registered buffers with ", s_->in_flight,
          " requests in flight");
  if (!s_->registered.empty()) {
    (void)io_uring_unregister_buffers(&s_->ring);
    s_->registered.clear();
    s_->buffers_note = "no buffers registered";
  }
  if (buffers.empty()) return false;
  constexpr std::size_t max_buffers = 1024;  // UIO_MAXIOV
  if (buffers.size() > max_buffers) {
    s_->buffers_note = detail::concat(buffers.size(), " buffers not registered: io_uring takes at most ", max_buffers);
    return false;
  }
  std::vector<iovec> iov(buffers.size());
  for (std::size_t i = 0; i < buffers.size(); ++i) iov[i] = {buffers[i].data(), buffers[i].size()};
  const int rc = io_uring_register_buffers(&s_->ring, iov.data(), static_cast<unsigned>(iov.size()));
  if (rc < 0) {
    s_->buffers_note = detail::concat(buffers.size(), " buffers not registered (plain reads and writes): ",
                                      "io_uring_register_buffers failed: ", std::strerror(-rc), " (errno ", -rc, ")",
                                      -rc == ENOMEM ? "; RLIMIT_MEMLOCK too small for the buffers" : "");
    return false;
  }
  s_->registered = std::move(iov);
  s_->buffers_note = detail::concat(buffers.size(), " registered buffers (fixed reads and writes)");
  return true;
}

inline void uring_io_engine::submit(const io_request& request) {
  s_->check_usable();
  detail::check_request(request, s_->files, s_->in_flight, s_->depth);
  bool fixed = false;
  if (request.buffer_index >= 0 && !s_->registered.empty()) {
    const auto idx = static_cast<std::size_t>(request.buffer_index);
    expects(idx < s_->registered.size(), "request.buffer_index", "buffer ", idx, " is not registered (",
            s_->registered.size(), " are)");
    const auto* base = static_cast<const std::byte*>(s_->registered[idx].iov_base);
    expects(request.buffer >= base && request.bytes <= s_->registered[idx].iov_len &&
                static_cast<std::size_t>(request.buffer - base) <= s_->registered[idx].iov_len - request.bytes,
            "request.buffer", "[buffer, buffer + ", request.bytes, ") is not inside registered buffer ", idx);
    fixed = true;
  }
  const std::uint32_t i = s_->free_slots.back();
  s_->free_slots.pop_back();
  auto& s = s_->slots[i];
  s.progress.emplace(request);
  s.fd = s_->files.fd(request.file);
  s.fixed = fixed;
  if (!s_->prepare(i)) {
    s.progress.reset();
    s_->free_slots.push_back(i);
    throw error("engine", "io_uring_get_sqe found the submission queue full");
  }
  ++s_->in_flight;  // from here the slot is the engine's: wait() returns it, the destructor reaps it
  s_->submit_prepared();
}

inline std::size_t uring_io_engine::wait(std::span<io_completion> out, std::size_t min) {
  s_->check_usable();
  const std::size_t want = std::min({min, s_->in_flight, out.size()});
  s_->reap_into_ready();
  while (s_->ready.size() < want) {
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_wait_cqe(&s_->ring, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      s_->failure = detail::concat("io_uring_wait_cqe failed: ", std::strerror(-rc), " (errno ", -rc, ")");
      throw error("engine", s_->failure);
    }
    s_->reap_into_ready();
  }
  const std::size_t n = std::min(out.size(), s_->ready.size());
  std::copy_n(s_->ready.begin(), n, out.begin());
  s_->ready.erase(s_->ready.begin(), s_->ready.begin() + static_cast<std::ptrdiff_t>(n));
  s_->in_flight -= n;
  return n;
}

inline std::string uring_io_engine::describe(const io_completion& c) const {
  return detail::describe_transfer(c, s_->files.path(c.request.file));
}

}  // namespace zenflow
