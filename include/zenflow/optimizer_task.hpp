// One tensor's share of a host optimizer's step: what the coordinator hands its CPU optimizer
// (concepts.hpp, host_optimizer R4), whatever the optimizer. cpu_adam's is cpu_adam_task.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "zenflow/types.hpp"

namespace zenflow {

/// One tensor's share of a host optimizer's multi-tensor step (host_optimizer R4), for the
/// optimizer whose hyper-parameter type is HyperParameters. Pointers are host memory (pinned is fine).
template <class HyperParameters>
struct optimizer_task {
  std::size_t tensor = 0;      ///< index returned by add_tensor
  const void* grad = nullptr;  ///< gradient, element type grad_type
  dtype grad_type = dtype::f32;
  std::span<const std::int32_t> columns;  ///< ascending column indices to update; empty = every column
  bool grad_compact = false;              ///< false: grad has the full layout (column c at c*rows);
                                          ///< true: only the listed columns, packed in list order
  void* copy_out = nullptr;               ///< optional: updated params written here (RNE), nullptr: none
  dtype copy_out_type = dtype::bf16;
  bool out_compact = false;  ///< layout of copy_out, as grad_compact is for grad
  /// This task's hyper-parameters (parameter groups); nullptr: the optimizer's options(). The step
  /// count, and so the bias correction, is the optimizer's unless `step` says otherwise.
  const HyperParameters* options = nullptr;
  /// This task's bias-correction step t (1-based), for a caller that counts steps per parameter as
  /// torch does (a parameter without a gradient is left out of a step and does not count it);
  /// 0: the optimizer's, step_count() + 1. The optimizer's own count advances by one per step
  /// either way.
  std::int64_t step = 0;
  /// Multiplies the step's grad_scale for this task's gradient (e.g. 1 / the number of gradients
  /// this parameter accumulated, when parameters accumulated different numbers).
  float grad_scale = 1.0f;
};

}  // namespace zenflow
