// What every I/O engine shares: the resumption of short transfers, the file table, the request
// checks and the text of a failed transfer. Included by io_engine.hpp after the vocabulary
// (io_op, io_request, io_completion) it uses.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "zenflow/error.hpp"

namespace zenflow {

namespace detail {

/// A request under way: resumes short transfers until the whole length moved, an error, or no
/// progress. `result` is what one read/write (or io_uring completion) returned: bytes moved, or
/// -errno.
struct transfer_progress {
  io_completion c;
  unsigned retries = 0;  // consecutive EINTR / EAGAIN without progress

  static constexpr unsigned max_retries = 1000;

  explicit transfer_progress(const io_request& r) noexcept { c.request = r; }

  /// Applies one result; returns true when the request is finished (c says how).
  bool advance(long long result) noexcept {
    if (result < 0) {
      const int err = static_cast<int>(-result);
      if ((err == EINTR || err == EAGAIN) && ++retries < max_retries) return false;  // issue the remainder again
      c.error = err;
      return true;
    }
    if (result == 0) return true;  // end of file (read) or no progress (write): c.ok() is false
    retries = 0;
    c.done += static_cast<std::size_t>(result);
    if (c.done > c.request.bytes) {  // more than asked: a broken engine or kernel, never success
      c.error = EIO;
      return true;
    }
    return c.done == c.request.bytes;
  }
  /// Where the remainder starts and how long it is.
  [[nodiscard]] std::byte* next_buffer() const noexcept { return c.request.buffer + c.done; }
  [[nodiscard]] std::uint64_t next_offset() const noexcept { return c.request.offset + c.done; }
  [[nodiscard]] std::size_t remaining() const noexcept { return c.request.bytes - c.done; }
};

/// "read of 1048576 bytes at offset 4096 of /x/state.bin failed after 8192 bytes: File too large
/// (errno 27)" — or, for a success, "read of ... completed".
inline std::string describe_transfer(const io_completion& c, std::string_view path) {
  std::string s = concat(c.request.op == io_op::read ? "read" : "write", " of ", c.request.bytes, " bytes at offset ",
                         c.request.offset, " of ", std::string(path));
  if (c.ok()) return s + " completed";
  s += c.done > 0 ? concat(" failed after ", c.done, " bytes") : std::string(" failed");
  if (c.error != 0) return s + concat(": ", std::strerror(c.error), " (errno ", c.error, ")");
  return s + (c.request.op == io_op::read ? ": unexpected end of file" : ": the write made no progress");
}

/// The files an engine knows: fd and path per id; ids of removed files are reused.
class file_table {
 public:
  std::uint32_t add(int fd, std::string_view path) {
    expects(fd >= 0, "fd", "must be an open file descriptor, got ", fd);
    for (std::size_t i = 0; i < files_.size(); ++i)
      if (files_[i].fd < 0) {
        files_[i] = {fd, std::string(path)};
        return static_cast<std::uint32_t>(i);
      }
    files_.push_back({fd, std::string(path)});
    return static_cast<std::uint32_t>(files_.size() - 1);
  }
  void remove(std::uint32_t id) {
    check(id, "file");
    files_[id] = {-1, {}};
  }
  void check(std::uint32_t id, const char* argument) const {
    expects(id < files_.size() && files_[id].fd >= 0, argument, "no file with id ", id, " was added");
  }
  [[nodiscard]] int fd(std::uint32_t id) const noexcept { return files_[id].fd; }
  [[nodiscard]] std::string_view path(std::uint32_t id) const noexcept {
    return id < files_.size() ? std::string_view(files_[id].path) : std::string_view("<unknown file>");
  }

 private:
  struct entry {
    int fd = -1;
    std::string path;
  };
  std::vector<entry> files_;
};

/// The request checks every engine makes before queueing anything.
inline void check_request(const io_request& r, const file_table& files, std::size_t in_flight,
                          std::size_t queue_depth) {
  expects(in_flight < queue_depth, "request", "the engine already has ", in_flight,
          " requests in flight (its queue depth): wait for a completion first");
  files.check(r.file, "request.file");
  expects(r.buffer != nullptr, "request.buffer", "must not be null");
  expects(r.bytes > 0, "request.bytes", "must be positive, got 0");
  expects(r.op == io_op::read || r.op == io_op::write, "request.op", "must be io_op::read or io_op::write");
  expects(r.offset <= static_cast<std::uint64_t>(INT64_MAX) - r.bytes, "request.offset", "offset ", r.offset, " + ",
          r.bytes, " bytes overflows a file offset");
}

}  // namespace detail
}  // namespace zenflow
