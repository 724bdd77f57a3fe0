// The schedule of basic_coordinator (included at the end of coordinator.hpp): construction and
// shutdown, registration, the trainer-side calls, and the step itself — selection boundaries, the
// GPU update, the offload hand-over, intervals, CPU update launches and write-backs within the
// staleness bound. State migration, the workers and checkpoints have their own files beside this
// one.
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
#include "zenflow/detail/coordinator/data_parallel.hpp"
#include "zenflow/detail/coordinator/jobs.hpp"
#include "zenflow/detail/coordinator/migration.hpp"
#include "zenflow/detail/coordinator/offload_worker.hpp"
#include "zenflow/detail/coordinator/reload.hpp"
#include "zenflow/detail/coordinator/update_worker.hpp"

namespace zenflow {

inline std::ostream& operator<<(std::ostream& os, const step_metrics& m) {
  os << "step " << m.step << " stall " << m.stall_seconds * 1e3 << " ms";
  if (!m.stall_reason.empty()) os << " (" << m.stall_reason << ")";
  os << " cpu_update " << m.cpu_update_seconds * 1e3 << " ms d2h " << m.bytes_device_to_host << " B h2d "
     << m.bytes_host_to_device << " B overlap " << m.selection_overlap << " interval " << m.interval
     << (m.reselected ? " reselected" : "") << (m.cpu_update_launched ? " cpu-update" : "")
     << (m.written_back ? " write-back" : "");
  return os;
}

// --- construction and shutdown -------------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::basic_coordinator(
    const zenflow_options& options,
    const coordinator_config& config) requires std::same_as<Communicator, single_process>
    : basic_coordinator(private_tag{}, nullptr, options, config) {}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::basic_coordinator(
    Communicator& comm, const zenflow_options& options,
    const coordinator_config& config) requires(!std::same_as<Communicator, single_process>)
    : basic_coordinator(private_tag{}, &comm, options, config) {}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::make_selector(const zenflow_options& options,
                                                                            Communicator* comm) -> selector_type {
  if constexpr (data_parallel)
    return selector_type(options.topk_ratio, score_norm::l1, detail::score_reducer<Communicator>(comm));
  else
    return selector_type(options.topk_ratio);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
basic_coordinator<Backend, HostOptimizer, Communicator>::basic_coordinator(private_tag, Communicator* comm,
                                                                           const zenflow_options& options,
                                                                           const coordinator_config& config)
    : device_(Backend::current_device()),
      options_(validated(options)),
      config_(validated(config)),
      comm_(comm),
      host_opt_(make_host_optimizer(options.adam, config)),
      device_opt_(options.adam),
      selector_(make_selector(options, comm)),
      policy_(options),
      offload_(shared_, config.d2h_slot_bytes, config.d2h_slots, config.cpu_threads, config.pin_threads),
      update_(shared_, host_opt_, config.h2d_slot_bytes, config.h2d_slots) {
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
  flags_dev_[0] = device_buffer(sizeof(step_flags));
  flags_dev_[1] = device_buffer(sizeof(step_flags));
  flags_host_[0] = typename Backend::host_buffer(sizeof(step_flags));
  flags_host_[1] = typename Backend::host_buffer(sizeof(step_flags));
  // The workers use the coordinator's device (a process may drive one GPU per coordinator).
  offload_.start(device_);
  try {
    update_.start(device_);
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
      Backend::synchronize(stats_ready_[b]);
      Backend::synchronize(written_back_[b]);
      for (auto& p : params_) Backend::synchronize((*p.gathered)[b]);
    }
  } catch (...) {
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
zenflow_options basic_coordinator<Backend, HostOptimizer, Communicator>::validated(const zenflow_options& options) {
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
  return config;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
HostOptimizer basic_coordinator<Backend, HostOptimizer, Communicator>::make_host_optimizer(
    const adam_options& adam, const coordinator_config& config) {
  try {
    return HostOptimizer(adam, cpu_adam_config{config.cpu_threads, config.pin_threads});
  } catch (const error& e) {
    // cpu_adam names its own config's field; the trainer set coordinator_config::cpu_threads.
    if (e.argument() == "config.threads") throw error("cpu_threads", e.reason());
    throw;
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::stop_workers() noexcept {
  shared_.request_stop();
  offload_.join();
  update_.join();
}

// --- accessors -----------------------------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const zenflow_options& basic_coordinator<Backend, HostOptimizer, Communicator>::options() const noexcept {
  return options_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::int64_t basic_coordinator<Backend, HostOptimizer, Communicator>::step_count() const noexcept {
  return step_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const step_metrics& basic_coordinator<Backend, HostOptimizer, Communicator>::metrics() const noexcept {
  return metrics_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::vector<update_record> basic_coordinator<Backend, HostOptimizer, Communicator>::trace() const {
  detail::state_lock lock(shared_.mutex);
  return update_.trace(lock);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const HostOptimizer& basic_coordinator<Backend, HostOptimizer, Communicator>::host_optimizer() const {
  std::unique_lock lock(shared_.mutex);
  shared_.cv.wait(lock, [&] { return shared_.updated_interval >= shared_.launched_interval || shared_.failed; });
  if (shared_.error) std::rethrow_exception(shared_.error);
  return host_opt_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::device_optimizer() const noexcept
    -> const device_optimizer_type& {
  return device_opt_;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::int64_t basic_coordinator<Backend, HostOptimizer, Communicator>::cpu_step_count(std::size_t i) const {
  const parameter& p = at(i);
  (void)host_optimizer();  // waits for the CPU updates launched so far (they count)
  return p.cpu_steps;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::int64_t basic_coordinator<Backend, HostOptimizer, Communicator>::gpu_step_count(std::size_t i) const {
  const device_scope scope(device_);
  const parameter& p = at(i);
  return p.device_index == npos ? 0 : device_opt_.step_count(p.device_index);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::size_t basic_coordinator<Backend, HostOptimizer, Communicator>::parameter_count() const noexcept {
  return params_.size();
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const std::string& basic_coordinator<Backend, HostOptimizer, Communicator>::name(std::size_t i) const {
  return at(i).name;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const adam_options& basic_coordinator<Backend, HostOptimizer, Communicator>::adam_options_of(std::size_t i) const {
  return at(i).adam;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::span<const std::int32_t> basic_coordinator<Backend, HostOptimizer, Communicator>::gpu_columns(
    std::size_t i) const {
  return at(i).selection;
}

// --- hyper-parameters and registration -----------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::set_adam_options(const adam_options& adam) {
  rethrow_worker_error();
  check_adam(adam);
  for (auto& p : params_) p.adam = adam;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::set_adam_options(std::size_t i,
                                                                               const adam_options& adam) {
  rethrow_worker_error();
  auto& p = at(i);
  check_adam(adam);
  p.adam = adam;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::size_t basic_coordinator<Backend, HostOptimizer, Communicator>::register_parameter(std::string name,
                                                                                        matrix_view param,
                                                                                        const_matrix_view initial,
                                                                                        dtype grad_type) {
  const device_scope scope(device_);
  param.validate("param", Backend::device_space);
  initial.validate("initial", memory_space::host);
  expects(!param.empty(), "param", "must not be empty");
  expects(initial.rows == param.rows && initial.cols == param.cols, "initial", "shape ", initial.rows, " x ",
          initial.cols, " does not match param ", param.rows, " x ", param.cols);
  expects(initial.type == dtype::f32 || initial.type == param.type, "initial", "must be f32 or the param's dtype (",
          std::string(dtype_name(param.type)), "), got ", std::string(dtype_name(initial.type)));
  expects(is_valid(grad_type), "grad_type", "unknown dtype");
  expects(step_ == 0 && !started_, "register_parameter", "parameters must be registered before the first step");
  expects(param.cols >= ranks_, "param", "has ", param.cols, " columns, fewer than the ", ranks_,
          " data-parallel ranks that each own a range of them");
  // Column-contiguous fp32 master of this rank's columns for the CPU optimizer.
  const column_range owned = detail::owned_range(param.cols, rank_, ranks_);
  std::vector<float> master(static_cast<std::size_t>(param.rows * owned.size()));
  dispatch_dtype(initial.type, [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(initial.data);
    for (index_t c = owned.first; c < owned.last; ++c)
      for (index_t r = 0; r < param.rows; ++r)
        master[(c - owned.first) * param.rows + r] = to_float(src[initial.offset(r, c)]);
  });
  parameter p;
  p.name = std::move(name);
  p.adam = options_.adam;
  p.matrix = param;
  p.grad_type = grad_type;
  p.owned = owned;
  p.cpu_tensor = host_opt_.add_tensor(master, param.rows, owned.size());
  p.selector_index = selector_.add_parameter(param.rows, param.cols);
  params_.push_back(std::move(p));
  return params_.size() - 1;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::size_t basic_coordinator<Backend, HostOptimizer, Communicator>::register_parameter(
    std::string name, vector_view param, std::span<const float> initial) {
  const device_scope scope(device_);
  param.validate("param", Backend::device_space);
  expects(!param.empty() && param.contiguous(), "param", "must be a non-empty contiguous vector");
  expects(static_cast<index_t>(initial.size()) == param.size, "initial", "has ", initial.size(), " values, param has ",
          param.size);
  expects(step_ == 0 && !started_, "register_parameter", "parameters must be registered before the first step");
  parameter p;
  p.name = std::move(name);
  p.adam = options_.adam;
  p.is_vector = true;
  p.vector = param;
  p.device_index = Backend::add_vector(device_opt_, param, initial);
  params_.push_back(std::move(p));
  return params_.size() - 1;
}

// --- gradients -----------------------------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::submit_gradient(std::size_t i, const_matrix_view grad,
                                                                              stream_type stream) {
  const device_scope scope(device_);
  rethrow_worker_error();
  auto& p = at(i);
  expects(!p.is_vector, "grad", "parameter ", i, " (", p.name, ") is 1-D: pass a vector view");
  check_submission(p, i);
  grad.validate("grad", Backend::device_space);
  expects(grad.rows == p.matrix.rows && grad.cols == p.matrix.cols, "grad", "shape ", grad.rows, " x ", grad.cols,
          " does not match parameter ", p.name, " (", p.matrix.rows, " x ", p.matrix.cols, ")");
  expects(grad.type == p.grad_type, "grad", "dtype ", std::string(dtype_name(grad.type)), " was registered as ",
          std::string(dtype_name(p.grad_type)));
  p.grad_matrix = grad;
  p.has_grad = true;
  // Without clipping, nothing about this gradient's CPU columns waits for the rest of backward:
  // gather them now and let the copy overlap backward (not at a selection boundary, which may
  // change the columns).
  // Data parallel: the CPU columns are reduced across ranks first, in step().
  if (!data_parallel && started_ && options_.max_grad_norm == 0.0f && !p.complement.empty() && !selection_boundary()) {
    begin_step();
    offload_gradient(p, unit_flags(), stream);
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::submit_gradient(std::size_t i, const_vector_view grad,
                                                                              stream_type stream) {
  const device_scope scope(device_);
  rethrow_worker_error();
  auto& p = at(i);
  expects(p.is_vector, "grad", "parameter ", i, " (", p.name, ") is 2-D: pass a matrix view");
  check_submission(p, i);
  grad.validate("grad", Backend::device_space);
  expects(grad.size == p.vector.size && grad.contiguous(), "grad", "must be contiguous with ", p.vector.size,
          " elements");
  p.grad_vector = grad;
  p.has_grad = true;
  (void)stream;
}

// --- trainer-side checks and failure -------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::at(std::size_t i) -> parameter& {
  expects(i < params_.size(), "parameter", "index ", i, " out of range (", params_.size(), " registered)");
  return params_[i];
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::at(std::size_t i) const -> const parameter& {
  expects(i < params_.size(), "parameter", "index ", i, " out of range (", params_.size(), " registered)");
  return params_[i];
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::check_adam(const adam_options& adam) const {
  adam.validate();
  const char* field = adam.differs_beyond_lr_and_weight_decay(options_.adam);
  expects(field == nullptr, field ? field : "adam", "must stay as in options().adam: parameter groups and schedules ",
          "change lr and weight_decay only");
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::check_submission(const parameter& p, std::size_t i) {
  expects(!p.has_grad, "grad", "parameter ", i, " (", p.name, ") already has a gradient in step ", step_,
          ": submit each gradient once per step");
  if constexpr (Backend::device_space == memory_space::host) {
    expects(!config_.check_stream_order || step_done_.query(), "grad", "parameter ", i, " (", p.name,
            ") was submitted in step ", step_, " while step ", step_ - 1,
            "'s parameter updates were still running on the stream: call stream.synchronize() after step() and "
            "before the backward that reads the parameters");
  }
}

// A failed coordinator rethrows the first error from every call (it is never cleared).
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::rethrow_worker_error() const {
  shared_.rethrow_error();
}

// Runs trainer-side work that changes the coordinator's state: an error in it leaves that state
// half-changed, so it fails the coordinator as a worker error does.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
template <class F>
decltype(auto) basic_coordinator<Backend, HostOptimizer, Communicator>::or_fail(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (...) {
    shared_.fail(std::current_exception());
    fail_peers(std::current_exception());
    throw;
  }
}

// Waits (trainer thread) until pred() holds; time is charged to the step's stall.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
template <class Pred>
void basic_coordinator<Backend, HostOptimizer, Communicator>::stall_until(Pred pred, const char* reason) {
  std::unique_lock lock(shared_.mutex);
  if (pred()) return;
  const auto t0 = clock::now();
  shared_.cv.wait(lock, [&] { return pred() || shared_.failed; });
  metrics_.stall_seconds += std::chrono::duration<double>(clock::now() - t0).count();
  if (metrics_.stall_reason.empty()) metrics_.stall_reason = reason;
  if (shared_.error) std::rethrow_exception(shared_.error);
}

// --- the schedule --------------------------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::in_warm_up() const noexcept {
  return options_.mode == offload_mode::zero_offload || step_ < options_.full_warm_up_rounds;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::overlapped() const noexcept {
  return options_.overlap_step && !in_warm_up();
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::has_cpu_columns() const noexcept {
  for (const auto& p : params_)
    if (!p.is_vector && !p.complement.empty()) return true;
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
  started_ = true;
  for (auto& p : params_)
    if (!p.is_vector) set_selection(p, {}, stream);  // every column on the CPU until the first selection
  interval_ = {0, 0, 0};
  interval_target_ = 1;
  if (!in_warm_up() && !options_.update_interval.is_auto) interval_target_ = options_.update_interval.value;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::int64_t basic_coordinator<Backend, HostOptimizer, Communicator>::auto_interval() const {
  // "auto": the interval ends when the unimportant gradient mass accumulated per CPU column
  // reaches the important mass per GPU column. With the selection's scores (L1 per column) as
  // the per-step masses -- the method's premise is that they change slowly -- that is
  // ceil(important per column / unimportant per column), bounded to [1, max_update_interval] and
  // by the selection interval. No unimportant mass, no CPU or no GPU columns: the bound.
  double important = 0.0, unimportant = 0.0;
  std::int64_t k = 0, rest = 0;
  for (const auto& p : params_) {
    if (p.is_vector || !p.has_grad) continue;  // no gradient: its scores are not this step's
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

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::reselect(stream_type stream) {
  // A selection change moves optimizer state: first complete and write back every CPU update,
  // so no accumulated gradient is lost and no stale result lands on a column the GPU now owns.
  // Before any of this step's work: the write-back happens at the end of the previous step.
  if (pending_interval_) write_back(*pending_interval_, stream, "reselection", step_ - 1);
  if (interval_.steps > 0) end_interval(stream, /*synchronous=*/true, step_ - 1);
  // A parameter without a gradient is scored from its weights (any view of its shape does: the
  // selector scores every parameter at once), and that selection is not used: it keeps its own.
  std::vector<const_matrix_view> grads;
  for (const auto& p : params_)
    if (!p.is_vector) grads.push_back(p.has_grad ? p.grad_matrix : const_matrix_view(p.matrix));
  if (options_.mode == offload_mode::dense) {
    for (auto& p : params_) {
      if (p.is_vector || !p.selection.empty()) continue;
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
      if (!p.selection.empty()) {
        overlap += selection_overlap(p.selection, s);
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

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::end_interval(stream_type stream, bool synchronous,
                                                                           std::int64_t last_step) {
  const std::int64_t i = interval_.index;
  const int b = static_cast<int>(i % 2);
  // The CPU update of every parameter with CPU columns, with the hyper-parameters in effect now.
  detail::update_job<Backend> job;
  job.interval = i;
  job.written_back = &written_back_[b];
  for (auto& p : params_) {
    if (p.is_vector || p.complement.empty()) continue;
    detail::update_item item;
    item.adam = p.adam;
    item.tensor = p.cpu_tensor;
    item.columns = p.owned_local;  // this rank's CPU columns (all of them in one process)
    item.accumulator = p.accumulator[b];
    item.accumulated = &p.accumulated[b];
    item.cpu_steps = &p.cpu_steps;
    item.out = p.out_stage[b];
    item.out_type = p.matrix.type;
    // Its block of the write-back's all-gather (the whole buffer in one process).
    item.device_out = p.writeback_dev[b].data() + static_cast<std::size_t>(rank_) * p.block * dtype_size(p.matrix.type);
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
      r.first_step = interval_.first_step;
      r.last_step = last_step;
      r.synchronous = synchronous;
      update_.add_record(lock, r);
    }
  }
  shared_.cv.notify_all();
  metrics_.cpu_update_launched = true;
  // The deadline of the previous interval's update is the end of this one.
  if (pending_interval_) write_back(*pending_interval_, stream, "staleness bound", last_step);
  if (synchronous)
    write_back(i, stream, "synchronous CPU update", last_step);
  else
    pending_interval_ = i;
  begin_interval(i + 1, last_step + 1);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::begin_interval(std::int64_t index,
                                                                             std::int64_t first_step) {
  interval_ = {index, first_step, 0};
  // The interval of this parity two before is written back: its counts are read.
  for (auto& p : params_) p.accumulated[index % 2] = 0;
  detail::state_lock lock(shared_.mutex);
  shared_.accumulated_count(index) = 0;  // the slot of interval index - 4, long written back
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::write_back(std::int64_t i, stream_type stream,
                                                                         const char* reason, std::int64_t at_end_of) {
  stall_until([&] { return shared_.updated_interval >= i; }, reason);
  bool applied;
  {
    detail::state_lock lock(shared_.mutex);
    applied = shared_.accumulated_count(i) > 0;
    update_.mark_written_back(lock, i, at_end_of);
  }
  if (applied) {
    // A parameter without a gradient in the interval had no CPU update: nothing to write back.
    auto written = [&](const parameter& p) {
      return !p.is_vector && !p.complement.empty() && p.accumulated[i % 2] != 0;
    };
    if constexpr (data_parallel) {
      grouped([&] {  // every rank's block of every parameter: the columns each owner updated
        for (auto& p : params_) {
          if (!written(p)) continue;
          dispatch_dtype(p.matrix.type, [&](auto tag) {
            using T = decltype(tag);
            T* all = reinterpret_cast<T*>(p.writeback_dev[i % 2].data());
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
      std::byte* blocks = p.writeback_dev[i % 2].data();
      const auto* complement_dev = reinterpret_cast<const std::int32_t*>(p.complement_dev.data());
      for (int r = 0; r < ranks_; ++r) {
        const std::size_t first = p.pieces[r], count = p.pieces[r + 1] - first;
        if (count == 0) continue;
        Backend::scatter(blocks + static_cast<std::size_t>(r) * p.block * esize, p.matrix.type,
                         std::span<const std::int32_t>(p.complement).subspan(first, count), complement_dev + first,
                         p.matrix, stream);
      }
    }
    Backend::record(written_back_[i % 2], stream);
  }
  if (pending_interval_ == i) pending_interval_.reset();
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
    auto* flags = reinterpret_cast<step_flags*>(flags_host_[parity].data());
    *flags = step_flags{};
    flags->skip = 1;
    Backend::record(stats_ready_[parity], stream);  // after the gathers the copies read
    {
      detail::state_lock lock(shared_.mutex);
      shared_.stats_ready_step = step_;
      detail::offload_job<Backend> marker;
      marker.step = step_;
      marker.interval = interval_.index;
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
  if (in_warm_up()) return false;
  if (selection_due_) return true;
  if (options_.mode == offload_mode::dense) {
    for (const auto& p : params_)
      if (!p.is_vector && p.selection.empty()) return true;  // the first step: every column to the GPU
    return false;
  }
  // The first step after warm-up, until a selection happened (a parameter without a gradient at a
  // selection step gets none: it waits for a later selection step at which it has one). Not
  // decided by which gradients arrived, so that submit_gradient can tell a boundary beforehand.
  if (!any_selection() && has_matrices()) return true;
  // The policy counts from the end of warm-up (its step 0 is the first selection).
  return policy_.should_select(step_ - options_.full_warm_up_rounds);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::any_selection() const noexcept {
  for (const auto& p : params_)
    if (!p.is_vector && !p.selection.empty()) return true;
  return false;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
bool basic_coordinator<Backend, HostOptimizer, Communicator>::has_matrices() const noexcept {
  for (const auto& p : params_)
    if (!p.is_vector) return true;
  return false;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::offload_gradient(parameter& p, const step_flags* flags,
                                                                               stream_type stream) {
  const int parity = static_cast<int>(step_ % 2);
  Backend::gather(p.grad_matrix, p.complement, reinterpret_cast<const std::int32_t*>(p.complement_dev.data()),
                  p.grad_stage[parity].data(), p.grad_type, flags, stream);
  hand_over(p, 0, p.complement.size() * static_cast<std::size_t>(p.matrix.rows) * dtype_size(p.grad_type),
            /*scale_by_flags=*/false, stream);
}

// Hands `bytes` of parameter p's gradient staging, from `offset`, to the offload worker, after the
// work enqueued on `stream` so far (the gather; data parallel, the reduce-scatter, whose block of
// this rank the worker scales: `scale_by_flags`). An empty job still counts the step.
template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::hand_over(parameter& p, std::size_t offset,
                                                                        std::size_t bytes, bool scale_by_flags,
                                                                        stream_type stream) {
  const int parity = static_cast<int>(step_ % 2);
  // The worker makes its copies wait for this event when it gets to them; a wait enqueued on the
  // offload stream here would also hold back the copies of earlier steps still being submitted.
  // Re-recorded two steps later, after begin_step saw this job consumed.
  Backend::record((*p.gathered)[parity], stream);
  detail::offload_job<Backend> j;
  j.step = step_;
  j.interval = interval_.index;
  j.src = p.grad_stage[parity].data() + offset;
  j.bytes = bytes;
  j.type = p.grad_type;
  j.accumulator = p.accumulator[interval_.index % 2].data();
  j.accumulated = &p.accumulated[interval_.index % 2];
  j.flags = reinterpret_cast<const step_flags*>(flags_host_[parity].data());
  j.flags_ready = &stats_ready_[parity];
  j.gathered = &(*p.gathered)[parity];
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

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
const step_metrics& basic_coordinator<Backend, HostOptimizer, Communicator>::step(stream_type stream,
                                                                                  missing_gradients missing) {
  const device_scope scope(device_);
  try {
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
  if (!started_) start(stream);
  begin_step();
  const int parity = static_cast<int>(step_ % 2);

  auto* flags_dev = reinterpret_cast<step_flags*>(flags_dev_[parity].data());
  auto* flags_host = reinterpret_cast<const step_flags*>(flags_host_[parity].data());
  auto* flags_host_dev = reinterpret_cast<step_flags*>(flags_host_[parity].device_data());

  if constexpr (data_parallel) {
    // 1. Selection boundary first (it decides which columns are all-reduced and which are
    //    reduce-scattered): scored from this rank's gradients, the scores summed over the ranks.
    //    Not at a step with a NaN/Inf on any rank (the selection waits for the next finite step).
    if (selection_boundary()) {
      if (any_nonfinite_gradient(stream))
        selection_due_ = true;
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
        selection_due_ = true;
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
    if (p.device_adam != p.adam) {
      Backend::set_options(device_opt_, p.device_index, p.adam, stream);
      p.device_adam = p.adam;
    }
  }
  if (device_opt_.parameter_count() > 0) Backend::device_step(device_opt_, device_matrices, vectors, flags_dev, stream);

  Backend::record(stats_ready_[parity], stream);
  {
    detail::state_lock lock(shared_.mutex);
    shared_.stats_ready_step = step_;
  }
  shared_.cv.notify_all();

  // 4. Offload the CPU columns not handed over during backward: gathered scaled by the step's
  //    clip factor, then the end-of-step marker.
  for (auto& p : params_) {
    if (p.is_vector || p.complement.empty() || !p.has_grad || p.offloaded) continue;
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
    marker.interval = interval_.index;
    marker.flags = step_offloaded_ ? flags_host : nullptr;
    offload_.push(lock, marker);
  }
  shared_.cv.notify_all();
  ++interval_.steps;

  // 5. Interval boundary: CPU update (async with overlap_step), write-back within the bound.
  if (in_warm_up() || interval_.steps >= interval_target_) {
    if (has_cpu_columns())
      end_interval(stream, /*synchronous=*/!overlapped(), step_);
    else
      begin_interval(interval_.index + 1, step_ + 1);
  }
  for (auto& p : params_) p.has_grad = p.offloaded = false;
  in_step_ = false;
  ++step_;
  // Leaving warm-up: the next interval follows the options.
  if (!in_warm_up() && !options_.update_interval.is_auto && interval_.steps == 0)
    interval_target_ = options_.update_interval.value;

  metrics_.selection_overlap = last_overlap_;
  metrics_.interval = interval_target_;
  {
    detail::state_lock lock(shared_.mutex);
    metrics_.cpu_update_seconds = shared_.last_update_seconds;
  }
  collectives_enqueued(stream);  // the control stream's next collective comes after this step's
  if constexpr (Backend::device_space == memory_space::host) Backend::record(step_done_, stream);
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::finish(stream_type stream) {
  const device_scope scope(device_);
  rethrow_worker_error();
  abandon_step(stream);
  or_fail([&] {
    if (pending_interval_) write_back(*pending_interval_, stream, "finish", step_ - 1);
    if (interval_.steps > 0 && has_cpu_columns()) end_interval(stream, /*synchronous=*/true, step_ - 1);
    Backend::synchronize(stream);
  });
}

}  // namespace zenflow
