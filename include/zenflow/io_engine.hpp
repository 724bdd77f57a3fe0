// I/O engines: asynchronous block reads and writes of files, behind one small concept. The NVMe
// state tier (state_file.hpp) streams optimizer state through one; usable on its own.
//
// Models:
//   posix_io_engine   a thread pool of pread/pwrite: runs wherever POSIX files do
//   uring_io_engine   io_uring through liburing, with registered (fixed) buffers; built when the
//                     consumer links zenflow::uring (which defines ZENFLOW_WITH_URING=1)
//   any_io_engine     either of them (or any model) behind a virtual interface
// `make_io_engine(config)` builds one: `io_engine_kind::automatic` tries io_uring and falls back to
// the posix engine when io_uring cannot run here (no unit of the program built with
// zenflow::uring, blocked by seccomp as container runtimes do, disabled by
// kernel.io_uring_disabled), and the engine's status() says which engine runs and why. io_uring is
// the program's: one unit built with zenflow::uring makes it available to every unit.
//
// Every completion is checked by the engine: a short transfer is resumed for its remainder, an
// interrupted one retried; a request completes only when its whole length moved, or with the
// errno of the failure (or end of file). `describe(completion)` names the operation, the file,
// the offset, the length, what moved and the errno text.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "zenflow/error.hpp"

namespace zenflow {

/// The direction of an I/O request.
enum class io_op : std::uint8_t { read, write };

/// One transfer between a file and host memory.
struct io_request {
  io_op op = io_op::read;          ///< read from the file into buffer, or write buffer to the file
  std::uint32_t file = 0;          ///< an id from the engine's add_file
  std::uint64_t offset = 0;        ///< byte offset in the file
  std::byte* buffer = nullptr;     ///< host memory (the engine neither owns nor copies it)
  std::size_t bytes = 0;           ///< length of the transfer, > 0
  std::int32_t buffer_index = -1;  ///< a registered buffer holding [buffer, buffer + bytes), or -1
  std::uint64_t user_data = 0;     ///< the caller's tag, returned in the completion
};

/// A finished request. Success is `ok()`: the whole length moved. Otherwise `error` is the errno
/// of the failure (0 when a read reached the end of the file, or a write made no progress, before
/// the whole length moved); `done` is what moved before it.
struct io_completion {
  io_request request;    ///< the request as submitted
  std::size_t done = 0;  ///< bytes transferred
  int error = 0;         ///< errno of the failure, 0 if none
  /// True when the whole request was transferred.
  [[nodiscard]] bool ok() const noexcept { return error == 0 && done == request.bytes; }
};

/// io_engine: asynchronous reads and writes of whole requests between files and host memory.
///    R1 `E` is movable (the object that streams through it owns it by value).
///    R2 `name()` — the engine's short name ("posix", "io_uring"); `status()` — a sentence on
///       what runs: queue depth, threads or registered buffers, and any fallback.
///    R3 `queue_depth()` — how many requests may be in flight; `in_flight()` — how many are:
///       submitted and not yet returned by wait.
///    R4 `add_file(fd, path)` — makes an open file descriptor (owned by the caller) known to
///       the engine, returns its id for requests; `path` is what messages name.
///       `remove_file(id)` forgets it (no request for it may be in flight).
///    R5 `register_buffers(buffers)` — offers the buffers that requests will use (a request
///       names one with `buffer_index`); returns whether the engine registered them with the
///       kernel (io_uring's fixed buffers) — an engine that needs no registration, or cannot
///       register them, returns false and still takes the requests. No request may be in flight.
///    R6 `submit(request)` — starts one transfer and returns without waiting. Throws
///       `zenflow::error` naming the field that is wrong (a file id not added, a null buffer,
///       zero bytes, queue full: in_flight() == queue_depth()) before queueing anything.
///    R7 `wait(out, min)` — blocks until at least min(min, in_flight(), out.size()) requests
///       completed, writes up to out.size() completions to `out` (in completion order, not
///       submission order) and returns how many. A failed transfer is a completion, not an
///       exception: the caller reaps every request it submitted.
///    R8 Every completion is checked: a short transfer is resumed for its remainder and an
///       interrupted one retried; a completion is `ok()` or carries the errno (or end of file).
///       `describe(completion)` — the operation, file path, offset, length, bytes moved and
///       errno text, for the caller's `zenflow::error`.
///    R9 Destruction never leaves a transfer running into the caller's memory: it waits for the
///       transfers in progress (requests not yet started may be dropped).
///    One thread at a time calls an engine.
template <class E>
concept io_engine = std::movable<E> &&
    requires(E& e, const E& ce, int fd, std::string_view path, std::uint32_t file,
             std::span<const std::span<std::byte>> buffers, const io_request& request, std::span<io_completion> out,
             std::size_t min, const io_completion& completion) {
  { ce.name() } -> std::convertible_to<std::string_view>;
  { ce.status() } -> std::convertible_to<std::string>;
  { ce.queue_depth() } -> std::convertible_to<std::size_t>;
  { ce.in_flight() } -> std::convertible_to<std::size_t>;
  { e.add_file(fd, path) } -> std::convertible_to<std::uint32_t>;
  e.remove_file(file);
  { e.register_buffers(buffers) } -> std::convertible_to<bool>;
  e.submit(request);
  { e.wait(out, min) } -> std::convertible_to<std::size_t>;
  { ce.describe(completion) } -> std::convertible_to<std::string>;
};

/// The largest queue depth an engine accepts.
inline constexpr std::size_t max_queue_depth = 4096;

/// The portable engine: `threads` worker threads, each running one request at a time with
/// pread/pwrite. Models io_engine. Needs nothing but POSIX.
class posix_io_engine {
 public:
  /// Starts `threads` workers (0: one per queue slot). Throws `zenflow::error` naming
  /// queue_depth (not in [1, max_queue_depth]) or threads (more than queue_depth, or a thread
  /// could not start).
  explicit posix_io_engine(std::size_t queue_depth = 32, std::size_t threads = 0);
  posix_io_engine(posix_io_engine&&) noexcept;
  posix_io_engine& operator=(posix_io_engine&&) noexcept;
  /// Drops the requests not started, waits for the ones running, joins the workers.
  ~posix_io_engine();

  /// "posix".
  [[nodiscard]] std::string_view name() const noexcept { return "posix"; }
  /// e.g. "posix: 32 threads of pread/pwrite, queue depth 32".
  [[nodiscard]] std::string status() const;
  /// Requests that may be in flight (R3).
  [[nodiscard]] std::size_t queue_depth() const noexcept;
  /// Requests submitted and not yet returned by wait (R3).
  [[nodiscard]] std::size_t in_flight() const noexcept;
  /// R4.
  std::uint32_t add_file(int fd, std::string_view path);
  /// R4.
  void remove_file(std::uint32_t file);
  /// pread/pwrite need no registration: returns false (R5).
  bool register_buffers(std::span<const std::span<std::byte>> buffers);
  /// R6. Does not wait.
  void submit(const io_request& request);
  /// R7. Blocks until min(min, in_flight(), out.size()) requests completed.
  std::size_t wait(std::span<io_completion> out, std::size_t min = 1);
  /// R8.
  [[nodiscard]] std::string describe(const io_completion& c) const;

 private:
  struct state;
  std::unique_ptr<state> s_;
};

#if defined(ZENFLOW_WITH_URING) && ZENFLOW_WITH_URING
/// io_uring through liburing (zenflow::uring): one ring of `queue_depth` entries, registered
/// (fixed) buffers when register_buffers succeeds, plain reads and writes otherwise. Models
/// io_engine.
class uring_io_engine {
 public:
  /// Creates the ring. Throws `zenflow::error` naming `io_uring` with the reason when io_uring
  /// cannot run here (io_uring_setup's errno and what it usually means: a seccomp filter,
  /// kernel.io_uring_disabled, no io_uring in the kernel), or `queue_depth`.
  explicit uring_io_engine(std::size_t queue_depth = 32);
  uring_io_engine(uring_io_engine&&) noexcept;
  uring_io_engine& operator=(uring_io_engine&&) noexcept;
  /// Reaps every request still in flight, then closes the ring.
  ~uring_io_engine();

  /// "io_uring".
  [[nodiscard]] std::string_view name() const noexcept { return "io_uring"; }
  /// e.g. "io_uring: queue depth 32, 32 registered buffers (fixed reads and writes)".
  [[nodiscard]] std::string status() const;
  /// Requests that may be in flight (R3).
  [[nodiscard]] std::size_t queue_depth() const noexcept;
  /// Requests submitted and not yet returned by wait (R3).
  [[nodiscard]] std::size_t in_flight() const noexcept;
  /// R4.
  std::uint32_t add_file(int fd, std::string_view path);
  /// R4.
  void remove_file(std::uint32_t file);
  /// Registers the buffers as io_uring fixed buffers (replacing earlier ones; an empty span
  /// unregisters). False, with the reason in status(), when the kernel refuses (e.g.
  /// RLIMIT_MEMLOCK): requests then run as plain reads and writes (R5).
  bool register_buffers(std::span<const std::span<std::byte>> buffers);
  /// R6: one SQE, submitted now. A request whose buffer_index names a registered buffer is a
  /// fixed read/write and must lie inside that buffer.
  void submit(const io_request& request);
  /// R7.
  std::size_t wait(std::span<io_completion> out, std::size_t min = 1);
  /// R8.
  [[nodiscard]] std::string describe(const io_completion& c) const;

 private:
  struct state;
  std::unique_ptr<state> s_;
};
#endif

/// Any io_engine behind a virtual interface: what make_io_engine returns. Models io_engine.
/// A moved-from any_io_engine may only be destroyed or assigned to.
class any_io_engine {
 public:
  /// Takes `engine` over; `note` is appended to its status() (make_io_engine says there why
  /// it chose the engine).
  // The same_as test comes first: checking io_engine<any_io_engine> would need this very
  // constructor's constraints (nvcc reports that recursion as an error; gcc forgives it).
  template <class E>
  requires(!std::same_as<std::remove_cvref_t<E>, any_io_engine> &&
           io_engine<E>) explicit any_io_engine(E engine, std::string note = {});
  any_io_engine(any_io_engine&&) noexcept;
  any_io_engine& operator=(any_io_engine&&) noexcept;
  /// Destroys the engine (which waits for its transfers, R9).
  ~any_io_engine();

  /// The engine's name (R2).
  [[nodiscard]] std::string_view name() const noexcept;
  /// The engine's status, then the note (R2).
  [[nodiscard]] std::string status() const;
  /// R3.
  [[nodiscard]] std::size_t queue_depth() const noexcept;
  /// R3.
  [[nodiscard]] std::size_t in_flight() const noexcept;
  /// R4.
  std::uint32_t add_file(int fd, std::string_view path);
  /// R4.
  void remove_file(std::uint32_t file);
  /// R5.
  bool register_buffers(std::span<const std::span<std::byte>> buffers);
  /// R6.
  void submit(const io_request& request);
  /// R7.
  std::size_t wait(std::span<io_completion> out, std::size_t min = 1);
  /// R8.
  [[nodiscard]] std::string describe(const io_completion& c) const;

 private:
  struct base;
  template <class E>
  struct model;
  std::unique_ptr<base> p_;
  std::string note_;
};

/// Which engine make_io_engine builds.
enum class io_engine_kind : std::uint8_t {
  automatic,  ///< io_uring when it runs here, else posix (status() says why)
  uring,      ///< io_uring, or a zenflow::error saying why not
  posix       ///< the thread pool of pread/pwrite
};

/// "automatic", "uring", "posix".
constexpr std::string_view io_engine_kind_name(io_engine_kind k) noexcept {
  switch (k) {
    case io_engine_kind::automatic:
      return "automatic";
    case io_engine_kind::uring:
      return "uring";
    case io_engine_kind::posix:
      return "posix";
  }
  return "unknown";
}

/// What make_io_engine builds.
struct io_engine_config {
  io_engine_kind kind = io_engine_kind::automatic;  ///< which engine
  std::size_t queue_depth = 32;                     ///< requests in flight, [1, max_queue_depth]
  std::size_t threads = 0;                          ///< posix engine's workers; 0: queue_depth
};

}  // namespace zenflow

#include "zenflow/detail/io_engine/posix_engine.hpp"
#include "zenflow/detail/io_engine/transfer.hpp"
#if defined(ZENFLOW_WITH_URING) && ZENFLOW_WITH_URING
#include "zenflow/detail/io_engine/uring_engine.hpp"
#endif
#include "zenflow/detail/io_engine/any_engine.hpp"
#include "zenflow/detail/io_engine/make_engine.hpp"
