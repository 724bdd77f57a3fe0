// The per-step flags of the coordinator and the one rule that makes them from the step's gradient
// statistics. The host backend calls make_step_flags on its stream's worker thread, the CUDA
// backend from a one-thread kernel: both compute exactly this, so the two backends clip and skip
// the same steps by the same factors.
#pragma once

#include <cmath>

#include "zenflow/config.hpp"

namespace zenflow {

/// Per-step decisions computed on the "device" from the gradient statistics: the factor every
/// gradient of the step is multiplied by (clipping), and whether the step is skipped (a NaN/Inf).
struct step_flags {
  float scale = 1.0f;      ///< multiplies every gradient of the step (1 unless clipped)
  int skip = 0;            ///< 1: a gradient of the step holds a NaN/Inf; nothing is updated or accumulated
  double grad_norm = 0.0;  ///< the global L2 norm of the step's gradients (both paths together)
};

/// The flags of a step whose gradients have `sum_of_squares` (of the finite elements) and
/// `any_nonfinite` elements that are NaN/Inf: skip when a value is not finite; otherwise
/// scale = max_norm / (norm + 1e-6) when max_norm > 0 and the norm exceeds it, else 1.
/// Host and device code.
ZENFLOW_HOST_DEVICE inline step_flags make_step_flags(double sum_of_squares, bool any_nonfinite,
                                                      float max_norm) noexcept {
  step_flags f;
#if ZENFLOW_IS_DEVICE_CODE
  f.grad_norm = sqrt(sum_of_squares);
  f.skip = any_nonfinite || !isfinite(sum_of_squares);
#else
  f.grad_norm = std::sqrt(sum_of_squares);
  f.skip = any_nonfinite || !std::isfinite(sum_of_squares);
#endif
  f.scale = (max_norm > 0.0f && !f.skip && f.grad_norm > max_norm)
                ? static_cast<float>(static_cast<double>(max_norm) / (f.grad_norm + 1e-6))
                : 1.0f;
  return f;
}

/// The flags of a data-parallel step over `ranks` ranks, from statistics of the gradients summed
/// over the ranks (sum_of_squares and nonfinite_count themselves summed over the ranks' shares).
/// The step's gradient is the mean, sum / ranks: its norm is the sum's norm / ranks, so the clip
/// decision is make_step_flags' on sum_of_squares / ranks^2, and `scale` is that clip factor
/// divided by `ranks` (what turns a summed gradient into the clipped mean). Host and device code.
ZENFLOW_HOST_DEVICE inline step_flags make_mean_step_flags(double sum_of_squares, double nonfinite_count, int ranks,
                                                           float max_norm) noexcept {
  const double n = static_cast<double>(ranks);
  step_flags f = make_step_flags(sum_of_squares / (n * n), nonfinite_count > 0.0, max_norm);
  f.scale = static_cast<float>(static_cast<double>(f.scale) / n);
  return f;
}

}  // namespace zenflow
