// The coordinator's checkpoints: basic_coordinator::save_checkpoint, the helpers it shares with
// the load (checkpoint_load.hpp) and the trainer's edits (reload.hpp), and the layout of the state
// they write (the file's header, scalars and arrays: checkpoint_format.hpp, read through
// checkpoint_reader.hpp).
//
//   offset  size  field
//   0       8     magic "ZENFLOW\x01"
//   8       4     format version (uint32, little endian) = 8
//   12      4     reserved (0)
//   16      8     payload size in bytes (uint64)
//   24      8     CRC32C of the payload (RFC 3720), zero-extended to uint64 (format 7, read
//                 too: the same layout with the FNV-1a 64-bit hash of the payload here)
//   32      ...   payload: a sequence of little-endian scalars and length-prefixed arrays, in the
//                 order written by basic_coordinator::save_checkpoint (below):
//                 the schedule's options, the optimizer's name (H::name), field table
//                 (field_table_text) and state slots (slot_names), the hyper-parameters every
//                 parameter shares, checkpoint_contents, rank and number of ranks (data parallel:
//                 each rank writes its own file), step and interval position, optimizer step
//                 counts, then per parameter its name, its per-group hyper-parameters (in table
//                 order), shape, dtypes, its own step counts (CPU and GPU: the steps that had its
//                 gradient) and accumulated-step counts (current and pending interval), whether its
//                 fp32 master is written, the CPU state of this rank's CPU columns (its columns not
//                 on the GPU) in fp32, one array per slot of the optimizers' state_slots
//                 (state_slots.hpp: the master, then for Adam exp_avg and exp_avg_sq), the
//                 selection, the GPU compact state ([master,] the other slots, per selected
//                 column), the accumulator of this rank's CPU columns (empty while the interval has
//                 no counted step: all zeros), their pending write-back, and with
//                 checkpoint_contents::everything the model's parameter bytes. Each column's state
//                 is written once, from the optimizer that owns it. The master is written with
//                 checkpoint_contents::everything, for a bf16/fp16 parameter, and for an f32
//                 parameter whose master is not exactly its values (outside the columns of a
//                 pending result, whose master is that result); else the loader reads it from the
//                 parameter.
// Version 8 checks the payload with a CRC32C instead of an FNV-1a hash (over ten times faster;
// the layout is version 7's, whose files are still read). Version 7 added the optimizer's name,
// field table and state slots, so that a checkpoint is read only by the optimizer it was written
// for (each parameter's per-group fields follow its table, its state arrays its slots); version 6
// the shared hyper-parameters (in the order of the fields() table); version 5 the contents, the
// master flag and the per-column ownership; version 4 the rank and the number of ranks (data
// parallel); version 3 the per-parameter counts (missing_gradients::skip). Older versions are not
// read.
// Scalars are arithmetic or enum types only (no structs: no padding bytes reach the file); a bool
// is one byte, 0 or 1 (any other value is rejected, never loaded as a bool).
// The file is written to "<path>.tmp" and renamed over <path>, so a process that dies mid-save
// never leaves a torn checkpoint under the real name; a failed write or rename removes the .tmp
// file. Nothing is synced to the disk (as torch.save): after a power loss the file system decides
// what the path holds, and a torn file is refused by its checksum. The reader accepts regular
// files only, checks size, magic and version before any field is parsed, and every length against
// what remains. Neither holds the whole state in memory: the save exports a parameter's CPU state
// a run of columns (checkpoint_run_bytes) at a time, each slot's part written in place
// (checkpoint_writer::begin_arrays), and the load reads the file twice: once to parse and validate
// it (the reader keeps the CRC32C of every part read, then reads the parts the validation skips
// and verifies the whole before anything changes; a corrupted file is named as such, whatever
// check it broke first; an array longer than the reader's buffer is allocated only from a
// verified file), once more to apply the state arrays, a run of columns at a time.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/checkpoint_format.hpp"
#include "zenflow/error.hpp"
#include "zenflow/state_slots.hpp"

namespace zenflow {

namespace detail {
/// This rank's CPU columns: the columns of `owned` not in `selection` (ascending), as columns of
/// its CPU tensor (column c is c - owned.first).
inline std::vector<std::int32_t> owned_cpu_columns(column_range owned, std::span<const std::int32_t> selection) {
  std::vector<std::int32_t> out;
  for (index_t c = owned.first; c < owned.last; ++c)
    if (!std::binary_search(selection.begin(), selection.end(), static_cast<std::int32_t>(c)))
      out.push_back(static_cast<std::int32_t>(c - owned.first));
  return out;
}
/// Whether `master` is exactly the values (elements of `type`, upcast), bit for bit.
inline bool is_value_of(std::span<const std::byte> values, dtype type, std::span<const float> master) {
  bool same = true;
  dispatch_dtype(type, [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t r = 0; r < master.size() && same; ++r) {
      T v;
      std::memcpy(&v, values.data() + r * sizeof(T), sizeof(T));
      const float x = to_float(v);
      same = std::memcmp(&x, &master[r], sizeof(float)) == 0;
    }
  });
  return same;
}
/// master[r] = values[r] upcast, for every r (`always`) or where values[r] (of `type`) differs from
/// master[r] rounded to `type`, bit for bit.
inline void adopt_values(std::span<const std::byte> values, dtype type, std::span<float> master, bool always) {
  dispatch_dtype(type, [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t r = 0; r < master.size(); ++r) {
      T value;
      std::memcpy(&value, values.data() + r * sizeof(T), sizeof(T));
      const T rounded = from_float<T>(master[r]);
      if (always || std::memcmp(&value, &rounded, sizeof(T)) != 0) master[r] = to_float(value);
    }
  });
}
}  // namespace detail

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::copy_all_columns(const parameter& p,
                                                                               std::span<std::byte> values,
                                                                               transfer_direction direction,
                                                                               stream_type stream) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(p.matrix.cols));
  std::iota(all.begin(), all.end(), 0);
  // Every buffer a copy below uses is allocated first and lives until the stream is idle.
  device_buffer all_dev(all.size() * sizeof(std::int32_t));
  device_buffer values_dev(values.size());
  const auto* columns_dev = reinterpret_cast<const std::int32_t*>(all_dev.data());
  detail::synchronize_on_unwind<Backend> guard(stream);
  Backend::copy_async(all_dev.data(), all.data(), all.size() * sizeof(std::int32_t), stream);
  if (direction == transfer_direction::device_to_host) {
    // Gathered with the coordinator's unit flags (scale 1, no skip).
    Backend::gather(const_matrix_view(p.matrix), all, columns_dev, values_dev.data(), p.matrix.type, unit_flags(),
                    stream);
    Backend::copy_async(values.data(), values_dev.data(), values.size(), stream);
  } else {
    Backend::copy_async(values_dev.data(), values.data(), values.size(), stream);
    Backend::scatter(values_dev.data(), p.matrix.type, all, columns_dev, p.matrix, stream);
  }
  Backend::synchronize(stream);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::save_checkpoint(const std::string& path,
                                                                              stream_type stream,
                                                                              checkpoint_contents contents) {
  const device_scope scope(device_);
  rethrow_worker_error();
  check_stream(stream);
  for (const auto& p : params_)
    expects(!p.has_grad, "save_checkpoint", "called between submit_gradient and step for parameter ", p.name);
  // Drain: every offloaded gradient accumulated and every launched CPU update done. A pending
  // result stays pending (it is saved), exactly as in an uninterrupted run.
  const auto pending_interval = schedule_.pending();
  const std::int64_t current_interval = schedule_.interval();
  stall_until(
      [&] {
        return shared_.offloaded_through_step >= step_ - 1 &&
               (!pending_interval || shared_.updated_interval >= *pending_interval);
      },
      "checkpoint");
  Backend::synchronize(stream);
  detail::checkpoint_writer w(path);  // streams to path.tmp: nothing but a buffer is held in memory
  detail::put_options<slots_type>(w, options_);
  w.put(contents);
  w.put<std::int32_t>(rank_);
  w.put<std::int32_t>(ranks_);
  w.put(step_);
  const auto& position = schedule_.position();
  w.put(position.started);
  w.put(position.interval);
  w.put(position.interval_first_step);
  w.put(position.interval_steps);
  w.put(position.target);
  w.put(position.pending);
  w.put(last_overlap_);
  w.put(position.selection_due);
  w.put(host_opt_.step_count());
  w.put(device_opt_.step_count());
  {
    detail::state_lock lock(shared_.mutex);
    auto count = [&](std::int64_t i) { return i >= 0 ? shared_.accumulated_count(i) : std::int64_t{0}; };
    w.put(count(current_interval));
    w.put(pending_interval ? count(*pending_interval) : std::int64_t{0});
  }
  w.put<std::uint64_t>(params_.size());
  const bool everything = contents == checkpoint_contents::everything;
  for (const auto& p : params_) {
    w.put_string(p.name);
    w.put(p.is_vector);
    detail::put_fields(w, p.hyper, true);  // the rest of the hyper-parameters is options().optimizer
    if (p.is_vector) {
      const auto size = static_cast<std::size_t>(p.vector.size);
      w.put(p.vector.size);
      w.put(p.vector.type);
      w.put<std::int64_t>(device_opt_.step_count(p.device_index));
      std::vector<float> state(slots_type::count * size);  // one column: the master first
      device_opt_.export_state(p.device_index, state);
      std::vector<std::byte> bytes(size * dtype_size(p.vector.type));
      Backend::copy_async(bytes.data(), p.vector.data, bytes.size(), stream);
      Backend::synchronize(stream);
      const bool master = everything || p.vector.type != dtype::f32 ||
                          !detail::is_value_of(bytes, p.vector.type, std::span<const float>(state).first(size));
      w.put(master);
      w.put_array<float>(std::span<const float>(state).subspan(master ? 0 : size));
      w.put_array<std::byte>(everything ? std::span<const std::byte>(bytes) : std::span<const std::byte>{});
      continue;
    }
    const auto rows = static_cast<std::size_t>(p.matrix.rows);
    const std::size_t esize = dtype_size(p.matrix.type), k = p.gpu_columns.size();
    w.put(p.matrix.rows);
    w.put(p.matrix.cols);
    w.put(p.matrix.type);
    w.put(p.grad_type);
    w.put<std::int64_t>(p.cpu_steps);
    w.put<std::int64_t>(p.device_index != npos ? device_opt_.step_count(p.device_index) : 0);
    std::int64_t current = 0, pending_count = 0;
    {
      detail::state_lock lock(shared_.mutex);  // drained above; the lock orders the workers' writes
      current = position.started ? p.by_interval[current_interval % 2].accumulated : 0;
      pending_count = pending_interval ? p.by_interval[*pending_interval % 2].accumulated : 0;
    }
    w.put(current);
    w.put(pending_count);
    constexpr std::size_t slots = slots_type::count;
    std::vector<float> compact(slots * k * rows);  // every slot per selected column, the master first
    if (p.device_index != npos) device_opt_.export_state(p.device_index, compact);
    std::vector<std::byte> pending;
    if (pending_interval) {
      // This rank's block of the write-back staging (the whole of it in one process).
      const std::byte* staged = writeback_of(p, *pending_interval).data() + rank_ * p.block * esize;
      pending.resize(owned_piece_elements(p) * esize);
      detail::synchronize_on_unwind<Backend> guard(stream);
      Backend::copy_async(pending.data(), staged, pending.size(), stream);
      Backend::synchronize(stream);
    }
    // The parameter's values: written with everything; an f32 parameter's are compared with its
    // master below. Otherwise (a bf16 or fp16 parameter's optimizer state) they are not read.
    std::vector<std::byte> values;
    if (everything || p.matrix.type == dtype::f32) {
      values.resize(rows * static_cast<std::size_t>(p.matrix.cols) * esize);
      copy_all_columns(p, values, transfer_direction::device_to_host, stream);
    }
    // This rank's CPU columns (its owned columns not on the GPU), as columns of its CPU tensor,
    // exported a run of columns at a time (checkpoint_run_bytes of state): slot after slot, the
    // master first.
    const auto cpu_columns = detail::owned_cpu_columns(p.owned, p.gpu_columns);
    const std::size_t cpu_n = cpu_columns.size() * rows;
    const std::size_t run = std::max<std::size_t>(1, detail::checkpoint_run_bytes / (slots * rows * sizeof(float)));
    std::vector<float> cpu_state(slots * std::min(run, cpu_columns.size()) * rows);
    std::size_t exported = cpu_columns.size();     // the run cpu_state holds (none yet)
    const auto export_run = [&](std::size_t j0) {  // columns [j0, j0 + run): returns their elements
      const std::size_t columns = std::min(run, cpu_columns.size() - j0);
      if (j0 != exported)
        host_opt_.export_state(p.cpu_tensor, std::span<const std::int32_t>(cpu_columns).subspan(j0, columns),
                               std::span<float>(cpu_state).first(slots * columns * rows));
      exported = j0;
      return columns * rows;
    };
    // The master is written unless it is an f32 parameter's values (everywhere but in the columns
    // whose pending result holds it): found out by a first export (a parameter of one run is
    // exported once). A bf16 or fp16 parameter's
    // master is always written, even when it equals the values (after an edit was adopted): the
    // load takes a master from f32 values only.
    bool master = everything || p.matrix.type != dtype::f32;
    if (!master) {
      auto column = [&](std::int32_t c) {
        return std::span<const std::byte>(values).subspan(c * rows * esize, rows * esize);
      };
      const bool in_pending = pending_interval && pending_count > 0;
      for (std::size_t j0 = 0; j0 < cpu_columns.size() && !master; j0 += run) {
        const std::size_t m = export_run(j0);
        for (std::size_t j = j0; j < j0 + m / rows && !master; ++j)
          master = !detail::is_value_of(
              in_pending ? std::span<const std::byte>(pending).subspan(j * rows * esize, rows * esize)
                         : column(cpu_columns[j] + static_cast<std::int32_t>(p.owned.first)),
              p.matrix.type, std::span<const float>(cpu_state).subspan((j - j0) * rows, rows));
      }
      for (std::size_t l = 0; l < k && !master; ++l)
        master = !detail::is_value_of(column(p.gpu_columns[l]), p.matrix.type,
                                      std::span<const float>(compact).subspan(slots * l * rows, rows));
    }
    w.put(master);
    std::array<std::size_t, slots> sizes;
    sizes.fill(cpu_n);
    if (!master) sizes[0] = 0;
    w.begin_arrays<float>(sizes);
    for (std::size_t j0 = 0; j0 < cpu_columns.size(); j0 += run) {
      const std::size_t m = export_run(j0);
      for (std::size_t slot = master ? 0 : 1; slot < slots; ++slot)
        w.put_part(slot, std::span<const float>(cpu_state).subspan(slot * m, m));
    }
    w.end_arrays();
    w.put_array<std::int32_t>(p.gpu_columns);
    if (master) {
      w.put_array<float>(compact);
    } else {  // the other slots of each selected column
      w.begin_array<float>((slots - 1) * k * rows);
      for (std::size_t l = 0; l < k; ++l)
        w.put_elements(std::span<const float>(compact).subspan((slots * l + 1) * rows, (slots - 1) * rows));
    }
    // Nothing is accumulated without a counted step: an empty accumulator is all zeros.
    w.put_array<float>(current > 0 ? std::span<const float>(accumulator_of(p, current_interval))
                                   : std::span<const float>{});
    w.put_array<std::byte>(pending);
    w.put_array<std::byte>(everything ? std::span<const std::byte>(values) : std::span<const std::byte>{});
  }
  w.commit();
}

}  // namespace zenflow
