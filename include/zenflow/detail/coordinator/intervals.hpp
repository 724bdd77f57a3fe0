// basic_coordinator's schedule between steps (included by coordinator_impl.hpp): warm-up and
// the start, the auto interval, reselection, the ends and beginnings of intervals, write-backs
// within the staleness bound, beginning and abandoning a step, selection boundaries, and handing
// the CPU columns' gradients to the offload worker.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <utility>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"
#include "zenflow/detail/coordinator/migration.hpp"
#include "zenflow/detail/coordinator/offload_worker.hpp"
#include "zenflow/detail/coordinator/update_worker.hpp"

namespace zenflow {

// --- the schedule --------------------------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::in_warm_up() const noexcept {
  return schedule_.in_warm_up(step_);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::overlapped() const noexcept {
  return schedule_.overlapped(step_);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::has_cpu_columns() const noexcept {
  for (const auto& p : params_)
    if (!p.is_vector && !p.cpu_columns.empty()) return true;
  return false;
}

// Scale 1, no skip: the flags of gathers that do not wait for the step's statistics (a member, so
// no copy of them can outlive their buffer).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const step_flags* basic_coordinator<Backend, HostOptimizer, Communicator>::unit_flags() const noexcept {
  return reinterpret_cast<const step_flags*>(unit_flags_dev_.data());
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::start(stream_type stream) {
  for (auto& p : params_)
    if (!p.is_vector) set_selection(p, {}, stream);  // every column on the CPU until the first selection
  schedule_.start(step_);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
detail::interval_masses basic_coordinator<Backend, HostOptimizer, Communicator>::selection_masses() const {
  // The selection's scores (L1 per column) of the parameters that had a gradient: the GPU
  // columns' and the CPU columns' masses and counts ("auto" interval: schedule::auto_length).
  detail::interval_masses m;
  for (const auto& p : params_) {
    if (p.is_vector || !p.has_grad) continue;  // no gradient: its scores are not this step's
    const auto scores = selector_.scores(p.selector_index);
    if (scores.empty()) continue;
    double sel = 0.0;
    for (std::int32_t c : p.gpu_columns) sel += scores[c];
    const double total = std::accumulate(scores.begin(), scores.end(), 0.0);
    m.important += sel;
    m.unimportant += total - sel;
    m.gpu_columns += static_cast<std::int64_t>(p.gpu_columns.size());
    m.cpu_columns += static_cast<std::int64_t>(p.cpu_columns.size());
  }
  return m;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::reselect(stream_type stream) {
  // A selection change moves optimizer state: first complete and write back every CPU update,
  // so no accumulated gradient is lost and no stale result lands on a column the GPU now owns.
  // Before any of this step's work: the write-back happens at the end of the previous step.
  if (const auto pending = schedule_.pending()) write_back(*pending, stream, "reselection", step_ - 1);
  if (schedule_.interval_steps() > 0) end_interval(stream, /*synchronous=*/true, step_ - 1);
  // A parameter without a gradient is scored from its weights (any view of its shape does: the
  // selector scores every parameter at once), and that selection is not used: it keeps its own.
  std::vector<const_matrix_view> grads;
  for (const auto& p : params_)
    if (!p.is_vector) grads.push_back(p.has_grad ? p.grad_matrix : const_matrix_view(p.matrix));
  if (options_.mode == offload_mode::dense) {
    for (auto& p : params_) {
      if (p.is_vector || !p.gpu_columns.empty()) continue;
      std::vector<std::int32_t> all(static_cast<std::size_t>(p.matrix.cols));
      std::iota(all.begin(), all.end(), 0);
      set_selection(p, std::move(all), stream);
    }
    migration_scratch_ = device_buffer();  // dense mode selects once: every column, for good
  } else {
    Backend::select(selector_, grads, stream);
    double overlap = 0.0;
    std::size_t counted = 0;
    for (auto& p : params_) {
      if (p.is_vector || !p.has_grad) continue;  // no gradient: keeps its selection (or has none yet)
      const auto s = selector_.selected(p.selector_index);
      if (!p.gpu_columns.empty()) {
        overlap += selection_overlap(p.gpu_columns, s);
        ++counted;
      }
      set_selection(p, std::vector<std::int32_t>(s.begin(), s.end()), stream);
    }
    last_overlap_ = counted ? overlap / static_cast<double>(counted) : 1.0;
  }
  metrics_.reselected = true;
  schedule_.selected(schedule_.wants_masses() ? selection_masses() : detail::interval_masses{});
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::end_interval(stream_type stream, bool synchronous,
                                                                           std::int64_t last_step) {
  const std::int64_t i = schedule_.interval();
  const int b = static_cast<int>(i % 2);
  // The CPU update of every parameter with CPU columns, with the hyper-parameters in effect now.
  detail::update_job<Backend, hyper_parameters_type> job;
  job.interval = i;
  job.written_back = &written_back_of(i);
  for (auto& p : params_) {
    if (p.is_vector || p.cpu_columns.empty()) continue;
    detail::update_item<hyper_parameters_type> item;
    item.hyper = p.hyper;
    item.tensor = p.cpu_tensor;
    item.columns = p.owned_local;  // this rank's CPU columns (all of them in one process)
    item.rows = static_cast<std::size_t>(p.matrix.rows);
    item.accumulator = accumulator_of(p, i);
    item.accumulated = &p.by_interval[b].accumulated;
    item.cpu_steps = &p.cpu_steps;
    item.out_type = p.matrix.type;
    // Its block of the write-back's all-gather (the whole buffer in one process).
    item.device_out = writeback_of(p, i).data() + static_cast<std::size_t>(rank_) * p.block * dtype_size(p.matrix.type);
    if (const step_flags* flags = p.by_interval[b].in_place) {
      item.in_place = flags;
      item.gradient = p.grad_matrix.data;
      item.device_out = static_cast<std::byte*>(p.matrix.data);
    }
    job.items.push_back(item);
  }
  {
    detail::state_lock lock(shared_.mutex);
    detail::offload_job<Backend> marker;  // every gradient of interval i has been handed over
    marker.step = last_step;
    marker.interval = i;
    marker.interval_end = true;
    offload_.push(lock, marker);
    update_.push(lock, std::move(job));
    shared_.launched_interval = i;
    if (config_.record_trace) {
      update_record r;
      r.interval = i;
      r.first_step = schedule_.position().interval_first_step;
      r.last_step = last_step;
      r.synchronous = synchronous;
      update_.add_record(lock, r);
    }
  }
  shared_.cv.notify_all();
  metrics_.cpu_update_launched = true;
  // The deadline of the previous interval's update is the end of this one.
  if (const auto pending = schedule_.pending()) write_back(*pending, stream, "staleness bound", last_step);
  if (synchronous)
    write_back(i, stream, "synchronous CPU update", last_step);
  else
    schedule_.awaits_write_back(i);
  begin_interval(i + 1, last_step + 1, stream);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::begin_interval(std::int64_t index,
                                                                             std::int64_t first_step,
                                                                             stream_type stream) {
  if (schedule_.covers_cpu_update(first_step)) schedule_.cover(steps_for_cpu_update(stream));
  interval_began_ = clock::now();
  interval_stalled_ = 0.0;
  schedule_.begin_interval(index, first_step);
  // The interval of this parity two before is written back: its counts are read.
  for (auto& p : params_) {
    p.by_interval[index % 2].accumulated = 0;
    p.by_interval[index % 2].in_place = nullptr;
  }
  detail::state_lock lock(shared_.mutex);
  shared_.accumulated_count(index) = 0;  // the slot of interval index - 4, long written back
}

// cover_cpu_update: the steps the last completed CPU update needs at the ended interval's pace
// (its time less its stalls, per step), 0 when either is unknown; the largest over the ranks (every
// rank begins every interval, so every rank makes this collective at the same point of its calls).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::int64_t basic_coordinator<Backend, HostOptimizer, Communicator>::steps_for_cpu_update(stream_type stream) {
  double update_seconds = 0.0;
  {
    detail::state_lock lock(shared_.mutex);
    update_seconds = shared_.last_update_seconds;
  }
  double step_seconds = 0.0;
  if (interval_began_ && schedule_.interval_steps() > 0) {
    const double elapsed = std::chrono::duration<double>(clock::now() - *interval_began_).count();
    step_seconds = (elapsed - interval_stalled_) / static_cast<double>(schedule_.interval_steps());
  }
  std::int64_t steps = schedule_.steps_for_update(update_seconds, step_seconds);
  if constexpr (data_parallel) {
    collectives_enqueued(stream);  // this step's collectives so far come first
    const std::int64_t mine[1] = {steps};
    steps = or_fail([&] { return all_reduce_to_host<std::int64_t>(mine, reduce_op::max); })[0];
  } else {
    (void)stream;
  }
  return steps;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::write_back(std::int64_t i, stream_type stream,
                                                                         const char* reason, std::int64_t at_end_of) {
  const double stalled = metrics_.stall_seconds;
  stall_until([&] { return shared_.updated_interval >= i; }, reason);
  bool applied;
  {
    detail::state_lock lock(shared_.mutex);
    // Name the disk's share of the stall the step's reason describes: its first (stalled == 0
    // before this wait: the reason is this wait's).
    if (stalled == 0.0 && metrics_.stall_seconds > 0.0 && shared_.last_update_disk_wait > 0.0)
      metrics_.stall_reason += detail::concat(" (the CPU update waited ", shared_.last_update_disk_wait * 1e3,
                                              " ms on its NVMe state file)");
    applied = shared_.accumulated_count(i) > 0;
    update_.mark_written_back(lock, i, at_end_of);
  }
  if (applied) {
    // A parameter without a gradient in the interval had no CPU update: nothing to write back.
    auto written = [&](const parameter& p) {
      return !p.is_vector && !p.cpu_columns.empty() && p.by_interval[i % 2].accumulated != 0;
    };
    if constexpr (data_parallel) {
      grouped([&] {  // every rank's block of every parameter: the columns each owner updated
        for (auto& p : params_) {
          if (!written(p)) continue;
          dispatch_dtype(p.matrix.type, [&](auto tag) {
            using T = decltype(tag);
            T* all = reinterpret_cast<T*>(writeback_of(p, i).data());
            comm_->all_gather(std::span<const T>(all + static_cast<std::size_t>(rank_) * p.block, p.block),
                              std::span<T>(all, static_cast<std::size_t>(ranks_) * p.block), stream);
          });
        }
      });
    }
    for (auto& p : params_) {
      if (!written(p)) continue;
      const std::size_t esize = dtype_size(p.matrix.type);
      metrics_.bytes_host_to_device += owned_piece_elements(p) * esize;
      if (p.by_interval[i % 2].in_place != nullptr) continue;  // the CPU update wrote the parameter
      std::byte* blocks = writeback_of(p, i).data();
      const auto* cpu_columns_dev = reinterpret_cast<const std::int32_t*>(p.cpu_columns_dev.data());
      for (int r = 0; r < ranks_; ++r) {
        const std::size_t first = p.pieces[r], count = p.pieces[r + 1] - first;
        if (count == 0) continue;
        Backend::scatter(blocks + static_cast<std::size_t>(r) * p.block * esize, p.matrix.type,
                         std::span<const std::int32_t>(p.cpu_columns).subspan(first, count), cpu_columns_dev + first,
                         p.matrix, stream);
      }
    }
    Backend::record(written_back_of(i), stream);
  }
  schedule_.written_back(i);
  metrics_.written_back = true;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::begin_step() {
  if (in_step_) return;
  last_metrics_ = metrics_;
  metrics_ = step_metrics{};
  metrics_.step = step_;
  in_step_ = true;
  step_offloaded_ = false;
  // The flags and gradient staging of this step's parity were last used two steps ago.
  stall_until([&] { return shared_.offloaded_through_step >= step_ - 2; }, "offload backpressure");
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::abandon_step(stream_type stream) {
  // Gradients handed over during backward may already be with the offload worker, which waits for
  // this step's flags: give it flags that skip, wait until it has dropped them, then rewind its
  // counters so that the step can run again from the start.
  if (in_step_ && step_offloaded_) {
    const int parity = static_cast<int>(step_ % 2);
    // Host-side write: this parity's flags were last read two steps ago (begin_step waited).
    auto* flags = reinterpret_cast<step_flags*>(by_step_[parity].flags_host.data());
    *flags = step_flags{};
    flags->skip = 1;
    Backend::record(by_step_[parity].stats_ready, stream);  // after the gathers the copies read
    {
      detail::state_lock lock(shared_.mutex);
      shared_.stats_ready_step = step_;
      detail::offload_job<Backend> marker;
      marker.step = step_;
      marker.interval = schedule_.interval();
      offload_.push(lock, marker);  // flags == nullptr: the step is not counted
    }
    shared_.cv.notify_all();
    stall_until([&] { return shared_.offloaded_through_step >= step_; }, "abandoned step");
    detail::state_lock lock(shared_.mutex);
    shared_.offloaded_through_step = shared_.stats_ready_step = step_ - 1;
  }
  for (auto& p : params_) p.has_grad = p.offloaded = false;
  if (in_step_) metrics_ = last_metrics_;
  in_step_ = step_offloaded_ = false;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::selection_boundary() const {
  // (A parameter without a gradient at a selection step gets no selection: it waits for a later
  // selection step at which it has one.)
  return schedule_.selects(step_, [&] {
    detail::selection_facts facts;
    for (const auto& p : params_) {
      if (p.is_vector) continue;
      facts.has_matrices = true;
      (p.gpu_columns.empty() ? facts.dense_unselected : facts.any_selection) = true;
      // Dense mode asks whether a parameter still has no GPU columns, the others whether any has.
      if (options_.mode == offload_mode::dense ? facts.dense_unselected : facts.any_selection) break;
    }
    return facts;
  });
}

// Whether this step's CPU update of p reads its gradient and writes its columns where they are,
// with no copy (can_update_in_place: the CPU update's memory is the trainer's): the step is its
// interval's only one and its CPU update completes within step() (not overlapped; the trainer's
// next forward reads the parameter only after), and p's gradient (fp32) and weights are both
// column-contiguous, the CPU Adam's layout. One step accumulated into the fp32 accumulator is
// g * scale, the product the CPU Adam forms from g with a grad_scale of scale: the same bits as the
// staged path, without its 4 element passes (the accumulator's write and read, the write-back
// staging's write and the scatter's read of it; the scatter's write is the CPU Adam's copy-out).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::updates_in_place(const parameter& p) const noexcept {
  if constexpr (can_update_in_place)
    return schedule_.interval_steps() == 0 && schedule_.ends_with(step_) && !overlapped() &&
           p.grad_type == dtype::f32 && p.grad_matrix.is_column_contiguous() && p.matrix.is_column_contiguous();
  else
    return false;
}

// Whether every CPU update of p is expected to run in place (updates_in_place): ZeRO-Offload, whose
// intervals are all one synchronous step, of a column-contiguous parameter with fp32 gradients.
// Such a parameter gets no accumulator and no write-back staging (8 bytes per element or more)
// unless a step hands over its gradient in another layout (stage_late).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::expects_in_place(const parameter& p) const noexcept {
  return can_update_in_place && options_.mode == offload_mode::zero_offload && p.grad_type == dtype::f32 &&
         p.matrix.is_column_contiguous();
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::offload_gradient(parameter& p, const step_flags* flags,
                                                                               stream_type stream) {
  if constexpr (accumulates_on_stream) {
    const std::int64_t i = schedule_.interval();
    if (updates_in_place(p)) {
      // No columns: the step is only counted (unless skipped), in stream order after its flags.
      Backend::gather_accumulate(p.grad_matrix, {}, nullptr, &p.by_interval[i % 2].accumulated, flags, stream);
      p.by_interval[i % 2].in_place = reinterpret_cast<const step_flags*>(by_step_[step_ % 2].flags_host.data());
    } else {
      stage_late(p, i);
      // Straight into the accumulator on the stream; the worker only waits for it (in step order).
      Backend::gather_accumulate(p.grad_matrix, p.cpu_columns, accumulator_of(p, i).data(),
                                 &p.by_interval[i % 2].accumulated, flags, stream);
    }
  } else {
    // Unscaled (exact in the gradient's dtype): the worker applies the step's clip factor in fp32
    // as it accumulates, as the GPU update applies it (a factor rounded into a bf16/fp16 gradient
    // would lose its small components, or all of an fp16 one).
    (void)flags;
    Backend::gather(p.grad_matrix, p.cpu_columns, reinterpret_cast<const std::int32_t*>(p.cpu_columns_dev.data()),
                    (*p.by_step)[step_ % 2].grad_stage.data(), p.grad_type, unit_flags(), stream);
  }
  hand_over(p, 0, p.cpu_columns.size() * static_cast<std::size_t>(p.matrix.rows) * dtype_size(p.grad_type),
            /*scale_by_flags=*/!accumulates_on_stream, stream);
}

// Hands `bytes` of parameter p's gradient staging, from `offset`, to the offload worker, after the
// work enqueued on `stream` so far (the unscaled gather, or in data parallel the reduce-scatter),
// which the worker multiplies by the step's flags->scale as it accumulates (`scale_by_flags`). An
// empty job still counts the step.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::hand_over(parameter& p, std::size_t offset,
                                                                        std::size_t bytes, bool scale_by_flags,
                                                                        stream_type stream) {
  const int parity = static_cast<int>(step_ % 2);
  // The worker makes its copies wait for this event when it gets to them; a wait enqueued on the
  // offload stream here would also hold back the copies of earlier steps still being submitted.
  // Re-recorded two steps later, after begin_step saw this job consumed.
  Backend::record((*p.by_step)[parity].gathered, stream);
  detail::offload_job<Backend> j;
  j.step = step_;
  j.interval = schedule_.interval();
  j.src = (*p.by_step)[parity].grad_stage.data() + offset;
  j.bytes = bytes;
  j.on_stream = accumulates_on_stream;
  j.type = p.grad_type;
  j.accumulator = accumulator_of(p, schedule_.interval()).data();
  j.accumulated = &p.by_interval[schedule_.interval() % 2].accumulated;
  j.flags = reinterpret_cast<const step_flags*>(by_step_[parity].flags_host.data());
  j.flags_ready = &by_step_[parity].stats_ready;
  j.gathered = &(*p.by_step)[parity].gathered;
  j.scale_by_flags = scale_by_flags;
  {
    detail::state_lock lock(shared_.mutex);
    offload_.push(lock, j);
  }
  shared_.cv.notify_all();
  metrics_.bytes_device_to_host += j.bytes;
  p.offloaded = true;
  step_offloaded_ = true;
}

}  // namespace zenflow
