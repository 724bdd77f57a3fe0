// mpi_communicator: the `communicator` (communicator.hpp) of the host backend, on MPI.
//
// Buffers are host memory; collectives are enqueued on host_streams and run, in call order, on
// the streams' worker threads as non-blocking MPI collectives polled against a deadline. Link
// zenflow::mpi (CMake option ZENFLOW_ENABLE_MPI); zenflow::core needs no MPI.
//
//   MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
//   {
//     zenflow::mpi_communicator comm(MPI_COMM_WORLD);  // collective: every rank constructs it
//     zenflow::host_stream stream;
//     comm.all_reduce(std::span<const float>(grad), std::span<float>(grad), zenflow::reduce_op::sum, &stream);
//     stream.synchronize();                            // rethrows a failed collective
//   }                                                  // destroy before MPI_Finalize
//   MPI_Finalize();
//
// Requirements: MPI initialized with MPI_THREAD_MULTIPLE (the collectives run on stream worker
// threads while the caller may use MPI); the communicator constructed and destroyed on every rank
// of `comm`, after MPI_Init and before MPI_Finalize.
//
// Failure (the concept's O5): a collective fails — its stream's error, rethrown by
// synchronize() — when it does not complete within `timeout` of being issued, when a peer aborts,
// or when MPI reports an error. The failing rank tells every peer on a private channel, so they
// fail at once with "rank r of n aborted the communicator: <reason>" instead of waiting for their
// own deadline. A collective whose stream skips it (an earlier task on that stream threw) fails
// the communicator the same way. `abort(reason)` does it on purpose. After a failure every call
// throws; the MPI resources of a failed communicator are leaked (a collective in flight cannot be
// cancelled in MPI), the process's other communicators are unaffected.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "zenflow/communicator.hpp"
#include "zenflow/detail/communicator/checks.hpp"
#include "zenflow/detail/communicator/mpi_core.hpp"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"

namespace zenflow {

struct mpi_communicator_options {
  /// How long one collective (or one staging round of a large one) may take once issued, waiting
  /// for the slowest peer included; also bounds construction and the wait for earlier collectives.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  /// About the most bytes one staging round moves through the communicator's own buffer (larger
  /// collectives take several rounds). The smallest value of all ranks is used.
  std::size_t staging_bytes = std::size_t{64} << 20;
};

class mpi_communicator {
 public:
  using stream_type = host_stream*;

  /// Duplicates `comm` (the caller keeps ownership of it; zenflow's traffic never mixes with the
  /// caller's). Collective over `comm`: blocks until every rank constructed it, or throws after
  /// the timeout. Throws `zenflow::error` if MPI is not initialized with MPI_THREAD_MULTIPLE.
  explicit mpi_communicator(MPI_Comm comm, const mpi_communicator_options& options = {})
      : core_(std::make_shared<detail::mpi::core>(comm, options.timeout, options.staging_bytes)) {}

  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;

  /// Waits (at most the timeout) for the collectives already called to run, then frees the MPI
  /// resources; a failed communicator leaks them instead. Must run before MPI_Finalize.
  ~mpi_communicator() {
    if (!core_) return;
    if (core_->wait_idle()) {
      core_->close();
    } else if (!core_->failed()) {
      const std::string reason = detail::concat("mpi_communicator destroyed on rank ", core_->rank(), " of ",
                                                core_->size(), " while collectives were still pending");
      core_->fail(reason, reason);
    }
  }

  [[nodiscard]] int rank() const noexcept { return core_->rank(); }
  [[nodiscard]] int size() const noexcept { return core_->size(); }
  /// The duplicated communicator the collectives run on.
  [[nodiscard]] MPI_Comm native_handle() const noexcept { return core_->comm(); }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return core_->timeout(); }
  /// The staging size in use (the smallest of all ranks' options).
  [[nodiscard]] std::size_t staging_bytes() const noexcept { return core_->staging_bytes(); }

  /// recv[i] = op over every rank's send[i] (R3), as a reduce-scatter and an all-gather: each
  /// element is reduced on one rank, so all ranks get the same bits (O4). Does not synchronize.
  template <communicable T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_all_reduce(send, recv, op, stream != nullptr);
    const std::size_t n = send.size();
    enqueue<T>("all_reduce", n, reduce_op_name(op), stream,
               [s = send.data(), r = recv.data(), n, op](detail::mpi::core& c, const std::string& what) {
                 c.all_reduce(s, r, n, op, what);
               });
  }

  /// Rank r's recv = op over every rank's block r of send (R4). Does not synchronize.
  template <communicable T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_reduce_scatter(send, recv, op, rank(), size(), stream != nullptr);
    const std::size_t n = recv.size();
    enqueue<T>("reduce_scatter", n, reduce_op_name(op), stream,
               [s = send.data(), r = recv.data(), n, op](detail::mpi::core& c, const std::string& what) {
                 c.reduce_scatter(s, r, n, op, what);
               });
  }

  /// Block r of recv = rank r's send (R5). Does not synchronize.
  template <communicable T>
  void all_gather(std::span<const T> send, std::span<T> recv, stream_type stream) {
    detail::check_all_gather(send, recv, rank(), size(), stream != nullptr);
    const std::size_t n = send.size();
    enqueue<T>("all_gather", n, "", stream,
               [s = send.data(), r = recv.data(), n](detail::mpi::core& c, const std::string& what) {
                 c.all_gather(s, r, n, what);
               });
  }

  /// Every rank's buffer = root's (R6). Does not synchronize.
  template <communicable T>
  void broadcast(std::span<T> buffer, int root, stream_type stream) {
    detail::check_broadcast(buffer, root, size(), stream != nullptr);
    const std::size_t n = buffer.size();
    enqueue<T>(
        "broadcast", n, detail::concat("from rank ", root), stream,
        [d = buffer.data(), n, root](detail::mpi::core& c, const std::string& what) { c.broadcast(d, n, root, what); });
  }

  /// Fails the communicator on every rank (R7): this rank at once, the peers as soon as they
  /// look (in a collective, a call, or check()). noexcept, idempotent; never waits for a peer.
  void abort(std::string_view reason) noexcept {
    try {
      const std::string text(reason);
      core_->fail(detail::concat("aborted on rank ", rank(), " of ", size(), ": ", text), text);
    } catch (...) {
      core_->fail("aborted", "aborted");
    }
  }

  /// Throws the first failure (R8), after looking for a peer's abort message. Does not block.
  void check() const { core_->check(); }

 private:
  /// Takes the collective's place in the call order and enqueues it. A zero-element call moves
  /// nothing and is not a collective.
  template <class T, class Body>
  void enqueue(const char* operation, std::size_t n, std::string_view details, stream_type stream, Body body) {
    if (n == 0) {
      check();
      return;
    }
    // Checked by every caller already; restated so that no compiler sees a null stream below.
    if (stream == nullptr) [[unlikely]]
      throw error("stream", "must not be null");
    const std::uint64_t ticket = core_->take_ticket(operation);
    try {
      auto guard = std::make_shared<detail::ticket_guard<detail::mpi::core>>(
          core_, ticket,
          detail::concat(operation, " #", ticket, " (", n, " x ", detail::element_name<T>(),
                         details.empty() ? "" : ", ", std::string(details), ")"));
      stream->enqueue([guard, body = std::move(body)] { guard->run(body); });
    } catch (const std::exception& e) {
      // The ticket is taken: without its collective every later one would wait for it.
      const std::string reason = detail::concat(operation, " could not be enqueued on rank ", rank(), ": ", e.what());
      core_->fail(reason, reason);
      throw;
    }
  }

  std::shared_ptr<detail::mpi::core> core_;
};

static_assert(communicator<mpi_communicator>);

}  // namespace zenflow
