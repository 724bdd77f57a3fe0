// basic_coordinator's step (included at the end of coordinator.hpp): construction and shutdown,
// and the step itself — selection boundaries, the GPU update, the offload hand-over, CPU update
// launches and write-backs within the staleness bound — and finish(). The trainer-facing calls
// (registration.hpp), the schedule between steps (intervals.hpp), state migration, the workers and
// checkpoints have their own files beside this one.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <ostream>
#include <utility>

#include "zenflow/coordinator.hpp"
#include "zenflow/detail/coordinator/checkpoint_io.hpp"
#include "zenflow/detail/coordinator/checkpoint_load.hpp"
#include "zenflow/detail/coordinator/data_parallel.hpp"
#include "zenflow/detail/coordinator/intervals.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"
#include "zenflow/detail/coordinator/migration.hpp"
#include "zenflow/detail/coordinator/offload_worker.hpp"
#include "zenflow/detail/coordinator/registration.hpp"
#include "zenflow/detail/coordinator/reload.hpp"
#include "zenflow/detail/coordinator/update_worker.hpp"

namespace zenflow {

inline std::ostream& operator<<(std::ostream& os, const step_metrics& m) {
  os << "step " << m.step << " stall " << m.stall_seconds * 1e3 << " ms";
  if (!m.stall_reason.empty()) os << " (" << m.stall_reason << ")";
  os << " cpu_update " << m.cpu_update_seconds * 1e3 << " ms";
  if (m.cpu_update_disk_read_bytes + m.cpu_update_disk_written_bytes > 0)
    os << " (disk: read " << m.cpu_update_disk_read_bytes << " B, wrote " << m.cpu_update_disk_written_bytes
       << " B, waited " << m.cpu_update_disk_wait_seconds * 1e3 << " ms)";
  os << " d2h " << m.bytes_device_to_host << " B h2d " << m.bytes_host_to_device << " B overlap " << m.selection_overlap
     << " interval " << m.interval;
  if (m.interval_floor > 0) os << " (floor " << m.interval_floor << ")";
  os << (m.reselected ? " reselected" : "") << (m.cpu_update_launched ? " cpu-update" : "")
     << (m.written_back ? " write-back" : "");
  return os;
}

// --- construction and shutdown -------------------------------------------------------------------

namespace detail {
/// The CPUs the coordinator's threads run on: every CPU this process may run on but the first
/// `reserved` (coordinator_config::reserved_cpus), or none (empty: unrestricted) when reserved is 0.
inline std::vector<int> worker_cpus(std::size_t reserved) {
  if (reserved == 0) return {};
  std::vector<int> cpus = allowed_cpus();
  expects(reserved < cpus.size(), "reserved_cpus", "must leave at least one of the ", cpus.size(),
          " CPUs this process may run on to the coordinator's threads, got ", reserved);
  cpus.erase(cpus.begin(), cpus.begin() + static_cast<std::ptrdiff_t>(reserved));
  return cpus;
}
}  // namespace detail

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::basic_coordinator(
    const options_type& options, const coordinator_config& config) requires std::same_as<Communicator, single_process>
    : basic_coordinator(private_tag{}, nullptr, options, config) {}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::basic_coordinator(
    Communicator& comm, const options_type& options,
    const coordinator_config& config) requires(!std::same_as<Communicator, single_process>)
    : basic_coordinator(private_tag{}, &comm, options, config) {}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::make_selector(const options_type& options,
                                                                            Communicator* comm) -> selector_type {
  if constexpr (data_parallel)
    return selector_type(options.topk_ratio, score_norm::l1, detail::score_reducer<Communicator>(comm));
  else
    return selector_type(options.topk_ratio);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::basic_coordinator(private_tag, Communicator* comm,
                                                                           const options_type& options,
                                                                           const coordinator_config& config)
    : device_(Backend::current_device()),
      options_(validated(options)),
      config_(validated(config)),
      worker_cpus_(detail::worker_cpus(config_.reserved_cpus)),
      comm_(comm),
      host_opt_(make_host_optimizer(options.optimizer, config, worker_cpus_, comm)),
      device_opt_(options.optimizer),
      selector_(make_selector(options, comm)),
      offload_(shared_, config.d2h_slot_bytes, config.d2h_slots, config.cpu_threads, config.pin_threads, worker_cpus_),
      update_(shared_, host_opt_, config.h2d_slot_bytes, config.h2d_slots, config.copy_out_window_bytes),
      schedule_(options_) {
  if constexpr (data_parallel) {
    rank_ = comm_->rank();
    ranks_ = comm_->size();
    expects(ranks_ >= 1 && rank_ >= 0 && rank_ < ranks_, "comm", "reports rank ", rank_, " of ", ranks_);
    comm_->check();
    reduce_scratch_ = device_buffer(2 * sizeof(double));
    control_stream_ = std::make_unique<typename Backend::owned_stream>();
  }
  statistics_scratch_ = device_buffer(Backend::statistics_scratch_bytes);
  unit_flags_dev_ = device_buffer(sizeof(step_flags));
  const step_flags unit{};
  Backend::copy_async(unit_flags_dev_.data(), &unit, sizeof unit, offload_.stream());
  Backend::synchronize(offload_.stream());
  by_step_[0].flags_dev = device_buffer(sizeof(step_flags));
  by_step_[1].flags_dev = device_buffer(sizeof(step_flags));
  by_step_[0].flags_host = typename Backend::host_buffer(sizeof(step_flags));
  by_step_[1].flags_host = typename Backend::host_buffer(sizeof(step_flags));
  // The workers use the coordinator's device (a process may drive one GPU per coordinator).
  offload_.start(device_, worker_cpus_);
  try {
    update_.start(device_, worker_cpus_);
  } catch (...) {
    stop_workers();  // a joinable std::thread must not be destroyed during unwinding
    throw;
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::~basic_coordinator() {
  std::optional<device_scope> scope;
  try {
    scope.emplace(device_);
  } catch (...) {  // the events and buffers below are then released on whatever device is current
  }
  stop_workers();
  // Copies still in flight (a worker that died with chunks submitted) read or write the
  // parameters' staging buffers, which are destroyed before the queues: wait for them first.
  offload_.drain();
  update_.drain();
  try {
    Backend::synchronize(offload_.stream());
    Backend::synchronize(update_.stream());
    // The trainer's stream may still run work that reads or writes our buffers (statistics, the
    // flags written to host memory, the sparse step, gathers, scatters): each step's last such
    // work is followed by one of these events. The trainer's stream itself is never synchronized
    // (it may be gone).
    for (int b = 0; b < 2; ++b) {
      Backend::synchronize(by_step_[b].stats_ready);
      Backend::synchronize(by_interval_[b].written_back);
      for (auto& p : params_) Backend::synchronize((*p.by_step)[b].gathered);
    }
  } catch (...) {
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::validated(const options_type& options) -> options_type {
  options.validate();
  return options;
}

namespace detail {
/// The coordinator's check of one transfer queue's settings, naming the coordinator_config fields
/// (the queue would name its own constructor's arguments).
inline void check_queue_config(std::size_t slot_bytes, std::size_t slots, const char* slot_bytes_field,
                               const char* slots_field) {
  // A slot carries whole fp32 elements (an offloaded gradient is accumulated per slot), so the
  // smallest slot that makes progress is 4 bytes.
  expects(slot_bytes >= 4, slot_bytes_field, "must be >= 4 (a slot carries whole fp32 elements), got ", slot_bytes);
  expects(slots >= 2, slots_field, "must be at least 2 (double buffering), got ", slots);
  (void)slot_stride(slot_bytes, slots, slot_bytes_field, slots_field);  // the pool's size overflow check
}
}  // namespace detail

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
coordinator_config basic_coordinator<Backend, HostOptimizer, Communicator>::validated(
    const coordinator_config& config) {
  detail::check_queue_config(config.d2h_slot_bytes, config.d2h_slots, "d2h_slot_bytes", "d2h_slots");
  detail::check_queue_config(config.h2d_slot_bytes, config.h2d_slots, "h2d_slot_bytes", "h2d_slots");
  expects(config.copy_out_window_bytes > 0, "copy_out_window_bytes", "must be > 0, got 0");
  return config;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
HostOptimizer basic_coordinator<Backend, HostOptimizer, Communicator>::make_host_optimizer(
    const hyper_parameters_type& hp, const coordinator_config& config, const std::vector<int>& cpus,
    Communicator* comm) {
  try {
    cpu_adam_config c{config.cpu_threads, config.pin_threads};
    c.cpus = cpus;
    c.cpu_state = config.cpu_state;
    c.nvme = config.nvme;
    (void)comm;
    if constexpr (data_parallel)
      if (c.nvme && comm != nullptr) c.nvme->file.rank = comm->rank();  // one file per rank
    return HostOptimizer(hp, c);
  } catch (const error& e) {
    // cpu_adam names its own config's fields; the trainer set coordinator_config's.
    if (e.argument() == "config.threads") throw error("cpu_threads", e.reason());
    if (e.argument().starts_with("config.nvme")) throw error(e.argument().substr(7), e.reason());
    throw;
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::stop_workers() noexcept {
  shared_.request_stop();
  offload_.join();
  update_.join();
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const step_metrics& basic_coordinator<Backend, HostOptimizer, Communicator>::step(stream_type stream,
                                                                                  missing_gradients missing) {
  const device_scope scope(device_);
  try {
    check_stream(stream);
    rethrow_worker_error();
  } catch (...) {
    fail_peers(std::current_exception());
    throw;
  }
  if constexpr (data_parallel) {
    // Before any collective whose size depends on the registration: the ranks compare a record of
    // fixed size (after a checkpoint load, load_checkpoint did).
    if (!agreed_) {
      or_fail([&] { agree(agreement_of(detail::agreement::first_step, current_position())); });
      agreed_ = true;
    }
    agree_on_gradients(missing, stream);
  }
  for (std::size_t i = 0; i < params_.size() && missing == missing_gradients::reject; ++i)
    if (!params_[i].has_grad) {
      abandon_step(stream);
      expects(false, "step", "no gradient was submitted for parameter ", i, " (", params_[i].name, ") in step ", step_,
              "; the step's gradients were dropped: submit all of them again");
    }
  or_fail([&] { run_step(stream); });
  return metrics_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::run_step(stream_type stream) {
  if (!schedule_.started()) start(stream);
  begin_step();
  const int parity = static_cast<int>(step_ % 2);

  auto* flags_dev = reinterpret_cast<step_flags*>(by_step_[parity].flags_dev.data());
  auto* flags_host = reinterpret_cast<const step_flags*>(by_step_[parity].flags_host.data());
  auto* flags_host_dev = reinterpret_cast<step_flags*>(by_step_[parity].flags_host.device_data());

  if constexpr (data_parallel) {
    // 1. Selection boundary first (it decides which columns are all-reduced and which are
    //    reduce-scattered): scored from this rank's gradients, the scores summed over the ranks.
    //    Not at a step with a NaN/Inf on any rank (the selection waits for the next finite step).
    if (selection_boundary()) {
      if (any_nonfinite_gradient(stream))
        schedule_.postpone_selection();
      else
        reselect(stream);
    }
    // 2. The gradients reduced over the ranks, and the step's flags from the reduced gradients.
    reduce_gradients(stream);
    reduced_statistics(flags_dev, flags_host_dev, stream);
  } else {
    // 1. Statistics (global norm for clipping, non-finite check). The flags go to the device (for
    //    this step's kernels) and straight into host memory (for the offload worker, once
    //    stats_ready_ completed): no copy on the trainer's stream.
    //    Over the gradients handed over only (missing_gradients::skip).
    std::vector<const_matrix_view> given_matrices;
    std::vector<const_vector_view> given_vectors;
    for (const auto& p : params_) {
      if (!p.has_grad) continue;
      if (p.is_vector)
        given_vectors.push_back(p.grad_vector);
      else
        given_matrices.push_back(p.grad_matrix);
    }
    Backend::step_statistics(given_matrices, given_vectors, options_.max_grad_norm, flags_dev, flags_host_dev,
                             statistics_scratch_.data(), stream);

    // 2. Selection boundary: the first step after warm-up, then as the policy says. A selection
    //    synchronizes anyway; it first reads the flags, and a skipped step does not select (its
    //    scores are not finite): the selection waits for the next finite step.
    if (selection_boundary()) {
      Backend::synchronize(stream);
      if (flags_host->skip)
        schedule_.postpone_selection();
      else
        reselect(stream);
    }
  }

  // 3. The GPU update of the selected columns and the 1-D parameters, with the hyper-parameters
  //    set before this step (handed over in stream order, where they changed).
  std::vector<const_matrix_view> device_matrices;
  std::vector<const_vector_view> vectors;
  for (auto& p : params_) {
    if (p.is_vector) vectors.push_back(p.has_grad ? p.grad_vector : const_vector_view{});  // null: skipped
    if (p.device_index == npos) continue;
    if (!p.is_vector) device_matrices.push_back(p.has_grad ? p.grad_matrix : const_matrix_view{});  // null: skipped
    if (p.device_hyper != p.hyper) {
      Backend::set_options(device_opt_, p.device_index, p.hyper, stream);
      p.device_hyper = p.hyper;
    }
  }
  if (device_opt_.parameter_count() > 0) Backend::device_step(device_opt_, device_matrices, vectors, flags_dev, stream);

  Backend::record(by_step_[parity].stats_ready, stream);
  {
    detail::state_lock lock(shared_.mutex);
    shared_.stats_ready_step = step_;
  }
  shared_.cv.notify_all();

  // 4. Offload the CPU columns not handed over during backward: gathered scaled by the step's
  //    clip factor, then the end-of-step marker.
  for (auto& p : params_) {
    if (p.is_vector || p.cpu_columns.empty() || !p.has_grad || p.offloaded) continue;
    if constexpr (data_parallel)  // this rank's block of the reduce-scatter, scaled as it accumulates
      hand_over(p, static_cast<std::size_t>(rank_) * p.block * dtype_size(p.grad_type),
                owned_piece_elements(p) * dtype_size(p.grad_type), /*scale_by_flags=*/true, stream);
    else
      offload_gradient(p, flags_dev, stream);
  }
  {
    detail::state_lock lock(shared_.mutex);
    detail::offload_job<Backend> marker;  // end of this step's gradients
    marker.step = step_;
    marker.interval = schedule_.interval();
    marker.flags = step_offloaded_ ? flags_host : nullptr;
    offload_.push(lock, marker);
  }
  shared_.cv.notify_all();

  // 5. Interval boundary: CPU update (async with overlap_step), write-back within the bound.
  if (schedule_.count_step(step_)) {
    if (has_cpu_columns())
      end_interval(stream, /*synchronous=*/!overlapped(), step_);
    else
      begin_interval(schedule_.interval() + 1, step_ + 1, stream);
  }
  for (auto& p : params_) p.has_grad = p.offloaded = false;
  in_step_ = false;
  ++step_;
  ran_step_ = true;
  schedule_.step_done(step_);  // leaving warm-up, the next interval follows the options

  metrics_.selection_overlap = last_overlap_;
  metrics_.interval = schedule_.target();
  metrics_.interval_floor = schedule_.cpu_update_floor();
  {
    detail::state_lock lock(shared_.mutex);
    metrics_.cpu_update_seconds = shared_.last_update_seconds;
    metrics_.cpu_update_disk_read_bytes = shared_.last_update_disk_read;
    metrics_.cpu_update_disk_written_bytes = shared_.last_update_disk_written;
    metrics_.cpu_update_disk_wait_seconds = shared_.last_update_disk_wait;
  }
  collectives_enqueued(stream);  // the control stream's next collective comes after this step's
  if constexpr (Backend::device_space == memory_space::host) Backend::record(step_done_, stream);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::finish(stream_type stream) {
  const device_scope scope(device_);
  rethrow_worker_error();
  check_stream(stream);
  abandon_step(stream);
  or_fail([&] {
    if (const auto pending = schedule_.pending()) write_back(*pending, stream, "finish", step_ - 1);
    if (schedule_.interval_steps() > 0 && has_cpu_columns()) end_interval(stream, /*synchronous=*/true, step_ - 1);
    Backend::synchronize(stream);
  });
}

}  // namespace zenflow
