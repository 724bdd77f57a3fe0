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
#include "zenflow/detail/coordinator/checkpoint_io.hpp"

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
//
// Data parallel: each rank packs the entering columns it owns, and one all-gather (equal blocks,
// in owner order, which is column order) gives every rank all of them; each rank keeps the
// leaving columns it owns. In one process a rank owns every column and nothing is gathered.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::set_selection(parameter& p,
                                                                            std::vector<std::int32_t> selection,
                                                                            stream_type stream) {
  const index_t rows = p.matrix.rows;
  const std::size_t per_column = 3 * static_cast<std::size_t>(rows);  // master, m, v
  const auto entering = detail::set_difference(selection, p.selection);
  const auto leaving = detail::set_difference(p.selection, selection);
  const std::span<float> params = host_opt_.params(p.cpu_tensor);
  const std::span<float> m = host_opt_.exp_avg(p.cpu_tensor);
  const std::span<float> v = host_opt_.exp_avg_sq(p.cpu_tensor);
  // The part of an ascending column list in rank r's range, and this rank's part as columns of
  // its CPU tensor.
  auto part = [&](std::span<const std::int32_t> list, int r) {
    const column_range range = detail::owned_range(p.matrix.cols, r, ranks_);
    const auto first = std::lower_bound(list.begin(), list.end(), range.first);
    const auto last = std::lower_bound(first, list.end(), range.last);
    return list.subspan(static_cast<std::size_t>(first - list.begin()), static_cast<std::size_t>(last - first));
  };
  auto local = [&](std::span<const std::int32_t> columns) {
    std::vector<std::int32_t> out(columns.begin(), columns.end());
    for (auto& c : out) c -= static_cast<std::int32_t>(p.owned.first);
    return out;
  };
  const bool unchanged = p.device_index != npos && entering.empty() && leaving.empty();
  if (!selection.empty() && !unchanged) {
    std::vector<float> packed;
    const auto own_entering = part(entering, rank_);
    detail::pack_columns(params, m, v, rows, local(own_entering), packed);
    metrics_.bytes_host_to_device += packed.size() * sizeof(float);
    device_buffer entering_dev(entering.size() * per_column * sizeof(float));
    if constexpr (data_parallel) {
      std::size_t block = 0;
      for (int r = 0; r < ranks_; ++r) block = std::max(block, part(entering, r).size() * per_column);
      if (block > 0) {
        device_buffer blocks(static_cast<std::size_t>(ranks_) * block * sizeof(float));
        auto* all = reinterpret_cast<float*>(blocks.data());
        detail::synchronize_on_unwind<Backend> guard(stream);
        Backend::copy_async(all + static_cast<std::size_t>(rank_) * block, packed.data(), packed.size() * sizeof(float),
                            stream);
        comm_->all_gather(std::span<const float>(all + static_cast<std::size_t>(rank_) * block, block),
                          std::span<float>(all, static_cast<std::size_t>(ranks_) * block), stream);
        std::size_t at = 0;
        for (int r = 0; r < ranks_; ++r) {
          const std::size_t n = part(entering, r).size() * per_column;
          Backend::copy_async(entering_dev.data() + at * sizeof(float), all + static_cast<std::size_t>(r) * block,
                              n * sizeof(float), stream);
          at += n;
        }
        Backend::synchronize(stream);
      }
    } else {
      Backend::copy_async(entering_dev.data(), packed.data(), packed.size() * sizeof(float), stream);
      Backend::synchronize(stream);
    }
    const std::span<const float> entering_span(reinterpret_cast<const float*>(entering_dev.data()),
                                               entering.size() * per_column);
    if (p.device_index == npos) {
      p.device_index = Backend::add_matrix(device_opt_, p.matrix, selection, entering_span, stream);
    } else {
      device_buffer leaving_dev(leaving.size() * per_column * sizeof(float));
      const std::span<float> leaving_span(reinterpret_cast<float*>(leaving_dev.data()), leaving.size() * per_column);
      Backend::reselect(device_opt_, p.device_index, selection, entering_span, leaving_span, stream);
      // This rank's part of the leaving columns (all of them in one process) back to its CPU.
      const auto own_leaving = part(leaving, rank_);
      const std::size_t skip = static_cast<std::size_t>(own_leaving.data() - leaving.data()) * per_column;
      std::vector<float> back(own_leaving.size() * per_column);
      Backend::copy_async(back.data(), leaving_dev.data() + skip * sizeof(float), back.size() * sizeof(float), stream);
      Backend::synchronize(stream);
      detail::unpack_columns(params, m, v, rows, local(own_leaving), back);
      metrics_.bytes_device_to_host += back.size() * sizeof(float);
    }
  }
  p.complement = complement_columns(selection, p.matrix.cols);
  p.selection = std::move(selection);
  setup_buffers(p, stream);
}

// Sizes parameter p's CPU-column buffers for its complement (accumulators and copy-out zeroed)
// and uploads the complement's column list. Synchronizes with `stream`.
//
// The complement is cut by owner into `pieces` (rank r's piece: its columns, in order); the
// gradient staging and the write-back staging hold ranks() blocks of `block` elements, the
// largest piece (the equal blocks of reduce_scatter and all_gather; in one process one block, the
// whole complement). This rank's accumulator and copy-out hold its own piece.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::setup_buffers(parameter& p, stream_type stream) {
  const auto rows = static_cast<std::size_t>(p.matrix.rows);
  p.pieces.assign(static_cast<std::size_t>(ranks_) + 1, 0);
  std::size_t largest = 0;
  for (int r = 0; r <= ranks_; ++r) {
    const index_t bound = r == ranks_ ? p.matrix.cols : detail::owned_range(p.matrix.cols, r, ranks_).first;
    p.pieces[r] = static_cast<std::size_t>(std::lower_bound(p.complement.begin(), p.complement.end(), bound) -
                                           p.complement.begin());
    if (r > 0) largest = std::max(largest, p.pieces[r] - p.pieces[r - 1]);
  }
  p.block = largest * rows;
  p.owned_local.assign(p.complement.begin() + static_cast<std::ptrdiff_t>(p.pieces[rank_]),
                       p.complement.begin() + static_cast<std::ptrdiff_t>(p.pieces[rank_ + 1]));
  for (auto& c : p.owned_local) c -= static_cast<std::int32_t>(p.owned.first);
  const std::size_t own = p.owned_local.size() * rows;
  const std::size_t staged = static_cast<std::size_t>(ranks_) * p.block;
  // k is fixed per parameter, so after the first call the sizes never change: the device buffers
  // are kept (a cudaFree per buffer and reselection would wait for the whole device each time).
  // Data parallel: the pieces (and so the blocks) follow the selection.
  auto fit = [](device_buffer& b, std::size_t bytes) {
    if (b.bytes() != bytes) b = device_buffer(bytes);
  };
  fit(p.complement_dev, p.complement.size() * sizeof(std::int32_t));
  Backend::copy_async(p.complement_dev.data(), p.complement.data(), p.complement.size() * sizeof(std::int32_t), stream);
  if constexpr (data_parallel) {
    fit(p.selection_dev, p.selection.size() * sizeof(std::int32_t));
    Backend::copy_async(p.selection_dev.data(), p.selection.data(), p.selection.size() * sizeof(std::int32_t), stream);
    fit(p.selected_stage, p.selection.size() * rows * dtype_size(p.grad_type));
  }
  for (int b = 0; b < 2; ++b) {
    fit(p.grad_stage[b], staged * dtype_size(p.grad_type));
    p.accumulator[b].assign(own, 0.0f);
    p.accumulated[b] = 0;
    p.out_stage[b].assign(own * dtype_size(p.matrix.type), std::byte{0});
    fit(p.writeback_dev[b], staged * dtype_size(p.matrix.type));
  }
  Backend::synchronize(stream);
}

}  // namespace zenflow
