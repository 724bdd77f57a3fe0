// The CUDA backend of the importance selector.
//
// cuda_importance_selector has the host selector's registration and query API; select() takes
// DEVICE gradient views and a stream and runs exactly two kernels for all parameters (column
// scores, then a batched radix-select top-k; see detail/importance_selector/kernels.cuh), copies
// the k indices of every parameter to host and synchronizes with that stream only
// (cudaStreamSynchronize). Its selection equals host `topk_columns` applied to its own scores.
// The gradient statistics that clipping and the skip check use are gradient_stats.cuh's.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/detail/importance_selector/kernels.cuh"
#include "zenflow/error.hpp"
#include "zenflow/importance_selector.hpp"

namespace zenflow {

/// device_score_communicator: a score_communicator that can also reduce DEVICE memory.
///    R1 models score_communicator.
///    R2 `c.all_reduce_sum(std::span<float> device_values, cudaStream_t)` — enqueued on the stream,
///       in place, bitwise identical result on every rank.
template <class C>
concept device_score_communicator = score_communicator<C> &&
    requires(C& c, std::span<float> values, cudaStream_t stream) {
  c.all_reduce_sum(values, stream);
};
static_assert(device_score_communicator<identity_communicator>);

/// The CUDA backend of the importance selector (models `zenflow::importance_selector`). Owns the
/// device scores and selections (double-buffered: the current and the previous one), the
/// workspace and the pinned staging buffers; all freed exactly once. Not thread-safe.
template <class Communicator = identity_communicator>
requires device_score_communicator<Communicator>
class cuda_importance_selector {
 public:
  /// Throws ("topk_ratio") unless it is finite and in (0, 1]. Allocates nothing yet.
  explicit cuda_importance_selector(double topk_ratio, score_norm norm = score_norm::l1, Communicator comm = {})
      : state_(topk_ratio, norm), comm_(std::move(comm)) {}

  /// Registers a rows x cols parameter (see host_importance_selector::add_parameter). Device
  /// buffers grow at the next select() / set_selection().
  std::size_t add_parameter(index_t rows, index_t cols) {
    const auto i = state_.add_parameter(rows, cols);
    buffers_stale_ = true;
    return i;
  }

  [[nodiscard]] std::size_t parameter_count() const noexcept { return state_.parameter_count(); }
  [[nodiscard]] index_t k(std::size_t i) const { return state_.k(i); }
  [[nodiscard]] index_t rows(std::size_t i) const { return state_.rows(i); }
  [[nodiscard]] index_t cols(std::size_t i) const { return state_.cols(i); }
  [[nodiscard]] double topk_ratio() const noexcept { return state_.topk_ratio(); }
  [[nodiscard]] score_norm norm() const noexcept { return state_.norm(); }

  /// Scores every registered parameter from `grads[i]` (DEVICE memory, any layout, f32/bf16/f16)
  /// in one kernel, all-reduces the scores through the communicator (one device call over all
  /// parameters, only with world_size() > 1), selects the top k of each in one kernel, copies the
  /// indices to host and calls cudaStreamSynchronize(stream). Throws ("grads") for a wrong count,
  /// shape, memory space or a malformed view before any work, and ("grads") after the
  /// synchronization if a parameter's scores contain NaN; on any throw the current and previous
  /// selections and scores (host and device) are unchanged. The first call after add_parameter
  /// allocates (cudaMalloc, which may synchronize the device).
  void select(std::span<const const_matrix_view> grads, cudaStream_t stream) {
    state_.validate_grads(grads, memory_space::device);
    ensure_buffers(stream);
    const std::size_t n = state_.parameter_count();
    if (n == 0) return;
    const int next = cur_ ^ 1;
    auto* sdesc = h_desc_.data<detail::selector::score_desc>();
    auto* tdesc = reinterpret_cast<detail::selector::topk_desc*>(sdesc + n);
    long long blocks = 0;
    for (std::size_t i = 0; i < n; ++i) {
      sdesc[i] = plan(i, grads[i], blocks);
      blocks += block_count(sdesc[i]);
      tdesc[i] = {state_.score_offset(i), state_.k_offset(i), static_cast<int>(state_.cols(i)),
                  static_cast<int>(state_.k(i))};
    }
    expects(blocks <= 0x7fffffffLL, "grads", "too many score blocks for one launch: ", blocks);
    const auto total_k = static_cast<std::size_t>(state_.total_k());
    try {
      ZENFLOW_CUDA_TRY(cudaMemcpyAsync(d_desc_.data(), h_desc_.data(), desc_bytes(n), cudaMemcpyHostToDevice, stream));
      const auto* d_sdesc = reinterpret_cast<const detail::selector::score_desc*>(d_desc_.data());
      const auto* d_tdesc = reinterpret_cast<const detail::selector::topk_desc*>(d_sdesc + n);
      float* scores = d_scores_[next].data();
      if (state_.norm() == score_norm::l1)
        detail::selector::column_scores_kernel<score_norm::l1>
            <<<static_cast<unsigned>(blocks), detail::selector::score_threads, 0, stream>>>(
                d_sdesc, static_cast<int>(n), scores, d_partials_.data(), d_counters_.data());
      else
        detail::selector::column_scores_kernel<score_norm::l2_squared>
            <<<static_cast<unsigned>(blocks), detail::selector::score_threads, 0, stream>>>(
                d_sdesc, static_cast<int>(n), scores, d_partials_.data(), d_counters_.data());
      ZENFLOW_CUDA_TRY(cudaGetLastError());
      if (comm_.world_size() > 1)
        comm_.all_reduce_sum(std::span<float>(scores, static_cast<std::size_t>(state_.total_score_size())), stream);
      // Into the scratch buffer: d_indices_[next] is previous_device() until this select succeeds.
      detail::selector::topk_kernel<<<static_cast<unsigned>(n), detail::selector::topk_threads, 0, stream>>>(
          d_tdesc, scores, d_indices_scratch_.data(), d_nan_.data());
      ZENFLOW_CUDA_TRY(cudaGetLastError());
      ZENFLOW_CUDA_TRY(cudaMemcpyAsync(h_indices_.data(), d_indices_scratch_.data(), total_k * sizeof(std::int32_t),
                                       cudaMemcpyDeviceToHost, stream));
      ZENFLOW_CUDA_TRY(cudaMemcpyAsync(h_nan_.data(), d_nan_.data(), n * sizeof(int), cudaMemcpyDeviceToHost, stream));
    } catch (...) {
      // Work already enqueued (score tickets, scratch writes) must not outlive a failed select.
      (void)cudaStreamSynchronize(stream);
      (void)cudaGetLastError();
      throw;
    }
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    for (std::size_t i = 0; i < n; ++i)
      expects(h_nan_.data<int>()[i] == 0, "grads", "parameter ", i, " has NaN column scores (non-finite gradient)");
    state_.commit_indices(std::span<const std::int32_t>(h_indices_.data<std::int32_t>(), total_k));
    std::swap(d_indices_[next], d_indices_scratch_);
    cur_ = next;
    host_scores_valid_ = false;
  }

  [[nodiscard]] bool has_selection() const noexcept { return state_.has_selection(); }
  /// Host copy of parameter i's selection, ascending. No synchronization.
  [[nodiscard]] std::span<const std::int32_t> selected(std::size_t i) const { return state_.selected(i); }
  /// Host copy of the selection before the last select() (empty after the first and after
  /// set_selection). No synchronization.
  [[nodiscard]] std::span<const std::int32_t> previous(std::size_t i) const { return state_.previous(i); }
  [[nodiscard]] double overlap(std::size_t i) const { return state_.overlap(i); }
  /// Host copy of parameter i's scores from the last select(). The first call after a select()
  /// copies every parameter's scores on an internal non-blocking stream and synchronizes with that
  /// stream only (no race: select() finished writing them and the next select() writes the other
  /// buffer). Empty-valued (zeros) before the first select().
  [[nodiscard]] std::span<const float> scores(std::size_t i) const {
    (void)state_.cols(i);  // validates i
    if (!host_scores_valid_ && d_scores_[cur_].size() != 0) {
      if (!copy_stream_) copy_stream_.emplace(cudaStreamNonBlocking);
      auto dst = const_cast<detail::selector::selection_state&>(state_).mutable_scores();
      // Parameters registered since the buffers were sized have no device scores yet (zeros).
      const std::size_t count = std::min(dst.size(), d_scores_[cur_].size());
      ZENFLOW_CUDA_TRY(cudaMemcpyAsync(dst.data(), d_scores_[cur_].data(), count * sizeof(float),
                                       cudaMemcpyDeviceToHost, copy_stream_->get()));
      ZENFLOW_CUDA_TRY(cudaStreamSynchronize(copy_stream_->get()));
      host_scores_valid_ = true;
    }
    return state_.scores(i);
  }

  /// Device copy of parameter i's current selection (k(i) ascending int32), valid until the
  /// select() after next; nullptr before buffers exist for parameter i (registered since the last
  /// select() / set_selection()). Every device pointer from this selector is invalidated by the
  /// first select() / set_selection() after an add_parameter(), which reallocates the buffers.
  [[nodiscard]] const std::int32_t* selected_device(std::size_t i) const {
    return in_buffer(d_indices_[cur_], state_.k_offset(i), state_.k(i));
  }
  /// Device copy of previous(i) (meaningful only while previous(i) is not empty); a failed
  /// select() leaves it unchanged.
  [[nodiscard]] const std::int32_t* previous_device(std::size_t i) const {
    return in_buffer(d_indices_[cur_ ^ 1], state_.k_offset(i), state_.k(i));
  }
  /// Device copy of parameter i's scores (cols(i) floats, 16-byte aligned) from the last select().
  [[nodiscard]] const float* scores_device(std::size_t i) const {
    return in_buffer(d_scores_[cur_], state_.score_offset(i), state_.cols(i));
  }

  /// Restores parameter i's selection (checkpoint resume) on host and device; validates like the
  /// host selector before touching anything; copies on `stream` and synchronizes with it.
  void set_selection(std::size_t i, std::span<const std::int32_t> columns, cudaStream_t stream = nullptr) {
    state_.validate_selection(i, columns);
    ensure_buffers(stream);
    ZENFLOW_CUDA_TRY(cudaMemcpyAsync(d_indices_[cur_].data() + state_.k_offset(i), columns.data(),
                                     columns.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream));
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    state_.set_selection(i, columns);
  }

 private:
  template <class T>
  static T* in_buffer(const detail::cuda_device_array<T>& a, index_t offset, index_t count) {
    if (a.data() == nullptr || static_cast<std::size_t>(offset + count) > a.size()) return nullptr;
    return a.data() + offset;
  }
  static std::size_t desc_bytes(std::size_t n) {
    return n * (sizeof(detail::selector::score_desc) + sizeof(detail::selector::topk_desc));
  }

  /// The launch plan of parameter i for this gradient view.
  detail::selector::score_desc plan(std::size_t i, const const_matrix_view& g, long long first_block) const {
    return detail::selector::make_score_desc(g, state_.score_offset(i), partial_offsets_[i], counter_offsets_[i],
                                             first_block, seg_rows_[i]);
  }
  static long long block_count(const detail::selector::score_desc& d) { return detail::selector::score_blocks(d); }

  /// (Re)allocates the device and pinned buffers after registrations, keeping the current
  /// selection and scores of the parameters registered before (their offsets do not move).
  void ensure_buffers(cudaStream_t stream) {
    if (!buffers_stale_) return;
    namespace sel = detail::selector;
    const std::size_t n = state_.parameter_count();
    if (resident_blocks_ == 0) resident_blocks_ = sel::score_resident_blocks(state_.norm());
    std::vector<long long> partial_offsets(n), counter_offsets(n), seg_rows(n);
    long long partials = 0, counters = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const long long rows = state_.rows(i), cols = state_.cols(i);
      seg_rows[i] = sel::row_sweep_seg_rows(rows, cols, resident_blocks_);
      const long long segments = sel::row_sweep_segments(rows, seg_rows[i]);
      partial_offsets[i] = partials, counter_offsets[i] = counters;
      if (segments > 1) partials += segments * cols, counters += sel::row_sweep_max_tiles(cols);
    }
    const auto total_scores = static_cast<std::size_t>(state_.total_score_size());
    const auto total_k = static_cast<std::size_t>(state_.total_k());
    detail::cuda_device_array<float> scores[2] = {detail::cuda_device_array<float>(total_scores),
                                                  detail::cuda_device_array<float>(total_scores)};
    detail::cuda_device_array<std::int32_t> indices[2] = {detail::cuda_device_array<std::int32_t>(total_k),
                                                          detail::cuda_device_array<std::int32_t>(total_k)};
    detail::cuda_device_array<std::int32_t> indices_scratch(total_k);
    detail::cuda_device_array<float> partial_buf(static_cast<std::size_t>(partials));
    detail::cuda_device_array<unsigned> counter_buf(static_cast<std::size_t>(counters));
    detail::cuda_device_array<unsigned char> desc(desc_bytes(n));
    detail::cuda_device_array<int> nan(n);
    detail::cuda_host_buffer h_desc(desc_bytes(n));
    detail::cuda_host_buffer h_indices(total_k * sizeof(std::int32_t));
    detail::cuda_host_buffer h_nan(n * sizeof(int));
    for (int b = 0; b < 2; ++b) {
      if (total_scores) ZENFLOW_CUDA_TRY(cudaMemsetAsync(scores[b].data(), 0, total_scores * sizeof(float), stream));
      if (total_k) ZENFLOW_CUDA_TRY(cudaMemsetAsync(indices[b].data(), 0, total_k * sizeof(std::int32_t), stream));
      if (d_scores_[b].size())
        ZENFLOW_CUDA_TRY(cudaMemcpyAsync(scores[b].data(), d_scores_[b].data(), d_scores_[b].size() * sizeof(float),
                                         cudaMemcpyDeviceToDevice, stream));
      if (d_indices_[b].size())
        ZENFLOW_CUDA_TRY(cudaMemcpyAsync(indices[b].data(), d_indices_[b].data(),
                                         d_indices_[b].size() * sizeof(std::int32_t), cudaMemcpyDeviceToDevice,
                                         stream));
    }
    if (counters) ZENFLOW_CUDA_TRY(cudaMemsetAsync(counter_buf.data(), 0, counters * sizeof(unsigned), stream));
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    // Commit (nothing below throws).
    for (int b = 0; b < 2; ++b) d_scores_[b] = std::move(scores[b]), d_indices_[b] = std::move(indices[b]);
    d_indices_scratch_ = std::move(indices_scratch);
    d_partials_ = std::move(partial_buf), d_counters_ = std::move(counter_buf), d_desc_ = std::move(desc);
    d_nan_ = std::move(nan), h_desc_ = std::move(h_desc), h_indices_ = std::move(h_indices), h_nan_ = std::move(h_nan);
    partial_offsets_ = std::move(partial_offsets), counter_offsets_ = std::move(counter_offsets);
    seg_rows_ = std::move(seg_rows);
    host_scores_valid_ = false;
    buffers_stale_ = false;
  }

  detail::selector::selection_state state_;
  Communicator comm_;
  bool buffers_stale_ = true;
  int cur_ = 0;
  detail::cuda_device_array<float> d_scores_[2];
  detail::cuda_device_array<std::int32_t> d_indices_[2];
  detail::cuda_device_array<std::int32_t> d_indices_scratch_;  // top-k output until select() succeeds
  detail::cuda_device_array<float> d_partials_;
  detail::cuda_device_array<unsigned> d_counters_;
  detail::cuda_device_array<unsigned char> d_desc_;
  detail::cuda_device_array<int> d_nan_;
  detail::cuda_host_buffer h_desc_;
  detail::cuda_host_buffer h_indices_;
  detail::cuda_host_buffer h_nan_;
  std::vector<long long> partial_offsets_, counter_offsets_;
  std::vector<long long> seg_rows_;  // row_sweep rows per segment, per parameter
  long long resident_blocks_ = 0;    // score blocks the device runs at once (0: not queried yet)
  mutable bool host_scores_valid_ = false;
  mutable std::optional<detail::cuda_stream> copy_stream_;  // created by the first scores() copy
};

static_assert(importance_selector<cuda_importance_selector<>>);

}  // namespace zenflow
