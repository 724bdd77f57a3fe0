// The bounded-async coordinator: the whole ZenFlow step (README.md, "The schedule in one paragraph").
//
//   trainer thread        submit_gradient(i, grad, stream) ... step(stream)
//   trainer stream        statistics -> GPU sparse Adam (selected columns, 1-D params)
//                         -> gather of the unselected columns (scaled) -> [write-back scatter]
//   offload worker        D2H through the transfer queue, fp32 accumulation on the CPU
//                         (host_backend in one process: the trainer stream gathers and
//                         accumulates in one pass at step(), and the worker only keeps count)
//   update worker         CPU Adam on the mean accumulated gradient (the library's thread pool),
//                         low-precision copy-out, H2D through the transfer queue
//
// Staleness bound: the CPU result of interval i is written back at the end of interval i+1 at the
// latest with overlap_step (at the end of interval i without), exactly once, and never over the
// selected columns. A selection boundary first completes and writes back all CPU work, then
// re-selects and migrates optimizer state both ways (nothing is zeroed or truncated).
//
// The template takes an execution backend (a coordinator_backend, concepts.hpp) that names the
// component types and the "device" operations: host_backend ships here (a host_stream plays the
// GPU stream), cuda_backend with coordinator.cuh. This header declares the class (its
// configuration, metrics and the other values it takes and returns are in coordinator_types.hpp);
// the definitions live in detail/coordinator/: construction and the step (coordinator_impl.hpp),
// the trainer-facing calls (registration.hpp), the schedule between steps (intervals.hpp), state
// migration on reselection (migration.hpp), the offload and update workers (offload_worker.hpp,
// update_worker.hpp, both on worker_thread.hpp; the work they are handed in jobs.hpp, what they
// share with the trainer thread in shared_state.hpp), the per-step flags (step_flags.hpp), the
// trainer's edits of its parameters (reload.hpp) and checkpoints (checkpoint_io.hpp saves,
// checkpoint_load.hpp loads).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "zenflow/communicator.hpp"
#include "zenflow/concepts.hpp"
#include "zenflow/coordinator_types.hpp"
#include "zenflow/cpu_adam.hpp"
#include "zenflow/detail/coordinator/agreement.hpp"
#include "zenflow/detail/coordinator/host_backend.hpp"
#include "zenflow/detail/coordinator/schedule.hpp"
#include "zenflow/detail/coordinator/shared_state.hpp"
#include "zenflow/detail/coordinator/step_flags.hpp"
#include "zenflow/error.hpp"
#include "zenflow/importance_selector.hpp"
#include "zenflow/options.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

namespace detail {
template <class Backend>
class offload_worker;
template <class Backend, class HostOptimizer>
class update_worker;
struct parameter_memory;
class checkpoint_reader;
}  // namespace detail

namespace detail {
/// Rank r's columns of a parameter with `cols` columns over `ranks` ranks: consecutive, balanced
/// to one column (every column of a parameter has the same bytes of CPU state).
inline column_range owned_range(index_t cols, int r, int ranks) noexcept {
  return {cols * r / ranks, cols * (r + 1) / ranks};
}

/// The score communicator of a data-parallel coordinator's selector: the column scores are summed
/// over the ranks through the coordinator's communicator before top-k.
template <class Communicator>
class score_reducer {
 public:
  score_reducer() = default;
  explicit score_reducer(Communicator* comm) : comm_(comm) {
    if constexpr (std::same_as<typename Communicator::stream_type, host_stream*>)
      stream_ = std::make_shared<host_stream>();
  }
  /// The host selector's synchronous form (scores in host memory).
  void all_reduce_sum(std::span<float> values) const {
    if constexpr (std::same_as<typename Communicator::stream_type, host_stream*>) {
      comm_->all_reduce(std::span<const float>(values), values, reduce_op::sum, stream_.get());
      stream_->synchronize();
      comm_->check();
    } else {
      throw error("score_reducer", "this communicator reduces scores on a device stream only");
    }
  }
  /// The device selector's stream-ordered form.
  template <class Stream>
  void all_reduce_sum(std::span<float> values, Stream stream) const {
    comm_->all_reduce(std::span<const float>(values), values, reduce_op::sum, stream);
  }
  [[nodiscard]] int world_size() const { return comm_ == nullptr ? 1 : comm_->size(); }

 private:
  Communicator* comm_ = nullptr;
  std::shared_ptr<host_stream> stream_;
};

/// The scope a coordinator's public calls run under: the backend's device_scope (its device
/// current, the caller's restored after), or nothing for a backend without one.
template <class Backend>
struct device_scope_of {
  struct type {
    explicit type(int) noexcept {}
  };
};
template <class Backend>
requires requires {
  typename Backend::device_scope;
}
struct device_scope_of<Backend> {
  using type = typename Backend::device_scope;
};

template <class Backend, class Communicator>
struct coordinator_selector {
  using type = typename Backend::template selector_with<score_reducer<Communicator>>;
};
template <class Backend>
struct coordinator_selector<Backend, single_process> {
  using type = typename Backend::selector_type;
};
}  // namespace detail

/// The schedule over an execution backend (host_backend, cuda_backend) and a CPU optimizer. The
/// CPU optimizer is a template parameter so that a trainer (or a test) can plug in its own: the
/// host_optimizer concept lists exactly what the coordinator calls on it.
///
/// Data parallel (docs/DATA_PARALLEL.md): with a `communicator` as the third argument (an
/// mpi_communicator for the host backend, an nccl_communicator for the CUDA backend) the
/// coordinator is one rank of a data-parallel group. Every rank registers the same parameters with
/// the same initial values and options, hands over its own micro-batch's gradients and calls
/// step() as in one process; the step applies the mean gradient over the ranks. The columns of
/// every 2-D parameter are cut into one contiguous range per rank (owned_columns(i)); a rank's
/// CPU optimizer holds and updates the state of its range only. Per step, on the trainer's stream:
/// the selected columns' and the 1-D parameters' gradients are all-reduced (every rank applies the
/// same GPU update), the CPU columns' gradients are reduce-scattered to their owners, the
/// statistics (clip norm, non-finite count) are all-reduced, and a CPU update's result is
/// all-gathered as it is written back; at a selection the column scores are all-reduced before
/// top-k and the entering columns' state is all-gathered from its owners.
template <coordinator_backend Backend, host_optimizer HostOptimizer = cpu_adam,
          coordinator_communicator<Backend> Communicator = single_process>
class basic_coordinator {
 public:
  using backend_type = Backend;
  using communicator_type = Communicator;
  using stream_type = typename Backend::stream_type;
  using selector_type = typename detail::coordinator_selector<Backend, Communicator>::type;
  using device_optimizer_type = typename Backend::device_optimizer_type;
  using queue_type = typename Backend::queue_type;
  /// The state the two optimizers exchange (state_slots.hpp): slot 0 the master, then theirs.
  using slots_type = typename HostOptimizer::slots_type;
  static_assert(std::same_as<slots_type, typename device_optimizer_type::slots_type>,
                "the host optimizer and the backend's device optimizer must hold the same state slots: a reselection "
                "moves one's export into the other");
  /// The hyper-parameters of both optimizers (hyper_parameters.hpp), and the options holding them.
  using hyper_parameters_type = typename HostOptimizer::hyper_parameters;
  using options_type = basic_zenflow_options<hyper_parameters_type>;
  static_assert(std::same_as<hyper_parameters_type, typename device_optimizer_type::hyper_parameters>,
                "the host optimizer and the backend's device optimizer must take the same hyper-parameters: they "
                "update the columns of one parameter with one set of them");

  /// Validates the options and the config (throws naming the field); starts the worker threads.
  /// Does not synchronize. The device current at construction is the coordinator's: every later
  /// call makes it current for its duration (the caller's is restored), whatever device is current
  /// when it is made.
  explicit basic_coordinator(const options_type& options,
                             const coordinator_config& config = {}) requires std::same_as<Communicator, single_process>;
  /// One rank of a data-parallel group: `comm` (kept by the caller, outliving the coordinator)
  /// carries every collective. Collective calls are made by the trainer thread only, in the same
  /// order on every rank. Does not communicate (the first step() checks that the ranks agree on
  /// the options and parameters).
  basic_coordinator(Communicator& comm, const options_type& options,
                    const coordinator_config& config = {}) requires(!std::same_as<Communicator, single_process>);

  basic_coordinator(const basic_coordinator&) = delete;
  basic_coordinator& operator=(const basic_coordinator&) = delete;

  /// Stops the workers after the work already handed to them (pending CPU updates finish; their
  /// results are not written back: call finish() for that). Never throws.
  ~basic_coordinator();

  [[nodiscard]] const options_type& options() const noexcept;
  /// This rank and the number of ranks (0 and 1 in one process).
  [[nodiscard]] int rank() const noexcept;
  [[nodiscard]] int ranks() const noexcept;
  /// The columns of 2-D parameter i whose CPU state this rank holds (all of them in one process):
  /// host_optimizer()'s tensor of parameter i holds these columns, in order. Empty for a 1-D one.
  [[nodiscard]] column_range owned_columns(std::size_t i) const;
  [[nodiscard]] std::int64_t step_count() const noexcept;
  /// The last step's metrics (also after a failure).
  [[nodiscard]] const step_metrics& metrics() const noexcept;
  /// The gradients of the last step this coordinator ran: whether it was skipped (a NaN/Inf;
  /// step() does not wait to find out) and their global norm before max_grad_norm clipping (of the
  /// mean gradient in data parallel). nullopt before the first step. Waits for that step's
  /// statistics on the trainer's stream (an event, not the whole stream).
  [[nodiscard]] std::optional<step_gradients> last_step_gradients();
  /// One record per CPU update launched so far (coordinator_config::record_trace; else empty).
  [[nodiscard]] std::vector<update_record> trace() const;
  /// The CPU optimizer, for reading its state between steps. Waits for CPU updates already
  /// launched (the update worker writes that state); the state then stays as it is until the next
  /// step(), which is how long the reference may be used. A result that is not yet written back is
  /// already in it.
  [[nodiscard]] const HostOptimizer& host_optimizer() const;
  [[nodiscard]] const device_optimizer_type& device_optimizer() const noexcept;
  /// The host memory this coordinator holds for its CPU columns, by what it is for (fixed between
  /// reselections). Waits for CPU updates already launched, as host_optimizer().
  [[nodiscard]] host_memory_bytes host_memory() const;
  /// Parameter i's own step counts, as torch keeps a `step` per parameter (they differ from the
  /// optimizers' counts when gradients were missing, see step()): the CPU updates applied to its
  /// columns (0 for a 1-D parameter; waits for CPU updates already launched, as host_optimizer()),
  /// and the GPU updates of its selected columns or of the 1-D parameter (0 before it has GPU
  /// columns; reads the device optimizer: call it when the stream is idle, e.g. after finish()).
  [[nodiscard]] std::int64_t cpu_step_count(std::size_t i) const;
  [[nodiscard]] std::int64_t gpu_step_count(std::size_t i) const;
  [[nodiscard]] std::size_t parameter_count() const noexcept;
  [[nodiscard]] const std::string& name(std::size_t i) const;
  /// Parameter i's hyper-parameters for the next step (options().optimizer until changed).
  [[nodiscard]] const hyper_parameters_type& hyper_parameters_of(std::size_t i) const;

  /// Learning-rate schedules and parameter groups: every parameter's (or parameter i's)
  /// hyper-parameters from the next step on. The GPU update of a step uses those set before its
  /// step(); the CPU update of an interval uses those in effect when the interval ended (at the
  /// step() that ends it, at a reselection or in finish()), in sync and async mode alike. They may
  /// differ from options().optimizer in their per-group fields only (hyper_parameter_field; Adam:
  /// lr, beta1, beta2, eps and weight_decay), else throws naming the first other field that
  /// differs; they are validated here, once. Saved in checkpoints. Does not synchronize.
  void set_hyper_parameters(const hyper_parameters_type& hp);
  void set_hyper_parameters(std::size_t i, const hyper_parameters_type& hp);

  /// Columns of parameter i updated on the GPU now (ascending; empty for 1-D parameters).
  [[nodiscard]] std::span<const std::int32_t> gpu_columns(std::size_t i) const;

  /// Registers a 2-D parameter (before the first step). `param` is the model's weight in device
  /// memory (updated in place); `initial` its initial values in host memory (same shape, any
  /// layout), either fp32 (an fp32 master the trainer keeps) or in the parameter's own dtype
  /// (upcast exactly); `grad_type` the dtype its gradients will have. Returns the parameter's index.
  std::size_t register_parameter(std::string name, matrix_view param, const_matrix_view initial, dtype grad_type);

  /// Registers a 1-D parameter (bias, norm): always updated on the GPU.
  std::size_t register_parameter(std::string name, vector_view param, std::span<const float> initial);

  /// Hands over parameter i's gradient for the current step (call as backward produces it), once
  /// per parameter and step. `grad` must stay valid until `stream` has passed step(). The gradient
  /// must have been computed from the parameters as the previous step left them: on a GPU, work
  /// enqueued on `stream` after step() sees them; with the host backend the trainer's own code
  /// reads them, so it must call stream.synchronize() after step() and before its backward (see
  /// coordinator_config::check_stream_order). Does not synchronize.
  void submit_gradient(std::size_t i, const_matrix_view grad, stream_type stream);
  void submit_gradient(std::size_t i, const_vector_view grad, stream_type stream);

  /// Ends the training step: GPU update of the selected columns, offload of the rest, and the
  /// CPU schedule. Blocks only where the staleness bound (or a synchronous mode, or a selection
  /// boundary) requires it; metrics() says why and for how long. Does not synchronize `stream`.
  /// A step whose gradients hold a NaN/Inf is skipped: none of its gradients is applied or
  /// accumulated, and a selection due at it waits for the next finite step. A CPU update due at it
  /// (the interval that ends there; with overlap_step, the pending one the staleness bound writes
  /// back) holds earlier steps' gradients only and is still written back: as if those steps had
  /// run and then finish(). A step() that rejects its input leaves the coordinator as if the step
  /// had not begun: the gradients handed over so far are dropped and may be submitted again. After
  /// an error on a worker (or a failed backend operation) the coordinator is failed: every later
  /// call but metrics() and destruction rethrows that error.
  ///
  /// Data parallel: every rank must give the same parameters gradients (a parameter missing on
  /// some ranks only is rejected on every rank, which all drop the step's gradients). The step
  /// overwrites the selected columns of each 2-D gradient with their sum over the ranks (the
  /// trainer's gradients are not needed after step(), as with DDP's in-place averaging).
  ///
  /// A parameter without a gradient in the step: rejected by default (step() throws naming it and
  /// drops the step's gradients). With missing_gradients::skip it is skipped, as torch.optim.AdamW
  /// skips a parameter whose `.grad` is None; every step count is per parameter, as torch's `step`:
  /// - GPU path (its selected columns, a 1-D parameter): no update, its device step count (bias
  ///   correction) does not advance;
  /// - CPU path: the step adds nothing to its accumulated gradient; an interval's CPU update uses
  ///   the mean over the steps that did give it a gradient (its own count), and a parameter with
  ///   no gradient in the whole interval gets no CPU update (its CPU step count stays) and no
  ///   write-back;
  /// - the gradient statistics (clip norm, non-finite check) cover the gradients given only;
  /// - selection: at a selection step it keeps its previous selection; one that has none yet keeps
  ///   every column on the CPU until a selection step at which it has a gradient (the first
  ///   selection happens at the first step after warm-up at which some 2-D parameter has one;
  ///   dense mode moves every column to the GPU at once, no gradient needed);
  /// - a 2-D parameter's device step count starts at its first selection from the device
  ///   optimizer's count of applied steps, as without missing gradients.
  /// A step with no gradient at all still counts as a training step (step_count(), intervals).
  const step_metrics& step(stream_type stream, missing_gradients missing = missing_gradients::reject);

  /// Completes all CPU work and writes it back (end of training, before evaluation or export).
  /// Gradients submitted since the last step() are dropped. Synchronizes with `stream`.
  void finish(stream_type stream);

  /// Drops the gradients handed over since the last step() (they may be submitted again), as a
  /// step() that rejects its input does, and changes nothing else: for a trainer whose iteration
  /// stopped between backward and step() (an exception, a skipped step) or whose gradients changed
  /// after it handed them over. Waits until the offload worker has dropped those it already took:
  /// on return no work reads them any more. Does nothing when none was handed over.
  void discard_gradients(stream_type stream);

  /// Adopts the trainer's edit of parameter i between steps (clamped, re-initialised, rolled back
  /// to earlier weights; the trainer's weights are the truth): reads its current values into the
  /// fp32 master of its GPU columns (the device optimizer) and of this rank's CPU columns (the CPU
  /// optimizer), keeping moments, step counts, the selection and the gradients accumulated so far.
  /// An element whose value is its master rounded to the parameter's dtype keeps that master (a
  /// bf16/fp16 parameter keeps the bits below its precision); every other element takes the value,
  /// upcast exactly.
  ///
  /// A CPU update in flight (overlap_step: launched, or done and not yet written back): the edit
  /// wins. The update completes first (its moments and step counts stay); then every element of
  /// parameter i's CPU columns takes its value as it is now, and the update's pending write-back
  /// writes those values to parameter i instead of the update's result (the other parameters get
  /// theirs). To edit the updated values instead, call finish() before editing.
  ///
  /// May be called between steps, or between submit_gradient and step(). Data parallel: not
  /// collective; each rank reads its own copy (edit every rank's copy alike, as with DDP).
  /// Synchronizes with `stream`.
  void reload_parameter(std::size_t i, stream_type stream);

  /// Writes the complete optimizer state to `path` (see detail/coordinator/checkpoint_io.hpp for
  /// the format), and with checkpoint_contents::everything the parameters' values. Drains pending
  /// CPU work first (its results stay pending, as in an uninterrupted run). Synchronizes with
  /// `stream`.
  void save_checkpoint(const std::string& path, stream_type stream,
                       checkpoint_contents contents = checkpoint_contents::everything);
  /// Restores a checkpoint written by save_checkpoint into a freshly constructed coordinator (no
  /// step() or load yet) with the same options and registered parameters; resumes bit-identically.
  /// The schedule's options and the optimizer's shared fields (Adam: its variant and bias
  /// correction) must match (a difference is rejected, naming it); each parameter's per-group
  /// fields (Adam: lr, betas, eps, weight_decay) come from the checkpoint (hyper_parameters_of;
  /// options().optimizer stays the constructor's), and max_grad_norm is this coordinator's. A
  /// checkpoint of checkpoint_contents::optimizer_state takes the parameters' values as they are:
  /// restore them first. A truncated, corrupted or mismatched file is rejected before any state
  /// changes. `match`: whether the parameters' names must agree too (checkpoint_match).
  /// Synchronizes with `stream`.
  void load_checkpoint(const std::string& path, stream_type stream, checkpoint_match match = checkpoint_match::names);

 private:
  using clock = std::chrono::steady_clock;
  using device_scope = typename detail::device_scope_of<Backend>::type;
  using device_buffer = typename Backend::device_buffer;
  using event_type = typename Backend::event_type;

  struct parameter {
    std::string name;
    bool is_vector = false;
    matrix_view matrix{};
    vector_view vector{};
    dtype grad_type = dtype::f32;
    std::size_t cpu_tensor = 0;
    std::size_t selector_index = 0;
    std::size_t device_index = npos;          // in the device optimizer (npos: no GPU columns yet)
    hyper_parameters_type hyper;              // hyper-parameters for the next step
    std::optional<hyper_parameters_type> device_hyper;  // the last ones handed to the device optimizer
    std::vector<std::int32_t> gpu_columns;    // updated on the GPU (ascending)
    std::vector<std::int32_t> cpu_columns;    // the rest, updated on the CPU (ascending)
    device_buffer cpu_columns_dev;            // device copy of cpu_columns (int32)
    // What a step's offload uses, per step parity (step % 2; behind a pointer: events do not move).
    struct step_buffers {
      device_buffer grad_stage;  // compact gathered gradient
      // Recorded after this parameter's gather; the offload worker's copies wait for it.
      event_type gathered;
    };
    std::unique_ptr<std::array<step_buffers, 2>> by_step = std::make_unique<std::array<step_buffers, 2>>();
    // What an interval's accumulation, CPU update and write-back use, per interval parity
    // (interval % 2); with overlap_step both, else by_interval[0]'s accumulator only (accumulator_of).
    struct interval_buffers {
      std::vector<float> accumulator;  // fp32 accumulated compact gradient
      // Non-skipped steps accumulated in the interval: written by the offload worker, read by the
      // update worker and by the trainer once the interval is accumulated, reset by the trainer
      // when the interval of that parity begins.
      std::int64_t accumulated = 0;
      device_buffer writeback_dev;  // the CPU update's result (param dtype, compact) the write-back reads
      // Not null: the interval's one step is updated in place (updates_in_place), with these flags
      // (the step's, in host memory): no accumulator, no write-back staging, no scatter. Set by the
      // trainer at the offload, reset when the interval of that parity begins.
      const step_flags* in_place = nullptr;
    };
    std::array<interval_buffers, 2> by_interval;
    // CPU updates applied to this parameter's columns (its CPU bias correction, as torch's per
    // parameter `step`): written by the update worker, read by the trainer when it is drained.
    std::int64_t cpu_steps = 0;
    const_matrix_view grad_matrix{};
    const_vector_view grad_vector{};
    bool has_grad = false;
    bool offloaded = false;  // this step's CPU columns are already handed to the offload worker
    // Data parallel (one process: the whole parameter, one piece).
    column_range owned{};                   // the columns whose CPU state this rank holds
    std::vector<std::int32_t> owned_local;  // the owned CPU columns, as columns of the CPU tensor
    std::vector<std::size_t> pieces;        // ranks + 1 bounds: cpu_columns[pieces[r], pieces[r+1]) is rank r's
    std::size_t block = 0;                  // elements of the largest piece: the collectives' block
    device_buffer gpu_columns_dev;          // device copy of gpu_columns (int32)
    device_buffer selected_stage;           // the selected columns' compact gradient (all-reduced)
    device_buffer vector_stage;             // a 1-D parameter's all-reduced gradient
  };
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  // The accumulator interval i accumulates into: one per interval parity when a CPU update may run
  // while the next interval accumulates (overlap_step), else one for every interval (each update
  // completes before the next interval begins): 4 bytes per CPU-column element instead of 8.
  template <class Parameter>  // parameter or const parameter
  [[nodiscard]] auto& accumulator_of(Parameter& p, std::int64_t interval) const noexcept {
    return p.by_interval[staging_parity(interval)].accumulator;
  }
  // The write-back staging interval i's CPU update writes and its write-back scatters from, and
  // that write-back's event: as accumulator_of, one for every interval unless a CPU update may run
  // while the previous interval's result still waits for its write-back (overlap_step).
  template <class Parameter>
  [[nodiscard]] auto& writeback_of(Parameter& p, std::int64_t interval) const noexcept {
    return p.by_interval[staging_parity(interval)].writeback_dev;
  }
  [[nodiscard]] event_type& written_back_of(std::int64_t interval) noexcept {
    return by_interval_[staging_parity(interval)].written_back;
  }
  [[nodiscard]] int staging_parity(std::int64_t interval) const noexcept {
    return options_.overlap_step ? static_cast<int>(interval % 2) : 0;
  }

  // Construction (coordinator_impl.hpp).
  struct private_tag {};
  basic_coordinator(private_tag, Communicator* comm, const options_type& options, const coordinator_config& config);
  static selector_type make_selector(const options_type& options, Communicator* comm);
  static options_type validated(const options_type& options);
  static coordinator_config validated(const coordinator_config& config);
  static HostOptimizer make_host_optimizer(const hyper_parameters_type& hp, const coordinator_config& config,
                                           const std::vector<int>& cpus, Communicator* comm);
  void stop_workers() noexcept;

  // Checks and failure (registration.hpp).
  parameter& at(std::size_t i);
  const parameter& at(std::size_t i) const;
  void check_hyper_parameters(const hyper_parameters_type& hp) const;
  void check_submission(const parameter& p, std::size_t i);
  /// A host backend's stream is a host_stream*: null is rejected by name (a CUDA stream's null is
  /// the legacy default stream, valid).
  static void check_stream(stream_type stream);
  /// A parameter about to be registered shares no memory with a registered one (names both).
  void check_own_memory(const detail::parameter_memory& memory) const;
  void rethrow_worker_error() const;
  template <class F>
  decltype(auto) or_fail(F&& f);
  template <class Pred>
  void stall_until(Pred pred, const char* reason);

  // The schedule (intervals.hpp; run_step in coordinator_impl.hpp).
  [[nodiscard]] bool in_warm_up() const noexcept;
  [[nodiscard]] bool overlapped() const noexcept;
  [[nodiscard]] bool has_cpu_columns() const noexcept;
  [[nodiscard]] const step_flags* unit_flags() const noexcept;
  void start(stream_type stream);
  void begin_step();
  void abandon_step(stream_type stream);
  void run_step(stream_type stream);
  [[nodiscard]] bool selection_boundary() const;
  [[nodiscard]] bool updates_in_place(const parameter& p) const noexcept;
  [[nodiscard]] bool expects_in_place(const parameter& p) const noexcept;
  void offload_gradient(parameter& p, const step_flags* flags, stream_type stream);
  void hand_over(parameter& p, std::size_t offset, std::size_t bytes, bool scale_by_flags, stream_type stream);
  void reselect(stream_type stream);
  [[nodiscard]] detail::interval_masses selection_masses() const;
  void end_interval(stream_type stream, bool synchronous, std::int64_t last_step);
  void begin_interval(std::int64_t index, std::int64_t first_step, stream_type stream);
  [[nodiscard]] std::int64_t steps_for_cpu_update(stream_type stream);
  void write_back(std::int64_t interval, stream_type stream, const char* reason, std::int64_t at_end_of);

  // State migration (migration.hpp).
  void set_selection(parameter& p, std::vector<std::int32_t> selection, stream_type stream);
  void setup_buffers(parameter& p, stream_type stream);
  void stage_late(parameter& p, std::int64_t interval);
  float* migration_scratch();

  // Data parallel (data_parallel.hpp).
  static constexpr bool data_parallel = !std::same_as<Communicator, single_process>;
  // One process on a backend that accumulates the CPU columns' gradients on its stream (R13:
  // host_backend): at step(), with the step's flags; no gradient staging, no hand-over during
  // backward.
  static constexpr bool accumulates_on_stream = !data_parallel && detail::accumulates_on_stream<Backend>;
  // ... whose device memory is host memory, read and written by the CPU update itself
  // (updates_in_place).
  static constexpr bool can_update_in_place =
      accumulates_on_stream && Backend::device_space == memory_space::host && detail::copies_out_in_place<Backend>;
  [[nodiscard]] std::size_t owned_piece_elements(const parameter& p) const noexcept;
  [[nodiscard]] detail::agreement agreement_of(std::int64_t kind, const detail::agreement_position& at) const;
  [[nodiscard]] detail::agreement_position current_position() const;
  void agree(const detail::agreement& mine);
  void refuse_checkpoint(const std::exception_ptr& e);
  void agree_on_gradients(missing_gradients missing, stream_type stream);
  void reduce_gradients(stream_type stream);
  void reduced_statistics(step_flags* flags_dev, step_flags* flags_host_dev, stream_type stream);
  [[nodiscard]] bool any_nonfinite_gradient(stream_type stream);
  template <class T>
  std::vector<T> all_reduce_to_host(std::span<const T> values, reduce_op op);
  template <class Enqueue>
  void on_control_stream(std::size_t bytes, Enqueue&& enqueue);
  void collectives_enqueued(stream_type stream);
  template <class Enqueue>
  void grouped(Enqueue&& enqueue);
  void fail_peers(const std::exception_ptr& e) noexcept;

  // Checkpoints (checkpoint_io.hpp, checkpoint_load.hpp).
  void copy_all_columns(const parameter& p, std::span<std::byte> values, transfer_direction direction,
                        stream_type stream);
  void read_checkpoint(detail::checkpoint_reader& r, stream_type stream, checkpoint_match match, int& stage);

  int device_;  // the device current at construction: every public call runs under it (device_scope)
  options_type options_;
  coordinator_config config_;
  std::vector<int> worker_cpus_;  // the CPUs of the workers and their pools (reserved_cpus; empty: all)
  Communicator* comm_ = nullptr;  // data parallel: the caller's communicator
  int rank_ = 0;
  int ranks_ = 1;
  device_buffer reduce_scratch_;    // data parallel: the statistics' all-reduce (two doubles)
  device_buffer agreement_buffer_;  // data parallel: on_control_stream's buffers (device, pinned host)
  typename Backend::host_buffer agreement_host_;
  // Data parallel: the stream of the collectives whose result the host reads (agreement, which
  // parameters got gradients), so that reading them never waits for the trainer's stream; it runs
  // them after the trainer stream's collectives enqueued before (collectives_done_).
  std::unique_ptr<typename Backend::owned_stream> control_stream_;
  event_type collectives_done_;
  bool agreed_ = false;                  // data parallel: the ranks compared their records (first step or checkpoint)
  std::uint64_t initial_values_ = detail::fingerprint_basis;  // data parallel: the registered values' fingerprints
  mutable detail::shared_state shared_;  // with the workers: progress counters, first error, stop request
  HostOptimizer host_opt_;
  device_optimizer_type device_opt_;
  selector_type selector_;
  detail::offload_worker<Backend> offload_;
  detail::update_worker<Backend, HostOptimizer> update_;
  std::vector<parameter> params_;
  device_buffer statistics_scratch_;  // the backend's scratch for the step's gradient statistics
  device_buffer unit_flags_dev_;      // scale 1, no skip: gathers during backward and for checkpoints
  device_buffer migration_scratch_;   // the state of the columns a selection moves (migration_scratch)
  // The step's flags, per step parity (step % 2).
  struct step_flags_buffers {
    device_buffer flags_dev;
    typename Backend::host_buffer flags_host;
    event_type stats_ready;  // the step's flags reached the host
  };
  step_flags_buffers by_step_[2];
  // Per interval parity (interval % 2).
  struct interval_events {
    event_type written_back;  // the interval's scatter is done
  };
  interval_events by_interval_[2];
  event_type step_done_;  // the last step's work on the trainer's stream (stream-order check)

  // The trainer thread's own state.
  std::int64_t step_ = 0;
  bool ran_step_ = false;        // a step ran in this coordinator (its flags are by_step_[(step_ - 1) % 2]'s)
  detail::schedule schedule_;    // warm-up, selections, intervals, the pending write-back
  bool in_step_ = false;         // a gradient of step_ was handed over, or step() is running
  bool step_offloaded_ = false;  // step_ handed at least one gradient to the offload worker
  step_metrics last_metrics_{};  // the metrics before begin_step (restored when a step is abandoned)
  step_metrics metrics_{};
  double last_overlap_ = 1.0;
  // cover_cpu_update's measure of the current interval: when it began in this process (the
  // interval a checkpoint load lands in is not timed) and how long its steps stalled.
  std::optional<clock::time_point> interval_began_;
  double interval_stalled_ = 0.0;
};

/// The host instantiation: the full asynchronous schedule with a host_stream as the GPU stream.
using host_coordinator = basic_coordinator<host_backend>;
/// One rank of a data-parallel host coordinator (e.g. over an mpi_communicator).
template <class Communicator>
using data_parallel_host_coordinator = basic_coordinator<host_backend, cpu_adam, Communicator>;

}  // namespace zenflow

#include "zenflow/detail/coordinator/coordinator_impl.hpp"
