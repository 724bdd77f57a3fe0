// process_group_communicator: a zenflow `communicator` (zenflow/communicator.hpp) on a
// torch.distributed process group, for the host backend (CPU tensors, host_streams). It is what
// zenflow.torch runs the data-parallel schedule with under torchrun: the trainer's own engine
// (Gloo for CPU tensors), nothing home-made on the wire.
//
// - Issue order (O1). Each call takes a ticket on the caller's thread; its stream task waits for
//   its turn, so collectives reach the process group in call order whatever streams they were
//   enqueued on, one at a time. Give the communicator a process group of its own (zenflow.torch
//   makes one with new_group): a collective the trainer issues on the same group from another
//   thread would interleave with these in a different order on each rank.
// - Results (O4). Gloo's all-reduce (a ring: each element is reduced on one rank and passed on)
//   gives every rank the same bits; reduce_scatter is an all-reduce of which each rank keeps its
//   block (Gloo has none of its own), so it moves an all-reduce's bytes.
// - Deadline and abort (O5). A collective is polled (Work::isCompleted) until done, until `timeout`
//   after it was issued, or until a peer's abort: a failing rank writes its reason under a key of
//   the process group's Store that every rank looks at while it waits (every 50 ms) and in check().
// - Buffers. Data moves through tensors allocated per collective, which the process group's work
//   keeps alive: after a failure a late peer never writes into memory the caller got back.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "zenflow/communicator.hpp"
#include "zenflow/detail/communicator/call_order.hpp"
#include "zenflow/detail/communicator/checks.hpp"
#include "zenflow/detail/communicator/ticket_guard.hpp"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"

namespace zenflow_torch {

namespace pg_detail {

using clock = std::chrono::steady_clock;
using zenflow::detail::concat;

/// All-gathers `in` into `out`: ProcessGroup::all_gather_single where this torch has it (newer
/// releases), _allgather_base otherwise (torch 2.11 has only that one). A template, so that the
/// branch this torch lacks is never compiled.
template <class Group>
c10::intrusive_ptr<c10d::Work> all_gather_into(Group& group, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { group.all_gather_single(out, in); })
    return group.all_gather_single(out, in);
  else
    return group._allgather_base(out, in);
}

template <class T>
at::ScalarType scalar_type() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return at::kFloat;
  else if constexpr (std::is_same_v<T, double>)
    return at::kDouble;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return at::kInt;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return at::kLong;
  else if constexpr (std::is_same_v<T, zenflow::bfloat16>)
    return at::kBFloat16;
  else
    return at::kHalf;
}

inline c10d::ReduceOp to_op(zenflow::reduce_op op) {
  return op == zenflow::reduce_op::sum   ? c10d::ReduceOp(c10d::ReduceOp::SUM)
         : op == zenflow::reduce_op::max ? c10d::ReduceOp(c10d::ReduceOp::MAX)
                                         : c10d::ReduceOp(c10d::ReduceOp::MIN);
}

inline at::Tensor buffer(at::ScalarType type, std::size_t n) {
  return at::empty({static_cast<std::int64_t>(n)}, at::TensorOptions().dtype(type).device(at::kCPU));
}

}  // namespace pg_detail

/// A zenflow::abort_channel on a torch.distributed Store: a failing rank writes "<rank>\n<reason>"
/// under `key` (the same on every rank, one per communicator); the others look for the key, at most
/// every 50 ms (a Store call is a round trip to its server). What process_group_communicator and
/// the NCCL communicator of zenflow.torch's CUDA tensors tell their peers through.
class store_abort_channel final : public zenflow::abort_channel {
 public:
  store_abort_channel(c10::intrusive_ptr<c10d::Store> store, std::string key, int rank, int size)
      : store_(std::move(store)), key_(std::move(key)), rank_(rank), size_(size) {
    zenflow::expects(store_.defined(), "store", "must not be None");
  }
  void publish(std::string_view reason) noexcept override {
    try {
      store_->set(key_, pg_detail::concat(rank_, "\n", std::string(reason)));
    } catch (...) {
    }
  }
  /// Throws when the Store itself fails.
  std::string poll() override { return poll(false); }
  std::string poll(bool force) {
    const auto now = pg_detail::clock::now();
    if (!force && now - last_poll_.load() < std::chrono::milliseconds(50)) return {};
    last_poll_.store(now);
    if (!store_->check({key_})) return {};
    const std::string message = store_->get_to_str(key_);
    const auto newline = message.find('\n');
    const std::string source = newline == std::string::npos ? "?" : message.substr(0, newline);
    return pg_detail::concat("rank ", source, " of ", size_, " aborted the communicator: ",
                             newline == std::string::npos ? message : message.substr(newline + 1));
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  int rank_;
  int size_;
  std::atomic<pg_detail::clock::time_point> last_poll_{pg_detail::clock::time_point{}};
};

namespace pg_detail {

class core {
 public:
  core(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::intrusive_ptr<c10d::Store> store,
       std::chrono::milliseconds timeout)
      : group_(std::move(group)),
        store_(std::move(store)),
        timeout_(timeout),
        order_("process_group_communicator", timeout) {
    zenflow::expects(group_.defined(), "process_group", "must not be None");
    zenflow::expects(store_.defined(), "store", "must not be None");
    zenflow::expects(timeout.count() > 0, "timeout", "must be > 0 ms, got ", timeout.count());
    rank_ = group_->getRank();
    size_ = group_->getSize();
    // One abort key per communicator, the same on every rank: rank 0 draws it and broadcasts it,
    // which also checks that every rank of the group constructs the communicator.
    at::Tensor id = buffer(at::kLong, 1);
    id.fill_(static_cast<std::int64_t>(std::random_device{}() & 0x7fffffff) << 20 ^ std::random_device{}());
    std::vector<at::Tensor> tensors{id};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    auto work = group_->broadcast(tensors, options);
    wait(work, "agreeing on the abort key (a broadcast over the process group)", /*during_setup=*/true);
    channel_.emplace(store_, concat("zenflow/abort/", id.item<std::int64_t>()), rank_, size_);
  }

  core(const core&) = delete;
  core& operator=(const core&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] bool failed() const noexcept { return order_.failed(); }
  [[nodiscard]] std::string failure() const { return order_.failure(); }

  // --- caller's thread -------------------------------------------------------------------------

  std::uint64_t take_ticket(const char* operation) {
    poll_abort(/*force=*/false);
    return order_.take_ticket(operation);
  }

  void check() {
    poll_abort(/*force=*/true);
    if (order_.failed()) throw zenflow::error("process_group_communicator", order_.failure());
  }

  bool wait_idle() { return order_.wait_idle(); }

  /// Fails the communicator: `local` is this rank's message, `to_peers` (if not empty) goes to the
  /// Store for the peers. The first failure wins. noexcept: any trouble just stays local.
  void fail(const std::string& local, const std::string& to_peers) noexcept {
    try {
      if (!order_.record_failure(local) || to_peers.empty() || !channel_) return;
      channel_->publish(to_peers);
    } catch (...) {
    }
  }

  // --- stream tasks ------------------------------------------------------------------------------

  void begin(std::uint64_t ticket, const std::string& what) {
    order_.begin(
        ticket, what, rank_, size_, [] {}, [this](const std::string& reason) { fail(reason, reason); });
  }

  void end(std::uint64_t ticket) { order_.end(ticket); }

  /// `n` = elements of send and recv.
  template <class T>
  void all_reduce(const T* send, T* recv, std::size_t n, zenflow::reduce_op op, const std::string& what) {
    at::Tensor t = buffer(scalar_type<T>(), n);
    std::memcpy(t.data_ptr(), send, n * sizeof(T));
    all_reduce_tensor(t, op, what);
    std::memcpy(recv, t.data_ptr(), n * sizeof(T));
  }

  /// `n` = elements per block (recv.size()). Gloo has no reduce-scatter of its own (torch emulates
  /// it, and its work reports completion only once waited for, so it could not be polled against
  /// a deadline): an all-reduce of the whole send buffer, of which this rank keeps its block.
  template <class T>
  void reduce_scatter(const T* send, T* recv, std::size_t n, zenflow::reduce_op op, const std::string& what) {
    const std::size_t total = static_cast<std::size_t>(size_) * n;
    at::Tensor t = buffer(scalar_type<T>(), total);
    std::memcpy(t.data_ptr(), send, total * sizeof(T));
    all_reduce_tensor(t, op, what);
    std::memcpy(recv, static_cast<const T*>(t.data_ptr()) + static_cast<std::size_t>(rank_) * n, n * sizeof(T));
  }

  /// `n` = elements per block (send.size()).
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t n, const std::string& what) {
    at::Tensor in = buffer(scalar_type<T>(), n);
    std::memcpy(in.data_ptr(), send, n * sizeof(T));
    at::Tensor out = buffer(scalar_type<T>(), static_cast<std::size_t>(size_) * n);
    all_gather_tensor(out, in, what);
    std::memcpy(recv, out.data_ptr(), static_cast<std::size_t>(size_) * n * sizeof(T));
  }

  template <class T>
  void broadcast(T* data, std::size_t n, int root, const std::string& what) {
    at::Tensor t = buffer(scalar_type<T>(), n);
    if (rank_ == root) std::memcpy(t.data_ptr(), data, n * sizeof(T));
    std::vector<at::Tensor> tensors{t};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    auto work = issue(what, [&] { return group_->broadcast(tensors, options); });
    wait(work, what);
    if (rank_ != root) std::memcpy(data, t.data_ptr(), n * sizeof(T));
  }

 private:
  template <class Issue>
  c10::intrusive_ptr<c10d::Work> issue(const std::string& what, Issue&& call) {
    try {
      return call();
    } catch (const std::exception& e) {
      const std::string reason = concat(what, " could not be issued on rank ", rank_, " of ", size_, ": ", e.what());
      fail(reason, reason);
      throw zenflow::error("process_group_communicator", reason);
    }
  }

  void all_reduce_tensor(at::Tensor& t, zenflow::reduce_op op, const std::string& what) {
    std::vector<at::Tensor> tensors{t};
    c10d::AllreduceOptions options;
    options.reduceOp = to_op(op);
    auto work = issue(what, [&] { return group_->allreduce(tensors, options); });
    wait(work, what);
  }

  void all_gather_tensor(at::Tensor& out, at::Tensor& in, const std::string& what) {
    auto work = issue(what, [&] { return pg_detail::all_gather_into(*group_, out, in); });
    wait(work, what);
  }

  /// Looks for a peer's abort on the Store (store_abort_channel): at most every 50 ms unless `force`.
  void poll_abort(bool force) {
    if (order_.failed() || !channel_) return;
    std::string message;
    try {
      message = channel_->poll(force);
    } catch (const std::exception& e) {
      const std::string reason =
          concat("the process group's Store failed on rank ", rank_, " of ", size_, ": ", e.what());
      fail(reason, {});
      return;
    }
    if (!message.empty()) fail(message, {});
  }

  /// Polls `work` until it completes, a peer aborts, or the deadline passes; rethrows its error.
  void wait(c10::intrusive_ptr<c10d::Work>& work, const std::string& what, bool during_setup = false) {
    const auto deadline = clock::now() + timeout_;
    auto nap = std::chrono::microseconds(20);
    for (int polls = 0; !work->isCompleted(); ++polls) {
      if (!during_setup) poll_abort(/*force=*/false);
      if (order_.failed())
        throw zenflow::error("process_group_communicator", concat(what, " failed: ", order_.failure()));
      if (clock::now() >= deadline) {
        const std::string reason =
            concat(what, " did not complete within ", timeout_.count(), " ms on rank ", rank_, " of ", size_,
                   during_setup ? ": every rank of the process group must construct the communicator"
                                : ": a rank failed, stopped calling collectives or called them in another order; "
                                  "the communicator is aborted");
        fail(reason, during_setup ? std::string() : reason);
        throw zenflow::error("process_group_communicator", reason);
      }
      if (polls < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(nap);
        nap = std::min(nap * 2, std::chrono::microseconds(1000));
      }
    }
    try {
      work->wait();
    } catch (const std::exception& e) {
      // A peer that aborted wrote its reason to the Store before its transport closed: that reason,
      // not the transport's "remote worker crashed", is the failure (gloo can report the closed
      // connection before the next poll of the Store).
      if (!during_setup) {
        poll_abort(/*force=*/true);
        if (order_.failed())
          throw zenflow::error("process_group_communicator", concat(what, " failed: ", order_.failure()));
      }
      const std::string reason = concat(what, " failed on rank ", rank_, " of ", size_, ": ", e.what());
      fail(reason, during_setup ? std::string() : reason);
      throw zenflow::error("process_group_communicator", reason);
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0;
  int size_ = 1;
  std::optional<store_abort_channel> channel_;  // from when every rank agreed on its key

  zenflow::detail::call_order order_;
};

}  // namespace pg_detail

/// One rank's end of a torch.distributed process group, as a zenflow communicator on host
/// streams. Construction is collective over the group (a broadcast): every rank constructs it.
class process_group_communicator {
 public:
  using stream_type = zenflow::host_stream*;

  process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::intrusive_ptr<c10d::Store> store,
                             std::chrono::milliseconds timeout)
      : core_(std::make_shared<pg_detail::core>(std::move(group), std::move(store), timeout)) {}

  process_group_communicator(const process_group_communicator&) = delete;
  process_group_communicator& operator=(const process_group_communicator&) = delete;

  /// Waits (at most the timeout) for the collectives already called to run.
  ~process_group_communicator() {
    if (!core_->wait_idle() && !core_->failed()) {
      const std::string reason = pg_detail::concat("process_group_communicator destroyed on rank ", core_->rank(),
                                                   " of ", core_->size(), " while collectives were still pending");
      core_->fail(reason, reason);
    }
  }

  [[nodiscard]] int rank() const noexcept { return core_->rank(); }
  [[nodiscard]] int size() const noexcept { return core_->size(); }

  template <zenflow::communicable T>
  void all_reduce(std::span<const T> send, std::span<T> recv, zenflow::reduce_op op, stream_type stream) {
    zenflow::detail::check_all_reduce(send, recv, op, stream != nullptr);
    const std::size_t n = send.size();
    enqueue<T>("all_reduce", n, zenflow::reduce_op_name(op), stream,
               [s = send.data(), r = recv.data(), n, op](pg_detail::core& c, const std::string& what) {
                 c.all_reduce(s, r, n, op, what);
               });
  }
  template <zenflow::communicable T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, zenflow::reduce_op op, stream_type stream) {
    zenflow::detail::check_reduce_scatter(send, recv, op, rank(), size(), stream != nullptr);
    const std::size_t n = recv.size();
    enqueue<T>("reduce_scatter", n, zenflow::reduce_op_name(op), stream,
               [s = send.data(), r = recv.data(), n, op](pg_detail::core& c, const std::string& what) {
                 c.reduce_scatter(s, r, n, op, what);
               });
  }
  template <zenflow::communicable T>
  void all_gather(std::span<const T> send, std::span<T> recv, stream_type stream) {
    zenflow::detail::check_all_gather(send, recv, rank(), size(), stream != nullptr);
    const std::size_t n = send.size();
    enqueue<T>("all_gather", n, "", stream,
               [s = send.data(), r = recv.data(), n](pg_detail::core& c, const std::string& what) {
                 c.all_gather(s, r, n, what);
               });
  }
  template <zenflow::communicable T>
  void broadcast(std::span<T> buffer, int root, stream_type stream) {
    zenflow::detail::check_broadcast(buffer, root, size(), stream != nullptr);
    const std::size_t n = buffer.size();
    enqueue<T>(
        "broadcast", n, pg_detail::concat("from rank ", root), stream,
        [d = buffer.data(), n, root](pg_detail::core& c, const std::string& what) { c.broadcast(d, n, root, what); });
  }

  /// Fails the communicator here at once and, through the Store, on the peers as soon as they
  /// look (R7). noexcept, idempotent.
  void abort(std::string_view reason) noexcept {
    try {
      const std::string text(reason);
      core_->fail(pg_detail::concat("aborted on rank ", rank(), " of ", size(), ": ", text), text);
    } catch (...) {
      core_->fail("aborted", "aborted");
    }
  }
  /// Throws the first failure (R8), after looking for a peer's abort in the Store.
  void check() const { core_->check(); }

 private:
  template <class T, class Body>
  void enqueue(const char* operation, std::size_t n, std::string_view details, stream_type stream, Body body) {
    if (n == 0) {
      check();
      return;
    }
    if (stream == nullptr) [[unlikely]]
      throw zenflow::error("stream", "must not be null");
    const std::uint64_t ticket = core_->take_ticket(operation);
    try {
      auto guard = std::make_shared<zenflow::detail::ticket_guard<pg_detail::core>>(
          core_, ticket,
          pg_detail::concat(operation, " #", ticket, " (", n, " x ", zenflow::detail::element_name<T>(),
                            details.empty() ? "" : ", ", std::string(details), ")"));
      stream->enqueue([guard, body = std::move(body)] { guard->run(body); });
    } catch (const std::exception& e) {
      const std::string reason =
          pg_detail::concat(operation, " could not be enqueued on rank ", rank(), ": ", e.what());
      core_->fail(reason, reason);
      throw;
    }
  }

  std::shared_ptr<pg_detail::core> core_;
};

static_assert(zenflow::communicator<process_group_communicator>);

}  // namespace zenflow_torch
