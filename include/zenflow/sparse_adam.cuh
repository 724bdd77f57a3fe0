// CUDA backend of the sparse-column Adam (see sparse_adam.hpp for the method, the packed
// migration format and the parameter numbering, which are the same here).
//
// `cuda_sparse_adam` has host_sparse_adam's API, but views are DEVICE views (checked), packed
// buffers are device pointers, and the calls that take a `cudaStream_t` (last) are asynchronous:
// they enqueue work on that stream and return. Host spans (selections, initial masters) are
// copied into pinned staging memory before the call returns, so they may be reused at once.
// All calls on one instance must be ordered (one stream, or streams ordered by events).
//
// Device layout: per matrix parameter, compact fp32 master, exp_avg and exp_avg_sq of the k
// selected columns (k x rows values each, ordered like the parameter -- see
// detail/sparse_adam/element.hpp), the k selected column indices, and the complement (the
// unselected columns, ascending) for the caller's gather/scatter of the CPU columns.
//
// Step: ONE fused multi-tensor kernel launch updates every parameter (plus one read-only
// pre-pass when check_finite is set). The skip decision (skip flag, optional non-finite check,
// effective scale) is taken on the device and the 64-bit step counter lives on the device, so a
// step never waits for the host nor the host for the device; the bias corrections of each launch
// are computed on device in double from that counter. step_count() reads it back and
// synchronizes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "zenflow/adam_math.hpp"
#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/detail/sparse_adam/kernels.cuh"
#include "zenflow/detail/sparse_adam/pinned_uploader.cuh"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/sparse_adam.hpp"
#include "zenflow/state_slots.hpp"
#include "zenflow/types.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

/// CUDA backend of the sparse-column Adam; models `zenflow::device_optimizer`.
class cuda_sparse_adam {
 public:
  /// Its state in fp32 slots (state_slots.hpp): master, exp_avg, exp_avg_sq; the packed format
  /// is their device exchange layout.
  using slots_type = adam_state_slots;
  /// Its hyper-parameters (hyper_parameters.hpp).
  using hyper_parameters = adam_options;

  /// Uses the current CUDA device. Allocates the device control block; synchronizes.
  explicit cuda_sparse_adam(const adam_options& options);
  cuda_sparse_adam(const cuda_sparse_adam&) = delete;
  cuda_sparse_adam& operator=(const cuda_sparse_adam&) = delete;
  /// Waits for this instance's pending uploads, then frees everything (cudaFree synchronizes).
  ~cuda_sparse_adam() = default;

  /// Registers a 2-D device parameter updated in place on its selected columns.
  /// `initial_selection` (host): k in [1, cols] ascending indices. `initial_state_packed`
  /// (device): 3 * rows * k floats in the packed format. Allocates (cudaMalloc, which may
  /// synchronize); the state import is enqueued on `stream`. Returns the parameter's index.
  std::size_t add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                         const float* initial_state_packed, cudaStream_t stream);
  /// As above with a device span, whose size is checked (>= 3 * rows * k).
  std::size_t add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                         std::span<const float> initial_state_packed, cudaStream_t stream);
  /// Registers a 1-D device parameter with its fp32 master (host span, `size` floats); moments
  /// start at 0. Asynchronous on `stream` (the master is staged before return).
  std::size_t add_vector(vector_view param, std::span<const float> initial_master, cudaStream_t stream = nullptr);

  [[nodiscard]] std::size_t parameter_count() const noexcept { return entries_.size(); }
  [[nodiscard]] std::size_t matrix_count() const noexcept { return matrices_.size(); }
  [[nodiscard]] std::size_t vector_count() const noexcept { return vectors_.size(); }
  [[nodiscard]] bool is_vector(std::size_t i) const;
  [[nodiscard]] index_t rows(std::size_t i) const;
  /// Host copy of the selection of parameter i (no synchronization).
  [[nodiscard]] std::span<const std::int32_t> selection(std::size_t i) const;
  [[nodiscard]] index_t k(std::size_t i) const;
  /// Device copies of the selected and of the unselected columns of matrix i (ascending), valid
  /// in stream order after add_matrix/reselect; for gather/scatter of the CPU columns.
  [[nodiscard]] std::span<const std::int32_t> selection_device(std::size_t i) const;
  [[nodiscard]] std::span<const std::int32_t> unselected_device(std::size_t i) const;

  [[nodiscard]] const adam_options& options() const noexcept { return options_; }
  /// Validates; every parameter's hyper-parameters for the following steps (passed by value to
  /// each launch).
  void set_options(const adam_options& options);
  /// Parameter i's hyper-parameters (options() unless set_options(i, ...) changed them).
  [[nodiscard]] const adam_options& options(std::size_t i) const;
  /// Parameter groups: parameter i's hyper-parameters for the following steps. They may differ
  /// from options() in the per-group fields only (lr, beta1, beta2, eps, weight_decay; throws naming
  /// the first other field that differs).
  void set_options(std::size_t i, const adam_options& options);
  /// Applied steps. Reads the device counter back on the stream of the last call and
  /// synchronizes with that stream.
  [[nodiscard]] std::int64_t step_count() const;
  /// Sets the device step counter on `stream` (asynchronous).
  void set_step_count(std::int64_t step, cudaStream_t stream);
  /// Sets it on the stream of the last call and synchronizes with that stream.
  void set_step_count(std::int64_t step);
  /// Parameter i's applied steps (its bias correction: it counts the steps that had its gradient;
  /// it starts from step_count() in stream order when the parameter is added). Reads it back on
  /// the stream of the last call and synchronizes with that stream.
  [[nodiscard]] std::int64_t step_count(std::size_t i) const;
  /// Sets parameter i's count on `stream` (asynchronous), or on the stream of the last call and
  /// synchronizes with it. set_step_count(step) sets every parameter's count too.
  void set_step_count(std::size_t i, std::int64_t step, cudaStream_t stream);
  void set_step_count(std::size_t i, std::int64_t step);

  /// One fused Adam/AdamW step of every parameter, asynchronous on `stream`. Gradients are
  /// device views with the parameters' shapes (any layout and dtype); a view with data == nullptr:
  /// no gradient for that parameter this step (not updated, its count stays). Effective scale =
  /// grad_scale * (*scale_ptr_device if given). On device: if *skip_flag_device != 0, or the
  /// effective scale is not finite or negative, or (check_finite) any gradient value read is
  /// NaN/inf once scaled, nothing is written and the device step counter does not advance (with
  /// no parameter registered nothing is enqueued and the counter stays too). Every block
  /// reads *skip_flag_device and *scale_ptr_device once (device, managed or mapped pinned memory; any
  /// other pointer throws here): whoever writes them must be ordered before
  /// this call on `stream` (an event wait), never racing it from another stream. Host-side
  /// argument errors throw before anything is enqueued. Never synchronizes.
  void step(std::span<const const_matrix_view> matrix_grads, std::span<const const_vector_view> vector_grads,
            float grad_scale, const float* scale_ptr_device, const int* skip_flag_device, bool check_finite,
            cudaStream_t stream);

  /// Columns that leave (= enter) if matrix i moves to `new_selection` (host, validated).
  [[nodiscard]] index_t migration_count(std::size_t i, std::span<const std::int32_t> new_selection) const;
  /// Reselection with state migration, asynchronous on `stream` (host semantics, see
  /// host_sparse_adam::reselect). `entering_in`/`leaving_out` are device buffers of at least
  /// 3 * rows * migration_count floats (may alias). The selection (host and device) changes
  /// now, in stream order on the device.
  void reselect(std::size_t i, std::span<const std::int32_t> new_selection, const float* entering_in,
                float* leaving_out, cudaStream_t stream);
  /// As above with device spans, whose sizes are checked.
  void reselect(std::size_t i, std::span<const std::int32_t> new_selection, std::span<const float> entering_in,
                std::span<float> leaving_out, cudaStream_t stream);

  /// Packed state of the current selection of parameter i into a device buffer (3 * rows * k
  /// floats), asynchronous on `stream`.
  void export_state(std::size_t i, float* packed_out, cudaStream_t stream) const;
  /// Replaces the state of parameter i from a device buffer, asynchronous on `stream`.
  void import_state(std::size_t i, const float* packed_in, cudaStream_t stream);
  /// Checkpoint forms with HOST spans: synchronous (with the stream of the last call).
  void export_state(std::size_t i, std::span<float> packed_out) const;
  void import_state(std::size_t i, std::span<const float> packed_in);

 private:
  struct entry {
    bool is_vector = false;
    matrix_view param;
    std::vector<std::int32_t> selection;
    index_t rows = 0;
    bool state_row_major = false;
    adam_options options;                // this parameter's hyper-parameters
    detail::cuda_device_buffer state;    // master | exp_avg | exp_avg_sq
    detail::cuda_device_buffer columns;  // matrices: cols int32, [selection | complement]
    detail::cuda_device_buffer step;     // int64: applied steps that had this parameter's gradient
    [[nodiscard]] detail::sparse_adam::state_layout layout() const {
      return {rows, static_cast<index_t>(selection.size()), state_row_major};
    }
    [[nodiscard]] detail::sparse_adam::state_arrays arrays() const {
      float* base = state.data<float>();
      const index_t n = rows * static_cast<index_t>(selection.size());
      return {{base, base + n, base + 2 * n}};
    }
  };
  const entry& at(std::size_t i) const;
  entry& at(std::size_t i);
  void check_matrix(std::size_t i, const char* argument) const;
  void upload_selection(entry& e, cudaStream_t stream);
  void start_step_count(entry& e, cudaStream_t stream);
  void rebuild_tables(cudaStream_t stream);
  cudaStream_t remember(cudaStream_t stream) const {
    last_stream_ = stream;
    return stream;
  }

  adam_options options_;
  std::vector<entry> entries_;
  std::vector<std::size_t> matrices_, vectors_;
  detail::cuda_device_buffer control_;  // control_block
  // Launch tables: params_ rebuilt when parameters are added; grads uploaded when they change.
  bool params_dirty_ = true;
  bool betas_differ_ = false;  // some parameters' beta1, beta2 or eps differ (the step kernel's constants)
  std::int64_t tiles_ = 0;
  detail::cuda_device_buffer params_dev_, grads_dev_;
  std::vector<detail::sparse_adam::grad_desc> grads_host_;
  int grid_limit_ = 1;
  mutable cudaStream_t last_stream_ = nullptr;
  mutable detail::sparse_adam::pinned_uploader uploader_;  // declared last: destroyed first
};

/// Gathers columns of a DEVICE matrix into a compact column-contiguous device buffer (i-th
/// listed column at dst + i * rows, `dst_type`), each value * scale * (*scale_ptr_device if
/// given: device, managed or mapped pinned memory, read once per block), rounded to nearest even. `columns` is a DEVICE
/// span (indices outside [0, cols) are skipped: they cannot be checked on the host). Asynchronous on `stream`.
void cuda_gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                         float scale, const float* scale_ptr_device, cudaStream_t stream);
/// The same with scale 1.
void cuda_gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                         const float* scale_ptr_device, cudaStream_t stream);
/// Scatters a compact column-contiguous device buffer into the listed columns of a DEVICE matrix
/// (converted to its dtype, nearest even); other columns untouched. `columns` is a DEVICE span of
/// distinct indices (a column listed twice gets one of its values, which one unspecified).
/// Asynchronous on `stream`.
void cuda_scatter_columns(const void* src, dtype src_type, std::span<const std::int32_t> columns, matrix_view dst,
                          cudaStream_t stream);

}  // namespace zenflow

#include "zenflow/detail/sparse_adam/cuda_sparse_adam_impl.cuh"
