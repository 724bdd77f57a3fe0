// The bounded-async coordinator: the whole ZenFlow step (README.md, "The schedule in one paragraph").
//
//   trainer thread        submit_gradient(i, grad, stream) ... step(stream)
//   trainer stream        statistics -> GPU sparse Adam (selected columns, 1-D params)
//                         -> gather of the unselected columns (scaled) -> [write-back scatter]
//   offload worker        D2H through the transfer queue, fp32 accumulation on the CPU
//   update worker         CPU Adam on the mean accumulated gradient (the library's thread pool),
//                         low-precision copy-out, H2D through the transfer queue
//
// Staleness bound: the CPU result of interval i is written back at the end of interval i+1 at the
// latest with overlap_step (at the end of interval i without), exactly once, and never over the
// selected columns. A selection boundary first completes and writes back all CPU work, then
// re-selects and migrates optimizer state both ways (nothing is zeroed or truncated).
//
// The template takes an execution backend (a coordinator_backend, concepts.hpp) that names the
// component types and the "device" operations: host_backend (detail/coordinator/host_backend.hpp;
// a host_stream plays the GPU stream) ships here, cuda_backend with coordinator.cuh
// (detail/coordinator/cuda_backend.cuh).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "zenflow/concepts.hpp"
#include "zenflow/cpu_adam.hpp"
#include "zenflow/detail/coordinator/checkpoint_io.hpp"
#include "zenflow/detail/coordinator/host_backend.hpp"
#include "zenflow/error.hpp"
#include "zenflow/options.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

/// Resources of a coordinator (the method's knobs are in zenflow_options).
struct coordinator_config {
  std::size_t cpu_threads = 0;  ///< CPU Adam thread pool size; 0: the cores this process may use
  bool pin_threads = false;
  std::size_t d2h_slot_bytes = std::size_t{4} << 20;  ///< gradient staging slot size
  std::size_t d2h_slots = 4;
  std::size_t h2d_slot_bytes = std::size_t{4} << 20;  ///< parameter staging slot size
  std::size_t h2d_slots = 2;
  bool record_trace = false;  ///< keep an update_record per CPU update (the staleness oracle)
  /// Host backend only (its "device" memory is the trainer's host memory): reject the first
  /// gradient of a step while the previous step's parameter updates are still running on the
  /// stream, i.e. when the trainer computed it without stream.synchronize() first. A check, not a
  /// proof: a race that happens to finish in time goes unseen.
  bool check_stream_order = true;
};

/// What one step did and what it cost. Printable.
struct step_metrics {
  std::int64_t step = -1;                  ///< 0-based training step this describes
  double stall_seconds = 0.0;              ///< time the trainer thread waited on CPU-side work
  std::string stall_reason;                ///< why it waited ("" when it did not)
  double cpu_update_seconds = 0.0;         ///< duration of the last completed CPU update
  std::uint64_t bytes_device_to_host = 0;  ///< offloaded by this step: its CPU-column gradients, migration
  std::uint64_t bytes_host_to_device = 0;  ///< written back by this step: CPU-updated columns, migration
  double selection_overlap = 1.0;          ///< mean overlap of the last selection with the one before
  std::int64_t interval = 1;               ///< length (steps) of the current update interval
  bool reselected = false;
  bool cpu_update_launched = false;
  bool written_back = false;
  friend std::ostream& operator<<(std::ostream& os, const step_metrics& m) {
    os << "step " << m.step << " stall " << m.stall_seconds * 1e3 << " ms";
    if (!m.stall_reason.empty()) os << " (" << m.stall_reason << ")";
    os << " cpu_update " << m.cpu_update_seconds * 1e3 << " ms d2h " << m.bytes_device_to_host << " B h2d "
       << m.bytes_host_to_device << " B overlap " << m.selection_overlap << " interval " << m.interval
       << (m.reselected ? " reselected" : "") << (m.cpu_update_launched ? " cpu-update" : "")
       << (m.written_back ? " write-back" : "");
    return os;
  }
};

/// One CPU update as the staleness oracle sees it.
struct update_record {
  std::int64_t interval = 0;           ///< 0-based interval index
  std::int64_t first_step = 0;         ///< first training step whose gradient it accumulated
  std::int64_t last_step = 0;          ///< last one
  std::int64_t accumulated_steps = 0;  ///< non-skipped steps averaged (0: no update applied)
  std::int64_t written_back_at = -1;   ///< training step at whose end it reached the GPU parameters
  int write_backs = 0;                 ///< how often it was written back (must be 1)
  bool synchronous = false;
};

/// The schedule over an execution backend (host_backend, cuda_backend) and a CPU optimizer. The
/// CPU optimizer is a template parameter so that a trainer (or a test) can plug in its own: the
/// host_optimizer concept lists exactly what the coordinator calls on it.
template <coordinator_backend Backend, host_optimizer HostOptimizer = cpu_adam>
class basic_coordinator {
 public:
  using backend_type = Backend;
  using stream_type = typename Backend::stream_type;
  using selector_type = typename Backend::selector_type;
  using device_optimizer_type = typename Backend::device_optimizer_type;
  using queue_type = typename Backend::queue_type;

  /// Validates the options; starts the worker threads. Does not synchronize.
  explicit basic_coordinator(const zenflow_options& options, const coordinator_config& config = {})
      : options_(validated(options)),
        config_(config),
        host_opt_(options.adam, cpu_adam_config{config.cpu_threads, config.pin_threads}),
        device_opt_(options.adam),
        selector_(options.topk_ratio),
        policy_(options),
        d2h_(transfer_direction::device_to_host, at_least_one_float(config.d2h_slot_bytes, "d2h_slot_bytes"),
             config.d2h_slots),
        h2d_(transfer_direction::host_to_device, at_least_one_float(config.h2d_slot_bytes, "h2d_slot_bytes"),
             config.h2d_slots) {
    statistics_scratch_ = typename Backend::device_buffer(Backend::statistics_scratch_bytes);
    unit_flags_dev_ = typename Backend::device_buffer(sizeof(step_flags));
    const step_flags unit{};
    Backend::copy_async(unit_flags_dev_.data(), &unit, sizeof unit, offload_stream_.get());
    Backend::synchronize(offload_stream_.get());
    flags_dev_[0] = typename Backend::device_buffer(sizeof(step_flags));
    flags_dev_[1] = typename Backend::device_buffer(sizeof(step_flags));
    flags_host_[0] = typename Backend::host_buffer(sizeof(step_flags));
    flags_host_[1] = typename Backend::host_buffer(sizeof(step_flags));
    // The workers use the device current here (a process may drive one GPU per coordinator).
    const int device = Backend::current_device();
    offload_thread_ = std::thread([this, device] {
      Backend::bind_device(device);
      offload_loop();
    });
    try {
      update_thread_ = std::thread([this, device] {
        Backend::bind_device(device);
        update_loop();
      });
    } catch (...) {
      stop_workers();  // a joinable std::thread must not be destroyed during unwinding
      throw;
    }
  }

  basic_coordinator(const basic_coordinator&) = delete;
  basic_coordinator& operator=(const basic_coordinator&) = delete;

  /// Stops the workers after the work already handed to them (pending CPU updates finish; their
  /// results are not written back: call finish() for that). Never throws.
  ~basic_coordinator() {
    stop_workers();
    // Copies still in flight (a worker that died with chunks submitted) read or write the
    // parameters' staging buffers, which are destroyed before the queues: wait for them first.
    for (queue_type* q : {&d2h_, &h2d_}) {
      try {
        q->drain();
      } catch (...) {
      }
    }
    try {
      Backend::synchronize(offload_stream_.get());
      Backend::synchronize(writeback_stream_.get());
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

  [[nodiscard]] const zenflow_options& options() const noexcept { return options_; }
  [[nodiscard]] std::int64_t step_count() const noexcept { return step_; }
  /// The last step's metrics (also after a failure).
  [[nodiscard]] const step_metrics& metrics() const noexcept { return metrics_; }
  [[nodiscard]] std::vector<update_record> trace() const {
    std::lock_guard lock(mutex_);
    return trace_;
  }
  /// The CPU optimizer, for reading its state between steps. Waits for CPU updates already
  /// launched (the update worker writes that state); the state then stays as it is until the next
  /// step(), which is how long the reference may be used. A result that is not yet written back is
  /// already in it.
  [[nodiscard]] const HostOptimizer& host_optimizer() const {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return updated_interval_ >= launched_interval_ || failed_; });
    if (worker_error_) std::rethrow_exception(worker_error_);
    return host_opt_;
  }
  [[nodiscard]] const device_optimizer_type& device_optimizer() const noexcept { return device_opt_; }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return params_.size(); }
  [[nodiscard]] const std::string& name(std::size_t i) const { return at(i).name; }
  /// Parameter i's Adam/AdamW hyper-parameters for the next step (options().adam until changed).
  [[nodiscard]] const adam_options& adam_options_of(std::size_t i) const { return at(i).adam; }

  /// Learning-rate schedules and parameter groups: every parameter's (or parameter i's)
  /// hyper-parameters from the next step on. The GPU update of a step uses those set before its
  /// step(); the CPU update of an interval uses those in effect when the interval ended (at the
  /// step() that ends it, at a reselection or in finish()), in sync and async mode alike. They may
  /// differ from options().adam in lr and weight_decay only (throws naming the first other field
  /// that differs). Saved in checkpoints. Does not synchronize.
  void set_adam_options(const adam_options& adam) {
    rethrow_worker_error();
    check_adam(adam);
    for (auto& p : params_) p.adam = adam;
  }
  void set_adam_options(std::size_t i, const adam_options& adam) {
    rethrow_worker_error();
    auto& p = at(i);
    check_adam(adam);
    p.adam = adam;
  }

  /// Columns of parameter i updated on the GPU now (ascending; empty for 1-D parameters).
  [[nodiscard]] std::span<const std::int32_t> gpu_columns(std::size_t i) const { return at(i).selection; }

  /// Registers a 2-D parameter (before the first step). `param` is the model's weight in device
  /// memory (updated in place); `initial` its initial values in host memory (same shape, any
  /// layout), either fp32 (an fp32 master the trainer keeps) or in the parameter's own dtype
  /// (upcast exactly); `grad_type` the dtype its gradients will have. Returns the parameter's index.
  std::size_t register_parameter(std::string name, matrix_view param, const_matrix_view initial, dtype grad_type) {
    param.validate("param", Backend::device_space);
    initial.validate("initial", memory_space::host);
    expects(!param.empty(), "param", "must not be empty");
    expects(initial.rows == param.rows && initial.cols == param.cols, "initial", "shape ", initial.rows, " x ",
            initial.cols, " does not match param ", param.rows, " x ", param.cols);
    expects(initial.type == dtype::f32 || initial.type == param.type, "initial", "must be f32 or the param's dtype (",
            std::string(dtype_name(param.type)), "), got ", std::string(dtype_name(initial.type)));
    expects(is_valid(grad_type), "grad_type", "unknown dtype");
    expects(step_ == 0 && !started_, "register_parameter", "parameters must be registered before the first step");
    // Column-contiguous fp32 master for the CPU optimizer.
    std::vector<float> master(static_cast<std::size_t>(param.rows * param.cols));
    dispatch_dtype(initial.type, [&](auto tag) {
      using T = decltype(tag);
      const T* src = static_cast<const T*>(initial.data);
      for (index_t c = 0; c < param.cols; ++c)
        for (index_t r = 0; r < param.rows; ++r) master[c * param.rows + r] = to_float(src[initial.offset(r, c)]);
    });
    parameter p;
    p.name = std::move(name);
    p.adam = options_.adam;
    p.matrix = param;
    p.grad_type = grad_type;
    p.cpu_tensor = host_opt_.add_tensor(master, param.rows, param.cols);
    p.selector_index = selector_.add_parameter(param.rows, param.cols);
    params_.push_back(std::move(p));
    return params_.size() - 1;
  }

  /// Registers a 1-D parameter (bias, norm): always updated on the GPU.
  std::size_t register_parameter(std::string name, vector_view param, std::span<const float> initial) {
    param.validate("param", Backend::device_space);
    expects(!param.empty() && param.contiguous(), "param", "must be a non-empty contiguous vector");
    expects(static_cast<index_t>(initial.size()) == param.size, "initial", "has ", initial.size(),
            " values, param has ", param.size);
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

  /// Hands over parameter i's gradient for the current step (call as backward produces it), once
  /// per parameter and step. `grad` must stay valid until `stream` has passed step(). The gradient
  /// must have been computed from the parameters as the previous step left them: on a GPU, work
  /// enqueued on `stream` after step() sees them; with the host backend the trainer's own code
  /// reads them, so it must call stream.synchronize() after step() and before its backward (see
  /// coordinator_config::check_stream_order). Does not synchronize.
  void submit_gradient(std::size_t i, const_matrix_view grad, stream_type stream) {
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
    if (started_ && options_.max_grad_norm == 0.0f && !p.complement.empty() && !selection_boundary()) {
      begin_step();
      offload_gradient(p, reinterpret_cast<const step_flags*>(unit_flags_dev_.data()), stream);
    }
  }
  void submit_gradient(std::size_t i, const_vector_view grad, stream_type stream) {
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

  /// Ends the training step: GPU update of the selected columns, offload of the rest, and the
  /// CPU schedule. Blocks only where the staleness bound (or a synchronous mode, or a selection
  /// boundary) requires it; metrics() says why and for how long. Does not synchronize `stream`.
  /// A step whose gradients hold a NaN/Inf is skipped (nothing is updated or accumulated; a
  /// selection due at it waits for the next finite step). A step() that rejects its input leaves
  /// the coordinator as if the step had not begun: the gradients handed over so far are dropped
  /// and may be submitted again. After an error on a worker (or a failed backend operation) the
  /// coordinator is failed: every later call but metrics() and destruction rethrows that error.
  const step_metrics& step(stream_type stream);

  /// Completes all CPU work and writes it back (end of training, before evaluation or export).
  /// Gradients submitted since the last step() are dropped. Synchronizes with `stream`.
  void finish(stream_type stream);

  /// Writes the complete optimizer state to `path` (see detail/coordinator/checkpoint_io.hpp for
  /// the format). Drains pending CPU work first (its results stay pending, as in an uninterrupted
  /// run). Synchronizes with `stream`.
  void save_checkpoint(const std::string& path, stream_type stream);
  /// Restores a checkpoint written by save_checkpoint into a coordinator with the same options and
  /// registered parameters; resumes bit-identically. A truncated, corrupted or mismatched file is
  /// rejected before any state changes. Synchronizes with `stream`.
  void load_checkpoint(const std::string& path, stream_type stream);

 private:
  using clock = std::chrono::steady_clock;
  using device_buffer = typename Backend::device_buffer;

  struct parameter {
    std::string name;
    bool is_vector = false;
    matrix_view matrix{};
    vector_view vector{};
    dtype grad_type = dtype::f32;
    std::size_t cpu_tensor = 0;
    std::size_t selector_index = 0;
    std::size_t device_index = npos;          // in the device optimizer (npos: no GPU columns yet)
    adam_options adam;                        // hyper-parameters for the next step
    std::optional<adam_options> device_adam;  // the last ones handed to the device optimizer
    std::vector<std::int32_t> selection;      // GPU columns (ascending)
    std::vector<std::int32_t> complement;     // CPU columns (ascending)
    device_buffer complement_dev;             // device copy of complement (int32)
    device_buffer grad_stage[2];              // compact gathered gradient, per step parity
    // Recorded after this parameter's gather, per step parity; the offload worker's copies wait
    // for it (behind a pointer: events do not move).
    std::unique_ptr<std::array<typename Backend::event_type, 2>> gathered =
        std::make_unique<std::array<typename Backend::event_type, 2>>();
    std::vector<float> accumulator[2];    // fp32 accumulated compact gradient, per interval parity
    std::vector<std::byte> out_stage[2];  // CPU copy-out (param dtype, compact), per interval parity
    device_buffer writeback_dev[2];       // the same on the device, per interval parity
    const_matrix_view grad_matrix{};
    const_vector_view grad_vector{};
    bool has_grad = false;
    bool offloaded = false;  // this step's CPU columns are already handed to the offload worker
  };
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  // Work for the offload worker: one gathered gradient (or an interval marker).
  struct offload_job {
    std::int64_t step = 0;
    std::int64_t interval = 0;
    bool interval_end = false;  // marker: every gradient of `interval` has been handed over
    const std::byte* src = nullptr;
    std::size_t bytes = 0;
    dtype type = dtype::f32;
    float* accumulator = nullptr;
    const step_flags* flags = nullptr;  // host copy of the step's flags (valid once stats_ready_ completed)
    typename Backend::event_type* gathered = nullptr;  // the gather this copy must wait for
  };
  struct update_job {
    std::int64_t interval = 0;
    bool synchronous = false;
    std::vector<adam_options> adam;  // per parameter, as the interval ended
  };
  struct interval_state {
    std::int64_t index = 0;
    std::int64_t first_step = 0;
    std::int64_t steps = 0;  // training steps handed over so far
  };

  static zenflow_options validated(const zenflow_options& o) {
    o.validate();
    return o;
  }
  static std::size_t at_least_one_float(std::size_t v, const char* name) {
    expects(v >= 4, name, "must be >= 4 (a slot carries whole fp32 elements), got ", v);
    return v;
  }
  parameter& at(std::size_t i) {
    expects(i < params_.size(), "parameter", "index ", i, " out of range (", params_.size(), " registered)");
    return params_[i];
  }
  const parameter& at(std::size_t i) const {
    expects(i < params_.size(), "parameter", "index ", i, " out of range (", params_.size(), " registered)");
    return params_[i];
  }

  [[nodiscard]] bool warm_up() const noexcept {
    return options_.mode == offload_mode::zero_offload || step_ < options_.full_warm_up_rounds;
  }
  [[nodiscard]] bool overlapped() const noexcept { return options_.overlap_step && !warm_up(); }

  // A failed coordinator rethrows the first error from every call (it is never cleared).
  void rethrow_worker_error() const {
    std::lock_guard lock(mutex_);
    if (worker_error_) std::rethrow_exception(worker_error_);
  }
  void fail(std::exception_ptr e) {
    std::lock_guard lock(mutex_);
    if (!worker_error_) worker_error_ = std::move(e);
    failed_ = true;
    cv_.notify_all();
  }
  void stop_workers() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (offload_thread_.joinable()) offload_thread_.join();
    if (update_thread_.joinable()) update_thread_.join();
  }
  // Runs trainer-side work that changes the coordinator's state: an error in it leaves that state
  // half-changed, so it fails the coordinator as a worker error does.
  template <class F>
  decltype(auto) or_fail(F&& f) {
    try {
      return std::forward<F>(f)();
    } catch (...) {
      fail(std::current_exception());
      throw;
    }
  }
  void check_adam(const adam_options& adam) const {
    adam.validate();
    const char* field = adam.differs_beyond_lr_and_weight_decay(options_.adam);
    expects(field == nullptr, field ? field : "adam", "must stay as in options().adam: parameter groups and schedules ",
            "change lr and weight_decay only");
  }
  void check_submission(const parameter& p, std::size_t i) {
    expects(!p.has_grad, "grad", "parameter ", i, " (", p.name, ") already has a gradient in step ", step_,
            ": submit each gradient once per step");
    if constexpr (Backend::device_space == memory_space::host) {
      expects(!config_.check_stream_order || step_done_.query(), "grad", "parameter ", i, " (", p.name,
              ") was submitted in step ", step_, " while step ", step_ - 1,
              "'s parameter updates were still running on the stream: call stream.synchronize() after step() and "
              "before the backward that reads the parameters");
    }
  }

  // Waits (trainer thread) until pred() holds; time is charged to the step's stall.
  template <class Pred>
  void stall_until(Pred pred, const char* reason) {
    std::unique_lock lock(mutex_);
    if (pred()) return;
    const auto t0 = clock::now();
    cv_.wait(lock, [&] { return pred() || failed_; });
    metrics_.stall_seconds += std::chrono::duration<double>(clock::now() - t0).count();
    if (metrics_.stall_reason.empty()) metrics_.stall_reason = reason;
    if (worker_error_) std::rethrow_exception(worker_error_);
  }

  void start(stream_type stream);
  void begin_step();
  void abandon_step(stream_type stream);
  void run_step(stream_type stream);
  [[nodiscard]] bool selection_boundary() const;
  void offload_gradient(parameter& p, const step_flags* scale, stream_type stream);
  void set_selection(parameter& p, std::vector<std::int32_t> selection, stream_type stream);
  void reselect(stream_type stream);
  void end_interval(stream_type stream, bool synchronous, std::int64_t last_step);
  void begin_interval(std::int64_t index, std::int64_t first_step);
  void write_back(std::int64_t interval, stream_type stream, const char* reason, std::int64_t at_end_of);
  void setup_buffers(parameter& p, stream_type stream);
  [[nodiscard]] bool has_cpu_columns() const noexcept {
    for (const auto& p : params_)
      if (!p.is_vector && !p.complement.empty()) return true;
    return false;
  }
  void offload_loop();
  void update_loop();
  void run_update(const update_job& job);
  std::int64_t auto_interval() const;

  zenflow_options options_;
  coordinator_config config_;
  HostOptimizer host_opt_;
  device_optimizer_type device_opt_;
  selector_type selector_;
  selection_policy policy_;
  queue_type d2h_;
  queue_type h2d_;
  typename Backend::owned_stream offload_stream_;
  typename Backend::owned_stream writeback_stream_;
  std::vector<parameter> params_;
  device_buffer flags_dev_[2];
  device_buffer statistics_scratch_;              // the backend's scratch for the step's gradient statistics
  device_buffer unit_flags_dev_;                  // scale 1, no skip: for gathers during backward
  typename Backend::event_type stats_ready_[2];   // the step's flags reached the host (per step parity)
  typename Backend::event_type written_back_[2];  // the interval's scatter is done (per interval parity)
  typename Backend::host_buffer flags_host_[2];
  typename Backend::event_type step_done_;  // the last step's work on the trainer's stream (stream-order check)

  std::int64_t step_ = 0;
  bool started_ = false;
  bool in_step_ = false;         // a gradient of step_ was handed over, or step() is running
  bool step_offloaded_ = false;  // step_ handed at least one gradient to the offload worker
  bool selection_due_ = false;   // a selection fell on a skipped (non-finite) step: select at the next one
  step_metrics last_metrics_{};  // the metrics before begin_step (restored when a step is abandoned)
  interval_state interval_{};
  std::int64_t interval_target_ = 1;
  std::optional<std::int64_t> pending_interval_;  // CPU update launched, not yet written back
  step_metrics metrics_{};
  double last_overlap_ = 1.0;

  // Shared with the workers (mutex_).
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  std::deque<offload_job> offload_jobs_;
  std::deque<update_job> update_jobs_;
  std::int64_t offloaded_through_step_ = -1;  // every gradient of steps <= this is accumulated
  std::int64_t stats_ready_step_ = -1;        // the flags of steps <= this are recorded (stats_ready_)
  std::int64_t accumulated_interval_ = -1;    // intervals <= this are fully accumulated
  // Non-skipped steps per interval, by index % 4: at most three intervals are live at once (one
  // awaiting its write-back, one in its CPU update, one accumulating).
  std::array<std::int64_t, 4> accumulated_counts_{};
  std::int64_t& accumulated_count(std::int64_t interval) { return accumulated_counts_[interval % 4]; }
  std::int64_t updated_interval_ = -1;   // CPU updates of intervals <= this are done
  std::int64_t launched_interval_ = -1;  // CPU updates of intervals <= this were handed over
  std::vector<update_record> trace_;
  double last_update_seconds_ = 0.0;
  std::exception_ptr worker_error_;
  bool failed_ = false;
  bool stopping_ = false;
  std::thread offload_thread_;
  std::thread update_thread_;
};

/// The host instantiation: the full asynchronous schedule with a host_stream as the GPU stream.
using host_coordinator = basic_coordinator<host_backend>;

}  // namespace zenflow

#include "zenflow/detail/coordinator/coordinator_impl.hpp"
