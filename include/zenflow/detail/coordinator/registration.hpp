// basic_coordinator's trainer-facing calls (included by coordinator_impl.hpp): accessors,
// hyper-parameters and registration, gradient submission, and the trainer-side checks and
// failure handling that every public entry goes through.
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

namespace zenflow {

namespace detail {
/// A parameter's memory: the byte span from its first to its last element, the byte addresses of
/// those two elements, and whether it is dense (every element of the span is the parameter's).
struct parameter_memory {
  std::uintptr_t lo = 0, hi = 0, first = 0, last = 0;
  bool dense = false;
  /// Whether two parameters share memory: the same data, or a dense one holding an element of the
  /// other (strided views that interleave without sharing an element are allowed).
  [[nodiscard]] bool shares(const parameter_memory& o) const noexcept {
    if (first == o.first) return true;
    if (lo >= o.hi || o.lo >= hi) return false;
    const auto inside = [](std::uintptr_t a, const parameter_memory& m) { return a >= m.lo && a < m.hi; };
    return (dense && (inside(o.first, *this) || inside(o.last, *this) || o.dense)) ||
           (o.dense && (inside(first, o) || inside(last, o)));
  }
};
inline parameter_memory memory_of(const void* data, index_t last_offset, index_t elements, std::size_t esize) {
  const auto first = reinterpret_cast<std::uintptr_t>(data);
  const auto last = first + static_cast<std::uintptr_t>(last_offset) * esize;
  return {first, last + esize, first, last, last_offset + 1 == elements};
}
inline parameter_memory memory_of(const const_matrix_view& m) {
  return memory_of(m.data, (m.rows - 1) * m.row_stride + (m.cols - 1) * m.col_stride, m.rows * m.cols,
                   m.element_size());
}
inline parameter_memory memory_of(const const_vector_view& v) {
  return memory_of(v.data, (v.size - 1) * v.stride, v.size, v.element_size());
}
}  // namespace detail

// --- accessors -----------------------------------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
auto basic_coordinator<Backend, HostOptimizer, Communicator>::options() const noexcept -> const options_type& {
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
std::optional<step_gradients> basic_coordinator<Backend, HostOptimizer, Communicator>::last_step_gradients() {
  const device_scope scope(device_);
  rethrow_worker_error();
  if (!ran_step_) return std::nullopt;
  step_flags_buffers& b = by_step_[(step_ - 1) % 2];
  Backend::synchronize(b.stats_ready);
  const auto* flags = reinterpret_cast<const step_flags*>(b.flags_host.data());
  return step_gradients{flags->skip != 0, flags->grad_norm};
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
host_memory_bytes basic_coordinator<Backend, HostOptimizer, Communicator>::host_memory() const {
  const HostOptimizer& opt = host_optimizer();
  host_memory_bytes m;
  if constexpr (requires { opt.host_state_bytes(); }) m.cpu_state = opt.host_state_bytes();
  if constexpr (requires { opt.nvme_file()->pool().total_bytes(); })
    if (opt.nvme_file() != nullptr) m.state_file_pool = opt.nvme_file()->pool().total_bytes();
  m.copy_out = update_.copy_out_window_bytes();  // read after host_optimizer()'s wait: no update runs
  for (const parameter& p : params_)
    for (int b = 0; b < 2; ++b) {
      m.accumulators += p.by_interval[b].accumulator.capacity() * sizeof(float);
      m.device_buffers += (*p.by_step)[b].grad_stage.bytes() + p.by_interval[b].writeback_dev.bytes();
    }
  return m;
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
auto basic_coordinator<Backend, HostOptimizer, Communicator>::hyper_parameters_of(std::size_t i) const
    -> const hyper_parameters_type& {
  return at(i).hyper;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
std::span<const std::int32_t> basic_coordinator<Backend, HostOptimizer, Communicator>::gpu_columns(
    std::size_t i) const {
  return at(i).gpu_columns;
}

// --- hyper-parameters and registration -----------------------------------------------------------

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::set_hyper_parameters(const hyper_parameters_type& hp) {
  rethrow_worker_error();
  check_hyper_parameters(hp);
  for (auto& p : params_) p.hyper = hp;
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::set_hyper_parameters(std::size_t i,
                                                                                   const hyper_parameters_type& hp) {
  rethrow_worker_error();
  auto& p = at(i);
  check_hyper_parameters(hp);
  p.hyper = hp;
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
  check_own_memory(detail::memory_of(const_matrix_view(param)));
  expects(initial.rows == param.rows && initial.cols == param.cols, "initial", "shape ", initial.rows, " x ",
          initial.cols, " does not match param ", param.rows, " x ", param.cols);
  expects(initial.type == dtype::f32 || initial.type == param.type, "initial", "must be f32 or the param's dtype (",
          std::string(dtype_name(param.type)), "), got ", std::string(dtype_name(initial.type)));
  expects(is_valid(grad_type), "grad_type", "unknown dtype");
  expects(step_ == 0 && !schedule_.started(), "register_parameter",
          "parameters must be registered before the first step");
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
  // Data parallel: every rank's values, compared before the first step (replicas that start apart
  // would stay apart in their GPU columns and 1-D parameters).
  if constexpr (data_parallel)
    initial_values_ = detail::fingerprint(initial_values_, detail::values_fingerprint_of(initial));
  parameter p;
  p.name = std::move(name);
  p.hyper = options_.optimizer;
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
  check_own_memory(detail::memory_of(const_vector_view(param)));
  expects(static_cast<index_t>(initial.size()) == param.size, "initial", "has ", initial.size(), " values, param has ",
          param.size);
  expects(step_ == 0 && !schedule_.started(), "register_parameter",
          "parameters must be registered before the first step");
  if constexpr (data_parallel)
    initial_values_ = detail::fingerprint(initial_values_, detail::values_fingerprint_of(initial));
  parameter p;
  p.name = std::move(name);
  p.hyper = options_.optimizer;
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
  check_stream(stream);
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
  // Nothing about this gradient's CPU columns waits for the rest of backward: gather them now,
  // unscaled, and let the copy overlap backward (not at a selection boundary, which may change the
  // columns). The step's clip factor and skip flag, known at step(), apply as the offload worker
  // accumulates, as they do for a gradient gathered in step().
  // Data parallel: the CPU columns are reduced across ranks first, in step(). A backend that
  // accumulates on its stream needs the step's flags first: in step() too.
  if (!data_parallel && !accumulates_on_stream && schedule_.started() && !p.cpu_columns.empty() &&
      !selection_boundary()) {
    begin_step();
    offload_gradient(p, unit_flags(), stream);
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::submit_gradient(std::size_t i, const_vector_view grad,
                                                                              stream_type stream) {
  const device_scope scope(device_);
  rethrow_worker_error();
  check_stream(stream);
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
void basic_coordinator<Backend, HostOptimizer, Communicator>::check_hyper_parameters(
    const hyper_parameters_type& hp) const {
  hp.validate();
  const char* field = shared_field_mismatch(hp, options_.optimizer);
  if (field != nullptr)
    throw error(field, detail::concat("must stay as in options().optimizer (", field_text(options_.optimizer, field),
                                      "), got ", field_text(hp, field), ": ", per_group_rule<hyper_parameters_type>()));
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::check_own_memory(
    const detail::parameter_memory& memory) const {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& q = params_[i];
    const auto other =
        q.is_vector ? detail::memory_of(const_vector_view(q.vector)) : detail::memory_of(const_matrix_view(q.matrix));
    expects(!memory.shares(other), "param", "shares memory with parameter ", i, " (", q.name,
            "): each parameter must own its memory, or two optimizers' states would update it (tied weights: "
            "register the shared tensor once)");
  }
}

template <coordinator_backend Backend, host_optimizer HostOptimizer, coordinator_communicator<Backend> Communicator>
void basic_coordinator<Backend, HostOptimizer, Communicator>::check_stream(stream_type stream) {
  if constexpr (Backend::device_space == memory_space::host && std::is_pointer_v<stream_type>)
    expects(stream != nullptr, "stream", "is null: pass the host_stream the coordinator's device work runs on");
  else
    (void)stream;
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
  const double stalled = std::chrono::duration<double>(clock::now() - t0).count();
  metrics_.stall_seconds += stalled;
  interval_stalled_ += stalled;
  if (metrics_.stall_reason.empty()) metrics_.stall_reason = reason;
  if (shared_.error) std::rethrow_exception(shared_.error);
}

}  // namespace zenflow
