// Definitions of cuda_sparse_adam and the CUDA gather/scatter (included by
// zenflow/sparse_adam.cuh; not a public header).
#pragma once

#include <algorithm>
#include <utility>

#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/detail/sparse_adam/checks.hpp"
#include "zenflow/detail/sparse_adam/kernels.cuh"
#include "zenflow/sparse_adam.cuh"

namespace zenflow {
namespace detail::sparse_adam {

/// Throws unless `ptr` is device (or managed) memory; with `mapped_host_ok`, pinned host memory
/// mapped into the device's address space is accepted too (kernels read it in place: a loss scale
/// the host keeps in cudaHostAlloc memory, say).
inline void check_device_pointer(const void* ptr, const char* argument, bool mapped_host_ok = false) {
  expects(ptr != nullptr, argument, "is null");
  cudaPointerAttributes attributes{};
  ZENFLOW_CUDA_TRY(cudaPointerGetAttributes(&attributes, ptr));
  const bool device = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  const bool mapped = attributes.type == cudaMemoryTypeHost && attributes.devicePointer == ptr;
  expects(device || (mapped_host_ok && mapped), argument,
          mapped_host_ok ? "must be readable by the device (device, managed or mapped pinned memory)"
                         : "must point to device memory");
}

/// Blocks for a grid-stride launch over n items.
inline unsigned int grid_for(index_t n, int threads, unsigned int limit = 65535u * 16u) {
  const index_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(std::clamp<index_t>(blocks, 1, limit));
}

}  // namespace detail::sparse_adam

inline cuda_sparse_adam::cuda_sparse_adam(const adam_options& options) : options_(options) {
  options_.validate();
  control_ = detail::cuda_device_buffer(sizeof(detail::sparse_adam::control_block));
  ZENFLOW_CUDA_TRY(cudaMemset(control_.data(), 0, sizeof(detail::sparse_adam::control_block)));
  // cudaMemset on device memory may return before it ran, on the legacy stream, which a non-blocking
  // stream does not wait for: the first step must see a zeroed control block.
  ZENFLOW_CUDA_TRY(cudaDeviceSynchronize());
  int device = 0, sms = 0, per_sm = 0;
  ZENFLOW_CUDA_TRY(cudaGetDevice(&device));
  ZENFLOW_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  ZENFLOW_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, detail::sparse_adam::sparse_adam_step_kernel,
                                                                 detail::sparse_adam::kThreads, 0));
  grid_limit_ = std::max(1, sms * std::max(1, per_sm));
}

inline const cuda_sparse_adam::entry& cuda_sparse_adam::at(std::size_t i) const {
  expects(i < entries_.size(), "i", "parameter index ", i, " out of range (", entries_.size(), " registered)");
  return entries_[i];
}
inline cuda_sparse_adam::entry& cuda_sparse_adam::at(std::size_t i) {
  return const_cast<entry&>(std::as_const(*this).at(i));
}
inline void cuda_sparse_adam::check_matrix(std::size_t i, const char* argument) const {
  expects(!at(i).is_vector, argument, "parameter ", i, " is a vector: it has no selection to change");
}

inline bool cuda_sparse_adam::is_vector(std::size_t i) const {
  return at(i).is_vector;
}
inline index_t cuda_sparse_adam::rows(std::size_t i) const {
  return at(i).rows;
}
inline std::span<const std::int32_t> cuda_sparse_adam::selection(std::size_t i) const {
  return at(i).selection;
}
inline index_t cuda_sparse_adam::k(std::size_t i) const {
  return static_cast<index_t>(at(i).selection.size());
}
inline std::span<const std::int32_t> cuda_sparse_adam::selection_device(std::size_t i) const {
  check_matrix(i, "i");
  return {entries_[i].columns.data<const std::int32_t>(), entries_[i].selection.size()};
}
inline std::span<const std::int32_t> cuda_sparse_adam::unselected_device(std::size_t i) const {
  check_matrix(i, "i");
  const auto& e = entries_[i];
  return {e.columns.data<const std::int32_t>() + e.selection.size(),
          static_cast<std::size_t>(e.param.cols) - e.selection.size()};
}

inline const adam_options& cuda_sparse_adam::options(std::size_t i) const {
  expects(i < entries_.size(), "i", "parameter index ", i, " out of range (", entries_.size(), " registered)");
  return entries_[i].options;
}
inline void cuda_sparse_adam::set_options(std::size_t i, const adam_options& options) {
  expects(i < entries_.size(), "i", "parameter index ", i, " out of range (", entries_.size(), " registered)");
  options.validate();
  const char* field = shared_field_mismatch(options, options_);
  expects(field == nullptr, field ? field : "options", "must be as in options(): ", per_group_rule<adam_options>());
  entries_[i].options = options;
  params_dirty_ = true;  // the tables carry the per-group fields
}
inline void cuda_sparse_adam::set_options(const adam_options& options) {
  options.validate();
  options_ = options;
  for (auto& e : entries_) e.options = options;
  params_dirty_ = true;
}

inline std::int64_t cuda_sparse_adam::step_count() const {
  detail::sparse_adam::control_block c;
  ZENFLOW_CUDA_TRY(cudaMemcpyAsync(&c, control_.data(), sizeof c, cudaMemcpyDeviceToHost, last_stream_));
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(last_stream_));
  return c.step;
}
inline void cuda_sparse_adam::set_step_count(std::int64_t step, cudaStream_t stream) {
  expects(step >= 0, "step", "must be >= 0, got ", step);
  uploader_.upload(control_.data(), &step, sizeof step, remember(stream));  // step is the first field
  for (auto& e : entries_) uploader_.upload(e.step.data(), &step, sizeof step, stream);
}
inline std::int64_t cuda_sparse_adam::step_count(std::size_t i) const {
  std::int64_t step = 0;
  ZENFLOW_CUDA_TRY(cudaMemcpyAsync(&step, at(i).step.data(), sizeof step, cudaMemcpyDeviceToHost, last_stream_));
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(last_stream_));
  return step;
}
inline void cuda_sparse_adam::set_step_count(std::size_t i, std::int64_t step, cudaStream_t stream) {
  entry& e = at(i);
  expects(step >= 0, "step", "must be >= 0, got ", step);
  uploader_.upload(e.step.data(), &step, sizeof step, remember(stream));
}
inline void cuda_sparse_adam::set_step_count(std::size_t i, std::int64_t step) {
  set_step_count(i, step, last_stream_);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(last_stream_));
}
inline void cuda_sparse_adam::start_step_count(entry& e, cudaStream_t stream) {
  // A new parameter starts from the optimizer's count, in stream order (step is the control
  // block's first field).
  e.step = detail::cuda_device_buffer(sizeof(std::int64_t));
  ZENFLOW_CUDA_TRY(
      cudaMemcpyAsync(e.step.data(), control_.data(), sizeof(std::int64_t), cudaMemcpyDeviceToDevice, stream));
}
inline void cuda_sparse_adam::set_step_count(std::int64_t step) {
  set_step_count(step, last_stream_);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(last_stream_));
}

inline void cuda_sparse_adam::upload_selection(entry& e, cudaStream_t stream) {
  // One upload of [selection (k) | complement (cols - k)] into the parameter's column array.
  std::vector<std::int32_t> both(e.selection);
  const auto rest = complement_columns(e.selection, e.param.cols);
  both.insert(both.end(), rest.begin(), rest.end());
  uploader_.upload(e.columns.data(), both.data(), both.size() * sizeof(std::int32_t), stream);
}

inline std::size_t cuda_sparse_adam::add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                                                const float* initial_state_packed, cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  sa::check_param_matrix(param, memory_space::device, "param");
  sa::check_selection(initial_selection, param.cols, "initial_selection");
  const index_t k = static_cast<index_t>(initial_selection.size());
  expects(param.rows * k <= std::numeric_limits<std::int32_t>::max() - sa::kTile, "initial_selection",
          "rows * k must stay below 2^31 (", param.rows, " x ", k, ")");
  sa::check_device_pointer(initial_state_packed, "initial_state_packed");
  remember(stream);
  entry e;
  e.param = param;
  e.selection.assign(initial_selection.begin(), initial_selection.end());
  e.rows = param.rows;
  e.state_row_major = sa::state_row_major_for(param.row_stride, param.col_stride);
  e.state = detail::cuda_device_buffer(3 * static_cast<std::size_t>(param.rows * k) * sizeof(float));
  e.columns = detail::cuda_device_buffer(static_cast<std::size_t>(param.cols) * sizeof(std::int32_t));
  upload_selection(e, stream);
  const sa::state_arrays a = e.arrays();
  sa::rebuild_state_kernel<<<sa::grid_for(param.rows * k, sa::kThreads), sa::kThreads, 0, stream>>>(
      a, a, e.layout(), nullptr, initial_state_packed);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
  e.options = options_;
  start_step_count(e, stream);
  entries_.push_back(std::move(e));
  matrices_.push_back(entries_.size() - 1);
  params_dirty_ = true;
  return entries_.size() - 1;
}

inline std::size_t cuda_sparse_adam::add_matrix(matrix_view param, std::span<const std::int32_t> initial_selection,
                                                std::span<const float> initial_state_packed, cudaStream_t stream) {
  detail::sparse_adam::check_buffer(initial_state_packed.size(),
                                    3 * param.rows * static_cast<index_t>(initial_selection.size()),
                                    "initial_state_packed");
  return add_matrix(param, initial_selection, initial_state_packed.data(), stream);
}

inline std::size_t cuda_sparse_adam::add_vector(vector_view param, std::span<const float> initial_master,
                                                cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  param.validate("param", memory_space::device);
  expects(param.size > 0, "param", "must not be empty");
  expects(param.size <= std::numeric_limits<std::int32_t>::max() - sa::kTile, "param", "size must stay below 2^31");
  sa::check_buffer(initial_master.size(), param.size, "initial_master");
  remember(stream);
  entry e;
  e.is_vector = true;
  e.param = matrix_view(param.data, param.size, 1, param.stride, 1, param.type, param.space);
  e.selection = {0};
  e.rows = param.size;
  e.state = detail::cuda_device_buffer(3 * static_cast<std::size_t>(param.size) * sizeof(float));
  uploader_.upload(e.state.data(), initial_master.data(), static_cast<std::size_t>(param.size) * sizeof(float), stream);
  ZENFLOW_CUDA_TRY(cudaMemsetAsync(e.state.data<float>() + param.size, 0,
                                   2 * static_cast<std::size_t>(param.size) * sizeof(float), stream));
  e.options = options_;
  start_step_count(e, stream);
  entries_.push_back(std::move(e));
  vectors_.push_back(entries_.size() - 1);
  params_dirty_ = true;
  return entries_.size() - 1;
}

inline void cuda_sparse_adam::rebuild_tables(cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  std::vector<sa::param_desc> table(entries_.size());
  std::int64_t tiles = 0;
  betas_differ_ = false;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const entry& e = entries_[i];
    const adam_options& first = entries_[0].options;
    betas_differ_ =
        betas_differ_ || e.options.beta1 != first.beta1 || e.options.beta2 != first.beta2 || e.options.eps != first.eps;
    sa::param_desc& d = table[i];
    d.param = e.param.data;
    d.row_stride = e.param.row_stride;
    d.col_stride = e.param.col_stride;
    d.columns = e.is_vector ? nullptr : e.columns.data<const std::int32_t>();
    const sa::state_arrays a = e.arrays();
    d.master = a.part[0];
    d.exp_avg = a.part[1];
    d.exp_avg_sq = a.part[2];
    d.rows = static_cast<std::uint32_t>(e.rows);
    d.k = static_cast<std::uint32_t>(e.selection.size());
    d.tile_begin = tiles;
    d.step = e.step.data<std::int64_t>();
    d.lr = e.options.lr;
    d.beta1 = e.options.beta1;
    d.beta2 = e.options.beta2;
    d.eps = e.options.eps;
    d.weight_decay = e.options.weight_decay;
    d.type = e.param.type;
    d.state_row_major = e.state_row_major;
    tiles += (e.rows * static_cast<index_t>(e.selection.size()) + sa::kTile - 1) / sa::kTile;
  }
  if (params_dev_.bytes() < table.size() * sizeof(sa::param_desc)) {
    params_dev_ = detail::cuda_device_buffer(table.size() * sizeof(sa::param_desc));
    grads_dev_ = detail::cuda_device_buffer(table.size() * sizeof(sa::grad_desc));
    grads_host_.clear();
  }
  uploader_.upload(params_dev_.data(), table.data(), table.size() * sizeof(sa::param_desc), stream);
  tiles_ = tiles;
  params_dirty_ = false;
}

inline void cuda_sparse_adam::step(std::span<const const_matrix_view> matrix_grads,
                                   std::span<const const_vector_view> vector_grads, float grad_scale,
                                   const float* scale_ptr_device, const int* skip_flag_device, bool check_finite,
                                   cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  expects(matrix_grads.size() == matrices_.size(), "matrix_grads", "has ", matrix_grads.size(),
          " views, expected one per matrix parameter (", matrices_.size(), ")");
  expects(vector_grads.size() == vectors_.size(), "vector_grads", "has ", vector_grads.size(),
          " views, expected one per vector parameter (", vectors_.size(), ")");
  expects(is_finite_bits(grad_scale) && grad_scale >= 0.0f, "grad_scale", "must be finite and >= 0, got ", grad_scale);
  // Every block dereferences them: a host pointer would fault in the kernel instead of throwing here.
  if (scale_ptr_device != nullptr)
    sa::check_device_pointer(scale_ptr_device, "scale_ptr_device", /*mapped_host_ok=*/true);
  if (skip_flag_device != nullptr)
    sa::check_device_pointer(skip_flag_device, "skip_flag_device", /*mapped_host_ok=*/true);
  std::vector<sa::grad_desc> grads(entries_.size());
  // A view with data == nullptr: no gradient for that parameter this step (grad_desc{}).
  for (std::size_t g = 0; g < matrices_.size(); ++g) {
    const auto& v = matrix_grads[g];
    if (v.data == nullptr) continue;
    sa::check_grad_matrix(v, entries_[matrices_[g]].param, memory_space::device, "matrix_grads");
    grads[matrices_[g]] = {v.data, v.row_stride, v.col_stride, v.type};
  }
  for (std::size_t g = 0; g < vectors_.size(); ++g) {
    const auto& v = vector_grads[g];
    if (v.data == nullptr) continue;
    v.validate("vector_grads", memory_space::device);
    expects(v.size == entries_[vectors_[g]].rows, "vector_grads", "size ", v.size, " does not match the parameter's ",
            entries_[vectors_[g]].rows);
    grads[vectors_[g]] = {v.data, v.stride, 1, v.type};
  }
  remember(stream);
  if (entries_.empty()) return;
  if (params_dirty_) rebuild_tables(stream);
  if (grads != grads_host_) {  // trainers normally keep their gradient buffers: uploaded once
    uploader_.upload(grads_dev_.data(), grads.data(), grads.size() * sizeof(sa::grad_desc), stream);
    grads_host_ = std::move(grads);
  }
  auto* control = control_.data<sa::control_block>();
  const int count = static_cast<int>(entries_.size());
  const auto grid = static_cast<unsigned int>(std::min<std::int64_t>(tiles_, grid_limit_));
  if (check_finite) {
    ZENFLOW_CUDA_TRY(cudaMemsetAsync(&control->nonfinite, 0, sizeof(int), stream));
    sa::sparse_adam_nonfinite_kernel<<<grid, sa::kThreads, 0, stream>>>(params_dev_.data<const sa::param_desc>(),
                                                                        grads_dev_.data<const sa::grad_desc>(), count,
                                                                        tiles_, grad_scale, scale_ptr_device, control);
    ZENFLOW_CUDA_TRY(cudaGetLastError());
  }
  sa::step_control ctl;
  ctl.options = options_;
  ctl.betas_differ = betas_differ_;
  ctl.grad_scale = grad_scale;
  ctl.scale_ptr = scale_ptr_device;
  ctl.skip_flag = skip_flag_device;
  ctl.use_nonfinite = check_finite;
  ctl.control = control;
  sa::sparse_adam_step_kernel<<<grid, sa::kThreads, 0, stream>>>(
      params_dev_.data<const sa::param_desc>(), grads_dev_.data<const sa::grad_desc>(), count, tiles_, ctl);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
}

inline index_t cuda_sparse_adam::migration_count(std::size_t i, std::span<const std::int32_t> new_selection) const {
  check_matrix(i, "i");
  detail::sparse_adam::check_selection(new_selection, entries_[i].param.cols, "new_selection");
  return detail::sparse_adam::migration_plan(entries_[i].selection, new_selection);
}

inline void cuda_sparse_adam::reselect(std::size_t i, std::span<const std::int32_t> new_selection,
                                       const float* entering_in, float* leaving_out, cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  check_matrix(i, "i");
  entry& e = entries_[i];
  sa::check_selection(new_selection, e.param.cols, "new_selection");
  expects(new_selection.size() == e.selection.size(), "new_selection", "has ", new_selection.size(),
          " columns, expected k = ", e.selection.size());
  std::vector<std::int32_t> source, leaving;
  const index_t moved = sa::migration_plan(e.selection, new_selection, &source, &leaving);
  if (moved > 0) {
    sa::check_device_pointer(entering_in, "entering_in");
    sa::check_device_pointer(leaving_out, "leaving_out");
  }
  remember(stream);
  if (moved == 0) return;  // same selection: nothing moves
  // source[j] for an entering slot: -(rank among entering) - 1.
  for (std::int32_t j = 0, entering = 0; j < static_cast<std::int32_t>(source.size()); ++j)
    if (source[j] < 0) source[j] = -(++entering);
  const sa::state_layout layout = e.layout();
  const index_t n = layout.size();
  // Scratch (stream-ordered): new state, then the maps [source (k) | leaving (moved)].
  const detail::cuda_async_buffer fresh_buffer(3 * n * sizeof(float), stream);
  const detail::cuda_async_buffer maps_buffer((source.size() + leaving.size()) * 4, stream);
  float* fresh = fresh_buffer.data<float>();
  std::int32_t* maps = maps_buffer.data<std::int32_t>();
  source.insert(source.end(), leaving.begin(), leaving.end());
  uploader_.upload(maps, source.data(), source.size() * sizeof(std::int32_t), stream);
  const sa::state_arrays old_state = e.arrays();
  const sa::state_arrays new_state{{fresh, fresh + n, fresh + 2 * n}};
  // Read every entering value before any leaving value is written (the buffers may alias).
  sa::rebuild_state_kernel<<<sa::grid_for(n, sa::kThreads), sa::kThreads, 0, stream>>>(old_state, new_state, layout,
                                                                                       maps, entering_in);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
  sa::pack_state_kernel<<<sa::grid_for(e.rows * moved, sa::kThreads), sa::kThreads, 0, stream>>>(
      old_state, layout, maps + e.selection.size(), moved, leaving_out);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
  ZENFLOW_CUDA_TRY(cudaMemcpyAsync(old_state.part[0], fresh, 3 * n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  e.selection.assign(new_selection.begin(), new_selection.end());
  upload_selection(e, stream);
}

inline void cuda_sparse_adam::reselect(std::size_t i, std::span<const std::int32_t> new_selection,
                                       std::span<const float> entering_in, std::span<float> leaving_out,
                                       cudaStream_t stream) {
  const index_t moved = migration_count(i, new_selection);
  detail::sparse_adam::check_buffer(entering_in.size(), 3 * entries_[i].rows * moved, "entering_in");
  detail::sparse_adam::check_buffer(leaving_out.size(), 3 * entries_[i].rows * moved, "leaving_out");
  reselect(i, new_selection, entering_in.data(), leaving_out.data(), stream);
}

inline void cuda_sparse_adam::export_state(std::size_t i, float* packed_out, cudaStream_t stream) const {
  namespace sa = detail::sparse_adam;
  const entry& e = at(i);
  sa::check_device_pointer(packed_out, "packed_out");
  remember(stream);
  const index_t k = static_cast<index_t>(e.selection.size());
  sa::pack_state_kernel<<<sa::grid_for(e.rows * k, sa::kThreads), sa::kThreads, 0, stream>>>(e.arrays(), e.layout(),
                                                                                             nullptr, k, packed_out);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
}

inline void cuda_sparse_adam::import_state(std::size_t i, const float* packed_in, cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  const entry& e = at(i);
  sa::check_device_pointer(packed_in, "packed_in");
  remember(stream);
  const sa::state_arrays a = e.arrays();
  sa::rebuild_state_kernel<<<sa::grid_for(e.layout().size(), sa::kThreads), sa::kThreads, 0, stream>>>(
      a, a, e.layout(), nullptr, packed_in);
  ZENFLOW_CUDA_TRY(cudaGetLastError());
}

inline void cuda_sparse_adam::export_state(std::size_t i, std::span<float> packed_out) const {
  const entry& e = at(i);
  const index_t n = 3 * e.layout().size();
  detail::sparse_adam::check_buffer(packed_out.size(), n, "packed_out");
  detail::cuda_device_buffer scratch(static_cast<std::size_t>(n) * sizeof(float));
  export_state(i, scratch.data<float>(), last_stream_);
  ZENFLOW_CUDA_TRY(
      cudaMemcpyAsync(packed_out.data(), scratch.data(), scratch.bytes(), cudaMemcpyDeviceToHost, last_stream_));
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(last_stream_));
}

inline void cuda_sparse_adam::import_state(std::size_t i, std::span<const float> packed_in) {
  const entry& e = at(i);
  const index_t n = 3 * e.layout().size();
  detail::sparse_adam::check_buffer(packed_in.size(), n, "packed_in");
  detail::cuda_device_buffer scratch(static_cast<std::size_t>(n) * sizeof(float));
  ZENFLOW_CUDA_TRY(
      cudaMemcpyAsync(scratch.data(), packed_in.data(), scratch.bytes(), cudaMemcpyHostToDevice, last_stream_));
  import_state(i, scratch.data<const float>(), last_stream_);
  ZENFLOW_CUDA_TRY(cudaStreamSynchronize(last_stream_));
}

namespace detail::sparse_adam {

/// cuda_gather_columns without its checks: for callers whose device buffers are their own (the
/// coordinator's column lists, staging and flags), checked once where they were made, not at every
/// step (each check is a cudaPointerGetAttributes call).
inline void launch_gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst,
                                  dtype dst_type, float scale, const float* scale_ptr_device, cudaStream_t stream) {
  const auto n = static_cast<index_t>(columns.size());
  if (n == 0 || src.rows == 0) return;
  if (src.row_stride <= src.col_stride) {
    const dim3 grid(static_cast<unsigned int>(n), row_tile_grid(src.rows, kTile));
    gather_columns_direct_kernel<<<grid, kThreads, 0, stream>>>(src.data, src.type, src.rows, src.cols, src.row_stride,
                                                                src.col_stride, columns.data(), dst, dst_type, scale,
                                                                scale_ptr_device);
  } else {
    const dim3 grid(static_cast<unsigned int>((n + kTransposeTile - 1) / kTransposeTile),
                    row_tile_grid(src.rows, kTransposeTile));
    gather_columns_transpose_kernel<<<grid, dim3(kTransposeTile, kTransposeRows), 0, stream>>>(
        src.data, src.type, src.rows, src.cols, src.row_stride, src.col_stride, columns.data(), n, dst, dst_type, scale,
        scale_ptr_device);
  }
  ZENFLOW_CUDA_TRY(cudaGetLastError());
}

/// cuda_scatter_columns without its checks (see launch_gather_columns).
inline void launch_scatter_columns(const void* src, dtype src_type, std::span<const std::int32_t> columns,
                                   matrix_view dst, cudaStream_t stream) {
  const auto n = static_cast<index_t>(columns.size());
  if (n == 0 || dst.rows == 0) return;
  if (dst.row_stride <= dst.col_stride) {
    const dim3 grid(static_cast<unsigned int>(n), row_tile_grid(dst.rows, kTile));
    scatter_columns_direct_kernel<<<grid, kThreads, 0, stream>>>(src, src_type, columns.data(), dst.data, dst.type,
                                                                 dst.rows, dst.cols, dst.row_stride, dst.col_stride);
  } else {
    const dim3 grid(static_cast<unsigned int>((n + kTransposeTile - 1) / kTransposeTile),
                    row_tile_grid(dst.rows, kTransposeTile));
    scatter_columns_transpose_kernel<<<grid, dim3(kTransposeTile, kTransposeRows), 0, stream>>>(
        src, src_type, columns.data(), n, dst.data, dst.type, dst.rows, dst.cols, dst.row_stride, dst.col_stride);
  }
  ZENFLOW_CUDA_TRY(cudaGetLastError());
}

}  // namespace detail::sparse_adam

inline void cuda_gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                                float scale, const float* scale_ptr_device, cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  src.validate("src", memory_space::device);
  expects(is_valid(dst_type), "dst_type", "unknown dtype value ", static_cast<int>(dst_type));
  expects(is_finite_bits(scale), "scale", "must be finite, got ", scale);
  if (columns.empty() || src.rows == 0) return;
  sa::check_device_pointer(columns.data(), "columns");
  sa::check_device_pointer(dst, "dst");
  if (scale_ptr_device != nullptr)
    sa::check_device_pointer(scale_ptr_device, "scale_ptr_device", /*mapped_host_ok=*/true);
  sa::launch_gather_columns(src, columns, dst, dst_type, scale, scale_ptr_device, stream);
}

inline void cuda_gather_columns(const_matrix_view src, std::span<const std::int32_t> columns, void* dst, dtype dst_type,
                                const float* scale_ptr_device, cudaStream_t stream) {
  cuda_gather_columns(src, columns, dst, dst_type, 1.0f, scale_ptr_device, stream);
}

inline void cuda_scatter_columns(const void* src, dtype src_type, std::span<const std::int32_t> columns,
                                 matrix_view dst, cudaStream_t stream) {
  namespace sa = detail::sparse_adam;
  dst.validate("dst", memory_space::device);
  expects(is_valid(src_type), "src_type", "unknown dtype value ", static_cast<int>(src_type));
  if (columns.empty() || dst.rows == 0) return;
  sa::check_device_pointer(columns.data(), "columns");
  sa::check_device_pointer(src, "src");
  sa::launch_scatter_columns(src, src_type, columns, dst, stream);
}

}  // namespace zenflow
