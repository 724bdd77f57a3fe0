// State migration of the coordinator on reselection: the columns that become important take their
// fp32 master and moments from the CPU optimizer to the device optimizer, the columns that stop
// being important hand theirs back (nothing is zeroed or truncated), and the per-parameter buffers
// of the CPU columns follow the new selection.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <span>
#include <utility>
#include <vector>

#include "zenflow/coordinator.hpp"

namespace zenflow {

namespace detail {
/// Packs [master, m, v] of `columns` (column-contiguous CPU state, `rows` per column).
inline void pack_columns(std::span<const float> p, std::span<const float> m, std::span<const float> v, index_t rows,
                         std::span<const std::int32_t> columns, std::vector<float>& out) {
  out.resize(columns.size() * 3 * static_cast<std::size_t>(rows));
  float* dst = out.data();
  for (std::int32_t c : columns) {
    const std::size_t at = static_cast<std::size_t>(c) * rows;
    for (auto* src : {&p, &m, &v}) {
      std::memcpy(dst, src->data() + at, rows * sizeof(float));
      dst += rows;
    }
  }
}
/// The inverse of pack_columns: writes `in` back into the columns' master, m and v.
inline void unpack_columns(std::span<float> p, std::span<float> m, std::span<float> v, index_t rows,
                           std::span<const std::int32_t> columns, std::span<const float> in) {
  const float* src = in.data();
  for (std::int32_t c : columns) {
    const std::size_t at = static_cast<std::size_t>(c) * rows;
    for (auto* dst : {&p, &m, &v}) {
      std::memcpy(dst->data() + at, src, rows * sizeof(float));
      src += rows;
    }
  }
}
/// The columns of `a` that are not in `b` (both ascending).
inline std::vector<std::int32_t> set_difference(std::span<const std::int32_t> a, std::span<const std::int32_t> b) {
  std::vector<std::int32_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}
}  // namespace detail

// Moves parameter p to `selection` (ascending; empty: every column on the CPU): the state of the
// entering columns goes to the device optimizer, that of the leaving columns comes back, and the
// CPU columns' buffers are set up for the new complement. Synchronizes with `stream`.
template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::set_selection(parameter& p, std::vector<std::int32_t> selection,
                                                              stream_type stream) {
  const index_t rows = p.matrix.rows;
  const auto entering = detail::set_difference(selection, p.selection);
  const auto leaving = detail::set_difference(p.selection, selection);
  const std::span<float> params = host_opt_.params(p.cpu_tensor);
  const std::span<float> m = host_opt_.exp_avg(p.cpu_tensor);
  const std::span<float> v = host_opt_.exp_avg_sq(p.cpu_tensor);
  const bool unchanged = p.device_index != npos && entering.empty() && leaving.empty();
  if (!selection.empty() && !unchanged) {
    std::vector<float> packed;
    detail::pack_columns(params, m, v, rows, entering, packed);
    device_buffer entering_dev(packed.size() * sizeof(float));
    Backend::copy_async(entering_dev.data(), packed.data(), packed.size() * sizeof(float), stream);
    Backend::synchronize(stream);
    const std::span<const float> entering_span(reinterpret_cast<const float*>(entering_dev.data()), packed.size());
    metrics_.bytes_host_to_device += packed.size() * sizeof(float);
    if (p.device_index == npos) {
      p.device_index = Backend::add_matrix(device_opt_, p.matrix, selection, entering_span, stream);
    } else {
      device_buffer leaving_dev(leaving.size() * 3 * rows * sizeof(float));
      const std::span<float> leaving_span(reinterpret_cast<float*>(leaving_dev.data()), leaving.size() * 3 * rows);
      Backend::reselect(device_opt_, p.device_index, selection, entering_span, leaving_span, stream);
      std::vector<float> back(leaving_span.size());
      Backend::copy_async(back.data(), leaving_dev.data(), back.size() * sizeof(float), stream);
      Backend::synchronize(stream);
      detail::unpack_columns(params, m, v, rows, leaving, back);
      metrics_.bytes_device_to_host += back.size() * sizeof(float);
    }
  }
  p.complement = complement_columns(selection, p.matrix.cols);
  p.selection = std::move(selection);
  setup_buffers(p, stream);
}

// Sizes parameter p's CPU-column buffers for its complement (accumulators and copy-out zeroed)
// and uploads the complement's column list. Synchronizes with `stream`.
template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::setup_buffers(parameter& p, stream_type stream) {
  const std::size_t n = p.complement.size() * static_cast<std::size_t>(p.matrix.rows);
  // k is fixed per parameter, so after the first call the sizes never change: the device buffers
  // are kept (a cudaFree per buffer and reselection would wait for the whole device each time).
  auto fit = [](device_buffer& b, std::size_t bytes) {
    if (b.bytes() != bytes) b = device_buffer(bytes);
  };
  fit(p.complement_dev, p.complement.size() * sizeof(std::int32_t));
  Backend::copy_async(p.complement_dev.data(), p.complement.data(), p.complement.size() * sizeof(std::int32_t), stream);
  for (int b = 0; b < 2; ++b) {
    fit(p.grad_stage[b], n * dtype_size(p.grad_type));
    p.accumulator[b].assign(n, 0.0f);
    p.out_stage[b].assign(n * dtype_size(p.matrix.type), std::byte{0});
    fit(p.writeback_dev[b], n * dtype_size(p.matrix.type));
  }
  Backend::synchronize(stream);
}

}  // namespace zenflow
