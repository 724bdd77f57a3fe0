// posix_io_engine's definitions: a pool of worker threads, each running one request at a time
// with pread/pwrite (resuming short transfers), and a completion list the owner waits on.
// Included by io_engine.hpp.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "zenflow/detail/io_engine/transfer.hpp"

namespace zenflow {

struct posix_io_engine::state {
  struct job {
    detail::transfer_progress progress;
    int fd = -1;
  };

  std::size_t depth = 0;
  std::size_t in_flight = 0;  // the owner's count: submitted, not yet returned by wait
  detail::file_table files;
  std::string status;

  std::mutex mutex;
  std::condition_variable work;
  std::condition_variable done;
  std::deque<job> pending;               // guarded by mutex
  std::vector<io_completion> completed;  // guarded by mutex
  bool stop = false;                     // guarded by mutex
  std::vector<std::thread> workers;

  ~state() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
      pending.clear();  // not started: no thread touches their buffers
    }
    work.notify_all();
    for (auto& t : workers)
      if (t.joinable()) t.join();  // a transfer in progress finishes first
  }

  static void run(job& j) noexcept {
    for (;;) {
      const auto& p = j.progress;
      const ssize_t n = p.c.request.op == io_op::read
                            ? ::pread(j.fd, p.next_buffer(), p.remaining(), static_cast<off_t>(p.next_offset()))
                            : ::pwrite(j.fd, p.next_buffer(), p.remaining(), static_cast<off_t>(p.next_offset()));
      if (j.progress.advance(n < 0 ? -static_cast<long long>(errno) : static_cast<long long>(n))) return;
    }
  }

  void worker_loop() noexcept {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex);
      work.wait(lock, [this] { return stop || !pending.empty(); });
      if (stop) return;
      job j = pending.front();
      pending.pop_front();
      lock.unlock();
      run(j);
      lock.lock();
      completed.push_back(j.progress.c);
      lock.unlock();
      done.notify_one();
    }
  }
};

inline posix_io_engine::posix_io_engine(std::size_t queue_depth, std::size_t threads) {
  expects(queue_depth >= 1 && queue_depth <= max_queue_depth, "queue_depth", "must be in [1, ", max_queue_depth,
          "], got ", queue_depth);
  if (threads == 0) threads = queue_depth;
  expects(threads <= queue_depth, "threads", "must be at most queue_depth (", queue_depth, "), got ", threads);
  s_ = std::make_unique<state>();
  s_->depth = queue_depth;
  s_->status = detail::concat("posix: ", threads, " threads of pread/pwrite, queue depth ", queue_depth);
  try {
    s_->workers.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i) s_->workers.emplace_back([s = s_.get()] { s->worker_loop(); });
  } catch (const std::exception& e) {
    s_.reset();  // joins the threads started so far
    throw error("threads", detail::concat("could not start ", threads, " I/O threads: ", e.what()));
  }
}

inline posix_io_engine::posix_io_engine(posix_io_engine&&) noexcept = default;
inline posix_io_engine& posix_io_engine::operator=(posix_io_engine&&) noexcept = default;
inline posix_io_engine::~posix_io_engine() = default;

inline std::string posix_io_engine::status() const {
  return s_->status;
}
inline std::size_t posix_io_engine::queue_depth() const noexcept {
  return s_->depth;
}
inline std::size_t posix_io_engine::in_flight() const noexcept {
  return s_->in_flight;
}
inline std::uint32_t posix_io_engine::add_file(int fd, std::string_view path) {
  return s_->files.add(fd, path);
}
inline void posix_io_engine::remove_file(std::uint32_t file) {
  s_->files.remove(file);
}
inline bool posix_io_engine::register_buffers(std::span<const std::span<std::byte>>) {
  return false;  // pread/pwrite take any host memory: nothing to register
}

inline void posix_io_engine::submit(const io_request& request) {
  detail::check_request(request, s_->files, s_->in_flight, s_->depth);
  {
    std::lock_guard<std::mutex> lock(s_->mutex);
    s_->pending.push_back({detail::transfer_progress(request), s_->files.fd(request.file)});
  }
  ++s_->in_flight;
  s_->work.notify_one();
}

inline std::size_t posix_io_engine::wait(std::span<io_completion> out, std::size_t min) {
  const std::size_t want = std::min({min, s_->in_flight, out.size()});
  std::unique_lock<std::mutex> lock(s_->mutex);
  s_->done.wait(lock, [&] { return s_->completed.size() >= want; });
  const std::size_t n = std::min(out.size(), s_->completed.size());
  std::copy_n(s_->completed.begin(), n, out.begin());
  s_->completed.erase(s_->completed.begin(), s_->completed.begin() + static_cast<std::ptrdiff_t>(n));
  s_->in_flight -= n;
  return n;
}

inline std::string posix_io_engine::describe(const io_completion& c) const {
  return detail::describe_transfer(c, s_->files.path(c.request.file));
}

}  // namespace zenflow
