// State migration of the coordinator on reselection: the columns that become important take their
// state slots (the fp32 master and the optimizer's own state, as the CPU optimizer exports them,
// whatever it holds; state_slots.hpp) from the CPU optimizer to the device optimizer, the columns
// that stop being important hand theirs back (nothing is zeroed or truncated), and the
// per-parameter buffers of the CPU columns follow the new selection.
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
/// Tensor t's `columns` (as columns of the tensor, ascending), `rows` per column, as the host
/// optimizer exports them in fp32, in the device exchange layout (state_slots.hpp). One export per
/// column: the host layout of one column is the device layout of that column, so each export
/// writes its place in `out` directly.
template <class HostOptimizer>
void pack_columns(const HostOptimizer& o, std::size_t t, index_t rows, std::span<const std::int32_t> columns,
                  std::vector<float>& out) {
  const std::size_t per_column = HostOptimizer::slots_type::count * static_cast<std::size_t>(rows);
  out.resize(columns.size() * per_column);
  for (std::size_t j = 0; j < columns.size(); ++j)
    o.export_state(t, columns.subspan(j, 1), std::span<float>(out).subspan(j * per_column, per_column));
}
/// The inverse of pack_columns: imports `in` into tensor t's `columns` in one call, so that the
/// host optimizer checks every column before it changes any.
template <class HostOptimizer>
void unpack_columns(HostOptimizer& o, std::size_t t, index_t rows, std::span<const std::int32_t> columns,
                    std::span<const float> in) {
  constexpr std::size_t slots = HostOptimizer::slots_type::count;
  const auto n = static_cast<std::size_t>(rows);
  const std::size_t total = columns.size() * n;
  std::vector<float> parts(in.size());  // the host layout: slot after slot, each in column order
  for (std::size_t j = 0; j < columns.size(); ++j)
    for (std::size_t s = 0; s < slots; ++s)
      std::memcpy(parts.data() + s * total + j * n, in.data() + (slots * j + s) * n, n * sizeof(float));
  o.import_state(t, columns, parts);
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
// CPU columns' buffers are set up for the new CPU columns. Synchronizes with `stream`.
//
// Data parallel: each rank packs the entering columns it owns, and one all-gather (equal blocks,
// in owner order, which is column order) gives every rank all of them; each rank keeps the
// leaving columns it owns. In one process a rank owns every column and nothing is gathered.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::set_selection(parameter& p,
                                                                            std::vector<std::int32_t> selection,
                                                                            stream_type stream) {
  const index_t rows = p.matrix.rows;
  const std::size_t per_column = slots_type::count * static_cast<std::size_t>(rows);
  const auto entering = detail::set_difference(selection, p.gpu_columns);
  const auto leaving = detail::set_difference(p.gpu_columns, selection);
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
    // Device scratch of the coordinator, sized once for the largest migration of any parameter:
    // [entering (<= k columns) | leaving (<= k columns) | data parallel: ranks blocks].
    const std::size_t k = selection.size();
    float* const entering_dev = migration_scratch();
    float* const leaving_dev = entering_dev + k * per_column;
    float* const all = leaving_dev + k * per_column;
    std::vector<float> packed;
    const auto own_entering = part(entering, rank_);
    detail::pack_columns(host_opt_, p.cpu_tensor, rows, local(own_entering), packed);
    metrics_.bytes_host_to_device += packed.size() * sizeof(float);
    if constexpr (data_parallel) {
      std::size_t block = 0;
      for (int r = 0; r < ranks_; ++r) block = std::max(block, part(entering, r).size() * per_column);
      if (block > 0) {
        // Padding past this rank's columns is zero: the all-gather reads the whole block.
        const std::vector<float> zeros(block - packed.size(), 0.0f);
        detail::synchronize_on_unwind<Backend> guard(stream);  // after `zeros`: the copies read it
        float* mine = all + static_cast<std::size_t>(rank_) * block;
        Backend::copy_async(mine, packed.data(), packed.size() * sizeof(float), stream);
        Backend::copy_async(mine + packed.size(), zeros.data(), zeros.size() * sizeof(float), stream);
        comm_->all_gather(std::span<const float>(mine, block),
                          std::span<float>(all, static_cast<std::size_t>(ranks_) * block), stream);
        std::size_t at = 0;
        for (int r = 0; r < ranks_; ++r) {
          const std::size_t n = part(entering, r).size() * per_column;
          Backend::copy_async(entering_dev + at, all + static_cast<std::size_t>(r) * block, n * sizeof(float), stream);
          at += n;
        }
        Backend::synchronize(stream);
      }
    } else {
      Backend::copy_async(entering_dev, packed.data(), packed.size() * sizeof(float), stream);
      Backend::synchronize(stream);
    }
    const std::span<const float> entering_span(entering_dev, entering.size() * per_column);
    if (p.device_index == npos) {
      p.device_index = Backend::add_matrix(device_opt_, p.matrix, selection, entering_span, stream);
    } else {
      const std::span<float> leaving_span(leaving_dev, leaving.size() * per_column);
      Backend::reselect(device_opt_, p.device_index, selection, entering_span, leaving_span, stream);
      // This rank's part of the leaving columns (all of them in one process) back to its CPU.
      const auto own_leaving = part(leaving, rank_);
      const std::size_t skip = static_cast<std::size_t>(own_leaving.data() - leaving.data()) * per_column;
      std::vector<float> back(own_leaving.size() * per_column);
      Backend::copy_async(back.data(), leaving_dev + skip, back.size() * sizeof(float), stream);
      Backend::synchronize(stream);
      detail::unpack_columns(host_opt_, p.cpu_tensor, rows, local(own_leaving), back);
      metrics_.bytes_device_to_host += back.size() * sizeof(float);
    }
  }
  p.cpu_columns = complement_columns(selection, p.matrix.cols);
  p.gpu_columns = std::move(selection);
  setup_buffers(p, stream);
}

// The migration scratch (device memory, float): allocated at the first selection for the largest
// migration any parameter can make (k entering and k leaving columns of every slot, and data
// parallel the all-gather's blocks), then reused: no allocation at a reselection.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
float* basic_coordinator<Backend, HostOptimizer, Communicator>::migration_scratch() {
  std::size_t most = 0;
  for (const auto& p : params_) {
    if (p.is_vector) continue;
    const auto cols = static_cast<std::size_t>(p.matrix.cols);
    const std::size_t k =
        options_.mode == offload_mode::dense ? cols : static_cast<std::size_t>(selector_.k(p.selector_index));
    const std::size_t owned = (cols + static_cast<std::size_t>(ranks_) - 1) / static_cast<std::size_t>(ranks_);
    const std::size_t blocks = data_parallel ? static_cast<std::size_t>(ranks_) * std::min(k, owned) : 0;
    most = std::max(most, (2 * k + blocks) * slots_type::count * static_cast<std::size_t>(p.matrix.rows));
  }
  if (migration_scratch_.bytes() < most * sizeof(float)) migration_scratch_ = device_buffer(most * sizeof(float));
  return reinterpret_cast<float*>(migration_scratch_.data());
}

// Sizes parameter p's CPU-column buffers for its CPU columns (accumulators and copy-out zeroed)
// and uploads their column list. Synchronizes with `stream`.
//
// The CPU columns are cut by owner into `pieces` (rank r's piece: its columns, in order); the
// gradient staging and the write-back staging hold ranks() blocks of `block` elements, the
// largest piece (the equal blocks of reduce_scatter and all_gather; in one process one block, the
// whole of them), and the padding after each piece is zero (the collectives read it). This
// rank's accumulator and copy-out hold its own piece.
//
// The device buffers are allocated once, at the first call (start(), or a checkpoint's load), for
// the most they can ever hold: every column of the parameter on the CPU, in data parallel the
// largest owned range per block. The pieces follow the selection; the buffers stay (on a GPU a
// reallocation is a cudaFree, which waits for the whole device). A parameter whose CPU columns are
// empty (every column selected, which lasts: k is fixed) lets its staging go.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::setup_buffers(parameter& p, stream_type stream) {
  const auto rows = static_cast<std::size_t>(p.matrix.rows);
  const auto cols = static_cast<std::size_t>(p.matrix.cols);
  p.pieces.assign(static_cast<std::size_t>(ranks_) + 1, 0);
  std::size_t largest = 0;
  for (int r = 0; r <= ranks_; ++r) {
    const index_t bound = r == ranks_ ? p.matrix.cols : detail::owned_range(p.matrix.cols, r, ranks_).first;
    p.pieces[r] = static_cast<std::size_t>(std::lower_bound(p.cpu_columns.begin(), p.cpu_columns.end(), bound) -
                                           p.cpu_columns.begin());
    if (r > 0) largest = std::max(largest, p.pieces[r] - p.pieces[r - 1]);
  }
  p.block = largest * rows;
  p.owned_local.assign(p.cpu_columns.begin() + static_cast<std::ptrdiff_t>(p.pieces[rank_]),
                       p.cpu_columns.begin() + static_cast<std::ptrdiff_t>(p.pieces[rank_ + 1]));
  for (auto& c : p.owned_local) c -= static_cast<std::int32_t>(p.owned.first);
  const std::size_t own = p.owned_local.size() * rows;
  // The most elements a staging buffer can hold: ranks blocks of the largest owned range.
  const std::size_t most_owned = (cols + static_cast<std::size_t>(ranks_) - 1) / static_cast<std::size_t>(ranks_);
  const std::size_t staged = p.cpu_columns.empty() ? 0 : static_cast<std::size_t>(ranks_) * most_owned * rows;
  auto reserve = [](device_buffer& b, std::size_t bytes) {
    if (bytes == 0)
      b = device_buffer();
    else if (b.bytes() < bytes)
      b = device_buffer(bytes);
  };
  reserve(p.cpu_columns_dev, cols * sizeof(std::int32_t));
  Backend::copy_async(p.cpu_columns_dev.data(), p.cpu_columns.data(), p.cpu_columns.size() * sizeof(std::int32_t),
                      stream);
  if constexpr (data_parallel) {
    reserve(p.gpu_columns_dev, cols * sizeof(std::int32_t));
    Backend::copy_async(p.gpu_columns_dev.data(), p.gpu_columns.data(), p.gpu_columns.size() * sizeof(std::int32_t),
                        stream);
    reserve(p.selected_stage, p.gpu_columns.size() * rows * dtype_size(p.grad_type));
  }
  // Data parallel: the padding after each rank's piece is zeroed from here (before the guard: the
  // copies read it until the stream is synchronized).
  const std::vector<std::byte> zeros(
      data_parallel ? p.block * std::max(dtype_size(p.grad_type), dtype_size(p.matrix.type)) : 0, std::byte{0});
  detail::synchronize_on_unwind<Backend> guard(stream);
  const bool in_place = expects_in_place(p);  // no accumulator, no write-back staging (stage_late)
  for (int b = 0; b < 2; ++b) {
    reserve((*p.by_step)[b].grad_stage, accumulates_on_stream ? 0 : staged * dtype_size(p.grad_type));
    {  // see accumulator_of; memory more CPU columns needed (before the first selection) is released
      const std::size_t want = !in_place && (b == 0 || options_.overlap_step) ? own : 0;
      if (p.by_interval[b].accumulator.capacity() > want)
        p.by_interval[b].accumulator = std::vector<float>(want, 0.0f);
      else
        p.by_interval[b].accumulator.assign(want, 0.0f);
    }
    p.by_interval[b].accumulated = 0;
    reserve(p.by_interval[b].writeback_dev,
            !in_place && b == staging_parity(b) ? staged * dtype_size(p.matrix.type) : 0);
    if constexpr (data_parallel) {
      for (int r = 0; r < ranks_ && !p.cpu_columns.empty(); ++r) {
        const std::size_t used = (p.pieces[r + 1] - p.pieces[r]) * rows;
        for (auto* buffer : {&(*p.by_step)[b].grad_stage, &p.by_interval[b].writeback_dev}) {
          if (buffer->bytes() == 0) continue;  // a parity without write-back staging (staging_parity)
          const std::size_t esize =
              buffer == &(*p.by_step)[b].grad_stage ? dtype_size(p.grad_type) : dtype_size(p.matrix.type);
          const std::size_t bytes = (p.block - used) * esize;
          Backend::copy_async(buffer->data() + (static_cast<std::size_t>(r) * p.block + used) * esize, zeros.data(),
                              bytes, stream);
        }
      }
    }
  }
  Backend::synchronize(stream);
}

// A parameter set up without an accumulator and write-back staging (expects_in_place) whose step
// is not updated in place (a gradient handed over in another layout): allocates both for interval
// `interval` as setup_buffers would have (one process: accumulates_on_stream).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::stage_late(parameter& p, std::int64_t interval) {
  const std::size_t elements = p.cpu_columns.size() * static_cast<std::size_t>(p.matrix.rows);
  if (accumulator_of(p, interval).size() < elements) accumulator_of(p, interval).assign(elements, 0.0f);
  auto& writeback = writeback_of(p, interval);
  if (writeback.bytes() < elements * dtype_size(p.matrix.type))
    writeback = device_buffer(elements * dtype_size(p.matrix.type));
}

}  // namespace zenflow
