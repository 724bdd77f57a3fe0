// The engine behind mpi_communicator: a duplicated MPI communicator, collectives issued in call
// order from stream worker threads, non-blocking MPI collectives polled against a deadline, and a
// private abort channel.
//
// - Issue order (O1). Each call takes a ticket on the caller's thread; its stream task waits for
//   its turn, so collectives reach MPI in call order whatever streams they were enqueued on, one
//   at a time. A task the stream skips (its stream failed earlier) fails the communicator when it
//   is destroyed unrun: its peers are already waiting in that collective.
// - Deadline (O5). A collective is MPI_I<collective> + MPI_Test until done, until a peer's abort
//   message arrives, or until `timeout` after it was issued; waiting for the turn has the same
//   bound.
// - Abort channel. Every rank keeps one receive posted (any source, a private tag on the
//   duplicate); failing sends the reason to every peer, so a rank that fails makes the others
//   fail at once rather than at their deadline.
// - Staging. Data moves through a buffer the communicator owns, in rounds of about
//   `staging_bytes` (which also keeps every MPI count within int). A failed collective cannot be
//   cancelled in MPI, so after a failure that buffer, the posted receive's buffer and the
//   duplicate are deliberately leaked: a late peer can never write into memory the caller got
//   back.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include "zenflow/communicator.hpp"
#include "zenflow/detail/communicator/call_order.hpp"
#include "zenflow/detail/communicator/checks.hpp"
#include "zenflow/detail/communicator/ticket_guard.hpp"
#include "zenflow/error.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::mpi {

using clock = std::chrono::steady_clock;

inline std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

template <class T>
MPI_Datatype datatype() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return MPI_INT64_T;
  else
    return MPI_UINT16_T;  // bfloat16, float16: moved as 16-bit words, reduced by the ops below
}

/// MPI user function for bfloat16 / float16: inout[i] = in[i] op inout[i], computed in float;
/// a sum is rounded to T, max and min return one of the operands unchanged.
template <class T, int Op>
void reduce_16bit(void* in, void* inout, int* length, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) {
    const float x = to_float(a[i]);
    const float y = to_float(b[i]);
    if constexpr (Op == 0)
      b[i] = from_float<T>(x + y);
    else if constexpr (Op == 1)
      b[i] = x > y ? a[i] : b[i];
    else
      b[i] = x < y ? a[i] : b[i];
  }
}

class core {
 public:
  static constexpr int abort_tag = 0x7a66;
  static constexpr int message_bytes = 1024;

  core(MPI_Comm parent, std::chrono::milliseconds timeout, std::size_t staging_bytes)
      : timeout_(timeout), order_("mpi_communicator", timeout) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    expects(initialized != 0 && finalized == 0, "MPI", "must be initialized (MPI_Init_thread) and not finalized");
    int level = 0;
    MPI_Query_thread(&level);
    expects(level == MPI_THREAD_MULTIPLE, "MPI",
            "must be initialized with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...): collectives run on stream "
            "worker threads while the caller may call MPI; the thread level is ",
            level);
    expects(parent != MPI_COMM_NULL, "comm", "must not be MPI_COMM_NULL");
    expects(timeout.count() > 0, "timeout", "must be > 0 ms, got ", timeout.count());
    expects(staging_bytes >= 64, "staging_bytes", "must be >= 64, got ", staging_bytes);
    setup_call(MPI_Comm_rank(parent, &rank_), "MPI_Comm_rank");
    setup_call(MPI_Comm_size(parent, &size_), "MPI_Comm_size");

    // The duplicate and the agreed staging size are written by MPI when the requests complete:
    // both live on the heap and are leaked if a peer never joins (the requests stay pending).
    auto* comm = new MPI_Comm(MPI_COMM_NULL);
    MPI_Request request = MPI_REQUEST_NULL;
    setup_call(MPI_Comm_idup(parent, comm, &request), "MPI_Comm_idup");
    setup_wait(request, "duplicating the communicator (MPI_Comm_idup)");
    comm_ = *comm;
    delete comm;
    setup_call(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    // Every rank must cut collectives into the same rounds: use the smallest staging size.
    auto* agreed = new std::uint64_t(staging_bytes);
    setup_call(MPI_Iallreduce(MPI_IN_PLACE, agreed, 1, MPI_UINT64_T, MPI_MIN, comm_, &request), "MPI_Iallreduce");
    setup_wait(request, "agreeing on the staging size");
    staging_limit_ = static_cast<std::size_t>(*agreed);
    delete agreed;

    setup_call(MPI_Op_create(&reduce_16bit<bfloat16, 0>, 1, &ops_[0][0]), "MPI_Op_create");
    setup_call(MPI_Op_create(&reduce_16bit<bfloat16, 1>, 1, &ops_[0][1]), "MPI_Op_create");
    setup_call(MPI_Op_create(&reduce_16bit<bfloat16, 2>, 1, &ops_[0][2]), "MPI_Op_create");
    setup_call(MPI_Op_create(&reduce_16bit<float16, 0>, 1, &ops_[1][0]), "MPI_Op_create");
    setup_call(MPI_Op_create(&reduce_16bit<float16, 1>, 1, &ops_[1][1]), "MPI_Op_create");
    setup_call(MPI_Op_create(&reduce_16bit<float16, 2>, 1, &ops_[1][2]), "MPI_Op_create");

    abort_in_.reset(new char[message_bytes]);
    setup_call(MPI_Irecv(abort_in_.get(), message_bytes, MPI_CHAR, MPI_ANY_SOURCE, abort_tag, comm_, &abort_recv_),
               "MPI_Irecv");
    healthy_setup_ = true;
  }

  core(const core&) = delete;
  core& operator=(const core&) = delete;

  /// Deliberately leaks what MPI may still write into after a failure (see the file comment).
  ~core() {
    if (!closed_) {
      (void)abort_in_.release();
      (void)staging_.release();
    }
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] std::size_t staging_bytes() const noexcept { return staging_limit_; }
  [[nodiscard]] bool failed() const noexcept { return order_.failed(); }
  [[nodiscard]] std::string failure() const { return order_.failure(); }

  // --- caller's thread -------------------------------------------------------------------------

  /// The next collective's place in the call order; throws if the communicator has failed.
  std::uint64_t take_ticket(const char* operation) {
    poll_abort();
    return order_.take_ticket(operation);
  }

  /// Throws the first failure, after looking for a peer's abort message.
  void check() {
    poll_abort();
    if (order_.failed()) throw error("mpi_communicator", order_.failure());
  }

  /// Waits (at most the timeout) until every collective called so far has run; false if not.
  bool wait_idle() { return order_.wait_idle(); }

  /// Frees the duplicate, the posted receive and the ops; only when healthy and idle.
  void close() noexcept {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (order_.failed() || !healthy_setup_ || finalized != 0) return;
    {
      std::lock_guard lock(channel_mutex_);
      if (abort_recv_ != MPI_REQUEST_NULL) {
        MPI_Cancel(&abort_recv_);
        MPI_Wait(&abort_recv_, MPI_STATUS_IGNORE);
      }
    }
    for (auto& per_type : ops_)
      for (MPI_Op& op : per_type)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    MPI_Comm_free(&comm_);
    closed_ = true;
  }

  /// Fails the communicator: `local` is what this rank reports, `to_peers` (if not empty) is sent
  /// to every other rank. The first failure wins. noexcept: any trouble just stays local.
  void fail(const std::string& local, const std::string& to_peers) noexcept {
    try {
      if (!order_.record_failure(local) || to_peers.empty() || !healthy_setup_) return;
      // Sent from a buffer that is never freed: the sends are not waited for (a dead peer never
      // receives), so the buffer must outlive the communicator.
      const std::size_t length = std::min<std::size_t>(to_peers.size(), message_bytes);
      char* message = new char[length];
      std::memcpy(message, to_peers.data(), length);
      std::lock_guard lock(channel_mutex_);
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        MPI_Request request = MPI_REQUEST_NULL;
        if (MPI_Isend(message, static_cast<int>(length), MPI_CHAR, peer, abort_tag, comm_, &request) == MPI_SUCCESS)
          MPI_Request_free(&request);
      }
    } catch (...) {
    }
  }

  // --- stream tasks ------------------------------------------------------------------------------

  /// Waits for `ticket`'s turn (the collectives called before it have run), looking for a peer's
  /// abort meanwhile.
  void begin(std::uint64_t ticket, const std::string& what) {
    order_.begin(
        ticket, what, rank_, size_, [this] { poll_abort(); },
        [this](const std::string& reason) { fail(reason, reason); });
  }

  /// Hands the turn to the next collective.
  void end(std::uint64_t ticket) { order_.end(ticket); }

  /// A reduce-scatter then an all-gather per round: each element is reduced once, on one rank,
  /// so every rank receives the same bits whatever algorithm MPI picks (O4).
  template <class T>
  void all_reduce(const T* send, T* recv, std::size_t n, reduce_op op, const std::string& what) {
    const auto blocks = static_cast<std::size_t>(size_);
    const std::size_t step = round_elements(2, sizeof(T));
    for (std::size_t o = 0; o < n; o += step) {
      const std::size_t c = std::min(step, n - o);
      const std::size_t per_rank = (c + blocks - 1) / blocks;
      T* in = staging<T>(2 * blocks * per_rank);
      T* out = in + blocks * per_rank;
      std::memcpy(in, send + o, c * sizeof(T));
      std::memset(static_cast<void*>(in + c), 0, (blocks * per_rank - c) * sizeof(T));  // padding
      const int count = static_cast<int>(per_rank);
      MPI_Request request = MPI_REQUEST_NULL;
      call(MPI_Ireduce_scatter_block(in, out + static_cast<std::size_t>(rank_) * per_rank, count, datatype<T>(),
                                     mpi_op<T>(op), comm_, &request),
           what);
      wait(request, what);
      call(MPI_Iallgather(MPI_IN_PLACE, count, datatype<T>(), out, count, datatype<T>(), comm_, &request), what);
      wait(request, what);
      std::memcpy(recv + o, out, c * sizeof(T));
    }
  }

  /// `n` = elements per block (recv.size()).
  template <class T>
  void reduce_scatter(const T* send, T* recv, std::size_t n, reduce_op op, const std::string& what) {
    const auto blocks = static_cast<std::size_t>(size_);
    const std::size_t step = round_elements(blocks + 1, sizeof(T));
    for (std::size_t o = 0; o < n; o += step) {
      const std::size_t c = std::min(step, n - o);
      T* in = staging<T>((blocks + 1) * c);
      T* out = in + blocks * c;
      for (std::size_t r = 0; r < blocks; ++r) std::memcpy(in + r * c, send + r * n + o, c * sizeof(T));
      MPI_Request request = MPI_REQUEST_NULL;
      call(MPI_Ireduce_scatter_block(in, out, static_cast<int>(c), datatype<T>(), mpi_op<T>(op), comm_, &request),
           what);
      wait(request, what);
      std::memcpy(recv + o, out, c * sizeof(T));
    }
  }

  /// `n` = elements per block (send.size()).
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, const std::string& what) {
    const auto blocks = static_cast<std::size_t>(size_);
    const std::size_t step = round_elements(blocks + 1, sizeof(T));
    for (std::size_t o = 0; o < n; o += step) {
      const std::size_t c = std::min(step, n - o);
      T* in = staging<T>((blocks + 1) * c);
      T* out = in + c;
      std::memcpy(in, send + o, c * sizeof(T));
      MPI_Request request = MPI_REQUEST_NULL;
      const int count = static_cast<int>(c);
      call(MPI_Iallgather(in, count, datatype<T>(), out, count, datatype<T>(), comm_, &request), what);
      wait(request, what);
      for (std::size_t r = 0; r < blocks; ++r) std::memcpy(recv + r * n + o, out + r * c, c * sizeof(T));
    }
  }

  template <class T>
  void broadcast(T* data, std::size_t n, int root, const std::string& what) {
    const std::size_t step = round_elements(1, sizeof(T));
    for (std::size_t o = 0; o < n; o += step) {
      const std::size_t c = std::min(step, n - o);
      T* buffer = staging<T>(c);
      if (rank_ == root) std::memcpy(buffer, data + o, c * sizeof(T));
      MPI_Request request = MPI_REQUEST_NULL;
      call(MPI_Ibcast(buffer, static_cast<int>(c), datatype<T>(), root, comm_, &request), what);
      wait(request, what);
      if (rank_ != root) std::memcpy(data + o, buffer, c * sizeof(T));
    }
  }

 private:
  /// Looks for a peer's abort message without blocking.
  void poll_abort() {
    if (order_.failed() || !healthy_setup_) return;
    std::string message;
    int source = -1;
    {
      std::lock_guard lock(channel_mutex_);
      if (abort_recv_ == MPI_REQUEST_NULL) return;
      int done = 0;
      MPI_Status status;
      if (MPI_Test(&abort_recv_, &done, &status) != MPI_SUCCESS || done == 0) return;
      int count = 0;
      MPI_Get_count(&status, MPI_CHAR, &count);
      message.assign(abort_in_.get(), static_cast<std::size_t>(std::clamp(count, 0, message_bytes)));
      source = status.MPI_SOURCE;
    }
    fail(detail::concat("rank ", source, " of ", size_, " aborted the communicator: ", message), {});
  }

  /// Polls `request` until it completes, a peer aborts, or the deadline passes.
  void wait(MPI_Request& request, const std::string& what) {
    const auto deadline = clock::now() + timeout_;
    auto nap = std::chrono::microseconds(20);
    for (int polls = 0;; ++polls) {
      int done = 0;
      call(MPI_Test(&request, &done, MPI_STATUS_IGNORE), what);
      if (done != 0) return;
      poll_abort();
      if (order_.failed()) throw error("mpi_communicator", detail::concat(what, " failed: ", order_.failure()));
      if (clock::now() >= deadline) {
        const std::string reason = detail::concat(
            what, " did not complete within ", timeout_.count(), " ms on rank ", rank_, " of ", size_,
            ": a rank failed, stopped calling collectives or called them in another order; the communicator is "
            "aborted");
        fail(reason, reason);
        throw error("mpi_communicator", reason);
      }
      if (polls < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, std::chrono::microseconds(1000));
      }
    }
  }

  void call(int code, const std::string& what) {
    if (code == MPI_SUCCESS) [[likely]]
      return;
    const std::string reason = detail::concat(what, " failed on rank ", rank_, " of ", size_, ": ", error_text(code));
    fail(reason, reason);
    throw error("mpi_communicator", reason);
  }

  /// Setup calls: plain errors (nothing to tell the peers yet).
  static void setup_call(int code, const char* call) {
    if (code != MPI_SUCCESS) throw error("mpi_communicator", detail::concat(call, " failed: ", error_text(code)));
  }
  void setup_wait(MPI_Request& request, const char* what) {
    const auto deadline = clock::now() + timeout_;
    for (;;) {
      int done = 0;
      setup_call(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done != 0) return;
      if (clock::now() >= deadline)
        throw error("mpi_communicator",
                    detail::concat(what, " did not complete within ", timeout_.count(), " ms on rank ", rank_, " of ",
                                   size_, ": every rank of the communicator must construct it"));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  template <class T>
  MPI_Op mpi_op(reduce_op op) const noexcept {
    const auto index = static_cast<std::size_t>(op);
    if constexpr (std::is_same_v<T, bfloat16>)
      return ops_[0][index];
    else if constexpr (std::is_same_v<T, float16>)
      return ops_[1][index];
    else
      return op == reduce_op::sum ? MPI_SUM : op == reduce_op::max ? MPI_MAX : MPI_MIN;
  }

  /// Elements per round when a round's staging holds `blocks` blocks of them.
  [[nodiscard]] std::size_t round_elements(std::size_t blocks, std::size_t element_bytes) const noexcept {
    const std::size_t c = staging_limit_ / (blocks * element_bytes);
    return std::clamp<std::size_t>(c, 1, static_cast<std::size_t>(INT_MAX));
  }

  template <class T>
  T* staging(std::size_t count) {
    const std::size_t bytes = count * sizeof(T);
    if (staging_size_ < bytes) {
      staging_.reset();
      staging_size_ = 0;
      staging_.reset(new std::byte[bytes]);
      staging_size_ = bytes;
    }
    return reinterpret_cast<T*>(staging_.get());
  }

  int rank_ = 0;
  int size_ = 1;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::chrono::milliseconds timeout_;
  std::size_t staging_limit_ = 0;
  MPI_Op ops_[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
  bool healthy_setup_ = false;
  bool closed_ = false;

  std::mutex channel_mutex_;  // abort_recv_ and the sends of the abort channel
  MPI_Request abort_recv_ = MPI_REQUEST_NULL;
  std::unique_ptr<char[]> abort_in_;

  call_order order_;

  std::unique_ptr<std::byte[]> staging_;  // used by the collective holding the turn only
  std::size_t staging_size_ = 0;
};

}  // namespace zenflow::detail::mpi
