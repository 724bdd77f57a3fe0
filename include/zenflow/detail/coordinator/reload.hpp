// The trainer's edits of its parameters between steps (basic_coordinator::discard_gradients and
// reload_parameter): the values in the trainer's tensors are the truth, so an edited parameter's
// values become the fp32 master of the optimizer that updates each of its columns.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/checkpoint_io.hpp"
#include "zenflow/types.hpp"

namespace zenflow {

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::discard_gradients(stream_type stream) {
  rethrow_worker_error();
  check_stream(stream);
  abandon_step(stream);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::reload_parameter(std::size_t i, stream_type stream) {
  rethrow_worker_error();
  check_stream(stream);
  parameter& p = at(i);
  // The CPU update in flight writes the CPU master (and its result's staging): it completes first.
  (void)host_optimizer();
  or_fail([&] {
    if (p.is_vector) {
      const auto rows = static_cast<std::size_t>(p.vector.size);
      std::vector<std::byte> values(rows * dtype_size(p.vector.type));
      Backend::copy_async(values.data(), p.vector.data, values.size(), stream);
      Backend::synchronize(stream);
      std::vector<float> state(slots_type::count * rows);  // one column: the master first
      device_opt_.export_state(p.device_index, state);
      detail::adopt_values(values, p.vector.type, std::span<float>(state).first(rows), false);
      device_opt_.import_state(p.device_index, state);
      return;
    }
    const auto rows = static_cast<std::size_t>(p.matrix.rows);
    const dtype type = p.matrix.type;
    const std::size_t column_bytes = rows * dtype_size(type);
    // Every column's values, column c at c * column_bytes.
    std::vector<std::byte> values(static_cast<std::size_t>(p.matrix.cols) * column_bytes);
    copy_all_columns(p, values, transfer_direction::device_to_host, stream);
    auto column = [&](index_t c) { return std::span<const std::byte>(values).subspan(c * column_bytes, column_bytes); };
    if (p.device_index != npos) {  // the GPU columns: every slot per selected column, the master first
      constexpr std::size_t slots = slots_type::count;
      std::vector<float> packed(slots * rows * p.gpu_columns.size());
      device_opt_.export_state(p.device_index, packed);
      for (std::size_t l = 0; l < p.gpu_columns.size(); ++l)
        detail::adopt_values(column(p.gpu_columns[l]), type, std::span<float>(packed).subspan(slots * l * rows, rows),
                             false);
      device_opt_.import_state(p.device_index, packed);
    }
    // This rank's CPU columns. With a pending result for this parameter (its CPU columns are the ones
    // the update ran on) the edit wins: every element takes its value, and the
    // write-back will write these values.
    const auto pending_interval = schedule_.pending();
    const bool pending =
        pending_interval && p.by_interval[*pending_interval % 2].accumulated > 0 && !p.cpu_columns.empty();
    // Through the optimizer's export and import: wherever it keeps the master (RAM or an SSD).
    const auto cpu_columns = detail::owned_cpu_columns(p.owned, p.gpu_columns);
    const std::size_t cpu_n = cpu_columns.size() * rows;
    std::vector<float> state(slots_type::count * cpu_n);  // slot after slot: the master first
    host_opt_.export_state(p.cpu_tensor, cpu_columns, state);
    const auto master = std::span<float>(state).first(cpu_n);
    for (std::size_t j = 0; j < cpu_columns.size(); ++j)
      detail::adopt_values(column(cpu_columns[j] + static_cast<std::int32_t>(p.owned.first)), type,
                           master.subspan(j * rows, rows), pending);
    host_opt_.import_state(p.cpu_tensor, cpu_columns, state);
    if (pending) {
      std::vector<std::byte> block(p.owned_local.size() * column_bytes);
      for (std::size_t j = 0; j < p.owned_local.size(); ++j) {
        const auto c = column(p.owned_local[j] + p.owned.first);
        std::copy(c.begin(), c.end(), block.begin() + static_cast<std::ptrdiff_t>(j * column_bytes));
      }
      std::byte* staged =
          writeback_of(p, *pending_interval).data() + static_cast<std::size_t>(rank_) * p.block * dtype_size(type);
      detail::synchronize_on_unwind<Backend> guard(stream);
      Backend::copy_async(staged, block.data(), block.size(), stream);
      Backend::synchronize(stream);
    }
  });
}

}  // namespace zenflow
