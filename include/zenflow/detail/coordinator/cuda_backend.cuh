// The CUDA execution backend of the coordinator: maps each "device" operation of the schedule
// (basic_coordinator, coordinator.hpp) onto the CUDA components. The gradient statistics and the
// per-step flags (clip factor, skip) stay on the device, the sparse-column Adam and the column
// gather/scatter run on the trainer's stream, offload and write-back copies go through pinned
// transfer queues on their own non-blocking streams. No operation synchronizes the device; the
// trainer's stream is only synchronized where the schedule asks for it (selection boundaries,
// finish() and checkpoints).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <utility>

#include "zenflow/concepts.hpp"
#include "zenflow/detail/coordinator/step_flags.hpp"
#include "zenflow/detail/cuda/memory.cuh"
#include "zenflow/error.hpp"
#include "zenflow/gradient_stats.cuh"
#include "zenflow/importance_selector.cuh"
#include "zenflow/sparse_adam.cuh"
#include "zenflow/transfer_queue.cuh"
#include "zenflow/view.hpp"

namespace zenflow {

namespace detail {
/// One thread turns the device-side gradient statistics into the step's flags (make_step_flags,
/// the host backend's rule), written to device memory (for the step's kernels) and straight into
/// mapped pinned host memory (for the offload worker): no copy on the trainer's stream, which could
/// queue behind the offload's large copies on a copy engine.
static __global__ void make_step_flags_kernel(const gradient_stats_device* stats, float max_norm, step_flags* flags,
                                              step_flags* flags_host) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const step_flags f =
      make_step_flags(static_cast<double>(stats->sum_of_squares), stats->nonfinite_count > 0, max_norm);
  *flags = f;
  *flags_host = f;
  __threadfence_system();  // visible to the host once an event after this kernel completed
}
/// One thread copies this rank's statistics into two doubles (the all-reduced form).
static __global__ void partial_statistics_kernel(const gradient_stats_device* stats, double* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  out[0] = stats->sum_of_squares;
  out[1] = static_cast<double>(stats->nonfinite_count);
}
/// One thread turns the statistics summed over the ranks into the flags (make_mean_step_flags).
static __global__ void make_mean_step_flags_kernel(const double* stats, int ranks, float max_norm, step_flags* flags,
                                                   step_flags* flags_host) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const step_flags f = make_mean_step_flags(stats[0], stats[1], ranks, max_norm);
  *flags = f;
  *flags_host = f;
  __threadfence_system();
}
}  // namespace detail

/// The CUDA execution backend of basic_coordinator (models coordinator_backend).
struct cuda_backend {
  using stream_type = cudaStream_t;
  using selector_type = cuda_importance_selector<>;
  using device_optimizer_type = cuda_sparse_adam;
  /// The coordinator's queues. Their consumers are its worker threads, which wait while the CPU
  /// Adam's thread pool runs: they sleep (event_wait::block) rather than spin on a core the pool
  /// needs.
  class queue_type : public cuda_transfer_queue {
   public:
    queue_type(transfer_direction direction, std::size_t slot_bytes, std::size_t slot_count)
        : cuda_transfer_queue(direction, slot_bytes, slot_count, pinned_allocation::host_alloc, event_wait::block) {}
  };
  static constexpr memory_space device_space = memory_space::device;

  /// Device memory (cudaMalloc): the column lists, staging and write-back buffers.
  using device_buffer = detail::cuda_device_buffer;
  /// Mapped pinned host memory kernels write into directly (the per-step flags): data() for the
  /// host, device_data() for kernels.
  using host_buffer = detail::cuda_mapped_host_buffer;
  /// An event created on first use (timing disabled; waiters sleep, like the queues' consumers).
  class event_type : public detail::cuda_event {
   public:
    event_type() noexcept : cuda_event(cudaEventDisableTiming | cudaEventBlockingSync) {}
  };
  /// A non-blocking stream owned by the coordinator.
  using owned_stream = detail::cuda_stream;

  /// The calling thread's current device; bind_device makes it a worker thread's current device.
  static int current_device() {
    int device = 0;
    ZENFLOW_CUDA_TRY(cudaGetDevice(&device));
    return device;
  }
  static void bind_device(int device) noexcept { ZENFLOW_CUDA_ASSERT(cudaSetDevice(device)); }
  /// What every public call of the coordinator runs under: its device current, the caller's
  /// restored after (a trainer may drive several GPUs from one thread, torch changes the current
  /// device between calls).
  using device_scope = detail::cuda_device_scope;

  /// The stream argument the transfer queues take.
  static cudaStream_t queue_stream(stream_type stream) noexcept { return stream; }

  static void record(event_type& event, stream_type stream) { event.record(stream); }
  static void wait(stream_type stream, event_type& event) { event.wait(stream); }
  static void synchronize(event_type& event) { event.synchronize(); }
  static void synchronize(stream_type stream) { ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream)); }

  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_type stream) {
    if (bytes != 0) ZENFLOW_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  }

  /// Device scratch the coordinator owns for step_statistics.
  static constexpr std::size_t statistics_scratch_bytes = sizeof(gradient_stats_device);

  /// Global gradient statistics of the step into `scratch`, then the flags (a one-thread kernel)
  /// into `flags` (device) and `flags_host` (a host_buffer's device_data()). Asynchronous on
  /// `stream`.
  static void step_statistics(std::span<const const_matrix_view> matrices, std::span<const const_vector_view> vectors,
                              float max_norm, step_flags* flags, step_flags* flags_host, std::byte* scratch,
                              stream_type stream) {
    auto* stats = reinterpret_cast<gradient_stats_device*>(scratch);
    cuda_gradient_stats(matrices, vectors, stats, stream);
    detail::make_step_flags_kernel<<<1, 1, 0, stream>>>(stats, max_norm, flags, flags_host);
    ZENFLOW_CUDA_TRY(cudaGetLastError());
  }

  static void device_step(device_optimizer_type& opt, std::span<const const_matrix_view> matrices,
                          std::span<const const_vector_view> vectors, const step_flags* flags, stream_type stream) {
    opt.step(matrices, vectors, 1.0f, &flags->scale, &flags->skip, false, stream);
  }
  /// The coordinator's own column lists, staging and flags (device memory it allocated): launched
  /// without cuda_gather_columns' pointer checks, which would cost a cudaPointerGetAttributes each
  /// per parameter and step. The gradient was checked when it was submitted.
  static void gather(const_matrix_view grad, std::span<const std::int32_t> columns, const std::int32_t* columns_dev,
                     void* dst, dtype dst_type, const step_flags* flags, stream_type stream) {
    detail::sparse_adam::launch_gather_columns(grad, std::span<const std::int32_t>(columns_dev, columns.size()), dst,
                                               dst_type, 1.0f, &flags->scale, stream);
  }
  static void scatter(const void* src, dtype src_type, std::span<const std::int32_t> columns,
                      const std::int32_t* columns_dev, matrix_view param, stream_type stream) {
    detail::sparse_adam::launch_scatter_columns(
        src, src_type, std::span<const std::int32_t>(columns_dev, columns.size()), param, stream);
  }
  // --- data parallel (data_parallel_backend) ---

  /// The selector reducing its scores (device memory, on the stream) through ScoreCommunicator.
  template <class ScoreCommunicator>
  using selector_with = cuda_importance_selector<ScoreCommunicator>;

  /// This rank's share of the statistics into out[0..1] (device memory), via `scratch`.
  static void partial_statistics(std::span<const const_matrix_view> matrices,
                                 std::span<const const_vector_view> vectors, double* out, std::byte* scratch,
                                 stream_type stream) {
    auto* stats = reinterpret_cast<gradient_stats_device*>(scratch);
    cuda_gradient_stats(matrices, vectors, stats, stream);
    detail::partial_statistics_kernel<<<1, 1, 0, stream>>>(stats, out);
    ZENFLOW_CUDA_TRY(cudaGetLastError());
  }
  static void mean_step_flags(const double* stats, int ranks, float max_norm, step_flags* flags, step_flags* flags_host,
                              stream_type stream) {
    detail::make_mean_step_flags_kernel<<<1, 1, 0, stream>>>(stats, ranks, max_norm, flags, flags_host);
    ZENFLOW_CUDA_TRY(cudaGetLastError());
  }

  template <class Selector>
  static void select(Selector& selector, std::span<const const_matrix_view> grads, stream_type stream) {
    selector.select(grads, stream);
  }
  /// Parameter `index`'s hyper-parameters for the launches after this call (they are read when a
  /// step is enqueued, so stream order holds).
  static void set_options(device_optimizer_type& opt, std::size_t index, const adam_options& options,
                          stream_type /*stream*/) {
    opt.set_options(index, options);
  }
  static void reselect(device_optimizer_type& opt, std::size_t index, std::span<const std::int32_t> selection,
                       std::span<const float> entering, std::span<float> leaving, stream_type stream) {
    opt.reselect(index, selection, entering, leaving, stream);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
  }
  static std::size_t add_matrix(device_optimizer_type& opt, matrix_view param, std::span<const std::int32_t> selection,
                                std::span<const float> packed, stream_type stream) {
    const auto i = opt.add_matrix(param, selection, packed, stream);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(stream));
    return i;
  }
  /// Registration has no trainer stream: the upload runs on the default stream and completes
  /// here, so the trainer's (non-blocking) stream never races it.
  static std::size_t add_vector(device_optimizer_type& opt, vector_view param, std::span<const float> initial) {
    const auto i = opt.add_vector(param, initial, nullptr);
    ZENFLOW_CUDA_TRY(cudaStreamSynchronize(nullptr));
    return i;
  }
};

static_assert(coordinator_backend<cuda_backend>);
static_assert(data_parallel_backend<cuda_backend>);

}  // namespace zenflow
