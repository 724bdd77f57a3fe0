// The host execution backend of the coordinator: "device" memory is host memory and a
// host_stream plays the GPU stream, so the whole asynchronous schedule runs (and is tested) on a
// machine without a GPU. Every "device" operation is enqueued on the stream and runs in stream
// order, asynchronously to the caller, exactly where the CUDA backend would launch a kernel, and
// spreads over the stream's thread pool (host_stream::execution) with the CPU Adam's SIMD paths,
// as a kernel spreads over the GPU: one parallel pass per operation, all parameters of a sparse
// step in one, small operations on the stream's thread alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "zenflow/concepts.hpp"
#include "zenflow/detail/coordinator/step_flags.hpp"
#include "zenflow/detail/host_device/columns.hpp"
#include "zenflow/gradient_stats.hpp"
#include "zenflow/host_stream.hpp"
#include "zenflow/importance_selector.hpp"
#include "zenflow/sparse_adam.hpp"
#include "zenflow/transfer_queue.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

/// The host execution backend of basic_coordinator (models coordinator_backend), over the
/// "device" optimizer DeviceOptimizer: host_sparse_adam (`host_backend`), or another optimizer's
/// sparse-column twin (concepts.hpp: host_column_optimizer, what the backend calls on it).
template <host_column_optimizer DeviceOptimizer>
struct basic_host_backend {
  using stream_type = host_stream*;
  using event_type = host_event;
  using selector_type = host_importance_selector<>;
  using device_optimizer_type = DeviceOptimizer;
  using queue_type = host_transfer_queue;
  static constexpr memory_space device_space = memory_space::host;

  /// One "device": nothing to bind on worker threads.
  static int current_device() noexcept { return 0; }
  static void bind_device(int) noexcept {}

  /// Owning "device" allocation (host memory for this backend).
  class device_buffer {
   public:
    device_buffer() = default;
    explicit device_buffer(std::size_t bytes) : bytes_(bytes), data_(bytes ? new std::byte[bytes]() : nullptr) {}
    [[nodiscard]] std::byte* data() const noexcept { return data_.get(); }
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

   private:
    std::size_t bytes_ = 0;
    std::unique_ptr<std::byte[]> data_;
  };
  /// Host memory the "device" writes into asynchronously (mapped pinned memory in the CUDA
  /// backend); device_data() is the address device work writes through.
  class host_buffer : public device_buffer {
   public:
    using device_buffer::device_buffer;
    [[nodiscard]] std::byte* device_data() const noexcept { return this->data(); }
  };

  /// An owned stream of the backend (the coordinator's offload and write-back streams).
  class owned_stream {
   public:
    [[nodiscard]] stream_type get() noexcept { return &stream_; }

   private:
    host_stream stream_;
  };

  /// The stream argument the transfer queues take.
  static host_stream& queue_stream(stream_type stream) noexcept { return *stream; }

  static void record(event_type& event, stream_type stream) { event.record(*stream); }
  static void wait(stream_type stream, const event_type& event) { stream->wait(event); }
  static void synchronize(const event_type& event) { event.synchronize(); }
  static void synchronize(stream_type stream) { stream->synchronize(); }

  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_type stream) {
    if (bytes == 0) return;
    stream->enqueue([=] { std::memcpy(dst, src, bytes); });
  }

  /// Global gradient statistics of the step, then the flags (make_step_flags) into `flags` and
  /// `flags_host`, in one task on `stream`: no scratch.
  static constexpr std::size_t statistics_scratch_bytes = 0;

  static void step_statistics(std::span<const const_matrix_view> matrices, std::span<const const_vector_view> vectors,
                              float max_norm, step_flags* flags, step_flags* flags_host, std::byte* /*scratch*/,
                              stream_type stream) {
    std::vector<const_matrix_view> m(matrices.begin(), matrices.end());
    std::vector<const_vector_view> v(vectors.begin(), vectors.end());
    stream->enqueue([m = std::move(m), v = std::move(v), max_norm, flags, flags_host, stream] {
      const gradient_stats stats = host_gradient_stats(m, v, stream->execution());
      *flags = *flags_host = make_step_flags(stats.sum_of_squares, stats.nonfinite_count > 0, max_norm);
    });
  }

  static void device_step(device_optimizer_type& opt, std::span<const const_matrix_view> matrices,
                          std::span<const const_vector_view> vectors, const step_flags* flags, stream_type stream) {
    std::vector<const_matrix_view> m(matrices.begin(), matrices.end());
    std::vector<const_vector_view> v(vectors.begin(), vectors.end());
    stream->enqueue([&opt, m = std::move(m), v = std::move(v), flags, stream] {
      opt.step(m, v, 1.0f, &flags->scale, &flags->skip, false, stream->execution());
    });
  }

  /// Parameter `index`'s hyper-parameters for the device steps enqueued after this call.
  static void set_options(device_optimizer_type& opt, std::size_t index,
                          const typename device_optimizer_type::hyper_parameters& options, stream_type stream) {
    stream->enqueue([&opt, index, options] { opt.set_options(index, options); });
  }

  /// dst (compact) = grad's `columns` * flags->scale, in `dst_type`.
  static void gather(const_matrix_view grad, std::span<const std::int32_t> columns, const std::int32_t* /*columns_dev*/,
                     void* dst, dtype dst_type, const step_flags* flags, stream_type stream) {
    stream->enqueue([=] { gather_columns(grad, columns, dst, dst_type, flags->scale, stream->execution()); });
  }
  /// The offload of one process's step on the stream, straight from the trainer's gradient (R13):
  /// unless flags->skip, `acc` (compact fp32) = fma(flags->scale, grad's `columns`, acc) in fp32
  /// (stores scale * grad when *accumulated == 0: the parameter's first step of the interval),
  /// then ++*accumulated. The same bits as an unscaled gather followed by the offload worker's
  /// accumulation of the staging scaled by the flags, with neither the staging (2 x the CPU
  /// columns' gradient) nor its two passes.
  static constexpr bool accumulates_on_stream = true;
  static void gather_accumulate(const_matrix_view grad, std::span<const std::int32_t> columns, float* acc,
                                std::int64_t* accumulated, const step_flags* flags, stream_type stream) {
    stream->enqueue([=] {
      if (flags->skip) return;
      namespace hd = detail::host_device;
      const host_execution exec = stream->execution();
      hd::gather_accumulate(
          {grad.data, grad.type, grad.row_stride, grad.col_stride, columns.data(), hd::max_column(columns)}, grad.rows,
          static_cast<index_t>(columns.size()), flags->scale, acc, *accumulated == 0, exec,
          hd::checked_isa(exec, "exec.isa"));
      ++*accumulated;
    });
  }
  /// param's `columns` = compact src (converted to the parameter's dtype).
  static void scatter(const void* src, dtype src_type, std::span<const std::int32_t> columns,
                      const std::int32_t* /*columns_dev*/, matrix_view param, stream_type stream) {
    stream->enqueue([=] { scatter_columns(src, src_type, columns, param, stream->execution()); });
  }

  // --- data parallel (data_parallel_backend) ---

  /// The selector reducing its scores through ScoreCommunicator.
  template <class ScoreCommunicator>
  using selector_with = host_importance_selector<ScoreCommunicator>;

  /// This rank's share of the statistics: out[0] = sum of squares, out[1] = non-finite count.
  static void partial_statistics(std::span<const const_matrix_view> matrices,
                                 std::span<const const_vector_view> vectors, double* out, std::byte* /*scratch*/,
                                 stream_type stream) {
    std::vector<const_matrix_view> m(matrices.begin(), matrices.end());
    std::vector<const_vector_view> v(vectors.begin(), vectors.end());
    stream->enqueue([m = std::move(m), v = std::move(v), out, stream] {
      const gradient_stats stats = host_gradient_stats(m, v, stream->execution());
      out[0] = stats.sum_of_squares;
      out[1] = static_cast<double>(stats.nonfinite_count);
    });
  }
  /// The flags from the statistics summed over `ranks` ranks (make_mean_step_flags).
  static void mean_step_flags(const double* stats, int ranks, float max_norm, step_flags* flags, step_flags* flags_host,
                              stream_type stream) {
    stream->enqueue([=] { *flags = *flags_host = make_mean_step_flags(stats[0], stats[1], ranks, max_norm); });
  }

  /// Scores and selects from the step's gradients. Synchronizes with `stream` first.
  template <class Selector>
  static void select(Selector& selector, std::span<const const_matrix_view> grads, stream_type stream) {
    stream->synchronize();
    selector.select(grads);
  }
  static void reselect(device_optimizer_type& opt, std::size_t index, std::span<const std::int32_t> selection,
                       std::span<const float> entering, std::span<float> leaving, stream_type stream) {
    stream->synchronize();
    opt.reselect(index, selection, entering, leaving, stream->execution());
  }
  static std::size_t add_matrix(device_optimizer_type& opt, matrix_view param, std::span<const std::int32_t> selection,
                                std::span<const float> packed, stream_type stream) {
    stream->synchronize();
    return opt.add_matrix(param, selection, packed, stream->execution());
  }
  static std::size_t add_vector(device_optimizer_type& opt, vector_view param, std::span<const float> initial) {
    return opt.add_vector(param, initial);
  }
};

/// The host execution backend with the library's sparse-column Adam.
using host_backend = basic_host_backend<host_sparse_adam>;

}  // namespace zenflow
