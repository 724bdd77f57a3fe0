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
//
// Failure (O5): the communicator is non-blocking (ncclConfig_t.blocking = 0) and a watchdog thread
// polls it. A collective not completed `timeout` after it was called (the time the stream takes
// to reach it counts), an asynchronous NCCL error (a peer's connection lost), or an initialization
// that does not finish within `timeout`, fails the communicator: ncclCommAbort ends the kernels
// still waiting (their streams then go on, with the collectives' results unspecified) and
// `check()` and every later call throw with the reason. A peer learns of it through its own
// watchdog (its collectives time out) or from NCCL's remote error; `abort(reason)` fails this
// rank at once. Streams captured into a CUDA graph are not watched (no event can be polled there).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
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
  /// How often the watchdog looks at the collectives in flight and NCCL's asynchronous error.
  std::chrono::milliseconds poll_interval = std::chrono::milliseconds(10);
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
      : rank_(rank), size_(size), timeout_(options.timeout), poll_interval_(options.poll_interval) {
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

  /// Stops the watchdog; waits (bounded by the timeout) for the collectives in flight, then
  /// finalizes and destroys the NCCL communicator, or aborts it if that does not finish in time
  /// or it had failed. Never throws.
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
          while (cudaEventQuery(op.event.native()) == cudaErrorNotReady && clock::now() < op.deadline)
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          if (cudaEventQuery(op.event.native()) != cudaSuccess) {
            fail_locked(detail::concat("nccl_communicator destroyed while ", op.what, " was in flight"));
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
      inflight_.clear();  // the events, destroyed on the communicator's device
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
    issue<T>("all_reduce", send.size(), reduce_op_name(op), stream, [&](ncclComm_t comm) {
      return ncclAllReduce(send.data(), recv.data(), send.size(), detail::nccl::datatype<T>(),
                           detail::nccl::reduction(op), comm, stream);
    });
  }

  /// Rank r's recv = op over every rank's block r of send (R4): ncclReduceScatter. Does not
  /// synchronize.
  template <communicable T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_reduce_scatter(send, recv, op, rank_, size_, true);
    issue<T>("reduce_scatter", recv.size(), reduce_op_name(op), stream, [&](ncclComm_t comm) {
      return ncclReduceScatter(send.data(), recv.data(), recv.size(), detail::nccl::datatype<T>(),
                               detail::nccl::reduction(op), comm, stream);
    });
  }

  /// Block r of recv = rank r's send (R5): ncclAllGather. Does not synchronize.
  template <communicable T>
  void all_gather(std::span<const T> send, std::span<T> recv, stream_type stream) {
    detail::check_all_gather(send, recv, rank_, size_, true);
    issue<T>("all_gather", send.size(), "", stream, [&](ncclComm_t comm) {
      return ncclAllGather(send.data(), recv.data(), send.size(), detail::nccl::datatype<T>(), comm, stream);
    });
  }

  /// Every rank's buffer = root's (R6): ncclBroadcast in place. Does not synchronize.
  template <communicable T>
  void broadcast(std::span<T> buffer, int root, stream_type stream) {
    detail::check_broadcast(buffer, root, size_, true);
    issue<T>("broadcast", buffer.size(), detail::concat("from rank ", root), stream, [&](ncclComm_t comm) {
      return ncclBroadcast(buffer.data(), buffer.data(), buffer.size(), detail::nccl::datatype<T>(), root, comm,
                           stream);
    });
  }

  /// Fails the communicator (R7): ncclCommAbort ends this rank's collectives in flight. Peers
  /// fail when their collectives time out or NCCL reports the lost peer. noexcept, idempotent.
  void abort(std::string_view reason) noexcept {
    std::lock_guard lock(mutex_);
    try {
      fail_locked(detail::concat("aborted on rank ", rank_, " of ", size_, ": ", std::string(reason)));
    } catch (...) {
      fail_locked("aborted");
    }
  }

  /// Throws the first failure (R8), after asking NCCL for an asynchronous error. Does not block.
  void check() const {
    std::lock_guard lock(mutex_);
    poll_async_error_locked();
    if (failed_.load()) throw error("nccl_communicator", failure_);
  }

 private:
  using clock = std::chrono::steady_clock;
  struct inflight {
    detail::cuda_event event;
    clock::time_point deadline;
    std::string what;
  };

  /// Enqueues one NCCL collective; `launch(comm)` makes the call. A zero-element call moves
  /// nothing and is not a collective.
  template <class T, class Launch>
  void issue(const char* operation, std::size_t n, std::string_view details, cudaStream_t stream, Launch&& launch) {
    if (n == 0) {
      check();
      return;
    }
    std::lock_guard lock(mutex_);
    expects(!failed_.load(), "nccl_communicator", operation, " called after the communicator failed: ", failure_);
    const std::string what = detail::concat(operation, " #", calls_++, " (", n, " x ", detail::element_name<T>(),
                                            details.empty() ? "" : ", ", std::string(details), ")");
    detail::nccl::device_guard guard(device_);
    const ncclResult_t result = launch(comm_);
    if (result != ncclSuccess && result != ncclInProgress) {
      fail_locked(detail::concat(what, " failed on rank ", rank_, " of ", size_, ": ",
                                 detail::nccl::result_text(result, comm_)));
      throw error("nccl_communicator", failure_);
    }
    if (result == ncclInProgress) {
      wait_ready_locked(what, "");
      if (failed_.load()) throw error("nccl_communicator", failure_);
    }
    watch_locked(what, stream);
  }

  /// Records an event behind the collective for the watchdog (not on a capturing stream).
  void watch_locked(const std::string& what, cudaStream_t stream) {
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
    cv_.notify_all();
  }

  /// Polls the communicator's state until it leaves ncclInProgress; fails (and aborts) on an error
  /// or when `timeout` passes.
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

  /// The first failure wins; aborts the NCCL communicator (its kernels in flight end).
  void fail_locked(std::string reason) const noexcept {
    if (failed_.load()) return;
    failure_ = std::move(reason);
    failed_.store(true);
    if (comm_ != nullptr) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  /// The watchdog: retires completed collectives, fails the communicator when one is overdue or
  /// NCCL reports an asynchronous error.
  void watch() {
    (void)cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      cv_.wait_for(lock, poll_interval_);
      if (stopping_) break;
      if (failed_.load()) continue;
      const auto now = clock::now();
      for (std::size_t i = 0; i < inflight_.size();) {
        const cudaError_t state = cudaEventQuery(inflight_[i].event.native());
        if (state == cudaSuccess) {
          free_events_.push_back(std::move(inflight_[i].event));
          inflight_.erase(inflight_.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        if (state != cudaErrorNotReady) {
          fail_locked(detail::concat(inflight_[i].what, " failed on rank ", rank_, " of ", size_, ": CUDA error ",
                                     cudaGetErrorName(state)));
          break;
        }
        if (now >= inflight_[i].deadline) {
          fail_locked(detail::concat(inflight_[i].what, " did not complete within ", timeout_.count(), " ms on rank ",
                                     rank_, " of ", size_,
                                     ": a rank failed, stopped calling collectives or called them in another order; "
                                     "the communicator is aborted"));
          break;
        }
        ++i;
      }
      poll_async_error_locked();
    }
  }

  int rank_;
  int size_;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds poll_interval_;

  // The failure state is mutable: check() (const) may find NCCL's asynchronous error and fail.
  mutable std::mutex mutex_;  // everything below, and every call on comm_
  mutable ncclComm_t comm_ = nullptr;
  std::condition_variable cv_;
  std::vector<inflight> inflight_;
  std::vector<detail::cuda_event> free_events_;
  std::uint64_t calls_ = 0;
  mutable std::atomic<bool> failed_{false};
  mutable std::string failure_;
  bool stopping_ = false;
  std::thread watchdog_;  // last: started once everything else exists
};

static_assert(communicator<nccl_communicator>);

}  // namespace zenflow
