// nccl_communicator: the `communicator` (communicator.hpp) of the CUDA backend, on NCCL.
//
// Buffers are device memory of the communicator's device; collectives are enqueued on CUDA streams
// (the trainer's or the coordinator's) as the NCCL collectives of the same name. Link
// zenflow::nccl (CMake option ZENFLOW_ENABLE_NCCL; NCCL ships with the CUDA toolkit).
//
// Bootstrap: every rank constructs the communicator with the same ncclUniqueId, made on one rank
// and sent to the others by the caller's own process group:
//   - MPI: `zenflow::mpi_communicator host(MPI_COMM_WORLD);
//           zenflow::nccl_communicator comm(zenflow::shared_nccl_unique_id(host), host.rank(), host.size());`
//   - torch.distributed (or anything that can broadcast 128 bytes): rank 0 calls
//     `zenflow::nccl_unique_id_bytes()` (exposed by the extension), the bytes travel as a
//     128-element uint8 tensor through `dist.broadcast(t, src=0)` (or `dist.broadcast_object_list`),
//     every rank passes them to `zenflow::nccl_unique_id_from_bytes()` and constructs with
//     `dist.get_rank()`, `dist.get_world_size()`. `shared_nccl_unique_id(rank, broadcast)` takes
//     the broadcast as a callable.
//
// Ordering (the concept's O1-O3): NCCL's own rules. The collectives of one communicator are
// launched in call order; a call returns once its collective is enqueued on the stream.
// group_start() / group_end() (ncclGroupStart / ncclGroupEnd) launch the collectives between them
// together, as one launch: what the data-parallel coordinator does with a step's gradients.
//
// Failure (O5): the communicator is non-blocking (ncclConfig_t.blocking = 0) and a watchdog thread
// polls it, retiring finished launches from the oldest on. A launch not completed `timeout` after
// it was made (the time the stream takes to reach it counts), an asynchronous NCCL error (a peer's
// connection lost), or an initialization that does not finish within `timeout`, fails the
// communicator: ncclCommAbort ends the kernels still waiting (their streams then go on, with the
// collectives' results unspecified) and `check()` and every later call throw with the reason.
// NCCL cannot tell a peer why: with an abort channel (nccl_communicator_options::abort_channel, the
// bootstrap's store: host_abort_channel over MPI, torch's Store in zenflow.torch) a failing rank
// publishes its reason there and every peer's watchdog, which polls the channel, fails at once
// with it (its kernels waiting for the failed rank end by its own ncclCommAbort). Without one a
// peer learns of the failure only when its own collectives time out, without the reason.
// `abort(reason)` fails this rank at once. Streams captured into a CUDA graph are not watched (no
// event can be polled there).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "zenflow/communicator.hpp"
#include "zenflow/detail/communicator/checks.hpp"
#include "zenflow/detail/communicator/nccl_core.cuh"
#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

struct nccl_communicator_options {
  /// How long a collective may take from its call until it completes on the device (the time
  /// its stream takes to reach it included); also bounds initialization and finalization.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  /// The CUDA device of this rank; -1: the device current at construction.
  int device = -1;
  /// How often the watchdog looks at the collectives in flight, NCCL's asynchronous error and the
  /// abort channel.
  std::chrono::milliseconds poll_interval = std::chrono::milliseconds(10);
  /// Where this rank publishes why it failed and looks for a peer's failure (NCCL has no channel
  /// of its own): the bootstrap's store, e.g. host_abort_channel over an mpi_communicator, or
  /// torch's Store in zenflow.torch. Null: a peer learns of a failure only when its own
  /// collectives time out (or NCCL reports the lost peer), without the reason.
  std::shared_ptr<abort_channel> abort_channel;
};

/// A new ncclUniqueId (ncclGetUniqueId), for rank 0 to send to the others. Throws zenflow::error.
inline ncclUniqueId nccl_unique_id() {
  ncclUniqueId id{};
  const ncclResult_t result = ncclGetUniqueId(&id);
  expects(result == ncclSuccess, "ncclGetUniqueId", "failed: ", detail::nccl::result_text(result, nullptr));
  return id;
}

/// The 128 bytes of an id, to send through a process group that moves bytes (torch.distributed).
inline std::array<std::byte, NCCL_UNIQUE_ID_BYTES> nccl_unique_id_bytes(const ncclUniqueId& id) noexcept {
  std::array<std::byte, NCCL_UNIQUE_ID_BYTES> bytes{};
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}
inline std::array<std::byte, NCCL_UNIQUE_ID_BYTES> nccl_unique_id_bytes() {
  return nccl_unique_id_bytes(nccl_unique_id());
}

/// The id from its 128 bytes. Throws unless `bytes` holds exactly NCCL_UNIQUE_ID_BYTES.
inline ncclUniqueId nccl_unique_id_from_bytes(std::span<const std::byte> bytes) {
  expects(bytes.size() == NCCL_UNIQUE_ID_BYTES, "bytes", "an ncclUniqueId has ", NCCL_UNIQUE_ID_BYTES, " bytes, got ",
          bytes.size());
  ncclUniqueId id{};
  std::memcpy(&id, bytes.data(), sizeof id);
  return id;
}

/// Rank 0 makes the id; `broadcast_bytes(void* data, std::size_t bytes)` must broadcast the
/// bytes from rank 0 to every rank (MPI_Bcast, a torch.distributed broadcast, ...). Collective.
template <class BroadcastBytes>
requires std::invocable<BroadcastBytes&, void*, std::size_t> ncclUniqueId
shared_nccl_unique_id(int rank, BroadcastBytes&& broadcast_bytes) {
  ncclUniqueId id{};
  if (rank == 0) id = nccl_unique_id();
  broadcast_bytes(static_cast<void*>(&id), sizeof id);
  return id;
}

/// The id made on rank 0 of a host communicator (mpi_communicator) and broadcast over it.
/// Collective over `host`; synchronizes (its own host stream). If rank 0 cannot make an id it
/// aborts `host` (the others fail instead of waiting) and throws.
template <communicator HostCommunicator>
requires std::same_as<typename HostCommunicator::stream_type, host_stream*> ncclUniqueId
shared_nccl_unique_id(HostCommunicator& host) {
  static_assert(sizeof(ncclUniqueId) % sizeof(std::int64_t) == 0);
  std::array<std::int64_t, sizeof(ncclUniqueId) / sizeof(std::int64_t)> words{};
  if (host.rank() == 0) {
    try {
      const ncclUniqueId id = nccl_unique_id();
      std::memcpy(words.data(), &id, sizeof id);
    } catch (const std::exception& e) {
      host.abort(e.what());
      throw;
    }
  }
  host_stream stream;
  host.broadcast(std::span<std::int64_t>(words), 0, &stream);
  stream.synchronize();
  ncclUniqueId id{};
  std::memcpy(&id, words.data(), sizeof id);
  return id;
}

class nccl_communicator {
 public:
  using stream_type = cudaStream_t;

  /// Joins the communicator of `size` ranks made from `id` as `rank`, on `options.device`.
  /// Collective: returns when every rank joined, or throws after the timeout (and aborts).
  nccl_communicator(const ncclUniqueId& id, int rank, int size, const nccl_communicator_options& options = {})
      : rank_(rank),
        size_(size),
        timeout_(options.timeout),
        poll_interval_(options.poll_interval),
        channel_(options.abort_channel) {
    expects(size >= 1, "size", "must be >= 1, got ", size);
    expects(rank >= 0 && rank < size, "rank", "must be in [0, ", size, "), got ", rank);
    expects(options.timeout.count() > 0, "timeout", "must be > 0 ms, got ", options.timeout.count());
    expects(options.poll_interval.count() > 0, "poll_interval", "must be > 0 ms, got ", options.poll_interval.count());
    device_ = options.device;
    if (device_ < 0) ZENFLOW_CUDA_TRY(cudaGetDevice(&device_));
    detail::nccl::device_guard guard(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t result = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
    if (result != ncclSuccess && result != ncclInProgress) {
      const std::string text = detail::nccl::result_text(result, comm_);
      if (comm_ != nullptr) (void)ncclCommAbort(comm_);
      throw error("nccl_communicator",
                  detail::concat("ncclCommInitRankConfig failed on rank ", rank, " of ", size, ": ", text));
    }
    {
      std::lock_guard lock(mutex_);
      wait_ready_locked("initialization (ncclCommInitRankConfig)",
                        ": every rank must construct the communicator with the same id and size");
      if (failed_.load()) throw error("nccl_communicator", failure_);
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;

  /// Stops the watchdog; waits (bounded by the timeout, and by a peer's abort on the abort
  /// channel) for the collectives in flight, then finalizes and destroys the NCCL communicator, or
  /// aborts it if that does not finish in time or it had failed. Never throws.
  ~nccl_communicator() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    std::lock_guard lock(mutex_);
    try {
      detail::nccl::device_guard guard(device_);
      if (comm_ != nullptr && !failed_.load()) {
        for (const inflight& op : inflight_) {
          while (cudaEventQuery(op.event.native()) == cudaErrorNotReady && clock::now() < op.deadline &&
                 !peer_failed_locked())
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          if (failed_.load()) break;
          if (cudaEventQuery(op.event.native()) != cudaSuccess) {
            fail_locked(detail::concat("nccl_communicator destroyed while ", op.what.text(), " was in flight"));
            break;
          }
        }
      }
      if (comm_ != nullptr && !failed_.load()) {
        const ncclResult_t result = ncclCommFinalize(comm_);
        if (result == ncclSuccess || result == ncclInProgress) {
          wait_ready_locked("finalization (ncclCommFinalize)", "");
        } else {
          fail_locked(detail::concat("ncclCommFinalize failed: ", detail::nccl::result_text(result, comm_)));
        }
        if (comm_ != nullptr && !failed_.load()) {
          (void)ncclCommDestroy(comm_);
          comm_ = nullptr;
        }
      }
      if (comm_ != nullptr && failed_.load()) abort_locked();  // failed with its abort deferred
      inflight_.clear();                                       // the events, destroyed on the communicator's device
      free_events_.clear();
    } catch (...) {
      if (comm_ != nullptr) (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The CUDA device the communicator and its buffers belong to.
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// The NCCL communicator (null once the communicator failed: ncclCommAbort freed it).
  [[nodiscard]] ncclComm_t native_handle() const noexcept {
    std::lock_guard lock(mutex_);
    return comm_;
  }

  /// recv[i] = op over every rank's send[i] (R3): ncclAllReduce. Does not synchronize.
  template <communicable T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_all_reduce(send, recv, op, true);
    issue<T>("all_reduce", send.size(), reduce_op_name(op).data(), -1, stream, [&](ncclComm_t comm) {
      return ncclAllReduce(send.data(), recv.data(), send.size(), detail::nccl::datatype<T>(),
                           detail::nccl::reduction(op), comm, stream);
    });
  }

  /// Rank r's recv = op over every rank's block r of send (R4): ncclReduceScatter. Does not
  /// synchronize.
  template <communicable T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_reduce_scatter(send, recv, op, rank_, size_, true);
    issue<T>("reduce_scatter", recv.size(), reduce_op_name(op).data(), -1, stream, [&](ncclComm_t comm) {
      return ncclReduceScatter(send.data(), recv.data(), recv.size(), detail::nccl::datatype<T>(),
                               detail::nccl::reduction(op), comm, stream);
    });
  }

  /// Block r of recv = rank r's send (R5): ncclAllGather. Does not synchronize.
  template <communicable T>
  void all_gather(std::span<const T> send, std::span<T> recv, stream_type stream) {
    detail::check_all_gather(send, recv, rank_, size_, true);
    issue<T>("all_gather", send.size(), "", -1, stream, [&](ncclComm_t comm) {
      return ncclAllGather(send.data(), recv.data(), send.size(), detail::nccl::datatype<T>(), comm, stream);
    });
  }

  /// Every rank's buffer = root's (R6): ncclBroadcast in place. Does not synchronize.
  template <communicable T>
  void broadcast(std::span<T> buffer, int root, stream_type stream) {
    detail::check_broadcast(buffer, root, size_, true);
    issue<T>("broadcast", buffer.size(), "", root, stream, [&](ncclComm_t comm) {
      return ncclBroadcast(buffer.data(), buffer.data(), buffer.size(), detail::nccl::datatype<T>(), root, comm,
                           stream);
    });
  }

  /// Opens a group (ncclGroupStart): the collectives called until the matching group_end() are
  /// launched together there, as one NCCL launch (one kernel for all of them), in call order (O1
  /// holds as for single calls). Groups nest; only the outermost group_end() launches. Calls from
  /// group_start() to group_end() must come from one thread. Does not synchronize.
  void group_start() {
    std::lock_guard lock(mutex_);
    expects(!failed_.load(), "nccl_communicator", "group_start called after the communicator failed: ", failure_);
    const ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) {
      fail_locked(detail::concat("ncclGroupStart failed on rank ", rank_, " of ", size_, ": ",
                                 detail::nccl::result_text(result, comm_)));
      throw error("nccl_communicator", failure_);
    }
    if (group_depth_++ == 0) {
      group_first_ = calls_;
      group_streams_.clear();
    }
  }

  /// Closes the group group_start() opened; the outermost one launches its collectives
  /// (ncclGroupEnd) and watches them as one launch. Throws if the communicator failed meanwhile
  /// (an abort while a group is open takes effect here). Does not synchronize.
  void group_end() {
    std::lock_guard lock(mutex_);
    expects(group_depth_ > 0, "group_end", "called without a matching group_start");
    detail::nccl::device_guard guard(device_);
    const ncclResult_t result = ncclGroupEnd();
    if (--group_depth_ > 0) return;
    const call_label what{"group", group_first_, calls_ - group_first_, "", "", -1, true};
    if (abort_deferred_) {  // failed while the group was open: abort now that NCCL's group is closed
      abort_deferred_ = false;
      abort_locked();
    }
    if (failed_.load()) throw error("nccl_communicator", detail::concat(what.text(), " failed: ", failure_));
    if (result != ncclSuccess && result != ncclInProgress) {
      fail_locked(detail::concat(what.text(), " failed on rank ", rank_, " of ", size_, ": ",
                                 detail::nccl::result_text(result, comm_)));
      throw error("nccl_communicator", failure_);
    }
    if (result == ncclInProgress) {
      wait_ready_locked(what.text(), "");
      if (failed_.load()) throw error("nccl_communicator", failure_);
    }
    if (what.count == 0) return;
    for (cudaStream_t stream : group_streams_) watch_locked(what, stream);
  }

  /// Fails the communicator (R7): ncclCommAbort ends this rank's collectives in flight, and the
  /// reason goes to the peers through the abort channel (nccl_communicator_options) when there is
  /// one; without one, peers fail when their collectives time out or NCCL reports the lost peer.
  /// noexcept, idempotent.
  void abort(std::string_view reason) noexcept {
    std::lock_guard lock(mutex_);
    try {
      fail_locked(detail::concat("aborted on rank ", rank_, " of ", size_, ": ", std::string(reason)), reason);
    } catch (...) {
      fail_locked("aborted");
    }
  }

  /// Throws the first failure (R8), after asking NCCL for an asynchronous error and the abort
  /// channel for a peer's failure. Does not wait for a collective.
  void check() const {
    std::string peer = poll_channel();
    std::lock_guard lock(mutex_);
    if (!peer.empty()) fail_locked(std::move(peer), {});
    poll_async_error_locked();
    if (failed_.load()) throw error("nccl_communicator", failure_);
  }

 private:
  using clock = std::chrono::steady_clock;
  /// What a launch was, put into words only when it fails (nothing is formatted per call).
  struct call_label {
    const char* operation = "";  // "all_reduce", ..., "group"
    std::uint64_t number = 0;    // the call's number among this communicator's collectives (a group: its first)
    std::uint64_t count = 0;     // elements (a group: collectives)
    const char* element = "";
    const char* reduction = "";  // "sum", "max", "min" or ""
    int root = -1;               // broadcast
    bool group = false;
    [[nodiscard]] std::string text() const {
      if (group) return detail::concat("group of ", count, " collectives from #", number);
      return detail::concat(operation, " #", number, " (", count, " x ", element, *reduction ? ", " : "", reduction,
                            root >= 0 ? ", from rank " : "", root >= 0 ? std::to_string(root) : std::string(), ")");
    }
  };
  struct inflight {
    detail::cuda_event event;
    clock::time_point deadline;
    call_label what;
  };

  /// Enqueues one NCCL collective; `launch(comm)` makes the call. A zero-element call moves
  /// nothing and is not a collective. Inside a group, the collective is launched at group_end.
  template <class T, class Launch>
  void issue(const char* operation, std::size_t n, const char* reduction, int root, cudaStream_t stream,
             Launch&& launch) {
    if (n == 0) {
      check();
      return;
    }
    std::lock_guard lock(mutex_);
    if (failed_.load())
      throw error("nccl_communicator", detail::concat(operation, " called after the communicator failed: ", failure_));
    const call_label what{operation, calls_++, n, detail::element_name<T>(), reduction, root, false};
    detail::nccl::device_guard guard(device_);
    const ncclResult_t result = launch(comm_);
    if (result != ncclSuccess && result != ncclInProgress) {  // in an open group, group_end aborts
      fail_locked(detail::concat(what.text(), " failed on rank ", rank_, " of ", size_, ": ",
                                 detail::nccl::result_text(result, comm_)));
      throw error("nccl_communicator", failure_);
    }
    if (group_depth_ > 0) {  // launched (and watched) at group_end
      if (std::find(group_streams_.begin(), group_streams_.end(), stream) == group_streams_.end())
        group_streams_.push_back(stream);
      return;
    }
    if (result == ncclInProgress) {
      wait_ready_locked(what.text(), "");
      if (failed_.load()) throw error("nccl_communicator", failure_);
    }
    watch_locked(what, stream);
  }

  /// Records an event behind a launch for the watchdog (not on a capturing stream).
  void watch_locked(const call_label& what, cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    ZENFLOW_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return;
    detail::cuda_event event(cudaEventDisableTiming);
    if (free_events_.empty()) {
      event.create();
    } else {
      event = std::move(free_events_.back());
      free_events_.pop_back();
    }
    const cudaError_t recorded = cudaEventRecord(event.native(), stream);
    if (recorded != cudaSuccess) {
      free_events_.push_back(std::move(event));
      ZENFLOW_CUDA_TRY(recorded);
    }
    inflight_.push_back({std::move(event), clock::now() + timeout_, what});
  }

  /// Polls the communicator's state until it leaves ncclInProgress; fails (and aborts) on an error,
  /// a peer's failure on the abort channel, or when `timeout` passes.
  void wait_ready_locked(const std::string& what, const char* hint) {
    const auto deadline = clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
      if (result != ncclSuccess) state = result;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        fail_locked(detail::concat(what, " failed on rank ", rank_, " of ", size_, ": ",
                                   detail::nccl::result_text(state, comm_), hint));
        return;
      }
      if (peer_failed_locked()) return;
      if (clock::now() >= deadline) {
        fail_locked(detail::concat(what, " did not complete within ", timeout_.count(), " ms on rank ", rank_, " of ",
                                   size_, hint));
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void poll_async_error_locked() const {
    if (failed_.load() || comm_ == nullptr) return;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t result = ncclCommGetAsyncError(comm_, &state);
    if (result != ncclSuccess) state = result;
    if (state != ncclSuccess && state != ncclInProgress)
      fail_locked(detail::concat("NCCL reported an asynchronous error on rank ", rank_, " of ", size_, ": ",
                                 detail::nccl::result_text(state, comm_)));
  }

  /// A peer's failure from the abort channel ("" when none, or without a channel).
  std::string poll_channel() const {
    if (!channel_ || failed_.load()) return {};
    try {
      return channel_->poll();
    } catch (const std::exception& e) {
      return detail::concat("the abort channel failed on rank ", rank_, " of ", size_, ": ", e.what());
    }
  }
  /// Fails the communicator with a peer's failure, if the abort channel has one; true if failed.
  bool peer_failed_locked() const {
    std::string peer = poll_channel();
    if (!peer.empty()) fail_locked(std::move(peer), {});
    return failed_.load();
  }

  /// The first failure wins: it aborts the NCCL communicator (its kernels in flight end) and goes
  /// to the peers on the abort channel: `reason` itself, or (second form) `to_peers`, nothing when
  /// empty (a failure that came from a peer is not sent back).
  void fail_locked(std::string reason) const noexcept {
    if (failed_.load()) return;
    failure_ = std::move(reason);
    failed_.store(true);
    if (channel_) channel_->publish(failure_);
    abort_or_defer_locked();
  }
  void fail_locked(std::string reason, std::string_view to_peers) const noexcept {
    if (failed_.load()) return;
    failure_ = std::move(reason);
    failed_.store(true);
    if (channel_ && !to_peers.empty()) channel_->publish(to_peers);
    abort_or_defer_locked();
  }
  /// NCCL's group is per thread: a communicator inside an open group is aborted at its group_end.
  void abort_or_defer_locked() const noexcept {
    if (group_depth_ > 0)
      abort_deferred_ = true;
    else
      abort_locked();
  }
  void abort_locked() const noexcept {
    if (comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  /// The watchdog: retires completed launches from the front (a communicator's collectives
  /// complete in launch order, so only the oldest can be overdue), fails the communicator when it
  /// is overdue, when NCCL reports an asynchronous error, or when a peer's failure arrives on the
  /// abort channel (polled without the lock).
  void watch() {
    (void)cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      cv_.wait_for(lock, poll_interval_);
      if (stopping_) break;
      if (failed_.load()) continue;
      lock.unlock();
      std::string peer = poll_channel();
      lock.lock();
      if (!peer.empty()) {
        fail_locked(std::move(peer), {});
        continue;
      }
      const auto now = clock::now();
      while (!inflight_.empty()) {
        inflight& op = inflight_.front();
        const cudaError_t state = cudaEventQuery(op.event.native());
        if (state == cudaSuccess) {
          free_events_.push_back(std::move(op.event));
          inflight_.pop_front();
          continue;
        }
        if (state != cudaErrorNotReady) {
          fail_locked(detail::concat(op.what.text(), " failed on rank ", rank_, " of ", size_, ": CUDA error ",
                                     cudaGetErrorName(state)));
        } else if (now >= op.deadline) {
          fail_locked(detail::concat(op.what.text(), " did not complete within ", timeout_.count(), " ms on rank ",
                                     rank_, " of ", size_,
                                     ": a rank failed, stopped calling collectives or called them in another order; "
                                     "the communicator is aborted"));
        }
        break;
      }
      poll_async_error_locked();
    }
  }

  int rank_;
  int size_;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds poll_interval_;
  std::shared_ptr<abort_channel> channel_;

  // The failure state is mutable: check() (const) may find NCCL's asynchronous error and fail.
  mutable std::mutex mutex_;  // everything below, and every call on comm_
  mutable ncclComm_t comm_ = nullptr;
  std::condition_variable cv_;
  std::deque<inflight> inflight_;  // launch order
  std::vector<detail::cuda_event> free_events_;
  std::uint64_t calls_ = 0;
  int group_depth_ = 0;                      // open groups (group_start without group_end)
  std::uint64_t group_first_ = 0;            // the first call of the outermost open group
  std::vector<cudaStream_t> group_streams_;  // the streams its collectives use
  mutable bool abort_deferred_ = false;      // failed while a group was open
  mutable std::atomic<bool> failed_{false};
  mutable std::string failure_;
  bool stopping_ = false;
  std::thread watchdog_;  // last: started once everything else exists
};

static_assert(communicator<nccl_communicator>);

}  // namespace zenflow
