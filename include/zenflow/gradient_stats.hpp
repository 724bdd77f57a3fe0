// The gradient statistics of a step: the sum of squares (for clipping by the global norm) and the
// count of non-finite elements (for skipping a step with a NaN or an infinity), over many tensors
// at once.
//
// This header is the host version, which the coordinator's host backend runs on its stream's
// thread pool and the CUDA version (`gradient_stats.cuh`, device tensors, stream-ordered) is
// tested against. It compiles with a plain C++20 host compiler and synchronizes with nothing
// (there is no device work).
#pragma once

#include <cstdint>
#include <span>

#include "zenflow/host_stream.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

/// Sum of squares and non-finite count over many tensors (host memory).
struct gradient_stats {
  double sum_of_squares = 0.0;       ///< sum of g*g (in double) over the finite elements only
  std::int64_t nonfinite_count = 0;  ///< elements that are +-inf or NaN
};

/// The gradient statistics of host tensors, in a fixed order that depends neither on the thread
/// count nor on the SIMD path (`exec`): each tensor (`grads`, then `vectors`) is read in its memory
/// order (the dimension with the smaller stride inner, as cuda_gradient_stats reads it) and cut
/// into blocks of 16384 elements; in a block, element q's g*g (g converted exactly to double, so
/// the square is exact) is added in double to partial sum q % 16, the 16 partial sums are folded
/// pairwise (lane l + lane l + w for w = 8, 4, 2, 1), and the blocks' sums are added in order,
/// tensor after tensor. Non-finite elements are counted, not added. Throws ("grads" / "vectors")
/// for malformed or device views, ("exec.isa") for a SIMD path this CPU lacks. Synchronous (host
/// only); the blocks spread over exec.pool.
inline gradient_stats host_gradient_stats(std::span<const const_matrix_view> grads,
                                          std::span<const const_vector_view> vectors, const host_execution& exec = {});

}  // namespace zenflow

#include "zenflow/detail/gradient_stats/host_impl.hpp"
