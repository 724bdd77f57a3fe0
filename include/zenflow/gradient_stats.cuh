// The gradient statistics of DEVICE tensors (CUDA): sum of squares and non-finite count, computed
// on the device in stream order and left in device memory, so that the clip factor and the skip
// decision of a step never wait for the host. The host reference is gradient_stats.hpp's.
#pragma once

#include <cuda_runtime.h>

#include <span>

#include "zenflow/gradient_stats.hpp"
#include "zenflow/view.hpp"

namespace zenflow {

/// The result of cuda_gradient_stats, in device memory.
struct gradient_stats_device {
  double sum_of_squares;               ///< sum of g*g (double) over the finite elements
  unsigned long long nonfinite_count;  ///< elements that are +-inf or NaN
};

/// Sum of squares and non-finite count of many DEVICE tensors, written to `out` (device memory)
/// on `stream`; no host synchronization. Each block of 16384 consecutive elements of one tensor
/// (inner dimension fastest) writes a double partial (fixed-order warp and block reduction); a
/// single-block kernel then adds the partials in order: the result is bitwise reproducible run to
/// run. The same blocks as host_gradient_stats (16384 elements of one tensor, in the same memory
/// order), summed inside a block in another fixed order: the two agree within double rounding
/// (the non-finite counts exactly). Uses a
/// stream-ordered scratch allocation (cudaMallocAsync / cudaFreeAsync); launches
/// ceil(tensors / 48) + 1 kernels. Throws ("grads" / "vectors" / "out") for malformed, host or null
/// input before any work.
inline void cuda_gradient_stats(std::span<const const_matrix_view> grads, std::span<const const_vector_view> vectors,
                                gradient_stats_device* out, cudaStream_t stream);

}  // namespace zenflow

#include "zenflow/detail/gradient_stats/cuda_impl.cuh"
