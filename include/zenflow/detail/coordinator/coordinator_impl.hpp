// Definitions of basic_coordinator (included at the end of coordinator.hpp).
#pragma once

#include <cmath>
#include <numeric>

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
inline std::vector<std::int32_t> set_difference(std::span<const std::int32_t> a, std::span<const std::int32_t> b) {
  std::vector<std::int32_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}
}  // namespace detail

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::start(stream_type stream) {
  started_ = true;
  for (auto& p : params_)
    if (!p.is_vector) set_selection(p, {}, stream);  // every column on the CPU until the first selection
  interval_ = {0, 0, 0};
  interval_target_ = 1;
  if (!warm_up() && !options_.update_interval.is_auto) interval_target_ = options_.update_interval.value;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
std::int64_t basic_coordinator<Backend, HostOptimizer>::auto_interval() const {
  // "auto": the interval ends when the unimportant gradient mass accumulated per CPU column
  // reaches the important mass per GPU column. With the selection's scores (L1 per column) as
  // the per-step masses -- the method's premise is that they change slowly -- that is
  // ceil(important per column / unimportant per column), bounded to [1, max_update_interval] and
  // by the selection interval. No unimportant mass, no CPU or no GPU columns: the bound.
  double important = 0.0, unimportant = 0.0;
  std::int64_t k = 0, rest = 0;
  for (const auto& p : params_) {
    if (p.is_vector) continue;
    const auto scores = selector_.scores(p.selector_index);
    if (scores.empty()) continue;
    double sel = 0.0;
    for (std::int32_t c : p.selection) sel += scores[c];
    const double total = std::accumulate(scores.begin(), scores.end(), 0.0);
    important += sel;
    unimportant += total - sel;
    k += static_cast<std::int64_t>(p.selection.size());
    rest += static_cast<std::int64_t>(p.complement.size());
  }
  const std::int64_t bound = options_.effective_max_update_interval();
  if (k == 0 || rest == 0 || !(unimportant > 0.0)) return bound;
  const double ratio = (important / static_cast<double>(k)) / (unimportant / static_cast<double>(rest));
  const double steps = std::ceil(ratio);
  return std::clamp<std::int64_t>(std::isfinite(steps) ? static_cast<std::int64_t>(std::min(steps, 1e9)) : 1, 1, bound);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::set_selection(parameter& p, std::vector<std::int32_t> selection,
                                                              stream_type stream) {
  const index_t rows = p.matrix.rows;
  const auto entering = detail::set_difference(selection, p.selection);
  const auto leaving = detail::set_difference(p.selection, selection);
  auto params = host_opt_.params(p.cpu_tensor);
  auto m = host_opt_.exp_avg(p.cpu_tensor);
  auto v = host_opt_.exp_avg_sq(p.cpu_tensor);
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

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::reselect(stream_type stream) {
  // A selection change moves optimizer state: first complete and write back every CPU update,
  // so no accumulated gradient is lost and no stale result lands on a column the GPU now owns.
  // Before any of this step's work: the write-back happens at the end of the previous step.
  if (pending_interval_) write_back(*pending_interval_, stream, "reselection", step_ - 1);
  if (interval_.steps > 0) end_interval(stream, /*synchronous=*/true, step_ - 1);
  std::vector<const_matrix_view> grads;
  for (const auto& p : params_)
    if (!p.is_vector) grads.push_back(p.grad_matrix);
  if (options_.mode == offload_mode::dense) {
    for (auto& p : params_) {
      if (p.is_vector || !p.selection.empty()) continue;
      std::vector<std::int32_t> all(static_cast<std::size_t>(p.matrix.cols));
      std::iota(all.begin(), all.end(), 0);
      set_selection(p, std::move(all), stream);
    }
  } else {
    Backend::select(selector_, grads, stream);
    double overlap = 0.0;
    std::size_t counted = 0;
    for (auto& p : params_) {
      if (p.is_vector) continue;
      const auto s = selector_.selected(p.selector_index);
      if (!p.selection.empty()) {
        overlap += selector_.overlap(p.selector_index);
        ++counted;
      }
      set_selection(p, std::vector<std::int32_t>(s.begin(), s.end()), stream);
    }
    last_overlap_ = counted ? overlap / static_cast<double>(counted) : 1.0;
  }
  metrics_.reselected = true;
  selection_due_ = false;
  interval_target_ = options_.update_interval.is_auto ? auto_interval() : options_.update_interval.value;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::end_interval(stream_type stream, bool synchronous,
                                                             std::int64_t last_step) {
  const std::int64_t i = interval_.index;
  {
    std::lock_guard lock(mutex_);
    offload_jobs_.push_back(offload_job{last_step, i, true});
    update_job job{i, synchronous, {}};
    for (const auto& p : params_) job.adam.push_back(p.adam);
    update_jobs_.push_back(std::move(job));
    launched_interval_ = i;
    if (config_.record_trace) {
      update_record r;
      r.interval = i;
      r.first_step = interval_.first_step;
      r.last_step = last_step;
      r.synchronous = synchronous;
      trace_.push_back(r);
    }
  }
  cv_.notify_all();
  metrics_.cpu_update_launched = true;
  // The deadline of the previous interval's update is the end of this one.
  if (pending_interval_) write_back(*pending_interval_, stream, "staleness bound", last_step);
  if (synchronous)
    write_back(i, stream, "synchronous CPU update", last_step);
  else
    pending_interval_ = i;
  begin_interval(i + 1, last_step + 1);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::begin_interval(std::int64_t index, std::int64_t first_step) {
  interval_ = {index, first_step, 0};
  std::lock_guard lock(mutex_);
  accumulated_count(index) = 0;  // the slot of interval index - 4, long written back
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::write_back(std::int64_t i, stream_type stream, const char* reason,
                                                           std::int64_t at_end_of) {
  stall_until([&] { return updated_interval_ >= i; }, reason);
  bool applied;
  {
    std::lock_guard lock(mutex_);
    applied = accumulated_count(i) > 0;
    for (auto& r : trace_)
      if (r.interval == i) {
        r.written_back_at = at_end_of;
        ++r.write_backs;
      }
  }
  if (applied) {
    for (auto& p : params_) {
      if (p.is_vector || p.complement.empty()) continue;
      metrics_.bytes_host_to_device += p.writeback_dev[i % 2].bytes();
      Backend::scatter(p.writeback_dev[i % 2].data(), p.matrix.type, p.complement,
                       reinterpret_cast<const std::int32_t*>(p.complement_dev.data()), p.matrix, stream);
    }
    Backend::record(written_back_[i % 2], stream);
  }
  if (pending_interval_ == i) pending_interval_.reset();
  metrics_.written_back = true;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::begin_step() {
  if (in_step_) return;
  last_metrics_ = metrics_;
  metrics_ = step_metrics{};
  metrics_.step = step_;
  in_step_ = true;
  step_offloaded_ = false;
  // The flags and gradient staging of this step's parity were last used two steps ago.
  stall_until([&] { return offloaded_through_step_ >= step_ - 2; }, "offload backpressure");
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::abandon_step(stream_type stream) {
  // Gradients handed over during backward may already be with the offload worker, which waits for
  // this step's flags: give it flags that skip, wait until it has dropped them, then rewind its
  // counters so that the step can run again from the start.
  if (in_step_ && step_offloaded_) {
    const int parity = static_cast<int>(step_ % 2);
    // Host-side write: this parity's flags were last read two steps ago (begin_step waited).
    auto* flags = reinterpret_cast<step_flags*>(flags_host_[parity].data());
    *flags = step_flags{};
    flags->skip = 1;
    Backend::record(stats_ready_[parity], stream);  // after the gathers the copies read
    {
      std::lock_guard lock(mutex_);
      stats_ready_step_ = step_;
      offload_job marker;
      marker.step = step_;
      marker.interval = interval_.index;
      offload_jobs_.push_back(marker);  // flags == nullptr: the step is not counted
    }
    cv_.notify_all();
    stall_until([&] { return offloaded_through_step_ >= step_; }, "abandoned step");
    std::lock_guard lock(mutex_);
    offloaded_through_step_ = stats_ready_step_ = step_ - 1;
  }
  for (auto& p : params_) p.has_grad = p.offloaded = false;
  if (in_step_) metrics_ = last_metrics_;
  in_step_ = step_offloaded_ = false;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
bool basic_coordinator<Backend, HostOptimizer>::selection_boundary() const {
  if (warm_up()) return false;
  if (selection_due_) return true;
  for (const auto& p : params_)
    if (!p.is_vector && p.selection.empty()) return true;  // the first step after warm-up
  // The policy counts from the end of warm-up (its step 0 is the first selection).
  return options_.mode == offload_mode::zenflow && policy_.should_select(step_ - options_.full_warm_up_rounds);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::offload_gradient(parameter& p, const step_flags* scale,
                                                                 stream_type stream) {
  const int parity = static_cast<int>(step_ % 2);
  Backend::gather(p.grad_matrix, p.complement, reinterpret_cast<const std::int32_t*>(p.complement_dev.data()),
                  p.grad_stage[parity].data(), p.grad_type, scale, stream);
  // The worker makes its copies wait for this event when it gets to them; a wait enqueued on the
  // offload stream here would also hold back the copies of earlier steps still being submitted.
  // Re-recorded two steps later, after begin_step saw this job consumed.
  Backend::record((*p.gathered)[parity], stream);
  offload_job j;
  j.step = step_;
  j.interval = interval_.index;
  j.src = p.grad_stage[parity].data();
  j.bytes = p.grad_stage[parity].bytes();
  j.type = p.grad_type;
  j.accumulator = p.accumulator[interval_.index % 2].data();
  j.flags = reinterpret_cast<const step_flags*>(flags_host_[parity].data());
  j.gathered = &(*p.gathered)[parity];
  {
    std::lock_guard lock(mutex_);
    offload_jobs_.push_back(j);
  }
  cv_.notify_all();
  metrics_.bytes_device_to_host += j.bytes;
  p.offloaded = true;
  step_offloaded_ = true;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
const step_metrics& basic_coordinator<Backend, HostOptimizer>::step(stream_type stream) {
  rethrow_worker_error();
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].has_grad) {
      abandon_step(stream);
      expects(false, "step", "no gradient was submitted for parameter ", i, " (", params_[i].name, ") in step ", step_,
              "; the step's gradients were dropped: submit all of them again");
    }
  or_fail([&] { run_step(stream); });
  return metrics_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::run_step(stream_type stream) {
  if (!started_) start(stream);
  begin_step();
  const int parity = static_cast<int>(step_ % 2);

  // 1. Statistics (global norm for clipping, non-finite check). The flags go to the device (for
  //    this step's kernels) and straight into host memory (for the offload worker, once
  //    stats_ready_ completed): no copy on the trainer's stream.
  std::vector<const_matrix_view> all_matrices, device_matrices;
  std::vector<const_vector_view> vectors;
  for (const auto& p : params_) {
    if (p.is_vector)
      vectors.push_back(p.grad_vector);
    else
      all_matrices.push_back(p.grad_matrix);
  }
  auto* flags_dev = reinterpret_cast<step_flags*>(flags_dev_[parity].data());
  auto* flags_host = reinterpret_cast<const step_flags*>(flags_host_[parity].data());
  Backend::step_statistics(all_matrices, vectors, options_.max_grad_norm, flags_dev,
                           reinterpret_cast<step_flags*>(flags_host_[parity].device_data()), statistics_scratch_.data(),
                           stream);

  // 2. Selection boundary: the first step after warm-up, then as the policy says. A selection
  //    synchronizes anyway; it first reads the flags, and a skipped step does not select (its
  //    scores are not finite): the selection waits for the next finite step.
  if (selection_boundary()) {
    Backend::synchronize(stream);
    if (flags_host->skip)
      selection_due_ = true;
    else
      reselect(stream);
  }

  // 3. The GPU update of the selected columns and the 1-D parameters, with the hyper-parameters
  //    set before this step (handed over in stream order, where they changed).
  for (auto& p : params_) {
    if (p.device_index == npos) continue;
    if (!p.is_vector) device_matrices.push_back(p.grad_matrix);
    if (p.device_adam != p.adam) {
      Backend::set_options(device_opt_, p.device_index, p.adam, stream);
      p.device_adam = p.adam;
    }
  }
  if (device_opt_.parameter_count() > 0) Backend::device_step(device_opt_, device_matrices, vectors, flags_dev, stream);

  Backend::record(stats_ready_[parity], stream);
  {
    std::lock_guard lock(mutex_);
    stats_ready_step_ = step_;
  }
  cv_.notify_all();

  // 4. Offload the CPU columns not handed over during backward: gathered scaled by the step's
  //    clip factor, then the end-of-step marker.
  for (auto& p : params_)
    if (!p.is_vector && !p.complement.empty() && !p.offloaded) offload_gradient(p, flags_dev, stream);
  {
    std::lock_guard lock(mutex_);
    offload_job marker;  // end of this step's gradients
    marker.step = step_;
    marker.interval = interval_.index;
    marker.flags = step_offloaded_ ? flags_host : nullptr;
    offload_jobs_.push_back(marker);
  }
  cv_.notify_all();
  ++interval_.steps;

  // 5. Interval boundary: CPU update (async with overlap_step), write-back within the bound.
  if (warm_up() || interval_.steps >= interval_target_) {
    if (has_cpu_columns())
      end_interval(stream, /*synchronous=*/!overlapped(), step_);
    else
      begin_interval(interval_.index + 1, step_ + 1);
  }
  for (auto& p : params_) p.has_grad = p.offloaded = false;
  in_step_ = false;
  ++step_;
  // Leaving warm-up: the next interval follows the options.
  if (!warm_up() && !options_.update_interval.is_auto && interval_.steps == 0)
    interval_target_ = options_.update_interval.value;

  metrics_.selection_overlap = last_overlap_;
  metrics_.interval = interval_target_;
  {
    std::lock_guard lock(mutex_);
    metrics_.cpu_update_seconds = last_update_seconds_;
  }
  if constexpr (Backend::device_space == memory_space::host) Backend::record(step_done_, stream);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::finish(stream_type stream) {
  rethrow_worker_error();
  abandon_step(stream);
  or_fail([&] {
    if (pending_interval_) write_back(*pending_interval_, stream, "finish", step_ - 1);
    if (interval_.steps > 0 && has_cpu_columns()) end_interval(stream, /*synchronous=*/true, step_ - 1);
    Backend::synchronize(stream);
  });
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::offload_loop() {
  struct in_flight {
    offload_job job;
    std::size_t offset;
    std::size_t bytes;
  };
  std::deque<in_flight> flight;
  auto consume_one = [&] {
    auto slot = d2h_.next();
    const in_flight f = flight.front();
    flight.pop_front();
    // A gradient handed over during backward can land before step() has produced the step's
    // flags: wait for them (abandoned at shutdown: then nothing is accumulated).
    bool have_flags;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stats_ready_step_ >= f.job.step || stopping_ || failed_; });
      have_flags = stats_ready_step_ >= f.job.step;
    }
    if (!have_flags) {
      d2h_.release(slot);
      return;
    }
    Backend::synchronize(stats_ready_[f.job.step % 2]);
    // The CPU Adam's SIMD accumulate kernel, on this thread alone: the pool belongs to the update
    // worker, which may be running the previous interval's update right now.
    if (!f.job.flags->skip)
      detail::cpu_accumulate_kernel(cpu_isa::automatic, f.job.accumulator + f.offset / dtype_size(f.job.type),
                                    slot.data, f.job.type, f.bytes / dtype_size(f.job.type), 1.0f);
    d2h_.release(slot);
  };
  std::exception_ptr error;
  try {
    for (;;) {
      offload_job job;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || failed_ || !offload_jobs_.empty(); });
        if (failed_ || offload_jobs_.empty()) break;  // stopping with nothing left
        job = offload_jobs_.front();
        offload_jobs_.pop_front();
      }
      if (job.src == nullptr) {
        // A marker: everything before it must be accumulated first.
        while (!flight.empty()) consume_one();
        std::lock_guard lock(mutex_);
        if (job.interval_end) {
          accumulated_interval_ = job.interval;
        } else {
          if (job.flags != nullptr && !job.flags->skip) {
            ++accumulated_count(job.interval);
          }
          offloaded_through_step_ = job.step;
        }
        cv_.notify_all();
        continue;
      }
      const std::size_t chunk = d2h_.slot_bytes() - d2h_.slot_bytes() % 4;
      Backend::wait(offload_stream_.get(), *job.gathered);  // the copies below read the gathered gradient
      for (std::size_t off = 0; off < job.bytes; off += chunk) {
        const std::size_t n = std::min(chunk, job.bytes - off);
        auto slot = d2h_.try_acquire();
        while (!slot) {
          if (!flight.empty()) consume_one();
          slot = d2h_.try_acquire();
          if (!slot && flight.empty()) slot = d2h_.acquire();
        }
        d2h_.submit_device_to_host(*slot, job.src + off, n, Backend::queue_stream(offload_stream_.get()));
        flight.push_back({job, off, n});
      }
    }
    while (!flight.empty()) consume_one();
  } catch (...) {
    error = std::current_exception();
  }
  // Published after the handler has ended, so that this thread holds no reference to the
  // exception once the trainer may rethrow and free it.
  if (error) fail(std::move(error));
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::update_loop() {
  std::exception_ptr error;
  try {
    for (;;) {
      update_job job;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || failed_ || !update_jobs_.empty(); });
        if (failed_ || update_jobs_.empty()) break;
        job = update_jobs_.front();
        update_jobs_.pop_front();
        // Every gradient of the interval must be accumulated.
        cv_.wait(lock, [&] { return failed_ || stopping_ || accumulated_interval_ >= job.interval; });
        if (accumulated_interval_ < job.interval) break;
      }
      run_update(job);
    }
  } catch (...) {
    error = std::current_exception();
  }
  // Published after the handler has ended, so that this thread holds no reference to the
  // exception once the trainer may rethrow and free it.
  if (error) fail(std::move(error));
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::run_update(const update_job& job) {
  const auto t0 = clock::now();
  const int b = static_cast<int>(job.interval % 2);
  std::int64_t count;
  {
    std::lock_guard lock(mutex_);
    count = accumulated_count(job.interval);
  }
  if (count > 0) {
    // The write-back of interval i-2 read writeback_dev[b]: it must have run before we refill it.
    Backend::synchronize(written_back_[b]);
    std::vector<cpu_adam_task> tasks;
    for (auto& p : params_) {
      if (p.is_vector || p.complement.empty()) continue;
      cpu_adam_task t{};
      t.options = &job.adam[static_cast<std::size_t>(&p - params_.data())];
      t.tensor = p.cpu_tensor;
      t.grad = p.accumulator[b].data();
      t.grad_type = dtype::f32;
      t.columns = p.complement;
      t.grad_compact = true;
      t.copy_out = p.out_stage[b].data();
      t.copy_out_type = p.matrix.type;
      t.out_compact = true;
      tasks.push_back(t);
    }
    host_opt_.step(tasks, 1.0f / static_cast<float>(count), /*check_finite=*/false);
    for (auto& p : params_) {
      if (p.is_vector || p.complement.empty()) continue;
      pipelined_copy_to_device(h2d_, p.writeback_dev[b].data(), p.out_stage[b].data(), p.out_stage[b].size(),
                               Backend::queue_stream(writeback_stream_.get()));
      std::fill(p.accumulator[b].begin(), p.accumulator[b].end(), 0.0f);
    }
    Backend::synchronize(writeback_stream_.get());
  }
  std::lock_guard lock(mutex_);
  last_update_seconds_ = std::chrono::duration<double>(clock::now() - t0).count();
  for (auto& r : trace_)
    if (r.interval == job.interval) r.accumulated_steps = count;
  updated_interval_ = job.interval;
  cv_.notify_all();
}

}  // namespace zenflow

namespace zenflow {

namespace detail {
/// The options a checkpoint must be resumed with (a mismatch is rejected), field by field (no
/// struct padding reaches the file).
inline void put_options(checkpoint_writer& w, const zenflow_options& o) {
  w.put(static_cast<std::uint8_t>(o.mode));
  w.put(o.topk_ratio);
  w.put(static_cast<std::uint8_t>(o.resolved_strategy()));
  w.put(o.select_interval_steps());
  w.put(o.update_interval.is_auto);
  w.put(o.update_interval.value);
  w.put(o.full_warm_up_rounds);
  w.put(o.overlap_step);
  w.put(o.max_update_interval);
}
inline void check_options(checkpoint_reader& r, const zenflow_options& o) {
  bool same = r.get<std::uint8_t>() == static_cast<std::uint8_t>(o.mode);
  same = (r.get<float>() == o.topk_ratio) && same;
  same = (r.get<std::uint8_t>() == static_cast<std::uint8_t>(o.resolved_strategy())) && same;
  same = (r.get<std::int64_t>() == o.select_interval_steps()) && same;
  same = (r.get<bool>() == o.update_interval.is_auto) && same;
  same = (r.get<std::int64_t>() == o.update_interval.value) && same;
  same = (r.get<std::int64_t>() == o.full_warm_up_rounds) && same;
  same = (r.get<bool>() == o.overlap_step) && same;
  same = (r.get<std::int64_t>() == o.max_update_interval) && same;
  expects(same, "checkpoint", "was written with different zenflow options (mode, topk_ratio, intervals, warm-up or ",
          "overlap_step)");
}

/// Waits for `stream` if the scope is left by an exception, so that copies already enqueued
/// never outlive the buffers declared before this guard. Never throws.
template <class Backend>
class synchronize_on_unwind {
 public:
  explicit synchronize_on_unwind(typename Backend::stream_type stream) noexcept : stream_(stream) {}
  synchronize_on_unwind(const synchronize_on_unwind&) = delete;
  synchronize_on_unwind& operator=(const synchronize_on_unwind&) = delete;
  ~synchronize_on_unwind() {
    if (std::uncaught_exceptions() <= exceptions_) return;
    try {
      Backend::synchronize(stream_);
    } catch (...) {
    }
  }

 private:
  typename Backend::stream_type stream_;
  int exceptions_ = std::uncaught_exceptions();
};
}  // namespace detail

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::save_checkpoint(const std::string& path, stream_type stream) {
  rethrow_worker_error();
  for (const auto& p : params_)
    expects(!p.has_grad, "save_checkpoint", "called between submit_gradient and step for parameter ", p.name);
  // Drain: every offloaded gradient accumulated and every launched CPU update done. A pending
  // result stays pending (it is saved), exactly as in an uninterrupted run.
  stall_until(
      [&] {
        return offloaded_through_step_ >= step_ - 1 && (!pending_interval_ || updated_interval_ >= *pending_interval_);
      },
      "checkpoint");
  Backend::synchronize(stream);
  detail::checkpoint_writer w;
  detail::put_options(w, options_);
  w.put(step_);
  w.put(started_);
  w.put(interval_.index);
  w.put(interval_.first_step);
  w.put(interval_.steps);
  w.put(interval_target_);
  w.put<std::int64_t>(pending_interval_ ? *pending_interval_ : -1);
  w.put(last_overlap_);
  w.put(selection_due_);
  w.put(host_opt_.step_count());
  w.put(device_opt_.step_count());
  {
    std::lock_guard lock(mutex_);
    auto count = [&](std::int64_t i) { return i >= 0 ? accumulated_count(i) : std::int64_t{0}; };
    w.put(count(interval_.index));
    w.put(pending_interval_ ? count(*pending_interval_) : std::int64_t{0});
  }
  w.put<std::uint64_t>(params_.size());
  // The values are gathered with the coordinator's own unit flags (scale 1, no skip): a member,
  // so no copy of the flags can outlive their buffer.
  const auto* identity = reinterpret_cast<const step_flags*>(unit_flags_dev_.data());
  for (const auto& p : params_) {
    w.put_string(p.name);
    w.put(p.is_vector);
    w.put(p.adam.lr);  // the rest of the hyper-parameters is options().adam
    w.put(p.adam.weight_decay);
    if (p.is_vector) {
      w.put(p.vector.size);
      w.put(p.vector.type);
      std::vector<float> state(3 * static_cast<std::size_t>(p.vector.size));
      device_opt_.export_state(p.device_index, state);
      w.put_array<float>(state);
      std::vector<std::byte> bytes(p.vector.size * dtype_size(p.vector.type));
      Backend::copy_async(bytes.data(), p.vector.data, bytes.size(), stream);
      Backend::synchronize(stream);
      w.put_array<std::byte>(bytes);
      continue;
    }
    w.put(p.matrix.rows);
    w.put(p.matrix.cols);
    w.put(p.matrix.type);
    w.put(p.grad_type);
    w.put_array<float>(host_opt_.params(p.cpu_tensor));
    w.put_array<float>(host_opt_.exp_avg(p.cpu_tensor));
    w.put_array<float>(host_opt_.exp_avg_sq(p.cpu_tensor));
    w.put_array<std::int32_t>(p.selection);
    std::vector<float> compact;
    if (p.device_index != npos) {
      compact.resize(3 * p.selection.size() * static_cast<std::size_t>(p.matrix.rows));
      device_opt_.export_state(p.device_index, compact);
    }
    w.put_array<float>(compact);
    w.put_array<float>(p.accumulator[interval_.index % 2]);
    // Every buffer a copy below uses is allocated first and lives until the stream is idle.
    const device_buffer* pending_dev = pending_interval_ ? &p.writeback_dev[*pending_interval_ % 2] : nullptr;
    std::vector<std::byte> pending(pending_dev ? pending_dev->bytes() : 0);
    // The model's parameter values, element by element (the view may be strided).
    std::vector<std::int32_t> all(static_cast<std::size_t>(p.matrix.cols));
    std::iota(all.begin(), all.end(), 0);
    device_buffer all_dev(all.size() * sizeof(std::int32_t));
    device_buffer values_dev(p.matrix.rows * p.matrix.cols * dtype_size(p.matrix.type));
    std::vector<std::byte> values(values_dev.bytes());
    {
      detail::synchronize_on_unwind<Backend> guard(stream);
      if (pending_dev) Backend::copy_async(pending.data(), pending_dev->data(), pending.size(), stream);
      Backend::copy_async(all_dev.data(), all.data(), all.size() * sizeof(std::int32_t), stream);
      Backend::gather(const_matrix_view(p.matrix), all, reinterpret_cast<const std::int32_t*>(all_dev.data()),
                      values_dev.data(), p.matrix.type, identity, stream);
      Backend::copy_async(values.data(), values_dev.data(), values.size(), stream);
      Backend::synchronize(stream);
    }
    w.put_array<std::byte>(pending);
    w.put_array<std::byte>(values);
  }
  w.write(path);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer>
void basic_coordinator<Backend, HostOptimizer>::load_checkpoint(const std::string& path, stream_type stream) {
  rethrow_worker_error();
  expects(!started_ && step_ == 0, "load_checkpoint",
          "restore into a freshly constructed coordinator with the same parameters registered, before its first step");
  // Parse and validate everything first: nothing changes unless the whole file is good, and what
  // follows the validation cannot fail on the file's content (only on a backend error).
  detail::checkpoint_reader r(path);
  detail::check_options(r, options_);
  struct saved_parameter {
    std::vector<float> cpu_p, cpu_m, cpu_v, compact, accumulator, vector_state;
    std::vector<std::int32_t> selection;
    std::vector<std::byte> pending, values;
    adam_options adam;
  };
  const auto step = r.get<std::int64_t>();
  const auto started = r.get<bool>();
  interval_state interval;
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
  // The schedule between two steps (start, step, end_interval, reselect, finish):
  // - nothing has happened before the first step; every interval spans at least one step, and
  //   the current one began `steps` steps ago;
  expects(step >= 0 && (started || step == 0) && interval.index >= 0 && interval.first_step >= interval.index &&
              interval.first_step <= step && interval.steps == step - interval.first_step,
          "checkpoint", "holds an inconsistent position: step ", step, ", interval ", interval.index, " begun at step ",
          interval.first_step, " with ", interval.steps, " steps");
  // - an interval ends when it reaches its target: 1 in warm-up and before the first step, else the
  //   fixed update_interval, or with "auto" a count in [1, max_update_interval];
  const std::int64_t max_target =
      options_.update_interval.is_auto ? options_.effective_max_update_interval() : options_.update_interval.value;
  expects(target >= 1 && target <= max_target && interval.steps < target && (started || target == 1), "checkpoint",
          "holds an update interval target of ", target, " with ", interval.steps, " steps done (options allow 1 to ",
          max_target, ")");
  // - only the interval before the current one can await its write-back, and only when ZenFlow
  //   overlaps the CPU update;
  const bool overlapping = options_.mode == offload_mode::zenflow && options_.overlap_step;
  expects(pending == -1 || (overlapping && pending == interval.index - 1), "checkpoint", "holds pending interval ",
          pending, " in interval ", interval.index, overlapping ? "" : " (these options never leave one pending)");
  // - counts never exceed what they count: non-skipped steps of an interval, one CPU update per
  //   ended interval, one GPU update per step;
  expects(current_count >= 0 && current_count <= interval.steps && pending_count >= 0 &&
              (pending >= 0 ? pending_count <= interval.first_step : pending_count == 0),
          "checkpoint", "holds accumulated step counts ", current_count, " and ", pending_count,
          " inconsistent with its interval position");
  expects(host_steps >= 0 && host_steps <= interval.index && device_steps >= 0 && device_steps <= step, "checkpoint",
          "holds optimizer step counts ", host_steps, " (CPU) and ", device_steps, " (GPU) for ", interval.index,
          " intervals and ", step, " steps");
  expects(overlap >= 0.0 && overlap <= 1.0, "checkpoint", "holds selection overlap ", overlap, " (not in [0, 1])");
  const auto count = r.get<std::uint64_t>();
  expects(count == params_.size(), "checkpoint", "holds ", count, " parameters, ", params_.size(), " are registered");
  // A selection exists from the first selection on (never in warm-up or ZeRO-Offload, where every
  // column stays on the CPU), for every 2-D parameter at once, with the selector's k columns (all
  // of them in dense mode).
  const bool selection_possible =
      started && options_.mode != offload_mode::zero_offload && step >= options_.full_warm_up_rounds;
  std::size_t selected = 0, unselected = 0, cpu_columns = 0;
  std::vector<saved_parameter> saved(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    auto& s = saved[i];
    const auto name = r.get_string();
    expects(name == p.name, "checkpoint", "parameter ", i, " is '", name, "', registered '", p.name, "'");
    expects(r.get<bool>() == p.is_vector, "checkpoint", "parameter '", name, "' changed between 1-D and 2-D");
    s.adam = options_.adam;
    s.adam.lr = r.get<float>();
    s.adam.weight_decay = r.get<float>();
    expects(std::isfinite(s.adam.lr) && s.adam.lr >= 0.0f && std::isfinite(s.adam.weight_decay) &&
                s.adam.weight_decay >= 0.0f,
            "checkpoint", "parameter '", name, "' has an invalid lr or weight_decay");
    if (p.is_vector) {
      expects(r.get<index_t>() == p.vector.size && r.get<dtype>() == p.vector.type, "checkpoint", "parameter '", name,
              "' has a different size or dtype");
      s.vector_state = r.get_array<float>();
      s.values = r.get_array<std::byte>();
      expects(s.vector_state.size() == 3 * static_cast<std::size_t>(p.vector.size) &&
                  s.values.size() == p.vector.size * dtype_size(p.vector.type),
              "checkpoint", "parameter '", name, "' has state of the wrong size");
      continue;
    }
    const auto rows = r.get<index_t>(), cols = r.get<index_t>();
    const auto type = r.get<dtype>(), grad_type = r.get<dtype>();
    expects(rows == p.matrix.rows && cols == p.matrix.cols && type == p.matrix.type && grad_type == p.grad_type,
            "checkpoint", "parameter '", name, "' has a different shape or dtype");
    const std::size_t n = static_cast<std::size_t>(rows * cols);
    s.cpu_p = r.get_array<float>();
    s.cpu_m = r.get_array<float>();
    s.cpu_v = r.get_array<float>();
    s.selection = r.get_array<std::int32_t>();
    s.compact = r.get_array<float>();
    s.accumulator = r.get_array<float>();
    s.pending = r.get_array<std::byte>();
    s.values = r.get_array<std::byte>();
    bool sorted =
        std::adjacent_find(s.selection.begin(), s.selection.end(), std::greater_equal<>()) == s.selection.end();
    for (auto c : s.selection) sorted = sorted && c >= 0 && c < cols;
    const std::size_t k = s.selection.size();
    const std::size_t expected_k = options_.mode == offload_mode::dense ? static_cast<std::size_t>(cols)
                                   : options_.mode == offload_mode::zero_offload
                                       ? 0
                                       : static_cast<std::size_t>(selector_.k(p.selector_index));
    expects(sorted && (k == 0 || (selection_possible && k == expected_k)), "checkpoint", "parameter '", name,
            "' has a selection of ", k, " columns (expected ", selection_possible ? expected_k : 0,
            ", ascending, each in [0, ", cols, "))");
    (k == 0 ? unselected : selected) += 1;
    const std::size_t cpu_cols = static_cast<std::size_t>(cols) - k;
    cpu_columns += cpu_cols;
    // The accumulator and staging buffers exist from the first step on.
    expects(s.cpu_p.size() == n && s.cpu_m.size() == n && s.cpu_v.size() == n && s.compact.size() == 3 * k * rows &&
                s.accumulator.size() == (started ? cpu_cols * rows : 0) &&
                s.pending.size() == (pending < 0 ? 0 : cpu_cols * rows * dtype_size(type)) &&
                s.values.size() == n * dtype_size(type),
            "checkpoint", "parameter '", name, "' has state of inconsistent sizes");
  }
  expects(r.at_end(), "checkpoint", "has trailing data after the last parameter");
  expects(selected == 0 || unselected == 0, "checkpoint", "holds a selection for ", selected, " of ",
          selected + unselected, " 2-D parameters (all or none)");
  expects(cpu_columns > 0 || pending == -1, "checkpoint", "holds a pending CPU update but no CPU columns");

  // Apply.
  started_ = started;
  step_ = step;
  interval_ = interval;
  interval_target_ = target;
  last_overlap_ = overlap;
  selection_due_ = selection_due;
  if (pending >= 0) pending_interval_ = pending;
  host_opt_.set_step_count(host_steps);
  {
    std::lock_guard lock(mutex_);
    accumulated_counts_ = {};
    accumulated_count(interval.index) = current_count;
    if (pending >= 0) accumulated_count(pending) = pending_count;
    offloaded_through_step_ = step - 1;
    stats_ready_step_ = step - 1;
    accumulated_interval_ = interval.index - 1;
    updated_interval_ = launched_interval_ = interval.index - 1;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    auto& s = saved[i];
    p.adam = s.adam;
    p.device_adam.reset();  // handed to the device optimizer at the next step
    if (p.is_vector) {
      device_opt_.import_state(p.device_index, s.vector_state);
      Backend::copy_async(p.vector.data, s.values.data(), s.values.size(), stream);
      Backend::synchronize(stream);
      continue;
    }
    std::copy(s.cpu_p.begin(), s.cpu_p.end(), host_opt_.params(p.cpu_tensor).begin());
    std::copy(s.cpu_m.begin(), s.cpu_m.end(), host_opt_.exp_avg(p.cpu_tensor).begin());
    std::copy(s.cpu_v.begin(), s.cpu_v.end(), host_opt_.exp_avg_sq(p.cpu_tensor).begin());
    if (!s.selection.empty()) {
      device_buffer compact_dev(s.compact.size() * sizeof(float));
      Backend::copy_async(compact_dev.data(), s.compact.data(), s.compact.size() * sizeof(float), stream);
      Backend::synchronize(stream);
      p.device_index = Backend::add_matrix(
          device_opt_, p.matrix, s.selection,
          std::span<const float>(reinterpret_cast<const float*>(compact_dev.data()), s.compact.size()), stream);
      // Dense mode does not use the selector (whose k may be smaller than every column).
      if (options_.mode == offload_mode::zenflow) selector_.set_selection(p.selector_index, s.selection);
    }
    // Before the first step a coordinator has no selection, CPU column list or staging buffers
    // yet (start() makes them).
    if (started) {
      p.selection = s.selection;
      p.complement = complement_columns(p.selection, p.matrix.cols);
      setup_buffers(p, stream);
      p.accumulator[interval.index % 2] = std::move(s.accumulator);
    }
    std::vector<std::int32_t> all(static_cast<std::size_t>(p.matrix.cols));
    std::iota(all.begin(), all.end(), 0);
    device_buffer all_dev(all.size() * sizeof(std::int32_t)), values_dev(s.values.size());
    detail::synchronize_on_unwind<Backend> guard(stream);
    if (pending >= 0)
      Backend::copy_async(p.writeback_dev[pending % 2].data(), s.pending.data(), s.pending.size(), stream);
    Backend::copy_async(all_dev.data(), all.data(), all.size() * sizeof(std::int32_t), stream);
    Backend::copy_async(values_dev.data(), s.values.data(), s.values.size(), stream);
    Backend::scatter(values_dev.data(), p.matrix.type, all, reinterpret_cast<const std::int32_t*>(all_dev.data()),
                     p.matrix, stream);
    Backend::synchronize(stream);
  }
  device_opt_.set_step_count(device_steps);
}

}  // namespace zenflow
