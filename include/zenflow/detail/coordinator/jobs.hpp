// The work the coordinator's trainer thread hands to its two workers (offload_worker.hpp,
// update_worker.hpp), under the shared mutex (shared_state.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "zenflow/detail/coordinator/step_flags.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail {

/// Work for the offload worker: one gathered gradient, one accumulated on the stream (on_stream),
/// or a marker (src == nullptr and !on_stream).
template <class Backend>
struct offload_job {
  std::int64_t step = 0;
  std::int64_t interval = 0;
  /// Marker only: every gradient of `interval` has been handed over (else: every gradient of
  /// `step`; with flags == nullptr the step is not counted).
  bool interval_end = false;
  const std::byte* src = nullptr;  ///< the gathered gradient (device memory, compact)
  std::size_t bytes = 0;
  dtype type = dtype::f32;
  float* accumulator = nullptr;         ///< the interval's fp32 accumulator of this parameter's CPU columns
  std::int64_t* accumulated = nullptr;  ///< its count of accumulated steps (+1 once all of it is, unless skipped)
  const step_flags* flags = nullptr;    ///< host copy of the step's flags, valid once *flags_ready completed
  typename Backend::event_type* flags_ready = nullptr;  ///< recorded after the step's flags were written
  typename Backend::event_type* gathered = nullptr;     ///< the gather this copy must wait for
  /// Accumulate times flags->scale (the gradient was gathered unscaled: data parallel, where it is
  /// reduced before the step's flags exist). Otherwise the gather applied it.
  bool scale_by_flags = false;
  /// The backend accumulated it on the stream (gather_accumulate) and counted it: the worker only
  /// waits for `gathered` (src is null; bytes says how much the gradient was).
  bool on_stream = false;
};

/// One parameter's share of a CPU update (HyperParameters: the host optimizer's).
template <class HyperParameters>
struct update_item {
  HyperParameters hyper;                  ///< its hyper-parameters as the interval ended
  std::size_t tensor = 0;                 ///< its tensor in the host optimizer
  std::span<const std::int32_t> columns;  ///< its CPU columns this rank updates, as columns of the tensor (ascending)
  std::size_t rows = 0;                   ///< the tensor's rows (elements per column)
  std::span<float> accumulator;           ///< the interval's accumulated gradient, compact
  /// How many steps it accumulated (the mean's divisor; 0: no gradient in the interval, no update).
  /// Read once the interval is accumulated.
  const std::int64_t* accumulated = nullptr;
  std::int64_t* cpu_steps = nullptr;  ///< its CPU updates so far (bias correction); +1 when updated
  dtype out_type = dtype::f32;        ///< the updated columns' dtype (the parameter's)
  std::byte* device_out = nullptr;    ///< where the write-back reads them from (device memory)
  /// Not null: updated in place (basic_coordinator::updates_in_place). The CPU Adam reads the
  /// gradient at `gradient` (fp32, the whole parameter's column-contiguous layout) times
  /// in_place->scale and writes the updated columns into the parameter at `device_out` (same
  /// layout); `accumulator` is not used.
  const step_flags* in_place = nullptr;
  const void* gradient = nullptr;
};

/// Work for the update worker: the CPU update of one interval.
template <class Backend, class HyperParameters>
struct update_job {
  std::int64_t interval = 0;
  std::vector<update_item<HyperParameters>> items;  ///< the parameters with CPU columns
  /// The write-back that last read this interval's device staging (interval - 2's with overlap_step,
  /// else interval - 1's: basic_coordinator::writeback_of): it must have run before the staging is
  /// refilled.
  typename Backend::event_type* written_back = nullptr;
};

}  // namespace zenflow::detail
