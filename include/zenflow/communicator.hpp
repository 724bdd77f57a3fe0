// The communicator concept: the collectives the data-parallel schedule runs between ranks.
//
// zenflow puts nothing home-made on the wire: a communicator wraps an engine the trainer already
// runs. Models:
//   self_communicator   (this header)                one process; the collectives are copies
//   mpi_communicator    (mpi_communicator.hpp)      MPI, host memory, host_stream (zenflow::mpi)
//   nccl_communicator   (nccl_communicator.cuh)     NCCL, device memory, cudaStream_t (zenflow::nccl)
//
// What the schedule sends (docs/DATA_PARALLEL.md): column scores all-reduced (sum) before top-k;
// the gradients of the selected columns and of the 1-D parameters all-reduced (sum, then scaled
// by 1/N); the gradients of the unselected columns reduce-scattered over a column partition (each
// rank updates its part on its own CPU); the updated columns all-gathered; the global gradient
// statistics all-reduced (sum of squares in double, non-finite count in int64); the initial
// state broadcast.
//
// Unequal partitions. reduce_scatter and all_gather move equal blocks (the native NCCL and MPI
// collectives, one call each). A column partition balanced by bytes is rarely equal in elements,
// so the schedule lays its buffers out in `block_partition`'s padded form: rank r's columns fill
// [r*block, r*block + sizes[r]) of a size()*block buffer and the rest of the block is padding
// (zeros). The gather that packs the columns writes straight into that layout, so padding costs
// no copy, only (block - sizes[r]) elements of traffic per rank. The coordinator cuts each
// parameter's columns with detail::owned_range (consecutive, balanced to one column, since every
// column of a parameter has the same bytes); partition_by_size is the general cut by size, for
// schedules whose items differ in size.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "zenflow/detail/communicator/checks.hpp"
#include "zenflow/error.hpp"
#include "zenflow/host_stream.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

/// The element-wise reduction of all_reduce and reduce_scatter. Integers reduce exactly; floats
/// are added in the engine's order (the result is the same on every rank, see O4). bfloat16 and
/// float16 round each partial result to their own type.
enum class reduce_op : std::uint8_t { sum = 0, max = 1, min = 2 };

/// "sum", "max", "min" (or "unknown").
constexpr std::string_view reduce_op_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum:
      return "sum";
    case reduce_op::max:
      return "max";
    case reduce_op::min:
      return "min";
  }
  return "unknown";
}

/// The element types every communicator moves and reduces: float, double, int32, int64,
/// bfloat16, float16.
template <class T>
concept communicable = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int32_t> ||
    std::same_as<T, std::int64_t> || std::same_as<T, bfloat16> || std::same_as<T, float16>;

/// The four collectives of a communicator for one element type T (R3-R6 of `communicator`).
template <class C, class T>
concept communicates = requires(C& c, std::span<const T> send, std::span<T> recv, reduce_op op, int root,
                                typename C::stream_type stream) {
  c.all_reduce(send, recv, op, stream);
  c.reduce_scatter(send, recv, op, stream);
  c.all_gather(send, recv, stream);
  c.broadcast(recv, root, stream);
};

/// 6. communicator: one rank's end of a group of `size()` ranks running collectives.
///    R1 `C::stream_type` — the stream the collectives are enqueued on (host_stream*, cudaStream_t).
///    R2 `rank()`, `size()` — this rank, 0 <= rank() < size(), and the number of ranks; fixed
///       for the communicator's life.
///    R3 `all_reduce(send, recv, op, stream)` — recv[i] = op over every rank's send[i];
///       recv.size() == send.size(); in place when recv.data() == send.data().
///    R4 `reduce_scatter(send, recv, op, stream)` — send holds size() blocks of n = recv.size()
///       elements; rank r's recv = op over every rank's block r. In place when
///       recv.data() == send.data() + rank() * n.
///    R5 `all_gather(send, recv, stream)` — recv holds size() blocks of n = send.size()
///       elements; block r of recv = rank r's send. In place when
///       send.data() == recv.data() + rank() * n.
///    R6 `broadcast(buffer, root, stream)` — every rank's buffer = root's buffer (in place).
///    R7 `abort(reason)` — fails this communicator (noexcept, idempotent) and tells the peers
///       where the engine can; see O5.
///    R8 `check()` — throws `zenflow::error` with the first failure (timeout, a peer's abort,
///       an engine error) once the communicator has failed; returns otherwise. Never waits for
///       a collective.
///    R3-R6 hold for every `communicable` T.
///
/// Ordering rules (every model):
///    O1 Matching. The k-th collective called on a communicator on one rank meets the k-th one
///       called on every other rank: every rank makes the same calls (operation, element type,
///       count, op, root) in the same order. The order is the order of the calls on the host,
///       whatever stream each one is enqueued on. Calls to one communicator from several
///       threads must be ordered by the caller. A call with zero elements moves nothing and is
///       not a collective (it checks its arguments and the communicator's state only).
///    O2 Asynchrony. A call checks its arguments (and throws `zenflow::error` naming the wrong
///       one before enqueueing anything: a rejected call is not a collective for O1), enqueues
///       the collective on `stream` and returns; it does not wait for the peers or the stream.
///       The collective runs after the work enqueued on `stream` before the call; work enqueued
///       after the call sees its result.
///    O3 Buffers. `send` must stay valid and unchanged, and `recv` valid and untouched by other
///       work, until `stream` has passed the collective (an event recorded after it completed).
///       Partially overlapping send and recv are rejected; only the in-place layouts of R3-R5
///       may share memory.
///    O4 Results. all_reduce, reduce_scatter, all_gather and broadcast give every rank bitwise
///       the same values (an all_reduce result is identical on all ranks).
///    O5 Failure. A collective that cannot complete — a peer failed, stopped calling
///       collectives, called them in another order, or aborted — fails within the model's
///       timeout instead of hanging, and the communicator fails with it: `check()` and every
///       later call throw `zenflow::error` naming the first failure. `abort(reason)` fails the
///       communicator on purpose (a rank that sees bad input) and makes the peers' collectives
///       fail early where the engine can tell them. After a failure the contents of the buffers
///       of collectives in flight are unspecified; the communicator cannot be repaired: build a
///       new one (every rank) or end the process.
///    O6 Lifetime. Destroying a communicator while its collectives are in flight is an error;
///       a model may wait (bounded by its timeout) for them.
///    Optional (nccl_communicator has them): `group_start()` and `group_end()` bracket collectives
///    that the engine may launch together at group_end() (one launch for many calls); O1 holds
///    for the calls inside as for single ones. A caller uses them when they exist
///    (communicates_in_groups).
template <class C>
concept communicator = requires(C& c, const C& cc, std::string_view reason) {
  typename C::stream_type;
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.abort(reason);
  cc.check();
}
&&communicates<C, float>&& communicates<C, double>&& communicates<C, std::int32_t>&& communicates<C, std::int64_t>&&
    communicates<C, bfloat16>&& communicates<C, float16>;

/// A communicator that can bracket collectives into one launch (see `communicator`, "Optional").
template <class C>
concept communicates_in_groups = requires(C& c) {
  c.group_start();
  c.group_end();
};

/// Where the ranks of a group publish why they failed and look for a peer's reason: the store of
/// the group's bootstrap (MPI's abort messages through host_abort_channel; torch's Store in
/// zenflow.torch). An engine with no channel of its own (NCCL) takes one, so that a rank that fails
/// makes its peers fail at once with its reason instead of at their timeout without it.
class abort_channel {
 public:
  abort_channel() = default;
  abort_channel(const abort_channel&) = delete;
  abort_channel& operator=(const abort_channel&) = delete;
  virtual ~abort_channel() = default;
  /// Tells every peer that this rank failed, and why. noexcept: trouble stays local.
  virtual void publish(std::string_view reason) noexcept = 0;
  /// A peer's failure ("rank r of n aborted the communicator: <reason>"), or "" while there is
  /// none. Never waits for a peer (it may rate-limit itself and answer "" between looks).
  virtual std::string poll() = 0;
};

/// An abort_channel over a host communicator it owns (an mpi_communicator of the bootstrap's
/// group): publish() aborts it with the reason, which its engine sends to every peer; poll() looks
/// for a peer's with check(). Use the host communicator for nothing else (its own failures would
/// read as a peer's).
template <class Host>
requires communicator<Host>
class host_abort_channel final : public abort_channel {
 public:
  explicit host_abort_channel(std::unique_ptr<Host> host) : host_(std::move(host)) {
    expects(host_ != nullptr, "host", "must not be null");
  }
  void publish(std::string_view reason) noexcept override { host_->abort(reason); }
  std::string poll() override {
    try {
      host_->check();
      return {};
    } catch (const error& e) {
      return e.reason();
    }
  }
  [[nodiscard]] Host& host() noexcept { return *host_; }

 private:
  std::unique_ptr<Host> host_;
};

/// The communicator argument of a coordinator that runs in one process (basic_coordinator's
/// default): no collectives at all, not even copies.
struct single_process {};

/// The communicator a coordinator over backend B runs its data-parallel schedule with: a
/// `communicator` on B's streams, or `single_process`.
template <class C, class B>
concept coordinator_communicator = std::same_as<C, single_process> ||
    (communicator<C>&& std::same_as<typename C::stream_type, typename B::stream_type>);

/// The one-rank communicator on host streams: size() == 1, every collective is a copy (or
/// nothing, in place) enqueued on the stream. What a single process runs the data-parallel
/// schedule with; also the reference model of the concept.
class self_communicator {
 public:
  using stream_type = host_stream*;

  [[nodiscard]] int rank() const noexcept { return 0; }
  [[nodiscard]] int size() const noexcept { return 1; }

  /// recv = send. Does not synchronize.
  template <communicable T>
  void all_reduce(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_all_reduce(send, recv, op, stream != nullptr);
    check();
    copy(send.data(), recv.data(), send.size(), stream);
  }
  /// recv = send (one block). Does not synchronize.
  template <communicable T>
  void reduce_scatter(std::span<const T> send, std::span<T> recv, reduce_op op, stream_type stream) {
    detail::check_reduce_scatter(send, recv, op, 0, 1, stream != nullptr);
    check();
    copy(send.data(), recv.data(), recv.size(), stream);
  }
  /// recv = send (one block). Does not synchronize.
  template <communicable T>
  void all_gather(std::span<const T> send, std::span<T> recv, stream_type stream) {
    detail::check_all_gather(send, recv, 0, 1, stream != nullptr);
    check();
    copy(send.data(), recv.data(), send.size(), stream);
  }
  /// Nothing to move; `root` must be 0.
  template <communicable T>
  void broadcast(std::span<T> buffer, int root, stream_type stream) {
    detail::check_broadcast(buffer, root, 1, stream != nullptr);
    check();
  }

  void abort(std::string_view reason) noexcept {
    std::lock_guard lock(mutex_);
    if (failure_.empty()) {
      try {
        failure_ = "rank 0 of 1 aborted: " + std::string(reason);
      } catch (...) {
        failure_ = "rank 0 of 1 aborted";
      }
    }
  }
  void check() const {
    std::lock_guard lock(mutex_);
    expects(failure_.empty(), "self_communicator", failure_);
  }

 private:
  template <class T>
  static void copy(const T* src, T* dst, std::size_t n, stream_type stream) {
    if (n == 0 || src == dst) return;
    // Checked by every caller already; restated so that no compiler sees a null stream here.
    if (stream == nullptr) [[unlikely]]
      throw error("stream", "must not be null");
    stream->enqueue([=] { std::memcpy(dst, src, n * sizeof(T)); });
  }

  mutable std::mutex mutex_;
  std::string failure_;
};

/// Consecutive items (the columns of the CPU partition, in the schedule's order) cut into
/// `parts()` contiguous ranges balanced by size, laid out for the equal-block collectives: part r
/// fills [r * block, r * block + sizes[r]) of a buffer of parts() * block elements, item i starts
/// at offsets[i], and the rest of each block is padding.
struct block_partition {
  std::vector<std::int64_t> bounds;   ///< parts() + 1 item indices: part r = items [bounds[r], bounds[r+1])
  std::vector<std::int64_t> sizes;    ///< elements of each part
  std::vector<std::int64_t> offsets;  ///< element offset of each item in the padded buffer
  std::int64_t block = 0;             ///< max(sizes): the per-rank count of reduce_scatter / all_gather

  [[nodiscard]] int parts() const noexcept { return static_cast<int>(sizes.size()); }
  /// Which part holds item i (0 <= i < items).
  [[nodiscard]] int part_of(std::int64_t item) const noexcept {
    return static_cast<int>(std::upper_bound(bounds.begin(), bounds.end(), item) - bounds.begin()) - 1;
  }
  /// Elements of padding in the whole buffer: parts() * block - sum(sizes).
  [[nodiscard]] std::int64_t padding() const noexcept {
    std::int64_t used = 0;
    for (const std::int64_t s : sizes) used += s;
    return static_cast<std::int64_t>(parts()) * block - used;
  }
};

/// Cuts items of `sizes` elements (>= 0 each) into `parts` contiguous ranges: cut r (1 <= r <
/// parts) is the item boundary whose prefix sum is nearest to r/parts of the total (the earlier
/// one on a tie), never before cut r-1. Each part then exceeds total/parts by at most the largest
/// item, so the padding is less than one item per part. Deterministic: every rank computes the
/// same partition from the same sizes. Throws for parts < 1 or a negative size.
inline block_partition partition_by_size(std::span<const std::int64_t> sizes, int parts) {
  expects(parts >= 1, "parts", "must be >= 1, got ", parts);
  const std::size_t items = sizes.size();
  std::vector<std::int64_t> prefix(items + 1, 0);
  for (std::size_t i = 0; i < items; ++i) {
    expects(sizes[i] >= 0, "sizes", "item ", i, " has a negative size ", sizes[i]);
    prefix[i + 1] = prefix[i] + sizes[i];
  }
  const std::int64_t total = prefix[items];
  block_partition p;
  p.bounds.assign(static_cast<std::size_t>(parts) + 1, 0);
  p.bounds.back() = static_cast<std::int64_t>(items);
  expects(total <= std::numeric_limits<std::int64_t>::max() / parts, "sizes", "total ", total, " elements times ",
          parts, " parts overflows 64 bits");
  for (int r = 1; r < parts; ++r) {
    // Compare prefix * parts with total * r: exact integers, no rounding of the target.
    const std::int64_t target = total * r;
    const auto scaled = [&](std::size_t j) { return prefix[j] * parts; };
    const auto first = static_cast<std::size_t>(p.bounds[static_cast<std::size_t>(r) - 1]);
    std::size_t cut = first;  // the first boundary j >= first with scaled(j) >= target
    std::size_t hi = items;
    while (cut < hi) {
      const std::size_t mid = cut + (hi - cut) / 2;
      if (scaled(mid) >= target)
        hi = mid;
      else
        cut = mid + 1;
    }
    if (cut > first && target - scaled(cut - 1) <= scaled(cut) - target) --cut;  // nearer (or tied) earlier
    p.bounds[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(cut);
  }
  p.sizes.resize(static_cast<std::size_t>(parts));
  for (std::size_t r = 0; r < static_cast<std::size_t>(parts); ++r)
    p.sizes[r] = prefix[static_cast<std::size_t>(p.bounds[r + 1])] - prefix[static_cast<std::size_t>(p.bounds[r])];
  p.block = *std::max_element(p.sizes.begin(), p.sizes.end());
  p.offsets.resize(items);
  for (std::size_t r = 0; r < static_cast<std::size_t>(parts); ++r)
    for (auto i = static_cast<std::size_t>(p.bounds[r]); i < static_cast<std::size_t>(p.bounds[r + 1]); ++i)
      p.offsets[i] = static_cast<std::int64_t>(r) * p.block + prefix[i] - prefix[static_cast<std::size_t>(p.bounds[r])];
  return p;
}

}  // namespace zenflow
