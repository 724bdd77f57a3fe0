// CUDA kernels of the gradient statistics (nvcc only; see gradient_stats.cuh for the launch).
//
// Partials (one launch per batch of up to 48 tensors): each block sums the squares of the finite
// elements and counts the non-finite ones among 16384 consecutive elements of one tensor (inner
// dimension fastest; 16-byte vector loads when the tensor is a flat, aligned array), in double, and
// writes one partial per block after a fixed-order warp and block reduction. Final (one block):
// adds the partials in order. The result is bitwise reproducible run to run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "zenflow/config.hpp"
#include "zenflow/detail/cuda/loads.cuh"
#include "zenflow/detail/gradient_stats/math.hpp"
#include "zenflow/types.hpp"

namespace zenflow::detail::stats {

inline constexpr int stats_threads = 256;
inline constexpr long long stats_chunk = 16384;  // elements per stats block
inline constexpr int stats_final_threads = 1024;

/// One tensor of the statistics launch (a vector is a 1 x size matrix).
struct stats_tensor {
  const void* data;
  long long inner_n, outer_n, inner_stride, outer_stride;
  long long first_chunk;  ///< relative to the batch's partial_base
  int type;
  int contiguous;  ///< inner_stride == 1 and outer_stride == inner_n: a flat array
};
inline constexpr int stats_max_tensors = 48;  // keeps the kernel parameter under 4 KiB
struct stats_batch {
  stats_tensor tensors[stats_max_tensors];
  int count;
  long long partial_base;
};

/// Deterministic block sum: xor-butterfly per warp, then the warps in order by thread 0.
template <class U, int Threads>
ZENFLOW_DEVICE U block_sum_ordered(U x, U* shared) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = x;
  __syncthreads();
  U total{};
  if (threadIdx.x == 0)
    for (int w = 0; w < Threads / 32; ++w) total += shared[w];
  return total;  // valid in thread 0
}

template <class T>
ZENFLOW_DEVICE void stats_chunk_sum(const stats_tensor& t, long long chunk, double& sum, unsigned long long& bad) {
  const long long n = t.inner_n * t.outer_n;
  const long long e_begin = chunk * stats_chunk;
  const long long e_end = e_begin + stats_chunk < n ? e_begin + stats_chunk : n;
  const T* base = static_cast<const T*>(t.data);
  auto add = [&](float x) {
    if (is_nonfinite_bits(__float_as_uint(x))) {
      ++bad;
    } else {
      const double v = x;
      sum += v * v;  // exact square: nvcc's contraction to fma(v, v, sum) changes no bit (adam_math.hpp)
    }
  };
  constexpr int V = vec_elems<T>;
  if (t.contiguous && (reinterpret_cast<std::uintptr_t>(base) % 16 == 0)) {
    const long long v_end = e_begin + (e_end - e_begin) / V * V;  // e_begin is a multiple of V
#pragma unroll 2
    for (long long e = e_begin + static_cast<long long>(threadIdx.x) * V; e < v_end; e += stats_threads * V) {
      float x[V];
      load_vec16<T>(base + e, x);
#pragma unroll
      for (int v = 0; v < V; ++v) add(x[v]);
    }
    for (long long e = v_end + threadIdx.x; e < e_end; e += stats_threads) add(load_element(base + e));
  } else {
    for (long long e = e_begin + threadIdx.x; e < e_end; e += stats_threads) {
      const long long outer = e / t.inner_n, inner = e - outer * t.inner_n;
      add(load_element(base + outer * t.outer_stride + inner * t.inner_stride));
    }
  }
}

static __global__ void __launch_bounds__(stats_threads)
    stats_partials_kernel(stats_batch batch, double* partial_sum, unsigned long long* partial_bad) {
  __shared__ double shared_sum[stats_threads / 32];
  __shared__ unsigned long long shared_bad[stats_threads / 32];
  const long long block = blockIdx.x;
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.tensors[mid].first_chunk <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  const stats_tensor& t = batch.tensors[lo];
  double sum = 0.0;
  unsigned long long bad = 0;
  switch (static_cast<dtype>(t.type)) {
    case dtype::bf16:
      stats_chunk_sum<bfloat16>(t, block - t.first_chunk, sum, bad);
      break;
    case dtype::f16:
      stats_chunk_sum<float16>(t, block - t.first_chunk, sum, bad);
      break;
    default:
      stats_chunk_sum<float>(t, block - t.first_chunk, sum, bad);
      break;
  }
  sum = block_sum_ordered<double, stats_threads>(sum, shared_sum);
  bad = block_sum_ordered<unsigned long long, stats_threads>(bad, shared_bad);
  if (threadIdx.x == 0) {
    partial_sum[batch.partial_base + block] = sum;
    partial_bad[batch.partial_base + block] = bad;
  }
}

template <class Out>
__global__ void __launch_bounds__(stats_final_threads)
    stats_final_kernel(const double* partial_sum, const unsigned long long* partial_bad, long long n, Out* out) {
  __shared__ double shared_sum[stats_final_threads / 32];
  __shared__ unsigned long long shared_bad[stats_final_threads / 32];
  double sum = 0.0;
  unsigned long long bad = 0;
  for (long long i = threadIdx.x; i < n; i += stats_final_threads) sum += partial_sum[i], bad += partial_bad[i];
  sum = block_sum_ordered<double, stats_final_threads>(sum, shared_sum);
  bad = block_sum_ordered<unsigned long long, stats_final_threads>(bad, shared_bad);
  if (threadIdx.x == 0) {
    out->sum_of_squares = sum;
    out->nonfinite_count = bad;
  }
}

}  // namespace zenflow::detail::stats
