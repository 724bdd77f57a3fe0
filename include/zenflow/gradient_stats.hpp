// The gradient statistics of a step: the sum of squares (for clipping by the global norm) and the
// count of non-finite elements (for skipping a step with a NaN or an infinity), over many tensors
// at once.
//
// This header is the host reference, which the coordinator's host backend uses and the CUDA
// version (`gradient_stats.cuh`, device tensors, stream-ordered) is tested against. It compiles
// with a plain C++20 host compiler and synchronizes with nothing (there is no device work).
#pragma once

#include <cstdint>
#include <span>

#include "zenflow/view.hpp"

namespace zenflow {

/// Sum of squares and non-finite count over many tensors (host memory).
struct gradient_stats {
  double sum_of_squares = 0.0;       ///< sum of g*g (in double) over the finite elements only
  std::int64_t nonfinite_count = 0;  ///< elements that are +-inf or NaN
};

/// Host reference of the gradient statistics: tensors in order (`grads`, then `vectors`), each in
/// its logical order (row r, then column c; vector element i), g converted exactly to double,
/// squared and added in double. Throws ("grads" / "vectors") for malformed or device views.
/// Deterministic; synchronous (host only).
inline gradient_stats host_gradient_stats(std::span<const const_matrix_view> grads,
                                          std::span<const const_vector_view> vectors);

}  // namespace zenflow

#include "zenflow/detail/gradient_stats/host_impl.hpp"
