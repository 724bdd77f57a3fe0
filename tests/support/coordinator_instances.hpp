// The host coordinators most tests train, instantiated once per build (coordinator_instances.cpp,
// linked into every unit test) instead of once in every test file that includes this header.
// A coordinator is a few thousand lines of templates: compiled in each of a dozen test files, it
// was most of the test build's time, and three times more under the sanitizers.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>

#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>

namespace zenflow::testing {
// The host backend with a GPU backend's offload (R13 off): each step's CPU columns gathered into
// the gradient staging, unscaled, at submit_gradient (after the first step, away from selection
// boundaries), and accumulated from the staging by the offload worker, which applies the step's
// clip factor. The path of a CUDA backend's schedule,
// run on the host and compared with the host backend's accumulation on its stream. Its CPU
// updates write their results into the copy-out window and upload them through the queue in
// waves (R14 off), as on a GPU, instead of into the write-back staging itself.
struct staged_host_backend : host_backend {
  static constexpr bool accumulates_on_stream = false;
  static constexpr bool copies_out_in_place = false;
  /// Column gathers enqueued so far (by every staged coordinator): when a gradient is offloaded.
  static inline std::atomic<std::int64_t> gathers{0};
  static void gather(const_matrix_view grad, std::span<const std::int32_t> columns, const std::int32_t* columns_dev,
                     void* dst, dtype dst_type, const step_flags* flags, stream_type stream) {
    ++gathers;
    host_backend::gather(grad, columns, columns_dev, dst, dst_type, flags, stream);
  }
};
}  // namespace zenflow::testing

extern template class zenflow::basic_coordinator<zenflow::host_backend>;
extern template class zenflow::basic_coordinator<zenflow::testing::staged_host_backend>;
extern template class zenflow::basic_coordinator<zenflow::host_backend, zenflow::cpu_adam, zenflow::self_communicator>;
