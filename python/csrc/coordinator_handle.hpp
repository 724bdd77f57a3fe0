// zenflow.torch: one type-erased handle over basic_coordinator, so that the Python binding (g++,
// host_coordinator) and the CUDA translation unit (nvcc, cuda_coordinator) share one interface.
//
// The handle takes zenflow views and an opaque stream (`void*`): a cudaStream_t for the CUDA
// backend; ignored by the host backend, which owns the host_stream that plays the GPU stream (its
// device work on `cpu_threads` threads, as many as the CPU Adam's) and synchronizes it at the end
// of every call that enqueued work (torch's CPU tensors are read by the next forward pass right
// away).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "zenflow/coordinator.hpp"
#include "zenflow/host_stream.hpp"

namespace zenflow_torch {

/// The coordinator behind a virtual interface (one instance per optimizer).
class handle {
 public:
  virtual ~handle() = default;
  [[nodiscard]] virtual const char* backend() const noexcept = 0;
  virtual std::size_t add_matrix(std::string name, zenflow::matrix_view param, zenflow::const_matrix_view initial,
                                 zenflow::dtype grad_type, const zenflow::adam_options& adam) = 0;
  virtual std::size_t add_vector(std::string name, zenflow::vector_view param, std::span<const float> initial,
                                 const zenflow::adam_options& adam) = 0;
  virtual void submit(std::size_t i, zenflow::const_matrix_view grad, void* stream) = 0;
  virtual void submit(std::size_t i, zenflow::const_vector_view grad, void* stream) = 0;
  virtual zenflow::step_metrics step(void* stream) = 0;
  virtual void finish(void* stream) = 0;
  virtual void discard_gradients(void* stream) = 0;
  virtual void reload_parameter(std::size_t i, void* stream) = 0;
  virtual void save(const std::string& path, zenflow::checkpoint_contents contents, void* stream) = 0;
  virtual void load(const std::string& path, void* stream, zenflow::checkpoint_match match) = 0;
  virtual void set_hyper_parameters(std::size_t i, const zenflow::adam_options& adam) = 0;
  [[nodiscard]] virtual zenflow::step_metrics metrics() const = 0;
  /// basic_coordinator::last_step_gradients (waits for the last step's statistics).
  [[nodiscard]] virtual std::optional<zenflow::step_gradients> last_step_gradients() = 0;
  [[nodiscard]] virtual std::vector<zenflow::update_record> trace() const = 0;
  [[nodiscard]] virtual std::vector<std::int32_t> gpu_columns(std::size_t i) const = 0;
  [[nodiscard]] virtual std::int64_t step_count() const = 0;
  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int ranks() const noexcept = 0;
  /// [first, last) of the columns of 2-D parameter i whose CPU state this rank holds.
  [[nodiscard]] virtual std::pair<std::int64_t, std::int64_t> owned_columns(std::size_t i) const = 0;
  /// The CPU optimizer's state file (cpu_adam::nvme_status): "" with the state in RAM.
  [[nodiscard]] virtual std::string nvme_status() const = 0;
  /// What the coordinator holds for its CPU columns (basic_coordinator::host_memory; waits for the
  /// CPU updates launched so far).
  [[nodiscard]] virtual zenflow::host_memory_bytes host_memory() const = 0;
  /// Data parallel: fails this rank's group on purpose (its communicator is aborted with `reason`,
  /// which reaches the peers), so that closing the handle waits for no peer and issues no
  /// collective: what a rank that exits after an error does instead of finish(). One process:
  /// nothing. The handle is then only to be destroyed. noexcept.
  virtual void abort(const std::string& reason) noexcept = 0;
};

/// The handle over one coordinator type (host_coordinator, cuda_coordinator, or a data-parallel
/// coordinator over `Communicator`, which the handle owns).
template <class Coordinator, class Communicator = void>
class coordinator_handle final : public handle {
  using stream_type = typename Coordinator::stream_type;
  static constexpr bool host = std::is_same_v<stream_type, zenflow::host_stream*>;
  static constexpr bool data_parallel = !std::is_void_v<Communicator>;

 public:
  coordinator_handle(const zenflow::zenflow_options& options,
                     const zenflow::coordinator_config& config) requires(!data_parallel)
      : stream_(config), coordinator_(options, config) {}
  /// One rank of a data-parallel group; `communicator` lives as long as the handle.
  template <class C = Communicator>
  coordinator_handle(std::unique_ptr<C> communicator, const zenflow::zenflow_options& options,
                     const zenflow::coordinator_config& config) requires(data_parallel)
      : stream_(config), communicator_(std::move(communicator)), coordinator_(*communicator_, options, config) {}

  [[nodiscard]] const char* backend() const noexcept override { return host ? "host" : "cuda"; }

  std::size_t add_matrix(std::string name, zenflow::matrix_view param, zenflow::const_matrix_view initial,
                         zenflow::dtype grad_type, const zenflow::adam_options& adam) override {
    const std::size_t i = coordinator_.register_parameter(std::move(name), param, initial, grad_type);
    coordinator_.set_hyper_parameters(i, adam);
    return i;
  }
  std::size_t add_vector(std::string name, zenflow::vector_view param, std::span<const float> initial,
                         const zenflow::adam_options& adam) override {
    const std::size_t i = coordinator_.register_parameter(std::move(name), param, initial);
    coordinator_.set_hyper_parameters(i, adam);
    return i;
  }
  void submit(std::size_t i, zenflow::const_matrix_view grad, void* stream) override {
    coordinator_.submit_gradient(i, grad, to_stream(stream));
  }
  void submit(std::size_t i, zenflow::const_vector_view grad, void* stream) override {
    coordinator_.submit_gradient(i, grad, to_stream(stream));
  }
  zenflow::step_metrics step(void* stream) override {
    // A parameter whose .grad is None this step is skipped, as torch.optim.AdamW skips it (the
    // Python layer checked the gradients that are there).
    zenflow::step_metrics m = coordinator_.step(to_stream(stream), zenflow::missing_gradients::skip);
    if constexpr (host) stream_.stream.synchronize();
    return m;
  }
  void finish(void* stream) override { coordinator_.finish(to_stream(stream)); }
  void discard_gradients(void* stream) override {
    coordinator_.discard_gradients(to_stream(stream));
    if constexpr (host) stream_.stream.synchronize();
  }
  void reload_parameter(std::size_t i, void* stream) override {
    coordinator_.reload_parameter(i, to_stream(stream));  // synchronizes
  }
  void save(const std::string& path, zenflow::checkpoint_contents contents, void* stream) override {
    coordinator_.save_checkpoint(path, to_stream(stream), contents);
  }
  void load(const std::string& path, void* stream, zenflow::checkpoint_match match) override {
    coordinator_.load_checkpoint(path, to_stream(stream), match);
  }
  void set_hyper_parameters(std::size_t i, const zenflow::adam_options& adam) override {
    coordinator_.set_hyper_parameters(i, adam);
  }
  [[nodiscard]] zenflow::step_metrics metrics() const override { return coordinator_.metrics(); }
  [[nodiscard]] std::optional<zenflow::step_gradients> last_step_gradients() override {
    return coordinator_.last_step_gradients();
  }
  [[nodiscard]] std::vector<zenflow::update_record> trace() const override { return coordinator_.trace(); }
  [[nodiscard]] std::vector<std::int32_t> gpu_columns(std::size_t i) const override {
    const auto c = coordinator_.gpu_columns(i);
    return {c.begin(), c.end()};
  }
  [[nodiscard]] std::int64_t step_count() const override { return coordinator_.step_count(); }
  [[nodiscard]] int rank() const noexcept override { return coordinator_.rank(); }
  [[nodiscard]] int ranks() const noexcept override { return coordinator_.ranks(); }
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> owned_columns(std::size_t i) const override {
    const auto r = coordinator_.owned_columns(i);
    return {r.first, r.last};
  }
  [[nodiscard]] std::string nvme_status() const override { return coordinator_.host_optimizer().nvme_status(); }
  [[nodiscard]] zenflow::host_memory_bytes host_memory() const override { return coordinator_.host_memory(); }
  void abort(const std::string& reason) noexcept override {
    if constexpr (data_parallel) communicator_->abort(reason);
    (void)reason;
  }

 private:
  stream_type to_stream(void* stream) {
    if constexpr (host) {
      (void)stream;
      return &stream_.stream;
    } else {
      return static_cast<stream_type>(stream);
    }
  }

  // The host "GPU stream" and the communicator outlive the coordinator, whose destructor waits for
  // events on the stream and for its collectives.
  struct host_stream_of {  // the host backend's "GPU stream", its device work on cpu_threads threads
    explicit host_stream_of(const zenflow::coordinator_config& config) : stream(config.cpu_threads) {}
    zenflow::host_stream stream;
  };
  struct no_stream {
    explicit no_stream(const zenflow::coordinator_config&) {}
  };
  [[no_unique_address]] std::conditional_t<host, host_stream_of, no_stream> stream_;
  [[no_unique_address]] std::conditional_t<
      data_parallel, std::unique_ptr<std::conditional_t<data_parallel, Communicator, int>>, std::monostate>
      communicator_;
  Coordinator coordinator_;
};

// The CUDA backend: defined in cuda_coordinator.cu when it is built, else in binding.cpp (they
// throw, saying why it was not built).

/// cuda_coordinator.
std::unique_ptr<handle> make_cuda_handle(const zenflow::zenflow_options& options,
                                         const zenflow::coordinator_config& config);
/// A new NCCL unique id's bytes (rank 0 makes it and sends it to the others).
std::vector<std::byte> make_nccl_unique_id();
/// Rank `rank` of `ranks` of a data-parallel group on an nccl_communicator made from `nccl_id`
/// (the same bytes on every rank), on the current CUDA device. Collective: returns when every rank
/// joined, or throws after `timeout`. `abort_channel` (the process group's Store in the extension;
/// may be null) carries a failing rank's reason to the others, which fail at once with it.
std::unique_ptr<handle> make_cuda_data_parallel_handle(const zenflow::zenflow_options& options,
                                                       const zenflow::coordinator_config& config,
                                                       std::span<const std::byte> nccl_id, int rank, int ranks,
                                                       std::chrono::milliseconds timeout,
                                                       std::shared_ptr<zenflow::abort_channel> abort_channel);

}  // namespace zenflow_torch
