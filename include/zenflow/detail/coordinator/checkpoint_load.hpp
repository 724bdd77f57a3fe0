// The coordinator's checkpoint load: basic_coordinator::read_checkpoint (load_checkpoint, in
// data_parallel.hpp, frames it for the data-parallel agreement) and the validation of the state it
// reads. The file's layout is documented in checkpoint_io.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/checkpoint_format.hpp"
#include "zenflow/detail/coordinator/checkpoint_io.hpp"
#include "zenflow/detail/coordinator/checkpoint_reader.hpp"
#include "zenflow/error.hpp"
#include "zenflow/state_slots.hpp"

namespace zenflow {

namespace detail {
/// Throws unless one element's own state (slot s + 1's value is value(s), s < Slots::count - 1)
/// is state the optimizers hold (the check their imports make): "parameter '<name>' holds
/// <holder><what> (<slot> <value>, ...) <where()> (<rule>)".
template <state_slots Slots, class Value, class Where>
void expect_valid_state(Value value, const std::string& name, const char* holder, Where where) {
  std::array<float, Slots::count - 1> own{};
  for (std::size_t s = 0; s < own.size(); ++s) own[s] = value(s);
  if (Slots::valid(own.data())) [[likely]]
    return;
  std::string values;
  for (std::size_t s = 0; s < own.size(); ++s) values += concat(s > 0 ? ", " : "", Slots::names[s + 1], " ", own[s]);
  throw error("checkpoint", detail::concat("parameter '", name, "' holds ", holder, Slots::what, " (", values, ") ",
                                           where(), " (", Slots::rule, ")"));
}
/// Elements a validation reads at a time (per array).
inline constexpr std::size_t validation_chunk = std::size_t{1} << 16;
/// expect_valid_state for every element of the slot arrays `own` (slot s + 1's values in own[s],
/// all of one length), read from the file a chunk at a time: "... at element <e>".
template <state_slots Slots>
void expect_valid_states(checkpoint_reader& r, const std::array<checkpoint_array<float>, Slots::count - 1>& own,
                         const std::string& name, const char* holder) {
  if constexpr (Slots::count > 1) {  // (the master alone: nothing to check)
    const std::size_t n = own[0].size;
    std::array<std::vector<float>, Slots::count - 1> chunk;
    for (auto& c : chunk) c.resize(std::min(n, validation_chunk));
    for (std::size_t e0 = 0; e0 < n; e0 += validation_chunk) {
      const std::size_t m = std::min(validation_chunk, n - e0);
      for (std::size_t s = 0; s < own.size(); ++s) r.read(own[s], e0, std::span<float>(chunk[s]).first(m));
      for (std::size_t e = 0; e < m; ++e)
        expect_valid_state<Slots>([&](std::size_t s) { return chunk[s][e]; }, name, holder,
                                  [&] { return concat("at element ", e0 + e); });
    }
  }
}
/// expect_valid_state for every element of a device optimizer's packed state in the file
/// (`compact`: per selected column, [the master,] then the other slots, `rows` each), read a run of
/// columns at a time: "... GPU ... at row <r> of selected column <l>".
template <state_slots Slots>
void expect_valid_compact_state(checkpoint_reader& r, const checkpoint_array<float>& compact, std::size_t rows,
                                bool master, const std::string& name) {
  const std::size_t stride = (master ? Slots::count : Slots::count - 1) * rows;  // per selected column
  if (stride == 0) return;
  const std::size_t k = compact.size / stride, run = std::max<std::size_t>(1, validation_chunk / stride);
  std::vector<float> chunk(std::min(k, run) * stride);
  for (std::size_t l0 = 0; l0 < k; l0 += run) {
    const std::size_t columns = std::min(run, k - l0);
    r.read(compact, l0 * stride, std::span<float>(chunk).first(columns * stride));
    for (std::size_t l = 0; l < columns; ++l)
      for (std::size_t row = 0; row < rows; ++row)
        expect_valid_state<Slots>(
            [&](std::size_t s) { return chunk[l * stride + stride - (Slots::count - 1 - s) * rows + row]; }, name,
            "GPU ", [&] { return concat("at row ", row, " of selected column ", l0 + l); });
  }
}
}  // namespace detail

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::read_checkpoint(detail::checkpoint_reader& r,
                                                                              stream_type stream,
                                                                              checkpoint_match match, int& stage) {
  // (load_checkpoint, in data_parallel.hpp, frames this for the data-parallel agreement.)
  expects(!schedule_.started() && step_ == 0, "load_checkpoint",
          "restore into a freshly constructed coordinator with the same parameters registered, before its first step");
  // Parse and validate everything first: nothing changes unless the whole file is good, and what
  // follows the validation cannot fail on the file's content (only on a backend error, or on a
  // file written in place while it loads). The payload is read twice, a part at a time: to be
  // validated (the reader keeps the checksum of what is read, and verifies the whole before
  // anything is applied: the parts the validation does not read are read for it then), and to be
  // applied. No more of the state is held in memory than the largest parameter's (a state larger
  // than the host's memory, on the NVMe tier, loads).
  detail::check_options<slots_type>(r, options_);
  const auto contents = r.get<checkpoint_contents>();
  expects(contents == checkpoint_contents::everything || contents == checkpoint_contents::optimizer_state, "checkpoint",
          "holds contents ", static_cast<int>(contents), " (0: everything, 1: optimizer state)");
  const bool everything = contents == checkpoint_contents::everything;
  {
    const auto rank = r.get<std::int32_t>(), ranks = r.get<std::int32_t>();
    expects(rank == rank_ && ranks == ranks_, "checkpoint", "was written by rank ", rank, " of ", ranks,
            " data-parallel ranks; this coordinator is rank ", rank_, " of ", ranks_,
            " (resume with the same number of ranks, each rank from its own file)");
  }
  constexpr std::size_t slots = slots_type::count;
  using floats = detail::checkpoint_array<float>;
  using bytes = detail::checkpoint_array<std::byte>;
  struct saved_parameter {  // the arrays: where they are in the file
    floats cpu_p, compact, accumulator, vector_state;
    std::array<floats, slots - 1> cpu_own;  // the CPU state's other slots
    std::vector<std::int32_t> gpu_columns;
    bytes pending, values;
    hyper_parameters_type hyper;
    std::int64_t host_steps = 0, device_steps = 0, current_count = 0, pending_count = 0;
    bool master = true;  // the fp32 master is in the file (else it is the parameter's values)
  };
  const auto step = r.get<std::int64_t>();
  const auto started = r.get<bool>();
  struct {
    std::int64_t index = 0, first_step = 0, steps = 0;
  } interval;
  interval.index = r.get<std::int64_t>();
  interval.first_step = r.get<std::int64_t>();
  interval.steps = r.get<std::int64_t>();
  const auto target = r.get<std::int64_t>();
  const auto pending = r.get<std::int64_t>();
  const auto overlap = r.get<double>();
  const auto selection_due = r.get<bool>();
  const auto host_steps = r.get<std::int64_t>();
  const auto device_steps = r.get<std::int64_t>();
  const auto current_count = r.get<std::int64_t>();
  const auto pending_count = r.get<std::int64_t>();
  // The schedule between two steps (start, step, end_interval, reselect, finish).
  const detail::schedule_position position{started, interval.index, interval.first_step, interval.steps,
                                           target,  pending,        selection_due};
  schedule_.check(position, step, current_count, pending_count, host_steps, device_steps);
  expects(overlap >= 0.0 && overlap <= 1.0, "checkpoint", "holds selection overlap ", overlap, " (not in [0, 1])");
  const auto count = r.get<std::uint64_t>();
  expects(count == params_.size(), "checkpoint", "holds ", count, " parameters, ", params_.size(), " are registered");
  // A selection exists from the first selection on (never in warm-up or ZeRO-Offload, where every
  // column stays on the CPU), for every 2-D parameter at once, with the selector's k columns (all
  // of them in dense mode).
  const bool selection_possible =
      started && options_.mode != offload_mode::zero_offload && step >= options_.full_warm_up_rounds;
  std::size_t selected = 0, unselected = 0, unselected_with_gpu_steps = 0, cpu_column_count = 0;
  std::vector<saved_parameter> saved(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    auto& s = saved[i];
    const auto saved_name = r.get_string();
    expects(match == checkpoint_match::positions || saved_name == p.name, "checkpoint", "parameter ", i, " is '",
            saved_name, "', registered '", p.name, "'");
    const std::string& name = p.name;  // the messages below name the registered parameter
    expects(r.get<bool>() == p.is_vector, "checkpoint", "parameter '", name, "' changed between 1-D and 2-D");
    s.hyper = options_.optimizer;
    detail::get_fields(r, s.hyper, true);
    try {
      s.hyper.validate();
    } catch (const error& e) {
      throw error("checkpoint",
                  detail::concat("parameter '", name, "' has an invalid ", e.argument(), ": ", e.reason()));
    }
    if (p.is_vector) {
      expects(r.get<index_t>() == p.vector.size && r.get<dtype>() == p.vector.type, "checkpoint", "parameter '", name,
              "' has a different size or dtype");
      s.device_steps = r.get<std::int64_t>();
      expects(s.device_steps >= 0 && s.device_steps <= device_steps, "checkpoint", "parameter '", name,
              "' holds GPU step count ", s.device_steps, " (the optimizer's is ", device_steps, ")");
      s.master = r.get<bool>();
      s.vector_state = r.get_array_ref<float>();
      s.values = r.get_array_ref<std::byte>();
      expects(s.master || (!everything && p.vector.type == dtype::f32), "checkpoint", "parameter '", name,
              "' has no fp32 master");
      expects(s.vector_state.size == (s.master ? slots : slots - 1) * static_cast<std::size_t>(p.vector.size) &&
                  s.values.size == (everything ? p.vector.size * dtype_size(p.vector.type) : 0),
              "checkpoint", "parameter '", name, "' has state of the wrong size");
      const auto size = static_cast<std::size_t>(p.vector.size);
      std::array<floats, slots - 1> own;
      for (std::size_t slot = 0; slot < own.size(); ++slot)
        own[slot] = s.vector_state.part(((s.master ? 1 : 0) + slot) * size, size);
      detail::expect_valid_states<slots_type>(r, own, name, "");
      continue;
    }
    const auto rows = r.get<index_t>(), cols = r.get<index_t>();
    const auto type = r.get<dtype>(), grad_type = r.get<dtype>();
    expects(rows == p.matrix.rows && cols == p.matrix.cols && type == p.matrix.type && grad_type == p.grad_type,
            "checkpoint", "parameter '", name, "' has a different shape or dtype");
    s.host_steps = r.get<std::int64_t>();
    s.device_steps = r.get<std::int64_t>();
    s.current_count = r.get<std::int64_t>();
    s.pending_count = r.get<std::int64_t>();
    s.master = r.get<bool>();
    expects(s.master || (!everything && type == dtype::f32), "checkpoint", "parameter '", name, "' has no fp32 master");
    const std::size_t n = static_cast<std::size_t>(rows * cols);
    s.cpu_p = r.get_array_ref<float>();
    for (auto& own : s.cpu_own) own = r.get_array_ref<float>();
    s.gpu_columns = r.get_array<std::int32_t>();
    s.compact = r.get_array_ref<float>();
    s.accumulator = r.get_array_ref<float>();
    s.pending = r.get_array_ref<std::byte>();
    s.values = r.get_array_ref<std::byte>();
    bool sorted =
        std::adjacent_find(s.gpu_columns.begin(), s.gpu_columns.end(), std::greater_equal<>()) == s.gpu_columns.end();
    for (auto c : s.gpu_columns) sorted = sorted && c >= 0 && c < cols;
    const std::size_t k = s.gpu_columns.size();
    const std::size_t expected_k = options_.mode == offload_mode::dense ? static_cast<std::size_t>(cols)
                                   : options_.mode == offload_mode::zero_offload
                                       ? 0
                                       : static_cast<std::size_t>(selector_.k(p.selector_index));
    expects(sorted && (k == 0 || (selection_possible && k == expected_k)), "checkpoint", "parameter '", name,
            "' has a selection of ", k, " columns (expected ", selection_possible ? expected_k : 0,
            ", ascending, each in [0, ", cols, "))");
    (k == 0 ? unselected : selected) += 1;
    if (k == 0 && s.device_steps != 0) ++unselected_with_gpu_steps;
    const std::size_t cpu_cols = static_cast<std::size_t>(cols) - k;
    // This rank's CPU columns: its range minus the selected columns in it.
    const auto selected_owned =
        static_cast<std::size_t>(std::count_if(s.gpu_columns.begin(), s.gpu_columns.end(),
                                               [&](std::int32_t c) { return c >= p.owned.first && c < p.owned.last; }));
    const std::size_t owned_cpu_cols = static_cast<std::size_t>(p.owned.size()) - selected_owned;
    // Its own counts never exceed the optimizers' and intervals' (it may have missed steps); a GPU
    // count exists with GPU columns, accumulated steps with CPU columns (and a pending interval).
    expects(s.host_steps >= 0 && s.host_steps <= host_steps && s.device_steps >= 0 && s.device_steps <= device_steps,
            "checkpoint", "parameter '", name, "' holds step counts ", s.host_steps, " (CPU) and ", s.device_steps,
            " (GPU) inconsistent with the optimizers' ", host_steps, " and ", device_steps);
    expects(s.current_count >= 0 && s.current_count <= current_count && s.pending_count >= 0 &&
                s.pending_count <= pending_count && (cpu_cols > 0 || (s.current_count == 0 && s.pending_count == 0)),
            "checkpoint", "parameter '", name, "' holds accumulated step counts ", s.current_count, " and ",
            s.pending_count, " inconsistent with the interval's ", current_count, " and ", pending_count);
    cpu_column_count += cpu_cols;
    // The CPU state of this rank's CPU columns; an accumulator while the interval has counted
    // steps (the staging buffers exist from the first step on).
    const std::size_t cpu_n = owned_cpu_cols * static_cast<std::size_t>(rows);
    expects(s.cpu_p.size == (s.master ? cpu_n : 0) &&
                std::ranges::all_of(s.cpu_own, [&](const auto& own) { return own.size == cpu_n; }) &&
                s.compact.size == (s.master ? slots : slots - 1) * k * rows &&
                s.accumulator.size == (s.current_count > 0 ? cpu_n : 0) &&
                s.pending.size == (pending < 0 ? 0 : cpu_n * dtype_size(type)) &&
                s.values.size == (everything ? n * dtype_size(type) : 0),
            "checkpoint", "parameter '", name, "' has state of inconsistent sizes");
    // The CPU optimizer takes state it can hold (the check it would make while loading).
    detail::expect_valid_states<slots_type>(r, s.cpu_own, name, "CPU ");
    // So do the GPU columns': a reselection hands them to the CPU optimizer.
    detail::expect_valid_compact_state<slots_type>(r, s.compact, static_cast<std::size_t>(rows), s.master, name);
  }
  expects(r.at_end(), "checkpoint", "has trailing data after the last parameter");
  // Every 2-D parameter is selected at once, except in ZenFlow one that had no gradient at any
  // selection step so far (missing_gradients::skip): it never had GPU columns, so no GPU step.
  const bool may_mix = options_.mode == offload_mode::zenflow && unselected_with_gpu_steps == 0;
  expects(selected == 0 || unselected == 0 || may_mix, "checkpoint", "holds a selection for ", selected, " of ",
          selected + unselected, " 2-D parameters (all or none, but for a parameter that never had a GPU step)");
  expects(unselected_with_gpu_steps == 0, "checkpoint",
          "holds a GPU step count for a 2-D parameter without a selection");
  expects(cpu_column_count > 0 || pending == -1, "checkpoint", "holds a pending CPU update but no CPU columns");
  r.verify();  // the whole payload is what was written (throws before anything changes)
  if constexpr (data_parallel) {
    detail::agreement_position at{step, started, interval.index, interval.first_step, target, pending};
    at.cpu_steps = host_steps;
    at.gpu_steps = device_steps;
    for (const auto& x : saved) at.add(x.gpu_columns, x.hyper, x.host_steps, x.device_steps);
    stage = 1;
    agree(agreement_of(detail::agreement::checkpoint, at));
  }

  // Apply.
  stage = 2;
  agreed_ = true;
  step_ = step;
  schedule_.restore(position);
  last_overlap_ = overlap;
  host_opt_.set_step_count(host_steps);
  {
    detail::state_lock lock(shared_.mutex);
    shared_.accumulated_counts = {};
    shared_.accumulated_count(interval.index) = current_count;
    if (pending >= 0) shared_.accumulated_count(pending) = pending_count;
    shared_.offloaded_through_step = step - 1;
    shared_.stats_ready_step = step - 1;
    shared_.accumulated_interval = interval.index - 1;
    shared_.updated_interval = shared_.launched_interval = interval.index - 1;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto& s = saved[i];
    p.hyper = s.hyper;
    p.device_hyper.reset();  // handed to the device optimizer at the next step
    if (p.is_vector) {
      const auto size = static_cast<std::size_t>(p.vector.size);
      std::vector<float> state(slots * size);  // one column: the master first
      r.read(s.vector_state, 0, std::span<float>(state).last(s.vector_state.size));
      if (everything) {
        const auto values = r.read(s.values);
        Backend::copy_async(p.vector.data, values.data(), values.size(), stream);
        Backend::synchronize(stream);
      } else if (!s.master) {  // the master is the parameter's values
        const auto master = std::span<float>(state).first(size);
        Backend::copy_async(master.data(), p.vector.data, size * sizeof(float), stream);
        Backend::synchronize(stream);
      }
      device_opt_.import_state(p.device_index, state);
      continue;
    }
    const auto rows = static_cast<std::size_t>(p.matrix.rows);
    const std::size_t column_bytes = rows * dtype_size(p.matrix.type);
    const auto cpu_columns = detail::owned_cpu_columns(p.owned, s.gpu_columns);
    const bool from_pending = !s.master && pending >= 0 && s.pending_count > 0;
    // An f32 parameter's master is its values (read from the device here), except where its
    // pending result (f32, exact) holds it; the pending result is read once, for both.
    std::vector<std::byte> values, pending_result = r.read(s.pending);
    if (!s.master) {
      values.resize(static_cast<std::size_t>(p.matrix.cols) * column_bytes);
      copy_all_columns(p, values, transfer_direction::device_to_host, stream);
    }
    // This rank's CPU columns, a run of columns at a time (slot after slot, the master first);
    // those on the GPU keep what the CPU tensor holds (never read: a column leaving the GPU
    // brings its state).
    const std::size_t run = std::max<std::size_t>(1, detail::checkpoint_run_bytes / (slots * rows * sizeof(float)));
    for (std::size_t j0 = 0; j0 < cpu_columns.size(); j0 += run) {
      const std::size_t columns = std::min(run, cpu_columns.size() - j0), m = columns * rows;
      std::vector<float> state(slots * m);
      const auto master = std::span<float>(state).first(m);
      if (s.master) {
        r.read(s.cpu_p, j0 * rows, master);
      } else {
        for (std::size_t j = j0; j < j0 + columns; ++j) {
          const std::size_t at = from_pending ? j * column_bytes : (cpu_columns[j] + p.owned.first) * column_bytes;
          detail::adopt_values(
              std::span<const std::byte>(from_pending ? pending_result : values).subspan(at, column_bytes), dtype::f32,
              master.subspan((j - j0) * rows, rows), true);
        }
      }
      for (std::size_t slot = 1; slot < slots; ++slot)
        r.read(s.cpu_own[slot - 1], j0 * rows, std::span<float>(state).subspan(slot * m, m));
      host_opt_.import_state(p.cpu_tensor, std::span<const std::int32_t>(cpu_columns).subspan(j0, columns), state);
    }
    if (!s.gpu_columns.empty()) {
      // Every slot per selected column, the master first: staged to the device a run of columns
      // at a time.
      const std::size_t per_column = slots * rows, k = s.gpu_columns.size();
      const std::size_t gpu_run = std::max<std::size_t>(1, detail::checkpoint_run_bytes / (per_column * sizeof(float)));
      const std::size_t compact_size = k * per_column;
      device_buffer compact_dev(compact_size * sizeof(float));
      std::vector<float> staged(std::min(gpu_run, k) * per_column);
      for (std::size_t l0 = 0; l0 < k; l0 += gpu_run) {
        const std::size_t columns = std::min(gpu_run, k - l0);
        const auto part = std::span<float>(staged).first(columns * per_column);
        if (s.master) {
          r.read(s.compact, l0 * per_column, part);
        } else {
          for (std::size_t l = l0; l < l0 + columns; ++l) {
            const auto column = part.subspan((l - l0) * per_column, per_column);
            detail::adopt_values(
                std::span<const std::byte>(values).subspan(s.gpu_columns[l] * column_bytes, column_bytes), dtype::f32,
                column.first(rows), true);
            r.read(s.compact, (slots - 1) * l * rows, column.subspan(rows));
          }
        }
        detail::synchronize_on_unwind<Backend> guard(stream);
        Backend::copy_async(compact_dev.data() + l0 * per_column * sizeof(float), part.data(), part.size_bytes(),
                            stream);
        Backend::synchronize(stream);  // (the staging is reused)
      }
      p.device_index = Backend::add_matrix(
          device_opt_, p.matrix, s.gpu_columns,
          std::span<const float>(reinterpret_cast<const float*>(compact_dev.data()), compact_size), stream);
      // Dense mode does not use the selector (whose k may be smaller than every column).
      if (options_.mode == offload_mode::zenflow) selector_.set_selection(p.selector_index, s.gpu_columns);
    }
    // Before the first step a coordinator has no selection, CPU column list or staging buffers
    // yet (start() makes them).
    if (started) {
      p.gpu_columns = s.gpu_columns;
      p.cpu_columns = complement_columns(p.gpu_columns, p.matrix.cols);
      setup_buffers(p, stream);  // zeroes the accumulators: an empty one in the file is all zeros
      if (!s.accumulator.empty()) {
        auto& accumulator = accumulator_of(p, interval.index);
        accumulator.resize(s.accumulator.size);
        r.read(s.accumulator, 0, std::span<float>(accumulator));
      }
      p.by_interval[interval.index % 2].accumulated = s.current_count;
      if (pending >= 0) p.by_interval[pending % 2].accumulated = s.pending_count;
    }
    p.cpu_steps = s.host_steps;
    if (pending >= 0) {
      detail::synchronize_on_unwind<Backend> guard(stream);
      Backend::copy_async(writeback_of(p, pending).data() + rank_ * p.block * dtype_size(p.matrix.type),
                          pending_result.data(), pending_result.size(), stream);
      Backend::synchronize(stream);
    }
    if (everything) {
      values = r.read(s.values);
      copy_all_columns(p, values, transfer_direction::host_to_device, stream);
    }
  }
  device_opt_.set_step_count(device_steps);
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].device_index != npos) device_opt_.set_step_count(params_[i].device_index, saved[i].device_steps);
}

}  // namespace zenflow
